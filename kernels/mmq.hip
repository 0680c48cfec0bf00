// Quantised matrix products for batches of more than 8 tokens (many sequences decoding at once,
// short prompts): y[t] = W x[t], W [n_rows, n_cols] in a GGUF integer format, x and y f32, with
// each weight byte read once per 64 tokens and the weights never expanded in memory (the BLAS
// path writes and reads an f16 copy of W every call, which dominates a batched decode step).
//
// Numerics are matvec.hip's: the activations are rounded to the weights' activation format
// exactly as the CPU backend rounds them (ember_mv_quantize of ember_q8.h), every group of 32
// values gives an exact integer dot product of int8 weights and int8 activations, and the f32
// scales multiply those sums as matvec.hip does. Only the order of the f32 additions differs
// from the CPU (and from matvec): outputs agree to f32 rounding of the row's magnitude. The order
// is fixed (per thread, then the K splits in index order), so results are deterministic.
//
// Two launches (three with a K split):
//   1. ember_mmq_quantize_{q8_0,q8_1,q8_k}: one block per token rounds x into a scratch buffer:
//      int8 values of token t at xq + t n_cols, laid out as ember_mv_xq_offset says for one token
//      (the first 16 bytes of every group of 32, then the second 16 bytes of every group), and
//      one float2 (d, s) per group at xds + t n_cols / 32 (see EMBER_ACT_* in ember_q8.h).
//   2. ember_mmq_<format>_n<NT>: block (bx, by, bz) computes rows 64 bx.. by tokens NT by.. over
//      K steps [bz steps_per_split, (bz + 1) steps_per_split) of 256 columns each, into
//      y + bz n_tokens n_rows. Per step every thread fetches its share of the weight blocks and
//      of the quantised activations from global memory into registers, unpacks the weights to
//      int8 (offsets applied: q4_0 q - 8, q5_0 q - 16, q6_K q - 32; q4_1, q5_1 and the k-quants
//      keep q and add their minimum through the activations' group sums) with one f32 scale per
//      group of 32 (per 16 for q6_K) in shared memory, and then, while the next step's loads are
//      in flight, multiplies the tiles: on NVIDIA sm_80 and newer with the int8 tensor-core
//      instruction (mma.sync m16n8k32, m16n8k16 for q6_K's 16-value scales; a warp owns 16 rows
//      by all NT tokens), elsewhere with dp4a/sdot4 (a thread owns one row by NT / 2 tokens).
//   3. ember_mmq_reduce: y = the sum of the K splits' partial results, in split order. Splitting
//      K gives small matrices (1024 or 4096 rows: 16 or 64 row tiles) enough blocks to keep the
//      memory system busy.
//
// Shapes: n_cols a multiple of 32 (256 for the k-quants; a last partial step of the 32-value
// formats is padded with zero weights and activations), weight rows 4-byte aligned for q4_1 and
// 8-byte aligned for q5_1 (true of every whole matrix in one pool allocation), x rows 16-byte
// aligned. Launch: EMBER_MMQ_THREADS threads, static shared memory only (under 48 KiB).
#include "ember_q8.h"

#define EMBER_MMQ_THREADS 128
// Rows of W per block, values of K per step, and groups of 32 per step.
#define EMBER_MMQ_ROWS 64
#define EMBER_MMQ_STEP 256
#define EMBER_MMQ_GROUPS 8
// Bytes per row of the int8 tiles in shared memory: 256 values plus 16 bytes, so that the eight
// rows one mma fragment load touches start in different banks (272 / 4 = 68 = 4 mod 32).
#define EMBER_MMQ_STRIDE 272
// Floats per row of the scale tiles: the weights' scales (one per group of 32, or per 16 values
// for q6_K) and minimums, the activations' (d, s). One more than the values, so that the rows a
// warp reads together fall in different banks.
#define EMBER_MMQ_WD_STRIDE 17
#define EMBER_MMQ_WM_STRIDE 9
#define EMBER_MMQ_XS_STRIDE 9

#if defined(EMBER_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define EMBER_MMQ_HAS_MMA 1
#else
#define EMBER_MMQ_HAS_MMA 0
#endif

// Four bytes v in [0, 2 bias) minus bias each, as signed bytes (bias 8, 16 or 32): adding
// 128 - bias keeps every byte below 256 (no carries), and flipping the top bit subtracts 128.
template <uint32_t BIAS>
EMBER_DEVICE uint32_t ember_mmq_unbias(uint32_t v) {
    return (v + (128u - BIAS) * 0x01010101u) ^ 0x80808080u;
}

// The shared tiles of one step: int8 weights and activations, and their per-group scales.
template <int NT>
struct EmberMmqTile {
    int4 wq[EMBER_MMQ_ROWS * EMBER_MMQ_STRIDE / 16];
    int4 xq[NT * EMBER_MMQ_STRIDE / 16];
    float wd[EMBER_MMQ_ROWS * EMBER_MMQ_WD_STRIDE];
    float wm[EMBER_MMQ_ROWS * EMBER_MMQ_WM_STRIDE];
    // Per token and group: (d, the format's activation term: see Format::act_term).
    float2 xds[NT * EMBER_MMQ_XS_STRIDE];
};

// ---- Weight formats: a unit is the part of a row's step one thread unpacks (a 32-value block,
// or a quarter of a 256-value super-block). fetch reads a unit into registers (Raw) without
// using it; commit unpacks it into the step's tiles: 32 int8 values per group at wq_row + 32 j,
// the group's scale at wd_row[j] (q6_K: wd_row[2 j + half]) and its minimum at wm_row[j]. A unit
// past the end of the row (the padding of a last partial step) is fetched as zeros and commits
// zero scales, so it adds nothing. add_term adds a group's f32 contribution, from its integer sum
// c (exact in f32) and the activation group's d and act_term, to an accumulator. ----

