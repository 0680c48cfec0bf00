//! The invariants that make ember's matmuls give llama.cpp's numbers bit for bit: for the
//! formats whose GGML x86 kernels compute every output like one `vec_dot` (Q4_1, Q5_1 through
//! `vec_dot`; Q8_0, Q5_0 and Q4_0 matrices whose rows are not a multiple of 8 through `vec_dot`
//! or llamafile's `tinyBLAS_Q0_AVX`, which sums in the same order), every strategy of `matmul`
//! (row-wise, the four-row matvec, the tiles) must give exactly the SIMD `vec_dot` of each
//! output, at every token count; and Q4_K and Q4_0 matrices with a multiple of 8 rows, which
//! llama.cpp repacks, must stay within rounding of the scalar reference (their kernels are
//! checked bit for bit against the repacked order's definition in the crate's unit tests).

mod common;

use common::{random_weights, test_data, Rng};
use ember_quant::simd::{available_levels, level, Level};
use ember_quant::{
    matmul_with, quantize_activations, vec_dot_type, vec_dot_with, GgmlType, QMatrix, Strategy,
};

fn check_exact(ty: GgmlType, rows: usize, cols: usize, n_tokens: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let data = random_weights(&mut rng, ty, rows * cols, false);
    let w = QMatrix::new(ty, rows, cols, &data).unwrap();
    let x = test_data(&mut rng, n_tokens * cols, 1.0);
    let act = quantize_activations(vec_dot_type(ty), &x, n_tokens, cols).unwrap();
    for lvl in available_levels() {
        if lvl == Level::Scalar {
            // The scalar reference sums in the plain order of GGML's generic code.
            continue;
        }
        for strategy in [Strategy::Auto, Strategy::RowWise, Strategy::Tiled] {
            if strategy == Strategy::Auto && ty == GgmlType::Q4_0 && rows.is_multiple_of(8) {
                // llama.cpp's repacked order (`repacked_orders_stay_within_rounding_...`).
                continue;
            }
            let mut out = vec![f32::NAN; rows * n_tokens];
            matmul_with(lvl, strategy, &w, &act, &mut out).unwrap();
            for t in 0..n_tokens {
                for r in 0..rows {
                    let want = vec_dot_with(lvl, ty, w.row(r), act.row(t), cols).unwrap();
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty} {lvl:?} {strategy:?} {rows}x{cols}, {n_tokens} tokens, row {r} \
                         token {t}: {got} vs vec_dot {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn legacy_formats_match_vec_dot_bit_for_bit() {
    for (i, ty) in [
        GgmlType::Q4_1,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
    ]
    .into_iter()
    .enumerate()
    {
        // Rows and tokens around the AVX-512 kernels' groups (four rows per register, two
        // registers and four tokens per tile): whole, partial and odd groups.
        for (j, &(rows, cols, n)) in [
            (7, 64, 1),
            (9, 96, 3),
            (13, 576, 8),
            (33, 160, 21),
            (4, 32, 4),
            (18, 64, 7),
            (24, 1536, 10),
        ]
        .iter()
        .enumerate()
        {
            check_exact(ty, rows, cols, n, (100 * i + j) as u64);
        }
    }
}

#[test]
fn unpacked_k_quants_match_vec_dot_bit_for_bit() {
    // Q4_K with rows not a multiple of 8 is not repacked by llama.cpp: `vec_dot` throughout.
    // Q6_K prompts on AVX-512 VNNI take a kernel of their own that must sum as `vec_dot` does.
    let cases = [
        (GgmlType::Q6_K, 5, 1),
        (GgmlType::Q6_K, 12, 16),
        (GgmlType::Q6_K, 9, 30),
        // Several jobs and token blocks of the AVX-512 Q6_K kernel (32 tokens per block).
        (GgmlType::Q6_K, 37, 45),
        (GgmlType::Q6_K, 3, 2),
        (GgmlType::Q4_K, 5, 1),
        (GgmlType::Q4_K, 13, 16),
    ];
    for (j, &(ty, rows, n)) in cases.iter().enumerate() {
        let mut rng = Rng::new(7 + j as u64);
        let cols = 512;
        let data = random_weights(&mut rng, ty, rows * cols, false);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = test_data(&mut rng, n * cols, 1.0);
        let act = quantize_activations(vec_dot_type(ty), &x, n, cols).unwrap();
        let mut out = vec![f32::NAN; rows * n];
        matmul_with(level(), Strategy::Auto, &w, &act, &mut out).unwrap();
        for t in 0..n {
            for r in 0..rows {
                let want = vec_dot_with(level(), ty, w.row(r), act.row(t), cols).unwrap();
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    want.to_bits(),
                    "row {r} token {t}"
                );
            }
        }
    }
}

/// Q4_K and Q4_0 with 8k rows follow llama.cpp's repacked kernels, whose float steps differ
/// from the scalar `vec_dot` (Q4_K: one FMA per super-block or per pair of sub-blocks instead of
/// one sum per super-block; Q4_0: one FMA chain over the blocks instead of eight lanes added at
/// the end), so the two agree to rounding: 2^-16 of the sum of |terms| bounds it.
#[test]
fn repacked_orders_stay_within_rounding_of_the_reference() {
    for (ty, rows, cols, seed) in [
        (GgmlType::Q4_K, 16, 768, 99),
        (GgmlType::Q4_0, 24, 1536, 98),
    ] {
        repacked_order_within_rounding(ty, rows, cols, seed);
    }
}

fn repacked_order_within_rounding(ty: GgmlType, rows: usize, cols: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let data = random_weights(&mut rng, ty, rows * cols, false);
    let w = QMatrix::new(ty, rows, cols, &data).unwrap();
    for n in [1, 4, 7] {
        let x = test_data(&mut rng, n * cols, 1.0);
        let act = quantize_activations(vec_dot_type(ty), &x, n, cols).unwrap();
        let mut out = vec![f32::NAN; rows * n];
        matmul_with(level(), Strategy::Auto, &w, &act, &mut out).unwrap();
        let mut abs = vec![0.0f32; rows * n];
        let wd = common::dequant(ty, &data, rows * cols);
        let ad = common::dequant(vec_dot_type(ty), act.data(), n * cols);
        for t in 0..n {
            for r in 0..rows {
                abs[t * rows + r] = (0..cols)
                    .map(|k| (wd[r * cols + k] * ad[t * cols + k]).abs())
                    .sum();
            }
        }
        for t in 0..n {
            for r in 0..rows {
                let want = vec_dot_with(Level::Scalar, ty, w.row(r), act.row(t), cols).unwrap();
                let got = out[t * rows + r];
                let tol = abs[t * rows + r] / 65536.0;
                assert!(
                    (got - want).abs() <= tol,
                    "{ty} {n} tokens, row {r} token {t}: {got} vs {want} (tolerance {tol})"
                );
            }
        }
    }
}
