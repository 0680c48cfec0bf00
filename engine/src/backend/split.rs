//! A model's layers over several devices: a [`Backend`] that owns one backend per device and
//! routes each op to the device holding its weights, moving activations between devices when an
//! op needs them elsewhere (the layer loop does not change, and every op keeps its one
//! implementation: the device backends' own).
//!
//! Where things live:
//! - a weight (matrix or vector) on the device of its layer (`blk.N.*`), by the
//!   [`crate::load_plan::LoadPlan`]; the output layer, the token embedding and every other
//!   tensor on the output device;
//! - each KV storage layer on the device of the model layer it belongs to, so each device's KV
//!   cache holds only its own layers' blocks;
//! - an activation buffer on the device that last wrote it ("home"). An op runs on the device
//!   of its weight or KV layer, or, for ops without one, where its first buffer is; inputs
//!   living elsewhere are moved there first: where the pair's [`PairState`] allows a peer
//!   copy, by the devices' own ([`Backend::copy_from_peer`]: GPUs copy device to device, on the
//!   destination's stream, so a decode graph records it) or else over the split's peer link
//!   (simulated devices); otherwise read to host memory, then written to the device (host
//!   staging). Outputs an op overwrites are only re-homed, not copied.
//!
//! So activations cross devices where layers change device: the residual stream once per
//! boundary, as llama.cpp's layer split does.
//!
//! Each device's weights, KV blocks and activation buffers are counted as they are placed and
//! allocated ([`super::split_memory`]): the memory report of the devices without a GPU
//! backend's pool.
//! A device given a pool ([`SplitBackend::with_pools`]: simulated devices) has the same bytes
//! reserved from it, so its budget refuses what does not fit (a weight: the load fails naming
//! the device; an allocation during a forward pass: the pass fails with an out-of-memory
//! [`OpFailure`] naming it), its pool trims to its floor when idle, and its weights' pool
//! buffers are what the placement check observes.
//!
//! Not built: models with recurrent state (hybrids' linear attention) over more than one
//! device, whose per-sequence state buffer holds every layer's state: they are refused at load.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ember_gguf::{Gguf, TensorInfo};
use ember_gpu::peer::{PairState, PeerLink};
use ember_gpu::pool::{DevicePool, PoolBuffer, PoolError};
use ember_gpu::DevicePtr;

use super::gpu::trim::IdleTrimmer;
use super::split_memory::{Reservation, SplitMemory, SplitPurpose};
use super::{Backend, BackendError, MoeFfn, OpFailure, QkNorm, SharedExpert};
use crate::batch::Batch;
use crate::ops::{AttentionPlan, FfnActivation, RopeMode, RopeParams};

/// An activation buffer that lives on one device at a time (with room kept on the others it
/// visited, reused on the next visit).
pub struct SplitBuf<Buf> {
    parts: RefCell<Parts<Buf>>,
}

struct Parts<Buf> {
    bufs: Vec<Option<Buf>>,
    home: usize,
    len: usize,
    /// Bytes of each device's part as last counted in `memory` (taken off when dropped).
    counted: Vec<u64>,
    /// Each part's bytes reserved from its device's pool, where the device has one.
    reserved: Vec<Reservation>,
    memory: Arc<SplitMemory>,
}

impl<Buf> Drop for Parts<Buf> {
    fn drop(&mut self) {
        for (device, &bytes) in self.counted.iter().enumerate() {
            self.memory.sub(device, SplitPurpose::Scratch, bytes);
        }
    }
}

impl<Buf> Parts<Buf> {
    fn on(&self, device: usize) -> &Buf {
        self.bufs[device]
            .as_ref()
            .expect("a buffer is allocated on a device before an op runs there")
    }

    fn on_mut(&mut self, device: usize) -> &mut Buf {
        self.bufs[device]
            .as_mut()
            .expect("a buffer is allocated on a device before an op runs there")
    }
}

/// A weight on one device.
pub struct OnDevice<T> {
    device: usize,
    inner: T,
    /// Where a device that streams weights finds it (see [`STREAM_MIN_TOKENS`]): set for the
    /// matrices of the devices that do not stream, in a split that has one that does.
    source: Option<Box<(Arc<Gguf>, TensorInfo)>>,
    /// Its bytes reserved from the device's pool, where the device has one.
    _reserved: Option<PoolBuffer>,
}

/// The fewest tokens of a product that a split runs on its weight-streaming device (a GPU of a
/// partial offload) when the weight lives on a device that does not stream (the CPU). Copying a
/// matrix of an 8B model's layer to the GPU costs a few milliseconds, about what the CPU spends
/// on a handful of tokens of that product; a prompt batch of hundreds of tokens then runs
/// tens of times faster than on the CPU (as llama.cpp offloads the products of host-resident
/// layers). Above [`crate::backend::gpu::graph::GRAPH_MAX_TOKENS`], so a pass that a GPU records
/// as a graph never streams: the weight's upload could not be recorded. Decode and small
/// batches read the weights once where they are. `EMBER_STREAM_MIN_TOKENS` sets it (0: never).
pub const STREAM_MIN_TOKENS: usize = 128;

impl<T> OnDevice<T> {
    /// The device it is on.
    pub fn device(&self) -> usize {
        self.device
    }
}

