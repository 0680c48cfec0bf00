// Causal grouped-query attention over a paged f16 KV cache whose blocks are allocated one by one.
//
// KV layout (one layer): physical block b holds block_size token slots; slot s of block b keeps
// the token's n_kv_heads * head_dim f16 keys at ((ember_half*)k_blocks[b]) + s * row_values and
// its values at ((ember_half*)v_blocks[b]) + s * row_values (row_values = n_kv_heads * head_dim).
// k_blocks / v_blocks are device arrays of u64 device addresses, so each block can come from and
// go back to the device pool on its own. A sequence's logical block i is physical block
// block_tables[table * max_blocks_per_table + i].
//
// Batch: q f32 [n_tokens, n_heads, head_dim]; token t belongs to table table_of_token[t] and sits
// at position positions[t]; it attends to the positions p of its table with
// first(t) <= p <= positions[t], first(t) = max(0, positions[t] - window + 1) with a window, else 0
// (a token sees q when pos - q < window, as the CPU backend does). out f32 [n_tokens, n_heads,
// head_dim]. GQA: query head h reads KV head h / (n_heads / n_kv_heads).
// score = scale * dot(q, k), then softcap * tanh(score / softcap) when softcap > 0; out = softmax
// (score) . v. As in the CPU backend (GGML's f16 path), queries are rounded to f16 before the dot
// products; keys and values are f16 in the cache; everything else is f32.
//
// Three kernels compute the same function for any batch:
//   * decode (flash decoding): one thread block per (key partition, head, token); partitions of
//     EMBER_ATTN_PARTITION keys run in parallel and a reduce kernel (launched only when a token
//     has more than one partition) merges their (max, sum, acc) triples. For head sizes 64, 128,
//     256 and 512 a block reads keys and values with 16-byte loads, at most 32 lanes per key (so
//     a key's lanes sit in one warp on wave32 and wave64 targets alike; 512 takes two loads per
//     lane) and several keys per warp, with no barrier per key. Best when every token is the
//     only query of its sequence in the batch.
//   * prefill (tiled flash attention): one thread block per (tile of EMBER_ATTN_TILE_Q consecutive
//     batch tokens, head); key tiles of EMBER_ATTN_TILE_K are staged through shared memory and
//     every query of the tile reuses them; online softmax. Consecutive batch tokens of one table
//     share the tile's key walk; a tile that spans several tables walks each table in turn.
//     Heads wider than 256 (Gemma 4's 512-wide global heads) stage each key and value tile in
//     chunks of 128 dimensions, so the kernel's static shared memory stays under 48 KiB (CUDA's
//     static limit; AMD's LDS is 64 KiB) whatever the head size.
//   * prefill on the tensor cores (NVIDIA only, heads of exactly 64 and 128): the prefill's
//     function with S = Q K^T and O += P V on mma.sync, 64 queries per block and key tiles of 64;
//     the weights P are rounded to f16 (see "prefill on the matrix cores" below).
// All are deterministic: fixed reduction orders, no atomics.
//
// kernels/tests/harness_attention.cu tests these kernels (kernels/tests/harness.cu should not).
#include "ember_compat.h"

#define EMBER_ATTN_PARTITION 64
#define EMBER_ATTN_MAX_HEAD_DIM 512
#define EMBER_ATTN_THREADS 128
#define EMBER_ATTN_TILE_Q 16
#define EMBER_ATTN_TILE_K 32

EMBER_DEVICE int ember_attn_first(int position, int window) { return window > 0 && position >= window ? position - window + 1 : 0; }

EMBER_DEVICE float ember_attn_round_f16(float x) { return __half2float(__float2half_rn(x)); }

EMBER_DEVICE float ember_attn_cap(float score, float softcap) { return softcap > 0.0f ? softcap * tanhf(score / softcap) : score; }

// Address of slot `position` of `table` in a layer's K or V blocks, plus the head offset.
EMBER_DEVICE const ember_half* ember_attn_slot(const uint64_t* blocks, const int32_t* table, int position, uint32_t block_size,
                                               uint32_t row_values, uint32_t head_offset) {
    const int32_t block = table[position / (int)block_size];
    const ember_half* base = (const ember_half*)blocks[block];
    return base + (size_t)(position % (int)block_size) * row_values + head_offset;
}

// Writes the new keys and values of n_tokens tokens as f16: for token t with slots[t] >= 0,
// block slots[t] / block_size, slot slots[t] % block_size gets k[t, :] and v[t, :] (row_values
// f32 each). slots[t] < 0 marks padding and is skipped, as is a block whose address is 0.
// Launch: grid = n_tokens, block = 256 (any size works).
EMBER_KERNEL void ember_kv_store_f16(const uint64_t* k_blocks, const uint64_t* v_blocks, const float* k, const float* v,
                                     const int32_t* slots, uint32_t row_values, uint32_t block_size) {
    const int32_t slot = slots[blockIdx.x];
    if (slot < 0) return;
    const uint32_t block = (uint32_t)slot / block_size, offset = (uint32_t)slot % block_size;
    ember_half* k_out = (ember_half*)k_blocks[block];
    ember_half* v_out = (ember_half*)v_blocks[block];
    if (k_out == nullptr || v_out == nullptr) return;
    k_out += (size_t)offset * row_values;
    v_out += (size_t)offset * row_values;
    const float* k_in = k + (size_t)blockIdx.x * row_values;
    const float* v_in = v + (size_t)blockIdx.x * row_values;
    for (uint32_t i = threadIdx.x; i < row_values; i += blockDim.x) {
        k_out[i] = __float2half_rn(k_in[i]);
        v_out[i] = __float2half_rn(v_in[i]);
    }
}

