// Host-side helpers shared by the kernel harnesses (kernels/tests/harness*.cu): error checking,
// device buffers, random inputs, exact f16/bf16 conversions, GGUF block formats (random blocks
// and a block-by-block dequantiser written from the GGUF layouts, independently of the kernels'
// ember_quant.h) and the pass/fail report.
//
// (This file was overwritten by mistake by K2 at 09:50 and rebuilt by K2 to provide what
// harness.cu uses, with the same names; K1 owns it.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK_CUDA(call)                                                                                    \
    do {                                                                                                    \
        cudaError_t status_ = (call);                                                                       \
        if (status_ != cudaSuccess) {                                                                       \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_)); \
            std::exit(2);                                                                                   \
        }                                                                                                   \
    } while (0)

static int g_failures = 0;
static std::mt19937 g_rng(1234);

static float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }
static int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g_rng); }

static std::vector<float> random_floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(lo, hi);
    return v;
}

// A device allocation of `count` T, zeroed, with 16 bytes of slack: kernels may read an aligned
// word that ends past the last byte, which inside the pool stays within a 256-byte granule.
template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) {
        CHECK_CUDA(cudaMalloc(&ptr, count * sizeof(T) + 16));
        CHECK_CUDA(cudaMemset(ptr, 0, count * sizeof(T) + 16));
    }
    DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    ~DeviceBuffer() { (void)cudaFree(ptr); }
    void upload(const std::vector<T>& host) { CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> host(n);
        CHECK_CUDA(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

static void sync() {
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
}

// Prints one check: PASS when error <= tolerance (and error is a number).
static void report(const std::string& name, double error, double tolerance) {
    const bool ok = std::isfinite(error) && error <= tolerance;
    if (!ok) ++g_failures;
    std::printf("%-4s %-70s error %.3e (tolerance %.1e)\n", ok ? "PASS" : "FAIL", name.c_str(), error, tolerance);
}

static double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
    double worst = 0.0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::fmax(worst, std::fabs((double)a[i] - b[i]));
    return worst;
}

// Prints the summary line and gives the exit status.
static int finish(const char* harness) {
    if (g_failures) {
        std::printf("%s: %d check(s) FAILED\n", harness, g_failures);
        return 1;
    }
    std::printf("%s: every check passed\n", harness);
    return 0;
}

// Median of the samples (sorted in place).
static float median(std::vector<float>& samples) {
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
}

// ---- f16 / bf16 ----

// IEEE binary16 bits to float (exact).
static float from_half_bits(uint16_t h) {
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float value;
    if (exponent == 0) value = std::ldexp((float)mantissa, -24);
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = std::ldexp((float)(1024 + mantissa), exponent - 25);
    return sign ? -value : value;
}

// float to IEEE binary16 bits, rounding to nearest even (as __float2half_rn does).
static uint16_t to_half_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const int raw_exponent = (int)((x >> 23) & 0xff);
    uint32_t mantissa = x & 0x7fffffu;
    if (raw_exponent == 0xff) return (uint16_t)(sign | 0x7c00u | (mantissa ? 0x200u : 0u));
    const int exponent = raw_exponent - 127 + 15;
    if (exponent >= 31) return (uint16_t)(sign | 0x7c00u);
    if (exponent <= 0) {
        if (exponent < -10) return (uint16_t)sign;
        mantissa |= 0x800000u;
        const int shift = 14 - exponent;
        uint32_t h = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) ++h;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exponent << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h;  // a carry into the exponent is right
    return (uint16_t)(sign | h);
}

static float round_to_half(float f) { return from_half_bits(to_half_bits(f)); }

static float from_bf16_bits(uint16_t b) {
    const uint32_t x = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

static uint16_t to_bf16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    return (uint16_t)(x >> 16);
}

// ---- GGUF block formats ----

enum Format { F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K };

struct FormatInfo {
    const char* name;
    int block_values, block_bytes;
    // Byte offsets of the block's f16 scale fields (-1: none), and the range their values are
    // drawn from so that dequantised values stay O(1).
    int half_offsets[2];
    float scale_lo, scale_hi;
};

