//! AVX-512 (F, BW, VL, VNNI) kernels: Q4_K prompt matrices in llama.cpp's repacked order, eight
//! rows and up to [`TOKENS`] tokens per call; Q6_K prompt matrices in GGML's `vec_dot` order,
//! one row and up to [`TOKENS`] tokens per call ([`q6k_row_tokens`]).
//!
//! The AVX2 kernel ([`super::avx2::q4k_repacked_rows8`]) unpacks each row's nibbles once per
//! token and forms the integer sums with `maddubs` and `madd`. Here a pair of sub-blocks of the
//! eight rows is unpacked once into eight registers (low nibbles in the lower 256 bits, high
//! nibbles in the upper 256, so the register lines up with the 64 activation bytes of the pair)
//! and reused for every token: per token, one `vpdpbusd` per row, one 8-row transpose-reduce,
//! and one multiplication by the sub-block scales laid out to match the reduced lanes.
//!
//! The integer terms are exact in any order, and the float steps (per super-block, or per pair
//! of sub-blocks) are the AVX2 kernel's, in the same order: every output is bit for bit
//! `repack_order`'s portable definition (tested there).
//!
//! Every function here is `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,
//! avx2,fma,f16c")]`; callers must have checked the CPU (`simd::level() == Avx512Vnni`).

use std::arch::x86_64::*;

use crate::blocks::{q4_k, q6_k, q8_k, QK_K};

use super::avx2::block8;

/// Tokens one call of [`q4k_rows8_tokens`] takes at most (its float accumulators live on the
/// stack).
pub const TOKENS: usize = 32;

/// The scales, mins and super-block factors of 8 consecutive Q4_K rows, decoded once for every
/// token of a batch: per super-block and pair `p` of sub-blocks, the scales as i32 lanes
/// `[s(2p) rows 0-3 | s(2p+1) rows 0-3 | s(2p) rows 4-7 | s(2p+1) rows 4-7]` (the lane order of
/// the kernel's reduction); per super-block and sub-block `j`, the mins of rows 0-7; per
/// super-block, `d` and `dmin` of rows 0-7.
#[derive(Default)]
pub struct Rows8Scales {
    scales: Vec<__m512i>,
    mins: Vec<__m256i>,
    d: Vec<__m256>,
    dmin: Vec<__m256>,
}

impl Rows8Scales {
    /// Decodes the metadata of the 8 rows of `row_bytes` bytes each in `rows` (contiguous) in
    /// place of what it held.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub fn decode(&mut self, rows: &[u8], row_bytes: usize) {
        let nb = row_bytes / q4_k::SIZE;
        assert!(rows.len() >= 8 * row_bytes);
        let Rows8Scales {
            scales,
            mins,
            d,
            dmin,
        } = self;
        scales.clear();
        mins.clear();
        d.clear();
        dmin.clear();
        for b in 0..nb {
            let k = block8(rows, row_bytes, b);
            let (sc_rows, mn_rows) = (&k.sc, &k.mn);
            for p in 0..4 {
                let (lo, hi) = (&sc_rows[2 * p], &sc_rows[2 * p + 1]);
                let lanes = [
                    lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3], lo[4], lo[5], lo[6],
                    lo[7], hi[4], hi[5], hi[6], hi[7],
                ];
                // SAFETY: 16 i32 = 64 readable bytes; unaligned load.
                scales.push(unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) });
            }
            for row in mn_rows {
                // SAFETY: 8 i32 = 32 readable bytes; unaligned load.
                mins.push(unsafe { _mm256_loadu_si256(row.as_ptr().cast()) });
            }
            // SAFETY: 8 f32 = 32 readable bytes each; unaligned loads.
            unsafe {
                d.push(_mm256_loadu_ps(k.d.as_ptr()));
                dmin.push(_mm256_loadu_ps(k.dmin.as_ptr()));
            }
        }
    }
}

/// The 8 rows' sums of the lanes of `v[r]`, low 256 bits and high 256 bits apart, as
/// `[low rows 0-3 | high rows 0-3 | low rows 4-7 | high rows 4-7]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn reduce8_halves(v: &[__m512i; 8]) -> __m512i {
    // Within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for rows a, b ...
    let pair = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    };
    let (p0, p1, p2, p3) = (
        pair(v[0], v[1]),
        pair(v[2], v[3]),
        pair(v[4], v[5]),
        pair(v[6], v[7]),
    );
    // ... then [Σa, Σb, Σc, Σd] per 128-bit lane: rows 0-3 and rows 4-7.
    let quad = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    };
    let (q0, q1) = (quad(p0, p1), quad(p2, p3));
    // Lanes 0+1 hold the low 256 bits' partial sums, lanes 2+3 the high ones'.
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(q0, q1),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(q0, q1),
    )
}

/// `count` Q8_K activation rows, `stride` bytes apart in `data`.
#[derive(Clone, Copy)]
pub struct TokenRows<'a> {
    pub data: &'a [u8],
    pub stride: usize,
    pub count: usize,
}

