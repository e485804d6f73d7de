/* gated_delta.c for CPUs without AVX512 (same symbols and rounding): gated_delta.h built
 * with -mavx2 -mfma, 16-lane vector types as pairs of ymm registers. */
#include "gated_delta.h"
