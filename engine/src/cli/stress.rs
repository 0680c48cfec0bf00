//! `ember stress`: a load test of one model instance. Each wave runs several sequences at once
//! with mixed prompt lengths: every step packs the decoding sequences' next tokens and chunks of
//! the prompts still being read into one batch of at most `--ubatch` tokens, so long and short
//! prompts and decoding share forward passes as a continuous-batching server would. A sequence is
//! freed (and its KV memory handed back) as soon as it has generated `--gen` tokens.
//!
//! Per wave it prints tokens per second and device memory (the pool's accounting and the
//! driver's free memory). After the last wave it samples device memory every 100 ms for 3 s and
//! reports when it came back within 5% of the post-load floor; the command fails (exit code 1)
//! if that took longer than 2 s.
//!
//! `--oom-request` adds one request per wave that cannot succeed, submitted after the first step
//! of the wave (so the others already hold KV memory) as one batch of its whole prompt: with
//! `--vram-budget`, a prompt whose KV cache alone exceeds the budget; without one, a short request
//! whose forward pass is made to fail as an out-of-memory failure would (the device may have far
//! more memory than is practical to fill). The command checks that it fails alone: the other
//! sequences finish and the context stays usable.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use ember_gpu::pool::format_bytes;
use ember_gpu::{DevicePool, Purpose};

use super::device::DeviceArgs;
use super::load::{self, AnyLoaded, Loaded};
use crate::backend::Backend;
use crate::batch::{Batch, SeqId};
use crate::kv_cache::DEFAULT_BLOCK_SIZE;
use crate::model::{Context, ContextParams, ForwardError, Model};
use crate::sample::Pcg32;

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
    /// Worker threads on the CPU (default: physical cores).
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
    if args.parallel == 0 || args.waves == 0 || args.ubatch == 0 {
        bail!(
            "--parallel, --waves and --ubatch: expected positive values, found {}, {} and {}",
            args.parallel,
            args.waves,
            args.ubatch
        );
    }
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    match loaded {
        AnyLoaded::Cpu(loaded) => stress_on(&loaded, &args, None),
        AnyLoaded::Gpu(loaded) => {
            let backend = loaded.model.backend();
            let inject = || backend.inject_out_of_memory();
            stress_on(&loaded, &args, Some(&inject))
        }
    }
}

/// One request of a wave.
struct Request {
    seq_id: SeqId,
    prompt: Vec<u32>,
    /// Prompt tokens evaluated so far.
    fed: usize,
    generated: usize,
    /// The token to feed next once the prompt is read.
    next: u32,
    done: bool,
    failure: Option<ForwardError>,
}

impl Request {
    /// Whether the prompt is read and the sequence generates.
    fn decoding(&self) -> bool {
        self.fed == self.prompt.len()
    }

    /// Takes a generated token; ends the sequence (freeing its KV memory) after `gen` tokens.
    fn accept<B: Backend>(
        &mut self,
        token: u32,
        gen: usize,
        ctx: &mut Context<B>,
        model: &Model<B>,
    ) {
        self.next = token;
        self.generated += 1;
        if self.generated >= gen.max(1) {
            self.end(ctx, model);
        }
    }

    fn end<B: Backend>(&mut self, ctx: &mut Context<B>, model: &Model<B>) {
        self.done = true;
        ctx.free_sequence(self.seq_id);
        ctx.release_free_kv(model, 0);
    }
}

/// A request's part of a batch.
struct Member {
    index: usize,
    /// Tokens of the request in the batch.
    count: usize,
    /// The request was generating (one token with logits) rather than reading its prompt.
    decoding: bool,
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
        "live {} (weights {}, kv {}, scratch {}), held {}, driver free {free}",
        format_bytes(usage.live),
        format_bytes(usage.purpose(Purpose::Weights).current),
        format_bytes(usage.purpose(Purpose::Kv).current),
        format_bytes(usage.purpose(Purpose::Scratch).current),
        format_bytes(usage.held),
    )
}

/// Bytes of KV cache one token takes on every layer together (f16 K and V).
fn kv_bytes_per_token<B: Backend>(model: &Model<B>) -> u64 {
    let hp = model.hparams();
    hp.layers
        .iter()
        .map(|l| (2 * l.n_head_kv * hp.head_dim_k * 2) as u64)
        .sum()
}

fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn stress_on<B: Backend>(
    loaded: &Loaded<B>,
    args: &StressArgs,
    inject_oom: Option<&dyn Fn()>,
) -> anyhow::Result<()> {
    let model = &loaded.model;
    let n_vocab = model.n_vocab() as u32;
    if args.oom_request && loaded.pool.is_none() {
        bail!("--oom-request: expected the model on a GPU (the request shows a device out-of-memory failure staying with its request), found it on the CPU");
    }
    eprintln!(
        "stress: {} on {}",
        loaded.path.display(),
        model.backend().describe()
    );
    let longest = args.prompts.iter().copied().max().unwrap_or(1);
    // The OOM request's prompt: with a budget, long enough that its KV cache alone exceeds it;
    // without one it is short and its failure is injected.
    let oom_prompt_len = match (args.oom_request, args.device.vram_budget, &loaded.pool) {
        (false, _, _) => 0,
        (true, Some(budget), Some(_)) => {
            (budget / kv_bytes_per_token(model)).saturating_add(1) as usize * 5 / 4 + 1
        }
        (true, _, _) => args.prompts[0],
    };
    let n_ctx = longest.max(oom_prompt_len) + args.gen + 1;
    let n_seqs = args.parallel + usize::from(args.oom_request);
    let mut ctx = model.new_context(ContextParams {
        n_ctx,
        kv_block_size: DEFAULT_BLOCK_SIZE,
        kv_capacity_tokens: n_ctx * n_seqs,
    });
    let mut rng = Pcg32::new(args.seed);
    let mut batch = Batch::new();
    let mut oom_failures_seen = 0;

    for wave in 0..args.waves {
        let mut requests: Vec<Request> = (0..args.parallel)
            .map(|i| {
                let len = args.prompts[(wave * args.parallel + i) % args.prompts.len()];
                Request {
                    seq_id: i as SeqId,
                    prompt: (0..len).map(|_| rng.next_u32() % n_vocab).collect(),
                    fed: 0,
                    generated: 0,
                    next: 0,
                    done: false,
                    failure: None,
                }
            })
            .collect();
        let start = Instant::now();
        let (mut prompt_tokens, mut generated_tokens) = (0usize, 0usize);
        let mut peak_line = None;
        let mut step = 0usize;
        while requests.iter().any(|r| !r.done) {
            // Decoding sequences first (one token each), then prompt chunks in the room left.
            batch.clear();
            let mut members: Vec<Member> = Vec::new();
            for (index, r) in requests.iter().enumerate().filter(|(_, r)| !r.done) {
                if r.decoding() {
                    let pos = (r.prompt.len() + r.generated - 1) as u32;
                    batch.push(r.next, pos, r.seq_id, true);
                    members.push(Member {
                        index,
                        count: 1,
                        decoding: true,
                    });
                }
            }
            for (index, r) in requests.iter().enumerate().filter(|(_, r)| !r.done) {
                let room = args.ubatch.saturating_sub(batch.len());
                if r.decoding() || room == 0 {
                    continue;
                }
                let take = room.min(r.prompt.len() - r.fed);
                for pos in r.fed..r.fed + take {
                    batch.push(
                        r.prompt[pos],
                        pos as u32,
                        r.seq_id,
                        pos + 1 == r.prompt.len(),
                    );
                }
                members.push(Member {
                    index,
                    count: take,
                    decoding: false,
                });
            }
            match model.forward(&mut ctx, &batch) {
                Ok(logits) => {
                    let n_vocab = n_vocab as usize;
                    // Rows of logits follow the batch order of the tokens that asked for them.
                    let tokens: Vec<u32> = logits.chunks_exact(n_vocab).map(greedy).collect();
                    let mut next = tokens.into_iter();
                    for member in &members {
                        let r = &mut requests[member.index];
                        if !member.decoding {
                            r.fed += member.count;
                            prompt_tokens += member.count;
                            if !r.decoding() {
                                continue;
                            }
                        }
                        // This member's last token asked for logits: the next generated token.
                        let Some(token) = next.next() else {
                            bail!(
                                "wave {}: expected a row of logits for sequence {}, found none",
                                wave + 1,
                                r.seq_id
                            );
                        };
                        generated_tokens += 1;
                        r.accept(token, args.gen, &mut ctx, model);
                    }
                }
                Err(error) => {
                    // A mixed batch failed: nothing of it stayed in the cache, so the requests
                    // are retried alone, and only those that fail alone fail.
                    eprintln!(
                        "wave {}: a batch of {} sequences failed ({error}); retrying each alone",
                        wave + 1,
                        members.len()
                    );
                    for member in &members {
                        let (p, g) = run_alone(
                            model,
                            &mut ctx,
                            &mut requests[member.index],
                            args,
                            &mut batch,
                        );
                        prompt_tokens += p;
                        generated_tokens += g;
                    }
                }
            }
            if let Some(pool) = &loaded.pool {
                let usage = pool.usage();
                if peak_line
                    .as_ref()
                    .is_none_or(|(held, _)| usage.held > *held)
                {
                    peak_line = Some((usage.held, memory_line(pool)));
                }
            }
            // The oversized request arrives once the others hold KV memory, as one batch of its
            // whole prompt: it must fail without disturbing them.
            if step == 0 && args.oom_request {
                let failure = run_oversized(
                    model,
                    &mut ctx,
                    args.parallel as SeqId,
                    oom_prompt_len,
                    &mut rng,
                    inject_oom.filter(|_| args.device.vram_budget.is_none()),
                );
                match failure {
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
            step += 1;
        }
        let elapsed = start.elapsed().as_secs_f64();
        let failed: Vec<String> = requests
            .iter()
            .filter_map(|r| r.failure.as_ref().map(|e| format!("seq {}: {e}", r.seq_id)))
            .collect();
        let lens: Vec<String> = requests
            .iter()
            .map(|r| r.prompt.len().to_string())
            .collect();
        println!(
            "wave {}: {} sequences (prompts {}), {prompt_tokens} prompt + {generated_tokens} generated tokens in {elapsed:.2} s: {:.1} t/s ({:.1} prompt t/s, {:.1} generated t/s)",
            wave + 1,
            requests.len(),
            lens.join(", "),
            (prompt_tokens + generated_tokens) as f64 / elapsed.max(1e-9),
            prompt_tokens as f64 / elapsed.max(1e-9),
            generated_tokens as f64 / elapsed.max(1e-9),
        );
        if let Some((_, line)) = &peak_line {
            println!("  device memory at peak: {line}");
        }
        if let Some(pool) = &loaded.pool {
            println!("  device memory at end:  {}", memory_line(pool));
        }
        if !failed.is_empty() {
            bail!(
                "wave {}: {} of the regular sequences failed: {}",
                wave + 1,
                failed.len(),
                failed.join("; ")
            );
        }
    }
    if args.oom_request {
        if oom_failures_seen < args.waves {
            bail!("--oom-request: expected the oversized request to fail in each of {} waves, it failed in {oom_failures_seen}", args.waves);
        }
        println!("oversized requests failed alone in every wave; the other sequences finished");
    }

    // Idle: every sequence has ended. Activations and KV memory go back to the pool, and the
    // backend's trimmer hands the pool's memory back to the driver.
    ctx.clear();
    ctx.release_free_kv(model, 0);
    ctx.release_scratch(model);
    let idle_since = Instant::now();
    let result = match &loaded.pool {
        Some(pool) => watch_floor(pool, idle_since),
        None => {
            println!("memory: the model runs on the CPU; no device memory to watch");
            Ok(())
        }
    };
    drop(ctx);
    loaded.finish();
    result
}

/// Evaluates one request's next step in a batch of its own; a failure is recorded on the request
/// and ends it. Returns the prompt and generated tokens it evaluated.
fn run_alone<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    r: &mut Request,
    args: &StressArgs,
    batch: &mut Batch,
) -> (usize, usize) {
    if r.done {
        return (0, 0);
    }
    batch.clear();
    let decoding = r.decoding();
    let take = if decoding {
        batch.push(
            r.next,
            (r.prompt.len() + r.generated - 1) as u32,
            r.seq_id,
            true,
        );
        1
    } else {
        let take = args.ubatch.min(r.prompt.len() - r.fed);
        for pos in r.fed..r.fed + take {
            batch.push(
                r.prompt[pos],
                pos as u32,
                r.seq_id,
                pos + 1 == r.prompt.len(),
            );
        }
        take
    };
    match model.forward(ctx, batch) {
        Ok(logits) => {
            let mut prompt = 0;
            if !decoding {
                r.fed += take;
                prompt = take;
                if !r.decoding() {
                    return (prompt, 0);
                }
            }
            let token = greedy(&logits[..model.n_vocab()]);
            r.accept(token, args.gen, ctx, model);
            (prompt, 1)
        }
        Err(error) => {
            eprintln!("sequence {} failed alone: {error}", r.seq_id);
            r.failure = Some(error);
            r.end(ctx, model);
            (0, 0)
        }
    }
}

/// Runs a request of `len` random tokens as one batch in sequence `seq_id`, with an injected
/// out-of-memory failure when `inject` is given; returns its error (it is expected to fail) and
/// leaves no trace of it in the cache either way.
fn run_oversized<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    seq_id: SeqId,
    len: usize,
    rng: &mut Pcg32,
    inject: Option<&dyn Fn()>,
) -> Option<ForwardError> {
    let n_vocab = model.n_vocab() as u32;
    let tokens: Vec<u32> = (0..len).map(|_| rng.next_u32() % n_vocab).collect();
    let batch = Batch::for_sequence(seq_id, 0, &tokens, false);
    if let Some(inject) = inject {
        inject();
    }
    let result = model.forward(ctx, &batch).err();
    ctx.free_sequence(seq_id);
    ctx.release_free_kv(model, 0);
    result
}

