//! Mixture-of-experts and hybrid (linear-attention) models at load time: what tiny `qwen3moe`
//! and `qwen35`/`qwen35moe` files give the model code, the errors a malformed one gets (each
//! naming the key or tensor at fault), and the refusal of a backend without mixture-of-experts
//! or linear-attention support, before any token runs.

use std::sync::Arc;

use ember_gguf::{Gguf, GgufWriter, Value};
use ember_synth::{
    metadata, tensor_list, Shape, ShapeOverrides, SynthOptions, TensorSpec, TypeSpec,
};

use super::{FfnWeights, MixerWeights, Model, ModelError};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, ExpertGating};

/// A two-layer `qwen3moe` of 8 experts (2 used) of 32 rows, after `edit` changed its metadata or
/// tensor list.
fn tiny_moe(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> Arc<Gguf> {
    tiny(
        "qwen3-30b-a3b",
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
        },
        edit,
    )
}

/// A four-layer hybrid of `shape` (`qwen3.5-27b` or `qwen3.5-35b-a3b`): three Gated DeltaNet
/// layers (2 key heads, 4 value heads of 32) and one gated full-attention layer.
fn tiny_hybrid(
    shape: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>),
) -> Arc<Gguf> {
    let moe = shape.contains("a3b");
    tiny(
        shape,
        ShapeOverrides {
            layers: Some(4),
            vocab: Some(400),
            embd: Some(64),
            heads: Some(2),
            kv_heads: Some(1),
            head_dim: Some(64),
            ff: Some(64),
            experts: moe.then_some(4),
            experts_used: moe.then_some(2),
            expert_ff: moe.then_some(32),
            shared_ff: moe.then_some(32),
            linear_k_heads: Some(2),
            linear_v_heads: Some(4),
            linear_head_dim: Some(32),
            ..ShapeOverrides::default()
        },
        edit,
    )
}

