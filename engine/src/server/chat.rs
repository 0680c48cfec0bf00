//! `POST /v1/chat/completions`: a conversation rendered through the model's chat template
//! ([`Engine::chat_prompt`](crate::engine::Engine::chat_prompt)), answered whole or as SSE chunks
//! (`chat.completion` / `chat.completion.chunk` objects), with chat-format logprobs
//! (`choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs}`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::generation::{
    self, logprob_value, token_text, usage_json, Collected, ResponseMeta, StreamFormat,
};
use super::{body, openai, random_u64, response_id, unix_now, AppState};
use crate::engine::{GeneratedToken, Usage};

/// An error and its causes, one after another (the chat template's own message is a cause).
pub(crate) fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// One token in the chat logprobs format.
fn token_logprob(token: &GeneratedToken) -> Value {
    let top: Vec<Value> = token
        .top
        .iter()
        .map(|alternative| {
            json!({
                "token": token_text(&alternative.bytes),
                "logprob": logprob_value(alternative.logprob),
                "bytes": alternative.bytes,
            })
        })
        .collect();
    json!({
        "token": token_text(&token.bytes),
        "logprob": token.logprob.map(logprob_value),
        "bytes": token.bytes,
        "top_logprobs": top,
    })
}

fn logprobs_json(tokens: &[GeneratedToken]) -> Value {
    json!({
        "content": tokens.iter().map(token_logprob).collect::<Vec<_>>(),
        "refusal": null,
    })
}

/// The `chat.completion` object of a finished request; with `prompt_ids`, the token ids too
/// (vLLM's `return_token_ids` layout: `prompt_token_ids` beside the choices, `token_ids` in the
/// choice).
fn completion_json(
    meta: &ResponseMeta,
    collected: &Collected,
    logprobs: bool,
    prompt_ids: Option<&[u32]>,
) -> Value {
    let mut value = json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": collected.text, "refusal": null},
            "logprobs": if logprobs { logprobs_json(&collected.tokens) } else { Value::Null },
            "finish_reason": collected.finish_reason.openai(),
        }],
        "usage": usage_json(&collected.usage),
    });
    if let Some(prompt_ids) = prompt_ids {
        value["prompt_token_ids"] = json!(prompt_ids);
        value["choices"][0]["token_ids"] =
            json!(collected.tokens.iter().map(|t| t.id).collect::<Vec<_>>());
    }
    value
}

/// `chat.completion.chunk` objects.
struct ChatChunks {
    meta: ResponseMeta,
    logprobs: bool,
    include_usage: bool,
    /// With `return_token_ids`: the prompt's ids (sent in the first chunk); chunks then carry
    /// their tokens' ids.
    prompt_ids: Option<Vec<u32>>,
}

