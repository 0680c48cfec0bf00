//! Checks `ember_gpu::ops` on a real GPU against host references computed here, then measures
//! matmul throughput.
//!
//! Usage (the kernels directory holds `<arch>/<module>.cubin|.hsaco`, as `cargo xtask kernels`
//! or `kernels/tests/run-nvcc.sh sm_90 DIR/sm_90` lay it out):
//!
//! ```text
//! EMBER_KERNELS_DIR=DIR ops_check [--quick] [--no-bench]
//! ```
//!
//! Every op's launch wrapper runs on random inputs: `matmul` for every weight format with 1, 7, 64
//! and 300 tokens through each path (matrix-vector, BLAS GEMM, the tiled fallback kernel), the
//! quantised matrix path (mmq) for 9, 16, 33, 64 and 100 tokens on every format it covers, and the
//! element-wise and row-wise ops. Host references are computed in f64 from weights dequantised by
//! ember-quant (the CPU engine's own code). Tolerances, stated per path:
//! - tiled GEMM: exact dequantisation, f32 accumulation: 1e-5 of `sum |w x|` (reordering bound);
//! - BLAS: weights and activations rounded to f16 (2^-11 relative each), f32 accumulation:
//!   1.5e-3 of `sum |w x|`;
//! - matrix-vector and mmq: activations may be quantised to 8 bits per 32-value block (q8_1,
//!   GGML's scheme), an error of at most `max|x| / 254` per value: 1/127 of `sum |w| * max|x|`;
//! - mmq against the CPU backend's own matmul (ember-quant, same activation rounding, same
//!   integer dot products per group): the group terms differ only in f32 association and are
//!   added in another order, at most `cols / 32` roundings of 2^-24 of the terms' magnitudes
//!   (1.2e-5 for 4096 columns), and the terms (minimum terms included) stay within a few times
//!   `sum |w x^|` for these matrices: 1e-4 of `sum |w x^|`, x^ the quantised activations.
//!
//! With no GPU (no CUDA or HIP driver, or no device) it says so and exits 0. Any failed check
//! makes it exit 1.

// OpsError keeps PoolError (and its driver error) inline so callers can match on out-of-memory
// and budget refusals; its size is not a concern on these checking paths.
#![allow(clippy::result_large_err)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use ember_gpu::blas::BlasStatus;
use ember_gpu::cuda::CudaDriver;
use ember_gpu::driver::Driver;
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::{default_kernels_dir, KernelLibrary};
use ember_gpu::ops::{
    self, DeviceMatrix, GpuContext, GpuContextOptions, MatmulPath, RopeMode, WeightFormat,
};
use ember_gpu::pool::{DevicePool, PoolConfig, PoolSelectOptions, Purpose};
use ember_gpu::PoolBuffer;
use ember_quant::GgmlType;
use half::f16;

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

    fn floats(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

fn ggml_type(format: WeightFormat) -> GgmlType {
    GgmlType::from_u32(format.ggml_type_id()).expect("every WeightFormat is a GGML type")
}

struct Checker {
    failures: usize,
}

impl Checker {
    fn report(&mut self, name: &str, error: f64, tolerance: f64) {
        let ok = error.is_finite() && error <= tolerance;
        if !ok {
            self.failures += 1;
        }
        println!(
            "{:<4} {name:<64} error {error:.3e} (tolerance {tolerance:.1e})",
            if ok { "PASS" } else { "FAIL" }
        );
    }

    fn fail(&mut self, name: &str, error: &dyn std::fmt::Display) {
        self.failures += 1;
        println!("FAIL {name:<64} {error}");
    }
}

fn upload_f32(ctx: &GpuContext, values: &[f32]) -> Result<PoolBuffer, ops::OpsError> {
    upload_bytes(ctx, &to_bytes(values))
}

fn upload_i32(ctx: &GpuContext, values: &[i32]) -> Result<PoolBuffer, ops::OpsError> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    upload_bytes(ctx, &bytes)
}

