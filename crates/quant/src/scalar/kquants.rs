//! The K-quants (Q2_K .. Q6_K) and their activation format Q8_K: GGML's reference quantizers
//! (without importance matrix), dequantizers and generic dot products, step by step so that
//! rounding and search order are the same.

use crate::blocks::{
    k4_scales_mins, q2_k, q3_k, q3k_scales, q4_k, q5_k, q6_k, q8_k, q8k_bsum, read_f16, read_f32,
    write_f16, QK_K,
};

/// Groups whose largest magnitude is below this are stored as zero (`GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// GGML's `nearest_int`: round to nearest, ties to even, through the float mantissa trick.
/// Bit-exact with GGML for every input, including the ones out of its documented range.
#[inline(always)]
pub fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    ((val.to_bits() & 0x007f_ffff) as i32) - 0x0040_0000
}

/// `make_qx_quants` with `rmse_type == 1` and no importance weights (the only form the
/// reference quantizers use): symmetric quants in `[-nmax, nmax)` stored offset by `nmax`.
fn make_qx_quants(x: &[f32], nmax: i32, l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &xi in x {
            let l = nearest_int(iscale * xi).clamp(-nmax, nmax - 1);
            let w = xi * xi;
            sumlx += w * xi * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse == true`.
fn make_q3_quants(x: &[f32], nmax: i32, l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    let mut l_vals = [0i32; 16];
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_vals[i] = l;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let mut slx = sumlx - w * x[i] * l_vals[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * l_vals[i] as f32 * l_vals[i] as f32;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l_vals[i] {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_vals[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for i in 0..n {
        l_out[i] = (l_vals[i] + nmax) as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `make_qkx2_quants`: asymmetric quants in `[0, nmax]` with a scale and a (negated) min,
/// searched over `nstep + 1` candidate scales. Returns `(scale, the_min)`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        let diff = if use_mad { diff.abs() } else { diff * diff };
        best_error += weights[i] * diff;
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                let diff = if use_mad { diff.abs() } else { diff * diff };
                cur_error += weights[i] * diff;
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs 256 two-bit values the way Q2_K and Q3_K store them: byte `j/4 + l` of each
/// 128-element half holds elements `l`, `l+32`, `l+64`, `l+96` in bits 0-1, 2-3, 4-5, 6-7.
fn pack_2bit(l_vals: &[u8; QK_K], qs: &mut [u8]) {
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            qs[j / 4 + l] = l_vals[j + l]
                | (l_vals[j + l + 32] << 2)
                | (l_vals[j + l + 64] << 4)
                | (l_vals[j + l + 96] << 6);
        }
    }
}

pub fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q2_k::SIZE)) {
        let mut l_vals = [0u8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut mins = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|l| xs[l].abs());
            let (scale, min) = make_qkx2_quants(
                xs,
                &weights,
                3,
                &mut l_vals[16 * j..16 * j + 16],
                -0.5,
                0.1,
                15,
                true,
            );
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }
        let sc = &mut y[q2_k::SCALES..q2_k::SCALES + 16];
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                sc[j] = nearest_int(iscale * scales[j]) as u8;
            }
        } else {
            sc.fill(0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
        }
        write_f16(
            y,
            q2_k::D,
            if max_scale > 0.0 {
                max_scale / Q4SCALE
            } else {
                0.0
            },
        );
        write_f16(
            y,
            q2_k::DMIN,
            if max_min > 0.0 {
                max_min / Q4SCALE
            } else {
                0.0
            },
        );
        let d_all = read_f16(y, q2_k::D);
        let dmin_all = read_f16(y, q2_k::DMIN);
        for j in 0..16 {
            let sc = y[q2_k::SCALES + j];
            let d = d_all * (sc & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * (sc >> 4) as f32;
            for ii in 0..16 {
                let l = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3);
                l_vals[16 * j + ii] = l as u8;
            }
        }
        pack_2bit(&l_vals, &mut y[q2_k::QS..q2_k::QS + 64]);
    }
}

pub fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q3_k::SIZE)) {
        let mut l_signed = [0i8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut amax = 0.0f32;
        for j in 0..16 {
            scales[j] = make_q3_quants(
                &x[16 * j..16 * j + 16],
                4,
                &mut l_signed[16 * j..16 * j + 16],
            );
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        y[q3_k::SCALES..q3_k::SCALES + 12].fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                // C stores `nearest_int` into an int8_t first; the wrap is part of the format.
                let l = nearest_int(iscale * scales[j]) as i8;
                let l = (l.clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    y[q3_k::SCALES + j] = l & 0xF;
                } else {
                    y[q3_k::SCALES + j - 8] |= (l & 0xF) << 4;
                }
                y[q3_k::SCALES + 8 + j % 4] |= (l >> 4) << (2 * (j / 4));
            }
            write_f16(y, q3_k::D, 1.0 / iscale);
        } else {
            write_f16(y, q3_k::D, 0.0);
        }
        let d_all = read_f16(y, q3_k::D);
        let sc = q3k_scales(&y[q3_k::SCALES..q3_k::SCALES + 12]);
        let mut l_vals = [0u8; QK_K];
        for (o, &l) in l_vals.iter_mut().zip(&l_signed) {
            *o = l as u8;
        }
        for j in 0..16 {
            let d = d_all * sc[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let l = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
                l_vals[16 * j + ii] = (l + 4) as u8;
            }
        }
        let hmask = &mut y[q3_k::HMASK..q3_k::HMASK + 32];
        hmask.fill(0);
        let mut m = 0usize;
        let mut hm = 1u8;
        for l in l_vals.iter_mut() {
            if *l > 3 {
                hmask[m] |= hm;
                *l -= 4;
            }
            m += 1;
            if m == QK_K / 8 {
                m = 0;
                hm <<= 1;
            }
        }
        pack_2bit(&l_vals, &mut y[q3_k::QS..q3_k::QS + 64]);
    }
}

/// Shared by Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
/// Returns the quants (0..=nmax) and writes d, dmin and the packed scales into `y`.
fn quantize_k4_common(x: &[f32], nmax: i32, rmin: f32, nstep: i32, y: &mut [u8]) -> [u8; QK_K] {
    // Q4_K and Q5_K share the header layout: d at 0, dmin at 2, 12 scale bytes at 4.
    let mut l_vals = [0u8; QK_K];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2: f32 = xs.iter().map(|v| v * v).sum();
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + xs[l].abs());
        let (scale, min) = make_qkx2_quants(
            xs,
            &weights,
            nmax,
            &mut l_vals[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut y[q4_k::SCALES..q4_k::SCALES + 12];
    sc.fill(0);
    for j in 0..8 {
        // C stores `nearest_int` into a uint8_t before clamping; keep the same wrap.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    write_f16(y, q4_k::D, max_scale / 63.0);
    write_f16(y, q4_k::DMIN, max_min / 63.0);
    let d_all = read_f16(y, q4_k::D);
    let dmin_all = read_f16(y, q4_k::DMIN);
    let (sc, mn) = k4_scales_mins(&y[q4_k::SCALES..q4_k::SCALES + 12]);
    for j in 0..8 {
        let d = d_all * sc[j] as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * mn[j] as f32;
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l_vals[32 * j + ii] = l as u8;
        }
    }
    l_vals
}

pub fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q4_k::SIZE)) {
        let l_vals = quantize_k4_common(x, 15, -1.0, 20, y);
        let qs = &mut y[q4_k::QS..q4_k::QS + 128];
        for (c, j) in (0..QK_K).step_by(64).enumerate() {
            for l in 0..32 {
                qs[32 * c + l] = l_vals[j + l] | (l_vals[j + l + 32] << 4);
            }
        }
    }
}

pub fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q5_k::SIZE)) {
        let l_vals = quantize_k4_common(x, 31, -0.5, 15, y);
        let mut qh = [0u8; 32];
        let mut m1 = 1u8;
        let mut m2 = 2u8;
        for (c, n) in (0..QK_K).step_by(64).enumerate() {
            for j in 0..32 {
                let mut l1 = l_vals[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = l_vals[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                y[q5_k::QS + 32 * c + j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
        y[q5_k::QH..q5_k::QH + 32].copy_from_slice(&qh);
    }
}

pub fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q6_k::SIZE)) {
        let mut l_signed = [0i8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..16 {
            let scale = make_qx_quants(
                &x[16 * ib..16 * ib + 16],
                32,
                &mut l_signed[16 * ib..16 * ib + 16],
            );
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            y.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        write_f16(y, q6_k::D, 1.0 / iscale);
        for ib in 0..16 {
            y[q6_k::SCALES + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
        }
        let d_all = read_f16(y, q6_k::D);
        let mut l_vals = [0u8; QK_K];
        for (o, &l) in l_vals.iter_mut().zip(&l_signed) {
            *o = l as u8;
        }
        for j in 0..16 {
            let d = d_all * (y[q6_k::SCALES + j] as i8) as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let l = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l_vals[16 * j + ii] = (l + 32) as u8;
            }
        }
        for (c, j) in (0..QK_K).step_by(128).enumerate() {
            for l in 0..32 {
                let q1 = l_vals[j + l] & 0xF;
                let q2 = l_vals[j + l + 32] & 0xF;
                let q3 = l_vals[j + l + 64] & 0xF;
                let q4 = l_vals[j + l + 96] & 0xF;
                y[q6_k::QL + 64 * c + l] = q1 | (q3 << 4);
                y[q6_k::QL + 64 * c + l + 32] = q2 | (q4 << 4);
                y[q6_k::QH + 32 * c + l] = (l_vals[j + l] >> 4)
                    | ((l_vals[j + l + 32] >> 4) << 2)
                    | ((l_vals[j + l + 64] >> 4) << 4)
                    | ((l_vals[j + l + 96] >> 4) << 6);
            }
        }
    }
}

/// GGML's `quantize_row_q8_K_ref`. Unlike GGML, an all-zero block also gets zero `bsums`
/// (GGML leaves whatever the buffer held; every reader multiplies them by `d == 0`).
pub fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q8_k::SIZE)) {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y[q8_k::QS..q8_k::QS + QK_K].iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let sum: i32 = y[q8_k::QS + 16 * j..q8_k::QS + 16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            let o = q8_k::BSUMS + 2 * j;
            y[o..o + 2].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        y[q8_k::D..q8_k::D + 4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// The 256 quants of a Q2_K block as values 0..=3, in element order.
#[inline(always)]
pub fn q2k_values(x: &[u8]) -> [u8; QK_K] {
    let qs = &x[q2_k::QS..q2_k::QS + 64];
    let mut out = [0u8; QK_K];
    for half in 0..2 {
        for shift in 0..4 {
            for l in 0..32 {
                out[128 * half + 32 * shift + l] = (qs[32 * half + l] >> (2 * shift)) & 3;
            }
        }
    }
    out
}

/// The 256 quants of a Q3_K block as signed values -4..=3, in element order.
#[inline(always)]
pub fn q3k_values(x: &[u8]) -> [i8; QK_K] {
    let qs = &x[q3_k::QS..q3_k::QS + 64];
    let hm = &x[q3_k::HMASK..q3_k::HMASK + 32];
    let mut out = [0i8; QK_K];
    for half in 0..2 {
        for shift in 0..4 {
            let bit = 1u8 << (4 * half + shift);
            for l in 0..32 {
                let low = ((qs[32 * half + l] >> (2 * shift)) & 3) as i8;
                let high = if hm[l] & bit != 0 { 0 } else { 4 };
                out[128 * half + 32 * shift + l] = low - high;
            }
        }
    }
    out
}

/// The 256 quants of a Q4_K block (0..=15) or Q5_K block (0..=31), in element order.
#[inline(always)]
pub fn k4_values(x: &[u8], qs_offset: usize, qh_offset: Option<usize>) -> [u8; QK_K] {
    let mut out = [0u8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            let q = x[qs_offset + 32 * c + l];
            let (mut lo, mut hi) = (q & 0xF, q >> 4);
            if let Some(qh) = qh_offset {
                let h = x[qh + l];
                lo |= ((h >> (2 * c)) & 1) << 4;
                hi |= ((h >> (2 * c + 1)) & 1) << 4;
            }
            out[64 * c + l] = lo;
            out[64 * c + 32 + l] = hi;
        }
    }
    out
}

/// The 256 quants of a Q6_K block as signed values -32..=31, in element order.
#[inline(always)]
pub fn q6k_values(x: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    for c in 0..2 {
        let ql = &x[q6_k::QL + 64 * c..];
        let qh = &x[q6_k::QH + 32 * c..];
        for l in 0..32 {
            let h = qh[l];
            out[128 * c + l] = ((ql[l] & 0xF) | ((h & 3) << 4)) as i8 - 32;
            out[128 * c + l + 32] = ((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) as i8 - 32;
            out[128 * c + l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            out[128 * c + l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    out
}

pub fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q2_k::SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = read_f16(x, q2_k::D);
        let min = read_f16(x, q2_k::DMIN);
        let q = q2k_values(x);
        for (sub, (ys, qs)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let sc = x[q2_k::SCALES + sub];
            let dl = d * (sc & 0xF) as f32;
            let ml = min * (sc >> 4) as f32;
            for (o, &v) in ys.iter_mut().zip(qs) {
                *o = dl * v as f32 - ml;
            }
        }
    }
}

pub fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q3_k::SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d_all = read_f16(x, q3_k::D);
        let sc = q3k_scales(&x[q3_k::SCALES..q3_k::SCALES + 12]);
        let q = q3k_values(x);
        for (sub, (ys, qs)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d_all * sc[sub] as f32;
            for (o, &v) in ys.iter_mut().zip(qs) {
                *o = dl * v as f32;
            }
        }
    }
}

fn dequantize_k4(src: &[u8], dst: &mut [f32], size: usize, qs: usize, qh: Option<usize>) {
    for (x, y) in src.chunks_exact(size).zip(dst.chunks_exact_mut(QK_K)) {
        let d = read_f16(x, q4_k::D);
        let min = read_f16(x, q4_k::DMIN);
        let (sc, mn) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        let q = k4_values(x, qs, qh);
        for (sub, (ys, qv)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let d1 = d * sc[sub] as f32;
            let m1 = min * mn[sub] as f32;
            for (o, &v) in ys.iter_mut().zip(qv) {
                *o = d1 * v as f32 - m1;
            }
        }
    }
}

pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    dequantize_k4(src, dst, q4_k::SIZE, q4_k::QS, None);
}

pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    dequantize_k4(src, dst, q5_k::SIZE, q5_k::QS, Some(q5_k::QH));
}

pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q6_k::SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = read_f16(x, q6_k::D);
        let q = q6k_values(x);
        for (sub, (ys, qv)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let sc = x[q6_k::SCALES + sub] as i8 as f32;
            for (o, &v) in ys.iter_mut().zip(qv) {
                *o = d * sc * v as f32;
            }
        }
    }
}

pub fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (x, y) in src.chunks_exact(q8_k::SIZE).zip(dst.chunks_exact_mut(QK_K)) {
        let d = read_f32(x, q8_k::D);
        for (o, &q) in y.iter_mut().zip(&x[q8_k::QS..q8_k::QS + QK_K]) {
            *o = d * q as i8 as f32;
        }
    }
}

/// Sum over sub-blocks of `scale[sub] * dot(q[sub], a[sub])`, all in integers.
#[inline(always)]
fn scaled_isum<const SUB: usize>(q: &[i32; QK_K], a: &[u8], scales: &[i32]) -> i32 {
    let mut isum = 0i32;
    for (sub, &sc) in scales.iter().enumerate() {
        let mut s = 0i32;
        for l in 0..SUB {
            s += q[SUB * sub + l] * (a[SUB * sub + l] as i8 as i32);
        }
        isum += sc * s;
    }
    isum
}

/// The integer parts of one K-quant block against one Q8_K block: `(isum, msum)` so that the
/// block's dot product is `d * d8 * isum - dmin * d8 * msum`. The SIMD paths must reproduce them.
pub fn block_isums(ty: crate::GgmlType, x: &[u8], y: &[u8]) -> (i32, i32) {
    use crate::GgmlType;
    let a = &y[q8_k::QS..q8_k::QS + QK_K];
    let bsum = |i: usize| q8k_bsum(y, i) as i32;
    match ty {
        GgmlType::Q2_K => {
            let v = q2k_values(x);
            let q: [i32; QK_K] = std::array::from_fn(|i| v[i] as i32);
            let sc: [i32; 16] = std::array::from_fn(|j| (x[q2_k::SCALES + j] & 0xF) as i32);
            let msum = (0..16)
                .map(|j| (x[q2_k::SCALES + j] >> 4) as i32 * bsum(j))
                .sum();
            (scaled_isum::<16>(&q, a, &sc), msum)
        }
        GgmlType::Q3_K => {
            let v = q3k_values(x);
            let q: [i32; QK_K] = std::array::from_fn(|i| v[i] as i32);
            let s = q3k_scales(&x[q3_k::SCALES..q3_k::SCALES + 12]);
            let sc: [i32; 16] = std::array::from_fn(|j| s[j] as i32);
            (scaled_isum::<16>(&q, a, &sc), 0)
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let v = if ty == GgmlType::Q4_K {
                k4_values(x, q4_k::QS, None)
            } else {
                k4_values(x, q5_k::QS, Some(q5_k::QH))
            };
            let q: [i32; QK_K] = std::array::from_fn(|i| v[i] as i32);
            let (s, m) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
            let sc: [i32; 8] = std::array::from_fn(|j| s[j] as i32);
            let msum = (0..8)
                .map(|j| m[j] as i32 * (bsum(2 * j) + bsum(2 * j + 1)))
                .sum();
            (scaled_isum::<32>(&q, a, &sc), msum)
        }
        GgmlType::Q6_K => {
            let v = q6k_values(x);
            let q: [i32; QK_K] = std::array::from_fn(|i| v[i] as i32);
            let sc: [i32; 16] = std::array::from_fn(|j| x[q6_k::SCALES + j] as i8 as i32);
            (scaled_isum::<16>(&q, a, &sc), 0)
        }
        _ => (0, 0),
    }
}

/// `d` and `dmin` of a K-quant block (Q3_K and Q6_K have no min).
#[inline(always)]
pub fn block_scales(ty: crate::GgmlType, x: &[u8]) -> (f32, f32) {
    use crate::GgmlType;
    match ty {
        GgmlType::Q2_K => (read_f16(x, q2_k::D), read_f16(x, q2_k::DMIN)),
        GgmlType::Q3_K => (read_f16(x, q3_k::D), 0.0),
        GgmlType::Q4_K | GgmlType::Q5_K => (read_f16(x, q4_k::D), read_f16(x, q4_k::DMIN)),
        GgmlType::Q6_K => (read_f16(x, q6_k::D), 0.0),
        _ => (0.0, 0.0),
    }
}

/// `ggml_vec_dot_<K-quant>_q8_K`: per block `d8 * d * isum - d8 * dmin * msum`.
pub fn vec_dot_k_q8_k(ty: crate::GgmlType, w: &[u8], a: &[u8]) -> f32 {
    let size = ty.type_size();
    let mut sumf = 0.0f32;
    for (x, y) in w.chunks_exact(size).zip(a.chunks_exact(q8_k::SIZE)) {
        let (isum, msum) = block_isums(ty, x, y);
        let d8 = read_f32(y, q8_k::D);
        let (d, dmin) = block_scales(ty, x);
        sumf += d8 * d * isum as f32 - d8 * dmin * msum as f32;
    }
    sumf
}
