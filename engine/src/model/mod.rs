//! Models: architecture registry, hyperparameters, weights, and the batched forward pass.
//!
//! Data flows GGUF file -> [`HParams`] (typed metadata) + [`Weights`] (checked tensors placed on a
//! [`Backend`]) -> [`Model::forward`], which takes a [`Batch`] of tokens from any number of
//! sequences and a [`Context`] (the paged KV cache and scratch buffers of one model instance) and
//! returns the logits of the requested tokens.

mod arch;
mod forward;
mod gemma4;
#[cfg(test)]
mod gemma4_tests;
mod hparams;
#[cfg(test)]
mod tests;
mod weights;

use std::path::Path;
use std::sync::Arc;

use ember_gguf::{Gguf, GgufError};

pub use arch::{Architecture, FfnActivation, MoeRules, Presence};
pub use forward::Context;
pub use hparams::{HParams, LayerShape, LinearAttention, MoeParams, RopeScaling};
pub use weights::{
    AttentionWeights, FfnWeights, Gemma4Kv, Gemma4LayerWeights, Gemma4Moe, Gemma4PerLayer,
    Gemma4PerLayerInput, LayerWeights, LinearAttentionWeights, MixerWeights, MoeWeights,
    SharedExpertWeights, Weights,
};

use crate::backend::{Backend, BackendError, OpFailure};
use crate::batch::Batch;
use crate::kv_cache::{KvError, DEFAULT_BLOCK_SIZE};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not a readable GGUF, or a metadata lookup failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names an architecture without model code.
    #[error("unknown architecture {found:?}: expected one of {supported}")]
    UnknownArchitecture { found: String, supported: String },
    /// The file is a multimodal projector (`general.architecture = clip`, an `--mmproj` file of
    /// llama.cpp), not a language model.
    #[error("general.architecture is \"clip\": this file is a multimodal projector (mmproj), not a language model; {MULTIMODAL_UNSUPPORTED}")]
    MultimodalProjector,
    /// A hyperparameter is out of range or inconsistent.
    #[error("metadata key {key}: expected {expected}, found {found}")]
    BadHyperparameter {
        key: String,
        expected: String,
        found: String,
    },
    /// A required tensor is absent.
    #[error("tensor {name} is missing: expected a tensor of dims {expected}")]
    MissingTensor { name: String, expected: String },
    /// A tensor has the wrong dims.
    #[error("tensor {name}: expected dims {expected:?}, found {found:?}")]
    WrongShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor has a type without kernels.
    #[error("tensor {name}: type {ty} is not supported: expected one of {supported}")]
    UnsupportedType {
        name: String,
        ty: String,
        supported: String,
    },
    /// The backend refused a tensor.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Why a forward pass could not run. Nothing in the KV cache changes when it fails.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    /// The batch has no tokens.
    #[error("empty batch: expected at least one token")]
    EmptyBatch,
    /// A token id is not in the vocabulary.
    #[error(
        "token id {token} at batch index {index} is out of range: expected less than {n_vocab}"
    )]
    TokenOutOfRange {
        token: u32,
        index: usize,
        n_vocab: usize,
    },
    /// The batch does not fit the KV cache.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// An op failed on the device (out of memory, over the VRAM budget, a driver fault). The
    /// batch's tokens were taken out of the KV cache again; the context stays usable.
    #[error("forward pass failed: {0}")]
    Backend(OpFailure),
}

impl ForwardError {
    /// Whether the pass failed for lack of memory (device memory, the VRAM budget, or KV
    /// blocks), so that the same work in smaller pieces or later may succeed.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            ForwardError::Backend(failure) | ForwardError::Kv(KvError::Memory(failure)) => {
                failure.out_of_memory
            }
            ForwardError::Kv(KvError::OutOfBlocks { .. }) => true,
            _ => false,
        }
    }
}

/// Why a sequence could not be cut back to a shorter length.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TruncateError {
    /// The model keeps a recurrent state per sequence, which holds only the state after the
    /// sequence's last token.
    #[error("sequence {seq_id}: cannot truncate to {len} of its {current} tokens: the model's linear-attention layers keep a recurrent state that cannot be cut back (only truncation to 0, which ends the sequence, is possible)")]
    RecurrentState {
        seq_id: crate::batch::SeqId,
        len: usize,
        current: usize,
    },
}