impl ChatChunks {
    fn chunk(&self, delta: Value, logprobs: Value, finish_reason: Option<&str>) -> Value {
        let mut chunk = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }],
        });
        if self.include_usage {
            // OpenAI sends `usage: null` on every chunk but the last when usage is asked for.
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl StreamFormat for ChatChunks {
    fn opening(&mut self) -> Option<Value> {
        let mut chunk = self.chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            None,
        );
        if let Some(prompt_ids) = &self.prompt_ids {
            chunk["prompt_token_ids"] = json!(prompt_ids);
        }
        Some(chunk)
    }

    fn tokens(&mut self, text: &str, tokens: &[GeneratedToken]) -> Option<Value> {
        let per_token = self.logprobs || self.prompt_ids.is_some();
        if text.is_empty() && (!per_token || tokens.is_empty()) {
            return None;
        }
        let logprobs = if self.logprobs {
            logprobs_json(tokens)
        } else {
            Value::Null
        };
        let mut chunk = self.chunk(json!({"content": text}), logprobs, None);
        if self.prompt_ids.is_some() {
            chunk["choices"][0]["token_ids"] =
                json!(tokens.iter().map(|t| t.id).collect::<Vec<_>>());
        }
        Some(chunk)
    }

    fn finish(&mut self, finish_reason: &'static str) -> Value {
        self.chunk(json!({}), Value::Null, Some(finish_reason))
    }

    fn usage(&mut self, usage: &Usage) -> Value {
        json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "choices": [],
            "usage": usage_json(usage),
        })
    }
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request_body: Body,
) -> Result<Response, ApiError> {
    let json = body::read_json(&headers, request_body, state.config.max_body_bytes).await?;
    let request = openai::parse_chat(&json)?;
    let engine = state.engine()?.clone();
    let model = state.model_for(request.common.model.as_deref())?;
    // Rendering and tokenizing a long conversation takes a while; it runs off the async workers
    // so that /health and /metrics keep answering.
    let messages = request.messages;
    let prompt = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.chat_prompt(&messages))
            .await
            .map_err(|e| ApiError::internal(format!("rendering the conversation failed: {e}")))?
            .map_err(|e| ApiError::invalid("messages", format!("messages: {}", with_causes(&e))))?
    };
    let stream_response = request.common.stream;
    let include_usage = request.common.include_usage;
    let logprobs = request.logprobs.is_some();
    let prompt_ids = request.common.return_token_ids.then(|| prompt.clone());
    let generate = request
        .common
        .into_generate(prompt, request.logprobs, random_u64());
    let stream = engine
        .submit(generate)
        .map_err(|e| ApiError::from_submit(e, "messages", "top_logprobs"))?;
    let meta = ResponseMeta {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model,
        system_fingerprint: state.fingerprint.clone(),
    };
    if stream_response {
        let format = ChatChunks {
            meta,
            logprobs,
            include_usage,
            prompt_ids,
        };
        return Ok(generation::sse_response(
            Arc::clone(&state),
            stream,
            format,
            include_usage,
        ));
    }
    let collected = generation::collect(&state, stream).await?;
    Ok(Json(completion_json(
        &meta,
        &collected,
        logprobs,
        prompt_ids.as_deref(),
    ))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{FinishReason, TopLogprob};

    fn meta() -> ResponseMeta {
        ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            system_fingerprint: "fp".into(),
        }
    }

    fn token() -> GeneratedToken {
        GeneratedToken {
            id: 5,
            bytes: b"Hi".to_vec(),
            logprob: Some(-0.25),
            top: vec![
                TopLogprob {
                    id: 5,
                    bytes: b"Hi".to_vec(),
                    logprob: -0.25,
                },
                TopLogprob {
                    id: 6,
                    bytes: b"Hey".to_vec(),
                    logprob: -2.0,
                },
            ],
        }
    }

    #[test]
    fn completion_object() {
        let collected = Collected {
            text: "Hi".into(),
            tokens: vec![token()],
            finish_reason: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 1,
                cached_tokens: 0,
            },
        };
        let value = completion_json(&meta(), &collected, true, Some(&[1, 2, 3]));
        assert_eq!(value["object"], "chat.completion");
        assert_eq!(value["choices"][0]["message"]["content"], "Hi");
        assert_eq!(value["choices"][0]["finish_reason"], "stop");
        assert_eq!(value["usage"]["total_tokens"], 4);
        let content = &value["choices"][0]["logprobs"]["content"][0];
        assert_eq!(content["token"], "Hi");
        assert_eq!(content["logprob"], -0.25);
        assert_eq!(content["bytes"], json!([72, 105]));
        assert_eq!(content["top_logprobs"][1]["token"], "Hey");
        assert_eq!(value["prompt_token_ids"], json!([1, 2, 3]));
        assert_eq!(value["choices"][0]["token_ids"], json!([5]));
        let without = completion_json(&meta(), &collected, false, None);
        assert_eq!(without["choices"][0]["logprobs"], Value::Null);
        assert!(without.get("prompt_token_ids").is_none());
    }

    #[test]
    fn chunks() {
        let mut chunks = ChatChunks {
            meta: meta(),
            logprobs: false,
            include_usage: true,
            prompt_ids: None,
        };
        let opening = chunks.opening().unwrap();
        assert_eq!(opening["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(opening["usage"], Value::Null);
        assert!(opening.as_object().unwrap().contains_key("usage"));
        assert!(chunks.tokens("", &[token()]).is_none(), "nothing to send");
        let piece = chunks.tokens("Hi", &[token()]).unwrap();
        assert_eq!(piece["choices"][0]["delta"]["content"], "Hi");
        let finish = chunks.finish("length");
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        assert_eq!(finish["choices"][0]["delta"], json!({}));
        let usage = chunks.usage(&Usage::default());
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 0);
    }
}
