//! Gemma 4's forward pass, following llama.cpp's `src/models/gemma4.cpp` op for op so the
//! numbers agree with it.
//!
//! Its block differs from the shared one (`forward.rs`) in enough places that it is written out
//! here, over the same backend ops and the same [`Context`]:
//! - attention: per-layer head size, KV head count and rotary table (global layers use
//!   `rope_freqs` for proportional rope); Q and K RMS-normalised with weights, V without;
//!   attention scale 1; layers past `n_layer_kv` compute only Q and attend over the cache of
//!   an earlier layer of their kind; a layer without `attn_v` uses K's projection as V;
//! - FFN: the dense GeGLU FFN, and on mixture-of-experts layers the experts beside it, each with
//!   its own norms (`post_ffw_norm_1` after the dense one, `pre_ffw_norm_2` / `post_ffw_norm_2`
//!   around the experts), summed, then `post_ffw_norm`. The router reads the block input
//!   RMS-normalised without weight, scaled by `1/sqrt(n_embd)` and by `ffn_gate_inp.scale`;
//! - per-layer embeddings (E models): before the layers, each token's `per_layer_token_embd`
//!   row (times `sqrt(width)`) plus the RMS-normalised projection of its embedding (times
//!   `1/sqrt(n_embd)`), times `1/sqrt(2)`; after each block, `gelu(inp_gate x) * slice`,
//!   projected back, RMS-normalised and added to the residual stream;
//! - an optional `layer_output_scale` on each block's output, and the final logit soft-cap.
//!
//! llama.cpp drops the rows nobody asked logits for only after the final norm; every op before
//! is row-wise, so dropping them there gives the same values.

use super::forward::{Context, Readout};
use super::Model;
use crate::backend::{Backend, Gemma4FfnNorms, MoeFfn, QkNorm, RopeParams};
use crate::batch::Batch;
use crate::ops::FfnActivation;

