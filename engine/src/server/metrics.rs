//! `/metrics`: Prometheus text (format 0.0.4) through the `prometheus-client` crate.
//!
//! `prometheus-client` (the Prometheus project's own Rust client) was chosen over `metrics` +
//! `metrics-exporter-prometheus` because its registries are plain values: every server owns
//! one, so several servers in one process (tests, embedders) never share a global recorder. It
//! also writes metric names as given, so vLLM's colon names survive.
//!
//! Two kinds of series:
//! - counted by the server as requests end: HTTP requests by route and status, and the latency
//!   histograms (time to first token, time per output token, end-to-end, queueing), from each
//!   request's [`Timings`];
//! - read at scrape time from the engine's snapshot and a sample of the device pool
//!   ([`EngineCollector`]): token and request totals, running and waiting requests, KV blocks,
//!   device memory by purpose, and the series the Kubernetes Gateway API Inference Extension
//!   scrapes under vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
//!   `vllm:gpu_cache_usage_perc`). Nothing here waits on the engine thread or on the device:
//!   the pool is sampled by a thread of its own (a hung device can stall a pool call, and a
//!   scrape must still answer then).

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use ember_gpu::pool::{PoolUsage, Purpose};
use ember_gpu::DevicePool;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::engine::{Engine, FinishReason, Timings, Usage};

/// The Content-Type of the text format written.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How often the device pool is sampled.
const POOL_SAMPLE_INTERVAL: Duration = Duration::from_millis(250);

/// The device pool's figures as last sampled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSample {
    /// The device label (`cuda:0`, `hip:1`).
    pub device: String,
    /// Live bytes by purpose, held and peak.
    pub usage: PoolUsage,
    /// Bytes held right after load (the floor idle trim returns to).
    pub held_at_load: Option<u64>,
    /// The pool's configured floor.
    pub floor_bytes: u64,
    /// Trims that gave memory back.
    pub trims: u64,
}

impl PoolSample {
    /// `pool`'s figures now, under the device name its driver gives (`sim:1`).
    pub fn now(pool: &DevicePool) -> PoolSample {
        let report = pool.report();
        PoolSample {
            device: report.device_name,
            usage: pool.usage(),
            held_at_load: report.at_load.map(|s| s.held),
            floor_bytes: report.floor_bytes,
            trims: pool.trim_generation(),
        }
    }
}

/// What the router and the collector share: the engine once loaded, and the pool sample.
#[derive(Default)]
pub struct ServedEngine {
    pub engine: OnceLock<Engine>,
    pub pool_sample: Mutex<Option<PoolSample>>,
}

impl std::fmt::Debug for ServedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedEngine")
            .field("loaded", &self.engine.get().is_some())
            .finish()
    }
}

