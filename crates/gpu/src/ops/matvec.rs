//! The decode matrix-vector product: `out[t] = W x[t]` for a few tokens in one pass over W
//! (kernels/matvec.hip), one kernel launch per (up to) eight tokens.
//!
//! Decode is bound by reading the weights, so the kernels read each weight byte once for up to
//! eight tokens. For the quantised formats every thread block first rounds the activations into
//! shared memory exactly as the CPU backend rounds them before its dot products (Q8_0 for
//! q4_0/q5_0/q8_0, Q8_1 for q4_1/q5_1, Q8_K for the k-quants; see kernels/matvec.hip), so the
//! integer dot products equal the CPU's and only the order of the f32 additions differs; the
//! integer formats then run on 4-byte integer dot instructions (the idea comes from GGML's CUDA
//! backend). f16 and bf16 weights are dotted with x rounded to f16 / bf16, f32 with x itself.
//! No host synchronisation and no allocation happen here: the op can be captured in a graph.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::{as_u32, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Threads per block of every `ember_matvec_*` kernel (matvec.hip's EMBER_MATVEC_THREADS).
const MATVEC_THREADS: u32 = 256;
/// Lanes that share one row (matvec.hip's EMBER_MATVEC_LANES): a block serves
/// `MATVEC_THREADS / MATVEC_LANES` rows per pass, whatever the warp size.
const MATVEC_LANES: u32 = 32;
/// Most blocks of one launch. Each block quantises the activations into its shared memory once
/// and then walks row groups grid-stride; about one resident wave of blocks on an H200 (132
/// SMs x 8 blocks of 256 threads) keeps the weight stream saturated while the activations are
/// read from L2 about a thousand times instead of once per row group.
const MAX_GRID: u32 = 1024;
/// Most tokens one matvec launch serves (the largest `_tN` kernel).
const MAX_TOKENS_PER_LAUNCH: usize = 8;
/// Values per activation quantisation group.
const GROUP: usize = 32;
/// Dynamic shared memory a launch may use without a per-function opt-in (48 KiB on every
/// CUDA and HIP device).
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// Whether `format`'s kernels quantise the activations into shared memory.
pub(crate) fn quantises_activations(format: WeightFormat) -> bool {
    !matches!(
        format,
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16
    )
}

/// Whether `format` has the int8 kernels (t1, t2, t4, t8; the others have t1 and t8).
pub(crate) fn has_int8_path(format: WeightFormat) -> bool {
    quantises_activations(format) && !matches!(format, WeightFormat::Q2K | WeightFormat::Q3K)
}

/// Dynamic shared bytes of a launch for `tokens` tokens of `cols` values
/// (matvec.hip's ember_matvec_shared_bytes): int8 values plus 8 bytes per group of 32.
fn shared_bytes(format: WeightFormat, tokens: usize, cols: usize) -> usize {
    if quantises_activations(format) {
        tokens * cols / 4 * 5
    } else {
        0
    }
}

/// Tokens per launch for `cols` columns: at most eight, and no more than fit the shared memory.
/// `None` when not even one token's activations fit.
fn tokens_per_launch(format: WeightFormat, cols: usize) -> Option<usize> {
    (1..=MAX_TOKENS_PER_LAUNCH)
        .rev()
        .find(|&tokens| shared_bytes(format, tokens, cols) <= MAX_SHARED_BYTES)
}

/// Whether one token's activations of `cols` values fit the shared memory of a launch.
pub(crate) fn shared_fits_one_token(format: WeightFormat, cols: usize) -> bool {
    tokens_per_launch(format, cols).is_some()
}

