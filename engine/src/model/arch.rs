//! The architecture registry: what each `general.architecture` value means to the model code.
//!
//! One forward pass serves every architecture here but Gemma 4 (they are all pre-norm
//! decoder-only transformers); an [`Architecture`] only answers the questions where they differ:
//! how rotary embedding pairs elements, which optional tensors exist, which activation the FFN
//! uses, and so on. Adding an architecture means adding a variant and answering those questions.
//! Gemma 4's block differs in too many places (per-layer head sizes, shared KV layers, experts
//! beside the dense FFN, per-layer embeddings), so it has a forward pass of its own over the same
//! backend ops (`model/gemma4.rs`).

use crate::backend::ExpertGating;
pub use crate::ops::FfnActivation;
use crate::ops::RopeMode;

/// A supported model architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1/2/3 and models converted as `llama` (SmolLM2, Mistral 7B, ...).
    Llama,
    /// Qwen2 and Qwen2.5: biases on Q, K and V.
    Qwen2,
    /// Qwen3: RMS norm on each Q and K head, no biases.
    Qwen3,
    /// Gemma 3: sliding-window layers, GeGLU, QK-norm, pre and post norms, scaled embeddings.
    Gemma3,
    /// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a mixture of experts
    /// in place of the FFN in every layer (softmax routing, normalised weights, no shared
    /// expert).
    Qwen3Moe,
    /// Qwen 3.5 / 3.6 dense (`qwen35`): a hybrid of Gated DeltaNet linear-attention layers with a
    /// short causal convolution and a per-sequence recurrent state, and every few layers gated
    /// full attention (a query gate, QK-norm, partial interleaved multi-section rope).
    Qwen35,
    /// Qwen 3.5 / 3.6 mixture of experts (`qwen35moe`): Qwen 3.5's layers with a mixture of
    /// experts plus a sigmoid-gated shared expert in place of the FFN.
    Qwen35Moe,
    /// Gemma 4 (26B-A4B, E2B, E4B, 31B): sliding-window and global layers with different head
    /// sizes, KV head counts and rotary bases, value norm, attention scale 1, and optionally a
    /// mixture of experts beside the dense FFN (26B-A4B), per-layer token embeddings and layers
    /// that reuse an earlier layer's KV cache (the E models). Its layer block differs enough
    /// that it has its own forward pass (`model::gemma4`).
    Gemma4,
}

/// How an architecture's mixture-of-experts layers route and what they hold, where llama.cpp
/// fixes it in the architecture's graph code rather than reading it from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeRules {
    pub gating: ExpertGating,
    /// Whether the chosen experts' weights are divided by their sum.
    pub normalize_weights: bool,
    /// Whether layers carry a shared expert (`ffn_{gate,up,down}_shexp`).
    pub shared_expert: Presence,
    /// Whether the shared expert's output is gated per token (`ffn_gate_inp_shexp`).
    pub shared_expert_gate: Presence,
}

