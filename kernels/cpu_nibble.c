// GGUF weights kept quantized on the CPU: y = x W^T with bf16 activations on AVX512-BF16 dot
// products (or, built without AVX512-BF16, on AVX2's fp32 FMAs: the second path below), W read
// as 4-bit codes (Q4_0, Q4_1, Q4_K) or 8-bit ones (Q8_0) in groups of 32 along K.
// kernels/cpu_nibble.py builds this file with the system C compiler, packs the weights and holds
// the torch reference; the layout and the arithmetic are described there.
//
// The idea, per output column n and group g of 32 inputs:
//   Q4: a nibble q (0..15) ORed into the bf16 bits 0x4300 is the number 128 + q exactly, so one
//       VDPBF16PS over half a 32-byte load (two 16-bit words per output lane) accumulates
//       acc = sum_k x_k (128 + q_k) in fp32 with no conversion of the codes, and
//       x . w_g = s (acc - 128 sx) + z sx = s acc + (z - 128 s) sx,          w = s q + z
//   Q8: a byte u = c + 128 (0..255) is exactly a bf16 number; converted through fp32 (two
//       widenings and one rounding that rounds nothing), acc = sum_k x_k u_k and
//       x . w_g = d (acc - 128 sx),                                           w = d c
//   where sx = sum_k x_k over the group (computed once per call).
// Every row runs the same sequence of operations whatever the number of rows or threads, so a
// request's logits do not depend on what else is in the batch.

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

enum { FMT_Q4 = 0, FMT_Q8 = 1 };

// nibble_gemm's jobs, on either path: runs of 4 tiles of 16 columns, then one of 2 and one of 1
// for the rest. Job `job` covers `tiles` tiles from tile `nt`.
static inline int job_count(int NT) {
    const int rest = NT % 4;
    return NT / 4 + (rest >= 2) + (rest & 1);
}

static inline void job_tiles(int job, int NT, int *nt, int *tiles) {
    const int quads = NT / 4;
    if (job < quads) { *nt = job * 4; *tiles = 4; }
    else if (job == quads && NT % 4 >= 2) { *nt = quads * 4; *tiles = 2; }
    else { *nt = NT - 1; *tiles = 1; }
}

#define CHUNK 32  // nibble_dequant_t's job: a run of CHUNK tiles

#if defined(__AVX512BF16__)

