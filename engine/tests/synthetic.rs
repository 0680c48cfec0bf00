//! Tiny random models written with `GgufWriter`, one per architecture of the registry: each loads,
//! runs, and gives the same logits whether tokens are evaluated in one batch, one at a time, or
//! batched together with other sequences; the paged KV cache returns its blocks; malformed models
//! give the error that names the problem.
//!
//! With f32 weights every token's arithmetic is the same whatever else is in the batch (row-wise
//! f32 products, per-row norms, per-token attention in position order), so batched and single
//! paths must agree to the last bits; the tolerance of 1e-5 only allows for summation order in
//! the SIMD reductions should a kernel choose differently by batch size.
//!
//! With quantized weights the activations are quantized to 8 bits per token before each product,
//! and the tiled (many tokens) and row-wise (one token) kernels of `ember-quant` may differ in
//! the last bit of a sum; such a bit can flip the rounding of one 8-bit activation, a step of
//! `max|x| / 127` (0.8% of the row's largest value), which then propagates. So quantized models
//! are held to 2% of the largest logit instead: far below what a real bug (wrong position, wrong
//! sequence, missing token) produces, which is a change of the order of the logits themselves.

use std::sync::Arc;

use ember::backend::cpu::CpuBackend;
use ember::batch::Batch;
use ember::kv_cache::KvError;
use ember::model::{ContextParams, ForwardError, Model, ModelError};
use ember::sample::Pcg32;
use ember_gguf::{GgmlType, Gguf, GgufWriter, Value};

const TOLERANCE: f32 = 1e-5;
const QUANTIZED_RELATIVE_TOLERANCE: f32 = 0.02;

/// The largest difference allowed between two evaluations of `reference` (see the module docs).
fn tolerance(spec: &Spec, reference: &[f32]) -> f32 {
    if spec.weight_type == GgmlType::F32 {
        TOLERANCE
    } else {
        QUANTIZED_RELATIVE_TOLERANCE * reference.iter().fold(0f32, |m, v| m.max(v.abs()))
    }
}

#[derive(Clone)]
struct Spec {
    arch: &'static str,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_ff: usize,
    n_vocab: usize,
    qkv_bias: bool,
    qk_norm: bool,
    post_norms: bool,
    tied: bool,
    linear_rope_scaling: Option<f32>,
    rope_freqs: bool,
    sliding_window: Option<u32>,
    weight_type: GgmlType,
}

impl Spec {
    fn llama() -> Spec {
        Spec {
            arch: "llama",
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_ff: 96,
            n_vocab: 97,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            tied: false,
            linear_rope_scaling: None,
            rope_freqs: false,
            sliding_window: None,
            weight_type: GgmlType::F32,
        }
    }
}

struct Builder {
    writer: GgufWriter,
    rng: Pcg32,
}

impl Builder {
    fn values(&mut self, n: usize, center: f32, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|_| center + (self.rng.next_f32() * 2.0 - 1.0) * spread)
            .collect()
    }

    fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, center: f32, spread: f32) {
        let n: usize = dims.iter().product();
        let values = self.values(n, center, spread);
        let bytes = match ty {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::I32 => values
                .iter()
                .flat_map(|v| ((v * 100.0) as i32).to_le_bytes())
                .collect(),
            _ => {
                let mut out = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
                ember_quant::quantize(ty, &values, &mut out).unwrap();
                out
            }
        };
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        self.writer.tensor(name, &dims, ty, bytes);
    }

    fn meta(&mut self, key: &str, value: Value) {
        self.writer.metadata(key, value);
    }
}

