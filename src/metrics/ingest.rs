//! Ingest metrics: ZMQ intake, sequencing, gap fill and what applying batches did.

use std::sync::Arc;

use kv_core::ApplyReport;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::registry::{counter, counter_vec, gauge, gauge_vec, Labels};

/// Event intake and application.
pub struct IngestMetrics {
    labels: Arc<Labels>,
    /// The series labelled by pod (removed when the pod is forgotten).
    pod: PodSeries,
    decode_errors: IntCounterVec,
    frame_errors: IntCounterVec,
    gap_fills: IntCounterVec,
    blocks_applied: IntCounterVec,
    events_skipped: IntCounterVec,
    messages_shed: IntCounterVec,
    queue_depth: IntGauge,
    queue_bytes: IntGauge,
    resyncs: IntCounterVec,
    models_evicted: IntCounter,
    publishers: IntGaugeVec,
    pods_forgotten: IntCounterVec,
    blocks_dropped: IntCounterVec,
}

/// Ingest's series labelled by pod: what [`IngestMetrics::forgotten`] removes.
struct PodSeries {
    messages_received: IntCounterVec,
    events_received: IntCounterVec,
    sequence_gaps: IntCounterVec,
    messages_lost: IntCounterVec,
    pod_restarts: IntCounterVec,
    hash_checks: IntCounterVec,
    rank_errors: IntCounterVec,
}

impl PodSeries {
    fn new(r: &Registry) -> Self {
        Self {
            messages_received: counter_vec(
                r,
                "kvindexer_zmq_messages_received_total",
                "ZMQ messages received",
                &["pod"],
            ),
            events_received: counter_vec(
                r,
                "kvindexer_events_received_total",
                "KV events received",
                &["pod", "type"],
            ),
            sequence_gaps: counter_vec(
                r,
                "kvindexer_sequence_gaps_total",
                "Gaps in a publisher's sequence numbers",
                &["pod"],
            ),
            messages_lost: counter_vec(
                r,
                "kvindexer_messages_lost_total",
                "Messages missing after gap fill from vLLM's replay buffer (or without it)",
                &["pod"],
            ),
            pod_restarts: counter_vec(
                r,
                "kvindexer_pod_restarts_total",
                "Publisher restarts detected (sequence went backwards)",
                &["pod"],
            ),
            hash_checks: counter_vec(
                r,
                "kvindexer_hash_checks_total",
                "Root-block hashes recomputed from event tokens",
                &["pod", "model", "result"],
            ),
            rank_errors: counter_vec(
                r,
                "kvindexer_rank_errors_total",
                "Messages dropped because their data_parallel_rank was out of range, by publisher",
                &["pod"],
            ),
        }
    }
}

impl IngestMetrics {
    pub(super) fn new(r: &Registry, labels: Arc<Labels>) -> Self {
        Self {
            labels,
            pod: PodSeries::new(r),
            decode_errors: counter_vec(
                r,
                "kvindexer_decode_errors_total",
                "Event payloads that failed to decode",
                &["reason"],
            ),
            frame_errors: counter_vec(
                r,
                "kvindexer_frame_errors_total",
                "ZMQ messages dropped before decoding",
                &["reason"],
            ),
            // vLLM calls its gap-fill socket the replay endpoint; the metric keeps that name.
            gap_fills: counter_vec(
                r,
                "kvindexer_replays_total",
                "Gap-fill requests to vLLM's replay socket",
                &["result"],
            ),
            blocks_applied: counter_vec(
                r,
                "kvindexer_blocks_applied_total",
                "Blocks applied to the index",
                &["op"],
            ),
            events_skipped: counter_vec(
                r,
                "kvindexer_events_skipped_total",
                "Events not applied",
                &["reason"],
            ),
            messages_shed: counter_vec(
                r,
                "kvindexer_messages_shed_total",
                "Queued messages dropped because their pod passed its share of the queue (over_share) or the queue its total (over_total); each starts a resync",
                &["reason"],
            ),
            queue_bytes: gauge(
                r,
                "kvindexer_event_queue_bytes",
                "Bytes of event messages waiting in worker queues (bounded by queueBytes)",
            ),
            resyncs: counter_vec(
                r,
                "kvindexer_resyncs_total",
                "Publishers resynchronised after messages of theirs were dropped from the queue: a gap fill started, or none possible (unavailable: counted as lost, the publisher marked stale)",
                &["result"],
            ),
            queue_depth: gauge(
                r,
                "kvindexer_event_queue_depth",
                "Event messages waiting in worker queues",
            ),
            models_evicted: counter(
                r,
                "kvindexer_models_evicted_total",
                "Models that gave their place to a new one at maxModels (the unconfigured model holding the fewest blocks)",
            ),
            publishers: gauge_vec(
                r,
                "kvindexer_pods",
                "Pods known to this replica's ingest, by presence (live, idle, gone)",
                &["state"],
            ),
            pods_forgotten: counter_vec(
                r,
                "kvindexer_pods_forgotten_total",
                "Pods forgotten (blocks, engines and publisher states dropped), by reason",
                &["reason"],
            ),
            blocks_dropped: counter_vec(
                r,
                "kvindexer_blocks_dropped_total",
                "Blocks received and not indexed, and removals that found nothing, by reason",
                &["reason"],
            ),
        }
    }

    /// The pods known now: `[live, idle, gone]`.
    pub fn publishers(&self, counts: [u64; 3]) {
        for (state, n) in ["live", "idle", "gone"].into_iter().zip(counts) {
            self.publishers.with_label_values(&[state]).set(n as i64);
        }
    }

