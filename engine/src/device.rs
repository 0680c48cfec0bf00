//! Where a model runs: the device names (`auto`, `cpu`, `cuda:N`, `hip:N`, lists of GPUs such as
//! `cuda:0,cuda:1`, simulated devices), the GPU layer count, memory sizes, and the rule that turns
//! those choices and a model's layer count into a [`Placement`] (CPU, a GPU with or without a CPU
//! fallback, or a layer split over several GPUs).
//!
//! The command line parses its flags into [`DeviceOptions`]; the loader ([`crate::load`]) and any
//! other front end decide from that plain struct, so every front end places a model the same
//! way. The flag names appear in the messages because they are what a user changes.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::backend::gpu::{GpuKind, Numerics, NumericsError};
use crate::load_plan::SplitMode;

/// Where to run, as `--device` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The first GPU with kernels in this build, else the CPU.
    Auto,
    Cpu,
    Gpu(GpuKind, usize),
    /// This many simulated GPUs (`sim:0,sim:1,...`): host devices that run the CPU's ops, each
    /// with its own layers and KV cache, copies between them as between GPUs (see
    /// [`crate::backend::split`]). For running layer splits on a machine without GPUs.
    Sim(usize),
    /// Several GPUs of one kind (`cuda:0,cuda:1`): a layer split over them, by a load plan.
    Gpus(GpuKind, GpuList),
}

/// The most simulated devices `--device sim:0,...` makes.
pub const MAX_SIM_DEVICES: usize = 16;

/// The most GPUs a `--device` list names.
pub const MAX_GPUS: usize = 16;

/// The environment variable that lets a `--device` list name one GPU more than once
/// (`cuda:0,cuda:0`): a testing aid, so a split over "two GPUs" (two backends, each with its own
/// pool and KV cache, copies between them as between GPUs) runs on a machine with one.
pub const ALLOW_REPEATED_DEVICE_ENV: &str = "EMBER_ALLOW_REPEATED_DEVICE";

/// The device numbers of a `--device` list of GPUs, in the order given (a fixed array, so that
/// [`DeviceSpec`] stays `Copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuList {
    ordinals: [u16; MAX_GPUS],
    len: u8,
}

impl GpuList {
    /// The list of `ordinals`; `None` when it is empty, longer than [`MAX_GPUS`], or a number
    /// does not fit.
    pub fn new(ordinals: &[usize]) -> Option<GpuList> {
        if ordinals.is_empty() || ordinals.len() > MAX_GPUS {
            return None;
        }
        let mut list = GpuList {
            ordinals: [0; MAX_GPUS],
            len: ordinals.len() as u8,
        };
        for (slot, &ordinal) in list.ordinals.iter_mut().zip(ordinals) {
            *slot = u16::try_from(ordinal).ok()?;
        }
        Some(list)
    }

    /// The device numbers, in order.
    pub fn ordinals(&self) -> Vec<usize> {
        self.ordinals[..usize::from(self.len)]
            .iter()
            .map(|&o| usize::from(o))
            .collect()
    }

