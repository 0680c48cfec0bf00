//! Q4_K matrix products in the order of llama.cpp's repacked x86 kernels.
//!
//! On x86 llama.cpp interleaves Q4_K weights with eight rows per block (`block_q4_Kx8`) when a
//! matrix has a multiple of 8 rows, and multiplies them with `ggml_gemv_q4_K_8x8_q8_K` (batches
//! of one to three tokens) and `ggml_gemm_q4_K_8x8_q8_K` (batches of four or more), not with
//! `vec_dot`. In a batch of four or more, every token takes the gemm's float steps, the last
//! `n % 4` included: that is what the reference outputs show (tests/data/golden: Gemma 3's
//! greedy lines and the re-evaluated steps of prompts of 6, 7, 10 and 16 tokens agree only this
//! way). llama.cpp of 2026-10 sends those last tokens through the gemv instead; ember follows
//! the build that made the references. Both keep every output in one float lane and form the
//! weight-scale and min terms in integers first; they differ in how often they turn those
//! integers into floats:
//! - gemv: once per 256-element super-block, `acc += I_b·(d_w·d_a)` and
//!   `acc_min += M_b·(dmin_w·d_a)` (each one FMA);
//! - gemm: once per pair of 32-element sub-blocks (four times per super-block), the same FMAs;
//!
//! and both return `acc - acc_min`. `I` is `Σ scale_j · Σ q·a` over the sub-blocks `j`
//! covered, `M` is `Σ min_j · Σ a` (the activations' 16-element sums added in pairs). Integer
//! sums are exact in any order, so reproducing the float steps is enough to get llama.cpp's
//! numbers bit for bit.

use crate::blocks::{k4_scales_mins, q4_k, q8_k, q8k_bsum, read_f16, read_f32, QK_K};

/// Whether llama.cpp repacks a Q4_K matrix of `rows` rows on x86 (`ggml_repack_get_optimal_repack_type`).
pub(crate) fn repacks_q4_k(rows: usize) -> bool {
    rows.is_multiple_of(8)
}

/// Whether llama.cpp multiplies a matrix of `ty` with `rows` rows by its repacked x86 kernels,
/// whose order ember then follows: Q4_K here, Q4_0 in [`crate::repack_q4_0`] (`block_q4_0x8`,
/// AVX2 or better), both with rows a multiple of 8.
pub(crate) fn repacks(ty: crate::GgmlType, rows: usize) -> bool {
    match ty {
        crate::GgmlType::Q4_K => repacks_q4_k(rows),
        crate::GgmlType::Q4_0 => crate::repack_q4_0::repacks(rows),
        _ => false,
    }
}

/// Per pair `p` of 32-element sub-blocks of one super-block: `sc[2p]·Σ q·a + sc[2p+1]·Σ q·a`
/// (q the 4-bit weight, a the activation, `sc` the sub-block scales), exact integers.
fn pair_sums_portable(w: &[u8], a: &[u8], sc: &[i32; 8]) -> [i32; 4] {
    let qs = &w[q4_k::QS..q4_k::QS + QK_K / 2];
    let aq = &a[q8_k::QS..q8_k::QS + QK_K];
    let dot = |j: usize| -> i32 {
        let (group, high) = (j / 2, j % 2 == 1);
        let q = &qs[32 * group..32 * group + 32];
        let x = &aq[32 * j..32 * j + 32];
        q.iter()
            .zip(x)
            .map(|(&b, &v)| {
                let nibble = if high { b >> 4 } else { b & 0xF };
                nibble as i32 * (v as i8 as i32)
            })
            .sum()
    };
    std::array::from_fn(|p| sc[2 * p] * dot(2 * p) + sc[2 * p + 1] * dot(2 * p + 1))
}

/// What one weight super-block contributes besides its quants: the 8 sub-block scales and mins
/// and the two f16 scales, decoded once per matmul instead of once per output.
#[derive(Clone, Copy, Default)]
struct WeightMeta {
    sc: [i32; 8],
    mn: [i32; 8],
    d: f32,
    dmin: f32,
}

