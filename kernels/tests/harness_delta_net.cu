// Gated DeltaNet harness: every kernel of kernels/delta_net.hip on random inputs against a plain
// scalar C++ reference of the same math in double (the math of engine/src/backend/cpu/delta_net.rs,
// llama.cpp's qwen35 linear-attention layer), plus the time of Qwen 3.5 27B-shaped launches.
//
// Cases:
// * ember_split_query_gate_f32: bit-exact copies.
// * ember_mul_sigmoid_f32: x * sigmoid(g) against double.
// * the four delta-net launches in the order ops::gated_delta_net queues them (convolution + SiLU,
//   L2 norm, delta rule, gated norm) over a batch of several sequences whose rows are interleaved
//   and out of position order in the batch, each continuing a random nonzero convolution and
//   delta-rule state, checked against the reference for the outputs and the new states; head
//   sizes 64 and 128 (the register-resident rule kernels) and 96 (the general one), Qwen 3.5's 4
//   taps and 2 taps, n_v_heads = 2 n_k_heads;
// * a prompt of 9 tokens as one call against the same tokens one call each: the outputs and
//   states must be the same bits (each token's values go through the same expressions);
// * the chunked rule kernels against the recurrent ones on the same inputs (tolerance at
//   check_chunked_matches_recurrent), and the time of both at 512 and 4096 tokens.
//
// Build and run on an NVIDIA machine (repository root), or through kernels/tests/run-nvcc.sh:
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness_delta_net.cu -o target/harness_delta_net
//   target/harness_delta_net
// Exit status 0 when every check passes. EMBER_HARNESS_NO_TIMING=1 skips the timing section.
//
// Tolerances (eps = 2^-24; every input at most 1 in magnitude, so q and k are unit vectors after
// the L2 norm, |v| <= 1.2 after SiLU, the decay and write strength lie in (0, 1]):
// * mul_sigmoid: one product and expf's 2 ulps: 4 eps relative.
// * convolution (checked through the new convolution state, which is copied, and the outputs):
//   the state is copied values: exact.
// * delta-rule state: each token's update of a state row is two head_dim-term FMA chains of
//   values below 2 |S| + 2 in magnitude, off by at most (head_dim + 2) eps (2 |S| + 2); the row's
//   error grows by that per token (the decay and 1 - b |k|^2 factors are at most 1), so after T
//   tokens it is at most T (head_dim + 2) eps (2 |S| + 2). With T <= 9 + 4 tokens (the longest
//   sequence here, and the start state's row norm |S| <= 4 counted as 4 more), that is
//   13 * 130 * 10 eps = 1.0e-4 absolute.
// * outputs: o = S.q / sqrt(head_dim) with |q| = 1 is then off by at most 1.0e-4 (the state's
//   error, whose row norm is at most sqrt(head_dim) times its entries') plus its own rounding,
//   1.1e-4 in all; the gated norm divides by the head's RMS and multiplies by
//   |norm * silu(z)| <= 1.5, so the bound is 1.5 * 1.1e-4 / (the smallest head RMS of the
//   case), computed from the reference for each case (the outputs are scale-free: a state of
//   small values gives small RMS and equally small errors, so the bound is loose there).
#include "../delta_net.hip"

#include "harness_common.h"

#include <memory>

struct Shape {
    int n_k, n_v, head_dim, taps;
    int channels() const { return (2 * n_k + n_v) * head_dim; }
    int conv_len() const { return channels() * (taps - 1); }
    int ssm_len() const { return n_v * head_dim * head_dim; }
    int state_len() const { return conv_len() + ssm_len(); }
};

struct Weights {
    std::vector<float> conv, dt_bias, a, norm;
};

static Weights random_weights(const Shape& s) {
    Weights w;
    w.conv = random_floats((size_t)s.channels() * s.taps, -0.5f, 0.5f);
    w.dt_bias = random_floats(s.n_v, -1.0f, 1.0f);
    w.a = random_floats(s.n_v, 0.1f, 1.1f);
    for (auto& v : w.a) v = -v;
    w.norm = random_floats(s.head_dim, 0.8f, 1.2f);
    return w;
}

struct Batch {
    int n_rows = 0;
    std::vector<float> qkv, z, beta, alpha;
    std::vector<std::vector<int>> rows;  // per sequence, its batch rows in position order
};