    /// How many GPUs the list names.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Always false: a list names at least one GPU.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => f.write_str("auto"),
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Gpu(kind, ordinal) => write!(f, "{kind}:{ordinal}"),
            DeviceSpec::Sim(n) => {
                let names: Vec<String> = (0..*n).map(|i| format!("sim:{i}")).collect();
                f.write_str(&names.join(","))
            }
            DeviceSpec::Gpus(kind, list) => {
                let names: Vec<String> = list
                    .ordinals()
                    .iter()
                    .map(|ordinal| format!("{kind}:{ordinal}"))
                    .collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// A flag value that could not be parsed; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: expected {expected}, found {found:?}")]
pub struct FlagError {
    pub flag: &'static str,
    pub expected: &'static str,
    pub found: String,
}

impl FromStr for DeviceSpec {
    type Err = FlagError;

    fn from_str(text: &str) -> Result<DeviceSpec, FlagError> {
        let error = || {
            FlagError {
            flag: "--device",
            expected: "auto, cpu, cuda:N or hip:N (N a device number such as 0), a list of GPUs such as cuda:0,cuda:1, or sim:0,sim:1,...",
            found: text.to_string(),
        }
        };
        let lower = text.trim().to_ascii_lowercase();
        if lower.starts_with("sim") {
            return parse_sim(text, &lower);
        }
        if lower.contains(',') {
            let allow_repeated = std::env::var(ALLOW_REPEATED_DEVICE_ENV).is_ok_and(|v| v == "1");
            return parse_gpu_list(text, allow_repeated);
        }
        match lower.as_str() {
            "auto" => return Ok(DeviceSpec::Auto),
            "cpu" => return Ok(DeviceSpec::Cpu),
            _ => {}
        }
        let (kind, ordinal) = match lower.split_once(':') {
            Some((kind, ordinal)) => (kind, Some(ordinal)),
            None => (lower.as_str(), None),
        };
        let kind = match kind {
            "cuda" => GpuKind::Cuda,
            "hip" | "rocm" => GpuKind::Hip,
            _ => return Err(error()),
        };
        let ordinal = match ordinal {
            // `cuda` alone means the first device, as `cuda:0`.
            None => 0,
            Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                digits.parse().map_err(|_| error())?
            }
            Some(_) => return Err(error()),
        };
        Ok(DeviceSpec::Gpu(kind, ordinal))
    }
}

/// `cuda:0,cuda:1,...` or `hip:0,hip:1,...`: several GPUs of one kind. A GPU named twice is
/// refused unless `allow_repeated` ([`ALLOW_REPEATED_DEVICE_ENV`]).
pub fn parse_gpu_list(text: &str, allow_repeated: bool) -> Result<DeviceSpec, FlagError> {
    let error = |expected: &'static str| FlagError {
        flag: "--device",
        expected,
        found: text.to_string(),
    };
    let mut kind = None;
    let mut ordinals = Vec::new();
    for part in text.split(',') {
        // A single name parses as one GPU (`cuda` alone is `cuda:0`); anything else in a list
        // (cpu, auto, a simulated device, another list) is refused.
        match part.trim().parse::<DeviceSpec>() {
            Ok(DeviceSpec::Gpu(part_kind, ordinal)) if part.trim().contains(':') => {
                if kind.is_some_and(|k| k != part_kind) {
                    return Err(error(
                        "GPUs of one kind, such as cuda:0,cuda:1 or hip:0,hip:1 (CUDA and HIP devices cannot share a split)",
                    ));
                }
                kind = Some(part_kind);
                ordinals.push(ordinal);
            }
            _ => {
                return Err(error(
                    "a list of GPUs of one kind, such as cuda:0,cuda:1 or hip:0,hip:1 (cpu, auto and sim:N cannot be listed with GPUs; the CPU takes the layers -ngl leaves off the GPUs)",
                ))
            }
        }
    }
    let repeated = ordinals
        .iter()
        .enumerate()
        .any(|(i, o)| ordinals[..i].contains(o));
    if repeated && !allow_repeated {
        return Err(error(
            "each GPU named once, such as cuda:0,cuda:1 (set EMBER_ALLOW_REPEATED_DEVICE=1 to run a split over one GPU named twice, a testing aid)",
        ));
    }
    match (kind, GpuList::new(&ordinals)) {
        (Some(kind), Some(list)) => Ok(DeviceSpec::Gpus(kind, list)),
        _ => Err(error("at most 16 GPUs, each numbered below 65536")),
    }
}

