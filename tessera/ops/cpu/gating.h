/* The gates around a linear-attention layer's core, one C call each instead of 5-12 small
 * torch ops (which also kept its decode steps out of the kernel graphs): the Gated
 * DeltaNet's decay and write strength, its gated output RMSNorm, and a sigmoid output gate
 * (Qwen3-Next / Qwen3.5's attention output, their shared expert's scale). One text for both
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

/* Each head's row normalised, weighted, gated by SiLU (Qwen3NextRMSNormGated, norm first):
 * bf16: round(round(w * round(x / rms)) * silu(gate)); float32: w * (x / rms) * silu(gate).
 * x, out: [tokens * heads, d] contiguous; gate: token t's head h at t * gate_stride + h * d;
 * w: [d]. d <= GATE_CHUNK. */
void tessera_gated_rms_norm(const void *x, const void *gate, int64_t gate_stride, const void *w, void *out,
                            int64_t tokens, int64_t heads, int64_t d, float eps, int is_bf16, int threads) {
#pragma omp parallel for num_threads(tokens * heads * d >= 65536 ? threads : 1) schedule(static)
    for (int64_t row = 0; row < tokens * heads; row++) {
        const int64_t t = row / heads, h = row % heads;
        float xs[GATE_CHUNK], gs[GATE_CHUNK], den[GATE_CHUNK];
        float sum = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            xs[i] = load(x, row * d + i, is_bf16);
            sum += xs[i] * xs[i];
            gs[i] = load(gate, t * gate_stride + h * d + i, is_bf16);
        }
        const float inv = 1.0f / sqrtf(sum / (float)d + eps);
        denominators(gs, den, d);
        for (int64_t i = 0; i < d; i++) {
            const float silu = gs[i] / den[i];
            const float normed = xs[i] * inv;
            const float weighted = is_bf16 ? round_to_bf16(load(w, i, 1) * round_to_bf16(normed))
                                           : load(w, i, 0) * normed;
            store(out, row * d + i, weighted * silu, is_bf16);
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