pub(super) fn run_layers<B: Backend>(model: &Model<B>, ctx: &mut Context<B>, batch: &Batch) {
    let hp = &model.hparams;
    let w = &model.weights;
    let b = &model.backend;
    let arch = hp.architecture;
    let n = batch.len();
    let n_embd = hp.n_embd;
    let n_layer = hp.n_layer;
    let eps = hp.rms_eps;
    let n_vocab = w.n_vocab;
    let Context {
        kv,
        plan,
        bufs,
        out_rows,
        readout,
        logits,
        greedy,
        ..
    } = ctx;
    let n_out = out_rows.len();

    let max_q = hp
        .layers
        .iter()
        .map(|l| l.n_head * l.head_dim)
        .max()
        .unwrap_or(0);
    let max_kv = hp
        .layers
        .iter()
        .map(|l| l.n_head_kv * l.head_dim)
        .max()
        .unwrap_or(0);
    let max_ff = hp.layers.iter().map(|l| l.n_ff).max().unwrap_or(0);
    let n_expert = hp.moe.map_or(0, |m| m.n_expert);
    let width = hp.n_embd_per_layer.unwrap_or(0);
    b.ensure_len(&mut bufs.x, n * n_embd);
    b.ensure_len(&mut bufs.xn, n * n_embd);
    b.ensure_len(&mut bufs.proj, n * n_embd);
    b.ensure_len(&mut bufs.q, n * max_q);
    b.ensure_len(&mut bufs.attn, n * max_q);
    b.ensure_len(&mut bufs.k, n * max_kv);
    b.ensure_len(&mut bufs.v, n * max_kv);
    b.ensure_len(&mut bufs.gate, n * max_ff);
    b.ensure_len(&mut bufs.up, n * max_ff);
    b.ensure_len(&mut bufs.logits, n_out * n_vocab);
    if n_expert > 0 {
        b.ensure_len(&mut bufs.router, n * n_expert);
        b.ensure_len(&mut bufs.moe_in, n * n_embd);
        b.ensure_len(&mut bufs.moe_out, n * n_embd);
        b.ensure_len(&mut bufs.router_in, n * n_embd);
    }
    if width > 0 {
        b.ensure_len(&mut bufs.per_layer_all, n * n_layer * width);
        b.ensure_len(&mut bufs.per_layer_proj, n * n_layer * width);
        b.ensure_len(&mut bufs.per_layer, n * width);
        b.ensure_len(&mut bufs.per_layer_gate, n * width);
    }

    b.get_rows(
        &w.token_embd,
        &batch.tokens,
        (n_embd as f32).sqrt(),
        &mut bufs.x,
    );

    // Per-layer inputs of every layer, `n_layer * width` values per token (llama.cpp's
    // `build_inp_per_layer` and `project_per_layer_inputs`).
    if let Some(pl) = &w.gemma4_per_layer {
        b.get_rows(
            &pl.token_embd,
            &batch.tokens,
            (width as f32).sqrt(),
            &mut bufs.per_layer_all,
        );
        let len = n * n_layer * width;
        b.matmul(&pl.model_proj, &bufs.x, n, &mut bufs.per_layer_proj);
        b.scale(&mut bufs.per_layer_proj, len, 1.0 / (n_embd as f32).sqrt());
        b.rms_norm_inplace(
            &mut bufs.per_layer_proj,
            &pl.proj_norm,
            n * n_layer,
            width,
            eps,
        );
        b.add_inplace(&mut bufs.per_layer_proj, &bufs.per_layer_all, len);
        b.scale(&mut bufs.per_layer_proj, len, 1.0 / 2f32.sqrt());
        std::mem::swap(&mut bufs.per_layer_all, &mut bufs.per_layer_proj);
    }

    let global = RopeParams {
        n_dims: hp.rope_n_dims,
        freq_base: hp.rope_freq_base,
        freq_scale: hp.rope_scaling.freq_scale(),
        freq_factors: w.rope_freqs.as_deref(),
    };
    b.rope_table(&batch.positions, &global, &mut bufs.rope_global);
    if hp.layers.iter().any(|l| l.sliding_window) {
        let local = RopeParams {
            n_dims: hp.rope_n_dims_swa,
            freq_base: hp.rope_freq_base_swa,
            freq_scale: 1.0,
            freq_factors: None,
        };
        b.rope_table(&batch.positions, &local, &mut bufs.rope_local);
    }
    let mode = arch.rope_mode();
    let kq_scale = hp.attention_scale();
    let all_rows: Vec<usize> = (0..n).collect();
    let mut layer_rows: Vec<usize> = Vec::with_capacity(n);

    for (il, (lw, shape)) in w.gemma4_layers.iter().zip(&hp.layers).enumerate() {
        let (n_head, n_head_kv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
        let kv_len = n_head_kv * hd;
        let rope = if shape.sliding_window {
            &bufs.rope_local
        } else {
            &bufs.rope_global
        };

        // Attention block.
        b.rms_norm(&bufs.x, &lw.attn_norm, n, n_embd, eps, &mut bufs.xn);
        match &lw.kv {
            Some(kvw) => {
                match &kvw.wv {
                    Some(wv) => b.matmul_shared(
                        &[&lw.wq, &kvw.wk, wv],
                        &bufs.xn,
                        n,
                        &mut [&mut bufs.q, &mut bufs.k, &mut bufs.v],
                    ),
                    None => {
                        b.matmul_shared(
                            &[&lw.wq, &kvw.wk],
                            &bufs.xn,
                            n,
                            &mut [&mut bufs.q, &mut bufs.k],
                        );
                        // V is K's projection, taken before K's norm and rope.
                        b.gather_rows(&bufs.k, kv_len, &all_rows, &mut bufs.v);
                    }
                }
                b.rms_norm_unit_inplace(&mut bufs.v, n * n_head_kv, hd, eps);
                let norm = QkNorm {
                    q: Some(&lw.q_norm),
                    k: Some(&kvw.k_norm),
                    eps,
                };
                b.rope_kv_store(
                    &mut bufs.q,
                    &mut bufs.k,
                    &bufs.v,
                    norm,
                    rope,
                    n,
                    n_head,
                    n_head_kv,
                    hd,
                    mode,
                    kv.layer_mut(il),
                    plan,
                );
            }
            None => {
                b.matmul(&lw.wq, &bufs.xn, n, &mut bufs.q);
                b.rms_norm_inplace(&mut bufs.q, &lw.q_norm, n * n_head, hd, eps);
                b.rope(&mut bufs.q, rope, n, n_head, hd, mode);
            }
        }
        let window = if shape.sliding_window {
            hp.sliding_window
        } else {
            None
        };
        b.attention(
            &bufs.q,
            kv.layer(shape.kv_source),
            plan,
            n_head,
            n_head_kv,
            hd,
            kq_scale,
            window,
            &mut bufs.attn,
        );
        b.matmul(&lw.wo, &bufs.attn, n, &mut bufs.proj);
        // The attention output normalised into the residual, then the inputs of the dense FFN
        // and, in a layer with experts, of the experts and of the router: one op for all four.
        match &lw.moe {
            Some(moe) => b.gemma4_ffn_inputs(
                &mut bufs.proj,
                &mut bufs.x,
                &Gemma4FfnNorms {
                    post_attn: &lw.post_attn_norm,
                    ffn: &lw.ffn_norm,
                    experts: &moe.pre_norm,
                    router: &moe.router_scale,
                    router_scale: 1.0 / (n_embd as f32).sqrt(),
                },
                n,
                n_embd,
                eps,
                [&mut bufs.xn, &mut bufs.moe_in, &mut bufs.router_in],
            ),
            None => {
                b.rms_norm_add(
                    &mut bufs.proj,
                    &lw.post_attn_norm,
                    n,
                    n_embd,
                    eps,
                    &mut bufs.x,
                );
                b.rms_norm(&bufs.x, &lw.ffn_norm, n, n_embd, eps, &mut bufs.xn);
            }
        }

        // Feed-forward block: the dense FFN, and the experts beside it.
        b.ffn_gate_up(
            &lw.ffn_gate,
            &lw.ffn_up,
            &bufs.xn,
            n,
            shape.n_ff,
            FfnActivation::GeGlu,
            &mut bufs.gate,
            &mut bufs.up,
        );
        b.matmul(&lw.ffn_down, &bufs.gate, n, &mut bufs.proj);
        if let Some(moe) = &lw.moe {
            b.rms_norm_inplace(&mut bufs.proj, &moe.post_norm_dense, n, n_embd, eps);
            // The experts' and the router's inputs came with the dense FFN's, above.
            let experts = &moe.experts;
            b.moe_router(&experts.router, &bufs.router_in, n, &mut bufs.router);
            let op = MoeFfn {
                gate: &experts.gate_exps,
                up: &experts.up_exps,
                down: &experts.down_exps,
                n_ff: experts.params.n_ff_expert,
                activation: FfnActivation::GeGlu,
                routing: experts.params.routing(),
                expert_scale: moe.expert_scale.as_deref(),
                shared: None,
            };
            b.moe_ffn(&op, &bufs.router, &bufs.moe_in, n, &mut bufs.moe_out);
            b.rms_norm_add(
                &mut bufs.moe_out,
                &moe.post_norm_experts,
                n,
                n_embd,
                eps,
                &mut bufs.proj,
            );
        }
        b.rms_norm_add(
            &mut bufs.proj,
            &lw.post_ffn_norm,
            n,
            n_embd,
            eps,
            &mut bufs.x,
        );

        // Per-layer embedding.
        if let Some(pl) = &lw.per_layer {
            layer_rows.clear();
            layer_rows.extend((0..n).map(|t| t * n_layer + il));
            b.gather_rows(&bufs.per_layer_all, width, &layer_rows, &mut bufs.per_layer);
            b.matmul(&pl.inp_gate, &bufs.x, n, &mut bufs.per_layer_gate);
            // `gelu(gate) * slice` is GGML's GELU followed by its multiply: GeGLU's values.
            b.geglu(&mut bufs.per_layer_gate, &bufs.per_layer, n * width);
            b.matmul(&pl.proj, &bufs.per_layer_gate, n, &mut bufs.proj);
            b.rms_norm_add(&mut bufs.proj, &pl.post_norm, n, n_embd, eps, &mut bufs.x);
        }
        if let Some(scale) = lw.out_scale {
            b.scale(&mut bufs.x, n * n_embd, scale);
        }
        // Gemma 4 keeps no recurrent state: a pass may be re-run from its start.
        b.layer_done(il, n_layer);
    }

    logits.clear();
    greedy.clear();
    if n_out == 0 {
        return;
    }
    b.rms_norm(&bufs.x, &w.output_norm, n, n_embd, eps, &mut bufs.xn);
    if n_out < n {
        b.gather_rows(&bufs.xn, n_embd, out_rows, &mut bufs.x);
        std::mem::swap(&mut bufs.x, &mut bufs.xn);
    }
    let output = w.output.as_ref().unwrap_or(&w.token_embd);
    b.matmul(output, &bufs.xn, n_out, &mut bufs.logits);
    if let Some(cap) = hp.final_logit_softcap {
        b.softcap(&mut bufs.logits, n_out * n_vocab, cap);
    }
    match readout {
        Readout::Logits => b.read(&bufs.logits, n_out * n_vocab, logits),
        Readout::Argmax => b.argmax_rows(&bufs.logits, n_out, n_vocab, &mut bufs.argmax, greedy),
    }
}
