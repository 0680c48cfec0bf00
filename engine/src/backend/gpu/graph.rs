//! Decode steps as device graphs: the ops of a small forward pass are recorded by stream capture
//! and run with one graph launch instead of one kernel launch each.
//!
//! Why: a decode step of an 8B model queues about 17 kernels per layer, and each launch costs a
//! few microseconds of CPU (far more under a sandbox that intercepts driver calls), while the
//! weights stream through the GPU in well under a millisecond; without graphs decode is bound by
//! launches. Recording costs much less than launching (the runtime only appends nodes), updating
//! the cached executable graph with the new recording is one call, and the launch is one call.
//!
//! How (the step is re-recorded every time, as llama.cpp does, so per-step scalars such as the
//! attention length and reallocated buffers are simply part of the new recording):
//! 1. [`Graphs::begin`] (from `begin_forward`, after the per-batch arrays were uploaded): for a
//!    batch of at most [`GRAPH_MAX_TOKENS`] tokens (one decode step of up to 64 sequences),
//!    start capturing the context's stream.
//! 2. The layer loop queues its ops; they are recorded, not run.
//! 3. [`Graphs::finish`] (from `read` before the logits are downloaded, or from `end_forward`):
//!    end the capture, update the executable graph cached for this batch shape (or instantiate
//!    one when the runtime refuses the update), launch it. Executable graphs are cached per
//!    shape, at most [`MAX_CACHED_GRAPHS`] of them; the least recently used goes first when a
//!    new shape needs room (a server whose batch size wanders over 1..64 keeps its common
//!    shapes without holding a graph for every size it ever saw).
//!
//! Fallbacks: if the capture cannot start, the pass runs with plain launches and graphs are
//! turned off for this backend (logged once). If it was aborted midway (an op had to wait for the
//! device, which a capture cannot record) or the graph cannot be run, nothing recorded ran, and
//! [`Graphs::take_redo`] asks the model code to run the layers again with plain launches; the
//! pass is idempotent (same KV slots, same inputs). Repeated aborts turn graphs off too.
//! `EMBER_GPU_GRAPHS=0` turns them off from the start, for comparisons.
//!
//! Segments: a pass of a model without recurrent state may be recorded as several graphs, split
//! at layer boundaries ([`Graphs::layer_done`], every [`SEGMENT_ENV`] layers, default
//! [`DEFAULT_SEGMENT_LAYERS`]). Each part is launched as soon as it is recorded, so the device
//! runs the first layers while the host records the next ones: the recording (about 2 us per
//! kernel, 1-2 ms for a step of a deep model) overlaps the device's work instead of adding to
//! it. A part that cannot be run asks for the whole pass to run again with plain launches, as a
//! single graph would; that is safe because such passes are idempotent, which is why passes with
//! recurrent state (whose layers update it in place) are recorded whole.
//!
//! Cached executable graphs are dropped when the pool trimmed (memory they referenced may have
//! been unmapped) and when the backend is dropped.

use std::time::{Duration, Instant};

use ember_gpu::driver::{GraphExecHandle, GraphHandle};
use ember_gpu::ops::{GpuContext, OpsError};

/// Environment variable: `0` turns decode graphs off.
pub const GRAPHS_ENV: &str = "EMBER_GPU_GRAPHS";

/// Batches of at most this many tokens are recorded as graphs: decode steps of up to 64
/// sequences at once (whose matrix products read the weights once, so the step is still short
/// and its launches would cost as much as its work), small speculative or parallel batches.
/// Larger ones are prompt chunks, compute-bound, and launch directly.
pub const GRAPH_MAX_TOKENS: usize = 64;

/// Batch shapes whose executable graphs are kept at once (one graph per segment of each),
/// least recently used dropped first.
pub const MAX_CACHED_GRAPHS: usize = 32;

/// Environment variable: layers per recorded segment of a pass (`0`: the whole pass as one
/// graph).
pub const SEGMENT_ENV: &str = "EMBER_GPU_GRAPH_SEGMENT";

/// Layers per segment unless [`SEGMENT_ENV`] says otherwise. The first segment is one layer, so
/// the device starts after recording one layer's kernels.
pub const DEFAULT_SEGMENT_LAYERS: usize = 4;

/// Segments per pass at most; the layers after the last split stay in the last segment.
const MAX_SEGMENTS: u32 = 32;

/// Aborted captures in a row after which graphs are turned off (something in every step waits
/// for the device, so recording is wasted work).
const MAX_ABORTS_IN_A_ROW: u32 = 3;

