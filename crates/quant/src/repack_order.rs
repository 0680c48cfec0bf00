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

use rayon::prelude::*;

use crate::blocks::{k4_scales_mins, q4_k, q8_k, q8k_bsum, read_f16, read_f32, QK_K};

/// Whether llama.cpp repacks a Q4_K matrix of `rows` rows on x86 (`ggml_repack_get_optimal_repack_type`).
pub(crate) fn repacks_q4_k(rows: usize) -> bool {
    rows.is_multiple_of(8)
}

/// Per 32-element sub-block of one super-block: `Σ q·a` (q the 4-bit weight, a the activation).
#[inline]
fn sub_block_dots(w: &[u8], a: &[u8]) -> [i32; 8] {
    #[cfg(target_arch = "x86_64")]
    if matches!(
        crate::simd::level(),
        crate::simd::Level::Avx2 | crate::simd::Level::Avx512Vnni
    ) {
        // SAFETY: `simd::level` reports AVX2 or better only after checking AVX2, FMA and F16C.
        return unsafe { crate::x86::avx2::q4k_sub_block_dots(w, a) };
    }
    sub_block_dots_portable(w, a)
}

/// [`sub_block_dots`] in plain Rust (the integers are the same on every path).
fn sub_block_dots_portable(w: &[u8], a: &[u8]) -> [i32; 8] {
    let qs = &w[q4_k::QS..q4_k::QS + QK_K / 2];
    let aq = &a[q8_k::QS..q8_k::QS + QK_K];
    std::array::from_fn(|j| {
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
    })
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
struct ActMeta {
    d: f32,
    bsum32: [i32; 8],
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

fn act_meta(y: &[u8]) -> ActMeta {
    ActMeta {
        d: read_f32(y, q8_k::D),
        bsum32: std::array::from_fn(|j| q8k_bsum(y, 2 * j) as i32 + q8k_bsum(y, 2 * j + 1) as i32),
    }
}

/// One output: weight row `w` (Q4_K, its super-blocks' `wm`) against activation row `a` (Q8_K,
/// `am`), with the gemm's (`per_pair`) or the gemv's float steps.
fn dot(w: &[u8], wm: &[WeightMeta], a: &[u8], am: &[ActMeta], per_pair: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(
        crate::simd::level(),
        crate::simd::Level::Avx2 | crate::simd::Level::Avx512Vnni
    ) {
        // SAFETY: `simd::level` reports AVX2 or better only after checking AVX2, FMA and F16C.
        return unsafe { dot_fma(w, wm, a, am, per_pair) };
    }
    dot_impl(w, wm, a, am, per_pair)
}

/// [`dot`] compiled with FMA, so `mul_add` is one instruction rather than a call to `fmaf`
/// (the same result either way).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_fma(w: &[u8], wm: &[WeightMeta], a: &[u8], am: &[ActMeta], per_pair: bool) -> f32 {
    dot_impl(w, wm, a, am, per_pair)
}

#[inline(always)]
fn dot_impl(w: &[u8], wm: &[WeightMeta], a: &[u8], am: &[ActMeta], per_pair: bool) -> f32 {
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    let blocks = w.chunks_exact(q4_k::SIZE).zip(a.chunks_exact(q8_k::SIZE));
    for ((x, y), (m, n)) in blocks.zip(wm.iter().zip(am)) {
        let dots = sub_block_dots(x, y);
        let scale = m.d * n.d;
        let scale_min = m.dmin * n.d;
        let pair = |p: usize| {
            let (j0, j1) = (2 * p, 2 * p + 1);
            let i = m.sc[j0] * dots[j0] + m.sc[j1] * dots[j1];
            let s = m.mn[j0] * n.bsum32[j0] + m.mn[j1] * n.bsum32[j1];
            (i, s)
        };
        if per_pair {
            for p in 0..4 {
                let (i, s) = pair(p);
                acc = (i as f32).mul_add(scale, acc);
                acc_min = (s as f32).mul_add(scale_min, acc_min);
            }
        } else {
            let (mut i, mut s) = (0i32, 0i32);
            for p in 0..4 {
                let (ip, sp) = pair(p);
                i += ip;
                s += sp;
            }
            acc = (i as f32).mul_add(scale, acc);
            acc_min = (s as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
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
    let nb = row_bytes / q4_k::SIZE;
    let wm: Vec<WeightMeta> = w[..rows * row_bytes]
        .chunks_exact(q4_k::SIZE)
        .map(weight_meta)
        .collect();
    let am: Vec<ActMeta> = acts[..n_tokens * act_bytes]
        .chunks_exact(q8_k::SIZE)
        .map(act_meta)
        .collect();
    let gemm = n_tokens > 3;
    let one = |r: usize, t: usize| {
        dot(
            &w[r * row_bytes..(r + 1) * row_bytes],
            &wm[r * nb..(r + 1) * nb],
            &acts[t * act_bytes..(t + 1) * act_bytes],
            &am[t * nb..(t + 1) * nb],
            gemm,
        )
    };
    if n_tokens == 1 {
        // One token: split the rows between threads, in multiples of 8 as llama.cpp does.
        let chunk = (rows
            .div_ceil(rayon::current_num_threads().max(1))
            .div_ceil(8)
            * 8)
        .max(8);
        out[..rows]
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, o)| {
                for (k, v) in o.iter_mut().enumerate() {
                    *v = one(c * chunk + k, 0);
                }
            });
    } else {
        out[..rows * n_tokens]
            .par_chunks_mut(rows)
            .enumerate()
            .for_each(|(t, o)| {
                for (r, v) in o.iter_mut().enumerate() {
                    *v = one(r, t);
                }
            });
    }
}
