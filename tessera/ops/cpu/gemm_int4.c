/* y[m, n] = x[m, k] times int4 weights (+ bias[n]): bfloat16 activations against weights
 * quantized per output feature in groups of 32 input features, w = d * q + m with codes q in
 * 0..15 and a float16 step d and offset m per group (GGUF's Q4_1; tessera/ops/linear_int4.py).
 * 5 bits per weight, so single-stream decode, which streams every weight once per token,
 * reads 5/16 of bf16's bytes.
 *
 * Layout (one uint8 tensor [n / 16, 10 k], built by tessera/ops/cpu/linear_int4.py): per
 * panel of 16 output features, per group of 32 k, 320 bytes: the 16 features' steps
 * (float16), their 16 offsets, then 8 chunks of 32 bytes, each holding 4 k of the 16
 * features: byte 2l + e of chunk t is code[l][4t + e] | code[l][4t + 2 + e] << 4. One
 * zero-extension of a chunk to 32 int16 lanes then gives, after a mask, the pair (4t, 4t+1)
 * of every feature side by side and, after a shift, the pair (4t+2, 4t+3): the layout
 * vpdpwssd multiplies against a broadcast pair of x.
 *
 * Arithmetic (few rows): each row of x is scaled to 15-bit integers as in gemm_int8.c
 * (int16_rows.h); per group, vpdpwssd sums code * x in int32 lanes (32 products of at most
 * 15 * 16383 cannot overflow), then sum_k w x = d * that + m * sum_k x over the group, both
 * in float32, and the row's scale at the end. Tiles: ROWS rows by two panels.
 *
 * Decode batches (Q8_MIN_ROWS to Q8_END_ROWS rows; below the AMX build's widening): x rounded
 * to 8 bits per group of 32 with a step each (int8_rows.h, as llama.cpp's CPU kernels take
 * x), and vpdpbusd sums four code * x products per lane per instruction, twice vpdpwssd's
 * (without AVX512-VNNI: vpmaddubsw, int16 sums per group, one vpmaddwd): per group, sum_k w x
 * = x_step * (d * that + m * the codes' sum), in float32. Tiles: ROWS8 rows by two panels.
 *
 * From WIDEN_MIN_ROWS rows on (prefill) each thread dequantizes a pair of panels to bf16
 * once per block of rows and runs gemm_bf16.c's 12-row tile on it; x stays bf16.
 * Requires n % 16 == 0 and k % 32 == 0. Built by tessera/ops/cpu/build.py. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int16_rows.h"
#include "int8_rows.h"
#include "packed_tile.h"
#include "panel_tiles.h"
#include "simd_bf16.h"
#include "widened_gemm.h"

#define GROUP 32
#define GROUP_BYTES 320                  /* 32 + 32 bytes of float16 scales, 256 of codes */
#define CHUNKS (GROUP / 4)               /* 32-byte chunks of codes per group */
#define PAIR_BYTES (GROUP_BYTES / (GROUP / 2))  /* a panel's bytes per pair of k, on average */
#define ROWS 4
#define ROW_BLOCK_BYTES (96 * 1024)      /* of x rows, int16 or int8 */
/* From how many rows dequantizing to bf16 and the 12-row bf16 tile beat the int16 tiles
 * (all 120 layer matrices of the default model, 2 threads, AVX512-BF16 host: 8 rows 8.3 ms
 * widened vs 7.0 int16, 16 rows level at 12.1 / 12.5, 24 rows 15.9 vs 19.3). Without
 * AVX512-BF16 the bf16 tile runs as float32 FMAs and the int16 tiles win longer (the same
 * host with the extensions off, TESSERA_CPU_KERNEL_ISA=avx512: 32 rows 31.0 vs 41.2 ms,
 * 48 rows 51.2 vs 57.4). T - 1 must be the top of a captured CPU decode bucket or above them
 * all (tessera/runner/decode_graphs.py), so that a replay takes the path its eager step
 * took: 17 and 64 are (and the AMX build's 9). The 8-bit x tiles take the rows below
 * Q8_END_ROWS first. Overridable for measurements. */
