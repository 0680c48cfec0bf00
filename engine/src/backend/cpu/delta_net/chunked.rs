//! The chunked form of the gated delta rule, for prompts: the algorithm of
//! flash-linear-attention's `chunk_gated_delta_rule` (the WY representation of a chunk's
//! updates, solved by the "UT transform") and of llama.cpp's chunked qwen3next graph, written
//! for one head over row-major f32 matrices.
//!
//! Within a chunk of `c` tokens starting from the state `S0` (row `j` a value index, as GGML
//! stores it), with `G_t` the cumulative log-decay of the chunk up to and including token `t`,
//! `Γ_t = exp(G_t)` and `r[t][s] = exp(G_t - G_s)` (at most 1 for `s <= t`, the gates being
//! negative), the recurrence `S_t = exp(g_t) S_{t-1} + u_t k_t^T` with
//! `u_t = b_t (v_t - exp(g_t) S_{t-1} k_t)` unrolls to
//!
//! * `S_t = Γ_t S0 + Σ_{s<=t} r[t][s] u_s k_s^T`, so
//! * `u_t + Σ_{s<t} b_t r[t][s] (k_t·k_s) u_s = b_t v_t - b_t Γ_t S0 k_t`: a unit lower
//!   triangular system in the `u_t`, solved by forward substitution;
//! * `o_t = Γ_t S0 q_t + Σ_{s<=t} r[t][s] (q_t·k_s) u_s`;
//! * the state after the chunk, `Γ_c S0 + Σ_s r[c][s] u_s k_s^T`.
//!
//! So a chunk reads and writes the state once instead of once per token, and the work is small
//! matrix products (`[K; Q] S0^T`, `[K; Q] K^T`, `P U`, `K'^T U`) instead of `c` passes over the
//! state. The decays are differences of the cumulative log-gate (summed in f64) put through
//! `exp`, never quotients of `Γ`s, which underflow over long chunks of small gates.

use super::vec;

/// Tokens per chunk (flash-linear-attention's and llama.cpp's chunk size).
pub(super) const CHUNK: usize = 64;

/// One value head's inputs over `n` tokens, token-major: the query and key of its key head
/// (L2-normalised), its values (`n * head_dim` each), the log-decay `g` and the write strength
/// `b` of each token (`n` each).
pub(super) struct HeadInputs<'a> {
    pub(super) q: &'a [f32],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) g: &'a [f32],
    pub(super) b: &'a [f32],
}

/// The gated delta rule over the tokens of `head` in chunks of [`CHUNK`], from and back to
/// `state` (`head_dim * head_dim`, row `j` over the key index), writing `o_t * scale` to
/// `out[t * head_dim..]`. Computes what the recurrent form computes, in another order.
pub(super) fn rule_chunked(
    state: &mut [f32],
    head: &HeadInputs<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if vec::has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { rule_avx2(state, head, head_dim, scale, out) };
    }
    rule_lanes::<false>(state, head, head_dim, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rule_avx2(
    state: &mut [f32],
    head: &HeadInputs<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    rule_lanes::<true>(state, head, head_dim, scale, out)
}

/// `a * b + c`, fused where the build has FMA (a plain multiply-add compiles to a call
/// elsewhere).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `y += a * x`.
#[inline(always)]
fn axpy<const FMA: bool>(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FMA>(a, x, *y);
    }
}

/// `out[j * rows + i] = x[i * cols + j]` for an `rows x cols` matrix `x`.
#[inline(always)]
fn transpose(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    for (i, row) in x.chunks_exact(cols).take(rows).enumerate() {
        for (j, &value) in row.iter().enumerate() {
            out[j * rows + i] = value;
        }
    }
}