static const FormatInfo FORMATS[] = {
    {"f32", 1, 4, {-1, -1}, 0, 0},
    {"f16", 1, 2, {-1, -1}, 0, 0},
    {"bf16", 1, 2, {-1, -1}, 0, 0},
    {"q4_0", 32, 18, {0, -1}, 0.01f, 0.1f},
    {"q4_1", 32, 20, {0, 2}, 0.01f, 0.1f},
    {"q5_0", 32, 22, {0, -1}, 0.01f, 0.05f},
    {"q5_1", 32, 24, {0, 2}, 0.01f, 0.05f},
    {"q8_0", 32, 34, {0, -1}, 0.001f, 0.01f},
    {"q2_K", 256, 84, {80, 82}, 0.005f, 0.02f},
    {"q3_K", 256, 110, {108, -1}, 0.002f, 0.01f},
    {"q4_K", 256, 144, {0, 2}, 0.0005f, 0.002f},
    {"q5_K", 256, 176, {0, 2}, 0.0003f, 0.001f},
    {"q6_K", 256, 210, {208, -1}, 0.0001f, 0.0003f},
};

static size_t row_bytes_of(Format f, int n_cols) { return (size_t)(n_cols / FORMATS[f].block_values) * FORMATS[f].block_bytes; }

// A random matrix: random bytes with sane f16 scales for the block formats, values in [-1, 1]
// for the float formats. q4_1/q5_1 minimums are drawn from +-(scale range) * 8.
static std::vector<uint8_t> random_matrix(Format f, int n_rows, int n_cols) {
    const size_t bytes = row_bytes_of(f, n_cols) * n_rows;
    std::vector<uint8_t> w(bytes);
    if (f == F32) {
        for (size_t i = 0; i < bytes / 4; ++i) {
            const float v = uniform(-1, 1);
            std::memcpy(&w[4 * i], &v, 4);
        }
        return w;
    }
    if (f == F16 || f == BF16) {
        for (size_t i = 0; i < bytes / 2; ++i) {
            const float v = uniform(-1, 1);
            const uint16_t bits = f == F16 ? to_half_bits(v) : to_bf16_bits(v);
            std::memcpy(&w[2 * i], &bits, 2);
        }
        return w;
    }
    for (auto& b : w) b = (uint8_t)uniform_int(0, 255);
    const FormatInfo& info = FORMATS[f];
    for (size_t block = 0; block < bytes / info.block_bytes; ++block) {
        for (int k = 0; k < 2; ++k) {
            if (info.half_offsets[k] < 0) continue;
            float v = uniform(info.scale_lo, info.scale_hi);
            // q4_1 / q5_1 keep a signed minimum in their second half.
            if (k == 1 && (f == Q4_1 || f == Q5_1)) v = uniform(-8 * info.scale_hi, 8 * info.scale_hi);
            const uint16_t bits = to_half_bits(v);
            std::memcpy(&w[block * info.block_bytes + info.half_offsets[k]], &bits, 2);
        }
    }
    return w;
}

static float half_at(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return from_half_bits(bits);
}