/// The kernel serving a launch of `tokens` tokens (1..=8): the smallest `_tN` with `N >= tokens`
/// among those compiled.
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
/// out (`w.rows` f32 each), up to eight tokens per pass over W (fewer when eight tokens' int8
/// activations exceed 48 KiB of shared memory: more than 4915 columns). Asynchronous on the
/// context's stream; no scratch memory.
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
    let Some(chunk) = tokens_per_launch(w.format, w.cols) else {
        return Err(OpsError::shape(
            OP,
            format!(
                "at most {} columns for {} weights (one token's int8 activations in 48 KiB of shared memory)",
                MAX_SHARED_BYTES * 4 / 5,
                w.format
            ),
            format!("{}", w.cols),
        ));
    };
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    as_u32(OP, "tokens times columns", n_tokens.saturating_mul(w.cols))?;
    let rows_per_block = MATVEC_THREADS / MATVEC_LANES;
    let grid = rows.div_ceil(rows_per_block).min(MAX_GRID);

    for first in (0..n_tokens).step_by(chunk) {
        let tokens = chunk.min(n_tokens - first);
        let config = LaunchConfig {
            shared_mem_bytes: shared_bytes(w.format, tokens, w.cols) as u32,
            ..LaunchConfig::linear(grid, MATVEC_THREADS)
        };
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(out.offset((first * w.rows * 4) as u64)))
            .arg(KernelArg::Ptr(w.ptr()))
            .arg(KernelArg::Ptr(x.offset((first * w.cols * 4) as u64)))
            .arg(KernelArg::U32(rows))
            .arg(KernelArg::U32(cols))
            .arg(KernelArg::U32(tokens as u32));
        // SAFETY: ember_matvec_<format>_tN(float* y, const uint8_t* w, const float* x, uint32_t
        // n_rows, uint32_t n_cols, uint32_t n_tokens) with n_tokens <= N and the dynamic shared
        // memory it needs for n_tokens (at most 48 KiB, checked above); it reads W
        // (DeviceMatrix::new checked the buffer holds rows x cols) and `tokens` rows of x from
        // row `first`, and writes `tokens` rows of out, which the caller sized for n_tokens rows.
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

/// Whether [`matvec_glu`] has kernels for `format` (every format with an int8 or float path;
/// q2_K and q3_K have neither).
pub(crate) fn has_glu_kernels(format: WeightFormat) -> bool {
    has_int8_path(format) || !quantises_activations(format)
}

/// The fused gate/up kernel: `out = act(gate x) * (up x)` for ONE token, both matrices in the
/// same format and of the same shape, in one pass over both (kernels/matvec.hip's
/// ember_matvec_{swiglu,geglu}_<format>_t1). Each row's two dot products are the ones
/// [`matvec`] computes (same lanes, same order), and the activation is the element-wise
/// kernels' expression, so the values equal matvec, matvec, swiglu/geglu. The caller checked
/// the formats, shapes and [`has_glu_kernels`].
pub(crate) fn matvec_glu(
    ctx: &GpuContext,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    x: DevicePtr,
    activation: &str,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matvec_glu";
    if gate.rows == 0 {
        return Ok(());
    }
    if gate.format != up.format || gate.rows != up.rows || gate.cols != up.cols {
        return Err(OpsError::shape(
            OP,
            format!(
                "an up matrix like the gate ({} {}x{})",
                gate.format, gate.rows, gate.cols
            ),
            format!("{} {}x{}", up.format, up.rows, up.cols),
        ));
    }
    if !has_glu_kernels(gate.format) {
        return Err(OpsError::shape(
            OP,
            "a format with fused gate/up kernels",
            gate.format.to_string(),
        ));
    }
    if gate.cols == 0 || !gate.cols.is_multiple_of(GROUP) {
        return Err(OpsError::shape(
            OP,
            "a column count that is a positive multiple of 32",
            format!("{}", gate.cols),
        ));
    }
    if tokens_per_launch(gate.format, gate.cols).is_none() {
        return Err(OpsError::shape(
            OP,
            format!(
                "at most {} columns for {} weights (one token's int8 activations in 48 KiB of shared memory)",
                MAX_SHARED_BYTES * 4 / 5,
                gate.format
            ),
            format!("{}", gate.cols),
        ));
    }
    let rows = as_u32(OP, "the row count", gate.rows)?;
    let cols = as_u32(OP, "the column count", gate.cols)?;
    let grid = rows.div_ceil(MATVEC_THREADS / MATVEC_LANES).min(MAX_GRID);
    let config = LaunchConfig {
        shared_mem_bytes: shared_bytes(gate.format, 1, gate.cols) as u32,
        ..LaunchConfig::linear(grid, MATVEC_THREADS)
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(gate.ptr()))
        .arg(KernelArg::Ptr(up.ptr()))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::U32(rows))
        .arg(KernelArg::U32(cols));
    let name = format!(
        "ember_matvec_{activation}_{}_t1",
        gate.format.kernel_suffix()
    );
    // SAFETY: ember_matvec_{swiglu,geglu}_<format>_t1(float* y, const uint8_t* w_gate, const
    // uint8_t* w_up, const float* x, uint32_t n_rows, uint32_t n_cols) with the dynamic shared
    // memory of one token (checked above to fit 48 KiB); it reads both matrices (same shape,
    // checked above; DeviceMatrix::new checked their buffers), one row of x and writes `rows`
    // values of out.
    unsafe { ctx.launch(KernelModule::MatVec, &name, config, &args) }
}

