//! Random tensor data: deterministic from (seed, tensor name, row), generated and quantized row
//! by row in parallel, so a tensor of any size is produced at the speed of the quantizer and
//! the same seed always gives the same file whatever the thread count.

use ember_gguf::GgmlType;
use rayon::prelude::*;

use crate::vocab::mix64;
use crate::SynthError;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal { std: f32 },
    /// Uniform in `center ± spread` (norm weights).
    Uniform { center: f32, spread: f32 },
    /// These exact values (rotary frequency factors).
    Values(Vec<f32>),
}

/// A small fast generator (SplitMix64): statistical quality is ample for random weights, and
/// seeding it per row costs nothing.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Fills `out` with values of `init` (Box-Muller for the normal, two values per draw).
    fn fill(&mut self, init: &Init, out: &mut [f32]) {
        match init {
            Init::Normal { std } => {
                let std = *std as f64;
                for pair in out.chunks_mut(2) {
                    let radius = (-2.0 * self.unit().ln()).sqrt() * std;
                    let angle = 2.0 * std::f64::consts::PI * self.unit();
                    pair[0] = (radius * angle.cos()) as f32;
                    if let Some(second) = pair.get_mut(1) {
                        *second = (radius * angle.sin()) as f32;
                    }
                }
            }
            Init::Uniform { center, spread } => {
                for v in out {
                    *v = center + (*spread as f64 * (2.0 * self.unit() - 1.0)) as f32;
                }
            }
            Init::Values(values) => out.copy_from_slice(&values[..out.len()]),
        }
    }
}

/// A stable 64-bit hash of a tensor name (FNV-1a), so seeds do not depend on tensor order.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The generator of row `row` of tensor `name` under `seed`.
fn row_rng(seed: u64, name: &str, row: u64) -> Rng {
    Rng(mix64(mix64(seed ^ name_hash(name)) ^ row))
}

/// Bytes of one row of `cols` elements of `ty`, or an error naming the tensor when `cols` is
/// not whole blocks.
pub fn row_bytes(name: &str, ty: GgmlType, cols: usize) -> Result<usize, SynthError> {
    ty.row_bytes(cols as u64)
        .map(|b| b as usize)
        .ok_or_else(|| SynthError::NotWholeBlocks {
            tensor: name.to_string(),
            ty,
            cols,
        })
}

/// Writes `values` as `ty` into `out` (exactly one row's bytes).
fn encode(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<(), SynthError> {
    match ty {
        GgmlType::F32 => {
            for (chunk, v) in out.chunks_exact_mut(4).zip(values) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }
        _ => ember_quant::quantize(ty, values, out).map_err(SynthError::from),
    }
}

/// Fills `out` (rows of `cols` elements of `ty`) with values of `init`, quantizing each row.
pub fn fill_exact(
    name: &str,
    ty: GgmlType,
    cols: usize,
    init: &Init,
    seed: u64,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let rb = row_bytes(name, ty, cols)?;
    if let Init::Values(v) = init {
        if v.len() != cols || out.len() != rb {
            return Err(SynthError::Internal(format!(
                "tensor {name}: expected one row of {cols} given values, found {} values for {} bytes",
                v.len(),
                out.len()
            )));
        }
    }
    out.par_chunks_mut(rb).enumerate().try_for_each_init(
        || vec![0f32; cols],
        |values, (row, bytes)| {
            row_rng(seed, name, row as u64).fill(init, values);
            encode(ty, values, bytes)
        },
    )
}

/// Number of distinct random units a `--fast` tensor is assembled from.
const FAST_POOL_UNITS: usize = 4096;

/// Fills `out` like [`fill_exact`] but fast: a pool of [`FAST_POOL_UNITS`] units (one block of a
/// quantized type, 32 values of a float type) is generated and quantized properly, and each
/// unit of each row is a copy of a pool unit picked at random. Every block is therefore valid
/// and distributed like an exactly quantized one; only the variety is smaller, which speed
/// measurements do not see.
pub fn fill_fast(
    name: &str,
    ty: GgmlType,
    cols: usize,
    init: &Init,
    seed: u64,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let rb = row_bytes(name, ty, cols)?;
    let unit_values = if ty.is_quantized() {
        ty.block_size()
    } else {
        32
    };
    if matches!(init, Init::Values(_)) || !cols.is_multiple_of(unit_values) {
        return fill_exact(name, ty, cols, init, seed, out);
    }
    let unit_bytes = row_bytes(name, ty, unit_values)?;
    let mut pool = vec![0u8; FAST_POOL_UNITS * unit_bytes];
    let pool_name = format!("{name}#pool");
    fill_exact(&pool_name, ty, unit_values, init, seed, &mut pool)?;
    let units_per_row = cols / unit_values;
    out.par_chunks_mut(rb).enumerate().for_each(|(row, bytes)| {
        let mut rng = row_rng(seed, name, row as u64);
        for unit in bytes.chunks_exact_mut(unit_bytes).take(units_per_row) {
            let pick = (rng.next_u64() % FAST_POOL_UNITS as u64) as usize;
            unit.copy_from_slice(&pool[pick * unit_bytes..(pick + 1) * unit_bytes]);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_have_the_asked_spread() {
        let mut v = vec![0f32; 100_000];
        row_rng(1, "t", 0).fill(&Init::Normal { std: 0.5 }, &mut v);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        // Standard errors: mean 0.0016, std about 0.0011.
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
    }

    #[test]
    fn rows_depend_on_seed_name_and_row_only() {
        let fill = |seed, name: &str| {
            let mut out = vec![0u8; 4 * 64 * 4];
            fill_exact(
                name,
                GgmlType::F32,
                64,
                &Init::Normal { std: 1.0 },
                seed,
                &mut out,
            )
            .unwrap();
            out
        };
        let a = fill(7, "w");
        assert_eq!(a, fill(7, "w"));
        assert_ne!(a, fill(8, "w"));
        assert_ne!(a, fill(7, "x"));
        assert_ne!(a[..256], a[256..512], "rows differ");
    }

    #[test]
    fn fast_fill_gives_valid_blocks_with_the_same_spread() {
        let cols = 512;
        let rows = 64;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::F16,
        ] {
            let rb = row_bytes("w", ty, cols).unwrap();
            let mut out = vec![0u8; rb * rows];
            fill_fast("w", ty, cols, &Init::Normal { std: 0.1 }, 3, &mut out).unwrap();
            let mut values = vec![0f32; cols * rows];
            ember_quant::dequantize(ty, &out, &mut values).unwrap();
            let rms =
                (values.iter().map(|&x| (x * x) as f64).sum::<f64>() / values.len() as f64).sqrt();
            assert!((rms - 0.1).abs() < 0.01, "{ty}: rms {rms}");
            assert!(values.iter().all(|v| v.is_finite()), "{ty}");
        }
    }

    #[test]
    fn bad_row_lengths_are_errors() {
        let mut out = vec![0u8; 18];
        let e = fill_exact(
            "w",
            GgmlType::Q4_0,
            48,
            &Init::Normal { std: 1.0 },
            0,
            &mut out,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor w: rows of 48 elements are not whole blocks of Q4_0 (32 elements)"
        );
    }
}
