/* The linear-attention gates (gating.h), built with the AVX512 family's flags. */
#include "gating.h"