/// Several matrices of one format and column count times the same ONE token in one launch:
/// `outs[i] = ws[i] x` for 2 or 3 matrices (kernels/matvec.hip's ember_matvec3_<format>_t1,
/// which walks their rows as one list). Each row is computed as [`matvec`] computes it, so the
/// values equal separate launches. The caller checked [`has_glu_kernels`] (the same formats
/// have these kernels).
pub(crate) fn matvec_multi(
    ctx: &GpuContext,
    ws: &[&DeviceMatrix],
    x: DevicePtr,
    outs: &[DevicePtr],
) -> Result<(), OpsError> {
    const OP: &str = "matvec_multi";
    if !(2..=3).contains(&ws.len()) || ws.len() != outs.len() {
        return Err(OpsError::shape(
            OP,
            "2 or 3 matrices and as many outputs",
            format!("{} matrices and {} outputs", ws.len(), outs.len()),
        ));
    }
    let (format, cols) = (ws[0].format, ws[0].cols);
    if let Some(w) = ws.iter().find(|w| w.format != format || w.cols != cols) {
        return Err(OpsError::shape(
            OP,
            format!("matrices like the first ({format} with {cols} columns)"),
            format!("{} with {} columns", w.format, w.cols),
        ));
    }
    if !has_glu_kernels(format) {
        return Err(OpsError::shape(
            OP,
            "a format with multi-matrix kernels",
            format.to_string(),
        ));
    }
    if cols == 0 || !cols.is_multiple_of(GROUP) || !shared_fits_one_token(format, cols) {
        return Err(OpsError::shape(
            OP,
            format!(
                "a positive multiple of 32 columns, at most {}",
                MAX_SHARED_BYTES * 4 / 5
            ),
            format!("{cols}"),
        ));
    }
    let mut rows = [0u32; 3];
    let mut weights = [DevicePtr::NULL; 3];
    let mut ys = [DevicePtr::NULL; 3];
    for (i, (w, &y)) in ws.iter().zip(outs).enumerate() {
        rows[i] = as_u32(OP, "a row count", w.rows)?;
        weights[i] = w.ptr();
        ys[i] = y;
    }
    let total = rows.iter().try_fold(0u32, |a, &r| a.checked_add(r));
    let Some(total) = total else {
        return Err(OpsError::shape(
            OP,
            "fewer than 2^32 rows in all",
            format!("{rows:?}"),
        ));
    };
    if total == 0 {
        return Ok(());
    }
    let grid = total.div_ceil(MATVEC_THREADS / MATVEC_LANES).min(MAX_GRID);
    let config = LaunchConfig {
        shared_mem_bytes: shared_bytes(format, 1, cols) as u32,
        ..LaunchConfig::linear(grid, MATVEC_THREADS)
    };
    let mut args = KernelArgs::new();
    for y in ys {
        args = args.arg(KernelArg::Ptr(y));
    }
    for w in weights {
        args = args.arg(KernelArg::Ptr(w));
    }
    args = args.arg(KernelArg::Ptr(x));
    for r in rows {
        args = args.arg(KernelArg::U32(r));
    }
    args = args.arg(KernelArg::U32(as_u32(OP, "the column count", cols)?));
    let name = format!("ember_matvec3_{}_t1", format.kernel_suffix());
    // SAFETY: ember_matvec3_<format>_t1(float* y0, float* y1, float* y2, const uint8_t* w0,
    // const uint8_t* w1, const uint8_t* w2, const float* x, uint32_t rows0, uint32_t rows1,
    // uint32_t rows2, uint32_t n_cols) with one token's shared memory (checked to fit); it reads
    // each matrix (same format and columns, checked; DeviceMatrix::new checked the buffers) and
    // one row of x, and writes rows_i values of y_i; an unused third segment has 0 rows and null
    // pointers, which the kernel never touches.
    unsafe { ctx.launch(KernelModule::MatVec, &name, config, &args) }
}

