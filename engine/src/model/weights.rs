//! The model's tensors, looked up by their GGUF names, checked and placed on the backend.
//!
//! Every tensor is checked for its exact shape (the error names the tensor, the expected and the
//! found dims) and for a type the quantization kernels support before the backend sees it.

use std::collections::HashSet;
use std::sync::Arc;

use ember_gguf::{GgmlType, Gguf, TensorInfo};

use super::arch::{Architecture, Presence};
use super::hparams::{HParams, LinearAttention, MoeParams};
use super::ModelError;
use crate::backend::{Backend, BackendError};

/// The weights of one transformer block.
pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Vector,
    /// The token mixer: attention over the KV cache, or a linear-attention layer.
    pub mixer: MixerWeights<B>,
    pub post_attn_norm: Option<B::Vector>,
    pub ffn_norm: B::Vector,
    pub ffn: FfnWeights<B>,
    pub post_ffn_norm: Option<B::Vector>,
}

/// The token-mixing block of a layer.
pub enum MixerWeights<B: Backend> {
    Attention(AttentionWeights<B>),
    /// A Gated DeltaNet layer of a hybrid model.
    Linear(LinearAttentionWeights<B>),
}

/// The weights of a (multi-head, grouped-query) attention block.
pub struct AttentionWeights<B: Backend> {
    /// The query projection; with a query gate (Qwen 3.5) it gives each head's query followed
    /// by that head's gate, `2 * head_dim` rows per head.
    pub wq: B::Matrix,
    pub wk: B::Matrix,
    pub wv: B::Matrix,
    pub wo: B::Matrix,
    pub bq: Option<B::Vector>,
    pub bk: Option<B::Vector>,
    pub bv: Option<B::Vector>,
    pub bo: Option<B::Vector>,
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
    /// Whether the query projection carries a per-element output gate (`sigmoid(gate)` times
    /// the attention output, before the output projection).
    pub query_gate: bool,
}

/// The weights of a Gated DeltaNet layer (llama.cpp's names in brackets).
pub struct LinearAttentionWeights<B: Backend> {
    /// `attn_qkv`: the Q, K and V channels the convolution runs over.
    pub qkv: B::Matrix,
    /// `attn_gate`: `z`, the gate of the output norm.
    pub gate: B::Matrix,
    /// `ssm_beta`: one logit per value head, the write strength `sigmoid(beta)`.
    pub beta: B::Matrix,
    /// `ssm_alpha`: one value per value head, the decay input.
    pub alpha: B::Matrix,
    /// `ssm_conv1d`: `conv_kernel` taps per channel.
    pub conv: B::Vector,
    /// `ssm_dt.bias`: added to `alpha` before the softplus.
    pub dt_bias: B::Vector,
    /// `ssm_a`: `-exp(A_log)` per value head, the decay rate.
    pub a: B::Vector,
    /// `ssm_norm`: the RMS norm weight of each value head's output.
    pub norm: B::Vector,
    /// `ssm_out`: the output projection.
    pub out: B::Matrix,
}

/// The feed-forward block of a layer.
pub enum FfnWeights<B: Backend> {
    /// A gated FFN: `down(act(gate x) * up x)`.
    Dense {
        gate: B::Matrix,
        up: B::Matrix,
        down: B::Matrix,
    },
    /// A mixture of experts.
    Moe(MoeWeights<B>),
}

/// The tensors of a mixture-of-experts FFN, with the hyperparameters they were loaded for.
pub struct MoeWeights<B: Backend> {
    pub params: MoeParams,
    /// `ffn_gate_inp`: one row of router logits per expert.
    pub router: B::Matrix,
    /// `ffn_{gate,up,down}_exps`: every expert's projection, stacked in one 3-D tensor and placed
    /// with [`Backend::expert_matrix`].
    pub gate_exps: B::Matrix,
    pub up_exps: B::Matrix,
    pub down_exps: B::Matrix,
    pub shared: Option<SharedExpertWeights<B>>,
}

