// Rotary position embeddings, in place on x [n_tokens, n_heads, head_dim].
//
// Token t is at position positions[t]. For pair index i in [0, n_dims / 2):
//   theta_i = freq_scale * (p * theta_scale^i / freq_factors[i]),  theta_scale = base^(-2 / n_dims),
// with theta_scale^i built by i repeated f32 multiplications of p, exactly as GGML's CPU tables
// (and ember's CPU backend) compute it, so the angles agree bit for bit before cos/sin.
// freq_factors is null when the model has none (every factor 1). The pair (a, b) becomes
// (a cos theta - b sin theta, a sin theta + b cos theta):
//   * "norm" (llama): the pair is (x[2i], x[2i + 1]);
//   * "neox" (gemma, qwen, ...): the pair is (x[i], x[i + n_dims / 2]).
// Values at or beyond n_dims are left unchanged (partial rotary embeddings).
// Launch: grid = n_tokens * n_heads (one block per head), any block size.
#include "ember_compat.h"
#include "ember_norm.h"

EMBER_DEVICE void ember_rope_angle(int position, uint32_t i, float theta_scale, float freq_scale, const float* freq_factors, float* c, float* s) {
    float theta_base = (float)position;
    for (uint32_t j = 0; j < i; ++j) theta_base *= theta_scale;
    const float factor = freq_factors ? freq_factors[i] : 1.0f;
    const float theta = freq_scale * (theta_base / factor);
    *c = cosf(theta);
    *s = sinf(theta);
}

EMBER_KERNEL void ember_rope_norm_f32(float* x, const int32_t* positions, const float* freq_factors, uint32_t n_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float freq_scale) {
    const uint32_t token = blockIdx.x / n_heads;
    float* v = x + (size_t)blockIdx.x * head_dim;
    for (uint32_t i = threadIdx.x; i < n_dims / 2; i += blockDim.x) {
        float c, s;
        ember_rope_angle(positions[token], i, theta_scale, freq_scale, freq_factors, &c, &s);
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * c - b * s;
        v[2 * i + 1] = a * s + b * c;
    }
}

EMBER_KERNEL void ember_rope_neox_f32(float* x, const int32_t* positions, const float* freq_factors, uint32_t n_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float freq_scale) {
    const uint32_t token = blockIdx.x / n_heads;
    float* v = x + (size_t)blockIdx.x * head_dim;
    const uint32_t half_dims = n_dims / 2;
    for (uint32_t i = threadIdx.x; i < half_dims; i += blockDim.x) {
        float c, s;
        ember_rope_angle(positions[token], i, theta_scale, freq_scale, freq_factors, &c, &s);
        const float a = v[i], b = v[i + half_dims];
        v[i] = a * c - b * s;
        v[i + half_dims] = a * s + b * c;
    }
}

// Fused decode step after the Q/K/V projections: rope of the q heads, rope of the k heads, and
// the store of the roped k row and the v row into the paged KV cache as f16 (what
// ember_rope_*_f32 twice and attention.hip's ember_kv_store_f16 do, in one launch). Every value
// goes through the same expressions as in those kernels, so q, k and the cache get the same bits.
// q [n_tokens, n_heads, head_dim] and k [n_tokens, n_kv_heads, head_dim] are rotated in place;
// v [n_tokens, n_kv_heads, head_dim]. Token t goes to slot slots[t] (block slots[t] / block_size
// of k_blocks / v_blocks, u64 addresses), skipped when negative or when either block address is
// 0, as ember_kv_store_f16 does. With q_norm / k_norm (QK-norm: Qwen3, Gemma 3 and 4, Qwen 3.5)
// each q / k head is first RMS-normalised in place and multiplied by the weight, as
// norm.hip's ember_rms_norm_f32 does with one block per head: launched with that kernel's block
// size for head_dim (ops::rope_kv_store does), the sums run in its order and the values are its
// bits. A null weight skips that norm. Launch: grid = n_tokens * (n_heads + n_kv_heads), one
// block per head (q heads first), any block size (the norm's when a weight is given).
template <bool NEOX>
EMBER_DEVICE void ember_rope_pair(uint32_t i, uint32_t half_dims, uint32_t* ia, uint32_t* ib) {
    *ia = NEOX ? i : 2 * i;
    *ib = NEOX ? i + half_dims : 2 * i + 1;
}

// The head's norm in place (see above); every thread of the block calls it (it has barriers).
EMBER_DEVICE void ember_head_norm(float* x, const float* weight, uint32_t head_dim, float eps, double* scratch) {
    if (weight == nullptr) return;  // the same for the whole block
    const float factor = ember_rms_factor(x, head_dim, eps, scratch);
    for (uint32_t c = threadIdx.x; c < head_dim; c += blockDim.x) x[c] = x[c] * factor * weight[c];
    __syncthreads();  // rope pairs read values other threads wrote
}

