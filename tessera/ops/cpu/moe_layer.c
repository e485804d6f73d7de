/* A mixture-of-experts layer's routing and experts on CPU, each in one C call, so that a
 * decode step of a mixture is kernels alone (its kernel graph replays it; ops/cpu/graph.py)
 * and pays no Python per expert. Plain C (built for any CPU): the work is the GEMMs, which
 * run through the dense builders' own kernels, passed in as function pointers.
 *
 * tessera_moe_softmax_topk: float32 softmax over a token's expert logits (bf16), its top k
 * (largest first; of equal logits the lower expert first), renormalised to sum to 1 where
 * asked.
 *
 * tessera_moe_experts: the (token, expert) pairs are counted and sorted by expert (stable:
 * token order within an expert); each expert with pairs runs its gate-up projection over its
 * rows, the gated activation runs once over all pairs, then each expert's down projection;
 * each token's output is the float32 sum, in expert order, of its pairs' bf16 products
 * down * bf16(weight), rounded once (ops/moe.py's run_grouped rounds so too). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The packed GEMMs' signature (gemm_bf16.c, gemm_int8.c, gemm_int4.c and their builds). */
typedef int (*gemm_fn)(const void *x, const void *w, const void *bias, void *y,
                       int64_t m, int64_t n, int64_t k, int threads);
/* The gated activations' (silu_and_mul_bf16.c): gate_up [rows, 2h] -> out [rows, h]. */
typedef void (*gated_fn)(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h, int threads);

enum { MOE_OK = 0, MOE_BAD_ARGS = 1, MOE_EXPERT_OUT_OF_RANGE = 4, MOE_SCRATCH_TOO_SMALL = 5 };

int tessera_moe_softmax_topk(const uint16_t *logits, float *weights, int64_t *ids, int64_t tokens,
                             int64_t experts, int64_t top_k, int renormalize, int threads) {
    if (top_k < 1 || top_k > experts || top_k > 64) return MOE_BAD_ARGS;
#pragma omp parallel for num_threads(tokens * experts >= 16384 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *row = logits + t * experts;
        float best[64];
        int64_t which[64];
        int64_t held = 0;
        float max = -INFINITY;
        for (int64_t e = 0; e < experts; e++) {
            const float v = bf16_to_f32(row[e]);
            if (v > max) max = v;
            /* insertion into the k largest so far, kept in descending order: only a
             * strictly larger value moves ahead, so of equal values the earlier expert stays
             * first (NaN compares false: taken only while fewer than k are held) */
            if (held < top_k || v > best[held - 1]) {
                int64_t at = held < top_k ? held : top_k - 1;  /* full: the last one drops */
                while (at > 0 && v > best[at - 1]) {
                    best[at] = best[at - 1];
                    which[at] = which[at - 1];
                    at--;
                }
                best[at] = v;
                which[at] = e;
                if (held < top_k) held++;
            }
        }
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; e++) sum += expf(bf16_to_f32(row[e]) - max);
        float kept = 0.0f;
        for (int64_t s = 0; s < top_k; s++) {
            const float p = expf(best[s] - max) / sum;
            weights[t * top_k + s] = p;
            ids[t * top_k + s] = which[s];
            kept += p;
        }
        if (renormalize)
            for (int64_t s = 0; s < top_k; s++) weights[t * top_k + s] /= kept;
    }
    return MOE_OK;
}

static int64_t aligned(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

/* The scratch tessera_moe_experts needs (the Python side computes the same: moe_experts.py). */
int64_t tessera_moe_scratch_bytes(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden,
                                  int64_t inter) {
    const int64_t pairs = tokens * top_k;
    return aligned(8 * (experts + 1)) + 2 * aligned(4 * pairs) + 2 * aligned(2 * pairs * hidden)
           + aligned(2 * pairs * 2 * inter) + aligned(2 * pairs * inter) + aligned(4 * tokens * hidden);
}

/* One projection of every expert that has pairs: rows [starts[e], starts[e + 1]) of `in`
 * ([pairs, k]) times expert e's matrix (`bytes` apart in `w`) into the same rows of `out`
 * ([pairs, n]); `wide` serves an expert from `wide_rows` rows on, `small` below. */
static int project(const int64_t *starts, int64_t experts, const uint16_t *in, uint16_t *out,
                   const uint8_t *w, int64_t bytes, const uint16_t *bias, int64_t n, int64_t k,
                   gemm_fn small, gemm_fn wide, int64_t wide_rows, int threads) {
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = starts[e], rows = starts[e + 1] - first;
        if (!rows) continue;
        const int status = (rows >= wide_rows ? wide : small)(
            in + first * k, w + e * bytes, bias ? bias + e * n : NULL, out + first * n, rows, n, k, threads);
        if (status) return status;
    }
    return MOE_OK;
}

