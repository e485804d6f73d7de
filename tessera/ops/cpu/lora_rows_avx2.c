/* LoRA deltas for a few rows (decode steps), each row with its own adapter slot: plain C
 * that the compiler vectorises (build.py builds *_avx2.c files with -mavx2 -mfma; AVX512
 * CPUs run it too). One call per layer: a captured kernel graph replays it, reading the
 * rows' slots from `row_slot` (base-model rows: -1, nothing added).
 *   t[j]   = bf16(x[r] . a[s][j])                 j < rank[s], float32 sums
 *   out[r] = bf16(out[r] + bf16(sum_j t[j] * bt[s][j]))
 * the rounding of two bf16 GEMMs and an add, as the torch path does them. */
#include <stdint.h>

#include "bf16.h"

#define MAX_CAPACITY 2048  /* slot rank capacity (max_lora_rank x packed shards, padded) */
#define CHUNK 512          /* output features accumulated at once (float32, on the stack) */

/* x [rows, in]; out [rows, n] (added to); a [slots, capacity, in]; bt [slots, capacity, n];
 * row_slot [rows]; slot_rank [slots]. Returns 1 for a capacity it cannot hold, else 0. */
int tessera_lora_rows_bf16(const uint16_t *x, uint16_t *out, const int32_t *row_slot,
                           const int32_t *slot_rank, const uint16_t *a, const uint16_t *bt,
                           int64_t rows, int64_t in, int64_t n, int64_t capacity) {
    if (capacity > MAX_CAPACITY) return 1;
    float t[MAX_CAPACITY];
    float acc[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        const int32_t s = row_slot[r];
        if (s < 0) continue;
        const int64_t rank = slot_rank[s];
        const uint16_t *xr = x + r * in;
        for (int64_t j = 0; j < rank; j++) {
            const uint16_t *aj = a + ((int64_t)s * capacity + j) * in;
            float lanes[8] = {0};  /* independent partial sums: vectorised without reassociation */
            for (int64_t i = 0; i < in; i++) lanes[i & 7] += bf16_to_f32(xr[i]) * bf16_to_f32(aj[i]);
            float sum = 0.0f;
            for (int l = 0; l < 8; l++) sum += lanes[l];
            t[j] = round_to_bf16(sum);
        }
        uint16_t *outr = out + r * n;
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
            const int64_t width = n - c0 < CHUNK ? n - c0 : CHUNK;
            for (int64_t c = 0; c < width; c++) acc[c] = 0.0f;
            for (int64_t j = 0; j < rank; j++) {
                const uint16_t *bj = bt + ((int64_t)s * capacity + j) * n + c0;
                const float tj = t[j];
                for (int64_t c = 0; c < width; c++) acc[c] += tj * bf16_to_f32(bj[c]);
            }
            for (int64_t c = 0; c < width; c++)
                outr[c0 + c] = f32_to_bf16(bf16_to_f32(outr[c0 + c]) + round_to_bf16(acc[c]));
        }
    }
    return 0;
}