// ---- decode ----

// 8 f16 values (one 16-byte load) as floats.
EMBER_DEVICE void ember_attn_unpack8(uint4 bits, float* v) {
    const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __half2float(__ushort_as_half((unsigned short)(words[i] & 0xffffu)));
        v[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(words[i] >> 16)));
    }
}

// Decode scores for head_dim = 8 CH V (CH = 8, 16 or 32 divides the wave; V = 1 or 2): CH
// neighbouring lanes share a key, lane c loads dimensions 8 (c + CH j) .. + 7 for j < V with one
// 16-byte load each (rows are 16-byte aligned when head_dim is a multiple of 8), and the group sums
// with shuffles; a block pass covers blockDim / CH keys and four passes' loads are issued before
// their arithmetic. The pass count depends only on n_keys, so every lane of a warp runs every
// shuffle.
template <int CH, int V>
EMBER_DEVICE void ember_attn_decode_scores(float* scores, const ember_half* const* key_rows, const float* q_shared, int n_keys, float scale,
                                          float softcap) {
    const int c = (int)(threadIdx.x % CH), slot = (int)(threadIdx.x / CH), per_pass = (int)(blockDim.x / CH);
    float q[V][8];
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
        for (int k = 0; k < 8; ++k) q[v][k] = q_shared[8 * (c + CH * v) + k];
    for (int base = 0; base < n_keys; base += 4 * per_pass) {
        uint4 bits[4][V];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = base + j * per_pass + slot;
#pragma unroll
            for (int v = 0; v < V; ++v)
                bits[j][v] = i < n_keys ? *(const uint4*)(key_rows[i] + 8 * (c + CH * v)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float dot = 0.0f;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float k[8];
                ember_attn_unpack8(bits[j][v], k);
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += q[v][e] * k[e];
            }
#pragma unroll
            for (int mask = CH / 2; mask > 0; mask >>= 1) dot += ember_shfl_xor(dot, mask);
            const int i = base + j * per_pass + slot;
            if (c == 0 && i < n_keys) scores[i] = ember_attn_cap(dot * scale, softcap);
        }
    }
}

// dst[d] = norm * sum_i probs[i] v_i[d] for head_dim = 8 CH V: thread (slot, c) accumulates keys
// slot, slot + blockDim / CH, ... (in increasing order) for dimensions 8 (c + CH j) .. + 7 (j < V)
// with 16-byte loads; for each j the slots' partial sums meet in `reduce` (blockDim * 8 floats)
// and are added in slot order. Deterministic; contains __syncthreads (call from the whole block).
template <int CH, int V>
EMBER_DEVICE void ember_attn_decode_values(float* dst, const float* probs, const ember_half* const* value_rows, int n_keys, float norm,
                                          float* reduce) {
    constexpr int CHUNK = 8 * CH;
    const int c = (int)(threadIdx.x % CH), slot = (int)(threadIdx.x / CH), per_pass = (int)(blockDim.x / CH);
    float acc[V][8];
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[v][e] = 0.0f;
    for (int base = slot; base < n_keys; base += 4 * per_pass) {
        uint4 bits[4][V];
        float p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = base + j * per_pass;
            const bool valid = i < n_keys;
#pragma unroll
            for (int v = 0; v < V; ++v)
                bits[j][v] = valid ? *(const uint4*)(value_rows[i] + 8 * (c + CH * v)) : make_uint4(0u, 0u, 0u, 0u);
            p[j] = valid ? probs[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float x[8];
                ember_attn_unpack8(bits[j][v], x);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[v][e] += p[j] * x[e];
            }
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
        // The previous round's readers are done with `reduce` before it is written again.
        if (v > 0) __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; ++e) reduce[slot * CHUNK + 8 * c + e] = acc[v][e];
        __syncthreads();
        for (int d = (int)threadIdx.x; d < CHUNK; d += (int)blockDim.x) {
            float sum = 0.0f;
            for (int g = 0; g < per_pass; ++g) sum += reduce[g * CHUNK + d];
            dst[CHUNK * v + d] = sum * norm;
        }
    }
}

