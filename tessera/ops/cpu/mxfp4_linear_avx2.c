/* y = x W^T (+ bias) with W in MXFP4 (gpt-oss's expert weights, tessera/weights/mxfp4.py),
 * for CPUs with AVX2 + FMA (and those with AVX512): W is never widened in memory.
 *
 * A row of W is G blocks of 32 weights: 16 bytes of E2M1 codes (element 2j in the low
 * nibble of byte j, 2j + 1 in the high) and one E8M0 scale byte (2^(s - 127)). A code
 * decodes in registers: its low three bits index the eight magnitudes (one vpermps), its
 * fourth bit is the sign (shifted to bit 31 and xored in). x is split once per call into
 * the order the decoded lanes come in (per block: the 16 even elements, then the 16 odd),
 * so decoding needs no shuffles; each row is decoded once into a float buffer (L1-sized)
 * and dotted with every token's x, so a prefill's many tokens share one decode.
 *
 * Decode reads 4.25 bits per weight, a quarter of bf16's bytes: single-token decode of a
 * MoE streams the active experts' weights once per token, so that is what bounds it.
 * Rows are split over the threads. Built by build.py. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_math.h"
#include "mxfp4_rows.h"

/* 8 codes (low three bits: magnitude, bit 3: sign) -> 8 floats. */
static inline __m256 decode8(__m256i codes, __m256 magnitudes) {
    const __m256 mag = _mm256_permutevar8x32_ps(magnitudes, codes);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

/* One row's G blocks -> w [G][32] floats: per block the even elements, then the odd, scaled. */
static void decode_row(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *w) {
    const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        const __m256 scale = _mm256_set1_ps(e8m0(scales[g]));
        const uint8_t *b = blocks + g * 16;
        float *out = w + g * 32;
        for (int half = 0; half < 2; half++) {  /* bytes 0-7, then 8-15 */
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + half * 8)));
            _mm256_storeu_ps(out + half * 8, _mm256_mul_ps(decode8(_mm256_and_si256(bytes, low), magnitudes), scale));
            _mm256_storeu_ps(out + 16 + half * 8, _mm256_mul_ps(decode8(_mm256_srli_epi32(bytes, 4), magnitudes), scale));
        }
    }
}

MXFP4_SPLIT_EVEN_ODD(split_even_odd, float)

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {  /* n is a multiple of 32 */
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* x [tokens, 32 G] float32; blocks [rows, G, 16], scales [rows, G] uint8; bias [rows] float32
 * or NULL; out [tokens, rows] float32. Returns 1 when a buffer cannot be allocated. */
int tessera_mxfp4_linear(const float *x, const uint8_t *blocks, const uint8_t *scales, const float *bias,
                         float *out, int64_t tokens, int64_t rows, int64_t groups, int threads) {
    const int64_t k = groups * 32;
    float *xs = malloc(sizeof(float) * (tokens * k > 0 ? tokens * k : 1));
    if (!xs) return 1;
    split_even_odd(x, tokens, groups, xs);
    int failed = 0;
#pragma omp parallel num_threads(rows * k >= 65536 ? threads : 1) reduction(| : failed)
    {
        float *w = malloc(sizeof(float) * k);
        if (!w) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!w) continue;
            decode_row(blocks + r * groups * 16, scales + r * groups, groups, w);
            const float b = bias ? bias[r] : 0.0f;
            for (int64_t t = 0; t < tokens; t++) out[t * rows + r] = dot(w, xs + t * k, k) + b;
        }
        free(w);
    }
    free(xs);
    return failed;
}
