//! `attention_exact`: the attention of the GPU's reference-numerics mode, bit for bit what the
//! CPU backend (engine/src/backend/cpu/attention.rs) computes for the same queries, the same f16
//! K/V cache contents and the same batch (kernels/exact_attention.hip).
//!
//! The CPU reproduces llama.cpp's CPU flash attention path for path, and which path a batch takes
//! decides its roundings: batches of 64 tokens or more (head size a multiple of 16) take the
//! tiled f32 path; a single token whose cache view (its position + 1 rounded up to 256 cells) has
//! 512 cells or more takes the split-KV path, whose split follows the CPU's thread count; every
//! other batch takes the one-query-at-a-time f16 path. [`attention_exact`] takes the same
//! decisions from the same inputs: the token count and head size here, the position of a single
//! token on the device, and the CPU thread count the caller names. How the CPU groups tokens into
//! query tiles and tasks does not change any token's result, so nothing else is needed.
//!
//! The kernel is one thread block per (token, query head), simple rather than fast: the running
//! maximum and sum are kept by one thread in key order, as the CPU keeps them. Scores,
//! exponentials and per-dimension accumulations run in parallel, each with the CPU's own sequence
//! of roundings; the exponentials are device ports of glibc's `expf` (the CPU's `f32::exp`) and of
//! GGML's vectorised `expf` ([`exp_exact`] exposes both for checks).

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::{as_u32, AttentionArgs, GpuContext, OpsError, BLOCK_THREADS, MAX_STRIDE_BLOCKS};

/// Threads per block of `ember_exact_attention` (EXACT_ATTN_THREADS): one per dimension.
const EXACT_ATTENTION_THREADS: u32 = 256;
/// Largest head size the kernel handles (EXACT_ATTN_MAX_HEAD_DIM).
pub const EXACT_MAX_HEAD_DIM: usize = 256;
/// From this many tokens in a batch on, the CPU takes its tiled f32 path
/// (attention.rs `F32_PATH_MIN_TOKENS`).
const F32_PATH_MIN_TOKENS: usize = 64;
/// Largest grid.x (blocks of 256 threads: the threads of one dimension stay below 2^32).
const MAX_BLOCKS: usize = 1 << 23;

