/* Gather table rows by index (token embedding, rotary cos/sin rows): one row copy per id.
 * A plain byte copy, so any dtype, bit-exact to F.embedding. Built by build.py.
 * tessera_embedding_scaled: rows times a scale (Gemma's sqrt(hidden)), as torch multiplies
 * a bf16 or float32 tensor by a Python float: in float32, rounded to the table's dtype. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* table: [num_rows, row_bytes]; out: [tokens, row_bytes]. Returns 1, having written
 * nothing, if an id is outside [0, num_rows) (F.embedding raises there too). */
int tessera_embedding(const int64_t *ids, const char *table, char *out, int64_t tokens,
                      int64_t row_bytes, int64_t num_rows) {
    for (int64_t t = 0; t < tokens; t++)
        if (ids[t] < 0 || ids[t] >= num_rows) return 1;
    for (int64_t t = 0; t < tokens; t++)
        memcpy(out + t * row_bytes, table + ids[t] * row_bytes, (size_t)row_bytes);
    return 0;
}

/* table: [num_rows, h] of bf16 (is_bf16) or float32; out: [tokens, h] = table[ids] * scale.
 * Returns 1, having written nothing, if an id is outside [0, num_rows). */
int tessera_embedding_scaled(const int64_t *ids, const void *table, void *out, int64_t tokens, int64_t h,
                             int64_t num_rows, float scale, int is_bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (ids[t] < 0 || ids[t] >= num_rows) return 1;
    for (int64_t t = 0; t < tokens; t++) {
        if (is_bf16) {
            const uint16_t *row = (const uint16_t *)table + ids[t] * h;
            uint16_t *o = (uint16_t *)out + t * h;
            for (int64_t i = 0; i < h; i++) o[i] = f32_to_bf16(bf16_to_f32(row[i]) * scale);
        } else {
            const float *row = (const float *)table + ids[t] * h;
            float *o = (float *)out + t * h;
            for (int64_t i = 0; i < h; i++) o[i] = row[i] * scale;
        }
    }
    return 0;
}
