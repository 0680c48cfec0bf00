//! Plain descriptions that the model code, the KV cache and every backend share: where the
//! tokens of a batch go in the cache (the attention plan), how rotary embeddings pair up values
//! and with which frequencies, and the activation of a gated feed-forward block.
//!
//! A leaf module: it imports nothing from the rest of the crate, so the dependencies between the
//! others run one way (model -> KV cache -> backend).

use std::sync::atomic::{AtomicU64, Ordering};

/// Source of [`AttentionPlan::id`].
static NEXT_PLAN_ID: AtomicU64 = AtomicU64::new(1);

/// Where every token of a batch goes and what it attends to, derived from the block tables. It is
/// plain host data so any backend can read (or upload) it.
#[derive(Debug, Clone, Default)]
pub struct AttentionPlan {
    /// Unique per planned batch (`KvCache::plan`) in the process (0: never planned), so a device backend
    /// can tell whether the arrays it uploaded for a forward pass belong to this plan.
    pub id: u64,
    /// Token slots per block.
    pub block_size: usize,
    /// For each batch token, its slot: `block_id * block_size + offset`.
    pub slots: Vec<u32>,
    /// For each batch token, its position (it attends to positions `0..=position`).
    pub positions: Vec<u32>,
    /// For each batch token, the index of its sequence's table in `tables`.
    pub table_of_token: Vec<u32>,
    /// Block tables of the sequences in the batch.
    pub tables: Vec<Vec<u32>>,
}

impl AttentionPlan {
    /// The slot holding position `pos` of the sequence whose table is `table`.
    #[inline]
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Number of tokens in the planned batch.
    pub fn n_tokens(&self) -> usize {
        self.slots.len()
    }
}

impl AttentionPlan {
    /// A fresh plan id, unique in the process.
    pub fn next_id() -> u64 {
        NEXT_PLAN_ID.fetch_add(1, Ordering::Relaxed)
    }
}

/// How rotary position embedding pairs up the elements of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// GGML's "normal" mode (Llama): pairs are adjacent elements `(2i, 2i + 1)`.
    Normal,
    /// GGML's NeoX mode (Qwen, Gemma): pairs are `(i, i + n_dims / 2)`.
    Neox,
}

/// The frequencies of one rotary embedding, as GGML's `rope_ext` takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams<'a> {
    /// How many leading elements of each head are rotated (even, at most the head size).
    pub n_dims: usize,
    /// Base of the geometric frequency sequence.
    pub freq_base: f32,
    /// Linear position scaling (1 / rope scaling factor).
    pub freq_scale: f32,
    /// Per-pair frequency divisors (Llama 3's `rope_freqs.weight`), `n_dims / 2` values.
    pub freq_factors: Option<&'a [f32]>,
}

/// The activation of the feed-forward network's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnActivation {
    /// `silu(gate) * up`.
    SwiGlu,
    /// `gelu_tanh(gate) * up`.
    GeGlu,
}
