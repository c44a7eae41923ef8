//! Index metrics: llm-d's admission/eviction counters, updated as batches apply, and size
//! gauges read from the index's own statistics at scrape time.

use std::sync::Arc;

use kv_core::{ApplyReport, Indexer};
use prometheus::{IntCounter, IntGaugeVec, Registry};

use super::registry::{counter, gauge_vec, Labels};

/// The index's size and activity.
pub struct IndexMetrics {
    labels: Arc<Labels>,
    admissions: IntCounter,
    evictions: IntCounter,
    keys: IntGaugeVec,
    memberships: IntGaugeVec,
    memory_bytes: IntGaugeVec,
    capacity_drops: IntGaugeVec,
    pool_exhausted: IntGaugeVec,
    orphan_runs: IntGaugeVec,
    reads_given_up: IntGaugeVec,
}

impl IndexMetrics {
    pub(super) fn new(r: &Registry, labels: Arc<Labels>) -> Self {
        Self {
            labels,
            admissions: counter(
                r,
                "kvcache_index_admissions_total",
                "Blocks added to the index (per pod and tier)",
            ),
            evictions: counter(
                r,
                "kvcache_index_evictions_total",
                "Blocks removed from the index (per pod and tier)",
            ),
            keys: gauge_vec(
                r,
                "kvindexer_index_keys",
                "Distinct block keys in the index",
                &["model"],
            ),
            memberships: gauge_vec(
                r,
                "kvindexer_index_memberships",
                "(block, pod, tier) memberships in the index",
                &["model"],
            ),
            memory_bytes: gauge_vec(
                r,
                "kvindexer_index_memory_bytes",
                "Memory held by the index",
                &["model"],
            ),
            orphan_runs: gauge_vec(
                r,
                "kvindexer_index_orphan_runs",
                "Stored runs whose parent the pod did not hold (stored by hash; they score once the chain arrives)",
                &["model"],
            ),
            reads_given_up: gauge_vec(
                r,
                "kvindexer_index_reads_given_up",
                "Blocks a score or lookup counted as not held because the writer kept changing them longer than a read waits (0 in a healthy index)",
                &["model"],
            ),
            capacity_drops: gauge_vec(
                r,
                "kvindexer_index_capacity_drops",
                "Memberships dropped because the index (size), a block (pod_cache_size) or the block ids (no_ids) were full",
                &["model", "reason"],
            ),
            pool_exhausted: gauge_vec(
                r,
                "kvindexer_index_pool_exhausted",
                "Holder changes the index's word pool had no room for (each part then scores for no one; 0 in a healthy index)",
                &["model"],
            ),
        }
    }

    /// Counts what one applied batch added and removed.
    pub fn applied(&self, report: &ApplyReport) {
        self.admissions.inc_by(report.blocks_stored);
        self.evictions.inc_by(report.blocks_removed);
    }

    /// Sets the gauges from every model's statistics.
    pub(super) fn refresh(&self, indexer: &Indexer) {
        for (model, stats) in indexer.stats() {
            let m = self.labels.model(&model);
            self.keys.with_label_values(&[&m]).set(stats.keys as i64);
            self.memberships
                .with_label_values(&[&m])
                .set(stats.memberships as i64);
            self.memory_bytes
                .with_label_values(&[&m])
                .set(stats.memory_bytes as i64);
            self.orphan_runs
                .with_label_values(&[&m])
                .set(stats.orphan_runs as i64);
            self.reads_given_up
                .with_label_values(&[&m])
                .set(stats.reads_given_up as i64);
            self.capacity_drops
                .with_label_values(&[&m, "size"])
                .set(stats.capacity_evictions as i64);
            self.capacity_drops
                .with_label_values(&[&m, "pod_cache_size"])
                .set(stats.pod_cache_evictions as i64);
            self.capacity_drops
                .with_label_values(&[&m, "no_ids"])
                .set(stats.dropped_full as i64);
            self.pool_exhausted
                .with_label_values(&[&m])
                .set(stats.pool_exhausted as i64);
        }
    }
}
