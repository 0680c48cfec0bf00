// Gated DeltaNet (Qwen 3.5 / 3.6 linear attention) and the gated full-attention helpers of the
// same models. The CPU backend's engine/src/backend/cpu/delta_net.rs is the definition (it
// follows llama.cpp's qwen35 graph and GGML's CPU ops); these kernels run the same math in the
// same order of operations per value, with the GPU's expf/logf in place of GGML's vectorised
// exp, and f32 block reductions where the CPU sums a row in one pass.
//
// A layer's op is four launches, all over the sequences of the batch:
//   1. ember_delta_net_conv_f32: the causal short convolution of each channel continuing the
//      sequence's convolution state, SiLU, and the new convolution state;
//   2. ember_delta_net_l2_norm_f32: each query and key head L2-normalised, in place;
//   3. ember_delta_net_rule_f32: the gated delta rule over the sequence's tokens in order, from
//      and back to its recurrent state, one token per step (the recurrent form, for decode and
//      short prompts), or ember_delta_net_chunked_hd{64,128}_f32, the same rule in chunks of tokens (the
//      chunked form, for prompts);
//   4. ember_delta_net_gated_norm_f32: each head's output RMS-normalised, times the norm
//      weight, times silu(z), in place.
//
// The sequences are given as a table: states[s] is the address of sequence s's state buffer
// (every linear-attention layer's state, one after the other), the layer's part starting
// `state_offset` floats in: its convolution state, `channels * (taps - 1)` floats channel by
// channel, then its delta-rule state, `n_v_heads` matrices of head_dim x head_dim (row j, a value
// index, over the key index). starts[s] .. starts[s + 1] index rows[], the batch rows of
// sequence s in position order. Nothing here waits for the host: a decode step is captured in a
// graph with the rest of the pass.
#include "ember_compat.h"

// Most convolution taps (Qwen 3.5 has 4); the window lives in registers.
#define EMBER_DN_MAX_TAPS 8

EMBER_DEVICE float ember_dn_silu(float x) { return x / (1.0f + expf(0.0f - x)); }

EMBER_DEVICE float ember_dn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// GGML's op_softplus.
EMBER_DEVICE float ember_dn_softplus(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

// The query gate of the gated full-attention layers: q_full [n_tokens, n_heads, 2 * head_dim]
// holds each head's head_dim query values then head_dim gate values; q and gate get
// [n_tokens, n_heads, head_dim] each. Launch: grid-stride over n_tokens * n_heads * head_dim.
EMBER_KERNEL void ember_split_query_gate_f32(float* q, float* gate, const float* q_full, uint32_t n_tokens, uint32_t n_heads,
                                             uint32_t head_dim) {
    const size_t total = (size_t)n_tokens * n_heads * head_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t head = i / head_dim, d = i % head_dim;
        const size_t src = head * 2 * head_dim + d;
        q[i] = q_full[src];
        gate[i] = q_full[src + head_dim];
    }
}

// x[i] *= sigmoid(gate[i]) (GGML's ggml_sigmoid, then ggml_mul). Launch: grid-stride over n.
EMBER_KERNEL void ember_mul_sigmoid_f32(float* x, const float* gate, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        x[i] = __fmul_rn(x[i], ember_dn_sigmoid(gate[i]));
    }
}

// 1. out[r, c] = silu(sum_k window(t + k) * w[c, k]) for every row r = rows[starts[s] + t] of
// sequence s, where window(i) is the sequence's convolution state for i < taps - 1 and qkv row
// rows[starts[s] + i - (taps - 1)] after; the state becomes the last taps - 1 inputs. The sum
// starts at 0 and adds the products in tap order, unfused, as the CPU does. One thread per
// (sequence, channel), walking the sequence's tokens with the window in registers.
// Launch: grid (ceil(channels / block), n_seq), any block size.
EMBER_KERNEL void ember_delta_net_conv_f32(float* out, const float* qkv, const float* conv_w, const uint64_t* states,
                                           const int32_t* starts, const int32_t* rows, uint32_t channels, uint32_t taps,
                                           uint64_t state_offset) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t s = blockIdx.y;
    if (c >= channels || taps == 0 || taps > EMBER_DN_MAX_TAPS) return;
    const uint32_t kept = taps - 1;
    float* state = (float*)states[s] + state_offset + (size_t)c * kept;
    float w[EMBER_DN_MAX_TAPS];
    float window[EMBER_DN_MAX_TAPS];
    for (uint32_t k = 0; k < taps; ++k) w[k] = conv_w[(size_t)c * taps + k];
    for (uint32_t k = 0; k < kept; ++k) window[k] = state[k];
    const int32_t begin = starts[s], end = starts[s + 1];
    for (int32_t i = begin; i < end; ++i) {
        const size_t row = (size_t)rows[i];
        window[kept] = qkv[row * channels + c];
        float sum = 0.0f;
        for (uint32_t k = 0; k < taps; ++k) sum = __fadd_rn(sum, __fmul_rn(window[k], w[k]));
        out[row * channels + c] = ember_dn_silu(sum);
        for (uint32_t k = 0; k < kept; ++k) window[k] = window[k + 1];
    }
    for (uint32_t k = 0; k < kept; ++k) state[k] = window[k];
}

