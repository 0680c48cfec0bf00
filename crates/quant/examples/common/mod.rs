//! What the examples and the matmul bench share: random weights of a shape, quantised.

use ember_quant::{quantize, GgmlType};

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
