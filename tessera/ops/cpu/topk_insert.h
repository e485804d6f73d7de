/* The k largest values seen so far, kept in descending order as values stream past (a
 * router's top k experts, or groups): only a strictly larger value moves ahead, so of equal
 * values the earlier index stays first; NaN compares false and is taken only while fewer
 * than k are held. Shared by moe_layer.c and moe_router.h. */
#ifndef TESSERA_TOPK_INSERT_H
#define TESSERA_TOPK_INSERT_H
#include <stdint.h>

static inline void keep_largest(float *best, int64_t *which, int64_t *held, int64_t k, float v, int64_t index) {
    if (*held < k || v > best[*held - 1]) {
        int64_t at = *held < k ? *held : k - 1; /* full: the last one drops */
        while (at > 0 && v > best[at - 1]) {
            best[at] = best[at - 1];
            which[at] = which[at - 1];
            at--;
        }
        best[at] = v;
        which[at] = index;
        if (*held < k) (*held)++;
    }
}
#endif
