// Matvec harness: every ember_matvec_* kernel of kernels/matvec.hip on random blocks of every
// format, 1..8 tokens, odd row counts and grids smaller than one row per warp, against a
// double-precision CPU reference; the in-kernel activation rounding bit for bit against a host
// twin of the CPU backend's quantisers (crates/quant; the Rust tests of crates/gpu/src/ops/
// matvec.rs check the same twin against crates/quant itself); then the weight bandwidth of the
// decode shapes of a Llama-3-8B (14336x4096 and 4096x14336) at 1, 2 and 8 tokens. The fused
// decode kernels (ember_matvec_{swiglu,geglu}_*_t1: gate, up and activation in one; and
// ember_matvec3_*_t1: up to three matrices sharing x) are checked bit for bit against the
// unfused launches they replace, and the fused FFN input is timed against the three launches.
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_matvec.cu -o target/harness_matvec
//   target/harness_matvec
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section;
// EMBER_MATVEC_SWEEP=1 adds a sweep of lanes-per-row and block sizes (tested and timed).
//
// Tolerances. The quantised kernels compute W x̂ where x̂ = d q is the activation rounded as the
// CPU does it (see matvec.hip); the reference reproduces x̂ bit for bit and sums in double
// (q4_1/q5_1 add m s with the CPU's s = f16(d sum q), as the kernel does), so the two differ only
// by f32 rounding inside the kernel: a handful of roundings per unit plus the per-lane and warp
// sums (under 40 roundings for the rows here), each at most 2^-24 relative to the magnitudes
// involved. Those magnitudes include the offset terms that cancel (q4_0's -8 d, q4_1's m, the
// k-quants' dmin * min), so the check is |y - W x̂| <= 1e-5 * sum_i (|w_i| + |offset_i|) |x̂_i|
// (1e-5 > 40 * 2^-24 = 2.4e-6). Against the unquantised x the kernels may differ further by the
// quantisation itself, |W (x - x̂)| <= sum_i (d_i / 2) |w_i| (+ the f16 rounding of d), which is
// checked too. f16 and bf16 weights use x̂ = x rounded to f16 / bf16 (the CPU's rule), f32 x̂ = x.
#include "../matvec.hip"
#include "../elementwise.hip"

#include "harness_common.h"

typedef void (*MatvecKernel)(float*, const uint8_t*, const float*, uint32_t, uint32_t, uint32_t);

// t1, t2, t4, t8 (formats without t2/t4 repeat t8 there).
struct MatvecKernels {
    MatvecKernel k[4];
};

// Indexed by Format.
static const MatvecKernels KERNELS[] = {
    {{ember_matvec_f32_t1, ember_matvec_f32_t8, ember_matvec_f32_t8, ember_matvec_f32_t8}},
    {{ember_matvec_f16_t1, ember_matvec_f16_t8, ember_matvec_f16_t8, ember_matvec_f16_t8}},
    {{ember_matvec_bf16_t1, ember_matvec_bf16_t8, ember_matvec_bf16_t8, ember_matvec_bf16_t8}},
    {{ember_matvec_q4_0_t1, ember_matvec_q4_0_t2, ember_matvec_q4_0_t4, ember_matvec_q4_0_t8}},
    {{ember_matvec_q4_1_t1, ember_matvec_q4_1_t2, ember_matvec_q4_1_t4, ember_matvec_q4_1_t8}},
    {{ember_matvec_q5_0_t1, ember_matvec_q5_0_t2, ember_matvec_q5_0_t4, ember_matvec_q5_0_t8}},
    {{ember_matvec_q5_1_t1, ember_matvec_q5_1_t2, ember_matvec_q5_1_t4, ember_matvec_q5_1_t8}},
    {{ember_matvec_q8_0_t1, ember_matvec_q8_0_t2, ember_matvec_q8_0_t4, ember_matvec_q8_0_t8}},
    {{ember_matvec_q2_k_t1, ember_matvec_q2_k_t8, ember_matvec_q2_k_t8, ember_matvec_q2_k_t8}},
    {{ember_matvec_q3_k_t1, ember_matvec_q3_k_t8, ember_matvec_q3_k_t8, ember_matvec_q3_k_t8}},
    {{ember_matvec_q4_k_t1, ember_matvec_q4_k_t2, ember_matvec_q4_k_t4, ember_matvec_q4_k_t8}},
    {{ember_matvec_q5_k_t1, ember_matvec_q5_k_t2, ember_matvec_q5_k_t4, ember_matvec_q5_k_t8}},
    {{ember_matvec_q6_k_t1, ember_matvec_q6_k_t2, ember_matvec_q6_k_t4, ember_matvec_q6_k_t8}},
};

