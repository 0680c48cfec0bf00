//! The ops of Qwen 3.5 / 3.6's hybrid layers (kernels/delta_net.hip): Gated DeltaNet's
//! convolution, L2 norm, gated delta rule and gated norm over the sequences of a batch, and the
//! query gate of the gated full-attention layers. Together they are the GPU form of the CPU
//! backend's `gated_delta_net`, `split_query_gate` and `mul_sigmoid`
//! (engine/src/backend/cpu/delta_net.rs), in the same order of operations per value.
//!
//! The sequences come as a device table ([`DeltaNetSeqs`]): each sequence's state address and
//! its batch rows in position order, uploaded by the caller once per forward pass, so nothing
//! here waits for the host and a decode step is captured in a graph like any other.
//!
//! The delta rule has two forms. The recurrent one walks each sequence's tokens one after the
//! other (decoding, short prompts). The chunked one (`ember_delta_net_chunked_hd*_f32`, the
//! maths of the CPU's `delta_net/chunked.rs`) takes a prompt's tokens in chunks of 32: the
//! intra-chunk matrices in shared memory and one state update per chunk, so a prompt's `n`
//! sequential token steps per layer become `n / 32` chunk steps. A batch whose sequences have
//! [`DELTA_NET_CHUNKED_MIN_ROWS`] rows or more on average runs the chunked kernels (head sizes 64
//! and 128; others run the recurrent form). The intra-chunk products are plain FMA loops, not
//! tensor-core tiles yet.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::{as_u32, stride_launch, GpuContext, OpsError};

/// Most convolution taps (delta_net.hip's EMBER_DN_MAX_TAPS).
pub const DELTA_NET_MAX_TAPS: usize = 8;
/// Largest head size of the delta rule (one thread per state row, at most a block).
pub const DELTA_NET_MAX_HEAD_DIM: usize = 1024;
/// Rows of the state one block of the register-resident rule kernels updates.
const RULE_ROWS: u32 = 32;
/// A batch with at least this many rows per sequence on average runs the chunked rule kernels.
/// Measured on the H200 (harness_delta_net, Qwen3.5-35B-A3B's 16/32 heads of 128): the chunked
/// rule takes 0.91x the recurrent one's speed at a 512-token prompt and 1.35x at 4096 tokens, so
/// it pays from about a thousand rows a sequence.
pub const DELTA_NET_CHUNKED_MIN_ROWS: usize = 1024;
/// State rows and threads of one block of the chunked rule kernels (EMBER_DELTA_NET_CHUNKED's
/// ROWS and THREADS).
const CHUNKED_ROWS: u32 = 16;
const CHUNKED_THREADS: u32 = 256;
/// Largest grid dimension y (sequences, rows) every driver accepts.
const MAX_GRID_Y: usize = 65_535;

/// The sequences of a batch as the delta-net kernels read them: `states` (u64 `[n_seq]`) the
/// address of each sequence's state buffer, `starts` (i32 `[n_seq + 1]`) and `rows` (i32
/// `[n_rows]`) each sequence's batch rows in position order (`rows[starts[s]..starts[s + 1]]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetSeqs {
    pub states: DevicePtr,
    pub starts: DevicePtr,
    pub rows: DevicePtr,
    pub n_seq: usize,
    pub n_rows: usize,
}

/// One Gated DeltaNet layer's shape and weights on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNetLayer {
    /// `conv_kernel` taps per channel, channel by channel.
    pub conv: DevicePtr,
    /// One per value head each.
    pub dt_bias: DevicePtr,
    pub a: DevicePtr,
    /// `head_dim` values.
    pub norm: DevicePtr,
    pub conv_kernel: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    /// Where this layer's part of each sequence's state starts, in floats: its convolution state
    /// (`channels * (conv_kernel - 1)` floats), then its delta-rule state.
    pub state_offset: usize,
}

impl DeltaNetLayer {
    /// Convolution channels: the query, key and value heads.
    pub fn channels(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }

    /// Floats of one sequence's convolution state in this layer.
    pub fn conv_state_len(&self) -> usize {
        self.channels() * self.conv_kernel.saturating_sub(1)
    }

    /// Floats of one sequence's delta-rule state in this layer.
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }
}

