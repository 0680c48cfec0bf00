// ember_q8.h: what the quantised matrix kernels share (matvec.hip for up to 8 tokens, mmq.hip for
// more): the rounding of f32 activations to GGML's 8-bit activation formats exactly as the CPU
// backend rounds them, the 4-byte integer dot product, and small helpers that unpack weight bytes.
// matvec.hip's header gives the rounding rules and why they matter.
#pragma once

#include "ember_quant.h"

// Activation formats: what the shared float2 of group g holds.
//   EMBER_ACT_Q8_0: (d, sum q) with d = f16(amax / 127) as f32, sum q exact as f32;
//   EMBER_ACT_Q8_1: (d, s), s = f16(sum q * amax / 127) as f32;
//   EMBER_ACT_Q8_K: (d of the 256-value super-block, sum q of the group's 32 values).
#define EMBER_ACT_Q8_0 0
#define EMBER_ACT_Q8_1 1
#define EMBER_ACT_Q8_K 2

// sum of the four signed byte products of a and b, plus c.
EMBER_DEVICE int ember_dp4a(int a, int b, int c) {
#if defined(EMBER_PLATFORM_CUDA)
    return __dp4a(a, b, c);
#elif defined(__GFX11__) || defined(__GFX12__)
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
    defined(__gfx942__) || defined(__gfx950__) || defined(__gfx1011__) || defined(__gfx1012__) || defined(__gfx1030__) ||  \
    defined(__gfx1031__) || defined(__gfx1032__) || defined(__gfx1033__) || defined(__gfx1034__) || defined(__gfx1035__) || \
    defined(__gfx1036__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    // Targets without an integer dot instruction: the same arithmetic, one byte at a time.
#pragma unroll
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
#endif
}

// An IEEE half at a 2-byte aligned address.
EMBER_DEVICE float ember_mv_half(const uint8_t* p) { return __half2float(*(const ember_half*)p); }

// N little-endian 32-bit words from an address that is only 2-byte aligned: aligned words are
// loaded and funnel-shifted, which is fewer load instructions than 2N 16-bit loads. The word past
// the end is read only when the address is misaligned; it then lies in the same aligned 4-byte
// word as the last wanted bytes, so it never crosses into an unmapped page.
template <int N>
EMBER_DEVICE void ember_load_words_a2(const uint8_t* p, uint32_t* out) {
    const uintptr_t address = (uintptr_t)p;
    const uint32_t* base = (const uint32_t*)(address & ~(uintptr_t)3);
    const uint32_t shift = (uint32_t)(address & 2) * 8;
    uint32_t words[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) words[i] = base[i];
    words[N] = shift ? base[N] : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = (uint32_t)(((((uint64_t)words[i + 1]) << 32) | words[i]) >> shift);
}

// The bits 0..3 of b moved to bit 4 of bytes 0..3 (the fifth bit of four q5 values).
EMBER_DEVICE uint32_t ember_spread_high_bits(uint32_t b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// Four unsigned bytes in 0..63 minus 32 each, as signed bytes, without carries between bytes.
EMBER_DEVICE uint32_t ember_bytes_minus_32(uint32_t v) {
    const uint32_t below = ~v & 0x20202020u;
    return (v ^ 0x20202020u) | (below << 1) | (below << 2);
}

// Byte offset of value v (a multiple of 8) of token t in the shared int8 activations. Each group
// of 32 values is two 16-byte chunks, and chunk j of every group of a token is stored together
// ("chunk-major"): lanes that read consecutive groups then read consecutive 16-byte words of
// shared memory, without the bank conflicts of 32 lanes reading 32-byte-strided groups.
EMBER_DEVICE size_t ember_mv_xq_offset(uint32_t n_cols, uint32_t t, uint32_t v) {
    const uint32_t n_groups = n_cols / 32, o = v % 32;
    return ((size_t)(2 * t + o / 16) * n_groups + v / 32) * 16 + o % 16;
}

// Quantises n_values f32 of x (rows of n_cols; whole groups: multiples of 32, of 256 for Q8_K)
// into xq (int8, laid out as ember_mv_xq_offset says) and xds (one float2 per 32 values, in
// order) as described at EMBER_ACT_*. The block works in teams of 32
// lanes (half a wave64); a team takes 256 consecutive values, 8 per lane, so a group of 32 is 4
// neighbouring lanes and a Q8_K super-block is the whole team. Products are rounded separately
// (__fmul_rn) so that no multiply-add contraction changes the rounding the CPU does. Every lane
// of the block must call this.
//
// With `rows` (the grouped products of mixture-of-experts layers), row t of the activations is
// row rows[t] / row_div of x instead of row t: each expert's block gathers the rows routed to it.
// n_cols is a multiple of 32, so the 8 values of a lane never straddle two rows.
template <int ACT>
EMBER_DEVICE void ember_mv_quantize(int8_t* xq, float2* xds, const float* x, uint32_t n_values, uint32_t n_cols,
                                    const int32_t* rows = nullptr, uint32_t row_div = 1) {
    constexpr int BATCH = 4;
    const int lane = (int)(threadIdx.x % 32);
    const uint32_t team = threadIdx.x / 32, n_teams = blockDim.x / 32;
    // BATCH chunks' loads of x are issued before any of them is used (every block waits for this
    // before its first weight load). The trip counts are the same for the whole block, so every
    // shuffle has every lane of its wave.
    for (uint32_t batch = 0; batch < n_values; batch += BATCH * 256 * n_teams) {
        float values[BATCH][8];
#pragma unroll
        for (int c = 0; c < BATCH; ++c) {
            const uint32_t i = batch + (c * n_teams + team) * 256 + 8 * (uint32_t)lane;
            if (i < n_values) {
                const float* src = rows ? x + (size_t)((uint32_t)rows[i / n_cols] / row_div) * n_cols + i % n_cols : x + i;
                const float4 a = *(const float4*)src, b = *(const float4*)(src + 4);
                values[c][0] = a.x, values[c][1] = a.y, values[c][2] = a.z, values[c][3] = a.w;
                values[c][4] = b.x, values[c][5] = b.y, values[c][6] = b.z, values[c][7] = b.w;
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) values[c][k] = 0.0f;
            }
        }
#pragma unroll
        for (int c = 0; c < BATCH; ++c) {
            // A chunk wholly past the end is skipped by its whole team (the shuffles below stay
            // within a team): a one-token row of 2048 values fills one chunk of the four, and
            // rounding the three empty ones cost each block of a decode product as much as the
            // full one.
            if (batch + (c * n_teams + team) * 256 >= n_values) continue;
            const uint32_t i = batch + (c * n_teams + team) * 256 + 8 * (uint32_t)lane;
            const bool valid = i < n_values;
            const float* v = values[c];
            int q[8];
            float d;
            if (ACT == EMBER_ACT_Q8_K) {
                // The value of largest magnitude, the first one on ties: (magnitude, index) pairs
                // reduced over the team, larger magnitude first, then smaller index.
                float best = 0.0f, best_abs = 0.0f;
                int best_index = 0x7fffffff;
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (fabsf(v[k]) > best_abs) best_abs = fabsf(v[k]), best = v[k], best_index = (int)i + k;
#pragma unroll
                for (int mask = 16; mask > 0; mask >>= 1) {
                    const float other = ember_shfl_xor(best, mask), other_abs = ember_shfl_xor(best_abs, mask);
                    const int other_index = ember_shfl_xor_int(best_index, mask);
                    if (other_abs > best_abs || (other_abs == best_abs && other_index < best_index))
                        best = other, best_abs = other_abs, best_index = other_index;
                }
                const float iscale = best_abs > 0.0f ? -127.0f / best : 0.0f;
#pragma unroll
                for (int k = 0; k < 8; ++k) q[k] = min((int)rintf(__fmul_rn(iscale, v[k])), 127);
                d = best_abs > 0.0f ? 1.0f / iscale : 0.0f;
            } else {
                float amax = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
                amax = fmaxf(amax, ember_shfl_xor(amax, 1));
                amax = fmaxf(amax, ember_shfl_xor(amax, 2));
                const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
                // |v id| <= 127 up to the rounding of id, which the clamp absorbs (the CPU's
                // saturating conversion does the same).
#pragma unroll
                for (int k = 0; k < 8; ++k) q[k] = max(-128, min(127, (int)rintf(__fmul_rn(v[k], id))));
                d = amax / 127.0f;
            }
            int sum = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) sum += q[k];
            sum += ember_shfl_xor_int(sum, 1);
            sum += ember_shfl_xor_int(sum, 2);
            if (valid) {
                int2 packed;
                packed.x = (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16) | ((uint32_t)(q[3] & 0xff) << 24);
                packed.y = (q[4] & 0xff) | ((q[5] & 0xff) << 8) | ((q[6] & 0xff) << 16) | ((uint32_t)(q[7] & 0xff) << 24);
                *(int2*)(xq + ember_mv_xq_offset(n_cols, i / n_cols, i % n_cols)) = packed;
                if (lane % 4 == 0) {
                    float2 ds;
                    if (ACT == EMBER_ACT_Q8_K) ds = make_float2(d, (float)sum);
                    else if (ACT == EMBER_ACT_Q8_0) ds = make_float2(__half2float(__float2half_rn(d)), (float)sum);
                    else ds = make_float2(__half2float(__float2half_rn(d)), __half2float(__float2half_rn(__fmul_rn((float)sum, d))));
                    xds[i / 32] = ds;
                }
            }
        }
    }
}

// The 6-bit scale and min of sub-block j (0..7) from a q4_K/q5_K super-block's 12 scale bytes
// held as three words (w0 = bytes 0..3, w1 = 4..7, w2 = 8..11); see ember_scale_min_k4.
EMBER_DEVICE void ember_mv_scale_min_k4(int j, uint32_t w0, uint32_t w1, uint32_t w2, int* scale, int* min) {
    if (j < 4) {
        *scale = (int)((w0 >> (8 * j)) & 63u);
        *min = (int)((w1 >> (8 * j)) & 63u);
    } else {
        const int shift = 8 * (j - 4);
        *scale = (int)(((w2 >> shift) & 15u) | (((w0 >> (shift + 6)) & 3u) << 4));
        *min = (int)(((w2 >> (shift + 4)) & 15u) | (((w1 >> (shift + 6)) & 3u) << 4));
    }
}
