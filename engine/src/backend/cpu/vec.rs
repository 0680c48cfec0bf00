//! f32 vector kernels of the CPU backend (dot products and scaled adds for attention), chosen at
//! run time: an AVX2+FMA build of the same loops where the CPU has it, the portable one elsewhere.
//!
//! The loops are written over fixed 8-wide lanes so the compiler vectorizes them without having
//! to reassociate float additions; the `#[target_feature]` copies only change which instructions
//! it may use.

use std::sync::OnceLock;

const LANES: usize = 8;

#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += x * y;
    }
    // Pairwise reduction of the lanes.
    let s4 = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    sum + (s4[0] + s4[2]) + (s4[1] + s4[3])
}

#[inline(always)]
fn axpy_lanes(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_lanes(y, a, x)
}

fn has_avx2() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `sum(a[i] * b[i])` over the shorter length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { dot_avx2(a, b) };
    }
    dot_lanes(a, b)
}

/// `y[i] += a * x[i]` over the shorter length.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { axpy_avx2(y, a, x) };
    }
    axpy_lanes(y, a, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatched_kernels_match_the_portable_ones() {
        for n in [0usize, 1, 7, 8, 9, 64, 100, 256] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            // Inputs are multiples of 1/8 with small products, so every partial sum is exact in f32.
            assert_eq!(dot(&a, &b) as f64, exact, "n = {n}");
            assert_eq!(dot_lanes(&a, &b) as f64, exact, "n = {n}");
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(&mut y1, 0.5, &a);
            axpy_lanes(&mut y2, 0.5, &a);
            assert_eq!(y1, y2);
        }
    }
}