/// The GGUF bytes of a random model of `spec`, leaving out the tensor `skip` and writing
/// `override_tensor` with other dims or type.
fn build(
    spec: &Spec,
    skip: Option<&str>,
    override_tensor: Option<(&str, &[usize], GgmlType)>,
) -> Vec<u8> {
    let mut b = Builder {
        writer: GgufWriter::new(),
        rng: Pcg32::new(1234),
    };
    let a = spec.arch;
    b.meta("general.architecture", Value::String(a.into()));
    b.meta(&format!("{a}.context_length"), Value::U32(256));
    b.meta(
        &format!("{a}.embedding_length"),
        Value::U32(spec.n_embd as u32),
    );
    b.meta(&format!("{a}.block_count"), Value::U32(spec.n_layer as u32));
    b.meta(
        &format!("{a}.feed_forward_length"),
        Value::U32(spec.n_ff as u32),
    );
    b.meta(
        &format!("{a}.attention.head_count"),
        Value::U32(spec.n_head as u32),
    );
    b.meta(
        &format!("{a}.attention.head_count_kv"),
        Value::U32(spec.n_head_kv as u32),
    );
    b.meta(
        &format!("{a}.attention.key_length"),
        Value::U32(spec.head_dim as u32),
    );
    b.meta(
        &format!("{a}.attention.value_length"),
        Value::U32(spec.head_dim as u32),
    );
    b.meta(
        &format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    );
    b.meta(&format!("{a}.rope.freq_base"), Value::F32(10000.0));
    if let Some(factor) = spec.linear_rope_scaling {
        b.meta(
            &format!("{a}.rope.scaling.type"),
            Value::String("linear".into()),
        );
        b.meta(&format!("{a}.rope.scaling.factor"), Value::F32(factor));
    }
    if let Some(w) = spec.sliding_window {
        b.meta(&format!("{a}.attention.sliding_window"), Value::U32(w));
    }
    let (e, hd, ff, v) = (spec.n_embd, spec.head_dim, spec.n_ff, spec.n_vocab);
    let (q_out, kv_out) = (spec.n_head * hd, spec.n_head_kv * hd);
    let wt = spec.weight_type;
    let mut tensors: Vec<(String, Vec<usize>, GgmlType, f32, f32)> = vec![
        ("token_embd.weight".into(), vec![e, v], wt, 0.0, 1.0),
        (
            "output_norm.weight".into(),
            vec![e],
            GgmlType::F32,
            1.0,
            0.2,
        ),
    ];
    if !spec.tied {
        tensors.push(("output.weight".into(), vec![e, v], wt, 0.0, 0.3));
    }
    if spec.rope_freqs {
        tensors.push((
            "rope_freqs.weight".into(),
            vec![hd / 2],
            GgmlType::F32,
            2.0,
            1.0,
        ));
    }
    for il in 0..spec.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}");
        let scale_in = 1.0 / (e as f32).sqrt();
        tensors.extend([
            (n("attn_norm.weight"), vec![e], GgmlType::F32, 1.0, 0.2),
            (n("attn_q.weight"), vec![e, q_out], wt, 0.0, 2.0 * scale_in),
            (n("attn_k.weight"), vec![e, kv_out], wt, 0.0, 2.0 * scale_in),
            (n("attn_v.weight"), vec![e, kv_out], wt, 0.0, 2.0 * scale_in),
            (n("attn_output.weight"), vec![q_out, e], wt, 0.0, scale_in),
            (n("ffn_norm.weight"), vec![e], GgmlType::F32, 1.0, 0.2),
            (n("ffn_gate.weight"), vec![e, ff], wt, 0.0, 2.0 * scale_in),
            (n("ffn_up.weight"), vec![e, ff], wt, 0.0, 2.0 * scale_in),
            (
                n("ffn_down.weight"),
                vec![ff, e],
                wt,
                0.0,
                1.0 / (ff as f32).sqrt(),
            ),
        ]);
        if spec.qkv_bias {
            tensors.extend([
                (n("attn_q.bias"), vec![q_out], GgmlType::F32, 0.0, 0.5),
                (n("attn_k.bias"), vec![kv_out], GgmlType::F32, 0.0, 0.5),
                (n("attn_v.bias"), vec![kv_out], GgmlType::F32, 0.0, 0.5),
            ]);
        }
        if spec.qk_norm {
            tensors.extend([
                (n("attn_q_norm.weight"), vec![hd], GgmlType::F32, 1.0, 0.2),
                (n("attn_k_norm.weight"), vec![hd], GgmlType::F32, 1.0, 0.2),
            ]);
        }
        if spec.post_norms {
            tensors.extend([
                (
                    n("post_attention_norm.weight"),
                    vec![e],
                    GgmlType::F32,
                    1.0,
                    0.2,
                ),
                (n("post_ffw_norm.weight"), vec![e], GgmlType::F32, 1.0, 0.2),
            ]);
        }
    }
    for (name, dims, ty, center, spread) in tensors {
        if Some(name.as_str()) == skip {
            continue;
        }
        match override_tensor {
            Some((o, odims, oty)) if o == name => b.tensor(&name, odims, oty, center, spread),
            _ => b.tensor(&name, &dims, ty, center, spread),
        }
    }
    b.writer.to_bytes()
}

