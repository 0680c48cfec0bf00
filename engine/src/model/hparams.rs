//! Typed, validated hyperparameters read from GGUF metadata (`<arch>.embedding_length`, ...).
//!
//! Everything the forward pass relies on is checked here once, so the model code can index
//! without re-checking: counts positive and bounded, heads divisible into KV groups, rotary
//! dimensions even and within a head. Each error names the metadata key at fault.

use ember_gguf::{Array, Metadata, Value};

use super::arch::{Architecture, Presence};
use super::ModelError;
use crate::backend::{ExpertGating, MoeRouting};

/// Upper bounds on sizes, far above any real model, so a hostile file cannot make the loader
/// allocate or loop without end.
const MAX_LAYERS: usize = 4096;
const MAX_HEADS: usize = 4096;
const MAX_DIM: usize = 1 << 20;
const MAX_EXPERTS: usize = 4096;

/// How positions are stretched for contexts longer than the training one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions as they are.
    None,
    /// Positions divided by `factor` (`rope.scaling.type = linear`).
    Linear { factor: f32 },
}

/// Per-layer shape; most models use one value for every layer, some vary KV heads or FFN size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    /// Whether the layer uses sliding-window attention (and the local rotary base).
    pub sliding_window: bool,
    /// Whether the layer's FFN is a mixture of experts (see [`HParams::moe`]); `n_ff` is then
    /// the dense size the metadata states, which the layer does not use (Gemma 4 runs a dense
    /// FFN of that size beside its experts).
    pub moe: bool,
    /// Size of each Q, K and V head (Gemma 4: larger on global layers than on sliding ones).
    pub head_dim: usize,
    /// Rotated elements per head.
    pub rope_n_dims: usize,
    /// The layer whose KV cache this layer attends over: itself, or for Gemma 4's KV-sharing
    /// layers an earlier layer of the same kind (the layer then computes no K or V, and the
    /// cache has no storage for it).
    pub kv_source: usize,
    /// Whether the layer is a linear-attention layer (Gated DeltaNet, see
    /// [`HParams::linear_attention`]) with a recurrent state per sequence instead of KV blocks;
    /// `n_head` and `n_head_kv` then describe the full-attention layers, not this one.
    pub recurrent: bool,
}

/// The Gated DeltaNet layers of a hybrid model (Qwen 3.5), from the `<arch>.ssm.*` keys as
/// llama.cpp's converter writes them: `conv_kernel` (linear_conv_kernel_dim), `state_size` (the
/// key head size), `group_count` (key heads), `time_step_rank` (value heads) and `inner_size`
/// (value heads times the value head size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttention {
    /// Taps of the causal convolution over the Q, K and V channels.
    pub conv_kernel: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Size of each key (and query) head; equal to the value head size.
    pub head_k_dim: usize,
    pub head_v_dim: usize,
}

impl LinearAttention {
    /// Width of the concatenated query (and key) heads.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k_dim
    }

    /// Width of the concatenated value heads (and of the output gate `z`).
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v_dim
    }

    /// Channels the convolution runs over: Q, K and V.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Floats of one layer's convolution state: the last `conv_kernel - 1` inputs per channel.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels()
    }

    /// Floats of one layer's recurrent state: a `head_v_dim` x `head_k_dim` matrix per value
    /// head.
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.head_v_dim * self.head_k_dim
    }
}

/// The mixture of experts of a model whose FFN layers route each token to a few experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeParams {
    /// Experts per layer (`<arch>.expert_count`).
    pub n_expert: usize,
    /// Experts each token goes through (`<arch>.expert_used_count`).
    pub n_expert_used: usize,
    /// Rows of each expert's gate and up projections (`<arch>.expert_feed_forward_length`,
    /// else the dense FFN size divided by the experts used, as llama.cpp does).
    pub n_ff_expert: usize,
    /// Rows of the shared expert's gate and up projections when layers have one
    /// (`<arch>.expert_shared_feed_forward_length`, else the dense FFN size).
    pub n_ff_shared: Option<usize>,
    /// Whether the shared expert's output is gated per token.
    pub shared_expert_gate: bool,
    pub gating: ExpertGating,
    pub normalize_weights: bool,
    /// A factor on the chosen weights after normalisation, when the model has one.
    pub weights_scale: Option<f32>,
}

