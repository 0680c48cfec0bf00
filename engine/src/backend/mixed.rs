//! One device of a split that may be either of two backend types: the CPU and a GPU in a
//! partial offload (`-ngl N` below the layer count), as one [`Backend`] a
//! [`super::split::SplitBackend`] can hold a list of.
//!
//! Each op forwards to the device's own backend (every op keeps its one implementation); its
//! weights and buffers are of that device's type, which the split guarantees by moving every
//! buffer to the device of the op before calling it. The single-device paths never go through
//! this type.

use std::sync::Arc;

use ember_gguf::{Gguf, TensorInfo};

use super::{Backend, BackendError, MoeFfn, OpFailure, QkNorm, SharedExpert};
use crate::batch::Batch;
use crate::ops::{AttentionPlan, FfnActivation, RopeMode, RopeParams};

/// A value of the first or of the second backend type: a device, or one of its weights,
/// buffers, rotary tables or KV layers.
pub enum OneOf<A, B> {
    First(A),
    Second(B),
}

/// Which side of a [`OneOf`] an op runs on, so one op body serves both.
trait Side {
    type Of<A, B>;
    fn get<A, B>(x: &OneOf<A, B>) -> &Self::Of<A, B>;
    fn get_mut<A, B>(x: &mut OneOf<A, B>) -> &mut Self::Of<A, B>;
    fn wrap<A, B>(x: Self::Of<A, B>) -> OneOf<A, B>;
}

/// A split moves every buffer to the device of an op before calling it, so a value of the
/// other type here is a bug in the split.
const MISMATCH: &str = "a split passes an op only values of the device it runs on";

struct FirstSide;
struct SecondSide;

impl Side for FirstSide {
    type Of<A, B> = A;
    fn get<A, B>(x: &OneOf<A, B>) -> &A {
        match x {
            OneOf::First(a) => a,
            OneOf::Second(_) => unreachable!("{MISMATCH}"),
        }
    }
    fn get_mut<A, B>(x: &mut OneOf<A, B>) -> &mut A {
        match x {
            OneOf::First(a) => a,
            OneOf::Second(_) => unreachable!("{MISMATCH}"),
        }
    }
    fn wrap<A, B>(x: A) -> OneOf<A, B> {
        OneOf::First(x)
    }
}

impl Side for SecondSide {
    type Of<A, B> = B;
    fn get<A, B>(x: &OneOf<A, B>) -> &B {
        match x {
            OneOf::Second(b) => b,
            OneOf::First(_) => unreachable!("{MISMATCH}"),
        }
    }
    fn get_mut<A, B>(x: &mut OneOf<A, B>) -> &mut B {
        match x {
            OneOf::Second(b) => b,
            OneOf::First(_) => unreachable!("{MISMATCH}"),
        }
    }
    fn wrap<A, B>(x: B) -> OneOf<A, B> {
        OneOf::Second(x)
    }
}

/// `on!(self, |device, S| body)`: runs `body` with `device` the backend of whichever side
/// `self` is and `S` that side (`S::get(buf)` is then the buffer of the device's type).
macro_rules! on {
    ($self:expr, |$d:ident, $s:ident| $body:expr) => {
        match $self {
            OneOf::First($d) => {
                #[allow(dead_code)]
                type $s = FirstSide;
                $body
            }
            OneOf::Second($d) => {
                #[allow(dead_code)]
                type $s = SecondSide;
                $body
            }
        }
    };
}

impl<A: Backend, B: Backend> Backend for OneOf<A, B> {
    type Buf = OneOf<A::Buf, B::Buf>;
    type Matrix = OneOf<A::Matrix, B::Matrix>;
    type Vector = OneOf<A::Vector, B::Vector>;
    type RopeTable = OneOf<A::RopeTable, B::RopeTable>;
    type KvLayer = OneOf<A::KvLayer, B::KvLayer>;

