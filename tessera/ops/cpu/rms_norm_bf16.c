/* RMSNorm over bfloat16 rows with the residual add fused, matching tessera's torch_rms_norm:
 *   s = bf16(x + residual)            (when residual is given; s is the next residual)
 *   out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))   (products and sums in float32)
 * One vectorised pass per row instead of the ~8 small torch ops (add, to, pow, mean, rsqrt,
 * mul, to, mul) whose dispatch dominates at decode batch sizes. Rounding to bf16 is
 * nearest even, as torch (simd_bf16.h). Built by build.py.
 * Built with TESSERA_F32_WEIGHT defined, w is float32 (Gemma's 1 + w) and the normalised
 * row is not rounded before it: out = bf16(w * (s * rsqrt(...))), as tessera/ops/norm.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd_bf16.h"

#ifdef TESSERA_F32_WEIGHT
typedef float weight_t;
#define LOAD_WEIGHT(p, m) _mm512_maskz_loadu_ps((m), (p))
#define NORMED(v) (v)
#else
typedef uint16_t weight_t;
#define LOAD_WEIGHT(p, m) load_bf16x16((p), (m))
#define NORMED(v) round_bf16x16(v)
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
        __m512 sum = _mm512_setzero_ps();
        if (residual_in) {  /* s = bf16(x + residual), stored as the next residual */
            for (int64_t i = 0; i < h; i += 16) {
                const __mmask16 m = lanes16(h - i);
                const __m512 s = round_bf16x16(_mm512_add_ps(load_bf16x16(xr + i, m), load_bf16x16(residual_in + r * h + i, m)));
                _mm256_mask_storeu_epi16(residual_out + r * h + i, m, f32x16_to_bf16(s));
                sum = _mm512_fmadd_ps(s, s, sum);
            }
            xr = residual_out + r * h;
        } else {
            for (int64_t i = 0; i < h; i += 16) {
                const __m512 s = load_bf16x16(xr + i, lanes16(h - i));
                sum = _mm512_fmadd_ps(s, s, sum);
            }
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = lanes16(h - i);
            const __m512 normed = NORMED(_mm512_mul_ps(load_bf16x16(xr + i, m), inv));
            _mm256_mask_storeu_epi16(out + r * h + i, m, f32x16_to_bf16(_mm512_mul_ps(LOAD_WEIGHT(w + i, m), normed)));
        }
    }
}
