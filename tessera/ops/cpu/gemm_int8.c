/* y[m, n] = (sum_k x[m, k] * q[n, k]) * scale[n] (+ bias[n]): bfloat16 activations against
 * int8 weights quantized per output feature (symmetric, |q| <= 127).
 * Half the bytes of bf16 weights, so single-stream decode, which streams every weight once
 * per token, reads half as much.
 *
 * Layout (one int8 tensor [n / 16, 64 + 16 k], built by tessera/ops/cpu/linear_int8.py): per
 * panel of 16 output features, their 16 float32 scales (64 bytes), then for each pair of k
 * the 16 features' two values side by side, as in gemm_bf16.c's packed panels.
 *
 * Arithmetic: widening int8 weights to bf16 costs five instructions per 32 weights, which
 * made the kernel compute-bound. Instead each row of x is scaled to 15-bit integers
 * (per-row scale max|x| / 16383: finer than bf16's 8-bit significand for every value within
 * 1/64 of the row's largest), weights are sign-extended to int16 (one instruction), and
 * AVX512-VNNI's vpdpwssd multiplies and adds 32 int16 pairs into int32 lanes. Partial sums
 * move to float32 every 256 pairs, before 512 products of at most 16383 * 127 could
 * overflow int32. Tiles: 6 rows of x by two panels (int32 and float32 partial sums share the
 * registers).
 *
 * From WIDEN_MIN_ROWS rows on the multiply is compute-bound and the 6-row tiles lose to bf16;
 * there each thread widens a pair of panels to bf16 once per block of rows (exact: |q| <= 127
 * fits bf16's significand) and runs gemm_bf16.c's 12-row tile on it, scales per lane at the
 * end; x stays bf16. Requires n % 16 == 0 and k % 2 == 0. Built by tessera/ops/cpu/build.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int16_rows.h"
#include "packed_tile.h"
#include "panel_tiles.h"
#include "simd_bf16.h"
#include "widened_gemm.h"

#define ROWS 6
#define ROW_BLOCK_BYTES (96 * 1024)   /* of int16 x rows */
/* From how many rows the widened bf16 tiles beat the 6-row int16 tiles (default model's
 * matrices, 2 threads). With AVX512-BF16: 4 (4-7 rows 8.4-9.7 ms widened vs 9.1-14.6).
 * Without it the bf16 tile runs as float32 FMAs and widening costs more, so the int16
 * tiles win longer; measured on a Xeon without AVX512-BF16: with VNNI 8 rows 14.5-18 vs
 * 34-37 ms, 16 rows 31 vs 49, 64 rows level, 128 rows 0.9x; without VNNI (vpmaddwd)
 * 8 rows 15.3 vs 23.5, 32 rows 0.92x. The two paths round differently, so a threshold T
 * must keep every captured decode bucket on one side (T - 1 a bucket top: the 9-16 row
 * bucket replays at 16 rows what eager ran at 10): 4, 17 and 64 all do. */
#if TESSERA_NATIVE_BF16
#define WIDEN_MIN_ROWS 4
#elif defined(__AVX512VNNI__)
#define WIDEN_MIN_ROWS 64
#else
#define WIDEN_MIN_ROWS 17
#endif

static inline __attribute__((always_inline)) void tile(
        const int16_t *x, const float *x_scale, const int8_t *panel, int64_t panel_bytes,
        const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total, int64_t col,
        const int rows, const int panels, const NextPair next) {
    const int64_t pairs = k / 2;
    int64_t prefetch_at = next.phase;
    __m512 total[ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) total[r][q] = _mm512_setzero_ps();
    const int8_t *q0 = panel + 64, *q1 = panel + panel_bytes + 64;
    for (int64_t c0 = 0; c0 < pairs; c0 += FLUSH_PAIRS) {
        const int64_t c1 = c0 + FLUSH_PAIRS < pairs ? c0 + FLUSH_PAIRS : pairs;
        __m512i acc[ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_si512();
        for (int64_t j = c0; j < c1; j++) {
            prefetch_next_pair(&next, j, &prefetch_at);
            const __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q0 + j * 32)));
            const __m512i b1 = panels == 2
                ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q1 + j * 32))) : b0;
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * k + 2 * j, sizeof pair);
                const __m512i a = _mm512_set1_epi32(pair);
                acc[r][0] = dot_i16_pairs(acc[r][0], a, b0);
                if (panels == 2) acc[r][1] = dot_i16_pairs(acc[r][1], a, b1);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++)
                total[r][q] = _mm512_add_ps(total[r][q], _mm512_cvtepi32_ps(acc[r][q]));
    }
    for (int q = 0; q < panels; q++) {
        const __m512 w_scale = _mm512_loadu_ps((const float *)(panel + q * panel_bytes));
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 scale = _mm512_mul_ps(w_scale, _mm512_set1_ps(x_scale[r]));
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_fmadd_ps(total[r][q], scale, b)));
        }
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

/* One panel's int8 values -> the same layout in bf16. */
static void widen_panel(const int8_t *q, uint16_t *out, int64_t pairs) {
    for (int64_t j = 0; j < pairs; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + j * 32));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
        _mm512_storeu_si512(out + j * 32, f32x32_to_bf16(hi, lo));
    }
}

/* widened_gemm.h's view of a panel: its values widened, its scales copied. */
static void widen_scaled_panel(const uint8_t *panel, uint16_t *out, float *scale, int64_t k) {
    widen_panel((const int8_t *)panel + 64, out, k / 2);
    memcpy(scale, panel, 64);
}

/* x [m, k] bf16, packed [n / 16, 64 + 16 k] int8, bias [n] bf16 or NULL, y [m, n] bf16.
 * Returns 1 on bad shapes, 2 when the int16 copy of x cannot be allocated. */
int tessera_gemm_int8(const uint16_t *x, const int8_t *packed, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 2 || n < 16 || k < 2) return 1;
    if (m >= WIDEN_MIN_ROWS) {
        const CompactPanels w = {(const uint8_t *)packed, 64 + 16 * k, 64, 32, widen_scaled_panel, 1};
        return gemm_widened(x, w, bias, y, m, n, k, threads);
    }
    int16_t *xq;
    float *x_scale;
    if (quantize_rows(x, m, k, threads, &xq, &x_scale)) return 2;
    const int64_t panels = n / 16, panel_bytes = 64 + 16 * k;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS, {
        const int8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes + 64 : NULL,
                                        panel_bytes, 32, tile_index, tiles);
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
