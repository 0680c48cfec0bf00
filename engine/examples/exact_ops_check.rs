//! Holds the GPU backend's reference numerics to the CPU backend, op by op and bit for bit: for
//! every [`Backend`] op the forward pass uses, random inputs at the shapes of real models go
//! through the CPU backend (2 threads, as the reference outputs were made) and through the GPU
//! backend in reference mode, and the results' bits are compared. One line per check,
//! `PASS name` or `FAIL name: first mismatch at i: gpu=.. cpu=..`; the exit code is 1 when any
//! check failed.
//!
//! `cargo build --release -p ember --examples`, then on the GPU machine (kernels as `ember` finds
//! them: `EMBER_KERNELS_DIR`, or `kernels/` beside the binary):
//! `target/release/examples/exact_ops_check [--device cuda:0] [--only SUBSTRING] [--quick]`.
//! `--only` runs the checks whose name contains the text (`rms_norm`, `q4_k`, `attention`, ...);
//! `--quick` keeps the smallest and largest shapes only; `--dry-run` puts a second CPU backend in
//! the GPU's place (no GPU needed), to check the checks.
//!
//! Shapes: hidden sizes 576, 640, 2048, 4096; head sizes 64, 128, 256; batches of 1, 5, 64 and
//! 300 tokens; every weight format the GPU backend places. Matrix products and attention go
//! through the Backend ops too (their exact kernels are `ops::matmul_exact` and
//! `ops::attention_exact`), so the integration is checked along with the element-wise ops.

use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use ember::backend::cpu::CpuBackend;
use ember::backend::gpu::{self, GpuBackend, Numerics, OpenOptions};
use ember::backend::{Backend, RopeMode, RopeParams};
use ember::batch::Batch;
use ember::device::DeviceSpec;
use ember::kv_cache::{AttentionPlan, KvCache, DEFAULT_BLOCK_SIZE};
use ember_gguf::{GgmlType, Gguf, GgufWriter};
use half::f16;

#[derive(Debug, Parser)]
#[command(about = "GPU reference numerics against the CPU backend, op by op, bit for bit")]
struct Args {
    /// The GPU: cuda:N or hip:N (auto: the first usable one).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// Run only the checks whose name contains this text.
    #[arg(long)]
    only: Option<String>,
    /// Only the smallest and largest shapes.
    #[arg(long)]
    quick: bool,
    /// CPU threads, and the reference thread count of the GPU backend.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Run every check with a second CPU backend in the GPU's place (no GPU needed): checks the
    /// checks themselves, every line should pass.
    #[arg(long)]
    dry_run: bool,
}

/// SplitMix64: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Values in (-mag, mag) with a spread of scales: mostly of size `mag`, some a hundred
    /// times smaller, a few outliers ten times larger.
    fn values(&mut self, n: usize, mag: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let v = (self.unit() * 2.0 - 1.0) * mag;
                match self.below(64) {
                    0 => v * 10.0,
                    1..=8 => v * 0.01,
                    _ => v,
                }
            })
            .collect()
    }
}

/// A backend the checks can feed host values and read back.
trait Host: Backend {
    fn upload(&self, values: &[f32]) -> Result<Self::Buf, String>;
    fn download(&self, buf: &Self::Buf, len: usize) -> Result<Vec<f32>, String>;
    /// The GPU backend, for the checks that need its own accessors (none in a dry run).
    fn as_gpu(&self) -> Option<&GpuBackend>;
}

impl Host for CpuBackend {
    fn upload(&self, values: &[f32]) -> Result<Vec<f32>, String> {
        Ok(values.to_vec())
    }

    fn download(&self, buf: &Vec<f32>, len: usize) -> Result<Vec<f32>, String> {
        Ok(buf[..len].to_vec())
    }

    fn as_gpu(&self) -> Option<&GpuBackend> {
        None
    }
}

impl Host for GpuBackend {
    fn upload(&self, values: &[f32]) -> Result<gpu::GpuBuf, String> {
        let mut buf = self.alloc(values.len());
        self.write(&mut buf, values);
        match self.take_failure() {
            Some(failure) => Err(failure.to_string()),
            None => Ok(buf),
        }
    }

    fn download(&self, buf: &gpu::GpuBuf, len: usize) -> Result<Vec<f32>, String> {
        let mut out = Vec::new();
        self.read(buf, len, &mut out);
        match self.take_failure() {
            Some(failure) => Err(failure.to_string()),
            None if out.len() != len => Err(format!("read {} values, expected {len}", out.len())),
            None => Ok(out),
        }
    }

    fn as_gpu(&self) -> Option<&GpuBackend> {
        Some(self)
    }
}

