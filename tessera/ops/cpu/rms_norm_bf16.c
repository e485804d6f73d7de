/* RMSNorm over bfloat16 rows with the residual add fused, matching tessera's torch_rms_norm:
 *   s = bf16(x + residual)            (when residual is given; s is the next residual)
 *   out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))   (products and sums in float32)
 * One pass per row instead of the ~8 small torch ops (add, to, pow, mean, rsqrt, mul, to,
 * mul) whose dispatch dominates at decode batch sizes. Built by build.py. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x, out: [rows, h]; residual_in / residual_out: [rows, h] or NULL (no add); w: [h]. */
void tessera_rms_norm_bf16(const uint16_t *x, const uint16_t *residual_in, uint16_t *residual_out,
                           const uint16_t *w, uint16_t *out, int64_t rows, int64_t h, float eps,
                           int threads) {
#pragma omp parallel for num_threads(rows >= 16 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * h;
        float sum = 0.0f;
        float buf[h];
        for (int64_t i = 0; i < h; i++) {
            float v = bf16_to_f32(xr[i]);
            if (residual_in) {
                uint16_t s = f32_to_bf16(v + bf16_to_f32(residual_in[r * h + i]));
                residual_out[r * h + i] = s;
                v = bf16_to_f32(s);
            }
            buf[i] = v;
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)h + eps);
        for (int64_t i = 0; i < h; i++) {
            const float normed = bf16_to_f32(f32_to_bf16(buf[i] * inv));
            out[r * h + i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
        }
    }
}