// q4_0 (18 bytes: half d, qs[16]): value = d (q - 8).
struct EmberMmqQ4_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0, BLOCK_VALUES = 32, BLOCK_BYTES = 18, UNITS = 8;
    static constexpr bool HALVES = false;
    struct Raw {
        float d;
        uint32_t qs[4];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint32_t block = step * UNITS + (uint32_t)u;
        if (block >= n_blocks) {
            raw.d = 0.0f;
            raw.qs[0] = raw.qs[1] = raw.qs[2] = raw.qs[3] = 0u;
            return;
        }
        const uint8_t* b = row + (size_t)BLOCK_BYTES * block;
        raw.d = ember_mv_half(b);
        ember_load_words_a2<4>(b + 2, raw.qs);
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = ember_mmq_unbias<8>(raw.qs[i] & 0x0f0f0f0fu);
            hi[i] = ember_mmq_unbias<8>((raw.qs[i] >> 4) & 0x0f0f0f0fu);
        }
        *(uint4*)(wq_row + 32 * u) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(wq_row + 32 * u + 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        wd_row[u] = raw.d;
        wm_row[u] = 0.0f;
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return sum; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, acc); }
};

// q4_1 (20 bytes: half d, half m, qs[16]): value = d q + m; the activations' s = d_x sum q_x.
struct EmberMmqQ4_1 {
    static constexpr int ACT = EMBER_ACT_Q8_1, BLOCK_VALUES = 32, BLOCK_BYTES = 20, UNITS = 8;
    static constexpr bool HALVES = false;
    struct Raw {
        float d, m;
        uint32_t qs[4];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint32_t block = step * UNITS + (uint32_t)u;
        if (block >= n_blocks) {
            raw.d = raw.m = 0.0f;
            raw.qs[0] = raw.qs[1] = raw.qs[2] = raw.qs[3] = 0u;
            return;
        }
        const uint8_t* b = row + (size_t)BLOCK_BYTES * block;
        raw.d = ember_mv_half(b);
        raw.m = ember_mv_half(b + 2);
        const uint32_t* p = (const uint32_t*)(b + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) raw.qs[i] = p[i];
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = raw.qs[i] & 0x0f0f0f0fu;
            hi[i] = (raw.qs[i] >> 4) & 0x0f0f0f0fu;
        }
        *(uint4*)(wq_row + 32 * u) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(wq_row + 32 * u + 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        wd_row[u] = raw.d;
        wm_row[u] = raw.m;
    }
    EMBER_DEVICE float act_term(float xd, float s) { return s; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, fmaf(wm, xs, acc)); }
};

// q5_0 (22 bytes: half d, qh u32, qs[16]): value = d (q - 16), q = nibble | bit v of qh << 4.
struct EmberMmqQ5_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0, BLOCK_VALUES = 32, BLOCK_BYTES = 22, UNITS = 8;
    static constexpr bool HALVES = false;
    struct Raw {
        float d;
        uint32_t qh, qs[4];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint32_t block = step * UNITS + (uint32_t)u;
        if (block >= n_blocks) {
            raw.d = 0.0f;
            raw.qh = raw.qs[0] = raw.qs[1] = raw.qs[2] = raw.qs[3] = 0u;
            return;
        }
        const uint8_t* b = row + (size_t)BLOCK_BYTES * block;
        raw.d = ember_mv_half(b);
        ember_load_words_a2<1>(b + 2, &raw.qh);
        ember_load_words_a2<4>(b + 6, raw.qs);
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = ember_mmq_unbias<16>((raw.qs[i] & 0x0f0f0f0fu) | ember_spread_high_bits(raw.qh >> (4 * i)));
            hi[i] = ember_mmq_unbias<16>(((raw.qs[i] >> 4) & 0x0f0f0f0fu) | ember_spread_high_bits(raw.qh >> (16 + 4 * i)));
        }
        *(uint4*)(wq_row + 32 * u) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(wq_row + 32 * u + 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        wd_row[u] = raw.d;
        wm_row[u] = 0.0f;
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return sum; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, acc); }
};

// q5_1 (24 bytes: half d, half m, qh u32, qs[16]): value = d q + m.
struct EmberMmqQ5_1 {
    static constexpr int ACT = EMBER_ACT_Q8_1, BLOCK_VALUES = 32, BLOCK_BYTES = 24, UNITS = 8;
    static constexpr bool HALVES = false;
    struct Raw {
        float d, m;
        uint32_t qh, qs[4];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint32_t block = step * UNITS + (uint32_t)u;
        if (block >= n_blocks) {
            raw.d = raw.m = 0.0f;
            raw.qh = raw.qs[0] = raw.qs[1] = raw.qs[2] = raw.qs[3] = 0u;
            return;
        }
        const uint8_t* b = row + (size_t)BLOCK_BYTES * block;
        raw.d = ember_mv_half(b);
        raw.m = ember_mv_half(b + 2);
        raw.qh = *(const uint32_t*)(b + 4);
        const uint2 q01 = *(const uint2*)(b + 8), q23 = *(const uint2*)(b + 16);
        raw.qs[0] = q01.x, raw.qs[1] = q01.y, raw.qs[2] = q23.x, raw.qs[3] = q23.y;
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = (raw.qs[i] & 0x0f0f0f0fu) | ember_spread_high_bits(raw.qh >> (4 * i));
            hi[i] = ((raw.qs[i] >> 4) & 0x0f0f0f0fu) | ember_spread_high_bits(raw.qh >> (16 + 4 * i));
        }
        *(uint4*)(wq_row + 32 * u) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(wq_row + 32 * u + 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        wd_row[u] = raw.d;
        wm_row[u] = raw.m;
    }
    EMBER_DEVICE float act_term(float xd, float s) { return s; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, fmaf(wm, xs, acc)); }
};

// q8_0 (34 bytes: half d, int8 qs[32]): value = d q.
struct EmberMmqQ8_0 {
    static constexpr int ACT = EMBER_ACT_Q8_0, BLOCK_VALUES = 32, BLOCK_BYTES = 34, UNITS = 8;
    static constexpr bool HALVES = false;
    struct Raw {
        float d;
        uint32_t qs[8];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint32_t block = step * UNITS + (uint32_t)u;
        if (block >= n_blocks) {
            raw.d = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) raw.qs[i] = 0u;
            return;
        }
        const uint8_t* b = row + (size_t)BLOCK_BYTES * block;
        raw.d = ember_mv_half(b);
        ember_load_words_a2<8>(b + 2, raw.qs);
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        *(uint4*)(wq_row + 32 * u) = make_uint4(raw.qs[0], raw.qs[1], raw.qs[2], raw.qs[3]);
        *(uint4*)(wq_row + 32 * u + 16) = make_uint4(raw.qs[4], raw.qs[5], raw.qs[6], raw.qs[7]);
        wd_row[u] = raw.d;
        wm_row[u] = 0.0f;
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return sum; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, acc); }
};

