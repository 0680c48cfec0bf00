//! The load plan: which device holds which layers of a model, and what that costs each device.
//!
//! From the model's layers and their sizes (weights, KV cache at the chosen context, scratch),
//! the devices and their free memory (or `--vram-budget`, whichever is smaller), and the flags
//! `-ngl N`, `--split-mode layer|none`, `--tensor-split A,B,...` and `--main-gpu I`, a
//! [`LoadPlan`] assigns each layer to one device, as llama.cpp's `llama_model::load_tensors`
//! does: the last `N` layers go to the GPUs, the rest stay on the CPU; the output layer (final
//! norm and output matrix) goes to the last GPU when every layer does. With `--split-mode
//! layer` the GPU layers are cut into contiguous ranges, one per GPU, sized by the
//! `--tensor-split` proportions or, by default, by each GPU's free memory after reserving its
//! scratch; `--split-mode none` keeps them all on `--main-gpu`.
//!
//! One difference from llama.cpp: there the output layer counts as layer `n_layer` and needs
//! `-ngl n_layer + 1`; here `-ngl n_layer` (every layer on the GPU) takes it along, because a
//! model whose blocks all fit and whose logits are then computed on the CPU is never what a
//! user asking for every layer meant.
//!
//! The plan is arithmetic only: it opens no device. Its errors name the flag to change.

use std::fmt;
use std::ops::Range;

use ember_gguf::Gguf;

use crate::model::HParams;

/// Where a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Cpu,
    /// The GPU at this index of the plan's device list.
    Gpu(usize),
}

/// How the GPU layers are spread over several GPUs (`--split-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitMode {
    /// Everything on `--main-gpu`.
    None,
    /// Contiguous layer ranges, one per GPU.
    #[default]
    Layer,
}

impl std::str::FromStr for SplitMode {
    type Err = PlanError;

    fn from_str(text: &str) -> Result<SplitMode, PlanError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(SplitMode::None),
            "layer" => Ok(SplitMode::Layer),
            // llama.cpp's `row` splits each matrix across GPUs: not built here.
            _ => Err(PlanError::Flag {
                flag: "--split-mode",
                problem: format!("expected layer or none, found {text:?}"),
            }),
        }
    }
}

/// `--tensor-split` as one flag value.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSplit(pub Vec<f64>);

impl std::str::FromStr for TensorSplit {
    type Err = PlanError;

    fn from_str(text: &str) -> Result<TensorSplit, PlanError> {
        parse_tensor_split(text).map(TensorSplit)
    }
}

/// Parses `--tensor-split A,B,...`: one non-negative finite proportion per GPU, not all zero.
pub fn parse_tensor_split(text: &str) -> Result<Vec<f64>, PlanError> {
    let error = |problem: String| PlanError::Flag {
        flag: "--tensor-split",
        problem,
    };
    let mut proportions = Vec::new();
    for part in text.split([',', '/']) {
        let value: f64 = part.trim().parse().map_err(|_| {
            error(format!(
                "expected proportions such as 3,1, found {text:?} ({part:?} is not a number)"
            ))
        })?;
        if !value.is_finite() || value < 0.0 {
            return Err(error(format!(
                "expected non-negative finite proportions, found {value} in {text:?}"
            )));
        }
        proportions.push(value);
    }
    if proportions.iter().all(|&p| p == 0.0) {
        return Err(error(format!(
            "expected at least one proportion above 0, found {text:?}"
        )));
    }
    Ok(proportions)
}

/// Bytes one layer needs on the device that runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerBytes {
    pub weights: u64,
    /// Its KV cache at the planned context (0 for layers without one).
    pub kv: u64,
}

/// What the plan is made from: the model's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelBytes {
    /// One entry per layer, in order.
    pub layers: Vec<LayerBytes>,
    /// The output layer: final norm and output matrix.
    pub output: u64,
    /// The token embedding table (and the other tensors outside layers and output): it goes
    /// with the output layer, as the split places it (a model with tied embeddings reads it as
    /// its output matrix).
    pub embedding: u64,
    /// Activation scratch each device that runs layers needs for the largest batch.
    pub scratch: u64,
}