fn upload_bytes(ctx: &GpuContext, bytes: &[u8]) -> Result<PoolBuffer, ops::OpsError> {
    let buffer = ctx.alloc(Purpose::Scratch, bytes.len().max(4) as u64)?;
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

fn download_i32(
    ctx: &GpuContext,
    buffer: &PoolBuffer,
    n: usize,
) -> Result<Vec<i32>, ops::OpsError> {
    let mut bytes = vec![0u8; n * 4];
    ctx.download(buffer.ptr(), &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max)
}

/// A random matrix in `format` (quantised from uniform values by ember-quant's reference
/// quantiser) and its dequantised f32 values.
fn random_matrix(
    rng: &mut Rng,
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f32>) {
    let values = rng.floats(rows * cols, -1.0, 1.0);
    let ty = ggml_type(format);
    let mut bytes = vec![0u8; DeviceMatrix::bytes_for(format, rows, cols).expect("whole blocks")];
    ember_quant::quantize(ty, &values, &mut bytes).expect("quantising random weights");
    let mut dequantised = vec![0f32; rows * cols];
    ember_quant::dequantize(ty, &bytes, &mut dequantised).expect("dequantising random weights");
    (bytes, dequantised)
}

fn device_matrix(
    ctx: &GpuContext,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Result<DeviceMatrix, ops::OpsError> {
    let buffer = ctx.alloc(Purpose::Weights, bytes.len() as u64)?;
    ctx.upload(buffer.ptr(), bytes)?;
    DeviceMatrix::new(buffer, format, rows, cols)
}

/// Errors of one matmul result against the f64 reference: (relative to sum |w x|, relative to
/// sum |w| max |x|), worst over outputs.
fn matmul_errors(
    out: &[f32],
    w: &[f32],
    x: &[f32],
    rows: usize,
    cols: usize,
    n_tokens: usize,
) -> (f64, f64) {
    let mut worst_wx = 0.0f64;
    let mut worst_w_xmax = 0.0f64;
    for t in 0..n_tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        let x_max = xt.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let (mut sum, mut magnitude, mut w_abs) = (0.0f64, 0.0f64, 0.0f64);
            for (&a, &b) in wr.iter().zip(xt) {
                sum += a as f64 * b as f64;
                magnitude += (a as f64 * b as f64).abs();
                w_abs += (a as f64).abs();
            }
            let error = (out[t * rows + r] as f64 - sum).abs();
            worst_wx = worst_wx.max(error / (magnitude + 1e-30));
            worst_w_xmax = worst_w_xmax.max(error / (w_abs * x_max + 1e-30));
        }
    }
    (worst_wx, worst_w_xmax)
}

