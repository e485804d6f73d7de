/* Gather table rows by index (token embedding, rotary cos/sin rows): one row copy per id.
 * A plain byte copy, so any dtype, bit-exact to F.embedding. Built by build.py. */
#include <stdint.h>
#include <string.h>

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
