//! The GPU backend's own logic on the host driver (real memory from the OS, no kernels): KV blocks
//! and their device address tables, failures recorded and handed over once, budget refusals
//! rolled back by the KV cache, per-batch arrays uploaded once, activations read back. The ops'
//! kernels are tested by `ember-gpu` and on the GPU.

use std::sync::Arc;

use ember_gpu::host::{HostDriver, HostDriverConfig};
use ember_gpu::kernels::KernelLibrary;
use ember_gpu::ops::{GpuContext, GpuContextOptions};
use ember_gpu::{DevicePool, Driver, PoolConfig, PoolKind, Purpose};

use super::*;
use crate::kv_cache::{KvCache, KvError};
use ember_gpu::driver::KernelArg;

fn backend(budget: Option<u64>) -> GpuBackend {
    let driver: Arc<dyn Driver> = Arc::new(HostDriver::new(HostDriverConfig::default()));
    let pool = DevicePool::with_kind(
        driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
        PoolConfig {
            budget,
            ..PoolConfig::default()
        },
    )
    .expect("host pool");
    let kernels = Arc::new(KernelLibrary::new(std::env::temp_dir()));
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        kernels,
        &GpuContextOptions { disable_blas: true },
    )
    .expect("host context");
    GpuBackend::new(ctx, "host", "host test device".into(), false)
}

