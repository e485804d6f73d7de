/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x, bfloat16 in and out,
 * float32 accumulation. Decode at small batch is a matrix-vector product: every weight
 * byte is read once per step, so the kernel's job is to stream `w` at memory bandwidth.
 * Each thread takes a contiguous range of output features (rows of w); four rows of w are
 * walked together so each load of x is reused four times, and AVX512-BF16's dot product
 * (vdpbf16ps) multiplies 32 bf16 pairs per instruction. Tails of k are masked loads.
 * Built by tessera/ops/cpu/build.py with -mavx512f -mavx512bw -mavx512bf16 -fopenmp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 8

static inline __m512bh load_bf16(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* Output features [n0, n1) (a multiple-of-4 start) for all m rows of x. */
static void gemv_range(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t m, int64_t n_total, int64_t n0, int64_t n1, int64_t k) {
    const int64_t full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1ull);
    for (int64_t n = n0; n < n1; n += 4) {
        const int rows = n1 - n < 4 ? (int)(n1 - n) : 4;
        const uint16_t *wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (n + (j < rows ? j : 0)) * k;  /* tail: reread row n */
        __m512 acc[MAX_ROWS][4];
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            const __mmask32 mask = i < full ? (__mmask32)0xffffffffu : tail;
            const __m512bh b0 = load_bf16(wr[0] + i, mask), b1 = load_bf16(wr[1] + i, mask);
            const __m512bh b2 = load_bf16(wr[2] + i, mask), b3 = load_bf16(wr[3] + i, mask);
            for (int64_t r = 0; r < m; r++) {
                const __m512bh a = load_bf16(x + r * k + i, mask);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < rows; j++) {
                float s = _mm512_reduce_add_ps(acc[r][j]);
                if (bias) s += bf16_to_f32(bias[n + j]);
                y[r * n_total + n + j] = f32_to_bf16(s);
            }
    }
}

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; all contiguous bf16; 1 <= m <= MAX_ROWS. */
int tessera_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1) return 1;
    const int64_t groups = (n + 3) / 4;  /* threads split whole groups of four features */
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        const int64_t n0 = g0 * 4, n1 = g1 * 4 < n ? g1 * 4 : n;
        if (n0 < n1) gemv_range(x, w, bias, y, m, n, n0, n1, k);
    }
    return 0;
}

int tessera_gemv_max_rows(void) { return MAX_ROWS; }
