// Quantised matrix-vector product for decode: y = W x with W [n_rows, n_cols] in a GGUF format
// and x, y in f32.
//
// CPU op: y[r] = sum_c dequantise(W[r])[c] * x[c], accumulated in f32 (the order of additions
// differs from the CPU, so results agree to f32 rounding, not bit for bit).
// One warp per row. Each lane takes 4 consecutive values of a 32-value group, so 8 lanes cover a
// group and the warp walks the row WAVE/8 groups at a time: the activation loads are one
// coalesced float4 per lane and a group's weight bytes are read by neighbouring lanes. x must be
// 16-byte aligned (pool allocations are 256-byte aligned) and n_cols a multiple of 32 (256 for
// k-quants). Launch: block = EMBER_MATVEC_ROWS_PER_BLOCK warps, grid = ceil(n_rows /
// EMBER_MATVEC_ROWS_PER_BLOCK).
#include "ember_quant.h"

#define EMBER_MATVEC_ROWS_PER_BLOCK 4

template <typename F>
EMBER_DEVICE void ember_matvec(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols) {
    const int lane = (int)(threadIdx.x % EMBER_WAVE_SIZE);
    const uint32_t r = blockIdx.x * EMBER_MATVEC_ROWS_PER_BLOCK + threadIdx.x / EMBER_WAVE_SIZE;
    if (r >= n_rows) return;
    const uint8_t* row = w + (size_t)r * ember_row_bytes<F>(n_cols);
    const int n_groups = (int)(n_cols / 32);
    const int quad = lane % 8;
    const int groups_per_step = EMBER_WAVE_SIZE / 8;
    float sum = 0.0f;
#pragma unroll 4
    for (int g = lane / 8; g < n_groups; g += groups_per_step) {
        const float4 xv = *(const float4*)(x + 32 * g + 4 * quad);
        sum += F::get(row, g, 4 * quad + 0) * xv.x;
        sum += F::get(row, g, 4 * quad + 1) * xv.y;
        sum += F::get(row, g, 4 * quad + 2) * xv.z;
        sum += F::get(row, g, 4 * quad + 3) * xv.w;
    }
    sum = ember_warp_sum(sum);
    if (lane == 0) y[r] = sum;
}

#define EMBER_MATVEC(name, format) \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols) { ember_matvec<format>(y, w, x, n_rows, n_cols); }

EMBER_MATVEC(ember_matvec_f32, EmberF32)
EMBER_MATVEC(ember_matvec_f16, EmberF16)
EMBER_MATVEC(ember_matvec_bf16, EmberBF16)
EMBER_MATVEC(ember_matvec_q4_0, EmberQ4_0)
EMBER_MATVEC(ember_matvec_q4_1, EmberQ4_1)
EMBER_MATVEC(ember_matvec_q5_0, EmberQ5_0)
EMBER_MATVEC(ember_matvec_q5_1, EmberQ5_1)
EMBER_MATVEC(ember_matvec_q8_0, EmberQ8_0)
EMBER_MATVEC(ember_matvec_q2_k, EmberQ2_K)
EMBER_MATVEC(ember_matvec_q3_k, EmberQ3_K)
EMBER_MATVEC(ember_matvec_q4_k, EmberQ4_K)
EMBER_MATVEC(ember_matvec_q5_k, EmberQ5_K)
EMBER_MATVEC(ember_matvec_q6_k, EmberQ6_K)