fn download_u64(backend: &GpuBackend, ptr: DevicePtr, n: usize) -> Vec<u64> {
    let mut bytes = vec![0u8; n * 8];
    backend.context().download(ptr, &mut bytes).unwrap();
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn download_u32(backend: &GpuBackend, ptr: DevicePtr, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; n * 4];
    backend.context().download(ptr, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn kv_blocks_get_memory_on_demand_and_the_device_tables_follow() {
    let b = backend(None);
    // 4 blocks of 8 slots, 2 KV heads of 16 values: 512 bytes per block for K and for V.
    let mut layer = b.kv_layer(4, 8, 2, 16);
    assert_eq!(b.kv_bytes(&layer), 0);
    b.kv_materialize(&mut layer, &[0, 2]);
    assert_eq!(b.take_failure(), None);
    assert_eq!(b.kv_bytes(&layer), 2 * 2 * 512);
    assert_eq!(
        b.pool().usage().purpose(Purpose::Kv).current,
        2 * 2 * 512 + 4 * 2 * 8,
        "two blocks of K and V plus the 64-byte address table"
    );
    let (k_table, v_table) = layer.tables().unwrap();
    let k = download_u64(&b, k_table, 4);
    let v = download_u64(&b, v_table, 4);
    let expected = |blocks: &[Option<PoolBuffer>]| -> Vec<u64> {
        blocks
            .iter()
            .map(|buf| buf.as_ref().map_or(0, |buf| buf.ptr().0))
            .collect()
    };
    assert_eq!(k, expected(&layer.k));
    assert_eq!(v, expected(&layer.v));
    assert!(k[0] != 0 && k[1] == 0 && k[2] != 0 && k[3] == 0, "{k:?}");

    // Materialising a block twice keeps its memory; releasing one zeroes its entries.
    b.kv_materialize(&mut layer, &[2, 3]);
    b.kv_release(&mut layer, &[0]);
    assert_eq!(b.take_failure(), None);
    assert_eq!(b.kv_bytes(&layer), 2 * 2 * 512);
    let k_after = download_u64(&b, layer.tables().unwrap().0, 4);
    assert_eq!(k_after[0], 0);
    assert_eq!(k_after[2], k[2], "block 2 kept its memory");
    assert_ne!(k_after[3], 0);
    b.kv_release(&mut layer, &[2, 3]);
    assert_eq!(b.kv_bytes(&layer), 0);
    assert_eq!(download_u64(&b, layer.tables().unwrap().1, 4), [0; 4]);
}

#[test]
fn a_failure_is_recorded_once_skips_later_ops_and_is_handed_over_once() {
    let b = backend(None);
    let mut buf = b.alloc(4);
    b.inject_out_of_memory();
    b.scale(&mut buf, 4, 2.0);
    // Skipped: the failure of `scale` stays the one reported.
    b.softcap(&mut buf, 4, 1.0);
    let failure = b.take_failure().expect("a failure");
    assert_eq!(failure.op, "scale");
    assert_eq!(failure.backend, "host");
    assert!(failure.out_of_memory);
    assert!(
        failure.cause.contains("injected out-of-memory failure"),
        "{}",
        failure.cause
    );
    assert_eq!(b.take_failure(), None, "handed over once");

    // Ops run again: an op on a buffer too short for it is a recorded shape error, not a
    // write past its end.
    let mut out = Vec::new();
    b.read(&buf, 8, &mut out);
    let failure = b.take_failure().expect("a failure");
    assert_eq!(failure.op, "reading results");
    assert!(!failure.out_of_memory);
    assert!(
        failure
            .cause
            .contains("expected a device buffer of at least 8 f32 values, found 4 values"),
        "{}",
        failure.cause
    );
}

#[test]
fn activations_round_trip_and_grow_only_when_needed() {
    let b = backend(None);
    let mut buf = b.alloc(0);
    assert!(buf.is_empty());
    b.ensure_len(&mut buf, 6);
    let ptr = buf.buf.as_ref().unwrap().ptr();
    b.ensure_len(&mut buf, 3);
    assert_eq!(
        buf.buf.as_ref().unwrap().ptr(),
        ptr,
        "a shorter request keeps the buffer"
    );
    assert_eq!(buf.len(), 6);
    let values = [1.5f32, -2.0, 0.25, 7.0, 0.0, -0.5];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.context().upload(ptr, &bytes).unwrap();
    let mut out = vec![9.0];
    b.read(&buf, 6, &mut out);
    assert_eq!(b.take_failure(), None);
    assert_eq!(out, values);
    assert_eq!(
        b.pool().usage().purpose(Purpose::Scratch).current,
        24 + (64 << 10),
        "one live activation buffer and the batch arrays' permanent buffer"
    );
}

#[test]
fn the_batch_is_uploaded_once_and_host_slices_find_their_device_copy() {
    let b = backend(None);
    let mut batch = Batch::new();
    batch.push(5, 0, 3, false);
    batch.push(6, 1, 3, true);
    let plan = AttentionPlan {
        id: 77,
        block_size: 4,
        slots: vec![8, 9],
        positions: vec![0, 1],
        table_of_token: vec![0, 0],
        tables: vec![vec![2]],
    };
    b.begin_forward(&batch, &plan, &[1]);
    assert_eq!(b.take_failure(), None);
    let tokens = b.batch_ptr(batch::Array::Tokens, &[5, 6]).unwrap();
    assert_eq!(download_u32(&b, tokens, 2), [5, 6]);
    let positions = b.batch_ptr(batch::Array::Positions, &[0, 1]).unwrap();
    assert_eq!(download_u32(&b, positions, 2), [0, 1]);
    let arrays = lock(&b.batch);
    let slots = arrays.plan_ptr(&plan, batch::Array::Slots).unwrap();
    let tables = arrays.plan_ptr(&plan, batch::Array::BlockTables).unwrap();
    drop(arrays);
    assert_eq!(download_u32(&b, slots, 2), [8, 9]);
    assert_eq!(download_u32(&b, tables, 1), [2]);
    // The same buffer: no upload per op.
    let scratch_before = b.pool().usage().allocations;
    assert_eq!(b.batch_ptr(batch::Array::Tokens, &[5, 6]).unwrap(), tokens);
    assert_eq!(b.pool().usage().allocations, scratch_before);
    // Other values get their own copy.
    let other = b.batch_ptr(batch::Array::Tokens, &[7]).unwrap();
    assert_ne!(other, tokens);
    assert_eq!(download_u32(&b, other, 1), [7]);
    // Another plan's arrays are refused.
    let stale = AttentionPlan {
        id: 78,
        ..plan.clone()
    };
    assert!(lock(&b.batch)
        .plan_ptr(&stale, batch::Array::Slots)
        .is_err());
}

#[test]
fn kv_blocks_over_the_budget_fail_the_plan_and_give_everything_back() {
    // Room for the address tables and 3 blocks of K and V, not for the 4 a 13-token prompt needs.
    let block = 4 * 2 * 16 * 2;
    let tables = 2 * (2 * 8 * 8);
    let b = backend(Some((tables + 3 * 2 * block * 2) as u64));
    let mut cache = KvCache::new(&b, &[(2, 16), (2, 16)], 4, 32, 8);
    let mut plan = AttentionPlan::default();
    // A first sequence of 4 tokens takes one block per layer.
    cache
        .plan(
            &b,
            &Batch::for_sequence(0, 0, &[1, 2, 3, 4], false),
            &mut plan,
        )
        .unwrap();
    let kv_before = b.pool().usage().purpose(Purpose::Kv).current;
    let stats_before = cache.stats();
    let error = cache
        .plan(&b, &Batch::for_sequence(1, 0, &[1; 13], false), &mut plan)
        .unwrap_err();
    let KvError::Memory(failure) = &error else {
        panic!("expected a memory failure, found {error:?}");
    };
    assert_eq!(failure.op, "kv_materialize");
    assert!(failure.out_of_memory, "{failure}");
    assert!(
        error.to_string().starts_with("KV cache blocks for the batch could not be given memory: host backend: kv_materialize failed: "),
        "{error}"
    );
    assert_eq!(b.pool().usage().purpose(Purpose::Kv).current, kv_before);
    assert_eq!(cache.stats(), stats_before);
    assert_eq!(cache.seq_len(1), 0);
    assert_eq!(b.take_failure(), None, "the cache took the failure");
    // What fits still runs.
    cache
        .plan(&b, &Batch::for_sequence(1, 0, &[1; 8], false), &mut plan)
        .unwrap();
    assert_eq!(cache.seq_len(1), 8);
}

#[test]
fn a_large_batch_gets_a_buffer_of_its_own_that_goes_with_it() {
    let b = backend(None);
    let base = b.pool().usage().purpose(Purpose::Scratch).current;
    assert_eq!(base, 64 << 10, "the permanent buffer exists from the start");
    let forward = |n: usize, id: u64| {
        let tokens: Vec<u32> = (0..n as u32).collect();
        let batch = Batch::for_sequence(0, 0, &tokens, false);
        let blocks = n.div_ceil(32);
        let plan = AttentionPlan {
            id,
            block_size: 32,
            slots: (0..n as u32).collect(),
            positions: (0..n as u32).collect(),
            table_of_token: vec![0; n],
            tables: vec![(0..blocks as u32).collect()],
        };
        b.begin_forward(&batch, &plan, &[n - 1]);
        assert_eq!(b.take_failure(), None);
        let ptr = b.batch_ptr(batch::Array::Tokens, &tokens).unwrap();
        assert_eq!(download_u32(&b, ptr, n), tokens);
    };
    forward(512, 1);
    assert_eq!(b.pool().usage().purpose(Purpose::Scratch).current, base);
    // 8192 tokens need 5 arrays of 8192 values and more: 256 KiB after rounding up.
    forward(8192, 2);
    assert_eq!(
        b.pool().usage().purpose(Purpose::Scratch).current,
        base + (256 << 10)
    );
    forward(16, 3);
    assert_eq!(
        b.pool().usage().purpose(Purpose::Scratch).current,
        base,
        "the large batch's buffer is gone once batches fit the permanent one"
    );
}

/// A backend on a host driver with a code object file for every module, a VRAM budget of
/// `budget` bytes if given, and the kernel twins `register` adds; the driver is returned to count
/// launches.
fn backend_with(
    budget: Option<u64>,
    register: impl FnOnce(&HostDriver),
) -> (GpuBackend, Arc<HostDriver>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    for spec in ember_gpu::kernels::KERNEL_MODULES {
        let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"host code object").unwrap();
    }
    let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
    register(&driver);
    let dyn_driver: Arc<dyn Driver> = driver.clone();
    let pool = DevicePool::with_kind(
        dyn_driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
        PoolConfig {
            budget,
            ..PoolConfig::default()
        },
    )
    .expect("host pool");
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        Arc::new(KernelLibrary::new(dir.path().to_path_buf())),
        &GpuContextOptions { disable_blas: true },
    )
    .expect("host context");
    let backend = GpuBackend::new(ctx, "host", "host test device".into(), false);
    (backend, driver, dir)
}

/// A backend whose host driver runs `ember_scale_f32` and `ember_add_f32` (Rust twins of the
/// kernels' signatures), for graph tests: the driver is returned to count launches.
fn backend_with_kernels() -> (GpuBackend, Arc<HostDriver>, tempfile::TempDir) {
    let (backend, driver, dir) = backend_with(None, register_elementwise_twins);
    backend.set_graphs(true);
    (backend, driver, dir)
}

pub(super) fn register_elementwise_twins(driver: &HostDriver) {
    // ember_scale_f32(float* out, const float* x, float scale, uint32_t n)
    driver.register_kernel("ember_scale_f32", |launch| {
        let (out, x) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?);
        let scale = launch.f32_arg(2)?;
        let n = launch.u32_arg(3)? as usize;
        let values: Vec<f32> = launch.read_f32(x, n)?.iter().map(|v| v * scale).collect();
        launch.write_f32(out, &values)
    });
    // ember_add_f32(float* out, const float* a, const float* b, uint32_t n, uint32_t n_b)
    driver.register_kernel("ember_add_f32", |launch| {
        let (out, a, b) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?, launch.ptr_arg(2)?);
        let n = launch.u32_arg(3)? as usize;
        let n_b = launch.u32_arg(4)? as usize;
        let a = launch.read_f32(a, n)?;
        let b = launch.read_f32(b, n_b)?;
        let values: Vec<f32> = a.iter().enumerate().map(|(i, v)| v + b[i % n_b]).collect();
        launch.write_f32(out, &values)
    });
}

