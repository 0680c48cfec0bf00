// Mixture-of-experts routing and combination on the device (the products themselves are
// matvec.hip's ember_moe_matvec_*): per token, the experts and their weights from the router
// logits; the (token, rank) pairs sorted by expert and cut into tiles for the grouped products;
// the weighted sum of each token's expert outputs; the per-token gate of a shared expert.
// Everything stays on the device: no host synchronisation, so a decode step that routes can be
// captured in a graph. The CPU backend's engine/src/backend/cpu/moe.rs is the definition.
#include "ember_compat.h"

// Most experts a layer may have here (the chosen set is a bit mask of this many bits).
#define EMBER_MOE_MAX_EXPERTS 512

// CPU op: route_token for each token. experts, weights: [n_tokens, n_used]; logits: [n_tokens,
// n_expert]. gating 0: softmax over the experts; 1: a sigmoid per expert. The n_used most
// probable experts in descending order (ties to the lower index), their probabilities as weights,
// divided by their sum (clamped below at 2^-14) when `normalize`, then times `scale`. One warp
// per token: lane l holds the probabilities of experts l, l + W, ... in registers, and each rank
// is a warp-wide arg-max over the experts not yet chosen. Launch: block a multiple of the warp
// size, grid covering n_tokens warps.
#define EMBER_MOE_PER_LANE (EMBER_MOE_MAX_EXPERTS / EMBER_WAVE_SIZE)
EMBER_KERNEL void ember_moe_route_f32(int32_t* experts, float* weights, const float* logits, uint32_t n_tokens,
                                      uint32_t n_expert, uint32_t n_used, uint32_t gating, uint32_t normalize,
                                      float scale) {
    const uint32_t lane = threadIdx.x % EMBER_WAVE_SIZE;
    const uint32_t t = (blockIdx.x * blockDim.x + threadIdx.x) / EMBER_WAVE_SIZE;
    if (t >= n_tokens) return;  // whole warps leave together
    const float* l = logits + (size_t)t * n_expert;
    float p[EMBER_MOE_PER_LANE];
    float max = -INFINITY;
#pragma unroll
    for (int i = 0; i < EMBER_MOE_PER_LANE; ++i) {
        const uint32_t e = lane + i * EMBER_WAVE_SIZE;
        p[i] = e < n_expert ? l[e] : -INFINITY;
        max = fmaxf(max, p[i]);
    }
    if (gating == 0) {
        max = ember_warp_max(max);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < EMBER_MOE_PER_LANE; ++i) {
            const uint32_t e = lane + i * EMBER_WAVE_SIZE;
            p[i] = e < n_expert ? expf(p[i] - max) : 0.0f;
            sum += p[i];
        }
        const float inv = 1.0f / ember_warp_sum(sum);
#pragma unroll
        for (int i = 0; i < EMBER_MOE_PER_LANE; ++i) p[i] = __fmul_rn(p[i], inv);
    } else {
#pragma unroll
        for (int i = 0; i < EMBER_MOE_PER_LANE; ++i) {
            const uint32_t e = lane + i * EMBER_WAVE_SIZE;
            p[i] = e < n_expert ? 1.0f / (1.0f + expf(-p[i])) : -INFINITY;
        }
    }
    // Chosen experts drop out of later ranks: their register becomes NaN, which never compares
    // greater. Unused registers hold -inf (sigmoid) or 0 (softmax, past n_expert): they lose to
    // every real expert on index, as they come after all of them.
    float total = 0.0f;
    for (uint32_t k = 0; k < n_used; ++k) {
        float best = -INFINITY;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < EMBER_MOE_PER_LANE; ++i) {
            const int e = (int)(lane + i * EMBER_WAVE_SIZE);
            if (e < (int)n_expert && (p[i] > best || (p[i] == best && e < best_e))) {
                best = p[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int mask = EMBER_WAVE_SIZE / 2; mask > 0; mask >>= 1) {
            const float other = ember_shfl_xor(best, mask);
            const int other_e = ember_shfl_xor_int(best_e, mask);
            if (other > best || (other == best && other_e < best_e)) {
                best = other;
                best_e = other_e;
            }
        }
        if (best_e == 0x7fffffff) best_e = 0, best = 0.0f;  // no expert left (n_used > experts)
#pragma unroll
        for (int i = 0; i < EMBER_MOE_PER_LANE; ++i)
            if ((int)(lane + i * EMBER_WAVE_SIZE) == best_e) p[i] = NAN;
        total += best;
        if (lane == 0) {
            experts[(size_t)t * n_used + k] = best_e;
            weights[(size_t)t * n_used + k] = best;
        }
    }
    if (lane == 0) {
        float* w = weights + (size_t)t * n_used;
        if (normalize) {
            const float s = fmaxf(total, 6.103515625e-5f);
            for (uint32_t k = 0; k < n_used; ++k) w[k] = __fdiv_rn(w[k], s);
        }
        if (scale != 1.0f)
            for (uint32_t k = 0; k < n_used; ++k) w[k] = __fmul_rn(w[k], scale);
    }
}