// 2. llama.cpp's build_gdn_l2_norm of each of the first n_heads heads (the query heads, then
// the key heads) of every listed row of x [*, channels], in place:
//   x = (x * (1 / sqrt(mean(x^2) + eps / head_dim))) * (1 / sqrt(head_dim)).
// The squares are summed in double and the mean rounded to f32, as the CPU's rms_scale does.
// Launch: grid (n_heads, n_rows), one warp per block (the block size is the warp size).
EMBER_KERNEL void ember_delta_net_l2_norm_f32(float* x, const int32_t* rows, uint32_t channels, uint32_t head_dim, float eps) {
    const size_t row = (size_t)rows[blockIdx.y];
    float* v = x + row * channels + (size_t)blockIdx.x * head_dim;
    double sum = 0.0;
    for (uint32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float square = __fmul_rn(v[i], v[i]);
        sum += (double)square;
    }
#pragma unroll
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
#if defined(EMBER_PLATFORM_CUDA)
        sum += __shfl_xor_sync(0xffffffffu, sum, mask, 32);
#else
        sum += __shfl_xor(sum, mask, EMBER_WAVE_SIZE);
#endif
    }
    const float n = (float)head_dim;
    const float mean = (float)(sum / (double)head_dim);
    const float scale = 1.0f / sqrtf(mean + eps / n);
    const float inv_sqrt_n = 1.0f / sqrtf(n);
    for (uint32_t i = threadIdx.x; i < head_dim; i += blockDim.x) v[i] = __fmul_rn(__fmul_rn(v[i], scale), inv_sqrt_n);
}

// 3. The gated delta rule. For value head h (query and key head h % n_k_heads) of sequence s, per
// token in order, with g = softplus(alpha + dt_bias[h]) * a[h] and b = sigmoid(beta), each state
// row j (a value index) does what the CPU does to it:
//   S[j] *= exp(g);  d = (v[j] - S[j].k) * b;  S[j] += d * k (fused multiply-adds);
//   o[j] = (S[j].q) * (1 / sqrt(head_dim)),
// the dot products chains of fused multiply-adds in key order (SPLIT chains over consecutive
// parts of the row, added lane to lane). Rows are independent, so a block takes ROWS rows of one
// head, SPLIT threads per row each holding HD / SPLIT values of it in registers, and the token's q
// and k go through shared memory. o is written to out [*, n_v_heads * head_dim]. x is the
// convolution output [*, channels]: q heads, k heads, then v heads.
// Launch: grid (n_v_heads * HD / ROWS, n_seq), block ROWS * SPLIT.
template <uint32_t HD, uint32_t ROWS, uint32_t SPLIT>
EMBER_DEVICE void ember_delta_net_rule(float* out, const float* x, const float* beta, const float* alpha, const float* dt_bias,
                                       const float* a, const uint64_t* states, const int32_t* starts, const int32_t* rows,
                                       uint32_t n_k_heads, uint32_t n_v_heads, uint32_t channels, uint64_t ssm_offset) {
    constexpr uint32_t PART = HD / SPLIT;
    __shared__ float q_s[HD];
    __shared__ float k_s[HD];
    constexpr uint32_t blocks_per_head = HD / ROWS;
    const uint32_t h = blockIdx.x / blocks_per_head;
    const uint32_t j = (blockIdx.x % blocks_per_head) * ROWS + threadIdx.x / SPLIT;
    const uint32_t first = (threadIdx.x % SPLIT) * PART;
    const uint32_t s = blockIdx.y;
    const uint32_t kh = h % n_k_heads;
    const uint32_t key_dim = n_k_heads * HD;
    float* row_state = (float*)states[s] + ssm_offset + ((size_t)h * HD + j) * HD + first;
    float st[PART];
#pragma unroll
    for (uint32_t i = 0; i < PART; i += 4) {
        const float4 v4 = *(const float4*)(row_state + i);
        st[i] = v4.x;
        st[i + 1] = v4.y;
        st[i + 2] = v4.z;
        st[i + 3] = v4.w;
    }
    const float scale = 1.0f / sqrtf((float)HD);
    const float bias = dt_bias[h], rate = a[h];
    const int32_t begin = starts[s], end = starts[s + 1];
    for (int32_t t = begin; t < end; ++t) {
        const size_t row = (size_t)rows[t];
        const float* xr = x + row * channels;
        __syncthreads();  // the previous token's q and k are no longer read
        for (uint32_t i = threadIdx.x; i < HD; i += ROWS * SPLIT) {
            q_s[i] = xr[kh * HD + i];
            k_s[i] = xr[key_dim + kh * HD + i];
        }
        __syncthreads();
        const float v = xr[2 * key_dim + h * HD + j];
        const float g = __fmul_rn(ember_dn_softplus(__fadd_rn(alpha[row * n_v_heads + h], bias)), rate);
        const float b = ember_dn_sigmoid(beta[row * n_v_heads + h]);
        const float decay = expf(g);
        float sk = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < PART; ++i) {
            st[i] = __fmul_rn(st[i], decay);
            sk = fmaf(st[i], k_s[first + i], sk);
        }
#pragma unroll
        for (uint32_t mask = 1; mask < SPLIT; mask <<= 1) sk += ember_shfl_xor(sk, mask);
        const float d = __fmul_rn(__fsub_rn(v, sk), b);
        float o = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < PART; ++i) {
            st[i] = fmaf(k_s[first + i], d, st[i]);
            o = fmaf(st[i], q_s[first + i], o);
        }