fn check_matmul(
    checker: &mut Checker,
    blas_ctx: &GpuContext,
    tiled_ctx: &GpuContext,
    rng: &mut Rng,
    quick: bool,
) -> Result<(), ops::OpsError> {
    let (rows, cols) = (300, 1024);
    let token_counts: &[usize] = if quick { &[1, 64] } else { &[1, 7, 64, 300] };
    for format in WeightFormat::ALL {
        let (bytes, w) = random_matrix(rng, format, rows, cols);
        let blas_matrix = device_matrix(blas_ctx, format, rows, cols, &bytes)?;
        let tiled_matrix = device_matrix(tiled_ctx, format, rows, cols, &bytes)?;
        for &n_tokens in token_counts {
            let x = rng.floats(n_tokens * cols, -1.0, 1.0);
            let mut paths = vec![(MatmulPath::Tiled, "tiled", tiled_ctx, &tiled_matrix)];
            if n_tokens <= 8 {
                paths.push((MatmulPath::MatVec, "matvec", blas_ctx, &blas_matrix));
            }
            if blas_ctx.blas().is_loaded() {
                paths.push((MatmulPath::Blas, "blas", blas_ctx, &blas_matrix));
            }
            for (path, label, ctx, matrix) in paths {
                let name = format!("matmul {format} {rows}x{cols}, {n_tokens} tokens, {label}");
                let result = (|| {
                    let dx = upload_f32(ctx, &x)?;
                    let dout = ctx.alloc(Purpose::Scratch, (n_tokens * rows * 4) as u64)?;
                    ops::matmul_with(ctx, matrix, dx.ptr(), n_tokens, dout.ptr(), path)?;
                    download_f32(ctx, &dout, n_tokens * rows)
                })();
                match result {
                    Ok(out) => {
                        let (rel_wx, rel_w_xmax) =
                            matmul_errors(&out, &w, &x, rows, cols, n_tokens);
                        match path {
                            MatmulPath::Tiled => {
                                checker.report(&format!("{name} (/sum|wx|)"), rel_wx, 1e-5)
                            }
                            MatmulPath::Blas => {
                                checker.report(&format!("{name} (/sum|wx|)"), rel_wx, 1.5e-3)
                            }
                            _ => checker.report(
                                &format!("{name} (/sum|w|max|x|)"),
                                rel_w_xmax,
                                1.0 / 127.0,
                            ),
                        }
                    }
                    Err(error) => checker.fail(&name, &error),
                }
            }
        }
    }
    Ok(())
}

/// The quantised matrix path (mmq) on every format it covers: against f64 with the matrix-vector
/// tolerance, and against the CPU backend's own matmul. Shapes: 300 rows (a partial row tile),
/// 77 x 4096 (two row tiles: split along K, so partial sums and their reduction run), and 130 x
/// 800 for the 32-value formats (800 columns end in a partial K step).
fn check_mmq(
    checker: &mut Checker,
    ctx: &GpuContext,
    rng: &mut Rng,
    quick: bool,
) -> Result<(), ops::OpsError> {
    let token_counts: &[usize] = if quick {
        &[9, 64]
    } else {
        &[9, 16, 33, 64, 100]
    };
    for format in WeightFormat::ALL
        .into_iter()
        .filter(|&f| ops::has_mmq_kernels(f))
    {
        let mut shapes = vec![(300usize, 1024usize), (77, 4096)];
        if format.block_values() == 32 {
            shapes.push((130, 800));
        }
        for (rows, cols) in shapes {
            let (bytes, w) = random_matrix(rng, format, rows, cols);
            let matrix = device_matrix(ctx, format, rows, cols, &bytes)?;
            for &n_tokens in token_counts {
                let x = rng.floats(n_tokens * cols, -1.0, 1.0);
                let name = format!("matmul {format} {rows}x{cols}, {n_tokens} tokens, mmq");
                let result = (|| {
                    let dx = upload_f32(ctx, &x)?;
                    // Poisoned, so an output the kernels never write fails the check.
                    let dout = upload_f32(ctx, &vec![f32::NAN; n_tokens * rows])?;
                    ops::matmul_with(
                        ctx,
                        &matrix,
                        dx.ptr(),
                        n_tokens,
                        dout.ptr(),
                        MatmulPath::Mmq,
                    )?;
                    download_f32(ctx, &dout, n_tokens * rows)
                })();
                let out = match result {
                    Ok(out) => out,
                    Err(error) => {
                        checker.fail(&name, &error);
                        continue;
                    }
                };
                let (_, rel_w_xmax) = matmul_errors(&out, &w, &x, rows, cols, n_tokens);
                checker.report(&format!("{name} (/sum|w|max|x|)"), rel_w_xmax, 1.0 / 127.0);
                match cpu_matmul(format, rows, cols, &bytes, &x, n_tokens) {
                    Ok((cpu, magnitude)) => {
                        let worst = out
                            .iter()
                            .zip(&cpu)
                            .zip(&magnitude)
                            .map(|((&g, &c), &m)| (g as f64 - c as f64).abs() / (m + 1e-30))
                            .fold(0.0f64, |a, b| if b.is_nan() { f64::NAN } else { a.max(b) });
                        checker.report(&format!("{name} vs CPU (/sum|w x^|)"), worst, 1e-4);
                    }
                    Err(error) => checker.fail(&format!("{name} vs CPU"), &error),
                }
            }
        }
    }
    Ok(())
}

