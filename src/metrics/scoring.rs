//! Score-request metrics.

use std::time::Duration;

use kv_core::Indexer;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, Registry};

use super::registry::{counter, counter_vec, gauge, latency, latency_vec};

/// ScorePods / GetPodScores activity.
pub struct ScoringMetrics {
    lookup_requests: IntCounter,
    lookup_hits: IntCounter,
    lookup_latency: Histogram,
    score_requests: IntCounterVec,
    score_latency: HistogramVec,
    memo_units: IntCounterVec,
    memo_bytes: IntGauge,
}

impl ScoringMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            lookup_requests: counter(
                r,
                "kvcache_index_lookup_requests_total",
                "Index lookups (score requests)",
            ),
            lookup_hits: counter(
                r,
                "kvcache_index_lookup_hits_total",
                "Lookups where some pod held at least the first block",
            ),
            lookup_latency: latency(
                r,
                "kvcache_index_lookup_latency_seconds",
                "Time to walk the index for one prompt's block hashes",
            ),
            score_requests: counter_vec(
                r,
                "kvindexer_score_requests_total",
                "Score requests",
                &["rpc", "code"],
            ),
            score_latency: latency_vec(
                r,
                "kvindexer_score_latency_seconds",
                "ScorePods latency inside the server (hashing + index walk), by input kind",
                &["input"],
            ),
            memo_units: counter_vec(
                r,
                "kvindexer_digest_memo_units_total",
                "Prompt hash units scored: taken from the digest memo (hit) or hashed (miss)",
                &["result"],
            ),
            memo_bytes: gauge(
                r,
                "kvindexer_digest_memo_bytes",
                "Bytes of the digest memos (scoring.digestMemoBytes per hash unit size in use)",
            ),
        }
    }

    /// Brings the digest-memo series up to the indexer's totals (at scrape time).
    pub(super) fn refresh(&self, indexer: &Indexer) {
        let stats = indexer.digest_memo_stats();
        for (result, total) in [("hit", stats.hits), ("miss", stats.misses)] {
            let counter = self.memo_units.with_label_values(&[result]);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        self.memo_bytes.set(stats.bytes as i64);
    }

    /// One index walk: whether any pod matched, and how long the walk took.
    pub fn lookup(&self, hit: bool, walk: Duration) {
        self.lookup_requests.inc();
        if hit {
            self.lookup_hits.inc();
        }
        self.lookup_latency.observe(walk.as_secs_f64());
    }

    /// A served score, by input kind (`tokens`, `prompt`, `chat`), end to end in the server.
    pub fn served(&self, input: &str, elapsed: Duration) {
        self.score_latency
            .with_label_values(&[input])
            .observe(elapsed.as_secs_f64());
    }

    /// A finished RPC with its gRPC code name.
    pub fn request(&self, rpc: &str, code: &str) {
        self.score_requests.with_label_values(&[rpc, code]).inc();
    }
}