static double silu(double x) { return x / (1.0 + std::exp(-x)); }

// The reference: one sequence's rows, from and back to `state` (conv then ssm, as the kernels
// lay it out), writing out [n_rows, n_v * head_dim].
static void reference(const Shape& s, const Weights& w, const Batch& b, const std::vector<int>& rows, std::vector<double>& state,
                      std::vector<double>& out, double eps, double& min_rms) {
    const int hd = s.head_dim, ch = s.channels(), kept = s.taps - 1, key_dim = s.n_k * hd;
    const int n = (int)rows.size();
    std::vector<double> x((size_t)n * ch);
    for (int c = 0; c < ch; ++c) {
        auto input = [&](int i) -> double { return i < kept ? state[(size_t)c * kept + i] : (double)b.qkv[(size_t)rows[i - kept] * ch + c]; };
        for (int t = 0; t < n; ++t) {
            double sum = 0.0;
            for (int k = 0; k < s.taps; ++k) sum += input(t + k) * (double)w.conv[(size_t)c * s.taps + k];
            x[(size_t)t * ch + c] = silu(sum);
        }
        std::vector<double> next(kept);
        for (int i = 0; i < kept; ++i) next[i] = input(n + i);
        for (int i = 0; i < kept; ++i) state[(size_t)c * kept + i] = next[i];
    }
    for (int t = 0; t < n; ++t)
        for (int h = 0; h < 2 * s.n_k; ++h) {
            double* v = &x[(size_t)t * ch + (size_t)h * hd];
            double sq = 0.0;
            for (int i = 0; i < hd; ++i) sq += v[i] * v[i];
            const double scale = 1.0 / std::sqrt(sq / hd + eps / hd) / std::sqrt((double)hd);
            for (int i = 0; i < hd; ++i) v[i] *= scale;
        }
    double* ssm = state.data() + s.conv_len();
    for (int h = 0; h < s.n_v; ++h) {
        const int kh = h % s.n_k;
        double* S = ssm + (size_t)h * hd * hd;
        for (int t = 0; t < n; ++t) {
            const int row = rows[t];
            const double* q = &x[(size_t)t * ch + (size_t)kh * hd];
            const double* k = &x[(size_t)t * ch + key_dim + (size_t)kh * hd];
            const double* v = &x[(size_t)t * ch + 2 * key_dim + (size_t)h * hd];
            const double xa = (double)b.alpha[(size_t)row * s.n_v + h] + (double)w.dt_bias[h];
            const double sp = xa > 20.0 ? xa : std::log(1.0 + std::exp(xa));
            const double decay = std::exp(sp * (double)w.a[h]);
            const double beta = 1.0 / (1.0 + std::exp(-(double)b.beta[(size_t)row * s.n_v + h]));
            std::vector<double> o(hd);
            for (int j = 0; j < hd; ++j) {
                double* Sj = S + (size_t)j * hd;
                double sk = 0.0;
                for (int i = 0; i < hd; ++i) {
                    Sj[i] *= decay;
                    sk += Sj[i] * k[i];
                }
                const double d = (v[j] - sk) * beta;
                double dot = 0.0;
                for (int i = 0; i < hd; ++i) {
                    Sj[i] += d * k[i];
                    dot += Sj[i] * q[i];
                }
                o[j] = dot / std::sqrt((double)hd);
            }
            double sq = 0.0;
            for (int j = 0; j < hd; ++j) sq += o[j] * o[j];
            const double rms = std::sqrt(sq / hd + eps);
            min_rms = std::fmin(min_rms, rms);
            for (int j = 0; j < hd; ++j) {
                const double zv = b.z[(size_t)row * s.n_v * hd + (size_t)h * hd + j];
                out[(size_t)row * s.n_v * hd + (size_t)h * hd + j] = o[j] / rms * (double)w.norm[j] * silu(zv);
            }
        }
    }
}

// Device copies of one layer's weights.
struct DeviceWeights {
    DeviceBuffer<float> conv, dt_bias, a, norm;
    explicit DeviceWeights(const Weights& w) : conv(w.conv), dt_bias(w.dt_bias), a(w.a), norm(w.norm) {}
};

