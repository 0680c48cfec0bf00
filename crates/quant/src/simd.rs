//! Run-time choice of the SIMD path. The CPU is probed once (`is_x86_feature_detected!`, or
//! NEON, which every aarch64 Linux CPU has) and the answer cached; binaries are never built for
//! the builder's CPU (`-C target-cpu=native`), since release artifacts run elsewhere.
//!
//! AVX-512 is used only for what this crate has AVX-512 kernels for; everything else falls
//! through to the AVX2 kernels, then to the scalar reference.

use std::sync::OnceLock;

use crate::{scalar, GgmlType};

/// A SIMD instruction set level, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The plain reference code.
    Scalar,
    /// aarch64 Advanced SIMD.
    Neon,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI (`vpdpbusd`), on top of AVX2.
    Avx512Vnni,
}

impl Level {
    /// The name shown by `ember info` and the benchmarks.
    pub const fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Neon => "neon",
            Level::Avx2 => "avx2",
            Level::Avx512Vnni => "avx512vnni",
        }
    }
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        if avx512 {
            return Level::Avx512Vnni;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Level::Neon;
        }
    }
    Level::Scalar
}

/// The best level this CPU supports (probed once).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(detect)
}

/// Every level this CPU can run, scalar first: the set the tests compare against each other.
pub fn available_levels() -> Vec<Level> {
    let best = level();
    [Level::Scalar, Level::Neon, Level::Avx2, Level::Avx512Vnni]
        .into_iter()
        .filter(|l| match l {
            Level::Scalar => true,
            Level::Neon => best == Level::Neon,
            Level::Avx2 | Level::Avx512Vnni => {
                *l <= best && matches!(best, Level::Avx2 | Level::Avx512Vnni)
            }
        })
        .collect()
}

/// The name of the SIMD path in use, e.g. "avx512vnni", "avx2", "neon" or "scalar";
/// "avx512vnni+amx" where Q4_K prompt products also use AMX tiles (see `x86::amx::usable`).
pub fn detected() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if crate::x86::amx::usable() {
        return "avx512vnni+amx";
    }
    level().name()
}

/// One row's dot product on `level` (which the CPU must support); arguments already checked.
pub(crate) fn vec_dot(level: Level, ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f32 {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512Vnni => {
            if let Some(v) = crate::x86::vec_dot(level, ty, w, a, n) {
                return v;
            }
        }
        #[cfg(target_arch = "aarch64")]
        Level::Neon => {
            if let Some(v) = crate::aarch64::vec_dot(ty, w, a) {
                return v;
            }
        }
        _ => {}
    }
    scalar::vec_dot(ty, w, a, n)
}

/// Dot products of consecutive weight rows of `ty` (contiguous in `w`, one per element of
/// `out`) with one activation row on `level`, where a multi-row kernel exists; returns whether
/// it ran (else the caller computes the rows one by one).
pub(crate) fn matvec(level: Level, ty: GgmlType, w: &[u8], a: &[u8], out: &mut [f32]) -> bool {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512Vnni => crate::x86::matvec(level, ty, w, a, out),
        _ => {
            let _ = (ty, w, a, out);
            false
        }
    }
}

/// Quantizes activations (whole blocks of `src`) to `ty`, a vec_dot_type, on `level`: what
/// `scalar::quantize` gives, bit for bit, faster where the level has a kernel for `ty`.
pub(crate) fn quantize(level: Level, ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(level, Level::Avx2 | Level::Avx512Vnni) {
        // SAFETY: `level` is at least AVX2, which `simd::level` only reports after checking
        // AVX2, FMA and F16C on this CPU.
        if unsafe { crate::x86::avx2::quantize_q8_activations(ty, src, dst) } {
            return;
        }
    }
    let _ = level;
    scalar::quantize(ty, src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD levels' activation quantizers give the scalar code's bytes, on values that
    /// land exactly on rounding ties (`v·127/amax` = k + 0.5, where half-to-even and
    /// half-away-from-zero part), on zero blocks, non-finite values, subnormal blocks and
    /// random ones (for Q8_K, whose blocks are 256 elements, these fall in its first block;
    /// its last block holds its maximum twice with opposite signs, and the first decides).
    #[test]
    fn quantize_matches_scalar_bit_for_bit() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let cols = 32 * 40;
        let mut x: Vec<f32> = (0..cols).map(|_| next() * 7.0).collect();
        // Block 1: amax 127, so the quants are the values themselves: ties at k + 0.5.
        for (j, v) in x[32..64].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { j as f32 - 16.5 };
        }
        x[64..96].fill(0.0);
        // Non-finite values and a block so small that 127/amax overflows: NaN products and
        // infinite ones, which the saturating cast sends to 0 and to ±127/-128.
        x[100] = f32::NAN;
        x[131] = f32::INFINITY;
        x[140] = f32::NEG_INFINITY;
        for (j, v) in x[160..192].iter_mut().enumerate() {
            *v = if j % 3 == 0 { -1e-40 } else { 3e-41 };
        }
        x[192..224].fill(-0.0);
        x[1100] = -9.5;
        x[1200] = 9.5;
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
            let bytes = cols / ty.block_size() * ty.type_size();
            let mut want = vec![0u8; bytes];
            scalar::quantize(ty, &x, &mut want);
            for level in available_levels() {
                let mut got = vec![0u8; bytes];
                quantize(level, ty, &x, &mut got);
                assert_eq!(got, want, "{ty} on {level:?}");
            }
        }
    }
}
