/* y = x W^T (+ bias) for bf16 x and W in MXFP4 (gpt-oss's expert weights) on AVX512 CPUs;
 * mxfp4_linear_avx2.c is the float32 build for other CPUs and float32 models.
 *
 * A block of 32 weights is 16 bytes of E2M1 codes (element 2j in the low nibble of byte j,
 * 2j + 1 in the high) and a power-of-two scale. Its codes become 32 bf16 weights in
 * registers with one vpermw over a 16-entry table (every E2M1 value is exact in bf16), in
 * the order evens then odds, and its scale is added to their exponents (exact for all but
 * extreme scales, which scale each block's float32 sums instead); x is split once per call
 * into that order, so a block is one bf16 pair-dot (vdpbf16ps where the CPU has it:
 * products exact, float32 sums) per token, spread over 2-4 accumulators. A row's blocks are decoded once per tile of up to TOKENS tokens,
 * whose accumulators stay in registers; rows are split over the threads. Built by build.py. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "mxfp4_rows.h"
#include "simd_bf16.h"

#define TOKENS 8

/* E2M1 code -> bf16 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives. */
static inline __m512i e2m1_table(void) {
    return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                            (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000,
                            (short)0xBFC0, (short)0xBF80, (short)0xBF00, (short)0x8000,
                            0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000);
}

/* One block's 16 bytes -> 32 bf16 weights, the even elements then the odd. */
static inline __m512i decode32(const uint8_t *block, __m512i table) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)block), nibble = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(raw, nibble), odd = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    const __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(even), odd, 1);
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
}

MXFP4_SPLIT_EVEN_ODD(split_even_odd, uint16_t)

/* The block's power of two applied to its decoded weights: 2^(s - 127) added to each
 * nonzero weight's exponent field (zeros stay zero). Exact while every result stays a
 * normal bf16: for E2M1's exponents (126..129) that is s in [2, 252] (rows_scalable). */
static inline __m512i scaled(__m512i w, uint8_t s) {
    const __mmask32 nonzero = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF));
    return _mm512_mask_add_epi16(w, nonzero, w, _mm512_set1_epi16((short)(((int)s - 127) * 128)));
}

static inline int row_scalable(const uint8_t *scales, int64_t groups) {
    for (int64_t g = 0; g < groups; g++)
        if (scales[g] < 2 || scales[g] > 252) return 0;
    return 1;
}

/* Row r against tokens [t0, t0 + n), n <= TOKENS; `chains` accumulators per token take the
 * blocks in turn, so a token's sums are that many independent dependency chains (4 for one
 * or two tokens, whose few chains would otherwise wait on each pair-dot's latency; 2 for
 * more, whose accumulators fill the registers). Both are constants after inlining. */
static inline __attribute__((always_inline)) void row_tile(
        const uint8_t *blocks, const uint8_t *scales, const uint16_t *xs, int64_t groups, int64_t t0,
        const int n, const int chains, float bias, float *out, int64_t rows, int64_t r) {
    const __m512i table = e2m1_table();
    __m512 acc[4][TOKENS];
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < TOKENS; t++) acc[c][t] = _mm512_setzero_ps();
    if (row_scalable(scales, groups)) {
        int64_t g = 0;
        for (; g + chains <= groups; g += chains) {
            __m512i w[4];
            for (int c = 0; c < chains; c++) w[c] = scaled(decode32(blocks + (g + c) * 16, table), scales[g + c]);
            for (int t = 0; t < n; t++) {
                const uint16_t *xt = xs + ((t0 + t) * groups + g) * 32;
                for (int c = 0; c < chains; c++)
                    acc[c][t] = dot_bf16_pairs(acc[c][t], w[c], _mm512_loadu_si512(xt + c * 32));
            }
        }
        for (; g < groups; g++) {
            const __m512i w = scaled(decode32(blocks + g * 16, table), scales[g]);
            for (int t = 0; t < n; t++)
                acc[0][t] = dot_bf16_pairs(acc[0][t], w, _mm512_loadu_si512(xs + ((t0 + t) * groups + g) * 32));
        }
    } else {  /* extreme scales: each block's sums scaled in float32 */
        for (int64_t g = 0; g < groups; g++) {
            const __m512i w = decode32(blocks + g * 16, table);
            const __m512 scale = _mm512_set1_ps(e8m0(scales[g]));
            for (int t = 0; t < n; t++) {
                const __m512i xv = _mm512_loadu_si512(xs + ((t0 + t) * groups + g) * 32);
                acc[0][t] = _mm512_fmadd_ps(dot_bf16_pairs(_mm512_setzero_ps(), w, xv), scale, acc[0][t]);
            }
        }
    }
    for (int t = 0; t < n; t++) {
        __m512 sum = acc[0][t];
        for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[c][t]);
        out[(t0 + t) * rows + r] = _mm512_reduce_add_ps(sum) + bias;
    }
}

