//! Helpers shared by the integration tests: a small deterministic RNG, random blocks of every
//! format, error measures, and a minimal GGUF reader for the real-model checks.

#![allow(dead_code)]

use ember_quant::blocks::{self, QK_K};
use ember_quant::GgmlType;
use half::f16;

/// SplitMix64: deterministic, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * (3.0f32).sqrt()
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    /// A signed byte in [-127, 127], the range GGML's quantizers produce.
    pub fn i8_sym(&mut self) -> i8 {
        ((self.next_u64() % 255) as i32 - 127) as i8
    }

    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.uniform()
    }
}

/// Normal data with a few outliers, like real weights and activations.
pub fn test_data(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = rng.normal() * scale;
            if i % 97 == 13 {
                v * 6.0
            } else {
                v
            }
        })
        .collect()
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Random blocks of weight type `ty` for `n` elements: random quant bytes and random scales;
/// with `unit_scales`, every scale and min is 1 (and legacy mins 0) so dot products are exact
/// integers.
pub fn random_weights(rng: &mut Rng, ty: GgmlType, n: usize, unit_scales: bool) -> Vec<u8> {
    use GgmlType::*;
    let nb = n / ty.block_size();
    let size = ty.type_size();
    let mut out = vec![0u8; nb * size];
    if matches!(ty, F32 | F16 | BF16) {
        let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        ember_quant::quantize(ty, &x, &mut out).unwrap();
        return out;
    }
    for b in out.chunks_exact_mut(size) {
        for v in b.iter_mut() {
            *v = rng.byte();
        }
        let scale = |rng: &mut Rng| {
            if unit_scales {
                1.0
            } else {
                rng.range(0.001, 0.05)
            }
        };
        match ty {
            Q4_0 | Q5_0 => put_f16(b, 0, scale(rng)),
            Q4_1 | Q5_1 => {
                put_f16(b, 0, scale(rng));
                let m = if unit_scales {
                    0.0
                } else {
                    -rng.range(0.0, 0.5)
                };
                put_f16(b, 2, m);
            }
            Q8_0 => {
                put_f16(b, 0, scale(rng));
                for q in &mut b[2..34] {
                    *q = rng.i8_sym() as u8;
                }
            }
            Q2_K => {
                put_f16(b, blocks::q2_k::D, scale(rng));
                put_f16(b, blocks::q2_k::DMIN, scale(rng));
            }
            Q3_K => put_f16(b, blocks::q3_k::D, scale(rng)),
            Q4_K | Q5_K => {
                put_f16(b, 0, scale(rng));
                put_f16(b, 2, scale(rng));
            }
            Q6_K => {
                put_f16(b, blocks::q6_k::D, scale(rng));
                // Scales are i8; GGML's quantizer never writes -128.
                for s in &mut b[blocks::q6_k::SCALES..blocks::q6_k::SCALES + 16] {
                    *s = rng.i8_sym() as u8;
                }
            }
            _ => panic!("no random weights for {ty}"),
        }
    }
    out
}

/// Random activation blocks of `ty` (Q8_0, Q8_1 or Q8_K) for `n` elements, internally
/// consistent (Q8_K block sums match the quants).
pub fn random_acts(rng: &mut Rng, ty: GgmlType, n: usize, unit_scales: bool) -> Vec<u8> {
    use GgmlType::*;
    let nb = n / ty.block_size();
    let size = ty.type_size();
    let mut out = vec![0u8; nb * size];
    if matches!(ty, F32 | F16 | BF16) {
        let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        ember_quant::quantize(ty, &x, &mut out).unwrap();
        return out;
    }
    for b in out.chunks_exact_mut(size) {
        let d = if unit_scales {
            1.0
        } else {
            rng.range(0.001, 0.05)
        };
        match ty {
            Q8_0 => {
                put_f16(b, 0, d);
                for q in &mut b[2..34] {
                    *q = rng.i8_sym() as u8;
                }
            }
            Q8_1 => {
                put_f16(b, 0, d);
                for q in &mut b[4..36] {
                    *q = rng.i8_sym() as u8;
                }
                let s = if unit_scales {
                    0.0
                } else {
                    rng.range(-2.0, 2.0)
                };
                put_f16(b, 2, s);
            }
            Q8_K => {
                b[0..4].copy_from_slice(&d.to_le_bytes());
                for q in &mut b[4..4 + QK_K] {
                    *q = rng.i8_sym() as u8;
                }
                for j in 0..16 {
                    let s: i32 = b[4 + 16 * j..4 + 16 * j + 16]
                        .iter()
                        .map(|&q| q as i8 as i32)
                        .sum();
                    let o = blocks::q8_k::BSUMS + 2 * j;
                    b[o..o + 2].copy_from_slice(&(s as i16).to_le_bytes());
                }
            }
            _ => panic!("no random activations for {ty}"),
        }
    }
    out
}

