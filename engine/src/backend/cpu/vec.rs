//! f32 vector kernels of the CPU backend, chosen at run time: an AVX2+FMA build of the same loops
//! where the CPU has it, the portable one elsewhere.
//!
//! Most of them reproduce a GGML kernel of llama.cpp's AVX-512 build operation for operation
//! (`ggml_v_expf`/`ggml_v_silu`, `ggml_vec_dot_f16`, `ggml_vec_mad_f16`, the tiled attention's
//! `simd_gemm` and `ggml_vec_soft_max_f32`): each output element sees the same sequence of
//! roundings, so 8-lane AVX2 code gives what 16-lane AVX-512 code gives. The portable twins are
//! written lane for lane the same way, and the tests hold them to bit equality.

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

pub(super) fn has_avx2() -> bool {
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

/// Coefficients of GGML's vectorised `expf` (`ggml_v_expf` in `ggml-cpu/vec.h`, "adapted from
/// arm limited optimized routine"): shift, log2(e), ln 2 in two parts, the polynomial.
mod expf_consts {
    pub const SHIFT: f32 = 12_582_912.0; // 0x1.8p23
    pub const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
    pub const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
    pub const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
    pub const C4: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
    pub const C3: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    pub const C2: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    pub const C1: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    pub const C0: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
}

/// `exp(x)` exactly as GGML's AVX-512 build computes it in `ggml_v_expf`: a degree-5
/// polynomial of the reduced argument, scaled by `2^n` with one rounding (`vscalefps`). The
/// AVX2 variant of the same routine rounds differently (`k + k·j`), and llama.cpp's reference
/// outputs come from the AVX-512 one.
#[inline]
pub fn expf_ggml(x: f32) -> f32 {
    use expf_consts::*;
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let u = b * b;
    let j = C4
        .mul_add(b, C3)
        .mul_add(u, C2.mul_add(b, C1))
        .mul_add(u, C0.mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // j·2^n with a single rounding: exact in f64, then rounded once to f32.
    let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * pow2) as f32
}

/// SiLU as GGML's AVX-512 `ggml_v_silu`: `x / (1 + expf(0 - x))` with [`expf_ggml`].
#[inline]
pub fn silu_ggml(x: f32) -> f32 {
    x / (1.0 + expf_ggml(0.0 - x))
}

/// `gate[i] = silu(gate[i]) * up[i]`, GGML's `ggml_vec_swiglu_f32` on its AVX-512 path.
pub fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::swiglu(gate, up) };
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu_ggml(*g) * u;
    }
}

/// GGML's `ggml_vec_dot_f16` on its AVX-512 path, over f16 values held as f32 (their products
/// are exact in f32): four 16-lane FMA accumulators over runs of 64, summed
/// `(a0 + a2) + (a1 + a3)`, then `_mm512_reduce_add_ps` (halving: 8, 4, 2, 1 apart); a tail
/// shorter than 64 is added product by product in f64.
#[inline]
pub fn dot_f16_ggml(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::dot_f16(a, b) };
    }
    dot_f16_ggml_portable(a, b)
}

/// The common body of GGML's 64-wide dot products: four 16-lane FMA accumulators over the runs
/// of 64, folded `(a0 + a2) + (a1 + a3)`. Returns the length, the end of the last whole run, and
/// the 16 lanes; the callers differ only in how they add the tail.
#[inline(always)]
fn fma_lanes_64(a: &[f32], b: &[f32]) -> (usize, usize, [f32; 16]) {
    let n = a.len().min(b.len());
    let np = n / 64 * 64;
    let mut acc = [[0f32; 16]; 4];
    for base in (0..np).step_by(64) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (i, v) in accj.iter_mut().enumerate() {
                let k = base + 16 * j + i;
                *v = a[k].mul_add(b[k], *v);
            }
        }
    }
    let lanes: [f32; 16] =
        std::array::from_fn(|i| (acc[0][i] + acc[2][i]) + (acc[1][i] + acc[3][i]));
    (n, np, lanes)
}

