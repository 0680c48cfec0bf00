//! `ember info`: the build, the CPU features in use and, for a model, what it is and what it
//! will need in memory.

use std::collections::BTreeMap;

use clap::Args;

use ember::backend::cpu::physical_cores;
use ember::load::open_gguf;
use ember::model::{architecture_of, Architecture, HParams, DEFAULT_N_CTX};

use super::load;

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

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    println!("ember {}", env!("CARGO_PKG_VERSION"));
    println!("{}", ember::build_manifest::render_text().trim_end());
    println!(
        "cpu: {} SIMD, {} physical cores",
        ember_quant::simd::detected(),
        physical_cores()
    );
    let Some(spec) = args.model else {
        return Ok(());
    };
    let path = load::resolve_model(&spec)?;
    let gguf = open_gguf(&path)?;
    let arch = architecture_of(&gguf)?;
    let hp = HParams::from_metadata(arch, gguf.metadata())?;
    let n_vocab = gguf
        .tensor("token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .unwrap_or(0) as usize;
    println!();
    println!("model: {}", path.display());
    if let Ok(Some(name)) = gguf.metadata().get_str_opt("general.name") {
        println!("name: {name}");
    }
    println!("architecture: {}", arch.name());
    println!(
        "file size: {} (GGUF v{})",
        mib(gguf.file_size() as f64),
        gguf.version()
    );
    println!("vocabulary: {n_vocab}");
    println!("context (trained): {}", hp.n_ctx_train);
    println!(
        "embedding: {}, layers: {}, head size: {}",
        hp.n_embd, hp.n_layer, hp.head_dim_k
    );
    let l0 = hp.layers[0];
    println!(
        "heads: {}, KV heads: {}, FFN: {}",
        l0.n_head, l0.n_head_kv, l0.n_ff
    );
    if let Some(linear) = hp.linear_attention {
        let n_linear = hp.layers.iter().filter(|l| l.recurrent).count();
        let kinds: String = hp
            .layers
            .iter()
            .map(|l| if l.recurrent { 'L' } else { 'F' })
            .collect();
        println!(
            "layer kinds: {} full attention (query-gated), {n_linear} linear (Gated DeltaNet): {kinds}",
            hp.n_layer - n_linear
        );
        println!(
            "linear attention: {} key heads, {} value heads of {}, convolution of {} taps",
            linear.n_k_heads, linear.n_v_heads, linear.head_v_dim, linear.conv_kernel
        );
    }
    if let Some(moe) = hp.moe {
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
        println!(
            "experts: {} per layer, {} used per token, expert FFN {}, shared: {shared}, routing: {:?}{}",
            moe.n_expert,
            moe.n_expert_used,
            moe.n_ff_expert,
            moe.gating,
            if moe.normalize_weights { ", weights normalised" } else { "" }
        );
    }
    println!(
        "rms eps: {:e}, rope: {} dims, base {}, {:?}",
        hp.rms_eps, hp.rope_n_dims, hp.rope_freq_base, hp.rope_scaling
    );
    if let Some(w) = hp.sliding_window {
        let n_local = hp.layers.iter().filter(|l| l.sliding_window).count();
        println!(
            "sliding window: {w} tokens on {n_local} of {} layers (local rope base {})",
            hp.n_layer, hp.rope_freq_base_swa
        );
    }
    if let Some(cap) = hp.final_logit_softcap {
        println!("final logit soft-cap: {cap}");
    }
    if arch == Architecture::Gemma4 {
        println!("layers by kind:");
        for line in layer_kinds(&hp) {
            println!("{line}");
        }
        if let Some(width) = hp.n_embd_per_layer {
            println!("per-layer embeddings: {width} per layer");
        }
    }

    let mut types: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in gguf.tensors() {
        let e = types.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    println!("tensors: {}", gguf.tensors().len());
    for (ty, (count, bytes)) in types {
        println!("  {ty:6} {count:4} tensors, {}", mib(bytes as f64));
    }

    let n_ctx = args
        .ctx_size
        .unwrap_or_else(|| hp.n_ctx_train.min(DEFAULT_N_CTX));
    let kv_token = hp.kv_bytes_per_token();
    println!("memory:");
    println!(
        "  weights: {} memory-mapped from the file (read in place, not copied)",
        mib(gguf.file_size() as f64)
    );
    let n_kv_layers = hp.layers.iter().filter(|l| !l.recurrent).count();
    println!("  KV cache (f16, {n_kv_layers} of {} layers): {} per token, {} for a full context of {n_ctx} (allocated in blocks as used)", hp.n_layer, mib(kv_token as f64), mib((kv_token * n_ctx) as f64));
    let state = hp.recurrent_state_bytes_per_sequence();
    if state > 0 {
        println!(
            "  recurrent state (f32, {} linear layers): {} per sequence, whatever its length (made when it starts, freed when it ends)",
            hp.layers.iter().filter(|l| l.recurrent).count(),
            mib(state as f64)
        );
    }
    println!(
        "  weights + KV at a context of {n_ctx}: {}",
        mib((gguf.file_size() as usize + kv_token * n_ctx) as f64)
    );
    println!(
        "  scratch: {} for a batch of {} tokens",
        mib(scratch_bytes(&hp, n_vocab, args.batch_size) as f64),
        args.batch_size
    );
    Ok(())
}