// Partial pass. Launch: grid = (n_partitions, n_heads, n_tokens), block = EMBER_ATTN_THREADS.
// Partition p of token t covers keys first(t) + p P .. min(positions[t], first(t) + (p+1) P - 1)
// and writes partial_ms[t, h, p] = (max, sum of exp) and partial_acc[t, h, p, :] (unnormalised).
// With n_partitions == 1 it writes the normalised result to out instead (no reduce needed).
EMBER_KERNEL void ember_attention_decode_partial(float* out, float* partial_acc, float2* partial_ms, const float* q, const uint64_t* k_blocks,
                                                 const uint64_t* v_blocks, const int32_t* block_tables, const int32_t* table_of_token,
                                                 const int32_t* positions, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                                 uint32_t block_size, uint32_t max_blocks_per_table, uint32_t n_partitions, float scale,
                                                 int32_t window, float softcap) {
    __shared__ float q_shared[EMBER_ATTN_MAX_HEAD_DIM];
    __shared__ float scores[EMBER_ATTN_PARTITION];
    __shared__ const ember_half* key_rows[EMBER_ATTN_PARTITION];
    __shared__ const ember_half* value_rows[EMBER_ATTN_PARTITION];
    __shared__ float scratch[EMBER_MAX_WARPS];
    __shared__ float reduce[EMBER_ATTN_THREADS * 8];
    const uint32_t p = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
    const uint32_t kv_head = h / (n_heads / n_kv_heads);
    const uint32_t row_values = n_kv_heads * head_dim, head_offset = kv_head * head_dim;
    const int position = positions[t];
    const int begin = ember_attn_first(position, window) + (int)p * EMBER_ATTN_PARTITION;
    const int end = min(position + 1, begin + EMBER_ATTN_PARTITION);
    const size_t partial_index = ((size_t)t * n_heads + h) * n_partitions + p;
    if (begin >= end) {
        // Only reachable with n_partitions > 1 (partition 0 always holds the token itself).
        float* acc = partial_acc + partial_index * head_dim;
        for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) acc[d] = 0.0f;
        if (threadIdx.x == 0) partial_ms[partial_index] = make_float2(-INFINITY, 0.0f);
        return;
    }
    const int n_keys = end - begin;
    const int32_t* table = block_tables + (size_t)table_of_token[t] * max_blocks_per_table;
    const float* q_head = q + ((size_t)t * n_heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) q_shared[d] = ember_attn_round_f16(q_head[d]);
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) {
        key_rows[i] = ember_attn_slot(k_blocks, table, begin + i, block_size, row_values, head_offset);
        value_rows[i] = ember_attn_slot(v_blocks, table, begin + i, block_size, row_values, head_offset);
    }
    __syncthreads();

    // Scores: vectorised for the common head sizes (CH lanes per key, 8 or 16 dimensions each),
    // one warp per key otherwise.
    if (head_dim == 128) ember_attn_decode_scores<16, 1>(scores, key_rows, q_shared, n_keys, scale, softcap);
    else if (head_dim == 64) ember_attn_decode_scores<8, 1>(scores, key_rows, q_shared, n_keys, scale, softcap);
    else if (head_dim == 256) ember_attn_decode_scores<32, 1>(scores, key_rows, q_shared, n_keys, scale, softcap);
    else if (head_dim == 512) ember_attn_decode_scores<32, 2>(scores, key_rows, q_shared, n_keys, scale, softcap);
    else {
        const int lane = threadIdx.x % EMBER_WAVE_SIZE, warp = threadIdx.x / EMBER_WAVE_SIZE;
        const int n_warps = blockDim.x / EMBER_WAVE_SIZE;
        for (int i = warp; i < n_keys; i += n_warps) {
            const ember_half* k = key_rows[i];
            float dot = 0.0f;
            for (uint32_t d = lane; d < head_dim; d += EMBER_WAVE_SIZE) dot += q_shared[d] * __half2float(k[d]);
            dot = ember_warp_sum(dot);
            if (lane == 0) scores[i] = ember_attn_cap(dot * scale, softcap);
        }
    }
    __syncthreads();

    float m = -INFINITY;
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) m = fmaxf(m, scores[i]);
    m = ember_block_max(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < n_keys; i += blockDim.x) {
        const float e = expf(scores[i] - m);
        scores[i] = e;
        l += e;
    }
    l = ember_block_sum(l, scratch);
    __syncthreads();

    const bool direct = n_partitions == 1;
    float* dst = direct ? out + ((size_t)t * n_heads + h) * head_dim : partial_acc + partial_index * head_dim;
    const float norm = direct ? 1.0f / l : 1.0f;
    if (head_dim == 128) ember_attn_decode_values<16, 1>(dst, scores, value_rows, n_keys, norm, reduce);
    else if (head_dim == 64) ember_attn_decode_values<8, 1>(dst, scores, value_rows, n_keys, norm, reduce);
    else if (head_dim == 256) ember_attn_decode_values<32, 1>(dst, scores, value_rows, n_keys, norm, reduce);
    else if (head_dim == 512) ember_attn_decode_values<32, 2>(dst, scores, value_rows, n_keys, norm, reduce);
    else
        for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int i = 0; i < n_keys; ++i) sum += scores[i] * __half2float(value_rows[i][d]);
            dst[d] = sum * norm;
        }
    if (!direct && threadIdx.x == 0) partial_ms[partial_index] = make_float2(m, l);
}

// Merge pass. Launch: grid = (n_heads, n_tokens), block = 128 (any size works).
// out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p with M = max_p m_p.
EMBER_KERNEL void ember_attention_decode_reduce(float* out, const float* partial_acc, const float2* partial_ms, uint32_t n_heads,
                                                uint32_t head_dim, uint32_t n_partitions) {
    const uint32_t h = blockIdx.x, t = blockIdx.y;
    const size_t base = ((size_t)t * n_heads + h) * n_partitions;
    float m = -INFINITY;
    for (uint32_t p = 0; p < n_partitions; ++p) m = fmaxf(m, partial_ms[base + p].x);
    float den = 0.0f;
    for (uint32_t p = 0; p < n_partitions; ++p) den += expf(partial_ms[base + p].x - m) * partial_ms[base + p].y;
    float* out_head = out + ((size_t)t * n_heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.0f;
        for (uint32_t p = 0; p < n_partitions; ++p) num += expf(partial_ms[base + p].x - m) * partial_acc[(base + p) * head_dim + d];
        out_head[d] = den > 0.0f ? num / den : 0.0f;
    }
}

