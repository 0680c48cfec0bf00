//! `ember bench`: llama-bench's measurements. `ppN` evaluates N random tokens in one batch from an
//! empty cache (prompt tokens per second); `tgN` generates N tokens one at a time from an empty
//! cache (generated tokens per second). Each test runs once to warm up, then `-r` times; the table
//! shows mean ± sample standard deviation, and the median. The header says where it ran (the
//! CPU's threads, or the GPU device and its memory pool), as `-ngl` and `--device` chose.
//!
//! `-d N` (llama-bench's `--n-depth`) measures at depth: before each run the cache is filled with
//! N random tokens (in prompt batches of [`DEPTH_CHUNK`], not timed), so `pp512 @ d8192` reads
//! 512 tokens that attend to 8192 earlier ones and `tg128 @ d8192` generates after them.

use std::time::Instant;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use ember::backend::Backend;
use ember::batch::Batch;
use ember::load::Loaded;
use ember::model::ContextParams;
use ember::sample::Pcg32;
use ember::with_loaded;

use super::device::DeviceArgs;
use super::load;

/// Tokens per forward pass while filling the cache to a test's depth.
const DEPTH_CHUNK: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchFormat {
    /// A markdown table like llama-bench's.
    Md,
    /// One JSON array of results.
    Json,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// Prompt lengths to test (comma-separated; 0 skips).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 skips).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Depths to test at (comma-separated): tokens already in the cache before each test, filled
    /// untimed, as llama-bench's `-d`.
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// Worker threads (0, the default: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = BenchFormat::Md)]
    pub output: BenchFormat,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Debug, Clone, serde::Serialize)]
struct BenchResult {
    test: String,
    backend: &'static str,
    device: String,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    threads: usize,
    samples_ts: Vec<f64>,
    avg_ts: f64,
    stddev_ts: f64,
    median_ts: f64,
}

fn stats(samples: &[f64]) -> (f64, f64, f64) {
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = if samples.len() > 1 {
        samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    let median = if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    };
    (mean, var.sqrt(), median)
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    ember::limits::check_positive(args.repetitions).map_err(|e| anyhow::anyhow!("-r {e}"))?;
    for (flag, lengths) in [
        ("-p", &args.n_prompt),
        ("-n", &args.n_gen),
        ("-d", &args.n_depth),
    ] {
        for &n in lengths {
            ember::limits::check_context(n, 1, 0, None)
                .map_err(|e| anyhow::anyhow!("{flag} {n}: {e}"))?;
        }
    }
    let threads = if args.threads == 0 {
        ember::backend::cpu::physical_cores()
    } else {
        args.threads
    };
    let loaded = load::load_on(&args.model, threads, &args.device)?;
    with_loaded!(loaded, |loaded| bench_on(&loaded, &args, threads))
}