    /// A pod was forgotten (`reason`: gone, idle, cleared). Its per-pod series are removed
    /// and its label slot freed for the pods that come after it.
    pub fn forgotten(&self, pod: &str, models: &[std::sync::Arc<str>], reason: &'static str) {
        self.pods_forgotten.with_label_values(&[reason]).inc();
        let Some(label) = self.labels.release_pod(pod) else {
            return; // reported as "_other": nothing of its own to remove
        };
        for vec in [
            &self.pod.messages_received,
            &self.pod.sequence_gaps,
            &self.pod.messages_lost,
            &self.pod.pod_restarts,
            &self.pod.rank_errors,
        ] {
            let _ = vec.remove_label_values(&[&label]);
        }
        for ty in ["BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown"] {
            let _ = self.pod.events_received.remove_label_values(&[&label, ty]);
        }
        for model in models {
            let model = self.labels.model(model);
            for result in ["match", "mismatch"] {
                let _ = self
                    .pod
                    .hash_checks
                    .remove_label_values(&[&label, &model, result]);
            }
        }
    }

    /// A well-formed message arrived from `pod`.
    pub fn received(&self, pod: &str) {
        self.pod
            .messages_received
            .with_label_values(&[&self.labels.pod(pod)])
            .inc();
    }

    /// A message was dropped before decoding (`reason` is a fixed label).
    pub fn frame_error(&self, reason: &'static str) {
        self.frame_errors.with_label_values(&[reason]).inc();
    }

    /// A payload did not decode (`reason` is the decoder's bounded label).
    pub fn decode_error(&self, reason: &'static str) {
        self.decode_errors.with_label_values(&[reason]).inc();
    }

    /// Events or messages not applied, by a fixed reason.
    pub fn skipped(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.events_skipped.with_label_values(&[reason]).inc_by(n);
        }
    }

    /// `n` blocks were dropped for `reason` (a fixed label; see [`ApplyReport::drops`]).
    pub fn dropped(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.blocks_dropped.with_label_values(&[reason]).inc_by(n);
        }
    }

    /// A message of `pod` named a data-parallel rank out of range (dropped).
    pub fn rank_error(&self, pod: &str) {
        self.pod
            .rank_errors
            .with_label_values(&[&self.labels.pod(pod)])
            .inc();
    }

    /// `n` queued messages were dropped (their pod past its share, or the queue past its total).
    pub fn shed_n(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.messages_shed.with_label_values(&[reason]).inc_by(n);
        }
    }

    /// Bytes queued now (all workers).
    pub fn queue_bytes(&self, bytes: usize) {
        self.queue_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A model gave its place to a new one (`maxModels`).
    pub fn model_evicted(&self) {
        self.models_evicted.inc();
    }

    /// A resync after dropped messages: `started` or `unavailable`.
    pub fn resync(&self, result: &'static str) {
        self.resyncs.with_label_values(&[result]).inc();
    }

    /// A publisher's sequence went backwards.
    pub fn restart(&self, pod: &str) {
        self.pod
            .pod_restarts
            .with_label_values(&[&self.labels.pod(pod)])
            .inc();
    }

    /// A publisher's sequence jumped.
    pub fn gap(&self, pod: &str) {
        self.pod
            .sequence_gaps
            .with_label_values(&[&self.labels.pod(pod)])
            .inc();
    }

    /// `n` messages of `pod` are lost for good.
    pub fn lost(&self, pod: &str, n: u64) {
        if n > 0 {
            self.pod
                .messages_lost
                .with_label_values(&[&self.labels.pod(pod)])
                .inc_by(n);
        }
    }

    /// A gap-fill request ended with `result` (`ok`, `unavailable`, `timeout`, ...).
    pub fn gap_fill(&self, result: &'static str) {
        self.gap_fills.with_label_values(&[result]).inc();
    }

    /// A message entered a worker queue.
    pub fn queued(&self) {
        self.queue_depth.inc();
    }

    /// A message left a worker queue (taken, or never delivered).
    pub fn dequeued(&self) {
        self.queue_depth.dec();
    }

    /// `n` messages left the worker queues at once (dropped from them).
    pub fn dequeued_n(&self, n: u64) {
        self.queue_depth.sub(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// What applying one batch of `pod` for `model` did.
    pub fn applied(&self, pod: &str, model: &str, report: &ApplyReport) {
        let pod_label = self.labels.pod(pod);
        for (ty, n) in [
            ("BlockStored", report.stored_events),
            ("BlockRemoved", report.removed_events),
            ("AllBlocksCleared", report.cleared_events),
            ("unknown", report.unknown_events),
        ] {
            if n > 0 {
                self.pod
                    .events_received
                    .with_label_values(&[&pod_label, ty])
                    .inc_by(u64::from(n));
            }
        }
        self.skipped(
            "non_prefix_cacheable_group",
            u64::from(report.skipped_group_events),
        );
        self.skipped("unknown_type", u64::from(report.unknown_events));
        // Runs stored in part: hashes no evidence pairs with a block (their count is a drop).
        self.skipped("unplaced_hash", u64::from(report.translation.unplaced_runs));
        self.skipped("too_many_engines", u64::from(report.engine_rejected));
        for (reason, n) in report.drops() {
            self.dropped(reason, n);
        }
        self.blocks_applied
            .with_label_values(&["stored"])
            .inc_by(report.blocks_stored);
        self.blocks_applied
            .with_label_values(&["removed"])
            .inc_by(report.blocks_removed);
        if report.hash_matches + report.hash_mismatches > 0 {
            let model_label = self.labels.model(model);
            for (result, n) in [
                ("match", report.hash_matches),
                ("mismatch", report.hash_mismatches),
            ] {
                self.pod
                    .hash_checks
                    .with_label_values(&[&pod_label, &model_label, result])
                    .inc_by(u64::from(n));
            }
        }
    }
}
