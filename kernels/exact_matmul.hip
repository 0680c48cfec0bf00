// Matrix products of the reference-numerics mode: out[t, r] = W[r] . x[t], every output float
// bit-identical to what the CPU backend (crates/quant, `ember_quant::matmul`) computes for the same
// weights and f32 activations on an x86 machine with AVX2. Speed is secondary; the fast kernels
// (matvec.hip, gemm.hip) stay the default.
//
// The spec is the Rust code, ported operation for operation:
//   * activations are first quantised exactly as the CPU quantises them (scalar/legacy.rs
//     `quantize_block_q8_runtime` for Q8_0 and Q8_1, scalar/kquants.rs `quantize_q8_k`,
//     scalar/float.rs for f16 and bf16), into a GPU layout: int8 quants [n_tokens, n_cols], the
//     f16 scales already widened to f32, and for Q8_K the i16 sums of each 16 quants;
//   * each output is computed by a group of 8 threads, thread l holding lane l of the CPU's
//     8-float AVX2 accumulator (lane l covers bytes 4l..4l+3 of every 32 bytes). Lane partial
//     sums are reduced in the CPU's tree with width-8 shuffles, so every step rounds where the
//     CPU rounds. Integer parts are exact in any order, and are split between the lanes freely
//     where the CPU only uses their total.
// Which float order an output follows depends on the format and, for some, on the token count
// and matrix shape (ops/exact_matmul.rs decides and passes `mode`):
//   * q4_0, q5_0, q8_0, q4_1, q5_1: GGML's AVX2 vec_dot (x86/avx2.rs `legacy_loop`): one FMA of
//     d_w*d_a by the 8 lane sums per block, for Q8_1 the min terms in a scalar FMA chain, then
//     `hsum_ps` (+ the chain). The CPU's 4-row matvec and its tiles give the same bits. But q4_0
//     matrices whose row count is a multiple of 8 follow llama.cpp's repacked order (mode 1,
//     repack_q4_0.rs): one FMA of each block's whole integer sum by d_w*d_a, no lanes;
//   * q6_K: AVX2 vec_dot at every token count (`rowwise_like_ggml`);
//   * q4_K: rows a multiple of 8: llama.cpp's repacked order (repack_order.rs), per super-block
//     (gemv: mode 1 tokens from gemm_tokens on, i.e. batches of 1-3) or per pair of sub-blocks
//     (gemm: tokens below gemm_tokens, i.e. every token of a batch of 4+); other row counts:
//     AVX2 vec_dot;
//   * q2_K, q3_K, q5_K: AVX2 vec_dot below 12 tokens (mode 0); from 12 tokens the CPU's tile
//     kernel (x86/tile.rs, mode 1): per 32-value chunk one FMA of the lane sums by s16*d_a, then
//     per 16-value half one FMA of m16 by d_a*bsum, lanes reduced by `hsum8` (hadd order) for
//     outputs in full 4-row by 2-token tiles and by `hsum_ps` for the rest;
//   * f32 and bf16: the scalar `lanes_dot` (8 lanes, separate multiply and add, a sequential
//     tail); f16: AVX2 `vec_dot_f16` (two FMA accumulators alternating per 8 values).
//
// Bit-exactness rules: every float operation goes through the ex_* helpers of ember_exact.h. nvcc contracts
// a*b+c into an FMA unless the _rn intrinsics are used; HIP's __fadd_rn/__fmul_rn are plain
// `x + y` / `x * y` in its headers and are contracted too (clang's HIP default is
// -ffp-contract=fast-honor-pragmas), so on AMD the header and this file turn contraction off with a
// pragma and the helpers are the operators themselves. Divisions are IEEE (nvcc __fdiv_rn; clang HIP divides correctly
// rounded by default) and no denormal is flushed (neither compiler flushes by default).
//
// Launch (ops/exact_matmul.rs): quantisation kernels grid-stride or one thread per block; matmul
// kernels with EMBER_EXACT_THREADS threads = 32 groups of 8, each block a tile of 32 / tile_tokens
// rows by tile_tokens tokens, grid (ceil(n_rows / (32 / tile_tokens)), token tiles), tokens from
// token0 + blockIdx.y * tile_tokens (so launches can be split in token slices).
#include "ember_exact.h"

#if defined(EMBER_PLATFORM_HIP)
#pragma clang fp contract(off)
#endif

#define EMBER_EXACT_THREADS 256
// Threads per output: the 8 float lanes of the CPU's AVX2 accumulator.
#define EMBER_EXACT_LANES 8
#define EMBER_EXACT_GROUPS (EMBER_EXACT_THREADS / EMBER_EXACT_LANES)

// GGML_FP32_TO_BF16 (scalar/float.rs `f32_to_bf16_bits`): nearest even, NaN kept quiet; -> f32.
EMBER_DEVICE float ex_round_bf16(float v) {
    const uint32_t u = __float_as_uint(v);
    uint32_t bits;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        bits = (u >> 16) | 64u;
    } else {
        bits = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
    }
    return __uint_as_float((bits & 0xffffu) << 16);
}

// ---- Shuffles within one group of 8 lanes ----