/// A KV storage layer on one device, its bytes counted in the split's memory (and taken off
/// when dropped with the cache).
pub struct SplitKvLayer<K> {
    device: usize,
    inner: K,
    counted: u64,
    /// Its bytes reserved from the device's pool, where the device has one.
    reserved: Reservation,
    memory: Arc<SplitMemory>,
}

impl<K> SplitKvLayer<K> {
    /// The device it is on.
    pub fn device(&self) -> usize {
        self.device
    }
}

impl<K> Drop for SplitKvLayer<K> {
    fn drop(&mut self) {
        self.memory.sub(self.device, SplitPurpose::Kv, self.counted);
    }
}

/// One rotary table per device (they are small, and filled once per pass).
pub struct SplitRope<T> {
    tables: Vec<T>,
}

/// Copies between devices so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferStats {
    pub peer_copies: u64,
    pub staged_copies: u64,
    pub bytes: u64,
}

/// Layers over several devices of one backend type; see the module documentation.
pub struct SplitBackend<B: Backend> {
    devices: Vec<B>,
    names: Vec<String>,
    /// `layer_device[il]`: the device of layer `il`.
    layer_device: Vec<usize>,
    output_device: usize,
    /// The device of each KV storage layer, in the order the KV cache creates them.
    kv_devices: Vec<usize>,
    kv_created: AtomicUsize,
    /// The device of the last op, where new buffers start.
    current: AtomicUsize,
    link: Option<Arc<dyn PeerLink>>,
    pairs: Vec<PairState>,
    peer_copies: AtomicU64,
    staged_copies: AtomicU64,
    bytes: AtomicU64,
    /// What each device holds by purpose, as placed and allocated here.
    memory: Arc<SplitMemory>,
    /// Each device's op scratch ([`Backend::op_scratch_bytes`]) as last counted in `memory`.
    op_scratch: Vec<AtomicU64>,
    /// The device that runs large products of the other devices' weights
    /// ([`Backend::matmul_streamed`]), and from how many tokens; `None` when none streams.
    stream_to: Option<(usize, usize)>,
    /// Products run by [`Backend::matmul_streamed`] so far.
    streamed_products: AtomicU64,
    /// The pool of each device that has one ([`SplitBackend::with_pools`]).
    pools: Vec<Option<Arc<DevicePool>>>,
    /// Each device's op scratch reserved from its pool.
    op_scratch_reserved: Vec<Mutex<Reservation>>,
    /// The weight buffers reserved on each device with a pool: name, address, bytes.
    placed: Mutex<Vec<Vec<(String, DevicePtr, u64)>>>,
    /// The first reservation that failed during ops, for [`Backend::take_failure`].
    failure: Mutex<Option<OpFailure>>,
    /// The idle trimmers of the pools, stopped with the split.
    _trimmers: Vec<IdleTrimmer>,
}

impl<B: Backend> Drop for SplitBackend<B> {
    fn drop(&mut self) {
        // The devices' op scratch goes with them.
        for (device, counted) in self.op_scratch.iter().enumerate() {
            self.memory.sub(
                device,
                SplitPurpose::Scratch,
                counted.load(Ordering::Relaxed),
            );
        }
    }
}

/// What a split needs to know about the model: its layers' devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitLayout {
    /// The device of each layer.
    pub layer_device: Vec<usize>,
    pub output_device: usize,
    /// The device of each KV storage layer, in layer order (layers with their own KV cache).
    pub kv_devices: Vec<usize>,
}

impl SplitLayout {
    /// The layout of a model whose layers `has_kv[il]` own a KV cache, layer `il` on
    /// `layer_device[il]`.
    pub fn new(layer_device: Vec<usize>, output_device: usize, has_kv: &[bool]) -> SplitLayout {
        let kv_devices = layer_device
            .iter()
            .zip(has_kv)
            .filter(|(_, &kv)| kv)
            .map(|(&d, _)| d)
            .collect();
        SplitLayout {
            layer_device,
            output_device,
            kv_devices,
        }
    }

    /// The layout of [`crate::model::HParams`]' layers.
    pub fn for_model(
        hparams: &crate::model::HParams,
        layer_device: Vec<usize>,
        output_device: usize,
    ) -> SplitLayout {
        let has_kv: Vec<bool> = hparams
            .layers
            .iter()
            .enumerate()
            .map(|(il, l)| !l.recurrent && l.kv_source == il)
            .collect();
        SplitLayout::new(layer_device, output_device, &has_kv)
    }
}

