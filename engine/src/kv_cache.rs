//! Paged KV cache: fixed-size blocks, a block table per sequence, blocks on demand.
//!
//! The idea is vLLM's PagedAttention: K/V memory is cut into blocks of `block_size` token slots;
//! each sequence owns a list of block ids (its block table) and position `p` of the sequence lives
//! in slot `p % block_size` of block `table[p / block_size]`. Blocks come from a pool shared by all
//! sequences and go back to it when a sequence is freed, so nothing is reserved for the whole
//! context up front and memory follows the live tokens. Free blocks keep their memory for reuse
//! until [`KvCache::trim`] hands it back to the backend.
//!
//! The cache keeps the bookkeeping (which block belongs to whom) on the host; the K/V memory
//! itself lives in the backend ([`Backend::KvLayer`]), one per layer, indexed by block id.

use std::collections::BTreeMap;

use crate::backend::{Backend, OpFailure};
use crate::batch::{Batch, SeqId};
pub use crate::ops::AttentionPlan;

/// Default tokens per block. 32 keeps block tables short and a block's K rows of one head in one
/// contiguous run long enough for the dot-product loops.
pub const DEFAULT_BLOCK_SIZE: usize = 32;

/// Why a batch could not be placed in the cache.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// A token's position is not the next position of its sequence.
    #[error("sequence {seq_id}: expected position {expected} for the next token, found {found}")]
    PositionMismatch {
        seq_id: SeqId,
        expected: u32,
        found: u32,
    },
    /// The sequence would grow past the context length.
    #[error("sequence {seq_id}: {needed} tokens do not fit in the context of {n_ctx} tokens")]
    ContextFull {
        seq_id: SeqId,
        needed: usize,
        n_ctx: usize,
    },
    /// The pool has too few free blocks for the batch.
    #[error("KV cache full: the batch needs {needed} more blocks, {free} are free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    /// The backend could not give the batch's new blocks memory (device out of memory or over
    /// its budget); nothing changed.
    #[error("KV cache blocks for the batch could not be given memory: {0}")]
    Memory(OpFailure),
    /// The batch's vectors have different lengths.
    #[error("malformed batch: {tokens} tokens, {positions} positions, {seq_ids} sequence ids, {want_logits} logit flags")]
    MalformedBatch {
        tokens: usize,
        positions: usize,
        seq_ids: usize,
        want_logits: usize,
    },
}

#[derive(Debug, Clone, Default)]
struct Sequence {
    blocks: Vec<u32>,
    len: usize,
}

/// Counts of the block pool, for tests, metrics and `ember info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks the pool may hand out in all.
    pub capacity: usize,
    /// Blocks owned by sequences.
    pub used: usize,
    /// Blocks that have memory (used ones and free ones kept for reuse).
    pub resident: usize,
}

/// The paged KV cache of one model instance.
pub struct KvCache<B: Backend> {
    block_size: usize,
    n_ctx: usize,
    layers: Vec<B::KvLayer>,
    /// Free block ids; popped from the end, so the lowest ids are reused first.
    free: Vec<u32>,
    resident: Vec<bool>,
    seqs: BTreeMap<SeqId, Sequence>,
    capacity: usize,
    scratch_new_blocks: Vec<u32>,
}

