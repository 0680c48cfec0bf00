//! What the examples and the matmul bench share: random weights of a shape, quantised; the
//! activations they are multiplied with; and the timing loop of the shape examples.
// Each example and bench compiles its own copy of this module and uses part of it.
#![allow(dead_code)]

use std::time::Instant;

use ember_quant::{quantize, quantize_activations, vec_dot_type, GgmlType, QuantizedActivations};

/// `rows x cols` values in [-0.1, 0.1) from an xorshift stream started at `seed`, quantised to
/// `ty`.
pub fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let x: Vec<f32> = (0..rows * cols)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    let mut data = vec![0u8; ty.row_bytes((rows * cols) as u64).unwrap() as usize];
    quantize(ty, &x, &mut data).unwrap();
    data
}

/// `n_tokens` rows of `cols` activations (a fixed ramp), quantised to `ty`'s dot-product type.
pub fn ramp_activations(ty: GgmlType, n_tokens: usize, cols: usize) -> QuantizedActivations {
    let x: Vec<f32> = (0..n_tokens * cols)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
        .collect();
    quantize_activations(vec_dot_type(ty), &x, n_tokens, cols).unwrap()
}

/// Runs `run` repeatedly for `seconds` and returns the best and the median time in seconds: on
/// a shared machine the best is the figure least disturbed by others.
pub fn best_and_median(seconds: f64, mut run: impl FnMut()) -> (f64, f64) {
    let start = Instant::now();
    let mut times = Vec::new();
    while times.is_empty() || start.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        run();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (times[0], times[times.len() / 2])
}