fn tiny(
    name: &str,
    overrides: ShapeOverrides,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>),
) -> Arc<Gguf> {
    let mut shape = Shape::named(name).unwrap();
    overrides.apply(&mut shape).unwrap();
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
fn a_decoded_token_reads_the_experts_in_use_and_one_embedding_row() {
    let gguf = tiny_moe(|_, _| {});
    let model = Model::from_gguf(gguf.clone(), cpu(), &mut |_, _| {}).unwrap();
    let read = model.hparams().weight_bytes_read_per_token(gguf.tensors());
    let (mut experts, mut embd, mut rest) = (0u64, 0u64, 0u64);
    for t in gguf.tensors() {
        if t.name.ends_with("_exps.weight") {
            experts += t.n_bytes;
        } else if t.name == "token_embd.weight" {
            embd += t.n_bytes;
        } else {
            rest += t.n_bytes;
        }
    }
    assert!(experts > 0 && embd > 0 && gguf.tensor("output.weight").is_some());
    // 2 of 8 experts, one of 400 embedding rows, every other tensor whole.
    assert_eq!(read, rest + experts / 4 + embd / 400);

    // Tied: the embedding table is the output projection too, read whole.
    let tied = tiny_moe(|_, tensors| tensors.retain(|t| t.name != "output.weight"));
    let model = Model::from_gguf(tied.clone(), cpu(), &mut |_, _| {}).unwrap();
    let tied_read = model.hparams().weight_bytes_read_per_token(tied.tensors());
    let out = gguf.tensor("output.weight").unwrap().n_bytes;
    assert_eq!(tied_read, rest - out + experts / 4 + embd);
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

#[test]
fn the_gpu_backend_places_stacked_experts_and_refuses_them_where_it_has_no_kernels() {
    // Fast numerics: each stacked tensor becomes one device matrix of every expert's rows.
    let model = Model::from_gguf(tiny_moe(|_, _| {}), host_gpu(), &mut |_, _| {}).unwrap();
    let FfnWeights::Moe(moe) = &model.weights.layers[0].ffn else {
        panic!("layer 0 is not a mixture of experts");
    };
    assert_eq!((moe.gate_exps.rows, moe.gate_exps.cols), (8 * 32, 64));
    assert_eq!((moe.down_exps.rows, moe.down_exps.cols), (8 * 64, 32));

    // Reference numerics have no bit-exact expert kernels: refused at load, with the way out.
    let mut gpu = host_gpu();
    gpu.set_numerics(crate::backend::gpu::Numerics::Reference);
    let e = Model::from_gguf(tiny_moe(|_, _| {}), gpu, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, ModelError::Backend(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "tensor blk.0.ffn_gate_exps.weight: mixture of experts in reference numerics \
         (--numerics fast runs it) (architecture qwen3moe) is not built for the host backend \
         yet: run the model on the CPU (--device cpu)"
    );

    // Expert weights in a type without grouped kernels (f16) are refused by name.
    let f16 = tiny_moe(|_, tensors| {
        for t in tensors.iter_mut().filter(|t| t.name.contains("_exps")) {
            t.ty = ember_gguf::GgmlType::F16;
        }
    });
    let e = Model::from_gguf(f16, host_gpu(), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("tensor blk.0.ffn_gate_exps.weight: type ")
            && e.to_lowercase()
                .contains("f16 is not supported by the host backend")
            && e.contains("q4_K, q5_K, q6_K for expert weights"),
        "{e}"
    );
}

#[test]
fn a_backend_without_linear_attention_refuses_hybrids_at_load() {
    // The GPU backend's reference numerics have no bit-exact Gated DeltaNet
    // (`Backend::linear_attention_supported` is false there), so a hybrid is refused before any
    // of its layers is placed; its default numerics place it.
    let mut reference = host_gpu();
    reference.set_numerics(crate::backend::gpu::Numerics::Reference);
    let e = Model::from_gguf(
        tiny_hybrid("qwen3.5-27b", |_, _| {}),
        reference,
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(matches!(e, ModelError::Backend(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "tensor blk.0.ssm_conv1d.weight: linear attention (Gated DeltaNet) with recurrent state \
         (architecture qwen35) is not built for the host backend yet: run the model on the CPU \
         (--device cpu)"
    );
    for shape in ["qwen3.5-27b", "qwen3.5-35b-a3b"] {
        let model = Model::from_gguf(tiny_hybrid(shape, |_, _| {}), host_gpu(), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{shape}: {e}"));
        assert!(model.hparams().has_recurrent_state());
    }
}

#[test]
fn a_hybrid_has_linear_and_full_attention_layers_and_their_memory() {
    let model =
        Model::from_gguf(tiny_hybrid("qwen3.5-27b", |_, _| {}), cpu(), &mut |_, _| {}).unwrap();
    let hp = model.hparams();
    let kinds: Vec<bool> = hp.layers.iter().map(|l| l.recurrent).collect();
    assert_eq!(kinds, [true, true, true, false]);
    let linear = hp.linear_attention.unwrap();
    assert_eq!(
        (
            linear.conv_kernel,
            linear.n_k_heads,
            linear.n_v_heads,
            linear.head_v_dim
        ),
        (4, 2, 4, 32)
    );
    // K and V of one layer (1 head of 64, f16); per sequence 3 layers of a convolution state
    // (3 taps of 2*64 + 128 channels) and 4 matrices of 32 x 32, f32.
    assert_eq!(hp.kv_bytes_per_token(), 2 * 64 * 2);
    assert_eq!(
        hp.recurrent_state_bytes_per_sequence(),
        3 * (3 * 256 + 4 * 32 * 32) * 4
    );
    assert_eq!(hp.rope_n_dims, 16);
    for (layer, recurrent) in model.weights().layers.iter().zip(kinds) {
        assert_eq!(matches!(layer.mixer, MixerWeights::Linear(_)), recurrent);
    }

    let moe = Model::from_gguf(
        tiny_hybrid("qwen3.5-35b-a3b", |_, _| {}),
        cpu(),
        &mut |_, _| {},
    )
    .unwrap();
    let params = moe.hparams().moe.unwrap();
    assert_eq!(params.n_ff_shared, Some(32));
    assert!(params.shared_expert_gate && params.normalize_weights);
    for layer in &moe.weights().layers {
        match &layer.ffn {
            FfnWeights::Moe(m) => {
                assert!(m.shared.as_ref().is_some_and(|s| s.gate_inp.is_some()))
            }
            FfnWeights::Dense { .. } => panic!("a dense FFN in a qwen35moe layer"),
        }
    }
}

#[test]
fn malformed_hybrids_name_the_key_or_tensor() {
    let e = load_error(
        tiny_hybrid("qwen3.5-27b", |_, tensors| {
            tensors.retain(|t| t.name != "blk.1.ssm_a")
        }),
        cpu(),
    );
    assert!(e.contains("tensor blk.1.ssm_a is missing"), "{e}");
    let set = |key: &'static str, value: Value| {
        move |md: &mut Vec<(String, Value)>, _: &mut Vec<TensorSpec>| {
            for (k, v) in md.iter_mut() {
                if k == key {
                    *v = value.clone();
                }
            }
        }
    };
    let e = load_error(
        tiny_hybrid("qwen3.5-27b", set("qwen35.ssm.inner_size", Value::U32(100))),
        cpu(),
    );
    assert!(e.contains("metadata key qwen35.ssm.inner_size"), "{e}");
    let e = load_error(
        tiny_hybrid(
            "qwen3.5-27b",
            set("qwen35.ssm.time_step_rank", Value::U32(3)),
        ),
        cpu(),
    );
    assert!(e.contains("metadata key qwen35.ssm.time_step_rank"), "{e}");
    // Sections [2, 2, 2, 2] over 8 rotary pairs put pair 6 in the fourth section, which text
    // positions leave at 0: refused rather than computed as plain NeoX rope.
    let e = load_error(
        tiny_hybrid(
            "qwen3.5-27b",
            set(
                "qwen35.rope.dimension_sections",
                Value::Array(ember_gguf::Array::I32(vec![2, 2, 2, 2])),
            ),
        ),
        cpu(),
    );
    assert!(
        e.contains("qwen35.rope.dimension_sections") && e.contains("pair 6"),
        "{e}"
    );
    // Every layer linear: no layer would use the KV cache.
    let e = load_error(
        tiny_hybrid(
            "qwen3.5-27b",
            set("qwen35.full_attention_interval", Value::U32(8)),
        ),
        cpu(),
    );
    assert!(e.contains("at least one full-attention layer"), "{e}");
    let e = load_error(
        tiny_hybrid("qwen3.5-27b", |md, _| {
            md.retain(|(k, _)| k != "qwen35.ssm.conv_kernel")
        }),
        cpu(),
    );
    assert!(e.contains("qwen35.ssm.conv_kernel"), "{e}");
}

#[test]
fn multi_token_prediction_blocks_are_not_part_of_the_trunk() {
    // Qwen 3.5 files may end with an MTP block counted in `block_count`; the main pass runs
    // the trunk only, so the block's tensors are not needed.
    let model = Model::from_gguf(
        tiny_hybrid("qwen3.5-27b", |md, _| {
            for (k, v) in md.iter_mut() {
                if k == "qwen35.block_count" {
                    *v = Value::U32(5);
                }
            }
            md.push(("qwen35.nextn_predict_layers".into(), Value::U32(1)));
        }),
        cpu(),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(model.hparams().n_layer, 4);
}
