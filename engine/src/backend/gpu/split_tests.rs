//! A layer split over several GPUs, through the real [`GpuBackend`] code on host drivers made
//! peers of each other (two and three devices, and one device named twice): the activations
//! cross between GPUs by the driver's peer copy where the start-up self-test trusts the pair,
//! through host memory elsewhere, and the result is bit-identical to one GPU's, with decode
//! graphs recording the peer copies. The host driver runs no model kernels, so the "layers" are
//! a bias add and a scale per layer (the elementwise kernels' Rust twins); a model's forward
//! pass over several GPUs is checked on the GPU.

use std::sync::Arc;

use ember_gguf::{GgmlType, Gguf, GgufWriter, Value};
use ember_gpu::host::{HostDriver, HostDriverConfig};
use ember_gpu::kernels::KernelLibrary;
use ember_gpu::ops::{GpuContext, GpuContextOptions};
use ember_gpu::peer::{plan_pairs, DriverPeerLink, PairState, PeerGate, PeerLink};
use ember_gpu::{DevicePool, Driver, PoolConfig, PoolKind};

use super::tests::register_elementwise_twins;
use super::GpuBackend;
use crate::backend::cpu::CpuBackend;
use crate::backend::mixed::OneOf;
use crate::backend::split::{SplitBackend, SplitLayout, TransferStats};
use crate::backend::Backend;
use crate::batch::Batch;
use crate::load::{split_pairs, Offloaded, ShiftedLink};
use crate::ops::AttentionPlan;

const LAYERS: usize = 6;
const DIM: usize = 1000;

/// A file of one bias vector per layer (`blk.N.bias`) and one for the output
/// (`output_bias`), each of `DIM` values that differ by layer.
fn weights() -> Arc<Gguf> {
    let mut writer = GgufWriter::new();
    writer.metadata("general.architecture", Value::String("test".into()));
    let vector = |seed: usize| -> Vec<u8> {
        (0..DIM)
            .flat_map(|i| (((i * 31 + seed * 17) % 97) as f32 * 0.013 - 0.6).to_le_bytes())
            .collect()
    };
    for il in 0..LAYERS {
        writer.tensor(
            &format!("blk.{il}.bias"),
            &[DIM as u64],
            GgmlType::F32,
            vector(il + 1),
        );
    }
    writer.tensor("output_bias", &[DIM as u64], GgmlType::F32, vector(99));
    Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap())
}

/// A GPU backend on `driver`'s device `ordinal`, with graphs on, whose kernel library finds a
/// code object for every module in `dir`.
fn host_gpu(driver: &Arc<HostDriver>, ordinal: usize, dir: &std::path::Path) -> GpuBackend {
    let dyn_driver: Arc<dyn Driver> = driver.clone();
    let pool = DevicePool::with_kind(
        dyn_driver,
        ordinal,
        PoolKind::Caching,
        format!("host:{ordinal}"),
        PoolConfig::default(),
    )
    .unwrap();
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        Arc::new(KernelLibrary::new(dir.to_path_buf())),
        &GpuContextOptions { disable_blas: true },
    )
    .unwrap();
    let backend = GpuBackend::new(ctx, "host", format!("host:{ordinal}"), false);
    backend.set_graphs(true);
    backend
}

/// A folder with a host code object for every kernel module.
fn kernels_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for spec in ember_gpu::kernels::KERNEL_MODULES {
        let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"host code object").unwrap();
    }
    dir
}

/// `n` host devices, peers of each other, each running the elementwise twins; copies into
/// device `dst` from `src` corrupt for each `(src, dst)` of `corrupt`.
fn host_drivers(n: usize, corrupt: &[(usize, usize)]) -> Vec<Arc<HostDriver>> {
    let drivers: Vec<Arc<HostDriver>> = (0..n)
        .map(|ordinal| {
            let driver = Arc::new(HostDriver::new(HostDriverConfig {
                ordinal,
                corrupt_peer_from: corrupt
                    .iter()
                    .filter(|&&(_, dst)| dst == ordinal)
                    .map(|&(src, _)| src)
                    .collect(),
                ..HostDriverConfig::default()
            }));
            register_elementwise_twins(&driver);
            driver
        })
        .collect();
    HostDriver::connect_peers(&drivers);
    drivers
}