/* The rows at which x is rounded to 8 bits (tile_q8): [Q8_MIN_ROWS, Q8_END_ROWS), passed by
 * linear_int4.py (INT8_X_ROWS). Without VNNI or AVX512-BF16 (TESSERA_CPU_KERNEL_ISA=avx512,
 * as Skylake-SP) 1.15-1.4x the int16 tiles' speed at 4-32 rows. With both, over the default
 * model's 210 layer matrices (2 threads), 1.2x the int16 tiles' speed at 4 rows, 1.5x at
 * 8-16, 1.3x the widened tiles' at 32; still 1.07-1.1x at 512-2048 rows, and 1.05x at 1 row,
 * but there, one stream's decode and prompts, x stays as exact as it was: the 8-bit rounding
 * moves a token's logprob by ~1.5x what bf16 arithmetic does (docs/benchmarks.md, session
 * 42), enough to flip near ties that a gain this small does not pay for. A step with a
 * prompt's rows, however few, runs this source built with an empty range (linear.EXACT_X). */
#ifndef Q8_MIN_ROWS
#define Q8_MIN_ROWS 4
#endif
#ifndef Q8_END_ROWS
#define Q8_END_ROWS 33
#endif
#ifndef WIDEN_MIN_ROWS
#if TESSERA_NATIVE_BF16
#define WIDEN_FROM 17
#else
#define WIDEN_FROM 64
#endif
#if Q8_END_ROWS > Q8_MIN_ROWS && Q8_END_ROWS > WIDEN_FROM
#define WIDEN_MIN_ROWS Q8_END_ROWS  /* the 8-bit x rows first */
#else
#define WIDEN_MIN_ROWS WIDEN_FROM
#endif
#endif
#define ROWS8 6  /* rows of an 8-bit x tile: 4 and 8 were slower (2 threads, 4-256 rows) */

static inline __m512i codes_low(__m512i words) { return _mm512_and_si512(words, _mm512_set1_epi16(15)); }
static inline __m512i codes_high(__m512i words) { return _mm512_srli_epi16(words, 4); }

static inline __m512 load_f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __attribute__((always_inline)) void tile(
        const int16_t *x, const float *x_scale, const float *x_sums, const uint8_t *panel,
        int64_t panel_bytes, const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total,
        int64_t col, const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    __m512 total[ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) total[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *g0 = panel + g * GROUP_BYTES, *g1 = g0 + panel_bytes;
        __m512i acc[ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_si512();
        for (int t = 0; t < CHUNKS; t++) {
            prefetch_next_pair(&next, g * CHUNKS + t, &prefetch_at);
            const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g0 + 64 + 32 * t)));
            const __m512i w1 = panels == 2
                ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(g1 + 64 + 32 * t))) : w0;
            const __m512i lo0 = codes_low(w0), hi0 = codes_high(w0);
            const __m512i lo1 = codes_low(w1), hi1 = codes_high(w1);
            for (int r = 0; r < rows; r++) {
                int32_t pairs[2];
                memcpy(pairs, x + r * k + g * GROUP + 4 * t, sizeof pairs);
                const __m512i a = _mm512_set1_epi32(pairs[0]), b = _mm512_set1_epi32(pairs[1]);
                acc[r][0] = dot_i16_pairs(dot_i16_pairs(acc[r][0], a, lo0), b, hi0);
                if (panels == 2) acc[r][1] = dot_i16_pairs(dot_i16_pairs(acc[r][1], a, lo1), b, hi1);
            }
        }
        for (int q = 0; q < panels; q++) {
            const uint8_t *head = q ? g1 : g0;
            const __m512 step = load_f16x16(head), offset = load_f16x16(head + 32);
            for (int r = 0; r < rows; r++) {
                const __m512 sum_x = _mm512_set1_ps(x_sums[r * groups + g]);
                total[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][q]), step, total[r][q]);
                total[r][q] = _mm512_fmadd_ps(offset, sum_x, total[r][q]);
            }
        }
    }
    for (int q = 0; q < panels; q++) {
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_fmadd_ps(total[r][q], _mm512_set1_ps(x_scale[r]), b)));
    }
}

/* Four codes of one feature as the four bytes of its 32-bit lane, k in order: a chunk's 16
 * features' two bytes (c0 | c2 << 4, c1 | c3 << 4) zero-extended to a lane v, then bytes
 * (v & 15, v >> 8 & 15, v >> 4 & 15, v >> 12 & 15) = ((v | v << 12) & 0x0F0F0F0F). */
