//! The memory a [`super::split::SplitBackend`] places on each of its devices, by purpose: the
//! weight tensors it put there, the KV blocks its layers there hold, and the activation
//! buffers living there. A GPU backend's pool accounts for its own memory; the CPU has no
//! pool, so this is what `--memory-report` shows for it, and for simulated devices beside
//! their pools (and how a test checks that a split puts every byte where the plan says).
//!
//! Every figure is counted from the allocations themselves, as the split makes them: a
//! buffer's or KV layer's bytes are the device backend's own answer
//! ([`super::Backend::buf_bytes`], [`super::Backend::kv_bytes`]) after each change, and are
//! taken off again when it is dropped; a device's op scratch
//! ([`super::Backend::op_scratch_bytes`]) is counted after each forward pass and after it is
//! given back.
//!
//! A device with a pool of its own in the split (a simulated device, [`super::sim`]) also has
//! every counted byte reserved from that pool ([`Reservation`]): the pool's budget then
//! refuses what does not fit, and its accounting and idle trim are the device's, as on a GPU.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use ember_gpu::pool::{format_bytes, DevicePool, PoolBuffer, PoolError, Purpose};

/// What a counted byte is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitPurpose {
    /// Weight tensors, as stored in the file.
    Weights,
    /// KV cache blocks holding memory.
    Kv,
    /// Activation buffers (the forward pass's scratch), and the scratch the device's ops keep
    /// between calls.
    Scratch,
}

impl SplitPurpose {
    /// The pool purpose its bytes are reserved as.
    pub fn pool_purpose(self) -> Purpose {
        match self {
            SplitPurpose::Weights => Purpose::Weights,
            SplitPurpose::Kv => Purpose::Kv,
            SplitPurpose::Scratch => Purpose::Scratch,
        }
    }

    fn index(self) -> usize {
        match self {
            SplitPurpose::Weights => 0,
            SplitPurpose::Kv => 1,
            SplitPurpose::Scratch => 2,
        }
    }
}

/// Bytes by purpose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByPurpose {
    pub weights: u64,
    pub kv: u64,
    pub scratch: u64,
}

impl ByPurpose {
    fn from_array(values: [u64; 3]) -> ByPurpose {
        ByPurpose {
            weights: values[0],
            kv: values[1],
            scratch: values[2],
        }
    }

    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.scratch
    }
}

/// One device's memory as the split counted it: now, and the most each purpose has held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device's name (`cpu`, `sim:0`, `cuda:0`).
    pub device: String,
    pub now: ByPurpose,
    /// The most each purpose has held (each purpose's own peak: they need not coincide).
    pub peak: ByPurpose,
}

impl fmt::Display for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: weights {}, kv cache {} now ({} at peak), scratch {} now ({} at peak)",
            self.device,
            format_bytes(self.now.weights),
            format_bytes(self.now.kv),
            format_bytes(self.peak.kv),
            format_bytes(self.now.scratch),
            format_bytes(self.peak.scratch),
        )
    }
}

#[derive(Debug, Default)]
struct Counters {
    now: [AtomicU64; 3],
    peak: [AtomicU64; 3],
}

/// The counters of every device of one split; shared by the split, its buffers and its KV
/// layers (which take their bytes off when dropped).
#[derive(Debug)]
pub struct SplitMemory {
    names: Vec<String>,
    devices: Vec<Counters>,
}

impl SplitMemory {
    pub fn new(names: Vec<String>) -> SplitMemory {
        SplitMemory {
            devices: names.iter().map(|_| Counters::default()).collect(),
            names,
        }
    }

    /// The devices' names, in device order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub(crate) fn add(&self, device: usize, purpose: SplitPurpose, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let counters = &self.devices[device];
        let i = purpose.index();
        let now = counters.now[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        counters.peak[i].fetch_max(now, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, device: usize, purpose: SplitPurpose, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.devices[device].now[purpose.index()].fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Moves a count from `old` bytes to `new` bytes.
    pub(crate) fn change(&self, device: usize, purpose: SplitPurpose, old: u64, new: u64) {
        if new > old {
            self.add(device, purpose, new - old);
        } else {
            self.sub(device, purpose, old - new);
        }
    }

    /// Device `device`'s memory now and at peak.
    pub fn device(&self, device: usize) -> DeviceMemory {
        let counters = &self.devices[device];
        let load = |values: &[AtomicU64; 3]| {
            ByPurpose::from_array([0, 1, 2].map(|i| values[i].load(Ordering::Relaxed)))
        };
        DeviceMemory {
            device: self.names[device].clone(),
            now: load(&counters.now),
            peak: load(&counters.peak),
        }
    }

    /// Every device's memory, in device order.
    pub fn devices(&self) -> Vec<DeviceMemory> {
        (0..self.devices.len()).map(|d| self.device(d)).collect()
    }
}

/// Bytes of one thing the split holds on a device (an activation buffer's part, a KV layer, a
/// device's op scratch), reserved from the device's pool: a list of pool buffers that grows by
/// the bytes added and gives back whole buffers when the thing shrinks, so the pool's live
/// bytes are exactly the split's counts. Dropping it gives everything back to the pool.
#[derive(Debug, Default)]
pub struct Reservation {
    buffers: Vec<PoolBuffer>,
    bytes: u64,
}

impl Reservation {
    /// Bytes reserved now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Makes the reservation `bytes` long. On failure (the budget, the device's memory) the
    /// pool's error says why, and the reservation holds less than `bytes`.
    pub fn resize(
        &mut self,
        pool: &DevicePool,
        purpose: SplitPurpose,
        bytes: u64,
    ) -> Result<(), PoolError> {
        while self.bytes > bytes {
            let Some(last) = self.buffers.pop() else {
                break;
            };
            self.bytes -= last.len();
        }
        if bytes > self.bytes {
            let buffer = pool.alloc(purpose.pool_purpose(), bytes - self.bytes)?;
            self.bytes += buffer.len();
            self.buffers.push(buffer);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_changes_and_keep_each_purposes_peak() {
        let memory = SplitMemory::new(vec!["cpu".into(), "sim:0".into()]);
        memory.add(0, SplitPurpose::Weights, 1000);
        memory.add(1, SplitPurpose::Kv, 64);
        memory.change(1, SplitPurpose::Kv, 64, 192);
        memory.add(1, SplitPurpose::Scratch, 40);
        memory.change(1, SplitPurpose::Kv, 192, 128);
        memory.sub(1, SplitPurpose::Scratch, 40);
        assert_eq!(
            memory.device(0),
            DeviceMemory {
                device: "cpu".into(),
                now: ByPurpose {
                    weights: 1000,
                    kv: 0,
                    scratch: 0
                },
                peak: ByPurpose {
                    weights: 1000,
                    kv: 0,
                    scratch: 0
                },
            }
        );
        let sim = memory.device(1);
        assert_eq!((sim.now.kv, sim.peak.kv), (128, 192));
        assert_eq!((sim.now.scratch, sim.peak.scratch), (0, 40));
        assert_eq!(sim.now.total(), 128);
        assert_eq!(
            sim.to_string(),
            "sim:0: weights 0 B, kv cache 128 B now (192 B at peak), scratch 0 B now (40 B at peak)"
        );
    }
}
