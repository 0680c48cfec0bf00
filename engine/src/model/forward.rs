//! The forward pass shared by every architecture but Gemma 4: a pre-norm decoder-only
//! transformer, following llama.cpp's graphs (`build_llama`, `build_qwen2`, `build_qwen3`,
//! `build_gemma3`, and for `qwen3moe` Qwen3's attention with `build_moe_ffn` in place of the FFN,
//! and for `qwen35` / `qwen35moe` llama.cpp's qwen35 graphs) op for op so the numbers agree with
//! it. Gemma 4 runs its own layer loop (`gemma4.rs`) over the same [`Context`]. A
//! mixture-of-experts FFN is the router product here and one backend op ([`Backend::moe_ffn`])
//! for the routing and the experts. A hybrid's linear-attention layer is its four input
//! products here and one backend op ([`Backend::gated_delta_net`]) for the convolution, the
//! delta rule and the gated norm, over the sequences' recurrent states; its full-attention
//! layers split a gate off the query projection and multiply the attention output by
//! `sigmoid(gate)` before the output projection.
//!
//! A [`Context`] owns the paged KV cache (for the layers that attend over it), the recurrent
//! states of hybrid models ([`crate::recurrent_state`]) and every scratch buffer; buffers grow
//! to the largest batch seen and are then reused, so decoding allocates nothing per token in
//! the layer loop.

use super::arch::Architecture;
use super::weights::{FfnWeights, MixerWeights};
use super::{ContextParams, ForwardError, Model, TruncateError};
use crate::backend::{Backend, GatedDeltaNet, MoeFfn, QkNorm, RopeParams, SharedExpert};
use crate::batch::{Batch, SeqId};
use crate::kv_cache::{AttentionPlan, KvCache, PoolStats};
use crate::recurrent_state::{RecurrentStates, StateStats};

/// Activation buffers of one forward pass.
pub(super) struct Buffers<B: Backend> {
    /// The residual stream.
    pub(super) x: B::Buf,
    /// Normalised input of the attention or FFN block.
    pub(super) xn: B::Buf,
    pub(super) q: B::Buf,
    pub(super) k: B::Buf,
    pub(super) v: B::Buf,
    pub(super) attn: B::Buf,
    /// Output of an attention or FFN block before the residual add.
    pub(super) proj: B::Buf,
    pub(super) gate: B::Buf,
    pub(super) up: B::Buf,
    /// Router logits of a mixture-of-experts layer.
    pub(super) router: B::Buf,
    /// A gated query projection (query and gate of each head) and the gate split from it.
    pub(super) q_full: B::Buf,
    pub(super) q_gate: B::Buf,
    /// Inputs of a linear-attention layer: the convolution channels, the output gate, and the
    /// per-head write strength and decay logits.
    pub(super) lin_qkv: B::Buf,
    pub(super) lin_z: B::Buf,
    pub(super) lin_beta: B::Buf,
    pub(super) lin_alpha: B::Buf,
    pub(super) logits: B::Buf,
    /// Gemma 4: the experts' input and output beside the dense FFN's, and the router's input.
    pub(super) moe_in: B::Buf,
    pub(super) moe_out: B::Buf,
    pub(super) router_in: B::Buf,
    /// Gemma 4: every layer's per-layer input (`n_layer * width` values per token), one
    /// layer's slice of it, and that slice's gate.
    pub(super) per_layer_all: B::Buf,
    pub(super) per_layer_proj: B::Buf,
    pub(super) per_layer: B::Buf,
    pub(super) per_layer_gate: B::Buf,
    /// The arg-max indices of a greedy readout, where the backend keeps them.
    pub(super) argmax: B::Buf,
    pub(super) rope_global: B::RopeTable,
    pub(super) rope_local: B::RopeTable,
}