/// Counts and prints the verdicts.
struct Report {
    only: Option<String>,
    passed: usize,
    failed: usize,
}

impl Report {
    fn wants(&self, name: &str) -> bool {
        self.only.as_deref().is_none_or(|o| name.contains(o))
    }

    fn fail(&mut self, name: &str, why: &str) {
        println!("FAIL {name}: {why}");
        self.failed += 1;
    }

    /// Compares bits; NaNs count as equal only when their bits are.
    fn compare(&mut self, name: &str, gpu: Result<Vec<f32>, String>, cpu: &[f32]) {
        let gpu = match gpu {
            Ok(values) => values,
            Err(error) => return self.fail(name, &format!("the GPU op failed: {error}")),
        };
        if gpu.len() != cpu.len() {
            return self.fail(
                name,
                &format!("gpu gave {} values, cpu {}", gpu.len(), cpu.len()),
            );
        }
        let mismatches: Vec<usize> = (0..cpu.len())
            .filter(|&i| gpu[i].to_bits() != cpu[i].to_bits())
            .collect();
        match mismatches.first() {
            None => {
                println!("PASS {name}");
                self.passed += 1;
            }
            Some(&i) => {
                let max_diff = mismatches
                    .iter()
                    .map(|&j| (gpu[j] - cpu[j]).abs())
                    .fold(0f32, f32::max);
                self.fail(
                    name,
                    &format!(
                        "first mismatch at {i}: gpu={:e} ({:#010x}) cpu={:e} ({:#010x}); {} of {} values differ, max |diff| {max_diff:e}",
                        gpu[i],
                        gpu[i].to_bits(),
                        cpu[i],
                        cpu[i].to_bits(),
                        mismatches.len(),
                        cpu.len()
                    ),
                );
            }
        }
    }
}

/// The two backends and the weights file the matrix and vector checks place from. `gpu` is a
/// second CPU backend in a dry run (`--dry-run`), which checks the checks.
struct Rig<G: Host> {
    cpu: CpuBackend,
    gpu: G,
    gguf: Arc<Gguf>,
    quick: bool,
}

impl<G: Host> Rig<G> {
    fn tensor(&self, name: &str) -> &ember_gguf::TensorInfo {
        self.gguf
            .tensor(name)
            .unwrap_or_else(|| panic!("the check's weights file has no {name}"))
    }

    fn token_counts(&self) -> Vec<usize> {
        if self.quick {
            vec![1, 300]
        } else {
            vec![1, 5, 64, 300]
        }
    }

    fn hidden_sizes(&self) -> Vec<usize> {
        if self.quick {
            vec![576, 4096]
        } else {
            vec![576, 640, 2048, 4096]
        }
    }
}

/// Weight formats, as GGUF types, with their GPU names.
const FORMATS: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

const HIDDEN_SIZES: [usize; 4] = [576, 640, 2048, 4096];
const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Rows of the embedding tables and of the matrices of the product checks.
const TABLE_ROWS: usize = 64;
const MATRIX_ROWS: usize = 256;

fn tensor_name(kind: &str, ty: GgmlType, cols: usize) -> String {
    format!("{kind}.{}.{cols}", ty.name())
}

/// A GGUF in memory with every table, matrix and vector the checks place.
fn weights_file(rng: &mut Rng) -> anyhow::Result<Arc<Gguf>> {
    let mut writer = GgufWriter::new();
    for ty in FORMATS {
        for cols in HIDDEN_SIZES {
            if cols % ty.block_size() != 0 {
                continue;
            }
            for (kind, rows) in [("emb", TABLE_ROWS), ("w", MATRIX_ROWS), ("wk", MATRIX_ROWS)] {
                let values = rng.values(rows * cols, 0.1);
                let mut data = vec![0u8; rows * cols / ty.block_size() * ty.type_size()];
                ember_quant::quantize(ty, &values, &mut data)
                    .with_context(|| format!("quantizing {kind} to {}", ty.name()))?;
                writer.tensor(
                    &tensor_name(kind, ty, cols),
                    &[cols as u64, rows as u64],
                    ty,
                    data,
                );
            }
        }
    }
    let mut vector_dims: Vec<usize> = HIDDEN_SIZES.to_vec();
    vector_dims.extend(HEAD_DIMS);
    vector_dims.extend([9 * 64, 3 * 64, 4 * 256, 32 * 128, 8 * 128]);
    vector_dims.sort_unstable();
    vector_dims.dedup();
    for dim in vector_dims {
        // Norm weights around 1 (Gemma's are stored that way too), biases around 0.
        let norm: Vec<f32> = rng.values(dim, 0.5).iter().map(|v| 1.0 + v).collect();
        let bias = rng.values(dim, 0.2);
        for (name, values) in [(format!("norm.{dim}"), norm), (format!("bias.{dim}"), bias)] {
            let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            writer.tensor(&name, &[dim as u64], GgmlType::F32, data);
        }
    }
    Ok(Arc::new(Gguf::from_bytes(writer.to_bytes())?))
}