    fn name(&self) -> &'static str {
        on!(self, |d, S| d.name())
    }

    fn describe(&self) -> String {
        on!(self, |d, S| d.describe())
    }

    fn take_failure(&self) -> Option<OpFailure> {
        on!(self, |d, S| d.take_failure())
    }

    fn begin_forward(&self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        on!(self, |d, S| d.begin_forward(batch, plan, out_rows))
    }

    fn end_forward(&self) -> bool {
        on!(self, |d, S| d.end_forward())
    }

    fn layer_done(&self, layer: usize, n_layers: usize) {
        on!(self, |d, S| d.layer_done(layer, n_layers))
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        on!(self, |d, S| d.install(f))
    }

    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Matrix, BackendError> {
        on!(self, |d, S| d.matrix(gguf, info).map(S::wrap))
    }

    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Vector, BackendError> {
        on!(self, |d, S| d.vector(gguf, info).map(S::wrap))
    }

    fn matrix_private_bytes(&self, matrix: &Self::Matrix) -> usize {
        on!(self, |d, S| d.matrix_private_bytes(S::get(matrix)))
    }

    fn expert_matrix(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
    ) -> Result<Self::Matrix, BackendError> {
        on!(self, |d, S| d.expert_matrix(gguf, info).map(S::wrap))
    }

    fn release_op_scratch(&self) {
        on!(self, |d, S| d.release_op_scratch())
    }

    fn op_scratch_bytes(&self) -> usize {
        on!(self, |d, S| d.op_scratch_bytes())
    }

    fn alloc(&self, len: usize) -> Self::Buf {
        on!(self, |d, S| S::wrap(d.alloc(len)))
    }

    fn ensure_len(&self, buf: &mut Self::Buf, len: usize) {
        on!(self, |d, S| d.ensure_len(S::get_mut(buf), len))
    }

    fn buf_bytes(&self, buf: &Self::Buf) -> usize {
        on!(self, |d, S| d.buf_bytes(S::get(buf)))
    }

    fn gather_rows(&self, src: &Self::Buf, dim: usize, rows: &[usize], out: &mut Self::Buf) {
        on!(self, |d, S| d.gather_rows(
            S::get(src),
            dim,
            rows,
            S::get_mut(out)
        ))
    }

    fn write(&self, buf: &mut Self::Buf, values: &[f32]) {
        on!(self, |d, S| d.write(S::get_mut(buf), values))
    }

    fn read(&self, buf: &Self::Buf, len: usize, out: &mut Vec<f32>) {
        on!(self, |d, S| d.read(S::get(buf), len, out))
    }

    fn argmax_rows(
        &self,
        x: &Self::Buf,
        n_rows: usize,
        n_cols: usize,
        scratch: &mut Self::Buf,
        out: &mut Vec<u32>,
    ) {
        on!(self, |d, S| d.argmax_rows(
            S::get(x),
            n_rows,
            n_cols,
            S::get_mut(scratch),
            out
        ))
    }

    fn get_rows(&self, table: &Self::Matrix, ids: &[u32], scale: f32, out: &mut Self::Buf) {
        on!(self, |d, S| d.get_rows(
            S::get(table),
            ids,
            scale,
            S::get_mut(out)
        ))
    }

    fn streams_weights(&self) -> bool {
        on!(self, |d, S| d.streams_weights())
    }

    fn copy_from_peer(
        &self,
        from: &Self,
        src: &Self::Buf,
        dst: &mut Self::Buf,
        len: usize,
    ) -> Result<bool, String> {
        match (self, from, src, dst) {
            (OneOf::First(a), OneOf::First(from), OneOf::First(src), OneOf::First(dst)) => {
                a.copy_from_peer(from, src, dst, len)
            }
            (OneOf::Second(b), OneOf::Second(from), OneOf::Second(src), OneOf::Second(dst)) => {
                b.copy_from_peer(from, src, dst, len)
            }
            // Between the two types (the CPU and a GPU) there is no peer path.
            _ => Ok(false),
        }
    }

    fn matmul_streamed(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) -> bool {
        on!(self, |d, S| d.matmul_streamed(
            gguf,
            info,
            S::get(x),
            n_tokens,
            S::get_mut(out)
        ))
    }

    fn matmul(&self, w: &Self::Matrix, x: &Self::Buf, n_tokens: usize, out: &mut Self::Buf) {
        on!(self, |d, S| d.matmul(
            S::get(w),
            S::get(x),
            n_tokens,
            S::get_mut(out)
        ))
    }

    fn matmul_shared(
        &self,
        ws: &[&Self::Matrix],
        x: &Self::Buf,
        n_tokens: usize,
        outs: &mut [&mut Self::Buf],
    ) {
        on!(self, |d, S| {
            let ws: Vec<_> = ws.iter().map(|w| S::get(w)).collect();
            let mut outs: Vec<_> = outs.iter_mut().map(|o| S::get_mut(o)).collect();
            d.matmul_shared(&ws, S::get(x), n_tokens, &mut outs)
        })
    }

    fn ffn_gate_up(
        &self,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        n_ff: usize,
        activation: FfnActivation,
        gate: &mut Self::Buf,
        up: &mut Self::Buf,
    ) {
        on!(self, |d, S| d.ffn_gate_up(
            S::get(w_gate),
            S::get(w_up),
            S::get(x),
            n_tokens,
            n_ff,
            activation,
            S::get_mut(gate),
            S::get_mut(up),
        ))
    }

    fn moe_router(
        &self,
        router: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        on!(self, |d, S| d.moe_router(
            S::get(router),
            S::get(x),
            n_tokens,
            S::get_mut(out)
        ))
    }

    fn moe_ffn(
        &self,
        moe: &MoeFfn<'_, Self::Matrix>,
        router_logits: &Self::Buf,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        on!(self, |d, S| {
            let inner = MoeFfn {
                gate: S::get(moe.gate),
                up: S::get(moe.up),
                down: S::get(moe.down),
                n_ff: moe.n_ff,
                activation: moe.activation,
                routing: moe.routing,
                expert_scale: moe.expert_scale,
                shared: moe.shared.as_ref().map(|s| SharedExpert {
                    gate: S::get(s.gate),
                    up: S::get(s.up),
                    down: S::get(s.down),
                    n_ff: s.n_ff,
                    gate_inp: s.gate_inp.map(S::get),
                }),
            };
            d.moe_ffn(
                &inner,
                S::get(router_logits),
                S::get(x),
                n_tokens,
                S::get_mut(out),
            )
        })
    }

    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        on!(self, |d, S| d.rms_norm(
            S::get(x),
            S::get(weight),
            n_rows,
            dim,
            eps,
            S::get_mut(out)
        ))
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) {
        on!(self, |d, S| d.rms_norm_inplace(
            S::get_mut(x),
            S::get(weight),
            n_rows,
            dim,
            eps
        ))
    }

    fn max_head_dim(&self) -> Option<usize> {
        on!(self, |d, S| d.max_head_dim())
    }

    fn has_gemma4_ops(&self) -> bool {
        on!(self, |d, S| d.has_gemma4_ops())
    }

    fn rms_norm_unit_inplace(&self, x: &mut Self::Buf, n_rows: usize, dim: usize, eps: f32) {
        on!(self, |d, S| d.rms_norm_unit_inplace(
            S::get_mut(x),
            n_rows,
            dim,
            eps
        ))
    }

    fn mul_rows_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
    ) {
        on!(self, |d, S| d.mul_rows_inplace(
            S::get_mut(x),
            S::get(weight),
            n_rows,
            dim
        ))
    }

    fn add_inplace(&self, dst: &mut Self::Buf, src: &Self::Buf, len: usize) {
        on!(self, |d, S| d.add_inplace(
            S::get_mut(dst),
            S::get(src),
            len
        ))
    }

    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        proj: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        on!(self, |d, S| d.add_rms_norm(
            S::get_mut(x),
            S::get(proj),
            S::get(weight),
            n_rows,
            dim,
            eps,
            S::get_mut(out),
        ))
    }

    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Vector, n_rows: usize, dim: usize) {
        on!(self, |d, S| d.add_bias(
            S::get_mut(x),
            S::get(bias),
            n_rows,
            dim
        ))
    }

    fn scale(&self, x: &mut Self::Buf, len: usize, scale: f32) {
        on!(self, |d, S| d.scale(S::get_mut(x), len, scale))
    }

    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) {
        on!(self, |d, S| d.swiglu(S::get_mut(gate), S::get(up), len))
    }

    fn geglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) {
        on!(self, |d, S| d.geglu(S::get_mut(gate), S::get(up), len))
    }

    fn softcap(&self, x: &mut Self::Buf, len: usize, cap: f32) {
        on!(self, |d, S| d.softcap(S::get_mut(x), len, cap))
    }

    fn rope_table_new(&self) -> Self::RopeTable {
        on!(self, |d, S| S::wrap(d.rope_table_new()))
    }

    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut Self::RopeTable) {
        on!(self, |d, S| d.rope_table(
            positions,
            params,
            S::get_mut(table)
        ))
    }

    fn rope(
        &self,
        x: &mut Self::Buf,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    ) {
        on!(self, |d, S| d.rope(
            S::get_mut(x),
            S::get(table),
            n_tokens,
            n_heads,
            head_dim,
            mode
        ))
    }

    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self::KvLayer {
        on!(self, |d, S| S::wrap(
            d.kv_layer(max_blocks, block_size, n_kv_heads, head_dim)
        ))
    }

    fn kv_materialize(&self, layer: &mut Self::KvLayer, blocks: &[u32]) {
        on!(self, |d, S| d.kv_materialize(S::get_mut(layer), blocks))
    }

    fn kv_release(&self, layer: &mut Self::KvLayer, blocks: &[u32]) {
        on!(self, |d, S| d.kv_release(S::get_mut(layer), blocks))
    }

    fn kv_bytes(&self, layer: &Self::KvLayer) -> usize {
        on!(self, |d, S| d.kv_bytes(S::get(layer)))
    }

    fn kv_store(
        &self,
        layer: &mut Self::KvLayer,
        k: &Self::Buf,
        v: &Self::Buf,
        plan: &AttentionPlan,
    ) {
        on!(self, |d, S| d.kv_store(
            S::get_mut(layer),
            S::get(k),
            S::get(v),
            plan
        ))
    }

    fn rope_kv_store(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        norm: QkNorm<'_, Self::Vector>,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        mode: RopeMode,
        layer: &mut Self::KvLayer,
        plan: &AttentionPlan,
    ) {
        on!(self, |d, S| d.rope_kv_store(
            S::get_mut(q),
            S::get_mut(k),
            S::get(v),
            norm.map(|w| S::get(w)),
            S::get(table),
            n_tokens,
            n_heads,
            n_kv_heads,
            head_dim,
            mode,
            S::get_mut(layer),
            plan,
        ))
    }

    fn attention(
        &self,
        q: &Self::Buf,
        layer: &Self::KvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut Self::Buf,
    ) {
        on!(self, |d, S| d.attention(
            S::get(q),
            S::get(layer),
            plan,
            n_heads,
            n_kv_heads,
            head_dim,
            kq_scale,
            window,
            S::get_mut(out),
        ))
    }
}