fn ptr(p: DevicePtr) -> KernelArg {
    KernelArg::Ptr(p)
}

/// The activations of one [`gated_delta_net`] call: `qkv` (`[*, channels]`), `z` (`[*, n_v_heads
/// * head_dim]`), `beta` and `alpha` (`[*, n_v_heads]`) in; `conv` scratch of `qkv`'s size;
/// `out` (`[*, n_v_heads * head_dim]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetIo {
    pub qkv: DevicePtr,
    pub z: DevicePtr,
    pub beta: DevicePtr,
    pub alpha: DevicePtr,
    pub conv: DevicePtr,
    pub out: DevicePtr,
}

/// The core of a Gated DeltaNet layer for the sequences of `seqs`: the convolution continuing
/// each sequence's convolution state and SiLU into `io.conv`, the L2 norm of its query and key
/// heads, the gated delta rule over each sequence's rows from and back to its state, and the
/// gated norm, into `io.out`. Rows of no sequence are left as they are. Four launches.
pub fn gated_delta_net(
    ctx: &GpuContext,
    layer: &DeltaNetLayer,
    seqs: &DeltaNetSeqs,
    io: &DeltaNetIo,
) -> Result<(), OpsError> {
    const OP: &str = "gated_delta_net";
    if seqs.n_seq == 0 || seqs.n_rows == 0 {
        return Ok(());
    }
    let hd = layer.head_dim;
    if layer.conv_kernel == 0 || layer.conv_kernel > DELTA_NET_MAX_TAPS {
        return Err(OpsError::shape(
            OP,
            format!("1 to {DELTA_NET_MAX_TAPS} convolution taps"),
            layer.conv_kernel.to_string(),
        ));
    }
    if hd == 0 || hd > DELTA_NET_MAX_HEAD_DIM || layer.n_k_heads == 0 || layer.n_v_heads == 0 {
        return Err(OpsError::shape(
            OP,
            format!("heads of 1 to {DELTA_NET_MAX_HEAD_DIM} values, at least one of each kind"),
            format!(
                "{} key and {} value heads of {hd}",
                layer.n_k_heads, layer.n_v_heads
            ),
        ));
    }
    if seqs.n_seq > MAX_GRID_Y || seqs.n_rows > MAX_GRID_Y {
        return Err(OpsError::shape(
            OP,
            format!("at most {MAX_GRID_Y} sequences and rows"),
            format!("{} sequences, {} rows", seqs.n_seq, seqs.n_rows),
        ));
    }
    let channels = as_u32(OP, "the channel count", layer.channels())?;
    as_u32(
        OP,
        "rows times channels",
        seqs.n_rows.saturating_mul(layer.channels()),
    )?;
    let n_seq = seqs.n_seq as u32;
    let n_rows = seqs.n_rows as u32;
    let hd32 = hd as u32;
    let warp = ctx.warp_size();

    // 1. Convolution and SiLU.
    let conv_block = 128u32;
    let args = KernelArgs::new()
        .arg(ptr(io.conv))
        .arg(ptr(io.qkv))
        .arg(ptr(layer.conv))
        .arg(ptr(seqs.states))
        .arg(ptr(seqs.starts))
        .arg(ptr(seqs.rows))
        .arg(KernelArg::U32(channels))
        .arg(KernelArg::U32(layer.conv_kernel as u32))
        .arg(KernelArg::U64(layer.state_offset as u64));
    let config = LaunchConfig {
        grid: [channels.div_ceil(conv_block), n_seq, 1],
        block: [conv_block, 1, 1],
        shared_mem_bytes: 0,
    };
    // SAFETY: ember_delta_net_conv_f32(float* out, const float* qkv, const float* conv_w, const
    // uint64_t* states, const int32_t* starts, const int32_t* rows, uint32_t channels, uint32_t
    // taps, uint64_t state_offset); thread (c, s) reads and writes channel c of the rows of
    // sequence s (below the batch size the caller sized qkv and conv for) and taps - 1 floats of
    // its state at state_offset (inside the state buffer the caller sized for every layer); taps
    // is within the kernel's register window (checked above).
    unsafe {
        ctx.launch(
            KernelModule::DeltaNet,
            "ember_delta_net_conv_f32",
            config,
            &args,
        )?
    };

    // 2. L2 norm of the query and key heads.
    let args = KernelArgs::new()
        .arg(ptr(io.conv))
        .arg(ptr(seqs.rows))
        .arg(KernelArg::U32(channels))
        .arg(KernelArg::U32(hd32))
        .arg(KernelArg::F32(layer.eps));
    let config = LaunchConfig {
        grid: [(2 * layer.n_k_heads) as u32, n_rows, 1],
        block: [warp, 1, 1],
        shared_mem_bytes: 0,
    };
    // SAFETY: ember_delta_net_l2_norm_f32(float* x, const int32_t* rows, uint32_t channels,
    // uint32_t head_dim, float eps); block (h, r) rewrites head h (one of the 2 * n_k_heads query
    // and key heads, inside the row's channels) of batch row rows[r]; one warp per block.
    unsafe {
        ctx.launch(
            KernelModule::DeltaNet,
            "ember_delta_net_l2_norm_f32",
            config,
            &args,
        )?
    };

    // 3. The gated delta rule.
    let ssm_offset = layer.state_offset + layer.conv_state_len();
    let args = KernelArgs::new()
        .arg(ptr(io.out))
        .arg(ptr(io.conv))
        .arg(ptr(io.beta))
        .arg(ptr(io.alpha))
        .arg(ptr(layer.dt_bias))
        .arg(ptr(layer.a))
        .arg(ptr(seqs.states))
        .arg(ptr(seqs.starts))
        .arg(ptr(seqs.rows))
        .arg(KernelArg::U32(layer.n_k_heads as u32))
        .arg(KernelArg::U32(layer.n_v_heads as u32))
        .arg(KernelArg::U32(channels))
        .arg(KernelArg::U64(ssm_offset as u64));
    let n_v = layer.n_v_heads as u32;
    let chunked = match hd {
        64 => Some("ember_delta_net_chunked_hd64_f32"),
        128 => Some("ember_delta_net_chunked_hd128_f32"),
        _ => None,
    }
    .filter(|_| seqs.n_rows >= DELTA_NET_CHUNKED_MIN_ROWS * seqs.n_seq);
    // The register-resident kernels load rows as 16-byte vectors: the state must start on one.
    // Threads per state row: each holds 64 values of it.
    let resident = match hd {
        64 => Some(("ember_delta_net_rule_hd64_f32", 1)),
        128 => Some(("ember_delta_net_rule_hd128_f32", 2)),
        _ => None,
    }
    .filter(|_| ssm_offset.is_multiple_of(4));
    match (chunked, resident) {
        (Some(name), _) => {
            let config = LaunchConfig {
                grid: [n_v * (hd32 / CHUNKED_ROWS), n_seq, 1],
                block: [CHUNKED_THREADS, 1, 1],
                shared_mem_bytes: 0,
            };
            // SAFETY: ember_delta_net_chunked_hd{64,128}_f32 takes the arguments of the
            // register-resident rule kernels; block (b, s) updates CHUNKED_ROWS state rows of one
            // value head of sequence s (inside its state buffer, read and written a float at a
            // time) over the rows of s, chunk by chunk, with CHUNKED_THREADS threads (its
            // __launch_bounds__) and its static shared memory (under 48 KiB), and writes those
            // rows' values of the head in out.
            unsafe { ctx.launch(KernelModule::DeltaNet, name, config, &args)? }
        }
        (None, Some((name, split))) => {
            let config = LaunchConfig {
                grid: [n_v * (hd32 / RULE_ROWS), n_seq, 1],
                block: [RULE_ROWS * split, 1, 1],
                shared_mem_bytes: 0,
            };
            // SAFETY: ember_delta_net_rule_hd{64,128}_f32(float* out, const float* x, const
            // float* beta, const float* alpha, const float* dt_bias, const float* a, const
            // uint64_t* states, const int32_t* starts, const int32_t* rows, uint32_t n_k_heads,
            // uint32_t n_v_heads, uint32_t channels, uint64_t ssm_offset); block (b, s) updates
            // RULE_ROWS state rows of one value head of sequence s (inside its state buffer, at a
            // 16-byte aligned offset, checked above) over the rows of s, `split` threads a row
            // (the kernel's __launch_bounds__ is RULE_ROWS * split), and writes those rows'
            // values of the head in out.
            unsafe { ctx.launch(KernelModule::DeltaNet, name, config, &args)? }
        }
        (None, None) => {
            let args = args.arg(KernelArg::U32(hd32));
            let config = LaunchConfig {
                grid: [n_v, n_seq, 1],
                block: [hd32, 1, 1],
                shared_mem_bytes: 2 * hd32 * 4,
            };
            // SAFETY: ember_delta_net_rule_any_f32(..., uint64_t ssm_offset, uint32_t head_dim)
            // as above with one block of head_dim threads (at most 1024, checked above) per value
            // head and 2 * head_dim floats of dynamic shared memory.
            unsafe {
                ctx.launch(
                    KernelModule::DeltaNet,
                    "ember_delta_net_rule_any_f32",
                    config,
                    &args,
                )?
            }
        }
    }

    // 4. The gated norm.
    let args = KernelArgs::new()
        .arg(ptr(io.out))
        .arg(ptr(io.z))
        .arg(ptr(layer.norm))
        .arg(ptr(seqs.rows))
        .arg(KernelArg::U32(n_v))
        .arg(KernelArg::U32(hd32))
        .arg(KernelArg::F32(layer.eps));
    let config = LaunchConfig {
        grid: [n_v, n_rows, 1],
        block: [warp, 1, 1],
        shared_mem_bytes: 0,
    };
    // SAFETY: ember_delta_net_gated_norm_f32(float* out, const float* z, const float* norm, const
    // int32_t* rows, uint32_t n_v_heads, uint32_t head_dim, float eps); block (h, r) rewrites
    // head h of batch row rows[r] of out, reading the same values of z and head_dim norm weights.
    unsafe {
        ctx.launch(
            KernelModule::DeltaNet,
            "ember_delta_net_gated_norm_f32",
            config,
            &args,
        )
    }
}