/// The CPU backend's matmul of `bytes` (a `rows` x `cols` matrix in `format`) with `x`, and per
/// output `sum |w x^|`, x^ the activations as the CPU quantised them.
fn cpu_matmul(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    x: &[f32],
    n_tokens: usize,
) -> Result<(Vec<f32>, Vec<f64>), ember_quant::QuantError> {
    let ty = ggml_type(format);
    let matrix = ember_quant::QMatrix {
        ty,
        rows,
        cols,
        data: bytes,
    };
    let mut out = vec![0f32; n_tokens * rows];
    ember_quant::matmul_f32(&matrix, x, n_tokens, &mut out)?;
    let act_ty = ember_quant::vec_dot_type(ty);
    let act = ember_quant::quantize_activations(act_ty, x, n_tokens, cols)?;
    let mut w = vec![0f32; rows * cols];
    ember_quant::dequantize(ty, bytes, &mut w)?;
    let mut magnitude = vec![0f64; n_tokens * rows];
    let mut x_hat = vec![0f32; cols];
    for t in 0..n_tokens {
        ember_quant::dequantize(act_ty, act.row(t), &mut x_hat)?;
        for r in 0..rows {
            magnitude[t * rows + r] = w[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x_hat)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
        }
    }
    Ok((out, magnitude))
}

