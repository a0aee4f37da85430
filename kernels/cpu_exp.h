// e^x in fp32 for the CPU kernels (kernels/cpu_attention.c's softmax, kernels/cpu_nibble.c's
// SwiGLU): 2^n e^r with r in [-ln2/2, ln2/2], Cephes's polynomial (~2 ulp), x clamped to where
// fp32's exponent holds the result. Written so that the compiler vectorizes the loops calling it
// (glibc's vector expf needs -ffast-math, which breaks the softmax's -inf).
#ifndef PDSERVE_CPU_EXP_H
#define PDSERVE_CPU_EXP_H

#include <stdint.h>
#include <string.h>

#pragma omp declare simd
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#endif