fn check_get_rows<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    for ty in FORMATS {
        for cols in rig.hidden_sizes() {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let info = rig.tensor(&tensor_name("emb", ty, cols)).clone();
            let gguf = &rig.gguf;
            for n in rig.token_counts() {
                for scale in [1.0f32, (cols as f32).sqrt()] {
                    let name = format!("get_rows {} cols={cols} n={n} scale={scale}", ty.name());
                    if !report.wants(&name) {
                        continue;
                    }
                    let ids: Vec<u32> = (0..n).map(|_| rng.below(TABLE_ROWS) as u32).collect();
                    let cpu = rig.cpu.install(|| {
                        let m = rig.cpu.matrix(gguf, &info).expect("cpu matrix");
                        let mut out = rig.cpu.alloc(n * cols);
                        rig.cpu.get_rows(&m, &ids, scale, &mut out);
                        out
                    });
                    let gpu = (|| {
                        let m = rig.gpu.matrix(gguf, &info).map_err(|e| e.to_string())?;
                        let mut out = rig.gpu.alloc(n * cols);
                        rig.gpu.get_rows(&m, &ids, scale, &mut out);
                        rig.gpu.download(&out, n * cols)
                    })();
                    report.compare(&name, gpu, &cpu);
                }
            }
        }
    }
}

fn check_matmul<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    for ty in FORMATS {
        for cols in rig.hidden_sizes() {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let w = rig.tensor(&tensor_name("w", ty, cols)).clone();
            let wk = rig.tensor(&tensor_name("wk", ty, cols)).clone();
            let gguf = &rig.gguf;
            for n in rig.token_counts() {
                let x = rng.values(n * cols, 2.0);
                let name = format!("matmul {} cols={cols} n={n}", ty.name());
                if report.wants(&name) {
                    let cpu = rig.cpu.install(|| {
                        let m = rig.cpu.matrix(gguf, &w).expect("cpu matrix");
                        let mut out = rig.cpu.alloc(n * MATRIX_ROWS);
                        rig.cpu.matmul(&m, &x, n, &mut out);
                        out
                    });
                    let gpu = (|| {
                        let m = rig.gpu.matrix(gguf, &w).map_err(|e| e.to_string())?;
                        let xb = rig.gpu.upload(&x)?;
                        let mut out = rig.gpu.alloc(n * MATRIX_ROWS);
                        rig.gpu.matmul(&m, &xb, n, &mut out);
                        rig.gpu.download(&out, n * MATRIX_ROWS)
                    })();
                    report.compare(&name, gpu, &cpu);
                }
                // Two matrices sharing one input (Q and K; gate and up).
                let name = format!("matmul_shared {} cols={cols} n={n}", ty.name());
                if report.wants(&name) {
                    let cpu = rig.cpu.install(|| {
                        let (a, b) = (
                            rig.cpu.matrix(gguf, &w).expect("cpu matrix"),
                            rig.cpu.matrix(gguf, &wk).expect("cpu matrix"),
                        );
                        let mut oa = rig.cpu.alloc(n * MATRIX_ROWS);
                        let mut ob = rig.cpu.alloc(n * MATRIX_ROWS);
                        rig.cpu
                            .matmul_shared(&[&a, &b], &x, n, &mut [&mut oa, &mut ob]);
                        [oa, ob].concat()
                    });
                    let gpu = (|| {
                        let a = rig.gpu.matrix(gguf, &w).map_err(|e| e.to_string())?;
                        let b = rig.gpu.matrix(gguf, &wk).map_err(|e| e.to_string())?;
                        let xb = rig.gpu.upload(&x)?;
                        let mut oa = rig.gpu.alloc(n * MATRIX_ROWS);
                        let mut ob = rig.gpu.alloc(n * MATRIX_ROWS);
                        rig.gpu
                            .matmul_shared(&[&a, &b], &xb, n, &mut [&mut oa, &mut ob]);
                        let mut values = rig.gpu.download(&oa, n * MATRIX_ROWS)?;
                        values.extend(rig.gpu.download(&ob, n * MATRIX_ROWS)?);
                        Ok(values)
                    })();
                    report.compare(&name, gpu, &cpu);
                }
            }
        }
    }
}