impl MoeParams {
    /// The routing rule the backend op takes.
    pub fn routing(&self) -> MoeRouting {
        MoeRouting {
            n_expert: self.n_expert,
            n_expert_used: self.n_expert_used,
            gating: self.gating,
            normalize_weights: self.normalize_weights,
            weights_scale: self.weights_scale,
        }
    }
}

/// The hyperparameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    pub architecture: Architecture,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    /// Size of each Q and K head.
    pub head_dim_k: usize,
    /// Size of each V head.
    pub head_dim_v: usize,
    pub layers: Vec<LayerShape>,
    pub rms_eps: f32,
    /// Rotated elements per head.
    pub rope_n_dims: usize,
    pub rope_freq_base: f32,
    pub rope_scaling: RopeScaling,
    /// Rotary base of sliding-window layers (Gemma 3 uses 10000 there).
    pub rope_freq_base_swa: f32,
    /// Window of sliding-window layers, in tokens (a token sees itself and the `n - 1` before).
    pub sliding_window: Option<usize>,
    /// `cap * tanh(logits / cap)` on the output, when set.
    pub final_logit_softcap: Option<f32>,
    /// Vocabulary size from metadata when present (else the embedding table decides).
    pub n_vocab_metadata: Option<usize>,
    /// The mixture of experts, for architectures whose FFN layers are mixtures of experts.
    pub moe: Option<MoeParams>,
    /// The linear-attention layers of a hybrid model (see [`LayerShape::recurrent`]).
    pub linear_attention: Option<LinearAttention>,
    /// Rotated elements per head of sliding-window layers.
    pub rope_n_dims_swa: usize,
    /// Layers that have KV storage of their own: the first `n_layer_kv` (Gemma 4's E models
    /// share the last layers' caches; every layer elsewhere).
    pub n_layer_kv: usize,
    /// Width of each layer's slice of Gemma 4's per-layer token embeddings, when the model has
    /// them (`<arch>.embedding_length_per_layer_input`, E models).
    pub n_embd_per_layer: Option<usize>,
}

/// Gemma 3 alternates five sliding-window layers with one global layer (llama.cpp's
/// `set_swa_pattern(6)`).
const GEMMA3_SWA_PERIOD: usize = 6;

struct Keys<'a> {
    arch: &'a str,
    md: &'a Metadata,
}

impl Keys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{}", self.arch, suffix)
    }

    fn usize_req(&self, suffix: &str, max: usize) -> Result<usize, ModelError> {
        let key = self.key(suffix);
        let v = self.md.get_u32(&key)? as usize;
        check_range(&key, v, 1, max)
    }

    fn usize_opt(&self, suffix: &str, max: usize) -> Result<Option<usize>, ModelError> {
        let key = self.key(suffix);
        match self.md.get_u32_opt(&key)? {
            Some(v) => Ok(Some(check_range(&key, v as usize, 1, max)?)),
            None => Ok(None),
        }
    }

    fn per_layer(
        &self,
        suffix: &str,
        n_layer: usize,
        min: usize,
        max: usize,
    ) -> Result<Vec<usize>, ModelError> {
        let key = self.key(suffix);
        self.md
            .get_u32_per_layer(&key, n_layer)?
            .into_iter()
            .map(|v| check_range(&key, v as usize, min, max))
            .collect()
    }

    fn f32_opt(&self, suffix: &str) -> Result<Option<f32>, ModelError> {
        let key = self.key(suffix);
        match self.md.get_f32_opt(&key)? {
            Some(v) if !v.is_finite() => Err(ModelError::BadHyperparameter {
                key,
                expected: "a finite number".into(),
                found: v.to_string(),
            }),
            other => Ok(other),
        }
    }

    fn positive_f32_opt(&self, suffix: &str) -> Result<Option<f32>, ModelError> {
        match self.f32_opt(suffix)? {
            Some(v) if v <= 0.0 => Err(ModelError::BadHyperparameter {
                key: self.key(suffix),
                expected: "a positive number".into(),
                found: v.to_string(),
            }),
            other => Ok(other),
        }
    }
}