#[cfg(test)]
mod tests {
    //! The activation rounding of the kernels (a Rust twin of matvec.hip's ember_mv_quantize)
    //! against the CPU backend's quantisers, kernel names, and the wrapper run on the host driver
    //! against Rust twins of the q8_0 and f32 kernels: token counts above what one launch serves
    //! are split into launches whose activation and output offsets and shared memory must line
    //! up. The kernels' arithmetic is tested on the GPU by kernels/tests/harness_matvec.cu.

    use ember_quant::{quantize_activations, GgmlType};
    use half::f16;

    use super::*;
    use crate::host::{HostDriver, HostLaunch};
    use crate::kernels::KERNEL_MODULES;
    use crate::ops::attention::tests::{
        download_f32, host_context, upload_bytes, upload_f32, values,
    };
    use crate::pool::Purpose;

    /// Activation formats of matvec.hip (EMBER_ACT_*).
    #[derive(Clone, Copy, Debug)]
    enum Act {
        Q8_0,
        Q8_1,
        Q8K,
    }

    /// The twin of ember_mv_quantize: int8 values and one (d, s) pair per group of 32, with the
    /// meaning of matvec.hip's EMBER_ACT_* (s: the integer sum for Q8_0 and Q8_K, f16(d sum) for
    /// Q8_1; d: f16-rounded for Q8_0 and Q8_1).
    fn quantize(act: Act, x: &[f32]) -> (Vec<i8>, Vec<(f32, f32)>) {
        let block = if matches!(act, Act::Q8K) { 256 } else { 32 };
        let mut q = Vec::with_capacity(x.len());
        let mut ds = Vec::new();
        for chunk in x.chunks_exact(block) {
            let (values, d): (Vec<i32>, f32) = match act {
                Act::Q8K => {
                    let (mut best, mut best_abs) = (0.0f32, 0.0f32);
                    for &v in chunk {
                        if v.abs() > best_abs {
                            (best, best_abs) = (v, v.abs());
                        }
                    }
                    let iscale = if best_abs > 0.0 { -127.0 / best } else { 0.0 };
                    let d = if best_abs > 0.0 { 1.0 / iscale } else { 0.0 };
                    let values = chunk
                        .iter()
                        .map(|&v| ((iscale * v).round_ties_even() as i32).min(127))
                        .collect();
                    (values, d)
                }
                Act::Q8_0 | Act::Q8_1 => {
                    let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let values = chunk
                        .iter()
                        .map(|&v| ((v * id).round_ties_even() as i32).clamp(-128, 127))
                        .collect();
                    (values, amax / 127.0)
                }
            };
            for group in values.chunks_exact(GROUP) {
                let sum: i32 = group.iter().sum();
                let round = |v: f32| f16::from_f32(v).to_f32();
                ds.push(match act {
                    Act::Q8_0 => (round(d), sum as f32),
                    Act::Q8_1 => (round(d), round(sum as f32 * d)),
                    Act::Q8K => (d, sum as f32),
                });
                q.extend(group.iter().map(|&v| v as i8));
            }
        }
        (q, ds)
    }

    /// Activations with groups of very different amplitude, exact ties of the rounding and, in
    /// one 256-value block, a largest magnitude held by a negative and a later positive value.
    fn awkward_activations(n: usize) -> Vec<f32> {
        let mut x = values(n, 7);
        for (g, group) in x.chunks_exact_mut(GROUP).enumerate() {
            let amplitude = [1.0f32, 1e-3, 37.0, 0.25][g % 4];
            group.iter_mut().for_each(|v| *v *= amplitude);
        }
        // amax 127: the multiplier is exactly 1, so these land on .5 and round to even.
        x[64..96].iter_mut().enumerate().for_each(|(i, v)| {
            *v = if i == 0 {
                127.0
            } else {
                (i as f32 - 16.0) + 0.5
            };
        });
        x[256 + 3] = -50.0;
        x[256 + 200] = 50.0;
        x[512..544].fill(0.0);
        x
    }

