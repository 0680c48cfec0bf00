//! ember: GGUF inference engine.
