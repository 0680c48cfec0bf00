// Bit-exact twin of the CPU backend's attention (engine/src/backend/cpu/attention.rs), for the GPU
// backend's reference numerics mode: every output float equals the CPU's for the same queries,
// the same f16 K/V cache contents and the same batch.
//
// The spec is the Rust code of the CPU backend, which reproduces llama.cpp's CPU flash attention
// path for path (engine/src/backend/cpu/attention.rs, helpers in engine/src/backend/cpu/vec.rs).
// The result of one (token, query head) depends only on its query, the keys and values it sees
// and which of three paths the CPU takes for the batch, never on how the CPU groups tokens into
// tiles or threads, so one thread block per (token, query head) recomputes it:
//   * path A (`attend`, batches of fewer than 64 tokens, or head sizes not a multiple of 16): the
//     query rounded to f16; each score is GGML's AVX-512 f16 dot (`dot_f16_ggml`: four 16-lane
//     FMA accumulators over runs of 64, summed (a0 + a2) + (a1 + a3), then halved 8, 4, 2, 1
//     apart; a tail under 64 added in f64) times the scale; an online softmax key by key in
//     position order with libm's expf; the value accumulator rounded to f16 after every key, not
//     rescaled when the rescale factor is exactly 1 and zeroed when it is exactly 0; at the end
//     multiplied by 1 / sum (by 0 when the sum is 0);
//   * path C (`attend_split`, a batch of one token whose cache view of (position + 1) cells
//     rounded up to 256 has 512 cells or more): the view cut into `n_chunks` (the CPU's thread
//     count) equal runs of cells, each attended like path A except that the accumulator is always
//     rescaled (GGML's `one_chunk`), the partial results merged in chunk order with two expf and
//     FMAs, and the total divided at the end unless its sum is 0;
//   * path B (`attend_f32`, batches of 64 tokens or more with a head size multiple of 16): keys
//     in tiles of 64 positions aligned to position 0; per tile, f32 scores by one FMA chain per
//     key (the query in f32), the tile's maximum, one libm expf rescale of the f32 accumulator
//     and sum when the maximum grows, probabilities from GGML's AVX-512 expf polynomial summed
//     per 16 in f32 (halving) and per tile in f64, values accumulated by one FMA per key.
// The sequential parts (the running maximum and sum) are done by one thread in key order; the
// exponentials, dot products and per-dimension accumulations run in parallel, each with the
// CPU's own sequence of roundings.
//
// Exponentials: the CPU's `f32::exp` is glibc's expf (x86-64, FMA build): a double-precision
// algorithm with a 32-entry table of 2^(i/32) (glibc sysdeps/ieee754/flt-32/e_expf.c, from Arm's
// optimized-routines), ported below with the fused multiply-adds that glibc's FMA variant
// (selected on every CPU with FMA) compiles to; crates/gpu/src/ops/exact_attention.rs keeps a Rust
// twin that its tests hold to `f32::exp`. GGML's vectorised expf is vec.rs `expf_ggml`, ported
// operation for operation.
//
// Exactly rounded arithmetic: every float operation goes through the xa_* helpers, never a bare
// operator, so the compiler can neither contract a multiply and an add into an FMA (nvcc does by
// default, clang for HIP too) nor reassociate; an FMA is written only where the Rust code calls
// mul_add. Denormals are kept (neither nvcc nor clang flush them by default for these targets),
// as on the CPU.
//
// KV layout (as kernels/attention.hip): slot s of physical block b keeps the token's
// n_kv_heads * head_dim f16 keys at ((ember_half*)k_blocks[b]) + s * row_values, values likewise
// in v_blocks; logical block i of table j is physical block block_tables[j * max_blocks + i].
//
// Launch (crates/gpu/src/ops/exact_attention.rs): grid = n_tokens * n_heads blocks (block
// t * n_heads + h computes token t, query head h), block = EXACT_ATTN_THREADS threads,
// head_dim <= EXACT_ATTN_MAX_HEAD_DIM.
#include "ember_exact.h"

#define EXACT_ATTN_THREADS 256
#define EXACT_ATTN_MAX_HEAD_DIM 256
// Keys scored per step of paths A and C (one per thread).
#define EXACT_ATTN_KEYS EXACT_ATTN_THREADS
// Keys per tile of path B (GGML_FA_TILE_KV, vec.rs KV_TILE).
#define EXACT_ATTN_KV_TILE 64
// GGML pads the cache view to this many cells (KV_VIEW_PAD) and splits a single query's keys
// from SPLIT_KV_MIN_CELLS cells on.
#define EXACT_ATTN_VIEW_PAD 256
#define EXACT_ATTN_SPLIT_MIN_CELLS 512

#if defined(EMBER_PLATFORM_HIP)
#pragma clang fp contract(off)
#endif

// ---- glibc's expf ----

// 2^(i/32) as double bits, minus i << 47 (glibc's __exp2f_data.tab), so that adding k << 47
// for k = 32 * e + i gives 2^(k/32).
__constant__ uint64_t xa_exp2f_table[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

// e^x as glibc's expf computes it on x86-64 with FMA: x * 32 / ln 2 = k + r (k rounded to
// nearest by adding 1.5 * 2^52), 2^(k/32) from the table, 2^(r/32) by a cubic, one product
// rounded to f32. The reduction and the cubic are fused multiply-adds (glibc's FMA build
// contracts them: `z = InvLn2N * x` feeds both `z + SHIFT` and `z - kd`).
EMBER_DEVICE float xa_expf_libm(float x) {
    const uint32_t bits = __float_as_uint(x);
    const uint32_t abstop = (bits >> 20) & 0x7ffu;
    if (abstop >= 0x42bu) {  // |x| >= 88 (top 12 bits of 88.0f), or x is inf or NaN
        if (bits == 0xff800000u) return 0.0f;           // -inf
        if (abstop >= 0x7f8u) return ex_add(x, x);      // +inf or NaN
        if (x > __uint_as_float(0x42b17217u)) return __uint_as_float(0x7f800000u);  // overflow
        if (x < __uint_as_float(0xc2cff1b4u)) return 0.0f;                          // underflow
    }
    const double inv_ln2_n = __longlong_as_double(0x40471547652b82fell);  // 32 / ln 2
    const double shift = __longlong_as_double(0x4338000000000000ll);      // 1.5 * 2^52
    const double c0 = __longlong_as_double(0x3ebc6af84b912394ll);         // cubic of 2^(r/32) - 1
    const double c1 = __longlong_as_double(0x3f2ebfce50fac4f3ll);
    const double c2 = __longlong_as_double(0x3f962e42ff0c52d6ll);
    const double xd = ex_f2d(x);
    double kd = ex_dfma(inv_ln2_n, xd, shift);
    const uint64_t ki = (uint64_t)__double_as_longlong(kd);
    kd = ex_dsub(kd, shift);
    const double r = ex_dfma(inv_ln2_n, xd, -kd);
    const uint64_t t = xa_exp2f_table[ki % 32] + (ki << 47);
    const double s = __longlong_as_double((long long)t);
    const double z = ex_dfma(c0, r, c1);
    const double r2 = ex_dmul(r, r);
    double y = ex_dfma(c2, r, 1.0);
    y = ex_dfma(z, r2, y);
    y = ex_dmul(y, s);
    return ex_d2f(y);
}

// ---- cache access ----

EMBER_DEVICE const ember_half* xa_row(const uint64_t* blocks, const int32_t* table, uint32_t position, uint32_t block_size,
                                      uint32_t row_values, uint32_t head_offset) {
    const int32_t block = table[position / block_size];
    const ember_half* base = (const ember_half*)blocks[block];
    return base + (size_t)(position % block_size) * row_values + head_offset;
}

// Eight consecutive f16 values as floats, with one 16-byte load when `wide` (the row is
// 16-byte aligned and its length a multiple of 8).
EMBER_DEVICE void xa_load8(const ember_half* p, bool wide, float* out) {
    if (wide) {
        const uint4 bits = *(const uint4*)p;
        const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __half2float(__ushort_as_half((unsigned short)(words[i] & 0xffffu)));
            out[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(words[i] >> 16)));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __half2float(p[i]);
    }
}

