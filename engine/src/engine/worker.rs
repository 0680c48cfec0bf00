//! The engine thread: owns the loaded model and its context, takes commands, steps the
//! scheduler, trims memory when idle, and publishes a snapshot after every step and idle tick.
//!
//! A panic inside the thread (a bug) does not take the process down: it is caught, every request
//! gets a `Failed` event, and the snapshot records why the engine stopped, so `/health` says so.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ember_gpu::DevicePool;
use ember_tokenizer::{ChatTemplate, Tokenizer};

use super::scheduler::{Scheduler, StepPoint};
use super::{Command, EngineError, KvSnapshot, ModelInfo, Shared, Snapshot};
use crate::backend::Backend;
use crate::load::{AnyLoaded, Loaded};
use crate::model::ContextParams;

/// How often an idle engine thread wakes to publish a heartbeat and check for idle trimming.
const IDLE_TICK: Duration = Duration::from_millis(100);

type Described = (
    ModelInfo,
    Arc<Tokenizer>,
    Option<Arc<ChatTemplate>>,
    Option<Arc<DevicePool>>,
    Option<crate::load::SplitMemoryView>,
);

/// What the handle keeps of a loaded model: its description, tokenizer, chat template, pool and
/// the split's memory counts.
pub(super) fn describe(loaded: &AnyLoaded) -> Result<Described, EngineError> {
    match loaded {
        AnyLoaded::Cpu(loaded) => describe_on(loaded),
        AnyLoaded::Gpu(loaded) => describe_on(loaded),
        AnyLoaded::Sim(loaded) => describe_on(loaded),
        AnyLoaded::Offload(loaded) => describe_on(loaded),
    }
}

fn describe_on<B: Backend>(loaded: &Loaded<B>) -> Result<Described, EngineError> {
    let model = &loaded.model;
    let gguf = model.gguf();
    let hparams = model.hparams();
    // Whether the file carries its own template; `resolve_template` below compiles it (or the
    // built-in one), so it is not compiled twice here.
    let has_chat_template = gguf.metadata().contains_key("tokenizer.chat_template");
    let template = crate::chat::resolve_template(gguf, &loaded.tokenizer, None)
        .map_err(|e| EngineError::Chat(e.to_string()))?;
    let info = ModelInfo {
        path: loaded.path.clone(),
        architecture: hparams.architecture.name().to_string(),
        general_name: gguf
            .metadata()
            .get_str_opt("general.name")
            .ok()
            .flatten()
            .map(str::to_string),
        n_vocab: model.n_vocab(),
        n_ctx_train: hparams.n_ctx_train,
        n_embd: hparams.n_embd,
        n_layer: hparams.n_layer,
        file_bytes: gguf.file_size(),
        backend: model.backend().describe(),
        has_chat_template,
        chat_template: template.as_ref().map(|t| t.source().to_string()),
    };
    Ok((
        info,
        Arc::clone(&loaded.tokenizer),
        template.map(Arc::new),
        loaded.pool.clone(),
        loaded.split_memory.clone(),
    ))
}

/// Starts the engine thread.
pub(super) fn spawn(
    loaded: AnyLoaded,
    shared: Arc<Shared>,
    commands: mpsc::Receiver<Command>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ember-engine".into())
        .spawn(move || {
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match loaded {
                AnyLoaded::Cpu(loaded) => run(*loaded, &shared, &commands),
                AnyLoaded::Gpu(loaded) => run(*loaded, &shared, &commands),
                AnyLoaded::Sim(loaded) => run(*loaded, &shared, &commands),
                AnyLoaded::Offload(loaded) => run(*loaded, &shared, &commands),
            }));
            let reason = match outcome {
                Ok(()) => "the engine was shut down".to_string(),
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "unknown panic".to_string());
                    tracing::error!(%message, "the engine thread panicked");
                    format!("the engine thread panicked: {message}")
                }
            };
            *shared.stopped.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.clone());
            let mut last = (**shared.snapshot.lock().unwrap_or_else(|e| e.into_inner())).clone();
            last.stopped = Some(reason);
            last.step_started = None;
            shared.publish(last);
            // Requests still queued in the channel never reached the scheduler: end them.
            while let Ok(command) = commands.try_recv() {
                if let Command::Submit(submission) = command {
                    shared.in_flight.fetch_sub(1, Ordering::AcqRel);
                    let _ = submission.events.send(super::Event::Failed {
                        message: "the engine has stopped".into(),
                    });
                }
            }
        })
}

struct Worker<'a> {
    shared: &'a Shared,
    started_at: Instant,
    steps: u64,
    last_step_finished: Option<Instant>,
    last_step_tokens: usize,
    bytes_per_block: usize,
}

