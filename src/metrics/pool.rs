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
    watch_restarts: IntCounterVec,
    api_probes: IntCounterVec,
    unknown_roles: IntCounter,
    panics: IntCounter,
    panicking: IntGauge,
}

impl PoolMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            endpoints: gauge_vec(
                r,
                "kvindexer_pool_endpoints",
                "The pool's endpoints by standing: candidate, not_ready (the pool says so), \
                 unreachable (ejected: its metrics port gave no connection \
                 scrapeFailuresToLeave times in a row; a candidate again while the pool panics)",
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
                 lists it), not_ready (the pool says not Ready), unreachable (ejected: its \
                 metrics port gave no connection scrapeFailuresToLeave times in a row)",
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
            watch_restarts: counter_vec(
                r,
                "kvindexer_pool_watch_restarts_total",
                "Kubernetes watches the picker restarted (a new list and watch), by cause: \
                 api_back (the API server answers again after it did not: a watch opened \
                 before may be dead), list_stalled (a list page did not come within \
                 endpointPicker.pool.requestTimeout)",
                &["cause"],
            ),
            api_probes: counter_vec(
                r,
                "kvindexer_pool_api_probes_total",
                "Reads of the InferencePool that check the API server answers (every 2 s), by \
                 result: ok, timeout (no answer within endpointPicker.pool.requestTimeout), \
                 error",
                &["result"],
            ),
            panics: counter(
                r,
                "kvindexer_pool_panics_total",
                "Panics begun: fewer than endpointPicker.health.panicThresholdPercent of the \
                 Ready endpoints would be left, so every Ready endpoint was a candidate again",
            ),
            panicking: gauge(
                r,
                "kvindexer_pool_panicking",
                "1 while the pool panics (every Ready endpoint a candidate, ejected ones \
                 included), else 0",
            ),
            unknown_roles: counter(
                r,
                "kvindexer_pool_unknown_roles_total",
                "Pool endpoints whose llm-d.ai/role label no llm-d filter knows (each endpoint \
                 and label counted once): neither a prefill nor a decode candidate",
            ),
        }
    }

    /// An endpoint with an unknown role label, first seen.
    pub fn unknown_role(&self) {
        self.unknown_roles.inc();
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

    /// A panic began.
    pub fn panic(&self) {
        self.panics.inc();
    }

    /// Whether the pool panics now.
    pub fn panicking(&self, now: bool) {
        self.panicking.set(i64::from(now));
    }

    /// The picker restarted a watch, for `cause`.
    pub fn watch_restart(&self, cause: &'static str) {
        self.watch_restarts.with_label_values(&[cause]).inc();
    }

    /// A read of the InferencePool that checks the API server, and its `result`.
    pub fn api_probe(&self, result: &'static str) {
        self.api_probes.with_label_values(&[result]).inc();
    }
}
