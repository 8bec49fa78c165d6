/* GGUF blocks x float32 activations on the CPU, for lightwell/kernels/cpu/gguf_cpu.py.
 *
 * out[m, n] = sum_k x[m, k] * W[n, k], W kept as a GGUF file stores it: row n is K / 32 blocks
 * (gguf_blocks.h). Up to 4 rows of x share one dequantization; output rows are split over
 * OpenMP threads. Optionally x is rounded to int8 first (integer dot products).
 */
#include <stdlib.h>

#include "gguf_blocks.h"

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W.T, W [N, K / 32 blocks]; with
 * int8_act, x's rows are first quantized to int8 by blocks (gguf_blocks.h) and each block of
 * the product is an integer dot product. */
int gguf_mm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
            int64_t w_row_bytes, int qtype, float *out, int64_t ldo, int nthreads,
            int int8_act) {
    int bb = block_bytes(qtype);
    if (bb == 0 || K % QK || w_row_bytes != K / QK * bb) return -1;
    int nb = (int)(K / QK);
    int8_t *q = NULL;
    float *ds = NULL;
    if (int8_act) {
        q = malloc(M * K);
        ds = malloc(M * nb * 2 * sizeof(float));
        if (!q || !ds) {
            free(q);
            free(ds);
            return -2;
        }
        for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, q + m * K, ds + m * nb * 2);
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = w + n * w_row_bytes;
        for (int64_t m = 0; m < M; m += 4) {
            int R = M - m < 4 ? (int)(M - m) : 4;
            if (int8_act) {
                q8_rows rows = {q + m * K, ds + m * nb * 2, K, nb * 2};
                row_dot_q8(wrow, nb, qtype, bb, &rows, R, out + m * ldo + n, ldo);
            } else {
                row_dot(wrow, nb, qtype, bb, x + m * ldx, ldx, R, out + m * ldo + n, ldo);
            }
        }
    }
    free(q);
    free(ds);
    return 0;
}

/* out [R, K] float32 = rows idx[0..R) of W [N, K / 32 blocks] dequantized. */
int gguf_dequant_rows(const uint8_t *w, int64_t K, int64_t w_row_bytes, int qtype,
                      const int64_t *idx, int64_t R, float *out, int nthreads) {
    int bb = block_bytes(qtype);
    if (bb == 0 || K % QK || w_row_bytes != K / QK * bb) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 8)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *wrow = w + idx[r] * w_row_bytes;
        for (int64_t b = 0; b < K / QK; b++) {
            float *o = out + r * K + b * QK;
#ifdef GGUF_AVX2
            __m256 v[4];
            dequant_block_avx2(wrow + b * bb, qtype, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, v[i]);
#else
            dequant_block(wrow + b * bb, qtype, o);
#endif
        }
    }
    return 0;
}
