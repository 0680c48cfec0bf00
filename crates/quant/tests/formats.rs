//! Format-level tests: hand-built blocks with known values, quantize→dequantize error bounds,
//! and the scalar dot products against f32 dot products of the dequantized operands.

mod common;

use common::{dequant, test_data, Rng};
use ember_quant::{
    dequantize, is_supported, quantize, simd::Level, vec_dot_type, vec_dot_with, GgmlType,
    QuantError,
};
use half::f16;

const WEIGHT_TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
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
];

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

#[test]
fn q4_0_known_block() {
    // d = 1.0, nibble j in the low half and 15 - j in the high half.
    let mut b = vec![0u8; 18];
    b[0..2].copy_from_slice(&h(1.0));
    for j in 0..16 {
        b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
    }
    let y = dequant(GgmlType::Q4_0, &b, 32);
    for j in 0..16 {
        assert_eq!(y[j], j as f32 - 8.0);
        assert_eq!(y[16 + j], 7.0 - j as f32);
    }
}

#[test]
fn q4_1_q5_0_q5_1_q8_0_known_blocks() {
    let mut b = vec![0u8; 20];
    b[0..2].copy_from_slice(&h(0.5));
    b[2..4].copy_from_slice(&h(-2.0));
    for j in 0..16 {
        b[4 + j] = (j as u8) | (3 << 4);
    }
    let y = dequant(GgmlType::Q4_1, &b, 32);
    assert_eq!(y[5], 0.5 * 5.0 - 2.0);
    assert_eq!(y[16 + 9], 0.5 * 3.0 - 2.0);

    // Q5_0: value j has its fifth bit set for odd j; d = 2.
    let mut b = vec![0u8; 22];
    b[0..2].copy_from_slice(&h(2.0));
    let qh: u32 = 0xAAAA_AAAA;
    b[2..6].copy_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        b[6 + j] = 0x0F | (0x01 << 4);
    }
    let y = dequant(GgmlType::Q5_0, &b, 32);
    assert_eq!(y[0], (15.0 - 16.0) * 2.0);
    assert_eq!(y[1], (31.0 - 16.0) * 2.0);
    assert_eq!(y[16], (1.0 - 16.0) * 2.0);
    assert_eq!(y[17], (17.0 - 16.0) * 2.0);

    let mut b = vec![0u8; 24];
    b[0..2].copy_from_slice(&h(1.0));
    b[2..4].copy_from_slice(&h(10.0));
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    let y = dequant(GgmlType::Q5_1, &b, 32);
    assert_eq!(y[0], 16.0 + 10.0);
    assert_eq!(y[1], 10.0);

    let mut b = vec![0u8; 34];
    b[0..2].copy_from_slice(&h(0.25));
    for j in 0..32 {
        b[2 + j] = (j as i8 - 16) as u8;
    }
    let y = dequant(GgmlType::Q8_0, &b, 32);
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 16.0) * 0.25);
    }
}

