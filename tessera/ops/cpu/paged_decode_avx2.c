/* paged_decode_bf16.c for CPUs without AVX512 (same symbol, arguments and results up to
 * float32 summation order), and for a cache of 8-bit floats on any CPU with AVX2 (built
 * with TESSERA_KV_FP8: kv_rows.h): one query token per sequence attends over its cache blocks in
 * place, GQA without repeating K/V, float32 scores, a two-pass softmax, float32
 * accumulation of V, window and soft-capping as there.
 *
 * Decode attention reads the whole cache once per step, so the loops are shaped to keep
 * the 16 AVX2 registers busy rather than the load and store ports:
 * - scores: four keys by up to three query heads (twelve accumulators), each key chunk
 *   widened from bf16 once and used by every head of the tile, the four sums of a head
 *   reduced together by one transpose-and-add;
 * - values: sixteen keys at a time (their rows stay in L1), output dims in 16-lane chunks
 *   held in registers for up to four heads across those keys;
 * - rows KEYS_AHEAD keys on are prefetched: blocks are scattered, and at each block's end
 *   the hardware prefetcher loses the stream. The prefetches are spread thin (K: a head's
 *   rows per 4-key step; V: one line per key inside the FMA loop), since a burst of them
 *   for every head of many keys at once stalled the loads they were meant to help.
 * A work item is a partition of one sequence's keys for all its KV heads, so each cache
 * slot is read whole. A batch smaller than the threads' share of work has its contexts
 * split into several partitions, merged afterwards, so batch-1 decode uses every thread.
 * tools/bench_cpu_attention.py times it. Built by build.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_sinks.h"
#include "avx2_math.h"
#include "bf16.h"
#include "kv_rows.h"
#include "paged_slots.h"

#define SCORE_HEADS 3   /* query heads per score tile: 4 keys x 3 heads = 12 accumulators */
#define VALUE_KEYS 16   /* keys per value tile */
#define VALUE_HEADS 4   /* query heads per value tile: 4 heads x 16 dims = 8 accumulators */
#define MIN_PARTITION 128   /* the fewest keys a partition of a split context takes */
#define MAX_PARTITION 4096  /* the most: bounds the score buffer */
#define ITEMS_PER_THREAD 4
/* Keys ahead whose rows are prefetched: blocks are scattered, and at every block boundary
 * the hardware prefetcher loses the stream (without this, the loads of rows not yet in
 * cache took most of the time). */
#define KEYS_AHEAD 16

typedef struct {
    const kv_t *k_cache, *v_cache;
    const int32_t *table;        /* this sequence's block table */
    int64_t shift, row_stride;   /* log2(block size); elements per cache slot */
} KvRows;

/* The first element of slot t's row (all KV heads); block sizes are powers of two. */
static inline int64_t slot_offset(const KvRows *kv, int64_t t) {
    return paged_slot(kv->table, kv->shift, t) * kv->row_stride;
}

/* `elems` cache values from `row` towards L1. */
static inline void prefetch_row(const kv_t *row, int64_t elems) {
    for (int64_t byte = 0; byte < elems * (int64_t)sizeof(kv_t); byte += 64) _mm_prefetch((const char *)row + byte, _MM_HINT_T0);
}

/* the totals of a0..a3, in that order */
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* out[h * n + j] = q_h . k_j for `heads` (constant after inlining, <= SCORE_HEADS) float32
 * query rows q_h = qf + h * d and four bf16 keys k_j. */
static inline __attribute__((always_inline)) void scores_4keys(
        const float *qf, int64_t d, const kv_t *k0, const kv_t *k1, const kv_t *k2,
        const kv_t *k3, float *out, int64_t n, const int heads) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 q0 = _mm256_loadu_ps(qf + i);
        const __m256 q1 = heads > 1 ? _mm256_loadu_ps(qf + d + i) : q0;
        const __m256 q2 = heads > 2 ? _mm256_loadu_ps(qf + 2 * d + i) : q0;
        /* one key's chunk, widened once, into the accumulators of every head */
