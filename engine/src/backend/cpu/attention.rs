//! Causal grouped-query attention over the paged KV cache, on the CPU.
//!
//! Work is split by query tiles: runs of up to [`QUERY_TILE`] consecutive tokens of one sequence
//! share one walk over the sequence's blocks (through its block table), so each block's f16 keys
//! and values are converted to f32 once per tile rather than once per token. Single-token decoding
//! splits by KV head instead. Masking is by position: a token sees positions `0..=pos` of its own
//! sequence, or the last `window` of them on sliding-window layers.
//!
//! The arithmetic is GGML's CPU flash attention with an f16 cache, path for path, because that
//! is what llama.cpp runs by default and its outputs carry its rounding (the models amplify an
//! ulp of difference, so the same mathematics is not enough):
//! - batches of fewer than [`F32_PATH_MIN_TOKENS`] queries ([`attend`], GGML's `one_chunk`): the
//!   query rounded to f16, scores by `ggml_vec_dot_f16`, an online softmax key by key with
//!   `expf`, and the value accumulator rounded to f16 after every key;
//! - larger batches ([`attend_f32`], GGML's tiled path): f32 queries, keys in tiles of 64
//!   positions, GGML's vectorised `expf`, f32 accumulators;
//! - a single token over a cache view of 512 cells or more ([`attend_split`], GGML's split-KV
//!   path): the view cut into one chunk per thread, each attended like `one_chunk`, the
//!   partial results merged in chunk order. The split follows the thread count, as llama.cpp's
//!   does.
//!
//! GGML picks the path by the size of the whole batch. ember picks it by the number of tokens each
//! sequence has in the batch, which is the same thing for a batch of one sequence (so single runs
//! keep llama.cpp's numbers) and keeps a sequence's results independent of whatever else a
//! continuous-batching server puts in the same batch (so a request served among others gives what
//! it gives alone).

use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::{vec, CpuKvLayer};
use crate::ops::AttentionPlan;

/// Most query tokens of one sequence served by one pass over the cache.
const QUERY_TILE: usize = 32;

/// From this many query tokens in one batch on, GGML's CPU flash attention takes its tiled f32
/// path (`ggml_compute_forward_flash_attn_ext_tiled`, `GGML_FA_TILE_Q`); below it, the
/// one-query-at-a-time path with an f16 query and f16 accumulators.
const F32_PATH_MIN_TOKENS: usize = 64;

#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    rows: Vec<f32>,
    queries: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    /// Keys of one KV tile transposed (`[dim][key]`) and its values (`[key][dim]`), in f32.
    kt: Vec<f32>,
    vt: Vec<f32>,
}

struct Shape<'a> {
    q: &'a [f32],
    layer: &'a CpuKvLayer,
    plan: &'a AttentionPlan,
    group: usize,
    head_dim: usize,
    row_len: usize,
    kq_scale: f32,
    window: Option<usize>,
}

