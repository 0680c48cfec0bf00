//! Per-sequence recurrent state of hybrid models, beside the paged KV cache.
//!
//! The linear-attention layers of a hybrid model (Qwen 3.5's Gated DeltaNet) do not attend over
//! the past tokens; each keeps, per sequence, a fixed-size state that summarises them: the last
//! `conv_kernel - 1` inputs of its causal convolution and the delta rule's matrix per value head.
//! A sequence's states are made (zeroed) when its first batch runs and freed with the sequence,
//! like its KV blocks (llama.cpp's `llama_memory_recurrent` keeps the same two tensors per layer
//! and sequence, `r` and `s`). The full-attention layers of the same model keep using the KV
//! cache.
//!
//! **What a recurrent state cannot do.** It holds the sequence after its last token and nothing
//! earlier, so it cannot be cut back to a shorter length, nor shared between sequences that start
//! alike. Hence: truncating such a sequence to fewer tokens is refused (to zero it simply ends the
//! sequence), the engine does not use the prefix cache for these models (a cached prefix's KV
//! blocks would come without the state at that prefix), and a forward pass that fails after its
//! layers ran ends the batch's sequences instead of rolling them back (on the CPU, the only
//! backend that runs these models, a pass cannot fail once its layers run).
//!
//! The states live in host memory: only the CPU backend runs linear attention, and a device
//! backend refuses such models at load time.

use std::collections::BTreeMap;

use crate::backend::SequenceState;
use crate::batch::SeqId;

/// Counts of the state store, for metrics and memory reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateStats {
    /// Sequences holding a state.
    pub sequences: usize,
    /// Bytes of one sequence's states (all linear-attention layers).
    pub bytes_per_sequence: usize,
    /// Bytes held now.
    pub bytes: usize,
}

/// The recurrent states of every live sequence of one model instance.
#[derive(Debug, Default)]
pub struct RecurrentStates {
    n_layers: usize,
    conv_len: usize,
    ssm_len: usize,
    /// Per sequence, `n_layers` blocks of `conv_len + ssm_len` floats (the convolution state,
    /// then the delta-rule state).
    seqs: BTreeMap<SeqId, Vec<f32>>,
}

impl RecurrentStates {
    /// A store for `n_layers` linear-attention layers whose convolution and delta-rule states
    /// have `conv_len` and `ssm_len` floats. With no layers it holds nothing.
    pub fn new(n_layers: usize, conv_len: usize, ssm_len: usize) -> Self {
        RecurrentStates {
            n_layers,
            conv_len,
            ssm_len,
            seqs: BTreeMap::new(),
        }
    }

    /// Whether the model has linear-attention layers.
    pub fn is_used(&self) -> bool {
        self.n_layers > 0
    }

    fn per_sequence(&self) -> usize {
        self.n_layers * (self.conv_len + self.ssm_len)
    }

    /// Makes zeroed states for sequences that have none (a sequence's first batch).
    pub fn ensure(&mut self, seq_ids: impl IntoIterator<Item = SeqId>) {
        if !self.is_used() {
            return;
        }
        let len = self.per_sequence();
        for seq_id in seq_ids {
            self.seqs.entry(seq_id).or_insert_with(|| vec![0.0; len]);
        }
    }

    /// Whether `seq_id` has a state.
    pub fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// The states of layer `layer` (its index among the linear-attention layers) of the
    /// sequences in `groups` (each a sequence and its batch rows), as the backend op takes them.
    /// Every sequence must have a state ([`RecurrentStates::ensure`]).
    pub fn layer_states<'a>(
        &'a mut self,
        layer: usize,
        groups: &'a [(SeqId, Vec<usize>)],
    ) -> Vec<SequenceState<'a>> {
        let (conv_len, ssm_len) = (self.conv_len, self.ssm_len);
        let block = conv_len + ssm_len;
        let mut states = Vec::with_capacity(groups.len());
        for (seq_id, data) in self.seqs.iter_mut() {
            let Some((_, rows)) = groups.iter().find(|(s, _)| s == seq_id) else {
                continue;
            };
            let (conv, ssm) = data[layer * block..(layer + 1) * block].split_at_mut(conv_len);
            states.push(SequenceState { rows, conv, ssm });
        }
        states
    }

    /// Frees a sequence's states.
    pub fn free_sequence(&mut self, seq_id: SeqId) {
        self.seqs.remove(&seq_id);
    }

    /// Frees every sequence's states.
    pub fn clear(&mut self) {
        self.seqs.clear();
    }

    /// Counts for reports.
    pub fn stats(&self) -> StateStats {
        let bytes_per_sequence = self.per_sequence() * std::mem::size_of::<f32>();
        StateStats {
            sequences: self.seqs.len(),
            bytes_per_sequence,
            bytes: self.seqs.len() * bytes_per_sequence,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_made_zeroed_split_per_layer_and_freed() {
        let mut store = RecurrentStates::new(2, 3, 5);
        store.ensure([4, 9]);
        assert_eq!(
            store.stats(),
            StateStats {
                sequences: 2,
                bytes_per_sequence: 2 * 8 * 4,
                bytes: 2 * 2 * 8 * 4
            }
        );
        let groups = vec![(9, vec![0, 1]), (4, vec![2])];
        for layer in 0..2 {
            let mut states = store.layer_states(layer, &groups);
            assert_eq!(states.len(), 2);
            for s in &mut states {
                assert_eq!((s.conv.len(), s.ssm.len()), (3, 5));
                assert!(s.conv.iter().chain(s.ssm.iter()).all(|&v| v == 0.0));
                s.ssm[0] = layer as f32 + 1.0;
            }
        }
        let only_nine = vec![(9, vec![0])];
        let states = store.layer_states(1, &only_nine);
        assert_eq!(states.len(), 1);
        assert_eq!(states[0].ssm[0], 2.0);
        store.free_sequence(9);
        assert!(!store.contains(9) && store.contains(4));
        store.clear();
        assert_eq!(store.stats().bytes, 0);
        let mut dense = RecurrentStates::new(0, 0, 0);
        dense.ensure([1]);
        assert!(!dense.is_used() && dense.stats().sequences == 0);
    }
}
