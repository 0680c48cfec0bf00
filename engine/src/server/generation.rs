//! Driving one request's [`RequestStream`] for a response, shared by chat and text completions:
//! collecting it whole (non-streaming), or turning it into server-sent events that end with
//! `data: [DONE]`.
//!
//! Cancellation follows ownership: the stream lives in the handler's future (non-streaming) or in
//! the SSE body (streaming). When the client goes away, hyper drops that future or body, the
//! stream is dropped with it, and the engine cancels the request within one step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::error::ApiError;
use super::AppState;
use crate::engine::{Event, FinishReason, GeneratedToken, RequestStream, Usage};

/// How often an idle SSE stream (a request still queued, or reading a long prompt) sends a
/// comment line, so that proxies keep the connection and a client that left is noticed.
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// What the response objects carry besides the generated text.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
}

/// A finished request, collected.
#[derive(Debug, Clone)]
pub struct Collected {
    pub text: String,
    pub tokens: Vec<GeneratedToken>,
    pub finish_reason: FinishReason,
    pub usage: Usage,
}

/// Reads a request's stream to its end.
pub async fn collect(state: &AppState, mut stream: RequestStream) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match stream.recv().await {
            Some(Event::Tokens {
                text: piece,
                tokens: generated,
            }) => {
                text.push_str(&piece);
                tokens.extend(generated);
            }
            Some(Event::Done {
                finish_reason,
                usage,
                timings,
            }) => {
                state.metrics.observe_done(finish_reason, &usage, &timings);
                return Ok(Collected {
                    text,
                    tokens,
                    finish_reason,
                    usage,
                });
            }
            Some(Event::Failed { message }) => {
                return Err(ApiError::internal(format!("generation failed: {message}")))
            }
            None => {
                return Err(ApiError::internal(
                    "the engine ended the request without finishing it",
                ))
            }
        }
    }
}

/// OpenAI's `usage` object.
pub fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

/// A log-probability as JSON. JSON has no infinities; OpenAI reports tokens the model rules out
/// as -9999.
pub fn logprob_value(logprob: f64) -> f64 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// A token's text for logprobs output (bytes that are not whole UTF-8 become U+FFFD; the
/// `bytes` field carries them exactly).
pub fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// How one kind of response turns engine events into SSE chunks.
pub trait StreamFormat: Send + 'static {
    /// A chunk sent before any token (chat's `role` delta), if the format has one.
    fn opening(&mut self) -> Option<Value>;
    /// The chunk for newly generated tokens and the text they released; `None` when there is
    /// nothing to send (no text released and no logprobs asked for).
    fn tokens(&mut self, text: &str, tokens: &[GeneratedToken]) -> Option<Value>;
    /// The chunk carrying `finish_reason`.
    fn finish(&mut self, finish_reason: &'static str) -> Value;
    /// The last chunk with `include_usage`: empty choices and the usage.
    fn usage(&mut self, usage: &Usage) -> Value;
}

struct SseState<F> {
    app: Arc<AppState>,
    stream: RequestStream,
    format: F,
    include_usage: bool,
    pending: VecDeque<SseEvent>,
    opened: bool,
    ended: bool,
}

fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

fn done_marker() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

impl<F: StreamFormat> SseState<F> {
    /// Reads the next engine event and queues the chunks it makes.
    async fn advance(&mut self) {
        if !self.opened {
            self.opened = true;
            if let Some(chunk) = self.format.opening() {
                self.pending.push_back(data(&chunk));
                return;
            }
        }
        match self.stream.recv().await {
            Some(Event::Tokens { text, tokens }) => {
                if let Some(chunk) = self.format.tokens(&text, &tokens) {
                    self.pending.push_back(data(&chunk));
                }
            }
            Some(Event::Done {
                finish_reason,
                usage,
                timings,
            }) => {
                self.app
                    .metrics
                    .observe_done(finish_reason, &usage, &timings);
                self.pending
                    .push_back(data(&self.format.finish(finish_reason.openai())));
                if self.include_usage {
                    self.pending.push_back(data(&self.format.usage(&usage)));
                }
                self.pending.push_back(done_marker());
                self.ended = true;
            }
            Some(Event::Failed { message }) => {
                let error = ApiError::internal(format!("generation failed: {message}"));
                self.pending.push_back(data(&error.body()));
                self.pending.push_back(done_marker());
                self.ended = true;
            }
            None => {
                let error = ApiError::internal("the engine ended the request without finishing it");
                self.pending.push_back(data(&error.body()));
                self.pending.push_back(done_marker());
                self.ended = true;
            }
        }
    }
}

/// A streaming response over `stream`. The body owns the stream: when hyper drops the body (the
/// client went away), the request is cancelled.
pub fn sse_response<F: StreamFormat>(
    app: Arc<AppState>,
    stream: RequestStream,
    format: F,
    include_usage: bool,
) -> Response {
    let state = SseState {
        app,
        stream,
        format,
        include_usage,
        pending: VecDeque::new(),
        opened: false,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event), state));
            }
            if state.ended {
                return None;
            }
            state.advance().await;
        }
    });
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
        .into_response();
    // Proxies such as nginx buffer responses unless told not to; tokens must arrive as made.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_has_totals_and_cached_tokens() {
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 4,
            cached_tokens: 8,
        };
        assert_eq!(
            usage_json(&usage),
            json!({
                "prompt_tokens": 10,
                "completion_tokens": 4,
                "total_tokens": 14,
                "prompt_tokens_details": {"cached_tokens": 8},
            })
        );
    }

    #[test]
    fn logprobs_stay_finite() {
        assert_eq!(logprob_value(-0.5), -0.5);
        assert_eq!(logprob_value(f64::NEG_INFINITY), -9999.0);
        assert_eq!(logprob_value(f64::NAN), -9999.0);
        assert_eq!(token_text(&[0x68, 0x69]), "hi");
        assert_eq!(token_text(&[0xe2, 0x82]), "\u{fffd}");
    }
}
