//! AVX-512 VNNI kernels for the signed legacy formats (weights `d·q` with `q` a signed byte and
//! no offset: Q4_0, Q5_0, Q8_0 against Q8_0 activations): the Q4_0 and Q5_0
//! matvecs of a decode step, and the tile kernel of prompts for all three.
//!
//! Both give bit for bit what the AVX2 kernels give (GGML's `vec_dot` order; see
//! `avx2::legacy_loop` and `tile`): per output, eight f32 lanes, lane `l` of a 32-element
//! block taking one FMA of the combined scale `d_w·d_a` by the exact integer sum of elements
//! `4l..4l+4`, and at the end `hsum_float_8` of the lanes. Only the way the integer sums are
//! formed differs, and integer sums are exact in any order.
//!
//! The layout that lets one instruction serve four rows: a 512-bit register holds the first (or
//! the last) 16 elements of a block of four rows, one row per 128-bit lane, and the activation's
//! 16 matching bytes are broadcast to the four lanes. One `vpdpbusd` then gives 16 i32 lanes:
//! lanes 0-3 (or 4-7) of each of the four rows, so two such products are the 32 lanes of four
//! outputs' eight, and the FMAs by the scales broadcast per row are GGML's, lane for lane.
//! `vpdpbusd` multiplies unsigned by signed bytes; the unsigned side carries an offset whose
//! contribution (an exact integer) is cancelled by the accumulator's initial value.
//!
//! Every function here is `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,
//! avx2,fma,f16c")]`; callers must have checked the CPU (`simd::level() == Avx512Vnni`).

use std::arch::x86_64::*;

use crate::blocks::{q4_0, q5_0, q8_0, QK};
use crate::matmul::{OutRows, Panel, TileActs};

/// The float lanes of four outputs (`lo`: each row's lanes 0-3 in its 128-bit lane, `hi`:
/// lanes 4-7) reduced as GGML's `hsum_float_8` reduces each output's eight: lanes `i` and
/// `i + 4` added, then `(s0 + s2) + (s1 + s3)`. Returns the four outputs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn hsum4(lo: __m512, hi: __m512) -> __m128 {
    let s = _mm512_add_ps(lo, hi);
    // [s2, s3, s0, s1] in each 128-bit lane: lane 0 becomes s0 + s2, lane 1 s1 + s3.
    let s = _mm512_add_ps(s, _mm512_shuffle_ps::<0b01_00_11_10>(s, s));
    // [s1 + s3, ...]: lane 0 becomes (s0 + s2) + (s1 + s3).
    let s = _mm512_add_ps(s, _mm512_shuffle_ps::<0b10_11_00_01>(s, s));
    _mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        s,
    ))
}

/// `[d0 ×4 | d1 ×4 | d2 ×4 | d3 ×4]` from `[d0, d1, d2, d3]`: one scale per row, broadcast over
/// that row's four lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn spread4(d: __m128) -> __m512 {
    _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_castps128_ps512(d),
    )
}

/// One Q8_0 activation block's parts for [`matvec_q4_0_q8_0`] and [`matvec_q5_0_q8_0`]: its two
/// halves broadcast to the four 128-bit lanes, `-offset·Σ` of each 4-byte lane of them (what
/// cancels the offset of the unsigned quants `q = w + offset`: 8 for Q4_0, 16 for Q5_0), and
/// its scale.
struct ActBlock {
    lo: __m512i,
    hi: __m512i,
    fix_lo: __m512i,
    fix_hi: __m512i,
    d: f32,
}

/// The [`ActBlock`]s of a Q8_0 activation row, for weights whose unsigned quants carry
/// `offset`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn act_blocks(a: &[u8], offset: i8) -> Vec<ActBlock> {
    let offset = _mm512_set1_epi8(offset);
    a.chunks_exact(q8_0::SIZE)
        .map(|y| {
            let qs = &y[q8_0::QS..q8_0::QS + QK];
            // SAFETY: 16 readable bytes each; unaligned loads.
            let (lo, hi) = unsafe {
                (
                    _mm512_broadcast_i32x4(_mm_loadu_si128(qs.as_ptr().cast())),
                    _mm512_broadcast_i32x4(_mm_loadu_si128(qs[16..].as_ptr().cast())),
                )
            };
            let neg = |v| _mm512_sub_epi32(_mm512_setzero_si512(), v);
            ActBlock {
                lo,
                hi,
                fix_lo: neg(_mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, lo)),
                fix_hi: neg(_mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, hi)),
                d: super::avx2::f16_at(y, q8_0::D),
            }
        })
        .collect()
}

