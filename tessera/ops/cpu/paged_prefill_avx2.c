/* Paged prefill attention for bf16 on CPUs with AVX2 + FMA (those with AVX512 too), over a
 * bf16 cache or, built with TESSERA_KV_FP8, an 8-bit float one (kv_rows.h): the
 * prompt rows of a step (chunks of any length, after any cached prefix) attend causally
 * over their sequence's cache blocks in place, GQA without repeating K/V, sliding windows
 * soft-capping and attention sinks, float32 scores and accumulation, an online softmax
 * over key tiles.
 *
 * The K/V of this step's tokens are already in the cache (the layer writes them first), so
 * every key is read from the blocks: a chunk after a cached prefix needs no gathered copy,
 * and the causal mask is aligned to each query's absolute position, so the prefix is read
 * unmasked and only the diagonal tiles are masked (torch's SDPA takes an explicit mask
 * there and computes every masked score).
 *
 * A work item is (sequence, KV head, block of query tokens): its rows are the block's
 * tokens times the group's query heads, token-major, so each K/V tile packed to float32
 * serves them all. Per tile of TILE_KEYS keys:
 * - K is widened and transposed to [dim][key], and scores are an outer-product tile of
 *   ROW_GROUP rows by 16 keys (12 accumulators), a broadcast query value per row and dim;
 * - the online softmax rescales each row's running sums;
 * - V is widened to [key][dim], and ROW_GROUP rows by 16 dims of the output are
 *   accumulated in registers over the tile's keys.
 * A row group skips the keys after its last position (causal) and the tiles wholly before
 * its window. Items run longest first under a dynamic schedule, since causal blocks late in
 * a long prompt see many more keys than early ones; too few items for the threads (a short
 * chunk after a long cached prefix) have their keys split into parts merged afterwards.
 * Built by build.py; with TESSERA_AMX (a bf16 or fp8 cache) both products run on AMX tiles
 * instead (paged_prefill_amx.h): rows padded to tiles of 16, head dims to steps of 32. */
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

#if TESSERA_AMX  /* fewer rescales of each row's sums; each packed key tile serves more rows */
#define TILE_KEYS 128    /* keys per packed K/V tile */
#define ROWS_TARGET 256  /* query rows per work item (tokens x group heads) */
#else
#define TILE_KEYS 64
#define ROWS_TARGET 128
#endif
#define ROW_GROUP 6      /* query rows per score / output register tile */
/* Fewer items than SPLIT_ITEMS_PER_THREAD per thread (a few new tokens after a long cached
 * prefix: one item per KV head) and their keys are split into parts of at least
 * MIN_SPLIT_KEYS, merged afterwards, so every thread has work. */
#define SPLIT_ITEMS_PER_THREAD 4
#define MIN_SPLIT_KEYS 256

typedef struct {
    int64_t seq, kv_head, first_token, num_tokens, cost;
    int64_t k_begin, k_end;  /* the keys this item reads: all the block's rows see, or a part */
    float *part;             /* NULL: write the output; else [rows][dp + 2] (sums, max, total) */
} Item;

/* A block of rows whose keys were split into `parts` items, merged after they all ran. */
typedef struct {
    int64_t seq, kv_head, first_token, num_tokens, parts;
    float *part;  /* parts x [rows][dp + 2] */
} Split;

typedef struct {
    float *q;      /* [rows][dp] query rows, scaled, zero-padded past d */
    float *kt;     /* [dp][TILE_KEYS] the tile's keys, transposed */
    float *v;      /* [TILE_KEYS][dp] the tile's values */
    float *s;      /* [rows][TILE_KEYS] scores, then probabilities */
    float *o;      /* [rows][dp] unnormalised output */
    float *m, *l, *corr;  /* [rows] running max, running sum, this tile's rescale */
    uint16_t *q16, *kt16, *v16, *p16;  /* the AMX build's bf16 tiles (paged_prefill_amx.h) */
} Scratch;

