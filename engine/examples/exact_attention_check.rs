//! Holds `ember_gpu::ops::attention_exact` (the GPU's reference-numerics attention) to the CPU
//! backend's attention bit for bit, then times it.
//!
//! Usage (the kernels directory holds `<arch>/exact_attention.cubin|.hsaco`, as
//! `cargo xtask kernels` or `kernels/tests/run-nvcc.sh sm_90 DIR/sm_90` lay it out):
//!
//! ```text
//! EMBER_KERNELS_DIR=DIR exact_attention_check [--exhaustive-exp] [--no-bench]
//! ```
//!
//! Every check prints `PASS name` or `FAIL name: first mismatch ...`; any failure makes the
//! program exit 1. The checks:
//! - `twin ...`: a plain Rust transcription of the kernel (one query at a time, the kernel's
//!   decisions and operation order) against the CPU attention, on the host. It needs no GPU and
//!   shows that the kernel's decomposition (one result per token and query head, the path
//!   chosen per batch) is the CPU's function;
//! - `exp libm` / `exp ggml`: the device exponentials against the CPU's (`f32::exp`, glibc's
//!   expf, and `vec::expf_ggml`) on every 61st f32 bit pattern (all 2^32 with
//!   `--exhaustive-exp`); NaN results count as equal to NaN whatever their payload;
//! - `gpu ...`: `attention_exact` against the CPU attention (`backend::cpu::attention_reference`,
//!   the engine's own code on a pool of the case's thread count) on random queries and caches:
//!   head sizes 64, 128, 256 with 1, 3 and 4 query heads per KV head, one token after 0, 5, 100,
//!   511, 512, 700 and 1500 cached positions, prompts of 5, 63, 64 and 100 tokens (and 100
//!   after 30 cached), two sequences in one batch, a sliding window of 512 over 700 positions,
//!   2 reference threads and 8 for some; then the attention shapes of real models (SmolLM2
//!   135M, Gemma 3 270M with and without its window, 2048- and 4096-wide llama models) and head
//!   sizes 72 and 96, with mild and peaked scores.
//!
//! Unless `--no-bench`, it then times one decode call over 4096 cached positions and one
//! 512-token prefill (32 heads, 8 KV heads, head size 128). With no GPU it runs the host checks,
//! says the GPU checks were skipped, and exits by the host checks alone.

// OpsError keeps PoolError (and its driver error) inline so callers can match on out-of-memory
// and budget refusals; its size is not a concern on these checking paths.
#![allow(clippy::result_large_err)]

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use ember::backend::cpu::{attention_reference, vec as cpu_vec};
use ember::kv_cache::AttentionPlan;
use ember_gpu::cuda::CudaDriver;
use ember_gpu::driver::{DevicePtr, Driver};
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::{default_kernels_dir, KernelLibrary};
use ember_gpu::ops::{self, AttentionArgs, ExactExp, GpuContext, GpuContextOptions};
use ember_gpu::pool::{DevicePool, PoolConfig, PoolSelectOptions, Purpose};
use ember_gpu::PoolBuffer;
use half::f16;

/// A small deterministic generator (xorshift64*), so runs are reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }
}

/// One attention call to check.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    head_dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
    block_size: usize,
    window: Option<usize>,
    /// The CPU's thread count (and `reference_threads` of the GPU op).
    threads: usize,
    /// (cached positions, new tokens) of each sequence in the batch.
    seqs: Vec<(usize, usize)>,
    /// Queries are uniform in `[-q_amplitude, q_amplitude)`, keys and values in `[-1, 1)`.
    q_amplitude: f32,
}

