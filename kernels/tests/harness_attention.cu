// Attention harness: ember_kv_store_f16 and the attention kernels of kernels/attention.hip
// (decode: partial + reduce; prefill: tiled flash attention; prefill on the tensor cores for
// heads of 64 and 128) on random inputs, against a
// straightforward double-precision CPU reference, plus the time of Llama-3-8B-shaped launches.
//
// Every case builds a paged cache whose blocks are separate device allocations at shuffled
// physical ids (some ids unused, address 0), stores the cached tokens and then the new ones with
// ember_kv_store_f16 (with padding slots that must be skipped), and runs one batch holding
// several sequences: a 300-token prefill from empty, prefills appended to existing caches,
// single decode tokens at partition boundaries. Both kernels run on every batch (each computes
// the same function for any batch). Cases: head_dim 64/80/128/256/320/512 x GQA group 1/4/8 x
// (no window | window) x (no softcap | softcap 5), block sizes 16 and 7 (320 takes the d512
// prefill kernel with a partial last chunk and the decode kernel's generic path; 512 is Gemma 4's
// global head, 256 its sliding one), then Gemma 4 26B-A4B's own layer shapes, then deep caches
// (prefills of 1..512 queries, ragged tails included, after 0, 100, 1000 and 4096 cached tokens)
// for heads of 64 and 128 at GQA groups 1, 4 and 8, where the tensor-core kernel matters.
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_attention.cu -o target/harness_attention
//   target/harness_attention
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section.
//
// Tolerances (eps = 2^-24, |v| <= 1, S = scale * max over visible keys of sum_d |q_d k_d|):
// * kv_store: bit-exact f16 round-to-nearest-even of the inputs.
// * against a reference fed the same f16-rounded q, k, v (so only f32 arithmetic differs): a
//   score is a sum of head_dim products, off by at most (head_dim + 4) eps S; shifting every
//   score by at most ds moves the softmax-weighted mean of values by at most (e^(2 ds) - 1) max|v|
//   (~2.2 ds); the sums of weights and of weighted values carry at most (n_keys + 8) eps relative
//   error each (sequential sums, expf's 2 ulps, the reduce's rescaling); softcap adds tanhf's few
//   ulps of the cap. Hence tol = 2.2 (head_dim + 4) eps S + 2 (n_keys + 8) eps + 8 eps cap + 1e-7.
// * against a reference fed the unrounded f32 q, k, v: f16 rounding moves q and k by 2^-11
//   relative each, hence each score by at most 2^-10 S (+ 2^-22 S), and v by 2^-11: the bound is
//   2.2 (2^-10 + 2^-22) S + 2^-11 + the previous tolerance.
// * the tensor-core prefill (ember_attention_prefill_mma_dN) also rounds the softmax weights to
//   f16 before P V and sums the rounded weights: every weight moves by at most 2^-11 relative
//   (normal range) or 2^-25 absolute (subnormal range, weights below 2^-14 of the row's largest,
//   which is 1), so the weighted mean of values moves by at most 2 (2^-11 + n_keys 2^-25) max|v|
//   / (1 - 2^-11): the bound adds 2^-10 (1 + 2^-10) + n_keys 2^-24 to both tolerances above.
//   Its sums run on the tensor cores, whose f32 accumulation may truncate (up to 1 ulp per
//   addition where the bounds above assume rounding's 1/2), so the score and sum terms count
//   twice: 2.2 (head_dim + 4) eps S + 2 (n_keys + 8) eps more.
#include "../attention.hip"

#include "harness_common.h"

struct Sequence {
    int cached, added;
};

struct Case {
    int n_heads, n_kv_heads, head_dim, block_size, window;
    float softcap;
    std::vector<Sequence> sequences;
};

// A paged cache and a batch, on the device.
struct Setup {
    int n_tokens = 0, n_tables = 0, max_blocks = 0, row_values = 0, max_position = 0;
    std::vector<void*> allocations;
    std::vector<uint64_t> k_addresses, v_addresses;
    std::vector<int32_t> tables, table_of_token, positions;
    std::vector<std::vector<float>> k, v;  // per table: [position, row_values]
    std::vector<float> q;                  // [n_tokens, n_heads, head_dim]
    ~Setup() {
        for (void* p : allocations) (void)cudaFree(p);
    }
};