impl ModelBytes {
    /// The sizes of a GGUF model: each `blk.N.` tensor's bytes to layer `N`, `output*` tensors
    /// to the output layer, `token_embd*` to the embedding; K and V cache of `n_ctx` tokens in
    /// f16 for every layer that owns one; `scratch` as given.
    pub fn from_gguf(gguf: &Gguf, hparams: &HParams, n_ctx: usize, scratch: u64) -> ModelBytes {
        let mut layers = vec![LayerBytes::default(); hparams.n_layer];
        let mut output = 0u64;
        let mut embedding = 0u64;
        for info in gguf.tensors() {
            let layer = info
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|index| index.parse::<usize>().ok());
            match layer {
                Some(il) if il < layers.len() => layers[il].weights += info.n_bytes,
                _ if info.name.starts_with("output") => output += info.n_bytes,
                // Rope frequency factors are read into host memory, not placed on a device.
                _ if info.name.starts_with("rope_freqs") => {}
                // Everything else (the embedding, rope factors, per-layer embeddings) goes
                // where the output layer goes, as the split places it: a model with tied
                // embeddings reads `token_embd` as its output matrix.
                _ => embedding += info.n_bytes,
            }
        }
        for (il, l) in hparams.layers.iter().enumerate() {
            if !l.recurrent && l.kv_source == il {
                layers[il].kv = (n_ctx as u64) * 2 * (l.n_head_kv * l.head_dim) as u64 * 2;
            }
        }
        ModelBytes {
            layers,
            output,
            embedding,
            scratch,
        }
    }
}

/// A GPU the plan may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanDevice {
    /// As `--device` writes it (`cuda:0`, `sim:1`).
    pub name: String,
    /// Memory the device may give the model: its free memory, or its budget when smaller.
    pub available: u64,
}

/// The flags that shape the plan.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlanOptions {
    /// `-ngl`: layers on the GPUs; `None` is all of them.
    pub gpu_layers: Option<usize>,
    pub split_mode: SplitMode,
    /// `--tensor-split`: one proportion per GPU, `None` for proportional to free memory.
    pub tensor_split: Option<Vec<f64>>,
    /// `--main-gpu`: the GPU of `--split-mode none`.
    pub main_gpu: usize,
}

/// Why no plan could be made; each names the flag to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("{flag}: {problem}")]
    Flag { flag: &'static str, problem: String },
    #[error("-ngl {gpu_layers} puts layers on a GPU, but no GPU is in use: choose GPUs with --device or use -ngl 0")]
    NoGpu { gpu_layers: usize },
    #[error("{device} needs {needed} bytes ({}) for its layers {layers:?}{output}, KV cache and scratch, but has {available} bytes ({}): lower -ngl, change --tensor-split, or shorten the context", gib(*needed), gib(*available), output = if *with_output { " and the output layer" } else { "" })]
    DoesNotFit {
        device: String,
        layers: Range<usize>,
        with_output: bool,
        needed: u64,
        available: u64,
    },
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// One device's share of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceShare {
    pub target: Target,
    /// `cpu`, or the GPU's name.
    pub name: String,
    /// Its contiguous range of layers (empty when it runs none).
    pub layers: Range<usize>,
    /// Whether it computes the output layer.
    pub output: bool,
    pub weights: u64,
    pub kv: u64,
    pub scratch: u64,
}

impl DeviceShare {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.scratch
    }
}

/// The layer-to-device assignment of one model load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    /// `layers[il]`: where layer `il` runs.
    pub layers: Vec<Target>,
    /// Where the output layer runs.
    pub output: Target,
    /// The CPU first, then each GPU in the order given; a device with no layers keeps an empty
    /// range.
    pub shares: Vec<DeviceShare>,
}

