//! The AVX-512 VNNI tile kernel: the same tile layout and arithmetic as `tile` (AVX2), with
//! `vpdpbusd` (u8·i8 summed straight into i32, no i16 saturation) in place of
//! `maddubs` + `madd`, 512-bit registers covering two 32-element chunks at once, and 32
//! registers allowing a 4 x 4 tile.
//!
//! Q8_0 weights are signed; `vpdpbusd` wants one unsigned operand, so the kernel uses
//! `w + 128` (an xor of the sign bit) and subtracts `128·Σa`, computed once per token chunk.

use std::arch::x86_64::*;

use crate::blocks::QK;
use crate::matmul::{OutRows, Panel, TileActs};
use crate::GgmlType;

/// Rows and tokens of the AVX-512 tile.
const ROWS: usize = 4;
const TOKENS: usize = 4;

struct TilePtrs {
    wq: *const u8,
    wd: *const f32,
    wm: *const f32,
    aq: *const u8,
    ad: *const f32,
    ash: *const f32,
    cols: usize,
    n_chunks: usize,
    n_halves: usize,
}

/// One step over chunks `c` and `c + 1` (only `c` when `HALF`).
///
/// # Safety
/// As [`kernel`]; `c + 1 < n_chunks` unless `HALF`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn step<const R: usize, const T: usize, const SIGNED: bool, const HALF: bool>(
    p: &TilePtrs,
    c: usize,
    acc: &mut [[__m512; T]; R],
) {
    let (cols, n_chunks) = (p.cols, p.n_chunks);
    let bytes_mask: __mmask64 = if HALF { 0xFFFF_FFFF } else { u64::MAX };
    let floats_mask: __mmask16 = if HALF { 0x00FF } else { 0xFFFF };
    let zero = _mm512_setzero_si512();
    // SAFETY: the masks limit every load to the chunks that exist (c, and c + 1 unless
    // HALF), inside the rows the caller guarantees.
    unsafe {
        let a: [__m512i; T] = std::array::from_fn(|t| {
            _mm512_maskz_loadu_epi8(bytes_mask, p.aq.add(t * cols + QK * c).cast())
        });
        let da: [__m512; T] = std::array::from_fn(|t| {
            _mm512_maskz_loadu_ps(floats_mask, p.ad.add((t * n_chunks + c) * 8))
        });
        let a_sum: [__m512i; T] = if SIGNED {
            std::array::from_fn(|t| _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128), a[t]))
        } else {
            [zero; T]
        };
        for r in 0..R {
            let wv = _mm512_maskz_loadu_epi8(bytes_mask, p.wq.add(r * cols + QK * c).cast());
            let dv = _mm512_maskz_loadu_ps(floats_mask, p.wd.add((r * n_chunks + c) * 8));
            let wu = if SIGNED {
                _mm512_xor_si512(wv, _mm512_set1_epi8(-128))
            } else {
                wv
            };
            for t in 0..T {
                let mut prod = _mm512_dpbusd_epi32(zero, wu, a[t]);
                if SIGNED {
                    prod = _mm512_sub_epi32(prod, a_sum[t]);
                }
                let scale = _mm512_mul_ps(dv, da[t]);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), scale, acc[r][t]);
            }
        }
    }
}

/// Computes one `R`x`T` tile and stores row r, token t at `out[t * stride + r]`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI; `p` must point at `R` panel rows and `T` token
/// rows of `p.cols` bytes, `p.n_chunks` chunks and `p.n_halves` halves each, and `out` at `T`
/// output rows of `stride` floats with `R` writable, written by no one else.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const R: usize, const T: usize, const SIGNED: bool>(
    p: &TilePtrs,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let pairs = p.n_chunks / 2;
    for k in 0..pairs {
        // SAFETY: 2k + 1 < n_chunks; the caller's contract covers the rest.
        unsafe { step::<R, T, SIGNED, false>(p, 2 * k, &mut acc) };
    }
    if p.n_chunks % 2 == 1 {
        // SAFETY: the last chunk exists; HALF loads only it.
        unsafe { step::<R, T, SIGNED, true>(p, p.n_chunks - 1, &mut acc) };
    }
    if !SIGNED {
        let n_halves = p.n_halves;
        for h in (0..n_halves).step_by(8) {
            // SAFETY: h + 8 <= n_halves (a multiple of 8), inside every row's halves.
            unsafe {
                let sh: [__m512; T] = std::array::from_fn(|t| {
                    _mm512_zextps256_ps512(_mm256_loadu_ps(p.ash.add(t * n_halves + h)))
                });
                for r in 0..R {
                    let mh = _mm512_zextps256_ps512(_mm256_loadu_ps(p.wm.add(r * n_halves + h)));
                    for t in 0..T {
                        acc[r][t] = _mm512_fmadd_ps(mh, sh[t], acc[r][t]);
                    }
                }
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            // SAFETY: r < R rows and t < T tokens are writable, per the contract.
            unsafe { *out.add(t * stride + r) = _mm512_reduce_add_ps(acc[r][t]) };
        }
    }
}

