// Mmq harness: the kernels of kernels/mmq.hip for every format they cover, both products (the
// int8 tensor-core path the NVIDIA build exports, and the dp4a path AMD targets take), token
// tiles of 16, 32 and 64, partial row and token tiles, a partial last K step, and K splits with
// their reduction, against a double-precision reference; then the time of both paths on the
// Llama-3-8B shapes for 16 and 64 tokens, split and unsplit.
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_mmq.cu -o target/harness_mmq
//   target/harness_mmq
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section.
//
// Reference and tolerance. The activations are rounded by the exported pre-pass
// (ember_mmq_quantize_*, which is matvec.hip's ember_mv_quantize; harness_matvec checks that
// rounding bit for bit against the CPU's), downloaded, and x^ = d q rebuilt from them; the
// reference is W x^ in double from an independent dequantiser (harness_common.h), plus, for
// q4_1/q5_1, the CPU's use of s = f16(d sum q) in place of d sum q. The kernels differ from it
// only by f32 rounding of the per-group scale products and of the sums over groups (at most
// n_cols / 32 + a few roundings of 2^-24 of the magnitudes involved, under 3e-6 for 1024
// columns), where the magnitudes include the offset terms that can cancel (q4_0's 8 d, q5_0's
// 16 d, q4_1/q5_1's m, the k-quants' dmin min): |y - ref| <= 1e-5 sum_i (|w_i| + |offset_i|) |x^_i|.
#include "../mmq.hip"

#include "harness_common.h"

typedef void (*MmqKernel)(float*, const uint8_t*, const int8_t*, const float2*, uint32_t, uint32_t, uint32_t, uint32_t);
typedef void (*QuantizeKernel)(int8_t*, float2*, const float*, uint32_t);

template <typename F, int NT, bool MMA>
__global__ void __launch_bounds__(EMBER_MMQ_THREADS)
    variant(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens,
            uint32_t steps_per_split) {
    ember_mmq<F, NT, MMA>(y, w, xq, xds, n_rows, n_cols, n_tokens, steps_per_split);
}

template <typename F, bool MMA>
static MmqKernel pick_tile(int tile) {
    return tile == 16 ? variant<F, 16, MMA> : tile == 32 ? variant<F, 32, MMA> : variant<F, 64, MMA>;
}

