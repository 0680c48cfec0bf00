//! Simulated devices hold memory as GPUs do ([`ember::backend::sim`]): over 1, 2, 3 and 4 of
//! them, each device's pool holds exactly what the split placed and allocated there, trims back
//! to its floor once idle after a run, and the logits stay bit-identical to the CPU's; a
//! `--vram-budget` is each device's own (a model that fits two devices' budgets but not one's
//! loads over two and is refused on one, naming the device); a device over its budget refuses a
//! weight at load, and an allocation during a forward pass, naming itself.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember::backend::cpu::CpuBackend;
use ember::backend::sim::SimDevice;
use ember::backend::split::{SplitBackend, SplitLayout};
use ember::backend::Backend;
use ember::batch::Batch;
use ember::device::{DeviceOptions, DeviceSpec};
use ember::kv_cache::KvError;
use ember::load::{self, AnyLoaded, LoadEvent, LoadOptions, Loaded};
use ember::model::{ContextParams, ForwardError, Model};
use ember_gguf::Gguf;
use ember_gpu::pool::{Purpose, TrimOutcome};
use ember_synth::{write_model, Shape, ShapeOverrides, SynthOptions, TypeSpec};

/// A small synthetic llama model (5 layers, a 256-token training context).
fn synth(dir: &Path) -> PathBuf {
    let mut shape = Shape::named("llama3.2-1b").unwrap();
    ShapeOverrides {
        layers: Some(5),
        vocab: Some(512),
        embd: Some(256),
        heads: Some(4),
        kv_heads: Some(2),
        head_dim: Some(64),
        ff: Some(512),
        ..ShapeOverrides::default()
    }
    .apply(&mut shape)
    .unwrap();
    shape.n_ctx_train = 256;
    let path = dir.join("llama-q8_0.gguf");
    let opts = SynthOptions {
        shape,
        types: TypeSpec::parse("q8_0").unwrap(),
        pure: false,
        seed: 9,
        fast: false,
    };
    write_model(&opts, &path, |_| {}).unwrap();
    path
}

fn options(path: &Path, device: DeviceSpec, budget: Option<u64>) -> LoadOptions {
    LoadOptions {
        model: path.display().to_string(),
        threads: 2,
        device: DeviceOptions {
            device,
            vram_budget: budget,
            ..DeviceOptions::default()
        },
    }
}

type SimLoaded = Box<Loaded<SplitBackend<CpuBackend>>>;

/// Loads over `n` simulated devices, with the load plan it printed.
fn load_sims(
    path: &Path,
    n: usize,
    budget: Option<u64>,
) -> anyhow::Result<(SimLoaded, ember::load_plan::LoadPlan)> {
    let mut plan = None;
    let loaded = load::load(&options(path, DeviceSpec::Sim(n), budget), &mut |event| {
        if let LoadEvent::Plan(p) = event {
            plan = Some(p.clone());
        }
    })?;
    let AnyLoaded::Sim(loaded) = loaded else {
        panic!("--device sim loaded elsewhere");
    };
    Ok((loaded, plan.expect("a load plan")))
}

/// The bits of the logits of a prefill of 9 tokens (every row) and 3 decode steps; the context
/// is dropped before returning.
fn logits<B: Backend>(model: &Model<B>) -> Vec<u32> {
    let n_vocab = model.n_vocab() as u32;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % n_vocab).collect();
    let mut ctx = model.new_context(ContextParams::with_ctx(32));
    let mut bits: Vec<u32> = model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &prompt, true))
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    for step in 0..3u32 {
        let token = (step * 101 + 7) % n_vocab;
        let logits = model
            .forward(
                &mut ctx,
                &Batch::for_sequence(0, prompt.len() as u32 + step, &[token], false),
            )
            .unwrap();
        bits.extend(logits.iter().map(|v| v.to_bits()));
    }
    bits
}

#[test]
fn each_simulated_device_pools_its_share_trims_to_its_floor_and_keeps_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let cpu = match load::load(&options(&path, DeviceSpec::Cpu, None), &mut |_| {}).unwrap() {
        AnyLoaded::Cpu(loaded) => loaded,
        _ => panic!("--device cpu loaded elsewhere"),
    };
    let expected = logits(&cpu.model);
    for n in 1..=4 {
        let (loaded, plan) = load_sims(&path, n, None).unwrap();
        let view = loaded.split_memory.clone().expect("the split's memory");
        assert_eq!(view.pools.len(), n);
        let split = loaded.model.backend();
        for (i, pool) in view.pools.iter().enumerate() {
            let counted = view.memory.device(i + 1);
            let usage = pool.usage();
            let report = pool.report();
            assert_eq!(report.device_name, format!("sim:{i}"));
            // The pool holds the device's weights as the split placed them, and the warm-up's
            // op scratch.
            assert_eq!(usage.purpose(Purpose::Weights).current, counted.now.weights);
            assert!(counted.now.weights > 0 || plan.shares[i + 1].layers.is_empty());
            assert_eq!(usage.purpose(Purpose::Scratch).current, counted.now.scratch);
            assert_eq!(usage.purpose(Purpose::Kv).current, 0);
            // Trimmed to the floor after load: nothing idle is left to give back.
            let at_load = report.at_load.expect("marked loaded");
            assert_eq!(pool.trim_now().unwrap(), 0, "n {n} sim:{i}");
            assert_eq!(usage.held, at_load.held);
            assert!(at_load.live >= counted.now.weights);
            // The warm-up's KV blocks and activations were reserved, and given back.
            assert!(report.peak_by_purpose[1] > 0 || plan.shares[i + 1].layers.is_empty());
            assert!(
                report.at_peak.held > at_load.held,
                "n {n} sim:{i}: {report:?}"
            );
        }
        assert_eq!(logits(&loaded.model), expected, "{n} simulated devices");
        // What the idle engine does: the ops' scratch back; then each pool's idle trimmer
        // trims it once idle (its idle time and a trimmer interval, with room for a busy
        // machine).
        split.release_op_scratch();
        std::thread::sleep(view.pools[0].config().idle_after + Duration::from_secs(1));
        for (i, pool) in view.pools.iter().enumerate() {
            assert_eq!(
                pool.trim_if_idle(Instant::now()).unwrap(),
                TrimOutcome::AlreadyTrimmed,
                "n {n} sim:{i}: the trimmer thread trimmed it"
            );
            let usage = pool.usage();
            let counted = view.memory.device(i + 1);
            // What is live is what the split counts: the weights, what the model keeps between
            // passes, no KV block.
            assert_eq!(usage.live, counted.now.total(), "n {n} sim:{i}");
            assert_eq!(usage.purpose(Purpose::Kv).current, 0, "n {n} sim:{i}");
            // Back to the floor (the pool's floor is 0: nothing idle is kept): the idle trim
            // left nothing to give back, and less is held than at the run's peak.
            assert_eq!(pool.trim_now().unwrap(), 0, "n {n} sim:{i}");
            let after = pool.report().after_idle.expect("trimmed when idle");
            assert_eq!(after.held, usage.held);
            assert!(usage.peak_held > usage.held, "n {n} sim:{i}");
        }
    }
}