fn load(bytes: Vec<u8>) -> Result<Model<CpuBackend>, ModelError> {
    let gguf = Arc::new(Gguf::from_bytes(bytes).expect("a well-formed GGUF"));
    Model::from_gguf(
        gguf,
        CpuBackend::new(2).expect("thread pool"),
        &mut |_, _| {},
    )
}

fn specs() -> Vec<Spec> {
    let llama = Spec::llama();
    vec![
        // Llama with linear rope scaling and Llama 3 frequency factors.
        Spec {
            linear_rope_scaling: Some(2.0),
            rope_freqs: true,
            ..llama.clone()
        },
        // SmolLM2-like: tied embeddings.
        Spec {
            tied: true,
            ..llama.clone()
        },
        // Mistral-like: grouped-query attention 4:1.
        Spec {
            n_head: 8,
            n_head_kv: 2,
            head_dim: 8,
            ..llama.clone()
        },
        Spec {
            arch: "qwen2",
            qkv_bias: true,
            ..llama.clone()
        },
        // Qwen3: QK-norm, head size not n_embd / n_head.
        Spec {
            arch: "qwen3",
            qk_norm: true,
            head_dim: 32,
            ..llama.clone()
        },
        // Gemma 3: six layers so layer 5 is global; a window of 8 so it matters.
        Spec {
            arch: "gemma3",
            n_layer: 6,
            qk_norm: true,
            post_norms: true,
            tied: true,
            sliding_window: Some(8),
            n_head_kv: 1,
            ..llama.clone()
        },
        // Quantized weights (Q8_0 with Q8_0 activations).
        Spec {
            weight_type: GgmlType::Q8_0,
            ..llama
        },
    ]
}

fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Pcg32::new(seed);
    (0..n).map(|_| rng.next_u32() % n_vocab as u32).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits of every position of `ids`, evaluated one token at a time.
fn one_by_one(model: &Model<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut ctx = model.new_context(ContextParams::with_ctx(64));
    let mut all = Vec::new();
    for (pos, &t) in ids.iter().enumerate() {
        let mut batch = Batch::new();
        batch.push(t, pos as u32, 0, true);
        all.extend_from_slice(model.forward(&mut ctx, &batch).unwrap());
    }
    all
}

#[test]
fn every_architecture_agrees_between_batched_and_single_token_paths() {
    for spec in specs() {
        let label = format!("{} {:?}", spec.arch, spec.weight_type);
        let model = load(build(&spec, None, None)).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(model.n_vocab(), spec.n_vocab);
        let ids = tokens(40, spec.n_vocab, 7);
        let single = one_by_one(&model, &ids);
        assert!(
            single.iter().all(|v| v.is_finite()),
            "{label}: non-finite logits"
        );

        // The whole prompt in one batch, all logits.
        let mut ctx = model.new_context(ContextParams::with_ctx(64));
        let batched = model
            .forward(&mut ctx, &Batch::for_sequence(0, 0, &ids, true))
            .unwrap()
            .to_vec();
        let tol = tolerance(&spec, &single);
        let d = max_diff(&single, &batched);
        assert!(
            d <= tol,
            "{label}: prefill vs one-by-one differ by {d}, expected at most {tol}"
        );

        // Chunks of 7 continue the same sequence.
        let mut ctx = model.new_context(ContextParams::with_ctx(64));
        let mut chunked = Vec::new();
        for (i, chunk) in ids.chunks(7).enumerate() {
            let b = Batch::for_sequence(0, (i * 7) as u32, chunk, true);
            chunked.extend_from_slice(model.forward(&mut ctx, &b).unwrap());
        }
        let d = max_diff(&single, &chunked);
        assert!(
            d <= tol,
            "{label}: chunked vs one-by-one differ by {d}, expected at most {tol}"
        );

        // The logits actually depend on the context (attention is not a no-op).
        let n_vocab = spec.n_vocab;
        let shifted = one_by_one(&model, &[ids[1], ids[39]]);
        assert!(
            max_diff(&single[39 * n_vocab..], &shifted[n_vocab..]) > 1e-3,
            "{label}: context ignored"
        );
    }
}

