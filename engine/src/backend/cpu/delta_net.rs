//! Gated DeltaNet (Qwen 3.5's linear attention) on the CPU, after llama.cpp's qwen35 graph
//! (`build_layer_attn_linear`, `build_conv_state`) and GGML's CPU ops it runs on:
//! `ggml_ssm_conv` (a plain f32 sum over the taps), SiLU, the L2 norm built as
//! `rms_norm(x, eps / n) / sqrt(n)`, and the fused `ggml_gated_delta_net`, which on the CPU is
//! the sequential recurrence for prompts and decoding alike (llama.cpp enables the fused op on
//! every backend that has it, so its chunked graph form never runs there). Doing the same
//! recurrence for a prompt as for one-token steps makes the two agree to the bit.
//!
//! Per value head `h` (query and key head `h % n_k_heads`) and token, with the state `S` stored
//! as GGML stores it (row `j` over the key index):
//! `S *= exp(g)`; `delta[j] = (v[j] - S[j]·k) * beta`; `S[j] += delta[j] * k`;
//! `o[j] = (S[j]·q) / sqrt(head_dim)`, with `g = softplus(alpha + dt_bias) * a` and
//! `beta = sigmoid(beta_logit)`. The dot products and updates are GGML's `ggml_vec_dot_f32` and
//! `ggml_vec_mad_f32` ([`vec::dot_f32_ggml`], [`vec::mad_f32`]).

use rayon::prelude::*;

use super::{ops, vec};
use crate::backend::GatedDeltaNet;

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
                let weights = &op.conv[c * taps..(c + 1) * taps];
                let input = |i: usize| -> f32 {
                    if i < kept {
                        state[i]
                    } else {
                        qkv[rows[i - kept] * channels + c]
                    }
                };
                for (t, o) in col.iter_mut().enumerate() {
                    let mut sum = 0f32;
                    for (k, &w) in weights.iter().enumerate() {
                        sum += input(t + k) * w;
                    }
                    *o = vec::silu_ggml(sum);
                }
                let next: Vec<f32> = (0..kept).map(|i| input(n + i)).collect();
                state.copy_from_slice(&next);
            });
        // Token-major Q, K and V with each query and key head L2-normalised.
        let mut conv_out = vec![0f32; n * channels];
        for (t, row) in conv_out.chunks_exact_mut(channels).enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = conv_t[c * n + t];
            }
            for head in row[..2 * key_dim].chunks_exact_mut(hd) {
                l2_norm(head, op.eps);
            }
        }
        // The recurrence, one task per value head, each writing its own column block.
        let scale = 1.0 / (hd as f32).sqrt();
        let mut per_head = vec![0f32; n_v * n * hd];
        per_head
            .par_chunks_mut(n * hd)
            .zip(seq.ssm.par_chunks_mut(hd * hd))
            .enumerate()
            .for_each(|(h, (o_head, state))| {
                let kh = h % n_k;
                let mut delta = vec![0f32; hd];
                for (t, &row) in rows.iter().enumerate() {
                    let x = &conv_out[t * channels..(t + 1) * channels];
                    let q = &x[kh * hd..(kh + 1) * hd];
                    let k = &x[key_dim + kh * hd..key_dim + (kh + 1) * hd];
                    let v = &x[2 * key_dim + h * hd..2 * key_dim + (h + 1) * hd];
                    let g = softplus(alpha[row * n_v + h] + op.dt_bias[h]) * op.a[h];
                    let b = sigmoid(beta[row * n_v + h]);
                    let decay = g.exp();
                    state.iter_mut().for_each(|s| *s *= decay);
                    for (j, d) in delta.iter_mut().enumerate() {
                        let sk = vec::dot_f32_ggml(&state[j * hd..(j + 1) * hd], k);
                        *d = (v[j] - sk) * b;
                    }
                    for (j, &d) in delta.iter().enumerate() {
                        vec::mad_f32(&mut state[j * hd..(j + 1) * hd], d, k);
                    }
                    let o = &mut o_head[t * hd..(t + 1) * hd];
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = vec::dot_f32_ggml(&state[j * hd..(j + 1) * hd], q) * scale;
                    }
                }
            });
        // The gated norm: rms_norm(o) * norm * silu(z), per head.
        for (t, &row) in rows.iter().enumerate() {
            let dst = &mut out[row * value_dim..(row + 1) * value_dim];
            for h in 0..n_v {
                let o = &per_head[(h * n + t) * hd..(h * n + t + 1) * hd];
                let d = &mut dst[h * hd..(h + 1) * hd];
                ops::rms_norm_row(o, op.norm, op.eps, d);
                let zh = &z[row * value_dim + h * hd..row * value_dim + (h + 1) * hd];
                for (d, &zv) in d.iter_mut().zip(zh) {
                    *d *= vec::silu_ggml(zv);
                }
            }
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

    /// The recurrence against a plain f64 transcription of the delta rule for one head.
    #[test]
    fn the_recurrence_computes_the_gated_delta_rule() {
        let l = layer();
        let n = 5;
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
                    "token {t} value {j}: {got} vs {want}"
                );
            }
        }
    }
}
