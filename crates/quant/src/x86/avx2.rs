//! AVX2 (+FMA, F16C) dot products, one per weight format: the SIMD twins of
//! `scalar::legacy` and `scalar::kquants`.
//!
//! Integer parts are computed exactly as the scalar reference computes them (same per-block
//! integer sums); only the order of the float accumulation differs. Signed-by-signed byte
//! products use `maddubs` on |x| and sign(y, x), the usual AVX2 idiom; unsigned weights go
//! straight into `maddubs`, whose i16 pair sums cannot saturate for values below 129.
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`; callers must have
//! checked the CPU (see `simd::level`).

use std::arch::x86_64::*;

use crate::blocks::{
    k4_scales_mins, q2_k, q3_k, q3k_scales, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0, q8_1,
    q8_k, QK_K,
};

/// Loads 32 bytes from the start of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn load32(b: &[u8]) -> __m256i {
    let b = &b[..32];
    // SAFETY: `b` holds 32 readable bytes; the load has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// Loads 16 bytes from the start of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn load16(b: &[u8]) -> __m128i {
    let b = &b[..16];
    // SAFETY: `b` holds 16 readable bytes; the load has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// Reads a little-endian f16 at `offset` as f32 with F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f16_at(b: &[u8], offset: usize) -> f32 {
    let bits = u16::from_le_bytes([b[offset], b[offset + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Bit j of `bits` to byte j: 0xFF where set, 0 where clear.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn bytes_from_bits(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let v = _mm256_shuffle_epi8(v, spread);
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select)
}

/// Σ x·y over 32 signed bytes, as 8 i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// Σ x·y over 32 bytes, x unsigned below 129 and y signed, as 8 i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_u8i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Reads a little-endian f16 through a raw pointer.
///
/// # Safety
/// `p` must point at 2 readable bytes; the CPU must have F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_ptr(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// One legacy block's contribution: the combined scale `d_w·d_a` (broadcast), its 8 lane sums
/// as f32, and for formats with a min the pair `[m, s]` (weight min, activation `d·Σq`),
/// `[0, 0]` otherwise.
type BlockTerms = (__m256, __m256, [f32; 2]);

/// The dot product loop shared by the legacy formats, in the order of GGML's x86 kernels
/// (`ggml_vec_dot_q4_1_q8_1` and its siblings in `arch/x86/quants.c`): one 8-lane accumulator
/// updated by one FMA per block, the min terms summed by a scalar FMA chain, and the lanes
/// reduced as `hsum_float_8` does. llama.cpp's outputs carry exactly this rounding, and the
/// models amplify an ulp of difference, so the order is part of the contract.
///
/// # Safety
/// `block` must be sound to call on every pair of block pointers of `w` and `a` (the slices
/// hold `nb` blocks of `w_size` and `a_size` bytes, which is checked here) and the CPU must
/// have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_loop(
    w: &[u8],
    a: &[u8],
    w_size: usize,
    a_size: usize,
    block: unsafe fn(*const u8, *const u8) -> BlockTerms,
) -> f32 {
    let nb = (w.len() / w_size).min(a.len() / a_size);
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for i in 0..nb {
        // SAFETY: i < nb, so each block pointer has a whole block behind it.
        let (d, p, [m, s]) = unsafe { block(wp.add(i * w_size), ap.add(i * a_size)) };
        acc = _mm256_fmadd_ps(d, p, acc);
        summs = m.mul_add(s, summs);
    }
    hsum_ps(acc) + summs
}

/// # Safety
/// `x` and `y` point at whole blocks; the CPU has AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q4_0(x: *const u8, y: *const u8) -> BlockTerms {
    // SAFETY: whole blocks behind `x` (18 bytes) and `y` (34 bytes), per the contract.
    unsafe {
        let d = _mm256_set1_ps(f16_ptr(x) * f16_ptr(y));
        let t = _mm_loadu_si128(x.add(q4_0::QS).cast());
        let q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(t), t),
            _mm256_set1_epi8(0xF),
        );
        let q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        let yv = _mm256_loadu_si256(y.add(q8_0::QS).cast());
        (d, _mm256_cvtepi32_ps(dot_i8(q, yv)), [0.0; 2])
    }
}

/// # Safety
/// As [`block_q4_0`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q4_1(x: *const u8, y: *const u8) -> BlockTerms {
    // SAFETY: whole blocks behind `x` (20 bytes) and `y` (36 bytes), per the contract.
    unsafe {
        let d = _mm256_set1_ps(f16_ptr(x) * f16_ptr(y));
        let ms = [f16_ptr(x.add(q4_1::M)), f16_ptr(y.add(q8_1::S))];
        let t = _mm_loadu_si128(x.add(q4_1::QS).cast());
        let q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(t), t),
            _mm256_set1_epi8(0xF),
        );
        let yv = _mm256_loadu_si256(y.add(q8_1::QS).cast());
        (d, _mm256_cvtepi32_ps(dot_u8i8(q, yv)), ms)
    }
}

/// # Safety
/// As [`block_q4_0`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q5_0(x: *const u8, y: *const u8) -> BlockTerms {
    // SAFETY: whole blocks behind `x` (22 bytes) and `y` (34 bytes), per the contract.
    unsafe {
        let d = _mm256_set1_ps(f16_ptr(x) * f16_ptr(y));
        let qh = x.add(q5_0::QH).cast::<u32>().read_unaligned();
        let high = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
        let t = _mm_loadu_si128(x.add(q5_0::QS).cast());
        let q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(t), t),
            _mm256_set1_epi8(0xF),
        );
        let q = _mm256_sub_epi8(_mm256_or_si256(q, high), _mm256_set1_epi8(16));
        let yv = _mm256_loadu_si256(y.add(q8_0::QS).cast());
        (d, _mm256_cvtepi32_ps(dot_i8(q, yv)), [0.0; 2])
    }
}

/// # Safety
/// As [`block_q4_0`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q5_1(x: *const u8, y: *const u8) -> BlockTerms {
    // SAFETY: whole blocks behind `x` (24 bytes) and `y` (36 bytes), per the contract.
    unsafe {
        let d = _mm256_set1_ps(f16_ptr(x) * f16_ptr(y));
        let ms = [f16_ptr(x.add(q5_1::M)), f16_ptr(y.add(q8_1::S))];
        let qh = x.add(q5_1::QH).cast::<u32>().read_unaligned();
        let high = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
        let t = _mm_loadu_si128(x.add(q5_1::QS).cast());
        let q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(t), t),
            _mm256_set1_epi8(0xF),
        );
        let q = _mm256_or_si256(q, high);
        let yv = _mm256_loadu_si256(y.add(q8_1::QS).cast());
        (d, _mm256_cvtepi32_ps(dot_u8i8(q, yv)), ms)
    }
}

/// # Safety
/// As [`block_q4_0`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q8_0(x: *const u8, y: *const u8) -> BlockTerms {
    // SAFETY: whole blocks behind `x` and `y` (34 bytes each), per the contract.
    unsafe {
        let d = _mm256_set1_ps(f16_ptr(x) * f16_ptr(y));
        let xv = _mm256_loadu_si256(x.add(q8_0::QS).cast());
        let yv = _mm256_loadu_si256(y.add(q8_0::QS).cast());
        (d, _mm256_cvtepi32_ps(dot_i8(xv, yv)), [0.0; 2])
    }
}

/// Q8_0 or Q8_1 activations with GGML's run-time quantizer (`scalar::legacy::
/// quantize_block_q8_runtime`), eight elements per instruction, bit for bit the scalar results:
/// the absolute maximum is exact in any order (`maxps` with the running maximum second skips a
/// NaN as `f32::max` does), `d` and the multiplier are the same scalar divisions, the products
/// the same multiplications, `roundps` rounds half to even as `round_ties_even` does, and NaN
/// and out-of-range products are sent where Rust's saturating `as i8` sends them (0, -128,
/// 127) before the exact conversion. Q8_1's `s` is the exact integer sum times `d`, as there.
/// Q8_K goes to [`quantize_q8_k`]. Returns whether `ty` was one of the three.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn quantize_q8_activations(ty: crate::GgmlType, src: &[f32], dst: &mut [u8]) -> bool {
    let (size, qs) = match ty {
        crate::GgmlType::Q8_0 => (q8_0::SIZE, q8_0::QS),
        crate::GgmlType::Q8_1 => (q8_1::SIZE, q8_1::QS),
        crate::GgmlType::Q8_K => {
            quantize_q8_k(src, dst);
            return true;
        }
        _ => return false,
    };
    let (lowest, highest) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(size)) {
        // SAFETY: 8 readable floats at each offset of the 32-element block; unaligned loads.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x[8 * i..8 * i + 8].as_ptr()) });
        let amax = abs_max(&v);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v[i], id),
            );
            // NaN to +0, then the saturating cast's range.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lowest), highest))
        });
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let out = &mut y[qs..qs + 32];
        // SAFETY: 32 writable bytes; unaligned store.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes) };
        crate::blocks::write_f16(y, 0, d);
        if size == q8_1::SIZE {
            let sum = hsum_epi32(_mm256_add_epi32(
                _mm256_add_epi32(q[0], q[1]),
                _mm256_add_epi32(q[2], q[3]),
            ));
            crate::blocks::write_f16(y, q8_1::S, sum as f32 * d);
        }
    }
    true
}

