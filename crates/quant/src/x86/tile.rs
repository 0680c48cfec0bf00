//! The register-tiled integer micro-kernel of the tiled matmul (see `matmul`'s module docs
//! for the layout): `R` weight rows by `T` tokens, all accumulators in registers, each loaded
//! weight chunk used `T` times and each activation chunk `R` times.
//!
//! Per row, token and 32-element chunk: `maddubs` + `madd` (exact i32 sums of 8 lanes),
//! conversion to f32, and one FMA with the combined scale `dv·d`. Signed formats (Q8_0, Q4_0,
//! Q5_0) then reduce the lanes as GGML's `hsum_float_8`; Q8_1 formats (Q4_1, Q5_1) add their
//! per-block `m·s` terms by a scalar FMA chain, as `ggml_vec_dot_q4_1_q8_1` does, so both give
//! exactly GGML's `vec_dot`; the other formats add one FMA per row, token and eight halves for
//! their offsets. [`run_panel`] sweeps a panel over a range of tokens so
//! that the per-call set-up is paid once per panel, not once per tile.

use std::arch::x86_64::*;

use super::avx2::hsum_ps;
use crate::blocks::QK;
use crate::matmul::{OutRows, Panel, TileActs, TILE_ROWS, TILE_TOKENS};
use crate::simd::Level;
use crate::GgmlType;

/// Chunks whose scale products [`kernel`] forms ahead of its integer work, a batch at a time.
const SCALE_BATCH: usize = 32;

/// Base pointers and strides of one tile's operands; built by [`run_panel`] from checked
/// slices. `aq`, `ad` and `ash` point at the tile's first token.
struct TilePtrs {
    wq: *const u8,
    wd: *const f32,
    wm: *const f32,
    aq: *const u8,
    ad: *const f32,
    ash: *const f32,
    /// For formats with one weight scale per chunk: the tile's rows' scales
    /// (`Panel::d_rows` of its group) and its tokens' (`TileActs::d_pairs` of its pair), at
    /// chunk 0; null otherwise.
    d_rows: *const f32,
    d_pair: *const f32,
    cols: usize,
    n_chunks: usize,
    n_halves: usize,
}

/// Sums each of 8 vectors: lane i of the result is the sum of `v[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum8(v: [__m256; 8]) -> __m256 {
    let h0 = _mm256_hadd_ps(v[0], v[1]);
    let h1 = _mm256_hadd_ps(v[2], v[3]);
    let h2 = _mm256_hadd_ps(v[4], v[5]);
    let h3 = _mm256_hadd_ps(v[6], v[7]);
    let g0 = _mm256_hadd_ps(h0, h1);
    let g1 = _mm256_hadd_ps(h2, h3);
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(g0, g1),
        _mm256_permute2f128_ps::<0x31>(g0, g1),
    )
}

