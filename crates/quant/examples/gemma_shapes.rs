//! Measures matvec and 128-token matmul on the weight shapes of Gemma 3 270M Q4_K_M (Q5_0,
//! Q4_K, Q6_K layers; a 262144-row Q8_0 output), on every SIMD level of this CPU. Run with
//! `cargo run --release -p ember-quant --example gemma_shapes [threads] [type]` (a type name
//! such as Q6_K keeps only its shapes); times are the best and the median of the runs in one second.

mod common;
use common::{best_and_median, ramp_activations, weights};

use ember_quant::{matmul_with, simd, GgmlType, QMatrix, Strategy};

/// The seed of the weights.
const SEED: u64 = 0x1234_5678_9abc_def0;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let only = std::env::args().nth(2);
    println!("simd: {}, threads: {threads}", simd::detected());
    let shapes = [
        (GgmlType::Q8_0, 262144, 640, "output"),
        (GgmlType::Q5_0, 2048, 640, "ffn gate/up"),
        (GgmlType::Q5_0, 1024, 640, "attn q"),
        (GgmlType::Q4_K, 640, 2048, "ffn down"),
        (GgmlType::Q6_K, 640, 2048, "ffn down"),
        (GgmlType::Q4_K, 640, 1024, "attn out"),
        (GgmlType::Q4_1, 1536, 576, "smollm2 ffn"),
    ];
    pool.install(|| {
        for n_tokens in [1usize, 128] {
            for &(ty, rows, cols, what) in &shapes {
                if only.as_ref().is_some_and(|o| *o != ty.to_string()) {
                    continue;
                }
                let data = weights(ty, rows, cols, SEED);
                let w = QMatrix::new(ty, rows, cols, &data).unwrap();
                let act = ramp_activations(ty, n_tokens, cols);
                let mut out = vec![0.0f32; rows * n_tokens];
                for level in simd::available_levels() {
                    if level == simd::Level::Scalar {
                        continue;
                    }
                    matmul_with(level, Strategy::Auto, &w, &act, &mut out).unwrap();
                    let (secs, median) = best_and_median(1.0, || {
                        matmul_with(level, Strategy::Auto, &w, &act, &mut out).unwrap();
                    });
                    println!(
                        "{what:12} {ty:5} {rows:6}x{cols:<5} tokens {n_tokens:4} {:10}: {:10.1} us (median {:10.1})  {:6.1} GB/s(weights)",
                        level.name(),
                        secs * 1e6,
                        median * 1e6,
                        data.len() as f64 / secs / 1e9
                    );
                }
            }
        }
    });
}
