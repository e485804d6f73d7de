/* paged_decode_bf16.c for CPUs without AVX512 (same symbol, arguments and results up to
 * float32 summation order): one query token per sequence attends over its cache blocks in
 * place, GQA without repeating K/V, float32 scores, two-pass softmax, float32 accumulation
 * of V, window and soft-capping as there. Plain C: the 8 partial sums per dot product and
 * the per-lane value updates are what the compiler vectorises for AVX2. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline const uint16_t *row_of(const uint16_t *cache, const int32_t *table, int64_t shift,
                                     int64_t row_stride, int64_t head_offset, int64_t t) {
    const int64_t slot = ((int64_t)table[t >> shift] << shift) + (t & (((int64_t)1 << shift) - 1));
    return cache + slot * row_stride + head_offset;
}

static inline float dot(const float *q, const uint16_t *k, int64_t d) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += q[i + l] * bf16_to_f32(k[i + l]);
    for (; i < d; i++) lanes[0] += q[i] * bf16_to_f32(k[i]);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* q, out: [batch, num_heads, d]; block_tables: [batch, table_width]; seq_lens: [batch];
 * block_size a power of two (returns 2 otherwise); 1 if a buffer cannot be allocated. */
int tessera_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out,
                              int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                              int64_t block_size, int64_t table_width, float scale, int64_t window,
                              float softcap, int threads) {
    if (block_size <= 0 || (block_size & (block_size - 1))) return 2;
    const int64_t shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * d;
    const int64_t work = batch * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(work >= 2 ? threads : 1) reduction(| : failed)
    {
        int64_t capacity = 0;
        float *scores = NULL;
        float *qf = malloc(sizeof(float) * group * d), *acc = malloc(sizeof(float) * group * d);
        if (!qf || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < work; item++) {
            if (failed) continue;
            const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t len = seq_lens[b];
            const int64_t start = window > 0 && len > window ? len - window : 0, n = len - start;
            if (n * group > capacity) {
                free(scores);
                capacity = n * group;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) { failed = 1; capacity = 0; continue; }
            }
            const int32_t *table = block_tables + b * table_width;
            const int64_t first_head = b * num_heads + kvh * group;
            for (int64_t i = 0; i < group * d; i++) qf[i] = bf16_to_f32(q[first_head * d + i]);
            for (int64_t t = start; t < len; t++) {
                const uint16_t *k = row_of(k_cache, table, shift, row_stride, kvh * d, t);
                for (int64_t g = 0; g < group; g++) scores[g * n + (t - start)] = dot(qf + g * d, k, d);
            }
            memset(acc, 0, sizeof(float) * group * d);
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * n, best = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    float s = row[j] * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    row[j] = s;
                    best = s > best ? s : best;
                }
                for (int64_t j = 0; j < n; j++) {
                    row[j] = expf(row[j] - best);
                    sum += row[j];
                }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < n; j++) row[j] *= inv;
            }
            for (int64_t t = start; t < len; t++) {
                const uint16_t *v = row_of(v_cache, table, shift, row_stride, kvh * d, t);
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * n + (t - start)];
                    float *a = acc + g * d;
                    for (int64_t i = 0; i < d; i++) a[i] += p * bf16_to_f32(v[i]);
                }
            }
            for (int64_t i = 0; i < group * d; i++) out[first_head * d + i] = f32_to_bf16(acc[i]);
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed;
}
