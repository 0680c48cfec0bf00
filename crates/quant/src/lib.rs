//! GGML quantization formats on the CPU: byte layouts, reference quantizers, dequantizers, dot
//! products and matrix products, with a plain scalar implementation of everything and SIMD
//! kernels (AVX2, AVX-512, NEON) chosen at run time.
//!
//! Numerics follow GGML so that ember reproduces llama.cpp's outputs: a weight row of type `T`
//! is dotted against activations quantized to `vec_dot_type(T)` (Q8_0, Q8_1 or Q8_K for the
//! quantized types), with GGML's reference rounding.
//!
//! Layout of the crate: [`blocks`] (block layouts), `scalar` (the reference), `x86` and
//! `aarch64` (SIMD twins of the scalar kernels), `matmul` (tiling and threading),
//! `repack_order` and `repack_q4_0` (Q4_K and Q4_0 in the order of llama.cpp's repacked x86
//! kernels), [`team`] (the threads of decoding's short ops).
//!
//! Beyond the same mathematics, the x86 paths sum in GGML's order where llama.cpp's reference
//! numbers depend on it: Q4_1, Q5_1, Q5_0, Q8_0, Q6_K and the Q4_0 matrices that llama.cpp does
//! not repack give, at every batch size and strategy, exactly what GGML's AVX2 `vec_dot` (or
//! llamafile's `tinyBLAS`, which sums alike) gives, and Q4_K and Q4_0 matrices that llama.cpp
//! repacks (rows a multiple of 8) follow its repacked GEMV/GEMM steps. The AVX-512 VNNI kernels
//! (Q4_0 and Q5_0 decode; Q4_0, Q5_0, Q8_0, Q4_K and Q6_K prompts) and the activation
//! quantizers form their integer sums differently but give the same bits.

pub mod blocks;
mod matmul;
mod repack_order;
mod repack_q4_0;
mod scalar;
pub mod simd;
pub mod team;

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use ember_gguf::GgmlType;
pub use matmul::{
    matmul, matmul_f32, matmul_rows, matmul_with, quantize_activations, QuantizedActivations,
    Strategy, ROW_RANGE_ALIGN,
};

/// Errors of this crate: what was expected and what was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("unsupported tensor type {0}: ember-quant handles F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q6_K and Q8_K")]
    UnsupportedType(GgmlType),
    #[error("type {0} has no dot product of its own (it is an activation format)")]
    NoDotProduct(GgmlType),
    #[error("{what}: expected a whole number of {ty} blocks of {block_size} elements, found {found} elements")]
    NotWholeBlocks {
        what: &'static str,
        ty: GgmlType,
        block_size: usize,
        found: usize,
    },
    #[error("{what}: expected {expected} {unit}, found {found}")]
    LengthMismatch {
        what: &'static str,
        unit: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("activations are {found}, expected {expected} (the vec_dot_type of the weights)")]
    ActivationType { expected: GgmlType, found: GgmlType },
    #[error("row range {start}..{end} of a {rows}-row matrix: it must lie inside the matrix, start at a multiple of {align} and end at one or at the last row")]
    RowRange {
        start: usize,
        end: usize,
        rows: usize,
        align: usize,
    },
    #[error("matrix of {rows} x {cols} {ty}: size overflows usize")]
    Overflow {
        ty: GgmlType,
        rows: usize,
        cols: usize,
    },
}

/// Whether this crate can quantize, dequantize and (for weight types) dot `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
    )
}

/// The activation type that weights of type `ty` are dotted against (GGML's `vec_dot_type`).
/// Activation formats and unsupported types map to themselves.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
        other => other,
    }
}

fn check_supported(ty: GgmlType) -> Result<(), QuantError> {
    if is_supported(ty) {
        Ok(())
    } else {
        Err(QuantError::UnsupportedType(ty))
    }
}

/// Bytes of `n` elements of `ty`, which must be whole blocks.
pub(crate) fn bytes_for(what: &'static str, ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if !n.is_multiple_of(block_size) {
        return Err(QuantError::NotWholeBlocks {
            what,
            ty,
            block_size,
            found: n,
        });
    }
    (n / block_size)
        .checked_mul(ty.type_size())
        .ok_or(QuantError::Overflow {
            ty,
            rows: 1,
            cols: n,
        })
}

