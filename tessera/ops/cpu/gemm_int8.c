/* y[m, n] = x[m, k] times int8 weights (+ bias[n]): bfloat16 activations against weights
 * quantized per output feature in groups of 32 input features, symmetrically, as GGUF's Q8_0
 * stores them: w = d * s * q with codes |q| <= 127, a float16 step d per group and a power of
 * two s per output feature (tessera/ops/linear_int8.py: s keeps small steps out of float16's
 * subnormals). 8.5 bits per weight, so single-stream decode, which streams every weight once
 * per token, reads 53% of bf16's bytes; a Q8_0 file's matrices keep their values (the step is
 * the group's, not the whole row's).
 *
 * Layout (one int8 tensor [n / 16, 64 + 17 k], built by tessera/ops/cpu/linear_int8.py): per
 * panel of 16 output features, their 16 scales s (float32), then per group of 32 k, 544
 * bytes: the 16 features' steps d (float16), then for each of the group's 16 pairs of k the
 * 16 features' two values side by side, as in gemm_bf16.c's packed panels.
 *
 * Arithmetic: widening int8 weights to bf16 costs five instructions per 32 weights, which
 * made the kernel compute-bound. Instead each row of x is scaled to 15-bit integers
 * (int16_rows.h: per-row scale max|x| / 16383, finer than bf16's 8-bit significand for
 * every value within 1/64 of the row's largest), weights are sign-extended to int16 (one
 * instruction), and AVX512-VNNI's vpdpwssd multiplies and adds 32 int16 pairs into int32
 * lanes; per group the exact int32 sums times d go to float32 sums, times s and the row's
 * scale at the end. Tiles: 6 rows of x by two panels.
 *
 * Decode batches on AVX512-VNNI (Q8_MIN_ROWS to Q8_END_ROWS rows): x rounded to 8 bits per
 * group of 32 with a step each (int8_rows.h, as llama.cpp's CPU kernels take x), the codes
 * offset to unsigned (q + 128), and vpdpbusd sums four products per lane per instruction,
 * twice vpdpwssd's; per group, sum_k w x = d * x_step * (that - 128 * the group's x codes'
 * sum), times s at the end.
 *
 * From WIDEN_MIN_ROWS rows on the multiply is compute-bound and the 6-row tiles lose to bf16;
 * there each thread widens a pair of panels to bf16 (d * s * q rounded to bf16) once per block
 * of rows and runs gemm_bf16.c's 12-row tile on it; x stays bf16. Requires n % 16 == 0 and
 * k % 32 == 0. Built by tessera/ops/cpu/build.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int16_rows.h"
#include "int8_rows.h"
#include "packed_tile.h"
#include "panel_tiles.h"
#include "simd_bf16.h"
#include "widened_gemm.h"

#define GROUP 32
#define GROUP_PAIRS (GROUP / 2)
#define GROUP_BYTES 544                  /* 32 bytes of float16 steps, 16 pairs x 32 bytes */
#define HEAD_BYTES 64                    /* a panel's 16 float32 scales, before its groups */
#define PAIR_BYTES (GROUP_BYTES / GROUP_PAIRS)  /* a panel's bytes per pair of k, on average */
#define ROWS 6
#define ROW_BLOCK_BYTES (96 * 1024)   /* of x rows, int16 or int8 */
/* From how many rows the widened bf16 tiles beat the 6-row int16 tiles (default model's
 * matrices, 2 threads). With AVX512-BF16: 4 (4-7 rows 8.4-9.7 ms widened vs 9.1-14.6).
 * Without it the bf16 tile runs as float32 FMAs and widening costs more, so the int16
 * tiles win longer; measured on a Xeon without AVX512-BF16: with VNNI 8 rows 14.5-18 vs
 * 34-37 ms, 16 rows 31 vs 49, 64 rows level, 128 rows 0.9x; without VNNI (vpmaddwd)
 * 8 rows 15.3 vs 23.5, 32 rows 0.92x. The two paths round differently, so a threshold T
 * must keep every captured decode bucket on one side (T - 1 a bucket top: the 9-16 row
 * bucket replays at 16 rows what eager ran at 10): 4, 17 and 64 all do. */
/* The rows at which AVX512-VNNI builds (not the AMX one: it widens from 4) round x to 8 bits
 * per group of 32 and multiply with vpdpbusd (tile_q8): [Q8_MIN_ROWS, Q8_END_ROWS), passed
 * by linear_int8.py (INT8_X_ROWS). Over the default model's 211 matrices as int8 (AVX512-BF16
 * host, 2 threads): 0.93x the 15-bit tiles' speed at 1 row, 1.4x the widened tiles' at 4,
 * 1.25x at 8-16, 1.1x at 32-64, 0.85x from 96. Decode steps only, as gemm_int4.c's. */
