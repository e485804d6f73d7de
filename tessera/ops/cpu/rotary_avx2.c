/* rotary_bf16.c for CPUs without AVX512 (same symbol, bit-exact to the torch builder):
 * out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)); plain C vectorised for AVX2. */
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "rotary_forms.h"

static void rotate_row(const uint16_t *x, int64_t x_head, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                       int64_t heads, int64_t d, int64_t full, int interleaved) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *xh = x + h * x_head;
        uint16_t *oh = out + h * full;
        if (rotate_head_aside(xh, oh, cos, sin, d, full, interleaved)) continue;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = bf16_to_f32(xh[i]), x2 = bf16_to_f32(xh[half + i]);
            oh[i] = f32_to_bf16(round_to_bf16(x1 * bf16_to_f32(cos[i])) + round_to_bf16(-x2 * bf16_to_f32(sin[i])));
            oh[half + i] = f32_to_bf16(round_to_bf16(x2 * bf16_to_f32(cos[half + i]))
                                       + round_to_bf16(x1 * bf16_to_f32(sin[half + i])));
        }
    }
}

/* as rotary_bf16.c: q, k row-strided, a head every q_head / k_head values, full wide, its first d
 * turned; cos / sin [tokens, d] */
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