// The activation format the kernels of f round x to (-1: f32, -2: f16, -3: bf16).
static int act_of(Format f) {
    switch (f) {
        case F32: return -1;
        case F16: return -2;
        case BF16: return -3;
        case Q4_0:
        case Q5_0:
        case Q8_0: return EMBER_ACT_Q8_0;
        case Q4_1:
        case Q5_1: return EMBER_ACT_Q8_1;
        default: return EMBER_ACT_Q8_K;
    }
}
static bool quantised(Format f) { return act_of(f) >= 0; }

// Shared bytes of a launch (ops/matvec.rs shared_bytes).
static size_t shared_for(Format f, int tokens, int n_cols) { return quantised(f) ? ember_matvec_shared_bytes(tokens, n_cols) : 0; }

// Variants of the exported kernels with other lanes-per-row counts (the exported ones use
// EMBER_MATVEC_LANES): tested and timed only with EMBER_MATVEC_SWEEP=1.
template <typename F, int NT, int LANES, int ROWS = EMBER_MATVEC_ROWS>
__global__ void variant_int8(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    ember_matvec_int8<F, NT, LANES, ROWS>(y, w, x, n_rows, n_cols, n_tokens);
}

// The exported int8 kernel with two rows per lane group (ROWS = 2), for 1, 2, 4 and 8 tokens:
// tested and timed against the exported ROWS = EMBER_MATVEC_ROWS at every run.
template <typename F>
static void launch_two_rows(int tokens, int grid, size_t shared, float* y, const uint8_t* w, const float* x, int n_rows, int n_cols) {
    const int t = EMBER_MATVEC_THREADS;
    constexpr int L = EMBER_MATVEC_LANES;
    if (tokens == 1) variant_int8<F, 1, L, 2><<<grid, t, shared>>>(y, w, x, n_rows, n_cols, tokens);
    else if (tokens == 2) variant_int8<F, 2, L, 2><<<grid, t, shared>>>(y, w, x, n_rows, n_cols, tokens);
    else if (tokens <= 4) variant_int8<F, 4, L, 2><<<grid, t, shared>>>(y, w, x, n_rows, n_cols, tokens);
    else variant_int8<F, 8, L, 2><<<grid, t, shared>>>(y, w, x, n_rows, n_cols, tokens);
}
template <typename F, int NT, int LANES>
__global__ void variant_float(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    ember_matvec_float<F, NT, LANES>(y, w, x, n_rows, n_cols, n_tokens);
}

// A kernel configuration: the exported kernel (lanes 0), the exported one with two rows per lane
// group (lanes -2), or a lanes-per-row variant, and its block size.
struct Variant {
    int lanes, threads;
};
static const Variant TWO_ROWS = {-2, EMBER_MATVEC_THREADS};

template <int NT, int LANES>
static void launch_variant(Format f, int grid, int threads, size_t shared, float* y, const uint8_t* w, const float* x, int n_rows,
                           int n_cols, int tokens) {
    switch (f) {
        case Q4_0: variant_int8<EmberMvQ4_0, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        case Q8_0: variant_int8<EmberMvQ8_0, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        case Q4_K: variant_int8<EmberMvQ4_K, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        case Q5_K: variant_int8<EmberMvQ5_K, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        case Q6_K: variant_int8<EmberMvQ6_K, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        case F16: variant_float<EmberMvF16, NT, LANES><<<grid, threads, shared>>>(y, w, x, n_rows, n_cols, tokens); break;
        default: std::fprintf(stderr, "no variant kernels for %s\n", FORMATS[f].name); std::exit(2);
    }
}

// The kernel ops::matvec launches for `tokens` tokens (crates/gpu/src/ops/matvec.rs kernel_name).
static int kernel_slot(int tokens) { return tokens == 1 ? 0 : tokens == 2 ? 1 : tokens <= 4 ? 2 : 3; }

static void launch(Format f, int tokens, int grid, float* y, const uint8_t* w, const float* x, int n_rows, int n_cols,
                   Variant variant = {0, EMBER_MATVEC_THREADS}) {
    const size_t shared = shared_for(f, tokens, n_cols);
    if (variant.lanes == 0) {
        KERNELS[f].k[kernel_slot(tokens)]<<<grid, EMBER_MATVEC_THREADS, shared>>>(y, w, x, n_rows, n_cols, tokens);
        return;
    }
    if (variant.lanes == TWO_ROWS.lanes) {
        switch (f) {
            case Q4_0: launch_two_rows<EmberMvQ4_0>(tokens, grid, shared, y, w, x, n_rows, n_cols); break;
            case Q8_0: launch_two_rows<EmberMvQ8_0>(tokens, grid, shared, y, w, x, n_rows, n_cols); break;
            case Q4_K: launch_two_rows<EmberMvQ4_K>(tokens, grid, shared, y, w, x, n_rows, n_cols); break;
            case Q5_K: launch_two_rows<EmberMvQ5_K>(tokens, grid, shared, y, w, x, n_rows, n_cols); break;
            case Q6_K: launch_two_rows<EmberMvQ6_K>(tokens, grid, shared, y, w, x, n_rows, n_cols); break;
            default: std::fprintf(stderr, "no two-row kernels for %s\n", FORMATS[f].name); std::exit(2);
        }
        return;
    }
    // Variants are compiled for 1 and 8 tokens.
    const int t = variant.threads;
    if (tokens == 1) {
        if (variant.lanes == 8) launch_variant<1, 8>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
        else if (variant.lanes == 16) launch_variant<1, 16>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
        else launch_variant<1, 32>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
    } else {
        if (variant.lanes == 8) launch_variant<8, 8>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
        else if (variant.lanes == 16) launch_variant<8, 16>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
        else launch_variant<8, 32>(f, grid, t, shared, y, w, x, n_rows, n_cols, tokens);
    }
}