impl ServedEngine {
    fn pool_sample(&self) -> Option<PoolSample> {
        self.pool_sample
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Samples `pool` into `served` until the server is gone.
pub fn spawn_pool_sampler(
    pool: Arc<DevicePool>,
    device: String,
    served: Weak<ServedEngine>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("ember-pool-sampler".into())
        .spawn(move || {
            // The at-load figure comes from the pool's report, which also asks the driver for
            // free memory; it is read once, here, off the HTTP threads.
            let report = pool.report();
            let held_at_load = report.at_load.map(|s| s.held);
            let floor_bytes = report.floor_bytes;
            loop {
                let sample = PoolSample {
                    device: device.clone(),
                    usage: pool.usage(),
                    held_at_load,
                    floor_bytes,
                    trims: pool.trim_generation(),
                };
                let Some(served) = served.upgrade() else {
                    return;
                };
                *served.pool_sample.lock().unwrap_or_else(|e| e.into_inner()) = Some(sample);
                drop(served);
                std::thread::sleep(POOL_SAMPLE_INTERVAL);
            }
        })
        .map(|_| ())
}

/// The label of a request counter.
type HttpLabels = [(&'static str, String); 2];

/// The server's metrics registry and the series it counts itself.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    http_requests: Family<HttpLabels, Counter>,
    time_to_first_token: Histogram,
    time_per_output_token: Histogram,
    request_latency: Histogram,
    queue_time: Histogram,
    completions: Family<[(&'static str, &'static str); 1], Counter>,
}

fn histogram(buckets: &[f64]) -> Histogram {
    Histogram::new(buckets.iter().copied())
}

impl Metrics {
    pub fn new(served: Arc<ServedEngine>) -> Metrics {
        let mut registry = Registry::default();
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register(
            "ember_http_requests",
            "HTTP requests answered, by route and status code",
            http_requests.clone(),
        );
        let completions = Family::<[(&'static str, &'static str); 1], Counter>::default();
        registry.register(
            "ember_request_finish",
            "Generation requests that ended, by OpenAI finish_reason (cancelled ones as cancelled)",
            completions.clone(),
        );
        let time_to_first_token = histogram(&[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
        ]);
        registry.register(
            "ember_time_to_first_token_seconds",
            "Time from submission to the first generated token",
            time_to_first_token.clone(),
        );
        let time_per_output_token = histogram(&[
            0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
        ]);
        registry.register(
            "ember_time_per_output_token_seconds",
            "Time per generated token after the first",
            time_per_output_token.clone(),
        );
        let request_latency = histogram(&[
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
        ]);
        registry.register(
            "ember_e2e_request_latency_seconds",
            "Time from submission to the end of a request",
            request_latency.clone(),
        );
        let queue_time = histogram(&[
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ]);
        registry.register(
            "ember_request_queue_time_seconds",
            "Time from submission to the first engine step that worked on a request",
            queue_time.clone(),
        );
        registry.register_collector(Box::new(EngineCollector { served }));
        Metrics {
            registry,
            http_requests,
            time_to_first_token,
            time_per_output_token,
            request_latency,
            queue_time,
            completions,
        }
    }

    /// Counts an answered HTTP request.
    pub fn count_http(&self, route: &str, status: u16) {
        self.http_requests
            .get_or_create(&[("route", route.to_string()), ("status", status.to_string())])
            .inc();
    }

    /// Records a request that ended with `Done`.
    pub fn observe_done(&self, finish_reason: FinishReason, usage: &Usage, timings: &Timings) {
        let reason = match finish_reason {
            FinishReason::Cancelled => "cancelled",
            other => other.openai(),
        };
        self.completions.get_or_create(&[("reason", reason)]).inc();
        if finish_reason == FinishReason::Cancelled {
            // A cancelled request's times say when the client left, not how fast ember was.
            return;
        }
        self.request_latency.observe(timings.total.as_secs_f64());
        self.queue_time.observe(timings.queued.as_secs_f64());
        if usage.completion_tokens > 0 {
            self.time_to_first_token
                .observe(timings.time_to_first_token.as_secs_f64());
        }
        if usage.completion_tokens > 1 {
            let decoding = timings.total.saturating_sub(timings.time_to_first_token);
            self.time_per_output_token
                .observe(decoding.as_secs_f64() / (usage.completion_tokens - 1) as f64);
        }
    }

    /// The text of a scrape.
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail; an encoder error would be a bug in a collector, and
        // the scrape then returns what was written so far.
        if let Err(error) =
            prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
        {
            tracing::error!("encoding metrics failed: {error}");
        }
        text
    }
}

/// The series read from the engine's snapshot and the pool sample at scrape time.
#[derive(Debug)]
struct EngineCollector {
    served: Arc<ServedEngine>,
}

/// Writes one unlabelled series.
fn single(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let metric_encoder = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(metric_encoder)
}

/// Writes one series with several label sets.
fn labelled<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    series: &[(Vec<(&str, String)>, M)],
) -> Result<(), std::fmt::Error> {
    let mut metric_encoder = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, metric) in series {
        metric.encode(metric_encoder.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let engine = self.served.engine.get();
        let snapshot = engine.map(|e| e.snapshot());
        single(
            &mut encoder,
            "ember_model_loaded",
            "1 once the model is loaded and the engine runs, 0 while loading.",
            &ConstGauge::new(i64::from(engine.is_some())),
        )?;
        let (running, waiting, kv, totals) = match &snapshot {
            Some(s) => (s.running.len(), s.waiting, s.kv, s.totals),
            None => (0, 0, Default::default(), Default::default()),
        };
        let draining = engine.is_some_and(|e| e.is_draining());
        single(
            &mut encoder,
            "ember_draining",
            "1 while the server drains before shutdown.",
            &ConstGauge::new(i64::from(draining)),
        )?;
        single(
            &mut encoder,
            "ember_requests_running",
            "Requests running (holding KV blocks and stepping).",
            &ConstGauge::new(running as i64),
        )?;
        single(
            &mut encoder,
            "ember_requests_waiting",
            "Requests waiting for a running slot.",
            &ConstGauge::new(waiting as i64),
        )?;
        single(
            &mut encoder,
            "vllm:num_requests_running",
            "Requests running (vLLM's name, for inference gateways).",
            &ConstGauge::new(running as i64),
        )?;
        single(
            &mut encoder,
            "vllm:num_requests_waiting",
            "Requests waiting (vLLM's name, for inference gateways).",
            &ConstGauge::new(waiting as i64),
        )?;
        single(
            &mut encoder,
            "vllm:gpu_cache_usage_perc",
            "KV blocks in use over KV blocks available, 0 to 1 (vLLM's name, for inference gateways; the CPU's cache too).",
            &ConstGauge::new(kv.usage()),
        )?;
        labelled(
            &mut encoder,
            "ember_kv_blocks",
            "KV cache blocks: used by live sequences, kept only by the prefix cache, holding memory, and the most the cache may hand out.",
            MetricType::Gauge,
            &[
                (vec![("state", "used".into())], ConstGauge::new(kv.used_blocks as i64)),
                (vec![("state", "cached".into())], ConstGauge::new(kv.cached_blocks as i64)),
                (vec![("state", "resident".into())], ConstGauge::new(kv.resident_blocks as i64)),
                (vec![("state", "total".into())], ConstGauge::new(kv.total_blocks as i64)),
            ],
        )?;
        single(
            &mut encoder,
            "ember_kv_block_size_tokens",
            "Tokens per KV block.",
            &ConstGauge::new(kv.block_size as i64),
        )?;
        labelled(
            &mut encoder,
            "ember_prompt_tokens",
            "Prompt tokens put in the KV cache: computed by forward passes (recomputation after preemption included) or taken from the prefix cache.",
            MetricType::Counter,
            &[
                (vec![("kind", "computed".into())], ConstCounter::new(totals.prompt_tokens_computed)),
                (vec![("kind", "cached".into())], ConstCounter::new(totals.prompt_tokens_cached)),
            ],
        )?;
        single(
            &mut encoder,
            "ember_prompt_tokens_submitted",
            "Prompt tokens of the requests submitted.",
            &ConstCounter::new(totals.prompt_tokens),
        )?;
        single(
            &mut encoder,
            "ember_generated_tokens",
            "Tokens generated.",
            &ConstCounter::new(totals.generated_tokens),
        )?;
        single(
            &mut encoder,
            "ember_preemptions",
            "Times a running sequence was preempted for lack of KV blocks (its blocks freed, its tokens recomputed later).",
            &ConstCounter::new(totals.preemptions),
        )?;
        single(
            &mut encoder,
            "ember_requests_submitted",
            "Requests the engine accepted.",
            &ConstCounter::new(totals.requests_submitted),
        )?;
        labelled(
            &mut encoder,
            "ember_requests_ended",
            "Requests that ended in the engine, by outcome.",
            MetricType::Counter,
            &[
                (
                    vec![("outcome", "finished".into())],
                    ConstCounter::new(
                        totals
                            .requests_finished
                            .saturating_sub(totals.requests_cancelled),
                    ),
                ),
                (
                    vec![("outcome", "cancelled".into())],
                    ConstCounter::new(totals.requests_cancelled),
                ),
                (
                    vec![("outcome", "failed".into())],
                    ConstCounter::new(totals.requests_failed),
                ),
            ],
        )?;
        single(
            &mut encoder,
            "ember_engine_steps",
            "Forward passes the engine ran.",
            &ConstCounter::new(snapshot.as_ref().map_or(0, |s| s.steps)),
        )?;
        single(
            &mut encoder,
            "ember_engine_failed_steps",
            "Forward passes that failed (their requests were retried alone).",
            &ConstCounter::new(totals.failed_steps),
        )?;
        single(
            &mut encoder,
            "ember_idle_trims",
            "Times the idle engine gave KV memory and scratch back.",
            &ConstCounter::new(totals.idle_trims),
        )?;
        if let Some(s) = &snapshot {
            let since = s
                .last_step_finished
                .unwrap_or(s.started_at)
                .elapsed()
                .as_secs_f64();
            single(
                &mut encoder,
                "ember_engine_seconds_since_last_step",
                "Seconds since the engine last finished a forward pass (or started, before the first).",
                &ConstGauge::new(since),
            )?;
        }
        self.encode_memory(&mut encoder, &kv)
    }
}

impl EngineCollector {
    /// Device memory: the pool's figures on a GPU; on the CPU alone, the KV cache's bytes; over
    /// a split, the split's own counts for each device without a GPU backend's pool (the CPU of
    /// a partial offload, simulated devices: weights, kv and scratch; the prefix cache's share
    /// is only given for a GPU's device or the CPU alone), and the simulated devices' pool
    /// series (held, peak held, floors, trims).
    fn encode_memory(
        &self,
        encoder: &mut DescriptorEncoder,
        kv: &crate::engine::KvSnapshot,
    ) -> Result<(), std::fmt::Error> {
        let kv_bytes = (kv.resident_blocks * kv.bytes_per_block) as u64;
        let prefix_bytes = (kv.cached_blocks * kv.bytes_per_block) as u64;
        let state_bytes = kv.recurrent_state_bytes as u64;
        let Some(engine) = self.served.engine.get() else {
            return Ok(());
        };
        const MEMORY_HELP: &str = "Device memory in use by purpose: weights, kv (the KV cache's blocks holding memory), scratch, prefix_cache (the part of kv kept only by the prefix cache), and recurrent_state (the per-sequence state of hybrid models' linear-attention layers).";
        // The split's devices without a GPU backend's pool, counted as the split allocates.
        let mut split_rows = Vec::new();
        if let Some(split) = engine.split_memory() {
            for device in split.devices() {
                for (purpose, bytes) in [
                    ("weights", device.now.weights),
                    ("kv", device.now.kv),
                    ("scratch", device.now.scratch),
                ] {
                    split_rows.push((
                        vec![
                            ("device", device.device.clone()),
                            ("purpose", purpose.to_string()),
                        ],
                        ConstGauge::new(bytes as i64),
                    ));
                }
            }
        }
        if engine.pool().is_none() && !split_rows.is_empty() {
            labelled(
                encoder,
                "ember_device_memory_bytes",
                MEMORY_HELP,
                MetricType::Gauge,
                &split_rows,
            )?;
            // The simulated devices' pools, read here: their lock is never held for long (a
            // host-driver trim does not wait on a device).
            let samples: Vec<PoolSample> = engine
                .split_memory()
                .map(|split| split.pools.iter().map(|p| PoolSample::now(p)).collect())
                .unwrap_or_default();
            return encode_pools(encoder, &samples);
        }
        if engine.pool().is_none() {
            let device = || vec![("device", "cpu".to_string())];
            let with = |purpose: &str| {
                let mut labels = device();
                labels.push(("purpose", purpose.to_string()));
                labels
            };
            return labelled(
                encoder,
                "ember_device_memory_bytes",
                MEMORY_HELP,
                MetricType::Gauge,
                &[
                    (with("kv"), ConstGauge::new(kv_bytes as i64)),
                    (with("prefix_cache"), ConstGauge::new(prefix_bytes as i64)),
                    (with("recurrent_state"), ConstGauge::new(state_bytes as i64)),
                ],
            );
        }
        let Some(sample) = self.served.pool_sample() else {
            return Ok(());
        };
        let with = |purpose: &str| {
            vec![
                ("device", sample.device.clone()),
                ("purpose", purpose.to_string()),
            ]
        };
        let live = |purpose: Purpose| sample.usage.purpose(purpose).current as i64;
        let mut rows = vec![
            (with("weights"), ConstGauge::new(live(Purpose::Weights))),
            (with("kv"), ConstGauge::new(live(Purpose::Kv))),
            (with("scratch"), ConstGauge::new(live(Purpose::Scratch))),
            (with("prefix_cache"), ConstGauge::new(prefix_bytes as i64)),
            (
                with("recurrent_state"),
                ConstGauge::new(live(Purpose::RecurrentState)),
            ),
        ];
        rows.extend(split_rows);
        labelled(
            encoder,
            "ember_device_memory_bytes",
            MEMORY_HELP,
            MetricType::Gauge,
            &rows,
        )?;
        encode_pools(encoder, std::slice::from_ref(&sample))
    }
}

/// A labelled gauge's row.
type GaugeRow = (Vec<(&'static str, String)>, ConstGauge<i64>);

/// The pools' own series, one row per device: held now and at peak, the floor after load and
/// the configured floor, and the trims.
fn encode_pools(
    encoder: &mut DescriptorEncoder,
    samples: &[PoolSample],
) -> Result<(), std::fmt::Error> {
    if samples.is_empty() {
        return Ok(());
    }
    let rows = |value: &dyn Fn(&PoolSample) -> i64| -> Vec<GaugeRow> {
        samples
            .iter()
            .map(|s| {
                (
                    vec![("device", s.device.clone())],
                    ConstGauge::new(value(s)),
                )
            })
            .collect()
    };
    labelled(
        encoder,
        "ember_device_memory_held_bytes",
        "Physical device memory the pool holds from the driver now.",
        MetricType::Gauge,
        &rows(&|s| s.usage.held as i64),
    )?;
    labelled(
        encoder,
        "ember_device_memory_peak_held_bytes",
        "The most physical device memory the pool has held.",
        MetricType::Gauge,
        &rows(&|s| s.usage.peak_held as i64),
    )?;
    let at_load: Vec<_> = samples
        .iter()
        .filter_map(|s| {
            s.held_at_load.map(|held| {
                (
                    vec![("device", s.device.clone())],
                    ConstGauge::new(held as i64),
                )
            })
        })
        .collect();
    if !at_load.is_empty() {
        labelled(
            encoder,
            "ember_device_memory_floor_bytes",
            "Device memory held right after load: the floor idle trim returns to.",
            MetricType::Gauge,
            &at_load,
        )?;
    }
    labelled(
        encoder,
        "ember_device_memory_pool_floor_bytes",
        "The pool's configured floor (memory it keeps when trimming).",
        MetricType::Gauge,
        &rows(&|s| s.floor_bytes as i64),
    )?;
    let trims: Vec<_> = samples
        .iter()
        .map(|s| {
            (
                vec![("device", s.device.clone())],
                ConstCounter::new(s.trims),
            )
        })
        .collect();
    labelled(
        encoder,
        "ember_device_memory_trims",
        "Times the pool gave device memory back to the driver.",
        MetricType::Counter,
        &trims,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrape_before_load_has_the_gateway_series_and_counts() {
        let metrics = Metrics::new(Arc::new(ServedEngine::default()));
        metrics.count_http("/v1/completions", 200);
        metrics.count_http("/v1/completions", 200);
        metrics.count_http("/v1/completions", 429);
        metrics.observe_done(
            FinishReason::Length,
            &Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_tokens: 0,
            },
            &Timings {
                queued: Duration::from_millis(1),
                time_to_first_token: Duration::from_millis(20),
                total: Duration::from_millis(60),
                preemptions: 0,
            },
        );
        let text = metrics.render();
        for line in [
            "ember_http_requests_total{route=\"/v1/completions\",status=\"200\"} 2",
            "ember_http_requests_total{route=\"/v1/completions\",status=\"429\"} 1",
            "ember_request_finish_total{reason=\"length\"} 1",
            "ember_time_to_first_token_seconds_count 1",
            "ember_time_per_output_token_seconds_count 1",
            "vllm:num_requests_running 0",
            "vllm:num_requests_waiting 0",
            "vllm:gpu_cache_usage_perc 0.0",
            "ember_model_loaded 0",
            "# TYPE vllm:num_requests_running gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Two tokens after the first in 40 ms: 20 ms each, in the 0.02 bucket.
        assert!(
            text.contains("ember_time_per_output_token_seconds_bucket{le=\"0.02\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn cancelled_requests_are_counted_but_not_timed() {
        let metrics = Metrics::new(Arc::new(ServedEngine::default()));
        metrics.observe_done(
            FinishReason::Cancelled,
            &Usage::default(),
            &Timings::default(),
        );
        let text = metrics.render();
        assert!(
            text.contains("ember_request_finish_total{reason=\"cancelled\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ember_e2e_request_latency_seconds_count 0"),
            "{text}"
        );
    }
}
