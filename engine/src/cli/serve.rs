//! `ember serve`: the OpenAI-compatible HTTP server. This module parses the flags, checks them
//! before anything is loaded, binds (printing `listening on http://HOST:PORT` at once), loads the
//! model on a thread of its own while `/health` says `loading`, prints `ready`, and turns
//! SIGTERM/SIGINT into a drain (a second signal exits at once). The server itself is
//! `ember::server`.

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use ember::engine::{Engine, EngineConfig};
use ember::load::AnyLoaded;
use ember::model::DEFAULT_N_CTX;
use ember::server::{Server, ServerConfig, DEFAULT_MAX_BODY_BYTES};

use super::device::DeviceArgs;

/// Longest drain accepted (a day): beyond it a typo is likelier than intent.
const MAX_DRAIN_SECONDS: f64 = 86_400.0;
/// Longest watchdog accepted (an hour).
const MAX_WATCHDOG_SECONDS: f64 = 3_600.0;
/// How long the engine thread gets to stop after the drain before the process exits anyway (a
/// device call that hangs cannot be interrupted).
const ENGINE_STOP_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// A multimodal projector (llama.cpp's `--mmproj`): refused, as ember runs text models only.
    #[arg(long, value_name = "FILE")]
    pub mmproj: Option<std::path::PathBuf>,
    /// Address to listen on (0.0.0.0 or :: for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 takes any free port (the one taken is printed).
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true)]
    pub port: u16,
    /// Sequences generated at once (also -np). Requests beyond them wait in the queue.
    #[arg(
        long,
        alias = "n-parallel",
        default_value_t = 4,
        allow_negative_numbers = true
    )]
    pub parallel: usize,
    /// Longest sequence, prompt plus generated tokens (default: the model's training context, at
    /// most 4096). Unlike llama-server's -c, it is not split among the --parallel sequences: each
    /// may grow to it, and KV memory is allocated in blocks on demand as sequences grow, so this
    /// is a ceiling, not a reservation.
    #[arg(short = 'c', long, allow_negative_numbers = true)]
    pub ctx_size: Option<usize>,
    /// Tokens the KV cache may hold for all sequences together (default: ctx-size x parallel),
    /// allocated on demand. When it runs out, the youngest sequence is preempted and recomputed
    /// later.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub kv_tokens: Option<usize>,
    /// Requests that may wait for a running sequence; beyond them a request gets 429 at once.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub max_queue: usize,
    /// Most tokens in one forward pass: the running sequences' next tokens plus chunks of the
    /// prompts being read.
    #[arg(
        long,
        alias = "ubatch-size",
        default_value_t = 512,
        allow_negative_numbers = true
    )]
    pub ubatch: usize,
    /// Require `Authorization: Bearer KEY` on every route except /health and /metrics.
    #[arg(long, env = "EMBER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model's name in the API (default: the GGUF file name; the file name, its stem and the
    /// -m value are accepted as well).
    #[arg(short = 'a', long)]
    pub alias: Option<String>,
    /// Seconds a drain (SIGTERM or SIGINT) lets running and queued requests finish before
    /// cancelling them.
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_drain_timeout, allow_hyphen_values = true)]
    pub drain_timeout: Duration,
    /// Seconds an engine step may run, or pending work may wait for one, before /health reports
    /// a stall (503).
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_watchdog, allow_hyphen_values = true)]
    pub watchdog: Duration,
    /// Do not reuse the KV blocks of prompt prefixes seen before.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// CPU worker threads (0, the default: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// Seconds as a duration within `0..=max` (`positive`: above 0).
fn parse_seconds(text: &str, flag: &str, max: f64, positive: bool) -> Result<Duration, String> {
    let lower = if positive { "above 0" } else { "from 0" };
    let error = || format!("{flag}: expected seconds {lower} up to {max}, found {text:?}");
    let seconds: f64 = text.trim().parse().map_err(|_| error())?;
    let in_range = seconds.is_finite()
        && seconds <= max
        && if positive {
            seconds > 0.0
        } else {
            seconds >= 0.0
        };
    if !in_range {
        return Err(error());
    }
    Ok(Duration::from_secs_f64(seconds))
}

fn parse_drain_timeout(text: &str) -> Result<Duration, String> {
    parse_seconds(text, "--drain-timeout", MAX_DRAIN_SECONDS, false)
}

fn parse_watchdog(text: &str) -> Result<Duration, String> {
    parse_seconds(text, "--watchdog", MAX_WATCHDOG_SECONDS, true)
}