// The grid ops::matvec launches: every row group one row, at most 1024 blocks (MAX_GRID).
static int grid_for(int n_rows, Variant variant) {
    const int lanes = variant.lanes > 0 ? variant.lanes : EMBER_MATVEC_LANES;
    const int rows_per_block = variant.threads / lanes * (variant.lanes == TWO_ROWS.lanes ? 2 : EMBER_MATVEC_ROWS);
    return std::min(1024, (n_rows + rows_per_block - 1) / rows_per_block);
}

// bf16 rounding to nearest even (crates/quant's f32_to_bf16_bits), as f32.
static float round_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) & 0xffff0000u;
    else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float r;
    std::memcpy(&r, &u, 4);
    return r;
}

// Host twin of the CPU backend's activation quantisers in the layout of matvec.hip's
// ember_mv_quantize: q per value, (d, s) per group of 32 (see EMBER_ACT_*).
struct Quantised {
    std::vector<int8_t> q;
    std::vector<float> d, s;
};

static Quantised quantize_reference(int act, const std::vector<float>& x) {
    Quantised out;
    out.q.assign(x.size(), 0);
    out.d.assign(x.size() / 32, 0.0f);
    out.s.assign(x.size() / 32, 0.0f);
    const size_t block = act == EMBER_ACT_Q8_K ? 256 : 32;
    for (size_t b0 = 0; b0 < x.size(); b0 += block) {
        float d;
        if (act == EMBER_ACT_Q8_K) {
            float best = 0.0f, best_abs = 0.0f;
            for (size_t i = b0; i < b0 + block; ++i)
                if (std::fabs(x[i]) > best_abs) best_abs = std::fabs(x[i]), best = x[i];
            const float iscale = best_abs > 0.0f ? -127.0f / best : 0.0f;
            for (size_t i = b0; i < b0 + block; ++i) {
                const float p = iscale * x[i];
                out.q[i] = (int8_t)std::min(127, (int)std::nearbyint(p));
            }
            d = best_abs > 0.0f ? 1.0f / iscale : 0.0f;
        } else {
            float amax = 0.0f;
            for (size_t i = b0; i < b0 + block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            for (size_t i = b0; i < b0 + block; ++i) {
                const float p = x[i] * id;
                out.q[i] = (int8_t)std::max(-128, std::min(127, (int)std::nearbyint(p)));
            }
            d = amax / 127.0f;
        }
        for (size_t g = b0 / 32; g < (b0 + block) / 32; ++g) {
            int sum = 0;
            for (int i = 0; i < 32; ++i) sum += out.q[32 * g + i];
            if (act == EMBER_ACT_Q8_K) out.d[g] = d, out.s[g] = (float)sum;
            else if (act == EMBER_ACT_Q8_0) out.d[g] = round_to_half(d), out.s[g] = (float)sum;
            else out.d[g] = round_to_half(d), out.s[g] = round_to_half((float)sum * d);
        }
    }
    return out;
}

template <int ACT>
__global__ void quantize_probe(int8_t* xq, float2* xds, const float* x, uint32_t n_values, uint32_t n_cols) {
    ember_mv_quantize<ACT>(xq, xds, x, n_values, n_cols);
}

// Activations whose groups differ in amplitude, with exact rounding ties (a group whose amax is
// 127, so the multiplier is 1 and the values x.5 round to even), an all-zero group and, in one
// 256-value block, the largest magnitude held by a negative and a later positive value.
static std::vector<float> awkward_activations(size_t n) {
    std::vector<float> x(n);
    for (size_t g = 0; g < n / 32; ++g) {
        const float amplitude = std::pow(10.0f, uniform(-3, 2));
        for (int i = 0; i < 32; ++i) x[32 * g + i] = amplitude * uniform(-1, 1);
    }
    if (n >= 1024) {
        for (int i = 0; i < 32; ++i) x[64 + i] = i == 0 ? 127.0f : (float)(i - 16) + 0.5f;
        x[256 + 3] = -50.0f, x[256 + 200] = 50.0f;
        for (int i = 0; i < 32; ++i) x[512 + i] = 0.0f;
    }
    return x;
}

static void test_quantize() {
    const int n_values = 256 * 40;
    const std::vector<float> x = awkward_activations(n_values);
    const char* names[] = {"Q8_0", "Q8_1", "Q8_K"};
    for (int act = 0; act < 3; ++act) {
        DeviceBuffer<float> dx(x);
        DeviceBuffer<int8_t> dq(n_values);
        DeviceBuffer<float2> dds(n_values / 32);
        // 96 threads: three teams, so teams take several 256-value chunks each.
        // Four rows of n_values / 4: the chunk-major layout restarts at every row.
        const uint32_t n_cols = n_values / 4;
        if (act == EMBER_ACT_Q8_0) quantize_probe<EMBER_ACT_Q8_0><<<1, 96>>>(dq.ptr, dds.ptr, dx.ptr, n_values, n_cols);
        else if (act == EMBER_ACT_Q8_1) quantize_probe<EMBER_ACT_Q8_1><<<1, 96>>>(dq.ptr, dds.ptr, dx.ptr, n_values, n_cols);
        else quantize_probe<EMBER_ACT_Q8_K><<<1, 96>>>(dq.ptr, dds.ptr, dx.ptr, n_values, n_cols);
        sync();
        const Quantised want = quantize_reference(act, x);
        const std::vector<int8_t> gq = dq.download();
        const std::vector<float2> gds = dds.download();
        uint32_t wrong = 0;
        // Value v of row t sits in chunk (v % 32) / 16 of its group (matvec.hip's ember_mv_xq_offset).
        for (int i = 0; i < n_values; ++i) {
            const uint32_t t = i / n_cols, v = i % n_cols, o = v % 32;
            const size_t at = ((size_t)(2 * t + o / 16) * (n_cols / 32) + v / 32) * 16 + o % 16;
            wrong += gq[at] != want.q[i];
        }
        for (int g = 0; g < n_values / 32; ++g) wrong += gds[g].x != want.d[g] || gds[g].y != want.s[g];
        char name[96];
        std::snprintf(name, sizeof name, "activations as %s (values and scales not bit-exact)", names[act]);
        report(name, wrong, 0.0);
    }
}

static void test_format(Format f, int n_rows, int n_cols, Variant variant = {0, EMBER_MATVEC_THREADS}) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t row_bytes = row_bytes_of(f, n_cols);
    const FormatInfo& info = FORMATS[f];
    std::vector<std::vector<float>> rows(n_rows);
    std::vector<std::vector<double>> offsets(n_rows, std::vector<double>(n_cols));
    for (int r = 0; r < n_rows; ++r) {
        rows[r] = dequant_row(f, w.data() + r * row_bytes, n_cols);
        for (int c = 0; c < n_cols; ++c) offsets[r][c] = offset_magnitude(f, w.data() + r * row_bytes, c);
    }
    DeviceBuffer<uint8_t> dw(w);
    double worst_kernel = 0.0, worst_bound = 0.0;
    const int act = act_of(f);
    for (int tokens = 1; tokens <= 8; ++tokens) {
        if (variant.lanes > 0 && tokens != 1 && tokens != 8) continue;  // variants exist for 1 and 8 tokens
        const std::vector<float> x = awkward_activations((size_t)tokens * n_cols);
        // x̂ per value, and the Q8_1 correction m (s - d sum q) per block.
        std::vector<double> xh(x.size());
        Quantised quant;
        if (quantised(f)) {
            quant = quantize_reference(act, x);
            for (size_t i = 0; i < x.size(); ++i) xh[i] = (double)quant.d[i / 32] * quant.q[i];
        } else {
            for (size_t i = 0; i < x.size(); ++i) xh[i] = act == -2 ? round_to_half(x[i]) : act == -3 ? round_to_bf16(x[i]) : x[i];
        }
        DeviceBuffer<float> dx(x), dy((size_t)tokens * n_rows);
        // One row per row group, and a grid of 3 blocks that must stride over the rows.
        for (int grid : {grid_for(n_rows, variant), 3}) {
            CHECK_CUDA(cudaMemset(dy.ptr, 0xff, (size_t)tokens * n_rows * sizeof(float)));
            launch(f, tokens, grid, dy.ptr, dw.ptr, dx.ptr, n_rows, n_cols, variant);
            sync();
            const std::vector<float> y = dy.download();
            for (int t = 0; t < tokens; ++t)
                for (int r = 0; r < n_rows; ++r) {
                    double reference = 0.0, exact = 0.0, magnitude = 0.0, quantisation = 0.0;
                    for (int c = 0; c < n_cols; ++c) {
                        const size_t i = (size_t)t * n_cols + c;
                        reference += (double)rows[r][c] * xh[i];
                        exact += (double)rows[r][c] * x[i];
                        magnitude += (std::fabs((double)rows[r][c]) + offsets[r][c]) * std::fabs(xh[i]);
                        quantisation += std::fabs((double)rows[r][c]) * std::fabs(xh[i] - (double)x[i]);
                    }
                    if (act == EMBER_ACT_Q8_1)
                        for (int g = 0; g < n_cols / 32; ++g) {
                            const size_t gi = ((size_t)t * n_cols) / 32 + g;
                            int sum = 0;
                            for (int i = 0; i < 32; ++i) sum += quant.q[32 * gi + i];
                            const double m = half_at(w.data() + r * row_bytes + (size_t)g * info.block_bytes + 2);
                            reference += m * ((double)quant.s[gi] - (double)quant.d[gi] * sum);
                            magnitude += std::fabs(m * quant.s[gi]);
                        }
                    const double got = y[(size_t)t * n_rows + r];
                    const double tolerance = 1e-5 * magnitude + 1e-30;
                    worst_kernel = std::fmax(worst_kernel, std::fabs(got - reference) / tolerance);
                    // The quantisation term is what x̂ moved each value by; the Q8_1 sum term adds
                    // at most the f16 rounding of s (2^-11 relative) per block.
                    worst_bound = std::fmax(worst_bound, std::fabs(got - exact) / (quantisation + 2.0 * tolerance + 1e-3 * magnitude * (act == EMBER_ACT_Q8_1)));
                }
        }
    }
    char name[160], what[48] = "1..8 tokens";
    if (variant.lanes > 0) std::snprintf(what, sizeof what, "%d lanes/row, %d threads, 1+8 tokens", variant.lanes, variant.threads);
    else if (variant.lanes == TWO_ROWS.lanes) std::snprintf(what, sizeof what, "2 rows/lane group, 1..8 tokens");
    std::snprintf(name, sizeof name, "matvec_%s %dx%d, %s: |y - W x^| / (1e-5 sum |w x^|)", FORMATS[f].name, n_rows, n_cols, what);
    report(name, worst_kernel, 1.0);
    std::snprintf(name, sizeof name, "matvec_%s %dx%d, %s: |y - W x| / quantisation bound", FORMATS[f].name, n_rows, n_cols, what);
    report(name, worst_bound, 1.0);
}

typedef void (*GluKernel)(float*, const uint8_t*, const uint8_t*, const float*, uint32_t, uint32_t);

// The fused gate/up kernels of `f` ({swiglu, geglu}); nullptr where there are none (q2_K, q3_K).
static void glu_kernels(Format f, GluKernel out[2]) {
    out[0] = out[1] = nullptr;
    switch (f) {
#define EMBER_GLU_CASE(F, name)                     \
    case F:                                         \
        out[0] = ember_matvec_swiglu_##name##_t1;   \
        out[1] = ember_matvec_geglu_##name##_t1;    \
        break;
        EMBER_GLU_CASE(F32, f32)
        EMBER_GLU_CASE(F16, f16)
        EMBER_GLU_CASE(BF16, bf16)
        EMBER_GLU_CASE(Q4_0, q4_0)
        EMBER_GLU_CASE(Q4_1, q4_1)
        EMBER_GLU_CASE(Q5_0, q5_0)
        EMBER_GLU_CASE(Q5_1, q5_1)
        EMBER_GLU_CASE(Q8_0, q8_0)
        EMBER_GLU_CASE(Q4_K, q4_k)
        EMBER_GLU_CASE(Q5_K, q5_k)
        EMBER_GLU_CASE(Q6_K, q6_k)
#undef EMBER_GLU_CASE
        default: break;
    }
}

