// Mixture-of-experts harness, three parts.
//
// 1. ember_moe_combine_f32 of kernels/moe.hip on random inputs, without and with per-expert
// output scales (Gemma 4's ffn_down_exps.scale), against a plain C++ reference of the CPU
// backend's order (engine/src/backend/cpu/moe.rs): each expert's output row times its scale,
// rounded to f32, then times the routing weight, rounded to f32, and the terms added in rank
// order from the first. Every step is one f32 operation in both, so the check is bit-exact
// (differing values: 0).
//
// 2. The grouped mmq product (mmq.hip's ember_mmq_moe, the prompt path: tiles of up to 16, 32
// or 64 pairs of one expert, both the tensor-core and the dp4a products) against the grouped
// matrix-vector product (matvec.hip's ember_moe_matvec_*, the path of 5 to 31 tokens), for every format
// both cover, on random experts and routing (ember_moe_route's distinct experts per token,
// sorted into tiles by ember_moe_tiles) at 1, 7, 64 and 512 tokens: Qwen3-30B-A3B's shapes (128
// experts, 8 used, gate/up 768x2048 reading token p / 8, down 2048x768 reading pair p) and
// Gemma 4 26B-A4B's (128 experts, 8 used, 704x2816 and 2816x704). Tolerance: both round the
// activations with the same function (ember_mv_quantize), so every group of 32 gives the same
// exact integer sum and the same f32 scales; they differ only in the order (and contraction) of
// the f32 products and additions over the n_cols / 32 groups. Each of those at most
// n_cols / 32 + 8 roundings errs by 2^-24 of a partial sum bounded by sum_i (|w_i| + 2
// |offset_i|) |x^_i| (the offset terms of q4_0/q5_0's 8 d and 16 d, q4_1/q5_1's m, the k-quants'
// dmin min may cancel against the integer part), so |y_mmq - y_matvec| <= 2 (96 / 2^24) B =
// 1.2e-5 B at 2816 columns; the check uses 1e-5 B with the looser bound B = max_i (|w_i| + 2
// |offset_i|) of the row times (||x_p||_1 + n_cols max|x_p| / 127) (|x^_i - x_i| <= d / 2 <=
// max|x_p| / 254), which is at least twice the sum above. Outputs start as NaN, so a pair no
// block writes fails. Then the time of both at 512 tokens (and 64) on Qwen3-30B-A3B's shapes in
// q4_K and q6_K, in microseconds (matvec, then mmq per tile size, the activation pre-pass
// included).
//
// 3. The decode kernels (matvec.hip's ember_moe_{swiglu,geglu}_*, and ember_quantize_act_* then
// ember_moe_down_*_l16/_l32: what moe_ffn runs for 1 to 4 tokens) against the tile path they
// replace there (ember_moe_tiles,
// ember_moe_matvec_* for gate and up, ember_silu_mul_f32 / ember_gelu_mul_f32; ember_moe_matvec_*
// for down, ember_moe_combine_f32, then ember_add_f32 or ember_moe_add_gated_f32 for a shared
// expert), for every format, 1 to 4 tokens, 128, 256 and 512 experts, with and without
// per-expert scales and a (gated) shared expert: bit for bit (differing values: 0), as both
// compute each dot product with the same units per lane in the same order and reduce it the
// same way, then apply the same f32 operations. Then, unless EMBER_HARNESS_NO_TIMING is set, one
// line per layer shape at 1 and 4 tokens ("INFO moe decode"): the tile path's gate/up (the sort
// alone, then sort + two products + activation) and down (product + combination) against the
// fused kernels, and the whole layer, in microseconds of device time of a captured graph with L2
// flushed before each launch (as in a decode step, where a layer's experts are not in L2).
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_moe.cu -o target/harness_moe
//   target/harness_moe
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section.
#include "../moe.hip"
#include "../matvec.hip"
#include "../mmq.hip"
#include "../elementwise.hip"

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


// ---- The grouped products ----

typedef void (*MoeKernel)(float*, const uint8_t*, const int8_t*, const float2*, const int32_t*, const int32_t*, uint32_t, uint32_t,
                          uint64_t, uint32_t);
typedef void (*MoeMatvecKernel)(float*, const uint8_t*, const float*, const int32_t*, const int32_t*, uint32_t, uint32_t, uint64_t,
                                uint32_t);
typedef void (*QuantizeKernel)(int8_t*, float2*, const float*, uint32_t);

template <typename F, int NT, bool MMA>
__global__ void __launch_bounds__(EMBER_MMQ_THREADS)
    moe_variant(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, const int32_t* pairs, const int32_t* tiles,
                uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div) {
    ember_mmq_moe<F, NT, MMA>(y, w, xq, xds, pairs, tiles, n_rows, n_cols, expert_bytes, x_div);
}

template <typename F, bool MMA>
static MoeKernel pick_moe_tile(int tile) {
    return tile == 16 ? moe_variant<F, 16, MMA> : tile == 32 ? moe_variant<F, 32, MMA> : moe_variant<F, 64, MMA>;
}

