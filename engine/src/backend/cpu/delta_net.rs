//! Gated DeltaNet (Qwen 3.5's linear attention) on the CPU, after llama.cpp's qwen35 graph
//! (`build_layer_attn_linear`, `build_conv_state`) and GGML's CPU ops it runs on:
//! `ggml_ssm_conv` (a plain f32 sum over the taps), SiLU, the L2 norm built as
//! `rms_norm(x, eps / n) / sqrt(n)`, and the fused `ggml_gated_delta_net`, which on the CPU is
//! the sequential recurrence for prompts and decoding alike (llama.cpp enables the fused op on
//! every backend that has it, so its chunked graph form never runs there).
//!
//! Per value head `h` (query and key head `h % n_k_heads`) and token, with the state `S` stored
//! as GGML stores it (row `j` over the key index):
//! `S *= exp(g)`; `delta[j] = (v[j] - S[j]·k) * beta`; `S[j] += delta[j] * k`;
//! `o[j] = (S[j]·q) / sqrt(head_dim)`, with `g = softplus(alpha + dt_bias) * a` and
//! `beta = sigmoid(beta_logit)`. That recurrent form ([`rule_recurrent`]) is the definition and
//! runs decoding and short prompts, with GGML's `ggml_vec_dot_f32` and `ggml_vec_mad_f32`
//! ([`vec::dot_f32_ggml`], [`vec::mad_f32`]), so a prompt read a token at a time agrees with
//! llama.cpp's to the bit. A sequence of more than [`CHUNKED_MIN_TOKENS`] tokens in one call
//! runs the chunked form ([`chunked`]): the same rule as small matrix products over chunks of
//! 64 tokens, equal to the recurrent form within f32 rounding, which reads and writes each
//! head's state once a chunk instead of four times a token.

use rayon::prelude::*;

use super::ops::Disjoint;
use super::{ops, vec};
use crate::backend::GatedDeltaNet;
use chunked::{rule_chunked, HeadInputs};

mod chunked;

/// A sequence with more than this many tokens in a call runs the chunked form of the delta rule
/// ([`chunked`]); fewer run the recurrent form, token by token, which is also the definition.
const CHUNKED_MIN_TOKENS: usize = 32;

/// One sequence's part of [`gated_delta_net`]: its rows and its state in the layer, split into
/// the convolution and delta-rule states (see [`crate::backend::SequenceState`]).
pub(super) struct SequenceState<'a> {
    pub(super) rows: &'a [usize],
    pub(super) conv: &'a mut [f32],
    pub(super) ssm: &'a mut [f32],
}

/// GGML's `op_softplus`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// GGML's `op_sigmoid`.
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// llama.cpp's `build_gdn_l2_norm` in place: `rms_norm(x, eps / n)`, then times `1 / sqrt(n)`.
fn l2_norm(x: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    let scale = ops::rms_scale(x, eps / n);
    let inv_sqrt_n = 1.0 / n.sqrt();
    for v in x.iter_mut() {
        *v = (*v * scale) * inv_sqrt_n;
    }
}

/// The gated norm of one sequence's tokens: `rms_norm(o) * weight * silu(z)` per value head,
/// `o` from the delta rule's head-major outputs, `z` and the result by batch row.
struct GatedNorm<'a> {
    per_head: &'a [f32],
    z: &'a [f32],
    weight: &'a [f32],
    eps: f32,
    n: usize,
    n_v: usize,
    hd: usize,
}

