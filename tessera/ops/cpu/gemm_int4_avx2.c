/* y[m, n] = x[m, k] times int4 weights (+ bias[n]) on CPUs with AVX2 but no AVX512 (AMD
 * Zen 2/3, Intel client cores): the AVX2 twin of gemm_int4.c, same symbol, same packed
 * panels (per 16 output features and group of 32 k: 16 float16 steps, 16 float16 offsets,
 * 8 chunks of 32 bytes), so one prepared weight serves either build.
 *
 * Arithmetic (one to three rows, and prompts) as gemm_int4.c's int16 tiles: x rows scaled to
 * 15-bit integers (int16_rows.h);
 * per chunk and half panel (8 features), 16 bytes zero-extended to int16 give, after a mask,
 * the pair (4t, 4t+1) of each feature and, after a shift, the pair (4t+2, 4t+3), which
 * vpmaddwd multiplies against broadcast pairs of x; per group, sum_k w x = d * that +
 * m * sum x. The float32 sums live in memory, touched once per group: the sixteen ymm
 * registers hold the int32 accumulators, the codes and the broadcasts. As in gemm_int8_avx2.c
 * there is no widened path for many rows: vpmaddwd runs about at the rate of the float32
 * FMAs that the bf16 AVX2 GEMM would use. Tiles: up to 2 rows by both panels of a pair, or
 * up to 4 rows by one panel.
 *
 * Decode batches (Q8_MIN_ROWS to Q8_END_ROWS rows, as gemm_int4.c's AVX512-VNNI build): x
 * rounded to 8 bits per group of 32 (int8_rows.h), and vpmaddubsw multiplies each feature's
 * four codes (as its lane's four bytes) by four bytes of x into two int16 sums of at most
 * 2 * 15 * 127; a group's eight chunks add up in int16 lanes (at most 30480: exact), so one
 * vpmaddwd per group and feature half moves them to int32. That is two instructions per four
 * k and eight features where the int16 tiles take four. Tiles: 4 rows by one panel.
 *
 * The step and offset widen through F16C (enabled for this file; the builder checks the CPU).
 * Requires n % 16 == 0 and k % 32 == 0. Built by build.py with -mavx2 -mfma. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int16_rows.h"
#include "int8_rows.h"
#include "panel_tiles.h"

#pragma GCC target("f16c")

#define GROUP 32
#define GROUP_BYTES 320
#define CHUNKS (GROUP / 4)
#define ROWS 4
#define PAIR_ROWS 2                  /* rows of a tile that takes both panels */
#define ROW_BLOCK_BYTES (96 * 1024)  /* of x rows, int16 or int8, as gemm_int4.c */
#ifndef Q8_MIN_ROWS                  /* passed by linear_int4.py (INT8_X_ROWS) */
#define Q8_MIN_ROWS 4
#endif
#ifndef Q8_END_ROWS
#define Q8_END_ROWS 33
#endif

static inline __attribute__((always_inline)) void tile_i16(
        const int16_t *x, const float *x_scale, const float *x_sums, const uint8_t *panel,
        int64_t panel_bytes, const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total,
        int64_t col, const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    float total[ROWS][2][16];
    memset(total, 0, sizeof total);
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[ROWS][2][2];
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < panels; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_si256();
        for (int t = 0; t < CHUNKS; t++) {
            prefetch_next_pair(&next, g * CHUNKS + t, &prefetch_at);
            for (int p = 0; p < panels; p++)
                for (int h = 0; h < 2; h++) {  /* features 8h .. 8h + 7 */
                    const uint8_t *chunk = panel + p * panel_bytes + g * GROUP_BYTES + 64 + 32 * t + 16 * h;
                    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)chunk));
                    const __m256i lo = _mm256_and_si256(words, _mm256_set1_epi16(15));
                    const __m256i hi = _mm256_srli_epi16(words, 4);
                    for (int r = 0; r < rows; r++) {
                        int32_t pairs[2];
                        memcpy(pairs, x + r * k + g * GROUP + 4 * t, sizeof pairs);
                        const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_set1_epi32(pairs[0]), lo),
                                                           _mm256_madd_epi16(_mm256_set1_epi32(pairs[1]), hi));
                        acc[r][p][h] = _mm256_add_epi32(acc[r][p][h], d);
                    }
                }
        }
        for (int p = 0; p < panels; p++) {
            const uint8_t *head = panel + p * panel_bytes + g * GROUP_BYTES;
            for (int h = 0; h < 2; h++) {
                const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h)));
                const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32 + 16 * h)));
                for (int r = 0; r < rows; r++) {
                    float *sum = total[r][p] + 8 * h;
                    __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][p][h]), step, _mm256_loadu_ps(sum));
                    s = _mm256_fmadd_ps(offset, _mm256_set1_ps(x_sums[r * groups + g]), s);
                    _mm256_storeu_ps(sum, s);
                }
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
            for (int r = 0; r < rows; r++) {
                float out[8];
                _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(total[r][p] + 8 * h),
                                                      _mm256_set1_ps(x_scale[r]), bv));
                for (int i = 0; i < 8; i++) y[r * n_total + c + i] = f32_to_bf16(out[i]);
            }
        }
}

/* Four codes of each of 8 features as its lane's four bytes, k in order (gemm_int4.c's
 * chunk_bytes on half a chunk): lanes v = c0 | c2 << 4 | c1 << 8 | c3 << 12 become
 * (v | v << 12) & 0x0F0F0F0F. */
static inline __m256i half_chunk_bytes(const uint8_t *half) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)half));
    return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F));
}

/* Up to ROWS rows of 8-bit x (int8_rows.h) by one panel. */
static inline __attribute__((always_inline)) void tile_q8(
        const int8_t *x, const float *x_steps, const float *x_sums, const uint8_t *panel,
        const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total, int64_t col, const int rows,
        const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    float total[ROWS][16];
    memset(total, 0, sizeof total);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = panel + g * GROUP_BYTES;
        __m256i acc[ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int t = 0; t < CHUNKS; t++) {
            prefetch_next_pair(&next, g * CHUNKS + t, &prefetch_at);
            const __m256i w0 = half_chunk_bytes(head + 64 + 32 * t), w1 = half_chunk_bytes(head + 80 + 32 * t);
            for (int r = 0; r < rows; r++) {
                int32_t quad;
                memcpy(&quad, x + r * k + g * GROUP + 4 * t, sizeof quad);
                const __m256i a = _mm256_set1_epi32(quad);
                acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, a));
                acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, a));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h)));
            const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32 + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const float step_x = x_steps[r * groups + g];
                const __m256i sums = _mm256_madd_epi16(acc[r][h], _mm256_set1_epi16(1));
                float *sum = total[r] + 8 * h;
                __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(step, _mm256_set1_ps(step_x)),
                                           _mm256_loadu_ps(sum));
                s = _mm256_fmadd_ps(offset, _mm256_set1_ps(step_x * x_sums[r * groups + g]), s);
                _mm256_storeu_ps(sum, s);
            }
        }
    }
    float b[16] = {0};
    if (bias)
        for (int i = 0; i < 16; i++) b[i] = bf16_to_f32(bias[col + i]);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 16; i++) y[r * n_total + col + i] = f32_to_bf16(total[r][i] + b[i]);
}

static int gemm_q8(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k, int threads) {
    int8_t *xq;
    float *x_steps, *x_sums;
    if (quantize_rows8(x, m, k, threads, &xq, &x_steps, &x_sums)) return 2;
    const int64_t groups = k / GROUP, panels = n / 16, panel_bytes = groups * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / k;
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS, {
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes : NULL,
                                        panel_bytes, 40, tile_index, tiles);
        for (int q = 0; q <= two_panels; q++) {
            const uint8_t *pq = packed + (p + q) * panel_bytes;
            const int8_t *xm = xq + mt * k;
            const float *xs = x_steps + mt * groups;  /* one declaration each: a top-level comma */
            const float *sums = x_sums + mt * groups;  /* would split the macro's argument */
            uint16_t *ym = y + mt * n;
            switch (rows) {
                case 1: tile_q8(xm, xs, sums, pq, bias, ym, k, n, col + 16 * q, 1, next); break;
                case 2: tile_q8(xm, xs, sums, pq, bias, ym, k, n, col + 16 * q, 2, next); break;
                case 3: tile_q8(xm, xs, sums, pq, bias, ym, k, n, col + 16 * q, 3, next); break;
                default: tile_q8(xm, xs, sums, pq, bias, ym, k, n, col + 16 * q, ROWS, next); break;
            }
        }
    });
    free(x_steps);  /* the codes and sums share its allocation */
    return 0;
}

#define TILE(PANEL, COL, ROWS_, PANELS_) \
    tile_i16(xm, xs, sums, PANEL, panel_bytes, bias, ym, k, n, COL, ROWS_, PANELS_, next)

/* x [m, k] bf16, packed [n / 16, 10 k] uint8, bias [n] bf16 or NULL, y [m, n] bf16.
 * Returns 1 on bad shapes, 2 when a copy of x cannot be allocated. */
int tessera_gemm_int4(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % GROUP || n < 16 || k < GROUP) return 1;
    if (m >= Q8_MIN_ROWS && m < Q8_END_ROWS) return gemm_q8(x, packed, bias, y, m, n, k, threads);
    int16_t *xq;
    float *x_scale, *x_sums;
    if (quantize_grouped_rows(x, m, k, threads, GROUP, &xq, &x_scale, &x_sums)) return 2;
    const int64_t groups = k / GROUP, panels = n / 16, panel_bytes = groups * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
    /* tiles of up to 2 rows take both panels in one pass over x; wider ones one at a time */
    const int tile_rows = m <= PAIR_ROWS ? PAIR_ROWS : ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, tile_rows, {
        const uint8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes : NULL,
                                        panel_bytes, 40, tile_index, tiles);
        const int16_t *xm = xq + mt * k;
        const float *xs = x_scale + mt;  /* one declaration each: a top-level comma */
        const float *sums = x_sums + mt * groups;  /* would split the macro's argument */
        uint16_t *ym = y + mt * n;
        if (tile_rows == PAIR_ROWS && two_panels) {
            switch (rows) {
                case 1: TILE(panel, col, 1, 2); break;
                default: TILE(panel, col, PAIR_ROWS, 2); break;
            }
        } else {
            for (int q = 0; q <= two_panels; q++) {
                const uint8_t *pq = panel + q * panel_bytes;
                const int64_t cq = col + 16 * q;
                switch (rows) {
                    case 1: TILE(pq, cq, 1, 1); break;
                    case 2: TILE(pq, cq, 2, 1); break;
                    case 3: TILE(pq, cq, 3, 1); break;
                    default: TILE(pq, cq, ROWS, 1); break;
                }
            }
        }
    });
    free(x_sums);
    free(x_scale);  /* xq shares its allocation */
    return 0;
}