fn check_range(key: &str, v: usize, min: usize, max: usize) -> Result<usize, ModelError> {
    if v < min || v > max {
        return Err(ModelError::BadHyperparameter {
            key: key.to_string(),
            expected: format!("a value from {min} to {max}"),
            found: v.to_string(),
        });
    }
    Ok(v)
}

impl HParams {
    /// Reads and validates the hyperparameters of `architecture` from `md`.
    pub fn from_metadata(architecture: Architecture, md: &Metadata) -> Result<HParams, ModelError> {
        let k = Keys {
            arch: architecture.name(),
            md,
        };
        let n_ctx_train = k.usize_req("context_length", u32::MAX as usize)?;
        let n_embd = k.usize_req("embedding_length", MAX_DIM)?;
        let n_layer_all = k.usize_req("block_count", MAX_LAYERS)?;
        // Qwen 3.5 files may carry multi-token-prediction blocks after the trunk
        // (`nextn_predict_layers`, counted in `block_count`); the main pass never runs them.
        let n_layer = if architecture.hybrid_recurrent() {
            let n_nextn = md.get_u32_opt(&k.key("nextn_predict_layers"))?.unwrap_or(0) as usize;
            if n_nextn >= n_layer_all {
                return Err(ModelError::BadHyperparameter {
                    key: k.key("nextn_predict_layers"),
                    expected: format!("fewer than the {n_layer_all} blocks"),
                    found: n_nextn.to_string(),
                });
            }
            n_layer_all - n_nextn
        } else {
            n_layer_all
        };
        let trunk = |mut v: Vec<usize>| {
            v.truncate(n_layer);
            v
        };
        let n_head = trunk(k.per_layer("attention.head_count", n_layer_all, 1, MAX_HEADS)?);
        let n_head_kv = if md.contains_key(&k.key("attention.head_count_kv")) {
            trunk(k.per_layer("attention.head_count_kv", n_layer_all, 1, MAX_HEADS)?)
        } else {
            n_head.clone()
        };
        // Qwen 3.5 MoE conversions may leave the dense size out (the config has none); the
        // expert size stands in for it, as it does in llama.cpp's shared-expert default.
        let n_ff = if architecture == Architecture::Qwen35Moe
            && !md.contains_key(&k.key("feed_forward_length"))
        {
            vec![k.usize_req("expert_feed_forward_length", MAX_DIM)?; n_layer]
        } else {
            trunk(k.per_layer("feed_forward_length", n_layer_all, 1, MAX_DIM)?)
        };
        let default_head_dim = n_embd / n_head[0];
        let head_dim_k = k
            .usize_opt("attention.key_length", MAX_DIM)?
            .unwrap_or(default_head_dim);
        let head_dim_v = k
            .usize_opt("attention.value_length", MAX_DIM)?
            .unwrap_or(default_head_dim);
        if head_dim_k != head_dim_v {
            return Err(ModelError::BadHyperparameter {
                key: k.key("attention.value_length"),
                expected: format!(
                    "the key length {head_dim_k} (different K and V head sizes are not supported)"
                ),
                found: head_dim_v.to_string(),
            });
        }
        if head_dim_k == 0 || head_dim_k % 2 != 0 {
            return Err(ModelError::BadHyperparameter {
                key: k.key("attention.key_length"),
                expected: "an even head size".into(),
                found: head_dim_k.to_string(),
            });
        }
        for (layer, (&h, &hkv)) in n_head.iter().zip(&n_head_kv).enumerate() {
            if h % hkv != 0 {
                return Err(ModelError::BadHyperparameter {
                    key: k.key("attention.head_count_kv"),
                    expected: format!("a divisor of the {h} attention heads of layer {layer}"),
                    found: hkv.to_string(),
                });
            }
        }

        let rms_eps_key = k.key("attention.layer_norm_rms_epsilon");
        let rms_eps = md.get_f32(&rms_eps_key)?;
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(ModelError::BadHyperparameter {
                key: rms_eps_key,
                expected: "a positive number".into(),
                found: rms_eps.to_string(),
            });
        }
        let rope_n_dims = k
            .usize_opt("rope.dimension_count", MAX_DIM)?
            .unwrap_or(head_dim_k);
        if rope_n_dims % 2 != 0 || rope_n_dims > head_dim_k {
            return Err(ModelError::BadHyperparameter {
                key: k.key("rope.dimension_count"),
                expected: format!("an even number of at most the head size {head_dim_k}"),
                found: rope_n_dims.to_string(),
            });
        }
        let rope_freq_base = k.positive_f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
        let rope_scaling = read_rope_scaling(&k)?;