/* x [tokens, 32 G] bf16; blocks [rows, G, 16], scales [rows, G] uint8; bias [rows] float32 or
 * NULL; out [tokens, rows] float32. Returns 1 when a buffer cannot be allocated. */
int tessera_mxfp4_linear_bf16(const uint16_t *x, const uint8_t *blocks, const uint8_t *scales, const float *bias,
                              float *out, int64_t tokens, int64_t rows, int64_t groups, int threads) {
    uint16_t *xs = malloc(sizeof(uint16_t) * (tokens * groups * 32 > 0 ? tokens * groups * 32 : 1));
    if (!xs) return 1;
    split_even_odd(x, tokens, groups, xs);
#pragma omp parallel for num_threads(rows * groups >= 2048 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *b = blocks + r * groups * 16, *s = scales + r * groups;
        const float bias_r = bias ? bias[r] : 0.0f;
        int64_t t0 = 0;
        for (; t0 + TOKENS <= tokens; t0 += TOKENS) row_tile(b, s, xs, groups, t0, TOKENS, 2, bias_r, out, rows, r);
        switch (tokens - t0) {  /* the last tile, by size so its loop unrolls */
            case 7: row_tile(b, s, xs, groups, t0, 7, 2, bias_r, out, rows, r); break;
            case 6: row_tile(b, s, xs, groups, t0, 6, 2, bias_r, out, rows, r); break;
            case 5: row_tile(b, s, xs, groups, t0, 5, 2, bias_r, out, rows, r); break;
            case 4: row_tile(b, s, xs, groups, t0, 4, 2, bias_r, out, rows, r); break;
            case 3: row_tile(b, s, xs, groups, t0, 3, 2, bias_r, out, rows, r); break;
            case 2: row_tile(b, s, xs, groups, t0, 2, 4, bias_r, out, rows, r); break;
            case 1: row_tile(b, s, xs, groups, t0, 1, 4, bias_r, out, rows, r); break;
            default: break;
        }
    }
    free(xs);
    return 0;
}

/* blocks [rows, groups, 16], scales [rows, groups] -> out [rows, 32 groups] bf16 in the
 * weights' own order, exactly (a prefill's many rows per expert then multiply on AMX tiles
 * through torch's bf16 GEMM, several times this kernel's rate). Returns 1, writing nothing,
 * when some scale is too extreme for bf16 to hold its weights exactly. */
int tessera_mxfp4_dequantize_bf16(const uint8_t *blocks, const uint8_t *scales, uint16_t *out, int64_t rows,
                                  int64_t groups, int threads) {
    for (int64_t r = 0; r < rows; r++)
        if (!row_scalable(scales + r * groups, groups)) return 1;
    int16_t order[32];  /* decode32's evens-then-odds back to element order */
    for (int i = 0; i < 32; i++) order[i] = (int16_t)((i & 1) ? 16 + i / 2 : i / 2);
    const __m512i table = e2m1_table(), interleave = _mm512_loadu_si512(order);
#pragma omp parallel for num_threads(rows * groups >= 2048 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const __m512i w = scaled(decode32(blocks + (r * groups + g) * 16, table), scales[r * groups + g]);
            _mm512_storeu_si512(out + (r * groups + g) * 32, _mm512_permutexvar_epi16(interleave, w));
        }
    return 0;
}