// q4_K (144 bytes: half d, half dmin, scales[12], qs[128]): unit k (0..3) of the step's
// super-block is sub-blocks 2k (low nibbles of qs[32k..32k+32]) and 2k+1 (high nibbles);
// value = d scale_j q - dmin min_j, so a group adds (d scale_j) d_x c - (dmin min_j) d_x sum q_x.
struct EmberMmqQ4_K {
    static constexpr int ACT = EMBER_ACT_Q8_K, BLOCK_VALUES = 256, BLOCK_BYTES = 144, UNITS = 4;
    static constexpr bool HALVES = false;
    struct Raw {
        float d, dmin;
        uint32_t sc[3], qs[8];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint8_t* b = row + (size_t)BLOCK_BYTES * step;
        raw.d = ember_mv_half(b);
        raw.dmin = ember_mv_half(b + 2);
        const uint32_t* sc = (const uint32_t*)(b + 4);
        raw.sc[0] = sc[0], raw.sc[1] = sc[1], raw.sc[2] = sc[2];
        const uint4* p = (const uint4*)(b + 16 + 32 * u);
        const uint4 v0 = p[0], v1 = p[1];
        raw.qs[0] = v0.x, raw.qs[1] = v0.y, raw.qs[2] = v0.z, raw.qs[3] = v0.w;
        raw.qs[4] = v1.x, raw.qs[5] = v1.y, raw.qs[6] = v1.z, raw.qs[7] = v1.w;
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        int scale_a, min_a, scale_b, min_b;
        ember_mv_scale_min_k4(2 * u, raw.sc[0], raw.sc[1], raw.sc[2], &scale_a, &min_a);
        ember_mv_scale_min_k4(2 * u + 1, raw.sc[0], raw.sc[1], raw.sc[2], &scale_b, &min_b);
        uint32_t lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = raw.qs[i] & 0x0f0f0f0fu;
            hi[i] = (raw.qs[i] >> 4) & 0x0f0f0f0fu;
        }
        uint4* out = (uint4*)(wq_row + 64 * u);
        out[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        out[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
        out[2] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        out[3] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
        wd_row[2 * u] = raw.d * (float)scale_a;
        wd_row[2 * u + 1] = raw.d * (float)scale_b;
        wm_row[2 * u] = raw.dmin * (float)min_a;
        wm_row[2 * u + 1] = raw.dmin * (float)min_b;
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return xd * sum; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, fmaf(-wm, xs, acc)); }
};

