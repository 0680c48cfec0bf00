//! `matmul_exact`: the matrix product of the GPU's reference-numerics mode, every output bit for
//! bit what the CPU backend computes (`ember_quant::matmul`, as `engine/src/backend/cpu` calls it)
//! for the same weights and f32 activations on an x86 CPU with AVX2.
//!
//! Two steps, both asynchronous on the context's stream:
//! 1. the activations are quantised to the weights' dot-product type exactly as the CPU quantises
//!    them (Q8_0, Q8_1, Q8_K, or rounded to f16 / bf16; f32 weights take x as it is) into one
//!    scratch buffer from the pool: int8 quants `[n_tokens, cols]`, then the per-block scales (the
//!    f16 ones widened to f32), then Q8_1's `s` or Q8_K's 16 block sums per super-block
//!    ([`ScratchLayout`]);
//! 2. one kernel per weight format computes every output with a group of 8 threads holding the 8
//!    float lanes of the CPU's AVX2 accumulator, in the CPU's order (`kernels/exact_matmul.hip`
//!    says which order each format follows).
//!
//! Where the CPU's order depends on the call, this module decides and passes it as the kernel's
//! `mode` ([`kernel_mode`]): Q2_K, Q3_K and Q5_K switch from `vec_dot` to the CPU's tile kernel at
//! 12 tokens; Q4_K matrices whose row count is a multiple of 8 follow llama.cpp's repacked order,
//! per pair of sub-blocks for every token of a batch of four or more, per super-block for smaller
//! batches; Q4_0 matrices whose row count is a multiple of 8 follow llama.cpp's repacked order
//! too (one FMA chain per output over the blocks' whole integer sums) at every token count.
//! The CPU's thread count and job split never change its bits, so nothing else is needed.
//!
//! `ember_quant::matmul` gives the same bits on AVX2 and AVX-512 machines (one tile kernel for
//! both), so the order followed here holds for the CPU backend on any x86 machine.
//!
//! Scratch comes from the pool like the other ops' (released once the launches are queued; stream
//! order keeps its reuse after them), so the op can be recorded in a graph once the pool holds a
//! block of the size it asks for. Speed is secondary: one group of 8 threads per output, blocks of
//! 32 outputs sharing weight rows and tokens through the caches, no shared-memory tiling (the
//! `exact_check` example times it).

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;
use crate::pool::Purpose;

use super::{as_u32, stride_launch, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Threads per block of the matmul kernels (`EMBER_EXACT_THREADS`).
const EXACT_THREADS: u32 = 256;
/// Threads per output: the CPU accumulator's 8 float lanes (`EMBER_EXACT_LANES`).
const EXACT_LANES: u32 = 8;
/// Outputs per block.
const EXACT_GROUPS: u32 = EXACT_THREADS / EXACT_LANES;
/// From this many tokens on, the CPU multiplies Q2_K, Q3_K and Q5_K with its tile kernel
/// (`ember_quant`'s `tile_min_tokens` for formats other than Q4_0, Q4_1 and Q8_0).
const K_TILE_MIN_TOKENS: usize = 12;
/// grid.y limit of every runtime.
const MAX_GRID_Y: usize = 65_535;
/// Alignment of each part of the scratch buffer.
const SCRATCH_ALIGN: u64 = 256;

/// What the CPU dots weights of a format against (GGML's `vec_dot_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActivationFormat {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q8_1,
    Q8K,
}

impl ActivationFormat {
    fn of(format: WeightFormat) -> ActivationFormat {
        match format {
            WeightFormat::F32 => ActivationFormat::F32,
            WeightFormat::F16 => ActivationFormat::F16,
            WeightFormat::BF16 => ActivationFormat::Bf16,
            WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => ActivationFormat::Q8_0,
            WeightFormat::Q4_1 | WeightFormat::Q5_1 => ActivationFormat::Q8_1,
            WeightFormat::Q2K
            | WeightFormat::Q3K
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q6K => ActivationFormat::Q8K,
        }
    }

    /// Values per scale.
    fn block_values(self) -> usize {
        match self {
            ActivationFormat::F32 | ActivationFormat::F16 | ActivationFormat::Bf16 => 1,
            ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => 32,
            ActivationFormat::Q8K => 256,
        }
    }
}

/// Byte offsets of the parts of the activation scratch buffer: `values` (int8 quants, or f32
/// values for f16/bf16), `scales` (one f32 per block), `sums` (Q8_1's `s`, one f32 per block),
/// `bsums` (Q8_K's 16 i16 per block). Parts a format does not use are empty (`total` bytes in
/// all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ScratchLayout {
    values: u64,
    scales: u64,
    sums: u64,
    bsums: u64,
    total: u64,
}

fn align_up(bytes: u64) -> u64 {
    bytes.div_ceil(SCRATCH_ALIGN) * SCRATCH_ALIGN
}

/// The scratch layout for `values` activation values (`n_tokens * cols`, whole blocks), or `None`
/// when the weights take the f32 activations as they are.
fn scratch_layout(act: ActivationFormat, values: usize) -> Option<ScratchLayout> {
    let values = values as u64;
    let blocks = values / act.block_values() as u64;
    let (value_bytes, sum_bytes, bsum_bytes) = match act {
        ActivationFormat::F32 => return None,
        ActivationFormat::F16 | ActivationFormat::Bf16 => (values * 4, 0, 0),
        ActivationFormat::Q8_0 => (values, 0, 0),
        ActivationFormat::Q8_1 => (values, blocks * 4, 0),
        ActivationFormat::Q8K => (values, 0, blocks * 16 * 2),
    };
    let scale_bytes = if act.block_values() > 1 {
        blocks * 4
    } else {
        0
    };
    let scales = align_up(value_bytes);
    let sums = scales + align_up(scale_bytes);
    let bsums = sums + align_up(sum_bytes);
    let total = (bsums + align_up(bsum_bytes)).max(SCRATCH_ALIGN);
    Some(ScratchLayout {
        values: 0,
        scales,
        sums,
        bsums,
        total,
    })
}