#[test]
fn a_model_that_fits_two_devices_budgets_but_not_one_loads_over_two() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let (_, one) = load_sims(&path, 1, None).unwrap();
    let (_, two) = load_sims(&path, 2, None).unwrap();
    let whole = one.shares[1].total();
    let larger_half = two.shares[1..].iter().map(|s| s.total()).max().unwrap();
    assert!(larger_half < whole, "{two:?}");
    let budget = (whole + larger_half) / 2;

    let error = load_sims(&path, 1, Some(budget)).err().expect("refused");
    let chain = format!("{error:#}");
    assert!(
        chain.contains(&format!("sim:0 needs {whole} bytes")),
        "{chain}"
    );
    assert!(
        chain.contains(&format!("but has {budget} bytes")),
        "{chain}"
    );

    let (loaded, _) = load_sims(&path, 2, Some(budget)).unwrap();
    let view = loaded.split_memory.clone().unwrap();
    logits(&loaded.model);
    for pool in &view.pools {
        assert_eq!(pool.config().budget, Some(budget));
        assert!(pool.usage().peak_live <= budget);
        assert!(pool.usage().purpose(Purpose::Weights).current > 0);
    }
}

#[test]
fn a_device_over_its_budget_refuses_weights_and_allocations_naming_itself() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = Arc::new(Gguf::open(&synth(dir.path())).unwrap());
    let hparams = ember::model::HParams::from_metadata(
        ember::model::architecture_of(&gguf).unwrap(),
        gguf.metadata(),
    )
    .unwrap();
    // Layers 0..2 on sim:0, the rest and the output on sim:1.
    let build = |budget: Option<u64>| {
        let sims = [
            SimDevice::open(0, None, false).unwrap(),
            SimDevice::open(1, budget, false).unwrap(),
        ];
        let backend = SplitBackend::new(
            vec![CpuBackend::new(2).unwrap(), CpuBackend::new(2).unwrap()],
            vec!["sim:0".into(), "sim:1".into()],
            SplitLayout::for_model(&hparams, vec![0, 0, 1, 1, 1], 1),
            None,
            Vec::new(),
        )
        .with_pools(
            sims.iter().map(|s| Some(Arc::clone(&s.pool))).collect(),
            false,
        );
        (
            Model::from_gguf(Arc::clone(&gguf), backend, &mut |_, _| {}),
            sims,
        )
    };
    let (model, _) = build(None);
    let weights = model.unwrap().backend().weight_bytes_per_device()[1];

    let (refused, _) = build(Some(weights / 2));
    let text = format!("{:#}", anyhow::Error::from(refused.err().unwrap()));
    assert!(
        text.contains("placing it on the device failed: sim:1: device 1: allocating ")
            && text.contains(&format!(
                "for weights would exceed the VRAM budget of {} bytes",
                weights / 2
            )),
        "{text}"
    );

    // Room for the weights and little else: the first pass cannot get its activations.
    let (model, sims) = build(Some(weights + 1024));
    let model = model.unwrap();
    let mut ctx = model.new_context(ContextParams::with_ctx(32));
    let error = model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &[1, 2, 3, 4], false))
        .expect_err("over the budget");
    // The KV blocks are the first thing the pass asks of the device.
    let (ForwardError::Backend(failure) | ForwardError::Kv(KvError::Memory(failure))) = &error
    else {
        panic!("{error:?}");
    };
    assert!(failure.out_of_memory, "{failure:?}");
    assert!(
        failure.cause.starts_with("sim:1: device 1: allocating ")
            && failure.cause.contains("would exceed the VRAM budget"),
        "{failure:?}"
    );
    drop(ctx);
    model.backend().release_op_scratch();
    // Nothing of the failed pass stays reserved.
    assert_eq!(sims[1].pool.usage().live, weights);
    assert_eq!(sims[0].pool.usage().purpose(Purpose::Kv).current, 0);
}
