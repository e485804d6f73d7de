/* Multi-head latent attention's ops (latent_attention.h), built with the AVX512 family's flags. */
#include "latent_attention.h"
