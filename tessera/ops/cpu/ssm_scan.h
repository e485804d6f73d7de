/* Decode step of Mamba-2's selective scan (ops/linear_attention/mamba2.py), one token per
 * sequence, states updated in place by slot. One text for both builds (ssm_scan.c with
 * AVX512 flags, ssm_scan_avx2.c with AVX2): GCC vector types, lowered to each build's
 * registers, and one intrinsic helper per build for the horizontal sums.
 *
 * Per (sequence, head), with step = clamp(softplus(dt + dt_bias), lo, hi) and the head's
 * group g:   S <- exp(step A) S + (step x) B_g^T,   y = S C_g + D x.
 * S ([P, N], 32 KiB at P = 64, N = 128) is read, updated and written once, row by row, each
 * row's dot with C taken from the registers on the way: one pass over the state, where the
 * torch reference gathers it, makes two full-size temporaries and scatters it back.
 * Products and sums are rounded as torch rounds them (no FMA contraction below), so the new
 * state equals torch's wherever the step and the decay do (libm's expf / log1pf against
 * torch's vectorised ones: they may differ in the last bit); only y's dot over N runs in
 * another order. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define SSM_MAX_STATE 1024 /* d_state the per-item stack buffers hold (beyond: torch runs it) */
#define SSM_ROWS 4         /* rows of S whose four dot products share one horizontal reduction */

/* torch's rounding of each product and sum (the state bit-exact to its) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#ifdef __AVX512F__
typedef float vf __attribute__((vector_size(64)));
#define VL 16
/* the sums of four vectors' lanes (avx512_math.h's sum4, inlined here to keep its exp out) */
static inline __m128 sum4v(vf a, vf b, vf c, vf d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a, (__m512)b), _mm512_unpackhi_ps((__m512)a, (__m512)b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps((__m512)c, (__m512)d), _mm512_unpackhi_ps((__m512)c, (__m512)d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#else
typedef float vf __attribute__((vector_size(32)));
#define VL 8
static inline __m128 sum4v(vf a, vf b, vf c, vf d) {
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd); /* each half: [a b c d] partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* value i of a bf16 (is_bf16) or float32 array, as float32 */
static inline float load1(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void widen(const void *src, int is_bf16, int64_t n, float *dst) {
    if (is_bf16) for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    else memcpy(dst, src, sizeof(float) * n);
}

/* `nr` (a constant after inlining) consecutive rows of one head's state s [., n]: each row
 * r updated with xs[r] = step x[p] and its dot with c written to y[r]. Row after row, in
 * memory order: the same work with the rows' vectors interleaved (four streams 512 B apart)
 * ran at ~58% of an in-place torch mul_'s bandwidth on Zen 4, this order at ~90-100%. */
static inline __attribute__((always_inline)) void scan_rows(
        float *restrict s, int64_t n, const int nr, const float *restrict xs, const float *restrict b,
        const float *restrict c, float decay, float *restrict y) {
    vf acc[SSM_ROWS];
    float tail[SSM_ROWS];
    for (int r = 0; r < SSM_ROWS; r++) { acc[r] = (vf){0}; tail[r] = 0.0f; }
    for (int r = 0; r < nr; r++) {
        float *row = s + r * n;
        int64_t j = 0;
        for (; j + VL <= n; j += VL) {
            const vf v = vload(row + j) * decay + vload(b + j) * xs[r];
            vstore(row + j, v);
            acc[r] += v * vload(c + j);
        }
        for (; j < n; j++) { /* columns past the last full vector */
            const float v = row[j] * decay + b[j] * xs[r];
            row[j] = v;
            tail[r] += v * c[j];
        }
    }
    float sums[4];
    _mm_storeu_ps(sums, sum4v(acc[0], acc[1], acc[2], acc[3]));
    for (int r = 0; r < nr; r++) y[r] = sums[r] + tail[r];
}

/* x: [b, h, p] rows every x_stride elements; b_mat, c_mat: [b, g, n] rows every b_stride /
 * c_stride (all three in one type); dt: [b, h] rows every dt_stride; dt_bias, d_skip: [h];
 * a: [h] float32; state: [slots, h, p, n] float32; out: [b, h, p] in x's type. `dtypes`:
 * bit 0 x, B and C are bf16, bit 1 dt, bit 2 dt_bias, bit 3 D (float32 where clear).
 * Returns 1, having done nothing, for n over SSM_MAX_STATE or h not a multiple of g. */
int tessera_ssm_scan_decode(const void *x, const void *dt, const void *dt_bias, const float *a,
                            const void *b_mat, const void *c_mat, const void *d_skip, float lo, float hi,
                            float *state, const int64_t *slots, void *out, int64_t b, int64_t h, int64_t p,
                            int64_t n, int64_t g, int64_t x_stride, int64_t dt_stride, int64_t b_stride,
                            int64_t c_stride, int dtypes, int threads) {
    if (g <= 0 || n > SSM_MAX_STATE || h % g) return 1;
    const int xbf = dtypes & 1, dtbf = (dtypes >> 1) & 1, biasbf = (dtypes >> 2) & 1, dbf = (dtypes >> 3) & 1;
    const int64_t heads_per_group = h / g, es = xbf ? 2 : 4;
    /* a fork costs microseconds: only for steps of 64 KiB of state or more */
    const int par = b * h >= 2 && b * h * p * n >= 16384;
    /* static: each thread walks a run of consecutive heads, which lie next to each other in
     * a slot's state (one sequential stream) */
#pragma omp parallel for num_threads(par ? threads : 1) schedule(static)
    for (int64_t item = 0; item < b * h; item++) {
        const int64_t row = item / h, hh = item % h, grp = hh / heads_per_group;
        float bv[SSM_MAX_STATE], cv[SSM_MAX_STATE];
        widen((const char *)b_mat + (row * b_stride + grp * n) * es, xbf, n, bv);
        widen((const char *)c_mat + (row * c_stride + grp * n) * es, xbf, n, cv);
        /* F.softplus (threshold 20), then clamp: comparisons that keep a NaN, as torch's */
        const float v = load1(dt, dtbf, row * dt_stride + hh) + load1(dt_bias, biasbf, hh);
        float step = v > 20.0f ? v : log1pf(expf(v));
        step = step < lo ? lo : step;
        step = step > hi ? hi : step;
        const float decay = expf(step * a[hh]), dh = load1(d_skip, dbf, hh);
        const char *xr = (const char *)x + (row * x_stride + hh * p) * es;
        float *s = state + (slots[row] * h + hh) * p * n;
        for (int64_t r0 = 0; r0 < p; r0 += SSM_ROWS) {
            const int nr = p - r0 < SSM_ROWS ? (int)(p - r0) : SSM_ROWS;
            float xv[SSM_ROWS], xs[SSM_ROWS], y[SSM_ROWS];
            for (int r = 0; r < nr; r++) { xv[r] = load1(xr, xbf, r0 + r); xs[r] = step * xv[r]; }
            if (nr == SSM_ROWS) scan_rows(s + r0 * n, n, SSM_ROWS, xs, bv, cv, decay, y);
            else for (int r = 0; r < nr; r++) scan_rows(s + (r0 + r) * n, n, 1, xs + r, bv, cv, decay, y + r);
            const int64_t o = (row * h + hh) * p + r0;
            for (int r = 0; r < nr; r++) {
                const float yr = y[r] + dh * xv[r];
                if (xbf) ((uint16_t *)out)[o + r] = f32_to_bf16(yr);
                else ((float *)out)[o + r] = yr;
            }
        }
    }
    return 0;
}
