//! x86-64 SIMD kernels. `avx2` holds the dot products of every weight format and the tiled
//! integer matmul kernel (also on AVX-512 machines, so results do not depend on the machine);
//! `avx512` the AVX-512 VNNI kernels whose results are bit for bit the AVX2 ones (Q4_K and Q6_K
//! prompts);
//! `signed` the same for the signed legacy formats (Q4_0 and Q5_0 decode; Q4_0, Q5_0, Q8_0
//! prompts).

pub mod amx;
pub mod avx2;
pub mod avx512;
pub mod q4_0_rows8;
pub mod q4_k_rows8;
pub mod signed;
pub mod tile;

use crate::simd::Level;
use crate::GgmlType;

/// How far ahead of its reads a memory-bound matvec prefetches its weights, in bytes. A matvec
/// over four rows at a time reads four places of its group at once, a pattern the hardware
/// prefetchers follow poorly; a plain forward stream of software prefetches this far ahead
/// (about the bytes one core has in flight at DRAM latency, with margin) took a Q8_0
/// 262144x640 matvec on one Zen 4 core from 9-10 GB/s to 14-19 GB/s (a plain read loop:
/// 16.7 GB/s).
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// Prefetches the cache lines of the `step` bytes at [`PREFETCH_AHEAD`] past `p`. Called once
/// per step of a kernel that advances through contiguous weights by `step` bytes per step, it
/// keeps a forward stream of lines in flight; lines a step shares with the next are asked for
/// twice, which costs next to nothing. Prefetches never fault, and `wrapping_add` keeps the
/// address arithmetic defined past the end of the weights.
#[inline(always)]
pub(crate) fn prefetch_ahead(p: *const u8, step: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = p.wrapping_add(PREFETCH_AHEAD);
    let mut off = 0;
    while off < step {
        // SAFETY: a prefetch is a hint: it reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// One row's dot product on an x86 SIMD `level`, or `None` when that level has no kernel for
/// `ty` (the caller then uses the scalar reference).
pub fn vec_dot(level: Level, ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> Option<f32> {
    if !matches!(level, Level::Avx2 | Level::Avx512Vnni) {
        return None;
    }
    use GgmlType::*;
    // SAFETY: `level` is at least AVX2, which `simd::level` only reports after checking AVX2,
    // FMA and F16C on this CPU; every kernel below needs exactly those.
    unsafe {
        Some(match ty {
            Q4_0 => avx2::vec_dot_q4_0_q8_0(w, a),
            Q4_1 => avx2::vec_dot_q4_1_q8_1(w, a),
            Q5_0 => avx2::vec_dot_q5_0_q8_0(w, a),
            Q5_1 => avx2::vec_dot_q5_1_q8_1(w, a),
            Q8_0 => avx2::vec_dot_q8_0_q8_0(w, a),
            Q2_K => avx2::vec_dot_q2_k_q8_k(w, a),
            Q3_K => avx2::vec_dot_q3_k_q8_k(w, a),
            Q4_K => avx2::vec_dot_q4_k_q8_k(w, a),
            Q5_K => avx2::vec_dot_q5_k_q8_k(w, a),
            Q6_K => avx2::vec_dot_q6_k_q8_k(w, a),
            F16 => avx2::vec_dot_f16(w, a, n),
            _ => return None,
        })
    }
}

/// Dot products of consecutive weight rows (contiguous in `w`, one per element of `out`) with
/// one activation row, where `level` has a multi-row kernel for `ty` (the formats of the
/// memory-bound matvecs that matter most); returns whether it did.
pub fn matvec(level: Level, ty: GgmlType, w: &[u8], a: &[u8], out: &mut [f32]) -> bool {
    if !matches!(level, Level::Avx2 | Level::Avx512Vnni) {
        return false;
    }
    // SAFETY: `level` is at least AVX2, which `simd::level` only reports after checking AVX2,
    // FMA and F16C on this CPU, and AVX-512 F/BW/VL/VNNI for `Avx512Vnni`; the kernels need
    // exactly those.
    unsafe {
        match ty {
            GgmlType::Q4_0 if level == Level::Avx512Vnni => signed::matvec_q4_0_q8_0(w, a, out),
            GgmlType::Q4_0 => avx2::matvec_q4_0_q8_0(w, a, out),
            GgmlType::Q4_1 => avx2::matvec_q4_1_q8_1(w, a, out),
            // The AVX2 kernel on AVX-512 machines too: with the weights streamed in ahead it
            // ran a 262144x640 matvec (Gemma 3's output) in a median 7.4-8.5 ms on one Zen 4
            // core against 9.7-11.6 ms for an AVX-512 VNNI one (two rows per register), and
            // Gemma 3 decoded 10-20% faster with it.
            GgmlType::Q8_0 => avx2::matvec_q8_0_q8_0(w, a, out),
            GgmlType::Q5_0 if level == Level::Avx512Vnni => signed::matvec_q5_0_q8_0(w, a, out),
            GgmlType::Q5_0 => avx2::matvec_q5_0_q8_0(w, a, out),
            GgmlType::Q5_1 => avx2::matvec_q5_1_q8_1(w, a, out),
            _ => return false,
        }
    }
    true
}
