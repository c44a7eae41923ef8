//! A worker's inbox: one FIFO lane per pod, served in turn, bounded by bytes rather than by a
//! count of messages (a burst of many small messages is not a reason to lose any).
//!
//! Invariants:
//! - a receiver's push never waits and never refuses: the newest message of a pod is always
//!   queued, so a publisher's stream keeps revealing where it stands;
//! - a pod's lane holds at most `queueBytesPerPod` beside its newest message; past that, its
//!   queued socket messages are dropped newest-first (never across a clear or a shared-log
//!   entry) and one [`Dropped`] marker per run takes their place, so the worker resynchronises
//!   that publisher when it gets there (the workers): only the pod that exceeds its
//!   share loses anything, and never silently;
//! - all inboxes together hold at most `queueBytes`; past it, the lane of the inbox holding the
//!   most is cut the same way (its newest message too, when nothing else is left);
//! - the worker takes one job per lane in turn, so a pod with a long lane delays another pod's
//!   message by at most one of its own per round;
//! - shared-log entries ([`Inbox::feed`]) wait for room instead of being dropped (a replica
//!   that skipped one would differ from the others); admin and sweeper jobs are never dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::jobs::{ClearOrigin, Dropped, Job, Via};

/// What a queued job costs beside its payload (its record, the pod and model names).
const JOB_OVERHEAD: usize = 128;

/// The byte bounds shared by every worker's inbox.
pub(super) struct Budget {
    /// `queueBytes`: all inboxes together.
    limit: usize,
    /// `queueBytesPerPod`: one pod's lane beside its newest message.
    per_pod: usize,
    /// Bytes queued now, all inboxes together.
    used: AtomicUsize,
}

