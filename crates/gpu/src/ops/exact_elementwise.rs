//! Launch wrappers for the bit-exact row-wise and element-wise kernels (kernels/exact_elementwise.hip),
//! the ops of the engine's reference numerics mode: each gives, bit for bit, what the engine's
//! CPU backend gives for the same inputs (engine/src/backend/cpu/{mod,ops,vec}.rs and the scalar
//! dequantisers of ember-quant are the spec; the kernel file says how the rounding is kept).
//!
//! Speed is secondary here: the row kernels let one thread sum a row sequentially (the CPU's f64
//! sum of squares is sequential, and a tree would round differently), the rest are one thread per
//! output value. The fast kernels ([`super::rms_norm`], [`super::rope`], ...) stay the default.
//!
//! What the CPU takes from libm is not evaluated on the device: [`rope_exact`] reads a table of
//! cosines and sines that the caller computed on the host with the CPU backend's code, and
//! [`geglu_exact`] reads the CPU's f16 GELU table ([`GELU_TABLE_LEN`] values) uploaded by the
//! caller. Gemma's logit soft-capping (glibc `tanhf` on the CPU) has no exact kernel.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::{as_u32, stride_launch, DeviceMatrix, GpuContext, OpsError, RopeMode, WeightFormat};

/// Values of the GELU table [`geglu_exact`] reads: one f16 per f16 bit pattern.
pub const GELU_TABLE_LEN: usize = 1 << 16;

/// Threads per block of the one-block-per-row kernels: rows are written by every thread, their
/// scale (when any) formed by thread 0.
const ROW_THREADS: u32 = 256;

fn ptr(p: DevicePtr) -> KernelArg {
    KernelArg::Ptr(p)
}

/// An element count of a grid-stride kernel: its 32-bit index must not wrap on the last stride.
fn stride_count(op: &'static str, n: usize) -> Result<u32, OpsError> {
    if n > i32::MAX as usize {
        return Err(OpsError::shape(
            op,
            "an element count below 2^31",
            format!("{n}"),
        ));
    }
    Ok(n as u32)
}

/// Launches the grid-stride kernel `name` over `n` elements.
fn stride_kernel(
    ctx: &GpuContext,
    op: &'static str,
    name: &str,
    n: usize,
    args: KernelArgs,
) -> Result<(), OpsError> {
    let n = stride_count(op, n)?;
    // SAFETY: every caller passes `name`'s exact parameter list, and each kernel touches elements
    // below n (grid-stride loop) of buffers the caller sized for n elements.
    unsafe {
        ctx.launch(
            KernelModule::ExactElementwise,
            name,
            stride_launch(n),
            &args,
        )
    }
}

/// Block size of a one-block-per-row kernel over rows of `dim` values.
fn row_threads(dim: u32) -> u32 {
    dim.next_multiple_of(32).clamp(32, ROW_THREADS)
}

/// The exact embedding kernel of `format` (a static name: no formatting on the launch path).
pub(super) fn get_rows_exact_kernel(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::F32 => "ember_exact_get_rows_f32",
        WeightFormat::F16 => "ember_exact_get_rows_f16",
        WeightFormat::BF16 => "ember_exact_get_rows_bf16",
        WeightFormat::Q4_0 => "ember_exact_get_rows_q4_0",
        WeightFormat::Q4_1 => "ember_exact_get_rows_q4_1",
        WeightFormat::Q5_0 => "ember_exact_get_rows_q5_0",
        WeightFormat::Q5_1 => "ember_exact_get_rows_q5_1",
        WeightFormat::Q8_0 => "ember_exact_get_rows_q8_0",
        WeightFormat::Q2K => "ember_exact_get_rows_q2_k",
        WeightFormat::Q3K => "ember_exact_get_rows_q3_k",
        WeightFormat::Q4K => "ember_exact_get_rows_q4_k",
        WeightFormat::Q5K => "ember_exact_get_rows_q5_k",
        WeightFormat::Q6K => "ember_exact_get_rows_q6_k",
    }
}

