//! `ember info`: the build, the CPU features in use and, for a model, what it is and what it
//! will need in memory.

use std::collections::BTreeMap;

use clap::Args;
use serde::Serialize;

use ember::backend::cpu::physical_cores;
use ember::backend::ExpertGating;
use ember::load::open_gguf;
use ember::model::{architecture_of, Architecture, HParams, RopeScaling, DEFAULT_N_CTX};
use ember::peer_report::PeerReport;

use super::{load, Format};

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// Context length to size the KV cache for (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// Batch size to size the scratch buffers for.
    #[arg(short = 'b', long, default_value_t = 512)]
    pub batch_size: usize,
    /// Output format. `json` prints one object for scripts, with stable field names:
    /// `ember_version`, `build` (the embedded build manifest: `target`, `features` with `name`,
    /// `state`, `enabled`, `reason`, `tracking`, ...), `cpu` (`arch`, `simd`, `physical_cores`),
    /// `peer_copy` (as `ember devices` gives it: `gate` on|off|probe, `reason`, `pairs`: each
    /// `src`, `dst`, `peer`, `reason`, `self_test` passed|failed|not run) and `model` (null without -m; else `path`, `name`, `architecture`, `file_bytes`,
    /// `n_vocab`, `n_ctx_train`, `n_embd`, `n_layer`, `n_head`, `n_head_kv`, `n_ff`, `head_dim`,
    /// `rope`, `tensor_types`, `memory` with `n_ctx`, `n_ctx_source`, `kv_bytes_per_token`,
    /// `kv_bytes`, `weights_bytes`, `scratch_bytes`, ...). Sizes are in bytes.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

fn mib(bytes: f64) -> String {
    format!("{:.2} MiB", bytes / (1024.0 * 1024.0))
}

/// Bytes of activation buffers for a batch of `n` tokens (the forward pass's scratch), plus the
/// logits of one output row.
pub fn scratch_bytes(hp: &HParams, n_vocab: usize, n: usize) -> usize {
    let attention = || hp.layers.iter().filter(|l| !l.recurrent);
    // A query gate doubles the query projection's output (and needs the gate split off).
    let q_factor = if hp.architecture.hybrid_recurrent() {
        4
    } else {
        2
    };
    let max_q = attention()
        .map(|l| l.n_head * l.head_dim)
        .max()
        .unwrap_or(0);
    let max_kv = attention()
        .map(|l| l.n_head_kv * l.head_dim)
        .max()
        .unwrap_or(0);
    let max_ff = hp.layers.iter().map(|l| l.n_ff).max().unwrap_or(0);
    // A linear-attention layer's inputs: convolution channels, output gate, two per head.
    let linear = hp.linear_attention.map_or(0, |l| {
        l.conv_channels() + 2 * l.value_dim() + 2 * l.n_v_heads
    });
    let mut floats =
        n * (3 * hp.n_embd + q_factor * max_q + 2 * max_kv + 2 * max_ff + linear) + 2 * n_vocab;
    if let Some(moe) = hp.moe {
        // The CPU's grouped expert buffers: each token's row once per chosen expert as the
        // experts' input, gate, up and down products and weighted output, with quantized copies
        // of the gate/up and down inputs (about a byte a value, counted as a quarter float).
        let per_route = 3 * hp.n_embd + 2 * moe.n_ff_expert;
        let quantized = (2 * hp.n_embd + moe.n_ff_expert).div_ceil(4);
        floats += n * moe.n_expert_used * (per_route + quantized);
    }
    if hp.architecture == Architecture::Gemma4 {
        // The experts' input and output, the router logits, and the per-layer inputs of every
        // layer (twice while they are computed) with one layer's slice and its gate.
        if let Some(moe) = hp.moe {
            floats += n * (2 * hp.n_embd + moe.n_expert);
        }
        if let Some(width) = hp.n_embd_per_layer {
            floats += n * width * (2 * hp.n_layer + 2);
        }
    }
    floats * 4
}