/// What one backend did with graphs so far (for tests and logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Passes recorded (each as one or more graphs).
    pub steps: u64,
    /// Captures that produced a graph.
    pub captured: u64,
    /// Executable graphs updated in place from a new capture.
    pub updated: u64,
    /// Executable graphs instantiated (first use of a shape, or an update the runtime refused).
    pub instantiated: u64,
    /// Graph launches.
    pub launched: u64,
    /// Captures that could not be run (the pass ran again with plain launches).
    pub redone: u64,
    /// Cached executable graphs dropped to make room for another shape.
    pub evicted: u64,
    /// CPU time from the start of each capture to its end: queueing the pass's ops.
    pub record_time: Duration,
    /// CPU time spent updating or instantiating executable graphs.
    pub update_time: Duration,
    /// CPU time spent in graph launches.
    pub launch_time: Duration,
}

impl GraphStats {
    /// A one-line summary with the mean CPU cost per step of each phase.
    pub fn summary(&self) -> String {
        let per_step = |total: Duration| {
            let steps = self.steps.max(1) as u32;
            format!("{:.1} us", (total / steps).as_secs_f64() * 1e6)
        };
        format!(
            "{} graph steps ({} graphs launched, {} updated in place, {} instantiated, {} redone); per step: record {}, update {}, launch {}; {} cached graphs evicted",
            self.steps,
            self.launched,
            self.updated,
            self.instantiated,
            self.redone,
            per_step(self.record_time),
            per_step(self.update_time),
            per_step(self.launch_time),
            self.evicted,
        )
    }
}

/// The shape an executable graph was recorded for. The update in [`Graphs::finish`] handles
/// everything else (addresses, scalars), so the shape only picks the cached graph most likely to
/// accept the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    n_tokens: usize,
    n_out: usize,
    /// Which part of the pass (0 for the first or only one).
    segment: u32,
}

/// A backend's graph state. See the module docs.
pub(super) struct Graphs {
    enabled: bool,
    /// Layers per segment (0: one graph per pass).
    segment_layers: usize,
    /// Why graphs were turned off, once known (logged once).
    disabled_reason: Option<String>,
    /// The shape of the pass being captured and when the capture began, while one is.
    capturing: Option<(GraphKey, Instant)>,
    /// The last capture could not be run: the model code must run the pass again.
    redo: bool,
    aborts_in_a_row: u32,
    execs: LruCache<GraphKey, GraphExecHandle>,
    /// The pool's trim generation the cached graphs were made under.
    trim_generation: u64,
    stats: GraphStats,
}

impl Graphs {
    /// Graph state, on unless `EMBER_GPU_GRAPHS=0`.
    pub(super) fn from_env() -> Graphs {
        let off = std::env::var(GRAPHS_ENV).is_ok_and(|v| v.trim() == "0");
        let mut graphs = Graphs::new(!off);
        if let Ok(value) = std::env::var(SEGMENT_ENV) {
            match value.trim().parse::<usize>() {
                Ok(layers) => graphs.segment_layers = layers,
                Err(_) => tracing::warn!(
                    %value,
                    "{SEGMENT_ENV} is not a layer count; using {DEFAULT_SEGMENT_LAYERS}"
                ),
            }
        }
        graphs
    }

    pub(super) fn new(enabled: bool) -> Graphs {
        Graphs {
            enabled,
            segment_layers: DEFAULT_SEGMENT_LAYERS,
            disabled_reason: (!enabled).then(|| format!("{GRAPHS_ENV}=0")),
            capturing: None,
            redo: false,
            aborts_in_a_row: 0,
            execs: LruCache::new(MAX_CACHED_GRAPHS * MAX_SEGMENTS as usize),
            trim_generation: 0,
            stats: GraphStats::default(),
        }
    }

    pub(super) fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Layers per recorded segment (0: one graph per pass).
    pub(super) fn segment_layers(&self) -> usize {
        self.segment_layers
    }