impl Case {
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// A case's batch and cache, in the CPU's layout and as plain rows.
struct Data {
    plan: AttentionPlan,
    /// `[n_tokens, n_heads, head_dim]`.
    q: Vec<f32>,
    /// Physical blocks in the CPU layout (`[kv_head][slot][dim]`); empty when unused.
    k_blocks: Vec<Vec<f16>>,
    v_blocks: Vec<Vec<f16>>,
    /// Per sequence, `[position][kv_head][dim]` as f32 (f16 values), for the host twin.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    max_blocks: usize,
}

fn build(case: &Case, rng: &mut Rng) -> Data {
    let (hd, n_kv, bs) = (case.head_dim, case.n_kv_heads, case.block_size);
    let lengths: Vec<usize> = case.seqs.iter().map(|&(c, n)| c + n).collect();
    let blocks_per_seq: Vec<usize> = lengths.iter().map(|l| l.div_ceil(bs)).collect();
    let needed: usize = blocks_per_seq.iter().sum();
    // Physical ids in a scrambled order (7 coprime to the count), a few of them unused.
    let mut n_physical = needed + 3;
    if n_physical.is_multiple_of(7) {
        n_physical += 1;
    }
    let ids: Vec<u32> = (0..n_physical)
        .map(|i| ((i * 7 + 2) % n_physical) as u32)
        .collect();
    let block_len = bs * n_kv * hd;
    let mut k_blocks = vec![Vec::new(); n_physical];
    let mut v_blocks = vec![Vec::new(); n_physical];
    let mut tables = Vec::new();
    let mut keys = Vec::new();
    let mut values = Vec::new();
    let mut next = 0;
    for (s, &len) in lengths.iter().enumerate() {
        let table: Vec<u32> = ids[next..next + blocks_per_seq[s]].to_vec();
        next += blocks_per_seq[s];
        for &b in &table {
            k_blocks[b as usize] = vec![f16::ZERO; block_len];
            v_blocks[b as usize] = vec![f16::ZERO; block_len];
        }
        let mut k_rows = vec![0f32; len * n_kv * hd];
        let mut v_rows = vec![0f32; len * n_kv * hd];
        for p in 0..len {
            let block = table[p / bs] as usize;
            for kv_head in 0..n_kv {
                for d in 0..hd {
                    let cpu = (kv_head * bs + p % bs) * hd + d;
                    let row = (p * n_kv + kv_head) * hd + d;
                    let k = f16::from_f32(rng.uniform(-1.0, 1.0));
                    let v = f16::from_f32(rng.uniform(-1.0, 1.0));
                    k_blocks[block][cpu] = k;
                    v_blocks[block][cpu] = v;
                    k_rows[row] = k.to_f32();
                    v_rows[row] = v.to_f32();
                }
            }
        }
        tables.push(table);
        keys.push(k_rows);
        values.push(v_rows);
    }
    let mut plan = AttentionPlan {
        block_size: bs,
        ..Default::default()
    };
    for (s, &(cached, new)) in case.seqs.iter().enumerate() {
        for p in cached..cached + new {
            plan.slots
                .push(tables[s][p / bs] * bs as u32 + (p % bs) as u32);
            plan.positions.push(p as u32);
            plan.table_of_token.push(s as u32);
        }
    }
    let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
    plan.tables = tables;
    let n = plan.n_tokens() * case.n_heads * hd;
    let q = (0..n)
        .map(|_| rng.uniform(-case.q_amplitude, case.q_amplitude))
        .collect();
    Data {
        plan,
        q,
        k_blocks,
        v_blocks,
        keys,
        values,
        max_blocks,
    }
}

fn cpu_attention(case: &Case, data: &Data) -> Vec<f32> {
    attention_reference(
        &data.k_blocks,
        &data.v_blocks,
        case.n_kv_heads,
        case.head_dim,
        &data.plan,
        &data.q,
        case.n_heads,
        case.scale(),
        case.window,
        case.threads,
    )
    .expect("a rayon pool for the CPU reference")
}

// ---- the host twin of kernels/exact_attention.hip ----

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// `xa_dot_f16_ggml`.
fn dot_f16_ggml(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len();
    let np = n / 64 * 64;
    let mut acc = [[0f32; 16]; 4];
    for base in (0..np).step_by(64) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (i, a) in accj.iter_mut().enumerate() {
                let e = base + 16 * j + i;
                *a = q[e].mul_add(k[e], *a);
            }
        }
    }
    let lanes: [f32; 16] =
        std::array::from_fn(|i| (acc[0][i] + acc[2][i]) + (acc[1][i] + acc[3][i]));
    let sum = reduce16(&lanes);
    let mut sum = f64::from(sum);
    for e in np..n {
        sum += f64::from(q[e] * k[e]);
    }
    sum as f32
}

