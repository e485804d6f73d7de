/* A mixture's scored top-k routing in one call, for the routers softmax top-k
 * (moe_layer.c's tessera_moe_softmax_topk) does not cover: DeepSeek's (V2's groups, V3's
 * sigmoid scores with a choice bias and group-limited choice; GLM-4.5, MiniMax-M2,
 * Nemotron 3, Mistral 4 route as these), ERNIE 4.5's and LFM2-MoE's. With it a decode step
 * of those mixtures can be kernels alone. Per token:
 *   logits: given (bf16 or float32), or x W^T of the hidden row and a float32 router
 *     weight (DeepSeek's routers keep theirs in float32), in float32: each router row read
 *     once for 8 tokens, a vector register of partial sums a token;
 *   scores: softmax or sigmoid of the logits, float32;
 *   choice: scores + bias (when given); with groups, only the topk_group groups whose
 *     best score (rule 0) or sum of best two (rule 1) is largest stay eligible;
 *   ids: the k eligible experts of largest choice (largest first; of equal choices the
 *     lower expert first; NaN is taken only while fewer than k are held);
 *   weights: the ids' scores (without the bias), over max(their sum, floor) + eps where
 *     renormalised, times scaling.
 * One text for both builds (moe_router.c with AVX512 flags, moe_router_avx2.c with AVX2). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "topk_insert.h"

#define ROUTER_MAX_K 64
#define ROUTER_TOKENS 8 /* token rows sharing each pass over a router row (accumulators in registers) */

#ifdef __AVX512F__
typedef float rvec __attribute__((vector_size(64)));
#define RVL 16
#else
typedef float rvec __attribute__((vector_size(32)));
#define RVL 8
#endif

enum { ROUTER_OK = 0, ROUTER_BAD_ARGS = 1, ROUTER_NO_MEMORY = 2 };

static inline rvec rload(const float *p) { rvec v; memcpy(&v, p, sizeof v); return v; }

/* logits[t, e] = x_t . w_e for n rows of x (n <= ROUTER_TOKENS) against one router row:
 * the row is read once for all of them, RVL lanes of partial sums a row, then the tail */
static inline __attribute__((always_inline)) void router_row_n(const float *x, int64_t n, const float *w,
                                                               int64_t hidden, float *logits, int64_t logit_stride) {
    rvec acc[ROUTER_TOKENS];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    for (; i + RVL <= hidden; i += RVL) {
        const rvec wv = rload(w + i);
        for (int64_t t = 0; t < n; t++) acc[t] += rload(x + t * hidden + i) * wv;
    }
    for (int64_t t = 0; t < n; t++) {
        float sum = 0.0f;
        for (int l = 0; l < RVL; l++) sum += acc[t][l];
        for (int64_t j = i; j < hidden; j++) sum += x[t * hidden + j] * w[j];
        logits[t * logit_stride] = sum;
    }
}

/* a full block of tokens with n a constant (its accumulators stay in registers), else any n */
static void router_row(const float *x, int64_t n, const float *w, int64_t hidden, float *logits,
                       int64_t logit_stride) {
    if (n == ROUTER_TOKENS) router_row_n(x, ROUTER_TOKENS, w, hidden, logits, logit_stride);
    else if (n == 1) router_row_n(x, 1, w, hidden, logits, logit_stride);
    else router_row_n(x, n, w, hidden, logits, logit_stride);
}

