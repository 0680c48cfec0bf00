// Memory helpers. ember_fill_u32 is the VMM probe's "touch with a kernel": it writes every word
// of a freshly mapped range from the device, which is where a broken mapping faults.
#include "ember_compat.h"

// Equivalent CPU op: `dst[..count].fill(value)`. Grid-stride loop, any launch size.
EMBER_KERNEL void ember_fill_u32(uint32_t* dst, uint32_t value, uint64_t count) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) dst[i] = value;
}
