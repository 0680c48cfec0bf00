// Element-wise ops on f32 tensors. Each kernel is a grid-stride loop over `n` elements, so any
// launch size is correct; the engine launches ceil(n / 256) blocks of 256 threads.
#include "ember_compat.h"

// CPU op: out[i] = a[i] + b[i % n_b]  (b broadcasts when n_b divides n; n_b == n is plain add).
EMBER_KERNEL void ember_add_f32(float* out, const float* a, const float* b, uint32_t n, uint32_t n_b) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] + b[i % n_b];
}

// CPU op: out[i] = a[i] * b[i % n_b].
EMBER_KERNEL void ember_mul_f32(float* out, const float* a, const float* b, uint32_t n, uint32_t n_b) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] * b[i % n_b];
}

// CPU op: out[i] = x[i] * scale.
EMBER_KERNEL void ember_scale_f32(float* out, const float* x, float scale, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = x[i] * scale;
}

// CPU op (SwiGLU): out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
EMBER_KERNEL void ember_silu_mul_f32(float* out, const float* gate, const float* up, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// CPU op (GeGLU, Gemma): out[i] = gelu_tanh(gate[i]) * up[i],
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
EMBER_KERNEL void ember_gelu_mul_f32(float* out, const float* gate, const float* up, uint32_t n) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        const float gelu = 0.5f * g * (1.0f + tanhf(sqrt_2_over_pi * (g + 0.044715f * g * g * g)));
        out[i] = gelu * up[i];
    }
}
