//! Layers split over several devices ([`ember::backend::split::SplitBackend`]) compute the same
//! logits, bit for bit, as the model on one device: over 1, 2, 3 and 4 devices, on synthetic
//! models of several shapes and weight types, through prefill and decode. A peer link that
//! corrupts one direction is caught by the self-test, the pair falls back to host staging, and
//! the logits stay bit-identical; with the gate forced on, the corruption shows.

use std::path::Path;
use std::sync::Arc;

use ember::backend::cpu::CpuBackend;
use ember::backend::split::{SplitBackend, SplitLayout};
use ember::backend::Backend;
use ember::batch::Batch;
use ember::model::{ContextParams, Model};
use ember_gguf::Gguf;
use ember_gpu::peer::{plan_pairs, PeerGate, PeerLink, SimPeerLink};
use ember_synth::{write_model, Shape, ShapeOverrides, SynthOptions, TypeSpec};

/// A small synthetic model of a real shape.
fn synth(dir: &Path, shape_name: &str, ty: &str, moe: bool) -> Arc<Gguf> {
    let mut shape = Shape::named(shape_name).unwrap();
    let mut overrides = ShapeOverrides {
        layers: Some(5),
        vocab: Some(512),
        embd: Some(256),
        heads: Some(4),
        kv_heads: Some(2),
        head_dim: Some(64),
        ff: Some(512),
        ..ShapeOverrides::default()
    };
    if moe {
        overrides.experts = Some(4);
        overrides.experts_used = Some(2);
        overrides.expert_ff = Some(256);
    }
    overrides.apply(&mut shape).unwrap();
    let path = dir.join(format!("{shape_name}-{ty}.gguf"));
    let opts = SynthOptions {
        shape,
        types: TypeSpec::parse(ty).unwrap(),
        pure: false,
        seed: 5,
        fast: false,
    };
    write_model(&opts, &path, |_| {}).unwrap();
    Arc::new(Gguf::open(&path).unwrap())
}

fn cpu() -> CpuBackend {
    CpuBackend::new(2).unwrap()
}

/// Logits of a prefill of 9 tokens (every row's logits) and 3 decode steps.
fn run<B: ember::backend::Backend>(model: &Model<B>) -> Vec<Vec<f32>> {
    let n_vocab = model.n_vocab() as u32;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % n_vocab).collect();
    let mut ctx = model.new_context(ContextParams::with_ctx(32));
    let mut out = Vec::new();
    let logits = model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &prompt, true))
        .unwrap();
    out.push(logits.to_vec());
    for step in 0..3u32 {
        let token = (step * 101 + 7) % n_vocab;
        let pos = prompt.len() as u32 + step;
        let logits = model
            .forward(&mut ctx, &Batch::for_sequence(0, pos, &[token], false))
            .unwrap();
        out.push(logits.to_vec());
    }
    out
}

