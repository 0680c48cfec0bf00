//! What every model-using subcommand does first: resolve `-m` (a path, or a pinned model fetched on
//! first use), open the GGUF, load the tokenizer and the weights, with progress on stderr.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use ember_gguf::Gguf;
use ember_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::backend::cpu::CpuBackend;
use crate::model::Model;
use crate::models::{self, PullProgress};

/// A model ready to run.
pub struct Loaded {
    pub model: Model<CpuBackend>,
    pub tokenizer: Tokenizer,
    pub path: PathBuf,
    pub load_time: Duration,
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

/// Resolves, opens and loads a model and its tokenizer on the CPU with `threads` threads (0 for
/// the physical core count).
pub fn load(spec: &str, threads: usize) -> anyhow::Result<Loaded> {
    let start = Instant::now();
    let path = resolve_model(spec)?;
    let gguf = open_gguf(&path)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot load the tokenizer of {}", path.display()))?;
    let backend = CpuBackend::new(threads).context("cannot start the CPU thread pool")?;
    let bar = ProgressBar::new(gguf.tensors().len() as u64);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} {bar:30} {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(
        path.file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let model = Model::from_gguf(gguf, backend, &mut |done, _| bar.set_position(done as u64));
    bar.finish_and_clear();
    let model = model.with_context(|| format!("cannot load {}", path.display()))?;
    Ok(Loaded {
        model,
        tokenizer,
        path,
        load_time: start.elapsed(),
    })
}