// The sequence table: state addresses, starts, rows.
struct DeviceSeqs {
    DeviceBuffer<uint64_t> states;
    DeviceBuffer<int32_t> starts, rows;
    int n_seq, n_rows;
    DeviceSeqs(const std::vector<uint64_t>& addresses, const std::vector<std::vector<int>>& seq_rows)
        : states(addresses), starts(seq_rows.size() + 1), rows(count(seq_rows)), n_seq((int)seq_rows.size()), n_rows((int)count(seq_rows)) {
        std::vector<int32_t> s(1, 0), r;
        for (const auto& rs : seq_rows) {
            for (int x : rs) r.push_back(x);
            s.push_back((int32_t)r.size());
        }
        starts.upload(s);
        rows.upload(r);
    }
    static size_t count(const std::vector<std::vector<int>>& seq_rows) {
        size_t n = 0;
        for (const auto& rs : seq_rows) n += rs.size();
        return n;
    }
};

// Queues the four launches as ops::gated_delta_net does (same grids and blocks).
static void launch_delta_net(const Shape& s, const DeviceWeights& w, const DeviceSeqs& q, float* qkv, float* z, float* beta, float* alpha,
                             float* conv_out, float* out, uint64_t state_offset, float eps) {
    const uint32_t ch = s.channels(), hd = s.head_dim;
    ember_delta_net_conv_f32<<<dim3((ch + 127) / 128, q.n_seq), 128>>>(conv_out, qkv, w.conv.ptr, q.states.ptr, q.starts.ptr, q.rows.ptr, ch,
                                                                      s.taps, state_offset);
    ember_delta_net_l2_norm_f32<<<dim3(2 * s.n_k, q.n_rows), 32>>>(conv_out, q.rows.ptr, ch, hd, eps);
    const uint64_t ssm_offset = state_offset + s.conv_len();
    if ((hd == 64 || hd == 128) && ssm_offset % 4 == 0) {
        const dim3 grid(s.n_v * hd / 32, q.n_seq);
        if (hd == 64)
            ember_delta_net_rule_hd64_f32<<<grid, 32>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr, q.rows.ptr,
                                                        s.n_k, s.n_v, ch, ssm_offset);
        else
            ember_delta_net_rule_hd128_f32<<<grid, 64>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr,
                                                         q.rows.ptr, s.n_k, s.n_v, ch, ssm_offset);
    } else {
        ember_delta_net_rule_any_f32<<<dim3(s.n_v, q.n_seq), hd, 2 * hd * sizeof(float)>>>(
            out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr, q.rows.ptr, s.n_k, s.n_v, ch, ssm_offset, hd);
    }
    ember_delta_net_gated_norm_f32<<<dim3(s.n_v, q.n_rows), 32>>>(out, z, w.norm.ptr, q.rows.ptr, s.n_v, hd, eps);
}

static Batch random_batch(const Shape& s, const std::vector<int>& lengths) {
    Batch b;
    for (int len : lengths) b.n_rows += len;
    // Rows of the sequences interleaved and shuffled: a sequence's rows are not contiguous nor
    // ascending in the batch.
    std::vector<int> perm(b.n_rows);
    for (int i = 0; i < b.n_rows; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), g_rng);
    int next = 0;
    for (int len : lengths) {
        b.rows.emplace_back(perm.begin() + next, perm.begin() + next + len);
        next += len;
    }
    b.qkv = random_floats((size_t)b.n_rows * s.channels());
    b.z = random_floats((size_t)b.n_rows * s.n_v * s.head_dim);
    b.beta = random_floats((size_t)b.n_rows * s.n_v, -2.0f, 2.0f);
    b.alpha = random_floats((size_t)b.n_rows * s.n_v, -2.0f, 2.0f);
    return b;
}

