//! GGML quantization formats.