fn bits(runs: &[Vec<f32>]) -> Vec<Vec<u32>> {
    runs.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// `layer_device` as contiguous ranges of `counts[d]` layers per device.
fn layout(model_layers: usize, counts: &[usize]) -> Vec<usize> {
    assert_eq!(counts.iter().sum::<usize>(), model_layers);
    counts
        .iter()
        .enumerate()
        .flat_map(|(d, &n)| std::iter::repeat_n(d, n))
        .collect()
}

fn split_model(
    gguf: &Arc<Gguf>,
    counts: &[usize],
    output: usize,
    link: Option<Arc<dyn PeerLink>>,
    gate: PeerGate,
) -> Model<SplitBackend<CpuBackend>> {
    let n = counts.len();
    let hparams = ember::model::HParams::from_metadata(
        ember::model::architecture_of(gguf).unwrap(),
        gguf.metadata(),
    )
    .unwrap();
    let layer_device = layout(hparams.n_layer, counts);
    let pairs = plan_pairs(n, gate, link.as_deref());
    let backend = SplitBackend::new(
        (0..n).map(|_| cpu()).collect(),
        (0..n).map(|d| format!("sim:{d}")).collect(),
        SplitLayout::for_model(&hparams, layer_device, output),
        link,
        pairs,
    );
    Model::from_gguf(Arc::clone(gguf), backend, &mut |_, _| {}).unwrap()
}

#[test]
fn a_split_over_one_to_four_devices_gives_bit_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    for (shape, ty, moe) in [
        ("llama3.2-1b", "q4_k_m", false),
        ("qwen3-0.6b", "q8_0", false),
        ("gemma3-270m", "q4_k_m", false),
        ("qwen3-30b-a3b", "q8_0", true),
    ] {
        let gguf = synth(dir.path(), shape, ty, moe);
        let single = Model::from_gguf(Arc::clone(&gguf), cpu(), &mut |_, _| {}).unwrap();
        let expected = bits(&run(&single));
        // Layouts of 5 layers: one device; even and uneven ranges; a device with no layers;
        // the output on a device other than the last layer's.
        let layouts: &[(&[usize], usize)] = &[
            (&[5], 0),
            (&[3, 2], 1),
            (&[1, 4], 0),
            (&[2, 2, 1], 2),
            (&[1, 0, 4], 1),
            (&[2, 1, 1, 1], 3),
            (&[1, 1, 1, 2], 0),
        ];
        for &(counts, output) in layouts {
            let model = split_model(&gguf, counts, output, None, PeerGate::Off);
            let got = bits(&run(&model));
            assert!(
                got == expected,
                "{shape} {ty}: split {counts:?} (output on {output}) differs from one device"
            );
            // Each device holds the KV blocks of its own layers and no others.
            let mut ctx = model.new_context(ContextParams::with_ctx(32));
            model
                .forward(&mut ctx, &Batch::for_sequence(0, 0, &[1, 2, 3], false))
                .unwrap();
            let per_device = model.backend().kv_bytes_per_device(ctx.kv());
            let total = ctx.kv().resident_bytes(model.backend());
            assert_eq!(
                per_device.iter().sum::<usize>(),
                total,
                "{shape} {counts:?}"
            );
            for (d, &bytes) in per_device.iter().enumerate() {
                assert_eq!(
                    bytes > 0,
                    counts[d] > 0,
                    "{shape} {counts:?}: {per_device:?}"
                );
            }
            let stats = model.backend().transfer_stats();
            let crossings = counts.iter().filter(|&&c| c > 0).count();
            if crossings > 1 {
                assert!(stats.staged_copies > 0, "{shape} {counts:?}: {stats:?}");
            }
            assert_eq!(stats.peer_copies, 0, "the gate is off");
        }
    }
}

#[test]
fn a_corrupting_peer_pair_is_caught_and_falls_back_to_host_staging() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = synth(dir.path(), "llama3.2-1b", "q8_0", false);
    let single = Model::from_gguf(Arc::clone(&gguf), cpu(), &mut |_, _| {}).unwrap();
    let expected = bits(&run(&single));
    let corrupt: Arc<dyn PeerLink> = Arc::new(SimPeerLink::corrupting(vec![(0, 1)]));

    // Probe: the self-test catches 0 -> 1 and turns that pair off both ways; 1 -> 2 stays peer.
    let model = split_model(
        &gguf,
        &[2, 2, 1],
        2,
        Some(Arc::clone(&corrupt)),
        PeerGate::Probe,
    );
    let pairs = model.backend().pairs();
    let pair = |s, d| pairs.iter().find(|p| p.src == s && p.dst == d).unwrap();
    assert!(!pair(0, 1).peer && pair(0, 1).reason.starts_with("self-test failed"));
    assert!(!pair(1, 0).peer);
    assert!(pair(1, 2).peer && pair(2, 0).peer, "{pairs:?}");
    assert_eq!(bits(&run(&model)), expected, "falls back, same logits");
    let stats = model.backend().transfer_stats();
    assert!(
        stats.peer_copies > 0 && stats.staged_copies > 0,
        "{stats:?}"
    );

    // Peer copies forced on over the corrupting pair: the corruption reaches the logits, which
    // is what the self-test is for.
    let forced = split_model(&gguf, &[2, 2, 1], 2, Some(corrupt), PeerGate::On);
    assert_ne!(bits(&run(&forced)), expected);
}

/// The layer of a `blk.N.*` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