static inline __m512 load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 load_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// Rows r0..r0+R-1 of x against column tiles nt0..nt0+T-1 (16 columns each), R * T <= 12 (8 with
// T = 4). Each (row, tile) keeps two accumulator chains (Q4: the low and the high nibbles; Q8:
// even and odd loads) so that the dot products' latency does not bound a single row; the
// running sums across groups live in `out`, on the stack (L1), not in registers.
static inline __attribute__((always_inline)) void block(
    const int R, const int T, const int FMT, const uint16_t *x, ptrdiff_t ldx, const float *sx,
    int K, const uint8_t *w, const uint16_t *s, const uint16_t *z, int nt0, void *y,
    ptrdiff_t ldy, int out_bf16)
{
    const int G = K / 32;
    const int L = FMT == FMT_Q4 ? 8 : 16;  // 32-byte loads per group and tile
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    const __m512i lo_bits = _mm512_set1_epi16(0x4300);
    __m512 out[6][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r][t] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 acc[6][4], acc2[6][4];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) acc[r][t] = acc2[r][t] = _mm512_setzero_ps();
        for (int st = 0; st < L; st++) {
            __m512i lo[4], hi[4];
            for (int t = 0; t < T; t++) {
                const uint8_t *src = w + ((size_t)(nt0 + t) * G * L + (size_t)g * L + st) * 32;
                // Few rows use the weights faster than memory brings them, and each tile's codes
                // are a short run (K / 32 groups x 256 bytes): the hardware's prefetcher ramps
                // up on every run anew. So fetch the line at this place in the next job's tiles
                // (jobs are runs of 4 tiles; a thread's jobs follow each other in memory):
                // single rows then stream 1.2-1.3x faster (2026-12-05).
                if (R <= 4 && (st & 1) == 0)
                    _mm_prefetch((const char *)src + (size_t)4 * G * L * 32, _MM_HINT_T1);
                if (FMT == FMT_Q4) {
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
                    lo[t] = _mm512_or_si512(_mm512_and_si512(v, low4), lo_bits);
                    hi[t] = _mm512_or_si512(_mm512_srli_epi16(v, 4), lo_bits);
                } else {  // words 0..15 and 16..31 of the load, each widened to fp32
                    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)src)));
                    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(src + 16))));
                    lo[t] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
                }
            }
            // Q4: a load holds inputs k, k+1 (low nibbles) and k+2, k+3 (high); Q8: k, k+1
            const int k = g * 32 + (FMT == FMT_Q4 ? st * 4 : st * 2);
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = x + r * ldx + k;
                __m512bh xa = (__m512bh)_mm512_set1_epi32(*(const int32_t *)xr);
                if (FMT == FMT_Q4) {
                    __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xr + 2));
                    for (int t = 0; t < T; t++) {
                        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xa, (__m512bh)lo[t]);
                        acc2[r][t] = _mm512_dpbf16_ps(acc2[r][t], xb, (__m512bh)hi[t]);
                    }
                } else if (st & 1) {
                    for (int t = 0; t < T; t++)
                        acc2[r][t] = _mm512_dpbf16_ps(acc2[r][t], xa, (__m512bh)lo[t]);
                } else {
                    for (int t = 0; t < T; t++)
                        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xa, (__m512bh)lo[t]);
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const size_t at = ((size_t)(nt0 + t) * G + g) * 16;
            __m512 sc = load_f16(s + at);
            if (FMT == FMT_Q4) {
                __m512 zc = _mm512_fnmadd_ps(sc, _mm512_set1_ps(128.f), load_f16(z + at));
                for (int r = 0; r < R; r++) {
                    __m512 dot = _mm512_add_ps(acc[r][t], acc2[r][t]);
                    __m512 part = _mm512_fmadd_ps(zc, _mm512_set1_ps(sx[r * G + g]),
                                                  _mm512_mul_ps(sc, dot));
                    out[r][t] = _mm512_add_ps(out[r][t], part);
                }
            } else {
                for (int r = 0; r < R; r++) {
                    __m512 dot = _mm512_add_ps(acc[r][t], acc2[r][t]);
                    __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(128.f),
                                                      _mm512_set1_ps(sx[r * G + g]), dot);
                    out[r][t] = _mm512_fmadd_ps(sc, centred, out[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            const size_t at = (size_t)r * ldy + (size_t)(nt0 + t) * 16;
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + at),
                                    (__m256i)_mm512_cvtneps_pbh(out[r][t]));
            else
                _mm512_storeu_ps((float *)y + at, out[r][t]);
        }
}

#define BLOCK(RR, TT, NT0, F) block(RR, TT, F, x + (ptrdiff_t)m * ldx, ldx, sx + (size_t)m * G, \
                                    K, w, s, z, NT0, (char *)y + (size_t)m * N * osize, N, \
                                    out_bf16)

// One job: `tiles` (1, 2 or 4) tiles from nt for every row. Blocks of 6 rows take the tiles two
// at a time; the last rows take as many tiles at once as the registers hold, so that a single
// row still has 4 independent accumulator chains (the dot products' latency, not the loads,
// bounds one row otherwise). A column's arithmetic is the same in every block shape.
#define JOB(F) do { int m = 0; \
    for (; m + 6 <= M; m += 6) { \
        if (tiles == 1) BLOCK(6, 1, nt, F); \
        else for (int t = 0; t < tiles; t += 2) BLOCK(6, 2, nt + t, F); } \
    const int left = M - m; \
    if (left == 0) break; \
    if (tiles == 4 && left <= 2) { \
        if (left == 1) BLOCK(1, 4, nt, F); else BLOCK(2, 4, nt, F); \
    } else { \
        for (int t = 0; t < tiles; t += 2) { \
            const int tt = tiles - t >= 2 ? 2 : 1; \
            switch (left * 2 + (tt == 2)) { \
            case 11: BLOCK(5, 2, nt + t, F); break; case 10: BLOCK(5, 1, nt + t, F); break; \
            case 9: BLOCK(4, 2, nt + t, F); break; case 8: BLOCK(4, 1, nt + t, F); break; \
            case 7: BLOCK(3, 2, nt + t, F); break; case 6: BLOCK(3, 1, nt + t, F); break; \
            case 5: BLOCK(2, 2, nt + t, F); break; case 4: BLOCK(2, 1, nt + t, F); break; \
            case 3: BLOCK(1, 2, nt + t, F); break; case 2: BLOCK(1, 1, nt + t, F); break; } \
        } \
    } } while (0)

