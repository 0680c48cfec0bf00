//! Matvec (one token, memory-bound) and 512-token matmul (compute-bound) on the shapes that
//! matter: SmolLM2-135M's Q4_1 FFN matrix and Q8_0 output matrix, and square Q4_K / Q6_K
//! matrices. Matvec reports weight bytes per second; matmul reports FLOP/s as "elements".
//! Threads: `EMBER_BENCH_THREADS` (default 2).

#[path = "../examples/common/mod.rs"]
mod common;
use common::weights;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ember_quant::{matmul, quantize_activations, vec_dot_type, GgmlType, QMatrix};

/// The seed of the weights.
const SEED: u64 = 0x2545_F491_4F6C_DD1D;

fn bench(c: &mut Criterion) {
    let threads = std::env::var("EMBER_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let shapes = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q4_K, 2048, 2048),
        (GgmlType::Q6_K, 2048, 2048),
    ];
    for (name, n_tokens) in [("matvec", 1usize), ("matmul512", 512)] {
        let mut group = c.benchmark_group(format!(
            "{name}/{}/{threads}t",
            ember_quant::simd::detected()
        ));
        group.sample_size(10);
        group.measurement_time(std::time::Duration::from_secs(2));
        group.warm_up_time(std::time::Duration::from_millis(500));
        for (ty, rows, cols) in shapes {
            let data = weights(ty, rows, cols, SEED);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..n_tokens * cols)
                .map(|i| ((i % 23) as f32 - 11.0) * 0.05)
                .collect();
            let act = quantize_activations(vec_dot_type(ty), &x, n_tokens, cols).unwrap();
            let mut out = vec![0.0f32; rows * n_tokens];
            if n_tokens == 1 {
                group.throughput(Throughput::Bytes(data.len() as u64));
            } else {
                group.throughput(Throughput::Elements(2 * (rows * cols * n_tokens) as u64));
            }
            group.bench_function(
                BenchmarkId::from_parameter(format!("{ty}_{rows}x{cols}")),
                |b| b.iter(|| pool.install(|| matmul(&w, &act, &mut out).unwrap())),
            );
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