fn upload_f32(b: &GpuBackend, buf: &GpuBuf, values: &[f32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.context()
        .upload(buf.ptr("test", values.len()).unwrap(), &bytes)
        .unwrap();
}

/// A stand-in for a forward pass of `n` tokens: begin, `x = x * factor + bias` twice, read,
/// end. Returns what was read and whether the backend asked for the pass again.
fn step(b: &GpuBackend, n: usize, x: &mut GpuBuf, bias: &GpuBuf, factor: f32) -> (Vec<f32>, bool) {
    let tokens: Vec<u32> = (0..n as u32).collect();
    let batch = Batch::for_sequence(0, 0, &tokens, false);
    let plan = AttentionPlan {
        id: 1000 + n as u64,
        block_size: 32,
        slots: (0..n as u32).collect(),
        positions: (0..n as u32).collect(),
        table_of_token: vec![0; n],
        tables: vec![vec![0]],
    };
    b.begin_forward(&batch, &plan, &[n - 1]);
    let len = 4 * n;
    let mut out = Vec::new();
    let body = |x: &mut GpuBuf, out: &mut Vec<f32>| {
        for _ in 0..2 {
            b.scale(x, len, factor);
            b.add_inplace(x, bias, len);
        }
        b.read(x, len, out);
    };
    body(x, &mut out);
    let redo = b.end_forward();
    if redo {
        body(x, &mut out);
    }
    (out, redo)
}

fn expected_step(x: &mut [f32], bias: &[f32], factor: f32) -> Vec<f32> {
    for _ in 0..2 {
        for (v, b) in x.iter_mut().zip(bias) {
            *v = *v * factor + b;
        }
    }
    x.to_vec()
}

#[test]
fn decode_steps_replay_a_graph_with_the_results_of_direct_launches() {
    let (b, driver, _dir) = backend_with_kernels();
    // Four values per token, for batches up to one token past the largest graphed one.
    let len = 4 * (super::graph::GRAPH_MAX_TOKENS + 1);
    let mut x = b.alloc(len);
    let bias = b.alloc(len);
    let mut host_x: Vec<f32> = (0..len).map(|i| (i % 64) as f32 * 0.25 - 3.0).collect();
    let host_bias: Vec<f32> = (0..len).map(|i| 1.0 - (i % 64) as f32 * 0.125).collect();
    upload_f32(&b, &x, &host_x);
    upload_f32(&b, &bias, &host_bias);

    for (i, factor) in [0.5f32, 2.0, -1.5].into_iter().enumerate() {
        let (out, redo) = step(&b, 1, &mut x, &bias, factor);
        assert!(!redo);
        assert_eq!(b.take_failure(), None);
        let expected = expected_step(&mut host_x[..4], &host_bias[..4], factor);
        assert_eq!(out, expected, "step {i}");
        let stats = b.graph_stats();
        assert_eq!(stats.launched, i as u64 + 1);
        assert_eq!(
            stats.instantiated, 1,
            "one shape, updated in place after the first step"
        );
        assert_eq!(stats.updated, i as u64);
    }
    assert_eq!(driver.direct_launches(), 0, "every op ran inside a graph");
    assert_eq!(driver.graph_launches(), 3);
    let summary = b.graph_stats().summary();
    assert!(
        summary.starts_with(
            "3 graph steps (3 graphs launched, 2 updated in place, 1 instantiated, 0 redone)"
        ),
        "{summary}"
    );

    // Other small shapes get graphs of their own; a batch past the largest graphed size
    // launches directly.
    let (out, _) = step(&b, 8, &mut x, &bias, 1.0);
    assert_eq!(out, expected_step(&mut host_x[..32], &host_bias[..32], 1.0));
    assert_eq!(b.graph_stats().instantiated, 2);
    let (out, _) = step(&b, 16, &mut x, &bias, 1.0);
    assert_eq!(out, expected_step(&mut host_x[..64], &host_bias[..64], 1.0));
    assert_eq!(b.graph_stats().instantiated, 3);
    assert_eq!(b.graph_stats().launched, 5);
    assert_eq!(driver.direct_launches(), 0);
    let (out, _) = step(&b, super::graph::GRAPH_MAX_TOKENS + 1, &mut x, &bias, 1.0);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 1.0));
    assert_eq!(
        b.graph_stats().launched,
        5,
        "no graph past {} tokens",
        super::graph::GRAPH_MAX_TOKENS
    );
    assert_eq!(driver.direct_launches(), 4);
}

/// A stand-in for a forward pass of one token through `n_layers` layers, each `x = x * factor +
/// bias` followed by [`Backend::layer_done`]; at `abort_in` a new rope table is uploaded, which a
/// capture cannot record. A repeat starts from `start` again (a real pass recomputes its inputs
/// from the token ids). Returns what was read and whether the pass ran twice.
fn layered_step(
    b: &GpuBackend,
    n_layers: usize,
    start: &[f32],
    x: &mut GpuBuf,
    bias: &GpuBuf,
    factor: f32,
    abort_in: Option<usize>,
) -> (Vec<f32>, bool) {
    let batch = Batch::for_sequence(0, 0, &[7], false);
    let plan = AttentionPlan {
        id: 77,
        block_size: 32,
        slots: vec![0],
        positions: vec![0],
        table_of_token: vec![0],
        tables: vec![vec![0]],
    };
    let factors = [1.0f32, 2.0];
    let params = RopeParams {
        n_dims: 4,
        freq_base: 10000.0,
        freq_scale: 1.0,
        freq_factors: Some(&factors),
    };
    let mut rope = b.rope_table_new();
    let mut out = Vec::new();
    let mut body = |x: &mut GpuBuf, out: &mut Vec<f32>, abort_in: Option<usize>| {
        for layer in 0..n_layers {
            b.scale(x, start.len(), factor);
            b.add_inplace(x, bias, start.len());
            if abort_in == Some(layer) {
                b.rope_table(&[0], &params, &mut rope);
            }
            b.layer_done(layer, n_layers);
        }
        b.read(x, start.len(), out);
    };
    upload_f32(b, x, start);
    b.begin_forward(&batch, &plan, &[0]);
    body(x, &mut out, abort_in);
    let redo = b.end_forward();
    if redo {
        upload_f32(b, x, start);
        body(x, &mut out, None);
        assert!(!b.end_forward());
    }
    (out, redo)
}

