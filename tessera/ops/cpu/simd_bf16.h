/* bfloat16 arithmetic for tessera's CPU kernels on any AVX512 CPU.
 *
 * Where the compiler targets AVX512-BF16 (build.py passes -mavx512bf16 only when the CPU
 * has it) these are single instructions; elsewhere (Skylake-X, Cascade Lake, Ice Lake and
 * virtual machines that hide the flag) the same results come from AVX512F/BW: a bf16 value
 * is the top half of a float32, so widening is a shift or a mask and the products run as
 * float32 FMAs. Likewise AVX512-VNNI's int16 dot product falls back to vpmaddwd + vpaddd. */
#ifndef TESSERA_SIMD_BF16_H
#define TESSERA_SIMD_BF16_H
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512BF16__)
#define TESSERA_NATIVE_BF16 1
#else
#define TESSERA_NATIVE_BF16 0
#endif

/* 16 bf16 (raw bits) -> 16 float32 */
static inline __m512 bf16x16_to_f32(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Lanes [0, left) of a 16-lane vector (all 16 when left >= 16). */
static inline __mmask16 lanes16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* Up to 16 bf16 under mask m -> float32 (masked lanes 0). */
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

/* The even (low) and odd (high) bf16 of each 32-bit lane, as float32. */
static inline __m512 bf16_even_f32(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
static inline __m512 bf16_odd_f32(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

#if !TESSERA_NATIVE_BF16
/* float32 -> bf16 bits in the low half of each lane: round to nearest even, NaN stays NaN
 * (what torch does, and what vcvtneps2bf16 does for normal numbers). */
static inline __m512i f32_to_bf16_lanes(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}
#endif

/* 16 float32 -> 16 bf16 */
static inline __m256i f32x16_to_bf16(__m512 v) {
#if TESSERA_NATIVE_BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return _mm512_cvtepi32_epi16(f32_to_bf16_lanes(v));
#endif
}

/* v rounded to bf16 and back: what torch holds after an op with a bf16 result */
static inline __m512 round_bf16x16(__m512 v) {
    return bf16x16_to_f32(f32x16_to_bf16(v));
}

/* 32 float32 -> 32 bf16: lo fills elements 0-15, hi 16-31 */
static inline __m512i f32x32_to_bf16(__m512 hi, __m512 lo) {
#if TESSERA_NATIVE_BF16
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(f32x16_to_bf16(lo)), f32x16_to_bf16(hi), 1);
#endif
}

/* 4 float32 -> 4 bf16 in the low 64 bits */
static inline __m128i f32x4_to_bf16(__m128 v) {
#if TESSERA_NATIVE_BF16
    return (__m128i)_mm_cvtneps_pbh(v);
#else
    return _mm512_castsi512_si128(_mm512_castsi256_si512(f32x16_to_bf16(_mm512_castps128_ps512(v))));
#endif
}

/* acc + a.even * b.even + a.odd * b.odd in each lane, a and b holding bf16 pairs (vdpbf16ps). */
static inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
#if TESSERA_NATIVE_BF16
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    acc = _mm512_fmadd_ps(bf16_even_f32(a), bf16_even_f32(b), acc);
    return _mm512_fmadd_ps(bf16_odd_f32(a), bf16_odd_f32(b), acc);
#endif
}

/* acc + a.even * b.even + a.odd * b.odd in each 32-bit lane, int16 pairs (vpdpwssd). */
static inline __m512i dot_i16_pairs(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif
