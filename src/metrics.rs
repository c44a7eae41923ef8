//! Prometheus metrics: the names llm-d users already chart (`kvcache_index_*`) and kv-indexer's
//! own (`kvindexer_*`).
//!
//! Invariant: every label set is bounded. Reasons and event types are fixed enums; the `pod`
//! label takes at most [`MAX_POD_LABELS`] distinct values (later pods are reported as
//! `"_other"`), so a fleet whose pods restart under new addresses cannot grow the series count
//! without bound; model labels are bounded the same way.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::indexer::Indexer;

/// Distinct pods with their own label value; beyond, `"_other"`.
pub const MAX_POD_LABELS: usize = 512;
/// Distinct models with their own label value; beyond, `"_other"`.
pub const MAX_MODEL_LABELS: usize = 64;

/// A bounded set of label values.
#[derive(Debug)]
struct BoundedLabels {
    seen: Mutex<HashSet<String>>,
    limit: usize,
}

impl BoundedLabels {
    fn new(limit: usize) -> Self {
        Self {
            seen: Mutex::new(HashSet::new()),
            limit,
        }
    }

    /// `value` if it has (or can get) its own series, else `"_other"`.
    fn get(&self, value: &str) -> String {
        let mut seen = self.seen.lock();
        if seen.contains(value) {
            return value.to_owned();
        }
        if seen.len() < self.limit {
            seen.insert(value.to_owned());
            return value.to_owned();
        }
        "_other".to_owned()
    }
}

/// Every metric the daemon exports.
pub struct Metrics {
    registry: Registry,
    pods: BoundedLabels,
    models: BoundedLabels,
    // llm-d compatible names.
    /// Blocks (memberships) added to the index.
    pub index_admissions: IntCounter,
    /// Blocks (memberships) removed from the index.
    pub index_evictions: IntCounter,
    /// Score lookups served.
    pub lookup_requests: IntCounter,
    /// Score lookups where at least one pod matched at least one block.
    pub lookup_hits: IntCounter,
    /// Time to score a prompt given its block hashes (index walk only).
    pub lookup_latency: Histogram,
    // kv-indexer's own.
    /// ZMQ messages received, by pod.
    pub messages_received: IntCounterVec,
    /// KV events received, by pod and event type.
    pub events_received: IntCounterVec,
    /// Payloads that failed to decode, by reason.
    pub decode_errors: IntCounterVec,
    /// Messages dropped before decoding (bad frame count, short sequence, bad topic).
    pub frame_errors: IntCounterVec,
    /// Sequence gaps detected, by pod.
    pub sequence_gaps: IntCounterVec,
    /// Messages lost for good (gaps replay could not fill), by pod.
    pub messages_lost: IntCounterVec,
    /// Replay requests, by result.
    pub replays: IntCounterVec,
    /// Publisher restarts detected (sequence went backwards), by pod.
    pub pod_restarts: IntCounterVec,
    /// Recomputed root-block hashes, by pod, model and result (match / mismatch).
    pub hash_checks: IntCounterVec,
    /// Blocks applied, by operation (stored / removed).
    pub blocks_applied: IntCounterVec,
    /// Events skipped (unknown type, non-prefix-cacheable group), by reason.
    pub events_skipped: IntCounterVec,
    /// Index keys, by model.
    pub index_keys: IntGaugeVec,
    /// (block, pod, tier) memberships, by model.
    pub index_memberships: IntGaugeVec,
    /// Estimated index memory, by model.
    pub index_memory_bytes: IntGaugeVec,
    /// Memberships dropped at `size` / `podCacheSize`, by model and reason.
    pub index_capacity_drops: IntGaugeVec,
    /// Stored runs whose parent the pod did not hold, by model.
    pub index_orphan_runs: IntGaugeVec,
    /// ScorePods / GetPodScores requests, by RPC and gRPC code.
    pub score_requests: IntCounterVec,
    /// End-to-end score latency inside the server, by input kind.
    pub score_latency: HistogramVec,
    /// Event batches waiting in worker queues.
    pub event_queue_depth: IntGauge,
    /// Time to tokenize a prompt that missed the prefix store (llm-d's name).
    pub tokenization_latency: Histogram,
    /// Tokens produced (from the tokenizer or the prefix store; llm-d's name).
    pub tokenized_tokens: IntCounter,
    /// Prefix-store lookups, by result (hit / miss).
    pub prefix_store_lookups: IntCounterVec,
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("static metric definition is valid");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(g.clone()))
        .expect("metric names are unique");
    g
}

