/* A mixture-of-experts layer's routing and experts on CPU, each in one C call, so that a
 * decode step of a mixture is kernels alone (its kernel graph replays it; ops/cpu/graph.py)
 * and pays no Python per expert. Plain C (built for any CPU): the work is the GEMMs, which
 * run through the dense builders' own kernels (or the MXFP4 experts' kernel), passed in as
 * function pointers.
 *
 * tessera_moe_softmax_topk: float32 softmax over a token's expert logits (bf16), its top k
 * (largest first; of equal logits the lower expert first), renormalised to sum to 1 where
 * asked, then times each chosen expert's bf16 scale where given (Gemma 4's per_expert_scale).
 *
 * tessera_moe_experts: the (token, expert) pairs are counted and sorted by expert (stable:
 * token order within an expert); each expert with pairs runs its gate-up projection over its
 * rows, the gated activation (a kernel, or gpt-oss's clamped SwiGLU here) runs once over all
 * pairs, then each expert's down projection; each token's output is the float32 sum, in
 * expert order, of its pairs' bf16 products down * bf16(weight), rounded once (ops/moe.py's
 * run_grouped rounds so too). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "topk_insert.h"

/* The packed GEMMs' signature (gemm_bf16.c, gemm_int8.c, gemm_int4.c and their builds). */
typedef int (*gemm_fn)(const void *x, const void *w, const void *bias, void *y,
                       int64_t m, int64_t n, int64_t k, int threads);
/* The gated activations' (silu_and_mul_bf16.c): gate_up [rows, 2h] -> out [rows, h]. */
typedef void (*gated_fn)(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h, int threads);

enum { MOE_OK = 0, MOE_BAD_ARGS = 1, MOE_EXPERT_OUT_OF_RANGE = 4, MOE_SCRATCH_TOO_SMALL = 5 };

int tessera_moe_softmax_topk(const uint16_t *logits, const uint16_t *expert_scales, float *weights, int64_t *ids,
                             int64_t tokens, int64_t experts, int64_t top_k, int renormalize, int threads) {
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
            keep_largest(best, which, &held, top_k, v, e);
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
        if (expert_scales)
            for (int64_t s = 0; s < top_k; s++) weights[t * top_k + s] *= bf16_to_f32(expert_scales[which[s]]);
    }
    return MOE_OK;
}

static int64_t aligned(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The scratch tessera_moe_experts needs for these sizes (the Python side asks for it). */
int64_t tessera_moe_scratch_bytes(int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden,
                                  int64_t inter) {
    const int64_t pairs = tokens * top_k, widest = max64(2 * inter, hidden);
    return aligned(8 * (experts + 1)) + 2 * aligned(4 * pairs) + 2 * aligned(2 * pairs * hidden)
           + aligned(2 * pairs * 2 * inter) + aligned(2 * pairs * inter) + aligned(4 * tokens * hidden)
           + aligned(4 * pairs * widest) + aligned(4 * widest);
}

/* The MXFP4 experts' kernel (mxfp4_linear.c): x [m, 32 groups] bf16, blocks [n, groups, 16]
 * and scales [n, groups] uint8, bias [n] float32 or NULL -> out [m, n] float32. */
typedef int (*mxfp4_fn)(const uint16_t *x, const uint8_t *blocks, const uint8_t *scales, const float *bias,
                        float *out, int64_t m, int64_t n, int64_t groups, int threads);

enum { PACKED_GEMM = 0, MXFP4_BLOCKS = 1 };  /* how a stack holds its experts */

/* One stack: each expert's matrix `bytes` apart from `w` (and, MXFP4, its scales
 * `scale_bytes` apart from `scales`); `wide` serves an expert from `wide_rows` rows on,
 * `small` below (MXFP4: `small` always). */
typedef struct {
    int64_t kind;
    const uint8_t *w;
    int64_t bytes;
    const uint8_t *scales;
    int64_t scale_bytes;
    void *small, *wide;
    int64_t wide_rows;
} Stack;

/* One projection of every expert that has pairs: rows [starts[e], starts[e + 1]) of `in`
 * ([pairs, k]) times expert e's matrix into the same rows of `out` ([pairs, n]), plus its
 * bias row (bf16, NULL: none). MXFP4 sums in float32 (into `sums`, with the bias widened
 * into `bias_f32`), rounded to bf16 as its builder rounds them. */
static int project(const int64_t *starts, int64_t experts, const uint16_t *in, uint16_t *out, Stack s,
                   const uint16_t *bias, int64_t n, int64_t k, float *sums, float *bias_f32, int threads) {
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = starts[e], rows = starts[e + 1] - first;
        if (!rows) continue;
        const uint16_t *b = bias ? bias + e * n : NULL;
        int status;
        if (s.kind == MXFP4_BLOCKS) {
            if (b)
                for (int64_t c = 0; c < n; c++) bias_f32[c] = bf16_to_f32(b[c]);
            status = ((mxfp4_fn)s.small)(in + first * k, s.w + e * s.bytes, s.scales + e * s.scale_bytes,
                                         b ? bias_f32 : NULL, sums, rows, n, k / 32, threads)
                     ? 2 : 0;  /* (its one failure: no memory for its copy of the rows) */
            for (int64_t i = 0; i < rows * n; i++) out[first * n + i] = f32_to_bf16(sums[i]);
        } else {
            status = ((gemm_fn)(rows >= s.wide_rows ? s.wide : s.small))(
                in + first * k, s.w + e * s.bytes, b, out + first * n, rows, n, k, threads);
        }
        if (status) return status;
    }
    return MOE_OK;
}

/* the activation between the projections: a gated kernel over [gate | up] rows, gpt-oss's
 * clamped SwiGLU, or an ungated kernel over up rows alone (relu squared: Nemotron 3's
 * gateless experts, whose first stack holds `inter` rows an expert, not 2 inter) */
