//! AVX-512 (F, BW, VL, VNNI) kernels: Q4_K prompt matrices in llama.cpp's repacked order,
//! sixteen rows and up to [`TOKENS`] tokens per call ([`q4k_rows16_tokens`]); Q6_K prompt
//! matrices in GGML's `vec_dot` order, one row and up to [`TOKENS`] tokens per call
//! ([`q6k_row_tokens`]).
//!
//! The Q4_K kernel keeps one row per 32-bit lane. Per pair of sub-blocks, the sixteen rows'
//! nibbles are gathered once into sixteen registers, one per sub-block half and 4-byte step
//! (lane `r`: row `r`'s four weights of that step), and reused for every token: per token, each
//! step is one `vpdpbusd` of its register with the token's four activations broadcast, so a
//! lane accumulates its own row's sum and no reduction across lanes is needed. The sub-block
//! scales multiply the two halves' lane sums, and the min terms come from one `vpmaddwd` of the
//! rows' two mins (as word pairs) with the token's two 32-element sums.
//!
//! The integer terms are exact in any order, and the float steps (per super-block, or per pair
//! of sub-blocks) are the AVX2 kernel's, in the same order: every output is bit for bit
//! `repack_order`'s portable definition (tested there).
//!
//! Every function here is `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,
//! avx2,fma,f16c")]`; callers must have checked the CPU (`simd::level() == Avx512Vnni`).

use std::arch::x86_64::*;

use crate::blocks::{q4_k, q6_k, q8_k, QK_K};

/// Tokens one call of [`q4k_rows16_tokens`] takes at most (its accumulators live on the stack).
pub const TOKENS: usize = 32;

/// Rows one call of [`q4k_rows16_tokens`] computes.
pub const ROWS: usize = 16;

/// The scales, mins and super-block factors of 16 consecutive Q4_K rows, decoded once for every
/// token of a batch, one row per lane: per super-block and sub-block `j`, the scales as i32;
/// per super-block and pair `p` of sub-blocks, the mins of sub-blocks `2p` and `2p + 1` as the
/// low and high word of each i32; per super-block, `d` and `dmin`.
#[derive(Default)]
pub struct Rows16Scales {
    scales: Vec<__m512i>,
    mins: Vec<__m512i>,
    d: Vec<__m512>,
    dmin: Vec<__m512>,
}

impl Rows16Scales {
    /// Decodes the metadata of the 16 rows of `row_bytes` bytes each in `rows` (contiguous) in
    /// place of what it held.
    ///
    /// One row per lane from the start: per super-block, four gathers read the 16 rows' `d` and
    /// `dmin` and their three words of packed 6-bit scales and mins, and the unpacking of
    /// GGML's `get_scale_min_k4` runs on all 16 lanes at once. (Unpacking row by row and
    /// transposing through memory was 44% of a mixture-of-experts prompt, whose experts see a
    /// handful of tokens each, so the decode is shared by few.)
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub fn decode(&mut self, rows: &[u8], row_bytes: usize) {
        let nb = row_bytes / q4_k::SIZE;
        assert!(rows.len() >= ROWS * row_bytes);
        // Gather offsets are i32: the 16 rows' bytes must be addressable from the first.
        assert!(ROWS * row_bytes <= i32::MAX as usize);
        let Rows16Scales {
            scales,
            mins,
            d,
            dmin,
        } = self;
        scales.clear();
        mins.clear();
        d.clear();
        dmin.clear();
        let offsets = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(row_bytes as i32),
        );
        let low6 = _mm512_set1_epi32(0x3f3f_3f3f);
        let low4 = _mm512_set1_epi32(0x0f0f_0f0f);
        let low2 = _mm512_set1_epi32(0x0303_0303);
        let byte = _mm512_set1_epi32(0xff);
        for b in 0..nb {
            let block = rows[b * q4_k::SIZE..].as_ptr();
            // SAFETY: lane r reads the 4 bytes at `r * row_bytes + b * SIZE + k` for k in
            // {D, SCALES, SCALES + 4, SCALES + 8}, inside row r's super-block b (D and DMIN are
            // the first 4 bytes, the scales the next 12), and `rows` holds all 16 rows.
            let [factors, w0, w1, w2] = [q4_k::D, q4_k::SCALES, q4_k::SCALES + 4, q4_k::SCALES + 8]
                .map(|k| unsafe { _mm512_i32gather_epi32::<1>(offsets, block.add(k).cast()) });
            debug_assert_eq!(q4_k::DMIN, q4_k::D + 2);
            // The bytes of sub-blocks 0-3 (low) and 4-7 (high), as `get_scale_min_k4` forms them.
            let sc_lo = _mm512_and_si512(w0, low6);
            let mn_lo = _mm512_and_si512(w1, low6);
            let sc_hi = _mm512_or_si512(
                _mm512_and_si512(w2, low4),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w0), low2)),
            );
            let mn_hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32::<4>(w2), low4),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w1), low2)),
            );
            for packed in [sc_lo, sc_hi] {
                scales.push(_mm512_and_si512(packed, byte));
                scales.push(_mm512_and_si512(_mm512_srli_epi32::<8>(packed), byte));
                scales.push(_mm512_and_si512(_mm512_srli_epi32::<16>(packed), byte));
                scales.push(_mm512_srli_epi32::<24>(packed));
            }
            // Mins of sub-blocks 2p and 2p + 1 as the low and high word: bytes 0, 2 of the
            // packed word, or its bytes 1, 3 moved down a byte.
            let words = _mm512_set1_epi32(0x00ff_00ff);
            for packed in [mn_lo, mn_hi] {
                let (even, odd) = (
                    _mm512_and_si512(packed, words),
                    _mm512_and_si512(_mm512_srli_epi32::<8>(packed), words),
                );
                // Pair (0, 1): bytes 0 and 1; pair (2, 3): bytes 2 and 3.
                let pair01 = _mm512_or_si512(
                    _mm512_and_si512(even, byte),
                    _mm512_slli_epi32::<16>(_mm512_and_si512(odd, byte)),
                );
                let pair23 = _mm512_or_si512(
                    _mm512_srli_epi32::<16>(even),
                    _mm512_andnot_si512(_mm512_set1_epi32(0xffff), odd),
                );
                mins.push(pair01);
                mins.push(pair23);
            }
            d.push(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(factors)));
            dmin.push(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<
                16,
            >(
                factors
            ))));
        }
    }
}

