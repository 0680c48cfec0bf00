// Quantised matrix-vector product for decode: y = W x with W [n_rows, n_cols] in a GGUF format
// and x, y in f32.
//
// CPU op: y[r] = sum_c dequantise(W[r])[c] * x[c], accumulated in f32 (the order of additions
// differs from the CPU, so results agree to f32 rounding, not bit for bit).
// One warp per row: lanes take 32-value groups in turn, then the warp sums. Launch: block =
// EMBER_MATVEC_ROWS_PER_BLOCK warps, grid = ceil(n_rows / EMBER_MATVEC_ROWS_PER_BLOCK).
#include "ember_quant.h"

#define EMBER_MATVEC_ROWS_PER_BLOCK 4

template <typename F>
EMBER_DEVICE void ember_matvec(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols) {
    const uint32_t lane = threadIdx.x % EMBER_WAVE_SIZE;
    const uint32_t r = blockIdx.x * EMBER_MATVEC_ROWS_PER_BLOCK + threadIdx.x / EMBER_WAVE_SIZE;
    if (r >= n_rows) return;
    const uint8_t* row = w + (size_t)r * ember_row_bytes<F>(n_cols);
    const int n_groups = (int)(n_cols / 32);
    float sum = 0.0f;
    for (int g = (int)lane; g < n_groups; g += EMBER_WAVE_SIZE) {
        const float* xg = x + 32 * g;
#pragma unroll 8
        for (int l = 0; l < 32; ++l) sum += F::get(row, g, l) * xg[l];
    }
    sum = ember_warp_sum(sum);
    if (lane == 0) y[r] = sum;
}

#define EMBER_MATVEC(name, format) \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols) { ember_matvec<format>(y, w, x, n_rows, n_cols); }

EMBER_MATVEC(ember_matvec_f32, EmberF32)
EMBER_MATVEC(ember_matvec_f16, EmberF16)
EMBER_MATVEC(ember_matvec_q4_0, EmberQ4_0)
EMBER_MATVEC(ember_matvec_q4_1, EmberQ4_1)
EMBER_MATVEC(ember_matvec_q8_0, EmberQ8_0)
EMBER_MATVEC(ember_matvec_q4_k, EmberQ4_K)
EMBER_MATVEC(ember_matvec_q6_k, EmberQ6_K)