        let (sliding_window, swa_period) = match architecture {
            Architecture::Gemma3 => (
                Some(k.usize_req("attention.sliding_window", u32::MAX as usize)?),
                Some(GEMMA3_SWA_PERIOD),
            ),
            _ => (None, None),
        };
        let moe = read_moe(&k, architecture, n_ff[0])?;
        let (linear_attention, recurrent) = if architecture.hybrid_recurrent() {
            check_rope_sections(&k, rope_n_dims)?;
            let linear = read_linear_attention(&k)?;
            (
                Some(linear),
                read_recurrent_layers(&k, n_layer_all, n_layer)?,
            )
        } else {
            (None, vec![false; n_layer])
        };
        let layers = (0..n_layer)
            .map(|il| LayerShape {
                n_head: n_head[il],
                n_head_kv: n_head_kv[il],
                n_ff: n_ff[il],
                sliding_window: swa_period.is_some_and(|p| il % p < p - 1),
                moe: moe.is_some(),
                recurrent: recurrent[il],
                head_dim: head_dim_k,
                rope_n_dims,
                kv_source: il,
            })
            .collect();
        let final_logit_softcap = k.positive_f32_opt("final_logit_softcapping")?;
        let n_vocab_metadata = k.usize_opt("vocab_size", u32::MAX as usize)?;

        let mut hp = HParams {
            architecture,
            n_ctx_train,
            n_embd,
            n_layer,
            head_dim_k,
            head_dim_v,
            layers,
            rms_eps,
            rope_n_dims,
            rope_freq_base,
            rope_scaling,
            rope_freq_base_swa: 10_000.0,
            sliding_window,
            final_logit_softcap,
            n_vocab_metadata,
            moe,
            linear_attention,
            rope_n_dims_swa: rope_n_dims,
            n_layer_kv: n_layer,
            n_embd_per_layer: None,
        };
        if architecture == Architecture::Gemma4 {
            read_gemma4(&k, &mut hp)?;
        }
        Ok(hp)
    }

    /// Bytes of K and V cache per token (f16 storage), summed over the layers that attend
    /// through the KV cache (linear-attention layers keep a recurrent state instead).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.layers
            .iter()
            .enumerate()
            .filter(|&(il, l)| !l.recurrent && l.kv_source == il)
            .map(|(_, l)| 2 * l.n_head_kv * l.head_dim * 2)
            .sum()
    }

    /// Bytes of recurrent state (f32 convolution and delta-rule states) one sequence holds,
    /// summed over the linear-attention layers; 0 for models without them.
    pub fn recurrent_state_bytes_per_sequence(&self) -> usize {
        let Some(linear) = &self.linear_attention else {
            return 0;
        };
        let n_recurrent = self.layers.iter().filter(|l| l.recurrent).count();
        n_recurrent * (linear.conv_state_len() + linear.ssm_state_len()) * 4
    }

    /// Bytes of weights one decoded token reads: every tensor whole, except the token embedding
    /// tables (one row each; the whole table when it is also the output projection, as in tied
    /// models) and the stacked routed experts (`*_exps`: the `n_expert_used` of `n_expert` a
    /// token is sent to). Decode speed times this is the bandwidth a decode step draws, which
    /// for a mixture of experts is far below the file size.
    pub fn weight_bytes_read_per_token(&self, tensors: &[ember_gguf::TensorInfo]) -> u64 {
        let tied = !tensors.iter().any(|t| t.name == "output.weight");
        tensors
            .iter()
            .map(|t| {
                let rows = t.dims.iter().skip(1).product::<u64>().max(1);
                if t.name.ends_with("_exps.weight") {
                    match &self.moe {
                        Some(moe) if moe.n_expert > 0 => {
                            t.n_bytes * moe.n_expert_used.min(moe.n_expert) as u64
                                / moe.n_expert as u64
                        }
                        _ => t.n_bytes,
                    }
                } else if (t.name == "token_embd.weight" && !tied)
                    || t.name == "per_layer_token_embd.weight"
                {
                    t.n_bytes / rows
                } else {
                    t.n_bytes
                }
            })
            .sum()
    }

    /// Whether any layer keeps a recurrent state per sequence.
    pub fn has_recurrent_state(&self) -> bool {
        self.layers.iter().any(|l| l.recurrent)
    }

    /// The attention scale: `1 / sqrt(head size)`; 1 for Gemma 4, whose Q and K norms take its
    /// place (llama.cpp's `f_attention_scale = 1`).
    pub fn attention_scale(&self) -> f32 {
        match self.architecture {
            Architecture::Gemma4 => 1.0,
            _ => 1.0 / (self.head_dim_k as f32).sqrt(),
        }
    }
}

