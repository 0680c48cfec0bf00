//! Synthetic GGUF models: the shapes of real models (Llama 3.1 8B, Llama 3.2 1B, SmolLM2, Qwen 2
//! and 3, Gemma 3, the Qwen3-30B-A3B mixture of experts, Gemma 4 26B-A4B and E2B) with random
//! weights, in any type ember runs, and a working BPE tokenizer.
//!
//! They exist for GPU work: speed benchmarks need 1B and 8B models that cannot be downloaded
//! here, and CPU-versus-GPU consistency tests need every architecture in every type. Weights are
//! drawn so that the network is numerically sane (see [`tensor_list`]): activations keep their
//! scale through all layers and the logits are peaked enough that greedy choices are mostly
//! clear.
//!
//! Files are streamed with [`ember_gguf::GgufWriter::tensor_generated`]: one tensor's data is in
//! memory at a time, generated and quantized row by row on all cores, so an 8B model is written
//! in minutes with a few GB of memory.

pub mod shapes;
pub mod types;
pub mod vocab;
pub mod weights;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use ember_gguf::{Array, GgmlType, GgufWriter, Value};

pub use shapes::{MoeShape, Shape, ShapeOverrides, TokenizerStyle, SHAPE_NAMES};
pub use types::{Plan, Role, TypeSpec, TYPE_NAMES};
pub use weights::Init;

/// Why a synthetic model could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error("unknown shape {found:?}: expected one of {}", SHAPE_NAMES.join(", "))]
    UnknownShape { found: String },
    #[error("unknown type {found:?}: expected one of {}", TYPE_NAMES.join(", "))]
    UnknownType { found: String },
    #[error("a vocabulary of {found} tokens is too small: expected at least {minimum} (256 bytes, the special tokens and one merge)")]
    VocabTooSmall { minimum: usize, found: usize },
    #[error("a vocabulary of {found} tokens is too large: {reason}")]
    VocabTooLarge { found: usize, reason: String },
    #[error("tensor {tensor}: rows of {cols} elements are not whole blocks of {ty} ({} elements)", ty.block_size())]
    NotWholeBlocks {
        tensor: String,
        ty: GgmlType,
        cols: usize,
    },
    #[error("{what}: expected at least 1, found 0")]
    Zero { what: &'static str },
    #[error("shape {shape}: {reason}")]
    BadShape { shape: String, reason: String },
    #[error("quantization failed: {0}")]
    Quant(#[from] ember_quant::QuantError),
    #[error("cannot write {path}: {message}")]
    Io { path: String, message: String },
    #[error("internal error: {0}")]
    Internal(String),
}

/// What to make.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: Shape,
    pub types: TypeSpec,
    /// Every matrix in the base type (`llama-quantize --pure`); see [`Plan`].
    pub pure: bool,
    pub seed: u64,
    /// Assemble quantized data from a pool of random blocks instead of quantizing every row
    /// (see [`weights::fill_fast`]): for speed benchmarks, where only the shapes matter.
    pub fast: bool,
}

/// One tensor of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// GGUF order: the row length first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl TensorSpec {
    pub fn cols(&self) -> usize {
        self.dims[0] as usize
    }

    pub fn n_bytes(&self) -> u64 {
        let n: u64 = self.dims.iter().product();
        self.ty.row_bytes(self.dims[0]).unwrap_or(0) * (n / self.dims[0].max(1))
    }
}

/// Progress of a write, reported before each tensor is generated and once at the end.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// Tensors done so far.
    pub done: usize,
    pub total: usize,
    /// The tensor about to be generated; `None` at the end.
    pub tensor: Option<&'a TensorSpec>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub elapsed_s: f64,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Summary {
    pub n_tensors: usize,
    pub n_params: u64,
    pub tensor_bytes: u64,
    /// Tensors per type.
    pub types: BTreeMap<String, usize>,
    pub seconds: f64,
}

/// Standard deviation of the logits the output projection aims at: wide enough that the top
/// token usually stands clear of the second (a mean gap of about 0.6 nats over 128k tokens), so
/// greedy comparisons between backends are not dominated by near-ties.
const LOGIT_STD: f32 = 3.0;

/// Spread of RMS-norm weights around 1.
const NORM_SPREAD: f32 = 0.1;

/// Standard deviation of the Q and K projections relative to `1/sqrt(n_embd)`: attention scores
/// then spread over a few units, so attention is selective but not one-hot.
const QK_GAIN: f32 = 1.5;

/// The gain that brings `silu(g) * u` (g, u standard normal; variance about 0.35) back to unit
/// variance in the down projection.
const FFN_DOWN_GAIN: f32 = 1.7;

