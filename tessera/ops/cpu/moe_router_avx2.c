/* moe_router.c for CPUs without AVX512 (same symbol and results): moe_router.h built with -mavx2 -mfma. */
#include "moe_router.h"
