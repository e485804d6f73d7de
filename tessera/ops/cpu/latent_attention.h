/* Multi-head latent attention's own ops on CPU (ops/latent_attention.py), one C call each:
 *
 * tessera_head_matmul: out[t, h, :] = x[t, h, :] W_h, W_h [k, n] (rows of n), or, transposed,
 * x[t, h, :] W_h^T with W_h [n, k] (rows of k): DeepSeek's absorbed W_UK and W_UV. A decode
 * step's few tokens share each read of W (the weights dominate); float32 sums rounded once, as
 * torch's bf16 GEMM (in another order: a bf16 result can differ by one unit). Heads split over
 * the threads. The plain loops vectorise for the build's ISA (latent_attention.c: AVX512,
 * latent_attention_avx2.c: AVX2).
 *
 * tessera_concat_columns: rows of a and rows of b side by side (bytes; any row strides). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define HM_LANES 16
#define HM_TOKENS 8
typedef float hm_vec __attribute__((vector_size(HM_LANES * sizeof(float))));
#define HM_MAX_K 1024 /* the widest per-head input of the untransposed form (a stack buffer) */

static float dot_f32_bf16(const float *x, const uint16_t *w, int64_t k) {
    float acc[HM_LANES] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + HM_LANES <= k; i += HM_LANES)
        for (int j = 0; j < HM_LANES; j++) acc[j] += x[i + j] * bf16_to_f32(w[i + j]);
    for (int j = 0; j < HM_LANES; j++) sum += acc[j];
    for (; i < k; i++) sum += x[i] * bf16_to_f32(w[i]);
    return sum;
}

/* x: [tokens, heads, k] with row stride x_row and head stride x_head (bf16); w: head h at
 * w + h * w_head, its rows w_row apart; out: [tokens, heads, n] contiguous. Returns 1 when
 * its scratch could not be allocated. */
int tessera_head_matmul(const uint16_t *x, int64_t x_row, int64_t x_head, const uint16_t *w, int64_t w_head,
                        int64_t w_row, uint16_t *out, int64_t tokens, int64_t heads, int64_t k, int64_t n,
                        int transposed, int threads) {
    int failed = 0;
#pragma omp parallel for num_threads(heads * k * n >= 65536 ? threads : 1) schedule(static) reduction(| : failed)
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *wh = w + h * w_head;
        if (!transposed && tokens <= 2) {
            /* a token or two: W's rows streamed once, each an axpy into the tokens' sums */
            float *acc = calloc((size_t)(tokens * n), sizeof(float));
            if (!acc) {
                failed = 1;
                continue;
            }
            for (int64_t i = 0; i < k; i++) {
                const uint16_t *wr = wh + i * w_row;
                for (int64_t t = 0; t < tokens; t++) {
                    const float xv = bf16_to_f32(x[t * x_row + h * x_head + i]);
                    for (int64_t j = 0; j < n; j++) acc[t * n + j] += xv * bf16_to_f32(wr[j]);
                }
            }
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t j = 0; j < n; j++) out[(t * heads + h) * n + j] = f32_to_bf16(acc[t * n + j]);
            free(acc);
            continue;
        }
        if (!transposed) {
            /* blocks of 8 tokens x 16 columns held in registers while W's rows go by: each
             * value of W is widened and read once per 8 tokens */
            float xs[HM_TOKENS][HM_MAX_K];
            for (int64_t t0 = 0; t0 < tokens; t0 += HM_TOKENS) {
                const int64_t tn = tokens - t0 < HM_TOKENS ? tokens - t0 : HM_TOKENS;
                for (int64_t t = 0; t < HM_TOKENS; t++)
                    for (int64_t i = 0; i < k; i++)
                        xs[t][i] = t < tn ? bf16_to_f32(x[(t0 + t) * x_row + h * x_head + i]) : 0.0f;
                for (int64_t j0 = 0; j0 < n; j0 += HM_LANES) {
                    const int64_t jn = n - j0 < HM_LANES ? n - j0 : HM_LANES;
                    hm_vec acc[HM_TOKENS] = {{0}};  /* (a vector type: the compiler keeps them in registers) */
                    for (int64_t i = 0; i < k; i++) {
                        float widened[HM_LANES] = {0};
                        const uint16_t *wr = wh + i * w_row + j0;
                        for (int64_t j = 0; j < jn; j++) widened[j] = bf16_to_f32(wr[j]);
                        hm_vec wv;
                        memcpy(&wv, widened, sizeof wv);
                        for (int t = 0; t < HM_TOKENS; t++) acc[t] += xs[t][i] * wv;
                    }
                    for (int64_t t = 0; t < tn; t++) {
                        float sums[HM_LANES];
                        memcpy(sums, &acc[t], sizeof sums);
                        for (int64_t j = 0; j < jn; j++) out[((t0 + t) * heads + h) * n + j0 + j] = f32_to_bf16(sums[j]);
                    }
                }
            }
            continue;
        }
        /* the tokens' rows in float32 */
        float *scratch = malloc((size_t)(tokens * k) * sizeof(float));
        if (!scratch) {
            failed = 1;
            continue;
        }
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t i = 0; i < k; i++) scratch[t * k + i] = bf16_to_f32(x[t * x_row + h * x_head + i]);
        for (int64_t j = 0; j < n; j++)
            for (int64_t t = 0; t < tokens; t++)
                out[(t * heads + h) * n + j] = f32_to_bf16(dot_f32_bf16(scratch + t * k, wh + j * w_row, k));
        free(scratch);
    }
    return failed;
}

/* out [rows, a_bytes + b_bytes] (contiguous) <- each row of a (a_stride bytes apart), then of b. */
void tessera_concat_columns(const uint8_t *a, int64_t a_stride, int64_t a_bytes, const uint8_t *b, int64_t b_stride,
                            int64_t b_bytes, uint8_t *out, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(out + r * (a_bytes + b_bytes), a + r * a_stride, (size_t)a_bytes);
        memcpy(out + r * (a_bytes + b_bytes) + a_bytes, b + r * b_stride, (size_t)b_bytes);
    }
}