// The 6-bit scale and min of sub-block j of a q4_K/q5_K super-block (12 packed bytes).
static void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Dequantises one row of n_cols values, block by block in the order the GGUF layouts store them,
// in f32 with the arithmetic of the GPU dequantisers (d * scale first, then times q).
static std::vector<float> dequant_row(Format f, const uint8_t* row, int n_cols) {
    std::vector<float> out(n_cols);
    const FormatInfo& info = FORMATS[f];
    for (int block = 0; block < n_cols / info.block_values; ++block) {
        const uint8_t* b = row + (size_t)block * info.block_bytes;
        float* y = out.data() + (size_t)block * info.block_values;
        switch (f) {
            case F32: std::memcpy(y, b, 4); break;
            case F16: y[0] = half_at(b); break;
            case BF16: {
                uint16_t bits;
                std::memcpy(&bits, b, 2);
                y[0] = from_bf16_bits(bits);
                break;
            }
            case Q4_0: {
                const float d = half_at(b);
                for (int j = 0; j < 16; ++j) {
                    y[j] = (float)((b[2 + j] & 15) - 8) * d;
                    y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
                }
                break;
            }
            case Q4_1: {
                const float d = half_at(b), m = half_at(b + 2);
                for (int j = 0; j < 16; ++j) {
                    y[j] = (float)(b[4 + j] & 15) * d + m;
                    y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
                }
                break;
            }
            case Q5_0: {
                const float d = half_at(b);
                uint32_t qh;
                std::memcpy(&qh, b + 2, 4);
                for (int j = 0; j < 16; ++j) {
                    y[j] = (float)((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16) * d;
                    y[j + 16] = (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * d;
                }
                break;
            }
            case Q5_1: {
                const float d = half_at(b), m = half_at(b + 2);
                uint32_t qh;
                std::memcpy(&qh, b + 4, 4);
                for (int j = 0; j < 16; ++j) {
                    y[j] = (float)((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) * d + m;
                    y[j + 16] = (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
                }
                break;
            }
            case Q8_0: {
                const float d = half_at(b);
                for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)b[2 + j] * d;
                break;
            }
            case Q2_K: {
                const uint8_t* scales = b;
                const uint8_t* q = b + 16;
                const float d = half_at(b + 80), dmin = half_at(b + 82);
                int is = 0;
                for (int n = 0; n < 2; ++n, q += 32)
                    for (int shift = 0; shift < 8; shift += 2)
                        for (int half = 0; half < 2; ++half) {
                            const uint8_t sc = scales[is++];
                            for (int l = 0; l < 16; ++l)
                                *y++ = d * (float)(sc & 15) * (float)((q[16 * half + l] >> shift) & 3) - dmin * (float)(sc >> 4);
                        }
                break;
            }
            case Q3_K: {
                const uint8_t* hmask = b;
                const uint8_t* q = b + 32;
                const float d = half_at(b + 108);
                uint32_t aux[4];
                std::memcpy(aux, b + 96, 12);
                const uint32_t tmp = aux[2];
                aux[2] = ((aux[0] >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
                aux[3] = ((aux[1] >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
                aux[0] = (aux[0] & 0x0f0f0f0fu) | (((tmp >> 0) & 0x03030303u) << 4);
                aux[1] = (aux[1] & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
                const int8_t* scales = (const int8_t*)aux;
                int is = 0;
                uint8_t m = 1;
                for (int n = 0; n < 2; ++n, q += 32)
                    for (int shift = 0; shift < 8; shift += 2, m <<= 1)
                        for (int half = 0; half < 2; ++half) {
                            const float dl = d * (float)(scales[is++] - 32);
                            for (int l = 16 * half; l < 16 * half + 16; ++l)
                                *y++ = dl * (float)((int)((q[l] >> shift) & 3) - ((hmask[l] & m) ? 0 : 4));
                        }
                break;
            }
            case Q4_K: {
                const float d = half_at(b), dmin = half_at(b + 2);
                const uint8_t* q = b + 16;
                for (int j = 0; j < 4; ++j, q += 32) {
                    int sc, mn;
                    scale_min_k4(2 * j, b + 4, &sc, &mn);
                    for (int l = 0; l < 32; ++l) *y++ = d * (float)sc * (float)(q[l] & 15) - dmin * (float)mn;
                    scale_min_k4(2 * j + 1, b + 4, &sc, &mn);
                    for (int l = 0; l < 32; ++l) *y++ = d * (float)sc * (float)(q[l] >> 4) - dmin * (float)mn;
                }
                break;
            }
            case Q5_K: {
                const float d = half_at(b), dmin = half_at(b + 2);
                const uint8_t* qh = b + 16;
                const uint8_t* q = b + 48;
                for (int j = 0; j < 4; ++j, q += 32) {
                    int sc, mn;
                    scale_min_k4(2 * j, b + 4, &sc, &mn);
                    for (int l = 0; l < 32; ++l) *y++ = d * (float)sc * (float)((q[l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4)) - dmin * (float)mn;
                    scale_min_k4(2 * j + 1, b + 4, &sc, &mn);
                    for (int l = 0; l < 32; ++l) *y++ = d * (float)sc * (float)((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - dmin * (float)mn;
                }
                break;
            }
            case Q6_K: {
                const float d = half_at(b + 208);
                const uint8_t* ql = b;
                const uint8_t* qh = b + 128;
                const int8_t* sc = (const int8_t*)(b + 192);
                for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128)
                    for (int l = 0; l < 32; ++l) {
                        const int is = l / 16;
                        const int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        y[l] = d * (float)sc[is] * (float)q1;
                        y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                        y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                        y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                    }
                break;
            }
        }
    }
    return out;
}

// The magnitude of the offset term of value c of a row (what may cancel against the scaled
// integer part).
static double offset_magnitude(Format f, const uint8_t* row, int c) {
    const FormatInfo& info = FORMATS[f];
    const uint8_t* b = row + (size_t)(c / info.block_values) * info.block_bytes;
    switch (f) {
        case Q4_0: return 8.0 * std::fabs(half_at(b));
        case Q5_0: return 16.0 * std::fabs(half_at(b));
        case Q4_1:
        case Q5_1: return std::fabs(half_at(b + 2));
        case Q4_K:
        case Q5_K: {
            int scale, min;
            scale_min_k4((c % 256) / 32, b + 4, &scale, &min);
            return std::fabs(half_at(b + 2)) * (double)min;
        }
        default: return 0.0;
    }
}
