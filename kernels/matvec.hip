// Matrix-vector products for decode: y[t] = W x[t] for a few tokens t (1..8) in one pass over the
// weights, W [n_rows, n_cols] in a GGUF format, x and y f32. One launch per call: no separate
// activation-quantisation kernel.
//
// Activations are rounded exactly as the CPU backend (crates/quant, GGML's CPU rules) rounds them
// before its dot products, so the integer dot products of the two backends are equal and only the
// order in which the f32 terms are added differs (a few ulps of the row's magnitude; greedy
// tokens can still part where two logits tie to that precision):
//   * q4_0, q5_0, q8_0 against Q8_0: groups of 32, amax = max |x|, q = round-half-even(x *
//     (127 / amax)) (the x86 runtime rule), d = f16(amax / 127);
//   * q4_1, q5_1 against Q8_1: the same q and d, plus s = f16(sum(q) * (amax / 127));
//   * q2_K..q6_K against Q8_K: groups of 256, max = the value of largest magnitude (the first on
//     ties), q = min(round-half-even(x * (-127 / max)), 127), d = 1 / (-127 / max) in f32, and
//     the integer sums of q per 32 values (bsums);
//   * f16 and bf16 against x rounded to f16 / bf16 (GGML's vec_dot_type), f32 against x.
// The integer formats' weights are dotted with 4-byte integer dot products (dp4a on NVIDIA,
// sdot4/sudot4 on AMD); q2_K and q3_K dequantise to f32 and multiply by d q.
//
// Every block first quantises all n_tokens rows of x into dynamic shared memory (int8 q, then a
// float2 per group of 32: see EMBER_ACT_*), which costs a read of x from L2 per block: the grid
// is capped (ops/matvec.rs) so blocks walk several row groups and reuse it. Shared bytes =
// n_tokens * n_cols * 5 / 4 (ember_matvec_shared_bytes), at most 48 KiB without an opt-in, so
// ops/matvec.rs splits the tokens into launches that fit.
//
// Work split: EMBER_MATVEC_LANES lanes per row (a warp, or a part of one holding several rows;
// warps walk the rows grid-stride, so any grid is correct), each lane takes "units" of the row
// (one 32-value block, or a quarter of a 256-value k-quant super-block) so a warp's loads cover
// contiguous weight bytes; the weight unit is unpacked once into registers and dotted with every
// token's activation, so the weights are read once for all tokens. Lane sums are reduced with
// shuffles in a fixed order: results are deterministic.
//
// Layouts: x f32 [n_tokens, n_cols] (16-byte aligned rows); y f32 [n_tokens, n_rows]. n_cols must
// be a multiple of 32 (256 for k-quants); weight rows start 16-byte aligned (the matrix is one
// pool allocation, which is 256-byte aligned). Kernels named _tN handle n_tokens <= N (N = 1, 2,
// 4, 8). Launch: block EMBER_MATVEC_THREADS threads, any grid, dynamic shared memory
// ember_matvec_shared_bytes(n_tokens, n_cols) for the quantised formats (0 for f32/f16/bf16).
//
// The activation rounding (ember_mv_quantize) and the dp4a wrapper live in ember_q8.h, shared
// with mmq.hip (the kernels for more tokens).
#include "ember_q8.h"

#define EMBER_MATVEC_THREADS 256

// Shared memory of a launch for n_tokens tokens of n_cols values: int8 values, then 8 bytes per
// group of 32 (ops/matvec.rs computes the same).
#define ember_matvec_shared_bytes(n_tokens, n_cols) ((size_t)(n_tokens) * (size_t)(n_cols) * 5 / 4)

// Activation group g of token t: 32 int8 values as 8 words, and the group's float2.
struct EmberQ8Group {
    int q[8];
    float d, s;
};

EMBER_DEVICE void ember_load_q8_group(const int8_t* xq, const float2* xds, uint32_t n_cols, int t, int g, EmberQ8Group* out) {
    const int4 a = *(const int4*)(xq + ember_mv_xq_offset(n_cols, t, 32 * g));
    const int4 b = *(const int4*)(xq + ember_mv_xq_offset(n_cols, t, 32 * g + 16));
    out->q[0] = a.x, out->q[1] = a.y, out->q[2] = a.z, out->q[3] = a.w;
    out->q[4] = b.x, out->q[5] = b.y, out->q[6] = b.z, out->q[7] = b.w;
    const float2 ds = xds[(size_t)t * (n_cols / 32) + g];
    out->d = ds.x, out->s = ds.y;
}

// The shared activation buffer of a launch for `tokens` tokens: int8 values, then the float2s.
EMBER_DEVICE int8_t* ember_mv_shared() {
    extern __shared__ int4 ember_mv_shared_memory[];
    return (int8_t*)ember_mv_shared_memory;
}

// ---- int8 path: one struct per format with ACT, UNIT_VALUES and dot<NT, SHARE>(row, unit, ...) ----
// dot adds the unit's products with tokens 0..n_tokens-1 to acc. With SHARE, tokens n_tokens..NT-1
// repeat the last token instead of ending the loop (their sums are never stored): the code is then
// branch-free, so a caller that unrolls over several rows gets each activation load once.

// q4_0 (18 bytes: half d, qs[16]): unit = one block. value = d (q - 8).
struct EmberMvQ4_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0;
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 18, UNIT_VALUES = 32;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const uint8_t* b = row + BLOCK_BYTES * u;
        const float d = ember_mv_half(b);
        uint32_t qs[4];
        ember_load_words_a2<4>(b + 2, qs);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group x;
            ember_load_q8_group(xq, xds, n_cols, tt, u, &x);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s = ember_dp4a((int)(qs[i] & 0x0f0f0f0fu), x.q[i], s);
                s = ember_dp4a((int)((qs[i] >> 4) & 0x0f0f0f0fu), x.q[4 + i], s);
            }
            // x.s is the group's integer sum of q: sum (q_w - 8) q_x, all in integers.
            acc[t] += (d * x.d) * (float)(s - 8 * (int)x.s);
        }
    }
};

// q4_1 (20 bytes: half d, half m, qs[16]): value = d q + m.
struct EmberMvQ4_1 {
    static constexpr int ACT = EMBER_ACT_Q8_1;
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 20, UNIT_VALUES = 32;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const uint8_t* b = row + BLOCK_BYTES * u;
        const float d = ember_mv_half(b), m = ember_mv_half(b + 2);
        const uint32_t* p = (const uint32_t*)(b + 4);
        const uint32_t qs[4] = {p[0], p[1], p[2], p[3]};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group x;
            ember_load_q8_group(xq, xds, n_cols, tt, u, &x);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s = ember_dp4a((int)(qs[i] & 0x0f0f0f0fu), x.q[i], s);
                s = ember_dp4a((int)((qs[i] >> 4) & 0x0f0f0f0fu), x.q[4 + i], s);
            }
            acc[t] += (d * x.d) * (float)s + m * x.s;
        }
    }
};

// q5_0 (22 bytes: half d, qh u32, qs[16]): value = d (q - 16), q = nibble | bit v of qh << 4.
struct EmberMvQ5_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0;
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 22, UNIT_VALUES = 32;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const uint8_t* b = row + BLOCK_BYTES * u;
        const float d = ember_mv_half(b);
        uint32_t qh, qs[4];
        ember_load_words_a2<1>(b + 2, &qh);
        ember_load_words_a2<4>(b + 6, qs);
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = (int)((qs[i] & 0x0f0f0f0fu) | ember_spread_high_bits(qh >> (4 * i)));
            hi[i] = (int)(((qs[i] >> 4) & 0x0f0f0f0fu) | ember_spread_high_bits(qh >> (16 + 4 * i)));
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group x;
            ember_load_q8_group(xq, xds, n_cols, tt, u, &x);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s = ember_dp4a(lo[i], x.q[i], s);
                s = ember_dp4a(hi[i], x.q[4 + i], s);
            }
            acc[t] += (d * x.d) * (float)(s - 16 * (int)x.s);
        }
    }
};

