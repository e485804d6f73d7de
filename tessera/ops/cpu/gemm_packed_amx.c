/* y[m, n] = x[m, k] times the packed bf16 weight (+ bias[n]) on AMX tiles (Sapphire Rapids
 * and later Xeons), bfloat16 in and out, float32 accumulation.
 *
 * gemm_bf16.c's packed panels are AMX's B tiles as they lie (amx_tiles.h), so no copy of
 * the weight is made. Each thread takes a contiguous share of the pairs of panels (as the
 * AVX512 kernel) and, per block of rows of x (amx_row_block), multiplies every row against
 * its pair while the pair stays in L1 / L2. Requires n % 16 == 0 and k % 32 == 0; AMX must
 * be granted to the process (Linux: an arch_prctl once, done here). Built by build.py for CPUs with amx_tile and
 * amx_bf16. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_tiles.h"

/* x [m, k], packed [n / 16, k / 2, 32], bias [n] or NULL, y [m, n]; all contiguous bf16.
 * Returns 1 on shapes it does not take, 3 where the OS refuses AMX, 2 without memory for
 * the padded rows. */
int tessera_gemm_packed_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                            uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || n % 16 || k % 32 || n < 16) return 1;
    if (!amx_granted()) return 3;
    const int64_t panels = n / 16, pairs = (panels + 1) / 2, panel_elems = k * 16, block = amx_row_block(k, 32);
    int failed;
    uint16_t *padded = amx_padded_rows(x, m, k, &failed);
    if (failed) return 2;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t u0 = pairs * t / nt, u1 = pairs * (t + 1) / nt;
        amx_configure();
        for (int64_t m0 = 0; m0 < m; m0 += block) {
            const int64_t rows = m - m0 < block ? m - m0 : block;
            for (int64_t u = u0; u < u1; u++) {
                const int64_t p = 2 * u;
                amx_pair_rows(x + m0 * k, padded, rows, k, packed + p * panel_elems, panel_elems, p + 1 < panels,
                              bias, y + m0 * n, n, 16 * p);
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
}
