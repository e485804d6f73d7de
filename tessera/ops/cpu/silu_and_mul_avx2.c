/* silu_and_mul_bf16.c for CPUs without AVX512 (same symbol and rounding):
 * out = bf16(bf16(silu(gate)) * up) over rows of a packed [gate | up] projection. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

/* gate_up: [rows, 2 * h]; out: [rows, h]. */
void tessera_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t h,
                               int threads) {
#pragma omp parallel for num_threads(rows * h >= 65536 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * h, *u = g + h;
        for (int64_t i = 0; i < h; i++) {
            const float x = bf16_to_f32(g[i]);
            const float silu = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
            out[r * h + i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
        }
    }
}