impl GatedNorm<'_> {
    /// Token `t` of the sequence, batch row `row`, into `dst` (`n_v * hd` values).
    #[inline(always)]
    fn run(&self, t: usize, row: usize, dst: &mut [f32]) {
        let (n, hd) = (self.n, self.hd);
        let value_dim = self.n_v * hd;
        for h in 0..self.n_v {
            let o = &self.per_head[(h * n + t) * hd..(h * n + t + 1) * hd];
            let d = &mut dst[h * hd..(h + 1) * hd];
            ops::rms_norm_row(o, self.weight, self.eps, d);
            let zh = &self.z[row * value_dim + h * hd..row * value_dim + (h + 1) * hd];
            for (d, &zv) in d.iter_mut().zip(zh) {
                *d *= vec::silu_ggml(zv);
            }
        }
    }

    /// [`GatedNorm::run`] compiled with FMA (see [`ConvChannel::run_fma`]).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_fma(&self, t: usize, row: usize, dst: &mut [f32]) {
        self.run(t, row, dst)
    }
}

/// One channel of the causal convolution over a sequence's tokens: its taps, and where its
/// inputs are (the sequence's rows of `qkv`, `channels` wide, after the window state).
struct ConvChannel<'a> {
    weights: &'a [f32],
    qkv: &'a [f32],
    rows: &'a [usize],
    channels: usize,
    c: usize,
}

impl ConvChannel<'_> {
    /// The convolution and SiLU of every token into `col`, and the channel's new window state:
    /// the last `state.len()` inputs of state + tokens.
    #[inline(always)]
    fn run(&self, col: &mut [f32], state: &mut [f32]) {
        let kept = state.len();
        let n = col.len();
        let input = |state: &[f32], i: usize| -> f32 {
            if i < kept {
                state[i]
            } else {
                self.qkv[self.rows[i - kept] * self.channels + self.c]
            }
        };
        for (t, o) in col.iter_mut().enumerate() {
            let mut sum = 0f32;
            for (k, &w) in self.weights.iter().enumerate() {
                sum += input(state, t + k) * w;
            }
            *o = vec::silu_ggml(sum);
        }
        // In place, front to back: input `n + i` comes from the state only when fewer tokens
        // than taps arrived, and then from a later slot than `i`, not yet overwritten.
        for i in 0..kept {
            state[i] = input(state, n + i);
        }
    }

    /// [`ConvChannel::run`] compiled with FMA, so the exponential's fused multiply-adds are
    /// instructions rather than calls to the C library's `fmaf` (the same bits either way).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_fma(&self, col: &mut [f32], state: &mut [f32]) {
        self.run(col, state)
    }
}

