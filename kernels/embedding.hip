// Embedding lookup (get_rows) from a possibly quantised table, and row gathers of f32 buffers.
//
// CPU op (get_rows): out[t, c] = dequantise(table row ids[t])[c] * scale for t < n_ids,
// c < n_cols. The table has n_rows rows of n_cols values (a multiple of 32, and of 256 for
// k-quants) in the named format. An id outside [0, n_rows) yields a row of NaNs instead of a read
// outside the table, so a bad token id shows up in the logits rather than faulting the GPU.
// Launch: grid = n_ids, block = 256 (any size works).
#include "ember_quant.h"

template <typename F>
EMBER_DEVICE void ember_get_rows(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_rows, uint32_t n_cols, float scale) {
    const int32_t id = ids[blockIdx.x];
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    if (id < 0 || (uint32_t)id >= n_rows) {
        for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = NAN;
        return;
    }
    const uint8_t* row = table + (size_t)id * ember_row_bytes<F>(n_cols);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = F::get(row, (int)(c / 32), (int)(c % 32)) * scale;
}

#define EMBER_GET_ROWS(name, format) \
    EMBER_KERNEL void name(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_rows, uint32_t n_cols, float scale) { ember_get_rows<format>(out, table, ids, n_rows, n_cols, scale); }

EMBER_GET_ROWS(ember_get_rows_f32, EmberF32)
EMBER_GET_ROWS(ember_get_rows_f16, EmberF16)
EMBER_GET_ROWS(ember_get_rows_bf16, EmberBF16)
EMBER_GET_ROWS(ember_get_rows_q4_0, EmberQ4_0)
EMBER_GET_ROWS(ember_get_rows_q4_1, EmberQ4_1)
EMBER_GET_ROWS(ember_get_rows_q5_0, EmberQ5_0)
EMBER_GET_ROWS(ember_get_rows_q5_1, EmberQ5_1)
EMBER_GET_ROWS(ember_get_rows_q8_0, EmberQ8_0)
EMBER_GET_ROWS(ember_get_rows_q2_k, EmberQ2_K)
EMBER_GET_ROWS(ember_get_rows_q3_k, EmberQ3_K)
EMBER_GET_ROWS(ember_get_rows_q4_k, EmberQ4_K)
EMBER_GET_ROWS(ember_get_rows_q5_k, EmberQ5_K)
EMBER_GET_ROWS(ember_get_rows_q6_k, EmberQ6_K)

// CPU op (gather_rows): out[i, c] = src[rows[i], c] for i < n (grid), c < dim. Used to pick the
// rows whose logits are wanted (the last token of each sequence) before the output matmul.
// Launch: grid = n, block = 256 (any size works).
EMBER_KERNEL void ember_gather_rows_f32(float* out, const float* src, const int32_t* rows, uint32_t dim) {
    const float* src_row = src + (size_t)rows[blockIdx.x] * dim;
    float* out_row = out + (size_t)blockIdx.x * dim;
    for (uint32_t c = threadIdx.x; c < dim; c += blockDim.x) out_row[c] = src_row[c];
}

// gather_rows of the rows first, first + stride, first + 2 stride, ...: out[i, c] = src[first +
// i * stride, c]. The same copy with no row list to upload, so a layer loop can take such slices
// inside a recorded graph (Gemma 4's per-layer inputs, one layer's slice of every token; a plain
// copy with stride 1). Launch: grid = n, block = 256 (any size works).
EMBER_KERNEL void ember_gather_rows_strided_f32(float* out, const float* src, uint32_t first, uint32_t stride, uint32_t dim) {
    const float* src_row = src + ((size_t)first + (size_t)blockIdx.x * stride) * dim;
    float* out_row = out + (size_t)blockIdx.x * dim;
    for (uint32_t c = threadIdx.x; c < dim; c += blockDim.x) out_row[c] = src_row[c];
}
