// RMS normalisation.
#include "ember_compat.h"

// CPU op: for each row r of x [n_rows, n_cols]:
//   out[r, c] = x[r, c] / sqrt(mean_c(x[r, :]^2) + eps) * weight[c]
// One block per row (grid = n_rows), any block size up to 1024; the sum is accumulated in f32.
// `out` may alias `x`.
EMBER_KERNEL void ember_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t n_cols, float eps) {
    __shared__ float scratch[EMBER_MAX_WARPS];
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    float sum = 0.0f;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) sum += row[c] * row[c];
    sum = ember_block_sum(sum, scratch);
    const float inv = rsqrtf(sum / (float)n_cols + eps);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = row[c] * inv * weight[c];
}
