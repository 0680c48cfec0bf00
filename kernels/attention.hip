// Paged attention for decode (one query token per sequence), flash-decoding style: the keys of a
// sequence are split into partitions of EMBER_ATTN_PARTITION tokens that are processed in
// parallel, each producing a partial (max, sum, weighted value sum); a second kernel merges them.
//
// Layouts:
//   q            f32 [n_seqs, n_heads, head_dim]                  (already scaled by nothing; `scale` applies)
//   k/v cache    KV  [n_blocks, block_size, n_kv_heads, head_dim] (KV = f16 or f32)
//   block_table  i32 [n_seqs, max_blocks_per_seq]: physical block of the sequence's i-th block
//   seq_lens     i32 [n_seqs]: tokens in the cache, the query's own token included (it is the last)
//   out          f32 [n_seqs, n_heads, head_dim]
// CPU op, for each sequence s and head h (GQA: kv head = h / (n_heads / n_kv_heads)):
//   keys t in [first, seq_len) with first = window > 0 ? max(0, seq_len - window) : 0
//   score_t = scale * dot(q, k_t), then softcap * tanh(score_t / softcap) when softcap > 0
//   out = sum_t softmax(score)_t * v_t
// head_dim at most EMBER_ATTN_MAX_HEAD_DIM (256).
#include "ember_compat.h"

#define EMBER_ATTN_PARTITION 256
#define EMBER_ATTN_MAX_HEAD_DIM 256
#define EMBER_ATTN_THREADS 128

EMBER_DEVICE float ember_kv_to_float(float v) { return v; }
EMBER_DEVICE float ember_kv_to_float(ember_half v) { return ember_half_to_float(v); }

EMBER_DEVICE int ember_attn_first_key(int seq_len, int window) { return window > 0 && seq_len > window ? seq_len - window : 0; }

// Writes new keys or values into the paged cache. CPU op: for token t < n_tokens with
// slots[t] >= 0, cache[slots[t], :] = (KV) src[t, :], where a row is n_kv_heads * head_dim values
// and slot = physical block * block_size + offset in the block; slots[t] < 0 marks padding and is
// skipped. Launch: grid = n_tokens, block = 256 (any size works).
template <typename KV>
EMBER_DEVICE void ember_kv_store(KV* cache, const float* src, const int32_t* slots, uint32_t row_values) {
    const int32_t slot = slots[blockIdx.x];
    if (slot < 0) return;
    const float* in = src + (size_t)blockIdx.x * row_values;
    KV* out = cache + (size_t)slot * row_values;
    for (uint32_t i = threadIdx.x; i < row_values; i += blockDim.x) out[i] = (KV)in[i];
}

EMBER_KERNEL void ember_kv_store_f16(ember_half* cache, const float* src, const int32_t* slots, uint32_t row_values) {
    ember_kv_store<ember_half>(cache, src, slots, row_values);
}

EMBER_KERNEL void ember_kv_store_f32(float* cache, const float* src, const int32_t* slots, uint32_t row_values) {
    ember_kv_store<float>(cache, src, slots, row_values);
}

// Prefill uses the same kernels: give each query token its own "sequence" row whose block-table
// row is its sequence's and whose length is its position + 1; that is causal attention.