fn reduce16(v: &[f32; 16]) -> f32 {
    let t: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let u: [f32; 4] = std::array::from_fn(|i| t[i] + t[i + 4]);
    (u[0] + u[2]) + (u[1] + u[3])
}

/// `xa_expf_ggml`.
fn expf_ggml(x: f32) -> f32 {
    let log2e = f32::from_bits(0x3fb8_aa3b);
    let shift = 12_582_912.0f32;
    let (ln2_hi, ln2_lo) = (f32::from_bits(0x3f31_7200), f32::from_bits(0x35bf_be8e));
    let c = [
        0x3f7f_fff6u32,
        0x3eff_fedb,
        0x3e2a_af33,
        0x3d2b_9f17,
        0x3c07_2010,
    ]
    .map(f32::from_bits);
    let z = x.mul_add(log2e, shift);
    let n = z - shift;
    let b = (-n).mul_add(ln2_lo, (-n).mul_add(ln2_hi, x));
    let u = b * b;
    let j = c[4]
        .mul_add(b, c[3])
        .mul_add(u, c[2].mul_add(b, c[1]))
        .mul_add(u, c[0].mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let e = if n.is_nan() { 0 } else { n as i64 };
    (f64::from(j) * f64::from_bits(((e + 1023) as u64) << 52)) as f32
}

/// `xa_softmax_f16`: (max, sum, unnormalised accumulator) over positions `lo..hi`.
fn softmax_f16<'a>(
    q16: &[f32],
    rows: &dyn Fn(usize) -> (&'a [f32], &'a [f32]),
    lo: usize,
    hi: usize,
    scale: f32,
    one_chunk: bool,
) -> (f32, f32, Vec<f32>) {
    let mut acc = vec![0f32; q16.len()];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for p in lo..hi {
        let (k, v) = rows(p);
        let s = dot_f16_ggml(q16, k) * scale;
        let raised = s > max;
        let (old_scale, weight) = if raised {
            let f = (max - s).exp();
            max = s;
            (f, 1.0)
        } else {
            (1.0, (s - max).exp())
        };
        sum = sum.mul_add(old_scale, weight);
        for (a, &x) in acc.iter_mut().zip(v) {
            if raised {
                if one_chunk || (old_scale != 1.0 && old_scale != 0.0) {
                    *a = round_f16(*a * old_scale);
                } else if old_scale == 0.0 {
                    *a = 0.0;
                }
            }
            *a = round_f16(x.mul_add(weight, *a));
        }
    }
    (max, sum, acc)
}