impl<B: Backend> SplitBackend<B> {
    /// A split over `devices` (named `names` for messages), laid out by `layout`. `pairs` says
    /// how copies travel between each ordered pair (from [`ember_gpu::peer::plan_pairs`]);
    /// `link` is the peer path the pairs marked `peer` use. Pairs not listed go through host
    /// memory.
    pub fn new(
        devices: Vec<B>,
        names: Vec<String>,
        layout: SplitLayout,
        link: Option<Arc<dyn PeerLink>>,
        pairs: Vec<PairState>,
    ) -> SplitBackend<B> {
        assert!(
            !devices.is_empty() && names.len() == devices.len(),
            "a split has at least one device, and one name per device"
        );
        let n = devices.len();
        assert!(
            layout.layer_device.iter().all(|&d| d < n) && layout.output_device < n,
            "the layout names devices of the split"
        );
        let stream_min = match std::env::var("EMBER_STREAM_MIN_TOKENS") {
            Ok(value) => value.trim().parse::<usize>().unwrap_or_else(|_| {
                tracing::warn!(%value, "EMBER_STREAM_MIN_TOKENS is not a token count; using {STREAM_MIN_TOKENS}");
                STREAM_MIN_TOKENS
            }),
            Err(_) => STREAM_MIN_TOKENS,
        };
        SplitBackend {
            stream_to: None,
            streamed_products: AtomicU64::new(0),
            devices,
            memory: Arc::new(SplitMemory::new(names.clone())),
            names,
            layer_device: layout.layer_device,
            output_device: layout.output_device,
            kv_devices: layout.kv_devices,
            kv_created: AtomicUsize::new(0),
            current: AtomicUsize::new(0),
            link,
            pairs,
            peer_copies: AtomicU64::new(0),
            staged_copies: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            op_scratch: (0..n).map(|_| AtomicU64::new(0)).collect(),
            pools: (0..n).map(|_| None).collect(),
            op_scratch_reserved: (0..n).map(|_| Mutex::default()).collect(),
            placed: Mutex::new((0..n).map(|_| Vec::new()).collect()),
            failure: Mutex::new(None),
            _trimmers: Vec::new(),
        }
        .with_stream_min_tokens(stream_min)
    }

    /// Gives devices pools of their own (`pools[d]` for device `d`, `None` for a device
    /// without one): from now on every byte the split counts on such a device is also reserved
    /// from its pool (see the module documentation). With `idle_trim`, a thread per pool trims
    /// it to its floor once idle, as a GPU backend's does. Call it before placing anything.
    pub fn with_pools(mut self, pools: Vec<Option<Arc<DevicePool>>>, idle_trim: bool) -> Self {
        assert_eq!(
            pools.len(),
            self.devices.len(),
            "one pool slot per device of the split"
        );
        if idle_trim {
            self._trimmers = pools
                .iter()
                .flatten()
                .filter_map(|pool| IdleTrimmer::start(Arc::clone(pool)))
                .collect();
        }
        self.pools = pools;
        self
    }

    /// The pool of each device that has one, in device order.
    pub fn pools(&self) -> &[Option<Arc<DevicePool>>] {
        &self.pools
    }

    /// The weight buffers reserved from `device`'s pool (name, address, bytes), for its
    /// placement check; empty for a device without a pool.
    pub fn placed_weights(&self, device: usize) -> Vec<(String, DevicePtr, u64)> {
        lock(&self.placed)[device].clone()
    }

    /// Resizes `reservation` on `device` (when it has a pool) to `bytes`; a failure is kept for
    /// [`Backend::take_failure`], naming the device and the op.
    fn reserve(
        &self,
        device: usize,
        reservation: &mut Reservation,
        purpose: SplitPurpose,
        bytes: u64,
        op: &'static str,
    ) {
        let Some(pool) = &self.pools[device] else {
            return;
        };
        if let Err(error) = reservation.resize(pool, purpose, bytes) {
            let failure = OpFailure {
                backend: self.devices[device].name(),
                op,
                cause: format!("{}: {error}", self.names[device]),
                out_of_memory: matches!(
                    error,
                    PoolError::BudgetExceeded { .. } | PoolError::OutOfMemory { .. }
                ),
            };
            lock(&self.failure).get_or_insert(failure);
        }
    }

    /// Counts each device's op scratch again (after a forward pass, or after giving it back).
    fn recount_op_scratch(&self) {
        for (device, backend) in self.devices.iter().enumerate() {
            let bytes = backend.op_scratch_bytes() as u64;
            let old = self.op_scratch[device].swap(bytes, Ordering::Relaxed);
            self.memory
                .change(device, SplitPurpose::Scratch, old, bytes);
            let mut reserved = lock(&self.op_scratch_reserved[device]);
            self.reserve(
                device,
                &mut reserved,
                SplitPurpose::Scratch,
                bytes,
                "op scratch",
            );
        }
    }

    /// The devices' names, in device order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Bytes of the weight tensors placed on each device (as stored in the file), in device
    /// order.
    pub fn weight_bytes_per_device(&self) -> Vec<u64> {
        self.memory
            .devices()
            .iter()
            .map(|d| d.now.weights)
            .collect()
    }

    /// What each device holds by purpose (weights, KV blocks, activation buffers), now and at
    /// peak, as this split placed and allocated it; shared, so that it can be read after the
    /// model is gone.
    pub fn memory(&self) -> &Arc<SplitMemory> {
        &self.memory
    }

    /// The device `info` goes to, counting its bytes there and reserving them from its pool
    /// (when it has one); a device over its budget refuses the tensor, naming itself.
    fn place(&self, info: &TensorInfo) -> Result<(usize, Option<PoolBuffer>), BackendError> {
        let device = self.device_of_tensor(&info.name);
        let reserved = match &self.pools[device] {
            Some(pool) if info.n_bytes > 0 => {
                let buffer = pool
                    .alloc(SplitPurpose::Weights.pool_purpose(), info.n_bytes)
                    .map_err(|error| BackendError::Device {
                        tensor: info.name.clone(),
                        cause: format!("{}: {error}", self.names[device]),
                    })?;
                lock(&self.placed)[device].push((info.name.clone(), buffer.ptr(), buffer.len()));
                Some(buffer)
            }
            _ => None,
        };
        self.memory.add(device, SplitPurpose::Weights, info.n_bytes);
        Ok((device, reserved))
    }

