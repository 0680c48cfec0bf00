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
//! itself lives in the backend ([`Backend::KvLayer`]), one per layer that attends over the
//! cache, indexed by block id. The linear-attention layers of hybrid models keep a fixed-size
//! state per sequence instead, in [`crate::recurrent_state`] beside this cache.
//!
//! **Prefix cache** (vLLM's automatic prefix caching, in the same spirit): a full block is named
//! by its content, a hash chained over every token from the start of the sequence up to the
//! block's end ([`KvCache::register_full_blocks`]). Blocks are reference-counted, so several
//! sequences can share the blocks of a common prefix ([`KvCache::attach_prefix`]). When no
//! sequence uses a named block any more it is kept, evictable, in least-recently-used order;
//! allocation takes plain free blocks first and evicts the oldest cached ones only when those run
//! out, and [`KvCache::evict_cached`] drops them all (before an idle trim gives memory back). A
//! full block is never written again while shared: sequences only append, and a block is named
//! only once it is full.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

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
    /// Leading blocks already named in the prefix cache (or found unnameable), and the chained
    /// hash of the last of them.
    named: usize,
    chain: u64,
}

/// Counts of the block pool, for tests, metrics and `ember info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks the pool may hand out in all.
    pub capacity: usize,
    /// Blocks owned by sequences (a block shared by several counts once).
    pub used: usize,
    /// Blocks that have memory (used ones, cached ones and free ones kept for reuse).
    pub resident: usize,
    /// Blocks kept only by the prefix cache: no sequence uses them, and they are evicted first
    /// when blocks run out.
    pub cached: usize,
}

/// A block's name in the prefix cache: the chained hash, and what it was computed from, so that a
/// hash collision can never hand out the wrong block.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockName {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

/// The chained hash of a block of `tokens` following a prefix whose hash is `parent` (0 for the
/// first block). `DefaultHasher::new()` has fixed keys, so names are stable within the process.
fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    // 0 is reserved for "no parent".
    hasher.finish().max(1)
}