/// `sim:0,sim:1,...`: simulated devices numbered from 0 in order.
fn parse_sim(text: &str, lower: &str) -> Result<DeviceSpec, FlagError> {
    let parts: Vec<&str> = lower.split(',').map(str::trim).collect();
    let numbered = parts
        .iter()
        .enumerate()
        .all(|(i, part)| *part == format!("sim:{i}"));
    if !numbered || parts.len() > MAX_SIM_DEVICES {
        return Err(FlagError {
            flag: "--device",
            expected:
                "simulated devices numbered from 0, such as sim:0 or sim:0,sim:1 (at most 16)",
            found: text.to_string(),
        });
    }
    Ok(DeviceSpec::Sim(parts.len()))
}

/// `-ngl/--gpu-layers`: how many layers go on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    All,
    Count(usize),
}

impl FromStr for GpuLayers {
    type Err = FlagError;

    fn from_str(text: &str) -> Result<GpuLayers, FlagError> {
        let trimmed = text.trim();
        if trimmed.eq_ignore_ascii_case("all") {
            return Ok(GpuLayers::All);
        }
        // llama.cpp's -1 ("as many as fit") and its usual 99/999 both mean "all" here.
        if trimmed == "-1" {
            return Ok(GpuLayers::All);
        }
        trimmed
            .parse::<usize>()
            .map(GpuLayers::Count)
            .map_err(|_| FlagError {
                flag: "--gpu-layers",
                expected: "a layer count (0 keeps the model on the CPU) or `all`",
                found: text.to_string(),
            })
    }
}

/// Parses a memory size: a byte count, or a number with a unit (`8GiB`, `8G`, `512MiB`,
/// `1.5GB`). K/M/G/T and KiB/MiB/GiB/TiB are binary; KB/MB/GB/TB are decimal.
pub fn parse_size(text: &str) -> Result<u64, FlagError> {
    let error = || FlagError {
        flag: "--vram-budget",
        expected: "a size such as 8GiB, 512MiB, 24G or a byte count",
        found: text.to_string(),
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim();
    let multiplier: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(error()),
    };
    if number.is_empty() || number.matches('.').count() > 1 {
        return Err(error());
    }
    let value: f64 = number.parse().map_err(|_| error())?;
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(error());
    }
    Ok(bytes.round() as u64)
}

/// The device choices of a model-running command, as plain values (the command line's device
/// flags parse into this).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceOptions {
    /// Where to run.
    pub device: DeviceSpec,
    /// Layers on the GPU; `None` means all of them when a GPU is used.
    pub gpu_layers: Option<GpuLayers>,
    /// Most device memory the engine may use at once, in bytes.
    pub vram_budget: Option<u64>,
    /// Report device memory by purpose at load, at peak and after idle.
    pub memory_report: bool,
    /// Run even when the weights are found not to be in VRAM (warn instead of refusing).
    pub allow_host_weights: bool,
    /// ROCm installation to load the HIP runtime from first.
    pub rocm_path: Option<PathBuf>,
    /// Folder holding the per-architecture kernel code objects.
    pub kernels_dir: Option<PathBuf>,
    /// How the GPU rounds; `None` takes `EMBER_GPU_NUMERICS`, else fast.
    pub numerics: Option<Numerics>,
    /// How layers spread over several GPUs (`--split-mode`).
    pub split_mode: SplitMode,
    /// `--tensor-split`: a proportion per GPU; `None` splits by free memory.
    pub tensor_split: Option<Vec<f64>>,
    /// `--main-gpu`: the GPU of `--split-mode none`.
    pub main_gpu: usize,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            device: DeviceSpec::Auto,
            gpu_layers: None,
            vram_budget: None,
            memory_report: false,
            allow_host_weights: false,
            rocm_path: None,
            kernels_dir: None,
            numerics: None,
            split_mode: SplitMode::Layer,
            tensor_split: None,
            main_gpu: 0,
        }
    }
}