impl<B: Backend> KvCache<B> {
    /// A cache for sequences of up to `n_ctx` tokens, with `capacity_blocks` blocks of
    /// `block_size` tokens in all; `layer_shapes[l]` is `(n_kv_heads, head_dim)` of layer `l`.
    /// No block has memory until it is used.
    pub fn new(
        backend: &B,
        layer_shapes: &[(usize, usize)],
        block_size: usize,
        n_ctx: usize,
        capacity_blocks: usize,
    ) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let layers = layer_shapes
            .iter()
            .map(|&(n_kv_heads, head_dim)| {
                backend.kv_layer(capacity_blocks, block_size, n_kv_heads, head_dim)
            })
            .collect();
        KvCache {
            block_size,
            n_ctx,
            layers,
            free: (0..capacity_blocks as u32).rev().collect(),
            resident: vec![false; capacity_blocks],
            seqs: BTreeMap::new(),
            capacity: capacity_blocks,
            scratch_new_blocks: Vec::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The longest sequence the cache accepts.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Tokens currently cached for `seq_id` (0 for an unknown sequence).
    pub fn seq_len(&self, seq_id: SeqId) -> usize {
        self.seqs.get(&seq_id).map_or(0, |s| s.len)
    }

    /// Block table of `seq_id`.
    pub fn block_table(&self, seq_id: SeqId) -> &[u32] {
        self.seqs.get(&seq_id).map_or(&[], |s| &s.blocks)
    }

    /// Pool counts.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.capacity,
            used: self.capacity - self.free.len(),
            resident: self.resident.iter().filter(|&&r| r).count(),
        }
    }

    /// Bytes of K/V memory held now.
    pub fn resident_bytes(&self, backend: &B) -> usize {
        self.layers.iter().map(|l| backend.kv_bytes(l)).sum()
    }

    /// The storage of layer `layer`.
    pub fn layer(&self, layer: usize) -> &B::KvLayer {
        &self.layers[layer]
    }

    /// The storage of layer `layer`, for writing.
    pub fn layer_mut(&mut self, layer: usize) -> &mut B::KvLayer {
        &mut self.layers[layer]
    }

    /// Ends a sequence: its blocks go back to the pool (keeping their memory for reuse).
    pub fn free_sequence(&mut self, seq_id: SeqId) {
        if let Some(seq) = self.seqs.remove(&seq_id) {
            // Pushed in reverse so the sequence's first blocks are the next ones handed out.
            self.free.extend(seq.blocks.iter().rev());
        }
    }

    /// Ends every sequence.
    pub fn clear(&mut self) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.free_sequence(id);
        }
    }

    /// Hands the memory of free blocks back to the backend, keeping at most `keep_free` free
    /// blocks resident for quick reuse.
    pub fn trim(&mut self, backend: &B, keep_free: usize) {
        let mut resident_free: Vec<u32> = self
            .free
            .iter()
            .copied()
            .filter(|&b| self.resident[b as usize])
            .collect();
        if resident_free.len() <= keep_free {
            return;
        }
        // Keep the blocks that would be handed out next (the end of the free list).
        let release: Vec<u32> = resident_free
            .drain(..resident_free.len() - keep_free)
            .collect();
        for layer in &mut self.layers {
            backend.kv_release(layer, &release);
        }
        for b in release {
            self.resident[b as usize] = false;
        }
    }

    /// Checks a batch against the sequences' lengths, allocates the blocks it needs, advances the
    /// lengths and fills `plan`. On error nothing changes.
    pub fn plan(
        &mut self,
        backend: &B,
        batch: &Batch,
        plan: &mut AttentionPlan,
    ) -> Result<(), KvError> {
        let n = batch.tokens.len();
        if batch.positions.len() != n || batch.seq_ids.len() != n || batch.want_logits.len() != n {
            return Err(KvError::MalformedBatch {
                tokens: n,
                positions: batch.positions.len(),
                seq_ids: batch.seq_ids.len(),
                want_logits: batch.want_logits.len(),
            });
        }
        // First pass: check positions and count the new blocks, without changing anything.
        let mut next_pos: BTreeMap<SeqId, usize> = BTreeMap::new();
        for (&seq_id, &pos) in batch.seq_ids.iter().zip(&batch.positions) {
            let expected = *next_pos
                .entry(seq_id)
                .or_insert_with(|| self.seq_len(seq_id));
            if pos as usize != expected {
                return Err(KvError::PositionMismatch {
                    seq_id,
                    expected: expected as u32,
                    found: pos,
                });
            }
            if expected + 1 > self.n_ctx {
                return Err(KvError::ContextFull {
                    seq_id,
                    needed: expected + 1,
                    n_ctx: self.n_ctx,
                });
            }
            next_pos.insert(seq_id, expected + 1);
        }
        let needed: usize = next_pos
            .iter()
            .map(|(&seq_id, &new_len)| {
                let have = self.seqs.get(&seq_id).map_or(0, |s| s.blocks.len());
                new_len.div_ceil(self.block_size).saturating_sub(have)
            })
            .sum();
        if needed > self.free.len() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.free.len(),
                total: self.capacity,
            });
        }

        // Second pass: allocate, then fill the plan. What each sequence had before is kept so a
        // backend that cannot give the new blocks memory leaves the cache as it was.
        self.scratch_new_blocks.clear();
        let before: Vec<(SeqId, Option<usize>)> = next_pos
            .keys()
            .map(|&seq_id| (seq_id, self.seqs.get(&seq_id).map(|s| s.blocks.len())))
            .collect();
        for (&seq_id, &new_len) in &next_pos {
            let seq = self.seqs.entry(seq_id).or_default();
            while seq.blocks.len() * self.block_size < new_len {
                let block = self.free.pop().expect("free blocks were counted above");
                seq.blocks.push(block);
                if !self.resident[block as usize] {
                    self.resident[block as usize] = true;
                    self.scratch_new_blocks.push(block);
                }
            }
        }
        if !self.scratch_new_blocks.is_empty() {
            for layer in &mut self.layers {
                backend.kv_materialize(layer, &self.scratch_new_blocks);
            }
            if let Some(failure) = backend.take_failure() {
                self.undo_allocation(backend, &before);
                return Err(KvError::Memory(failure));
            }
        }

        plan.id = AttentionPlan::next_id();
        plan.block_size = self.block_size;
        plan.slots.clear();
        plan.positions.clear();
        plan.table_of_token.clear();
        plan.tables.clear();
        let mut table_index: BTreeMap<SeqId, u32> = BTreeMap::new();
        for (&seq_id, &pos) in batch.seq_ids.iter().zip(&batch.positions) {
            let seq = &self.seqs[&seq_id];
            let table = *table_index.entry(seq_id).or_insert_with(|| {
                plan.tables.push(seq.blocks.clone());
                (plan.tables.len() - 1) as u32
            });
            let p = pos as usize;
            plan.slots.push(
                (seq.blocks[p / self.block_size] as usize * self.block_size + p % self.block_size)
                    as u32,
            );
            plan.positions.push(pos);
            plan.table_of_token.push(table);
        }
        for (&seq_id, &new_len) in &next_pos {
            self.seqs.get_mut(&seq_id).expect("created above").len = new_len;
        }
        Ok(())
    }

    /// Undoes the second pass of [`KvCache::plan`]: the blocks just handed to the sequences go
    /// back to the free list (in the order they came from), those just given memory lose it again,
    /// and sequences that did not exist before are removed.
    fn undo_allocation(&mut self, backend: &B, before: &[(SeqId, Option<usize>)]) {
        for layer in &mut self.layers {
            backend.kv_release(layer, &self.scratch_new_blocks);
        }
        for &block in &self.scratch_new_blocks {
            self.resident[block as usize] = false;
        }
        // Sequences were extended in ascending id order, popping from the end of the free list;
        // pushing their new blocks back in the reverse order restores the list exactly.
        for &(seq_id, old_blocks) in before.iter().rev() {
            let Some(seq) = self.seqs.get_mut(&seq_id) else {
                continue;
            };
            let added: Vec<u32> = seq.blocks.drain(old_blocks.unwrap_or(0)..).collect();
            self.free.extend(added.iter().rev());
            if old_blocks.is_none() {
                self.seqs.remove(&seq_id);
            }
        }
        self.scratch_new_blocks.clear();
    }

    /// Puts a sequence back to `len` tokens after a forward pass that failed on the device: the
    /// slots past `len` are rewritten by the next pass. A sequence that had no tokens is removed.
    pub fn rollback_sequence(&mut self, seq_id: SeqId, len: usize) {
        if len == 0 {
            self.free_sequence(seq_id);
        } else {
            self.truncate_sequence(seq_id, len);
        }
    }

    /// Forgets the last tokens of a sequence so it has `len` tokens (blocks past the end go back
    /// to the pool). Used to re-evaluate from an earlier point.
    pub fn truncate_sequence(&mut self, seq_id: SeqId, len: usize) {
        let block_size = self.block_size;
        if let Some(seq) = self.seqs.get_mut(&seq_id) {
            if len >= seq.len {
                return;
            }
            seq.len = len;
            let keep = len.div_ceil(block_size);
            let released: Vec<u32> = seq.blocks.drain(keep..).collect();
            self.free.extend(released.iter().rev());
        }
    }
}
