/* Where a token's K/V row sits in tessera's paged cache, for the AVX2 attention kernels:
 * blocks of a power-of-two size, indexed by shifts. */
#ifndef TESSERA_PAGED_SLOTS_H
#define TESSERA_PAGED_SLOTS_H
#include <stdint.h>

/* log2(block_size), or -1 when it is not a power of two. */
static inline int64_t block_shift(int64_t block_size) {
    if (block_size <= 0 || (block_size & (block_size - 1))) return -1;
    return __builtin_ctzll((unsigned long long)block_size);
}

/* The cache slot of position `pos` of a sequence with block table `table`. */
static inline int64_t paged_slot(const int32_t *table, int64_t shift, int64_t pos) {
    return ((int64_t)table[pos >> shift] << shift) + (pos & (((int64_t)1 << shift) - 1));
}
#endif
