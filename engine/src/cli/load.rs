//! What every model-using subcommand does first: resolve `-m` (a path, or a pinned model fetched on
//! first use), open the GGUF, load the tokenizer, decide the device from the device flags and the
//! model's layer count, and load the weights there, with progress on stderr. On a GPU it also
//! prints the device, why its memory pool was chosen and the numerics mode, checks that the
//! weights really are in VRAM, and prints the memory report when asked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use ember_gguf::Gguf;
use ember_gpu::placement::{self, PlacementPolicy};
use ember_gpu::pool::format_bytes;
use ember_gpu::{DevicePool, MemoryReport};
use ember_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use super::device::{DeviceArgs, Placement};
use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{self, GpuBackend, Numerics, OpenOptions};
use crate::backend::Backend;
use crate::batch::Batch;
use crate::model::{architecture_of, ContextParams, HParams, Model};
use crate::models::{self, PullProgress};

/// A model ready to run.
pub struct Loaded<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    pub path: PathBuf,
    pub load_time: Duration,
    /// The device's memory pool, on a GPU.
    pub pool: Option<Arc<DevicePool>>,
    /// `--memory-report` was given.
    pub memory_report: bool,
}

/// A model loaded on whichever backend the flags chose.
pub enum AnyLoaded {
    Cpu(Box<Loaded<CpuBackend>>),
    Gpu(Box<Loaded<GpuBackend>>),
}

/// Runs the same generic code on whichever backend a model was loaded on.
macro_rules! with_loaded {
    ($any:expr, |$loaded:ident| $body:expr) => {
        match $any {
            $crate::cli::load::AnyLoaded::Cpu($loaded) => $body,
            $crate::cli::load::AnyLoaded::Gpu($loaded) => $body,
        }
    };
}
pub(crate) use with_loaded;

impl<B: Backend> Loaded<B> {
    /// The memory report of the device, if on a GPU.
    pub fn memory_report_now(&self) -> Option<MemoryReport> {
        self.pool
            .as_ref()
            .map(|pool| MemoryReport::from_pools(&[DevicePool::clone(pool)]))
    }

    /// With `--memory-report` on a GPU: waits (at most 3 s) for the pool to trim itself after
    /// the work, then prints the report (at load, at peak, after idle). Call it once the
    /// command's contexts are dropped, so the report shows what idling gives back.
    pub fn finish(&self) {
        if !self.memory_report {
            return;
        }
        let Some(pool) = &self.pool else {
            eprintln!("memory report: the model runs on the CPU; nothing to report");
            return;
        };
        wait_for_idle_trim(pool, Duration::from_secs(3));
        if let Some(report) = self.memory_report_now() {
            eprint!("{report}");
        }
    }
}

/// Waits until the pool has trimmed itself after idling (the backend's trimmer does it), or
/// `limit` passes.
pub fn wait_for_idle_trim(pool: &DevicePool, limit: Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        let idle_after = pool.config().idle_after;
        // `trim_if_idle` is idempotent: it trims once per idle period, whoever asks.
        match pool.trim_if_idle(Instant::now()) {
            Ok(ember_gpu::pool::TrimOutcome::NotIdle { remaining }) => {
                std::thread::sleep(remaining.min(idle_after).max(Duration::from_millis(10)))
            }
            Ok(_) => return,
            Err(error) => {
                eprintln!("warning: trimming device memory failed: {error}");
                return;
            }
        }
    }
}

/// Pull progress as an indicatif byte bar on stderr (hidden when stderr is not a terminal).
pub struct BarProgress {
    bar: Option<ProgressBar>,
}

