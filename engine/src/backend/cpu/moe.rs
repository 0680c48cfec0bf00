//! The feed-forward block of a mixture-of-experts layer on the CPU, in the order of operations
//! of llama.cpp's `build_moe_ffn` and GGML's CPU `mul_mat_id`, so the numbers agree with it:
//!
//! 1. Routing, token by token: probabilities from the router logits (GGML's softmax, or a
//!    sigmoid), the `n_expert_used` most probable experts in descending order (ties to the lower
//!    index), their probabilities as weights, divided by their sum (summed in f64, clamped below
//!    at 2^-14) when the model normalises them, then scaled.
//! 2. Grouping: every (token, rank) pair is filed under its expert, tokens in batch order, as
//!    `mul_mat_id` groups the rows of each expert.
//! 3. For each expert chosen by any token: its gate and up products over just those tokens'
//!    rows, the activation, and its down product, each product reading only that expert's slice
//!    of the stacked tensor (a view of its bytes). The activations are quantized to the weights'
//!    dot-product type row by row, so a row gives the same bytes whichever rows it is gathered
//!    with, and every output is one dot product, as in GGML.
//!    With a per-expert factor (Gemma 4), each output row is multiplied by its expert's factor.
//! 4. Combination, token by token: each expert's output times its weight (rounded to f32), then
//!    added in rank order starting from the first (GGML's chain of `ggml_add` over the views).
//! 5. The shared expert, when there is one: a plain gated FFN over every token, scaled per token
//!    by `sigmoid(gate_inp x)` when the layer has that gate, added last.
//!
//! All scratch memory lives in [`Scratch`] and is reused, so a decode step allocates nothing once
//! the buffers have grown to the largest batch.

use rayon::prelude::*;

use super::ops::Disjoint;
use super::{ops, vec, CpuBackend, CpuMatrix};
use crate::backend::{Backend, ExpertGating, MoeFfn, MoeRouting};
use crate::ops::FfnActivation;
use ember_gguf::GgmlType;

/// Tokens per rayon task when combining expert outputs.
const TOKENS_PER_TASK: usize = 4;

/// Router rows (experts) per job of a one-token router product.
const ROUTER_ROWS_PER_JOB: usize = 16;

/// llama.cpp clamps the sum of the chosen weights to at least this (the smallest normal f16)
/// before dividing by it, so an all-zero choice does not divide by zero.
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// Reusable buffers of [`moe_ffn`].
#[derive(Default)]
pub(super) struct Scratch {
    probs: Vec<f32>,
    order: Vec<u32>,
    /// Expert of each (token, rank): `experts[t * n_used + rank]`.
    experts: Vec<u32>,
    /// Weight of each (token, rank), same layout.
    weights: Vec<f32>,
    /// Per expert, the (token, rank) indices routed to it, in batch order.
    routes_of_expert: Vec<Vec<u32>>,
    /// Gathered input rows of one expert.
    rows: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// Output of every (token, rank): `n_embd` values each.
    routed: Vec<f32>,
    shared_gate: Vec<f32>,
    shared_up: Vec<f32>,
    shared_out: Vec<f32>,
    shared_logit: Vec<f32>,
    /// The experts chosen by any token of the batch, with their runs of grouped rows.
    groups: Vec<Group>,
    /// Quantized inputs of each group's gate, up (where its type differs) and down products.
    gate_acts: Vec<ember_quant::QuantizedActivations>,
    up_acts: Vec<ember_quant::QuantizedActivations>,
    down_acts: Vec<ember_quant::QuantizedActivations>,
}

