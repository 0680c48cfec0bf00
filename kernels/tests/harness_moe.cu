// Mixture-of-experts combine harness: ember_moe_combine_f32 of kernels/moe.hip on random inputs,
// without and with per-expert output scales (Gemma 4's ffn_down_exps.scale), against a plain C++
// reference of the CPU backend's order (engine/src/backend/cpu/moe.rs): each expert's output row
// times its scale, rounded to f32, then times the routing weight, rounded to f32, and the terms
// added in rank order from the first. Every step is one f32 operation in both, so the check is
// bit-exact (differing values: 0).
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_moe.cu -o target/harness_moe
//   target/harness_moe
// Exit status 0 when every check passes.
#include "../moe.hip"

#include "harness_common.h"

// One f32 product, kept out of any multiply-add contraction by the host compiler.
static float mul_f32(float a, float b) {
    volatile float p = a * b;
    return p;
}

static void test_combine(uint32_t n_tokens, uint32_t n_used, uint32_t n_expert, uint32_t n_embd, bool scaled) {
    const std::vector<float> routed = random_floats((size_t)n_tokens * n_used * n_embd, -3, 3);
    const std::vector<float> weights = random_floats((size_t)n_tokens * n_used, 0, 1);
    const std::vector<float> scale = random_floats(n_expert, -2, 2);
    std::vector<int32_t> experts((size_t)n_tokens * n_used);
    for (uint32_t t = 0; t < n_tokens; ++t)
        for (uint32_t k = 0; k < n_used; ++k) {
            // Distinct experts per token, as the router picks them.
            int32_t e;
            bool taken;
            do {
                e = uniform_int(0, (int)n_expert - 1);
                taken = false;
                for (uint32_t j = 0; j < k; ++j) taken |= experts[(size_t)t * n_used + j] == e;
            } while (taken);
            experts[(size_t)t * n_used + k] = e;
        }
    DeviceBuffer<float> drouted(routed), dweights(weights), dscale(scale), dout((size_t)n_tokens * n_embd);
    DeviceBuffer<int32_t> dexperts(experts);
    const dim3 grid((n_embd + 255) / 256, n_tokens);
    ember_moe_combine_f32<<<grid, 256>>>(dout.ptr, drouted.ptr, dweights.ptr, dexperts.ptr, scaled ? dscale.ptr : nullptr, n_embd, n_used);
    CHECK_CUDA(cudaGetLastError());
    sync();
    const std::vector<float> got = dout.download();
    uint32_t differ = 0;
    for (uint32_t t = 0; t < n_tokens; ++t)
        for (uint32_t c = 0; c < n_embd; ++c) {
            float o = 0.0f;
            for (uint32_t k = 0; k < n_used; ++k) {
                const size_t pair = (size_t)t * n_used + k;
                float y = routed[pair * n_embd + c];
                if (scaled) y = mul_f32(y, scale[experts[pair]]);
                const float term = mul_f32(y, weights[pair]);
                o = k == 0 ? term : o + term;
            }
            differ += o != got[(size_t)t * n_embd + c];
        }
    char name[160];
    std::snprintf(name, sizeof name, "moe_combine_f32 %u tokens, %u of %u experts, n_embd %u%s (differing values)", n_tokens, n_used, n_expert,
                  n_embd, scaled ? ", per-expert scales" : "");
    report(name, differ, 0.0);
}

int main() {
    // Qwen3-30B-A3B's routing (8 of 128, n_embd 2048) and Gemma 4 26B-A4B's (8 of 128, n_embd
    // 2816, with scales); a decode-sized and a prompt-sized batch; a width that is not a multiple
    // of the block.
    for (bool scaled : {false, true}) {
        test_combine(1, 8, 128, 2048, scaled);
        test_combine(37, 8, 128, 2816, scaled);
        test_combine(5, 2, 4, 300, scaled);
    }
    return finish("harness_moe");
}
