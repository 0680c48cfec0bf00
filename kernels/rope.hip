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
