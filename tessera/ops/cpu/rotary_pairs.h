/* Rotary on neighbouring pairs (2i, 2i + 1): GLM-4's, ERNIE's and Cohere 2's form, rounded
 * as torch_rotary rounds the rotate-half form of the evens-then-odds order (the cos / sin
 * row's halves repeat, so pair i takes entry i of each). Scalar: a decode step's few heads.
 * Shared by rotary_bf16.c and rotary_avx2.c; bf16.h first. */
#ifndef TESSERA_ROTARY_PAIRS_H
#define TESSERA_ROTARY_PAIRS_H
#include <stdint.h>

static void rotate_pairs(const uint16_t *xh, uint16_t *oh, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = bf16_to_f32(xh[2 * i]), x2 = bf16_to_f32(xh[2 * i + 1]);
        oh[2 * i] = f32_to_bf16(round_to_bf16(x1 * bf16_to_f32(cos[i])) + round_to_bf16(-x2 * bf16_to_f32(sin[i])));
        oh[2 * i + 1] = f32_to_bf16(round_to_bf16(x2 * bf16_to_f32(cos[half + i]))
                                    + round_to_bf16(x1 * bf16_to_f32(sin[half + i])));
    }
}
#endif
