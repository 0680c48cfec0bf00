// Kernel test harness for the element-wise, row-wise, embedding, dequantisation and GEMM kernels
// (attention and matvec have their own harnesses, harness_attention.cu and harness_matvec.cu):
// every kernel runs on random inputs and is compared with a plain C++ reference written here,
// independently of the kernel code (harness_common.h dequantises block by block following the
// GGUF layouts; sums are taken in double).
//
// Build and run on an NVIDIA machine (from the repository root), or use run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness.cu -o target/ember_kernel_harness
//   target/ember_kernel_harness
// Exit status 0 when every check passes. Tolerances are stated per check: f32 kernels whose only
// difference from the reference is summation order are held to a relative error of 1e-5 of the
// sum of magnitudes (which bounds reordering error), transcendental ones to 2e-5 absolute, and
// kernels that do the reference's own f32 arithmetic to 0 or to multiply-add fusion (2e-6).
#include "../memory.hip"
#include "../elementwise.hip"
#include "../norm.hip"
#include "../rope.hip"
#include "../softmax.hip"
#include "../argmax.hip"
#include "../embedding.hip"
#include "../dequantize.hip"
#include "../gemm.hip"

#include "harness_common.h"


// The CPU backend's GELU (engine/src/backend/cpu/ops.rs): f16 in, f16 out, exact limits.
static double gelu_ggml_reference(float x) {
    if (x <= -10.0f) return 0.0;
    if (x >= 10.0f) return x;
    const double h = from_half_bits(to_half_bits(x));
    const double g = 0.5 * h * (1.0 + std::tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)));
    return from_half_bits(to_half_bits((float)g));
}

