/* LoRA deltas for a few rows (decode steps), each row with its own adapter slot, on AVX2
 * (build.py builds *_avx2.c files with -mavx2 -mfma; AVX512 CPUs run it too). One call per
 * layer: a captured kernel graph replays it, reading the rows' slots from `row_slot`
 * (base-model rows: -1, nothing added).
 *   t[j]   = bf16(x[r] . a[s][j])                 j < rank[s], float32 sums
 *   out[r] = bf16(out[r] + bf16(sum_j t[j] * bt[s][j]))
 * the rounding of two bf16 GEMMs and an add, as the torch path does them. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_math.h"
#include "bf16.h"

#define MAX_CAPACITY 2048  /* slot rank capacity (max_lora_rank x packed shards, padded) */
#define STACK_IN 4096      /* input features widened on the stack (16 KiB); more: malloc */

/* x . a over n features: x already float32, a bf16 */
static float dot_f32_bf16(const float *x, const uint16_t *a, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), bf16x8_to_f32(a + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), bf16x8_to_f32(a + i + 8), acc1);
    }
    float sum = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) sum += x[i] * bf16_to_f32(a[i]);
    return sum;
}

/* One row's delta, added to out_row (n features), with slot s; 2 when no memory. */
static int lora_row(const uint16_t *x_row, uint16_t *outr, int32_t s, const int32_t *slot_rank,
                    const uint16_t *a, const uint16_t *bt, int64_t in, int64_t n, int64_t capacity) {
    float t[MAX_CAPACITY];
    float stack_x[STACK_IN];
    float *xf = in <= STACK_IN ? stack_x : malloc((size_t)in * sizeof(float));
    if (!xf) return 2;
    const int64_t rank = slot_rank[s];
    for (int64_t i = 0; i < in; i++) xf[i] = bf16_to_f32(x_row[i]);
    const uint16_t *as = a + (int64_t)s * capacity * in;
    for (int64_t j = 0; j < rank; j++) t[j] = round_to_bf16(dot_f32_bf16(xf, as + j * in, in));
    const uint16_t *bs = bt + (int64_t)s * capacity * n;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {  /* 16 outputs in two registers, summed over the rank */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++) {
            const __m256 tj = _mm256_set1_ps(t[j]);
            acc0 = _mm256_fmadd_ps(tj, bf16x8_to_f32(bs + j * n + c), acc0);
            acc1 = _mm256_fmadd_ps(tj, bf16x8_to_f32(bs + j * n + c + 8), acc1);
        }
        /* out + bf16(acc), rounded: bf16(acc) is exact in float32, so round twice */
        const __m256 d0 = bf16x8_to_f32_from(f32x8_to_bf16(acc0));
        const __m256 d1 = bf16x8_to_f32_from(f32x8_to_bf16(acc1));
        _mm_storeu_si128((__m128i *)(outr + c), f32x8_to_bf16(_mm256_add_ps(bf16x8_to_f32(outr + c), d0)));
        _mm_storeu_si128((__m128i *)(outr + c + 8),
                         f32x8_to_bf16(_mm256_add_ps(bf16x8_to_f32(outr + c + 8), d1)));
    }
    for (; c < n; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc += t[j] * bf16_to_f32(bs[j * n + c]);
        outr[c] = f32_to_bf16(bf16_to_f32(outr[c]) + round_to_bf16(acc));
    }
    if (xf != stack_x) free(xf);
    return 0;
}

/* x [rows, in]; out [rows, n] (added to); a [slots, capacity, in]; bt [slots, capacity, n];
 * row_slot [rows]; slot_rank [slots]. Several rows are shared out over `threads` (one row
 * runs on the caller's thread: a parallel region would cost more than it). Returns 1 for
 * a capacity it cannot hold, 2 when out of memory, else 0. */
int tessera_lora_rows_bf16(const uint16_t *x, uint16_t *out, const int32_t *row_slot,
                           const int32_t *slot_rank, const uint16_t *a, const uint16_t *bt,
                           int64_t rows, int64_t in, int64_t n, int64_t capacity, int threads) {
    if (capacity > MAX_CAPACITY) return 1;
    int status = 0;
    if (rows == 1 || threads <= 1) {
        for (int64_t r = 0; r < rows; r++)
            if (row_slot[r] >= 0 && lora_row(x + r * in, out + r * n, row_slot[r], slot_rank, a, bt, in, n, capacity))
                status = 2;
        return status;
    }
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max:status)
    for (int64_t r = 0; r < rows; r++)
        if (row_slot[r] >= 0 && lora_row(x + r * in, out + r * n, row_slot[r], slot_rank, a, bt, in, n, capacity))
            status = 2;
    return status;
}
