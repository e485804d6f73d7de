/* The loop nest shared by the packed GEMM kernels (gemm_bf16.c, gemm_int8.c), run inside an
 * OpenMP parallel region: this thread takes a contiguous share of the pairs of 16-feature
 * panels; rows of x are walked in blocks of `block` (streamed from L3 across the
 * thread's panels) and, within a block, in tiles of at most `tile_rows`. BODY sees
 * p (first panel of the pair), col (its first output feature), mt (first row of the tile),
 * rows (rows in the tile), two_panels (whether panel p + 1 exists) and first_tile (the
 * first tile of this block for this pair: where per-pair work, like widening, goes). */
#ifndef TESSERA_PANEL_TILES_H
#define TESSERA_PANEL_TILES_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* The pair of panels a thread multiplies next, fetched into L2 while this tile runs: this
 * tile takes pairs j = phase, phase + every, ... (a tile's share when a pair is walked by
 * `every` tiles), both panels' bytes of pair j. base NULL: nothing to fetch. */
typedef struct {
    const char *base;
    int64_t panel_bytes;  /* from the first panel to the second */
    int64_t pair_bytes;   /* per pair of k in a panel: 64 (bf16), 32 (int8), 20 (int4) */
    int phase, every;
} NextPair;

static inline NextPair next_pair(const void *base, int64_t panel_bytes, int64_t pair_bytes,
                                 int phase, int every) {
    NextPair next = {(const char *)base, panel_bytes, pair_bytes, phase, every};
    return next;
}

/* Called for every pair j of a tile, `at` starting at next.phase. */
static inline void prefetch_next_pair(const NextPair *next, int64_t j, int64_t *at) {
    if (next->base && j == *at) {
        _mm_prefetch(next->base + j * next->pair_bytes, _MM_HINT_T1);
        _mm_prefetch(next->base + next->panel_bytes + j * next->pair_bytes, _MM_HINT_T1);
        *at += next->every;
    }
}

#define FOR_EACH_PANEL_TILE(m, panels, block, tile_rows, BODY)                             \
    do {                                                                                   \
        const int64_t units_ = ((panels) + 1) / 2;                                         \
        const int64_t t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();              \
        const int64_t u0_ = units_ * t_ / nt_, u1_ = units_ * (t_ + 1) / nt_;              \
        for (int64_t m0_ = 0; m0_ < (m); m0_ += (block)) {                                 \
            const int64_t m1_ = m0_ + (block) < (m) ? m0_ + (block) : (m);                 \
            /* balanced tiles: 16 rows are 8 + 8, not 12 + 4 */                            \
            const int tiles = (int)((m1_ - m0_ + (tile_rows) - 1) / (tile_rows));          \
            const int64_t step_ = (m1_ - m0_ + tiles - 1) / tiles;                         \
            for (int64_t u_ = u0_; u_ < u1_; u_++) {                                       \
                const int64_t p = 2 * u_, col = 16 * p;                                    \
                const int64_t next_p = u_ + 1 < u1_ ? p + 2 : -1;                          \
                const int two_panels = p + 1 < (panels);                                   \
                int tile_index = 0;                                                        \
                for (int64_t mt = m0_; mt < m1_; mt += step_, tile_index++) {              \
                    const int rows = m1_ - mt < step_ ? (int)(m1_ - mt) : (int)step_;      \
                    const int first_tile = mt == m0_;                                      \
                    (void)first_tile;                                                      \
                    (void)next_p;                                                          \
                    (void)tile_index;                                                      \
                    BODY                                                                   \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)
#endif