#[test]
fn sequences_batched_together_match_each_alone() {
    for spec in specs() {
        let label = format!("{} {:?}", spec.arch, spec.weight_type);
        let model = load(build(&spec, None, None)).unwrap();
        let n_vocab = spec.n_vocab;
        let prompts = [
            tokens(13, n_vocab, 1),
            tokens(5, n_vocab, 2),
            tokens(21, n_vocab, 3),
        ];
        let alone: Vec<Vec<f32>> = prompts.iter().map(|p| one_by_one(&model, p)).collect();

        // Prefill all three in one batch, interleaved, then decode two steps for all at once.
        let mut ctx = model.new_context(ContextParams {
            n_ctx: 64,
            kv_block_size: 4,
            kv_capacity_tokens: 256,
        });
        let mut batch = Batch::new();
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        for pos in 0..longest {
            for (seq, p) in prompts.iter().enumerate() {
                if pos < p.len() {
                    batch.push(p[pos], pos as u32, seq as u32 + 10, true);
                }
            }
        }
        let logits = model.forward(&mut ctx, &batch).unwrap().to_vec();
        let mut row = 0;
        for pos in 0..longest {
            for (seq, p) in prompts.iter().enumerate() {
                if pos < p.len() {
                    let got = &logits[row * n_vocab..(row + 1) * n_vocab];
                    let want = &alone[seq][pos * n_vocab..(pos + 1) * n_vocab];
                    let d = max_diff(got, want);
                    let tol = tolerance(&spec, want);
                    assert!(
                        d <= tol,
                        "{label}: seq {seq} pos {pos} differs by {d}, expected at most {tol}"
                    );
                    row += 1;
                }
            }
        }
        for (seq, p) in prompts.iter().enumerate() {
            assert_eq!(ctx.seq_len(seq as u32 + 10), p.len());
        }
    }
}

#[test]
fn kv_blocks_are_allocated_on_demand_and_returned() {
    let model = load(build(&Spec::llama(), None, None)).unwrap();
    let mut ctx = model.new_context(ContextParams {
        n_ctx: 64,
        kv_block_size: 4,
        kv_capacity_tokens: 40,
    });
    let stats = ctx.kv_stats();
    assert_eq!(
        (stats.capacity, stats.used, stats.resident),
        (10, 0, 0),
        "nothing allocated up front"
    );
    assert_eq!(ctx.kv().resident_bytes(model.backend()), 0);

    model
        .forward(
            &mut ctx,
            &Batch::for_sequence(0, 0, &tokens(9, 97, 1), false),
        )
        .unwrap();
    model
        .forward(
            &mut ctx,
            &Batch::for_sequence(1, 0, &tokens(4, 97, 2), false),
        )
        .unwrap();
    // 9 tokens need 3 blocks of 4, 4 tokens need 1.
    assert_eq!(ctx.kv_stats().used, 4);
    assert_eq!(ctx.kv().block_table(0).len(), 3);
    // Per block: 2 layers x (K + V) x 4 tokens x 2 KV heads x 16 x 2 bytes.
    assert_eq!(
        ctx.kv().resident_bytes(model.backend()),
        4 * 2 * 2 * 4 * 2 * 16 * 2
    );

    ctx.free_sequence(0);
    assert_eq!(ctx.kv_stats().used, 1);
    assert_eq!(
        ctx.kv_stats().resident,
        4,
        "freed blocks stay resident for reuse until trimmed"
    );
    // A new sequence reuses the freed blocks.
    model
        .forward(
            &mut ctx,
            &Batch::for_sequence(2, 0, &tokens(8, 97, 3), false),
        )
        .unwrap();
    assert_eq!(ctx.kv_stats().resident, 4);
    ctx.free_sequence(1);
    ctx.free_sequence(2);
    assert_eq!(ctx.kv_stats().used, 0);

    // The pool refuses a batch it cannot hold, changing nothing.
    let err = model
        .forward(
            &mut ctx,
            &Batch::for_sequence(3, 0, &tokens(41, 97, 4), false),
        )
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::Kv(KvError::OutOfBlocks {
            needed: 11,
            free: 10,
            total: 10
        })
    );
    assert_eq!(ctx.kv_stats().used, 0);
    assert_eq!(ctx.seq_len(3), 0);
}