// x [M, K] bf16, or fp32 when x_fp32 (then rounded to bf16 here, to nearest even, as torch's
// .to(torch.bfloat16) rounds), row stride ldx; y [M, N] fp32 or bf16 (contiguous); nthreads:
// torch's intra-op thread count. w, s, z as kernels/cpu_nibble.py packs them (z unused for Q8).
// K % 32 == 0, N % 16 == 0. Returns 0, or -1 if the scratch could not be allocated.
int nibble_gemm(const void *x_in, int x_fp32, ptrdiff_t ldx, int M, int K, int N, int fmt,
                const uint8_t *w, const uint16_t *s, const uint16_t *z, void *y, int out_bf16,
                int nthreads) {
    const int G = K / 32, NT = N / 16;
    const size_t osize = out_bf16 ? 2 : 4;
    float stack_sx[1024];
    uint16_t stack_x[8192];
    const size_t x_words = x_fp32 ? (size_t)M * K : 0;
    float *sx = (size_t)M * G <= 1024 ? stack_sx : malloc((size_t)M * G * sizeof(float));
    uint16_t *xb = x_words <= 8192 ? stack_x : malloc(x_words * sizeof(uint16_t));
    if (!sx || !xb) {
        if (sx && sx != stack_sx) free(sx);
        if (xb && xb != stack_x) free(xb);
        return -1;
    }
    const uint16_t *x = x_in;
    if (x_fp32) {  // rows rounded into xb, which the kernels then read with stride K
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k += 16) {
                __m512 v = _mm512_loadu_ps((const float *)x_in + (ptrdiff_t)m * ldx + k);
                _mm256_storeu_si256((__m256i *)(xb + (size_t)m * K + k),
                                    (__m256i)_mm512_cvtneps_pbh(v));
            }
        x = xb;
        ldx = K;
    }
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const uint16_t *p = x + (ptrdiff_t)m * ldx + g * 32;
            sx[(size_t)m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(p),
                                                                       load_bf16(p + 16)));
        }
    const int jobs = job_count(NT);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int job = 0; job < jobs; job++) {
        int nt, tiles;
        job_tiles(job, NT, &nt, &tiles);
        if (fmt == FMT_Q4) JOB(FMT_Q4); else JOB(FMT_Q8);
    }
    if (sx != stack_sx) free(sx);
    if (xb != stack_x) free(xb);
    return 0;
}

// W^T [K, N] in bf16 (each value rounded once from fp32), for steps long enough that a dense
// bf16 GEMM over it beats nibble_gemm. A job is a run of CHUNK tiles written group by group, so
// the stores of one input row are contiguous (a 49152-column lm_head written tile by tile would
// touch a new page at every row).
void nibble_dequant_t(int K, int N, int fmt, const uint8_t *w, const uint16_t *s,
                      const uint16_t *z, uint16_t *out, int nthreads) {
    const int G = K / 32, NT = N / 16;
    const int L = fmt == FMT_Q4 ? 8 : 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int chunk = 0; chunk < (NT + CHUNK - 1) / CHUNK; chunk++) {
        const int end = chunk * CHUNK + CHUNK < NT ? chunk * CHUNK + CHUNK : NT;
        for (int g = 0; g < G; g++) {
            for (int nt = chunk * CHUNK; nt < end; nt++) {
                const size_t at = ((size_t)nt * G + g) * 16;
                const __m512 sc = load_f16(s + at);
                const __m512 zc = fmt == FMT_Q4 ? load_f16(z + at)
                                                : _mm512_mul_ps(sc, _mm512_set1_ps(-128.f));
                for (int st = 0; st < L; st++) {
                    const uint8_t *src = w + ((size_t)nt * G * L + (size_t)g * L + st) * 32;
                    // lane i: column i; its two 16-bit words hold bytes 2i and 2i + 1
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
                    const int k = g * 32 + (fmt == FMT_Q4 ? st * 4 : st * 2);
                    __m512i codes[4];
                    int n_codes;
                    if (fmt == FMT_Q4) {  // inputs k, k + 1 (low nibbles), k + 2, k + 3 (high)
                        const __m512i m4 = _mm512_set1_epi32(0xF);
                        codes[0] = _mm512_and_si512(v, m4);
                        codes[1] = _mm512_and_si512(_mm512_srli_epi32(v, 16), m4);
                        codes[2] = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
                        codes[3] = _mm512_and_si512(_mm512_srli_epi32(v, 20), m4);
                        n_codes = 4;
                    } else {  // inputs k, k + 1
                        codes[0] = _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
                        codes[1] = _mm512_srli_epi32(v, 16);
                        n_codes = 2;
                    }
                    for (int j = 0; j < n_codes; j++) {
                        __m512 val = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes[j]), sc, zc);
                        _mm256_storeu_si256(
                            (__m256i *)(out + (size_t)(k + j) * N + (size_t)nt * 16),
                            (__m256i)_mm512_cvtneps_pbh(val));
                    }
                }
            }
        }
    }
}