/// Multiplies `rows` (1..=4) rows of `panel` from `row0` with tokens `t_begin..t_end` into
/// `out`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI (`simd::Level::Avx512Vnni`).
#[allow(clippy::too_many_arguments)]
pub unsafe fn run_panel(
    ty: GgmlType,
    panel: &Panel,
    row0: usize,
    rows: usize,
    acts: &TileActs,
    t_begin: usize,
    t_end: usize,
    out: OutRows,
) {
    let (cols, n_chunks, n_halves) = (acts.cols, acts.n_chunks, acts.n_halves);
    // The pointer arithmetic of `kernel` relies on these; they hold by construction in
    // `matmul`, so a failure is a bug, not bad input.
    assert!((1..=ROWS).contains(&rows) && t_begin <= t_end && n_chunks * QK == cols);
    assert!(n_halves % 8 == 0 && n_halves >= 2 * n_chunks);
    let row_end = row0 + rows;
    assert!(panel.q.len() >= row_end * cols && panel.dv.len() >= row_end * n_chunks * 8);
    assert!(panel.mh.len() >= row_end * n_halves);
    assert!(acts.qs.len() >= t_end * cols && acts.d.len() >= t_end * n_chunks * 8);
    assert!(acts.sh.len() >= t_end * n_halves);
    let (out_base, stride) = out.base(rows, t_end);
    let signed = ty == GgmlType::Q8_0;
    let mut t = t_begin;
    while t < t_end {
        let tokens = TOKENS.min(t_end - t);
        let p = TilePtrs {
            wq: panel.q[row0 * cols..].as_ptr(),
            wd: panel.dv[row0 * n_chunks * 8..].as_ptr(),
            wm: panel.mh[row0 * n_halves..].as_ptr(),
            aq: acts.qs[t * cols..].as_ptr(),
            ad: acts.d[t * n_chunks * 8..].as_ptr(),
            ash: acts.sh[t * n_halves..].as_ptr(),
            cols,
            n_chunks,
            n_halves,
        };
        // SAFETY: token t < t_end, inside the output `out.base` checked.
        let o = unsafe { out_base.add(t * stride) };
        macro_rules! go {
            ($r:literal, $t:literal) => {
                // SAFETY: the caller guarantees the CPU features; `p` covers $r panel rows
                // and $t tokens from t, and `o` $t output rows with $r elements of this
                // job's rows (checked above and by `out.base`).
                unsafe {
                    if signed {
                        kernel::<$r, $t, true>(&p, o, stride)
                    } else {
                        kernel::<$r, $t, false>(&p, o, stride)
                    }
                }
            };
        }
        match (rows, tokens) {
            (4, 4) => go!(4, 4),
            (4, 3) => go!(4, 3),
            (4, 2) => go!(4, 2),
            (4, 1) => go!(4, 1),
            (3, 4) => go!(3, 4),
            (3, 3) => go!(3, 3),
            (3, 2) => go!(3, 2),
            (3, 1) => go!(3, 1),
            (2, 4) => go!(2, 4),
            (2, 3) => go!(2, 3),
            (2, 2) => go!(2, 2),
            (2, 1) => go!(2, 1),
            (1, 4) => go!(1, 4),
            (1, 3) => go!(1, 3),
            (1, 2) => go!(1, 2),
            _ => go!(1, 1),
        }
        t += tokens;
    }
}
