/* tessera's int4 format from float weights (tessera/ops/linear_int4.py, quantize_int4): per
 * group of 32 input features, the offset m is the group's minimum rounded to float16 (down,
 * if rounding went up) and the step d its range over 15, rounded to float16; each code is
 * round-half-even((w - m) / d) clamped to 0..15 (0 where d is 0). Every operation is the
 * float32 one torch's version does, in the same order, so the bits are the same; this only
 * makes a model's quantization at load several times faster (one pass, rows over threads).
 * Portable C: float16 through _Float16 (round to nearest even, as torch converts). */
#include <math.h>  /* INFINITY */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32

static inline uint16_t half_bits(_Float16 h) { uint16_t b; memcpy(&b, &h, 2); return b; }
static inline _Float16 bits_half(uint16_t b) { _Float16 h; memcpy(&h, &b, 2); return h; }

/* The next float16 below h (toward -inf; h finite). */
static inline _Float16 half_below(_Float16 h) {
    const uint16_t b = half_bits(h);
    if (b == 0x0000 || b == 0x8000) return bits_half(0x8001);  /* +-0 -> the smallest negative */
    return bits_half(b & 0x8000 ? b + 1 : b - 1);
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
            _Float16 m = (_Float16)low;
            if ((float)m > low) m = half_below(m);
            const float mf = (float)m;
            const _Float16 d = (_Float16)((high - mf) / 15.0f);
            const float step = (float)d > 0 ? (float)d : 1.0f;
            for (int i = 0; i < GROUP; i++) {
                /* (w - m) / d lies in [0, 16): adding and taking 2^23 rounds it half to even,
                 * as torch.round does, without a libm call (baseline x86-64 has no roundps) */
                float q = ((v[i] - mf) / step + 8388608.0f) - 8388608.0f;
                q = q > 15 ? 15 : q;
                codes[at + i] = (uint8_t)q;
            }
            d_out[r * groups + g] = half_bits(d);
            m_out[r * groups + g] = half_bits(m);
        }
    }
    return 0;
}
