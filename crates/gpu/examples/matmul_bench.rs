//! Times `matmul`'s paths on the matrix shapes of Llama-3.1-8B for 1 to 128 tokens and prints,
//! for each, the time per call, the weight bandwidth it reaches (the matrix's bytes over the
//! time: what a path that reads the weights once per call would need) and the path `matmul`
//! picks (`ops::auto_path`). This is how `ops::MATVEC_MAX_TOKENS` and `ops::MMQ_MAX_TOKENS` were
//! placed.
//!
//! Usage (the kernels directory as for `ops_check`):
//!
//! ```text
//! EMBER_KERNELS_DIR=DIR matmul_bench [--formats q4_0,q4_K,q6_K] [--tokens 1,2,4,...]
//!     [--shapes 4096x4096,14336x4096,...] [--paths matvec,mmq,blas,tiled] [--repeats 5]
//! ```
//!
//! Every measurement is the median over `--repeats` runs of 10 calls timed with device events,
//! after a warm-up call. The weights are random bytes (only the speed is measured; f16 scales
//! stay finite) in enough copies to span 256 MiB, and successive calls take successive copies, so
//! that the matrix is read from device memory rather than from the L2 cache. With no GPU it says
//! so and exits 0.

// OpsError keeps PoolError (and its driver error) inline; its size is not a concern here.
#![allow(clippy::result_large_err)]

use std::process::ExitCode;
use std::sync::Arc;

use ember_gpu::cuda::CudaDriver;
use ember_gpu::driver::Driver;
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::{default_kernels_dir, KernelLibrary};
use ember_gpu::ops::{self, DeviceMatrix, GpuContext, MatmulPath, WeightFormat};
use ember_gpu::pool::{DevicePool, PoolConfig, PoolSelectOptions, Purpose};

/// The 8B shapes (rows x columns): attention q and o, the FFN's gate and up, its down
/// projection, and attention k and v (grouped-query: 8 of 32 heads).
const SHAPES: [(usize, usize); 4] = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)];
const TOKENS: [usize; 13] = [1, 2, 4, 8, 9, 12, 16, 24, 32, 48, 64, 96, 128];
/// Bytes of weight copies to rotate through (several times the L2 of current GPUs).
const ROTATION_BYTES: usize = 256 << 20;
const CALLS_PER_REPEAT: usize = 10;

/// One path's time for one token count.
struct Timing {
    label: &'static str,
    path: MatmulPath,
    seconds: f64,
}

struct Options {
    formats: Vec<WeightFormat>,
    tokens: Vec<usize>,
    shapes: Vec<(usize, usize)>,
    paths: Vec<(MatmulPath, &'static str)>,
    repeats: usize,
}

fn parse_list<T>(
    value: &str,
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Vec<T>, String> {
    value
        .split(',')
        .map(|item| parse(item.trim()).ok_or_else(|| format!("{what}: cannot read {item:?}")))
        .collect()
}

fn parse_path(name: &str) -> Option<(MatmulPath, &'static str)> {
    match name {
        "matvec" => Some((MatmulPath::MatVec, "matvec")),
        "mmq" => Some((MatmulPath::Mmq, "mmq")),
        "blas" => Some((MatmulPath::Blas, "blas")),
        "tiled" => Some((MatmulPath::Tiled, "tiled")),
        _ => None,
    }
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        formats: vec![WeightFormat::Q4_0, WeightFormat::Q4K, WeightFormat::Q6K],
        tokens: TOKENS.to_vec(),
        shapes: SHAPES.to_vec(),
        paths: ["matvec", "mmq", "blas"]
            .iter()
            .filter_map(|p| parse_path(p))
            .collect(),
        repeats: 5,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = args
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?;
        match flag {
            "--formats" => options.formats = parse_list(value, flag, WeightFormat::from_name)?,
            "--tokens" => options.tokens = parse_list(value, flag, |t| t.parse().ok())?,
            "--shapes" => {
                options.shapes = parse_list(value, flag, |s| {
                    let (rows, cols) = s.split_once('x')?;
                    Some((rows.parse().ok()?, cols.parse().ok()?))
                })?
            }
            "--paths" => options.paths = parse_list(value, flag, parse_path)?,
            "--repeats" => {
                options.repeats =
                    value.parse().ok().filter(|&r| r > 0).ok_or_else(|| {
                        format!("{flag}: expected a positive count, found {value:?}")
                    })?
            }
            other => return Err(format!("unknown flag {other}")),
        }
        i += 2;
    }
    Ok(options)
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Random bytes with bit 7 and bit 2 clear, so any two of them read as an f16 are finite.
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend(self.next_u64().to_le_bytes().map(|b| b & 0x7b));
        }
        out.truncate(n);
        out
    }

    fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }
}

