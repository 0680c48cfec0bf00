//! Gemma 4 at load time: what tiny files of the 26B-A4B and E2B shapes give the model code
//! (layer kinds, head sizes, shared KV layers, per-layer embeddings, experts), the errors a
//! malformed one gets, its placement on the GPU backend, and the refusals of heads wider than a
//! backend's attention kernels and of the GPU's reference numerics.

use std::sync::Arc;

use ember_gguf::{Array, Gguf, Value};
use ember_synth::{Shape, ShapeOverrides, TensorSpec};

use super::tests::{cpu, host_gpu, load_error, write_edited};
use super::{Model, ModelError};

/// The E2B shape at a width of 64: ten layers in groups of four sliding (head 32) and one global
/// (head 64), the last five reusing the caches of layers 3 and 4, per-layer embeddings of 32.
fn tiny_e2b(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> Arc<Gguf> {
    let mut shape = Shape::named("gemma4-e2b").unwrap();
    ShapeOverrides {
        layers: Some(10),
        vocab: Some(400),
        embd: Some(64),
        heads: Some(2),
        kv_heads: Some(1),
        head_dim: Some(32),
        ff: Some(64),
        window: Some(8),
        global_head_dim: Some(64),
        global_kv_heads: Some(1),
        shared_kv_layers: Some(5),
        per_layer_embd: Some(32),
        ..ShapeOverrides::default()
    }
    .apply(&mut shape)
    .unwrap();
    write_edited(shape, edit)
}

/// The 26B-A4B shape at a width of 64 with 8 experts (2 used) of 32 rows: six layers, the last
/// global (head 64, no attn_v).
fn tiny_26b(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<TensorSpec>)) -> Arc<Gguf> {
    let mut shape = Shape::named("gemma4-26b-a4b").unwrap();
    ShapeOverrides {
        layers: Some(6),
        vocab: Some(400),
        embd: Some(64),
        heads: Some(2),
        kv_heads: Some(2),
        head_dim: Some(32),
        ff: Some(64),
        experts: Some(8),
        experts_used: Some(2),
        expert_ff: Some(32),
        window: Some(8),
        global_head_dim: Some(64),
        global_kv_heads: Some(1),
        ..ShapeOverrides::default()
    }
    .apply(&mut shape)
    .unwrap();
    write_edited(shape, edit)
}

#[test]
fn an_e2b_file_gives_layer_kinds_shared_caches_and_per_layer_embeddings() {
    let model = Model::from_gguf(tiny_e2b(|_, _| {}), cpu(), &mut |_, _| {}).unwrap();
    let hp = model.hparams();
    assert_eq!(hp.n_layer_kv, 5);
    assert_eq!(hp.n_embd_per_layer, Some(32));
    assert_eq!(hp.sliding_window, Some(8));
    assert!(hp.moe.is_none());
    let kinds: Vec<(bool, usize, usize, usize)> = hp
        .layers
        .iter()
        .map(|l| (l.sliding_window, l.head_dim, l.kv_source, l.n_ff))
        .collect();
    #[rustfmt::skip]
    assert_eq!(kinds, [
        (true, 32, 0, 64), (true, 32, 1, 64), (true, 32, 2, 64), (true, 32, 3, 64),
        (false, 64, 4, 64),
        (true, 32, 3, 128), (true, 32, 3, 128), (true, 32, 3, 128), (true, 32, 3, 128),
        (false, 64, 4, 128),
    ]);
    // K and V of the five layers with a cache, f16: four of 32 values and one of 64.
    assert_eq!(hp.kv_bytes_per_token(), 2 * 2 * (4 * 32 + 64));
    let w = model.weights();
    assert!(w.gemma4_per_layer.is_some());
    assert!(w.gemma4_layers[..5].iter().all(|l| l.kv.is_some()));
    assert!(w.gemma4_layers[5..].iter().all(|l| l.kv.is_none()));
    assert_eq!(w.rope_freqs.as_ref().map(Vec::len), Some(32));
}