/// The kernel's `mode` and `gemm_tokens` for `n_tokens` tokens through a matrix of `rows` rows:
/// the float order the CPU follows (see the module docs). `gemm_tokens` matters only for
/// repacked Q4_K (mode 1): tokens below it take the gemm's steps, as `repack_order::matmul`
/// does (every token of a batch of four or more, none of a smaller one).
fn kernel_mode(format: WeightFormat, rows: usize, n_tokens: usize) -> (u32, u32) {
    match format {
        WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Q5K => {
            (u32::from(n_tokens >= K_TILE_MIN_TOKENS), 0)
        }
        WeightFormat::Q4K if rows.is_multiple_of(8) => {
            let gemm_tokens = if n_tokens > 3 { n_tokens } else { 0 };
            (1, gemm_tokens as u32)
        }
        // llama.cpp's repacked Q4_0 order: the same float steps at every token count.
        WeightFormat::Q4_0 if rows.is_multiple_of(8) => (1, 0),
        _ => (0, 0),
    }
}

/// Tokens per block of the matmul kernels (the block is `32 / tile_tokens` rows by `tile_tokens`
/// tokens): the block's rows share each activation load and its tokens each weight load.
fn tile_tokens(n_tokens: usize) -> u32 {
    match n_tokens {
        0 | 1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    }
}

/// The matmul kernel of `format`.
fn matmul_kernel(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::F32 => "ember_exact_matmul_f32",
        WeightFormat::F16 => "ember_exact_matmul_f16",
        WeightFormat::BF16 => "ember_exact_matmul_bf16",
        WeightFormat::Q4_0 => "ember_exact_matmul_q4_0",
        WeightFormat::Q4_1 => "ember_exact_matmul_q4_1",
        WeightFormat::Q5_0 => "ember_exact_matmul_q5_0",
        WeightFormat::Q5_1 => "ember_exact_matmul_q5_1",
        WeightFormat::Q8_0 => "ember_exact_matmul_q8_0",
        WeightFormat::Q2K => "ember_exact_matmul_q2_k",
        WeightFormat::Q3K => "ember_exact_matmul_q3_k",
        WeightFormat::Q4K => "ember_exact_matmul_q4_k",
        WeightFormat::Q5K => "ember_exact_matmul_q5_k",
        WeightFormat::Q6K => "ember_exact_matmul_q6_k",
    }
}

/// The matmul launches for `n_tokens` tokens through `rows` rows: (first token, launch config)
/// per token slice (grid.y is capped at [`MAX_GRID_Y`] token tiles).
fn matmul_launches(rows: usize, n_tokens: usize) -> Vec<(usize, LaunchConfig)> {
    let tile = tile_tokens(n_tokens) as usize;
    let tile_rows = (EXACT_GROUPS as usize) / tile;
    let grid_x = rows.div_ceil(tile_rows) as u32;
    let tiles = n_tokens.div_ceil(tile);
    (0..tiles)
        .step_by(MAX_GRID_Y)
        .map(|first_tile| {
            let count = (tiles - first_tile).min(MAX_GRID_Y);
            let config = LaunchConfig {
                grid: [grid_x, count as u32, 1],
                block: [EXACT_THREADS, 1, 1],
                shared_mem_bytes: 0,
            };
            (first_tile * tile, config)
        })
        .collect()
}

