/* Small AVX512 helpers shared by tessera's CPU kernels: horizontal sums and exp. */
#ifndef TESSERA_AVX512_MATH_H
#define TESSERA_AVX512_MATH_H
#include <immintrin.h>

#include "exp_poly.h"

/* The sums of four float32x16 vectors, as four floats: one transpose-and-add instead of
 * four separate horizontal reductions. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* each 128-bit lane: [a b c d] partial sums */
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* exp(x) for 16 floats, relative error ~2e-7: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
 * polynomial for exp(r), then scale by 2^n (scalef handles under- and overflow). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  /* below: exp underflows to 0 anyway */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = EXP_REDUCE(_mm512_fnmadd_ps, _mm512_set1_ps, n, x);
    const __m512 p = EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, r);
    return _mm512_scalef_ps(p, n);
}
#endif
