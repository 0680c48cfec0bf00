//! A batch: tokens of one or several sequences evaluated in one forward pass.
//!
//! Batch-first from the start (as in llama.cpp's `llama_batch`): a single prompt is a batch of one
//! sequence, and a server step is a batch of many. Each token carries its position and its
//! sequence id, and says whether its logits are wanted (usually only each sequence's last token).

/// Identifies a sequence in the KV cache.
pub type SeqId = u32;

/// Tokens to evaluate together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Position of each token in its sequence (0-based).
    pub positions: Vec<u32>,
    /// Sequence of each token.
    pub seq_ids: Vec<SeqId>,
    /// Whether the forward pass returns logits for each token.
    pub want_logits: Vec<bool>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Batch::default()
    }

    /// Adds one token.
    pub fn push(&mut self, token: u32, position: u32, seq_id: SeqId, want_logits: bool) {
        self.tokens.push(token);
        self.positions.push(position);
        self.seq_ids.push(seq_id);
        self.want_logits.push(want_logits);
    }

    /// A batch holding `tokens` of one sequence at positions `start..`; only the last token's
    /// logits are wanted, unless `all_logits`.
    pub fn for_sequence(seq_id: SeqId, start: u32, tokens: &[u32], all_logits: bool) -> Self {
        let mut batch = Batch::new();
        for (i, &t) in tokens.iter().enumerate() {
            batch.push(
                t,
                start + i as u32,
                seq_id,
                all_logits || i + 1 == tokens.len(),
            );
        }
        batch
    }

    /// Removes every token, keeping the allocations.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seq_ids.clear();
        self.want_logits.clear();
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the batch has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Indices of the tokens whose logits are wanted, in batch order.
    pub fn output_rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.want_logits
            .iter()
            .enumerate()
            .filter(|(_, &w)| w)
            .map(|(i, _)| i)
    }
}