static void build(const Case& c, Setup& s) {
    const int bs = c.block_size;
    s.n_tables = (int)c.sequences.size();
    s.row_values = c.n_kv_heads * c.head_dim;
    int total_blocks = 0;
    for (const Sequence& seq : c.sequences) {
        const int blocks = (seq.cached + seq.added + bs - 1) / bs;
        s.max_blocks = std::max(s.max_blocks, blocks);
        total_blocks += blocks;
    }
    s.max_blocks += 1;  // an unused column: the table stride is not the sequence's block count
    // Physical ids: shuffled, with 7 ids that no table uses (address 0).
    const int n_physical = total_blocks + 7;
    std::vector<int> ids(n_physical);
    for (int i = 0; i < n_physical; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), g_rng);
    s.k_addresses.assign(n_physical, 0);
    s.v_addresses.assign(n_physical, 0);
    s.tables.assign((size_t)s.n_tables * s.max_blocks, -1);
    int next = 0;
    for (int t = 0; t < s.n_tables; ++t) {
        const Sequence& seq = c.sequences[t];
        const int blocks = (seq.cached + seq.added + bs - 1) / bs;
        for (int b = 0; b < blocks; ++b) {
            const int id = ids[next++];
            s.tables[(size_t)t * s.max_blocks + b] = id;
            void* kp;
            void* vp;
            CHECK_CUDA(cudaMalloc(&kp, (size_t)bs * s.row_values * 2));
            CHECK_CUDA(cudaMalloc(&vp, (size_t)bs * s.row_values * 2));
            s.allocations.push_back(kp);
            s.allocations.push_back(vp);
            s.k_addresses[id] = (uint64_t)(uintptr_t)kp;
            s.v_addresses[id] = (uint64_t)(uintptr_t)vp;
        }
        s.k.push_back(random_floats((size_t)(seq.cached + seq.added) * s.row_values));
        s.v.push_back(random_floats((size_t)(seq.cached + seq.added) * s.row_values));
        for (int i = 0; i < seq.added; ++i) {
            s.table_of_token.push_back(t);
            s.positions.push_back(seq.cached + i);
            s.max_position = std::max(s.max_position, seq.cached + i);
        }
    }
    s.n_tokens = (int)s.positions.size();
    // Queries of amplitude 4 make peaked softmaxes and scores beyond a cap of 5.
    s.q = random_floats((size_t)s.n_tokens * c.n_heads * c.head_dim, -4.0f, 4.0f);
}

static int32_t slot_of(const Setup& s, int table, int position, int bs) {
    return s.tables[(size_t)table * s.max_blocks + position / bs] * bs + position % bs;
}

// Stores positions [from(t), to(t)) of every table with ember_kv_store_f16, with two padding
// rows (slot -1, garbage values) in the batch.
static void store(const Case& c, const Setup& s, const uint64_t* dk_blocks, const uint64_t* dv_blocks, bool added) {
    std::vector<float> k_rows, v_rows;
    std::vector<int32_t> slots;
    auto padding = [&]() {
        slots.push_back(-1);
        for (int i = 0; i < s.row_values; ++i) k_rows.push_back(1e4f), v_rows.push_back(-1e4f);
    };
    padding();
    for (int t = 0; t < s.n_tables; ++t) {
        const Sequence& seq = c.sequences[t];
        const int from = added ? seq.cached : 0, to = added ? seq.cached + seq.added : seq.cached;
        for (int p = from; p < to; ++p) {
            slots.push_back(slot_of(s, t, p, c.block_size));
            k_rows.insert(k_rows.end(), s.k[t].begin() + (size_t)p * s.row_values, s.k[t].begin() + (size_t)(p + 1) * s.row_values);
            v_rows.insert(v_rows.end(), s.v[t].begin() + (size_t)p * s.row_values, s.v[t].begin() + (size_t)(p + 1) * s.row_values);
        }
    }
    padding();
    DeviceBuffer<float> dk(k_rows), dv(v_rows);
    DeviceBuffer<int32_t> dslots(slots);
    ember_kv_store_f16<<<(unsigned)slots.size(), 256>>>(dk_blocks, dv_blocks, dk.ptr, dv.ptr, dslots.ptr, s.row_values, c.block_size);
    sync();
}

// Counts stored halves that are not the round-to-nearest-even f16 of their input.
static uint32_t check_store(const Case& c, const Setup& s) {
    uint32_t wrong = 0;
    std::vector<uint16_t> block((size_t)c.block_size * s.row_values);
    for (int t = 0; t < s.n_tables; ++t) {
        const int length = c.sequences[t].cached + c.sequences[t].added;
        for (int which = 0; which < 2; ++which) {
            const std::vector<uint64_t>& addresses = which ? s.v_addresses : s.k_addresses;
            const std::vector<float>& values = which ? s.v[t] : s.k[t];
            for (int b = 0; b * c.block_size < length; ++b) {
                const int id = s.tables[(size_t)t * s.max_blocks + b];
                CHECK_CUDA(cudaMemcpy(block.data(), (const void*)(uintptr_t)addresses[id], block.size() * 2, cudaMemcpyDeviceToHost));
                for (int o = 0; o < c.block_size && b * c.block_size + o < length; ++o)
                    for (int i = 0; i < s.row_values; ++i)
                        wrong += block[(size_t)o * s.row_values + i] != to_half_bits(values[(size_t)(b * c.block_size + o) * s.row_values + i]);
            }
        }
    }
    return wrong;
}

struct Reference {
    std::vector<double> out;
    std::vector<double> score_magnitude;  // S per (token, head)
    std::vector<int> n_keys;              // visible keys per token
};

// Causal attention in double; `rounded` feeds it the f16 values the kernels see.
static Reference reference(const Case& c, const Setup& s, float scale, bool rounded) {
    const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
    Reference r;
    r.out.assign((size_t)s.n_tokens * c.n_heads * hd, 0.0);
    r.score_magnitude.assign((size_t)s.n_tokens * c.n_heads, 0.0);
    r.n_keys.assign(s.n_tokens, 0);
    auto f16 = [&](float x) { return rounded ? (double)round_to_half(x) : (double)x; };
    std::vector<double> scores, qh(hd);
    for (int t = 0; t < s.n_tokens; ++t) {
        const int table = s.table_of_token[t], pos = s.positions[t];
        const int first = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;
        r.n_keys[t] = pos + 1 - first;
        for (int h = 0; h < c.n_heads; ++h) {
            const int kvh = h / group;
            for (int d = 0; d < hd; ++d) qh[d] = f16(s.q[((size_t)t * c.n_heads + h) * hd + d]);
            scores.assign(pos + 1 - first, 0.0);
            double m = -INFINITY, magnitude = 0.0;
            for (int p = first; p <= pos; ++p) {
                const float* k = s.k[table].data() + (size_t)p * s.row_values + kvh * hd;
                double dot = 0.0, abs_dot = 0.0;
                for (int d = 0; d < hd; ++d) {
                    dot += qh[d] * f16(k[d]);
                    abs_dot += std::fabs(qh[d] * f16(k[d]));
                }
                double score = dot * scale;
                if (c.softcap > 0.0f) score = c.softcap * std::tanh(score / c.softcap);
                scores[p - first] = score;
                m = std::fmax(m, score);
                magnitude = std::fmax(magnitude, abs_dot * scale);
            }
            r.score_magnitude[(size_t)t * c.n_heads + h] = magnitude;
            double sum = 0.0;
            for (double& e : scores) sum += (e = std::exp(e - m));
            double* out = r.out.data() + ((size_t)t * c.n_heads + h) * hd;
            for (int p = first; p <= pos; ++p) {
                const float* v = s.v[table].data() + (size_t)p * s.row_values + kvh * hd;
                for (int d = 0; d < hd; ++d) out[d] += scores[p - first] / sum * f16(v[d]);
            }
        }
    }
    return r;
}