#pragma unroll
        for (uint32_t mask = 1; mask < SPLIT; mask <<= 1) o += ember_shfl_xor(o, mask);
        if (first == 0) out[row * (size_t)n_v_heads * HD + (size_t)h * HD + j] = __fmul_rn(o, scale);
    }
#pragma unroll
    for (uint32_t i = 0; i < PART; i += 4) *(float4*)(row_state + i) = make_float4(st[i], st[i + 1], st[i + 2], st[i + 3]);
}

#define EMBER_DELTA_NET_RULE(NAME, HD, ROWS, SPLIT)                                                                                  \
    EMBER_KERNEL void __launch_bounds__(ROWS * SPLIT)                                                                                \
        NAME(float* out, const float* x, const float* beta, const float* alpha, const float* dt_bias,   \
                                          const float* a, const uint64_t* states, const int32_t* starts, const int32_t* rows,        \
                                          uint32_t n_k_heads, uint32_t n_v_heads, uint32_t channels, uint64_t ssm_offset) {          \
        ember_delta_net_rule<HD, ROWS, SPLIT>(out, x, beta, alpha, dt_bias, a, states, starts, rows, n_k_heads, n_v_heads, channels, \
                                              ssm_offset);                                                                           \
    }

// Head size 64: one thread per row (64 values in registers); 128: two (64 values each).
EMBER_DELTA_NET_RULE(ember_delta_net_rule_hd64_f32, 64, 32, 1)
EMBER_DELTA_NET_RULE(ember_delta_net_rule_hd128_f32, 128, 32, 2)