/// `out[t, :] = dequantise(table row ids[t])`, then times `scale` unless it is exactly 1, for `n`
/// ids (i32 on the device): the CPU backend's `get_rows` with ember-quant's scalar dequantiser.
/// An id outside `0..table.rows` gives a row of NaNs rather than a fault.
pub fn get_rows_exact(
    ctx: &GpuContext,
    table: &DeviceMatrix,
    ids: DevicePtr,
    n: usize,
    scale: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "get_rows_exact";
    if n == 0 {
        return Ok(());
    }
    let n = as_u32(OP, "the id count", n)?;
    let n_cols = as_u32(OP, "the table's column count", table.cols)?;
    let n_rows = as_u32(OP, "the table's row count", table.rows)?;
    if table.format.row_bytes(table.cols).is_none() {
        return Err(OpsError::shape(
            OP,
            format!(
                "a column count that is a multiple of {}",
                table.format.block_values()
            ),
            format!("{}", table.cols),
        ));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(table.ptr()))
        .arg(ptr(ids))
        .arg(KernelArg::U32(n_rows))
        .arg(KernelArg::U32(n_cols))
        .arg(KernelArg::F32(scale));
    // SAFETY: ember_exact_get_rows_*(float* out, const uint8_t* table, const int32_t* ids,
    // uint32_t n_rows, uint32_t n_cols, float scale); block t reads ids[t] and, when it is in
    // range, that row of the table, and writes row t of out (n_cols floats); the caller sized
    // out and ids for n.
    unsafe {
        ctx.launch(
            KernelModule::ExactElementwise,
            get_rows_exact_kernel(table.format),
            LaunchConfig::linear(n, row_threads(n_cols)),
            &args,
        )
    }
}

/// RMS normalisation of `n_rows` rows of `dim` values as the CPU's `rms_norm_row`:
/// `out = x * (1 / sqrt(f32(Σ f64(x²) / dim) + eps)) * weight`, the f64 sum sequential from the
/// first value. `out` may equal `x`.
pub fn rms_norm_exact(
    ctx: &GpuContext,
    x: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "rms_norm_exact";
    if n_rows == 0 {
        return Ok(());
    }
    let n_rows = as_u32(OP, "the row count", n_rows)?;
    let dim = as_u32(OP, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(OP, "a row length above 0", "0"));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps));
    // SAFETY: ember_exact_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t
    // n_cols, float eps); block r reads row r of x and dim weights and writes row r of out.
    unsafe {
        ctx.launch(
            KernelModule::ExactElementwise,
            "ember_exact_rms_norm_f32",
            LaunchConfig::linear(n_rows, row_threads(dim)),
            &args,
        )
    }
}

/// The residual add and the next normalisation, as the CPU's `add_inplace` then `rms_norm`:
/// `x[r] += proj[r]`, then `out[r] = rms_norm(x[r]) * weight` (as [`rms_norm_exact`]), in one
/// launch. `out` must be a buffer other than `x` and `proj`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_exact(
    ctx: &GpuContext,
    x: DevicePtr,
    proj: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "add_rms_norm_exact";
    if n_rows == 0 {
        return Ok(());
    }
    if out == x || out == proj {
        return Err(OpsError::shape(
            OP,
            "an output buffer other than x and proj",
            "the same buffer",
        ));
    }
    let n_rows = as_u32(OP, "the row count", n_rows)?;
    let dim = as_u32(OP, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(OP, "a row length above 0", "0"));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(ptr(proj))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps));
    // SAFETY: ember_exact_add_rms_norm_f32(float* out, float* x, const float* proj, const float*
    // weight, uint32_t n_cols, float eps); block r touches row r of x, proj and out, and dim
    // weights.
    unsafe {
        ctx.launch(
            KernelModule::ExactElementwise,
            "ember_exact_add_rms_norm_f32",
            LaunchConfig::linear(n_rows, row_threads(dim)),
            &args,
        )
    }
}

/// SwiGLU as the CPU's `swiglu` (GGML's vectorised `expf` polynomial, `vec::swiglu_ggml`):
/// `out[i] = gate[i] / (1 + expf_ggml(0 - gate[i])) * up[i]`. `out` may equal `gate` or `up`.
pub fn swiglu_exact(
    ctx: &GpuContext,
    out: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    const OP: &str = "swiglu_exact";
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(gate))
        .arg(ptr(up))
        .arg(KernelArg::U32(stride_count(OP, n)?));
    stride_kernel(ctx, OP, "ember_exact_swiglu_f32", n, args)
}