/// Sizes of a [`Context`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextParams {
    /// Longest sequence, in tokens.
    pub n_ctx: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Tokens of all sequences together the KV pool may hold (rounded up to whole blocks).
    pub kv_capacity_tokens: usize,
}

impl ContextParams {
    /// One sequence of up to `n_ctx` tokens with the default block size.
    pub fn with_ctx(n_ctx: usize) -> Self {
        ContextParams {
            n_ctx,
            kv_block_size: DEFAULT_BLOCK_SIZE,
            kv_capacity_tokens: n_ctx,
        }
    }
}

/// Default context length of the CLI: the training context, capped so a long-context model does
/// not get a block table sized for a million tokens by default (blocks are allocated on demand
/// either way).
pub const DEFAULT_N_CTX: usize = 4096;

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    gguf: Arc<Gguf>,
    hparams: HParams,
    weights: Weights<B>,
    backend: B,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("hparams", &self.hparams)
            .field("backend", &self.backend.name())
            .finish()
    }
}

impl<B: Backend> Model<B> {
    /// Opens `path` and loads the model on `backend`. `progress(done, total)` is called as
    /// tensors are placed.
    pub fn load(
        path: &Path,
        backend: B,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>, ModelError> {
        let gguf = Arc::new(Gguf::open(path)?);
        Model::from_gguf(gguf, backend, progress)
    }

    /// Loads the model described by an opened GGUF file.
    pub fn from_gguf(
        gguf: Arc<Gguf>,
        backend: B,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>, ModelError> {
        let architecture = architecture_of(&gguf)?;
        let hparams = HParams::from_metadata(architecture, gguf.metadata())?;
        let weights = Weights::load(&gguf, &hparams, &backend, progress)?;
        Ok(Model {
            gguf,
            hparams,
            weights,
            backend,
        })
    }

    /// The GGUF file the model was loaded from.
    pub fn gguf(&self) -> &Arc<Gguf> {
        &self.gguf
    }

    /// Hyperparameters.
    pub fn hparams(&self) -> &HParams {
        &self.hparams
    }

    /// Weights.
    pub fn weights(&self) -> &Weights<B> {
        &self.weights
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Vocabulary size (rows of the output projection).
    pub fn n_vocab(&self) -> usize {
        self.weights.n_vocab
    }

    /// A fresh context (empty KV cache) for this model.
    pub fn new_context(&self, params: ContextParams) -> Context<B> {
        Context::new(self, params)
    }

    /// Evaluates `batch` and returns the logits of the tokens that asked for them, `n_vocab`
    /// values per such token in batch order. The batch's tokens are added to the KV cache.
    pub fn forward<'c>(
        &self,
        ctx: &'c mut Context<B>,
        batch: &Batch,
    ) -> Result<&'c [f32], ForwardError> {
        forward::forward(self, ctx, batch, forward::Readout::Logits)?;
        Ok(&ctx.logits)
    }

    /// Evaluates `batch` like [`Model::forward`] but returns, for each token that asked for
    /// output, only its greedy token ([`crate::sample::greedy_token`] of its logits): the
    /// backend takes the arg-max where the logits are, so a device copies back 4 bytes per
    /// sequence instead of the whole vocabulary. The same tokens as greedy sampling of
    /// [`Model::forward`]'s logits.
    pub fn forward_greedy<'c>(
        &self,
        ctx: &'c mut Context<B>,
        batch: &Batch,
    ) -> Result<&'c [u32], ForwardError> {
        forward::forward(self, ctx, batch, forward::Readout::Argmax)?;
        Ok(&ctx.greedy)
    }
}

/// What ember says of multimodal projectors (`--mmproj` files), wherever one turns up.
pub const MULTIMODAL_UNSUPPORTED: &str = "multimodal projectors are not supported yet";

/// The architecture a GGUF file declares, if supported.
pub fn architecture_of(gguf: &Gguf) -> Result<Architecture, ModelError> {
    let name = gguf.architecture()?;
    if name == "clip" {
        return Err(ModelError::MultimodalProjector);
    }
    Architecture::from_name(name).ok_or_else(|| ModelError::UnknownArchitecture {
        found: name.to_string(),
        supported: Architecture::supported_list(),
    })
}