impl Scratch {
    /// Bytes of memory the buffers hold.
    pub(super) fn bytes(&self) -> usize {
        let f32s = [
            &self.probs,
            &self.weights,
            &self.rows,
            &self.gate,
            &self.up,
            &self.down,
            &self.routed,
            &self.shared_gate,
            &self.shared_up,
            &self.shared_out,
            &self.shared_logit,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>();
        let u32s = self.order.capacity()
            + self.groups.capacity() * std::mem::size_of::<Group>() / 4
            + self.experts.capacity()
            + self
                .routes_of_expert
                .iter()
                .map(Vec::capacity)
                .sum::<usize>();
        let acts = self
            .gate_acts
            .iter()
            .chain(&self.up_acts)
            .chain(&self.down_acts)
            .map(ember_quant::QuantizedActivations::bytes)
            .sum::<usize>();
        (f32s + u32s) * 4
            + self.routes_of_expert.capacity() * std::mem::size_of::<Vec<u32>>()
            + acts
    }
}

/// Chooses and weighs the experts of one token from its router logits: writes the `n_used`
/// chosen experts (most probable first) to `experts` and their weights to `weights`. `probs`
/// and `order` are scratch.
pub(super) fn route_token(
    logits: &[f32],
    routing: &MoeRouting,
    probs: &mut Vec<f32>,
    order: &mut Vec<u32>,
    experts: &mut [u32],
    weights: &mut [f32],
) {
    let n_expert = routing.n_expert;
    probs.resize(n_expert, 0.0);
    match routing.gating {
        ExpertGating::Softmax => vec::softmax_ggml(&logits[..n_expert], probs),
        // GGML's `ggml_vec_sigmoid_f32`: `1 / (1 + expf(-x))` with the C library's `expf`.
        ExpertGating::Sigmoid => probs
            .iter_mut()
            .zip(logits)
            .for_each(|(p, &l)| *p = 1.0 / (1.0 + (-l).exp())),
    }
    order.clear();
    order.extend(0..n_expert as u32);
    // A stable sort, so equal probabilities keep the lower expert first.
    order.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
    for ((e, w), &chosen) in experts.iter_mut().zip(weights.iter_mut()).zip(order.iter()) {
        *e = chosen;
        *w = probs[chosen as usize];
    }
    if routing.normalize_weights {
        let sum = weights.iter().map(|&w| w as f64).sum::<f64>() as f32;
        let sum = sum.max(MIN_WEIGHT_SUM);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    if let Some(scale) = routing.weights_scale {
        weights.iter_mut().for_each(|w| *w *= scale);
    }
}

/// Router logits of an F32 router (how llama.cpp's converter and quantizer store every router)
/// in the order llama.cpp's CPU backend sums them, since a routing decision near a tie follows
/// the last bits: over two or more tokens with rows of whole runs of 16 and a multiple of 4
/// experts, llamafile's `tinyBLAS` kernel; otherwise (a decode step) `ggml_vec_dot_f32`. Both
/// as llama.cpp's AVX-512 build computes them, like the rest of this backend.
pub(super) fn router_f32(router: &CpuMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let (n_expert, n_embd) = (router.rows, router.cols);
    let data = router.data();
    // SAFETY: every bit pattern is a valid f32, and `align_to` only hands out the aligned middle.
    let (head, aligned, tail) = unsafe { data.align_to::<f32>() };
    let decoded: Vec<f32>;
    let weights: &[f32] = if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
        aligned
    } else {
        // A file mapped at an odd offset (or a big-endian machine): decode a copy.
        decoded = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        &decoded
    };
    let tinyblas = n_tokens >= 2 && n_embd % 16 == 0 && n_expert % 4 == 0;
    if n_tokens == 1 {
        // A decode step: the experts' rows split between the threads (one token alone was one
        // thread reading the whole router, a few MB per layer).
        let logits = Disjoint::new(&mut out[..n_expert]);
        let token = &x[..n_embd];
        let n_jobs = n_expert.div_ceil(ROUTER_ROWS_PER_JOB);
        ember_quant::team::for_each_index(n_jobs, |job| {
            let first = job * ROUTER_ROWS_PER_JOB;
            let last = (first + ROUTER_ROWS_PER_JOB).min(n_expert);
            // SAFETY: the jobs' row ranges are disjoint.
            let mine = unsafe { logits.range(first..last) };
            for (logit, row) in mine
                .iter_mut()
                .zip(weights[first * n_embd..last * n_embd].chunks_exact(n_embd))
            {
                *logit = vec::dot_f32_ggml(row, token);
            }
        });
        return;
    }
    out[..n_tokens * n_expert]
        .par_chunks_mut(n_expert)
        .with_min_len(TOKENS_PER_TASK)
        .zip(x[..n_tokens * n_embd].par_chunks(n_embd))
        .for_each(|(logits, token)| {
            for (logit, row) in logits.iter_mut().zip(weights.chunks_exact(n_embd)) {
                *logit = if tinyblas {
                    vec::dot_f32_tinyblas(row, token)
                } else {
                    vec::dot_f32_ggml(row, token)
                };
            }
        });
}

/// An expert chosen by some token of the batch: its routes' rows are rows `start..start +
/// count` of the grouped buffers (in [`Scratch::routes_of_expert`] order).
#[derive(Clone, Copy)]
pub(super) struct Group {
    expert: usize,
    start: usize,
    count: usize,
}

/// The buffers of [`run_experts`].
struct ExpertBuffers<'a> {
    groups: &'a [Group],
    /// Grouped input rows (`n_embd` each).
    rows: &'a mut Vec<f32>,
    /// Grouped gate products, then the activation (`n_ff` each).
    gate: &'a mut Vec<f32>,
    up: &'a mut Vec<f32>,
    /// Grouped down products (`n_embd` each).
    down: &'a mut Vec<f32>,
    /// Each route's expert output times the expert's factor, by route.
    routed: &'a mut [f32],
    gate_acts: &'a mut Vec<ember_quant::QuantizedActivations>,
    up_acts: &'a mut Vec<ember_quant::QuantizedActivations>,
    down_acts: &'a mut Vec<ember_quant::QuantizedActivations>,
}