/// Gemma 4's hyperparameters beyond the common ones, as llama.cpp's `llama_model_gemma4` and
/// the common loader read them: the layer kinds from `attention.sliding_window_pattern` (one
/// bool per layer, true for sliding-window layers); head sizes `attention.key_length` (global
/// layers) and `attention.key_length_swa`; rotary dims `rope.dimension_count` and
/// `rope.dimension_count_swa` (defaulting to the global one, as llama.cpp does); the sliding
/// base `rope.freq_base_swa` (default 10000); `attention.shared_kv_layers` (default 0): the
/// last that many layers reuse the cache of the last KV layer of their kind (llama.cpp's
/// `n_layer_kv_from_start - (swa ? 2 : 1)`); `embedding_length_per_layer_input` (0: none).
fn read_gemma4(k: &Keys<'_>, hp: &mut HParams) -> Result<(), ModelError> {
    let n_layer = hp.n_layer;
    let pattern_key = k.key("attention.sliding_window_pattern");
    let pattern: Vec<bool> = match k.md.get(&pattern_key) {
        Some(Value::Array(Array::Bool(v))) => v.clone(),
        Some(Value::Array(Array::U8(v))) => v.iter().map(|&x| x != 0).collect(),
        Some(Value::Array(Array::I32(v))) => v.iter().map(|&x| x != 0).collect(),
        Some(Value::Array(Array::U32(v))) => v.iter().map(|&x| x != 0).collect(),
        Some(other) => {
            return Err(ModelError::BadHyperparameter {
                key: pattern_key,
                expected: "an array of one bool per layer".into(),
                found: other.type_name().into(),
            })
        }
        None => {
            return Err(ModelError::BadHyperparameter {
                key: pattern_key,
                expected: "an array of one bool per layer".into(),
                found: "no value".into(),
            })
        }
    };
    if pattern.len() != n_layer {
        return Err(ModelError::BadHyperparameter {
            key: pattern_key,
            expected: format!("{n_layer} values, one per layer"),
            found: format!("{} values", pattern.len()),
        });
    }
    let head_dim_full = hp.head_dim_k;
    let head_dim_swa = k.usize_req("attention.key_length_swa", MAX_DIM)?;
    let value_swa = k.usize_req("attention.value_length_swa", MAX_DIM)?;
    if value_swa != head_dim_swa || head_dim_swa % 2 != 0 {
        return Err(ModelError::BadHyperparameter {
            key: k.key("attention.value_length_swa"),
            expected: format!(
                "the even sliding-window key length {head_dim_swa} (Gemma 4 needs equal K and V head sizes)"
            ),
            found: value_swa.to_string(),
        });
    }
    let rope_n_dims_swa = k
        .usize_opt("rope.dimension_count_swa", MAX_DIM)?
        .unwrap_or(hp.rope_n_dims);
    if rope_n_dims_swa % 2 != 0 || rope_n_dims_swa > head_dim_swa {
        return Err(ModelError::BadHyperparameter {
            key: k.key("rope.dimension_count_swa"),
            expected: format!("an even number of at most the sliding head size {head_dim_swa}"),
            found: rope_n_dims_swa.to_string(),
        });
    }
    let window = k.usize_req("attention.sliding_window", u32::MAX as usize)?;
    let n_shared = match k.md.get_u32_opt(&k.key("attention.shared_kv_layers"))? {
        Some(v) => v as usize,
        None => 0,
    };
    let n_layer_kv = n_layer.saturating_sub(n_shared);
    if n_shared > 0 && n_layer_kv < 2 {
        return Err(ModelError::BadHyperparameter {
            key: k.key("attention.shared_kv_layers"),
            expected: format!(
                "at most {} (two of the {n_layer} layers keep a cache)",
                n_layer.saturating_sub(2)
            ),
            found: n_shared.to_string(),
        });
    }
    for (il, layer) in hp.layers.iter_mut().enumerate() {
        let swa = pattern[il];
        layer.sliding_window = swa;
        layer.head_dim = if swa { head_dim_swa } else { head_dim_full };
        layer.rope_n_dims = if swa { rope_n_dims_swa } else { hp.rope_n_dims };
        layer.kv_source = if il < n_layer_kv {
            il
        } else {
            n_layer_kv - if swa { 2 } else { 1 }
        };
    }
    for il in n_layer_kv..n_layer {
        let (layer, source) = (hp.layers[il], hp.layers[hp.layers[il].kv_source]);
        if layer.sliding_window != source.sliding_window || layer.n_head_kv != source.n_head_kv {
            return Err(ModelError::BadHyperparameter {
                key: k.key("attention.shared_kv_layers"),
                expected: format!(
                    "layer {il} to reuse the cache of a layer of its own kind and KV head count"
                ),
                found: format!(
                    "layer {} ({}, {} KV heads) for layer {il} ({}, {} KV heads)",
                    layer.kv_source,
                    if source.sliding_window {
                        "sliding"
                    } else {
                        "global"
                    },
                    source.n_head_kv,
                    if layer.sliding_window {
                        "sliding"
                    } else {
                        "global"
                    },
                    layer.n_head_kv
                ),
            });
        }
    }
    let per_layer = match k
        .md
        .get_u32_opt(&k.key("embedding_length_per_layer_input"))?
    {
        Some(v) => check_range(
            &k.key("embedding_length_per_layer_input"),
            v as usize,
            0,
            MAX_DIM,
        )?,
        None => {
            return Err(ModelError::BadHyperparameter {
                key: k.key("embedding_length_per_layer_input"),
                expected: "a width (0 when the model has no per-layer embeddings)".into(),
                found: "no value".into(),
            })
        }
    };
    hp.rope_n_dims_swa = rope_n_dims_swa;
    hp.rope_freq_base_swa = k
        .positive_f32_opt("rope.freq_base_swa")?
        .unwrap_or(10_000.0);
    hp.sliding_window = Some(window);
    hp.n_layer_kv = n_layer_kv;
    hp.n_embd_per_layer = (per_layer > 0).then_some(per_layer);
    Ok(())
}