enum { GATED_KERNEL = 0, CLAMPED_SWIGLU = 1, UNGATED_KERNEL = 2 };
/* The ungated activations' (gating.h's tessera_relu_squared): n values of x -> out. */
typedef void (*plain_fn)(const void *x, void *out, int64_t n, int is_bf16, int threads);

static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* gpt-oss's (ops/activation.py's clamped_swiglu_ref), rounding to bf16 after each op as torch
 * does: (clamp(up, -limit, limit) + 1) * (g * sigmoid(g * alpha)), g = min(gate, limit). */
static void clamped_swiglu(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h, float alpha,
                           float limit, int threads) {
#pragma omp parallel for num_threads(rows * h >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * h, *u = g + h;
        for (int64_t i = 0; i < h; i++) {
            float gate = bf16_to_f32(g[i]), up = bf16_to_f32(u[i]);
            gate = gate > limit ? limit : gate;  /* (NaN passes, as torch's clamp) */
            up = up > limit ? limit : (up < -limit ? -limit : up);
            const float glu = round_to_bf16(gate * round_to_bf16(sigmoid(round_to_bf16(gate * alpha))));
            out[r * h + i] = f32_to_bf16(round_to_bf16(up + 1.0f) * glu);
        }
    }
}

/* x [tokens, hidden] bf16; weights [tokens, top_k] float32 and ids [tokens, top_k] int64 (the
 * routing); live: NULL, or how many leading tokens are real (a step padded to a captured
 * graph's rows, read at each call): the rest get no experts and zero rows; out [tokens,
 * hidden] bf16. Stack 13: each expert's gate-then-up matrix [2 inter, hidden], b13 [experts,
 * 2 inter] bf16 or NULL; stack 2 likewise ([hidden, inter]). Between them act_kind's
 * activation: a gated kernel `act` (silu_and_mul_bf16.c's signature), the clamped SwiGLU
 * with alpha and limit, or an ungated kernel `act` (stack 13 then [inter, hidden] an
 * expert). Returns 0, a GEMM's nonzero status, MOE_EXPERT_OUT_OF_RANGE or
 * MOE_SCRATCH_TOO_SMALL (before anything is written). */
int tessera_moe_experts(const uint16_t *x, const float *weights, const int64_t *ids, const int64_t *live,
                        uint16_t *out, int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden,
                        int64_t inter,
                        int64_t kind13, const uint8_t *w13, int64_t w13_bytes, const uint8_t *scales13,
                        int64_t scales13_bytes, void *up_small, void *up_wide, int64_t up_wide_rows,
                        const uint16_t *b13,
                        int64_t kind2, const uint8_t *w2, int64_t w2_bytes, const uint8_t *scales2,
                        int64_t scales2_bytes, void *down_small, void *down_wide, int64_t down_wide_rows,
                        const uint16_t *b2,
                        int64_t act_kind, void *act, float alpha, float limit,
                        uint8_t *scratch, int64_t scratch_bytes, int threads) {
    if (top_k < 1 || top_k > 64) return MOE_BAD_ARGS;
    const int64_t used = live && *live >= 0 && *live < tokens ? *live : tokens;
    const int64_t pairs = used * top_k;
    if (scratch_bytes < tessera_moe_scratch_bytes(tokens, top_k, experts, hidden, inter))
        return MOE_SCRATCH_TOO_SMALL;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= experts) return MOE_EXPERT_OUT_OF_RANGE;
    const Stack s13 = {kind13, w13, w13_bytes, scales13, scales13_bytes, up_small, up_wide, up_wide_rows};
    const Stack s2 = {kind2, w2, w2_bytes, scales2, scales2_bytes, down_small, down_wide, down_wide_rows};
    const int64_t widest = max64(2 * inter, hidden);
    int64_t *starts = (int64_t *)scratch;
    int32_t *order = (int32_t *)(scratch + aligned(8 * (experts + 1)));  /* sorted slot -> pair */
    int32_t *slot = (int32_t *)((uint8_t *)order + aligned(4 * pairs));  /* pair -> sorted slot */
    uint16_t *rows = (uint16_t *)((uint8_t *)slot + aligned(4 * pairs));
    uint16_t *gate_up = (uint16_t *)((uint8_t *)rows + aligned(2 * pairs * hidden));
    uint16_t *hidden_rows = (uint16_t *)((uint8_t *)gate_up + aligned(2 * pairs * 2 * inter));
    uint16_t *down = (uint16_t *)((uint8_t *)hidden_rows + aligned(2 * pairs * inter));
    float *sums = (float *)((uint8_t *)down + aligned(2 * pairs * hidden));
    float *projected = (float *)((uint8_t *)sums + aligned(4 * tokens * hidden));  /* [pairs, widest] */
    float *bias_f32 = (float *)((uint8_t *)projected + aligned(4 * pairs * widest));

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

    const int64_t up_rows = act_kind == UNGATED_KERNEL ? inter : 2 * inter;
    int status = project(starts, experts, rows, gate_up, s13, b13, up_rows, hidden, projected, bias_f32, threads);
    if (status) return status;
    if (act_kind == CLAMPED_SWIGLU)
        clamped_swiglu(gate_up, hidden_rows, pairs, inter, alpha, limit, threads);
    else if (act_kind == UNGATED_KERNEL)
        ((plain_fn)act)(gate_up, hidden_rows, pairs * inter, 1, threads);
    else
        ((gated_fn)act)(gate_up, hidden_rows, pairs, inter, threads);
    status = project(starts, experts, hidden_rows, down, s2, b2, hidden, inter, projected, bias_f32, threads);
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
