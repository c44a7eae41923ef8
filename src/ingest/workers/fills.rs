//! A worker's gap fills and resyncs: the tasks that fetch what a publisher missed (a gap in
//! its sequence, or messages dropped from its queue), their reports, and the backoff of a
//! publisher whose fills fail. The publisher waits parked meanwhile; every other one applies.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::decode_batch;

use super::{FillReport, Parked, Pending, Worker, BACKOFF_MAX, BACKOFF_START, LOG_FILL_GRACE};
use crate::ingest::gap_fill;
use crate::ingest::jobs::{Dropped, GapFillRoute};
use crate::ingest::publishers::PublisherKey;
use crate::warn_budget::LineKind;

impl Worker<'_> {
    /// Some of the pod's socket messages were dropped from its queue (it passed its share):
    /// each publisher of the pod and model that is behind the dropped run is asked for what
    /// it missed, as for a gap (the shared log first, with replication); what cannot be
    /// fetched is counted as lost and the publisher is marked stale, never left silently
    /// short. The dropped messages' ranks are not known (they were not decoded): every known
    /// rank behind the run is asked, rank 0 when none is known yet.
    pub(super) fn resync(&mut self, dropped: Dropped) {
        let shared = self.shared;
        let mut ranks = shared.publishers.ranks_of(&dropped.pod, &dropped.model);
        if ranks.is_empty() {
            ranks.push(0);
        }
        let last_dropped = dropped.seqs.1;
        let mut counted = false;
        for rank in ranks {
            let key = PublisherKey::new(dropped.pod.clone(), dropped.model.clone(), rank);
            if !counted {
                self.state(&key, |s| s.messages_dropped += dropped.messages);
                counted = true;
            }
            if let Some(parked) = self.parked.get_mut(&key) {
                // A fill is in flight from an earlier point: it fetches the rest too.
                parked.wanted.end = parked.wanted.end.max(last_dropped + 1);
                continue;
            }
            let from = self.state(&key, |s| s.last_seq.map_or(0, |last| last + 1));
            if from > last_dropped {
                continue; // this rank is past the run (it was another rank's)
            }
            let wanted = from..last_dropped + 1;
            let closed_by_log = Arc::new(AtomicBool::new(false));
            match self.start_fill(&dropped.route, &key, wanted.clone(), closed_by_log.clone()) {
                Some(fill) => {
                    self.shared.metrics.ingest.resync("started");
                    self.parked.insert(
                        key,
                        Parked {
                            fill,
                            wanted,
                            count_lost: true,
                            messages: VecDeque::new(),
                            closed_by_log,
                        },
                    );
                }
                None => {
                    self.shared.metrics.ingest.resync("unavailable");
                    self.lost(&key, dropped.messages);
                }
            }
        }
    }

    /// Starts a gap-fill task for `wanted`, or says why not (and counts it): no gap-fill
    /// endpoint, the publisher in backoff, or every slot taken.
    pub(super) fn start_fill(
        &mut self,
        route: &GapFillRoute,
        key: &PublisherKey,
        wanted: Range<u64>,
        closed_by_log: Arc<AtomicBool>,
    ) -> Option<u64> {
        let metrics = &self.shared.metrics.ingest;
        let Some(endpoint) = route.endpoint(&key.engine.pod, key.engine.dp_rank) else {
            metrics.gap_fill("unavailable");
            return None;
        };
        let now = Instant::now();
        if self.state(key, |s| s.backoff_until.is_some_and(|t| now < t)) {
            metrics.gap_fill("backoff");
            return None;
        }
        let Ok(permit) = self.shared.gap_fill_slots.clone().try_acquire_owned() else {
            metrics.gap_fill("throttled");
            return None;
        };
        self.next_fill += 1;
        let fill = self.next_fill;
        let reports = self.reports.clone();
        let timeout = self.shared.gap_fill_timeout;
        let key = key.clone();
        let grace = if self.shared.log.is_some() {
            LOG_FILL_GRACE
        } else {
            Duration::ZERO
        };
        tokio::spawn(async move {
            if !grace.is_zero() {
                tokio::time::sleep(grace).await;
                if closed_by_log.load(Ordering::Relaxed) {
                    return;
                }
            }
            let started = Instant::now();
            let result = gap_fill::fetch(&endpoint, wanted.start, timeout).await;
            drop(permit);
            let _ = reports.send(FillReport {
                key,
                fill,
                result,
                elapsed: started.elapsed(),
            });
        });
        Some(fill)
    }

    /// A gap-fill task reported: apply what it fetched, then what was parked.
    pub(super) fn settle(&mut self, report: FillReport) {
        let metrics = &self.shared.metrics.ingest;
        let Some(parked) = self.parked.get(&report.key) else {
            return; // given up earlier
        };
        if parked.fill != report.fill {
            return;
        }
        let Some(parked) = self.parked.remove(&report.key) else {
            return;
        };
        let key = report.key;
        match report.result {
            Ok(batches) => {
                metrics.gap_fill("ok");
                self.state(&key, |s| {
                    s.gap_fill_failures = 0;
                    s.backoff_until = None;
                });
                let mut applied = 0u64;
                for (seq, payload) in batches {
                    if !parked.wanted.contains(&seq) {
                        continue;
                    }
                    match decode_batch(&payload) {
                        Ok(batch) => {
                            let message = Pending {
                                seq,
                                payload,
                                batch,
                                from_log: None,
                                link: None,
                            };
                            self.apply(&key, message);
                            applied += 1;
                        }
                        Err(e) => metrics.decode_error(e.reason()),
                    }
                }
                if self.shared.warn_budget.allow(LineKind::GapFilled) {
                    tracing::info!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, from = parked.wanted.start, to = parked.wanted.end, applied, elapsed = ?report.elapsed, "filled a gap from the publisher's replay buffer");
                }
                if parked.count_lost {
                    let wanted = parked.wanted.end - parked.wanted.start;
                    self.lost(&key, wanted.saturating_sub(applied));
                }
            }
            Err(e) => {
                metrics.gap_fill(e.label());
                let failures = self.back_off(&key);
                if let Some(suppressed) = self.shared.gap_fill_warn.allow() {
                    tracing::warn!(pod = %key.engine.pod, model = %key.model, error = %e, failures, suppressed, "gap fill failed; the missed events are lost and this publisher is backed off");
                }
                self.lose(&key, &parked);
            }
        }
        self.release(&key, parked.messages);
    }

    /// Records a failed (or abandoned) gap fill: no fill is asked of `key` for 1 s, doubling
    /// with each failure in a row up to 60 s. Returns the failures in a row.
    pub(super) fn back_off(&self, key: &PublisherKey) -> u32 {
        self.state(key, |s| {
            s.gap_fill_failures = s.gap_fill_failures.saturating_add(1);
            let backoff = BACKOFF_START
                .saturating_mul(1 << (s.gap_fill_failures - 1).min(6))
                .min(BACKOFF_MAX);
            s.backoff_until = Some(Instant::now() + backoff);
            s.gap_fill_failures
        })
    }

    /// Counts a parked hole as lost (when it is a gap).
    pub(super) fn lose(&self, key: &PublisherKey, parked: &Parked) {
        if parked.count_lost {
            self.lost(key, parked.wanted.end - parked.wanted.start);
        }
    }
}
