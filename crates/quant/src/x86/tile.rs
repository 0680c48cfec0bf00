//! The register-tiled integer micro-kernel of the tiled matmul (see `matmul`'s module docs
//! for the layout): `R` weight rows by `T` tokens, all accumulators in registers, each loaded
//! weight chunk used `T` times and each activation chunk `R` times.
//!
//! Per row, token and 32-element chunk: `maddubs` + `madd` (exact i32 sums of 8 lanes),
//! conversion to f32, and one FMA with the combined scale `dv·d`; the offset term adds one FMA
//! per row, token and eight halves.

use std::arch::x86_64::*;

use super::avx2::hsum_ps;
use crate::blocks::QK;
use crate::matmul::{Panel, TileActs, TILE_ROWS, TILE_TOKENS};
use crate::simd::Level;
use crate::GgmlType;

/// Base pointers and strides of one tile's operands; built by [`run`] from checked slices.
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

/// # Safety
/// The CPU must have AVX2, FMA and F16C, and `p` must point at `R` panel rows and `T` token
/// rows of `p.cols` bytes, `p.n_chunks` chunks and `p.n_halves` halves each (as `run` checks).
// Row and token indices address several register arrays in lockstep; iterators would hide
// that the loops are fully unrolled over constant bounds.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const R: usize, const T: usize, const SIGNED: bool>(
    p: &TilePtrs,
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    let (cols, n_chunks) = (p.cols, p.n_chunks);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for c in 0..n_chunks {
        // SAFETY: c < n_chunks, so every offset below stays inside the rows that the caller
        // guarantees: 32 bytes at QK*c of each row, 8 floats at 8*c, 1 float at c.
        unsafe {
            let a: [__m256i; T] =
                std::array::from_fn(|t| _mm256_loadu_si256(p.aq.add(t * cols + QK * c).cast()));
            let da: [__m256; T] =
                std::array::from_fn(|t| _mm256_broadcast_ss(&*p.ad.add(t * n_chunks + c)));
            for r in 0..R {
                let wv = _mm256_loadu_si256(p.wq.add(r * cols + QK * c).cast());
                let dv = _mm256_loadu_ps(p.wd.add((r * n_chunks + c) * 8));
                let wu = if SIGNED { _mm256_sign_epi8(wv, wv) } else { wv };
                for t in 0..T {
                    let at = if SIGNED {
                        _mm256_sign_epi8(a[t], wv)
                    } else {
                        a[t]
                    };
                    let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, at), ones);
                    let scale = _mm256_mul_ps(dv, da[t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), scale, acc[r][t]);
                }
            }
        }
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
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum_ps(acc[r][t]);
        }
    }
}

/// Runs the kernel for `rows` (1..=TILE_ROWS) panel rows and `tokens` (1..=TILE_TOKENS)
/// tokens from `t0`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    level: Level,
    ty: GgmlType,
    panel: &Panel,
    rows: usize,
    acts: &TileActs,
    t0: usize,
    tokens: usize,
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    assert!(matches!(level, Level::Avx2 | Level::Avx512Vnni));
    let (cols, n_chunks, n_halves) = (acts.cols, acts.n_chunks, acts.n_halves);
    // The pointer arithmetic of `kernel` relies on these; they hold by construction in
    // `matmul`, so a failure is a bug, not bad input.
    assert!(rows <= TILE_ROWS && tokens <= TILE_TOKENS && n_chunks * QK == cols);
    assert!(n_halves % 8 == 0 && n_halves >= 2 * n_chunks);
    assert!(panel.q.len() >= rows * cols && panel.dv.len() >= rows * n_chunks * 8);
    assert!(panel.mh.len() >= rows * n_halves);
    assert!(acts.qs.len() >= (t0 + tokens) * cols && acts.d.len() >= (t0 + tokens) * n_chunks);
    assert!(acts.sh.len() >= (t0 + tokens) * n_halves);
    let p = TilePtrs {
        wq: panel.q.as_ptr(),
        wd: panel.dv.as_ptr(),
        wm: panel.mh.as_ptr(),
        aq: acts.qs[t0 * cols..].as_ptr(),
        ad: acts.d[t0 * n_chunks..].as_ptr(),
        ash: acts.sh[t0 * n_halves..].as_ptr(),
        cols,
        n_chunks,
        n_halves,
    };
    let signed = ty == GgmlType::Q8_0;
    macro_rules! go {
        ($r:literal, $t:literal) => {
            // SAFETY: `level` is AVX2 or better, which `simd::level` reports only after
            // checking AVX2, FMA and F16C on this CPU; `p` covers $r rows and $t tokens
            // (asserted above).
            unsafe {
                if signed {
                    kernel::<$r, $t, true>(&p, out)
                } else {
                    kernel::<$r, $t, false>(&p, out)
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
}