fn dot_f16_ggml_portable(a: &[f32], b: &[f32]) -> f32 {
    let (n, np, lanes) = fma_lanes_64(a, b);
    let mut sum = reduce16(&lanes) as f64;
    for k in np..n {
        sum += (a[k] * b[k]) as f64;
    }
    sum as f32
}

/// GGML's `ggml_vec_dot_f32` on its AVX-512 path (a product of one f32 row with one token, the
/// path of a one-token F32 matrix product): four 16-lane FMA accumulators over runs of 64,
/// summed `(a0 + a2) + (a1 + a3)`, then `_mm512_reduce_add_ps`; a tail shorter than 64 is added
/// product by product with FMA (GCC contracts GGML's `sumf += x[i]*y[i]`).
#[inline]
pub fn dot_f32_ggml(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::dot_f32_ggml(a, b) };
    }
    dot_f32_ggml_portable(a, b)
}

#[inline(always)]
fn dot_f32_ggml_portable(a: &[f32], b: &[f32]) -> f32 {
    let (n, np, lanes) = fma_lanes_64(a, b);
    let mut sum = reduce16(&lanes);
    for k in np..n {
        sum = a[k].mul_add(b[k], sum);
    }
    sum
}

/// The dot product of llamafile's `tinyBLAS` F32 kernel in llama.cpp's AVX-512 build (the path
/// of F32 matrix products over two or more tokens whose rows are whole runs of 16): one 16-lane
/// FMA accumulator over the row, then `_mm512_reduce_add_ps`. `a.len()` must be a multiple of
/// 16.
#[inline]
pub fn dot_f32_tinyblas(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::dot_f32_tinyblas(a, b) };
    }
    dot_f32_tinyblas_portable(a, b)
}

#[inline(always)]
fn dot_f32_tinyblas_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (ra, rb) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] = ra[i].mul_add(rb[i], acc[i]);
        }
    }
    reduce16(&acc)
}

/// `_mm512_reduce_add_ps`: halves added lane-wise until one value is left.
#[inline]
fn reduce16(v: &[f32; 16]) -> f32 {
    let t: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let u: [f32; 4] = std::array::from_fn(|i| t[i] + t[i + 4]);
    (u[0] + u[2]) + (u[1] + u[3])
}

/// `y[i] = fma(a[i], b, y[i])`, GGML's `ggml_vec_mad_f32` (elementwise, so any lane width).
#[inline]
pub fn mad_f32(y: &mut [f32], b: f32, a: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::mad(y, b, a) };
    }
    for (yi, &ai) in y.iter_mut().zip(a) {
        *yi = ai.mul_add(b, *yi);
    }
}

/// Keys per tile of GGML's tiled flash attention (`GGML_FA_TILE_KV`), the lane count of
/// [`kq_tile`] and [`softmax_tile`].
pub const KV_TILE: usize = 64;

/// `out[j] = Σ_d q[d]·kt[d·KV_TILE + j]` by one FMA chain per key in `d` order, starting from 0:
/// GGML's `simd_gemm` of a query row with a transposed tile of keys.
#[inline]
pub fn kq_tile(q: &[f32], kt: &[f32], out: &mut [f32; KV_TILE]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::kq_tile(q, kt, out) };
    }
    kq_tile_portable(q, kt, out)
}

#[inline(always)]
fn kq_tile_portable(q: &[f32], kt: &[f32], out: &mut [f32; KV_TILE]) {
    out.fill(0.0);
    for (&qd, row) in q.iter().zip(kt.chunks_exact(KV_TILE)) {
        for (o, &k) in out.iter_mut().zip(row) {
            *o = k.mul_add(qd, *o);
        }
    }
}