impl Budget {
    pub(super) fn new(limit: usize, per_pod: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            per_pod: per_pod.max(1),
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes queued now, all inboxes together.
    pub(super) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// What a push did beside queueing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pushed {
    /// Messages dropped because their pod's lane passed its share.
    pub(super) over_share: u64,
    /// Messages dropped because all lanes together passed `queueBytes`.
    pub(super) over_total: u64,
    /// The inbox is closed: the job was not queued.
    pub(super) closed: bool,
}

struct Queued {
    job: Job,
    bytes: usize,
}

#[derive(Default)]
struct Lane {
    jobs: VecDeque<Queued>,
    bytes: usize,
}

#[derive(Default)]
struct Lanes {
    by_pod: HashMap<Arc<str>, Lane>,
    /// Pods with queued jobs, in the order they are served.
    turn: VecDeque<Arc<str>>,
    /// Jobs served before any lane (a pause).
    urgent: VecDeque<Job>,
    /// Shared-log jobs queued and not yet taken.
    log_jobs: usize,
    closed: bool,
}

/// One worker's inbox.
pub(super) struct Inbox {
    lanes: Mutex<Lanes>,
    budget: Arc<Budget>,
    /// Wakes the worker.
    ready: Notify,
    /// Wakes whoever waits for room or for the shared-log jobs to be taken.
    taken: Notify,
}

/// What a job costs in the budget.
fn cost(job: &Job) -> usize {
    match job {
        Job::Message(m) => JOB_OVERHEAD + m.payload.len(),
        _ => JOB_OVERHEAD,
    }
}

/// Whether a message came from this replica's socket (the only kind ever dropped).
fn droppable_via(via: &Via) -> bool {
    matches!(via, Via::Socket(..))
}

fn from_log(job: &Job) -> bool {
    match job {
        Job::Message(m) => matches!(m.via, Via::Log(_)),
        Job::ClearPod { origin, .. } => matches!(origin, ClearOrigin::Log),
        _ => false,
    }
}

impl Lane {
    /// Drops socket messages from the back (behind the newest when `keep_newest`) until
    /// `excess` bytes are freed or the next job is not droppable; the dropped become one
    /// marker (merged with a marker already there). Returns the messages dropped and the
    /// bytes freed.
    fn cut(&mut self, keep_newest: bool, excess: usize) -> (u64, usize) {
        let newest = match keep_newest {
            true => match self.jobs.pop_back() {
                Some(q) => Some(q),
                None => return (0, 0),
            },
            false => None,
        };
        let (mut dropped, mut removed) = (0u64, 0usize);
        let mut marker: Option<Dropped> = None;
        while removed < excess + JOB_OVERHEAD {
            let fits = |d: &Dropped, model: &Arc<str>| d.model == *model;
            let take = match self.jobs.back().map(|q| &q.job) {
                Some(Job::Message(m)) if droppable_via(&m.via) => {
                    marker.as_ref().is_none_or(|d| fits(d, &m.model))
                }
                Some(Job::Dropped(older)) => marker.as_ref().is_none_or(|d| fits(d, &older.model)),
                _ => false,
            };
            if !take {
                break;
            }
            let Some(q) = self.jobs.pop_back() else { break };
            removed += q.bytes;
            match q.job {
                Job::Message(m) => {
                    dropped += 1;
                    let run = Dropped::of(m);
                    match &mut marker {
                        Some(d) => d.absorb(run),
                        None => marker = Some(run),
                    }
                }
                Job::Dropped(older) => match &mut marker {
                    Some(d) => d.absorb(older),
                    None => marker = Some(older),
                },
                _ => unreachable!("only messages and markers are taken"),
            }
        }
        // A marker left just before this run is the same resync: one marker for both.
        if let Some(d) = &mut marker {
            if matches!(self.jobs.back(), Some(Queued { job: Job::Dropped(older), .. }) if older.model == d.model)
            {
                if let Some(Queued {
                    job: Job::Dropped(older),
                    bytes,
                }) = self.jobs.pop_back()
                {
                    removed += bytes;
                    d.absorb(older);
                }
            }
        }
        let mut added = 0;
        if let Some(d) = marker {
            self.jobs.push_back(Queued {
                job: Job::Dropped(d),
                bytes: JOB_OVERHEAD,
            });
            added = JOB_OVERHEAD;
        }
        if let Some(newest) = newest {
            self.jobs.push_back(newest);
        }
        let freed = removed.saturating_sub(added);
        self.bytes -= freed;
        (dropped, freed)
    }
}

impl Inbox {
    pub(super) fn new(budget: Arc<Budget>) -> Self {
        Self {
            lanes: Mutex::new(Lanes::default()),
            budget,
            ready: Notify::new(),
            taken: Notify::new(),
        }
    }

    /// Queues `job` on `pod`'s lane without waiting; a socket message past its pod's share or
    /// past `queueBytes` makes room by dropping (see the module's invariants).
    pub(super) fn push(&self, pod: &Arc<str>, job: Job) -> Pushed {
        let mut pushed = Pushed::default();
        let bytes = cost(&job);
        let log = from_log(&job);
        {
            let mut lanes = self.lanes.lock();
            if lanes.closed {
                pushed.closed = true;
                return pushed;
            }
            let lanes = &mut *lanes;
            if log {
                lanes.log_jobs += 1;
            }
            let lane = lanes.by_pod.entry(pod.clone()).or_default();
            if lane.jobs.is_empty() {
                lanes.turn.push_back(pod.clone());
            }
            lane.jobs.push_back(Queued { job, bytes });
            lane.bytes += bytes;
            self.budget.used.fetch_add(bytes, Ordering::Relaxed);
            let newest = lane.jobs.back().map_or(0, |q| q.bytes);
            if lane.bytes - newest > self.budget.per_pod {
                let (dropped, freed) = lane.cut(true, lane.bytes - newest - self.budget.per_pod);
                self.budget.used.fetch_sub(freed, Ordering::Relaxed);
                pushed.over_share = dropped;
            }
            let used = self.budget.used();
            if used > self.budget.limit {
                pushed.over_total = self.cut_fattest(lanes, used - self.budget.limit);
            }
        }
        self.ready.notify_one();
        pushed
    }