// The kernel of format f, token tile `tile` and product path (tensor cores or dp4a).
static MmqKernel kernel_for(Format f, int tile, bool mma) {
    switch (f) {
#define EMBER_MMQ_CASE(FORMAT, TYPE) \
    case FORMAT: return mma ? pick_tile<TYPE, true>(tile) : pick_tile<TYPE, false>(tile);
        EMBER_MMQ_CASE(Q4_0, EmberMmqQ4_0)
        EMBER_MMQ_CASE(Q4_1, EmberMmqQ4_1)
        EMBER_MMQ_CASE(Q5_0, EmberMmqQ5_0)
        EMBER_MMQ_CASE(Q5_1, EmberMmqQ5_1)
        EMBER_MMQ_CASE(Q8_0, EmberMmqQ8_0)
        EMBER_MMQ_CASE(Q4_K, EmberMmqQ4_K)
        EMBER_MMQ_CASE(Q5_K, EmberMmqQ5_K)
        EMBER_MMQ_CASE(Q6_K, EmberMmqQ6_K)
#undef EMBER_MMQ_CASE
        default: std::fprintf(stderr, "no mmq kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

static int act_of(Format f) {
    switch (f) {
        case Q4_1:
        case Q5_1: return EMBER_ACT_Q8_1;
        case Q4_0:
        case Q5_0:
        case Q8_0: return EMBER_ACT_Q8_0;
        default: return EMBER_ACT_Q8_K;
    }
}

static QuantizeKernel quantize_for(Format f) {
    const int act = act_of(f);
    return act == EMBER_ACT_Q8_0 ? ember_mmq_quantize_q8_0 : act == EMBER_ACT_Q8_1 ? ember_mmq_quantize_q8_1 : ember_mmq_quantize_q8_k;
}

// ops/mmq.rs token_tile.
static int tile_for(int tokens) { return tokens <= 16 ? 16 : tokens <= 32 ? 32 : 64; }

// The rounded activations of a launch, on the device.
struct Activations {
    DeviceBuffer<int8_t> q;
    DeviceBuffer<float2> ds;
    Activations(size_t values) : q(values), ds(values / 32) {}
};

static void quantize(Format f, const DeviceBuffer<float>& x, int tokens, int n_cols, Activations& a) {
    quantize_for(f)<<<tokens, 256>>>(a.q.ptr, a.ds.ptr, x.ptr, n_cols);
}

// Runs the product (and the reduction of a split) into y [tokens, n_rows].
static void launch(Format f, bool mma, int tile, int splits_wanted, const Activations& a, const uint8_t* w, float* y, float* partial,
                   int n_rows, int n_cols, int tokens) {
    const int n_steps = (n_cols + EMBER_MMQ_STEP - 1) / EMBER_MMQ_STEP;
    const int steps_per_split = (n_steps + splits_wanted - 1) / splits_wanted;
    const int splits = (n_steps + steps_per_split - 1) / steps_per_split;
    const dim3 grid((n_rows + EMBER_MMQ_ROWS - 1) / EMBER_MMQ_ROWS, (tokens + tile - 1) / tile, splits);
    kernel_for(f, tile, mma)<<<grid, EMBER_MMQ_THREADS>>>(splits > 1 ? partial : y, w, a.q.ptr, a.ds.ptr, n_rows, n_cols, tokens,
                                                           steps_per_split);
    if (splits > 1) ember_mmq_reduce<<<64, 256>>>(y, partial, (uint32_t)(tokens * n_rows), splits);
}

static void test_format(Format f, int n_rows, int n_cols) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t row_bytes = row_bytes_of(f, n_cols);
    std::vector<std::vector<float>> rows(n_rows);
    for (int r = 0; r < n_rows; ++r) rows[r] = dequant_row(f, w.data() + r * row_bytes, n_cols);
    DeviceBuffer<uint8_t> dw(w);
    const int n_groups = n_cols / 32;
    const int n_steps = (n_cols + EMBER_MMQ_STEP - 1) / EMBER_MMQ_STEP;
    for (int tokens : {9, 16, 17, 33, 64, 100}) {
        // Groups of different amplitude, so the per-group scales matter.
        std::vector<float> x((size_t)tokens * n_cols);
        for (size_t g = 0; g < x.size() / 32; ++g) {
            const float amplitude = std::pow(10.0f, uniform(-2, 1));
            for (int i = 0; i < 32; ++i) x[32 * g + i] = amplitude * uniform(-1, 1);
        }
        DeviceBuffer<float> dx(x);
        Activations a(x.size());
        quantize(f, dx, tokens, n_cols, a);
        sync();
        const std::vector<int8_t> q = a.q.download();
        const std::vector<float2> ds = a.ds.download();
        // x^ from the kernel's layout (per token: first halves of every group, then second halves).
        std::vector<double> xh(x.size());
        std::vector<int> sums(x.size() / 32, 0);
        for (int t = 0; t < tokens; ++t)
            for (int c = 0; c < n_cols; ++c) {
                const size_t at = (size_t)t * n_cols + ((size_t)((c % 32) / 16) * n_groups + c / 32) * 16 + c % 16;
                const size_t g = ((size_t)t * n_cols + c) / 32;
                xh[(size_t)t * n_cols + c] = (double)ds[g].x * q[at];
                sums[g] += q[at];
            }
        std::vector<double> reference((size_t)tokens * n_rows), magnitude((size_t)tokens * n_rows);
        for (int t = 0; t < tokens; ++t)
            for (int r = 0; r < n_rows; ++r) {
                double sum = 0.0, mag = 0.0;
                const uint8_t* wrow = w.data() + r * row_bytes;
                for (int c = 0; c < n_cols; ++c) {
                    const double v = xh[(size_t)t * n_cols + c];
                    sum += (double)rows[r][c] * v;
                    mag += (std::fabs((double)rows[r][c]) + offset_magnitude(f, wrow, c)) * std::fabs(v);
                }
                if (act_of(f) == EMBER_ACT_Q8_1)
                    for (int g = 0; g < n_groups; ++g) {
                        const size_t gi = (size_t)t * n_groups + g;
                        const double m = half_at(wrow + (size_t)g * FORMATS[f].block_bytes + 2);
                        sum += m * ((double)ds[gi].y - (double)ds[gi].x * sums[gi]);
                        mag += std::fabs(m * ds[gi].y);
                    }
                reference[(size_t)t * n_rows + r] = sum;
                magnitude[(size_t)t * n_rows + r] = mag;
            }
        for (bool mma : {true, false}) {
            for (int splits : {1, 3, n_steps}) {
                DeviceBuffer<float> dy((size_t)tokens * n_rows), partial((size_t)splits * tokens * n_rows);
                // Poisoned: an output no block writes stays NaN and fails.
                CHECK_CUDA(cudaMemset(dy.ptr, 0xff, (size_t)tokens * n_rows * sizeof(float)));
                CHECK_CUDA(cudaMemset(partial.ptr, 0xff, (size_t)splits * tokens * n_rows * sizeof(float)));
                launch(f, mma, tile_for(tokens), splits, a, dw.ptr, dy.ptr, partial.ptr, n_rows, n_cols, tokens);
                sync();
                const std::vector<float> y = dy.download();
                double worst = 0.0;
                for (size_t i = 0; i < y.size(); ++i) {
                    const double error = std::fabs((double)y[i] - reference[i]) / (1e-5 * magnitude[i] + 1e-30);
                    worst = std::isnan(error) ? error : std::fmax(worst, error);
                    if (std::isnan(error)) break;
                }
                char name[160];
                std::snprintf(name, sizeof name, "mmq_%s %dx%d, %d tok, %s, %d split%s: |y - W x^| / (1e-5 sum |w x^|)",
                              FORMATS[f].name, n_rows, n_cols, tokens, mma ? "mma " : "dp4a", splits, splits > 1 ? "s" : "");
                report(name, worst, 1.0);
            }
        }
    }
}

// Time of the product (the pre-pass and reduction included) per call: median of 30 launches,
// cycling through enough copies of the matrix that none is still in L2 when read again.
static void benchmark(Format f, int n_rows, int n_cols) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t bytes = w.size();
    const size_t copies = std::max<size_t>(2, (size_t)std::ceil(3.0 * 64e6 / (double)bytes));
    std::vector<DeviceBuffer<uint8_t>*> matrices;
    for (size_t i = 0; i < copies; ++i) matrices.push_back(new DeviceBuffer<uint8_t>(w));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    const int n_steps = (n_cols + EMBER_MMQ_STEP - 1) / EMBER_MMQ_STEP;
    for (int tokens : {16, 64}) {
        const std::vector<float> x = random_floats((size_t)tokens * n_cols);
        DeviceBuffer<float> dx(x), dy((size_t)tokens * n_rows), partial((size_t)n_steps * tokens * n_rows);
        Activations a(x.size());
        char line[512];
        int at = std::snprintf(line, sizeof line, "INFO mmq_%-5s %5dx%-5d %2d tok:", FORMATS[f].name, n_rows, n_cols, tokens);
        for (bool mma : {true, false})
            for (int splits : {1, 2, 4, 8}) {
                if (!mma && splits > 1) continue;
                std::vector<float> samples;
                for (int i = 0; i < 33; ++i) {
                    CHECK_CUDA(cudaEventRecord(start));
                    quantize(f, dx, tokens, n_cols, a);
                    launch(f, mma, tile_for(tokens), splits, a, matrices[i % copies]->ptr, dy.ptr, partial.ptr, n_rows, n_cols, tokens);
                    CHECK_CUDA(cudaEventRecord(stop));
                    CHECK_CUDA(cudaEventSynchronize(stop));
                    float ms = 0;
                    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
                    if (i >= 3) samples.push_back(ms);
                }
                sync();
                const double us = median(samples) * 1e3;
                at += std::snprintf(line + at, sizeof line - at, " %s/%d %6.1f us %5.0f GB/s |", mma ? "mma" : "dp4a", splits, us,
                                    bytes / (us * 1e-6) / 1e9);
            }
        std::printf("%s\n", line);
    }
    for (auto* m : matrices) delete m;
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

int main() {
    for (Format f : {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K}) {
        // 130 rows: a partial row tile; 1024 columns: 4 K steps.
        test_format(f, 130, 1024);
        // 800 columns (32-value formats): a last K step of 32 of 256 values.
        if (FORMATS[f].block_values == 32) test_format(f, 70, 800);
    }
    if (std::getenv("EMBER_HARNESS_NO_TIMING") == nullptr) {
        const int shapes[4][2] = {{14336, 4096}, {4096, 14336}, {4096, 4096}, {1024, 4096}};
        for (Format f : {Q4_0, Q4_K, Q6_K})
            for (const auto& shape : shapes) benchmark(f, shape[0], shape[1]);
    }
    return finish("harness_mmq");
}
