/* What both MXFP4 kernels (mxfp4_linear.c, mxfp4_linear_avx2.c) share: a block's scale as a
 * float, and the input split into the order their decoded lanes come in. */
#ifndef TESSERA_MXFP4_ROWS_H
#define TESSERA_MXFP4_ROWS_H
#include <stdint.h>

/* 2^(s - 127): the float with exponent field s (s = 0: 2^-127, a subnormal). */
static inline float e8m0(uint8_t s) {
    union { uint32_t u; float f; } v;
    v.u = s ? (uint32_t)s << 23 : 0x00400000u;
    return v.f;
}

/* `static void name(const T *x, int64_t tokens, int64_t groups, T *xs)`: x [tokens, 32 G] ->
 * xs [tokens, G, 32], each block's 16 even elements, then its 16 odd ones (a block's low
 * nibbles decode to the even elements, its high nibbles to the odd). */
#define MXFP4_SPLIT_EVEN_ODD(name, T)                                          \
    static void name(const T *x, int64_t tokens, int64_t groups, T *xs) {      \
        for (int64_t i = 0; i < tokens * groups; i++) {                        \
            const T *src = x + i * 32;                                         \
            T *dst = xs + i * 32;                                              \
            for (int j = 0; j < 16; j++) {                                     \
                dst[j] = src[2 * j];                                           \
                dst[16 + j] = src[2 * j + 1];                                  \
            }                                                                  \
        }                                                                      \
    }
#endif
