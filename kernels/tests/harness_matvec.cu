// Matvec harness: every ember_matvec_* kernel of kernels/matvec.hip (and ember_quantize_q8_1) on
// random blocks of every format, 1..8 tokens, odd row counts and grids smaller than one row per
// warp, against a double-precision CPU reference; then the weight bandwidth of the decode shapes
// of a Llama-3-8B (14336x4096 and 4096x14336).
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_matvec.cu -o target/harness_matvec
//   target/harness_matvec
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section.
//
// Tolerances. The int8 kernels compute W x̂ where x̂ = d q is the activation quantised per group
// of 32 (d = max|x| / 127, q = round(x / d)); the reference reproduces x̂ bit for bit (same f32
// operations) and then sums in double, so the two differ only by f32 rounding inside the kernel:
// a handful of roundings per 32-value unit plus the per-lane and warp sums (under 40 roundings
// for the rows here), each at most 2^-24 relative to the magnitudes involved. Those magnitudes
// include the offset terms that cancel (q4_0's -8 d, q4_1's m, the k-quants' dmin * min), so the
// check is |y - W x̂| <= 1e-5 * sum_i (|w_i| + |offset_i|) |x̂_i|  (1e-5 > 40 * 2^-24 = 2.4e-6).
// Against the unquantised x the kernels may differ further by the quantisation itself,
// |W (x - x̂)| <= sum_groups (d / 2) sum_{i in group} |w_i|, which is checked too (that bound is
// what the int8 path trades for reading the weights with integer dot products). The float path
// (f32, f16, bf16, q2_K, q3_K) has x̂ = x and the same 1e-5 relative bound.
#include "../matvec.hip"

#include "harness_common.h"

typedef void (*Int8Kernel)(float*, const uint8_t*, const int8_t*, const float2*, uint32_t, uint32_t, uint32_t);
typedef void (*FloatKernel)(float*, const uint8_t*, const float*, uint32_t, uint32_t, uint32_t);

struct MatvecKernels {
    Int8Kernel int8[4];  // t1, t2, t4, t8
    FloatKernel float_path[2];  // t1, t8
};

// Indexed by Format.
static const MatvecKernels KERNELS[] = {
    {{nullptr}, {ember_matvec_f32_t1, ember_matvec_f32_t8}},
    {{nullptr}, {ember_matvec_f16_t1, ember_matvec_f16_t8}},
    {{nullptr}, {ember_matvec_bf16_t1, ember_matvec_bf16_t8}},
    {{ember_matvec_q4_0_t1, ember_matvec_q4_0_t2, ember_matvec_q4_0_t4, ember_matvec_q4_0_t8}, {nullptr}},
    {{ember_matvec_q4_1_t1, ember_matvec_q4_1_t2, ember_matvec_q4_1_t4, ember_matvec_q4_1_t8}, {nullptr}},
    {{ember_matvec_q5_0_t1, ember_matvec_q5_0_t2, ember_matvec_q5_0_t4, ember_matvec_q5_0_t8}, {nullptr}},
    {{ember_matvec_q5_1_t1, ember_matvec_q5_1_t2, ember_matvec_q5_1_t4, ember_matvec_q5_1_t8}, {nullptr}},
    {{ember_matvec_q8_0_t1, ember_matvec_q8_0_t2, ember_matvec_q8_0_t4, ember_matvec_q8_0_t8}, {nullptr}},
    {{nullptr}, {ember_matvec_q2_k_t1, ember_matvec_q2_k_t8}},
    {{nullptr}, {ember_matvec_q3_k_t1, ember_matvec_q3_k_t8}},
    {{ember_matvec_q4_k_t1, ember_matvec_q4_k_t2, ember_matvec_q4_k_t4, ember_matvec_q4_k_t8}, {nullptr}},
    {{ember_matvec_q5_k_t1, ember_matvec_q5_k_t2, ember_matvec_q5_k_t4, ember_matvec_q5_k_t8}, {nullptr}},
    {{ember_matvec_q6_k_t1, ember_matvec_q6_k_t2, ember_matvec_q6_k_t4, ember_matvec_q6_k_t8}, {nullptr}},
};

