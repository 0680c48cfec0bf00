// ember_quant.h: GGUF block formats as seen by the kernels, shared by embedding.hip and matvec.hip.
//
// Every format is read in "groups" of 32 consecutive values of a row: group g holds row elements
// [32 g, 32 g + 32). A format type provides
//   BLOCK_VALUES / BLOCK_BYTES   the GGUF block (32 values, or 256 for k-quants),
//   get(row, g, l)               dequantised value l (0..31) of group g of a row.
// The layouts are those of the GGUF specification (ggml's block_q4_0, block_q4_K, ...); values
// are dequantised exactly as ember-quant's scalar CPU code does, in f32.
#pragma once
#include "ember_compat.h"

struct EmberF32 {
    static constexpr int BLOCK_VALUES = 1, BLOCK_BYTES = 4;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) { return ((const float*)row)[32 * g + l]; }
};

struct EmberF16 {
    static constexpr int BLOCK_VALUES = 1, BLOCK_BYTES = 2;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) { return ember_load_half(row + 2 * (32 * g + l)); }
};

// block_q4_0: half d; uint8 qs[16]. Value j < 16: (qs[j] & 15) - 8; value j >= 16: (qs[j-16] >> 4) - 8; times d.
struct EmberQ4_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 18;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * g;
        const int q = l < 16 ? (b[2 + l] & 15) : (b[2 + l - 16] >> 4);
        return (float)(q - 8) * ember_load_half(b);
    }
};

// block_q4_1: half d; half m; uint8 qs[16]. Value = q * d + m with q as in q4_0 but unsigned.
struct EmberQ4_1 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 20;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * g;
        const int q = l < 16 ? (b[4 + l] & 15) : (b[4 + l - 16] >> 4);
        return (float)q * ember_load_half(b) + ember_load_half(b + 2);
    }
};

// block_q8_0: half d; int8 qs[32]. Value = qs[l] * d.
struct EmberQ8_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * g;
        return (float)(int8_t)b[2 + l] * ember_load_half(b);
    }
};

// The 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K super-block's 12 packed bytes.
EMBER_DEVICE void ember_scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// block_q4_K (256 values): half d; half dmin; uint8 scales[12]; uint8 qs[128].
// Sub-block j (32 values) uses qs[32 (j / 2) + l], low nibble for even j, high for odd j:
// value = d * scale_j * q - dmin * min_j.
struct EmberQ4_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 144;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * (g / 8);
        const int j = g % 8;
        int scale, min;
        ember_scale_min_k4(j, b + 4, &scale, &min);
        const uint8_t byte = b[16 + 32 * (j / 2) + l];
        const int q = (j & 1) ? (byte >> 4) : (byte & 15);
        return ember_load_half(b) * (float)scale * (float)q - ember_load_half(b + 2) * (float)min;
    }
};

// block_q6_K (256 values): uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d.
// Each half h (128 values) has four groups k of 32: low 4 bits from ql[64 h + l + 32 (k & 1)]
// (low nibble for k < 2, high for k >= 2), high 2 bits from qh[32 h + l] >> 2k; q - 32, times
// d * scales[8 h + 2k + l / 16].
struct EmberQ6_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * (g / 8);
        const int h = (g % 8) / 4, k = g % 4;
        const uint8_t low_byte = b[64 * h + l + 32 * (k & 1)];
        const int low = k < 2 ? (low_byte & 15) : (low_byte >> 4);
        const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
        const int q = (low | (high << 4)) - 32;
        const int8_t scale = (int8_t)b[192 + 8 * h + 2 * k + l / 16];
        return ember_load_half(b + 208) * (float)scale * (float)q;
    }
};

// bf16: the top 16 bits of an f32.
struct EmberBF16 {
    static constexpr int BLOCK_VALUES = 1, BLOCK_BYTES = 2;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* p = row + 2 * (32 * g + l);
        return __uint_as_float((uint32_t)(p[0] | (p[1] << 8)) << 16);
    }
};