// 3b. The chunked form of the same rule, for prompts: the maths of the CPU's
// engine/src/backend/cpu/delta_net/chunked.rs (flash-linear-attention's chunk_gated_delta_rule:
// within a chunk, the new values u_t solve a unit lower triangular system, and the outputs and
// the next state are products with the state at the chunk's start), in chunks of C tokens.
// A block takes ROWS state rows (value indices) of one value head of one sequence and walks the
// sequence's chunks in order, its rows in registers as in the recurrent kernels (SPLIT threads a
// row, thread `part` holding the key indices part, part + SPLIT, ...). Per chunk, in shared
// memory: the chunk's keys and queries, the C x C matrices A[t][s] = b_t r[t][s] (k_t.k_s)
// (s < t) and P[t][s] = r[t][s] (q_t.k_s) (s <= t) with r[t][s] = exp(G_t - G_s) from the
// chunk's cumulative log-gate G (summed in double), then for the block's rows Y = S0 k_t and
// Z = S0 q_t, U by forward substitution over the tokens (overwriting Y), the outputs
// o_t = (exp(G_t) Z_t + sum_{s<=t} P[t][s] u_s) / sqrt(HD), and the state
// exp(G_c) S0 + sum_s r[c][s] u_s k_s^T. Every block recomputes A and P of its head (C^2 HD
// work, less than the rows' own). Chunks of 32 keep the shared memory under 48 KiB for head
// size 128, which every target gives a block without asking (64 KiB of LDS on AMD).
// Launch: grid (n_v_heads * HD / ROWS, n_seq), block THREADS.
template <uint32_t HD, uint32_t ROWS, uint32_t C, uint32_t THREADS>
EMBER_DEVICE void ember_delta_net_chunked(float* out, const float* x, const float* beta, const float* alpha, const float* dt_bias,
                                          const float* a, const uint64_t* states, const int32_t* starts, const int32_t* rows,
                                          uint32_t n_k_heads, uint32_t n_v_heads, uint32_t channels, uint64_t ssm_offset) {
    constexpr uint32_t SPLIT = THREADS / ROWS;
    constexpr uint32_t PART = HD / SPLIT;
    // Rows of the key and query tiles padded by one float: the threads of a warp read one
    // column of consecutive rows without bank conflicts.
    constexpr uint32_t STRIDE = HD + 1;
    static_assert(SPLIT * ROWS == THREADS && PART * SPLIT == HD, "THREADS must split HD evenly");
    static_assert((SPLIT & (SPLIT - 1)) == 0 && SPLIT <= 32, "SPLIT lanes must be a power of two within a warp");
    static_assert(ROWS <= THREADS && C <= THREADS, "one thread per row and per token");
    __shared__ float k_s[C * STRIDE];
    __shared__ float q_s[C * STRIDE];
    __shared__ float a_s[C * C];
    __shared__ float p_s[C * C];
    __shared__ float yu_s[C * ROWS];  // Y[t][row], then U[t][row]
    __shared__ float z_s[C * ROWS];
    __shared__ double cumulative_s[C];
    __shared__ float g_s[C], gamma_s[C], b_s[C], last_s[C];
    __shared__ int32_t row_s[C];

    constexpr uint32_t blocks_per_head = HD / ROWS;
    const uint32_t h = blockIdx.x / blocks_per_head;
    const uint32_t j0 = (blockIdx.x % blocks_per_head) * ROWS;
    const uint32_t jl = threadIdx.x / SPLIT;
    const uint32_t part = threadIdx.x % SPLIT;
    const uint32_t s = blockIdx.y;
    const uint32_t kh = h % n_k_heads;
    const uint32_t key_dim = n_k_heads * HD;
    float* row_state = (float*)states[s] + ssm_offset + ((size_t)h * HD + j0 + jl) * HD;
    float st[PART];
#pragma unroll
    for (uint32_t m = 0; m < PART; ++m) st[m] = row_state[part + SPLIT * m];
    const float scale = 1.0f / sqrtf((float)HD);
    const float bias = dt_bias[h], rate = a[h];
    const int32_t begin = starts[s], end = starts[s + 1];
    for (int32_t t0 = begin; t0 < end; t0 += (int32_t)C) {
        const uint32_t c = (uint32_t)min((int32_t)C, end - t0);
        __syncthreads();  // the previous chunk's tiles are no longer read
        for (uint32_t idx = threadIdx.x; idx < c * HD; idx += THREADS) {
            const uint32_t t = idx / HD, i = idx % HD;
            const float* xr = x + (size_t)rows[t0 + t] * channels;
            k_s[t * STRIDE + i] = xr[key_dim + kh * HD + i];
            q_s[t * STRIDE + i] = xr[kh * HD + i];
        }
        if (threadIdx.x < c) {
            const size_t row = (size_t)rows[t0 + threadIdx.x];
            row_s[threadIdx.x] = (int32_t)row;
            g_s[threadIdx.x] = __fmul_rn(ember_dn_softplus(__fadd_rn(alpha[row * n_v_heads + h], bias)), rate);
            b_s[threadIdx.x] = ember_dn_sigmoid(beta[row * n_v_heads + h]);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double sum = 0.0;
            for (uint32_t t = 0; t < c; ++t) {
                sum += (double)g_s[t];
                cumulative_s[t] = sum;
                gamma_s[t] = (float)exp(sum);
            }
        }
        __syncthreads();
        // A and P (consecutive threads take consecutive t of one s), and r[c - 1][s].
        for (uint32_t idx = threadIdx.x; idx < C * C; idx += THREADS) {
            const uint32_t t = idx % C, sk = idx / C;
            if (t >= c || sk > t) continue;
            const float* kt = k_s + t * STRIDE;
            const float* qt = q_s + t * STRIDE;
            const float* ks = k_s + sk * STRIDE;
            float kk = 0.0f, qk = 0.0f;
#pragma unroll 8
            for (uint32_t i = 0; i < HD; ++i) {
                kk = fmaf(kt[i], ks[i], kk);
                qk = fmaf(qt[i], ks[i], qk);
            }
            const float r = expf((float)(cumulative_s[t] - cumulative_s[sk]));
            a_s[t * C + sk] = sk < t ? b_s[t] * r * kk : 0.0f;
            p_s[t * C + sk] = r * qk;
            if (t == c - 1) last_s[sk] = r;
        }
        // Y and Z of the block's rows.
        for (uint32_t t = 0; t < c; ++t) {
            float y = 0.0f, z = 0.0f;
#pragma unroll
            for (uint32_t m = 0; m < PART; ++m) {
                const uint32_t i = part + SPLIT * m;
                y = fmaf(st[m], k_s[t * STRIDE + i], y);
                z = fmaf(st[m], q_s[t * STRIDE + i], z);
            }
#pragma unroll
            for (uint32_t mask = 1; mask < SPLIT; mask <<= 1) {
                y += ember_shfl_xor(y, mask);
                z += ember_shfl_xor(z, mask);
            }
            if (part == 0) {
                yu_s[t * ROWS + jl] = y;
                z_s[t * ROWS + jl] = z;
            }
        }
        __syncthreads();
        // U by forward substitution, one thread per row.
        if (threadIdx.x < ROWS) {
            const uint32_t jj = threadIdx.x;
            const float* v = x + 2 * key_dim + (size_t)h * HD + j0 + jj;
            for (uint32_t t = 0; t < c; ++t) {
                const float bt = b_s[t];
                float u = bt * v[(size_t)row_s[t] * channels] - bt * gamma_s[t] * yu_s[t * ROWS + jj];
                for (uint32_t sk = 0; sk < t; ++sk) u = fmaf(-a_s[t * C + sk], yu_s[sk * ROWS + jj], u);
                yu_s[t * ROWS + jj] = u;
            }
        }
        __syncthreads();
        // The outputs of the block's rows.
        for (uint32_t idx = threadIdx.x; idx < c * ROWS; idx += THREADS) {
            const uint32_t t = idx / ROWS, jj = idx % ROWS;
            float o = gamma_s[t] * z_s[t * ROWS + jj];
            for (uint32_t sk = 0; sk <= t; ++sk) o = fmaf(p_s[t * C + sk], yu_s[sk * ROWS + jj], o);
            out[(size_t)row_s[t] * n_v_heads * HD + (size_t)h * HD + j0 + jj] = o * scale;
        }
        // The state after the chunk.
        const float gamma_c = gamma_s[c - 1];
#pragma unroll
        for (uint32_t m = 0; m < PART; ++m) st[m] *= gamma_c;
        for (uint32_t sk = 0; sk < c; ++sk) {
            const float w = yu_s[sk * ROWS + jl] * last_s[sk];
#pragma unroll
            for (uint32_t m = 0; m < PART; ++m) st[m] = fmaf(w, k_s[sk * STRIDE + part + SPLIT * m], st[m]);
        }
    }
#pragma unroll
    for (uint32_t m = 0; m < PART; ++m) row_state[part + SPLIT * m] = st[m];
}

