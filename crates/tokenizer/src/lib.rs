//! Tokenizers and chat templates from GGUF metadata.
//!
//! [`Tokenizer`] turns text into token ids and back for the two vocabulary kinds GGUF models
//! ship: byte-level BPE (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen, SmolLM, Mistral Nemo,
//! ...) and SentencePiece BPE with byte fallback (`"llama"`: Llama 2, Gemma, ...). Token ids
//! match llama.cpp's exactly, since that is what GGUF models are used and checked with; the
//! golden test in `tests/` compares them on the project's reference models.
//!
//! [`ChatTemplate`] renders a conversation into a prompt with the model's Jinja template, and
//! [`StreamDecoder`] turns generated ids into text as they arrive without splitting characters.
//!
//! Layout: `vocab` (tokens, special tokens, the special-token partition), `pretokenize` (BPE
//! pre-tokenizer regexes), `bpe` and `spm` (the two merge algorithms), `unicode` (category
//! tables), `tokenizer` (the public type), `chat` (templates).

mod bpe;
mod budget;
mod chat;
mod error;
mod pretokenize;
mod spm;
mod tokenizer;
mod unicode;
mod vocab;

pub use budget::RenderBudgetAllocator;
pub use chat::{
    ChatMessage, ChatTemplate, DEFAULT_FUEL, MAX_TEMPLATE_BYTES, RENDER_MEMORY_BYTES,
    RENDER_TIME_LIMIT,
};
pub use error::TokenizerError;
pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerKind, TokenizerSpec};
