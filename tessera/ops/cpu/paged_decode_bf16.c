/* Paged decode attention over a bfloat16 KV cache: one query token per sequence, read
 * straight from the cache blocks (no gather copy), GQA without repeating K/V.
 * cache layout [num_blocks, block_size, num_kv_heads, head_size]; float32 scores, a
 * two-pass softmax, float32 accumulation of V; output rounded to bfloat16.
 * window > 0: the query at p = len - 1 sees keys in (p - window, p]. softcap > 0:
 * scores become softcap * tanh(scores / softcap) (gemma2). Built by build.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline __m512 load16(const uint16_t *p, __mmask16 mask) {
    __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline float dot(const uint16_t *k, const float *q, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 mask = d - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - i)) - 1u);
        acc = _mm512_fmadd_ps(load16(k + i, mask), _mm512_maskz_loadu_ps(mask, q + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static inline void axpy(float *acc, float p, const uint16_t *v, int64_t d) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 mask = d - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - i)) - 1u);
        __m512 a = _mm512_maskz_loadu_ps(mask, acc + i);
        _mm512_mask_storeu_ps(acc + i, mask, _mm512_fmadd_ps(pv, load16(v + i, mask), a));
    }
}

/* q, out: [batch, num_heads, d]; block_tables: [batch, table_width]; seq_lens: [batch]. */
int tessera_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out,
                              int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                              int64_t block_size, int64_t table_width, float scale, int64_t window,
                              float softcap, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t work = batch * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(work >= 2 ? threads : 1) reduction(| : failed)
    {
        int64_t capacity = 0;
        float *scores = NULL;
        float *qf = malloc(sizeof(float) * d);
        float *acc = malloc(sizeof(float) * d);
        if (!qf || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < work; item++) {
            if (failed) continue;
            const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t len = seq_lens[b];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            if (len - start > capacity) {
                free(scores);
                capacity = len - start;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) { failed = 1; capacity = 0; continue; }
            }
            const int32_t *table = block_tables + b * table_width;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                const uint16_t *qh = q + (b * num_heads + h) * d;
                for (int64_t i = 0; i < d; i++) qf[i] = bf16_to_f32(qh[i]);
                float best = -INFINITY;
                for (int64_t t = start; t < len; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    float s = dot(k_cache + (slot * num_kv_heads + kvh) * d, qf, d) * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    scores[t - start] = s;
                    if (s > best) best = s;
                }
                float total = 0.0f;
                for (int64_t t = 0; t < len - start; t++) {
                    scores[t] = expf(scores[t] - best);
                    total += scores[t];
                }
                memset(acc, 0, sizeof(float) * d);
                for (int64_t t = start; t < len; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    axpy(acc, scores[t - start] / total, v_cache + (slot * num_kv_heads + kvh) * d, d);
                }
                uint16_t *oh = out + (b * num_heads + h) * d;
                for (int64_t i = 0; i < d; i++) oh[i] = f32_to_bf16(acc[i]);
            }
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed;
}