/// RMS of the sum of all layers' contributions to the residual stream. With tied embeddings the
/// final hidden state's share of the input token's own embedding `f` makes that token's logit
/// about `f * sqrt(n_embd) * LOGIT_STD` (its dot product with itself), a bias towards repeating
/// the input; the layers must outweigh the embedding for the model to predict anything else.
/// For Llama-style models the embedding's RMS is `LOGIT_STD / sqrt(n_embd)`, so a layer sum of
/// RMS 3 keeps the bias near one logit standard deviation.
const RESIDUAL_RMS: f32 = 3.0;

/// Standard deviation of a mixture-of-experts router's logits. Its input is RMS-normalised, so
/// rows of std `ROUTER_GAIN / sqrt(n_embd)` give logits of std `ROUTER_GAIN`: the softmax over
/// experts is then clearly peaked (the top expert of 128 typically takes a few times the weight
/// of the eighth), and the gap between the last chosen expert and the first one left out is
/// typically about a tenth of a logit, far above the rounding of the router product (a few
/// millionths of a logit at a width of 2048), so implementations that round differently rarely
/// choose different experts.
const ROUTER_GAIN: f32 = 2.0;

/// The same for Gemma 3, whose embeddings enter multiplied by `sqrt(n_embd)` (RMS
/// [`LOGIT_STD`]) and whose layer outputs are RMS-normalised before the residual add, so the
/// post-norm weights set their scale: 45 brings the self-bias of a 640-wide model to about 5.
const GEMMA_RESIDUAL_RMS: f32 = 45.0;

