//! Model shapes: the hyperparameters of real models (from their published configs, or for
//! Gemma 3 270M from the GGUF file of `models.toml`), which synthetic models copy with random
//! weights.

use crate::SynthError;

/// The tokenizer conventions a shape's vocabulary follows: special tokens, BOS handling, the
/// pre-tokenizer name and the chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerStyle {
    /// Llama 3: `<|begin_of_text|>` added as BOS, header tokens, `llama-bpe` pre-tokenizer.
    Llama3,
    /// SmolLM2: ChatML tokens first in the vocabulary, no BOS added, `smollm` pre-tokenizer.
    SmolLm2,
    /// Qwen 2 and 3: ChatML tokens, no BOS added, `qwen2` pre-tokenizer.
    Qwen,
    /// Gemma 3's special tokens with a byte-level BPE (the real model uses SentencePiece; the
    /// synthetic one only needs a working tokenizer of the same size), BOS added.
    Gemma,
}

/// Llama 3.1's frequency-dependent rotary scaling, written as the `rope_freqs.weight` tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: u32,
}

impl Llama3RopeScaling {
    /// The divisor of each rotary pair's frequency (`head_dim / 2` values), by the rule of Meta's
    /// reference code for Llama 3.1: high frequencies (short wavelengths) unchanged, low ones
    /// divided by `factor`, a smooth blend between.
    pub fn freq_divisors(&self, head_dim: usize, freq_base: f32) -> Vec<f32> {
        let low_wavelen = self.original_context as f64 / self.low_freq_factor as f64;
        let high_wavelen = self.original_context as f64 / self.high_freq_factor as f64;
        (0..head_dim / 2)
            .map(|i| {
                let freq = (freq_base as f64).powf(-((2 * i) as f64) / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    self.factor
                } else {
                    let smooth = (self.original_context as f64 / wavelen
                        - self.low_freq_factor as f64)
                        / (self.high_freq_factor - self.low_freq_factor) as f64;
                    (1.0 / ((1.0 - smooth) / self.factor as f64 + smooth)) as f32
                }
            })
            .collect()
    }
}

/// The mixture of experts of a shape whose FFN layers route each token to a few experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts per layer.
    pub n_expert: usize,
    /// Experts each token goes through.
    pub n_expert_used: usize,
    /// Rows of each expert's gate and up projections.
    pub n_ff_expert: usize,
    /// Rows of the shared expert's gate and up projections, when layers have one (its output
    /// is then gated by `sigmoid(ffn_gate_inp_shexp x)`, as in Qwen 3.5 MoE).
    pub n_ff_shared: Option<usize>,
}

/// The Gated DeltaNet layers of a hybrid shape (Qwen 3.5): every layer is one except each
/// `full_attention_interval`-th, which is gated full attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Taps of the causal convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// Query and key heads (`linear_num_key_heads`).
    pub n_k_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub n_v_heads: usize,
    /// Size of every query, key and value head (`linear_key_head_dim` = `linear_value_head_dim`).
    pub head_dim: usize,
    pub full_attention_interval: usize,
}

impl LinearShape {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_dim
    }

    /// Channels of the convolution: queries, keys and values.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Whether layer `il` is a linear-attention layer.
    pub fn is_linear(&self, il: usize) -> bool {
        !(il + 1).is_multiple_of(self.full_attention_interval)
    }
}

/// What Gemma 4 adds to the common fields of a [`Shape`], whose `head_dim`, `n_head_kv`,
/// `sliding_window` and `rope_freq_base` are then those of its sliding-window layers and global
/// layers respectively (see each field).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma4Shape {
    /// Layers come in groups of this many: the last of each group is global, the others slide
    /// (the HF config's `layer_types`).
    pub swa_period: usize,
    /// Head size of global layers (`global_head_dim`; `Shape::head_dim` is the sliding one).
    pub head_dim_global: usize,
    /// KV heads of global layers (`num_global_key_value_heads`).
    pub n_head_kv_global: usize,
    /// Rotary base of sliding layers (`Shape::rope_freq_base` is the global layers').
    pub rope_freq_base_swa: f32,
    /// Share of a global head that rotates (proportional rope, `partial_rotary_factor`).
    pub partial_rotary_global: f32,
    /// Global layers have no V projection and use K's (`attention_k_eq_v`).
    pub k_eq_v_global: bool,
    /// The last this many layers reuse the cache of the last KV layer of their kind.
    pub n_kv_shared_layers: usize,
    /// Width of each layer's per-layer token embedding (0: none).
    pub n_embd_per_layer: usize,
    /// KV-sharing layers have an FFN twice as wide (`use_double_wide_mlp`).
    pub double_wide_shared_ffn: bool,
    pub final_logit_softcap: f32,
}