fn bench_on<B: Backend>(
    loaded: &Loaded<B>,
    args: &BenchArgs,
    threads: usize,
) -> anyhow::Result<()> {
    let model = &loaded.model;
    let n_vocab = model.n_vocab() as u32;
    let device = model.backend().describe();
    let reps = args.repetitions;
    let max_test = args
        .n_prompt
        .iter()
        .chain(&args.n_gen)
        .copied()
        .max()
        .unwrap_or(0);
    let max_depth = args.n_depth.iter().copied().max().unwrap_or(0);
    let max_len = max_test
        .checked_add(max_depth)
        .ok_or_else(|| anyhow::anyhow!("-d {max_depth} with -p/-n {max_test}: too long"))?
        .max(1);
    // The KV cache goes where the model is: this process's memory, or the device's.
    let memory = ember::limits::KvMemory::of(loaded.pool.as_deref());
    ember::limits::check_context(
        max_len,
        1,
        model.hparams().kv_bytes_per_token(),
        memory.as_ref(),
    )
    .map_err(|e| anyhow::anyhow!("-d + -p/-n = {max_len}: {e}"))?;
    let mut ctx = model.new_context(ContextParams::with_ctx(max_len));
    let mut rng = Pcg32::new(42);
    let mut results = Vec::new();
    let mut batch = Batch::new();

    // Fills the cache with `depth` random tokens (untimed): what each test starts from.
    let fill = |depth: usize, rng: &mut Pcg32, ctx: &mut _| -> anyhow::Result<()> {
        ember::model::Context::clear(ctx);
        let mut pos = 0;
        while pos < depth {
            let n = DEPTH_CHUNK.min(depth - pos);
            let tokens: Vec<u32> = (0..n).map(|_| rng.next_u32() % n_vocab).collect();
            let batch = Batch::for_sequence(0, pos as u32, &tokens, false);
            model
                .forward(ctx, &batch)
                .with_context(|| format!("filling the cache to depth {depth} failed"))?;
            pos += n;
        }
        Ok(())
    };
    let run_pp = |n: usize, depth: usize, rng: &mut Pcg32, ctx: &mut _| -> anyhow::Result<f64> {
        fill(depth, rng, ctx)?;
        let tokens: Vec<u32> = (0..n).map(|_| rng.next_u32() % n_vocab).collect();
        let batch = Batch::for_sequence(0, depth as u32, &tokens, false);
        let start = Instant::now();
        let logits = model
            .forward(ctx, &batch)
            .context("prompt evaluation failed")?;
        let elapsed = start.elapsed().as_secs_f64();
        check_logits(
            logits,
            &format!("pp{n}, the prompt's last position {}", depth + n - 1),
        )?;
        Ok(n as f64 / elapsed)
    };
    // `test` names the test in errors (its warm-up generates one token under the same name).
    let run_tg = |test: &str,
                  count: usize,
                  depth: usize,
                  rng: &mut Pcg32,
                  ctx: &mut _,
                  batch: &mut Batch|
     -> anyhow::Result<f64> {
        fill(depth, rng, ctx)?;
        let start = Instant::now();
        for pos in depth..depth + count {
            batch.clear();
            batch.push(rng.next_u32() % n_vocab, pos as u32, 0, true);
            let logits = model
                .forward(ctx, batch)
                .context("generation step failed")?;
            check_logits(logits, &format!("{test}, position {pos}"))?;
        }
        Ok(count as f64 / start.elapsed().as_secs_f64())
    };
    for &depth in &args.n_depth {
        let at = if depth > 0 {
            format!(" @ d{depth}")
        } else {
            String::new()
        };
        for &n in args.n_prompt.iter().filter(|&&n| n > 0) {
            run_pp(n, depth, &mut rng, &mut ctx)?;
            let samples = (0..reps)
                .map(|_| run_pp(n, depth, &mut rng, &mut ctx))
                .collect::<anyhow::Result<Vec<_>>>()?;
            results.push(result(format!("pp{n}{at}"), n, 0, depth, threads, samples));
        }
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            let test = format!("tg{n}{at}");
            run_tg(&test, 1, depth, &mut rng, &mut ctx, &mut batch)?;
            let samples = (0..reps)
                .map(|_| run_tg(&test, n, depth, &mut rng, &mut ctx, &mut batch))
                .collect::<anyhow::Result<Vec<_>>>()?;
            results.push(result(test, 0, n, depth, threads, samples));
        }
    }

    for r in &mut results {
        r.backend = model.backend().name();
        r.device.clone_from(&device);
    }
    let file_size = model.gguf().file_size() as f64;
    let n_params: u64 = model.gguf().tensors().iter().map(|t| t.n_elements()).sum();
    let name = loaded
        .path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    match args.output {
        BenchFormat::Json => println!("{}", serde_json::to_string_pretty(&results)?),
        BenchFormat::Md => {
            println!("device: {device}");
            println!("| model | size | params | backend | threads | test | t/s | median t/s |");
            println!("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |");
            for r in &results {
                println!(
                    "| {name} | {:.2} MiB | {:.2} M | {} | {} | {} | {:.2} ± {:.2} | {:.2} |",
                    file_size / (1024.0 * 1024.0),
                    n_params as f64 / 1e6,
                    model.backend().name(),
                    r.threads,
                    r.test,
                    r.avg_ts,
                    r.stddev_ts,
                    r.median_ts
                );
            }
        }
    }
    drop(ctx);
    load::finish(loaded);
    Ok(())
}

/// Fails a run whose logits hold NaN or +inf: its speed would be reported for a model that
/// computes nothing usable. `at` names the test and position.
fn check_logits(logits: &[f32], at: &str) -> anyhow::Result<()> {
    if ember::sample::logits_are_sane(logits) {
        Ok(())
    } else {
        anyhow::bail!("{at}: {}", ember::sample::NON_FINITE_MESSAGE)
    }
}

fn result(
    test: String,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    threads: usize,
    samples: Vec<f64>,
) -> BenchResult {
    let (avg_ts, stddev_ts, median_ts) = stats(&samples);
    BenchResult {
        test,
        backend: "",
        device: String::new(),
        n_prompt,
        n_gen,
        n_depth,
        threads,
        samples_ts: samples,
        avg_ts,
        stddev_ts,
        median_ts,
    }
}

#[cfg(test)]
mod tests {
    use super::stats;

    #[test]
    fn stats_are_mean_sample_stddev_and_median() {
        let (mean, sd, median) = stats(&[1.0, 2.0, 3.0, 10.0]);
        assert_eq!(mean, 4.0);
        assert!((sd - (50.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(median, 2.5);
    }
}
