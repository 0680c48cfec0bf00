//! Fuzz target: a model-supplied chat template, rendered with fuzzed messages through the same
//! sandboxed path ember uses (its own thread under fuel, a time limit and an output cap, with the
//! ember binary's counting allocator enforcing the memory budget). Rendering must return `Ok` or
//! `Err`, never panic, hang or allocate without bound. The input format is described in
//! `crates/tokenizer/tests/fuzzing/mod.rs`, shared with the stable replay tests.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/tokenizer/tests/fuzzing/mod.rs"]
mod fuzzing;

#[global_allocator]
static ALLOCATOR: ember_tokenizer::RenderBudgetAllocator = ember_tokenizer::RenderBudgetAllocator;

fuzz_target!(|data: &[u8]| fuzzing::chat_template_case(data));