/// `(rows, dim)` of the normalisations: hidden rows per token, and per-head rows (Q/K norms).
fn norm_shapes<G: Host>(rig: &Rig<G>) -> Vec<(usize, usize)> {
    let mut shapes = Vec::new();
    for n in rig.token_counts() {
        for dim in rig.hidden_sizes() {
            shapes.push((n, dim));
        }
        for (heads, dim) in [(9, 64), (8, 128), (4, 256)] {
            shapes.push((n * heads, dim));
        }
    }
    shapes
}

fn check_norms<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    let gguf = &rig.gguf;
    for (rows, dim) in norm_shapes(rig) {
        let info = rig.tensor(&format!("norm.{dim}")).clone();
        for eps in [1e-6f32, 1e-5] {
            let mag = [0.02f32, 1.0, 40.0][rng.below(3)];
            let x = rng.values(rows * dim, mag);
            let proj = rng.values(rows * dim, mag);
            let len = rows * dim;
            let name = format!("rms_norm rows={rows} dim={dim} eps={eps:e}");
            if report.wants(&name) {
                let cpu = rig.cpu.install(|| {
                    let w = rig.cpu.vector(gguf, &info).expect("cpu vector");
                    let mut out = rig.cpu.alloc(len);
                    rig.cpu.rms_norm(&x, &w, rows, dim, eps, &mut out);
                    out
                });
                let gpu = (|| {
                    let w = rig.gpu.vector(gguf, &info).map_err(|e| e.to_string())?;
                    let xb = rig.gpu.upload(&x)?;
                    let mut out = rig.gpu.alloc(len);
                    rig.gpu.rms_norm(&xb, &w, rows, dim, eps, &mut out);
                    rig.gpu.download(&out, len)
                })();
                report.compare(&name, gpu, &cpu);
            }
            let name = format!("rms_norm_inplace rows={rows} dim={dim} eps={eps:e}");
            if report.wants(&name) {
                let cpu = rig.cpu.install(|| {
                    let w = rig.cpu.vector(gguf, &info).expect("cpu vector");
                    let mut xb = x.clone();
                    rig.cpu.rms_norm_inplace(&mut xb, &w, rows, dim, eps);
                    xb
                });
                let gpu = (|| {
                    let w = rig.gpu.vector(gguf, &info).map_err(|e| e.to_string())?;
                    let mut xb = rig.gpu.upload(&x)?;
                    rig.gpu.rms_norm_inplace(&mut xb, &w, rows, dim, eps);
                    rig.gpu.download(&xb, len)
                })();
                report.compare(&name, gpu, &cpu);
            }
            let name = format!("add_rms_norm rows={rows} dim={dim} eps={eps:e}");
            if report.wants(&name) {
                let cpu = rig.cpu.install(|| {
                    let w = rig.cpu.vector(gguf, &info).expect("cpu vector");
                    let mut xb = x.clone();
                    let mut out = rig.cpu.alloc(len);
                    rig.cpu
                        .add_rms_norm(&mut xb, &proj, &w, rows, dim, eps, &mut out);
                    [xb, out].concat()
                });
                let gpu = (|| {
                    let w = rig.gpu.vector(gguf, &info).map_err(|e| e.to_string())?;
                    let mut xb = rig.gpu.upload(&x)?;
                    let pb = rig.gpu.upload(&proj)?;
                    let mut out = rig.gpu.alloc(len);
                    rig.gpu
                        .add_rms_norm(&mut xb, &pb, &w, rows, dim, eps, &mut out);
                    let mut values = rig.gpu.download(&xb, len)?;
                    values.extend(rig.gpu.download(&out, len)?);
                    Ok(values)
                })();
                report.compare(&name, gpu, &cpu);
            }
        }
    }
}

/// Gate values over the whole range the activations see, with the edges of `expf`'s range and of
/// the GELU table spelled out.
fn activation_inputs(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = rng.values(n, 12.0);
    let edges = [
        0.0f32, -0.0, 1e-30, -1e-30, 9.999, 10.0, 10.001, -9.999, -10.0, -10.001, 87.0, 88.7, 89.0,
        104.0, -87.0, -88.0, -103.0, -104.0, -150.0, 150.0, 1e-5, -1e-5, 3.0e-39,
    ];
    for (slot, e) in v.iter_mut().zip(edges) {
        *slot = e;
    }
    v
}

