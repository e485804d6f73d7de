/* Rotary position embedding (rotate-half form) over bfloat16 q and k, matching tessera's
 * torch_rotary rounding: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)).
 * q and k may be row-strided views of the packed QKV projection; the outputs are
 * contiguous. One pass for both instead of ~10 small torch ops per call. Built by build.py. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "rotary_forms.h"
#include "simd_bf16.h"

/* heads of one token: x [heads, d] at x (contiguous within the row), out likewise. */
static void rotate_row(const uint16_t *x, int64_t x_head, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                       int64_t heads, int64_t d, int64_t full, int interleaved) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *xh = x + h * x_head;
        uint16_t *oh = out + h * full;
        if (rotate_head_aside(xh, oh, cos, sin, d, full, interleaved)) continue;
        for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = lanes16(half - i);
            const __m512 x1 = load_bf16x16(xh + i, m), x2 = load_bf16x16(xh + half + i, m);
            const __m512 lo = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(cos + i, m))),
                                            round_bf16x16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                                     load_bf16x16(sin + i, m))));
            const __m512 hi = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, load_bf16x16(cos + half + i, m))),
                                            round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(sin + half + i, m))));
            _mm256_mask_storeu_epi16(oh + i, m, f32x16_to_bf16(lo));
            _mm256_mask_storeu_epi16(oh + half + i, m, f32x16_to_bf16(hi));
        }
    }
}

/* q [tokens, q_heads * full] with row stride q_stride, a head every q_head values (full, or
 * more: MLA's rotary parts of heads that hold more), k likewise; cos / sin [tokens, d]
 * with row stride cs_stride (views of one gathered cos|sin row); q_out [tokens, q_heads *
 * full], k_out [tokens, k_heads * full]; d even. Each head's first d dimensions turn, the
 * other full - d are copied (partial rotary). */
void tessera_rotary_bf16(const uint16_t *q, int64_t q_stride, int64_t q_head, const uint16_t *k, int64_t k_stride,
                         int64_t k_head, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                         uint16_t *q_out, uint16_t *k_out,
                         int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t d, int64_t full,
                         int interleaved, int threads) {
#pragma omp parallel for num_threads(tokens >= 32 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        rotate_row(q + t * q_stride, q_head, q_out + t * q_heads * full, cos + t * cs_stride, sin + t * cs_stride,
                   q_heads, d, full, interleaved);
        rotate_row(k + t * k_stride, k_head, k_out + t * k_heads * full, cos + t * cs_stride, sin + t * cs_stride,
                   k_heads, d, full, interleaved);
    }
}
