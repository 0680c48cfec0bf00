//! Holds a whole model on the GPU backend in reference numerics to the CPU backend, bit for bit:
//! the same prompt through both (the CPU with 2 threads, the GPU reproducing 2 threads), then
//! one-token decode steps that feed both the CPU's greedy token, comparing the logits of every
//! step. On the first step whose logits differ it prints the step and the largest difference,
//! then runs that step again with every op's output recorded on both backends and names the
//! first op (and layer) whose output differs. Exit code 1 on any mismatch.
//!
//! `cargo build --release -p ember --examples`, then on the GPU machine (kernels as `ember` finds
//! them: `EMBER_KERNELS_DIR`, or `kernels/` beside the binary):
//! `target/release/examples/exact_forward_check MODEL.gguf [--ids 1,2,3 | --prompt-len N]
//! [--steps 16] [--batch N] [--threads 2] [--device cuda:0]`.
//!
//! The prompt is `--ids` as given, else `--prompt-len` (default 80) token ids spread over the
//! vocabulary. Prompt lengths choose the attention paths: 80 tokens take the CPU's tiled f32 path
//! for the prompt and the f16 path for the decode steps; `--prompt-len 5` the f16 path
//! throughout; `--prompt-len 600` the split-KV path of single tokens over 512 or more cached
//! positions, whose split follows `--threads`. `--batch N` evaluates the prompt in chunks of N.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;
use ember::backend::cpu::CpuBackend;
use ember::backend::gpu::{self, Numerics, OpenOptions};
use ember::backend::{Backend, BackendError, OpFailure, QkNorm, RopeMode, RopeParams};
use ember::batch::Batch;
use ember::device::DeviceSpec;
use ember::kv_cache::AttentionPlan;
use ember::model::{architecture_of, ContextParams, FfnActivation, HParams, Model};
use ember_gguf::{Gguf, TensorInfo};

#[derive(Debug, Parser)]
#[command(about = "a model's logits on the GPU in reference numerics against the CPU, bit for bit")]
struct Args {
    /// The GGUF model (an `ember-synth` file or a real one).
    model: std::path::PathBuf,
    /// Prompt token ids, comma-separated (default: --prompt-len ids spread over the vocabulary).
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<u32>>,
    /// Length of the generated prompt when --ids is not given.
    #[arg(long, default_value_t = 80)]
    prompt_len: usize,
    /// One-token decode steps after the prompt.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Prompt tokens per forward pass (default: the whole prompt at once).
    #[arg(long)]
    batch: Option<usize>,
    /// CPU threads, and the CPU thread count the GPU's reference attention reproduces.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The GPU: cuda:N or hip:N (auto: the first usable one).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// Put a second CPU backend with this many threads in the GPU's place (no GPU needed), to
    /// check the check: equal thread counts must pass; unequal ones differ only where the
    /// split-KV attention runs (a prompt of 512 tokens or more).
    #[arg(long, value_name = "THREADS")]
    dry_run: Option<usize>,
}

/// One op's output, recorded while tracing.
struct Record {
    label: String,
    /// Empty when the op failed on the device (the failure reaches the forward pass).
    values: Vec<f32>,
}

/// A backend that runs another and, while `recording` is set, downloads every op's output after
/// the op (the model code and the wrapped backend's own implementations run unchanged, so a
/// traced pass computes what an untraced one does; the reads only add waits).
struct Trace<B: Backend> {
    inner: B,
    recording: AtomicBool,
    records: Mutex<Vec<Record>>,
    /// Q/K/V products seen while recording: the layer number of what follows (+1).
    qkv_calls: AtomicUsize,
}

/// A matrix with its shape, so the tracer knows how many outputs a product writes.
struct TracedMatrix<M> {
    inner: M,
    rows: usize,
    cols: usize,
}

impl<B: Backend> Trace<B> {
    fn new(inner: B) -> Trace<B> {
        Trace {
            inner,
            recording: AtomicBool::new(false),
            records: Mutex::new(Vec::new()),
            qkv_calls: AtomicUsize::new(0),
        }
    }

    fn start(&self) {
        self.records.lock().unwrap().clear();
        self.qkv_calls.store(0, Ordering::SeqCst);
        self.recording.store(true, Ordering::SeqCst);
    }

    fn stop(&self) -> Vec<Record> {
        self.recording.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.records.lock().unwrap())
    }

    fn snap(&self, op: &str, buf: &B::Buf, len: usize) {
        if !self.recording.load(Ordering::SeqCst) {
            return;
        }
        let mut values = Vec::new();
        self.inner.read(buf, len, &mut values);
        let layer = match self.qkv_calls.load(Ordering::SeqCst) {
            0 => "input".to_string(),
            n => format!("layer {}", n - 1),
        };
        let mut records = self.records.lock().unwrap();
        let label = format!("op #{} ({layer}) {op}", records.len());
        records.push(Record { label, values });
    }
}

