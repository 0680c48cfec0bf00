// Dequantisation of whole weight matrices to f16, for prefill: a quantised matrix is expanded
// into a scratch buffer and handed to a vendor GEMM (hipBLAS/cuBLAS, loaded at run time) when
// many tokens share it, where the expansion costs less than the GEMM saves.
//
// CPU op: out[r, c] = (f16) dequantise(W[r])[c] for r < n_rows, c < n_cols (round to nearest
// even). Launch: grid = n_rows, block = 256 (any size works).
#include "ember_quant.h"

template <typename F>
EMBER_DEVICE void ember_dequantize_f16(ember_half* out, const uint8_t* w, uint32_t n_cols) {
    const uint8_t* row = w + (size_t)blockIdx.x * ember_row_bytes<F>(n_cols);
    ember_half* out_row = out + (size_t)blockIdx.x * n_cols;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = __float2half(F::get(row, (int)(c / 32), (int)(c % 32)));
}

#define EMBER_DEQUANTIZE(name, format) \
    EMBER_KERNEL void name(ember_half* out, const uint8_t* w, uint32_t n_cols) { ember_dequantize_f16<format>(out, w, n_cols); }

EMBER_DEQUANTIZE(ember_dequantize_f16_bf16, EmberBF16)
EMBER_DEQUANTIZE(ember_dequantize_f16_q4_0, EmberQ4_0)
EMBER_DEQUANTIZE(ember_dequantize_f16_q4_1, EmberQ4_1)
EMBER_DEQUANTIZE(ember_dequantize_f16_q5_0, EmberQ5_0)
EMBER_DEQUANTIZE(ember_dequantize_f16_q5_1, EmberQ5_1)
EMBER_DEQUANTIZE(ember_dequantize_f16_q8_0, EmberQ8_0)
EMBER_DEQUANTIZE(ember_dequantize_f16_q2_k, EmberQ2_K)
EMBER_DEQUANTIZE(ember_dequantize_f16_q3_k, EmberQ3_K)
EMBER_DEQUANTIZE(ember_dequantize_f16_q4_k, EmberQ4_K)
EMBER_DEQUANTIZE(ember_dequantize_f16_q5_k, EmberQ5_K)
EMBER_DEQUANTIZE(ember_dequantize_f16_q6_k, EmberQ6_K)