struct DeviceSetup {
    DeviceBuffer<uint64_t> k_blocks, v_blocks;
    DeviceBuffer<int32_t> tables, table_of_token, positions;
    DeviceBuffer<float> q;
    explicit DeviceSetup(const Setup& s)
        : k_blocks(s.k_addresses), v_blocks(s.v_addresses), tables(s.tables), table_of_token(s.table_of_token), positions(s.positions), q(s.q) {}
};

// The launches ops::attention makes (crates/gpu/src/ops/attention.rs).
static void run_decode(const Case& c, const Setup& s, const DeviceSetup& d, float scale, float* out) {
    int n_keys = s.max_position + 1;
    if (c.window > 0) n_keys = std::min(n_keys, c.window);
    const int n_partitions = std::max(1, (n_keys + EMBER_ATTN_PARTITION - 1) / EMBER_ATTN_PARTITION);
    const size_t n_partials = (size_t)s.n_tokens * c.n_heads * n_partitions;
    DeviceBuffer<float> acc(n_partitions > 1 ? n_partials * c.head_dim : 1);
    DeviceBuffer<float2> ms(n_partitions > 1 ? n_partials : 1);
    ember_attention_decode_partial<<<dim3(n_partitions, c.n_heads, s.n_tokens), EMBER_ATTN_THREADS>>>(
        out, n_partitions > 1 ? acc.ptr : nullptr, n_partitions > 1 ? ms.ptr : nullptr, d.q.ptr, d.k_blocks.ptr, d.v_blocks.ptr, d.tables.ptr,
        d.table_of_token.ptr, d.positions.ptr, c.n_heads, c.n_kv_heads, c.head_dim, c.block_size, s.max_blocks, n_partitions, scale, c.window,
        c.softcap);
    if (n_partitions > 1)
        ember_attention_decode_reduce<<<dim3(c.n_heads, s.n_tokens), EMBER_ATTN_THREADS>>>(out, acc.ptr, ms.ptr, c.n_heads, c.head_dim, n_partitions);
    sync();
}

// The tensor-core prefill exists for heads of exactly 64 and 128 (NVIDIA only).
static bool has_mma(const Case& c) { return c.head_dim == 64 || c.head_dim == 128; }

static void run_prefill_mma(const Case& c, const Setup& s, const DeviceSetup& d, float scale, float* out) {
    const dim3 grid((s.n_tokens + EMBER_FA_ROWS - 1) / EMBER_FA_ROWS, c.n_heads);
    auto kernel = c.head_dim == 64 ? ember_attention_prefill_mma_d64 : ember_attention_prefill_mma_d128;
    kernel<<<grid, EMBER_FA_THREADS>>>(out, d.q.ptr, d.k_blocks.ptr, d.v_blocks.ptr, d.tables.ptr, d.table_of_token.ptr, d.positions.ptr, s.n_tokens,
                                       c.n_heads, c.n_kv_heads, c.head_dim, c.block_size, s.max_blocks, scale, c.window, c.softcap);
    sync();
}

static void run_prefill(const Case& c, const Setup& s, const DeviceSetup& d, float scale, float* out) {
    const dim3 grid((s.n_tokens + EMBER_ATTN_TILE_Q - 1) / EMBER_ATTN_TILE_Q, c.n_heads);
    auto kernel = c.head_dim <= 64    ? ember_attention_prefill_d64
                  : c.head_dim <= 128 ? ember_attention_prefill_d128
                  : c.head_dim <= 256 ? ember_attention_prefill_d256
                                      : ember_attention_prefill_d512;
    kernel<<<grid, EMBER_ATTN_THREADS>>>(out, d.q.ptr, d.k_blocks.ptr, d.v_blocks.ptr, d.tables.ptr, d.table_of_token.ptr, d.positions.ptr, s.n_tokens,
                                         c.n_heads, c.n_kv_heads, c.head_dim, c.block_size, s.max_blocks, scale, c.window, c.softcap);
    sync();
}