impl Shape<'_> {
    /// The first position token `t` attends to.
    fn first(&self, t: usize) -> usize {
        let pos = self.plan.positions[t] as usize;
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Splits the batch into tiles: runs of consecutive tokens of one sequence at consecutive
/// positions, at most [`QUERY_TILE`] long.
fn query_tiles(plan: &AttentionPlan) -> Vec<Range<usize>> {
    let mut tiles = Vec::new();
    let mut start = 0;
    for t in 1..=plan.n_tokens() {
        let split = t == plan.n_tokens()
            || t - start == QUERY_TILE
            || plan.table_of_token[t] != plan.table_of_token[t - 1]
            || plan.positions[t] != plan.positions[t - 1] + 1;
        if split {
            tiles.push(start..t);
            start = t;
        }
    }
    tiles
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    layer: &CpuKvLayer,
    plan: &AttentionPlan,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    kq_scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let group = n_heads / n_kv_heads;
    let row_len = n_heads * head_dim;
    let n_tokens = plan.n_tokens();
    let shape = Shape {
        q,
        layer,
        plan,
        group,
        head_dim,
        row_len,
        kq_scale,
        window,
    };
    let tiles = query_tiles(plan);
    // Tokens of each sequence (by its table) in this batch: the path is chosen per sequence.
    let mut per_table = vec![0usize; plan.tables.len()];
    for &table in &plan.table_of_token {
        per_table[table as usize] += 1;
    }
    let tokens_of = |t: usize| per_table[plan.table_of_token[t] as usize];
    let f32_path = |t: usize| tokens_of(t) >= F32_PATH_MIN_TOKENS && head_dim.is_multiple_of(16);
    let attend = |s: &Shape<'_>,
                  tile: Range<usize>,
                  kv_head: usize,
                  out: &mut [f32],
                  token_stride: usize,
                  base: usize,
                  scratch: &mut Scratch| {
        if f32_path(tile.start) {
            attend_f32(s, tile, kv_head, out, token_stride, base, scratch)
        } else {
            attend(s, tile, kv_head, out, token_stride, base, scratch)
        }
    };
    let threads = rayon::current_num_threads();
    let n_chunks = threads.max(1);
    // A sequence with one token in the batch over a long cache takes the split-KV path.
    let split = |t: usize| tokens_of(t) == 1 && split_kv_len(plan.positions[t] as usize).is_some();
    if tiles.len() >= 2 * threads {
        // Prompt processing with tiles enough for every thread: one task per tile, all KV heads.
        let mut parts = Vec::with_capacity(tiles.len());
        let mut rest = &mut out[..n_tokens * row_len];
        for tile in tiles {
            let (part, tail) = rest.split_at_mut(tile.len() * row_len);
            parts.push((tile, part));
            rest = tail;
        }
        parts
            .into_par_iter()
            .for_each_init(Scratch::default, |scratch, (tile, part)| {
                for kv_head in 0..n_kv_heads {
                    if tile.len() == 1 && split(tile.start) {
                        let at = kv_head * group * head_dim;
                        attend_split(
                            &shape,
                            tile.start,
                            kv_head,
                            n_chunks,
                            &mut part[at..at + group * head_dim],
                        );
                    } else {
                        attend(
                            &shape,
                            tile.clone(),
                            kv_head,
                            part,
                            row_len,
                            kv_head * group * head_dim,
                            scratch,
                        );
                    }
                }
            });
    } else if tiles.iter().any(|tile| tile.len() > 1) {
        // A prompt of fewer tiles than twice the threads (256 tokens are 8 tiles): one task per
        // (KV head, tile), so every thread has work and each tile still walks the cache once per
        // head. A task's outputs are strided in `out` (its head's columns of its tile's tokens),
        // so each writes its own run of a KV-head-major staging buffer, scattered afterwards.
        // The same `attend` calls on the same tiles as above: the same bits.
        let gd = group * head_dim;
        let mut staged = vec![0f32; n_kv_heads * n_tokens * gd];
        let mut tasks = Vec::with_capacity(n_kv_heads * tiles.len());
        let mut rest = staged.as_mut_slice();
        for kv_head in 0..n_kv_heads {
            for tile in &tiles {
                let (part, tail) = rest.split_at_mut(tile.len() * gd);
                tasks.push((kv_head, tile.clone(), part));
                rest = tail;
            }
        }
        tasks
            .into_par_iter()
            .for_each_init(Scratch::default, |scratch, (kv_head, tile, part)| {
                if tile.len() == 1 && split(tile.start) {
                    attend_split(&shape, tile.start, kv_head, n_chunks, part);
                } else {
                    attend(&shape, tile, kv_head, part, gd, 0, scratch);
                }
            });
        for (kv_head, head_rows) in staged.chunks_exact(n_tokens * gd).enumerate() {
            for (t, row) in head_rows.chunks_exact(gd).enumerate() {
                out[t * row_len + kv_head * gd..][..gd].copy_from_slice(row);
            }
        }
    } else {
        // Decoding: one task per (token, KV head); a token over a long cache takes GGML's
        // split-KV path (one KV chunk per thread, merged in order). On the decode team where
        // one is entered (see `ember_quant::team`).
        let parts: Vec<std::sync::Mutex<&mut [f32]>> = out[..n_tokens * row_len]
            .chunks_mut(group * head_dim)
            .map(std::sync::Mutex::new)
            .collect();
        ember_quant::team::for_each_index(parts.len(), |task| {
            let (t, kv_head) = (task / n_kv_heads, task % n_kv_heads);
            // Each task locks only its own part: never contended.
            let mut part = parts[task]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if split(t) {
                attend_split(&shape, t, kv_head, n_chunks, &mut part);
            } else {
                // Scratch of the task's own: nothing stays held past the op.
                let scratch = &mut Scratch::default();
                attend(&shape, t..t + 1, kv_head, &mut part, 0, 0, scratch);
            }
        });
    }
}

/// Attention of the tokens `tile` for KV head `kv_head`: query head `j` of the group of token `t`
/// is written at `out[(t - tile.start) * token_stride + base + j * head_dim..]`.
fn attend(
    s: &Shape<'_>,
    tile: Range<usize>,
    kv_head: usize,
    out: &mut [f32],
    token_stride: usize,
    base: usize,
    scratch: &mut Scratch,
) {
    let (group, hd) = (s.group, s.head_dim);
    let layer = s.layer;
    let block_size = layer.block_size;
    let t0 = tile.start;
    let n_tile = tile.len();
    let lo = s.first(t0);
    let hi = s.plan.positions[tile.end - 1] as usize;
    let span = hi + 1 - lo;
    let table = &s.plan.tables[s.plan.table_of_token[t0] as usize];

    let Scratch {
        scores,
        rows,
        queries,
        max,
        sum,
        ..
    } = scratch;
    scores.clear();
    scores.resize(n_tile * group * span, 0.0);
    rows.resize(block_size * hd, 0.0);
    // The queries, rounded to f16 as GGML converts them to the keys' type.
    queries.clear();
    for t in tile.clone() {
        queries.extend_from_slice(&s.q[t * s.row_len + kv_head * group * hd..][..group * hd]);
    }
    vec::round_f16(queries);

    // The positions of tile token `i` that fall in the run `run_lo..run_hi`.
    let overlap = |i: usize, run_lo: usize, run_hi: usize| {
        let t = t0 + i;
        let a = s.first(t).max(run_lo);
        let b = (s.plan.positions[t] as usize + 1).min(run_hi);
        a..b.max(a)
    };

    // Scores, block by block.
    for_each_run(lo, hi, block_size, |block_idx, start, end| {
        let block = table[block_idx] as usize;
        let n = end - start;
        let src = &layer.k[block][layer.row_offset(kv_head, start)..][..n * hd];
        src.convert_to_f32_slice(&mut rows[..n * hd]);
        let run_lo = block_idx * block_size + start;
        for i in 0..n_tile {
            let keys = overlap(i, run_lo, run_lo + n);
            for j in 0..group {
                let qh = &queries[(i * group + j) * hd..][..hd];
                let dst = &mut scores[(i * group + j) * span..][..span];
                if !keys.is_empty() {
                    let k_rows = &rows[(keys.start - run_lo) * hd..(keys.end - run_lo) * hd];
                    for (o, k_row) in dst[keys.start - lo..keys.end - lo]
                        .iter_mut()
                        .zip(k_rows.chunks_exact(hd))
                    {
                        *o = vec::dot_f16_ggml(qh, k_row) * s.kq_scale;
                    }
                }
            }
        }
    });

    // Online softmax over the keys in position order, accumulating values in f16.
    max.clear();
    max.resize(n_tile * group, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(n_tile * group, 0.0);
    for i in 0..n_tile {
        out[i * token_stride + base..][..group * hd]
            .iter_mut()
            .for_each(|o| *o = 0.0);
    }
    for_each_run(lo, hi, block_size, |block_idx, start, end| {
        let block = table[block_idx] as usize;
        let n = end - start;
        let src = &layer.v[block][layer.row_offset(kv_head, start)..][..n * hd];
        src.convert_to_f32_slice(&mut rows[..n * hd]);
        let run_lo = block_idx * block_size + start;
        for i in 0..n_tile {
            let keys = overlap(i, run_lo, run_lo + n);
            if keys.is_empty() {
                continue;
            }
            for j in 0..group {
                let k = i * group + j;
                let acc = &mut out[i * token_stride + base + j * hd..][..hd];
                let sc = &scores[k * span..][..span];
                for p in keys.clone() {
                    let score = sc[p - lo];
                    let (mut old_scale, mut weight) = (1.0f32, 1.0f32);
                    if score > max[k] {
                        old_scale = (max[k] - score).exp();
                        max[k] = score;
                        // The accumulator holds f16 values already, so scaling by exactly 1 (or
                        // an all-zero accumulator before the first key) would change nothing.
                        if old_scale != 1.0 && old_scale != 0.0 {
                            vec::scale_round_f16(acc, old_scale);
                        } else if old_scale == 0.0 {
                            acc.iter_mut().for_each(|o| *o = 0.0);
                        }
                    } else {
                        weight = (score - max[k]).exp();
                    }
                    vec::mad_round_f16(acc, weight, &rows[(p - run_lo) * hd..][..hd]);
                    // GGML's `S = S*ms + vs`, which its compilers contract to one FMA.
                    sum[k] = sum[k].mul_add(old_scale, weight);
                }
            }
        }
    });
    for i in 0..n_tile {
        for j in 0..group {
            let total = sum[i * group + j];
            let inv = if total == 0.0 { 0.0 } else { 1.0 / total };
            out[i * token_stride + base + j * hd..][..hd]
                .iter_mut()
                .for_each(|o| *o *= inv);
        }
    }
}

/// GGML pads the cache view its attention sees (`llama_kv_cache::get_n_kv`) to a multiple of
/// this many cells, at least one such multiple.
const KV_VIEW_PAD: usize = 256;

/// From this many cells in the view on, GGML attends a single query token by splitting the
/// cells between its threads (`use_split_kv_path` in `ggml_compute_forward_flash_attn_ext_f16`).
const SPLIT_KV_MIN_CELLS: usize = 512;

/// The cells of the cache view GGML attends when the newest token is at `position` (one
/// sequence, stored from cell 0 on), if that view takes the split-KV path.
fn split_kv_len(position: usize) -> Option<usize> {
    let n_kv = (position + 1).div_ceil(KV_VIEW_PAD).max(1) * KV_VIEW_PAD;
    (n_kv >= SPLIT_KV_MIN_CELLS).then_some(n_kv)
}

/// One query head's online softmax over positions `range` of token `t`'s sequence, as GGML's
/// `ggml_compute_forward_flash_attn_ext_f16_one_chunk` computes it with an f16 cache: `q16` is
/// the query rounded to f16, scores are `ggml_vec_dot_f16` times the scale, and the value
/// accumulator is rounded to f16 after every key. Returns the running maximum and sum; `acc`
/// holds the unnormalised values.
fn one_chunk(
    s: &Shape<'_>,
    t: usize,
    kv_head: usize,
    q16: &[f32],
    range: Range<usize>,
    row: &mut [f32],
    acc: &mut [f32],
) -> (f32, f32) {
    let layer = s.layer;
    let block_size = layer.block_size;
    let hd = s.head_dim;
    let table = &s.plan.tables[s.plan.table_of_token[t] as usize];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    acc.iter_mut().for_each(|o| *o = 0.0);
    for pos in range {
        let block = table[pos / block_size] as usize;
        let off = layer.row_offset(kv_head, pos % block_size);
        layer.k[block][off..off + hd].convert_to_f32_slice(row);
        let score = vec::dot_f16_ggml(q16, row) * s.kq_scale;
        let (mut old_scale, mut weight) = (1.0f32, 1.0f32);
        if score > max {
            old_scale = (max - score).exp();
            max = score;
            vec::scale_round_f16(acc, old_scale);
        } else {
            weight = (score - max).exp();
        }
        layer.v[block][off..off + hd].convert_to_f32_slice(row);
        vec::mad_round_f16(acc, weight, row);
        sum = sum.mul_add(old_scale, weight);
    }
    (max, sum)
}

/// Attention of the single token `t` for KV head `kv_head` as GGML's split-KV path computes
/// it: the cache view (see [`split_kv_len`]) cut into `n_chunks` equal runs of cells, each
/// attended by [`one_chunk`], then the partial results merged in chunk order
/// (`ggml_flash_attn_ext_reduce_partials`).
fn attend_split(s: &Shape<'_>, t: usize, kv_head: usize, n_chunks: usize, out: &mut [f32]) {
    let (group, hd) = (s.group, s.head_dim);
    let position = s.plan.positions[t] as usize;
    let n_kv = split_kv_len(position).unwrap_or(position + 1);
    let chunk = n_kv.div_ceil(n_chunks);
    let first = s.first(t);
    let mut q16 = vec![0f32; hd];
    let mut row = vec![0f32; hd];
    let mut part = vec![0f32; hd];
    for j in 0..group {
        q16.copy_from_slice(&s.q[t * s.row_len + (kv_head * group + j) * hd..][..hd]);
        vec::round_f16(&mut q16);
        let fin = &mut out[j * hd..(j + 1) * hd];
        fin.iter_mut().for_each(|o| *o = 0.0);
        let (mut fin_max, mut fin_sum) = (f32::NEG_INFINITY, 0.0f32);
        for c in 0..n_chunks {
            let lo = (c * chunk).max(first);
            let hi = ((c + 1) * chunk).min(n_kv).min(position + 1);
            if lo >= hi {
                continue;
            }
            let (max, sum) = one_chunk(s, t, kv_head, &q16, lo..hi, &mut row, &mut part);
            if sum == 0.0 {
                continue;
            }
            let new_max = fin_max.max(max);
            let scale_old = (fin_max - new_max).exp();
            let scale_new = (max - new_max).exp();
            // `a*b + c*d` as GGML's compilers contract it: the left product fused.
            for (f, &p) in fin.iter_mut().zip(part.iter()) {
                *f = f.mul_add(scale_old, p * scale_new);
            }
            fin_sum = fin_sum.mul_add(scale_old, sum * scale_new);
            fin_max = new_max;
        }
        if fin_sum != 0.0 {
            let inv = 1.0 / fin_sum;
            fin.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// [`attend`] as GGML's tiled f32 flash attention computes it, which llama.cpp uses for batches
/// of [`F32_PATH_MIN_TOKENS`] queries or more: keys in tiles of [`vec::KV_TILE`] positions
/// (aligned to position 0), the query kept in f32, scores by one FMA chain per key, the running
/// maximum and sum updated once per tile, probabilities from GGML's vectorised `expf` summed
/// per 16 in f32 and per tile in f64, and values accumulated in f32 by one FMA per key.
fn attend_f32(
    s: &Shape<'_>,
    tile: Range<usize>,
    kv_head: usize,
    out: &mut [f32],
    token_stride: usize,
    base: usize,
    scratch: &mut Scratch,
) {
    const KV_TILE: usize = vec::KV_TILE;
    let (group, hd) = (s.group, s.head_dim);
    let layer = s.layer;
    let block_size = layer.block_size;
    let t0 = tile.start;
    let n_tile = tile.len();
    let lo = s.first(t0);
    let hi = s.plan.positions[tile.end - 1] as usize;
    let table = &s.plan.tables[s.plan.table_of_token[t0] as usize];
    let Scratch {
        rows,
        max,
        sum,
        kt,
        vt,
        ..
    } = scratch;
    kt.clear();
    kt.resize(hd * KV_TILE, 0.0);
    vt.clear();
    vt.resize(KV_TILE * hd, 0.0);
    rows.resize(block_size * hd, 0.0);
    max.clear();
    max.resize(n_tile * group, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(n_tile * group, 0.0);
    for i in 0..n_tile {
        out[i * token_stride + base..][..group * hd]
            .iter_mut()
            .for_each(|o| *o = 0.0);
    }
    let mut kq = [0f32; KV_TILE];
    for kv_tile in lo / KV_TILE..=hi / KV_TILE {
        let tile_lo = kv_tile * KV_TILE;
        let (first, last) = (lo.max(tile_lo), hi.min(tile_lo + KV_TILE - 1));
        // This tile's keys and values, as f32, keys transposed so one query's scores are
        // KV_TILE lanes.
        for_each_run(first, last, block_size, |block_idx, start, end| {
            let block = table[block_idx] as usize;
            let n = end - start;
            let run_lo = block_idx * block_size + start - tile_lo;
            let src = &layer.k[block][layer.row_offset(kv_head, start)..][..n * hd];
            src.convert_to_f32_slice(&mut rows[..n * hd]);
            for (j, k_row) in rows[..n * hd].chunks_exact(hd).enumerate() {
                for (d, &k) in k_row.iter().enumerate() {
                    kt[d * KV_TILE + run_lo + j] = k;
                }
            }
            let src = &layer.v[block][layer.row_offset(kv_head, start)..][..n * hd];
            src.convert_to_f32_slice(&mut vt[run_lo * hd..(run_lo + n) * hd]);
        });
        for i in 0..n_tile {
            let t = t0 + i;
            let visible_lo = s.first(t).max(tile_lo);
            let visible_hi = (s.plan.positions[t] as usize + 1).min(tile_lo + KV_TILE);
            if visible_lo >= visible_hi {
                continue;
            }
            let visible = visible_lo - tile_lo..visible_hi - tile_lo;
            for j in 0..group {
                let k = i * group + j;
                let qh = &s.q[t * s.row_len + (kv_head * group + j) * hd..][..hd];
                vec::kq_tile(qh, kt, &mut kq);
                let mut tile_max = f32::NEG_INFINITY;
                for (key, v) in kq.iter_mut().enumerate() {
                    if visible.contains(&key) {
                        *v *= s.kq_scale;
                        tile_max = tile_max.max(*v);
                    } else {
                        *v = f32::NEG_INFINITY;
                    }
                }
                let acc = &mut out[i * token_stride + base + j * hd..][..hd];
                let new_max = max[k].max(tile_max);
                if new_max > max[k] {
                    let ms = (max[k] - new_max).exp();
                    acc.iter_mut().for_each(|o| *o *= ms);
                    sum[k] *= ms;
                }
                max[k] = new_max;
                let tile_sum = vec::softmax_tile(&mut kq, new_max);
                sum[k] = (sum[k] as f64 + tile_sum) as f32;
                for key in visible.clone() {
                    vec::mad_f32(acc, kq[key], &vt[key * hd..(key + 1) * hd]);
                }
            }
        }
    }
    for i in 0..n_tile {
        for j in 0..group {
            let total = sum[i * group + j];
            let inv = if total == 0.0 { 0.0 } else { 1.0 / total };
            out[i * token_stride + base + j * hd..][..hd]
                .iter_mut()
                .for_each(|o| *o *= inv);
        }
    }
}

/// Calls `f(block_idx, start, end)` for each run of positions `first..=last` that lies in one
/// block: slots `start..end` of block `block_idx`, in position order.
#[inline]
fn for_each_run(
    first: usize,
    last: usize,
    block_size: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let mut p = first;
    while p <= last {
        let block_idx = p / block_size;
        let start = p % block_size;
        let end = block_size.min(last + 1 - block_idx * block_size);
        f(block_idx, start, end);
        p = block_idx * block_size + end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_kv_starts_at_a_512_cell_view() {
        // The view is the cells in use rounded up to 256 (at least 256).
        assert_eq!(split_kv_len(0), None);
        assert_eq!(split_kv_len(255), None);
        assert_eq!(split_kv_len(256), Some(512));
        assert_eq!(split_kv_len(511), Some(512));
        assert_eq!(split_kv_len(512), Some(768));
        assert_eq!(split_kv_len(1319), Some(1536));
    }

    #[test]
    fn runs_cover_the_range_once() {
        let mut seen = Vec::new();
        for_each_run(5, 70, 32, |b, s, e| seen.push((b, s, e)));
        assert_eq!(seen, vec![(0, 5, 32), (1, 0, 32), (2, 0, 7)]);
        seen.clear();
        for_each_run(0, 0, 16, |b, s, e| seen.push((b, s, e)));
        assert_eq!(seen, vec![(0, 0, 1)]);
    }

    /// A layer of `n_blocks` blocks filled with deterministic values in about -1..1.
    fn filled_layer(
        n_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> CpuKvLayer {
        let mut state = 0x2545_f491_u32;
        let mut next = move || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            half::f16::from_f32((state >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
        };
        let len = block_size * n_kv_heads * head_dim;
        let mut block = || (0..len).map(|_| next()).collect::<Vec<_>>();
        CpuKvLayer {
            block_size,
            n_kv_heads,
            head_dim,
            k: (0..n_blocks).map(|_| block()).collect(),
            v: (0..n_blocks).map(|_| block()).collect(),
        }
    }

    /// Each sequence `(table, first position, tokens)` adds its tokens to the plan.
    fn plan_of(block_size: usize, sequences: &[(Vec<u32>, u32, u32)]) -> AttentionPlan {
        let mut plan = AttentionPlan {
            block_size,
            ..Default::default()
        };
        for (index, (table, first, n)) in sequences.iter().enumerate() {
            for pos in *first..first + n {
                plan.slots.push(plan.slot(table, pos as usize) as u32);
                plan.positions.push(pos);
                plan.table_of_token.push(index as u32);
            }
            plan.tables.push(table.clone());
        }
        plan
    }

    #[test]
    fn prompt_attention_gives_the_same_bits_at_every_thread_count() {
        let (block_size, n_kv_heads, group, head_dim) = (16, 2, 3, 64);
        let n_heads = n_kv_heads * group;
        let layer = filled_layer(24, block_size, n_kv_heads, head_dim);
        let cases = [
            // 100 tokens from position 0: the f32 path, 4 tiles.
            vec![((0..8).rev().collect::<Vec<u32>>(), 0, 100)],
            // 40 tokens after 20 cached ones: the f16 path; beside it a second sequence's 70.
            vec![
                (vec![9, 3, 11, 8], 20, 40),
                (vec![12, 14, 13, 15, 16, 17, 18, 19], 10, 70),
            ],
            // A single tile of 5 tokens, and a one-token sequence past 256 cells (split-KV).
            vec![
                (vec![20, 21], 3, 5),
                ((0..18).collect::<Vec<u32>>(), 270, 1),
            ],
        ];
        for (case, sequences) in cases.iter().enumerate() {
            let plan = plan_of(block_size, sequences);
            let n_tokens = plan.n_tokens();
            let q: Vec<f32> = (0..n_tokens * n_heads * head_dim)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.5)
                .collect();
            for window in [None, Some(24)] {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let mut out = vec![f32::NAN; n_tokens * n_heads * head_dim];
                    pool.install(|| {
                        attention(
                            &q, &layer, &plan, n_heads, n_kv_heads, head_dim, 0.125, window,
                            &mut out,
                        )
                    });
                    out
                };
                let one = run(1);
                assert!(
                    one.iter().all(|x| x.is_finite()),
                    "case {case}: every output written"
                );
                for threads in [2, 3, 8, 16] {
                    let got = run(threads);
                    // The split-KV token's chunks follow the thread count, as llama.cpp's do.
                    let compared = if case == 2 {
                        5 * n_heads * head_dim
                    } else {
                        got.len()
                    };
                    let same = one[..compared]
                        .iter()
                        .zip(&got[..compared])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "case {case}, window {window:?}: {threads} threads differ from 1"
                    );
                }
            }
        }
    }

    #[test]
    fn tiles_break_at_sequences_gaps_and_size() {
        let mut plan = AttentionPlan {
            block_size: 16,
            ..Default::default()
        };
        for t in 0..40u32 {
            plan.slots.push(t);
            plan.positions.push(t);
            plan.table_of_token.push(0);
        }
        plan.positions.push(7);
        plan.table_of_token.push(1);
        plan.slots.push(99);
        assert_eq!(query_tiles(&plan), vec![0..32, 32..40, 40..41]);
    }
}