/// Q4_0 rows (contiguous in `w`, one per element of `out`) against one Q8_0 activation row,
/// four rows per register (see the module docs), the weights prefetched as one forward stream
/// (`x86::prefetch_ahead`). Every output is bit for bit `avx2::vec_dot_q4_0_q8_0`'s; the rows past
/// the last multiple of four are computed by it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn matvec_q4_0_q8_0(w: &[u8], a: &[u8], out: &mut [f32]) {
    let nb = a.len() / q8_0::SIZE;
    let row_bytes = nb * q4_0::SIZE;
    assert!(w.len() >= out.len() * row_bytes && a.len() >= nb * q8_0::SIZE);
    let acts = act_blocks(a, 8);
    let low = _mm512_set1_epi8(0x0F);
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (i, o) in quads.by_ref().enumerate() {
        let rows = &w[4 * i * row_bytes..(4 * i + 4) * row_bytes];
        let base = rows.as_ptr();
        let mut acc_lo = _mm512_setzero_ps();
        let mut acc_hi = _mm512_setzero_ps();
        for (c, y) in acts.iter().enumerate() {
            let x: [*const u8; 4] =
                std::array::from_fn(|r| base.wrapping_add(r * row_bytes + c * q4_0::SIZE));
            // The group's four rows are contiguous: stream them in as block c of each is read.
            super::prefetch_ahead(base.wrapping_add(4 * c * q4_0::SIZE), 4 * q4_0::SIZE);
            // SAFETY: block c < nb of each of the four rows lies inside `rows` (sliced
            // above): 2 scale bytes at the block's start and 16 quant bytes after them.
            let (q, d) = unsafe {
                let q = _mm512_inserti32x4::<3>(
                    _mm512_inserti32x4::<2>(
                        _mm512_inserti32x4::<1>(
                            _mm512_castsi128_si512(_mm_loadu_si128(x[0].add(q4_0::QS).cast())),
                            _mm_loadu_si128(x[1].add(q4_0::QS).cast()),
                        ),
                        _mm_loadu_si128(x[2].add(q4_0::QS).cast()),
                    ),
                    _mm_loadu_si128(x[3].add(q4_0::QS).cast()),
                );
                let bits = |r: usize| x[r].cast::<u16>().read_unaligned() as i64;
                let d = bits(0) | bits(1) << 16 | bits(2) << 32 | bits(3) << 48;
                (q, d)
            };
            let d = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128(d)), _mm_set1_ps(y.d));
            let d = spread4(d);
            let q_lo = _mm512_and_si512(q, low);
            let q_hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
            let i_lo = _mm512_dpbusd_epi32(y.fix_lo, q_lo, y.lo);
            let i_hi = _mm512_dpbusd_epi32(y.fix_hi, q_hi, y.hi);
            acc_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_lo), d, acc_lo);
            acc_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_hi), d, acc_hi);
        }
        // SAFETY: `o` holds 4 writable floats; unaligned store.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), hsum4(acc_lo, acc_hi)) };
    }
    for (k, o) in quads.into_remainder().iter_mut().enumerate() {
        let row = &w[(done + k) * row_bytes..(done + k + 1) * row_bytes];
        *o = super::avx2::vec_dot_q4_0_q8_0(row, a);
    }
}