// q5_K (176 bytes: half d, half dmin, scales[12], qh[32], qs[128]): as q4_K with a fifth bit,
// bit j of qh[l] for sub-block j.
struct EmberMmqQ5_K {
    static constexpr int ACT = EMBER_ACT_Q8_K, BLOCK_VALUES = 256, BLOCK_BYTES = 176, UNITS = 4;
    static constexpr bool HALVES = false;
    struct Raw {
        float d, dmin;
        uint32_t sc[3], qh[8], qs[8];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const uint8_t* b = row + (size_t)BLOCK_BYTES * step;
        raw.d = ember_mv_half(b);
        raw.dmin = ember_mv_half(b + 2);
        const uint32_t* sc = (const uint32_t*)(b + 4);
        raw.sc[0] = sc[0], raw.sc[1] = sc[1], raw.sc[2] = sc[2];
        const uint4* h = (const uint4*)(b + 16);
        const uint4 h0 = h[0], h1 = h[1];
        raw.qh[0] = h0.x, raw.qh[1] = h0.y, raw.qh[2] = h0.z, raw.qh[3] = h0.w;
        raw.qh[4] = h1.x, raw.qh[5] = h1.y, raw.qh[6] = h1.z, raw.qh[7] = h1.w;
        const uint4* p = (const uint4*)(b + 48 + 32 * u);
        const uint4 v0 = p[0], v1 = p[1];
        raw.qs[0] = v0.x, raw.qs[1] = v0.y, raw.qs[2] = v0.z, raw.qs[3] = v0.w;
        raw.qs[4] = v1.x, raw.qs[5] = v1.y, raw.qs[6] = v1.z, raw.qs[7] = v1.w;
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        int scale_a, min_a, scale_b, min_b;
        ember_mv_scale_min_k4(2 * u, raw.sc[0], raw.sc[1], raw.sc[2], &scale_a, &min_a);
        ember_mv_scale_min_k4(2 * u + 1, raw.sc[0], raw.sc[1], raw.sc[2], &scale_b, &min_b);
        uint32_t lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = (raw.qs[i] & 0x0f0f0f0fu) | (((raw.qh[i] >> (2 * u)) & 0x01010101u) << 4);
            hi[i] = ((raw.qs[i] >> 4) & 0x0f0f0f0fu) | (((raw.qh[i] >> (2 * u + 1)) & 0x01010101u) << 4);
        }
        uint4* out = (uint4*)(wq_row + 64 * u);
        out[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        out[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
        out[2] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        out[3] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
        wd_row[2 * u] = raw.d * (float)scale_a;
        wd_row[2 * u + 1] = raw.d * (float)scale_b;
        wm_row[2 * u] = raw.dmin * (float)min_a;
        wm_row[2 * u + 1] = raw.dmin * (float)min_b;
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return xd * sum; }
    EMBER_DEVICE float add_term(float acc, float wd, float wm, float xd, float xs, float c) { return fmaf(wd * xd, c, fmaf(-wm, xs, acc)); }
};

// q6_K (210 bytes: ql[128], qh[64], int8 scales[16], half d): unit u = 2 h + c covers groups
// 4 h + c and 4 h + c + 2 (matvec.hip's EmberMvQ6_K says how their bits are stored); value =
// d scale (q - 32) with one scale per 16 values, scale i = scales[i] for the step's values
// 16 i..16 i + 15, so group j's halves take scales 2 j and 2 j + 1.
struct EmberMmqQ6_K {
    static constexpr int ACT = EMBER_ACT_Q8_K, BLOCK_VALUES = 256, BLOCK_BYTES = 210, UNITS = 4;
    static constexpr bool HALVES = true;
    struct Raw {
        float d;
        uint32_t ql[8], qh[8];
        int scales[4];
    };
    EMBER_DEVICE void fetch(const uint8_t* row, uint32_t step, int u, uint32_t n_blocks, Raw& raw) {
        const int h = u >> 1, c = u & 1;
        const uint8_t* b = row + (size_t)BLOCK_BYTES * step;
        ember_load_words_a2<8>(b + 64 * h + 32 * c, raw.ql);
        ember_load_words_a2<8>(b + 128 + 32 * h, raw.qh);
        const int8_t* scales = (const int8_t*)(b + 192 + 8 * h + 2 * c);
        raw.scales[0] = scales[0], raw.scales[1] = scales[1], raw.scales[2] = scales[4], raw.scales[3] = scales[5];
        raw.d = ember_mv_half(b + 208);
    }
    EMBER_DEVICE void commit(const Raw& raw, int u, int8_t* wq_row, float* wd_row, float* wm_row) {
        const int h = u >> 1, c = u & 1;
        uint32_t va[8], vb[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            va[i] = ember_mmq_unbias<32>((raw.ql[i] & 0x0f0f0f0fu) | (((raw.qh[i] >> (2 * c)) & 0x03030303u) << 4));
            vb[i] = ember_mmq_unbias<32>(((raw.ql[i] >> 4) & 0x0f0f0f0fu) | (((raw.qh[i] >> (2 * c + 4)) & 0x03030303u) << 4));
        }
        const int ja = 4 * h + c, jb = ja + 2;
        uint4* a = (uint4*)(wq_row + 32 * ja);
        uint4* b = (uint4*)(wq_row + 32 * jb);
        a[0] = make_uint4(va[0], va[1], va[2], va[3]);
        a[1] = make_uint4(va[4], va[5], va[6], va[7]);
        b[0] = make_uint4(vb[0], vb[1], vb[2], vb[3]);
        b[1] = make_uint4(vb[4], vb[5], vb[6], vb[7]);
        wd_row[2 * ja] = raw.d * (float)raw.scales[0];
        wd_row[2 * ja + 1] = raw.d * (float)raw.scales[1];
        wd_row[2 * jb] = raw.d * (float)raw.scales[2];
        wd_row[2 * jb + 1] = raw.d * (float)raw.scales[3];
    }
    EMBER_DEVICE float act_term(float xd, float sum) { return sum; }
    // A group's two halves, each with its own scale.
    EMBER_DEVICE float add_term2(float acc, float wd_lo, float wd_hi, float xd, float c_lo, float c_hi) {
        return fmaf(wd_hi * xd, c_hi, fmaf(wd_lo * xd, c_lo, acc));
    }
};

// ---- The int8 tensor-core products (NVIDIA sm_80+). Fragments, with g = lane / 4 and
// t = lane % 4: A (16 x 32, row-major) a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..],
// a3 = A[g+8][16+4t..]; B (32 x 8, column-major) b0 = B[4t..4t+3][g], b1 = B[16+4t..][g];
// C (16 x 8) c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]. The m16n8k16
// form takes A = {a0, a1} and B = {b0} over the first 16 values of K. ----

// The sums come back as f32 without an integer-to-float conversion (a quarter-rate instruction
// that bounds the 64-token tiles otherwise): the accumulator starts at the bit pattern of
// 1.5 * 2^23, so each result's bits, read as an f32, are exactly 1.5 * 2^23 + sum for
// |sum| < 2^22 (a group's sum is at most 32 * 128 * 128 = 2^19 in magnitude), and one f32
// subtraction recovers the sum exactly.
#define EMBER_MMQ_FLOAT_BIAS 0x4B400000
#define EMBER_MMQ_FLOAT_BIAS_VALUE 12582912.0f

EMBER_DEVICE void ember_mmq_mma_k32(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    int d[4];
#if EMBER_MMQ_HAS_MMA
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(EMBER_MMQ_FLOAT_BIAS));
#else
    // Never launched: kernels take the tensor-core path only where EMBER_MMQ_HAS_MMA holds.
    d[0] = d[1] = d[2] = d[3] = EMBER_MMQ_FLOAT_BIAS;
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = __int_as_float(d[i]) - EMBER_MMQ_FLOAT_BIAS_VALUE;
}

EMBER_DEVICE void ember_mmq_mma_k16(float* c, uint32_t a0, uint32_t a1, uint32_t b0) {
    int d[4];
#if EMBER_MMQ_HAS_MMA
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(EMBER_MMQ_FLOAT_BIAS));
#else
    d[0] = d[1] = d[2] = d[3] = EMBER_MMQ_FLOAT_BIAS;
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = __int_as_float(d[i]) - EMBER_MMQ_FLOAT_BIAS_VALUE;
}