static bool is_int8(Format f) { return KERNELS[f].int8[0] != nullptr; }

// Variants of the exported kernels with other lanes-per-row counts (the exported ones use
// EMBER_MATVEC_LANES): tested for correctness and timed, to choose the exported value.
template <typename F, int NT, int LANES>
__global__ void variant_int8(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    ember_matvec_int8<F, NT, LANES>(y, w, xq, xds, n_rows, n_cols, n_tokens);
}
template <typename F, int NT, int LANES>
__global__ void variant_float(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    ember_matvec_float<F, NT, LANES>(y, w, x, n_rows, n_cols, n_tokens);
}

// A kernel configuration: the exported kernel (lanes 0) or a variant, and its block size.
struct Variant {
    int lanes, threads;
};

template <int NT, int LANES>
static void launch_variant(Format f, int grid, int threads, float* y, const uint8_t* w, const float* x, const int8_t* xq, const float2* xds,
                           int n_rows, int n_cols, int tokens) {
    switch (f) {
        case Q4_0: variant_int8<EmberMvQ4_0, NT, LANES><<<grid, threads>>>(y, w, xq, xds, n_rows, n_cols, tokens); break;
        case Q8_0: variant_int8<EmberMvQ8_0, NT, LANES><<<grid, threads>>>(y, w, xq, xds, n_rows, n_cols, tokens); break;
        case Q4_K: variant_int8<EmberMvQ4_K, NT, LANES><<<grid, threads>>>(y, w, xq, xds, n_rows, n_cols, tokens); break;
        case Q5_K: variant_int8<EmberMvQ5_K, NT, LANES><<<grid, threads>>>(y, w, xq, xds, n_rows, n_cols, tokens); break;
        case Q6_K: variant_int8<EmberMvQ6_K, NT, LANES><<<grid, threads>>>(y, w, xq, xds, n_rows, n_cols, tokens); break;
        case F16: variant_float<EmberMvF16, NT, LANES><<<grid, threads>>>(y, w, x, n_rows, n_cols, tokens); break;
        default: std::fprintf(stderr, "no variant kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

// The kernel ops::matvec launches for `tokens` tokens (crates/gpu/src/ops/matvec.rs kernel_name).
static int kernel_slot(Format f, int tokens) {
    if (is_int8(f)) return tokens == 1 ? 0 : tokens == 2 ? 1 : tokens <= 4 ? 2 : 3;
    return tokens == 1 ? 0 : 1;
}

static void launch(Format f, int tokens, int grid, float* y, const uint8_t* w, const float* x, const int8_t* xq, const float2* xds,
                   int n_rows, int n_cols, Variant variant = {0, EMBER_MATVEC_THREADS}) {
    const int slot = kernel_slot(f, tokens);
    if (variant.lanes == 0) {
        if (is_int8(f)) KERNELS[f].int8[slot]<<<grid, EMBER_MATVEC_THREADS>>>(y, w, xq, xds, n_rows, n_cols, tokens);
        else KERNELS[f].float_path[slot]<<<grid, EMBER_MATVEC_THREADS>>>(y, w, x, n_rows, n_cols, tokens);
        return;
    }
    // Variants are compiled for 1 and 8 tokens.
    const int t = variant.threads;
    if (tokens == 1) {
        if (variant.lanes == 8) launch_variant<1, 8>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
        else if (variant.lanes == 16) launch_variant<1, 16>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
        else launch_variant<1, 32>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
    } else {
        if (variant.lanes == 8) launch_variant<8, 8>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
        else if (variant.lanes == 16) launch_variant<8, 16>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
        else launch_variant<8, 32>(f, grid, t, y, w, x, xq, xds, n_rows, n_cols, tokens);
    }
}

// Blocks that give every row group one row.
static int grid_for(int n_rows, Variant variant) {
    const int lanes = variant.lanes ? variant.lanes : EMBER_MATVEC_LANES;
    const int rows_per_block = variant.threads / lanes;
    return (n_rows + rows_per_block - 1) / rows_per_block;
}

// The magnitude of the offset term that the kernel adds to (and that may cancel against) the
// scaled integer part of value c of a row.
static double offset_magnitude(Format f, const uint8_t* row, int c) {
    const FormatInfo& info = FORMATS[f];
    const uint8_t* b = row + (size_t)(c / info.block_values) * info.block_bytes;
    switch (f) {
        case Q4_0: return 8.0 * half_at(b);
        case Q5_0: return 16.0 * half_at(b);
        case Q4_1:
        case Q5_1: return std::fabs(half_at(b + 2));
        case Q4_K:
        case Q5_K: {
            int scale, min;
            scale_min_k4((c % 256) / 32, b + 4, &scale, &min);
            return half_at(b + 2) * (double)min;
        }
        default: return 0.0;
    }
}

// Host twin of ember_quantize_q8_1: the same f32 operations, so x̂ matches bit for bit.
static void quantize_reference(const std::vector<float>& x, std::vector<int8_t>& q, std::vector<float>& d, std::vector<float>& s) {
    const size_t n_groups = x.size() / 32;
    q.assign(x.size(), 0);
    d.assign(n_groups, 0.0f);
    s.assign(n_groups, 0.0f);
    for (size_t g = 0; g < n_groups; ++g) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[32 * g + i]));
        d[g] = amax / 127.0f;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
            const int v = amax > 0.0f ? (int)std::nearbyint(x[32 * g + i] * (127.0f / amax)) : 0;
            q[32 * g + i] = (int8_t)v;
            sum += v;
        }
        s[g] = d[g] * (float)sum;
    }
}

