/* y[m, n] = x[m, k] times int8 weights (+ bias[n]) on CPUs with AVX2 but no AVX512 (AMD
 * Zen 2/3, Intel client cores): the AVX2 twin of gemm_int8.c, same symbol, same packed int8
 * panels (per 16 output features and group of 32 k: their 16 float16 steps, then per pair of
 * k the 16 features' two values side by side), so one prepared weight serves either build.
 *
 * Arithmetic as gemm_int8.c's int16 tiles: each row of x is scaled to 15-bit integers
 * (int16_rows.h), the weights of a pair are sign-extended to int16 (one vpmovsxbw per 8
 * features), and vpmaddwd multiplies a broadcast pair of x against 8 features' pairs into
 * int32 lanes; per group the exact int32 sums times the step go to float32 sums (times the feature's scale
 * at the end), which live
 * in memory (the sixteen ymm registers hold the int32 accumulators, the sign-extended
 * weights and the broadcast). A row's result does not depend on the tile it lands in, and
 * matches the AVX512 build's int16 tiles. vpmaddwd runs at about the FMA rate here, so unlike
 * the AVX512 build there is no widened path for many rows: these tiles stayed ahead of the
 * bf16 AVX2 GEMM's float32 FMAs at every row count measured, 1 to 128 (docs/benchmarks.md,
 * session 6). Tiles: up to 3 rows by both panels of a pair (4 int32 accumulators per row), or
 * up to 6 rows by one panel. The steps widen through F16C (enabled for this file; the builder
 * checks the CPU). Requires n % 16 == 0 and k % 32 == 0. Built by build.py with -mavx2 -mfma. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int16_rows.h"
#include "panel_tiles.h"

#pragma GCC target("f16c")

#define GROUP 32
#define GROUP_PAIRS (GROUP / 2)
#define GROUP_BYTES 544              /* 32 bytes of float16 steps, 16 pairs x 32 bytes */
#define PAIR_BYTES (GROUP_BYTES / GROUP_PAIRS)
#define HEAD_BYTES 64                /* a panel's 16 float32 scales, before its groups */
#define ROWS 6
#define PAIR_ROWS 3                  /* rows of a tile that takes both panels */
#define ROW_BLOCK_BYTES (96 * 1024)  /* of int16 x rows, as gemm_int8.c */

static inline __attribute__((always_inline)) void tile_i16(
        const int16_t *x, const float *x_scale, const int8_t *panel, int64_t panel_bytes,
        const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total, int64_t col,
        const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    /* float32 sums in memory, touched once per group: the sixteen registers are the int32
     * accumulators', the weights' and the broadcast's */
    float total[ROWS][2][16];
    memset(total, 0, sizeof total);
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *g0 = panel + HEAD_BYTES + g * GROUP_BYTES, *g1 = g0 + panel_bytes;
        __m256i acc[ROWS][2][2];
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < panels; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_si256();
        for (int j = 0; j < GROUP_PAIRS; j++) {
            prefetch_next_pair(&next, g * GROUP_PAIRS + j, &prefetch_at);
            __m256i w[2][2];
            w[0][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g0 + 32 + j * 32)));
            w[0][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g0 + 32 + j * 32 + 16)));
            if (panels == 2) {
                w[1][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g1 + 32 + j * 32)));
                w[1][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g1 + 32 + j * 32 + 16)));
            }
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * k + g * GROUP + 2 * j, sizeof pair);
                const __m256i a = _mm256_set1_epi32(pair);
                for (int p = 0; p < panels; p++)
                    for (int h = 0; h < 2; h++)
                        acc[r][p][h] = _mm256_add_epi32(acc[r][p][h], _mm256_madd_epi16(a, w[p][h]));
            }
        }
        for (int p = 0; p < panels; p++)
            for (int h = 0; h < 2; h++) {
                const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p ? g1 : g0) + 16 * h)));
                for (int r = 0; r < rows; r++) {
                    float *sum = total[r][p] + 8 * h;
                    _mm256_storeu_ps(sum, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][p][h]), step,
                                                          _mm256_loadu_ps(sum)));
                }
            }
    }
    for (int p = 0; p < panels; p++)
        for (int h = 0; h < 2; h++) {
            const int64_t c = col + 16 * p + 8 * h;
            float b[8] = {0};
            if (bias)
                for (int i = 0; i < 8; i++) b[i] = bf16_to_f32(bias[c + i]);
            const __m256 bv = _mm256_loadu_ps(b);
            const __m256 ws = _mm256_loadu_ps((const float *)(panel + p * panel_bytes) + 8 * h);
            for (int r = 0; r < rows; r++) {
                float out[8];
                _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(total[r][p] + 8 * h),
                                                      _mm256_mul_ps(ws, _mm256_set1_ps(x_scale[r])), bv));
                for (int i = 0; i < 8; i++) y[r * n_total + c + i] = f32_to_bf16(out[i]);
            }
        }
}

#define TILE(PANEL, COL, ROWS_, PANELS_) \
    tile_i16(xm, xs, PANEL, panel_bytes, bias, ym, k, n, COL, ROWS_, PANELS_, next)

/* x [m, k] bf16, packed [n / 16, 64 + 17 k] int8, bias [n] bf16 or NULL, y [m, n] bf16.
 * Returns 1 on bad shapes, 2 when the int16 copy of x cannot be allocated. */
int tessera_gemm_int8(const uint16_t *x, const int8_t *packed, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % GROUP || n < 16 || k < GROUP) return 1;
    int16_t *xq;
    float *x_scale;
    if (quantize_rows(x, m, k, threads, &xq, &x_scale)) return 2;
    const int64_t panels = n / 16, panel_bytes = HEAD_BYTES + k / GROUP * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
    /* tiles of up to 3 rows take both panels in one pass over x; wider ones one at a time */
    const int tile_rows = m <= PAIR_ROWS ? PAIR_ROWS : ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, tile_rows, {
        const int8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes + HEAD_BYTES : NULL,
                                        panel_bytes, PAIR_BYTES, tile_index, tiles);
        const int16_t *xm = xq + mt * k;
        const float *xs = x_scale + mt;
        uint16_t *ym = y + mt * n;
        if (tile_rows == PAIR_ROWS && two_panels) {
            switch (rows) {
                case 1: TILE(panel, col, 1, 2); break;
                case 2: TILE(panel, col, 2, 2); break;
                default: TILE(panel, col, PAIR_ROWS, 2); break;
            }
        } else {
            for (int q = 0; q <= two_panels; q++) {
                const int8_t *pq = panel + q * panel_bytes;
                const int64_t cq = col + 16 * q;
                switch (rows) {
                    case 1: TILE(pq, cq, 1, 1); break;
                    case 2: TILE(pq, cq, 2, 1); break;
                    case 3: TILE(pq, cq, 3, 1); break;
                    case 4: TILE(pq, cq, 4, 1); break;
                    case 5: TILE(pq, cq, 5, 1); break;
                    default: TILE(pq, cq, ROWS, 1); break;
                }
            }
        }
    });
    free(x_scale);  /* xq shares its allocation */
    return 0;
}