#[cfg(test)]
mod tests {
    //! Partial offload's split over two backend types computes what one device computes: over
    //! two CPU backends seen as the two sides of [`OneOf`], the logits are bit-identical to
    //! one CPU at every -ngl (the op dispatch and the boundary crossings change no value). With
    //! a GPU backend on the host driver as the second side, each -ngl puts exactly the last
    //! layers' weights (and the output layer's when all fit) in the GPU's pool, and each
    //! device's KV cache holds its own layers. (The host driver runs no model kernels, so a
    //! GPU forward pass is checked on the GPU: `scripts/gpu/split.sh`.)

    use std::path::Path;
    use std::sync::Arc;

    use ember_gguf::Gguf;
    use ember_gpu::host::{HostDriver, HostDriverConfig};
    use ember_gpu::kernels::KernelLibrary;
    use ember_gpu::ops::{GpuContext, GpuContextOptions};
    use ember_gpu::{DevicePool, Driver, PoolConfig, PoolKind};
    use ember_synth::{write_model, Shape, ShapeOverrides, SynthOptions, TypeSpec};

    use super::OneOf;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::gpu::GpuBackend;
    use crate::backend::split::{SplitBackend, SplitLayout};
    use crate::backend::Backend;
    use crate::batch::Batch;
    use crate::load::{offload_split, plan_bytes};
    use crate::load_plan::{LoadPlan, PlanDevice, PlanOptions, SplitMode, Target};
    use crate::model::{architecture_of, ContextParams, HParams, Model};

