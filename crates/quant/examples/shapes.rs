//! Measures matvec and 512-token matmul on the weight shapes of SmolLM2-135M (Q4_1 layers,
//! Q8_0 tied embedding/output) and prints effective GFLOP/s and GB/s. Run with
//! `cargo run --release -p ember-quant --example shapes [threads]`; times are the best of
//! the runs in one second.

use std::time::Instant;

mod common;
use common::weights;

use ember_quant::{
    matmul_with, quantize_activations, simd, vec_dot_type, GgmlType, QMatrix, Strategy,
};

/// The seed of the weights.
const SEED: u64 = 0x1234_5678_9abc_def0;

fn measure(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tokens: usize,
    strategy: Strategy,
) -> (f64, f64, f64) {
    let data = weights(ty, rows, cols, SEED);
    let w = QMatrix::new(ty, rows, cols, &data).unwrap();
    let x: Vec<f32> = (0..n_tokens * cols)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
        .collect();
    let act = quantize_activations(vec_dot_type(ty), &x, n_tokens, cols).unwrap();
    let mut out = vec![0.0f32; rows * n_tokens];
    let level = simd::level();
    matmul_with(level, strategy, &w, &act, &mut out).unwrap();
    // The best of many runs: on a shared machine that is the figure least disturbed by others.
    let start = Instant::now();
    let mut secs = f64::MAX;
    while start.elapsed().as_secs_f64() < 1.0 {
        let t = Instant::now();
        matmul_with(level, strategy, &w, &act, &mut out).unwrap();
        secs = secs.min(t.elapsed().as_secs_f64());
    }
    let flops = 2.0 * rows as f64 * cols as f64 * n_tokens as f64;
    (
        secs * 1e6,
        flops / secs / 1e9,
        data.len() as f64 / secs / 1e9,
    )
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    println!(
        "simd: {}, threads: {threads}",
        ember_quant::simd::detected()
    );
    let shapes = [
        (GgmlType::Q4_1, 576, 576, "attn q/o"),
        (GgmlType::Q4_1, 192, 576, "attn k/v"),
        (GgmlType::Q4_1, 1536, 576, "ffn gate/up"),
        (GgmlType::Q4_1, 576, 1536, "ffn down"),
        (GgmlType::Q8_0, 49152, 576, "output"),
        (GgmlType::Q4_0, 1536, 576, "ffn gate/up"),
        (GgmlType::Q4_0, 576, 1536, "ffn down"),
        (GgmlType::Q4_K, 2048, 2048, "q4_K square"),
        (GgmlType::Q6_K, 2048, 2048, "q6_K square"),
    ];
    pool.install(|| {
        for n_tokens in [1usize, 512] {
            for &(ty, rows, cols, what) in &shapes {
                let (us, gflops, gbs) = measure(ty, rows, cols, n_tokens, Strategy::Auto);
                println!(
                    "{what:12} {ty:5} {rows:6}x{cols:<5} tokens {n_tokens:4}: {us:10.1} us  {gflops:7.1} GFLOP/s  {gbs:6.1} GB/s(weights)"
                );
            }
        }
        model_pass(1, 20);
        model_pass(512, 1);
        // Where the tiled kernel starts to pay for unpacking the weights.
        for &(ty, rows, cols, what) in &[shapes[2], shapes[5]] {
            for n_tokens in [2usize, 4, 8, 12, 16, 32] {
                let (row_us, ..) = measure(ty, rows, cols, n_tokens, Strategy::RowWise);
                let (tile_us, ..) = measure(ty, rows, cols, n_tokens, Strategy::Tiled);
                println!("{what:12} {ty:5} tokens {n_tokens:3}: row-wise {row_us:9.1} us, tiled {tile_us:9.1} us");
            }
        }
    });
}

/// All linear layers of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down in Q4_1, then
/// the Q8_0 output matrix for the last token), each matrix its own memory as in the real
/// model, so weights stream from DRAM as they do in decoding. Activations are quantized per
/// matmul (shared by q/k/v and by gate/up) as the engine does. Prints tokens per second of
/// the linear layers alone (no attention, norms or sampling).
fn model_pass(n_tokens: usize, runs: usize) {
    let (d, ff, kv, vocab) = (576usize, 1536usize, 192usize, 49152usize);
    let layers: Vec<Vec<(usize, usize, Vec<u8>)>> = (0..30)
        .map(|_| {
            [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]
                .iter()
                .map(|&(r, c)| (r, c, weights(GgmlType::Q4_1, r, c, SEED)))
                .collect()
        })
        .collect();
    let output = weights(GgmlType::Q8_0, vocab, d, SEED);
    let x: Vec<f32> = (0..n_tokens * ff)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
        .collect();
    let mut out = vec![0.0f32; n_tokens * vocab.max(ff)];
    let level = simd::level();
    let mut best = f64::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        for layer in &layers {
            let act =
                quantize_activations(GgmlType::Q8_1, &x[..n_tokens * d], n_tokens, d).unwrap();
            for (i, (r, c, data)) in layer.iter().enumerate() {
                let w = QMatrix::new(GgmlType::Q4_1, *r, *c, data).unwrap();
                let fresh;
                let a = if i == 3 || i == 6 {
                    fresh = quantize_activations(GgmlType::Q8_1, &x[..n_tokens * c], n_tokens, *c)
                        .unwrap();
                    &fresh
                } else {
                    &act
                };
                matmul_with(level, Strategy::Auto, &w, a, &mut out[..n_tokens * r]).unwrap();
            }
        }
        let w = QMatrix::new(GgmlType::Q8_0, vocab, d, &output).unwrap();
        let last = quantize_activations(GgmlType::Q8_0, &x[(n_tokens - 1) * d..n_tokens * d], 1, d)
            .unwrap();
        matmul_with(level, Strategy::Auto, &w, &last, &mut out[..vocab]).unwrap();
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!(
        "SmolLM2-135M linear layers, {n_tokens} token(s) per pass: {:8.2} ms, {:7.1} tokens/s",
        best * 1e3,
        n_tokens as f64 / best
    );
}
