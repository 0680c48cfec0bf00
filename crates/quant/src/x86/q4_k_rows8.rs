//! Q4_K against Q8_K eight rows at a time with one row per 32-bit lane, in the order of
//! llama.cpp's repacked x86 kernels (`repack_order` defines it), for batches of tokens.
//!
//! A group of 8 rows is first unpacked into a panel ([`Panel::fill`]): per super-block and
//! sub-block `j`, 8 vectors of 32 bytes, vector `s` holding in lane `r` the nibbles of values
//! `32j + 4s .. 32j + 4s + 3` of row `r`; per sub-block the 8 rows' scales, each twice in its
//! lane as i16 (a `madd` operand); per pair of sub-blocks the 8 rows' two mins as i16; and the
//! rows' `d` and `dmin`. Against a step vector a token's 4 activation bytes, broadcast to every
//! lane, give with one `maddubs` each row's partial dot product in its own lane, so no sum ever
//! crosses lanes. A sub-block's 8 steps add up in 16 bits (each step's pair sums are at most
//! 2·15·128 = 3840 in magnitude, eight of them 30720, below 2^15); one `madd` by the scales
//! gives `sc_j · Σ q·a` in 32 bits. The pair's min term `mn_2p·bsum_2p + mn_2p+1·bsum_2p+1` is
//! one `madd` of the mins by the token's two 32-value sums. From there the float steps are the
//! definition's, per pair (gemm) or per super-block (gemv).
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`; callers must have
//! checked the CPU (see `simd::level`).

use std::arch::x86_64::*;

use crate::blocks::{q4_k, q8_k};

/// Bytes of one super-block's quants in a panel: 8 sub-blocks of 8 steps of 32 bytes.
const SUPER_BYTES: usize = 2048;

/// What a token's Q8_K super-block adds besides its quants: its scale, and per pair of
/// sub-blocks `p` their two 32-value sums as two i16 in one i32 (each at most 32·128 in
/// magnitude), the operand of the mins' `madd`.
#[derive(Clone, Copy, Default)]
pub(crate) struct ActTerms {
    d: f32,
    bsums: [i32; 4],
}

/// The [`ActTerms`] of each super-block of the Q8_K row `a`.
pub(crate) fn act_terms(a: &[u8]) -> impl Iterator<Item = ActTerms> + '_ {
    a.chunks_exact(q8_k::SIZE).map(|y| {
        let m = crate::repack_order::act_meta(y);
        ActTerms {
            d: m.d,
            bsums: std::array::from_fn(|p| {
                (m.bsum32[2 * p] & 0xffff) | (m.bsum32[2 * p + 1] << 16)
            }),
        }
    })
}

/// One group of 8 rows unpacked (see the module docs); reused from group to group.
#[derive(Default)]
pub(crate) struct Panel {
    q: Vec<u8>,
    /// Per super-block: 8 vectors of scales (sub-blocks), then 4 of mins (pairs).
    meta: Vec<__m256i>,
    d: Vec<__m256>,
    dmin: Vec<__m256>,
}

/// 8 rows' 32 bytes at `p`, rows `row_bytes` apart, transposed by 32-bit words: vector `k` holds
/// word `k` (bytes `4k..4k+3`) of row `r` in lane `r`. Must be expanded inside an `unsafe` block
/// of a function with AVX2. (A macro: closures would not inherit the function's features.)
macro_rules! transpose8 {
    ($p:expr, $row_bytes:expr) => {{
        let (p, rb): (*const u8, usize) = ($p, $row_bytes);
        let r = [
            _mm256_loadu_si256(p.cast()),
            _mm256_loadu_si256(p.add(rb).cast()),
            _mm256_loadu_si256(p.add(2 * rb).cast()),
            _mm256_loadu_si256(p.add(3 * rb).cast()),
            _mm256_loadu_si256(p.add(4 * rb).cast()),
            _mm256_loadu_si256(p.add(5 * rb).cast()),
            _mm256_loadu_si256(p.add(6 * rb).cast()),
            _mm256_loadu_si256(p.add(7 * rb).cast()),
        ];
        let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
        let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
        let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        // Words k and 4 + k of rows 0-3 (u[k]) and of rows 4-7 (u[4 + k]), in the two halves.
        let u = [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
            _mm256_unpacklo_epi64(t4, t6),
            _mm256_unpackhi_epi64(t4, t6),
            _mm256_unpacklo_epi64(t5, t7),
            _mm256_unpackhi_epi64(t5, t7),
        ];
        [
            _mm256_permute2x128_si256::<0x20>(u[0], u[4]),
            _mm256_permute2x128_si256::<0x20>(u[1], u[5]),
            _mm256_permute2x128_si256::<0x20>(u[2], u[6]),
            _mm256_permute2x128_si256::<0x20>(u[3], u[7]),
            _mm256_permute2x128_si256::<0x31>(u[0], u[4]),
            _mm256_permute2x128_si256::<0x31>(u[1], u[5]),
            _mm256_permute2x128_si256::<0x31>(u[2], u[6]),
            _mm256_permute2x128_si256::<0x31>(u[3], u[7]),
        ]
    }};
}

impl Panel {
    /// Unpacks the 8 rows of `row_bytes` bytes each at the start of `rows` (contiguous) in
    /// place of what the panel held.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn fill(&mut self, rows: &[u8], row_bytes: usize) {
        let nb = row_bytes / q4_k::SIZE;
        assert!(rows.len() >= 8 * row_bytes);
        self.q.resize(nb * SUPER_BYTES, 0);
        self.meta.clear();
        self.d.clear();
        self.dmin.clear();
        let m4 = _mm256_set1_epi8(0x0f);
        for b in 0..nb {
            // 32 bytes `g` of the quants hold sub-block 2g in their low nibbles and 2g + 1 in
            // their high ones, 4 values per word.
            for g in 0..4 {
                // SAFETY: bytes 32g..32g+32 of the quants of super-block b of rows 0..8 lie
                // inside `rows` (asserted above); the panel holds nb · 2048 bytes; unaligned
                // loads and stores.
                unsafe {
                    let src = rows.as_ptr().add(b * q4_k::SIZE + q4_k::QS + 32 * g);
                    let words = transpose8!(src, row_bytes);
                    let dst = self.q.as_mut_ptr().add(b * SUPER_BYTES + 2 * g * 256);
                    for (s, &v) in words.iter().enumerate() {
                        _mm256_storeu_si256(dst.add(32 * s).cast(), _mm256_and_si256(v, m4));
                        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                        _mm256_storeu_si256(dst.add(256 + 32 * s).cast(), high);
                    }
                }
            }
            let k = super::avx2::block8(rows, row_bytes, b);
            for sc in &k.sc {
                let pairs: [i32; 8] = std::array::from_fn(|r| sc[r] | (sc[r] << 16));
                // SAFETY: 8 i32 = 32 readable bytes; unaligned load.
                self.meta
                    .push(unsafe { _mm256_loadu_si256(pairs.as_ptr().cast()) });
            }
            for p in 0..4 {
                let pairs: [i32; 8] =
                    std::array::from_fn(|r| k.mn[2 * p][r] | (k.mn[2 * p + 1][r] << 16));
                // SAFETY: as above.
                self.meta
                    .push(unsafe { _mm256_loadu_si256(pairs.as_ptr().cast()) });
            }
            // SAFETY: 8 f32 = 32 readable bytes each; unaligned loads.
            unsafe {
                self.d.push(_mm256_loadu_ps(k.d.as_ptr()));
                self.dmin.push(_mm256_loadu_ps(k.dmin.as_ptr()));
            }
        }
    }

    /// Tokens `0..T` of `acts` (Q8_K rows every `act_stride` bytes; `terms` their
    /// [`ActTerms`], `nb` per token) against the panel: output `[t][r]` for row `r` of the
    /// group, with the gemm's float steps (`per_pair`) or the gemv's.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tokens<const T: usize>(
        &self,
        acts: &[u8],
        act_stride: usize,
        terms: &[ActTerms],
        per_pair: bool,
    ) -> [[f32; 8]; T] {
        let nb = self.d.len();
        assert!(T >= 1 && acts.len() >= (T - 1) * act_stride + nb * q8_k::SIZE);
        assert!(terms.len() >= T * nb);
        assert!(self.q.len() >= nb * SUPER_BYTES && self.meta.len() >= 12 * nb);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            let y = acts.as_ptr().wrapping_add(b * q8_k::SIZE + q8_k::QS);
            let term = |t: usize| &terms[t * nb + b];
            let meta = &self.meta[12 * b..12 * b + 12];
            let mut isum = [_mm256_setzero_si256(); T];
            let mut msum = [_mm256_setzero_si256(); T];
            for p in 0..4 {
                let mut pair = [_mm256_setzero_si256(); T];
                for j in [2 * p, 2 * p + 1] {
                    let mut sums = [_mm256_setzero_si256(); T];
                    // SAFETY: the panel's sub-block j of super-block b (8 steps of 32 bytes)
                    // and each token's quants 32j..32j+32 of super-block b (`y` + t·stride)
                    // lie inside `self.q` and `acts` (asserted above); unaligned loads.
                    unsafe {
                        let wq = self.q.as_ptr().add(b * SUPER_BYTES + 256 * j);
                        for s in 0..8 {
                            let w = _mm256_loadu_si256(wq.add(32 * s).cast());
                            for (t, sum) in sums.iter_mut().enumerate() {
                                let at = y.add(t * act_stride + 32 * j + 4 * s);
                                let x = _mm256_set1_epi32(at.cast::<i32>().read_unaligned());
                                *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(w, x));
                            }
                        }
                    }
                    for (t, sum) in sums.iter().enumerate() {
                        pair[t] = _mm256_add_epi32(pair[t], _mm256_madd_epi16(*sum, meta[j]));
                    }
                }
                for t in 0..T {
                    let mins = _mm256_madd_epi16(meta[8 + p], _mm256_set1_epi32(term(t).bsums[p]));
                    if per_pair {
                        let da = _mm256_set1_ps(term(t).d);
                        let (scale, scale_min) = (
                            _mm256_mul_ps(self.d[b], da),
                            _mm256_mul_ps(self.dmin[b], da),
                        );
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair[t]), scale, acc[t]);
                        acc_min[t] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), scale_min, acc_min[t]);
                    } else {
                        isum[t] = _mm256_add_epi32(isum[t], pair[t]);
                        msum[t] = _mm256_add_epi32(msum[t], mins);
                    }
                }
            }
            if !per_pair {
                for t in 0..T {
                    let da = _mm256_set1_ps(term(t).d);
                    let (scale, scale_min) = (
                        _mm256_mul_ps(self.d[b], da),
                        _mm256_mul_ps(self.dmin[b], da),
                    );
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), scale, acc[t]);
                    acc_min[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[t]), scale_min, acc_min[t]);
                }
            }
        }
        let mut out = [[0.0f32; 8]; T];
        for (o, (a, m)) in out.iter_mut().zip(acc.iter().zip(&acc_min)) {
            // SAFETY: `o` holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(*a, *m)) };
        }
        out
    }
}