fn expected_layers(start: &[f32], bias: &[f32], factor: f32, n_layers: usize) -> Vec<f32> {
    let mut x = start.to_vec();
    for _ in 0..n_layers {
        for (v, b) in x.iter_mut().zip(bias) {
            *v = *v * factor + b;
        }
    }
    x
}

#[test]
fn a_pass_recorded_in_segments_runs_each_part_as_it_is_recorded() {
    let (b, driver, _dir) = backend_with_kernels();
    b.set_graph_segment_layers(2);
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let start = [1.0f32, -2.0, 0.5, 3.0];
    let host_bias = [0.25f32, -0.5, 1.0, 0.0];
    upload_f32(&b, &bias, &host_bias);
    // Six layers in parts of two: boundaries after layers 0, 1 and 3 (never after the last), so
    // the parts are [0], [1], [2, 3], [4, 5 and the read].
    for (i, factor) in [0.5f32, -1.25].into_iter().enumerate() {
        let (out, redo) = layered_step(&b, 6, &start, &mut x, &bias, factor, None);
        assert!(!redo);
        assert_eq!(b.take_failure(), None);
        assert_eq!(out, expected_layers(&start, &host_bias, factor, 6));
        let stats = b.graph_stats();
        assert_eq!(stats.steps, i as u64 + 1);
        assert_eq!(stats.launched, 4 * (i as u64 + 1), "four parts per step");
        assert_eq!(
            stats.instantiated, 4,
            "one graph per part, updated in later steps"
        );
        assert_eq!(stats.updated, 4 * i as u64);
    }
    assert_eq!(driver.direct_launches(), 0, "every op ran inside a graph");

    // A part that cannot be recorded: the parts before it already ran; the whole pass runs
    // again with plain launches and gives the same result.
    let launched = b.graph_stats().launched;
    let (out, redo) = layered_step(&b, 6, &start, &mut x, &bias, 2.0, Some(4));
    assert!(redo, "the pass ran again");
    assert_eq!(b.take_failure(), None);
    assert_eq!(out, expected_layers(&start, &host_bias, 2.0, 6));
    assert_eq!(
        b.graph_stats().launched,
        launched + 3,
        "the three parts before layer 4 ran"
    );
    assert_eq!(b.graph_stats().redone, 1);
    assert!(b.graphs_enabled(), "one abort does not turn graphs off");

    // One graph per pass when segments are off.
    b.set_graph_segment_layers(0);
    let launched = b.graph_stats().launched;
    let (out, _) = layered_step(&b, 6, &start, &mut x, &bias, 0.75, None);
    assert_eq!(out, expected_layers(&start, &host_bias, 0.75, 6));
    assert_eq!(b.graph_stats().launched, launched + 1);
}

#[test]
fn graphs_off_give_the_same_results_with_plain_launches() {
    let (b, driver, _dir) = backend_with_kernels();
    b.set_graphs(false);
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let mut host_x = vec![1.0f32, -2.0, 3.5, 0.25];
    let host_bias = vec![0.5f32, 0.5, -1.0, 2.0];
    upload_f32(&b, &x, &host_x);
    upload_f32(&b, &bias, &host_bias);
    let (out, redo) = step(&b, 1, &mut x, &bias, 3.0);
    assert!(!redo);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 3.0));
    assert_eq!(driver.graph_launches(), 0);
    assert_eq!(driver.direct_launches(), 4);
}

#[test]
fn a_capture_that_cannot_start_falls_back_to_plain_launches() {
    let (b, driver, _dir) = backend_with_kernels();
    driver.fail_graphs(true);
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let mut host_x = vec![1.0f32, 2.0, 3.0, 4.0];
    let host_bias = vec![-1.0f32; 4];
    upload_f32(&b, &x, &host_x);
    upload_f32(&b, &bias, &host_bias);
    let (out, redo) = step(&b, 1, &mut x, &bias, 2.0);
    assert!(!redo, "the pass ran directly from the start");
    assert_eq!(b.take_failure(), None);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 2.0));
    assert!(!b.graphs_enabled(), "graphs are off after the failed start");
    assert_eq!(driver.direct_launches(), 4);
    // Later steps do not try again.
    driver.fail_graphs(false);
    let (out, _) = step(&b, 1, &mut x, &bias, 2.0);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 2.0));
    assert_eq!(driver.graph_launches(), 0);
}

#[test]
fn an_aborted_capture_runs_the_pass_again_with_plain_launches() {
    let (b, driver, _dir) = backend_with_kernels();
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let mut host_x = vec![1.0f32, 2.0, 3.0, 4.0];
    let host_bias = vec![0.5f32; 4];
    upload_f32(&b, &x, &host_x);
    upload_f32(&b, &bias, &host_bias);
    let batch = Batch::for_sequence(0, 0, &[3], false);
    let plan = AttentionPlan {
        id: 5,
        block_size: 32,
        slots: vec![0],
        positions: vec![0],
        table_of_token: vec![0],
        tables: vec![vec![0]],
    };
    b.begin_forward(&batch, &plan, &[0]);
    b.scale(&mut x, 4, 2.0);
    // New rope frequency factors are uploaded, which a capture cannot record.
    let mut rope = b.rope_table_new();
    let factors = [1.0f32, 2.0];
    let params = RopeParams {
        n_dims: 4,
        freq_base: 10000.0,
        freq_scale: 1.0,
        freq_factors: Some(&factors),
    };
    b.rope_table(&[0], &params, &mut rope);
    b.add_inplace(&mut x, &bias, 4);
    let mut out = vec![1.0];
    b.read(&x, 4, &mut out);
    assert!(out.is_empty(), "no results from a pass that must run again");
    assert!(b.end_forward(), "the pass must run again");
    assert_eq!(b.take_failure(), None);
    assert_eq!(b.graph_stats().redone, 1);
    assert!(b.graphs_enabled(), "one abort does not turn graphs off");
    // The repeat runs directly; the scale recorded before the abort never ran, and the add after
    // it ran directly, so the repeat starts from x + bias (a real pass recomputes its inputs).
    upload_f32(&b, &x, &host_x);
    b.scale(&mut x, 4, 2.0);
    b.rope_table(&[0], &params, &mut rope);
    b.add_inplace(&mut x, &bias, 4);
    b.read(&x, 4, &mut out);
    assert!(!b.end_forward());
    for v in &mut host_x {
        *v = *v * 2.0 + 0.5;
    }
    assert_eq!(out, host_x);
    assert_eq!(driver.graph_launches(), 0);
    // The next step records again.
    let (out, redo) = step(&b, 1, &mut x, &bias, 1.0);
    assert!(!redo);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 1.0));
    assert_eq!(driver.graph_launches(), 1);
}