    /// Sets the layers per recorded segment (0: one graph per pass).
    pub(super) fn set_segment_layers(&mut self, layers: usize) {
        self.segment_layers = layers;
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Starts capturing a pass of `n_tokens` tokens with `n_out` output rows if it is small
    /// enough and graphs are on.
    pub(super) fn begin(&mut self, ctx: &GpuContext, n_tokens: usize, n_out: usize) {
        self.redo = false;
        if !self.enabled || n_tokens == 0 || n_tokens > GRAPH_MAX_TOKENS {
            return;
        }
        let generation = ctx.pool().trim_generation();
        if generation != self.trim_generation {
            self.drop_execs(ctx);
            self.trim_generation = generation;
        }
        let key = GraphKey {
            n_tokens,
            n_out,
            segment: 0,
        };
        if self.begin_segment(ctx, key) {
            self.stats.steps += 1;
        }
    }

    fn begin_segment(&mut self, ctx: &GpuContext, key: GraphKey) -> bool {
        match ctx.begin_capture() {
            Ok(()) => {
                self.capturing = Some((key, Instant::now()));
                true
            }
            Err(error) => {
                self.disable(ctx, &format!("the capture could not start: {error}"));
                false
            }
        }
    }

    /// Layer `layer` (of `n_layers`) of an idempotent pass was queued: at a segment boundary,
    /// runs what was recorded so far and starts recording the next segment. The last layer is
    /// never a boundary (what follows it, the output head, belongs to the last segment).
    /// `op_failed` as for [`Graphs::finish`].
    pub(super) fn layer_done(
        &mut self,
        ctx: &GpuContext,
        layer: usize,
        n_layers: usize,
        op_failed: bool,
    ) {
        let Some((key, _)) = self.capturing else {
            return;
        };
        let every = self.segment_layers;
        let boundary =
            every > 0 && layer + 1 < n_layers && (layer == 0 || (layer + 1).is_multiple_of(every));
        if !boundary || key.segment + 1 >= MAX_SEGMENTS || op_failed {
            return;
        }
        self.finish(ctx, false);
        // After a part that could not run, the rest of the pass runs with plain launches and the
        // whole pass runs again (see `finish`).
        if self.enabled && !self.redo {
            let next = GraphKey {
                segment: key.segment + 1,
                ..key
            };
            self.begin_segment(ctx, next);
        }
    }

    /// Whether a pass is being captured.
    pub(super) fn is_capturing(&self) -> bool {
        self.capturing.is_some()
    }

    /// Ends the capture in progress (if any) and runs it. `op_failed`: an op of the pass failed,
    /// so the pass fails anyway and the recording is dropped. Afterwards [`Graphs::take_redo`]
    /// says whether the pass must run again with plain launches.
    pub(super) fn finish(&mut self, ctx: &GpuContext, op_failed: bool) {
        let Some((key, begun)) = self.capturing.take() else {
            return;
        };
        let graph = match ctx.end_capture() {
            Ok(graph) => {
                self.stats.record_time += begun.elapsed();
                graph
            }
            Err(error) => {
                // Aborted by a call that had to wait for the device, or invalidated by the runtime
                // (another thread synchronising the device): nothing recorded ran.
                self.aborts_in_a_row += 1;
                tracing::debug!(%error, "graph capture failed; the step runs with plain launches");
                if self.aborts_in_a_row >= MAX_ABORTS_IN_A_ROW {
                    self.disable(
                        ctx,
                        &format!("{MAX_ABORTS_IN_A_ROW} captures in a row failed, the last with: {error}"),
                    );
                }
                self.request_redo(op_failed);
                return;
            }
        };
        self.stats.captured += 1;
        if op_failed {
            self.destroy_graph(ctx, graph);
            return;
        }
        let result = self.run(ctx, key, graph);
        self.destroy_graph(ctx, graph);
        match result {
            Ok(()) => self.aborts_in_a_row = 0,
            Err(error) => {
                self.disable(ctx, &format!("running the recorded graph failed: {error}"));
                self.request_redo(false);
            }
        }
    }

    /// Ends a capture left open (a pass that never reached its end) without running it.
    pub(super) fn discard(&mut self, ctx: &GpuContext) {
        if self.capturing.take().is_none() {
            return;
        }
        match ctx.end_capture() {
            Ok(graph) => self.destroy_graph(ctx, graph),
            Err(error) => tracing::debug!(%error, "discarding an unfinished capture"),
        }
    }

    /// Whether the last pass must run again (without clearing the request).
    pub(super) fn redo_pending(&self) -> bool {
        self.redo
    }

    /// Whether the last pass must run again with plain launches (clears the request).
    pub(super) fn take_redo(&mut self) -> bool {
        std::mem::take(&mut self.redo)
    }

    /// Destroys every cached executable graph (the backend is going away, or memory they refer
    /// to may be gone).
    pub(super) fn drop_execs(&mut self, ctx: &GpuContext) {
        for exec in self.execs.drain() {
            if let Err(error) = ctx.destroy_graph_exec(exec) {
                tracing::debug!(%error, "destroying a cached graph failed");
            }
        }
    }

    fn request_redo(&mut self, op_failed: bool) {
        self.stats.redone += u64::from(!op_failed);
        // A pass whose op failed fails as a whole; running it again would not help.
        self.redo = !op_failed;
    }

    /// Updates (or instantiates) the executable graph for `key` to `graph` and launches it.
    fn run(&mut self, ctx: &GpuContext, key: GraphKey, graph: GraphHandle) -> Result<(), OpsError> {
        let started = Instant::now();
        let exec = match self.execs.get(&key) {
            Some(exec) => match ctx.update_graph(exec, graph) {
                Ok(true) => {
                    self.stats.updated += 1;
                    exec
                }
                refused => {
                    if let Err(error) = refused {
                        tracing::debug!(%error, "graph update failed; instantiating anew");
                    }
                    self.execs.remove(&key);
                    if let Err(error) = ctx.destroy_graph_exec(exec) {
                        tracing::debug!(%error, "destroying a refused graph failed");
                    }
                    self.instantiate(ctx, key, graph)?
                }
            },
            None => self.instantiate(ctx, key, graph)?,
        };
        let launching = Instant::now();
        self.stats.update_time += launching - started;
        ctx.launch_graph(exec)?;
        self.stats.launch_time += launching.elapsed();
        self.stats.launched += 1;
        if self.stats.launched == 1 {
            tracing::info!(
                device = ctx.device(),
                n_tokens = key.n_tokens,
                "decode steps run as device graphs"
            );
        }
        Ok(())
    }

    fn instantiate(
        &mut self,
        ctx: &GpuContext,
        key: GraphKey,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, OpsError> {
        let exec = ctx.instantiate_graph(graph)?;
        self.stats.instantiated += 1;
        if let Some(evicted) = self.execs.insert(key, exec) {
            self.stats.evicted += 1;
            if let Err(error) = ctx.destroy_graph_exec(evicted) {
                tracing::debug!(%error, "destroying an evicted graph failed");
            }
        }
        Ok(exec)
    }

    fn destroy_graph(&self, ctx: &GpuContext, graph: GraphHandle) {
        if let Err(error) = ctx.destroy_graph(graph) {
            tracing::debug!(%error, "destroying a recorded graph failed");
        }
    }

    /// Turns graphs off for this backend, logging why once.
    fn disable(&mut self, ctx: &GpuContext, reason: &str) {
        if self.disabled_reason.is_none() {
            tracing::warn!(device = ctx.device(), %reason, "decode graphs are off; decode uses plain kernel launches");
            self.disabled_reason = Some(reason.to_string());
        }
        self.enabled = false;
        self.drop_execs(ctx);
    }
}

/// A small cache that keeps at most `capacity` entries and drops the least recently used one to
/// make room. Lookups are linear: the cache holds a few dozen entries and is used once per step.
#[derive(Debug)]
struct LruCache<K, V> {
    capacity: usize,
    /// Least recently used first.
    entries: Vec<(K, V)>,
}

impl<K: PartialEq + Copy, V: Copy> LruCache<K, V> {
    fn new(capacity: usize) -> LruCache<K, V> {
        LruCache {
            capacity: capacity.max(1),
            entries: Vec::new(),
        }
    }

    /// The value of `key`, now the most recently used.
    fn get(&mut self, key: &K) -> Option<V> {
        let index = self.entries.iter().position(|(k, _)| k == key)?;
        let entry = self.entries.remove(index);
        let value = entry.1;
        self.entries.push(entry);
        Some(value)
    }

    /// Adds (or replaces) `key` as the most recently used entry; returns the value it replaced
    /// or the least recently used value evicted to make room.
    fn insert(&mut self, key: K, value: V) -> Option<V> {
        if let Some(old) = self.remove(&key) {
            self.entries.push((key, value));
            return Some(old);
        }
        let evicted = if self.entries.len() >= self.capacity {
            Some(self.entries.remove(0).1)
        } else {
            None
        };
        self.entries.push((key, value));
        evicted
    }

    fn remove(&mut self, key: &K) -> Option<V> {
        let index = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(index).1)
    }

    /// Removes every entry, least recently used first.
    fn drain(&mut self) -> impl Iterator<Item = V> + '_ {
        self.entries.drain(..).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod lru_tests {
    use super::LruCache;

    #[test]
    fn the_least_recently_used_entry_makes_room() {
        let mut cache = LruCache::new(3);
        assert_eq!(cache.insert(1, 10), None);
        assert_eq!(cache.insert(2, 20), None);
        assert_eq!(cache.insert(3, 30), None);
        // Using 1 makes 2 the least recently used.
        assert_eq!(cache.get(&1), Some(10));
        assert_eq!(cache.insert(4, 40), Some(20));
        assert_eq!(cache.get(&2), None);
        assert_eq!(cache.insert(5, 50), Some(30));
        assert_eq!(cache.drain().collect::<Vec<_>>(), [10, 40, 50]);
        assert_eq!(cache.get(&1), None);
    }

    #[test]
    fn replacing_and_removing_keep_the_bound() {
        let mut cache = LruCache::new(2);
        cache.insert(1, 10);
        cache.insert(2, 20);
        // A key already present is replaced in place, nothing else is evicted.
        assert_eq!(cache.insert(1, 11), Some(10));
        assert_eq!(cache.remove(&2), Some(20));
        assert_eq!(cache.insert(3, 30), None);
        assert_eq!(cache.insert(4, 40), Some(11));
        assert_eq!(cache.drain().collect::<Vec<_>>(), [30, 40]);
    }
}
