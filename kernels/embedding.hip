// Embedding lookup (get_rows) from a possibly quantised table.
//
// CPU op: out[t, c] = dequantise(table row ids[t])[c] for t < n_ids, c < n_cols. The table has
// n_cols values per row (a multiple of 32, and of 256 for k-quants) in the named format.
// Launch: grid = n_ids, block = 256 (any size works).
#include "ember_quant.h"

template <typename F>
EMBER_DEVICE void ember_get_rows(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_cols) {
    const uint8_t* row = table + (size_t)ids[blockIdx.x] * ember_row_bytes<F>(n_cols);
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = F::get(row, (int)(c / 32), (int)(c % 32));
}

#define EMBER_GET_ROWS(name, format) \
    EMBER_KERNEL void name(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_cols) { ember_get_rows<format>(out, table, ids, n_cols); }

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