/// `p[j] = expf(kq[j] - max)` with GGML's AVX-512 `expf` (0 for masked keys at -inf), returning
/// the sum as `ggml_vec_soft_max_f32` forms it: each run of 16 reduced in f32 by halving, the
/// runs added in f64.
pub fn softmax_tile(kq: &mut [f32; KV_TILE], max: f32) -> f64 {
    let mut sum = 0f64;
    for run in kq.chunks_exact_mut(16) {
        let mut v = [0f32; 16];
        exp_minus16(run, max, &mut v);
        run.copy_from_slice(&v);
        sum += reduce16(&v) as f64;
    }
    sum
}

/// `out[i] = expf(run[i] - max)` for a run of 16, with GGML's AVX-512 `expf`.
#[inline]
fn exp_minus16(run: &[f32], max: f32, out: &mut [f32; 16]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: `has_avx2` checked at run time that the CPU supports AVX2 and FMA.
        return unsafe { exact::exp_minus(run, max, out) };
    }
    out.iter_mut()
        .zip(run.iter())
        .for_each(|(o, &x)| *o = expf_ggml(x - max));
}

/// The softmax of one row as `ggml_soft_max` (no mask, scale 1) computes it in llama.cpp's
/// AVX-512 build: the maximum; `expf(x - max)` with GGML's `expf`, each run of 16 summed in f32
/// by halving and the runs added in f64 (`ggml_vec_soft_max_f32`); a tail shorter than 16 with
/// the C library's `expf`, added value by value; then every value times `(float)(1 / sum)`.
/// `out` holds at least `x.len()` values.
pub fn softmax_ggml(x: &[f32], out: &mut [f32]) {
    let max = x
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let full = x.len() / 16 * 16;
    let mut sum = 0f64;
    for (run, dst) in x[..full].chunks_exact(16).zip(out.chunks_exact_mut(16)) {
        let mut v = [0f32; 16];
        exp_minus16(run, max, &mut v);
        dst.copy_from_slice(&v);
        sum += reduce16(&v) as f64;
    }
    for (&xi, o) in x[full..].iter().zip(&mut out[full..x.len()]) {
        let v = (xi - max).exp();
        sum += v as f64;
        *o = v;
    }
    let scale = (1.0 / sum) as f32;
    out[..x.len()].iter_mut().for_each(|v| *v *= scale);
}

#[cfg(target_arch = "x86_64")]
mod exact {
    use std::arch::x86_64::*;

    use super::expf_consts::*;