static int by_cost_desc(const void *a, const void *b) {
    const int64_t ca = ((const Item *)a)->cost, cb = ((const Item *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* 8 floats of a cache row from dim d0, zeros past its d dims (no read beyond them). */
static inline __m256 row8(const kv_t *row, int64_t d0, int64_t d) {
    if (d0 + 8 <= d) return kv8_to_f32(row + d0);
    kv_t tmp[8] = {0};
    for (int64_t i = d0; i < d; i++) tmp[i - d0] = row[i];
    return kv8_to_f32(tmp);
}

/* Transpose 8 rows of 8 floats; row i of the result goes to out + i * stride. */
static inline void store_transposed8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4,
                                     __m256 r5, __m256 r6, __m256 r7, float *out, int64_t stride) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(out + 0 * stride, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(out + 1 * stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(out + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(out + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(out + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(out + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(out + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(out + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

typedef struct {
    const kv_t *k_cache, *v_cache;
    const int32_t *table;
    int64_t shift, row_stride, head_offset, d, dp;
} Tile;

static inline const kv_t *cache_row(const Tile *t, const kv_t *cache, int64_t pos) {
    return cache + paged_slot(t->table, t->shift, pos) * t->row_stride + t->head_offset;
}

/* Keys [k0, k0 + kn) into kt ([dp][TILE_KEYS], transposed) and values into v ([TILE_KEYS][dp]);
 * keys past kn are zeros (their scores are masked; zeros keep 0 * garbage out of the sums). */
static void pack_tile(const Tile *t, int64_t k0, int64_t kn, float *kt, float *v) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < TILE_KEYS; j0 += 8) {
        const kv_t *rows[8];
        for (int j = 0; j < 8; j++) rows[j] = j0 + j < kn ? cache_row(t, t->k_cache, k0 + j0 + j) : NULL;
        for (int64_t d0 = 0; d0 < t->dp; d0 += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = rows[j] ? row8(rows[j], d0, t->d) : zero;
            store_transposed8(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], kt + d0 * TILE_KEYS + j0, TILE_KEYS);
        }
    }
    for (int64_t j = 0; j < TILE_KEYS; j++) {
        float *dst = v + j * t->dp;
        if (j < kn) {
            const kv_t *row = cache_row(t, t->v_cache, k0 + j);
            for (int64_t d0 = 0; d0 < t->dp; d0 += 8) _mm256_storeu_ps(dst + d0, row8(row, d0, t->d));
        } else {
            for (int64_t d0 = 0; d0 < t->dp; d0 += 8) _mm256_storeu_ps(dst + d0, zero);
        }
    }
}

/* Store the accumulators a<r>0 (and a<r>1 when width > 1) of rows r < nr at
 * base + r * stride + c0, the tile functions' last step. */
#define STORE_ROWS(base, stride, width) do {                                            \
        float *const row0_ = (base) + c0;                                               \
        _mm256_storeu_ps(row0_, a00);                                                   \
        if ((width) > 1) _mm256_storeu_ps(row0_ + 8, a01);                              \
        if (nr > 1) { _mm256_storeu_ps(row0_ + (stride), a10);                          \
            if ((width) > 1) _mm256_storeu_ps(row0_ + (stride) + 8, a11); }             \
        if (nr > 2) { _mm256_storeu_ps(row0_ + 2 * (stride), a20);                      \
            if ((width) > 1) _mm256_storeu_ps(row0_ + 2 * (stride) + 8, a21); }         \
        if (nr > 3) { _mm256_storeu_ps(row0_ + 3 * (stride), a30);                      \
            if ((width) > 1) _mm256_storeu_ps(row0_ + 3 * (stride) + 8, a31); }         \
        if (nr > 4) { _mm256_storeu_ps(row0_ + 4 * (stride), a40);                      \
            if ((width) > 1) _mm256_storeu_ps(row0_ + 4 * (stride) + 8, a41); }         \
        if (nr > 5) { _mm256_storeu_ps(row0_ + 5 * (stride), a50);                      \
            if ((width) > 1) _mm256_storeu_ps(row0_ + 5 * (stride) + 8, a51); }         \
    } while (0)

/* s[r][c0 .. c0 + 16) = q_r . k_j for `nr` (constant after inlining, <= ROW_GROUP) rows. */
static inline __attribute__((always_inline)) void scores_tile(
        const float *q, const float *kt, int64_t dp, int64_t c0, float *s, const int nr) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t i = 0; i < dp; i++) {
        const __m256 k0 = _mm256_loadu_ps(kt + i * TILE_KEYS + c0);
        const __m256 k1 = _mm256_loadu_ps(kt + i * TILE_KEYS + c0 + 8);
#define ROW_FMAS(r, acc0, acc1) do {                                    \
            if (nr > r) {                                               \
                const __m256 qb = _mm256_broadcast_ss(q + r * dp + i);  \
                acc0 = _mm256_fmadd_ps(qb, k0, acc0);                   \
                acc1 = _mm256_fmadd_ps(qb, k1, acc1);                   \
            }                                                           \
        } while (0)
        ROW_FMAS(0, a00, a01); ROW_FMAS(1, a10, a11); ROW_FMAS(2, a20, a21);
        ROW_FMAS(3, a30, a31); ROW_FMAS(4, a40, a41); ROW_FMAS(5, a50, a51);
#undef ROW_FMAS
    }
    STORE_ROWS(s, TILE_KEYS, 2);
}

/* o[r][c0 .. c0 + 8 * width) = o * corr_r + sum over the first kn keys of p[r][j] v[j], for
 * `nr` rows; width 2 (16 dims) or 1 (the last 8 of a head size that is not a multiple of 16). */
static inline __attribute__((always_inline)) void values_tile(
        const float *p, const float *v, int64_t dp, int64_t c0, int64_t kn, const float *corr,
        float *o, const int nr, const int width) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define ROW_LOAD(r, acc0, acc1) do {                                                        \
        if (nr > r) {                                                                       \
            const __m256 c = _mm256_broadcast_ss(corr + r);                                 \
            acc0 = _mm256_mul_ps(c, _mm256_loadu_ps(o + r * dp + c0));                      \
            if (width > 1) acc1 = _mm256_mul_ps(c, _mm256_loadu_ps(o + r * dp + c0 + 8));   \
        }                                                                                   \
    } while (0)
    ROW_LOAD(0, a00, a01); ROW_LOAD(1, a10, a11); ROW_LOAD(2, a20, a21);
    ROW_LOAD(3, a30, a31); ROW_LOAD(4, a40, a41); ROW_LOAD(5, a50, a51);
#undef ROW_LOAD
    for (int64_t j = 0; j < kn; j++) {
        const __m256 v0 = _mm256_loadu_ps(v + j * dp + c0);
        const __m256 v1 = width > 1 ? _mm256_loadu_ps(v + j * dp + c0 + 8) : v0;
#define ROW_FMAS(r, acc0, acc1) do {                                    \
            if (nr > r) {                                               \
                const __m256 pb = _mm256_broadcast_ss(p + r * TILE_KEYS + j); \
                acc0 = _mm256_fmadd_ps(pb, v0, acc0);                   \
                if (width > 1) acc1 = _mm256_fmadd_ps(pb, v1, acc1);    \
            }                                                           \
        } while (0)
        ROW_FMAS(0, a00, a01); ROW_FMAS(1, a10, a11); ROW_FMAS(2, a20, a21);
        ROW_FMAS(3, a30, a31); ROW_FMAS(4, a40, a41); ROW_FMAS(5, a50, a51);
#undef ROW_FMAS
    }
    STORE_ROWS(o, dp, width);
}

/* The softmax step of one row over its tile scores s[0 .. kn): keys j with lo <= j <= hi
 * (tile indices) are seen, the rest masked. Leaves probabilities in s (zeros where masked)
 * and the rescale of the row's earlier sums in *corr. Most tiles are wholly seen and not
 * soft-capped: their first pass only takes the max. */
static inline __attribute__((always_inline)) void softmax_row(
        float *s, int64_t kn, int64_t lo, int64_t hi, float softcap, float *m, float *l, float *corr) {
    const int masked = lo > 0 || hi < kn - 1;
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 mx = neg_inf;
    if (masked || softcap > 0.0f) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        /* clamped into [0, kn] before narrowing: a window of 2^31 or more wrapped */
        const int64_t lo_c = lo < 0 ? 0 : lo, hi_c = hi > kn ? kn : hi;
        const __m256i lo_v = _mm256_set1_epi32((int)(lo_c - 1)), hi_v = _mm256_set1_epi32((int)(hi_c + 1));
        for (int64_t j = 0; j < kn; j += 8) {
            __m256 x = _mm256_loadu_ps(s + j);
            if (softcap > 0.0f) {  /* softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1) */
                const __m256 e = exp8(_mm256_mul_ps(x, _mm256_set1_ps(2.0f / softcap)));
                const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
                x = _mm256_mul_ps(t, _mm256_set1_ps(softcap));
            }
            const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32((int)j));
            const __m256 seen = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, lo_v),
                                                                     _mm256_cmpgt_epi32(hi_v, idx)));
            x = _mm256_blendv_ps(neg_inf, x, seen);
            _mm256_storeu_ps(s + j, x);
            mx = _mm256_max_ps(mx, x);
        }
    } else {
        for (int64_t j = 0; j < kn; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    }
    const float tile_max = hmax8(mx);
    const float new_max = tile_max > *m ? tile_max : *m;
    *corr = *m == -INFINITY ? 0.0f : expf(*m - new_max);
    __m256 sum = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(new_max);
    for (int64_t j = 0; j < kn; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        __m256 p = exp8(_mm256_sub_ps(x, mv));
        /* masked keys: exactly zero (exp8 of -inf clamps to a tiny positive value) */
        if (masked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    *l = *l * *corr + hsum8(sum);
    *m = new_max;
}

typedef struct {
    const uint16_t *q;
    uint16_t *out;
    const int32_t *tables, *seq_lens, *query_start;
    int64_t heads, group, d, dp, table_width, window;
    float scale, softcap;
    const float *sinks;  /* [heads] or NULL */
    Tile tile;  /* k/v caches, shift, row stride; table and head offset set per item */
} Problem;

/* One row group of `nr` (constant after inlining) rows against the packed tile: scores,
 * the softmax step of each row, then the output. Rows sit at positions first_pos + (r / group). */
static inline __attribute__((always_inline)) void row_group(
        const Problem *pb, Scratch *w, int64_t r0, int64_t first_pos, int64_t k0, int64_t kn, const int nr) {
    const int64_t group = pb->group, dp = pb->dp, window = pb->window;
    const int64_t pos_first = first_pos + r0 / group, pos_last = first_pos + (r0 + nr - 1) / group;
    const int64_t hi_group = (pos_last - k0 < kn - 1 ? pos_last - k0 : kn - 1);
    const int64_t lo_group = window > 0 ? pos_first - window + 1 - k0 : 0;
    if (hi_group < 0 || lo_group > kn - 1) return;  /* the tile is after or before every row's keys */
    const int64_t seen = hi_group + 1, chunks = (seen + 15) / 16;
    float *s = w->s + r0 * TILE_KEYS;
    for (int64_t c = 0; c < chunks; c++) scores_tile(w->q + r0 * dp, w->kt, dp, c * 16, s, nr);
    for (int r = 0; r < nr; r++) {
        const int64_t pos = first_pos + (r0 + r) / group;
        const int64_t hi = pos - k0 < kn - 1 ? pos - k0 : kn - 1;  /* within the tile's keys */
        const int64_t lo = window > 0 ? pos - window + 1 - k0 : 0;
        softmax_row(s + r * TILE_KEYS, chunks * 16, lo, hi, pb->softcap,
                    w->m + r0 + r, w->l + r0 + r, w->corr + r0 + r);
    }
    float *o = w->o + r0 * dp;
    int64_t c0 = 0;
    for (; c0 + 16 <= dp; c0 += 16) values_tile(s, w->v, dp, c0, seen, w->corr + r0, o, nr, 2);
    if (c0 < dp) values_tile(s, w->v, dp, c0, seen, w->corr + r0, o, nr, 1);
}

#if TESSERA_AMX
#include "paged_prefill_amx.h"
#define ROW_PAD 16  /* rows per AMX tile */
#define DIM_PAD 32  /* dims per A tile row */
#else
#define ROW_PAD 1
#define DIM_PAD 8
#endif

static void run_item(const Problem *pb, const Item *it, Scratch *w) {
    const int64_t group = pb->group, d = pb->d, dp = pb->dp;
    const int64_t q_begin = pb->query_start[it->seq];
    const int64_t q_len = pb->query_start[it->seq + 1] - q_begin;
    const int64_t first_pos = pb->seq_lens[it->seq] - q_len + it->first_token;
    const int64_t rows = it->num_tokens * group;
    const int64_t row_elems = pb->heads * d;
    Tile tile = pb->tile;
    tile.table = pb->tables + it->seq * pb->table_width;
    tile.head_offset = it->kv_head * d;
    const int64_t rows_pad = (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
    memset(w->o, 0, rows_pad * dp * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
#if TESSERA_AMX
    amx_load_queries(pb, it, w, q_begin, rows, rows_pad);
    for (int64_t k0 = it->k_begin; k0 < it->k_end; k0 += TILE_KEYS) {
        const int64_t kn = it->k_end - k0 < TILE_KEYS ? it->k_end - k0 : TILE_KEYS;
        amx_pack_tile(&tile, k0, kn, w->kt16, w->v16);
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
            amx_row_tile(pb, w, r0, first_pos, k0, kn, rows - r0 < 16 ? (int)(rows - r0) : 16);
    }
#else
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = pb->q + (q_begin + it->first_token + r / group) * row_elems
                              + (it->kv_head * group + r % group) * d;
        float *dst = w->q + r * dp;
        for (int64_t i = 0; i < dp; i++) dst[i] = i < d ? bf16_to_f32(src[i]) * pb->scale : 0.0f;
    }
    for (int64_t k0 = it->k_begin; k0 < it->k_end; k0 += TILE_KEYS) {
        const int64_t kn = it->k_end - k0 < TILE_KEYS ? it->k_end - k0 : TILE_KEYS;
        pack_tile(&tile, k0, kn, w->kt, w->v);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_GROUP) {
            switch (rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP) {
                case 6: row_group(pb, w, r0, first_pos, k0, kn, 6); break;
                case 5: row_group(pb, w, r0, first_pos, k0, kn, 5); break;
                case 4: row_group(pb, w, r0, first_pos, k0, kn, 4); break;
                case 3: row_group(pb, w, r0, first_pos, k0, kn, 3); break;
                case 2: row_group(pb, w, r0, first_pos, k0, kn, 2); break;
                default: row_group(pb, w, r0, first_pos, k0, kn, 1); break;
            }
        }
    }
#endif
    if (it->part) {  /* one part of split keys: the merge normalises */
        for (int64_t r = 0; r < rows; r++) {
            float *dst = it->part + r * (dp + 2);
            memcpy(dst, w->o + r * dp, dp * sizeof(float));
            dst[dp] = w->m[r];
            dst[dp + 1] = w->l[r];
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = pb->out + (q_begin + it->first_token + r / group) * row_elems
                        + (it->kv_head * group + r % group) * d;
        /* l > 0: a query always sees its own key */
        const float inv = sink_normaliser(w->m[r], w->l[r], sink_of(pb->sinks, it->kv_head * group + r % group));
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(w->o[r * dp + i] * inv);
    }
}

/* The output rows of a split block: each part's sums rescaled to the largest max. */
static void merge_split(const Problem *pb, const Split *sp, float *acc) {
    const int64_t group = pb->group, d = pb->d, dp = pb->dp, rows = sp->num_tokens * group;
    const int64_t q_begin = pb->query_start[sp->seq], row_elems = pb->heads * d;
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < sp->parts; p++) {
            const float mp = sp->part[(p * rows + r) * (dp + 2) + dp];
            m = mp > m ? mp : m;
        }
        memset(acc, 0, d * sizeof(float));
        for (int64_t p = 0; p < sp->parts; p++) {
            const float *src = sp->part + (p * rows + r) * (dp + 2);
            if (src[dp] == -INFINITY) continue;  /* the row saw no key of this part */
            const float weight = expf(src[dp] - m);
            total += weight * src[dp + 1];
            for (int64_t i = 0; i < d; i++) acc[i] += weight * src[i];
        }
        uint16_t *dst = pb->out + (q_begin + sp->first_token + r / group) * row_elems
                        + (sp->kv_head * group + r % group) * d;
        const float inv = sink_normaliser(m, total, sink_of(pb->sinks, sp->kv_head * group + r % group));
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[i] * inv);
    }
}