impl BarProgress {
    pub fn new() -> Self {
        BarProgress { bar: None }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl PullProgress for BarProgress {
    fn message(&mut self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => eprintln!("{text}"),
        }
    }

    fn bytes(&mut self, done: u64, total: u64) {
        let bar = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        bar.set_position(done);
    }
}

/// The file `-m` names, fetching a pinned model on first use.
pub fn resolve_model(spec: &str) -> anyhow::Result<PathBuf> {
    let mut progress = BarProgress::new();
    let path = models::resolve(spec, &mut progress);
    progress.finish();
    Ok(path?)
}

/// Opens a GGUF file with a readable error naming it.
pub fn open_gguf(path: &Path) -> anyhow::Result<Arc<Gguf>> {
    Ok(Arc::new(Gguf::open(path).with_context(|| {
        format!("cannot load {}", path.display())
    })?))
}

fn tensor_bar(path: &Path, n_tensors: usize) -> ProgressBar {
    let bar = ProgressBar::new(n_tensors as u64);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} {bar:30} {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        path.file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    bar
}

/// Runs one small forward pass (enough tokens for the prefill path, and a decode step) so the
/// runtime loads its kernel modules and BLAS state now rather than during the first request, and
/// so the post-load memory floor includes them.
fn warm_up<B: Backend>(model: &Model<B>) -> anyhow::Result<()> {
    const WARM_UP_TOKENS: usize = 16;
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

/// Resolves, opens and loads a model and its tokenizer where the device flags say: on the CPU
/// with `threads` threads (0 for the physical core count), or on a GPU.
pub fn load_on(spec: &str, threads: usize, device: &DeviceArgs) -> anyhow::Result<AnyLoaded> {
    let start = Instant::now();
    let path = resolve_model(spec)?;
    let gguf = open_gguf(&path)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot load the tokenizer of {}", path.display()))?;
    let architecture =
        architecture_of(&gguf).with_context(|| format!("cannot load {}", path.display()))?;
    let hparams = HParams::from_metadata(architecture, gguf.metadata())
        .with_context(|| format!("cannot load {}", path.display()))?;
    let gpu_device = match device.placement(hparams.n_layer)? {
        Placement::Cpu => None,
        Placement::Gpu {
            device: wanted,
            fall_back_to_cpu,
        } => {
            let numerics = device.numerics()?;
            if numerics == Numerics::Reference {
                if let Some(error) = gpu::numerics::reference_unsupported(hparams.head_dim_k, hparams.final_logit_softcap) {
                    return Err(anyhow::Error::new(error)
                        .context(format!("cannot load {} on a GPU", path.display())));
                }
            }
            let options = OpenOptions {
                device: wanted,
                rocm_path: device.rocm_path.clone(),
                kernels_dir: device.kernels_dir.clone(),
                budget: device.vram_budget,
                idle_trim: true,
                numerics: Some(numerics),
                reference_threads: None,
            };
            match gpu::select(&options) {
                Ok(selection) => Some((selection, options)),
                Err(error) if fall_back_to_cpu => {
                    eprintln!("info: running on the CPU: {error}");
                    None
                }
                Err(error) => return Err(error.into()),
            }
        }
    };
    let Some((selection, options)) = gpu_device else {
        if device.memory_report {
            eprintln!("memory report: the model runs on the CPU; nothing to report");
        }
        let backend = CpuBackend::new(threads).context("cannot start the CPU thread pool")?;
        let bar = tensor_bar(&path, gguf.tensors().len());
        let model = Model::from_gguf(gguf, backend, &mut |done, _| bar.set_position(done as u64));
        bar.finish_and_clear();
        let model = model.with_context(|| format!("cannot load {}", path.display()))?;
        return Ok(AnyLoaded::Cpu(Box::new(Loaded {
            model,
            tokenizer,
            path,
            load_time: start.elapsed(),
            pool: None,
            memory_report: false,
        })));
    };

    let driver = Arc::clone(&selection.driver);
    let ordinal = selection.ordinal;
    let opened = gpu::open(selection, &options)?;
    eprintln!(
        "{}: {} ({}), {} VRAM; {}; {}",
        opened.device,
        opened.info.name,
        opened.info.arch,
        format_bytes(opened.info.total_memory),
        opened.pool_reason,
        opened.backend.context().blas()
    );
    match opened.backend.numerics() {
        Numerics::Fast => eprintln!("{}: fast numerics", opened.device),
        Numerics::Reference => eprintln!(
            "{}: reference numerics: every op bit-identical to the CPU backend with {} threads ({}); no fused kernels, no decode graphs",
            opened.device,
            opened.backend.reference_threads(),
            gpu::REFERENCE_THREADS_ENV
        ),
    }
    let pool = Arc::clone(opened.backend.pool());
    let free_before = driver
        .mem_info(ordinal)
        .with_context(|| format!("cannot read the free memory of {}", opened.device))?
        .free;
    let bar = tensor_bar(&path, gguf.tensors().len());
    let model = Model::from_gguf(gguf, opened.backend, &mut |done, _| {
        bar.set_position(done as u64)
    });
    bar.finish_and_clear();
    let model =
        model.with_context(|| format!("cannot load {} on {}", path.display(), opened.device))?;
    let buffers = model.backend().placed_weights();
    let views: Vec<(&str, ember_gpu::DevicePtr, u64)> = buffers
        .iter()
        .map(|(name, ptr, bytes)| (name.as_str(), *ptr, *bytes))
        .collect();
    let observation = placement::observe(&*driver, ordinal, &views, free_before)
        .with_context(|| format!("cannot check where the weights live on {}", opened.device))?;
    let policy = PlacementPolicy {
        allow_host_weights: device.allow_host_weights,
        ..PlacementPolicy::default()
    };
    match placement::evaluate(&observation, &policy) {
        Ok(verdict) => eprintln!("{}: {verdict}", opened.device),
        Err(error) => bail!(error),
    }
    warm_up(&model)
        .with_context(|| format!("the first forward pass on {} failed", opened.device))?;
    // The post-load floor: weights plus what the runtime keeps once it has run every kind of
    // work (kernel modules, the BLAS workspace), with the warm-up's memory handed back.
    pool.trim_now()
        .with_context(|| format!("cannot trim the memory pool of {}", opened.device))?;
    pool.mark_loaded();
    let loaded = Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
        pool: Some(pool),
        memory_report: device.memory_report,
    };
    if device.memory_report {
        if let Some(report) = loaded.memory_report_now() {
            eprint!("{report}");
        }
    }
    Ok(AnyLoaded::Gpu(Box::new(loaded)))
}
