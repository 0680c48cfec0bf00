//! The per-batch arrays of a forward pass on the device: token ids, positions, KV slots, the
//! sequence of each token, the block tables and the output rows, packed into one buffer and
//! uploaded with one copy per forward pass, so the layer loop never waits for the host.

use ember_gpu::ops::{GpuContext, OpsError};
use ember_gpu::{DevicePtr, PoolBuffer, Purpose};

use crate::batch::Batch;
use crate::ops::AttentionPlan;

/// One of the packed arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Array {
    Tokens,
    Positions,
    Slots,
    TableOfToken,
    /// `n_tables` rows of `max_blocks_per_table` block ids (unused entries 0).
    BlockTables,
    OutRows,
}

impl Array {
    const COUNT: usize = 6;

    fn index(self) -> usize {
        match self {
            Array::Tokens => 0,
            Array::Positions => 1,
            Array::Slots => 2,
            Array::TableOfToken => 3,
            Array::BlockTables => 4,
            Array::OutRows => 5,
        }
    }
}

/// Each array starts on a multiple of this many values (64 bytes), so every array is aligned for
/// vector loads whatever the lengths of the others.
const ALIGN_VALUES: usize = 16;

/// The arrays of the current forward pass, on the host and the device.
#[derive(Default)]
pub(super) struct BatchArrays {
    /// [`AttentionPlan::id`] of the plan the arrays were built from (0: none yet).
    plan_id: u64,
    /// Host copies of the arrays that ops receive as host slices, to find their device copy.
    tokens: Vec<u32>,
    positions: Vec<u32>,
    out_rows: Vec<u32>,
    max_blocks_per_table: usize,
    max_position: usize,
    staging: Vec<u32>,
    /// Offsets in values of each array in the buffer in use.
    offsets: [usize; Array::COUNT],
    /// The buffer every batch of up to [`BASE_BYTES`] of arrays uses, allocated with the backend
    /// (so before the weights, at the bottom of the pool) and kept.
    base: Option<PoolBuffer>,
    /// A buffer for a larger batch, kept only while batches need it: a long-lived buffer
    /// allocated among KV blocks would keep their memory mapped after they are released.
    overflow: Option<PoolBuffer>,
    /// Arrays uploaded on the side for callers passing other values; they live until the next
    /// forward pass so the kernels queued with them still find them.
    extra: Vec<PoolBuffer>,
}

/// Bytes of the permanent buffer: the arrays of a 1024-token batch of one sequence with a
/// 4096-token context, or of a few hundred sequences decoding.
const BASE_BYTES: u64 = 64 << 10;

impl BatchArrays {
    /// Arrays with their permanent buffer (none if the pool refuses it now; batches then use
    /// overflow buffers).
    pub(super) fn new(ctx: &GpuContext) -> BatchArrays {
        BatchArrays {
            base: ctx.alloc(Purpose::Scratch, BASE_BYTES).ok(),
            ..BatchArrays::default()
        }
    }

    /// The buffer the arrays of this pass are in.
    fn buf(&self) -> Option<&PoolBuffer> {
        self.overflow.as_ref().or(self.base.as_ref())
    }

    /// Packs and uploads the arrays of one forward pass.
    pub(super) fn upload(
        &mut self,
        ctx: &GpuContext,
        batch: &Batch,
        plan: &AttentionPlan,
        out_rows: &[usize],
    ) -> Result<(), OpsError> {
        // Invalidate first: if the upload fails, nothing may use the previous pass's arrays.
        self.plan_id = 0;
        self.extra.clear();
        self.pack(batch, plan, out_rows);
        let bytes = (self.staging.len() * 4) as u64;
        if self.base.as_ref().is_some_and(|b| b.len() >= bytes) {
            self.overflow = None;
        } else if self.overflow.as_ref().is_none_or(|b| b.len() < bytes) {
            self.overflow = None;
            // Grown to a power of two so a run of growing batches does not reallocate each time.
            self.overflow = Some(ctx.alloc(Purpose::Scratch, bytes.next_power_of_two())?);
        }
        let buf = self.buf().expect("a buffer large enough was chosen above");
        let host: Vec<u8> = self.staging.iter().flat_map(|v| v.to_le_bytes()).collect();
        ctx.upload(buf.ptr(), &host)?;
        self.plan_id = plan.id;
        Ok(())
    }

