//! The CPU backend: weights read in place from the GGUF memory map, ops on a rayon thread pool.
//!
//! Matrix products go through `ember-quant` (activations quantized to the weight's dot-product
//! type, as GGML's CPU path does); element-wise ops, normalisation, rotary embedding and attention
//! live here. Work is split across the pool's threads only when there is enough of it to pay for
//! the split, so single-token decoding does not drown in scheduling overhead.

mod attention;
mod delta_net;
mod moe;
mod ops;
pub use ops::{gelu_table, rope_cos_sin};
pub mod vec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ember_gguf::{GgmlType, Gguf, TensorInfo};
use half::f16;
use rayon::prelude::*;

use super::{Backend, BackendError, GatedDeltaNet, MoeFfn, RopeMode, RopeParams, SequenceState};
use crate::ops::AttentionPlan;

/// Rows per rayon task for the cheap row-wise ops; below this a single thread does the work.
const ROWS_PER_TASK: usize = 8;

/// Batches of fewer tokens than this (decode steps) run their products, experts and attention
/// on the backend's [`Team`](ember_quant::team::Team), whose workers stay awake between the
/// step's ops; larger batches, whose ops are long, on the rayon pool.
const TEAM_MAX_TOKENS: usize = 8;

/// `off` runs decode steps on the rayon pool as well (to measure what the team gains).
pub const TEAM_ENV: &str = "EMBER_CPU_TEAM";

/// The CPU backend: a rayon thread pool of a chosen size.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    n_threads: usize,
    /// Quantized-activation buffers reused across matmuls, one per (activation type, row
    /// length), so the forward pass does not allocate them for every matrix product.
    activations: Mutex<HashMap<(GgmlType, usize), ember_quant::QuantizedActivations>>,
    /// Routing and expert buffers of the mixture-of-experts op, reused across layers and passes.
    moe_scratch: Mutex<moe::Scratch>,
    /// Runs [`Backend::matmul_streamed`] (see [`CpuBackend::streaming_weights`]).
    streams: bool,
    /// The threads of decode steps (see [`TEAM_MAX_TOKENS`]); none where its threads could not
    /// be started, and then decode runs on the rayon pool.
    team: Option<ember_quant::team::Team>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

/// The machine's physical core count (hyper-threads share a core's vector units, so llama.cpp
/// also defaults to physical cores), falling back to the logical count.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores_from_cpuinfo().map_or(logical, |p| p.clamp(1, logical))
}