template <bool NEOX>
EMBER_DEVICE void ember_rope_kv_store(float* q, float* k, const float* v, const int32_t* positions, const float* freq_factors,
                                      uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t n_dims,
                                      float theta_scale, float freq_scale, const uint64_t* k_blocks, const uint64_t* v_blocks,
                                      const int32_t* slots, uint32_t block_size, const float* q_norm, const float* k_norm,
                                      float eps) {
    __shared__ double scratch[EMBER_MAX_WARPS];
    const uint32_t half_dims = n_dims / 2;
    const uint32_t q_heads = n_tokens * n_heads;
    if (blockIdx.x < q_heads) {
        const uint32_t token = blockIdx.x / n_heads;
        float* x = q + (size_t)blockIdx.x * head_dim;
        ember_head_norm(x, q_norm, head_dim, eps, scratch);
        for (uint32_t i = threadIdx.x; i < half_dims; i += blockDim.x) {
            float c, s;
            ember_rope_angle(positions[token], i, theta_scale, freq_scale, freq_factors, &c, &s);
            uint32_t ia, ib;
            ember_rope_pair<NEOX>(i, half_dims, &ia, &ib);
            const float a = x[ia], b = x[ib];
            x[ia] = a * c - b * s;
            x[ib] = a * s + b * c;
        }
        return;
    }
    const uint32_t kv_head = blockIdx.x - q_heads;
    const uint32_t token = kv_head / n_kv_heads, head = kv_head % n_kv_heads;
    float* x = k + (size_t)kv_head * head_dim;
    const float* vx = v + (size_t)kv_head * head_dim;
    ember_head_norm(x, k_norm, head_dim, eps, scratch);
    ember_half* k_out = nullptr;
    ember_half* v_out = nullptr;
    const int32_t slot = slots[token];
    if (slot >= 0) {
        const uint32_t block = (uint32_t)slot / block_size, offset = (uint32_t)slot % block_size;
        k_out = (ember_half*)k_blocks[block];
        v_out = (ember_half*)v_blocks[block];
        if (k_out == nullptr || v_out == nullptr) {
            k_out = v_out = nullptr;
        } else {
            const size_t at = (size_t)offset * n_kv_heads * head_dim + (size_t)head * head_dim;
            k_out += at;
            v_out += at;
        }
    }
    for (uint32_t i = threadIdx.x; i < half_dims; i += blockDim.x) {
        float c, s;
        ember_rope_angle(positions[token], i, theta_scale, freq_scale, freq_factors, &c, &s);
        uint32_t ia, ib;
        ember_rope_pair<NEOX>(i, half_dims, &ia, &ib);
        const float a = x[ia], b = x[ib];
        const float ra = a * c - b * s, rb = a * s + b * c;
        x[ia] = ra;
        x[ib] = rb;
        if (k_out) {
            k_out[ia] = __float2half_rn(ra);
            k_out[ib] = __float2half_rn(rb);
        }
    }
    if (k_out) {
        // The values past n_dims are not rotated; each thread stores only values no other
        // thread writes.
        for (uint32_t c = n_dims + threadIdx.x; c < head_dim; c += blockDim.x) k_out[c] = __float2half_rn(x[c]);
        for (uint32_t c = threadIdx.x; c < head_dim; c += blockDim.x) v_out[c] = __float2half_rn(vx[c]);
    }
}

EMBER_KERNEL void ember_rope_kv_store_norm_f32(float* q, float* k, const float* v, const int32_t* positions, const float* freq_factors,
                                               uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                               uint32_t n_dims, float theta_scale, float freq_scale, const uint64_t* k_blocks,
                                               const uint64_t* v_blocks, const int32_t* slots, uint32_t block_size,
                                               const float* q_norm, const float* k_norm, float eps) {
    ember_rope_kv_store<false>(q, k, v, positions, freq_factors, n_tokens, n_heads, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale,
                               k_blocks, v_blocks, slots, block_size, q_norm, k_norm, eps);
}

EMBER_KERNEL void ember_rope_kv_store_neox_f32(float* q, float* k, const float* v, const int32_t* positions, const float* freq_factors,
                                               uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                               uint32_t n_dims, float theta_scale, float freq_scale, const uint64_t* k_blocks,
                                               const uint64_t* v_blocks, const int32_t* slots, uint32_t block_size,
                                               const float* q_norm, const float* k_norm, float eps) {
    ember_rope_kv_store<true>(q, k, v, positions, freq_factors, n_tokens, n_heads, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale,
                              k_blocks, v_blocks, slots, block_size, q_norm, k_norm, eps);
}