EMBER_DEVICE float ex_shfl_xor8(float v, int mask) {
#if defined(EMBER_PLATFORM_CUDA)
    return __shfl_xor_sync(0xffffffffu, v, mask, EMBER_EXACT_LANES);
#else
    return __shfl_xor(v, mask, EMBER_EXACT_LANES);
#endif
}

EMBER_DEVICE int ex_shfl_xor8_int(int v, int mask) {
#if defined(EMBER_PLATFORM_CUDA)
    return __shfl_xor_sync(0xffffffffu, v, mask, EMBER_EXACT_LANES);
#else
    return __shfl_xor(v, mask, EMBER_EXACT_LANES);
#endif
}

// The value of lane `src` (0..7) of this thread's group.
EMBER_DEVICE int ex_shfl8_int(int v, int src) {
#if defined(EMBER_PLATFORM_CUDA)
    return __shfl_sync(0xffffffffu, v, src, EMBER_EXACT_LANES);
#else
    return __shfl(v, src, EMBER_EXACT_LANES);
#endif
}

// AVX2 `hsum_ps` of the group's lanes v0..v7: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
// Addition is commutative, so every lane ends with the same bits.
EMBER_DEVICE float ex_hsum_ps(float v) {
    v = ex_add(v, ex_shfl_xor8(v, 4));
    v = ex_add(v, ex_shfl_xor8(v, 2));
    return ex_add(v, ex_shfl_xor8(v, 1));
}

// The tile kernel's `hsum8` (x86/tile.rs, two rounds of `hadd`) for one output:
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)).
EMBER_DEVICE float ex_hsum_hadd(float v) {
    v = ex_add(v, ex_shfl_xor8(v, 1));
    v = ex_add(v, ex_shfl_xor8(v, 2));
    return ex_add(v, ex_shfl_xor8(v, 4));
}

// Exact integer sum over the group's lanes.
EMBER_DEVICE int ex_isum8(int v) {
    v += ex_shfl_xor8_int(v, 4);
    v += ex_shfl_xor8_int(v, 2);
    return v + ex_shfl_xor8_int(v, 1);
}

// ---- AVX2 integer idioms, emulated where they can differ from exact arithmetic ----

EMBER_DEVICE int ex_sat16(int v) { return v > 32767 ? 32767 : (v < -32768 ? -32768 : v); }

// One i16 of `maddubs(|x|, sign(y, x))` (x86/avx2.rs `dot_i8`) for signed bytes x0, x1 and y0,
// y1: |x| as an unsigned byte (128 for -128), y negated with wrap-around where x < 0 and zeroed
// where x == 0, the pair sum saturated to i16. Equal to x0*y0 + x1*y1 except for -128s.
EMBER_DEVICE int ex_signed_pair(int x0, int y0, int x1, int y1) {
    const int a0 = x0 < 0 ? -x0 : x0;
    const int a1 = x1 < 0 ? -x1 : x1;
    const int s0 = x0 < 0 ? (int)(int8_t)(-y0) : (x0 == 0 ? 0 : y0);
    const int s1 = x1 < 0 ? (int)(int8_t)(-y1) : (x1 == 0 ? 0 : y1);
    return ex_sat16(a0 * s0 + a1 * s1);
}

// ---- Activation quantisation ----

// Q8_0 / Q8_1 as GGML's x86 CPU backend quantises activations at run time (scalar/legacy.rs
// `quantize_block_q8_runtime`): amax = max |x|, d = amax / 127, multiplier 127 / amax (0 when
// amax is 0), quants round-half-even(x * multiplier) saturated to i8 (NaN to 0); d stored as f16,
// and for Q8_1 s = f16(sum(q) * d). One thread per 32-value block; block i holds x[32 i, 32 i + 32).
template <bool WITH_SUM>
EMBER_DEVICE void ex_quantize_q8_32(const float* x, int8_t* q, float* d, float* s, uint32_t n_blocks) {
    for (uint32_t blk = blockIdx.x * blockDim.x + threadIdx.x; blk < n_blocks; blk += gridDim.x * blockDim.x) {
        const float* xb = x + (size_t)blk * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        const float dv = ex_div(amax, 127.0f);
        const float id = amax != 0.0f ? ex_div(127.0f, amax) : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
            const float v = rintf(ex_mul(xb[i], id));
            // Rust's saturating `as i8`: NaN is 0, out-of-range values clamp.
            const int qi = v != v ? 0 : (int)fminf(fmaxf(v, -128.0f), 127.0f);
            q[(size_t)blk * 32 + i] = (int8_t)qi;
            sum += qi;
        }
        d[blk] = ex_round_f16(dv);
        if (WITH_SUM) s[blk] = ex_round_f16(ex_mul((float)sum, dv));
    }
}

EMBER_KERNEL void ember_exact_quantize_q8_0(const float* x, int8_t* q, float* d, float* s, uint32_t n_blocks) {
    ex_quantize_q8_32<false>(x, q, d, s, n_blocks);
}

EMBER_KERNEL void ember_exact_quantize_q8_1(const float* x, int8_t* q, float* d, float* s, uint32_t n_blocks) {
    ex_quantize_q8_32<true>(x, q, d, s, n_blocks);
}