/// The largest absolute value of `v`'s lanes (`max` drops a NaN lane in favour of the running
/// maximum, as the quantizers' scalar loops skip NaNs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn abs_max(v: &[__m256]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for &vi in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// Q8_K activations (`scalar::kquants::quantize_q8_k`, GGML's `quantize_row_q8_K_ref`), eight
/// elements per instruction, bit for bit the scalar results: the absolute maximum as in
/// [`quantize_q8_activations`] (NaNs skipped), the signed maximum taken from the first element
/// whose absolute value equals it (the scalar loop keeps the first of equals), the same scalar
/// `iscale`, the same products, and `nearest_int`'s magic-number rounding done on the same bits
/// (so NaN and infinite products land where the scalar code sends them). The quants are within
/// [-128, 127] (|product| <= 127 up to rounding, and NaN bits give 0..=0x3fffff before the
/// `min(127)`), so saturating packs are the scalar `as i8`; `bsums` are exact integer sums.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let sign = _mm256_set1_ps(-0.0);
    let magic = _mm256_set1_ps(12_582_912.0);
    let (mantissa, half) = (
        _mm256_set1_epi32(0x007f_ffff),
        _mm256_set1_epi32(0x0040_0000),
    );
    let top = _mm256_set1_epi32(127);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(q8_k::SIZE)) {
        // SAFETY: 8 readable floats at each offset of the 256-element block; unaligned loads.
        let v: [__m256; 32] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x[8 * i..8 * i + 8].as_ptr()) });
        let amax = abs_max(&v);
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        let target = _mm256_set1_ps(amax);
        let first = v
            .iter()
            .enumerate()
            .find_map(|(i, vi)| {
                let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, *vi), target);
                let bits = _mm256_movemask_ps(eq);
                (bits != 0).then(|| 8 * i + bits.trailing_zeros() as usize)
            })
            .expect("the absolute maximum is one of the block's values");
        let iscale = -127.0 / x[first];
        let scale = _mm256_set1_ps(iscale);
        let q: [__m256i; 32] = std::array::from_fn(|i| {
            let val = _mm256_add_ps(_mm256_mul_ps(scale, v[i]), magic);
            let n = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(val), mantissa), half);
            _mm256_min_epi32(n, top)
        });
        for c in 0..8 {
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(q[4 * c], q[4 * c + 1]),
                _mm256_packs_epi32(q[4 * c + 2], q[4 * c + 3]),
            );
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let out = &mut y[q8_k::QS + 32 * c..q8_k::QS + 32 * c + 32];
            // SAFETY: 32 writable bytes; unaligned store.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes) };
        }
        for j in 0..16 {
            let sum = hsum_epi32(_mm256_add_epi32(q[2 * j], q[2 * j + 1]));
            let o = q8_k::BSUMS + 2 * j;
            y[o..o + 2].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        y[q8_k::D..q8_k::D + 4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: `legacy_loop` passes whole blocks of these sizes; this CPU has the features.
    unsafe { legacy_loop(w, a, q4_0::SIZE, q8_0::SIZE, block_q4_0) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: `legacy_loop` passes whole blocks of these sizes; this CPU has the features.
    unsafe { legacy_loop(w, a, q4_1::SIZE, q8_1::SIZE, block_q4_1) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: `legacy_loop` passes whole blocks of these sizes; this CPU has the features.
    unsafe { legacy_loop(w, a, q5_0::SIZE, q8_0::SIZE, block_q5_0) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q5_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: `legacy_loop` passes whole blocks of these sizes; this CPU has the features.
    unsafe { legacy_loop(w, a, q5_1::SIZE, q8_1::SIZE, block_q5_1) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: `legacy_loop` passes whole blocks of these sizes; this CPU has the features.
    unsafe { legacy_loop(w, a, q8_0::SIZE, q8_0::SIZE, block_q8_0) }
}

/// The 16 i16 block sums of a Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8k_bsums(y: &[u8]) -> __m256i {
    load32(&y[q8_k::BSUMS..])
}

/// i16 vector with `lo` in elements 0..8 and `hi` in 8..16: the scales of two 16-element
/// sub-blocks after `maddubs` of 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q2_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    let mask3 = _mm256_set1_epi8(3);
    for (x, y) in w.chunks_exact(q2_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let sc = &x[q2_k::SCALES..q2_k::SCALES + 16];
        let mins: [i16; 16] = std::array::from_fn(|j| (sc[j] >> 4) as i16);
        // SAFETY: `mins` is 16 i16 = 32 readable bytes; unaligned load.
        let mins_v = unsafe { _mm256_loadu_si256(mins.as_ptr().cast()) };
        let msum = hsum_epi32(_mm256_madd_epi16(mins_v, q8k_bsums(y)));
        let mut isum = _mm256_setzero_si256();
        for half in 0..2 {
            let q = load32(&x[q2_k::QS + 32 * half..]);
            for shift in 0..4 {
                let v = match shift {
                    0 => q,
                    1 => _mm256_srli_epi16::<2>(q),
                    2 => _mm256_srli_epi16::<4>(q),
                    _ => _mm256_srli_epi16::<6>(q),
                };
                let v = _mm256_and_si256(v, mask3);
                let e = 128 * half + 32 * shift;
                let yv = load32(&y[q8_k::QS + e..]);
                let s = e / 16;
                let scales = scale_pair((sc[s] & 0xF) as i16, (sc[s + 1] & 0xF) as i16);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, yv), scales);
                isum = _mm256_add_epi32(isum, p);
            }
        }
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let d = f16_at(x, q2_k::D);
        let dmin = f16_at(x, q2_k::DMIN);
        sumf += d8 * d * hsum_epi32(isum) as f32 - d8 * dmin * msum as f32;
    }
    sumf
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q3_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    let mask3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    for (x, y) in w.chunks_exact(q3_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let sc = q3k_scales(&x[q3_k::SCALES..q3_k::SCALES + 12]);
        let hm = load32(&x[q3_k::HMASK..]);
        let mut isum = _mm256_setzero_si256();
        for half in 0..2 {
            let q = load32(&x[q3_k::QS + 32 * half..]);
            for shift in 0..4 {
                let v = match shift {
                    0 => q,
                    1 => _mm256_srli_epi16::<2>(q),
                    2 => _mm256_srli_epi16::<4>(q),
                    _ => _mm256_srli_epi16::<6>(q),
                };
                let low = _mm256_and_si256(v, mask3);
                // High bit set means the value is low, clear means low - 4; store value + 4,
                // which is low + 4·bit, as an unsigned byte.
                let bit = _mm256_set1_epi8((1u8 << (4 * half + shift)) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                let value4 = _mm256_or_si256(low, _mm256_and_si256(set, four));
                let e = 128 * half + 32 * shift;
                let yv = load32(&y[q8_k::QS + e..]);
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(value4, yv),
                    _mm256_maddubs_epi16(four, yv),
                );
                let s = e / 16;
                let p = _mm256_madd_epi16(p, scale_pair(sc[s] as i16, sc[s + 1] as i16));
                isum = _mm256_add_epi32(isum, p);
            }
        }
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        sumf += d8 * f16_at(x, q3_k::D) * hsum_epi32(isum) as f32;
    }
    sumf
}

/// Q4_K and Q5_K share everything but the fifth bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn vec_dot_k4<const FIVE: bool>(w: &[u8], a: &[u8]) -> f32 {
    let size = if FIVE { q5_k::SIZE } else { q4_k::SIZE };
    let qs_off = if FIVE { q5_k::QS } else { q4_k::QS };
    let mut sumf = 0.0f32;
    let low = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    for (x, y) in w.chunks_exact(size).zip(a.chunks_exact(q8_k::SIZE)) {
        let (sc, mn) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        let mins: [i16; 16] = std::array::from_fn(|j| mn[j / 2] as i16);
        // SAFETY: `mins` is 16 i16 = 32 readable bytes; unaligned load.
        let mins_v = unsafe { _mm256_loadu_si256(mins.as_ptr().cast()) };
        let msum = hsum_epi32(_mm256_madd_epi16(mins_v, q8k_bsums(y)));
        let qh = if FIVE {
            load32(&x[q5_k::QH..])
        } else {
            _mm256_setzero_si256()
        };
        let mut isum = _mm256_setzero_si256();
        for c in 0..4 {
            let q = load32(&x[qs_off + 32 * c..]);
            let mut lo = _mm256_and_si256(q, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
            if FIVE {
                let hbits = _mm256_srlv_epi32(qh, _mm256_set1_epi32(2 * c as i32));
                let h_lo = _mm256_and_si256(hbits, one);
                let h_hi = _mm256_and_si256(_mm256_srli_epi16::<1>(hbits), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(h_lo));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h_hi));
            }
            let y0 = load32(&y[q8_k::QS + 64 * c..]);
            let y1 = load32(&y[q8_k::QS + 64 * c + 32..]);
            let p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, y0),
                _mm256_set1_epi16(sc[2 * c] as i16),
            );
            let p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, y1),
                _mm256_set1_epi16(sc[2 * c + 1] as i16),
            );
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
        }
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let d = f16_at(x, q4_k::D);
        let dmin = f16_at(x, q4_k::DMIN);
        sumf += d8 * d * hsum_epi32(isum) as f32 - d8 * dmin * msum as f32;
    }
    sumf
}