EMBER_DEVICE bool xa_wide(const ember_half* row, uint32_t head_dim) {
    return head_dim % 8 == 0 && ((uintptr_t)row & 15u) == 0;
}

// ---- scores ----

// vec.rs dot_f16_ggml(q, k): q holds f16 values as floats (shared memory), k is a cache row.
EMBER_DEVICE float xa_dot_f16_ggml(const float* q, const ember_half* k, uint32_t n) {
    const bool wide = xa_wide(k, n);
    const uint32_t np = n / 64 * 64;
    float acc[4][16];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[j][i] = 0.0f;
    for (uint32_t base = 0; base < np; base += 64) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float kv[16];
            xa_load8(k + base + 16 * j, wide, kv);
            xa_load8(k + base + 16 * j + 8, wide, kv + 8);
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[j][i] = ex_fma(q[base + 16 * j + i], kv[i], acc[j][i]);
        }
    }
    float lanes[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) lanes[i] = ex_add(ex_add(acc[0][i], acc[2][i]), ex_add(acc[1][i], acc[3][i]));
    // _mm512_reduce_add_ps: halves added lane-wise until one value is left.
    float t8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) t8[i] = ex_add(lanes[i], lanes[i + 8]);
    float u4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) u4[i] = ex_add(t8[i], t8[i + 4]);
    double sum = ex_f2d(ex_add(ex_add(u4[0], u4[2]), ex_add(u4[1], u4[3])));
    for (uint32_t i = np; i < n; ++i) sum = ex_dadd(sum, ex_f2d(ex_mul(q[i], __half2float(k[i]))));
    return ex_d2f(sum);
}

