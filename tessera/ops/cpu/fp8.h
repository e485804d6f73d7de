/* 8-bit floats for tessera's KV cache (tessera/ops/attention/kv_quant.py), scalar and
 * portable: the format is chosen when the kernel is built, TESSERA_KV_FP8 = 1 for e4m3fn
 * (bias 7, 3 mantissa bits, largest 448, no inf) or 2 for e5m2 (bias 15, 2 bits, largest
 * 57344). Values are stored unscaled. Encoding rounds to nearest, ties to even, and
 * saturates at the largest finite value (inf included), as kv_quant.quantize_kv does; NaN
 * stays NaN. Decoding is exact in float32. */
#ifndef TESSERA_FP8_H
#define TESSERA_FP8_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if TESSERA_KV_FP8 == 1
#define FP8_MANT 3
#define FP8_BIAS 7
#define FP8_MAX_CODE 0x7e      /* 448 */
#define FP8_NAN_CODE 0x7f
#define FP8_SPECIAL 0x7f       /* the first magnitude that is not a finite value */
#define FP8_SUB_UNIT 0x1p-9f   /* 2^(1 - bias - mantissa bits): the subnormal step */
#elif TESSERA_KV_FP8 == 2
#define FP8_MANT 2
#define FP8_BIAS 15
#define FP8_MAX_CODE 0x7b      /* 57344 */
#define FP8_NAN_CODE 0x7f
#define FP8_SPECIAL 0x7c       /* inf; 0x7d-0x7f NaN */
#define FP8_SUB_UNIT 0x1p-16f
#else
#error "fp8.h needs TESSERA_KV_FP8 = 1 (e4m3fn) or 2 (e5m2)"
#endif
/* float32 bits of a normal fp8 magnitude m (exponent and mantissa, 7 bits): the fields
 * shifted into float32's places, the exponent rebased */
#define FP8_SHIFT (23 - FP8_MANT)
#define FP8_REBASE ((127 - FP8_BIAS) << 23)

static inline float fp8_to_f32(uint8_t x) {
    const uint32_t mag = x & 0x7fu;
    float f;
    if (mag >= FP8_SPECIAL) {  /* e4m3fn: NaN; e5m2: inf and NaN, as float16's */
        f = mag == FP8_SPECIAL && TESSERA_KV_FP8 == 2 ? INFINITY : NAN;
    } else if (mag < (1u << FP8_MANT)) {  /* subnormal (or zero): mantissa steps of FP8_SUB_UNIT */
        f = (float)mag * FP8_SUB_UNIT;
    } else {
        const uint32_t bits = (mag << FP8_SHIFT) + FP8_REBASE;
        memcpy(&f, &bits, sizeof f);
    }
    return (x & 0x80u) ? -f : f;
}

static inline uint8_t f32_to_fp8(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const uint32_t a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | FP8_NAN_CODE;
    float x;
    memcpy(&x, &a, sizeof x);
    if (x < (float)(1u << FP8_MANT) * FP8_SUB_UNIT) {  /* below the smallest normal */
        /* a multiple of the subnormal step, rounded to nearest even (the default mode);
         * a round up to 2^mant steps is the smallest normal's code */
        return sign | (uint8_t)rintf(x / FP8_SUB_UNIT);
    }
    const uint32_t lsb = (a >> FP8_SHIFT) & 1u;
    const uint32_t rounded = (a + ((1u << (FP8_SHIFT - 1)) - 1u) + lsb) >> FP8_SHIFT;
    const int64_t code = (int64_t)rounded - ((127 - FP8_BIAS) << FP8_MANT);
    return sign | (uint8_t)(code > FP8_MAX_CODE ? FP8_MAX_CODE : code);
}
#endif