#[test]
fn a_26b_file_gives_experts_beside_the_dense_ffn_and_k_as_v_on_global_layers() {
    let model = Model::from_gguf(tiny_26b(|_, _| {}), cpu(), &mut |_, _| {}).unwrap();
    let moe = model.hparams().moe.unwrap();
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_expert),
        (8, 2, 32)
    );
    let layers = &model.weights().gemma4_layers;
    assert!(layers.iter().all(|l| l.moe.is_some()));
    assert!(layers
        .iter()
        .all(|l| l.moe.as_ref().unwrap().expert_scale.is_some()));
    assert!(layers[..5]
        .iter()
        .all(|l| l.kv.as_ref().unwrap().wv.is_some()));
    assert!(layers[5].kv.as_ref().unwrap().wv.is_none());
    assert_eq!(model.hparams().attention_scale(), 1.0);
}

#[test]
fn bad_gemma4_metadata_names_its_key() {
    let e = load_error(
        tiny_e2b(|md, _| md.retain(|(k, _)| k != "gemma4.attention.sliding_window_pattern")),
        cpu(),
    );
    assert!(
        e.contains("gemma4.attention.sliding_window_pattern: expected an array of one bool per layer, found no value"),
        "{e}"
    );
    let e = load_error(
        tiny_e2b(|md, _| {
            for (k, v) in md.iter_mut() {
                if k == "gemma4.attention.sliding_window_pattern" {
                    *v = Value::Array(Array::Bool(vec![true; 9]));
                }
            }
        }),
        cpu(),
    );
    assert!(
        e.contains("expected 10 values, one per layer, found 9 values"),
        "{e}"
    );
    // Six shared layers: sliding layers would reuse layer 2 and global ones layer 3, a sliding
    // layer.
    let e = load_error(
        tiny_e2b(|md, _| {
            for (k, v) in md.iter_mut() {
                if k == "gemma4.attention.shared_kv_layers" {
                    *v = Value::U32(6);
                }
            }
        }),
        cpu(),
    );
    assert!(
        e.contains("gemma4.attention.shared_kv_layers: expected layer 4 to reuse the cache of a layer of its own kind"),
        "{e}"
    );
    let e = load_error(
        tiny_e2b(|md, _| md.retain(|(k, _)| k != "gemma4.attention.key_length_swa")),
        cpu(),
    );
    assert!(e.contains("gemma4.attention.key_length_swa"), "{e}");
}

#[test]
fn missing_gemma4_tensors_are_named() {
    let e = load_error(
        tiny_e2b(|_, t| t.retain(|t| t.name != "blk.2.attn_k.weight")),
        cpu(),
    );
    assert!(e.contains("tensor blk.2.attn_k.weight is missing"), "{e}");
    let e = load_error(
        tiny_e2b(|_, t| t.retain(|t| t.name != "per_layer_model_proj.weight")),
        cpu(),
    );
    assert!(
        e.contains(
            "tensor per_layer_model_proj.weight is missing: expected a tensor of dims [64, 320]"
        ),
        "{e}"
    );
    let e = load_error(
        tiny_26b(|_, t| t.retain(|t| t.name != "blk.1.ffn_gate_inp.scale")),
        cpu(),
    );
    assert!(
        e.contains("tensor blk.1.ffn_gate_inp.scale is missing"),
        "{e}"
    );
    let e = load_error(
        tiny_26b(|_, t| t.retain(|t| t.name != "rope_freqs.weight")),
        cpu(),
    );
    assert!(e.contains("tensor rope_freqs.weight is missing"), "{e}");
}

#[test]
fn the_gpu_backend_places_gemma4_in_fast_numerics() {
    // Every weight of both shapes reaches the device (the host driver here): the experts with
    // their per-expert scales, the per-layer embeddings, the layers without a cache.
    for gguf in [tiny_e2b(|_, _| {}), tiny_26b(|_, _| {})] {
        let model = Model::from_gguf(gguf, host_gpu(), &mut |_, _| {}).unwrap();
        assert_eq!(model.weights().gemma4_layers.len(), model.hparams().n_layer);
    }
}

