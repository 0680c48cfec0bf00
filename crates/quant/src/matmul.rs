//! Matrix products of quantized weights with quantized activations, threaded with rayon's
//! current pool.
//!
//! Two strategies:
//! - **row-wise**, for one or a few tokens (decode): each output is one `vec_dot` (four rows
//!   at a time for Q4_1 and Q8_0, with software prefetch of the next rows), rows split over
//!   threads. This streams the weights once and is bound by memory bandwidth.
//! - **tiled**, for many tokens (prefill): a panel of `R` weight rows is unpacked once into
//!   bytes plus per-16-element float scales and offsets (one layout for every format), and a
//!   register-tiled integer kernel multiplies it with `T` tokens at a time, so each loaded
//!   weight chunk serves `T` tokens and each activation chunk `R` rows. The idea is the
//!   classic GEMM micro-kernel (Goto/BLIS) with GGML's per-block scales folded in.
//!
//! In the tiled layout a weight value is `s·q + m` with `q` an unsigned byte (signed, with no
//! offset, for Q8_0, Q4_0 and Q5_0) and `s`, `m` constant over each 16-element half. A row's
//! dot product with a token is
//! `Σ_chunks Σ_lanes dv·d·isum_lane + Σ_halves m·sh`, where `dv` holds the two halves' scales
//! in four lanes each (matching the lanes of `madd`'s output), `d` is the activation chunk's
//! scale and `sh` its `d·Σa` per half. The offset term is a plain dot product over halves,
//! computed eight halves at a time.

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::blocks::{
    q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0, q8_1, q8_k, q8k_bsum, read_f16,
    read_f32, read_u32, QK, QK_K,
};
use crate::scalar::{kquants, legacy};
use crate::simd::{self, Level};
use crate::{bytes_for, check_len, vec_dot_type, GgmlType, QMatrix, QuantError};

/// Activations of `n_tokens` rows of `cols` elements, quantized once to a vec_dot_type and
/// reusable for several matrices (Q, K and V share their input).
pub struct QuantizedActivations {
    ty: GgmlType,
    n_tokens: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
    tiles: OnceLock<TileActs>,
}

impl QuantizedActivations {
    /// The activation type (Q8_0, Q8_1, Q8_K, F16, BF16 or F32).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// All rows in GGML layout.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Bytes of memory the buffer holds: the quantized rows, and the tiled copy when one was
    /// made.
    pub fn bytes(&self) -> usize {
        let tiles = self.tiles.get().map_or(0, |t| {
            t.qs.capacity() + (t.d.capacity() + t.sh.capacity()) * std::mem::size_of::<f32>()
        });
        self.data.capacity() + tiles
    }

    /// Token `t`'s row in GGML layout. Panics when `t >= n_tokens`, like slice indexing.
    pub fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    fn tiles(&self) -> &TileActs {
        self.tiles.get_or_init(|| TileActs::build(self))
    }
}

/// Whether `ty` is what some weight type is dotted against.
fn is_activation_type(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | F16 | BF16 | Q8_0 | Q8_1 | Q8_K)
}

/// Quantizes `x` (`n_tokens` rows of `cols`) to `ty`, a vec_dot_type, in parallel over tokens.
pub fn quantize_activations(
    ty: GgmlType,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
) -> Result<QuantizedActivations, QuantError> {
    let mut act = QuantizedActivations::empty(ty, cols)?;
    act.requantize(x, n_tokens)?;
    Ok(act)
}

/// Below this many elements activations are quantized on the calling thread (a decode step's
/// one token): the pool's hand-off would cost more than the work.
const QUANTIZE_MIN_PARALLEL: usize = 8 * 1024;

impl QuantizedActivations {
    /// No tokens yet, of type `ty` (a vec_dot_type) and `cols` columns: a buffer for
    /// [`QuantizedActivations::requantize`].
    pub fn empty(ty: GgmlType, cols: usize) -> Result<QuantizedActivations, QuantError> {
        if !is_activation_type(ty) {
            return Err(QuantError::ActivationType {
                expected: vec_dot_type(ty),
                found: ty,
            });
        }
        let row_bytes = bytes_for("activation row", ty, cols)?;
        Ok(QuantizedActivations {
            ty,
            n_tokens: 0,
            cols,
            row_bytes,
            data: Vec::new(),
            tiles: OnceLock::new(),
        })
    }

    /// Quantizes `x` (`n_tokens` rows of [`cols`](Self::cols)) into this buffer, keeping its
    /// type and reusing its allocation: what a caller that quantizes every step (the engine's
    /// decode loop) uses instead of [`quantize_activations`]. The result is the same.
    pub fn requantize(&mut self, x: &[f32], n_tokens: usize) -> Result<(), QuantError> {
        let (ty, cols, row_bytes) = (self.ty, self.cols, self.row_bytes);
        let total = n_tokens.checked_mul(cols).ok_or(QuantError::Overflow {
            ty,
            rows: n_tokens,
            cols,
        })?;
        check_len("activations", "elements", total, x.len())?;
        let bytes = row_bytes
            .checked_mul(n_tokens)
            .ok_or(QuantError::Overflow {
                ty,
                rows: n_tokens,
                cols,
            })?;
        self.tiles = OnceLock::new();
        self.n_tokens = n_tokens;
        // Every byte is overwritten below; resizing only zero-fills what the buffer grows by.
        self.data.resize(bytes, 0);
        let level = simd::level();
        if row_bytes > 0 {
            if total < QUANTIZE_MIN_PARALLEL {
                self.data
                    .chunks_mut(row_bytes)
                    .zip(x.chunks(cols))
                    .for_each(|(dst, src)| simd::quantize(level, ty, src, dst));
            } else {
                self.data
                    .par_chunks_mut(row_bytes)
                    .zip(x.par_chunks(cols))
                    .for_each(|(dst, src)| simd::quantize(level, ty, src, dst));
            }
        }
        Ok(())
    }
}

/// How a matmul is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Tiled from a per-format number of tokens on, where the CPU has a SIMD tile kernel.
    Auto,
    /// One dot product per output.
    RowWise,
    /// The tile kernel (portable code on levels without a SIMD one); F16, BF16 and F32
    /// weights are always row-wise.
    Tiled,
}

/// From this many tokens on, the tiled kernel beats one `vec_dot` per output: below it, the
/// one-off unpacking of the weights costs more than the tile saves. Measured crossovers
/// (`examples/shapes.rs`): 6-8 tokens for Q4_1 1536x576, whose unpacking is SIMD, and 12 for
/// Q4_K 2048x2048, whose unpacking is scalar. Q4_0 on AVX-512 VNNI has a four-row matvec that
/// runs a token in a quarter of the AVX2 kernel's time: the tiles pay from about 32 tokens on
/// (1536x576).
fn tile_min_tokens(level: Level, ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 if level == Level::Avx512Vnni => 32,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 8,
        _ => 12,
    }
}