/// `out[t, :] = W x[t, :]` for `n_tokens` rows of x (`w.cols` f32 each) into `n_tokens` rows of
/// out (`w.rows` f32 each), every output bit-identical to the CPU backend's. Asynchronous on the
/// context's stream; `out` may not alias `x`.
pub fn matmul_exact(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matmul_exact";
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    if w.format.row_bytes(w.cols).is_none() || w.cols == 0 {
        return Err(OpsError::shape(
            OP,
            format!(
                "a column count that is a positive multiple of {} for {}",
                w.format.block_values(),
                w.format
            ),
            format!("{}", w.cols),
        ));
    }
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let tokens = as_u32(OP, "the token count", n_tokens)?;
    let values = n_tokens
        .checked_mul(w.cols)
        .ok_or_else(|| OpsError::shape(OP, "tokens times columns below 2^64", "an overflow"))?;
    let n_values = as_u32(OP, "tokens times columns", values)?;
    let act = ActivationFormat::of(w.format);
    let scratch = match scratch_layout(act, values) {
        Some(layout) => Some((layout, ctx.alloc(Purpose::Scratch, layout.total)?)),
        None => None,
    };
    // Pointers the matmul kernel reads: activations, scales, Q8_1 sums, Q8_K block sums.
    let (act_values, act_scales, act_sums, act_bsums) = match &scratch {
        None => (x, DevicePtr::NULL, DevicePtr::NULL, DevicePtr::NULL),
        Some((layout, buffer)) => {
            let base = buffer.ptr();
            let part = |offset: u64, used: bool| {
                if used {
                    base.offset(offset)
                } else {
                    DevicePtr::NULL
                }
            };
            let q8 = matches!(act, ActivationFormat::Q8_0 | ActivationFormat::Q8_1);
            (
                base.offset(layout.values),
                part(layout.scales, q8 || act == ActivationFormat::Q8K),
                part(layout.sums, act == ActivationFormat::Q8_1),
                part(layout.bsums, act == ActivationFormat::Q8K),
            )
        }
    };
    let (name, config, args) = match act {
        ActivationFormat::F32 => ("", None, KernelArgs::new()),
        ActivationFormat::F16 | ActivationFormat::Bf16 => {
            let name = if act == ActivationFormat::F16 {
                "ember_exact_round_f16"
            } else {
                "ember_exact_round_bf16"
            };
            let args = KernelArgs::new()
                .arg(KernelArg::Ptr(x))
                .arg(KernelArg::Ptr(act_values))
                .arg(KernelArg::U32(n_values));
            (name, Some(stride_launch(n_values)), args)
        }
        ActivationFormat::Q8_0 | ActivationFormat::Q8_1 | ActivationFormat::Q8K => {
            let blocks = n_values / act.block_values() as u32;
            let (name, last) = match act {
                ActivationFormat::Q8_0 => ("ember_exact_quantize_q8_0", act_sums),
                ActivationFormat::Q8_1 => ("ember_exact_quantize_q8_1", act_sums),
                _ => ("ember_exact_quantize_q8_k", act_bsums),
            };
            let args = KernelArgs::new()
                .arg(KernelArg::Ptr(x))
                .arg(KernelArg::Ptr(act_values))
                .arg(KernelArg::Ptr(act_scales))
                .arg(KernelArg::Ptr(last))
                .arg(KernelArg::U32(blocks));
            (name, Some(stride_launch(blocks)), args)
        }
    };
    if let Some(config) = config {
        // SAFETY: ember_exact_round_{f16,bf16}(const float* x, float* out, uint32_t n) reads n
        // floats of x (n_tokens x cols, the caller's) and writes n floats at the scratch's
        // values part, sized n * 4 bytes; ember_exact_quantize_q8_{0,1,k}(const float* x,
        // int8_t* q, float* d, float*|int16_t* last, uint32_t n_blocks) reads n_blocks whole
        // blocks of x and writes n_blocks blocks of quants, one scale each and (Q8_1) one sum or
        // (Q8_K) 16 block sums each, the parts `scratch_layout` sized for exactly that; Q8_0's
        // `last` is null and unread.
        unsafe { ctx.launch(KernelModule::ExactMatmul, name, config, &args) }?;
    }
    let (mode, gemm_tokens) = kernel_mode(w.format, w.rows, n_tokens);
    let tile = tile_tokens(n_tokens);
    let kernel = matmul_kernel(w.format);
    for (token0, config) in matmul_launches(w.rows, n_tokens) {
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(out))
            .arg(KernelArg::Ptr(w.ptr()))
            .arg(KernelArg::Ptr(act_values))
            .arg(KernelArg::Ptr(act_scales))
            .arg(KernelArg::Ptr(act_sums))
            .arg(KernelArg::Ptr(act_bsums))
            .arg(KernelArg::U32(tokens))
            .arg(KernelArg::U32(token0 as u32))
            .arg(KernelArg::U32(rows))
            .arg(KernelArg::U32(cols))
            .arg(KernelArg::U32(tile))
            .arg(KernelArg::U32(mode))
            .arg(KernelArg::U32(gemm_tokens));
        // SAFETY: ember_exact_matmul_*(float* out, const uint8_t* w, const void* act, const
        // float* act_d, const float* act_s, const int16_t* act_bsums, uint32_t n_tokens, uint32_t
        // token0, uint32_t n_rows, uint32_t n_cols, uint32_t tile_tokens, uint32_t mode,
        // uint32_t gemm_tokens). Each group reads one weight row of W (rows x row_bytes(cols),
        // clamped to the matrix) and one token's activations, scales and sums (clamped below
        // n_tokens, inside the parts written above, or x for f32 weights; the parts a format
        // does not read are null), and writes out[t * rows + r] only for r < rows and
        // t < n_tokens, inside what the caller sized for n_tokens x rows floats. The scratch is
        // released after the launches are queued, and stream order keeps any reuse after them.
        unsafe { ctx.launch(KernelModule::ExactMatmul, kernel, config, &args) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Without a GPU: the host-side decisions, and `matmul_exact` run on the host driver with Rust
    //! twins of `kernels/exact_matmul.hip` registered (each decodes the kernel's C signature and
    //! computes what the launched blocks compute, lane by lane, in the kernel's order), compared
    //! bit for bit with `ember_quant::matmul` on AVX2. That pins down the CPU order the kernels
    //! port, the wrapper's arguments, launch geometry and scratch layout; the kernels themselves
    //! are compared with the CPU on a GPU by the `exact_check` example.

    use half::f16;

    use super::*;
    use crate::host::{HostDriver, HostLaunch};
    use crate::ops::test_support::{host_fixture, Fixture};

    #[test]
    fn every_kernel_name_is_exported_by_the_module() {
        let spec = KernelModule::ExactMatmul.spec();
        for format in WeightFormat::ALL {
            let name = matmul_kernel(format);
            assert!(spec.functions.contains(&name), "{name}");
            assert_eq!(
                name,
                format!("ember_exact_matmul_{}", format.kernel_suffix())
            );
        }
        for name in [
            "ember_exact_quantize_q8_0",
            "ember_exact_quantize_q8_1",
            "ember_exact_quantize_q8_k",
            "ember_exact_round_f16",
            "ember_exact_round_bf16",
        ] {
            assert!(spec.functions.contains(&name), "{name}");
        }
    }

    #[test]
    fn activation_formats_are_ggml_vec_dot_types() {
        for format in WeightFormat::ALL {
            let ty = ember_quant::GgmlType::from_u32(format.ggml_type_id()).unwrap();
            let expected = match ember_quant::vec_dot_type(ty) {
                ember_quant::GgmlType::F32 => ActivationFormat::F32,
                ember_quant::GgmlType::F16 => ActivationFormat::F16,
                ember_quant::GgmlType::BF16 => ActivationFormat::Bf16,
                ember_quant::GgmlType::Q8_0 => ActivationFormat::Q8_0,
                ember_quant::GgmlType::Q8_1 => ActivationFormat::Q8_1,
                ember_quant::GgmlType::Q8_K => ActivationFormat::Q8K,
                other => panic!("unexpected vec_dot_type {other}"),
            };
            assert_eq!(ActivationFormat::of(format), expected, "{format}");
            let act_ty = ember_quant::vec_dot_type(ty);
            assert_eq!(expected.block_values(), act_ty.block_size(), "{format}");
        }
    }

    #[test]
    fn scratch_parts_are_aligned_and_disjoint() {
        assert_eq!(scratch_layout(ActivationFormat::F32, 4096), None);
        let check = |act, values: usize, parts: [u64; 4]| {
            let layout = scratch_layout(act, values).unwrap();
            let offsets = [layout.values, layout.scales, layout.sums, layout.bsums];
            for (i, (&offset, &bytes)) in offsets.iter().zip(&parts).enumerate() {
                assert_eq!(offset % SCRATCH_ALIGN, 0, "{act:?} part {i}");
                let end = offsets.get(i + 1).copied().unwrap_or(layout.total);
                assert!(offset + bytes <= end, "{act:?} part {i}: {layout:?}");
            }
        };
        // 3 tokens of 576 (Q8_0/Q8_1: 54 blocks) and of 512 (Q8_K: 6 super-blocks).
        check(ActivationFormat::Q8_0, 3 * 576, [1728, 54 * 4, 0, 0]);
        check(ActivationFormat::Q8_1, 3 * 576, [1728, 54 * 4, 54 * 4, 0]);
        check(ActivationFormat::Q8K, 3 * 512, [1536, 6 * 4, 0, 6 * 32]);
        check(ActivationFormat::F16, 3 * 100, [1200, 0, 0, 0]);
        check(ActivationFormat::Bf16, 1, [4, 0, 0, 0]);
    }

    #[test]
    fn kernel_modes_follow_the_cpu_strategy() {
        use WeightFormat::*;
        for format in [Q2K, Q3K, Q5K] {
            assert_eq!(kernel_mode(format, 64, 11), (0, 0), "{format}");
            assert_eq!(kernel_mode(format, 64, 12), (1, 0), "{format}");
            assert_eq!(kernel_mode(format, 63, 300), (1, 0), "{format}");
        }
        // Repacked Q4_K: every token of a batch of four or more takes the gemm's steps.
        assert_eq!(kernel_mode(Q4K, 256, 1), (1, 0));
        assert_eq!(kernel_mode(Q4K, 256, 3), (1, 0));
        assert_eq!(kernel_mode(Q4K, 256, 4), (1, 4));
        assert_eq!(kernel_mode(Q4K, 256, 7), (1, 7));
        assert_eq!(kernel_mode(Q4K, 256, 65), (1, 65));
        // Row counts llama.cpp does not repack: vec_dot at every token count.
        assert_eq!(kernel_mode(Q4K, 260, 64), (0, 0));
        // Repacked Q4_0: the same steps at every token count; other row counts vec_dot.
        for n in [1, 3, 4, 300] {
            assert_eq!(kernel_mode(Q4_0, 64, n), (1, 0));
            assert_eq!(kernel_mode(Q4_0, 60, n), (0, 0));
        }
        for format in [F32, F16, BF16, Q4_1, Q5_0, Q5_1, Q8_0, Q6K] {
            assert_eq!(kernel_mode(format, 64, 300), (0, 0), "{format}");
        }
    }

    #[test]
    fn launches_cover_every_output_once() {
        for (rows, n_tokens) in [(1, 1), (576, 1), (33, 2), (9, 3), (100, 5), (640, 300)] {
            let mut seen = vec![0u8; rows * n_tokens];
            let tile = tile_tokens(n_tokens) as usize;
            let tile_rows = EXACT_GROUPS as usize / tile;
            assert_eq!(tile * tile_rows, EXACT_GROUPS as usize);
            for (token0, config) in matmul_launches(rows, n_tokens) {
                assert_eq!(config.block, [EXACT_THREADS, 1, 1]);
                for bx in 0..config.grid[0] as usize {
                    for by in 0..config.grid[1] as usize {
                        for group in 0..EXACT_GROUPS as usize {
                            let r = bx * tile_rows + group % tile_rows;
                            let t = token0 + by * tile + group / tile_rows;
                            if r < rows && t < n_tokens {
                                seen[t * rows + r] += 1;
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{rows} x {n_tokens}");
        }
        // More token tiles than grid.y allows: slices of 65535 tiles.
        let launches = matmul_launches(8, 8 * MAX_GRID_Y + 3);
        assert_eq!(launches.len(), 2);
        assert_eq!(launches[1].0, 8 * MAX_GRID_Y);
        assert_eq!(launches[1].1.grid[1], 1);
    }

    // ---- Twins of the kernels, written like the .hip code ----

    /// Lane operations of one group of 8 threads: `xor(v, m)[l]` is lane `l ^ m`'s value.
    fn xor_step(v: [f32; 8], mask: usize) -> [f32; 8] {
        std::array::from_fn(|l| v[l] + v[l ^ mask])
    }

    /// `ex_hsum_ps`; also checks that every lane ends with the same bits, as the kernel assumes.
    fn hsum_ps(v: [f32; 8]) -> f32 {
        let r = xor_step(xor_step(xor_step(v, 4), 2), 1);
        assert!(r.iter().all(|x| x.to_bits() == r[0].to_bits()));
        r[0]
    }

    /// `ex_hsum_hadd`.
    fn hsum_hadd(v: [f32; 8]) -> f32 {
        let r = xor_step(xor_step(xor_step(v, 1), 2), 4);
        assert!(r.iter().all(|x| x.to_bits() == r[0].to_bits()));
        r[0]
    }

    fn half_at(b: &[u8], o: usize) -> f32 {
        f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
    }

    fn sat16(v: i32) -> i32 {
        v.clamp(-32768, 32767)
    }

    fn signed_pair(x0: i32, y0: i32, x1: i32, y1: i32) -> i32 {
        let sign = |x: i32, y: i32| {
            if x < 0 {
                (-y) as i8 as i32
            } else if x == 0 {
                0
            } else {
                y
            }
        };
        sat16(x0.abs() * sign(x0, y0) + x1.abs() * sign(x1, y1))
    }

    fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
        if j < 4 {
            ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
        } else {
            (
                ((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4)) as i32,
                ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
            )
        }
    }

    fn q3k_scale(s: &[u8], j: usize) -> i32 {
        let low = if j < 8 { s[j] & 15 } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    }

    fn q2k_value(b: &[u8], e: usize) -> i32 {
        let (half, shift, j) = (e / 128, (e % 128) / 32, e % 32);
        ((b[16 + 32 * half + j] >> (2 * shift)) & 3) as i32
    }

    fn q3k_value4(b: &[u8], e: usize) -> i32 {
        let (half, shift, j) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((b[32 + 32 * half + j] >> (2 * shift)) & 3) as i32;
        let set = ((b[j] >> (4 * half + shift)) & 1) as i32;
        low + 4 * set
    }

    fn q5k_value(b: &[u8], e: usize) -> i32 {
        let (c, r) = (e / 64, e % 64);
        let j = r % 32;
        let (q, h) = (b[48 + 32 * c + j] as i32, b[16 + j] as i32);
        if r < 32 {
            (q & 15) | (((h >> (2 * c)) & 1) << 4)
        } else {
            (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4)
        }
    }

    fn q6k_value(b: &[u8], c: usize, k: usize, j: usize) -> i32 {
        let ql = &b[64 * c..];
        let h = b[128 + 32 * c + j] as i32;
        let low = if k & 1 == 1 { ql[j + 32] } else { ql[j] } as i32;
        let nibble = if k < 2 { low & 15 } else { low >> 4 };
        nibble | (((h >> (2 * k)) & 3) << 4)
    }

    /// The activations of one token as the matmul kernels see them.
    struct Act<'a> {
        q: &'a [i8],
        d: &'a [f32],
        s: &'a [f32],
        bsums: &'a [i16],
        x: &'a [f32],
    }

    /// `ex_matmul_legacy`.
    fn legacy(format: WeightFormat, row: &[u8], a: &Act, mode: u32) -> f32 {
        let bytes = format.block_bytes();
        let (signed, mins) = match format {
            WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => (true, false),
            _ => (false, true),
        };
        let mut acc = [0.0f32; 8];
        let mut summs = 0.0f32;
        // Mode 1 (repacked Q4_0): one float, the block's integer sum over every lane.
        let mut repacked = 0.0f32;
        for (blk, b) in row.chunks_exact(bytes).enumerate() {
            let mut block_isum = 0i32;
            for (l, lane) in acc.iter_mut().enumerate() {
                let v: [i32; 4] = std::array::from_fn(|k| {
                    let e = 4 * l + k;
                    let nibble = |qs: usize| {
                        let byte = b[qs + 4 * (l & 3) + k] as i32;
                        if l < 4 {
                            byte & 15
                        } else {
                            byte >> 4
                        }
                    };
                    let high = |qh: usize| {
                        let qh = u32::from_le_bytes([b[qh], b[qh + 1], b[qh + 2], b[qh + 3]]);
                        (((qh >> e) & 1) << 4) as i32
                    };
                    match format {
                        WeightFormat::Q4_0 => nibble(2) - 8,
                        WeightFormat::Q4_1 => nibble(4),
                        WeightFormat::Q5_0 => (nibble(6) | high(2)) - 16,
                        WeightFormat::Q5_1 => nibble(8) | high(4),
                        _ => b[2 + e] as i8 as i32,
                    }
                });
                let y: [i32; 4] = std::array::from_fn(|k| a.q[32 * blk + 4 * l + k] as i32);
                let isum = if signed {
                    signed_pair(v[0], y[0], v[1], y[1]) + signed_pair(v[2], y[2], v[3], y[3])
                } else {
                    sat16(v[0] * y[0] + v[1] * y[1]) + sat16(v[2] * y[2] + v[3] * y[3])
                };
                *lane = (half_at(b, 0) * a.d[blk]).mul_add(isum as f32, *lane);
                block_isum += isum;
            }
            repacked = (block_isum as f32).mul_add(half_at(b, 0) * a.d[blk], repacked);
            if mins {
                summs = half_at(b, 2).mul_add(a.s[blk], summs);
            }
        }
        if mode == 1 {
            return repacked;
        }
        hsum_ps(acc) + summs
    }

    /// `isum_msum` of ExQ2_K, ExQ3_K and ExQ5_K for lane `l`.
    fn k_isum_msum(format: WeightFormat, b: &[u8], y: &[i8], bs: &[i16], l: usize) -> (i32, i32) {
        let y = |e: usize| y[e] as i32;
        let bs = |j: usize| bs[j] as i32;
        let mut isum = 0;
        match format {
            WeightFormat::Q2K | WeightFormat::Q3K => {
                for half in 0..2 {
                    for shift in 0..4 {
                        let e = 128 * half + 32 * shift + 4 * l;
                        let part: i32 = (0..4)
                            .map(|i| {
                                let v = if format == WeightFormat::Q2K {
                                    q2k_value(b, e + i)
                                } else {
                                    q3k_value4(b, e + i) - 4
                                };
                                v * y(e + i)
                            })
                            .sum();
                        let scale = if format == WeightFormat::Q2K {
                            (b[e / 16] & 15) as i32
                        } else {
                            q3k_scale(&b[96..], e / 16)
                        };
                        isum += scale * part;
                    }
                }
                if format == WeightFormat::Q3K {
                    return (isum, 0);
                }
                let msum = (b[l] >> 4) as i32 * bs(l) + (b[l + 8] >> 4) as i32 * bs(l + 8);
                (isum, msum)
            }
            _ => {
                for c in 0..4 {
                    let (mut lo, mut hi) = (0, 0);
                    for i in 0..4 {
                        let e = 64 * c + 4 * l + i;
                        lo += q5k_value(b, e) * y(e);
                        hi += q5k_value(b, e + 32) * y(e + 32);
                    }
                    isum += scale_min_k4(2 * c, &b[4..]).0 * lo;
                    isum += scale_min_k4(2 * c + 1, &b[4..]).0 * hi;
                }
                let msum = scale_min_k4(l / 2, &b[4..]).1 * bs(l)
                    + scale_min_k4((l + 8) / 2, &b[4..]).1 * bs(l + 8);
                (isum, msum)
            }
        }
    }

    /// `ex_matmul_k_small`.
    fn k_small(format: WeightFormat, row: &[u8], a: &Act, mode: u32, full_tile: bool) -> f32 {
        let bytes = format.block_bytes();
        let (d_off, dmin_off) = match format {
            WeightFormat::Q2K => (80, Some(82)),
            WeightFormat::Q3K => (108, None),
            _ => (0, Some(2)),
        };
        if mode == 0 {
            let mut sumf = 0.0f32;
            for (blk, b) in row.chunks_exact(bytes).enumerate() {
                let (mut isum, mut msum) = (0, 0);
                for l in 0..8 {
                    let (i, m) = k_isum_msum(
                        format,
                        b,
                        &a.q[256 * blk..],
                        &a.bsums[16 * blk..16 * blk + 16],
                        l,
                    );
                    isum += i;
                    msum += m;
                }
                let d8 = a.d[blk];
                let term = d8 * half_at(b, d_off) * isum as f32;
                sumf += match dmin_off {
                    Some(o) => term - d8 * half_at(b, o) * msum as f32,
                    None => term,
                };
            }
            return sumf;
        }
        let value = |b: &[u8], e: usize| match format {
            WeightFormat::Q2K => q2k_value(b, e),
            WeightFormat::Q3K => q3k_value4(b, e),
            _ => q5k_value(b, e),
        };
        let s16 = |b: &[u8], j: usize| match format {
            WeightFormat::Q2K => half_at(b, d_off) * (b[j] & 15) as f32,
            WeightFormat::Q3K => half_at(b, d_off) * q3k_scale(&b[96..], j) as f32,
            _ => half_at(b, d_off) * scale_min_k4(j / 2, &b[4..]).0 as f32,
        };
        let m16 = |b: &[u8], j: usize| match format {
            WeightFormat::Q2K => -half_at(b, 82) * (b[j] >> 4) as f32,
            WeightFormat::Q3K => -4.0 * s16(b, j),
            _ => -half_at(b, 2) * scale_min_k4(j / 2, &b[4..]).1 as f32,
        };
        let mut acc = [0.0f32; 8];
        for (l, lane) in acc.iter_mut().enumerate() {
            for (blk, b) in row.chunks_exact(bytes).enumerate() {
                let y = &a.q[256 * blk..];
                for c in 0..8 {
                    let isum: i32 = (0..4)
                        .map(|i| {
                            let e = 32 * c + 4 * l + i;
                            value(b, e) * y[e] as i32
                        })
                        .sum();
                    let scale = s16(b, 2 * c + usize::from(l >= 4)) * a.d[blk];
                    *lane = (isum as f32).mul_add(scale, *lane);
                }
            }
            for (blk, b) in row.chunks_exact(bytes).enumerate() {
                for j in [l, l + 8] {
                    let sh = a.d[blk] * a.bsums[16 * blk + j] as f32;
                    *lane = m16(b, j).mul_add(sh, *lane);
                }
            }
        }
        if full_tile {
            hsum_hadd(acc)
        } else {
            hsum_ps(acc)
        }
    }

    /// `ex_matmul_q4_k`.
    fn q4_k(row: &[u8], a: &Act, mode: u32, per_pair: bool) -> f32 {
        if mode == 0 {
            let mut acc = [0.0f32; 8];
            let mut acc_m = [0.0f32; 8];
            for (blk, b) in row.chunks_exact(144).enumerate() {
                let y = &a.q[256 * blk..];
                let bs = &a.bsums[16 * blk..];
                let d8 = a.d[blk];
                let d = d8 * half_at(b, 0);
                let dmin = -d8 * half_at(b, 2);
                for l in 0..8 {
                    let mut isum = 0;
                    for j in 0..4 {
                        let (sl, _) = scale_min_k4(2 * j, &b[4..]);
                        let (sh, _) = scale_min_k4(2 * j + 1, &b[4..]);
                        let (mut lo, mut hi) = (0, 0);
                        for i in 0..4 {
                            let q = b[16 + 32 * j + 4 * l + i] as i32;
                            lo += (q & 15) * y[64 * j + 4 * l + i] as i32;
                            hi += (q >> 4) * y[64 * j + 32 + 4 * l + i] as i32;
                        }
                        isum += sl * lo + sh * hi;
                    }
                    acc[l] = d.mul_add(isum as f32, acc[l]);
                    let ml = l & 3;
                    let (_, m0) = scale_min_k4(2 * ml, &b[4..]);
                    let (_, m1) = scale_min_k4(2 * ml + 1, &b[4..]);
                    let q8s0 = bs[4 * ml].wrapping_add(bs[4 * ml + 1]) as i32;
                    let q8s1 = bs[4 * ml + 2].wrapping_add(bs[4 * ml + 3]) as i32;
                    acc_m[l] = dmin.mul_add((m0 * q8s0 + m1 * q8s1) as f32, acc_m[l]);
                }
            }
            let m = xor_step(xor_step(acc_m, 2), 1);
            return hsum_ps(acc) + m[0];
        }
        let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
        for (blk, b) in row.chunks_exact(144).enumerate() {
            let da = a.d[blk];
            let lanes: Vec<(i32, i32)> = (0..8)
                .map(|l| {
                    let (scale, min) = scale_min_k4(l, &b[4..]);
                    let qs = &b[16 + 32 * (l / 2)..];
                    let y = &a.q[256 * blk + 32 * l..];
                    let dot: i32 = (0..32)
                        .map(|i| {
                            let q = if l & 1 == 1 { qs[i] >> 4 } else { qs[i] & 15 };
                            q as i32 * y[i] as i32
                        })
                        .sum();
                    let bs = &a.bsums[16 * blk..];
                    (scale * dot, min * (bs[2 * l] as i32 + bs[2 * l + 1] as i32))
                })
                .collect();
            let sc = half_at(b, 0) * da;
            let sc_min = half_at(b, 2) * da;
            if per_pair {
                for p in 0..4 {
                    let (i, s) = (
                        lanes[2 * p].0 + lanes[2 * p + 1].0,
                        lanes[2 * p].1 + lanes[2 * p + 1].1,
                    );
                    acc = (i as f32).mul_add(sc, acc);
                    acc_min = (s as f32).mul_add(sc_min, acc_min);
                }
            } else {
                let i: i32 = lanes.iter().map(|v| v.0).sum();
                let s: i32 = lanes.iter().map(|v| v.1).sum();
                acc = (i as f32).mul_add(sc, acc);
                acc_min = (s as f32).mul_add(sc_min, acc_min);
            }
        }
        acc - acc_min
    }

    /// `ex_matmul_q6_k`.
    fn q6_k(row: &[u8], a: &Act) -> f32 {
        let mut acc = [0.0f32; 8];
        for (blk, b) in row.chunks_exact(210).enumerate() {
            let y = &a.q[256 * blk..];
            for (l, lane) in acc.iter_mut().enumerate() {
                let mut isum = 0;
                for c in 0..2 {
                    for k in 0..4 {
                        let e = 128 * c + 32 * k;
                        let part: i32 = (0..4)
                            .map(|i| {
                                let j = 4 * l + i;
                                q6k_value(b, c, k, j) * y[e + j] as i32
                            })
                            .sum();
                        isum += (b[192 + e / 16 + usize::from(l >= 4)] as i8 as i32) * part;
                    }
                }
                let bs = &a.bsums[16 * blk..];
                isum -= 32
                    * (bs[2 * l] as i32 * (b[192 + 2 * l] as i8 as i32)
                        + bs[2 * l + 1] as i32 * (b[192 + 2 * l + 1] as i8 as i32));
                *lane = (a.d[blk] * half_at(b, 208)).mul_add(isum as f32, *lane);
            }
        }
        hsum_ps(acc)
    }

    /// `ex_matmul_lanes_dot` and `ex_matmul_f16`. Indices mirror the kernel's lanes and
    /// element numbers, which iterators would hide.
    #[allow(clippy::needless_range_loop)]
    fn float_dot(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let weight = |i: usize| match format {
            WeightFormat::F32 => f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()),
            WeightFormat::BF16 => {
                f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16)
            }
            _ => half_at(row, 2 * i),
        };
        let full = n / 8 * 8;
        if format == WeightFormat::F16 {
            let mut acc = [[0.0f32; 8]; 2];
            for g in 0..full / 8 {
                for l in 0..8 {
                    let i = 8 * g + l;
                    acc[g & 1][l] = weight(i).mul_add(x[i], acc[g & 1][l]);
                }
            }
            let mut sum = hsum_ps(std::array::from_fn(|l| acc[0][l] + acc[1][l]));
            for i in full..n {
                sum += weight(i) * x[i];
            }
            return sum;
        }
        let mut acc = [0.0f32; 8];
        for g in 0..full / 8 {
            for (l, lane) in acc.iter_mut().enumerate() {
                *lane += weight(8 * g + l) * x[8 * g + l];
            }
        }
        let mut tail = 0.0f32;
        for i in full..n {
            tail += weight(i) * x[i];
        }
        hsum_ps(acc) + tail
    }

    fn read_bytes(l: &HostLaunch<'_>, ptr: DevicePtr, n: usize) -> Result<Vec<u8>, String> {
        let mut bytes = vec![0u8; n];
        l.read(ptr, &mut bytes)?;
        Ok(bytes)
    }

    fn round_bf16(v: f32) -> f32 {
        let u = v.to_bits();
        let bits = if (u & 0x7fff_ffff) > 0x7f80_0000 {
            (u >> 16) | 64
        } else {
            (u + (0x7fff + ((u >> 16) & 1))) >> 16
        };
        f32::from_bits((bits & 0xffff) << 16)
    }

    fn register_twins(driver: &HostDriver) {
        for (name, bf16) in [
            ("ember_exact_round_f16", false),
            ("ember_exact_round_bf16", true),
        ] {
            driver.register_kernel(name, move |l| {
                let n = l.u32_arg(2)? as usize;
                let x = l.read_f32(l.ptr_arg(0)?, n)?;
                let out: Vec<f32> = x
                    .iter()
                    .map(|&v| {
                        if bf16 {
                            round_bf16(v)
                        } else {
                            f16::from_f32(v).to_f32()
                        }
                    })
                    .collect();
                l.write_f32(l.ptr_arg(1)?, &out)
            });
        }
        for (name, with_sum) in [
            ("ember_exact_quantize_q8_0", false),
            ("ember_exact_quantize_q8_1", true),
        ] {
            driver.register_kernel(name, move |l| {
                let n_blocks = l.u32_arg(4)? as usize;
                let x = l.read_f32(l.ptr_arg(0)?, n_blocks * 32)?;
                let mut q = vec![0u8; n_blocks * 32];
                let (mut d, mut s) = (vec![0.0f32; n_blocks], vec![0.0f32; n_blocks]);
                for blk in 0..n_blocks {
                    let xb = &x[32 * blk..32 * blk + 32];
                    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let dv = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let mut sum = 0i32;
                    for i in 0..32 {
                        let v = (xb[i] * id).round_ties_even();
                        let qi = if v.is_nan() {
                            0
                        } else {
                            v.clamp(-128.0, 127.0) as i32
                        };
                        q[32 * blk + i] = qi as i8 as u8;
                        sum += qi;
                    }
                    d[blk] = f16::from_f32(dv).to_f32();
                    s[blk] = f16::from_f32(sum as f32 * dv).to_f32();
                }
                l.write(l.ptr_arg(1)?, &q)?;
                l.write_f32(l.ptr_arg(2)?, &d)?;
                if with_sum {
                    l.write_f32(l.ptr_arg(3)?, &s)?;
                }
                Ok(())
            });
        }
        driver.register_kernel("ember_exact_quantize_q8_k", |l| {
            let n_blocks = l.u32_arg(4)? as usize;
            let x = l.read_f32(l.ptr_arg(0)?, n_blocks * 256)?;
            let mut q = vec![0u8; n_blocks * 256];
            let mut d = vec![0.0f32; n_blocks];
            let mut bsums = vec![0u8; n_blocks * 32];
            for blk in 0..n_blocks {
                let xb = &x[256 * blk..256 * blk + 256];
                let (mut max, mut amax) = (0.0f32, 0.0f32);
                for &v in xb {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                if amax == 0.0 {
                    continue;
                }
                let iscale = -127.0 / max;
                for j in 0..16 {
                    let mut sum = 0i32;
                    for i in 16 * j..16 * j + 16 {
                        let v = iscale * xb[i] + 12_582_912.0;
                        let n = ((v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000).min(127);
                        q[256 * blk + i] = n as u8;
                        sum += n as u8 as i8 as i32;
                    }
                    let o = 32 * blk + 2 * j;
                    bsums[o..o + 2].copy_from_slice(&(sum as i16).to_le_bytes());
                }
                d[blk] = 1.0 / iscale;
            }
            l.write(l.ptr_arg(1)?, &q)?;
            l.write_f32(l.ptr_arg(2)?, &d)?;
            l.write(l.ptr_arg(3)?, &bsums)
        });
        for format in WeightFormat::ALL {
            driver.register_kernel(matmul_kernel(format), move |l| twin_matmul(format, l));
        }
    }

    /// The matmul kernels: every group of every launched block, in the kernel's order.
    fn twin_matmul(format: WeightFormat, l: &HostLaunch<'_>) -> Result<(), String> {
        let (out, w, act) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (act_d, act_s, act_bsums) = (l.ptr_arg(3)?, l.ptr_arg(4)?, l.ptr_arg(5)?);
        let n_tokens = l.u32_arg(6)? as usize;
        let token0 = l.u32_arg(7)? as usize;
        let (rows, cols) = (l.u32_arg(8)? as usize, l.u32_arg(9)? as usize);
        let tile = l.u32_arg(10)? as usize;
        let (mode, gemm_tokens) = (l.u32_arg(11)?, l.u32_arg(12)? as usize);
        let config = *l.config();
        if config.block != [EXACT_THREADS, 1, 1] {
            return Err(format!("block {:?}", config.block));
        }
        let row_bytes = format.row_bytes(cols).ok_or("columns")?;
        let weights = read_bytes(l, w, rows * row_bytes)?;
        let act_ty = ActivationFormat::of(format);
        let per_block = act_ty.block_values();
        let values = n_tokens * cols;
        let floats = match act_ty {
            ActivationFormat::F32 | ActivationFormat::F16 | ActivationFormat::Bf16 => {
                l.read_f32(act, values)?
            }
            _ => Vec::new(),
        };
        let (q, d, s, bsums) = if per_block > 1 {
            let q: Vec<i8> = read_bytes(l, act, values)?
                .into_iter()
                .map(|b| b as i8)
                .collect();
            let d = l.read_f32(act_d, values / per_block)?;
            let s = if act_ty == ActivationFormat::Q8_1 {
                l.read_f32(act_s, values / per_block)?
            } else {
                Vec::new()
            };
            let bsums: Vec<i16> = if act_ty == ActivationFormat::Q8K {
                read_bytes(l, act_bsums, values / 16 * 2)?
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]))
                    .collect()
            } else {
                Vec::new()
            };
            (q, d, s, bsums)
        } else {
            Default::default()
        };
        let tile_rows = EXACT_GROUPS as usize / tile;
        let mut results = Vec::new();
        for bx in 0..config.grid[0] as usize {
            for by in 0..config.grid[1] as usize {
                for group in 0..EXACT_GROUPS as usize {
                    let r = bx * tile_rows + group % tile_rows;
                    let t = token0 + by * tile + group / tile_rows;
                    if r >= rows || t >= n_tokens {
                        continue;
                    }
                    let row = &weights[r * row_bytes..(r + 1) * row_bytes];
                    let nb = cols / per_block;
                    let a = Act {
                        q: if q.is_empty() {
                            &[]
                        } else {
                            &q[t * cols..(t + 1) * cols]
                        },
                        d: if d.is_empty() {
                            &[]
                        } else {
                            &d[t * nb..(t + 1) * nb]
                        },
                        s: if s.is_empty() {
                            &[]
                        } else {
                            &s[t * nb..(t + 1) * nb]
                        },
                        bsums: if bsums.is_empty() {
                            &[]
                        } else {
                            &bsums[t * cols / 16..(t + 1) * cols / 16]
                        },
                        x: if floats.is_empty() {
                            &[]
                        } else {
                            &floats[t * cols..(t + 1) * cols]
                        },
                    };
                    let value = match format {
                        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => {
                            float_dot(format, row, a.x)
                        }
                        WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Q5K => {
                            let full = r < rows - rows % 4 && t < n_tokens - n_tokens % 2;
                            k_small(format, row, &a, mode, full)
                        }
                        WeightFormat::Q4K => q4_k(row, &a, mode, t < gemm_tokens),
                        WeightFormat::Q6K => q6_k(row, &a),
                        _ => legacy(format, row, &a, mode),
                    };
                    results.push((t * rows + r, value));
                }
            }
        }
        for (index, value) in results {
            l.write_f32(out.offset(index as u64 * 4), &[value])?;
        }
        Ok(())
    }

    fn fixture() -> Fixture {
        host_fixture(register_twins)
    }

    /// xorshift64*, for reproducible inputs.
    struct Rng(u64);

    impl Rng {
        fn uniform(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
            (v >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// The CPU backend's result on AVX2 (`None` on a CPU without it: the order ported here is
    /// AVX2's, which the scalar path does not follow).
    fn cpu_avx2(
        ty: ember_quant::GgmlType,
        weights: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n_tokens: usize,
    ) -> Option<Vec<f32>> {
        use ember_quant::simd::{available_levels, Level};
        if !available_levels().contains(&Level::Avx2) {
            return None;
        }
        let w = ember_quant::QMatrix::new(ty, rows, cols, weights).unwrap();
        let act =
            ember_quant::quantize_activations(ember_quant::vec_dot_type(ty), x, n_tokens, cols)
                .unwrap();
        let mut out = vec![0.0f32; rows * n_tokens];
        ember_quant::matmul_with(Level::Avx2, ember_quant::Strategy::Auto, &w, &act, &mut out)
            .unwrap();
        Some(out)
    }

    fn check(
        fx: &Fixture,
        rng: &mut Rng,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        n: usize,
    ) {
        let ty = ember_quant::GgmlType::from_u32(format.ggml_type_id()).unwrap();
        let wf: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
        let mut weights = vec![0u8; DeviceMatrix::bytes_for(format, rows, cols).unwrap()];
        ember_quant::quantize(ty, &wf, &mut weights).unwrap();
        // Activations with a spread of magnitudes, and one all-zero block.
        let mut x: Vec<f32> = (0..n * cols)
            .map(|i| rng.uniform() * (1 + i % 7) as f32)
            .collect();
        x[..format.block_values().max(32).min(cols)].fill(0.0);
        let Some(expected) = cpu_avx2(ty, &weights, rows, cols, &x, n) else {
            return;
        };
        let ctx = &fx.ctx;
        let wbuf = ctx.alloc(Purpose::Weights, weights.len() as u64).unwrap();
        ctx.upload(wbuf.ptr(), &weights).unwrap();
        let matrix = DeviceMatrix::new(wbuf, format, rows, cols).unwrap();
        let xbytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let xbuf = ctx.alloc(Purpose::Scratch, xbytes.len() as u64).unwrap();
        ctx.upload(xbuf.ptr(), &xbytes).unwrap();
        let obuf = ctx.alloc(Purpose::Scratch, (rows * n * 4) as u64).unwrap();
        matmul_exact(ctx, &matrix, xbuf.ptr(), n, obuf.ptr()).unwrap();
        let mut bytes = vec![0u8; rows * n * 4];
        ctx.download(obuf.ptr(), &mut bytes).unwrap();
        for (i, (c, e)) in bytes.chunks_exact(4).zip(&expected).enumerate() {
            let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            assert_eq!(
                got.to_bits(),
                e.to_bits(),
                "{format} {rows}x{cols}, {n} tokens, output {i} (token {}, row {}): twin {got}, cpu {e}",
                i / rows,
                i % rows
            );
        }
    }

    /// Every format at the token counts where the CPU changes order (1..4, 7, 8, 11, 12, 13), with
    /// row counts that leave partial 4-row tiles and non-repacked Q4_K.
    #[test]
    fn twins_match_the_cpu_bit_for_bit() {
        let fx = fixture();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for format in WeightFormat::ALL {
            let cols = if format.block_values() == 256 {
                512
            } else {
                96
            };
            for (rows, n) in [
                (9, 1),
                (16, 2),
                (13, 3),
                (8, 4),
                (7, 7),
                (16, 8),
                (10, 11),
                (6, 12),
                (16, 13),
            ] {
                check(&fx, &mut rng, format, rows, cols, n);
            }
        }
        // Float formats with a tail of n % 8 columns.
        for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16] {
            check(&fx, &mut rng, format, 5, 77, 3);
        }
    }
}