#[test]
fn the_split_counts_each_devices_weights_kv_and_scratch_from_its_allocations() {
    let dir = tempfile::tempdir().unwrap();
    // The synthetic shapes' attention, as `synth` sets it: 2 KV heads of 64, every layer with
    // its own KV cache. A K and a V row per token and KV head, f16 on the CPU backend.
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 64;
    const BLOCK_SIZE: usize = 16;
    let kv_bytes_per_layer_block = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2 * 2;
    for (shape, ty) in [("llama3.2-1b", "q4_k_m"), ("qwen3-0.6b", "q8_0")] {
        let gguf = synth(dir.path(), shape, ty, false);
        let counts = [2, 0, 2, 1];
        let output = 3;
        let model = split_model(&gguf, &counts, output, None, PeerGate::Off);
        let memory = Arc::clone(model.backend().memory());

        // Weights: a device without the output holds exactly its layers' tensors, as stored.
        let layer_device = layout(5, &counts);
        let weights: Vec<u64> = memory.devices().iter().map(|d| d.now.weights).collect();
        for (device, &bytes) in weights.iter().enumerate() {
            let own: u64 = gguf
                .tensors()
                .iter()
                .filter(|t| layer_of(&t.name).is_some_and(|il| layer_device[il] == device))
                .map(|t| t.n_bytes)
                .sum();
            if device == output {
                assert!(bytes > own, "{shape}: {weights:?}");
            } else {
                assert_eq!(bytes, own, "{shape} device {device}: {weights:?}");
            }
        }
        assert!(memory
            .devices()
            .iter()
            .all(|d| d.now.kv == 0 && d.now.scratch == 0));

        // 40 tokens: two blocks of 16 full and a third begun, on every layer.
        let params = ContextParams {
            kv_block_size: BLOCK_SIZE,
            ..ContextParams::with_ctx(64)
        };
        let mut ctx = model.new_context(params);
        let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 512).collect();
        model
            .forward(&mut ctx, &Batch::for_sequence(0, 0, &prompt, false))
            .unwrap();
        let blocks = prompt.len().div_ceil(BLOCK_SIZE);
        let per_device = model.backend().kv_bytes_per_device(ctx.kv());
        for (device, usage) in memory.devices().iter().enumerate() {
            let expected = (counts[device] * blocks * kv_bytes_per_layer_block) as u64;
            assert_eq!(usage.now.kv, expected, "{shape} device {device}");
            assert_eq!(usage.now.kv, per_device[device] as u64, "{shape} {device}");
            // Activations visit every device holding a layer, and only those (the output
            // device holds the embedding table too).
            assert_eq!(
                usage.now.scratch > 0,
                counts[device] > 0 || device == output,
                "{shape} device {device}: {usage:?}"
            );
        }
        let peak_kv: Vec<u64> = memory.devices().iter().map(|d| d.now.kv).collect();
        let peak_scratch: Vec<u64> = memory.devices().iter().map(|d| d.now.scratch).collect();
        let devices = model.backend().devices();
        let op_scratch: Vec<u64> = devices
            .iter()
            .map(|d| d.op_scratch_bytes() as u64)
            .collect();
        // The CPU's ops keep quantized activations between passes: counted with the scratch.
        for (device, &bytes) in op_scratch.iter().enumerate() {
            assert_eq!(
                bytes > 0,
                counts[device] > 0 || device == output,
                "{op_scratch:?}"
            );
        }

        // Dropping the context gives its KV blocks and buffers back; what the devices' ops
        // keep stays counted, until they give it back; the peaks stay.
        drop(ctx);
        for (device, usage) in memory.devices().iter().enumerate() {
            assert_eq!(
                (usage.now.kv, usage.now.scratch),
                (0, op_scratch[device]),
                "{shape} {device}"
            );
            assert_eq!(usage.peak.kv, peak_kv[device], "{shape} {device}");
            assert!(
                usage.peak.scratch >= peak_scratch[device],
                "{shape} {device}"
            );
            assert_eq!(usage.now.weights, weights[device]);
        }
        model.backend().release_op_scratch();
        for (device, usage) in memory.devices().iter().enumerate() {
            let kept = devices[device].op_scratch_bytes() as u64;
            assert_eq!(usage.now.scratch, kept, "{shape} {device}");
        }
        // The model gone, nothing is counted but the weights placed.
        drop(model);
        for (device, usage) in memory.devices().iter().enumerate() {
            assert_eq!(
                (usage.now.kv, usage.now.scratch),
                (0, 0),
                "{shape} {device}"
            );
        }
    }
}