/// out[t*rows + r] = dot(w.row(r), x.row(t)). Parallel with rayon's current pool.
pub fn matmul(w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) -> Result<(), QuantError> {
    matmul_with(simd::level(), Strategy::Auto, w, x, out)
}

/// Convenience: quantizes `x` to `vec_dot_type(w.ty)`, then [`matmul`].
pub fn matmul_f32(
    w: &QMatrix,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let act = quantize_activations(vec_dot_type(w.ty), x, n_tokens, w.cols)?;
    matmul(w, &act, out)
}

/// [`matmul`] on a given SIMD level and strategy: for tests and benchmarks that compare paths.
/// `level` must be one of [`simd::available_levels`]; a level the CPU lacks runs as scalar.
pub fn matmul_with(
    level: Level,
    strategy: Strategy,
    w: &QMatrix,
    x: &QuantizedActivations,
    out: &mut [f32],
) -> Result<(), QuantError> {
    check_activations(w, x)?;
    let total = x.n_tokens.checked_mul(w.rows).ok_or(QuantError::Overflow {
        ty: w.ty,
        rows: w.rows,
        cols: x.n_tokens,
    })?;
    check_len("matmul output", "elements", total, out.len())?;
    if total == 0 {
        return Ok(());
    }
    let level = if simd::available_levels().contains(&level) {
        level
    } else {
        Level::Scalar
    };
    dispatch(
        level,
        strategy,
        w,
        x,
        out,
        crate::repack_order::repacks(w.ty, w.rows),
    );
    Ok(())
}

/// That `x` is of `w`'s dot-product type and as wide as `w`.
fn check_activations(w: &QMatrix, x: &QuantizedActivations) -> Result<(), QuantError> {
    let expected = vec_dot_type(w.ty);
    if x.ty != expected {
        return Err(QuantError::ActivationType {
            expected,
            found: x.ty,
        });
    }
    check_len("activation columns", "columns", w.cols, x.cols)
}

/// Row alignment of [`matmul_rows`]: every kernel's groups of rows (and every split of rows
/// between jobs) divide it, so a range starting at a multiple of it gives each output the bits
/// of the whole product.
pub const ROW_RANGE_ALIGN: usize = 16;

/// Rows `rows` of [`matmul`]`(w, x)`, on the calling thread alone: `out` holds `x.n_tokens` rows
/// of `rows.len()` outputs, each bit for bit its value in the whole product. `rows.start` must
/// be a multiple of [`ROW_RANGE_ALIGN`] and `rows.end` one too or `w.rows`. For callers that
/// split a product (or several) between threads themselves.
pub fn matmul_rows(
    w: &QMatrix,
    x: &QuantizedActivations,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let aligned = |r: usize| r.is_multiple_of(ROW_RANGE_ALIGN);
    if rows.start > rows.end
        || rows.end > w.rows
        || !aligned(rows.start)
        || !(aligned(rows.end) || rows.end == w.rows)
    {
        return Err(QuantError::RowRange {
            start: rows.start,
            end: rows.end,
            rows: w.rows,
            align: ROW_RANGE_ALIGN,
        });
    }
    let rb = w.row_bytes();
    let part = QMatrix {
        ty: w.ty,
        rows: rows.len(),
        cols: w.cols,
        data: &w.data[rows.start * rb..rows.end * rb],
    };
    check_activations(w, x)?;
    check_len(
        "matmul_rows output",
        "elements",
        x.n_tokens * part.rows,
        out.len(),
    )?;
    if out.is_empty() {
        return Ok(());
    }
    // The order of the whole matrix: whether it takes the repacked kernels depends on its row
    // count, not the range's.
    let repack = crate::repack_order::repacks(w.ty, w.rows);
    crate::team::inline(|| dispatch(simd::level(), Strategy::Auto, &part, x, out, repack));
    Ok(())
}