/* x [tokens, hidden] bf16; weights [tokens, top_k] float32 and ids [tokens, top_k] int64 (the
 * routing); live: NULL, or how many leading tokens are real (a step padded to a captured
 * graph's rows, read at each call): the rest get no experts and zero rows; out [tokens,
 * hidden] bf16. w13: each expert's gate-then-up matrix [2 inter, hidden]
 * in a packed layout, `w13_bytes` apart, multiplied by up_small / up_wide (from up_wide_rows
 * rows); b13 [experts, 2 inter] bf16 or NULL; w2 likewise ([hidden, inter]); act the gated
 * activation. Returns 0, a GEMM's nonzero status, MOE_EXPERT_OUT_OF_RANGE or
 * MOE_SCRATCH_TOO_SMALL (before anything is written). */
int tessera_moe_experts(const uint16_t *x, const float *weights, const int64_t *ids, const int64_t *live,
                        uint16_t *out, int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter,
                        const uint8_t *w13, int64_t w13_bytes, const uint16_t *b13,
                        void *up_small, void *up_wide, int64_t up_wide_rows,
                        const uint8_t *w2, int64_t w2_bytes, const uint16_t *b2,
                        void *down_small, void *down_wide, int64_t down_wide_rows,
                        void *act, uint8_t *scratch, int64_t scratch_bytes, int threads) {
    if (top_k < 1 || top_k > 64) return MOE_BAD_ARGS;
    const int64_t used = live && *live >= 0 && *live < tokens ? *live : tokens;
    const int64_t pairs = used * top_k;
    if (scratch_bytes < tessera_moe_scratch_bytes(tokens, top_k, experts, hidden, inter))
        return MOE_SCRATCH_TOO_SMALL;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= experts) return MOE_EXPERT_OUT_OF_RANGE;
    int64_t *starts = (int64_t *)scratch;
    int32_t *order = (int32_t *)(scratch + aligned(8 * (experts + 1)));  /* sorted slot -> pair */
    int32_t *slot = (int32_t *)((uint8_t *)order + aligned(4 * pairs));  /* pair -> sorted slot */
    uint16_t *rows = (uint16_t *)((uint8_t *)slot + aligned(4 * pairs));
    uint16_t *gate_up = (uint16_t *)((uint8_t *)rows + aligned(2 * pairs * hidden));
    uint16_t *hidden_rows = (uint16_t *)((uint8_t *)gate_up + aligned(2 * pairs * 2 * inter));
    uint16_t *down = (uint16_t *)((uint8_t *)hidden_rows + aligned(2 * pairs * inter));
    float *sums = (float *)((uint8_t *)down + aligned(2 * pairs * hidden));

    /* counting sort of the pairs by expert (stable) */
    memset(starts, 0, 8 * (experts + 1));
    for (int64_t p = 0; p < pairs; p++) starts[ids[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) starts[e + 1] += starts[e];
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = starts[ids[p]]++;
        order[at] = (int32_t)p;
        slot[p] = (int32_t)at;
    }
    for (int64_t e = experts; e > 0; e--) starts[e] = starts[e - 1];  /* back to each expert's first */
    starts[0] = 0;

    const int big = pairs * hidden >= 65536;
#pragma omp parallel for num_threads(big ? threads : 1) schedule(static)
    for (int64_t at = 0; at < pairs; at++)
        memcpy(rows + at * hidden, x + (order[at] / top_k) * hidden, 2 * hidden);

    int status = project(starts, experts, rows, gate_up, w13, w13_bytes, b13, 2 * inter, hidden,
                         (gemm_fn)up_small, (gemm_fn)up_wide, up_wide_rows, threads);
    if (status) return status;
    ((gated_fn)act)(gate_up, hidden_rows, pairs, inter, threads);
    status = project(starts, experts, hidden_rows, down, w2, w2_bytes, b2, hidden, inter,
                     (gemm_fn)down_small, (gemm_fn)down_wide, down_wide_rows, threads);
    if (status) return status;

#pragma omp parallel for num_threads(big ? threads : 1) schedule(static)
    for (int64_t t = 0; t < used; t++) {
        /* this token's sorted slots, ascending: its experts in expert order */
        int32_t mine[64];
        for (int64_t s = 0; s < top_k; s++) {
            int32_t v = slot[t * top_k + s];
            int64_t i = s;
            for (; i > 0 && mine[i - 1] > v; i--) mine[i] = mine[i - 1];
            mine[i] = v;
        }
        float *sum = sums + t * hidden;
        memset(sum, 0, 4 * hidden);
        for (int64_t s = 0; s < top_k; s++) {
            const uint16_t *row = down + (int64_t)mine[s] * hidden;
            const float w = round_to_bf16(weights[order[mine[s]]]);
            for (int64_t c = 0; c < hidden; c++) sum[c] += round_to_bf16(bf16_to_f32(row[c]) * w);
        }
        for (int64_t c = 0; c < hidden; c++) out[t * hidden + c] = f32_to_bf16(sum[c]);
    }
    memset(out + used * hidden, 0, 2 * (tokens - used) * hidden);
    return MOE_OK;
}
