/* Paged decode attention over a bfloat16 KV cache: one query token per sequence, read
 * straight from the cache blocks (no gather copy), GQA without repeating K/V.
 * cache layout [num_blocks, block_size, num_kv_heads, head_size]; float32 scores, a
 * two-pass softmax, float32 accumulation of V; output rounded to bfloat16.
 * window > 0: the query at p = len - 1 sees keys in (p - window, p]. softcap > 0:
 * scores become softcap * tanh(scores / softcap) (gemma2). sinks (NULL: none): a logit per
 * query head in each softmax's denominator (gpt-oss, attention_sinks.h).
 *
 * One work item is one (sequence, KV head), or a whole sequence when the batch has enough
 * of them: every query head of a GQA group is served from one read of each key and value
 * row. Scores: four keys at a time, vdpbf16ps on the
 * bf16 query and key (products are exact in float32) and one transpose-and-add for the
 * four sums. Softmax: vectorised exp. Values: for head sizes 64, 128 and 256 the output
 * rows of a tile of heads stay in registers across all keys; other sizes accumulate in
 * memory. Built by build.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_sinks.h"
#include "avx512_math.h"
#include "bf16.h"
#include "simd_bf16.h"

typedef struct {
    const uint16_t *k_cache, *v_cache;
    const int32_t *table;   /* this sequence's block table */
    int64_t block_shift, row_stride, head_offset;  /* log2(block size); elements per cache slot; this KV head's */
} KvRows;

/* Block sizes are powers of two (the engine's config requires it): a shift and a mask per
 * key row rather than a division by a runtime value. */
static inline const uint16_t *row_of(const KvRows *kv, const uint16_t *cache, int64_t t) {
    const int64_t slot = ((int64_t)kv->table[t >> kv->block_shift] << kv->block_shift)
                         + (t & (((int64_t)1 << kv->block_shift) - 1));
    return cache + slot * kv->row_stride + kv->head_offset;
}

#define PREFETCH_AHEAD 8

static inline void prefetch_row(const uint16_t *row, int64_t d, int hint) {
    for (int64_t i = 0; i < d; i += 32) {  /* one 64-byte line per 32 elements */
        if (hint == _MM_HINT_T0) _mm_prefetch((const char *)(row + i), _MM_HINT_T0);
        else _mm_prefetch((const char *)(row + i), _MM_HINT_T1);
    }
}

static inline __m512i load_bf16x32(const uint16_t *p, __mmask32 mask, int masked) {
    return masked ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p);
}

/* scores[h * n + (t - start)] = q_h . k_t for the item's query heads h (kv_heads groups of
 * `group`, consecutive in q) and keys t; head h reads KV head h / group of the item. */