/// One activation super-block's scale and its 32-element sums (16-element `bsums` in pairs).
#[derive(Clone, Copy, Default)]
pub(crate) struct ActMeta {
    pub(crate) d: f32,
    pub(crate) bsum32: [i32; 8],
}

fn weight_meta(x: &[u8]) -> WeightMeta {
    let (sc, mn) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
    WeightMeta {
        sc: sc.map(i32::from),
        mn: mn.map(i32::from),
        d: read_f16(x, q4_k::D),
        dmin: read_f16(x, q4_k::DMIN),
    }
}

pub(crate) fn act_meta(y: &[u8]) -> ActMeta {
    ActMeta {
        d: read_f32(y, q8_k::D),
        bsum32: std::array::from_fn(|j| q8k_bsum(y, 2 * j) as i32 + q8k_bsum(y, 2 * j + 1) as i32),
    }
}

/// One output: weight row `w` (Q4_K) against activation row `a` (Q8_K), with the gemm's
/// (`per_pair`) or the gemv's float steps.
fn dot(w: &[u8], a: &[u8], per_pair: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(
        crate::simd::level(),
        crate::simd::Level::Avx2 | crate::simd::Level::Avx512Vnni
    ) {
        // SAFETY: `simd::level` reports AVX2 or better only after checking AVX2, FMA and F16C.
        return unsafe { crate::x86::avx2::q4k_repacked_dot(w, a, per_pair) };
    }
    dot_portable(w, a, per_pair)
}

/// [`dot`] in plain Rust: the definition of the order, which the SIMD kernel reproduces bit for
/// bit (tested below).
fn dot_portable(w: &[u8], a: &[u8], per_pair: bool) -> f32 {
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    for (x, y) in w.chunks_exact(q4_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let (m, n) = (weight_meta(x), act_meta(y));
        let is = pair_sums_portable(x, y, &m.sc);
        let scale = m.d * n.d;
        let scale_min = m.dmin * n.d;
        let min_sum =
            |p: usize| m.mn[2 * p] * n.bsum32[2 * p] + m.mn[2 * p + 1] * n.bsum32[2 * p + 1];
        if per_pair {
            for (p, &i) in is.iter().enumerate() {
                acc = (i as f32).mul_add(scale, acc);
                acc_min = (min_sum(p) as f32).mul_add(scale_min, acc_min);
            }
        } else {
            let i: i32 = is.iter().sum();
            let s: i32 = (0..4).map(min_sum).sum();
            acc = (i as f32).mul_add(scale, acc);
            acc_min = (s as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// From this many tokens on, rows are computed eight at a time ([`crate::x86::q4_k_rows8`]):
/// unpacking a group into a panel pays off once several tokens share it.
#[cfg(target_arch = "x86_64")]
const ROWS8_MIN_TOKENS: usize = 2;

/// Tokens per call of the eight-row kernel ([`crate::x86::q4_k_rows8`]); a batch's last
/// `n % 4` go through the smaller instances.
#[cfg(target_arch = "x86_64")]
const ROWS8_TOKENS: usize = 4;

/// Tokens per sweep of a job's rows in a batch: their activations (2.3 KB per token for 2048
/// columns) stay in cache while each row's weights are read once per sweep.
const TOKEN_BLOCK: usize = 32;

/// Rows per job of a repacked product of `rows` rows (a multiple of 8) of `row_bytes` bytes
/// against `n_tokens` tokens: multiples of 16 where the rows allow it (whole groups of the
/// eight- and sixteen-row kernels, and whole cache lines of output), else of 8. One token gets
/// one job per thread at most, each big enough to pay for waking its thread; a batch more jobs
/// than threads, for balance.
pub(crate) fn job_rows(rows: usize, row_bytes: usize, n_tokens: usize) -> usize {
    if n_tokens == 1 {
        crate::matmul::split_rows(rows, rows * row_bytes, 16).1
    } else {
        let jobs = rayon::current_num_threads().max(1) * 4;
        let group = if rows.is_multiple_of(16) { 16 } else { 8 };
        (rows.div_ceil(jobs).div_ceil(group) * group).max(group)
    }
}

/// Outputs `out[t·rows + r]` of the rows `r` in `range` of `w` (`rows` rows of `row_bytes`)
/// for every token `t` of `acts` (`n_tokens` rows of `act_bytes`), one `dot` each: a job's
/// fallback where no eight-row kernel runs. Tokens in blocks of `TOKEN_BLOCK`, whose
/// activations stay in cache while each row is read once per block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn by_dot(
    w: &[u8],
    row_bytes: usize,
    rows: usize,
    range: std::ops::Range<usize>,
    acts: &[u8],
    act_bytes: usize,
    n_tokens: usize,
    out: &crate::matmul::OutPtr,
    dot: impl Fn(&[u8], &[u8]) -> f32,
) {
    for t0 in (0..n_tokens).step_by(TOKEN_BLOCK) {
        for t in t0..(t0 + TOKEN_BLOCK).min(n_tokens) {
            let a = &acts[t * act_bytes..(t + 1) * act_bytes];
            // SAFETY: jobs own disjoint row ranges of every token.
            let o = unsafe { out.slice(t * rows + range.start, range.len()) };
            for (v, r) in o.iter_mut().zip(range.clone()) {
                *v = dot(&w[r * row_bytes..(r + 1) * row_bytes], a);
            }
        }
    }
}

/// `out[t·rows + r]` for every row `r` of `w` (`rows` rows of `row_bytes`) and token `t` of
/// `acts` (`n_tokens` rows of `act_bytes`): batches of four or more tokens take the gemm's
/// steps for every token, smaller ones the gemv's (see the module docs).
pub(crate) fn matmul(
    w: &[u8],
    row_bytes: usize,
    rows: usize,
    acts: &[u8],
    act_bytes: usize,
    n_tokens: usize,
    out: &mut [f32],
) {
    let gemm = n_tokens > 3;
    let chunk = job_rows(rows, row_bytes, n_tokens);
    // The AVX2 eight-row kernel's activation terms of every token, once, shared by the jobs
    // (AVX-512 VNNI machines take their own kernels below, every job's rows being whole
    // groups of 8).
    #[cfg(target_arch = "x86_64")]
    let (nb, act_terms) = {
        let nb = row_bytes / q4_k::SIZE;
        let avx2 = crate::simd::level() == crate::simd::Level::Avx2;
        let terms: Vec<_> = if avx2 && n_tokens >= ROWS8_MIN_TOKENS {
            (0..n_tokens)
                .flat_map(|t| {
                    crate::x86::q4_k_rows8::act_terms(&acts[t * act_bytes..][..nb * q8_k::SIZE])
                })
                .collect()
        } else {
            Vec::new()
        };
        (nb, terms)
    };
    let out = crate::matmul::OutPtr::new(&mut out[..rows * n_tokens]);
    let job = |c: usize| {
        let r0 = c * chunk;
        let n_rows = chunk.min(rows - r0);
        #[cfg(target_arch = "x86_64")]
        if n_tokens >= ROWS8_MIN_TOKENS
            && n_rows.is_multiple_of(8)
            && crate::simd::level() == crate::simd::Level::Avx512Vnni
        {
            use crate::x86::amx;
            use crate::x86::avx512::{
                q4k_rows16_tokens, Rows16Acc, Rows16Scales, TokenRows, ROWS, TOKENS,
            };
            let mut meta = Rows16Scales::default();
            // AMX tiles from a block of 16 tokens on, where the CPU and the OS allow them.
            let use_amx = gemm && n_tokens >= amx::TOKENS && amx::usable();
            // SAFETY: `amx::usable` checked AMX, the OS grant and AVX-512 VNNI.
            let _tiles = use_amx.then(|| unsafe { amx::Tiles::configure() });
            let mut amx_scratch = use_amx.then(Box::<amx::AmxScratch>::default);
            let mut scratch = Box::<Rows16Acc>::default();
            let mut v = [[0f32; ROWS]; amx::CALL_TOKENS];
            // A last group of 8 rows runs as 16 with 8 rows of zeros (scales 0: outputs 0).
            let mut padded = Vec::new();
            // Each group's metadata is decoded once; its rows stay in cache while every block
            // of tokens passes over them.
            for g in (r0..r0 + n_rows).step_by(ROWS) {
                let n = ROWS.min(r0 + n_rows - g);
                let group = if n == ROWS {
                    &w[g * row_bytes..(g + ROWS) * row_bytes]
                } else {
                    padded.clear();
                    padded.extend_from_slice(&w[g * row_bytes..(g + n) * row_bytes]);
                    padded.resize(ROWS * row_bytes, 0);
                    &padded[..]
                };
                // SAFETY: `simd::level` reports AVX-512 VNNI only after checking AVX-512 F, BW,
                // VL and VNNI, AVX2, FMA and F16C.
                unsafe { meta.decode(group, row_bytes) };
                let block = if use_amx { amx::CALL_TOKENS } else { TOKENS };
                for t0 in (0..n_tokens).step_by(block) {
                    let nt = block.min(n_tokens - t0);
                    match amx_scratch.as_deref_mut() {
                        // SAFETY: `amx::usable` returned true and this thread's tiles are
                        // configured (`_tiles`, held until the job ends).
                        Some(s) => unsafe {
                            amx::q4k_rows16_tokens_amx(
                                group,
                                row_bytes,
                                &meta,
                                &acts[t0 * act_bytes..],
                                act_bytes,
                                nt,
                                s,
                                &mut v,
                            )
                        },
                        // SAFETY: as above.
                        None => unsafe {
                            q4k_rows16_tokens(
                                group,
                                row_bytes,
                                &meta,
                                TokenRows {
                                    data: &acts[t0 * act_bytes..],
                                    stride: act_bytes,
                                    count: nt,
                                },
                                gemm,
                                &mut scratch,
                                &mut v,
                            );
                        },
                    }
                    for (t, vt) in v.iter().enumerate().take(nt) {
                        // SAFETY: jobs own disjoint row ranges of every token.
                        let dst = unsafe { out.slice((t0 + t) * rows + g, n) };
                        if let Ok(dst) = <&mut [f32; ROWS]>::try_from(&mut *dst) {
                            // A copy of known size, inlined: a call per token cost 4% of a
                            // prompt's time.
                            *dst = *vt;
                        } else {
                            dst.copy_from_slice(&vt[..n]);
                        }
                    }
                }
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if n_tokens >= ROWS8_MIN_TOKENS
            && n_rows.is_multiple_of(8)
            && crate::simd::level() == crate::simd::Level::Avx2
        {
            use crate::x86::q4_k_rows8::Panel;
            let terms = &act_terms;
            let mut panel = Panel::default();
            for g in (r0..r0 + n_rows).step_by(8) {
                let group = &w[g * row_bytes..(g + 8) * row_bytes];
                // SAFETY: `simd::level` reports AVX2 or better only after checking AVX2, FMA
                // and F16C.
                unsafe { panel.fill(group, row_bytes) };
                // Tokens `t..t + $n` through the kernel's `$n`-token instance.
                macro_rules! run {
                    ($t:expr, $n:expr) => {{
                        // SAFETY: as above.
                        let v = unsafe {
                            panel.tokens::<$n>(
                                &acts[$t * act_bytes..],
                                act_bytes,
                                &terms[$t * nb..],
                                gemm,
                            )
                        };
                        // SAFETY: jobs own disjoint row ranges of every token.
                        unsafe { out.store8(rows, g, $t, &v) };
                    }};
                }
                for (t, n) in crate::matmul::token_groups(n_tokens, ROWS8_TOKENS) {
                    match n {
                        1 => run!(t, 1),
                        2 => run!(t, 2),
                        3 => run!(t, 3),
                        _ => run!(t, ROWS8_TOKENS),
                    }
                }
            }
            return;
        }
        by_dot(
            w,
            row_bytes,
            rows,
            r0..r0 + n_rows,
            acts,
            act_bytes,
            n_tokens,
            &out,
            |w, a| dot(w, a, gemm),
        );
    };
    crate::team::for_each_index(rows.div_ceil(chunk), job);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic xorshift stream of bytes.
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut state = seed | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 32) as u8
            })
            .collect()
    }

    /// A Q4_K row of `nb` random super-blocks with finite scales (every nibble 15 in some).
    fn weight_row(seed: u64, nb: usize) -> Vec<u8> {
        let mut w = bytes(seed, nb * q4_k::SIZE);
        for (b, x) in w.chunks_exact_mut(q4_k::SIZE).enumerate() {
            x[q4_k::D..q4_k::D + 2]
                .copy_from_slice(&half::f16::from_f32(0.01 + b as f32 * 1e-3).to_le_bytes());
            x[q4_k::DMIN..q4_k::DMIN + 2]
                .copy_from_slice(&half::f16::from_f32(0.003).to_le_bytes());
            if (seed + b as u64).is_multiple_of(4) {
                x[q4_k::QS..q4_k::QS + QK_K / 2].fill(0xFF);
            }
        }
        w
    }

    /// A Q8_K row of `nb` random super-blocks with consistent `bsums` (-128 everywhere in some).
    fn act_row(seed: u64, nb: usize) -> Vec<u8> {
        let mut a = bytes(seed, nb * q8_k::SIZE);
        for (b, y) in a.chunks_exact_mut(q8_k::SIZE).enumerate() {
            y[q8_k::D..q8_k::D + 4].copy_from_slice(&(0.02f32 + b as f32 * 1e-3).to_le_bytes());
            if (seed + b as u64).is_multiple_of(5) {
                y[q8_k::QS..q8_k::QS + QK_K].fill(0x80);
            }
            for k in 0..QK_K / 16 {
                let sum: i16 = y[q8_k::QS + 16 * k..q8_k::QS + 16 * k + 16]
                    .iter()
                    .map(|&v| v as i8 as i16)
                    .sum();
                y[q8_k::BSUMS + 2 * k..q8_k::BSUMS + 2 * k + 2].copy_from_slice(&sum.to_le_bytes());
            }
        }
        a
    }

    #[test]
    fn the_simd_dot_is_the_portable_order_bit_for_bit() {
        for seed in 1..120u64 {
            let nb = 1 + (seed as usize % 9);
            let (w, a) = (weight_row(seed, nb), act_row(seed * 7919, nb));
            for per_pair in [false, true] {
                let want = dot_portable(&w, &a, per_pair);
                let got = dot(&w, &a, per_pair);
                assert!(want.is_finite(), "seed {seed}");
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "seed {seed}, per_pair {per_pair}: {got} vs {want}"
                );
            }
        }
    }

    /// The whole product, on whichever kernels this CPU takes: row counts that leave a group of
    /// 8 (padded to 16 on AVX-512), token counts across the block size, several threads.
    #[test]
    fn the_matmul_is_the_portable_order_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for (seed, rows, n_tokens) in [
            (1u64, 8, 5),
            (2, 24, 37),
            (3, 40, 2),
            (4, 96, 33),
            (5, 16, 1),
        ] {
            let nb = 2 + (seed as usize % 3);
            let (row_bytes, act_bytes) = (nb * q4_k::SIZE, nb * q8_k::SIZE);
            let w: Vec<u8> = (0..rows as u64)
                .flat_map(|r| weight_row(seed * 31 + r, nb))
                .collect();
            let acts: Vec<u8> = (0..n_tokens as u64)
                .flat_map(|t| act_row(seed * 7919 + t * 104729, nb))
                .collect();
            let mut out = vec![f32::NAN; rows * n_tokens];
            pool.install(|| matmul(&w, row_bytes, rows, &acts, act_bytes, n_tokens, &mut out));
            for t in 0..n_tokens {
                let a = &acts[t * act_bytes..(t + 1) * act_bytes];
                for r in 0..rows {
                    let want =
                        dot_portable(&w[r * row_bytes..(r + 1) * row_bytes], a, n_tokens > 3);
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "rows {rows} tokens {n_tokens}: token {t} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn eight_rows_at_once_are_each_row_bit_for_bit() {
        use crate::x86::q4_k_rows8::{act_terms, Panel};
        if !matches!(
            crate::simd::level(),
            crate::simd::Level::Avx2 | crate::simd::Level::Avx512Vnni
        ) {
            return;
        }
        // One panel reused across groups of different widths, as a matmul job reuses it.
        let mut panel = Panel::default();
        for seed in 1..40u64 {
            let nb = 1 + (seed as usize % 5);
            let row_bytes = nb * q4_k::SIZE;
            let rows: Vec<u8> = (0..8).flat_map(|r| weight_row(seed * 13 + r, nb)).collect();
            // Four tokens, their rows apart by more than a row (as in a matmul's buffer).
            let act_bytes = nb * q8_k::SIZE + 64;
            let mut acts = Vec::new();
            for t in 0..4u64 {
                acts.extend(act_row(seed * 7919 + t * 104729, nb));
                acts.resize((t as usize + 1) * act_bytes, 0xA5);
            }
            let terms: Vec<_> = (0..4)
                .flat_map(|t| act_terms(&acts[t * act_bytes..][..nb * q8_k::SIZE]))
                .collect();
            // SAFETY: the level check above found AVX2, FMA and F16C.
            unsafe { panel.fill(&rows, row_bytes) };
            for per_pair in [false, true] {
                let want = |t: usize, r: usize| {
                    let a = &acts[t * act_bytes..t * act_bytes + nb * q8_k::SIZE];
                    dot_portable(&rows[r * row_bytes..(r + 1) * row_bytes], a, per_pair)
                };
                let check = |got: &[[f32; 8]]| {
                    for (t, out) in got.iter().enumerate() {
                        for (r, v) in out.iter().enumerate() {
                            assert_eq!(
                                v.to_bits(),
                                want(t, r).to_bits(),
                                "seed {seed}: token {t} of {}, row {r}, per_pair {per_pair}",
                                got.len()
                            );
                        }
                    }
                };
                // SAFETY: as above.
                let one = unsafe { panel.tokens::<1>(&acts, act_bytes, &terms, per_pair) };
                check(&one);
                // SAFETY: as above.
                let two = unsafe { panel.tokens::<2>(&acts, act_bytes, &terms, per_pair) };
                check(&two);
                // SAFETY: as above.
                let four = unsafe { panel.tokens::<4>(&acts, act_bytes, &terms, per_pair) };
                check(&four);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sixteen_rows_by_many_tokens_are_each_output_bit_for_bit() {
        use crate::x86::avx512::{
            q4k_rows16_tokens, Rows16Acc, Rows16Scales, TokenRows, ROWS, TOKENS,
        };
        if crate::simd::level() != crate::simd::Level::Avx512Vnni {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // One value reused across groups of different widths, as a matmul job reuses it.
        let mut meta = Rows16Scales::default();
        let mut scratch = Box::<Rows16Acc>::default();
        let mut out = [[f32::NAN; ROWS]; TOKENS];
        for seed in 1..24u64 {
            let nb = 1 + (seed as usize % 5);
            let row_bytes = nb * q4_k::SIZE;
            let rows: Vec<u8> = (0..ROWS as u64)
                .flat_map(|r| weight_row(seed * 13 + r, nb))
                .collect();
            let n_tokens = [1, 2, 3, 4, 7, 16, 31, TOKENS][seed as usize % 8];
            let acts: Vec<u8> = (0..n_tokens as u64)
                .flat_map(|t| act_row(seed * 7919 + t * 104729, nb))
                .collect();
            let act_bytes = nb * q8_k::SIZE;
            // SAFETY: the level check above found AVX-512 F, BW, VL and VNNI, AVX2, FMA, F16C.
            unsafe { meta.decode(&rows, row_bytes) };
            for per_pair in [false, true] {
                // SAFETY: as above.
                unsafe {
                    q4k_rows16_tokens(
                        &rows,
                        row_bytes,
                        &meta,
                        TokenRows {
                            data: &acts,
                            stride: act_bytes,
                            count: n_tokens,
                        },
                        per_pair,
                        &mut scratch,
                        &mut out,
                    )
                };
                for (t, got) in out.iter().enumerate().take(n_tokens) {
                    let a = &acts[t * act_bytes..(t + 1) * act_bytes];
                    for (r, g) in got.iter().enumerate() {
                        let want =
                            dot_portable(&rows[r * row_bytes..(r + 1) * row_bytes], a, per_pair);
                        assert!(want.is_finite(), "seed {seed} token {t} row {r}");
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "seed {seed} token {t} of {n_tokens} row {r} per_pair {per_pair}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The AMX kernel on its own, where this CPU and OS allow tiles: token counts 1 to 64
    /// (short blocks read a padded copy), super-blocks 1 to 5, weights with every nibble 15 and
    /// activations at -128 in some blocks, against the portable definition (gemm steps).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_tiles_give_every_output_bit_for_bit() {
        use crate::x86::amx;
        use crate::x86::avx512::{Rows16Scales, ROWS};
        if !amx::usable() {
            eprintln!("skipped: no AMX tiles here (CPU, OS grant or EMBER_CPU_AMX=off)");
            return;
        }
        // SAFETY: `amx::usable` checked AMX, the OS grant and AVX-512 VNNI.
        let _tiles = unsafe { amx::Tiles::configure() };
        let mut meta = Rows16Scales::default();
        let mut scratch = Box::<amx::AmxScratch>::default();
        let mut out = [[f32::NAN; ROWS]; amx::CALL_TOKENS];
        for seed in 1..24u64 {
            let nb = 1 + (seed as usize % 5);
            let row_bytes = nb * q4_k::SIZE;
            let rows: Vec<u8> = (0..ROWS as u64)
                .flat_map(|r| weight_row(seed * 17 + r, nb))
                .collect();
            let n_tokens = [1, 2, 15, 16, 17, 33, 64, 50][seed as usize % 8];
            let acts: Vec<u8> = (0..n_tokens as u64)
                .flat_map(|t| act_row(seed * 6151 + t * 104729, nb))
                .collect();
            let act_bytes = nb * q8_k::SIZE;
            // SAFETY: AVX-512 VNNI and AMX checked above; this thread's tiles are configured.
            unsafe {
                meta.decode(&rows, row_bytes);
                amx::q4k_rows16_tokens_amx(
                    &rows,
                    row_bytes,
                    &meta,
                    &acts,
                    act_bytes,
                    n_tokens,
                    &mut scratch,
                    &mut out,
                );
            }
            for (t, got) in out.iter().enumerate().take(n_tokens) {
                let a = &acts[t * act_bytes..(t + 1) * act_bytes];
                for (r, g) in got.iter().enumerate() {
                    let want = dot_portable(&rows[r * row_bytes..(r + 1) * row_bytes], a, true);
                    assert!(want.is_finite(), "seed {seed} token {t} row {r}");
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "seed {seed} token {t} of {n_tokens} row {r}: {g} vs {want}"
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_packed_scale_decoding_equals_the_reference_one() {
        for seed in 1..500u64 {
            let b = bytes(seed, 12);
            let (sc, mn) = k4_scales_mins(&b);
            let (sc64, mn64) = crate::x86::avx2::k4_scales_mins_u64(&b);
            assert_eq!(sc64.to_le_bytes(), sc, "seed {seed}");
            assert_eq!(mn64.to_le_bytes(), mn, "seed {seed}");
        }
    }
}
