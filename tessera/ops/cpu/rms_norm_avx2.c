/* rms_norm_bf16.c for CPUs without AVX512 (same symbol, same rounding): plain C that the
 * compiler vectorises for AVX2 (build.py builds *_avx2.c files with -mavx2 -mfma).
 *   s = bf16(x + residual)            (when residual is given; s is the next residual)
 *   out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))   (products and sums in float32)
 * With TESSERA_F32_WEIGHT defined: w is float32 and s * rsqrt(...) is not rounded first. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

#ifdef TESSERA_F32_WEIGHT
typedef float weight_t;
#define WEIGHT(v) (v)
#define NORMED(v) (v)
#else
typedef uint16_t weight_t;
#define WEIGHT(v) bf16_to_f32(v)
#define NORMED(v) round_to_bf16(v)
#endif

/* out: [rows, h]; residual_in / residual_out: [rows, h] or NULL (no add); w: [h]. x: rows of h
 * in groups of `group` consecutive rows, a group every `group_stride` values (per-head norms
 * read the query or key heads of each token where the QKV projection left them, a copy saved
 * that would keep a decode step from being captured); group = rows: plain [rows, h]. */
void tessera_rms_norm_bf16(const uint16_t *x, const uint16_t *residual_in, uint16_t *residual_out,
                           const weight_t *w, uint16_t *out, int64_t rows, int64_t h, int64_t group,
                           int64_t group_stride, float eps, int threads) {
#pragma omp parallel for num_threads(rows >= 16 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + (r / group) * group_stride + (r % group) * h;
        float lanes[8] = {0};  /* independent partial sums: vectorised without reassociation */
        if (residual_in) {
            for (int64_t i = 0; i < h; i++) {
                const float s = round_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(residual_in[r * h + i]));
                residual_out[r * h + i] = f32_to_bf16(s);
                lanes[i & 7] += s * s;
            }
            xr = residual_out + r * h;
        } else {
            for (int64_t i = 0; i < h; i++) {
                const float s = bf16_to_f32(xr[i]);
                lanes[i & 7] += s * s;
            }
        }
        float sum = 0.0f;
        for (int l = 0; l < 8; l++) sum += lanes[l];
        const float inv = 1.0f / sqrtf(sum / (float)h + eps);
        for (int64_t i = 0; i < h; i++)
            out[r * h + i] = f32_to_bf16(WEIGHT(w[i]) * NORMED(bf16_to_f32(xr[i]) * inv));
    }
}