#[test]
fn a_pool_trim_drops_the_cached_graphs() {
    let (b, _driver, _dir) = backend_with_kernels();
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let mut host_x = vec![1.0f32, 2.0, 3.0, 4.0];
    let host_bias = vec![0.5f32; 4];
    upload_f32(&b, &x, &host_x);
    upload_f32(&b, &bias, &host_bias);
    step(&b, 1, &mut x, &bias, 2.0);
    step(&b, 1, &mut x, &bias, 2.0);
    assert_eq!(b.graph_stats().instantiated, 1);
    // Memory given back to the driver: the cached graph is dropped and made anew.
    drop(b.alloc(1 << 20));
    b.pool().trim_now().unwrap();
    let (out, _) = step(&b, 1, &mut x, &bias, 2.0);
    expected_step(&mut host_x, &host_bias, 2.0);
    expected_step(&mut host_x, &host_bias, 2.0);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 2.0));
    let stats = b.graph_stats();
    assert_eq!(stats.instantiated, 2);
    assert_eq!(stats.updated, 1);
}

#[test]
fn an_op_failing_inside_a_capture_fails_the_pass_alone() {
    let (b, driver, _dir) = backend_with_kernels();
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    upload_f32(&b, &x, &[1.0; 4]);
    upload_f32(&b, &bias, &[1.0; 4]);
    b.inject_out_of_memory();
    let (out, redo) = step(&b, 1, &mut x, &bias, 2.0);
    assert!(!redo, "a failed pass is not repeated");
    assert!(out.is_empty());
    assert!(b.take_failure().is_some_and(|f| f.out_of_memory));
    assert_eq!(driver.graph_launches(), 0);
    assert!(b.graphs_enabled());
    // The next pass records and runs.
    let (out, _) = step(&b, 1, &mut x, &bias, 2.0);
    assert_eq!(
        out,
        vec![7.0; 4],
        "the failed pass ran nothing: (1*2+1)*2+1"
    );
}

/// [`backend_with_kernels`] in reference numerics. The graph-test step's ops (scale, add) round
/// once, so both numerics run the same kernels for them.
fn reference_backend_with_kernels() -> (GpuBackend, Arc<HostDriver>, tempfile::TempDir) {
    let (mut b, driver, dir) = backend_with_kernels();
    b.set_numerics(Numerics::Reference);
    (b, driver, dir)
}

#[test]
fn reference_numerics_run_the_exact_kernels_without_graphs() {
    let (b, driver, _dir) = reference_backend_with_kernels();
    assert_eq!(b.numerics(), Numerics::Reference);
    assert!(!b.graphs_enabled(), "reference numerics turn graphs off");
    // Turning graphs back on does not make the reference mode record: its passes upload.
    b.set_graphs(true);
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let mut host_x = vec![1.0f32, -2.0, 3.5, 0.25];
    let host_bias = vec![0.5f32, 0.5, -1.0, 2.0];
    b.write(&mut x, &host_x);
    upload_f32(&b, &bias, &host_bias);
    let (out, redo) = step(&b, 1, &mut x, &bias, 3.0);
    assert!(!redo);
    assert_eq!(b.take_failure(), None);
    assert_eq!(out, expected_step(&mut host_x, &host_bias, 3.0));
    assert_eq!(driver.graph_launches(), 0);
    assert_eq!(
        driver.direct_launches(),
        4,
        "two scales and two adds, one launch each"
    );
}

#[test]
fn reference_numerics_name_themselves_and_refuse_soft_capping() {
    let (mut b, _driver, _dir) = reference_backend_with_kernels();
    assert_eq!(
        b.describe(),
        "host test device, reference numerics (2 reference threads)"
    );
    b.set_reference_threads(4);
    assert_eq!(b.reference_threads(), 4);
    assert!(b.describe().ends_with("(4 reference threads)"));
    let mut x = b.alloc(4);
    b.softcap(&mut x, 4, 30.0);
    let failure = b.take_failure().expect("soft-capping is refused");
    assert_eq!(failure.op, "softcap");
    assert!(
        failure.cause.contains("reference numerics"),
        "{}",
        failure.cause
    );
    assert!(!failure.out_of_memory);
    // The fast mode is the default and keeps its description.
    let fast = backend(None);
    assert_eq!(fast.numerics(), Numerics::Fast);
    assert_eq!(fast.describe(), "host test device");
    assert_eq!(fast.reference_threads(), DEFAULT_REFERENCE_THREADS);
}

/// Runs `f` on a one-thread CPU backend inside its pool.
fn with_cpu<R: Send>(f: impl FnOnce(&crate::backend::cpu::CpuBackend) -> R + Send) -> R {
    let cpu = crate::backend::cpu::CpuBackend::new(1).expect("cpu backend");
    cpu.install(|| f(&cpu))
}

#[test]
fn the_host_gelu_table_is_the_cpu_backends() {
    use half::f16;
    let table = numerics::gelu_table();
    assert_eq!(table.len(), ember_gpu::ops::GELU_TABLE_LEN);
    // Every entry the exact kernel can read: inputs strictly inside (-10, 10), whose f16
    // rounding is any f16 value in [-10, 10]. The CPU's geglu with up = 1 returns its table
    // entry for x unchanged; ±9.999 round to ±10, reaching the two end entries.
    let mut gate: Vec<f32> = (0..=u16::MAX)
        .map(|bits| f16::from_bits(bits).to_f32())
        .filter(|x| x.abs() < 10.0)
        .collect();
    gate.extend([9.999f32, -9.999]);
    let len = gate.len();
    let up = vec![1.0f32; len];
    let cpu_out = with_cpu(|cpu| {
        let mut g = gate.clone();
        cpu.geglu(&mut g, &up, len);
        g
    });
    for (x, got) in gate.iter().zip(&cpu_out) {
        let want = table[f16::from_f32(*x).to_bits() as usize].to_f32();
        assert_eq!(got.to_bits(), want.to_bits(), "x = {x}");
    }
}

