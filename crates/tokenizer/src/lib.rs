//! Tokenizers from GGUF metadata.