impl Gemma4Shape {
    /// Whether layer `il` uses sliding-window attention.
    pub fn is_sliding(&self, il: usize) -> bool {
        il % self.swa_period != self.swa_period - 1
    }
}

/// Everything about a model's shape that its GGUF metadata and tensor list need.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// The name on the command line (`llama3-8b`, ...).
    pub name: String,
    /// `general.architecture`.
    pub architecture: &'static str,
    pub tokenizer: TokenizerStyle,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx_train: u32,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// No `output.weight`: the output projection is the token embedding table.
    pub tied_embeddings: bool,
    /// Biases on Q, K and V (Qwen 2).
    pub qkv_bias: bool,
    /// RMS norm on each Q and K head (Qwen 3, Gemma 3).
    pub qk_norm: bool,
    /// Norms after attention and FFN before the residual add (Gemma 3).
    pub post_norms: bool,
    /// Sliding-window attention (Gemma 3: five local layers to one global).
    pub sliding_window: Option<u32>,
    /// A mixture of experts in place of the FFN of every layer (`n_ff` is then only the dense
    /// size the metadata states, as real conversions write it; Gemma 4 runs a dense FFN of that
    /// size beside the experts).
    pub moe: Option<MoeShape>,
    /// Gated DeltaNet layers between the full-attention ones (Qwen 3.5); the full-attention
    /// layers then have a query gate (the Q projection gives `2 * head_dim` rows per head).
    pub linear: Option<LinearShape>,
    /// Rotated elements per head when fewer than the head size (Qwen 3.5: a quarter).
    pub rope_dims: Option<usize>,
    /// `rope.dimension_sections` of a multi-section rope (Qwen 3.5's interleaved one).
    pub rope_sections: Option<[u32; 4]>,
    /// Gemma 4's layout.
    pub gemma4: Option<Gemma4Shape>,
}

/// The named shapes, in the order `--help` lists them.
pub const SHAPE_NAMES: [&str; 11] = [
    "llama3-8b",
    "llama3.2-1b",
    "smollm2-135m",
    "qwen2-0.5b",
    "qwen3-0.6b",
    "gemma3-270m",
    "qwen3-30b-a3b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "gemma4-26b-a4b",
    "gemma4-e2b",
];

/// Qwen 3.5's linear-attention layers in both published sizes here: 16 key heads of 128, a
/// 4-tap convolution, one full-attention layer in four (the value heads differ).
const fn qwen35_linear(n_v_heads: usize) -> LinearShape {
    LinearShape {
        conv_kernel: 4,
        n_k_heads: 16,
        n_v_heads,
        head_dim: 128,
        full_attention_interval: 4,
    }
}

/// The `mrope_section` of Qwen 3.5's configs, with the fourth section llama.cpp's converter
/// adds.
const QWEN35_ROPE_SECTIONS: [u32; 4] = [11, 11, 10, 0];

/// Llama 3.1 8B and Llama 3.2 1B share this scaling (factor 8 and 32 respectively).
const fn llama3_scaling(factor: f32) -> Llama3RopeScaling {
    Llama3RopeScaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    }
}