fn check_element_wise<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    let gguf = &rig.gguf;
    for n in rig.token_counts() {
        for dim in rig.hidden_sizes() {
            let len = n * dim;
            let a = rng.values(len, 3.0);
            let b = rng.values(len, 3.0);
            let name = format!("add_inplace len={len}");
            if report.wants(&name) {
                let cpu = rig.cpu.install(|| {
                    let mut d = a.clone();
                    rig.cpu.add_inplace(&mut d, &b, len);
                    d
                });
                let gpu = (|| {
                    let mut d = rig.gpu.upload(&a)?;
                    let s = rig.gpu.upload(&b)?;
                    rig.gpu.add_inplace(&mut d, &s, len);
                    rig.gpu.download(&d, len)
                })();
                report.compare(&name, gpu, &cpu);
            }
            let info = rig.tensor(&format!("bias.{dim}")).clone();
            let name = format!("add_bias rows={n} dim={dim}");
            if report.wants(&name) {
                let cpu = rig.cpu.install(|| {
                    let bias = rig.cpu.vector(gguf, &info).expect("cpu vector");
                    let mut d = a.clone();
                    rig.cpu.add_bias(&mut d, &bias, n, dim);
                    d
                });
                let gpu = (|| {
                    let bias = rig.gpu.vector(gguf, &info).map_err(|e| e.to_string())?;
                    let mut d = rig.gpu.upload(&a)?;
                    rig.gpu.add_bias(&mut d, &bias, n, dim);
                    rig.gpu.download(&d, len)
                })();
                report.compare(&name, gpu, &cpu);
            }
            for factor in [0.125f32, 1.0 / 3.0, (dim as f32).sqrt()] {
                let name = format!("scale len={len} by {factor}");
                if report.wants(&name) {
                    let cpu = rig.cpu.install(|| {
                        let mut d = a.clone();
                        rig.cpu.scale(&mut d, len, factor);
                        d
                    });
                    let gpu = (|| {
                        let mut d = rig.gpu.upload(&a)?;
                        rig.gpu.scale(&mut d, len, factor);
                        rig.gpu.download(&d, len)
                    })();
                    report.compare(&name, gpu, &cpu);
                }
            }
        }
        // The feed-forward widths of SmolLM2 135M, Gemma 3 270M, Llama 3.2 1B (one slice).
        for n_ff in [1536usize, 2048, 8192] {
            let len = n * n_ff;
            let gate = activation_inputs(rng, len);
            let up = rng.values(len, 4.0);
            for (op, swi) in [("swiglu", true), ("geglu", false)] {
                let name = format!("{op} len={len}");
                if !report.wants(&name) {
                    continue;
                }
                let cpu = rig.cpu.install(|| {
                    let mut g = gate.clone();
                    if swi {
                        rig.cpu.swiglu(&mut g, &up, len);
                    } else {
                        rig.cpu.geglu(&mut g, &up, len);
                    }
                    g
                });
                let gpu = (|| {
                    let mut g = rig.gpu.upload(&gate)?;
                    let u = rig.gpu.upload(&up)?;
                    if swi {
                        rig.gpu.swiglu(&mut g, &u, len);
                    } else {
                        rig.gpu.geglu(&mut g, &u, len);
                    }
                    rig.gpu.download(&g, len)
                })();
                report.compare(&name, gpu, &cpu);
            }
        }
    }
    // Every f16 value through GeGLU (the whole table) and a sweep of SwiGLU over [-110, 110].
    let name = "geglu every f16 input".to_string();
    if report.wants(&name) {
        let gate: Vec<f32> = (0..=u16::MAX)
            .map(|b| f16::from_bits(b).to_f32())
            .filter(|x| x.is_finite())
            .collect();
        let len = gate.len();
        let up = vec![1.0f32; len];
        let cpu = rig.cpu.install(|| {
            let mut g = gate.clone();
            rig.cpu.geglu(&mut g, &up, len);
            g
        });
        let gpu = (|| {
            let mut g = rig.gpu.upload(&gate)?;
            let u = rig.gpu.upload(&up)?;
            rig.gpu.geglu(&mut g, &u, len);
            rig.gpu.download(&g, len)
        })();
        report.compare(&name, gpu, &cpu);
    }
    let name = "swiglu sweep of [-110, 110]".to_string();
    if report.wants(&name) {
        let gate: Vec<f32> = (0..1_000_000).map(|i| -110.0 + i as f32 * 2.2e-4).collect();
        let len = gate.len();
        let up = vec![1.0f32; len];
        let cpu = rig.cpu.install(|| {
            let mut g = gate.clone();
            rig.cpu.swiglu(&mut g, &up, len);
            g
        });
        let gpu = (|| {
            let mut g = rig.gpu.upload(&gate)?;
            let u = rig.gpu.upload(&up)?;
            rig.gpu.swiglu(&mut g, &u, len);
            rig.gpu.download(&g, len)
        })();
        report.compare(&name, gpu, &cpu);
    }
    // Soft-capping has no exact kernel: the reference mode must refuse it, not round it its own
    // way.
    let name = "softcap is refused".to_string();
    if let (true, Some(gpu)) = (report.wants(&name), rig.gpu.as_gpu()) {
        let refused = (|| {
            let mut x = gpu.upload(&[1.0f32; 8])?;
            gpu.softcap(&mut x, 8, 30.0);
            Ok::<_, String>(gpu.take_failure())
        })();
        match refused {
            Ok(Some(failure)) if failure.op == "softcap" => {
                println!("PASS {name}");
                report.passed += 1;
            }
            Ok(other) => report.fail(&name, &format!("expected a refusal, found {other:?}")),
            Err(error) => report.fail(&name, &error),
        }
    }
}

