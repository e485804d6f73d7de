/* y[m, n] = x[m, k] times packed bf16 weights (+ bias[n]) on CPUs with AVX2 and FMA but no
 * AVX512 (AMD Zen 2/3, Intel client cores): the same packed panels as gemm_bf16.c
 * (packed[p, j, 2 * c + e] = w[16 p + c, 2 j + e]), so one prepared weight serves either
 * kernel. With no bf16 arithmetic the panel's pairs are widened to float32 in registers (the
 * even value by a shift, the odd one by a mask) once per pair of k and shared by every row
 * of the tile, and x is widened to float32 once per call, its values broadcast into the
 * FMAs. At one row this streams the weights (half the bytes of float32 ones); with many
 * rows it runs at the float32 FMA rate.
 * Tiles: up to AVX2_ROWS rows by one 16-feature panel (two 8-lane halves); the sixteen ymm
 * registers hold 2 x rows accumulators, the panel's four widened halves and two broadcasts.
 * From WIDE_MIN_ROWS rows on (prefill, large batches) the widening and the four registers
 * it ties up cost more than reading twice the bytes: each thread widens its panel pair to
 * float32 once per block of rows, into a buffer that stays in L2, and 6-row tiles run a
 * plain float32 kernel over it (12 accumulators, two panel halves, one broadcast; 12 FMAs
 * per 8 loads). Both sum every row in the same order (k ascending, one accumulator per
 * lane), so a row's result does not depend on which path or tile it lands in.
 * Requires n % 16 == 0 and k % 2 == 0. Built by build.py with -mavx2 -mfma. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "panel_tiles.h"

#define AVX2_ROWS 4
#define WIDE_ROWS 6        /* rows per tile of the float32 kernel */
#define WIDE_MIN_ROWS 24   /* products with fewer rows widen in registers: as fast up to ~24 */
#define ROW_BLOCK_BYTES (4096 * 1024)  /* of float32 x rows: weights stay in L2, x streams (see gemm_bf16.c) */

/* y[col .. col + 16) = the two 8-lane sums (+ bias), rounded to bf16. */
static inline void store_row(__m256 lo, __m256 hi, const uint16_t *bias, uint16_t *y, int64_t col) {
    float out[16];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    for (int c = 0; c < 16; c++) y[col + c] = f32_to_bf16(out[c] + (bias ? bf16_to_f32(bias[col + c]) : 0.0f));
}

/* `rows` rows of float32 x against one packed panel at `panel`, writing y[r, col .. col + 16).
 * `sets` accumulator sets take alternate pairs. Named accumulators, as in tile_wide. */
static inline __attribute__((always_inline)) void tile_avx2(
        const float *x, const uint16_t *panel, const uint16_t *bias, uint16_t *y,
        int64_t k, int64_t n_total, int64_t col, const int rows, const int sets, NextPair next) {
    const int64_t pairs = k / 2;
    int64_t prefetch_at = next.phase;
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 zero = _mm256_setzero_ps();
    /* set 0: rows 0-3, low and high halves; set 1 (at most two rows): rows 0-1 */
    __m256 l0 = zero, h0 = zero, l1 = zero, h1 = zero, l2 = zero, h2 = zero, l3 = zero, h3 = zero;
    __m256 sl0 = zero, sh0 = zero, sl1 = zero, sh1 = zero;
#define PAIR_ROW(r, lo, hi)                                                                   \
    if (rows > r) {                                                                           \
        const __m256 xe = _mm256_broadcast_ss(x + r * k + 2 * j);                             \
        const __m256 xo = _mm256_broadcast_ss(x + r * k + 2 * j + 1);                         \
        lo = _mm256_fmadd_ps(xo, lo_o, _mm256_fmadd_ps(xe, lo_e, lo));                        \
        hi = _mm256_fmadd_ps(xo, hi_o, _mm256_fmadd_ps(xe, hi_e, hi));                        \
    }
#define WIDEN_PAIR                                                                            \
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(panel + j * 32));  /* features 0-7 */ \
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(panel + j * 32 + 16)); /* 8-15 */    \
    const __m256 lo_e = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));                     \
    const __m256 lo_o = _mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask));                 \
    const __m256 hi_e = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));                     \
    const __m256 hi_o = _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask));
    for (int64_t j0 = 0; j0 < pairs; j0 += sets) {
        {
            const int64_t j = j0;
            WIDEN_PAIR
            PAIR_ROW(0, l0, h0) PAIR_ROW(1, l1, h1) PAIR_ROW(2, l2, h2) PAIR_ROW(3, l3, h3)
            prefetch_next_pair(&next, j, &prefetch_at);
        }
        if (sets == 2 && j0 + 1 < pairs) {
            const int64_t j = j0 + 1;
            WIDEN_PAIR
            PAIR_ROW(0, sl0, sh0) PAIR_ROW(1, sl1, sh1)
            prefetch_next_pair(&next, j, &prefetch_at);
        }
    }
