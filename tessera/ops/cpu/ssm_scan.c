/* The Mamba-2 decode scan (ssm_scan.h), built with the AVX512 family's flags. */
#include "ssm_scan.h"
