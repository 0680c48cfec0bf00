//! Row-wise and element-wise CPU ops, written to round the way GGML's CPU path does.

use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;

use crate::backend::{RopeMode, RopeParams};

/// Elements per rayon task for element-wise ops; smaller inputs run on one thread.
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// Applies `f` to `dst[i], src[i]`, in parallel for long inputs.
pub fn par_zip(dst: &mut [f32], src: &[f32], f: impl Fn(&mut f32, f32) + Sync + Send) {
    if dst.len() < 2 * ELEMENTS_PER_TASK {
        dst.iter_mut().zip(src).for_each(|(d, &s)| f(d, s));
    } else {
        dst.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(src.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| f(d, s)));
    }
}

/// Applies `f` to matching chunks of `dst` and `src`, in parallel for long inputs.
pub fn par_chunks(dst: &mut [f32], src: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync + Send) {
    if dst.len() < 2 * ELEMENTS_PER_TASK {
        f(dst, src);
    } else {
        dst.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(src.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(d, s)| f(d, s));
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, the sum of squares accumulated in f64 as GGML does.
#[inline]
pub(super) fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `out = x / rms(x) * weight`.
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// In-place [`rms_norm_row`].
pub fn rms_norm_row_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// In-place `x / rms(x)` (no weight).
pub fn rms_norm_row_unit_inplace(x: &mut [f32], eps: f32) {
    let scale = rms_scale(x, eps);
    x.iter_mut().for_each(|v| *v *= scale);
}

const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GELU with the tanh approximation, in f32, as GGML's `ggml_gelu_f32` is compiled: the inner
/// `1 + a·x·x` contracted to `fma(a·x, x, 1)`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// GELU of every f16 value, rounded to f16: GGML's CPU path looks GELU up in such a table (input
/// rounded to f16), and doing the same keeps Gemma's activations bit-compatible with it.
pub fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// GELU as GGML's CPU path computes it: exact limits outside [-10, 10], the f16 table inside.
#[inline]
pub fn gelu_ggml(table: &[f16], x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        table[f16::from_f32(x).to_bits() as usize].to_f32()
    }
}

/// The cosines and sines of every rotated pair of every token, as GGML's rope cache: `out[t *
/// n_dims + 2 i]` is the cosine of pair `i` of token `t`, the next value its sine (`out` is
/// replaced). The angle of pair `i` is `pos * base^(-2i/n_dims)`, built by repeated
/// multiplication in f32 so the rounding matches GGML's tables. The GPU's reference numerics
/// upload these same values.
pub fn rope_cos_sin(positions: &[u32], params: &RopeParams<'_>, out: &mut Vec<f32>) {
    let n_dims = params.n_dims;
    out.clear();
    out.resize(positions.len() * n_dims, 0.0);
    if n_dims == 0 {
        return;
    }
    let theta_scale = params.freq_base.powf(-2.0 / n_dims as f32);
    for (t, &pos) in positions.iter().enumerate() {
        let row = &mut out[t * n_dims..(t + 1) * n_dims];
        let mut theta_base = pos as f32;
        for i in 0..n_dims / 2 {
            let factor = params.freq_factors.map_or(1.0, |f| f[i]);
            let theta = params.freq_scale * (theta_base / factor);
            row[2 * i] = theta.cos();
            row[2 * i + 1] = theta.sin();
            theta_base *= theta_scale;
        }
    }
}

/// `x0·cos - x1·sin` as GGML's `rotate_pairs` is compiled (GCC and Clang both contract the
/// expression to `fma(x0, cos, -(x1·sin))`, the left product fused).
#[inline(always)]
fn rotate_first(x0: f32, x1: f32, c: f32, s: f32) -> f32 {
    x0.mul_add(c, -(x1 * s))
}

/// `x0·sin + x1·cos` as GGML's `rotate_pairs` is compiled: `fma(x0, sin, x1·cos)`.
#[inline(always)]
fn rotate_second(x0: f32, x1: f32, c: f32, s: f32) -> f32 {
    x0.mul_add(s, x1 * c)
}

/// Rotates the first `n_dims` values of one head by the angles in `cos_sin`
/// (`cos_sin[2i]`, `cos_sin[2i + 1]` for pair `i`).
#[inline]
pub fn rope_head(head: &mut [f32], cos_sin: &[f32], n_dims: usize, mode: RopeMode) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: `has_fma` checked at run time that the CPU supports FMA.
        return unsafe { rope_head_fma(head, cos_sin, n_dims, mode) };
    }
    rope_head_impl(head, cos_sin, n_dims, mode)
}

