// Greedy sampling: the index of the largest logit of each row.
//
// CPU op (argmax_rows): out[r] = the smallest c with x[r, c] == max_c x[r, c] (ties go to the
// lowest index; -inf is never chosen, and a row of -inf gives 0), or -1 for a row holding NaN or
// +inf (logits nobody should sample from; the engine fails that sequence).
//
// Two launches: ember_argmax_partial_f32 splits each row into parts of EMBER_ARGMAX_PART values,
// one block each, so that a vocabulary of 150,000 logits is read by about 150 blocks at once
// instead of by one block (which took about 60 us on an H100, on the critical path of every
// decode step); ember_argmax_merge_f32 then picks each row's winner among its parts. Every
// comparison is on (value, index) pairs, larger value first, then smaller index, so the result
// is the same whatever the split.
#include "ember_compat.h"

#define EMBER_ARGMAX_PART 1024

// Reduces the block's (best, best_index, bad) triples; thread 0 gets the result. Block size a
// multiple of the warp size, at most EMBER_MAX_BLOCK.
EMBER_DEVICE void ember_argmax_block(float* best, int* best_index, int* bad) {
    __shared__ float best_values[EMBER_MAX_WARPS];
    __shared__ int best_indices[EMBER_MAX_WARPS];
    __shared__ int bad_parts[EMBER_MAX_WARPS];
    float b = *best;
    int bi = *best_index, any_bad = *bad;
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
        const float other = ember_shfl_xor(b, mask);
        const int other_index = ember_shfl_xor_int(bi, mask);
        if (other > b || (other == b && other_index < bi)) {
            b = other;
            bi = other_index;
        }
        any_bad |= ember_shfl_xor_int(any_bad, mask);
    }
    const int lane = threadIdx.x % EMBER_WAVE_SIZE, warp = threadIdx.x / EMBER_WAVE_SIZE;
    if (lane == 0) {
        best_values[warp] = b;
        best_indices[warp] = bi;
        bad_parts[warp] = any_bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n_warps = (blockDim.x + EMBER_WAVE_SIZE - 1) / EMBER_WAVE_SIZE;
        for (int w = 1; w < n_warps; ++w) {
            any_bad |= bad_parts[w];
            if (best_values[w] > b || (best_values[w] == b && best_indices[w] < bi)) {
                b = best_values[w];
                bi = best_indices[w];
            }
        }
        *best = b;
        *best_index = bi;
        *bad = any_bad;
    }
}

// Block (r, p): values p * EMBER_ARGMAX_PART .. of row r (n_cols per row). Writes
// part_values[r * gridDim.y + p] and part_indices[same]: the part's largest value and its
// smallest index (0x7fffffff when the part holds only -inf), or index -1 when the part holds
// NaN or +inf. Launch: grid (n_rows, ceil(n_cols / EMBER_ARGMAX_PART)), block a multiple of
// the warp size, at most 1024.
EMBER_KERNEL void ember_argmax_partial_f32(float* part_values, int32_t* part_indices, const float* x, uint32_t n_cols) {
    const float* row = x + (size_t)blockIdx.x * n_cols;
    const uint32_t begin = blockIdx.y * EMBER_ARGMAX_PART;
    const uint32_t end = min(begin + EMBER_ARGMAX_PART, n_cols);
    float best = -INFINITY;
    int best_index = 0x7fffffff;
    int bad = 0;
    for (uint32_t c = begin + threadIdx.x; c < end; c += blockDim.x) {
        const float v = row[c];
        bad |= !(v < INFINITY);  // NaN or +inf
        // Strides visit c in increasing order, so a tie never replaces; -inf never enters.
        if (v > best) {
            best = v;
            best_index = (int)c;
        }
    }
    ember_argmax_block(&best, &best_index, &bad);
    if (threadIdx.x == 0) {
        const size_t at = (size_t)blockIdx.x * gridDim.y + blockIdx.y;
        part_values[at] = best;
        part_indices[at] = bad ? -1 : best_index;
    }
}

// Block r: out[r] from row r's n_parts parts (as ember_argmax_partial_f32 wrote them). Launch:
// grid n_rows, block a multiple of the warp size, at most 1024.
EMBER_KERNEL void ember_argmax_merge_f32(int32_t* out, const float* part_values, const int32_t* part_indices, uint32_t n_parts) {
    const size_t base = (size_t)blockIdx.x * n_parts;
    float best = -INFINITY;
    int best_index = 0x7fffffff;
    int bad = 0;
    for (uint32_t p = threadIdx.x; p < n_parts; p += blockDim.x) {
        const float v = part_values[base + p];
        const int i = part_indices[base + p];
        if (i < 0) {
            bad = 1;
        } else if (v > best || (v == best && i < best_index)) {
            best = v;
            best_index = i;
        }
    }
    ember_argmax_block(&best, &best_index, &bad);
    if (threadIdx.x == 0) out[blockIdx.x] = bad ? -1 : best_index == 0x7fffffff ? 0 : best_index;
}