/// The mixture-of-experts hyperparameters of `architecture`, `None` for dense architectures.
fn read_moe(
    k: &Keys<'_>,
    architecture: Architecture,
    n_ff_dense: usize,
) -> Result<Option<MoeParams>, ModelError> {
    let Some(rules) = architecture.moe() else {
        return Ok(None);
    };
    // Gemma 4 has dense and mixture-of-experts models under one name.
    if architecture == Architecture::Gemma4
        && k.md.get_u32_opt(&k.key("expert_count"))?.unwrap_or(0) == 0
    {
        return Ok(None);
    }
    let n_expert = k.usize_req("expert_count", MAX_EXPERTS)?;
    let n_expert_used = k.usize_req("expert_used_count", n_expert)?;
    let n_ff_expert = match k.usize_opt("expert_feed_forward_length", MAX_DIM)? {
        Some(n) => n,
        None if n_ff_dense / n_expert_used > 0 => n_ff_dense / n_expert_used,
        None => {
            return Err(ModelError::BadHyperparameter {
                key: k.key("expert_feed_forward_length"),
                expected: format!(
                    "a value (the dense size {n_ff_dense} is smaller than the {n_expert_used} experts used)"
                ),
                found: "no value".into(),
            })
        }
    };
    let n_ff_shared = match rules.shared_expert {
        Presence::Absent => None,
        Presence::Required | Presence::Optional => Some(
            k.usize_opt("expert_shared_feed_forward_length", MAX_DIM)?
                .unwrap_or(n_ff_dense),
        ),
    };
    Ok(Some(MoeParams {
        n_expert,
        n_expert_used,
        n_ff_expert,
        n_ff_shared,
        shared_expert_gate: rules.shared_expert_gate != Presence::Absent,
        gating: rules.gating,
        normalize_weights: rules.normalize_weights,
        weights_scale: None,
    }))
}