/// Latency buckets from 1 us to 1 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
        2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    ]
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Arc<Self> {
        let r = Registry::new();
        let lookup_latency = Histogram::with_opts(
            HistogramOpts::new(
                "kvcache_index_lookup_latency_seconds",
                "Time to walk the index for one prompt's block hashes",
            )
            .buckets(latency_buckets()),
        )
        .expect("static metric definition");
        r.register(Box::new(lookup_latency.clone()))
            .expect("unique");
        let score_latency = HistogramVec::new(
            HistogramOpts::new(
                "kvindexer_score_latency_seconds",
                "ScorePods latency inside the server (hashing + index walk), by input kind",
            )
            .buckets(latency_buckets()),
            &["input"],
        )
        .expect("static metric definition");
        r.register(Box::new(score_latency.clone())).expect("unique");
        let event_queue_depth = IntGauge::new(
            "kvindexer_event_queue_depth",
            "Event messages waiting in worker queues",
        )
        .expect("static metric definition");
        r.register(Box::new(event_queue_depth.clone()))
            .expect("unique");
        let tokenization_latency = Histogram::with_opts(
            HistogramOpts::new(
                "kvcache_tokenization_tokenization_latency_seconds",
                "Time to tokenize a prompt (prefix-store misses)",
            )
            .buckets(latency_buckets()),
        )
        .expect("static metric definition");
        r.register(Box::new(tokenization_latency.clone()))
            .expect("unique");
        Arc::new(Self {
            tokenization_latency,
            tokenized_tokens: counter(
                &r,
                "kvcache_tokenization_tokenized_tokens_total",
                "Tokens produced for score requests",
            ),
            prefix_store_lookups: counter_vec(
                &r,
                "kvindexer_prefix_store_lookups_total",
                "Prefix-store lookups",
                &["result"],
            ),
            index_admissions: counter(
                &r,
                "kvcache_index_admissions_total",
                "Blocks added to the index (per pod and tier)",
            ),
            index_evictions: counter(
                &r,
                "kvcache_index_evictions_total",
                "Blocks removed from the index (per pod and tier)",
            ),
            lookup_requests: counter(
                &r,
                "kvcache_index_lookup_requests_total",
                "Index lookups (score requests)",
            ),
            lookup_hits: counter(
                &r,
                "kvcache_index_lookup_hits_total",
                "Lookups where some pod held at least the first block",
            ),
            lookup_latency,
            messages_received: counter_vec(
                &r,
                "kvindexer_zmq_messages_received_total",
                "ZMQ messages received",
                &["pod"],
            ),
            events_received: counter_vec(
                &r,
                "kvindexer_events_received_total",
                "KV events received",
                &["pod", "type"],
            ),
            decode_errors: counter_vec(
                &r,
                "kvindexer_decode_errors_total",
                "Event payloads that failed to decode",
                &["reason"],
            ),
            frame_errors: counter_vec(
                &r,
                "kvindexer_frame_errors_total",
                "ZMQ messages dropped before decoding",
                &["reason"],
            ),
            sequence_gaps: counter_vec(
                &r,
                "kvindexer_sequence_gaps_total",
                "Gaps in a publisher's sequence numbers",
                &["pod"],
            ),
            messages_lost: counter_vec(
                &r,
                "kvindexer_messages_lost_total",
                "Messages missing after replay (or without replay)",
                &["pod"],
            ),
            replays: counter_vec(
                &r,
                "kvindexer_replays_total",
                "Replay requests to vLLM's ROUTER",
                &["result"],
            ),
            pod_restarts: counter_vec(
                &r,
                "kvindexer_pod_restarts_total",
                "Publisher restarts detected (sequence went backwards)",
                &["pod"],
            ),
            hash_checks: counter_vec(
                &r,
                "kvindexer_hash_checks_total",
                "Root-block hashes recomputed from event tokens",
                &["pod", "model", "result"],
            ),
            blocks_applied: counter_vec(
                &r,
                "kvindexer_blocks_applied_total",
                "Blocks applied to the index",
                &["op"],
            ),
            events_skipped: counter_vec(
                &r,
                "kvindexer_events_skipped_total",
                "Events not applied",
                &["reason"],
            ),
            index_keys: gauge_vec(
                &r,
                "kvindexer_index_keys",
                "Distinct block keys in the index",
                &["model"],
            ),
            index_memberships: gauge_vec(
                &r,
                "kvindexer_index_memberships",
                "(block, pod, tier) memberships in the index",
                &["model"],
            ),
            index_memory_bytes: gauge_vec(
                &r,
                "kvindexer_index_memory_bytes",
                "Memory held by the index",
                &["model"],
            ),
            index_orphan_runs: gauge_vec(
                &r,
                "kvindexer_index_orphan_runs",
                "Stored runs whose parent the pod did not hold (stored by hash; they score once the chain arrives)",
                &["model"],
            ),
            index_capacity_drops: gauge_vec(
                &r,
                "kvindexer_index_capacity_drops",
                "Memberships dropped because the index or a block was full",
                &["model", "reason"],
            ),
            score_requests: counter_vec(
                &r,
                "kvindexer_score_requests_total",
                "Score requests",
                &["rpc", "code"],
            ),
            score_latency,
            event_queue_depth,
            pods: BoundedLabels::new(MAX_POD_LABELS),
            models: BoundedLabels::new(MAX_MODEL_LABELS),
            registry: r,
        })
    }

    /// The label value for a pod (bounded).
    pub fn pod_label(&self, pod: &str) -> String {
        self.pods.get(pod)
    }

    /// The label value for a model (bounded).
    pub fn model_label(&self, model: &str) -> String {
        self.models.get(model)
    }

    /// Refreshes the index gauges from the indexer, then renders the text exposition.
    pub fn render(&self, indexer: &Indexer) -> String {
        for (model, stats) in indexer.stats() {
            let m = self.model_label(&model);
            self.index_keys
                .with_label_values(&[&m])
                .set(stats.keys as i64);
            self.index_memberships
                .with_label_values(&[&m])
                .set(stats.memberships as i64);
            self.index_memory_bytes
                .with_label_values(&[&m])
                .set(stats.memory_bytes as i64);
            self.index_orphan_runs
                .with_label_values(&[&m])
                .set(stats.orphan_runs as i64);
            self.index_capacity_drops
                .with_label_values(&[&m, "size"])
                .set(stats.capacity_evictions as i64);
            self.index_capacity_drops
                .with_label_values(&[&m, "pod_cache_size"])
                .set(stats.pod_cache_evictions as i64);
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            return format!("# metrics encoding failed: {e}\n");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_labels_are_bounded() {
        let m = Metrics::new();
        for i in 0..MAX_POD_LABELS {
            assert_eq!(m.pod_label(&format!("10.0.0.{i}")), format!("10.0.0.{i}"));
        }
        assert_eq!(m.pod_label("one-too-many"), "_other");
        assert_eq!(
            m.pod_label("10.0.0.3"),
            "10.0.0.3",
            "known pods keep their label"
        );
    }
}
