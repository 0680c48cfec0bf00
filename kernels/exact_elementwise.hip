// Bit-exact twins of the CPU backend's row-wise and element-wise ops, for the GPU backend's
// reference numerics mode: embedding lookup (get_rows), RMS normalisation (alone and fused with
// the residual add), SwiGLU, GeGLU and rotary embedding. (The element-wise add and scale,
// the f16 K/V store and the row gathers round once or not at all, so the fast kernels of
// elementwise.hip, attention.hip and embedding.hip are already exact and serve both modes.)
//
// The spec is the Rust code of the CPU backend, not GGML's C: engine/src/backend/cpu/mod.rs (the
// ops), engine/src/backend/cpu/ops.rs (rms_norm_row, gelu_ggml, rope_head), engine/src/backend/cpu/
// vec.rs (expf_ggml, silu_ggml, swiglu_ggml) and crates/quant/src/scalar/{float,legacy,kquants}.rs
// (dequantisation). Every output element sees the same f32/f64 operations in the same order with
// the same roundings as there, so results agree bit for bit:
//   * every floating-point operation goes through the ex_* helpers of ember_exact.h, never a bare operator,
//     so the compiler cannot contract a multiply and an add into an FMA (nvcc does by default,
//     clang for HIP too), reassociate, or use an approximate division or square root; an FMA is
//     written only where the Rust code calls mul_add;
//   * sums keep the Rust order: the f64 sum of squares of rms_norm_row is sequential (one thread
//     per row), as `Iterator::sum` is;
//   * transcendentals the CPU takes from libm are not evaluated here: the rotary cosines and sines
//     arrive as a table the host computed with the CPU's Rust code, and GELU as the CPU's f16
//     table (ops::gelu_table), uploaded once. The exponential of SwiGLU is GGML's vectorised
//     expf polynomial, which the CPU reproduces in Rust (vec.rs expf_ggml) and is ported here
//     operation for operation.
// Denormals are kept (neither nvcc nor clang flush f32 denormals by default for these targets),
// as on the CPU.
//
// Launches (crates/gpu/src/ops/exact_elementwise.rs): grid-stride kernels take any grid; the
// row kernels take one block per row (any block size).
#include "ember_exact.h"

#if defined(EMBER_PLATFORM_HIP)
#pragma clang fp contract(off)
#endif

// ---- dequantisation: value e of a row, as crates/quant/src/scalar computes it ----

// F32 / F16 / BF16 (float.rs dequantize_*): plain conversions.
EMBER_DEVICE float exq_f32(const uint8_t* row, uint32_t e) { return ((const float*)row)[e]; }
EMBER_DEVICE float exq_f16(const uint8_t* row, uint32_t e) { return ex_half_at(row + 2 * e); }
EMBER_DEVICE float exq_bf16(const uint8_t* row, uint32_t e) {
    const uint32_t bits = (uint32_t)row[2 * e] | ((uint32_t)row[2 * e + 1] << 8);
    return __uint_as_float(bits << 16);
}

// Q4_0 (18 bytes: f16 d, u8 qs[16]): ((q & 0xF) - 8 or (q >> 4) - 8) as f32 * d.
EMBER_DEVICE float exq_q4_0(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 18 * (e / 32);
    const uint32_t j = e % 32;
    const int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
    return ex_mul((float)(q - 8), ex_half_at(b));
}

// Q4_1 (20 bytes: f16 d, f16 m, u8 qs[16]): q as f32 * d + m (two roundings, no FMA).
EMBER_DEVICE float exq_q4_1(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 20 * (e / 32);
    const uint32_t j = e % 32;
    const int q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
    return ex_add(ex_mul((float)q, ex_half_at(b)), ex_half_at(b + 2));
}

// The 5-bit value j of a Q5 block (legacy.rs q5_values): nibble of qs, fifth bit j of qh.
EMBER_DEVICE int ex_q5_value(const uint8_t* qh_bytes, const uint8_t* qs, uint32_t j) {
    const uint32_t qh = (uint32_t)qh_bytes[0] | ((uint32_t)qh_bytes[1] << 8) | ((uint32_t)qh_bytes[2] << 16) | ((uint32_t)qh_bytes[3] << 24);
    const int low = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
    return low | (int)(((qh >> j) & 1u) << 4);
}

// Q5_0 (22 bytes: f16 d, u8 qh[4], u8 qs[16]): (q - 16) as f32 * d.
EMBER_DEVICE float exq_q5_0(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 22 * (e / 32);
    const int q = ex_q5_value(b + 2, b + 6, e % 32);
    return ex_mul((float)(q - 16), ex_half_at(b));
}