static void check_delta_net(const Shape& s, const std::vector<int>& lengths, int n_layers_before) {
    const float eps = 1e-6f;
    const Weights w = random_weights(s);
    const DeviceWeights dw(w);
    const Batch b = random_batch(s, lengths);
    const int n_seq = (int)lengths.size();
    // Each sequence's state buffer holds n_layers_before other layers first (this layer's part
    // starts at their end), like the engine's per-sequence buffers.
    const uint64_t state_offset = (uint64_t)n_layers_before * s.state_len();
    const size_t buffer_len = state_offset + s.state_len();
    std::vector<std::vector<float>> states(n_seq);
    std::vector<std::unique_ptr<DeviceBuffer<float>>> device_states;
    std::vector<uint64_t> addresses;
    for (int i = 0; i < n_seq; ++i) {
        states[i] = random_floats(buffer_len, -1.0f, 1.0f);
        // Delta-rule states of norm about 1 per row, as a decoded sequence carries.
        for (size_t k = state_offset + s.conv_len(); k < buffer_len; ++k) states[i][k] *= 0.25f;
        device_states.emplace_back(new DeviceBuffer<float>(states[i]));
        addresses.push_back((uint64_t)device_states.back()->ptr);
    }
    DeviceSeqs seqs(addresses, b.rows);
    DeviceBuffer<float> qkv(b.qkv), z(b.z), beta(b.beta), alpha(b.alpha);
    DeviceBuffer<float> conv_out((size_t)b.n_rows * s.channels());
    // Rows of no sequence do not exist here; out starts as a marker that every row must replace.
    DeviceBuffer<float> out(std::vector<float>((size_t)b.n_rows * s.n_v * s.head_dim, 1234.0f));
    launch_delta_net(s, dw, seqs, qkv.ptr, z.ptr, beta.ptr, alpha.ptr, conv_out.ptr, out.ptr, state_offset, eps);
    sync();
    const std::vector<float> got = out.download();

    std::vector<double> want((size_t)b.n_rows * s.n_v * s.head_dim, 0.0);
    double state_error = 0.0, conv_state_error = 0.0, untouched_error = 0.0, min_rms = INFINITY;
    for (int i = 0; i < n_seq; ++i) {
        std::vector<double> st(states[i].begin() + state_offset, states[i].end());
        reference(s, w, b, b.rows[i], st, want, eps, min_rms);
        const std::vector<float> dev = device_states[i]->download();
        for (size_t k = 0; k < (size_t)s.state_len(); ++k) {
            const double e = std::fabs((double)dev[state_offset + k] - st[k]);
            if (k < (size_t)s.conv_len()) conv_state_error = std::fmax(conv_state_error, e);
            else state_error = std::fmax(state_error, e);
        }
        for (size_t k = 0; k < state_offset; ++k) untouched_error = std::fmax(untouched_error, std::fabs(dev[k] - states[i][k]));
    }
    char name[160];
    std::snprintf(name, sizeof name, "delta net hd %d, %d/%d heads, %d taps, %d seqs (%d rows)", s.head_dim, s.n_k, s.n_v, s.taps, n_seq,
                  b.n_rows);
    report(std::string(name) + ": outputs", max_abs_diff(got, want), 1.5 * 1.1e-4 / min_rms);
    report(std::string(name) + ": delta-rule state", state_error, 1e-4);
    report(std::string(name) + ": convolution state", conv_state_error, 0.0);
    report(std::string(name) + ": other layers' states untouched", untouched_error, 0.0);
}

// The same tokens of one sequence as one call and one call per token: the same bits.
static void check_prompt_equals_steps(const Shape& s, int n) {
    const float eps = 1e-6f;
    const Weights w = random_weights(s);
    const DeviceWeights dw(w);
    Batch b = random_batch(s, {n});
    std::sort(b.rows[0].begin(), b.rows[0].end());
    DeviceBuffer<float> qkv(b.qkv), z(b.z), beta(b.beta), alpha(b.alpha);
    DeviceBuffer<float> conv_out((size_t)n * s.channels());
    DeviceBuffer<float> out_prompt((size_t)n * s.n_v * s.head_dim), out_steps((size_t)n * s.n_v * s.head_dim);
    DeviceBuffer<float> state_prompt(s.state_len()), state_steps(s.state_len());
    {
        DeviceSeqs seqs({(uint64_t)state_prompt.ptr}, b.rows);
        launch_delta_net(s, dw, seqs, qkv.ptr, z.ptr, beta.ptr, alpha.ptr, conv_out.ptr, out_prompt.ptr, 0, eps);
        sync();
    }
    for (int t = 0; t < n; ++t) {
        const std::vector<std::vector<int>> one_row = {std::vector<int>{b.rows[0][t]}};
        DeviceSeqs seqs({(uint64_t)state_steps.ptr}, one_row);
        launch_delta_net(s, dw, seqs, qkv.ptr, z.ptr, beta.ptr, alpha.ptr, conv_out.ptr, out_steps.ptr, 0, eps);
        sync();
    }
    const auto a = out_prompt.download(), c = out_steps.download();
    const auto sa = state_prompt.download(), sc = state_steps.download();
    const bool same = std::memcmp(a.data(), c.data(), a.size() * 4) == 0 && std::memcmp(sa.data(), sc.data(), sa.size() * 4) == 0;
    bool nonzero = false;
    for (float v : a) nonzero |= std::isfinite(v) && v != 0.0f;
    char name[160];
    std::snprintf(name, sizeof name, "delta net hd %d: %d tokens as one call = one call each (bits)", s.head_dim, n);
    report(name, same && nonzero ? 0.0 : 1.0, 0.0);
}

