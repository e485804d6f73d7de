/* The AMX build of paged_prefill_avx2.c (built with TESSERA_AMX; a bf16 cache, or an 8-bit
 * float one widened to bf16 as it is packed): the same work
 * items, key tiles, masks and online softmax, with both products on AMX tiles (amx_tiles.h)
 * instead of float32 FMAs on 8 lanes.
 *
 * Head sizes are padded with zeros to dp, a multiple of 32 (the cache rows are read only to
 * their d dims). Per key tile of TILE_KEYS keys, packed once per work item and read by all
 * its row tiles:
 * - K as AMX B tiles: per 16 keys and 32 dims, row i holds dims 2i, 2i + 1 of the 16 keys
 *   side by side (a 16 x 16 transpose of 32-bit pairs);
 * - V as B tiles: per 32 keys and 16 dims, row j holds keys 2j, 2j + 1 of the 16 dims.
 * Per row tile of 16 query rows (bf16 as given, not pre-scaled):
 * - scores = Q K^T, 64 keys (4 accumulators) at a time, stored as float32;
 * - the softmax step of each row on 16 lanes (scaled, capped and masked as softmax_row
 *   does), its probabilities written straight to A rows as two bf16 halves (amx_store_p);
 * - the row's output sums (float32 in memory) rescaled, loaded as accumulators, P V added
 *   on tiles and stored back.
 * q, k and v are bf16 already, so only the probabilities are rounded, to ~16 bits. */
#ifndef TESSERA_PAGED_PREFILL_AMX_H
#define TESSERA_PAGED_PREFILL_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "avx512_math.h"

#define AMX_PAIRS_TILE 512  /* bf16 elements of one tile: 16 rows x 32 */

/* Rows r[0..15] of 16 32-bit lanes, transposed in place: lane j of row i <-> lane i of row j. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  /* per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3 */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* per lane: rows 4g .. 4g + 3 of one column */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* r[4g + e], lane L: column 4L + e of rows 4g .. 4g + 3 */
        const __m512i u0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), u1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
        t[e] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[8 + e] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + e] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 16 elements of a cache row from dim d0 as bf16, zeros past its d dims (none read). An
 * 8-bit float cache (TESSERA_KV_FP8) widens exactly: every e4m3 and e5m2 value, NaN
 * included, is a bf16 value. */
static inline __m256i row16(const kv_t *row, int64_t d0, int64_t d) {
    if (!row || d0 >= d) return _mm256_setzero_si256();
    const int64_t n = d - d0 < 16 ? d - d0 : 16;
#if defined(TESSERA_KV_FP8) && TESSERA_KV_FP8
    const __m128i bytes = n == 16 ? _mm_loadu_si128((const __m128i *)(row + d0))
                                  : _mm_maskz_loadu_epi8(((__mmask16)1 << n) - 1, row + d0);
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(kv16_half(_mm256_cvtepu8_epi16(bytes))),
                                   _mm512_set1_ps(KV_WIDEN_SCALE));
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    if (n == 16) return _mm256_loadu_si256((const __m256i *)(row + d0));
    return _mm256_maskz_loadu_epi16(((__mmask16)1 << n) - 1, row + d0);
#endif
}

/* 32 elements from dim d0 as bf16 (zeros past d) */
static inline __m512i row32(const kv_t *row, int64_t d0, int64_t d) {
    const __m256i hi = d0 + 16 < d ? row16(row, d0 + 16, d) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(row16(row, d0, d)), hi, 1);
}

/* Keys [k0, k0 + kn) of the item's head into kt (TILE_KEYS / 16 key tiles x dp / 32 B tiles)
 * and vt (TILE_KEYS / 32 key pairs' tiles x dp / 16 B tiles); keys past kn are zeros. */
