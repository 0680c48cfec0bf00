//! Q4_0 against Q8_0 eight rows at a time, in the order of llama.cpp's repacked x86 kernels
//! (`repack_q4_0` defines it): each output is one float lane,
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
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`, and [`tokens_vnni`]
//! AVX-512 VNNI's besides; callers must have checked the CPU (see `simd::level`).

use std::arch::x86_64::*;

use super::avx2::{f16_at, hsum_epi32};
use crate::blocks::{q4_0, q8_0};

/// Bytes of one block of a panel: 8 steps of 32 bytes.
pub(crate) const PANEL_BLOCK: usize = 256;

/// Block `$b` of the 8 rows at `$g` (rows `$row_bytes` apart): the 4 vectors of 32-bit words
/// (word `k` of every row, row `r` in lane `r`: bytes `4k..4k+3`, whose low nibbles are values
/// `4k..4k+3`, step `k`, and whose high nibbles are values `16+4k..`, step `4 + k`) and the 8
/// rows' scales. Also asks for the next group's share of this block's bytes (see below). Must
/// be expanded inside an `unsafe` block of a function with AVX2 and F16C, with block `$b` of
/// rows `0..8` readable. (A macro: closures would not inherit the function's target features.)
macro_rules! unpack_block {
    ($g:expr, $row_bytes:expr, $b:expr) => {{
        let (g, row_bytes, b): (*const u8, usize, usize) = ($g, $row_bytes, $b);
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
        // The group's 8 rows are one contiguous range read as 8 interleaved streams, which the
        // hardware prefetchers follow poorly. The next group's range is asked for instead as
        // one forward stream, block by block: its share of this block's 144 bytes, lines 64
        // bytes apart (the last reaching past the share, so none is missed). Prefetches never
        // fault; `wrapping_add` keeps the address arithmetic defined past the weights' end.
        let ahead = g.wrapping_add(8 * row_bytes + b * 8 * q4_0::SIZE);
        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128).cast());
        // Rows r and r + 4 in the two halves: the 4x4 transposes of 32-bit words below run in
        // each half, rows 0-3 in the low one and 4-7 in the high one.
        let y0 = _mm256_set_m128i(nibbles!(4), nibbles!(0));
        let y1 = _mm256_set_m128i(nibbles!(5), nibbles!(1));
        let y2 = _mm256_set_m128i(nibbles!(6), nibbles!(2));
        let y3 = _mm256_set_m128i(nibbles!(7), nibbles!(3));
        let t0 = _mm256_unpacklo_epi32(y0, y1);
        let t1 = _mm256_unpackhi_epi32(y0, y1);
        let t2 = _mm256_unpacklo_epi32(y2, y3);
        let t3 = _mm256_unpackhi_epi32(y2, y3);
        let words = [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
        ];
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
        (words, _mm256_cvtph_ps(bits))
    }};
}

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
    // SAFETY: the asserts above keep every read inside `group` (block `b` of row `r` at
    // `r·row_bytes + b·18`, 18 bytes) and every write inside `q` and `d`; unaligned loads and
    // stores.
    unsafe {
        for b in 0..nb {
            let (words, dw) = unpack_block!(group.as_ptr(), row_bytes, b);
            let dst = q.as_mut_ptr().add(b * PANEL_BLOCK);
            for (k, &v) in words.iter().enumerate() {
                _mm256_storeu_si256(dst.add(32 * k).cast(), _mm256_and_si256(v, m4));
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                _mm256_storeu_si256(dst.add(32 * (4 + k)).cast(), high);
            }
            _mm256_storeu_ps(d.as_mut_ptr().add(8 * b), dw);
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
        *term = BlockTerms {
            bias: 8 * hsum_epi32(sums),
            d: f16_at(block, q8_0::D),
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
            block_end!(sums, acc, dw, $terms, $nb, b, |$ws| $widen);
        }
        outputs!(acc, $t_count)
    }};
}

/// The float steps of block `$b` for every token: `acc = fma(isum, d_w·d_a, acc)`, `isum` the
/// token's sums widened (`widen`) less its `8·Σa`.
macro_rules! block_end {
    ($sums:ident, $acc:ident, $dw:ident, $terms:ident, $nb:ident, $b:ident,
     |$ws:ident| $widen:expr) => {
        for (t, (sum, acc)) in $sums.iter().zip($acc.iter_mut()).enumerate() {
            let term = $terms[t * $nb + $b];
            let $ws = *sum;
            let isum = _mm256_sub_epi32($widen, _mm256_set1_epi32(term.bias));
            let scale = _mm256_mul_ps($dw, _mm256_set1_ps(term.d));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
        }
    };
}

/// The accumulators as `[[f32; 8]; T]`.
macro_rules! outputs {
    ($acc:ident, $t_count:ident) => {{
        let mut out = [[0.0f32; 8]; $t_count];
        for (o, acc) in out.iter_mut().zip($acc) {
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

/// [`tokens`] straight from the 8 rows at the start of `group` (rows of `row_bytes` bytes, `nb`
/// blocks), each block unpacked in registers and used at once: for a few tokens, where a panel
/// would be written and read back for too little reuse.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn direct<const T: usize>(
    group: &[u8],
    row_bytes: usize,
    nb: usize,
    acts: &[u8],
    act_bytes: usize,
    terms: &[BlockTerms],
) -> [[f32; 8]; T] {
    assert!(group.len() >= 7 * row_bytes + nb * q4_0::SIZE);
    assert!(acts.len() >= (T - 1) * act_bytes + nb * q8_0::SIZE);
    assert!(terms.len() >= T * nb);
    let (m4, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); T];
    let a = acts.as_ptr();
    for b in 0..nb {
        let mut sums = [_mm256_setzero_si256(); T];
        // SAFETY: the asserts above keep block `b` of rows 0..8 inside `group` and each token's
        // quants of block `b` (bytes 2..34 of the block, token t at t·act_bytes) inside `acts`;
        // unaligned loads.
        let dw = unsafe {
            let (words, dw) = unpack_block!(group.as_ptr(), row_bytes, b);
            let ab = a.add(b * q8_0::SIZE + q8_0::QS);
            for (k, &v) in words.iter().enumerate() {
                let low = _mm256_and_si256(v, m4);
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                for (t, sum) in sums.iter_mut().enumerate() {
                    let at = ab.add(t * act_bytes + 4 * k);
                    let xl = _mm256_set1_epi32(at.cast::<i32>().read_unaligned());
                    let xh = _mm256_set1_epi32(at.add(16).cast::<i32>().read_unaligned());
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(low, xl),
                        _mm256_maddubs_epi16(high, xh),
                    );
                    *sum = _mm256_add_epi16(*sum, p);
                }
            }
            dw
        };
        block_end!(sums, acc, dw, terms, nb, b, |s| _mm256_madd_epi16(s, ones));
    }
    outputs!(acc, T)
}