impl Shape {
    /// The shape called `name` (one of [`SHAPE_NAMES`]).
    pub fn named(name: &str) -> Option<Shape> {
        let llama = Shape {
            name: name.to_string(),
            architecture: "llama",
            tokenizer: TokenizerStyle::Llama3,
            n_vocab: 128_256,
            n_embd: 4096,
            n_layer: 32,
            n_head: 32,
            n_head_kv: 8,
            head_dim: 128,
            n_ff: 14_336,
            n_ctx_train: 131_072,
            rms_eps: 1e-5,
            rope_freq_base: 500_000.0,
            rope_scaling: Some(llama3_scaling(8.0)),
            tied_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            sliding_window: None,
            moe: None,
            linear: None,
            rope_dims: None,
            rope_sections: None,
            gemma4: None,
        };
        let shape = match name {
            // Meta Llama 3.1 8B (config.json of meta-llama/Llama-3.1-8B).
            "llama3-8b" => llama,
            // Meta Llama 3.2 1B: tied embeddings, head size 64.
            "llama3.2-1b" => Shape {
                n_embd: 2048,
                n_layer: 16,
                head_dim: 64,
                n_ff: 8192,
                rope_scaling: Some(llama3_scaling(32.0)),
                tied_embeddings: true,
                ..llama
            },
            // HuggingFaceTB SmolLM2-135M (as in the pinned GGUF's metadata).
            "smollm2-135m" => Shape {
                tokenizer: TokenizerStyle::SmolLm2,
                n_vocab: 49_152,
                n_embd: 576,
                n_layer: 30,
                n_head: 9,
                n_head_kv: 3,
                head_dim: 64,
                n_ff: 1536,
                n_ctx_train: 8192,
                rope_freq_base: 100_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                ..llama
            },
            // Qwen2.5-0.5B: biases on Q, K and V, tied embeddings.
            "qwen2-0.5b" => Shape {
                architecture: "qwen2",
                tokenizer: TokenizerStyle::Qwen,
                n_vocab: 151_936,
                n_embd: 896,
                n_layer: 24,
                n_head: 14,
                n_head_kv: 2,
                head_dim: 64,
                n_ff: 4864,
                n_ctx_train: 32_768,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                qkv_bias: true,
                ..llama
            },
            // Qwen3-0.6B: QK-norm, head size 128 (not n_embd / n_head), tied embeddings.
            "qwen3-0.6b" => Shape {
                architecture: "qwen3",
                tokenizer: TokenizerStyle::Qwen,
                n_vocab: 151_936,
                n_embd: 1024,
                n_layer: 28,
                n_head: 16,
                n_head_kv: 8,
                head_dim: 128,
                n_ff: 3072,
                n_ctx_train: 40_960,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                qk_norm: true,
                ..llama
            },
            // Gemma 3 270M, numbers from the metadata of gemma-3-270m-q4_k_m.gguf.
            "gemma3-270m" => Shape {
                architecture: "gemma3",
                tokenizer: TokenizerStyle::Gemma,
                n_vocab: 262_144,
                n_embd: 640,
                n_layer: 18,
                n_head: 4,
                n_head_kv: 1,
                head_dim: 256,
                n_ff: 2048,
                n_ctx_train: 32_768,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                qk_norm: true,
                post_norms: true,
                sliding_window: Some(512),
                ..llama
            },
            // Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): Qwen3's attention, 128 experts
            // of 768 rows in every layer, 8 used per token (normalised top-k weights), no shared
            // expert, untied embeddings; `n_ff` is its `intermediate_size`, which the converter
            // writes as `feed_forward_length`.
            "qwen3-30b-a3b" => Shape {
                architecture: "qwen3moe",
                tokenizer: TokenizerStyle::Qwen,
                n_vocab: 151_936,
                n_embd: 2048,
                n_layer: 48,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                n_ff: 6144,
                n_ctx_train: 40_960,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: false,
                qk_norm: true,
                moe: Some(MoeShape {
                    n_expert: 128,
                    n_expert_used: 8,
                    n_ff_expert: 768,
                    n_ff_shared: None,
                }),
                ..llama
            },
            // Qwen3.5-27B (the text config of Qwen/Qwen3.5-27B's config.json, as
            // conversion/qwen.py's Qwen3_5TextModel writes it): 64 layers, three of four Gated
            // DeltaNet (16 key heads and 48 value heads of 128, a 4-tap convolution), the
            // fourth gated full attention (24 heads, 4 KV heads of 256, QK-norm, rope on a
            // quarter of each head with interleaved sections [11, 11, 10], base 1e7), a dense
            // FFN of 17408, untied embeddings over 248320 tokens.
            "qwen3.5-27b" => Shape {
                architecture: "qwen35",
                tokenizer: TokenizerStyle::Qwen,
                n_vocab: 248_320,
                n_embd: 5120,
                n_layer: 64,
                n_head: 24,
                n_head_kv: 4,
                head_dim: 256,
                n_ff: 17_408,
                n_ctx_train: 262_144,
                rms_eps: 1e-6,
                rope_freq_base: 10_000_000.0,
                rope_scaling: None,
                tied_embeddings: false,
                qk_norm: true,
                linear: Some(qwen35_linear(48)),
                rope_dims: Some(64),
                rope_sections: Some(QWEN35_ROPE_SECTIONS),
                ..llama
            },
            // Qwen3.5-35B-A3B (the text config of Qwen/Qwen3.5-35B-A3B's config.json, as
            // conversion/qwen.py's Qwen3_5MoeTextModel writes it): 40 layers, three of four
            // Gated DeltaNet (16 key heads and 32 value heads of 128), the fourth gated full
            // attention (16 heads, 2 KV heads of 256); in every layer 256 experts of 512 rows,
            // 8 used per token, plus a shared expert of 512 rows gated per token.
            "qwen3.5-35b-a3b" => Shape {
                architecture: "qwen35moe",
                tokenizer: TokenizerStyle::Qwen,
                n_vocab: 248_320,
                n_embd: 2048,
                n_layer: 40,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                n_ff: 512,
                n_ctx_train: 262_144,
                rms_eps: 1e-6,
                rope_freq_base: 10_000_000.0,
                rope_scaling: None,
                tied_embeddings: false,
                qk_norm: true,
                moe: Some(MoeShape {
                    n_expert: 256,
                    n_expert_used: 8,
                    n_ff_expert: 512,
                    n_ff_shared: Some(512),
                }),
                linear: Some(qwen35_linear(32)),
                rope_dims: Some(64),
                rope_sections: Some(QWEN35_ROPE_SECTIONS),
                ..llama
            },
            // Gemma 4 26B-A4B (the text config of google/gemma-4-26B-A4B-it, as llama.cpp's
            // converter `conversion/gemma.py` maps it; the numbers as published, not checked
            // against the file here, which cannot be fetched): 30 layers in groups of five
            // sliding (head 256, 8 KV heads, window 1024, rope base 10000) and one global (head
            // 512, 2 KV heads, K used as V, proportional rope on a quarter of the head, base
            // 1e6); 128 experts of 704 rows, 8 used, beside a dense GeGLU FFN of 2112 rows in
            // every layer; tied embeddings, logit soft-cap 30.
            "gemma4-26b-a4b" => Shape {
                architecture: "gemma4",
                tokenizer: TokenizerStyle::Gemma,
                n_vocab: 262_144,
                n_embd: 2816,
                n_layer: 30,
                n_head: 16,
                n_head_kv: 8,
                head_dim: 256,
                n_ff: 2112,
                n_ctx_train: 262_144,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                qk_norm: true,
                post_norms: true,
                sliding_window: Some(1024),
                moe: Some(MoeShape {
                    n_expert: 128,
                    n_expert_used: 8,
                    n_ff_expert: 704,
                    n_ff_shared: None,
                }),
                gemma4: Some(Gemma4Shape {
                    swa_period: 6,
                    head_dim_global: 512,
                    n_head_kv_global: 2,
                    rope_freq_base_swa: 10_000.0,
                    partial_rotary_global: 0.25,
                    k_eq_v_global: true,
                    n_kv_shared_layers: 0,
                    n_embd_per_layer: 0,
                    double_wide_shared_ffn: false,
                    final_logit_softcap: 30.0,
                }),
                ..llama
            },
            // Gemma 4 E2B (the text config of google/gemma-4-E2B-it, as above): 35 layers in
            // groups of four sliding (head 256, window 512) and one global (head 512), one KV
            // head everywhere; the last 20 layers reuse the caches of layers 13 (sliding) and 14
            // (global) and have an FFN of twice the 6144 rows; per-layer token embeddings of
            // 256 per layer; tied embeddings, logit soft-cap 30.
            "gemma4-e2b" => Shape {
                architecture: "gemma4",
                tokenizer: TokenizerStyle::Gemma,
                n_vocab: 262_144,
                n_embd: 1536,
                n_layer: 35,
                n_head: 8,
                n_head_kv: 1,
                head_dim: 256,
                n_ff: 6144,
                n_ctx_train: 131_072,
                rms_eps: 1e-6,
                rope_freq_base: 1_000_000.0,
                rope_scaling: None,
                tied_embeddings: true,
                qk_norm: true,
                post_norms: true,
                sliding_window: Some(512),
                gemma4: Some(Gemma4Shape {
                    swa_period: 5,
                    head_dim_global: 512,
                    n_head_kv_global: 1,
                    rope_freq_base_swa: 10_000.0,
                    partial_rotary_global: 0.25,
                    k_eq_v_global: false,
                    n_kv_shared_layers: 20,
                    n_embd_per_layer: 256,
                    double_wide_shared_ffn: true,
                    final_logit_softcap: 30.0,
                }),
                ..llama
            },
            _ => return None,
        };
        Some(shape)
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Head size of layer `il` (Gemma 4's global layers differ).
    pub fn layer_head_dim(&self, il: usize) -> usize {
        match self.gemma4 {
            Some(g) if !g.is_sliding(il) => g.head_dim_global,
            _ => self.head_dim,
        }
    }

    /// KV heads of layer `il`.
    pub fn layer_n_head_kv(&self, il: usize) -> usize {
        match self.gemma4 {
            Some(g) if !g.is_sliding(il) => g.n_head_kv_global,
            _ => self.n_head_kv,
        }
    }

    /// Dense FFN rows of layer `il`.
    pub fn layer_n_ff(&self, il: usize) -> usize {
        match self.gemma4 {
            Some(g) if g.double_wide_shared_ffn && !self.layer_has_kv(il) => 2 * self.n_ff,
            _ => self.n_ff,
        }
    }

    /// Whether layer `il` has K and V of its own (Gemma 4's last layers reuse earlier ones').
    pub fn layer_has_kv(&self, il: usize) -> bool {
        match self.gemma4 {
            Some(g) => il + g.n_kv_shared_layers < self.n_layer,
            None => true,
        }
    }

    /// Width of the concatenated key (and value) heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Rows of the Q projection: twice the query width when full-attention layers have a
    /// query gate (hybrid shapes).
    pub fn q_rows(&self) -> usize {
        if self.linear.is_some() {
            2 * self.q_dim()
        } else {
            self.q_dim()
        }
    }

    /// Parameters of the tensors the model file holds.
    pub fn n_params(&self) -> u64 {
        if let Some(g) = self.gemma4 {
            return self.n_params_gemma4(&g);
        }
        let (e, ff) = (self.n_embd as u64, self.n_ff as u64);
        let (q, kv) = (self.q_dim() as u64, self.kv_dim() as u64);
        let ffn = match self.moe {
            // The router (one row per expert) and every expert's three projections, plus the
            // shared expert and its one-row gate.
            Some(m) => {
                let n_expert = m.n_expert as u64;
                let shared = m.n_ff_shared.map_or(0, |s| 3 * e * s as u64 + e);
                e * n_expert + 3 * e * m.n_ff_expert as u64 * n_expert + shared
            }
            None => 3 * e * ff,
        };
        let mut attention = e * self.q_rows() as u64 + 2 * e * kv + q * e;
        if self.qkv_bias {
            attention += q + 2 * kv;
        }
        if self.qk_norm {
            attention += 2 * self.head_dim as u64;
        }
        let mut per_layer = ffn + 2 * e;
        if self.post_norms {
            per_layer += 2 * e;
        }
        let mut total = 0;
        for il in 0..self.n_layer {
            total += per_layer;
            total += match self.linear {
                Some(l) if l.is_linear(il) => {
                    let (ch, vd, nv) = (
                        l.conv_channels() as u64,
                        l.value_dim() as u64,
                        l.n_v_heads as u64,
                    );
                    // qkv, z, beta, alpha, the convolution, dt bias, A, the norm, the output.
                    e * ch
                        + e * vd
                        + 2 * e * nv
                        + l.conv_kernel as u64 * ch
                        + 2 * nv
                        + l.head_dim as u64
                        + vd * e
                }
                _ => attention,
            };
        }
        let embeddings = e * self.n_vocab as u64 * if self.tied_embeddings { 1 } else { 2 };
        embeddings + e + total
    }

    fn n_params_gemma4(&self, g: &Gemma4Shape) -> u64 {
        let e = self.n_embd as u64;
        let (n_layer, width) = (self.n_layer as u64, g.n_embd_per_layer as u64);
        let mut total = e * self.n_vocab as u64 * if self.tied_embeddings { 1 } else { 2 } + e;
        if (0..self.n_layer).any(|il| !g.is_sliding(il)) {
            total += g.head_dim_global as u64 / 2;
        }
        if width > 0 {
            total += width * n_layer * self.n_vocab as u64 + e * width * n_layer + width;
        }
        for il in 0..self.n_layer {
            let hd = self.layer_head_dim(il) as u64;
            let (q, kv) = (
                self.n_head as u64 * hd,
                self.layer_n_head_kv(il) as u64 * hd,
            );
            let ff = self.layer_n_ff(il) as u64;
            // Norms: attention, post-attention, FFN, post-FFN, Q.
            total += 4 * e + hd + 2 * e * q + 3 * e * ff;
            if self.layer_has_kv(il) {
                let v = if g.k_eq_v_global && !g.is_sliding(il) {
                    0
                } else {
                    e * kv
                };
                total += e * kv + v + hd;
            }
            if let Some(m) = self.moe {
                let n_expert = m.n_expert as u64;
                // Router, its input scale, three norms, the experts and their output scales.
                total += e * n_expert + e + 3 * e;
                total += 3 * e * m.n_ff_expert as u64 * n_expert + n_expert;
            }
            if width > 0 {
                total += 2 * e * width + e;
            }
            // The layer's output scale.
            total += 1;
        }
        total
    }
}

/// Changes to a named shape: a smaller model of the same family (fewer layers, a smaller
/// vocabulary, narrower layers, fewer experts) for tests that need the architecture, not the
/// size. The flags of `ember-synth`; [`ShapeOverrides::to_args`] writes them back.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ShapeOverrides {
    /// Use this many layers instead of the shape's.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Use this many tokens instead of the shape's vocabulary size (at least 256 plus the
    /// special tokens).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Use this embedding width instead of the shape's.
    #[arg(long)]
    pub embd: Option<usize>,
    /// Use this many attention heads instead of the shape's.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Use this many KV heads instead of the shape's (a divisor of the heads).
    #[arg(long = "kv-heads")]
    pub kv_heads: Option<usize>,
    /// Use this head size instead of the shape's.
    #[arg(long = "head-dim")]
    pub head_dim: Option<usize>,
    /// Use this dense FFN size instead of the shape's.
    #[arg(long)]
    pub ff: Option<usize>,
    /// Use this many experts per layer instead of the shape's (mixture-of-experts shapes).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Route each token to this many experts instead of the shape's.
    #[arg(long = "experts-used")]
    pub experts_used: Option<usize>,
    /// Use this many rows for each expert's gate and up projections instead of the shape's.
    #[arg(long = "expert-ff")]
    pub expert_ff: Option<usize>,
    /// Use this many rows for the shared expert's gate and up projections (shapes with one).
    #[arg(long = "shared-ff")]
    pub shared_ff: Option<usize>,
    /// Use this many query and key heads in the linear-attention layers (hybrid shapes).
    #[arg(long = "linear-k-heads")]
    pub linear_k_heads: Option<usize>,
    /// Use this many value heads in the linear-attention layers (a multiple of the key heads).
    #[arg(long = "linear-v-heads")]
    pub linear_v_heads: Option<usize>,
    /// Use this head size in the linear-attention layers.
    #[arg(long = "linear-head-dim")]
    pub linear_head_dim: Option<usize>,
    /// Use this sliding window instead of the shape's (sliding-window shapes).
    #[arg(long)]
    pub window: Option<usize>,
    /// Use this head size on global layers instead of the shape's (Gemma 4).
    #[arg(long = "global-head-dim")]
    pub global_head_dim: Option<usize>,
    /// Use this many KV heads on global layers instead of the shape's (Gemma 4).
    #[arg(long = "global-kv-heads")]
    pub global_kv_heads: Option<usize>,
    /// Let this many last layers reuse earlier layers' caches instead of the shape's (Gemma 4).
    #[arg(long = "shared-kv-layers")]
    pub shared_kv_layers: Option<usize>,
    /// Use this per-layer embedding width instead of the shape's (Gemma 4; 0 for none).
    #[arg(long = "per-layer-embd")]
    pub per_layer_embd: Option<usize>,
}

impl ShapeOverrides {
    /// Applies the overrides to `shape`, checking that the result is still a consistent shape.
    pub fn apply(&self, shape: &mut Shape) -> Result<(), SynthError> {
        let bad = |reason: String| SynthError::BadShape {
            shape: shape.name.clone(),
            reason,
        };
        if shape.moe.is_none()
            && (self.experts.is_some() || self.experts_used.is_some() || self.expert_ff.is_some())
        {
            return Err(bad(
                "--experts, --experts-used and --expert-ff apply to mixture-of-experts shapes only"
                    .into(),
            ));
        }
        if self.shared_ff.is_some() && shape.moe.and_then(|m| m.n_ff_shared).is_none() {
            return Err(bad(
                "--shared-ff applies to shapes with a shared expert only".into(),
            ));
        }
        if shape.linear.is_none()
            && (self.linear_k_heads.is_some()
                || self.linear_v_heads.is_some()
                || self.linear_head_dim.is_some())
        {
            return Err(bad(
                "--linear-k-heads, --linear-v-heads and --linear-head-dim apply to hybrid shapes only"
                    .into(),
            ));
        }
        if shape.sliding_window.is_none() && self.window.is_some() {
            return Err(bad("--window applies to sliding-window shapes only".into()));
        }
        if shape.gemma4.is_none()
            && (self.global_head_dim.is_some()
                || self.global_kv_heads.is_some()
                || self.shared_kv_layers.is_some()
                || self.per_layer_embd.is_some())
        {
            return Err(bad(
                "--global-head-dim, --global-kv-heads, --shared-kv-layers and --per-layer-embd apply to Gemma 4 shapes only"
                    .into(),
            ));
        }
        let mut s = shape.clone();
        let set = |field: &mut usize, value: Option<usize>| {
            if let Some(v) = value {
                *field = v;
            }
        };
        set(&mut s.n_layer, self.layers);
        set(&mut s.n_vocab, self.vocab);
        set(&mut s.n_embd, self.embd);
        set(&mut s.n_head, self.heads);
        set(&mut s.n_head_kv, self.kv_heads);
        set(&mut s.head_dim, self.head_dim);
        set(&mut s.n_ff, self.ff);
        if let Some(m) = &mut s.moe {
            set(&mut m.n_expert, self.experts);
            set(&mut m.n_expert_used, self.experts_used);
            set(&mut m.n_ff_expert, self.expert_ff);
            if let (Some(shared), Some(v)) = (&mut m.n_ff_shared, self.shared_ff) {
                *shared = v;
            }
        }
        if let Some(l) = &mut s.linear {
            set(&mut l.n_k_heads, self.linear_k_heads);
            set(&mut l.n_v_heads, self.linear_v_heads);
            set(&mut l.head_dim, self.linear_head_dim);
        }
        if let (Some(dims), Some(_)) = (&mut s.rope_dims, self.head_dim) {
            // A narrower head keeps the shape's rotated fraction (a quarter for Qwen 3.5).
            *dims = (*dims * s.head_dim / shape.head_dim).max(2) & !1;
        }
        if let (Some(w), Some(window)) = (self.window, &mut s.sliding_window) {
            *window = w as u32;
        }
        if let Some(g) = &mut s.gemma4 {
            set(&mut g.head_dim_global, self.global_head_dim);
            set(&mut g.n_head_kv_global, self.global_kv_heads);
            set(&mut g.n_kv_shared_layers, self.shared_kv_layers);
            set(&mut g.n_embd_per_layer, self.per_layer_embd);
        }
        if s.n_head_kv == 0 || !s.n_head.is_multiple_of(s.n_head_kv) {
            return Err(bad(format!(
                "{} KV heads do not divide {} heads",
                s.n_head_kv, s.n_head
            )));
        }
        if !s.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head size {} is odd", s.head_dim)));
        }
        if let Some(l) = s.linear {
            if l.n_k_heads == 0 || l.n_v_heads == 0 || !l.n_v_heads.is_multiple_of(l.n_k_heads) {
                return Err(bad(format!(
                    "{} linear-attention value heads are not a multiple of {} key heads",
                    l.n_v_heads, l.n_k_heads
                )));
            }
            if l.head_dim == 0 {
                return Err(bad("linear-attention head size 0".into()));
            }
        }
        if let Some(g) = s.gemma4 {
            if g.n_head_kv_global == 0 || !s.n_head.is_multiple_of(g.n_head_kv_global) {
                return Err(bad(format!(
                    "{} global KV heads do not divide {} heads",
                    g.n_head_kv_global, s.n_head
                )));
            }
            if !g.head_dim_global.is_multiple_of(2) {
                return Err(bad(format!(
                    "global head size {} is odd",
                    g.head_dim_global
                )));
            }
            if g.n_kv_shared_layers > 0 {
                // llama.cpp's rule: sliding layers reuse layer n_kv - 2, global ones n_kv - 1,
                // so those two must be a sliding and a global layer.
                let n_kv = s.n_layer.saturating_sub(g.n_kv_shared_layers);
                if n_kv < 2 || !g.is_sliding(n_kv - 2) || g.is_sliding(n_kv - 1) {
                    return Err(bad(format!(
                        "{} shared KV layers of {}: the last two layers with a cache must be a sliding and a global one",
                        g.n_kv_shared_layers, s.n_layer
                    )));
                }
            }
        }
        if let Some(m) = s.moe {
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
                return Err(bad(format!(
                    "{} experts used of {}: expected from 1 to the expert count",
                    m.n_expert_used, m.n_expert
                )));
            }
        }
        *shape = s;
        Ok(())
    }

    /// The `ember-synth` flags that give these overrides, in a fixed order.
    pub fn to_args(&self) -> Vec<String> {
        [
            ("--layers", self.layers),
            ("--vocab", self.vocab),
            ("--embd", self.embd),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
            ("--ff", self.ff),
            ("--experts", self.experts),
            ("--experts-used", self.experts_used),
            ("--expert-ff", self.expert_ff),
            ("--shared-ff", self.shared_ff),
            ("--linear-k-heads", self.linear_k_heads),
            ("--linear-v-heads", self.linear_v_heads),
            ("--linear-head-dim", self.linear_head_dim),
            ("--window", self.window),
            ("--global-head-dim", self.global_head_dim),
            ("--global-kv-heads", self.global_kv_heads),
            ("--shared-kv-layers", self.shared_kv_layers),
            ("--per-layer-embd", self.per_layer_embd),
        ]
        .into_iter()
        .filter_map(|(flag, v)| v.map(|v| [flag.to_string(), v.to_string()]))
        .flatten()
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_shrink_a_shape_and_refuse_inconsistent_ones() {
        let overrides = ShapeOverrides {
            layers: Some(3),
            embd: Some(128),
            heads: Some(8),
            kv_heads: Some(1),
            expert_ff: Some(32),
            ..ShapeOverrides::default()
        };
        let mut s = Shape::named("qwen3-30b-a3b").unwrap();
        overrides.apply(&mut s).unwrap();
        assert_eq!((s.n_layer, s.n_embd, s.n_head, s.n_head_kv), (3, 128, 8, 1));
        assert_eq!(
            s.moe,
            Some(MoeShape {
                n_expert: 128,
                n_expert_used: 8,
                n_ff_expert: 32,
                n_ff_shared: None,
            })
        );
        assert_eq!(
            overrides.to_args().join(" "),
            "--layers 3 --embd 128 --heads 8 --kv-heads 1 --expert-ff 32"
        );
        let mut dense = Shape::named("qwen3-0.6b").unwrap();
        let e = ShapeOverrides {
            experts: Some(4),
            ..ShapeOverrides::default()
        }
        .apply(&mut dense)
        .unwrap_err();
        assert!(
            e.to_string().contains("mixture-of-experts shapes only"),
            "{e}"
        );
        let e = ShapeOverrides {
            heads: Some(6),
            kv_heads: Some(4),
            ..ShapeOverrides::default()
        }
        .apply(&mut dense)
        .unwrap_err();
        assert!(
            e.to_string().contains("4 KV heads do not divide 6 heads"),
            "{e}"
        );
        assert_eq!(
            dense,
            Shape::named("qwen3-0.6b").unwrap(),
            "unchanged on error"
        );
    }

    #[test]
    fn every_name_has_a_consistent_shape() {
        for name in SHAPE_NAMES {
            let s = Shape::named(name).unwrap();
            assert_eq!(s.name, name);
            assert_eq!(s.n_head % s.n_head_kv, 0, "{name}");
            assert_eq!(s.head_dim % 2, 0, "{name}");
            if let Some(m) = s.moe {
                assert!(m.n_expert_used <= m.n_expert, "{name}");
            }
        }
        assert!(Shape::named("llama3-70b").is_none());
    }

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        // Llama 3.1 8B: 8.03 B parameters; Llama 3.2 1B: 1.24 B; SmolLM2: 134.5 M.
        let billions = |n: &str| Shape::named(n).unwrap().n_params() as f64 / 1e9;
        assert!((billions("llama3-8b") - 8.03).abs() < 0.01);
        assert!((billions("llama3.2-1b") - 1.236).abs() < 0.01);
        assert!((billions("smollm2-135m") - 0.1345).abs() < 0.001);
        // Qwen3-30B-A3B: 30.5 B parameters in all.
        assert!((billions("qwen3-30b-a3b") - 30.53).abs() < 0.01);
        // Qwen3.5-27B and Qwen3.5-35B-A3B without their vision towers and MTP blocks (which
        // the synthetic files leave out): about 26.9 B and 34.7 B.
        assert!(
            (billions("qwen3.5-27b") - 26.9).abs() < 0.1,
            "{}",
            billions("qwen3.5-27b")
        );
        assert!(
            (billions("qwen3.5-35b-a3b") - 34.7).abs() < 0.1,
            "{}",
            billions("qwen3.5-35b-a3b")
        );
    }

    #[test]
    fn llama3_scaling_leaves_high_frequencies_and_divides_low_ones() {
        let d = llama3_scaling(8.0).freq_divisors(128, 500_000.0);
        assert_eq!(d.len(), 64);
        assert_eq!(d[0], 1.0);
        assert_eq!(d[63], 8.0);
        assert!(d.windows(2).all(|w| w[0] <= w[1]), "{d:?}");
        assert!(
            d.iter().any(|&x| x > 1.0 && x < 8.0),
            "a blended band exists"
        );
    }
}