    const LAYERS: usize = 5;

    fn synth(dir: &Path, shape_name: &str, ty: &str) -> Arc<Gguf> {
        let mut shape = Shape::named(shape_name).unwrap();
        let overrides = ShapeOverrides {
            layers: Some(LAYERS),
            vocab: Some(512),
            embd: Some(256),
            heads: Some(4),
            kv_heads: Some(2),
            head_dim: Some(64),
            ff: Some(512),
            ..ShapeOverrides::default()
        };
        overrides.apply(&mut shape).unwrap();
        let path = dir.join(format!("{shape_name}-{ty}.gguf"));
        let opts = SynthOptions {
            shape,
            types: TypeSpec::parse(ty).unwrap(),
            pure: false,
            seed: 9,
            fast: false,
        };
        write_model(&opts, &path, |_| {}).unwrap();
        Arc::new(Gguf::open(&path).unwrap())
    }

    fn hparams(gguf: &Gguf) -> HParams {
        HParams::from_metadata(architecture_of(gguf).unwrap(), gguf.metadata()).unwrap()
    }

    /// The plan of `-ngl ngl` on one GPU with room for everything.
    fn plan(gguf: &Gguf, ngl: usize) -> LoadPlan {
        let devices = [PlanDevice {
            name: "gpu".into(),
            available: 1 << 40,
        }];
        let options = PlanOptions {
            gpu_layers: Some(ngl),
            split_mode: SplitMode::Layer,
            tensor_split: None,
            main_gpu: 0,
        };
        LoadPlan::new(&plan_bytes(gguf, &hparams(gguf)), &devices, &options).unwrap()
    }