/// Q4_K in GGML's order (`ggml_vec_dot_q4_K_q8_K`, AVX2): per super-block the 8 integer lane
/// sums are fused into one accumulator with `d_a·d_w`, and the min terms, four lanes of
/// `min·Σa` pairs, into a second one with `-d_a·dmin_w`; the min lanes are reduced as
/// `(m0 + m2) + (m1 + m3)` and added to `hsum_float_8` of the first.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q4_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (x, y) in w.chunks_exact(q4_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let d = d8 * f16_at(x, q4_k::D);
        let dmin = -d8 * f16_at(x, q4_k::DMIN);
        let (sc, mn) = k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        // Σa over 32 elements: the 16-element sums added in pairs (`hadd`).
        let bs = q8k_bsums(y);
        let q8s = _mm_hadd_epi16(
            _mm256_castsi256_si128(bs),
            _mm256_extracti128_si256::<1>(bs),
        );
        let mins: [i16; 8] = std::array::from_fn(|j| mn[j] as i16);
        // SAFETY: `mins` is 8 i16 = 16 readable bytes; unaligned load.
        let mins_v = unsafe { _mm_loadu_si128(mins.as_ptr().cast()) };
        let prod = _mm_madd_epi16(mins_v, q8s);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        let mut isum = _mm256_setzero_si256();
        for j in 0..4 {
            let q = load32(&x[q4_k::QS + 32 * j..]);
            let lo = _mm256_and_si256(q, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
            let pl = _mm256_madd_epi16(
                _mm256_set1_epi16(sc[2 * j] as i16),
                _mm256_maddubs_epi16(lo, load32(&y[q8_k::QS + 64 * j..])),
            );
            let ph = _mm256_madd_epi16(
                _mm256_set1_epi16(sc[2 * j + 1] as i16),
                _mm256_maddubs_epi16(hi, load32(&y[q8_k::QS + 64 * j + 32..])),
            );
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum), acc);
    }
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    hsum_ps(acc) + _mm_cvtss_f32(m)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q5_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    vec_dot_k4::<true>(w, a)
}