// q5_1 (24 bytes: half d, half m, qh u32, qs[16]): value = d q + m.
struct EmberMvQ5_1 {
    static constexpr int ACT = EMBER_ACT_Q8_1;
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 24, UNIT_VALUES = 32;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const uint8_t* b = row + BLOCK_BYTES * u;
        const float d = ember_mv_half(b), m = ember_mv_half(b + 2);
        const uint32_t qh = *(const uint32_t*)(b + 4);
        const uint2 q01 = *(const uint2*)(b + 8), q23 = *(const uint2*)(b + 16);
        const uint32_t qs[4] = {q01.x, q01.y, q23.x, q23.y};
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = (int)((qs[i] & 0x0f0f0f0fu) | ember_spread_high_bits(qh >> (4 * i)));
            hi[i] = (int)(((qs[i] >> 4) & 0x0f0f0f0fu) | ember_spread_high_bits(qh >> (16 + 4 * i)));
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group x;
            ember_load_q8_group(xq, xds, n_cols, tt, u, &x);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s = ember_dp4a(lo[i], x.q[i], s);
                s = ember_dp4a(hi[i], x.q[4 + i], s);
            }
            acc[t] += (d * x.d) * (float)s + m * x.s;
        }
    }
};

// q8_0 (34 bytes: half d, int8 qs[32]): value = d q.
struct EmberMvQ8_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0;
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34, UNIT_VALUES = 32;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const uint8_t* b = row + BLOCK_BYTES * u;
        const float d = ember_mv_half(b);
        uint32_t qs[8];
        ember_load_words_a2<8>(b + 2, qs);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group x;
            ember_load_q8_group(xq, xds, n_cols, tt, u, &x);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) s = ember_dp4a((int)qs[i], x.q[i], s);
            acc[t] += (d * x.d) * (float)s;
        }
    }
};

// q4_K (144 bytes: half d, half dmin, scales[12], qs[128]): unit k (0..3) of a super-block is
// sub-blocks 2k (low nibbles of qs[32k..32k+32]) and 2k+1 (high nibbles).
// value = d scale_j q - dmin min_j.
struct EmberMvQ4_K {
    static constexpr int ACT = EMBER_ACT_Q8_K;
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 144, UNIT_VALUES = 64;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const int super_block = u >> 2, k = u & 3;
        const uint8_t* b = row + BLOCK_BYTES * super_block;
        const float d = ember_mv_half(b), dmin = ember_mv_half(b + 2);
        const uint32_t* sc = (const uint32_t*)(b + 4);
        int scale_a, min_a, scale_b, min_b;
        {
            const uint32_t w0 = sc[0], w1 = sc[1], w2 = sc[2];
            ember_mv_scale_min_k4(2 * k, w0, w1, w2, &scale_a, &min_a);
            ember_mv_scale_min_k4(2 * k + 1, w0, w1, w2, &scale_b, &min_b);
        }
        const uint4* p = (const uint4*)(b + 16 + 32 * k);
        const uint4 v0 = p[0], v1 = p[1];
        const uint32_t qs[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        const int g = 8 * super_block + 2 * k;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group xa, xb;
            ember_load_q8_group(xq, xds, n_cols, tt, g, &xa);
            ember_load_q8_group(xq, xds, n_cols, tt, g + 1, &xb);
            int sa = 0, sb = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                sa = ember_dp4a((int)(qs[i] & 0x0f0f0f0fu), xa.q[i], sa);
                sb = ember_dp4a((int)((qs[i] >> 4) & 0x0f0f0f0fu), xb.q[i], sb);
            }
            // xa.d == xb.d (one Q8_K super-block); xa.s, xb.s are the groups' integer sums.
            acc[t] += (d * xa.d) * (float)(scale_a * sa + scale_b * sb) - (dmin * xa.d) * (float)(min_a * (int)xa.s + min_b * (int)xb.s);
        }
    }
};

// q5_K (176 bytes: half d, half dmin, scales[12], qh[32], qs[128]): as q4_K with a fifth bit,
// bit j of qh[l] for sub-block j.
struct EmberMvQ5_K {
    static constexpr int ACT = EMBER_ACT_Q8_K;
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 176, UNIT_VALUES = 64;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const int super_block = u >> 2, k = u & 3;
        const uint8_t* b = row + BLOCK_BYTES * super_block;
        const float d = ember_mv_half(b), dmin = ember_mv_half(b + 2);
        const uint32_t* sc = (const uint32_t*)(b + 4);
        int scale_a, min_a, scale_b, min_b;
        {
            const uint32_t w0 = sc[0], w1 = sc[1], w2 = sc[2];
            ember_mv_scale_min_k4(2 * k, w0, w1, w2, &scale_a, &min_a);
            ember_mv_scale_min_k4(2 * k + 1, w0, w1, w2, &scale_b, &min_b);
        }
        const uint4* h = (const uint4*)(b + 16);
        const uint4 h0 = h[0], h1 = h[1];
        const uint32_t qh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const uint4* p = (const uint4*)(b + 48 + 32 * k);
        const uint4 v0 = p[0], v1 = p[1];
        const uint32_t qs[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        int lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = (int)((qs[i] & 0x0f0f0f0fu) | (((qh[i] >> (2 * k)) & 0x01010101u) << 4));
            hi[i] = (int)(((qs[i] >> 4) & 0x0f0f0f0fu) | (((qh[i] >> (2 * k + 1)) & 0x01010101u) << 4));
        }
        const int g = 8 * super_block + 2 * k;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group xa, xb;
            ember_load_q8_group(xq, xds, n_cols, tt, g, &xa);
            ember_load_q8_group(xq, xds, n_cols, tt, g + 1, &xb);
            int sa = 0, sb = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                sa = ember_dp4a(lo[i], xa.q[i], sa);
                sb = ember_dp4a(hi[i], xb.q[i], sb);
            }
            // xa.d == xb.d (one Q8_K super-block); xa.s, xb.s are the groups' integer sums.
            acc[t] += (d * xa.d) * (float)(scale_a * sa + scale_b * sb) - (dmin * xa.d) * (float)(min_a * (int)xa.s + min_b * (int)xb.s);
        }
    }
};

