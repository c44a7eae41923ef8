//! The endpoint picker's pool: its endpoints by standing, each change of standing by reason,
//! publishers outside the pool, and the Kubernetes watcher's events and errors. Every label is
//! a fixed enum.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::registry::{counter, counter_vec, gauge, gauge_vec};
use kv_core::Standing;

/// What the pool did.
pub struct PoolMetrics {
    endpoints: IntGaugeVec,
    joined: IntCounterVec,
    left: IntCounterVec,
    outside: IntCounter,
    outside_now: IntGauge,
    synced: IntGauge,
    watch_events: IntCounterVec,
    watch_errors: IntCounterVec,
}

impl PoolMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            endpoints: gauge_vec(
                r,
                "kvindexer_pool_endpoints",
                "The pool's endpoints by standing: candidate, not_ready (the pool says so), \
                 unreachable (its metrics endpoint refused or timed out scrapeFailuresToLeave \
                 times in a row)",
                &["standing"],
            ),
            joined: counter_vec(
                r,
                "kvindexer_pool_joined_total",
                "Endpoints that became candidates, by reason: added (the pool lists it), ready \
                 (the pool says Ready again), answered (its metrics endpoint answers again)",
                &["reason"],
            ),
            left: counter_vec(
                r,
                "kvindexer_pool_left_total",
                "Endpoints that stopped being candidates, by reason: removed (the pool no longer \
                 lists it), not_ready (the pool says not Ready), unreachable (metrics refused or \
                 timed out scrapeFailuresToLeave times in a row)",
                &["reason"],
            ),
            outside: counter(
                r,
                "kvindexer_pool_publishers_outside_total",
                "Pods publishing KV events that the pool does not list (each counted once, when \
                 first seen): never candidates",
            ),
            outside_now: gauge(
                r,
                "kvindexer_pool_publishers_outside",
                "Pods publishing KV events that the pool does not list, now",
            ),
            synced: gauge(
                r,
                "kvindexer_pool_synced",
                "1 once the pool's source has answered (the Kubernetes watcher's first list, \
                 DNS's first answer, a static list at once); 0 before, and without a pool",
            ),
            watch_events: counter_vec(
                r,
                "kvindexer_pool_watch_events_total",
                "Kubernetes watcher events by resource (inferencepool, pod) and kind: init (a \
                 list begins: at start and after a 410 Gone), init_done, apply, delete",
                &["resource", "event"],
            ),
            watch_errors: counter_vec(
                r,
                "kvindexer_pool_watch_errors_total",
                "Kubernetes watcher errors by resource (each retried with backoff; a 410 Gone \
                 relists)",
                &["resource"],
            ),
        }
    }

    /// The endpoints' standings now.
    pub fn standings(&self, candidate: usize, not_ready: usize, unreachable: usize) {
        for (label, n) in [
            ("candidate", candidate),
            ("not_ready", not_ready),
            ("unreachable", unreachable),
        ] {
            self.endpoints.with_label_values(&[label]).set(n as i64);
        }
    }

    /// An endpoint's standing changed from `from` to `to`.
    pub fn changed(&self, from: Standing, to: Standing) {
        let reason = |s: Standing| match s {
            Standing::NotInPool => "removed",
            Standing::NotReady => "not_ready",
            Standing::Unreachable => "unreachable",
            Standing::Candidate => "candidate",
        };
        match (from, to) {
            (_, Standing::Candidate) => {
                let why = match from {
                    Standing::NotInPool => "added",
                    Standing::NotReady => "ready",
                    _ => "answered",
                };
                self.joined.with_label_values(&[why]).inc();
            }
            (Standing::Candidate, _) => self.left.with_label_values(&[reason(to)]).inc(),
            // Between two ways of being out: not a candidate either way.
            _ => {}
        }
    }

    /// Publishers outside the pool: `new` first seen, `now` in all.
    pub fn outside(&self, new: usize, now: usize) {
        self.outside.inc_by(new as u64);
        self.outside_now.set(now as i64);
    }

    /// Whether the pool's source has answered.
    pub fn synced(&self, synced: bool) {
        self.synced.set(i64::from(synced));
    }

    /// A watcher event on `resource`.
    pub fn watch_event(&self, resource: &'static str, event: &'static str) {
        self.watch_events
            .with_label_values(&[resource, event])
            .inc();
    }

    /// A watcher error on `resource`.
    pub fn watch_error(&self, resource: &'static str) {
        self.watch_errors.with_label_values(&[resource]).inc();
    }
}
