/* The element of the paged KV cache as the AVX2 attention kernels read it: bfloat16 by
 * default, or an 8-bit float when built with TESSERA_KV_FP8 (fp8.h). kv8_to_f32 widens 8
 * consecutive elements, kv_to_f32 one. */
#ifndef TESSERA_KV_ROWS_H
#define TESSERA_KV_ROWS_H
#include <immintrin.h>
#include <stdint.h>

#include "avx2_math.h"
#include "bf16.h"

#if defined(TESSERA_KV_FP8) && TESSERA_KV_FP8
#include "fp8.h"
typedef uint8_t kv_t;

static inline float kv_to_f32(kv_t x) { return fp8_to_f32(x); }

/* fp8_to_f32 on 8 lanes: normal magnitudes by moving their fields into float32's places,
 * subnormals as integer multiples of the step, then the sign */
static inline __m256 kv8_to_f32(const kv_t *p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, FP8_SHIFT), _mm256_set1_epi32(FP8_REBASE)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(FP8_SUB_UNIT));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(1 << FP8_MANT), mag));
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24));
    return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), sign);
}
#else
typedef uint16_t kv_t;

static inline float kv_to_f32(kv_t x) { return bf16_to_f32(x); }
static inline __m256 kv8_to_f32(const kv_t *p) { return bf16x8_to_f32(p); }
#endif
#endif