/// The kernel choice of [`matmul_with`] on checked arguments; `repacked`: whether a Q4_K or
/// Q4_0 matrix follows llama.cpp's repacked order (decided on the whole matrix's rows).
fn dispatch(
    level: Level,
    strategy: Strategy,
    w: &QMatrix,
    x: &QuantizedActivations,
    out: &mut [f32],
    repacked: bool,
) {
    if strategy == Strategy::Auto && repacked {
        // llama.cpp multiplies such matrices with its repacked kernels; follow their order.
        let product = match w.ty {
            GgmlType::Q4_0 => crate::repack_q4_0::matmul,
            _ => crate::repack_order::matmul,
        };
        product(
            w.data,
            w.row_bytes(),
            w.rows,
            &x.data,
            x.row_bytes,
            x.n_tokens,
            out,
        );
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if strategy == Strategy::Auto && w.ty == GgmlType::Q6_K && x.n_tokens >= Q6K_TOKENS_MIN_TOKENS {
        match level {
            Level::Avx512Vnni => return matmul_q6k_tokens(w, x, out),
            Level::Avx2 => return matmul_q6k_tokens_avx2(w, x, out),
            _ => {}
        }
    }
    let tiled = match strategy {
        Strategy::Auto => {
            x.n_tokens >= tile_min_tokens(level, w.ty)
                && has_tiles(w.ty)
                && has_simd_tiles(level)
                && !rowwise_like_ggml(w.ty)
        }
        Strategy::RowWise => false,
        Strategy::Tiled => has_tiles(w.ty),
    };
    if tiled {
        matmul_tiled(level, w, x, out);
    } else {
        matmul_rowwise(level, w, x, out);
    }
}

/// From this many tokens on, Q6_K matrices on AVX-512 VNNI take [`matmul_q6k_tokens`] (on AVX2
/// [`matmul_q6k_tokens_avx2`]): one token is a memory-bound matvec, where unpacking the weights
/// for a single use gains nothing.
#[cfg(target_arch = "x86_64")]
const Q6K_TOKENS_MIN_TOKENS: usize = 2;

/// Q6_K weights against several tokens on AVX-512 VNNI, every output bit for bit the AVX2
/// `vec_dot` (GGML's order, which llama.cpp's reference outputs carry): each row's super-blocks
/// are unpacked once per block of up to `avx512::TOKENS` tokens instead of once per output.
/// Rows are split between jobs; the activations' quants are widened to words once.
#[cfg(target_arch = "x86_64")]
fn matmul_q6k_tokens(w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) {
    use crate::x86::avx512::{q6k_row_tokens, widen_q8k, TOKENS};
    let (rows, cols, n_tokens) = (w.rows, w.cols, x.n_tokens);
    let mut widened = vec![0i16; n_tokens * cols];
    widened
        .par_chunks_mut(cols)
        .zip(x.data.par_chunks(x.row_bytes))
        // SAFETY: the caller checked that the level is AVX-512 VNNI, which `simd::level`
        // reports only after checking AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
        .for_each(|(o, row)| unsafe { widen_q8k(row, o) });
    let chunk = rows_per_job(rows, 1);
    let out_ptr = OutPtr::new(out);
    (0..rows.div_ceil(chunk)).into_par_iter().for_each(|job| {
        let r0 = job * chunk;
        let n_rows = chunk.min(rows - r0);
        let mut block = vec![0.0f32; TOKENS * n_rows];
        for t0 in (0..n_tokens).step_by(TOKENS) {
            let nt = TOKENS.min(n_tokens - t0);
            let mut v = [0.0f32; TOKENS];
            for i in 0..n_rows {
                // SAFETY: as above.
                unsafe {
                    q6k_row_tokens(
                        w.row(r0 + i),
                        &x.data[t0 * x.row_bytes..],
                        x.row_bytes,
                        &widened[t0 * cols..],
                        cols,
                        &mut v[..nt],
                    )
                };
                for (t, vt) in v.iter().enumerate().take(nt) {
                    block[t * n_rows + i] = *vt;
                }
            }
            for t in 0..nt {
                // SAFETY: jobs own disjoint row ranges of every token.
                unsafe { out_ptr.slice((t0 + t) * rows + r0, n_rows) }
                    .copy_from_slice(&block[t * n_rows..(t + 1) * n_rows]);
            }
        }
    });
}

/// Tokens per sweep of [`matmul_q6k_tokens_avx2`]: their activations (9 KB per token for 8192
/// columns) stay in L2 while each row, unpacked once per sweep, meets them all.
#[cfg(target_arch = "x86_64")]
const Q6K_AVX2_TOKEN_BLOCK: usize = 32;

/// Q6_K weights against several tokens on AVX2, every output bit for bit the AVX2 `vec_dot`
/// (GGML's order): each row is unpacked once per block of tokens ([`crate::x86::avx2::Q6kRow`])
/// instead of once per output. Rows are split between jobs.
#[cfg(target_arch = "x86_64")]
fn matmul_q6k_tokens_avx2(w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) {
    use crate::x86::avx2::Q6kRow;
    let (rows, n_tokens) = (w.rows, x.n_tokens);
    let chunk = rows_per_job(rows, 1);
    let out_ptr = OutPtr::new(out);
    (0..rows.div_ceil(chunk)).into_par_iter().for_each(|job| {
        let r0 = job * chunk;
        let n_rows = chunk.min(rows - r0);
        let mut row = Q6kRow::default();
        for t0 in (0..n_tokens).step_by(Q6K_AVX2_TOKEN_BLOCK) {
            let t_end = (t0 + Q6K_AVX2_TOKEN_BLOCK).min(n_tokens);
            for r in r0..r0 + n_rows {
                // SAFETY: the caller checked that the level is AVX2, which `simd::level`
                // reports only after checking AVX2, FMA and F16C.
                unsafe { row.unpack(w.row(r)) };
                for t in t0..t_end {
                    // SAFETY: as above.
                    let v = unsafe { row.dot(x.row(t)) };
                    // SAFETY: jobs own disjoint row ranges of every token.
                    let o = unsafe { out_ptr.slice(t * rows + r, 1) };
                    o[0] = v;
                }
            }
        }
    });
}

/// Whether GGML's CPU backend computes `ty` by one `vec_dot` per output at every batch size (no
/// llamafile or repacked GEMM takes it on x86; for Q4_K, matrices whose rows are not a multiple
/// of 8 and so stay unpacked), and whose tiles here do not follow that order: such matrices stay
/// row-wise so prompts get exactly the numbers llama.cpp gets (Q6_K prompts take
/// `matmul_q6k_tokens` on AVX-512 VNNI and `matmul_q6k_tokens_avx2` on AVX2 first, which give
/// those same numbers faster).
fn rowwise_like_ggml(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q6_K | GgmlType::Q4_K)
}

/// Rows per parallel job: enough jobs for load balance, each big enough to pay for itself.
fn rows_per_job(rows: usize, align: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let per = rows.div_ceil(threads * 4).max(16);
    per.div_ceil(align) * align
}

/// Least weight bytes per job of a row-wise matmul: below it, waking another thread costs more
/// than it saves. Below this many bytes in all the matmul runs on the calling thread (SmolLM2's
/// K and V matvecs, 62 KiB); a 576x576 Q4_0 matrix (182 KiB) takes three threads, not sixteen.
const ROWWISE_MIN_JOB_BYTES: usize = 64 * 1024;

/// Output rows per job are a multiple of this: 16 f32 outputs are one 64-byte cache line, so two
/// threads never write the same line of a decode step's output (and the four-row kernels always
/// get whole groups).
const ROWWISE_ROW_ALIGN: usize = 16;

/// The split of `rows` rows of `bytes` weight bytes into jobs: (jobs, rows per job). At most one
/// job per thread of the current pool, each of at least [`ROWWISE_MIN_JOB_BYTES`], rows per job
/// a multiple of `align`.
pub(crate) fn split_rows(rows: usize, bytes: usize, align: usize) -> (usize, usize) {
    let by_bytes = (bytes / ROWWISE_MIN_JOB_BYTES).max(1);
    let jobs = rayon::current_num_threads()
        .min(by_bytes)
        .clamp(1, rows.div_ceil(align).max(1));
    let chunk = rows.div_ceil(jobs).div_ceil(align) * align;
    (rows.div_ceil(chunk.max(1)), chunk.max(1))
}

/// Row-wise: the rows are split into one contiguous range per job (decode rows are short,
/// a few cache lines, so a few big jobs cost less to schedule than many small ones), and each
/// job sweeps its rows over every token while they are in cache.
fn matmul_rowwise(level: Level, w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) {
    let rows = w.rows;
    let (n_jobs, chunk) = split_rows(rows, w.data.len(), ROWWISE_ROW_ALIGN);
    let out_ptr = OutPtr {
        ptr: out.as_mut_ptr(),
        len: out.len(),
    };
    crate::team::for_each_index(n_jobs, |job: usize| {
        let r0 = job * chunk;
        let n = chunk.min(rows - r0);
        for t in 0..x.n_tokens {
            // SAFETY: jobs own disjoint row ranges of every token, so no element is reached
            // through two of these slices at once.
            let o = unsafe { out_ptr.slice(t * rows + r0, n) };
            rowwise_job(level, w, x.row(t), r0, o);
        }
    });
}