/// Splits a gated query projection (`n_tokens` rows of `n_heads` heads, each `head_dim` query
/// values then `head_dim` gate values) into `q` and `gate`.
pub fn split_query_gate(
    ctx: &GpuContext,
    q_full: DevicePtr,
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    q: DevicePtr,
    gate: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "split_query_gate";
    let total = as_u32(
        OP,
        "the value count",
        n_tokens.saturating_mul(n_heads).saturating_mul(head_dim),
    )?;
    if total == 0 {
        return Ok(());
    }
    as_u32(OP, "twice the value count", 2 * total as usize)?;
    let args = KernelArgs::new()
        .arg(ptr(q))
        .arg(ptr(gate))
        .arg(ptr(q_full))
        .arg(KernelArg::U32(n_tokens as u32))
        .arg(KernelArg::U32(n_heads as u32))
        .arg(KernelArg::U32(head_dim as u32));
    // SAFETY: ember_split_query_gate_f32(float* q, float* gate, const float* q_full, uint32_t
    // n_tokens, uint32_t n_heads, uint32_t head_dim); grid-stride over the n_tokens * n_heads *
    // head_dim values of q and gate, reading twice as many of q_full; the caller sized all three.
    unsafe {
        ctx.launch(
            KernelModule::DeltaNet,
            "ember_split_query_gate_f32",
            stride_launch(total),
            &args,
        )
    }
}

/// `x[i] *= sigmoid(gate[i])` for `len` values.
pub fn mul_sigmoid(
    ctx: &GpuContext,
    x: DevicePtr,
    gate: DevicePtr,
    len: usize,
) -> Result<(), OpsError> {
    const OP: &str = "mul_sigmoid";
    let n = as_u32(OP, "the value count", len)?;
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .arg(ptr(x))
        .arg(ptr(gate))
        .arg(KernelArg::U32(n));
    // SAFETY: ember_mul_sigmoid_f32(float* x, const float* gate, uint32_t n); grid-stride over n
    // values of x and gate, which the caller sized.
    unsafe {
        ctx.launch(
            KernelModule::DeltaNet,
            "ember_mul_sigmoid_f32",
            stride_launch(n),
            &args,
        )
    }
}