#define KEY_FMAS(key, acc0, acc1, acc2) do {                            \
            const __m256 k = kv8_widened((key) + i);                    \
            acc0 = _mm256_fmadd_ps(q0, k, acc0);                        \
            if (heads > 1) acc1 = _mm256_fmadd_ps(q1, k, acc1);         \
            if (heads > 2) acc2 = _mm256_fmadd_ps(q2, k, acc2);         \
        } while (0)
        KEY_FMAS(k0, a00, a10, a20);
        KEY_FMAS(k1, a01, a11, a21);
        KEY_FMAS(k2, a02, a12, a22);
        KEY_FMAS(k3, a03, a13, a23);
#undef KEY_FMAS
    }
    __m128 s[SCORE_HEADS];
    s[0] = sum4(a00, a01, a02, a03);
    if (heads > 1) s[1] = sum4(a10, a11, a12, a13);
    if (heads > 2) s[2] = sum4(a20, a21, a22, a23);
    for (int h = 0; h < heads; h++) {
        if (i < d) {  /* head sizes that are not a multiple of 8 */
            float t[4];
            _mm_storeu_ps(t, s[h]);
            const kv_t *keys[4] = {k0, k1, k2, k3};
            for (int j = 0; j < 4; j++)
                for (int64_t e = i; e < d; e++) t[j] += qf[h * d + e] * kv_widened(keys[j][e]);
            s[h] = _mm_loadu_ps(t);
        }
        _mm_storeu_ps(out + h * n, s[h]);
    }
}

static float dot1(const float *q, const kv_t *k, int64_t d) {
    __m256 a = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv8_widened(k + i), a);
    float s = hsum8(a);
    for (; i < d; i++) s += q[i] * kv_widened(k[i]);
    return s;
}

/* scores[h * n + (t - start)] = q_h . k_t for a sequence's query heads (kv_heads groups of
 * `group`, group j reading KV head j) and keys t in [start, end). */
static void scores_pass(const float *qf, int64_t kv_heads, int64_t group, int64_t d,
                        const KvRows *kv, int64_t start, int64_t end, float *scores) {
    const int64_t n = end - start;
    int64_t t = start;
    for (; t + 4 <= end; t += 4) {
        const kv_t *r0 = kv->k_cache + slot_offset(kv, t), *r1 = kv->k_cache + slot_offset(kv, t + 1);
        const kv_t *r2 = kv->k_cache + slot_offset(kv, t + 2), *r3 = kv->k_cache + slot_offset(kv, t + 3);
        const kv_t *ahead[4];  /* rows KEYS_AHEAD keys on (NULL past the end) */
        for (int64_t u = 0; u < 4; u++)
            ahead[u] = t + KEYS_AHEAD + u < end ? kv->k_cache + slot_offset(kv, t + KEYS_AHEAD + u) : NULL;
        for (int64_t j = 0; j < kv_heads; j++) {
            const int64_t off = j * d;
            /* this head's rows only (all heads' at once: 133 -> 106 ms at 32 x 2000 when spread) */
            for (int64_t u = 0; u < 4 && ahead[u]; u++) prefetch_row(ahead[u] + off, d);
            for (int64_t g = 0; g < group; g += SCORE_HEADS) {
                const int64_t h = j * group + g;
                const float *q = qf + h * d;
                float *out = scores + h * n + (t - start);
                switch (group - g) {
                    case 1: scores_4keys(q, d, r0 + off, r1 + off, r2 + off, r3 + off, out, n, 1); break;
                    case 2: scores_4keys(q, d, r0 + off, r1 + off, r2 + off, r3 + off, out, n, 2); break;
                    default: scores_4keys(q, d, r0 + off, r1 + off, r2 + off, r3 + off, out, n, 3);
                }
            }
        }
    }
    for (; t < end; t++) {
        const kv_t *r = kv->k_cache + slot_offset(kv, t);
        for (int64_t h = 0; h < kv_heads * group; h++)
            scores[h * n + (t - start)] = dot1(qf + h * d, r + h / group * d, d);
    }
}