    fn device_of(target: Target) -> usize {
        match target {
            Target::Cpu => 0,
            Target::Gpu(_) => 1,
        }
    }

    /// Logits of a prefill of 9 tokens (every row) and 3 decode steps, as bits.
    fn run<B: Backend>(model: &Model<B>) -> Vec<Vec<u32>> {
        let n_vocab = model.n_vocab() as u32;
        let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % n_vocab).collect();
        let mut ctx = model.new_context(ContextParams::with_ctx(32));
        let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        let mut out = vec![bits(
            model
                .forward(&mut ctx, &Batch::for_sequence(0, 0, &prompt, true))
                .unwrap(),
        )];
        for step in 0..3u32 {
            let token = (step * 101 + 7) % n_vocab;
            let pos = prompt.len() as u32 + step;
            out.push(bits(
                model
                    .forward(&mut ctx, &Batch::for_sequence(0, pos, &[token], false))
                    .unwrap(),
            ));
        }
        out
    }

    /// The model on one CPU backend: the reference of the splits.
    fn one_cpu(gguf: &Arc<Gguf>) -> Model<CpuBackend> {
        Model::from_gguf(
            Arc::clone(gguf),
            CpuBackend::new(2).unwrap(),
            &mut |_, _| {},
        )
        .unwrap()
    }

    /// The split of `plan` over the CPU and `second` (a CPU backend standing in for the GPU).
    fn two_cpu_split(
        gguf: &Gguf,
        plan: &LoadPlan,
        second: CpuBackend,
    ) -> SplitBackend<OneOf<CpuBackend, CpuBackend>> {
        let layer_device: Vec<usize> = plan.layers.iter().map(|&t| device_of(t)).collect();
        SplitBackend::new(
            vec![
                OneOf::First(CpuBackend::new(2).unwrap()),
                OneOf::Second(second),
            ],
            vec!["cpu".into(), "gpu".into()],
            SplitLayout::for_model(&hparams(gguf), layer_device, device_of(plan.output)),
            None,
            Vec::new(),
        )
    }

    #[test]
    fn cpu_and_second_backend_split_gives_bit_identical_logits_at_every_ngl() {
        let dir = tempfile::tempdir().unwrap();
        for (shape, ty) in [("llama3.2-1b", "q4_k_m"), ("qwen3-0.6b", "q8_0")] {
            let gguf = synth(dir.path(), shape, ty);
            let expected = run(&one_cpu(&gguf));
            for ngl in 1..=LAYERS {
                let plan = plan(&gguf, ngl);
                let layer_device: Vec<usize> = plan.layers.iter().map(|&t| device_of(t)).collect();
                assert_eq!(
                    layer_device.iter().filter(|&&d| d == 1).count(),
                    ngl,
                    "{plan:?}"
                );
                assert!(
                    layer_device[LAYERS - ngl..].iter().all(|&d| d == 1),
                    "the last layers go to the GPU: {plan:?}"
                );
                assert_eq!(device_of(plan.output) == 1, ngl == LAYERS, "{plan:?}");
                let backend = two_cpu_split(&gguf, &plan, CpuBackend::new(2).unwrap());
                let model = Model::from_gguf(Arc::clone(&gguf), backend, &mut |_, _| {}).unwrap();
                assert!(
                    run(&model) == expected,
                    "{shape} {ty} -ngl {ngl}: the split differs from one device"
                );
                // The plan counted each device's weights as the split placed them (the
                // embedding with the output layer).
                let planned: Vec<u64> = plan.shares.iter().map(|s| s.weights).collect();
                assert_eq!(
                    model.backend().weight_bytes_per_device(),
                    planned,
                    "{shape} {ty} -ngl {ngl}"
                );
                // Activations cross at the boundary, through host memory; with every layer and
                // the output on the GPU (the embedding table with them) nothing crosses.
                let stats = model.backend().transfer_stats();
                assert_eq!(stats.staged_copies > 0, ngl < LAYERS, "{stats:?}");
                assert_eq!(stats.peer_copies, 0, "{stats:?}");
            }
        }
    }

    /// A prompt's products with the CPU's weights run on the device that streams weights (a
    /// GPU of a partial offload, here a CPU backend standing in for one), with the same logits
    /// as one device; decode steps and batches under the threshold read the weights where they
    /// are.
    #[test]
    fn prompt_products_of_the_cpus_layers_stream_to_the_second_device() {
        let dir = tempfile::tempdir().unwrap();
        for (shape, ty) in [("llama3.2-1b", "q4_k_m"), ("qwen3-0.6b", "q8_0")] {
            let gguf = synth(dir.path(), shape, ty);
            let expected = run(&one_cpu(&gguf));
            for (ngl, min_tokens) in [(2, 4), (LAYERS - 1, 9), (2, 10), (LAYERS, 4)] {
                let plan = plan(&gguf, ngl);
                let backend = two_cpu_split(
                    &gguf,
                    &plan,
                    CpuBackend::new(2).unwrap().streaming_weights(),
                )
                .with_stream_min_tokens(min_tokens);
                let model = Model::from_gguf(Arc::clone(&gguf), backend, &mut |_, _| {}).unwrap();
                assert!(
                    run(&model) == expected,
                    "{shape} {ty} -ngl {ngl}, streaming from {min_tokens} tokens: the split differs from one device"
                );
                let streamed = model.backend().streamed_products();
                // The 9-token prompt streams each of the CPU's products (its layers' and the
                // output's) when 9 reaches the threshold; with every weight on the second
                // device there is nothing to stream.
                let cpu_layers = LAYERS - ngl;
                if min_tokens <= 9 && ngl < LAYERS {
                    // q, k, v, o, gate, up, down per layer, and the output.
                    assert_eq!(
                        streamed,
                        7 * cpu_layers as u64 + 1,
                        "{shape} {ty} -ngl {ngl}"
                    );
                } else {
                    assert_eq!(streamed, 0, "{shape} {ty} -ngl {ngl}, from {min_tokens}");
                }
            }
        }
    }

    fn host_gpu() -> GpuBackend {
        host_gpu_on(Arc::new(HostDriver::new(HostDriverConfig::default())))
    }

    fn host_gpu_on(driver: Arc<dyn Driver>) -> GpuBackend {
        let pool = DevicePool::with_kind(
            driver,
            0,
            PoolKind::Caching,
            "offload test".to_string(),
            PoolConfig::default(),
        )
        .unwrap();
        let kernels = Arc::new(KernelLibrary::new(std::env::temp_dir()));
        let ctx = GpuContext::with_options(
            Arc::new(pool),
            kernels,
            &GpuContextOptions { disable_blas: true },
        )
        .unwrap();
        GpuBackend::new(ctx, "host", "host test device".into(), false)
    }

    #[test]
    fn an_offload_whose_gpu_weights_are_in_host_memory_is_refused_naming_the_gpu() {
        use ember_gpu::driver::MemoryType;

        use crate::device::DeviceOptions;
        use crate::load::{check_placement, LoadError, LoadEvent};

        let dir = tempfile::tempdir().unwrap();
        let gguf = synth(dir.path(), "llama3.2-1b", "q4_k_m");
        let path = dir.path().join("model.gguf");
        for (memory_type, allow_host_weights) in [
            (MemoryType::Device, false),
            (MemoryType::Host, false),
            (MemoryType::Host, true),
        ] {
            let driver: Arc<dyn Driver> = Arc::new(HostDriver::new(HostDriverConfig {
                reported_memory_type: memory_type,
                ..HostDriverConfig::default()
            }));
            let free_before = driver.mem_info(0).unwrap().free;
            let backend = offload_split(
                CpuBackend::new(2).unwrap(),
                host_gpu_on(Arc::clone(&driver)),
                "host:1",
                &hparams(&gguf),
                &plan(&gguf, 2),
            );
            let model = Model::from_gguf(Arc::clone(&gguf), backend, &mut |_, _| {}).unwrap();
            let OneOf::Second(gpu) = &model.backend().devices()[1] else {
                panic!("device 1 is the GPU");
            };
            let options = DeviceOptions {
                allow_host_weights,
                ..DeviceOptions::default()
            };
            let mut placed = Vec::new();
            let result = check_placement(
                &*driver,
                0,
                gpu,
                free_before,
                &options,
                &path,
                "host:1",
                &mut |event| {
                    if let LoadEvent::WeightsPlaced { device, verdict } = event {
                        placed.push((device.to_string(), verdict.warnings.len()));
                    }
                },
            );
            match (memory_type, allow_host_weights) {
                (MemoryType::Device, _) => {
                    result.unwrap();
                    assert_eq!(placed, [("host:1".to_string(), 0)]);
                }
                (_, false) => {
                    let error = result.unwrap_err();
                    assert!(
                        matches!(&error, LoadError::WeightsNotInVram { device, .. } if device == "host:1"),
                        "{error:?}"
                    );
                    assert_eq!(
                        error.to_string(),
                        format!("cannot load {} on host:1", path.display())
                    );
                    let cause = std::error::Error::source(&error).unwrap().to_string();
                    assert!(cause.contains("is host memory"), "{cause}");
                    assert!(placed.is_empty());
                }
                (_, true) => {
                    result.unwrap();
                    assert_eq!(placed.len(), 1);
                    assert_eq!(placed[0].0, "host:1");
                    assert!(placed[0].1 > 0, "a warning names what is in host memory");
                }
            }
        }
    }

    /// The layer of a `blk.N.*` tensor.
    fn layer_of(name: &str) -> Option<usize> {
        name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
    }

    #[test]
    fn a_gpu_on_the_host_driver_holds_exactly_its_layers_weights_and_kv() {
        let dir = tempfile::tempdir().unwrap();
        let gguf = synth(dir.path(), "llama3.2-1b", "q4_k_m");
        for ngl in 1..=LAYERS {
            let plan = plan(&gguf, ngl);
            let backend = offload_split(
                CpuBackend::new(2).unwrap(),
                host_gpu(),
                "host:0",
                &hparams(&gguf),
                &plan,
            );
            let model = Model::from_gguf(Arc::clone(&gguf), backend, &mut |_, _| {}).unwrap();
            let OneOf::Second(gpu) = &model.backend().devices()[1] else {
                panic!("device 1 is the GPU");
            };
            let placed = gpu.placed_weights();
            let mut gpu_layers: Vec<usize> =
                placed.iter().filter_map(|(n, _, _)| layer_of(n)).collect();
            gpu_layers.dedup();
            assert_eq!(
                gpu_layers,
                (LAYERS - ngl..LAYERS).collect::<Vec<_>>(),
                "-ngl {ngl}"
            );
            // Each tensor's bytes are counted on the device it went to: below all layers, the
            // GPU's are exactly its layers' tensors (the rest, with the output layer, are the
            // CPU's; a model may hold a tensor no backend loads, such as rope frequencies).
            let weights = model.backend().weight_bytes_per_device();
            let tensor_bytes = |keep: &dyn Fn(Option<usize>) -> bool| -> u64 {
                gguf.tensors()
                    .iter()
                    .filter(|t| keep(layer_of(&t.name)))
                    .map(|t| t.n_bytes)
                    .sum()
            };
            let first_gpu = LAYERS - ngl;
            let gpu_layers = tensor_bytes(&|l| l.is_some_and(|l| l >= first_gpu));
            let cpu_layers = tensor_bytes(&|l| l.is_some_and(|l| l < first_gpu));
            let file = tensor_bytes(&|_| true);
            if ngl < LAYERS {
                assert_eq!(weights[1], gpu_layers, "-ngl {ngl}: {weights:?}");
                assert!(weights[0] > cpu_layers, "-ngl {ngl}: {weights:?}");
            } else {
                assert_eq!(weights[0], 0, "{weights:?}");
                assert!(weights[1] > gpu_layers, "{weights:?}");
            }
            assert!(weights[0] + weights[1] <= file, "{weights:?}");
            let output_on_gpu = placed.iter().any(|(n, _, _)| layer_of(n).is_none());
            assert_eq!(output_on_gpu, ngl == LAYERS, "-ngl {ngl}: {placed:?}");
            // KV blocks: each device's cache holds its own layers, materialized on demand.
            let mut ctx = model.new_context(ContextParams::with_ctx(32));
            let kv = ctx.kv_mut();
            let blocks: Vec<u32> = vec![0];
            for index in 0..LAYERS {
                let layer = kv.layer_mut(index);
                model.backend().kv_materialize(layer, &blocks);
            }
            let per_device = model.backend().kv_bytes_per_device(ctx.kv());
            assert_eq!(
                per_device[0] > 0,
                ngl < LAYERS,
                "-ngl {ngl}: {per_device:?}"
            );
            assert!(per_device[1] > 0, "-ngl {ngl}: {per_device:?}");
            // The split's own count agrees with each device: the CPU's KV layers, and the
            // GPU pool's accounting of its KV purpose, which also holds each GPU layer's
            // device address table (a K and a V address of 8 bytes for the context's one
            // block).
            let memory = model.backend().memory();
            assert_eq!(memory.device(0).now.kv, per_device[0] as u64, "-ngl {ngl}");
            let OneOf::Second(gpu) = &model.backend().devices()[1] else {
                panic!("device 1 is the GPU");
            };
            let pool_kv = gpu
                .pool()
                .usage()
                .purpose(ember_gpu::pool::Purpose::Kv)
                .current;
            assert_eq!(
                memory.device(1).now.kv + (ngl * 2 * 8) as u64,
                pool_kv,
                "-ngl {ngl}"
            );
        }
    }
}