/// Heads of the rotary and attention checks: (query heads, KV heads, head size, window) of
/// SmolLM2 135M, Gemma 3 270M (sliding and global layers) and Llama 3 8B.
const ATTENTION_SHAPES: [(usize, usize, usize, Option<usize>); 4] = [
    (9, 3, 64, None),
    (4, 1, 256, Some(512)),
    (4, 1, 256, None),
    (32, 8, 128, None),
];

fn check_rope<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    let factors: Vec<f32> = (0..128).map(|i| 1.0 + i as f32 * 0.25).collect();
    for (n_heads, _, head_dim, _) in ATTENTION_SHAPES {
        for (n_dims, base, freq_scale, with_factors) in [
            (head_dim, 10000.0f32, 1.0f32, false),
            (head_dim, 1_000_000.0, 0.125, false),
            (head_dim, 500_000.0, 1.0, true),
            (head_dim / 2, 10000.0, 1.0, false),
        ] {
            let params = RopeParams {
                n_dims,
                freq_base: base,
                freq_scale,
                freq_factors: with_factors.then(|| &factors[..n_dims / 2]),
            };
            for n in rig.token_counts() {
                let start = [0u32, 17, 511, 4000, 31000][rng.below(5)];
                let positions: Vec<u32> = (start..start + n as u32).collect();
                let len = n * n_heads * head_dim;
                let x = rng.values(len, 5.0);
                for mode in [RopeMode::Normal, RopeMode::Neox] {
                    let name = format!(
                        "rope {mode:?} heads={n_heads} head_dim={head_dim} n_dims={n_dims} base={base} scale={freq_scale} factors={with_factors} n={n} from {start}"
                    );
                    if !report.wants(&name) {
                        continue;
                    }
                    let cpu = rig.cpu.install(|| {
                        let mut table = rig.cpu.rope_table_new();
                        rig.cpu.rope_table(&positions, &params, &mut table);
                        let mut v = x.clone();
                        rig.cpu.rope(&mut v, &table, n, n_heads, head_dim, mode);
                        v
                    });
                    let gpu = (|| {
                        let mut table = rig.gpu.rope_table_new();
                        rig.gpu.rope_table(&positions, &params, &mut table);
                        let mut v = rig.gpu.upload(&x)?;
                        rig.gpu.rope(&mut v, &table, n, n_heads, head_dim, mode);
                        rig.gpu.download(&v, len)
                    })();
                    report.compare(&name, gpu, &cpu);
                }
            }
        }
    }
}

/// The plans of a prefix of `prefix` tokens and then a batch of `n` tokens of one sequence,
/// made on `b`'s cache (so the blocks get memory there).
fn plans<B: Backend>(
    b: &B,
    cache: &mut KvCache<B>,
    prefix: usize,
    n: usize,
) -> Vec<(Batch, AttentionPlan)> {
    let mut out = Vec::new();
    for (start, len) in [(0usize, prefix), (prefix, n)] {
        if len == 0 {
            continue;
        }
        let tokens: Vec<u32> = (0..len as u32).collect();
        let batch = Batch::for_sequence(0, start as u32, &tokens, false);
        let mut plan = AttentionPlan::default();
        cache.plan(b, &batch, &mut plan).expect("plan");
        out.push((batch, plan));
    }
    out
}