/// The four 32-element quarters of half `c` (0 or 1) of the Q6_K super-block `x`, as unsigned
/// 6-bit values (low nibbles from `ql`, high bits from `qh`), in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q6k_quarters(x: &[u8], c: usize) -> [__m256i; 4] {
    let low = _mm256_set1_epi8(0x0F);
    let mask2 = _mm256_set1_epi8(3);
    let ql0 = load32(&x[q6_k::QL + 64 * c..]);
    let ql1 = load32(&x[q6_k::QL + 64 * c + 32..]);
    let qh = load32(&x[q6_k::QH + 32 * c..]);
    let h = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, mask2));
    [
        _mm256_or_si256(_mm256_and_si256(ql0, low), h(qh)),
        _mm256_or_si256(_mm256_and_si256(ql1, low), h(_mm256_srli_epi16::<2>(qh))),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low),
            h(_mm256_srli_epi16::<4>(qh)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low),
            h(_mm256_srli_epi16::<6>(qh)),
        ),
    ]
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    // GGML's order (`ggml_vec_dot_q6_K_q8_K`, AVX2): per super-block the 8 lane sums (scales
    // applied in integers) are converted and fused into one accumulator with `d_a·d_w`, and the
    // lanes are reduced once at the end. The weights' -32 offset is not applied value by value:
    // the unsigned 6-bit values are multiplied as they are, and each lane then subtracts
    // `32·(bsum[2l]·scale[2l] + bsum[2l+1]·scale[2l+1])` (the activations' 16-element sums
    // against the weight scales, `madd` lane `l`), so every lane holds a different integer
    // than an offset-first order would give, and the lanes round differently when converted.
    // Checked bit for bit against a llama.cpp build (2026-10, AVX2) tensor by tensor.
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.chunks_exact(q6_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        // A decode step calls this for consecutive rows: stream the weights in ahead, into the
        // rows that follow.
        super::prefetch_ahead(x.as_ptr(), q6_k::SIZE);
        let sc = &x[q6_k::SCALES..q6_k::SCALES + 16];
        let mut isum = _mm256_setzero_si256();
        for c in 0..2 {
            let quarters = q6k_quarters(x, c);
            for (k, q) in quarters.into_iter().enumerate() {
                let e = 128 * c + 32 * k;
                let yv = load32(&y[q8_k::QS + e..]);
                let p = _mm256_maddubs_epi16(q, yv);
                let s = e / 16;
                let p =
                    _mm256_madd_epi16(p, scale_pair(sc[s] as i8 as i16, sc[s + 1] as i8 as i16));
                isum = _mm256_add_epi32(isum, p);
            }
        }
        let mut scales = [0u8; 32];
        scales[..16].copy_from_slice(sc);
        let scales16 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(load32(&scales)));
        let bsums = load32(&y[q8_k::BSUMS..]);
        let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales16));
        isum = _mm256_sub_epi32(isum, offset);
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let d = _mm256_set1_ps(d8 * f16_at(x, q6_k::D));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
    }
    hsum_ps(acc)
}