fn load_driver() -> Result<Arc<dyn Driver>, String> {
    let cuda = match CudaDriver::load() {
        Ok(driver) if driver.device_count().unwrap_or(0) > 0 => return Ok(Arc::new(driver)),
        Ok(_) => "the CUDA driver reports no device".to_string(),
        Err(error) => error.to_string(),
    };
    let hip = match HipDriver::load(&HipLoadOptions::default()) {
        Ok(driver) if driver.device_count().unwrap_or(0) > 0 => return Ok(Arc::new(driver)),
        Ok(_) => "the HIP runtime reports no device".to_string(),
        Err(error) => error.to_string(),
    };
    Err(format!("CUDA: {cuda}; HIP: {hip}"))
}

/// Median seconds per call of `f(i)` (i counts calls, for rotating inputs), timed with events.
fn time_calls(
    ctx: &GpuContext,
    repeats: usize,
    mut f: impl FnMut(usize) -> Result<(), ops::OpsError>,
) -> Result<f64, Box<dyn std::error::Error>> {
    f(0)?;
    ctx.synchronize()?;
    let driver = ctx.driver();
    let start = driver.event_create(ctx.device())?;
    let stop = driver.event_create(ctx.device())?;
    let mut samples = Vec::with_capacity(repeats);
    let mut call = 1;
    for _ in 0..repeats {
        driver.event_record(ctx.device(), start, ctx.stream())?;
        for _ in 0..CALLS_PER_REPEAT {
            f(call)?;
            call += 1;
        }
        driver.event_record(ctx.device(), stop, ctx.stream())?;
        driver.event_synchronize(ctx.device(), stop)?;
        let ms = driver.event_elapsed_ms(ctx.device(), start, stop)?;
        samples.push(ms as f64 / 1e3 / CALLS_PER_REPEAT as f64);
    }
    driver.event_destroy(ctx.device(), start)?;
    driver.event_destroy(ctx.device(), stop)?;
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let options = parse_options()?;
    let driver = match load_driver() {
        Ok(driver) => driver,
        Err(reason) => {
            println!("matmul_bench: skipped, no GPU: {reason}");
            return Ok(false);
        }
    };
    let info = driver.device_info(0)?;
    println!(
        "matmul_bench: {} device 0: {} ({}, {} multiprocessors)",
        driver.backend(),
        info.name,
        info.arch,
        info.multiprocessor_count
    );
    let pool = Arc::new(DevicePool::new(
        Arc::clone(&driver),
        0,
        &PoolSelectOptions::default(),
        PoolConfig::default(),
        None,
    )?);
    let kernels = Arc::new(KernelLibrary::new(default_kernels_dir()));
    let ctx = GpuContext::new(Arc::clone(&pool), kernels)?;
    println!(
        "matmul_bench: BLAS {}; matvec up to {} tokens, mmq up to {} tokens, mmq target {} blocks",
        if ctx.blas().is_loaded() {
            "loaded"
        } else {
            "absent"
        },
        ops::matvec_max_tokens(),
        ops::mmq_max_tokens(),
        std::env::var(ops::MMQ_TARGET_BLOCKS_ENV)
            .unwrap_or_else(|_| ops::MMQ_TARGET_BLOCKS.to_string()),
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let max_tokens = options.tokens.iter().copied().max().unwrap_or(1);
    for &format in &options.formats {
        for &(rows, cols) in &options.shapes {
            let bytes_per_matrix = DeviceMatrix::bytes_for(format, rows, cols)?;
            let copies = ROTATION_BYTES.div_ceil(bytes_per_matrix).clamp(1, 64);
            let host = rng.bytes(bytes_per_matrix);
            let mut matrices = Vec::with_capacity(copies);
            for _ in 0..copies {
                let buffer = ctx.alloc(Purpose::Weights, bytes_per_matrix as u64)?;
                ctx.upload(buffer.ptr(), &host)?;
                matrices.push(DeviceMatrix::new(buffer, format, rows, cols)?);
            }
            let x = rng.floats(max_tokens * cols);
            let dx = ctx.alloc(Purpose::Scratch, (x.len() * 4) as u64)?;
            ctx.upload(
                dx.ptr(),
                &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
            )?;
            let dout = ctx.alloc(Purpose::Scratch, (max_tokens * rows * 4) as u64)?;
            let mut best_by_tokens = Vec::new();
            for &n_tokens in &options.tokens {
                let auto = ops::auto_path(&ctx, &matrices[0], n_tokens);
                let mut line = format!("BENCH {format:<5} {rows:>5}x{cols:<5} {n_tokens:>3} tok:");
                let mut timings = Vec::new();
                for &(path, label) in &options.paths {
                    if path == MatmulPath::Blas && !ctx.blas().is_loaded() {
                        continue;
                    }
                    if path == MatmulPath::Mmq && !ops::has_mmq_kernels(format) {
                        continue;
                    }
                    let seconds = time_calls(&ctx, options.repeats, |call| {
                        let matrix = &matrices[call % copies];
                        ops::matmul_with(&ctx, matrix, dx.ptr(), n_tokens, dout.ptr(), path)
                    })?;
                    line.push_str(&format!(
                        " {label} {:8.1} us {:6.0} GB/s |",
                        seconds * 1e6,
                        bytes_per_matrix as f64 / seconds / 1e9
                    ));
                    timings.push(Timing {
                        label,
                        path,
                        seconds,
                    });
                }
                let best = timings
                    .iter()
                    .min_by(|a, b| a.seconds.total_cmp(&b.seconds))
                    .map_or("-", |t| t.label);
                let auto_label = format!("{auto:?}").to_lowercase();
                line.push_str(&format!(" auto {auto_label}, fastest {best}"));
                println!("{line}");
                best_by_tokens.push((n_tokens, timings));
            }
            summarize(format, rows, cols, &best_by_tokens);
        }
    }
    println!("{}", pool.report());
    Ok(true)
}

/// One line per matrix: the largest token count at which mmq beats BLAS, and the smallest at
/// which it beats the matrix-vector path.
fn summarize(format: WeightFormat, rows: usize, cols: usize, results: &[(usize, Vec<Timing>)]) {
    let time_of = |timings: &[Timing], path: MatmulPath| {
        timings.iter().find(|t| t.path == path).map(|t| t.seconds)
    };
    let mut beats_blas_up_to = None;
    let mut beats_matvec_from = None;
    for (n_tokens, timings) in results {
        let Some(mmq) = time_of(timings, MatmulPath::Mmq) else {
            continue;
        };
        if time_of(timings, MatmulPath::Blas).is_some_and(|blas| mmq < blas) {
            beats_blas_up_to = Some(*n_tokens);
        }
        if beats_matvec_from.is_none()
            && time_of(timings, MatmulPath::MatVec).is_some_and(|matvec| mmq < matvec)
        {
            beats_matvec_from = Some(*n_tokens);
        }
    }
    let show = |v: Option<usize>| v.map_or("-".to_string(), |n| n.to_string());
    println!(
        "CROSSOVER {format:<5} {rows}x{cols}: mmq beats blas up to {} tokens, beats matvec from {} tokens",
        show(beats_blas_up_to),
        show(beats_matvec_from)
    );
}

fn main() -> ExitCode {
    match run() {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            println!("matmul_bench: FAILED: {error}");
            ExitCode::FAILURE
        }
    }
}
