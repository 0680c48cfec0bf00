//! The engine core: one thread owns a loaded model, its KV cache and the scheduler, and is
//! stepped one batch at a time; callers reach it through a cheap, cloneable, non-generic
//! [`Engine`] handle over channels. `ember run`, `ember stress` and `ember serve` all drive it.
//!
//! - [`Engine::submit`] checks a request at the door (prompt length, whether it could ever fit
//!   the KV cache, the bounded queue, draining) and returns a [`RequestStream`] of [`Event`]s.
//!   Dropping the stream cancels the request; the engine frees its KV blocks within one step.
//! - [`Engine::snapshot`] and [`Engine::health`] read state the engine thread publishes after
//!   every step and every idle tick, so they never wait on the engine thread (health stays
//!   truthful while a step hangs: it reports how long the step has run and what it holds).
//! - Scheduling (continuous batching, admission by KV blocks, preemption, the prefix cache) is
//!   in [`scheduler`]; stop strings in [`stop`].

pub mod request;
pub mod scheduler;
pub mod stop;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ember_gpu::DevicePool;
use ember_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

pub use request::{
    Event, FinishReason, GenerateRequest, GeneratedToken, SubmitError, Timings, TopLogprob, Usage,
    MAX_TOP_LOGPROBS,
};

use crate::load::AnyLoaded;

/// How the engine schedules work.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Most sequences running (holding KV blocks and stepping) at once.
    pub parallel: usize,
    /// Most requests waiting for a running slot; beyond it, [`SubmitError::QueueFull`].
    pub max_queue: usize,
    /// Longest sequence (prompt plus generated tokens).
    pub n_ctx: usize,
    /// Tokens of all sequences together that the KV cache may hold (whole blocks; allocated on
    /// demand, so this is a ceiling, not a reservation).
    pub kv_capacity_tokens: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Most tokens in one forward pass: the running sequences' next tokens plus prompt chunks.
    pub ubatch: usize,
    /// Reuse the KV blocks of prompt prefixes seen before.
    pub prefix_cache: bool,
    /// A step that runs longer than this, or pending work with no finished step for this long,
    /// makes [`Engine::health`] report a stall.
    pub watchdog: Duration,
    /// After this long with nothing to do, the engine gives back KV memory (prefix cache
    /// included) and scratch buffers, so device memory returns to the post-load floor.
    pub idle_trim_after: Duration,
    /// Fault injection for tests: step number `n` (1-based) sleeps for the duration first, as a
    /// hung device would. From `EMBER_FAULT_STALL_STEP=N:SECONDS`.
    pub fault_stall: Option<(u64, Duration)>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            parallel: 4,
            max_queue: 64,
            n_ctx: crate::model::DEFAULT_N_CTX,
            kv_capacity_tokens: 4 * crate::model::DEFAULT_N_CTX,
            kv_block_size: crate::kv_cache::DEFAULT_BLOCK_SIZE,
            ubatch: 512,
            prefix_cache: true,
            watchdog: Duration::from_secs(10),
            idle_trim_after: Duration::from_millis(500),
            fault_stall: None,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}: expected {expected}, found {found}")]
    OutOfRange {
        name: &'static str,
        expected: String,
        found: String,
    },
    #[error("{variable}: expected STEP:SECONDS (e.g. 3:15), found {found:?}")]
    BadFaultSpec {
        variable: &'static str,
        found: String,
    },
}

/// The environment variable of [`EngineConfig::fault_stall`].
pub const FAULT_STALL_ENV: &str = "EMBER_FAULT_STALL_STEP";