static void test_elementwise() {
    const uint32_t n = 10000, n_b = 100;
    const std::vector<float> a = random_floats(n, -4, 4), b = random_floats(n, -4, 4), bb = random_floats(n_b);
    DeviceBuffer<float> da(a), db(b), dbb(bb), dout(n);
    std::vector<double> expected(n);

    ember_add_f32<<<40, 256>>>(dout.ptr, da.ptr, dbb.ptr, n, n_b);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = (double)(a[i] + bb[i % n_b]);
    report("add_f32 (broadcast)", max_abs_diff(dout.download(), expected), 0.0);

    ember_mul_f32<<<40, 256>>>(dout.ptr, da.ptr, db.ptr, n, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = (double)(a[i] * b[i]);
    report("mul_f32", max_abs_diff(dout.download(), expected), 0.0);

    ember_scale_f32<<<40, 256>>>(dout.ptr, da.ptr, 0.125f, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = a[i] * 0.125;
    report("scale_f32", max_abs_diff(dout.download(), expected), 0.0);

    ember_silu_mul_f32<<<40, 256>>>(dout.ptr, da.ptr, db.ptr, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = a[i] / (1.0 + std::exp(-(double)a[i])) * b[i];
    report("silu_mul_f32", max_abs_diff(dout.download(), expected), 2e-5);

    // Wide inputs to reach the exact limits at +-10 as well as the f16-rounded middle.
    const std::vector<float> wide = random_floats(n, -14, 14);
    DeviceBuffer<float> dwide(wide);
    ember_gelu_mul_f32<<<40, 256>>>(dout.ptr, dwide.ptr, db.ptr, n);
    sync();
    {
        const std::vector<float> out = dout.download();
        // Both sides round GELU to f16; tanhf may differ from tanh by an ulp, which can move the
        // rounded value by one f16 ulp (2^-11 relative): the tolerance is that, times |up| <= 4.
        double worst = 0.0;
        for (uint32_t i = 0; i < n; ++i) {
            const double e = gelu_ggml_reference(wide[i]) * b[i];
            const double ulp = std::fabs(gelu_ggml_reference(wide[i])) * std::ldexp(1.0, -10) * std::fabs(b[i]) + 1e-6;
            worst = std::fmax(worst, std::fabs(out[i] - e) / ulp);
        }
        report("gelu_mul_f32 (GGML CPU rounding, in f16 ulps)", worst, 1.0);
    }

    ember_softcap_f32<<<40, 256>>>(dout.ptr, dwide.ptr, 5.0f, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = 5.0 * std::tanh((double)wide[i] / 5.0);
    report("softcap_f32 (cap 5)", max_abs_diff(dout.download(), expected), 2e-6 * 5.0);

    // In place, as ops::softcap launches it.
    ember_softcap_f32<<<40, 256>>>(dwide.ptr, dwide.ptr, 30.0f, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = 30.0 * std::tanh((double)wide[i] / 30.0);
    report("softcap_f32 (cap 30, in place)", max_abs_diff(dwide.download(), expected), 2e-6 * 30.0);

    DeviceBuffer<uint16_t> dhalf(n);
    ember_convert_f16_f32<<<7, 256>>>((ember_half*)dhalf.ptr, da.ptr, n);
    sync();
    {
        const std::vector<uint16_t> bits = dhalf.download();
        uint32_t wrong = 0;
        for (uint32_t i = 0; i < n; ++i) wrong += bits[i] != to_half_bits(a[i]);
        report("convert_f16_f32 (values not rounded to nearest even)", wrong, 0.0);
    }

    DeviceBuffer<uint32_t> fill(5000);
    ember_fill_u32<<<3, 128>>>(fill.ptr, 0x9e3779b9u, 5000);
    sync();
    uint32_t wrong = 0;
    for (uint32_t v : fill.download()) wrong += v != 0x9e3779b9u;
    report("fill_u32 (wrong words)", wrong, 0.0);
}

static void test_norm_softmax_argmax() {
    const uint32_t n_rows = 7, n_cols = 2304;
    const std::vector<float> x = random_floats(n_rows * n_cols, -3, 3), w = random_floats(n_cols);
    DeviceBuffer<float> dx(x), dw(w), dout(n_rows * n_cols);
    std::vector<double> expected(n_rows * n_cols);

    ember_rms_norm_f32<<<n_rows, 256>>>(dout.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f);
    sync();
    for (uint32_t r = 0; r < n_rows; ++r) {
        double sum = 0.0;
        for (uint32_t c = 0; c < n_cols; ++c) sum += (double)x[r * n_cols + c] * x[r * n_cols + c];
        const double inv = 1.0 / std::sqrt(sum / n_cols + 1e-6);
        for (uint32_t c = 0; c < n_cols; ++c) expected[r * n_cols + c] = x[r * n_cols + c] * inv * w[c];
    }
    report("rms_norm_f32", max_abs_diff(dout.download(), expected), 1e-5);
    // In place with a 640-thread block (ops::rms_norm rounds the row length up to 64 lanes).
    ember_rms_norm_f32<<<n_rows, 640>>>(dx.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f);
    sync();
    report("rms_norm_f32 (in place, 640 threads)", max_abs_diff(dx.download(), expected), 1e-5);
    dx.upload(x);

    // Without a weight (Gemma 4's bare ggml_rms_norm of V and of the router input), then the
    // broadcast product of every row with one vector (its router input scale): the weighted
    // norm's values, in the same f32 order (x * scale, then * w).
    ember_rms_norm_f32<<<n_rows, 256>>>(dout.ptr, dx.ptr, nullptr, n_cols, 1e-6f);
    sync();
    for (uint32_t r = 0; r < n_rows; ++r) {
        double sum = 0.0;
        for (uint32_t c = 0; c < n_cols; ++c) sum += (double)x[r * n_cols + c] * x[r * n_cols + c];
        const double inv = 1.0 / std::sqrt(sum / n_cols + 1e-6);
        for (uint32_t c = 0; c < n_cols; ++c) expected[r * n_cols + c] = x[r * n_cols + c] * inv;
    }
    report("rms_norm_f32 (no weight)", max_abs_diff(dout.download(), expected), 1e-5);
    {
        DeviceBuffer<float> weighted(n_rows * n_cols);
        ember_rms_norm_f32<<<n_rows, 256>>>(weighted.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f);
        ember_mul_f32<<<64, 256>>>(dout.ptr, dout.ptr, dw.ptr, n_rows * n_cols, n_cols);
        sync();
        const std::vector<float> want = weighted.download(), got = dout.download();
        uint32_t differ = 0;
        for (size_t i = 0; i < want.size(); ++i) differ += want[i] != got[i];
        report("rms_norm_f32 (no weight) then mul_f32 (row broadcast) vs rms_norm_f32 (differing values)", differ, 0.0);
    }
    // The post-norm and the residual add in one launch against rms_norm then add_f32, with the
    // block sizes ops::rms_norm uses for short and wide rows.
    for (uint32_t threads : {256u, 1024u}) {
        const std::vector<float> residual = random_floats(n_rows * n_cols, -2, 2);
        DeviceBuffer<float> steps_x(x), steps_dst(residual), fused_x(x), fused_dst(residual);
        ember_rms_norm_f32<<<n_rows, threads>>>(steps_x.ptr, steps_x.ptr, dw.ptr, n_cols, 1e-6f);
        ember_add_f32<<<64, 256>>>(steps_dst.ptr, steps_dst.ptr, steps_x.ptr, n_rows * n_cols, n_rows * n_cols);
        ember_rms_norm_add_f32<<<n_rows, threads>>>(fused_dst.ptr, fused_x.ptr, dw.ptr, n_cols, 1e-6f);
        sync();
        uint32_t differ = 0;
        for (int k = 0; k < 2; ++k) {
            const std::vector<float> want = (k ? steps_dst : steps_x).download(), got = (k ? fused_dst : fused_x).download();
            for (size_t i = 0; i < want.size(); ++i) differ += std::memcmp(&want[i], &got[i], sizeof(float)) != 0;
        }
        report(threads == 256u ? "rms_norm_add_f32 vs rms_norm + add (differing values, 256 threads)"
                               : "rms_norm_add_f32 vs rms_norm + add (differing values, 1024 threads)",
               differ, 0.0);
    }
    // Gemma 4's router input in one launch against the bare norm, the scale and the row product
    // as three launches, with the block sizes ops::rms_norm uses for short and wide rows.
    for (uint32_t threads : {256u, 1024u}) {
        const float scale = 1.0f / std::sqrt((float)n_cols);
        DeviceBuffer<float> steps(n_rows * n_cols), fused(n_rows * n_cols);
        CHECK_CUDA(cudaMemset(fused.ptr, 0xff, (size_t)n_rows * n_cols * sizeof(float)));
        ember_rms_norm_f32<<<n_rows, threads>>>(steps.ptr, dx.ptr, nullptr, n_cols, 1e-6f);
        ember_scale_f32<<<64, 256>>>(steps.ptr, steps.ptr, scale, n_rows * n_cols);
        ember_mul_f32<<<64, 256>>>(steps.ptr, steps.ptr, dw.ptr, n_rows * n_cols, n_cols);
        ember_rms_norm_scale_mul_f32<<<n_rows, threads>>>(fused.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f, scale);
        sync();
        const std::vector<float> want = steps.download(), got = fused.download();
        uint32_t differ = 0;
        for (size_t i = 0; i < want.size(); ++i) differ += std::memcmp(&want[i], &got[i], sizeof(float)) != 0;
        report(threads == 256u ? "rms_norm_scale_mul_f32 vs rms_norm (no weight) + scale + mul (differing values, 256 threads)"
                               : "rms_norm_scale_mul_f32 vs rms_norm (no weight) + scale + mul (differing values, 1024 threads)",
               differ, 0.0);
    }

    // Gemma 4's step from attention to its FFN blocks in one launch against the four launches it
    // replaces (rms_norm_add, rms_norm twice, rms_norm_scale_mul), at both block sizes.
    for (uint32_t threads : {256u, 1024u}) {
        const std::vector<float> residual = random_floats(n_rows * n_cols, -2, 2), attn = random_floats(n_rows * n_cols, -3, 3);
        const std::vector<float> w_ffn = random_floats(n_cols), w_pre = random_floats(n_cols), w_router = random_floats(n_cols);
        DeviceBuffer<float> d_ffn(w_ffn), d_pre(w_pre), d_router(w_router);
        const float scale = 1.0f / std::sqrt((float)n_cols);
        DeviceBuffer<float> steps_x(residual), steps_proj(attn), fused_x(residual), fused_proj(attn);
        DeviceBuffer<float> steps_out[3] = {DeviceBuffer<float>(n_rows * n_cols), DeviceBuffer<float>(n_rows * n_cols),
                                            DeviceBuffer<float>(n_rows * n_cols)};
        DeviceBuffer<float> fused_out[3] = {DeviceBuffer<float>(n_rows * n_cols), DeviceBuffer<float>(n_rows * n_cols),
                                            DeviceBuffer<float>(n_rows * n_cols)};
        ember_rms_norm_add_f32<<<n_rows, threads>>>(steps_x.ptr, steps_proj.ptr, dw.ptr, n_cols, 1e-6f);
        ember_rms_norm_f32<<<n_rows, threads>>>(steps_out[0].ptr, steps_x.ptr, d_ffn.ptr, n_cols, 1e-6f);
        ember_rms_norm_f32<<<n_rows, threads>>>(steps_out[1].ptr, steps_x.ptr, d_pre.ptr, n_cols, 1e-6f);
        ember_rms_norm_scale_mul_f32<<<n_rows, threads>>>(steps_out[2].ptr, steps_x.ptr, d_router.ptr, n_cols, 1e-6f, scale);
        ember_gemma4_ffn_inputs_f32<<<n_rows, threads>>>(fused_x.ptr, fused_proj.ptr, dw.ptr, fused_out[0].ptr, d_ffn.ptr, fused_out[1].ptr,
                                                         d_pre.ptr, fused_out[2].ptr, d_router.ptr, n_cols, 1e-6f, scale);
        sync();
        uint32_t differ = 0;
        const DeviceBuffer<float>* want[5] = {&steps_x, &steps_proj, &steps_out[0], &steps_out[1], &steps_out[2]};
        const DeviceBuffer<float>* got[5] = {&fused_x, &fused_proj, &fused_out[0], &fused_out[1], &fused_out[2]};
        for (int k = 0; k < 5; ++k) {
            const std::vector<float> a = want[k]->download(), b = got[k]->download();
            for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
        }
        report(threads == 256u ? "gemma4_ffn_inputs_f32 vs rms_norm_add + rms_norm x2 + rms_norm_scale_mul (differing values, 256 threads)"
                               : "gemma4_ffn_inputs_f32 vs rms_norm_add + rms_norm x2 + rms_norm_scale_mul (differing values, 1024 threads)",
               differ, 0.0);
    }

    // Fused residual add + norm against add then rms_norm with the block size ops uses for this
    // row length (2304 -> 1024 threads) and a short-row one (640): bit-exact, same arithmetic.
    const std::vector<float> proj = random_floats(n_rows * n_cols, -3, 3);
    DeviceBuffer<float> dproj(proj), dfused(n_rows * n_cols), dsum(x);
    for (uint32_t threads : {1024u, 640u}) {
        dx.upload(x);
        dsum.upload(x);
        ember_add_f32<<<64, 256>>>(dx.ptr, dx.ptr, dproj.ptr, n_rows * n_cols, n_rows * n_cols);
        ember_rms_norm_f32<<<n_rows, threads>>>(dout.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f);
        ember_add_rms_norm_f32<<<n_rows, threads>>>(dfused.ptr, dsum.ptr, dproj.ptr, dw.ptr, n_cols, 1e-6f);
        sync();
        const std::vector<float> want = dout.download(), got = dfused.download();
        const std::vector<float> want_x = dx.download(), got_x = dsum.download();
        uint32_t differ = 0;
        for (size_t i = 0; i < want.size(); ++i) differ += want[i] != got[i] || want_x[i] != got_x[i];
        report(threads == 1024u ? "add_rms_norm_f32 vs add + rms_norm (differing values, 1024 threads)"
                                : "add_rms_norm_f32 vs add + rms_norm (differing values, 640 threads)",
               differ, 0.0);
    }
    dx.upload(x);

    ember_softmax_f32<<<n_rows, 512>>>(dout.ptr, dx.ptr, n_cols, 0.7f);
    sync();
    for (uint32_t r = 0; r < n_rows; ++r) {
        double m = -INFINITY, sum = 0.0;
        for (uint32_t c = 0; c < n_cols; ++c) m = std::fmax(m, 0.7 * x[r * n_cols + c]);
        for (uint32_t c = 0; c < n_cols; ++c) sum += std::exp(0.7 * x[r * n_cols + c] - m);
        for (uint32_t c = 0; c < n_cols; ++c) expected[r * n_cols + c] = std::exp(0.7 * x[r * n_cols + c] - m) / sum;
    }
    report("softmax_f32", max_abs_diff(dout.download(), expected), 1e-6);

    std::vector<float> logits = random_floats(n_rows * 49152, -10, 10);
    logits[3 * 49152 + 777] = 50.0f;  // a tie: the lower index must win
    logits[3 * 49152 + 40000] = 50.0f;
    logits[4 * 49152 + 5] = NAN;  // a row holding NaN: -1
    logits[5 * 49152 + 40000] = INFINITY;  // a row holding +inf: -1
    for (int c = 0; c < 49152; ++c) logits[6 * 49152 + c] = -INFINITY;  // nothing to choose: 0
    DeviceBuffer<float> dl(logits);
    DeviceBuffer<int32_t> didx(n_rows);
    // crates/gpu/src/ops/elementwise.rs: argmax (parts of EMBER_ARGMAX_PART values, then a merge).
    const uint32_t n_parts = (49152 + EMBER_ARGMAX_PART - 1) / EMBER_ARGMAX_PART;
    DeviceBuffer<float> part_values(n_rows * n_parts);
    DeviceBuffer<int32_t> part_indices(n_rows * n_parts);
    ember_argmax_partial_f32<<<dim3(n_rows, n_parts), 256>>>(part_values.ptr, part_indices.ptr, dl.ptr, 49152);
    ember_argmax_merge_f32<<<n_rows, 256>>>(didx.ptr, part_values.ptr, part_indices.ptr, n_parts);
    sync();
    const std::vector<int32_t> idx = didx.download();
    uint32_t wrong = 0;
    for (uint32_t r = 0; r < n_rows; ++r) {
        // engine/src/sample.rs: greedy_token (the first largest, -inf never chosen), or -1 for a
        // row that logits_are_sane refuses (NaN or +inf).
        int best = 0;
        float best_value = -INFINITY;
        bool bad = false;
        for (int c = 0; c < 49152; ++c) {
            const float v = logits[r * 49152 + c];
            bad |= !(v < INFINITY);
            if (v > best_value) best = c, best_value = v;
        }
        wrong += idx[r] != (bad ? -1 : best);
    }
    report("argmax over parts (wrong rows, ties to lowest across parts, NaN/+inf rows -1, -inf rows 0)", wrong, 0.0);
}

static void test_rope() {
    const uint32_t n_tokens = 5, n_heads = 4, head_dim = 128, n_dims = 96;
    const float base = 10000.0f, freq_scale = 0.5f;
    const std::vector<float> x = random_floats(n_tokens * n_heads * head_dim);
    const std::vector<int32_t> pos = {0, 1, 17, 1000, 32767};
    const std::vector<float> factors = random_floats(n_dims / 2, 1.0f, 8.0f);
    // The CPU backend's f32 constant (engine/src/backend/cpu/mod.rs): base^(-2 / n_dims).
    const float theta_scale = std::pow(base, -2.0f / (float)n_dims);
    for (int variant = 0; variant < 4; ++variant) {
        const bool neox = variant & 1, with_factors = variant & 2;
        DeviceBuffer<float> dx(x), df(factors);
        DeviceBuffer<int32_t> dp(pos);
        const float* f = with_factors ? df.ptr : nullptr;
        if (neox) ember_rope_neox_f32<<<n_tokens * n_heads, 32>>>(dx.ptr, dp.ptr, f, n_heads, head_dim, n_dims, theta_scale, freq_scale);
        else ember_rope_norm_f32<<<n_tokens * n_heads, 32>>>(dx.ptr, dp.ptr, f, n_heads, head_dim, n_dims, theta_scale, freq_scale);
        sync();
        std::vector<double> expected(x.begin(), x.end());
        for (uint32_t t = 0; t < n_tokens; ++t)
            for (uint32_t h = 0; h < n_heads; ++h) {
                const size_t base_index = ((size_t)t * n_heads + h) * head_dim;
                float theta_base = (float)pos[t];
                for (uint32_t i = 0; i < n_dims / 2; ++i) {
                    // The CPU table's f32 angle, then cos/sin in double.
                    const float factor = with_factors ? factors[i] : 1.0f;
                    const double theta = freq_scale * (theta_base / factor);
                    theta_base *= theta_scale;
                    const size_t ia = neox ? base_index + i : base_index + 2 * i;
                    const size_t ib = neox ? base_index + i + n_dims / 2 : base_index + 2 * i + 1;
                    expected[ia] = x[ia] * std::cos(theta) - x[ib] * std::sin(theta);
                    expected[ib] = x[ia] * std::sin(theta) + x[ib] * std::cos(theta);
                }
            }
        // Same f32 angle on both sides; cosf/sinf of angles up to ~1.6e4 rad are within a few
        // ulps of the angle's magnitude-scaled error (2^-24 * 1.6e4 = 1e-3 worst case).
        const std::string name = std::string(neox ? "rope_neox_f32" : "rope_norm_f32") + (with_factors ? " (freq factors)" : "") + ", n_dims < head_dim";
        report(name, max_abs_diff(dx.download(), expected), 1e-3);
    }

    // Fused rope(q) + rope(k) + K/V store against the separate rope launches and the f16 store
    // rule of ember_kv_store_f16 (round to nearest even): the same expressions, so q, k and both
    // caches must match bit for bit (differing values counted, tolerance 0). 5 tokens of 4 q heads
    // and 2 kv heads; 2 blocks of 4 slots. Token 2 has no slot (-1) and tokens 0 and 4 land in
    // block 1, which has no V memory: all three are skipped, as ember_kv_store_f16 skips them.
    {
        const uint32_t n_kv_heads = 2, block_size = 4, row = n_kv_heads * head_dim;
        const std::vector<float> k = random_floats(n_tokens * row), v = random_floats(n_tokens * row);
        const std::vector<int32_t> slots = {5, 0, -1, 2, 7};  // blocks 1, 0, none, 0, 1
        // Variants 2 and 3 add the QK-norm: per-head weights for q and k, the separate path
        // normalising first with ember_rms_norm_f32 at the block size ops::rms_norm takes for
        // head_dim (128) and the fused kernel launched with that size too.
        const std::vector<float> qw = random_floats(head_dim, 0.5f, 1.5f), kw = random_floats(head_dim, 0.5f, 1.5f);
        const uint32_t norm_threads = 128;
        const float eps = 1e-6f;
        for (int variant = 0; variant < 4; ++variant) {
            const bool neox = variant & 1, normed = variant & 2;
            DeviceBuffer<float> dq(x), dk(k), dv(v), rq(x), rk(k), df(factors), dqw(qw), dkw(kw);
            DeviceBuffer<int32_t> dp(pos), ds(slots);
            const float* qn = normed ? dqw.ptr : nullptr;
            const float* kn = normed ? dkw.ptr : nullptr;
            const uint32_t threads = normed ? norm_threads : 64;
            if (normed) {
                ember_rms_norm_f32<<<n_tokens * n_heads, norm_threads>>>(rq.ptr, rq.ptr, dqw.ptr, head_dim, eps);
                ember_rms_norm_f32<<<n_tokens * n_kv_heads, norm_threads>>>(rk.ptr, rk.ptr, dkw.ptr, head_dim, eps);
            }
            // Zeroed caches of 2 blocks; block 0 has K and V memory, block 1 only K memory.
            DeviceBuffer<uint16_t> kc((size_t)2 * block_size * row), vc((size_t)2 * block_size * row);
            const std::vector<uint64_t> kt = {(uint64_t)(uintptr_t)kc.ptr, (uint64_t)(uintptr_t)(kc.ptr + block_size * row)};
            const std::vector<uint64_t> vt = {(uint64_t)(uintptr_t)vc.ptr, 0};
            DeviceBuffer<uint64_t> dkt(kt), dvt(vt);
            if (neox) {
                ember_rope_neox_f32<<<n_tokens * n_heads, 32>>>(rq.ptr, dp.ptr, df.ptr, n_heads, head_dim, n_dims, theta_scale, freq_scale);
                ember_rope_neox_f32<<<n_tokens * n_kv_heads, 32>>>(rk.ptr, dp.ptr, df.ptr, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale);
                ember_rope_kv_store_neox_f32<<<n_tokens * (n_heads + n_kv_heads), threads>>>(
                    dq.ptr, dk.ptr, dv.ptr, dp.ptr, df.ptr, n_tokens, n_heads, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale,
                    dkt.ptr, dvt.ptr, ds.ptr, block_size, qn, kn, eps);
            } else {
                ember_rope_norm_f32<<<n_tokens * n_heads, 32>>>(rq.ptr, dp.ptr, df.ptr, n_heads, head_dim, n_dims, theta_scale, freq_scale);
                ember_rope_norm_f32<<<n_tokens * n_kv_heads, 32>>>(rk.ptr, dp.ptr, df.ptr, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale);
                ember_rope_kv_store_norm_f32<<<n_tokens * (n_heads + n_kv_heads), threads>>>(
                    dq.ptr, dk.ptr, dv.ptr, dp.ptr, df.ptr, n_tokens, n_heads, n_kv_heads, head_dim, n_dims, theta_scale, freq_scale,
                    dkt.ptr, dvt.ptr, ds.ptr, block_size, qn, kn, eps);
            }
            sync();
            const std::vector<float> gq = dq.download(), wq = rq.download(), gk = dk.download(), wk = rk.download();
            const std::vector<uint16_t> gkc = kc.download(), gvc = vc.download();
            uint32_t differ = 0;
            for (size_t i = 0; i < gq.size(); ++i) differ += std::memcmp(&gq[i], &wq[i], 4) != 0;
            for (size_t i = 0; i < gk.size(); ++i) differ += std::memcmp(&gk[i], &wk[i], 4) != 0;
            std::vector<uint16_t> want_k(gkc.size(), 0), want_v(gvc.size(), 0);
            for (uint32_t t = 0; t < n_tokens; ++t) {
                const int32_t slot = slots[t];
                if (slot < 0 || (uint32_t)slot / block_size >= 1) continue;  // block 1 has no V memory: skipped
                for (uint32_t c = 0; c < row; ++c) {
                    want_k[(size_t)slot * row + c] = to_half_bits(wk[(size_t)t * row + c]);
                    want_v[(size_t)slot * row + c] = to_half_bits(v[(size_t)t * row + c]);
                }
            }
            for (size_t i = 0; i < gkc.size(); ++i) differ += gkc[i] != want_k[i];
            for (size_t i = 0; i < gvc.size(); ++i) differ += gvc[i] != want_v[i];
            const std::string name = std::string(neox ? "rope_kv_store_neox_f32" : "rope_kv_store_norm_f32") + " vs " +
                                     (normed ? "rms_norm(q) + rms_norm(k) + " : "") + "rope + rope + f16 store (differing values)";
            report(name, differ, 0.0);
        }
    }
}

typedef void (*GetRowsKernel)(float*, const uint8_t*, const int32_t*, uint32_t, uint32_t, float);
static const GetRowsKernel GET_ROWS[] = {ember_get_rows_f32,  ember_get_rows_f16,  ember_get_rows_bf16, ember_get_rows_q4_0, ember_get_rows_q4_1,
                                         ember_get_rows_q5_0, ember_get_rows_q5_1, ember_get_rows_q8_0, ember_get_rows_q2_k, ember_get_rows_q3_k,
                                         ember_get_rows_q4_k, ember_get_rows_q5_k, ember_get_rows_q6_k};
typedef void (*GemmKernel)(float*, const uint8_t*, const float*, uint32_t, uint32_t, uint32_t);
static const GemmKernel GEMM[] = {ember_gemm_f32,  ember_gemm_f16,  ember_gemm_bf16, ember_gemm_q4_0, ember_gemm_q4_1, ember_gemm_q5_0, ember_gemm_q5_1,
                                  ember_gemm_q8_0, ember_gemm_q2_k, ember_gemm_q3_k, ember_gemm_q4_k, ember_gemm_q5_k, ember_gemm_q6_k};

static void test_get_rows() {
    for (int fi = 0; fi <= Q6_K; ++fi) {
        const Format f = (Format)fi;
        const int n_rows = 67, n_cols = 1024;
        const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
        DeviceBuffer<uint8_t> dw(w);
        // 67 and -1 are out of range: their rows must come back as NaN.
        const std::vector<int32_t> ids = {5, 0, 66, 5, 31, 67, -1};
        DeviceBuffer<int32_t> dids(ids);
        DeviceBuffer<float> dout(ids.size() * n_cols);
        const float scale = 0.375f;
        GET_ROWS[fi]<<<(unsigned)ids.size(), 256>>>(dout.ptr, dw.ptr, dids.ptr, n_rows, n_cols, scale);
        sync();
        const std::vector<float> out = dout.download();
        double worst = 0.0;
        uint32_t not_nan = 0;
        for (size_t t = 0; t < ids.size(); ++t) {
            if (ids[t] < 0 || ids[t] >= n_rows) {
                for (int c = 0; c < n_cols; ++c) not_nan += !std::isnan(out[t * n_cols + c]);
                continue;
            }
            const std::vector<float> row = dequant_row(f, w.data() + ids[t] * row_bytes_of(f, n_cols), n_cols);
            for (int c = 0; c < n_cols; ++c) worst = std::fmax(worst, std::fabs((double)out[t * n_cols + c] - (double)(row[c] * scale)));
        }
        // The same f32 arithmetic on both sides, up to multiply-add fusion on the device.
        report(std::string("get_rows_") + FORMATS[f].name + " (scale 0.375)", worst, 2e-6);
        report(std::string("get_rows_") + FORMATS[f].name + " (out-of-range ids: values not NaN)", not_nan, 0.0);
    }

    const uint32_t dim = 300, n_src = 9;
    const std::vector<float> src = random_floats(n_src * dim);
    const std::vector<int32_t> rows = {8, 0, 3, 3};
    DeviceBuffer<float> dsrc(src), dout(rows.size() * dim);
    DeviceBuffer<int32_t> drows(rows);
    ember_gather_rows_f32<<<(unsigned)rows.size(), 256>>>(dout.ptr, dsrc.ptr, drows.ptr, dim);
    sync();
    std::vector<double> expected(rows.size() * dim);
    for (size_t i = 0; i < rows.size(); ++i)
        for (uint32_t c = 0; c < dim; ++c) expected[i * dim + c] = src[rows[i] * dim + c];
    report("gather_rows_f32", max_abs_diff(dout.download(), expected), 0.0);
}

typedef void (*DequantizeKernel)(ember_half*, const uint8_t*, uint32_t);

static void test_dequantize() {
    // Indexed by Format; f32 and f16 weights need no expansion kernel.
    const DequantizeKernel kernels[] = {nullptr,
                                        nullptr,
                                        ember_dequantize_f16_bf16,
                                        ember_dequantize_f16_q4_0,
                                        ember_dequantize_f16_q4_1,
                                        ember_dequantize_f16_q5_0,
                                        ember_dequantize_f16_q5_1,
                                        ember_dequantize_f16_q8_0,
                                        ember_dequantize_f16_q2_k,
                                        ember_dequantize_f16_q3_k,
                                        ember_dequantize_f16_q4_k,
                                        ember_dequantize_f16_q5_k,
                                        ember_dequantize_f16_q6_k};
    // The last case is bf16 rows of 300 values: not a multiple of 8, so the one-value loop runs.
    for (int fi = BF16; fi <= Q6_K + 1; ++fi) {
        const Format f = fi > Q6_K ? BF16 : (Format)fi;
        const int n_rows = 9, n_cols = fi > Q6_K ? 300 : 512;
        const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
        DeviceBuffer<uint8_t> dw(w);
        DeviceBuffer<uint16_t> dout((size_t)n_rows * n_cols);
        kernels[f]<<<n_rows, 256>>>((ember_half*)dout.ptr, dw.ptr, n_cols);
        sync();
        const std::vector<uint16_t> out = dout.download();
        double worst = 0.0;
        for (int r = 0; r < n_rows; ++r) {
            const std::vector<float> row = dequant_row(f, w.data() + r * row_bytes_of(f, n_cols), n_cols);
            for (int c = 0; c < n_cols; ++c) {
                // f16 rounding: half an ulp is 2^-11 of the value, plus the 2e-6 of multiply-add fusion.
                const double error = std::fabs((double)from_half_bits(out[(size_t)r * n_cols + c]) - row[c]);
                worst = std::fmax(worst, error / (std::fabs(row[c]) * std::ldexp(1.0, -11) + 2e-6));
            }
        }
        report(std::string("dequantize_f16_") + FORMATS[f].name + " " + std::to_string(n_cols) + " columns (in units of f16 rounding)", worst, 1.0);
    }
}

static void test_gemm() {
    // 67 rows and 100 tokens are not multiples of the 64 x 64 tile: the masked edges are tested.
    const int n_rows = 67, n_cols = 512;
    for (int fi = 0; fi <= Q6_K; ++fi) {
        const Format f = (Format)fi;
        const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
        std::vector<std::vector<float>> rows(n_rows);
        for (int r = 0; r < n_rows; ++r) rows[r] = dequant_row(f, w.data() + r * row_bytes_of(f, n_cols), n_cols);
        DeviceBuffer<uint8_t> dw(w);
        double worst = 0.0;
        for (int n_tokens : {1, 7, 64, 100}) {
            const std::vector<float> x = random_floats((size_t)n_tokens * n_cols);
            DeviceBuffer<float> dx(x), dout((size_t)n_tokens * n_rows);
            dim3 grid((n_rows + EMBER_GEMM_TILE_ROWS - 1) / EMBER_GEMM_TILE_ROWS, (n_tokens + EMBER_GEMM_TILE_TOKENS - 1) / EMBER_GEMM_TILE_TOKENS);
            GEMM[fi]<<<grid, EMBER_GEMM_THREADS>>>(dout.ptr, dw.ptr, dx.ptr, n_tokens, n_rows, n_cols);
            sync();
            const std::vector<float> out = dout.download();
            for (int t = 0; t < n_tokens; ++t)
                for (int r = 0; r < n_rows; ++r) {
                    double sum = 0.0, magnitude = 0.0;
                    for (int c = 0; c < n_cols; ++c) {
                        sum += (double)rows[r][c] * x[(size_t)t * n_cols + c];
                        magnitude += std::fabs((double)rows[r][c] * x[(size_t)t * n_cols + c]);
                    }
                    worst = std::fmax(worst, std::fabs(out[(size_t)t * n_rows + r] - sum) / (magnitude + 1e-30));
                }
        }
        report(std::string("gemm_") + FORMATS[f].name + " (1/7/64/100 tokens, relative to sum |w x|)", worst, 1e-5);
    }
}

static void benchmark_gemm(Format f, int n_rows, int n_cols, int n_tokens) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    DeviceBuffer<uint8_t> dw(w);
    DeviceBuffer<float> dx(random_floats((size_t)n_tokens * n_cols)), dout((size_t)n_tokens * n_rows);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    dim3 grid((n_rows + EMBER_GEMM_TILE_ROWS - 1) / EMBER_GEMM_TILE_ROWS, (n_tokens + EMBER_GEMM_TILE_TOKENS - 1) / EMBER_GEMM_TILE_TOKENS);
    GEMM[f]<<<grid, EMBER_GEMM_THREADS>>>(dout.ptr, dw.ptr, dx.ptr, n_tokens, n_rows, n_cols);
    const int iterations = 5;
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < iterations; ++i) GEMM[f]<<<grid, EMBER_GEMM_THREADS>>>(dout.ptr, dw.ptr, dx.ptr, n_tokens, n_rows, n_cols);
    CHECK_CUDA(cudaEventRecord(stop));
    sync();
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    const double seconds = ms / 1000.0 / iterations;
    std::printf("INFO gemm_%s %dx%dx%d (tiled fallback): %.2f ms, %.1f TFLOP/s\n", FORMATS[f].name, n_rows, n_cols, n_tokens, seconds * 1e3,
                2.0 * n_rows * n_cols * n_tokens / seconds / 1e12);
}

int main() {
    test_elementwise();
    test_norm_softmax_argmax();
    test_rope();
    test_get_rows();
    test_dequantize();
    test_gemm();
    benchmark_gemm(Q4_0, 4096, 4096, 512);
    benchmark_gemm(Q4_K, 4096, 4096, 512);
    benchmark_gemm(F16, 4096, 4096, 512);
    return finish("harness");
}