/// The shared expert of a mixture-of-experts FFN (`ffn_*_shexp`).
pub struct SharedExpertWeights<B: Backend> {
    /// Rows of the gate and up projections.
    pub n_ff: usize,
    pub gate: B::Matrix,
    pub up: B::Matrix,
    pub down: B::Matrix,
    /// `ffn_gate_inp_shexp`: one row, the per-token gate of the shared expert's output.
    pub gate_inp: Option<B::Matrix>,
}

/// The weights of one Gemma 4 block (llama.cpp's `llama_model_gemma4::load_arch_tensors`).
pub struct Gemma4LayerWeights<B: Backend> {
    pub attn_norm: B::Vector,
    pub wq: B::Matrix,
    /// K and V of a layer with a cache of its own; `None` on KV-sharing layers.
    pub kv: Option<Gemma4Kv<B>>,
    pub wo: B::Matrix,
    pub q_norm: B::Vector,
    pub post_attn_norm: B::Vector,
    /// The dense FFN (`ffn_{norm,gate,up,down}`), which MoE layers run beside the experts.
    pub ffn_norm: B::Vector,
    pub ffn_gate: B::Matrix,
    pub ffn_up: B::Matrix,
    pub ffn_down: B::Matrix,
    pub post_ffn_norm: B::Vector,
    pub moe: Option<Gemma4Moe<B>>,
    pub per_layer: Option<Gemma4PerLayer<B>>,
    /// `layer_output_scale`: a factor on the block's output, when present.
    pub out_scale: Option<f32>,
}

/// K and V projections of a Gemma 4 layer with its own cache.
pub struct Gemma4Kv<B: Backend> {
    pub wk: B::Matrix,
    /// `None` where V is K's projection (`attention_k_eq_v`: global layers of 26B-A4B).
    pub wv: Option<B::Matrix>,
    pub k_norm: B::Vector,
}

/// The mixture of experts of a Gemma 4 layer and the norms around it.
pub struct Gemma4Moe<B: Backend> {
    /// Router and stacked experts (no shared expert: the dense FFN is computed apart).
    pub experts: MoeWeights<B>,
    /// `ffn_gate_inp.scale`: per-column factor on the router's input.
    pub router_scale: B::Vector,
    /// `ffn_down_exps.scale`: per-expert factor on the experts' outputs, when present.
    pub expert_scale: Option<Vec<f32>>,
    /// `pre_ffw_norm_2`: the experts' input norm.
    pub pre_norm: B::Vector,
    /// `post_ffw_norm_1`: after the dense FFN.
    pub post_norm_dense: B::Vector,
    /// `post_ffw_norm_2`: after the experts.
    pub post_norm_experts: B::Vector,
}

/// A Gemma 4 layer's per-layer-embedding block (`inp_gate`, `proj`, `post_norm`).
pub struct Gemma4PerLayer<B: Backend> {
    pub inp_gate: B::Matrix,
    pub proj: B::Matrix,
    pub post_norm: B::Vector,
}

/// Gemma 4's per-layer token embeddings (E models).
pub struct Gemma4PerLayerInput<B: Backend> {
    /// `per_layer_token_embd`: one row of `n_layer * width` values per token.
    pub token_embd: B::Matrix,
    /// `per_layer_model_proj`: the embedding's projection to the same `n_layer * width`.
    pub model_proj: B::Matrix,
    /// `per_layer_proj_norm`: RMS norm of each layer's `width` values of that projection.
    pub proj_norm: B::Vector,
}

/// All weights of a model.
pub struct Weights<B: Backend> {
    pub token_embd: B::Matrix,
    /// The blocks of every architecture but Gemma 4 (empty for Gemma 4).
    pub layers: Vec<LayerWeights<B>>,
    /// Gemma 4's blocks (empty otherwise).
    pub gemma4_layers: Vec<Gemma4LayerWeights<B>>,
    /// Gemma 4's per-layer token embeddings, when the model has them.
    pub gemma4_per_layer: Option<Gemma4PerLayerInput<B>>,
    pub output_norm: B::Vector,
    /// The output projection; `None` when it is tied to the token embeddings.
    pub output: Option<B::Matrix>,
    /// Llama 3's per-pair rotary frequency divisors.
    pub rope_freqs: Option<Vec<f32>>,
    pub n_vocab: usize,
}