fn physical_cores_from_cpuinfo() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mut cores = std::collections::BTreeSet::new();
    let mut physical_id = None;
    for line in text.lines() {
        let mut parts = line.splitn(2, ':');
        let key = parts.next()?.trim();
        let value = parts.next().map(str::trim);
        match key {
            "physical id" => physical_id = value.and_then(|v| v.parse::<u32>().ok()),
            "core id" => {
                if let Some(core) = value.and_then(|v| v.parse::<u32>().ok()) {
                    cores.insert((physical_id.unwrap_or(0), core));
                }
            }
            _ => {}
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// `out[t * rows + r] = dot(w.row(r), acts.row(t))`. Shapes were checked when the matrix was
/// placed and the buffers are sized by the model code from the same hyperparameters, so this
/// cannot fail on any input file.
fn products(
    w: &ember_quant::QMatrix<'_>,
    acts: &ember_quant::QuantizedActivations,
    out: &mut [f32],
) {
    ember_quant::matmul(w, acts, out).expect("matmul shapes match");
}

impl CpuBackend {
    /// Runs `f` with `x` (`n_tokens` rows of `cols`) quantized to the dot-product type of
    /// weights of type `weight_type`, in a buffer kept for the next call with the same type and
    /// row length, so the forward pass does not allocate one per matrix product.
    fn with_activations<R>(
        &self,
        weight_type: GgmlType,
        cols: usize,
        x: &[f32],
        n_tokens: usize,
        f: impl FnOnce(&ember_quant::QuantizedActivations) -> R,
    ) -> R {
        let vdt = ember_quant::vec_dot_type(weight_type);
        // The forward pass runs its ops from one thread at a time, so the lock is uncontended; a
        // poisoned lock only means an earlier product panicked, and the buffer is rewritten whole.
        let mut buffers = self
            .activations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let acts = match buffers.entry((vdt, cols)) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => entry.insert(
                ember_quant::QuantizedActivations::empty(vdt, cols)
                    .expect("vec_dot_type is an activation type"),
            ),
        };
        acts.requantize(x, n_tokens)
            .expect("activation shape matches the matrix");
        f(acts)
    }

    /// A backend with `n_threads` worker threads (0 means [`physical_cores`]).
    pub fn new(n_threads: usize) -> Result<CpuBackend, rayon::ThreadPoolBuildError> {
        let n_threads = if n_threads == 0 {
            physical_cores()
        } else {
            n_threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads)
            .thread_name(|i| format!("ember-cpu-{i}"))
            .build()?;
        let setting = std::env::var(TEAM_ENV).ok();
        let team = match setting.as_deref() {
            Some("off") => None,
            value => {
                if let Some(other) = value.filter(|v| *v != "on") {
                    tracing::warn!("{TEAM_ENV}={other:?} is neither `on` nor `off`; taken as `on`");
                }
                match ember_quant::team::Team::new(n_threads) {
                    Ok(team) => Some(team),
                    Err(error) => {
                        tracing::warn!(
                            "cannot start the CPU decode threads ({error}); decoding runs on \
                             the pool"
                        );
                        None
                    }
                }
            }
        };
        Ok(CpuBackend {
            pool,
            n_threads,
            activations: Mutex::new(HashMap::new()),
            moe_scratch: Mutex::new(moe::Scratch::default()),
            streams: false,
            team,
        })
    }

    /// Runs `f`, an op over `n_tokens` tokens, on the decode team when the batch is that small.
    fn on_team<R>(&self, n_tokens: usize, f: impl FnOnce() -> R) -> R {
        match &self.team {
            Some(team) if n_tokens < TEAM_MAX_TOKENS => team.enter(f),
            _ => f(),
        }
    }

    /// This backend also runs products with weights it does not hold
    /// ([`Backend::matmul_streamed`], reading them from the file), as a GPU of a partial offload
    /// does: a stand-in for that GPU where a split is checked without one.
    pub fn streaming_weights(mut self) -> CpuBackend {
        self.streams = true;
        self
    }

    /// Worker threads.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }
}

/// A weight matrix read in place from the file mapping, or a stack of equally shaped matrices
/// (the experts of a mixture-of-experts layer, one 3-D tensor).
pub struct CpuMatrix {
    gguf: Arc<Gguf>,
    info: TensorInfo,
    /// Rows of one matrix of the stack.
    rows: usize,
    cols: usize,
    /// Matrices in the stack: 1 for a plain matrix.
    n_stacked: usize,
}

impl CpuMatrix {
    fn data(&self) -> &[u8] {
        self.gguf.tensor_data(&self.info)
    }

    /// All rows of every matrix of the stack.
    fn qmatrix(&self) -> ember_quant::QMatrix<'_> {
        ember_quant::QMatrix::new(
            self.info.ty,
            self.rows * self.n_stacked,
            self.cols,
            self.data(),
        )
        .expect("the matrix's shape and size were checked when it was placed")
    }

    /// Matrix `index` of the stack: a view of its contiguous bytes, nothing copied.
    fn stacked(&self, index: usize) -> ember_quant::QMatrix<'_> {
        let bytes = self.data().len() / self.n_stacked;
        let data = &self.data()[index * bytes..(index + 1) * bytes];
        ember_quant::QMatrix::new(self.info.ty, self.rows, self.cols, data)
            .expect("the stack's shape and size were checked when it was placed")
    }
}

/// Cosine and sine of every rotated pair of every token: `table[t * n_dims + 2 * i]` is the cosine
/// of pair `i` of token `t`, the next value its sine.
pub struct CpuRopeTable {
    n_dims: usize,
    values: Vec<f32>,
}

/// One layer's K and V blocks. Within a block values are head-major (`[head][slot][dim]`) so one
/// head's keys of a block are one contiguous run for the attention loops.
pub struct CpuKvLayer {
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

impl CpuKvLayer {
    /// Blocks the layer's tables reach now (the highest block given memory, plus one).
    #[cfg(test)]
    pub(crate) fn blocks_tracked(&self) -> usize {
        self.k.len()
    }

