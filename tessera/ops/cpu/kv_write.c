/* Write this step's keys and values into their cache slots: one row copy per token for K
 * and V, skipping slot -1 (padded rows). A plain byte copy, so any dtype; rows may be
 * strided views of the QKV projection. Replaces two index_copy_ calls (and, with padding,
 * a boolean gather) per layer. Built by build.py. */
#include <stdint.h>
#include <string.h>

/* key / value: [tokens, row_bytes] with row strides (bytes); caches: [num_slots, row_bytes].
 * Returns 1, having written nothing, if a slot is >= num_slots (index_copy_ raises there
 * too; a bad slot must not write outside the cache). */
int tessera_kv_write(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                     char *k_cache, char *v_cache, const int64_t *slots, int64_t tokens,
                     int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return 1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
