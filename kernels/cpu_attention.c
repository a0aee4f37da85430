// A CPU decode step's attention for one layer in one call: rotate q and k (HF's rotate_half with
// the step's cos/sin tables), write k and v into their paged-cache slots, attend each decode's
// query over its sequence's blocks. kernels/cpu_attention.py builds this file and holds the
// torch reference; engine/attention/torch_backend.py calls it for steps made only of decodes.
//
//   cache  [2, num_blocks, block_size, Hkv, D]: K then V; slot = block * block_size + offset
//   q      [T, H, D], k and v [T, Hkv, D]: rows `ld` elements apart, heads D apart
//   out    [T, H, D] contiguous
//
// The decodes' G = H / Hkv query heads that share a kv head are one task: each key row is read
// once for the G of them. A task walks its sequence's blocks with the online softmax (a running
// max m, sum l and weighted sum acc per query head; a block's scores rescale them once):
//
//   s_j = scale q . k_j;  m' = max(m, s_j over the block);  l = l e^(m - m') + sum_j e^(s_j - m')
//   acc = acc e^(m - m') + sum_j e^(s_j - m') v_j;           out = acc / l
//
// All arithmetic is in fp32. In bf16, rotated q and k are rounded to bf16 first, as the torch
// path holds them, and the output is rounded once. e^x is kernels/cpu_exp.h's.

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { MAX_D = 256, MAX_G = 16, MAX_BS = 128 };
enum { ERR_SHAPE = -1, ERR_SLOT = -2, ERR_BLOCK = -3 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to()
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_row(float *dst, const void *src, ptrdiff_t i, int n, int dt) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)src + i, (size_t)n * 4);
    } else {
        const uint16_t *s = (const uint16_t *)src + i;
#pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    }
}

static inline void store_row(void *dst, ptrdiff_t i, const float *src, int n, int dt) {
    if (dt == DT_F32) {
        memcpy((float *)dst + i, src, (size_t)n * 4);
    } else {
        uint16_t *o = (uint16_t *)dst + i;
        for (int d = 0; d < n; d++) o[d] = f32_to_bf16(src[d]);
    }
}

static inline void round_row(float *x, int n, int dt) {  // to what the dtype holds
    if (dt == DT_BF16)
        for (int d = 0; d < n; d++) x[d] = bf16_to_f32(f32_to_bf16(x[d]));
}

// x rotated by the token's cos/sin (fp32 rows of D): x cos + rotate_half(x) sin
static inline void rotate(float *x, const float *c, const float *s, int D) {
    const int half = D / 2;
    float r[MAX_D];
    for (int d = 0; d < half; d++) r[d] = x[d] * c[d] - x[d + half] * s[d];
    for (int d = half; d < D; d++) r[d] = x[d] * c[d] + x[d - half] * s[d];
    memcpy(x, r, (size_t)D * 4);
}

static inline const float *key_row(const void *base, ptrdiff_t i, int D, int dt, float *buf) {
    if (dt == DT_F32) return (const float *)base + i;
    load_row(buf, base, i, D, dt);
    return buf;
}

// One decode's G query heads of kv head h over its keys in blocks [b0, b1) of its table (L keys
// in all); qf already rotated, in fp32. Leaves the unnormalised acc and each head's running max
// m and sum l (m = -inf, l = 0 for an empty range). Inlined into `attend_d` with D a constant
// (the usual head sizes), so that the loops over D unroll into whole vectors.
static inline __attribute__((always_inline)) int attend(
    int dt, int G, int Hkv, int D, int h, const float (*qf)[MAX_D], float scale, const void *kc,
    const void *vc, int64_t num_blocks, int bs, const int32_t *table, int L, int b0, int b1,
    float (*acc)[MAX_D], float *m, float *l) {
    float s[MAX_G][MAX_BS], kbuf[MAX_D], vbuf[MAX_D];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc[g], 0, (size_t)D * 4);
    }
    for (int b = b0; b < b1; b++) {
        const int64_t blk = table[b];
        if (blk < 0 || blk >= num_blocks) return ERR_BLOCK;
        const int n = L - b * bs < bs ? L - b * bs : bs;
        const ptrdiff_t row0 = ((ptrdiff_t)blk * bs * Hkv + h) * D;  // key 0 of the block
        for (int j = 0; j < n; j++) {
            const float *k = key_row(kc, row0 + (ptrdiff_t)j * Hkv * D, D, dt, kbuf);
            for (int g = 0; g < G; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qf[g][d] * k[d];
                s[g][j] = dot * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
            const float corr = m[g] == -INFINITY ? 0.0f : exp_poly(m[g] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) {
                s[g][j] = exp_poly(s[g][j] - mx);
                sum += s[g][j];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mx;
            if (corr != 1.0f)
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g][d] *= corr;
        }
        for (int j = 0; j < n; j++) {
            const float *v = key_row(vc, row0 + (ptrdiff_t)j * Hkv * D, D, dt, vbuf);
            for (int g = 0; g < G; g++) {
                const float p = s[g][j];
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g][d] += p * v[d];
            }
        }
    }
    return 0;
}