/// `xa_softmax_f32`: the normalised output over positions `first..=last`.
fn softmax_f32<'a>(
    q: &[f32],
    rows: &dyn Fn(usize) -> (&'a [f32], &'a [f32]),
    first: usize,
    last: usize,
    scale: f32,
) -> Vec<f32> {
    const TILE: usize = 64;
    let mut acc = vec![0f32; q.len()];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for tile in first / TILE..=last / TILE {
        let tile_lo = tile * TILE;
        let visible = first.max(tile_lo) - tile_lo..(last + 1).min(tile_lo + TILE) - tile_lo;
        let mut kq = [f32::NEG_INFINITY; TILE];
        for i in visible.clone() {
            let k = rows(tile_lo + i).0;
            let mut o = 0f32;
            for (&kd, &qd) in k.iter().zip(q) {
                o = kd.mul_add(qd, o);
            }
            kq[i] = o * scale;
        }
        let tile_max = visible.clone().fold(f32::NEG_INFINITY, |m, i| m.max(kq[i]));
        let new_max = max.max(tile_max);
        let rescale = new_max > max;
        let ms = if rescale { (max - new_max).exp() } else { 1.0 };
        if rescale {
            sum *= ms;
            acc.iter_mut().for_each(|a| *a *= ms);
        }
        max = new_max;
        let p: [f32; TILE] = std::array::from_fn(|i| expf_ggml(kq[i] - new_max));
        let mut tile_sum = 0f64;
        for run in p.chunks_exact(16) {
            tile_sum += f64::from(reduce16(run.try_into().unwrap()));
        }
        sum = (f64::from(sum) + tile_sum) as f32;
        for i in visible {
            let v = rows(tile_lo + i).1;
            for (a, &x) in acc.iter_mut().zip(v) {
                *a = x.mul_add(p[i], *a);
            }
        }
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    acc.iter().map(|a| a * inv).collect()
}

/// The kernel's computation, one (token, query head) at a time.
fn twin(case: &Case, data: &Data) -> Vec<f32> {
    let (hd, n_heads) = (case.head_dim, case.n_heads);
    let group = n_heads / case.n_kv_heads;
    let plan = &data.plan;
    let n_tokens = plan.n_tokens();
    let f32_path = n_tokens >= 64 && hd.is_multiple_of(16);
    let scale = case.scale();
    let mut out = vec![0f32; n_tokens * n_heads * hd];
    for t in 0..n_tokens {
        let s = plan.table_of_token[t] as usize;
        let position = plan.positions[t] as usize;
        let first = case.window.map_or(0, |w| (position + 1).saturating_sub(w));
        for h in 0..n_heads {
            let kv_head = h / group;
            let row = |p: usize| {
                let at = (p * case.n_kv_heads + kv_head) * hd;
                (&data.keys[s][at..at + hd], &data.values[s][at..at + hd])
            };
            let q = &data.q[(t * n_heads + h) * hd..][..hd];
            let dst = &mut out[(t * n_heads + h) * hd..][..hd];
            if f32_path {
                dst.copy_from_slice(&softmax_f32(q, &row, first, position, scale));
                continue;
            }
            let q16: Vec<f32> = q.iter().map(|&x| round_f16(x)).collect();
            let n_kv = (position + 1).div_ceil(256).max(1) * 256;
            if n_tokens == 1 && n_kv >= 512 {
                let n_chunks = case.threads.max(1);
                let chunk = n_kv.div_ceil(n_chunks);
                let mut fin = vec![0f32; hd];
                let (mut fin_max, mut fin_sum) = (f32::NEG_INFINITY, 0f32);
                for c in 0..n_chunks {
                    let lo = (c * chunk).max(first);
                    let hi = ((c + 1) * chunk).min(n_kv).min(position + 1);
                    if lo >= hi {
                        continue;
                    }
                    let (max, sum, part) = softmax_f16(&q16, &row, lo, hi, scale, true);
                    if sum == 0.0 {
                        continue;
                    }
                    let new_max = fin_max.max(max);
                    let scale_old = (fin_max - new_max).exp();
                    let scale_new = (max - new_max).exp();
                    for (f, &p) in fin.iter_mut().zip(&part) {
                        *f = f.mul_add(scale_old, p * scale_new);
                    }
                    fin_sum = fin_sum.mul_add(scale_old, sum * scale_new);
                    fin_max = new_max;
                }
                if fin_sum != 0.0 {
                    let inv = 1.0 / fin_sum;
                    fin.iter_mut().for_each(|f| *f *= inv);
                }
                dst.copy_from_slice(&fin);
            } else {
                let (_, sum, acc) = softmax_f16(&q16, &row, first, position + 1, scale, false);
                let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
                for (o, a) in dst.iter_mut().zip(&acc) {
                    *o = a * inv;
                }
            }
        }
    }
    out
}

// ---- reporting ----

struct Checker {
    failures: usize,
}

impl Checker {
    /// Compares `got` (from `name`'s first word: `gpu` or `twin`) with the CPU's `want` bit for
    /// bit (NaN equal to NaN) and prints one line.
    fn compare(&mut self, name: &str, got: &[f32], want: &[f32], n_heads: usize, hd: usize) {
        let source = name.split(' ').next().unwrap_or("got");
        let mismatch = got
            .iter()
            .zip(want)
            .position(|(g, w)| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()));
        match mismatch {
            _ if got.len() != want.len() => self.fail(
                name,
                &format!("{} values, expected {}", got.len(), want.len()),
            ),
            None => println!("PASS {name}"),
            Some(i) => {
                let count = got
                    .iter()
                    .zip(want)
                    .filter(|(g, w)| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()))
                    .count();
                let (t, h, d) = (i / (n_heads * hd), i / hd % n_heads, i % hd);
                self.fail(
                    name,
                    &format!(
                        "first mismatch at {i} (token {t}, head {h}, dim {d}): {source}={:e} \
                         ({:#010x}) cpu={:e} ({:#010x}); {count} of {} values differ",
                        got[i],
                        got[i].to_bits(),
                        want[i],
                        want[i].to_bits(),
                        got.len()
                    ),
                )
            }
        }
    }

    fn fail(&mut self, name: &str, why: &str) {
        println!("FAIL {name}: {why}");
        self.failures += 1;
    }
}

// ---- cases ----

fn grid_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for head_dim in [64usize, 128, 256] {
        for gqa in [1usize, 3, 4] {
            let n_kv_heads = 2;
            let block_size = if gqa == 3 { 16 } else { 32 };
            let mut add = |label: String, seqs: Vec<(usize, usize)>, window, threads| {
                cases.push(Case {
                    name: format!("hd{head_dim} gqa{gqa} {label}"),
                    head_dim,
                    n_heads: n_kv_heads * gqa,
                    n_kv_heads,
                    block_size,
                    window,
                    threads,
                    seqs,
                    q_amplitude: 2.0,
                });
            };
            for cached in [0usize, 5, 100, 511, 512, 700, 1500] {
                add(format!("decode@{cached} t2"), vec![(cached, 1)], None, 2);
            }
            add("decode@1500 t8".into(), vec![(1500, 1)], None, 8);
            for n in [5usize, 63, 64, 100] {
                add(format!("prompt{n}"), vec![(0, n)], None, 2);
            }
            add("prompt100@30".into(), vec![(30, 100)], None, 2);
            add(
                "two-seq 3@40+1@600".into(),
                vec![(40, 3), (600, 1)],
                None,
                2,
            );
            add(
                "two-seq 40@200+30@0".into(),
                vec![(200, 40), (0, 30)],
                None,
                2,
            );
            add(
                "window512 decode@700 t2".into(),
                vec![(700, 1)],
                Some(512),
                2,
            );
            add(
                "window512 decode@700 t8".into(),
                vec![(700, 1)],
                Some(512),
                8,
            );
            add("window512 10@690".into(), vec![(690, 10)], Some(512), 2);
            add("window512 64@650".into(), vec![(650, 64)], Some(512), 2);
        }
    }
    cases
}

/// The attention shapes of real models: (label, n_heads, n_kv_heads, head_dim, window), and
/// head sizes that take the dot products' tails past the last run of 64: 96 (a multiple of 16,
/// so batches of 64 tokens take the f32 path) and 72 (not one: they stay on the f16 path).
const MODELS: [(&str, usize, usize, usize, Option<usize>); 7] = [
    ("smollm2-135m (576)", 9, 3, 64, None),
    ("hd72", 8, 2, 72, None),
    ("hd96", 6, 2, 96, None),
    ("gemma3-270m (640)", 4, 1, 256, None),
    ("gemma3-270m (640) local", 4, 1, 256, Some(512)),
    ("llama-2048", 32, 8, 64, None),
    ("llama-4096", 32, 8, 128, None),
];

fn model_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (label, n_heads, n_kv_heads, head_dim, window) in MODELS {
        for q_amplitude in [1.0f32, 8.0] {
            for (batch, seqs) in [
                ("decode@100", vec![(100usize, 1usize)]),
                ("decode@700", vec![(700, 1)]),
                ("prompt20", vec![(0, 20)]),
                ("prompt64", vec![(0, 64)]),
                ("prompt100", vec![(0, 100)]),
                ("4 seqs decode", vec![(30, 1), (300, 1), (520, 1), (900, 1)]),
            ] {
                cases.push(Case {
                    name: format!("{label} {batch} amp{q_amplitude}"),
                    head_dim,
                    n_heads,
                    n_kv_heads,
                    block_size: 32,
                    window,
                    threads: 2,
                    seqs,
                    q_amplitude,
                });
            }
        }
    }
    cases
}

fn bench_cases() -> [Case; 2] {
    let case = |name: &str, seqs| Case {
        name: name.to_string(),
        head_dim: 128,
        n_heads: 32,
        n_kv_heads: 8,
        block_size: 32,
        window: None,
        threads: 2,
        seqs,
        q_amplitude: 1.0,
    };
    [
        case("bench decode@4096 (32 heads, 8 KV, hd128)", vec![(4096, 1)]),
        case("bench prefill512 (32 heads, 8 KV, hd128)", vec![(0, 512)]),
    ]
}