// vec.rs kq_tile for one key: sum over d of q[d] * k[d] by one FMA chain from 0 (q in f32).
EMBER_DEVICE float xa_dot_chain(const float* q, const ember_half* k, uint32_t n) {
    const bool wide = xa_wide(k, n);
    float acc = 0.0f;
    uint32_t d = 0;
    for (; d + 8 <= n; d += 8) {
        float kv[8];
        xa_load8(k + d, wide, kv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = ex_fma(kv[i], q[d + i], acc);
    }
    for (; d < n; ++d) acc = ex_fma(__half2float(k[d]), q[d], acc);
    return acc;
}

// ---- paths A and C: the f16 online softmax ----

struct XaShared {
    float q[EXACT_ATTN_MAX_HEAD_DIM];
    float score[EXACT_ATTN_KEYS];
    float max_before[EXACT_ATTN_KEYS];
    float weight[EXACT_ATTN_KEYS];
    float old_scale[EXACT_ATTN_KEYS];
    unsigned char raised[EXACT_ATTN_KEYS];
    const ember_half* v_row[EXACT_ATTN_KEYS];
    float max;
    float sum;
    float ms;
    int rescale;
};

// Which of the CPU's accumulator rescaling rules applies.
enum XaRescale {
    // `attend`: skip a factor of exactly 1, zero the accumulator for a factor of exactly 0.
    XA_RESCALE_ATTEND = 0,
    // `one_chunk`: always `f16(acc * factor)`.
    XA_RESCALE_ONE_CHUNK = 1,
};

// The online softmax of positions lo..hi (hi > lo) in order, as `attend` (one query) or
// `one_chunk` computes it. On return, `sh.max` and `sh.sum` hold the running maximum and sum
// (visible to every thread) and the return value is the unnormalised accumulator of dimension
// threadIdx.x (0 for threads past head_dim). The query, rounded to f16, is in sh.q.
EMBER_DEVICE float xa_softmax_f16(XaShared& sh, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* table,
                                  uint32_t lo, uint32_t hi, uint32_t head_dim, uint32_t block_size, uint32_t row_values,
                                  uint32_t head_offset, float scale, int rule) {
    const uint32_t tid = threadIdx.x;
    float acc = 0.0f;
    float run_max = -INFINITY, run_sum = 0.0f;  // thread 0's running state
    for (uint32_t start = lo; start < hi; start += EXACT_ATTN_KEYS) {
        const uint32_t n = min((uint32_t)EXACT_ATTN_KEYS, hi - start);
        __syncthreads();  // the previous step's readers are done with the shared arrays
        if (tid < n) {
            const uint32_t p = start + tid;
            const ember_half* k = xa_row(k_blocks, table, p, block_size, row_values, head_offset);
            sh.v_row[tid] = xa_row(v_blocks, table, p, block_size, row_values, head_offset);
            sh.score[tid] = ex_mul(xa_dot_f16_ggml(sh.q, k, head_dim), scale);
        }
        __syncthreads();
        // The running maximum before each key, and whether the key raises it (`score > max`).
        if (tid == 0) {
#pragma unroll 8
            for (uint32_t i = 0; i < n; ++i) {
                const float s = sh.score[i];
                sh.max_before[i] = run_max;
                const bool raised = s > run_max;
                sh.raised[i] = raised;
                if (raised) run_max = s;
            }
        }
        __syncthreads();
        if (tid < n) {
            const float s = sh.score[tid], m = sh.max_before[tid];
            if (sh.raised[tid]) {
                sh.old_scale[tid] = xa_expf_libm(ex_sub(m, s));
                sh.weight[tid] = 1.0f;
            } else {
                sh.old_scale[tid] = 1.0f;
                sh.weight[tid] = xa_expf_libm(ex_sub(s, m));
            }
        }
        __syncthreads();
        // `S = S*ms + vs`, contracted to one FMA.
        if (tid == 0) {
#pragma unroll 8
            for (uint32_t i = 0; i < n; ++i) run_sum = ex_fma(run_sum, sh.old_scale[i], sh.weight[i]);
        }
        if (tid < head_dim) {
#pragma unroll 4
            for (uint32_t i = 0; i < n; ++i) {
                if (sh.raised[i]) {
                    const float f = sh.old_scale[i];
                    if (rule == XA_RESCALE_ONE_CHUNK) {
                        acc = ex_round_f16(ex_mul(acc, f));
                    } else if (f != 1.0f && f != 0.0f) {
                        acc = ex_round_f16(ex_mul(acc, f));
                    } else if (f == 0.0f) {
                        acc = 0.0f;
                    }
                }
                // ggml_vec_mad_f16: f16(v * w + acc).
                acc = ex_round_f16(ex_fma(__half2float(sh.v_row[i][tid]), sh.weight[i], acc));
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        sh.max = run_max;
        sh.sum = run_sum;
    }
    __syncthreads();
    return acc;
}

// ---- path B: the tiled f32 softmax ----

// Positions first..=last (last >= first) as `attend_f32` computes them for one query in f32
// (sh.q); returns the normalised output of dimension threadIdx.x.
EMBER_DEVICE float xa_softmax_f32(XaShared& sh, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* table,
                                  uint32_t first, uint32_t last, uint32_t head_dim, uint32_t block_size, uint32_t row_values,
                                  uint32_t head_offset, float scale) {
    const uint32_t tid = threadIdx.x;
    float acc = 0.0f;
    float run_max = -INFINITY, run_sum = 0.0f;  // thread 0's running state
    for (uint32_t tile = first / EXACT_ATTN_KV_TILE; tile <= last / EXACT_ATTN_KV_TILE; ++tile) {
        const uint32_t tile_lo = tile * EXACT_ATTN_KV_TILE;
        const uint32_t visible_lo = max(first, tile_lo) - tile_lo;
        const uint32_t visible_hi = min(last + 1, tile_lo + EXACT_ATTN_KV_TILE) - tile_lo;
        __syncthreads();  // the previous tile's readers are done with the shared arrays
        if (tid < EXACT_ATTN_KV_TILE) {
            if (tid >= visible_lo && tid < visible_hi) {
                const uint32_t p = tile_lo + tid;
                const ember_half* k = xa_row(k_blocks, table, p, block_size, row_values, head_offset);
                sh.v_row[tid] = xa_row(v_blocks, table, p, block_size, row_values, head_offset);
                sh.score[tid] = ex_mul(xa_dot_chain(sh.q, k, head_dim), scale);
            } else {
                sh.score[tid] = -INFINITY;
            }
        }
        __syncthreads();
        if (tid == 0) {
            float tile_max = -INFINITY;
            for (uint32_t i = visible_lo; i < visible_hi; ++i) tile_max = ex_max(tile_max, sh.score[i]);
            const float new_max = ex_max(run_max, tile_max);
            const bool rescale = new_max > run_max;
            const float ms = rescale ? xa_expf_libm(ex_sub(run_max, new_max)) : 1.0f;
            if (rescale) run_sum = ex_mul(run_sum, ms);
            run_max = new_max;
            sh.max = new_max;
            sh.ms = ms;
            sh.rescale = rescale;
        }
        __syncthreads();
        // softmax_tile: p = expf_ggml(kq - max), 0 for masked keys.
        if (tid < EXACT_ATTN_KV_TILE) sh.weight[tid] = ex_expf_ggml(ex_sub(sh.score[tid], sh.max));
        __syncthreads();
        if (tid == 0) {
            double tile_sum = 0.0;
            for (int run = 0; run < EXACT_ATTN_KV_TILE / 16; ++run) {
                const float* v = sh.weight + 16 * run;
                float t8[8], u4[4];
                for (int i = 0; i < 8; ++i) t8[i] = ex_add(v[i], v[i + 8]);
                for (int i = 0; i < 4; ++i) u4[i] = ex_add(t8[i], t8[i + 4]);
                tile_sum = ex_dadd(tile_sum, ex_f2d(ex_add(ex_add(u4[0], u4[2]), ex_add(u4[1], u4[3]))));
            }
            run_sum = ex_d2f(ex_dadd(ex_f2d(run_sum), tile_sum));
        }
        if (tid < head_dim) {
            if (sh.rescale) acc = ex_mul(acc, sh.ms);
            // ggml_vec_mad_f32: acc = v * p + acc.
#pragma unroll 4
            for (uint32_t i = visible_lo; i < visible_hi; ++i)
                acc = ex_fma(__half2float(sh.v_row[i][tid]), sh.weight[i], acc);
        }
    }
    __syncthreads();
    if (tid == 0) sh.sum = run_sum;
    __syncthreads();
    const float total = sh.sum;
    const float inv = total == 0.0f ? 0.0f : ex_div(1.0f, total);
    return ex_mul(acc, inv);
}

// ---- the kernel ----

// Attention of token t = blockIdx.x / n_heads, query head h = blockIdx.x % n_heads, as the CPU
// backend computes it. f32_path: the batch takes the CPU's tiled f32 path (64 tokens or more,
// head size a multiple of 16). n_chunks: the CPU's thread count, which sets the split of the
// split-KV path (taken, as on the CPU, by a batch of one token whose padded view has 512 cells
// or more, the sequence stored from position 0).
EMBER_KERNEL void ember_exact_attention(float* out, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks,
                                        const int32_t* block_tables, const int32_t* table_of_token, const int32_t* positions,
                                        uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                        uint32_t block_size, uint32_t max_blocks_per_table, float scale, int32_t window,
                                        uint32_t f32_path, uint32_t n_chunks) {
    __shared__ XaShared sh;
    const uint32_t tid = threadIdx.x;
    const uint32_t t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    const uint32_t group = n_heads / n_kv_heads;
    const uint32_t row_values = n_kv_heads * head_dim;
    const uint32_t head_offset = (h / group) * head_dim;
    const uint32_t position = (uint32_t)positions[t];
    // Shape::first: (position + 1).saturating_sub(window).
    const uint32_t first = window > 0 && position + 1 > (uint32_t)window ? position + 1 - (uint32_t)window : 0;
    const int32_t* table = block_tables + (size_t)table_of_token[t] * max_blocks_per_table;
    const float* q_row = q + ((size_t)t * n_heads + h) * head_dim;
    float* out_row = out + ((size_t)t * n_heads + h) * head_dim;

    if (f32_path) {
        if (tid < head_dim) sh.q[tid] = q_row[tid];
        const float o = xa_softmax_f32(sh, k_blocks, v_blocks, table, first, position, head_dim, block_size, row_values,
                                       head_offset, scale);
        if (tid < head_dim) out_row[tid] = o;
        return;
    }

    // The query rounded to f16, as GGML converts it to the keys' type.
    if (tid < head_dim) sh.q[tid] = ex_round_f16(q_row[tid]);
    // split_kv_len: the view GGML attends, (position + 1) rounded up to 256 cells.
    const uint32_t n_kv = max((position + 1 + EXACT_ATTN_VIEW_PAD - 1) / EXACT_ATTN_VIEW_PAD, 1u) * EXACT_ATTN_VIEW_PAD;
    if (n_tokens == 1 && n_kv >= EXACT_ATTN_SPLIT_MIN_CELLS) {
        // attend_split: chunks of the view, merged in order.
        const uint32_t chunk = (n_kv + n_chunks - 1) / n_chunks;
        float fin = 0.0f, fin_max = -INFINITY, fin_sum = 0.0f;
        for (uint32_t c = 0; c < n_chunks; ++c) {
            const uint32_t lo = max(c * chunk, first);
            const uint32_t hi = min(min((c + 1) * chunk, n_kv), position + 1);
            if (lo >= hi) continue;
            const float part = xa_softmax_f16(sh, k_blocks, v_blocks, table, lo, hi, head_dim, block_size, row_values,
                                              head_offset, scale, XA_RESCALE_ONE_CHUNK);
            const float chunk_max = sh.max, chunk_sum = sh.sum;
            if (chunk_sum == 0.0f) continue;
            const float new_max = ex_max(fin_max, chunk_max);
            const float scale_old = xa_expf_libm(ex_sub(fin_max, new_max));
            const float scale_new = xa_expf_libm(ex_sub(chunk_max, new_max));
            // `a*b + c*d` with the left product fused.
            fin = ex_fma(fin, scale_old, ex_mul(part, scale_new));
            fin_sum = ex_fma(fin_sum, scale_old, ex_mul(chunk_sum, scale_new));
            fin_max = new_max;
        }
        if (fin_sum != 0.0f) fin = ex_mul(fin, ex_div(1.0f, fin_sum));
        if (tid < head_dim) out_row[tid] = fin;
        return;
    }

    // attend: one online softmax over first..=position.
    const float acc = xa_softmax_f16(sh, k_blocks, v_blocks, table, first, position + 1, head_dim, block_size, row_values,
                                     head_offset, scale, XA_RESCALE_ATTEND);
    const float total = sh.sum;
    const float inv = total == 0.0f ? 0.0f : ex_div(1.0f, total);
    if (tid < head_dim) out_row[tid] = ex_mul(acc, inv);
}

// out[i] = e^x[i] for i < n by the exponential the CPU's attention uses: libm's expf
// (flavor 0) or GGML's vectorised expf (flavor 1). For the checks that hold the device
// exponentials to the CPU's. Launch: any grid (grid-stride).
EMBER_KERNEL void ember_exact_expf(float* out, const float* x, uint32_t n, uint32_t flavor) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = flavor == 0 ? xa_expf_libm(x[i]) : ex_expf_ggml(x[i]);
}