#[test]
fn q4_k_known_block() {
    // d = 1, dmin = 0.5; sub-block j has scale j + 1 and min 2j (6-bit packing of
    // get_scale_min_k4); every quant is 3 in low nibbles and 7 in high nibbles.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&h(1.0));
    b[2..4].copy_from_slice(&h(0.5));
    let sc: [u8; 8] = std::array::from_fn(|j| j as u8 + 1);
    let mn: [u8; 8] = std::array::from_fn(|j| 2 * j as u8);
    for j in 0..4 {
        b[4 + j] = sc[j];
        b[4 + j + 4] = mn[j];
    }
    for j in 4..8 {
        b[4 + j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
        b[4 + j - 4] |= (sc[j] >> 4) << 6;
        b[4 + j] |= (mn[j] >> 4) << 6;
    }
    for q in &mut b[16..144] {
        *q = 3 | (7 << 4);
    }
    let y = dequant(GgmlType::Q4_K, &b, 256);
    for (i, v) in y.iter().enumerate() {
        let sub = i / 32;
        let q = if sub % 2 == 0 { 3.0 } else { 7.0 };
        assert_eq!(*v, sc[sub] as f32 * q - 0.5 * mn[sub] as f32, "element {i}");
    }
}

#[test]
fn q6_k_known_block() {
    // d = 0.5, scales alternate 2 and -3, every 6-bit quant is 40 (value 8).
    let mut b = vec![0u8; 210];
    for q in &mut b[0..128] {
        *q = 8 | (8 << 4);
    }
    for q in &mut b[128..192] {
        *q = 0b10_10_10_10;
    }
    for j in 0..16 {
        b[192 + j] = if j % 2 == 0 { 2 } else { (-3i8) as u8 };
    }
    b[208..210].copy_from_slice(&h(0.5));
    let y = dequant(GgmlType::Q6_K, &b, 256);
    for (i, v) in y.iter().enumerate() {
        let sc = if (i / 16) % 2 == 0 { 2.0 } else { -3.0 };
        assert_eq!(*v, 0.5 * sc * 8.0, "element {i}");
    }
}

#[test]
fn q8_k_quantizer_matches_its_definition() {
    let mut rng = Rng::new(7);
    let x = test_data(&mut rng, 512, 1.0);
    let mut b = vec![0u8; 2 * 292];
    quantize(GgmlType::Q8_K, &x, &mut b).unwrap();
    for (blk, xs) in b.chunks_exact(292).zip(x.chunks_exact(256)) {
        let max = xs
            .iter()
            .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let iscale = -127.0 / max;
        let d = f32::from_le_bytes(blk[0..4].try_into().unwrap());
        assert_eq!(d, 1.0 / iscale);
        for j in 0..256 {
            let q = blk[4 + j] as i8 as i32;
            assert_eq!(q, ((iscale * xs[j]).round_ties_even() as i32).min(127));
        }
        for g in 0..16 {
            let s: i32 = blk[4 + 16 * g..4 + 16 * g + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            assert_eq!(
                i16::from_le_bytes([blk[260 + 2 * g], blk[261 + 2 * g]]) as i32,
                s
            );
        }
    }
}

#[test]
fn q8_1_sum_is_d_times_sum_of_quants() {
    let mut rng = Rng::new(3);
    let x = test_data(&mut rng, 64, 2.0);
    let mut b = vec![0u8; 72];
    quantize(GgmlType::Q8_1, &x, &mut b).unwrap();
    for (blk, xs) in b.chunks_exact(36).zip(x.chunks_exact(32)) {
        // GGML multiplies by the f32 scale, before it is rounded to f16 for storage.
        let d = xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        assert_eq!(
            f16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            f16::from_f32(d).to_f32()
        );
        let s = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        let sum: i32 = blk[4..].iter().map(|&q| q as i8 as i32).sum();
        assert_eq!(s, f16::from_f32(sum as f32 * d).to_f32());
    }
}

#[test]
fn zero_blocks_quantize_to_zero() {
    for ty in WEIGHT_TYPES
        .into_iter()
        .chain([GgmlType::Q8_1, GgmlType::Q8_K])
    {
        let n = ty.block_size().max(32) * 2;
        let x = vec![0.0f32; n];
        let mut b = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
        quantize(ty, &x, &mut b).unwrap();
        assert!(dequant(ty, &b, n).iter().all(|&v| v == 0.0), "{ty}");
    }
}

/// Largest error allowed per element after a round trip, for a group of values (the block for
/// the legacy formats) — see each arm for the derivation. `None`: judged by RMS instead.
fn element_bound(ty: GgmlType, group: &[f32]) -> Option<f32> {
    let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (min, max) = group
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    // f16 keeps 11 significant bits: a stored scale is off by at most 2^-11 relative.
    let f16_rel = 1.0 / 2048.0;
    Some(match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => amax * f16_rel,
        GgmlType::BF16 => amax / 256.0,
        // Half a step of d = amax/127, plus 127 steps of the scale's rounding error.
        GgmlType::Q8_0 | GgmlType::Q8_1 => amax / 254.0 + amax * f16_rel * 1.01,
        // d = amax/8 (/16): values round to nearest except the one clamped at +amax, which
        // is off by one full step d; plus the scale's rounding over 8 (16) steps.
        GgmlType::Q4_0 => amax / 8.0 * (1.0 + 2.0 * f16_rel) * 1.001,
        GgmlType::Q5_0 => amax / 16.0 * (1.0 + 2.0 * f16_rel) * 1.001,
        // Half a step of d = range/15 (/31) plus the rounding of d (15 steps) and of min.
        GgmlType::Q4_1 => (max - min) / 30.0 + ((max - min) + min.abs()) * f16_rel * 1.01,
        GgmlType::Q5_1 => (max - min) / 62.0 + ((max - min) + min.abs()) * f16_rel * 1.01,
        _ => return None,
    })
}

/// RMS round-trip error of the K-quants relative to the RMS of the data, on normal data with
/// outliers. An ideal uniform quantizer over ±3σ with 2^b levels gives 6σ/(2^b - 1)/√12
/// relative error: 0.58 (b=2), 0.25 (3), 0.115 (4), 0.056 (5), 0.027 (6); per-group scales
/// fitted to each 16/32 values do better, 6-bit scale codes a little worse. The bounds are
/// those ideal figures: a regression in the search or the packing breaks them by far.
fn rms_bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::Q2_K => 0.58,
        GgmlType::Q3_K => 0.25,
        GgmlType::Q4_K => 0.115,
        GgmlType::Q5_K => 0.056,
        GgmlType::Q6_K => 0.027,
        _ => unreachable!(),
    }
}

