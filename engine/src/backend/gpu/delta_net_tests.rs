//! The GPU backend's hybrid-model plumbing on the host driver: the delta-net kernels are Rust
//! twins here (the same math as kernels/delta_net.hip, in f32, one loop per launch over the whole
//! grid), so what is checked is what the backend feeds them: the sequence table, the state
//! buffers and their layer offsets, the rows, the scratch, and the launch arguments, against the
//! CPU backend on the same inputs. The kernels themselves are checked against a scalar reference
//! by kernels/tests/harness_delta_net.cu on a GPU.

use std::sync::Arc;

use ember_gpu::driver::KernelArg;
use ember_gpu::host::{HostDriver, HostDriverConfig, HostLaunch};
use ember_gpu::kernels::KernelLibrary;
use ember_gpu::ops::{GpuContext, GpuContextOptions};
use ember_gpu::{DevicePool, DevicePtr, Driver, PoolConfig, PoolKind, Purpose};

use super::super::{lock, GpuBackend, GpuBuf, GpuVector};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, GatedDeltaNet};
use crate::batch::SeqId;
use crate::recurrent_state::RecurrentStates;

fn u64_arg(l: &HostLaunch<'_>, index: usize) -> Result<u64, String> {
    match l.args().get(index) {
        Some(KernelArg::U64(v)) => Ok(*v),
        other => Err(format!("argument {index}: expected a u64, found {other:?}")),
    }
}

fn read_i32(l: &HostLaunch<'_>, ptr: DevicePtr, n: usize) -> Result<Vec<usize>, String> {
    let mut bytes = vec![0u8; n * 4];
    l.read(ptr, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect())
}

/// The table of a launch: state addresses and each sequence's rows.
fn read_seqs(
    l: &HostLaunch<'_>,
    states: usize,
    starts: usize,
    rows: usize,
    n_seq: usize,
) -> Result<Vec<(u64, Vec<usize>)>, String> {
    let mut bytes = vec![0u8; n_seq * 8];
    l.read(l.ptr_arg(states)?, &mut bytes)?;
    let addresses: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let starts = read_i32(l, l.ptr_arg(starts)?, n_seq + 1)?;
    let all_rows = read_i32(l, l.ptr_arg(rows)?, starts[n_seq])?;
    Ok(addresses
        .into_iter()
        .enumerate()
        .map(|(s, a)| (a, all_rows[starts[s]..starts[s + 1]].to_vec()))
        .collect())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (0.0 - x).exp())
}

fn register_twins(driver: &HostDriver) {
    // ember_split_query_gate_f32(q, gate, q_full, n_tokens, n_heads, head_dim)
    driver.register_kernel("ember_split_query_gate_f32", |l| {
        let n = (l.u32_arg(3)? * l.u32_arg(4)?) as usize;
        let hd = l.u32_arg(5)? as usize;
        let full = l.read_f32(l.ptr_arg(2)?, 2 * n * hd)?;
        let (mut q, mut gate) = (Vec::new(), Vec::new());
        for head in full.chunks_exact(2 * hd) {
            q.extend_from_slice(&head[..hd]);
            gate.extend_from_slice(&head[hd..]);
        }
        l.write_f32(l.ptr_arg(0)?, &q)?;
        l.write_f32(l.ptr_arg(1)?, &gate)
    });
    // ember_mul_sigmoid_f32(x, gate, n)
    driver.register_kernel("ember_mul_sigmoid_f32", |l| {
        let n = l.u32_arg(2)? as usize;
        let gate = l.read_f32(l.ptr_arg(1)?, n)?;
        let x: Vec<f32> = l
            .read_f32(l.ptr_arg(0)?, n)?
            .iter()
            .zip(&gate)
            .map(|(x, g)| x * (1.0 / (1.0 + (-g).exp())))
            .collect();
        l.write_f32(l.ptr_arg(0)?, &x)
    });
    // ember_delta_net_conv_f32(out, qkv, conv_w, states, starts, rows, channels, taps, state_offset)
    driver.register_kernel("ember_delta_net_conv_f32", |l| {
        let n_seq = l.config().grid[1] as usize;
        let (channels, taps) = (l.u32_arg(6)? as usize, l.u32_arg(7)? as usize);
        let offset = u64_arg(l, 8)?;
        let kept = taps - 1;
        let w = l.read_f32(l.ptr_arg(2)?, channels * taps)?;
        for (address, rows) in read_seqs(l, 3, 4, 5, n_seq)? {
            let state_ptr = DevicePtr(address + 4 * offset);
            let mut state = l.read_f32(state_ptr, channels * kept)?;
            let max_row = rows.iter().copied().max().unwrap_or(0);
            let qkv = l.read_f32(l.ptr_arg(1)?, (max_row + 1) * channels)?;
            let mut out = l.read_f32(l.ptr_arg(0)?, (max_row + 1) * channels)?;
            for c in 0..channels {
                let mut window: Vec<f32> = state[c * kept..(c + 1) * kept].to_vec();
                for &row in &rows {
                    window.push(qkv[row * channels + c]);
                    let mut sum = 0f32;
                    for k in 0..taps {
                        sum += window[k] * w[c * taps + k];
                    }
                    out[row * channels + c] = silu(sum);
                    window.remove(0);
                }
                state[c * kept..(c + 1) * kept].copy_from_slice(&window);
            }
            l.write_f32(state_ptr, &state)?;
            l.write_f32(l.ptr_arg(0)?, &out)?;
        }
        Ok(())
    });
    // ember_delta_net_l2_norm_f32(x, rows, channels, head_dim, eps); grid (heads, rows)
    driver.register_kernel("ember_delta_net_l2_norm_f32", |l| {
        let [n_heads, n_rows, _] = l.config().grid;
        let (channels, hd) = (l.u32_arg(2)? as usize, l.u32_arg(3)? as usize);
        let eps = l.f32_arg(4)?;
        for row in read_i32(l, l.ptr_arg(1)?, n_rows as usize)? {
            let ptr = l.ptr_arg(0)?.offset((row * channels * 4) as u64);
            let mut x = l.read_f32(ptr, n_heads as usize * hd)?;
            for head in x.chunks_exact_mut(hd) {
                let sum: f64 = head.iter().map(|&v| (v * v) as f64).sum();
                let mean = (sum / hd as f64) as f32;
                let scale = 1.0 / (mean + eps / hd as f32).sqrt();
                let inv = 1.0 / (hd as f32).sqrt();
                head.iter_mut().for_each(|v| *v = (*v * scale) * inv);
            }
            l.write_f32(ptr, &x)?;
        }
        Ok(())
    });
    // ember_delta_net_rule_*_f32 and ember_delta_net_chunked_*_f32 (the same rule, in chunks)
    // (out, x, beta, alpha, dt_bias, a, states, starts, rows, n_k, n_v, channels, ssm_offset[,
    // head_dim])
    for (name, fixed) in [
        ("ember_delta_net_rule_hd64_f32", Some(64)),
        ("ember_delta_net_rule_hd128_f32", Some(128)),
        ("ember_delta_net_rule_any_f32", None),
        ("ember_delta_net_chunked_hd64_f32", Some(64)),
        ("ember_delta_net_chunked_hd128_f32", Some(128)),
    ] {
        driver.register_kernel(name, move |l| {
            let n_seq = l.config().grid[1] as usize;
            let (n_k, n_v) = (l.u32_arg(9)? as usize, l.u32_arg(10)? as usize);
            let channels = l.u32_arg(11)? as usize;
            let offset = u64_arg(l, 12)?;
            let hd = match fixed {
                Some(hd) => hd,
                None => l.u32_arg(13)? as usize,
            };
            let key_dim = n_k * hd;
            let dt_bias = l.read_f32(l.ptr_arg(4)?, n_v)?;
            let a = l.read_f32(l.ptr_arg(5)?, n_v)?;
            for (address, rows) in read_seqs(l, 6, 7, 8, n_seq)? {
                let max_row = rows.iter().copied().max().unwrap_or(0);
                let x = l.read_f32(l.ptr_arg(1)?, (max_row + 1) * channels)?;
                let beta = l.read_f32(l.ptr_arg(2)?, (max_row + 1) * n_v)?;
                let alpha = l.read_f32(l.ptr_arg(3)?, (max_row + 1) * n_v)?;
                let mut out = l.read_f32(l.ptr_arg(0)?, (max_row + 1) * n_v * hd)?;
                let state_ptr = DevicePtr(address + 4 * offset);
                let mut s = l.read_f32(state_ptr, n_v * hd * hd)?;
                for h in 0..n_v {
                    let kh = h % n_k;
                    for &row in &rows {
                        let xr = &x[row * channels..(row + 1) * channels];
                        let q = &xr[kh * hd..(kh + 1) * hd];
                        let k = &xr[key_dim + kh * hd..key_dim + (kh + 1) * hd];
                        let z = alpha[row * n_v + h] + dt_bias[h];
                        let sp = if z > 20.0 { z } else { (1.0 + z.exp()).ln() };
                        let decay = (sp * a[h]).exp();
                        let b = 1.0 / (1.0 + (-beta[row * n_v + h]).exp());
                        for j in 0..hd {
                            let sj = &mut s[(h * hd + j) * hd..(h * hd + j + 1) * hd];
                            let mut sk = 0f32;
                            for i in 0..hd {
                                sj[i] *= decay;
                                sk = sj[i].mul_add(k[i], sk);
                            }
                            let d = (xr[2 * key_dim + h * hd + j] - sk) * b;
                            let mut o = 0f32;
                            for i in 0..hd {
                                sj[i] = k[i].mul_add(d, sj[i]);
                                o = sj[i].mul_add(q[i], o);
                            }
                            out[row * n_v * hd + h * hd + j] = o * (1.0 / (hd as f32).sqrt());
                        }
                    }
                }
                l.write_f32(state_ptr, &s)?;
                l.write_f32(l.ptr_arg(0)?, &out)?;
            }
            Ok(())
        });
    }
    // ember_delta_net_gated_norm_f32(out, z, norm, rows, n_v, head_dim, eps); grid (n_v, rows)
    driver.register_kernel("ember_delta_net_gated_norm_f32", |l| {
        let n_rows = l.config().grid[1] as usize;
        let (n_v, hd) = (l.u32_arg(4)? as usize, l.u32_arg(5)? as usize);
        let eps = l.f32_arg(6)?;
        let norm = l.read_f32(l.ptr_arg(2)?, hd)?;
        for row in read_i32(l, l.ptr_arg(3)?, n_rows)? {
            let at = (row * n_v * hd * 4) as u64;
            let mut o = l.read_f32(l.ptr_arg(0)?.offset(at), n_v * hd)?;
            let z = l.read_f32(l.ptr_arg(1)?.offset(at), n_v * hd)?;
            for (head, zh) in o.chunks_exact_mut(hd).zip(z.chunks_exact(hd)) {
                let sum: f64 = head.iter().map(|&v| (v * v) as f64).sum();
                let scale = 1.0 / ((sum / hd as f64) as f32 + eps).sqrt();
                for ((v, &w), &zv) in head.iter_mut().zip(&norm).zip(zh) {
                    *v = *v * scale * w * silu(zv);
                }
            }
            l.write_f32(l.ptr_arg(0)?.offset(at), &o)?;
        }
        Ok(())
    });
}

