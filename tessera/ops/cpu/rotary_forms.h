/* What both rotary builds (rotary_bf16.c, rotary_avx2.c) do to a head besides turning it in
 * halves: copy a partial head's unturned dimensions, and turn neighbouring pairs (2i, 2i + 1),
 * GLM-4's, ERNIE's and Cohere 2's form, rounded as torch_rotary rounds the rotate-half form
 * of the evens-then-odds order (the cos / sin row's halves repeat, so pair i takes entry i
 * of each); scalar: a decode step's few heads. bf16.h first. */
#ifndef TESSERA_ROTARY_FORMS_H
#define TESSERA_ROTARY_FORMS_H
#include <stdint.h>
#include <string.h>

static void rotate_pairs(const uint16_t *xh, uint16_t *oh, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = bf16_to_f32(xh[2 * i]), x2 = bf16_to_f32(xh[2 * i + 1]);
        oh[2 * i] = f32_to_bf16(round_to_bf16(x1 * bf16_to_f32(cos[i])) + round_to_bf16(-x2 * bf16_to_f32(sin[i])));
        oh[2 * i + 1] = f32_to_bf16(round_to_bf16(x2 * bf16_to_f32(cos[half + i]))
                                    + round_to_bf16(x1 * bf16_to_f32(sin[half + i])));
    }
}

/* A head of `full` values at xh, its first d turned: the dimensions past d copied to oh;
 * interleaved, its pairs turned here. Returns 1 when the head is done (interleaved), 0 when
 * its first d still turn in halves. */
static inline int rotate_head_aside(const uint16_t *xh, uint16_t *oh, const uint16_t *cos, const uint16_t *sin,
                                    int64_t d, int64_t full, int interleaved) {
    if (full > d) memcpy(oh + d, xh + d, (size_t)(full - d) * sizeof(uint16_t)); /* partial: passed through */
    if (!interleaved) return 0;
    rotate_pairs(xh, oh, cos, sin, d / 2);
    return 1;
}
#endif