/// The split over the CPU (device 0) and a GPU per entry of `gpus` (a driver and its device),
/// the layers spread evenly over the GPUs in order (`cpu_layers` first layers on the CPU), the
/// output on the last GPU; the peer pairs decided under `gate` by the driver link's self-test.
fn split_over(
    gpus: &[(Arc<HostDriver>, usize)],
    cpu_layers: usize,
    gate: PeerGate,
    dir: &std::path::Path,
) -> (SplitBackend<Offloaded>, Vec<PairState>) {
    let n = gpus.len();
    let link = DriverPeerLink::new(
        gpus.iter()
            .map(|(driver, ordinal)| (Arc::clone(driver) as Arc<dyn Driver>, *ordinal))
            .collect(),
    );
    let pairs = plan_pairs(n, gate, Some(&link));
    let gpu_layers = LAYERS - cpu_layers;
    let layer_device: Vec<usize> = (0..LAYERS)
        .map(|il| match il.checked_sub(cpu_layers) {
            None => 0,
            Some(g) => 1 + g * n / gpu_layers,
        })
        .collect();
    let mut backends = vec![OneOf::First(CpuBackend::new(2).unwrap())];
    let mut names = vec!["cpu".to_string()];
    for (i, (driver, ordinal)) in gpus.iter().enumerate() {
        backends.push(OneOf::Second(host_gpu(driver, *ordinal, dir)));
        names.push(format!("host:{ordinal}#{i}"));
    }
    let link: Arc<dyn PeerLink> = Arc::new(ShiftedLink(Arc::new(link)));
    let split = SplitBackend::new(
        backends,
        names,
        SplitLayout::new(layer_device, n, &[false; LAYERS]),
        Some(link),
        split_pairs(&pairs),
    );
    (split, pairs)
}

/// Three passes of one token: the input written on the CPU, each layer `x = (x + bias) * s`
/// on its device, then the output bias on the output device; what each pass read, as bits.
fn run(split: &SplitBackend<Offloaded>, gguf: &Arc<Gguf>) -> Vec<Vec<u32>> {
    let biases: Vec<_> = (0..LAYERS)
        .map(|il| {
            split
                .vector(gguf, gguf.tensor(&format!("blk.{il}.bias")).unwrap())
                .unwrap()
        })
        .collect();
    let output_bias = split
        .vector(gguf, gguf.tensor("output_bias").unwrap())
        .unwrap();
    let batch = Batch::for_sequence(0, 0, &[7], false);
    let plan = AttentionPlan {
        id: 4242,
        block_size: 32,
        slots: vec![0],
        positions: vec![0],
        table_of_token: vec![0],
        tables: vec![vec![0]],
    };
    let mut passes = Vec::new();
    let mut x = split.alloc(DIM);
    for pass in 0..3 {
        let start: Vec<f32> = (0..DIM)
            .map(|i| ((i * 7 + pass) % 23) as f32 * 0.25 - 2.0)
            .collect();
        split.begin_forward(&batch, &plan, &[0]);
        // The input goes where x last was (the output GPU after the first pass), as a
        // model's embedding rows do.
        split.write(&mut x, &start);
        for (il, bias) in biases.iter().enumerate() {
            split.add_bias(&mut x, bias, 1, DIM);
            split.scale(&mut x, DIM, 1.0 + il as f32 * 0.125);
            split.layer_done(il, LAYERS);
        }
        split.add_bias(&mut x, &output_bias, 1, DIM);
        let mut out = Vec::new();
        split.read(&x, DIM, &mut out);
        assert!(!split.end_forward(), "no pass asks to run again");
        assert!(split.take_failure().is_none());
        passes.push(out.iter().map(|v| v.to_bits()).collect());
    }
    passes
}

fn peers(pairs: &[PairState]) -> Vec<(usize, usize, bool)> {
    pairs.iter().map(|p| (p.src, p.dst, p.peer)).collect()
}