static void amx_pack_tile(const Tile *t, int64_t k0, int64_t kn, uint16_t *kt, uint16_t *vt) {
    const int64_t d = t->d, chunks = t->dp / 32, dim_tiles = t->dp / 16;
    for (int64_t kb = 0; kb < TILE_KEYS; kb += 16) {
        const kv_t *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = kb + j < kn ? cache_row(t, t->k_cache, k0 + kb + j) : NULL;
        for (int64_t c = 0; c < chunks; c++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = row32(rows[j], 32 * c, d);
            transpose16_epi32(r);
            uint16_t *out = kt + ((kb / 16) * chunks + c) * AMX_PAIRS_TILE;
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(out + 32 * i, r[i]);
        }
    }
    for (int64_t kc = 0; kc < TILE_KEYS; kc += 32) {
        for (int64_t j = 0; j < 16; j++) {
            const int64_t a = kc + 2 * j, b = a + 1;
            const kv_t *ra = a < kn ? cache_row(t, t->v_cache, k0 + a) : NULL;
            const kv_t *rb = b < kn ? cache_row(t, t->v_cache, k0 + b) : NULL;
            for (int64_t g = 0; g < dim_tiles; g++) {
                const __m512i lo = _mm512_cvtepu16_epi32(row16(ra, 16 * g, d));
                const __m512i hi = _mm512_cvtepu16_epi32(row16(rb, 16 * g, d));
                uint16_t *out = vt + ((kc / 32) * dim_tiles + g) * AMX_PAIRS_TILE + 32 * j;
                _mm512_storeu_si512(out, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
}

#define AMX_P_LO (16 * TILE_KEYS)  /* where a row tile's low bf16 halves of P start */

/* Probabilities e as two bf16 A rows, e = hi + lo to ~16 bits (lo at AMX_P_LO further): P V
 * then multiplies both, so P is not rounded to bf16 as torch's flash attention rounds it.
 * (Rounded, the default model's answer to "What is the capital of France?" changed.) */
static inline void amx_store_p(uint16_t *p, __m512 e) {
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    _mm256_storeu_si256((__m256i *)p, hi);
    _mm256_storeu_si256((__m256i *)(p + AMX_P_LO), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hi_f)));
}

/* softmax_row on 16 lanes for `width` (16 or more, a multiple of 16) scores of one row,
 * scaled first; the probabilities go to p as bf16 halves (zeros where masked). A tile whose
 * keys the row all sees, uncapped (most), takes its max from the raw scores and no masks. */
static inline void amx_softmax_row(float *s, int64_t width, int64_t lo, int64_t hi, float scale, float softcap,
                                   float *m, float *l, float *corr, uint16_t *p) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    const int masked = !(lo <= 0 && hi >= width - 1 && softcap <= 0.0f && scale > 0.0f);
    float tile_max;
    if (!masked) {
        __m512 raw = _mm512_loadu_ps(s);
        for (int64_t j = 16; j < width; j += 16) raw = _mm512_max_ps(raw, _mm512_loadu_ps(s + j));
        tile_max = _mm512_reduce_max_ps(raw) * scale;
    } else {  /* scaled, capped and masked in place */
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        /* clamped into [0, width] before narrowing: a window of 2^31 or more wrapped */
        const int64_t lo_c = lo < 0 ? 0 : lo, hi_c = hi > width ? width : hi;
        const __m512i lo_v = _mm512_set1_epi32((int)lo_c), hi_v = _mm512_set1_epi32((int)hi_c);
        __m512 mx = neg_inf;
        for (int64_t j = 0; j < width; j += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), sc);
            if (softcap > 0.0f) {  /* softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1) */
                const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / softcap)));
                const __m512 inv = _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
                const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f), inv);
                x = _mm512_mul_ps(t, _mm512_set1_ps(softcap));
            }
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)j));
            const __mmask16 seen = _mm512_cmpge_epi32_mask(idx, lo_v) & _mm512_cmple_epi32_mask(idx, hi_v);
            x = _mm512_mask_mov_ps(neg_inf, seen, x);
            _mm512_storeu_ps(s + j, x);
            mx = _mm512_max_ps(mx, x);
        }
        tile_max = _mm512_reduce_max_ps(mx);
    }
    const float new_max = tile_max > *m ? tile_max : *m;
    *corr = *m == -INFINITY ? 0.0f : expf(*m - new_max);
    const __m512 mv = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
        const __m512 x = _mm512_loadu_ps(s + j);
        /* masked keys: exactly zero (exp16 of -inf clamps to a tiny positive value) */
        const __m512 e = masked ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ),
                                                      exp16(_mm512_sub_ps(x, mv)))
                                : exp16(_mm512_fmsub_ps(x, sc, mv));
        sum = _mm512_add_ps(sum, e);
        amx_store_p(p + j, e);
    }
    *l = *l * *corr + _mm512_reduce_add_ps(sum);
    *m = new_max;
}