/// One Q6_K row unpacked for several tokens: per super-block, the eight 32-element quarters
/// of unsigned 6-bit values, each quarter's pair of scales as `madd` operands, the 16 scales
/// widened to words (for the offset term) and the row's `d`. [`Q6kRow::dot`] then costs a token
/// about a third of [`vec_dot_q6_k_q8_k`], whose steps it takes on the same values, so its
/// results are that function's bit for bit. One value per job, its buffers reused row to row.
#[derive(Default)]
pub struct Q6kRow {
    quarters: Vec<__m256i>,
    scales: Vec<__m256i>,
    scales16: Vec<__m256i>,
    d: Vec<f32>,
}

impl Q6kRow {
    /// Unpacks the Q6_K row `w` in place of what this value held.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn unpack(&mut self, w: &[u8]) {
        self.quarters.clear();
        self.scales.clear();
        self.scales16.clear();
        self.d.clear();
        for x in w.chunks_exact(q6_k::SIZE) {
            let sc = &x[q6_k::SCALES..q6_k::SCALES + 16];
            for c in 0..2 {
                self.quarters.extend(q6k_quarters(x, c));
                for k in 0..4 {
                    let s = (128 * c + 32 * k) / 16;
                    self.scales
                        .push(scale_pair(sc[s] as i8 as i16, sc[s + 1] as i8 as i16));
                }
            }
            let mut scales = [0u8; 32];
            scales[..16].copy_from_slice(sc);
            self.scales16
                .push(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(load32(
                    &scales,
                ))));
            self.d.push(f16_at(x, q6_k::D));
        }
    }

    /// The unpacked row against the Q8_K activation row `a`: [`vec_dot_q6_k_q8_k`]'s value.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dot(&self, a: &[u8]) -> f32 {
        let nb = self.d.len();
        assert!(a.len() >= nb * q8_k::SIZE);
        assert!(self.quarters.len() == 8 * nb && self.scales.len() == 8 * nb);
        let mut acc = _mm256_setzero_ps();
        for (b, y) in a.chunks_exact(q8_k::SIZE).take(nb).enumerate() {
            let mut isum = _mm256_setzero_si256();
            for k in 0..8 {
                let yv = load32(&y[q8_k::QS + 32 * k..]);
                let p = _mm256_maddubs_epi16(self.quarters[8 * b + k], yv);
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, self.scales[8 * b + k]));
            }
            let bsums = load32(&y[q8_k::BSUMS..]);
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, self.scales16[b]));
            isum = _mm256_sub_epi32(isum, offset);
            let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
            let d = _mm256_set1_ps(d8 * self.d[b]);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
        }
        hsum_ps(acc)
    }
}