impl EngineConfig {
    /// Checks the sizes; every error names the setting and the range it accepts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let check = |name: &'static str, value: usize, min: usize, max: usize| {
            if value < min || value > max {
                Err(ConfigError::OutOfRange {
                    name,
                    expected: format!("{min} to {max}"),
                    found: value.to_string(),
                })
            } else {
                Ok(())
            }
        };
        check("parallel", self.parallel, 1, 4096)?;
        check("max_queue", self.max_queue, 0, 1 << 20)?;
        check("n_ctx", self.n_ctx, 2, crate::limits::MAX_N_CTX)?;
        check("kv_block_size", self.kv_block_size, 1, 4096)?;
        check("ubatch", self.ubatch, 1, 1 << 16)?;
        check(
            "kv_capacity_tokens",
            self.kv_capacity_tokens,
            self.kv_block_size,
            1 << 28,
        )?;
        if self.watchdog.is_zero() {
            return Err(ConfigError::OutOfRange {
                name: "watchdog",
                expected: "a positive duration".into(),
                found: "0".into(),
            });
        }
        Ok(())
    }

    /// Reads [`FAULT_STALL_ENV`] (`STEP:SECONDS`) into `fault_stall`.
    pub fn fault_stall_from_env(&mut self) -> Result<(), ConfigError> {
        let Ok(text) = std::env::var(FAULT_STALL_ENV) else {
            return Ok(());
        };
        let bad = || ConfigError::BadFaultSpec {
            variable: FAULT_STALL_ENV,
            found: text.clone(),
        };
        let (step, seconds) = text.trim().split_once(':').ok_or_else(bad)?;
        let step: u64 = step.trim().parse().map_err(|_| bad())?;
        let seconds: f64 = seconds.trim().parse().map_err(|_| bad())?;
        if step == 0 || !seconds.is_finite() || !(0.0..=3600.0).contains(&seconds) {
            return Err(bad());
        }
        self.fault_stall = Some((step, Duration::from_secs_f64(seconds)));
        Ok(())
    }
}

/// What the model is, for `/v1/models`, `/props` and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The GGUF file.
    pub path: std::path::PathBuf,
    /// `general.architecture`.
    pub architecture: String,
    /// `general.name`, when the file has one.
    pub general_name: Option<String>,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// The context length the model was trained with.
    pub n_ctx_train: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Layers.
    pub n_layer: usize,
    /// Bytes of the GGUF file.
    pub file_bytes: u64,
    /// Where it runs (`cpu, 2 threads`, `cuda:0 NVIDIA H200 (sm_90), vmm pool`).
    pub backend: String,
    /// Whether the model carries a chat template (else a built-in one is chosen by its
    /// tokenizer, when one fits).
    pub has_chat_template: bool,
    /// The chat template's source in use, if any.
    pub chat_template: Option<String>,
}

/// One running sequence, as [`Snapshot::running`] shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotSnapshot {
    /// The request's id.
    pub request_id: u64,
    /// Prompt tokens.
    pub n_prompt: usize,
    /// Prompt tokens in the KV cache so far (computed or taken from the prefix cache).
    pub n_prompt_done: usize,
    /// Tokens generated so far.
    pub n_generated: usize,
    /// Most tokens it may generate (`None`: until the context is full).
    pub max_tokens: Option<usize>,
    /// Since submission.
    pub age: Duration,
}

/// The KV cache's block counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvSnapshot {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks the cache may hand out in all.
    pub total_blocks: usize,
    /// Blocks in use by live sequences (shared prefix blocks counted once).
    pub used_blocks: usize,
    /// Blocks kept only by the prefix cache (no live sequence uses them; evicted first).
    pub cached_blocks: usize,
    /// Blocks that hold memory now (used, cached, and free ones kept for reuse).
    pub resident_blocks: usize,
    /// Bytes of K and V one block takes on all layers together.
    pub bytes_per_block: usize,
    /// Bytes of recurrent state held by live sequences beside the KV blocks (hybrid models'
    /// linear-attention layers: a fixed size per sequence; 0 for other models).
    pub recurrent_state_bytes: usize,
}

impl KvSnapshot {
    /// Blocks in use over blocks available, 0 to 1 (vLLM's `gpu_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f64 / self.total_blocks as f64
        }
    }
}