/// Attention of every query token over its sequence's cached keys and values, every output
/// bit-identical to the CPU backend's attention of the same batch run on `reference_threads`
/// threads (the CPU's rayon pool size; it matters only for a single token over a cache view of
/// 512 cells or more, and 0 counts as 1, as on the CPU). The cache and batch are those of
/// [`super::attention()`]: the same paged f16 K/V blocks, tables and positions, and every
/// position a token attends to must be stored. `args.max_position` is not used.
///
/// A single-token batch follows the CPU's assumption that its sequence is stored from position
/// 0 on (the view it pads is the position + 1 cells). `args.softcap` must be `None`: the CPU
/// attention has no softcap, so there is no reference to match. Asynchronous on the context's
/// stream; allocates nothing.
pub fn attention_exact(
    ctx: &GpuContext,
    args: &AttentionArgs,
    reference_threads: usize,
) -> Result<(), OpsError> {
    const OP: &str = "attention_exact";
    if args.n_tokens == 0 || args.n_heads == 0 {
        return Ok(());
    }
    check_shape(args)?;
    let window = match args.window {
        None => 0,
        Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
    };
    let f32_path = args.n_tokens >= F32_PATH_MIN_TOKENS && args.head_dim.is_multiple_of(16);
    let n_chunks = as_u32(OP, "the reference thread count", reference_threads.max(1))?;
    let blocks = args
        .n_tokens
        .checked_mul(args.n_heads)
        .filter(|&b| b <= MAX_BLOCKS)
        .ok_or_else(|| {
            OpsError::shape(
                OP,
                format!("at most {MAX_BLOCKS} tokens x heads"),
                format!("{} x {}", args.n_tokens, args.n_heads),
            )
        })?;
    let n_tokens = as_u32(OP, "the token count", args.n_tokens)?;
    let n_heads = as_u32(OP, "the head count", args.n_heads)?;
    let n_kv_heads = as_u32(OP, "the KV head count", args.n_kv_heads)?;
    let head_dim = as_u32(OP, "the head size", args.head_dim)?;
    let block_size = as_u32(OP, "the block size", args.block_size)?;
    let max_blocks = as_u32(OP, "the blocks per table", args.max_blocks_per_table)?;
    let launch_args = KernelArgs::new()
        .arg(KernelArg::Ptr(args.out))
        .arg(KernelArg::Ptr(args.q))
        .arg(KernelArg::Ptr(args.k_blocks))
        .arg(KernelArg::Ptr(args.v_blocks))
        .arg(KernelArg::Ptr(args.block_tables))
        .arg(KernelArg::Ptr(args.table_of_token))
        .arg(KernelArg::Ptr(args.positions))
        .arg(KernelArg::U32(n_tokens))
        .arg(KernelArg::U32(n_heads))
        .arg(KernelArg::U32(n_kv_heads))
        .arg(KernelArg::U32(head_dim))
        .arg(KernelArg::U32(block_size))
        .arg(KernelArg::U32(max_blocks))
        .arg(KernelArg::F32(args.scale))
        .arg(KernelArg::I32(window))
        .arg(KernelArg::U32(u32::from(f32_path)))
        .arg(KernelArg::U32(n_chunks));
    let config = LaunchConfig {
        grid: [blocks as u32, 1, 1],
        block: [EXACT_ATTENTION_THREADS, 1, 1],
        shared_mem_bytes: 0,
    };
    // SAFETY: ember_exact_attention(float* out, const float* q, const uint64_t* k_blocks, const
    // uint64_t* v_blocks, const int32_t* block_tables, const int32_t* table_of_token, const
    // int32_t* positions, uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t
    // head_dim, uint32_t block_size, uint32_t max_blocks_per_table, float scale, int32_t window,
    // uint32_t f32_path, uint32_t n_chunks) with head_dim <= 256 and n_heads a multiple of
    // n_kv_heads (checked). Block t * n_heads + h reads row (t, h) of q, the cache slots of the
    // positions the caller declared stored through its tables, and writes row (t, h) of out.
    unsafe {
        ctx.launch(
            KernelModule::ExactAttention,
            "ember_exact_attention",
            config,
            &launch_args,
        )
    }
}

/// Which exponential [`exp_exact`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExactExp {
    /// glibc's `expf` (x86-64, FMA build): the CPU's `f32::exp`.
    Libm,
    /// GGML's AVX-512 `ggml_v_expf`: the CPU backend's `vec::expf_ggml`.
    Ggml,
}

/// `out[i] = e^x[i]` for `n` f32 values by the device exponential the exact attention uses, so
/// checks can hold it to the CPU's. Asynchronous on the context's stream.
pub fn exp_exact(
    ctx: &GpuContext,
    x: DevicePtr,
    out: DevicePtr,
    n: usize,
    flavor: ExactExp,
) -> Result<(), OpsError> {
    const OP: &str = "exp_exact";
    if n == 0 {
        return Ok(());
    }
    let n = as_u32(OP, "the value count", n)?;
    let flavor = match flavor {
        ExactExp::Libm => 0u32,
        ExactExp::Ggml => 1,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::U32(n))
        .arg(KernelArg::U32(flavor));
    let blocks = n.div_ceil(BLOCK_THREADS).min(MAX_STRIDE_BLOCKS);
    // SAFETY: ember_exact_expf(float* out, const float* x, uint32_t n, uint32_t flavor) is a
    // grid-stride loop over i < n reading x[i] and writing out[i] (both sized by the caller).
    unsafe {
        ctx.launch(
            KernelModule::ExactAttention,
            "ember_exact_expf",
            LaunchConfig::linear(blocks, BLOCK_THREADS),
            &args,
        )
    }
}