// Tokens per chunk of the chunked rule kernels (EMBER_DELTA_NET_CHUNKED's C).
static const int CHUNK = 32;

// Launch 3 alone, as ops::gated_delta_net queues it: the recurrent rule, or the chunked one.
static void launch_rule(const Shape& s, const DeviceWeights& w, const DeviceSeqs& q, const float* conv_out, const float* beta,
                        const float* alpha, float* out, uint64_t ssm_offset, bool chunked) {
    const uint32_t ch = s.channels(), hd = s.head_dim;
    if (chunked) {
        const dim3 grid(s.n_v * hd / 16, q.n_seq);
        if (hd == 64)
            ember_delta_net_chunked_hd64_f32<<<grid, 256>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr,
                                                            q.rows.ptr, s.n_k, s.n_v, ch, ssm_offset);
        else
            ember_delta_net_chunked_hd128_f32<<<grid, 256>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr,
                                                             q.rows.ptr, s.n_k, s.n_v, ch, ssm_offset);
        return;
    }
    const dim3 grid(s.n_v * hd / 32, q.n_seq);
    if (hd == 64)
        ember_delta_net_rule_hd64_f32<<<grid, 32>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr, q.rows.ptr,
                                                    s.n_k, s.n_v, ch, ssm_offset);
    else
        ember_delta_net_rule_hd128_f32<<<grid, 64>>>(out, conv_out, beta, alpha, w.dt_bias.ptr, w.a.ptr, q.states.ptr, q.starts.ptr,
                                                     q.rows.ptr, s.n_k, s.n_v, ch, ssm_offset);
}

// The largest |a - b| over the largest |b|, over the listed rows of two [*, width] arrays.
static double relative_error(const std::vector<float>& a, const std::vector<float>& b, const std::vector<int>& rows, int width,
                             double& largest) {
    double diff = 0.0;
    largest = 0.0;
    for (int r : rows)
        for (int i = 0; i < width; ++i) {
            const size_t k = (size_t)r * width + i;
            largest = std::fmax(largest, std::fabs((double)b[k]));
            diff = std::fmax(diff, std::isfinite(a[k]) ? std::fabs((double)a[k] - (double)b[k]) : INFINITY);
        }
    return diff / largest;
}

