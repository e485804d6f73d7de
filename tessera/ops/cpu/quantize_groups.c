/* tessera's grouped formats from float weights, per group of 32 input features:
 * - int4 (tessera/ops/linear_int4.py, quantize_int4): the offset m is the group's minimum
 *   rounded to float16 (down, if rounding went up) and the step d its range over 15, rounded
 *   to float16; each code is round-half-even((w - m) / d) clamped to 0..15 (0 where d is 0);
 * - int8 (tessera/ops/linear_int8.py, quantize_int8_groups): the group's step max |w| / 127
 *   over its row's power of two (2^frexp of the row's largest step), rounded to float16, is
 *   d; each code is round-half-even(w / (d * scale)) clamped to -127..127 (0 where d is 0).
 * Every operation is the float32 one torch's version does, in the same order, so the bits
 * are the same; this only makes a model's quantization at load several times faster (one
 * pass, rows over threads). Portable C: float16 conversions by hand (round to nearest even,
 * as torch converts), not _Float16, which GCC before 12 lacks on x86. */
#include <math.h>  /* INFINITY, fabsf, frexpf, ldexpf */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32

#define TWO_23 8388608.0f  /* adding and taking 2^23 rounds a float in [0, 2^23) half to even */

/* float -> float16 bits, rounded to nearest even (overflow to infinity). */
static inline uint16_t to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t a = x & 0x7fffffff;
    if (a >= 0x47800000) return sign | 0x7c00;        /* 2^16 and beyond (and inf): infinity */
    if (a < 0x38800000) {                             /* below 2^-14: a subnormal, in 2^-24 units */
        float v;
        memcpy(&v, &a, 4);
        return sign | (uint16_t)((v * 16777216.0f + TWO_23) - TWO_23);  /* (1024 is 2^-14 itself) */
    }
    uint32_t h = ((a >> 23) - 112) << 10 | (a >> 13 & 0x3ff);  /* exponent rebiased 127 -> 15 */
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;     /* a carry moves up the exponent */
    return sign | (uint16_t)h;
}

static inline float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {
        const float v = (float)mant * 5.9604644775390625e-08f;  /* mant * 2^-24 */
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 255u : exp + 112) << 23 | mant << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The next float16 below h (toward -inf; h finite). */
static inline uint16_t half_below(uint16_t h) {
    if (h == 0x0000 || h == 0x8000) return 0x8001;  /* +-0 -> the smallest negative */
    return h & 0x8000 ? h + 1 : h - 1;
}

static inline float load_value(const void *w, int bf16, int64_t i) {
    if (!bf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* w [n, k] float32 (bf16 = 0) or bfloat16 (bf16 = 1), k a multiple of 32, values finite ->
 * codes uint8 [n, k], d and m float16 bits [n, k / 32]. Returns 1 on bad shapes. */
int tessera_quantize_int4(const void *w, int bf16, uint8_t *codes, uint16_t *d_out, uint16_t *m_out,
                          int64_t n, int64_t k, int threads) {
    if (n < 0 || k % GROUP) return 1;
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float v[GROUP];
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = r * k + g * GROUP;
            float low = INFINITY, high = -INFINITY;
            for (int i = 0; i < GROUP; i++) {
                v[i] = load_value(w, bf16, at + i);
                low = v[i] < low ? v[i] : low;
                high = v[i] > high ? v[i] : high;
            }
            uint16_t m = to_half(low);
            if (from_half(m) > low) m = half_below(m);
            const float mf = from_half(m);
            const uint16_t d = to_half((high - mf) / 15.0f);
            const float step = from_half(d) > 0 ? from_half(d) : 1.0f;
            for (int i = 0; i < GROUP; i++) {
                /* (w - m) / d lies in [0, 16): rounded half to even as torch.round does,
                 * without a libm call (baseline x86-64 has no roundps) */
                float q = ((v[i] - mf) / step + TWO_23) - TWO_23;
                q = q > 15 ? 15 : (q >= 0 ? q : 0);
                codes[at + i] = (uint8_t)q;
            }
            d_out[r * groups + g] = d;
            m_out[r * groups + g] = m;
        }
    }
    return 0;
}

/* w [n, k] float32 (bf16 = 0) or bfloat16 (bf16 = 1), k a multiple of 32, values finite ->
 * codes int8 [n, k], d float16 bits [n, k / 32], each row's power-of-two scale float32 [n].
 * Returns 1 on bad shapes, 2 when a row's step buffer cannot be allocated. */
int tessera_quantize_int8(const void *w, int bf16, int8_t *codes, uint16_t *d_out, float *scale_out,
                          int64_t n, int64_t k, int threads) {
    if (n < 0 || k % GROUP) return 1;
    const int64_t groups = k / GROUP;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *step = malloc(sizeof(float) * (size_t)(groups > 0 ? groups : 1));
        if (!step) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!step) continue;
            float top = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                float largest = 0.0f;
                for (int i = 0; i < GROUP; i++) {
                    const float a = fabsf(load_value(w, bf16, r * k + g * GROUP + i));
                    largest = a > largest ? a : largest;
                }
                step[g] = largest / 127.0f;
                top = step[g] > top ? step[g] : top;
            }
            int exponent;
            frexpf(top, &exponent);                    /* top = m 2^exponent, m in [0.5, 1); 0 for 0 */
            const float row = ldexpf(1.0f, exponent);  /* a power of two: step / row is exact */
            scale_out[r] = row;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = r * k + g * GROUP;
                const uint16_t d = to_half(step[g] / row);
                const float effective = from_half(d) * row;
                const float safe = effective > 0 ? effective : 1.0f;
                for (int i = 0; i < GROUP; i++) {
                    /* |w / step| rounded half to even (adding and taking 2^23), the sign put
                     * back: rounding half to even is symmetric, as torch.round is */
                    const float x = load_value(w, bf16, at + i) / safe;
                    float q = (fabsf(x) + TWO_23) - TWO_23;
                    q = q > 127 ? 127 : q;
                    codes[at + i] = (int8_t)(x < 0 ? -q : q);
                }
                d_out[r * groups + g] = d;
            }
        }
        free(step);
    }
    return failed ? 2 : 0;
}