/// Outputs of rows `r0..r0 + out.len()` with one activation row.
fn rowwise_job(level: Level, w: &QMatrix, act: &[u8], r0: usize, out: &mut [f32]) {
    let rb = w.row_bytes();
    let data = &w.data[r0 * rb..(r0 + out.len()) * rb];
    if simd::matvec(level, w.ty, data, act, out) {
        return;
    }
    for (k, v) in out.iter_mut().enumerate() {
        *v = simd::vec_dot(level, w.ty, w.row(r0 + k), act, w.cols);
    }
}

/// Whether the tiled path handles weights of `ty` (every quantized weight format; on levels
/// without a SIMD tile kernel it runs the portable one).
fn has_tiles(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
    )
}

/// Whether `level` has a SIMD tile kernel, which beats one `vec_dot` per output.
fn has_simd_tiles(level: Level) -> bool {
    matches!(level, Level::Avx2 | Level::Avx512Vnni)
}

/// Activations in the tile layout: per token, per 32-element chunk `c`, the 32 quants and
/// the chunk's scale `d` (in 8 lanes, so the kernel multiplies by it straight from memory
/// instead of holding a broadcast in a register: AVX2's 16 registers are all taken by the
/// tile); and `sh`: `d·Σa` of each 16-element half, `n_halves` per token
/// (padded with zeros to a multiple of 8 so the offset term is a whole-vector dot product).
pub(crate) struct TileActs {
    pub cols: usize,
    pub n_chunks: usize,
    pub n_halves: usize,
    pub qs: Vec<u8>,
    pub d: Vec<f32>,
    pub sh: Vec<f32>,
    /// The chunk scales of tokens in pairs, for tile kernels whose weight scale is one value
    /// per chunk: pair `p` (tokens 2p and 2p + 1), chunk `c` at `(p * n_chunks + c) * 8`, token
    /// 2p's scale in lanes 0..4 and token 2p + 1's in lanes 4..8 (zeros past the last token).
    pub d_pairs: Vec<f32>,
}

/// Halves (16-element groups) of a row of `cols`, padded to a multiple of 8.
pub(crate) fn padded_halves(cols: usize) -> usize {
    (cols / 16).div_ceil(8) * 8
}

fn half_sums(qs: &[u8]) -> (i32, i32) {
    let s = |h: &[u8]| h.iter().map(|&q| q as i8 as i32).sum::<i32>();
    (s(&qs[..16]), s(&qs[16..32]))
}

impl TileActs {
    fn build(x: &QuantizedActivations) -> TileActs {
        let n_chunks = x.cols / QK;
        let n_halves = padded_halves(x.cols);
        let n = x.n_tokens;
        let mut qs = vec![0u8; n * x.cols];
        let mut d = vec![0.0f32; n * n_chunks * 8];
        let mut sh = vec![0.0f32; n * n_halves];
        if n_chunks > 0 {
            qs.par_chunks_mut(x.cols)
                .zip(d.par_chunks_mut(n_chunks * 8))
                .zip(sh.par_chunks_mut(n_halves))
                .enumerate()
                .for_each(|(t, ((qs, d), sh))| Self::build_row(x.ty, x.row(t), qs, d, sh));
        }
        // Only the chunk-scale formats' activations (Q8_0, Q8_1) are read this way.
        let pairs = if matches!(x.ty, GgmlType::Q8_0 | GgmlType::Q8_1) {
            n.div_ceil(2)
        } else {
            0
        };
        let mut d_pairs = vec![0.0f32; pairs * n_chunks * 8];
        for (i, pair) in d_pairs.chunks_exact_mut(8).enumerate() {
            let (p, c) = (i / n_chunks, i % n_chunks);
            for (k, half) in pair.chunks_exact_mut(4).enumerate() {
                let t = 2 * p + k;
                if t < n {
                    half.fill(d[(t * n_chunks + c) * 8]);
                }
            }
        }
        TileActs {
            cols: x.cols,
            n_chunks,
            n_halves,
            qs,
            d,
            sh,
            d_pairs,
        }
    }

    fn build_row(ty: GgmlType, row: &[u8], qs: &mut [u8], d: &mut [f32], sh: &mut [f32]) {
        let mut set = |c: usize, dc: f32, s0: f32, s1: f32| {
            d[8 * c..8 * c + 8].fill(dc);
            sh[2 * c] = s0;
            sh[2 * c + 1] = s1;
        };
        match ty {
            GgmlType::Q8_0 => {
                for (c, y) in row.chunks_exact(q8_0::SIZE).enumerate() {
                    let q = &y[q8_0::QS..q8_0::QS + QK];
                    qs[QK * c..QK * c + QK].copy_from_slice(q);
                    let dc = read_f16(y, q8_0::D);
                    let (h0, h1) = half_sums(q);
                    set(c, dc, dc * h0 as f32, dc * h1 as f32);
                }
            }
            GgmlType::Q8_1 => {
                for (c, y) in row.chunks_exact(q8_1::SIZE).enumerate() {
                    qs[QK * c..QK * c + QK].copy_from_slice(&y[q8_1::QS..q8_1::QS + QK]);
                    // GGML uses the stored f16 `s` for the whole block; halving it is exact.
                    let s = read_f16(y, q8_1::S) * 0.5;
                    set(c, read_f16(y, q8_1::D), s, s);
                }
            }
            GgmlType::Q8_K => {
                for (b, y) in row.chunks_exact(q8_k::SIZE).enumerate() {
                    let base = b * QK_K;
                    qs[base..base + QK_K].copy_from_slice(&y[q8_k::QS..q8_k::QS + QK_K]);
                    let dc = read_f32(y, q8_k::D);
                    for c in 0..QK_K / QK {
                        let s0 = dc * q8k_bsum(y, 2 * c) as f32;
                        let s1 = dc * q8k_bsum(y, 2 * c + 1) as f32;
                        set(b * (QK_K / QK) + c, dc, s0, s1);
                    }
                }
            }
            _ => unreachable!("tiles are only built for quantized activations"),
        }
    }
}

/// `R` weight rows unpacked for the tile kernel: `q` row-major (`R * cols` bytes), `dv` as 8
/// lanes per 32-element chunk per row, `mh` the offset of each 16-element half (padded like
/// [`TileActs::sh`]).
pub(crate) struct Panel {
    pub q: Vec<u8>,
    pub dv: Vec<f32>,
    pub mh: Vec<f32>,
    /// For formats with one weight scale per chunk (both halves alike): the scales of the rows
    /// in groups of [`TILE_ROWS`], group `g`, chunk `c` at `(g * n_chunks + c) * 4`, one row per
    /// lane (zeros past the last row). Empty for the other formats.
    pub d_rows: Vec<f32>,
}