#else  // AVX2, FMA and F16C: CPUs without AVX512-BF16 (kernels/cpu_nibble.py picks the flags)

// The idea here: 8 output columns a register (two a tile of 16), x in fp32 (rounded to bf16
// first, as the AVX512 path reads it). A load's 16 bytes for 8 columns widen to 8 32-bit lanes
// holding each column's two bytes; a shift and a mask give one input's codes for the 8 columns,
// converted to fp32 and made weights at once, w = s q + z (Q8: w = d u - 128 d), the way the
// reference computes them; then every row of the block adds x_k w into its accumulators, in
// ascending k, one FMA chain per column: a row's sums are the same whatever the block shape,
// the number of rows or the threads.

static inline __m256 load_f16x8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m128i bf16x8(__m256 v) {  // round to nearest even, as torch rounds (finite v)
    __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                          16);
    return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

static inline float bf16_round(float v) {  // v rounded to bf16 and back, as torch rounds
    uint32_t b;
    memcpy(&b, &v, 4);
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&v, &b, 4);
    return v;
}

// The weights of input k + j of a load for tile t's two halves of 8 columns.
static inline __attribute__((always_inline)) void weights(
    const int FMT, const int j, __m256i v0, __m256i v1, __m256 s0, __m256 s1, __m256 z0,
    __m256 z1, __m256 *w0, __m256 *w1)
{
    // Q4: a lane holds bytes (q[k] | q[k+2] << 4) | (q[k+1] | q[k+3] << 4) << 8; Q8: u[k] | u[k+1] << 8
    const int shift = FMT == FMT_Q4 ? (j == 0 ? 0 : j == 1 ? 8 : j == 2 ? 4 : 12) : 8 * j;
    const __m256i mask = _mm256_set1_epi32(FMT == FMT_Q4 ? 0xF : 0xFF);
    *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v0, shift), mask)),
                          s0, z0);
    *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v1, shift), mask)),
                          s1, z1);
}

