/* Multiplying on AMX tiles (Sapphire Rapids and later Xeons): rows of x (bf16) against a pair
 * of 16-feature panels in gemm_bf16.c's packed bf16 layout (packed[p, j, 2 c + e] =
 * w[16 p + c, 2 j + e]). That layout is already AMX's B operand: 16 pairs of k of a panel
 * are 16 rows of 64 bytes, one 1 KB tile, loaded where it lies. A tiles are 16 rows of x by
 * 32 values of k, loaded with x's row stride. Tiles of 32 rows by 32 features: 2 A, 2 B and
 * 4 accumulator tiles, all 8 of AMX's; k in steps of 32 (k % 32 == 0). Rows past the last
 * whole 16 come from a zero-padded copy. Each step prefetches the next 32 k of its rows of
 * x: a tile load reads 16 lines 2 k bytes apart, which the hardware prefetchers do not
 * follow (1.3-1.5x on prefill shapes of the default model, 64-4096 rows, 2 threads), and
 * callers take x in blocks of rows that stay in L2 (amx_row_block) while every pair of
 * panels passes over them. Used by gemm_packed_amx.c (bf16 weights, as
 * stored) and widened_gemm.h's AMX build (int8 / int4 weights widened to bf16 per pair).
 * Needs -mamx-tile -mamx-bf16 -mavx512bf16 (build.py's amx family). */
#ifndef TESSERA_AMX_TILES_H
#define TESSERA_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TILE_ROWS 16
#define AMX_BLOCK_BYTES (512 * 1024)  /* of x rows per block: half of a 2 MB L2 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) AmxTileConfig;

/* Linux hands AMX's tile state to a process only when asked (once; every thread after). */
static int amx_granted(void) {
    static volatile int state = 0;  /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Rows of x [., k] per block (whole pairs of row tiles, at least `min_rows`): a block's rows
 * stay in L2 while a thread's pairs of panels pass over them, where x as a whole would stream
 * from memory once per pair (1.2-1.5x at 4096 prefill rows, or 1024 rows of k 1536). */
static inline int64_t amx_row_block(int64_t k, int64_t min_rows) {
    const int64_t rows = k > 0 ? AMX_BLOCK_BYTES / (2 * k) / (2 * AMX_TILE_ROWS) * (2 * AMX_TILE_ROWS) : min_rows;
    return rows < min_rows ? min_rows : rows;
}

/* Per thread, before its first tile instruction. */
static void amx_configure(void) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {  /* 0-3 accumulators (16 x 16 float32), 4-5 x, 6-7 weight */
        cfg.rows[t] = AMX_TILE_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x's last m % 16 rows, zero-padded to a tile (NULL when m is whole tiles, or on no memory:
 * *failed set). */
static uint16_t *amx_padded_rows(const uint16_t *x, int64_t m, int64_t k, int *failed) {
    const int64_t whole = m / AMX_TILE_ROWS * AMX_TILE_ROWS;
    *failed = 0;
    if (whole == m) return NULL;
    uint16_t *padded = (uint16_t *)calloc((size_t)(AMX_TILE_ROWS * k), sizeof(uint16_t));
    if (!padded) {
        *failed = 1;
        return NULL;
    }
    memcpy(padded, x + whole * k, (size_t)((m - whole) * k) * sizeof(uint16_t));
    return padded;
}

static inline __m512 amx_bias16(const uint16_t *bias, int64_t col) {
    if (!bias) return _mm512_setzero_ps();
    const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + col));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* An accumulator tile (stored to `acc`) plus bias, rounded to bf16 into `rows` rows of y. */
static inline void amx_store_rows(int tile_index, float *acc, const __m512 bias,
                                  uint16_t *y, int64_t n, int rows) {
    switch (tile_index) {  /* (the tile number must be a constant) */
        case 0: _tile_stored(0, acc, 64); break;
        case 1: _tile_stored(1, acc, 64); break;
        case 2: _tile_stored(2, acc, 64); break;
        default: _tile_stored(3, acc, 64); break;
    }
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), bias);
        _mm256_storeu_si256((__m256i *)(y + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The 64 bytes after `at` in each of a tile's 16 rows (`stride` elements apart) into L1;
 * past a row's end they are the next row's first, which is harmless. */
static inline void amx_prefetch_rows(const uint16_t *at, int64_t stride) {
    for (int r = 0; r < AMX_TILE_ROWS; r++) _mm_prefetch((const char *)(at + r * stride), _MM_HINT_T0);
}

#define AMX_MULTIPLY(ROW_TILES, TWO)                                                          \
    do {                                                                                      \
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                           \
        for (int64_t kk = 0; kk < k; kk += 32) {                                              \
            const uint16_t *b0 = panel0 + kk * 16;                                            \
            _tile_loadd(6, b0, 64);                                                           \
            if (TWO) _tile_loadd(7, b0 + panel_elems, 64);                                    \
            _tile_loadd(4, xa + kk, k * 2);                                                   \
            amx_prefetch_rows(xa + kk + 32, k);                                               \
            _tile_dpbf16ps(0, 4, 6);                                                          \
            if (TWO) _tile_dpbf16ps(1, 4, 7);                                                 \
            if ((ROW_TILES) == 2) {                                                           \
                _tile_loadd(5, xb + kk, k * 2);                                               \
                amx_prefetch_rows(xb + kk + 32, k);                                           \
                _tile_dpbf16ps(2, 5, 6);                                                      \
                if (TWO) _tile_dpbf16ps(3, 5, 7);                                             \
            }                                                                                 \
        }                                                                                     \
    } while (0)

/* Every row of x [m, k] against panels p (at `panel0`) and p + 1 (`panel_elems` further;
 * `two`: whether it exists), into y's columns col .. col + 32. `padded`: amx_padded_rows'
 * copy of the last rows. */
static void amx_pair_rows(const uint16_t *x, const uint16_t *padded, int64_t m, int64_t k,
                          const uint16_t *panel0, int64_t panel_elems, int two, const uint16_t *bias,
                          uint16_t *y, int64_t n, int64_t col) {
    const int64_t whole = m / AMX_TILE_ROWS * AMX_TILE_ROWS, rest = m - whole;
    const __m512 bias0 = amx_bias16(bias, col), bias1 = two ? amx_bias16(bias, col + 16) : bias0;
    float acc[AMX_TILE_ROWS * 16];
    for (int64_t m0 = 0; m0 < m; m0 += 2 * AMX_TILE_ROWS) {
        /* the two row tiles: whole ones from x, the last partial one from `padded` */
        const uint16_t *xa = m0 < whole ? x + m0 * k : padded;
        const int rows_a = m0 < whole ? AMX_TILE_ROWS : (int)rest;
        const int64_t mb = m0 + AMX_TILE_ROWS;
        const int has_b = mb < m;
        const uint16_t *xb = mb < whole ? x + mb * k : padded;
        const int rows_b = !has_b ? 0 : mb < whole ? AMX_TILE_ROWS : (int)rest;
        if (has_b) {
            if (two) AMX_MULTIPLY(2, 1); else AMX_MULTIPLY(2, 0);
        } else {
            if (two) AMX_MULTIPLY(1, 1); else AMX_MULTIPLY(1, 0);
        }
        amx_store_rows(0, acc, bias0, y + m0 * n + col, n, rows_a);
        if (two) amx_store_rows(1, acc, bias1, y + m0 * n + col + 16, n, rows_a);
        if (has_b) {
            amx_store_rows(2, acc, bias0, y + mb * n + col, n, rows_b);
            if (two) amx_store_rows(3, acc, bias1, y + mb * n + col + 16, n, rows_b);
        }
    }
}
#endif