/* In place: row <- exp(row * scale (soft-capped) - max); *best = that max, returns the sum. */
static float exp_row(float *row, int64_t n, float scale, float softcap, float *best) {
    const int64_t n8 = n / 8 * 8;
    if (softcap > 0.0f) {
        for (int64_t j = 0; j < n; j++) row[j] = softcap * tanhf(row[j] * scale / softcap);
    } else {
        const __m256 s = _mm256_set1_ps(scale);
        for (int64_t j = 0; j < n8; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), s));
        for (int64_t j = n8; j < n; j++) row[j] *= scale;
    }
    __m256 vbest = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n8; j += 8) vbest = _mm256_max_ps(vbest, _mm256_loadu_ps(row + j));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, vbest);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (int64_t j = n8; j < n; j++) m = row[j] > m ? row[j] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm));
        _mm256_storeu_ps(row + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (int64_t j = n8; j < n; j++) {
        row[j] = expf(row[j] - m);
        sum += row[j];
    }
    *best = m;
    return sum;
}

/* acc[h][i..i+16) += sum_j p[h * n + j] * v_j[i..i+16) for `heads` (constant after
 * inlining, <= VALUE_HEADS) rows of acc (stride d) and `keys` value rows. */
static inline __attribute__((always_inline)) void values_16dims(
        float *acc, int64_t d, const kv_t *const *rows, const kv_t *const *ahead,
        int64_t keys, int64_t i, const float *p, int64_t n, const int heads) {
    __m256 a00 = _mm256_loadu_ps(acc + i), a01 = _mm256_loadu_ps(acc + i + 8);
    __m256 a10 = a00, a11 = a01, a20 = a00, a21 = a01, a30 = a00, a31 = a01;
    if (heads > 1) { a10 = _mm256_loadu_ps(acc + d + i); a11 = _mm256_loadu_ps(acc + d + i + 8); }
    if (heads > 2) { a20 = _mm256_loadu_ps(acc + 2 * d + i); a21 = _mm256_loadu_ps(acc + 2 * d + i + 8); }
    if (heads > 3) { a30 = _mm256_loadu_ps(acc + 3 * d + i); a31 = _mm256_loadu_ps(acc + 3 * d + i + 8); }
    for (int64_t j = 0; j < keys; j++) {
        _mm_prefetch((const char *)(ahead[j] + i), _MM_HINT_T0);
        __m256 v0, v1;
        kv16_widened(rows[j] + i, &v0, &v1);
        __m256 w = _mm256_broadcast_ss(p + j);
        a00 = _mm256_fmadd_ps(w, v0, a00);
        a01 = _mm256_fmadd_ps(w, v1, a01);
        if (heads > 1) {
            w = _mm256_broadcast_ss(p + n + j);
            a10 = _mm256_fmadd_ps(w, v0, a10);
            a11 = _mm256_fmadd_ps(w, v1, a11);
        }
        if (heads > 2) {
            w = _mm256_broadcast_ss(p + 2 * n + j);
            a20 = _mm256_fmadd_ps(w, v0, a20);
            a21 = _mm256_fmadd_ps(w, v1, a21);
        }
        if (heads > 3) {
            w = _mm256_broadcast_ss(p + 3 * n + j);
            a30 = _mm256_fmadd_ps(w, v0, a30);
            a31 = _mm256_fmadd_ps(w, v1, a31);
        }
    }
    _mm256_storeu_ps(acc + i, a00);
    _mm256_storeu_ps(acc + i + 8, a01);
    if (heads > 1) { _mm256_storeu_ps(acc + d + i, a10); _mm256_storeu_ps(acc + d + i + 8, a11); }
    if (heads > 2) { _mm256_storeu_ps(acc + 2 * d + i, a20); _mm256_storeu_ps(acc + 2 * d + i + 8, a21); }
    if (heads > 3) { _mm256_storeu_ps(acc + 3 * d + i, a30); _mm256_storeu_ps(acc + 3 * d + i + 8, a31); }
}

/* As values_16dims for dims [i, d) (fewer than 16), one head at a time. */
static void values_tail(float *acc, int64_t d, const kv_t *const *rows, int64_t keys, int64_t i,
                        const float *p, int64_t n, int64_t heads) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < keys; j++) {
            const float w = p[h * n + j];
            for (int64_t e = i; e < d; e++) acc[h * d + e] += w * kv_widened(rows[j][e]);
        }
}

