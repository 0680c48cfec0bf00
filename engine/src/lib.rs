//! ember: a GGUF LLM inference engine.
//!
//! The crate is laid out the way data flows through it:
//! - [`models`]: the project's pinned model list, the model cache and `ember pull`.
//! - [`model`]: architecture registry, hyperparameters, weights and the batched forward pass.
//! - [`ops`]: plain descriptions shared by the model, the KV cache and the backends (a leaf).
//! - [`backend`]: the ops the model is written in, with the CPU implementation.
//! - [`kv_cache`]: the paged KV cache (block tables, block pool).
//! - [`batch`]: a batch of tokens from several sequences.
//! - [`sample`]: turning logits into tokens.
//! - [`generate`]: prompt evaluation and generation loops shared by the CLI and tests.
//! - [`cli`]: the `ember` command line.

pub mod backend;
pub mod batch;
pub mod build_manifest;
pub mod cli;
pub mod generate;
pub mod kv_cache;
pub mod model;
pub mod models;
pub mod ops;
pub mod sample;
