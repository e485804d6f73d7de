/* Decode steps of Gated DeltaNet (ops/linear_attention): the gated delta rule and the causal
 * conv1d + SiLU before it, one token per sequence, states updated in place by slot. One text
 * for both builds (gated_delta.c with AVX512 flags, gated_delta_avx2.c with AVX2): the delta
 * rule is written with GCC vector types, which each build lowers to its own registers.
 *
 * Delta rule, per (sequence, value head), with S_d = exp(g) S:
 *     delta = beta (v - S_d^T k),  S <- S_d + k delta^T,  out = S_d^T q + delta (k . q)
 * (out = S^T q of the new S, expanded), so one read pass over S computes both S^T k and
 * S^T q, and one read-modify-write pass writes the new S: the state, 64 KiB a head at
 * Dk = Dv = 128, is read twice, the second time from cache, and written once. The torch
 * reference makes a gathered copy and several full-size temporaries. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GD_MAX_DIM 1024 /* head sizes the per-item stack buffers hold (beyond: torch runs it) */

#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64))); /* one zmm register */
#define VL 16
#define TILE 8 /* vectors of columns per tile: 2 x 8 sums + 8 deltas fit in 32 registers */
#else
typedef float vf __attribute__((vector_size(32))); /* one ymm (as 2 x ymm, GCC spilled: 25x slower) */
#define VL 8
#define TILE 4 /* 16 registers */
#endif

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* bf16.h's f32_to_bf16 (nearest even, NaN stays NaN) with a select for the branch, which
 * the compiler vectorises */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

/* `n` values of a bf16 (is_bf16) or float32 row as float32 */
static inline void widen(const void *src, int is_bf16, int64_t n, float *dst) {
    if (is_bf16) for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    else memcpy(dst, src, sizeof(float) * n);
}

/* sum a_i b_i in VL independent partial sums (vectorised without reassociating) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[VL] = {0};
    for (int64_t i = 0; i < n; i++) lanes[i % VL] += a[i] * b[i];
    float sum = 0.0f;
    for (int l = 0; l < VL; l++) sum += lanes[l];
    return sum;
}

/* x * rsqrt(sum x^2 + 1e-6) * scale, in place (flash-linear-attention's L2 norm) */
static inline void l2_normalize(float *x, int64_t n, float scale) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv * scale;
}

/* Columns c0 .. c0 + nv * VL of one head's state s [dk, dv] (nv a constant after inlining,
 * so the sums stay in registers). */
static inline __attribute__((always_inline)) void delta_tile(
        float *restrict s, int64_t dk, int64_t dv, int64_t c0, const int nv, const float *restrict kn,
        const float *restrict qn, const float *restrict v, float decay, float beta, float kq,
        float *restrict o) {
    vf ak[TILE], aq[TILE], d[TILE];
    for (int j = 0; j < nv; j++) ak[j] = aq[j] = (vf){0};
    for (int64_t i = 0; i < dk; i++) {
        const float *row = s + i * dv + c0;
        /* narrower tiles than the row (AVX2; Dv > 128): fetch the rest of it on the first */
        if (c0 == 0) for (int64_t l = nv * VL; l < dv; l += 16) __builtin_prefetch(row + l);
        for (int j = 0; j < nv; j++) {
            const vf x = vload(row + j * VL);
            ak[j] += x * kn[i];
            aq[j] += x * qn[i];
        }
    }
    for (int j = 0; j < nv; j++) {
        d[j] = (vload(v + c0 + j * VL) - ak[j] * decay) * beta;
        vstore(o + c0 + j * VL, aq[j] * decay + d[j] * kq);
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * dv + c0;
        for (int j = 0; j < nv; j++) vstore(row + j * VL, vload(row + j * VL) * decay + d[j] * kn[i]);
    }
}

/* q, k: rows of hk * dk, v: rows of hv * dv (bf16 or float32, as is_bf16; a row every
 * *_stride elements, heads contiguous within it); g, beta: [b, hv] float32 rows every
 * gb_stride; state: [slots, hv, dk, dv] float32; out: [b, hv, dv] in v's type.
 * Returns 1, having done nothing, for head sizes over GD_MAX_DIM or hv not a multiple of hk. */
