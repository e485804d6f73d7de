/* silu_and_mul_bf16.c for CPUs without AVX512 (same symbol and rounding; TESSERA_GELU_TANH too):
 * out = bf16(bf16(silu(gate)) * up) over rows of a packed [gate | up] projection, 8 lanes at
 * a time with a polynomial exp (avx2_math.h): scalar expf per value took 38 ms of a
 * 128-token prefill of the default model (30 layers x 128 x 1536 values). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "avx2_math.h"

/* the argument of the sigmoid that multiplies x (TESSERA_GELU_TANH: silu_and_mul_bf16.c) */
static inline __m256 gate_arg8(__m256 x) {
#ifdef TESSERA_GELU_TANH
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    return _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
#else
    return x;
#endif
}

/* 8 values of one row: out[0..8) from gate[0..8) and up[0..8). */
static inline void silu_and_mul8(const uint16_t *g, const uint16_t *u, uint16_t *out) {
    const __m256 x = bf16x8_to_f32(g);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate_arg8(x)));
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    const __m128i silu16 = f32x8_to_bf16(silu);
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(silu16), 16));
    _mm_storeu_si128((__m128i *)out, f32x8_to_bf16(_mm256_mul_ps(s, bf16x8_to_f32(u))));
}

/* gate, up: rows every gate_stride / up_stride elements; out: [rows, h]. */
void tessera_act_mul_rows_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                               uint16_t *out, int64_t rows, int64_t h, int threads) {
#pragma omp parallel for num_threads(rows * h >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;
        uint16_t *o = out + r * h;
        int64_t i = 0;
        for (; i + 8 <= h; i += 8) silu_and_mul8(g + i, u + i, o + i);
        if (i < h) {  /* the last h % 8 values, through zero-padded copies */
            uint16_t gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + i, (size_t)(h - i) * 2);
            memcpy(ut, u + i, (size_t)(h - i) * 2);
            silu_and_mul8(gt, ut, ot);
            memcpy(o + i, ot, (size_t)(h - i) * 2);
        }
    }
}

/* gate_up: [rows, 2 * h]; out: [rows, h]. */
void tessera_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h, int threads) {
    tessera_act_mul_rows_bf16(gate_up, 2 * h, gate_up + h, 2 * h, out, rows, h, threads);
}
