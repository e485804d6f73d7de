/* y[m, n] = x[m, k] times the packed bf16 weight (+ bias[n]) on AMX tiles (Sapphire Rapids
 * and later Xeons), bfloat16 in and out, float32 accumulation.
 *
 * The packed layout of gemm_bf16.c (packed[p, j, 2 c + e] = w[16 p + c, 2 j + e]) is already
 * what AMX's bf16 dot product takes as its B operand: 16 rows of one panel (pairs of k
 * j .. j + 15) are 16 rows of 64 bytes, one 1 KB tile, each row the 16 features' two values
 * of one pair of k. So no copy of the weight is made: a tile is loaded from the panel as it
 * lies. A tiles are 16 rows of x by 32 values of k, loaded with x's row stride.
 *
 * Each thread takes a contiguous share of the pairs of panels (as the AVX512 kernel) and
 * multiplies every row of x against its pair while the pair stays in L1 / L2: tiles of 32
 * rows by 32 features (2 A, 2 B and 4 accumulator tiles, all 8 of AMX's), k in steps of 32.
 * Rows past the last whole 16 are copied, zero-padded, into a 16-row buffer first.
 * Requires n % 16 == 0 and k % 32 == 0; AMX must be granted to the process (Linux: an
 * arch_prctl once, done here). Built by build.py for CPUs with amx_tile and amx_bf16. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Linux hands AMX's tile state to a process only when asked (once; every thread after). */
static int amx_granted(void) {
    static volatile int state = 0;  /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {  /* 0-3 accumulators (16 x 16 float32), 4-5 x, 6-7 weight */
        cfg.rows[t] = TILE_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 accumulated rows (a 16 x 16 float32 tile stored to `acc`) plus bias, rounded to bf16
 * into y's `rows` rows at column col. */
static inline void store_rows(const float *acc, const __m512 bias, uint16_t *y, int64_t n, int rows) {
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), bias);
        _mm256_storeu_si256((__m256i *)(y + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

static inline __m512 bias16(const uint16_t *bias, int64_t col) {
    if (!bias) return _mm512_setzero_ps();
    const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + col));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* Rows [m0, m0 + 32) of x (stride xs elements) against panels p and p + 1 (`two`): tile
 * rows of 16, `row_tiles` of them (1 or 2). */
#define MULTIPLY(ROW_TILES, TWO)                                                              \
    do {                                                                                      \
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                           \
        for (int64_t kk = 0; kk < k; kk += 32) {                                              \
            const uint16_t *b0 = panel0 + kk * 16;                                            \
            _tile_loadd(6, b0, 64);                                                           \
            if (TWO) _tile_loadd(7, b0 + panel_elems, 64);                                    \
            _tile_loadd(4, xa + kk, xs * 2);                                                  \
            _tile_dpbf16ps(0, 4, 6);                                                          \
            if (TWO) _tile_dpbf16ps(1, 4, 7);                                                 \
            if ((ROW_TILES) == 2) {                                                           \
                _tile_loadd(5, xb + kk, xs * 2);                                              \
                _tile_dpbf16ps(2, 5, 6);                                                      \
                if (TWO) _tile_dpbf16ps(3, 5, 7);                                             \
            }                                                                                 \
        }                                                                                     \
    } while (0)

/* x [m, k], packed [n / 16, k / 2, 32], bias [n] or NULL, y [m, n]; all contiguous bf16.
 * Returns 1 on shapes it does not take, 3 where the OS refuses AMX, 2 without memory for
 * the padded rows. */
int tessera_gemm_packed_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                            uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 32 || n < 16) return 1;
    if (!amx_granted()) return 3;
    const int64_t panels = n / 16, pairs = (panels + 1) / 2, panel_elems = k * 16;
    const int64_t whole = m / TILE_ROWS * TILE_ROWS, rest = m - whole;
    uint16_t *padded = NULL;  /* the last rows, zero-padded to a tile */
    if (rest) {
        padded = (uint16_t *)calloc((size_t)(TILE_ROWS * k), sizeof(uint16_t));
        if (!padded) return 2;
        memcpy(padded, x + whole * k, (size_t)(rest * k) * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t u0 = pairs * t / nt, u1 = pairs * (t + 1) / nt;
        float acc[4][TILE_ROWS * 16];
        configure_tiles();
        for (int64_t u = u0; u < u1; u++) {
            const int64_t p = 2 * u, col = 16 * p;
            const int two = p + 1 < panels;
            const uint16_t *panel0 = packed + p * panel_elems;
            const __m512 bias0 = bias16(bias, col), bias1 = two ? bias16(bias, col + 16) : bias0;
            for (int64_t m0 = 0; m0 < m; m0 += 2 * TILE_ROWS) {
                /* the two row tiles: whole ones from x, the last partial one from `padded` */
                const int64_t xs = k;
                const uint16_t *xa = m0 < whole ? x + m0 * k : padded;
                const int rows_a = m0 < whole ? TILE_ROWS : (int)rest;
                const int64_t mb = m0 + TILE_ROWS;
                const int has_b = mb < m;
                const uint16_t *xb = mb < whole ? x + mb * k : padded;
                const int rows_b = !has_b ? 0 : mb < whole ? TILE_ROWS : (int)rest;
                if (has_b) {
                    if (two) MULTIPLY(2, 1); else MULTIPLY(2, 0);
                } else {
                    if (two) MULTIPLY(1, 1); else MULTIPLY(1, 0);
                }
                _tile_stored(0, acc[0], 64);
                store_rows(acc[0], bias0, y + m0 * n + col, n, rows_a);
                if (two) {
                    _tile_stored(1, acc[1], 64);
                    store_rows(acc[1], bias1, y + m0 * n + col + 16, n, rows_a);
                }
                if (has_b) {
                    _tile_stored(2, acc[2], 64);
                    store_rows(acc[2], bias0, y + mb * n + col, n, rows_b);
                    if (two) {
                        _tile_stored(3, acc[3], 64);
                        store_rows(acc[3], bias1, y + mb * n + col + 16, n, rows_b);
                    }
                }
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
}
