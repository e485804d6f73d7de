/* gating.c for CPUs without AVX512 (same symbols and rounding): gating.h built with -mavx2 -mfma. */
#include "gating.h"
