//! `/health` and `/metrics`: answered from the engine's published snapshot and the pool sample,
//! never by asking the engine thread, so they answer while a step hangs (and `/health` then says
//! so: 503 with how long since the last step, how long the current one has run, and what it
//! holds).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::metrics::CONTENT_TYPE;
use super::AppState;
use crate::engine::Health;

/// `GET /health`: 200 `{"status":"ok"}` only when the engine loop is alive and making progress;
/// 503 with `loading`, `draining`, `stalled` (with details) or `stopped` otherwise.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    let Some(engine) = state.served.engine.get() else {
        return (unavailable, Json(json!({"status": "loading"}))).into_response();
    };
    match engine.health() {
        Health::Stopped { reason } => (
            unavailable,
            Json(json!({"status": "stopped", "reason": reason})),
        )
            .into_response(),
        _ if state.is_draining() => (
            unavailable,
            Json(json!({"status": "draining", "in_flight": engine.in_flight()})),
        )
            .into_response(),
        Health::Ok => Json(json!({"status": "ok"})).into_response(),
        Health::Stalled {
            since_last_step,
            step_running_for,
            running,
            waiting,
        } => {
            let watchdog = engine.config().watchdog.as_secs_f64();
            let reason = match step_running_for {
                Some(step) => format!(
                    "the engine step running now has taken {:.1} s (watchdog {watchdog} s)",
                    step.as_secs_f64()
                ),
                None => format!(
                    "work is pending and no engine step has finished for {:.1} s (watchdog {watchdog} s)",
                    since_last_step.as_secs_f64()
                ),
            };
            (
                unavailable,
                Json(json!({
                    "status": "stalled",
                    "reason": reason,
                    "seconds_since_last_step": since_last_step.as_secs_f64(),
                    "step_running_seconds": step_running_for.map(|d| d.as_secs_f64()),
                    "running_requests": running,
                    "waiting_requests": waiting,
                })),
            )
                .into_response()
        }
    }
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}