// Worst error / tolerance over the batch (<= 1 passes). When it fails, prints where (token,
// its position, head, dimension), the values and the batch's largest absolute error.
static double compare(const Case& c, const Setup& s, const std::vector<float>& got, const Reference& rounded, const Reference& exact, bool against_exact,
                      bool tensor_cores) {
    const double eps = std::ldexp(1.0, -24);
    const Reference& ref = against_exact ? exact : rounded;
    double worst = 0.0, max_abs = 0.0;
    size_t worst_i = 0;
    for (int t = 0; t < s.n_tokens; ++t)
        for (int h = 0; h < c.n_heads; ++h) {
            const double S = rounded.score_magnitude[(size_t)t * c.n_heads + h];
            double tol = 2.2 * (c.head_dim + 4) * eps * S + 2.0 * (rounded.n_keys[t] + 8) * eps + 8.0 * eps * c.softcap + 1e-7;
            if (against_exact) tol += 2.2 * (std::ldexp(1.0, -10) + std::ldexp(1.0, -22)) * S + std::ldexp(1.0, -11);
            if (tensor_cores)
                tol += std::ldexp(1.0, -10) * (1.0 + std::ldexp(1.0, -10)) + rounded.n_keys[t] * 2.0 * eps + 2.2 * (c.head_dim + 4) * eps * S +
                       2.0 * (rounded.n_keys[t] + 8) * eps;
            for (int d = 0; d < c.head_dim; ++d) {
                const size_t i = ((size_t)t * c.n_heads + h) * c.head_dim + d;
                const double err = std::fabs((double)got[i] - ref.out[i]);
                max_abs = std::fmax(max_abs, err);
                // NaN (an unwritten output) counts as the worst.
                const double ratio = std::isnan(err) ? INFINITY : err / tol;
                if (ratio > worst) {
                    worst = ratio;
                    worst_i = i;
                }
            }
        }
    if (!(worst <= 1.0)) {
        const size_t row = worst_i / c.head_dim;
        const int t = (int)(row / c.n_heads), h = (int)(row % c.n_heads), d = (int)(worst_i % c.head_dim);
        std::printf("     worst at token %d (table %d, position %d) head %d dim %d: got %.7g, reference %.7g; max abs error %.3e\n", t,
                    s.table_of_token[t], s.positions[t], h, d, got[worst_i], ref.out[worst_i], max_abs);
    }
    return worst;
}

static void run_case(const Case& c, const char* batch_name) {
    Setup s;
    build(c, s);
    const float scale = 1.0f / std::sqrt((float)c.head_dim);
    DeviceSetup d(s);
    store(c, s, d.k_blocks.ptr, d.v_blocks.ptr, false);
    store(c, s, d.k_blocks.ptr, d.v_blocks.ptr, true);
    char name[200];
    std::snprintf(name, sizeof name, "d=%d gqa=%d bs=%d window=%d softcap=%g %s", c.head_dim, c.n_heads / c.n_kv_heads, c.block_size, c.window,
                  c.softcap, batch_name);
    report(std::string("kv_store_f16 ") + name + " (wrong halves)", check_store(c, s), 0.0);
    const Reference rounded = reference(c, s, scale, true), exact = reference(c, s, scale, false);
    DeviceBuffer<float> out((size_t)s.n_tokens * c.n_heads * c.head_dim);
    const int n_kernels = has_mma(c) ? 3 : 2;
    for (int kernel = 0; kernel < n_kernels; ++kernel) {
        CHECK_CUDA(cudaMemset(out.ptr, 0xff, out.n * sizeof(float)));
        if (kernel == 0) run_decode(c, s, d, scale, out.ptr);
        else if (kernel == 1) run_prefill(c, s, d, scale, out.ptr);
        else run_prefill_mma(c, s, d, scale, out.ptr);
        const std::vector<float> got = out.download();
        const std::string kernel_name = kernel == 0 ? "decode " : kernel == 1 ? "prefill " : "prefill_mma ";
        const bool tensor_cores = kernel == 2;
        report(kernel_name + name + " vs f16-input reference", compare(c, s, got, rounded, exact, false, tensor_cores), 1.0);
        report(kernel_name + name + " vs f32-input reference", compare(c, s, got, rounded, exact, true, tensor_cores), 1.0);
    }
}

