/* The scored MoE routing (moe_router.h), built with the AVX512 family's flags. */
#include "moe_router.h"