/// The state of one model instance: its KV cache, the recurrent states of hybrid models, and
/// scratch buffers.
pub struct Context<B: Backend> {
    params: ContextParams,
    /// KV blocks of the layers that attend over the cache (every layer but the linear-attention
    /// ones); `kv_layer_of[il]` is layer `il`'s index in it.
    pub(super) kv: KvCache<B>,
    pub(super) kv_layer_of: Vec<Option<usize>>,
    /// Recurrent states of the linear-attention layers (empty for other models).
    states: RecurrentStates<B>,
    /// The batch's rows grouped by sequence, in position order, for the linear-attention op.
    seq_groups: Vec<(SeqId, Vec<usize>)>,
    pub(super) plan: AttentionPlan,
    pub(super) bufs: Buffers<B>,
    pub(super) out_rows: Vec<usize>,
    /// What the current pass hands back: logits rows, or only their arg-max.
    pub(super) readout: Readout,
    pub(super) logits: Vec<f32>,
    /// Greedy tokens of the last forward pass read out by arg-max.
    pub(super) greedy: Vec<u32>,
    /// Sequence lengths before the current batch (see `forward`).
    lens_before: Vec<(SeqId, usize)>,
}

impl<B: Backend> Context<B> {
    pub(super) fn new(model: &Model<B>, params: ContextParams) -> Self {
        let hp = &model.hparams;
        let b = &model.backend;
        let block_size = params.kv_block_size.max(1);
        let capacity_blocks = params.kv_capacity_tokens.max(1).div_ceil(block_size);
        // Layers with a recurrent state (hybrids' linear attention) have no KV storage, nor do
        // layers that reuse an earlier layer's cache (Gemma 4's KV sharing: they come last, so
        // every other layer's storage index is its own index there); `kv_layer_of[il]` is where
        // layer `il` reads and writes.
        let mut kv_layer_of: Vec<Option<usize>> = Vec::with_capacity(hp.n_layer);
        let mut shapes: Vec<(usize, usize)> = Vec::new();
        for (il, l) in hp.layers.iter().enumerate() {
            if l.recurrent {
                kv_layer_of.push(None);
            } else if l.kv_source != il {
                kv_layer_of.push(kv_layer_of[l.kv_source]);
            } else {
                kv_layer_of.push(Some(shapes.len()));
                shapes.push((l.n_head_kv, l.head_dim));
            }
        }
        let kv = KvCache::new(b, &shapes, block_size, params.n_ctx, capacity_blocks);
        let n_recurrent = hp.layers.iter().filter(|l| l.recurrent).count();
        let states = match &hp.linear_attention {
            Some(linear) if n_recurrent > 0 => {
                RecurrentStates::new(n_recurrent, linear.conv_state_len(), linear.ssm_state_len())
            }
            _ => RecurrentStates::new(0, 0, 0),
        };
        let bufs = Buffers {
            x: b.alloc(0),
            xn: b.alloc(0),
            q: b.alloc(0),
            k: b.alloc(0),
            v: b.alloc(0),
            attn: b.alloc(0),
            proj: b.alloc(0),
            gate: b.alloc(0),
            up: b.alloc(0),
            router: b.alloc(0),
            q_full: b.alloc(0),
            q_gate: b.alloc(0),
            lin_qkv: b.alloc(0),
            lin_z: b.alloc(0),
            lin_beta: b.alloc(0),
            lin_alpha: b.alloc(0),
            logits: b.alloc(0),
            argmax: b.alloc(0),
            moe_in: b.alloc(0),
            moe_out: b.alloc(0),
            router_in: b.alloc(0),
            per_layer_all: b.alloc(0),
            per_layer_proj: b.alloc(0),
            per_layer: b.alloc(0),
            per_layer_gate: b.alloc(0),
            rope_global: b.rope_table_new(),
            rope_local: b.rope_table_new(),
        };
        Context {
            params,
            kv,
            kv_layer_of,
            states,
            seq_groups: Vec::new(),
            plan: AttentionPlan::default(),
            bufs,
            out_rows: Vec::new(),
            readout: Readout::Logits,
            logits: Vec::new(),
            greedy: Vec::new(),
            lens_before: Vec::new(),
        }
    }