impl ServeArgs {
    /// The engine configuration for a context of `n_ctx` tokens, checked.
    fn engine_config(&self, n_ctx: usize) -> anyhow::Result<EngineConfig> {
        let kv_capacity_tokens = match self.kv_tokens {
            Some(tokens) => tokens,
            None => n_ctx.checked_mul(self.parallel).with_context(|| {
                format!(
                    "--ctx-size {n_ctx} x --parallel {} overflows: pass --kv-tokens",
                    self.parallel
                )
            })?,
        };
        let config = EngineConfig {
            parallel: self.parallel,
            max_queue: self.max_queue,
            n_ctx,
            kv_capacity_tokens,
            ubatch: self.ubatch,
            prefix_cache: !self.no_prefix_cache,
            watchdog: self.watchdog,
            ..EngineConfig::default()
        };
        config.validate().map_err(|e| {
            // The engine names its settings; say which flag sets each.
            let flag = match &e {
                ember::engine::ConfigError::OutOfRange { name, .. } => match *name {
                    "parallel" => "--parallel",
                    "max_queue" => "--max-queue",
                    "n_ctx" => "--ctx-size",
                    "ubatch" => "--ubatch",
                    "kv_capacity_tokens" => "--kv-tokens",
                    "watchdog" => "--watchdog",
                    _ => "",
                },
                _ => "",
            };
            if flag.is_empty() {
                anyhow::Error::new(e)
            } else {
                anyhow::Error::new(e).context(format!("bad {flag}"))
            }
        })?;
        Ok(config)
    }

    /// Checks everything that can be checked before the model is loaded.
    fn check(&self) -> anyhow::Result<()> {
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            bail!("--api-key (or EMBER_API_KEY) is empty: pass a key, or leave it unset to serve without one");
        }
        if self.alias.as_deref().is_some_and(|a| a.trim().is_empty()) {
            bail!("--alias is empty: pass a name, or leave it out to use the file name");
        }
        self.engine_config(self.ctx_size.unwrap_or(DEFAULT_N_CTX))?;
        Ok(())
    }
}

/// Loads the model and starts the engine (on the loading thread).
fn load_engine(args: &ServeArgs, fault_stall: Option<(u64, Duration)>) -> anyhow::Result<Engine> {
    let loaded = super::load::load_on(&args.model, args.threads, &args.device)?;
    let (n_ctx_train, kv_bytes_per_token, kv_memory, on_cpu) = match &loaded {
        AnyLoaded::Cpu(loaded) => (
            loaded.model.hparams().n_ctx_train,
            loaded.model.hparams().kv_bytes_per_token(),
            ember::limits::KvMemory::of(loaded.pool.as_deref()),
            loaded.pool.is_none(),
        ),
        AnyLoaded::Offload(loaded) => (
            loaded.model.hparams().n_ctx_train,
            loaded.model.hparams().kv_bytes_per_token(),
            ember::limits::KvMemory::of(loaded.pool.as_deref()),
            loaded.pool.is_none(),
        ),
        AnyLoaded::Sim(loaded) => (
            loaded.model.hparams().n_ctx_train,
            loaded.model.hparams().kv_bytes_per_token(),
            ember::limits::KvMemory::of(loaded.pool.as_deref()),
            loaded.pool.is_none(),
        ),
        AnyLoaded::Gpu(loaded) => (
            loaded.model.hparams().n_ctx_train,
            loaded.model.hparams().kv_bytes_per_token(),
            ember::limits::KvMemory::of(loaded.pool.as_deref()),
            loaded.pool.is_none(),
        ),
    };
    let n_ctx = args
        .ctx_size
        .unwrap_or_else(|| n_ctx_train.clamp(2, DEFAULT_N_CTX));
    if n_ctx > n_ctx_train {
        eprintln!("warning: --ctx-size {n_ctx} is beyond the {n_ctx_train} tokens the model was trained with; output past them may degrade");
    }
    let mut config = args.engine_config(n_ctx)?;
    if on_cpu {
        // On the CPU a full KV cache is in this process's memory.
        ember::limits::check_kv_tokens(
            config.kv_capacity_tokens,
            kv_bytes_per_token,
            kv_memory.as_ref(),
        )
        .map_err(|e| anyhow::anyhow!("--ctx-size x --parallel (or --kv-tokens): {e}"))?;
    } else {
        // On a GPU the cache grows as requests arrive (a request that finds no memory fails
        // alone), but one sequence of the whole context must fit.
        ember::limits::check_context(n_ctx, 1, kv_bytes_per_token, kv_memory.as_ref())
            .map_err(|e| anyhow::anyhow!("--ctx-size {n_ctx}: {e}"))?;
    }
    config.fault_stall = fault_stall;
    let engine = Engine::start(loaded, config).context("cannot start the engine")?;
    let info = engine.model_info();
    let config = engine.config();
    eprintln!(
        "serving {} ({}) on {}: {} sequences at once of up to {} tokens, KV cache up to {} tokens, queue {}{}",
        info.path.display(),
        info.architecture,
        info.backend,
        config.parallel,
        config.n_ctx,
        config.kv_capacity_tokens,
        config.max_queue,
        if config.prefix_cache { ", prefix cache on" } else { "" },
    );
    Ok(engine)
}