impl LoadPlan {
    /// Makes the plan; see the module documentation for the rules.
    pub fn new(
        model: &ModelBytes,
        devices: &[PlanDevice],
        options: &PlanOptions,
    ) -> Result<LoadPlan, PlanError> {
        let n_layer = model.layers.len();
        let gpu_layers = options.gpu_layers.unwrap_or(n_layer).min(n_layer);
        if devices.is_empty() && gpu_layers > 0 {
            return Err(PlanError::NoGpu {
                gpu_layers: options.gpu_layers.unwrap_or(n_layer),
            });
        }
        if !devices.is_empty() && options.main_gpu >= devices.len() {
            return Err(PlanError::Flag {
                flag: "--main-gpu",
                problem: format!(
                    "expected a GPU index below {} (the GPUs in use: {}), found {}",
                    devices.len(),
                    device_names(devices),
                    options.main_gpu
                ),
            });
        }
        if let Some(split) = &options.tensor_split {
            if options.split_mode == SplitMode::None {
                return Err(PlanError::Flag {
                    flag: "--tensor-split",
                    problem: "spreads layers over GPUs, but --split-mode none keeps them on --main-gpu: drop one of the two".into(),
                });
            }
            if split.len() > devices.len() {
                return Err(PlanError::Flag {
                    flag: "--tensor-split",
                    problem: format!(
                        "expected at most one proportion per GPU ({}: {}), found {}",
                        devices.len(),
                        device_names(devices),
                        split.len()
                    ),
                });
            }
            if split.iter().any(|p| !p.is_finite() || *p < 0.0) || split.iter().all(|&p| p == 0.0) {
                return Err(PlanError::Flag {
                    flag: "--tensor-split",
                    problem: format!(
                        "expected non-negative finite proportions, not all 0, found {split:?}"
                    ),
                });
            }
        }
        let first_gpu_layer = n_layer - gpu_layers;
        let output_on_gpu = gpu_layers == n_layer && !devices.is_empty();
        // Units to spread: the GPU layers, and the output layer as one more when it goes.
        let units = gpu_layers + usize::from(output_on_gpu);
        let counts: Vec<usize> = if devices.is_empty() {
            Vec::new()
        } else {
            match options.split_mode {
                SplitMode::None => (0..devices.len())
                    .map(|i| if i == options.main_gpu { units } else { 0 })
                    .collect(),
                SplitMode::Layer => {
                    let proportions: Vec<f64> = match &options.tensor_split {
                        Some(split) => (0..devices.len())
                            .map(|i| split.get(i).copied().unwrap_or(0.0))
                            .collect(),
                        None => {
                            let free: Vec<f64> = devices
                                .iter()
                                .map(|d| d.available.saturating_sub(model.scratch) as f64)
                                .collect();
                            if free.iter().all(|&f| f == 0.0) {
                                // Nothing is free anywhere: an even split, and the fit check
                                // below says what is missing.
                                vec![1.0; devices.len()]
                            } else {
                                free
                            }
                        }
                    };
                    split_counts(units, &proportions)
                }
            }
        };
        let mut layers = vec![Target::Cpu; n_layer];
        let mut output = Target::Cpu;
        let mut shares = vec![DeviceShare {
            target: Target::Cpu,
            name: "cpu".into(),
            layers: 0..first_gpu_layer,
            output: !output_on_gpu,
            weights: 0,
            kv: 0,
            scratch: model.scratch,
        }];
        let mut next = first_gpu_layer;
        for (i, (device, &count)) in devices.iter().zip(&counts).enumerate() {
            let end_units = next - first_gpu_layer + count;
            let takes_output = output_on_gpu && end_units == units && count > 0;
            let block_end = (next + count - usize::from(takes_output)).min(n_layer);
            for target in &mut layers[next..block_end] {
                *target = Target::Gpu(i);
            }
            if takes_output {
                output = Target::Gpu(i);
            }
            shares.push(DeviceShare {
                target: Target::Gpu(i),
                name: device.name.clone(),
                layers: next..block_end,
                output: takes_output,
                weights: 0,
                kv: 0,
                scratch: if count > 0 { model.scratch } else { 0 },
            });
            next = block_end;
        }
        for share in &mut shares {
            for l in &model.layers[share.layers.clone()] {
                share.weights += l.weights;
                share.kv += l.kv;
            }
            if share.output {
                share.weights += model.output + model.embedding;
            }
        }
        for (share, device) in shares[1..].iter().zip(devices) {
            if share.total() > device.available && (!share.layers.is_empty() || share.output) {
                return Err(PlanError::DoesNotFit {
                    device: device.name.clone(),
                    layers: share.layers.clone(),
                    with_output: share.output,
                    needed: share.total(),
                    available: device.available,
                });
            }
        }
        Ok(LoadPlan {
            layers,
            output,
            shares,
        })
    }