/// Q5_0 rows (contiguous in `w`, one per element of `out`) against one Q8_0 activation row,
/// four rows per register as [`matvec_q4_0_q8_0`]: the unsigned quants `q = w + 16` are the
/// nibbles with each block's fifth bits set in by a byte mask (`qh` bits 0-15 for the first
/// 16 elements of each row, 16-31 for the last). Every output is bit for bit
/// `avx2::vec_dot_q5_0_q8_0`'s; the rows past the last multiple of four are computed by it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn matvec_q5_0_q8_0(w: &[u8], a: &[u8], out: &mut [f32]) {
    let nb = a.len() / q8_0::SIZE;
    let row_bytes = nb * q5_0::SIZE;
    assert!(w.len() >= out.len() * row_bytes && a.len() >= nb * q8_0::SIZE);
    let acts = act_blocks(a, 16);
    let low = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(16);
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (i, o) in quads.by_ref().enumerate() {
        let rows = &w[4 * i * row_bytes..(4 * i + 4) * row_bytes];
        let base = rows.as_ptr();
        let mut acc_lo = _mm512_setzero_ps();
        let mut acc_hi = _mm512_setzero_ps();
        for (c, y) in acts.iter().enumerate() {
            let x: [*const u8; 4] =
                std::array::from_fn(|r| base.wrapping_add(r * row_bytes + c * q5_0::SIZE));
            // The group's four rows are contiguous: stream them in as block c of each is read.
            super::prefetch_ahead(base.wrapping_add(4 * c * q5_0::SIZE), 4 * q5_0::SIZE);
            // SAFETY: block c < nb of each of the four rows lies inside `rows` (sliced
            // above): 2 scale bytes, 4 bytes of fifth bits and 16 quant bytes.
            let (q, qh, d) = unsafe {
                let q = _mm512_inserti32x4::<3>(
                    _mm512_inserti32x4::<2>(
                        _mm512_inserti32x4::<1>(
                            _mm512_castsi128_si512(_mm_loadu_si128(x[0].add(q5_0::QS).cast())),
                            _mm_loadu_si128(x[1].add(q5_0::QS).cast()),
                        ),
                        _mm_loadu_si128(x[2].add(q5_0::QS).cast()),
                    ),
                    _mm_loadu_si128(x[3].add(q5_0::QS).cast()),
                );
                let qh: [u64; 4] = std::array::from_fn(|r| {
                    x[r].add(q5_0::QH).cast::<u32>().read_unaligned() as u64
                });
                let bits = |r: usize| x[r].cast::<u16>().read_unaligned() as i64;
                let d = bits(0) | bits(1) << 16 | bits(2) << 32 | bits(3) << 48;
                (q, qh, d)
            };
            // Bit 16r + j of a mask is element j (of 16) of row r's half.
            let mask_lo = (qh[0] & 0xFFFF)
                | (qh[1] & 0xFFFF) << 16
                | (qh[2] & 0xFFFF) << 32
                | (qh[3] & 0xFFFF) << 48;
            let mask_hi =
                qh[0] >> 16 | (qh[1] >> 16) << 16 | (qh[2] >> 16) << 32 | (qh[3] >> 16) << 48;
            let d = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128(d)), _mm_set1_ps(y.d));
            let d = spread4(d);
            let q_lo = _mm512_and_si512(q, low);
            let q_hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), low);
            let q_lo = _mm512_or_si512(q_lo, _mm512_maskz_mov_epi8(mask_lo, sixteen));
            let q_hi = _mm512_or_si512(q_hi, _mm512_maskz_mov_epi8(mask_hi, sixteen));
            let i_lo = _mm512_dpbusd_epi32(y.fix_lo, q_lo, y.lo);
            let i_hi = _mm512_dpbusd_epi32(y.fix_hi, q_hi, y.hi);
            acc_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_lo), d, acc_lo);
            acc_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_hi), d, acc_hi);
        }
        // SAFETY: `o` holds 4 writable floats; unaligned store.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), hsum4(acc_lo, acc_hi)) };
    }
    for (k, o) in quads.into_remainder().iter_mut().enumerate() {
        let row = &w[(done + k) * row_bytes..(done + k + 1) * row_bytes];
        *o = super::avx2::vec_dot_q5_0_q8_0(row, a);
    }
}

/// A tile panel's rows in the layout of [`run_panel`]: per group of four rows and 32-element
/// chunk, 80 bytes of 16-byte lanes (one per row): the chunk's first 16 signed quants, its last
/// 16, `-128·Σ` of each 4-byte lane of each (what cancels the offset of the unsigned
/// activations `a + 128`), and the row's scale four times. Rows past the panel's end are zero.
pub struct SignedPanel {
    groups: usize,
    n_chunks: usize,
    /// Per group and chunk: `[q_lo, q_hi]`, 64 bytes each.
    q: Vec<__m512i>,
    /// Per group and chunk: `[fix_lo, fix_hi]`.
    fix: Vec<__m512i>,
    /// Per group and chunk: the rows' scales, each over its four lanes.
    d: Vec<__m512>,
}