/* q/out: [T, heads, d] bf16, the prompt rows of num_seqs sequences back to back (sequence i's
 * rows are query_start[i] .. query_start[i + 1]); caches [blocks, block_size, kv_heads, d];
 * tables [num_seqs, table_width]; seq_lens: each sequence's length including its rows, whose
 * K/V are already in the cache. window 0: none; softcap 0: none; sinks NULL: none.
 * Returns 0, 1 when scratch could not be allocated, 2 for a block size not a power of two;
 * the AMX build 3 where the OS refuses AMX. */
int tessera_paged_prefill_bf16(const uint16_t *q, const kv_t *k_cache, const kv_t *v_cache,
                               const int32_t *tables, const int32_t *seq_lens, const int32_t *query_start,
                               uint16_t *out, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t d,
                               int64_t block_size, int64_t table_width, float scale, int64_t window,
                               float softcap, const float *sinks, int threads) {
    const int64_t shift = block_shift(block_size);
    if (shift < 0) return 2;
#if TESSERA_AMX
    if (!amx_granted()) return 3;
#endif
    const int64_t group = heads / kv_heads, dp = (d + DIM_PAD - 1) / DIM_PAD * DIM_PAD;
    const int64_t block_tokens = ROWS_TARGET / group > 0 ? ROWS_TARGET / group : 1;
    int64_t num_blocks = 0;  /* (sequence, KV head, block of tokens) */
    for (int64_t i = 0; i < num_seqs; i++)
        num_blocks += kv_heads * ((query_start[i + 1] - query_start[i] + block_tokens - 1) / block_tokens);
    if (num_blocks == 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t wanted = threads > 1 ? SPLIT_ITEMS_PER_THREAD * (int64_t)threads : 1;
    const int64_t max_parts = num_blocks < wanted ? (wanted + num_blocks - 1) / num_blocks : 1;
    const int64_t rows = (block_tokens * group + ROW_PAD - 1) / ROW_PAD * ROW_PAD;  /* scratch rows */
    /* the AMX build's bf16 tiles: queries, keys, values, one row tile's probabilities (2 halves) */
    const int64_t halves = ROW_PAD > 1 ? rows * dp + 2 * TILE_KEYS * dp + 2 * ROW_PAD * TILE_KEYS : 0;
    const int64_t floats = rows * dp * 2 + 2 * dp * TILE_KEYS + rows * TILE_KEYS + 3 * rows + halves / 2;
    const int64_t stride = (floats * sizeof(float) + 63) / 64 * 64 / sizeof(float);
    Item *items = malloc(num_blocks * max_parts * sizeof(Item));
    Split *splits = malloc(num_blocks * sizeof(Split));
    float *scratch = aligned_alloc(64, (size_t)threads * stride * sizeof(float));
    float *parts_buf = max_parts > 1 ? malloc(num_blocks * max_parts * rows * (dp + 2) * sizeof(float)) : NULL;
    if (!items || !splits || !scratch || (max_parts > 1 && !parts_buf)) {
        free(items); free(splits); free(scratch); free(parts_buf);
        return 1;
    }
    int64_t num_items = 0, num_splits = 0;
    float *next_part = parts_buf;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = query_start[i + 1] - query_start[i];
        for (int64_t t = 0; t < q_len; t += block_tokens) {
            const int64_t count = q_len - t < block_tokens ? q_len - t : block_tokens;
            const int64_t first_pos = seq_lens[i] - q_len + t, last_pos = first_pos + count - 1;
            const int64_t k_begin = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            const int64_t keys = last_pos + 1 - k_begin;
            int64_t parts = keys / MIN_SPLIT_KEYS < max_parts ? keys / MIN_SPLIT_KEYS : max_parts;
            if (parts < 1) parts = 1;
            int64_t size = keys;
            if (parts > 1) {  /* parts of whole tiles; rounding may leave fewer */
                size = ((keys + parts - 1) / parts + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
                parts = (keys + size - 1) / size;
            }
            for (int64_t h = 0; h < kv_heads; h++) {
                if (parts > 1) splits[num_splits++] = (Split){i, h, t, count, parts, next_part};
                for (int64_t p = 0; p < parts; p++) {
                    const int64_t kb = k_begin + p * size, ke = kb + size < last_pos + 1 ? kb + size : last_pos + 1;
                    items[num_items++] = (Item){i, h, t, count, (ke - kb) * count, kb, ke,
                                                parts > 1 ? next_part + p * count * group * (dp + 2) : NULL};
                }
                if (parts > 1) next_part += parts * count * group * (dp + 2);
            }
        }
    }
    qsort(items, num_items, sizeof(Item), by_cost_desc);
    const Problem pb = {q, out, tables, seq_lens, query_start, heads, group, d, dp, table_width, window,
                        scale, softcap, sinks, {k_cache, v_cache, NULL, shift, kv_heads * d, 0, d, dp}};
    #pragma omp parallel num_threads(threads)
    {
        float *base = scratch + omp_get_thread_num() * stride;
        Scratch w = {base, base + rows * dp, base + rows * dp + dp * TILE_KEYS,
                     base + rows * dp + 2 * dp * TILE_KEYS, base + rows * dp + 2 * dp * TILE_KEYS + rows * TILE_KEYS,
                     NULL, NULL, NULL};
        w.m = w.o + rows * dp;
        w.l = w.m + rows;
        w.corr = w.l + rows;
#if TESSERA_AMX
        w.q16 = (uint16_t *)(w.corr + rows);
        w.kt16 = w.q16 + rows * dp;
        w.v16 = w.kt16 + TILE_KEYS * dp;
        w.p16 = w.v16 + TILE_KEYS * dp;
        amx_configure();
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) run_item(&pb, &items[i], &w);
#if TESSERA_AMX
        _tile_release();
#endif
        /* after the loop's barrier every part is written; w.q (rows x dp >= d) is free */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_splits; i++) merge_split(&pb, &splits[i], w.q);
    }
    free(items);
    free(splits);
    free(parts_buf);
    free(scratch);
    return 0;
}
