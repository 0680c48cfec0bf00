//! Measures one-token and 256-token products on the weight shapes of Llama 3.2 1B Q4_K_M (Q4_K
//! and Q6_K layers) and of SmolLM2-135M in Q4_0, the CPU side-by-side models of
//! `scripts/gpu/cpu_scaling.sh`. Run with
//! `cargo run --release -p ember-quant --example llama_shapes [threads] [type] [seconds]` (a type
//! name such as Q4_K keeps only its shapes). Each line is the best and the median of the runs in
//! `seconds` (default 1): on a shared machine the best is the figure least disturbed by others,
//! so two builds compare by their best times, run one after the other.

mod common;
use common::{best_and_median, ramp_activations, weights};

use ember_quant::{matmul_with, simd, GgmlType, QMatrix, Strategy};

/// The seed of the weights.
const SEED: u64 = 0x1234_5678_9abc_def0;

fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let threads: usize = arg(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let only = arg(2).filter(|o| o != "all");
    let seconds: f64 = arg(3).and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    println!("simd: {}, threads: {threads}", simd::detected());
    let shapes = [
        (GgmlType::Q4_K, 2048, 2048, "1b attn q/o"),
        (GgmlType::Q4_K, 512, 2048, "1b attn k"),
        (GgmlType::Q4_K, 8192, 2048, "1b ffn gate"),
        (GgmlType::Q6_K, 2048, 8192, "1b ffn down"),
        (GgmlType::Q4_0, 576, 576, "smol attn q"),
        (GgmlType::Q4_0, 1536, 576, "smol ffn up"),
        (GgmlType::Q4_0, 576, 1536, "smol ffn down"),
    ];
    let level = simd::level();
    pool.install(|| {
        for n_tokens in [1usize, 256] {
            for &(ty, rows, cols, what) in &shapes {
                if only.as_ref().is_some_and(|o| *o != ty.to_string()) {
                    continue;
                }
                let data = weights(ty, rows, cols, SEED);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                let act = ramp_activations(ty, n_tokens, cols);
                let mut out = vec![0.0f32; rows * n_tokens];
                matmul_with(level, Strategy::Auto, &w, &act, &mut out).unwrap();
                let (best, median) = best_and_median(seconds, || {
                    matmul_with(level, Strategy::Auto, &w, &act, &mut out).unwrap();
                });
                let flops = 2.0 * rows as f64 * cols as f64 * n_tokens as f64;
                println!(
                    "{what:14} {ty:5} {rows:5}x{cols:<5} tokens {n_tokens:3}: {:9.1} us (median {:9.1})  {:7.1} GFLOP/s  {:6.1} GB/s(weights)",
                    best * 1e6,
                    median * 1e6,
                    flops / best / 1e9,
                    data.len() as f64 / best / 1e9
                );
            }
        }
    });
}