#[test]
fn round_trip_error_is_within_the_format_bound() {
    let mut rng = Rng::new(11);
    for ty in WEIGHT_TYPES
        .into_iter()
        .chain([GgmlType::Q8_1, GgmlType::Q8_K])
    {
        let n = 4096;
        let x = test_data(&mut rng, n, 0.7);
        let mut b = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
        quantize(ty, &x, &mut b).unwrap();
        let y = dequant(ty, &b, n);
        let group = ty.block_size().max(32);
        if element_bound(ty, &x[..group]).is_some() {
            for (xg, yg) in x.chunks(group).zip(y.chunks(group)) {
                let bound = element_bound(ty, xg).unwrap();
                for (a, b) in xg.iter().zip(yg) {
                    assert!((a - b).abs() <= bound, "{ty}: {a} -> {b}, bound {bound}");
                }
            }
        } else if ty == GgmlType::Q8_K {
            // f32 scale: half a step of amax/127 per 256 values.
            for (xg, yg) in x.chunks(256).zip(y.chunks(256)) {
                let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in xg.iter().zip(yg) {
                    assert!((a - b).abs() <= amax / 254.0 * 1.0001, "{ty}: {a} -> {b}");
                }
            }
        } else {
            let err: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let sig: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
            let rel = (err / sig).sqrt();
            assert!(rel < rms_bound(ty), "{ty}: relative RMS error {rel}");
        }
    }
}

#[test]
fn scalar_vec_dot_matches_f32_dot_within_activation_error() {
    let mut rng = Rng::new(5);
    for ty in WEIGHT_TYPES {
        let n = 1024;
        let w_f = test_data(&mut rng, n, 0.1);
        let a_f = test_data(&mut rng, n, 1.0);
        let mut w = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
        quantize(ty, &w_f, &mut w).unwrap();
        let at = vec_dot_type(ty);
        let mut a = vec![0u8; at.row_bytes(n as u64).unwrap() as usize];
        quantize(at, &a_f, &mut a).unwrap();
        let wd = dequant(ty, &w, n);
        let exact: f64 = wd
            .iter()
            .zip(&a_f)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum();
        let got = vec_dot_with(Level::Scalar, ty, &w, &a, n).unwrap() as f64;
        // The activation's rounding error bounds the difference: per element at most the
        // element bound of its format (computed per activation block), times |w|; plus f32
        // rounding of the sums (2^-20 of Σ|w·a|), and for Q8_1 the f16 rounding of s·m.
        let ab = at.block_size().max(32);
        let mut bound = 0.0f64;
        for (wg, ag) in wd.chunks(ab).zip(a_f.chunks(ab)) {
            let e = match at {
                GgmlType::Q8_K => ag.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 254.0,
                _ => element_bound(at, ag).unwrap(),
            } as f64;
            bound += wg.iter().map(|v| v.abs() as f64 * e).sum::<f64>();
            if at == GgmlType::Q8_1 {
                let m = wg.iter().fold(f32::MAX, |m, v| m.min(*v)).abs() as f64;
                bound += m * ag.iter().map(|v| v.abs() as f64).sum::<f64>() / 1024.0;
            }
        }
        bound += common::abs_scale(&wd, &a_f) / (1u64 << 20) as f64;
        assert!(
            (got - exact).abs() <= bound,
            "{ty}: {got} vs {exact}, bound {bound}"
        );
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let mut out = vec![0.0f32; 31];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0u8; 18], &mut out),
        Err(QuantError::NotWholeBlocks { .. })
    ));
    let mut out = vec![0.0f32; 32];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out),
        Err(QuantError::LengthMismatch {
            expected: 18,
            found: 17,
            ..
        })
    ));
    assert!(matches!(
        dequantize(GgmlType::IQ2_XS, &[0u8; 74], &mut vec![0.0; 256]),
        Err(QuantError::UnsupportedType(GgmlType::IQ2_XS))
    ));
    assert!(matches!(
        quantize(GgmlType::Q4_K, &[0.0; 255], &mut [0u8; 144]),
        Err(QuantError::NotWholeBlocks { .. })
    ));
    assert!(matches!(
        ember_quant::vec_dot(GgmlType::Q4_1, &[0u8; 20], &[0u8; 34], 32),
        Err(QuantError::LengthMismatch {
            expected: 36,
            found: 34,
            ..
        })
    ));
    assert!(matches!(
        ember_quant::vec_dot(GgmlType::Q8_K, &[0u8; 292], &[0u8; 292], 256),
        Err(QuantError::NoDotProduct(GgmlType::Q8_K))
    ));
    assert!(ember_quant::QMatrix::new(GgmlType::Q4_0, 2, 32, &[0u8; 35]).is_err());
    assert!(ember_quant::QMatrix::new(GgmlType::Q4_0, usize::MAX, 32, &[]).is_err());
    let msg = QuantError::LengthMismatch {
        what: "x",
        unit: "bytes",
        expected: 3,
        found: 4,
    }
    .to_string();
    assert_eq!(msg, "x: expected 3 bytes, found 4");
    assert!(!is_supported(GgmlType::IQ4_NL));
}

#[test]
fn vec_dot_types_follow_ggml() {
    use GgmlType::*;
    for (w, a) in [
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2_K, Q8_K),
        (Q3_K, Q8_K),
        (Q4_K, Q8_K),
        (Q5_K, Q8_K),
        (Q6_K, Q8_K),
        (F16, F16),
        (BF16, BF16),
        (F32, F32),
    ] {
        assert_eq!(vec_dot_type(w), a);
    }
}