/// `c += a b` for row-major `a` (`m x k`), `b` (`k x n`) and `c` (`m x n`): blocks of 4 rows
/// by 16 columns accumulated in registers, the edges as row updates.
#[inline(always)]
fn gemm_acc<const FMA: bool>(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    const MR: usize = 4;
    const NR: usize = 16;
    let (a, b, c) = (&a[..m * k], &b[..k * n], &mut c[..m * n]);
    let n_full = n / NR * NR;
    let m_full = m / MR * MR;
    for i0 in (0..m_full).step_by(MR) {
        for j0 in (0..n_full).step_by(NR) {
            let mut acc = [[0f32; NR]; MR];
            for p in 0..k {
                let b_row: &[f32; NR] = b[p * n + j0..p * n + j0 + NR].try_into().unwrap();
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let a_value = a[(i0 + r) * k + p];
                    for (acc, &b_value) in acc_row.iter_mut().zip(b_row) {
                        *acc = madd::<FMA>(a_value, b_value, *acc);
                    }
                }
            }
            for (r, acc_row) in acc.iter().enumerate() {
                let c_row = &mut c[(i0 + r) * n + j0..(i0 + r) * n + j0 + NR];
                for (c, &acc) in c_row.iter_mut().zip(acc_row) {
                    *c += acc;
                }
            }
        }
    }
    // The columns right of the last whole block, and the rows below the last whole block.
    for i in 0..m {
        let from = if i < m_full { n_full } else { 0 };
        if from == n {
            continue;
        }
        let c_row = &mut c[i * n + from..(i + 1) * n];
        for p in 0..k {
            axpy::<FMA>(c_row, a[i * k + p], &b[p * n + from..(p + 1) * n]);
        }
    }
}

#[inline(always)]
fn rule_lanes<const FMA: bool>(
    state: &mut [f32],
    head: &HeadInputs<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let d = head_dim;
    let n = head.g.len();
    // Taken out of the thread's slot and put back, not borrowed in a closure: a closure would
    // be compiled without the caller's target features (no FMA: `mul_add` a library call).
    let mut scratch = SCRATCH.take();
    scratch.resize(d);
    rule_in::<FMA>(state, head, d, n, scale, out, &mut scratch);
    SCRATCH.set(scratch);
}

/// The working matrices of [`rule_lanes`], kept per thread: a head's are about 320 KiB at a
/// head size of 128, which fresh from the allocator (a mapping of its own) cost a page fault
/// per 4 KiB on every head of every layer.
#[derive(Default)]
struct Scratch {
    s_t: Vec<f32>,
    kq: Vec<f32>,
    yz: Vec<f32>,
    k_t: Vec<f32>,
    kk_qk: Vec<f32>,
    u: Vec<f32>,
    p: Vec<f32>,
    decay: Vec<f32>,
}