/// The layer kinds of a model with sliding-window and global layers of different shapes
/// (Gemma 4), one line per kind.
fn layer_kinds(hp: &HParams) -> Vec<String> {
    let mut lines = Vec::new();
    for sliding in [false, true] {
        let layers: Vec<_> = hp
            .layers
            .iter()
            .filter(|l| l.sliding_window == sliding)
            .collect();
        let Some(first) = layers.first() else {
            continue;
        };
        let kv_heads: std::collections::BTreeSet<usize> =
            layers.iter().map(|l| l.n_head_kv).collect();
        let kv_heads: Vec<String> = kv_heads.iter().map(usize::to_string).collect();
        let (base, window) = if sliding {
            (
                hp.rope_freq_base_swa,
                format!(", window {}", hp.sliding_window.unwrap_or(0)),
            )
        } else {
            (hp.rope_freq_base, String::new())
        };
        lines.push(format!(
            "  {} {}: head size {}, {} heads, KV heads {}, rope {} dims base {base}{window}",
            layers.len(),
            if sliding { "sliding" } else { "full" },
            first.head_dim,
            first.n_head,
            kv_heads.join("/"),
            first.rope_n_dims,
        ));
    }
    let shared: Vec<usize> = hp
        .layers
        .iter()
        .enumerate()
        .filter(|&(il, l)| l.kv_source != il)
        .map(|(il, _)| il)
        .collect();
    if let (Some(first), Some(last)) = (shared.first(), shared.last()) {
        let sources: std::collections::BTreeSet<usize> =
            shared.iter().map(|&il| hp.layers[il].kv_source).collect();
        let sources: Vec<String> = sources.iter().map(usize::to_string).collect();
        lines.push(format!(
            "  {} KV-sharing (layers {first}..={last}, no cache of their own: they attend over layers {})",
            shared.len(),
            sources.join(" and ")
        ));
    }
    lines
}

/// Everything `ember info` reports, as `--format json` prints it.
#[derive(Debug, Serialize)]
struct InfoReport {
    ember_version: &'static str,
    /// The embedded build manifest as built in (null when it cannot be read).
    build: serde_json::Value,
    cpu: CpuReport,
    /// The peer-copy state of every ordered pair of the GPUs found.
    peer_copy: PeerReport,
    model: Option<ModelReport>,
}

#[derive(Debug, Serialize)]
struct CpuReport {
    arch: &'static str,
    simd: String,
    physical_cores: usize,
}

#[derive(Debug, Serialize)]
struct ModelReport {
    path: String,
    name: Option<String>,
    architecture: &'static str,
    file_bytes: u64,
    gguf_version: u32,
    n_vocab: usize,
    n_ctx_train: usize,
    n_embd: usize,
    n_layer: usize,
    /// Of the first layer (layers may differ: `layer_kinds`).
    n_head: usize,
    n_head_kv: usize,
    n_ff: usize,
    head_dim: usize,
    rms_eps: f32,
    rope: RopeReport,
    sliding_window: Option<SlidingWindowReport>,
    final_logit_softcap: Option<f32>,
    experts: Option<ExpertsReport>,
    linear_attention: Option<LinearAttentionReport>,
    /// Gemma 4's layer kinds, as text lines (empty for other models).
    layer_kinds: Vec<String>,
    n_embd_per_layer: Option<usize>,
    n_tensors: usize,
    tensor_types: Vec<TensorTypeReport>,
    memory: MemoryReport,
}

#[derive(Debug, Serialize)]
struct RopeReport {
    n_dims: usize,
    freq_base: f32,
    /// `none` or `linear`.
    scaling: &'static str,
    /// The linear scaling factor (positions are divided by it), null without scaling.
    scaling_factor: Option<f32>,
}

#[derive(Debug, Serialize)]
struct SlidingWindowReport {
    tokens: usize,
    layers: usize,
    freq_base: f32,
}

#[derive(Debug, Serialize)]
struct ExpertsReport {
    n_expert: usize,
    n_expert_used: usize,
    n_ff_expert: usize,
    /// The shared expert, in words (`none`, `1 of FFN N`, ...).
    shared: String,
    /// `softmax` or `sigmoid`.
    gating: &'static str,
    normalize_weights: bool,
}