// GGML's `nearest_int` (scalar/kquants.rs): the float mantissa trick, for every input.
EMBER_DEVICE int ex_nearest_int(float f) {
    const float v = ex_add(f, 12582912.0f);
    return (int)(__float_as_uint(v) & 0x007fffffu) - 0x00400000;
}

// Q8_K (scalar/kquants.rs `quantize_q8_k`, GGML's reference): max = the value of largest
// magnitude (the first on ties), iscale = -127 / max, q = min(nearest_int(iscale * x), 127) as
// i8 (wrapping), d = 1 / iscale, bsums = i16 sums of each 16 quants; an all-zero block is zeros.
// One thread per 256-value block.
EMBER_KERNEL void ember_exact_quantize_q8_k(const float* x, int8_t* q, float* d, int16_t* bsums, uint32_t n_blocks) {
    for (uint32_t blk = blockIdx.x * blockDim.x + threadIdx.x; blk < n_blocks; blk += gridDim.x * blockDim.x) {
        const float* xb = x + (size_t)blk * 256;
        int8_t* qb = q + (size_t)blk * 256;
        float vmax = 0.0f, amax = 0.0f;
        for (int i = 0; i < 256; ++i) {
            const float a = fabsf(xb[i]);
            if (a > amax) {
                amax = a;
                vmax = xb[i];
            }
        }
        if (amax == 0.0f) {
            for (int i = 0; i < 256; ++i) qb[i] = 0;
            for (int j = 0; j < 16; ++j) bsums[(size_t)blk * 16 + j] = 0;
            d[blk] = 0.0f;
            continue;
        }
        const float iscale = ex_div(-127.0f, vmax);
        for (int j = 0; j < 16; ++j) {
            int sum = 0;
            for (int i = 16 * j; i < 16 * j + 16; ++i) {
                int n = ex_nearest_int(ex_mul(iscale, xb[i]));
                n = n < 127 ? n : 127;
                const int8_t qi = (int8_t)(uint8_t)(uint32_t)n;
                qb[i] = qi;
                sum += qi;
            }
            bsums[(size_t)blk * 16 + j] = (int16_t)(uint16_t)(uint32_t)sum;
        }
        d[blk] = ex_div(1.0f, iscale);
    }
}

// f16 and bf16 activations (GGML's vec_dot_type of f16 and bf16 weights): x rounded, kept as f32.
EMBER_KERNEL void ember_exact_round_f16(const float* x, float* out, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = ex_round_f16(x[i]);
}

EMBER_KERNEL void ember_exact_round_bf16(const float* x, float* out, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = ex_round_bf16(x[i]);
}

// ---- Matmul kernels: common arguments and the output a group computes ----

// out f32 [n_tokens, n_rows]; w the matrix in GGML layout; act the activations (int8 quants, or
// f32 values for the float formats) [n_tokens, n_cols]; act_d one scale per activation block
// (32 values for Q8_0/Q8_1, 256 for Q8_K); act_s Q8_1's s per block; act_bsums Q8_K's 16 sums per
// block. Unused pointers may be null.
#define EMBER_EXACT_MATMUL_ARGS                                                                     \
    float *out, const uint8_t *w, const void *act, const float *act_d, const float *act_s,          \
        const int16_t *act_bsums, uint32_t n_tokens, uint32_t token0, uint32_t n_rows, uint32_t n_cols, \
        uint32_t tile_tokens, uint32_t mode, uint32_t gemm_tokens

// The output of this thread's group and the thread's lane. Groups past the matrix compute a
// clamped output (every lane of a warp must take part in the shuffles) and store nothing.
struct ExOutput {
    uint32_t row, token;
    int lane;
    bool store;
};

EMBER_DEVICE ExOutput ex_output(uint32_t n_tokens, uint32_t token0, uint32_t n_rows, uint32_t tile_tokens) {
    const uint32_t group = threadIdx.x / EMBER_EXACT_LANES;
    const uint32_t tile_rows = EMBER_EXACT_GROUPS / tile_tokens;
    ExOutput o;
    o.lane = (int)(threadIdx.x % EMBER_EXACT_LANES);
    o.row = blockIdx.x * tile_rows + group % tile_rows;
    o.token = token0 + blockIdx.y * tile_tokens + group / tile_rows;
    o.store = o.row < n_rows && o.token < n_tokens;
    if (o.row >= n_rows) o.row = n_rows - 1;
    if (o.token >= n_tokens) o.token = n_tokens - 1;
    return o;
}

EMBER_DEVICE void ex_store(float* out, const ExOutput& o, uint32_t n_rows, float value) {
    if (o.store && o.lane == 0) out[(size_t)o.token * n_rows + o.row] = value;
}

// ---- Legacy formats (32-value blocks) against Q8_0 / Q8_1 ----
// lane(b, l, v): the 4 weight values of elements 4l..4l+3 of block b (signed formats: the value,
// unsigned: the stored quant); m(b): the block's min (f16, widened). Every block starts with its
// f16 scale d.