/// The tensors of a model, in file order, with their types and value distributions.
///
/// Scales (each RMS norm gives its output RMS 1): Q, K, V, gate and up are normal with std
/// `gain / sqrt(n_embd)` so their outputs have unit scale; the attention output and down
/// projections are scaled by `RESIDUAL_RMS / sqrt(2 n_layer)` (as GPT-2's initialisation) so
/// that the 2 n_layer residual additions sum to [`RESIDUAL_RMS`] whatever the depth (Gemma's
/// post-norm weights do the same with [`GEMMA_RESIDUAL_RMS`]); the output projection gives
/// logits of std [`LOGIT_STD`]. Mixture-of-experts layers replace the FFN by a router (logits of
/// std [`ROUTER_GAIN`], always F32, as llama-quantize leaves `ffn_gate_inp`) and stacked experts
/// scaled like the dense FFN, except that the down projections are `sqrt(n_expert_used)` times
/// larger: a token's output is the weighted mean of its experts' outputs (weights summing to
/// 1), and a mean of `k` independent outputs has `1/sqrt(k)` of their RMS when the weights are
/// equal, so without the factor the layers would add less than [`RESIDUAL_RMS`] and the
/// input token's embedding would dominate the logits. Untied token embeddings are standard normal (Gemma, which
/// multiplies them by `sqrt(n_embd)`, gets `1/sqrt(n_embd)`); tied ones serve as the output
/// projection and take its scale.
pub fn tensor_list(opts: &SynthOptions) -> Result<Vec<TensorSpec>, SynthError> {
    let s = &opts.shape;
    for (what, v) in [
        ("n_layer", s.n_layer),
        ("n_vocab", s.n_vocab),
        ("n_embd", s.n_embd),
        ("n_head_kv", s.n_head_kv),
        ("head_dim", s.head_dim),
        ("n_ff", s.n_ff),
    ] {
        if v == 0 {
            return Err(SynthError::Zero { what });
        }
    }
    let plan = Plan {
        spec: opts.types,
        pure: opts.pure,
        tied_embeddings: s.tied_embeddings,
        n_layer: s.n_layer,
    };
    let (e, ff, q, kv, hd) = (s.n_embd, s.n_ff, s.q_dim(), s.kv_dim(), s.head_dim);
    if let Some(m) = s.moe {
        for (what, v) in [
            ("n_expert", m.n_expert),
            ("n_expert_used", m.n_expert_used),
            ("n_ff_expert", m.n_ff_expert),
        ] {
            if v == 0 {
                return Err(SynthError::Zero { what });
            }
        }
    }
    if let Some(g) = s.gemma4 {
        return tensor_list_gemma4(s, &g, &plan);
    }
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    let residual_scale = RESIDUAL_RMS * inv_sqrt(2 * s.n_layer);
    let post_norm_center = GEMMA_RESIDUAL_RMS * inv_sqrt(2 * s.n_layer);
    let output_std = LOGIT_STD * inv_sqrt(e);
    let embd_std = if s.tied_embeddings {
        output_std
    } else if s.architecture == "gemma3" {
        inv_sqrt(e)
    } else {
        1.0
    };

    let mut list = Vec::new();
    let matrix =
        |name: String, role: Role, layer: usize, cols: usize, rows: usize, std: f32| TensorSpec {
            name,
            dims: vec![cols as u64, rows as u64],
            ty: plan.tensor_type(role, layer, cols),
            init: Init::Normal { std },
        };
    let vector = |name: String, len: usize, init: Init| TensorSpec {
        name,
        dims: vec![len as u64],
        ty: GgmlType::F32,
        init,
    };
    let norm = |name: String, len: usize| {
        vector(
            name,
            len,
            Init::Uniform {
                center: 1.0,
                spread: NORM_SPREAD,
            },
        )
    };
    let post_norm = |name: String| {
        vector(
            name,
            e,
            Init::Uniform {
                center: post_norm_center,
                spread: NORM_SPREAD * post_norm_center,
            },
        )
    };

    list.push(matrix(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        0,
        e,
        s.n_vocab,
        embd_std,
    ));
    if let Some(scaling) = s.rope_scaling {
        list.push(vector(
            "rope_freqs.weight".into(),
            hd / 2,
            Init::Values(scaling.freq_divisors(hd, s.rope_freq_base)),
        ));
    }
    for il in 0..s.n_layer {
        let n = |suffix: &str| format!("blk.{il}.{suffix}");
        list.push(norm(n("attn_norm.weight"), e));
        match s.linear {
            Some(l) if l.is_linear(il) => {
                let (ch, vd, nv) = (l.conv_channels(), l.value_dim(), l.n_v_heads);
                list.push(matrix(
                    n("attn_qkv.weight"),
                    Role::AttnQ,
                    il,
                    e,
                    ch,
                    inv_sqrt(e),
                ));
                list.push(matrix(
                    n("attn_gate.weight"),
                    Role::AttnQ,
                    il,
                    e,
                    vd,
                    inv_sqrt(e),
                ));
                // The convolution keeps the channels at unit scale; the decay
                // `exp(softplus(alpha + dt) * a)` sits mostly between 0.6 and 0.95 per token,
                // so the state remembers a few tokens to a few tens.
                list.push(TensorSpec {
                    name: n("ssm_conv1d.weight"),
                    dims: vec![l.conv_kernel as u64, ch as u64],
                    ty: GgmlType::F32,
                    init: Init::Normal {
                        std: inv_sqrt(l.conv_kernel),
                    },
                });
                list.push(vector(
                    n("ssm_dt.bias"),
                    nv,
                    Init::Uniform {
                        center: 0.0,
                        spread: 0.5,
                    },
                ));
                list.push(vector(
                    n("ssm_a"),
                    nv,
                    Init::Uniform {
                        center: -0.2,
                        spread: 0.1,
                    },
                ));
                list.push(matrix(
                    n("ssm_beta.weight"),
                    Role::AttnK,
                    il,
                    e,
                    nv,
                    inv_sqrt(e),
                ));
                list.push(matrix(
                    n("ssm_alpha.weight"),
                    Role::AttnK,
                    il,
                    e,
                    nv,
                    inv_sqrt(e),
                ));
                list.push(norm(n("ssm_norm.weight"), l.head_dim));
                list.push(matrix(
                    n("ssm_out.weight"),
                    Role::AttnOutput,
                    il,
                    vd,
                    e,
                    residual_scale * inv_sqrt(vd),
                ));
            }
            _ => {
                list.push(matrix(
                    n("attn_q.weight"),
                    Role::AttnQ,
                    il,
                    e,
                    s.q_rows(),
                    QK_GAIN * inv_sqrt(e),
                ));
                list.push(matrix(
                    n("attn_k.weight"),
                    Role::AttnK,
                    il,
                    e,
                    kv,
                    QK_GAIN * inv_sqrt(e),
                ));
                list.push(matrix(
                    n("attn_v.weight"),
                    Role::AttnV,
                    il,
                    e,
                    kv,
                    inv_sqrt(e),
                ));
                if s.qkv_bias {
                    for (name, len) in
                        [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)]
                    {
                        list.push(vector(n(name), len, Init::Normal { std: 0.3 }));
                    }
                }
                if s.qk_norm {
                    list.push(norm(n("attn_q_norm.weight"), hd));
                    list.push(norm(n("attn_k_norm.weight"), hd));
                }
                list.push(matrix(
                    n("attn_output.weight"),
                    Role::AttnOutput,
                    il,
                    q,
                    e,
                    residual_scale * inv_sqrt(q),
                ));
            }
        }
        if s.post_norms {
            list.push(post_norm(n("post_attention_norm.weight")));
        }
        // Qwen 3.5 names the norm before the FFN after the attention block it follows.
        let ffn_norm = if s.linear.is_some() {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        list.push(norm(n(ffn_norm), e));
        if let Some(m) = s.moe {
            let (n_expert, eff) = (m.n_expert as u64, m.n_ff_expert);
            let experts =
                |name: String, role: Role, cols: usize, rows: usize, std: f32| TensorSpec {
                    name,
                    dims: vec![cols as u64, rows as u64, n_expert],
                    ty: plan.tensor_type(role, il, cols),
                    init: Init::Normal { std },
                };
            list.push(TensorSpec {
                name: n("ffn_gate_inp.weight"),
                dims: vec![e as u64, n_expert],
                ty: GgmlType::F32,
                init: Init::Normal {
                    std: ROUTER_GAIN * inv_sqrt(e),
                },
            });
            list.push(experts(
                n("ffn_gate_exps.weight"),
                Role::FfnGate,
                e,
                eff,
                inv_sqrt(e),
            ));
            list.push(experts(
                n("ffn_up_exps.weight"),
                Role::FfnUp,
                e,
                eff,
                inv_sqrt(e),
            ));
            let mean_gain = (m.n_expert_used as f32).sqrt();
            list.push(experts(
                n("ffn_down_exps.weight"),
                Role::FfnDown,
                eff,
                e,
                FFN_DOWN_GAIN * mean_gain * residual_scale * inv_sqrt(eff),
            ));
            if let Some(sff) = m.n_ff_shared {
                // The shared expert adds to the routed mean; its gate's logits have unit
                // scale, so `sigmoid` passes about half of it.
                list.push(TensorSpec {
                    name: n("ffn_gate_inp_shexp.weight"),
                    dims: vec![e as u64],
                    ty: GgmlType::F32,
                    init: Init::Normal { std: inv_sqrt(e) },
                });
                list.push(matrix(
                    n("ffn_gate_shexp.weight"),
                    Role::FfnGate,
                    il,
                    e,
                    sff,
                    inv_sqrt(e),
                ));
                list.push(matrix(
                    n("ffn_up_shexp.weight"),
                    Role::FfnUp,
                    il,
                    e,
                    sff,
                    inv_sqrt(e),
                ));
                list.push(matrix(
                    n("ffn_down_shexp.weight"),
                    Role::FfnDown,
                    il,
                    sff,
                    e,
                    FFN_DOWN_GAIN * residual_scale * inv_sqrt(sff),
                ));
            }
        } else {
            list.push(matrix(
                n("ffn_gate.weight"),
                Role::FfnGate,
                il,
                e,
                ff,
                inv_sqrt(e),
            ));
            list.push(matrix(
                n("ffn_up.weight"),
                Role::FfnUp,
                il,
                e,
                ff,
                inv_sqrt(e),
            ));
            list.push(matrix(
                n("ffn_down.weight"),
                Role::FfnDown,
                il,
                ff,
                e,
                FFN_DOWN_GAIN * residual_scale * inv_sqrt(ff),
            ));
        }
        if s.post_norms {
            list.push(post_norm(n("post_ffw_norm.weight")));
        }
    }
    list.push(norm("output_norm.weight".into(), e));
    if !s.tied_embeddings {
        list.push(matrix(
            "output.weight".into(),
            Role::Output,
            0,
            e,
            s.n_vocab,
            output_std,
        ));
    }
    for t in &list {
        weights::row_bytes(&t.name, t.ty, t.cols())?;
    }
    Ok(list)
}