/// Where the model goes, once the options and the model's layer count are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    /// On a GPU: the given one, or the first usable one (falling back to the CPU when there is
    /// none, with the reason reported).
    Gpu {
        device: Option<(GpuKind, usize)>,
        fall_back_to_cpu: bool,
    },
    /// The last `layers` layers on a GPU (the given one, or the first usable one), the rest on
    /// the CPU: partial offload, by a load plan.
    Offload {
        device: Option<(GpuKind, usize)>,
        layers: usize,
        fall_back_to_cpu: bool,
    },
    /// Over simulated devices, by a load plan (any -ngl: the other layers on the CPU).
    Sim {
        devices: usize,
    },
    /// Over several GPUs, by a load plan: `layers` of them on the GPUs (`None`: all), the
    /// others on the CPU.
    Gpus {
        kind: GpuKind,
        ordinals: GpuList,
        layers: Option<usize>,
    },
}

/// Device choices that contradict each other or ask for something not supported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("-ngl {layers} puts layers on a GPU, but --device cpu keeps everything on the CPU: drop -ngl or choose --device auto, cuda:N or hip:N")]
    LayersOnCpu { layers: usize },
    #[error("-ngl 0 keeps every layer on the CPU, but --device {device} asks for a GPU: drop -ngl 0 or use --device cpu")]
    NoLayersOnGpu { device: DeviceSpec },
}

impl DeviceOptions {
    /// The numerics mode a GPU runs in: the option, else `EMBER_GPU_NUMERICS`, else fast.
    pub fn numerics(&self) -> Result<Numerics, NumericsError> {
        Numerics::resolve(self.numerics)
    }