/// GeGLU as the CPU's `geglu`: `out[i] = gelu(gate[i]) * up[i]`, GELU 0 at or below -10, the
/// identity at or above 10 and `table[f16 bits of x]` in between. `table` holds the CPU's
/// [`GELU_TABLE_LEN`] f16 GELU values (the engine's `gelu_table`), uploaded by the caller.
/// `out` may equal `gate` or `up`.
pub fn geglu_exact(
    ctx: &GpuContext,
    out: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    table: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    const OP: &str = "geglu_exact";
    if n == 0 {
        return Ok(());
    }
    if table == DevicePtr::NULL {
        return Err(OpsError::shape(
            OP,
            format!("a device table of {GELU_TABLE_LEN} f16 GELU values"),
            "a null pointer",
        ));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(gate))
        .arg(ptr(up))
        .arg(ptr(table))
        .arg(KernelArg::U32(stride_count(OP, n)?));
    stride_kernel(ctx, OP, "ember_exact_geglu_f32", n, args)
}

/// Rotary embedding of `x` `[n_tokens, n_heads, head_dim]` in place, as the CPU's `rope`: pair
/// `i` of every head of token `t` turns by the cosine `cos_sin[t * n_dims + 2 i]` and sine
/// `cos_sin[t * n_dims + 2 i + 1]` (f32, computed on the host exactly as the CPU backend's
/// `rope_table` does), `(x0, x1) -> (fma(x0, c, -(x1 s)), fma(x0, s, x1 c))`. Values from
/// `n_dims` on are left alone.
#[allow(clippy::too_many_arguments)]
pub fn rope_exact(
    ctx: &GpuContext,
    x: DevicePtr,
    cos_sin: DevicePtr,
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    n_dims: usize,
    mode: RopeMode,
) -> Result<(), OpsError> {
    const OP: &str = "rope_exact";
    if n_tokens == 0 || n_heads == 0 || n_dims == 0 {
        return Ok(());
    }
    if !n_dims.is_multiple_of(2) || n_dims > head_dim {
        return Err(OpsError::shape(
            OP,
            format!("an even rotated dimension count of at most the head size {head_dim}"),
            format!("{n_dims}"),
        ));
    }
    let pairs = n_tokens
        .checked_mul(n_heads)
        .and_then(|n| n.checked_mul(n_dims / 2))
        .unwrap_or(usize::MAX);
    let n = stride_count(OP, pairs)?;
    // Every index the kernel forms stays below the element count of x, which must fit too.
    stride_count(
        OP,
        n_tokens.saturating_mul(n_heads).saturating_mul(head_dim),
    )?;
    let name = match mode {
        RopeMode::Normal => "ember_exact_rope_norm_f32",
        RopeMode::Neox => "ember_exact_rope_neox_f32",
    };
    let args = KernelArgs::new()
        .arg(ptr(x))
        .arg(ptr(cos_sin))
        .arg(KernelArg::U32(n_tokens as u32))
        .arg(KernelArg::U32(n_heads as u32))
        .arg(KernelArg::U32(head_dim as u32))
        .arg(KernelArg::U32(n_dims as u32));
    // SAFETY: ember_exact_rope_{norm,neox}_f32(float* x, const float* cos_sin, uint32_t n_tokens,
    // uint32_t n_heads, uint32_t head_dim, uint32_t n_dims); thread work item p < n_tokens *
    // n_heads * n_dims / 2 rotates one pair of x (sized by the caller for n_tokens rows of
    // n_heads * head_dim) reading two values of cos_sin (n_tokens * n_dims).
    unsafe {
        ctx.launch(
            KernelModule::ExactElementwise,
            name,
            stride_launch(n),
            &args,
        )
    }
}

#[cfg(test)]
mod tests {
    //! The wrappers on the host driver against Rust twins of the kernels: each twin decodes the
    //! arguments in the order the kernel's C signature declares them and does the work of the
    //! launch it is given, with the arithmetic of the CPU backend, so a wrong argument order, a
    //! wrong grid or a wrong table layout fails here. That the kernels themselves round as the
    //! CPU does is checked on the GPU by the engine's `exact_ops_check` example.

