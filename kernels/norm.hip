// RMS normalisation.
#include "ember_compat.h"
#include "ember_norm.h"

// CPU op: for each row r of x [n_rows, n_cols]:
//   out[r, c] = x[r, c] * (1 / sqrt(mean_c(x[r, :]^2) + eps)) * weight[c]
// or, with a null weight, x[r, c] * (1 / sqrt(...)) (GGML's bare ggml_rms_norm, which Gemma 4
// applies to V and to its router input; the weighted form is that times weight[c]).
// The squares are summed in double and the mean rounded to f32 before eps is added, as ember's
// CPU backend (and GGML's) does, so both usually produce the same f32 scale bit for bit; the
// order of the additions still differs. One block per row (grid = n_rows), any block size up to
// 1024. `out` may alias `x`.
EMBER_KERNEL void ember_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t n_cols, float eps) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    const float scale = ember_rms_factor(row, n_cols, eps, scratch);
    if (weight == nullptr)
        for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = row[c] * scale;
    else
        for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = row[c] * scale * weight[c];
}

// Gemma 4's router input in one launch instead of a copy and three: out[r, c] = x[r, c] * s_r *
// scale * weight[c], s_r = ember_rms_factor of row r, the products rounded one at a time from
// the left, so with the block size of ember_rms_norm_f32 the values are bit for bit those of
// ember_rms_norm_f32 without a weight, then ember_scale_f32, then ember_mul_f32 broadcasting
// `weight` over the rows (GGML's ggml_rms_norm, ggml_scale, ggml_mul). One block per row. `out`
// may alias `x`.
EMBER_KERNEL void ember_rms_norm_scale_mul_f32(float* out, const float* x, const float* weight, uint32_t n_cols, float eps, float scale) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    const float factor = ember_rms_factor(row, n_cols, eps, scratch);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = row[c] * factor * scale * weight[c];
}

// RMS normalisation then a residual add, in one launch (Gemma 4's post-norms before each
// residual): x[r, c] = x[r, c] * s_r * weight[c] (s_r = ember_rms_factor of row r, the products
// of ember_rms_norm_f32), then dst[r, c] += x[r, c]. With the block size of ember_rms_norm_f32
// the values are bit for bit those of ember_rms_norm_f32 in place followed by ember_add_f32. One
// block per row; `dst` must not alias `x`.
EMBER_KERNEL void ember_rms_norm_add_f32(float* dst, float* x, const float* weight, uint32_t n_cols, float eps) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    float* row = x + (size_t)blockIdx.x * n_cols;
    float* dst_row = dst + (size_t)blockIdx.x * n_cols;
    const float factor = ember_rms_factor(row, n_cols, eps, scratch);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float normed = row[c] * factor * weight[c];
        row[c] = normed;
        dst_row[c] = dst_row[c] + normed;
    }
}

// Fused residual add and RMS normalisation (decode: one launch instead of two per transition).
// For each row r: x[r, c] += proj[r, c]; out[r, c] = rms_norm(x[r, :]) * weight[c].
// Thread t owns the same columns and sums its squares in the same order as ember_rms_norm_f32
// does with the same block size, and the sum goes through the same block reduction, so the
// result is bit for bit that of ember_add_f32 followed by ember_rms_norm_f32 (ops::add_rms_norm
// launches the block size ops::rms_norm would). One block per row. `out` must not alias `x`
// or `proj`.
//
// Tried and dropped: folding this launch into the one-token products that read `out` (Q/K/V,
// the dense gate/up, a MoE router), every block of those recomputing the factor in this
// kernel's summation order and block 0 writing the new residual to a second buffer. It was bit
// for bit (harness_matvec, greedy output on three models) but slower inside H100 decode graphs
// (same call, tg128: Llama 3 8B Q4_0 297 -> 264 t/s, Qwen3-30B-A3B 287 -> 275-282, 1B Q4_0
// 884-891 -> 827-868): each block then loads the row five times from L2 and waits for a block
// reduction before its first weight load, which costs more than the launch it saves.
EMBER_KERNEL void ember_add_rms_norm_f32(float* out, float* x, const float* proj, const float* weight, uint32_t n_cols, float eps) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    float* row = x + (size_t)blockIdx.x * n_cols;
    const float* proj_row = proj + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    double sum = 0.0;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float value = row[c] + proj_row[c];
        row[c] = value;
        const float square = value * value;
        sum += (double)square;
    }
    sum = ember_block_sum_f64(sum, scratch);
    const float mean = (float)(sum / (double)n_cols);
    const float scale = 1.0f / sqrtf(mean + eps);
    // Each thread reads back only the columns it wrote itself.
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = row[c] * scale * weight[c];
}

// Gemma 4's step from attention to its two FFN blocks in one launch instead of four. For each
// row r, with s(v) = ember_rms_factor of row v:
//   proj = proj * s(proj) * post_attn;  x = x + proj            (ember_rms_norm_add_f32)
//   xn = x * s(x) * ffn_norm                                    (ember_rms_norm_f32)
//   moe_in = x * s(x) * pre_norm                                (ember_rms_norm_f32)
//   router_in = x * s(x) * router_scale * router_weight         (ember_rms_norm_scale_mul_f32)
// Each line is the expression of the kernel named beside it and every factor sums in the order
// of ember_rms_norm_f32, so at the block size of those kernels the values are theirs bit for bit.
// Each thread reads back only the columns of x it wrote itself. One block per row; no output may
// alias another buffer.
EMBER_KERNEL void ember_gemma4_ffn_inputs_f32(float* x, float* proj, const float* post_attn, float* xn, const float* ffn_norm, float* moe_in,
                                             const float* pre_norm, float* router_in, const float* router_weight, uint32_t n_cols, float eps,
                                             float router_scale) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    const size_t base = (size_t)blockIdx.x * n_cols;
    float* proj_row = proj + base;
    float* x_row = x + base;
    const float attn_factor = ember_rms_factor(proj_row, n_cols, eps, scratch);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float normed = proj_row[c] * attn_factor * post_attn[c];
        proj_row[c] = normed;
        x_row[c] = x_row[c] + normed;
    }
    const float factor = ember_rms_factor(x_row, n_cols, eps, scratch);
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float v = x_row[c];
        xn[base + c] = v * factor * ffn_norm[c];
        moe_in[base + c] = v * factor * pre_norm[c];
        router_in[base + c] = v * factor * router_scale * router_weight[c];
    }
}