impl<B: Backend> Backend for Trace<B> {
    type Buf = B::Buf;
    type Matrix = TracedMatrix<B::Matrix>;
    type Vector = B::Vector;
    type RopeTable = B::RopeTable;
    type KvLayer = B::KvLayer;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn take_failure(&self) -> Option<OpFailure> {
        self.inner.take_failure()
    }
    fn begin_forward(&self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        self.inner.begin_forward(batch, plan, out_rows)
    }
    fn end_forward(&self) -> bool {
        self.inner.end_forward()
    }
    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.inner.install(f)
    }
    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Matrix, BackendError> {
        let cols = info.dims.first().copied().unwrap_or(0) as usize;
        let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
        Ok(TracedMatrix {
            inner: self.inner.matrix(gguf, info)?,
            rows,
            cols,
        })
    }
    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<B::Vector, BackendError> {
        self.inner.vector(gguf, info)
    }
    fn matrix_private_bytes(&self, matrix: &Self::Matrix) -> usize {
        self.inner.matrix_private_bytes(&matrix.inner)
    }
    fn alloc(&self, len: usize) -> B::Buf {
        self.inner.alloc(len)
    }
    fn ensure_len(&self, buf: &mut B::Buf, len: usize) {
        self.inner.ensure_len(buf, len)
    }
    fn buf_bytes(&self, buf: &B::Buf) -> usize {
        self.inner.buf_bytes(buf)
    }
    fn gather_rows(&self, src: &B::Buf, dim: usize, rows: &[usize], out: &mut B::Buf) {
        self.inner.gather_rows(src, dim, rows, out);
        self.snap("gather_rows", out, rows.len() * dim);
    }
    fn write(&self, buf: &mut B::Buf, values: &[f32]) {
        self.inner.write(buf, values)
    }
    fn read(&self, buf: &B::Buf, len: usize, out: &mut Vec<f32>) {
        self.inner.read(buf, len, out)
    }
    fn argmax_rows(
        &self,
        x: &B::Buf,
        n_rows: usize,
        n_cols: usize,
        scratch: &mut B::Buf,
        out: &mut Vec<u32>,
    ) {
        self.inner.argmax_rows(x, n_rows, n_cols, scratch, out)
    }
    fn release_op_scratch(&self) {
        self.inner.release_op_scratch()
    }
    fn get_rows(&self, table: &Self::Matrix, ids: &[u32], scale: f32, out: &mut B::Buf) {
        self.inner.get_rows(&table.inner, ids, scale, out);
        self.snap("get_rows (embedding)", out, ids.len() * table.cols);
    }
    fn matmul(&self, w: &Self::Matrix, x: &B::Buf, n_tokens: usize, out: &mut B::Buf) {
        self.inner.matmul(&w.inner, x, n_tokens, out);
        self.snap(&format!("matmul ({} rows)", w.rows), out, n_tokens * w.rows);
    }
    fn matmul_shared(
        &self,
        ws: &[&Self::Matrix],
        x: &B::Buf,
        n_tokens: usize,
        outs: &mut [&mut B::Buf],
    ) {
        if ws.len() == 3 && self.recording.load(Ordering::SeqCst) {
            self.qkv_calls.fetch_add(1, Ordering::SeqCst);
        }
        let inner: Vec<&B::Matrix> = ws.iter().map(|w| &w.inner).collect();
        self.inner.matmul_shared(&inner, x, n_tokens, outs);
        for (i, (w, out)) in ws.iter().zip(outs.iter()).enumerate() {
            let name = if ws.len() == 3 {
                ["q", "k", "v"][i].to_string()
            } else {
                format!("{i}")
            };
            self.snap(
                &format!("matmul_shared {name} ({} rows)", w.rows),
                out,
                n_tokens * w.rows,
            );
        }
    }
    fn ffn_gate_up(
        &self,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        x: &B::Buf,
        n_tokens: usize,
        n_ff: usize,
        activation: FfnActivation,
        gate: &mut B::Buf,
        up: &mut B::Buf,
    ) {
        self.inner.ffn_gate_up(
            &w_gate.inner,
            &w_up.inner,
            x,
            n_tokens,
            n_ff,
            activation,
            gate,
            up,
        );
        self.snap(
            &format!("ffn_gate_up {activation:?} (products and activation)"),
            gate,
            n_tokens * n_ff,
        );
    }
    fn rms_norm(
        &self,
        x: &B::Buf,
        weight: &B::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut B::Buf,
    ) {
        self.inner.rms_norm(x, weight, n_rows, dim, eps, out);
        self.snap(&format!("rms_norm ({n_rows} x {dim})"), out, n_rows * dim);
    }
    fn rms_norm_inplace(
        &self,
        x: &mut B::Buf,
        weight: &B::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) {
        self.inner.rms_norm_inplace(x, weight, n_rows, dim, eps);
        self.snap(
            &format!("rms_norm_inplace ({n_rows} x {dim})"),
            x,
            n_rows * dim,
        );
    }
    fn add_inplace(&self, dst: &mut B::Buf, src: &B::Buf, len: usize) {
        self.inner.add_inplace(dst, src, len);
        self.snap("add_inplace (residual)", dst, len);
    }
    fn add_rms_norm(
        &self,
        x: &mut B::Buf,
        proj: &B::Buf,
        weight: &B::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut B::Buf,
    ) {
        self.inner
            .add_rms_norm(x, proj, weight, n_rows, dim, eps, out);
        self.snap("add_rms_norm: residual", x, n_rows * dim);
        self.snap("add_rms_norm: normalised", out, n_rows * dim);
    }
    fn add_bias(&self, x: &mut B::Buf, bias: &B::Vector, n_rows: usize, dim: usize) {
        self.inner.add_bias(x, bias, n_rows, dim);
        self.snap("add_bias", x, n_rows * dim);
    }
    fn scale(&self, x: &mut B::Buf, len: usize, scale: f32) {
        self.inner.scale(x, len, scale);
        self.snap("scale", x, len);
    }
    fn swiglu(&self, gate: &mut B::Buf, up: &B::Buf, len: usize) {
        self.inner.swiglu(gate, up, len);
        self.snap("swiglu", gate, len);
    }
    fn geglu(&self, gate: &mut B::Buf, up: &B::Buf, len: usize) {
        self.inner.geglu(gate, up, len);
        self.snap("geglu", gate, len);
    }
    fn softcap(&self, x: &mut B::Buf, len: usize, cap: f32) {
        self.inner.softcap(x, len, cap);
        self.snap("softcap", x, len);
    }
    fn rope_table_new(&self) -> B::RopeTable {
        self.inner.rope_table_new()
    }
    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut B::RopeTable) {
        self.inner.rope_table(positions, params, table)
    }
    fn rope(
        &self,
        x: &mut B::Buf,
        table: &B::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    ) {
        self.inner.rope(x, table, n_tokens, n_heads, head_dim, mode);
        self.snap("rope", x, n_tokens * n_heads * head_dim);
    }
    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> B::KvLayer {
        self.inner
            .kv_layer(max_blocks, block_size, n_kv_heads, head_dim)
    }
    fn kv_materialize(&self, layer: &mut B::KvLayer, blocks: &[u32]) {
        self.inner.kv_materialize(layer, blocks)
    }
    fn kv_release(&self, layer: &mut B::KvLayer, blocks: &[u32]) {
        self.inner.kv_release(layer, blocks)
    }
    fn kv_bytes(&self, layer: &B::KvLayer) -> usize {
        self.inner.kv_bytes(layer)
    }
    fn kv_store(&self, layer: &mut B::KvLayer, k: &B::Buf, v: &B::Buf, plan: &AttentionPlan) {
        // The stored f16 rows are private to each backend; the attention's output shows them.
        self.inner.kv_store(layer, k, v, plan)
    }
    fn rope_kv_store(
        &self,
        q: &mut B::Buf,
        k: &mut B::Buf,
        v: &B::Buf,
        norm: QkNorm<'_, B::Vector>,
        table: &B::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        mode: RopeMode,
        layer: &mut B::KvLayer,
        plan: &AttentionPlan,
    ) {
        self.inner.rope_kv_store(
            q, k, v, norm, table, n_tokens, n_heads, n_kv_heads, head_dim, mode, layer, plan,
        );
        self.snap("rope_kv_store: q", q, n_tokens * n_heads * head_dim);
        self.snap("rope_kv_store: k", k, n_tokens * n_kv_heads * head_dim);
    }
    fn attention(
        &self,
        q: &B::Buf,
        layer: &B::KvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut B::Buf,
    ) {
        self.inner.attention(
            q, layer, plan, n_heads, n_kv_heads, head_dim, kq_scale, window, out,
        );
        self.snap(
            &format!("attention (window {window:?})"),
            out,
            plan.n_tokens() * n_heads * head_dim,
        );
    }
}