// ---- prefill ----

// Shared-memory rows are padded by one half2 so that 32 threads reading 32 different rows at the
// same column hit 32 different banks. Keys and values are staged CHUNK dimensions at a time: the
// whole head up to 256 (one chunk, keys and values staged together), 128 for wider heads (keys
// chunk by chunk for the scores, then values chunk by chunk for the outputs), which keeps a d512
// tile at about 35 KiB.
template <int D_MAX>
struct EmberAttnTile {
    static constexpr int CHUNK = D_MAX > 256 ? 128 : D_MAX;
    static constexpr int N_CHUNKS = D_MAX / CHUNK;
    static constexpr int Q_STRIDE = D_MAX + 2;
    static constexpr int STRIDE = CHUNK + 2;
    ember_half q[EMBER_ATTN_TILE_Q][Q_STRIDE];
    ember_half k[EMBER_ATTN_TILE_K][STRIDE];
    ember_half v[EMBER_ATTN_TILE_K][STRIDE];
    float s[EMBER_ATTN_TILE_Q][EMBER_ATTN_TILE_K + 1];
    float alpha[EMBER_ATTN_TILE_Q];
    float l[EMBER_ATTN_TILE_Q];
    const ember_half* key_rows[EMBER_ATTN_TILE_K];
    const ember_half* value_rows[EMBER_ATTN_TILE_K];
    int table[EMBER_ATTN_TILE_Q];
    int position[EMBER_ATTN_TILE_Q];
    int first[EMBER_ATTN_TILE_Q];
};

// Copies dimensions col0 .. col0 + n_cols - 1 of n_valid key (or value) rows into a shared tile;
// rows past n_valid are zero. 16-byte loads when head_dim is a multiple of 8 (rows, and chunks
// starting at multiples of 8, are then 16-byte aligned), 4-byte ones otherwise (head_dim is even).
template <int STRIDE>
EMBER_DEVICE void ember_attn_stage(ember_half (*dst)[STRIDE], const ember_half* const* rows, int n_valid, int col0, int n_cols,
                                   uint32_t head_dim) {
    if (head_dim % 8 == 0) {
        const int chunks = n_cols / 8;
        for (int i = threadIdx.x; i < EMBER_ATTN_TILE_K * chunks; i += blockDim.x) {
            const int key = i / chunks, c = 8 * (i % chunks);
            uint4 bits = make_uint4(0u, 0u, 0u, 0u);
            if (key < n_valid) bits = *(const uint4*)(rows[key] + col0 + c);
            uint32_t* out = (uint32_t*)&dst[key][c];
            out[0] = bits.x, out[1] = bits.y, out[2] = bits.z, out[3] = bits.w;
        }
    } else {
        const int chunks = n_cols / 2;
        for (int i = threadIdx.x; i < EMBER_ATTN_TILE_K * chunks; i += blockDim.x) {
            const int key = i / chunks, c = 2 * (i % chunks);
            uint32_t bits = 0u;
            if (key < n_valid) bits = *(const uint32_t*)(rows[key] + col0 + c);
            *(uint32_t*)&dst[key][c] = bits;
        }
    }
}

