//! The error type of this crate: why a tokenizer or chat template could not be built from a file,
//! and why a chat template could not be rendered.

/// Why a tokenizer could not be loaded or a chat template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type.
    #[error("tokenizer metadata: {0}")]
    Metadata(#[from] ember_gguf::GgufError),

    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error(
        "unsupported tokenizer model {model:?} in tokenizer.ggml.model: expected \"gpt2\" (byte-level BPE) or \"llama\" (SentencePiece)"
    )]
    UnsupportedModel { model: String },

    /// `tokenizer.ggml.tokens` is empty.
    #[error("tokenizer.ggml.tokens is empty: expected at least one token")]
    EmptyVocabulary,

    /// More tokens than a u32 id can address.
    #[error("tokenizer.ggml.tokens has {n_tokens} tokens: expected at most 4294967295")]
    VocabularyTooLarge { n_tokens: usize },

    /// A per-token array whose length differs from the token list's.
    #[error("{key} has {len} entries but tokenizer.ggml.tokens has {n_tokens}: expected the same length")]
    LengthMismatch {
        key: &'static str,
        len: usize,
        n_tokens: usize,
    },

    /// Two tokens with the same text.
    #[error("duplicate token {text:?} in tokenizer.ggml.tokens at ids {first} and {second}: expected unique token texts")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },

    /// A special token id (BOS, EOS, ...) outside the vocabulary.
    #[error(
        "{name} token id {id} is out of range: expected an id below the vocabulary size {n_tokens}"
    )]
    SpecialIdOutOfRange {
        name: &'static str,
        id: u32,
        n_tokens: usize,
    },

    /// `add_bos_token` or `add_eos_token` is set but the token it asks for is not defined.
    #[error("{flag} is true but the vocabulary has no {name} token: expected {id_key} to be set")]
    MissingSpecialToken {
        flag: &'static str,
        name: &'static str,
        id_key: &'static str,
    },

    /// A BPE vocabulary without merges.
    #[error(
        "tokenizer.ggml.merges is missing: expected the merge list of a \"gpt2\" (BPE) tokenizer"
    )]
    MissingMerges,

    /// A pre-tokenizer regex failed to compile (a bug in this crate's pattern table).
    #[error("{0}")]
    PreTokenizer(String),

    /// A chat template larger than [`crate::chat::MAX_TEMPLATE_BYTES`], refused before it is
    /// compiled.
    #[error("chat template is {size} bytes: expected at most {max}")]
    TemplateTooLarge { size: usize, max: usize },

    /// A chat template that does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),

    /// A chat template that failed while rendering, including `raise_exception` calls, exhausted
    /// fuel (a template that loops without end) and output over the size limit.
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
}