#ifndef Q8_MIN_ROWS
#define Q8_MIN_ROWS 4
#endif
#ifndef Q8_END_ROWS
#define Q8_END_ROWS 33
#endif
#ifndef WIDEN_MIN_ROWS
#if TESSERA_NATIVE_BF16
#define WIDEN_FROM 4
#elif defined(__AVX512VNNI__)
#define WIDEN_FROM 64
#else
#define WIDEN_FROM 17
#endif
#if defined(__AVX512VNNI__) && !defined(TESSERA_AMX) && Q8_END_ROWS > Q8_MIN_ROWS && Q8_END_ROWS > WIDEN_FROM
#define WIDEN_MIN_ROWS Q8_END_ROWS  /* the 8-bit x rows first */
#else
#define WIDEN_MIN_ROWS WIDEN_FROM
#endif
#endif
#define ROWS8 6

static inline __m512 load_f16x16(const int8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __attribute__((always_inline)) void tile(
        const int16_t *x, const float *x_scale, const int8_t *panel, int64_t panel_bytes,
        const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total, int64_t col,
        const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    __m512 total[ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) total[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *g0 = panel + HEAD_BYTES + g * GROUP_BYTES, *g1 = g0 + panel_bytes;
        __m512i acc[ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_si512();
        for (int j = 0; j < GROUP_PAIRS; j++) {
            prefetch_next_pair(&next, g * GROUP_PAIRS + j, &prefetch_at);
            const __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(g0 + 32 + j * 32)));
            const __m512i b1 = panels == 2
                ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(g1 + 32 + j * 32))) : b0;
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * k + g * GROUP + 2 * j, sizeof pair);
                const __m512i a = _mm512_set1_epi32(pair);
                acc[r][0] = dot_i16_pairs(acc[r][0], a, b0);
                if (panels == 2) acc[r][1] = dot_i16_pairs(acc[r][1], a, b1);
            }
        }
        for (int q = 0; q < panels; q++) {
            const __m512 step = load_f16x16(q ? g1 : g0);
            for (int r = 0; r < rows; r++)
                total[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][q]), step, total[r][q]);
        }
    }
    for (int q = 0; q < panels; q++) {
        const __m512 w_scale = _mm512_loadu_ps((const float *)(panel + q * panel_bytes));
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_fmadd_ps(
                                    total[r][q], _mm512_mul_ps(w_scale, _mm512_set1_ps(x_scale[r])), b)));
    }
}

#define TILE_CASES(PANELS)                                                                  \
    switch (rows) {                                                                         \
        case 1: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, 1, PANELS, next); break;    \
        case 2: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, 2, PANELS, next); break;    \
        case 3: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, 3, PANELS, next); break;    \
        case 4: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, 4, PANELS, next); break;    \
        case 5: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, 5, PANELS, next); break;    \
        default: tile(xm, xs, panel, panel_bytes, bias, ym, k, n, col, ROWS, PANELS, next); break; \
    }

#if defined(__AVX512VNNI__)
/* Pairs 2t and 2t + 1 of a group (64 bytes: each holds the 16 features' two values side by
 * side) as each feature's four k in its lane's bytes, offset to unsigned (q + 128): vpdpbusd
 * multiplies unsigned bytes by signed ones, and x is the signed side. */
static inline __m512i quad_bytes(const int8_t *pairs) {
    static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i words = _mm512_permutexvar_epi16(_mm512_loadu_si512(order), _mm512_loadu_si512(pairs));
    return _mm512_xor_si512(words, _mm512_set1_epi8((char)0x80));
}

/* ROWS8 rows of 8-bit x (int8_rows.h, with its groups' code sums) by one or two panels; the
 * int32 sums less 128 times the code sum are exact in float32 (below 2^21). */
static inline __attribute__((always_inline)) void tile_q8(
        const int8_t *x, const float *x_steps, const float *x_sums, const int8_t *panel,
        int64_t panel_bytes, const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total,
        int64_t col, const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    __m512 total[ROWS8][2];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) total[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *g0 = panel + HEAD_BYTES + g * GROUP_BYTES, *g1 = g0 + panel_bytes;
        __m512i acc[ROWS8][2];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_si512();
        for (int t = 0; t < GROUP_PAIRS / 2; t++) {
            prefetch_next_pair(&next, g * GROUP_PAIRS + 2 * t, &prefetch_at);
            prefetch_next_pair(&next, g * GROUP_PAIRS + 2 * t + 1, &prefetch_at);
            const __m512i w0 = quad_bytes(g0 + 32 + 64 * t);
            const __m512i w1 = panels == 2 ? quad_bytes(g1 + 32 + 64 * t) : w0;
            for (int r = 0; r < rows; r++) {
                int32_t quad;
                memcpy(&quad, x + r * k + g * GROUP + 4 * t, sizeof quad);
                const __m512i a = _mm512_set1_epi32(quad);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, a);
                if (panels == 2) acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, a);
            }
        }
        for (int q = 0; q < panels; q++) {
            const __m512 step = load_f16x16(q ? g1 : g0);
            for (int r = 0; r < rows; r++) {
                const __m512 offset = _mm512_set1_ps(128.0f * x_sums[r * groups + g]);
                const __m512 x_step = _mm512_set1_ps(x_steps[r * groups + g]);
                total[r][q] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[r][q]), offset),
                                              _mm512_mul_ps(step, x_step), total[r][q]);
            }
        }
    }
    for (int q = 0; q < panels; q++) {
        const __m512 w_scale = _mm512_loadu_ps((const float *)(panel + q * panel_bytes));
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_fmadd_ps(total[r][q], w_scale, b)));
    }
}