// ---- the GPU side ----

/// A case's cache and batch on the device.
struct DeviceCase {
    args: AttentionArgs,
    _buffers: Vec<PoolBuffer>,
}

fn upload_bytes(ctx: &GpuContext, bytes: &[u8]) -> Result<PoolBuffer, Box<dyn Error>> {
    let buffer = ctx.alloc(Purpose::Scratch, bytes.len().max(4) as u64)?;
    ctx.upload(buffer.ptr(), bytes)?;
    Ok(buffer)
}

fn bytes_of<T: Copy, const N: usize>(values: &[T], to_bytes: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to_bytes(v)).collect()
}

fn upload_case(ctx: &GpuContext, case: &Case, data: &Data) -> Result<DeviceCase, Box<dyn Error>> {
    let (hd, n_kv, bs) = (case.head_dim, case.n_kv_heads, case.block_size);
    let block_len = bs * n_kv * hd;
    let n_physical = data.k_blocks.len();
    let mut buffers = Vec::new();
    let mut addresses = Vec::new();
    for blocks in [&data.k_blocks, &data.v_blocks] {
        // The GPU layout: `[slot][kv_head][dim]` per block, blocks one after another.
        let mut halves = vec![f16::ZERO; n_physical * block_len];
        for (b, block) in blocks.iter().enumerate() {
            if block.is_empty() {
                continue;
            }
            for kv_head in 0..n_kv {
                for slot in 0..bs {
                    let src = &block[(kv_head * bs + slot) * hd..][..hd];
                    halves[b * block_len + (slot * n_kv + kv_head) * hd..][..hd]
                        .copy_from_slice(src);
                }
            }
        }
        let buffer = ctx.alloc(Purpose::Kv, (halves.len() * 2).max(4) as u64)?;
        ctx.upload(buffer.ptr(), &bytes_of(&halves, f16::to_le_bytes))?;
        let base = buffer.ptr().0;
        let block_addresses: Vec<u64> = (0..n_physical)
            .map(|b| base + (b * block_len * 2) as u64)
            .collect();
        addresses.push(upload_bytes(
            ctx,
            &bytes_of(&block_addresses, u64::to_le_bytes),
        )?);
        buffers.push(buffer);
    }
    let plan = &data.plan;
    let mut tables = vec![0i32; plan.tables.len() * data.max_blocks];
    for (j, table) in plan.tables.iter().enumerate() {
        for (i, &b) in table.iter().enumerate() {
            tables[j * data.max_blocks + i] = b as i32;
        }
    }
    let as_i32 = |v: &[u32]| -> Vec<i32> { v.iter().map(|&x| x as i32).collect() };
    let tables = upload_bytes(ctx, &bytes_of(&tables, i32::to_le_bytes))?;
    let table_of_token = upload_bytes(
        ctx,
        &bytes_of(&as_i32(&plan.table_of_token), i32::to_le_bytes),
    )?;
    let positions = upload_bytes(ctx, &bytes_of(&as_i32(&plan.positions), i32::to_le_bytes))?;
    let q = upload_bytes(ctx, &bytes_of(&data.q, f32::to_le_bytes))?;
    let out = ctx.alloc(Purpose::Scratch, (data.q.len() * 4).max(4) as u64)?;
    let args = AttentionArgs {
        q: q.ptr(),
        out: out.ptr(),
        k_blocks: addresses[0].ptr(),
        v_blocks: addresses[1].ptr(),
        block_tables: tables.ptr(),
        table_of_token: table_of_token.ptr(),
        positions: positions.ptr(),
        n_tokens: plan.n_tokens(),
        n_tables: plan.tables.len(),
        max_blocks_per_table: data.max_blocks,
        max_position: plan.positions.iter().copied().max().unwrap_or(0) as usize,
        n_heads: case.n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        block_size: bs,
        scale: case.scale(),
        window: case.window,
        softcap: None,
    };
    buffers.extend(addresses);
    buffers.extend([tables, table_of_token, positions, q, out]);
    Ok(DeviceCase {
        args,
        _buffers: buffers,
    })
}

fn download_f32(ctx: &GpuContext, ptr: DevicePtr, n: usize) -> Result<Vec<f32>, Box<dyn Error>> {
    let mut bytes = vec![0u8; n * 4];
    ctx.download(ptr, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn gpu_attention(ctx: &GpuContext, case: &Case, data: &Data) -> Result<Vec<f32>, Box<dyn Error>> {
    let device = upload_case(ctx, case, data)?;
    // NaN bits in the output first, so a value the kernel does not write cannot pass.
    ctx.upload(
        device.args.out,
        &bytes_of(
            &vec![f32::from_bits(0x7fc0_dead); data.q.len()],
            f32::to_le_bytes,
        ),
    )?;
    ops::attention_exact(ctx, &device.args, case.threads)?;
    download_f32(ctx, device.args.out, data.q.len())
}

/// The device exponentials against the CPU's, over every `stride`-th f32 bit pattern.
fn check_exp(
    checker: &mut Checker,
    ctx: &GpuContext,
    flavor: ExactExp,
    stride: u64,
) -> Result<(), Box<dyn Error>> {
    const BATCH: u64 = 1 << 24;
    let name = match flavor {
        ExactExp::Libm => "exp libm (glibc expf, f32::exp)",
        ExactExp::Ggml => "exp ggml (vec::expf_ggml)",
    };
    let reference = move |x: f32| match flavor {
        ExactExp::Libm => std::hint::black_box(x).exp(),
        ExactExp::Ggml => cpu_vec::expf_ggml(x),
    };
    let x_buffer = ctx.alloc(Purpose::Scratch, BATCH * 4)?;
    let out_buffer = ctx.alloc(Purpose::Scratch, BATCH * 4)?;
    let total = (1u64 << 32).div_ceil(stride);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut bad, mut first_bad) = (0u64, None);
    let mut start = 0u64;
    while start < total {
        let n = BATCH.min(total - start) as usize;
        let xs: Vec<f32> = (0..n as u64)
            .map(|i| f32::from_bits(((start + i) * stride) as u32))
            .collect();
        ctx.upload(x_buffer.ptr(), &bytes_of(&xs, f32::to_le_bytes))?;
        ops::exp_exact(ctx, x_buffer.ptr(), out_buffer.ptr(), n, flavor)?;
        let got = download_f32(ctx, out_buffer.ptr(), n)?;
        let per_thread = n.div_ceil(threads);
        let results: Vec<(u64, Option<usize>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = xs
                .chunks(per_thread)
                .zip(got.chunks(per_thread))
                .enumerate()
                .map(|(c, (xs, got))| {
                    scope.spawn(move || {
                        let (mut bad, mut first) = (0u64, None);
                        for (i, (&x, &g)) in xs.iter().zip(got).enumerate() {
                            let w = reference(x);
                            if g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) {
                                bad += 1;
                                first.get_or_insert(c * per_thread + i);
                            }
                        }
                        (bad, first)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (b, f) in results {
            bad += b;
            if first_bad.is_none() {
                if let Some(i) = f {
                    first_bad = Some((xs[i], got[i]));
                }
            }
        }
        start += n as u64;
    }
    match first_bad {
        None => println!("PASS {name}: {total} inputs (every {stride}th f32)"),
        Some((x, g)) => {
            let w = reference(x);
            checker.fail(
                name,
                &format!(
                    "{bad} of {total} inputs differ; first at x={x:e} ({:#010x}): gpu={g:e} \
                     ({:#010x}) cpu={w:e} ({:#010x})",
                    x.to_bits(),
                    g.to_bits(),
                    w.to_bits()
                ),
            );
        }
    }
    Ok(())
}

fn load_driver() -> Result<Arc<dyn Driver>, String> {
    let cuda = match CudaDriver::load() {
        Ok(driver) if driver.device_count().unwrap_or(0) > 0 => return Ok(Arc::new(driver)),
        Ok(_) => "the CUDA driver reports no device".to_string(),
        Err(error) => error.to_string(),
    };
    let hip = match HipDriver::load(&HipLoadOptions::default()) {
        Ok(driver) if driver.device_count().unwrap_or(0) > 0 => return Ok(Arc::new(driver)),
        Ok(_) => "the HIP runtime reports no device".to_string(),
        Err(error) => error.to_string(),
    };
    Err(format!("CUDA: {cuda}; HIP: {hip}"))
}

fn gpu_context() -> Result<Option<GpuContext>, Box<dyn Error>> {
    let driver = match load_driver() {
        Ok(driver) => driver,
        Err(reason) => {
            println!("SKIP gpu checks: no GPU: {reason}");
            return Ok(None);
        }
    };
    let info = driver.device_info(0)?;
    println!(
        "exact_attention_check: {} device 0: {} ({})",
        driver.backend(),
        info.name,
        info.arch
    );
    let pool = Arc::new(DevicePool::new(
        Arc::clone(&driver),
        0,
        &PoolSelectOptions::default(),
        PoolConfig::default(),
        None,
    )?);
    let kernels = Arc::new(KernelLibrary::new(default_kernels_dir()));
    println!(
        "exact_attention_check: kernels from {}",
        kernels.dir().display()
    );
    Ok(Some(GpuContext::with_options(
        pool,
        kernels,
        &GpuContextOptions { disable_blas: true },
    )?))
}

fn bench(checker: &mut Checker, ctx: &GpuContext, rng: &mut Rng) -> Result<(), Box<dyn Error>> {
    for case in bench_cases() {
        let data = build(&case, rng);
        let device = upload_case(ctx, &case, &data)?;
        ops::attention_exact(ctx, &device.args, case.threads)?;
        ctx.synchronize()?;
        let runs = 10;
        let started = Instant::now();
        for _ in 0..runs {
            ops::attention_exact(ctx, &device.args, case.threads)?;
        }
        ctx.synchronize()?;
        let ms = started.elapsed().as_secs_f64() * 1e3 / f64::from(runs);
        println!("TIME {}: {ms:.3} ms per call", case.name);
        let got = download_f32(ctx, device.args.out, data.q.len())?;
        let want = cpu_attention(&case, &data);
        checker.compare(
            &format!("gpu {}", case.name),
            &got,
            &want,
            case.n_heads,
            case.head_dim,
        );
    }
    Ok(())
}

fn run() -> Result<usize, Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exhaustive = args.iter().any(|a| a == "--exhaustive-exp");
    let no_bench = args.iter().any(|a| a == "--no-bench");
    let mut checker = Checker { failures: 0 };
    let cases: Vec<Case> = grid_cases().into_iter().chain(model_cases()).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let data: Vec<Data> = cases.iter().map(|case| build(case, &mut rng)).collect();
    let started = Instant::now();
    let mut wants = Vec::with_capacity(cases.len());
    for (case, data) in cases.iter().zip(&data) {
        let want = cpu_attention(case, data);
        checker.compare(
            &format!("twin {}", case.name),
            &twin(case, data),
            &want,
            case.n_heads,
            case.head_dim,
        );
        wants.push(want);
    }
    println!(
        "exact_attention_check: {} host checks took {:.1} s",
        cases.len(),
        started.elapsed().as_secs_f64()
    );
    let Some(ctx) = gpu_context()? else {
        return Ok(checker.failures);
    };
    let started = Instant::now();
    for flavor in [ExactExp::Libm, ExactExp::Ggml] {
        check_exp(&mut checker, &ctx, flavor, if exhaustive { 1 } else { 61 })?;
    }
    for ((case, data), want) in cases.iter().zip(&data).zip(&wants) {
        match gpu_attention(&ctx, case, data) {
            Ok(got) => checker.compare(
                &format!("gpu {}", case.name),
                &got,
                want,
                case.n_heads,
                case.head_dim,
            ),
            Err(error) => checker.fail(&format!("gpu {}", case.name), &error.to_string()),
        }
    }
    println!(
        "exact_attention_check: GPU checks took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if !no_bench {
        bench(&mut checker, &ctx, &mut rng)?;
    }
    Ok(checker.failures)
}

fn main() -> ExitCode {
    match run() {
        Ok(0) => {
            println!("exact_attention_check: ALL PASSED");
            ExitCode::SUCCESS
        }
        Ok(failures) => {
            println!("exact_attention_check: FAILED: {failures} check(s)");
            ExitCode::FAILURE
        }
        Err(error) => {
            println!("exact_attention_check: FAILED: {error}");
            ExitCode::FAILURE
        }
    }
}