/// The paged KV cache of one model instance.
pub struct KvCache<B: Backend> {
    block_size: usize,
    n_ctx: usize,
    layers: Vec<B::KvLayer>,
    /// Released block ids; popped from the end, so the most recently released are reused first.
    free: Vec<u32>,
    /// Blocks `fresh..capacity` were never handed out: they are free, and the per-block state
    /// below (and the backend's per-layer tables) only reach `fresh`, so the bookkeeping grows
    /// with the tokens cached rather than with the capacity (a context of millions of tokens
    /// holding one prompt costs a few blocks).
    fresh: u32,
    resident: Vec<bool>,
    seqs: BTreeMap<SeqId, Sequence>,
    capacity: usize,
    scratch_new_blocks: Vec<u32>,
    /// Sequences using each block.
    refs: Vec<u32>,
    /// The prefix-cache name of each block, if it has one.
    names: Vec<Option<BlockName>>,
    /// Named blocks by hash.
    by_hash: HashMap<u64, u32>,
    /// Named blocks no sequence uses, by the tick of their last use (oldest first).
    lru: BTreeMap<u64, u32>,
    /// The tick under which each block sits in `lru`.
    lru_tick: Vec<u64>,
    tick: u64,
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
            free: Vec::new(),
            fresh: 0,
            resident: Vec::new(),
            seqs: BTreeMap::new(),
            capacity: capacity_blocks,
            scratch_new_blocks: Vec::new(),
            refs: Vec::new(),
            names: Vec::new(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick: Vec::new(),
            tick: 0,
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
            used: self.capacity - self.free_blocks() - self.lru.len(),
            resident: self.resident.iter().filter(|&&r| r).count(),
            cached: self.lru.len(),
        }
    }

    /// Blocks a batch can still get: free ones plus cached ones that would be evicted.
    pub fn available_blocks(&self) -> usize {
        self.free_blocks() + self.lru.len()
    }

    /// Blocks that are free: released ones and those never handed out.
    fn free_blocks(&self) -> usize {
        self.free.len() + (self.capacity - self.fresh as usize)
    }

    /// Blocks `seq_id` needs beyond those it holds to grow to `new_len` tokens.
    pub fn blocks_needed(&self, seq_id: SeqId, new_len: usize) -> usize {
        let have = self.seqs.get(&seq_id).map_or(0, |s| s.blocks.len());
        new_len.div_ceil(self.block_size).saturating_sub(have)
    }

    /// Sequences in the cache.
    pub fn n_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The cached blocks holding the longest run of whole blocks at the start of `tokens`, in
    /// order (empty when the first block is not cached). Changes nothing; pass the result to
    /// [`KvCache::attach_prefix`].
    pub fn lookup_prefix(&self, tokens: &[u32]) -> Vec<u32> {
        let mut found = Vec::new();
        let mut parent = 0;
        for chunk in tokens.chunks_exact(self.block_size) {
            let hash = chain_hash(parent, chunk);
            let Some(&block) = self.by_hash.get(&hash) else {
                break;
            };
            let name = self.names[block as usize].as_ref();
            if !name.is_some_and(|n| n.parent == parent && *n.tokens == *chunk) {
                break;
            }
            found.push(block);
            parent = hash;
        }
        found
    }

    /// Starts sequence `seq_id` (which must not exist) on the shared blocks `blocks` found by
    /// [`KvCache::lookup_prefix`]: it holds `blocks.len() * block_size` tokens without computing
    /// them.
    pub fn attach_prefix(&mut self, seq_id: SeqId, blocks: &[u32]) {
        debug_assert!(!self.seqs.contains_key(&seq_id), "sequence {seq_id} exists");
        let mut chain = 0;
        for &block in blocks {
            let b = block as usize;
            if self.refs[b] == 0 {
                self.lru.remove(&self.lru_tick[b]);
            }
            self.refs[b] += 1;
            chain = self.names[b].as_ref().map_or(0, |n| n.hash);
        }
        if blocks.is_empty() {
            return;
        }
        self.seqs.insert(
            seq_id,
            Sequence {
                blocks: blocks.to_vec(),
                len: blocks.len() * self.block_size,
                named: blocks.len(),
                chain,
            },
        );
    }

    /// Names the full blocks of `seq_id` that are not named yet, given the sequence's tokens
    /// (at least its cached length), so later sequences starting with the same tokens can share
    /// them. A block whose content is already cached under another block stays unnamed.
    pub fn register_full_blocks(&mut self, seq_id: SeqId, tokens: &[u32]) {
        let block_size = self.block_size;
        let Some(seq) = self.seqs.get_mut(&seq_id) else {
            return;
        };
        let full = seq.len.min(tokens.len()) / block_size;
        while seq.named < full {
            let i = seq.named;
            let chunk = &tokens[i * block_size..(i + 1) * block_size];
            let hash = chain_hash(seq.chain, chunk);
            let block = seq.blocks[i];
            if self.names[block as usize].is_none() && !self.by_hash.contains_key(&hash) {
                self.names[block as usize] = Some(BlockName {
                    hash,
                    parent: seq.chain,
                    tokens: chunk.into(),
                });
                self.by_hash.insert(hash, block);
            }
            seq.chain = hash;
            seq.named += 1;
        }
    }

    /// Drops every cached block no sequence uses (their memory stays until [`KvCache::trim`]).
    /// Returns how many were dropped.
    pub fn evict_cached(&mut self) -> usize {
        let n = self.lru.len();
        while let Some((_, block)) = self.lru.pop_first() {
            self.unname(block);
            self.free.push(block);
        }
        n
    }

    fn unname(&mut self, block: u32) {
        if let Some(name) = self.names[block as usize].take() {
            self.by_hash.remove(&name.hash);
        }
    }

    /// Takes a block for a sequence: a plain free block, else the least recently used cached
    /// one (losing its name). The caller has checked that one exists.
    fn take_block(&mut self) -> u32 {
        let block = match self.free.pop() {
            Some(block) => block,
            None if (self.fresh as usize) < self.capacity => {
                let block = self.fresh;
                self.fresh += 1;
                self.resident.push(false);
                self.refs.push(0);
                self.names.push(None);
                self.lru_tick.push(0);
                block
            }
            None => {
                let (_, block) = self.lru.pop_first().expect("available blocks were counted");
                self.unname(block);
                block
            }
        };
        self.refs[block as usize] = 1;
        block
    }

    /// Lets go of one sequence's hold on `block`: with no holder left, a named block goes to the
    /// cache, any other to the free list.
    fn release_block(&mut self, block: u32) {
        let b = block as usize;
        self.refs[b] = self.refs[b].saturating_sub(1);
        if self.refs[b] > 0 {
            return;
        }
        if self.names[b].is_some() {
            self.tick += 1;
            self.lru_tick[b] = self.tick;
            self.lru.insert(self.tick, block);
        } else {
            self.free.push(block);
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
            // Released in reverse so the sequence's first blocks are the next ones handed out.
            for &block in seq.blocks.iter().rev() {
                self.release_block(block);
            }
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
        if needed > self.available_blocks() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.available_blocks(),
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
        let mut evicted_names: Vec<(u32, BlockName)> = Vec::new();
        for (&seq_id, &new_len) in &next_pos {
            let have = self.seqs.get(&seq_id).map_or(0, |s| s.blocks.len());
            for _ in have..new_len.div_ceil(self.block_size) {
                // Keep what eviction takes, so a failed allocation can put it back.
                let from_cache = self.free_blocks() == 0;
                let name_before = if from_cache {
                    self.lru
                        .first_key_value()
                        .and_then(|(_, &b)| self.names[b as usize].clone().map(|n| (b, n)))
                } else {
                    None
                };
                let block = self.take_block();
                if let Some(entry) = name_before {
                    evicted_names.push(entry);
                }
                self.seqs.entry(seq_id).or_default().blocks.push(block);
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
                self.undo_allocation(backend, &before, evicted_names);
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
    fn undo_allocation(
        &mut self,
        backend: &B,
        before: &[(SeqId, Option<usize>)],
        evicted_names: Vec<(u32, BlockName)>,
    ) {
        for layer in &mut self.layers {
            backend.kv_release(layer, &self.scratch_new_blocks);
        }
        for &block in &self.scratch_new_blocks {
            self.resident[block as usize] = false;
        }
        // Sequences were extended in ascending id order, popping from the end of the free list;
        // pushing their new blocks back in the reverse order restores the list exactly. Blocks
        // taken from the prefix cache go back to it under their names (a block that lost its
        // memory above was free, never cached, so cached blocks keep their contents).
        let evicted: HashMap<u32, BlockName> = evicted_names.into_iter().collect();
        for &(seq_id, old_blocks) in before.iter().rev() {
            let Some(seq) = self.seqs.get_mut(&seq_id) else {
                continue;
            };
            let added: Vec<u32> = seq.blocks.drain(old_blocks.unwrap_or(0)..).collect();
            for &block in added.iter().rev() {
                self.refs[block as usize] = 0;
                match evicted.get(&block) {
                    Some(name) => {
                        self.by_hash.insert(name.hash, block);
                        self.names[block as usize] = Some(name.clone());
                        self.tick += 1;
                        self.lru_tick[block as usize] = self.tick;
                        self.lru.insert(self.tick, block);
                    }
                    // The newest block never handed out before goes back to never handed out.
                    None if block + 1 == self.fresh => {
                        self.fresh -= 1;
                        self.resident.pop();
                        self.refs.pop();
                        self.names.pop();
                        self.lru_tick.pop();
                    }
                    None => self.free.push(block),
                }
            }
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
            // Whole blocks past `len` keep their names and contents; a named block cut in the
            // middle will be rewritten, so it loses its name (it is never shared: only the
            // scheduler shares blocks, and it never truncates).
            seq.named = seq.named.min(len / block_size);
            let partial = (!len.is_multiple_of(block_size)).then(|| seq.blocks[keep - 1]);
            for &block in released.iter().rev() {
                self.release_block(block);
            }
            if let Some(block) = partial {
                self.unname(block);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    const BLOCK: usize = 4;

    fn cache(backend: &CpuBackend, blocks: usize) -> KvCache<CpuBackend> {
        KvCache::new(backend, &[(1, 8)], BLOCK, 64, blocks)
    }

    /// Feeds `tokens` to `seq_id` (continuing it) and names its full blocks.
    fn feed(kv: &mut KvCache<CpuBackend>, backend: &CpuBackend, seq_id: SeqId, tokens: &[u32]) {
        let start = kv.seq_len(seq_id);
        let batch = Batch::for_sequence(seq_id, start as u32, &tokens[start..], false);
        let mut plan = AttentionPlan::default();
        kv.plan(backend, &batch, &mut plan).expect("fits");
        kv.register_full_blocks(seq_id, tokens);
    }

    /// A context of 2^24 tokens holding a few: the cache's per-block state and the layers'
    /// tables reach only the blocks used (case 6 of issue 13: they were sized from `-c`).
    #[test]
    fn bookkeeping_grows_with_the_tokens_not_the_capacity() {
        let backend = CpuBackend::new(1).expect("thread pool");
        let capacity = (1usize << 24) / BLOCK;
        let mut kv = KvCache::new(&backend, &[(1, 8), (1, 8)], BLOCK, 1 << 24, capacity);
        assert_eq!(kv.available_blocks(), capacity);
        let mut plan = AttentionPlan::default();
        let tokens: Vec<u32> = (0..10).collect();
        let batch = Batch::for_sequence(1, 0, &tokens, false);
        kv.plan(&backend, &batch, &mut plan).expect("fits");
        assert_eq!(kv.block_table(1), [0, 1, 2]);
        assert_eq!(kv.available_blocks(), capacity - 3);
        assert_eq!(kv.stats().used, 3);
        let lens = |kv: &KvCache<CpuBackend>| {
            [
                kv.resident.len(),
                kv.refs.len(),
                kv.names.len(),
                kv.lru_tick.len(),
                kv.layer(0).blocks_tracked(),
                kv.layer(1).blocks_tracked(),
            ]
        };
        assert_eq!(lens(&kv), [3; 6]);
        // Released blocks are handed out again before new ones.
        kv.free_sequence(1);
        assert_eq!(kv.available_blocks(), capacity);
        let batch = Batch::for_sequence(2, 0, &tokens[..6], false);
        kv.plan(&backend, &batch, &mut plan).expect("fits");
        assert_eq!(kv.block_table(2), [0, 1]);
        assert_eq!(lens(&kv), [3; 6]);
        assert_eq!(kv.stats().resident, 3);
        // A sequence past the context is refused as before.
        let long: Vec<u32> = vec![1; 9];
        let batch = Batch::for_sequence(3, (1 << 24) - 4, &long, false);
        assert!(kv.plan(&backend, &batch, &mut plan).is_err());
        assert_eq!(lens(&kv), [3; 6]);
    }

    #[test]
    fn a_shared_prefix_is_found_attached_and_kept_until_evicted() {
        let backend = CpuBackend::new(1).expect("thread pool");
        let mut kv = cache(&backend, 8);
        let prompt: Vec<u32> = (0..10).collect();
        feed(&mut kv, &backend, 0, &prompt);
        // 10 tokens: two full blocks are named, the third is partial.
        assert_eq!(kv.lookup_prefix(&prompt), kv.block_table(0)[..2].to_vec());
        let shared = kv.lookup_prefix(&prompt[..9]);
        assert_eq!(shared.len(), 2);
        kv.attach_prefix(1, &shared);
        assert_eq!(kv.seq_len(1), 8);
        assert_eq!(
            kv.stats().used,
            3,
            "two shared blocks and one private block"
        );
        // A different continuation after the shared blocks goes to new blocks.
        let mut other = prompt[..8].to_vec();
        other.extend([100, 101]);
        feed(&mut kv, &backend, 1, &other);
        assert_eq!(kv.block_table(1)[..2], kv.block_table(0)[..2]);
        assert_ne!(kv.block_table(1)[2], kv.block_table(0)[2]);
        assert_eq!(kv.stats().used, 4);

        kv.free_sequence(0);
        kv.free_sequence(1);
        let stats = kv.stats();
        assert_eq!(stats.used, 0);
        assert_eq!(stats.cached, 2, "the two named blocks stay cached");
        assert_eq!(kv.available_blocks(), 8);
        assert_eq!(kv.lookup_prefix(&prompt).len(), 2);
        assert_eq!(kv.evict_cached(), 2);
        assert!(kv.lookup_prefix(&prompt).is_empty());
        assert_eq!(kv.stats().cached, 0);
    }

    #[test]
    fn a_prefix_that_differs_in_any_earlier_block_is_not_shared() {
        let backend = CpuBackend::new(1).expect("thread pool");
        let mut kv = cache(&backend, 8);
        let prompt: Vec<u32> = (0..8).collect();
        feed(&mut kv, &backend, 0, &prompt);
        let mut changed = prompt.clone();
        changed[0] = 99;
        // The second block's tokens are equal, but its chain includes the first block.
        assert!(kv.lookup_prefix(&changed).is_empty());
        let mut tail_changed = prompt.clone();
        tail_changed[5] = 99;
        assert_eq!(kv.lookup_prefix(&tail_changed).len(), 1);
    }

    #[test]
    fn cached_blocks_are_evicted_oldest_first_when_blocks_run_out() {
        let backend = CpuBackend::new(1).expect("thread pool");
        let mut kv = cache(&backend, 4);
        let a: Vec<u32> = (0..4).collect();
        let b: Vec<u32> = (10..14).collect();
        feed(&mut kv, &backend, 0, &a);
        kv.free_sequence(0);
        feed(&mut kv, &backend, 1, &b);
        kv.free_sequence(1);
        assert_eq!(kv.stats().cached, 2);
        // Four blocks needed, two free: the two cached ones are evicted, `a`'s (older) first.
        let c: Vec<u32> = (20..34).collect();
        feed(&mut kv, &backend, 2, &c[..12]);
        assert_eq!(kv.stats().cached, 1);
        assert!(kv.lookup_prefix(&a).is_empty());
        assert_eq!(kv.lookup_prefix(&b).len(), 1);
        let batch = Batch::for_sequence(2, 12, &c[12..14], false);
        let mut plan = AttentionPlan::default();
        kv.plan(&backend, &batch, &mut plan)
            .expect("the last cached block is taken");
        assert_eq!(kv.stats().cached, 0);
        assert!(kv.lookup_prefix(&b).is_empty());
        let batch = Batch::for_sequence(3, 0, &[1], false);
        assert!(matches!(
            kv.plan(&backend, &batch, &mut plan),
            Err(KvError::OutOfBlocks { .. })
        ));
    }

    #[test]
    fn a_shared_block_is_freed_only_when_its_last_sequence_ends() {
        let backend = CpuBackend::new(1).expect("thread pool");
        let mut kv = cache(&backend, 4);
        let prompt: Vec<u32> = (0..5).collect();
        feed(&mut kv, &backend, 0, &prompt);
        let shared = kv.lookup_prefix(&prompt[..4]);
        kv.attach_prefix(1, &shared);
        kv.free_sequence(0);
        assert_eq!(
            kv.stats().used,
            1,
            "sequence 1 still holds the shared block"
        );
        assert_eq!(kv.stats().cached, 0);
        kv.free_sequence(1);
        assert_eq!(kv.stats().cached, 1);
        kv.evict_cached();
        kv.trim(&backend, 0);
        assert_eq!(kv.stats().resident, 0);
    }
}
