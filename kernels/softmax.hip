// Row-wise softmax.
#include "ember_compat.h"

// CPU op: for each row r of x [n_rows, n_cols]:
//   out[r, c] = exp(scale x[r, c] - m) / sum_c exp(scale x[r, c] - m),  m = max_c scale x[r, c]
// One block per row, any block size up to 1024. `out` may alias `x`.
EMBER_KERNEL void ember_softmax_f32(float* out, const float* x, uint32_t n_cols, float scale) {
    __shared__ float scratch[EMBER_MAX_WARPS];
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    float m = -INFINITY;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) m = fmaxf(m, row[c] * scale);
    m = ember_block_max(m, scratch);
    float sum = 0.0f;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float e = expf(row[c] * scale - m);
        out_row[c] = e;
        sum += e;
    }
    sum = ember_block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] *= inv;
}