/// Makes `list` hold at least `n` buffers of quantized activations of type `ty`, `cols` wide.
fn ensure_acts(
    list: &mut Vec<ember_quant::QuantizedActivations>,
    n: usize,
    ty: GgmlType,
    cols: usize,
) {
    if list.iter().any(|a| a.ty() != ty || a.cols() != cols) {
        list.clear();
    }
    while list.len() < n {
        list.push(
            ember_quant::QuantizedActivations::empty(ty, cols)
                .expect("vec_dot_type is an activation type"),
        );
    }
}

/// How the products of a stack of experts are split into jobs: whole experts where there are
/// enough of them for every thread (a prompt), else runs of rows of each expert (a decode step's
/// few experts: about two jobs per thread in all), in whole [`ember_quant::ROW_RANGE_ALIGN`]s.
fn rows_per_job(rows: usize, n_groups: usize, threads: usize) -> usize {
    if n_groups >= 2 * threads {
        return rows;
    }
    let align = ember_quant::ROW_RANGE_ALIGN;
    let per_group = (2 * threads).div_ceil(n_groups.max(1)).max(1);
    (rows.div_ceil(per_group).div_ceil(align) * align)
        .max(align)
        .min(rows)
}

thread_local! {
    /// Outputs of one job whose rows are a part of its expert's, for more than one token.
    static PART: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows `rows` of expert matrix `w` against `acts` (the `group`'s `count` rows), written to the
/// group's rows of `out` (grouped, `stride` wide), columns `rows`.
fn product_part(
    w: &ember_quant::QMatrix<'_>,
    acts: &ember_quant::QuantizedActivations,
    rows: std::ops::Range<usize>,
    group: Group,
    out: Disjoint<f32>,
    stride: usize,
) {
    let width = rows.len();
    if width == stride || group.count == 1 {
        // The outputs are one contiguous run: the group's rows whole, or one token's part.
        let at = group.start * stride + rows.start;
        // SAFETY: jobs of one op own disjoint (group, rows) parts of `out`.
        let dst = unsafe { out.range(at..at + (group.count - 1) * stride + width) };
        ember_quant::matmul_rows(w, acts, rows, dst).expect("matmul shapes match");
        return;
    }
    PART.with_borrow_mut(|part| {
        part.resize(group.count * width, 0.0);
        ember_quant::matmul_rows(w, acts, rows.clone(), part).expect("matmul shapes match");
        for (i, src) in part.chunks_exact(width).enumerate() {
            let at = (group.start + i) * stride + rows.start;
            // SAFETY: as above.
            unsafe { out.range(at..at + width) }.copy_from_slice(src);
        }
    });
}

/// The routed experts of a batch, every chosen expert at once rather than one after another:
/// one op gathers and quantizes each expert's input rows, one runs every gate and up product,
/// the activation runs over all of them, one op quantizes the down inputs and one runs every
/// down product, each split between the threads by expert (and by rows where the experts are
/// fewer than the threads). Expert by expert, a layer was five ops per expert, each too small
/// to pay for the threads it woke: on 16 threads 0.72x llama.cpp's prompt speed and 0.69x its
/// decode. Each output is the same dot product as the expert's whole product would give
/// ([`ember_quant::matmul_rows`]), the activations are quantized row by row, and the
/// activation and factors are the same elementwise ops.
fn run_experts(
    backend: &CpuBackend,
    moe: &MoeFfn<'_, CpuMatrix>,
    x: &[f32],
    n_used: usize,
    routes_of_expert: &[Vec<u32>],
    buffers: ExpertBuffers<'_>,
) {
    let ExpertBuffers {
        groups,
        rows,
        gate,
        up,
        down,
        routed,
        gate_acts,
        up_acts,
        down_acts,
    } = buffers;
    let (n_embd, n_ff) = (moe.gate.cols, moe.n_ff);
    let n_groups = groups.len();
    let grouped = groups.last().map_or(0, |g| g.start + g.count);
    let threads = backend.n_threads();

    // Inputs: each expert's rows gathered and quantized (row by row, as one batch would be).
    let gate_ty = ember_quant::vec_dot_type(moe.gate.info.ty);
    let up_ty = ember_quant::vec_dot_type(moe.up.info.ty);
    let same_activations = gate_ty == up_ty;
    ensure_acts(gate_acts, n_groups, gate_ty, n_embd);
    if !same_activations {
        ensure_acts(up_acts, n_groups, up_ty, n_embd);
    }
    rows.resize(grouped * n_embd, 0.0);
    {
        let (rows_out, gate_in, up_in) = (
            Disjoint::new(rows),
            Disjoint::new(gate_acts),
            Disjoint::new(up_acts),
        );
        ember_quant::team::for_each_index(n_groups, |g| {
            let group = groups[g];
            let routes = &routes_of_expert[group.expert];
            // SAFETY: job `g` alone touches group `g`'s rows and activation buffers.
            let mine = unsafe {
                rows_out.range(group.start * n_embd..(group.start + group.count) * n_embd)
            };
            for (row, &route) in mine.chunks_exact_mut(n_embd).zip(routes) {
                let t = route as usize / n_used;
                row.copy_from_slice(&x[t * n_embd..(t + 1) * n_embd]);
            }
            // SAFETY: as above.
            unsafe { gate_in.at(g) }
                .requantize(mine, group.count)
                .expect("activation shape matches the matrix");
            if !same_activations {
                // SAFETY: as above.
                unsafe { up_in.at(g) }
                    .requantize(mine, group.count)
                    .expect("activation shape matches the matrix");
            }
        });
    }

    // Gate and up products.
    gate.resize(grouped * n_ff, 0.0);
    up.resize(grouped * n_ff, 0.0);
    {
        let up_acts: &[ember_quant::QuantizedActivations] =
            if same_activations { gate_acts } else { up_acts };
        let gate_acts = &gate_acts[..];
        let chunk = rows_per_job(n_ff, n_groups, threads);
        let parts = n_ff.div_ceil(chunk);
        let (gate_out, up_out) = (Disjoint::new(gate), Disjoint::new(up));
        ember_quant::team::for_each_index(n_groups * parts, |job| {
            let (g, part) = (job / parts, job % parts);
            let group = groups[g];
            let rows = part * chunk..((part + 1) * chunk).min(n_ff);
            let e = group.expert;
            product_part(
                &moe.gate.stacked(e),
                &gate_acts[g],
                rows.clone(),
                group,
                gate_out,
                n_ff,
            );
            product_part(&moe.up.stacked(e), &up_acts[g], rows, group, up_out, n_ff);
        });
    }
    match moe.activation {
        FfnActivation::SwiGlu => backend.swiglu(gate, up, grouped * n_ff),
        FfnActivation::GeGlu => backend.geglu(gate, up, grouped * n_ff),
    }

    // Down products, and each route's output (times its expert's factor) in its place.
    let down_ty = ember_quant::vec_dot_type(moe.down.info.ty);
    ensure_acts(down_acts, n_groups, down_ty, n_ff);
    {
        let (gate, down_in) = (&gate[..], Disjoint::new(down_acts));
        ember_quant::team::for_each_index(n_groups, |g| {
            let group = groups[g];
            // SAFETY: job `g` alone touches group `g`'s buffer.
            unsafe { down_in.at(g) }
                .requantize(
                    &gate[group.start * n_ff..(group.start + group.count) * n_ff],
                    group.count,
                )
                .expect("activation shape matches the matrix");
        });
    }
    down.resize(grouped * n_embd, 0.0);
    let down_acts = &down_acts[..];
    let chunk = rows_per_job(n_embd, n_groups, threads);
    let parts = n_embd.div_ceil(chunk);
    let (down_out, routed_out) = (Disjoint::new(down), Disjoint::new(routed));
    ember_quant::team::for_each_index(n_groups * parts, |job| {
        let (g, part) = (job / parts, job % parts);
        let group = groups[g];
        let rows = part * chunk..((part + 1) * chunk).min(n_embd);
        let e = group.expert;
        product_part(
            &moe.down.stacked(e),
            &down_acts[g],
            rows.clone(),
            group,
            down_out,
            n_embd,
        );
        // GGML scales the expert's output by its factor as a separate op, before the weight.
        let factor = moe.expert_scale.map(|s| s[e]);
        for (i, &route) in routes_of_expert[e].iter().enumerate() {
            let (src, dst) = ((group.start + i) * n_embd, route as usize * n_embd);
            // SAFETY: job (g, part) alone touches these rows' columns `rows`: the group's rows
            // of `down`, its routes' rows of `routed` (each route belongs to one group).
            let (y, d) = unsafe {
                (
                    down_out.range(src + rows.start..src + rows.end),
                    routed_out.range(dst + rows.start..dst + rows.end),
                )
            };
            match factor {
                Some(f) => d.iter_mut().zip(y.iter()).for_each(|(d, &y)| *d = y * f),
                None => d.copy_from_slice(y),
            }
        }
    });
}

/// [`Backend::moe_ffn`] on the CPU (see the module docs for the order of operations).
pub(super) fn moe_ffn(
    backend: &CpuBackend,
    moe: &MoeFfn<'_, CpuMatrix>,
    router_logits: &[f32],
    x: &Vec<f32>,
    n_tokens: usize,
    out: &mut [f32],
) {
    let routing = &moe.routing;
    let (n_expert, n_used) = (routing.n_expert, routing.n_expert_used);
    let n_embd = moe.gate.cols;
    let n_ff = moe.n_ff;
    debug_assert_eq!(moe.gate.rows, n_ff);
    debug_assert_eq!(moe.gate.n_stacked, n_expert);
    debug_assert_eq!((moe.down.rows, moe.down.cols), (n_embd, n_ff));
    if n_tokens == 0 {
        return;
    }
    let mut guard = backend
        .moe_scratch
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Scratch {
        probs,
        order,
        experts,
        weights,
        routes_of_expert,
        rows,
        gate,
        up,
        down,
        routed,
        shared_gate,
        shared_up,
        shared_out,
        shared_logit,
        groups,
        gate_acts,
        up_acts,
        down_acts,
    } = &mut *guard;

    experts.resize(n_tokens * n_used, 0);
    weights.resize(n_tokens * n_used, 0.0);
    for (t, (token_experts, token_weights)) in experts
        .chunks_exact_mut(n_used)
        .zip(weights.chunks_exact_mut(n_used))
        .enumerate()
    {
        let logits = &router_logits[t * n_expert..(t + 1) * n_expert];
        route_token(logits, routing, probs, order, token_experts, token_weights);
    }

    routes_of_expert.resize_with(n_expert, Vec::new);
    routes_of_expert.iter_mut().for_each(Vec::clear);
    for (route, &e) in experts.iter().enumerate() {
        routes_of_expert[e as usize].push(route as u32);
    }

    routed.resize(n_tokens * n_used * n_embd, 0.0);
    groups.clear();
    let mut grouped = 0;
    for (e, routes) in routes_of_expert.iter().enumerate() {
        if !routes.is_empty() {
            groups.push(Group {
                expert: e,
                start: grouped,
                count: routes.len(),
            });
            grouped += routes.len();
        }
    }
    run_experts(
        backend,
        moe,
        x,
        n_used,
        routes_of_expert,
        ExpertBuffers {
            groups,
            rows,
            gate,
            up,
            down,
            routed,
            gate_acts,
            up_acts,
            down_acts,
        },
    );

    let routed = &routed[..];
    let weights = &weights[..];
    out[..n_tokens * n_embd]
        .par_chunks_mut(n_embd)
        .with_min_len(TOKENS_PER_TASK)
        .enumerate()
        .for_each(|(t, o)| {
            for rank in 0..n_used {
                let route = t * n_used + rank;
                let w = weights[route];
                let y = &routed[route * n_embd..(route + 1) * n_embd];
                if rank == 0 {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o = y * w);
                } else {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o += y * w);
                }
            }
        });

    if let Some(shared) = &moe.shared {
        let n_ff = shared.n_ff;
        backend.ensure_len(shared_gate, n_tokens * n_ff);
        backend.ensure_len(shared_up, n_tokens * n_ff);
        backend.ensure_len(shared_out, n_tokens * n_embd);
        backend.ffn_gate_up(
            shared.gate,
            shared.up,
            x,
            n_tokens,
            n_ff,
            moe.activation,
            shared_gate,
            shared_up,
        );
        backend.matmul(shared.down, shared_gate, n_tokens, shared_out);
        if let Some(gate_inp) = shared.gate_inp {
            backend.ensure_len(shared_logit, n_tokens);
            backend.matmul(gate_inp, x, n_tokens, shared_logit);
            for (row, &logit) in shared_out
                .chunks_exact_mut(n_embd)
                .zip(shared_logit.iter())
                .take(n_tokens)
            {
                let g = 1.0 / (1.0 + (-logit).exp());
                row.iter_mut().for_each(|v| *v *= g);
            }
        }
        ops::par_zip(
            &mut out[..n_tokens * n_embd],
            &shared_out[..n_tokens * n_embd],
            |o, s| *o += s,
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ember_gguf::{GgmlType, Gguf, GgufWriter, Value};

    use super::*;
    use crate::backend::SharedExpert;

    /// Deterministic values in `[-spread, spread)` (a 64-bit LCG).
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

    const N_EMBD: usize = 32;
    const N_FF: usize = 32;
    const N_EXPERT: usize = 6;
    const N_USED: usize = 2;

    /// A file holding stacked experts and a gated shared expert of type `ty`, and the backend's
    /// placements of them.
    struct Layer {
        gate: CpuMatrix,
        up: CpuMatrix,
        down: CpuMatrix,
        shared_gate: CpuMatrix,
        shared_up: CpuMatrix,
        shared_down: CpuMatrix,
        shared_gate_inp: CpuMatrix,
    }

    fn layer(backend: &CpuBackend, ty: GgmlType) -> Layer {
        layer_of(backend, ty, N_EMBD, N_FF)
    }

    fn layer_of(backend: &CpuBackend, ty: GgmlType, n_embd: usize, n_ff: usize) -> Layer {
        // The shared expert is twice as wide as a routed one.
        let (e, f, sf) = (n_embd as u64, n_ff as u64, 2 * n_ff as u64);
        let mut writer = GgufWriter::new();
        writer.metadata("general.architecture", Value::String("test".into()));
        let tensors: [(&str, Vec<u64>); 7] = [
            ("gate", vec![e, f, N_EXPERT as u64]),
            ("up", vec![e, f, N_EXPERT as u64]),
            ("down", vec![f, e, N_EXPERT as u64]),
            ("shared_gate", vec![e, sf]),
            ("shared_up", vec![e, sf]),
            ("shared_down", vec![sf, e]),
            ("shared_gate_inp", vec![e]),
        ];
        for (i, (name, dims)) in tensors.iter().enumerate() {
            let n: u64 = dims.iter().product();
            let v = values(i as u64 + 1, n as usize, 0.5);
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap() as usize];
            ember_quant::quantize(ty, &v, &mut bytes).unwrap();
            writer.tensor(name, dims, ty, bytes);
        }
        let gguf = Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap());
        let info = |name: &str| gguf.tensor(name).unwrap().clone();
        Layer {
            gate: backend.expert_matrix(&gguf, &info("gate")).unwrap(),
            up: backend.expert_matrix(&gguf, &info("up")).unwrap(),
            down: backend.expert_matrix(&gguf, &info("down")).unwrap(),
            shared_gate: backend.matrix(&gguf, &info("shared_gate")).unwrap(),
            shared_up: backend.matrix(&gguf, &info("shared_up")).unwrap(),
            shared_down: backend.matrix(&gguf, &info("shared_down")).unwrap(),
            shared_gate_inp: backend.matrix(&gguf, &info("shared_gate_inp")).unwrap(),
        }
    }

    fn op(layer: &Layer, with_shared: bool) -> MoeFfn<'_, CpuMatrix> {
        MoeFfn {
            gate: &layer.gate,
            up: &layer.up,
            down: &layer.down,
            n_ff: layer.gate.rows,
            activation: FfnActivation::SwiGlu,
            routing: routing(N_EXPERT, N_USED, true),
            expert_scale: None,
            shared: with_shared.then_some(SharedExpert {
                gate: &layer.shared_gate,
                up: &layer.shared_up,
                down: &layer.shared_down,
                n_ff: layer.shared_gate.rows,
                gate_inp: Some(&layer.shared_gate_inp),
            }),
        }
    }

    /// Rows of a (stacked) matrix as f32.
    fn dense(m: &CpuMatrix) -> Vec<f32> {
        let q = m.qmatrix();
        let mut out = vec![0f32; q.rows * q.cols];
        for (r, row) in out.chunks_exact_mut(q.cols).enumerate() {
            q.dequantize_row(r, row).unwrap();
        }
        out
    }

    fn matvec(w: &[f32], x: &[f64]) -> Vec<f64> {
        w.chunks_exact(x.len())
            .map(|row| row.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum())
            .collect()
    }

    fn silu(v: f64) -> f64 {
        v / (1.0 + (-v).exp())
    }

    /// The block in f64 straight from its definition: softmax, top-2, normalised weights, each
    /// chosen expert's SwiGLU FFN, the weighted sum, plus the gated shared expert.
    fn plain(layer: &Layer, logits: &[f32], x: &[f32]) -> Vec<f64> {
        let (gate, up, down) = (dense(&layer.gate), dense(&layer.up), dense(&layer.down));
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let mut order: Vec<usize> = (0..N_EXPERT).collect();
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
        let chosen = &order[..N_USED];
        let total: f64 = chosen.iter().map(|&e| exps[e]).sum();
        let mut out = vec![0f64; N_EMBD];
        for &e in chosen {
            let g = matvec(&gate[e * N_FF * N_EMBD..(e + 1) * N_FF * N_EMBD], &x);
            let u = matvec(&up[e * N_FF * N_EMBD..(e + 1) * N_FF * N_EMBD], &x);
            let h: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
            let y = matvec(&down[e * N_EMBD * N_FF..(e + 1) * N_EMBD * N_FF], &h);
            out.iter_mut()
                .zip(y)
                .for_each(|(o, y)| *o += exps[e] / total * y);
        }
        let g = matvec(&dense(&layer.shared_gate), &x);
        let u = matvec(&dense(&layer.shared_up), &x);
        let h: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
        let y = matvec(&dense(&layer.shared_down), &h);
        let s = matvec(&dense(&layer.shared_gate_inp), &x)[0];
        let gate = 1.0 / (1.0 + (-s).exp());
        out.iter_mut().zip(y).for_each(|(o, y)| *o += gate * y);
        out
    }

    #[test]
    fn the_block_computes_its_definition() {
        let backend = CpuBackend::new(2).unwrap();
        let layer = layer(&backend, GgmlType::F32);
        let n_tokens = 5;
        let logits = values(101, n_tokens * N_EXPERT, 3.0);
        let x = values(102, n_tokens * N_EMBD, 1.0);
        let mut out = vec![0f32; n_tokens * N_EMBD];
        backend.install(|| backend.moe_ffn(&op(&layer, true), &logits, &x, n_tokens, &mut out));
        for t in 0..n_tokens {
            let want = plain(
                &layer,
                &logits[t * N_EXPERT..(t + 1) * N_EXPERT],
                &x[t * N_EMBD..(t + 1) * N_EMBD],
            );
            for (i, (&got, &want)) in out[t * N_EMBD..].iter().zip(&want).enumerate() {
                // f32 products of 32 and 64 terms against f64: a few ulp of values near 1.
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "token {t} value {i}: {got} != {want}"
                );
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_alone_or_in_a_batch() {
        let backend = CpuBackend::new(2).unwrap();
        let layer = layer(&backend, GgmlType::Q8_0);
        let n_tokens = 9;
        let logits = values(201, n_tokens * N_EXPERT, 3.0);
        let x = values(202, n_tokens * N_EMBD, 1.0);
        for with_shared in [false, true] {
            let op = op(&layer, with_shared);
            let mut batched = vec![0f32; n_tokens * N_EMBD];
            backend.install(|| backend.moe_ffn(&op, &logits, &x, n_tokens, &mut batched));
            for t in 0..n_tokens {
                let mut alone = vec![0f32; N_EMBD];
                let token_logits = logits[t * N_EXPERT..(t + 1) * N_EXPERT].to_vec();
                let token_x = x[t * N_EMBD..(t + 1) * N_EMBD].to_vec();
                backend.install(|| backend.moe_ffn(&op, &token_logits, &token_x, 1, &mut alone));
                assert_eq!(
                    alone,
                    batched[t * N_EMBD..(t + 1) * N_EMBD],
                    "token {t}, shared expert {with_shared}"
                );
            }
        }
    }

    /// The experts' products split by whole experts (1 thread: every batch has at least two
    /// groups) or by (expert, rows) (3 threads, fewer than six groups), for a batch and for
    /// each of its tokens alone, give every output the same bits: for each weight type's
    /// kernels, with several tokens per expert (rows of a part copied into place) and one, with
    /// and without the shared expert and the per-expert factors.
    #[test]
    fn expert_products_split_by_rows_or_whole_give_the_same_bits() {
        const E: usize = 256;
        const F: usize = 512;
        let one = CpuBackend::new(1).unwrap();
        let three = CpuBackend::new(3).unwrap();
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
        ] {
            let layer = layer_of(&one, ty, E, F);
            // Q4_K products take llama.cpp's gemm order from four tokens on (a token alone takes
            // its gemv order), so its batch keeps every expert under four.
            let n_tokens = if ty == GgmlType::Q4_K { 3 } else { 5 };
            let logits = values(301, n_tokens * N_EXPERT, 3.0);
            let x = values(302, n_tokens * E, 1.0);
            let factors = values(303, N_EXPERT, 2.0);
            for (with_shared, scaled) in [(false, false), (true, false), (false, true)] {
                let mut op = op(&layer, with_shared);
                if scaled {
                    op.expert_scale = Some(&factors);
                }
                let run = |backend: &CpuBackend, logits: &[f32], x: &[f32], n: usize| {
                    let mut out = vec![f32::NAN; n * E];
                    let (logits, x) = (logits.to_vec(), x.to_vec());
                    backend.install(|| backend.moe_ffn(&op, &logits, &x, n, &mut out));
                    out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let what = format!("{ty}, shared {with_shared}, factors {scaled}");
                let batched = run(&three, &logits, &x, n_tokens);
                assert!(
                    batched == run(&one, &logits, &x, n_tokens),
                    "{what}: 3 threads against 1"
                );
                for t in 0..n_tokens {
                    let alone = run(
                        &three,
                        &logits[t * N_EXPERT..(t + 1) * N_EXPERT],
                        &x[t * E..(t + 1) * E],
                        1,
                    );
                    assert!(
                        alone == batched[t * E..(t + 1) * E],
                        "{what}: token {t} alone against the batch"
                    );
                }
            }
        }
    }

    /// A one-token router product split between threads by rows (experts) gives each logit
    /// GGML's one-token F32 dot product of its row, on 1 thread and on 3, a last job short.
    #[test]
    fn a_one_token_router_gives_each_expert_its_row_dot_product() {
        const E: usize = 96;
        const EXPERTS: usize = 40;
        let weights = values(401, EXPERTS * E, 0.5);
        let mut writer = GgufWriter::new();
        writer.metadata("general.architecture", Value::String("test".into()));
        let bytes = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
        writer.tensor("router", &[E as u64, EXPERTS as u64], GgmlType::F32, bytes);
        let gguf = Arc::new(Gguf::from_bytes(writer.to_bytes()).unwrap());
        let x = values(402, E, 1.0);
        let want: Vec<u32> = weights
            .chunks_exact(E)
            .map(|row| vec::dot_f32_ggml(row, &x).to_bits())
            .collect();
        for threads in [1, 3] {
            let backend = CpuBackend::new(threads).unwrap();
            let router = backend
                .matrix(&gguf, &gguf.tensor("router").unwrap().clone())
                .unwrap();
            let mut out = vec![f32::NAN; EXPERTS];
            backend.install(|| backend.moe_router(&router, &x, 1, &mut out));
            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{threads} threads");
        }
    }

    fn routing(n_expert: usize, n_used: usize, normalize: bool) -> MoeRouting {
        MoeRouting {
            n_expert,
            n_expert_used: n_used,
            gating: ExpertGating::Softmax,
            normalize_weights: normalize,
            weights_scale: None,
        }
    }

    fn route(logits: &[f32], r: &MoeRouting) -> (Vec<u32>, Vec<f32>) {
        let (mut probs, mut order) = (Vec::new(), Vec::new());
        let mut experts = vec![0u32; r.n_expert_used];
        let mut weights = vec![0f32; r.n_expert_used];
        route_token(
            logits,
            r,
            &mut probs,
            &mut order,
            &mut experts,
            &mut weights,
        );
        (experts, weights)
    }

    #[test]
    fn the_most_probable_experts_come_first_with_their_probabilities() {
        let logits = [0.5, 3.0, -1.0, 2.0, 2.5, 0.0];
        let r = routing(6, 3, false);
        let (experts, weights) = route(&logits, &r);
        assert_eq!(experts, [1, 4, 3]);
        let mut probs = vec![0f32; 6];
        vec::softmax_ggml(&logits, &mut probs);
        assert_eq!(weights, [probs[1], probs[4], probs[3]]);
    }

    #[test]
    fn normalised_weights_sum_to_one_and_ties_keep_the_lower_expert() {
        let logits = [1.0, 2.0, 2.0, 0.0];
        let (experts, weights) = route(&logits, &routing(4, 2, true));
        assert_eq!(experts, [1, 2]);
        assert_eq!(weights, [0.5, 0.5]);
        let scaled = MoeRouting {
            weights_scale: Some(2.5),
            ..routing(4, 2, true)
        };
        assert_eq!(route(&logits, &scaled).1, [1.25, 1.25]);
    }

    #[test]
    fn sigmoid_gating_weighs_each_expert_on_its_own() {
        let logits = [0.0, 1.0, -2.0];
        let r = MoeRouting {
            gating: ExpertGating::Sigmoid,
            ..routing(3, 2, false)
        };
        let (experts, weights) = route(&logits, &r);
        assert_eq!(experts, [1, 0]);
        assert_eq!(weights, [1.0 / (1.0 + (-1f32).exp()), 0.5]);
    }
}