fn backend() -> (GpuBackend, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    for spec in ember_gpu::kernels::KERNEL_MODULES {
        let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"host code object").unwrap();
    }
    let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
    register_twins(&driver);
    let dyn_driver: Arc<dyn Driver> = driver;
    let pool = DevicePool::with_kind(
        dyn_driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
        PoolConfig::default(),
    )
    .expect("host pool");
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        Arc::new(KernelLibrary::new(dir.path().to_path_buf())),
        &GpuContextOptions { disable_blas: true },
    )
    .expect("host context");
    (
        GpuBackend::new(ctx, "host", "host test device".into(), false),
        dir,
    )
}

/// Deterministic values in `[-spread, spread)`.
fn values(seed: u64, n: usize, spread: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * spread
        })
        .collect()
}

const HD: usize = 64;
const NK: usize = 1;
const NV: usize = 2;
const TAPS: usize = 4;
const CH: usize = (2 * NK + NV) * HD;
const VD: usize = NV * HD;
/// Two linear-attention layers in each sequence's state; the op runs the second.
const LAYER: usize = 1;

/// Runs two passes of the op on layer [`LAYER`] through `b`: a prompt batch of three sequences
/// whose rows are interleaved, then one decode token each (in another row order). Returns both
/// passes' outputs and every sequence's whole state buffer afterwards, by sequence id.
fn run<B: Backend>(
    b: &B,
    vector: impl Fn(&[f32]) -> B::Vector,
    buf: impl Fn(&[f32]) -> B::Buf,
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let (conv, dt_bias, a, norm) = (
        vector(&values(1, CH * TAPS, 0.5)),
        vector(&values(2, NV, 1.0)),
        vector(
            &values(3, NV, 1.0)
                .iter()
                .map(|v| -v.abs() - 0.1)
                .collect::<Vec<_>>(),
        ),
        vector(
            &values(4, HD, 0.2)
                .iter()
                .map(|v| 1.0 + v)
                .collect::<Vec<_>>(),
        ),
    );
    let op = GatedDeltaNet {
        conv: &conv,
        dt_bias: &dt_bias,
        a: &a,
        norm: &norm,
        conv_kernel: TAPS,
        n_k_heads: NK,
        n_v_heads: NV,
        head_dim: HD,
        eps: 1e-6,
    };
    let conv_len = op.conv_state_len();
    let ssm_len = op.ssm_state_len();
    let mut store = RecurrentStates::<B>::new(2, conv_len, ssm_len);
    let mut outputs = Vec::new();
    // A long prompt (ops::DELTA_NET_CHUNKED_MIN_ROWS + 2 rows a sequence: the chunked rule on
    // both backends), a short one and a decode step (the recurrent rule).
    let long_rows = ember_gpu::ops::DELTA_NET_CHUNKED_MIN_ROWS + 2;
    let long = |first: usize| (first..3 * long_rows).step_by(3).collect::<Vec<usize>>();
    let passes: [Vec<(SeqId, Vec<usize>)>; 3] = [
        vec![(7, long(0)), (2, long(1)), (9, long(2))],
        vec![(7, vec![0, 3, 5]), (2, vec![1, 4]), (9, vec![2])],
        vec![(9, vec![0]), (2, vec![2]), (7, vec![1])],
    ];
    for (pass, groups) in passes.iter().enumerate() {
        let n: usize = groups.iter().map(|(_, rows)| rows.len()).sum();
        let seed = 10 * (pass as u64 + 1);
        let qkv = buf(&values(seed, n * CH, 1.0));
        let z = buf(&values(seed + 1, n * VD, 1.0));
        let beta = buf(&values(seed + 2, n * NV, 2.0));
        let alpha = buf(&values(seed + 3, n * NV, 2.0));
        let mut out = buf(&vec![0.0; n * VD]);
        store.ensure(b, groups.iter().map(|(s, _)| *s));
        b.begin_states(&store.layer_states(0, groups));
        let mut states = store.layer_states(LAYER, groups);
        b.gated_delta_net(&op, &qkv, &z, &beta, &alpha, &mut states, &mut out);
        let mut host = Vec::new();
        b.read(&out, n * VD, &mut host);
        outputs.push(host);
    }
    let all = vec![(2, vec![]), (7, vec![]), (9, vec![])];
    let states = store
        .layer_states(0, &all)
        .iter()
        .map(|s| {
            let mut host = Vec::new();
            b.read(s.state, 2 * (conv_len + ssm_len), &mut host);
            host
        })
        .collect();
    let decode = outputs.pop().unwrap();
    (outputs.concat(), decode, states)
}