fn check_elementwise(
    checker: &mut Checker,
    ctx: &GpuContext,
    rng: &mut Rng,
) -> Result<(), ops::OpsError> {
    let (n_rows, dim) = (5usize, 2304usize);
    let n = n_rows * dim;
    let a = rng.floats(n, -4.0, 4.0);
    let b = rng.floats(n, -4.0, 4.0);
    let bias = rng.floats(dim, -1.0, 1.0);
    let (da, db, dbias) = (
        upload_f32(ctx, &a)?,
        upload_f32(ctx, &b)?,
        upload_f32(ctx, &bias)?,
    );
    let dout = ctx.alloc(Purpose::Scratch, (n * 4) as u64)?;

    ops::add(ctx, dout.ptr(), da.ptr(), dbias.ptr(), n, dim)?;
    let expected: Vec<f64> = (0..n).map(|i| (a[i] + bias[i % dim]) as f64).collect();
    checker.report(
        "add (bias broadcast)",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        0.0,
    );

    ops::add(ctx, dout.ptr(), da.ptr(), db.ptr(), n, n)?;
    let expected: Vec<f64> = (0..n).map(|i| (a[i] + b[i]) as f64).collect();
    checker.report(
        "add",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        0.0,
    );

    ops::scale(ctx, dout.ptr(), da.ptr(), 0.3, n)?;
    let expected: Vec<f64> = a.iter().map(|&v| (v * 0.3) as f64).collect();
    checker.report(
        "scale",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        0.0,
    );

    ops::swiglu(ctx, dout.ptr(), da.ptr(), db.ptr(), n)?;
    let expected: Vec<f64> = (0..n)
        .map(|i| a[i] as f64 / (1.0 + (-(a[i] as f64)).exp()) * b[i] as f64)
        .collect();
    checker.report(
        "swiglu",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        2e-5,
    );

    ops::geglu(ctx, dout.ptr(), da.ptr(), db.ptr(), n)?;
    let expected: Vec<f64> = (0..n)
        .map(|i| {
            let g = a[i];
            let gelu = if g <= -10.0 {
                0.0
            } else if g >= 10.0 {
                g
            } else {
                let h = f16::from_f32(g).to_f32();
                let v = 0.5 * h * (1.0 + (0.797_884_6 * h * (1.0 + 0.044715 * h * h)).tanh());
                f16::from_f32(v).to_f32()
            };
            gelu as f64 * b[i] as f64
        })
        .collect();
    // One f16 ulp of GELU (<= 4 * 2^-10) times |up| <= 4, for tanh's last-bit differences.
    checker.report(
        "geglu (GGML CPU rounding)",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        4.0 * 4.0 / 1024.0,
    );

    let dcap = upload_f32(ctx, &a)?;
    ops::softcap(ctx, dcap.ptr(), n, 3.0)?;
    let expected: Vec<f64> = a.iter().map(|&v| 3.0 * (v as f64 / 3.0).tanh()).collect();
    checker.report(
        "softcap (in place, cap 3)",
        max_abs_diff(&download_f32(ctx, &dcap, n)?, &expected),
        1e-6,
    );

    let dhalf = ctx.alloc(Purpose::Scratch, (n * 2) as u64)?;
    ops::convert_f32_to_f16(ctx, dhalf.ptr(), da.ptr(), n)?;
    let mut bits = vec![0u8; n * 2];
    ctx.download(dhalf.ptr(), &mut bits)?;
    let wrong = bits
        .chunks_exact(2)
        .zip(&a)
        .filter(|(c, &v)| u16::from_le_bytes([c[0], c[1]]) != f16::from_f32(v).to_bits())
        .count();
    checker.report("convert_f32_to_f16 (wrong values)", wrong as f64, 0.0);

    let weight = rng.floats(dim, -1.0, 1.0);
    let dweight = upload_f32(ctx, &weight)?;
    let eps = 1e-6f32;
    ops::rms_norm(ctx, da.ptr(), dweight.ptr(), n_rows, dim, eps, dout.ptr())?;
    let mut expected = vec![0f64; n];
    for r in 0..n_rows {
        let row = &a[r * dim..(r + 1) * dim];
        let mean = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean + eps as f64).sqrt();
        for c in 0..dim {
            expected[r * dim + c] = row[c] as f64 * inv * weight[c] as f64;
        }
    }
    checker.report(
        "rms_norm",
        max_abs_diff(&download_f32(ctx, &dout, n)?, &expected),
        1e-5,
    );
    let dinplace = upload_f32(ctx, &a)?;
    ops::rms_norm(
        ctx,
        dinplace.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        eps,
        dinplace.ptr(),
    )?;
    checker.report(
        "rms_norm (in place)",
        max_abs_diff(&download_f32(ctx, &dinplace, n)?, &expected),
        1e-5,
    );

    let rows = [4i32, 0, 2, 2];
    let drows = upload_i32(ctx, &rows)?;
    ops::gather_rows(ctx, da.ptr(), dim, drows.ptr(), rows.len(), dout.ptr())?;
    let expected: Vec<f64> = rows
        .iter()
        .flat_map(|&r| {
            a[r as usize * dim..(r as usize + 1) * dim]
                .iter()
                .map(|&v| v as f64)
        })
        .collect();
    checker.report(
        "gather_rows",
        max_abs_diff(&download_f32(ctx, &dout, rows.len() * dim)?, &expected),
        0.0,
    );

    let vocab = 49_152usize;
    let mut logits = rng.floats(3 * vocab, -10.0, 10.0);
    logits[vocab + 100] = 40.0;
    logits[vocab + 30_000] = 40.0;
    let dlogits = upload_f32(ctx, &logits)?;
    let dindex = ctx.alloc(Purpose::Scratch, 12)?;
    let dparts = ctx.alloc(Purpose::Scratch, ops::argmax_scratch_bytes(3, vocab) as u64)?;
    ops::argmax(ctx, dlogits.ptr(), 3, vocab, dparts.ptr(), dindex.ptr())?;
    let got = download_i32(ctx, &dindex, 3)?;
    let wrong = (0..3)
        .filter(|&r| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let best = (0..vocab).fold(0, |best, c| if row[c] > row[best] { c } else { best });
            got[r] != best as i32
        })
        .count();
    checker.report("argmax (wrong rows, ties to lowest)", wrong as f64, 0.0);
    Ok(())
}