// Launch: grid = (ceil(n_tokens / EMBER_ATTN_TILE_Q), n_heads), block = EMBER_ATTN_THREADS (128).
// head_dim must be even and at most D_MAX. Thread roles:
//   scores:  key kk = tid % 32 for rows tid / 32 + 4 j (j < 4);
//   softmax: row tid / 8, keys 4 (tid % 8) .. + 3 (row statistics live in registers of the
//            row's 8 threads, which all compute the same values);
//   values:  columns 2 (tid % 32) + 64 i (i < D_MAX / 64) for rows tid / 32 + 4 j.
template <int D_MAX>
EMBER_DEVICE void ember_attention_prefill(float* out, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks,
                                          const int32_t* block_tables, const int32_t* table_of_token, const int32_t* positions,
                                          uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                          uint32_t block_size, uint32_t max_blocks_per_table, float scale, int32_t window,
                                          float softcap) {
    constexpr int TQ = EMBER_ATTN_TILE_Q, TK = EMBER_ATTN_TILE_K, COLS = D_MAX / 64;
    using Tile = EmberAttnTile<D_MAX>;
    constexpr int CHUNK = Tile::CHUNK, N_CHUNKS = Tile::N_CHUNKS, CHUNK_COLS = CHUNK / 64;
    __shared__ Tile tile;
    const int tid = threadIdx.x;
    const uint32_t h = blockIdx.y;
    const uint32_t kv_head = h / (n_heads / n_kv_heads);
    const uint32_t row_values = n_kv_heads * head_dim, head_offset = kv_head * head_dim;
    const int t0 = blockIdx.x * TQ;
    const int n_rows = min(TQ, (int)n_tokens - t0);

    if (tid < TQ) {
        const bool valid = tid < n_rows;
        tile.table[tid] = valid ? table_of_token[t0 + tid] : -1;
        tile.position[tid] = valid ? positions[t0 + tid] : -1;
        tile.first[tid] = valid ? ember_attn_first(tile.position[tid], window) : 0;
    }
    for (int i = tid; i < TQ * (int)head_dim; i += blockDim.x) {
        const int r = i / (int)head_dim, c = i % (int)head_dim;
        const float value = r < n_rows ? q[((size_t)(t0 + r) * n_heads + h) * head_dim + c] : 0.0f;
        tile.q[r][c] = __float2half_rn(value);
    }
    __syncthreads();

    // Value accumulators and the softmax statistics of this thread's rows.
    float o[4][COLS][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < COLS; ++i) o[j][i][0] = o[j][i][1] = 0.0f;
    const int soft_row = tid / 8, soft_sub = tid % 8;
    float row_max = -INFINITY, row_sum = 0.0f;

    const int score_key = tid % 32, score_row = tid / 32;
    const int value_col = 2 * (tid % 32), value_row = tid / 32;

    for (int segment_start = 0; segment_start < n_rows;) {
        const int table_id = tile.table[segment_start];
        int segment_end = segment_start + 1;
        while (segment_end < n_rows && tile.table[segment_end] == table_id) ++segment_end;
        int lo = INT32_MAX, hi = -1;
        for (int r = segment_start; r < segment_end; ++r) {
            lo = min(lo, tile.first[r]);
            hi = max(hi, tile.position[r]);
        }
        const int32_t* table = block_tables + (size_t)table_id * max_blocks_per_table;

        for (int k0 = lo; k0 <= hi; k0 += TK) {
            const int n_valid = min(TK, hi + 1 - k0);
            if (tid < TK && tid < n_valid) {
                tile.key_rows[tid] = ember_attn_slot(k_blocks, table, k0 + tid, block_size, row_values, head_offset);
                tile.value_rows[tid] = ember_attn_slot(v_blocks, table, k0 + tid, block_size, row_values, head_offset);
            }
            __syncthreads();
            if (N_CHUNKS == 1) {
                ember_attn_stage<Tile::STRIDE>(tile.k, tile.key_rows, n_valid, 0, (int)head_dim, head_dim);
                ember_attn_stage<Tile::STRIDE>(tile.v, tile.value_rows, n_valid, 0, (int)head_dim, head_dim);
                __syncthreads();
            }

            // Scores of 4 rows against one key, chunk by chunk of the head.
            {
                float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int chunk = 0; chunk < N_CHUNKS; ++chunk) {
                    const int col0 = chunk * CHUNK, n_cols = min(CHUNK, (int)head_dim - col0);
                    // The same for every thread of the block, so the barriers below are uniform.
                    if (n_cols <= 0) break;
                    if (N_CHUNKS > 1) {
                        ember_attn_stage<Tile::STRIDE>(tile.k, tile.key_rows, n_valid, col0, n_cols, head_dim);
                        __syncthreads();
                    }
                    for (int c = 0; c < n_cols; c += 2) {
                        const float2 kv = __half22float2(*(const __half2*)&tile.k[score_key][c]);
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float2 qv = __half22float2(*(const __half2*)&tile.q[score_row + 4 * j][col0 + c]);
                            dot[j] += qv.x * kv.x + qv.y * kv.y;
                        }
                    }
                    // The next chunk overwrites the keys.
                    if (N_CHUNKS > 1) __syncthreads();
                }
                const int key = k0 + score_key;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int r = score_row + 4 * j;
                    const bool visible = r >= segment_start && r < segment_end && key <= tile.position[r] && key >= tile.first[r];
                    tile.s[r][score_key] = visible ? ember_attn_cap(dot[j] * scale, softcap) : -INFINITY;
                }
            }
            __syncthreads();

            // Online softmax: 8 threads per row, 4 keys each.
            {
                float s[4];
                float tile_max = -INFINITY;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s[i] = tile.s[soft_row][4 * soft_sub + i];
                    tile_max = fmaxf(tile_max, s[i]);
                }
#pragma unroll
                for (int mask = 4; mask > 0; mask >>= 1) tile_max = fmaxf(tile_max, ember_shfl_xor(tile_max, mask));
                const float new_max = fmaxf(row_max, tile_max);
                float alpha = 1.0f, tile_sum = 0.0f;
                if (new_max != -INFINITY) {
                    alpha = expf(row_max - new_max);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        s[i] = expf(s[i] - new_max);
                        tile_sum += s[i];
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) s[i] = 0.0f;
                }
#pragma unroll
                for (int mask = 4; mask > 0; mask >>= 1) tile_sum += ember_shfl_xor(tile_sum, mask);
                row_max = new_max;
                row_sum = row_sum * alpha + tile_sum;
#pragma unroll
                for (int i = 0; i < 4; ++i) tile.s[soft_row][4 * soft_sub + i] = s[i];
                if (soft_sub == 0) tile.alpha[soft_row] = alpha;
            }
            __syncthreads();

            // o = alpha o + P V for this thread's rows and columns.
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float alpha = tile.alpha[value_row + 4 * j];
#pragma unroll
                for (int i = 0; i < COLS; ++i) o[j][i][0] *= alpha, o[j][i][1] *= alpha;
            }
