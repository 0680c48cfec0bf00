// ember_norm.h: the RMS factor of a row, shared by norm.hip and the kernels that fuse a norm
// into another step (rope.hip's QK-norm before rope), so every fused norm sums in the order of
// ember_rms_norm_f32 at the same block size and gets the same bits.
#pragma once
#include "ember_compat.h"

// Sum over the whole block in double; every thread gets the result. `scratch` holds one double
// per warp.
EMBER_DEVICE double ember_block_sum_f64(double value, double* scratch) {
    const int lane = threadIdx.x % EMBER_WAVE_SIZE;
    const int warp = threadIdx.x / EMBER_WAVE_SIZE;
    const int n_warps = (blockDim.x + EMBER_WAVE_SIZE - 1) / EMBER_WAVE_SIZE;
#pragma unroll
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
#if defined(EMBER_PLATFORM_CUDA)
        value += __shfl_xor_sync(0xffffffffu, value, mask, 32);
#else
        value += __shfl_xor(value, mask, EMBER_WAVE_SIZE);
#endif
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    value = 0.0;
    for (int w = 0; w < n_warps; ++w) value += scratch[w];
    return value;
}

// The factor 1 / sqrt(mean(row^2) + eps) of one row, every thread of the block summing its
// columns c = threadIdx.x, c + blockDim.x, ... (so the block size fixes the order). Every thread
// of the block must call this.
EMBER_DEVICE float ember_rms_factor(const float* row, uint32_t n_cols, float eps, double* scratch) {
    double sum = 0.0;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float square = row[c] * row[c];
        sum += (double)square;
    }
    sum = ember_block_sum_f64(sum, scratch);
    const float mean = (float)(sum / (double)n_cols);
    return 1.0f / sqrtf(mean + eps);
}