#[test]
fn a_split_over_two_and_three_host_gpus_matches_one_gpu_bit_for_bit() {
    let dir = kernels_dir();
    let gguf = weights();
    let one = host_drivers(1, &[]);
    let (single, _) = split_over(&[(Arc::clone(&one[0]), 0)], 0, PeerGate::Probe, dir.path());
    let expected = run(&single, &gguf);
    assert_eq!(single.transfer_stats().peer_copies, 0);
    for n in [2, 3] {
        for cpu_layers in [0, 1] {
            let drivers = host_drivers(n, &[]);
            let gpus: Vec<(Arc<HostDriver>, usize)> = drivers
                .iter()
                .enumerate()
                .map(|(i, d)| (Arc::clone(d), i))
                .collect();
            let (split, pairs) = split_over(&gpus, cpu_layers, PeerGate::Probe, dir.path());
            assert!(pairs.iter().all(|p| p.peer), "{pairs:?}");
            assert!(
                run(&split, &gguf) == expected,
                "{n} GPUs, {cpu_layers} CPU layers: the split differs from one GPU"
            );
            // Each pass crosses each GPU boundary once, by peer copy, and the input, written
            // where x last was (the CPU before the first pass, then the output GPU), goes to
            // the first layer's device: by peer copy to the first GPU, through host memory to
            // and from the CPU.
            let TransferStats {
                peer_copies,
                staged_copies,
                ..
            } = split.transfer_stats();
            let (input_peer, input_staged) = if cpu_layers == 0 { (2, 1) } else { (0, 3 + 2) };
            assert_eq!(
                (peer_copies, staged_copies),
                (3 * (n as u64 - 1) + input_peer, input_staged),
                "{n} GPUs, {cpu_layers} CPU layers"
            );
            // The GPUs after the first recorded their passes as graphs, the peer copy in
            // them, and replayed them.
            for driver in &drivers[1..] {
                assert!(driver.graph_launches() > 0, "{n} GPUs, {cpu_layers}");
            }
        }
    }
}

#[test]
fn a_corrupting_peer_direction_is_caught_and_its_copies_go_through_host_memory() {
    let dir = kernels_dir();
    let gguf = weights();
    let one = host_drivers(1, &[]);
    let (single, _) = split_over(&[(Arc::clone(&one[0]), 0)], 0, PeerGate::Probe, dir.path());
    let expected = run(&single, &gguf);
    // Copies from GPU 1 into GPU 2 corrupt: the self-test turns that pair (both ways) to host
    // staging, and the others keep their peer copies.
    let drivers = host_drivers(3, &[(1, 2)]);
    let gpus: Vec<(Arc<HostDriver>, usize)> = drivers
        .iter()
        .enumerate()
        .map(|(i, d)| (Arc::clone(d), i))
        .collect();
    let (split, pairs) = split_over(&gpus, 0, PeerGate::Probe, dir.path());
    assert_eq!(
        peers(&pairs),
        [
            (0, 1, true),
            (0, 2, true),
            (1, 0, true),
            (1, 2, false),
            (2, 0, true),
            (2, 1, false)
        ]
    );
    assert!(
        pairs[3].reason.starts_with("self-test failed: "),
        "{}",
        pairs[3]
    );
    assert!(
        run(&split, &gguf) == expected,
        "the fallback to host staging changed the result"
    );
    let stats = split.transfer_stats();
    // Per pass: GPU 0 -> 1 by peer copy, 1 -> 2 staged; the input from the CPU to GPU 0
    // staged in the first pass, from GPU 2 by peer copy in the next two.
    assert_eq!(
        (stats.peer_copies, stats.staged_copies),
        (3 + 2, 3 + 1),
        "{stats:?}"
    );

    // The same broken pair trusted without a test (gate on) corrupts the result: the
    // self-test is what keeps it right.
    let (trusted, _) = split_over(&gpus, 0, PeerGate::On, dir.path());
    assert!(
        run(&trusted, &gguf) != expected,
        "a corrupting peer copy went unnoticed in the result"
    );
}

#[test]
fn one_host_gpu_named_twice_splits_over_two_backends_with_device_copies() {
    let dir = kernels_dir();
    let gguf = weights();
    let one = host_drivers(1, &[]);
    let (single, _) = split_over(&[(Arc::clone(&one[0]), 0)], 0, PeerGate::Probe, dir.path());
    let expected = run(&single, &gguf);
    let drivers = host_drivers(1, &[]);
    let twice = [(Arc::clone(&drivers[0]), 0), (Arc::clone(&drivers[0]), 0)];
    let (split, pairs) = split_over(&twice, 0, PeerGate::Probe, dir.path());
    assert!(pairs.iter().all(|p| p.peer), "{pairs:?}");
    assert!(run(&split, &gguf) == expected);
    // The boundary in each pass and the input's return in the last two.
    assert_eq!(split.transfer_stats().peer_copies, 3 + 2);
}
