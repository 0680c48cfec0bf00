//! Q4_0 against Q8_0 eight rows at a time, in the order of llama.cpp's repacked x86 kernels
//! (`repack_order` defines it): each output is one float lane,
//! `acc = fma(isum_b, d_w·d_a, acc)` over the blocks `b` in order, `isum_b` the block's exact
//! integer dot product.
//!
//! A group of 8 rows is first unpacked into a panel ([`panel`]): per block, 8 vectors of 32
//! bytes, vector `s` holding in its 32-bit lane `r` the unsigned nibbles of values `4s..4s+3`
//! of row `r` (0..15, not yet offset by 8), and the 8 rows' scales as f32. Against such a vector
//! a token's 4 activation bytes `4s..4s+3`, broadcast to every lane, give with one `maddubs`
//! each row's partial dot product in its own lane: no reduction across lanes is ever needed.
//! The 8 steps of a block add up in 16 bits (each step's pair sums are at most 2·15·128 = 3840,
//! eight of them 30720, below 2^15), one `madd` by ones widens them, and `8·Σa` (the offset of
//! the nibbles) comes off in 32 bits, which leaves the exact `Σ (q - 8)·a` of every row.
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`; callers must have
//! checked the CPU (see `simd::level`).

use std::arch::x86_64::*;

use crate::blocks::{q4_0, q8_0};

/// Bytes of one block of a panel: 8 steps of 32 bytes.
pub(crate) const PANEL_BLOCK: usize = 256;

/// Unpacks rows `0..8` of `group` (rows of `row_bytes` bytes, `nb` Q4_0 blocks each) into `q`
/// (`nb` · [`PANEL_BLOCK`] bytes) and their scales into `d` (`nb` · 8 floats, row order).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn panel(group: &[u8], row_bytes: usize, nb: usize, q: &mut [u8], d: &mut [f32]) {
    assert!(group.len() >= 7 * row_bytes + nb * q4_0::SIZE);
    assert!(q.len() >= nb * PANEL_BLOCK && d.len() >= nb * 8);
    let m4 = _mm256_set1_epi8(0x0f);
    let g = group.as_ptr();
    // SAFETY: the asserts above keep every read inside `group` (block `b` of row `r` at
    // `r·row_bytes + b·18`, 18 bytes) and every write inside `q` and `d`; unaligned loads and
    // stores.
    unsafe {
        for b in 0..nb {
            // (Macros: closures would not inherit this function's target features.)
            macro_rules! at {
                ($r:expr) => {
                    g.add($r * row_bytes + b * q4_0::SIZE)
                };
            }
            macro_rules! nibbles {
                ($r:expr) => {
                    _mm_loadu_si128(at!($r).add(q4_0::QS).cast())
                };
            }
            macro_rules! half {
                ($r:expr) => {
                    at!($r).add(q4_0::D).cast::<i16>().read_unaligned()
                };
            }
            // Rows r and r + 4 in the two halves: the 4x4 transposes of 32-bit words below run
            // in each half, rows 0-3 in the low one and 4-7 in the high one.
            let y0 = _mm256_set_m128i(nibbles!(4), nibbles!(0));
            let y1 = _mm256_set_m128i(nibbles!(5), nibbles!(1));
            let y2 = _mm256_set_m128i(nibbles!(6), nibbles!(2));
            let y3 = _mm256_set_m128i(nibbles!(7), nibbles!(3));
            let t0 = _mm256_unpacklo_epi32(y0, y1);
            let t1 = _mm256_unpackhi_epi32(y0, y1);
            let t2 = _mm256_unpacklo_epi32(y2, y3);
            let t3 = _mm256_unpackhi_epi32(y2, y3);
            // Word g of every row: bytes 4g..4g+3, whose low nibbles are values 4g..4g+3 (step
            // g) and whose high nibbles are values 16+4g.. (step 4 + g).
            let words = [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ];
            let dst = q.as_mut_ptr().add(b * PANEL_BLOCK);
            for (k, &v) in words.iter().enumerate() {
                _mm256_storeu_si256(dst.add(32 * k).cast(), _mm256_and_si256(v, m4));
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                _mm256_storeu_si256(dst.add(32 * (4 + k)).cast(), high);
            }
            let bits = _mm_set_epi16(
                half!(7),
                half!(6),
                half!(5),
                half!(4),
                half!(3),
                half!(2),
                half!(1),
                half!(0),
            );
            _mm256_storeu_ps(d.as_mut_ptr().add(8 * b), _mm256_cvtph_ps(bits));
        }
    }
}

/// What a token's Q8_0 block adds besides its quants: `8·Σa`, the offset the unsigned nibbles
/// carry, and its scale as f32.
#[derive(Clone, Copy, Default)]
pub(crate) struct BlockTerms {
    pub(crate) bias: i32,
    pub(crate) d: f32,
}

/// [`BlockTerms`] of every block of a Q8_0 row `a` (`nb` blocks) into `terms`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block_terms(a: &[u8], nb: usize, terms: &mut [BlockTerms]) {
    assert!(a.len() >= nb * q8_0::SIZE && terms.len() >= nb);
    let ones = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for (b, term) in terms.iter_mut().enumerate().take(nb) {
        let block = &a[b * q8_0::SIZE..(b + 1) * q8_0::SIZE];
        // SAFETY: `block` holds the 32 quant bytes after its 2-byte scale.
        let qs = unsafe { _mm256_loadu_si256(block[q8_0::QS..].as_ptr().cast()) };
        let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, qs), ones16);
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(sums),
            _mm256_extracti128_si256::<1>(sums),
        );
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        let bits = u16::from_le_bytes([block[q8_0::D], block[q8_0::D + 1]]);
        *term = BlockTerms {
            bias: 8 * _mm_cvtsi128_si32(s),
            d: _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))),
        };
    }
}

/// The body of [`tokens`] and [`tokens_vnni`]: `step` adds one step's products of the 8 rows'
/// weight vector `w` by the broadcast activations `x` to a token's sums `s`, `widen` turns the
/// block's sums `s` into eight i32. (A macro, not closures: the code must take the calling
/// function's target features.)
macro_rules! tokens_body {
    ($q:ident, $d:ident, $nb:ident, $acts:ident, $act_bytes:ident, $terms:ident, $t_count:ident,
     step: |$s:ident, $w:ident, $x:ident| $step:expr, widen: |$ws:ident| $widen:expr) => {{
        assert!($q.len() >= $nb * PANEL_BLOCK && $d.len() >= $nb * 8);
        assert!($acts.len() >= ($t_count - 1) * $act_bytes + $nb * q8_0::SIZE);
        assert!($terms.len() >= $t_count * $nb);
        let mut acc = [_mm256_setzero_ps(); $t_count];
        let (qp, a) = ($q.as_ptr(), $acts.as_ptr());
        for b in 0..$nb {
            let mut sums = [_mm256_setzero_si256(); $t_count];
            // SAFETY: the asserts above keep the panel's block `b` (256 bytes), its 8 scales
            // and each token's quants of block `b` (bytes 2..34 of the block, token t at
            // t·act_bytes) inside `q`, `d` and `acts`; unaligned loads.
            unsafe {
                let wq = qp.add(b * PANEL_BLOCK);
                let ab = a.add(b * q8_0::SIZE + q8_0::QS);
                for s in 0..8 {
                    let w = _mm256_loadu_si256(wq.add(32 * s).cast());
                    for (t, sum) in sums.iter_mut().enumerate() {
                        let x = ab
                            .add(t * $act_bytes + 4 * s)
                            .cast::<i32>()
                            .read_unaligned();
                        let ($s, $w, $x) = (*sum, w, _mm256_set1_epi32(x));
                        *sum = $step;
                    }
                }
            }
            // SAFETY: as above.
            let dw = unsafe { _mm256_loadu_ps($d.as_ptr().add(8 * b)) };
            for (t, (sum, acc)) in sums.iter().zip(acc.iter_mut()).enumerate() {
                let term = $terms[t * $nb + b];
                let $ws = *sum;
                let isum = _mm256_sub_epi32($widen, _mm256_set1_epi32(term.bias));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(term.d));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
            }
        }
        let mut out = [[0.0f32; 8]; $t_count];
        for (o, acc) in out.iter_mut().zip(acc) {
            // SAFETY: `o` holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
        }
        out
    }};
}

/// Tokens `0..T` of `acts` (Q8_0 rows of `act_bytes` bytes, `terms` their [`BlockTerms`] in rows
/// of `nb`) against a panel (`q`, `d`) of `nb` blocks: output `[t][r]` for row `r` of the group.
/// Each step is a `maddubs` into 16-bit sums (see the module docs), widened once per block.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens<const T: usize>(
    q: &[u8],
    d: &[f32],
    nb: usize,
    acts: &[u8],
    act_bytes: usize,
    terms: &[BlockTerms],
) -> [[f32; 8]; T] {
    let ones = _mm256_set1_epi16(1);
    tokens_body!(
        q,
        d,
        nb,
        acts,
        act_bytes,
        terms,
        T,
        step: |s, w, x| _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)),
        widen: |s| _mm256_madd_epi16(s, ones)
    )
}

/// [`tokens`] on AVX-512 VNNI: each step is one `vpdpbusd` (unsigned weights by signed
/// activations, four products into each 32-bit lane), the same exact integer sums, so the same
/// bits.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tokens_vnni<const T: usize>(
    q: &[u8],
    d: &[f32],
    nb: usize,
    acts: &[u8],
    act_bytes: usize,
    terms: &[BlockTerms],
) -> [[f32; 8]; T] {
    tokens_body!(
        q,
        d,
        nb,
        acts,
        act_bytes,
        terms,
        T,
        step: |s, w, x| _mm256_dpbusd_epi32(s, w, x),
        widen: |s| s
    )
}