/// Waits for SIGTERM or SIGINT; returns its name and number.
#[cfg(unix)]
async fn next_signal(
    terminate: &mut tokio::signal::unix::Signal,
    interrupt: &mut tokio::signal::unix::Signal,
) -> (&'static str, i32) {
    tokio::select! {
        _ = terminate.recv() => ("SIGTERM", libc::SIGTERM),
        _ = interrupt.recv() => ("SIGINT", libc::SIGINT),
    }
}

/// Listens for shutdown signals: the first completes the returned receiver (the drain), a
/// second exits the process at once.
fn watch_signals(drain_timeout: Duration) -> anyhow::Result<tokio::sync::oneshot::Receiver<()>> {
    let (first, first_received) = tokio::sync::oneshot::channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
        tokio::spawn(async move {
            let (name, _) = next_signal(&mut terminate, &mut interrupt).await;
            eprintln!(
                "{name}: draining (new requests get 503; running ones get up to {} s to finish; a second signal exits at once)",
                drain_timeout.as_secs_f64()
            );
            let _ = first.send(());
            let (name, number) = next_signal(&mut terminate, &mut interrupt).await;
            eprintln!("{name} again: exiting now");
            std::process::exit(128 + number);
        });
    }
    #[cfg(not(unix))]
    {
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            eprintln!(
                "Ctrl-C: draining (new requests get 503; running ones get up to {} s to finish; a second Ctrl-C exits at once)",
                drain_timeout.as_secs_f64()
            );
            let _ = first.send(());
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("Ctrl-C again: exiting now");
                std::process::exit(130);
            }
        });
    }
    Ok(first_received)
}

