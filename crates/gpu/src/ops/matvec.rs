//! The decode matrix-vector product: `out[t] = W x[t]` for a few tokens in one pass over W
//! (kernels/matvec.hip).
//!
//! Decode is bound by reading the weights, so the kernels read each weight byte once for up to
//! eight tokens. For the formats with an integer path (q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K,
//! q6_K) the activations are first quantised to int8 groups of 32 with one scale each (the "q8_1"
//! layout of GGML's CUDA backend, where this idea comes from) and the dot products run on 4-byte
//! integer dot instructions; this changes each activation by at most half its group's scale
//! (`max |x| / 254`), the same approximation llama.cpp's GPU decode makes. The float formats and
//! q2_K/q3_K dequantise to f32 and keep x in f32.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;
use crate::pool::Purpose;

use super::{as_u32, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Threads per block of every `ember_matvec_*` kernel (matvec.hip's EMBER_MATVEC_THREADS).
const MATVEC_THREADS: u32 = 128;
/// Lanes that share one row (matvec.hip's EMBER_MATVEC_LANES): a block serves
/// `MATVEC_THREADS / MATVEC_LANES` rows, whatever the warp size.
const MATVEC_LANES: u32 = 32;
/// Threads per block of `ember_quantize_q8_1` (any multiple of 32 works).
const QUANTIZE_THREADS: u32 = 256;
/// Most tokens one matvec launch serves (the largest `_tN` kernel).
const MAX_TOKENS_PER_LAUNCH: usize = 8;
/// Values per activation quantisation group.
const GROUP: usize = 32;
/// Bytes of one group's `(d, d * sum q)` pair.
const GROUP_SCALE_BYTES: usize = 8;
/// Alignment of the scales behind the int8 values in the scratch buffer.
const SCRATCH_ALIGN: usize = 256;

/// Whether `format` has the int8 kernels (otherwise the f32 ones).
pub(crate) fn has_int8_path(format: WeightFormat) -> bool {
    matches!(
        format,
        WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Q8_0
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q6K
    )
}

/// The kernel serving a launch of `tokens` tokens (1..=8): the smallest `_tN` with `N >= tokens`
/// among those compiled (int8 formats have t1, t2, t4, t8; the others t1 and t8).
pub(crate) fn kernel_name(format: WeightFormat, tokens: usize) -> String {
    let n = match (has_int8_path(format), tokens) {
        (_, 1) => 1,
        (true, 2) => 2,
        (true, 3..=4) => 4,
        _ => 8,
    };
    format!("ember_matvec_{}_t{n}", format.kernel_suffix())
}

/// `out[t, :] = W x[t, :]` for `n_tokens` rows of x (`w.cols` f32 each) into `n_tokens` rows of
/// out (`w.rows` f32 each), eight tokens per pass over W. Asynchronous on the context's stream;
/// int8 formats take a scratch buffer of about `n_tokens * w.cols * 1.25` bytes from the pool.
pub(crate) fn matvec(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matvec";
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    if w.cols == 0 || !w.cols.is_multiple_of(GROUP) {
        return Err(OpsError::shape(
            OP,
            "a column count that is a positive multiple of 32",
            format!("{}", w.cols),
        ));
    }
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let n_values = n_tokens.saturating_mul(w.cols);
    let n_values_u32 = as_u32(OP, "tokens times columns", n_values)?;
    let rows_per_block = MATVEC_THREADS / MATVEC_LANES;
    let config = LaunchConfig::linear(rows.div_ceil(rows_per_block), MATVEC_THREADS);

    if !has_int8_path(w.format) {
        for first in (0..n_tokens).step_by(MAX_TOKENS_PER_LAUNCH) {
            let tokens = MAX_TOKENS_PER_LAUNCH.min(n_tokens - first);
            let args = KernelArgs::new()
                .arg(KernelArg::Ptr(out.offset((first * w.rows * 4) as u64)))
                .arg(KernelArg::Ptr(w.ptr()))
                .arg(KernelArg::Ptr(x.offset((first * w.cols * 4) as u64)))
                .arg(KernelArg::U32(rows))
                .arg(KernelArg::U32(cols))
                .arg(KernelArg::U32(tokens as u32));
            // SAFETY: ember_matvec_<float format>_tN(float* y, const uint8_t* w, const float* x,
            // uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) with n_tokens <= N; it reads W
            // (DeviceMatrix::new checked the buffer holds rows x cols) and `tokens` rows of x
            // from row `first`, and writes `tokens` rows of out, which the caller sized for
            // n_tokens rows.
            unsafe {
                ctx.launch(
                    KernelModule::MatVec,
                    &kernel_name(w.format, tokens),
                    config,
                    &args,
                )
            }?;
        }
        return Ok(());
    }

    // int8 path: quantise every token's activations once, then one launch per 8 tokens.
    let scales_offset = n_values.next_multiple_of(SCRATCH_ALIGN);
    let n_groups = n_values / GROUP;
    let scratch = ctx.alloc(
        Purpose::Scratch,
        (scales_offset + n_groups * GROUP_SCALE_BYTES) as u64,
    )?;
    let xq = scratch.ptr();
    let xds = xq.offset(scales_offset as u64);
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(xq))
        .arg(KernelArg::Ptr(xds))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::U32(n_values_u32));
    // SAFETY: ember_quantize_q8_1(int8_t* xq, float2* xds, const float* x, uint32_t n_values)
    // reads n_values floats of x (n_tokens rows of cols, sized by the caller) and writes n_values
    // bytes at xq and n_values / 32 pairs at xds, both inside `scratch`.
    unsafe {
        ctx.launch(
            KernelModule::MatVec,
            "ember_quantize_q8_1",
            LaunchConfig::linear(n_values_u32.div_ceil(QUANTIZE_THREADS), QUANTIZE_THREADS),
            &args,
        )
    }?;
    for first in (0..n_tokens).step_by(MAX_TOKENS_PER_LAUNCH) {
        let tokens = MAX_TOKENS_PER_LAUNCH.min(n_tokens - first);
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(out.offset((first * w.rows * 4) as u64)))
            .arg(KernelArg::Ptr(w.ptr()))
            .arg(KernelArg::Ptr(xq.offset((first * w.cols) as u64)))
            .arg(KernelArg::Ptr(xds.offset(
                (first * (w.cols / GROUP) * GROUP_SCALE_BYTES) as u64,
            )))
            .arg(KernelArg::U32(rows))
            .arg(KernelArg::U32(cols))
            .arg(KernelArg::U32(tokens as u32));
        // SAFETY: ember_matvec_<int8 format>_tN(float* y, const uint8_t* w, const int8_t* xq,
        // const float2* xds, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens) with n_tokens
        // <= N; it reads W (checked by DeviceMatrix::new), `tokens` rows of the quantised
        // activations from row `first` (inside `scratch`, which lives until the launches are
        // queued; later users of the memory are queued after them on the same stream) and
        // writes `tokens` rows of out.
        unsafe {
            ctx.launch(
                KernelModule::MatVec,
                &kernel_name(w.format, tokens),
                config,
                &args,
            )
        }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Kernel names, and the wrapper run on the host driver against Rust twins of
    //! `ember_quantize_q8_1` and the q8_0 and f32 matvec kernels: token counts above eight are
    //! split into launches whose activation, scale and output offsets must line up. The kernels'
    //! arithmetic is tested on the GPU by kernels/tests/harness_matvec.cu.

    use half::f16;

    use super::*;
    use crate::host::{HostDriver, HostLaunch};
    use crate::kernels::KERNEL_MODULES;
    use crate::ops::attention::tests::{
        download_f32, host_context, upload_bytes, upload_f32, values,
    };

    /// The quantisation of ember_quantize_q8_1: per group of 32, d = max|x| / 127,
    /// q = round-half-even(x * 127 / max|x|), s = d * sum q.
    fn quantize(x: &[f32]) -> (Vec<i8>, Vec<(f32, f32)>) {
        let mut q = Vec::with_capacity(x.len());
        let mut ds = Vec::new();
        for group in x.chunks_exact(GROUP) {
            let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let mut sum = 0i32;
            for &v in group {
                let value = if amax > 0.0 {
                    (v * (127.0 / amax)).round_ties_even() as i32
                } else {
                    0
                };
                sum += value;
                q.push(value as i8);
            }
            ds.push((d, d * sum as f32));
        }
        (q, ds)
    }

    fn tokens_of(name: &str) -> usize {
        name.rsplit("_t").next().unwrap().parse().unwrap()
    }

    fn register_matvec_twins(driver: &HostDriver) {
        // ember_quantize_q8_1(int8_t* xq, float2* xds, const float* x, uint32_t n_values)
        driver.register_kernel("ember_quantize_q8_1", |l| {
            let (xq, xds, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let n = l.u32_arg(3)? as usize;
            if (l.config().grid[0] * l.config().block[0]) < n as u32 {
                return Err(format!(
                    "grid {:?} does not cover {n} values",
                    l.config().grid
                ));
            }
            let (q, ds) = quantize(&l.read_f32(x, n)?);
            l.write(xq, &q.iter().map(|&v| v as u8).collect::<Vec<u8>>())?;
            let flat: Vec<f32> = ds.iter().flat_map(|&(d, s)| [d, s]).collect();
            l.write_f32(xds, &flat)
        });
        // ember_matvec_q8_0_tN(float* y, const uint8_t* w, const int8_t* xq, const float2* xds,
        // uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens)
        for name in [
            "ember_matvec_q8_0_t1",
            "ember_matvec_q8_0_t2",
            "ember_matvec_q8_0_t4",
            "ember_matvec_q8_0_t8",
        ] {
            driver.register_kernel(name, move |l| {
                let (y, w, xq, xds) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
                let (rows, cols, tokens) = (
                    l.u32_arg(4)? as usize,
                    l.u32_arg(5)? as usize,
                    l.u32_arg(6)? as usize,
                );
                check_tokens(l, name, tokens)?;
                let mut wb = vec![0u8; rows * cols / 32 * 34];
                l.read(w, &mut wb)?;
                let mut qb = vec![0u8; tokens * cols];
                l.read(xq, &mut qb)?;
                let ds = l.read_f32(xds, tokens * cols / 32 * 2)?;
                let mut out = Vec::with_capacity(tokens * rows);
                for t in 0..tokens {
                    for r in 0..rows {
                        let mut sum = 0.0f32;
                        for g in 0..cols / 32 {
                            let block = &wb[(r * cols / 32 + g) * 34..][..34];
                            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                            let dot: i32 = (0..32)
                                .map(|i| {
                                    i32::from(block[2 + i] as i8)
                                        * i32::from(qb[t * cols + 32 * g + i] as i8)
                                })
                                .sum();
                            sum += d * ds[2 * (t * cols / 32 + g)] * dot as f32;
                        }
                        out.push(sum);
                    }
                }
                write_rows(l, y, rows, tokens, &out)
            });
        }
        // ember_matvec_f32_tN(float* y, const uint8_t* w, const float* x, uint32_t n_rows,
        // uint32_t n_cols, uint32_t n_tokens)
        for name in ["ember_matvec_f32_t1", "ember_matvec_f32_t8"] {
            driver.register_kernel(name, move |l| {
                let (y, w, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
                let (rows, cols, tokens) = (
                    l.u32_arg(3)? as usize,
                    l.u32_arg(4)? as usize,
                    l.u32_arg(5)? as usize,
                );
                check_tokens(l, name, tokens)?;
                let (w, x) = (l.read_f32(w, rows * cols)?, l.read_f32(x, tokens * cols)?);
                let out: Vec<f32> = (0..tokens * rows)
                    .map(|i| {
                        (0..cols)
                            .map(|c| w[(i % rows) * cols + c] * x[(i / rows) * cols + c])
                            .sum()
                    })
                    .collect();
                write_rows(l, y, rows, tokens, &out)
            });
        }
    }

    /// A `_tN` kernel serves at most N tokens, and its grid must give every row a warp.
    fn check_tokens(l: &HostLaunch<'_>, name: &str, tokens: usize) -> Result<(), String> {
        if tokens == 0 || tokens > tokens_of(name) {
            return Err(format!("{name} launched for {tokens} tokens"));
        }
        if l.config().block[0] != MATVEC_THREADS {
            return Err(format!(
                "{name} launched with {:?} threads",
                l.config().block
            ));
        }
        Ok(())
    }

    fn write_rows(
        l: &HostLaunch<'_>,
        y: DevicePtr,
        rows: usize,
        tokens: usize,
        out: &[f32],
    ) -> Result<(), String> {
        let rows_per_block = (MATVEC_THREADS / MATVEC_LANES) as usize;
        if (l.config().grid[0] as usize) * rows_per_block < rows {
            return Err(format!(
                "grid {:?} does not cover {rows} rows",
                l.config().grid
            ));
        }
        debug_assert_eq!(out.len(), rows * tokens);
        l.write_f32(y, out)
    }

    #[test]
    fn token_counts_above_eight_are_split_with_matching_offsets() {
        let (ctx, _dir) = host_context(register_matvec_twins);
        let (rows, cols) = (5usize, 64usize);
        // q8_0 weights: scale 1/64 and values -64..63.
        let mut q8 = Vec::new();
        for block in 0..rows * cols / 32 {
            q8.extend(f16::from_f32(1.0 / 64.0).to_le_bytes());
            q8.extend((0..32).map(|i| ((block * 7 + i * 13) % 128) as u8 ^ 0x40));
        }
        let w_values: Vec<f32> = (0..rows * cols)
            .map(|i| f32::from(q8[(i / 32) * 34 + 2 + i % 32] as i8) / 64.0)
            .collect();
        let f32_weights = upload_f32(&ctx, &w_values);
        let q8_weights = upload_bytes(&ctx, &q8);
        let matrices = [
            DeviceMatrix::new(f32_weights, WeightFormat::F32, rows, cols).unwrap(),
            DeviceMatrix::new(q8_weights, WeightFormat::Q8_0, rows, cols).unwrap(),
        ];
        for n_tokens in [1usize, 3, 8, 11, 17] {
            let x = values(n_tokens * cols, n_tokens as u32);
            let dx = upload_f32(&ctx, &x);
            let out = ctx
                .alloc(Purpose::Scratch, (n_tokens * rows * 4) as u64)
                .unwrap();
            for matrix in &matrices {
                matvec(&ctx, matrix, dx.ptr(), n_tokens, out.ptr()).unwrap();
                let got = download_f32(&ctx, out.ptr(), n_tokens * rows);
                // The int8 path multiplies by the quantised activations.
                let x_used: Vec<f32> = if matrix.format == WeightFormat::Q8_0 {
                    let (q, ds) = quantize(&x);
                    q.iter()
                        .enumerate()
                        .map(|(i, &v)| ds[i / GROUP].0 * f32::from(v))
                        .collect()
                } else {
                    x.clone()
                };
                for t in 0..n_tokens {
                    for r in 0..rows {
                        let expected: f64 = (0..cols)
                            .map(|c| {
                                f64::from(w_values[r * cols + c]) * f64::from(x_used[t * cols + c])
                            })
                            .sum();
                        let g = f64::from(got[t * rows + r]);
                        assert!(
                            (g - expected).abs() <= 1e-5 * (1.0 + expected.abs()),
                            "{} token {t} of {n_tokens}, row {r}: {g} vs {expected}",
                            matrix.format
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn columns_that_are_not_whole_groups_are_errors() {
        let (ctx, _dir) = host_context(|_| {});
        let matrix = DeviceMatrix {
            buf: ctx.alloc(Purpose::Scratch, 1024).unwrap(),
            format: WeightFormat::F32,
            rows: 2,
            cols: 40,
        };
        let error = matvec(&ctx, &matrix, matrix.ptr(), 1, matrix.ptr()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "matvec: expected a column count that is a positive multiple of 32, found 40"
        );
    }

    #[test]
    fn every_format_and_token_count_has_a_listed_kernel() {
        let spec = KERNEL_MODULES
            .iter()
            .find(|spec| spec.module == KernelModule::MatVec)
            .unwrap();
        for format in WeightFormat::ALL {
            for tokens in 1..=MAX_TOKENS_PER_LAUNCH {
                let name = kernel_name(format, tokens);
                assert!(
                    spec.functions.contains(&name.as_str()),
                    "{name} (format {format}, {tokens} tokens) is not in KERNEL_MODULES"
                );
            }
        }
        assert!(spec.functions.contains(&"ember_quantize_q8_1"));
    }

    #[test]
    fn launches_pick_the_smallest_kernel_that_fits() {
        assert_eq!(kernel_name(WeightFormat::Q4_0, 1), "ember_matvec_q4_0_t1");
        assert_eq!(kernel_name(WeightFormat::Q4K, 3), "ember_matvec_q4_k_t4");
        assert_eq!(kernel_name(WeightFormat::Q6K, 5), "ember_matvec_q6_k_t8");
        assert_eq!(kernel_name(WeightFormat::F16, 2), "ember_matvec_f16_t8");
        assert_eq!(kernel_name(WeightFormat::Q3K, 1), "ember_matvec_q3_k_t1");
    }
}