// The fifth bit of value v (0..31) of a q5_0/q5_1 block: bit v of the little-endian u32 qh.
EMBER_DEVICE int ember_q5_high_bit(const uint8_t* qh, int v) { return (qh[v / 8] >> (v % 8)) & 1; }

// block_q5_0: half d; uint8 qh[4]; uint8 qs[16]. Value v = ((nibble as in q4_0) | bit v of qh << 4) - 16, times d.
struct EmberQ5_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 22;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * g;
        const int low = l < 16 ? (b[6 + l] & 15) : (b[6 + l - 16] >> 4);
        return (float)((low | (ember_q5_high_bit(b + 2, l) << 4)) - 16) * ember_load_half(b);
    }
};

// block_q5_1: half d; half m; uint8 qh[4]; uint8 qs[16]. Value = q * d + m, q in 0..31.
struct EmberQ5_1 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 24;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * g;
        const int low = l < 16 ? (b[8 + l] & 15) : (b[8 + l - 16] >> 4);
        return (float)(low | (ember_q5_high_bit(b + 4, l) << 4)) * ember_load_half(b) + ember_load_half(b + 2);
    }
};

// block_q2_K (256 values): uint8 scales[16]; uint8 qs[64]; half d; half dmin.
// Sub-block j = 4 n + k (half n, k 0..3): 2-bit q = (qs[32 n + l] >> 2k) & 3 with scale byte
// scales[8 n + 2k + l / 16]: value = d * (scale & 15) * q - dmin * (scale >> 4).
struct EmberQ2_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 84;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * (g / 8);
        const int n = (g % 8) / 4, k = g % 4;
        const int q = (b[16 + 32 * n + l] >> (2 * k)) & 3;
        const uint8_t scale = b[8 * n + 2 * k + l / 16];
        return ember_load_half(b + 80) * (float)(scale & 15) * (float)q - ember_load_half(b + 82) * (float)(scale >> 4);
    }
};

// block_q3_K (256 values): uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d.
// Sub-block j = 4 n + k: q = ((qs[32 n + l] >> 2k) & 3) - (hmask[l] bit (4 n + k) ? 0 : 4), scale
// index i = 8 n + 2k + l / 16 with the 6-bit scale (low nibble of scales[i % 8], high nibble for
// i >= 8; top two bits from scales[8 + i % 4] >> 2 (i / 4)) minus 32; value = d * scale * q.
struct EmberQ3_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 110;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * (g / 8);
        const int n = (g % 8) / 4, k = g % 4;
        const int low = (b[32 + 32 * n + l] >> (2 * k)) & 3;
        const int q = low - (((b[l] >> (4 * n + k)) & 1) ? 0 : 4);
        const int i = 8 * n + 2 * k + l / 16;
        const uint8_t* sc = b + 96;
        const int low_nibble = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
        const int scale = (low_nibble | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
        return ember_load_half(b + 108) * (float)scale * (float)q;
    }
};

// block_q5_K (256 values): half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128].
// As q4_K, plus a fifth bit: bit j of qh[l] for sub-block j.
struct EmberQ5_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 176;
    EMBER_DEVICE float get(const uint8_t* row, int g, int l) {
        const uint8_t* b = row + BLOCK_BYTES * (g / 8);
        const int j = g % 8;
        int scale, min;
        ember_scale_min_k4(j, b + 4, &scale, &min);
        const uint8_t byte = b[48 + 32 * (j / 2) + l];
        const int q = ((j & 1) ? (byte >> 4) : (byte & 15)) | (((b[16 + l] >> j) & 1) << 4);
        return ember_load_half(b) * (float)scale * (float)q - ember_load_half(b + 2) * (float)min;
    }
};

// Bytes of one row of n_cols values.
template <typename F>
EMBER_DEVICE size_t ember_row_bytes(uint32_t n_cols) {
    return (size_t)(n_cols / F::BLOCK_VALUES) * F::BLOCK_BYTES;
}