    fn block_len(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Index, inside a block, of head `head`'s row at `slot_in_block`.
    #[inline]
    fn row_offset(&self, head: usize, slot_in_block: usize) -> usize {
        (head * self.block_size + slot_in_block) * self.head_dim
    }
}

/// Check hook, not used by the engine: this backend's attention ([`Backend::attention`]) on plain
/// data, for programs that hold another implementation to it bit for bit (the GPU's reference
/// numerics mode, engine/examples/exact_attention_check.rs). `k_blocks[b]` and `v_blocks[b]` are
/// physical block `b` of one layer in this backend's layout, `[kv_head][slot][dim]` f16
/// (`plan.block_size * n_kv_heads * head_dim` values; blocks no table reaches may be empty).
/// `plan` is the batch: `positions`, `table_of_token`, `tables` and `block_size` are read, and
/// `slots` only for its length (the token count). `q` is `[n_tokens, n_heads, head_dim]` f32.
/// Runs on a pool of `n_threads` threads, as a backend of that size would (the split of long
/// single-token attention follows it). Returns `[n_tokens, n_heads, head_dim]` f32.
#[allow(clippy::too_many_arguments)]
pub fn attention_reference(
    k_blocks: &[Vec<f16>],
    v_blocks: &[Vec<f16>],
    n_kv_heads: usize,
    head_dim: usize,
    plan: &AttentionPlan,
    q: &[f32],
    n_heads: usize,
    kq_scale: f32,
    window: Option<usize>,
    n_threads: usize,
) -> Result<Vec<f32>, rayon::ThreadPoolBuildError> {
    let layer = CpuKvLayer {
        block_size: plan.block_size,
        n_kv_heads,
        head_dim,
        k: k_blocks.to_vec(),
        v: v_blocks.to_vec(),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n_threads.max(1))
        .build()?;
    let mut out = vec![0f32; plan.n_tokens() * n_heads * head_dim];
    pool.install(|| {
        attention::attention(
            q, &layer, plan, n_heads, n_kv_heads, head_dim, kq_scale, window, &mut out,
        )
    });
    Ok(out)
}

fn check_matrix(info: &TensorInfo) -> Result<(usize, usize), BackendError> {
    if !ember_quant::is_supported(info.ty) {
        return Err(BackendError::UnsupportedType {
            tensor: info.name.clone(),
            ty: info.ty.name().to_string(),
            backend: "cpu",
            supported: supported_types(),
        });
    }
    if info.dims.len() > 2 || info.dims.is_empty() {
        return Err(BackendError::BadTensor {
            tensor: info.name.clone(),
            expected: "a matrix (1 or 2 dimensions)".into(),
            found: format!("dims {:?}", info.dims),
        });
    }
    let cols = info.dims[0] as usize;
    let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
    Ok((rows, cols))
}

/// A matrix (or a stack of `n_stacked` matrices) of `rows` x `cols` read in place, after checking
/// that the file holds exactly its bytes.
fn place(
    gguf: &Arc<Gguf>,
    info: &TensorInfo,
    rows: usize,
    cols: usize,
    n_stacked: usize,
) -> Result<CpuMatrix, BackendError> {
    let matrix = CpuMatrix {
        gguf: Arc::clone(gguf),
        info: info.clone(),
        rows,
        cols,
        n_stacked,
    };
    let total_rows = rows.checked_mul(n_stacked);
    let checked = match total_rows {
        Some(total) => ember_quant::QMatrix::new(info.ty, total, cols, matrix.data())
            .map(|_| ())
            .map_err(|e| e.to_string()),
        None => Err("the row count overflows".to_string()),
    };
    checked.map_err(|found| BackendError::BadTensor {
        tensor: info.name.clone(),
        expected: if n_stacked == 1 {
            format!("{rows} rows of {cols} {} values", info.ty.name())
        } else {
            format!(
                "{n_stacked} matrices of {rows} rows of {cols} {} values",
                info.ty.name()
            )
        },
        found,
    })?;
    Ok(matrix)
}

fn supported_types() -> String {
    GgmlType::ALL
        .iter()
        .filter(|t| ember_quant::is_supported(**t))
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type RopeTable = CpuRopeTable;
    type KvLayer = CpuKvLayer;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<CpuMatrix, BackendError> {
        let (rows, cols) = check_matrix(info)?;
        place(gguf, info, rows, cols, 1)
    }

    fn expert_matrix(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
    ) -> Result<CpuMatrix, BackendError> {
        if !ember_quant::is_supported(info.ty) {
            return Err(BackendError::UnsupportedType {
                tensor: info.name.clone(),
                ty: info.ty.name().to_string(),
                backend: "cpu",
                supported: supported_types(),
            });
        }
        let [cols, rows, n_stacked] = match info.dims[..] {
            [cols, rows, n] if cols > 0 && rows > 0 && n > 0 => {
                [cols as usize, rows as usize, n as usize]
            }
            _ => {
                return Err(BackendError::BadTensor {
                    tensor: info.name.clone(),
                    expected: "a stack of matrices (3 dimensions, none of them 0)".into(),
                    found: format!("dims {:?}", info.dims),
                })
            }
        };
        place(gguf, info, rows, cols, n_stacked)
    }

    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Vec<f32>, BackendError> {
        let (rows, cols) = check_matrix(info)?;
        let mut out = vec![0f32; rows * cols];
        ember_quant::dequantize(info.ty, gguf.tensor_data(info), &mut out).map_err(|e| {
            BackendError::BadTensor {
                tensor: info.name.clone(),
                expected: format!("{} {} values", rows * cols, info.ty.name()),
                found: e.to_string(),
            }
        })?;
        Ok(out)
    }

    fn matrix_private_bytes(&self, _matrix: &CpuMatrix) -> usize {
        0
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn ensure_len(&self, buf: &mut Vec<f32>, len: usize) {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
    }

    fn buf_bytes(&self, buf: &Vec<f32>) -> usize {
        buf.capacity() * std::mem::size_of::<f32>()
    }

    fn gather_rows(&self, src: &Vec<f32>, dim: usize, rows: &[usize], out: &mut Vec<f32>) {
        for (i, &r) in rows.iter().enumerate() {
            out[i * dim..(i + 1) * dim].copy_from_slice(&src[r * dim..(r + 1) * dim]);
        }
    }

    fn write(&self, buf: &mut Vec<f32>, values: &[f32]) {
        buf[..values.len()].copy_from_slice(values);
    }

    fn read(&self, buf: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(&buf[..len]);
    }

    fn argmax_rows(
        &self,
        x: &Vec<f32>,
        n_rows: usize,
        n_cols: usize,
        _scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        out.extend(x[..n_rows * n_cols].chunks_exact(n_cols.max(1)).map(|row| {
            if crate::sample::logits_are_sane(row) {
                crate::sample::greedy_token(row)
            } else {
                crate::sample::NON_FINITE_ROW
            }
        }));
    }

    fn get_rows(&self, table: &CpuMatrix, ids: &[u32], scale: f32, out: &mut Vec<f32>) {
        let cols = table.cols;
        let q = table.qmatrix();
        out[..ids.len() * cols]
            .par_chunks_mut(cols)
            .with_min_len(ROWS_PER_TASK)
            .zip(ids)
            .for_each(|(row, &id)| {
                q.dequantize_row(id as usize, row)
                    .expect("token ids are checked against the vocabulary before the forward pass");
                if scale != 1.0 {
                    row.iter_mut().for_each(|x| *x *= scale);
                }
            });
    }

    fn streams_weights(&self) -> bool {
        self.streams
    }

    fn matmul_streamed(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
        x: &Vec<f32>,
        n_tokens: usize,
        out: &mut Vec<f32>,
    ) -> bool {
        if !self.streams {
            return false;
        }
        match self.matrix(gguf, info) {
            Ok(w) => {
                self.matmul(&w, x, n_tokens, out);
                true
            }
            Err(error) => {
                tracing::debug!(tensor = %info.name, %error, "a streamed weight runs where it lives");
                false
            }
        }
    }

    fn matmul(&self, w: &CpuMatrix, x: &Vec<f32>, n_tokens: usize, out: &mut Vec<f32>) {
        let q = w.qmatrix();
        let out = &mut out[..n_tokens * q.rows];
        self.with_activations(q.ty, q.cols, &x[..n_tokens * q.cols], n_tokens, |acts| {
            self.on_team(n_tokens, || products(&q, acts, out))
        });
    }

    fn moe_router(&self, router: &CpuMatrix, x: &Vec<f32>, n_tokens: usize, out: &mut Vec<f32>) {
        if router.info.ty == GgmlType::F32 {
            self.on_team(n_tokens, || moe::router_f32(router, x, n_tokens, out));
        } else {
            self.matmul(router, x, n_tokens, out);
        }
    }

    fn moe_ffn(
        &self,
        moe: &MoeFfn<'_, CpuMatrix>,
        router_logits: &Vec<f32>,
        x: &Vec<f32>,
        n_tokens: usize,
        out: &mut Vec<f32>,
    ) {
        // A decode step's experts are a dozen small products per layer: on the team.
        self.on_team(n_tokens, || {
            moe::moe_ffn(self, moe, router_logits, x, n_tokens, out)
        });
    }

    fn op_scratch_bytes(&self) -> usize {
        let activations: usize = self
            .activations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .map(ember_quant::QuantizedActivations::bytes)
            .sum();
        let moe = self
            .moe_scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .bytes();
        activations + moe
    }

    fn release_op_scratch(&self) {
        *self
            .moe_scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = moe::Scratch::default();
    }

    fn linear_attention_supported(&self) -> bool {
        true
    }

    fn split_query_gate(
        &self,
        q_full: &Vec<f32>,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        q: &mut Vec<f32>,
        gate: &mut Vec<f32>,
    ) {
        let width = n_heads * head_dim;
        for t in 0..n_tokens {
            for h in 0..n_heads {
                let src = &q_full[(t * n_heads + h) * 2 * head_dim..][..2 * head_dim];
                let dst = (t * width + h * head_dim)..(t * width + (h + 1) * head_dim);
                q[dst.clone()].copy_from_slice(&src[..head_dim]);
                gate[dst].copy_from_slice(&src[head_dim..]);
            }
        }
    }

    fn mul_sigmoid(&self, x: &mut Vec<f32>, gate: &Vec<f32>, len: usize) {
        ops::par_zip(&mut x[..len], &gate[..len], |v, g| {
            *v *= delta_net::sigmoid(g)
        });
    }

    fn gated_delta_net(
        &self,
        op: &GatedDeltaNet<'_, Vec<f32>>,
        qkv: &Vec<f32>,
        z: &Vec<f32>,
        beta: &Vec<f32>,
        alpha: &Vec<f32>,
        states: &mut [SequenceState<'_, Vec<f32>>],
        out: &mut Vec<f32>,
    ) {
        let (conv_len, ssm_len) = (op.conv_state_len(), op.ssm_state_len());
        let mut parts: Vec<delta_net::SequenceState<'_>> = states
            .iter_mut()
            .map(|s| {
                let (conv, ssm) =
                    s.state[s.offset..s.offset + conv_len + ssm_len].split_at_mut(conv_len);
                delta_net::SequenceState {
                    rows: s.rows,
                    conv,
                    ssm,
                }
            })
            .collect();
        delta_net::gated_delta_net(op, qkv, z, beta, alpha, &mut parts, out);
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        out[..n_rows * dim]
            .par_chunks_mut(dim)
            .with_min_len(ROWS_PER_TASK)
            .zip(x[..n_rows * dim].par_chunks(dim))
            .for_each(|(o, r)| ops::rms_norm_row(r, weight, eps, o));
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Vec<f32>,
        weight: &Vec<f32>,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) {
        x[..n_rows * dim]
            .par_chunks_mut(dim)
            .with_min_len(ROWS_PER_TASK)
            .for_each(|r| ops::rms_norm_row_inplace(r, weight, eps));
    }

    fn has_gemma4_ops(&self) -> bool {
        true
    }

    fn rms_norm_unit_inplace(&self, x: &mut Vec<f32>, n_rows: usize, dim: usize, eps: f32) {
        x[..n_rows * dim]
            .par_chunks_mut(dim)
            .with_min_len(ROWS_PER_TASK)
            .for_each(|r| ops::rms_norm_row_unit_inplace(r, eps));
    }

    fn mul_rows_inplace(&self, x: &mut Vec<f32>, weight: &Vec<f32>, n_rows: usize, dim: usize) {
        x[..n_rows * dim]
            .par_chunks_mut(dim)
            .with_min_len(ROWS_PER_TASK)
            .for_each(|r| r.iter_mut().zip(weight).for_each(|(v, w)| *v *= w));
    }

    fn add_inplace(&self, dst: &mut Vec<f32>, src: &Vec<f32>, len: usize) {
        ops::par_zip(&mut dst[..len], &src[..len], |d, s| *d += s);
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, n_rows: usize, dim: usize) {
        x[..n_rows * dim]
            .chunks_mut(dim)
            .for_each(|r| r.iter_mut().zip(bias).for_each(|(v, b)| *v += b));
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, scale: f32) {
        x[..len].iter_mut().for_each(|v| *v *= scale);
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) {
        ops::par_chunks(&mut gate[..len], &up[..len], vec::swiglu_ggml);
    }

    fn geglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize) {
        let table = ops::gelu_table();
        ops::par_zip(&mut gate[..len], &up[..len], |g, u| {
            *g = ops::gelu_ggml(table, *g) * u
        });
    }

    fn softcap(&self, x: &mut Vec<f32>, len: usize, cap: f32) {
        x[..len]
            .iter_mut()
            .for_each(|v| *v = cap * (*v * (1.0 / cap)).tanh());
    }

    fn rope_table_new(&self) -> CpuRopeTable {
        CpuRopeTable {
            n_dims: 0,
            values: Vec::new(),
        }
    }

    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut CpuRopeTable) {
        table.n_dims = params.n_dims;
        ops::rope_cos_sin(positions, params, &mut table.values);
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        table: &CpuRopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    ) {
        let row_len = n_heads * head_dim;
        let n_dims = table.n_dims;
        x[..n_tokens * row_len]
            .par_chunks_mut(row_len)
            .with_min_len(ROWS_PER_TASK)
            .zip(table.values.par_chunks(n_dims))
            .for_each(|(row, cs)| {
                for head in row.chunks_mut(head_dim) {
                    ops::rope_head(head, cs, n_dims, mode);
                }
            });
    }

    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> CpuKvLayer {
        CpuKvLayer {
            block_size,
            n_kv_heads,
            head_dim,
            // Grown by `kv_materialize` as blocks are first used: block ids are handed out lowest
            // first, so the tables follow the tokens cached, not `max_blocks`.
            k: Vec::with_capacity(max_blocks.min(64)),
            v: Vec::with_capacity(max_blocks.min(64)),
        }
    }

    fn kv_materialize(&self, layer: &mut CpuKvLayer, blocks: &[u32]) {
        let len = layer.block_len();
        for &b in blocks {
            for store in [&mut layer.k, &mut layer.v] {
                if store.len() <= b as usize {
                    store.resize_with(b as usize + 1, Vec::new);
                }
                let block = &mut store[b as usize];
                if block.len() != len {
                    *block = vec![f16::ZERO; len];
                }
            }
        }
    }

    fn kv_release(&self, layer: &mut CpuKvLayer, blocks: &[u32]) {
        for &b in blocks {
            for store in [&mut layer.k, &mut layer.v] {
                if let Some(block) = store.get_mut(b as usize) {
                    *block = Vec::new();
                }
            }
        }
    }

    fn kv_bytes(&self, layer: &CpuKvLayer) -> usize {
        layer.k.iter().chain(&layer.v).map(|b| b.len() * 2).sum()
    }

    fn kv_store(&self, layer: &mut CpuKvLayer, k: &Vec<f32>, v: &Vec<f32>, plan: &AttentionPlan) {
        let (n_heads, head_dim, block_size) = (layer.n_kv_heads, layer.head_dim, layer.block_size);
        let row_len = n_heads * head_dim;
        for (t, &slot) in plan.slots.iter().enumerate() {
            let (block, in_block) = (slot as usize / block_size, slot as usize % block_size);
            for h in 0..n_heads {
                let off = layer.row_offset(h, in_block);
                let src = t * row_len + h * head_dim;
                half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                    &mut layer.k[block][off..off + head_dim],
                    &k[src..src + head_dim],
                );
                half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                    &mut layer.v[block][off..off + head_dim],
                    &v[src..src + head_dim],
                );
            }
        }
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        layer: &CpuKvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut Vec<f32>,
    ) {
        self.on_team(plan.n_tokens(), || {
            attention::attention(
                q, layer, plan, n_heads, n_kv_heads, head_dim, kq_scale, window, out,
            )
        });
    }
}