#undef PAIR_ROW
#undef WIDEN_PAIR
    if (sets == 2) {
        l0 = _mm256_add_ps(l0, sl0), h0 = _mm256_add_ps(h0, sh0);
        l1 = _mm256_add_ps(l1, sl1), h1 = _mm256_add_ps(h1, sh1);
    }
    const __m256 sums[AVX2_ROWS][2] = {{l0, h0}, {l1, h1}, {l2, h2}, {l3, h3}};
    for (int r = 0; r < rows; r++) store_row(sums[r][0], sums[r][1], bias, y + r * n_total, col);
}

/* Pair j of a packed panel as float32: wide[2j] and wide[2j + 1], 16 features each. */
static void widen_panel(const uint16_t *panel, float *wide, int64_t k) {
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t j = 0; j < k / 2; j++) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(panel + j * 32));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(panel + j * 32 + 16));
        float *even = wide + 2 * j * 16, *odd = even + 16;
        _mm256_store_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)));
        _mm256_store_ps(even + 8, _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
        _mm256_store_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask)));
        _mm256_store_ps(odd + 8, _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask)));
    }
}

/* `rows` rows of float32 x against a widened panel [k][16], writing y[r, col .. col + 16).
 * The accumulators are named variables, not an array: GCC kept an array of them in memory,
 * storing all twelve every step (store-bound at half the FMA rate). */
static inline __attribute__((always_inline)) void tile_wide(
        const float *x, const float *wide, const uint16_t *bias, uint16_t *y,
        int64_t k, int64_t n_total, int64_t col, const int rows, NextPair next) {
    int64_t prefetch_at = next.phase;
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
    __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
#define WIDE_ROW(r, lo, hi)                                                   \
    if (rows > r) {                                                           \
        const __m256 a = _mm256_broadcast_ss(x + r * k + i);                  \
        lo = _mm256_fmadd_ps(a, b0, lo);                                      \
        hi = _mm256_fmadd_ps(a, b1, hi);                                      \
    }
    for (int64_t i = 0; i < k; i++) {
        const __m256 b0 = _mm256_load_ps(wide + i * 16), b1 = _mm256_load_ps(wide + i * 16 + 8);
        WIDE_ROW(0, l0, h0) WIDE_ROW(1, l1, h1) WIDE_ROW(2, l2, h2)
        WIDE_ROW(3, l3, h3) WIDE_ROW(4, l4, h4) WIDE_ROW(5, l5, h5)
        if (i & 1) prefetch_next_pair(&next, i >> 1, &prefetch_at);
    }
#undef WIDE_ROW
    const __m256 sums[WIDE_ROWS][2] = {{l0, h0}, {l1, h1}, {l2, h2}, {l3, h3}, {l4, h4}, {l5, h5}};
    for (int r = 0; r < rows; r++) store_row(sums[r][0], sums[r][1], bias, y + r * n_total, col);
}

static inline void panel_wide(const float *xm, const float *wide, const uint16_t *bias, uint16_t *ym,
                              int64_t k, int64_t n, int64_t col, int rows, NextPair next) {
    switch (rows) {
        case 1: tile_wide(xm, wide, bias, ym, k, n, col, 1, next); break;
        case 2: tile_wide(xm, wide, bias, ym, k, n, col, 2, next); break;
        case 3: tile_wide(xm, wide, bias, ym, k, n, col, 3, next); break;
        case 4: tile_wide(xm, wide, bias, ym, k, n, col, 4, next); break;
        case 5: tile_wide(xm, wide, bias, ym, k, n, col, 5, next); break;
        default: tile_wide(xm, wide, bias, ym, k, n, col, WIDE_ROWS, next); break;
    }
}

/* A product of at most two rows keeps a second set of accumulators for odd pairs, so the
 * FMA chains (two per pair and accumulator, ~4 cycles each) do not serialise the stream.
 * Decided by m, not by the tile: a row must sum in the same order whatever tile it lands in
 * (10 rows tile as 4 + 4 + 2; a captured 16-row replay of them as 4 x 4). */
static inline void panel_avx2(const float *xm, const uint16_t *panel, const uint16_t *bias, uint16_t *ym,
                              int64_t k, int64_t n, int64_t col, int rows, int64_t m, NextPair next) {
    if (m <= 2) {
        if (rows == 1) tile_avx2(xm, panel, bias, ym, k, n, col, 1, 2, next);
        else tile_avx2(xm, panel, bias, ym, k, n, col, 2, 2, next);
        return;
    }
    switch (rows) {
        case 1: tile_avx2(xm, panel, bias, ym, k, n, col, 1, 1, next); break;
        case 2: tile_avx2(xm, panel, bias, ym, k, n, col, 2, 1, next); break;
        case 3: tile_avx2(xm, panel, bias, ym, k, n, col, 3, 1, next); break;
        default: tile_avx2(xm, panel, bias, ym, k, n, col, AVX2_ROWS, 1, next); break;
    }
}

/* x [m, k], packed [n / 16, k / 2, 32], bias [n] or NULL, y [m, n]; all contiguous bf16.
 * Returns 1 on bad shapes, 2 when the float32 copies (of x, of a panel pair) cannot be allocated. */
int tessera_gemm_packed_bf16_avx2(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                                  uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 2 || n < 16 || k < 2) return 1;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return 2;
#pragma omp parallel for num_threads(m * k >= (1 << 16) ? threads : 1) schedule(static)
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t panels = n / 16;
    const int wide = m >= WIDE_MIN_ROWS;
    const int tile_rows = wide ? WIDE_ROWS : AVX2_ROWS;
    int64_t block = ROW_BLOCK_BYTES / (4 * k);
    block = block < tile_rows ? tile_rows : block / tile_rows * tile_rows;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* this thread's panel pair as float32 (2 x k x 16), 32-byte aligned for the loads */
        float *widened = wide ? aligned_alloc(32, sizeof(float) * 32 * (size_t)k) : NULL;
        if (wide && !widened) failed = 1;
        else FOR_EACH_PANEL_TILE(m, panels, block, tile_rows, {
            const float *xm = xf + mt * k;
            uint16_t *ym = y + mt * n;
            const uint16_t *panel = packed + p * (k / 2) * 32;
            /* this thread's next pair fetched into L2 while this one is multiplied, each
             * tile (of the first panel) a share, as in gemm_bf16.c; not at one or two rows,
             * where the hardware prefetchers keep up with the stream and this slowed it */
            const NextPair next = next_pair(next_p >= 0 && m > 2 ? packed + next_p * (k / 2) * 32 : NULL,
                                            k * 32, 64, tile_index, tiles);
            const NextPair none = next_pair(NULL, 0, 0, 0, 1);
            if (wide) {
                if (first_tile) {
                    widen_panel(panel, widened, k);
                    if (two_panels) widen_panel(panel + (k / 2) * 32, widened + 16 * k, k);
                }
                panel_wide(xm, widened, bias, ym, k, n, col, rows, next);
                if (two_panels) panel_wide(xm, widened + 16 * k, bias, ym, k, n, col + 16, rows, none);
            } else {
                panel_avx2(xm, panel, bias, ym, k, n, col, rows, m, next);
                if (two_panels) panel_avx2(xm, panel + (k / 2) * 32, bias, ym, k, n, col + 16, rows, m, none);
            }
        });
        free(widened);
    }
    free(xf);
    return failed ? 2 : 0;
}