// The (token, rank) pairs sorted by expert, pairs of one expert in batch order, and tiles of at
// most `tile` pairs of one expert: tiles [n_slots, 4] = (expert, first index into pairs, count,
// 0), experts in increasing order, unused slots with count 0. experts: [n_pairs] (pair p =
// token * n_used + rank). One block; thread e takes experts e, e + blockDim.x, ...; shared
// memory: two int32 per expert (dynamic, 8 * n_expert bytes). n_slots must be at least
// n_pairs / tile + n_expert (every expert's last tile may be partial) or n_pairs, whichever is
// smaller.
EMBER_KERNEL void ember_moe_tiles(int32_t* pairs, int32_t* tiles, const int32_t* experts, uint32_t n_pairs,
                                  uint32_t n_expert, uint32_t n_slots, uint32_t tile) {
    extern __shared__ int32_t ember_moe_shared[];
    int32_t* count = ember_moe_shared;
    int32_t* offset = ember_moe_shared + n_expert;
    for (uint32_t e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int32_t c = 0;
        for (uint32_t p = 0; p < n_pairs; ++p) c += experts[p] == (int32_t)e;
        count[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // offset[e]: where expert e's pairs start in `pairs`.
        int32_t pair_at = 0;
        for (uint32_t e = 0; e < n_expert; ++e) {
            offset[e] = pair_at;
            pair_at += count[e];
        }
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int32_t at = offset[e];
        for (uint32_t p = 0; p < n_pairs; ++p)
            if (experts[p] == (int32_t)e) pairs[at++] = (int32_t)p;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t slot = 0;
        for (uint32_t e = 0; e < n_expert; ++e) {
            for (int32_t first = 0; first < count[e] && slot < n_slots; first += (int32_t)tile, ++slot) {
                int32_t* s = tiles + 4 * (size_t)slot;
                s[0] = (int32_t)e;
                s[1] = offset[e] + first;
                s[2] = min((int32_t)tile, count[e] - first);
                s[3] = 0;
            }
        }
        for (; slot < n_slots; ++slot) {
            int32_t* s = tiles + 4 * (size_t)slot;
            s[0] = 0, s[1] = 0, s[2] = 0, s[3] = 0;
        }
    }
}

// CPU op: the combination of moe_ffn. out[t, c] = sum over ranks k of y_k * weights[t * n_used + k]
// with y_k = routed[t * n_used + k, c], times expert_scale[experts[t * n_used + k]] first when
// expert_scale is not null (Gemma 4's per-expert down-projection scales, applied as GGML does:
// a product rounded to f32 before the routing weight); products rounded to f32 and added in rank
// order from the first (no contraction into multiply-adds). Launch: grid (ceil(n_embd / block),
// n_tokens).
EMBER_KERNEL void ember_moe_combine_f32(float* out, const float* routed, const float* weights, const int32_t* experts,
                                        const float* expert_scale, uint32_t n_embd, uint32_t n_used) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t t = blockIdx.y;
    if (c >= n_embd) return;
    const float* w = weights + t * n_used;
    const float* y = routed + t * n_used * n_embd + c;
    const int32_t* e = experts + t * n_used;
    float o = 0.0f;
    for (uint32_t k = 0; k < n_used; ++k) {
        float y_k = y[(size_t)k * n_embd];
        if (expert_scale != nullptr) y_k = __fmul_rn(y_k, expert_scale[e[k]]);
        const float term = __fmul_rn(y_k, w[k]);
        o = k == 0 ? term : __fadd_rn(o, term);
    }
    out[t * n_embd + c] = o;
}

// CPU op: the shared expert's per-token gate. out[t, c] += x[t, c] * (1 / (1 + exp(-logit[t]))).
// Launch: grid (ceil(n_embd / block), n_tokens).
EMBER_KERNEL void ember_moe_add_gated_f32(float* out, const float* x, const float* logit, uint32_t n_embd) {
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t t = blockIdx.y;
    if (c >= n_embd) return;
    const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-logit[t])));
    out[t * n_embd + c] = __fadd_rn(out[t * n_embd + c], __fmul_rn(x[t * n_embd + c], g));
}
