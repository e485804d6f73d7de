/* The Gated DeltaNet decode kernels (gated_delta.h), built with the AVX512 family's flags. */
#include "gated_delta.h"
