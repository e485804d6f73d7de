/* Rows of bf16 x as 15-bit integers for the int8- and int4-weight GEMMs (gemm_int8.c,
 * gemm_int4.c and their AVX2 twins): each row is scaled by max|x| / X_MAX, so int16 pair
 * products with the weights' codes (|q| <= 127) can be summed exactly in int32 lanes over a
 * group of 32 k (16 pairs of at most 2 * 16383 * 127 each), after which the kernels move
 * the sums to float32 with the group's step. Plain C: built with either instruction set. */
#ifndef TESSERA_INT16_ROWS_H
#define TESSERA_INT16_ROWS_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define X_MAX 16383.0f

/* One bf16 row to int16 at a per-row scale; returns the scale. Comparisons rather than
 * fmaxf/fminf (libm calls per value: their NaN rules keep GCC from inlining them) and rintf
 * rather than lrintf (same rounding, to nearest even, but one instruction), so both loops
 * vectorise: a row of 576 took ~3.5 us as calls, more than a small matrix's multiply.
 * A NaN is ignored by the maximum and clamps to X_MAX. */
static inline float quantize_row(const uint16_t *x, int16_t *out, int64_t k) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float a = fabsf(bf16_to_f32(x[i]));
        amax = a > amax ? a : amax;
    }
    const float scale = amax > 0.0f && isfinite(amax) ? amax / X_MAX : 1.0f;
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < k; i++) {
        float v = bf16_to_f32(x[i]) * inv;
        v = v < X_MAX ? v : X_MAX;
        v = v > -X_MAX ? v : -X_MAX;
        out[i] = (int16_t)rintf(v);
    }
    return scale;
}

/* x [m, k] bf16 as int16 rows (*q) and their scales (*scale), in one allocation owned by
 * *scale (free(*scale)); from 8 rows on, `threads` threads quantize. Returns 0, or 2 when
 * the copy cannot be allocated (the kernels' "no memory" status). */
static inline int quantize_rows(const uint16_t *x, int64_t m, int64_t k, int threads,
                                int16_t **q, float **scale) {
    float *buf = malloc(sizeof(float) * m + sizeof(int16_t) * m * k);
    if (!buf) return 2;
    int16_t *xq = (int16_t *)(buf + m);
#pragma omp parallel for num_threads(m >= 8 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < m; r++) buf[r] = quantize_row(x + r * k, xq + r * k, k);
    *q = xq;
    *scale = buf;
    return 0;
}
/* Each row's sum of its int16 values per group of `group` (k % group == 0), as float32 (exact:
 * a group of 32 sums to at most 32 * 16383 < 2^24): the int4 GEMMs' offset terms. NULL when
 * it cannot be allocated; release with free. */
static inline float *group_sums(const int16_t *xq, int64_t m, int64_t k, int group) {
    const int64_t groups = k / group;
    float *sums = malloc(sizeof(float) * (size_t)(m * groups > 0 ? m * groups : 1));
    if (!sums) return NULL;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t s = 0;
            for (int i = 0; i < group; i++) s += xq[r * k + g * group + i];
            sums[r * groups + g] = (float)s;
        }
    return sums;
}

/* quantize_rows, plus each row's group sums (*sums, freed separately): the int4 GEMMs'
 * prologue. Returns 0, or 2 when a copy cannot be allocated (nothing is left allocated). */
static inline int quantize_grouped_rows(const uint16_t *x, int64_t m, int64_t k, int threads, int group,
                                        int16_t **q, float **scale, float **sums) {
    if (quantize_rows(x, m, k, threads, q, scale)) return 2;
    *sums = group_sums(*q, m, k, group);
    if (!*sums) {
        free(*scale);
        return 2;
    }
    return 0;
}
#endif