#[test]
fn the_host_rope_table_is_the_cpu_backends() {
    let factors: Vec<f32> = (0..128).map(|i| 1.0 + i as f32 * 0.37).collect();
    let positions = [0u32, 1, 2, 7, 100, 511, 512, 4095, 30000];
    for (n_dims, base, scale, with_factors) in [
        (64usize, 10000.0f32, 1.0f32, false),
        (128, 500000.0, 1.0, true),
        (256, 1_000_000.0, 0.125, false),
        (32, 10000.0, 0.25, true),
    ] {
        let params = RopeParams {
            n_dims,
            freq_base: base,
            freq_scale: scale,
            freq_factors: with_factors.then_some(&factors[..n_dims / 2]),
        };
        let mut host = Vec::new();
        numerics::rope_cos_sin(&positions, &params, &mut host);
        // The CPU's rope of heads of (1, 0) pairs gives back its cosines and sines exactly:
        // fma(1, c, -(0 s)) = c and fma(1, s, 0 c) = s.
        let n = positions.len();
        let cpu_out = with_cpu(|cpu| {
            let mut table = cpu.rope_table_new();
            cpu.rope_table(&positions, &params, &mut table);
            let mut x: Vec<f32> = (0..n * n_dims)
                .map(|i| if i % 2 == 0 { 1.0 } else { 0.0 })
                .collect();
            cpu.rope(&mut x, &table, n, 1, n_dims, RopeMode::Normal);
            x
        });
        assert_eq!(host.len(), cpu_out.len());
        for (i, (h, c)) in host.iter().zip(&cpu_out).enumerate() {
            assert_eq!(
                h.to_bits(),
                c.to_bits(),
                "n_dims {n_dims}, token {}, value {}",
                i / n_dims,
                i % n_dims
            );
        }
    }
}

#[test]
fn evenly_spaced_rows_are_recognised_for_the_strided_gather() {
    assert_eq!(evenly_spaced(&[]), None);
    assert_eq!(evenly_spaced(&[5]), Some((5, 0)));
    assert_eq!(evenly_spaced(&[0, 1, 2, 3]), Some((0, 1)));
    // One layer's slice of Gemma 4's per-layer inputs: token t's row t * n_layer + layer.
    assert_eq!(evenly_spaced(&[3, 13, 23]), Some((3, 10)));
    assert_eq!(evenly_spaced(&[0, 1, 3]), None);
    assert_eq!(evenly_spaced(&[2, 0]), None);
    assert_eq!(evenly_spaced(&[4, 4]), None);
}

#[test]
fn expert_scales_are_uploaded_once_and_again_when_their_values_change() {
    let b = backend(None);
    let mut scale = vec![0.5f32, 2.0, -1.0, 4.0];
    let first = b.expert_scale_ptr(&scale).unwrap();
    assert_eq!(b.expert_scale_ptr(&scale).unwrap(), first);
    let mut bytes = vec![0u8; 16];
    b.context().download(first, &mut bytes).unwrap();
    let on_device: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(on_device, scale);
    // The same host slice with other values (as after a reload into the same memory).
    scale[1] = 3.0;
    let second = b.expert_scale_ptr(&scale).unwrap();
    b.context().download(second, &mut bytes).unwrap();
    assert_eq!(f32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3.0);
    assert_eq!(lock(&b.expert_scales).entries_len(), 1);
}

#[test]
fn gemma4_ops_and_head_sizes_follow_the_numerics() {
    let mut b = backend(None);
    assert!(b.has_gemma4_ops());
    assert_eq!(b.max_head_dim(), Some(512));
    b.set_numerics(Numerics::Reference);
    assert!(!b.has_gemma4_ops());
    assert_eq!(b.max_head_dim(), Some(ember_gpu::ops::EXACT_MAX_HEAD_DIM));
}

/// Bytes of one layer's device address table for `blocks` block ids (a K and a V address each).
fn address_table_bytes(blocks: usize) -> u64 {
    (2 * 8 * blocks) as u64
}

#[test]
fn a_huge_context_starts_with_a_small_address_table() {
    let b = backend(None);
    // `-c 100000000` in blocks of 16 tokens, two KV heads of 16 values: 1 KiB per block for K
    // and for V. A table sized from the context would be 100 MB per layer.
    let max_blocks = 100_000_000 / 16;
    let mut cache = KvCache::new(&b, &[(2, 16), (2, 16)], 16, 100_000_000, max_blocks);
    let tables = 2 * address_table_bytes(INITIAL_TABLE_BLOCKS);
    assert_eq!(b.pool().usage().purpose(Purpose::Kv).current, tables);
    assert_eq!(cache.layer(0).table_capacity(), INITIAL_TABLE_BLOCKS);

    // A one-token prompt adds one block per layer and nothing to the tables.
    let mut plan = AttentionPlan::default();
    cache
        .plan(&b, &Batch::for_sequence(0, 0, &[1], false), &mut plan)
        .unwrap();
    let block = 16 * 2 * 16 * 2;
    assert_eq!(
        b.pool().usage().purpose(Purpose::Kv).current,
        tables + 2 * 2 * block
    );
    assert_eq!(cache.layer(1).table_capacity(), INITIAL_TABLE_BLOCKS);

    // A block id past the layer's blocks is a shape error naming the limit, not a table of its
    // size.
    let mut layer = b.kv_layer(40, 16, 2, 16);
    b.kv_materialize(&mut layer, &[40]);
    let failure = b.take_failure().expect("a failure");
    assert_eq!(failure.op, "kv_materialize");
    assert!(
        failure
            .cause
            .contains("expected a block id below 40, found block 40"),
        "{}",
        failure.cause
    );
    assert_eq!(layer.table_capacity(), INITIAL_TABLE_BLOCKS);
}

#[test]
fn the_address_table_doubles_up_to_the_layers_blocks_and_keeps_its_entries() {
    let b = backend(None);
    let mut layer = b.kv_layer(40, 4, 2, 16);
    b.kv_materialize(&mut layer, &[0, 5]);
    assert_eq!(layer.table_capacity(), 16);
    let first_table = layer.tables().unwrap().0;
    // Block 20 needs 21 entries: the table doubles to 32.
    b.kv_materialize(&mut layer, &[20]);
    assert_eq!(b.take_failure(), None);
    assert_eq!(layer.table_capacity(), 32);
    let (k_table, v_table) = layer.tables().unwrap();
    assert_ne!(k_table, first_table, "a new device table");
    assert_eq!(
        v_table,
        k_table.offset(32 * 8),
        "the V half after 32 K entries"
    );
    let expected = |blocks: &[Option<PoolBuffer>]| -> Vec<u64> {
        blocks
            .iter()
            .map(|buf| buf.as_ref().map_or(0, |buf| buf.ptr().0))
            .collect()
    };
    let k = download_u64(&b, k_table, 32);
    let v = download_u64(&b, v_table, 32);
    assert_eq!(k, expected(&layer.k));
    assert_eq!(v, expected(&layer.v));
    let set: Vec<usize> = (0..32).filter(|&i| k[i] != 0).collect();
    assert_eq!(set, [0, 5, 20], "the old entries moved, the new one added");
    assert!(v[0] != 0 && v[5] != 0 && v[20] != 0);
    // Doubling again would pass the layer's 40 blocks: the table stops there.
    b.kv_materialize(&mut layer, &[39]);
    assert_eq!(b.take_failure(), None);
    assert_eq!(layer.table_capacity(), 40);
    // Only the live table is held: 40 blocks' entries and the four blocks' K and V.
    assert_eq!(
        b.pool().usage().purpose(Purpose::Kv).current,
        address_table_bytes(40) + 4 * 2 * (4 * 2 * 16 * 2)
    );
}