// The chunked rule against the recurrent one (checked against the double reference above) on
// the same convolution output and start states: outputs and new states of every sequence.
// alpha and beta ranges pick the gates: alpha far below 0 gives decays near 1 (softplus near
// 0), far above 0 decays near 0; beta far below 0 write strengths near 0, far above near 1.
//
// Tolerance, relative (the largest difference over the largest magnitude of the recurrent
// kernel's values): both compute the same sums in another order in f32 (eps = 2^-24); the state's
// map from a token to the next is a contraction (decay at most 1 times I - b k k^T, |k| = 1,
// b in (0, 1)), so rounding errors are not amplified and those of n tokens add up, each token
// (or its share of its chunk) adding the rounding of sums of at most head_dim + CHUNK terms of
// at most the largest magnitude: at most 2 (n + CHUNK) (head_dim + CHUNK) eps, n the longest
// sequence. The CPU's test of its chunked form holds it to the same bound.
static void check_chunked_matches_recurrent(const Shape& s, const std::vector<int>& lengths, const char* gates, float alpha_lo,
                                            float alpha_hi, float beta_lo, float beta_hi) {
    const float eps = 1e-6f;
    const Weights w = random_weights(s);
    const DeviceWeights dw(w);
    Batch b = random_batch(s, lengths);
    b.alpha = random_floats((size_t)b.n_rows * s.n_v, alpha_lo, alpha_hi);
    b.beta = random_floats((size_t)b.n_rows * s.n_v, beta_lo, beta_hi);
    const int n_seq = (int)lengths.size();
    std::vector<std::unique_ptr<DeviceBuffer<float>>> recurrent_states, chunked_states;
    std::vector<uint64_t> recurrent_addresses, chunked_addresses;
    for (int i = 0; i < n_seq; ++i) {
        std::vector<float> start = random_floats(s.state_len(), -1.0f, 1.0f);
        for (size_t k = s.conv_len(); k < (size_t)s.state_len(); ++k) start[k] *= 0.25f;
        recurrent_states.emplace_back(new DeviceBuffer<float>(start));
        chunked_states.emplace_back(new DeviceBuffer<float>(start));
        recurrent_addresses.push_back((uint64_t)recurrent_states.back()->ptr);
        chunked_addresses.push_back((uint64_t)chunked_states.back()->ptr);
    }
    DeviceSeqs recurrent_seqs(recurrent_addresses, b.rows), chunked_seqs(chunked_addresses, b.rows);
    DeviceBuffer<float> qkv(b.qkv), beta(b.beta), alpha(b.alpha);
    DeviceBuffer<float> conv_out((size_t)b.n_rows * s.channels());
    const size_t out_len = (size_t)b.n_rows * s.n_v * s.head_dim;
    DeviceBuffer<float> out_recurrent(out_len), out_chunked(std::vector<float>(out_len, 1234.0f));
    const uint32_t ch = s.channels();
    // The convolution (it moves only the recurrent copies' convolution states) and the L2 norm.
    ember_delta_net_conv_f32<<<dim3((ch + 127) / 128, n_seq), 128>>>(conv_out.ptr, qkv.ptr, dw.conv.ptr, recurrent_seqs.states.ptr,
                                                                     recurrent_seqs.starts.ptr, recurrent_seqs.rows.ptr, ch, s.taps, 0);
    ember_delta_net_l2_norm_f32<<<dim3(2 * s.n_k, b.n_rows), 32>>>(conv_out.ptr, recurrent_seqs.rows.ptr, ch, s.head_dim, eps);
    launch_rule(s, dw, recurrent_seqs, conv_out.ptr, beta.ptr, alpha.ptr, out_recurrent.ptr, s.conv_len(), false);
    launch_rule(s, dw, chunked_seqs, conv_out.ptr, beta.ptr, alpha.ptr, out_chunked.ptr, s.conv_len(), true);
    sync();
    std::vector<int> all_rows;
    for (const auto& rs : b.rows) all_rows.insert(all_rows.end(), rs.begin(), rs.end());
    double largest = 0.0;
    const double out_error = relative_error(out_chunked.download(), out_recurrent.download(), all_rows, s.n_v * s.head_dim, largest);
    double state_error = 0.0;
    std::vector<int> ssm_rows(s.n_v * s.head_dim);
    for (int r = 0; r < (int)ssm_rows.size(); ++r) ssm_rows[r] = r;
    for (int i = 0; i < n_seq; ++i) {
        const auto rec = recurrent_states[i]->download(), chu = chunked_states[i]->download();
        const std::vector<float> rec_ssm(rec.begin() + s.conv_len(), rec.begin() + s.state_len());
        const std::vector<float> chu_ssm(chu.begin() + s.conv_len(), chu.begin() + s.state_len());
        double state_largest = 0.0;
        state_error = std::fmax(state_error, relative_error(chu_ssm, rec_ssm, ssm_rows, s.head_dim, state_largest));
    }
    int longest = 0;
    std::string lens;
    for (int len : lengths) {
        longest = std::max(longest, len);
        lens += (lens.empty() ? "" : ",") + std::to_string(len);
    }
    const double bound = 2.0 * (longest + CHUNK) * (s.head_dim + CHUNK) * std::ldexp(1.0, -24);
    char name[200];
    std::snprintf(name, sizeof name, "chunked = recurrent, hd %d, %d/%d heads, tokens %s, %s", s.head_dim, s.n_k, s.n_v, lens.c_str(), gates);
    report(std::string(name) + ": outputs", out_error, bound);
    report(std::string(name) + ": state", state_error, bound);
}