/* acc[h] = sum_t p[h * n + (t - start)] v_t over keys [start, end) for the item's heads
 * (acc [kv_heads * group, d], zeroed here). */
static void values_pass(const float *p, int64_t kv_heads, int64_t group, int64_t d,
                        const KvRows *kv, int64_t start, int64_t end, float *acc) {
    const int64_t n = end - start, d16 = d / 16 * 16;
    memset(acc, 0, sizeof(float) * kv_heads * group * d);
    const kv_t *slots[VALUE_KEYS], *rows[VALUE_KEYS], *ahead_slots[VALUE_KEYS], *ahead[VALUE_KEYS];
    for (int64_t t0 = start; t0 < end; t0 += VALUE_KEYS) {
        const int64_t keys = end - t0 < VALUE_KEYS ? end - t0 : VALUE_KEYS;
        for (int64_t j = 0; j < keys; j++) {
            slots[j] = kv->v_cache + slot_offset(kv, t0 + j);
            /* the next tile's rows, prefetched one per key and 16 dims inside the FMA loop */
            ahead_slots[j] = t0 + VALUE_KEYS + j < end ? kv->v_cache + slot_offset(kv, t0 + VALUE_KEYS + j) : slots[j];
        }
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            for (int64_t j = 0; j < keys; j++) {
                rows[j] = slots[j] + kvh * d;
                ahead[j] = ahead_slots[j] + kvh * d;
            }
            for (int64_t g = 0; g < group; g += VALUE_HEADS) {
                const int64_t h = kvh * group + g, heads = group - g < VALUE_HEADS ? group - g : VALUE_HEADS;
                float *a = acc + h * d;
                const float *ph = p + h * n + (t0 - start);
                for (int64_t i = 0; i < d16; i += 16) {
                    switch (heads) {
                        case 1: values_16dims(a, d, rows, ahead, keys, i, ph, n, 1); break;
                        case 2: values_16dims(a, d, rows, ahead, keys, i, ph, n, 2); break;
                        case 3: values_16dims(a, d, rows, ahead, keys, i, ph, n, 3); break;
                        default: values_16dims(a, d, rows, ahead, keys, i, ph, n, 4);
                    }
                }
                if (d16 < d) values_tail(a, d, rows, keys, d16, ph, n, heads);
            }
        }
    }
}

/* The keys a sequence attends to: [first, len). */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* q: [batch, num_heads, d], its rows q_stride elements apart; out: [batch, num_heads, d];
 * block_tables: [batch, table_width]; seq_lens: [batch]; block_size a power of two
 * (returns 2 otherwise); 1 if a buffer cannot be allocated. */
