//! Checks on real tensors of the two test models (found through `EMBER_MODELS_DIR` or
//! `~/.cache/ember/models`, fetched and verified before tests run): dequantization against
//! values computed independently from the raw bytes, and dot products with one-hot
//! activations against the dequantized weights.

mod common;

use common::{models_dir, Gguf};
use ember_quant::simd::available_levels;
use ember_quant::{
    dequantize, matmul_with, quantize, quantize_activations, vec_dot_type, vec_dot_with, GgmlType,
    QMatrix, Strategy,
};
use half::f16;

fn open(name: &str) -> Gguf {
    let path = models_dir().join(name);
    assert!(
        path.exists(),
        "test model {} is missing: fetch the pinned models first",
        path.display()
    );
    Gguf::open(&path)
}

#[test]
fn smollm2_q8_0_embedding_matches_raw_bytes_and_requantizes_exactly() {
    let g = open("SmolLM2-135M-Instruct.Q4_1.gguf");
    let (info, data) = g.tensor("token_embd.weight");
    assert_eq!(info.ty, GgmlType::Q8_0);
    assert_eq!(info.dims, vec![576, 49152]);
    let cols = 576;
    let row_bytes = 576 / 32 * 34;
    let w = QMatrix::new(GgmlType::Q8_0, 49152, cols, data).unwrap();
    let mut row = vec![0.0f32; cols];
    for r in (0..49152).step_by(977) {
        w.dequantize_row(r, &mut row).unwrap();
        let raw = &data[r * row_bytes..(r + 1) * row_bytes];
        for (b, blk) in raw.chunks_exact(34).enumerate() {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            // Block sum two ways: Σ dequantized values and d · Σ quants (exact integers).
            let isum: i32 = blk[2..].iter().map(|&q| q as i8 as i32).sum();
            let fsum: f64 = row[32 * b..32 * b + 32].iter().map(|&v| v as f64).sum();
            assert!(
                (fsum - d as f64 * isum as f64).abs() <= 1e-6 * (d.abs() as f64 * 32.0 * 127.0)
            );
            for j in 0..32 {
                assert_eq!(row[32 * b + j], blk[2 + j] as i8 as f32 * d);
            }
        }
        // GGML's Q8_0 quantizer maps each block's largest magnitude to ±127, so quantizing
        // the dequantized row reproduces the file's bytes.
        let mut again = vec![0u8; row_bytes];
        quantize(GgmlType::Q8_0, &row, &mut again).unwrap();
        assert_eq!(again, raw, "row {r}");
    }
}

/// For a few rows and columns of a weight matrix: the dot product with a one-hot activation
/// (1.0 at column j) must give the dequantized weight. Quantizing the one-hot vector is exact
/// up to the f16 (Q8_0/Q8_1) or f32 (Q8_K) rounding of the scale 1/127 (2^-11 relative),
/// which multiplies the scaled quant `w_j - offset`; the offset (Q4_1's block minimum) is at
/// most the block's largest magnitude, hence the tolerance (|w_j| + max|w_block|) · 2^-10.
fn tolerance(deq: &[f32], j: usize) -> f32 {
    let block = &deq[j / 32 * 32..j / 32 * 32 + 32];
    let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    (deq[j].abs() + max) / 1024.0 + 1e-6
}

fn one_hot_check(g: &Gguf, name: &str, expected: GgmlType) {
    let (info, data) = g.tensor(name);
    assert_eq!(info.ty, expected, "{name}");
    let cols = info.dims[0] as usize;
    let rows = info.dims[1] as usize;
    let w = QMatrix::new(info.ty, rows, cols, data).unwrap();
    let mut deq = vec![0.0f32; cols];
    let at = vec_dot_type(info.ty);
    let picks: Vec<usize> = vec![0, 1, cols / 3, cols - 1];
    let mut x = vec![0.0f32; picks.len() * cols];
    for (t, &j) in picks.iter().enumerate() {
        x[t * cols + j] = 1.0;
    }
    let act = quantize_activations(at, &x, picks.len(), cols).unwrap();
    for r in [0, rows / 2, rows - 1] {
        w.dequantize_row(r, &mut deq).unwrap();
        assert!(deq.iter().all(|v| v.is_finite()), "{name} row {r}");
        for (t, &j) in picks.iter().enumerate() {
            for level in available_levels() {
                let got = vec_dot_with(level, info.ty, w.row(r), act.row(t), cols).unwrap();
                let tol = tolerance(&deq, j);
                assert!(
                    (got - deq[j]).abs() <= tol,
                    "{name} [{r}, {j}] on {level:?}: {got} vs {}",
                    deq[j]
                );
            }
        }
    }
    // The whole matrix through every matmul path against dequantized rows.
    for level in available_levels() {
        for strategy in [Strategy::RowWise, Strategy::Tiled] {
            let mut out = vec![0.0f32; rows * picks.len()];
            matmul_with(level, strategy, &w, &act, &mut out).unwrap();
            for r in (0..rows).step_by(rows / 7 + 1) {
                w.dequantize_row(r, &mut deq).unwrap();
                for (t, &j) in picks.iter().enumerate() {
                    let got = out[t * rows + r];
                    let tol = tolerance(&deq, j);
                    assert!(
                        (got - deq[j]).abs() <= tol,
                        "{name} [{r}, {j}] {level:?} {strategy:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn smollm2_q4_1_matrices_dot_like_their_dequantized_rows() {
    let g = open("SmolLM2-135M-Instruct.Q4_1.gguf");
    let shape = |n: &str| g.tensors.iter().find(|t| t.name == n).unwrap().dims.clone();
    assert_eq!(shape("blk.0.attn_q.weight"), vec![576, 576]);
    assert_eq!(shape("blk.0.attn_k.weight"), vec![576, 192]);
    assert_eq!(shape("blk.0.ffn_up.weight"), vec![576, 1536]);
    assert_eq!(shape("blk.0.ffn_down.weight"), vec![1536, 576]);
    for name in [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.7.ffn_down.weight",
    ] {
        one_hot_check(&g, name, GgmlType::Q4_1);
    }
}

#[test]
fn gemma3_k_quant_and_q5_0_matrices_dot_like_their_dequantized_rows() {
    let g = open("gemma-3-270m-q4_k_m.gguf");
    let mut seen = Vec::new();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
    ] {
        let t = g
            .tensors
            .iter()
            .find(|t| t.ty == ty && t.dims.len() == 2 && t.name.starts_with("blk."));
        if let Some(t) = t {
            one_hot_check(&g, &t.name, ty);
            seen.push(ty);
        }
    }
    assert!(
        seen.contains(&GgmlType::Q4_K) && seen.contains(&GgmlType::Q6_K),
        "found {seen:?}"
    );
    // Every tensor of a supported type dequantizes to finite values (first row only).
    for t in &g.tensors {
        if !ember_quant::is_supported(t.ty) {
            continue;
        }
        let (_, data) = g.tensor(&t.name);
        let cols = t.dims[0] as usize;
        let mut row = vec![0.0f32; cols];
        let bytes = t.ty.row_bytes(cols as u64).unwrap() as usize;
        dequantize(t.ty, &data[..bytes], &mut row).unwrap();
        assert!(row.iter().all(|v| v.is_finite()), "{}", t.name);
    }
}
