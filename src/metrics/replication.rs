//! Replication metrics: the shared log (appended, applied, lag), snapshots, Redis health.

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use super::registry::{counter, counter_vec, gauge, latency};

/// The replication log, snapshots and the Redis connection.
pub struct ReplicationMetrics {
    appended: IntCounter,
    append_dropped: IntCounter,
    append_queue: IntGauge,
    applied: IntCounterVec,
    lag_messages: IntGauge,
    lag_seconds: Gauge,
    snapshot_age: Gauge,
    snapshot_bytes: IntGauge,
    snapshot_memberships: IntGauge,
    snapshot_duration: Histogram,
    snapshots: IntCounterVec,
    redis_errors: IntCounterVec,
    reconnects: IntCounter,
    reloads: IntCounter,
}

impl ReplicationMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        let float_gauge = |name: &str, help: &str| {
            let g = Gauge::with_opts(Opts::new(name, help)).expect("valid metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        Self {
            appended: counter(
                r,
                "kvindexer_replication_appended_total",
                "Messages this replica appended to the shared log",
            ),
            append_dropped: counter(
                r,
                "kvindexer_replication_append_dropped_total",
                "Messages not appended because the append queue was full (Redis slow or down)",
            ),
            append_queue: gauge(
                r,
                "kvindexer_replication_append_queue",
                "Messages waiting to be appended",
            ),
            applied: counter_vec(
                r,
                "kvindexer_replication_log_entries_total",
                "Log entries read, by outcome (applied: handed to the workers; own: this process's own entry, skipped; undecodable)",
                &["outcome"],
            ),
            lag_messages: gauge(
                r,
                "kvindexer_replication_lag_messages",
                "Log entries behind the log's end, as of the last read",
            ),
            lag_seconds: float_gauge(
                "kvindexer_replication_lag_seconds",
                "Age of the newest log entry read while more were waiting (0 at the log's end)",
            ),
            snapshot_age: float_gauge(
                "kvindexer_replication_snapshot_age_seconds",
                "Age of the newest snapshot in Redis, as seen by this replica",
            ),
            snapshot_bytes: gauge(
                r,
                "kvindexer_replication_snapshot_bytes",
                "Size of the last snapshot this replica wrote or loaded",
            ),
            snapshot_memberships: gauge(
                r,
                "kvindexer_replication_snapshot_memberships",
                "Memberships in the last snapshot this replica wrote or loaded",
            ),
            snapshot_duration: latency(
                r,
                "kvindexer_replication_snapshot_seconds",
                "Time to write a snapshot (pause, export, encode, store)",
            ),
            snapshots: counter_vec(
                r,
                "kvindexer_replication_snapshots_total",
                "Snapshots by operation and result (written, loaded, failed)",
                &["operation", "result"],
            ),
            redis_errors: counter_vec(
                r,
                "kvindexer_replication_redis_errors_total",
                "Redis commands that failed, by the task that sent them",
                &["task"],
            ),
            reconnects: counter(
                r,
                "kvindexer_replication_reconnects_total",
                "Times a replication task reconnected after a Redis error",
            ),
            reloads: counter(
                r,
                "kvindexer_replication_reloads_total",
                "Times this replica fell behind the trimmed log and reloaded from a snapshot",
            ),
        }
    }

    /// One message appended.
    pub fn appended(&self, n: u64) {
        self.appended.inc_by(n);
    }

    /// An append dropped (queue full).
    pub fn append_dropped(&self) {
        self.append_dropped.inc();
    }

    /// Messages waiting to be appended.
    pub fn append_queue(&self, n: usize) {
        self.append_queue.set(n as i64);
    }

    /// A log entry read, with what became of it.
    pub fn log_entry(&self, outcome: &'static str) {
        self.applied.with_label_values(&[outcome]).inc();
    }

    /// Entries between this replica's position and the log's end (estimated once a second).
    pub fn lag_messages(&self, messages: u64) {
        self.lag_messages.set(messages as i64);
    }

    /// Age of the newest entry read, when more were waiting (0 at the log's end).
    pub fn lag_seconds(&self, seconds: f64) {
        self.lag_seconds.set(seconds);
    }

    /// The newest snapshot's age.
    pub fn snapshot_age(&self, seconds: f64) {
        self.snapshot_age.set(seconds);
    }

    /// A snapshot written or loaded: its size.
    pub fn snapshot(&self, operation: &'static str, bytes: usize, memberships: u64) {
        self.snapshots.with_label_values(&[operation, "ok"]).inc();
        self.snapshot_bytes.set(bytes as i64);
        self.snapshot_memberships.set(memberships as i64);
    }

    /// A snapshot written: how long it took.
    pub fn snapshot_duration(&self, seconds: f64) {
        self.snapshot_duration.observe(seconds);
    }

    /// A snapshot operation failed.
    pub fn snapshot_failed(&self, operation: &'static str) {
        self.snapshots
            .with_label_values(&[operation, "failed"])
            .inc();
    }

    /// A Redis command failed.
    pub fn redis_error(&self, task: &'static str) {
        self.redis_errors.with_label_values(&[task]).inc();
    }

    /// A task reconnected.
    pub fn reconnected(&self) {
        self.reconnects.inc();
    }

    /// A reload from a snapshot.
    pub fn reloaded(&self) {
        self.reloads.inc();
    }
}