    /// Gives `parts` room for its length on `device` (allocating its part there the first
    /// time), and counts the part's bytes.
    fn room_on(&self, parts: &mut Parts<B::Buf>, device: usize) {
        let len = parts.len;
        let backend = &self.devices[device];
        let part = match &mut parts.bufs[device] {
            Some(buf) => {
                backend.ensure_len(buf, len);
                buf
            }
            slot @ None => slot.insert(backend.alloc(len)),
        };
        let bytes = backend.buf_bytes(part) as u64;
        self.memory
            .change(device, SplitPurpose::Scratch, parts.counted[device], bytes);
        parts.counted[device] = bytes;
        self.reserve(
            device,
            &mut parts.reserved[device],
            SplitPurpose::Scratch,
            bytes,
            "alloc",
        );
    }

    /// Counts the bytes of `layer` again after a change (`op` made it).
    fn recount_kv(&self, layer: &mut SplitKvLayer<B::KvLayer>, op: &'static str) {
        let bytes = self.devices[layer.device].kv_bytes(&layer.inner) as u64;
        self.memory
            .change(layer.device, SplitPurpose::Kv, layer.counted, bytes);
        layer.counted = bytes;
        self.reserve(
            layer.device,
            &mut layer.reserved,
            SplitPurpose::Kv,
            bytes,
            op,
        );
    }

    /// The device backends, in device order.
    pub fn devices(&self) -> &[B] {
        &self.devices
    }

    /// How copies travel between each ordered pair of devices.
    pub fn pairs(&self) -> &[PairState] {
        &self.pairs
    }

