//! `ember stress`: a load test of one model instance through the engine core, the same scheduler
//! `ember serve` runs. Each wave submits several requests at once with mixed prompt lengths: every
//! engine step packs the decoding sequences' next tokens and chunks of the prompts still being
//! read into one batch of at most `--ubatch` tokens. A sequence is freed (and its KV memory handed
//! back) as soon as it has generated `--gen` tokens.
//!
//! Per wave it prints tokens per second and device memory (the pool's accounting and the
//! driver's free memory). After the last wave it samples device memory every 100 ms for 3 s and
//! reports when it came back within 5% of the post-load floor; the command fails (exit code 1)
//! if that took longer than 2 s.
//!
//! `--oom-request` (with `--vram-budget`) adds one request per wave that cannot succeed, submitted
//! once the others hold KV memory: a prompt whose KV cache alone exceeds the budget. The command
//! checks that it fails alone: the other sequences finish and the engine stays usable.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use ember::backend::Backend;
use ember::engine::{Engine, EngineConfig, Event, GenerateRequest, RequestStream};
use ember::kv_cache::DEFAULT_BLOCK_SIZE;
use ember::sample::Pcg32;
use ember::with_loaded;
use ember_gpu::pool::format_bytes;
use ember_gpu::{DevicePool, Purpose};

use super::device::DeviceArgs;
use super::load;

#[derive(Debug, Args)]
pub struct StressArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// Prompt lengths, used in turn by the sequences of each wave (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "256,4000,15000")]
    pub prompts: Vec<usize>,
    /// Sequences running at once in each wave.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Waves.
    #[arg(long, default_value_t = 2)]
    pub waves: usize,
    /// Tokens each sequence generates (greedy).
    #[arg(long, default_value_t = 16)]
    pub gen: usize,
    /// Most tokens in one forward pass (prompts are read in chunks that fit).
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Add one request per wave that cannot fit in memory, and check that it fails alone.
    #[arg(long)]
    pub oom_request: bool,
    /// Seed of the random prompt tokens.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Worker threads on the CPU (0, the default: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// How close to the post-load floor device memory must come, and how soon.
const FLOOR_TOLERANCE: f64 = 0.05;
const FLOOR_DEADLINE: Duration = Duration::from_secs(2);
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
const SAMPLE_FOR: Duration = Duration::from_secs(3);