/* One row tile (rows r0 .. r0 + nr of the item, nr <= 16) against the packed key tile. */
static void amx_row_tile(const Problem *pb, Scratch *w, int64_t r0, int64_t first_pos, int64_t k0, int64_t kn,
                         int nr) {
    const int64_t group = pb->group, d = pb->dp, window = pb->window, chunks = d / 32, dim_tiles = d / 16;
    const int64_t pos_first = first_pos + r0 / group, pos_last = first_pos + (r0 + nr - 1) / group;
    const int64_t hi_group = (pos_last - k0 < kn - 1 ? pos_last - k0 : kn - 1);
    const int64_t lo_group = window > 0 ? pos_first - window + 1 - k0 : 0;
    if (hi_group < 0 || lo_group > kn - 1) return;  /* the tile is after or before every row's keys */
    const int64_t seen = hi_group + 1, key_tiles = (seen + 15) / 16, key_pairs = (seen + 31) / 32;
    float *s = w->s + r0 * TILE_KEYS;
    const uint16_t *q = w->q16 + r0 * d;
    for (int64_t t0 = 0; t0 < key_tiles; t0 += 4) {  /* 64 keys per pass: 4 accumulators */
        const int64_t nk = key_tiles - t0 < 4 ? key_tiles - t0 : 4;
        float *st = s + 16 * t0;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *kt = w->kt16 + (t0 * chunks + c) * AMX_PAIRS_TILE, *next = kt + chunks * AMX_PAIRS_TILE;
            _tile_loadd(4, q + 32 * c, 2 * d);
            _tile_loadd(5, kt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nk > 1) { _tile_loadd(6, next, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nk > 2) { _tile_loadd(7, next + chunks * AMX_PAIRS_TILE, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nk > 3) { _tile_loadd(5, next + 2 * chunks * AMX_PAIRS_TILE, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, st, 4 * TILE_KEYS);
        if (nk > 1) _tile_stored(1, st + 16, 4 * TILE_KEYS);
        if (nk > 2) _tile_stored(2, st + 32, 4 * TILE_KEYS);
        if (nk > 3) _tile_stored(3, st + 48, 4 * TILE_KEYS);
    }
    for (int r = 0; r < 16; r++) {  /* probabilities as bf16 A rows; zeros past the seen keys and rows */
        uint16_t *p = w->p16 + r * TILE_KEYS;
        if (r < nr) {
            const int64_t pos = first_pos + (r0 + r) / group;
            const int64_t hi = pos - k0 < kn - 1 ? pos - k0 : kn - 1;  /* within the tile's keys */
            const int64_t lo = window > 0 ? pos - window + 1 - k0 : 0;
            amx_softmax_row(s + r * TILE_KEYS, 16 * key_tiles, lo, hi, pb->scale, pb->softcap,
                            w->m + r0 + r, w->l + r0 + r, w->corr + r0 + r, p);
            if (key_tiles % 2) {
                memset(p + 16 * key_tiles, 0, 16 * sizeof(uint16_t));
                memset(p + AMX_P_LO + 16 * key_tiles, 0, 16 * sizeof(uint16_t));
            }
        } else {
            memset(p, 0, 32 * key_pairs * sizeof(uint16_t));
            memset(p + AMX_P_LO, 0, 32 * key_pairs * sizeof(uint16_t));
        }
    }
    float *o = w->o + r0 * d;
    for (int r = 0; r < nr; r++) {
        const float corr = w->corr[r0 + r];
        if (corr == 1.0f) continue;
        const __m512 c = _mm512_set1_ps(corr);
        for (float *x = o + r * d; x < o + (r + 1) * d; x += 16)
            _mm512_storeu_ps(x, _mm512_mul_ps(c, _mm512_loadu_ps(x)));
    }
    for (int64_t g0 = 0; g0 < dim_tiles; g0 += 4) {
        const int64_t nd = dim_tiles - g0 < 4 ? dim_tiles - g0 : 4;
        float *og = o + 16 * g0;
        _tile_loadd(0, og, 4 * d);
        if (nd > 1) _tile_loadd(1, og + 16, 4 * d);
        if (nd > 2) _tile_loadd(2, og + 32, 4 * d);
        if (nd > 3) _tile_loadd(3, og + 48, 4 * d);
        for (int64_t a = 0; a < 2 * key_pairs; a++) {  /* P's high halves, then its low */
            const int64_t kc = a % key_pairs;
            const uint16_t *vt = w->v16 + (kc * dim_tiles + g0) * AMX_PAIRS_TILE;
            _tile_loadd(4, w->p16 + (a < key_pairs ? 0 : AMX_P_LO) + 32 * kc, 2 * TILE_KEYS);
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) { _tile_loadd(6, vt + AMX_PAIRS_TILE, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nd > 2) { _tile_loadd(7, vt + 2 * AMX_PAIRS_TILE, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nd > 3) { _tile_loadd(5, vt + 3 * AMX_PAIRS_TILE, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, og, 4 * d);
        if (nd > 1) _tile_stored(1, og + 16, 4 * d);
        if (nd > 2) _tile_stored(2, og + 32, 4 * d);
        if (nd > 3) _tile_stored(3, og + 48, 4 * d);
    }
}

/* The item's query rows as bf16 A rows of dp (rows_pad of them; zeros past d and `rows`). */
static void amx_load_queries(const Problem *pb, const Item *it, Scratch *w, int64_t q_begin, int64_t rows,
                             int64_t rows_pad) {
    const int64_t group = pb->group, d = pb->d, dp = pb->dp, row_elems = pb->heads * d;
    for (int64_t r = 0; r < rows_pad; r++) {
        uint16_t *dst = w->q16 + r * dp;
        const int64_t kept = r < rows ? d : 0;
        if (kept)
            memcpy(dst, pb->q + (q_begin + it->first_token + r / group) * row_elems
                        + (it->kv_head * group + r % group) * d, d * sizeof(uint16_t));
        memset(dst + kept, 0, (dp - kept) * sizeof(uint16_t));
    }
}
#endif