impl Panel {
    fn new(rows: usize, cols: usize) -> Panel {
        let n_chunks = cols / QK;
        Panel {
            q: vec![0; rows * cols],
            dv: vec![0.0; rows * n_chunks * 8],
            mh: vec![0.0; rows * padded_halves(cols)],
            d_rows: Vec::new(),
        }
    }

    /// Fills [`Panel::d_rows`] from `dv` (whose halves must hold one scale per chunk).
    fn group_row_scales(&mut self, rows: usize, n_chunks: usize) {
        self.d_rows = vec![0.0; rows.div_ceil(TILE_ROWS) * n_chunks * TILE_ROWS];
        for r in 0..rows {
            for c in 0..n_chunks {
                let (g, i) = (r / TILE_ROWS, r % TILE_ROWS);
                let lanes = &self.dv[(r * n_chunks + c) * 8..][..8];
                debug_assert!(lanes.iter().all(|&v| v.to_bits() == lanes[0].to_bits()));
                self.d_rows[(g * n_chunks + c) * TILE_ROWS + i] = lanes[0];
            }
        }
    }
}

/// Whether the tiles of `ty` have one weight scale per chunk (the same in both halves), so
/// that the tile kernel can form the products of row and token scales eight at a time.
pub(crate) fn has_chunk_scales(ty: GgmlType) -> bool {
    is_signed_tile(ty) || matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// Writes chunk `c`'s scales `s` and offsets `m` of its two halves.
#[inline(always)]
fn set_lanes(dv: &mut [f32], mh: &mut [f32], c: usize, s: [f32; 2], m: [f32; 2]) {
    dv[8 * c..8 * c + 4].fill(s[0]);
    dv[8 * c + 4..8 * c + 8].fill(s[1]);
    mh[2 * c] = m[0];
    mh[2 * c + 1] = m[1];
}

/// Unpacks one weight row of `ty` into tile layout.
pub(crate) fn unpack_row(
    level: Level,
    ty: GgmlType,
    row: &[u8],
    q: &mut [u8],
    dv: &mut [f32],
    mh: &mut [f32],
) {
    use GgmlType::*;
    #[cfg(target_arch = "x86_64")]
    {
        if has_simd_tiles(level) {
            // SAFETY: `level` is AVX2 or better, which `simd::level` reports only after
            // checking AVX2, FMA and F16C on this CPU.
            if unsafe { crate::x86::tile::unpack_row(ty, row, q, dv, mh) } {
                return;
            }
        }
    }
    let _ = level;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => {
            for (c, x) in row.chunks_exact(ty.type_size()).enumerate() {
                let qc = &mut q[QK * c..QK * c + QK];
                let (d, m) = match ty {
                    Q4_0 | Q4_1 => {
                        let qs = if ty == Q4_0 { q4_0::QS } else { q4_1::QS };
                        for j in 0..16 {
                            qc[j] = x[qs + j] & 0xF;
                            qc[j + 16] = x[qs + j] >> 4;
                        }
                        let d = read_f16(x, q4_0::D);
                        if ty == Q4_0 {
                            // Signed, as GGML's Q4_0 kernels use it (see `is_signed_tile`).
                            qc.iter_mut().for_each(|v| *v = v.wrapping_sub(8));
                            (d, 0.0)
                        } else {
                            (d, read_f16(x, q4_1::M))
                        }
                    }
                    Q5_0 => {
                        let v =
                            legacy::q5_values(&x[q5_0::QS..q5_0::QS + 16], read_u32(x, q5_0::QH));
                        for (o, v) in qc.iter_mut().zip(v) {
                            *o = v.wrapping_sub(16);
                        }
                        (read_f16(x, q5_0::D), 0.0)
                    }
                    Q5_1 => {
                        let v =
                            legacy::q5_values(&x[q5_1::QS..q5_1::QS + 16], read_u32(x, q5_1::QH));
                        qc.copy_from_slice(&v);
                        (read_f16(x, q5_1::D), read_f16(x, q5_1::M))
                    }
                    _ => {
                        qc.copy_from_slice(&x[q8_0::QS..q8_0::QS + QK]);
                        (read_f16(x, q8_0::D), 0.0)
                    }
                };
                set_lanes(dv, mh, c, [d, d], [m, m]);
            }
        }
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => {
            for (b, x) in row.chunks_exact(ty.type_size()).enumerate() {
                let base = b * QK_K;
                let qb = &mut q[base..base + QK_K];
                // Per 16-element sub-block: scale and offset of the unsigned value.
                let mut s16 = [0.0f32; 16];
                let mut m16 = [0.0f32; 16];
                match ty {
                    Q2_K => {
                        qb.copy_from_slice(&kquants::q2k_values(x));
                        let d = read_f16(x, q2_k::D);
                        let dmin = read_f16(x, q2_k::DMIN);
                        for j in 0..16 {
                            let sc = x[q2_k::SCALES + j];
                            s16[j] = d * (sc & 0xF) as f32;
                            m16[j] = -dmin * (sc >> 4) as f32;
                        }
                    }
                    Q3_K => {
                        for (o, v) in qb.iter_mut().zip(kquants::q3k_values(x)) {
                            *o = (v + 4) as u8;
                        }
                        let d = read_f16(x, q3_k::D);
                        let sc = crate::blocks::q3k_scales(&x[q3_k::SCALES..q3_k::SCALES + 12]);
                        for j in 0..16 {
                            s16[j] = d * sc[j] as f32;
                            m16[j] = -4.0 * s16[j];
                        }
                    }
                    Q4_K | Q5_K => {
                        let v = if ty == Q4_K {
                            kquants::k4_values(x, q4_k::QS, None)
                        } else {
                            kquants::k4_values(x, q5_k::QS, Some(q5_k::QH))
                        };
                        qb.copy_from_slice(&v);
                        let d = read_f16(x, q4_k::D);
                        let dmin = read_f16(x, q4_k::DMIN);
                        let (sc, mn) =
                            crate::blocks::k4_scales_mins(&x[q4_k::SCALES..q4_k::SCALES + 12]);
                        for j in 0..16 {
                            s16[j] = d * sc[j / 2] as f32;
                            m16[j] = -dmin * mn[j / 2] as f32;
                        }
                    }
                    _ => {
                        for (o, v) in qb.iter_mut().zip(kquants::q6k_values(x)) {
                            *o = (v + 32) as u8;
                        }
                        let d = read_f16(x, q6_k::D);
                        for j in 0..16 {
                            s16[j] = d * (x[q6_k::SCALES + j] as i8) as f32;
                            m16[j] = -32.0 * s16[j];
                        }
                    }
                }
                for c in 0..QK_K / QK {
                    let cc = b * (QK_K / QK) + c;
                    set_lanes(
                        dv,
                        mh,
                        cc,
                        [s16[2 * c], s16[2 * c + 1]],
                        [m16[2 * c], m16[2 * c + 1]],
                    );
                }
            }
        }
        _ => unreachable!("tiles are only built for quantized weights"),
    }
}