fn check_rope(checker: &mut Checker, ctx: &GpuContext, rng: &mut Rng) -> Result<(), ops::OpsError> {
    let (n_tokens, n_heads, head_dim, n_dims) = (4usize, 3usize, 128usize, 64usize);
    let positions = [0i32, 5, 300, 4095];
    let factors = rng.floats(n_dims / 2, 1.0, 8.0);
    let x = rng.floats(n_tokens * n_heads * head_dim, -1.0, 1.0);
    let (base, freq_scale) = (500_000.0f32, 0.25f32);
    let dpos = upload_i32(ctx, &positions)?;
    let dfactors = upload_f32(ctx, &factors)?;
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        for with_factors in [false, true] {
            let dx = upload_f32(ctx, &x)?;
            let factor_ptr = with_factors.then(|| dfactors.ptr());
            ops::rope(
                ctx,
                dx.ptr(),
                dpos.ptr(),
                n_tokens,
                n_heads,
                head_dim,
                n_dims,
                mode,
                base,
                freq_scale,
                factor_ptr,
            )?;
            let got = download_f32(ctx, &dx, x.len())?;
            // The CPU backend's table: f32 angles by repeated multiplication, then cos/sin.
            let theta_scale = base.powf(-2.0 / n_dims as f32);
            let mut expected: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for (t, &position) in positions.iter().enumerate() {
                let mut theta_base = position as f32;
                for (i, &listed_factor) in factors.iter().enumerate() {
                    let factor = if with_factors { listed_factor } else { 1.0 };
                    let theta = (freq_scale * (theta_base / factor)) as f64;
                    theta_base *= theta_scale;
                    for h in 0..n_heads {
                        let head = (t * n_heads + h) * head_dim;
                        let (ia, ib) = match mode {
                            RopeMode::Normal => (head + 2 * i, head + 2 * i + 1),
                            RopeMode::Neox => (head + i, head + i + n_dims / 2),
                        };
                        let (xa, xb) = (x[ia] as f64, x[ib] as f64);
                        expected[ia] = xa * theta.cos() - xb * theta.sin();
                        expected[ib] = xa * theta.sin() + xb * theta.cos();
                    }
                }
            }
            // Same f32 angles; cosf/sinf within a few ulps of angles up to ~1e3 rad.
            checker.report(
                &format!(
                    "rope {mode:?}{}",
                    if with_factors {
                        " with freq factors"
                    } else {
                        ""
                    }
                ),
                max_abs_diff(&got, &expected),
                1e-4,
            );
        }
    }
    Ok(())
}

fn check_get_rows(
    checker: &mut Checker,
    ctx: &GpuContext,
    rng: &mut Rng,
) -> Result<(), ops::OpsError> {
    let (rows, cols) = (50usize, 512usize);
    for format in [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Q8_0,
        WeightFormat::Q4K,
        WeightFormat::Q6K,
        WeightFormat::Q5_0,
    ] {
        let (bytes, w) = random_matrix(rng, format, rows, cols);
        let table = device_matrix(ctx, format, rows, cols, &bytes)?;
        let ids = [3i32, 49, 0, 3];
        let dids = upload_i32(ctx, &ids)?;
        let dout = ctx.alloc(Purpose::Scratch, (ids.len() * cols * 4) as u64)?;
        ops::get_rows(ctx, &table, dids.ptr(), ids.len(), 1.5, dout.ptr())?;
        let expected: Vec<f64> = ids
            .iter()
            .flat_map(|&id| {
                w[id as usize * cols..(id as usize + 1) * cols]
                    .iter()
                    .map(|&v| (v * 1.5) as f64)
            })
            .collect();
        // ember-quant and the kernel dequantise with the same f32 operations, up to fused
        // multiply-adds on the device.
        checker.report(
            &format!("get_rows {format} (scale 1.5)"),
            max_abs_diff(&download_f32(ctx, &dout, ids.len() * cols)?, &expected),
            4e-6,
        );
    }
    Ok(())
}