#pragma unroll
            for (int chunk = 0; chunk < N_CHUNKS; ++chunk) {
                const int col0 = chunk * CHUNK, n_cols = min(CHUNK, (int)head_dim - col0);
                if (n_cols <= 0) break;
                if (N_CHUNKS > 1) {
                    ember_attn_stage<Tile::STRIDE>(tile.v, tile.value_rows, n_valid, col0, n_cols, head_dim);
                    __syncthreads();
                }
                for (int key = 0; key < n_valid; ++key) {
                    float pj[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) pj[j] = tile.s[value_row + 4 * j][key];
#pragma unroll
                    for (int i = 0; i < COLS; ++i) {
                        // Column group i lies in chunk i / CHUNK_COLS (known at compile time).
                        if (i / CHUNK_COLS != chunk) continue;
                        const int c = value_col + 64 * (i % CHUNK_COLS);
                        if (c < n_cols) {
                            const float2 vv = __half22float2(*(const __half2*)&tile.v[key][c]);
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                o[j][i][0] += pj[j] * vv.x;
                                o[j][i][1] += pj[j] * vv.y;
                            }
                        }
                    }
                }
                // The next chunk overwrites the values.
                if (N_CHUNKS > 1) __syncthreads();
            }
            // The next tile overwrites k, v, s and the row pointers.
            __syncthreads();
        }
        segment_start = segment_end;
    }

    if (soft_sub == 0) tile.l[soft_row] = row_sum;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int r = value_row + 4 * j;
        if (r >= n_rows) continue;
        const float l = tile.l[r];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* dst = out + ((size_t)(t0 + r) * n_heads + h) * head_dim;
#pragma unroll
        for (int i = 0; i < COLS; ++i) {
            const int c = value_col + 64 * i;
            if (c < (int)head_dim) *(float2*)(dst + c) = make_float2(o[j][i][0] * inv, o[j][i][1] * inv);
        }
    }
}

#define EMBER_ATTENTION_PREFILL(name, d_max)                                                                                             \
    EMBER_KERNEL void name(float* out, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* block_tables, \
                           const int32_t* table_of_token, const int32_t* positions, uint32_t n_tokens, uint32_t n_heads,               \
                           uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks_per_table, float scale,    \
                           int32_t window, float softcap) {                                                                          \
        ember_attention_prefill<d_max>(out, q, k_blocks, v_blocks, block_tables, table_of_token, positions, n_tokens, n_heads,          \
                                       n_kv_heads, head_dim, block_size, max_blocks_per_table, scale, window, softcap);               \
    }

EMBER_ATTENTION_PREFILL(ember_attention_prefill_d64, 64)
EMBER_ATTENTION_PREFILL(ember_attention_prefill_d128, 128)
EMBER_ATTENTION_PREFILL(ember_attention_prefill_d256, 256)
EMBER_ATTENTION_PREFILL(ember_attention_prefill_d512, 512)

// ---- prefill on the matrix cores (NVIDIA mma.sync) ----
//
// The same function as ember_attention_prefill for head sizes of exactly 64 and 128, with the
// products on the tensor cores: one thread block per (EMBER_FA_ROWS = 64 consecutive batch
// tokens, head), four warps of 16 query rows each. A warp keeps its rows' queries in registers as
// f16 A fragments of mma.sync.m16n8k16, walks the keys in tiles of EMBER_FA_KEYS = 64 staged
// through shared memory as f16 (keys and values of the whole head, 16-byte loads), computes the
// 16 x 64 scores with S = Q K^T (f16 products, f32 accumulation), updates its rows' running max and
// sum in f32 (online softmax), rounds the weights P to f16 and accumulates O += P V with mma.sync
// again (f32 accumulators). The accumulator layout of m16n8k16 (lane = 4 g + t holds rows g and
// g + 8, columns 2 t and 2 t + 1) is also its A layout, so the weights go from the S accumulators to
// the P V operands without shared memory; the row statistics are reduced over the 4 lanes of a
// row with shuffles. Masks (causal, window, table, the tile's tail) are applied only where a
// warp's tile is not wholly visible to all its rows, and a warp skips tiles none of its rows see.
// Extra error against ember_attention_prefill: the weights are rounded to f16 (2^-11 relative),
// and the row sums are taken over the rounded weights, so the output moves by at most about
// 2^-10 max|v| (kernels/tests/harness_attention.cu states the bound).
// Launch: grid = (ceil(n_tokens / EMBER_FA_ROWS), n_heads), block = EMBER_FA_THREADS (128);
// head_dim must equal D. Compiled for NVIDIA targets only (sm_80 and newer have m16n8k16).
#define EMBER_FA_ROWS 64
#define EMBER_FA_KEYS 64
#define EMBER_FA_THREADS 128

#if defined(EMBER_PLATFORM_CUDA)

template <int D>
struct EmberFaTile {
    // Rows padded by 8 halves (16 bytes): the fragment loads of a warp hit 32 distinct banks.
    static constexpr int STRIDE = D + 8;
    alignas(16) ember_half k[EMBER_FA_KEYS][STRIDE];
    alignas(16) ember_half v[EMBER_FA_KEYS][STRIDE];
    const ember_half* key_rows[EMBER_FA_KEYS];
    const ember_half* value_rows[EMBER_FA_KEYS];
    int table[EMBER_FA_ROWS], position[EMBER_FA_ROWS], first[EMBER_FA_ROWS];
};

