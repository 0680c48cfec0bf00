//! Checks `ember_gpu::ops::matmul_exact` on a real GPU against the CPU backend's matmul
//! (`ember_quant`, called as `engine/src/backend/cpu` calls it), bit for bit, then times it.
//!
//! Usage (the kernels directory holds `<arch>/<module>.cubin|.hsaco`, as `cargo xtask kernels`
//! or `kernels/tests/run-nvcc.sh sm_90 DIR/sm_90` lay it out):
//!
//! ```text
//! EMBER_KERNELS_DIR=DIR exact_check [--quick] [--native] [--no-bench]
//! ```
//!
//! For every weight format, token counts 1, 2, 3, 4, 5, 7, 8, 9, 16, 63, 64, 65, 130 and 300, and
//! shapes of real models (576x576, 1536x576, 640x640, 2048x640, 256x2048, an odd 99x2048, and
//! 4096x4096 for a few formats; 14336x4096 for Q4_0 and Q4_K with 1 and 64 tokens; shapes whose
//! columns are not whole blocks of the format are skipped), random weights are quantised with
//! ember-quant's reference quantiser and multiplied with random activations on both sides. One
//! line per check: `PASS name`, or `FAIL name: first mismatch at i: gpu=.. cpu=..` with the
//! output's token and row and both values' bits.
//!
//! The CPU reference is `ember_quant::matmul_with(Level::Avx2, Strategy::Auto)`: the order the
//! kernels reproduce, and what the CPU backend computes on an AVX2 machine. On an AVX-512 VNNI
//! CPU the backend's own level differs for Q2_K, Q3_K and Q5_K from 12 tokens on; every output
//! where the native level's result differs from the AVX2 one is reported on a `NOTE` line and
//! counted in the summary (with `--native`, the native result is the reference instead).
//! `--quick` runs the first three shapes only.
//!
//! With no GPU it says so and exits 0; a CPU without AVX2 cannot give the reference order and
//! exits 1. Any failed check makes it exit 1.

// OpsError keeps PoolError (and its driver error) inline so callers can match on out-of-memory
// and budget refusals; its size is not a concern on this checking path.
#![allow(clippy::result_large_err)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use ember_gpu::cuda::CudaDriver;
use ember_gpu::driver::Driver;
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::{default_kernels_dir, KernelLibrary};
use ember_gpu::ops::{self, DeviceMatrix, GpuContext, GpuContextOptions, WeightFormat};
use ember_gpu::pool::{DevicePool, PoolConfig, PoolSelectOptions, Purpose};
use ember_gpu::PoolBuffer;
use ember_quant::simd::{available_levels, Level};
use ember_quant::{GgmlType, QMatrix, Strategy};

const TOKEN_COUNTS: [usize; 14] = [1, 2, 3, 4, 5, 7, 8, 9, 16, 63, 64, 65, 130, 300];

/// A small deterministic generator (xorshift64*), so runs are reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }
}

fn ggml_type(format: WeightFormat) -> GgmlType {
    GgmlType::from_u32(format.ggml_type_id()).expect("every WeightFormat is a GGML type")
}

/// Random weights in `format`: uniform values quantised by ember-quant's reference quantiser,
/// rows split over the machine's threads (the k-quant quantisers are slow on big matrices).
fn random_weights(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let row_bytes = format.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (dst, src) in bytes
            .chunks_mut(rows_per * row_bytes)
            .zip(values.chunks(rows_per * cols))
        {
            scope.spawn(move || {
                ember_quant::quantize(ggml_type(format), src, dst).expect("quantising weights")
            });
        }
    });
    bytes
}

/// Random activations: each token at its own scale (1e-3 to 1e2), and the first block of the
/// first token all zeros (the quantisers' special case).
fn random_activations(rng: &mut Rng, n_tokens: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n_tokens * cols);
    for t in 0..n_tokens {
        let scale = 10f32.powi((t % 6) as i32 - 3);
        x.extend((0..cols).map(|_| rng.uniform(-1.0, 1.0) * scale));
    }
    let zeros = 256.min(cols);
    x[..zeros].fill(0.0);
    x
}

/// The CPU backend's matmul at `level`: activations quantised to the weights' dot-product type,
/// then `ember_quant`'s matmul with the strategy the backend uses.
fn cpu_matmul(
    level: Level,
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
) -> Result<Vec<f32>, ember_quant::QuantError> {
    let w = QMatrix::new(ty, rows, cols, weights)?;
    let act = ember_quant::quantize_activations(ember_quant::vec_dot_type(ty), x, n_tokens, cols)?;
    let mut out = vec![0.0f32; rows * n_tokens];
    ember_quant::matmul_with(level, Strategy::Auto, &w, &act, &mut out)?;
    Ok(out)
}