static int attend_d(int dt, int G, int Hkv, int D, int h, const float (*qf)[MAX_D], float scale,
                    const void *kc, const void *vc, int64_t num_blocks, int bs,
                    const int32_t *table, int L, int b0, int b1, float (*acc)[MAX_D], float *m,
                    float *l) {
    if (D == 64)
        return attend(dt, G, Hkv, 64, h, qf, scale, kc, vc, num_blocks, bs, table, L, b0, b1,
                      acc, m, l);
    if (D == 128)
        return attend(dt, G, Hkv, 128, h, qf, scale, kc, vc, num_blocks, bs, table, L, b0, b1,
                      acc, m, l);
    return attend(dt, G, Hkv, D, h, qf, scale, kc, vc, num_blocks, bs, table, L, b0, b1, acc, m,
                  l);
}

// cos, sin: [T, D] rows rope_ld apart in dt, or NULL (no rotation). slots [T] int64,
// tables [T, table_ld] int32, seq_lens [T] int32. Returns 0, or a negative ERR_* (the
// attention's output is then undefined; the stores of rows before a bad slot are made).
//
// Fewer (decode, kv head) tasks than twice the threads (a single stream: Hkv tasks) would leave
// threads idle, so each task's blocks are then split into `parts` ranges (flash-decoding's
// split-K): every part leaves its (m, l, acc) in `scratch`, and the parts merge as
//   M = max_p m_p,   out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
int cpu_paged_decode(int dt, int T, int H, int Hkv, int D,
                     const void *q, ptrdiff_t q_ld, const void *k, ptrdiff_t k_ld,
                     const void *v, ptrdiff_t v_ld, const void *cos, const void *sin,
                     ptrdiff_t rope_ld, void *cache, int64_t num_blocks, int bs,
                     const int64_t *slots, const int32_t *tables, ptrdiff_t table_ld,
                     const int32_t *seq_lens, float scale, void *out, int nthreads) {
    if (D > MAX_D || D % 2 || H % Hkv || H / Hkv > MAX_G || bs > MAX_BS || bs < 1)
        return ERR_SHAPE;
    const int G = H / Hkv;
    const ptrdiff_t plane = (ptrdiff_t)num_blocks * bs * Hkv * D;  // K's elements; V's follow
    const size_t esize = dt == DT_F32 ? 4 : 2;
    void *vcache = (char *)cache + plane * esize;
    // the new tokens' K (rotated) and V into their slots, before any task reads them
    int max_blocks = 0;
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= (int64_t)num_blocks * bs) return ERR_SLOT;
        const int nb = (seq_lens[t] + bs - 1) / bs;
        max_blocks = nb > max_blocks ? nb : max_blocks;
        float c[MAX_D], sn[MAX_D], x[MAX_D];
        if (cos) {
            load_row(c, cos, t * rope_ld, D, dt);
            load_row(sn, sin, t * rope_ld, D, dt);
        }
        for (int h = 0; h < Hkv; h++) {
            const ptrdiff_t dst = (slot * Hkv + h) * D;
            load_row(x, k, t * k_ld + (ptrdiff_t)h * D, D, dt);
            if (cos) rotate(x, c, sn, D);
            store_row(cache, dst, x, D, dt);
            memcpy((char *)vcache + dst * esize, (const char *)v + (t * v_ld + h * D) * esize,
                   (size_t)D * esize);
        }
    }
    const long work = (long)T * Hkv;
    int parts = work >= 2L * nthreads ? 1 : (int)((2L * nthreads + work - 1) / work);
    parts = parts > max_blocks ? max_blocks : parts;
    parts = parts < 1 ? 1 : parts;
    const size_t part_floats = (size_t)G * (D + 2);  // acc [G][D], then m [G], l [G]
    float *scratch = parts > 1 ? malloc(work * parts * part_floats * sizeof(float)) : NULL;
    if (parts > 1 && !scratch) parts = 1;
    int status = 0;
