//! `POST /v1/completions`: a text prompt (tokenized exactly as `ember run -p` does, so greedy
//! output matches it) or a list of token ids (evaluated as given), answered whole or as SSE
//! chunks (`text_completion` objects), with the legacy logprobs format (`tokens`,
//! `token_logprobs`, `top_logprobs` as token-to-logprob maps, `text_offset`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::generation::{
    self, logprob_value, token_text, usage_json, Collected, ResponseMeta, StreamFormat,
};
use super::openai::{self, Prompt};
use super::{body, random_u64, response_id, unix_now, AppState};
use crate::engine::{GeneratedToken, Usage};

/// The legacy logprobs object for `tokens`, whose text starts `offset` characters into the
/// completion; returns it and the offset after them.
fn legacy_logprobs(tokens: &[GeneratedToken], mut offset: usize) -> (Value, usize) {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut logprobs = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    for token in tokens {
        let text = token_text(&token.bytes);
        offsets.push(offset);
        offset += text.chars().count();
        texts.push(text);
        logprobs.push(token.logprob.map(logprob_value));
        let mut top = Map::new();
        for alternative in &token.top {
            // Two ids with the same text keep the likelier one (the list is most likely first).
            top.entry(token_text(&alternative.bytes))
                .or_insert_with(|| json!(logprob_value(alternative.logprob)));
        }
        tops.push(Value::Object(top));
    }
    (
        json!({
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }),
        offset,
    )
}

/// The `text_completion` object of a finished request; with `prompt_ids`, the token ids too
/// (vLLM's `return_token_ids` layout: `prompt_token_ids` and `token_ids` in the choice).
fn completion_json(
    meta: &ResponseMeta,
    collected: &Collected,
    logprobs: bool,
    prompt_ids: Option<&[u32]>,
) -> Value {
    let mut value = json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{
            "index": 0,
            "text": collected.text,
            "logprobs": if logprobs { legacy_logprobs(&collected.tokens, 0).0 } else { Value::Null },
            "finish_reason": collected.finish_reason.openai(),
        }],
        "usage": usage_json(&collected.usage),
    });
    if let Some(prompt_ids) = prompt_ids {
        value["choices"][0]["prompt_token_ids"] = json!(prompt_ids);
        value["choices"][0]["token_ids"] =
            json!(collected.tokens.iter().map(|t| t.id).collect::<Vec<_>>());
    }
    value
}

/// Streamed `text_completion` chunks.
struct CompletionChunks {
    meta: ResponseMeta,
    logprobs: bool,
    include_usage: bool,
    /// Characters of token text sent so far (for `text_offset`).
    offset: usize,
    /// With `return_token_ids`: the prompt's ids, until the first chunk has carried them;
    /// chunks carry their tokens' ids.
    prompt_ids: Option<Vec<u32>>,
    return_token_ids: bool,
}