#[test]
fn bad_batches_are_errors() {
    let model = load(build(&Spec::llama(), None, None)).unwrap();
    let mut ctx = model.new_context(ContextParams::with_ctx(8));
    assert_eq!(
        model.forward(&mut ctx, &Batch::new()).unwrap_err(),
        ForwardError::EmptyBatch
    );
    let err = model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &[1, 97], false))
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::TokenOutOfRange {
            token: 97,
            index: 1,
            n_vocab: 97
        }
    );
    let err = model
        .forward(&mut ctx, &Batch::for_sequence(0, 3, &[1], false))
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::Kv(KvError::PositionMismatch {
            seq_id: 0,
            expected: 0,
            found: 3
        })
    );
    let err = model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &[1; 9], false))
        .unwrap_err();
    assert_eq!(
        err,
        ForwardError::Kv(KvError::ContextFull {
            seq_id: 0,
            needed: 9,
            n_ctx: 8
        })
    );
    assert_eq!(
        ctx.seq_len(0),
        0,
        "failed batches leave the cache unchanged"
    );
}

fn load_err(bytes: Vec<u8>) -> String {
    match load(bytes) {
        Ok(_) => panic!("the model loaded: expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_models_name_the_problem() {
    let spec = Spec::llama();
    let e = load_err(build(&spec, Some("blk.1.ffn_up.weight"), None));
    assert!(e.contains("blk.1.ffn_up.weight is missing"), "{e}");

    let e = load_err(build(
        &spec,
        None,
        Some(("blk.0.attn_k.weight", &[64, 48], GgmlType::F32)),
    ));
    assert!(
        e.contains("blk.0.attn_k.weight: expected dims [64, 32], found [64, 48]"),
        "{e}"
    );

    let e = load_err(build(
        &spec,
        None,
        Some(("blk.0.ffn_down.weight", &[96, 64], GgmlType::I32)),
    ));
    assert!(
        e.contains("blk.0.ffn_down.weight: type I32 is not supported"),
        "{e}"
    );

    let qwen2_without_bias = Spec {
        arch: "qwen2",
        ..spec.clone()
    };
    let e = load_err(build(&qwen2_without_bias, None, None));
    assert!(e.contains("blk.0.attn_q.bias is missing"), "{e}");

    let e = load_err(build(
        &Spec {
            arch: "mamba",
            ..spec.clone()
        },
        None,
        None,
    ));
    assert!(
        e.contains("unknown architecture \"mamba\"") && e.contains("llama, qwen2, qwen3, gemma3"),
        "{e}"
    );

    let e = load_err(build(
        &Spec {
            n_head_kv: 3,
            ..spec.clone()
        },
        None,
        None,
    ));
    assert!(e.contains("llama.attention.head_count_kv"), "{e}");

    let e = load_err(build(
        &Spec {
            arch: "gemma3",
            qk_norm: true,
            post_norms: true,
            ..spec
        },
        None,
        None,
    ));
    assert!(e.contains("gemma3.attention.sliding_window"), "{e}");
}

/// A backend that runs on the CPU but fails the way a device backend does: the `fail_op`-th op
/// (counting every op of the trait) or every `kv_materialize` when `fail_materialize` is set is
/// recorded as a failure, every later op is skipped until [`Backend::take_failure`], exactly as
/// the GPU backend behaves. It checks that failures reach the caller and that the context stays
/// usable.
mod faulty {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use ember::backend::cpu::CpuBackend;
    use ember::backend::{Backend, BackendError, OpFailure, RopeMode, RopeParams};
    use ember::kv_cache::AttentionPlan;
    use ember_gguf::{Gguf, TensorInfo};

    pub struct Faulty {
        pub cpu: CpuBackend,
        /// Fail the op with this 1-based number (0: none); counted over every op.
        pub fail_op: AtomicUsize,
        pub ops: AtomicUsize,
        pub fail_materialize: AtomicBool,
        pub failed: AtomicBool,
        pub failure: Mutex<Option<OpFailure>>,
    }

    impl Faulty {
        pub fn new() -> Faulty {
            Faulty {
                cpu: CpuBackend::new(2).expect("thread pool"),
                fail_op: AtomicUsize::new(0),
                ops: AtomicUsize::new(0),
                fail_materialize: AtomicBool::new(false),
                failed: AtomicBool::new(false),
                failure: Mutex::new(None),
            }
        }

        fn fail(&self, op: &'static str) {
            let mut failure = self.failure.lock().unwrap();
            if failure.is_none() {
                *failure = Some(OpFailure {
                    backend: "faulty",
                    op,
                    cause: "out of memory (simulated)".into(),
                    out_of_memory: true,
                });
                self.failed.store(true, Ordering::SeqCst);
            }
        }

        /// Whether `op` runs: false once an op failed, or when this op is the one to fail.
        fn go(&self, op: &'static str) -> bool {
            if self.failed.load(Ordering::SeqCst) {
                return false;
            }
            let n = self.ops.fetch_add(1, Ordering::SeqCst) + 1;
            if n == self.fail_op.load(Ordering::SeqCst) {
                self.fail(op);
                return false;
            }
            true
        }
    }

    type Buf = <CpuBackend as Backend>::Buf;
    type Matrix = <CpuBackend as Backend>::Matrix;
    type Vector = <CpuBackend as Backend>::Vector;
    type Rope = <CpuBackend as Backend>::RopeTable;
    type Kv = <CpuBackend as Backend>::KvLayer;

    impl Backend for Faulty {
        type Buf = Buf;
        type Matrix = Matrix;
        type Vector = Vector;
        type RopeTable = Rope;
        type KvLayer = Kv;

        fn name(&self) -> &'static str {
            "faulty"
        }
        fn take_failure(&self) -> Option<OpFailure> {
            let failure = self.failure.lock().unwrap().take();
            self.failed.store(false, Ordering::SeqCst);
            failure
        }
        fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
            self.cpu.install(f)
        }
        fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Matrix, BackendError> {
            self.cpu.matrix(gguf, info)
        }
        fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Vector, BackendError> {
            self.cpu.vector(gguf, info)
        }
        fn matrix_private_bytes(&self, m: &Matrix) -> usize {
            self.cpu.matrix_private_bytes(m)
        }
        fn alloc(&self, len: usize) -> Buf {
            self.cpu.alloc(len)
        }
        fn ensure_len(&self, buf: &mut Buf, len: usize) {
            self.cpu.ensure_len(buf, len)
        }
        fn buf_bytes(&self, buf: &Buf) -> usize {
            self.cpu.buf_bytes(buf)
        }
        fn gather_rows(&self, src: &Buf, dim: usize, rows: &[usize], out: &mut Buf) {
            if self.go("gather_rows") {
                self.cpu.gather_rows(src, dim, rows, out)
            }
        }
        fn write(&self, buf: &mut Buf, values: &[f32]) {
            if self.go("write") {
                self.cpu.write(buf, values)
            }
        }
        fn read(&self, buf: &Buf, len: usize, out: &mut Vec<f32>) {
            if self.go("read") {
                self.cpu.read(buf, len, out)
            }
        }
        fn argmax_rows(
            &self,
            x: &Buf,
            n_rows: usize,
            n_cols: usize,
            scratch: &mut Buf,
            out: &mut Vec<u32>,
        ) {
            if self.go("argmax_rows") {
                self.cpu.argmax_rows(x, n_rows, n_cols, scratch, out)
            }
        }
        fn get_rows(&self, t: &Matrix, ids: &[u32], scale: f32, out: &mut Buf) {
            if self.go("get_rows") {
                self.cpu.get_rows(t, ids, scale, out)
            }
        }
        fn matmul(&self, w: &Matrix, x: &Buf, n: usize, out: &mut Buf) {
            if self.go("matmul") {
                self.cpu.matmul(w, x, n, out)
            }
        }
        fn rms_norm(&self, x: &Buf, w: &Vector, n: usize, d: usize, eps: f32, out: &mut Buf) {
            if self.go("rms_norm") {
                self.cpu.rms_norm(x, w, n, d, eps, out)
            }
        }
        fn rms_norm_inplace(&self, x: &mut Buf, w: &Vector, n: usize, d: usize, eps: f32) {
            if self.go("rms_norm") {
                self.cpu.rms_norm_inplace(x, w, n, d, eps)
            }
        }
        fn add_inplace(&self, dst: &mut Buf, src: &Buf, len: usize) {
            if self.go("add") {
                self.cpu.add_inplace(dst, src, len)
            }
        }
        fn add_bias(&self, x: &mut Buf, b: &Vector, n: usize, d: usize) {
            if self.go("add_bias") {
                self.cpu.add_bias(x, b, n, d)
            }
        }
        fn scale(&self, x: &mut Buf, len: usize, s: f32) {
            if self.go("scale") {
                self.cpu.scale(x, len, s)
            }
        }
        fn swiglu(&self, g: &mut Buf, u: &Buf, len: usize) {
            if self.go("swiglu") {
                self.cpu.swiglu(g, u, len)
            }
        }
        fn geglu(&self, g: &mut Buf, u: &Buf, len: usize) {
            if self.go("geglu") {
                self.cpu.geglu(g, u, len)
            }
        }
        fn softcap(&self, x: &mut Buf, len: usize, cap: f32) {
            if self.go("softcap") {
                self.cpu.softcap(x, len, cap)
            }
        }
        fn rope_table_new(&self) -> Rope {
            self.cpu.rope_table_new()
        }
        fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut Rope) {
            if self.go("rope_table") {
                self.cpu.rope_table(positions, params, table)
            }
        }
        fn rope(&self, x: &mut Buf, t: &Rope, n: usize, h: usize, d: usize, mode: RopeMode) {
            if self.go("rope") {
                self.cpu.rope(x, t, n, h, d, mode)
            }
        }
        fn kv_layer(&self, max_blocks: usize, block_size: usize, heads: usize, dim: usize) -> Kv {
            self.cpu.kv_layer(max_blocks, block_size, heads, dim)
        }
        fn kv_materialize(&self, layer: &mut Kv, blocks: &[u32]) {
            if self.fail_materialize.load(Ordering::SeqCst) {
                // Like a device running out of memory halfway: some blocks get memory.
                self.cpu.kv_materialize(layer, &blocks[..blocks.len() / 2]);
                self.fail("kv_materialize");
            } else if !self.failed.load(Ordering::SeqCst) {
                self.cpu.kv_materialize(layer, blocks)
            }
        }
        fn kv_release(&self, layer: &mut Kv, blocks: &[u32]) {
            self.cpu.kv_release(layer, blocks)
        }
        fn kv_bytes(&self, layer: &Kv) -> usize {
            self.cpu.kv_bytes(layer)
        }
        fn kv_store(&self, layer: &mut Kv, k: &Buf, v: &Buf, plan: &AttentionPlan) {
            if self.go("kv_store") {
                self.cpu.kv_store(layer, k, v, plan)
            }
        }
        fn attention(
            &self,
            q: &Buf,
            layer: &Kv,
            plan: &AttentionPlan,
            n_heads: usize,
            n_kv_heads: usize,
            head_dim: usize,
            kq_scale: f32,
            window: Option<usize>,
            out: &mut Buf,
        ) {
            if self.go("attention") {
                self.cpu.attention(
                    q, layer, plan, n_heads, n_kv_heads, head_dim, kq_scale, window, out,
                )
            }
        }
    }
}