// Q5_1 (24 bytes: f16 d, f16 m, u8 qh[4], u8 qs[16]): q as f32 * d + m.
EMBER_DEVICE float exq_q5_1(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 24 * (e / 32);
    const int q = ex_q5_value(b + 4, b + 8, e % 32);
    return ex_add(ex_mul((float)q, ex_half_at(b)), ex_half_at(b + 2));
}

// Q8_0 (34 bytes: f16 d, i8 qs[32]): q as f32 * d.
EMBER_DEVICE float exq_q8_0(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 34 * (e / 32);
    return ex_mul((float)(int8_t)b[2 + e % 32], ex_half_at(b));
}

// Q2_K (84 bytes: u8 scales[16], u8 qs[64], f16 d, f16 dmin), kquants.rs dequantize_q2_k:
// dl = d * (sc & 0xF), ml = dmin * (sc >> 4), value = dl * q - ml, q from q2k_values.
EMBER_DEVICE float exq_q2_k(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 84 * (e / 256);
    const uint32_t i = e % 256;
    const uint32_t half_idx = i / 128, shift = (i % 128) / 32, l = i % 32;
    const int q = (b[16 + 32 * half_idx + l] >> (2 * shift)) & 3;
    const uint8_t sc = b[i / 16];
    const float dl = ex_mul(ex_half_at(b + 80), (float)(sc & 0xF));
    const float ml = ex_mul(ex_half_at(b + 82), (float)(sc >> 4));
    return ex_sub(ex_mul(dl, (float)q), ml);
}

// Q3_K (110 bytes: u8 hmask[32], u8 qs[64], u8 scales[12], f16 d), dequantize_q3_k:
// dl = d * scale, value = dl * q, q from q3k_values (-4..=3), scale from q3k_scales (-32..=31).
EMBER_DEVICE float exq_q3_k(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 110 * (e / 256);
    const uint32_t i = e % 256;
    const uint32_t half_idx = i / 128, shift = (i % 128) / 32, l = i % 32;
    const int low = (b[32 + 32 * half_idx + l] >> (2 * shift)) & 3;
    const uint32_t bit = 1u << (4 * half_idx + shift);
    const int high = (b[l] & bit) ? 0 : 4;
    const int q = low - high;
    const uint32_t j = i / 16;
    const uint8_t* scales = b + 96;
    const int sc_low = j < 8 ? (scales[j] & 0xF) : (scales[j - 8] >> 4);
    const int sc_high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    const int sc = (sc_low | (sc_high << 4)) - 32;
    const float dl = ex_mul(ex_half_at(b + 108), (float)sc);
    return ex_mul(dl, (float)q);
}