// Time of the rule launch alone, recurrent and chunked, for one sequence of n tokens of Qwen 3.5
// 35B-A3B's linear-attention layers (16 key heads and 32 value heads of 128).
static void benchmark_rule(int n) {
    const Shape s{16, 32, 128, 4};
    const Weights w = random_weights(s);
    const DeviceWeights dw(w);
    const Batch b = random_batch(s, {n});
    DeviceBuffer<float> state(s.state_len());
    DeviceSeqs seqs({(uint64_t)state.ptr}, b.rows);
    DeviceBuffer<float> conv_out(random_floats((size_t)n * s.channels(), -0.1f, 0.1f)), beta(b.beta), alpha(b.alpha);
    DeviceBuffer<float> out((size_t)n * s.n_v * s.head_dim);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    float ms[2];
    for (int chunked = 0; chunked < 2; ++chunked) {
        std::vector<float> samples;
        for (int i = 0; i < 11; ++i) {
            CHECK_CUDA(cudaEventRecord(start));
            launch_rule(s, dw, seqs, conv_out.ptr, beta.ptr, alpha.ptr, out.ptr, s.conv_len(), chunked != 0);
            CHECK_CUDA(cudaEventRecord(stop));
            sync();
            float t = 0.0f;
            CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
            samples.push_back(t);
        }
        ms[chunked] = median(samples);
    }
    std::printf("time delta rule, prompt of %4d tokens (16/32 heads of 128): recurrent %9.1f us, chunked %9.1f us, %.2fx\n", n,
                ms[0] * 1e3, ms[1] * 1e3, ms[0] / ms[1]);
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

static void check_split_and_sigmoid() {
    const int n_tokens = 5, n_heads = 6, hd = 96;
    const auto q_full = random_floats((size_t)n_tokens * n_heads * 2 * hd);
    DeviceBuffer<float> d_full(q_full), q((size_t)n_tokens * n_heads * hd), gate((size_t)n_tokens * n_heads * hd);
    ember_split_query_gate_f32<<<8, 256>>>(q.ptr, gate.ptr, d_full.ptr, n_tokens, n_heads, hd);
    sync();
    const auto gq = q.download(), gg = gate.download();
    double split_error = 0.0;
    for (int t = 0; t < n_tokens; ++t)
        for (int h = 0; h < n_heads; ++h)
            for (int d = 0; d < hd; ++d) {
                const size_t dst = ((size_t)t * n_heads + h) * hd + d, src = ((size_t)t * n_heads + h) * 2 * hd + d;
                split_error = std::fmax(split_error, std::fabs(gq[dst] - q_full[src]));
                split_error = std::fmax(split_error, std::fabs(gg[dst] - q_full[src + hd]));
            }
    report("split_query_gate (copies)", split_error, 0.0);

    const int n = 10000;
    const auto x = random_floats(n, -4.0f, 4.0f), g = random_floats(n, -8.0f, 8.0f);
    DeviceBuffer<float> dx(x), dg(g);
    ember_mul_sigmoid_f32<<<16, 256>>>(dx.ptr, dg.ptr, n);
    sync();
    const auto got = dx.download();
    double rel = 0.0;
    for (int i = 0; i < n; ++i) {
        const double want = (double)x[i] / (1.0 + std::exp(-(double)g[i]));
        rel = std::fmax(rel, std::fabs(got[i] - want) / std::fmax(std::fabs(want), 1e-30));
    }
    report("mul_sigmoid (relative)", rel, 4.0 * std::ldexp(1.0, -24));
}

// Time of one layer's four launches for a Qwen 3.5 27B linear-attention layer.
static void benchmark(const char* name, const std::vector<int>& lengths) {
    const Shape s{16, 48, 128, 4};
    const Weights w = random_weights(s);
    const DeviceWeights dw(w);
    const Batch b = random_batch(s, lengths);
    std::vector<std::unique_ptr<DeviceBuffer<float>>> states;
    std::vector<uint64_t> addresses;
    for (size_t i = 0; i < lengths.size(); ++i) {
        states.emplace_back(new DeviceBuffer<float>(s.state_len()));
        addresses.push_back((uint64_t)states.back()->ptr);
    }
    DeviceSeqs seqs(addresses, b.rows);
    DeviceBuffer<float> qkv(b.qkv), z(b.z), beta(b.beta), alpha(b.alpha);
    DeviceBuffer<float> conv_out((size_t)b.n_rows * s.channels()), out((size_t)b.n_rows * s.n_v * s.head_dim);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> samples;
    for (int i = 0; i < 20; ++i) {
        CHECK_CUDA(cudaEventRecord(start));
        launch_delta_net(s, dw, seqs, qkv.ptr, z.ptr, beta.ptr, alpha.ptr, conv_out.ptr, out.ptr, 0, 1e-6f);
        CHECK_CUDA(cudaEventRecord(stop));
        sync();
        float ms = 0.0f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        samples.push_back(ms);
    }
    const float ms = median(samples);
    const double state_bytes = 2.0 * lengths.size() * s.ssm_len() * 4.0;
    std::printf("time %-60s %8.1f us (state read+write %.1f MB: %.0f GB/s)\n", name, ms * 1e3, state_bytes / 1e6, state_bytes / (ms * 1e-3) / 1e9);
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
}

int main() {
    check_split_and_sigmoid();
    // Batches mixing a prompt, a few-token chunk and decode tokens.
    const std::vector<int> mixed = {9, 1, 4, 1};
    check_delta_net({2, 4, 64, 4}, mixed, 0);
    check_delta_net({2, 4, 128, 4}, mixed, 1);
    check_delta_net({2, 4, 96, 4}, mixed, 2);
    check_delta_net({1, 2, 128, 2}, {3, 1}, 0);
    // A head size of one warp (the general kernel) with three value heads per key head.
    check_delta_net({1, 3, 32, 2}, {5, 2}, 1);
    check_prompt_equals_steps({2, 4, 128, 4}, 9);
    check_prompt_equals_steps({2, 4, 96, 4}, 9);
    // The chunked rule: one to three sequences, whole and partial chunks, mixed gates, then
    // decays and write strengths near 0 and near 1; Qwen 3.5 35B-A3B's heads in the last.
    check_chunked_matches_recurrent({2, 4, 128, 4}, {1}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);
    check_chunked_matches_recurrent({2, 4, 128, 4}, {31}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);
    check_chunked_matches_recurrent({2, 4, 128, 4}, {32, 33}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);
    check_chunked_matches_recurrent({2, 4, 64, 4}, {100, 7, 64}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);
    check_chunked_matches_recurrent({1, 3, 64, 4}, {257}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);
    check_chunked_matches_recurrent({2, 4, 128, 4}, {200, 45}, "decays near 1, writes near 0", -24.0f, -18.0f, -9.0f, -5.0f);
    check_chunked_matches_recurrent({2, 4, 128, 4}, {200, 45}, "decays near 1, writes near 1", -24.0f, -18.0f, 5.0f, 9.0f);
    check_chunked_matches_recurrent({2, 4, 128, 4}, {130, 3}, "decays near 0, writes near 1", 40.0f, 60.0f, 5.0f, 9.0f);
    check_chunked_matches_recurrent({2, 4, 64, 4}, {130, 3}, "decays near 0, writes near 0", 40.0f, 60.0f, -9.0f, -5.0f);
    check_chunked_matches_recurrent({16, 32, 128, 4}, {300, 17, 1}, "mixed gates", -2.0f, 2.0f, -2.0f, 2.0f);

    if (std::getenv("EMBER_HARNESS_NO_TIMING") != nullptr) return finish("harness_delta_net");
    benchmark("decode 1 sequence (16/48 heads of 128, 4 taps)", {1});
    benchmark("decode 16 sequences", std::vector<int>(16, 1));
    benchmark("decode 64 sequences", std::vector<int>(64, 1));
    benchmark("prompt of 512 tokens", {512});
    benchmark_rule(512);
    benchmark_rule(4096);
    return finish("harness_delta_net");
}