#[derive(Debug, Serialize)]
struct LinearAttentionReport {
    n_linear_layers: usize,
    /// One letter per layer: F full attention, L linear.
    layer_kinds: String,
    n_k_heads: usize,
    n_v_heads: usize,
    head_v_dim: usize,
    conv_kernel: usize,
}

#[derive(Debug, Serialize)]
struct TensorTypeReport {
    #[serde(rename = "type")]
    ty: &'static str,
    count: usize,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct MemoryReport {
    weights_bytes: u64,
    /// Weight bytes one decoded token reads (token embedding rows, the routed experts in use).
    weights_read_per_token_bytes: u64,
    /// The context the KV figures are for.
    n_ctx: usize,
    /// Where `n_ctx` came from: `flag` (-c), `trained` (the model's), or `capped` (the model's
    /// trained context above the default cap, `n_ctx_cap`).
    n_ctx_source: &'static str,
    n_ctx_cap: usize,
    kv_layers: usize,
    kv_bytes_per_token: usize,
    kv_bytes: usize,
    recurrent_state_bytes_per_sequence: usize,
    weights_and_kv_bytes: u64,
    batch_size: usize,
    scratch_bytes: usize,
}

fn gating_name(gating: ExpertGating) -> &'static str {
    match gating {
        ExpertGating::Softmax => "softmax",
        ExpertGating::Sigmoid => "sigmoid",
    }
}