static void scores_pass(const uint16_t *q, int64_t kv_heads, int64_t group, int64_t d,
                        const KvRows *kv, int64_t start, int64_t len, float *scores) {
    const int64_t n = len - start, full = d / 32 * 32, span = kv_heads * d;
    const __mmask32 tail = (__mmask32)((1ull << (d - full)) - 1ull);
    int64_t t = start;
    for (; t + 4 <= len; t += 4) {
        const uint16_t *r0 = row_of(kv, kv->k_cache, t), *r1 = row_of(kv, kv->k_cache, t + 1);
        const uint16_t *r2 = row_of(kv, kv->k_cache, t + 2), *r3 = row_of(kv, kv->k_cache, t + 3);
        /* A KV head's rows are short runs a cache slot apart, which the hardware prefetchers
         * follow poorly: fetch the keys PREFETCH_AHEAD rows on, and the values for the pass
         * after this one. */
        for (int64_t u = t + PREFETCH_AHEAD; u < t + PREFETCH_AHEAD + 4 && u < len; u++)
            prefetch_row(row_of(kv, kv->k_cache, u), span, _MM_HINT_T0);
        for (int64_t u = t; u < t + 4; u++) prefetch_row(row_of(kv, kv->v_cache, u), span, _MM_HINT_T1);
        for (int64_t h = 0; h < kv_heads * group; h++) {
            const uint16_t *qh = q + h * d;
            const int64_t off = h / group * d;
            const uint16_t *k0 = r0 + off, *k1 = r1 + off, *k2 = r2 + off, *k3 = r3 + off;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < d; i += 32) {
                const int masked = i >= full;
                const __m512i qv = load_bf16x32(qh + i, tail, masked);
                a0 = dot_bf16_pairs(a0, qv, load_bf16x32(k0 + i, tail, masked));
                a1 = dot_bf16_pairs(a1, qv, load_bf16x32(k1 + i, tail, masked));
                a2 = dot_bf16_pairs(a2, qv, load_bf16x32(k2 + i, tail, masked));
                a3 = dot_bf16_pairs(a3, qv, load_bf16x32(k3 + i, tail, masked));
            }
            _mm_storeu_ps(scores + h * n + (t - start), sum4(a0, a1, a2, a3));
        }
    }
    for (; t < len; t++) {
        const uint16_t *r0 = row_of(kv, kv->k_cache, t);
        for (int64_t h = 0; h < kv_heads * group; h++) {
            const uint16_t *k0 = r0 + h / group * d;
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 32) {
                const int masked = i >= full;
                a0 = dot_bf16_pairs(a0, load_bf16x32(q + h * d + i, tail, masked),
                                      load_bf16x32(k0 + i, tail, masked));
            }
            scores[h * n + (t - start)] = _mm512_reduce_add_ps(a0);
        }
    }
}

/* In place: row <- exp(row * scale (soft-capped) - max); returns 1 / sum, the sink (-inf:
 * none) counted in the max and the sum. */
static float softmax_row(float *row, int64_t n, float scale, float softcap, float sink) {
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes16(n - i);
        __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), vscale);
        if (softcap > 0.0f) {
            float tmp[16];
            _mm512_storeu_ps(tmp, s);
            for (int j = 0; j < 16; j++) tmp[j] = softcap * tanhf(tmp[j] / softcap);
            s = _mm512_loadu_ps(tmp);
        }
        _mm512_mask_storeu_ps(row + i, m, s);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, s);
    }
    const float top = _mm512_reduce_max_ps(vmax), top_or_sink = sink > top ? sink : top;
    const __m512 best = _mm512_set1_ps(top_or_sink);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes16(n - i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), best));
        _mm512_mask_storeu_ps(row + i, m, e);
        vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    return 1.0f / (_mm512_reduce_add_ps(vsum) + expf(sink - top_or_sink));
}

static inline void store_out(uint16_t *out, __m512 v) {
    _mm256_storeu_si256((__m256i *)out, f32x16_to_bf16(v));
}

/* out_g = inv[g] * sum_t p[g, t] v_t with the output rows of `tile` heads held in
 * registers; D (64, 128 or 256) and tile are constants after inlining. */
static inline __attribute__((always_inline)) void values_pass_fixed(
        const float *p, const float *inv, int64_t group, const KvRows *kv, int64_t start,
        int64_t len, uint16_t *out, const int D, const int tile) {
    const int64_t n = len - start;
    for (int64_t g0 = 0; g0 < group; g0 += tile) {
        const int heads = group - g0 < tile ? (int)(group - g0) : tile;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = start; t < len; t++) {
            const uint16_t *v = row_of(kv, kv->v_cache, t);
            __m512 vv[16];
            for (int c = 0; c < D / 16; c++) vv[c] = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(v + c * 16)));
            for (int h = 0; h < tile; h++) {
                if (h >= heads) break;
                const __m512 pv = _mm512_set1_ps(p[(g0 + h) * n + (t - start)]);
                for (int c = 0; c < D / 16; c++) acc[h * (D / 16) + c] = _mm512_fmadd_ps(pv, vv[c], acc[h * (D / 16) + c]);
            }
        }
        for (int h = 0; h < heads; h++) {
            const __m512 s = _mm512_set1_ps(inv[g0 + h]);
            for (int c = 0; c < D / 16; c++)
                store_out(out + (g0 + h) * D + c * 16, _mm512_mul_ps(acc[h * (D / 16) + c], s));
        }
    }
}