    /// Copies between devices so far.
    pub fn transfer_stats(&self) -> TransferStats {
        TransferStats {
            peer_copies: self.peer_copies.load(Ordering::Relaxed),
            staged_copies: self.staged_copies.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Runs products of at least `min_tokens` tokens with other devices' weights on the
    /// weight-streaming device, if the split has one (0: never; the default is
    /// [`STREAM_MIN_TOKENS`] or `EMBER_STREAM_MIN_TOKENS`). Weights placed before this call keep
    /// what they were placed with.
    pub fn with_stream_min_tokens(mut self, min_tokens: usize) -> SplitBackend<B> {
        self.stream_to = (0..self.devices.len())
            .rev()
            .find(|&d| self.devices[d].streams_weights())
            .filter(|_| min_tokens > 0 && self.devices.iter().any(|d| !d.streams_weights()))
            .map(|d| (d, min_tokens));
        self
    }

    /// Products that ran on the weight-streaming device with a weight of another device (see
    /// [`STREAM_MIN_TOKENS`]) so far.
    pub fn streamed_products(&self) -> u64 {
        self.streamed_products.load(Ordering::Relaxed)
    }

    /// Bytes of K/V memory each device holds for `kv` (a context's cache), in device order:
    /// each device holds only its own layers' blocks.
    pub fn kv_bytes_per_device(&self, kv: &crate::kv_cache::KvCache<Self>) -> Vec<usize> {
        let mut bytes = vec![0; self.devices.len()];
        for index in 0..self.kv_devices.len() {
            let layer = kv.layer(index);
            bytes[layer.device] += self.devices[layer.device].kv_bytes(&layer.inner);
        }
        bytes
    }

    /// The device a tensor goes to, by its name.
    fn device_of_tensor(&self, name: &str) -> usize {
        name.strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|index| index.parse::<usize>().ok())
            .and_then(|il| self.layer_device.get(il).copied())
            .unwrap_or(self.output_device)
    }

    fn uses(&self, device: usize) -> &B {
        self.current.store(device, Ordering::Relaxed);
        &self.devices[device]
    }

    fn peer(&self, src: usize, dst: usize) -> bool {
        self.link.is_some()
            && self
                .pairs
                .iter()
                .any(|p| p.src == src && p.dst == dst && p.peer)
    }

    /// Moves the contents of `parts` to `device`.
    fn migrate(&self, parts: &mut Parts<B::Buf>, device: usize) {
        let home = parts.home;
        if home == device {
            return;
        }
        let len = parts.len;
        self.room_on(parts, device);
        // A pair whose peer copies are trusted first tries the devices' own peer copy (GPUs:
        // device to device, queued on the destination's stream); a device type without one
        // (simulated devices) goes through the link below.
        let mut device_peer_failed = false;
        if len > 0 && self.peer(home, device) {
            let (src, dst) = two_parts(&mut parts.bufs, home, device);
            match self.devices[device].copy_from_peer(&self.devices[home], src, dst, len) {
                Ok(true) => {
                    self.peer_copies.fetch_add(1, Ordering::Relaxed);
                    self.bytes.fetch_add(len as u64 * 4, Ordering::Relaxed);
                    parts.home = device;
                    return;
                }
                Ok(false) => {}
                Err(error) => {
                    // A peer copy that fails after passing the self-test: the source still
                    // holds the values, so they are staged and the failure logged.
                    tracing::warn!(
                        src = %self.names[home],
                        dst = %self.names[device],
                        %error,
                        "a peer copy failed; using host staging for it"
                    );
                    device_peer_failed = true;
                }
            }
        }
        if len > 0 {
            let mut host = Vec::with_capacity(len);
            self.devices[home].read(parts.on(home), len, &mut host);
            if let (true, false, Some(link)) =
                (self.peer(home, device), device_peer_failed, &self.link)
            {
                let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
                let mut arrived = Vec::with_capacity(bytes.len());
                match link.copy(home, device, &bytes, &mut arrived) {
                    Ok(()) if arrived.len() == bytes.len() => {
                        host.clear();
                        host.extend(
                            arrived
                                .chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                        );
                        self.peer_copies.fetch_add(1, Ordering::Relaxed);
                    }
                    // A peer copy that fails after passing the self-test: the host copy is
                    // still good, so it is used (staged) and the failure logged.
                    result => {
                        tracing::warn!(
                            src = %self.names[home],
                            dst = %self.names[device],
                            ?result,
                            "a peer copy failed; using host staging for it"
                        );
                        self.staged_copies.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else {
                self.staged_copies.fetch_add(1, Ordering::Relaxed);
            }
            self.bytes.fetch_add(len as u64 * 4, Ordering::Relaxed);
            self.devices[device].write(parts.on_mut(device), &host);
        }
        parts.home = device;
    }

    /// Runs `out = w x` on the weight-streaming device when `w` lives elsewhere and the batch
    /// is large enough (see [`STREAM_MIN_TOKENS`]); `false` when the product is left to `w`'s
    /// device.
    fn streamed(
        &self,
        w: &OnDevice<B::Matrix>,
        x: &SplitBuf<B::Buf>,
        n_tokens: usize,
        out: &mut SplitBuf<B::Buf>,
    ) -> bool {
        let (Some((d, min_tokens)), Some(source)) = (self.stream_to, &w.source) else {
            return false;
        };
        if n_tokens < min_tokens {
            return false;
        }
        let (gguf, info) = &**source;
        self.input(x, d);
        // When the product does not run there, the caller's `output` moves `out` to `w`'s
        // device (no copy: the product overwrites it).
        self.output(out, d);
        let ran = self.uses(d).matmul_streamed(
            gguf,
            info,
            x.parts.borrow().on(d),
            n_tokens,
            out.parts.get_mut().on_mut(d),
        );
        if ran {
            self.streamed_products.fetch_add(1, Ordering::Relaxed);
        }
        ran
    }

    /// Whether products of `n_tokens` tokens with all of `ws` run on the weight-streaming
    /// device (so one by one, through [`SplitBackend::streamed`]).
    fn streams(&self, ws: &[&OnDevice<B::Matrix>], n_tokens: usize) -> bool {
        self.stream_to
            .is_some_and(|(_, min_tokens)| n_tokens >= min_tokens)
            && ws.iter().all(|w| w.source.is_some())
    }

    /// Makes `buf`'s contents available on `device`.
    fn input(&self, buf: &SplitBuf<B::Buf>, device: usize) {
        self.migrate(&mut buf.parts.borrow_mut(), device);
    }

    /// Makes `buf` live on `device` for an op that overwrites it: no copy.
    fn output(&self, buf: &mut SplitBuf<B::Buf>, device: usize) {
        let parts = buf.parts.get_mut();
        if parts.home == device {
            return;
        }
        self.room_on(parts, device);
        parts.home = device;
    }

    /// Makes `buf` live on `device` for an op that reads and writes it.
    fn in_place(&self, buf: &mut SplitBuf<B::Buf>, device: usize) {
        self.migrate(buf.parts.get_mut(), device);
    }

    fn home(buf: &SplitBuf<B::Buf>) -> usize {
        buf.parts.borrow().home
    }
}

impl<B: Backend> Backend for SplitBackend<B> {
    type Buf = SplitBuf<B::Buf>;
    type Matrix = OnDevice<B::Matrix>;
    type Vector = OnDevice<B::Vector>;
    type RopeTable = SplitRope<B::RopeTable>;
    type KvLayer = SplitKvLayer<B::KvLayer>;

    /// The last device's: the accelerator of a partial offload (whose device 0 is the CPU), as
    /// llama.cpp names the backend of a partially offloaded model; `describe` lists every device.
    fn name(&self) -> &'static str {
        self.devices[self.devices.len() - 1].name()
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self
            .devices
            .iter()
            .zip(&self.names)
            .map(|(d, name)| format!("{name} ({})", d.describe()))
            .collect();
        format!("split over {}", names.join(", "))
    }

    fn take_failure(&self) -> Option<OpFailure> {
        // Every device's failure is taken, so none is left to blame a later pass; the first
        // is reported, a pool's refusal before the devices' own.
        let mut first = lock(&self.failure).take();
        for device in &self.devices {
            if let Some(failure) = device.take_failure() {
                first.get_or_insert(failure);
            }
        }
        first
    }

    fn begin_forward(&self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        for device in &self.devices {
            device.begin_forward(batch, plan, out_rows);
        }
    }

    fn end_forward(&self) -> bool {
        let mut again = false;
        for device in &self.devices {
            again |= device.end_forward();
        }
        self.recount_op_scratch();
        again
    }

    fn layer_done(&self, layer: usize, n_layers: usize) {
        // Only the device that ran the layer: a device records its own layers' segments, and a
        // segment boundary on a device that ran nothing would end and launch an empty recording.
        if let Some(&device) = self.layer_device.get(layer) {
            self.devices[device].layer_done(layer, n_layers);
        }
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.devices[0].install(f)
    }

    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Matrix, BackendError> {
        let (device, reserved) = self.place(info)?;
        let source = self
            .stream_to
            .filter(|_| !self.devices[device].streams_weights())
            .map(|_| Box::new((Arc::clone(gguf), info.clone())));
        Ok(OnDevice {
            device,
            inner: self.devices[device].matrix(gguf, info)?,
            source,
            _reserved: reserved,
        })
    }

    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Vector, BackendError> {
        let (device, reserved) = self.place(info)?;
        Ok(OnDevice {
            device,
            inner: self.devices[device].vector(gguf, info)?,
            source: None,
            _reserved: reserved,
        })
    }

    fn matrix_private_bytes(&self, matrix: &Self::Matrix) -> usize {
        self.devices[matrix.device].matrix_private_bytes(&matrix.inner)
    }

    fn expert_matrix(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
    ) -> Result<Self::Matrix, BackendError> {
        let (device, reserved) = self.place(info)?;
        Ok(OnDevice {
            device,
            inner: self.devices[device].expert_matrix(gguf, info)?,
            source: None,
            _reserved: reserved,
        })
    }

    fn release_op_scratch(&self) {
        for device in &self.devices {
            device.release_op_scratch();
        }
        self.recount_op_scratch();
    }

    fn op_scratch_bytes(&self) -> usize {
        self.devices.iter().map(Backend::op_scratch_bytes).sum()
    }

    fn alloc(&self, len: usize) -> Self::Buf {
        let home = self.current.load(Ordering::Relaxed);
        let n = self.devices.len();
        let mut parts = Parts {
            bufs: (0..n).map(|_| None).collect(),
            home,
            len,
            counted: vec![0; n],
            reserved: (0..n).map(|_| Reservation::default()).collect(),
            memory: Arc::clone(&self.memory),
        };
        self.room_on(&mut parts, home);
        SplitBuf {
            parts: RefCell::new(parts),
        }
    }

    fn ensure_len(&self, buf: &mut Self::Buf, len: usize) {
        let parts = buf.parts.get_mut();
        parts.len = parts.len.max(len);
        let home = parts.home;
        self.room_on(parts, home);
    }

    fn buf_bytes(&self, buf: &Self::Buf) -> usize {
        buf.parts.borrow().counted.iter().sum::<u64>() as usize
    }

    fn write(&self, buf: &mut Self::Buf, values: &[f32]) {
        let parts = buf.parts.get_mut();
        let home = parts.home;
        self.devices[home].write(parts.on_mut(home), values);
    }

    fn gather_rows(&self, src: &Self::Buf, dim: usize, rows: &[usize], out: &mut Self::Buf) {
        let d = Self::home(src);
        self.output(out, d);
        self.uses(d).gather_rows(
            src.parts.borrow().on(d),
            dim,
            rows,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn read(&self, buf: &Self::Buf, len: usize, out: &mut Vec<f32>) {
        let parts = buf.parts.borrow();
        self.devices[parts.home].read(parts.on(parts.home), len, out);
    }

    fn argmax_rows(
        &self,
        x: &Self::Buf,
        n_rows: usize,
        n_cols: usize,
        scratch: &mut Self::Buf,
        out: &mut Vec<u32>,
    ) {
        let d = Self::home(x);
        self.output(scratch, d);
        self.uses(d).argmax_rows(
            x.parts.borrow().on(d),
            n_rows,
            n_cols,
            scratch.parts.get_mut().on_mut(d),
            out,
        );
    }

    fn get_rows(&self, table: &Self::Matrix, ids: &[u32], scale: f32, out: &mut Self::Buf) {
        let d = table.device;
        self.output(out, d);
        self.uses(d)
            .get_rows(&table.inner, ids, scale, out.parts.get_mut().on_mut(d));
    }

    fn matmul(&self, w: &Self::Matrix, x: &Self::Buf, n_tokens: usize, out: &mut Self::Buf) {
        if self.streamed(w, x, n_tokens, out) {
            return;
        }
        let d = w.device;
        self.input(x, d);
        self.output(out, d);
        self.uses(d).matmul(
            &w.inner,
            x.parts.borrow().on(d),
            n_tokens,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn matmul_shared(
        &self,
        ws: &[&Self::Matrix],
        x: &Self::Buf,
        n_tokens: usize,
        outs: &mut [&mut Self::Buf],
    ) {
        let Some(d) = ws.first().map(|w| w.device) else {
            return;
        };
        if ws.iter().any(|w| w.device != d) || self.streams(ws, n_tokens) {
            // Matrices sharing an input belong to one layer, so to one device; were they not,
            // each product runs where its matrix is.
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, n_tokens, out);
            }
            return;
        }
        self.input(x, d);
        for out in outs.iter_mut() {
            self.output(out, d);
        }
        let inner_ws: Vec<&B::Matrix> = ws.iter().map(|w| &w.inner).collect();
        let mut inner_outs: Vec<&mut B::Buf> = outs
            .iter_mut()
            .map(|o| o.parts.get_mut().on_mut(d))
            .collect();
        self.uses(d)
            .matmul_shared(&inner_ws, x.parts.borrow().on(d), n_tokens, &mut inner_outs);
    }

    fn ffn_gate_up(
        &self,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        n_ff: usize,
        activation: FfnActivation,
        gate: &mut Self::Buf,
        up: &mut Self::Buf,
    ) {
        let d = w_gate.device;
        if w_up.device != d || self.streams(&[w_gate, w_up], n_tokens) {
            self.matmul_shared(&[w_gate, w_up], x, n_tokens, &mut [&mut *gate, &mut *up]);
            match activation {
                FfnActivation::SwiGlu => self.swiglu(gate, up, n_tokens * n_ff),
                FfnActivation::GeGlu => self.geglu(gate, up, n_tokens * n_ff),
            }
            return;
        }
        self.input(x, d);
        self.output(gate, d);
        self.output(up, d);
        self.uses(d).ffn_gate_up(
            &w_gate.inner,
            &w_up.inner,
            x.parts.borrow().on(d),
            n_tokens,
            n_ff,
            activation,
            gate.parts.get_mut().on_mut(d),
            up.parts.get_mut().on_mut(d),
        );
    }

    fn moe_router(
        &self,
        router: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        let d = router.device;
        self.input(x, d);
        self.output(out, d);
        self.uses(d).moe_router(
            &router.inner,
            x.parts.borrow().on(d),
            n_tokens,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn moe_ffn(
        &self,
        moe: &MoeFfn<'_, Self::Matrix>,
        router_logits: &Self::Buf,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        let d = moe.gate.device;
        self.input(router_logits, d);
        self.input(x, d);
        self.output(out, d);
        let inner = MoeFfn {
            gate: &moe.gate.inner,
            up: &moe.up.inner,
            down: &moe.down.inner,
            n_ff: moe.n_ff,
            activation: moe.activation,
            routing: moe.routing,
            expert_scale: moe.expert_scale,
            shared: moe.shared.as_ref().map(|s| SharedExpert {
                gate: &s.gate.inner,
                up: &s.up.inner,
                down: &s.down.inner,
                n_ff: s.n_ff,
                gate_inp: s.gate_inp.map(|g| &g.inner),
            }),
        };
        self.uses(d).moe_ffn(
            &inner,
            router_logits.parts.borrow().on(d),
            x.parts.borrow().on(d),
            n_tokens,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn linear_attention_supported(&self) -> bool {
        // The per-sequence state buffer holds every linear-attention layer's state; spread
        // over devices it would cross devices at every such layer. Not built.
        self.devices.len() == 1 && self.devices[0].linear_attention_supported()
    }

    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        let d = weight.device;
        self.input(x, d);
        self.output(out, d);
        self.uses(d).rms_norm(
            x.parts.borrow().on(d),
            &weight.inner,
            n_rows,
            dim,
            eps,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) {
        let d = weight.device;
        self.in_place(x, d);
        self.uses(d)
            .rms_norm_inplace(x.parts.get_mut().on_mut(d), &weight.inner, n_rows, dim, eps);
    }

    fn max_head_dim(&self) -> Option<usize> {
        self.devices.iter().filter_map(Backend::max_head_dim).min()
    }

    fn has_gemma4_ops(&self) -> bool {
        self.devices.iter().all(Backend::has_gemma4_ops)
    }

    fn rms_norm_unit_inplace(&self, x: &mut Self::Buf, n_rows: usize, dim: usize, eps: f32) {
        let d = Self::home(x);
        self.uses(d)
            .rms_norm_unit_inplace(x.parts.get_mut().on_mut(d), n_rows, dim, eps);
    }

    fn mul_rows_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
    ) {
        let d = weight.device;
        self.in_place(x, d);
        self.uses(d)
            .mul_rows_inplace(x.parts.get_mut().on_mut(d), &weight.inner, n_rows, dim);
    }

    fn add_inplace(&self, dst: &mut Self::Buf, src: &Self::Buf, len: usize) {
        let d = Self::home(dst);
        self.input(src, d);
        self.uses(d)
            .add_inplace(dst.parts.get_mut().on_mut(d), src.parts.borrow().on(d), len);
    }

    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        proj: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        let d = weight.device;
        self.in_place(x, d);
        self.input(proj, d);
        self.output(out, d);
        self.uses(d).add_rms_norm(
            x.parts.get_mut().on_mut(d),
            proj.parts.borrow().on(d),
            &weight.inner,
            n_rows,
            dim,
            eps,
            out.parts.get_mut().on_mut(d),
        );
    }

    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Vector, n_rows: usize, dim: usize) {
        let d = bias.device;
        self.in_place(x, d);
        self.uses(d)
            .add_bias(x.parts.get_mut().on_mut(d), &bias.inner, n_rows, dim);
    }

    fn scale(&self, x: &mut Self::Buf, len: usize, scale: f32) {
        let d = Self::home(x);
        self.uses(d).scale(x.parts.get_mut().on_mut(d), len, scale);
    }

    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) {
        let d = Self::home(gate);
        self.input(up, d);
        self.uses(d)
            .swiglu(gate.parts.get_mut().on_mut(d), up.parts.borrow().on(d), len);
    }

    fn geglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize) {
        let d = Self::home(gate);
        self.input(up, d);
        self.uses(d)
            .geglu(gate.parts.get_mut().on_mut(d), up.parts.borrow().on(d), len);
    }

    fn softcap(&self, x: &mut Self::Buf, len: usize, cap: f32) {
        let d = Self::home(x);
        self.uses(d).softcap(x.parts.get_mut().on_mut(d), len, cap);
    }

    fn rope_table_new(&self) -> Self::RopeTable {
        SplitRope {
            tables: self.devices.iter().map(Backend::rope_table_new).collect(),
        }
    }

    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut Self::RopeTable) {
        for (device, t) in self.devices.iter().zip(&mut table.tables) {
            device.rope_table(positions, params, t);
        }
    }

    fn rope(
        &self,
        x: &mut Self::Buf,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    ) {
        let d = Self::home(x);
        self.uses(d).rope(
            x.parts.get_mut().on_mut(d),
            &table.tables[d],
            n_tokens,
            n_heads,
            head_dim,
            mode,
        );
    }

    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self::KvLayer {
        // The KV cache creates its layers in layer order, all of them each time.
        let index = self.kv_created.fetch_add(1, Ordering::Relaxed);
        let device = if self.kv_devices.is_empty() {
            self.output_device
        } else {
            self.kv_devices[index % self.kv_devices.len()]
        };
        let mut layer = SplitKvLayer {
            device,
            inner: self.devices[device].kv_layer(max_blocks, block_size, n_kv_heads, head_dim),
            counted: 0,
            reserved: Reservation::default(),
            memory: Arc::clone(&self.memory),
        };
        self.recount_kv(&mut layer, "kv_layer");
        layer
    }

    fn kv_materialize(&self, layer: &mut Self::KvLayer, blocks: &[u32]) {
        self.devices[layer.device].kv_materialize(&mut layer.inner, blocks);
        self.recount_kv(layer, "kv_materialize");
    }

    fn kv_release(&self, layer: &mut Self::KvLayer, blocks: &[u32]) {
        self.devices[layer.device].kv_release(&mut layer.inner, blocks);
        self.recount_kv(layer, "kv_release");
    }

    fn kv_bytes(&self, layer: &Self::KvLayer) -> usize {
        self.devices[layer.device].kv_bytes(&layer.inner)
    }

    fn kv_store(
        &self,
        layer: &mut Self::KvLayer,
        k: &Self::Buf,
        v: &Self::Buf,
        plan: &AttentionPlan,
    ) {
        let d = layer.device;
        self.input(k, d);
        self.input(v, d);
        self.uses(d).kv_store(
            &mut layer.inner,
            k.parts.borrow().on(d),
            v.parts.borrow().on(d),
            plan,
        );
    }

    fn rope_kv_store(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        norm: QkNorm<'_, Self::Vector>,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        mode: RopeMode,
        layer: &mut Self::KvLayer,
        plan: &AttentionPlan,
    ) {
        let d = layer.device;
        // A layer's norm weights live on its device; any that would not run as separate norms
        // first, where their weight is.
        let apart = |w: Option<&Self::Vector>| w.is_some_and(|w| w.device != d);
        let norm = if apart(norm.q) || apart(norm.k) {
            norm.apply(self, q, k, n_tokens, n_heads, n_kv_heads, head_dim);
            QkNorm::none()
        } else {
            norm
        };
        self.in_place(q, d);
        self.in_place(k, d);
        self.input(v, d);
        self.uses(d).rope_kv_store(
            q.parts.get_mut().on_mut(d),
            k.parts.get_mut().on_mut(d),
            v.parts.borrow().on(d),
            norm.map(|w| &w.inner),
            &table.tables[d],
            n_tokens,
            n_heads,
            n_kv_heads,
            head_dim,
            mode,
            &mut layer.inner,
            plan,
        );
    }

    fn attention(
        &self,
        q: &Self::Buf,
        layer: &Self::KvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut Self::Buf,
    ) {
        let d = layer.device;
        self.input(q, d);
        self.output(out, d);
        self.uses(d).attention(
            q.parts.borrow().on(d),
            &layer.inner,
            plan,
            n_heads,
            n_kv_heads,
            head_dim,
            kq_scale,
            window,
            out.parts.get_mut().on_mut(d),
        );
    }
}

/// The buffers of devices `a` (to read) and `b` (to write), `a != b`, both allocated.
fn two_parts<Buf>(bufs: &mut [Option<Buf>], a: usize, b: usize) -> (&Buf, &mut Buf) {
    const MISSING: &str = "a buffer is allocated on a device before an op runs there";
    if a < b {
        let (low, high) = bufs.split_at_mut(b);
        (
            low[a].as_ref().expect(MISSING),
            high[0].as_mut().expect(MISSING),
        )
    } else {
        let (low, high) = bufs.split_at_mut(a);
        (
            high[0].as_ref().expect(MISSING),
            low[b].as_mut().expect(MISSING),
        )
    }
}

/// Locks `mutex`; a panicked holder's data is still consistent counts.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