struct ExQ4_0 {
    static constexpr int BYTES = 18;
    static constexpr bool SIGNED = true, MINS = false;
    EMBER_DEVICE void lane(const uint8_t* b, int l, int v[4]) {
        for (int k = 0; k < 4; ++k) {
            const int byte = b[2 + 4 * (l & 3) + k];
            v[k] = (l < 4 ? (byte & 15) : (byte >> 4)) - 8;
        }
    }
    EMBER_DEVICE float m(const uint8_t*) { return 0.0f; }
};

struct ExQ4_1 {
    static constexpr int BYTES = 20;
    static constexpr bool SIGNED = false, MINS = true;
    EMBER_DEVICE void lane(const uint8_t* b, int l, int v[4]) {
        for (int k = 0; k < 4; ++k) {
            const int byte = b[4 + 4 * (l & 3) + k];
            v[k] = l < 4 ? (byte & 15) : (byte >> 4);
        }
    }
    EMBER_DEVICE float m(const uint8_t* b) { return ex_half_at(b + 2); }
};

EMBER_DEVICE uint32_t ex_u32_at(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// block_q5_0: half d; u8 qh[4]; u8 qs[16]. Element e: nibble as Q4, fifth bit = bit e of qh.
struct ExQ5_0 {
    static constexpr int BYTES = 22;
    static constexpr bool SIGNED = true, MINS = false;
    EMBER_DEVICE void lane(const uint8_t* b, int l, int v[4]) {
        const uint32_t qh = ex_u32_at(b + 2);
        for (int k = 0; k < 4; ++k) {
            const int e = 4 * l + k;
            const int byte = b[6 + 4 * (l & 3) + k];
            const int nibble = l < 4 ? (byte & 15) : (byte >> 4);
            v[k] = (nibble | (int)(((qh >> e) & 1u) << 4)) - 16;
        }
    }
    EMBER_DEVICE float m(const uint8_t*) { return 0.0f; }
};

// block_q5_1: half d; half m; u8 qh[4]; u8 qs[16].
struct ExQ5_1 {
    static constexpr int BYTES = 24;
    static constexpr bool SIGNED = false, MINS = true;
    EMBER_DEVICE void lane(const uint8_t* b, int l, int v[4]) {
        const uint32_t qh = ex_u32_at(b + 4);
        for (int k = 0; k < 4; ++k) {
            const int e = 4 * l + k;
            const int byte = b[8 + 4 * (l & 3) + k];
            const int nibble = l < 4 ? (byte & 15) : (byte >> 4);
            v[k] = nibble | (int)(((qh >> e) & 1u) << 4);
        }
    }
    EMBER_DEVICE float m(const uint8_t* b) { return ex_half_at(b + 2); }
};

struct ExQ8_0 {
    static constexpr int BYTES = 34;
    static constexpr bool SIGNED = true, MINS = false;
    EMBER_DEVICE void lane(const uint8_t* b, int l, int v[4]) {
        for (int k = 0; k < 4; ++k) v[k] = (int8_t)b[2 + 4 * l + k];
    }
    EMBER_DEVICE float m(const uint8_t*) { return 0.0f; }
};

// mode 0: x86/avx2.rs `legacy_loop`: per block acc = fma(d_w * d_a, lane sum, acc) and, with
// mins, summs = fma(m_w, s_a, summs); the result hsum_ps(acc) + summs (+0 for the signed formats,
// as the CPU adds its zero chain too). mode 1 (q4_0 with rows a multiple of 8, which llama.cpp
// repacks): repack_q4_0.rs, one float per output, per block acc = fma(block isum, d_w * d_a, acc)
// with the block's integer sum over all 8 lanes; the result acc.
template <typename F>
EMBER_DEVICE void ex_matmul_legacy(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const uint32_t nb = n_cols / 32;
    const uint8_t* row = w + (size_t)o.row * nb * F::BYTES;
    const int8_t* a = (const int8_t*)act + (size_t)o.token * n_cols + 4 * o.lane;
    const float* ad = act_d + (size_t)o.token * nb;
    const float* as = F::MINS ? act_s + (size_t)o.token * nb : nullptr;
    float acc = 0.0f, summs = 0.0f;
    for (uint32_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = row + (size_t)blk * F::BYTES;
        int v[4];
        F::lane(b, o.lane, v);
        const int8_t* y = a + 32 * blk;
        int isum;
        if (F::SIGNED) {
            isum = ex_signed_pair(v[0], y[0], v[1], y[1]) + ex_signed_pair(v[2], y[2], v[3], y[3]);
        } else {
            isum = ex_sat16(v[0] * y[0] + v[1] * y[1]) + ex_sat16(v[2] * y[2] + v[3] * y[3]);
        }
        if (mode == 1) {
            acc = ex_fma((float)ex_isum8(isum), ex_mul(ex_half_at(b), ad[blk]), acc);
        } else {
            acc = ex_fma(ex_mul(ex_half_at(b), ad[blk]), (float)isum, acc);
        }
        if (F::MINS) summs = ex_fma(F::m(b), as[blk], summs);
    }
    ex_store(out, o, n_rows, mode == 1 ? acc : ex_add(ex_hsum_ps(acc), summs));
}

// ---- K-quants (256-value super-blocks) against Q8_K ----

// Scale and min j (0..7) of the 12 packed bytes of q4_K/q5_K (blocks.rs `scale_min_k4`).
EMBER_DEVICE void ex_scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Signed scale j (0..15) of q3_K's 12 packed bytes (blocks.rs `q3k_scales`).
EMBER_DEVICE int ex_q3k_scale(const uint8_t* s, int j) {
    const int low = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
    const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (low | (high << 4)) - 32;
}

// Unsigned weight values of element e (0..255) of a super-block, as the CPU tiles unpack them:
// q2_K 0..3; q3_K value + 4, 0..7; q5_K 0..31 (scalar/kquants.rs q2k/q3k/k4_values).
EMBER_DEVICE int ex_q2k_value(const uint8_t* b, int e) {
    const int half = e / 128, shift = (e % 128) / 32, j = e % 32;
    return (b[16 + 32 * half + j] >> (2 * shift)) & 3;
}

EMBER_DEVICE int ex_q3k_value4(const uint8_t* b, int e) {
    const int half = e / 128, shift = (e % 128) / 32, j = e % 32;
    const int low = (b[32 + 32 * half + j] >> (2 * shift)) & 3;
    const int set = (b[j] >> (4 * half + shift)) & 1;
    return low + 4 * set;
}

EMBER_DEVICE int ex_q5k_value(const uint8_t* b, int e) {
    const int c = e / 64, r = e % 64, j = r % 32;
    const int q = b[48 + 32 * c + j], h = b[16 + j];
    return r < 32 ? ((q & 15) | (((h >> (2 * c)) & 1) << 4)) : ((q >> 4) | (((h >> (2 * c + 1)) & 1) << 4));
}

// q6_K value (0..63, before the -32) of element 128 c + 32 k + j.
EMBER_DEVICE int ex_q6k_value(const uint8_t* b, int c, int k, int j) {
    const uint8_t* ql = b + 64 * c;
    const int h = b[128 + 32 * c + j];
    const int low = (k & 1) ? ql[j + 32] : ql[j];
    const int nibble = k < 2 ? (low & 15) : (low >> 4);
    return nibble | (((h >> (2 * k)) & 3) << 4);
}

// Per-format pieces of the K-quant paths.
//   BYTES; isum_msum(b, y, bsums, l, isum, msum): this lane's share of vec_dot's integer totals
//   (the block's `isum` and `msum`, exact); value(b, e): the tile's unsigned weight value;
//   s16(b, j) and m16(b, j): the tile's scale and offset of 16-value sub-block j.
struct ExQ2_K {
    static constexpr int BYTES = 84;
    static constexpr bool HAS_MIN = true;
    EMBER_DEVICE float d(const uint8_t* b) { return ex_half_at(b + 80); }
    EMBER_DEVICE float dmin(const uint8_t* b) { return ex_half_at(b + 82); }
    EMBER_DEVICE void isum_msum(const uint8_t* b, const int8_t* y, const int16_t* bs, int l, int* isum, int* msum) {
        int is = 0;
        for (int half = 0; half < 2; ++half) {
            for (int shift = 0; shift < 4; ++shift) {
                const int e = 128 * half + 32 * shift + 4 * l;
                int part = 0;
                for (int i = 0; i < 4; ++i) part += ex_q2k_value(b, e + i) * y[e + i];
                is += (b[e / 16] & 15) * part;
            }
        }
        *isum = is;
        *msum = (b[l] >> 4) * bs[l] + (b[l + 8] >> 4) * bs[l + 8];
    }
    EMBER_DEVICE int value(const uint8_t* b, int e) { return ex_q2k_value(b, e); }
    EMBER_DEVICE float s16(const uint8_t* b, int j) { return ex_mul(d(b), (float)(b[j] & 15)); }
    EMBER_DEVICE float m16(const uint8_t* b, int j) { return ex_mul(-dmin(b), (float)(b[j] >> 4)); }
};

struct ExQ3_K {
    static constexpr int BYTES = 110;
    static constexpr bool HAS_MIN = false;
    EMBER_DEVICE float d(const uint8_t* b) { return ex_half_at(b + 108); }
    EMBER_DEVICE float dmin(const uint8_t*) { return 0.0f; }
    EMBER_DEVICE void isum_msum(const uint8_t* b, const int8_t* y, const int16_t*, int l, int* isum, int* msum) {
        int is = 0;
        for (int half = 0; half < 2; ++half) {
            for (int shift = 0; shift < 4; ++shift) {
                const int e = 128 * half + 32 * shift + 4 * l;
                int part = 0;
                for (int i = 0; i < 4; ++i) part += (ex_q3k_value4(b, e + i) - 4) * y[e + i];
                is += ex_q3k_scale(b + 96, e / 16) * part;
            }
        }
        *isum = is;
        *msum = 0;
    }
    EMBER_DEVICE int value(const uint8_t* b, int e) { return ex_q3k_value4(b, e); }
    EMBER_DEVICE float s16(const uint8_t* b, int j) { return ex_mul(d(b), (float)ex_q3k_scale(b + 96, j)); }
    EMBER_DEVICE float m16(const uint8_t* b, int j) { return ex_mul(-4.0f, s16(b, j)); }
};

struct ExQ5_K {
    static constexpr int BYTES = 176;
    static constexpr bool HAS_MIN = true;
    EMBER_DEVICE float d(const uint8_t* b) { return ex_half_at(b); }
    EMBER_DEVICE float dmin(const uint8_t* b) { return ex_half_at(b + 2); }
    EMBER_DEVICE void isum_msum(const uint8_t* b, const int8_t* y, const int16_t* bs, int l, int* isum, int* msum) {
        int is = 0;
        for (int c = 0; c < 4; ++c) {
            int scale, min, part_lo = 0, part_hi = 0;
            for (int i = 0; i < 4; ++i) {
                const int e = 64 * c + 4 * l + i;
                part_lo += ex_q5k_value(b, e) * y[e];
                part_hi += ex_q5k_value(b, e + 32) * y[e + 32];
            }
            ex_scale_min_k4(2 * c, b + 4, &scale, &min);
            is += scale * part_lo;
            ex_scale_min_k4(2 * c + 1, b + 4, &scale, &min);
            is += scale * part_hi;
        }
        *isum = is;
        int scale0, min0, scale1, min1;
        ex_scale_min_k4(l / 2, b + 4, &scale0, &min0);
        ex_scale_min_k4((l + 8) / 2, b + 4, &scale1, &min1);
        *msum = min0 * bs[l] + min1 * bs[l + 8];
    }
    EMBER_DEVICE int value(const uint8_t* b, int e) { return ex_q5k_value(b, e); }
    EMBER_DEVICE float s16(const uint8_t* b, int j) {
        int scale, min;
        ex_scale_min_k4(j / 2, b + 4, &scale, &min);
        return ex_mul(d(b), (float)scale);
    }
    EMBER_DEVICE float m16(const uint8_t* b, int j) {
        int scale, min;
        ex_scale_min_k4(j / 2, b + 4, &scale, &min);
        return ex_mul(-dmin(b), (float)min);
    }
};

// q2_K, q3_K, q5_K. mode 0: AVX2 vec_dot, per super-block
//   sumf += (d_a * d) * isum - (d_a * dmin) * msum   (q3_K: sumf += (d_a * d) * isum),
// the integer totals summed over the lanes first. mode 1: the CPU's AVX2 tile (see the top).
template <typename F>
EMBER_DEVICE void ex_matmul_k_small(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const int l = o.lane;
    const uint32_t nb = n_cols / 256;
    const uint8_t* row = w + (size_t)o.row * nb * F::BYTES;
    const int8_t* a = (const int8_t*)act + (size_t)o.token * n_cols;
    const float* ad = act_d + (size_t)o.token * nb;
    const int16_t* bsums = act_bsums + (size_t)o.token * nb * 16;
    if (mode == 0) {
        float sumf = 0.0f;
        for (uint32_t blk = 0; blk < nb; ++blk) {
            const uint8_t* b = row + (size_t)blk * F::BYTES;
            int isum, msum;
            F::isum_msum(b, a + 256 * blk, bsums + 16 * blk, l, &isum, &msum);
            isum = ex_isum8(isum);
            msum = ex_isum8(msum);
            const float d8 = ad[blk];
            const float term = ex_mul(ex_mul(d8, F::d(b)), (float)isum);
            if (F::HAS_MIN) {
                sumf = ex_add(sumf, ex_sub(term, ex_mul(ex_mul(d8, F::dmin(b)), (float)msum)));
            } else {
                sumf = ex_add(sumf, term);
            }
        }
        ex_store(out, o, n_rows, sumf);
        return;
    }
    // The tile: every chunk of the row first, then every half.
    float acc = 0.0f;
    for (uint32_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = row + (size_t)blk * F::BYTES;
        const int8_t* y = a + 256 * blk;
        const float da = ad[blk];
        for (int c = 0; c < 8; ++c) {
            int isum = 0;
            for (int i = 0; i < 4; ++i) {
                const int e = 32 * c + 4 * l + i;
                isum += F::value(b, e) * y[e];
            }
            const float scale = ex_mul(F::s16(b, 2 * c + (l >= 4 ? 1 : 0)), da);
            acc = ex_fma((float)isum, scale, acc);
        }
    }
    for (uint32_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = row + (size_t)blk * F::BYTES;
        const float da = ad[blk];
        for (int j = l; j < 16; j += 8) {
            const float sh = ex_mul(da, (float)bsums[16 * blk + j]);
            acc = ex_fma(F::m16(b, j), sh, acc);
        }
    }
    // Full 4-row by 2-token tiles reduce with hsum8, the edges with hsum_ps (both computed, so
    // every lane takes part in every shuffle).
    const bool full_tile = o.row < n_rows - n_rows % 4 && o.token < n_tokens - n_tokens % 2;
    const float tile_sum = ex_hsum_hadd(acc);
    const float edge_sum = ex_hsum_ps(acc);
    ex_store(out, o, n_rows, full_tile ? tile_sum : edge_sum);
}

// q4_K. mode 0: AVX2 vec_dot_q4_k_q8_k: per super-block acc = fma(d_a * d, lane isum, acc) and
// on four min lanes acc_m = fma(-d_a * dmin, mins . pair sums of bsums, acc_m); result
// hsum_ps(acc) + ((m0 + m2) + (m1 + m3)). mode 1: repack_order.rs, lane l holding sub-block l:
// tokens below gemm_tokens one FMA per pair of sub-blocks, the others one per super-block;
// result acc - acc_min.
EMBER_DEVICE void ex_matmul_q4_k(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const int l = o.lane;
    const uint32_t nb = n_cols / 256;
    const uint8_t* row = w + (size_t)o.row * nb * 144;
    const int8_t* a = (const int8_t*)act + (size_t)o.token * n_cols;
    const float* ad = act_d + (size_t)o.token * nb;
    const int16_t* bsums = act_bsums + (size_t)o.token * nb * 16;
    if (mode == 0) {
        float acc = 0.0f, acc_m = 0.0f;
        const int ml = l & 3;
        for (uint32_t blk = 0; blk < nb; ++blk) {
            const uint8_t* b = row + (size_t)blk * 144;
            const int8_t* y = a + 256 * blk;
            const int16_t* bs = bsums + 16 * blk;
            const float d8 = ad[blk];
            const float d = ex_mul(d8, ex_half_at(b));
            const float dmin = ex_mul(-d8, ex_half_at(b + 2));
            int isum = 0;
            for (int j = 0; j < 4; ++j) {
                int scale_lo, min_lo, scale_hi, min_hi, part_lo = 0, part_hi = 0;
                ex_scale_min_k4(2 * j, b + 4, &scale_lo, &min_lo);
                ex_scale_min_k4(2 * j + 1, b + 4, &scale_hi, &min_hi);
                for (int i = 0; i < 4; ++i) {
                    const int q = b[16 + 32 * j + 4 * l + i];
                    part_lo += (q & 15) * y[64 * j + 4 * l + i];
                    part_hi += (q >> 4) * y[64 * j + 32 + 4 * l + i];
                }
                isum += scale_lo * part_lo + scale_hi * part_hi;
            }
            acc = ex_fma(d, (float)isum, acc);
            int s0, m0, s1, m1;
            ex_scale_min_k4(2 * ml, b + 4, &s0, &m0);
            ex_scale_min_k4(2 * ml + 1, b + 4, &s1, &m1);
            const int q8s0 = (int16_t)(bs[4 * ml] + bs[4 * ml + 1]);
            const int q8s1 = (int16_t)(bs[4 * ml + 2] + bs[4 * ml + 3]);
            acc_m = ex_fma(dmin, (float)(m0 * q8s0 + m1 * q8s1), acc_m);
        }
        float m = ex_add(acc_m, ex_shfl_xor8(acc_m, 2));
        m = ex_add(m, ex_shfl_xor8(m, 1));
        ex_store(out, o, n_rows, ex_add(ex_hsum_ps(acc), m));
        return;
    }
    const bool per_pair = o.token < gemm_tokens;
    float acc = 0.0f, acc_min = 0.0f;
    for (uint32_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = row + (size_t)blk * 144;
        const int8_t* y = a + 256 * blk + 32 * l;
        const int16_t* bs = bsums + 16 * blk;
        const float da = ad[blk];
        int scale, min;
        ex_scale_min_k4(l, b + 4, &scale, &min);
        const uint8_t* qs = b + 16 + 32 * (l / 2);
        int dot = 0;
        for (int i = 0; i < 32; ++i) dot += ((l & 1) ? (qs[i] >> 4) : (qs[i] & 15)) * y[i];
        const int i_l = scale * dot;
        const int s_l = min * (bs[2 * l] + bs[2 * l + 1]);
        const float sc = ex_mul(ex_half_at(b), da);
        const float sc_min = ex_mul(ex_half_at(b + 2), da);
        // Pair p's integers on every lane (shuffled outside the branch, which may diverge
        // between the groups of an AMD wavefront).
        const int i_pair = i_l + ex_shfl_xor8_int(i_l, 1);
        const int s_pair = s_l + ex_shfl_xor8_int(s_l, 1);
        int ip[4], sp[4];
        for (int p = 0; p < 4; ++p) {
            ip[p] = ex_shfl8_int(i_pair, 2 * p);
            sp[p] = ex_shfl8_int(s_pair, 2 * p);
        }
        if (per_pair) {
            for (int p = 0; p < 4; ++p) {
                acc = ex_fma((float)ip[p], sc, acc);
                acc_min = ex_fma((float)sp[p], sc_min, acc_min);
            }
        } else {
            acc = ex_fma((float)(ip[0] + ip[1] + ip[2] + ip[3]), sc, acc);
            acc_min = ex_fma((float)(sp[0] + sp[1] + sp[2] + sp[3]), sc_min, acc_min);
        }
    }
    ex_store(out, o, n_rows, ex_sub(acc, acc_min));
}

// q6_K: AVX2 vec_dot_q6_k_q8_k: per super-block acc = fma(d_a * d, lane isum, acc), where lane
// l's isum is the sum over the 8 quarters of scale * sum q * a of its 4 values (q the unsigned
// 6-bit value), minus 32 * (bsum[2l] * scale[2l] + bsum[2l+1] * scale[2l+1]); hsum_ps.
EMBER_DEVICE void ex_matmul_q6_k(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const int l = o.lane;
    const uint32_t nb = n_cols / 256;
    const uint8_t* row = w + (size_t)o.row * nb * 210;
    const int8_t* a = (const int8_t*)act + (size_t)o.token * n_cols;
    const float* ad = act_d + (size_t)o.token * nb;
    const int16_t* bsums = act_bsums + (size_t)o.token * nb * 16;
    float acc = 0.0f;
    for (uint32_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = row + (size_t)blk * 210;
        const int8_t* y = a + 256 * blk;
        int isum = 0;
        for (int c = 0; c < 2; ++c) {
            for (int k = 0; k < 4; ++k) {
                const int e = 128 * c + 32 * k;
                int part = 0;
                for (int i = 0; i < 4; ++i) {
                    const int j = 4 * l + i;
                    part += ex_q6k_value(b, c, k, j) * y[e + j];
                }
                isum += (int)(int8_t)b[192 + e / 16 + (l >= 4 ? 1 : 0)] * part;
            }
        }
        const int16_t* bs = bsums + 16 * blk;
        isum -= 32 * ((int)bs[2 * l] * (int)(int8_t)b[192 + 2 * l] +
                      (int)bs[2 * l + 1] * (int)(int8_t)b[192 + 2 * l + 1]);
        acc = ex_fma(ex_mul(ad[blk], ex_half_at(b + 208)), (float)isum, acc);
    }
    ex_store(out, o, n_rows, ex_hsum_ps(acc));
}

// ---- Float formats ----

// f32 and bf16 (scalar/float.rs `lanes_dot`): lane l sums w*x of elements 8g + l with a separate
// multiply and add; the n % 8 tail is a sequential sum of its own; hsum_ps(lanes) + tail.
template <bool BF16>
EMBER_DEVICE float ex_weight_f32_bf16(const uint8_t* row, uint32_t i) {
    if (BF16) {
        const unsigned short bits = ((const unsigned short*)row)[i];
        return __uint_as_float((uint32_t)bits << 16);
    }
    return ((const float*)row)[i];
}

template <bool BF16>
EMBER_DEVICE void ex_matmul_lanes_dot(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const uint8_t* row = w + (size_t)o.row * n_cols * (BF16 ? 2 : 4);
    const float* x = (const float*)act + (size_t)o.token * n_cols;
    const uint32_t full = n_cols / 8 * 8;
    float acc = 0.0f;
    for (uint32_t i = (uint32_t)o.lane; i < full; i += 8) acc = ex_add(acc, ex_mul(ex_weight_f32_bf16<BF16>(row, i), x[i]));
    float tail = 0.0f;
    for (uint32_t i = full; i < n_cols; ++i) tail = ex_add(tail, ex_mul(ex_weight_f32_bf16<BF16>(row, i), x[i]));
    ex_store(out, o, n_rows, ex_add(ex_hsum_ps(acc), tail));
}

// f16 (x86/avx2.rs `vec_dot_f16`): 8-value group g goes to accumulator g & 1 by FMA; the two are
// added lane-wise, reduced by hsum_ps, then the n % 8 tail is added product by product.
EMBER_DEVICE void ex_matmul_f16(EMBER_EXACT_MATMUL_ARGS) {
    const ExOutput o = ex_output(n_tokens, token0, n_rows, tile_tokens);
    const unsigned short* row = (const unsigned short*)w + (size_t)o.row * n_cols;
    const float* x = (const float*)act + (size_t)o.token * n_cols;
    const uint32_t full = n_cols / 8 * 8;
    float acc[2] = {0.0f, 0.0f};
    for (uint32_t g = 0; 8 * g < full; ++g) {
        const uint32_t i = 8 * g + (uint32_t)o.lane;
        acc[g & 1] = ex_fma(__half2float(__ushort_as_half(row[i])), x[i], acc[g & 1]);
    }
    float sum = ex_hsum_ps(ex_add(acc[0], acc[1]));
    for (uint32_t i = full; i < n_cols; ++i) sum = ex_add(sum, ex_mul(__half2float(__ushort_as_half(row[i])), x[i]));
    ex_store(out, o, n_rows, sum);
}

// ---- Exported kernels ----

EMBER_KERNEL void ember_exact_matmul_f32(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_lanes_dot<false>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_bf16(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_lanes_dot<true>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_f16(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_f16(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q4_0(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_legacy<ExQ4_0>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q4_1(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_legacy<ExQ4_1>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q5_0(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_legacy<ExQ5_0>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q5_1(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_legacy<ExQ5_1>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q8_0(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_legacy<ExQ8_0>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q2_k(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_k_small<ExQ2_K>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q3_k(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_k_small<ExQ3_K>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q4_k(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_q4_k(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q5_k(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_k_small<ExQ5_K>(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}

EMBER_KERNEL void ember_exact_matmul_q6_k(EMBER_EXACT_MATMUL_ARGS) {
    ex_matmul_q6_k(out, w, act, act_d, act_s, act_bsums, n_tokens, token0, n_rows, n_cols, tile_tokens, mode, gemm_tokens);
}