// q6_K (210 bytes: ql[128], qh[64], int8 scales[16], half d): unit u = 2 h + c of a super-block
// covers groups k = c and k = c + 2 of half h: low 4 bits from ql[64 h + 32 c + l] (low nibble
// for k = c, high for k = c + 2), high 2 bits from qh[32 h + l] >> 2k; value = d scale (q - 32)
// with scale = scales[8 h + 2 k + l / 16].
struct EmberMvQ6_K {
    static constexpr int ACT = EMBER_ACT_Q8_K;
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210, UNIT_VALUES = 64;
    template <int NT, bool SHARE>
    EMBER_DEVICE void dot(const uint8_t* row, int u, const int8_t* xq, const float2* xds, uint32_t n_cols, int n_tokens, float* acc) {
        const int super_block = u >> 2, h = (u >> 1) & 1, c = u & 1;
        const uint8_t* b = row + BLOCK_BYTES * super_block;
        const float d = ember_mv_half(b + 208);
        uint32_t ql[8], qh[8];
        ember_load_words_a2<8>(b + 64 * h + 32 * c, ql);
        ember_load_words_a2<8>(b + 128 + 32 * h, qh);
        const int8_t* scales = (const int8_t*)(b + 192 + 8 * h + 2 * c);
        const int scale_a0 = scales[0], scale_a1 = scales[1], scale_b0 = scales[4], scale_b1 = scales[5];
        int va[8], vb[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            va[i] = (int)ember_bytes_minus_32((ql[i] & 0x0f0f0f0fu) | (((qh[i] >> (2 * c)) & 0x03030303u) << 4));
            vb[i] = (int)ember_bytes_minus_32(((ql[i] >> 4) & 0x0f0f0f0fu) | (((qh[i] >> (2 * c + 4)) & 0x03030303u) << 4));
        }
        const int g = 8 * super_block + 4 * h + c;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (!SHARE && t >= n_tokens) break;
            const int tt = SHARE ? min(t, n_tokens - 1) : t;
            EmberQ8Group xa, xb;
            ember_load_q8_group(xq, xds, n_cols, tt, g, &xa);
            ember_load_q8_group(xq, xds, n_cols, tt, g + 2, &xb);
            int sa0 = 0, sa1 = 0, sb0 = 0, sb1 = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sa0 = ember_dp4a(va[i], xa.q[i], sa0);
                sa1 = ember_dp4a(va[4 + i], xa.q[4 + i], sa1);
                sb0 = ember_dp4a(vb[i], xb.q[i], sb0);
                sb1 = ember_dp4a(vb[4 + i], xb.q[4 + i], sb1);
            }
            acc[t] += (d * xa.d) * (float)(scale_a0 * sa0 + scale_a1 * sa1 + scale_b0 * sb0 + scale_b1 * sb1);
        }
    }
};

// Sums each token's partial dot over the LANES lanes of a row group and writes it (when the
// group has a row). Every lane of the warp must call this: the shuffles span the whole warp.
template <int NT, int LANES>
EMBER_DEVICE void ember_matvec_store(float* y, float* acc, uint32_t r, bool valid, uint32_t n_rows, int n_tokens) {
    const int sub = (int)(threadIdx.x % LANES);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float sum = acc[t];
#pragma unroll
        for (int mask = LANES / 2; mask > 0; mask >>= 1) sum += ember_shfl_xor(sum, mask);
        if (valid && sub == 0 && t < n_tokens) y[(size_t)t * n_rows + r] = sum;
    }
}

// Rows a lane group of the exported int8 kernels computes at once (the ROWS parameter of
// ember_matvec_int8). With ROWS > 1 each activation word read from shared memory serves several
// rows (the row loop is unrolled and branch-free, so the compiler loads it once), which cuts the
// shared-memory traffic that bounds the multi-token kernels, at the price of registers.
// kernels/tests/harness_matvec.cu times ROWS = 2 against this default.
#define EMBER_MATVEC_ROWS 1

// LANES lanes (8, 16 or 32) share a row, so a warp holds EMBER_WAVE_SIZE / LANES row groups of
// ROWS rows; warps walk the rows grid-stride, all lanes of a warp together (the reductions need
// every lane).
template <typename F, int NT, int LANES, int ROWS = EMBER_MATVEC_ROWS>
EMBER_DEVICE void ember_matvec_int8(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES, R = ROWS;
    const int tokens = (int)min(n_tokens, (uint32_t)NT);
    int8_t* xq = ember_mv_shared();
    float2* xds = (float2*)(xq + (size_t)tokens * n_cols);
    ember_mv_quantize<F::ACT>(xq, xds, x, (uint32_t)tokens * n_cols, n_cols);
    __syncthreads();

    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const int n_units = (int)(n_cols / F::UNIT_VALUES);
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP * R; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP * R) {
        // Rows first + group + k ROWS_PER_WARP; a row past the end computes row r[0] again and
        // is not stored (no branch inside the unit loop, so the activation loads are shared).
        uint32_t r[R];
        bool valid[R];
        const uint8_t* rows[R];
        float acc[R][NT];
#pragma unroll
        for (int k = 0; k < R; ++k) {
            r[k] = first + group + k * ROWS_PER_WARP;
            valid[k] = r[k] < n_rows;
            rows[k] = w + (size_t)(valid[k] ? r[k] : r[0]) * row_bytes;
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[k][t] = 0.0f;
        }
        if (valid[0]) {
#pragma unroll 2
            for (int u = sub; u < n_units; u += LANES)
#pragma unroll
                for (int k = 0; k < R; ++k) format.template dot<NT, (R > 1)>(rows[k], u, xq, xds, n_cols, tokens, acc[k]);
        }
#pragma unroll
        for (int k = 0; k < R; ++k) ember_matvec_store<NT, LANES>(y, acc[k], r[k], valid[k], n_rows, tokens);
    }
}

// ---- q2_K, q3_K: dequantised weights times the Q8_K activations d q ----

template <typename F, int NT, int LANES>
EMBER_DEVICE void ember_matvec_get_q8k(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const int tokens = (int)min(n_tokens, (uint32_t)NT);
    int8_t* xq = ember_mv_shared();
    float2* xds = (float2*)(xq + (size_t)tokens * n_cols);
    ember_mv_quantize<EMBER_ACT_Q8_K>(xq, xds, x, (uint32_t)tokens * n_cols, n_cols);
    __syncthreads();

    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        if (valid) {
            const uint8_t* row = w + (size_t)r * row_bytes;
            for (int c = 8 * sub; c < (int)n_cols; c += 8 * LANES) {
                float v[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = F::get(row, c / 32, c % 32 + i);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t >= tokens) break;
                    const int2 packed = *(const int2*)(xq + ember_mv_xq_offset(n_cols, t, c));
                    const float d = xds[((size_t)t * n_cols + c) / 32].x;
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const int word = i < 4 ? packed.x : packed.y;
                        s += v[i] * (float)(int8_t)(word >> (8 * (i % 4)));
                    }
                    acc[t] += d * s;
                }
            }
        }
        ember_matvec_store<NT, LANES>(y, acc, r, valid, n_rows, tokens);
    }
}

// ---- f32, f16, bf16: 8 consecutive values per lane, x rounded to the weights' type ----

struct EmberMvF32 {
    EMBER_DEVICE void load8(const uint8_t* row, int c, float* v) {
        const float4* p = (const float4*)(row + 4 * (size_t)c);
        const float4 a = p[0], b = p[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    EMBER_DEVICE float round_x(float x) { return x; }
    EMBER_DEVICE size_t row_bytes(uint32_t n_cols) { return 4 * (size_t)n_cols; }
};

struct EmberMvF16 {
    EMBER_DEVICE void load8(const uint8_t* row, int c, float* v) {
        const uint4 bits = *(const uint4*)(row + 2 * (size_t)c);
        const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __half2float(__ushort_as_half((unsigned short)(words[i] & 0xffffu)));
            v[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(words[i] >> 16)));
        }
    }
    // The CPU dots f16 weights with x converted to f16 (round to nearest even).
    EMBER_DEVICE float round_x(float x) { return __half2float(__float2half_rn(x)); }
    EMBER_DEVICE size_t row_bytes(uint32_t n_cols) { return 2 * (size_t)n_cols; }
};

struct EmberMvBF16 {
    EMBER_DEVICE void load8(const uint8_t* row, int c, float* v) {
        const uint4 bits = *(const uint4*)(row + 2 * (size_t)c);
        const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(words[i] << 16);
            v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
        }
    }
    // The CPU dots bf16 weights with x converted to bf16: round to nearest even, NaN kept quiet.
    EMBER_DEVICE float round_x(float x) {
        const uint32_t u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
        return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    }
    EMBER_DEVICE size_t row_bytes(uint32_t n_cols) { return 2 * (size_t)n_cols; }
};