/// The Gated DeltaNet hyperparameters of a hybrid model.
fn read_linear_attention(k: &Keys<'_>) -> Result<LinearAttention, ModelError> {
    let conv_kernel = k.usize_req("ssm.conv_kernel", 64)?;
    let head_k_dim = k.usize_req("ssm.state_size", MAX_DIM)?;
    let n_k_heads = k.usize_req("ssm.group_count", MAX_HEADS)?;
    let n_v_heads = k.usize_req("ssm.time_step_rank", MAX_HEADS)?;
    let d_inner = k.usize_req("ssm.inner_size", MAX_DIM)?;
    if conv_kernel < 2 {
        return Err(ModelError::BadHyperparameter {
            key: k.key("ssm.conv_kernel"),
            expected: "at least 2 taps".into(),
            found: conv_kernel.to_string(),
        });
    }
    if !n_v_heads.is_multiple_of(n_k_heads) {
        return Err(ModelError::BadHyperparameter {
            key: k.key("ssm.time_step_rank"),
            expected: format!("a multiple of the {n_k_heads} key heads (ssm.group_count)"),
            found: n_v_heads.to_string(),
        });
    }
    if !d_inner.is_multiple_of(n_v_heads) || d_inner / n_v_heads != head_k_dim {
        return Err(ModelError::BadHyperparameter {
            key: k.key("ssm.inner_size"),
            expected: format!(
                "{n_v_heads} value heads of the key head size {head_k_dim} (ssm.state_size), {}",
                n_v_heads * head_k_dim
            ),
            found: d_inner.to_string(),
        });
    }
    Ok(LinearAttention {
        conv_kernel,
        n_k_heads,
        n_v_heads,
        head_k_dim,
        head_v_dim: d_inner / n_v_heads,
    })
}

/// Which of the first `n_layer` layers are linear-attention layers: the
/// `attention.recurrent_layers` flags when present, else every layer but each
/// `full_attention_interval`-th (default 4), as llama.cpp's loader decides.
fn read_recurrent_layers(
    k: &Keys<'_>,
    n_layer_all: usize,
    n_layer: usize,
) -> Result<Vec<bool>, ModelError> {
    let key = k.key("attention.recurrent_layers");
    let recurrent = match k.md.get(&key) {
        Some(ember_gguf::Value::Array(ember_gguf::Array::Bool(flags))) => {
            if flags.len() != n_layer_all {
                return Err(ModelError::BadHyperparameter {
                    key,
                    expected: format!("one flag per block ({n_layer_all})"),
                    found: format!("{} flags", flags.len()),
                });
            }
            flags[..n_layer].to_vec()
        }
        Some(other) => {
            return Err(ModelError::BadHyperparameter {
                key,
                expected: "an array of bool".into(),
                found: other.type_name().to_string(),
            })
        }
        None => {
            let interval = k
                .usize_opt("full_attention_interval", MAX_LAYERS)?
                .unwrap_or(4);
            (0..n_layer).map(|il| (il + 1) % interval != 0).collect()
        }
    };
    if recurrent.iter().all(|&r| r) {
        return Err(ModelError::BadHyperparameter {
            key: k.key("full_attention_interval"),
            expected: "at least one full-attention layer".into(),
            found: format!("{n_layer} linear-attention layers"),
        });
    }
    Ok(recurrent)
}

