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
 * Requires n % 16 == 0 and k % 2 == 0. Built by build.py with -mavx2 -mfma. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "panel_tiles.h"

#define AVX2_ROWS 4
#define ROW_BLOCK_BYTES (4096 * 1024)  /* of float32 x rows: weights stay in L2, x streams (see gemm_bf16.c) */

/* `rows` rows of float32 x against one packed panel at `panel`, writing y[r, col .. col + 16). */
static inline __attribute__((always_inline)) void tile_avx2(
        const float *x, const uint16_t *panel, const uint16_t *bias, uint16_t *y,
        int64_t k, int64_t n_total, int64_t col, const int rows, const int sets) {
    const int64_t pairs = k / 2;
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[2][AVX2_ROWS][2];
    for (int s = 0; s < sets; s++)
        for (int r = 0; r < rows; r++) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < pairs; j0 += sets) {
        for (int s = 0; s < sets; s++) {
            const int64_t j = j0 + s;
            if (s && j >= pairs) break;
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(panel + j * 32));       /* features 0-7 */
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(panel + j * 32 + 16));  /* features 8-15 */
            const __m256 lo_e = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
            const __m256 lo_o = _mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask));
            const __m256 hi_e = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
            const __m256 hi_o = _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask));
            for (int r = 0; r < rows; r++) {
                const __m256 xe = _mm256_broadcast_ss(x + r * k + 2 * j);
                const __m256 xo = _mm256_broadcast_ss(x + r * k + 2 * j + 1);
                acc[s][r][0] = _mm256_fmadd_ps(xo, lo_o, _mm256_fmadd_ps(xe, lo_e, acc[s][r][0]));
                acc[s][r][1] = _mm256_fmadd_ps(xo, hi_o, _mm256_fmadd_ps(xe, hi_e, acc[s][r][1]));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[16];
        _mm256_storeu_ps(out, sets == 2 ? _mm256_add_ps(acc[0][r][0], acc[1][r][0]) : acc[0][r][0]);
        _mm256_storeu_ps(out + 8, sets == 2 ? _mm256_add_ps(acc[0][r][1], acc[1][r][1]) : acc[0][r][1]);
        uint16_t *yr = y + r * n_total + col;
        for (int c = 0; c < 16; c++) yr[c] = f32_to_bf16(out[c] + (bias ? bf16_to_f32(bias[col + c]) : 0.0f));
    }
}

/* A product of at most two rows keeps a second set of accumulators for odd pairs, so the
 * FMA chains (two per pair and accumulator, ~4 cycles each) do not serialise the stream.
 * Decided by m, not by the tile: a row must sum in the same order whatever tile it lands in
 * (10 rows tile as 4 + 4 + 2; a captured 16-row replay of them as 4 x 4). */
static inline void panel_avx2(const float *xm, const uint16_t *panel, const uint16_t *bias, uint16_t *ym,
                              int64_t k, int64_t n, int64_t col, int rows, int64_t m) {
    if (m <= 2) {
        if (rows == 1) tile_avx2(xm, panel, bias, ym, k, n, col, 1, 2);
        else tile_avx2(xm, panel, bias, ym, k, n, col, 2, 2);
        return;
    }
    switch (rows) {
        case 1: tile_avx2(xm, panel, bias, ym, k, n, col, 1, 1); break;
        case 2: tile_avx2(xm, panel, bias, ym, k, n, col, 2, 1); break;
        case 3: tile_avx2(xm, panel, bias, ym, k, n, col, 3, 1); break;
        default: tile_avx2(xm, panel, bias, ym, k, n, col, AVX2_ROWS, 1); break;
    }
}

/* x [m, k], packed [n / 16, k / 2, 32], bias [n] or NULL, y [m, n]; all contiguous bf16.
 * Returns 1 on bad shapes, 2 when the float32 copy of x cannot be allocated. */
int tessera_gemm_packed_bf16_avx2(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                                  uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 2 || n < 16 || k < 2) return 1;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (!xf) return 2;
#pragma omp parallel for num_threads(m * k >= (1 << 16) ? threads : 1) schedule(static)
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t panels = n / 16;
    int64_t block = ROW_BLOCK_BYTES / (4 * k);
    block = block < AVX2_ROWS ? AVX2_ROWS : block / AVX2_ROWS * AVX2_ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, AVX2_ROWS, {
        const float *xm = xf + mt * k;
        uint16_t *ym = y + mt * n;
        const uint16_t *panel = packed + p * (k / 2) * 32;
        panel_avx2(xm, panel, bias, ym, k, n, col, rows, m);
        if (two_panels) panel_avx2(xm, panel + (k / 2) * 32, bias, ym, k, n, col + 16, rows, m);
    });
    free(xf);
    return 0;
}