struct Loader<'a, B: Backend> {
    gguf: &'a Arc<Gguf>,
    backend: &'a B,
    used: HashSet<String>,
    progress: &'a mut dyn FnMut(usize, usize),
    total: usize,
}

impl<B: Backend> Loader<'_, B> {
    fn find(&mut self, name: &str, dims: &[usize]) -> Result<TensorInfo, ModelError> {
        let info = self
            .gguf
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected: format!("{dims:?}"),
            })?;
        let found: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        if found != dims {
            return Err(ModelError::WrongShape {
                name: name.to_string(),
                expected: dims.to_vec(),
                found,
            });
        }
        if !ember_quant::is_supported(info.ty) || matches!(info.ty, GgmlType::Q8_1 | GgmlType::Q8_K)
        {
            return Err(ModelError::UnsupportedType {
                name: name.to_string(),
                ty: info.ty.name().to_string(),
                supported:
                    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"
                        .into(),
            });
        }
        self.used.insert(name.to_string());
        (self.progress)(self.used.len(), self.total);
        Ok(info.clone())
    }

    fn matrix(&mut self, name: &str, cols: usize, rows: usize) -> Result<B::Matrix, ModelError> {
        let info = self.find(name, &[cols, rows])?;
        Ok(self.backend.matrix(self.gguf, &info)?)
    }

    /// A one-row matrix stored as a vector (`dims [cols]`), such as a per-token gate.
    fn row_matrix(&mut self, name: &str, cols: usize) -> Result<B::Matrix, ModelError> {
        let info = self.find(name, &[cols])?;
        Ok(self.backend.matrix(self.gguf, &info)?)
    }

    /// The stacked matrices of `n_expert` experts, each `rows` x `cols`.
    fn experts(
        &mut self,
        name: &str,
        cols: usize,
        rows: usize,
        n_expert: usize,
    ) -> Result<B::Matrix, ModelError> {
        let info = self.find(name, &[cols, rows, n_expert])?;
        Ok(self.backend.expert_matrix(self.gguf, &info)?)
    }

    fn present(&self, name: &str, presence: Presence) -> bool {
        match presence {
            Presence::Required => true,
            Presence::Optional => self.gguf.tensor(name).is_some(),
            Presence::Absent => false,
        }
    }

    /// The FFN of layer `il`: dense, or the mixture of experts `hp.moe` describes.
    fn ffn(&mut self, hp: &HParams, il: usize, n_ff: usize) -> Result<FfnWeights<B>, ModelError> {
        let name = |suffix: &str| format!("blk.{il}.{suffix}");
        let n_embd = hp.n_embd;
        let (Some(moe), true) = (&hp.moe, hp.layers[il].moe) else {
            return Ok(FfnWeights::Dense {
                gate: self.matrix(&name("ffn_gate.weight"), n_embd, n_ff)?,
                up: self.matrix(&name("ffn_up.weight"), n_embd, n_ff)?,
                down: self.matrix(&name("ffn_down.weight"), n_ff, n_embd)?,
            });
        };
        let rules = hp.architecture.moe();
        let (n_expert, n_ff_expert) = (moe.n_expert, moe.n_ff_expert);
        let router = self.matrix(&name("ffn_gate_inp.weight"), n_embd, n_expert)?;
        let gate_exps =
            self.experts(&name("ffn_gate_exps.weight"), n_embd, n_ff_expert, n_expert)?;
        let up_exps = self.experts(&name("ffn_up_exps.weight"), n_embd, n_ff_expert, n_expert)?;
        let down_exps =
            self.experts(&name("ffn_down_exps.weight"), n_ff_expert, n_embd, n_expert)?;
        let shared_presence = rules.map_or(Presence::Absent, |r| r.shared_expert);
        let shared = match moe.n_ff_shared {
            Some(n_ff) if self.present(&name("ffn_gate_shexp.weight"), shared_presence) => {
                let gate_presence = rules.map_or(Presence::Absent, |r| r.shared_expert_gate);
                let gate_inp_name = name("ffn_gate_inp_shexp.weight");
                Some(SharedExpertWeights {
                    n_ff,
                    gate: self.matrix(&name("ffn_gate_shexp.weight"), n_embd, n_ff)?,
                    up: self.matrix(&name("ffn_up_shexp.weight"), n_embd, n_ff)?,
                    down: self.matrix(&name("ffn_down_shexp.weight"), n_ff, n_embd)?,
                    gate_inp: if self.present(&gate_inp_name, gate_presence) {
                        Some(self.row_matrix(&gate_inp_name, n_embd)?)
                    } else {
                        None
                    },
                })
            }
            _ => None,
        };
        Ok(FfnWeights::Moe(MoeWeights {
            params: *moe,
            router,
            gate_exps,
            up_exps,
            down_exps,
            shared,
        }))
    }

    /// A small tensor read to host f32 (rotary factors, per-expert scales, a layer scalar).
    fn host_f32(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let info = self.find(name, &[len])?;
        let mut v = vec![0f32; len];
        ember_quant::dequantize(info.ty, self.gguf.tensor_data(&info), &mut v).map_err(|e| {
            ModelError::UnsupportedType {
                name: info.name.clone(),
                ty: info.ty.name().to_string(),
                supported: e.to_string(),
            }
        })?;
        Ok(v)
    }

    /// The stacked experts and router of a mixture-of-experts layer (no shared expert).
    fn moe_experts(
        &mut self,
        il: usize,
        n_embd: usize,
        moe: &MoeParams,
    ) -> Result<MoeWeights<B>, ModelError> {
        let name = |suffix: &str| format!("blk.{il}.{suffix}");
        let (n_expert, n_ff_expert) = (moe.n_expert, moe.n_ff_expert);
        Ok(MoeWeights {
            params: *moe,
            router: self.matrix(&name("ffn_gate_inp.weight"), n_embd, n_expert)?,
            gate_exps: self.experts(
                &name("ffn_gate_exps.weight"),
                n_embd,
                n_ff_expert,
                n_expert,
            )?,
            up_exps: self.experts(&name("ffn_up_exps.weight"), n_embd, n_ff_expert, n_expert)?,
            down_exps: self.experts(
                &name("ffn_down_exps.weight"),
                n_ff_expert,
                n_embd,
                n_expert,
            )?,
            shared: None,
        })
    }

    /// Gemma 4's block `il`.
    fn gemma4_layer(
        &mut self,
        hp: &HParams,
        il: usize,
    ) -> Result<Gemma4LayerWeights<B>, ModelError> {
        let name = |suffix: &str| format!("blk.{il}.{suffix}");
        let shape = hp.layers[il];
        let (n_embd, hd) = (hp.n_embd, shape.head_dim);
        let (q_out, kv_out) = (shape.n_head * hd, shape.n_head_kv * hd);
        if self.gguf.tensor(&name("attn_q.weight")).is_none()
            && self.gguf.tensor(&name("attn_qkv.weight")).is_some()
        {
            return Err(ModelError::MissingTensor {
                name: name("attn_q.weight"),
                expected: format!("[{n_embd}, {q_out}] (fused attn_qkv is not supported yet)"),
            });
        }
        let kv = if shape.kv_source == il {
            Some(Gemma4Kv {
                wk: self.matrix(&name("attn_k.weight"), n_embd, kv_out)?,
                wv: if self.gguf.tensor(&name("attn_v.weight")).is_some() {
                    Some(self.matrix(&name("attn_v.weight"), n_embd, kv_out)?)
                } else {
                    None
                },
                k_norm: self.vector(&name("attn_k_norm.weight"), hd)?,
            })
        } else {
            None
        };
        let moe = match (&hp.moe, shape.moe) {
            (Some(params), true) => {
                if self.gguf.tensor(&name("ffn_gate_exps.weight")).is_none()
                    && self.gguf.tensor(&name("ffn_gate_up_exps.weight")).is_some()
                {
                    return Err(ModelError::MissingTensor {
                        name: name("ffn_gate_exps.weight"),
                        expected: format!(
                            "[{n_embd}, {}, {}] (fused ffn_gate_up_exps is not supported yet)",
                            params.n_ff_expert, params.n_expert
                        ),
                    });
                }
                let scale_name = name("ffn_down_exps.scale");
                Some(Gemma4Moe {
                    experts: self.moe_experts(il, n_embd, params)?,
                    router_scale: self.vector(&name("ffn_gate_inp.scale"), n_embd)?,
                    expert_scale: if self.gguf.tensor(&scale_name).is_some() {
                        Some(self.host_f32(&scale_name, params.n_expert)?)
                    } else {
                        None
                    },
                    pre_norm: self.vector(&name("pre_ffw_norm_2.weight"), n_embd)?,
                    post_norm_dense: self.vector(&name("post_ffw_norm_1.weight"), n_embd)?,
                    post_norm_experts: self.vector(&name("post_ffw_norm_2.weight"), n_embd)?,
                })
            }
            _ => None,
        };
        let per_layer = match hp.n_embd_per_layer {
            Some(width) => Some(Gemma4PerLayer {
                inp_gate: self.matrix(&name("inp_gate.weight"), n_embd, width)?,
                proj: self.matrix(&name("proj.weight"), width, n_embd)?,
                post_norm: self.vector(&name("post_norm.weight"), n_embd)?,
            }),
            None => None,
        };
        let out_scale_name = name("layer_output_scale.weight");
        let out_scale = if self.gguf.tensor(&out_scale_name).is_some() {
            Some(self.host_f32(&out_scale_name, 1)?[0])
        } else {
            None
        };
        let n_ff = shape.n_ff;
        Ok(Gemma4LayerWeights {
            attn_norm: self.vector(&name("attn_norm.weight"), n_embd)?,
            wq: self.matrix(&name("attn_q.weight"), n_embd, q_out)?,
            kv,
            wo: self.matrix(&name("attn_output.weight"), q_out, n_embd)?,
            q_norm: self.vector(&name("attn_q_norm.weight"), hd)?,
            post_attn_norm: self.vector(&name("post_attention_norm.weight"), n_embd)?,
            ffn_norm: self.vector(&name("ffn_norm.weight"), n_embd)?,
            ffn_gate: self.matrix(&name("ffn_gate.weight"), n_embd, n_ff)?,
            ffn_up: self.matrix(&name("ffn_up.weight"), n_embd, n_ff)?,
            ffn_down: self.matrix(&name("ffn_down.weight"), n_ff, n_embd)?,
            post_ffn_norm: self.vector(&name("post_ffw_norm.weight"), n_embd)?,
            moe,
            per_layer,
            out_scale,
        })
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector, ModelError> {
        self.vector_dims(name, &[len])
    }

    /// A tensor of any dims read as one f32 vector (row-major, the first dim fastest).
    fn vector_dims(&mut self, name: &str, dims: &[usize]) -> Result<B::Vector, ModelError> {
        let info = self.find(name, dims)?;
        Ok(self.backend.vector(self.gguf, &info)?)
    }

    /// The attention block of layer `il`.
    fn attention(&mut self, hp: &HParams, il: usize) -> Result<AttentionWeights<B>, ModelError> {
        let name = |suffix: &str| format!("blk.{il}.{suffix}");
        let arch = hp.architecture;
        let (n_embd, hd) = (hp.n_embd, hp.head_dim_k);
        let shape = &hp.layers[il];
        let (q_out, kv_out) = (shape.n_head * hd, shape.n_head_kv * hd);
        let query_gate = arch.hybrid_recurrent();
        let q_rows = if query_gate { 2 * q_out } else { q_out };
        Ok(AttentionWeights {
            wq: self.matrix(&name("attn_q.weight"), n_embd, q_rows)?,
            wk: self.matrix(&name("attn_k.weight"), n_embd, kv_out)?,
            wv: self.matrix(&name("attn_v.weight"), n_embd, kv_out)?,
            wo: self.matrix(&name("attn_output.weight"), q_out, n_embd)?,
            bq: self.vector_if(arch.qkv_bias(), &name("attn_q.bias"), q_out)?,
            bk: self.vector_if(arch.qkv_bias(), &name("attn_k.bias"), kv_out)?,
            bv: self.vector_if(arch.qkv_bias(), &name("attn_v.bias"), kv_out)?,
            bo: match arch.qkv_bias() {
                Presence::Absent => None,
                _ => self.vector_opt(&name("attn_output.bias"), n_embd)?,
            },
            q_norm: if arch.qk_norm() {
                Some(self.vector(&name("attn_q_norm.weight"), hd)?)
            } else {
                None
            },
            k_norm: if arch.qk_norm() {
                Some(self.vector(&name("attn_k_norm.weight"), hd)?)
            } else {
                None
            },
            query_gate,
        })
    }

    /// The Gated DeltaNet block of layer `il`.
    fn linear_attention(
        &mut self,
        hp: &HParams,
        linear: &LinearAttention,
        il: usize,
    ) -> Result<LinearAttentionWeights<B>, ModelError> {
        let name = |suffix: &str| format!("blk.{il}.{suffix}");
        let n_embd = hp.n_embd;
        let (value_dim, n_v_heads) = (linear.value_dim(), linear.n_v_heads);
        Ok(LinearAttentionWeights {
            qkv: self.matrix(&name("attn_qkv.weight"), n_embd, linear.conv_channels())?,
            gate: self.matrix(&name("attn_gate.weight"), n_embd, value_dim)?,
            beta: self.matrix(&name("ssm_beta.weight"), n_embd, n_v_heads)?,
            alpha: self.matrix(&name("ssm_alpha.weight"), n_embd, n_v_heads)?,
            conv: self.vector_dims(
                &name("ssm_conv1d.weight"),
                &[linear.conv_kernel, linear.conv_channels()],
            )?,
            dt_bias: self.vector(&name("ssm_dt.bias"), n_v_heads)?,
            a: self.vector(&name("ssm_a"), n_v_heads)?,
            norm: self.vector(&name("ssm_norm.weight"), linear.head_v_dim)?,
            out: self.matrix(&name("ssm_out.weight"), value_dim, n_embd)?,
        })
    }

    fn vector_opt(&mut self, name: &str, len: usize) -> Result<Option<B::Vector>, ModelError> {
        if self.gguf.tensor(name).is_none() {
            return Ok(None);
        }
        self.vector(name, len).map(Some)
    }

    fn vector_if(
        &mut self,
        presence: Presence,
        name: &str,
        len: usize,
    ) -> Result<Option<B::Vector>, ModelError> {
        match presence {
            Presence::Required => self.vector(name, len).map(Some),
            Presence::Optional => self.vector_opt(name, len),
            Presence::Absent => Ok(None),
        }
    }
}

