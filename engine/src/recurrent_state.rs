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
//! blocks would come without the state at that prefix), and a forward pass that fails ends the
//! batch's sequences instead of rolling them back (on the CPU a pass cannot fail once its layers
//! run; on a GPU a failed op may leave some layers' states updated and others not).
//!
//! The states live where the backend computes: each sequence's is one backend buffer
//! ([`Backend::state_alloc`]) holding every linear-attention layer's state, host memory on the
//! CPU, a device buffer of its own purpose in the pool's accounting on a GPU (so memory reports
//! show it apart from KV and scratch, and it goes back to the pool when the sequence ends). The
//! same store serves both backends.
//! A GPU records decode steps as graphs and, when a recording cannot be run, runs the pass again
//! with plain launches; that is only sound because no op of a pass reaches the states before
//! the recording runs (see the GPU backend's `gated_delta_net`).

use std::collections::BTreeMap;

use crate::backend::{Backend, SequenceState};
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
pub struct RecurrentStates<B: Backend> {
    n_layers: usize,
    conv_len: usize,
    ssm_len: usize,
    /// Per sequence, `n_layers` blocks of `conv_len + ssm_len` values (the convolution state,
    /// then the delta-rule state) in one backend buffer.
    seqs: BTreeMap<SeqId, B::Buf>,
}

impl<B: Backend> std::fmt::Debug for RecurrentStates<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecurrentStates")
            .field("n_layers", &self.n_layers)
            .field("sequences", &self.seqs.len())
            .finish()
    }
}

impl<B: Backend> RecurrentStates<B> {
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

    /// Makes zeroed states for sequences that have none (a sequence's first batch), from
    /// `backend` (a device backend records a failed allocation as an op failure, which fails
    /// the forward pass).
    pub fn ensure(&mut self, backend: &B, seq_ids: impl IntoIterator<Item = SeqId>) {
        if !self.is_used() {
            return;
        }
        let len = self.per_sequence();
        for seq_id in seq_ids {
            self.seqs
                .entry(seq_id)
                .or_insert_with(|| backend.state_alloc(len));
        }
    }

    /// Whether `seq_id` has a state.
    pub fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// The states of layer `layer` (its index among the linear-attention layers) of the
    /// sequences in `groups` (each a sequence and its batch rows), as the backend op takes them.
    /// Every sequence must have a state ([`RecurrentStates::ensure`]).
    ///
    /// The sequences come in the store's order (by id), the same for every layer of a pass.
    pub fn layer_states<'a>(
        &'a mut self,
        layer: usize,
        groups: &'a [(SeqId, Vec<usize>)],
    ) -> Vec<SequenceState<'a, B::Buf>> {
        let block = self.conv_len + self.ssm_len;
        let mut states = Vec::with_capacity(groups.len());
        for (seq_id, state) in self.seqs.iter_mut() {
            let Some((_, rows)) = groups.iter().find(|(s, _)| s == seq_id) else {
                continue;
            };
            states.push(SequenceState {
                rows,
                state,
                offset: layer * block,
            });
        }
        states
    }

    /// Values of one layer's convolution state per sequence (the start of its delta-rule state
    /// within the layer's part).
    pub fn conv_len(&self) -> usize {
        self.conv_len
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
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn states_are_made_zeroed_split_per_layer_and_freed() {
        let backend = CpuBackend::new(1).expect("a CPU backend");
        let mut store = RecurrentStates::<CpuBackend>::new(2, 3, 5);
        store.ensure(&backend, [4, 9]);
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
            // By sequence id, whatever the order of the groups.
            assert_eq!(states[0].rows, &[2]);
            assert_eq!(states[1].rows, &[0, 1]);
            for s in &mut states {
                assert_eq!((s.state.len(), s.offset), (16, layer * 8));
                let part = &mut s.state[s.offset..s.offset + 8];
                assert!(part.iter().all(|&v| v == 0.0));
                // The first value of the layer's delta-rule state.
                part[3] = layer as f32 + 1.0;
            }
        }
        let only_nine = vec![(9, vec![0])];
        let states = store.layer_states(1, &only_nine);
        assert_eq!(states.len(), 1);
        assert_eq!(states[0].state[8 + 3], 2.0);
        assert_eq!(states[0].state[3], 1.0);
        store.free_sequence(9);
        assert!(!store.contains(9) && store.contains(4));
        store.clear();
        assert_eq!(store.stats().bytes, 0);
        let mut dense = RecurrentStates::<CpuBackend>::new(0, 0, 0);
        dense.ensure(&backend, [1]);
        assert!(!dense.is_used() && dense.stats().sequences == 0);
    }
}