int tessera_gated_delta_decode(const void *q, const void *k, const void *v, const float *g,
                               const float *beta, float *state, const int64_t *slots, void *out,
                               int64_t b, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                               int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t gb_stride,
                               int is_bf16, int threads) {
    if (hk <= 0 || dk > GD_MAX_DIM || dv > GD_MAX_DIM || hv % hk) return 1;
    const int64_t r = hv / hk, esize = is_bf16 ? 2 : 4;
    const float scale = 1.0f / sqrtf((float)dk);
    /* static: each thread walks a run of consecutive heads, which lie next to each other in
     * a slot's state */
#pragma omp parallel for num_threads(b * hv >= 2 ? threads : 1) schedule(static)
    for (int64_t item = 0; item < b * hv; item++) {
        const int64_t row = item / hv, h = item % hv, kh = h / r;
        float qn[GD_MAX_DIM], kn[GD_MAX_DIM], vv[GD_MAX_DIM], o[GD_MAX_DIM];
        widen((const char *)q + (row * q_stride + kh * dk) * esize, is_bf16, dk, qn);
        widen((const char *)k + (row * k_stride + kh * dk) * esize, is_bf16, dk, kn);
        widen((const char *)v + (row * v_stride + h * dv) * esize, is_bf16, dv, vv);
        l2_normalize(qn, dk, scale);
        l2_normalize(kn, dk, 1.0f);
        const float kq = dot(kn, qn, dk), decay = expf(g[row * gb_stride + h]);
        const float bt = beta[row * gb_stride + h];
        float *s = state + (slots[row] * hv + h) * dk * dv;
        int64_t c = 0;
        for (; c + TILE * VL <= dv; c += TILE * VL)
            delta_tile(s, dk, dv, c, TILE, kn, qn, vv, decay, bt, kq, o);
        for (; c + VL <= dv; c += VL) delta_tile(s, dk, dv, c, 1, kn, qn, vv, decay, bt, kq, o);
        for (; c < dv; c++) { /* columns past the last full vector */
            float ak = 0.0f, aq = 0.0f;
            for (int64_t i = 0; i < dk; i++) { ak += s[i * dv + c] * kn[i]; aq += s[i * dv + c] * qn[i]; }
            const float d = (vv[c] - ak * decay) * bt;
            o[c] = aq * decay + d * kq;
            for (int64_t i = 0; i < dk; i++) s[i * dv + c] = s[i * dv + c] * decay + d * kn[i];
        }
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + (row * hv + h) * dv;
            for (int64_t i = 0; i < dv; i++) dst[i] = to_bf16(o[i]);
        } else {
            memcpy((float *)out + (row * hv + h) * dv, o, sizeof(float) * dv);
        }
    }
    return 0;
}

/* Causal conv1d decode: window = [state (K - 1 inputs), x], out = silu(round(sum_j window_j
 * w_j + bias)), each product and sum rounded as torch's (window * weight).sum(-1) does: in
 * order, no FMA (the pragmas keep the compilers from contracting), so the pre-activation is
 * bit-exact; the SiLU is silu_and_mul's (x / (1 + exp(-x)), polynomial exp). */
