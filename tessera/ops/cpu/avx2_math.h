/* Small AVX2 helpers for tessera's *_avx2.c kernels: exp on 8 floats and 8-lane bf16 <->
 * float32 with torch's rounding (the AVX2 twins of avx512_math.h / simd_bf16.h). */
#ifndef TESSERA_AVX2_MATH_H
#define TESSERA_AVX2_MATH_H
#include <immintrin.h>
#include <stdint.h>

#include "exp_poly.h"

/* exp(x) for 8 floats, relative error ~2e-7, as avx512_math.h's exp16: x = n ln2 + r with
 * |r| <= ln2 / 2, a degree-6 polynomial for exp(r), then 2^n applied as two halves so that
 * results below FLT_MIN come out denormal and above FLT_MAX infinite (AVX2 has no scalef).
 * x is clamped to [-104, 104] first, where exp is already 0 or infinite in float32. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(104.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = EXP_REDUCE(_mm256_fnmadd_ps, _mm256_set1_ps, n, x);
    const __m256 p = EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, r);
    const __m256i ni = _mm256_cvtps_epi32(n);                 /* |n| <= 151 */
    const __m256i half = _mm256_srai_epi32(ni, 1);            /* n = half + (n - half) */
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* The sum and the max of 8 floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 bf16 values held in a register (as f32x8_to_bf16 returns them) -> float32 */
static inline __m256 bf16x8_to_f32_from(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* Round to nearest even, NaN stays NaN (quiet), as bf16.h's f32_to_bf16. */
static inline __m128i f32x8_to_bf16(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    /* 8 x 32-bit lanes holding 16-bit values -> 8 x 16 bits (packus within 128-bit halves) */
    const __m256i packed = _mm256_packus_epi32(rounded, rounded);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif
