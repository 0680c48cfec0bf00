//! Q4_0 matrix products in the order of llama.cpp's repacked x86 kernels.
//!
//! On a CPU with AVX2 llama.cpp interleaves the blocks of Q4_0 matrices whose row count is a
//! multiple of 8 (`block_q4_0x8`) and multiplies them with `ggml_gemv_q4_0_8x8_q8_0` (one to
//! three tokens) and `ggml_gemm_q4_0_8x8_q8_0` (four or more), not with `vec_dot`. Both keep
//! every output in one float lane and take the same float steps, so the token count does not
//! matter: over the 32-value blocks `b` in order,
//!
//! `acc = fma(I_b, d_w·d_a, acc)`, starting from 0,
//!
//! where `I_b = Σ (q - 8)·a` is the block's exact integer dot product (at most 32·8·127 in
//! magnitude, so exact as a float too) and `d_w·d_a` the product of the two f16 scales widened
//! to f32, rounded once. `vec_dot` instead keeps eight lanes of partial sums and adds them at
//! the end, a different rounding. The activations are the same Q8_0 rows in both.
//!
//! Following this order makes ember's numbers llama.cpp's on the machines both run on, and it
//! is the faster order too: a row's blocks need no reduction across SIMD lanes, so eight rows
//! take one vector per step ([`crate::x86::q4_0_rows8`]; on AVX-512 VNNI one `vpdpbusd` per
//! step).

use crate::blocks::{q4_0, q8_0, read_f16};
use crate::matmul::OutPtr;

/// Whether llama.cpp repacks a Q4_0 matrix of `rows` rows on x86
/// (`ggml_repack_get_optimal_repack_type`: AVX2 and a multiple of 8 rows).
pub(crate) fn repacks(rows: usize) -> bool {
    rows.is_multiple_of(8)
}

/// The order's definition in plain Rust: weight row `w` (Q4_0) against activation row `a`
/// (Q8_0). The SIMD kernel gives these bits (tested below).
fn dot_portable(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0.0f32;
    for (x, y) in w.chunks_exact(q4_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let qs = &x[q4_0::QS..q4_0::QS + 16];
        let ys = &y[q8_0::QS..q8_0::QS + 32];
        let isum: i32 = qs
            .iter()
            .enumerate()
            .map(|(j, &q)| {
                let low = (q & 15) as i32 - 8;
                let high = (q >> 4) as i32 - 8;
                low * ys[j] as i8 as i32 + high * ys[j + 16] as i8 as i32
            })
            .sum();
        let scale = read_f16(x, q4_0::D) * read_f16(y, q8_0::D);
        acc = (isum as f32).mul_add(scale, acc);
    }
    acc
}

/// Tokens per call of the eight-row kernel; a batch's last `n % 4` go through the smaller
/// instances.
#[cfg(target_arch = "x86_64")]
const TOKENS: usize = 4;

/// `out[t·rows + r]` for every row `r` of `w` (`rows` rows of `row_bytes`, `rows` a multiple of
/// 8) and token `t` of `acts` (`n_tokens` Q8_0 rows of `act_bytes`).
pub(crate) fn matmul(
    w: &[u8],
    row_bytes: usize,
    rows: usize,
    acts: &[u8],
    act_bytes: usize,
    n_tokens: usize,
    out: &mut [f32],
) {
    debug_assert!(repacks(rows));
    let chunk = crate::repack_order::job_rows(rows, row_bytes, n_tokens);
    let out = OutPtr::new(&mut out[..rows * n_tokens]);
    #[cfg(target_arch = "x86_64")]
    if matches!(
        crate::simd::level(),
        crate::simd::Level::Avx2 | crate::simd::Level::Avx512Vnni
    ) {
        use crate::x86::q4_0_rows8::{
            block_terms, direct, panel, tokens, tokens_vnni, BlockTerms, PANEL_BLOCK,
        };
        let vnni = crate::simd::level() == crate::simd::Level::Avx512Vnni;
        let nb = row_bytes / q4_0::SIZE;
        // Every token's block terms once, shared by the jobs.
        let mut terms = vec![BlockTerms::default(); n_tokens * nb];
        for (t, dst) in terms.chunks_exact_mut(nb.max(1)).enumerate().take(n_tokens) {
            // SAFETY: `simd::level` reports AVX2 or better only after checking AVX2, FMA and
            // F16C.
            unsafe { block_terms(&acts[t * act_bytes..(t + 1) * act_bytes], nb, dst) };
        }
        if n_tokens < TOKENS {
            // A few tokens: each group's blocks unpacked in registers and used at once.
            let job = |c: usize| {
                let r0 = c * chunk;
                for g in (r0..r0 + chunk.min(rows - r0)).step_by(8) {
                    let group = &w[g * row_bytes..(g + 8) * row_bytes];
                    macro_rules! run {
                        ($n:expr) => {{
                            // SAFETY: as above.
                            let v = unsafe {
                                direct::<$n>(group, row_bytes, nb, acts, act_bytes, &terms)
                            };
                            // SAFETY: jobs own disjoint row ranges of every token.
                            unsafe { out.store8(rows, g, 0, &v) };
                        }};
                    }
                    match n_tokens {
                        1 => run!(1),
                        2 => run!(2),
                        _ => run!(3),
                    }
                }
            };
            crate::team::for_each_index(rows.div_ceil(chunk), job);
            return;
        }
        let job = |c: usize| {
            let r0 = c * chunk;
            let n_rows = chunk.min(rows - r0);
            let mut q = vec![0u8; nb * PANEL_BLOCK];
            let mut d = vec![0f32; nb * 8];
            for g in (r0..r0 + n_rows).step_by(8) {
                // SAFETY: as above.
                unsafe {
                    panel(
                        &w[g * row_bytes..(g + 8) * row_bytes],
                        row_bytes,
                        nb,
                        &mut q,
                        &mut d,
                    )
                };
                // Tokens `t..t + $n` through the kernel's `$n`-token instance.
                macro_rules! run {
                    ($t:expr, $n:expr) => {{
                        let (a, tt) = (&acts[$t * act_bytes..], &terms[$t * nb..]);
                        // SAFETY: as above; `vnni` only where `simd::level` found AVX-512
                        // VNNI (with F, BW and VL).
                        let v = unsafe {
                            if vnni {
                                tokens_vnni::<$n>(&q, &d, nb, a, act_bytes, tt)
                            } else {
                                tokens::<$n>(&q, &d, nb, a, act_bytes, tt)
                            }
                        };
                        // SAFETY: jobs own disjoint row ranges of every token.
                        unsafe { out.store8(rows, g, $t, &v) };
                    }};
                }
                for (t, n) in crate::matmul::token_groups(n_tokens, TOKENS) {
                    match n {
                        1 => run!(t, 1),
                        2 => run!(t, 2),
                        3 => run!(t, 3),
                        _ => run!(t, TOKENS),
                    }
                }
            }
        };
        crate::team::for_each_index(rows.div_ceil(chunk), job);
        return;
    }
    let job = |c: usize| {
        let r0 = c * chunk;
        let range = r0..r0 + chunk.min(rows - r0);
        crate::repack_order::by_dot(
            w,
            row_bytes,
            rows,
            range,
            acts,
            act_bytes,
            n_tokens,
            &out,
            dot_portable,
        );
    };
    crate::team::for_each_index(rows.div_ceil(chunk), job);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{quantize_activations, GgmlType};

    /// A deterministic xorshift stream.
    fn stream(seed: u64) -> impl FnMut() -> u64 {
        let mut state = seed | 1;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// `rows` Q4_0 rows of `nb` blocks: random nibbles (some blocks all 0 or all 15, the
    /// extremes) and finite scales of random sign and size.
    fn weights(seed: u64, rows: usize, nb: usize) -> Vec<u8> {
        let mut next = stream(seed);
        let mut w = Vec::with_capacity(rows * nb * q4_0::SIZE);
        for i in 0..rows * nb {
            let d = half::f16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0);
            w.extend_from_slice(&d.to_bits().to_le_bytes());
            for _ in 0..16 {
                w.push(match i % 7 {
                    0 => 0x00,
                    1 => 0xff,
                    _ => next() as u8,
                });
            }
        }
        w
    }

    fn activations(seed: u64, n_tokens: usize, cols: usize) -> Vec<f32> {
        let mut next = stream(seed);
        (0..n_tokens * cols)
            .map(|i| {
                // Some blocks at full scale both ways, so activations reach +-127.
                let v = (next() % 20001) as f32 / 10000.0 - 1.0;
                if (i / 32) % 5 == 0 {
                    v.signum() * 3.0
                } else {
                    v * (1 + i % 3) as f32
                }
            })
            .collect()
    }

    /// Every output of [`matmul`] (the SIMD kernel on x86 with AVX2, else the portable loop)
    /// is [`dot_portable`]'s bits, for batches that take every instance of the kernel (1, 2, 3
    /// and 4 tokens, and 4 plus a rest), and for several jobs.
    #[test]
    fn matmul_is_the_portable_order_bit_for_bit() {
        for (i, &(rows, nb, n_tokens, threads)) in [
            (8, 1, 1, 1),
            (16, 3, 2, 1),
            (24, 18, 3, 2),
            (40, 7, 4, 3),
            (64, 48, 7, 2),
            (8, 5, 13, 1),
            (96, 2, 1, 4),
        ]
        .iter()
        .enumerate()
        {
            let cols = 32 * nb;
            let w = weights(i as u64 + 1, rows, nb);
            let x = activations(i as u64 + 100, n_tokens, cols);
            let act = quantize_activations(GgmlType::Q8_0, &x, n_tokens, cols).unwrap();
            let row_bytes = nb * q4_0::SIZE;
            let act_bytes = nb * q8_0::SIZE;
            let mut out = vec![f32::NAN; rows * n_tokens];
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    matmul(
                        &w,
                        row_bytes,
                        rows,
                        act.data(),
                        act_bytes,
                        n_tokens,
                        &mut out,
                    )
                });
            for t in 0..n_tokens {
                for r in 0..rows {
                    let want = dot_portable(
                        &w[r * row_bytes..(r + 1) * row_bytes],
                        &act.data()[t * act_bytes..(t + 1) * act_bytes],
                    );
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{rows}x{cols}, {n_tokens} tokens: row {r} token {t}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The definition against a plain f64 sum of the dequantized products: the integer part is
    /// exact, so the two differ by the float steps' rounding alone.
    #[test]
    fn portable_order_is_the_dot_product() {
        let nb = 40;
        let w = weights(7, 1, nb);
        let x = activations(8, 1, 32 * nb);
        let act = quantize_activations(GgmlType::Q8_0, &x, 1, 32 * nb).unwrap();
        let a = act.data();
        let mut exact = 0.0f64;
        let mut abs = 0.0f64;
        for b in 0..nb {
            let (wb, ab) = (&w[b * q4_0::SIZE..], &a[b * q8_0::SIZE..]);
            let scale = (read_f16(wb, q4_0::D) * read_f16(ab, q8_0::D)) as f64;
            for j in 0..32 {
                let byte = wb[q4_0::QS + j % 16];
                let q = if j < 16 { byte & 15 } else { byte >> 4 } as f64 - 8.0;
                let term = q * ab[q8_0::QS + j] as i8 as f64 * scale;
                exact += term;
                abs += term.abs();
            }
        }
        let got = dot_portable(&w, a) as f64;
        assert!((got - exact).abs() <= abs * 1e-6, "{got} vs {exact}");
    }
}
