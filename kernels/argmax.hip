// Greedy sampling: the index of the largest logit of each row.
#include "ember_compat.h"

// CPU op (argmax_rows): out[r] = the smallest c with x[r, c] == max_c x[r, c] (ties go to the
// lowest index; -inf is never chosen, and a row of -inf gives 0), or -1 for a row holding NaN or
// +inf (logits nobody should sample from; the engine fails that sequence). One block per row,
// block size a multiple of the warp size, at most 1024.
EMBER_KERNEL void ember_argmax_f32(int32_t* out, const float* x, uint32_t n_cols) {
    __shared__ float best_values[EMBER_MAX_WARPS];
    __shared__ int best_indices[EMBER_MAX_WARPS];
    __shared__ int bad_rows[EMBER_MAX_WARPS];
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float best = -INFINITY;
    int best_index = 0x7fffffff;
    int bad = 0;
    for (uint32_t c = threadIdx.x; c < n_cols; c += blockDim.x) {
        const float v = row[c];
        bad |= !(v < INFINITY);  // NaN or +inf
        // Strides visit c in increasing order, so a tie never replaces; -inf never enters.
        if (v > best) {
            best = v;
            best_index = (int)c;
        }
    }
    for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
        const float other = ember_shfl_xor(best, mask);
        const int other_index = ember_shfl_xor_int(best_index, mask);
        if (other > best || (other == best && other_index < best_index)) {
            best = other;
            best_index = other_index;
        }
        bad |= ember_shfl_xor_int(bad, mask);
    }
    const int lane = threadIdx.x % EMBER_WAVE_SIZE, warp = threadIdx.x / EMBER_WAVE_SIZE;
    if (lane == 0) {
        best_values[warp] = best;
        best_indices[warp] = best_index;
        bad_rows[warp] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n_warps = (blockDim.x + EMBER_WAVE_SIZE - 1) / EMBER_WAVE_SIZE;
        float b = best_values[0];
        int bi = best_indices[0];
        int any_bad = bad_rows[0];
        for (int w = 1; w < n_warps; ++w) {
            any_bad |= bad_rows[w];
            if (best_values[w] > b || (best_values[w] == b && best_indices[w] < bi)) {
                b = best_values[w];
                bi = best_indices[w];
            }
        }
        out[blockIdx.x] = any_bad ? -1 : bi == 0x7fffffff ? 0 : bi;
    }
}