fn check_len(
    what: &'static str,
    unit: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), QuantError> {
    if expected == found {
        Ok(())
    } else {
        Err(QuantError::LengthMismatch {
            what,
            unit,
            expected,
            found,
        })
    }
}

/// Dequantizes `dst.len()` elements (whole blocks) of `ty` from `src`, which must hold exactly
/// those blocks.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_supported(ty)?;
    let bytes = bytes_for("dequantize destination", ty, dst.len())?;
    check_len("dequantize source", "bytes", bytes, src.len())?;
    scalar::dequantize(ty, src, dst);
    Ok(())
}

/// Quantizes `src` (whole blocks) to `ty` with GGML's reference quantizer (no importance
/// matrix); `dst` must hold exactly the resulting blocks.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_supported(ty)?;
    let bytes = bytes_for("quantize source", ty, src.len())?;
    check_len("quantize destination", "bytes", bytes, dst.len())?;
    scalar::quantize_reference(ty, src, dst);
    Ok(())
}

/// Checks the arguments of a dot product of one row of `n` elements.
fn check_vec_dot(ty: GgmlType, w: &[u8], act: &[u8], n: usize) -> Result<(), QuantError> {
    check_supported(ty)?;
    if matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
        return Err(QuantError::NoDotProduct(ty));
    }
    let w_bytes = bytes_for("vec_dot weights", ty, n)?;
    check_len("vec_dot weights", "bytes", w_bytes, w.len())?;
    let act_ty = vec_dot_type(ty);
    let a_bytes = bytes_for("vec_dot activations", act_ty, n)?;
    check_len("vec_dot activations", "bytes", a_bytes, act.len())
}

/// Dot product of one weight row of `n` elements of `ty` with activations of
/// [`vec_dot_type`]`(ty)`, on the best SIMD path of this CPU.
pub fn vec_dot(ty: GgmlType, w: &[u8], act: &[u8], n: usize) -> Result<f32, QuantError> {
    check_vec_dot(ty, w, act, n)?;
    Ok(simd::vec_dot(simd::level(), ty, w, act, n))
}

/// [`vec_dot`] on a given SIMD level, for tests and benchmarks that compare paths
/// (`simd::Level::Scalar` is the plain reference). A level this CPU lacks runs as scalar.
pub fn vec_dot_with(
    level: simd::Level,
    ty: GgmlType,
    w: &[u8],
    act: &[u8],
    n: usize,
) -> Result<f32, QuantError> {
    check_vec_dot(ty, w, act, n)?;
    let level = if simd::available_levels().contains(&level) {
        level
    } else {
        simd::Level::Scalar
    };
    Ok(simd::vec_dot(level, ty, w, act, n))
}

/// A weight matrix in GGML layout: `rows` rows, each `cols` elements of `ty`, rows contiguous.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Checks that `ty` has a dot product, that `cols` is whole blocks and that `data` holds
    /// exactly `rows` rows.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        check_supported(ty)?;
        if matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
            return Err(QuantError::NoDotProduct(ty));
        }
        let row_bytes = bytes_for("matrix row", ty, cols)?;
        let total = row_bytes
            .checked_mul(rows)
            .ok_or(QuantError::Overflow { ty, rows, cols })?;
        check_len("matrix data", "bytes", total, data.len())?;
        Ok(QMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// The bytes of row `i`. Panics when `i >= rows`, like slice indexing.
    pub fn row(&self, i: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }

    /// Dequantizes row `i` into `dst`, which must hold `cols` elements.
    pub fn dequantize_row(&self, i: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        if i >= self.rows {
            return Err(QuantError::LengthMismatch {
                what: "dequantize_row index",
                unit: "rows at most",
                expected: self.rows,
                found: i + 1,
            });
        }
        check_len(
            "dequantize_row destination",
            "elements",
            self.cols,
            dst.len(),
        )?;
        scalar::dequantize(self.ty, self.row(i), dst);
        Ok(())
    }
}