// The grouped mmq kernel of format f, tile size and product path; the matvec kernel and the
// activation pre-pass of f.
static MoeKernel moe_mmq_for(Format f, int tile, bool mma) {
    switch (f) {
#define EMBER_MOE_CASE(FORMAT, TYPE) \
    case FORMAT: return mma ? pick_moe_tile<TYPE, true>(tile) : pick_moe_tile<TYPE, false>(tile);
        EMBER_MOE_CASE(Q4_0, EmberMmqQ4_0)
        EMBER_MOE_CASE(Q4_1, EmberMmqQ4_1)
        EMBER_MOE_CASE(Q5_0, EmberMmqQ5_0)
        EMBER_MOE_CASE(Q5_1, EmberMmqQ5_1)
        EMBER_MOE_CASE(Q8_0, EmberMmqQ8_0)
        EMBER_MOE_CASE(Q4_K, EmberMmqQ4_K)
        EMBER_MOE_CASE(Q5_K, EmberMmqQ5_K)
        EMBER_MOE_CASE(Q6_K, EmberMmqQ6_K)
#undef EMBER_MOE_CASE
        default: std::fprintf(stderr, "no grouped mmq kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

static MoeMatvecKernel moe_matvec_for(Format f) {
    switch (f) {
        case Q4_0: return ember_moe_matvec_q4_0;
        case Q4_1: return ember_moe_matvec_q4_1;
        case Q5_0: return ember_moe_matvec_q5_0;
        case Q5_1: return ember_moe_matvec_q5_1;
        case Q8_0: return ember_moe_matvec_q8_0;
        case Q4_K: return ember_moe_matvec_q4_k;
        case Q5_K: return ember_moe_matvec_q5_k;
        case Q6_K: return ember_moe_matvec_q6_k;
        default: std::fprintf(stderr, "no grouped matvec kernel for %s\n", FORMATS[f].name); std::exit(2);
    }
}

static QuantizeKernel moe_quantize_for(Format f) {
    switch (f) {
        case Q4_1:
        case Q5_1: return ember_mmq_quantize_q8_1;
        case Q4_0:
        case Q5_0:
        case Q8_0: return ember_mmq_quantize_q8_0;
        default: return ember_mmq_quantize_q8_k;
    }
}

// crates/gpu/src/ops/moe.rs moe_tile_slots.
static int tile_slots(int n_pairs, int n_expert, int tile) { return std::min(n_pairs / tile + n_expert, n_pairs); }

// One layer's stack of experts on the device, with per row the bound max_i (|w_i| + 2 |offset_i|).
struct ExpertStack {
    Format f;
    int n_expert, n_rows, n_cols;  // n_rows per expert
    size_t expert_bytes;
    DeviceBuffer<uint8_t> w;
    std::vector<double> row_bound;
    ExpertStack(Format format, int experts, int rows, int cols, const std::vector<uint8_t>& bytes)
        : f(format), n_expert(experts), n_rows(rows), n_cols(cols), expert_bytes(row_bytes_of(format, cols) * rows), w(bytes),
          row_bound((size_t)experts * rows) {
        const size_t row_bytes = row_bytes_of(f, n_cols);
        for (size_t r = 0; r < row_bound.size(); ++r) {
            const uint8_t* row = bytes.data() + r * row_bytes;
            const std::vector<float> v = dequant_row(f, row, n_cols);
            double bound = 0.0;
            for (int c = 0; c < n_cols; ++c) bound = std::fmax(bound, std::fabs((double)v[c]) + 2.0 * offset_magnitude(f, row, c));
            row_bound[r] = bound;
        }
    }
};

// A routing of n_tokens tokens to n_used distinct experts each, sorted into tiles on the device.
struct Routing {
    int n_tokens, n_used, n_pairs;
    std::vector<int32_t> experts;
    DeviceBuffer<int32_t> dexperts, pairs, tiles;
    int slots;
    Routing(int tokens, int used, int n_expert, int tile)
        : n_tokens(tokens), n_used(used), n_pairs(tokens * used), experts(random_experts(tokens, used, n_expert)), dexperts(experts),
          pairs(n_pairs), tiles(4 * (size_t)tile_slots(n_pairs, n_expert, tile)), slots(tile_slots(n_pairs, n_expert, tile)) {
        ember_moe_tiles<<<1, 256, 8 * n_expert>>>(pairs.ptr, tiles.ptr, dexperts.ptr, n_pairs, n_expert, slots, tile);
        sync();
    }
    static std::vector<int32_t> random_experts(int tokens, int used, int n_expert) {
        std::vector<int32_t> e((size_t)tokens * used);
        for (int t = 0; t < tokens; ++t)
            for (int k = 0; k < used; ++k) {
                int32_t pick;
                bool taken;
                do {
                    pick = uniform_int(0, n_expert - 1);
                    taken = false;
                    for (int j = 0; j < k; ++j) taken |= e[(size_t)t * used + j] == pick;
                } while (taken);
                e[(size_t)t * used + k] = pick;
            }
        return e;
    }
};

// Runs the grouped matvec product (tiles of EMBER_MOE_TILE) into y, grid as ops/moe.rs launches it.
static void run_matvec(const ExpertStack& s, const Routing& r8, const float* x, int x_div, float* y) {
    const int rows_per_block = 256 / EMBER_MATVEC_LANES;
    const int grid_x = std::max(1, std::min((s.n_rows + rows_per_block - 1) / rows_per_block, (1024 + r8.slots - 1) / r8.slots));
    moe_matvec_for(s.f)<<<dim3(grid_x, r8.slots), 256, ember_matvec_shared_bytes(EMBER_MOE_TILE, s.n_cols)>>>(
        y, s.w.ptr, x, r8.pairs.ptr, r8.tiles.ptr, s.n_rows, s.n_cols, s.expert_bytes, x_div);
}

// One product of the layer: `down` false is gate/up (pair p reads token p / n_used), true is down
// (pair p reads its own row).
static void test_grouped(const ExpertStack& s, int n_tokens, int n_used, bool down) {
    const Routing r8(n_tokens, n_used, s.n_expert, EMBER_MOE_TILE);
    const int n_pairs = r8.n_pairs, x_div = down ? 1 : n_used, x_rows = down ? n_pairs : n_tokens;
    std::vector<float> x((size_t)x_rows * s.n_cols);
    for (size_t g = 0; g < x.size() / 32; ++g) {
        const float amplitude = std::pow(10.0f, uniform(-2, 1));
        for (int i = 0; i < 32; ++i) x[32 * g + i] = amplitude * uniform(-1, 1);
    }
    std::vector<double> x_bound(x_rows);
    for (int i = 0; i < x_rows; ++i) {
        double l1 = 0.0, max = 0.0;
        for (int c = 0; c < s.n_cols; ++c) {
            const double v = std::fabs((double)x[(size_t)i * s.n_cols + c]);
            l1 += v;
            max = std::fmax(max, v);
        }
        x_bound[i] = l1 + s.n_cols * max / 127.0;
    }
    DeviceBuffer<float> dx(x), want((size_t)n_pairs * s.n_rows), got((size_t)n_pairs * s.n_rows);
    DeviceBuffer<int8_t> xq(x.size());
    DeviceBuffer<float2> xds(x.size() / 32);
    CHECK_CUDA(cudaMemset(want.ptr, 0xff, (size_t)n_pairs * s.n_rows * sizeof(float)));
    run_matvec(s, r8, dx.ptr, x_div, want.ptr);
    sync();
    const std::vector<float> reference = want.download();
    for (int tile : {16, 32, 64}) {
        // The same routing, cut into tiles of this size.
        DeviceBuffer<int32_t> pairs(n_pairs), tiles(4 * (size_t)tile_slots(n_pairs, s.n_expert, tile));
        const int slots = tile_slots(n_pairs, s.n_expert, tile);
        ember_moe_tiles<<<1, 256, 8 * s.n_expert>>>(pairs.ptr, tiles.ptr, r8.dexperts.ptr, n_pairs, s.n_expert, slots, tile);
        for (bool mma : {true, false}) {
            CHECK_CUDA(cudaMemset(got.ptr, 0xff, (size_t)n_pairs * s.n_rows * sizeof(float)));
            moe_quantize_for(s.f)<<<x_rows, 256>>>(xq.ptr, xds.ptr, dx.ptr, s.n_cols);
            moe_mmq_for(s.f, tile, mma)<<<dim3((s.n_rows + EMBER_MMQ_ROWS - 1) / EMBER_MMQ_ROWS, slots), EMBER_MMQ_THREADS>>>(
                got.ptr, s.w.ptr, xq.ptr, xds.ptr, pairs.ptr, tiles.ptr, s.n_rows, s.n_cols, s.expert_bytes, x_div);
            sync();
            const std::vector<float> y = got.download();
            double worst = 0.0;
            for (int p = 0; p < n_pairs && !std::isnan(worst); ++p) {
                const size_t expert_row0 = (size_t)r8.experts[p] * s.n_rows;
                for (int row = 0; row < s.n_rows; ++row) {
                    const size_t i = (size_t)p * s.n_rows + row;
                    const double bound = 1e-5 * s.row_bound[expert_row0 + row] * x_bound[p / x_div] + 1e-30;
                    const double error = std::fabs((double)y[i] - (double)reference[i]) / bound;
                    if (std::isnan(error)) {
                        worst = error;
                        break;
                    }
                    worst = std::fmax(worst, error);
                }
            }
            char name[200];
            std::snprintf(name, sizeof name, "moe mmq_%s %s %dx%d x%d, %d tok, tile %d, %s: |mmq - matvec| / (1e-5 B)", FORMATS[s.f].name,
                          down ? "down" : "gate", s.n_rows, s.n_cols, s.n_expert, n_tokens, tile, mma ? "mma " : "dp4a");
            report(name, worst, 1.0);
        }
    }
}

// Median time of fn over 30 calls (after 3 warm-up calls), in microseconds.
template <typename Fn>
static double time_us(Fn fn) {
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> samples;
    for (int i = 0; i < 33; ++i) {
        CHECK_CUDA(cudaEventRecord(start));
        fn();
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 3) samples.push_back(ms);
    }
    sync();
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    return median(samples) * 1e3;
}

// The time of one product of the layer by both paths (the weights, over 100 MB, do not stay in
// L2 between calls).
static void benchmark_grouped(const ExpertStack& s, int n_tokens, int n_used, bool down) {
    const Routing r8(n_tokens, n_used, s.n_expert, EMBER_MOE_TILE);
    const int n_pairs = r8.n_pairs, x_div = down ? 1 : n_used, x_rows = down ? n_pairs : n_tokens;
    DeviceBuffer<float> dx(random_floats((size_t)x_rows * s.n_cols)), y((size_t)n_pairs * s.n_rows);
    DeviceBuffer<int8_t> xq((size_t)x_rows * s.n_cols);
    DeviceBuffer<float2> xds((size_t)x_rows * s.n_cols / 32);
    char line[512];
    int at = std::snprintf(line, sizeof line, "INFO moe_%-5s %s %4dx%-4d x%d, %3d tok: matvec %7.1f us |", FORMATS[s.f].name,
                           down ? "down" : "gate", s.n_rows, s.n_cols, s.n_expert, n_tokens,
                           time_us([&] { run_matvec(s, r8, dx.ptr, x_div, y.ptr); }));
    for (int tile : {16, 32, 64}) {
        DeviceBuffer<int32_t> pairs(n_pairs), tiles(4 * (size_t)tile_slots(n_pairs, s.n_expert, tile));
        const int slots = tile_slots(n_pairs, s.n_expert, tile);
        ember_moe_tiles<<<1, 256, 8 * s.n_expert>>>(pairs.ptr, tiles.ptr, r8.dexperts.ptr, n_pairs, s.n_expert, slots, tile);
        for (bool mma : {true, false}) {
            const double us = time_us([&] {
                moe_quantize_for(s.f)<<<x_rows, 256>>>(xq.ptr, xds.ptr, dx.ptr, s.n_cols);
                moe_mmq_for(s.f, tile, mma)<<<dim3((s.n_rows + EMBER_MMQ_ROWS - 1) / EMBER_MMQ_ROWS, slots), EMBER_MMQ_THREADS>>>(
                    y.ptr, s.w.ptr, xq.ptr, xds.ptr, pairs.ptr, tiles.ptr, s.n_rows, s.n_cols, s.expert_bytes, x_div);
            });
            at += std::snprintf(line + at, sizeof line - at, " mmq/%d %s %7.1f us |", tile, mma ? "mma" : "dp4a", us);
        }
    }
    std::printf("%s\n", line);
}

// ---- 3. The decode kernels against the tile path ----

// A stack of experts from a fast generator (stacks here are hundreds of MB): random bytes, with
// the f16 scale fields drawn from random_matrix's ranges.
struct FastRandom {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float unit() { return (float)(next() >> 40) / 16777216.0f; }
};

static std::vector<uint8_t> fast_random_stack(Format f, size_t n_rows, int n_cols) {
    const size_t bytes = row_bytes_of(f, n_cols) * n_rows;
    std::vector<uint8_t> w(bytes + 8);
    FastRandom rng{(uint64_t)g_rng()};
    for (size_t i = 0; i < bytes; i += 8) {
        const uint64_t v = rng.next();
        std::memcpy(&w[i], &v, 8);
    }
    w.resize(bytes);
    const FormatInfo& info = FORMATS[f];
    for (size_t block = 0; block < bytes / info.block_bytes; ++block)
        for (int k = 0; k < 2; ++k) {
            if (info.half_offsets[k] < 0) continue;
            float v = info.scale_lo + rng.unit() * (info.scale_hi - info.scale_lo);
            if (k == 1 && (f == Q4_1 || f == Q5_1)) v = (2.0f * rng.unit() - 1.0f) * 8 * info.scale_hi;
            const uint16_t bits = to_half_bits(v);
            std::memcpy(&w[block * info.block_bytes + info.half_offsets[k]], &bits, 2);
        }
    return w;
}

struct DecodeStack {
    Format f;
    int n_expert, n_rows, n_cols;  // n_rows per expert
    size_t expert_bytes;
    DeviceBuffer<uint8_t> w;
    DecodeStack(Format format, int experts, int rows, int cols)
        : f(format), n_expert(experts), n_rows(rows), n_cols(cols), expert_bytes(row_bytes_of(format, cols) * rows),
          w(fast_random_stack(format, (size_t)experts * rows, cols)) {}
};

typedef void (*MoeGluKernel)(float*, const uint8_t*, const uint8_t*, const float*, const int32_t*, uint32_t, uint32_t, uint64_t, uint32_t);
typedef void (*MoeDownKernel)(float*, const uint8_t*, const int8_t*, const float2*, const int32_t*, const float*, const float*,
                              const float*, const float*, uint32_t, uint32_t, uint64_t, uint32_t);
typedef void (*ActQuantizeKernel)(int8_t*, float2*, const float*, uint32_t, uint32_t);

static MoeGluKernel moe_glu_for(Format f, bool gelu) {
    switch (f) {
#define EMBER_GLU_CASE(FORMAT, name) \
    case FORMAT: return gelu ? ember_moe_geglu_##name : ember_moe_swiglu_##name;
        EMBER_GLU_CASE(Q4_0, q4_0)
        EMBER_GLU_CASE(Q4_1, q4_1)
        EMBER_GLU_CASE(Q5_0, q5_0)
        EMBER_GLU_CASE(Q5_1, q5_1)
        EMBER_GLU_CASE(Q8_0, q8_0)
        EMBER_GLU_CASE(Q4_K, q4_k)
        EMBER_GLU_CASE(Q5_K, q5_k)
        EMBER_GLU_CASE(Q6_K, q6_k)
#undef EMBER_GLU_CASE
        default: std::fprintf(stderr, "no decode kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

static MoeDownKernel moe_down_for(Format f, int lanes) {
    switch (f) {
#define EMBER_DOWN_CASE(FORMAT, name) \
    case FORMAT: return lanes == 16 ? ember_moe_down_##name##_l16 : ember_moe_down_##name##_l32;
        EMBER_DOWN_CASE(Q4_0, q4_0)
        EMBER_DOWN_CASE(Q4_1, q4_1)
        EMBER_DOWN_CASE(Q5_0, q5_0)
        EMBER_DOWN_CASE(Q5_1, q5_1)
        EMBER_DOWN_CASE(Q8_0, q8_0)
        EMBER_DOWN_CASE(Q4_K, q4_k)
        EMBER_DOWN_CASE(Q5_K, q5_k)
        EMBER_DOWN_CASE(Q6_K, q6_k)
#undef EMBER_DOWN_CASE
        default: std::fprintf(stderr, "no decode kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

// crates/gpu/src/ops/moe.rs: down_lanes and decode_grid_x.
static int down_lanes(Format f, int n_cols) { return n_cols / std::min(FORMATS[f].block_values, 64) <= 16 ? 16 : 32; }
static int decode_grid_x(int rows, int lanes, int columns) {
    return std::max(1, std::min((rows + 256 / lanes - 1) / (256 / lanes), (1024 + columns - 1) / columns));
}

// One decode batch: n_tokens tokens routed to n_used distinct experts each (random, as the
// router picks them), with routing weights, per-expert scales, a shared expert's output and gate
// logits, and both paths' scratch.
struct DecodeBatch {
    int n_tokens, n_used, n_pairs, n_expert, slots;
    std::vector<int32_t> experts;
    DeviceBuffer<int32_t> dexperts, pairs, tiles;
    DeviceBuffer<float> weights, scale, shared, logit;
    DecodeBatch(int tokens, int used, int n_expert_, int n_embd)
        : n_tokens(tokens), n_used(used), n_pairs(tokens * used), n_expert(n_expert_),
          slots(tile_slots(tokens * used, n_expert_, EMBER_MOE_TILE)), experts(Routing::random_experts(tokens, used, n_expert_)),
          dexperts(experts), pairs(n_pairs), tiles(4 * (size_t)slots), weights(random_floats(n_pairs, 0, 1)),
          scale(random_floats(n_expert_, -2, 2)), shared(random_floats((size_t)tokens * n_embd, -3, 3)),
          logit(random_floats(tokens, -4, 4)) {}
};

// Activations with groups of very different amplitude (the rounding's scales vary).
static std::vector<float> decode_activations(size_t rows, int n_cols) {
    std::vector<float> x(rows * n_cols);
    for (size_t g = 0; g < x.size() / 32; ++g) {
        const float amplitude = std::pow(10.0f, uniform(-2, 1));
        for (int i = 0; i < 32; ++i) x[32 * g + i] = amplitude * uniform(-1, 1);
    }
    return x;
}

// The tile path of moe_ffn for gate/up: the sort into tiles of EMBER_MOE_TILE, both grouped
// products, the element-wise activation (h into `gate_out`).
static void tile_glu(const DecodeStack& gate, const DecodeStack& up, DecodeBatch& b, const float* x, bool gelu, float* gate_out,
                     float* up_out, cudaStream_t st) {
    ember_moe_tiles<<<1, 256, 8 * b.n_expert, st>>>(b.pairs.ptr, b.tiles.ptr, b.dexperts.ptr, b.n_pairs, b.n_expert, b.slots,
                                                   EMBER_MOE_TILE);
    const int grid_x = decode_grid_x(gate.n_rows, 32, b.slots);
    const size_t shared = ember_matvec_shared_bytes(EMBER_MOE_TILE, gate.n_cols);
    for (int k = 0; k < 2; ++k) {
        const DecodeStack& s = k == 0 ? gate : up;
        moe_matvec_for(s.f)<<<dim3(grid_x, b.slots), 256, shared, st>>>(k == 0 ? gate_out : up_out, s.w.ptr, x, b.pairs.ptr, b.tiles.ptr,
                                                                       s.n_rows, s.n_cols, s.expert_bytes, b.n_used);
    }
    const uint32_t n = (uint32_t)b.n_pairs * gate.n_rows;
    if (gelu) ember_gelu_mul_f32<<<(n + 255) / 256, 256, 0, st>>>(gate_out, gate_out, up_out, n);
    else ember_silu_mul_f32<<<(n + 255) / 256, 256, 0, st>>>(gate_out, gate_out, up_out, n);
}

static void decode_glu(const DecodeStack& gate, const DecodeStack& up, DecodeBatch& b, const float* x, bool gelu, float* h, cudaStream_t st) {
    moe_glu_for(gate.f, gelu)<<<dim3(decode_grid_x(gate.n_rows, 32, b.n_pairs), b.n_pairs), 256, ember_matvec_shared_bytes(1, gate.n_cols),
                                st>>>(h, gate.w.ptr, up.w.ptr, x, b.dexperts.ptr, gate.n_rows, gate.n_cols, gate.expert_bytes, b.n_used);
}

// Down variants: per-expert scales (Gemma 4), a shared expert added plainly, or through its gate.
enum DownExtra { DOWN_PLAIN, DOWN_SCALED, DOWN_SHARED, DOWN_SHARED_GATED };
static const char* DOWN_EXTRA_NAMES[] = {"", ", scales", ", shared expert", ", gated shared expert"};

// The tile path for down: the sort (already done by tile_glu in a real layer, repeated here so
// the timing counts it once per layer with the glu), the grouped product, the combination, and
// the shared expert's addition.
static void tile_down(const DecodeStack& down, DecodeBatch& b, const float* h, DownExtra extra, float* routed, float* out, cudaStream_t st) {
    const int grid_x = decode_grid_x(down.n_rows, 32, b.slots);
    moe_matvec_for(down.f)<<<dim3(grid_x, b.slots), 256, ember_matvec_shared_bytes(EMBER_MOE_TILE, down.n_cols), st>>>(
        routed, down.w.ptr, h, b.pairs.ptr, b.tiles.ptr, down.n_rows, down.n_cols, down.expert_bytes, 1);
    const dim3 grid((down.n_rows + 255) / 256, b.n_tokens);
    ember_moe_combine_f32<<<grid, 256, 0, st>>>(out, routed, b.weights.ptr, b.dexperts.ptr, extra == DOWN_SCALED ? b.scale.ptr : nullptr,
                                                down.n_rows, b.n_used);
    const uint32_t n = (uint32_t)b.n_tokens * down.n_rows;
    if (extra == DOWN_SHARED) ember_add_f32<<<(n + 255) / 256, 256, 0, st>>>(out, out, b.shared.ptr, n, n);
    if (extra == DOWN_SHARED_GATED) ember_moe_add_gated_f32<<<grid, 256, 0, st>>>(out, b.shared.ptr, b.logit.ptr, down.n_rows);
}

// crates/gpu/src/ops/mmq.rs: activation_suffix (which ember_quantize_act_* moe_down launches).
static ActQuantizeKernel act_quantize_for(Format f) {
    if (f == Q4_1 || f == Q5_1) return ember_quantize_act_q8_1;
    if (FORMATS[f].block_values == 256) return ember_quantize_act_q8_k;
    return ember_quantize_act_q8_0;
}

// The rounded down input of the decode path: at most 4 tokens x 10 ranks x 1536 columns here
// (allocated once, before any capture).
static int8_t* down_scratch() {
    static DeviceBuffer<int8_t> scratch((size_t)4 * 10 * 1536 * 5 / 4);
    return scratch.ptr;
}

// The decode path's down product as crates/gpu/src/ops/moe.rs's moe_down launches it: h rounded
// once (ember_quantize_act_*), then ember_moe_down_*.
static void decode_down(const DecodeStack& down, DecodeBatch& b, const float* h, DownExtra extra, float* out, cudaStream_t st) {
    const int lanes = down_lanes(down.f, down.n_cols);
    const bool shared = extra == DOWN_SHARED || extra == DOWN_SHARED_GATED;
    const size_t values = (size_t)b.n_pairs * down.n_cols;
    if (values * 5 / 4 > (size_t)4 * 10 * 1536 * 5 / 4) {
        std::fprintf(stderr, "decode_down: %zu values exceed the scratch\n", values);
        std::exit(2);
    }
    int8_t* hq = down_scratch();
    float2* hds = (float2*)(hq + values);
    act_quantize_for(down.f)<<<std::min(b.n_pairs, 1024), 256, 0, st>>>(hq, hds, h, b.n_pairs, down.n_cols);
    moe_down_for(down.f, lanes)<<<dim3((down.n_rows + 32 / lanes - 1) / (32 / lanes), b.n_tokens), 256,
                                  b.n_used * (64 / lanes) * sizeof(float), st>>>(
        out, down.w.ptr, hq, hds, b.dexperts.ptr, b.weights.ptr, extra == DOWN_SCALED ? b.scale.ptr : nullptr,
        shared ? b.shared.ptr : nullptr, extra == DOWN_SHARED_GATED ? b.logit.ptr : nullptr, down.n_rows, down.n_cols,
        down.expert_bytes, b.n_used);
}

static uint32_t count_differing(const DeviceBuffer<float>& a, const DeviceBuffer<float>& b, size_t n) {
    const std::vector<float> x = a.download(), y = b.download();
    uint32_t differ = 0;
    for (size_t i = 0; i < n; ++i) differ += std::memcmp(&x[i], &y[i], sizeof(float)) != 0;
    return differ;
}

// One layer shape: both activations of the fused gate/up kernel and every down variant, at 1 to
// 4 tokens, against the tile path; the values must be equal bit for bit (outputs start as NaN,
// so a value no block writes differs).
static void test_decode(const char* label, Format gate_format, Format down_format, int n_expert, int n_used, int n_embd, int n_ff) {
    const DecodeStack gate(gate_format, n_expert, n_ff, n_embd), up(gate_format, n_expert, n_ff, n_embd);
    const DecodeStack down(down_format, n_expert, n_embd, n_ff);
    uint32_t differ_glu[2] = {0, 0}, differ_down[4] = {0, 0, 0, 0};
    for (int n_tokens = 1; n_tokens <= 4; ++n_tokens) {
        DecodeBatch b(n_tokens, n_used, n_expert, n_embd);
        const size_t n_h = (size_t)b.n_pairs * n_ff, n_out = (size_t)n_tokens * n_embd;
        DeviceBuffer<float> x(decode_activations(n_tokens, n_embd)), h_in(decode_activations(b.n_pairs, n_ff));
        DeviceBuffer<float> want(std::max(n_h, n_out)), got(std::max(n_h, n_out)), up_out(n_h), routed((size_t)b.n_pairs * n_embd);
        for (int gelu = 0; gelu < 2; ++gelu) {
            CHECK_CUDA(cudaMemset(want.ptr, 0xff, n_h * sizeof(float)));
            CHECK_CUDA(cudaMemset(got.ptr, 0xff, n_h * sizeof(float)));
            tile_glu(gate, up, b, x.ptr, gelu, want.ptr, up_out.ptr, 0);
            decode_glu(gate, up, b, x.ptr, gelu, got.ptr, 0);
            sync();
            differ_glu[gelu] += count_differing(want, got, n_h);
        }
        // The tiles of this routing (tile_glu sorted them) serve the tile path's down product.
        for (int extra = 0; extra < 4; ++extra) {
            CHECK_CUDA(cudaMemset(want.ptr, 0xff, n_out * sizeof(float)));
            CHECK_CUDA(cudaMemset(got.ptr, 0xff, n_out * sizeof(float)));
            tile_down(down, b, h_in.ptr, (DownExtra)extra, routed.ptr, want.ptr, 0);
            decode_down(down, b, h_in.ptr, (DownExtra)extra, got.ptr, 0);
            sync();
            differ_down[extra] += count_differing(want, got, n_out);
        }
    }
    char name[240];
    for (int gelu = 0; gelu < 2; ++gelu) {
        std::snprintf(name, sizeof name, "moe_%s_%s %s %dx%d x%d/%d, 1-4 tok vs tiles+matvec+%s (differing)", gelu ? "geglu" : "swiglu",
                      FORMATS[gate_format].name, label, n_ff, n_embd, n_expert, n_used, gelu ? "gelu_mul" : "silu_mul");
        report(name, differ_glu[gelu], 0.0);
    }
    for (int extra = 0; extra < 4; ++extra) {
        std::snprintf(name, sizeof name, "moe_down_%s_l%d %s %dx%d x%d/%d%s, 1-4 tok vs tiles+matvec+combine (differing)",
                      FORMATS[down_format].name, down_lanes(down_format, n_ff), label, n_embd, n_ff, n_expert, n_used, DOWN_EXTRA_NAMES[extra]);
        report(name, differ_down[extra], 0.0);
    }
}

// Median device time of the ops `enqueue` queues, captured once as a graph (as a decode step
// runs), with L2 flushed before every launch (a layer's experts are not in L2 when it starts).
template <typename Fn>
static double graph_us(Fn enqueue) {
    static DeviceBuffer<uint8_t> flush(256u << 20);
    cudaStream_t st;
    CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    enqueue(st);
    CHECK_CUDA(cudaStreamEndCapture(st, &graph));
    CHECK_CUDA(cudaGraphInstantiateWithFlags(&exec, graph, 0));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> samples;
    for (int i = 0; i < 33; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush.ptr, i, flush.n, st));
        CHECK_CUDA(cudaEventRecord(start, st));
        CHECK_CUDA(cudaGraphLaunch(exec, st));
        CHECK_CUDA(cudaEventRecord(stop, st));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 3) samples.push_back(ms);
    }
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    CHECK_CUDA(cudaStreamDestroy(st));
    return median(samples) * 1e3;
}

// Decode time of one layer's expert FFN by both paths, per kernel, at `n_tokens` tokens.
static void benchmark_decode(const char* label, Format gate_format, Format down_format, int n_expert, int n_used, int n_embd, int n_ff,
                             bool gelu, DownExtra extra, int n_tokens) {
    const DecodeStack gate(gate_format, n_expert, n_ff, n_embd), up(gate_format, n_expert, n_ff, n_embd);
    const DecodeStack down(down_format, n_expert, n_embd, n_ff);
    DecodeBatch b(n_tokens, n_used, n_expert, n_embd);
    const size_t n_h = (size_t)b.n_pairs * n_ff;
    DeviceBuffer<float> x(decode_activations(n_tokens, n_embd)), h(n_h), up_out(n_h), routed((size_t)b.n_pairs * n_embd),
        out((size_t)n_tokens * n_embd);
    const double tiles = graph_us([&](cudaStream_t st) {
        ember_moe_tiles<<<1, 256, 8 * b.n_expert, st>>>(b.pairs.ptr, b.tiles.ptr, b.dexperts.ptr, b.n_pairs, b.n_expert, b.slots,
                                                       EMBER_MOE_TILE);
    });
    const double old_glu = graph_us([&](cudaStream_t st) { tile_glu(gate, up, b, x.ptr, gelu, h.ptr, up_out.ptr, st); });
    const double new_glu = graph_us([&](cudaStream_t st) { decode_glu(gate, up, b, x.ptr, gelu, h.ptr, st); });
    const double old_down = graph_us([&](cudaStream_t st) { tile_down(down, b, h.ptr, extra, routed.ptr, out.ptr, st); });
    const double new_down = graph_us([&](cudaStream_t st) { decode_down(down, b, h.ptr, extra, out.ptr, st); });
    const double old_all = graph_us([&](cudaStream_t st) {
        tile_glu(gate, up, b, x.ptr, gelu, h.ptr, up_out.ptr, st);
        tile_down(down, b, h.ptr, extra, routed.ptr, out.ptr, st);
    });
    const double new_all = graph_us([&](cudaStream_t st) {
        decode_glu(gate, up, b, x.ptr, gelu, h.ptr, st);
        decode_down(down, b, h.ptr, extra, out.ptr, st);
    });
    const double bytes = (double)b.n_pairs * (2.0 * gate.expert_bytes + down.expert_bytes);
    std::printf("INFO moe decode %s %d tok, %s/%s%s: gate+up+act: tiles %.1f + matvec x2 + act = %.1f us -> fused %.1f us | "
                "down+combine: %.1f us -> fused %.1f us | layer: %.1f us -> %.1f us (%.0f GB/s of expert weights)\n",
                label, n_tokens, FORMATS[gate_format].name, FORMATS[down_format].name, DOWN_EXTRA_NAMES[extra], tiles, old_glu, new_glu,
                old_down, new_down, old_all, new_all, bytes / (new_all * 1e-6) / 1e9);
}

static ExpertStack* random_stack(Format f, int n_expert, int n_rows, int n_cols) {
    return new ExpertStack(f, n_expert, n_rows, n_cols, random_matrix(f, n_expert * n_rows, n_cols));
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
    const bool timing = std::getenv("EMBER_HARNESS_NO_TIMING") == nullptr;
    // Qwen3-30B-A3B: gate/up 768x2048 and down 2048x768 per expert, in every format.
    for (Format f : {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K}) {
        for (bool down : {false, true}) {
            ExpertStack* s = down ? random_stack(f, 128, 2048, 768) : random_stack(f, 128, 768, 2048);
            for (int tokens : {1, 7, 64, 512}) test_grouped(*s, tokens, 8, down);
            if (timing && (f == Q4_K || f == Q6_K))
                for (int tokens : {64, 512}) benchmark_grouped(*s, tokens, 8, down);
            delete s;
        }
    }
    // Gemma 4 26B-A4B: gate/up 704x2816 (q4_K) and down 2816x704 (704 columns: a partial last K
    // step, so only the 32-value formats; q8_0 as the GGUF falls back to).
    {
        ExpertStack* gate = random_stack(Q4_K, 128, 704, 2816);
        for (int tokens : {1, 7, 64, 512}) test_grouped(*gate, tokens, 8, false);
        delete gate;
        ExpertStack* down = random_stack(Q8_0, 128, 2816, 704);
        for (int tokens : {1, 7, 64, 512}) test_grouped(*down, tokens, 8, true);
        delete down;
    }
    // The decode kernels against the tile path, every format, 1 to 4 tokens: Qwen3-30B-A3B (128
    // experts, 8 used, 768x2048; down rows of 12 k-quant units take 16 lanes, 24 blocks of 32
    // take 32), Qwen3.5-35B-A3B (256 experts, 8 used, 512x2048, with its gated shared expert),
    // Gemma 4 26B-A4B (128 experts, 704x2816 with per-expert scales; its down rows are not whole
    // k-quant super-blocks, so only the 32-value formats there), rows of 24 k-quant units (32
    // lanes: Qwen3-235B-A22B's 1536x4096, on 32 experts), and 10 of 512 experts (two rounds of
    // ranks, the second partial).
    for (Format f : {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K}) {
        test_decode("30B-A3B", f, f, 128, 8, 2048, 768);
        test_decode("35B-A3B", f, f, 256, 8, 2048, 512);
        test_decode("26B-A4B", f, FORMATS[f].block_values == 256 ? Q8_0 : f, 128, 8, 2816, 704);
        test_decode("512/10", f, f, 512, 10, 512, 256);
        if (FORMATS[f].block_values == 256) test_decode("235B-A22B", f, f, 32, 8, 4096, 1536);
    }
    if (timing) {
        // One layer's experts at decode, both paths, per kernel (graph launches, L2 flushed).
        for (int tokens : {1, 4}) {
            benchmark_decode("30B-A3B", Q4_K, Q4_K, 128, 8, 2048, 768, false, DOWN_PLAIN, tokens);
            benchmark_decode("30B-A3B", Q4_K, Q6_K, 128, 8, 2048, 768, false, DOWN_PLAIN, tokens);
            benchmark_decode("26B-A4B", Q4_K, Q8_0, 128, 8, 2816, 704, true, DOWN_SCALED, tokens);
            benchmark_decode("26B-A4B", Q4_K, Q5_0, 128, 8, 2816, 704, true, DOWN_SCALED, tokens);
            benchmark_decode("35B-A3B", Q4_K, Q4_K, 256, 8, 2048, 512, false, DOWN_SHARED_GATED, tokens);
        }
    }
    return finish("harness_moe");
}