/// The outputs of 8 consecutive rows of a repacked Q4_K matrix (`rows`, contiguous, `row_bytes`
/// each, their [`Rows8Scales`] `meta`) for the activation rows of `acts` (at most [`TOKENS`]):
/// `out[t][r]`. Each output takes exactly the steps of
/// `repack_order`'s definition: per super-block the exact integer terms, turned into floats per
/// pair of sub-blocks (`per_pair`, the gemm's steps) or once per super-block (the gemv's).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn q4k_rows8_tokens(
    rows: &[u8],
    row_bytes: usize,
    meta: &Rows8Scales,
    acts: TokenRows,
    per_pair: bool,
    out: &mut [[f32; 8]],
) {
    let TokenRows {
        data: acts,
        stride: act_bytes,
        count: n_tokens,
    } = acts;
    let nb = row_bytes / q4_k::SIZE;
    assert!(n_tokens <= TOKENS && out.len() >= n_tokens);
    assert!(rows.len() >= 8 * row_bytes && meta.d.len() >= nb);
    assert!(n_tokens == 0 || acts.len() >= (n_tokens - 1) * act_bytes + nb * q8_k::SIZE);
    let low = _mm512_set1_epi8(0x0F);
    // Shift counts per 16-bit lane: 0 in the low 256 bits (low nibbles), 4 in the high ones.
    let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let mut acc = [_mm256_setzero_ps(); TOKENS];
    let mut acc_min = [_mm256_setzero_ps(); TOKENS];
    let mut i_sum = [_mm256_setzero_si256(); TOKENS];
    let mut m_sum = [_mm256_setzero_si256(); TOKENS];
    for b in 0..nb {
        for p in 0..4 {
            let mut w = [_mm512_setzero_si512(); 8];
            for (r, wr) in w.iter_mut().enumerate() {
                let at = r * row_bytes + b * q4_k::SIZE + q4_k::QS + 32 * p;
                let q = &rows[at..at + 32];
                // SAFETY: 32 readable bytes; unaligned load.
                let q = unsafe { _mm256_loadu_si256(q.as_ptr().cast()) };
                *wr = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(q), shift), low);
            }
            let sc = meta.scales[4 * b + p];
            let (mn0, mn1) = (meta.mins[8 * b + 2 * p], meta.mins[8 * b + 2 * p + 1]);
            for t in 0..n_tokens {
                let y = &acts[t * act_bytes + b * q8_k::SIZE..][..q8_k::SIZE];
                let ys = &y[q8_k::QS + 64 * p..q8_k::QS + 64 * p + 64];
                // SAFETY: 64 readable bytes; unaligned load.
                let yv = unsafe { _mm512_loadu_si512(ys.as_ptr().cast()) };
                let mut v = [_mm512_setzero_si512(); 8];
                for (vr, wr) in v.iter_mut().zip(&w) {
                    *vr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), *wr, yv);
                }
                let scaled = _mm512_mullo_epi32(reduce8_halves(&v), sc);
                let i_p = _mm512_castsi512_si256(_mm512_add_epi32(
                    _mm512_shuffle_i64x2::<0b10_00_10_00>(scaled, scaled),
                    _mm512_shuffle_i64x2::<0b11_01_11_01>(scaled, scaled),
                ));
                let bsum = |k: usize| {
                    i16::from_le_bytes([y[q8_k::BSUMS + 2 * k], y[q8_k::BSUMS + 2 * k + 1]]) as i32
                };
                let b0 = bsum(4 * p) + bsum(4 * p + 1);
                let b1 = bsum(4 * p + 2) + bsum(4 * p + 3);
                let m_p = _mm256_add_epi32(
                    _mm256_mullo_epi32(mn0, _mm256_set1_epi32(b0)),
                    _mm256_mullo_epi32(mn1, _mm256_set1_epi32(b1)),
                );
                if per_pair {
                    let d8 = _mm256_set1_ps(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
                    let scale = _mm256_mul_ps(meta.d[b], d8);
                    let scale_min = _mm256_mul_ps(meta.dmin[b], d8);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i_p), scale, acc[t]);
                    acc_min[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m_p), scale_min, acc_min[t]);
                } else {
                    i_sum[t] = _mm256_add_epi32(i_sum[t], i_p);
                    m_sum[t] = _mm256_add_epi32(m_sum[t], m_p);
                }
            }
        }
        if !per_pair {
            for t in 0..n_tokens {
                let y = &acts[t * act_bytes + b * q8_k::SIZE..][..4];
                let d8 = _mm256_set1_ps(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
                let scale = _mm256_mul_ps(meta.d[b], d8);
                let scale_min = _mm256_mul_ps(meta.dmin[b], d8);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i_sum[t]), scale, acc[t]);
                acc_min[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m_sum[t]), scale_min, acc_min[t]);
                i_sum[t] = _mm256_setzero_si256();
                m_sum[t] = _mm256_setzero_si256();
            }
        }
    }
    for (o, (a, m)) in out.iter_mut().zip(acc.iter().zip(&acc_min)).take(n_tokens) {
        // SAFETY: 8 f32 = 32 writable bytes; unaligned store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(*a, *m)) };
    }
}