#pragma omp parallel num_threads(nthreads) if (work * parts > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (long sub = 0; sub < work * parts; sub++) {
            const long task = sub / parts;
            const int part = (int)(sub % parts);
            const int t = (int)(task / Hkv), h = (int)(task % Hkv);
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], c[MAX_D], sn[MAX_D];
            if (cos) {
                load_row(c, cos, t * rope_ld, D, dt);
                load_row(sn, sin, t * rope_ld, D, dt);
            }
            for (int g = 0; g < G; g++) {
                load_row(qf[g], q, t * q_ld + (ptrdiff_t)(h * G + g) * D, D, dt);
                if (cos) {
                    rotate(qf[g], c, sn, D);
                    round_row(qf[g], D, dt);
                }
            }
            const int L = seq_lens[t], nb = (L + bs - 1) / bs, per = (nb + parts - 1) / parts;
            const int b0 = part * per < nb ? part * per : nb;
            const int b1 = b0 + per < nb ? b0 + per : nb;
            const int err = attend_d(dt, G, Hkv, D, h, (const float(*)[MAX_D])qf, scale, cache,
                                     vcache, num_blocks, bs, tables + t * table_ld, L, b0, b1,
                                     acc, m, l);
            if (err) {
#pragma omp atomic write
                status = err;
                continue;
            }
            if (parts == 1) {
                for (int g = 0; g < G; g++) {
                    const float inv = 1.0f / l[g];
                    for (int d = 0; d < D; d++) acc[g][d] *= inv;
                    store_row(out, ((ptrdiff_t)t * H + h * G + g) * D, acc[g], D, dt);
                }
                continue;
            }
            float *dst = scratch + sub * part_floats;
            for (int g = 0; g < G; g++) memcpy(dst + (size_t)g * D, acc[g], (size_t)D * 4);
            memcpy(dst + (size_t)G * D, m, (size_t)G * 4);
            memcpy(dst + (size_t)G * D + G, l, (size_t)G * 4);
        }
        if (parts > 1 && !status) {
#pragma omp for schedule(static)
            for (long task = 0; task < work; task++) {
                const int t = (int)(task / Hkv), h = (int)(task % Hkv);
                const float *first = scratch + task * parts * part_floats;
                for (int g = 0; g < G; g++) {
                    float M = -INFINITY, sum = 0.0f, o[MAX_D];
                    for (int p = 0; p < parts; p++) {
                        const float mp = first[p * part_floats + (size_t)G * D + g];
                        M = mp > M ? mp : M;
                    }
                    memset(o, 0, (size_t)D * 4);
                    for (int p = 0; p < parts; p++) {
                        const float *part = first + p * part_floats;
                        const float mp = part[(size_t)G * D + g];
                        if (mp == -INFINITY) continue;  // an empty range
                        const float w = exp_poly(mp - M);
                        sum += w * part[(size_t)G * D + G + g];
                        for (int d = 0; d < D; d++) o[d] += w * part[(size_t)g * D + d];
                    }
                    const float inv = 1.0f / sum;
                    for (int d = 0; d < D; d++) o[d] *= inv;
                    store_row(out, ((ptrdiff_t)t * H + h * G + g) * D, o, D, dt);
                }
            }
        }
    }
    free(scratch);
    return status;
}
