// Kernel test harness: runs every kernel of kernels/*.hip on random inputs and compares it with a
// plain C++ reference written here independently of the kernel code (block dequantisation follows
// the GGUF layouts block by block; sums are taken in double).
//
// Build and run on an NVIDIA machine (from the repository root):
//   nvcc -std=c++17 -O2 -arch=sm_90 -x cu -I kernels kernels/tests/harness.cu -o target/ember_kernel_harness
//   target/ember_kernel_harness
// Exit status 0 when every check passes. Tolerances are stated per check: f32 kernels whose only
// difference from the reference is summation order are held to a relative error of 1e-4 (of the
// sum of magnitudes, which bounds reordering error), transcendental ones to 2e-5 absolute plus
// that, and attention (two-pass softmax, expf) to 1e-4 absolute on O(1) outputs.
#include "../memory.hip"
#include "../elementwise.hip"
#include "../norm.hip"
#include "../rope.hip"
#include "../softmax.hip"
#include "../argmax.hip"
#include "../embedding.hip"
#include "../matvec.hip"
#include "../dequantize.hip"
#include "../attention.hip"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK_CUDA(call)                                                                           \
    do {                                                                                           \
        cudaError_t status_ = (call);                                                              \
        if (status_ != cudaSuccess) {                                                              \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_)); \
            std::exit(2);                                                                          \
        }                                                                                          \
    } while (0)

static int g_failures = 0;
static std::mt19937 g_rng(1234);

static float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }

static std::vector<float> random_floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(lo, hi);
    return v;
}