/// Whether weights of `ty` are unpacked to signed bytes with no offset term, so that a tile
/// computes exactly what GGML's kernels for them compute at every batch size (`vec_dot` for one
/// token, llamafile's `tinyBLAS_Q0_AVX` for more: per output, one FMA of `d_w·d_a` by the
/// 8 four-byte lane sums per block, then `hsum_float_8`).
pub(crate) fn is_signed_tile(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0)
}

/// `hsum_float_8`: the two halves added, then lanes two apart, then the last two.
#[inline]
fn hsum8_ggml(lanes: &[f32; 8]) -> f32 {
    let s4: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// Rows of a weight panel and tokens per tile of the micro-kernel.
pub(crate) const TILE_ROWS: usize = 4;
pub(crate) const TILE_TOKENS: usize = 2;
/// Bytes of unpacked weights per job and of activations per token block. A job unpacks its
/// rows once and sweeps them over each token block; both stay in a 512 KiB L2 together.
const CACHE_BLOCK_BYTES: usize = 128 * 1024;

fn matmul_tiled(level: Level, w: &QMatrix, x: &QuantizedActivations, out: &mut [f32]) {
    let acts = x.tiles();
    let n_tokens = x.n_tokens;
    let rows = w.rows;
    let cols = w.cols;
    let n_chunks = cols / QK;
    let n_halves = padded_halves(cols);
    // One weight row and one token take the same bytes in the tile layout.
    let row_bytes = cols + 32 * n_chunks + 4 * n_halves;
    let job_rows = (CACHE_BLOCK_BYTES / row_bytes / TILE_ROWS * TILE_ROWS)
        .clamp(TILE_ROWS, rows_per_job(rows, TILE_ROWS));
    let token_block = (CACHE_BLOCK_BYTES / row_bytes).max(8) / 2 * 2;
    // Few row jobs for many threads (576 rows are 36 jobs: three waves on 16 threads, the last
    // a quarter full): the tokens are split too, in whole token blocks, into as many groups as
    // bring the jobs to four per thread. Each group unpacks its rows again, a small cost beside
    // a block of tokens; every output is computed by the same tile calls as without the split.
    let row_jobs = rows.div_ceil(job_rows);
    let token_blocks = n_tokens.div_ceil(token_block);
    let groups = (4 * rayon::current_num_threads())
        .div_ceil(row_jobs)
        .clamp(1, token_blocks);
    let blocks_per_group = token_blocks.div_ceil(groups);
    let groups = token_blocks.div_ceil(blocks_per_group);
    let out_ptr = OutPtr {
        ptr: out.as_mut_ptr(),
        len: out.len(),
    };
    // Whether the panels need their rows' compact scales: only for the AVX2 tile kernel's
    // chunk-scale formats (the signed ones on AVX-512 VNNI take `x86::signed` instead).
    let row_scales = has_chunk_scales(w.ty)
        && has_simd_tiles(level)
        && !(level == Level::Avx512Vnni && is_signed_tile(w.ty));
    #[cfg(target_arch = "x86_64")]
    let flipped = (level == Level::Avx512Vnni && is_signed_tile(w.ty))
        .then(|| crate::x86::signed::FlippedActs::new(acts));
    (0..row_jobs * groups).into_par_iter().for_each(|job| {
        let (job, group) = (job / groups, job % groups);
        let tokens = group * blocks_per_group * token_block
            ..((group + 1) * blocks_per_group * token_block).min(n_tokens);
        let r0 = job * job_rows;
        let job_n = job_rows.min(rows - r0);
        let unpack = || {
            let mut panel = Panel::new(job_n, cols);
            for i in 0..job_n {
                unpack_row(
                    level,
                    w.ty,
                    w.row(r0 + i),
                    &mut panel.q[i * cols..(i + 1) * cols],
                    &mut panel.dv[i * n_chunks * 8..(i + 1) * n_chunks * 8],
                    &mut panel.mh[i * n_halves..(i + 1) * n_halves],
                );
            }
            if row_scales {
                panel.group_row_scales(job_n, n_chunks);
            }
            panel
        };
        #[cfg(target_arch = "x86_64")]
        if let Some(flipped) = &flipped {
            use crate::x86::signed;
            let rb = w.row_bytes();
            let job_rows = &w.data[r0 * rb..(r0 + job_n) * rb];
            // SAFETY: `level` is AVX-512 VNNI, which `simd::level` reports only after
            // checking AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C on this CPU.
            let vnni = unsafe {
                if w.ty == GgmlType::Q4_0 {
                    signed::SignedPanel::from_q4_0(job_rows, job_n, cols)
                } else if w.ty == GgmlType::Q5_0 {
                    signed::SignedPanel::from_q5_0(job_rows, job_n, cols)
                } else {
                    signed::SignedPanel::build(&unpack(), job_n, cols)
                }
            };
            for tb in tokens.clone().step_by(token_block) {
                let tb_end = (tb + token_block).min(tokens.end);
                let target = OutRows {
                    out: out_ptr,
                    row0: r0,
                    stride: rows,
                };
                // SAFETY: as above.
                unsafe { signed::run_panel(&vnni, job_n, flipped, tb, tb_end, target) };
            }
            return;
        }
        let panel = unpack();
        for tb in tokens.clone().step_by(token_block) {
            let tb_end = (tb + token_block).min(tokens.end);
            for pr in (0..job_n).step_by(TILE_ROWS) {
                let pr_n = TILE_ROWS.min(job_n - pr);
                let target = OutRows {
                    out: out_ptr,
                    row0: r0 + pr,
                    stride: rows,
                };
                run_panel(level, w.ty, &panel, pr, pr_n, acts, tb, tb_end, target);
            }
        }
    });
}

/// The output matrix (`n_tokens` rows of `stride` floats), shared by the jobs of a tiled
/// matmul, each of which writes only its own weight rows (columns of the output).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    len: usize,
}

