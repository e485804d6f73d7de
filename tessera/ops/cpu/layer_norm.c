/* LayerNorm (layer_norm.h), built with the AVX512 family's flags. */
#include "layer_norm.h"
