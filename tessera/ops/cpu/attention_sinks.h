/* Attention sinks (gpt-oss): a learned logit per query head that joins every softmax's
 * denominator and contributes no value, so a head can attend to (almost) nothing. */
#ifndef TESSERA_ATTENTION_SINKS_H
#define TESSERA_ATTENTION_SINKS_H
#include <math.h>
#include <stdint.h>

/* Head h's sink logit, or -inf (no sink: exp(-inf) = 0) when the layer has none. */
static inline float sink_of(const float *sinks, int64_t h) {
    return sinks ? sinks[h] : -INFINITY;
}

/* What multiplies an unnormalised output sum_t exp(s_t - m) v_t, whose weights sum to `l`,
 * to give softmax over the keys and the sink: exp(m - M) / (l exp(m - M) + exp(sink - M))
 * with M = max(m, sink), so neither exponent can overflow; 1 / l without a sink. */
static inline float sink_normaliser(float m, float l, float sink) {
    if (sink == -INFINITY) return 1.0f / l;
    const float top = m > sink ? m : sink, kept = expf(m - top);
    return kept / (l * kept + expf(sink - top));
}
#endif