impl OutPtr {
    /// The whole of `out`, for jobs that each write their own elements.
    pub(crate) fn new(out: &mut [f32]) -> OutPtr {
        OutPtr {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// `n` elements from `start`, checked to lie inside the output.
    ///
    /// # Safety
    /// No other live reference may reach these elements (each job its own).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, n: usize) -> &mut [f32] {
        assert!(start.checked_add(n).is_some_and(|end| end <= self.len));
        // SAFETY: in bounds (checked above), the output is borrowed mutably for as long as
        // this pointer is used, and the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }
}

impl OutPtr {
    /// Stores the outputs of 8 rows from `row0` (`v[k]` token `t0 + k`'s) of a product with
    /// `rows` rows.
    ///
    /// # Safety
    /// As [`OutPtr::slice`]: no other live reference may reach these elements.
    pub(crate) unsafe fn store8(&self, rows: usize, row0: usize, t0: usize, v: &[[f32; 8]]) {
        for (k, vt) in v.iter().enumerate() {
            // SAFETY: the caller's guarantee.
            unsafe { self.slice((t0 + k) * rows + row0, 8) }.copy_from_slice(vt);
        }
    }
}

/// Splits `n_tokens` tokens into groups for a kernel of `full` tokens per call: `(first, n)`
/// with `n` = `full` while as many remain, then the rest (below `full`) in one group.
pub(crate) fn token_groups(n_tokens: usize, full: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n_tokens)
        .step_by(full)
        .map(move |t| (t, full.min(n_tokens - t)))
}

// SAFETY: jobs write disjoint elements through it (each job its own row range), and the
// borrow of the output slice outlives the parallel loop that uses it.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no element is read or written by two jobs.
unsafe impl Sync for OutPtr {}

/// Where a panel's results go: output column `row0 + i` for panel row i, token t at
/// `t * stride + row0 + i`.
#[derive(Clone, Copy)]
pub(crate) struct OutRows {
    out: OutPtr,
    row0: usize,
    stride: usize,
}

impl OutRows {
    /// Pointer to the element of token `t`, row `row0`, after checking that `rows` rows of
    /// tokens up to `t_end` are inside the output.
    pub(crate) fn base(&self, rows: usize, t_end: usize) -> (*mut f32, usize) {
        assert!(self.row0 + rows <= self.stride);
        assert!(t_end == 0 || (t_end - 1) * self.stride + self.row0 + rows <= self.out.len);
        // SAFETY: row0 < stride <= len (checked above, or nothing is written at all).
        (
            unsafe { self.out.ptr.add(self.row0.min(self.out.len)) },
            self.stride,
        )
    }
}

/// Multiplies panel rows `row0..row0 + rows` with tokens `t_begin..t_end` into `out`.
#[allow(clippy::too_many_arguments)]
fn run_panel(
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
    #[cfg(target_arch = "x86_64")]
    {
        // One tile kernel for AVX2 and AVX-512 machines alike: the results must not depend on
        // the machine (the GPU's reference numerics reproduce them, and tests pin their bits).
        // The signed formats (Q4_0, Q5_0, Q8_0) on AVX-512 VNNI never come here: `matmul_tiled`
        // runs them in `x86::signed`, whose outputs are these very bits (GGML's `vec_dot` order).
        if has_simd_tiles(level) {
            crate::x86::tile::run_panel(level, ty, panel, row0, rows, acts, t_begin, t_end, out);
            return;
        }
    }
    let _ = level;
    let signed = is_signed_tile(ty);
    let mins = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
    for t in (t_begin..t_end).step_by(TILE_TOKENS) {
        let tokens = TILE_TOKENS.min(t_end - t);
        let mut tile = [[0.0f32; TILE_TOKENS]; TILE_ROWS];
        portable_tile(signed, mins, panel, row0, rows, acts, t, tokens, &mut tile);
        let (base, stride) = out.base(rows, t + tokens);
        for (i, tile_row) in tile.iter().enumerate().take(rows) {
            for (k, v) in tile_row.iter().enumerate().take(tokens) {
                // SAFETY: `base` checked rows `0..rows` of tokens up to `t + tokens`; this
                // job is the only writer of these rows.
                unsafe { *base.add((t + k) * stride + i) = *v };
            }
        }
    }
}

/// The tile kernel in plain Rust, lane for lane the computation of the SIMD kernels: what the
/// tiled path runs on levels without a SIMD tile kernel, and its reference in the tests.
/// `mins` selects GGML's order for Q8_1 activations (see `x86::tile::has_ggml_mins`).
#[allow(clippy::too_many_arguments)]
fn portable_tile(
    signed: bool,
    mins: bool,
    panel: &Panel,
    row0: usize,
    rows: usize,
    acts: &TileActs,
    t0: usize,
    tokens: usize,
    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
) {
    let (cols, n_chunks, n_halves) = (acts.cols, acts.n_chunks, acts.n_halves);
    for (i, out_r) in out.iter_mut().enumerate().take(rows) {
        let r = row0 + i;
        let wq = &panel.q[r * cols..(r + 1) * cols];
        let wd = &panel.dv[r * n_chunks * 8..(r + 1) * n_chunks * 8];
        let wm = &panel.mh[r * n_halves..(r + 1) * n_halves];
        for (ti, o) in out_r.iter_mut().enumerate().take(tokens) {
            let t = t0 + ti;
            let aq = &acts.qs[t * cols..(t + 1) * cols];
            let mut lanes = [0.0f32; 8];
            let mut summs = 0.0f32;
            for c in 0..n_chunks {
                let da = acts.d[(t * n_chunks + c) * 8];
                if mins {
                    summs = wm[2 * c].mul_add(acts.sh[t * n_halves + 2 * c] * 2.0, summs);
                }
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let mut isum = 0i32;
                    for k in 0..4 {
                        let i = QK * c + 4 * l + k;
                        let w = if signed {
                            wq[i] as i8 as i32
                        } else {
                            wq[i] as i32
                        };
                        isum += w * (aq[i] as i8 as i32);
                    }
                    *lane = (isum as f32).mul_add(wd[8 * c + l] * da, *lane);
                }
            }
            if mins || signed {
                *o = hsum8_ggml(&lanes) + summs;
                continue;
            }
            if !signed {
                let sh = &acts.sh[t * n_halves..(t + 1) * n_halves];
                for (h, (m, s)) in wm.iter().zip(sh).enumerate() {
                    lanes[h % 8] += m * s;
                }
            }
            *o = lanes.iter().sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acts(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) * seed)
            .collect()
    }

