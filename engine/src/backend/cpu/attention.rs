//! Causal grouped-query attention over the paged KV cache, on the CPU.
//!
//! One task per (query token, KV head): the task walks the token's sequence through its block
//! table, converts each block's f16 keys of that head to f32 once, scores every query head of the
//! group against them, takes the softmax in f32 (sums in f64, as GGML), and accumulates the values
//! the same way. Masking is by position: a token sees positions `0..=pos` of its own sequence, or
//! the last `window` of them on sliding-window layers.

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::{vec, CpuKvLayer};
use crate::kv_cache::AttentionPlan;

#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    rows: Vec<f32>,
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
    let block_size = layer.block_size;
    out[..n_tokens * row_len].par_chunks_mut(group * head_dim).enumerate().for_each_init(
        Scratch::default,
        |scratch, (task, out_group)| {
            let (t, kv_head) = (task / n_kv_heads, task % n_kv_heads);
            let pos = plan.positions[t] as usize;
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let n_keys = pos + 1 - first;
            let table = &plan.tables[plan.table_of_token[t] as usize];
            let q_group = &q[t * row_len + kv_head * group * head_dim..][..group * head_dim];

            scratch.scores.clear();
            scratch.scores.resize(group * n_keys, 0.0);
            scratch.rows.resize(block_size * head_dim, 0.0);
            let Scratch { scores, rows } = scratch;

            // Scores, block by block.
            for_each_run(first, pos, block_size, |block_idx, start, end, key_index| {
                let block = table[block_idx] as usize;
                let n = end - start;
                let src = &layer.k[block][layer.row_offset(kv_head, start)..][..n * head_dim];
                src.convert_to_f32_slice(&mut rows[..n * head_dim]);
                for (j, q_head) in q_group.chunks_exact(head_dim).enumerate() {
                    let mut qh = [0f32; 512];
                    let q_head = if f16_accumulate() { qh[..head_dim].copy_from_slice(q_head); round_f16(&mut qh[..head_dim]); &qh[..head_dim] } else { q_head };
                    let dst = &mut scores[j * n_keys + key_index..][..n];
                    for (s, k_row) in dst.iter_mut().zip(rows[..n * head_dim].chunks_exact(head_dim)) {
                        *s = vec::dot(q_head, k_row) * kq_scale;
                    }
                }
            });

            // Online softmax with the value accumulator rounded to f16 after every key, as GGML's
            // CPU flash attention does with f16 V: llama.cpp's outputs carry exactly this rounding.
            if f16_accumulate() {
                out_group.iter_mut().for_each(|o| *o = 0.0);
                let mut max = [f32::NEG_INFINITY; 64];
                let mut sum = [0f32; 64];
                for_each_run(first, pos, block_size, |block_idx, start, end, key_index| {
                    let block = table[block_idx] as usize;
                    let n = end - start;
                    let src = &layer.v[block][layer.row_offset(kv_head, start)..][..n * head_dim];
                    src.convert_to_f32_slice(&mut rows[..n * head_dim]);
                    for (j, out_head) in out_group.chunks_exact_mut(head_dim).enumerate() {
                        let s_row = &scores[j * n_keys + key_index..][..n];
                        for (&s, v_row) in s_row.iter().zip(rows[..n * head_dim].chunks_exact(head_dim)) {
                            let (mut ms, mut vs) = (1.0f32, 1.0f32);
                            if s > max[j] {
                                let old = max[j];
                                max[j] = s;
                                ms = (old - s).exp();
                                out_head.iter_mut().for_each(|o| *o *= ms);
                                round_f16(out_head);
                            } else {
                                vs = (s - max[j]).exp();
                            }
                            vec::axpy(out_head, vs, v_row);
                            round_f16(out_head);
                            sum[j] = sum[j] * ms + vs;
                        }
                    }
                });
                for (j, out_head) in out_group.chunks_exact_mut(head_dim).enumerate() {
                    let inv = if sum[j] == 0.0 { 0.0 } else { 1.0 / sum[j] };
                    out_head.iter_mut().for_each(|o| *o *= inv);
                }
                return;
            }
            // Softmax per query head; the weights are left unnormalised and the output divided
            // by their sum at the end.
            let mut inv_sums = [0f32; 16];
            let mut inv_sums_vec = Vec::new();
            let inv: &mut [f32] = if group <= inv_sums.len() {
                &mut inv_sums[..group]
            } else {
                inv_sums_vec.resize(group, 0.0);
                &mut inv_sums_vec
            };
            for (j, inv_j) in inv.iter_mut().enumerate() {
                let s = &mut scores[j * n_keys..(j + 1) * n_keys];
                let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f64;
                for v in s.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v as f64;
                }
                *inv_j = (1.0 / sum) as f32;
            }

            // Weighted sum of the values.
            out_group.iter_mut().for_each(|o| *o = 0.0);
            for_each_run(first, pos, block_size, |block_idx, start, end, key_index| {
                let block = table[block_idx] as usize;
                let n = end - start;
                let src = &layer.v[block][layer.row_offset(kv_head, start)..][..n * head_dim];
                src.convert_to_f32_slice(&mut rows[..n * head_dim]);
                for (j, out_head) in out_group.chunks_exact_mut(head_dim).enumerate() {
                    let w = &scores[j * n_keys + key_index..][..n];
                    for (&wi, v_row) in w.iter().zip(rows[..n * head_dim].chunks_exact(head_dim)) {
                        vec::axpy(out_head, wi, v_row);
                    }
                }
            });
            for (out_head, &inv_j) in out_group.chunks_exact_mut(head_dim).zip(inv.iter()) {
                out_head.iter_mut().for_each(|o| *o *= inv_j);
            }
        },
    );
}

/// Calls `f(block_idx, start, end, key_index)` for each run of positions `first..=last` that lies
/// in one block: slots `start..end` of block `block_idx`, the run's first position being the
/// `key_index`-th key.
#[inline]
fn for_each_run(first: usize, last: usize, block_size: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut p = first;
    while p <= last {
        let block_idx = p / block_size;
        let start = p % block_size;
        let end = block_size.min(last + 1 - block_idx * block_size);
        f(block_idx, start, end, p - first);
        p = block_idx * block_size + end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_the_range_once() {
        let mut seen = Vec::new();
        for_each_run(5, 70, 32, |b, s, e, k| seen.push((b, s, e, k)));
        assert_eq!(seen, vec![(0, 5, 32, 0), (1, 0, 32, 27), (2, 0, 7, 59)]);
        seen.clear();
        for_each_run(0, 0, 16, |b, s, e, k| seen.push((b, s, e, k)));
        assert_eq!(seen, vec![(0, 0, 1, 0)]);
    }
}

fn f16_accumulate() -> bool {
    std::env::var_os("EMBER_DEBUG_FA16").is_some()
}

fn round_f16(x: &mut [f32]) {
    let mut tmp = [half::f16::ZERO; 512];
    let tmp = &mut tmp[..x.len()];
    tmp.convert_from_f32_slice(x);
    tmp.convert_to_f32_slice(x);
}