    /// Fills the host copies, `staging` and `offsets` for one forward pass.
    fn pack(&mut self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        self.tokens.clear();
        self.tokens.extend_from_slice(&batch.tokens);
        self.positions.clear();
        self.positions.extend_from_slice(&plan.positions);
        self.out_rows.clear();
        self.out_rows.extend(out_rows.iter().map(|&r| r as u32));
        self.max_blocks_per_table = plan.tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        self.max_position = plan.positions.iter().copied().max().unwrap_or(0) as usize;

        let staging = &mut self.staging;
        staging.clear();
        let mut push = |index: Array, values: &mut dyn Iterator<Item = u32>| {
            let aligned = staging.len().div_ceil(ALIGN_VALUES) * ALIGN_VALUES;
            staging.resize(aligned, 0);
            self.offsets[index.index()] = aligned;
            staging.extend(values);
        };
        push(Array::Tokens, &mut batch.tokens.iter().copied());
        push(Array::Positions, &mut plan.positions.iter().copied());
        push(Array::Slots, &mut plan.slots.iter().copied());
        push(
            Array::TableOfToken,
            &mut plan.table_of_token.iter().copied(),
        );
        let width = self.max_blocks_per_table;
        push(
            Array::BlockTables,
            &mut plan.tables.iter().flat_map(|t| {
                t.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, width - t.len()))
            }),
        );
        push(Array::OutRows, &mut out_rows.iter().map(|&r| r as u32));
    }

    fn ptr_of(&self, array: Array) -> Result<DevicePtr, OpsError> {
        match self.buf() {
            Some(buf) if self.plan_id != 0 => {
                Ok(buf.ptr().offset((self.offsets[array.index()] * 4) as u64))
            }
            _ => Err(OpsError::Shape {
                op: "batch arrays",
                expected: "the per-batch arrays uploaded by begin_forward".into(),
                found: "no upload for this forward pass".into(),
            }),
        }
    }

    /// The device copy of an array the ops receive as a host slice (token ids, positions, output
    /// rows): the one uploaded for this pass when `host` holds the same values, else a copy made
    /// now (one wait for the upload; only callers outside the forward pass take this path).
    pub(super) fn device_ptr(
        &mut self,
        ctx: &GpuContext,
        array: Array,
        host: &[u32],
    ) -> Result<DevicePtr, OpsError> {
        let uploaded = match array {
            Array::Tokens => &self.tokens,
            Array::Positions => &self.positions,
            Array::OutRows => &self.out_rows,
            Array::Slots | Array::TableOfToken | Array::BlockTables => {
                return Err(OpsError::Shape {
                    op: "batch arrays",
                    expected: "an array passed as a host slice".into(),
                    found: format!("{array:?}, which comes from the attention plan"),
                })
            }
        };
        if self.plan_id != 0 && uploaded.as_slice() == host {
            return self.ptr_of(array);
        }
        let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buf = ctx.alloc(Purpose::Scratch, bytes.len().max(4) as u64)?;
        ctx.upload(buf.ptr(), &bytes)?;
        let ptr = buf.ptr();
        self.extra.push(buf);
        Ok(ptr)
    }

    /// The device copy of one of `plan`'s arrays; `plan` must be the one of this forward pass.
    pub(super) fn plan_ptr(
        &self,
        plan: &AttentionPlan,
        array: Array,
    ) -> Result<DevicePtr, OpsError> {
        if plan.id != self.plan_id || self.plan_id == 0 {
            return Err(OpsError::Shape {
                op: "batch arrays",
                expected: format!(
                    "the attention plan uploaded for this forward pass (plan {})",
                    self.plan_id
                ),
                found: format!("plan {}", plan.id),
            });
        }
        self.ptr_of(array)
    }

    /// Width of the block-table rows.
    pub(super) fn max_blocks_per_table(&self) -> usize {
        self.max_blocks_per_table
    }

    /// The largest position in the batch.
    pub(super) fn max_position(&self) -> usize {
        self.max_position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(arrays: &BatchArrays, array: Array, len: usize) -> &[u32] {
        let start = arrays.offsets[array.index()];
        &arrays.staging[start..start + len]
    }

    #[test]
    fn packs_every_array_aligned_with_padded_block_tables() {
        // Two sequences: seq 7 continues at position 40 (blocks 3 and 5), seq 2 starts a
        // three-token prompt (block 9).
        let mut batch = Batch::new();
        batch.push(11, 40, 7, true);
        batch.push(12, 0, 2, false);
        batch.push(13, 1, 2, false);
        batch.push(14, 2, 2, true);
        let plan = AttentionPlan {
            id: 5,
            block_size: 32,
            slots: vec![5 * 32 + 8, 9 * 32, 9 * 32 + 1, 9 * 32 + 2],
            positions: vec![40, 0, 1, 2],
            table_of_token: vec![0, 1, 1, 1],
            tables: vec![vec![3, 5], vec![9]],
        };
        let mut arrays = BatchArrays::default();
        arrays.pack(&batch, &plan, &[0, 3]);
        for array in [
            Array::Tokens,
            Array::Positions,
            Array::Slots,
            Array::TableOfToken,
            Array::BlockTables,
            Array::OutRows,
        ] {
            assert_eq!(arrays.offsets[array.index()] % ALIGN_VALUES, 0, "{array:?}");
        }
        assert_eq!(section(&arrays, Array::Tokens, 4), [11, 12, 13, 14]);
        assert_eq!(section(&arrays, Array::Positions, 4), [40, 0, 1, 2]);
        assert_eq!(section(&arrays, Array::Slots, 4), [168, 288, 289, 290]);
        assert_eq!(section(&arrays, Array::TableOfToken, 4), [0, 1, 1, 1]);
        assert_eq!(section(&arrays, Array::BlockTables, 4), [3, 5, 9, 0]);
        assert_eq!(section(&arrays, Array::OutRows, 2), [0, 3]);
        assert_eq!(arrays.max_blocks_per_table(), 2);
        assert_eq!(arrays.max_position(), 40);
        // Packing a smaller batch afterwards leaves no trace of the larger one.
        let single = Batch::for_sequence(1, 0, &[99], true);
        let plan = AttentionPlan {
            id: 6,
            block_size: 32,
            slots: vec![0],
            positions: vec![0],
            table_of_token: vec![0],
            tables: vec![vec![0]],
        };
        arrays.pack(&single, &plan, &[0]);
        assert_eq!(section(&arrays, Array::Tokens, 1), [99]);
        assert_eq!(arrays.max_blocks_per_table(), 1);
        assert_eq!(arrays.max_position(), 0);
        assert_eq!(arrays.staging.len(), 5 * ALIGN_VALUES + 1);
    }

    #[test]
    fn plan_arrays_are_refused_before_an_upload() {
        let arrays = BatchArrays::default();
        let plan = AttentionPlan::default();
        let error = arrays.plan_ptr(&plan, Array::Slots).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("expected the attention plan uploaded"),
            "{error}"
        );
    }
}