EMBER_DEVICE uint32_t ember_fa_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t*)&h;
}

EMBER_DEVICE uint32_t ember_fa_pack_halves(ember_half lo, ember_half hi) {
    return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

// c (16 x 8, f32) += a (16 x 16, f16, row-major fragment) * b (16 x 8, f16, column fragment).
EMBER_DEVICE void ember_fa_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int D>
EMBER_DEVICE void ember_attention_prefill_mma(float* out, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks,
                                              const int32_t* block_tables, const int32_t* table_of_token, const int32_t* positions,
                                              uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t block_size,
                                              uint32_t max_blocks_per_table, float scale, int32_t window, float softcap) {
    constexpr int ROWS = EMBER_FA_ROWS, KEYS = EMBER_FA_KEYS, K_STEPS = D / 16, D_TILES = D / 8, KEY_TILES = KEYS / 8;
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per key row
    __shared__ EmberFaTile<D> tile;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const uint32_t h = blockIdx.y;
    const uint32_t kv_head = h / (n_heads / n_kv_heads);
    const uint32_t row_values = n_kv_heads * D, head_offset = kv_head * D;
    const int t0 = blockIdx.x * ROWS;
    const int n_rows = min(ROWS, (int)n_tokens - t0);

    for (int r = tid; r < ROWS; r += blockDim.x) {
        const bool valid = r < n_rows;
        tile.table[r] = valid ? table_of_token[t0 + r] : -1;
        tile.position[r] = valid ? positions[t0 + r] : -1;
        tile.first[r] = valid ? ember_attn_first(tile.position[r], window) : 0;
    }

    // This lane's two rows and their queries as A fragments (rounded to f16, as the tile kernel).
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    uint32_t qa[K_STEPS][4];
    {
        const float* q0 = q + ((size_t)(t0 + r0) * n_heads + h) * D;
        const float* q1 = q + ((size_t)(t0 + r1) * n_heads + h) * D;
        const bool v0 = r0 < n_rows, v1 = r1 < n_rows;
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ++ks) {
            const int c = 16 * ks + 2 * t;
            const float2 a = v0 ? *(const float2*)(q0 + c) : make_float2(0.0f, 0.0f);
            const float2 b = v1 ? *(const float2*)(q1 + c) : make_float2(0.0f, 0.0f);
            const float2 a8 = v0 ? *(const float2*)(q0 + c + 8) : make_float2(0.0f, 0.0f);
            const float2 b8 = v1 ? *(const float2*)(q1 + c + 8) : make_float2(0.0f, 0.0f);
            qa[ks][0] = ember_fa_pack(a.x, a.y);
            qa[ks][1] = ember_fa_pack(b.x, b.y);
            qa[ks][2] = ember_fa_pack(a8.x, a8.y);
            qa[ks][3] = ember_fa_pack(b8.x, b8.y);
        }
    }
    __syncthreads();

    float o[D_TILES][4];
#pragma unroll
    for (int i = 0; i < D_TILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int table0 = tile.table[r0], table1 = tile.table[r1];
    const int pos0 = tile.position[r0], pos1 = tile.position[r1];
    const int first0 = tile.first[r0], first1 = tile.first[r1];

    for (int segment_start = 0; segment_start < n_rows;) {
        const int table_id = tile.table[segment_start];
        int segment_end = segment_start + 1;
        while (segment_end < n_rows && tile.table[segment_end] == table_id) ++segment_end;
        int lo = INT32_MAX, hi = -1;
        for (int r = segment_start; r < segment_end; ++r) {
            lo = min(lo, tile.first[r]);
            hi = max(hi, tile.position[r]);
        }
        const int32_t* table = block_tables + (size_t)table_id * max_blocks_per_table;
        const bool in0 = r0 >= segment_start && r0 < segment_end, in1 = r1 >= segment_start && r1 < segment_end;

        for (int k0 = lo; k0 <= hi; k0 += KEYS) {
            const int n_valid = min(KEYS, hi + 1 - k0);
            // The previous tile's keys, values and row pointers are no longer read.
            __syncthreads();
            for (int i = tid; i < n_valid; i += blockDim.x) {
                tile.key_rows[i] = ember_attn_slot(k_blocks, table, k0 + i, block_size, row_values, head_offset);
                tile.value_rows[i] = ember_attn_slot(v_blocks, table, k0 + i, block_size, row_values, head_offset);
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < KEYS * CHUNKS / EMBER_FA_THREADS; ++j) {
                const int i = tid + j * EMBER_FA_THREADS, key = i / CHUNKS, c = 8 * (i % CHUNKS);
                uint4 kb = make_uint4(0u, 0u, 0u, 0u), vb = kb;
                if (key < n_valid) {
                    kb = *(const uint4*)(tile.key_rows[key] + c);
                    vb = *(const uint4*)(tile.value_rows[key] + c);
                }
                *(uint4*)&tile.k[key][c] = kb;
                *(uint4*)&tile.v[key][c] = vb;
            }
            __syncthreads();

            // Which of this warp's rows see the tile, and whether all of them see all of it.
            const int last = k0 + n_valid - 1;
            const bool sees0 = in0 && first0 <= last && pos0 >= k0, sees1 = in1 && first1 <= last && pos1 >= k0;
            const bool whole0 = in0 && n_valid == KEYS && first0 <= k0 && pos0 >= last;
            const bool whole1 = in1 && n_valid == KEYS && first1 <= k0 && pos1 >= last;
            if (!__any_sync(0xffffffffu, sees0 || sees1)) continue;
            const bool masked = !__all_sync(0xffffffffu, whole0 && whole1);

            float s[KEY_TILES][4];
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks)
#pragma unroll
                for (int n = 0; n < KEY_TILES; ++n) {
                    const ember_half* row = &tile.k[8 * n + g][16 * ks + 2 * t];
                    ember_fa_mma(s[n], qa[ks], *(const uint32_t*)row, *(const uint32_t*)(row + 8));
                }

            float tile_max0 = -INFINITY, tile_max1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = ember_attn_cap(s[n][e] * scale, softcap);
                    if (masked) {
                        const int key = k0 + 8 * n + 2 * t + (e & 1);
                        const bool visible = e < 2 ? in0 && key <= pos0 && key >= first0 && key <= last
                                                   : in1 && key <= pos1 && key >= first1 && key <= last;
                        if (!visible) x = -INFINITY;
                    }
                    s[n][e] = x;
                    if (e < 2) tile_max0 = fmaxf(tile_max0, x);
                    else tile_max1 = fmaxf(tile_max1, x);
                }
#pragma unroll
            for (int mask = 1; mask <= 2; mask <<= 1) {
                tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, mask));
                tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, mask));
            }
            const float new_max0 = fmaxf(m0, tile_max0), new_max1 = fmaxf(m1, tile_max1);
            const float alpha0 = new_max0 == -INFINITY ? 1.0f : expf(m0 - new_max0);
            const float alpha1 = new_max1 == -INFINITY ? 1.0f : expf(m1 - new_max1);
            m0 = new_max0;
            m1 = new_max1;

            // P in f16 as A fragments: key tiles 2 kk and 2 kk + 1 make the 16 keys of step kk.
            uint32_t pa[KEYS / 16][4];
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float mx = e < 2 ? new_max0 : new_max1;
                    p[e] = mx == -INFINITY ? 0.0f : expf(s[n][e] - mx);
                }
                const __half2 lo = __floats2half2_rn(p[0], p[1]), hi = __floats2half2_rn(p[2], p[3]);
                const float2 lo_f = __half22float2(lo), hi_f = __half22float2(hi);
                sum0 += lo_f.x + lo_f.y;
                sum1 += hi_f.x + hi_f.y;
                pa[n / 2][2 * (n % 2)] = *(const uint32_t*)&lo;
                pa[n / 2][2 * (n % 2) + 1] = *(const uint32_t*)&hi;
            }
            l0 = l0 * alpha0 + sum0;
            l1 = l1 * alpha1 + sum1;