impl Worker<'_> {
    /// The cache's blocks and the recurrent state, as `ctx` holds them now.
    fn kv_snapshot<B: Backend>(&self, ctx: &crate::model::Context<B>) -> KvSnapshot {
        let stats = ctx.kv_stats();
        KvSnapshot {
            block_size: ctx.kv().block_size(),
            total_blocks: stats.capacity,
            used_blocks: stats.used,
            cached_blocks: stats.cached,
            resident_blocks: stats.resident,
            bytes_per_block: self.bytes_per_block,
            recurrent_state_bytes: ctx.state_stats().bytes,
        }
    }

    fn snapshot<B: Backend>(
        &self,
        scheduler: &Scheduler,
        ctx: &crate::model::Context<B>,
    ) -> Snapshot {
        let now = Instant::now();
        Snapshot {
            started_at: self.started_at,
            heartbeat: now,
            steps: self.steps,
            last_step_finished: self.last_step_finished,
            step_started: None,
            last_step_tokens: self.last_step_tokens,
            running: scheduler.slots(now),
            waiting: scheduler.n_waiting(),
            kv: self.kv_snapshot(ctx),
            totals: scheduler.totals(),
            draining: self.shared.draining.load(Ordering::Acquire),
            stopped: None,
        }
    }
}

fn run<B: Backend>(loaded: Loaded<B>, shared: &Arc<Shared>, commands: &mpsc::Receiver<Command>) {
    let config = shared.config.clone();
    let model = &loaded.model;
    let mut ctx = model.new_context(ContextParams {
        n_ctx: config.n_ctx,
        kv_block_size: config.kv_block_size,
        kv_capacity_tokens: config.kv_capacity_tokens,
    });
    if config.prefix_cache && ctx.has_recurrent_state() {
        tracing::info!(
            "prefix cache off: the model's linear-attention layers keep a recurrent state per \
             sequence, which a cached prefix would not carry"
        );
    }
    let mut scheduler = Scheduler::new(
        config.clone(),
        Arc::clone(&loaded.tokenizer),
        Arc::clone(shared),
    );
    let mut worker = Worker {
        shared,
        started_at: Instant::now(),
        steps: 0,
        last_step_finished: None,
        last_step_tokens: 0,
        bytes_per_block: loaded.model.hparams().kv_bytes_per_token() * config.kv_block_size,
    };
    let mut idle_since: Option<Instant> = Some(Instant::now());
    let mut trimmed = true;
    loop {
        // Commands: wait for one when idle (waking for heartbeats and the idle trim), else take
        // whatever has arrived and go on stepping.
        let first = if scheduler.has_work() {
            commands.try_recv().ok()
        } else {
            match commands.recv_timeout(IDLE_TICK) {
                Ok(command) => Some(command),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        let mut shutdown = false;
        let mut next = first;
        while let Some(command) = next {
            match command {
                Command::Submit(submission) => scheduler.enqueue(*submission),
                Command::Cancel(id) => scheduler.cancel(id, &mut ctx),
                Command::CancelAll => scheduler.cancel_all(&mut ctx),
                Command::Shutdown => shutdown = true,
            }
            next = commands.try_recv().ok();
        }
        if shutdown {
            scheduler.cancel_all(&mut ctx);
            break;
        }

        if scheduler.has_work() {
            idle_since = None;
            trimmed = false;
            let step_number = worker.steps + 1;
            let report = scheduler.step(model, &mut ctx, &mut |point, slots, ctx| {
                // Before the pass: publish that the step runs, with what it holds, so a pass
                // that never returns is visible to `/health` while this thread is stuck in it.
                // After it, before its tokens go out: the cache as the pass left it.
                let now = Instant::now();
                let mut snapshot =
                    (**shared.snapshot.lock().unwrap_or_else(|e| e.into_inner())).clone();
                snapshot.heartbeat = now;
                if point == StepPoint::BeforeForward {
                    snapshot.step_started = Some(now);
                }
                snapshot.running = slots.to_vec();
                snapshot.kv = worker.kv_snapshot(ctx);
                shared.publish(snapshot);
                if point != StepPoint::BeforeForward {
                    return;
                }
                if let Some((stall_step, stall_for)) = config.fault_stall {
                    if stall_step == step_number {
                        tracing::warn!(
                            step = step_number,
                            seconds = stall_for.as_secs_f64(),
                            "fault injection: stalling this step"
                        );
                        std::thread::sleep(stall_for);
                    }
                }
            });
            if report.passes > 0 {
                worker.steps += 1;
                worker.last_step_finished = Some(Instant::now());
                worker.last_step_tokens = report.tokens;
            }
        } else {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if !trimmed && since.elapsed() >= config.idle_trim_after {
                // Idle: the prefix cache, free KV blocks and activation buffers give their memory
                // back, so a device returns to its post-load floor.
                let evicted = ctx.kv_mut().evict_cached();
                ctx.release_free_kv(model, 0);
                ctx.release_scratch(model);
                scheduler.note_idle_trim();
                tracing::debug!(evicted, "idle trim");
                trimmed = true;
            }
        }
        shared.publish(worker.snapshot(&scheduler, &ctx));
    }
}