/// Seconds per call of `f`, timed with events on the context's stream.
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

fn benchmark(
    blas_ctx: &GpuContext,
    tiled_ctx: &GpuContext,
    rng: &mut Rng,
) -> Result<(), Box<dyn std::error::Error>> {
    let n_tokens = 512usize;
    for (rows, cols) in [(4096usize, 4096usize), (14336, 4096)] {
        for format in [WeightFormat::Q4_0, WeightFormat::Q4K, WeightFormat::F16] {
            // Random bytes stand in for weights here (only the speed is measured); scales are
            // whatever the bytes say, which costs the kernels nothing.
            let bytes: Vec<u8> = (0..DeviceMatrix::bytes_for(format, rows, cols)?)
                .map(|_| (rng.next_u64() >> 56) as u8 & 0x3b)
                .collect();
            let x = rng.floats(n_tokens * cols, -1.0, 1.0);
            let flops = 2.0 * rows as f64 * cols as f64 * n_tokens as f64;
            for (label, ctx, path) in [
                ("blas", blas_ctx, MatmulPath::Blas),
                ("tiled", tiled_ctx, MatmulPath::Tiled),
            ] {
                if path == MatmulPath::Blas && !ctx.blas().is_loaded() {
                    continue;
                }
                let matrix = device_matrix(ctx, format, rows, cols, &bytes)?;
                let dx = upload_f32(ctx, &x)?;
                let dout = ctx.alloc(Purpose::Scratch, (n_tokens * rows * 4) as u64)?;
                let iterations = if path == MatmulPath::Tiled { 3 } else { 20 };
                let seconds = time_on_stream(ctx, iterations, || {
                    ops::matmul_with(ctx, &matrix, dx.ptr(), n_tokens, dout.ptr(), path)
                })?;
                println!("BENCH matmul {format:<5} {rows}x{cols}x{n_tokens} {label:<5}: {:8.3} ms, {:6.1} TFLOP/s", seconds * 1e3, flops / seconds / 1e12);
            }
            let matrix = device_matrix(blas_ctx, format, rows, cols, &bytes)?;
            let dx = upload_f32(blas_ctx, &x[..cols])?;
            let dout = blas_ctx.alloc(Purpose::Scratch, (rows * 4) as u64)?;
            let seconds = time_on_stream(blas_ctx, 50, || {
                ops::matmul_with(
                    blas_ctx,
                    &matrix,
                    dx.ptr(),
                    1,
                    dout.ptr(),
                    MatmulPath::MatVec,
                )
            })?;
            println!(
                "BENCH matvec {format:<5} {rows}x{cols}x1: {:8.1} us, {:6.0} GB/s of weights",
                seconds * 1e6,
                bytes.len() as f64 / seconds / 1e9
            );
        }
    }
    crossover(blas_ctx, rng)
}