fn read_bytes<const N: usize>(
    launch: &ember_gpu::host::HostLaunch<'_>,
    ptr: DevicePtr,
    index: usize,
) -> Result<[u8; N], String> {
    let mut bytes = [0u8; N];
    launch.read(ptr.offset((index * N) as u64), &mut bytes)?;
    Ok(bytes)
}

fn read_i32(
    launch: &ember_gpu::host::HostLaunch<'_>,
    ptr: DevicePtr,
    index: usize,
) -> Result<i32, String> {
    read_bytes::<4>(launch, ptr, index).map(i32::from_le_bytes)
}

fn read_u64(
    launch: &ember_gpu::host::HostLaunch<'_>,
    ptr: DevicePtr,
    index: usize,
) -> Result<u64, String> {
    read_bytes::<8>(launch, ptr, index).map(u64::from_le_bytes)
}

/// Rust twins of `ember_kv_store_f16` and `ember_attention_prefill_d64` (arguments in the order
/// of their C signatures, see `ember_gpu::ops::attention`): both reach the K/V blocks only
/// through the layer's device address table, as the kernels do, so a table whose entries or V
/// half are misplaced gives other results. The arithmetic is plain (f32 in key order), not the
/// kernels'; the tests compare runs of the same twins.
fn register_attention_twins(driver: &HostDriver) {
    // ember_kv_store_f16(const uint64_t* k_blocks, const uint64_t* v_blocks, const float* k,
    // const float* v, const int32_t* slots, uint32_t row_values, uint32_t block_size); one
    // thread block per token.
    driver.register_kernel("ember_kv_store_f16", |launch| {
        let (k_blocks, v_blocks) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?);
        let (k, v, slots) = (launch.ptr_arg(2)?, launch.ptr_arg(3)?, launch.ptr_arg(4)?);
        let row = launch.u32_arg(5)? as usize;
        let block_size = launch.u32_arg(6)? as usize;
        for t in 0..launch.config().grid[0] as usize {
            let slot = read_i32(launch, slots, t)?;
            if slot < 0 {
                continue;
            }
            let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
            for (table, src) in [(k_blocks, k), (v_blocks, v)] {
                let base = read_u64(launch, table, block)?;
                if base == 0 {
                    continue;
                }
                let values = launch.read_f32(src.offset((t * row * 4) as u64), row)?;
                let halves: Vec<u8> = values
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                launch.write(DevicePtr(base + (offset * row * 2) as u64), &halves)?;
            }
        }
        Ok(())
    });
    // ember_attention_prefill_d64(float* out, const float* q, const uint64_t* k_blocks, const
    // uint64_t* v_blocks, const int32_t* block_tables, const int32_t* table_of_token, const
    // int32_t* positions, uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t
    // head_dim, uint32_t block_size, uint32_t max_blocks_per_table, float scale, int32_t window,
    // float softcap)
    driver.register_kernel("ember_attention_prefill_d64", |launch| {
        let (out, q) = (launch.ptr_arg(0)?, launch.ptr_arg(1)?);
        let (k_blocks, v_blocks) = (launch.ptr_arg(2)?, launch.ptr_arg(3)?);
        let (tables, table_of_token, positions) =
            (launch.ptr_arg(4)?, launch.ptr_arg(5)?, launch.ptr_arg(6)?);
        let n_tokens = launch.u32_arg(7)? as usize;
        let n_heads = launch.u32_arg(8)? as usize;
        let n_kv_heads = launch.u32_arg(9)? as usize;
        let head_dim = launch.u32_arg(10)? as usize;
        let block_size = launch.u32_arg(11)? as usize;
        let max_blocks = launch.u32_arg(12)? as usize;
        let scale = launch.f32_arg(13)?;
        if !matches!(launch.args()[14], KernelArg::I32(0)) || launch.f32_arg(15)? != 0.0 {
            return Err("the twin has no window or softcap".into());
        }
        let row = n_kv_heads * head_dim;
        let read_row = |table: DevicePtr, block: usize, offset: usize, head: usize| {
            let base = read_u64(launch, table, block)?;
            let mut bytes = vec![0u8; head_dim * 2];
            launch.read(
                DevicePtr(base + ((offset * row + head * head_dim) * 2) as u64),
                &mut bytes,
            )?;
            Ok::<_, String>(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect::<Vec<f32>>(),
            )
        };
        for t in 0..n_tokens {
            let table = read_i32(launch, table_of_token, t)? as usize;
            let position = read_i32(launch, positions, t)? as usize;
            for h in 0..n_heads {
                let kv_head = h / (n_heads / n_kv_heads);
                let query = launch.read_f32(
                    q.offset(((t * n_heads + h) * head_dim * 4) as u64),
                    head_dim,
                )?;
                let mut scores = Vec::with_capacity(position + 1);
                let mut values = Vec::with_capacity(position + 1);
                for p in 0..=position {
                    let block =
                        read_i32(launch, tables, table * max_blocks + p / block_size)? as usize;
                    let key = read_row(k_blocks, block, p % block_size, kv_head)?;
                    let dot: f32 = query.iter().zip(&key).map(|(a, b)| a * b).sum();
                    scores.push(dot * scale);
                    values.push(read_row(v_blocks, block, p % block_size, kv_head)?);
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f32 = weights.iter().sum();
                let mut result = vec![0f32; head_dim];
                for (w, value) in weights.iter().zip(&values) {
                    for (r, x) in result.iter_mut().zip(value) {
                        *r += w / sum * x;
                    }
                }
                launch.write_f32(
                    out.offset(((t * n_heads + h) * head_dim * 4) as u64),
                    &result,
                )?;
            }
        }
        Ok(())
    });
}

