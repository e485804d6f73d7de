/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bfloat16 in and out, float32 accumulation,
 * on the checkpoint's own [n, k] layout (no repacking, so the same weight serves every
 * batch size and every other reader).
 *
 * Decode multiplies a few rows by every weight matrix. At one row the job is to stream `w`
 * at memory bandwidth; at 8-64 rows it is compute: torch's bf16 GEMM reaches ~200 GFLOP/s
 * there on the 2-core host, about half of what AVX512-BF16 allows. The loop order serves
 * both: each thread owns a contiguous range of output features; four rows of w (a few KB,
 * resident in L1) are walked against a tile of up to six rows of x, so each w load feeds
 * six dot products and each x load four; vdpbf16ps multiplies 32 bf16 pairs per
 * instruction. Rows of x are taken in blocks of up to 4 MB, so large batches re-read w once
 * per block instead of once per tile. The 24 accumulators of a tile are summed four at a
 * time by a transpose-and-add instead of 24 separate horizontal reductions.
 * Built by tessera/ops/cpu/build.py (-mavx512bf16 where the CPU has it; simd_bf16.h). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"
#include "bf16.h"
#include "packed_tile.h"
#include "panel_tiles.h"
#include "simd_bf16.h"

#define ROW_TILE 6        /* rows of x per register tile: 6 x 4 accumulators + 4 w + 1 x */
/* rows of x walked per pass over the weights. The weights' working set (a panel pair, or
 * four rows) stays in L2 while the block of x streams from L3; blocks sized to L2 instead
 * (192 KB) re-read a 512 KB panel pair every 12 rows at k = 8192: 1.35x slower prefill */
#define ROW_BLOCK_BYTES (4096 * 1024)

static inline __m512i load_bf16(const uint16_t *p, __mmask32 mask) {
    return _mm512_maskz_loadu_epi16(mask, p);
}

/* One register tile: `rows` rows of x (a compile-time constant after inlining) against the
 * four rows of w in `wr`, writing y[r, n .. n + cols). */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, const uint16_t *const wr[4], const float bias4[4], uint16_t *y,
        const int rows, int64_t k, int64_t n_total, int64_t n, int cols) {
    const int64_t full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1ull);
    __m512 acc[ROW_TILE][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
#define TILE_STEP(i, LOAD)                                                                  \
    do {                                                                                    \
        const __m512i b0 = LOAD(wr[0] + (i)), b1 = LOAD(wr[1] + (i));                       \
        const __m512i b2 = LOAD(wr[2] + (i)), b3 = LOAD(wr[3] + (i));                       \
        for (int r = 0; r < rows; r++) {                                                    \
            const __m512i a = LOAD(x + r * k + (i));                                        \
            acc[r][0] = dot_bf16_pairs(acc[r][0], a, b0);                                   \
            acc[r][1] = dot_bf16_pairs(acc[r][1], a, b1);                                   \
            acc[r][2] = dot_bf16_pairs(acc[r][2], a, b2);                                   \
            acc[r][3] = dot_bf16_pairs(acc[r][3], a, b3);                                   \
        }                                                                                   \
    } while (0)
#define LOAD_FULL(p) _mm512_loadu_si512((const void *)(p))
#define LOAD_TAIL(p) load_bf16((p), tail)
    for (int64_t i = 0; i < full; i += 32) TILE_STEP(i, LOAD_FULL);
    if (full < k) TILE_STEP(full, LOAD_TAIL);
    const __m128 b = _mm_loadu_ps(bias4);
    for (int r = 0; r < rows; r++) {
        const __m128 s = _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b);
        const __m128i packed = f32x4_to_bf16(s);  /* round to nearest even */
        uint16_t *out = y + r * n_total + n;
        if (cols == 4) {
            _mm_storel_epi64((__m128i *)out, packed);
        } else {
            uint16_t tmp[8];
            _mm_storeu_si128((__m128i *)tmp, packed);
            memcpy(out, tmp, (size_t)cols * sizeof(uint16_t));
        }
    }
}

