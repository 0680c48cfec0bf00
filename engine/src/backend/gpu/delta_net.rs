//! The GPU backend's part of the hybrid models (Qwen 3.5 / 3.6): the recurrent states on the
//! device, the table of a pass's sequences, and the linear-attention and query-gate ops over
//! `ember_gpu::ops::delta_net`.
//!
//! States: each sequence's recurrent state is one zeroed device buffer of purpose
//! [`Purpose::RecurrentState`] made by [`GpuBackend::state_alloc_on_device`] when the engine's
//! state store ([`crate::recurrent_state`]) first sees the sequence, and given back to the pool
//! when the store drops it with the sequence, so the pool's accounting and the memory report show
//! them apart from KV and scratch.
//!
//! Graphs: the kernels read the batch's sequences from a device table (state addresses, rows
//! per sequence) that [`GpuBackend::upload_sequence_table`] uploads once per pass, before the
//! pass starts recording (`Backend::begin_states`), so nothing in a layer waits for the host.
//! A recorded pass that cannot run is run again with plain launches (see [`super::graph`]); that
//! is sound only while nothing touched the states before the recording ran, so when a capture
//! has been aborted midway (an op of the pass had to wait for the device, after which the rest of
//! the pass would run for real and then run again), the delta-net launches of that pass are
//! skipped and the repeat does them once.

use ember_gpu::ops::{self, DeltaNetIo, DeltaNetLayer, DeltaNetSeqs, OpsError};
use ember_gpu::{DevicePtr, PoolBuffer, Purpose};

use super::{check_vector, lock, GpuBackend, GpuBuf, GpuVector};
use crate::backend::{GatedDeltaNet, SequenceState};

#[cfg(test)]
#[path = "delta_net_tests.rs"]
mod tests;

/// The device table of the current pass's sequences and the convolution scratch.
#[derive(Default)]
pub(super) struct DeltaNetScratch {
    /// `[state address as two u32 per sequence][starts: n_seq + 1][rows]`, as last uploaded.
    host: Vec<u32>,
    table: Option<PoolBuffer>,
    n_seq: usize,
    n_rows: usize,
    /// The convolution's output (`[rows, channels]`).
    conv: GpuBuf,
}