/// Running totals since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Requests accepted by [`Engine::submit`].
    pub requests_submitted: u64,
    /// Requests that ended with `Done` (cancelled ones included).
    pub requests_finished: u64,
    /// Requests cancelled (client gone, drain).
    pub requests_cancelled: u64,
    /// Requests that ended with `Failed`.
    pub requests_failed: u64,
    /// Times a running sequence was preempted for lack of KV blocks.
    pub preemptions: u64,
    /// Prompt tokens submitted.
    pub prompt_tokens: u64,
    /// Prompt tokens computed by forward passes (recomputation after preemption included).
    pub prompt_tokens_computed: u64,
    /// Prompt tokens taken from the prefix cache.
    pub prompt_tokens_cached: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Forward passes that failed (their requests were retried alone).
    pub failed_steps: u64,
    /// Idle trims (KV memory and scratch given back).
    pub idle_trims: u64,
}

/// The engine's state as last published by its thread.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// When the engine thread started.
    pub started_at: Instant,
    /// When the engine thread last went round its loop (it does at least every 100 ms when
    /// idle).
    pub heartbeat: Instant,
    /// Forward passes run.
    pub steps: u64,
    /// When the last step finished.
    pub last_step_finished: Option<Instant>,
    /// When the step now running started (`None` between steps).
    pub step_started: Option<Instant>,
    /// Tokens in the last step's batch.
    pub last_step_tokens: usize,
    /// Sequences running.
    pub running: Vec<SlotSnapshot>,
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// The KV cache.
    pub kv: KvSnapshot,
    /// Totals since start.
    pub totals: Totals,
    /// Whether the engine is draining (admits nothing new).
    pub draining: bool,
    /// Set once the engine thread has ended, with why.
    pub stopped: Option<String>,
}

/// What `/health` says.
#[derive(Debug, Clone, PartialEq)]
pub enum Health {
    /// The engine loop is alive and, if work is pending, making progress.
    Ok,
    /// A step has run longer than the watchdog, or work is pending and no step finished within
    /// it.
    Stalled {
        /// Since the last finished step (or since start, when none has finished).
        since_last_step: Duration,
        /// How long the step now running has run, if one is.
        step_running_for: Option<Duration>,
        /// Request ids of the running sequences.
        running: Vec<u64>,
        /// Requests waiting.
        waiting: usize,
    },
    /// The engine thread has ended.
    Stopped { reason: String },
}

/// Messages to the engine thread.
pub(crate) enum Command {
    Submit(Box<Submission>),
    Cancel(u64),
    CancelAll,
    Shutdown,
}

/// A request on its way to the engine thread.
pub(crate) struct Submission {
    pub id: u64,
    pub request: GenerateRequest,
    pub submitted_at: Instant,
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
}

/// What the handle and the engine thread share.
pub(crate) struct Shared {
    pub config: EngineConfig,
    pub snapshot: Mutex<Arc<Snapshot>>,
    pub draining: AtomicBool,
    /// Requests submitted and not yet ended (running plus waiting).
    pub in_flight: AtomicUsize,
    pub next_id: AtomicU64,
    pub stopped: Mutex<Option<String>>,
}

impl Shared {
    pub(crate) fn publish(&self, snapshot: Snapshot) {
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(snapshot);
    }
}

struct Inner {
    shared: Arc<Shared>,
    commands: mpsc::Sender<Command>,
    thread: Mutex<Option<JoinHandle<()>>>,
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    pool: Option<Arc<DevicePool>>,
    split_memory: Option<crate::load::SplitMemoryView>,
    kv_total_blocks: usize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(handle) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = handle.join();
        }
    }
}

/// A handle to a running engine; clones share it. The engine thread stops when the last clone
/// is dropped (or on [`Engine::shutdown`]).
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.inner.info.path)
            .field("backend", &self.inner.info.backend)
            .finish()
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot start the engine thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("cannot prepare the chat template: {0}")]
    Chat(String),
}

