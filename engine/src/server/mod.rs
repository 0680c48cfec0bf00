//! `ember serve`: an OpenAI-compatible HTTP server (axum on tokio) over the engine core.
//!
//! The server binds and answers before the model is loaded: while loading, `/health` says
//! `loading` and generation routes answer 503 with `Retry-After`; the caller loads the model on a
//! thread of its own and hands the [`Engine`] over with [`ServerHandle::set_engine`]. Requests are
//! checked and mapped here ([`openai`]); scheduling, stop strings, the bounded queue, prompt
//! length checks and cancellation are the engine's, and this module maps its answers to HTTP
//! ([`error`]). Dropping a request's [`crate::engine::RequestStream`] cancels it, so a client that
//! goes away (its handler future or its SSE body dropped by hyper) frees its KV blocks.
//!
//! Routes: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`; `/health` and
//! `/metrics` (served from snapshots, never waiting on the engine thread); llama-server's
//! `/props`, `/slots`, `/tokenize` and `/detokenize`. Every error, axum's own rejections included,
//! is OpenAI's error object.
//!
//! Shutdown is a drain ([`Server::run`]): stop admitting (503), let what runs finish for up to the
//! drain timeout, cancel the rest, then stop the HTTP server.

mod body;
mod chat;
mod completions;
mod error;
mod generation;
mod health;
mod llama;
mod metrics;
mod openai;

use std::future::{Future, IntoFuture};
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use body::DEFAULT_MAX_BODY_BYTES;
pub use error::ApiError;

use crate::engine::Engine;
use metrics::{Metrics, ServedEngine};

/// How long in-flight requests get to end after `cancel_all` at the end of a drain.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// How long the HTTP server gets to send what it has and close its connections at the end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How the server listens and what it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Address or host name to bind.
    pub host: String,
    /// Port; 0 takes any free one ([`Server::local_addr`] tells which).
    pub port: u16,
    /// When set, every route but `/health` and `/metrics` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The model's public name; else the GGUF file name is.
    pub alias: Option<String>,
    /// The model as `-m` named it (a path or a pinned name); accepted as a `model` value.
    pub model_spec: String,
    /// Largest request body read.
    pub max_body_bytes: usize,
    /// How long a drain lets running and queued requests finish before cancelling them.
    pub drain_timeout: Duration,
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("the HTTP server failed: {0}")]
    Serve(std::io::Error),
    #[error("cannot start the device memory sampler thread: {0}")]
    Sampler(std::io::Error),
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainOutcome {
    /// Requests still in flight when the drain timeout ran out (then cancelled); 0 when all
    /// finished in time.
    pub cancelled: usize,
    /// Whether the HTTP server closed its connections within the grace period.
    pub closed_cleanly: bool,
}

/// The names a `model` field may use, and the one responses and `/v1/models` show.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ModelNames {
    /// The alias, else the file name.
    id: String,
    /// The id, the `-m` spelling, the file name and the file stem.
    accepted: Vec<String>,
}

impl ModelNames {
    fn new(alias: Option<&str>, spec: &str, path: &Path) -> ModelNames {
        let file_name = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let stem = path
            .file_stem()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| file_name.clone());
        let id = alias.map_or_else(|| file_name.clone(), str::to_string);
        let mut accepted = vec![id.clone()];
        for name in [spec.to_string(), file_name, stem] {
            if !name.is_empty() && !accepted.contains(&name) {
                accepted.push(name);
            }
        }
        ModelNames { id, accepted }
    }
}

/// State every handler sees.
pub(crate) struct AppState {
    config: ServerConfig,
    served: Arc<ServedEngine>,
    names: OnceLock<ModelNames>,
    /// Unix time the model became ready (`created` of `/v1/models`).
    ready_at: AtomicU64,
    draining: AtomicBool,
    metrics: Metrics,
    fingerprint: String,
}

impl AppState {
    /// The engine for a new request: 503 while loading or draining.
    fn engine(&self) -> Result<&Engine, ApiError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(ApiError::draining());
        }
        self.served.engine.get().ok_or_else(ApiError::loading)
    }

    /// The engine for read-only routes (they answer while draining).
    fn loaded_engine(&self) -> Result<&Engine, ApiError> {
        self.served.engine.get().ok_or_else(ApiError::loading)
    }

    /// Checks a request's `model` against the served names; the name responses carry (the one
    /// asked for, as vLLM does, else the id).
    fn model_for(&self, requested: Option<&str>) -> Result<String, ApiError> {
        let Some(names) = self.names.get() else {
            return Err(ApiError::loading());
        };
        match requested {
            None => Ok(names.id.clone()),
            Some(name) if names.accepted.iter().any(|n| n == name) => Ok(name.to_string()),
            Some(name) => {
                // The -m spelling may be a path on this machine; clients are not told it.
                let public: Vec<String> = names
                    .accepted
                    .iter()
                    .filter(|n| !n.contains(['/', '\\']))
                    .cloned()
                    .collect();
                Err(ApiError::model_not_found(name, &public))
            }
        }
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// Process-wide counter mixed into random draws so that two draws never hash the same input.
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// A random 64-bit number for ids and default seeds: SipHash with the standard library's
/// randomly keyed state over a counter and the clock. Not for secrets.
pub(crate) fn random_u64() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new()
        .hash_one((DRAWS.fetch_add(1, Ordering::Relaxed), nanos))
}

