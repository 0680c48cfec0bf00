//! Shared by the integration tests: where the reference models are, and loading their tokenizers
//! once per test binary.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ember_tokenizer::{ChatTemplate, Tokenizer};

pub const SMOLLM: &str = "smollm2-135m-instruct-q4_1";
pub const GEMMA: &str = "gemma3-270m-q4_k_m";

/// The model cache: `EMBER_MODELS_DIR`, else `~/.cache/ember/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("ember").join("models")
}

/// The GGUF file of a golden model name.
pub fn model_file(model: &str) -> &'static str {
    match model {
        SMOLLM => "SmolLM2-135M-Instruct.Q4_1.gguf",
        GEMMA => "gemma-3-270m-q4_k_m.gguf",
        other => {
            panic!("golden data names an unknown model {other:?}: expected {SMOLLM} or {GEMMA}")
        }
    }
}

pub struct Loaded {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
}

fn load(model: &str) -> Loaded {
    let path = models_dir().join(model_file(model));
    if !path.is_file() {
        panic!(
            "reference model {} is missing: fetch it with `cargo run -p ember -- pull` \
             (or point EMBER_MODELS_DIR at a folder holding it)",
            path.display()
        );
    }
    let gguf = ember_gguf::Gguf::open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .unwrap_or_else(|e| panic!("cannot load the tokenizer of {}: {e}", path.display()));
    let template = ChatTemplate::from_gguf(&gguf)
        .unwrap_or_else(|e| panic!("cannot load the chat template of {}: {e}", path.display()));
    Loaded {
        tokenizer,
        template,
    }
}

/// The tokenizer (and chat template) of a golden model, loaded once.
pub fn model(model: &str) -> &'static Loaded {
    static SMOLLM_MODEL: OnceLock<Loaded> = OnceLock::new();
    static GEMMA_MODEL: OnceLock<Loaded> = OnceLock::new();
    match model {
        SMOLLM => SMOLLM_MODEL.get_or_init(|| load(SMOLLM)),
        GEMMA => GEMMA_MODEL.get_or_init(|| load(GEMMA)),
        other => panic!("unknown model {other:?}"),
    }
}

/// `tests/data/golden/NAME` of the workspace.
pub fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/golden")
        .join(name)
}