// The 6-bit scale and min of sub-block j of Q4_K/Q5_K (blocks.rs scale_min_k4).
EMBER_DEVICE void ex_scale_min_k4(uint32_t j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K (144 bytes: f16 d, f16 dmin, u8 scales[12], u8 qs[128]) and Q5_K (176 bytes: the same
// header, u8 qh[32] at 16, u8 qs[128] at 48), dequantize_k4: d1 = d * scale, m1 = dmin * min,
// value = d1 * q - m1, q from k4_values.
template <bool Q5>
EMBER_DEVICE float exq_k4(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + (Q5 ? 176 : 144) * (e / 256);
    const uint32_t i = e % 256;
    const uint32_t c = i / 64, w = i % 64, l = w % 32;
    const uint8_t byte = b[(Q5 ? 48 : 16) + 32 * c + l];
    int q = w < 32 ? (byte & 0xF) : (byte >> 4);
    if (Q5) {
        const uint8_t h = b[16 + l];
        q |= ((h >> (2 * c + (w < 32 ? 0 : 1))) & 1) << 4;
    }
    int scale, min;
    ex_scale_min_k4(i / 32, b + 4, &scale, &min);
    const float d1 = ex_mul(ex_half_at(b), (float)scale);
    const float m1 = ex_mul(ex_half_at(b + 2), (float)min);
    return ex_sub(ex_mul(d1, (float)q), m1);
}
EMBER_DEVICE float exq_q4_k(const uint8_t* row, uint32_t e) { return exq_k4<false>(row, e); }
EMBER_DEVICE float exq_q5_k(const uint8_t* row, uint32_t e) { return exq_k4<true>(row, e); }

// Q6_K (210 bytes: u8 ql[128], u8 qh[64], i8 scales[16], f16 d), dequantize_q6_k:
// value = d * scale * q (left to right), q from q6k_values (-32..=31).
EMBER_DEVICE float exq_q6_k(const uint8_t* row, uint32_t e) {
    const uint8_t* b = row + 210 * (e / 256);
    const uint32_t i = e % 256;
    const uint32_t c = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
    const uint8_t* ql = b + 64 * c;
    const uint8_t h = b[128 + 32 * c + l];
    int q;
    switch (quarter) {
        case 0: q = (ql[l] & 0xF) | ((h & 3) << 4); break;
        case 1: q = (ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4); break;
        case 2: q = (ql[l] >> 4) | (((h >> 4) & 3) << 4); break;
        default: q = (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4); break;
    }
    q -= 32;
    const float sc = (float)(int8_t)b[192 + i / 16];
    return ex_mul(ex_mul(ex_half_at(b + 208), sc), (float)q);
}

// ---- get_rows ----

// CPU op (CpuBackend::get_rows): out[t, c] = dequantise(table row ids[t])[c], then times scale
// unless scale is exactly 1. Row bytes are n_cols / BLOCK_VALUES * BLOCK_BYTES. An id outside
// [0, n_rows) gives a row of NaNs rather than a read outside the table (the engine checks ids
// first, so it never happens there). Launch: grid = n_ids, any block size.
#define EMBER_EXACT_GET_ROWS(name, fn, block_values, block_bytes)                                                  \
    EMBER_KERNEL void name(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_rows, uint32_t n_cols, \
                           float scale) {                                                                          \
        const int32_t id = ids[blockIdx.x];                                                                        \
        float* out_row = out + (size_t)blockIdx.x * n_cols;                                                        \
        if (id < 0 || (uint32_t)id >= n_rows) {                                                                    \
            for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = NAN;                          \
            return;                                                                                                \
        }                                                                                                          \
        const uint8_t* row = table + (size_t)id * ((size_t)n_cols / (block_values) * (block_bytes));               \
        for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {                                              \
            float v = fn(row, c);                                                                                  \
            if (scale != 1.0f) v = ex_mul(v, scale);                                                               \
            out_row[c] = v;                                                                                        \
        }                                                                                                          \
    }

EMBER_EXACT_GET_ROWS(ember_exact_get_rows_f32, exq_f32, 1, 4)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_f16, exq_f16, 1, 2)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_bf16, exq_bf16, 1, 2)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q4_0, exq_q4_0, 32, 18)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q4_1, exq_q4_1, 32, 20)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q5_0, exq_q5_0, 32, 22)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q5_1, exq_q5_1, 32, 24)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q8_0, exq_q8_0, 32, 34)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q2_k, exq_q2_k, 256, 84)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q3_k, exq_q3_k, 256, 110)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q4_k, exq_q4_k, 256, 144)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q5_k, exq_q5_k, 256, 176)
EMBER_EXACT_GET_ROWS(ember_exact_get_rows_q6_k, exq_q6_k, 256, 210)

// ---- RMS normalisation ----

// rms_scale of ops.rs: 1 / sqrt(f32(sum_f64(f64(v * v)) / n) + eps), the f64 sum taken
// sequentially from the first value to the last (Rust's Iterator::sum folds left to right).
// Called by one thread.
EMBER_DEVICE float ex_rms_scale(const float* row, uint32_t n, float eps) {
    double sum = 0.0;
    for (uint32_t c = 0; c < n; ++c) {
        const float v = row[c];
        sum = ex_dadd(sum, (double)ex_mul(v, v));
    }
    const float mean = ex_d2f(ex_ddiv(sum, (double)n));
    return ex_div(1.0f, ex_sqrt(ex_add(mean, eps)));
}

// CPU op (rms_norm_row): out[r, c] = x[r, c] * scale_r * weight[c] (left to right). Thread 0 of
// the row's block forms the scale; every thread then writes its columns. `out` may alias `x`
// (every read of the row happens before the barrier, every write after it).
// Launch: grid = n_rows, any block size.
EMBER_KERNEL void ember_exact_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t n_cols, float eps) {
    __shared__ float row_scale;
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    if (threadIdx.x == 0) row_scale = ex_rms_scale(row, n_cols, eps);
    __syncthreads();
    const float scale = row_scale;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = ex_mul(ex_mul(row[c], scale), weight[c]);
}