fn check_kv_store<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    for (_, n_kv, head_dim, _) in ATTENTION_SHAPES {
        for (prefix, n) in [
            (0usize, 1usize),
            (0, 5),
            (0, 64),
            (0, 300),
            (300, 5),
            (37, 1),
        ] {
            let name =
                format!("kv_store kv_heads={n_kv} head_dim={head_dim} prefix={prefix} n={n}");
            // The stored bits are read through the GPU backend's own accessor (the CPU's
            // blocks are private to it): nothing to check in a dry run.
            let Some(b) = rig.gpu.as_gpu() else {
                continue;
            };
            if !report.wants(&name) {
                continue;
            }
            let row = n_kv * head_dim;
            let total = prefix + n;
            let k = rng.values(total * row, 8.0);
            let v = rng.values(total * row, 8.0);
            let result = (|| {
                let mut cache = KvCache::new(
                    b,
                    &[(n_kv, head_dim)],
                    DEFAULT_BLOCK_SIZE,
                    total + 1,
                    total.div_ceil(DEFAULT_BLOCK_SIZE) + 1,
                );
                let mut expected: Vec<(usize, usize, Vec<u16>, Vec<u16>)> = Vec::new();
                let mut first = 0;
                for (batch, plan) in plans(b, &mut cache, prefix, n) {
                    b.begin_forward(&batch, &plan, &[]);
                    let len = batch.len();
                    let kb = b.upload(&k[first * row..(first + len) * row])?;
                    let vb = b.upload(&v[first * row..(first + len) * row])?;
                    b.kv_store(cache.layer_mut(0), &kb, &vb, &plan);
                    if let Some(failure) = b.take_failure() {
                        return Err(failure.to_string());
                    }
                    for (t, &slot) in plan.slots.iter().enumerate() {
                        // What the CPU's kv_store stores: half's slice conversion of each row.
                        let src = (first + t) * row;
                        let mut kh = vec![f16::ZERO; row];
                        let mut vh = vec![f16::ZERO; row];
                        half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                            &mut kh[..],
                            &k[src..src + row],
                        );
                        half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                            &mut vh[..],
                            &v[src..src + row],
                        );
                        expected.push((
                            slot as usize / DEFAULT_BLOCK_SIZE,
                            slot as usize % DEFAULT_BLOCK_SIZE,
                            kh.iter().map(|h| h.to_bits()).collect(),
                            vh.iter().map(|h| h.to_bits()).collect(),
                        ));
                    }
                    first += len;
                }
                // Compared as f32 values of the f16 bits (exact), to report like the others.
                let (mut got, mut want) = (Vec::new(), Vec::new());
                for (block, offset, kh, vh) in expected {
                    for (is_k, bits) in [(true, kh), (false, vh)] {
                        let stored = b
                            .kv_block_bits(cache.layer(0), block, is_k)
                            .map_err(|e| e.to_string())?;
                        let at = offset * row;
                        got.extend(
                            stored[at..at + row]
                                .iter()
                                .map(|&h| f16::from_bits(h).to_f32()),
                        );
                        want.extend(bits.iter().map(|&h| f16::from_bits(h).to_f32()));
                    }
                }
                Ok((got, want))
            })();
            match result {
                Ok((got, want)) => report.compare(&name, Ok(got), &want),
                Err(error) => report.fail(&name, &error),
            }
        }
    }
}

/// Stores random K/V for a prefix and a batch, then attends the batch's queries: the output.
#[allow(clippy::too_many_arguments)]
fn attend<B: Host>(
    b: &B,
    shape: (usize, usize, usize, Option<usize>),
    prefix: usize,
    n: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<Vec<f32>, String> {
    let (n_heads, n_kv, head_dim, window) = shape;
    let total = prefix + n;
    let row = n_kv * head_dim;
    let mut cache = KvCache::new(
        b,
        &[(n_kv, head_dim)],
        DEFAULT_BLOCK_SIZE,
        total + 1,
        total.div_ceil(DEFAULT_BLOCK_SIZE) + 1,
    );
    let mut first = 0;
    let mut out_values = Vec::new();
    let batches = plans(b, &mut cache, prefix, n);
    let last = batches.len() - 1;
    for (i, (batch, plan)) in batches.into_iter().enumerate() {
        let len = batch.len();
        b.begin_forward(&batch, &plan, &[]);
        let kb = b.upload(&k[first * row..(first + len) * row])?;
        let vb = b.upload(&v[first * row..(first + len) * row])?;
        b.kv_store(cache.layer_mut(0), &kb, &vb, &plan);
        if i == last {
            let qb = b.upload(q)?;
            let mut out = b.upload(&vec![0f32; len * n_heads * head_dim])?;
            let scale = 1.0 / (head_dim as f32).sqrt();
            b.attention(
                &qb,
                cache.layer(0),
                &plan,
                n_heads,
                n_kv,
                head_dim,
                scale,
                window,
                &mut out,
            );
            out_values = b.download(&out, len * n_heads * head_dim)?;
        }
        first += len;
    }
    Ok(out_values)
}

fn check_attention<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    let mut cases: Vec<(usize, usize)> = rig.token_counts().into_iter().map(|n| (0, n)).collect();
    // A chunk after a prefix, decode steps below and above the split-KV threshold (512 cached
    // cells), and far past a 512-token sliding window.
    cases.extend([(300, 5), (100, 1), (600, 1), (1100, 1), (700, 64)]);
    for shape in ATTENTION_SHAPES {
        let (n_heads, n_kv, head_dim, window) = shape;
        for &(prefix, n) in &cases {
            let name = format!(
                "attention heads={n_heads}/{n_kv} head_dim={head_dim} window={window:?} prefix={prefix} n={n} threads={}",
                rig.cpu.n_threads()
            );
            if !report.wants(&name) {
                continue;
            }
            let total = prefix + n;
            let q = rng.values(n * n_heads * head_dim, 3.0);
            let k = rng.values(total * n_kv * head_dim, 3.0);
            let v = rng.values(total * n_kv * head_dim, 3.0);
            let cpu = rig
                .cpu
                .install(|| attend(&rig.cpu, shape, prefix, n, &q, &k, &v))
                .expect("the CPU attention cannot fail");
            let gpu = attend(&rig.gpu, shape, prefix, n, &q, &k, &v);
            report.compare(&name, gpu, &cpu);
        }
    }
}

