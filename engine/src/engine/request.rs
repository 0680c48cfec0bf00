//! What a caller hands the engine (a [`GenerateRequest`]) and what comes back on the request's
//! stream ([`Event`]s), with the reasons a request is refused at the door ([`SubmitError`]).

use std::time::Duration;

use crate::sample::{SamplerParams, SamplingError};

/// One generation request: a tokenized prompt and how to continue it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids, as the model reads them (BOS and chat template already applied).
    pub prompt: Vec<u32>,
    /// Most tokens to generate; `None` generates until an end-of-generation token, a stop string
    /// or the end of the context.
    pub max_tokens: Option<usize>,
    /// The sampler chain's parameters; a temperature of 0 is greedy decoding.
    pub sampling: SamplerParams,
    /// Texts that end generation when they appear in the output; the matched text and anything
    /// after it are never sent.
    pub stop: Vec<String>,
    /// `Some(n)`: every generated token carries its log-probability and the `n` most likely
    /// alternatives (at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Keep generating past end-of-generation tokens (they are then ordinary tokens).
    pub ignore_eos: bool,
    /// Send the end-of-generation token that ends the request in a last `Tokens` event (with no
    /// text), for callers that record every token the model chose (`ember run --format json`).
    /// It is never counted in `Usage::completion_tokens`.
    pub report_eog: bool,
}

/// Most alternatives per token that `logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl GenerateRequest {
    /// A greedy request for `max_tokens` tokens after `prompt`.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens: Some(max_tokens),
            sampling: SamplerParams::greedy(),
            stop: Vec::new(),
            logprobs: None,
            ignore_eos: false,
            report_eog: false,
        }
    }
}

/// A token the engine generated, with what was asked about it.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// The token id.
    pub id: u32,
    /// The bytes the token decodes to (a UTF-8 character may span several tokens).
    pub bytes: Vec<u8>,
    /// Its log-probability under the model's distribution (before penalties and temperature),
    /// when logprobs were asked for.
    pub logprob: Option<f64>,
    /// The most likely tokens at this step with their bytes and log-probabilities, most likely
    /// first, when logprobs were asked for.
    pub top: Vec<TopLogprob>,
}

/// One alternative of [`GeneratedToken::top`].
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    pub bytes: Vec<u8>,
    pub logprob: f64,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string (OpenAI's `stop`).
    Stop,
    /// `max_tokens` tokens were generated (OpenAI's `length`).
    Length,
    /// The sequence filled the context (reported as `length` to OpenAI clients).
    ContextFull,
    /// The caller cancelled it (a client went away, or the server drained).
    Cancelled,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull | FinishReason::Cancelled => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (stop strings' tokens included, the end-of-generation token not).
    pub completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: usize,
}

/// Where a request's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// From submission to the first step that worked on it.
    pub queued: Duration,
    /// From submission to the first generated token.
    pub time_to_first_token: Duration,
    /// From submission to the end.
    pub total: Duration,
    /// Times the request was preempted (its KV freed and its tokens computed again later).
    pub preemptions: u32,
}

/// What a request's stream yields, in order: zero or more `Tokens`, then one `Done` or one
/// `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly generated tokens and the text they release. `text` can be shorter than the tokens'
    /// bytes: text that could be the start of a stop string, or an incomplete UTF-8 character,
    /// is held back until it is decided.
    Tokens {
        text: String,
        tokens: Vec<GeneratedToken>,
    },
    /// The request ended normally (or was cancelled).
    Done {
        finish_reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    /// The request failed on its own (a device failure that retrying alone did not cure, or the
    /// engine stopping); other requests are not affected.
    Failed { message: String },
}

/// Why a request was not accepted. Each maps to an HTTP status in the server.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt has no tokens.
    #[error("the prompt is empty: expected at least one token")]
    EmptyPrompt,
    /// A prompt token is not in the vocabulary.
    #[error("prompt token {token} at index {index} is out of range: expected less than {n_vocab}")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        n_vocab: usize,
    },
    /// The prompt (plus at least one generated token) does not fit in the context.
    #[error(
        "the prompt has {prompt_tokens} tokens: expected fewer than the context of {n_ctx} tokens"
    )]
    PromptTooLong { prompt_tokens: usize, n_ctx: usize },
    /// The request needs more KV blocks than the whole cache has, so it could never run.
    #[error("the request needs {needed_blocks} KV blocks of {block_size} tokens ({needed_tokens} tokens), the cache has {total_blocks} blocks in all")]
    NeverFits {
        needed_tokens: usize,
        needed_blocks: usize,
        block_size: usize,
        total_blocks: usize,
    },
    /// A sampling parameter is out of its range ([`SamplerParams::validate`]).
    #[error(transparent)]
    InvalidSampling(#[from] SamplingError),
    /// `logprobs` asks for more alternatives than allowed.
    #[error("top_logprobs {found}: expected at most {max}")]
    TooManyLogprobs { found: usize, max: usize },
    /// The waiting queue is full.
    #[error("the server is busy: {waiting} requests are waiting (at most {max_queue}) behind {running} running ones")]
    QueueFull {
        waiting: usize,
        running: usize,
        max_queue: usize,
    },
    /// The engine is draining before shutdown and admits nothing new.
    #[error("the server is shutting down and admits no new requests")]
    Draining,
    /// The engine thread has stopped.
    #[error("the engine has stopped: {reason}")]
    Stopped { reason: String },
}