    /// The sizes this context was made with.
    pub fn params(&self) -> ContextParams {
        self.params
    }

    /// The KV cache.
    pub fn kv(&self) -> &KvCache<B> {
        &self.kv
    }

    /// The KV cache, for the scheduler's prefix-cache bookkeeping (sharing blocks, naming them,
    /// evicting them).
    pub fn kv_mut(&mut self) -> &mut KvCache<B> {
        &mut self.kv
    }

    /// Tokens cached for a sequence.
    pub fn seq_len(&self, seq_id: SeqId) -> usize {
        self.kv.seq_len(seq_id)
    }

    /// Ends a sequence, returning its KV blocks to the pool and freeing its recurrent states.
    pub fn free_sequence(&mut self, seq_id: SeqId) {
        self.kv.free_sequence(seq_id);
        self.states.free_sequence(seq_id);
    }

    /// Drops the tokens of `seq_id` from position `len` on. A model with recurrent state (see
    /// [`crate::recurrent_state`]) cannot cut a sequence back: there truncating to 0 ends the
    /// sequence and any other shorter length is refused, leaving the sequence as it was.
    pub fn truncate_sequence(&mut self, seq_id: SeqId, len: usize) -> Result<(), TruncateError> {
        let current = self.kv.seq_len(seq_id);
        if len >= current {
            return Ok(());
        }
        if self.states.is_used() {
            if len > 0 {
                return Err(TruncateError::RecurrentState {
                    seq_id,
                    len,
                    current,
                });
            }
            self.free_sequence(seq_id);
            return Ok(());
        }
        self.kv.truncate_sequence(seq_id, len);
        Ok(())
    }

    /// Ends every sequence.
    pub fn clear(&mut self) {
        self.kv.clear();
        self.states.clear();
    }

    /// KV block pool counts.
    pub fn kv_stats(&self) -> PoolStats {
        self.kv.stats()
    }

    /// Whether the model keeps a recurrent state per sequence (a hybrid with linear-attention
    /// layers): such sequences cannot share a cached prefix or be cut back.
    pub fn has_recurrent_state(&self) -> bool {
        self.states.is_used()
    }

    /// Recurrent state counts (zero for models without linear-attention layers).
    pub fn state_stats(&self) -> StateStats {
        self.states.stats()
    }

    /// Logits of the last forward pass.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Gives the memory of free KV blocks back to the backend, keeping at most `keep_free`
    /// of them resident for reuse. On a device this is what lets device memory return to the
    /// post-load floor once sequences end (the pool hands it to the driver when idle).
    pub fn release_free_kv(&mut self, model: &Model<B>, keep_free: usize) {
        self.kv.trim(&model.backend, keep_free);
    }

    /// Frees the activation buffers; the next forward pass allocates them again. For idle
    /// periods on a device, where every byte above the post-load floor counts.
    pub fn release_scratch(&mut self, model: &Model<B>) {
        let b = &model.backend;
        let bufs = &mut self.bufs;
        for buf in [
            &mut bufs.x,
            &mut bufs.xn,
            &mut bufs.q,
            &mut bufs.k,
            &mut bufs.v,
            &mut bufs.attn,
            &mut bufs.proj,
            &mut bufs.gate,
            &mut bufs.up,
            &mut bufs.router,
            &mut bufs.q_full,
            &mut bufs.q_gate,
            &mut bufs.lin_qkv,
            &mut bufs.lin_z,
            &mut bufs.lin_beta,
            &mut bufs.lin_alpha,
            &mut bufs.logits,
            &mut bufs.argmax,
            &mut bufs.moe_in,
            &mut bufs.moe_out,
            &mut bufs.router_in,
            &mut bufs.per_layer_all,
            &mut bufs.per_layer_proj,
            &mut bufs.per_layer,
            &mut bufs.per_layer_gate,
        ] {
            *buf = b.alloc(0);
        }
        bufs.rope_global = b.rope_table_new();
        bufs.rope_local = b.rope_table_new();
        b.release_op_scratch();
    }
}