template <typename F, int NT, int LANES>
EMBER_DEVICE void ember_matvec_float(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const int tokens = (int)min(n_tokens, (uint32_t)NT);
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        if (valid) {
            const uint8_t* row = w + (size_t)r * F::row_bytes(n_cols);
            // Unrolled so that several steps' weight loads are in flight at once: a short matrix
            // (a MoE router's 128 f32 rows of 2048: 16 blocks, 8 steps per row) would otherwise
            // wait for memory once per step. The order of the additions is unchanged.
#pragma unroll 4
            for (int c = 8 * sub; c < (int)n_cols; c += 8 * LANES) {
                float v[8];
                format.load8(row, c, v);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t >= tokens) break;
                    const float4* xp = (const float4*)(x + (size_t)t * n_cols + c);
                    const float4 a = xp[0], b = xp[1];
                    acc[t] += v[0] * format.round_x(a.x) + v[1] * format.round_x(a.y) + v[2] * format.round_x(a.z) +
                              v[3] * format.round_x(a.w) + v[4] * format.round_x(b.x) + v[5] * format.round_x(b.y) +
                              v[6] * format.round_x(b.z) + v[7] * format.round_x(b.w);
                }
            }
        }
        ember_matvec_store<NT, LANES>(y, acc, r, valid, n_rows, tokens);
    }
}

// Lanes per row of the exported kernels (crates/gpu/src/ops/matvec.rs sizes its grid with it).
#define EMBER_MATVEC_LANES 32

// Register cap of the one-token fused kernels (gate/up, Q/K/V and the experts' gate/up) on CUDA:
// at most 64 registers a thread, so that 4 blocks of EMBER_MATVEC_THREADS fit an SM's 64K
// registers. Uncapped, nvcc gave them 66 (sm_90), which fits 3 blocks: a decode step's expert
// gate/up launch (768 blocks for 8 experts of 768 rows) then ran in two waves at 37.5%
// occupancy. The cap changes which registers hold what, never an operation or its order.
#if defined(EMBER_PLATFORM_CUDA)
#define EMBER_DECODE_BOUNDS __launch_bounds__(EMBER_MATVEC_THREADS, 4)
#else
#define EMBER_DECODE_BOUNDS
#endif

#define EMBER_MATVEC_INT8(name, format, nt)                                                                                      \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) { \
        ember_matvec_int8<format, nt, EMBER_MATVEC_LANES>(y, w, x, n_rows, n_cols, n_tokens);                                   \
    }

#define EMBER_MATVEC_GET_Q8K(name, format, nt)                                                                                   \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) { \
        ember_matvec_get_q8k<format, nt, EMBER_MATVEC_LANES>(y, w, x, n_rows, n_cols, n_tokens);                                \
    }

#define EMBER_MATVEC_FLOAT(name, format, nt)                                                                                     \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) { \
        ember_matvec_float<format, nt, EMBER_MATVEC_LANES>(y, w, x, n_rows, n_cols, n_tokens);                                  \
    }

EMBER_MATVEC_INT8(ember_matvec_q4_0_t1, EmberMvQ4_0, 1)
EMBER_MATVEC_INT8(ember_matvec_q4_0_t2, EmberMvQ4_0, 2)
EMBER_MATVEC_INT8(ember_matvec_q4_0_t4, EmberMvQ4_0, 4)
EMBER_MATVEC_INT8(ember_matvec_q4_0_t8, EmberMvQ4_0, 8)
EMBER_MATVEC_INT8(ember_matvec_q4_1_t1, EmberMvQ4_1, 1)
EMBER_MATVEC_INT8(ember_matvec_q4_1_t2, EmberMvQ4_1, 2)
EMBER_MATVEC_INT8(ember_matvec_q4_1_t4, EmberMvQ4_1, 4)
EMBER_MATVEC_INT8(ember_matvec_q4_1_t8, EmberMvQ4_1, 8)
EMBER_MATVEC_INT8(ember_matvec_q5_0_t1, EmberMvQ5_0, 1)
EMBER_MATVEC_INT8(ember_matvec_q5_0_t2, EmberMvQ5_0, 2)
EMBER_MATVEC_INT8(ember_matvec_q5_0_t4, EmberMvQ5_0, 4)
EMBER_MATVEC_INT8(ember_matvec_q5_0_t8, EmberMvQ5_0, 8)
EMBER_MATVEC_INT8(ember_matvec_q5_1_t1, EmberMvQ5_1, 1)
EMBER_MATVEC_INT8(ember_matvec_q5_1_t2, EmberMvQ5_1, 2)
EMBER_MATVEC_INT8(ember_matvec_q5_1_t4, EmberMvQ5_1, 4)
EMBER_MATVEC_INT8(ember_matvec_q5_1_t8, EmberMvQ5_1, 8)
EMBER_MATVEC_INT8(ember_matvec_q8_0_t1, EmberMvQ8_0, 1)
EMBER_MATVEC_INT8(ember_matvec_q8_0_t2, EmberMvQ8_0, 2)
EMBER_MATVEC_INT8(ember_matvec_q8_0_t4, EmberMvQ8_0, 4)
EMBER_MATVEC_INT8(ember_matvec_q8_0_t8, EmberMvQ8_0, 8)
EMBER_MATVEC_INT8(ember_matvec_q4_k_t1, EmberMvQ4_K, 1)
EMBER_MATVEC_INT8(ember_matvec_q4_k_t2, EmberMvQ4_K, 2)
EMBER_MATVEC_INT8(ember_matvec_q4_k_t4, EmberMvQ4_K, 4)
EMBER_MATVEC_INT8(ember_matvec_q4_k_t8, EmberMvQ4_K, 8)
EMBER_MATVEC_INT8(ember_matvec_q5_k_t1, EmberMvQ5_K, 1)
EMBER_MATVEC_INT8(ember_matvec_q5_k_t2, EmberMvQ5_K, 2)
EMBER_MATVEC_INT8(ember_matvec_q5_k_t4, EmberMvQ5_K, 4)
EMBER_MATVEC_INT8(ember_matvec_q5_k_t8, EmberMvQ5_K, 8)
EMBER_MATVEC_INT8(ember_matvec_q6_k_t1, EmberMvQ6_K, 1)
EMBER_MATVEC_INT8(ember_matvec_q6_k_t2, EmberMvQ6_K, 2)
EMBER_MATVEC_INT8(ember_matvec_q6_k_t4, EmberMvQ6_K, 4)
EMBER_MATVEC_INT8(ember_matvec_q6_k_t8, EmberMvQ6_K, 8)

EMBER_MATVEC_GET_Q8K(ember_matvec_q2_k_t1, EmberQ2_K, 1)
EMBER_MATVEC_GET_Q8K(ember_matvec_q2_k_t8, EmberQ2_K, 8)
EMBER_MATVEC_GET_Q8K(ember_matvec_q3_k_t1, EmberQ3_K, 1)
EMBER_MATVEC_GET_Q8K(ember_matvec_q3_k_t8, EmberQ3_K, 8)

EMBER_MATVEC_FLOAT(ember_matvec_f32_t1, EmberMvF32, 1)
EMBER_MATVEC_FLOAT(ember_matvec_f32_t8, EmberMvF32, 8)
EMBER_MATVEC_FLOAT(ember_matvec_f16_t1, EmberMvF16, 1)
EMBER_MATVEC_FLOAT(ember_matvec_f16_t8, EmberMvF16, 8)
EMBER_MATVEC_FLOAT(ember_matvec_bf16_t1, EmberMvBF16, 1)
EMBER_MATVEC_FLOAT(ember_matvec_bf16_t8, EmberMvBF16, 8)