/// The first index where the bits differ, the count of differing values and the largest
/// difference.
fn diff(gpu: &[f32], cpu: &[f32]) -> Option<(usize, usize, f32)> {
    let differing: Vec<usize> = (0..gpu.len().min(cpu.len()))
        .filter(|&i| gpu[i].to_bits() != cpu[i].to_bits())
        .collect();
    let first = *differing.first()?;
    let max = differing
        .iter()
        .map(|&i| (gpu[i] - cpu[i]).abs())
        .fold(0f32, f32::max);
    Some((first, differing.len(), max))
}

/// The greedy choice: the largest logit, the lowest index among equals.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs `batches[..step]` on fresh contexts, then `batches[step]` with every op recorded on both
/// backends, and prints the first op whose output differs.
fn diagnose<G: Backend>(
    cpu: &Model<Trace<CpuBackend>>,
    gpu: &Model<Trace<G>>,
    params: ContextParams,
    batches: &[Batch],
    step: usize,
) -> anyhow::Result<()> {
    let mut cpu_ctx = cpu.new_context(params);
    let mut gpu_ctx = gpu.new_context(params);
    for batch in &batches[..step] {
        cpu.forward(&mut cpu_ctx, batch)?;
        gpu.forward(&mut gpu_ctx, batch)?;
    }
    cpu.backend().start();
    gpu.backend().start();
    let cpu_result = cpu
        .forward(&mut cpu_ctx, &batches[step])
        .map(|l| l.to_vec());
    let cpu_records = cpu.backend().stop();
    let gpu_result = gpu
        .forward(&mut gpu_ctx, &batches[step])
        .map(|l| l.to_vec());
    let gpu_records = gpu.backend().stop();
    cpu_result?;
    gpu_result.context("the GPU forward pass of the traced step failed")?;
    if cpu_records.len() != gpu_records.len() {
        println!(
            "  the traces differ in length: cpu {} ops, gpu {} ops",
            cpu_records.len(),
            gpu_records.len()
        );
    }
    for (c, g) in cpu_records.iter().zip(&gpu_records) {
        if g.values.is_empty() && !c.values.is_empty() {
            println!(
                "  first differing op: {}: the GPU op produced no values",
                c.label
            );
            return Ok(());
        }
        if let Some((i, count, max)) = diff(&g.values, &c.values) {
            println!(
                "  first differing op: {} ({} values): first mismatch at {i}: gpu={:e} ({:#010x}) cpu={:e} ({:#010x}); {count} values differ, max |diff| {max:e}",
                c.label,
                c.values.len(),
                g.values[i],
                g.values[i].to_bits(),
                c.values[i],
                c.values[i].to_bits()
            );
            println!("  (every earlier op of the step gave identical bits; `layer N` counts Q/K/V products, so the residual add that ends layer N and the norm that starts layer N + 1 are labelled layer N)");
            return Ok(());
        }
    }
    println!(
        "  every recorded op of the step gave identical bits on both backends ({} ops): the difference is in what the trace cannot see (the KV cache as stored, or state from an earlier step)",
        cpu_records.len()
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let gguf = Arc::new(
        Gguf::open(&args.model).with_context(|| format!("cannot open {}", args.model.display()))?,
    );
    let hparams = HParams::from_metadata(architecture_of(&gguf)?, gguf.metadata())?;
    if let Some(error) =
        gpu::numerics::reference_unsupported(hparams.head_dim_k, hparams.final_logit_softcap)
            .or_else(|| {
                gpu::numerics::reference_unsupported_recurrent(hparams.has_recurrent_state())
            })
    {
        bail!(error);
    }
    let cpu = Model::from_gguf(
        Arc::clone(&gguf),
        Trace::new(CpuBackend::new(args.threads)?),
        &mut |_, _| {},
    )?;
    println!(
        "cpu: {}, {} threads",
        cpu.backend().describe(),
        args.threads
    );
    if let Some(threads) = args.dry_run {
        let other = CpuBackend::new(threads)?;
        println!("dry run: a CPU backend of {threads} threads in the GPU's place");
        let other = Model::from_gguf(Arc::clone(&gguf), Trace::new(other), &mut |_, _| {})?;
        return check(&args, &hparams, &cpu, &other);
    }
    let device = match args.device {
        DeviceSpec::Gpu(kind, ordinal) => Some((kind, ordinal)),
        DeviceSpec::Auto => None,
        DeviceSpec::Cpu | DeviceSpec::Sim(_) | DeviceSpec::Gpus(..) => bail!(
            "--device: expected one GPU (auto, cuda:N or hip:N), found {}",
            args.device
        ),
    };
    let options = OpenOptions {
        device,
        idle_trim: false,
        numerics: Some(Numerics::Reference),
        reference_threads: Some(args.threads),
        ..OpenOptions::default()
    };
    let opened = gpu::open(gpu::select(&options)?, &options)?;
    println!("gpu: {}", opened.backend.describe());
    let gpu = Model::from_gguf(
        Arc::clone(&gguf),
        Trace::new(opened.backend),
        &mut |_, _| {},
    )?;
    check(&args, &hparams, &cpu, &gpu)
}

/// The prompt and the decode steps on both models, compared step by step.
fn check<G: Backend>(
    args: &Args,
    hparams: &HParams,
    cpu: &Model<Trace<CpuBackend>>,
    gpu: &Model<Trace<G>>,
) -> anyhow::Result<()> {
    let n_vocab = cpu.n_vocab();
    println!(
        "model: {} ({:?}, {} layers, n_embd {}, head size {}, vocab {n_vocab})",
        args.model.display(),
        hparams.architecture,
        hparams.n_layer,
        hparams.n_embd,
        hparams.head_dim_k,
    );

    let prompt: Vec<u32> = match &args.ids {
        Some(ids) => ids.clone(),
        None => (0..args.prompt_len)
            .map(|i| ((i as u64 * 7919 + 17) % n_vocab.max(1) as u64) as u32)
            .collect(),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty: pass --ids or a --prompt-len above 0");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= n_vocab) {
        bail!("prompt id {bad} is outside the vocabulary of {n_vocab} tokens");
    }
    let chunk = args.batch.unwrap_or(prompt.len()).max(1);
    let mut batches: Vec<Batch> = prompt
        .chunks(chunk)
        .enumerate()
        .map(|(i, c)| Batch::for_sequence(0, (i * chunk) as u32, c, false))
        .collect();
    let n_prompt_batches = batches.len();
    let params = ContextParams::with_ctx(prompt.len() + args.steps + 1);
    let mut cpu_ctx = cpu.new_context(params);
    let mut gpu_ctx = gpu.new_context(params);
    let mut decode_time = Duration::ZERO;
    let mut step = 0;
    loop {
        let batch = &batches[step];
        let what = if step < n_prompt_batches {
            format!(
                "prompt batch {} (positions {}..{})",
                step,
                batch.positions[0],
                batch.positions[batch.len() - 1] + 1
            )
        } else {
            format!(
                "decode step {} (position {})",
                step - n_prompt_batches + 1,
                batch.positions[0]
            )
        };
        let cpu_logits = cpu.forward(&mut cpu_ctx, batch)?.to_vec();
        let start = Instant::now();
        let gpu_logits = gpu
            .forward(&mut gpu_ctx, batch)
            .with_context(|| format!("the GPU forward pass of {what} failed"))?
            .to_vec();
        if step >= n_prompt_batches {
            decode_time += start.elapsed();
        }
        let next = argmax(&cpu_logits);
        match diff(&gpu_logits, &cpu_logits) {
            None if gpu_logits.len() == cpu_logits.len() => {
                println!("PASS {what}: logits bit-identical (greedy token {next})");
            }
            found => {
                match found {
                    Some((i, count, max)) => println!(
                        "FAIL {what}: {count} of {} logits differ, max |diff| {max:e}, first at {i}: gpu={:e} cpu={:e}; greedy token gpu {} cpu {next}",
                        cpu_logits.len(),
                        gpu_logits[i],
                        cpu_logits[i],
                        argmax(&gpu_logits)
                    ),
                    None => println!(
                        "FAIL {what}: gpu gave {} logits, cpu {}",
                        gpu_logits.len(),
                        cpu_logits.len()
                    ),
                }
                println!("tracing {what} op by op on both backends:");
                diagnose(cpu, gpu, params, &batches, step)?;
                std::process::exit(1);
            }
        }
        if step + 1 >= n_prompt_batches + args.steps {
            break;
        }
        if step + 1 >= n_prompt_batches {
            let position = prompt.len() + (step + 1 - n_prompt_batches);
            batches.push(Batch::for_sequence(0, position as u32, &[next], false));
        }
        step += 1;
    }
    if args.steps > 0 {
        println!(
            "gpu reference decode: {:.1} tokens/s ({} steps)",
            args.steps as f64 / decode_time.as_secs_f64().max(1e-9),
            args.steps
        );
    }
    println!(
        "exact_forward_check: PASS, {} prompt tokens and {} decode steps bit-identical",
        prompt.len(),
        args.steps
    );
    Ok(())
}