fn model_report(
    spec: &str,
    ctx_size: Option<usize>,
    batch_size: usize,
) -> anyhow::Result<ModelReport> {
    let path = load::resolve_model(spec)?;
    let gguf = open_gguf(&path)?;
    let arch = architecture_of(&gguf)?;
    let hp = HParams::from_metadata(arch, gguf.metadata())?;
    let n_vocab = gguf
        .tensor("token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .unwrap_or(0) as usize;
    let l0 = hp.layers[0];
    let linear_attention = hp.linear_attention.map(|linear| LinearAttentionReport {
        n_linear_layers: hp.layers.iter().filter(|l| l.recurrent).count(),
        layer_kinds: hp
            .layers
            .iter()
            .map(|l| if l.recurrent { 'L' } else { 'F' })
            .collect(),
        n_k_heads: linear.n_k_heads,
        n_v_heads: linear.n_v_heads,
        head_v_dim: linear.head_v_dim,
        conv_kernel: linear.conv_kernel,
    });
    let experts = hp.moe.map(|moe| {
        let shared = match (arch, moe.n_ff_shared) {
            (Architecture::Gemma4, _) => format!("1 (the dense FFN of {})", l0.n_ff),
            (_, Some(n)) => format!("1 of FFN {n}"),
            (_, None) => "none".to_string(),
        };
        let shared = if moe.shared_expert_gate && moe.n_ff_shared.is_some() {
            format!("{shared}, gated per token")
        } else {
            shared
        };
        ExpertsReport {
            n_expert: moe.n_expert,
            n_expert_used: moe.n_expert_used,
            n_ff_expert: moe.n_ff_expert,
            shared,
            gating: gating_name(moe.gating),
            normalize_weights: moe.normalize_weights,
        }
    });
    let (scaling, scaling_factor) = match hp.rope_scaling {
        RopeScaling::None => ("none", None),
        RopeScaling::Linear { factor } => ("linear", Some(factor)),
    };
    let mut types: BTreeMap<&'static str, (usize, u64)> = BTreeMap::new();
    for t in gguf.tensors() {
        let e = types.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    let (n_ctx, n_ctx_source) = match ctx_size {
        Some(n) => (n, "flag"),
        None if hp.n_ctx_train > DEFAULT_N_CTX => (DEFAULT_N_CTX, "capped"),
        None => (hp.n_ctx_train, "trained"),
    };
    let kv_bytes_per_token = hp.kv_bytes_per_token();
    let file_bytes = gguf.file_size();
    Ok(ModelReport {
        path: path.display().to_string(),
        name: gguf
            .metadata()
            .get_str_opt("general.name")
            .ok()
            .flatten()
            .map(str::to_string),
        architecture: arch.name(),
        file_bytes,
        gguf_version: gguf.version(),
        n_vocab,
        n_ctx_train: hp.n_ctx_train,
        n_embd: hp.n_embd,
        n_layer: hp.n_layer,
        n_head: l0.n_head,
        n_head_kv: l0.n_head_kv,
        n_ff: l0.n_ff,
        head_dim: hp.head_dim_k,
        rms_eps: hp.rms_eps,
        rope: RopeReport {
            n_dims: hp.rope_n_dims,
            freq_base: hp.rope_freq_base,
            scaling,
            scaling_factor,
        },
        sliding_window: hp.sliding_window.map(|tokens| SlidingWindowReport {
            tokens,
            layers: hp.layers.iter().filter(|l| l.sliding_window).count(),
            freq_base: hp.rope_freq_base_swa,
        }),
        final_logit_softcap: hp.final_logit_softcap,
        experts,
        linear_attention,
        layer_kinds: if arch == Architecture::Gemma4 {
            layer_kinds(&hp)
        } else {
            Vec::new()
        },
        n_embd_per_layer: hp.n_embd_per_layer,
        n_tensors: gguf.tensors().len(),
        tensor_types: types
            .into_iter()
            .map(|(ty, (count, bytes))| TensorTypeReport { ty, count, bytes })
            .collect(),
        memory: MemoryReport {
            weights_bytes: file_bytes,
            weights_read_per_token_bytes: hp.weight_bytes_read_per_token(gguf.tensors()),
            n_ctx,
            n_ctx_source,
            n_ctx_cap: DEFAULT_N_CTX,
            kv_layers: hp.layers.iter().filter(|l| !l.recurrent).count(),
            kv_bytes_per_token,
            kv_bytes: kv_bytes_per_token * n_ctx,
            recurrent_state_bytes_per_sequence: hp.recurrent_state_bytes_per_sequence(),
            weights_and_kv_bytes: file_bytes + (kv_bytes_per_token * n_ctx) as u64,
            batch_size,
            scratch_bytes: scratch_bytes(&hp, n_vocab, batch_size),
        },
    })
}

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    let model = match &args.model {
        Some(spec) => Some(model_report(spec, args.ctx_size, args.batch_size)?),
        None => None,
    };
    let report = InfoReport {
        ember_version: env!("CARGO_PKG_VERSION"),
        build: serde_json::from_str(ember::build_manifest::manifest_json())
            .unwrap_or(serde_json::Value::Null),
        cpu: CpuReport {
            arch: std::env::consts::ARCH,
            simd: ember_quant::simd::detected().to_string(),
            physical_cores: physical_cores(),
        },
        peer_copy: PeerReport::for_gpus(&super::devices::listed_gpu_names(
            &super::devices::list_devices(
                std::env::var_os("ROCM_PATH").map(Into::into),
                std::env::var_os("EMBER_KERNELS_DIR").map(Into::into),
                false,
            ),
        )),
        model,
    };
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Text => print!("{}", render_text(&report)),
    }
    Ok(())
}