impl Rows16Scales {
    /// The 16 rows' scales of sub-block `j` of super-block `b`, one per i32 lane.
    pub(crate) fn scale(&self, b: usize, j: usize) -> __m512i {
        self.scales[8 * b + j]
    }

    /// The 16 rows' mins of sub-blocks `2p` and `2p + 1` of super-block `b`, as the low and
    /// high word of each lane.
    pub(crate) fn mins_pair(&self, b: usize, p: usize) -> __m512i {
        self.mins[4 * b + p]
    }

    /// The 16 rows' `d` and `dmin` of super-block `b`.
    pub(crate) fn factors(&self, b: usize) -> (__m512, __m512) {
        (self.d[b], self.dmin[b])
    }
}

/// The per-token accumulators of [`q4k_rows16_tokens`], kept by the caller from call to call:
/// a call clears only the entries of its tokens (clearing all of them, 8 KiB, on every call
/// took several percent of a prompt's time).
pub struct Rows16Acc {
    acc: [__m512; TOKENS],
    acc_min: [__m512; TOKENS],
    i_sum: [__m512i; TOKENS],
    m_sum: [__m512i; TOKENS],
}

impl Default for Rows16Acc {
    fn default() -> Self {
        // SAFETY: all-zero bits are valid vectors (zeros).
        unsafe { std::mem::zeroed() }
    }
}

/// `count` Q8_K activation rows, `stride` bytes apart in `data`.
#[derive(Clone, Copy)]
pub struct TokenRows<'a> {
    pub data: &'a [u8],
    pub stride: usize,
    pub count: usize,
}