    #[test]
    fn activation_rounding_matches_the_cpu_backend() {
        let x = awkward_activations(1024);
        // Q8_K: d (f32), 256 values, 16 sums of 16 values.
        let (q, ds) = quantize(Act::Q8K, &x);
        let cpu = quantize_activations(GgmlType::Q8_K, &x, 1, x.len()).unwrap();
        for (b, block) in cpu.data().chunks_exact(292).enumerate() {
            let d = f32::from_le_bytes(block[0..4].try_into().unwrap());
            assert_eq!(d.to_bits(), ds[8 * b].0.to_bits(), "Q8_K block {b} scale");
            for i in 0..256 {
                assert_eq!(
                    block[4 + i] as i8,
                    q[256 * b + i],
                    "Q8_K block {b} value {i}"
                );
            }
            for g in 0..8 {
                let bsum = |j: usize| i16::from_le_bytes([block[260 + 2 * j], block[261 + 2 * j]]);
                let sum = f32::from(bsum(2 * g) + bsum(2 * g + 1));
                assert_eq!(sum, ds[8 * b + g].1, "Q8_K block {b} group {g} sum");
            }
        }
        // Q8_0 and Q8_1 follow the CPU's x86 rule (multiplier 127 / amax); on aarch64 the CPU
        // multiplies by 1 / d instead, which differs by an ulp for some groups.
        if cfg!(target_arch = "aarch64") {
            return;
        }
        for (act, ty, size) in [
            (Act::Q8_0, GgmlType::Q8_0, 34),
            (Act::Q8_1, GgmlType::Q8_1, 36),
        ] {
            let (q, ds) = quantize(act, &x);
            let cpu = quantize_activations(ty, &x, 1, x.len()).unwrap();
            for (g, block) in cpu.data().chunks_exact(size).enumerate() {
                let half = |o: usize| f16::from_le_bytes([block[o], block[o + 1]]).to_f32();
                assert_eq!(half(0).to_bits(), ds[g].0.to_bits(), "{ty} group {g} scale");
                let values = &block[size - 32..];
                for i in 0..32 {
                    assert_eq!(values[i] as i8, q[32 * g + i], "{ty} group {g} value {i}");
                }
                if matches!(act, Act::Q8_1) {
                    assert_eq!(half(2).to_bits(), ds[g].1.to_bits(), "{ty} group {g} sum");
                }
            }
        }
        // The ties above rounded to even.
        let (q, _) = quantize(Act::Q8_0, &x);
        assert_eq!(&q[64..68], &[127, -14, -14, -12]);
    }

    fn tokens_of(name: &str) -> usize {
        name.rsplit("_t").next().unwrap().parse().unwrap()
    }