static inline __m512i chunk_bytes(const uint8_t *chunk) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)chunk));
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

/* acc + four code * x products per 32-bit lane: vpdpbusd with VNNI. Without it vpmaddubsw's
 * pairs (at most 2 * 15 * 127) add up in int16 lanes, at most 30480 over a group's 8 chunks:
 * exact, and one vpmaddwd per group moves them to int32 (tile_q8). */
static inline __m512i dot_u8_i8(__m512i acc, __m512i codes, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, codes, x);
#else
    return _mm512_add_epi16(acc, _mm512_maddubs_epi16(codes, x));
#endif
}

/* ROWS8 rows of 8-bit x (int8_rows.h, with its groups' codes' sums) by one or two panels. */
static inline __attribute__((always_inline)) void tile_q8(
        const int8_t *x, const float *x_steps, const float *x_sums, const uint8_t *panel,
        int64_t panel_bytes, const uint16_t *bias, uint16_t *y, int64_t k, int64_t n_total,
        int64_t col, const int rows, const int panels, const NextPair next) {
    const int64_t groups = k / GROUP;
    int64_t prefetch_at = next.phase;
    __m512 total[ROWS8][2];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < panels; q++) total[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *g0 = panel + g * GROUP_BYTES, *g1 = g0 + panel_bytes;
        __m512i acc[ROWS8][2];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < panels; q++) acc[r][q] = _mm512_setzero_si512();
        for (int t = 0; t < CHUNKS; t++) {
            prefetch_next_pair(&next, g * CHUNKS + t, &prefetch_at);
            const __m512i w0 = chunk_bytes(g0 + 64 + 32 * t);
            const __m512i w1 = panels == 2 ? chunk_bytes(g1 + 64 + 32 * t) : w0;
            for (int r = 0; r < rows; r++) {
                int32_t quad;
                memcpy(&quad, x + r * k + g * GROUP + 4 * t, sizeof quad);
                const __m512i a = _mm512_set1_epi32(quad);
                acc[r][0] = dot_u8_i8(acc[r][0], w0, a);
                if (panels == 2) acc[r][1] = dot_u8_i8(acc[r][1], w1, a);
            }
        }
        for (int q = 0; q < panels; q++) {
            const uint8_t *head = q ? g1 : g0;
#if !defined(__AVX512VNNI__)
            for (int r = 0; r < rows; r++) acc[r][q] = _mm512_madd_epi16(acc[r][q], _mm512_set1_epi16(1));
#endif
            const __m512 step = load_f16x16(head), offset = load_f16x16(head + 32);
            for (int r = 0; r < rows; r++) {
                const float step_x = x_steps[r * groups + g];
                const __m512 x_step = _mm512_set1_ps(step_x);
                const __m512 sum_x = _mm512_set1_ps(step_x * x_sums[r * groups + g]);  /* of the rounded x */
                total[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][q]), _mm512_mul_ps(step, x_step), total[r][q]);
                total[r][q] = _mm512_fmadd_ps(offset, sum_x, total[r][q]);
            }
        }
    }
    for (int q = 0; q < panels; q++) {
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + col + 16 * q)))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n_total + col + 16 * q),
                                f32x16_to_bf16(_mm512_add_ps(total[r][q], b)));
    }
}

#define Q8_TILE_CASES(PANELS)                                                                       \
    switch (rows) {                                                                                 \
        case 1: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 1, PANELS, next); break;    \
        case 2: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 2, PANELS, next); break;    \
        case 3: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 3, PANELS, next); break;    \
        case 4: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 4, PANELS, next); break;    \
        case 5: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 5, PANELS, next); break;    \
        default: tile_q8(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, ROWS8, PANELS, next); break; \
    }

static int gemm_q8(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k, int threads) {
    int8_t *xq;
    float *x_steps, *x_sums;
    if (quantize_rows8(x, m, k, threads, &xq, &x_steps, &x_sums)) return 2;
    const int64_t groups = k / GROUP, panels = n / 16, panel_bytes = groups * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / k;
    block = block < ROWS8 ? ROWS8 : block / ROWS8 * ROWS8;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS8, {
        const uint8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes : NULL,
                                        panel_bytes, 40, tile_index, tiles);
        const int8_t *xm = xq + mt * k;
        const float *xs = x_steps + mt * groups;
        const float *sums = x_sums + mt * groups;
        uint16_t *ym = y + mt * n;
        if (two_panels) {
            Q8_TILE_CASES(2)
        } else {
            Q8_TILE_CASES(1)
        }
    });
    free(x_steps);  /* the codes and sums share its allocation */
    return 0;
}

