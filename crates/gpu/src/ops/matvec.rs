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
    if w.cols == 0 || w.cols % GROUP != 0 {
        return Err(OpsError::shape(
            OP,
            "a column count that is a positive multiple of 32",
            format!("{}", w.cols),
        ));
    }
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let n_values = n_tokens.checked_mul(w.cols).unwrap_or(usize::MAX);
    let n_values_u32 = as_u32(OP, "tokens times columns", n_values)?;
    let rows_per_block = (MATVEC_THREADS / ctx.warp_size().clamp(1, MATVEC_THREADS)).max(1);
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
    use super::*;
    use crate::kernels::KERNEL_MODULES;

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