// Partial pass. Launch: grid = (max_partitions, n_heads, n_seqs), block = EMBER_ATTN_THREADS.
// Partition p of sequence s writes partial_max/partial_sum [s, h, p] and partial_acc [s, h, p, :].
template <typename KV>
EMBER_DEVICE void ember_attention_partial(float* partial_acc, float* partial_max, float* partial_sum, const float* q, const KV* k_cache,
                                          const KV* v_cache, const int32_t* block_table, const int32_t* seq_lens, uint32_t n_heads,
                                          uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks_per_seq,
                                          uint32_t max_partitions, float scale, int32_t window, float softcap) {
    __shared__ float q_shared[EMBER_ATTN_MAX_HEAD_DIM];
    __shared__ float scores[EMBER_ATTN_PARTITION];
    __shared__ float scratch[EMBER_MAX_WARPS];
    const uint32_t p = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const uint32_t kv_head = h / (n_heads / n_kv_heads);
    const int seq_len = seq_lens[s];
    const int first = ember_attn_first_key(seq_len, window);
    const int begin = first + (int)p * EMBER_ATTN_PARTITION;
    const int end = min(seq_len, begin + EMBER_ATTN_PARTITION);
    const size_t partial_index = ((size_t)s * n_heads + h) * max_partitions + p;
    float* acc = partial_acc + partial_index * head_dim;
    if (begin >= end) {
        for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) acc[d] = 0.0f;
        if (threadIdx.x == 0) {
            partial_max[partial_index] = -INFINITY;
            partial_sum[partial_index] = 0.0f;
        }
        return;
    }
    const int n_tokens = end - begin;
    const float* q_head = q + ((size_t)s * n_heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) q_shared[d] = q_head[d];
    __syncthreads();

    const int lane = threadIdx.x % EMBER_WAVE_SIZE, warp = threadIdx.x / EMBER_WAVE_SIZE;
    const int n_warps = blockDim.x / EMBER_WAVE_SIZE;
    const int32_t* table = block_table + (size_t)s * max_blocks_per_seq;
    for (int i = warp; i < n_tokens; i += n_warps) {
        const int t = begin + i;
        const size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        const KV* k = k_cache + (slot * n_kv_heads + kv_head) * head_dim;
        float dot = 0.0f;
        for (uint32_t d = lane; d < head_dim; d += EMBER_WAVE_SIZE) dot += q_shared[d] * ember_kv_to_float(k[d]);
        dot = ember_warp_sum(dot) * scale;
        if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
        if (lane == 0) scores[i] = dot;
    }
    __syncthreads();

    float m = -INFINITY;
    for (int i = threadIdx.x; i < n_tokens; i += blockDim.x) m = fmaxf(m, scores[i]);
    m = ember_block_max(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < n_tokens; i += blockDim.x) {
        const float e = expf(scores[i] - m);
        scores[i] = e;
        l += e;
    }
    l = ember_block_sum(l, scratch);
    __syncthreads();

    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int i = 0; i < n_tokens; ++i) {
            const int t = begin + i;
            const size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
            sum += scores[i] * ember_kv_to_float(v_cache[(slot * n_kv_heads + kv_head) * head_dim + d]);
        }
        acc[d] = sum;
    }
    if (threadIdx.x == 0) {
        partial_max[partial_index] = m;
        partial_sum[partial_index] = l;
    }
}

#define EMBER_ATTENTION_PARTIAL(name, KV)                                                                                                     \
    EMBER_KERNEL void name(float* partial_acc, float* partial_max, float* partial_sum, const float* q, const KV* k_cache, const KV* v_cache, \
                           const int32_t* block_table, const int32_t* seq_lens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,  \
                           uint32_t block_size, uint32_t max_blocks_per_seq, uint32_t max_partitions, float scale, int32_t window,        \
                           float softcap) {                                                                                               \
        ember_attention_partial<KV>(partial_acc, partial_max, partial_sum, q, k_cache, v_cache, block_table, seq_lens, n_heads, n_kv_heads, \
                                    head_dim, block_size, max_blocks_per_seq, max_partitions, scale, window, softcap);                     \
    }

EMBER_ATTENTION_PARTIAL(ember_paged_attention_decode_partial_f16kv, ember_half)
EMBER_ATTENTION_PARTIAL(ember_paged_attention_decode_partial_f32kv, float)

// Merge pass. Launch: grid = (n_heads, n_seqs), block = head_dim threads rounded up to the warp
// size (any size works). out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M = max_p m_p.
EMBER_KERNEL void ember_paged_attention_decode_reduce(float* out, const float* partial_acc, const float* partial_max, const float* partial_sum,
                                                      const int32_t* seq_lens, uint32_t n_heads, uint32_t head_dim, uint32_t max_partitions,
                                                      int32_t window) {
    const uint32_t h = blockIdx.x, s = blockIdx.y;
    const int seq_len = seq_lens[s];
    const int n_keys = seq_len - ember_attn_first_key(seq_len, window);
    const int n_parts = min((int)max_partitions, (n_keys + EMBER_ATTN_PARTITION - 1) / EMBER_ATTN_PARTITION);
    const size_t base = ((size_t)s * n_heads + h) * max_partitions;
    float* out_head = out + ((size_t)s * n_heads + h) * head_dim;
    float m = -INFINITY;
    for (int p = 0; p < n_parts; ++p) m = fmaxf(m, partial_max[base + p]);
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int p = 0; p < n_parts; ++p) {
            const float w = expf(partial_max[base + p] - m);
            num += w * partial_acc[(base + p) * head_dim + d];
            den += w * partial_sum[base + p];
        }
        out_head[d] = den > 0.0f ? num / den : 0.0f;
    }
}
