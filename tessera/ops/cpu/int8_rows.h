/* Rows of bf16 x as int8 codes in groups of 32 input features, each group with its own step
 * (max |x| / 127 over the group) and its codes' sum: the activations AVX512-VNNI's vpdpbusd
 * multiplies against the int8 and int4 GEMMs' codes in decode batches (gemm_int8.c,
 * gemm_int4.c). 8-bit x is what llama.cpp's CPU kernels multiply too (its Q8_0 / Q8_1
 * blocks): a step per group, so one group's outlier does not coarsen the whole row. The
 * codes' sum serves the weights' offsets (int4's m, int8's unsigned shift): taken on the
 * rounded x, as the products are, the offset cancels exactly, where x's own sum would leave
 * each code's rounding error times (w - m), 2-3x that times w for Q4_1 weights. Plain C:
 * built with either instruction set. */
#ifndef TESSERA_INT8_ROWS_H
#define TESSERA_INT8_ROWS_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define Q8_GROUP 32
#define Q8_MAX 127.0f

/* One group of 32 bf16 values -> 32 int8 codes, *step (0 for an all-zero group) and *sum,
 * the codes' sum (exact in float32). A NaN is ignored by the maximum; an infinite maximum
 * gives step 1 and clamped codes. */
static inline void quantize_group8(const uint16_t *x, int8_t *out, float *step, float *sum) {
    float amax = 0.0f;
    for (int i = 0; i < Q8_GROUP; i++) {
        const float a = fabsf(bf16_to_f32(x[i]));
        amax = a > amax ? a : amax;
    }
    const float d = amax > 0.0f && isfinite(amax) ? amax / Q8_MAX : (amax > 0.0f ? 1.0f : 0.0f);
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t codes = 0;
    for (int i = 0; i < Q8_GROUP; i++) {
        float v = bf16_to_f32(x[i]) * inv;
        v = v < Q8_MAX ? v : Q8_MAX;
        v = v > -Q8_MAX ? v : -Q8_MAX;
        out[i] = (int8_t)rintf(v);
        codes += out[i];
    }
    *step = d;
    *sum = (float)codes;
}

/* x [m, k] bf16 (k % 32 == 0) -> codes *q [m, k] int8, *steps and the codes' *sums
 * [m, k / 32] float32,
 * in one allocation owned by *steps (free(*steps)); from 8 rows on, `threads` threads
 * quantize. Returns 0, or 2 when the copy cannot be allocated (the kernels' "no memory"). */
static inline int quantize_rows8(const uint16_t *x, int64_t m, int64_t k, int threads,
                                 int8_t **q, float **steps, float **sums) {
    const int64_t groups = k / Q8_GROUP;
    float *buf = malloc(sizeof(float) * 2 * m * groups + (size_t)(m * k));
    if (!buf) return 2;
    int8_t *xq = (int8_t *)(buf + 2 * m * groups);
#pragma omp parallel for num_threads(m >= 8 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < m * groups; i++)
        quantize_group8(x + i * Q8_GROUP, xq + i * Q8_GROUP, buf + i, buf + m * groups + i);
    *q = xq;
    *steps = buf;
    *sums = buf + m * groups;
    return 0;
}
#endif