    /// Frees `excess` bytes from the lanes holding the most: behind their newest message
    /// first, then the newest too. Returns the messages dropped.
    fn cut_fattest(&self, lanes: &mut Lanes, excess: usize) -> u64 {
        let mut dropped = 0;
        let mut left = excess;
        for keep_newest in [true, false] {
            while left > 0 {
                let Some(lane) = lanes.by_pod.values_mut().max_by_key(|l| l.bytes) else {
                    break;
                };
                let (n, freed) = lane.cut(keep_newest, left);
                self.budget.used.fetch_sub(freed, Ordering::Relaxed);
                dropped += n;
                if freed == 0 {
                    break;
                }
                left = left.saturating_sub(freed);
            }
        }
        dropped
    }

    /// Queues a shared-log job on `pod`'s lane once all inboxes are under `queueBytes` (it is
    /// never dropped). `false` when the inbox is closed.
    pub(super) async fn feed(&self, pod: &Arc<str>, job: Job) -> bool {
        loop {
            let room = self.taken.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.budget.used() <= self.budget.limit || self.lanes.lock().closed {
                break;
            }
            room.await;
        }
        !self.push(pod, job).closed
    }

    /// Queues `job` before every lane (a pause). `false` when the inbox is closed.
    pub(super) fn push_urgent(&self, job: Job) -> bool {
        {
            let mut lanes = self.lanes.lock();
            if lanes.closed {
                return false;
            }
            lanes.urgent.push_back(job);
        }
        self.ready.notify_one();
        true
    }

    /// Returns once the worker has taken every shared-log job queued so far.
    pub(super) async fn log_taken(&self) {
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            taken.as_mut().enable();
            let done = {
                let lanes = self.lanes.lock();
                lanes.log_jobs == 0 || lanes.closed
            };
            if done {
                return;
            }
            taken.await;
        }
    }

    /// Stops intake: the worker takes what is queued, then [`Inbox::next`] answers `None`.
    pub(super) fn close(&self) {
        self.lanes.lock().closed = true;
        self.ready.notify_one();
        self.taken.notify_waiters();
    }

    /// The next job: a pause first, then one job of the next lane in turn. `None` once the
    /// inbox is closed and empty.
    pub(super) async fn next(&self) -> Option<Job> {
        loop {
            if let Some(job) = self.take() {
                self.taken.notify_waiters();
                return Some(job);
            }
            if self.lanes.lock().closed {
                return None;
            }
            self.ready.notified().await;
        }
    }

    fn take(&self) -> Option<Job> {
        let mut lanes = self.lanes.lock();
        let lanes = &mut *lanes;
        if let Some(job) = lanes.urgent.pop_front() {
            return Some(job);
        }
        // Every pod in turn has a lane with a job (a lane leaves the turn when it empties).
        while let Some(pod) = lanes.turn.pop_front() {
            let Some(lane) = lanes.by_pod.get_mut(&pod) else {
                continue;
            };
            let Some(q) = lane.jobs.pop_front() else {
                lanes.by_pod.remove(&pod);
                continue;
            };
            lane.bytes -= q.bytes;
            self.budget.used.fetch_sub(q.bytes, Ordering::Relaxed);
            if lane.jobs.is_empty() {
                lanes.by_pod.remove(&pod);
                // A burst of many pods leaves a large table behind: give it back.
                if lanes.by_pod.capacity() > 1024
                    && lanes.by_pod.len() < lanes.by_pod.capacity() / 4
                {
                    lanes.by_pod.shrink_to_fit();
                }
            } else {
                lanes.turn.push_back(pod);
            }
            if from_log(&q.job) {
                lanes.log_jobs -= 1;
            }
            return Some(q.job);
        }
        None
    }
}

#[cfg(test)]
#[path = "inbox_tests.rs"]
mod tests;