#ifdef __AVX512F__
#include "avx512_math.h"
#define SILU_LANES 16
static inline void silu_lanes(float *p) {
    const __m512 x = _mm512_loadu_ps(p);
    _mm512_storeu_ps(p, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                       exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
}
#else
#include "avx2_math.h"
#define SILU_LANES 8
static inline void silu_lanes(float *p) {
    const __m256 x = _mm256_loadu_ps(p);
    _mm256_storeu_ps(p, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                       exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
}
#endif

#define CONV_CHUNK 512 /* channels per work item (a multiple of SILU_LANES) */

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
/* n channels: pre[c] = the sum; st (K - 1 inputs a channel) shifted, x appended */
#define CONV_PRE(NAME, T, TO_F32)                                                                   \
    static inline __attribute__((always_inline)) void NAME##_any(                                   \
            const T *restrict x, const T *restrict w, const T *restrict bias, T *restrict st,       \
            float *restrict pre, int64_t n, int64_t km1) {                                          \
        for (int64_t c = 0; c < n; c++) {                                                           \
            T *sc = st + c * km1;                                                                   \
            const T *wc = w + c * (km1 + 1);                                                        \
            const T xv = x[c];                                                                      \
            float acc = 0.0f;                                                                       \
            for (int64_t j = 0; j < km1; j++) {                                                     \
                const float p = TO_F32(sc[j]) * TO_F32(wc[j]);                                      \
                acc += p;                                                                           \
            }                                                                                       \
            const float p = TO_F32(xv) * TO_F32(wc[km1]);                                           \
            acc += p;                                                                               \
            if (bias) acc += TO_F32(bias[c]);                                                       \
            for (int64_t j = 0; j + 1 < km1; j++) sc[j] = sc[j + 1];                                \
            if (km1) sc[km1 - 1] = xv;                                                              \
            pre[c] = acc;                                                                           \
        }                                                                                           \
    }                                                                                               \
    /* K = 4 (Qwen3-Next, Qwen3.5) as a constant: unrolled and vectorised across channels */        \
    static void NAME(const T *x, const T *w, const T *bias, T *st, float *pre, int64_t n, int64_t km1) {\
        if (km1 == 3) NAME##_any(x, w, bias, st, pre, n, 3);                                        \
        else NAME##_any(x, w, bias, st, pre, n, km1);                                               \
    }
#define SAME(x) (x)
CONV_PRE(conv_pre_bf16, uint16_t, bf16_to_f32)
CONV_PRE(conv_pre_f32, float, SAME)
#if defined(__clang__)
#pragma STDC FP_CONTRACT ON
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* One decode token per row through the causal conv, states shifted at `slots`. Plain
 * (tessera_causal_conv1d_decode): x rows -> silu(round(sum)). Gated (LFM2's short conv,
 * tessera_gated_short_conv_decode): x rows pack [B | C | X], c channels each -> C *
 * round(sum over B X), with torch's roundings in bf16 (B X rounded, the sum, the product). */
static void conv_decode(const void *x, int64_t x_stride, const void *w, const void *bias, void *state,
                        const int64_t *slots, void *out, int64_t b, int64_t c, int64_t width, int is_bf16,
                        int gated, int threads) {
    const int64_t chunks = (c + CONV_CHUNK - 1) / CONV_CHUNK, km1 = width - 1, es = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(b * c >= 4096 ? threads : 1) schedule(static)
    for (int64_t item = 0; item < b * chunks; item++) {
        const int64_t row = item / chunks, c0 = item % chunks * CONV_CHUNK;
        const int64_t n = c - c0 < CONV_CHUNK ? c - c0 : CONV_CHUNK;
        float pre[CONV_CHUNK] = {0};
        const char *xr = (const char *)x + (row * x_stride + c0) * es, *wr = (const char *)w + c0 * width * es;
        const char *br = bias ? (const char *)bias + c0 * es : NULL;
        char *sr = (char *)state + (slots[row] * c + c0) * km1 * es;
        if (gated && is_bf16) {
            const uint16_t *xb = (const uint16_t *)xr, *xc = xb + c, *xx = xb + 2 * c;
            uint16_t bx[CONV_CHUNK], *o = (uint16_t *)out + row * c + c0;
            for (int64_t i = 0; i < n; i++) bx[i] = to_bf16(bf16_to_f32(xb[i]) * bf16_to_f32(xx[i]));
            conv_pre_bf16(bx, (const uint16_t *)wr, (const uint16_t *)br, (uint16_t *)sr, pre, n, km1);
            for (int64_t i = 0; i < n; i++) o[i] = to_bf16(bf16_to_f32(xc[i]) * bf16_to_f32(to_bf16(pre[i])));
        } else if (gated) {
            const float *xb = (const float *)xr, *xc = xb + c, *xx = xb + 2 * c;
            float bx[CONV_CHUNK], *o = (float *)out + row * c + c0;
            for (int64_t i = 0; i < n; i++) bx[i] = xb[i] * xx[i];
            conv_pre_f32(bx, (const float *)wr, (const float *)br, (float *)sr, pre, n, km1);
            for (int64_t i = 0; i < n; i++) o[i] = xc[i] * pre[i];
        } else if (is_bf16) {
            conv_pre_bf16((const uint16_t *)xr, (const uint16_t *)wr, (const uint16_t *)br, (uint16_t *)sr,
                          pre, n, km1);
            /* torch rounds the sum to bf16 before SiLU: in a loop of its own, which vectorises
             * (inside the sum's loop it kept that from vectorising, 2.2x slower) */
            for (int64_t i = 0; i < n; i++) pre[i] = bf16_to_f32(to_bf16(pre[i]));
        } else {
            conv_pre_f32((const float *)xr, (const float *)wr, (const float *)br, (float *)sr, pre, n, km1);
        }
        if (gated) continue;
        for (int64_t i = 0; i < n; i += SILU_LANES) silu_lanes(pre + i); /* zeros past n */
        if (is_bf16) {
            uint16_t *o = (uint16_t *)out + row * c + c0;
            for (int64_t i = 0; i < n; i++) o[i] = to_bf16(pre[i]);
        } else {
            memcpy((float *)out + row * c + c0, pre, sizeof(float) * n);
        }
    }
}

/* x: [b, c] rows every x_stride elements; weight: [c, width]; bias: [c] or NULL (all three
 * and the state in one type, bf16 if is_bf16 else float32); state: [slots, c, width - 1];
 * out: [b, c]. */
void tessera_causal_conv1d_decode(const void *x, int64_t x_stride, const void *w, const void *bias,
                                  void *state, const int64_t *slots, void *out, int64_t b, int64_t c,
                                  int64_t width, int is_bf16, int threads) {
    conv_decode(x, x_stride, w, bias, state, slots, out, b, c, width, is_bf16, 0, threads);
}

/* LFM2's gated short convolution: bcx [b, 3c] rows every bcx_stride elements packing
 * [B | C | x]; the rest as tessera_causal_conv1d_decode's. */
void tessera_gated_short_conv_decode(const void *bcx, int64_t bcx_stride, const void *w, const void *bias,
                                     void *state, const int64_t *slots, void *out, int64_t b, int64_t c,
                                     int64_t width, int is_bf16, int threads) {
    conv_decode(bcx, bcx_stride, w, bias, state, slots, out, b, c, width, is_bf16, 1, threads);
}