/// F16 weights against F16 activations, products and sums in f32 (as GGML's F16C path).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn vec_dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 2];
    let full = n / 8 * 8;
    for (i, base) in (0..full).step_by(8).enumerate() {
        let x = _mm256_cvtph_ps(load16(&w[2 * base..]));
        let y = _mm256_cvtph_ps(load16(&a[2 * base..]));
        acc[i & 1] = _mm256_fmadd_ps(x, y, acc[i & 1]);
    }
    let mut sum = hsum_ps(_mm256_add_ps(acc[0], acc[1]));
    for i in full..n {
        sum += f16_at(w, 2 * i) * f16_at(a, 2 * i);
    }
    sum
}

/// Four rows against one activation row at a time, for the memory-bound matvec: each
/// activation block is loaded once for four rows (contiguous in memory, which the prefetch
/// assumes; any other rows only prefetch in vain), and each row keeps its own accumulator and
/// min chain in the order of [`legacy_loop`] (GGML's), so a row's result is bit for bit the
/// single-row kernel's.
///
/// # Safety
/// Each row of `rows` and `a` must hold `nb` whole blocks of `w_size` and `a_size` bytes (the
/// callers check), and the CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows4<const Q8: bool>(rows: [&[u8]; 4], a: &[u8], nb: usize) -> [f32; 4] {
    let (w_size, a_size) = if Q8 {
        (q8_0::SIZE, q8_0::SIZE)
    } else {
        (q4_1::SIZE, q8_1::SIZE)
    };
    let ap = a.as_ptr();
    let wp: [*const u8; 4] = std::array::from_fn(|r| rows[r].as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    // The four rows' min chains, one lane each: lane-wise FMAs, so each lane is exactly the
    // scalar chain of `legacy_loop`.
    let mut summs = _mm_setzero_ps();
    let low = _mm256_set1_epi8(0xF);
    for c in 0..nb {
        // SAFETY: block c exists in every row and in `a` (c < nb).
        unsafe {
            let y = ap.add(c * a_size);
            let qs_a = if Q8 { q8_0::QS } else { q8_1::QS };
            let yv = _mm256_loadu_si256(y.add(qs_a).cast());
            // [d_y, s_y] (Q8_1) or [d_y, first quants] (Q8_0, lane 1 unused).
            let dsy = _mm_cvtph_ps(_mm_cvtsi32_si128(y.cast::<i32>().read_unaligned()));
            let dy = _mm_broadcastss_ps(dsy);
            let x: [*const u8; 4] = std::array::from_fn(|r| wp[r].add(c * w_size));
            // [d, m] of the four rows (Q4_1), or [d, quants] (Q8_0), in one conversion.
            let dm = _mm256_cvtph_ps(_mm_setr_epi32(
                x[0].cast::<i32>().read_unaligned(),
                x[1].cast::<i32>().read_unaligned(),
                x[2].cast::<i32>().read_unaligned(),
                x[3].cast::<i32>().read_unaligned(),
            ));
            // Lanes 0..4: d of rows 0..4; lanes 4..8: m of rows 0..4.
            let dm = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
            let d4 = _mm_mul_ps(_mm256_castps256_ps128(dm), dy);
            if !Q8 {
                let sy = _mm_shuffle_ps::<0b01_01_01_01>(dsy, dsy);
                summs = _mm_fmadd_ps(_mm256_extractf128_ps::<1>(dm), sy, summs);
            }
            // Rows are short (a few cache lines), too short for the hardware prefetcher to
            // lock on to four interleaved streams; the callers' four rows are contiguous, so
            // stream them in as block c of each is read.
            super::prefetch_ahead(wp[0].wrapping_add(4 * c * w_size), 4 * w_size);
            let d = [
                _mm256_broadcastss_ps(d4),
                _mm256_broadcastss_ps(_mm_shuffle_ps::<0b01_01_01_01>(d4, d4)),
                _mm256_broadcastss_ps(_mm_shuffle_ps::<0b10_10_10_10>(d4, d4)),
                _mm256_broadcastss_ps(_mm_shuffle_ps::<0b11_11_11_11>(d4, d4)),
            ];
            for r in 0..4 {
                let p = if Q8 {
                    dot_i8(_mm256_loadu_si256(x[r].add(q8_0::QS).cast()), yv)
                } else {
                    let t = _mm_loadu_si128(x[r].add(q4_1::QS).cast());
                    let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(t), t), low);
                    dot_u8i8(q, yv)
                };
                acc[r] = _mm256_fmadd_ps(d[r], _mm256_cvtepi32_ps(p), acc[r]);
            }
        }
    }
    let mut m = [0.0f32; 4];
    // SAFETY: `m` holds 4 floats; unaligned store.
    unsafe { _mm_storeu_ps(m.as_mut_ptr(), summs) };
    std::array::from_fn(|r| hsum_ps(acc[r]) + if Q8 { 0.0 } else { m[r] })
}

