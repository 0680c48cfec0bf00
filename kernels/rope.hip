// Rotary position embeddings, in place on x [n_tokens, n_heads, head_dim].
//
// For pair index i in [0, rope_dim / 2): theta = position * freq_scale * freq_base^(-2i / rope_dim),
// and the pair (a, b) becomes (a cos theta - b sin theta, a sin theta + b cos theta).
//   * "norm" (llama): the pair is (x[2i], x[2i + 1]);
//   * "neox" (gemma, qwen, ...): the pair is (x[i], x[i + rope_dim / 2]).
// Dimensions at or beyond rope_dim are left unchanged.
// Launch: grid = n_tokens * n_heads, block = rope_dim / 2 threads (at most 512).
#include "ember_compat.h"

EMBER_DEVICE void ember_rope_angle(int position, uint32_t i, uint32_t rope_dim, float freq_base, float freq_scale, float* c, float* s) {
    const float theta = (float)position * freq_scale * powf(freq_base, -2.0f * (float)i / (float)rope_dim);
    sincosf(theta, s, c);
}

EMBER_KERNEL void ember_rope_norm_f32(float* x, const int32_t* positions, uint32_t n_heads, uint32_t head_dim, uint32_t rope_dim, float freq_base, float freq_scale) {
    const uint32_t token = blockIdx.x / n_heads;
    float* v = x + (size_t)blockIdx.x * head_dim;
    for (uint32_t i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        float c, s;
        ember_rope_angle(positions[token], i, rope_dim, freq_base, freq_scale, &c, &s);
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * c - b * s;
        v[2 * i + 1] = a * s + b * c;
    }
}

EMBER_KERNEL void ember_rope_neox_f32(float* x, const int32_t* positions, uint32_t n_heads, uint32_t head_dim, uint32_t rope_dim, float freq_base, float freq_scale) {
    const uint32_t token = blockIdx.x / n_heads;
    float* v = x + (size_t)blockIdx.x * head_dim;
    const uint32_t half_dim = rope_dim / 2;
    for (uint32_t i = threadIdx.x; i < half_dim; i += blockDim.x) {
        float c, s;
        ember_rope_angle(positions[token], i, rope_dim, freq_base, freq_scale, &c, &s);
        const float a = v[i], b = v[i + half_dim];
        v[i] = a * c - b * s;
        v[i + half_dim] = a * s + b * c;
    }
}