fn gpu_vector(b: &GpuBackend, values: &[f32]) -> GpuVector {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    GpuVector {
        buf: b.upload_new(Purpose::Weights, &bytes).unwrap(),
        len: values.len(),
    }
}

fn gpu_buf(b: &GpuBackend, values: &[f32]) -> GpuBuf {
    let mut buf = b.alloc(values.len());
    b.write(&mut buf, values);
    buf
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        // The CPU sums its dot products in GGML's 64-lane order and takes GGML's exp in SiLU;
        // the twins sum in key order with libm's exp: a few ulps per step over two passes.
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn the_gpu_backend_feeds_the_delta_net_kernels_what_the_cpu_computes_with() {
    let cpu = CpuBackend::new(1).unwrap();
    let (want_prompt, want_decode, want_states) =
        cpu.install(|| run(&cpu, |v| v.to_vec(), |v| v.to_vec()));
    let (gpu, _dir) = backend();
    let (got_prompt, got_decode, got_states) =
        run(&gpu, |v| gpu_vector(&gpu, v), |v| gpu_buf(&gpu, v));
    assert_eq!(gpu.take_failure(), None);
    assert!(want_prompt.iter().any(|&v| v != 0.0) && want_decode.iter().any(|&v| v != 0.0));
    assert_close("prompt outputs", &got_prompt, &want_prompt);
    assert_close("decode outputs", &got_decode, &want_decode);
    let layer_len = want_states[0].len() / 2;
    for (got, want) in got_states.iter().zip(&want_states) {
        assert!(
            got[..layer_len].iter().all(|&v| v == 0.0),
            "the other layer's state is untouched"
        );
        assert_close("states", got, want);
    }
}

#[test]
fn states_are_device_memory_of_their_own_purpose_freed_with_the_sequence() {
    let (gpu, _dir) = backend();
    let state_bytes = |b: &GpuBackend| b.pool().usage().purpose(Purpose::RecurrentState).current;
    let scratch = gpu.pool().usage().purpose(Purpose::Scratch).current;
    let mut store = RecurrentStates::<GpuBackend>::new(3, 10, 100);
    store.ensure(&gpu, [1, 2]);
    assert_eq!(gpu.take_failure(), None);
    assert_eq!(state_bytes(&gpu), 2 * 3 * 110 * 4);
    assert_eq!(store.stats().bytes as u64, state_bytes(&gpu));
    let groups = vec![(1, vec![0]), (2, vec![1])];
    let mut zeros = Vec::new();
    gpu.read(store.layer_states(0, &groups)[1].state, 330, &mut zeros);
    assert!(zeros.iter().all(|&v| v == 0.0), "made zeroed");
    store.free_sequence(1);
    assert_eq!(state_bytes(&gpu), 3 * 110 * 4);
    store.clear();
    assert_eq!(state_bytes(&gpu), 0);
    assert_eq!(
        gpu.pool().usage().purpose(Purpose::Scratch).current,
        scratch,
        "nothing of the states counted as scratch"
    );
}

#[test]
fn sequences_other_than_those_uploaded_fail_the_op_instead_of_waiting_mid_pass() {
    let (gpu, _dir) = backend();
    let vector = |v: &[f32]| gpu_vector(&gpu, v);
    let (conv, dt_bias, a, norm) = (
        vector(&vec![0.1; CH * TAPS]),
        vector(&[0.0; NV]),
        vector(&[-0.5; NV]),
        vector(&[1.0; HD]),
    );
    let op = GatedDeltaNet {
        conv: &conv,
        dt_bias: &dt_bias,
        a: &a,
        norm: &norm,
        conv_kernel: TAPS,
        n_k_heads: NK,
        n_v_heads: NV,
        head_dim: HD,
        eps: 1e-6,
    };
    let mut store = RecurrentStates::<GpuBackend>::new(1, op.conv_state_len(), op.ssm_state_len());
    store.ensure(&gpu, [1, 2]);
    let uploaded = vec![(1, vec![0]), (2, vec![1])];
    gpu.begin_states(&store.layer_states(0, &uploaded));
    let (qkv, z, beta, alpha) = (
        gpu_buf(&gpu, &[0.5; 2 * CH]),
        gpu_buf(&gpu, &[0.5; 2 * VD]),
        gpu_buf(&gpu, &[0.5; 2 * NV]),
        gpu_buf(&gpu, &[0.5; 2 * NV]),
    );
    let mut out = gpu.alloc(2 * VD);
    let other = vec![(1, vec![1]), (2, vec![0])];
    gpu.gated_delta_net(
        &op,
        &qkv,
        &z,
        &beta,
        &alpha,
        &mut store.layer_states(0, &other),
        &mut out,
    );
    let failure = gpu.take_failure().expect("a failure");
    assert_eq!(failure.op, "gated_delta_net");
    assert!(
        failure
            .cause
            .contains("the sequences whose table begin_states uploaded"),
        "{}",
        failure.cause
    );
    // The uploaded ones run.
    gpu.gated_delta_net(
        &op,
        &qkv,
        &z,
        &beta,
        &alpha,
        &mut store.layer_states(0, &uploaded),
        &mut out,
    );
    assert_eq!(gpu.take_failure(), None);
}

#[test]
fn a_pass_whose_recording_was_aborted_updates_the_states_once_when_it_runs_again() {
    let (gpu, _dir) = backend();
    gpu.set_graphs(true);
    let vector = |v: &[f32]| gpu_vector(&gpu, v);
    let (conv, dt_bias, a, norm) = (
        vector(&values(1, CH * TAPS, 0.5)),
        vector(&values(2, NV, 1.0)),
        vector(&[-0.5; NV]),
        vector(&[1.0; HD]),
    );
    let op = GatedDeltaNet {
        conv: &conv,
        dt_bias: &dt_bias,
        a: &a,
        norm: &norm,
        conv_kernel: TAPS,
        n_k_heads: NK,
        n_v_heads: NV,
        head_dim: HD,
        eps: 1e-6,
    };
    let (qkv, z, beta, alpha) = (
        gpu_buf(&gpu, &values(5, CH, 1.0)),
        gpu_buf(&gpu, &values(6, VD, 1.0)),
        gpu_buf(&gpu, &values(7, NV, 1.0)),
        gpu_buf(&gpu, &values(8, NV, 1.0)),
    );
    let groups = vec![(1, vec![0])];
    let len = op.conv_state_len() + op.ssm_state_len();
    let state_after = |aborted: bool| -> Vec<f32> {
        let mut store =
            RecurrentStates::<GpuBackend>::new(1, op.conv_state_len(), op.ssm_state_len());
        store.ensure(&gpu, [1]);
        gpu.begin_states(&store.layer_states(0, &groups));
        let mut out = gpu.alloc(VD);
        if aborted {
            lock(&gpu.graphs).begin(&gpu.ctx, 1, 1);
            assert!(gpu.ctx.is_capturing());
            // A call that waits for the device ends a capture that holds ops (an empty one
            // would begin again); what follows would run for real and then again in the repeat.
            gpu.ctx
                .zero(out.ptr("test", VD).unwrap(), (VD * 4) as u64)
                .unwrap();
            gpu.write(&mut out, &[0.0; VD]);
            assert!(!gpu.ctx.is_capturing());
            gpu.gated_delta_net(
                &op,
                &qkv,
                &z,
                &beta,
                &alpha,
                &mut store.layer_states(0, &groups),
                &mut out,
            );
            assert!(gpu.end_forward(), "the pass runs again with plain launches");
        }
        gpu.gated_delta_net(
            &op,
            &qkv,
            &z,
            &beta,
            &alpha,
            &mut store.layer_states(0, &groups),
            &mut out,
        );
        assert_eq!(gpu.take_failure(), None);
        let mut host = Vec::new();
        gpu.read(store.layer_states(0, &groups)[0].state, len, &mut host);
        host
    };
    let once = state_after(false);
    assert!(once.iter().any(|&v| v != 0.0));
    assert_eq!(state_after(true), once);
}

#[test]
fn the_query_gate_is_split_and_applied_as_on_the_cpu() {
    let cpu = CpuBackend::new(1).unwrap();
    let (gpu, _dir) = backend();
    let (n_tokens, n_heads, hd) = (3, 2, 8);
    let len = n_tokens * n_heads * hd;
    let full = values(31, 2 * len, 1.0);
    let attn = values(32, len, 1.0);
    let cpu_result = cpu.install(|| {
        let (mut q, mut gate) = (vec![0.0; len], vec![0.0; len]);
        cpu.split_query_gate(&full, n_tokens, n_heads, hd, &mut q, &mut gate);
        let mut x = attn.clone();
        cpu.mul_sigmoid(&mut x, &gate, len);
        (q, x)
    });
    let (mut q, mut gate) = (gpu.alloc(len), gpu.alloc(len));
    gpu.split_query_gate(
        &gpu_buf(&gpu, &full),
        n_tokens,
        n_heads,
        hd,
        &mut q,
        &mut gate,
    );
    let mut x = gpu_buf(&gpu, &attn);
    gpu.mul_sigmoid(&mut x, &gate, len);
    let (mut got_q, mut got_x) = (Vec::new(), Vec::new());
    gpu.read(&q, len, &mut got_q);
    gpu.read(&x, len, &mut got_x);
    assert_eq!(gpu.take_failure(), None);
    // The split copies values; the gate is one sigmoid and one product on either side.
    assert_eq!(got_q, cpu_result.0);
    assert_close("gated attention", &got_x, &cpu_result.1);
}