static void route_token(const float *logits, const float *bias, float *weights, int64_t *ids, int64_t experts,
                        int64_t k, int sigmoid, int64_t groups, int64_t topk_group, int group_rule, int renormalize,
                        float eps, float floor_, float scaling, float *scores, float *choice, unsigned char *eligible) {
    if (sigmoid) {
        for (int64_t e = 0; e < experts; e++) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else {
        float max = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < experts; e++) if (logits[e] > max) max = logits[e];
        for (int64_t e = 0; e < experts; e++) sum += (scores[e] = expf(logits[e] - max));
        for (int64_t e = 0; e < experts; e++) scores[e] /= sum;
    }
    for (int64_t e = 0; e < experts; e++) choice[e] = bias ? scores[e] + bias[e] : scores[e];
    memset(eligible, 1, (size_t)experts);
    if (groups > 1) {
        const int64_t per = experts / groups;
        float gbest[ROUTER_MAX_K];
        int64_t gwhich[ROUTER_MAX_K], gheld = 0;
        for (int64_t g = 0; g < groups; g++) {
            float first = -INFINITY, second = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                const float v = choice[e];
                if (v > first) { second = first; first = v; }
                else if (v > second) second = v;
            }
            keep_largest(gbest, gwhich, &gheld, topk_group, group_rule ? first + second : first, g);
        }
        memset(eligible, 0, (size_t)experts);
        for (int64_t j = 0; j < gheld; j++) memset(eligible + gwhich[j] * per, 1, (size_t)per);
    }
    float best[ROUTER_MAX_K];
    int64_t which[ROUTER_MAX_K], held = 0;
    for (int64_t e = 0; e < experts; e++)
        if (eligible[e]) keep_largest(best, which, &held, k, choice[e], e);
    float sum = 0.0f;
    for (int64_t s = 0; s < k; s++) {
        const int64_t e = s < held ? which[s] : which[0];  /* (held < k only for groups too small) */
        ids[s] = e;
        weights[s] = scores[e];
        sum += scores[e];
    }
    const float denominator = (sum > floor_ ? sum : floor_) + eps;
    for (int64_t s = 0; s < k; s++) {
        if (renormalize) weights[s] = weights[s] / denominator;
        if (scaling != 1.0f) weights[s] = weights[s] * scaling;
    }
}

/* in: [tokens, ...] rows every in_stride elements: the logits [experts], or with router_w
 * [experts, hidden] float32 the hidden rows [hidden]; in_bf16: in's type (else float32).
 * bias: [experts] float32 or NULL. weights: [tokens, k] float32; ids: [tokens, k]. */
int tessera_moe_scored_topk(const void *in, int64_t in_stride, int in_bf16, const float *router_w, int64_t hidden,
                            const float *bias, float *weights, int64_t *ids, int64_t tokens, int64_t experts,
                            int64_t k, int sigmoid, int64_t groups, int64_t topk_group, int group_rule,
                            int renormalize, float eps, float floor_, float scaling, int threads) {
    if (k < 1 || k > ROUTER_MAX_K || k > experts || groups < 1 || experts % groups || topk_group < 1
        || topk_group > groups || topk_group > ROUTER_MAX_K || (router_w && hidden < 1))
        return ROUTER_BAD_ARGS;
    float *logits = malloc(sizeof(float) * (size_t)(tokens * experts));
    float *rows = router_w ? malloc(sizeof(float) * (size_t)(tokens * hidden)) : NULL;
    float *work = malloc((sizeof(float) * 2 + 1) * (size_t)(tokens * experts));
    if (!logits || !work || (router_w && !rows)) {
        free(logits); free(rows); free(work);
        return ROUTER_NO_MEMORY;
    }
    const int64_t width = router_w ? hidden : experts;
    float *src = router_w ? rows : logits;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < width; i++)
            src[t * width + i] = in_bf16 ? bf16_to_f32(((const uint16_t *)in)[t * in_stride + i])
                                         : ((const float *)in)[t * in_stride + i];
    if (router_w) {
        const int64_t blocks = (tokens + ROUTER_TOKENS - 1) / ROUTER_TOKENS;
#pragma omp parallel for collapse(2) num_threads(experts * hidden >= 65536 ? threads : 1) schedule(static)
        for (int64_t e = 0; e < experts; e++)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t t0 = b * ROUTER_TOKENS, n = tokens - t0 < ROUTER_TOKENS ? tokens - t0 : ROUTER_TOKENS;
                router_row(rows + t0 * hidden, n, router_w + e * hidden, hidden, logits + t0 * experts + e, experts);
            }
    }
    float *scores = work, *choice = work + tokens * experts;
    unsigned char *eligible = (unsigned char *)(work + 2 * tokens * experts);
#pragma omp parallel for num_threads(tokens * experts >= 16384 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        route_token(logits + t * experts, bias, weights + t * k, ids + t * k, experts, k, sigmoid, groups,
                    topk_group, group_rule, renormalize, eps, floor_, scaling, scores + t * experts,
                    choice + t * experts, eligible + t * experts);
    free(logits); free(rows); free(work);
    return ROUTER_OK;
}