    fn register_matvec_twins(driver: &HostDriver) {
        // ember_matvec_q8_0_tN(float* y, const uint8_t* w, const float* x, uint32_t n_rows,
        // uint32_t n_cols, uint32_t n_tokens)
        for name in [
            "ember_matvec_q8_0_t1",
            "ember_matvec_q8_0_t2",
            "ember_matvec_q8_0_t4",
            "ember_matvec_q8_0_t8",
        ] {
            driver.register_kernel(name, move |l| {
                let (y, w, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
                let (rows, cols, tokens) = (
                    l.u32_arg(3)? as usize,
                    l.u32_arg(4)? as usize,
                    l.u32_arg(5)? as usize,
                );
                check_launch(l, name, tokens, tokens * cols * 5 / 4)?;
                let mut wb = vec![0u8; rows * cols / 32 * 34];
                l.read(w, &mut wb)?;
                let (q, ds) = quantize(Act::Q8_0, &l.read_f32(x, tokens * cols)?);
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
                                        * i32::from(q[t * cols + 32 * g + i])
                                })
                                .sum();
                            sum += d * ds[t * cols / 32 + g].0 * dot as f32;
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
                check_launch(l, name, tokens, 0)?;
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
        // ember_matvec_swiglu_f32_t1(float* y, const uint8_t* w_gate, const uint8_t* w_up,
        // const float* x, uint32_t n_rows, uint32_t n_cols)
        driver.register_kernel("ember_matvec_swiglu_f32_t1", |l| {
            let (y, wg, wu, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
            let (rows, cols) = (l.u32_arg(4)? as usize, l.u32_arg(5)? as usize);
            check_launch(l, "ember_matvec_swiglu_f32_t1", 1, 0)?;
            let (wg, wu) = (l.read_f32(wg, rows * cols)?, l.read_f32(wu, rows * cols)?);
            let x = l.read_f32(x, cols)?;
            let out: Vec<f32> = (0..rows)
                .map(|r| silu_mul(dot_row(&wg, &x, r), dot_row(&wu, &x, r)))
                .collect();
            write_rows(l, y, rows, 1, &out)
        });
        // ember_matvec3_f32_t1(float* y0, float* y1, float* y2, const uint8_t* w0, const
        // uint8_t* w1, const uint8_t* w2, const float* x, uint32_t rows0, uint32_t rows1,
        // uint32_t rows2, uint32_t n_cols)
        driver.register_kernel("ember_matvec3_f32_t1", |l| {
            MATVEC3_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let cols = l.u32_arg(10)? as usize;
            check_launch(l, "ember_matvec3_f32_t1", 1, 0)?;
            let rows: Vec<usize> = (7..10)
                .map(|i| l.u32_arg(i).map(|r| r as usize))
                .collect::<Result<_, _>>()?;
            let total: usize = rows.iter().sum();
            let grid = l.config().grid[0] as usize;
            if grid == 0 || grid > total.div_ceil((MATVEC_THREADS / MATVEC_LANES) as usize) {
                return Err(format!("grid {grid} for {total} rows"));
            }
            let x = l.read_f32(l.ptr_arg(6)?, cols)?;
            for (s, &n) in rows.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let w = l.read_f32(l.ptr_arg(3 + s)?, n * cols)?;
                let out: Vec<f32> = (0..n).map(|r| dot_row(&w, &x, r)).collect();
                l.write_f32(l.ptr_arg(s)?, &out)?;
            }
            Ok(())
        });
        // ember_silu_mul_f32(float* out, const float* gate, const float* up, uint32_t n): the
        // unfused path's activation.
        driver.register_kernel("ember_silu_mul_f32", |l| {
            let (out, gate, up) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let n = l.u32_arg(3)? as usize;
            let (gate, up) = (l.read_f32(gate, n)?, l.read_f32(up, n)?);
            let values: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| silu_mul(g, u))
                .collect();
            l.write_f32(out, &values)
        });
    }

    /// Launches of the ember_matvec3_f32_t1 twin (only the test of matmul_shared launches it).
    static MATVEC3_LAUNCHES: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);

    fn dot_row(w: &[f32], x: &[f32], r: usize) -> f32 {
        let cols = x.len();
        (0..cols).map(|c| w[r * cols + c] * x[c]).sum()
    }

    fn silu_mul(g: f32, u: f32) -> f32 {
        g / (1.0 + (-g).exp()) * u
    }

    #[test]
    fn gate_and_up_fuse_for_one_token_and_fall_back_otherwise() {
        let (ctx, _dir) = host_context(register_matvec_twins);
        let (rows, cols) = (9usize, 64usize);
        let (wg, wu) = (values(rows * cols, 1), values(rows * cols, 2));
        let gate = DeviceMatrix::new(upload_f32(&ctx, &wg), WeightFormat::F32, rows, cols).unwrap();
        let up = DeviceMatrix::new(upload_f32(&ctx, &wu), WeightFormat::F32, rows, cols).unwrap();
        for n_tokens in [1usize, 3] {
            let x = values(n_tokens * cols, 3 + n_tokens as u32);
            let dx = upload_f32(&ctx, &x);
            let out = upload_f32(&ctx, &vec![0.0; n_tokens * rows]);
            let up_out = upload_f32(&ctx, &vec![0.0; n_tokens * rows]);
            crate::ops::matmul_glu(
                &ctx,
                &gate,
                &up,
                dx.ptr(),
                n_tokens,
                crate::ops::Glu::SwiGlu,
                out.ptr(),
                up_out.ptr(),
            )
            .unwrap();
            let expected: Vec<f32> = (0..n_tokens * rows)
                .map(|i| {
                    let xt = &x[(i / rows) * cols..][..cols];
                    silu_mul(dot_row(&wg, xt, i % rows), dot_row(&wu, xt, i % rows))
                })
                .collect();
            assert_eq!(
                download_f32(&ctx, out.ptr(), n_tokens * rows),
                expected,
                "{n_tokens} tokens"
            );
            // Only the unfused path writes the up projection.
            let up_values = download_f32(&ctx, up_out.ptr(), n_tokens * rows);
            assert_eq!(up_values.iter().any(|&v| v != 0.0), n_tokens > 1);
        }
        // Mismatched matrices are refused by the fused kernel's wrapper.
        let other = DeviceMatrix::new(
            upload_f32(&ctx, &wu[..8 * cols]),
            WeightFormat::F32,
            8,
            cols,
        )
        .unwrap();
        let dx = upload_f32(&ctx, &values(cols, 9));
        let error = matvec_glu(&ctx, &gate, &other, dx.ptr(), "swiglu", dx.ptr()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "matvec_glu: expected an up matrix like the gate (f32 9x64), found f32 8x64"
        );
        assert!(has_glu_kernels(WeightFormat::Q4K) && has_glu_kernels(WeightFormat::F16));
        assert!(!has_glu_kernels(WeightFormat::Q3K));
    }