/// [`crate::backend::Backend::gated_delta_net`] on the CPU.
#[allow(clippy::too_many_arguments)]
pub(super) fn gated_delta_net(
    op: &GatedDeltaNet<'_, Vec<f32>>,
    qkv: &[f32],
    z: &[f32],
    beta: &[f32],
    alpha: &[f32],
    states: &mut [SequenceState<'_>],
    out: &mut [f32],
) {
    let hd = op.head_dim;
    let (n_k, n_v) = (op.n_k_heads, op.n_v_heads);
    let key_dim = n_k * hd;
    let value_dim = n_v * hd;
    let channels = 2 * key_dim + value_dim;
    let taps = op.conv_kernel;
    let kept = taps - 1;
    for seq in states.iter_mut() {
        let rows = seq.rows;
        let n = rows.len();
        if n == 0 {
            continue;
        }
        // Convolution and SiLU, channel by channel (`conv_t[c * n + t]`), and the new
        // convolution state: the last `taps - 1` inputs of the window state + tokens.
        let mut conv_t = vec![0f32; channels * n];
        conv_t
            .par_chunks_mut(n)
            .zip(seq.conv.par_chunks_mut(kept))
            .enumerate()
            .with_min_len(64)
            .for_each(|(c, (col, state))| {
                let channel = ConvChannel {
                    weights: &op.conv[c * taps..(c + 1) * taps],
                    qkv,
                    rows,
                    channels,
                    c,
                };
                #[cfg(target_arch = "x86_64")]
                if vec::has_avx2() {
                    // SAFETY: `has_avx2` checked at run time that the CPU has AVX2 and FMA.
                    return unsafe { channel.run_fma(col, state) };
                }
                channel.run(col, state);
            });
        // Token-major Q, K and V with each query and key head L2-normalised.
        let mut conv_out = vec![0f32; n * channels];
        conv_out
            .par_chunks_mut(channels)
            .enumerate()
            .with_min_len(4)
            .for_each(|(t, row)| {
                for (c, v) in row.iter_mut().enumerate() {
                    *v = conv_t[c * n + t];
                }
                for head in row[..2 * key_dim].chunks_exact_mut(hd) {
                    l2_norm(head, op.eps);
                }
            });
        // The delta rule, one task per value head, each writing its own column block.
        let scale = 1.0 / (hd as f32).sqrt();
        let chunked = n > CHUNKED_MIN_TOKENS;
        let mut per_head = vec![0f32; n_v * n * hd];
        per_head
            .par_chunks_mut(n * hd)
            .zip(seq.ssm.par_chunks_mut(hd * hd))
            .enumerate()
            .for_each(|(h, (o_head, state))| {
                let kh = h % n_k;
                let (mut q, mut k, mut v) = (
                    Vec::with_capacity(n * hd),
                    Vec::with_capacity(n * hd),
                    Vec::with_capacity(n * hd),
                );
                let (mut g, mut b) = (Vec::with_capacity(n), Vec::with_capacity(n));
                for (t, &row) in rows.iter().enumerate() {
                    let x = &conv_out[t * channels..(t + 1) * channels];
                    q.extend_from_slice(&x[kh * hd..(kh + 1) * hd]);
                    k.extend_from_slice(&x[key_dim + kh * hd..key_dim + (kh + 1) * hd]);
                    v.extend_from_slice(&x[2 * key_dim + h * hd..2 * key_dim + (h + 1) * hd]);
                    g.push(softplus(alpha[row * n_v + h] + op.dt_bias[h]) * op.a[h]);
                    b.push(sigmoid(beta[row * n_v + h]));
                }
                let head = HeadInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    g: &g,
                    b: &b,
                };
                if chunked {
                    rule_chunked(state, &head, hd, scale, o_head);
                } else {
                    rule_recurrent(state, &head, hd, scale, o_head);
                }
            });
        // The gated norm: rms_norm(o) * norm * silu(z), per head.
        let norm = GatedNorm {
            per_head: &per_head,
            z,
            weight: op.norm,
            eps: op.eps,
            n,
            n_v,
            hd,
        };
        // Token by token in parallel: each writes its own batch row of `out`.
        let out_rows = Disjoint::new(&mut out[..]);
        rows.par_iter()
            .enumerate()
            .with_min_len(4)
            .for_each(|(t, &row)| {
                // SAFETY: a sequence's batch rows are distinct, so are the tokens' row ranges.
                let dst = unsafe { out_rows.range(row * value_dim..(row + 1) * value_dim) };
                #[cfg(target_arch = "x86_64")]
                if vec::has_avx2() {
                    // SAFETY: `has_avx2` checked at run time that the CPU has AVX2 and FMA.
                    return unsafe { norm.run_fma(t, row, dst) };
                }
                norm.run(t, row, dst);
            });
    }
}