/// A response id: `prefix` and 24 random hex digits (`chatcmpl-...`, `cmpl-...`).
pub(crate) fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}{:08x}", random_u64(), random_u64() as u32)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `system_fingerprint`: the engine version, build target and commit from the build manifest.
fn system_fingerprint() -> String {
    match crate::build_manifest::manifest() {
        Ok(manifest) => {
            let commit = manifest
                .engine
                .commit
                .as_deref()
                .map(|c| c.chars().take(12).collect::<String>())
                .unwrap_or_else(|| "unknown".into());
            let dirty = if manifest.engine.dirty { "-dirty" } else { "" };
            format!(
                "ember-{}-{}-{commit}{dirty}",
                manifest.engine.version, manifest.target
            )
        }
        Err(_) => format!("ember-{}", env!("CARGO_PKG_VERSION")),
    }
}

/// Compares two byte strings in time that depends only on their lengths, so a key cannot be
/// guessed a byte at a time from response times.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    if given.len() != expected.len() {
        return false;
    }
    given
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let Some(given) = given else {
            return ApiError::unauthorized("missing API key: send it as Authorization: Bearer KEY")
                .into_response();
        };
        let token = given
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|_| &given[7..]);
        match token {
            Some(token) if same_secret(token, key.as_bytes()) => {}
            Some(_) => return ApiError::unauthorized("invalid API key").into_response(),
            None => return ApiError::unauthorized(
                "the Authorization header is not a bearer token: send Authorization: Bearer KEY",
            )
            .into_response(),
        }
    }
    next.run(request).await
}

async fn count_requests(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    state.metrics.count_http(&route, response.status().as_u16());
    response
}

async fn route_not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// All routes, with the API key check on every one but `/health` and `/metrics`.
fn router(state: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(llama::models))
        .route("/v1/models/{model}", get(llama::model))
        .route("/props", get(llama::props))
        .route("/slots", get(llama::slots))
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ));
    let public = Router::new()
        .route("/health", get(health::health))
        .route("/metrics", get(health::metrics));
    Router::new()
        .merge(protected)
        .merge(public)
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            count_requests,
        ))
        .with_state(state)
}

/// Hands the loaded engine to a running server.
#[derive(Clone)]
pub struct ServerHandle {
    state: Arc<AppState>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("served", &self.state.served)
            .finish()
    }
}

impl ServerHandle {
    /// Starts serving requests with `engine` (until then, routes answer 503 loading). On a GPU
    /// it also starts the thread that samples device memory for `/metrics`.
    pub fn set_engine(&self, engine: Engine) -> Result<(), ServerError> {
        let state = &self.state;
        let names = ModelNames::new(
            state.config.alias.as_deref(),
            &state.config.model_spec,
            &engine.model_info().path,
        );
        let _ = state.names.set(names);
        if let Some(pool) = engine.pool() {
            let device = gpu_label(&engine.model_info().backend, pool.device());
            metrics::spawn_pool_sampler(Arc::clone(pool), device, Arc::downgrade(&state.served))
                .map_err(ServerError::Sampler)?;
        }
        if state.is_draining() {
            engine.begin_drain();
        }
        state.ready_at.store(unix_now(), Ordering::Release);
        let _ = state.served.engine.set(engine);
        Ok(())
    }

    /// The engine, once set.
    pub fn engine(&self) -> Option<&Engine> {
        self.state.served.engine.get()
    }
}

/// The device label of a GPU for metrics: `cuda:0` / `hip:1` as the backend description starts,
/// else `gpu:N`.
fn gpu_label(backend: &str, ordinal: usize) -> String {
    let first = backend.split_whitespace().next().unwrap_or("");
    let first = first.trim_end_matches([',', ':']);
    let known = ["cuda:", "hip:"]
        .iter()
        .any(|prefix| first.starts_with(prefix));
    if known {
        first.to_string()
    } else {
        format!("gpu:{ordinal}")
    }
}