/// Gemma 4's tensors, named and shaped as llama.cpp's `llama_model_gemma4::load_arch_tensors`
/// reads them, scaled as [`tensor_list`] describes for Gemma 3 (every block output and the
/// per-layer embedding's output are RMS-normalised, so their norm weights set the residual
/// scale). The router's input is RMS-normalised and scaled by `1/sqrt(n_embd)`, so its rows
/// get std [`ROUTER_GAIN`] for logits of that std. The global layers' `rope_freqs` hold 1 for
/// the rotated quarter of the pairs and 1e30 (no rotation) for the rest, as the converter
/// writes proportional rope.
fn tensor_list_gemma4(
    s: &Shape,
    g: &shapes::Gemma4Shape,
    plan: &Plan,
) -> Result<Vec<TensorSpec>, SynthError> {
    let e = s.n_embd;
    let width = g.n_embd_per_layer;
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    // Each layer adds up to three normalised outputs (attention, FFN, per-layer embedding).
    let n_adds = if width > 0 { 3 } else { 2 } * s.n_layer;
    let post_norm_center = GEMMA_RESIDUAL_RMS * inv_sqrt(n_adds);
    let output_std = LOGIT_STD * inv_sqrt(e);
    let embd_std = if s.tied_embeddings {
        output_std
    } else {
        inv_sqrt(e)
    };
    let matrix =
        |name: String, role: Role, layer: usize, cols: usize, rows: usize, std: f32| TensorSpec {
            name,
            dims: vec![cols as u64, rows as u64],
            ty: plan.tensor_type(role, layer, cols),
            init: Init::Normal { std },
        };
    let vector = |name: String, len: usize, init: Init| TensorSpec {
        name,
        dims: vec![len as u64],
        ty: GgmlType::F32,
        init,
    };
    let around_one = |name: String, len: usize| {
        vector(
            name,
            len,
            Init::Uniform {
                center: 1.0,
                spread: NORM_SPREAD,
            },
        )
    };
    let post_norm = |name: String| {
        vector(
            name,
            e,
            Init::Uniform {
                center: post_norm_center,
                spread: NORM_SPREAD * post_norm_center,
            },
        )
    };

    let mut list = vec![matrix(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        0,
        e,
        s.n_vocab,
        embd_std,
    )];
    if (0..s.n_layer).any(|il| !g.is_sliding(il)) {
        let n_pairs = g.head_dim_global / 2;
        let n_rotated = (g.head_dim_global as f32 * g.partial_rotary_global / 2.0) as usize;
        let factors = (0..n_pairs)
            .map(|i| if i < n_rotated { 1.0 } else { 1e30 })
            .collect();
        list.push(vector(
            "rope_freqs.weight".into(),
            n_pairs,
            Init::Values(factors),
        ));
    }
    if width > 0 {
        let total = width * s.n_layer;
        list.push(matrix(
            "per_layer_token_embd.weight".into(),
            Role::TokenEmbd,
            0,
            total,
            s.n_vocab,
            inv_sqrt(width),
        ));
        list.push(matrix(
            "per_layer_model_proj.weight".into(),
            Role::AttnQ,
            0,
            e,
            total,
            inv_sqrt(e),
        ));
        list.push(around_one("per_layer_proj_norm.weight".into(), width));
    }
    for il in 0..s.n_layer {
        let n = |suffix: &str| format!("blk.{il}.{suffix}");
        let hd = s.layer_head_dim(il);
        let (q, kv) = (s.n_head * hd, s.layer_n_head_kv(il) * hd);
        let ff = s.layer_n_ff(il);
        list.push(around_one(n("attn_norm.weight"), e));
        list.push(matrix(
            n("attn_q.weight"),
            Role::AttnQ,
            il,
            e,
            q,
            QK_GAIN * inv_sqrt(e),
        ));
        if s.layer_has_kv(il) {
            list.push(matrix(
                n("attn_k.weight"),
                Role::AttnK,
                il,
                e,
                kv,
                QK_GAIN * inv_sqrt(e),
            ));
            if !g.k_eq_v_global || g.is_sliding(il) {
                list.push(matrix(
                    n("attn_v.weight"),
                    Role::AttnV,
                    il,
                    e,
                    kv,
                    inv_sqrt(e),
                ));
            }
            list.push(around_one(n("attn_k_norm.weight"), hd));
        }
        list.push(around_one(n("attn_q_norm.weight"), hd));
        list.push(matrix(
            n("attn_output.weight"),
            Role::AttnOutput,
            il,
            q,
            e,
            inv_sqrt(q),
        ));
        list.push(post_norm(n("post_attention_norm.weight")));
        list.push(around_one(n("ffn_norm.weight"), e));
        list.push(matrix(
            n("ffn_gate.weight"),
            Role::FfnGate,
            il,
            e,
            ff,
            inv_sqrt(e),
        ));
        list.push(matrix(
            n("ffn_up.weight"),
            Role::FfnUp,
            il,
            e,
            ff,
            inv_sqrt(e),
        ));
        list.push(matrix(
            n("ffn_down.weight"),
            Role::FfnDown,
            il,
            ff,
            e,
            FFN_DOWN_GAIN * inv_sqrt(ff),
        ));
        list.push(post_norm(n("post_ffw_norm.weight")));
        if let Some(m) = s.moe {
            let (n_expert, eff) = (m.n_expert as u64, m.n_ff_expert);
            let experts =
                |name: String, role: Role, cols: usize, rows: usize, std: f32| TensorSpec {
                    name,
                    dims: vec![cols as u64, rows as u64, n_expert],
                    ty: plan.tensor_type(role, il, cols),
                    init: Init::Normal { std },
                };
            list.push(TensorSpec {
                name: n("ffn_gate_inp.weight"),
                dims: vec![e as u64, n_expert],
                ty: GgmlType::F32,
                init: Init::Normal { std: ROUTER_GAIN },
            });
            list.push(around_one(n("ffn_gate_inp.scale"), e));
            list.push(around_one(n("pre_ffw_norm_2.weight"), e));
            list.push(around_one(n("post_ffw_norm_1.weight"), e));
            list.push(around_one(n("post_ffw_norm_2.weight"), e));
            list.push(experts(
                n("ffn_gate_exps.weight"),
                Role::FfnGate,
                e,
                eff,
                inv_sqrt(e),
            ));
            list.push(experts(
                n("ffn_up_exps.weight"),
                Role::FfnUp,
                e,
                eff,
                inv_sqrt(e),
            ));
            list.push(experts(
                n("ffn_down_exps.weight"),
                Role::FfnDown,
                eff,
                e,
                FFN_DOWN_GAIN * inv_sqrt(eff),
            ));
            list.push(around_one(n("ffn_down_exps.scale"), m.n_expert));
        }
        if width > 0 {
            list.push(matrix(
                n("inp_gate.weight"),
                Role::FfnGate,
                il,
                e,
                width,
                inv_sqrt(e),
            ));
            list.push(matrix(
                n("proj.weight"),
                Role::FfnDown,
                il,
                width,
                e,
                inv_sqrt(width),
            ));
            list.push(post_norm(n("post_norm.weight")));
        }
        list.push(around_one(n("layer_output_scale.weight"), 1));
    }
    list.push(around_one("output_norm.weight".into(), e));
    if !s.tied_embeddings {
        list.push(matrix(
            "output.weight".into(),
            Role::Output,
            0,
            e,
            s.n_vocab,
            output_std,
        ));
    }
    for t in &list {
        weights::row_bytes(&t.name, t.ty, t.cols())?;
    }
    Ok(list)
}