impl Engine {
    /// Starts the engine thread on a loaded model.
    pub fn start(loaded: AnyLoaded, config: EngineConfig) -> Result<Engine, EngineError> {
        config.validate()?;
        let (info, tokenizer, chat_template, pool, split_memory) = worker::describe(&loaded)?;
        let kv_total_blocks = config.kv_capacity_tokens.div_ceil(config.kv_block_size);
        let now = Instant::now();
        let shared = Arc::new(Shared {
            config: config.clone(),
            snapshot: Mutex::new(Arc::new(Snapshot {
                started_at: now,
                heartbeat: now,
                steps: 0,
                last_step_finished: None,
                step_started: None,
                last_step_tokens: 0,
                running: Vec::new(),
                waiting: 0,
                kv: KvSnapshot {
                    block_size: config.kv_block_size,
                    total_blocks: kv_total_blocks,
                    ..KvSnapshot::default()
                },
                totals: Totals::default(),
                draining: false,
                stopped: None,
            })),
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            stopped: Mutex::new(None),
        });
        let (commands, receiver) = mpsc::channel();
        let thread = worker::spawn(loaded, Arc::clone(&shared), receiver)?;
        Ok(Engine {
            inner: Arc::new(Inner {
                shared,
                commands,
                thread: Mutex::new(Some(thread)),
                info,
                tokenizer,
                chat_template,
                pool,
                split_memory,
                kv_total_blocks,
            }),
        })
    }

    /// The model.
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The scheduling configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.shared.config
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    /// The device memory pool, when the model runs on a GPU.
    pub fn pool(&self) -> Option<&Arc<DevicePool>> {
        self.inner.pool.as_ref()
    }

    /// Over a split: the devices whose memory the split counts (the CPU of a partial offload,
    /// simulated devices), and the simulated devices' pools.
    pub fn split_memory(&self) -> Option<&crate::load::SplitMemoryView> {
        self.inner.split_memory.as_ref()
    }

