/* The gates around a linear-attention layer's core, one C call each instead of 5-12 small
 * torch ops (which also kept its decode steps out of the kernel graphs): the Gated
 * DeltaNet's decay and write strength, its gated output RMSNorm, and a sigmoid output gate
 * (Qwen3-Next / Qwen3.5's attention output, their shared expert's scale); Nemotron-H's
 * relu(x)^2, and Granite's scaled residual sums. One text for both
 * builds (gating.c with AVX512 flags, gating_avx2.c with AVX2); rounding follows the torch
 * builders step by step (bf16 where they round), exp is avx512_math.h's / avx2_math.h's
 * polynomial (within 2e-7 of torch's), the few per-head gates use libm. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#include "avx512_math.h"
#define LANES 16
/* p[0..LANES) <- 1 + exp(-p) */
static inline void one_plus_exp_neg(float *p) {
    const __m512 x = _mm512_loadu_ps(p);
    _mm512_storeu_ps(p, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#else
#include "avx2_math.h"
#define LANES 8
static inline void one_plus_exp_neg(float *p) {
    const __m256 x = _mm256_loadu_ps(p);
    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#endif

/* each product and sum rounded on its own, as torch's separate ops are (no FMA contraction) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define GATE_CHUNK 1024 /* columns per pass through the stack buffers (a multiple of LANES) */

/* den[i] = 1 + exp(-s[i]): sigmoid = 1 / den, silu = s / den, as torch computes them */
static void denominators(const float *s, float *den, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        memcpy(den + i, s + i, sizeof(float) * LANES);
        one_plus_exp_neg(den + i);
    }
    if (i < n) {
        float tail[LANES] = {0};
        memcpy(tail, s + i, sizeof(float) * (size_t)(n - i));
        one_plus_exp_neg(tail);
        memcpy(den + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Gated DeltaNet's gates per (token, value head): beta = sigmoid(b) (rounded to the model
 * dtype, as torch.sigmoid(b).float() is), g = -exp(A_log) softplus(a + dt_bias) in float32
 * (softplus's threshold 20 as torch's). a and b: rows every a_stride / b_stride elements;
 * A_log, dt_bias: [heads]; g, beta: [tokens, heads] float32. */
void tessera_delta_gates(const void *a, int64_t a_stride, const void *b, int64_t b_stride, const void *a_log,
                         const void *dt_bias, float *g, float *beta, int64_t tokens, int64_t heads, int is_bf16) {
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const float s = 1.0f / (1.0f + expf(-load(b, t * b_stride + h, is_bf16)));
            beta[t * heads + h] = is_bf16 ? round_to_bf16(s) : s;
            const float x = load(a, t * a_stride + h, is_bf16) + load(dt_bias, h, is_bf16);
            const float softplus = x > 20.0f ? x : log1pf(expf(x));
            g[t * heads + h] = -expf(load(a_log, h, is_bf16)) * softplus;
        }
    }
}

/* A gated RMSNorm per group of d values, in the torch builder's three forms:
 *   mode 0, norm first (Qwen3NextRMSNormGated): bf16 round(round(w * round(x / rms)) * silu(g));
 *   mode 1, gate first (Mamba-2's RMSNormGated): y = x silu(g) in float32, round(w * round(y / rms(y)));
 *   mode 2, norm first per group (Falcon-H1's): round(w * (x / rms) * silu(g)) in float32.
 * float32 models: the same without the roundings. x, out: [tokens, groups * d] contiguous;
 * gate: token t's values from t * gate_stride, adjacent; w: [w_period], value p of a token
 * weighted by w[p % w_period] (a weight per head dimension, or per channel). d <= GATE_CHUNK. */
void tessera_gated_rms_norm(const void *x, const void *gate, int64_t gate_stride, const void *w, int64_t w_period,
                            void *out, int64_t tokens, int64_t groups, int64_t d, float eps, int mode, int is_bf16,
                            int threads) {
#pragma omp parallel for num_threads(tokens * groups * d >= 65536 ? threads : 1) schedule(static)
    for (int64_t row = 0; row < tokens * groups; row++) {
        const int64_t t = row / groups, p0 = row % groups * d;
        float xs[GATE_CHUNK], gs[GATE_CHUNK], den[GATE_CHUNK];
        for (int64_t i = 0; i < d; i++) {
            xs[i] = load(x, row * d + i, is_bf16);
            gs[i] = load(gate, t * gate_stride + p0 + i, is_bf16);
        }
        denominators(gs, den, d);
        for (int64_t i = 0; i < d; i++) gs[i] = gs[i] / den[i]; /* silu */
        if (mode == 1) for (int64_t i = 0; i < d; i++) xs[i] = xs[i] * gs[i];
        float sum = 0.0f;
        for (int64_t i = 0; i < d; i++) sum += xs[i] * xs[i];
        const float inv = 1.0f / sqrtf(sum / (float)d + eps);
        for (int64_t i = 0; i < d; i++) {
            const float normed = xs[i] * inv, wv = load(w, (p0 + i) % w_period, is_bf16);
            float v;
            if (mode == 0) v = (is_bf16 ? round_to_bf16(wv * round_to_bf16(normed)) : wv * normed) * gs[i];
            else if (mode == 1) v = wv * (is_bf16 ? round_to_bf16(normed) : normed);
            else v = wv * normed * gs[i];
            store(out, row * d + i, v, is_bf16);
        }
    }
}

/* out = x * sigmoid(gate) (+ add), rounded as torch's ops are one by one in bf16: the
 * sigmoid, the product, the sum. x, gate, add: rows every x_stride / gate_stride /
 * add_stride elements; gate has `cols` columns or one (a scale per row); add may be NULL;
 * out: [rows, cols] contiguous. */
void tessera_sigmoid_gate_mul(const void *x, int64_t x_stride, const void *gate, int64_t gate_stride,
                              int64_t gate_cols, const void *add, int64_t add_stride, void *out, int64_t rows,
                              int64_t cols, int is_bf16, int threads) {
    const int64_t chunks = (cols + GATE_CHUNK - 1) / GATE_CHUNK;
#pragma omp parallel for num_threads(rows * cols >= 65536 ? threads : 1) schedule(static)
    for (int64_t item = 0; item < rows * chunks; item++) {
        const int64_t r = item / chunks, c0 = item % chunks * GATE_CHUNK;
        const int64_t n = cols - c0 < GATE_CHUNK ? cols - c0 : GATE_CHUNK, gn = gate_cols == 1 ? 1 : n;
        float gs[GATE_CHUNK], den[GATE_CHUNK];
        for (int64_t i = 0; i < gn; i++) gs[i] = load(gate, r * gate_stride + (gate_cols == 1 ? 0 : c0 + i), is_bf16);
        denominators(gs, den, gn);
        for (int64_t i = 0; i < gn; i++) {  /* (exp's clamp drops NaN: it stays NaN here, as torch's) */
            const float sigmoid = gs[i] != gs[i] ? gs[i] : 1.0f / den[i];
            gs[i] = is_bf16 ? round_to_bf16(sigmoid) : sigmoid;
        }
        for (int64_t i = 0; i < n; i++) {
            float v = load(x, r * x_stride + c0 + i, is_bf16) * gs[gate_cols == 1 ? 0 : i];
            if (add) v = (is_bf16 ? round_to_bf16(v) : v) + load(add, r * add_stride + c0 + i, is_bf16);
            store(out, r * cols + c0 + i, v, is_bf16);
        }
    }
}

/* relu(x)^2 (Nemotron-H's MLP), the square rounded as torch's: x, out [n] contiguous. */
void tessera_relu_squared(const void *x, void *out, int64_t n, int is_bf16, int threads) {
#pragma omp parallel for num_threads(n >= 65536 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float v = load(x, i, is_bf16), r = v > 0.0f ? v : (v != v ? v : 0.0f);
        store(out, i, r * r, is_bf16);
    }
}

/* (x + other) * scale, each step rounded as torch's (Granite's residual multiplier, its
 * experts' and shared MLP's sum); other may be NULL, scale 1 skips the product. scales (x's
 * dtype; may be NULL) replaces scale: element r * row_step + i * col_step scales row r,
 * column i (one a row: Llama 4's query temperature; one a column: Falcon-H1's muP vectors).
 * x, other: rows every x_stride / other_stride elements; out: [rows, cols] contiguous. */
void tessera_sum_and_scale(const void *x, int64_t x_stride, const void *other, int64_t other_stride,
                           const void *scales, int64_t row_step, int64_t col_step, void *out, int64_t rows,
                           int64_t cols, float scale, int is_bf16, int threads) {
#pragma omp parallel for num_threads(rows * cols >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int scaled = scales || scale != 1.0f;
        for (int64_t i = 0; i < cols; i++) {
            float v = load(x, r * x_stride + i, is_bf16);
            if (other) {
                v = v + load(other, r * other_stride + i, is_bf16);
                if (is_bf16 && scaled) v = round_to_bf16(v);
            }
            if (scaled) v = v * (scales ? load(scales, r * row_step + i * col_step, is_bf16) : scale);
            store(out, r * cols + i, v, is_bf16);
        }
    }
}
