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

// CPU op (GeGLU, Gemma): out[i] = gelu(gate[i]) * up[i] with GGML's CPU GELU:
//   gelu(x) = 0 for x <= -10, x for x >= 10, else f16(gelu_tanh(f16(x))),
//   gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))).
// GGML's CPU path looks GELU up in a table indexed by the f16 input and holding f16 results;
// rounding the same way here keeps the GPU's activations equal to ember's CPU backend (which
// mirrors GGML) up to tanhf's last bit.
EMBER_KERNEL void ember_gelu_mul_f32(float* out, const float* gate, const float* up, uint32_t n) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        float gelu;
        if (g <= -10.0f) {
            gelu = 0.0f;
        } else if (g >= 10.0f) {
            gelu = g;
        } else {
            const float h = __half2float(__float2half(g));
            gelu = 0.5f * h * (1.0f + tanhf(sqrt_2_over_pi * h * (1.0f + 0.044715f * h * h)));
            gelu = __half2float(__float2half(gelu));
        }
        out[i] = gelu * up[i];
    }
}

// CPU op (Gemma 2 soft-capping): out[i] = cap * tanh(x[i] / cap). `out` may alias `x`.
EMBER_KERNEL void ember_softcap_f32(float* out, const float* x, float cap, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = cap * tanhf(x[i] / cap);
}

// CPU op: out[i] = (f16) x[i], rounded to nearest even (activations for the f16 GEMM).
EMBER_KERNEL void ember_convert_f16_f32(ember_half* out, const float* x, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = __float2half(x[i]);
}