async fn serve(
    args: ServeArgs,
    fault_stall: Option<(u64, Duration)>,
) -> anyhow::Result<Option<Engine>> {
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        alias: args.alias.clone(),
        model_spec: args.model.clone(),
        max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        drain_timeout: args.drain_timeout,
    };
    let server = Server::bind(config).await?;
    eprintln!("listening on http://{}", server.local_addr());
    let handle = server.handle();
    let first_signal = watch_signals(args.drain_timeout)?;
    let drain_timeout = args.drain_timeout;

    let (loaded, load_result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("ember-load".into())
        .spawn(move || {
            let _ = loaded.send(load_engine(&args, fault_stall));
        })
        .context("cannot start the loading thread")?;

    let mut serving = tokio::spawn(server.run(async move {
        let _ = first_signal.await;
    }));
    tokio::select! {
        result = load_result => match result {
            Ok(Ok(engine)) => {
                handle.set_engine(engine)?;
                eprintln!("ready");
            }
            Ok(Err(error)) => return Err(error),
            Err(_) => bail!("the loading thread ended without a result"),
        },
        result = &mut serving => {
            // A signal came while loading: there was nothing to drain.
            result.context("the HTTP server task failed")??;
            eprintln!("stopped before the model was loaded");
            return Ok(None);
        }
    }
    let outcome = serving.await.context("the HTTP server task failed")??;
    if outcome.cancelled > 0 {
        eprintln!(
            "drain timeout ({} s): cancelled {} requests",
            drain_timeout.as_secs_f64(),
            outcome.cancelled
        );
    } else {
        eprintln!("drained: every request finished");
    }
    if !outcome.closed_cleanly {
        eprintln!("warning: some connections did not close in time");
    }
    Ok(handle.engine().cloned())
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.mmproj {
        anyhow::bail!(
            "--mmproj {}: {}",
            path.display(),
            ember::model::MULTIMODAL_UNSUPPORTED
        );
    }
    args.check()?;
    // Tests force a stalled step through the environment; a bad value is refused before load.
    let mut fault_settings = EngineConfig::default();
    fault_settings
        .fault_stall_from_env()
        .context("bad fault injection setting")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ember-http")
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(serve(args, fault_settings.fault_stall));
    // Blocking tasks (tokenizing a prompt) end on their own; nothing must keep the exit waiting.
    runtime.shutdown_timeout(Duration::from_secs(1));
    let engine = result?;
    if let Some(engine) = engine {
        // The engine thread joins once its work is cancelled; if a device call hangs it never
        // does, and the process must still exit.
        let (stopped, stopped_received) = std::sync::mpsc::channel();
        let stopper = engine.clone();
        let spawned = std::thread::Builder::new()
            .name("ember-stop".into())
            .spawn(move || {
                stopper.shutdown();
                let _ = stopped.send(());
            });
        if spawned.is_ok() && stopped_received.recv_timeout(ENGINE_STOP_GRACE).is_err() {
            eprintln!(
                "warning: the engine thread did not stop within {} s; exiting anyway",
                ENGINE_STOP_GRACE.as_secs()
            );
            std::process::exit(0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<ServeArgs, String> {
        let argv = std::iter::once("ember")
            .chain(args.iter().copied())
            .map(std::ffi::OsString::from);
        Flags::try_parse_from(super::super::device::rewrite_ngl(argv))
            .map(|f| f.serve)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn llama_server_spellings() {
        let args = parse(&[
            "-m",
            "x.gguf",
            "-c",
            "2048",
            "-np",
            "8",
            "-ngl",
            "0",
            "-a",
            "smol",
            "--api-key",
            "k",
            "-t",
            "2",
        ])
        .unwrap();
        assert_eq!(args.ctx_size, Some(2048));
        assert_eq!(args.parallel, 8);
        assert_eq!(args.alias.as_deref(), Some("smol"));
        assert_eq!(args.api_key.as_deref(), Some("k"));
        assert_eq!(args.threads, 2);
        let eq = parse(&["-m", "x.gguf", "-np=3", "--ubatch-size", "64"]).unwrap();
        assert_eq!(eq.parallel, 3);
        assert_eq!(eq.ubatch, 64);
    }

    #[test]
    fn defaults() {
        let args = parse(&["-m", "x.gguf"]).unwrap();
        assert_eq!(args.host, "127.0.0.1");
        assert_eq!(args.port, 8080);
        assert_eq!(args.drain_timeout, Duration::from_secs(30));
        assert_eq!(args.watchdog, Duration::from_secs(10));
        let config = args.engine_config(1024).unwrap();
        assert_eq!(config.kv_capacity_tokens, 1024 * args.parallel);
        assert!(config.prefix_cache);
    }

    #[test]
    fn absurd_values_are_refused_before_loading() {
        for (flags, expected) in [
            (vec!["--parallel", "0"], "--parallel"),
            (vec!["--ubatch", "0"], "--ubatch"),
            (vec!["-c", "20000000"], "--ctx-size"),
            (vec!["-c", "1"], "--ctx-size"),
            (vec!["--kv-tokens", "0"], "--kv-tokens"),
        ] {
            let mut argv = vec!["-m", "x.gguf"];
            argv.extend(flags.iter().copied());
            let args = parse(&argv).unwrap();
            let error = format!("{:#}", args.check().unwrap_err());
            assert!(error.contains(expected), "{flags:?}: {error}");
        }
        for (flags, expected) in [
            (
                vec!["--drain-timeout", "-1"],
                "--drain-timeout: expected seconds from 0",
            ),
            (vec!["--drain-timeout", "NaN"], "--drain-timeout"),
            (vec!["--drain-timeout", "1e12"], "--drain-timeout"),
            (
                vec!["--watchdog", "0"],
                "--watchdog: expected seconds above 0",
            ),
            (vec!["--watchdog", "inf"], "--watchdog"),
            (vec!["--port", "70000"], "--port"),
            (vec!["--parallel", "-3"], "--parallel"),
        ] {
            let mut argv = vec!["-m", "x.gguf"];
            argv.extend(flags.iter().copied());
            let error = parse(&argv).unwrap_err();
            assert!(error.contains(expected), "{flags:?}: {error}");
        }
        let empty_key = parse(&["-m", "x.gguf", "--api-key", ""]).unwrap();
        assert!(empty_key.check().is_err());
        assert!(parse(&["-m", "x.gguf", "--port", "0"])
            .unwrap()
            .check()
            .is_ok());
        assert!(parse(&["-m", "x.gguf", "--drain-timeout", "0"])
            .unwrap()
            .check()
            .is_ok());
    }
}
