/* bfloat16 <-> float32 for tessera's CPU kernels (bit patterns held in uint16_t). */
#ifndef TESSERA_BF16_H
#define TESSERA_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* f rounded to bf16 and back: what torch holds after an op with a bf16 result */
static inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif
