//! Speculative-entry metrics: routings recorded (`RecordRouting`), prompt keys used, and the
//! entries' size and outcomes, read from each model's statistics at scrape time.

use std::sync::Arc;

use kv_core::{Indexer, RoutingRecorded};
use prometheus::{IntCounterVec, IntGaugeVec, Registry};

use super::registry::{counter_vec, gauge_vec, Labels};

/// How a record ended, in kv-core's `RecordEnd` order.
const ENDS: [&str; 5] = ["confirmed", "expired", "evicted", "superseded", "cleared"];

/// Recorded routings and their speculative entries.
pub struct SpeculationMetrics {
    labels: Arc<Labels>,
    routings: IntCounterVec,
    prompt_keys: IntCounterVec,
    records: IntGaugeVec,
    entries: IntGaugeVec,
    fallback_pods: IntGaugeVec,
    memory_bytes: IntGaugeVec,
    ended: IntGaugeVec,
}

impl SpeculationMetrics {
    pub(super) fn new(r: &Registry, labels: Arc<Labels>) -> Self {
        Self {
            labels,
            routings: counter_vec(
                r,
                "kvindexer_speculative_routings_total",
                "RecordRouting calls that recorded (recorded), found every block already held (already_held), or were refused for a prompt longer than speculativePodBlocks (too_long)",
                &["outcome"],
            ),
            prompt_keys: counter_vec(
                r,
                "kvindexer_prompt_keys_total",
                "RecordRouting prompt keys: found, unknown or expired (unknown), not sent (absent)",
                &["result"],
            ),
            records: gauge_vec(
                r,
                "kvindexer_speculative_records",
                "Recorded routings not yet confirmed, expired or dropped",
                &["model"],
            ),
            entries: gauge_vec(
                r,
                "kvindexer_speculative_entries",
                "Distinct (block, pod) speculative entries",
                &["model"],
            ),
            fallback_pods: gauge_vec(
                r,
                "kvindexer_speculative_fallback_pods",
                "Pods scored by their recorded routings alone (no events for the model, or hashes that never matched)",
                &["model"],
            ),
            memory_bytes: gauge_vec(
                r,
                "kvindexer_speculative_memory_bytes",
                "Memory held by speculative entries and their records",
                &["model"],
            ),
            ended: gauge_vec(
                r,
                "kvindexer_speculative_records_ended",
                "Recorded routings ended since start, by reason (confirmed by BlockStored, expired, evicted for a bound, superseded by a longer prompt, cleared with the pod)",
                &["model", "reason"],
            ),
        }
    }

    /// A `RecordRouting` call's prompt key: `found`, `unknown` (or expired), `absent`.
    pub fn prompt_key(&self, result: &'static str) {
        self.prompt_keys.with_label_values(&[result]).inc();
    }

    /// A recorded routing's outcome.
    pub fn routing_recorded(&self, outcome: RoutingRecorded) {
        self.routings.with_label_values(&[outcome.as_str()]).inc();
    }

    /// Sets the gauges from every model's speculation.
    pub(super) fn refresh(&self, indexer: &Indexer) {
        for model in indexer.models() {
            let m = self.labels.model(model.name());
            let stats = model.speculation_stats();
            self.records
                .with_label_values(&[&m])
                .set(stats.records as i64);
            self.entries
                .with_label_values(&[&m])
                .set(stats.entries as i64);
            self.fallback_pods
                .with_label_values(&[&m])
                .set(stats.fallback_pods as i64);
            self.memory_bytes
                .with_label_values(&[&m])
                .set(stats.memory_bytes as i64);
            for (reason, n) in ENDS.iter().zip(model.speculation_ends()) {
                self.ended
                    .with_label_values(&[m.as_str(), reason])
                    .set(n as i64);
            }
        }
    }
}