// CPU ops add_inplace then rms_norm (Backend::add_rms_norm's default): x[r, c] += proj[r, c],
// then out[r] = rms_norm_row(x[r]) * weight. The adds are written before the barrier, so thread
// 0 sums the updated row. `out` is a buffer other than `x` and `proj`.
// Launch: grid = n_rows, any block size.
EMBER_KERNEL void ember_exact_add_rms_norm_f32(float* out, float* x, const float* proj, const float* weight, uint32_t n_cols,
                                               float eps) {
    __shared__ float row_scale;
    float* row = x + (size_t)blockIdx.x * n_cols;
    const float* proj_row = proj + (size_t)blockIdx.x * n_cols;
    float* out_row = out + (size_t)blockIdx.x * n_cols;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) row[c] = ex_add(row[c], proj_row[c]);
    __syncthreads();
    if (threadIdx.x == 0) row_scale = ex_rms_scale(row, n_cols, eps);
    __syncthreads();
    const float scale = row_scale;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) out_row[c] = ex_mul(ex_mul(row[c], scale), weight[c]);
}

// ---- element-wise ----

// vec.rs silu_ggml: x / (1 + expf(0 - x)).
EMBER_DEVICE float ex_silu_ggml(float x) { return ex_div(x, ex_add(1.0f, ex_expf_ggml(ex_sub(0.0f, x)))); }

// CPU op swiglu (vec.rs swiglu_ggml, whose AVX2 lanes equal silu_ggml bit for bit):
// out[i] = silu(gate[i]) * up[i]. `out` may alias `gate` or `up`.
EMBER_KERNEL void ember_exact_swiglu_f32(float* out, const float* gate, const float* up, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = ex_mul(ex_silu_ggml(gate[i]), up[i]);
}

// CPU op geglu (ops.rs gelu_ggml): out[i] = gelu(gate[i]) * up[i] with gelu(x) = 0 for
// x <= -10, x for x >= 10, else table[f16 bits of x] as f32. `table` is the CPU's GELU table
// (65536 f16 values, ops::gelu_table), uploaded by the host. `out` may alias `gate` or `up`.
EMBER_KERNEL void ember_exact_geglu_f32(float* out, const float* gate, const float* up, const uint16_t* table, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float x = gate[i];
        float g;
        if (x <= -10.0f) {
            g = 0.0f;
        } else if (x >= 10.0f) {
            g = x;
        } else {
            g = ex_half_bits(table[ex_f16_bits(x)]);
        }
        out[i] = ex_mul(g, up[i]);
    }
}

// ---- rotary embedding ----

// CPU op rope (ops.rs rope_head) on x [n_tokens, n_heads, head_dim], in place, with the cosines
// and sines the host computed exactly as CpuBackend::rope_table does: cos_sin[t * n_dims + 2 i]
// and [t * n_dims + 2 i + 1] for pair i of token t. Pair (x0, x1) becomes
//   (fma(x0, cos, -(x1 * sin)), fma(x0, sin, x1 * cos))       (rotate_first, rotate_second)
// where the pair is (x[2 i], x[2 i + 1]) (norm) or (x[i], x[i + n_dims / 2]) (neox). Values from
// n_dims on are left alone. One thread per (token, head, pair), grid-stride.
template <bool NEOX>
EMBER_DEVICE void ex_rope(float* x, const float* cos_sin, uint32_t n_tokens, uint32_t n_heads, uint32_t head_dim, uint32_t n_dims) {
    const uint32_t half_dims = n_dims / 2;
    const uint32_t per_token = n_heads * half_dims;
    const uint32_t n = n_tokens * per_token;
    for (uint32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
        const uint32_t token = idx / per_token;
        const uint32_t head = (idx % per_token) / half_dims;
        const uint32_t i = idx % half_dims;
        float* h = x + ((size_t)token * n_heads + head) * head_dim;
        const float c = cos_sin[(size_t)token * n_dims + 2 * i];
        const float s = cos_sin[(size_t)token * n_dims + 2 * i + 1];
        const uint32_t ia = NEOX ? i : 2 * i;
        const uint32_t ib = NEOX ? i + half_dims : 2 * i + 1;
        const float x0 = h[ia], x1 = h[ib];
        h[ia] = ex_fma(x0, c, -ex_mul(x1, s));
        h[ib] = ex_fma(x0, s, ex_mul(x1, c));
    }
}

EMBER_KERNEL void ember_exact_rope_norm_f32(float* x, const float* cos_sin, uint32_t n_tokens, uint32_t n_heads, uint32_t head_dim, uint32_t n_dims) {
    ex_rope<false>(x, cos_sin, n_tokens, n_heads, head_dim, n_dims);
}

EMBER_KERNEL void ember_exact_rope_neox_f32(float* x, const float* cos_sin, uint32_t n_tokens, uint32_t n_heads, uint32_t head_dim, uint32_t n_dims) {
    ex_rope<true>(x, cos_sin, n_tokens, n_heads, head_dim, n_dims);
}
