// Dequantisation of whole weight matrices to f16, for prefill: a quantised matrix is expanded
// into a scratch buffer and handed to a vendor GEMM (hipBLAS/cuBLAS, loaded at run time) when
// many tokens share it, where the expansion costs less than the GEMM saves.
//
// CPU op: out[r, c] = (f16) dequantise(W[r])[c] for r < n_rows, c < n_cols (round to nearest
// even). Launch: grid = n_rows, block = 256 (any size works).
//
// Each thread expands 8 consecutive values of one group and stores them as one 16-byte write, so
// the block-header loads of the 8 get() calls are shared and the stores are full transactions.
// Rows whose length is not a multiple of 8 (possible for bf16 only) take the one-value loop.
#include "ember_quant.h"

template <typename F>
EMBER_DEVICE void ember_dequantize_f16(ember_half* out, const uint8_t* w, uint32_t n_cols) {
    const uint8_t* row = w + (size_t)blockIdx.x * ember_row_bytes<F>(n_cols);
    ember_half* out_row = out + (size_t)blockIdx.x * n_cols;
    if (n_cols % 8 == 0) {
        for (uint32_t c = threadIdx.x * 8; c < n_cols; c += blockDim.x * 8) {
            const int g = (int)(c / 32), l = (int)(c % 32);
            uint32_t words[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t lo = __half_as_ushort(__float2half(F::get(row, g, l + 2 * i)));
                const uint32_t hi = __half_as_ushort(__float2half(F::get(row, g, l + 2 * i + 1)));
                words[i] = lo | (hi << 16);
            }
            *(uint4*)(out_row + c) = make_uint4(words[0], words[1], words[2], words[3]);
        }
        return;
    }
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
