//! Mixture-of-experts models at load time: what a tiny `qwen3moe` file gives the model code, the
//! errors a malformed one gets (each naming the key or tensor at fault), and the refusal of a
//! backend without mixture-of-experts support, before any token runs.

use std::sync::Arc;

use ember_gguf::{Gguf, GgufWriter, Value};
use ember_synth::{
    metadata, tensor_list, Shape, ShapeOverrides, SynthOptions, TensorSpec, TypeSpec,
};

use super::{FfnWeights, Model, ModelError};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, ExpertGating};

/// A two-layer `qwen3moe` of 8 experts (2 used) of 32 rows, after `edit` changed its metadata or
/// tensor list.
fn tiny_moe(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> Arc<Gguf> {
    let mut shape = Shape::named("qwen3-30b-a3b").unwrap();
    ShapeOverrides {
        layers: Some(2),
        vocab: Some(400),
        embd: Some(64),
        heads: Some(4),
        kv_heads: Some(1),
        head_dim: Some(32),
        experts: Some(8),
        experts_used: Some(2),
        expert_ff: Some(32),
        ..ShapeOverrides::default()
    }
    .apply(&mut shape)
    .unwrap();
    write_edited(shape, edit)
}

/// The model of `shape` (Q8_0, seed 3) after `edit` changed its metadata or tensor list.
pub(super) fn write_edited(
    shape: Shape,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>),
) -> Arc<Gguf> {
    let opts = SynthOptions {
        shape,
        types: TypeSpec::parse("q8_0").unwrap(),
        pure: false,
        seed: 3,
        fast: false,
    };
    let mut md = metadata(&opts).unwrap();
    let mut tensors = tensor_list(&opts).unwrap();
    edit(&mut md, &mut tensors);
    let mut writer = GgufWriter::new();
    for (key, value) in md {
        writer.metadata(&key, value);
    }
    for t in tensors {
        let mut bytes = vec![0u8; t.n_bytes() as usize];
        ember_synth::weights::fill_exact(&t.name, t.ty, t.cols(), &t.init, 3, &mut bytes).unwrap();
        writer.tensor(&t.name, &t.dims, t.ty, bytes);
    }
    Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap())
}

pub(super) fn load_error<B: Backend>(gguf: Arc<Gguf>, backend: B) -> String {
    match Model::from_gguf(gguf, backend, &mut |_, _| {}) {
        Ok(_) => panic!("the model loaded"),
        Err(e) => e.to_string(),
    }
}

pub(super) fn cpu() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

#[test]
fn a_qwen3moe_file_loads_with_its_experts() {
    let model = Model::from_gguf(tiny_moe(|_, _| {}), cpu(), &mut |_, _| {}).unwrap();
    let moe = model.hparams().moe.unwrap();
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_expert),
        (8, 2, 32)
    );
    assert_eq!(moe.gating, ExpertGating::Softmax);
    assert!(moe.normalize_weights && moe.n_ff_shared.is_none());
    assert!(model.hparams().layers.iter().all(|l| l.moe));
    for layer in &model.weights().layers {
        match &layer.ffn {
            FfnWeights::Moe(m) => assert!(m.shared.is_none()),
            FfnWeights::Dense { .. } => panic!("a dense FFN in a qwen3moe layer"),
        }
    }
}

#[test]
fn the_expert_ffn_size_falls_back_to_the_dense_one_over_the_experts_used() {
    // llama.cpp's rule when `expert_feed_forward_length` is absent: n_ff / n_expert_used.
    let gguf = tiny_moe(|md, _| {
        md.retain(|(k, _)| k != "qwen3moe.expert_feed_forward_length");
        for (k, v) in md.iter_mut() {
            if k == "qwen3moe.feed_forward_length" {
                *v = Value::U32(64);
            }
        }
    });
    let model = Model::from_gguf(gguf, cpu(), &mut |_, _| {}).unwrap();
    assert_eq!(model.hparams().moe.unwrap().n_ff_expert, 32);
}

#[test]
fn bad_expert_counts_name_their_key() {
    let set = |key: &'static str, value: u32| {
        move |md: &mut Vec<(String, Value)>, _: &mut Vec<TensorSpec>| {
            for (k, v) in md.iter_mut() {
                if k == key {
                    *v = Value::U32(value);
                }
            }
        }
    };
    let e = load_error(tiny_moe(set("qwen3moe.expert_used_count", 9)), cpu());
    assert!(
        e.contains("qwen3moe.expert_used_count: expected a value from 1 to 8, found 9"),
        "{e}"
    );
    let e = load_error(tiny_moe(set("qwen3moe.expert_count", 0)), cpu());
    assert!(
        e.contains("qwen3moe.expert_count: expected a value from 1"),
        "{e}"
    );
    let e = load_error(
        tiny_moe(|md, _| md.retain(|(k, _)| k != "qwen3moe.expert_count")),
        cpu(),
    );
    assert!(e.contains("qwen3moe.expert_count"), "{e}");
}

#[test]
fn missing_or_misshapen_expert_tensors_are_named() {
    let e = load_error(
        tiny_moe(|_, t| t.retain(|t| t.name != "blk.1.ffn_down_exps.weight")),
        cpu(),
    );
    assert!(
        e.contains(
            "tensor blk.1.ffn_down_exps.weight is missing: expected a tensor of dims [32, 64, 8]"
        ),
        "{e}"
    );
    let e = load_error(
        tiny_moe(|_, tensors| {
            for t in tensors.iter_mut() {
                if t.name == "blk.0.ffn_up_exps.weight" {
                    t.dims = vec![64, 32, 7];
                }
            }
        }),
        cpu(),
    );
    assert!(
        e.contains("tensor blk.0.ffn_up_exps.weight: expected dims [64, 32, 8], found [64, 32, 7]"),
        "{e}"
    );
    let e = load_error(
        tiny_moe(|_, t| t.retain(|t| t.name != "blk.0.ffn_gate_inp.weight")),
        cpu(),
    );
    assert!(
        e.contains("tensor blk.0.ffn_gate_inp.weight is missing"),
        "{e}"
    );
}

#[test]
fn a_backend_without_experts_refuses_them_at_load() {
    // The GPU backend over the host driver (real memory, no kernels): it has no
    // mixture-of-experts placement, so the default of `Backend::expert_matrix` refuses the first
    // stacked tensor and the load fails with the architecture named.
    let gpu = host_gpu();
    let e = Model::from_gguf(tiny_moe(|_, _| {}), gpu, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, ModelError::Backend(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "tensor blk.0.ffn_gate_exps.weight: mixture of experts (architecture qwen3moe) is not \
         built for the host backend yet: run the model on the CPU (--device cpu)"
    );
}

/// The GPU backend over the host driver (real memory, no kernels).
pub(super) fn host_gpu() -> crate::backend::gpu::GpuBackend {
    use ember_gpu::host::{HostDriver, HostDriverConfig};
    use ember_gpu::kernels::KernelLibrary;
    use ember_gpu::ops::{GpuContext, GpuContextOptions};
    use ember_gpu::{DevicePool, Driver, PoolConfig, PoolKind};

    let driver: Arc<dyn Driver> = Arc::new(HostDriver::new(HostDriverConfig::default()));
    let pool = DevicePool::with_kind(
        driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
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
    crate::backend::gpu::GpuBackend::new(ctx, "host", "host test device".into(), false)
}
