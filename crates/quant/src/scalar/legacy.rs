//! The 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1): reference quantizers,
//! dequantizers and dot products, following GGML's `quantize_row_*_ref`, `dequantize_row_*` and
//! the generic `ggml_vec_dot_*` step by step so that rounding is the same.

use crate::blocks::{q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, read_f16, read_u32, write_f16, QK};

/// The (signed) element of largest magnitude, the first one on ties, as GGML's loops find it.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

pub fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q4_0::SIZE)) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse(d);
        write_f16(y, q4_0::D, d);
        for j in 0..QK / 2 {
            // C's `(int8_t)(v + 8.5f)` truncates toward zero; `as i8` does the same.
            let xi0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let xi1 = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            y[q4_0::QS + j] = xi0 | (xi1 << 4);
        }
    }
}

pub fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q4_1::SIZE)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse(d);
        write_f16(y, q4_1::D, d);
        write_f16(y, q4_1::M, min);
        for j in 0..QK / 2 {
            let xi0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let xi1 = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
            y[q4_1::QS + j] = xi0 | (xi1 << 4);
        }
    }
}

pub fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q5_0::SIZE)) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse(d);
        write_f16(y, q5_0::D, d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let xi0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
            let xi1 = ((x[j + QK / 2] * id + 16.5) as i8).min(31) as u8;
            y[q5_0::QS + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        y[q5_0::QH..q5_0::QH + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

pub fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q5_1::SIZE)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse(d);
        write_f16(y, q5_1::D, d);
        write_f16(y, q5_1::M, min);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            // GGML clamps nothing here: `(uint8_t)(v + 0.5f)` with v in [0, 31].
            let xi0 = ((x[j] - min) * id + 0.5) as u8;
            let xi1 = ((x[j + QK / 2] - min) * id + 0.5) as u8;
            y[q5_1::QS + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        y[q5_1::QH..q5_1::QH + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Quantizes one 32-element block to Q8_0's 32 quants and scale (GGML's `quantize_row_q8_0_ref`).
#[inline(always)]
pub fn quantize_block_q8(x: &[f32], qs: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        // `roundf` rounds half away from zero, as `f32::round` does.
        *q = (v * id).round() as i8 as u8;
    }
    d
}

/// Quantizes one 32-element block of activations to Q8_0's quants and scale the way GGML's CPU
/// backend does at run time (`quantize_row_q8_0`/`_q8_1`, which differ from the `_ref` versions):
/// on x86 (the AVX/AVX2 kernel) the multiplier is `127 / amax` rather than `1 / d`, and on x86 and
/// ARM (`_mm256_round_ps(.., _MM_ROUND_NEAREST)`, `vcvtnq_s32_f32`) halves round to even rather
/// than away from zero. The two multipliers differ by an ulp for many blocks, which moves quants
/// across a rounding boundary; the network is sensitive enough to that for greedy continuations
/// to part from llama.cpp's, so activations must be rounded exactly as it rounds them.
#[inline(always)]
pub fn quantize_block_q8_runtime(x: &[f32], qs: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if cfg!(target_arch = "aarch64") {
        inverse(d)
    } else if amax != 0.0 {
        127.0 / amax
    } else {
        0.0
    };
    for (q, &v) in qs.iter_mut().zip(x) {
        // |v * id| <= 127 (up to rounding of `id`, which the saturating cast absorbs as GGML's
        // saturating packs do).
        *q = (v * id).round_ties_even() as i8 as u8;
    }
    d
}

/// Q8_0 activations as GGML's CPU backend quantizes them (see [`quantize_block_q8_runtime`]).
pub fn quantize_q8_0_activations(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q8_0::SIZE)) {
        let d = quantize_block_q8_runtime(x, &mut y[q8_0::QS..q8_0::QS + QK]);
        write_f16(y, q8_0::D, d);
    }
}

/// Q8_1 activations as GGML's CPU backend quantizes them (see [`quantize_block_q8_runtime`]);
/// `s` is `d` times the sum of the quants, rounded to f16, as in the reference.
pub fn quantize_q8_1_activations(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q8_1::SIZE)) {
        let d = quantize_block_q8_runtime(x, &mut y[q8_1::QS..q8_1::QS + QK]);
        let sum: i32 = y[q8_1::QS..q8_1::QS + QK]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        write_f16(y, q8_1::D, d);
        write_f16(y, q8_1::S, sum as f32 * d);
    }
}

pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q8_0::SIZE)) {
        let d = quantize_block_q8(x, &mut y[q8_0::QS..q8_0::QS + QK]);
        write_f16(y, q8_0::D, d);
    }
}

pub fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(q8_1::SIZE)) {
        let d = quantize_block_q8(x, &mut y[q8_1::QS..q8_1::QS + QK]);
        let sum: i32 = y[q8_1::QS..q8_1::QS + QK]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        write_f16(y, q8_1::D, d);
        write_f16(y, q8_1::S, sum as f32 * d);
    }
}

pub fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q4_0::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q4_0::D);
        for j in 0..QK / 2 {
            let q = x[q4_0::QS + j];
            y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q4_1::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q4_1::D);
        let m = read_f16(x, q4_1::M);
        for j in 0..QK / 2 {
            let q = x[q4_1::QS + j];
            y[j] = (q & 0xF) as f32 * d + m;
            y[j + QK / 2] = (q >> 4) as f32 * d + m;
        }
    }
}

/// The 32 five-bit values of a Q5 block, 0..=31.
#[inline(always)]
pub fn q5_values(qs: &[u8], qh: u32) -> [u8; QK] {
    let mut out = [0u8; QK];
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        out[j] = (qs[j] & 0xF) | h0;
        out[j + QK / 2] = (qs[j] >> 4) | h1;
    }
    out
}

