/* LayerNorm over rows, one C call (Cohere's bias-free norm, the encoders' biased one):
 *   mean = sum(x) / h, var = sum((x - mean)^2) / h (both in float32),
 *   out = ((x - mean) * rsqrt(var + eps)) * w + b, rounded once to the model dtype,
 * as transformers' CohereLayerNorm and torch's layer_norm compute it (their float32 sums
 * run in another order: a bf16 result can differ by one unit on a rounding edge). w and b
 * may be NULL. Plain loops over LN_LANES independent partial sums, which the compiler
 * vectorises for the build's ISA (layer_norm.c: AVX512, layer_norm_avx2.c: AVX2). */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

#define LN_LANES 16

/* one row: x_row read `h` values; is_bf16 picks the element type of x, w, b and out */
#define LN_ROW(T, LOAD, STORE)                                                                  \
    static void ln_row_##T(const T *x, const T *w, const T *b, T *out, int64_t h, float eps) {   \
        float acc[LN_LANES] = {0}, sum = 0.0f;                                                   \
        int64_t i = 0;                                                                           \
        for (; i + LN_LANES <= h; i += LN_LANES)                                                 \
            for (int j = 0; j < LN_LANES; j++) acc[j] += LOAD(x[i + j]);                         \
        for (int j = 0; j < LN_LANES; j++) sum += acc[j];                                        \
        for (; i < h; i++) sum += LOAD(x[i]);                                                    \
        const float mean = sum / (float)h;                                                       \
        float dev[LN_LANES] = {0}, squares = 0.0f;                                               \
        for (i = 0; i + LN_LANES <= h; i += LN_LANES)                                            \
            for (int j = 0; j < LN_LANES; j++) {                                                 \
                const float d = LOAD(x[i + j]) - mean;                                           \
                dev[j] += d * d;                                                                 \
            }                                                                                    \
        for (int j = 0; j < LN_LANES; j++) squares += dev[j];                                    \
        for (; i < h; i++) squares += (LOAD(x[i]) - mean) * (LOAD(x[i]) - mean);                 \
        const float rstd = 1.0f / sqrtf(squares / (float)h + eps);                               \
        for (i = 0; i < h; i++) {                                                                \
            float v = (LOAD(x[i]) - mean) * rstd;                                                \
            if (w) v = v * LOAD(w[i]);                                                           \
            if (b) v = v + LOAD(b[i]);                                                           \
            out[i] = STORE(v);                                                                   \
        }                                                                                        \
    }

#define LN_F32(v) (v)
LN_ROW(uint16_t, bf16_to_f32, f32_to_bf16)
LN_ROW(float, LN_F32, LN_F32)

/* x: rows of h values every x_stride elements; w, b: [h] or NULL; out: [rows, h] contiguous. */
void tessera_layer_norm(const void *x, int64_t x_stride, const void *w, const void *b, void *out, int64_t rows,
                        int64_t h, float eps, int is_bf16, int threads) {
#pragma omp parallel for num_threads(rows * h >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16)
            ln_row_uint16_t((const uint16_t *)x + r * x_stride, w, b, (uint16_t *)out + r * h, h, eps);
        else
            ln_row_float((const float *)x + r * x_stride, w, b, (float *)out + r * h, h, eps);
    }
}