// ---- Fused FFN input: y[t, r] = act(gate_r . x[t]) * (up_r . x[t]) for one token (decode) ----
//
// Gate and up have the same format and shape. Each lane group computes gate row r and up row r
// from the one copy of the quantised activations, with the very arithmetic of the plain kernels
// above (same units per lane, same order of the partial sums, same shuffle reduction), then
// applies the activation with the expressions of elementwise.hip's ember_silu_mul_f32 and
// ember_gelu_mul_f32, so the result equals matvec(gate), matvec(up), then the element-wise
// kernel, in one launch instead of three. Launch as the plain t1 kernels (same block, grid and
// shared memory).
#define EMBER_GLU_SILU 0
#define EMBER_GLU_GELU 1

template <int GLU>
EMBER_DEVICE float ember_mv_glu(float g, float u) {
    if (GLU == EMBER_GLU_SILU) return g / (1.0f + expf(-g)) * u;
    const float sqrt_2_over_pi = 0.7978845608028654f;
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
    return gelu * u;
}

// The gate and up sums of one token reduced over the LANES lanes of a row group (the order of
// ember_matvec_store), combined and written by lane 0 of a group with a row.
template <int LANES, int GLU>
EMBER_DEVICE void ember_matvec_glu_store(float* y, float g, float u, uint32_t r, bool valid) {
    const int sub = (int)(threadIdx.x % LANES);
#pragma unroll
    for (int mask = LANES / 2; mask > 0; mask >>= 1) g += ember_shfl_xor(g, mask);
#pragma unroll
    for (int mask = LANES / 2; mask > 0; mask >>= 1) u += ember_shfl_xor(u, mask);
    if (valid && sub == 0) y[r] = ember_mv_glu<GLU>(g, u);
}

template <typename F, int LANES, int GLU>
EMBER_DEVICE void ember_matvec_glu_int8(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, uint32_t n_rows, uint32_t n_cols) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    int8_t* xq = ember_mv_shared();
    float2* xds = (float2*)(xq + (size_t)n_cols);
    ember_mv_quantize<F::ACT>(xq, xds, x, n_cols, n_cols);
    __syncthreads();

    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const int n_units = (int)(n_cols / F::UNIT_VALUES);
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        float g[1] = {0.0f}, u[1] = {0.0f};
        if (valid) {
            const uint8_t* gate_row = wg + (size_t)r * row_bytes;
            const uint8_t* up_row = wu + (size_t)r * row_bytes;
#pragma unroll 2
            for (int k = sub; k < n_units; k += LANES) {
                format.template dot<1, false>(gate_row, k, xq, xds, n_cols, 1, g);
                format.template dot<1, false>(up_row, k, xq, xds, n_cols, 1, u);
            }
        }
        ember_matvec_glu_store<LANES, GLU>(y, g[0], u[0], r, valid);
    }
}

template <typename F, int LANES, int GLU>
EMBER_DEVICE void ember_matvec_glu_float(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, uint32_t n_rows, uint32_t n_cols) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        float acc[2] = {0.0f, 0.0f};
        if (valid) {
            const uint8_t* rows[2] = {wg + (size_t)r * F::row_bytes(n_cols), wu + (size_t)r * F::row_bytes(n_cols)};
            for (int c = 8 * sub; c < (int)n_cols; c += 8 * LANES) {
                const float4* xp = (const float4*)(x + c);
                const float4 a = xp[0], b = xp[1];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    float v[8];
                    format.load8(rows[k], c, v);
                    acc[k] += v[0] * format.round_x(a.x) + v[1] * format.round_x(a.y) + v[2] * format.round_x(a.z) +
                              v[3] * format.round_x(a.w) + v[4] * format.round_x(b.x) + v[5] * format.round_x(b.y) +
                              v[6] * format.round_x(b.z) + v[7] * format.round_x(b.w);
                }
            }
        }
        ember_matvec_glu_store<LANES, GLU>(y, acc[0], acc[1], r, valid);
    }
}

// ember_matvec_{swiglu,geglu}_<format>_t1(float* y, const uint8_t* w_gate, const uint8_t* w_up,
// const float* x, uint32_t n_rows, uint32_t n_cols): one token, y [n_rows].
#define EMBER_MATVEC_GLU_INT8(name, format, glu)                                                                                  \
    EMBER_KERNEL void EMBER_DECODE_BOUNDS name(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, uint32_t n_rows, uint32_t n_cols) { \
        ember_matvec_glu_int8<format, EMBER_MATVEC_LANES, glu>(y, wg, wu, x, n_rows, n_cols);                                     \
    }

#define EMBER_MATVEC_GLU_FLOAT(name, format, glu)                                                                                 \
    EMBER_KERNEL void name(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, uint32_t n_rows, uint32_t n_cols) { \
        ember_matvec_glu_float<format, EMBER_MATVEC_LANES, glu>(y, wg, wu, x, n_rows, n_cols);                                    \
    }

EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q4_0_t1, EmberMvQ4_0, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q4_0_t1, EmberMvQ4_0, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q4_1_t1, EmberMvQ4_1, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q4_1_t1, EmberMvQ4_1, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q5_0_t1, EmberMvQ5_0, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q5_0_t1, EmberMvQ5_0, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q5_1_t1, EmberMvQ5_1, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q5_1_t1, EmberMvQ5_1, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q8_0_t1, EmberMvQ8_0, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q8_0_t1, EmberMvQ8_0, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q4_k_t1, EmberMvQ4_K, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q4_k_t1, EmberMvQ4_K, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q5_k_t1, EmberMvQ5_K, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q5_k_t1, EmberMvQ5_K, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_INT8(ember_matvec_swiglu_q6_k_t1, EmberMvQ6_K, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_INT8(ember_matvec_geglu_q6_k_t1, EmberMvQ6_K, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_swiglu_f32_t1, EmberMvF32, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_geglu_f32_t1, EmberMvF32, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_swiglu_f16_t1, EmberMvF16, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_geglu_f16_t1, EmberMvF16, EMBER_GLU_GELU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_swiglu_bf16_t1, EmberMvBF16, EMBER_GLU_SILU)
EMBER_MATVEC_GLU_FLOAT(ember_matvec_geglu_bf16_t1, EmberMvBF16, EMBER_GLU_GELU)

// ---- Several matrices sharing one input, one token: y_s = W_s x for s < 3 (Q, K and V) ----
//
// The matrices have the same format and column count; their rows are walked as one list of
// rows0 + rows1 + rows2 rows (a row group finds its matrix by its index), so one launch and one
// quantisation of x per block serve all of them. Each row is computed exactly as the plain t1
// kernels compute it (same units per lane, same order, same reduction): the values equal three
// ember_matvec_<format>_t1 launches. A segment with 0 rows is never touched (its pointers may be
// null). Launch as the plain t1 kernels with the grid of the total row count.
struct EmberMvSegments {
    float* y[3];
    const uint8_t* w[3];
    uint32_t rows[3];
};

// The matrix of row r of the combined list, and r's index in it.
EMBER_DEVICE int ember_mv_segment_of(const EmberMvSegments& s, uint32_t r, uint32_t* local) {
    if (r < s.rows[0]) {
        *local = r;
        return 0;
    }
    r -= s.rows[0];
    if (r < s.rows[1]) {
        *local = r;
        return 1;
    }
    *local = r - s.rows[1];
    return 2;
}

template <typename F, int LANES>
EMBER_DEVICE void ember_matvec_multi_int8(const EmberMvSegments& s, const float* x, uint32_t n_cols) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    int8_t* xq = ember_mv_shared();
    float2* xds = (float2*)(xq + (size_t)n_cols);
    ember_mv_quantize<F::ACT>(xq, xds, x, n_cols, n_cols);
    __syncthreads();

    const uint32_t n_rows = s.rows[0] + s.rows[1] + s.rows[2];
    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const int n_units = (int)(n_cols / F::UNIT_VALUES);
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        uint32_t local = 0;
        const int seg = valid ? ember_mv_segment_of(s, r, &local) : 0;
        float acc[1] = {0.0f};
        if (valid) {
            const uint8_t* row = s.w[seg] + (size_t)local * row_bytes;
#pragma unroll 2
            for (int u = sub; u < n_units; u += LANES) format.template dot<1, false>(row, u, xq, xds, n_cols, 1, acc);
        }
        ember_matvec_store<1, LANES>(s.y[seg], acc, local, valid, s.rows[seg], 1);
    }
}