    #[test]
    fn matrices_sharing_an_input_run_in_one_launch_per_format() {
        let (ctx, _dir) = host_context(register_matvec_twins);
        let cols = 64usize;
        // q: 5 rows, k: 3 rows (f32), v: 4 rows (q8_0 with exact values).
        let (wq, wk) = (values(5 * cols, 11), values(3 * cols, 12));
        let mut q8 = Vec::new();
        for block in 0..4 * cols / 32 {
            q8.extend(f16::from_f32(1.0 / 64.0).to_le_bytes());
            q8.extend((0..32).map(|i| ((block * 5 + i * 3) % 128) as u8 ^ 0x40));
        }
        let q = DeviceMatrix::new(upload_f32(&ctx, &wq), WeightFormat::F32, 5, cols).unwrap();
        let k = DeviceMatrix::new(upload_f32(&ctx, &wk), WeightFormat::F32, 3, cols).unwrap();
        let v = DeviceMatrix::new(upload_bytes(&ctx, &q8), WeightFormat::Q8_0, 4, cols).unwrap();
        for n_tokens in [1usize, 2] {
            let x = values(n_tokens * cols, 13);
            let dx = upload_f32(&ctx, &x);
            let outs: Vec<_> = [5usize, 3, 4]
                .iter()
                .map(|&r| upload_f32(&ctx, &vec![0.0; n_tokens * r]))
                .collect();
            let ptrs: Vec<DevicePtr> = outs.iter().map(|o| o.ptr()).collect();
            let before = MATVEC3_LAUNCHES.load(std::sync::atomic::Ordering::SeqCst);
            crate::ops::matmul_shared(&ctx, &[&q, &k, &v], dx.ptr(), n_tokens, &ptrs).unwrap();
            // q and k (both f32) share one launch for one token; v (q8_0) runs alone.
            let fused = MATVEC3_LAUNCHES.load(std::sync::atomic::Ordering::SeqCst) - before;
            assert_eq!(fused, usize::from(n_tokens == 1), "{n_tokens} tokens");
            let mut separate = Vec::new();
            for (w, rows) in [(&q, 5usize), (&k, 3), (&v, 4)] {
                let out = upload_f32(&ctx, &vec![0.0; n_tokens * rows]);
                matvec(&ctx, w, dx.ptr(), n_tokens, out.ptr()).unwrap();
                separate.push(download_f32(&ctx, out.ptr(), n_tokens * rows));
            }
            for (i, rows) in [5usize, 3, 4].into_iter().enumerate() {
                assert_eq!(
                    download_f32(&ctx, ptrs[i], n_tokens * rows),
                    separate[i],
                    "matrix {i}, {n_tokens} tokens"
                );
            }
            for (i, &rows) in [5usize, 3].iter().enumerate() {
                let w = if i == 0 { &wq } else { &wk };
                let expected: Vec<f32> = (0..n_tokens * rows)
                    .map(|j| dot_row(w, &x[(j / rows) * cols..][..cols], j % rows))
                    .collect();
                assert_eq!(separate[i], expected, "matrix {i}");
            }
        }
        let dx = upload_f32(&ctx, &values(cols, 14));
        let error = matvec_multi(&ctx, &[&q, &v], dx.ptr(), &[dx.ptr(), dx.ptr()]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "matvec_multi: expected matrices like the first (f32 with 64 columns), found q8_0 with 64 columns"
        );
    }