#define EMBER_DELTA_NET_CHUNKED(NAME, HD, ROWS, C, THREADS)                                                                       \
    EMBER_KERNEL void __launch_bounds__(THREADS)                                                                                 \
        NAME(float* out, const float* x, const float* beta, const float* alpha, const float* dt_bias, const float* a,            \
             const uint64_t* states, const int32_t* starts, const int32_t* rows, uint32_t n_k_heads, uint32_t n_v_heads,         \
             uint32_t channels, uint64_t ssm_offset) {                                                                           \
        ember_delta_net_chunked<HD, ROWS, C, THREADS>(out, x, beta, alpha, dt_bias, a, states, starts, rows, n_k_heads, n_v_heads, \
                                                      channels, ssm_offset);                                                     \
    }

// Head sizes 64 and 128, 16 rows a block of 256 threads (16 or 8 values of a row per thread),
// chunks of 32 tokens.
EMBER_DELTA_NET_CHUNKED(ember_delta_net_chunked_hd64_f32, 64, 16, 32, 256)
EMBER_DELTA_NET_CHUNKED(ember_delta_net_chunked_hd128_f32, 128, 16, 32, 256)

// The same rule for any head size (at most 1024, the block limit): one block per head, thread j
// owns state row j and updates it where it lies in the state buffer. For head sizes without a
// register-resident kernel above. Launch: grid (n_v_heads, n_seq), block head_dim.
EMBER_KERNEL void ember_delta_net_rule_any_f32(float* out, const float* x, const float* beta, const float* alpha,
                                               const float* dt_bias, const float* a, const uint64_t* states,
                                               const int32_t* starts, const int32_t* rows, uint32_t n_k_heads,
                                               uint32_t n_v_heads, uint32_t channels, uint64_t ssm_offset, uint32_t head_dim) {
    extern __shared__ float qk_s[];  // 2 * head_dim floats: q then k
    const uint32_t h = blockIdx.x, j = threadIdx.x, s = blockIdx.y;
    const uint32_t kh = h % n_k_heads;
    const uint32_t key_dim = n_k_heads * head_dim;
    float* st = (float*)states[s] + ssm_offset + ((size_t)h * head_dim + j) * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    const float bias = dt_bias[h], rate = a[h];
    const int32_t begin = starts[s], end = starts[s + 1];
    for (int32_t t = begin; t < end; ++t) {
        const size_t row = (size_t)rows[t];
        const float* xr = x + row * channels;
        __syncthreads();
        qk_s[j] = xr[kh * head_dim + j];
        qk_s[head_dim + j] = xr[key_dim + kh * head_dim + j];
        __syncthreads();
        const float v = xr[2 * key_dim + h * head_dim + j];
        const float g = __fmul_rn(ember_dn_softplus(__fadd_rn(alpha[row * n_v_heads + h], bias)), rate);
        const float b = ember_dn_sigmoid(beta[row * n_v_heads + h]);
        const float decay = expf(g);
        float sk = 0.0f;
        for (uint32_t i = 0; i < head_dim; ++i) {
            const float value = __fmul_rn(st[i], decay);
            st[i] = value;
            sk = fmaf(value, qk_s[head_dim + i], sk);
        }
        const float d = __fmul_rn(__fsub_rn(v, sk), b);
        float o = 0.0f;
        for (uint32_t i = 0; i < head_dim; ++i) {
            const float value = fmaf(qk_s[head_dim + i], d, st[i]);
            st[i] = value;
            o = fmaf(value, qk_s[i], o);
        }
        out[row * (size_t)n_v_heads * head_dim + (size_t)h * head_dim + j] = __fmul_rn(o, scale);
    }
}