template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) { CHECK_CUDA(cudaMalloc(&ptr, count * sizeof(T) + 16)); }
    DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    ~DeviceBuffer() { (void)cudaFree(ptr); }
    void upload(const std::vector<T>& host) { CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> host(n);
        CHECK_CUDA(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

static void report(const std::string& name, double max_error, double tolerance) {
    const bool ok = max_error <= tolerance && std::isfinite(max_error);
    if (!ok) ++g_failures;
    std::printf("%-4s %-44s max error %.3e (tolerance %.1e)\n", ok ? "PASS" : "FAIL", name.c_str(), max_error, tolerance);
}

static double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
    double worst = 0.0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::fmax(worst, std::fabs((double)a[i] - b[i]));
    return worst;
}

static void sync() {
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
}

// ---- host half helpers --------------------------------------------------------------------

static uint16_t to_half_bits(float f) {
    __half h = __float2half(f);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

static float from_half_bits(uint16_t bits) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
}

static void put_half(uint8_t* p, float f) {
    const uint16_t bits = to_half_bits(f);
    p[0] = bits & 0xff;
    p[1] = bits >> 8;
}

static float get_half(const uint8_t* p) { return from_half_bits((uint16_t)(p[0] | (p[1] << 8))); }

// ---- reference dequantisation, block by block -----------------------------------------------

enum Format { F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K };
struct FormatInfo {
    const char* name;
    int block_values, block_bytes;
};
static const FormatInfo FORMATS[] = {{"f32", 1, 4},    {"f16", 1, 2},     {"bf16", 1, 2},    {"q4_0", 32, 18},  {"q4_1", 32, 20},
                                      {"q5_0", 32, 22},  {"q5_1", 32, 24},  {"q8_0", 32, 34},  {"q2_k", 256, 84}, {"q3_k", 256, 110},
                                      {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210}};

static void dequant_block(Format f, const uint8_t* b, float* y) {
    switch (f) {
        case F32: std::memcpy(y, b, 4); break;
        case F16: y[0] = get_half(b); break;
        case BF16: {
            const uint32_t bits = (uint32_t)(b[0] | (b[1] << 8)) << 16;
            std::memcpy(y, &bits, 4);
            break;
        }
        case Q5_0:
        case Q5_1: {
            const bool q5_1 = f == Q5_1;
            const float d = get_half(b), m = q5_1 ? get_half(b + 2) : 0.0f;
            uint32_t qh;
            std::memcpy(&qh, b + (q5_1 ? 4 : 2), 4);
            const uint8_t* qs = b + (q5_1 ? 8 : 6);
            for (int j = 0; j < 16; ++j) {
                const int xh_0 = ((qh >> j) << 4) & 0x10;
                const int xh_1 = (qh >> (j + 12)) & 0x10;
                const int x0 = ((qs[j] & 15) | xh_0) - (q5_1 ? 0 : 16);
                const int x1 = ((qs[j] >> 4) | xh_1) - (q5_1 ? 0 : 16);
                y[j] = q5_1 ? x0 * d + m : x0 * d;
                y[j + 16] = q5_1 ? x1 * d + m : x1 * d;
            }
            break;
        }
        case Q2_K: {
            const float d = get_half(b + 80), dmin = get_half(b + 82);
            const uint8_t* q = b + 16;
            int is = 0;
            for (int n = 0; n < 256; n += 128) {
                int shift = 0;
                for (int j = 0; j < 4; ++j) {
                    uint8_t sc = b[is++];
                    for (int l = 0; l < 16; ++l) y[n + 32 * j + l] = d * (sc & 15) * ((q[l] >> shift) & 3) - dmin * (sc >> 4);
                    sc = b[is++];
                    for (int l = 0; l < 16; ++l) y[n + 32 * j + 16 + l] = d * (sc & 15) * ((q[l + 16] >> shift) & 3) - dmin * (sc >> 4);
                    shift += 2;
                }
                q += 32;
            }
            break;
        }
        case Q3_K: {
            const float d = get_half(b + 108);
            const uint8_t* hm = b;
            const uint8_t* q = b + 32;
            uint32_t aux[4];
            std::memcpy(aux, b + 96, 12);
            const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
            aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
            aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
            aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
            const int8_t* scales = (const int8_t*)aux;
            int is = 0;
            uint8_t m = 1;
            for (int n = 0; n < 256; n += 128) {
                int shift = 0;
                for (int j = 0; j < 4; ++j) {
                    float dl = d * (scales[is++] - 32);
                    for (int l = 0; l < 16; ++l) y[n + 32 * j + l] = dl * ((int8_t)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                    dl = d * (scales[is++] - 32);
                    for (int l = 0; l < 16; ++l) y[n + 32 * j + 16 + l] = dl * ((int8_t)((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
                    shift += 2;
                    m <<= 1;
                }
                q += 32;
            }
            break;
        }
        case Q5_K: {
            const float d = get_half(b), dmin = get_half(b + 2);
            const uint8_t* scales = b + 4;
            const uint8_t* qh = b + 16;
            const uint8_t* ql = b + 48;
            uint8_t u1 = 1, u2 = 2;
            for (int chunk = 0; chunk < 4; ++chunk) {
                int sc[2], mn[2];
                for (int half = 0; half < 2; ++half) {
                    const int j = 2 * chunk + half;
                    if (j < 4) {
                        sc[half] = scales[j] & 63;
                        mn[half] = scales[j + 4] & 63;
                    } else {
                        sc[half] = (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4);
                        mn[half] = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
                    }
                }
                for (int l = 0; l < 32; ++l) y[64 * chunk + l] = d * sc[0] * ((ql[l] & 15) + ((qh[l] & u1) ? 16 : 0)) - dmin * mn[0];
                for (int l = 0; l < 32; ++l) y[64 * chunk + 32 + l] = d * sc[1] * ((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - dmin * mn[1];
                ql += 32;
                u1 <<= 2;
                u2 <<= 2;
            }
            break;
        }
        case Q4_0: {
            const float d = get_half(b);
            for (int j = 0; j < 16; ++j) {
                y[j] = ((b[2 + j] & 15) - 8) * d;
                y[j + 16] = ((b[2 + j] >> 4) - 8) * d;
            }
            break;
        }
        case Q4_1: {
            const float d = get_half(b), m = get_half(b + 2);
            for (int j = 0; j < 16; ++j) {
                y[j] = (b[4 + j] & 15) * d + m;
                y[j + 16] = (b[4 + j] >> 4) * d + m;
            }
            break;
        }
        case Q8_0: {
            const float d = get_half(b);
            for (int j = 0; j < 32; ++j) y[j] = (int8_t)b[2 + j] * d;
            break;
        }
        case Q4_K: {
            const float d = get_half(b), dmin = get_half(b + 2);
            const uint8_t* scales = b + 4;
            const uint8_t* q = b + 16;
            for (int chunk = 0; chunk < 4; ++chunk) {
                for (int half = 0; half < 2; ++half) {
                    const int j = 2 * chunk + half;
                    int sc, m;
                    if (j < 4) {
                        sc = scales[j] & 63;
                        m = scales[j + 4] & 63;
                    } else {
                        sc = (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4);
                        m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
                    }
                    for (int l = 0; l < 32; ++l) {
                        const int nib = half ? (q[32 * chunk + l] >> 4) : (q[32 * chunk + l] & 15);
                        y[64 * chunk + 32 * half + l] = d * sc * nib - dmin * m;
                    }
                }
            }
            break;
        }
        case Q6_K: {
            const float d = get_half(b + 208);
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            const int8_t* sc = (const int8_t*)(b + 192);
            for (int n = 0; n < 256; n += 128) {
                for (int l = 0; l < 32; ++l) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[n + l] = d * sc[is] * q1;
                    y[n + l + 32] = d * sc[is + 2] * q2;
                    y[n + l + 64] = d * sc[is + 4] * q3;
                    y[n + l + 96] = d * sc[is + 6] * q4;
                }
                ql += 64;
                qh += 32;
                sc += 8;
            }
            break;
        }
    }
}

// Random row-major matrix of n_rows x n_cols in format f, with sane scales.
static std::vector<uint8_t> random_matrix(Format f, int n_rows, int n_cols) {
    const FormatInfo& info = FORMATS[f];
    const size_t blocks = (size_t)n_rows * n_cols / info.block_values;
    std::vector<uint8_t> data(blocks * info.block_bytes);
    for (auto& byte : data) byte = (uint8_t)(g_rng() & 0xff);
    for (size_t i = 0; i < blocks; ++i) {
        uint8_t* b = data.data() + i * info.block_bytes;
        switch (f) {
            case F32: {
                const float v = uniform(-1, 1);
                std::memcpy(b, &v, 4);
                break;
            }
            case F16: put_half(b, uniform(-1, 1)); break;
            case BF16: {
                const float v = uniform(-1, 1);
                uint32_t bits;
                std::memcpy(&bits, &v, 4);
                b[0] = (bits >> 16) & 0xff;
                b[1] = bits >> 24;
                break;
            }
            case Q4_0:
            case Q5_0:
            case Q8_0: put_half(b, uniform(0.001f, 0.05f)); break;
            case Q4_1:
            case Q5_1:
                put_half(b, uniform(0.001f, 0.05f));
                put_half(b + 2, uniform(-0.2f, 0.2f));
                break;
            case Q2_K:
                put_half(b + 80, uniform(0.0005f, 0.01f));
                put_half(b + 82, uniform(0.0005f, 0.01f));
                break;
            case Q3_K: put_half(b + 108, uniform(0.0005f, 0.01f)); break;
            case Q5_K:
            case Q4_K:
                put_half(b, uniform(0.0005f, 0.01f));
                put_half(b + 2, uniform(0.0005f, 0.01f));
                break;
            case Q6_K: put_half(b + 208, uniform(0.0005f, 0.01f)); break;
        }
    }
    return data;
}

static std::vector<float> dequant_row(Format f, const uint8_t* row, int n_cols) {
    const FormatInfo& info = FORMATS[f];
    std::vector<float> y(n_cols);
    for (int b = 0; b < n_cols / info.block_values; ++b) dequant_block(f, row + (size_t)b * info.block_bytes, y.data() + (size_t)b * info.block_values);
    return y;
}

typedef void (*DequantizeKernel)(ember_half*, const uint8_t*, uint32_t);

static void test_dequantize() {
    // Indexed by Format; f32 and f16 weights need no expansion.
    const DequantizeKernel kernels[] = {nullptr,
                                        nullptr,
                                        ember_dequantize_f16_bf16,
                                        ember_dequantize_f16_q4_0,
                                        ember_dequantize_f16_q4_1,
                                        ember_dequantize_f16_q5_0,
                                        ember_dequantize_f16_q5_1,
                                        ember_dequantize_f16_q8_0,
                                        ember_dequantize_f16_q2_k,
                                        ember_dequantize_f16_q3_k,
                                        ember_dequantize_f16_q4_k,
                                        ember_dequantize_f16_q5_k,
                                        ember_dequantize_f16_q6_k};
    for (int fi = BF16; fi <= Q6_K; ++fi) {
        const Format f = (Format)fi;
        const int n_rows = 9, n_cols = 512;
        const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
        DeviceBuffer<uint8_t> dw(w);
        DeviceBuffer<uint16_t> dout((size_t)n_rows * n_cols);
        kernels[fi]<<<n_rows, 256>>>((ember_half*)dout.ptr, dw.ptr, n_cols);
        sync();
        const std::vector<uint16_t> out = dout.download();
        const size_t row_bytes = (size_t)n_cols / FORMATS[f].block_values * FORMATS[f].block_bytes;
        double worst = 0.0;
        for (int r = 0; r < n_rows; ++r) {
            const std::vector<float> row = dequant_row(f, w.data() + r * row_bytes, n_cols);
            for (int c = 0; c < n_cols; ++c) {
                // f16 rounding: half an ulp is 2^-11 of the value, plus the 2e-6 of multiply-add fusion.
                const double error = std::fabs((double)from_half_bits(out[(size_t)r * n_cols + c]) - row[c]);
                worst = std::fmax(worst, error / (std::fabs(row[c]) * std::ldexp(1.0, -11) + 2e-6));
            }
        }
        report(std::string("dequantize_f16_") + FORMATS[f].name + " (in units of f16 rounding)", worst, 1.0);
    }
}

static void test_kv_store() {
    const uint32_t n_tokens = 6, row_values = 2 * 128, n_slots = 64;
    const std::vector<float> src = random_floats(n_tokens * row_values);
    const std::vector<int32_t> slots = {17, 3, -1, 40, 63, 0};
    DeviceBuffer<float> dsrc(src), cache32(n_slots * row_values);
    DeviceBuffer<uint16_t> cache16(n_slots * row_values);
    DeviceBuffer<int32_t> dslots(slots);
    CHECK_CUDA(cudaMemset(cache32.ptr, 0, n_slots * row_values * sizeof(float)));
    CHECK_CUDA(cudaMemset(cache16.ptr, 0, n_slots * row_values * sizeof(uint16_t)));
    ember_kv_store_f32<<<n_tokens, 256>>>(cache32.ptr, dsrc.ptr, dslots.ptr, row_values);
    ember_kv_store_f16<<<n_tokens, 256>>>((ember_half*)cache16.ptr, dsrc.ptr, dslots.ptr, row_values);
    sync();
    std::vector<double> expected32(n_slots * row_values, 0.0), expected16(n_slots * row_values, 0.0);
    for (uint32_t t = 0; t < n_tokens; ++t) {
        if (slots[t] < 0) continue;
        for (uint32_t i = 0; i < row_values; ++i) {
            expected32[slots[t] * row_values + i] = src[t * row_values + i];
            expected16[slots[t] * row_values + i] = from_half_bits(to_half_bits(src[t * row_values + i]));
        }
    }
    report("kv_store_f32 (padding skipped)", max_abs_diff(cache32.download(), expected32), 0.0);
    const std::vector<uint16_t> bits = cache16.download();
    std::vector<float> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) values[i] = from_half_bits(bits[i]);
    report("kv_store_f16 (padding skipped)", max_abs_diff(values, expected16), 0.0);
}

typedef void (*MatvecKernel)(float*, const uint8_t*, const float*, uint32_t, uint32_t);
typedef void (*GetRowsKernel)(float*, const uint8_t*, const int32_t*, uint32_t);
static const MatvecKernel MATVEC[] = {ember_matvec_f32,  ember_matvec_f16,  ember_matvec_bf16, ember_matvec_q4_0, ember_matvec_q4_1,
                                      ember_matvec_q5_0, ember_matvec_q5_1, ember_matvec_q8_0, ember_matvec_q2_k, ember_matvec_q3_k,
                                      ember_matvec_q4_k, ember_matvec_q5_k, ember_matvec_q6_k};
static const GetRowsKernel GET_ROWS[] = {ember_get_rows_f32,  ember_get_rows_f16,  ember_get_rows_bf16, ember_get_rows_q4_0, ember_get_rows_q4_1,
                                         ember_get_rows_q5_0, ember_get_rows_q5_1, ember_get_rows_q8_0, ember_get_rows_q2_k, ember_get_rows_q3_k,
                                         ember_get_rows_q4_k, ember_get_rows_q5_k, ember_get_rows_q6_k};

static void test_quant_formats() {
    for (int fi = 0; fi <= Q6_K; ++fi) {
        const Format f = (Format)fi;
        const int n_rows = 67, n_cols = 1024;
        const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
        const std::vector<float> x = random_floats(n_cols);
        DeviceBuffer<uint8_t> dw(w);
        DeviceBuffer<float> dx(x), dy(n_rows);
        MATVEC[fi]<<<(n_rows + EMBER_MATVEC_ROWS_PER_BLOCK - 1) / EMBER_MATVEC_ROWS_PER_BLOCK, EMBER_MATVEC_ROWS_PER_BLOCK * EMBER_WAVE_SIZE>>>(dy.ptr, dw.ptr, dx.ptr, n_rows, n_cols);
        sync();
        const std::vector<float> y = dy.download();
        const size_t row_bytes = (size_t)n_cols / FORMATS[f].block_values * FORMATS[f].block_bytes;
        double worst = 0.0;
        for (int r = 0; r < n_rows; ++r) {
            const std::vector<float> row = dequant_row(f, w.data() + r * row_bytes, n_cols);
            double sum = 0.0, magnitude = 0.0;
            for (int c = 0; c < n_cols; ++c) {
                sum += (double)row[c] * x[c];
                magnitude += std::fabs((double)row[c] * x[c]);
            }
            worst = std::fmax(worst, std::fabs(y[r] - sum) / (magnitude + 1e-30));
        }
        report(std::string("matvec_") + FORMATS[f].name + " (relative to sum |w x|)", worst, 1e-5);

        const std::vector<int32_t> ids = {5, 0, 66, 5, 31};
        DeviceBuffer<int32_t> dids(ids);
        DeviceBuffer<float> dout(ids.size() * n_cols);
        GET_ROWS[fi]<<<(unsigned)ids.size(), 256>>>(dout.ptr, dw.ptr, dids.ptr, n_cols);
        sync();
        const std::vector<float> out = dout.download();
        double exact = 0.0;
        for (size_t t = 0; t < ids.size(); ++t) {
            const std::vector<float> row = dequant_row(f, w.data() + ids[t] * row_bytes, n_cols);
            for (int c = 0; c < n_cols; ++c) exact = std::fmax(exact, std::fabs((double)out[t * n_cols + c] - row[c]));
        }
        // The same f32 arithmetic on both sides, up to multiply-add fusion on the device.
        report(std::string("get_rows_") + FORMATS[f].name, exact, 2e-6);
    }
}

static void test_elementwise() {
    const uint32_t n = 10000, n_b = 100;
    const std::vector<float> a = random_floats(n, -4, 4), b = random_floats(n, -4, 4), bb = random_floats(n_b);
    DeviceBuffer<float> da(a), db(b), dbb(bb), dout(n);
    std::vector<double> expected(n);

    ember_add_f32<<<40, 256>>>(dout.ptr, da.ptr, dbb.ptr, n, n_b);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = (double)a[i] + bb[i % n_b];
    report("add_f32 (broadcast)", max_abs_diff(dout.download(), expected), 1e-6);

    ember_mul_f32<<<40, 256>>>(dout.ptr, da.ptr, db.ptr, n, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = (double)a[i] * b[i];
    report("mul_f32", max_abs_diff(dout.download(), expected), 1e-5);

    ember_scale_f32<<<40, 256>>>(dout.ptr, da.ptr, 0.125f, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = a[i] * 0.125;
    report("scale_f32", max_abs_diff(dout.download(), expected), 0.0);

    ember_silu_mul_f32<<<40, 256>>>(dout.ptr, da.ptr, db.ptr, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) expected[i] = a[i] / (1.0 + std::exp(-(double)a[i])) * b[i];
    report("silu_mul_f32", max_abs_diff(dout.download(), expected), 2e-5);

    ember_gelu_mul_f32<<<40, 256>>>(dout.ptr, da.ptr, db.ptr, n);
    sync();
    for (uint32_t i = 0; i < n; ++i) {
        const double g = a[i];
        expected[i] = 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * b[i];
    }
    report("gelu_mul_f32", max_abs_diff(dout.download(), expected), 2e-5);

    DeviceBuffer<uint32_t> fill(5000);
    ember_fill_u32<<<3, 128>>>(fill.ptr, 0x9e3779b9u, 5000);
    sync();
    uint32_t wrong = 0;
    for (uint32_t v : fill.download()) wrong += v != 0x9e3779b9u;
    report("fill_u32 (wrong words)", wrong, 0.0);
}

static void test_norm_softmax_argmax() {
    const uint32_t n_rows = 7, n_cols = 2304;
    const std::vector<float> x = random_floats(n_rows * n_cols, -3, 3), w = random_floats(n_cols);
    DeviceBuffer<float> dx(x), dw(w), dout(n_rows * n_cols);
    std::vector<double> expected(n_rows * n_cols);

    ember_rms_norm_f32<<<n_rows, 256>>>(dout.ptr, dx.ptr, dw.ptr, n_cols, 1e-6f);
    sync();
    for (uint32_t r = 0; r < n_rows; ++r) {
        double sum = 0.0;
        for (uint32_t c = 0; c < n_cols; ++c) sum += (double)x[r * n_cols + c] * x[r * n_cols + c];
        const double inv = 1.0 / std::sqrt(sum / n_cols + 1e-6);
        for (uint32_t c = 0; c < n_cols; ++c) expected[r * n_cols + c] = x[r * n_cols + c] * inv * w[c];
    }
    report("rms_norm_f32", max_abs_diff(dout.download(), expected), 1e-5);

    ember_softmax_f32<<<n_rows, 512>>>(dout.ptr, dx.ptr, n_cols, 0.7f);
    sync();
    for (uint32_t r = 0; r < n_rows; ++r) {
        double m = -INFINITY, sum = 0.0;
        for (uint32_t c = 0; c < n_cols; ++c) m = std::fmax(m, 0.7 * x[r * n_cols + c]);
        for (uint32_t c = 0; c < n_cols; ++c) sum += std::exp(0.7 * x[r * n_cols + c] - m);
        for (uint32_t c = 0; c < n_cols; ++c) expected[r * n_cols + c] = std::exp(0.7 * x[r * n_cols + c] - m) / sum;
    }
    report("softmax_f32", max_abs_diff(dout.download(), expected), 1e-6);

    std::vector<float> logits = random_floats(n_rows * 49152, -10, 10);
    logits[3 * 49152 + 777] = 50.0f;  // a tie: the lower index must win
    logits[3 * 49152 + 40000] = 50.0f;
    DeviceBuffer<float> dl(logits);
    DeviceBuffer<int32_t> didx(n_rows);
    ember_argmax_f32<<<n_rows, 1024>>>(didx.ptr, dl.ptr, 49152);
    sync();
    const std::vector<int32_t> idx = didx.download();
    uint32_t wrong = 0;
    for (uint32_t r = 0; r < n_rows; ++r) {
        int best = 0;
        for (int c = 1; c < 49152; ++c)
            if (logits[r * 49152 + c] > logits[r * 49152 + best]) best = c;
        wrong += idx[r] != best;
    }
    report("argmax_f32 (wrong rows, ties to lowest)", wrong, 0.0);
}

static void test_rope() {
    const uint32_t n_tokens = 5, n_heads = 4, head_dim = 128, rope_dim = 96;
    const std::vector<float> x = random_floats(n_tokens * n_heads * head_dim);
    const std::vector<int32_t> pos = {0, 1, 17, 1000, 32767};
    for (int neox = 0; neox < 2; ++neox) {
        DeviceBuffer<float> dx(x);
        DeviceBuffer<int32_t> dp(pos);
        if (neox) ember_rope_neox_f32<<<n_tokens * n_heads, rope_dim / 2>>>(dx.ptr, dp.ptr, n_heads, head_dim, rope_dim, 10000.0f, 1.0f);
        else ember_rope_norm_f32<<<n_tokens * n_heads, rope_dim / 2>>>(dx.ptr, dp.ptr, n_heads, head_dim, rope_dim, 10000.0f, 1.0f);
        sync();
        std::vector<double> expected(x.begin(), x.end());
        for (uint32_t t = 0; t < n_tokens; ++t)
            for (uint32_t h = 0; h < n_heads; ++h) {
                const size_t base = ((size_t)t * n_heads + h) * head_dim;
                for (uint32_t i = 0; i < rope_dim / 2; ++i) {
                    const double theta = pos[t] * std::pow(10000.0, -2.0 * i / rope_dim);
                    const size_t ia = neox ? base + i : base + 2 * i, ib = neox ? base + i + rope_dim / 2 : base + 2 * i + 1;
                    expected[ia] = x[ia] * std::cos(theta) - x[ib] * std::sin(theta);
                    expected[ib] = x[ia] * std::sin(theta) + x[ib] * std::cos(theta);
                }
            }
        // f32 theta at position 32767 carries ~2e-3 rad of rounding, as in any f32 implementation.
        report(neox ? "rope_neox_f32" : "rope_norm_f32", max_abs_diff(dx.download(), expected), 5e-3);
    }
}

template <typename KV>
static void test_attention(const char* name, uint32_t head_dim, int32_t window, float softcap) {
    const uint32_t n_seqs = 3, n_heads = 8, n_kv_heads = 2, block_size = 16, n_blocks = 160;
    const std::vector<int32_t> seq_lens = {1, 300, 700};
    const uint32_t max_blocks_per_seq = 48;
    // Blocks handed out in a scrambled order so the block table matters.
    std::vector<int32_t> free_blocks(n_blocks);
    for (uint32_t i = 0; i < n_blocks; ++i) free_blocks[i] = (int32_t)((i * 37) % n_blocks);
    std::vector<int32_t> table(n_seqs * max_blocks_per_seq, -1);
    uint32_t next = 0;
    for (uint32_t s = 0; s < n_seqs; ++s)
        for (uint32_t b = 0; b < (seq_lens[s] + block_size - 1) / block_size; ++b) table[s * max_blocks_per_seq + b] = free_blocks[next++];
    const size_t cache_values = (size_t)n_blocks * block_size * n_kv_heads * head_dim;
    std::vector<float> kf = random_floats(cache_values), vf = random_floats(cache_values);
    std::vector<KV> k(cache_values), v(cache_values);
    for (size_t i = 0; i < cache_values; ++i) {
        k[i] = (KV)kf[i];
        v[i] = (KV)vf[i];
        kf[i] = (float)k[i];  // the reference sees exactly the stored values
        vf[i] = (float)v[i];
    }
    const std::vector<float> q = random_floats(n_seqs * n_heads * head_dim, -2, 2);
    const float scale = 1.0f / std::sqrt((float)head_dim);
    const uint32_t max_partitions = (700 + EMBER_ATTN_PARTITION - 1) / EMBER_ATTN_PARTITION;
    DeviceBuffer<KV> dk(k), dv(v);
    DeviceBuffer<float> dq(q), dout(n_seqs * n_heads * head_dim);
    DeviceBuffer<float> acc(n_seqs * n_heads * max_partitions * head_dim), pmax(n_seqs * n_heads * max_partitions), psum(n_seqs * n_heads * max_partitions);
    DeviceBuffer<int32_t> dtable(table), dlens(seq_lens);
    dim3 grid(max_partitions, n_heads, n_seqs);
    if (sizeof(KV) == 2)
        ember_paged_attention_decode_partial_f16kv<<<grid, EMBER_ATTN_THREADS>>>(acc.ptr, pmax.ptr, psum.ptr, dq.ptr, (const ember_half*)dk.ptr, (const ember_half*)dv.ptr, dtable.ptr, dlens.ptr, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, max_partitions, scale, window, softcap);
    else
        ember_paged_attention_decode_partial_f32kv<<<grid, EMBER_ATTN_THREADS>>>(acc.ptr, pmax.ptr, psum.ptr, dq.ptr, (const float*)dk.ptr, (const float*)dv.ptr, dtable.ptr, dlens.ptr, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, max_partitions, scale, window, softcap);
    ember_paged_attention_decode_reduce<<<dim3(n_heads, n_seqs), 256>>>(dout.ptr, acc.ptr, pmax.ptr, psum.ptr, dlens.ptr, n_heads, head_dim, max_partitions, window);
    sync();
    std::vector<double> expected(n_seqs * n_heads * head_dim, 0.0);
    for (uint32_t s = 0; s < n_seqs; ++s)
        for (uint32_t h = 0; h < n_heads; ++h) {
            const uint32_t kvh = h / (n_heads / n_kv_heads);
            const int first = window > 0 && seq_lens[s] > window ? seq_lens[s] - window : 0;
            std::vector<double> scores;
            for (int t = first; t < seq_lens[s]; ++t) {
                const size_t slot = (size_t)table[s * max_blocks_per_seq + t / block_size] * block_size + t % block_size;
                double dot = 0.0;
                for (uint32_t d = 0; d < head_dim; ++d) dot += (double)q[(s * n_heads + h) * head_dim + d] * kf[(slot * n_kv_heads + kvh) * head_dim + d];
                dot *= scale;
                if (softcap > 0) dot = softcap * std::tanh(dot / softcap);
                scores.push_back(dot);
            }
            double m = -INFINITY, sum = 0.0;
            for (double sc : scores) m = std::fmax(m, sc);
            for (double& sc : scores) sum += (sc = std::exp(sc - m));
            for (int t = first; t < seq_lens[s]; ++t) {
                const size_t slot = (size_t)table[s * max_blocks_per_seq + t / block_size] * block_size + t % block_size;
                for (uint32_t d = 0; d < head_dim; ++d) expected[(s * n_heads + h) * head_dim + d] += scores[t - first] / sum * vf[(slot * n_kv_heads + kvh) * head_dim + d];
            }
        }
    report(name, max_abs_diff(dout.download(), expected), 1e-4);
}

static void benchmark_matvec(Format f, int n_rows, int n_cols) {
    const std::vector<uint8_t> w = random_matrix(f, n_rows, n_cols);
    DeviceBuffer<uint8_t> dw(w);
    DeviceBuffer<float> dx(random_floats(n_cols)), dy(n_rows);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    const unsigned blocks = (n_rows + EMBER_MATVEC_ROWS_PER_BLOCK - 1) / EMBER_MATVEC_ROWS_PER_BLOCK;
    for (int i = 0; i < 3; ++i) MATVEC[f]<<<blocks, EMBER_MATVEC_ROWS_PER_BLOCK * EMBER_WAVE_SIZE>>>(dy.ptr, dw.ptr, dx.ptr, n_rows, n_cols);
    const int iterations = 50;
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < iterations; ++i) MATVEC[f]<<<blocks, EMBER_MATVEC_ROWS_PER_BLOCK * EMBER_WAVE_SIZE>>>(dy.ptr, dw.ptr, dx.ptr, n_rows, n_cols);
    CHECK_CUDA(cudaEventRecord(stop));
    sync();
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    const double seconds = ms / 1000.0 / iterations;
    std::printf("INFO matvec_%s %dx%d: %.1f us, %.0f GB/s of weights\n", FORMATS[f].name, n_rows, n_cols, seconds * 1e6, w.size() / seconds / 1e9);
}

int main() {
    test_elementwise();
    test_norm_softmax_argmax();
    test_rope();
    test_quant_formats();
    test_dequantize();
    test_kv_store();
    test_attention<float>("paged_attention f32 kv, d=128", 128, 0, 0.0f);
    test_attention<__half>("paged_attention f16 kv, d=256", 256, 0, 0.0f);
    test_attention<__half>("paged_attention f16 kv, d=64, window 100", 64, 100, 0.0f);
    test_attention<float>("paged_attention f32 kv, d=80, softcap 50", 80, 0, 50.0f);
    benchmark_matvec(Q4_0, 14336, 4096);
    benchmark_matvec(Q4_K, 14336, 4096);
    benchmark_matvec(Q6_K, 14336, 4096);
    benchmark_matvec(Q8_0, 14336, 4096);
    benchmark_matvec(F16, 14336, 4096);
    std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    return g_failures ? 1 : 0;
}
