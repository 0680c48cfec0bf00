// ember_compat.h: the portability header every kernel in kernels/ includes first.
//
// The kernels are written once in HIP C++ and compiled two ways:
//   * clang/hipcc for AMD targets (-x hip --offload-arch=gfxNNNN), where HIP's headers define
//     __HIP_PLATFORM_AMD__ and the wavefront is 32 or 64 lanes (xtask passes -DEMBER_WAVE_SIZE);
//   * nvcc for NVIDIA targets (-x cu), where a warp is always 32 lanes.
// This header hides the differences: the runtime header, half precision, warp shuffles and the
// kernel linkage, so that kernel sources never test the platform themselves.
#pragma once

#if defined(__HIP__) || defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#define EMBER_PLATFORM_HIP 1
#elif defined(__CUDACC__)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#define EMBER_PLATFORM_CUDA 1
#else
#error "ember kernels must be compiled as HIP (clang/hipcc) or CUDA (nvcc)"
#endif

#include <stdint.h>

// Lanes per warp (NVIDIA) or wavefront (AMD). xtask passes it per target; when absent, take the
// compiler's value on AMD and 32 on NVIDIA.
#ifndef EMBER_WAVE_SIZE
#if defined(EMBER_PLATFORM_CUDA)
#define EMBER_WAVE_SIZE 32
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define EMBER_WAVE_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define EMBER_WAVE_SIZE 64
#endif
#endif

#if EMBER_WAVE_SIZE != 32 && EMBER_WAVE_SIZE != 64
#error "EMBER_WAVE_SIZE must be 32 or 64"
#endif

#if defined(EMBER_PLATFORM_CUDA) && EMBER_WAVE_SIZE != 32
#error "NVIDIA warps are 32 lanes"
#endif

// Every exported kernel has C linkage so the driver finds it by its plain name.
#define EMBER_KERNEL extern "C" __global__
#define EMBER_DEVICE static __device__ __forceinline__

typedef __half ember_half;

EMBER_DEVICE float ember_half_to_float(ember_half h) { return __half2float(h); }

// Reads a little-endian IEEE half from a byte address that is only 2-byte aligned.
EMBER_DEVICE float ember_load_half(const uint8_t* p) {
    const unsigned short bits = (unsigned short)(p[0] | (p[1] << 8));
    return __half2float(__ushort_as_half(bits));
}

EMBER_DEVICE float ember_shfl_xor(float value, int lane_mask) {
#if defined(EMBER_PLATFORM_CUDA)
    return __shfl_xor_sync(0xffffffffu, value, lane_mask, 32);
#else
    return __shfl_xor(value, lane_mask, EMBER_WAVE_SIZE);
#endif
}

EMBER_DEVICE int ember_shfl_xor_int(int value, int lane_mask) {
#if defined(EMBER_PLATFORM_CUDA)
    return __shfl_xor_sync(0xffffffffu, value, lane_mask, 32);
#else
    return __shfl_xor(value, lane_mask, EMBER_WAVE_SIZE);
#endif
}

// Sum over the lanes of one warp; every lane gets the result.
EMBER_DEVICE float ember_warp_sum(float value) {
#pragma unroll
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) value += ember_shfl_xor(value, mask);
    return value;
}

EMBER_DEVICE float ember_warp_max(float value) {
#pragma unroll
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) value = fmaxf(value, ember_shfl_xor(value, mask));
    return value;
}

// Largest block size any kernel here launches with; sizes the reduction scratch.
#define EMBER_MAX_BLOCK 1024
#define EMBER_MAX_WARPS (EMBER_MAX_BLOCK / 32)

// Sum over the whole block; every thread gets the result. `scratch` is __shared__ float[EMBER_MAX_WARPS].
EMBER_DEVICE float ember_block_sum(float value, float* scratch) {
    const int lane = threadIdx.x % EMBER_WAVE_SIZE;
    const int warp = threadIdx.x / EMBER_WAVE_SIZE;
    const int n_warps = (blockDim.x + EMBER_WAVE_SIZE - 1) / EMBER_WAVE_SIZE;
    value = ember_warp_sum(value);
    __syncthreads();
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    value = lane < n_warps ? scratch[lane] : 0.0f;
    return ember_warp_sum(value);
}

EMBER_DEVICE float ember_block_max(float value, float* scratch) {
    const int lane = threadIdx.x % EMBER_WAVE_SIZE;
    const int warp = threadIdx.x / EMBER_WAVE_SIZE;
    const int n_warps = (blockDim.x + EMBER_WAVE_SIZE - 1) / EMBER_WAVE_SIZE;
    value = ember_warp_max(value);
    __syncthreads();
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    value = lane < n_warps ? scratch[lane] : -INFINITY;
    return ember_warp_max(value);
}