    use half::f16;

    use super::*;
    use crate::host::HostDriver;
    use crate::ops::test_support::{host_fixture, Fixture};
    use crate::pool::{PoolBuffer, Purpose};

    fn register_twins(driver: &HostDriver) {
        // ember_exact_rms_norm_f32(float* out, const float* x, const float* weight,
        // uint32_t n_cols, float eps); grid = rows.
        driver.register_kernel("ember_exact_rms_norm_f32", |launch| {
            let (out, x, w) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?, launch.ptr_arg(2)?);
            let (dim, eps) = (launch.u32_arg(3)? as usize, launch.f32_arg(4)?);
            let rows = launch.config().grid[0] as usize;
            let x = launch.read_f32(x, rows * dim)?;
            let w = launch.read_f32(w, dim)?;
            let mut values = vec![0f32; rows * dim];
            for r in 0..rows {
                let row = &x[r * dim..(r + 1) * dim];
                let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
                let scale = 1.0 / ((sum / dim as f64) as f32 + eps).sqrt();
                for c in 0..dim {
                    values[r * dim + c] = row[c] * scale * w[c];
                }
            }
            launch.write_f32(out, &values)
        });
        // ember_exact_geglu_f32(float* out, const float* gate, const float* up,
        // const uint16_t* table, uint32_t n)
        driver.register_kernel("ember_exact_geglu_f32", |launch| {
            let (out, gate, up, table) = (
                launch.ptr_arg(0)?,
                launch.ptr_arg(1)?,
                launch.ptr_arg(2)?,
                launch.ptr_arg(3)?,
            );
            let n = launch.u32_arg(4)? as usize;
            let gate = launch.read_f32(gate, n)?;
            let up = launch.read_f32(up, n)?;
            let mut bytes = vec![0u8; GELU_TABLE_LEN * 2];
            launch.read(table, &mut bytes)?;
            let values: Vec<f32> = (0..n)
                .map(|i| {
                    let x = gate[i];
                    let g = if x <= -10.0 {
                        0.0
                    } else if x >= 10.0 {
                        x
                    } else {
                        let index = f16::from_f32(x).to_bits() as usize;
                        f16::from_bits(u16::from_le_bytes([bytes[2 * index], bytes[2 * index + 1]]))
                            .to_f32()
                    };
                    g * up[i]
                })
                .collect();
            launch.write_f32(out, &values)
        });
        // ember_exact_rope_{norm,neox}_f32(float* x, const float* cos_sin, uint32_t n_tokens,
        // uint32_t n_heads, uint32_t head_dim, uint32_t n_dims)
        for (name, neox) in [
            ("ember_exact_rope_norm_f32", false),
            ("ember_exact_rope_neox_f32", true),
        ] {
            driver.register_kernel(name, move |launch| {
                let (x, cs) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?);
                let n_tokens = launch.u32_arg(2)? as usize;
                let n_heads = launch.u32_arg(3)? as usize;
                let head_dim = launch.u32_arg(4)? as usize;
                let n_dims = launch.u32_arg(5)? as usize;
                let mut v = launch.read_f32(x, n_tokens * n_heads * head_dim)?;
                let cs = launch.read_f32(cs, n_tokens * n_dims)?;
                let half = n_dims / 2;
                for t in 0..n_tokens {
                    for h in 0..n_heads {
                        let head = &mut v[(t * n_heads + h) * head_dim..][..head_dim];
                        for i in 0..half {
                            let (c, s) = (cs[t * n_dims + 2 * i], cs[t * n_dims + 2 * i + 1]);
                            let (a, b) = if neox {
                                (i, i + half)
                            } else {
                                (2 * i, 2 * i + 1)
                            };
                            let (x0, x1) = (head[a], head[b]);
                            head[a] = x0.mul_add(c, -(x1 * s));
                            head[b] = x0.mul_add(s, x1 * c);
                        }
                    }
                }
                launch.write_f32(x, &v)
            });
        }
    }

    fn fixture() -> Fixture {
        host_fixture(register_twins)
    }

    fn upload_f32(ctx: &GpuContext, values: &[f32]) -> PoolBuffer {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        upload_bytes(ctx, &bytes)
    }

    fn upload_bytes(ctx: &GpuContext, bytes: &[u8]) -> PoolBuffer {
        let buf = ctx
            .alloc(Purpose::Scratch, bytes.len().max(4) as u64)
            .unwrap();
        ctx.upload(buf.ptr(), bytes).unwrap();
        buf
    }

    fn download_f32(ctx: &GpuContext, ptr: DevicePtr, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        ctx.download(ptr, &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.731).sin() * 3.0)
            .collect()
    }

    #[test]
    fn every_exact_get_rows_kernel_name_is_exported() {
        let spec = KernelModule::ExactElementwise.spec();
        for format in WeightFormat::ALL {
            let name = get_rows_exact_kernel(format);
            assert!(spec.functions.contains(&name), "{name}");
            assert_eq!(
                name,
                format!("ember_exact_get_rows_{}", format.kernel_suffix())
            );
        }
    }

    #[test]
    fn rms_norm_runs_one_block_per_row() {
        let f = fixture();
        let ctx = &f.ctx;
        let (rows, dim) = (3, 64);
        let x = values(rows * dim, 1.0);
        let w = values(dim, 2.0);
        let (x_buf, w_buf) = (upload_f32(ctx, &x), upload_f32(ctx, &w));
        let out = ctx
            .alloc(Purpose::Scratch, (rows * dim * 4) as u64)
            .unwrap();
        rms_norm_exact(ctx, x_buf.ptr(), w_buf.ptr(), rows, dim, 1e-6, out.ptr()).unwrap();
        let got = download_f32(ctx, out.ptr(), rows * dim);
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
            let scale = 1.0 / ((sum / dim as f64) as f32 + 1e-6).sqrt();
            for c in 0..dim {
                assert_eq!(
                    got[r * dim + c],
                    row[c] * scale * w[c],
                    "row {r}, column {c}"
                );
            }
        }
    }

    #[test]
    fn the_wrappers_run_the_exact_kernels_in_reference_numerics() {
        // Only the exact kernels' twins are registered, so a launch of a fast kernel fails.
        let mut f = fixture();
        let (rows, dim) = (2, 32);
        let x = values(rows * dim, 1.0);
        let w = values(dim, 2.0);
        let (x_buf, w_buf) = (upload_f32(&f.ctx, &x), upload_f32(&f.ctx, &w));
        let out = f
            .ctx
            .alloc(Purpose::Scratch, (rows * dim * 4) as u64)
            .unwrap();
        let norm = |ctx: &GpuContext| {
            super::super::rms_norm(ctx, x_buf.ptr(), w_buf.ptr(), rows, dim, 1e-6, out.ptr())
        };
        assert_eq!(f.ctx.numerics(), super::super::Numerics::Fast);
        let error = norm(&f.ctx).unwrap_err().to_string();
        assert!(error.contains("ember_rms_norm_f32"), "{error}");
        f.ctx.set_numerics(super::super::Numerics::Reference);
        norm(&f.ctx).unwrap();
        let got = download_f32(&f.ctx, out.ptr(), rows * dim);
        let exact = f
            .ctx
            .alloc(Purpose::Scratch, (rows * dim * 4) as u64)
            .unwrap();
        rms_norm_exact(
            &f.ctx,
            x_buf.ptr(),
            w_buf.ptr(),
            rows,
            dim,
            1e-6,
            exact.ptr(),
        )
        .unwrap();
        assert_eq!(got, download_f32(&f.ctx, exact.ptr(), rows * dim));
        // The exact kernel always multiplies by a weight; a bare norm is refused, not faulted.
        let error = super::super::rms_norm(
            &f.ctx,
            x_buf.ptr(),
            DevicePtr::NULL,
            rows,
            dim,
            1e-6,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("without a weight"), "{error}");
        // SwiGLU's exact kernel has no twin here: the error names the kernel the wrapper chose.
        let up = upload_f32(&f.ctx, &x);
        let error = super::super::swiglu(&f.ctx, out.ptr(), x_buf.ptr(), up.ptr(), rows * dim)
            .unwrap_err()
            .to_string();
        assert!(error.contains("ember_exact_swiglu_f32"), "{error}");
    }

    #[test]
    fn geglu_reads_the_table_it_is_given() {
        let f = fixture();
        let ctx = &f.ctx;
        // A table holding each f16 value's own bits doubled: gelu(x) becomes f16(2 f16(x)).
        let table: Vec<u8> = (0..GELU_TABLE_LEN)
            .flat_map(|bits| {
                let x = f16::from_bits(bits as u16).to_f32();
                f16::from_f32(2.0 * x).to_bits().to_le_bytes()
            })
            .collect();
        let table_buf = upload_bytes(ctx, &table);
        let gate = [-12.0f32, -3.3, 0.0, 1.7, 9.99, 12.0];
        let up = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (gate_buf, up_buf) = (upload_f32(ctx, &gate), upload_f32(ctx, &up));
        geglu_exact(
            ctx,
            gate_buf.ptr(),
            gate_buf.ptr(),
            up_buf.ptr(),
            table_buf.ptr(),
            gate.len(),
        )
        .unwrap();
        let got = download_f32(ctx, gate_buf.ptr(), gate.len());
        let doubled = |x: f32| f16::from_f32(2.0 * f16::from_f32(x).to_f32()).to_f32();
        let want = [
            0.0,
            doubled(-3.3) * 2.0,
            0.0,
            doubled(1.7) * 4.0,
            doubled(9.99) * 5.0,
            12.0 * 6.0,
        ];
        assert_eq!(got, want);
        let error = geglu_exact(
            ctx,
            gate_buf.ptr(),
            gate_buf.ptr(),
            up_buf.ptr(),
            DevicePtr::NULL,
            6,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("65536 f16 GELU values"),
            "{error}"
        );
    }

    #[test]
    fn rope_reads_one_cos_sin_row_per_token_in_both_modes() {
        let f = fixture();
        let ctx = &f.ctx;
        let (n_tokens, n_heads, head_dim, n_dims) = (2, 2, 8, 4);
        // Token 0: pair 0 turns by 90 degrees, pair 1 not at all; token 1: the other way round.
        let cs = [0.0f32, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
        let cs_buf = upload_f32(ctx, &cs);
        let x: Vec<f32> = (0..n_tokens * n_heads * head_dim)
            .map(|i| i as f32)
            .collect();
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            let x_buf = upload_f32(ctx, &x);
            rope_exact(
                ctx,
                x_buf.ptr(),
                cs_buf.ptr(),
                n_tokens,
                n_heads,
                head_dim,
                n_dims,
                mode,
            )
            .unwrap();
            let got = download_f32(ctx, x_buf.ptr(), x.len());
            let (a0, b0, a1, b1) = match mode {
                RopeMode::Normal => (0, 1, 2, 3),
                RopeMode::Neox => (0, 2, 1, 3),
            };
            for t in 0..n_tokens {
                for h in 0..n_heads {
                    let base = (t * n_heads + h) * head_dim;
                    let head = &got[base..base + head_dim];
                    let orig = &x[base..base + head_dim];
                    // The turned pair: (x0, x1) -> (-x1, x0); the other unchanged.
                    let (ta, tb, sa, sb) = if t == 0 {
                        (a0, b0, a1, b1)
                    } else {
                        (a1, b1, a0, b0)
                    };
                    assert_eq!(head[ta], -orig[tb], "{mode:?} token {t} head {h}");
                    assert_eq!(head[tb], orig[ta], "{mode:?} token {t} head {h}");
                    assert_eq!(head[sa], orig[sa]);
                    assert_eq!(head[sb], orig[sb]);
                    assert_eq!(&head[n_dims..], &orig[n_dims..], "past n_dims untouched");
                }
            }
        }
        let error =
            rope_exact(ctx, cs_buf.ptr(), cs_buf.ptr(), 1, 1, 4, 6, RopeMode::Neox).unwrap_err();
        assert!(
            error.to_string().contains("at most the head size 4"),
            "{error}"
        );
    }
}
