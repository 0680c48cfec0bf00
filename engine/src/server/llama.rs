//! `GET /v1/models` (OpenAI) and llama-server's `/props`, `/slots` (read-only), `/tokenize` and
//! `/detokenize`, with the field names llama-server uses so its clients and scripts work.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::openai::{shown, Fields};
use super::{body, AppState};
use crate::engine::Engine;

/// An `f32` setting as JSON, written as its shortest decimal (0.05, not 0.05000000074505806).
fn setting(value: f32) -> Value {
    value
        .to_string()
        .parse::<f64>()
        .map_or(Value::Null, |v| json!(v))
}

/// The `model` object of `/v1/models`, with llama-server's `meta` details.
fn model_json(state: &AppState, engine: &Engine, id: &str) -> Value {
    let info = engine.model_info();
    json!({
        "id": id,
        "object": "model",
        "created": state.ready_at.load(std::sync::atomic::Ordering::Acquire),
        "owned_by": "ember",
        "meta": {
            "architecture": info.architecture,
            "general_name": info.general_name,
            "n_vocab": info.n_vocab,
            "n_ctx_train": info.n_ctx_train,
            "n_ctx": engine.config().n_ctx,
            "n_embd": info.n_embd,
            "n_layer": info.n_layer,
            "size": info.file_bytes,
            "backend": info.backend,
        },
    })
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let engine = state.loaded_engine()?;
    let id = state.model_for(None)?;
    Ok(Json(json!({
        "object": "list",
        "data": [model_json(&state, engine, &id)],
    })))
}

/// `GET /v1/models/{model}`: the model by any of its accepted names, else 404.
pub async fn model(
    State(state): State<Arc<AppState>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    // axum's own rejection (a name that is not UTF-8 once decoded) would be plain text.
    let Path(name) =
        name.map_err(|e| ApiError::invalid("model", format!("model: {}", e.body_text())))?;
    let engine = state.loaded_engine()?;
    state.model_for(Some(&name))?;
    let id = state.model_for(None)?;
    Ok(Json(model_json(&state, engine, &id)))
}

/// `GET /props`: the server's settings, as llama-server reports them.
pub async fn props(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let engine = state.loaded_engine()?;
    let config = engine.config();
    let info = engine.model_info();
    let defaults = crate::sample::SamplerParams::default();
    Ok(Json(json!({
        "default_generation_settings": {
            "n_ctx": config.n_ctx,
            "params": {
                "n_predict": -1,
                "temperature": setting(defaults.temperature),
                "top_k": defaults.top_k,
                "top_p": setting(defaults.top_p),
                "min_p": setting(defaults.min_p),
                "presence_penalty": setting(defaults.presence_penalty),
                "frequency_penalty": setting(defaults.frequency_penalty),
                "repeat_penalty": setting(defaults.repeat_penalty),
                "repeat_last_n": defaults.penalty_last_n,
            },
        },
        "total_slots": config.parallel,
        "max_queue": config.max_queue,
        "n_ctx": config.n_ctx,
        "kv_capacity_tokens": config.kv_capacity_tokens,
        "kv_block_size": config.kv_block_size,
        "ubatch": config.ubatch,
        "prefix_cache": config.prefix_cache,
        "watchdog_seconds": config.watchdog.as_secs_f64(),
        "n_vocab": info.n_vocab,
        "model_path": info.path.display().to_string(),
        "model_alias": state.model_for(None)?,
        "architecture": info.architecture,
        "backend": info.backend,
        "chat_template": info.chat_template.clone().unwrap_or_default(),
        "modalities": {"vision": false, "audio": false},
        "build_info": state.fingerprint,
    })))
}

/// `GET /slots`: what each running slot does, from the snapshot (llama-server's field names);
/// idle slots up to `--parallel` follow the busy ones.
pub async fn slots(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let engine = state.loaded_engine()?;
    let config = engine.config();
    let snapshot = engine.snapshot();
    let mut slots: Vec<Value> = snapshot
        .running
        .iter()
        .enumerate()
        .map(|(index, slot)| {
            json!({
                "id": index,
                "id_task": slot.request_id,
                "n_ctx": config.n_ctx,
                "is_processing": true,
                "n_prompt_tokens": slot.n_prompt,
                "n_prompt_tokens_processed": slot.n_prompt_done,
                "n_decoded": slot.n_generated,
                "n_predict": slot.max_tokens.map_or(-1, |n| n as i64),
                "age_ms": slot.age.as_millis() as u64,
            })
        })
        .collect();
    for index in slots.len()..config.parallel {
        slots.push(json!({
            "id": index,
            "id_task": -1,
            "n_ctx": config.n_ctx,
            "is_processing": false,
        }));
    }
    Ok(Json(Value::Array(slots)))
}

/// `POST /tokenize`: `{"content", "add_special" (false), "parse_special" (true), "with_pieces"
/// (false)}` → `{"tokens": [...]}`, with pieces `[{"id", "piece"}]` (a string when the piece is
/// whole UTF-8, else its bytes).
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request_body: Body,
) -> Result<Json<Value>, ApiError> {
    let json = body::read_json(&headers, request_body, state.config.max_body_bytes).await?;
    let fields = Fields::root(&json)?;
    let Some(content) = fields.string("content")? else {
        return Err(ApiError::invalid(
            "content",
            "content: expected the text to tokenize, found nothing",
        ));
    };
    let add_special = fields.bool("add_special")?.unwrap_or(false);
    let parse_special = fields.bool("parse_special")?.unwrap_or(true);
    let with_pieces = fields.bool("with_pieces")?.unwrap_or(false);
    let engine = state.loaded_engine()?;
    let tokenizer = Arc::clone(engine.tokenizer());
    let content = content.to_string();
    let tokens = tokio::task::spawn_blocking(move || {
        let ids = tokenizer.encode(&content, add_special, parse_special);
        if !with_pieces {
            return json!(ids);
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let bytes = tokenizer.token_to_piece(id, true);
                let piece = match String::from_utf8(bytes) {
                    Ok(text) => json!(text),
                    Err(e) => json!(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect();
        Value::Array(pieces)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?;
    Ok(Json(json!({ "tokens": tokens })))
}

/// `POST /detokenize`: `{"tokens": [...]}` → `{"content": "..."}` (special tokens rendered).
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request_body: Body,
) -> Result<Json<Value>, ApiError> {
    let json = body::read_json(&headers, request_body, state.config.max_body_bytes).await?;
    let fields = Fields::root(&json)?;
    let engine = state.loaded_engine()?;
    let n_vocab = engine.tokenizer().vocab_size();
    let items: &[Value] = match fields.get("tokens") {
        None => &[],
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid(
                "tokens",
                format!(
                    "tokens: expected a list of token ids, found {}",
                    shown(other)
                ),
            ))
        }
    };
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item.as_u64() {
            Some(id) if (id as usize) < n_vocab => ids.push(id as u32),
            _ => {
                let param = format!("tokens[{i}]");
                return Err(ApiError::invalid(
                    &param,
                    format!(
                        "{param}: expected a token id below the vocabulary size {n_vocab}, found {}",
                        shown(item)
                    ),
                ));
            }
        }
    }
    let tokenizer = Arc::clone(engine.tokenizer());
    let content = tokio::task::spawn_blocking(move || tokenizer.decode(&ids, true))
        .await
        .map_err(|e| ApiError::internal(format!("detokenizing failed: {e}")))?;
    Ok(Json(json!({ "content": content })))
}