/// The GGUF metadata of a model: hyperparameters under the architecture's prefix, the
/// tokenizer, and a name saying what it is.
pub fn metadata(opts: &SynthOptions) -> Result<Vec<(String, Value)>, SynthError> {
    let s = &opts.shape;
    let a = s.architecture;
    let vocab = vocab::build(s.tokenizer, s.n_vocab)?;
    let u32_of = |v: usize| Value::U32(v as u32);
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String(format!(
                "ember-synth {} {}{} seed {}{}",
                s.name,
                opts.types.name(),
                if opts.pure { " pure" } else { "" },
                opts.seed,
                if opts.fast { " fast" } else { "" }
            )),
        ),
        ("general.type".into(), Value::String("model".into())),
        (
            "general.file_type".into(),
            Value::U32(opts.types.file_type()),
        ),
        ("general.quantization_version".into(), Value::U32(2)),
        (format!("{a}.context_length"), Value::U32(s.n_ctx_train)),
        (format!("{a}.embedding_length"), u32_of(s.n_embd)),
        (format!("{a}.block_count"), u32_of(s.n_layer)),
        (format!("{a}.feed_forward_length"), u32_of(s.n_ff)),
        (format!("{a}.attention.head_count"), u32_of(s.n_head)),
        (format!("{a}.attention.head_count_kv"), u32_of(s.n_head_kv)),
        (format!("{a}.attention.key_length"), u32_of(s.head_dim)),
        (format!("{a}.attention.value_length"), u32_of(s.head_dim)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(s.rms_eps),
        ),
        (format!("{a}.rope.freq_base"), Value::F32(s.rope_freq_base)),
        (
            format!("{a}.rope.dimension_count"),
            u32_of(s.rope_dims.unwrap_or(s.head_dim)),
        ),
        (format!("{a}.vocab_size"), u32_of(s.n_vocab)),
    ];
    if let Some(window) = s.sliding_window {
        md.push((format!("{a}.attention.sliding_window"), Value::U32(window)));
    }
    if let Some(g) = s.gemma4 {
        // Global layers' sizes under the plain keys, sliding layers' under `_swa`, as
        // llama.cpp's converter writes them.
        let n_kv = |il| s.layer_n_head_kv(il) as u32;
        let n_ff: Vec<u32> = (0..s.n_layer).map(|il| s.layer_n_ff(il) as u32).collect();
        md.retain(|(k, _)| {
            !k.ends_with(".attention.head_count_kv")
                && !k.ends_with(".attention.key_length")
                && !k.ends_with(".attention.value_length")
                && !k.ends_with(".rope.dimension_count")
                && !k.ends_with(".feed_forward_length")
        });
        md.extend([
            (
                format!("{a}.feed_forward_length"),
                if n_ff.iter().all(|&f| f == n_ff[0]) {
                    Value::U32(n_ff[0])
                } else {
                    Value::Array(Array::U32(n_ff))
                },
            ),
            (
                format!("{a}.attention.head_count_kv"),
                Value::Array(Array::U32((0..s.n_layer).map(n_kv).collect())),
            ),
            (
                format!("{a}.attention.key_length"),
                u32_of(g.head_dim_global),
            ),
            (
                format!("{a}.attention.value_length"),
                u32_of(g.head_dim_global),
            ),
            (format!("{a}.attention.key_length_swa"), u32_of(s.head_dim)),
            (
                format!("{a}.attention.value_length_swa"),
                u32_of(s.head_dim),
            ),
            (
                format!("{a}.rope.dimension_count"),
                u32_of(g.head_dim_global),
            ),
            (format!("{a}.rope.dimension_count_swa"), u32_of(s.head_dim)),
            (
                format!("{a}.rope.freq_base_swa"),
                Value::F32(g.rope_freq_base_swa),
            ),
            (
                format!("{a}.attention.sliding_window_pattern"),
                Value::Array(Array::Bool(
                    (0..s.n_layer).map(|il| g.is_sliding(il)).collect(),
                )),
            ),
            (
                format!("{a}.attention.shared_kv_layers"),
                u32_of(g.n_kv_shared_layers),
            ),
            (
                format!("{a}.embedding_length_per_layer_input"),
                u32_of(g.n_embd_per_layer),
            ),
            (
                format!("{a}.final_logit_softcapping"),
                Value::F32(g.final_logit_softcap),
            ),
        ]);
    }
    if let Some(m) = s.moe {
        md.extend([
            (format!("{a}.expert_count"), u32_of(m.n_expert)),
            (format!("{a}.expert_used_count"), u32_of(m.n_expert_used)),
            (
                format!("{a}.expert_feed_forward_length"),
                u32_of(m.n_ff_expert),
            ),
        ]);
        if let Some(sff) = m.n_ff_shared {
            md.push((
                format!("{a}.expert_shared_feed_forward_length"),
                u32_of(sff),
            ));
        }
    }
    if let Some(l) = s.linear {
        md.extend([
            (format!("{a}.ssm.conv_kernel"), u32_of(l.conv_kernel)),
            (format!("{a}.ssm.state_size"), u32_of(l.head_dim)),
            (format!("{a}.ssm.group_count"), u32_of(l.n_k_heads)),
            (format!("{a}.ssm.time_step_rank"), u32_of(l.n_v_heads)),
            (format!("{a}.ssm.inner_size"), u32_of(l.value_dim())),
            (
                format!("{a}.full_attention_interval"),
                u32_of(l.full_attention_interval),
            ),
        ]);
    }
    if let Some(sections) = s.rope_sections {
        md.push((
            format!("{a}.rope.dimension_sections"),
            Value::Array(Array::I32(sections.iter().map(|&v| v as i32).collect())),
        ));
    }
    md.extend([
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(vocab.pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(vocab.tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(vocab.token_types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(vocab.merges)),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(vocab.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(vocab.eos)),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(vocab.padding),
        ),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(vocab.add_bos),
        ),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(vocab.chat_template.into()),
        ),
    ]);
    Ok(md)
}