impl SignedPanel {
    /// [`SignedPanel::build`] of `rows` Q4_0 rows of `cols` elements (contiguous in `data`),
    /// straight from the blocks: the same panel, without the row-major unpacking in between.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub fn from_q4_0(data: &[u8], rows: usize, cols: usize) -> SignedPanel {
        Self::from_blocks::<false>(data, rows, cols)
    }

    /// [`SignedPanel::build`] of `rows` Q5_0 rows of `cols` elements (contiguous in `data`),
    /// straight from the blocks, as [`SignedPanel::from_q4_0`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub fn from_q5_0(data: &[u8], rows: usize, cols: usize) -> SignedPanel {
        Self::from_blocks::<true>(data, rows, cols)
    }

    /// Q4_0 (`FIVE` false) or Q5_0 (`FIVE` true) blocks regrouped: the nibbles of four rows'
    /// blocks in one register, for Q5_0 with the fifth bits set in by byte masks (`qh` bits
    /// 0-15 for each row's first 16 elements, 16-31 for the last), less the format's offset.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn from_blocks<const FIVE: bool>(data: &[u8], rows: usize, cols: usize) -> SignedPanel {
        let (size, qs_at) = if FIVE {
            (q5_0::SIZE, q5_0::QS)
        } else {
            (q4_0::SIZE, q4_0::QS)
        };
        let n_chunks = cols / QK;
        let row_bytes = n_chunks * size;
        let groups = rows.div_ceil(4);
        assert!(data.len() >= rows * row_bytes);
        let mut q = Vec::with_capacity(groups * n_chunks * 2);
        let mut fix = Vec::with_capacity(groups * n_chunks * 2);
        let mut d = Vec::with_capacity(groups * n_chunks);
        let (low, offset, sixteen, minus128) = (
            _mm512_set1_epi8(0x0F),
            _mm512_set1_epi8(if FIVE { 16 } else { 8 }),
            _mm512_set1_epi8(16),
            _mm512_set1_epi8(-128),
        );
        for g in 0..groups {
            for c in 0..n_chunks {
                // Rows past the end stay zero (quants 8, no fifth bits, scale 0); their outputs
                // are not stored.
                let mut qs = [_mm_set1_epi8(0x88u8 as i8); 4];
                let mut bits = 0i64;
                let mut mask = [0u64; 2];
                for (k, qk) in qs.iter_mut().enumerate() {
                    let r = 4 * g + k;
                    if r < rows {
                        let x = &data[r * row_bytes + c * size..][..size];
                        // SAFETY: 16 readable bytes after the scale; unaligned load.
                        *qk = unsafe { _mm_loadu_si128(x[qs_at..].as_ptr().cast()) };
                        bits |= (u16::from_le_bytes([x[0], x[1]]) as i64) << (16 * k);
                        if FIVE {
                            let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]) as u64;
                            mask[0] |= (qh & 0xFFFF) << (16 * k);
                            mask[1] |= (qh >> 16) << (16 * k);
                        }
                    }
                }
                let v = _mm512_inserti32x4::<3>(
                    _mm512_inserti32x4::<2>(
                        _mm512_inserti32x4::<1>(_mm512_castsi128_si512(qs[0]), qs[1]),
                        qs[2],
                    ),
                    qs[3],
                );
                for (half, m) in [
                    _mm512_and_si512(v, low),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
                ]
                .into_iter()
                .zip(mask)
                {
                    let half = if FIVE {
                        _mm512_or_si512(half, _mm512_maskz_mov_epi8(m, sixteen))
                    } else {
                        half
                    };
                    let w = _mm512_sub_epi8(half, offset);
                    q.push(w);
                    fix.push(_mm512_sub_epi32(
                        _mm512_setzero_si512(),
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), minus128, w),
                    ));
                }
                d.push(spread4(_mm_cvtph_ps(_mm_cvtsi64_si128(bits))));
            }
        }
        SignedPanel {
            groups,
            n_chunks,
            q,
            fix,
            d,
        }
    }

    /// Regroups `rows` rows of `panel` (unpacked by `matmul::unpack_row` for a signed format:
    /// `q` signed bytes, `dv` the row's scale in 8 lanes per chunk) of `cols` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub fn build(panel: &Panel, rows: usize, cols: usize) -> SignedPanel {
        let n_chunks = cols / QK;
        let groups = rows.div_ceil(4);
        assert!(panel.q.len() >= rows * cols && panel.dv.len() >= rows * n_chunks * 8);
        let mut q = Vec::with_capacity(groups * n_chunks * 2);
        let mut fix = Vec::with_capacity(groups * n_chunks * 2);
        let mut d = Vec::with_capacity(groups * n_chunks);
        let minus128 = _mm512_set1_epi8(-128);
        for g in 0..groups {
            for c in 0..n_chunks {
                let mut bytes = [[0u8; 64]; 2];
                let mut scales = [0.0f32; 16];
                for k in 0..4 {
                    let r = 4 * g + k;
                    if r >= rows {
                        continue;
                    }
                    let src = &panel.q[r * cols + QK * c..r * cols + QK * c + QK];
                    bytes[0][16 * k..16 * k + 16].copy_from_slice(&src[..16]);
                    bytes[1][16 * k..16 * k + 16].copy_from_slice(&src[16..]);
                    scales[4 * k..4 * k + 4].fill(panel.dv[(r * n_chunks + c) * 8]);
                }
                for half in &bytes {
                    // SAFETY: 64 readable bytes; unaligned load.
                    let v = unsafe { _mm512_loadu_si512(half.as_ptr().cast()) };
                    q.push(v);
                    // Σ 0x80·w over each 4-byte lane (0x80 read as the unsigned 128), negated.
                    fix.push(_mm512_sub_epi32(
                        _mm512_setzero_si512(),
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), minus128, v),
                    ));
                }
                // SAFETY: 16 readable floats; unaligned load.
                d.push(unsafe { _mm512_loadu_ps(scales.as_ptr()) });
            }
        }
        SignedPanel {
            groups,
            n_chunks,
            q,
            fix,
            d,
        }
    }
}