    /// Eight lanes of `super::expf_ggml`; lanes whose `2^n` is not a normal f32 (results
    /// that are subnormal, zero or infinite) are redone by the scalar routine.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn expf8(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(SHIFT);
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(LN2_LO),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x),
        );
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(_mm256_set1_ps(C4), b, _mm256_set1_ps(C3)),
                u,
                _mm256_fmadd_ps(_mm256_set1_ps(C2), b, _mm256_set1_ps(C1)),
            ),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(C0), b, _mm256_set1_ps(1.0)),
        );
        let e = _mm256_cvtps_epi32(n);
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            e,
            _mm256_set1_epi32(127),
        )));
        let res = _mm256_mul_ps(j, pow2);
        let out_of_range = _mm256_or_ps(
            _mm256_cmp_ps::<_CMP_LT_OQ>(n, _mm256_set1_ps(-126.0)),
            _mm256_cmp_ps::<_CMP_GT_OQ>(n, _mm256_set1_ps(127.0)),
        );
        if _mm256_movemask_ps(out_of_range) == 0 {
            return res;
        }
        let mut xs = [0f32; 8];
        let mut rs = [0f32; 8];
        // SAFETY: both arrays hold 8 floats; unaligned stores and loads.
        unsafe {
            _mm256_storeu_ps(xs.as_mut_ptr(), x);
            _mm256_storeu_ps(rs.as_mut_ptr(), res);
        }
        let mask = _mm256_movemask_ps(out_of_range);
        for i in 0..8 {
            if mask & (1 << i) != 0 {
                rs[i] = super::expf_ggml(xs[i]);
            }
        }
        // SAFETY: `rs` holds 8 floats.
        unsafe { _mm256_loadu_ps(rs.as_ptr()) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, and both slices hold at least n values.
            unsafe {
                let pg = gate.as_mut_ptr().add(i);
                let x = _mm256_loadu_ps(pg);
                let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_storeu_ps(pg, _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(i))));
            }
            i += 8;
        }
        for k in i..n {
            gate[k] = super::silu_ggml(gate[k]) * up[k];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f16(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let np = n / 64 * 64;
        let mut lo = [_mm256_setzero_ps(); 4];
        let mut hi = [_mm256_setzero_ps(); 4];
        let mut base = 0;
        while base < np {
            for j in 0..4 {
                // SAFETY: base + 64 <= np <= n, inside both slices.
                unsafe {
                    let pa = a.as_ptr().add(base + 16 * j);
                    let pb = b.as_ptr().add(base + 16 * j);
                    lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb), lo[j]);
                    hi[j] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(pa.add(8)),
                        _mm256_loadu_ps(pb.add(8)),
                        hi[j],
                    );
                }
            }
            base += 64;
        }
        let a_lo = _mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3]));
        let a_hi = _mm256_add_ps(_mm256_add_ps(hi[0], hi[2]), _mm256_add_ps(hi[1], hi[3]));
        let t = _mm256_add_ps(a_lo, a_hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        let mut sum = _mm_cvtss_f32(s) as f64;
        for k in np..n {
            sum += (a[k] * b[k]) as f64;
        }
        sum as f32
    }

    // The two f32 dot products below are their portable twins compiled with FMA enabled: every
    // lane's sequence of fused operations is fixed by the code, so vectorising it changes
    // nothing but the speed.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_ggml(a: &[f32], b: &[f32]) -> f32 {
        super::dot_f32_ggml_portable(a, b)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_tinyblas(a: &[f32], b: &[f32]) -> f32 {
        super::dot_f32_tinyblas_portable(a, b)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn kq_tile(q: &[f32], kt: &[f32], out: &mut [f32; super::KV_TILE]) {
        super::kq_tile_portable(q, kt, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_minus(x: &[f32], max: f32, out: &mut [f32; 16]) {
        let m = _mm256_set1_ps(max);
        for h in 0..2 {
            let xs = &x[8 * h..8 * h + 8];
            // SAFETY: `xs` and the half of `out` hold 8 floats each.
            unsafe {
                let v = expf8(_mm256_sub_ps(_mm256_loadu_ps(xs.as_ptr()), m));
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), v);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mad(y: &mut [f32], v: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let vv = _mm256_set1_ps(v);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, and both slices hold at least n values.
            unsafe {
                let py = y.as_mut_ptr().add(i);
                let r =
                    _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), vv, _mm256_loadu_ps(py));
                _mm256_storeu_ps(py, r);
            }
            i += 8;
        }
        for k in i..n {
            y[k] = x[k].mul_add(v, y[k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values spread over the range the kernels see, including both ends of `expf`'s range.
    fn samples() -> Vec<f32> {
        let mut v: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.0517).collect();
        v.extend([
            0.0, -0.0, 88.0, 88.8, 89.0, -87.0, -87.5, -100.0, -103.9, -104.5, -150.0, 200.0,
        ]);
        v.extend([f32::NEG_INFINITY, f32::INFINITY]);
        v
    }

    #[test]
    fn ggml_expf_is_within_two_ulp_of_exp_and_handles_its_limits() {
        for x in samples() {
            let got = expf_ggml(x);
            let want = (x as f64).exp();
            if want > f32::MAX as f64 {
                assert_eq!(got, f32::INFINITY, "x = {x}");
            } else if want >= f32::MIN_POSITIVE as f64 {
                // GGML states 1.45 ulp + 0.5 for the polynomial; two ulp bounds it.
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!((got as f64 - want).abs() <= 2.0 * ulp as f64, "x = {x}");
            } else {
                assert!(got as f64 <= f32::MIN_POSITIVE as f64, "x = {x}: {got}");
            }
        }
        assert_eq!(expf_ggml(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn vectorised_ggml_kernels_match_their_scalar_twins_bit_for_bit() {
        let xs = samples();
        let up: Vec<f32> = xs.iter().map(|x| 0.5 - x * 0.01).collect();
        let mut gate = xs.clone();
        swiglu_ggml(&mut gate, &up);
        for ((g, &x), &u) in gate.iter().zip(&xs).zip(&up) {
            let want = silu_ggml(x) * u;
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "x = {x}"
            );
        }
        for n in [16, 64, 100, 256, 300] {
            let a: Vec<f32> = (0..n)
                .map(|i| half::f16::from_f32((i as f32 * 0.37).sin()).to_f32())
                .collect();
            let b: Vec<f32> = (0..n)
                .map(|i| half::f16::from_f32((i as f32 * 0.11).cos() * 3.0).to_f32())
                .collect();
            assert_eq!(
                dot_f16_ggml(&a, &b).to_bits(),
                dot_f16_ggml_portable(&a, &b).to_bits(),
                "n = {n}"
            );
        }
        for n in [16usize, 64, 100, 128, 2048] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            assert_eq!(
                dot_f32_ggml(&a, &b).to_bits(),
                dot_f32_ggml_portable(&a, &b).to_bits(),
                "n = {n}"
            );
            if n % 16 == 0 {
                assert_eq!(
                    dot_f32_tinyblas(&a, &b).to_bits(),
                    dot_f32_tinyblas_portable(&a, &b).to_bits(),
                    "n = {n}"
                );
            }
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot_f32_ggml(&a, &b) as f64 - exact).abs() < 1e-4 * n as f64);
        }
        let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.3).sin()).collect();
        let kt: Vec<f32> = (0..64 * KV_TILE).map(|i| (i as f32 * 0.07).cos()).collect();
        let (mut fast, mut slow) = ([0f32; KV_TILE], [0f32; KV_TILE]);
        kq_tile(&q, &kt, &mut fast);
        kq_tile_portable(&q, &kt, &mut slow);
        assert_eq!(fast.map(f32::to_bits), slow.map(f32::to_bits));
    }

    #[test]
    fn softmax_tile_sums_runs_of_sixteen_and_zeroes_masked_keys() {
        let mut kq = [f32::NEG_INFINITY; KV_TILE];
        for (i, v) in kq.iter_mut().enumerate().take(40) {
            *v = i as f32 * 0.25 - 3.0;
        }
        let max = kq.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let input = kq;
        let sum = softmax_tile(&mut kq, max);
        let mut want = 0f64;
        for run in 0..4 {
            let v: [f32; 16] = std::array::from_fn(|i| expf_ggml(input[16 * run + i] - max));
            want += reduce16(&v) as f64;
            assert_eq!(&kq[16 * run..16 * run + 16], &v[..]);
        }
        assert_eq!(sum, want);
        assert!(kq[40..].iter().all(|&p| p == 0.0));
        assert_eq!(kq[39], 1.0);
    }

    #[test]
    fn ggml_softmax_runs_of_sixteen_then_a_libm_tail_sum_to_one() {
        for n in [1usize, 8, 16, 128, 131] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
                .collect();
            let mut out = vec![0f32; n];
            softmax_ggml(&x, &mut out);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let full = n / 16 * 16;
            let mut sum = 0f64;
            let mut want: Vec<f32> = Vec::with_capacity(n);
            for run in x[..full].chunks_exact(16) {
                let v: [f32; 16] = std::array::from_fn(|i| expf_ggml(run[i] - max));
                sum += reduce16(&v) as f64;
                want.extend(v);
            }
            for &xi in &x[full..] {
                let v = (xi - max).exp();
                sum += v as f64;
                want.push(v);
            }
            let scale = (1.0 / sum) as f32;
            want.iter_mut().for_each(|v| *v *= scale);
            assert_eq!(out, want, "n = {n}");
            let total: f64 = out.iter().map(|&p| p as f64).sum();
            assert!((total - 1.0).abs() < 1e-5, "n = {n}: {total}");
        }
    }

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