/// A Q8_K activation row's quants widened to i16, for [`q6k_row_tokens`] (`vpdpwssd` takes
/// words): `out` must hold as many elements as the row has quants.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn widen_q8k(row: &[u8], out: &mut [i16]) {
    for (y, o) in row.chunks_exact(q8_k::SIZE).zip(out.chunks_exact_mut(QK_K)) {
        for (k, o32) in o.chunks_exact_mut(32).enumerate() {
            // SAFETY: 32 readable quant bytes of this block and 32 writable i16; unaligned.
            unsafe {
                let q = _mm256_loadu_si256(y[q8_k::QS + 32 * k..].as_ptr().cast());
                _mm512_storeu_si512(o32.as_mut_ptr().cast(), _mm512_cvtepi8_epi16(q));
            }
        }
    }
}

/// One Q6_K row against `out.len()` (at most [`TOKENS`]) Q8_K activation rows, each output bit
/// for bit `avx2::vec_dot_q6_k_q8_k`'s: per super-block, the same eight exact integer lanes
/// (lane `l`: elements `4l..4l+4` of every 32, times their scale, less `32·(bsum[2l]·sc[2l] +
/// bsum[2l+1]·sc[2l+1])`), one FMA by `d_a·d_w` into the token's accumulator, and GGML's
/// `hsum_float_8` at the end. Only the integer sums are formed differently: each super-block's
/// weights are unpacked once for every token, times their scales, as words (`sc·q` fits: at
/// most 63·128), and one `vpdpwssd` per 32 elements and token sums `sc·q·a` in pairs; lane
/// pairs `2l, 2l+1` are then added into lane `l`. Integer sums are exact in any order.
///
/// `acts` holds the tokens' Q8_K rows `act_bytes` apart, `widened` their quants as words
/// ([`widen_q8k`]), `cols` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn q6k_row_tokens(
    row: &[u8],
    acts: &[u8],
    act_bytes: usize,
    widened: &[i16],
    cols: usize,
    out: &mut [f32],
) {
    let n = out.len();
    let nb = cols / QK_K;
    assert!(n <= TOKENS && row.len() >= nb * q6_k::SIZE);
    assert!(n == 0 || (acts.len() >= (n - 1) * act_bytes + nb * q8_k::SIZE));
    assert!(widened.len() >= n * cols && act_bytes >= nb * q8_k::SIZE);
    let mut acc = [_mm256_setzero_ps(); TOKENS];
    let low = _mm256_set1_epi8(0x0F);
    let mask2 = _mm256_set1_epi8(3);
    for b in 0..nb {
        let x = &row[b * q6_k::SIZE..(b + 1) * q6_k::SIZE];
        let sc = &x[q6_k::SCALES..q6_k::SCALES + 16];
        // The 256 weights times their scales, 32 words per register, in element order.
        let mut w = [_mm512_setzero_si512(); 8];
        for c in 0..2 {
            // SAFETY: the block holds 128 `ql` bytes from QL and 64 `qh` bytes from QH.
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(x[q6_k::QL + 64 * c..].as_ptr().cast()),
                    _mm256_loadu_si256(x[q6_k::QL + 64 * c + 32..].as_ptr().cast()),
                    _mm256_loadu_si256(x[q6_k::QH + 32 * c..].as_ptr().cast()),
                )
            };
            let h = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, mask2));
            let quarters = [
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
            ];
            for (k, q) in quarters.into_iter().enumerate() {
                let j = 4 * c + k;
                let s = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi16(sc[2 * j] as i8 as i16),
                    _mm256_set1_epi16(sc[2 * j + 1] as i8 as i16),
                );
                w[j] = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(q), s);
            }
        }
        // SAFETY: 16 scale bytes; unaligned load.
        let scales16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(sc.as_ptr().cast()) });
        let d_w = super::avx2::f16_at(x, q6_k::D);
        for (t, acc_t) in acc.iter_mut().enumerate().take(n) {
            let y = &acts[t * act_bytes + b * q8_k::SIZE..][..q8_k::SIZE];
            let a16 = &widened[t * cols + b * QK_K..][..QK_K];
            let mut sum = _mm512_setzero_si512();
            for (j, wj) in w.iter().enumerate() {
                // SAFETY: 32 readable words of this super-block; unaligned load.
                let a = unsafe { _mm512_loadu_si512(a16[32 * j..].as_ptr().cast()) };
                sum = _mm512_dpwssd_epi32(sum, *wj, a);
            }
            // Lane l of the eight: the pair sums 2l and 2l + 1.
            let pairs = _mm512_add_epi64(sum, _mm512_srli_epi64::<32>(sum));
            let isum = _mm512_cvtepi64_epi32(pairs);
            // SAFETY: 16 i16 bsums of this block; unaligned load.
            let bsums = unsafe { _mm256_loadu_si256(y[q8_k::BSUMS..].as_ptr().cast()) };
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales16));
            let isum = _mm256_sub_epi32(isum, offset);
            let d_a = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
            let d = _mm256_set1_ps(d_a * d_w);
            *acc_t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc_t);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = super::avx2::hsum_ps(a);
    }
}
