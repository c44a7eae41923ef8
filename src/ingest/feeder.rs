//! The shared log's way in: the replication follower hands log entries to the workers through
//! a [`Feeder`] (each to its pod's worker, in log order, waiting for room rather than dropping),
//! pauses them for a snapshot, and says whether the log is flowing (a stalled log is not the
//! silence of the pods heard through it).

use std::sync::Arc;

use kv_core::Indexer;
use tokio::sync::{mpsc, watch};

use super::dispatch::Dispatch;
use super::jobs::{ClearOrigin, Job, Message, PauseGate, Via};
use super::publishers::{worker_of, PublisherKey, Publishers};
use super::sequence;
use super::shared_log::{LogEntry, Stamp};

/// Every worker paused; they resume when this is dropped.
pub struct Paused {
    _resume: watch::Sender<bool>,
}

/// Hands shared-log entries to the workers (each to its pod's worker, in log order), and
/// pauses them all for a snapshot.
#[derive(Clone)]
pub struct Feeder {
    pub(super) dispatch: Arc<Dispatch>,
}

impl Feeder {
    /// Queues `entry` (appended by `replica`) for its pod's worker, waiting for room (the log
    /// is never shed: a replica that skipped an entry would differ from the others). `false`
    /// once the workers are gone.
    pub async fn feed(&self, replica: Arc<str>, entry: LogEntry) -> bool {
        let (pod, job) = match entry {
            LogEntry::Message {
                pod,
                model,
                seq,
                payload,
                ..
            } => (
                pod.clone(),
                Job::Message(Message {
                    pod,
                    model,
                    seq,
                    payload,
                    via: Via::Log(replica),
                }),
            ),
            LogEntry::ClearPod { model, pod } => (
                pod.clone(),
                Job::ClearPod {
                    model,
                    pod,
                    origin: ClearOrigin::Log,
                },
            ),
            // Recorded routings touch no publisher state: made here, as RecordRouting does.
            LogEntry::Speculate {
                model,
                pod,
                rank,
                hashes,
            } => {
                let shared = &self.dispatch.shared;
                let now = std::time::Instant::now();
                match shared
                    .indexer
                    .record_routing(&model, &pod, rank, hashes, now)
                {
                    Ok(recorded) => shared.metrics.speculation.routing_recorded(recorded),
                    // The model is not indexed here (e.g. maxModels): nothing to speculate on.
                    Err(e) => {
                        tracing::debug!(%model, %pod, error = %e, "recorded routing from the log not applied")
                    }
                }
                return true;
            }
        };
        let inbox = &self.dispatch.workers[worker_of(&pod, self.dispatch.workers.len())];
        let metrics = &self.dispatch.shared.metrics.ingest;
        metrics.queued();
        let sent = inbox.feed(&pod, job).await;
        if !sent {
            metrics.dequeued();
        }
        metrics.queue_bytes(self.dispatch.budget.used());
        sent
    }

    /// Whether the message `seq` of publisher (`pod`, `model`, `stamp.rank`) is one the
    /// workers would drop (already applied, or stale): then the follower need not decode it.
    /// Safe to ask early: a publisher's state only moves forward, so a message that is
    /// behind it now stays behind.
    pub fn already_applied(
        &self,
        pod: &Arc<str>,
        model: &Arc<str>,
        seq: u64,
        stamp: Stamp,
    ) -> bool {
        let key = PublisherKey::new(pod.clone(), model.clone(), stamp.rank);
        let last = self.dispatch.shared.publishers.last_applied(&key);
        matches!(
            sequence::SeqOutcome::classify_timed(last, seq, stamp.ts),
            sequence::SeqOutcome::Duplicate | sequence::SeqOutcome::Stale
        )
    }

    /// Pauses every worker once it has taken every log entry fed before (messages from
    /// sockets may come either side); returns once all have stopped. `None` when the workers
    /// are gone.
    pub async fn pause(&self) -> Option<Paused> {
        let n = self.dispatch.workers.len();
        let (arrived, mut arrivals) = mpsc::channel(n);
        let (resume, resume_rx) = watch::channel(false);
        for inbox in &self.dispatch.workers {
            inbox.log_taken().await;
            let gate = PauseGate {
                arrived: arrived.clone(),
                resume: resume_rx.clone(),
            };
            if !inbox.push_urgent(Job::Pause(gate)) {
                return None;
            }
        }
        drop(arrived);
        for _ in 0..n {
            arrivals.recv().await?;
        }
        Some(Paused { _resume: resume })
    }

    /// The follower stopped reading the log at its end (Redis down, or it fell behind): pods
    /// heard only through the log are not judged idle meanwhile.
    pub fn log_stalled(&self) {
        let shared = &self.dispatch.shared;
        shared
            .log_stalled
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The follower reads the log at its end again. After a stall, the pods heard only through
    /// the log count their silence from now: the stall was the log's, not theirs.
    pub fn log_flowing(&self) {
        let shared = &self.dispatch.shared;
        if shared
            .log_stalled
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            shared.publishers.touch_unlinked();
        }
    }

    /// The index the workers apply to.
    pub fn indexer(&self) -> &Arc<Indexer> {
        &self.dispatch.shared.indexer
    }

    /// The publishers' states.
    pub fn publishers(&self) -> &Arc<Publishers> {
        &self.dispatch.shared.publishers
    }
}