static void test_quantize() {
    const int n_values = 32 * 1000;
    std::vector<float> x = random_floats(n_values, -3, 3);
    for (int i = 0; i < 32; ++i) x[64 + i] = 0.0f;  // an all-zero group
    for (int i = 96; i < 128; ++i) x[i] *= 1e-3f;   // a small one
    DeviceBuffer<float> dx(x);
    DeviceBuffer<int8_t> dq(n_values);
    DeviceBuffer<float2> dds(n_values / 32);
    ember_quantize_q8_1<<<(n_values + 255) / 256, 256>>>(dq.ptr, dds.ptr, dx.ptr, n_values);
    sync();
    std::vector<int8_t> q;
    std::vector<float> d, s;
    quantize_reference(x, q, d, s);
    const std::vector<int8_t> gq = dq.download();
    const std::vector<float2> gds = dds.download();
    uint32_t wrong = 0;
    for (int i = 0; i < n_values; ++i) wrong += gq[i] != q[i];
    for (int g = 0; g < n_values / 32; ++g) wrong += gds[g].x != d[g] || gds[g].y != s[g];
    report("quantize_q8_1 (values and scales not bit-exact)", wrong, 0.0);
}

static void test_format(Format f, int n_rows, int n_cols, Variant variant = {0, EMBER_MATVEC_THREADS}) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t row_bytes = row_bytes_of(f, n_cols);
    std::vector<std::vector<float>> rows(n_rows);
    std::vector<std::vector<double>> offsets(n_rows, std::vector<double>(n_cols));
    for (int r = 0; r < n_rows; ++r) {
        rows[r] = dequant_row(f, w.data() + r * row_bytes, n_cols);
        for (int c = 0; c < n_cols; ++c) offsets[r][c] = offset_magnitude(f, w.data() + r * row_bytes, c);
    }
    DeviceBuffer<uint8_t> dw(w);
    double worst_kernel = 0.0, worst_bound = 0.0;
    for (int tokens = 1; tokens <= 8; ++tokens) {
        if (variant.lanes && tokens != 1 && tokens != 8) continue;  // variants exist for 1 and 8 tokens
        // Groups of very different amplitude, so the per-group scales differ.
        std::vector<float> x((size_t)tokens * n_cols);
        for (size_t g = 0; g < x.size() / 32; ++g) {
            const float amplitude = std::pow(10.0f, uniform(-2, 1));
            for (int i = 0; i < 32; ++i) x[32 * g + i] = amplitude * uniform(-1, 1);
        }
        std::vector<int8_t> q;
        std::vector<float> d, s;
        quantize_reference(x, q, d, s);
        DeviceBuffer<float> dx(x), dy((size_t)tokens * n_rows);
        DeviceBuffer<int8_t> dq(x.size());
        DeviceBuffer<float2> dds(x.size() / 32);
        ember_quantize_q8_1<<<(unsigned)((x.size() + 255) / 256), 256>>>(dq.ptr, dds.ptr, dx.ptr, (uint32_t)x.size());
        // One row per row group, and a grid of 3 blocks that must stride over the rows.
        for (int grid : {grid_for(n_rows, variant), 3}) {
            CHECK_CUDA(cudaMemset(dy.ptr, 0xff, (size_t)tokens * n_rows * sizeof(float)));
            launch(f, tokens, grid, dy.ptr, dw.ptr, dx.ptr, dq.ptr, dds.ptr, n_rows, n_cols, variant);
            sync();
            const std::vector<float> y = dy.download();
            for (int t = 0; t < tokens; ++t)
                for (int r = 0; r < n_rows; ++r) {
                    double quantised = 0.0, exact = 0.0, magnitude = 0.0, quantisation = 0.0;
                    for (int c = 0; c < n_cols; ++c) {
                        const size_t i = (size_t)t * n_cols + c;
                        const double xh = is_int8(f) ? (double)d[i / 32] * q[i] : (double)x[i];
                        quantised += (double)rows[r][c] * xh;
                        exact += (double)rows[r][c] * x[i];
                        magnitude += (std::fabs((double)rows[r][c]) + offsets[r][c]) * std::fabs(xh);
                        if (is_int8(f)) quantisation += 0.5 * d[i / 32] * std::fabs((double)rows[r][c]);
                    }
                    const double got = y[(size_t)t * n_rows + r];
                    const double tolerance = 1e-5 * magnitude + 1e-30;
                    worst_kernel = std::fmax(worst_kernel, std::fabs(got - quantised) / tolerance);
                    worst_bound = std::fmax(worst_bound, std::fabs(got - exact) / (quantisation + tolerance));
                }
        }
    }
    char name[160], what[48] = "1..8 tokens";
    if (variant.lanes) std::snprintf(what, sizeof what, "%d lanes/row, %d threads, 1+8 tokens", variant.lanes, variant.threads);
    std::snprintf(name, sizeof name, "matvec_%s %dx%d, %s: |y - W x^| / (1e-5 sum |w x^|)", FORMATS[f].name, n_rows, n_cols, what);
    report(name, worst_kernel, 1.0);
    std::snprintf(name, sizeof name, "matvec_%s %dx%d, %s: |y - W x| / quantisation bound", FORMATS[f].name, n_rows, n_cols, what);
    report(name, worst_bound, 1.0);
}