// The fused gate/up/activation kernels against the unfused sequence they replace (the t1 matvec
// of gate, of up, then ember_silu_mul_f32 / ember_gelu_mul_f32): the same arithmetic in the same
// order, so every value must be equal bit for bit (counted as differing values, tolerance 0). Two
// grids: the one ops launches and 3 blocks that stride over the rows. Scaled activations push the
// GELU inputs across its +-10 limits too.
static void test_glu(Format f, int n_rows, int n_cols) {
    GluKernel fused[2];
    glu_kernels(f, fused);
    if (!fused[0]) return;
    const std::vector<uint8_t> wg = random_matrix(f, n_rows, n_cols), wu = random_matrix(f, n_rows, n_cols);
    DeviceBuffer<uint8_t> dwg(wg), dwu(wu);
    std::vector<float> x = awkward_activations((size_t)n_cols);
    for (float& v : x) v *= 4.0f;
    DeviceBuffer<float> dx(x), dg(n_rows), du(n_rows), dref(n_rows), dfused(n_rows);
    const size_t shared = shared_for(f, 1, n_cols);
    uint32_t differ[2] = {0, 0};
    for (int a = 0; a < 2; ++a)
        for (int grid : {grid_for(n_rows, {0, EMBER_MATVEC_THREADS}), 3}) {
            CHECK_CUDA(cudaMemset(dfused.ptr, 0xff, (size_t)n_rows * sizeof(float)));
            KERNELS[f].k[0]<<<grid, EMBER_MATVEC_THREADS, shared>>>(dg.ptr, dwg.ptr, dx.ptr, n_rows, n_cols, 1);
            KERNELS[f].k[0]<<<grid, EMBER_MATVEC_THREADS, shared>>>(du.ptr, dwu.ptr, dx.ptr, n_rows, n_cols, 1);
            if (a == 0) ember_silu_mul_f32<<<4, 256>>>(dref.ptr, dg.ptr, du.ptr, n_rows);
            else ember_gelu_mul_f32<<<4, 256>>>(dref.ptr, dg.ptr, du.ptr, n_rows);
            fused[a]<<<grid, EMBER_MATVEC_THREADS, shared>>>(dfused.ptr, dwg.ptr, dwu.ptr, dx.ptr, n_rows, n_cols);
            sync();
            const std::vector<float> want = dref.download(), got = dfused.download();
            for (int r = 0; r < n_rows; ++r) differ[a] += std::memcmp(&want[r], &got[r], sizeof(float)) != 0;
        }
    char name[160];
    std::snprintf(name, sizeof name, "matvec_swiglu_%s %dx%d vs matvec + matvec + silu_mul (differing values)", FORMATS[f].name, n_rows, n_cols);
    report(name, differ[0], 0.0);
    std::snprintf(name, sizeof name, "matvec_geglu_%s %dx%d vs matvec + matvec + gelu_mul (differing values)", FORMATS[f].name, n_rows, n_cols);
    report(name, differ[1], 0.0);
}

