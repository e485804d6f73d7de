/* out = bf16(bf16(silu(gate)) * up) over bfloat16 rows of a packed [gate | up] projection,
 * matching torch's F.silu(gate) * up in bf16 (each op computes in float32 and rounds its
 * result). One pass instead of chunk + silu + mul (two full-size temporaries); the exp is
 * vectorised (avx512_math.h). Built by build.py.
 *
 * Built with TESSERA_GELU_TANH: gelu(gate, tanh approximation) * up instead (Gemma's MLP).
 * gelu_tanh(x) = x (1 + tanh(y)) / 2 with y = sqrt(2/pi) (x + 0.044715 x^3), and
 * (1 + tanh(y)) / 2 = sigmoid(2y): the same x * sigmoid(.) as silu, of another argument. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "avx512_math.h"
#include "simd_bf16.h"

/* the argument of the sigmoid that multiplies x */
static inline __m512 gate_arg16(__m512 x) {
#ifdef TESSERA_GELU_TANH
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    return _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),  /* 2 sqrt(2 / pi) */
                         _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
#else
    return x;
#endif
}

/* gate, up: rows every gate_stride / up_stride elements (a packed projection's halves, or
 * two tensors: Gemma 4's per-layer input gate); out: [rows, h]. */
void tessera_act_mul_rows_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                               uint16_t *out, int64_t rows, int64_t h, int threads) {
#pragma omp parallel for num_threads(rows * h >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = lanes16(h - i);
            const __m512 x = load_bf16x16(g + i, m);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate_arg16(x)))));
            const __m256i silu16 = f32x16_to_bf16(silu);
            const __m512 s = bf16x16_to_f32(silu16);
            _mm256_mask_storeu_epi16(out + r * h + i, m, f32x16_to_bf16(_mm512_mul_ps(s, load_bf16x16(u + i, m))));
        }
    }
}

/* gate_up: [rows, 2 * h]; out: [rows, h]. */
void tessera_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h, int threads) {
    tessera_act_mul_rows_bf16(gate_up, 2 * h, gate_up + h, 2 * h, out, rows, h, threads);
}
