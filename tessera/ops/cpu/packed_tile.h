/* The register tile of the packed-panel GEMMs (gemm_bf16.c; the int8 / int4 GEMMs on panels
 * they have widened to bf16, widened_gemm.h): up to PACK_ROWS rows of x by one or two panels
 * of 16 output features, each panel holding, for every pair of k, the 16 features' two values
 * side by side, so one vdpbf16ps multiplies a broadcast pair of x against 16 features.
 *
 * Without AVX512-BF16 (simd_bf16.h) a panel pair is widened to float32 in registers once
 * per pair of k (a shift and a mask) and each row's two x values are float32 broadcasts
 * folded into the FMAs, so x comes in as float32 (TileX, widened once per call by
 * tile_x_from_bf16): the widening is shared by every row of the tile. */
#ifndef TESSERA_PACKED_TILE_H
#define TESSERA_PACKED_TILE_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panel_tiles.h"
#include "simd_bf16.h"

#if TESSERA_NATIVE_BF16
typedef uint16_t TileX;
#else
typedef float TileX;
#endif

/* x [count] bf16 as the tile reads it: itself with AVX512-BF16, else a float32 copy (NULL
 * if it cannot be allocated); release with tile_x_free. */
static inline const TileX *tile_x_from_bf16(const uint16_t *x, int64_t count, int threads) {
#if TESSERA_NATIVE_BF16
    (void)count;
    (void)threads;
    return x;
#else
    float *out = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    if (!out) return NULL;
    const int64_t full = count / 16 * 16;
#pragma omp parallel for num_threads(count >= (1 << 16) ? threads : 1) schedule(static)
    for (int64_t i = 0; i < full; i += 16)
        _mm512_storeu_ps(out + i, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(x + i))));
    for (int64_t i = full; i < count; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(out + i, &bits, sizeof bits);
    }
    return out;
#endif
}

static inline void tile_x_free(const TileX *x) {
#if TESSERA_NATIVE_BF16
    (void)x;
#else
    free((void *)x);
#endif
}

#define PACK_ROWS 12

/* `rows` rows of x against `panels` (1 or 2) consecutive packed panels starting at p. */
static inline __attribute__((always_inline)) void packed_tile(
        const TileX *x, const uint16_t *panel, const uint16_t *bias, uint16_t *y, int64_t k,
        int64_t n_total, int64_t col, const int rows, const int panels, const NextPair next) {
    const int64_t pairs = k / 2, stride = pairs * 32;  /* elements per panel */
    /* few rows: a second set of accumulators for odd pairs, so the dot-product chains
     * (latency ~6 cycles) do not serialise the stream */
    const int sets = rows <= 4 ? 2 : 1;
    __m512 acc[2][PACK_ROWS][2];
    for (int s = 0; s < sets; s++)
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[s][r][q] = _mm512_setzero_ps();
    int64_t prefetch_at = next.phase;
    for (int64_t j0 = 0; j0 < pairs; j0 += sets) {
        for (int s = 0; s < sets; s++) {
            const int64_t j = j0 + s;
            if (s && j >= pairs) break;
            prefetch_next_pair(&next, j, &prefetch_at);
            const __m512i b0 = _mm512_loadu_si512(panel + j * 32);
            const __m512i b1 = panels == 2 ? _mm512_loadu_si512(panel + stride + j * 32) : b0;
#if TESSERA_NATIVE_BF16
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * k + 2 * j, sizeof pair);
                const __m512i a = _mm512_set1_epi32(pair);
                acc[s][r][0] = dot_bf16_pairs(acc[s][r][0], a, b0);
                if (panels == 2) acc[s][r][1] = dot_bf16_pairs(acc[s][r][1], a, b1);
            }
#else
            const __m512 e0 = bf16_even_f32(b0), o0 = bf16_odd_f32(b0);
            const __m512 e1 = bf16_even_f32(b1), o1 = bf16_odd_f32(b1);
            for (int r = 0; r < rows; r++) {
                const __m512 xe = _mm512_set1_ps(x[r * k + 2 * j]), xo = _mm512_set1_ps(x[r * k + 2 * j + 1]);
                acc[s][r][0] = _mm512_fmadd_ps(xo, o0, _mm512_fmadd_ps(xe, e0, acc[s][r][0]));
                if (panels == 2) acc[s][r][1] = _mm512_fmadd_ps(xo, o1, _mm512_fmadd_ps(xe, e1, acc[s][r][1]));
            }
#endif
        }
    }
    if (sets == 2)
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[0][r][q] = _mm512_add_ps(acc[0][r][q], acc[1][r][q]);
    for (int q = 0; q < panels; q++) {
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_add_ps(acc[0][r][q], b)));
    }
}

#define PACKED_TILE_CASES(PANELS, NEXT)                                                       \
    switch (rows) {                                                                           \
        case 1: packed_tile(xm, panel, bias, ym, k, n, col, 1, PANELS, NEXT); break;          \
        case 2: packed_tile(xm, panel, bias, ym, k, n, col, 2, PANELS, NEXT); break;          \
        case 3: packed_tile(xm, panel, bias, ym, k, n, col, 3, PANELS, NEXT); break;          \
        case 4: packed_tile(xm, panel, bias, ym, k, n, col, 4, PANELS, NEXT); break;          \
        case 5: packed_tile(xm, panel, bias, ym, k, n, col, 5, PANELS, NEXT); break;          \
        case 6: packed_tile(xm, panel, bias, ym, k, n, col, 6, PANELS, NEXT); break;          \
        case 7: packed_tile(xm, panel, bias, ym, k, n, col, 7, PANELS, NEXT); break;          \
        case 8: packed_tile(xm, panel, bias, ym, k, n, col, 8, PANELS, NEXT); break;          \
        case 9: packed_tile(xm, panel, bias, ym, k, n, col, 9, PANELS, NEXT); break;          \
        case 10: packed_tile(xm, panel, bias, ym, k, n, col, 10, PANELS, NEXT); break;        \
        case 11: packed_tile(xm, panel, bias, ym, k, n, col, 11, PANELS, NEXT); break;        \
        default: packed_tile(xm, panel, bias, ym, k, n, col, PACK_ROWS, PANELS, NEXT); break; \
    }
#endif