int tessera_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const kv_t *k_cache, const kv_t *v_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out,
                              int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                              int64_t block_size, int64_t table_width, float scale, int64_t window,
                              float softcap, const float *sinks, int threads) {
    const int64_t shift = block_shift(block_size);
    if (shift < 0) return 2;
    if (batch <= 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * d;
    /* A work item is one partition of a sequence's keys, for all its heads. Fewer sequences
     * than ITEMS_PER_THREAD per thread: contexts split into more partitions (of at least
     * MIN_PARTITION keys); and never more than MAX_PARTITION keys (the score buffer). */
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = seq_lens[b] - first_key(seq_lens[b], window);
        longest = n > longest ? n : longest;
    }
    const int64_t wanted = threads > 1 ? ITEMS_PER_THREAD * (int64_t)threads : 1;  /* one thread: no split */
    int64_t part = longest;
    if (batch < wanted) {
        part = (longest + (wanted + batch - 1) / batch - 1) / ((wanted + batch - 1) / batch);
        part = part < MIN_PARTITION ? MIN_PARTITION : (part + 15) / 16 * 16;
    }
    part = part < MAX_PARTITION ? part : MAX_PARTITION;
    const int64_t max_parts = (longest + part - 1) / part;
    int64_t *first_item = malloc(sizeof(int64_t) * (batch + 1));  /* items sequence by sequence */
    if (!first_item) return 1;
    first_item[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = seq_lens[b] - first_key(seq_lens[b], window);
        first_item[b + 1] = first_item[b] + (n + part - 1) / part;
    }
    const int64_t work = first_item[batch];
    /* split sequences leave (max, sum, unnormalised output) per head and partition */
    float *part_m = NULL, *part_l = NULL, *part_acc = NULL;
    if (max_parts > 1) {
        const int64_t rows = batch * num_heads * max_parts;
        part_m = malloc(sizeof(float) * rows);
        part_l = malloc(sizeof(float) * rows);
        part_acc = malloc(sizeof(float) * rows * d);
        if (!part_m || !part_l || !part_acc) {
            free(part_m); free(part_l); free(part_acc); free(first_item);
            return 1;
        }
    }
    int failed = 0;  /* shared: a thread without its buffers stops every thread's work */
#pragma omp parallel num_threads(work >= 2 ? threads : 1)
    {
        float *scores = malloc(sizeof(float) * num_heads * part);
        float *qf = malloc(sizeof(float) * num_heads * d), *acc = malloc(sizeof(float) * num_heads * d);
        float *best = malloc(sizeof(float) * num_heads), *sums = malloc(sizeof(float) * num_heads);
        if (!scores || !qf || !acc || !best || !sums) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < work; item++) {
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) continue;
            while (first_item[b + 1] <= item) b++;  /* a thread's items come in order */
            while (first_item[b] > item) b--;
            const int64_t p = item - first_item[b], len = seq_lens[b], first = first_key(len, window);
            const int64_t parts = first_item[b + 1] - first_item[b];
            const int64_t start = first + p * part, end = start + part < len ? start + part : len;
            const int64_t n = end - start;
            const KvRows kv = {k_cache, v_cache, block_tables + b * table_width, shift, row_stride};
            /* keys and values are read widened (kv_rows.h): the query scaled up for the
             * scores, the output back below, by the same power of two */
            for (int64_t i = 0; i < num_heads * d; i++) qf[i] = bf16_to_f32(q[b * q_stride + i]) * KV_WIDEN_SCALE;
            scores_pass(qf, num_kv_heads, group, d, &kv, start, end, scores);
            for (int64_t h = 0; h < num_heads; h++) sums[h] = exp_row(scores + h * n, n, scale, softcap, &best[h]);
            values_pass(scores, num_kv_heads, group, d, &kv, start, end, acc);
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t row = b * num_heads + h;
                if (parts == 1) {
                    const float inv = KV_WIDEN_SCALE * sink_normaliser(best[h], sums[h], sink_of(sinks, h));
                    for (int64_t i = 0; i < d; i++) out[row * d + i] = f32_to_bf16(acc[h * d + i] * inv);
                } else {
                    const int64_t at = row * max_parts + p;
                    part_m[at] = best[h];
                    part_l[at] = sums[h];
                    memcpy(part_acc + at * d, acc + h * d, sizeof(float) * d);
                }
            }
        }
        /* after the loop's implied barrier every partition is written (or `failed` is set,
         * and the flush of that barrier makes every thread see it) */
        if (max_parts > 1) {
#pragma omp for schedule(static)
            for (int64_t row = 0; row < batch * num_heads; row++) {
                const int64_t bb = row / num_heads, parts = first_item[bb + 1] - first_item[bb];
                if (failed || parts == 1) continue;
                const int64_t at = row * max_parts;
                float m = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < parts; i++) m = part_m[at + i] > m ? part_m[at + i] : m;
                for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
                for (int64_t i = 0; i < parts; i++) {
                    const float w = expf(part_m[at + i] - m);
                    total += w * part_l[at + i];
                    const float *a = part_acc + (at + i) * d;
                    for (int64_t e = 0; e < d; e++) acc[e] += w * a[e];
                }
                const float inv = KV_WIDEN_SCALE * sink_normaliser(m, total, sink_of(sinks, row % num_heads));
                for (int64_t e = 0; e < d; e++) out[row * d + e] = f32_to_bf16(acc[e] * inv);
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(best);
        free(sums);
    }
    free(first_item);
    free(part_m);
    free(part_l);
    free(part_acc);
    return failed;
}