/// Times the matrix-vector path against the BLAS path for a few token counts, to place
/// `ops::MATVEC_MAX_TOKENS` (the matrix-vector kernels read the weights once per 8 tokens; the
/// BLAS path expands them to f16 once per call).
fn crossover(ctx: &GpuContext, rng: &mut Rng) -> Result<(), Box<dyn std::error::Error>> {
    if !ctx.blas().is_loaded() {
        return Ok(());
    }
    let (rows, cols) = (14336usize, 4096usize);
    for format in [WeightFormat::Q4_0, WeightFormat::Q4K] {
        let bytes: Vec<u8> = (0..DeviceMatrix::bytes_for(format, rows, cols)?)
            .map(|_| (rng.next_u64() >> 56) as u8 & 0x3b)
            .collect();
        let matrix = device_matrix(ctx, format, rows, cols, &bytes)?;
        for n_tokens in [8usize, 16, 32, 48, 64, 128] {
            let x = rng.floats(n_tokens * cols, -1.0, 1.0);
            let dx = upload_f32(ctx, &x)?;
            let dout = ctx.alloc(Purpose::Scratch, (n_tokens * rows * 4) as u64)?;
            let mut line = format!("BENCH crossover {format:<5} {rows}x{cols}x{n_tokens:<3}");
            for (label, path) in [("matvec", MatmulPath::MatVec), ("blas", MatmulPath::Blas)] {
                let seconds = time_on_stream(ctx, 10, || {
                    ops::matmul_with(ctx, &matrix, dx.ptr(), n_tokens, dout.ptr(), path)
                })?;
                line.push_str(&format!(" {label} {:8.1} us", seconds * 1e6));
            }
            println!("{line}");
        }
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

/// The number of failed checks, or `None` when there is no GPU to check.
fn run() -> Result<Option<usize>, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let no_bench = args.iter().any(|a| a == "--no-bench");
    let driver = match load_driver() {
        Ok(driver) => driver,
        Err(reason) => {
            println!("ops_check: skipped, no GPU: {reason}");
            return Ok(None);
        }
    };
    let info = driver.device_info(0)?;
    println!(
        "ops_check: {} device 0: {} ({}), {} MiB",
        driver.backend(),
        info.name,
        info.arch,
        info.total_memory >> 20
    );
    let pool = Arc::new(DevicePool::new(
        Arc::clone(&driver),
        0,
        &PoolSelectOptions::default(),
        PoolConfig::default(),
        None,
    )?);
    let kernels = Arc::new(KernelLibrary::new(default_kernels_dir()));
    println!(
        "ops_check: kernels from {}, {} pool ({})",
        kernels.dir().display(),
        pool.kind(),
        pool.reason()
    );
    let blas_ctx = GpuContext::with_options(
        Arc::clone(&pool),
        Arc::clone(&kernels),
        &GpuContextOptions {
            disable_blas: false,
        },
    )?;
    let tiled_ctx = GpuContext::with_options(
        Arc::clone(&pool),
        Arc::clone(&kernels),
        &GpuContextOptions { disable_blas: true },
    )?;
    match blas_ctx.blas() {
        BlasStatus::Loaded { library } => println!("ops_check: BLAS from {}", library.display()),
        BlasStatus::Unavailable { reason } => {
            println!("ops_check: no BLAS ({reason}); only the tiled path is checked")
        }
    }
    let mut checker = Checker { failures: 0 };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let started = Instant::now();
    for (name, result) in [
        (
            "element-wise ops",
            check_elementwise(&mut checker, &blas_ctx, &mut rng),
        ),
        ("rope", check_rope(&mut checker, &blas_ctx, &mut rng)),
        (
            "get_rows",
            check_get_rows(&mut checker, &blas_ctx, &mut rng),
        ),
        (
            "matmul",
            check_matmul(&mut checker, &blas_ctx, &tiled_ctx, &mut rng, quick),
        ),
        ("mmq", check_mmq(&mut checker, &blas_ctx, &mut rng, quick)),
    ] {
        if let Err(error) = result {
            checker.fail(name, &error);
        }
    }
    println!(
        "ops_check: checks took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if !no_bench {
        if let Err(error) = benchmark(&blas_ctx, &tiled_ctx, &mut rng) {
            checker.fail("benchmark", &error);
        }
    }
    println!("{}", pool.report());
    Ok(Some(checker.failures))
}

fn main() -> ExitCode {
    match run() {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(0)) => {
            println!("ops_check: ALL PASSED");
            ExitCode::SUCCESS
        }
        Ok(Some(failures)) => {
            println!("ops_check: FAILED: {failures} check(s)");
            ExitCode::FAILURE
        }
        Err(error) => {
            println!("ops_check: FAILED: {error}");
            ExitCode::FAILURE
        }
    }
}