/// Samples device memory every 100 ms for 3 s after `idle_since` and reports when it came within
/// 5% of the post-load floor; an error if that took longer than 2 s (or never happened).
fn watch_floor(pool: &DevicePool, idle_since: Instant) -> anyhow::Result<()> {
    let driver = pool.driver();
    let device = pool.device();
    let total = driver
        .mem_info(device)
        .context("cannot read the device's memory")?
        .total;
    let report = pool.report();
    let Some(floor_free) = report.at_load.and_then(|s| s.device_free) else {
        bail!("the post-load memory of the device was not recorded: expected a free-memory figure at load");
    };
    let floor_used = total.saturating_sub(floor_free);
    let limit = floor_used as f64 * (1.0 + FLOOR_TOLERANCE);
    let floor_held = report.at_load.map_or(0, |s| s.held);
    println!(
        "idle: device memory used at load {} (pool held {}); watching for {:.0} s whether it returns within {:.0}% ({})",
        format_bytes(floor_used),
        format_bytes(floor_held),
        SAMPLE_FOR.as_secs_f64(),
        FLOOR_TOLERANCE * 100.0,
        format_bytes(limit as u64)
    );
    let mut reached: Option<Duration> = None;
    while idle_since.elapsed() < SAMPLE_FOR {
        let now = idle_since.elapsed();
        let used = match driver.mem_info(device) {
            Ok(m) => total.saturating_sub(m.free),
            Err(error) => bail!("cannot read the device's free memory: {error}"),
        };
        let within = (used as f64) <= limit;
        if within && reached.is_none() {
            reached = Some(now);
        } else if !within {
            reached = None;
        }
        println!(
            "  +{:.1} s: used {} ({:+.1}% of the floor), pool held {}",
            now.as_secs_f64(),
            format_bytes(used),
            (used as f64 / floor_used.max(1) as f64 - 1.0) * 100.0,
            format_bytes(pool.usage().held)
        );
        std::thread::sleep(SAMPLE_EVERY);
    }
    match reached {
        Some(at) if at <= FLOOR_DEADLINE => {
            println!(
                "device memory was back within {:.0}% of the post-load floor {:.1} s after idle",
                FLOOR_TOLERANCE * 100.0,
                at.as_secs_f64()
            );
            Ok(())
        }
        Some(at) => bail!(
            "device memory came back within {:.0}% of the post-load floor only {:.1} s after idle: expected within {:.0} s",
            FLOOR_TOLERANCE * 100.0,
            at.as_secs_f64(),
            FLOOR_DEADLINE.as_secs_f64()
        ),
        None => bail!(
            "device memory did not come back within {:.0}% of the post-load floor ({}) in {:.0} s of idle",
            FLOOR_TOLERANCE * 100.0,
            format_bytes(limit as u64),
            SAMPLE_FOR.as_secs_f64()
        ),
    }
}