/// Checks `rope.dimension_sections` of a Qwen 3.5 model. Its interleaved multi-section rope
/// gives rotary pair `i` the position of section `i % 3` (temporal, height, width) while `i` is
/// below three times that section's size, else the fourth section's position. For text the
/// first three are the token's position and the fourth is 0 (llama.cpp's
/// `llm_graph_input_pos`), so the rope is NeoX rope exactly when every rotated pair falls in
/// one of the first three sections, as in the published models (`[11, 11, 10, 0]` over 32
/// pairs). Other layouts are refused rather than computed wrongly.
fn check_rope_sections(k: &Keys<'_>, rope_n_dims: usize) -> Result<(), ModelError> {
    let key = k.key("rope.dimension_sections");
    let sections = k.md.get_u32_array_lossless(&key)?;
    let found = format!("{sections:?}");
    let bad = |expected: String| ModelError::BadHyperparameter {
        key: key.clone(),
        expected,
        found: found.clone(),
    };
    if sections.len() != 4 {
        return Err(bad("4 section sizes".into()));
    }
    let s: Vec<usize> = sections.iter().map(|&v| v as usize).collect();
    let total: usize = s.iter().sum();
    if total == 0 {
        return Err(bad("at least one non-empty section".into()));
    }
    for pair in 0..rope_n_dims / 2 {
        let sector = pair % total;
        let text_section = match sector % 3 {
            0 => sector < 3 * s[0],
            1 => sector < 3 * s[1],
            _ => sector < 3 * s[2],
        };
        if !text_section {
            return Err(bad(format!(
                "sections that give each of the {} rotary pairs the token position (pair {pair} \
                 falls in the fourth section, which is not supported)",
                rope_n_dims / 2
            )));
        }
    }
    Ok(())
}

fn read_rope_scaling(k: &Keys<'_>) -> Result<RopeScaling, ModelError> {
    let type_key = k.key("rope.scaling.type");
    let factor = k.positive_f32_opt("rope.scaling.factor")?;
    match k.md.get_str_opt(&type_key)? {
        None => {
            // Older conversions write only `rope.scale_linear`.
            match k.positive_f32_opt("rope.scale_linear")? {
                Some(f) if f != 1.0 => Ok(RopeScaling::Linear { factor: f }),
                _ => Ok(RopeScaling::None),
            }
        }
        Some("none") => Ok(RopeScaling::None),
        Some("linear") => match factor {
            Some(f) => Ok(RopeScaling::Linear { factor: f }),
            None => Err(ModelError::BadHyperparameter {
                key: k.key("rope.scaling.factor"),
                expected: "a positive factor for linear rope scaling".into(),
                found: "no value".into(),
            }),
        },
        // Llama 3's frequency-dependent scaling is carried by the `rope_freqs.weight` tensor;
        // converters label it `llama3` when they label it at all.
        Some("llama3") => Ok(RopeScaling::None),
        Some(other) => Err(ModelError::BadHyperparameter {
            key: type_key,
            expected: "none, linear or llama3".into(),
            found: other.to_string(),
        }),
    }
}

impl RopeScaling {
    /// GGML's `freq_scale`: the factor applied to positions.
    pub fn freq_scale(self) -> f32 {
        match self {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => 1.0 / factor,
        }
    }
}