/// Writes the model of `opts` to `path` (through a temporary file beside it, renamed at the
/// end, so a failed run never leaves a truncated model under the final name). `progress` is
/// called before each tensor and once at the end.
pub fn write_model(
    opts: &SynthOptions,
    path: &Path,
    progress: impl FnMut(&Progress<'_>) + 'static,
) -> Result<Summary, SynthError> {
    let start = Instant::now();
    let tensors = tensor_list(opts)?;
    let mut writer = GgufWriter::new();
    for (key, value) in metadata(opts)? {
        writer.metadata(&key, value);
    }
    let total = tensors.len();
    let bytes_total: u64 = tensors.iter().map(TensorSpec::n_bytes).sum();
    let failure: Rc<RefCell<Option<SynthError>>> = Rc::new(RefCell::new(None));
    let progress = Rc::new(RefCell::new(progress));
    let bytes_done = Rc::new(RefCell::new(0u64));
    let mut types: BTreeMap<String, usize> = BTreeMap::new();
    for (index, t) in tensors.iter().enumerate() {
        *types.entry(t.ty.name().to_string()).or_insert(0) += 1;
        let spec = t.clone();
        let (failure, progress, bytes_done) =
            (failure.clone(), progress.clone(), bytes_done.clone());
        let (seed, fast) = (opts.seed, opts.fast);
        writer.tensor_generated(&t.name, &t.dims, t.ty, move |out: &mut [u8]| {
            if failure.borrow().is_some() {
                return;
            }
            (progress.borrow_mut())(&Progress {
                done: index,
                total,
                tensor: Some(&spec),
                bytes_done: *bytes_done.borrow(),
                bytes_total,
                elapsed_s: start.elapsed().as_secs_f64(),
            });
            let fill = if fast {
                weights::fill_fast
            } else {
                weights::fill_exact
            };
            if let Err(e) = fill(&spec.name, spec.ty, spec.cols(), &spec.init, seed, out) {
                *failure.borrow_mut() = Some(e);
            }
            *bytes_done.borrow_mut() += out.len() as u64;
        });
    }

    let io_error = |e: std::io::Error, p: &Path| SynthError::Io {
        path: p.display().to_string(),
        message: e.to_string(),
    };
    let file_name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.gguf".into());
    let tmp = path.with_file_name(format!(".{file_name}.partial"));
    let written = writer.write_file(&tmp);
    if let Some(e) = failure.borrow_mut().take() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_error(e, &tmp));
    }
    std::fs::rename(&tmp, path).map_err(|e| io_error(e, path))?;
    let seconds = start.elapsed().as_secs_f64();
    (progress.borrow_mut())(&Progress {
        done: total,
        total,
        tensor: None,
        bytes_done: bytes_total,
        bytes_total,
        elapsed_s: seconds,
    });
    Ok(Summary {
        n_tensors: total,
        n_params: tensors.iter().map(|t| t.dims.iter().product::<u64>()).sum(),
        tensor_bytes: bytes_total,
        types,
        seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(shape: &str, types: &str, pure: bool) -> SynthOptions {
        SynthOptions {
            shape: Shape::named(shape).unwrap(),
            types: TypeSpec::parse(types).unwrap(),
            pure,
            seed: 1,
            fast: false,
        }
    }

    #[test]
    fn every_full_shape_in_every_type_has_a_valid_tensor_list() {
        for shape in SHAPE_NAMES {
            for types in TYPE_NAMES {
                for pure in [false, true] {
                    let list = tensor_list(&opts(shape, types, pure)).unwrap();
                    let params: u64 = list.iter().map(|t| t.dims.iter().product::<u64>()).sum();
                    let s = Shape::named(shape).unwrap();
                    let rope_freqs = s.rope_scaling.map_or(0, |_| s.head_dim as u64 / 2);
                    assert_eq!(params, s.n_params() + rope_freqs, "{shape} {types}");
                }
            }
        }
    }

    /// File sizes of llama.cpp's synthetic models of the same shapes, from
    /// `shared/anchors/h200-llamacpp.md` (F16 written by the converter, the others by
    /// llama-quantize): the same mix of types gives the same bytes, within the metadata.
    #[test]
    fn sizes_match_the_llama_cpp_anchor_files() {
        let mib = |shape: &str, types: &str| {
            let list = tensor_list(&opts(shape, types, false)).unwrap();
            list.iter().map(TensorSpec::n_bytes).sum::<u64>() as f64 / (1024.0 * 1024.0)
        };
        // The anchors' 1B model has a separate output.weight (its file is exactly this mix plus
        // a Q4_0 token table of 140.91 MiB); ours ties them, as Llama 3.2 1B does.
        let untied_token_table = (128_256 * 2048 / 32 * 18) as f64 / (1024.0 * 1024.0);
        for (shape, types, anchor_mib) in [
            ("llama3.2-1b", "q4_0", 868.65 - untied_token_table),
            ("llama3-8b", "q4_0", 4.33 * 1024.0),
            ("llama3-8b", "q4_k_m", 4.58 * 1024.0),
            ("llama3-8b", "f16", 14.96 * 1024.0),
        ] {
            let got = mib(shape, types);
            // The anchors' sizes are rounded to 0.01 GiB and include a few MiB of metadata.
            assert!(
                (got - anchor_mib).abs() < 12.0,
                "{shape} {types}: {got:.2} MiB of tensors, llama.cpp's file {anchor_mib:.2} MiB"
            );
        }
    }
}