/// Consecutive rows (whole blocks of `w_size` bytes, as many rows as `out` holds, contiguous
/// in `w`) against one activation row of `a_size`-byte blocks: four rows at a time with
/// [`rows4`] inlined, the last `out.len() % 4` rows with the single-row kernel. One call
/// per thread's share of a matvec, so nothing is dispatched per row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matvec_pairs<const Q8: bool>(w: &[u8], a: &[u8], out: &mut [f32]) {
    let (w_size, a_size) = if Q8 {
        (q8_0::SIZE, q8_0::SIZE)
    } else {
        (q4_1::SIZE, q8_1::SIZE)
    };
    let nb = a.len() / a_size;
    let row_bytes = nb * w_size;
    assert!(w.len() >= out.len() * row_bytes);
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (i, o) in quads.by_ref().enumerate() {
        let base = 4 * i * row_bytes;
        let rows = std::array::from_fn(|k| &w[base + k * row_bytes..base + (k + 1) * row_bytes]);
        // SAFETY: every row holds nb blocks (sliced above); this CPU has the features.
        o.copy_from_slice(&unsafe { rows4::<Q8>(rows, a, nb) });
    }
    for (k, o) in quads.into_remainder().iter_mut().enumerate() {
        let row = &w[(done + k) * row_bytes..(done + k + 1) * row_bytes];
        *o = if Q8 {
            vec_dot_q8_0_q8_0(row, a)
        } else {
            vec_dot_q4_1_q8_1(row, a)
        };
    }
}

/// Consecutive rows of a legacy format (contiguous in `w`, one per element of `out`) against
/// one activation row, four rows at a time: the same columns of four rows are read together
/// (the weights prefetched as one forward stream, as [`rows4`] does), and each row keeps its own chain of
/// [`legacy_loop`]'s steps, so every output is bit for bit that kernel's.
///
/// # Safety
/// `block` must be sound on whole blocks of `w_size` and `a_size` bytes, and the CPU must have
/// AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matvec_legacy(
    w: &[u8],
    a: &[u8],
    out: &mut [f32],
    w_size: usize,
    a_size: usize,
    block: unsafe fn(*const u8, *const u8) -> BlockTerms,
) {
    let nb = a.len() / a_size;
    let row_bytes = nb * w_size;
    assert!(w.len() >= out.len() * row_bytes);
    let ap = a.as_ptr();
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (i, o) in quads.by_ref().enumerate() {
        let base = w[4 * i * row_bytes..].as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0.0f32; 4];
        for c in 0..nb {
            // The group's four rows are contiguous: stream them in as block c of each is read.
            super::prefetch_ahead(base.wrapping_add(4 * c * w_size), 4 * w_size);
            for r in 0..4 {
                // SAFETY: rows 4i..4i+4 each hold nb blocks (asserted above), and c < nb.
                let (d, p, [m, s]) =
                    unsafe { block(base.add(r * row_bytes + c * w_size), ap.add(c * a_size)) };
                acc[r] = _mm256_fmadd_ps(d, p, acc[r]);
                summs[r] = m.mul_add(s, summs[r]);
            }
        }
        for r in 0..4 {
            o[r] = hsum_ps(acc[r]) + summs[r];
        }
    }
    for (k, o) in quads.into_remainder().iter_mut().enumerate() {
        let row = &w[(done + k) * row_bytes..(done + k + 1) * row_bytes];
        // SAFETY: as above.
        *o = unsafe { legacy_loop(row, a, w_size, a_size, block) };
    }
}

/// Q4_0 rows against one Q8_0 activation row (see [`matvec_legacy`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn matvec_q4_0_q8_0(w: &[u8], a: &[u8], out: &mut [f32]) {
    // SAFETY: whole blocks of these sizes; this CPU has the features.
    unsafe { matvec_legacy(w, a, out, q4_0::SIZE, q8_0::SIZE, block_q4_0) }
}

/// Q5_0 rows against one Q8_0 activation row (see [`matvec_legacy`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn matvec_q5_0_q8_0(w: &[u8], a: &[u8], out: &mut [f32]) {
    // SAFETY: whole blocks of these sizes; this CPU has the features.
    unsafe { matvec_legacy(w, a, out, q5_0::SIZE, q8_0::SIZE, block_q5_0) }
}

/// Q5_1 rows against one Q8_1 activation row (see [`matvec_legacy`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn matvec_q5_1_q8_1(w: &[u8], a: &[u8], out: &mut [f32]) {
    // SAFETY: whole blocks of these sizes; this CPU has the features.
    unsafe { matvec_legacy(w, a, out, q5_1::SIZE, q8_1::SIZE, block_q5_1) }
}

/// Q4_1 rows (contiguous in `w`, one per element of `out`) against one Q8_1 activation row
/// (see [`matvec_pairs`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn matvec_q4_1_q8_1(w: &[u8], a: &[u8], out: &mut [f32]) {
    // SAFETY: this CPU has the features.
    unsafe { matvec_pairs::<false>(w, a, out) }
}

/// Q8_0 rows (contiguous in `w`, one per element of `out`) against one Q8_0 activation row
/// (see [`matvec_pairs`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn matvec_q8_0_q8_0(w: &[u8], a: &[u8], out: &mut [f32]) {
    // SAFETY: this CPU has the features.
    unsafe { matvec_pairs::<true>(w, a, out) }
}