/* Any head size: accumulate in `acc` ([group, d] floats). */
static void values_pass_any(const float *p, const float *inv, int64_t group, int64_t d,
                            const KvRows *kv, int64_t start, int64_t len, float *acc, uint16_t *out) {
    const int64_t n = len - start;
    memset(acc, 0, sizeof(float) * group * d);
    for (int64_t t = start; t < len; t++) {
        const uint16_t *v = row_of(kv, kv->v_cache, t);
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = lanes16(d - i);
            const __m512 vv = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, v + i));
            for (int64_t g = 0; g < group; g++) {
                float *a = acc + g * d + i;
                _mm512_mask_storeu_ps(a, m, _mm512_fmadd_ps(_mm512_set1_ps(p[g * n + (t - start)]), vv,
                                                            _mm512_maskz_loadu_ps(m, a)));
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < d; i++) out[g * d + i] = f32_to_bf16(acc[g * d + i] * inv[g]);
}

/* q: [batch, num_heads, d], its rows q_stride elements apart (a column slice of a packed
 * QKV projection); out: [batch, num_heads, d]; block_tables: [batch, table_width];
 * seq_lens: [batch]; block_size a power of two (returns 2 otherwise). */
int tessera_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out,
                              int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                              int64_t block_size, int64_t table_width, float scale, int64_t window,
                              float softcap, const float *sinks, int threads) {
    if (block_size <= 0 || (block_size & (block_size - 1))) return 2;
    const int64_t block_shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t group = num_heads / num_kv_heads;
    /* One work item is a sequence's KV heads together when there are sequences enough to
     * share out (its cache rows are then read front to back), else one KV head. */
    const int64_t kv_per_item = batch >= 4 * (int64_t)threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
    const int64_t work = batch * items_per_seq;
    const int64_t item_heads = kv_per_item * group;
    int failed = 0;
#pragma omp parallel num_threads(work >= 2 ? threads : 1) reduction(| : failed)
    {
        int64_t capacity = 0;
        float *scores = NULL;
        float *inv = malloc(sizeof(float) * item_heads);
        float *acc = malloc(sizeof(float) * group * d);
        if (!inv || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < work; item++) {
            if (failed) continue;
            const int64_t b = item / items_per_seq, kvh0 = item % items_per_seq * kv_per_item;
            const int64_t len = seq_lens[b];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            const int64_t n = len - start;
            if (n * item_heads > capacity) {
                free(scores);
                capacity = n * item_heads;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) { failed = 1; capacity = 0; continue; }
            }
            const int64_t first_head = b * num_heads + kvh0 * group;
            KvRows kv = {k_cache, v_cache, block_tables + b * table_width, block_shift,
                         num_kv_heads * d, kvh0 * d};
            scores_pass(q + b * q_stride + kvh0 * group * d, kv_per_item, group, d, &kv, start, len, scores);
            for (int64_t h = 0; h < item_heads; h++)
                inv[h] = softmax_row(scores + h * n, n, scale, softcap, sink_of(sinks, kvh0 * group + h));
            for (int64_t j = 0; j < kv_per_item; j++, kv.head_offset += d) {
                const float *p = scores + j * group * n, *iv = inv + j * group;
                uint16_t *o = out + (first_head + j * group) * d;
                switch (d) {
                    case 64: values_pass_fixed(p, iv, group, &kv, start, len, o, 64, 4); break;
                    case 128: values_pass_fixed(p, iv, group, &kv, start, len, o, 128, 2); break;
                    case 256: values_pass_fixed(p, iv, group, &kv, start, len, o, 256, 1); break;
                    default: values_pass_any(p, iv, group, d, &kv, start, len, acc, o);
                }
            }
        }
        free(scores);
        free(inv);
        free(acc);
    }
    return failed;
}