/// Runs two sequences through one attention layer in chunks (two to seven tokens, alternating
/// between the sequences, so their blocks interleave), with decode graphs on: each chunk is
/// planned by the cache, its K and V stored and attended to, and the attention output read
/// back. `grown_first`: the layer's address table is made as large as the cache before the
/// first chunk. Returns the outputs of every chunk and the table capacities seen after each.
fn run_attention_chunks(grown_first: bool) -> (Vec<Vec<f32>>, Vec<usize>) {
    let (b, _driver, _dir) = backend_with(None, register_attention_twins);
    b.set_graphs(true);
    let (n_heads, n_kv_heads, head_dim) = (4, 2, 16);
    // Blocks of 2 tokens, room for 128 of them.
    let mut cache = KvCache::new(&b, &[(n_kv_heads, head_dim)], 2, 256, 128);
    if grown_first {
        cache.layer_mut(0).grow_table(b.context(), 128).unwrap();
    }
    let mut plan = AttentionPlan::default();
    let (mut q, mut k, mut v, mut out) = (b.alloc(0), b.alloc(0), b.alloc(0), b.alloc(0));
    let mut outputs = Vec::new();
    let mut capacities = Vec::new();
    let mut lengths = [0u32; 2];
    let mut value_seed = 0u32;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                value_seed = value_seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                ((value_seed >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    };
    for chunk in 0..24usize {
        let seq = chunk % 2;
        let n = 2 + chunk % 6;
        let tokens: Vec<u32> = (0..n as u32).collect();
        let batch = Batch::for_sequence(seq as u32, lengths[seq], &tokens, false);
        lengths[seq] += n as u32;
        cache.plan(&b, &batch, &mut plan).unwrap();
        for (buf, len) in [
            (&mut q, n * n_heads * head_dim),
            (&mut k, n * n_kv_heads * head_dim),
            (&mut v, n * n_kv_heads * head_dim),
            (&mut out, n * n_heads * head_dim),
        ] {
            b.ensure_len(buf, len);
        }
        // The inputs reach the device before the pass is recorded, as a model's embeddings do.
        b.write(&mut q, &values(n * n_heads * head_dim));
        b.write(&mut k, &values(n * n_kv_heads * head_dim));
        b.write(&mut v, &values(n * n_kv_heads * head_dim));
        b.begin_forward(&batch, &plan, &[n - 1]);
        let pass = |out: &mut GpuBuf, result: &mut Vec<f32>, layer: &mut GpuKvLayer| {
            b.kv_store(layer, &k, &v, &plan);
            b.attention(
                &q, layer, &plan, n_heads, n_kv_heads, head_dim, 0.25, None, out,
            );
            b.read(out, n * n_heads * head_dim, result);
        };
        let mut result = Vec::new();
        pass(&mut out, &mut result, cache.layer_mut(0));
        if b.end_forward() {
            pass(&mut out, &mut result, cache.layer_mut(0));
        }
        assert_eq!(b.take_failure(), None, "chunk {chunk}");
        outputs.push(result);
        capacities.push(cache.layer(0).table_capacity());
    }
    assert!(b.graph_stats().launched > 0, "the chunks ran as graphs");
    (outputs, capacities)
}

#[test]
fn attention_over_a_growing_address_table_matches_a_table_grown_first() {
    let (grown, capacities) = run_attention_chunks(false);
    let (reference, reference_capacities) = run_attention_chunks(true);
    assert!(reference_capacities.iter().all(|&c| c == 128));
    // 48 and 60 tokens in blocks of 2: 54 blocks, so the table grew twice, past 16 and 32.
    let mut steps = capacities.clone();
    steps.dedup();
    assert_eq!(steps, [16, 32, 64], "{capacities:?}");
    assert_eq!(grown.len(), reference.len());
    for (chunk, (a, b)) in grown.iter().zip(&reference).enumerate() {
        assert!(
            a.iter().any(|&x| x != 0.0),
            "chunk {chunk} attended to nothing"
        );
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "chunk {chunk}");
    }
}

#[test]
fn an_address_table_growth_over_the_budget_fails_the_plan_cleanly() {
    // One layer, blocks of 4 tokens of 2 heads of 16: 256 bytes for K and for V. The budget
    // holds the first table (16 entries) and 16 blocks, not the 32-entry table the 17th block
    // needs.
    let block = 4 * 2 * 16 * 2;
    let budget = address_table_bytes(16) + 16 * 2 * block + block;
    let b = backend(Some(budget));
    let mut cache = KvCache::new(&b, &[(2, 16)], 4, 4096, 1024);
    let mut plan = AttentionPlan::default();
    cache
        .plan(&b, &Batch::for_sequence(0, 0, &[1; 64], false), &mut plan)
        .unwrap();
    assert_eq!(cache.layer(0).table_capacity(), 16);
    let kv_before = b.pool().usage().purpose(Purpose::Kv).current;
    let stats_before = cache.stats();
    let error = cache
        .plan(&b, &Batch::for_sequence(0, 64, &[1], false), &mut plan)
        .unwrap_err();
    let KvError::Memory(failure) = &error else {
        panic!("expected a memory failure, found {error:?}");
    };
    assert_eq!(failure.op, "kv_materialize");
    assert!(failure.out_of_memory, "{failure}");
    assert_eq!(error.to_string().lines().count(), 1, "{error}");
    assert_eq!(
        cache.layer(0).table_capacity(),
        16,
        "the table is unchanged"
    );
    assert_eq!(b.pool().usage().purpose(Purpose::Kv).current, kv_before);
    assert_eq!(cache.stats(), stats_before);
    assert_eq!(cache.seq_len(0), 64);
    // Attention over what the sequence holds still finds its table.
    assert!(cache.layer(0).tables().is_ok());
}

/// The pass of a split's later device: its capture opens at `begin_forward`, the activations
/// arrive by `Backend::write` once the earlier devices ran their layers, then its own layers
/// run. The write comes before any op was recorded, so the pass is still one graph: no repeat
/// (a repeat would run the earlier devices' layers twice), no direct launch.
#[test]
fn activations_written_before_a_devices_first_op_keep_the_pass_recorded() {
    let (b, driver, _dir) = backend_with_kernels();
    let mut x = b.alloc(4);
    let bias = b.alloc(4);
    let host_bias = [0.25f32, -0.5, 1.0, 0.0];
    upload_f32(&b, &bias, &host_bias);
    let batch = Batch::for_sequence(0, 0, &[3], false);
    let plan = AttentionPlan {
        id: 91,
        block_size: 32,
        slots: vec![0],
        positions: vec![0],
        table_of_token: vec![0],
        tables: vec![vec![0]],
    };
    for (i, start) in [[1.0f32, -2.0, 0.5, 3.0], [4.0, 0.0, -1.0, 2.0]]
        .into_iter()
        .enumerate()
    {
        b.begin_forward(&batch, &plan, &[0]);
        Backend::write(&b, &mut x, &start);
        for _ in 0..2 {
            b.scale(&mut x, 4, 1.5);
            b.add_inplace(&mut x, &bias, 4);
        }
        let mut out = Vec::new();
        b.read(&x, 4, &mut out);
        assert!(!b.end_forward(), "pass {i} needs no repeat");
        assert_eq!(b.take_failure(), None);
        assert_eq!(out, expected_layers(&start, &host_bias, 1.5, 2), "pass {i}");
        assert_eq!(b.graph_stats().launched, i as u64 + 1, "one graph per pass");
    }
    assert_eq!(driver.direct_launches(), 0, "every op ran inside a graph");
}