// One step's products on the tensor cores: warp w owns rows 16 w..16 w + 15 of the tile and all
// NT tokens (NT / 8 fragments of 8 tokens); acc[n][i] is C element i of token fragment n.
template <typename F, int NT>
EMBER_DEVICE void ember_mmq_step_mma(const EmberMmqTile<NT>& tile, float (&acc)[NT / 8][4]) {
    const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
    const int g = lane / 4, t = lane % 4;
    const int row_a = 16 * warp + g, row_b = row_a + 8;
    const int8_t* wq = (const int8_t*)tile.wq;
    const int8_t* xq = (const int8_t*)tile.xq;
    const int8_t* wa = wq + row_a * EMBER_MMQ_STRIDE + 4 * t;
    const int8_t* wb = wq + row_b * EMBER_MMQ_STRIDE + 4 * t;
#pragma unroll
    for (int j = 0; j < EMBER_MMQ_GROUPS; ++j) {
        const uint32_t a0 = *(const uint32_t*)(wa + 32 * j), a1 = *(const uint32_t*)(wb + 32 * j);
        const uint32_t a2 = *(const uint32_t*)(wa + 32 * j + 16), a3 = *(const uint32_t*)(wb + 32 * j + 16);
        // The scales of this lane's two rows: per half group for q6_K, else per group.
        const int s = F::HALVES ? 2 * j : j;
        const float wd_a0 = tile.wd[row_a * EMBER_MMQ_WD_STRIDE + s], wd_b0 = tile.wd[row_b * EMBER_MMQ_WD_STRIDE + s];
        const float wd_a1 = F::HALVES ? tile.wd[row_a * EMBER_MMQ_WD_STRIDE + s + 1] : 0.0f;
        const float wd_b1 = F::HALVES ? tile.wd[row_b * EMBER_MMQ_WD_STRIDE + s + 1] : 0.0f;
        const float wm_a = F::HALVES ? 0.0f : tile.wm[row_a * EMBER_MMQ_WM_STRIDE + j];
        const float wm_b = F::HALVES ? 0.0f : tile.wm[row_b * EMBER_MMQ_WM_STRIDE + j];
#pragma unroll
        for (int n = 0; n < NT / 8; ++n) {
            const int8_t* xb = xq + (8 * n + g) * EMBER_MMQ_STRIDE + 32 * j + 4 * t;
            const uint32_t b0 = *(const uint32_t*)xb, b1 = *(const uint32_t*)(xb + 16);
            // The two tokens of this lane's C elements.
            const int token_a = 8 * n + 2 * t, token_b = token_a + 1;
            const float2 x_a = tile.xds[token_a * EMBER_MMQ_XS_STRIDE + j], x_b = tile.xds[token_b * EMBER_MMQ_XS_STRIDE + j];
            const float xd_a = x_a.x, xd_b = x_b.x;
            if constexpr (F::HALVES) {
                float lo[4], hi[4];
                ember_mmq_mma_k16(lo, a0, a1, b0);
                ember_mmq_mma_k16(hi, a2, a3, b1);
                acc[n][0] = F::add_term2(acc[n][0], wd_a0, wd_a1, xd_a, lo[0], hi[0]);
                acc[n][1] = F::add_term2(acc[n][1], wd_a0, wd_a1, xd_b, lo[1], hi[1]);
                acc[n][2] = F::add_term2(acc[n][2], wd_b0, wd_b1, xd_a, lo[2], hi[2]);
                acc[n][3] = F::add_term2(acc[n][3], wd_b0, wd_b1, xd_b, lo[3], hi[3]);
            } else {
                float c[4];
                ember_mmq_mma_k32(c, a0, a1, a2, a3, b0, b1);
                const float xs_a = x_a.y, xs_b = x_b.y;
                acc[n][0] = F::add_term(acc[n][0], wd_a0, wm_a, xd_a, xs_a, c[0]);
                acc[n][1] = F::add_term(acc[n][1], wd_a0, wm_a, xd_b, xs_b, c[1]);
                acc[n][2] = F::add_term(acc[n][2], wd_b0, wm_b, xd_a, xs_a, c[2]);
                acc[n][3] = F::add_term(acc[n][3], wd_b0, wm_b, xd_b, xs_b, c[3]);
            }
        }
    }
}

// One step's products with 4-byte integer dot products: thread i owns row i % 64 of the tile and
// tokens i / 64, i / 64 + 2, ... (NT / 2 of them); every lane of a wave reads the same token's
// activations (a broadcast) and its own row (16-byte loads 272 bytes apart: no bank conflicts).
// Tokens go in batches of 4 per pass over the groups, which bounds the activation registers in
// flight (more tokens at once spill on AMD targets).
template <typename F, int NT>
EMBER_DEVICE void ember_mmq_step_dp4a(const EmberMmqTile<NT>& tile, float (&acc)[NT / 2]) {
    constexpr int BATCH = 4;
    const int row = (int)(threadIdx.x % EMBER_MMQ_ROWS), parity = (int)(threadIdx.x / EMBER_MMQ_ROWS);
    const int8_t* wrow = (const int8_t*)tile.wq + row * EMBER_MMQ_STRIDE;
    const int8_t* xq = (const int8_t*)tile.xq;
    const float* wd = tile.wd + row * EMBER_MMQ_WD_STRIDE;
    const float* wm = tile.wm + row * EMBER_MMQ_WM_STRIDE;
#pragma unroll
    for (int batch = 0; batch < NT / 2; batch += BATCH) {
#pragma unroll 1
        for (int j = 0; j < EMBER_MMQ_GROUPS; ++j) {
            const int4 w0 = *(const int4*)(wrow + 32 * j), w1 = *(const int4*)(wrow + 32 * j + 16);
#pragma unroll
            for (int k = batch; k < batch + BATCH; ++k) {
                const int token = 2 * k + parity;
                const int8_t* xrow = xq + token * EMBER_MMQ_STRIDE + 32 * j;
                const int4 x0 = *(const int4*)xrow, x1 = *(const int4*)(xrow + 16);
                int lo = ember_dp4a(w0.x, x0.x, 0);
                lo = ember_dp4a(w0.y, x0.y, lo);
                lo = ember_dp4a(w0.z, x0.z, lo);
                lo = ember_dp4a(w0.w, x0.w, lo);
                int hi = ember_dp4a(w1.x, x1.x, 0);
                hi = ember_dp4a(w1.y, x1.y, hi);
                hi = ember_dp4a(w1.z, x1.z, hi);
                hi = ember_dp4a(w1.w, x1.w, hi);
                const float2 xds = tile.xds[token * EMBER_MMQ_XS_STRIDE + j];
                const float xd = xds.x;
                if constexpr (F::HALVES) {
                    acc[k] = F::add_term2(acc[k], wd[2 * j], wd[2 * j + 1], xd, (float)lo, (float)hi);
                } else {
                    acc[k] = F::add_term(acc[k], wd[j], wm[j], xd, xds.y, (float)(lo + hi));
                }
            }
        }
    }
}

// The registers one thread fetches for a step: its weight units and activation chunks.
template <typename F, int NT>
struct EmberMmqFetch {
    static constexpr int UNITS = EMBER_MMQ_ROWS * F::UNITS / EMBER_MMQ_THREADS;
    static constexpr int CHUNKS = NT * 2 * EMBER_MMQ_GROUPS / EMBER_MMQ_THREADS;
    static constexpr int SCALES = NT * EMBER_MMQ_GROUPS / EMBER_MMQ_THREADS;
    typename F::Raw w[UNITS];
    int4 x[CHUNKS];
    float2 xds[SCALES];
};

// What the block multiplies: W's rows from row0 (clamped to the last row: rows past the end are
// computed and never stored), tokens from token0 (past the end: zero activations). A grouped
// product (GATHER, the mixture-of-experts tiles) has token0 0, n_tokens the tile's pair count,
// and per token of the tile the row of xq it reads (x_rows) and the row of y it writes (y_rows),
// both in shared memory.
struct EmberMmqArgs {
    const uint8_t* w;
    const int8_t* xq;
    const float2* xds;
    uint32_t n_rows, n_cols, n_tokens, row0, token0;
    size_t row_bytes;
    const int32_t* x_rows;
    const int32_t* y_rows;
};

// The row of xq that token `local` of the block's tile reads.
template <bool GATHER>
EMBER_DEVICE size_t ember_mmq_x_row(const EmberMmqArgs& a, uint32_t local) {
    if constexpr (GATHER) return (size_t)a.x_rows[local];
    else return (size_t)(a.token0 + local);
}

// The row of y that token `local` of the block's tile writes.
template <bool GATHER>
EMBER_DEVICE size_t ember_mmq_y_row(const EmberMmqArgs& a, uint32_t local) {
    if constexpr (GATHER) return (size_t)a.y_rows[local];
    else return (size_t)(a.token0 + local);
}

template <typename F, int NT, bool GATHER>
EMBER_DEVICE void ember_mmq_fetch(const EmberMmqArgs& a, uint32_t step, EmberMmqFetch<F, NT>& f) {
    const uint32_t n_blocks = a.n_cols / F::BLOCK_VALUES, n_groups = a.n_cols / 32;
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::UNITS; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        const uint32_t row = min(a.row0 + (uint32_t)(i / F::UNITS), a.n_rows - 1);
        F::fetch(a.w + (size_t)row * a.row_bytes, step, i % F::UNITS, n_blocks, f.w[k]);
    }
    // Chunk i: token i / 16, group (i % 16) / 2, half i % 2 (16 bytes each).
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::CHUNKS; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        const uint32_t local = (uint32_t)(i / 16), group = step * EMBER_MMQ_GROUPS + (uint32_t)((i % 16) / 2);
        const uint32_t half = (uint32_t)(i % 2);
        if (a.token0 + local < a.n_tokens && group < n_groups)
            f.x[k] = *(const int4*)(a.xq + ember_mmq_x_row<GATHER>(a, local) * a.n_cols + ((size_t)half * n_groups + group) * 16);
        else
            f.x[k] = make_int4(0, 0, 0, 0);
    }
    // Scale i: token i / 8, group i % 8.
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::SCALES; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        const uint32_t local = (uint32_t)(i / EMBER_MMQ_GROUPS), group = step * EMBER_MMQ_GROUPS + (uint32_t)(i % EMBER_MMQ_GROUPS);
        f.xds[k] = a.token0 + local < a.n_tokens && group < n_groups ? a.xds[ember_mmq_x_row<GATHER>(a, local) * n_groups + group]
                                                                     : make_float2(0.0f, 0.0f);
    }
}

template <typename F, int NT>
EMBER_DEVICE void ember_mmq_commit(const EmberMmqFetch<F, NT>& f, EmberMmqTile<NT>& tile) {
    int8_t* wq = (int8_t*)tile.wq;
    int8_t* xq = (int8_t*)tile.xq;
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::UNITS; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        const int row = i / F::UNITS;
        F::commit(f.w[k], i % F::UNITS, wq + row * EMBER_MMQ_STRIDE, tile.wd + row * EMBER_MMQ_WD_STRIDE, tile.wm + row * EMBER_MMQ_WM_STRIDE);
    }
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::CHUNKS; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        *(int4*)(xq + (i / 16) * EMBER_MMQ_STRIDE + 32 * ((i % 16) / 2) + 16 * (i % 2)) = f.x[k];
    }
#pragma unroll
    for (int k = 0; k < EmberMmqFetch<F, NT>::SCALES; ++k) {
        const int i = (int)threadIdx.x + k * EMBER_MMQ_THREADS;
        const int at = (i / EMBER_MMQ_GROUPS) * EMBER_MMQ_XS_STRIDE + i % EMBER_MMQ_GROUPS;
        tile.xds[at] = make_float2(f.xds[k].x, F::act_term(f.xds[k].x, f.xds[k].y));
    }
}

// One block's tile: rows args.row0.. by the tile's tokens over steps [first, end), stored into
// out (row y_row(token) of n_rows floats).
template <typename F, int NT, bool MMA, bool GATHER>
EMBER_DEVICE void ember_mmq_tile(float* out, const EmberMmqArgs& args, uint32_t first, uint32_t end) {
    static_assert(NT % 16 == 0 && NT <= 64, "token tiles of 16, 32 or 64");
    static_assert(EMBER_MMQ_THREADS == 2 * EMBER_MMQ_ROWS && EMBER_MMQ_ROWS == 16 * (EMBER_MMQ_THREADS / 32), "tile shape");
    __shared__ EmberMmqTile<NT> tile;
    const uint32_t n_rows = args.n_rows, n_tokens = args.n_tokens;

    // The tensor-core path's C fragments, or the dp4a path's outputs.
    float acc_mma[MMA ? NT / 8 : 1][4] = {};
    float acc_dp4a[MMA ? 1 : NT / 2] = {};

    // Loads run ahead of the products by one step, or by two for token tiles of 16 and 32, whose
    // products are too short to cover a load's latency; the second set of registers would spill
    // at 64 tokens. Each set is indexed by a constant (the loop below is unrolled by hand).
    constexpr int AHEAD = NT <= 32 ? 2 : 1;
    EmberMmqFetch<F, NT> fetched[AHEAD];
#pragma unroll
    for (int k = 0; k < AHEAD; ++k)
        if (first + k < end) ember_mmq_fetch<F, NT, GATHER>(args, first + k, fetched[k]);
    for (uint32_t step = first; step < end; step += AHEAD) {
#pragma unroll
        for (int k = 0; k < AHEAD; ++k) {
            if (step + k < end) {
                ember_mmq_commit<F, NT>(fetched[k], tile);
                __syncthreads();
                // The loads of step + k + AHEAD are issued now and land while the products run.
                if (step + k + AHEAD < end) ember_mmq_fetch<F, NT, GATHER>(args, step + k + AHEAD, fetched[k]);
                if constexpr (MMA) ember_mmq_step_mma<F, NT>(tile, acc_mma);
                else ember_mmq_step_dp4a<F, NT>(tile, acc_dp4a);
                __syncthreads();
            }
        }
    }

    if constexpr (MMA) {
        const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
        const uint32_t row_a = args.row0 + 16 * warp + lane / 4, row_b = row_a + 8;
#pragma unroll
        for (int n = 0; n < NT / 8; ++n) {
            const uint32_t local_a = 8 * n + 2 * (lane % 4), local_b = local_a + 1;
            const bool in_a = args.token0 + local_a < n_tokens, in_b = args.token0 + local_b < n_tokens;
            const size_t y_a = in_a ? ember_mmq_y_row<GATHER>(args, local_a) * n_rows : 0;
            const size_t y_b = in_b ? ember_mmq_y_row<GATHER>(args, local_b) * n_rows : 0;
            if (row_a < n_rows && in_a) out[y_a + row_a] = acc_mma[n][0];
            if (row_a < n_rows && in_b) out[y_b + row_a] = acc_mma[n][1];
            if (row_b < n_rows && in_a) out[y_a + row_b] = acc_mma[n][2];
            if (row_b < n_rows && in_b) out[y_b + row_b] = acc_mma[n][3];
        }
    } else {
        const uint32_t row = args.row0 + threadIdx.x % EMBER_MMQ_ROWS;
#pragma unroll
        for (int k = 0; k < NT / 2; ++k) {
            const uint32_t local = 2 * k + threadIdx.x / EMBER_MMQ_ROWS;
            if (row < n_rows && args.token0 + local < n_tokens) out[ember_mmq_y_row<GATHER>(args, local) * n_rows + row] = acc_dp4a[k];
        }
    }
}

template <typename F, int NT, bool MMA>
EMBER_DEVICE void ember_mmq(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, uint32_t n_rows, uint32_t n_cols,
                            uint32_t n_tokens, uint32_t steps_per_split) {
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const EmberMmqArgs args = {w, xq, xds, n_rows, n_cols, n_tokens, blockIdx.x * EMBER_MMQ_ROWS, blockIdx.y * NT, row_bytes, nullptr, nullptr};
    const uint32_t n_steps = (n_cols + EMBER_MMQ_STEP - 1) / EMBER_MMQ_STEP;
    const uint32_t first = blockIdx.z * steps_per_split, end = min(first + steps_per_split, n_steps);
    ember_mmq_tile<F, NT, MMA, false>(y + (size_t)blockIdx.z * n_tokens * n_rows, args, first, end);
}