/// The table words of `states` (see [`DeltaNetScratch::host`]), with the sequence and row counts
/// and the highest batch row.
fn table_words(
    states: &[SequenceState<'_, GpuBuf>],
    out: &mut Vec<u32>,
) -> Result<(usize, usize, usize), OpsError> {
    out.clear();
    let mut n_rows = 0;
    let mut max_row = 0;
    for s in states {
        let address = s.state.ptr("gated_delta_net states", s.offset)?.0;
        out.push(address as u32);
        out.push((address >> 32) as u32);
    }
    out.push(0);
    for s in states {
        n_rows += s.rows.len();
        out.push(as_i32(n_rows)?);
    }
    for s in states {
        for &row in s.rows {
            max_row = max_row.max(row);
            out.push(as_i32(row)?);
        }
    }
    Ok((states.len(), n_rows, max_row))
}

fn as_i32(value: usize) -> Result<u32, OpsError> {
    i32::try_from(value)
        .map(|v| v as u32)
        .map_err(|_| OpsError::Shape {
            op: "gated_delta_net",
            expected: "row counts below 2^31".into(),
            found: value.to_string(),
        })
}

impl GpuBackend {
    /// [`crate::backend::Backend::state_alloc`]: a zeroed buffer of purpose
    /// [`Purpose::RecurrentState`].
    pub(super) fn state_alloc_on_device(&self, len: usize) -> GpuBuf {
        let mut buf = GpuBuf { buf: None, len: 0 };
        self.run("allocating a recurrent state", || {
            if len == 0 {
                return Ok(());
            }
            let bytes = super::f32_bytes(len);
            let pool_buf = self.ctx.alloc(Purpose::RecurrentState, bytes)?;
            self.ctx.zero(pool_buf.ptr(), bytes)?;
            buf.buf = Some(pool_buf);
            buf.len = len;
            Ok(())
        });
        buf
    }

    /// [`crate::backend::Backend::begin_states`]: uploads the table of the pass's sequences.
    pub(super) fn upload_sequence_table(&self, states: &[SequenceState<'_, GpuBuf>]) {
        self.run("uploading the sequence table", || {
            let mut scratch = lock(&self.delta_net);
            let mut host = std::mem::take(&mut scratch.host);
            // Invalidate first: if the upload fails, no op may use the previous pass's table.
            scratch.n_seq = 0;
            let (n_seq, n_rows, _) = table_words(states, &mut host)?;
            let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
            if scratch
                .table
                .as_ref()
                .is_none_or(|t| t.len() < bytes.len() as u64)
            {
                scratch.table = None;
                let size = (bytes.len() as u64).next_power_of_two().max(256);
                scratch.table = Some(self.ctx.alloc(Purpose::Scratch, size)?);
            }
            let table = scratch.table.as_ref().expect("allocated above");
            self.ctx.upload(table.ptr(), &bytes)?;
            scratch.host = host;
            scratch.n_seq = n_seq;
            scratch.n_rows = n_rows;
            Ok(())
        });
    }

    /// [`crate::backend::Backend::gated_delta_net`] on the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_net_on_device(
        &self,
        op: &GatedDeltaNet<'_, GpuVector>,
        qkv: &GpuBuf,
        z: &GpuBuf,
        beta: &GpuBuf,
        alpha: &GpuBuf,
        states: &mut [SequenceState<'_, GpuBuf>],
        out: &mut GpuBuf,
    ) {
        if lock(&self.graphs).is_capturing() && !self.ctx.is_capturing() {
            // The recording of this pass was aborted: it runs again with plain launches, which
            // update the states once (see the module docs).
            return;
        }
        self.run("gated_delta_net", || {
            const OP: &str = "gated_delta_net";
            let mut scratch = lock(&self.delta_net);
            let mut words = Vec::new();
            let (n_seq, n_rows, max_row) = table_words(states, &mut words)?;
            if n_seq == 0 || n_rows == 0 {
                return Ok(());
            }
            if scratch.n_seq == 0 || words != scratch.host {
                // Uploading here would wait for the device in the middle of a pass.
                return Err(OpsError::Shape {
                    op: OP,
                    expected: "the sequences whose table begin_states uploaded for this pass"
                        .into(),
                    found: format!("{n_seq} other sequences"),
                });
            }
            let table = scratch
                .table
                .as_ref()
                .expect("uploaded with the host words");
            let base = table.ptr();
            let seqs = DeltaNetSeqs {
                states: base,
                starts: base.offset(8 * n_seq as u64),
                rows: base.offset(4 * (2 * n_seq + n_seq + 1) as u64),
                n_seq,
                n_rows,
            };
            let layer = DeltaNetLayer {
                conv: op.conv.buf.ptr(),
                dt_bias: op.dt_bias.buf.ptr(),
                a: op.a.buf.ptr(),
                norm: op.norm.buf.ptr(),
                conv_kernel: op.conv_kernel,
                n_k_heads: op.n_k_heads,
                n_v_heads: op.n_v_heads,
                head_dim: op.head_dim,
                eps: op.eps,
                state_offset: states[0].offset,
            };
            check_vector(OP, op.conv, layer.channels() * op.conv_kernel)?;
            check_vector(OP, op.dt_bias, op.n_v_heads)?;
            check_vector(OP, op.a, op.n_v_heads)?;
            check_vector(OP, op.norm, op.head_dim)?;
            let state_len = layer.state_offset + op.conv_state_len() + op.ssm_state_len();
            for s in states.iter() {
                if s.offset != layer.state_offset {
                    return Err(OpsError::Shape {
                        op: OP,
                        expected: "every sequence at the same layer offset".into(),
                        found: format!("offsets {} and {}", layer.state_offset, s.offset),
                    });
                }
                s.state.ptr(OP, state_len)?;
            }
            let batch_rows = max_row + 1;
            let channels = layer.channels();
            let value_dim = op.n_v_heads * op.head_dim;
            let io = DeltaNetIo {
                qkv: qkv.ptr(OP, batch_rows * channels)?,
                z: z.ptr(OP, batch_rows * value_dim)?,
                beta: beta.ptr(OP, batch_rows * op.n_v_heads)?,
                alpha: alpha.ptr(OP, batch_rows * op.n_v_heads)?,
                conv: conv_scratch(self, &mut scratch.conv, batch_rows * channels)?,
                out: out.ptr(OP, batch_rows * value_dim)?,
            };
            ops::gated_delta_net(&self.ctx, &layer, &seqs, &io)
        });
    }

    /// [`crate::backend::Backend::split_query_gate`] on the device.
    pub(super) fn split_query_gate_on_device(
        &self,
        q_full: &GpuBuf,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        q: &mut GpuBuf,
        gate: &mut GpuBuf,
    ) {
        self.run("split_query_gate", || {
            let len = n_tokens * n_heads * head_dim;
            let full = q_full.ptr("split_query_gate", 2 * len)?;
            let q_ptr = q.ptr("split_query_gate", len)?;
            let gate_ptr = gate.ptr("split_query_gate", len)?;
            ops::split_query_gate(
                &self.ctx, full, n_tokens, n_heads, head_dim, q_ptr, gate_ptr,
            )
        });
    }

    /// [`crate::backend::Backend::mul_sigmoid`] on the device.
    pub(super) fn mul_sigmoid_on_device(&self, x: &mut GpuBuf, gate: &GpuBuf, len: usize) {
        self.run("mul_sigmoid", || {
            let x_ptr = x.ptr("mul_sigmoid", len)?;
            let gate_ptr = gate.ptr("mul_sigmoid", len)?;
            ops::mul_sigmoid(&self.ctx, x_ptr, gate_ptr, len)
        });
    }

    /// Gives back the convolution scratch and the sequence table.
    pub(super) fn release_delta_net_scratch(&self) {
        *lock(&self.delta_net) = DeltaNetScratch::default();
    }
}

/// The convolution scratch, grown to `len` values when shorter.
fn conv_scratch(
    backend: &GpuBackend,
    conv: &mut GpuBuf,
    len: usize,
) -> Result<DevicePtr, OpsError> {
    if conv.len < len || conv.buf.is_none() {
        conv.buf = None;
        conv.len = 0;
        conv.buf = backend.alloc_f32(len)?;
        conv.len = len;
    }
    conv.ptr("gated_delta_net scratch", len)
}