// Weight bandwidth: median of 50 launches (CUDA events around each), cycling through enough
// copies of the matrix that none is still in L2 when it is read again. One matrix serves every
// (token count, kernel configuration) run of a shape.
static void benchmark(Format f, int n_rows, int n_cols, const std::vector<std::pair<int, Variant>>& runs) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t bytes = w.size();
    const size_t copies = std::max<size_t>(2, (size_t)std::ceil(3.0 * 64e6 / (double)bytes));
    std::vector<DeviceBuffer<uint8_t>*> matrices;
    for (size_t i = 0; i < copies; ++i) matrices.push_back(new DeviceBuffer<uint8_t>(w));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (const auto& run : runs) {
        const int tokens = run.first;
        const Variant variant = run.second;
        const std::vector<float> x = random_floats((size_t)tokens * n_cols);
        DeviceBuffer<float> dx(x), dy((size_t)tokens * n_rows);
        DeviceBuffer<int8_t> dq(x.size());
        DeviceBuffer<float2> dds(x.size() / 32);
        const int grid = grid_for(n_rows, variant);
        std::vector<float> samples, quantize_samples;
        for (int i = 0; i < 55; ++i) {
            CHECK_CUDA(cudaEventRecord(start));
            ember_quantize_q8_1<<<(unsigned)((x.size() + 255) / 256), 256>>>(dq.ptr, dds.ptr, dx.ptr, (uint32_t)x.size());
            CHECK_CUDA(cudaEventRecord(stop));
            CHECK_CUDA(cudaEventSynchronize(stop));
            float quantize_ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&quantize_ms, start, stop));
            CHECK_CUDA(cudaEventRecord(start));
            launch(f, tokens, grid, dy.ptr, matrices[i % copies]->ptr, dx.ptr, dq.ptr, dds.ptr, n_rows, n_cols, variant);
            CHECK_CUDA(cudaEventRecord(stop));
            CHECK_CUDA(cudaEventSynchronize(stop));
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
            if (i >= 5) {  // the first launches load the module and warm the clocks
                samples.push_back(ms);
                quantize_samples.push_back(quantize_ms);
            }
        }
        sync();
        const double seconds = median(samples) / 1e3;
        char config[48] = "exported";
        if (variant.lanes) std::snprintf(config, sizeof config, "%2d lanes/row %3d threads", variant.lanes, variant.threads);
        char quantize[48] = "";
        if (is_int8(f)) std::snprintf(quantize, sizeof quantize, " (+ quantize %.1f us)", median(quantize_samples) * 1e3);
        std::printf("INFO matvec_%-5s %5dx%-5d %d token(s) [%s]: %7.1f us, %6.0f GB/s of weights%s\n", FORMATS[f].name, n_rows, n_cols, tokens,
                    config, seconds * 1e6, bytes / seconds / 1e9, quantize);
    }
    for (auto* m : matrices) delete m;
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