#[test]
fn the_gpu_backend_refuses_gemma4_in_reference_numerics_at_load() {
    // The reference numerics have no exact kernels for Gemma 4's own ops; `ember` refuses the
    // mode earlier still, for the logit soft-cap (numerics::reference_unsupported).
    let mut gpu = host_gpu();
    gpu.set_numerics(crate::backend::gpu::Numerics::Reference);
    let e = Model::from_gguf(tiny_e2b(|_, _| {}), gpu, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, ModelError::Backend(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "tensor token_embd.weight: the Gemma 4 forward pass (architecture gemma4) is not built \
         for the host backend yet: run the model on the CPU (--device cpu)"
    );
}

#[test]
fn heads_wider_than_the_attention_kernels_are_refused_at_load() {
    // Global heads of 1024 on the GPU (its kernels stop at 512), and the real 512 in reference
    // numerics (the exact attention stops at 256): refused before any weight is placed, naming
    // the first such layer.
    let wide = |head_dim: usize| {
        tiny_e2b(|md, _| {
            for (k, v) in md.iter_mut() {
                if k == "gemma4.attention.key_length" || k == "gemma4.attention.value_length" {
                    *v = Value::U32(head_dim as u32);
                }
            }
        })
    };
    let e = load_error(wide(1024), host_gpu());
    assert_eq!(
        e,
        "tensor blk.4.attn_q.weight: attention heads of 1024 values (layer 4) are wider than the \
         host backend's attention kernels handle (at most 512): run the model on the CPU \
         (--device cpu)"
    );
    let mut reference = host_gpu();
    reference.set_numerics(crate::backend::gpu::Numerics::Reference);
    let e = load_error(wide(512), reference);
    assert!(
        e.contains("attention heads of 512 values (layer 4)") && e.contains("(at most 256)"),
        "{e}"
    );
}

#[test]
fn a_multimodal_projector_is_refused_with_a_clear_message() {
    let gguf = tiny_e2b(|md, _| {
        for (k, v) in md.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String("clip".into());
            }
        }
    });
    let e = load_error(gguf, cpu());
    assert!(
        e.contains("this file is a multimodal projector (mmproj), not a language model; multimodal projectors are not supported yet"),
        "{e}"
    );
}

/// Logits of `tokens` (one sequence) evaluated `split` tokens at a time.
fn logits_in_steps(
    model: &Model<crate::backend::cpu::CpuBackend>,
    tokens: &[u32],
    split: usize,
) -> Vec<f32> {
    let mut ctx = model.new_context(super::ContextParams::with_ctx(64));
    let mut logits = Vec::new();
    for (i, chunk) in tokens.chunks(split).enumerate() {
        let batch = crate::batch::Batch::for_sequence(0, (i * split) as u32, chunk, true);
        logits.extend_from_slice(model.forward(&mut ctx, &batch).unwrap());
    }
    logits
}

#[test]
fn decoding_an_e2b_model_token_by_token_gives_the_logits_of_one_batch() {
    // Fewer than 64 tokens, so one batch and single tokens take the same attention path: the
    // layers without a cache must then read, step after step, exactly what their source layers
    // stored (and sliding layers see the same window), which makes the results equal.
    let model = Model::from_gguf(tiny_e2b(|_, _| {}), cpu(), &mut |_, _| {}).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 400).collect();
    let whole = logits_in_steps(&model, &tokens, tokens.len());
    for split in [1, 7] {
        let steps = logits_in_steps(&model, &tokens, split);
        assert_eq!(steps.len(), whole.len());
        let max_diff = steps
            .iter()
            .zip(&whole)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(max_diff, 0.0, "steps of {split}");
    }
}