template <typename F, int LANES>
EMBER_DEVICE void ember_matvec_multi_float(const EmberMvSegments& s, const float* x, uint32_t n_cols) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const uint32_t n_rows = s.rows[0] + s.rows[1] + s.rows[2];
    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        uint32_t local = 0;
        const int seg = valid ? ember_mv_segment_of(s, r, &local) : 0;
        float acc[1] = {0.0f};
        if (valid) {
            const uint8_t* row = s.w[seg] + (size_t)local * F::row_bytes(n_cols);
            for (int c = 8 * sub; c < (int)n_cols; c += 8 * LANES) {
                float v[8];
                format.load8(row, c, v);
                const float4* xp = (const float4*)(x + c);
                const float4 a = xp[0], b = xp[1];
                acc[0] += v[0] * format.round_x(a.x) + v[1] * format.round_x(a.y) + v[2] * format.round_x(a.z) +
                          v[3] * format.round_x(a.w) + v[4] * format.round_x(b.x) + v[5] * format.round_x(b.y) +
                          v[6] * format.round_x(b.z) + v[7] * format.round_x(b.w);
            }
        }
        ember_matvec_store<1, LANES>(s.y[seg], acc, local, valid, s.rows[seg], 1);
    }
}

// ember_matvec3_<format>_t1(float* y0, float* y1, float* y2, const uint8_t* w0, const uint8_t* w1,
// const uint8_t* w2, const float* x, uint32_t rows0, uint32_t rows1, uint32_t rows2, uint32_t n_cols)
#define EMBER_MATVEC3_INT8(name, format)                                                                                           \
    EMBER_KERNEL void EMBER_DECODE_BOUNDS name(float* y0, float* y1, float* y2, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, const float* x, \
                           uint32_t rows0, uint32_t rows1, uint32_t rows2, uint32_t n_cols) {                                       \
        const EmberMvSegments s = {{y0, y1, y2}, {w0, w1, w2}, {rows0, rows1, rows2}};                                              \
        ember_matvec_multi_int8<format, EMBER_MATVEC_LANES>(s, x, n_cols);                                                          \
    }

#define EMBER_MATVEC3_FLOAT(name, format)                                                                                          \
    EMBER_KERNEL void name(float* y0, float* y1, float* y2, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, const float* x, \
                           uint32_t rows0, uint32_t rows1, uint32_t rows2, uint32_t n_cols) {                                       \
        const EmberMvSegments s = {{y0, y1, y2}, {w0, w1, w2}, {rows0, rows1, rows2}};                                              \
        ember_matvec_multi_float<format, EMBER_MATVEC_LANES>(s, x, n_cols);                                                         \
    }

EMBER_MATVEC3_INT8(ember_matvec3_q4_0_t1, EmberMvQ4_0)
EMBER_MATVEC3_INT8(ember_matvec3_q4_1_t1, EmberMvQ4_1)
EMBER_MATVEC3_INT8(ember_matvec3_q5_0_t1, EmberMvQ5_0)
EMBER_MATVEC3_INT8(ember_matvec3_q5_1_t1, EmberMvQ5_1)
EMBER_MATVEC3_INT8(ember_matvec3_q8_0_t1, EmberMvQ8_0)
EMBER_MATVEC3_INT8(ember_matvec3_q4_k_t1, EmberMvQ4_K)
EMBER_MATVEC3_INT8(ember_matvec3_q5_k_t1, EmberMvQ5_K)
EMBER_MATVEC3_INT8(ember_matvec3_q6_k_t1, EmberMvQ6_K)
EMBER_MATVEC3_FLOAT(ember_matvec3_f32_t1, EmberMvF32)
EMBER_MATVEC3_FLOAT(ember_matvec3_f16_t1, EmberMvF16)
EMBER_MATVEC3_FLOAT(ember_matvec3_bf16_t1, EmberMvBF16)

// ---- grouped products of mixture-of-experts layers ----
//
// y[p] = W[expert of p] x[p / x_div] for the (token, rank) pairs p that a batch routes, W a stack
// of experts of n_rows rows each (expert_bytes apart). The pairs come sorted by expert (`pairs`)
// and cut into tiles of at most NT pairs of one expert (`tiles`: int32 [expert, first, count, 0]
// per tile slot, count 0 for an unused slot); moe.hip's ember_moe_tiles builds both on the
// device, so nothing waits for the host and the op can be captured in a graph. Block (bx, slot)
// gathers its tile's activation rows into shared memory, rounded as ember_matvec_int8 rounds
// them, and walks the rows of its expert grid-stride over bx: an expert's weights are read once
// per tile of up to NT pairs that chose it, and an expert nobody chose is never read. x_div is
// the number of ranks for the gate and up products (pair p reads token p / n_used) and 1 for the
// down product (pair p reads its own row). Each output is one dot product, computed as
// ember_matvec_int8 with ROWS = 1 computes it, so a pair's values do not depend on which pairs
// share its tile. Launch: block EMBER_MATVEC_THREADS, grid (any, tile slots), dynamic shared
// memory ember_matvec_shared_bytes(NT, n_cols).
template <typename F, int NT, int LANES>
EMBER_DEVICE void ember_moe_matvec_int8(float* y, const uint8_t* w, const float* x, const int32_t* pairs, const int32_t* tiles,
                                        uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const int32_t* tile = tiles + 4 * (size_t)blockIdx.y;
    const int tokens = min(tile[2], NT);
    if (tokens <= 0) return;  // the whole block leaves, before any barrier
    const int32_t* tile_pairs = pairs + tile[1];
    w += (size_t)tile[0] * expert_bytes;
    int8_t* xq = ember_mv_shared();
    float2* xds = (float2*)(xq + (size_t)tokens * n_cols);
    ember_mv_quantize<F::ACT>(xq, xds, x, (uint32_t)tokens * n_cols, n_cols, tile_pairs, x_div);
    __syncthreads();

    const int sub = (int)(threadIdx.x % LANES);
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const int n_units = (int)(n_cols / F::UNIT_VALUES);
    F format;
    for (uint32_t first = warp * ROWS_PER_WARP; first < n_rows; first += gridDim.x * warps_per_block * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        if (valid) {
            const uint8_t* row = w + (size_t)r * row_bytes;
#pragma unroll 2
            for (int u = sub; u < n_units; u += LANES) format.template dot<NT, false>(row, u, xq, xds, n_cols, tokens, acc);
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float sum = acc[t];
#pragma unroll
            for (int mask = LANES / 2; mask > 0; mask >>= 1) sum += ember_shfl_xor(sum, mask);
            if (valid && sub == 0 && t < tokens) y[(size_t)tile_pairs[t] * n_rows + r] = sum;
        }
    }
}

// Pairs per tile of the exported grouped kernels (crates/gpu/src/ops/moe.rs cuts tiles of this
// many pairs).
#define EMBER_MOE_TILE 8

// ember_moe_matvec_<format>(float* y, const uint8_t* w, const float* x, const int32_t* pairs,
// const int32_t* tiles, uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div)
#define EMBER_MOE_MATVEC(name, format)                                                                                \
    EMBER_KERNEL void name(float* y, const uint8_t* w, const float* x, const int32_t* pairs, const int32_t* tiles,   \
                           uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div) {                \
        ember_moe_matvec_int8<format, EMBER_MOE_TILE, EMBER_MATVEC_LANES>(y, w, x, pairs, tiles, n_rows, n_cols,     \
                                                                         expert_bytes, x_div);                        \
    }