pub fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q5_0::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q5_0::D);
        let v = q5_values(&x[q5_0::QS..q5_0::QS + 16], read_u32(x, q5_0::QH));
        for (o, &q) in y.iter_mut().zip(&v) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q5_1::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q5_1::D);
        let m = read_f16(x, q5_1::M);
        let v = q5_values(&x[q5_1::QS..q5_1::QS + 16], read_u32(x, q5_1::QH));
        for (o, &q) in y.iter_mut().zip(&v) {
            *o = q as f32 * d + m;
        }
    }
}

pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q8_0::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q8_0::D);
        for (o, &q) in y.iter_mut().zip(&x[q8_0::QS..q8_0::QS + QK]) {
            *o = q as i8 as f32 * d;
        }
    }
}

pub fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q8_1::SIZE).zip(dst.chunks_exact_mut(QK)) {
        let d = read_f16(x, q8_1::D);
        for (o, &q) in y.iter_mut().zip(&x[q8_1::QS..q8_1::QS + QK]) {
            *o = q as i8 as f32 * d;
        }
    }
}

/// Integer dot product of 32 quants of a weight block (as i32 values) with 32 int8 quants.
#[inline(always)]
fn idot(w: &[i32; QK], a: &[u8]) -> i32 {
    w.iter().zip(a).map(|(&x, &y)| x * (y as i8 as i32)).sum()
}

pub fn vec_dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q4_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let mut v = [0i32; QK];
        for j in 0..16 {
            v[j] = (x[q4_0::QS + j] & 0xF) as i32 - 8;
            v[j + 16] = (x[q4_0::QS + j] >> 4) as i32 - 8;
        }
        let sumi = idot(&v, &y[q8_0::QS..]);
        sumf += sumi as f32 * read_f16(x, q4_0::D) * read_f16(y, q8_0::D);
    }
    sumf
}

pub fn vec_dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q4_1::SIZE).zip(a.chunks_exact(q8_1::SIZE)) {
        let mut v = [0i32; QK];
        for j in 0..16 {
            v[j] = (x[q4_1::QS + j] & 0xF) as i32;
            v[j + 16] = (x[q4_1::QS + j] >> 4) as i32;
        }
        let sumi = idot(&v, &y[q8_1::QS..]);
        sumf += (read_f16(x, q4_1::D) * read_f16(y, q8_1::D)) * sumi as f32
            + read_f16(x, q4_1::M) * read_f16(y, q8_1::S);
    }
    sumf
}

pub fn vec_dot_q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q5_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let q = q5_values(&x[q5_0::QS..q5_0::QS + 16], read_u32(x, q5_0::QH));
        let v: [i32; QK] = std::array::from_fn(|j| q[j] as i32 - 16);
        let sumi = idot(&v, &y[q8_0::QS..]);
        sumf += (read_f16(x, q5_0::D) * read_f16(y, q8_0::D)) * sumi as f32;
    }
    sumf
}

pub fn vec_dot_q5_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q5_1::SIZE).zip(a.chunks_exact(q8_1::SIZE)) {
        let q = q5_values(&x[q5_1::QS..q5_1::QS + 16], read_u32(x, q5_1::QH));
        let v: [i32; QK] = std::array::from_fn(|j| q[j] as i32);
        let sumi = idot(&v, &y[q8_1::QS..]);
        sumf += (read_f16(x, q5_1::D) * read_f16(y, q8_1::D)) * sumi as f32
            + read_f16(x, q5_1::M) * read_f16(y, q8_1::S);
    }
    sumf
}

pub fn vec_dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q8_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let v: [i32; QK] = std::array::from_fn(|j| x[q8_0::QS + j] as i8 as i32);
        let sumi = idot(&v, &y[q8_0::QS..]);
        sumf += sumi as f32 * (read_f16(x, q8_0::D) * read_f16(y, q8_0::D));
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(rest: &[f32]) -> [f32; QK] {
        // 127 first so that amax = 127 and the multiplier is exactly 1.
        let mut x = [0f32; QK];
        x[0] = 127.0;
        x[1..=rest.len()].copy_from_slice(rest);
        x
    }

    #[test]
    fn activation_quants_round_halves_to_even_and_reference_ones_away_from_zero() {
        let x = block(&[0.5, 1.5, 2.5, -0.5, -2.5]);
        let mut run = [0u8; QK];
        let mut reference = [0u8; QK];
        assert_eq!(quantize_block_q8_runtime(&x, &mut run), 1.0);
        assert_eq!(quantize_block_q8(&x, &mut reference), 1.0);
        let ints = |q: &[u8]| q[..6].iter().map(|&b| b as i8).collect::<Vec<_>>();
        assert_eq!(ints(&run), [127, 0, 2, 2, 0, -2]);
        assert_eq!(ints(&reference), [127, 1, 2, 3, -1, -3]);
    }

    #[cfg(not(target_arch = "aarch64"))]
    #[test]
    fn x86_activation_multiplier_is_127_over_amax() {
        // With amax = 57/7, 1/(amax/127) is an ulp below 127/amax: this element scales to exactly
        // 0.5 (rounded to even: 0) with the reference multiplier and just above 0.5 (so 1) with
        // GGML's x86 one.
        let amax = 57.0f32 / 7.0;
        let v = 0.032_058_496_f32;
        let x = block(&[v]).map(|e| if e == 127.0 { amax } else { e });
        assert_eq!(v * inverse(amax / 127.0), 0.5);
        let mut run = [0u8; QK];
        quantize_block_q8_runtime(&x, &mut run);
        assert_eq!(run[0] as i8, 127);
        assert_eq!(run[1] as i8, 1);
    }
}