/// The recurrent form of the gated delta rule for one value head, token after token, from and
/// back to `state` (row `j` over the key index), writing `o_t * scale` to `out[t * head_dim..]`:
/// the definition, and the form of decoding and short prompts.
fn rule_recurrent(
    state: &mut [f32],
    head: &HeadInputs<'_>,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = head_dim;
    let mut delta = vec![0f32; hd];
    for (t, (&g, &b)) in head.g.iter().zip(head.b).enumerate() {
        let q = &head.q[t * hd..(t + 1) * hd];
        let k = &head.k[t * hd..(t + 1) * hd];
        let v = &head.v[t * hd..(t + 1) * hd];
        let decay = g.exp();
        state.iter_mut().for_each(|s| *s *= decay);
        for (j, d) in delta.iter_mut().enumerate() {
            let sk = vec::dot_f32_ggml(&state[j * hd..(j + 1) * hd], k);
            *d = (v[j] - sk) * b;
        }
        for (j, &d) in delta.iter().enumerate() {
            vec::mad_f32(&mut state[j * hd..(j + 1) * hd], d, k);
        }
        let o = &mut out[t * hd..(t + 1) * hd];
        for (j, o) in o.iter_mut().enumerate() {
            *o = vec::dot_f32_ggml(&state[j * hd..(j + 1) * hd], q) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in `[-spread, spread)`.
    fn values(seed: u64, n: usize, spread: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * spread
            })
            .collect()
    }

    struct Layer {
        conv: Vec<f32>,
        dt_bias: Vec<f32>,
        a: Vec<f32>,
        norm: Vec<f32>,
    }

    const HD: usize = 16;
    const NK: usize = 2;
    const NV: usize = 4;
    const TAPS: usize = 4;
    const CH: usize = 2 * NK * HD + NV * HD;

    fn layer() -> Layer {
        Layer {
            conv: values(1, CH * TAPS, 0.5),
            dt_bias: values(2, NV, 1.0),
            a: values(3, NV, 1.0).iter().map(|v| -v.abs() - 0.1).collect(),
            norm: values(4, HD, 0.2).iter().map(|v| 1.0 + v).collect(),
        }
    }

    fn op(l: &Layer) -> GatedDeltaNet<'_, Vec<f32>> {
        GatedDeltaNet {
            conv: &l.conv,
            dt_bias: &l.dt_bias,
            a: &l.a,
            norm: &l.norm,
            conv_kernel: TAPS,
            n_k_heads: NK,
            n_v_heads: NV,
            head_dim: HD,
            eps: 1e-6,
        }
    }

    /// Runs `n` tokens as one call, then the same tokens one call each, and compares.
    #[test]
    fn a_prompt_and_one_token_steps_give_the_same_bits() {
        let l = layer();
        let n = 7;
        let qkv = values(5, n * CH, 1.0);
        let z = values(6, n * NV * HD, 1.0);
        let beta = values(7, n * NV, 2.0);
        let alpha = values(8, n * NV, 2.0);
        let rows: Vec<usize> = (0..n).collect();
        let (mut conv, mut ssm) = (vec![0f32; (TAPS - 1) * CH], vec![0f32; NV * HD * HD]);
        let mut out = vec![0f32; n * NV * HD];
        gated_delta_net(
            &op(&l),
            &qkv,
            &z,
            &beta,
            &alpha,
            &mut [SequenceState {
                rows: &rows,
                conv: &mut conv,
                ssm: &mut ssm,
            }],
            &mut out,
        );
        let (mut conv1, mut ssm1) = (vec![0f32; (TAPS - 1) * CH], vec![0f32; NV * HD * HD]);
        let mut out1 = vec![0f32; n * NV * HD];
        for t in 0..n {
            gated_delta_net(
                &op(&l),
                &qkv,
                &z,
                &beta,
                &alpha,
                &mut [SequenceState {
                    rows: &[t],
                    conv: &mut conv1,
                    ssm: &mut ssm1,
                }],
                &mut out1,
            );
        }
        assert_eq!(out, out1);
        assert_eq!(conv, conv1);
        assert_eq!(ssm, ssm1);
        assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|&v| v != 0.0));
    }

    /// The layer against a plain f64 transcription of the delta rule for one head: a short
    /// prompt (the recurrent form) and one of two chunks, the second partial (the chunked form).
    #[test]
    fn the_layer_computes_the_gated_delta_rule() {
        check_against_f64_model(5);
        check_against_f64_model(CHUNKED_MIN_TOKENS + 38);
    }

    fn check_against_f64_model(n: usize) {
        let l = layer();
        let qkv = values(9, n * CH, 1.0);
        let z = values(10, n * NV * HD, 1.0);
        let beta = values(11, n * NV, 2.0);
        let alpha = values(12, n * NV, 2.0);
        let rows: Vec<usize> = (0..n).collect();
        let (mut conv, mut ssm) = (vec![0f32; (TAPS - 1) * CH], vec![0f32; NV * HD * HD]);
        let mut out = vec![0f32; n * NV * HD];
        gated_delta_net(
            &op(&l),
            &qkv,
            &z,
            &beta,
            &alpha,
            &mut [SequenceState {
                rows: &rows,
                conv: &mut conv,
                ssm: &mut ssm,
            }],
            &mut out,
        );
        // Plain model of head 3 (key head 1).
        let (h, kh) = (3usize, 1usize);
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let conv_at = |t: usize, c: usize| -> f64 {
            (0..TAPS)
                .map(|k| {
                    let i = t + k;
                    if i < TAPS - 1 {
                        0.0
                    } else {
                        qkv[(i - (TAPS - 1)) * CH + c] as f64 * l.conv[c * TAPS + k] as f64
                    }
                })
                .sum::<f64>()
        };
        let l2 = |x: Vec<f64>| {
            let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
            x.into_iter().map(|v| v / norm).collect::<Vec<f64>>()
        };
        let mut s = vec![vec![0f64; HD]; HD]; // s[j][i]
        for t in 0..n {
            let q = l2((0..HD).map(|i| silu(conv_at(t, kh * HD + i))).collect());
            let k = l2((0..HD)
                .map(|i| silu(conv_at(t, NK * HD + kh * HD + i)))
                .collect());
            let v: Vec<f64> = (0..HD)
                .map(|j| silu(conv_at(t, 2 * NK * HD + h * HD + j)))
                .collect();
            let x = alpha[t * NV + h] as f64 + l.dt_bias[h] as f64;
            let g = (1.0 + x.exp()).ln() * l.a[h] as f64;
            let b = 1.0 / (1.0 + (-(beta[t * NV + h] as f64)).exp());
            let mut o = [0f64; HD];
            for ((row, o), &vj) in s.iter_mut().zip(o.iter_mut()).zip(&v) {
                row.iter_mut().for_each(|x| *x *= g.exp());
                let sk: f64 = row.iter().zip(&k).map(|(x, k)| x * k).sum();
                let d = (vj - sk) * b;
                row.iter_mut().zip(&k).for_each(|(x, k)| *x += d * k);
                *o = row.iter().zip(&q).map(|(x, q)| x * q).sum::<f64>() / (HD as f64).sqrt();
            }
            let rms = (o.iter().map(|v| v * v).sum::<f64>() / HD as f64 + 1e-6).sqrt();
            for j in 0..HD {
                let zv = z[t * NV * HD + h * HD + j] as f64;
                let want = o[j] / rms * l.norm[j] as f64 * silu(zv);
                let got = out[t * NV * HD + h * HD + j] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{n} tokens, token {t} value {j}: {got} vs {want}"
                );
            }
        }
    }

    /// One head's inputs over `n` tokens: unit queries and keys, values in `[-1, 1]`, log-decays
    /// in `g_range` and write strengths in `b_range`.
    fn head_inputs(
        seed: u64,
        n: usize,
        hd: usize,
        g_range: (f32, f32),
        b_range: (f32, f32),
    ) -> [Vec<f32>; 5] {
        let unit_rows = |seed: u64| {
            let mut x = values(seed, n * hd, 1.0);
            for row in x.chunks_exact_mut(hd) {
                let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                row.iter_mut().for_each(|v| *v /= norm);
            }
            x
        };
        let within = |seed: u64, (low, high): (f32, f32)| -> Vec<f32> {
            values(seed, n, 1.0)
                .iter()
                .map(|u| low + (u + 1.0) * 0.5 * (high - low))
                .collect()
        };
        [
            unit_rows(seed),
            unit_rows(seed + 1),
            values(seed + 2, n * hd, 1.0),
            within(seed + 3, g_range),
            within(seed + 4, b_range),
        ]
    }

    /// The chunked form against the recurrent form (the definition) on one head: outputs and
    /// final state, from a nonzero start state, over one to four chunks, whole and partial, with
    /// decays near 1 and near 0 and write strengths near 0 and near 1.
    ///
    /// Tolerance, as a relative error (the largest difference over the largest magnitude of the
    /// recurrent form's outputs, or state). Both forms compute the same sums in another order,
    /// in f32 (eps = 2^-24). The state's map from one token to the next is a contraction (a decay
    /// at most 1 times `I - b k k^T` with `|k| = 1`, `b` in (0, 1)), so a rounding error made
    /// at one token is not amplified later and the errors of `n` tokens add up: each token (or
    /// each chunk's share of a token) adds the rounding of sums of at most `hd + CHUNK` terms of
    /// magnitude at most the largest state or output value, so the difference between the two
    /// forms is at most `2 (n + CHUNK) (hd + CHUNK) eps` of it (the forward substitution's
    /// coefficients are `b r (k_t·k_s)`, at most 1, and it adds at most `CHUNK` terms per
    /// token, counted in the `CHUNK` of each factor). A wrong decay or a token off by one moves
    /// the results by the decay's size, far beyond the bound with the mixed gates.
    #[test]
    fn the_chunked_form_computes_what_the_recurrent_form_computes() {
        let eps = f32::EPSILON as f64 / 2.0;
        let gates = [
            ("decays near 1", (-1e-3f32, 0.0f32)),
            ("decays near 0", (-20.0, -5.0)),
            ("mixed decays", (-3.0, 0.0)),
        ];
        let strengths = [
            ("writes near 0", (1e-3f32, 1e-2f32)),
            ("writes near 1", (0.99, 1.0)),
            ("mixed writes", (0.0, 1.0)),
        ];
        let cases: &[(usize, usize)] =
            &[(32, 1), (32, 33), (32, 64), (32, 65), (32, 200), (128, 130)];
        let mut seed = 100;
        let mut worst = 0f64;
        for &(hd, n) in cases {
            for (gate_name, g_range) in gates {
                for (strength_name, b_range) in strengths {
                    seed += 10;
                    let [q, k, v, g, b] = head_inputs(seed, n, hd, g_range, b_range);
                    let head = HeadInputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        g: &g,
                        b: &b,
                    };
                    let start = values(seed + 5, hd * hd, 0.25);
                    let scale = 1.0 / (hd as f32).sqrt();
                    let (mut state_r, mut out_r) = (start.clone(), vec![0f32; n * hd]);
                    rule_recurrent(&mut state_r, &head, hd, scale, &mut out_r);
                    let (mut state_c, mut out_c) = (start.clone(), vec![0f32; n * hd]);
                    rule_chunked(&mut state_c, &head, hd, scale, &mut out_c);
                    let relative = |got: &[f32], want: &[f32]| {
                        let largest = want.iter().fold(0f64, |m, &w| m.max(w.abs() as f64));
                        let diff = got
                            .iter()
                            .zip(want)
                            .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
                        assert!(largest > 0.0 && got.iter().all(|v| v.is_finite()));
                        diff / largest
                    };
                    let bound =
                        2.0 * (n + chunked::CHUNK) as f64 * (hd + chunked::CHUNK) as f64 * eps;
                    let (out_error, state_error) =
                        (relative(&out_c, &out_r), relative(&state_c, &state_r));
                    worst = worst.max(out_error / bound).max(state_error / bound);
                    eprintln!(
                        "head {hd}, {n} tokens, {gate_name}, {strength_name}: relative error \
                         outputs {out_error:.2e}, state {state_error:.2e} (bound {bound:.2e})"
                    );
                    assert!(
                        out_error <= bound && state_error <= bound,
                        "head {hd}, {n} tokens, {gate_name}, {strength_name}: outputs off by \
                         {out_error:.3e}, state by {state_error:.3e}, bound {bound:.3e}"
                    );
                }
            }
        }
        eprintln!("largest error over its bound: {worst:.2e}");
    }
}
