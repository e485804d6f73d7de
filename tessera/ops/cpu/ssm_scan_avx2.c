/* ssm_scan.c for CPUs without AVX512 (same symbol and rounding): ssm_scan.h built with
 * -mavx2 -mfma, 8-lane vector types. */
#include "ssm_scan.h"