    /// Decides where a model of `n_layer` layers runs. `-ngl 0` means the CPU; no `-ngl`, `all`,
    /// or a count of at least `n_layer` means the GPU; anything between is partial offload. `--device auto` falls back to the CPU (with a warning) when no GPU is usable.
    pub fn placement(&self, n_layer: usize) -> Result<Placement, PlacementError> {
        let all = match self.gpu_layers {
            None | Some(GpuLayers::All) => None,
            Some(GpuLayers::Count(n)) if n >= n_layer => None,
            Some(GpuLayers::Count(n)) => Some(n),
        };
        match (self.device, all) {
            (DeviceSpec::Sim(devices), _) => Ok(Placement::Sim { devices }),
            (DeviceSpec::Gpus(..), Some(0)) => Err(PlacementError::NoLayersOnGpu {
                device: self.device,
            }),
            (DeviceSpec::Gpus(kind, ordinals), layers) => Ok(Placement::Gpus {
                kind,
                ordinals,
                layers,
            }),
            (DeviceSpec::Cpu, None) if self.gpu_layers.is_none() => Ok(Placement::Cpu),
            (DeviceSpec::Cpu, Some(0)) => Ok(Placement::Cpu),
            (DeviceSpec::Cpu, _) => Err(PlacementError::LayersOnCpu {
                layers: match self.gpu_layers {
                    Some(GpuLayers::Count(n)) => n,
                    _ => n_layer,
                },
            }),
            (DeviceSpec::Auto, Some(0)) => Ok(Placement::Cpu),
            (DeviceSpec::Gpu(..), Some(0)) => Err(PlacementError::NoLayersOnGpu {
                device: self.device,
            }),
            (DeviceSpec::Auto, Some(layers)) => Ok(Placement::Offload {
                device: None,
                layers,
                fall_back_to_cpu: true,
            }),
            (DeviceSpec::Gpu(kind, ordinal), Some(layers)) => Ok(Placement::Offload {
                device: Some((kind, ordinal)),
                layers,
                fall_back_to_cpu: false,
            }),
            (DeviceSpec::Auto, None) => Ok(Placement::Gpu {
                device: None,
                // As llama.cpp does, -ngl without a usable GPU runs on the CPU with a warning;
                // only a GPU named with --device is required.
                fall_back_to_cpu: true,
            }),
            (DeviceSpec::Gpu(kind, ordinal), None) => Ok(Placement::Gpu {
                device: Some((kind, ordinal)),
                fall_back_to_cpu: false,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(text: &str) -> Result<DeviceSpec, String> {
        text.parse::<DeviceSpec>().map_err(|e| e.to_string())
    }

    #[test]
    fn device_strings() {
        assert_eq!(device("auto"), Ok(DeviceSpec::Auto));
        assert_eq!(device("CPU"), Ok(DeviceSpec::Cpu));
        assert_eq!(device("cuda:0"), Ok(DeviceSpec::Gpu(GpuKind::Cuda, 0)));
        assert_eq!(device("cuda"), Ok(DeviceSpec::Gpu(GpuKind::Cuda, 0)));
        assert_eq!(device("hip:3"), Ok(DeviceSpec::Gpu(GpuKind::Hip, 3)));
        assert_eq!(device("rocm:1"), Ok(DeviceSpec::Gpu(GpuKind::Hip, 1)));
        for bad in [
            "gpu", "cuda:", "cuda:x", "cuda:-1", "hip:1:2", "", "vulkan:0",
        ] {
            let error = device(bad).unwrap_err();
            assert_eq!(
                error,
                format!("--device: expected auto, cpu, cuda:N or hip:N (N a device number such as 0), a list of GPUs such as cuda:0,cuda:1, or sim:0,sim:1,..., found {bad:?}")
            );
        }
        assert_eq!(DeviceSpec::Gpu(GpuKind::Hip, 2).to_string(), "hip:2");
    }

    #[test]
    fn simulated_device_lists() {
        assert_eq!(device("sim:0"), Ok(DeviceSpec::Sim(1)));
        assert_eq!(device("sim:0,sim:1, sim:2"), Ok(DeviceSpec::Sim(3)));
        assert_eq!(DeviceSpec::Sim(2).to_string(), "sim:0,sim:1");
        let sixteen: Vec<String> = (0..16).map(|i| format!("sim:{i}")).collect();
        assert_eq!(device(&sixteen.join(",")), Ok(DeviceSpec::Sim(16)));
        let seventeen: Vec<String> = (0..17).map(|i| format!("sim:{i}")).collect();
        for bad in [
            "sim",
            "sim:1",
            "sim:0,sim:0",
            "sim:0,sim:2",
            "sim:0,cuda:1",
            &seventeen.join(","),
        ] {
            assert_eq!(
                device(bad),
                Err(format!("--device: expected simulated devices numbered from 0, such as sim:0 or sim:0,sim:1 (at most 16), found {bad:?}")),
            );
        }
        // Any -ngl is a plan over the simulated devices (and the CPU for the rest).
        for layers in [None, Some(GpuLayers::Count(0)), Some(GpuLayers::Count(7))] {
            assert_eq!(
                placement(DeviceSpec::Sim(2), layers),
                Ok(Placement::Sim { devices: 2 })
            );
        }
    }

    fn list(kind: GpuKind, ordinals: &[usize]) -> DeviceSpec {
        DeviceSpec::Gpus(kind, GpuList::new(ordinals).unwrap())
    }

    #[test]
    fn gpu_lists() {
        assert_eq!(device("cuda:0,cuda:1"), Ok(list(GpuKind::Cuda, &[0, 1])));
        assert_eq!(
            device(" HIP:2, hip:0 ,rocm:1"),
            Ok(list(GpuKind::Hip, &[2, 0, 1]))
        );
        assert_eq!(
            list(GpuKind::Cuda, &[1, 0, 3]).to_string(),
            "cuda:1,cuda:0,cuda:3"
        );
        assert_eq!(
            list(GpuKind::Hip, &[0, 1]).to_string().parse(),
            Ok(list(GpuKind::Hip, &[0, 1]))
        );
        // A single GPU stays what it was.
        assert_eq!(device("cuda:1"), Ok(DeviceSpec::Gpu(GpuKind::Cuda, 1)));
        let mixed = "--device: expected GPUs of one kind, such as cuda:0,cuda:1 or hip:0,hip:1 (CUDA and HIP devices cannot share a split)";
        assert_eq!(
            device("cuda:0,hip:1"),
            Err(format!("{mixed}, found \"cuda:0,hip:1\""))
        );
        for bad in [
            "cuda:0,cpu",
            "cpu,cuda:0",
            "auto,cuda:1",
            "cuda:0,sim:1",
            "cuda:0,",
            "cuda:0,cuda",
            "cuda:0,cuda:x",
            "cuda:0,vulkan:1",
        ] {
            assert_eq!(
                device(bad),
                Err(format!("--device: expected a list of GPUs of one kind, such as cuda:0,cuda:1 or hip:0,hip:1 (cpu, auto and sim:N cannot be listed with GPUs; the CPU takes the layers -ngl leaves off the GPUs), found {bad:?}")),
            );
        }
        let seventeen: Vec<String> = (0..17).map(|i| format!("cuda:{i}")).collect();
        assert_eq!(
            device(&seventeen.join(",")),
            Err(format!(
                "--device: expected at most 16 GPUs, each numbered below 65536, found {:?}",
                seventeen.join(",")
            ))
        );
    }

    #[test]
    fn a_repeated_gpu_needs_the_testing_aid() {
        let repeated = "--device: expected each GPU named once, such as cuda:0,cuda:1 (set EMBER_ALLOW_REPEATED_DEVICE=1 to run a split over one GPU named twice, a testing aid)";
        for (text, allowed) in [
            ("cuda:0,cuda:0", list(GpuKind::Cuda, &[0, 0])),
            ("hip:1,hip:0,hip:1", list(GpuKind::Hip, &[1, 0, 1])),
        ] {
            assert_eq!(
                parse_gpu_list(text, false).map_err(|e| e.to_string()),
                Err(format!("{repeated}, found {text:?}"))
            );
            assert_eq!(parse_gpu_list(text, true), Ok(allowed));
        }
        // The tests never set the variable, so `--device` itself refuses.
        if std::env::var(ALLOW_REPEATED_DEVICE_ENV).is_err() {
            assert_eq!(
                device("cuda:0,cuda:0"),
                Err(format!("{repeated}, found \"cuda:0,cuda:0\""))
            );
        }
    }

    #[test]
    fn a_gpu_list_is_a_plan_over_its_gpus() {
        use GpuLayers::{All, Count};
        let cuda01 = list(GpuKind::Cuda, &[0, 1]);
        let DeviceSpec::Gpus(_, ordinals) = cuda01 else {
            unreachable!()
        };
        let gpus = |layers| {
            Ok(Placement::Gpus {
                kind: GpuKind::Cuda,
                ordinals,
                layers,
            })
        };
        assert_eq!(placement(cuda01, None), gpus(None));
        assert_eq!(placement(cuda01, Some(All)), gpus(None));
        assert_eq!(placement(cuda01, Some(Count(40))), gpus(None));
        assert_eq!(placement(cuda01, Some(Count(7))), gpus(Some(7)));
        assert_eq!(
            placement(cuda01, Some(Count(0))),
            Err("-ngl 0 keeps every layer on the CPU, but --device cuda:0,cuda:1 asks for a GPU: drop -ngl 0 or use --device cpu".into())
        );
    }

    #[test]
    fn sizes() {
        let cases: &[(&str, u64)] = &[
            ("8GiB", 8 << 30),
            ("8G", 8 << 30),
            ("8 gib", 8 << 30),
            ("512MiB", 512 << 20),
            ("1.5GiB", 3 << 29),
            ("2GB", 2_000_000_000),
            ("4096", 4096),
            ("64k", 64 << 10),
            ("1TiB", 1 << 40),
        ];
        for &(text, bytes) in cases {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in ["", "GiB", "8XB", "-1G", "1.2.3G", "0", "0.1"] {
            let error = parse_size(bad).unwrap_err().to_string();
            assert!(
                error.starts_with("--vram-budget: expected a size such as 8GiB"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn gpu_layer_values() {
        assert_eq!("all".parse(), Ok(GpuLayers::All));
        assert_eq!("-1".parse(), Ok(GpuLayers::All));
        assert_eq!("99".parse(), Ok(GpuLayers::Count(99)));
        assert_eq!("0".parse(), Ok(GpuLayers::Count(0)));
        let error = "some".parse::<GpuLayers>().unwrap_err().to_string();
        assert_eq!(error, "--gpu-layers: expected a layer count (0 keeps the model on the CPU) or `all`, found \"some\"");
    }

    fn placement(device: DeviceSpec, layers: Option<GpuLayers>) -> Result<Placement, String> {
        let options = DeviceOptions {
            device,
            gpu_layers: layers,
            ..DeviceOptions::default()
        };
        options.placement(32).map_err(|e| e.to_string())
    }

    #[test]
    fn ngl_rules() {
        use GpuLayers::{All, Count};
        let cuda0 = DeviceSpec::Gpu(GpuKind::Cuda, 0);
        let gpu = |device, fall_back_to_cpu| {
            Ok(Placement::Gpu {
                device,
                fall_back_to_cpu,
            })
        };
        assert_eq!(placement(DeviceSpec::Auto, None), gpu(None, true));
        assert_eq!(placement(DeviceSpec::Auto, Some(All)), gpu(None, true));
        assert_eq!(
            placement(DeviceSpec::Auto, Some(Count(99))),
            gpu(None, true)
        );
        assert_eq!(
            placement(DeviceSpec::Auto, Some(Count(32))),
            gpu(None, true)
        );
        assert_eq!(
            placement(DeviceSpec::Auto, Some(Count(0))),
            Ok(Placement::Cpu)
        );
        assert_eq!(placement(DeviceSpec::Cpu, None), Ok(Placement::Cpu));
        assert_eq!(
            placement(DeviceSpec::Cpu, Some(Count(0))),
            Ok(Placement::Cpu)
        );
        assert_eq!(placement(cuda0, None), gpu(Some((GpuKind::Cuda, 0)), false));
        assert_eq!(
            placement(cuda0, Some(Count(99))),
            gpu(Some((GpuKind::Cuda, 0)), false)
        );
        assert_eq!(
            placement(DeviceSpec::Auto, Some(Count(16))),
            Ok(Placement::Offload {
                device: None,
                layers: 16,
                fall_back_to_cpu: true
            })
        );
        assert_eq!(
            placement(cuda0, Some(Count(31))),
            Ok(Placement::Offload {
                device: Some((GpuKind::Cuda, 0)),
                layers: 31,
                fall_back_to_cpu: false
            })
        );
        assert_eq!(
            placement(DeviceSpec::Cpu, Some(Count(99))),
            Err("-ngl 99 puts layers on a GPU, but --device cpu keeps everything on the CPU: drop -ngl or choose --device auto, cuda:N or hip:N".into())
        );
        assert_eq!(
            placement(DeviceSpec::Cpu, Some(All)),
            Err("-ngl 32 puts layers on a GPU, but --device cpu keeps everything on the CPU: drop -ngl or choose --device auto, cuda:N or hip:N".into())
        );
        assert_eq!(
            placement(cuda0, Some(Count(0))),
            Err("-ngl 0 keeps every layer on the CPU, but --device cuda:0 asks for a GPU: drop -ngl 0 or use --device cpu".into())
        );
    }

    #[test]
    fn the_numerics_option_wins_over_the_environment() {
        let options = DeviceOptions {
            numerics: Some(Numerics::Reference),
            ..DeviceOptions::default()
        };
        assert_eq!(options.numerics(), Ok(Numerics::Reference));
        let options = DeviceOptions {
            numerics: Some(Numerics::Fast),
            ..DeviceOptions::default()
        };
        assert_eq!(options.numerics(), Ok(Numerics::Fast));
    }
}