#define Q8_TILE_CASES(PANELS)                                                                       \
    switch (rows) {                                                                                 \
        case 1: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 1, PANELS, next); break;    \
        case 2: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 2, PANELS, next); break;    \
        case 3: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 3, PANELS, next); break;    \
        case 4: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 4, PANELS, next); break;    \
        case 5: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 5, PANELS, next); break;    \
        default: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, ROWS8, PANELS, next); break; \
    }

static int gemm_q8(const uint16_t *x, const int8_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k, int threads) {
    int8_t *xq;
    float *x_steps, *x_sums;
    if (quantize_rows8(x, m, k, threads, &xq, &x_steps, &x_sums)) return 2;
    const int64_t groups = k / GROUP, panels = n / 16, panel_bytes = HEAD_BYTES + groups * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / k;
    block = block < ROWS8 ? ROWS8 : block / ROWS8 * ROWS8;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS8, {
        const int8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes + HEAD_BYTES : NULL,
                                        panel_bytes, PAIR_BYTES, tile_index, tiles);
        const int8_t *xm = xq + mt * k;
        const float *xs = x_steps + mt * groups;
        const float *sums = x_sums + mt * groups;
        uint16_t *ym = y + mt * n;
        if (two_panels) {
            Q8_TILE_CASES(2)
        } else {
            Q8_TILE_CASES(1)
        }
    });
    free(x_steps);  /* the codes and sums share its allocation */
    return 0;
}
#endif

/* One panel -> gemm_bf16.c's packed layout (for each pair of k, the 16 features' two values
 * side by side), each value d * s * q rounded to bf16 (widened_gemm.h's view of a panel). */
static void widen_panel(const uint8_t *panel, uint16_t *out, int64_t k) {
    /* a pair's first 16 bytes are features 0-7 (two k each), its last 16 features 8-15 */
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 w_scale = _mm512_loadu_ps((const float *)panel);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const int8_t *head = (const int8_t *)panel + HEAD_BYTES + g * GROUP_BYTES;
        const __m512 step = _mm512_mul_ps(load_f16x16(head), w_scale);  /* exact: s is a power of two */
        const __m512 step_a = _mm512_permutexvar_ps(first, step), step_b = _mm512_permutexvar_ps(second, step);
        for (int j = 0; j < GROUP_PAIRS; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(head + 32 + j * 32));
            const __m512 a = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))), step_a);
            const __m512 b = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))), step_b);
            _mm512_storeu_si512(out + (g * GROUP_PAIRS + j) * 32, f32x32_to_bf16(b, a));
        }
    }
}

/* x [m, k] bf16, packed [n / 16, 64 + 17 k] int8, bias [n] bf16 or NULL, y [m, n] bf16.
 * Returns 1 on bad shapes, 2 when the int16 copy of x cannot be allocated. */
int tessera_gemm_int8(const uint16_t *x, const int8_t *packed, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % GROUP || n < 16 || k < GROUP) return 1;
    const int64_t panels = n / 16, panel_bytes = HEAD_BYTES + k / GROUP * GROUP_BYTES;
    if (m >= WIDEN_MIN_ROWS) {
        const CompactPanels w = {(const uint8_t *)packed, panel_bytes, HEAD_BYTES, PAIR_BYTES, widen_panel};
        return gemm_widened(x, w, bias, y, m, n, k, threads);
    }
#if defined(__AVX512VNNI__)
    if (m >= Q8_MIN_ROWS && m < Q8_END_ROWS) return gemm_q8(x, packed, bias, y, m, n, k, threads);
#endif
    int16_t *xq;
    float *x_scale;
    if (quantize_rows(x, m, k, threads, &xq, &x_scale)) return 2;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS, {
        const int8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes + HEAD_BYTES : NULL,
                                        panel_bytes, PAIR_BYTES, tile_index, tiles);
        const int16_t *xm = xq + mt * k;
        const float *xs = x_scale + mt;
        uint16_t *ym = y + mt * n;
        if (two_panels) {
            TILE_CASES(2)
        } else {
            TILE_CASES(1)
        }
    });
    free(x_scale);  /* xq shares its allocation */
    return 0;
}
