//! NEON dot products for aarch64: the SIMD twins of the scalar Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
//! kernels. They use only baseline Advanced SIMD (widening multiplies and pairwise adds, no
//! `sdot`), so every aarch64 CPU runs them; the integer sums and the float formula per block
//! are the scalar ones, so results are bit-identical to the reference.

use std::arch::aarch64::*;

use crate::blocks::{
    k4_scales_mins, q4_0, q4_1, q4_k, q6_k, q8_0, q8_1, q8_k, q8k_bsum, read_f16, read_f32,
};
use crate::GgmlType;

/// Loads 16 bytes from the start of `b`.
#[inline]
#[target_feature(enable = "neon")]
fn load16(b: &[u8]) -> uint8x16_t {
    let b = &b[..16];
    // SAFETY: `b` holds 16 readable bytes; NEON loads have no alignment requirement.
    unsafe { vld1q_u8(b.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn load16_s8(b: &[u8]) -> int8x16_t {
    vreinterpretq_s8_u8(load16(b))
}

/// Σ x·y over 16 signed bytes.
#[inline]
#[target_feature(enable = "neon")]
fn dot16(x: int8x16_t, y: int8x16_t) -> i32 {
    let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    let hi = vmull_high_s8(x, y);
    vaddvq_s32(vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)))
}

/// The low and high nibbles of 16 bytes, as signed bytes 0..=15.
#[inline]
#[target_feature(enable = "neon")]
fn nibbles(v: uint8x16_t) -> (int8x16_t, int8x16_t) {
    let lo = vandq_u8(v, vdupq_n_u8(0x0F));
    let hi = vshrq_n_u8::<4>(v);
    (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
}

#[target_feature(enable = "neon")]
fn vec_dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    let eight = vdupq_n_s8(8);
    for (x, y) in w.chunks_exact(q4_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let (lo, hi) = nibbles(load16(&x[q4_0::QS..]));
        let sumi = dot16(vsubq_s8(lo, eight), load16_s8(&y[q8_0::QS..]))
            + dot16(vsubq_s8(hi, eight), load16_s8(&y[q8_0::QS + 16..]));
        sumf += sumi as f32 * read_f16(x, q4_0::D) * read_f16(y, q8_0::D);
    }
    sumf
}

#[target_feature(enable = "neon")]
fn vec_dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q4_1::SIZE).zip(a.chunks_exact(q8_1::SIZE)) {
        let (lo, hi) = nibbles(load16(&x[q4_1::QS..]));
        let sumi = dot16(lo, load16_s8(&y[q8_1::QS..])) + dot16(hi, load16_s8(&y[q8_1::QS + 16..]));
        sumf += (read_f16(x, q4_1::D) * read_f16(y, q8_1::D)) * sumi as f32
            + read_f16(x, q4_1::M) * read_f16(y, q8_1::S);
    }
    sumf
}

#[target_feature(enable = "neon")]
fn vec_dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q8_0::SIZE).zip(a.chunks_exact(q8_0::SIZE)) {
        let sumi = dot16(load16_s8(&x[q8_0::QS..]), load16_s8(&y[q8_0::QS..]))
            + dot16(
                load16_s8(&x[q8_0::QS + 16..]),
                load16_s8(&y[q8_0::QS + 16..]),
            );
        sumf += sumi as f32 * (read_f16(x, q8_0::D) * read_f16(y, q8_0::D));
    }
    sumf
}

#[target_feature(enable = "neon")]
fn vec_dot_q4_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(q4_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let (sc, mn) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        let msum: i32 = (0..8)
            .map(|j| mn[j] as i32 * (q8k_bsum(y, 2 * j) as i32 + q8k_bsum(y, 2 * j + 1) as i32))
            .sum();
        let mut isum = 0i32;
        for c in 0..4 {
            let (lo0, hi0) = nibbles(load16(&x[q4_k::QS + 32 * c..]));
            let (lo1, hi1) = nibbles(load16(&x[q4_k::QS + 32 * c + 16..]));
            let yq = &y[q8_k::QS + 64 * c..];
            let s_lo = dot16(lo0, load16_s8(yq)) + dot16(lo1, load16_s8(&yq[16..]));
            let s_hi = dot16(hi0, load16_s8(&yq[32..])) + dot16(hi1, load16_s8(&yq[48..]));
            isum += sc[2 * c] as i32 * s_lo + sc[2 * c + 1] as i32 * s_hi;
        }
        let d8 = read_f32(y, q8_k::D);
        sumf +=
            d8 * read_f16(x, q4_k::D) * isum as f32 - d8 * read_f16(x, q4_k::DMIN) * msum as f32;
    }
    sumf
}

#[target_feature(enable = "neon")]
fn vec_dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    let low = vdupq_n_u8(0x0F);
    let three = vdupq_n_u8(3);
    let m32 = vdupq_n_s8(32);
    for (x, y) in w.chunks_exact(q6_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let sc = &x[q6_k::SCALES..q6_k::SCALES + 16];
        let mut isum = 0i32;
        for c in 0..2 {
            for half in 0..2 {
                // Elements 128c + 32k + 16·half + (0..16) for quarter k.
                let ql0 = load16(&x[q6_k::QL + 64 * c + 16 * half..]);
                let ql1 = load16(&x[q6_k::QL + 64 * c + 32 + 16 * half..]);
                let qh = load16(&x[q6_k::QH + 32 * c + 16 * half..]);
                let quarters = [
                    vorrq_u8(vandq_u8(ql0, low), vshlq_n_u8::<4>(vandq_u8(qh, three))),
                    vorrq_u8(
                        vandq_u8(ql1, low),
                        vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(qh), three)),
                    ),
                    vorrq_u8(
                        vshrq_n_u8::<4>(ql0),
                        vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(qh), three)),
                    ),
                    vorrq_u8(vshrq_n_u8::<4>(ql1), vshlq_n_u8::<4>(vshrq_n_u8::<6>(qh))),
                ];
                for (k, q) in quarters.into_iter().enumerate() {
                    let e = 128 * c + 32 * k + 16 * half;
                    let v = vsubq_s8(vreinterpretq_s8_u8(q), m32);
                    isum += (sc[e / 16] as i8 as i32) * dot16(v, load16_s8(&y[q8_k::QS + e..]));
                }
            }
        }
        sumf += read_f32(y, q8_k::D) * read_f16(x, q6_k::D) * isum as f32;
    }
    sumf
}

/// One row's dot product with NEON, or `None` for the formats without a NEON kernel.
pub fn vec_dot(ty: GgmlType, w: &[u8], a: &[u8]) -> Option<f32> {
    // SAFETY: NEON is part of the aarch64 baseline (and `simd::level` checked it).
    unsafe {
        Some(match ty {
            GgmlType::Q4_0 => vec_dot_q4_0_q8_0(w, a),
            GgmlType::Q4_1 => vec_dot_q4_1_q8_1(w, a),
            GgmlType::Q8_0 => vec_dot_q8_0_q8_0(w, a),
            GgmlType::Q4_K => vec_dot_q4_k_q8_k(w, a),
            GgmlType::Q6_K => vec_dot_q6_k_q8_k(w, a),
            _ => return None,
        })
    }
}
