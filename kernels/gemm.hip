// Tiled GEMM for prefill when no vendor BLAS is available: out = x W^T with W [n_rows, n_cols] in
// a GGUF format and x [n_tokens, n_cols], out [n_tokens, n_rows] in f32 (row-major).
//
// CPU op: out[t, r] = sum_c dequantise(W[r])[c] * x[t, c], accumulated in f32 (in a different
// order than the CPU, so results agree to f32 rounding, not bit for bit).
// Each block computes a 64 (rows of W) x 64 (tokens) tile of out and walks the shared dimension
// 32 values (one quantisation group) at a time: the W tile is dequantised on the fly with the
// format's get() into shared memory, the x tile is copied there, and each of the 256 threads
// accumulates a 4 x 4 sub-tile in registers. n_cols must be a multiple of the format's block
// (32 or 256 values; any count for f32/f16/bf16); rows and tokens past the end are masked.
// Launch: grid = (ceil(n_rows / 64), ceil(n_tokens / 64)), block = 256.
#include "ember_quant.h"

#define EMBER_GEMM_TILE_ROWS 64
#define EMBER_GEMM_TILE_TOKENS 64
#define EMBER_GEMM_TILE_K 32
#define EMBER_GEMM_THREADS 256
static_assert(EMBER_GEMM_THREADS == EMBER_GEMM_TILE_ROWS * 4, "the W tile load gives each row 4 threads of 8 values");
static_assert(EMBER_GEMM_TILE_K == 32, "a K step is one quantisation group");

template <typename F>
EMBER_DEVICE void ember_gemm(float* out, const uint8_t* w, const float* x, uint32_t n_tokens, uint32_t n_rows, uint32_t n_cols) {
    // +1 column of padding: the stores of a warp (8 rows x 4 runs of 8 k) and the loads of the
    // inner loop then fall in distinct banks.
    __shared__ float w_tile[EMBER_GEMM_TILE_K][EMBER_GEMM_TILE_ROWS + 1];
    __shared__ float x_tile[EMBER_GEMM_TILE_K][EMBER_GEMM_TILE_TOKENS + 1];
    const uint32_t tid = threadIdx.x;
    const uint32_t row0 = blockIdx.x * EMBER_GEMM_TILE_ROWS;
    const uint32_t token0 = blockIdx.y * EMBER_GEMM_TILE_TOKENS;
    const size_t row_bytes = ember_row_bytes<F>(n_cols);
    // This thread's 4 x 4 outputs: rows tr + 16 i, tokens tt + 16 j of the tile.
    const uint32_t tr = tid % 16, tt = tid / 16;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (uint32_t k0 = 0; k0 < n_cols; k0 += EMBER_GEMM_TILE_K) {
        const int group = (int)(k0 / 32);
        {
            // Each thread dequantises 8 consecutive values of one row's group (64 rows x 4
            // threads), so the 8 get() calls share their block-header loads.
            const uint32_t r = tid / 4, l0 = (tid % 4) * 8;
            const uint32_t row = row0 + r;
            const uint8_t* w_row = w + (size_t)row * row_bytes;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t l = l0 + i;
                float v = 0.0f;
                if (row < n_rows && k0 + l < n_cols) v = F::get(w_row, group, (int)l);
                w_tile[l][r] = v;
            }
        }
#pragma unroll
        for (int e = 0; e < (EMBER_GEMM_TILE_TOKENS * EMBER_GEMM_TILE_K) / EMBER_GEMM_THREADS; ++e) {
            const uint32_t idx = tid + e * EMBER_GEMM_THREADS;
            const uint32_t t = idx / EMBER_GEMM_TILE_K, l = idx % EMBER_GEMM_TILE_K;
            const uint32_t token = token0 + t;
            float v = 0.0f;
            if (token < n_tokens && k0 + l < n_cols) v = x[(size_t)token * n_cols + k0 + l];
            x_tile[l][t] = v;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < EMBER_GEMM_TILE_K; ++k) {
            float wv[4], xv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) wv[i] = w_tile[k][tr + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) xv[j] = x_tile[k][tt + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += wv[i] * xv[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t token = token0 + tt + 16 * j;
        if (token >= n_tokens) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t row = row0 + tr + 16 * i;
            if (row < n_rows) out[(size_t)token * n_rows + row] = acc[i][j];
        }
    }
}

#define EMBER_GEMM(name, format) \
    EMBER_KERNEL void name(float* out, const uint8_t* w, const float* x, uint32_t n_tokens, uint32_t n_rows, uint32_t n_cols) { ember_gemm<format>(out, w, x, n_tokens, n_rows, n_cols); }

EMBER_GEMM(ember_gemm_f32, EmberF32)
EMBER_GEMM(ember_gemm_f16, EmberF16)
EMBER_GEMM(ember_gemm_bf16, EmberBF16)
EMBER_GEMM(ember_gemm_q4_0, EmberQ4_0)
EMBER_GEMM(ember_gemm_q4_1, EmberQ4_1)
EMBER_GEMM(ember_gemm_q5_0, EmberQ5_0)
EMBER_GEMM(ember_gemm_q5_1, EmberQ5_1)
EMBER_GEMM(ember_gemm_q8_0, EmberQ8_0)
EMBER_GEMM(ember_gemm_q2_k, EmberQ2_K)
EMBER_GEMM(ember_gemm_q3_k, EmberQ3_K)
EMBER_GEMM(ember_gemm_q4_k, EmberQ4_K)
EMBER_GEMM(ember_gemm_q5_k, EmberQ5_K)
EMBER_GEMM(ember_gemm_q6_k, EmberQ6_K)