impl Scratch {
    /// Sizes the matrices for head size `d` (their contents are overwritten before use).
    fn resize(&mut self, d: usize) {
        self.s_t.resize(d * d, 0.0);
        self.kq.resize(2 * CHUNK * d, 0.0);
        self.yz.resize(2 * CHUNK * d, 0.0);
        self.k_t.resize(d * CHUNK, 0.0);
        self.kk_qk.resize(2 * CHUNK * CHUNK, 0.0);
        self.u.resize(CHUNK * d, 0.0);
        self.p.resize(CHUNK * CHUNK, 0.0);
        self.decay.resize(CHUNK * CHUNK, 0.0);
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

#[inline(always)]
fn rule_in<const FMA: bool>(
    state: &mut [f32],
    head: &HeadInputs<'_>,
    d: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let Scratch {
        s_t,
        kq,
        yz,
        k_t,
        kk_qk,
        u,
        p,
        decay,
    } = scratch;
    // The state transposed (key-major) while the chunks run: `s_t[i * d + j] = S[j][i]`, so that
    // `K S0^T` and the update are products of row-major matrices.
    transpose(&state[..d * d], d, d, s_t);
    // The chunk's keys then queries (`2c x d`), their products with the state (`Y = K S0^T`
    // then `Z = Q S0^T`), the keys transposed (`d x c`), `[K; Q] K^T` (`2c x c`), the new values
    // `U` (`c x d`), the output mixing matrix `P` (`c x c`) and the decays `r` (`CHUNK` wide):
    // every element read is written first in its chunk.
    let mut cumulative = [0f64; CHUNK];
    let mut gamma = [0f32; CHUNK];
    for t0 in (0..n).step_by(CHUNK) {
        let c = CHUNK.min(n - t0);
        let keys = &head.k[t0 * d..(t0 + c) * d];
        let queries = &head.q[t0 * d..(t0 + c) * d];
        let values = &head.v[t0 * d..(t0 + c) * d];
        let (g, b) = (&head.g[t0..t0 + c], &head.b[t0..t0 + c]);

        let mut sum = 0f64;
        for t in 0..c {
            sum += g[t] as f64;
            cumulative[t] = sum;
            gamma[t] = sum.exp() as f32;
            for s in 0..=t {
                decay[t * CHUNK + s] = ((sum - cumulative[s]) as f32).exp();
            }
        }

        let (kq, yz, kk_qk) = (
            &mut kq[..2 * c * d],
            &mut yz[..2 * c * d],
            &mut kk_qk[..2 * c * c],
        );
        kq[..c * d].copy_from_slice(keys);
        kq[c * d..].copy_from_slice(queries);
        yz.fill(0.0);
        gemm_acc::<FMA>(kq, s_t, yz, 2 * c, d, d);
        let k_t = &mut k_t[..d * c];
        transpose(keys, c, d, k_t);
        kk_qk.fill(0.0);
        gemm_acc::<FMA>(kq, k_t, kk_qk, 2 * c, d, c);

        // U by forward substitution.
        let u = &mut u[..c * d];
        for t in 0..c {
            let (done, rest) = u.split_at_mut(t * d);
            let u_row = &mut rest[..d];
            let y_row = &yz[t * d..(t + 1) * d];
            let v_row = &values[t * d..(t + 1) * d];
            let bg = b[t] * gamma[t];
            for ((u, &v), &y) in u_row.iter_mut().zip(v_row).zip(y_row) {
                *u = b[t] * v - bg * y;
            }
            for (s, u_s) in done.chunks_exact(d).enumerate() {
                let coefficient = b[t] * decay[t * CHUNK + s] * kk_qk[t * c + s];
                axpy::<FMA>(u_row, -coefficient, u_s);
            }
        }

        // O = diag(Γ) Z + P U with P[t][s] = r[t][s] (q_t·k_s) for s <= t.
        let p = &mut p[..c * c];
        for t in 0..c {
            for s in 0..c {
                p[t * c + s] = if s <= t {
                    decay[t * CHUNK + s] * kk_qk[(c + t) * c + s]
                } else {
                    0.0
                };
            }
        }
        let o = &mut out[t0 * d..(t0 + c) * d];
        for (t, o_row) in o.chunks_exact_mut(d).enumerate() {
            let z_row = &yz[(c + t) * d..(c + t + 1) * d];
            for (o, &z) in o_row.iter_mut().zip(z_row) {
                *o = gamma[t] * z;
            }
        }
        gemm_acc::<FMA>(p, u, o, c, c, d);
        o.iter_mut().for_each(|v| *v *= scale);

        // S = Γ_c S0 + Σ_s r[c][s] u_s k_s^T, as s_t += (K')^T U with K' the decayed keys.
        let last = &decay[(c - 1) * CHUNK..(c - 1) * CHUNK + c];
        for k_row in k_t.chunks_exact_mut(c) {
            for (k, &r) in k_row.iter_mut().zip(last) {
                *k *= r;
            }
        }
        let gamma_c = gamma[c - 1];
        s_t.iter_mut().for_each(|s| *s *= gamma_c);
        gemm_acc::<FMA>(k_t, u, s_t, d, c, d);
    }
    transpose(s_t, d, d, &mut state[..d * d]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiled_product_computes_a_matrix_product() {
        // Shapes with and without whole 4 x 16 blocks.
        for &(m, k, n) in &[(8, 5, 32), (7, 3, 19), (2, 9, 16), (4, 1, 3), (13, 64, 48)] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 11) as f32) - 5.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 13) as f32) - 6.0).collect();
            let mut c: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
            let mut want = c.clone();
            for i in 0..m {
                for j in 0..n {
                    want[i * n + j] += (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
                }
            }
            // Small integers: every product and sum is exact, so both builds give the same.
            gemm_acc::<false>(&a, &b, &mut c, m, k, n);
            assert_eq!(c, want, "{m}x{k} by {k}x{n}");
        }
    }
}