/// The 4-byte little-endian word at `at` of `bytes`.
#[inline(always)]
fn word(bytes: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The outputs of 16 consecutive rows of a Q4_K matrix (`rows`, contiguous, `row_bytes` each,
/// their [`Rows16Scales`] `meta`) for the activation rows of `acts` (at most [`TOKENS`]):
/// `out[t][r]`. Each output takes exactly the steps of `repack_order`'s definition: per
/// super-block the exact integer terms, turned into floats per pair of sub-blocks (`per_pair`,
/// the gemm's steps) or once per super-block (the gemv's).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn q4k_rows16_tokens(
    rows: &[u8],
    row_bytes: usize,
    meta: &Rows16Scales,
    acts: TokenRows,
    per_pair: bool,
    scratch: &mut Rows16Acc,
    out: &mut [[f32; ROWS]],
) {
    let TokenRows {
        data: acts,
        stride: act_bytes,
        count: n_tokens,
    } = acts;
    let nb = row_bytes / q4_k::SIZE;
    assert!(n_tokens <= TOKENS && out.len() >= n_tokens);
    assert!(rows.len() >= ROWS * row_bytes && meta.d.len() >= nb);
    assert!(n_tokens == 0 || acts.len() >= (n_tokens - 1) * act_bytes + nb * q8_k::SIZE);
    assert!(ROWS * row_bytes <= i32::MAX as usize);
    let low = _mm512_set1_epi8(0x0F);
    // Byte offsets of the 16 rows, for the gathers.
    let offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(row_bytes as i32),
    );
    let Rows16Acc {
        acc,
        acc_min,
        i_sum,
        m_sum,
    } = scratch;
    for t in 0..n_tokens {
        acc[t] = _mm512_setzero_ps();
        acc_min[t] = _mm512_setzero_ps();
        i_sum[t] = _mm512_setzero_si512();
        m_sum[t] = _mm512_setzero_si512();
    }
    for b in 0..nb {
        for p in 0..4 {
            // w[h][k], lane r: row r's 4-byte step k of this pair's 32 bytes, low nibbles
            // (sub-block 2p) for h = 0, high ones (2p + 1) for h = 1.
            let base = b * q4_k::SIZE + q4_k::QS + 32 * p;
            // SAFETY: every lane reads 4 bytes at `r·row_bytes + base + 4k`, inside row r's
            // super-block b of the 16 rows asserted above.
            let q: [__m512i; 8] = std::array::from_fn(|k| unsafe {
                _mm512_i32gather_epi32::<1>(offsets, rows[base + 4 * k..].as_ptr().cast())
            });
            // Built whole rather than written into zeroed arrays: nothing is spilled to be
            // cleared on every pair.
            let w = [
                q.map(|v| _mm512_and_si512(v, low)),
                q.map(|v| _mm512_and_si512(_mm512_srli_epi16::<4>(v), low)),
            ];
            let (sc0, sc1) = (meta.scales[8 * b + 2 * p], meta.scales[8 * b + 2 * p + 1]);
            let mins = meta.mins[4 * b + p];
            for t in 0..n_tokens {
                let y = &acts[t * act_bytes + b * q8_k::SIZE..][..q8_k::SIZE];
                let qs = q8_k::QS + 64 * p;
                // Two accumulators per half: shorter dependency chains.
                let mut s = [_mm512_setzero_si512(); 4];
                for k in 0..8 {
                    let (lo, hi) = (word(y, qs + 4 * k), word(y, qs + 32 + 4 * k));
                    s[k % 2] = _mm512_dpbusd_epi32(s[k % 2], w[0][k], _mm512_set1_epi32(lo));
                    s[2 + k % 2] =
                        _mm512_dpbusd_epi32(s[2 + k % 2], w[1][k], _mm512_set1_epi32(hi));
                }
                let i_p = _mm512_add_epi32(
                    _mm512_mullo_epi32(_mm512_add_epi32(s[0], s[1]), sc0),
                    _mm512_mullo_epi32(_mm512_add_epi32(s[2], s[3]), sc1),
                );
                // The 32-element sums of sub-blocks 2p and 2p + 1 (16-element bsums in pairs;
                // at most 32·128 in size, so each fits a word).
                let bsum = |k: usize| {
                    i16::from_le_bytes([y[q8_k::BSUMS + 2 * k], y[q8_k::BSUMS + 2 * k + 1]])
                };
                let b0 = bsum(4 * p).wrapping_add(bsum(4 * p + 1)) as u16 as i32;
                let b1 = bsum(4 * p + 2).wrapping_add(bsum(4 * p + 3)) as u16 as i32;
                let m_p = _mm512_madd_epi16(mins, _mm512_set1_epi32(b0 | (b1 << 16)));
                if per_pair {
                    let d8 = _mm512_set1_ps(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
                    let scale = _mm512_mul_ps(meta.d[b], d8);
                    let scale_min = _mm512_mul_ps(meta.dmin[b], d8);
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_p), scale, acc[t]);
                    acc_min[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m_p), scale_min, acc_min[t]);
                } else {
                    i_sum[t] = _mm512_add_epi32(i_sum[t], i_p);
                    m_sum[t] = _mm512_add_epi32(m_sum[t], m_p);
                }
            }
        }
        if !per_pair {
            for t in 0..n_tokens {
                let y = &acts[t * act_bytes + b * q8_k::SIZE..][..4];
                let d8 = _mm512_set1_ps(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
                let scale = _mm512_mul_ps(meta.d[b], d8);
                let scale_min = _mm512_mul_ps(meta.dmin[b], d8);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_sum[t]), scale, acc[t]);
                acc_min[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m_sum[t]), scale_min, acc_min[t]);
                i_sum[t] = _mm512_setzero_si512();
                m_sum[t] = _mm512_setzero_si512();
            }
        }
    }
    for (o, (a, m)) in out
        .iter_mut()
        .zip(acc.iter().zip(acc_min.iter()))
        .take(n_tokens)
    {
        // SAFETY: 16 f32 = 64 writable bytes; unaligned store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_sub_ps(*a, *m)) };
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
    for b in 0..nb {
        let x = &row[b * q6_k::SIZE..(b + 1) * q6_k::SIZE];
        let sc = &x[q6_k::SCALES..q6_k::SCALES + 16];
        // The 256 weights times their scales, 32 words per register, in element order.
        let mut w = [_mm512_setzero_si512(); 8];
        for c in 0..2 {
            let quarters = super::avx2::q6k_quarters(x, c);
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