/// Dequantizes whole blocks to a new vector.
pub fn dequant(ty: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    ember_quant::dequantize(ty, data, &mut out).unwrap();
    out
}

/// The scale against which float rounding of a dot product is measured:
/// Σ_i max|w| over i's 16-element group · |a_i|. It covers the terms that the kernels add
/// and cancel (block offsets are at most a group's largest magnitude).
pub fn abs_scale(w: &[f32], a: &[f32]) -> f64 {
    let mut s = 0.0f64;
    for (wg, ag) in w.chunks(16).zip(a.chunks(16)) {
        let m = wg.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        s += ag.iter().map(|v| m * v.abs() as f64).sum::<f64>();
    }
    s
}

/// A tensor found in a GGUF file.
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub offset: u64,
}

/// The bytes of a GGUF file and its tensor directory: just enough parsing for these tests
/// (the real parser lives in ember-gguf).
pub struct Gguf {
    pub bytes: Vec<u8>,
    pub tensors: Vec<TensorInfo>,
    pub data_start: usize,
}

impl Gguf {
    pub fn open(path: &std::path::Path) -> Gguf {
        let bytes = std::fs::read(path).unwrap();
        let mut pos = 0usize;
        let mut rd = |n: usize| {
            let s = pos;
            pos += n;
            s
        };
        let u32_at = |b: &[u8], p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
        let u64_at = |b: &[u8], p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap());
        assert_eq!(&bytes[0..4], b"GGUF");
        rd(4);
        let version = u32_at(&bytes, rd(4));
        assert!(version >= 2);
        let n_tensors = u64_at(&bytes, rd(8));
        let n_kv = u64_at(&bytes, rd(8));
        let mut alignment = 32u64;
        fn skip_value(b: &[u8], pos: &mut usize, ty: u32) {
            let fixed = |t: u32| match t {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            };
            if let Some(n) = fixed(ty) {
                *pos += n;
            } else if ty == 8 {
                let len = u64::from_le_bytes(b[*pos..*pos + 8].try_into().unwrap()) as usize;
                *pos += 8 + len;
            } else if ty == 9 {
                let et = u32::from_le_bytes(b[*pos..*pos + 4].try_into().unwrap());
                let len = u64::from_le_bytes(b[*pos + 4..*pos + 12].try_into().unwrap());
                *pos += 12;
                for _ in 0..len {
                    skip_value(b, pos, et);
                }
            } else {
                panic!("unknown GGUF value type {ty}");
            }
        }
        for _ in 0..n_kv {
            let klen = u64_at(&bytes, pos) as usize;
            let key = String::from_utf8_lossy(&bytes[pos + 8..pos + 8 + klen]).to_string();
            pos += 8 + klen;
            let vt = u32_at(&bytes, pos);
            pos += 4;
            if key == "general.alignment" && vt == 4 {
                alignment = u32_at(&bytes, pos) as u64;
            }
            skip_value(&bytes, &mut pos, vt);
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let nlen = u64_at(&bytes, pos) as usize;
            let name = String::from_utf8_lossy(&bytes[pos + 8..pos + 8 + nlen]).to_string();
            pos += 8 + nlen;
            let nd = u32_at(&bytes, pos) as usize;
            pos += 4;
            let dims: Vec<u64> = (0..nd).map(|i| u64_at(&bytes, pos + 8 * i)).collect();
            pos += 8 * nd;
            let ty = GgmlType::from_u32(u32_at(&bytes, pos)).unwrap();
            pos += 4;
            let offset = u64_at(&bytes, pos);
            pos += 8;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let data_start = (pos as u64).div_ceil(alignment) * alignment;
        Gguf {
            bytes,
            tensors,
            data_start: data_start as usize,
        }
    }

    pub fn tensor(&self, name: &str) -> (&TensorInfo, &[u8]) {
        let t = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        let n: u64 = t.dims.iter().product();
        let size = t.ty.row_bytes(n).unwrap() as usize;
        let start = self.data_start + t.offset as usize;
        (t, &self.bytes[start..start + size])
    }
}

/// The directory of the test models: `EMBER_MODELS_DIR`, else `~/.cache/ember/models`.
pub fn models_dir() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("EMBER_MODELS_DIR") {
        return d.into();
    }
    let home = std::env::var_os("HOME").expect("HOME or EMBER_MODELS_DIR must be set");
    std::path::Path::new(&home).join(".cache/ember/models")
}