    /// Whether any layer or the output runs on a GPU.
    pub fn uses_gpu(&self) -> bool {
        self.output != Target::Cpu || self.layers.iter().any(|t| *t != Target::Cpu)
    }

    /// The devices that run something, in layer order.
    pub fn active_shares(&self) -> impl Iterator<Item = &DeviceShare> {
        self.shares
            .iter()
            .filter(|s| !s.layers.is_empty() || s.output || s.target == Target::Cpu)
    }
}

impl fmt::Display for LoadPlan {
    /// One line per device that runs something: its layers, and its bytes by purpose.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
        let mut first = true;
        for share in self.active_shares() {
            if share.target == Target::Cpu && share.layers.is_empty() && !share.output {
                // Nothing of the model is on the CPU then (the embedding goes with the output).
                continue;
            }
            if !first {
                writeln!(f)?;
            }
            first = false;
            let layers = if share.layers.is_empty() {
                "no layers".to_string()
            } else {
                format!(
                    "layers {}..{} ({})",
                    share.layers.start,
                    share.layers.end,
                    share.layers.len()
                )
            };
            write!(
                f,
                "{:>8}: {layers}{}; weights {:.1} MiB, KV {:.1} MiB, scratch {:.1} MiB",
                share.name,
                if share.output { " + output" } else { "" },
                mib(share.weights),
                mib(share.kv),
                mib(share.scratch)
            )?;
        }
        Ok(())
    }
}

