/* Many rows against weights stored in a compact format (gemm_int8.c, gemm_int4.c): each
 * thread widens a pair of its 16-feature panels to gemm_bf16.c's packed bf16 layout once per
 * block of rows and runs the 12-row bf16 tile (packed_tile.h) on it; x stays bf16. At many
 * rows the multiply is compute-bound, so the widening, paid once per block, is cheap next to
 * it, and the bf16 tile is the fastest multiply there is. */
#ifndef TESSERA_WIDENED_GEMM_H
#define TESSERA_WIDENED_GEMM_H
#include <stdint.h>
#include <stdlib.h>

#include "packed_tile.h"
#include "panel_tiles.h"

#define WIDE_BLOCK_BYTES (4096 * 1024)  /* of bf16 x rows, as gemm_bf16.c (see there) */
#define WIDE_MIN_BLOCK 512              /* rows of x per widening of a pair, at least (AMX build) */

/* One compact panel -> `out` (k / 2 pairs of 32 bf16), every scale applied. */
typedef void (*WidenPanel)(const uint8_t *panel, uint16_t *out, int64_t k);

/* The compact weights: panels of `panel_bytes`, whose values start `values_at` bytes in, at
 * `pair_bytes` per pair of k on average (for prefetching the next pair). */
typedef struct {
    const uint8_t *packed;
    int64_t panel_bytes, values_at, pair_bytes;
    WidenPanel widen;
} CompactPanels;

#ifdef TESSERA_AMX
#include <omp.h>

#include "amx_tiles.h"

/* The AMX build (build.py's amx family, TESSERA_AMX): each thread widens one pair of its
 * panels at a time and multiplies every row of a block of x (amx_row_block) against it on
 * AMX tiles (amx_tiles.h). Returns 0, 1 when k is not whole steps of 32, 2
 * when memory runs out, 3 where the OS refuses AMX. */
static int gemm_widened(const uint16_t *x, CompactPanels w, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 32) return 1;
    if (!amx_granted()) return 3;
    /* at least WIDE_MIN_BLOCK rows: a pair is widened once per block, and at large k (11008:
     * 32-row blocks) widening would cost more than the multiply it feeds */
    const int64_t panels = n / 16, units = (panels + 1) / 2, panel_elems = k * 16;
    const int64_t block = amx_row_block(k, WIDE_MIN_BLOCK);
    int failed;
    uint16_t *padded = amx_padded_rows(x, m, k, &failed);
    if (failed) return 2;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint16_t *wide = malloc(sizeof(uint16_t) * 2 * panel_elems);
        if (!wide) {
            failed = 1;
        } else {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
            amx_configure();
            for (int64_t m0 = 0; m0 < m; m0 += block) {  /* a pair is widened once per block */
                const int64_t rows = m - m0 < block ? m - m0 : block;
                for (int64_t u = u0; u < u1; u++) {
                    const int64_t p = 2 * u;
                    const int two = p + 1 < panels;
                    const uint8_t *compact = w.packed + p * w.panel_bytes;
                    w.widen(compact, wide, k);
                    if (two) w.widen(compact + w.panel_bytes, wide + panel_elems, k);
                    amx_pair_rows(x + m0 * k, padded, rows, k, wide, panel_elems, two, bias, y + m0 * n, n, 16 * p);
                }
            }
            _tile_release();
        }
        free(wide);
    }
    free(padded);
    return failed ? 2 : 0;
}
#else
/* y [m, n] = x [m, k] (bf16) times the widened panels (+ bias). Returns 0, or 2 when memory
 * runs out. */
static int gemm_widened(const uint16_t *x, CompactPanels w, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t panels = n / 16, pairs = k / 2;
    int64_t block = WIDE_BLOCK_BYTES / (2 * k);
    block = block < PACK_ROWS ? PACK_ROWS : block / PACK_ROWS * PACK_ROWS;
    const TileX *xt = tile_x_from_bf16(x, m * k, threads);
    if (!xt) return 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint16_t *wide = malloc(sizeof(uint16_t) * 2 * pairs * 32);
        if (!wide) {
            failed = 1;
        } else {
            FOR_EACH_PANEL_TILE(m, panels, block, PACK_ROWS, {
                const uint8_t *compact = w.packed + p * w.panel_bytes;
                if (first_tile) {
                    w.widen(compact, wide, k);
                    if (two_panels) w.widen(compact + w.panel_bytes, wide + pairs * 32, k);
                }
                /* the next pair's compact panels come into L2 meanwhile (see gemm_bf16.c) */
                const NextPair next = next_pair(
                    next_p >= 0 ? w.packed + next_p * w.panel_bytes + w.values_at : NULL,
                    w.panel_bytes, w.pair_bytes, tile_index, tiles);
                const uint16_t *panel = wide;  /* one declaration each: a top-level comma */
                const TileX *xm = xt + mt * k;  /* would split the macro's argument */
                uint16_t *ym = y + mt * n;
                if (two_panels) {
                    PACKED_TILE_CASES(2, next)
                } else {
                    PACKED_TILE_CASES(1, next)
                }
            });
        }
        free(wide);
    }
    tile_x_free(xt);
    return failed ? 2 : 0;
}
#endif
#endif