fn check_gather_rows<G: Host>(rig: &Rig<G>, report: &mut Report, rng: &mut Rng) {
    for dim in rig.hidden_sizes() {
        for n in rig.token_counts() {
            let name = format!("gather_rows dim={dim} n={n}");
            if !report.wants(&name) {
                continue;
            }
            let src = rng.values(n * dim, 1.0);
            let rows: Vec<usize> = (0..n.min(7)).map(|_| rng.below(n)).collect();
            let len = rows.len() * dim;
            let cpu = rig.cpu.install(|| {
                let mut out = rig.cpu.alloc(len);
                rig.cpu.gather_rows(&src, dim, &rows, &mut out);
                out
            });
            let gpu = (|| {
                let s = rig.gpu.upload(&src)?;
                let mut out = rig.gpu.alloc(len);
                rig.gpu.gather_rows(&s, dim, &rows, &mut out);
                rig.gpu.download(&out, len)
            })();
            report.compare(&name, gpu, &cpu);
        }
    }
}

fn run<G: Host>(rig: &Rig<G>, only: Option<String>) -> bool {
    let mut rng = Rng(0x5eed_ba5e_0000_0002);
    let mut report = Report {
        only,
        passed: 0,
        failed: 0,
    };
    let checks: [fn(&Rig<G>, &mut Report, &mut Rng); 8] = [
        check_get_rows,
        check_norms,
        check_element_wise,
        check_rope,
        check_kv_store,
        check_gather_rows,
        check_matmul,
        check_attention,
    ];
    for check in checks {
        check(rig, &mut report, &mut rng);
    }
    println!(
        "exact_ops_check: {} passed, {} failed",
        report.passed, report.failed
    );
    report.failed == 0
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cpu = CpuBackend::new(args.threads)?;
    println!("cpu: {} threads", cpu.n_threads());
    let mut rng = Rng(0x5eed_ba5e_0000_0001);
    let gguf = weights_file(&mut rng)?;
    if args.dry_run {
        let rig = Rig {
            cpu,
            gpu: CpuBackend::new(args.threads)?,
            gguf,
            quick: args.quick,
        };
        println!("dry run: the CPU backend against itself");
        if !run(&rig, args.only) {
            std::process::exit(1);
        }
        return Ok(());
    }
    let device = match args.device {
        DeviceSpec::Gpu(kind, ordinal) => Some((kind, ordinal)),
        DeviceSpec::Auto => None,
        DeviceSpec::Cpu | DeviceSpec::Sim(_) | DeviceSpec::Gpus(..) => {
            anyhow::bail!(
                "--device: expected one GPU (auto, cuda:N or hip:N), found {}",
                args.device
            )
        }
    };
    let options = OpenOptions {
        device,
        idle_trim: false,
        numerics: Some(Numerics::Reference),
        reference_threads: Some(args.threads),
        ..OpenOptions::default()
    };
    let selection = gpu::select(&options)?;
    let opened = gpu::open(selection, &options)?;
    println!("gpu: {}", opened.backend.describe());
    let rig = Rig {
        cpu,
        gpu: opened.backend,
        gguf,
        quick: args.quick,
    };
    if !run(&rig, args.only) {
        std::process::exit(1);
    }
    Ok(())
}