    /// A `_tN` kernel serves at most N tokens, with the block size of matvec.hip and the shared
    /// memory its tokens need (at most 48 KiB).
    fn check_launch(
        l: &HostLaunch<'_>,
        name: &str,
        tokens: usize,
        shared: usize,
    ) -> Result<(), String> {
        if tokens == 0 || tokens > tokens_of(name) {
            return Err(format!("{name} launched for {tokens} tokens"));
        }
        if l.config().block[0] != MATVEC_THREADS {
            return Err(format!(
                "{name} launched with {:?} threads",
                l.config().block
            ));
        }
        let got = l.config().shared_mem_bytes as usize;
        if got != shared || got > MAX_SHARED_BYTES {
            return Err(format!(
                "{name} for {tokens} tokens launched with {got} shared bytes, expected {shared}"
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
        let grid = l.config().grid[0];
        if grid == 0 || grid > MAX_GRID || (grid as usize) > rows.div_ceil(rows_per_block) {
            return Err(format!("grid {grid} for {rows} rows"));
        }
        debug_assert_eq!(out.len(), rows * tokens);
        l.write_f32(y, out)
    }

    #[test]
    fn token_counts_above_one_launch_are_split_with_matching_offsets() {
        let (ctx, _dir) = host_context(register_matvec_twins);
        // 8192 columns: four tokens of int8 activations per launch fit in 48 KiB.
        for (rows, cols) in [(5usize, 64usize), (3, 8192)] {
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
                        let (q, ds) = quantize(Act::Q8_0, &x);
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
                                    f64::from(w_values[r * cols + c])
                                        * f64::from(x_used[t * cols + c])
                                })
                                .sum();
                            let g = f64::from(got[t * rows + r]);
                            assert!(
                                (g - expected).abs() <= 1e-4 * (1.0 + expected.abs()),
                                "{} {rows}x{cols} token {t} of {n_tokens}, row {r}: {g} vs {expected}",
                                matrix.format
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn launches_fit_their_activations_in_shared_memory() {
        assert_eq!(tokens_per_launch(WeightFormat::Q4_0, 4096), Some(8));
        assert_eq!(tokens_per_launch(WeightFormat::Q4K, 14336), Some(2));
        assert_eq!(tokens_per_launch(WeightFormat::Q6K, 28672), Some(1));
        assert_eq!(tokens_per_launch(WeightFormat::F16, 1 << 20), Some(8));
        assert_eq!(tokens_per_launch(WeightFormat::Q8_0, 40960), None);
        assert_eq!(shared_bytes(WeightFormat::Q4K, 2, 14336), 35840);
    }

    #[test]
    fn columns_that_do_not_fit_are_errors() {
        let (ctx, _dir) = host_context(|_| {});
        let matrix = DeviceMatrix {
            buf: ctx.alloc(Purpose::Scratch, 1024).unwrap(),
            format: WeightFormat::Q8_0,
            rows: 1,
            cols: 40960,
        };
        let error = matvec(&ctx, &matrix, matrix.ptr(), 1, matrix.ptr()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "matvec: expected at most 39321 columns for q8_0 weights (one token's int8 activations in 48 KiB of shared memory), found 40960"
        );
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
    }

    #[test]
    fn launches_pick_the_smallest_kernel_that_fits() {
        assert_eq!(kernel_name(WeightFormat::Q4_0, 1), "ember_matvec_q4_0_t1");
        assert_eq!(kernel_name(WeightFormat::Q4K, 3), "ember_matvec_q4_k_t4");
        assert_eq!(kernel_name(WeightFormat::Q6K, 5), "ember_matvec_q6_k_t8");
        assert_eq!(kernel_name(WeightFormat::F16, 2), "ember_matvec_f16_t8");
        assert_eq!(kernel_name(WeightFormat::Q3K, 1), "ember_matvec_q3_k_t1");
        assert_eq!(kernel_name(WeightFormat::Q2K, 2), "ember_matvec_q2_k_t8");
    }
}