fn device_names(devices: &[PlanDevice]) -> String {
    devices
        .iter()
        .map(|d| d.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Splits `units` into one contiguous count per proportion: device `i` ends at the rounded
/// cumulative share `units * (p_0 + ... + p_i) / sum`, so every count is within one of its exact
/// share and the counts add up to `units`.
fn split_counts(units: usize, proportions: &[f64]) -> Vec<usize> {
    let sum: f64 = proportions.iter().sum();
    let mut counts = Vec::with_capacity(proportions.len());
    let mut cumulative = 0.0;
    let mut previous_end = 0usize;
    for (i, p) in proportions.iter().enumerate() {
        cumulative += p;
        let end = if i + 1 == proportions.len() {
            units
        } else {
            ((units as f64) * cumulative / sum)
                .round()
                .min(units as f64) as usize
        };
        let end = end.max(previous_end);
        counts.push(end - previous_end);
        previous_end = end;
    }
    counts
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn model(n_layer: usize) -> ModelBytes {
        ModelBytes {
            layers: vec![
                LayerBytes {
                    weights: 100,
                    kv: 10
                };
                n_layer
            ],
            output: 50,
            embedding: 70,
            scratch: 5,
        }
    }

    fn gpus(available: &[u64]) -> Vec<PlanDevice> {
        available
            .iter()
            .enumerate()
            .map(|(i, &available)| PlanDevice {
                name: format!("sim:{i}"),
                available,
            })
            .collect()
    }

    fn plan(
        n_layer: usize,
        available: &[u64],
        gpu_layers: Option<usize>,
        split: Option<&str>,
    ) -> Result<LoadPlan, String> {
        let options = PlanOptions {
            gpu_layers,
            tensor_split: split.map(|s| parse_tensor_split(s).unwrap()),
            ..PlanOptions::default()
        };
        LoadPlan::new(&model(n_layer), &gpus(available), &options).map_err(|e| e.to_string())
    }

    /// The plan as `device:start..end[+out]` per device that runs something.
    fn ranges(plan: &LoadPlan) -> String {
        plan.shares
            .iter()
            .filter(|s| !s.layers.is_empty() || s.output)
            .map(|s| {
                format!(
                    "{}:{}..{}{}",
                    s.name,
                    s.layers.start,
                    s.layers.end,
                    if s.output { "+out" } else { "" }
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn ngl_puts_the_last_layers_on_the_gpu_and_the_output_only_with_all() {
        let big = 1 << 30;
        let check = |ngl: Option<usize>, expected: &str| {
            let p = plan(8, &[big], ngl, None).unwrap();
            assert_eq!(ranges(&p), expected, "-ngl {ngl:?}");
        };
        check(Some(0), "cpu:0..8+out");
        check(Some(3), "cpu:0..5+out sim:0:5..8");
        check(Some(7), "cpu:0..1+out sim:0:1..8");
        check(Some(8), "sim:0:0..8+out");
        check(Some(99), "sim:0:0..8+out");
        check(None, "sim:0:0..8+out");
        let p = plan(8, &[big], Some(3), None).unwrap();
        assert_eq!(p.layers[4], Target::Cpu);
        assert_eq!(p.layers[5], Target::Gpu(0));
        assert_eq!(p.output, Target::Cpu);
        // The CPU holds the embedding and its layers; the GPU its layers, KV and scratch.
        assert_eq!(p.shares[0].weights, 70 + 5 * 100 + 50);
        assert_eq!(p.shares[1].weights, 300);
        assert_eq!(p.shares[1].kv, 30);
        assert_eq!(p.shares[1].scratch, 5);
    }

    #[test]
    fn tensor_split_proportions_and_the_output_on_the_last_gpu() {
        let big = 1 << 30;
        let check = |split: &str, expected: &str| {
            let p = plan(8, &[big, big], None, Some(split)).unwrap();
            assert_eq!(ranges(&p), expected, "--tensor-split {split}");
        };
        // 9 units (8 layers and the output): 1,1 rounds the boundary at 4.5 up.
        check("1,1", "sim:0:0..5 sim:1:5..8+out");
        check("3,1", "sim:0:0..7 sim:1:7..8+out");
        check("1,0", "sim:0:0..8+out");
        check("0,1", "sim:1:0..8+out");
        // 7 units: boundaries at 2.33 and 4.67 round to 2 and 5; the output is the last unit.
        let p = plan(6, &[big; 3], Some(6), Some("1,1,1")).unwrap();
        assert_eq!(ranges(&p), "sim:0:0..2 sim:1:2..5 sim:2:5..6+out");
    }

    #[test]
    fn the_default_split_follows_free_memory_after_scratch() {
        // 9 units; free after scratch 6000 and 3000: two thirds and one third.
        let p = plan(8, &[6005, 3005], None, None).unwrap();
        assert_eq!(ranges(&p), "sim:0:0..6 sim:1:6..8+out");
        // The last GPU's share: its layers, the output layer and the embedding, and scratch.
        assert_eq!(p.shares[2].total(), 2 * 110 + 50 + 70 + 5);
    }

    #[test]
    fn split_mode_none_uses_the_main_gpu() {
        let options = PlanOptions {
            split_mode: SplitMode::None,
            main_gpu: 1,
            ..PlanOptions::default()
        };
        let p = LoadPlan::new(&model(4), &gpus(&[1 << 20, 1 << 20]), &options).unwrap();
        assert_eq!(ranges(&p), "sim:1:0..4+out");
    }

    #[test]
    fn the_printed_plan_names_layers_and_bytes_per_device() {
        let p = plan(8, &[1 << 30, 1 << 30], Some(6), Some("1,1")).unwrap();
        let text = p.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("     cpu: layers 0..2 (2) + output; weights "),
            "{text}"
        );
        assert!(
            lines[1].starts_with("   sim:0: layers 2..5 (3); weights "),
            "{text}"
        );
        assert!(
            lines[2].starts_with("   sim:1: layers 5..8 (3); weights "),
            "{text}"
        );
    }

    #[test]
    fn absurd_values_are_refused_naming_the_flag() {
        let big = 1 << 30;
        let error = |text: &str| parse_tensor_split(text).unwrap_err().to_string();
        assert!(error("1,x").starts_with("--tensor-split: expected proportions such as 3,1"));
        assert!(error("1,-1").starts_with("--tensor-split: expected non-negative"));
        assert!(error("inf").starts_with("--tensor-split: expected non-negative"));
        assert!(error("0,0").starts_with("--tensor-split: expected at least one"));
        assert_eq!(
            "row".parse::<SplitMode>().unwrap_err().to_string(),
            "--split-mode: expected layer or none, found \"row\""
        );
        assert_eq!(
            plan(8, &[big], None, Some("1,1")).unwrap_err(),
            "--tensor-split: expected at most one proportion per GPU (1: sim:0), found 2"
        );
        assert_eq!(
            plan(8, &[], Some(4), None).unwrap_err(),
            "-ngl 4 puts layers on a GPU, but no GPU is in use: choose GPUs with --device or use -ngl 0"
        );
        let options = PlanOptions {
            main_gpu: 2,
            ..PlanOptions::default()
        };
        assert_eq!(
            LoadPlan::new(&model(4), &gpus(&[big, big]), &options)
                .unwrap_err()
                .to_string(),
            "--main-gpu: expected a GPU index below 2 (the GPUs in use: sim:0, sim:1), found 2"
        );
        let options = PlanOptions {
            split_mode: SplitMode::None,
            tensor_split: Some(vec![1.0]),
            ..PlanOptions::default()
        };
        assert!(LoadPlan::new(&model(4), &gpus(&[big]), &options)
            .unwrap_err()
            .to_string()
            .starts_with("--tensor-split: spreads layers over GPUs"));
        // 4 layers of 110 bytes, output 50 and embedding 70, scratch 5 on a 400-byte device.
        let e = plan(4, &[400], None, None).unwrap_err();
        assert!(
            e.starts_with("sim:0 needs 565 bytes (0.00 GiB) for its layers 0..4 and the output layer, KV cache and scratch, but has 400 bytes"),
            "{e}"
        );
        // Fewer layers fit.
        assert_eq!(
            ranges(&plan(4, &[400], Some(3), None).unwrap()),
            "cpu:0..1+out sim:0:1..4"
        );
    }

    proptest! {
        #[test]
        fn every_layer_is_assigned_once_in_contiguous_ranges(
            n_layer in 0usize..80,
            ngl in proptest::option::of(0usize..100),
            split in proptest::collection::vec(0u32..10, 1..5),
        ) {
            prop_assume!(split.iter().any(|&p| p > 0));
            let n_gpu = split.len();
            let devices = gpus(&vec![u64::MAX / 8; n_gpu]);
            let options = PlanOptions {
                gpu_layers: ngl,
                tensor_split: Some(split.iter().map(|&p| f64::from(p)).collect()),
                ..PlanOptions::default()
            };
            let p = LoadPlan::new(&model(n_layer), &devices, &options).unwrap();
            prop_assert_eq!(p.layers.len(), n_layer);
            // Ranges tile 0..n_layer in device order, each layer where its range says.
            let mut next = 0;
            for share in &p.shares {
                prop_assert_eq!(share.layers.start, next);
                for il in share.layers.clone() {
                    prop_assert_eq!(p.layers[il], share.target);
                }
                next = share.layers.end;
            }
            prop_assert_eq!(next, n_layer);
            // The CPU has exactly the first n_layer - ngl layers.
            let gpu_layers = ngl.unwrap_or(n_layer).min(n_layer);
            prop_assert_eq!(p.shares[0].layers.clone(), 0..n_layer - gpu_layers);
            // Exactly one device computes the output, the last GPU with layers when all are on
            // GPUs.
            prop_assert_eq!(p.shares.iter().filter(|s| s.output).count(), 1);
            prop_assert_eq!(p.output != Target::Cpu, gpu_layers == n_layer);
            // Proportions honoured: each GPU's units within one of its exact share.
            let units = gpu_layers + usize::from(gpu_layers == n_layer);
            let sum: u32 = split.iter().sum();
            for (i, share) in p.shares[1..].iter().enumerate() {
                let got = share.layers.len() + usize::from(share.output);
                let exact = units as f64 * f64::from(split[i]) / f64::from(sum);
                prop_assert!((got as f64 - exact).abs() <= 1.0, "gpu {} got {} units, exact {}", i, got, exact);
            }
        }

        #[test]
        fn split_counts_add_up(units in 0usize..500, proportions in proptest::collection::vec(0.0f64..100.0, 1..9)) {
            prop_assume!(proportions.iter().any(|&p| p > 0.0));
            let counts = split_counts(units, &proportions);
            prop_assert_eq!(counts.iter().sum::<usize>(), units);
            prop_assert_eq!(counts.len(), proportions.len());
        }
    }
}
