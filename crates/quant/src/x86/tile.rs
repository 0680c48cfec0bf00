//! The register-tiled integer micro-kernel of the tiled matmul (see `matmul`'s module docs
//! for the layout): `R` weight rows by `T` tokens, all accumulators in registers, each loaded
//! weight chunk used `T` times and each activation chunk `R` times.
//!
//! Per row, token and 32-element chunk: `maddubs` + `madd` (exact i32 sums of 8 lanes),
//! conversion to f32, one FMA with the combined scale `dv·d`, and one FMA adding the offset
//! term `mv·sv`.

use std::arch::x86_64::*;

use super::avx2::{hsum_ps, load32, load_ps};
use crate::blocks::QK;
use crate::matmul::{Panel, TileActs, TILE_ROWS, TILE_TOKENS};
use crate::simd::Level;
use crate::GgmlType;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kernel<const R: usize, const T: usize, const SIGNED: bool>(
    panel: &Panel,
    acts: &TileActs,
    t0: usize,
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    let cols = acts.cols;
    let n_chunks = acts.n_chunks;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let wq: [&[u8]; R] = std::array::from_fn(|r| &panel.q[r * cols..(r + 1) * cols]);
    let wd: [&[f32]; R] = std::array::from_fn(|r| &panel.dv[r * n_chunks * 8..(r + 1) * n_chunks * 8]);
    let wm: [&[f32]; R] = std::array::from_fn(|r| &panel.mv[r * n_chunks * 8..(r + 1) * n_chunks * 8]);
    let aq: [&[u8]; T] = std::array::from_fn(|t| &acts.qs[(t0 + t) * cols..(t0 + t + 1) * cols]);
    let ad: [&[f32]; T] = std::array::from_fn(|t| &acts.d[(t0 + t) * n_chunks..(t0 + t + 1) * n_chunks]);
    let asv: [&[f32]; T] =
        std::array::from_fn(|t| &acts.sv[(t0 + t) * n_chunks * 8..(t0 + t + 1) * n_chunks * 8]);
    for c in 0..n_chunks {
        let a: [__m256i; T] = std::array::from_fn(|t| load32(&aq[t][QK * c..]));
        let da: [__m256; T] = std::array::from_fn(|t| _mm256_set1_ps(ad[t][c]));
        for r in 0..R {
            let wv = load32(&wq[r][QK * c..]);
            let dv = load_ps(&wd[r][8 * c..]);
            let wu = if SIGNED { _mm256_sign_epi8(wv, wv) } else { wv };
            for t in 0..T {
                let at = if SIGNED { _mm256_sign_epi8(a[t], wv) } else { a[t] };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, at), ones);
                let scale = _mm256_mul_ps(dv, da[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][t]);
                if !SIGNED {
                    let mv = load_ps(&wm[r][8 * c..]);
                    acc[r][t] = _mm256_fmadd_ps(mv, load_ps(&asv[t][8 * c..]), acc[r][t]);
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
    debug_assert!(matches!(level, Level::Avx2 | Level::Avx512Vnni));
    let signed = ty == GgmlType::Q8_0;
    macro_rules! go {
        ($r:literal, $t:literal) => {
            // SAFETY: `level` is AVX2 or better, which `simd::level` reports only after
            // checking AVX2, FMA and F16C on this CPU.
            unsafe {
                if signed {
                    kernel::<$r, $t, true>(panel, acts, t0, out)
                } else {
                    kernel::<$r, $t, false>(panel, acts, t0, out)
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