// Rows r0..r0+R-1 of x (fp32) against tiles nt0..nt0+T-1, R * T <= 6: 2 R T accumulators.
static inline __attribute__((always_inline)) void block(
    const int R, const int T, const int FMT, const float *x, ptrdiff_t ldx, int K,
    const uint8_t *w, const uint16_t *s, const uint16_t *z, int nt0, void *y, ptrdiff_t ldy,
    int out_bf16)
{
    const int G = K / 32;
    const int L = FMT == FMT_Q4 ? 8 : 16;  // 32-byte loads per group and tile
    const int J = FMT == FMT_Q4 ? 4 : 2;  // inputs a load holds per column
    __m256 acc[6][4][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256 sc[4][2], zc[4][2];
        for (int t = 0; t < T; t++) {
            const size_t at = ((size_t)(nt0 + t) * G + g) * 16;
            sc[t][0] = load_f16x8(s + at);
            sc[t][1] = load_f16x8(s + at + 8);
            if (FMT == FMT_Q4) {
                zc[t][0] = load_f16x8(z + at);
                zc[t][1] = load_f16x8(z + at + 8);
            } else {
                zc[t][0] = _mm256_mul_ps(sc[t][0], _mm256_set1_ps(-128.f));
                zc[t][1] = _mm256_mul_ps(sc[t][1], _mm256_set1_ps(-128.f));
            }
        }
        for (int st = 0; st < L; st++) {
            const int k = g * 32 + st * J;
            for (int t = 0; t < T; t++) {
                const uint8_t *src = w + ((size_t)(nt0 + t) * G * L + (size_t)g * L + st) * 32;
                if (R <= 4 && (st & 1) == 0)  // the next job's line: see the AVX512 path
                    _mm_prefetch((const char *)src + (size_t)4 * G * L * 32, _MM_HINT_T1);
                const __m256i v0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
                const __m256i v1 = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(src + 16)));
                for (int j = 0; j < J; j++) {
                    __m256 w0, w1;
                    weights(FMT, j, v0, v1, sc[t][0], sc[t][1], zc[t][0], zc[t][1], &w0, &w1);
                    for (int r = 0; r < R; r++) {
                        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k + j);
                        acc[r][t][0] = _mm256_fmadd_ps(xb, w0, acc[r][t][0]);
                        acc[r][t][1] = _mm256_fmadd_ps(xb, w1, acc[r][t][1]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < 2; h++) {
                const size_t at = (size_t)r * ldy + (size_t)(nt0 + t) * 16 + h * 8;
                if (out_bf16)
                    _mm_storeu_si128((__m128i *)((uint16_t *)y + at), bf16x8(acc[r][t][h]));
                else
                    _mm256_storeu_ps((float *)y + at, acc[r][t][h]);
            }
}

#define BLOCK(RR, TT, NT0, F) block(RR, TT, F, x + (ptrdiff_t)m * K, K, K, w, s, z, NT0, \
                                    (char *)y + (size_t)m * N * osize, N, out_bf16)

// One job: `tiles` (1, 2 or 4) tiles from nt for every row: blocks of 6 rows a tile at a time
// (12 accumulators of the 16 registers), then the last rows with as many tiles at once as keep
// a single row at 8 independent FMA chains.
#define JOB(F) do { int m = 0; \
    for (; m + 6 <= M; m += 6) \
        for (int t = 0; t < tiles; t++) BLOCK(6, 1, nt + t, F); \
    const int left = M - m; \
    if (left == 1) { \
        if (tiles == 4) BLOCK(1, 4, nt, F); \
        else if (tiles == 2) BLOCK(1, 2, nt, F); \
        else BLOCK(1, 1, nt, F); \
    } else if (left == 2) { \
        for (int t = 0; t + 2 <= tiles; t += 2) BLOCK(2, 2, nt + t, F); \
        if (tiles == 1) BLOCK(2, 1, nt, F); \
    } else if (left == 3) { \
        for (int t = 0; t < tiles; t++) BLOCK(3, 1, nt + t, F); \
    } else if (left == 4) { \
        for (int t = 0; t < tiles; t++) BLOCK(4, 1, nt + t, F); \
    } else if (left == 5) { \
        for (int t = 0; t < tiles; t++) BLOCK(5, 1, nt + t, F); \
    } } while (0)

// As the AVX512 path's nibble_gemm (same arguments and layout): x bf16, or fp32 when x_fp32
// (rounded to bf16 here first), y fp32 or bf16. Returns 0, or -1 without scratch.
int nibble_gemm(const void *x_in, int x_fp32, ptrdiff_t ldx, int M, int K, int N, int fmt,
                const uint8_t *w, const uint16_t *s, const uint16_t *z, void *y, int out_bf16,
                int nthreads) {
    const int NT = N / 16;
    const size_t osize = out_bf16 ? 2 : 4;
    float stack_x[8192];
    const size_t words = (size_t)M * K;
    float *x = words <= 8192 ? stack_x : malloc(words * sizeof(float));
    if (!x) return -1;
    for (int m = 0; m < M; m++) {
        float *dst = x + (size_t)m * K;
        if (x_fp32) {
            const float *src = (const float *)x_in + (ptrdiff_t)m * ldx;
            for (int k = 0; k < K; k++) dst[k] = bf16_round(src[k]);
        } else {
            const uint16_t *src = (const uint16_t *)x_in + (ptrdiff_t)m * ldx;
            for (int k = 0; k < K; k++) {
                const uint32_t b = (uint32_t)src[k] << 16;
                memcpy(dst + k, &b, 4);
            }
        }
    }
    const int jobs = job_count(NT);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int job = 0; job < jobs; job++) {
        int nt, tiles;
        job_tiles(job, NT, &nt, &tiles);
        if (fmt == FMT_Q4) JOB(FMT_Q4); else JOB(FMT_Q8);
    }
    if (x != stack_x) free(x);
    return 0;
}

