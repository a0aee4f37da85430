// A whole Llama decoder layer for a CPU step of decodes in one call: the Python between the
// layer's kernels (a dozen calls, views and output tensors, ~0.1 ms a layer on a 2-core CPU)
// costs more than some of the kernels themselves at one row. The steps are the ones the torch
// path runs, with the same kernels (this file includes both), in the same order:
//
//   r1  = h + residual                          (h alone at layer 0)
//   qkv = rmsnorm(r1, norm1) Wqkv^T              nibble_gemm_pre, PRE_RMSNORM
//   att = paged attention of rotated q, k, v     cpu_paged_decode (K/V stored into the cache)
//   r2  = att Wo^T + r1
//   out = (silu(gate) * up)(rmsnorm(r2, norm2) Wgu^T) Wdown^T
//                                                nibble_gemm_pre, PRE_RMSNORM then PRE_SILU_MUL
//
// and the layer returns (out, r2), as LlamaDecoderLayer.forward does (the skip connection's add
// deferred into the next layer's norm). kernels/cpu_decode_layer.py builds this file and holds
// the structs' Python side; engine/models/cpu_decode_layer.py decides where it runs.

#include "cpu_nibble.c"
#include "cpu_attention.c"

typedef struct {  // one projection as kernels/cpu_nibble.py packs it: y = x W^T, W [n, k]
    int32_t fmt, n, k;
    const uint8_t *w;
    const uint16_t *s, *z;
} Mat;

typedef struct {  // what a layer holds (the same every step)
    Mat qkv, o, gate_up, down;
    const float *norm1, *norm2;
    float eps1, eps2, scale;
    int32_t heads, kv_heads, head_dim;
} Layer;

typedef struct {  // what a step's layers share: kernels/cpu_attention.c's tables, fp32 rope
    const int64_t *slots;
    const int32_t *tables;
    int64_t table_ld;
    const int32_t *seq_lens;
    const float *cos, *sin;
    int64_t rope_ld;
} Step;

enum { ERR_LAYER = -10, ERR_SCRATCH = -11 };

// h, residual (NULL at layer 0): [M, hidden] fp32 rows ldh / ldr apart; out, res_out: [M,
// hidden] contiguous. Returns 0, ERR_LAYER (projections that do not chain), ERR_SCRATCH, or a
// kernel's own error (cpu_paged_decode's ERR_*; -1 from a GEMM's scratch).
int cpu_decode_layer(const Layer *L, const Step *S, float *cache, int64_t num_blocks, int bs,
                     const float *h, int64_t ldh, const float *residual, int64_t ldr, int M,
                     float *out, float *res_out, int nthreads) {
    const int hidden = L->qkv.k, H = L->heads, Hkv = L->kv_heads, D = L->head_dim;
    const int inter = L->down.k;
    if (L->qkv.n != (H + 2 * Hkv) * D || L->o.k != H * D || L->o.n != hidden ||
        L->gate_up.k != hidden || L->gate_up.n != 2 * inter || L->down.n != hidden)
        return ERR_LAYER;
    const size_t qkv_n = (size_t)L->qkv.n;
    float *scratch = malloc(sizeof(float) * (size_t)M * (qkv_n + (size_t)H * D + hidden +
                                                         2 * (size_t)inter));
    if (!scratch) return ERR_SCRATCH;
    float *qkv = scratch, *att = qkv + (size_t)M * qkv_n;
    float *a = att + (size_t)M * H * D, *gu = a + (size_t)M * hidden;
    int err = nibble_gemm_pre(PRE_RMSNORM, h, ldh, residual, ldr, res_out, L->norm1, L->eps1, M,
                              hidden, L->qkv.n, L->qkv.fmt, L->qkv.w, L->qkv.s, L->qkv.z, qkv, 0,
                              nthreads);
    if (!err)
        err = cpu_paged_decode(DT_F32, M, H, Hkv, D, qkv, qkv_n, qkv + (size_t)H * D, qkv_n,
                               qkv + (size_t)(H + Hkv) * D, qkv_n, S->cos, S->sin, S->rope_ld,
                               cache, num_blocks, bs, S->slots, S->tables, S->table_ld,
                               S->seq_lens, L->scale, att, nthreads);
    if (!err)
        err = nibble_gemm(att, 1, (ptrdiff_t)H * D, M, H * D, hidden, L->o.fmt, L->o.w, L->o.s,
                          L->o.z, a, 0, nthreads);
    if (!err)  // r2 = a + r1 written over r1 (each element read before it is written)
        err = nibble_gemm_pre(PRE_RMSNORM, a, hidden, res_out, hidden, res_out, L->norm2,
                              L->eps2, M, hidden, L->gate_up.n, L->gate_up.fmt, L->gate_up.w,
                              L->gate_up.s, L->gate_up.z, gu, 0, nthreads);
    if (!err)
        err = nibble_gemm_pre(PRE_SILU_MUL, gu, L->gate_up.n, NULL, 0, NULL, NULL, 0.0f, M,
                              inter, hidden, L->down.fmt, L->down.w, L->down.s, L->down.z, out, 0,
                              nthreads);
    free(scratch);
    return err;
}