EMBER_MOE_MATVEC(ember_moe_matvec_q4_0, EmberMvQ4_0)
EMBER_MOE_MATVEC(ember_moe_matvec_q4_1, EmberMvQ4_1)
EMBER_MOE_MATVEC(ember_moe_matvec_q5_0, EmberMvQ5_0)
EMBER_MOE_MATVEC(ember_moe_matvec_q5_1, EmberMvQ5_1)
EMBER_MOE_MATVEC(ember_moe_matvec_q8_0, EmberMvQ8_0)
EMBER_MOE_MATVEC(ember_moe_matvec_q4_k, EmberMvQ4_K)
EMBER_MOE_MATVEC(ember_moe_matvec_q5_k, EmberMvQ5_K)
EMBER_MOE_MATVEC(ember_moe_matvec_q6_k, EmberMvQ6_K)

// ---- decode of mixture-of-experts layers: one block column per (token, rank) pair or token ----
//
// With a few tokens almost every (token, rank) pair has an expert of its own, so sorting the
// pairs into tiles (above) buys nothing but two launches, a serial sort and kernels sized for
// eight pairs per tile. These kernels read the router's choice directly (`experts`, int32
// [n_pairs], pair p = token * n_used + rank, as moe.hip's ember_moe_route_f32 writes it) and fuse
// the steps around the products, so a decode step's expert FFN is four launches (route, gate/up,
// rounding of the down input, down) instead of seven:
//   * ember_moe_{swiglu,geglu}_<format>: h[p] = act(G_e x[p / n_used]) * (U_e x[p / n_used]),
//     e = experts[p]: block (bx, p) runs the dense fused kernel (ember_matvec_glu_int8) over
//     expert e's rows. Its sums are ember_moe_matvec_*'s (the same units per lane in the same
//     order, the same shuffle reduction) and its activation the element-wise kernels' expression,
//     so each value equals the tile path's gate and up products followed by ember_silu_mul_f32 /
//     ember_gelu_mul_f32. Launch: block EMBER_MATVEC_THREADS, grid (any, n_pairs), dynamic shared
//     memory ember_matvec_shared_bytes(1, n_cols).
//   * ember_quantize_act_<act>(hq, hds, h, n_rows, n_cols): rows of f32 values rounded once, as
//     ember_mv_quantize rounds them inside the other kernels, into the layout of the shared
//     activations (int8 [n_rows, n_cols] chunk-major per row, then a float2 per 32 values), for
//     the down kernel, whose input is n_used rows per token. Launch: block EMBER_MATVEC_THREADS,
//     grid any (a block per row, grid-stride).
//   * ember_moe_down_<format>_l<LANES>: out[t] = sum over ranks k of weights[t, k] (s_e D_e
//     h[t n_used + k]), e = experts[t n_used + k], s_e = expert_scale[e] when given, then plus
//     shared[t] (times sigmoid(shared_logit[t]) when given): a shared expert's output. h comes
//     rounded by ember_quantize_act_* (hq, hds, for the format's activation type). Block (bx, t)
//     takes EMBER_WAVE_SIZE / LANES rows; its warp w computes ranks w, w + warps, ... of them (one
//     row per lane group), each rank's dot product read straight from hq, and leaves the rank's
//     term in shared memory; then one lane per row adds the terms in rank order. Every rank's
//     sum is the one ember_moe_matvec_* computes with 32 lanes: _l32 is that very order, and _l16
//     (for rows of at most 16 units) gives each of lanes 0..15 the one unit it holds with 32 lanes
//     while lanes 16..31 would add exact zeros. The products and additions that follow are
//     ember_moe_combine_f32's and then ember_moe_add_gated_f32's (or ember_add_f32's), so `out`
//     equals the tile path bit for bit. Spreading the ranks over warps (rather than every rank
//     of a row in one lane group, the layout before) gives a decode step's down product eight
//     times the warps, each with an eighth of the instructions: the kernel was bound by the
//     latency of its instructions at two warps per scheduler. Launch: block EMBER_MATVEC_THREADS,
//     grid (any, n_tokens), dynamic shared memory n_used * (EMBER_WAVE_SIZE / LANES) floats.
// Before it rounds its activations, each lane group of the gate/up kernel asks for the first row
// it will read to be brought into L2 (ember_prefetch_l2, a hint), so the weights' DRAM latency
// overlaps that work.
// Tried and dropped: folding the routing into the router product's launch and the rounding of h
// into the gate/up launch, each done by the block that finishes last (a ticket counter, a fence
// before and after). Bit for bit the same, but slower inside a decode graph on an H100: the
// expert FFN with the rounding in its last block took 27.7 us against 25.9 us for the two
// launches (harness_moe, Qwen3-30B-A3B shapes), and full-depth Qwen3-30B-A3B decode fell from
// 291-297 to 281-282 tokens/s. A graph's next kernel starts within a microsecond or so; a
// last-block tail is a serial chain of fence, atomic, loads and reductions on one SM.

// Brings the cache line at p towards the SMs (into L2); a hint without effect on any value.
EMBER_DEVICE void ember_prefetch_l2(const void* p) {
#if defined(EMBER_PLATFORM_CUDA)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

// The first row of `row_bytes` bytes at `row`, spread over the LANES lanes of a group in 128-byte
// lines.
template <int LANES>
EMBER_DEVICE void ember_prefetch_row(const uint8_t* row, size_t row_bytes) {
    for (size_t at = 128 * (size_t)(threadIdx.x % LANES); at < row_bytes; at += 128 * LANES) ember_prefetch_l2(row + at);
}

// The first row the calling lane group of an ember_matvec_* row loop takes (it may be past the
// end: then the group has no row).
template <int LANES>
EMBER_DEVICE uint32_t ember_mv_first_row() {
    const uint32_t warps_per_block = blockDim.x / EMBER_WAVE_SIZE;
    const uint32_t warp = blockIdx.x * warps_per_block + threadIdx.x / EMBER_WAVE_SIZE;
    return warp * (EMBER_WAVE_SIZE / LANES) + (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
}

template <typename F, int GLU>
EMBER_DEVICE void ember_moe_glu_int8(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, const int32_t* experts,
                                     uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t n_used) {
    const size_t p = blockIdx.y;
    const size_t offset = (size_t)experts[p] * expert_bytes;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const uint32_t r = ember_mv_first_row<EMBER_MATVEC_LANES>();
    if (r < n_rows) {
        ember_prefetch_row<EMBER_MATVEC_LANES>(wg + offset + (size_t)r * row_bytes, row_bytes);
        ember_prefetch_row<EMBER_MATVEC_LANES>(wu + offset + (size_t)r * row_bytes, row_bytes);
    }
    ember_matvec_glu_int8<F, EMBER_MATVEC_LANES, GLU>(y + p * n_rows, wg + offset, wu + offset, x + (p / n_used) * n_cols, n_rows,
                                                      n_cols);
}

template <int ACT>
EMBER_DEVICE void ember_quantize_act_rows(int8_t* xq, float2* xds, const float* x, uint32_t n_rows, uint32_t n_cols) {
    for (uint32_t r = blockIdx.x; r < n_rows; r += gridDim.x)
        ember_mv_quantize<ACT>(xq + (size_t)r * n_cols, xds + (size_t)r * (n_cols / 32), x + (size_t)r * n_cols, n_cols, n_cols);
}

template <typename F, int LANES>
EMBER_DEVICE void ember_moe_down_int8(float* out, const uint8_t* w, const int8_t* hq, const float2* hds, const int32_t* experts,
                                      const float* weights, const float* expert_scale, const float* shared, const float* shared_logit,
                                      uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t n_used) {
    constexpr int ROWS_PER_WARP = EMBER_WAVE_SIZE / LANES;
    const size_t t = blockIdx.y;
    const int32_t* e = experts + t * n_used;
    const float* rank_weight = weights + t * n_used;
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const int n_units = (int)(n_cols / F::UNIT_VALUES);
    const uint32_t n_warps = blockDim.x / EMBER_WAVE_SIZE, warp = threadIdx.x / EMBER_WAVE_SIZE;
    const uint32_t group = (threadIdx.x % EMBER_WAVE_SIZE) / LANES;
    const int sub = (int)(threadIdx.x % LANES);
    // terms[k * ROWS_PER_WARP + i]: rank k's weighted sum for row i of the block's rows.
    float* terms = (float*)ember_mv_shared();
    F format;
    for (uint32_t first = blockIdx.x * ROWS_PER_WARP; first < n_rows; first += gridDim.x * ROWS_PER_WARP) {
        const uint32_t r = first + group;
        const bool valid = r < n_rows;
        for (uint32_t k = warp; k < n_used; k += n_warps) {
            const size_t pair = t * n_used + k;
            const int32_t expert = e[k];
            const uint8_t* row = w + (size_t)expert * expert_bytes + (size_t)(valid ? r : 0) * row_bytes;
            float acc = 0.0f;
            if (valid) {
                for (int u = sub; u < n_units; u += LANES)
                    format.template dot<1, false>(row, u, hq + pair * n_cols, hds + pair * (n_cols / 32), n_cols, 1, &acc);
            }
#pragma unroll
            for (int mask = LANES / 2; mask > 0; mask >>= 1) acc += ember_shfl_xor(acc, mask);
            if (valid && sub == 0) {
                if (expert_scale != nullptr) acc = __fmul_rn(acc, expert_scale[expert]);
                terms[k * ROWS_PER_WARP + group] = __fmul_rn(acc, rank_weight[k]);
            }
        }
        __syncthreads();
        if (threadIdx.x < (uint32_t)ROWS_PER_WARP && first + threadIdx.x < n_rows) {
            const uint32_t row = first + threadIdx.x;
            float o = terms[threadIdx.x];
            for (uint32_t k = 1; k < n_used; ++k) o = __fadd_rn(o, terms[k * ROWS_PER_WARP + threadIdx.x]);
            if (shared != nullptr) {
                const float s = shared[t * n_rows + row];
                if (shared_logit != nullptr) {
                    const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-shared_logit[t])));
                    o = __fadd_rn(o, __fmul_rn(s, g));
                } else {
                    o = __fadd_rn(o, s);
                }
            }
            out[t * n_rows + row] = o;
        }
        // The terms are written again for the next rows.
        __syncthreads();
    }
}

