//! Matrix products on every level and strategy against loops of scalar `vec_dot`, with row
//! and token counts that are not multiples of the tile sizes (4 rows x 2 tokens) or of the
//! cache blocks.
//!
//! The tiled kernel splits each value into `scale·q + offset` and adds the offset term
//! separately, so its float rounding is relative to the magnitude of the offset terms, which
//! `abs_scale` bounds (Σ over 16-groups of max|w|·|a|); tolerance 2^-17 of it, as in the
//! vec_dot tests.

mod common;

use common::{abs_scale, dequant, random_weights, test_data, Rng};
use ember_quant::simd::{available_levels, Level};
use ember_quant::{
    matmul, matmul_f32, matmul_with, quantize_activations, vec_dot_type, vec_dot_with, GgmlType,
    QMatrix, QuantError, Strategy,
};

const TYPES: [GgmlType; 13] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn check(ty: GgmlType, rows: usize, cols: usize, n_tokens: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let data = random_weights(&mut rng, ty, rows * cols, false);
    let w = QMatrix::new(ty, rows, cols, &data).unwrap();
    let x = test_data(&mut rng, n_tokens * cols, 1.0);
    let at = vec_dot_type(ty);
    let act = quantize_activations(at, &x, n_tokens, cols).unwrap();
    let wd = dequant(ty, &data, rows * cols);
    let ad = dequant(at, act.data(), n_tokens * cols);
    let mut reference = vec![0.0f32; rows * n_tokens];
    let mut tolerance = vec![0.0f64; rows * n_tokens];
    for t in 0..n_tokens {
        for r in 0..rows {
            reference[t * rows + r] =
                vec_dot_with(Level::Scalar, ty, w.row(r), act.row(t), cols).unwrap();
            tolerance[t * rows + r] =
                abs_scale(&wd[r * cols..(r + 1) * cols], &ad[t * cols..(t + 1) * cols])
                    / (1u64 << 17) as f64;
        }
    }
    for level in available_levels() {
        for strategy in [Strategy::Auto, Strategy::RowWise, Strategy::Tiled] {
            let mut out = vec![f32::NAN; rows * n_tokens];
            matmul_with(level, strategy, &w, &act, &mut out).unwrap();
            for i in 0..out.len() {
                assert!(
                    ((out[i] - reference[i]) as f64).abs() <= tolerance[i],
                    "{ty} {rows}x{cols}, {n_tokens} tokens, {level:?} {strategy:?}: output {i} is {} expected {} (tolerance {})",
                    out[i],
                    reference[i],
                    tolerance[i]
                );
            }
        }
    }
    let mut out = vec![0.0f32; rows * n_tokens];
    matmul_f32(&w, &x, n_tokens, &mut out).unwrap();
    let mut out2 = vec![0.0f32; rows * n_tokens];
    matmul(&w, &act, &mut out2).unwrap();
    assert_eq!(
        out, out2,
        "matmul_f32 quantizes exactly as quantize_activations"
    );
}

#[test]
fn every_type_odd_shapes() {
    for (i, ty) in TYPES.into_iter().enumerate() {
        let cols = if ty.block_size() == 256 { 512 } else { 96 };
        for (rows, n_tokens) in [(1, 1), (7, 1), (7, 3), (13, 5), (5, 8), (33, 9)] {
            check(ty, rows, cols, n_tokens, i as u64 * 100 + rows as u64);
        }
    }
}

#[test]
fn more_tokens_than_a_cache_block_and_many_jobs() {
    check(GgmlType::Q4_1, 70, 64, 261, 1);
    check(GgmlType::Q4_K, 37, 256, 259, 2);
    check(GgmlType::Q8_0, 130, 32, 300, 3);
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let mut rng = Rng::new(9);
    let (rows, cols, n_tokens) = (67, 128, 11);
    let data = random_weights(&mut rng, GgmlType::Q4_1, rows * cols, false);
    let w = QMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
    let x = test_data(&mut rng, n_tokens * cols, 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut out = vec![0.0f32; rows * n_tokens];
            matmul_f32(&w, &x, n_tokens, &mut out).unwrap();
            out
        })
    };
    assert_eq!(run(1), run(3));
}

#[test]
fn mismatched_arguments_are_errors() {
    let data = vec![0u8; 2 * 20];
    let w = QMatrix::new(GgmlType::Q4_1, 2, 32, &data).unwrap();
    let act = quantize_activations(GgmlType::Q8_0, &[0.0; 32], 1, 32).unwrap();
    let mut out = vec![0.0f32; 2];
    assert!(matches!(
        matmul(&w, &act, &mut out),
        Err(QuantError::ActivationType {
            expected: GgmlType::Q8_1,
            found: GgmlType::Q8_0
        })
    ));
    let act = quantize_activations(GgmlType::Q8_1, &[0.0; 32], 1, 32).unwrap();
    assert!(matches!(
        matmul(&w, &act, &mut out[..1]),
        Err(QuantError::LengthMismatch {
            expected: 2,
            found: 1,
            ..
        })
    ));
    assert!(quantize_activations(GgmlType::Q4_0, &[0.0; 32], 1, 32).is_err());
    assert!(quantize_activations(GgmlType::Q8_0, &[0.0; 31], 1, 32).is_err());
    assert!(quantize_activations(GgmlType::Q8_0, &[0.0; 30], 1, 30).is_err());
    let act = quantize_activations(GgmlType::Q8_1, &[], 0, 32).unwrap();
    assert!(matmul(&w, &act, &mut []).is_ok());
    let _ = Level::Scalar;
}