fn render_text(report: &InfoReport) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!("ember {}", report.ember_version));
    line(ember::build_manifest::render_text().trim_end().to_string());
    line(format!(
        "cpu: {} SIMD, {} physical cores",
        report.cpu.simd, report.cpu.physical_cores
    ));
    for text in report.peer_copy.lines() {
        line(text);
    }
    if report.peer_copy.pairs.is_empty() {
        line("          no pair of GPUs to copy between (fewer than two found)".to_string());
    }
    let Some(m) = &report.model else {
        return out;
    };
    line(String::new());
    line(format!("model: {}", m.path));
    if let Some(name) = &m.name {
        line(format!("name: {name}"));
    }
    line(format!("architecture: {}", m.architecture));
    line(format!(
        "file size: {} (GGUF v{})",
        mib(m.file_bytes as f64),
        m.gguf_version
    ));
    line(format!("vocabulary: {}", m.n_vocab));
    line(format!("context (trained): {}", m.n_ctx_train));
    line(format!(
        "embedding: {}, layers: {}, head size: {}",
        m.n_embd, m.n_layer, m.head_dim
    ));
    line(format!(
        "heads: {}, KV heads: {}, FFN: {}",
        m.n_head, m.n_head_kv, m.n_ff
    ));
    if let Some(linear) = &m.linear_attention {
        line(format!(
            "layer kinds: {} full attention (query-gated), {} linear (Gated DeltaNet): {}",
            m.n_layer - linear.n_linear_layers,
            linear.n_linear_layers,
            linear.layer_kinds
        ));
        line(format!(
            "linear attention: {} key heads, {} value heads of {}, convolution of {} taps",
            linear.n_k_heads, linear.n_v_heads, linear.head_v_dim, linear.conv_kernel
        ));
    }
    if let Some(e) = &m.experts {
        line(format!(
            "experts: {} per layer, {} used per token, expert FFN {}, shared: {}, routing: {}{}",
            e.n_expert,
            e.n_expert_used,
            e.n_ff_expert,
            e.shared,
            e.gating,
            if e.normalize_weights {
                ", weights normalised"
            } else {
                ""
            }
        ));
    }
    let scaling = match m.rope.scaling_factor {
        Some(factor) => format!("linear scaling (positions divided by {factor})"),
        None => "no scaling".to_string(),
    };
    line(format!(
        "rms eps: {:e}, rope: {} dims, base {}, {scaling}",
        m.rms_eps, m.rope.n_dims, m.rope.freq_base
    ));
    if let Some(w) = &m.sliding_window {
        line(format!(
            "sliding window: {} tokens on {} of {} layers (local rope base {})",
            w.tokens, w.layers, m.n_layer, w.freq_base
        ));
    }
    if let Some(cap) = m.final_logit_softcap {
        line(format!("final logit soft-cap: {cap}"));
    }
    if !m.layer_kinds.is_empty() {
        line("layers by kind:".to_string());
        for kind in &m.layer_kinds {
            line(kind.clone());
        }
    }
    if let Some(width) = m.n_embd_per_layer {
        line(format!("per-layer embeddings: {width} per layer"));
    }
    line(format!("tensors: {}", m.n_tensors));
    for t in &m.tensor_types {
        line(format!(
            "  {:6} {:4} tensors, {}",
            t.ty,
            t.count,
            mib(t.bytes as f64)
        ));
    }
    let mem = &m.memory;
    let n_ctx = mem.n_ctx;
    let why_ctx = match mem.n_ctx_source {
        "flag" => "as -c asked".to_string(),
        "capped" => format!(
            "the default: the trained {} capped at {} so that a long-context model does not get a block table for all of it; -c N sizes for another",
            m.n_ctx_train, mem.n_ctx_cap
        ),
        _ => "the trained context; -c N sizes for another".to_string(),
    };
    line("memory:".to_string());
    line(format!(
        "  weights: {} memory-mapped from the file (read in place, not copied)",
        mib(mem.weights_bytes as f64)
    ));
    line(format!(
        "  weights read per decoded token: {} (one embedding row{})",
        mib(mem.weights_read_per_token_bytes as f64),
        if m.experts.is_some() {
            ", the routed experts in use"
        } else {
            ""
        }
    ));
    line(format!("  context: {n_ctx} tokens ({why_ctx})"));
    line(format!(
        "  KV cache (f16, {} of {} layers): {} per token, {} for a full context of {n_ctx} (allocated in blocks as used)",
        mem.kv_layers,
        m.n_layer,
        mib(mem.kv_bytes_per_token as f64),
        mib(mem.kv_bytes as f64)
    ));
    if mem.recurrent_state_bytes_per_sequence > 0 {
        line(format!(
            "  recurrent state (f32, {} linear layers): {} per sequence, whatever its length (made when it starts, freed when it ends)",
            m.n_layer - mem.kv_layers,
            mib(mem.recurrent_state_bytes_per_sequence as f64)
        ));
    }
    line(format!(
        "  weights + KV at a context of {n_ctx}: {}",
        mib(mem.weights_and_kv_bytes as f64)
    ));
    line(format!(
        "  scratch: {} for a batch of {} tokens",
        mib(mem.scratch_bytes as f64),
        mem.batch_size
    ));
    out
}