/// Checks what the kernel requires of the shape.
fn check_shape(args: &AttentionArgs) -> Result<(), OpsError> {
    const OP: &str = "attention_exact";
    if args.n_kv_heads == 0 || !args.n_heads.is_multiple_of(args.n_kv_heads) {
        return Err(OpsError::shape(
            OP,
            format!("a KV head count dividing the {} query heads", args.n_heads),
            format!("{}", args.n_kv_heads),
        ));
    }
    if args.head_dim == 0 || args.head_dim > EXACT_MAX_HEAD_DIM {
        return Err(OpsError::shape(
            OP,
            format!("a head size from 1 to {EXACT_MAX_HEAD_DIM}"),
            format!("{}", args.head_dim),
        ));
    }
    if args.block_size == 0 {
        return Err(OpsError::shape(OP, "a block size above 0", "0"));
    }
    if args.n_tables == 0 || args.max_blocks_per_table == 0 {
        return Err(OpsError::shape(
            OP,
            "at least one block table with at least one block",
            format!(
                "{} tables of {} blocks",
                args.n_tables, args.max_blocks_per_table
            ),
        ));
    }
    if args.window == Some(0) {
        return Err(OpsError::shape(OP, "a window of at least 1 position", "0"));
    }
    if let Some(cap) = args.softcap {
        return Err(OpsError::Unsupported {
            op: OP,
            what: format!(
                "a softcap ({cap}): the CPU attention it must match applies none (Gemma 2 only)"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The launch wrapper on the host driver (argument order, grid, path decisions), and a Rust
    //! twin of the device port of glibc's `expf` held to `f32::exp`. The kernel's arithmetic is
    //! checked against the CPU backend on a GPU by engine/examples/exact_attention_check.rs.

    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::host::HostDriver;
    use crate::ops::attention::tests::{host_context, upload_f32};

    /// glibc's `__exp2f_data.tab`: 2^(i/32) as f64 bits, minus `i << 47`.
    const EXP2F_TABLE: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];

    /// `xa_expf_libm` of kernels/exact_attention.hip, operation for operation.
    fn expf_libm_twin(x: f32) -> f32 {
        let bits = x.to_bits();
        let abstop = (bits >> 20) & 0x7ff;
        if abstop >= 0x42b {
            if bits == 0xff80_0000 {
                return 0.0;
            }
            if abstop >= 0x7f8 {
                return x + x;
            }
            if x > f32::from_bits(0x42b1_7217) {
                return f32::INFINITY;
            }
            if x < f32::from_bits(0xc2cf_f1b4) {
                return 0.0;
            }
        }
        let inv_ln2_n = f64::from_bits(0x4047_1547_652b_82fe);
        let shift = f64::from_bits(0x4338_0000_0000_0000);
        let c0 = f64::from_bits(0x3ebc_6af8_4b91_2394);
        let c1 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
        let c2 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
        let xd = f64::from(x);
        let kd = inv_ln2_n.mul_add(xd, shift);
        let ki = kd.to_bits();
        let kd = kd - shift;
        let r = inv_ln2_n.mul_add(xd, -kd);
        let t = EXP2F_TABLE[(ki % 32) as usize].wrapping_add(ki << 47);
        let s = f64::from_bits(t);
        let z = c0.mul_add(r, c1);
        let r2 = r * r;
        let y = c2.mul_add(r, 1.0);
        let y = z.mul_add(r2, y);
        (y * s) as f32
    }

    fn check_expf(x: f32) {
        // black_box keeps LLVM from folding `exp` of a constant (it folds through f64, which
        // rounds correctly where glibc's expf does not).
        let (got, want) = (expf_libm_twin(x), std::hint::black_box(x).exp());
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "x = {x} ({:#010x}): twin {got} ({:#010x}), f32::exp {want} ({:#010x})",
            x.to_bits(),
            got.to_bits(),
            want.to_bits()
        );
    }

    /// The twin was compared with glibc 2.36's `expf` over every f32 once (equal for all
    /// non-NaN inputs); here, a sample over all of them and every input of one binade in the
    /// softmax range, plus the two inputs where an unfused reduction would differ.
    #[test]
    fn expf_twin_matches_f32_exp() {
        for bits in (0..=u32::MAX).step_by(4099) {
            check_expf(f32::from_bits(bits));
        }
        for bits in f32::to_bits(-1.0)..f32::to_bits(-2.0) {
            check_expf(f32::from_bits(bits));
        }
        for x in [
            32.564_632,
            -63.099_46,
            0.0,
            -0.0,
            88.0,
            88.72,
            -87.5,
            -103.28,
            -103.97,
            -104.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ] {
            check_expf(x);
        }
    }

    /// The launch arguments of each call, as the host twin of the kernel decoded them.
    type Seen = Arc<Mutex<Vec<(LaunchConfig, Vec<KernelArg>)>>>;

    fn recording_context() -> (GpuContext, tempfile::TempDir, Seen) {
        let seen: Seen = Arc::default();
        let record = Arc::clone(&seen);
        let (ctx, dir) = host_context(move |driver: &HostDriver| {
            for name in ["ember_exact_attention", "ember_exact_expf"] {
                let record = Arc::clone(&record);
                driver.register_kernel(name, move |l| {
                    record
                        .lock()
                        .unwrap()
                        .push((*l.config(), l.args().to_vec()));
                    Ok(())
                });
            }
        });
        (ctx, dir, seen)
    }

    fn args(n_tokens: usize, head_dim: usize) -> AttentionArgs {
        AttentionArgs {
            q: DevicePtr(0x1000),
            out: DevicePtr(0x2000),
            k_blocks: DevicePtr(0x3000),
            v_blocks: DevicePtr(0x4000),
            block_tables: DevicePtr(0x5000),
            table_of_token: DevicePtr(0x6000),
            positions: DevicePtr(0x7000),
            n_tokens,
            n_tables: 1,
            max_blocks_per_table: 40,
            max_position: 1000,
            n_heads: 12,
            n_kv_heads: 4,
            head_dim,
            block_size: 32,
            scale: 0.125,
            window: Some(512),
            softcap: None,
        }
    }

    #[test]
    fn attention_exact_passes_its_arguments_in_kernel_order() {
        let (ctx, _dir, seen) = recording_context();
        for (n_tokens, head_dim, threads, f32_path, chunks) in [
            (1usize, 64usize, 2usize, 0u32, 2u32),
            (63, 128, 2, 0, 2),
            (64, 128, 8, 1, 8),
            (64, 72, 2, 0, 2),
            (100, 256, 0, 1, 1),
        ] {
            let a = args(n_tokens, head_dim);
            attention_exact(&ctx, &a, threads).unwrap();
            let (config, got) = seen.lock().unwrap().pop().unwrap();
            assert_eq!(config.grid, [(n_tokens * 12) as u32, 1, 1]);
            assert_eq!(config.block, [EXACT_ATTENTION_THREADS, 1, 1]);
            let want = vec![
                KernelArg::Ptr(a.out),
                KernelArg::Ptr(a.q),
                KernelArg::Ptr(a.k_blocks),
                KernelArg::Ptr(a.v_blocks),
                KernelArg::Ptr(a.block_tables),
                KernelArg::Ptr(a.table_of_token),
                KernelArg::Ptr(a.positions),
                KernelArg::U32(n_tokens as u32),
                KernelArg::U32(12),
                KernelArg::U32(4),
                KernelArg::U32(head_dim as u32),
                KernelArg::U32(32),
                KernelArg::U32(40),
                KernelArg::F32(0.125),
                KernelArg::I32(512),
                KernelArg::U32(f32_path),
                KernelArg::U32(chunks),
            ];
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "{n_tokens} tokens");
        }
        // Nothing to do: no launch.
        attention_exact(&ctx, &args(0, 64), 2).unwrap();
        assert!(seen.lock().unwrap().is_empty());

        let x = upload_f32(&ctx, &[0.0; 4]);
        exp_exact(&ctx, x.ptr(), x.ptr(), 4, ExactExp::Ggml).unwrap();
        let (_, got) = seen.lock().unwrap().pop().unwrap();
        let want = [
            KernelArg::Ptr(x.ptr()),
            KernelArg::Ptr(x.ptr()),
            KernelArg::U32(4),
            KernelArg::U32(1),
        ];
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
    }

    #[test]
    fn shapes_the_exact_kernel_cannot_serve_are_errors() {
        let rejected = |change: &dyn Fn(&mut AttentionArgs), expected: &str| {
            let mut a = args(4, 128);
            change(&mut a);
            let error = check_shape(&a).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        };
        check_shape(&args(4, 128)).unwrap();
        check_shape(&args(4, 72)).unwrap();
        rejected(&|a| a.n_kv_heads = 5, "a KV head count dividing the 12");
        rejected(&|a| a.head_dim = 257, "a head size from 1 to 256");
        rejected(&|a| a.block_size = 0, "a block size above 0");
        rejected(&|a| a.window = Some(0), "a window of at least 1");
        rejected(&|a| a.n_tables = 0, "at least one block table");
        rejected(&|a| a.softcap = Some(30.0), "does not support a softcap");
    }
}
