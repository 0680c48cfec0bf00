//! The plain reference implementation of every format: what the SIMD kernels are tested
//! against, and what runs where no SIMD kernel exists. Lengths are checked by the callers in
//! `lib.rs`; these functions work on whole blocks.

pub mod float;
pub mod kquants;
pub mod legacy;

use crate::GgmlType;

/// Dequantizes whole blocks of `ty`; `dst.len()` elements.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => legacy::dequantize_q4_0(src, dst),
        Q4_1 => legacy::dequantize_q4_1(src, dst),
        Q5_0 => legacy::dequantize_q5_0(src, dst),
        Q5_1 => legacy::dequantize_q5_1(src, dst),
        Q8_0 => legacy::dequantize_q8_0(src, dst),
        Q8_1 => legacy::dequantize_q8_1(src, dst),
        Q2_K => kquants::dequantize_q2_k(src, dst),
        Q3_K => kquants::dequantize_q3_k(src, dst),
        Q4_K => kquants::dequantize_q4_k(src, dst),
        Q5_K => kquants::dequantize_q5_k(src, dst),
        Q6_K => kquants::dequantize_q6_k(src, dst),
        Q8_K => kquants::dequantize_q8_k(src, dst),
        _ => unreachable!("callers check is_supported"),
    }
}

/// Quantizes whole blocks of activations `src` into `dst` as GGML's CPU backend does at run time
/// before a matrix product: Q8_0 and Q8_1 round differently from their reference quantizers (see
/// [`legacy::quantize_block_q8_runtime`]); Q8_K and every other type use the reference, as GGML
/// does (its x86 `quantize_row_q8_K` is the reference one).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    match ty {
        GgmlType::Q8_0 => legacy::quantize_q8_0_activations(src, dst),
        GgmlType::Q8_1 => legacy::quantize_q8_1_activations(src, dst),
        _ => quantize_reference(ty, src, dst),
    }
}

/// Quantizes whole blocks of `src` into `dst` with GGML's reference quantizer for `ty`.
pub fn quantize_reference(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    use GgmlType::*;
    match ty {
        F32 => float::quantize_f32(src, dst),
        F16 => float::quantize_f16(src, dst),
        BF16 => float::quantize_bf16(src, dst),
        Q4_0 => legacy::quantize_q4_0(src, dst),
        Q4_1 => legacy::quantize_q4_1(src, dst),
        Q5_0 => legacy::quantize_q5_0(src, dst),
        Q5_1 => legacy::quantize_q5_1(src, dst),
        Q8_0 => legacy::quantize_q8_0(src, dst),
        Q8_1 => legacy::quantize_q8_1(src, dst),
        Q2_K => kquants::quantize_q2_k(src, dst),
        Q3_K => kquants::quantize_q3_k(src, dst),
        Q4_K => kquants::quantize_q4_k(src, dst),
        Q5_K => kquants::quantize_q5_k(src, dst),
        Q6_K => kquants::quantize_q6_k(src, dst),
        Q8_K => kquants::quantize_q8_k(src, dst),
        _ => unreachable!("callers check is_supported"),
    }
}

/// One row of `n` elements of `ty` dotted with activations of `vec_dot_type(ty)`.
pub fn vec_dot(ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f32 {
    use GgmlType::*;
    match ty {
        F32 => float::vec_dot_f32(w, a, n),
        F16 => float::vec_dot_f16(w, a, n),
        BF16 => float::vec_dot_bf16(w, a, n),
        Q4_0 => legacy::vec_dot_q4_0_q8_0(w, a),
        Q4_1 => legacy::vec_dot_q4_1_q8_1(w, a),
        Q5_0 => legacy::vec_dot_q5_0_q8_0(w, a),
        Q5_1 => legacy::vec_dot_q5_1_q8_1(w, a),
        Q8_0 => legacy::vec_dot_q8_0_q8_0(w, a),
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => kquants::vec_dot_k_q8_k(ty, w, a),
        _ => unreachable!("callers check that the type has a dot product"),
    }
}