#define TILE_CASES(PANELS)                                                                          \
    switch (rows) {                                                                                 \
        case 1: tile(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 1, PANELS, next); break;    \
        case 2: tile(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 2, PANELS, next); break;    \
        case 3: tile(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, 3, PANELS, next); break;    \
        default: tile(xm, xs, sums, panel, panel_bytes, bias, ym, k, n, col, ROWS, PANELS, next); break; \
    }

/* One panel's codes -> gemm_bf16.c's packed layout (for each pair of k, the 16 features'
 * two values side by side), each value d * q + m rounded to bf16. */
static void widen_panel(const uint8_t *panel, uint16_t *out, int64_t k) {
    /* lanes 0-15 of a chunk's words are features 0-7 (two k each), lanes 16-31 features 8-15 */
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *head = panel + g * GROUP_BYTES;
        const __m512 step = load_f16x16(head), offset = load_f16x16(head + 32);
        const __m512 step_a = _mm512_permutexvar_ps(first, step), step_b = _mm512_permutexvar_ps(second, step);
        const __m512 off_a = _mm512_permutexvar_ps(first, offset), off_b = _mm512_permutexvar_ps(second, offset);
        for (int t = 0; t < CHUNKS; t++) {
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(head + 64 + 32 * t)));
            const __m512i halves[2] = {codes_low(words), codes_high(words)};
            for (int h = 0; h < 2; h++) {  /* pairs 2t and 2t + 1 of this group */
                const __m512 a = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(halves[h]))), step_a, off_a);
                const __m512 b = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(halves[h], 1))), step_b, off_b);
                _mm512_storeu_si512(out + (g * (GROUP / 2) + 2 * t + h) * 32, f32x32_to_bf16(b, a));
            }
        }
    }
}

/* The 15-bit x tiles. */
static int gemm_i16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y,
                    int64_t m, int64_t n, int64_t k, int threads) {
    int16_t *xq;
    float *x_scale, *x_sums;
    if (quantize_grouped_rows(x, m, k, threads, GROUP, &xq, &x_scale, &x_sums)) return 2;
    const int64_t groups = k / GROUP, panels = n / 16, panel_bytes = groups * GROUP_BYTES;
    int64_t block = ROW_BLOCK_BYTES / (2 * k);
    block = block < ROWS ? ROWS : block / ROWS * ROWS;
#pragma omp parallel num_threads(threads)
    FOR_EACH_PANEL_TILE(m, panels, block, ROWS, {
        const uint8_t *panel = packed + p * panel_bytes;
        const NextPair next = next_pair(next_p >= 0 ? packed + next_p * panel_bytes : NULL,
                                        panel_bytes, 40, tile_index, tiles);
        const int16_t *xm = xq + mt * k;
        const float *xs = x_scale + mt;  /* one declaration each: a top-level comma */
        const float *sums = x_sums + mt * groups;  /* would split the macro's argument */
        uint16_t *ym = y + mt * n;
        if (two_panels) {
            TILE_CASES(2)
        } else {
            TILE_CASES(1)
        }
    });
    free(x_sums);
    free(x_scale);  /* xq shares its allocation */
    return 0;
}

/* x [m, k] bf16, packed [n / 16, 10 k] uint8, bias [n] bf16 or NULL, y [m, n] bf16.
 * Returns 1 on bad shapes, 2 when a copy of x cannot be allocated. */
int tessera_gemm_int4(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % GROUP || n < 16 || k < GROUP) return 1;
    if (m >= WIDEN_MIN_ROWS) {
        const CompactPanels w = {packed, k / GROUP * GROUP_BYTES, 0, PAIR_BYTES, widen_panel};
        return gemm_widened(x, w, bias, y, m, n, k, threads);
    }
    if (m >= Q8_MIN_ROWS && m < Q8_END_ROWS) return gemm_q8(x, packed, bias, y, m, n, k, threads);
    return gemm_i16(x, packed, bias, y, m, n, k, threads);
}