/// What a forward pass hands back for the rows that asked for output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readout {
    /// Each row's logits, `n_vocab` values.
    Logits,
    /// Each row's greedy token ([`crate::sample::greedy_token`]), taken by the backend where
    /// the logits are, so only the indices cross to host memory.
    Argmax,
}

/// Evaluates `batch`; the output is in `ctx.logits` or `ctx.greedy` as `readout` asks.
pub(super) fn forward<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    batch: &Batch,
    readout: Readout,
) -> Result<(), ForwardError> {
    if batch.is_empty() {
        return Err(ForwardError::EmptyBatch);
    }
    let n_vocab = model.n_vocab();
    if let Some((index, &token)) = batch
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= n_vocab)
    {
        return Err(ForwardError::TokenOutOfRange {
            token,
            index,
            n_vocab,
        });
    }
    let backend = &model.backend;
    // A failure left over from an op outside a forward pass (a release of KV blocks) belongs to
    // no batch; it is logged rather than blamed on this one.
    if let Some(stale) = backend.take_failure() {
        tracing::warn!(%stale, "device op failed outside a forward pass");
    }
    // Each sequence's length before the batch, to undo the batch if the device fails.
    ctx.lens_before.clear();
    for &seq_id in &batch.seq_ids {
        if !ctx.lens_before.iter().any(|&(s, _)| s == seq_id) {
            ctx.lens_before.push((seq_id, ctx.kv.seq_len(seq_id)));
        }
    }
    ctx.kv.plan(backend, batch, &mut ctx.plan)?;
    if ctx.states.is_used() {
        ctx.seq_groups.clear();
        for (row, &seq_id) in batch.seq_ids.iter().enumerate() {
            match ctx.seq_groups.iter_mut().find(|(s, _)| *s == seq_id) {
                Some((_, rows)) => rows.push(row),
                None => ctx.seq_groups.push((seq_id, vec![row])),
            }
        }
        // Rows of a sequence in position order (the plan checked the positions follow on).
        for (_, rows) in &mut ctx.seq_groups {
            rows.sort_by_key(|&r| batch.positions[r]);
        }
        ctx.states
            .ensure(backend, ctx.seq_groups.iter().map(|(s, _)| *s));
        backend.begin_states(&ctx.states.layer_states(0, &ctx.seq_groups));
    }
    ctx.out_rows.clear();
    ctx.out_rows.extend(batch.output_rows());
    ctx.readout = readout;
    backend.begin_forward(batch, &ctx.plan, &ctx.out_rows);
    let run = match model.hparams.architecture {
        Architecture::Gemma4 => super::gemma4::run_layers::<B>,
        _ => run_layers::<B>,
    };
    backend.install(|| run(model, ctx, batch));
    if backend.end_forward() {
        backend.install(|| run(model, ctx, batch));
    }
    if let Some(failure) = backend.take_failure() {
        for &(seq_id, len) in &ctx.lens_before {
            if ctx.states.is_used() {
                // The recurrent states already absorbed the batch and cannot be rewound: the
                // sequence ends (see `crate::recurrent_state`).
                ctx.kv.free_sequence(seq_id);
                ctx.states.free_sequence(seq_id);
            } else {
                ctx.kv.rollback_sequence(seq_id, len);
            }
        }
        ctx.logits.clear();
        ctx.greedy.clear();
        return Err(ForwardError::Backend(failure));
    }
    Ok(())
}

