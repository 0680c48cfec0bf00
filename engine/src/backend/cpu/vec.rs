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
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
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

#[inline(always)]
fn dot_rows_lanes(q: &[f32], rows: &[f32], scale: f32, out: &mut [f32]) {
    let d = q.len();
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(d)) {
        *o = dot_lanes(q, row) * scale;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2(q: &[f32], rows: &[f32], scale: f32, out: &mut [f32]) {
    dot_rows_lanes(q, rows, scale, out)
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

/// `out[i] = dot(q, rows[i * q.len()..][..q.len()]) * scale` for each row: one dispatch for a
/// whole block of keys.
#[inline]
pub fn dot_rows(q: &[f32], rows: &[f32], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { dot_rows_avx2(q, rows, scale, out) };
    }
    dot_rows_lanes(q, rows, scale, out)
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

/// `y[i] = f16(y[i] + a * x[i])`: GGML's `ggml_vec_mad_f16` on an f16 accumulator held as f32
/// values (fused multiply-add, then rounding to f16).
#[inline]
pub fn mad_round_f16(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: `has_f16c` checked at run time that the CPU supports AVX2, FMA and F16C.
        return unsafe { f16c::mad_round(y, a, x) };
    }
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = half::f16::from_f32(xi.mul_add(a, *yi)).to_f32();
    }
}

/// `y[i] = f16(y[i] * a)`: GGML's `ggml_vec_scale_f16` on an f16 accumulator held as f32 values.
#[inline]
pub fn scale_round_f16(y: &mut [f32], a: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: `has_f16c` checked at run time that the CPU supports AVX2, FMA and F16C.
        return unsafe { f16c::scale_round(y, a) };
    }
    for yi in y.iter_mut() {
        *yi = half::f16::from_f32(*yi * a).to_f32();
    }
}

/// `y[i] = f16(y[i])`: rounds every value to the nearest f16.
#[inline]
pub fn round_f16(y: &mut [f32]) {
    scale_round_f16(y, 1.0)
}

fn has_f16c() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx2() && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// Rounds 8 lanes to f16 and back.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round8(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn mad_round(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, and both slices hold at least n values.
            unsafe {
                let py = y.as_mut_ptr().add(i);
                let vy = _mm256_loadu_ps(py);
                let vx = _mm256_loadu_ps(x.as_ptr().add(i));
                _mm256_storeu_ps(py, round8(_mm256_fmadd_ps(vx, va, vy)));
            }
            i += 8;
        }
        for j in i..n {
            y[j] = half::f16::from_f32(x[j].mul_add(a, y[j])).to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_round(y: &mut [f32], a: f32) {
        let n = y.len();
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n = y.len().
            unsafe {
                let py = y.as_mut_ptr().add(i);
                _mm256_storeu_ps(py, round8(_mm256_mul_ps(_mm256_loadu_ps(py), va)));
            }
            i += 8;
        }
        for v in &mut y[i..] {
            *v = half::f16::from_f32(*v * a).to_f32();
        }
    }
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
            if n > 0 {
                let rows: Vec<f32> = a.iter().chain(&b).copied().collect();
                let mut out = [0f32; 2];
                dot_rows(&a, &rows, 2.0, &mut out);
                assert_eq!(out, [2.0 * dot(&a, &a), 2.0 * dot(&a, &b)]);
            }
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(&mut y1, 0.5, &a);
            axpy_lanes(&mut y2, 0.5, &a);
            assert_eq!(y1, y2);
            // The f16-rounding kernels against a scalar twin.
            let mut r1 = b.iter().map(|v| v * 1.37 + 0.011).collect::<Vec<f32>>();
            let mut r2 = r1.clone();
            mad_round_f16(&mut r1, 0.3, &a);
            for (yi, &xi) in r2.iter_mut().zip(&a) {
                *yi = half::f16::from_f32(xi.mul_add(0.3, *yi)).to_f32();
            }
            assert_eq!(r1, r2, "n = {n}");
            scale_round_f16(&mut r1, 0.77);
            r2.iter_mut()
                .for_each(|v| *v = half::f16::from_f32(*v * 0.77).to_f32());
            assert_eq!(r1, r2, "n = {n}");
        }
    }
}