fn has_fma() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// [`rope_head`] compiled with FMA, so its fused products are instructions, not `fmaf` calls.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn rope_head_fma(head: &mut [f32], cos_sin: &[f32], n_dims: usize, mode: RopeMode) {
    rope_head_impl(head, cos_sin, n_dims, mode)
}

#[inline(always)]
fn rope_head_impl(head: &mut [f32], cos_sin: &[f32], n_dims: usize, mode: RopeMode) {
    let half = n_dims / 2;
    match mode {
        RopeMode::Normal => {
            for i in 0..half {
                let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = rotate_first(x0, x1, c, s);
                head[2 * i + 1] = rotate_second(x0, x1, c, s);
            }
        }
        RopeMode::Neox => {
            for i in 0..half {
                let (c, s) = (cos_sin[2 * i], cos_sin[2 * i + 1]);
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = rotate_first(x0, x1, c, s);
                head[i + half] = rotate_second(x0, x1, c, s);
            }
        }
    }
}

/// A slice written in disjoint parts by the jobs of one op.
pub(super) struct Disjoint<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for Disjoint<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Disjoint<T> {}

// SAFETY: jobs reach the slice only through `range`/`at` on parts no other job touches, and the
// slice outlives the op; `T: Send` moves no non-sendable value between threads.
unsafe impl<T: Send> Send for Disjoint<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    pub(super) fn new(buf: &mut [T]) -> Disjoint<T> {
        Disjoint {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// # Safety
    /// No other live reference into the slice overlaps `range`.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn range(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds (checked), not aliased (the caller's promise).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// # Safety
    /// As [`Disjoint::range`], for element `i`.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn at(&self, i: usize) -> &mut T {
        // SAFETY: the caller's promise.
        unsafe { &mut self.range(i..i + 1)[0] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_a_constant_row_is_the_weight() {
        let x = [3.0f32; 8];
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut out = [0f32; 8];
        rms_norm_row(&x, &w, 0.0, &mut out);
        for (o, w) in out.iter().zip(&w) {
            assert!((o - w).abs() < 1e-6, "{o} vs {w}");
        }
    }

    #[test]
    fn gelu_table_is_close_to_the_formula() {
        let t = gelu_table();
        for i in -100..100 {
            let x = i as f32 * 0.097;
            let exact = gelu_tanh(x);
            // f16 rounding of input and output: relative error a few 2^-11.
            assert!(
                (gelu_ggml(t, x) - exact).abs() <= 2e-3 * exact.abs().max(1.0),
                "x = {x}"
            );
        }
        assert_eq!(gelu_ggml(t, -20.0), 0.0);
        assert_eq!(gelu_ggml(t, 20.0), 20.0);
    }

    #[test]
    fn rope_modes_rotate_their_pairs() {
        // Rotation by 90 degrees of pair 0 only (pair 1 has angle 0).
        let cs = [0.0f32, 1.0, 1.0, 0.0];
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_head(&mut h, &cs, 4, RopeMode::Normal);
        assert_eq!(h, [-2.0, 1.0, 3.0, 4.0]);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_head(&mut h, &cs, 4, RopeMode::Neox);
        assert_eq!(h, [-3.0, 2.0, 1.0, 4.0]);
    }
}