pub fn run(args: StressArgs) -> anyhow::Result<()> {
    if args.prompts.is_empty() || args.prompts.contains(&0) {
        bail!(
            "--prompts: expected positive prompt lengths, found {:?}",
            args.prompts
        );
    }
    if args.parallel == 0 || args.waves == 0 || args.ubatch == 0 || args.gen == 0 {
        bail!(
            "--parallel, --waves, --ubatch and --gen: expected positive values, found {}, {}, {} and {}",
            args.parallel,
            args.waves,
            args.ubatch,
            args.gen
        );
    }
    const MAX_TOKENS: usize = 1 << 24;
    if args.parallel > 4096 || args.prompts.iter().any(|&p| p > MAX_TOKENS) || args.gen > MAX_TOKENS
    {
        bail!(
            "--parallel at most 4096, --prompts and --gen at most {MAX_TOKENS} tokens: found {}, {:?} and {}",
            args.parallel,
            args.prompts,
            args.gen
        );
    }
    if args.oom_request && args.device.vram_budget.is_none() {
        bail!("--oom-request: expected --vram-budget (the oversized request is one whose KV cache alone exceeds the budget)");
    }
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    let (pool, sim_pools, memory_reporter, kv_per_token, n_vocab, description) =
        with_loaded!(&loaded, |l| (
            l.pool.clone(),
            // Simulated devices' pools (a split's other devices have none).
            l.split_memory
                .as_ref()
                .map(|s| s.pools.clone())
                .unwrap_or_default(),
            l.memory_reporter(),
            l.model.hparams().kv_bytes_per_token() as u64,
            l.model.n_vocab() as u32,
            format!("{} on {}", l.path.display(), l.model.backend().describe()),
        ));
    if args.oom_request && pool.is_none() {
        bail!("--oom-request: expected the model on a GPU (the request shows a device out-of-memory failure staying with its request), found it on the CPU");
    }
    eprintln!("stress: {description}");
    let longest = args.prompts.iter().copied().max().unwrap_or(1);
    // The oversized request's prompt: long enough that its KV cache alone exceeds the budget.
    let oom_prompt_len = match (args.oom_request, args.device.vram_budget) {
        (true, Some(budget)) => (budget / kv_per_token).saturating_add(1) as usize * 5 / 4 + 1,
        _ => 0,
    };
    let n_ctx = longest.max(oom_prompt_len) + args.gen + 1;
    let n_seqs = args.parallel + usize::from(args.oom_request);
    // On the CPU the KV cache of all the sequences is in this process's memory.
    // (On a GPU the run may ask for more than the budget on purpose: --oom-request.)
    let memory = pool.is_none().then(ember::limits::KvMemory::host).flatten();
    ember::limits::check_context(n_ctx, n_seqs, kv_per_token as usize, memory.as_ref()).map_err(
        |e| {
            anyhow::anyhow!(
                "--prompts {longest} + --gen {} for --parallel {}: {e}",
                args.gen,
                args.parallel
            )
        },
    )?;
    let engine = Engine::start(
        loaded,
        EngineConfig {
            parallel: n_seqs,
            max_queue: n_seqs,
            n_ctx,
            kv_capacity_tokens: n_ctx * n_seqs,
            kv_block_size: DEFAULT_BLOCK_SIZE,
            ubatch: args.ubatch,
            // Random prompts share nothing; the memory figures are those of the sequences.
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )?;
    let result = stress_on(&engine, pool.as_deref(), &args, n_vocab, oom_prompt_len);
    // The floor is watched with the engine still running and idle, as a server sits between
    // bursts: its idle trim and the pool's trimmer (both owned by the loaded model) are what
    // give the memory back. After a shutdown the model is gone and nobody trims.
    let result = result.and_then(|()| match &pool {
        Some(pool) => watch_floor(&[pool], Instant::now()),
        None if !sim_pools.is_empty() => {
            let pools: Vec<&DevicePool> = sim_pools.iter().map(|p| &**p).collect();
            watch_floor(&pools, Instant::now())
        }
        None => {
            println!("memory: the model runs on the CPU; no device memory to watch");
            Ok(())
        }
    });
    engine.shutdown();
    // Every device: the GPU's pool after idling, the split's counts of the others.
    if let Some(reporter) = memory_reporter {
        load::print_memory_report_after_idle(&reporter);
    }
    result
}

/// Device memory now: the pool's accounting and the driver's free memory.
fn memory_line(pool: &DevicePool) -> String {
    let usage = pool.usage();
    let free = pool
        .driver()
        .mem_info(pool.device())
        .map(|m| format_bytes(m.free))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    format!(
        "live {} (weights {}, kv {}, scratch {}, recurrent state {}), held {}, driver free {free}",
        format_bytes(usage.live),
        format_bytes(usage.purpose(Purpose::Weights).current),
        format_bytes(usage.purpose(Purpose::Kv).current),
        format_bytes(usage.purpose(Purpose::Scratch).current),
        format_bytes(usage.purpose(Purpose::RecurrentState).current),
        format_bytes(usage.held),
    )
}

/// What one request of a wave produced.
struct Outcome {
    prompt_tokens: usize,
    generated: usize,
    failure: Option<String>,
}

/// Reads a request's stream to its end.
fn drain(mut stream: RequestStream, prompt_tokens: usize) -> Outcome {
    let mut generated = 0;
    while let Some(event) = stream.blocking_recv() {
        match event {
            Event::Tokens { tokens, .. } => generated += tokens.len(),
            Event::Done { .. } => {
                return Outcome {
                    prompt_tokens,
                    generated,
                    failure: None,
                }
            }
            Event::Failed { message } => {
                return Outcome {
                    prompt_tokens,
                    generated,
                    failure: Some(message),
                }
            }
        }
    }
    Outcome {
        prompt_tokens,
        generated,
        failure: Some("the stream ended without a result".into()),
    }
}

/// Samples the pool's held bytes every 10 ms until `stop`, keeping the line of the highest.
fn watch_peak(pool: &DevicePool, stop: &AtomicBool) -> Option<String> {
    let mut peak: Option<(u64, String)> = None;
    while !stop.load(Ordering::Acquire) {
        let held = pool.usage().held;
        if peak.as_ref().is_none_or(|(h, _)| held > *h) {
            peak = Some((held, memory_line(pool)));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    peak.map(|(_, line)| line)
}

fn stress_on(
    engine: &Engine,
    pool: Option<&DevicePool>,
    args: &StressArgs,
    n_vocab: u32,
    oom_prompt_len: usize,
) -> anyhow::Result<()> {
    let mut rng = Pcg32::new(args.seed);
    let mut oom_failures_seen = 0;
    let mut random_prompt =
        |len: usize| -> Vec<u32> { (0..len).map(|_| rng.next_u32() % n_vocab).collect() };
    for wave in 0..args.waves {
        let prompts: Vec<Vec<u32>> = (0..args.parallel)
            .map(|i| random_prompt(args.prompts[(wave * args.parallel + i) % args.prompts.len()]))
            .collect();
        let oversized = args.oom_request.then(|| random_prompt(oom_prompt_len));
        let stop = AtomicBool::new(false);
        let start = Instant::now();
        let (outcomes, oom_outcome, peak_line) = std::thread::scope(|scope| {
            let peak = pool.map(|pool| scope.spawn(|| watch_peak(pool, &stop)));
            let mut streams = Vec::new();
            for prompt in &prompts {
                let mut request = GenerateRequest::greedy(prompt.clone(), args.gen);
                // Exactly --gen tokens each, as a load test wants, whatever the model emits.
                request.ignore_eos = true;
                streams.push((engine.submit(request), prompt.len()));
            }
            // The oversized request arrives once the others hold KV memory: it must fail alone.
            let oom_outcome = oversized.map(|prompt| {
                while engine.snapshot().totals.generated_tokens == 0
                    && engine.snapshot().totals.requests_finished == 0
                    && start.elapsed() < Duration::from_secs(600)
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let len = prompt.len();
                let request = GenerateRequest::greedy(prompt, 1);
                match engine.submit(request) {
                    Ok(stream) => drain(stream, len),
                    Err(error) => Outcome {
                        prompt_tokens: 0,
                        generated: 0,
                        failure: Some(error.to_string()),
                    },
                }
            });
            let outcomes: Vec<Outcome> = streams
                .into_iter()
                .map(|(stream, len)| match stream {
                    Ok(stream) => drain(stream, len),
                    Err(error) => Outcome {
                        prompt_tokens: 0,
                        generated: 0,
                        failure: Some(error.to_string()),
                    },
                })
                .collect();
            stop.store(true, Ordering::Release);
            let peak_line = peak.and_then(|handle| handle.join().ok().flatten());
            (outcomes, oom_outcome, peak_line)
        });
        let elapsed = start.elapsed().as_secs_f64();
        let prompt_tokens: usize = outcomes.iter().map(|o| o.prompt_tokens).sum();
        let generated_tokens: usize = outcomes.iter().map(|o| o.generated).sum();
        let lens: Vec<String> = prompts.iter().map(|p| p.len().to_string()).collect();
        println!(
            "wave {}: {} sequences (prompts {}), {prompt_tokens} prompt + {generated_tokens} generated tokens in {elapsed:.2} s: {:.1} t/s ({:.1} prompt t/s, {:.1} generated t/s)",
            wave + 1,
            prompts.len(),
            lens.join(", "),
            (prompt_tokens + generated_tokens) as f64 / elapsed.max(1e-9),
            prompt_tokens as f64 / elapsed.max(1e-9),
            generated_tokens as f64 / elapsed.max(1e-9),
        );
        if let Some(line) = &peak_line {
            println!("  device memory at peak: {line}");
        }
        if let Some(pool) = pool {
            println!("  device memory at end:  {}", memory_line(pool));
        }
        if let Some(outcome) = oom_outcome {
            match outcome.failure {
                Some(error) => {
                    oom_failures_seen += 1;
                    println!(
                        "wave {}: the oversized request ({oom_prompt_len} prompt tokens) failed alone: {error}",
                        wave + 1
                    );
                }
                None => println!(
                    "wave {}: warning: the oversized request ({oom_prompt_len} prompt tokens) did not fail",
                    wave + 1
                ),
            }
        }
        let failed: Vec<String> = outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| o.failure.as_ref().map(|e| format!("sequence {i}: {e}")))
            .collect();
        if !failed.is_empty() {
            bail!(
                "wave {}: {} of the regular sequences failed: {}",
                wave + 1,
                failed.len(),
                failed.join("; ")
            );
        }
        let short: Vec<usize> = (0..outcomes.len())
            .filter(|&i| outcomes[i].generated != args.gen)
            .collect();
        if !short.is_empty() {
            bail!(
                "wave {}: sequences {short:?} generated fewer than --gen {} tokens",
                wave + 1,
                args.gen
            );
        }
    }
    if args.oom_request {
        if oom_failures_seen < args.waves {
            bail!("--oom-request: expected the oversized request to fail in each of {} waves, it failed in {oom_failures_seen}", args.waves);
        }
        println!("oversized requests failed alone in every wave; the other sequences finished");
    }
    Ok(())
}

/// Samples each device's memory every 100 ms for 3 s after `idle_since` and reports when it
/// came within 5% of its post-load floor; an error if that took longer than 2 s (or never
/// happened) on any device, naming it. Several pools (simulated devices) are watched together,
/// each line naming its device.
fn watch_floor(pools: &[&DevicePool], idle_since: Instant) -> anyhow::Result<()> {
    struct Watched<'a> {
        pool: &'a DevicePool,
        name: String,
        total: u64,
        floor_used: u64,
        limit: f64,
        reached: Option<Duration>,
    }
    let several = pools.len() > 1;
    let mut watched = Vec::with_capacity(pools.len());
    for &pool in pools {
        let total = pool
            .driver()
            .mem_info(pool.device())
            .context("cannot read the device's memory")?
            .total;
        let report = pool.report();
        let Some(floor_free) = report.at_load.and_then(|s| s.device_free) else {
            bail!("the post-load memory of the device was not recorded: expected a free-memory figure at load");
        };
        let floor_used = total.saturating_sub(floor_free);
        let limit = floor_used as f64 * (1.0 + FLOOR_TOLERANCE);
        let floor_held = report.at_load.map_or(0, |s| s.held);
        let name = if several {
            format!("{} ", report.device_name)
        } else {
            String::new()
        };
        println!(
            "idle: {name}device memory used at load {} (pool held {}); watching for {:.0} s whether it returns within {:.0}% ({})",
            format_bytes(floor_used),
            format_bytes(floor_held),
            SAMPLE_FOR.as_secs_f64(),
            FLOOR_TOLERANCE * 100.0,
            format_bytes(limit as u64)
        );
        watched.push(Watched {
            pool,
            name,
            total,
            floor_used,
            limit,
            reached: None,
        });
    }
    while idle_since.elapsed() < SAMPLE_FOR {
        let now = idle_since.elapsed();
        for w in &mut watched {
            let used = match w.pool.driver().mem_info(w.pool.device()) {
                Ok(m) => w.total.saturating_sub(m.free),
                Err(error) => bail!("cannot read the {}device's free memory: {error}", w.name),
            };
            let within = (used as f64) <= w.limit;
            if within && w.reached.is_none() {
                w.reached = Some(now);
            } else if !within {
                w.reached = None;
            }
            println!(
                "  +{:.1} s: {}used {} ({:+.1}% of the floor), pool held {}",
                now.as_secs_f64(),
                w.name,
                format_bytes(used),
                (used as f64 / w.floor_used.max(1) as f64 - 1.0) * 100.0,
                format_bytes(w.pool.usage().held)
            );
        }
        std::thread::sleep(SAMPLE_EVERY);
    }
    for w in &watched {
        let device = w.name.trim_end();
        let on = if device.is_empty() {
            String::new()
        } else {
            format!(" of {device}")
        };
        match w.reached {
            Some(at) if at <= FLOOR_DEADLINE => println!(
                "device memory{on} was back within {:.0}% of the post-load floor {:.1} s after idle",
                FLOOR_TOLERANCE * 100.0,
                at.as_secs_f64()
            ),
            Some(at) => bail!(
                "device memory{on} came back within {:.0}% of the post-load floor only {:.1} s after idle: expected within {:.0} s",
                FLOOR_TOLERANCE * 100.0,
                at.as_secs_f64(),
                FLOOR_DEADLINE.as_secs_f64()
            ),
            None => bail!(
                "device memory{on} did not come back within {:.0}% of the post-load floor ({}) in {:.0} s of idle",
                FLOOR_TOLERANCE * 100.0,
                format_bytes(w.limit as u64),
                SAMPLE_FOR.as_secs_f64()
            ),
        }
    }
    Ok(())
}
