//! ember: a GGUF LLM inference engine.
//!
//! The crate is laid out the way data flows through it:
//! - [`models`]: the project's pinned model list, the model cache and `ember pull`.
//! - [`hub`]: GGUF models from the Hugging Face hub into the huggingface_hub cache.
//! - [`model`]: architecture registry, hyperparameters, weights and the batched forward pass.
//! - [`ops`]: plain descriptions shared by the model, the KV cache and the backends (a leaf).
//! - [`backend`]: the ops the model is written in, with the CPU implementation.
//! - [`kv_cache`]: the paged KV cache (block tables, block pool).
//! - [`recurrent_state`]: per-sequence recurrent states of hybrid (linear-attention) models.
//! - [`batch`]: a batch of tokens from several sequences.
//! - [`sample`]: turning logits into tokens.
//! - [`generate`]: prompt evaluation and generation loops shared by the CLI and tests.
//! - [`device`]: device choices (`cpu`, `cuda:N`, `hip:N`, GPU layers) and where a model goes.
//! - [`doctor`]: the `ember doctor` preflight checks, over a system view tests can fake.
//! - [`load`]: resolving, opening and placing a model, reporting progress as events.
//! - [`chat`]: chat templates and conversations rendered into prompt token ids.
//!
//! The `ember` command line (the binary's `cli` module) only parses flags and prints.

pub mod backend;
pub mod batch;
pub mod build_manifest;
pub mod chat;
pub mod device;
pub mod doctor;
pub mod engine;
pub mod generate;
pub mod hub;
pub mod kl_divergence;
pub mod kv_cache;
pub mod limits;
pub mod load;
pub mod load_plan;
pub mod model;
pub mod models;
pub mod ops;
pub mod peer_report;
pub mod recurrent_state;
pub mod sample;
pub mod server;