fn load_faulty(spec: &Spec) -> Model<faulty::Faulty> {
    let gguf = Arc::new(Gguf::from_bytes(build(spec, None, None)).expect("a well-formed GGUF"));
    Model::from_gguf(gguf, faulty::Faulty::new(), &mut |_, _| {}).expect("model loads")
}

#[test]
fn a_failing_op_fails_the_forward_pass_alone_and_the_context_stays_usable() {
    use std::sync::atomic::Ordering;
    let spec = Spec::llama();
    let model = load_faulty(&spec);
    let backend = model.backend();
    let mut ctx = model.new_context(ContextParams {
        n_ctx: 64,
        kv_block_size: 4,
        kv_capacity_tokens: 128,
    });
    // Sequence 0 holds 6 tokens before the failing batch.
    let first = tokens(6, spec.n_vocab, 1);
    model
        .forward(&mut ctx, &Batch::for_sequence(0, 0, &first, false))
        .unwrap();
    let before = ctx.kv_stats();

    // A batch continuing sequence 0 and starting sequence 1 fails at its 5th op.
    let mut batch = Batch::new();
    let more = tokens(3, spec.n_vocab, 2);
    let other = tokens(5, spec.n_vocab, 3);
    for (i, &t) in more.iter().enumerate() {
        batch.push(t, 6 + i as u32, 0, i + 1 == more.len());
    }
    for (i, &t) in other.iter().enumerate() {
        batch.push(t, i as u32, 1, i + 1 == other.len());
    }
    backend.ops.store(0, Ordering::SeqCst);
    backend.fail_op.store(5, Ordering::SeqCst);
    let error = model.forward(&mut ctx, &batch).unwrap_err();
    backend.fail_op.store(0, Ordering::SeqCst);
    let ForwardError::Backend(failure) = &error else {
        panic!("expected a backend failure, found {error:?}");
    };
    assert!(failure.out_of_memory);
    assert!(error.is_out_of_memory());
    assert_eq!(
        error.to_string(),
        format!(
            "forward pass failed: faulty backend: {} failed: out of memory (simulated)",
            failure.op
        )
    );
    // The batch left no trace: sequence 0 is back to 6 tokens, sequence 1 does not exist, and
    // the blocks the batch took are free again.
    assert_eq!(ctx.seq_len(0), 6);
    assert_eq!(ctx.seq_len(1), 0);
    assert!(ctx.kv().block_table(1).is_empty());
    assert_eq!(ctx.kv_stats().used, before.used);
    assert!(ctx.logits().is_empty());

    // The same batch now runs, and gives what a context that never failed gives.
    let retried = model.forward(&mut ctx, &batch).unwrap().to_vec();
    let mut fresh = model.new_context(ContextParams {
        n_ctx: 64,
        kv_block_size: 4,
        kv_capacity_tokens: 128,
    });
    model
        .forward(&mut fresh, &Batch::for_sequence(0, 0, &first, false))
        .unwrap();
    let expected = model.forward(&mut fresh, &batch).unwrap().to_vec();
    assert_eq!(retried, expected);
    assert_eq!(ctx.seq_len(0), 9);
    assert_eq!(ctx.seq_len(1), 5);
}