/// A bound server, not yet serving.
pub struct Server {
    listener: tokio::net::TcpListener,
    local_addr: SocketAddr,
    state: Arc<AppState>,
}

impl Server {
    /// Binds the listening socket (port 0: any free port).
    pub async fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let address = if config.host.contains(':') && !config.host.starts_with('[') {
            format!("[{}]:{}", config.host, config.port)
        } else {
            format!("{}:{}", config.host, config.port)
        };
        let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| ServerError::Bind {
                address: address.clone(),
                source,
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServerError::Bind { address, source })?;
        let served = Arc::new(ServedEngine::default());
        let state = Arc::new(AppState {
            config,
            metrics: Metrics::new(Arc::clone(&served)),
            served,
            names: OnceLock::new(),
            ready_at: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            fingerprint: system_fingerprint(),
        });
        Ok(Server {
            listener,
            local_addr,
            state,
        })
    }

    /// The address it listens on (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A handle for handing over the engine once loaded.
    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            state: Arc::clone(&self.state),
        }
    }

    /// Serves until `drain` completes, then drains: new requests get 503 and `/health` says
    /// `draining`; running and queued requests get up to the drain timeout to finish, then the
    /// rest are cancelled (their streams end with `finish_reason: "length"`); then the HTTP
    /// server stops accepting and closes its connections.
    pub async fn run(
        self,
        drain: impl Future<Output = ()> + Send + 'static,
    ) -> Result<DrainOutcome, ServerError> {
        let state = Arc::clone(&self.state);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serve = axum::serve(self.listener, router(Arc::clone(&state)))
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .into_future();
        let mut serving = tokio::spawn(serve);
        tokio::select! {
            result = &mut serving => {
                return match result {
                    Ok(Ok(())) => Ok(DrainOutcome { cancelled: 0, closed_cleanly: true }),
                    Ok(Err(error)) => Err(ServerError::Serve(error)),
                    Err(join) => Err(ServerError::Serve(std::io::Error::other(join.to_string()))),
                };
            }
            () = drain => {}
        }
        let cancelled = drain_engine(&state).await;
        let _ = stop.send(());
        let closed_cleanly = matches!(
            tokio::time::timeout(SHUTDOWN_GRACE, serving).await,
            Ok(Ok(Ok(())))
        );
        Ok(DrainOutcome {
            cancelled,
            closed_cleanly,
        })
    }
}

/// Stops admitting, waits for in-flight requests up to the drain timeout, cancels the rest;
/// returns how many were cancelled.
async fn drain_engine(state: &AppState) -> usize {
    state.draining.store(true, Ordering::Release);
    let Some(engine) = state.served.engine.get() else {
        return 0;
    };
    engine.begin_drain();
    let deadline = Instant::now() + state.config.drain_timeout;
    while engine.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cancelled = engine.in_flight();
    if cancelled > 0 {
        engine.cancel_all();
        let deadline = Instant::now() + CANCEL_GRACE;
        while engine.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    cancelled
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names() {
        let path = Path::new("/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let names = ModelNames::new(None, "smollm2-135m-instruct-q4_1", path);
        assert_eq!(names.id, "SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(
            names.accepted,
            [
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                "smollm2-135m-instruct-q4_1",
                "SmolLM2-135M-Instruct.Q4_1"
            ]
        );
        let aliased = ModelNames::new(Some("smol"), "/models/x.gguf", Path::new("/models/x.gguf"));
        assert_eq!(aliased.id, "smol");
        assert_eq!(aliased.accepted, ["smol", "/models/x.gguf", "x.gguf", "x"]);
    }

    #[test]
    fn secrets_compare_by_content_and_length() {
        assert!(same_secret(b"key", b"key"));
        assert!(!same_secret(b"kez", b"key"));
        assert!(!same_secret(b"ke", b"key"));
        assert!(!same_secret(b"", b"key"));
    }

    #[test]
    fn ids_are_distinct_and_shaped() {
        let a = response_id("chatcmpl");
        let b = response_id("chatcmpl");
        assert_ne!(a, b);
        assert_eq!(a.len(), "chatcmpl-".len() + 24);
        assert!(a["chatcmpl-".len()..]
            .bytes()
            .all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn gpu_labels() {
        assert_eq!(
            gpu_label("cuda:0 NVIDIA H200 (sm_90), vmm pool", 0),
            "cuda:0"
        );
        assert_eq!(gpu_label("hip:1, gfx1201", 1), "hip:1");
        assert_eq!(gpu_label("cpu, 2 threads", 2), "gpu:2");
    }

    #[test]
    fn fingerprint_names_the_engine() {
        assert!(system_fingerprint().starts_with("ember-"));
    }
}