fn upload_bytes(
    ctx: &GpuContext,
    purpose: Purpose,
    bytes: &[u8],
) -> Result<PoolBuffer, ops::OpsError> {
    let buffer = ctx.alloc(purpose, bytes.len().max(4) as u64)?;
    ctx.upload(buffer.ptr(), bytes)?;
    Ok(buffer)
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn download_f32(
    ctx: &GpuContext,
    buffer: &PoolBuffer,
    n: usize,
) -> Result<Vec<f32>, ops::OpsError> {
    let mut bytes = vec![0u8; n * 4];
    ctx.download(buffer.ptr(), &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The first index where `a` and `b` differ in bits.
fn first_mismatch(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

struct Counts {
    passed: usize,
    failed: usize,
    native_differs: usize,
}

struct Checker<'a> {
    ctx: &'a GpuContext,
    reference: Level,
    native: Level,
    counts: Counts,
}

impl Checker<'_> {
    /// One format and shape at every token count in `token_counts`.
    fn check_shape(
        &mut self,
        rng: &mut Rng,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        token_counts: &[usize],
    ) -> Result<(), Box<dyn std::error::Error>> {
        let ty = ggml_type(format);
        let weights = random_weights(rng, format, rows, cols);
        let matrix = DeviceMatrix::new(
            upload_bytes(self.ctx, Purpose::Weights, &weights)?,
            format,
            rows,
            cols,
        )?;
        for &n_tokens in token_counts {
            let name = format!("{:<5} {rows}x{cols} t={n_tokens}", format.name());
            let x = random_activations(rng, n_tokens, cols);
            let expected = cpu_matmul(self.reference, ty, &weights, rows, cols, &x, n_tokens)?;
            if self.native != self.reference {
                let native = cpu_matmul(self.native, ty, &weights, rows, cols, &x, n_tokens)?;
                if let Some(i) = first_mismatch(&native, &expected) {
                    self.counts.native_differs += 1;
                    println!(
                        "NOTE {name}: the CPU's native level ({}) differs from {} at {i}: {} vs {}",
                        self.native.name(),
                        self.reference.name(),
                        native[i],
                        expected[i]
                    );
                }
            }
            let dx = upload_bytes(self.ctx, Purpose::Scratch, &to_bytes(&x))?;
            let dout = self
                .ctx
                .alloc(Purpose::Scratch, (rows * n_tokens * 4) as u64)?;
            ops::matmul_exact(self.ctx, &matrix, dx.ptr(), n_tokens, dout.ptr())?;
            let got = download_f32(self.ctx, &dout, rows * n_tokens)?;
            match first_mismatch(&got, &expected) {
                None => {
                    self.counts.passed += 1;
                    println!("PASS {name}");
                }
                Some(i) => {
                    self.counts.failed += 1;
                    let wrong = got
                        .iter()
                        .zip(&expected)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    println!(
                        "FAIL {name}: first mismatch at {i} (token {}, row {}): gpu={:e} ({:#010x}) cpu={:e} ({:#010x}); {wrong} of {} outputs differ",
                        i / rows,
                        i % rows,
                        got[i],
                        got[i].to_bits(),
                        expected[i],
                        expected[i].to_bits(),
                        got.len()
                    );
                }
            }
        }
        Ok(())
    }
}

/// Average seconds per call of `f` over `iterations` calls queued back to back (after one warm-up
/// call), timed with events on the context's stream.
fn time_on_stream(
    ctx: &GpuContext,
    iterations: usize,
    mut f: impl FnMut() -> Result<(), ops::OpsError>,
) -> Result<f64, Box<dyn std::error::Error>> {
    f()?;
    ctx.synchronize()?;
    let driver = ctx.driver();
    let start = driver.event_create(ctx.device())?;
    let stop = driver.event_create(ctx.device())?;
    driver.event_record(ctx.device(), start, ctx.stream())?;
    for _ in 0..iterations {
        f()?;
    }
    driver.event_record(ctx.device(), stop, ctx.stream())?;
    driver.event_synchronize(ctx.device(), stop)?;
    let ms = driver.event_elapsed_ms(ctx.device(), start, stop)?;
    driver.event_destroy(ctx.device(), start)?;
    driver.event_destroy(ctx.device(), stop)?;
    Ok(ms as f64 / 1e3 / iterations as f64)
}

/// Time per call of `matmul_exact` for 4096x4096 Q4_0 at 1 and 512 tokens (and, for scale, the
/// default `matmul`).
fn benchmark(ctx: &GpuContext, rng: &mut Rng) -> Result<(), Box<dyn std::error::Error>> {
    let (rows, cols, format) = (4096usize, 4096usize, WeightFormat::Q4_0);
    let weights = random_weights(rng, format, rows, cols);
    let matrix = DeviceMatrix::new(
        upload_bytes(ctx, Purpose::Weights, &weights)?,
        format,
        rows,
        cols,
    )?;
    for (n_tokens, iterations) in [(1usize, 50usize), (512, 5)] {
        let x = random_activations(rng, n_tokens, cols);
        let dx = upload_bytes(ctx, Purpose::Scratch, &to_bytes(&x))?;
        let dout = ctx.alloc(Purpose::Scratch, (rows * n_tokens * 4) as u64)?;
        let exact = time_on_stream(ctx, iterations, || {
            ops::matmul_exact(ctx, &matrix, dx.ptr(), n_tokens, dout.ptr())
        })?;
        let fast = time_on_stream(ctx, iterations, || {
            ops::matmul(ctx, &matrix, dx.ptr(), n_tokens, dout.ptr())
        })?;
        println!(
            "BENCH matmul_exact q4_0 {rows}x{cols} t={n_tokens}: {:10.1} us per call (default matmul {:8.1} us)",
            exact * 1e6,
            fast * 1e6
        );
    }
    Ok(())
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

/// The shapes (rows, cols) checked for `format` at every token count.
fn shapes(format: WeightFormat, quick: bool) -> Vec<(usize, usize)> {
    let mut shapes = vec![
        (576, 576),
        (1536, 576),
        (640, 640),
        (2048, 640),
        (256, 2048),
        (99, 2048),
    ];
    if matches!(
        format,
        WeightFormat::Q4_0
            | WeightFormat::Q8_0
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q6K
            | WeightFormat::F16
    ) {
        shapes.push((4096, 4096));
    }
    if quick {
        shapes.truncate(3);
    }
    shapes
        .into_iter()
        .filter(|&(_, cols)| format.row_bytes(cols).is_some())
        .collect()
}

/// The number of failed checks, or `None` when there is no GPU to check.
fn run() -> Result<Option<usize>, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let native_reference = args.iter().any(|a| a == "--native");
    let no_bench = args.iter().any(|a| a == "--no-bench");
    let native = ember_quant::simd::level();
    if !available_levels().contains(&Level::Avx2) {
        return Err(format!(
            "this CPU ({}) has no AVX2: the order the kernels reproduce cannot be computed here",
            native.name()
        )
        .into());
    }
    let driver = match load_driver() {
        Ok(driver) => driver,
        Err(reason) => {
            println!("exact_check: skipped, no GPU: {reason}");
            return Ok(None);
        }
    };
    let info = driver.device_info(0)?;
    println!(
        "exact_check: {} device 0: {} ({}), {} MiB; CPU level {}",
        driver.backend(),
        info.name,
        info.arch,
        info.total_memory >> 20,
        native.name()
    );
    let pool = Arc::new(DevicePool::new(
        Arc::clone(&driver),
        0,
        &PoolSelectOptions::default(),
        PoolConfig::default(),
        None,
    )?);
    let kernels = Arc::new(KernelLibrary::new(default_kernels_dir()));
    println!("exact_check: kernels from {}", kernels.dir().display());
    let ctx = GpuContext::with_options(
        Arc::clone(&pool),
        kernels,
        &GpuContextOptions { disable_blas: true },
    )?;
    let reference = if native_reference {
        native
    } else {
        Level::Avx2
    };
    println!("exact_check: CPU reference at level {}", reference.name());
    let mut checker = Checker {
        ctx: &ctx,
        reference,
        native,
        counts: Counts {
            passed: 0,
            failed: 0,
            native_differs: 0,
        },
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let started = Instant::now();
    for format in WeightFormat::ALL {
        for (rows, cols) in shapes(format, quick) {
            if let Err(error) = checker.check_shape(&mut rng, format, rows, cols, &TOKEN_COUNTS) {
                checker.counts.failed += 1;
                println!("FAIL {} {rows}x{cols}: {error}", format.name());
            }
        }
    }
    if !quick {
        for format in [WeightFormat::Q4_0, WeightFormat::Q4K] {
            if let Err(error) = checker.check_shape(&mut rng, format, 14336, 4096, &[1, 64]) {
                checker.counts.failed += 1;
                println!("FAIL {} 14336x4096: {error}", format.name());
            }
        }
    }
    let counts = &checker.counts;
    println!(
        "exact_check: {} passed, {} failed, in {:.1} s; the native CPU level differed from the reference in {} check(s)",
        counts.passed,
        counts.failed,
        started.elapsed().as_secs_f64(),
        counts.native_differs
    );
    let mut failures = counts.failed;
    if !no_bench {
        if let Err(error) = benchmark(&ctx, &mut rng) {
            failures += 1;
            println!("FAIL benchmark: {error}");
        }
    }
    Ok(Some(failures))
}

fn main() -> ExitCode {
    match run() {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(0)) => {
            println!("exact_check: ALL PASSED");
            ExitCode::SUCCESS
        }
        Ok(Some(failures)) => {
            println!("exact_check: FAILED: {failures} check(s)");
            ExitCode::FAILURE
        }
        Err(error) => {
            println!("exact_check: FAILED: {error}");
            ExitCode::FAILURE
        }
    }
}