int main() {
    test_quantize();
    for (int fi = F32; fi <= Q6_K; ++fi) {
        test_format((Format)fi, 37, 768);
        test_format((Format)fi, 101, 2048);
    }
    const Variant variants[] = {{8, 128}, {16, 128}, {32, 128}, {8, 256}, {16, 256}, {32, 256}};
    for (Format f : {Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, F16})
        for (const Variant& v : variants) test_format(f, 37, 768, v);
    if (std::getenv("EMBER_HARNESS_NO_TIMING") == nullptr) {
        // The exported kernels for every format, then other lanes-per-row counts and block sizes
        // (to choose EMBER_MATVEC_LANES) for the formats that matter most.
        const Variant exported = {0, EMBER_MATVEC_THREADS};
        for (int fi = F32; fi <= Q6_K; ++fi) {
            const Format f = (Format)fi;
            const bool tuned = f == Q4_0 || f == Q8_0 || f == Q4_K || f == Q5_K || f == Q6_K || f == F16;
            for (int shape = 0; shape < 2; ++shape) {
                std::vector<std::pair<int, Variant>> runs = {{1, exported}};
                if (shape == 0 && (f == Q4_0 || f == Q4_K || f == Q6_K)) runs.insert(runs.end(), {{2, exported}, {8, exported}});
                if (tuned)
                    for (const Variant& v : variants) runs.push_back({1, v});
                if (shape == 0 && (f == Q4_0 || f == Q4_K))
                    for (const Variant& v : variants) runs.push_back({8, v});
                if (shape == 0) benchmark(f, 14336, 4096, runs);
                else benchmark(f, 4096, 14336, runs);
            }
        }
    }
    return finish("harness_matvec");
}
