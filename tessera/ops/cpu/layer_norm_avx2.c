/* layer_norm.c for CPUs without AVX512 (same symbol and rounding): layer_norm.h built with -mavx2 -mfma. */
#include "layer_norm.h"