/// The 8 six-bit scales and 8 six-bit mins of a Q4_K super-block's 12 scale bytes, as two
/// little-endian u64s holding one value per byte (scales 0..8 and mins 0..8). Bytes 0..4 hold
/// the low 6 bits of scales 0..4 (mins 0..4 in bytes 4..8) and lend their top 2 bits to scales
/// (mins) 4..8, whose low 4 bits are the nibbles of bytes 8..12.
#[inline(always)]
pub(crate) fn k4_scales_mins_u64(b: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (w0, w1, w2) = (word(0), word(4), word(8));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc_lo = w0 & LOW6;
    let mn_lo = w1 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        mn_lo as u64 | (mn_hi as u64) << 32,
    )
}

/// One output of a Q4_K matrix in the order of llama.cpp's repacked x86 kernels (see
/// `repack_order`): weight row `w` against the Q8_K activation row `a`. Per super-block the
/// integer terms are formed in the lanes (sub-block scales by `madd`, the four pairs of
/// sub-blocks reduced together by one `hadd` tree; the min terms as the activations' 32-element
/// sums against the mins, one `madd` lane per pair), then turned into floats pair by pair
/// (`per_pair`, the gemm's steps) or once per super-block (the gemv's).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn q4k_repacked_dot(w: &[u8], a: &[u8], per_pair: bool) -> f32 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    for (x, y) in w.chunks_exact(q4_k::SIZE).zip(a.chunks_exact(q8_k::SIZE)) {
        // A decode step calls this for consecutive rows: stream the weights in ahead, into the
        // rows that follow.
        super::prefetch_ahead(x.as_ptr(), q4_k::SIZE);
        let (sc, mn) = k4_scales_mins_u64(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        let scale_of = |j: usize| ((sc >> (8 * j)) & 0xFF) as i16;
        let pair = |g: usize| {
            let q = load32(&x[q4_k::QS + 32 * g..]);
            let lo = _mm256_and_si256(q, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
            // 4-bit values times i8 stay far inside i16 (|2·15·128| < 2^15): no saturation.
            let pl = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, load32(&y[q8_k::QS + 64 * g..])),
                _mm256_set1_epi16(scale_of(2 * g)),
            );
            let ph = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, load32(&y[q8_k::QS + 64 * g + 32..])),
                _mm256_set1_epi16(scale_of(2 * g + 1)),
            );
            _mm256_add_epi32(pl, ph)
        };
        let (v0, v1, v2, v3) = (pair(0), pair(1), pair(2), pair(3));
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
        let is = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        // The activations' 32-element sums (16-element `bsums` added in pairs, |Σ| ≤ 4096)
        // against the mins widened to i16: lane p is pair p's min term.
        let bs = load32(&y[q8_k::BSUMS..]);
        let bsum32 = _mm_hadd_epi16(
            _mm256_castsi256_si128(bs),
            _mm256_extracti128_si256::<1>(bs),
        );
        let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
        let ms = _mm_madd_epi16(mins, bsum32);
        let d8 = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let scale = f16_at(x, q4_k::D) * d8;
        let scale_min = f16_at(x, q4_k::DMIN) * d8;
        let mut i4 = [0i32; 4];
        let mut m4 = [0i32; 4];
        // SAFETY: each array is 4 i32 = 16 writable bytes; unaligned stores.
        unsafe {
            _mm_storeu_si128(i4.as_mut_ptr().cast(), is);
            _mm_storeu_si128(m4.as_mut_ptr().cast(), ms);
        }
        if per_pair {
            for p in 0..4 {
                acc = (i4[p] as f32).mul_add(scale, acc);
                acc_min = (m4[p] as f32).mul_add(scale_min, acc_min);
            }
        } else {
            let i: i32 = i4.iter().sum();
            let m: i32 = m4.iter().sum();
            acc = (i as f32).mul_add(scale, acc);
            acc_min = (m as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// Super-block `b` of 8 consecutive Q4_K rows (`rows`, contiguous, `row_bytes` each), decoded:
/// `sc[j][r]` and `mn[j][r]` the scale and min of sub-block `j` of row `r`, `d[r]` and `dmin[r]`
/// the row's factors. The eight-row kernel (`q4_k_rows8`) and `avx512`'s lay their vectors out
/// from it.
pub(crate) struct Block8 {
    pub sc: [[i32; 8]; 8],
    pub mn: [[i32; 8]; 8],
    pub d: [f32; 8],
    pub dmin: [f32; 8],
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn block8(rows: &[u8], row_bytes: usize, b: usize) -> Block8 {
    let mut k = Block8 {
        sc: [[0; 8]; 8],
        mn: [[0; 8]; 8],
        d: [0.0; 8],
        dmin: [0.0; 8],
    };
    for r in 0..8 {
        let x = &rows[r * row_bytes + b * q4_k::SIZE..][..q4_k::SIZE];
        let (sc, mn) = k4_scales_mins_u64(&x[q4_k::SCALES..q4_k::SCALES + 12]);
        for j in 0..8 {
            k.sc[j][r] = ((sc >> (8 * j)) & 0xFF) as i32;
            k.mn[j][r] = ((mn >> (8 * j)) & 0xFF) as i32;
        }
        k.d[r] = f16_at(x, q4_k::D);
        k.dmin[r] = f16_at(x, q4_k::DMIN);
    }
    k
}