// ember_quantize_act_<act>(int8_t* xq, float2* xds, const float* x, uint32_t n_rows, uint32_t n_cols)
#define EMBER_QUANTIZE_ACT(name, act)                                                                         \
    EMBER_KERNEL void name(int8_t* xq, float2* xds, const float* x, uint32_t n_rows, uint32_t n_cols) { \
        ember_quantize_act_rows<act>(xq, xds, x, n_rows, n_cols);                                         \
    }

EMBER_QUANTIZE_ACT(ember_quantize_act_q8_0, EMBER_ACT_Q8_0)
EMBER_QUANTIZE_ACT(ember_quantize_act_q8_1, EMBER_ACT_Q8_1)
EMBER_QUANTIZE_ACT(ember_quantize_act_q8_k, EMBER_ACT_Q8_K)

// ember_moe_{swiglu,geglu}_<format>(float* y, const uint8_t* w_gate, const uint8_t* w_up, const
// float* x, const int32_t* experts, uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes,
// uint32_t n_used)
#define EMBER_MOE_GLU(name, format, glu)                                                                                          \
    EMBER_KERNEL void EMBER_DECODE_BOUNDS name(float* y, const uint8_t* wg, const uint8_t* wu, const float* x, const int32_t* experts, uint32_t n_rows, \
                           uint32_t n_cols, uint64_t expert_bytes, uint32_t n_used) {                                              \
        ember_moe_glu_int8<format, glu>(y, wg, wu, x, experts, n_rows, n_cols, expert_bytes, n_used);                             \
    }

// ember_moe_down_<format>_l<LANES>(float* out, const uint8_t* w, const int8_t* hq, const float2* hds,
// const int32_t* experts, const float* weights, const float* expert_scale, const float* shared,
// const float* shared_logit, uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t n_used)
#define EMBER_MOE_DOWN(name, format, lanes)                                                                                          \
    EMBER_KERNEL void name(float* out, const uint8_t* w, const int8_t* hq, const float2* hds, const int32_t* experts,               \
                           const float* weights, const float* expert_scale, const float* shared, const float* shared_logit,         \
                           uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t n_used) {                              \
        ember_moe_down_int8<format, lanes>(out, w, hq, hds, experts, weights, expert_scale, shared, shared_logit, n_rows, n_cols,   \
                                           expert_bytes, n_used);                                                                 \
    }

EMBER_MOE_GLU(ember_moe_swiglu_q4_0, EmberMvQ4_0, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q4_0, EmberMvQ4_0, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q4_1, EmberMvQ4_1, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q4_1, EmberMvQ4_1, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q5_0, EmberMvQ5_0, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q5_0, EmberMvQ5_0, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q5_1, EmberMvQ5_1, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q5_1, EmberMvQ5_1, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q8_0, EmberMvQ8_0, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q8_0, EmberMvQ8_0, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q4_k, EmberMvQ4_K, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q4_k, EmberMvQ4_K, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q5_k, EmberMvQ5_K, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q5_k, EmberMvQ5_K, EMBER_GLU_GELU)
EMBER_MOE_GLU(ember_moe_swiglu_q6_k, EmberMvQ6_K, EMBER_GLU_SILU)
EMBER_MOE_GLU(ember_moe_geglu_q6_k, EmberMvQ6_K, EMBER_GLU_GELU)
EMBER_MOE_DOWN(ember_moe_down_q4_0_l16, EmberMvQ4_0, 16)
EMBER_MOE_DOWN(ember_moe_down_q4_0_l32, EmberMvQ4_0, 32)
EMBER_MOE_DOWN(ember_moe_down_q4_1_l16, EmberMvQ4_1, 16)
EMBER_MOE_DOWN(ember_moe_down_q4_1_l32, EmberMvQ4_1, 32)
EMBER_MOE_DOWN(ember_moe_down_q5_0_l16, EmberMvQ5_0, 16)
EMBER_MOE_DOWN(ember_moe_down_q5_0_l32, EmberMvQ5_0, 32)
EMBER_MOE_DOWN(ember_moe_down_q5_1_l16, EmberMvQ5_1, 16)
EMBER_MOE_DOWN(ember_moe_down_q5_1_l32, EmberMvQ5_1, 32)
EMBER_MOE_DOWN(ember_moe_down_q8_0_l16, EmberMvQ8_0, 16)
EMBER_MOE_DOWN(ember_moe_down_q8_0_l32, EmberMvQ8_0, 32)
EMBER_MOE_DOWN(ember_moe_down_q4_k_l16, EmberMvQ4_K, 16)
EMBER_MOE_DOWN(ember_moe_down_q4_k_l32, EmberMvQ4_K, 32)
EMBER_MOE_DOWN(ember_moe_down_q5_k_l16, EmberMvQ5_K, 16)
EMBER_MOE_DOWN(ember_moe_down_q5_k_l32, EmberMvQ5_K, 32)
EMBER_MOE_DOWN(ember_moe_down_q6_k_l16, EmberMvQ6_K, 16)
EMBER_MOE_DOWN(ember_moe_down_q6_k_l32, EmberMvQ6_K, 32)
