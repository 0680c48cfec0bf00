//! Fuzz target: a tokenizer built from model-supplied vocabularies and merges (fuzzed
//! `tokenizer.ggml.*` metadata, given directly and, when the input asks, through a GGUF file),
//! then fuzzed text encoded and decoded every way. Building must return `Ok` or `Err`; an accepted
//! tokenizer must give ids inside its vocabulary and decode anything without panicking. The input
//! format is described in `crates/tokenizer/tests/fuzzing/mod.rs`, shared with the stable replay
//! tests.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/tokenizer/tests/fuzzing/mod.rs"]
mod fuzzing;

fuzz_target!(|data: &[u8]| fuzzing::tokenizer_case(data));
