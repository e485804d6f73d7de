/* kv_write.c for an 8-bit float cache (fp8.h; the format is fixed when it is built): this
 * step's keys and values, bfloat16 or float32, rounded into their cache slots, skipping
 * slot -1 (padded rows). Scalar: a step writes one row per token per layer, little beside
 * the attention that reads the whole context. Built by build.py. */
#include <stdint.h>

#include "bf16.h"
#include "fp8.h"

static inline float element(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* key / value: [tokens, row] (elements; bf16 when `bf16`, else float32) with row strides in
 * elements; caches: [num_slots, row] bytes. Returns 1, having written nothing, if a slot is
 * >= num_slots. */
int tessera_kv_write_fp8(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                         uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t tokens,
                         int64_t row, int64_t num_slots, int bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return 1;
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const char *k = (const char *)key + t * key_stride * elem;
        const char *v = (const char *)value + t * value_stride * elem;
        uint8_t *kd = k_cache + slot * row, *vd = v_cache + slot * row;
        for (int64_t i = 0; i < row; i++) {
            kd[i] = f32_to_fp8(element(k, i, bf16));
            vd[i] = f32_to_fp8(element(v, i, bf16));
        }
    }
    return 0;
}