typedef void (*Matvec3Kernel)(float*, float*, float*, const uint8_t*, const uint8_t*, const uint8_t*, const float*, uint32_t, uint32_t,
                              uint32_t, uint32_t);

// The multi-matrix kernel of `f` (nullptr for q2_K, q3_K).
static Matvec3Kernel matvec3_kernel(Format f) {
    switch (f) {
        case F32: return ember_matvec3_f32_t1;
        case F16: return ember_matvec3_f16_t1;
        case BF16: return ember_matvec3_bf16_t1;
        case Q4_0: return ember_matvec3_q4_0_t1;
        case Q4_1: return ember_matvec3_q4_1_t1;
        case Q5_0: return ember_matvec3_q5_0_t1;
        case Q5_1: return ember_matvec3_q5_1_t1;
        case Q8_0: return ember_matvec3_q8_0_t1;
        case Q4_K: return ember_matvec3_q4_k_t1;
        case Q5_K: return ember_matvec3_q5_k_t1;
        case Q6_K: return ember_matvec3_q6_k_t1;
        default: return nullptr;
    }
}

// Q, K and V in one launch against three t1 launches: the same arithmetic per row, so equal bit
// for bit (differing values counted, tolerance 0); also two matrices with an empty third segment
// (null pointers), and a grid of 3 blocks that must stride over the combined rows.
static void test_matvec3(Format f, int n_cols) {
    const Matvec3Kernel kernel = matvec3_kernel(f);
    if (!kernel) return;
    const int rows[3] = {37, 11, 19};
    std::vector<DeviceBuffer<uint8_t>*> w;
    std::vector<DeviceBuffer<float>*> want, got;
    for (int s = 0; s < 3; ++s) {
        w.push_back(new DeviceBuffer<uint8_t>(random_matrix(f, rows[s], n_cols)));
        want.push_back(new DeviceBuffer<float>((size_t)rows[s]));
        got.push_back(new DeviceBuffer<float>((size_t)rows[s]));
    }
    const std::vector<float> x = awkward_activations((size_t)n_cols);
    DeviceBuffer<float> dx(x);
    const size_t shared = shared_for(f, 1, n_cols);
    uint32_t differ = 0;
    for (int segments : {3, 2})
        for (int grid : {grid_for(rows[0] + rows[1] + (segments == 3 ? rows[2] : 0), {0, EMBER_MATVEC_THREADS}), 3}) {
            for (int s = 0; s < 3; ++s) {
                CHECK_CUDA(cudaMemset(got[s]->ptr, 0xff, (size_t)rows[s] * sizeof(float)));
                KERNELS[f].k[0]<<<grid_for(rows[s], {0, EMBER_MATVEC_THREADS}), EMBER_MATVEC_THREADS, shared>>>(
                    want[s]->ptr, w[s]->ptr, dx.ptr, rows[s], n_cols, 1);
            }
            if (segments == 3)
                kernel<<<grid, EMBER_MATVEC_THREADS, shared>>>(got[0]->ptr, got[1]->ptr, got[2]->ptr, w[0]->ptr, w[1]->ptr, w[2]->ptr, dx.ptr,
                                                              rows[0], rows[1], rows[2], n_cols);
            else
                kernel<<<grid, EMBER_MATVEC_THREADS, shared>>>(got[0]->ptr, got[1]->ptr, nullptr, w[0]->ptr, w[1]->ptr, nullptr, dx.ptr,
                                                              rows[0], rows[1], 0, n_cols);
            sync();
            for (int s = 0; s < segments; ++s) {
                const std::vector<float> a = want[s]->download(), b = got[s]->download();
                for (int r = 0; r < rows[s]; ++r) differ += std::memcmp(&a[r], &b[r], sizeof(float)) != 0;
            }
            if (segments == 2) {
                // The empty third segment is left alone.
                const std::vector<float> untouched = got[2]->download();
                for (float v : untouched) {
                    uint32_t bits;
                    std::memcpy(&bits, &v, 4);
                    differ += bits != 0xffffffffu;
                }
            }
        }
    for (int s = 0; s < 3; ++s) {
        delete w[s];
        delete want[s];
        delete got[s];
    }
    char name[160];
    std::snprintf(name, sizeof name, "matvec3_%s 37+11+19 x %d vs three t1 launches (differing values)", FORMATS[f].name, n_cols);
    report(name, differ, 0.0);
}

