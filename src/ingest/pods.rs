//! The pods as a whole: the admin API's view of them ([`Pods`]: their publishers and presence
//! for ListPods, ClearPod) and the sweeper that proposes to forget the pods that left or fell
//! silent ([`sweep`]). Both reach a pod through its worker, in order with its messages.

use std::sync::{Arc, Weak};
use std::time::Instant;

use thiserror::Error;
use tokio::sync::{oneshot, watch};

use super::dispatch::Dispatch;
use super::jobs::{ClearOrigin, Job};
use super::lifecycle::{self, LifecycleSettings, Presence};
use super::publishers::Publishers;

/// The admin API's view of the pods: the publishers with what tells whether their pods are
/// there (what ListPods reports), and the way to clear one (ClearPod).
#[derive(Clone)]
pub struct Pods {
    /// Publisher states.
    pub publishers: Arc<Publishers>,
    pub(super) links: Arc<lifecycle::Links>,
    pub(super) lifecycle: lifecycle::LifecycleSettings,
    /// The workers' queues, while ingestion runs (held weakly: the admin API must not keep the
    /// queues open past shutdown).
    pub(super) dispatch: Weak<Dispatch>,
}

/// Why an admin clear was not carried out.
#[derive(Debug, Error)]
pub enum ClearError {
    /// Ingestion has stopped (the daemon is shutting down).
    #[error("event ingestion has stopped")]
    Stopped,
}

impl Pods {
    /// Forgets `pod` in `model` through the pod's worker, in order with its messages: its
    /// blocks, engines, publisher states and parked gap fills; with a shared log, every replica
    /// is told. Returns the memberships removed.
    pub async fn clear_pod(&self, model: Arc<str>, pod: Arc<str>) -> Result<usize, ClearError> {
        let dispatch = self.dispatch.upgrade().ok_or(ClearError::Stopped)?;
        let (reply, answer) = oneshot::channel();
        let job = Job::ClearPod {
            model,
            pod: pod.clone(),
            origin: ClearOrigin::Admin(reply),
        };
        if dispatch.push(&pod, job).closed {
            return Err(ClearError::Stopped);
        }
        drop(dispatch);
        answer.await.map_err(|_| ClearError::Stopped)
    }

    /// Every pod known, with its presence and when it last spoke.
    pub fn presence(
        &self,
    ) -> std::collections::HashMap<Arc<str>, (lifecycle::Presence, std::time::Instant)> {
        let mut out = std::collections::HashMap::new();
        self.publishers
            .each_presence(&self.lifecycle, &self.links, |pod, presence, last, _| {
                out.insert(pod.clone(), (presence, last));
            });
        out
    }
}

/// Every sweep interval: proposes to each pod's worker to forget the pods past their grace
/// period or idle timeout, refreshes the publisher gauges, and prints the log budget's
/// summary every window.
pub(super) async fn sweep(
    dispatch: Arc<Dispatch>,
    settings: LifecycleSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    let shared = dispatch.shared.clone();
    let interval = settings.sweep_interval();
    let mut last_summary = Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let mut counts = [0u64; 3];
        let mut proposals = Vec::new();
        shared
            .publishers
            .each_presence(&settings, &shared.links, |pod, presence, last, linked| {
                counts[match presence {
                    Presence::Live => 0,
                    Presence::Idle(_) => 1,
                    Presence::Gone(_) => 2,
                }] += 1;
                if let Some(reason) = shared.verdict(presence, last, linked) {
                    proposals.push((pod.clone(), reason));
                }
            });
        shared.metrics.ingest.publishers(counts);
        for (pod, reason) in proposals {
            if dispatch
                .push(&pod.clone(), Job::Forget { pod, reason })
                .closed
            {
                return;
            }
        }
        let now = Instant::now();
        shared
            .links
            .prune(settings.grace_period.saturating_mul(2), now);
        if now.duration_since(last_summary) >= crate::warn_budget::WINDOW {
            last_summary = now;
            shared.warn_budget.summarize();
        }
    }
}
