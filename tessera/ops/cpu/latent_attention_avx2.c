/* latent_attention.c for CPUs without AVX512 (same symbols and rounding): latent_attention.h built with
 * -mavx2 -mfma. */
#include "latent_attention.h"