// Time of the FFN input of a Llama-3-8B decode step (gate and up 14336x4096, one token): the
// fused SwiGLU kernel against the three launches it replaces. Median of 30, matrices cycled
// through enough copies that L2 does not hold them.
static void benchmark_glu(Format f) {
    GluKernel fused[2];
    glu_kernels(f, fused);
    if (!fused[0]) return;
    const int n_rows = 14336, n_cols = 4096;
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    const size_t copies = std::max<size_t>(2, (size_t)std::ceil(1.5 * 64e6 / (double)w.size()));
    std::vector<DeviceBuffer<uint8_t>*> matrices;
    for (size_t i = 0; i < copies; ++i) matrices.push_back(new DeviceBuffer<uint8_t>(w));
    DeviceBuffer<float> dx(random_floats(n_cols)), dg(n_rows), du(n_rows);
    const size_t shared = shared_for(f, 1, n_cols);
    const int grid = grid_for(n_rows, {0, EMBER_MATVEC_THREADS});
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    double us[2];
    for (int fuse = 0; fuse < 2; ++fuse) {
        std::vector<float> samples;
        for (int i = 0; i < 33; ++i) {
            const uint8_t* a = matrices[(2 * i) % copies]->ptr;
            const uint8_t* b = matrices[(2 * i + 1) % copies]->ptr;
            CHECK_CUDA(cudaEventRecord(start));
            if (fuse) {
                fused[0]<<<grid, EMBER_MATVEC_THREADS, shared>>>(dg.ptr, a, b, dx.ptr, n_rows, n_cols);
            } else {
                KERNELS[f].k[0]<<<grid, EMBER_MATVEC_THREADS, shared>>>(dg.ptr, a, dx.ptr, n_rows, n_cols, 1);
                KERNELS[f].k[0]<<<grid, EMBER_MATVEC_THREADS, shared>>>(du.ptr, b, dx.ptr, n_rows, n_cols, 1);
                ember_silu_mul_f32<<<(n_rows + 255) / 256, 256>>>(dg.ptr, dg.ptr, du.ptr, n_rows);
            }
            CHECK_CUDA(cudaEventRecord(stop));
            CHECK_CUDA(cudaEventSynchronize(stop));
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
            if (i >= 3) samples.push_back(ms);
        }
        us[fuse] = median(samples) * 1e3;
    }
    std::printf("INFO ffn gate+up+swiglu %-5s 14336x4096 1 token: unfused %7.1f us, fused %7.1f us (%6.0f GB/s of weights)\n",
                FORMATS[f].name, us[0], us[1], 2.0 * w.size() / (us[1] * 1e-6) / 1e9);
    for (auto* m : matrices) delete m;
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

// Weight bandwidth: median of 30 launches (CUDA events around each), cycling through enough
// copies of the matrix that none is still in L2 when it is read again. One random matrix serves
// both decode shapes (its blocks are independent, so the same bytes are a 14336x4096 and a
// 4096x14336 matrix) and every (token count, kernel configuration) run of a shape. Token counts
// whose activations exceed the shared memory of one launch are split as ops::matvec splits them.
static void benchmark(Format f, const std::vector<std::pair<int, Variant>> (&runs)[2]) {
    const int shapes[2][2] = {{14336, 4096}, {4096, 14336}};
    const std::vector<uint8_t> w = random_matrix(f, shapes[0][0], shapes[0][1]);
    const size_t bytes = w.size();
    const size_t copies = std::max<size_t>(2, (size_t)std::ceil(1.5 * 64e6 / (double)bytes));
    std::vector<DeviceBuffer<uint8_t>*> matrices;
    for (size_t i = 0; i < copies; ++i) matrices.push_back(new DeviceBuffer<uint8_t>(w));
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int shape = 0; shape < 2; ++shape) {
        const int n_rows = shapes[shape][0], n_cols = shapes[shape][1];
        for (const auto& run : runs[shape]) {
            const int tokens = run.first;
            const Variant variant = run.second;
            int per_launch = tokens;
            while (quantised(f) && shared_for(f, per_launch, n_cols) > 48 * 1024) --per_launch;
            const std::vector<float> x = random_floats((size_t)tokens * n_cols);
            DeviceBuffer<float> dx(x), dy((size_t)tokens * n_rows);
            const int grid = grid_for(n_rows, variant);
            std::vector<float> samples;
            for (int i = 0; i < 33; ++i) {
                CHECK_CUDA(cudaEventRecord(start));
                for (int first = 0; first < tokens; first += per_launch)
                    launch(f, std::min(per_launch, tokens - first), grid, dy.ptr + (size_t)first * n_rows, matrices[i % copies]->ptr,
                           dx.ptr + (size_t)first * n_cols, n_rows, n_cols, variant);
                CHECK_CUDA(cudaEventRecord(stop));
                CHECK_CUDA(cudaEventSynchronize(stop));
                float ms = 0;
                CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
                if (i >= 3) samples.push_back(ms);  // the first launches load the module and warm the clocks
            }
            sync();
            const double seconds = median(samples) / 1e3;
            char config[48] = "exported";
            if (variant.lanes > 0) std::snprintf(config, sizeof config, "%2d lanes/row %3d threads", variant.lanes, variant.threads);
            else if (variant.lanes == TWO_ROWS.lanes) std::snprintf(config, sizeof config, "2 rows/lane group");
            std::printf("INFO matvec_%-5s %5dx%-5d %d token(s) [%s, %d launch(es)]: %7.1f us, %6.0f GB/s of weights\n", FORMATS[f].name,
                        n_rows, n_cols, tokens, config, (tokens + per_launch - 1) / per_launch, seconds * 1e6, bytes / seconds / 1e9);
        }
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
    for (Format f : {Q4_0, Q8_0, Q4_K, Q5_K, Q6_K}) test_format(f, 37, 768, TWO_ROWS);
    for (int fi = F32; fi <= Q6_K; ++fi) {
        test_glu((Format)fi, 37, 768);
        test_glu((Format)fi, 101, 2048);
        test_matvec3((Format)fi, 768);
        test_matvec3((Format)fi, 4096);
    }
    const bool sweep = std::getenv("EMBER_MATVEC_SWEEP") != nullptr;
    const Variant variants[] = {{8, 128}, {16, 128}, {32, 128}, {8, 256}, {16, 256}, {32, 256}};
    if (sweep)
        for (Format f : {Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, F16})
            for (const Variant& v : variants) test_format(f, 37, 768, v);
    if (std::getenv("EMBER_HARNESS_NO_TIMING") == nullptr) {
        // The exported kernels for every format at 1 token, and at 2 and 8 tokens for the
        // formats of the 8B models; with EMBER_MATVEC_SWEEP, other lanes-per-row counts and
        // block sizes (to choose EMBER_MATVEC_LANES / EMBER_MATVEC_THREADS).
        const Variant exported = {0, EMBER_MATVEC_THREADS};
        for (int fi = F32; fi <= Q6_K; ++fi) {
            const Format f = (Format)fi;
            const bool main_format = f == Q4_0 || f == Q8_0 || f == Q4_K || f == Q5_K || f == Q6_K || f == F16;
            std::vector<std::pair<int, Variant>> runs[2];
            for (int shape = 0; shape < 2; ++shape) {
                runs[shape] = {{1, exported}};
                if (main_format) runs[shape].insert(runs[shape].end(), {{2, exported}, {8, exported}});
                if (main_format && f != F16) runs[shape].insert(runs[shape].end(), {{1, TWO_ROWS}, {2, TWO_ROWS}, {8, TWO_ROWS}});
                if (sweep && main_format)
                    for (const Variant& v : variants) runs[shape].push_back({1, v}), runs[shape].push_back({8, v});
            }
            benchmark(f, runs);
        }
        for (Format f : {Q4_0, Q4_K, Q6_K, F16}) benchmark_glu(f);
    }
    return finish("harness_matvec");
}
