// Exactly rounded arithmetic for the reference-numerics kernels (exact_elementwise.hip,
// exact_matmul.hip, exact_attention.hip): the one set of ex_* helpers they share.
//
// Every floating-point operation of a bit-exact kernel goes through these helpers, never a bare
// operator, so the compiler cannot contract a multiply and an add into an FMA (nvcc does by
// default, clang for HIP too), reassociate, or use an approximate division or square root; an
// FMA is written only where the CPU's code calls mul_add (or its SIMD kernel an FMA).
//
// HIP's __fadd_rn & co. are plain operators (contractible under clang's default
// -ffp-contract=fast-honor-pragmas) and its __fsqrt_rn is the approximate native square root, so
// under HIP the helpers are plain operators compiled with contraction off, and the square root
// and FMAs are the correctly rounded builtins. The pragma below covers the helpers; every file
// that includes this header repeats it after the include, so that its own code is compiled with
// contraction off whatever clang does with a pragma's scope at the end of a header. Under nvcc
// the _rn intrinsics are documented never to be merged into an FMA, and __fdiv_rn / __fsqrt_rn
// are IEEE round-to-nearest. Denormals are kept (neither nvcc nor clang flush f32 denormals by
// default for these targets), as on the CPU.
#pragma once
#include "ember_compat.h"

#if defined(EMBER_PLATFORM_HIP)
#pragma clang fp contract(off)
EMBER_DEVICE float ex_add(float a, float b) { return a + b; }
EMBER_DEVICE float ex_sub(float a, float b) { return a - b; }
EMBER_DEVICE float ex_mul(float a, float b) { return a * b; }
EMBER_DEVICE float ex_div(float a, float b) { return a / b; }
EMBER_DEVICE float ex_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
EMBER_DEVICE float ex_sqrt(float a) { return __builtin_sqrtf(a); }
EMBER_DEVICE double ex_dadd(double a, double b) { return a + b; }
EMBER_DEVICE double ex_dsub(double a, double b) { return a - b; }
EMBER_DEVICE double ex_dmul(double a, double b) { return a * b; }
EMBER_DEVICE double ex_ddiv(double a, double b) { return a / b; }
EMBER_DEVICE double ex_dfma(double a, double b, double c) { return __builtin_fma(a, b, c); }
EMBER_DEVICE float ex_d2f(double a) { return (float)a; }
#else
EMBER_DEVICE float ex_add(float a, float b) { return __fadd_rn(a, b); }
EMBER_DEVICE float ex_sub(float a, float b) { return __fsub_rn(a, b); }
EMBER_DEVICE float ex_mul(float a, float b) { return __fmul_rn(a, b); }
EMBER_DEVICE float ex_div(float a, float b) { return __fdiv_rn(a, b); }
EMBER_DEVICE float ex_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
EMBER_DEVICE float ex_sqrt(float a) { return __fsqrt_rn(a); }
EMBER_DEVICE double ex_dadd(double a, double b) { return __dadd_rn(a, b); }
EMBER_DEVICE double ex_dsub(double a, double b) { return __dsub_rn(a, b); }
EMBER_DEVICE double ex_dmul(double a, double b) { return __dmul_rn(a, b); }
EMBER_DEVICE double ex_ddiv(double a, double b) { return __ddiv_rn(a, b); }
EMBER_DEVICE double ex_dfma(double a, double b, double c) { return __fma_rn(a, b, c); }
EMBER_DEVICE float ex_d2f(double a) { return __double2float_rn(a); }
#endif

// f32 -> double is exact; written out for symmetry with ex_d2f.
EMBER_DEVICE double ex_f2d(float a) { return (double)a; }

// Rust's f32::max: the other operand when one is NaN (fmaxf's rule too).
EMBER_DEVICE float ex_max(float a, float b) { return fmaxf(a, b); }

// ---- f16 ----

// A little-endian IEEE half at a byte address (any alignment), widened exactly.
EMBER_DEVICE float ex_half_at(const uint8_t* p) { return ember_load_half(p); }

// f16 bits as f32 (exact).
EMBER_DEVICE float ex_half_bits(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// f32 rounded to the nearest f16 (ties to even), as bits: half::f16::from_f32, F16C's
// vcvtps2ph with round-to-nearest, GGML_FP32_TO_FP16.
EMBER_DEVICE uint16_t ex_f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

// The same rounding, widened back to f32 (exact): half::f16::from_f32(x).to_f32().
EMBER_DEVICE float ex_round_f16(float x) { return __half2float(__float2half_rn(x)); }

// ---- GGML's vectorised expf (engine/src/backend/cpu/vec.rs expf_ggml) ----

// e^x as GGML's `ggml_v_expf`, operation for operation: a degree-5 polynomial of the reduced
// argument, scaled by 2^n with one rounding (the product j * 2^n is exact in f64, then rounded
// to f32).
EMBER_DEVICE float ex_expf_ggml(float x) {
    const float shift = 12582912.0f;                  // 0x1.8p23
    const float log2e = __uint_as_float(0x3fb8aa3bu);   // 0x1.715476p+0
    const float ln2_hi = __uint_as_float(0x3f317200u);  // 0x1.62e4p-1
    const float ln2_lo = __uint_as_float(0x35bfbe8eu);  // 0x1.7f7d1cp-20
    const float c4 = __uint_as_float(0x3c072010u);      // 0x1.0e4020p-7
    const float c3 = __uint_as_float(0x3d2b9f17u);      // 0x1.573e2ep-5
    const float c2 = __uint_as_float(0x3e2aaf33u);      // 0x1.555e66p-3
    const float c1 = __uint_as_float(0x3efffedbu);      // 0x1.fffdb6p-2
    const float c0 = __uint_as_float(0x3f7ffff6u);      // 0x1.ffffecp-1
    const float z = ex_fma(x, log2e, shift);
    const float n = ex_sub(z, shift);
    const float b = ex_fma(-n, ln2_lo, ex_fma(-n, ln2_hi, x));
    const float u = ex_mul(b, b);
    const float j = ex_fma(ex_fma(ex_fma(c4, b, c3), u, ex_fma(c2, b, c1)), u, ex_fma(c0, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : __uint_as_float(0x7f800000u);
    // Rust's `n as i64` is 0 for NaN (then j is NaN too and so is the result); n is an integer
    // in [-192, 192] otherwise.
    const long long e = n == n ? (long long)n : 0;
    const double pow2 = __longlong_as_double((e + 1023) << 52);
    return ex_d2f(ex_dmul(ex_f2d(j), pow2));
}