// 4. The gated norm of each value head of every listed row of out [*, n_v_heads * head_dim], in
// place: out = ((out * (1 / sqrt(mean(out^2) + eps))) * norm) * silu(z), z [*, n_v_heads *
// head_dim]; the squares summed in double and the mean rounded to f32 as the CPU does.
// Launch: grid (n_v_heads, n_rows), one warp per block.
EMBER_KERNEL void ember_delta_net_gated_norm_f32(float* out, const float* z, const float* norm, const int32_t* rows,
                                                 uint32_t n_v_heads, uint32_t head_dim, float eps) {
    const size_t row = (size_t)rows[blockIdx.y];
    const size_t at = row * n_v_heads * head_dim + (size_t)blockIdx.x * head_dim;
    float* o = out + at;
    const float* zh = z + at;
    double sum = 0.0;
    for (uint32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float square = __fmul_rn(o[i], o[i]);
        sum += (double)square;
    }
#pragma unroll
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
#if defined(EMBER_PLATFORM_CUDA)
        sum += __shfl_xor_sync(0xffffffffu, sum, mask, 32);
#else
        sum += __shfl_xor(sum, mask, EMBER_WAVE_SIZE);
#endif
    }
    const float mean = (float)(sum / (double)head_dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (uint32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
        o[i] = __fmul_rn(__fmul_rn(__fmul_rn(o[i], scale), norm[i]), ember_dn_silu(zh[i]));
    }
}
