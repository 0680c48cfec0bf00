//! `ember info`: the build, the CPU features in use and, for a model, what it is and what it
//! will need in memory.

use std::collections::BTreeMap;

use clap::Args;

use ember::backend::cpu::physical_cores;
use ember::load::open_gguf;
use ember::model::{architecture_of, HParams, DEFAULT_N_CTX};

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
    let hd = hp.head_dim_k;
    let max_q = hp.layers.iter().map(|l| l.n_head * hd).max().unwrap_or(0);
    let max_kv = hp
        .layers
        .iter()
        .map(|l| l.n_head_kv * hd)
        .max()
        .unwrap_or(0);
    let max_ff = hp.layers.iter().map(|l| l.n_ff).max().unwrap_or(0);
    let floats = n * (3 * hp.n_embd + 2 * max_q + 2 * max_kv + 2 * max_ff) + 2 * n_vocab;
    floats * 4
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
    if let Some(moe) = hp.moe {
        let shared = moe
            .n_ff_shared
            .map_or_else(|| "none".to_string(), |n| format!("1 of FFN {n}"));
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
    println!("  KV cache (f16): {} per token, {} for a full context of {n_ctx} (allocated in blocks as used)", mib(kv_token as f64), mib((kv_token * n_ctx) as f64));
    println!(
        "  scratch: {} for a batch of {} tokens",
        mib(scratch_bytes(&hp, n_vocab, args.batch_size) as f64),
        args.batch_size
    );
    Ok(())
}