enum class Kernel { Decode, Prefill, PrefillMma };

static void benchmark(const char* what, const Case& c, Kernel kernel) {
    Setup s;
    build(c, s);
    DeviceSetup d(s);
    store(c, s, d.k_blocks.ptr, d.v_blocks.ptr, false);
    store(c, s, d.k_blocks.ptr, d.v_blocks.ptr, true);
    const float scale = 1.0f / std::sqrt((float)c.head_dim);
    DeviceBuffer<float> out((size_t)s.n_tokens * c.n_heads * c.head_dim);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> samples;
    for (int i = 0; i < 25; ++i) {
        CHECK_CUDA(cudaEventRecord(start));
        if (kernel == Kernel::Decode) run_decode(c, s, d, scale, out.ptr);
        else if (kernel == Kernel::Prefill) run_prefill(c, s, d, scale, out.ptr);
        else run_prefill_mma(c, s, d, scale, out.ptr);
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 5) samples.push_back(ms);
    }
    const char* kernel_name = kernel == Kernel::Decode ? "decode" : kernel == Kernel::Prefill ? "prefill" : "prefill_mma";
    std::printf("INFO attention %s %s: %.1f us (median of 20)\n", kernel_name, what, median(samples) * 1e3);
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

int main() {
    // Prefill of 300 from empty, appends to existing caches (1, 45, 16 tokens), a decode token at
    // 600: tiles that mix tables, keys crossing blocks, several decode partitions.
    const std::vector<Sequence> mixed = {{0, 300}, {37, 1}, {250, 45}, {5, 16}, {600, 1}};
    // Pure decode at partition boundaries (EMBER_ATTN_PARTITION = 64: 63, 64, 255, 256, 511
    // keys before the token) and one that is not.
    const std::vector<Sequence> decode = {{0, 1}, {62, 1}, {63, 1}, {254, 1}, {255, 1}, {511, 1}, {700, 1}};
    int index = 0;
    for (int head_dim : {64, 80, 128, 256, 320, 512})
        for (int group : {1, 4, 8})
            for (int variant = 0; variant < 4; ++variant, ++index) {
                Case c;
                c.n_heads = 8;
                c.n_kv_heads = 8 / group;
                c.head_dim = head_dim;
                c.block_size = index % 2 ? 7 : 16;
                c.window = variant & 1 ? (head_dim % 128 == 0 ? 300 : 37) : 0;
                c.softcap = variant & 2 ? 5.0f : 0.0f;
                c.sequences = mixed;
                run_case(c, "mixed prefill batch");
                if (variant == 0 || variant == 3) {
                    c.sequences = decode;
                    run_case(c, "decode batch");
                }
            }
    // Gemma 4 26B-A4B's layers: global (16 heads, 2 KV heads of 512, no window) and sliding (16
    // heads, 8 KV heads of 256, window 1024), over a batch long enough to cross the window.
    {
        const std::vector<Sequence> long_mixed = {{0, 200}, {1100, 1}, {900, 130}, {1500, 1}};
        Case global;
        global.n_heads = 16;
        global.n_kv_heads = 2;
        global.head_dim = 512;
        global.block_size = 16;
        global.window = 0;
        global.softcap = 0.0f;
        global.sequences = long_mixed;
        run_case(global, "gemma4 global layer");
        Case sliding = global;
        sliding.n_kv_heads = 8;
        sliding.head_dim = 256;
        sliding.window = 1024;
        run_case(sliding, "gemma4 sliding layer");
    }

    // Deep caches for the tensor-core prefill: 512 queries from empty, ragged prefills (1, 63,
    // 65, 130 queries: tails of a 64-row block) after 100, 1000 and 4096 cached tokens, one
    // sequence per depth so the reference stays quick; a window case crosses tiles mid-block.
    for (int head_dim : {64, 128})
        for (int group : {1, 4, 8}) {
            Case c;
            c.n_heads = 8;
            c.n_kv_heads = 8 / group;
            c.head_dim = head_dim;
            c.block_size = 16;
            c.window = 0;
            c.softcap = 0.0f;
            c.sequences = {{0, 512}};
            run_case(c, "512 queries at depth 0");
            c.sequences = {{100, 63}, {1000, 65}, {4096, 1}};
            run_case(c, "63 at depth 100, 65 at 1000, 1 at 4096");
            c.sequences = {{4096, 130}};
            run_case(c, "130 queries at depth 4096");
            c.window = 1000;
            c.softcap = 5.0f;
            c.block_size = 7;
            c.sequences = {{1000, 77}, {4096, 33}};
            run_case(c, "window 1000 softcap 5: 77 at depth 1000, 33 at 4096");
        }

    if (std::getenv("EMBER_HARNESS_NO_TIMING") != nullptr) return finish("harness_attention");
    // Llama-3-8B attention shapes: 32 heads, 8 KV heads, head_dim 128, blocks of 16.
    Case llama;
    llama.n_heads = 32;
    llama.n_kv_heads = 8;
    llama.head_dim = 128;
    llama.block_size = 16;
    llama.window = 0;
    llama.softcap = 0.0f;
    llama.sequences = {{0, 512}};
    benchmark("prefill 512 tokens from empty (32 heads, 8 KV, d=128)", llama, Kernel::Prefill);
    benchmark("prefill 512 tokens from empty (32 heads, 8 KV, d=128)", llama, Kernel::PrefillMma);
    llama.sequences = {{4096, 512}};
    benchmark("prefill 512 tokens at depth 4096 (32 heads, 8 KV, d=128)", llama, Kernel::Prefill);
    benchmark("prefill 512 tokens at depth 4096 (32 heads, 8 KV, d=128)", llama, Kernel::PrefillMma);
    Case llama1b = llama;  // Llama-3.2-1B: 32 heads, 8 KV heads, head_dim 64
    llama1b.head_dim = 64;
    benchmark("prefill 512 tokens at depth 4096 (32 heads, 8 KV, d=64)", llama1b, Kernel::Prefill);
    benchmark("prefill 512 tokens at depth 4096 (32 heads, 8 KV, d=64)", llama1b, Kernel::PrefillMma);
    llama.sequences = {{511, 1}};
    benchmark("decode 1 token after 511 (32 heads, 8 KV, d=128)", llama, Kernel::Decode);
    llama.sequences = std::vector<Sequence>(8, Sequence{4095, 1});
    benchmark("decode 8 sequences after 4095 each (32 heads, 8 KV, d=128)", llama, Kernel::Decode);
    // Gemma 3 270M shapes (4 heads, 1 KV head, head_dim 256) and SmolLM2-135M (9 heads, 3 KV, 64).
    Case gemma = llama;
    gemma.n_heads = 4;
    gemma.n_kv_heads = 1;
    gemma.head_dim = 256;
    gemma.sequences = {{0, 512}};
    benchmark("prefill 512 tokens from empty (4 heads, 1 KV, d=256)", gemma, Kernel::Prefill);
    Case smol = llama;
    smol.n_heads = 9;
    smol.n_kv_heads = 3;
    smol.head_dim = 64;
    smol.sequences = {{0, 512}};
    benchmark("prefill 512 tokens from empty (9 heads, 3 KV, d=64)", smol, Kernel::Prefill);
    benchmark("prefill 512 tokens from empty (9 heads, 3 KV, d=64)", smol, Kernel::PrefillMma);
    // Gemma 4 26B-A4B's global layers (16 heads, 2 KV heads, head_dim 512).
    Case gemma4 = llama;
    gemma4.n_heads = 16;
    gemma4.n_kv_heads = 2;
    gemma4.head_dim = 512;
    gemma4.sequences = {{0, 512}};
    benchmark("prefill 512 tokens from empty (16 heads, 2 KV, d=512)", gemma4, Kernel::Prefill);
    gemma4.sequences = {{4095, 1}};
    benchmark("decode 1 token after 4095 (16 heads, 2 KV, d=512)", gemma4, Kernel::Decode);
    return finish("harness_attention");
}