    /// Every aligned row range of a product, computed alone, gives the bits of the whole
    /// product: for each type's kernels (Q4_K with and without llama.cpp's repacked order, whose
    /// choice follows the whole matrix's rows), one token and several; misaligned ranges are
    /// refused.
    #[test]
    fn row_ranges_give_the_bits_of_the_whole_product() {
        let cols = 512;
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
        ] {
            for rows in [72, 68, 37] {
                let wf: Vec<f32> = (0..rows * cols)
                    .map(|i| (((i * 2_654_435_761usize) >> 7) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut wq = vec![0u8; bytes_for("w", ty, rows * cols).unwrap()];
                crate::quantize(ty, &wf, &mut wq).unwrap();
                let w = QMatrix::new(ty, rows, cols, &wq).unwrap();
                for n in [1, 3, 20] {
                    let x = quantize_activations(vec_dot_type(ty), &acts(n * cols, 0.05), n, cols)
                        .unwrap();
                    let mut whole = vec![0.0f32; n * rows];
                    matmul(&w, &x, &mut whole).unwrap();
                    let ends = (16..rows).step_by(16).chain([rows]);
                    let mut start = 0;
                    for end in ends {
                        let mut part = vec![f32::NAN; n * (end - start)];
                        matmul_rows(&w, &x, start..end, &mut part).unwrap();
                        for t in 0..n {
                            for r in start..end {
                                assert_eq!(
                                    part[t * (end - start) + r - start].to_bits(),
                                    whole[t * rows + r].to_bits(),
                                    "{ty} rows {rows}, {n} tokens, row {r} of range {start}..{end}"
                                );
                            }
                        }
                        start = end;
                    }
                    let mut part = vec![0.0f32; n * 8];
                    assert!(matches!(
                        matmul_rows(&w, &x, 8..16, &mut part),
                        Err(QuantError::RowRange { start: 8, .. })
                    ));
                    let mut part = vec![0.0f32; n * rows];
                    assert!(matches!(
                        matmul_rows(&w, &x, 0..rows + 1, &mut part),
                        Err(QuantError::RowRange { .. })
                    ));
                }
            }
        }
    }

    /// A reused buffer gives exactly what a fresh quantization gives, growing and shrinking,
    /// and a tiled matmul after requantizing sees the new tokens, not the old tile layout.
    #[test]
    fn requantize_matches_fresh_quantization() {
        let cols = 256;
        let rows = 8;
        let wf = acts(rows * cols, 0.013);
        let mut wq = vec![0u8; bytes_for("w", GgmlType::Q4_K, rows * cols).unwrap()];
        crate::quantize(GgmlType::Q4_K, &wf, &mut wq).unwrap();
        let w = QMatrix::new(GgmlType::Q4_K, rows, cols, &wq).unwrap();
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
            let mut buf = QuantizedActivations::empty(ty, cols).unwrap();
            for (n, seed) in [(3, 0.1), (40, 0.07), (1, 0.3), (17, 0.02)] {
                let x = acts(n * cols, seed);
                buf.requantize(&x, n).unwrap();
                let fresh = quantize_activations(ty, &x, n, cols).unwrap();
                assert_eq!(buf.data(), fresh.data());
                assert_eq!(buf.n_tokens(), n);
                if ty == GgmlType::Q8_K {
                    let mut a = vec![0.0; n * rows];
                    let mut b = vec![0.0; n * rows];
                    let level = simd::level();
                    matmul_with(level, Strategy::Tiled, &w, &buf, &mut a).unwrap();
                    matmul_with(level, Strategy::Tiled, &w, &fresh, &mut b).unwrap();
                    assert_eq!(a, b);
                }
            }
            assert!(buf.requantize(&[0.0; 10], 1).is_err());
        }
    }

    /// Big enough for several parallel jobs, with rows not a multiple of 4: the split over
    /// threads gives exactly what one sweep over all rows gives, for one and several tokens.
    #[test]
    fn rowwise_split_matches_one_sweep() {
        let (rows, cols) = (16387, 64);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0] {
            let wf = acts(rows * cols, 0.011);
            let mut wq = vec![0u8; bytes_for("w", ty, rows * cols).unwrap()];
            crate::quantize(ty, &wf, &mut wq).unwrap();
            let w = QMatrix::new(ty, rows, cols, &wq).unwrap();
            assert!(wq.len() >= 3 * ROWWISE_MIN_JOB_BYTES);
            // Three threads take one job each (handed out by broadcast); 32 get fewer jobs
            // than threads (a parallel iterator).
            for (n, threads) in [(1, 3), (3, 3), (1, 32), (2, 32)] {
                let x =
                    quantize_activations(vec_dot_type(ty), &acts(n * cols, 0.05), n, cols).unwrap();
                let level = simd::level();
                let mut out = vec![f32::NAN; n * rows];
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let jobs = pool.install(|| split_rows(rows, wq.len(), ROWWISE_ROW_ALIGN).0);
                assert_eq!(jobs == threads, threads == 3, "{ty}: {jobs} jobs");
                pool.install(|| matmul_with(level, Strategy::RowWise, &w, &x, &mut out))
                    .unwrap();
                let mut one = vec![0.0; n * rows];
                for (t, o) in one.chunks_mut(rows).enumerate() {
                    rowwise_job(level, &w, x.row(t), 0, o);
                }
                assert_eq!(out, one, "{ty}, {n} tokens, {threads} threads");
            }
        }
    }

    /// The tiled path splits tokens as well as rows when the rows make few jobs for the pool:
    /// every split (1 thread: none; 8 and 48: two or more token groups, the last one short)
    /// gives the bits of one thread, on every tile kernel this machine has.
    #[test]
    fn tiled_token_groups_give_the_bits_of_one_thread() {
        let (rows, cols, n) = (70, 512, 301);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
        ] {
            let wf = acts(rows * cols, 0.011);
            let mut wq = vec![0u8; bytes_for("w", ty, rows * cols).unwrap()];
            crate::quantize(ty, &wf, &mut wq).unwrap();
            let w = QMatrix::new(ty, rows, cols, &wq).unwrap();
            let x = quantize_activations(vec_dot_type(ty), &acts(n * cols, 0.05), n, cols).unwrap();
            for level in simd::available_levels() {
                let run = |threads: usize| {
                    let mut out = vec![f32::NAN; n * rows];
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap()
                        .install(|| matmul_with(level, Strategy::Tiled, &w, &x, &mut out))
                        .unwrap();
                    out
                };
                let one = run(1);
                assert!(one.iter().all(|v| v.is_finite()), "{ty} {level:?}");
                for threads in [8, 48] {
                    assert_eq!(run(threads), one, "{ty}, {level:?}, {threads} threads");
                }
            }
        }
    }
}