impl CompletionChunks {
    fn chunk(&self, text: &str, logprobs: Value, finish_reason: Option<&str>) -> Value {
        let mut chunk = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl StreamFormat for CompletionChunks {
    fn opening(&mut self) -> Option<Value> {
        None
    }

    fn tokens(&mut self, text: &str, tokens: &[GeneratedToken]) -> Option<Value> {
        let per_token = self.logprobs || self.return_token_ids;
        if text.is_empty() && (!per_token || tokens.is_empty()) {
            return None;
        }
        let logprobs = if self.logprobs {
            let (value, offset) = legacy_logprobs(tokens, self.offset);
            self.offset = offset;
            value
        } else {
            Value::Null
        };
        let mut chunk = self.chunk(text, logprobs, None);
        if self.return_token_ids {
            if let Some(prompt_ids) = self.prompt_ids.take() {
                chunk["choices"][0]["prompt_token_ids"] = json!(prompt_ids);
            }
            chunk["choices"][0]["token_ids"] =
                json!(tokens.iter().map(|t| t.id).collect::<Vec<_>>());
        }
        Some(chunk)
    }

    fn finish(&mut self, finish_reason: &'static str) -> Value {
        self.chunk("", Value::Null, Some(finish_reason))
    }

    fn usage(&mut self, usage: &Usage) -> Value {
        json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "choices": [],
            "usage": usage_json(usage),
        })
    }
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request_body: Body,
) -> Result<Response, ApiError> {
    let json = body::read_json(&headers, request_body, state.config.max_body_bytes).await?;
    let request = openai::parse_completion(&json)?;
    let engine = state.engine()?.clone();
    let model = state.model_for(request.common.model.as_deref())?;
    let prompt = match request.prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(text) => {
            // Tokenizing a long text takes a while: off the async workers, as in chat.
            let tokenizer = Arc::clone(engine.tokenizer());
            tokio::task::spawn_blocking(move || crate::chat::plain_prompt_ids(&tokenizer, &text))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?
        }
    };
    let stream_response = request.common.stream;
    let include_usage = request.common.include_usage;
    let logprobs = request.logprobs.is_some();
    let return_token_ids = request.common.return_token_ids;
    let prompt_ids = return_token_ids.then(|| prompt.clone());
    let generate = request
        .common
        .into_generate(prompt, request.logprobs, random_u64());
    let stream = engine
        .submit(generate)
        .map_err(|e| ApiError::from_submit(e, "prompt", "logprobs"))?;
    let meta = ResponseMeta {
        id: response_id("cmpl"),
        created: unix_now(),
        model,
        system_fingerprint: state.fingerprint.clone(),
    };
    if stream_response {
        let format = CompletionChunks {
            meta,
            logprobs,
            include_usage,
            offset: 0,
            prompt_ids,
            return_token_ids,
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
    use crate::engine::TopLogprob;

    fn token(text: &str, logprob: f64, top: &[(&str, f64)]) -> GeneratedToken {
        GeneratedToken {
            id: 1,
            bytes: text.as_bytes().to_vec(),
            logprob: Some(logprob),
            top: top
                .iter()
                .map(|&(t, lp)| TopLogprob {
                    id: 2,
                    bytes: t.as_bytes().to_vec(),
                    logprob: lp,
                })
                .collect(),
        }
    }

    #[test]
    fn legacy_format() {
        let tokens = [
            token(" Paris", -0.1, &[(" Paris", -0.1), (" Lyon", -3.0)]),
            token("é", -0.5, &[("é", -0.5), ("é", -9.0)]),
        ];
        let (value, end) = legacy_logprobs(&tokens, 3);
        assert_eq!(value["tokens"], json!([" Paris", "é"]));
        assert_eq!(value["token_logprobs"][0], json!(-0.1));
        assert_eq!(value["top_logprobs"][0][" Lyon"], json!(-3.0));
        assert_eq!(value["top_logprobs"][1], json!({"é": -0.5}));
        assert_eq!(value["text_offset"], json!([3, 9]));
        assert_eq!(end, 10);
    }

    #[test]
    fn streamed_offsets_continue() {
        let mut chunks = CompletionChunks {
            meta: ResponseMeta {
                id: "cmpl-1".into(),
                created: 1,
                model: "m".into(),
                system_fingerprint: "fp".into(),
            },
            logprobs: true,
            include_usage: false,
            offset: 0,
            prompt_ids: Some(vec![7, 8]),
            return_token_ids: true,
        };
        assert!(chunks.opening().is_none());
        let first = chunks.tokens("ab", &[token("ab", -1.0, &[])]).unwrap();
        assert_eq!(first["choices"][0]["logprobs"]["text_offset"], json!([0]));
        assert_eq!(first["choices"][0]["prompt_token_ids"], json!([7, 8]));
        assert_eq!(first["choices"][0]["token_ids"], json!([1]));
        assert!(!first.as_object().unwrap().contains_key("usage"));
        let second = chunks.tokens("c", &[token("c", -1.0, &[])]).unwrap();
        assert_eq!(second["choices"][0]["logprobs"]["text_offset"], json!([2]));
        assert!(second["choices"][0].get("prompt_token_ids").is_none());
        assert_eq!(chunks.finish("stop")["choices"][0]["finish_reason"], "stop");
    }
}