/// Computes one `R`x`T` tile and stores row r, token t at `out[t * stride + r]`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `p` must point at `R` panel rows and `T` token rows
/// of `p.cols` bytes, `p.n_chunks` chunks and `p.n_halves` halves each, and `out` at `T`
/// output rows of `stride` floats with `R` writable, written by no one else (as `run_panel`
/// checks).
// Row and token indices address several register arrays in lockstep; iterators would hide
// that the loops are fully unrolled over constant bounds.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const R: usize, const T: usize, const SIGNED: bool, const MINS: bool>(
    p: &TilePtrs,
    out: *mut f32,
    stride: usize,
) {
    let (cols, n_chunks) = (p.cols, p.n_chunks);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // GGML's per-block min terms (`m·s`), one scalar FMA chain per output, for `MINS`.
    let mut summs = [[0.0f32; T]; R];
    // Signed and Q8_1 formats have one weight scale per chunk: the products `d_w·d_a` of the
    // tile's rows and tokens are formed eight at a time, one multiply per chunk, into `prods`
    // (lane r + 4t), and each output's is then a broadcast load instead of a multiply of its
    // own (the same products, so the same bits).
    let chunk_scales = SIGNED || MINS;
    // Not zeroed: a kernel call is one small tile, and clearing 1 KiB per call would cost a
    // good part of the work it saves. Only the vectors written for the current batch are read.
    let mut prods = [std::mem::MaybeUninit::<__m256>::uninit(); SCALE_BATCH];
    for c0 in (0..n_chunks).step_by(SCALE_BATCH) {
        let c1 = (c0 + SCALE_BATCH).min(n_chunks);
        if chunk_scales {
            for c in c0..c1 {
                // SAFETY: c < n_chunks: 4 floats at 4c of the group's row scales and 8 at 8c of
                // the pair's token scales, as the caller guarantees for these formats.
                unsafe {
                    prods[c - c0].write(_mm256_mul_ps(
                        _mm256_broadcast_ps(&*p.d_rows.add(4 * c).cast::<__m128>()),
                        _mm256_loadu_ps(p.d_pair.add(8 * c)),
                    ));
                }
            }
        }
        let prods = prods.as_ptr().cast::<f32>();
        for c in c0..c1 {
            // SAFETY: c < n_chunks, so every offset below stays inside the rows that the
            // caller guarantees: 32 bytes at QK*c of each row and 8 floats at 8*c; and
            // c - c0 < SCALE_BATCH vectors of `prods`, each written above for this batch.
            unsafe {
                let a: [__m256i; T] =
                    std::array::from_fn(|t| _mm256_loadu_si256(p.aq.add(t * cols + QK * c).cast()));
                for r in 0..R {
                    let wv = _mm256_loadu_si256(p.wq.add(r * cols + QK * c).cast());
                    let wu = if SIGNED { _mm256_sign_epi8(wv, wv) } else { wv };
                    for t in 0..T {
                        let at = if SIGNED {
                            _mm256_sign_epi8(a[t], wv)
                        } else {
                            a[t]
                        };
                        let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, at), ones);
                        let scale = if chunk_scales {
                            _mm256_broadcast_ss(&*prods.add((c - c0) * 8 + r + 4 * t))
                        } else {
                            _mm256_mul_ps(
                                _mm256_loadu_ps(p.wd.add((r * n_chunks + c) * 8)),
                                _mm256_loadu_ps(p.ad.add((t * n_chunks + c) * 8)),
                            )
                        };
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), scale, acc[r][t]);
                        if MINS {
                            // Both halves hold the block's min and half of its `s` (exact).
                            let m = *p.wm.add(r * p.n_halves + 2 * c);
                            let s = *p.ash.add(t * p.n_halves + 2 * c) * 2.0;
                            summs[r][t] = m.mul_add(s, summs[r][t]);
                        }
                    }
                }
            }
        }
    }
    if MINS {
        for r in 0..R {
            for t in 0..T {
                // SAFETY: r < R rows and t < T tokens are writable, per the contract.
                unsafe { *out.add(t * stride + r) = hsum_ps(acc[r][t]) + summs[r][t] };
            }
        }
        return;
    }
    if !SIGNED {
        let n_halves = p.n_halves;
        for h in (0..n_halves).step_by(8) {
            // SAFETY: h + 8 <= n_halves (a multiple of 8), inside every row's halves.
            unsafe {
                let sh: [__m256; T] =
                    std::array::from_fn(|t| _mm256_loadu_ps(p.ash.add(t * n_halves + h)));
                for r in 0..R {
                    let mh = _mm256_loadu_ps(p.wm.add(r * n_halves + h));
                    for t in 0..T {
                        acc[r][t] = _mm256_fmadd_ps(mh, sh[t], acc[r][t]);
                    }
                }
            }
        }
    }
    if SIGNED {
        for r in 0..R {
            for t in 0..T {
                // SAFETY: r < R rows and t < T tokens are writable, per the contract.
                unsafe { *out.add(t * stride + r) = hsum_ps(acc[r][t]) };
            }
        }
        return;
    }
    if R * T == 8 {
        let sums = hsum8(std::array::from_fn(|i| acc[i / T][i % T]));
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` is 8 writable floats; unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums) };
        for r in 0..R {
            for t in 0..T {
                // SAFETY: r < R rows and t < T tokens are writable, per the contract.
                unsafe { *out.add(t * stride + r) = lanes[r * T + t] };
            }
        }
    } else {
        for r in 0..R {
            for t in 0..T {
                // SAFETY: r < R rows and t < T tokens are writable, per the contract.
                unsafe { *out.add(t * stride + r) = hsum_ps(acc[r][t]) };
            }
        }
    }
}

/// Whether `ty` is dotted against Q8_1 activations, whose tiles reproduce GGML's order
/// exactly (`ggml_vec_dot_q4_1_q8_1`: lanes by FMA per block, mins by a scalar FMA chain,
/// `hsum_float_8`, then the mins added), so that a prompt's matmul gives bit for bit what
/// one `vec_dot` per output gives, as llama.cpp computes these formats at every batch size.
pub(crate) fn has_ggml_mins(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// Multiplies `rows` (1..=TILE_ROWS) rows of `panel` from `row0` with tokens
/// `t_begin..t_end` into `out`.
#[allow(clippy::too_many_arguments)]
pub fn run_panel(
    level: Level,
    ty: GgmlType,
    panel: &Panel,
    row0: usize,
    rows: usize,
    acts: &TileActs,
    t_begin: usize,
    t_end: usize,
    out: OutRows,
) {
    assert!(matches!(level, Level::Avx2 | Level::Avx512Vnni));
    let (cols, n_chunks, n_halves) = (acts.cols, acts.n_chunks, acts.n_halves);
    // The pointer arithmetic of `kernel` relies on these; they hold by construction in
    // `matmul`, so a failure is a bug, not bad input.
    assert!((1..=TILE_ROWS).contains(&rows) && t_begin <= t_end && n_chunks * QK == cols);
    assert!(n_halves % 8 == 0 && n_halves >= 2 * n_chunks);
    let row_end = row0 + rows;
    assert!(panel.q.len() >= row_end * cols && panel.dv.len() >= row_end * n_chunks * 8);
    assert!(panel.mh.len() >= row_end * n_halves);
    assert!(acts.qs.len() >= t_end * cols && acts.d.len() >= t_end * n_chunks * 8);
    assert!(acts.sh.len() >= t_end * n_halves);
    let (out_base, stride) = out.base(rows, t_end);
    let signed = crate::matmul::is_signed_tile(ty);
    let mins = has_ggml_mins(ty);
    // The kernels of these formats read the compact scales: the row group's and each token
    // pair's (tiles start at even tokens, the token blocks being even).
    let chunk_scales = signed || mins;
    assert_eq!(chunk_scales, crate::matmul::has_chunk_scales(ty));
    let group = row0 / TILE_ROWS;
    if chunk_scales {
        assert!(row0.is_multiple_of(TILE_ROWS));
        assert!(panel.d_rows.len() >= (group + 1) * n_chunks * TILE_ROWS);
        assert!(
            t_begin.is_multiple_of(2) && acts.d_pairs.len() >= t_end.div_ceil(2) * n_chunks * 8
        );
    }
    let mut t = t_begin;
    while t < t_end {
        let tokens = TILE_TOKENS.min(t_end - t);
        let p = TilePtrs {
            wq: panel.q[row0 * cols..].as_ptr(),
            wd: panel.dv[row0 * n_chunks * 8..].as_ptr(),
            wm: panel.mh[row0 * n_halves..].as_ptr(),
            aq: acts.qs[t * cols..].as_ptr(),
            ad: acts.d[t * n_chunks * 8..].as_ptr(),
            ash: acts.sh[t * n_halves..].as_ptr(),
            d_rows: if chunk_scales {
                panel.d_rows[group * n_chunks * TILE_ROWS..].as_ptr()
            } else {
                std::ptr::null()
            },
            d_pair: if chunk_scales {
                acts.d_pairs[t / 2 * n_chunks * 8..].as_ptr()
            } else {
                std::ptr::null()
            },
            cols,
            n_chunks,
            n_halves,
        };
        // SAFETY: token t < t_end, inside the output `out.base` checked.
        let o = unsafe { out_base.add(t * stride) };
        macro_rules! go {
            ($r:literal, $t:literal) => {
                // SAFETY: `level` is AVX2 or better, which `simd::level` reports only after
                // checking AVX2, FMA and F16C on this CPU; `p` covers $r panel rows and $t
                // tokens from t, and `o` $t output rows with $r elements of this job's rows
                // (checked by `out.base`).
                unsafe {
                    if signed {
                        kernel::<$r, $t, true, false>(&p, o, stride)
                    } else if mins {
                        kernel::<$r, $t, false, true>(&p, o, stride)
                    } else {
                        kernel::<$r, $t, false, false>(&p, o, stride)
                    }
                }
            };
        }
        match (rows, tokens) {
            (4, 2) => go!(4, 2),
            (4, 1) => go!(4, 1),
            (3, 2) => go!(3, 2),
            (3, 1) => go!(3, 1),
            (2, 2) => go!(2, 2),
            (2, 1) => go!(2, 1),
            (1, 2) => go!(1, 2),
            _ => go!(1, 1),
        }
        t += tokens;
    }
}

/// Stores 16 bytes at the start of `dst`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store16(dst: &mut [u8], v: __m128i) {
    let dst = &mut dst[..16];
    // SAFETY: `dst` holds 16 writable bytes; the store has no alignment requirement.
    unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), v) }
}

/// Stores 8 floats at the start of `dst`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_ps(dst: &mut [f32], v: __m256) {
    let dst = &mut dst[..8];
    // SAFETY: `dst` holds 8 writable floats; the store has no alignment requirement.
    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
}

/// `matmul::unpack_row` for Q4_0, Q4_1 and Q8_0 with AVX2 and F16C: the same output, about
/// three times faster than the portable code, which matters when few tokens share the
/// unpacking. Returns false for the other formats.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn unpack_row(ty: GgmlType, row: &[u8], q: &mut [u8], dv: &mut [f32], mh: &mut [f32]) -> bool {
    use super::avx2::{f16_at, load16};
    use crate::blocks::{q4_0, q4_1, q8_0};
    let low = _mm_set1_epi8(0x0F);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (size, qs) = if ty == GgmlType::Q4_0 {
                (q4_0::SIZE, q4_0::QS)
            } else {
                (q4_1::SIZE, q4_1::QS)
            };
            for (c, x) in row.chunks_exact(size).enumerate() {
                let t = load16(&x[qs..]);
                // Q4_0 is unpacked signed (`matmul::is_signed_tile`), Q4_1 unsigned.
                let bias = _mm_set1_epi8(if ty == GgmlType::Q4_0 { 8 } else { 0 });
                store16(&mut q[QK * c..], _mm_sub_epi8(_mm_and_si128(t, low), bias));
                store16(
                    &mut q[QK * c + 16..],
                    _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16::<4>(t), low), bias),
                );
                let d = f16_at(x, 0);
                let m = if ty == GgmlType::Q4_0 {
                    0.0
                } else {
                    f16_at(x, q4_1::M)
                };
                store_ps(&mut dv[8 * c..], _mm256_set1_ps(d));
                mh[2 * c] = m;
                mh[2 * c + 1] = m;
            }
            true
        }
        GgmlType::Q8_0 => {
            for (c, x) in row.chunks_exact(q8_0::SIZE).enumerate() {
                q[QK * c..QK * c + QK].copy_from_slice(&x[q8_0::QS..q8_0::QS + QK]);
                store_ps(&mut dv[8 * c..], _mm256_set1_ps(f16_at(x, q8_0::D)));
                mh[2 * c] = 0.0;
                mh[2 * c + 1] = 0.0;
            }
            true
        }
        _ => false,
    }
}