// The grouped product of the mixture-of-experts layers: block (bx, slot) multiplies rows 64 bx..
// of expert tiles[slot].expert (a stack of experts, expert_bytes apart) by the tile's pairs
// (tiles[slot] = (expert, first, count, 0) over `pairs`, count at most NT, as ember_moe_tiles of
// moe.hip cuts them): pair p reads row p / x_div of the rounded activations and writes row p of
// y ([n_pairs, n_rows]). No K split: a prompt's tiles give enough blocks. Unused slots (count 0)
// return at once.
template <typename F, int NT, bool MMA>
EMBER_DEVICE void ember_mmq_moe(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, const int32_t* pairs,
                                const int32_t* tiles, uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div) {
    __shared__ int32_t x_rows[NT], y_rows[NT];
    const int32_t* slot = tiles + 4 * (size_t)blockIdx.y;
    const int32_t expert = slot[0], first = slot[1], count = slot[2];
    if (count <= 0) return;  // the whole block leaves together
    for (int i = (int)threadIdx.x; i < count && i < NT; i += EMBER_MMQ_THREADS) {
        const int32_t pair = pairs[first + i];
        y_rows[i] = pair;
        x_rows[i] = pair / (int32_t)x_div;
    }
    __syncthreads();
    const size_t row_bytes = (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
    const EmberMmqArgs args = {w + (size_t)expert * expert_bytes, xq, xds, n_rows, n_cols, (uint32_t)min(count, NT), blockIdx.x * EMBER_MMQ_ROWS, 0u,
                               row_bytes, x_rows, y_rows};
    const uint32_t n_steps = (n_cols + EMBER_MMQ_STEP - 1) / EMBER_MMQ_STEP;
    ember_mmq_tile<F, NT, MMA, true>(y, args, 0, n_steps);
}

// ember_mmq_<format>_n<NT>(float* y, const uint8_t* w, const int8_t* xq, const float2* xds,
// uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens, uint32_t steps_per_split): grid
// (ceil(n_rows / 64), ceil(n_tokens / NT), ceil(n_steps / steps_per_split)) with n_steps =
// ceil(n_cols / 256); split z writes y + z n_tokens n_rows.
#define EMBER_MMQ(name, format, nt)                                                                                            \
    EMBER_KERNEL void __launch_bounds__(EMBER_MMQ_THREADS)                                                                     \
        name(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens, \
             uint32_t steps_per_split) {                                                                                       \
        ember_mmq<format, nt, EMBER_MMQ_HAS_MMA != 0>(y, w, xq, xds, n_rows, n_cols, n_tokens, steps_per_split);              \
    }

// ember_mmq_moe_<format>_n<NT>(float* y, const uint8_t* w, const int8_t* xq, const float2* xds,
// const int32_t* pairs, const int32_t* tiles, uint32_t n_rows, uint32_t n_cols, uint64_t
// expert_bytes, uint32_t x_div): grid (ceil(n_rows / 64), tile slots); n_rows are one expert's.
#define EMBER_MMQ_MOE(name, format, nt)                                                                                          \
    EMBER_KERNEL void __launch_bounds__(EMBER_MMQ_THREADS)                                                                       \
        name(float* y, const uint8_t* w, const int8_t* xq, const float2* xds, const int32_t* pairs, const int32_t* tiles,         \
             uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes, uint32_t x_div) {                                           \
        ember_mmq_moe<format, nt, EMBER_MMQ_HAS_MMA != 0>(y, w, xq, xds, pairs, tiles, n_rows, n_cols, expert_bytes, x_div);     \
    }

// ember_mmq_quantize_<act>(int8_t* xq, float2* xds, const float* x, uint32_t n_cols): grid =
// n_tokens, block 256 (any multiple of 32).
#define EMBER_MMQ_QUANTIZE(name, act)                                                                       \
    EMBER_KERNEL void name(int8_t* xq, float2* xds, const float* x, uint32_t n_cols) {                      \
        const size_t t = blockIdx.x;                                                                        \
        ember_mv_quantize<act>(xq + t * n_cols, xds + t * (n_cols / 32), x + t * n_cols, n_cols, n_cols); \
    }

EMBER_MMQ_QUANTIZE(ember_mmq_quantize_q8_0, EMBER_ACT_Q8_0)
EMBER_MMQ_QUANTIZE(ember_mmq_quantize_q8_1, EMBER_ACT_Q8_1)
EMBER_MMQ_QUANTIZE(ember_mmq_quantize_q8_k, EMBER_ACT_Q8_K)

EMBER_MMQ(ember_mmq_q4_0_n16, EmberMmqQ4_0, 16)
EMBER_MMQ(ember_mmq_q4_0_n32, EmberMmqQ4_0, 32)
EMBER_MMQ(ember_mmq_q4_0_n64, EmberMmqQ4_0, 64)
EMBER_MMQ(ember_mmq_q4_1_n16, EmberMmqQ4_1, 16)
EMBER_MMQ(ember_mmq_q4_1_n32, EmberMmqQ4_1, 32)
EMBER_MMQ(ember_mmq_q4_1_n64, EmberMmqQ4_1, 64)
EMBER_MMQ(ember_mmq_q5_0_n16, EmberMmqQ5_0, 16)
EMBER_MMQ(ember_mmq_q5_0_n32, EmberMmqQ5_0, 32)
EMBER_MMQ(ember_mmq_q5_0_n64, EmberMmqQ5_0, 64)
EMBER_MMQ(ember_mmq_q5_1_n16, EmberMmqQ5_1, 16)
EMBER_MMQ(ember_mmq_q5_1_n32, EmberMmqQ5_1, 32)
EMBER_MMQ(ember_mmq_q5_1_n64, EmberMmqQ5_1, 64)
EMBER_MMQ(ember_mmq_q8_0_n16, EmberMmqQ8_0, 16)
EMBER_MMQ(ember_mmq_q8_0_n32, EmberMmqQ8_0, 32)
EMBER_MMQ(ember_mmq_q8_0_n64, EmberMmqQ8_0, 64)
EMBER_MMQ(ember_mmq_q4_k_n16, EmberMmqQ4_K, 16)
EMBER_MMQ(ember_mmq_q4_k_n32, EmberMmqQ4_K, 32)
EMBER_MMQ(ember_mmq_q4_k_n64, EmberMmqQ4_K, 64)
EMBER_MMQ(ember_mmq_q5_k_n16, EmberMmqQ5_K, 16)
EMBER_MMQ(ember_mmq_q5_k_n32, EmberMmqQ5_K, 32)
EMBER_MMQ(ember_mmq_q5_k_n64, EmberMmqQ5_K, 64)
EMBER_MMQ(ember_mmq_q6_k_n16, EmberMmqQ6_K, 16)
EMBER_MMQ(ember_mmq_q6_k_n32, EmberMmqQ6_K, 32)
EMBER_MMQ(ember_mmq_q6_k_n64, EmberMmqQ6_K, 64)

EMBER_MMQ_MOE(ember_mmq_moe_q4_0_n16, EmberMmqQ4_0, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q4_0_n32, EmberMmqQ4_0, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q4_0_n64, EmberMmqQ4_0, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q4_1_n16, EmberMmqQ4_1, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q4_1_n32, EmberMmqQ4_1, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q4_1_n64, EmberMmqQ4_1, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q5_0_n16, EmberMmqQ5_0, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q5_0_n32, EmberMmqQ5_0, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q5_0_n64, EmberMmqQ5_0, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q5_1_n16, EmberMmqQ5_1, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q5_1_n32, EmberMmqQ5_1, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q5_1_n64, EmberMmqQ5_1, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q8_0_n16, EmberMmqQ8_0, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q8_0_n32, EmberMmqQ8_0, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q8_0_n64, EmberMmqQ8_0, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q4_k_n16, EmberMmqQ4_K, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q4_k_n32, EmberMmqQ4_K, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q4_k_n64, EmberMmqQ4_K, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q5_k_n16, EmberMmqQ5_K, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q5_k_n32, EmberMmqQ5_K, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q5_k_n64, EmberMmqQ5_K, 64)
EMBER_MMQ_MOE(ember_mmq_moe_q6_k_n16, EmberMmqQ6_K, 16)
EMBER_MMQ_MOE(ember_mmq_moe_q6_k_n32, EmberMmqQ6_K, 32)
EMBER_MMQ_MOE(ember_mmq_moe_q6_k_n64, EmberMmqQ6_K, 64)

// ember_mmq_reduce(float* y, const float* partial, uint32_t n, uint32_t n_splits): y[i] = the
// sum over z < n_splits of partial[z n + i], added in order z = 0, 1, ... Any grid.
EMBER_KERNEL void ember_mmq_reduce(float* y, const float* partial, uint32_t n, uint32_t n_splits) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sum = partial[i];
        for (uint32_t z = 1; z < n_splits; ++z) sum += partial[(size_t)z * n + i];
        y[i] = sum;
    }
}
