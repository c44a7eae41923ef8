//! What receivers and workers share ([`Shared`]: the index, the metrics, the publishers, the
//! filters, the warning throttles, the shared log) and the way to a pod's worker
//! ([`Dispatch`]: every worker's inbox, each job to the worker of its pod).
//!
//! Invariants: all jobs of one pod go to the same worker ([`worker_of`]); a receiver's push
//! never waits; the queues close when the last [`Dispatch`] goes (the receivers and the
//! handle let go), and the workers then drain them and exit.

use std::sync::Arc;
use std::time::Duration;

use kv_core::Indexer;

use super::inbox;
use super::jobs::Job;
use super::lifecycle;
use super::publishers::{worker_of, Publishers};
use super::shared_log::LogHandle;
use crate::metrics::Metrics;
use crate::warn_budget::{WarnBudget, WarnThrottle};

/// Shared by receivers and workers.
pub(super) struct Shared {
    pub(super) indexer: Arc<Indexer>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) publishers: Arc<Publishers>,
    pub(super) filter: String,
    /// `allowedModels` (empty: any).
    pub(super) allowed_models: Vec<String>,
    /// `allowedPods` patterns (empty: any).
    pub(super) allowed_pods: Vec<String>,
    pub(super) gap_fill_timeout: Duration,
    /// Permits for gap fills in flight (`maxGapFillsInFlight`), across all workers.
    pub(super) gap_fill_slots: Arc<tokio::sync::Semaphore>,
    pub(super) frame_warn: WarnThrottle,
    pub(super) decode_warn: WarnThrottle,
    pub(super) gap_fill_warn: WarnThrottle,
    pub(super) shed_warn: WarnThrottle,
    /// The budget of the warning lines that name a publisher.
    pub(super) warn_budget: WarnBudget,
    /// The links (connections, sockets) that tell whether a pod is there.
    pub(super) links: Arc<lifecycle::Links>,
    /// Grace period and idle timeout.
    pub(super) lifecycle: lifecycle::LifecycleSettings,
    /// Where messages from this replica's sockets are appended (replication on).
    pub(super) log: Option<LogHandle>,
    /// This replica's id (`received_by` of what its sockets bring).
    pub(super) replica: Arc<str>,
    /// The shared log is not being followed at its end (Redis down, the follower behind):
    /// pods heard only through it are not silent, the log is (see [`Shared::verdict`]).
    pub(super) log_stalled: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Why a pod is to be forgotten now, if it is. A pod this replica hears only through the
    /// shared log (no link of its own) is never judged idle while the log is stalled: its
    /// silence is the log's, and forgetting it would clear it on the replica that hears it
    /// live (an outage of Redis longer than `publisherIdleTimeout` did exactly that).
    pub(super) fn verdict(
        &self,
        presence: lifecycle::Presence,
        last_message: std::time::Instant,
        linked: bool,
    ) -> Option<lifecycle::ForgetReason> {
        let reason = self.lifecycle.verdict(presence, last_message)?;
        let stalled = self.log_stalled.load(std::sync::atomic::Ordering::Relaxed);
        (linked || !stalled || reason != lifecycle::ForgetReason::Idle).then_some(reason)
    }
}

/// What receivers hold: the shared state and the workers' queues. Workers do not hold it, so
/// when the receivers and the handle let go, the queues close and the workers drain and exit.
pub(super) struct Dispatch {
    pub(super) shared: Arc<Shared>,
    pub(super) workers: Vec<Arc<inbox::Inbox>>,
    pub(super) budget: Arc<inbox::Budget>,
}

impl Dispatch {
    /// Queues `job` on `pod`'s worker without waiting (a socket message may make room by
    /// dropping others of a pod past its share: counted and logged here).
    pub(super) fn push(&self, pod: &Arc<str>, job: Job) -> inbox::Pushed {
        let worker = worker_of(pod, self.workers.len());
        let metrics = &self.shared.metrics.ingest;
        metrics.queued();
        let pushed = self.workers[worker].push(pod, job);
        let dropped = pushed.over_share + pushed.over_total;
        if pushed.closed {
            metrics.dequeued();
        } else if dropped > 0 {
            metrics.dequeued_n(dropped);
            metrics.shed_n("over_share", pushed.over_share);
            metrics.shed_n("over_total", pushed.over_total);
            if let Some(suppressed) = self.shared.shed_warn.allow() {
                tracing::warn!(%pod, worker, over_share = pushed.over_share, over_total = pushed.over_total, queued_bytes = self.budget.used(), suppressed, "event queue past its byte bounds (kvEventsConfig.queueBytesPerPod, queueBytes): queued messages of the pod holding the most were dropped; its publisher is resynchronised");
            }
        }
        metrics.queue_bytes(self.budget.used());
        pushed
    }
}

impl Drop for Dispatch {
    /// The receivers and the handle let go: the workers take what is queued, then stop.
    fn drop(&mut self) {
        for inbox in &self.workers {
            inbox.close();
        }
    }
}