// W^T [K, N] in bf16, as the AVX512 path's: each weight made as the GEMM makes it, rounded once.
void nibble_dequant_t(int K, int N, int fmt, const uint8_t *w, const uint16_t *s,
                      const uint16_t *z, uint16_t *out, int nthreads) {
    const int G = K / 32, NT = N / 16;
    const int L = fmt == FMT_Q4 ? 8 : 16, J = fmt == FMT_Q4 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int chunk = 0; chunk < (NT + CHUNK - 1) / CHUNK; chunk++) {
        const int end = chunk * CHUNK + CHUNK < NT ? chunk * CHUNK + CHUNK : NT;
        for (int g = 0; g < G; g++) {
            for (int nt = chunk * CHUNK; nt < end; nt++) {
                const size_t at = ((size_t)nt * G + g) * 16;
                const __m256 s0 = load_f16x8(s + at), s1 = load_f16x8(s + at + 8);
                __m256 z0, z1;
                if (fmt == FMT_Q4) {
                    z0 = load_f16x8(z + at);
                    z1 = load_f16x8(z + at + 8);
                } else {
                    z0 = _mm256_mul_ps(s0, _mm256_set1_ps(-128.f));
                    z1 = _mm256_mul_ps(s1, _mm256_set1_ps(-128.f));
                }
                for (int st = 0; st < L; st++) {
                    const uint8_t *src = w + ((size_t)nt * G * L + (size_t)g * L + st) * 32;
                    const __m256i v0 = _mm256_cvtepu16_epi32(
                        _mm_loadu_si128((const __m128i *)src));
                    const __m256i v1 = _mm256_cvtepu16_epi32(
                        _mm_loadu_si128((const __m128i *)(src + 16)));
                    const int k = g * 32 + st * J;
                    for (int j = 0; j < J; j++) {
                        __m256 w0, w1;
                        if (fmt == FMT_Q4)
                            weights(FMT_Q4, j, v0, v1, s0, s1, z0, z1, &w0, &w1);
                        else
                            weights(FMT_Q8, j, v0, v1, s0, s1, z0, z1, &w0, &w1);
                        uint16_t *dst = out + (size_t)(k + j) * N + (size_t)nt * 16;
                        _mm_storeu_si128((__m128i *)dst, bf16x8(w0));
                        _mm_storeu_si128((__m128i *)(dst + 8), bf16x8(w1));
                    }
                }
            }
        }
    }
}

#endif

// The GEMM's input made here from fp32 rows, so that a decode layer's norm or SwiGLU and the
// projection after it are one call (kernels/cpu_nibble.py `gemm_pre`):
//   PRE_RMSNORM   r = x + residual (x alone when residual is NULL) is written to r_out [M, K],
//                 and the GEMM reads r * w / sqrt(mean(r^2) + eps)         (x [M, K], ldx)
//   PRE_SILU_MUL  the GEMM reads silu(x[:, :K]) * x[:, K:], silu(g) = g / (1 + e^-g)
//                                                                        (x [M, 2K], ldx)
// all in fp32, then rounded to bf16 as nibble_gemm rounds fp32 rows. Returns nibble_gemm's.
enum { PRE_RMSNORM = 0, PRE_SILU_MUL = 1 };

int nibble_gemm_pre(int pre, const float *x, ptrdiff_t ldx, const float *residual,
                    ptrdiff_t ldr, float *r_out, const float *norm_w, float eps, int M, int K,
                    int N, int fmt, const uint8_t *w, const uint16_t *s, const uint16_t *z,
                    void *y, int out_bf16, int nthreads) {
    float stack[4096];
    const size_t words = (size_t)M * K;
    float *in = words <= 4096 ? stack : malloc(words * sizeof(float));
    if (!in) return -1;
    for (int m = 0; m < M; m++) {
        const float *xr = x + (ptrdiff_t)m * ldx;
        float *dst = in + (size_t)m * K;
        if (pre == PRE_RMSNORM) {
            float *r = r_out + (size_t)m * K;
            const float *res = residual ? residual + (ptrdiff_t)m * ldr : NULL;
            float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
            for (int k = 0; k < K; k++) {
                const float v = res ? xr[k] + res[k] : xr[k];
                r[k] = v;
                sq += v * v;
            }
            const float inv = 1.0f / sqrtf(sq / (float)K + eps);
#pragma omp simd
            for (int k = 0; k < K; k++) dst[k] = r[k] * inv * norm_w[k];
        } else {
#pragma omp simd
            for (int k = 0; k < K; k++) {
                const float g = xr[k];
                dst[k] = g / (1.0f + exp_poly(-g)) * xr[K + k];
            }
        }
    }
    const int status = nibble_gemm(in, 1, K, M, K, N, fmt, w, s, z, y, out_bf16, nthreads);
    if (in != stack) free(in);
    return status;
}