impl<B: Backend> Weights<B> {
    /// Finds, checks and places every tensor the model needs. `progress(done, total)` is called
    /// after each tensor.
    pub fn load(
        gguf: &Arc<Gguf>,
        hp: &HParams,
        backend: &B,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights<B>, ModelError> {
        let arch = hp.architecture;
        let n_embd = hp.n_embd;
        let token_embd_info =
            gguf.tensor("token_embd.weight")
                .ok_or_else(|| ModelError::MissingTensor {
                    name: "token_embd.weight".into(),
                    expected: format!("[{n_embd}, n_vocab]"),
                })?;
        let n_vocab = token_embd_info.dims.get(1).copied().unwrap_or(0) as usize;
        if let Some(n) = hp.n_vocab_metadata {
            if n != n_vocab {
                return Err(ModelError::WrongShape {
                    name: "token_embd.weight".into(),
                    expected: vec![n_embd, n],
                    found: token_embd_info.dims.iter().map(|&d| d as usize).collect(),
                });
            }
        }
        if let Some(max) = backend.max_head_dim() {
            if let Some((layer, shape)) = hp
                .layers
                .iter()
                .enumerate()
                .find(|(_, shape)| !shape.recurrent && shape.head_dim > max)
            {
                return Err(BackendError::HeadDimTooLarge {
                    tensor: format!("blk.{layer}.attn_q.weight"),
                    layer,
                    head_dim: shape.head_dim,
                    max,
                    backend: backend.name(),
                }
                .into());
            }
        }
        let mut loader = Loader {
            gguf,
            backend,
            used: HashSet::new(),
            progress,
            total: gguf.tensors().len(),
        };
        let token_embd = loader.matrix("token_embd.weight", n_embd, n_vocab)?;
        let output_norm = loader.vector("output_norm.weight", n_embd)?;
        let output = if gguf.tensor("output.weight").is_some() {
            Some(loader.matrix("output.weight", n_embd, n_vocab)?)
        } else {
            None
        };
        // Gemma 4's global layers require their proportional-rope factors; elsewhere they are
        // Llama 3's optional frequency divisors.
        let rope_freqs_required =
            arch == Architecture::Gemma4 && hp.layers.iter().any(|l| !l.sliding_window);
        let rope_freqs = if gguf.tensor("rope_freqs.weight").is_some() || rope_freqs_required {
            Some(loader.host_f32("rope_freqs.weight", hp.rope_n_dims / 2)?)
        } else {
            None
        };

        if hp.has_recurrent_state() && !backend.linear_attention_supported() {
            return Err(ModelError::Backend(BackendError::NotBuilt {
                tensor: "blk.0.ssm_conv1d.weight".into(),
                feature: "linear attention (Gated DeltaNet) with recurrent state",
                architecture: arch.name().to_string(),
                backend: backend.name(),
            }));
        }
        if arch == Architecture::Gemma4 {
            if !backend.has_gemma4_ops() {
                return Err(BackendError::NotBuilt {
                    tensor: "token_embd.weight".into(),
                    feature: "the Gemma 4 forward pass",
                    architecture: arch.name().into(),
                    backend: backend.name(),
                }
                .into());
            }
            let gemma4_per_layer = match hp.n_embd_per_layer {
                Some(width) => Some(Gemma4PerLayerInput {
                    token_embd: loader.matrix(
                        "per_layer_token_embd.weight",
                        width * hp.n_layer,
                        n_vocab,
                    )?,
                    model_proj: loader.matrix(
                        "per_layer_model_proj.weight",
                        n_embd,
                        width * hp.n_layer,
                    )?,
                    proj_norm: loader.vector("per_layer_proj_norm.weight", width)?,
                }),
                None => None,
            };
            let gemma4_layers = (0..hp.n_layer)
                .map(|il| loader.gemma4_layer(hp, il))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Weights {
                token_embd,
                layers: Vec::new(),
                gemma4_layers,
                gemma4_per_layer,
                output_norm,
                output,
                rope_freqs,
                n_vocab,
            });
        }

        let mut layers = Vec::with_capacity(hp.n_layer);
        for (il, shape) in hp.layers.iter().enumerate() {
            let name = |suffix: &str| format!("blk.{il}.{suffix}");
            let attn_norm = loader.vector(&name("attn_norm.weight"), n_embd)?;
            let mixer = match (&hp.linear_attention, shape.recurrent) {
                (Some(linear), true) => {
                    MixerWeights::Linear(loader.linear_attention(hp, linear, il)?)
                }
                _ => MixerWeights::Attention(loader.attention(hp, il)?),
            };
            layers.push(LayerWeights {
                attn_norm,
                mixer,
                post_attn_norm: if arch.post_norms() {
                    Some(loader.vector(&name("post_attention_norm.weight"), n_embd)?)
                } else {
                    None
                },
                ffn_norm: loader.vector(&name(arch.ffn_norm_name()), n_embd)?,
                ffn: loader.ffn(hp, il, shape.n_ff)?,
                post_ffn_norm: if arch.post_norms() {
                    Some(loader.vector(&name("post_ffw_norm.weight"), n_embd)?)
                } else {
                    None
                },
            });
        }
        Ok(Weights {
            token_embd,
            layers,
            gemma4_layers: Vec::new(),
            gemma4_per_layer: None,
            output_norm,
            output,
            rope_freqs,
            n_vocab,
        })
    }
}