#pragma unroll
            for (int i = 0; i < D_TILES; ++i) {
                o[i][0] *= alpha0;
                o[i][1] *= alpha0;
                o[i][2] *= alpha1;
                o[i][3] *= alpha1;
            }
            // B fragment of V (keys x dims): lane holds keys 2 t, 2 t + 1 (and + 8) of column g.
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk)
#pragma unroll
                for (int i = 0; i < D_TILES; ++i) {
                    const int key = 16 * kk + 2 * t, c = 8 * i + g;
                    const uint32_t b0 = ember_fa_pack_halves(tile.v[key][c], tile.v[key + 1][c]);
                    const uint32_t b1 = ember_fa_pack_halves(tile.v[key + 8][c], tile.v[key + 9][c]);
                    ember_fa_mma(o[i], pa[kk], b0, b1);
                }
        }
        segment_start = segment_end;
    }

    // Row sums: each lane summed its own columns.
#pragma unroll
    for (int mask = 1; mask <= 2; mask <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, mask);
        l1 += __shfl_xor_sync(0xffffffffu, l1, mask);
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    float* dst0 = out + ((size_t)(t0 + r0) * n_heads + h) * D;
    float* dst1 = out + ((size_t)(t0 + r1) * n_heads + h) * D;
#pragma unroll
    for (int i = 0; i < D_TILES; ++i) {
        const int c = 8 * i + 2 * t;
        if (r0 < n_rows) *(float2*)(dst0 + c) = make_float2(o[i][0] * inv0, o[i][1] * inv0);
        if (r1 < n_rows) *(float2*)(dst1 + c) = make_float2(o[i][2] * inv1, o[i][3] * inv1);
    }
}

#define EMBER_ATTENTION_PREFILL_MMA(name, d)                                                                                            \
    EMBER_KERNEL void name(float* out, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* block_tables, \
                           const int32_t* table_of_token, const int32_t* positions, uint32_t n_tokens, uint32_t n_heads,               \
                           uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks_per_table, float scale,    \
                           int32_t window, float softcap) {                                                                          \
        (void)head_dim;                                                                                                                  \
        ember_attention_prefill_mma<d>(out, q, k_blocks, v_blocks, block_tables, table_of_token, positions, n_tokens, n_heads,           \
                                       n_kv_heads, block_size, max_blocks_per_table, scale, window, softcap);                          \
    }

EMBER_ATTENTION_PREFILL_MMA(ember_attention_prefill_mma_d64, 64)
EMBER_ATTENTION_PREFILL_MMA(ember_attention_prefill_mma_d128, 128)

#endif  // EMBER_PLATFORM_CUDA