    /// Renders a conversation through the model's chat template (with the assistant's turn
    /// opened) and tokenizes it as the model reads it.
    pub fn chat_prompt(
        &self,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>, crate::chat::ChatError> {
        crate::chat::prompt_ids(
            &self.inner.tokenizer,
            self.inner.chat_template.as_deref(),
            messages,
        )
    }

    /// Checks a request and queues it. The returned stream yields its events; dropping it
    /// cancels the request.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let shared = &self.inner.shared;
        let config = &shared.config;
        if let Some(reason) = shared
            .stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(SubmitError::Stopped { reason });
        }
        if shared.draining.load(Ordering::Acquire) {
            return Err(SubmitError::Draining);
        }
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let n_vocab = self.inner.info.n_vocab;
        if let Some((index, &token)) = request
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= n_vocab)
        {
            return Err(SubmitError::TokenOutOfRange {
                token,
                index,
                n_vocab,
            });
        }
        if request.prompt.len() >= config.n_ctx {
            return Err(SubmitError::PromptTooLong {
                prompt_tokens: request.prompt.len(),
                n_ctx: config.n_ctx,
            });
        }
        request.sampling.validate()?;
        if let Some(n) = request.logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(SubmitError::TooManyLogprobs {
                    found: n,
                    max: MAX_TOP_LOGPROBS,
                });
            }
        }
        // The prompt and one generated token must fit the whole cache, else it can never run.
        let needed_tokens = request.prompt.len() + 1;
        let needed_blocks = needed_tokens.div_ceil(config.kv_block_size);
        if needed_blocks > self.inner.kv_total_blocks {
            return Err(SubmitError::NeverFits {
                needed_tokens,
                needed_blocks,
                block_size: config.kv_block_size,
                total_blocks: self.inner.kv_total_blocks,
            });
        }
        // Running plus waiting is bounded by parallel + max_queue; the check and the increment
        // are one atomic step, so a burst cannot overshoot.
        let limit = config.parallel + config.max_queue;
        if shared
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_err()
        {
            let snapshot = self.snapshot();
            return Err(SubmitError::QueueFull {
                waiting: snapshot.waiting.max(config.max_queue),
                running: snapshot.running.len(),
                max_queue: config.max_queue,
            });
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        let submission = Submission {
            id,
            request,
            submitted_at: Instant::now(),
            events,
        };
        if self
            .inner
            .commands
            .send(Command::Submit(Box::new(submission)))
            .is_err()
        {
            shared.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Stopped {
                reason: "the engine thread has ended".into(),
            });
        }
        Ok(RequestStream {
            id,
            events: receiver,
            commands: self.inner.commands.clone(),
            ended: false,
        })
    }

    /// The state last published by the engine thread; never waits on it.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(
            &self
                .inner
                .shared
                .snapshot
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Whether the engine is making progress, judged against the watchdog from the snapshot.
    pub fn health(&self) -> Health {
        health_of(
            &self.snapshot(),
            self.inner.shared.config.watchdog,
            Instant::now(),
        )
    }

    /// Stops admitting new requests; those already submitted go on.
    pub fn begin_drain(&self) {
        self.inner.shared.draining.store(true, Ordering::Release);
    }

    /// Whether [`Engine::begin_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.inner.shared.draining.load(Ordering::Acquire)
    }

    /// Requests submitted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.inner.shared.in_flight.load(Ordering::Acquire)
    }

    /// Cancels every request (each ends with `Done` and [`FinishReason::Cancelled`]).
    pub fn cancel_all(&self) {
        let _ = self.inner.commands.send(Command::CancelAll);
    }

    /// Cancels every request and stops the engine thread, waiting for it to end.
    pub fn shutdown(&self) {
        let _ = self.inner.commands.send(Command::CancelAll);
        let _ = self.inner.commands.send(Command::Shutdown);
        let handle = self
            .inner
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// [`Engine::health`] for a given snapshot, watchdog and time.
pub fn health_of(snapshot: &Snapshot, watchdog: Duration, now: Instant) -> Health {
    if let Some(reason) = &snapshot.stopped {
        return Health::Stopped {
            reason: reason.clone(),
        };
    }
    let since_last_step =
        now.saturating_duration_since(snapshot.last_step_finished.unwrap_or(snapshot.started_at));
    let step_running_for = snapshot
        .step_started
        .map(|started| now.saturating_duration_since(started));
    let pending = !snapshot.running.is_empty() || snapshot.waiting > 0;
    let step_too_long = step_running_for.is_some_and(|d| d > watchdog);
    // A loop that stopped going round (not in a step, yet no heartbeat) is as stuck as a step.
    let loop_silent =
        step_running_for.is_none() && now.saturating_duration_since(snapshot.heartbeat) > watchdog;
    let no_progress = pending && since_last_step > watchdog && step_running_for.is_none();
    if step_too_long || loop_silent || no_progress {
        return Health::Stalled {
            since_last_step,
            step_running_for,
            running: snapshot.running.iter().map(|s| s.request_id).collect(),
            waiting: snapshot.waiting,
        };
    }
    Health::Ok
}

/// The events of one request. Dropping it before the request ends cancels the request.
pub struct RequestStream {
    id: u64,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    commands: mpsc::Sender<Command>,
    ended: bool,
}

impl RequestStream {
    /// The request's id (as `/slots` and the snapshot show it).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn note(&mut self, event: &Option<Event>) {
        if matches!(
            event,
            None | Some(Event::Done { .. } | Event::Failed { .. })
        ) {
            self.ended = true;
        }
    }

    /// The next event; `None` once the request has ended and every event was read.
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        self.note(&event);
        event
    }

    /// [`RequestStream::recv`] for threads outside an async runtime.
    pub fn blocking_recv(&mut self) -> Option<Event> {
        let event = self.events.blocking_recv();
        self.note(&event);
        event
    }

    /// Cancels the request; its stream then ends with `Done` and [`FinishReason::Cancelled`].
    pub fn cancel(&self) {
        let _ = self.commands.send(Command::Cancel(self.id));
    }

    /// A handle that cancels this request from another thread (a Ctrl-C handler) while this
    /// stream is being read.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            id: self.id,
            commands: self.commands.clone(),
        }
    }
}

/// Cancels one request from any thread; see [`RequestStream::canceller`].
#[derive(Clone)]
pub struct Canceller {
    id: u64,
    commands: mpsc::Sender<Command>,
}

impl Canceller {
    /// Cancels the request (nothing happens when it has already ended).
    pub fn cancel(&self) {
        let _ = self.commands.send(Command::Cancel(self.id));
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}