/* Output features [n0, n1) for rows [m0, m1) of x. */
static void gemm_range(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t m0, int64_t m1, int64_t n_total, int64_t n0, int64_t n1, int64_t k) {
    for (int64_t n = n0; n < n1; n += 4) {
        const int cols = n1 - n < 4 ? (int)(n1 - n) : 4;
        const uint16_t *wr[4];
        float bias4[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < 4; j++) {
            wr[j] = w + (n + (j < cols ? j : 0)) * k;  /* tail: reread row n, results dropped */
            if (bias && j < cols) bias4[j] = bf16_to_f32(bias[n + j]);
        }
        for (int64_t m = m0; m < m1; m += ROW_TILE) {
            const uint16_t *xm = x + m * k;
            uint16_t *ym = y + m * n_total;
            switch (m1 - m < ROW_TILE ? (int)(m1 - m) : ROW_TILE) {
                case 1: tile(xm, wr, bias4, ym, 1, k, n_total, n, cols); break;
                case 2: tile(xm, wr, bias4, ym, 2, k, n_total, n, cols); break;
                case 3: tile(xm, wr, bias4, ym, 3, k, n_total, n, cols); break;
                case 4: tile(xm, wr, bias4, ym, 4, k, n_total, n, cols); break;
                case 5: tile(xm, wr, bias4, ym, 5, k, n_total, n, cols); break;
                default: tile(xm, wr, bias4, ym, ROW_TILE, k, n_total, n, cols); break;
            }
        }
    }
}

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; all contiguous bf16. */
int tessera_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n < 1 || k < 1) return 1;
    const int64_t groups = (n + 3) / 4;  /* threads split whole groups of four features */
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROW_TILE ? ROW_TILE : block / ROW_TILE * ROW_TILE;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        const int64_t n0 = g0 * 4, n1 = g1 * 4 < n ? g1 * 4 : n;
        for (int64_t m0 = 0; m0 < m && n0 < n1; m0 += block)
            gemm_range(x, w, bias, y, m0, m0 + block < m ? m0 + block : m, n, n0, n1, k);
    }
    return 0;
}

/* ---- Packed weights -------------------------------------------------------------------
 * The same product on weights repacked once after loading into panels of 16 output
 * features: packed[p, j, 2 * c + e] = w[16 p + c, 2 j + e], i.e. for each pair of k, the 16
 * features' two values side by side, exactly what one vdpbf16ps multiplies against a
 * broadcast pair of x. Each panel is one contiguous run of 32 * k bytes, so a thread
 * streams long sequential runs (the row layout above walks four short rows at once, which
 * the prefetchers follow poorly: 20 vs 28 GB/s over the default model's weights at one
 * row), and the outputs land in lanes (no horizontal sums). Tiles: up to 12 rows of x by
 * two panels (24 accumulators); rows of x in blocks, as above.
 * Requires n % 16 == 0 and k % 2 == 0; packed by tessera/ops/cpu/linear.py:pack_weight. */

/* x [m, k], packed [n / 16, k / 2, 32], bias [n] or NULL, y [m, n]; all contiguous bf16.
 * Returns 1 on bad shapes, 2 when the float32 copy of x (no AVX512-BF16) cannot be allocated. */
int tessera_gemm_packed_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                             uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 2 || n < 16 || k < 2) return 1;
    const TileX *xt = tile_x_from_bf16(x, m * k, threads);
    if (!xt) return 2;
    const int64_t panels = n / 16;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < PACK_ROWS ? PACK_ROWS : block / PACK_ROWS * PACK_ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, PACK_ROWS, {
        const uint16_t *panel = packed + p * (k / 2) * 32;
        const TileX *xm = xt + mt * k;
        uint16_t *ym = y + mt * n;
        /* fetch this thread's next pair into L2 while this one is multiplied, each tile a
         * share: without it a pair's first tile waited on memory and the rest on the
         * arithmetic (the sum of both; now the larger): 32 rows 29.0 -> 23.1 ms, 8 rows
         * 16.1 -> 11.0 ms over the default model's matrices */
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * (k / 2) * 32 : NULL,
                                        k * 32, 64, tile_index, tiles);
        if (two_panels) {
            PACKED_TILE_CASES(2, next)
        } else {
            PACKED_TILE_CASES(1, next)
        }
    });
    tile_x_free(xt);
    return 0;
}