/// Tokens per tile of [`run_panel`]'s kernel, and groups of four rows.
const TILE_TOKENS: usize = 4;
const TILE_GROUPS: usize = 2;

/// Activations as [`run_panel`] reads them: the tile layout's quants plus 128 (`a ^ 0x80`, the
/// unsigned operand of `vpdpbusd`), and the scales.
pub struct FlippedActs<'a> {
    qs: Vec<u8>,
    acts: &'a TileActs,
}

impl<'a> FlippedActs<'a> {
    pub fn new(acts: &'a TileActs) -> FlippedActs<'a> {
        FlippedActs {
            qs: acts.qs.iter().map(|q| q ^ 0x80).collect(),
            acts,
        }
    }
}

/// `G` groups of four rows from group `g0` by `T` tokens from `t0`: the sums of four outputs
/// per group and token, `out[t][g]`.
///
/// # Safety
/// Groups `g0..g0 + G` must be inside `panel` and tokens `t0..t0 + T` inside `acts` (as
/// [`run_panel`] checks), with `panel.n_chunks == acts.n_chunks`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const G: usize, const T: usize>(
    panel: &SignedPanel,
    g0: usize,
    acts: &FlippedActs,
    t0: usize,
    out: &mut [[__m128; TILE_GROUPS]; TILE_TOKENS],
) {
    let n_chunks = panel.n_chunks;
    let cols = acts.acts.cols;
    // SAFETY: the caller guarantees groups g0..g0 + G and tokens t0..t0 + T, so these
    // offsets are inside the vectors.
    let (aq, ad, pq, pfix, pd) = unsafe {
        (
            acts.qs.as_ptr().add(t0 * cols),
            acts.acts.d.as_ptr().add(t0 * n_chunks * 8),
            panel.q.as_ptr().add(2 * g0 * n_chunks),
            panel.fix.as_ptr().add(2 * g0 * n_chunks),
            panel.d.as_ptr().add(g0 * n_chunks),
        )
    };
    let mut acc_lo = [[_mm512_setzero_ps(); G]; T];
    let mut acc_hi = [[_mm512_setzero_ps(); G]; T];
    for c in 0..n_chunks {
        let mut a_lo = [_mm512_setzero_si512(); T];
        let mut a_hi = [_mm512_setzero_si512(); T];
        let mut d_a = [_mm512_setzero_ps(); T];
        for t in 0..T {
            // SAFETY: chunk c < n_chunks of token t < T, inside the caller's tokens.
            unsafe {
                let q = aq.add(t * cols + QK * c);
                a_lo[t] = _mm512_broadcast_i32x4(_mm_loadu_si128(q.cast()));
                a_hi[t] = _mm512_broadcast_i32x4(_mm_loadu_si128(q.add(16).cast()));
                d_a[t] = _mm512_set1_ps(*ad.add((t * n_chunks + c) * 8));
            }
        }
        for g in 0..G {
            let at = g * n_chunks + c;
            // SAFETY: chunk c < n_chunks of group g < G, inside the caller's groups.
            let (w_lo, w_hi, fix_lo, fix_hi, d_w) = unsafe {
                (
                    *pq.add(2 * at),
                    *pq.add(2 * at + 1),
                    *pfix.add(2 * at),
                    *pfix.add(2 * at + 1),
                    *pd.add(at),
                )
            };
            for t in 0..T {
                let d = _mm512_mul_ps(d_w, d_a[t]);
                let i_lo = _mm512_dpbusd_epi32(fix_lo, a_lo[t], w_lo);
                let i_hi = _mm512_dpbusd_epi32(fix_hi, a_hi[t], w_hi);
                acc_lo[t][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_lo), d, acc_lo[t][g]);
                acc_hi[t][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_hi), d, acc_hi[t][g]);
            }
        }
    }
    for t in 0..T {
        for g in 0..G {
            out[t][g] = hsum4(acc_lo[t][g], acc_hi[t][g]);
        }
    }
}