fn run_layers<B: Backend>(model: &Model<B>, ctx: &mut Context<B>, batch: &Batch) {
    let hp = &model.hparams;
    let w = &model.weights;
    let b = &model.backend;
    let arch = hp.architecture;
    let n = batch.len();
    let n_embd = hp.n_embd;
    let hd = hp.head_dim_k;
    let eps = hp.rms_eps;
    let n_vocab = w.n_vocab;
    let Context {
        kv,
        kv_layer_of,
        states,
        seq_groups,
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
        .filter(|l| !l.recurrent)
        .map(|l| l.n_head * hd)
        .max()
        .unwrap_or(0);
    let max_kv = hp
        .layers
        .iter()
        .filter(|l| !l.recurrent)
        .map(|l| l.n_head_kv * hd)
        .max()
        .unwrap_or(0);
    // The attention output buffer also takes a linear-attention layer's output.
    let max_attn = max_q.max(hp.linear_attention.map_or(0, |l| l.value_dim()));
    // Mixture-of-experts layers keep their expert activations in the backend's own scratch.
    let max_ff = hp
        .layers
        .iter()
        .filter(|l| !l.moe)
        .map(|l| l.n_ff)
        .max()
        .unwrap_or(0);
    let n_expert = hp.moe.map_or(0, |m| m.n_expert);
    b.ensure_len(&mut bufs.x, n * n_embd);
    b.ensure_len(&mut bufs.xn, n * n_embd);
    b.ensure_len(&mut bufs.proj, n * n_embd);
    b.ensure_len(&mut bufs.q, n * max_q);
    b.ensure_len(&mut bufs.attn, n * max_attn);
    if arch.hybrid_recurrent() {
        b.ensure_len(&mut bufs.q_full, n * 2 * max_q);
        b.ensure_len(&mut bufs.q_gate, n * max_q);
    }
    if let Some(linear) = &hp.linear_attention {
        b.ensure_len(&mut bufs.lin_qkv, n * linear.conv_channels());
        b.ensure_len(&mut bufs.lin_z, n * linear.value_dim());
        b.ensure_len(&mut bufs.lin_beta, n * linear.n_v_heads);
        b.ensure_len(&mut bufs.lin_alpha, n * linear.n_v_heads);
    }
    b.ensure_len(&mut bufs.k, n * max_kv);
    b.ensure_len(&mut bufs.v, n * max_kv);
    b.ensure_len(&mut bufs.gate, n * max_ff);
    b.ensure_len(&mut bufs.up, n * max_ff);
    b.ensure_len(&mut bufs.router, n * n_expert);
    b.ensure_len(&mut bufs.logits, n_out * n_vocab);

    let embed_scale = if arch.scales_embeddings() {
        (n_embd as f32).sqrt()
    } else {
        1.0
    };
    b.get_rows(&w.token_embd, &batch.tokens, embed_scale, &mut bufs.x);

    let global = RopeParams {
        n_dims: hp.rope_n_dims,
        freq_base: hp.rope_freq_base,
        freq_scale: hp.rope_scaling.freq_scale(),
        freq_factors: w.rope_freqs.as_deref(),
    };
    b.rope_table(&batch.positions, &global, &mut bufs.rope_global);
    let any_local = hp.layers.iter().any(|l| l.sliding_window);
    if any_local {
        let local = RopeParams {
            n_dims: hp.rope_n_dims_swa,
            freq_base: hp.rope_freq_base_swa,
            freq_scale: 1.0,
            freq_factors: None,
        };
        b.rope_table(&batch.positions, &local, &mut bufs.rope_local);
    }
    let mode = arch.rope_mode();
    let attn_scale = hp.attention_scale();

    // Rows still flowing through the network: every token, until the last layer drops the ones
    // whose logits nobody asked for (as llama.cpp does with `inp_out_ids`).
    let mut n_rows = n;
    // Whether `xn` already holds this layer's attention input: the previous layer's last residual
    // add ran fused with this layer's norm (`Backend::add_rms_norm`, one kernel on a device).
    let mut xn_ready = false;
    // Index of the next linear-attention layer among them (its slot in the state store).
    let mut recurrent_index = 0;
    for (il, (lw, shape)) in w.layers.iter().zip(&hp.layers).enumerate() {
        let (n_head, n_head_kv) = (shape.n_head, shape.n_head_kv);
        let (q_len, kv_len) = (n_head * hd, n_head_kv * hd);

        // Attention (or linear-attention) block.
        if !xn_ready {
            b.rms_norm(&bufs.x, &lw.attn_norm, n, n_embd, eps, &mut bufs.xn);
        }
        xn_ready = false;
        match &lw.mixer {
            MixerWeights::Linear(lin) => {
                // `has_recurrent_state` layers exist only with these hyperparameters.
                let linear = hp
                    .linear_attention
                    .as_ref()
                    .expect("a linear-attention layer in a model without its hyperparameters");
                b.matmul_shared(
                    &[&lin.qkv, &lin.gate, &lin.beta, &lin.alpha],
                    &bufs.xn,
                    n,
                    &mut [
                        &mut bufs.lin_qkv,
                        &mut bufs.lin_z,
                        &mut bufs.lin_beta,
                        &mut bufs.lin_alpha,
                    ],
                );
                let op = GatedDeltaNet {
                    conv: &lin.conv,
                    dt_bias: &lin.dt_bias,
                    a: &lin.a,
                    norm: &lin.norm,
                    conv_kernel: linear.conv_kernel,
                    n_k_heads: linear.n_k_heads,
                    n_v_heads: linear.n_v_heads,
                    head_dim: linear.head_v_dim,
                    eps,
                };
                let mut seq_states = states.layer_states(recurrent_index, seq_groups);
                recurrent_index += 1;
                b.gated_delta_net(
                    &op,
                    &bufs.lin_qkv,
                    &bufs.lin_z,
                    &bufs.lin_beta,
                    &bufs.lin_alpha,
                    &mut seq_states,
                    &mut bufs.attn,
                );
                b.matmul(&lin.out, &bufs.attn, n, &mut bufs.proj);
            }
            MixerWeights::Attention(att) => {
                let kv_index = kv_layer_of[il].expect("an attention layer without KV storage");
                if att.query_gate {
                    b.matmul_shared(
                        &[&att.wq, &att.wk, &att.wv],
                        &bufs.xn,
                        n,
                        &mut [&mut bufs.q_full, &mut bufs.k, &mut bufs.v],
                    );
                    b.split_query_gate(&bufs.q_full, n, n_head, hd, &mut bufs.q, &mut bufs.q_gate);
                } else {
                    b.matmul_shared(
                        &[&att.wq, &att.wk, &att.wv],
                        &bufs.xn,
                        n,
                        &mut [&mut bufs.q, &mut bufs.k, &mut bufs.v],
                    );
                }
                if let Some(bias) = &att.bq {
                    b.add_bias(&mut bufs.q, bias, n, q_len);
                }
                if let Some(bias) = &att.bk {
                    b.add_bias(&mut bufs.k, bias, n, kv_len);
                }
                if let Some(bias) = &att.bv {
                    b.add_bias(&mut bufs.v, bias, n, kv_len);
                }
                let rope = if shape.sliding_window {
                    &bufs.rope_local
                } else {
                    &bufs.rope_global
                };
                // The QK-norm, rope of q and k and the K/V store (one kernel on a device); the
                // query scaling below touches only q, so doing it after the store leaves every
                // value as before.
                let norm = QkNorm {
                    q: att.q_norm.as_ref(),
                    k: att.k_norm.as_ref(),
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
                    kv.layer_mut(kv_index),
                    plan,
                );
                let kq_scale = if arch.scales_queries() {
                    b.scale(&mut bufs.q, n * q_len, attn_scale);
                    1.0
                } else {
                    attn_scale
                };
                let window = if shape.sliding_window {
                    hp.sliding_window
                } else {
                    None
                };
                b.attention(
                    &bufs.q,
                    kv.layer(kv_index),
                    plan,
                    n_head,
                    n_head_kv,
                    hd,
                    kq_scale,
                    window,
                    &mut bufs.attn,
                );
                if att.query_gate {
                    b.mul_sigmoid(&mut bufs.attn, &bufs.q_gate, n * q_len);
                }
                b.matmul(&att.wo, &bufs.attn, n, &mut bufs.proj);
                if let Some(bias) = &att.bo {
                    b.add_bias(&mut bufs.proj, bias, n, n_embd);
                }
            }
        }
        if let Some(norm) = &lw.post_attn_norm {
            b.rms_norm_inplace(&mut bufs.proj, norm, n, n_embd, eps);
        }
        // Feed-forward block.
        if il + 1 == hp.n_layer && n_out < n {
            b.add_inplace(&mut bufs.x, &bufs.proj, n * n_embd);
            b.gather_rows(&bufs.x, n_embd, out_rows, &mut bufs.xn);
            std::mem::swap(&mut bufs.x, &mut bufs.xn);
            n_rows = n_out;
            b.rms_norm(&bufs.x, &lw.ffn_norm, n_rows, n_embd, eps, &mut bufs.xn);
        } else {
            b.add_rms_norm(
                &mut bufs.x,
                &bufs.proj,
                &lw.ffn_norm,
                n_rows,
                n_embd,
                eps,
                &mut bufs.xn,
            );
        }
        match &lw.ffn {
            FfnWeights::Dense { gate, up, down } => {
                b.ffn_gate_up(
                    gate,
                    up,
                    &bufs.xn,
                    n_rows,
                    shape.n_ff,
                    arch.ffn_activation(),
                    &mut bufs.gate,
                    &mut bufs.up,
                );
                b.matmul(down, &bufs.gate, n_rows, &mut bufs.proj);
            }
            FfnWeights::Moe(moe) => {
                let params = &moe.params;
                b.moe_router(&moe.router, &bufs.xn, n_rows, &mut bufs.router);
                let op = MoeFfn {
                    gate: &moe.gate_exps,
                    up: &moe.up_exps,
                    down: &moe.down_exps,
                    n_ff: params.n_ff_expert,
                    activation: arch.ffn_activation(),
                    routing: params.routing(),
                    expert_scale: None,
                    shared: moe.shared.as_ref().map(|s| SharedExpert {
                        gate: &s.gate,
                        up: &s.up,
                        down: &s.down,
                        n_ff: s.n_ff,
                        gate_inp: s.gate_inp.as_ref(),
                    }),
                };
                b.moe_ffn(&op, &bufs.router, &bufs.xn, n_rows, &mut bufs.proj);
            }
        }
        if let Some(norm) = &lw.post_ffn_norm {
            b.rms_norm_inplace(&mut bufs.proj, norm, n_rows, n_embd, eps);
        }
        match w.layers.get(il + 1) {
            Some(next) => {
                b.add_rms_norm(
                    &mut bufs.x,
                    &bufs.proj,
                    &next.attn_norm,
                    n_rows,
                    n_embd,
                    eps,
                    &mut bufs.xn,
                );
                xn_ready = true;
            }
            None => b.add_inplace(&mut bufs.x, &bufs.proj, n_rows * n_embd),
        }
        if !states.is_used() {
            b.layer_done(il, hp.layers.len());
        }
    }

    // Output rows: after the last layer `x` holds exactly them when some were dropped.
    if n_rows != n_out {
        b.gather_rows(&bufs.x, n_embd, out_rows, &mut bufs.xn);
        std::mem::swap(&mut bufs.x, &mut bufs.xn);
    }
    logits.clear();
    greedy.clear();
    if n_out == 0 {
        return;
    }
    b.rms_norm_inplace(&mut bufs.x, &w.output_norm, n_out, n_embd, eps);
    let output = w.output.as_ref().unwrap_or(&w.token_embd);
    b.matmul(output, &bufs.x, n_out, &mut bufs.logits);
    if let Some(cap) = hp.final_logit_softcap {
        b.softcap(&mut bufs.logits, n_out * n_vocab, cap);
    }
    match readout {
        Readout::Logits => b.read(&bufs.logits, n_out * n_vocab, logits),
        Readout::Argmax => b.argmax_rows(&bufs.logits, n_out, n_vocab, &mut bufs.argmax, greedy),
    }
}