#[test]
fn kv_blocks_that_cannot_get_memory_fail_the_batch_and_change_nothing() {
    use std::sync::atomic::Ordering;
    let spec = Spec::llama();
    let model = load_faulty(&spec);
    let backend = model.backend();
    let mut ctx = model.new_context(ContextParams {
        n_ctx: 64,
        kv_block_size: 4,
        kv_capacity_tokens: 64,
    });
    model
        .forward(
            &mut ctx,
            &Batch::for_sequence(0, 0, &tokens(5, spec.n_vocab, 1), false),
        )
        .unwrap();
    let before = ctx.kv_stats();
    let bytes_before = ctx.kv().resident_bytes(backend);

    backend.fail_materialize.store(true, Ordering::SeqCst);
    let mut batch = Batch::for_sequence(0, 5, &tokens(8, spec.n_vocab, 2), false);
    let second = Batch::for_sequence(1, 0, &tokens(6, spec.n_vocab, 3), true);
    for i in 0..second.len() {
        batch.push(
            second.tokens[i],
            second.positions[i],
            1,
            second.want_logits[i],
        );
    }
    let error = model.forward(&mut ctx, &batch).unwrap_err();
    backend.fail_materialize.store(false, Ordering::SeqCst);
    let ForwardError::Kv(KvError::Memory(failure)) = &error else {
        panic!("expected a KV memory failure, found {error:?}");
    };
    assert_eq!(failure.op, "kv_materialize");
    assert!(error.is_out_of_memory());
    assert_eq!(ctx.kv_stats(), before);
    assert_eq!(ctx.kv().resident_bytes(backend), bytes_before);
    assert_eq!(ctx.seq_len(0), 5);
    assert_eq!(ctx.seq_len(1), 0);
    assert_eq!(ctx.kv().block_table(0).len(), 2);

    // The free list is as it was: the retried batch gets the blocks it would have got.
    let mut fresh = model.new_context(ContextParams {
        n_ctx: 64,
        kv_block_size: 4,
        kv_capacity_tokens: 64,
    });
    model
        .forward(
            &mut fresh,
            &Batch::for_sequence(0, 0, &tokens(5, spec.n_vocab, 1), false),
        )
        .unwrap();
    let expected = model.forward(&mut fresh, &batch).unwrap().to_vec();
    let retried = model.forward(&mut ctx, &batch).unwrap().to_vec();
    assert_eq!(retried, expected);
    assert_eq!(ctx.kv().block_table(0), fresh.kv().block_table(0));
    assert_eq!(ctx.kv().block_table(1), fresh.kv().block_table(1));
}