impl Architecture {
    /// Every supported architecture.
    pub const ALL: [Architecture; 8] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma3,
        Architecture::Qwen3Moe,
        Architecture::Qwen35,
        Architecture::Qwen35Moe,
        Architecture::Gemma4,
    ];

    /// The `general.architecture` value, which is also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Qwen35 => "qwen35",
            Architecture::Qwen35Moe => "qwen35moe",
            Architecture::Gemma4 => "gemma4",
        }
    }

    /// The architecture called `name`, if supported.
    pub fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The supported names, comma-separated, for error messages.
    pub fn supported_list() -> String {
        Architecture::ALL.map(|a| a.name()).join(", ")
    }

    /// How rotary embedding pairs elements (llama.cpp's `llama_model_rope_type`). Qwen 3.5's
    /// interleaved multi-section rope (`IMROPE`) pairs elements as NeoX does; for text every
    /// section has the token's position, which makes it NeoX rope exactly (see
    /// `HParams::rope_sections`).
    pub fn rope_mode(self) -> RopeMode {
        match self {
            Architecture::Llama => RopeMode::Normal,
            Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Gemma3
            | Architecture::Qwen3Moe
            | Architecture::Qwen35
            | Architecture::Qwen35Moe
            | Architecture::Gemma4 => RopeMode::Neox,
        }
    }

    /// Whether Q, K and V carry biases: required for Qwen2; optional (loaded when present) for
    /// Llama, as some Llama conversions have them; absent otherwise.
    pub fn qkv_bias(self) -> Presence {
        match self {
            Architecture::Qwen2 => Presence::Required,
            Architecture::Llama => Presence::Optional,
            Architecture::Qwen3
            | Architecture::Gemma3
            | Architecture::Qwen3Moe
            | Architecture::Qwen35
            | Architecture::Qwen35Moe
            | Architecture::Gemma4 => Presence::Absent,
        }
    }

    /// Whether each Q and K head is RMS-normalised before rotary embedding.
    pub fn qk_norm(self) -> bool {
        matches!(
            self,
            Architecture::Qwen3
                | Architecture::Gemma3
                | Architecture::Qwen3Moe
                | Architecture::Qwen35
                | Architecture::Qwen35Moe
                | Architecture::Gemma4
        )
    }

    /// Whether the model is a hybrid whose linear-attention layers (Gated DeltaNet) keep a
    /// recurrent state per sequence; its full-attention layers then have a query gate (the Q
    /// projection gives each head's query and its gate).
    pub fn hybrid_recurrent(self) -> bool {
        matches!(self, Architecture::Qwen35 | Architecture::Qwen35Moe)
    }

    /// The name of the norm before the FFN: Qwen 3.5 calls it the post-attention norm (it
    /// normalises the residual stream after the attention block's add, like every other
    /// architecture's FFN norm).
    pub fn ffn_norm_name(self) -> &'static str {
        match self {
            Architecture::Qwen35 | Architecture::Qwen35Moe => "post_attention_norm.weight",
            _ => "ffn_norm.weight",
        }
    }

    /// Whether the attention and FFN outputs are RMS-normalised before the residual add.
    pub fn post_norms(self) -> bool {
        matches!(self, Architecture::Gemma3 | Architecture::Gemma4)
    }

    /// The FFN's activation.
    pub fn ffn_activation(self) -> FfnActivation {
        match self {
            Architecture::Gemma3 | Architecture::Gemma4 => FfnActivation::GeGlu,
            _ => FfnActivation::SwiGlu,
        }
    }

    /// The mixture-of-experts rules when the architecture's FFN layers are mixtures of experts
    /// (then `<arch>.expert_count` and `<arch>.expert_used_count` are required).
    pub fn moe(self) -> Option<MoeRules> {
        match self {
            // llama.cpp's qwen3moe graph passes softmax gating and normalisation as constants.
            Architecture::Qwen3Moe => Some(MoeRules {
                gating: ExpertGating::Softmax,
                normalize_weights: true,
                shared_expert: Presence::Absent,
                shared_expert_gate: Presence::Absent,
            }),
            // llama.cpp's qwen35moe graph: softmax gating, normalised weights, a shared expert
            // whose output is scaled by `sigmoid(ffn_gate_inp_shexp x)` (both required by its
            // loader).
            Architecture::Qwen35Moe => Some(MoeRules {
                gating: ExpertGating::Softmax,
                normalize_weights: true,
                shared_expert: Presence::Required,
                shared_expert_gate: Presence::Required,
            }),
            // llama.cpp's gemma4 graph: softmax gating, normalised weights, a scale of 1. Its
            // dense FFN runs beside the experts with norms of its own, so the forward pass
            // computes it rather than the op's shared expert. Whether a file has experts at all
            // is its `expert_count` (the E models have none).
            Architecture::Gemma4 => Some(MoeRules {
                gating: ExpertGating::Softmax,
                normalize_weights: true,
                shared_expert: Presence::Absent,
                shared_expert_gate: Presence::Absent,
            }),
            _ => None,
        }
    }

    /// Whether token embeddings are multiplied by `sqrt(n_embd)`.
    pub fn scales_embeddings(self) -> bool {
        matches!(self, Architecture::Gemma3 | Architecture::Gemma4)
    }

    /// Whether the queries, rather than the scores, are multiplied by the attention scale
    /// (llama.cpp's Gemma code does this; the result differs only in rounding).
    pub fn scales_queries(self) -> bool {
        matches!(self, Architecture::Gemma3)
    }
}

/// Whether an optional group of tensors is expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    Required,
    Optional,
    Absent,
}
