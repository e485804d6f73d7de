/* The element of the paged KV cache as the AVX2 attention kernels read it: bfloat16 by
 * default, or an 8-bit float when built with TESSERA_KV_FP8 (fp8.h).
 *
 * kv8_widened gives 8 consecutive elements as float32 divided by KV_WIDEN_SCALE (a power of
 * two, so exactly), the cheapest widening each format has: bf16 is the top half of a
 * float32; e5m2 is the top byte of a float16 and e4m3 becomes one by moving its fields
 * (then its exponent bias is 8 short: the value / 2^8), and F16C widens float16 in one
 * instruction, subnormals included (kv16_widened: 16 from one load). NaN reads back NaN
 * everywhere but in kv8_widened (the decode kernel's keys; see there). The decode kernel scales its query up and its output
 * back by KV_WIDEN_SCALE instead of every element (exact: powers of two). kv8_to_f32 and
 * kv_to_f32 give the values themselves. */
#ifndef TESSERA_KV_ROWS_H
#define TESSERA_KV_ROWS_H
#include <immintrin.h>
#include <stdint.h>

#include "avx2_math.h"
#include "bf16.h"

#if defined(TESSERA_KV_FP8) && TESSERA_KV_FP8
#include "fp8.h"
/* F16C for the functions from here on (the fp8 builds only; their builders check the CPU) */
#pragma GCC target("f16c")
typedef uint8_t kv_t;

#if TESSERA_KV_FP8 == 1
#define KV_WIDEN_SCALE 256.0f
#else
#define KV_WIDEN_SCALE 1.0f
#endif

static inline float kv_to_f32(kv_t x) { return fp8_to_f32(x); }
static inline float kv_widened(kv_t x) { return fp8_to_f32(x) * (1.0f / KV_WIDEN_SCALE); }

static inline __m128i kv8_half(const kv_t *p, int keep_nan) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
#if TESSERA_KV_FP8 == 1
    /* s eeee mmm -> float16 s 0eeee mmm0000000: shifted to the top byte, the sign copied
     * one place down by the arithmetic shift and that copy cleared */
    __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), _mm_set1_epi16((short)0xbfff));
    if (keep_nan) half = _mm_or_si128(half, _mm_and_si128(
        _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00)));
    return half;
#else
    (void)keep_nan;
    return _mm_slli_epi16(x, 8);
#endif
}

/* The decode kernel's keys: e4m3's NaN code reads as 480 here (3 fewer instructions in its
 * hottest loop); its values keep NaN (kv16_widened), so a NaN row still gives NaN. */
static inline __m256 kv8_widened(const kv_t *p) { return _mm256_cvtph_ps(kv8_half(p, 0)); }

static inline __m256 kv8_to_f32(const kv_t *p) {
    return _mm256_mul_ps(_mm256_cvtph_ps(kv8_half(p, 1)), _mm256_set1_ps(KV_WIDEN_SCALE));
}

/* 16 codes (one per 16-bit lane) as float16 bits, NaN kept: the value / KV_WIDEN_SCALE */
static inline __m256i kv16_half(__m256i x) {
#if TESSERA_KV_FP8 == 1
    const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1),
                                          _mm256_set1_epi16((short)0xbfff));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
    return _mm256_or_si256(half, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
#else
    return _mm256_slli_epi16(x, 8);
#endif
}

/* kv8_widened of p and p + 8 (NaN kept), from one load and one set of shifts */
static inline void kv16_widened(const kv_t *p, __m256 *lo, __m256 *hi) {
    const __m256i half = kv16_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}
#else
typedef uint16_t kv_t;
#define KV_WIDEN_SCALE 1.0f

static inline float kv_to_f32(kv_t x) { return bf16_to_f32(x); }
static inline float kv_widened(kv_t x) { return bf16_to_f32(x); }
static inline __m256 kv8_widened(const kv_t *p) { return bf16x8_to_f32(p); }
static inline __m256 kv8_to_f32(const kv_t *p) { return bf16x8_to_f32(p); }

static inline void kv16_widened(const kv_t *p, __m256 *lo, __m256 *hi) {
    *lo = bf16x8_to_f32(p);
    *hi = bf16x8_to_f32(p + 8);
}
#endif
#endif