/// Multiplies the panel's `rows` rows with tokens `t_begin..t_end` into `out`, bit for bit as
/// `tile::run_panel` does for a signed format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn run_panel(
    panel: &SignedPanel,
    rows: usize,
    acts: &FlippedActs,
    t_begin: usize,
    t_end: usize,
    out: OutRows,
) {
    let n_chunks = panel.n_chunks;
    assert!(rows <= 4 * panel.groups && n_chunks == acts.acts.n_chunks);
    assert!(panel.q.len() >= 2 * panel.groups * n_chunks && panel.fix.len() == panel.q.len());
    assert!(panel.d.len() >= panel.groups * n_chunks);
    assert!(t_begin <= t_end && acts.qs.len() >= t_end * acts.acts.cols);
    assert!(acts.acts.d.len() >= t_end * n_chunks * 8 && n_chunks * QK == acts.acts.cols);
    let (base, stride) = out.base(rows, t_end);
    let mut t = t_begin;
    while t < t_end {
        let tokens = TILE_TOKENS.min(t_end - t);
        let mut g = 0;
        while g < panel.groups {
            let groups = TILE_GROUPS.min(panel.groups - g);
            let mut sums = [[_mm_setzero_ps(); TILE_GROUPS]; TILE_TOKENS];
            macro_rules! go {
                ($g:literal, $t:literal) => {
                    // SAFETY: groups g..g + $g and tokens t..t + $t are inside the panel and
                    // the activations (checked above).
                    unsafe { kernel::<$g, $t>(panel, g, acts, t, &mut sums) }
                };
            }
            match (groups, tokens) {
                (2, 4) => go!(2, 4),
                (2, 3) => go!(2, 3),
                (2, 2) => go!(2, 2),
                (2, 1) => go!(2, 1),
                (1, 4) => go!(1, 4),
                (1, 3) => go!(1, 3),
                (1, 2) => go!(1, 2),
                _ => go!(1, 1),
            }
            for (k, token_sums) in sums.iter().enumerate().take(tokens) {
                for (j, s) in token_sums.iter().enumerate().take(groups) {
                    let mut v = [0.0f32; 4];
                    // SAFETY: `v` holds 4 writable floats; unaligned store.
                    unsafe { _mm_storeu_ps(v.as_mut_ptr(), *s) };
                    let r0 = 4 * (g + j);
                    for (i, v) in v.iter().enumerate().take(rows.saturating_sub(r0).min(4)) {
                        // SAFETY: `out.base` checked rows `0..rows` of tokens up to `t_end`;
                        // r0 + i < rows and t + k < t_end; this job alone writes these rows.
                        unsafe { *base.add((t + k) * stride + r0 + i) = *v };
                    }
                }
            }
            g += groups;
        }
        t += tokens;
    }
}
