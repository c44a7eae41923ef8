//! The workers: each owns the publishers of the pods hashed to it, so one publisher's messages
//! are decoded, sequenced ([`SeqOutcome`]) and applied in order.
//!
//! Gap fill never runs inline. When a publisher's stream has a hole, the worker starts a gap-fill
//! task (if a slot is free and the publisher is not in backoff) and parks that publisher: its
//! next messages wait, decoded, in a bounded buffer ([`MAX_PARKED`]) while the worker goes on
//! with every other publisher. When the task reports back (it always does, within
//! `replayTimeoutMs`), the fetched batches are applied, then the parked ones, in sequence order.
//! A buffer that overflows gives up waiting: the hole is counted as lost and the parked messages
//! are applied.
//!
//! A worker yields between jobs once its cooperative budget is spent (Tokio's, per task),
//! so the receivers and the other workers on the ingest runtime ([`super::runtime`]) keep
//! their turns while an inbox is full.
//!
//! Messages from the shared log ([`Via::Log`]) are sequenced by the same state: never
//! gap-filled (the replica that received them did that), never appended again.
//!
//! Forgetting a pod happens here and nowhere else (an admin clear, another replica's clear from
//! the log, the sweeper's proposal), so it is ordered with the pod's messages and drops the
//! pod's parked gap fills: a fill that reports after the clear finds nobody waiting.
//!
//! A marker of messages dropped from the pod's queue ([`Job::Dropped`]) is a hole too: the
//! publisher is resynchronised the same way ([`fills`]: the fill tasks, their reports, backoff).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kv_core::{decode_batch, EventBatch, KeyMode};
use tokio::sync::mpsc;

mod fills;

use super::dispatch::Shared;
use super::gap_fill::GapFillError;
use super::inbox::Inbox;
use super::jobs::{ClearOrigin, GapFillRoute, Job, Message, Via};
use super::lifecycle::{ForgetReason, Link};
use super::publishers::{PublisherKey, PublisherState};
use super::sequence::SeqOutcome;
use super::shared_log::{LogEntry, Stamp};
use crate::warn_budget::LineKind;

/// Messages a publisher may park while its gap is being filled; beyond, the fill is given up.
pub(super) const MAX_PARKED: usize = 4096;

/// The first backoff after a failed gap fill; it doubles with each failure in a row.
const BACKOFF_START: Duration = Duration::from_secs(1);
/// The longest backoff.
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// With replication on, how long a gap waits for the log (another replica may have received
/// the missing messages) before the publisher's replay socket is asked.
const LOG_FILL_GRACE: Duration = Duration::from_millis(100);

/// A publisher waiting for its gap fill.
struct Parked {
    /// Matches the task's report (a given-up fill may still report).
    fill: u64,
    /// The hole being filled.
    wanted: Range<u64>,
    /// Whether the hole counts as lost when it cannot be filled (a gap; not a late join).
    count_lost: bool,
    /// Messages that arrived meanwhile, in arrival order.
    messages: VecDeque<Pending>,
    /// Set when the replication log closed the hole first: the fill task, still in its
    /// grace delay, then never asks the publisher.
    closed_by_log: Arc<AtomicBool>,
}

/// A decoded message on its way to the index.
struct Pending {
    seq: u64,
    payload: Bytes,
    batch: EventBatch,
    /// `None`: this replica's socket; `Some(replica)`: the replication log.
    from_log: Option<Arc<str>>,
    /// What tells whether the pod is there (messages from this replica's socket).
    link: Option<Link>,
}

/// A gap-fill task's report.
struct FillReport {
    key: PublisherKey,
    fill: u64,
    result: Result<Vec<(u64, Bytes)>, GapFillError>,
    elapsed: Duration,
}

/// One worker's state: the publishers it has parked.
struct Worker<'a> {
    index: usize,
    shared: &'a Shared,
    parked: HashMap<PublisherKey, Parked>,
    next_fill: u64,
    reports: mpsc::UnboundedSender<FillReport>,
}

/// Runs worker `index` until its queue closes, then settles what is still parked.
pub(super) async fn run(index: usize, inbox: Arc<Inbox>, shared: Arc<Shared>) {
    let (reports, mut report_rx) = mpsc::unbounded_channel();
    let mut worker = Worker {
        index,
        shared: &shared,
        parked: HashMap::new(),
        next_fill: 0,
        reports,
    };
    loop {
        tokio::select! {
            biased;
            Some(report) = report_rx.recv() => worker.settle(report),
            job = inbox.next() => match job {
                Some(Job::Message(message)) => {
                    shared.metrics.ingest.dequeued();
                    worker.handle(message);
                }
                Some(Job::ClearPod { model, pod, origin }) => {
                    shared.metrics.ingest.dequeued();
                    worker.clear(model, pod, origin);
                }
                Some(Job::Forget { pod, reason }) => {
                    shared.metrics.ingest.dequeued();
                    worker.forget_if_still(&pod, reason);
                }
                // A marker stands for messages already counted out when they were dropped.
                Some(Job::Dropped(dropped)) => worker.resync(dropped),
                Some(Job::Pause(gate)) => gate.hold().await,
                None => break,
            },
        }
        // The inbox answers at once while it holds work, so without this a busy worker
        // would keep its thread: spend one unit of Tokio's cooperative budget per job, and
        // give the thread to the runtime's other tasks (receivers, other workers, gap fills)
        // when the budget is spent.
        tokio::task::coop::consume_budget().await;
    }
    // Shutdown: wait for the fills in flight (each ends within its timeout), then stop.
    while !worker.parked.is_empty() {
        match report_rx.recv().await {
            Some(report) => worker.settle(report),
            None => break,
        }
    }
}

impl Worker<'_> {
    fn state<R>(&self, key: &PublisherKey, f: impl FnOnce(&mut PublisherState) -> R) -> R {
        self.shared.publishers.with_state(key, f)
    }

    /// The sweeper proposes to forget `pod`: done if it is still gone (or idle) now, in order
    /// with its messages; with replication, every replica is told through the log.
    fn forget_if_still(&mut self, pod: &Arc<str>, reason: ForgetReason) {
        let shared = self.shared;
        let still = {
            let shard = shared.publishers.shards[self.index].lock();
            shard.get(pod).is_some_and(|entry| {
                let presence = shared.lifecycle.presence(
                    &shared.links,
                    entry.link.as_ref(),
                    entry.last_message,
                );
                shared.verdict(presence, entry.last_message, entry.link.is_some()) == Some(reason)
            })
        };
        if !still {
            return;
        }
        let models = shared.publishers.models_of(pod);
        if let Some(log) = &shared.log {
            for model in &models {
                log.append(LogEntry::ClearPod {
                    model: model.clone(),
                    pod: pod.clone(),
                });
            }
        }
        self.forget(pod, &models, reason.label(), Some(reason));
    }

    /// Clears `pod` in `model` as `origin` asked: an admin request is appended to the shared
    /// log (every replica clears it too) and answered with the memberships removed.
    fn clear(&mut self, model: Arc<str>, pod: Arc<str>, origin: ClearOrigin) {
        let reply = match origin {
            ClearOrigin::Log => None,
            ClearOrigin::Admin(reply) => {
                if let Some(log) = &self.shared.log {
                    log.append(LogEntry::ClearPod {
                        model: model.clone(),
                        pod: pod.clone(),
                    });
                }
                Some(reply)
            }
        };
        let removed = self.forget(&pod, std::slice::from_ref(&model), "cleared", None);
        match reply {
            Some(reply) => {
                tracing::info!(%model, %pod, removed, "pod cleared by admin request");
                // The requester may have gone (its deadline passed): the clear stands.
                let _ = reply.send(removed);
            }
            None if self.shared.warn_budget.allow(LineKind::Forgotten) => {
                tracing::info!(%model, %pod, removed, "pod cleared by another replica (an admin request, or the pod gone or idle there), through the shared log");
            }
            None => {}
        }
    }

    /// Forgets `pod` in `models`: blocks, engines, publisher states, parked gap fills, per-pod
    /// series; one log line (under the budget) when the sweeper asked. Returns the memberships
    /// removed.
    fn forget(
        &mut self,
        pod: &Arc<str>,
        models: &[Arc<str>],
        label: &'static str,
        reason: Option<ForgetReason>,
    ) -> usize {
        let shared = self.shared;
        // A fill in flight for the pod reports to nobody.
        self.parked
            .retain(|key, _| !(key.engine.pod == *pod && models.contains(&key.model)));
        let mut removed = 0;
        for model in models {
            removed += shared.indexer.remove_pod(model, pod);
            shared.publishers.forget_pod(model, pod);
        }
        shared.metrics.ingest.forgotten(pod, models, label);
        // A clear is logged by its caller.
        let Some(reason) = reason else {
            return removed;
        };
        if shared.warn_budget.allow(LineKind::Forgotten) {
            match reason {
                ForgetReason::Gone => {
                    tracing::info!(%pod, removed, grace = ?shared.lifecycle.grace_period, "pod forgotten: gone for the grace period (publisherGracePeriod)")
                }
                ForgetReason::Idle => {
                    tracing::info!(%pod, removed, idle_timeout = ?shared.lifecycle.idle_timeout, "pod forgotten: silent for the idle timeout (publisherIdleTimeout)")
                }
            }
        }
        removed
    }

    fn handle(&mut self, job: Message) {
        let metrics = &self.shared.metrics.ingest;
        let batch = match decode_batch(&job.payload) {
            Ok(b) => b,
            Err(e) => {
                metrics.decode_error(e.reason());
                if let Some(suppressed) = self.shared.decode_warn.allow() {
                    tracing::warn!(pod = %job.pod, model = %job.model, seq = job.seq, error = %e, suppressed, "undecodable KV event payload dropped");
                }
                return;
            }
        };
        let rank = match batch.rank() {
            Ok(rank) => rank,
            Err(e) => {
                // No publisher to sequence it under: dropped and counted against the pod.
                metrics.rank_error(&job.pod);
                metrics.dropped("rank_out_of_range", stored_blocks(&batch));
                if self.shared.warn_budget.allow(LineKind::Dropped) {
                    tracing::warn!(pod = %job.pod, model = %job.model, seq = job.seq, error = %e, "KV event message dropped: its data-parallel rank is out of range (a broken publisher)");
                }
                return;
            }
        };
        let key = PublisherKey::new(job.pod.clone(), job.model.clone(), rank);
        let (gap_fill, from_log, link) = match job.via {
            Via::Socket(route, link) => (Some(route), None, link),
            Via::Log(replica) => (None, Some(replica), None),
        };
        let message = Pending {
            seq: job.seq,
            payload: job.payload,
            batch,
            from_log,
            link,
        };
        if let Some(parked) = self.parked.get_mut(&key) {
            if message.from_log.is_some() && message.seq == parked.wanted.start {
                // The log brings the next missing message: apply it, and stop waiting for the
                // fill once the hole is closed.
                parked.wanted.start += 1;
                let closed = parked.wanted.is_empty();
                self.apply(&key, message);
                if closed {
                    if let Some(parked) = self.parked.remove(&key) {
                        parked.closed_by_log.store(true, Ordering::Relaxed);
                        metrics.gap_fill("from_log");
                        self.release(&key, parked.messages);
                    }
                }
                return;
            }
            if parked.messages.len() < MAX_PARKED {
                parked.messages.push_back(message);
                return;
            }
            // The fill takes too long for this publisher's traffic: stop waiting for it, and
            // back the publisher off as if the fill had failed.
            if let Some(parked) = self.parked.remove(&key) {
                metrics.gap_fill("abandoned");
                self.back_off(&key);
                self.lose(&key, &parked);
                self.release(&key, parked.messages);
            }
        }
        self.sequence(gap_fill.as_ref(), key, message);
    }

    /// Sequences one message of `key` and applies it; with a gap-fill route, a hole before it
    /// starts a gap fill (and parks the message) instead of being counted as lost.
    fn sequence(&mut self, gap_fill: Option<&GapFillRoute>, key: PublisherKey, message: Pending) {
        let metrics = &self.shared.metrics.ingest;
        let seq = message.seq;
        let last_applied = self.state(&key, |s| s.last_seq.map(|seq| (seq, s.last_ts)));
        let last = last_applied.map(|(seq, _)| seq);
        // Two paths (replication) need the timestamps to order a publisher's messages.
        let outcome = if self.shared.log.is_some() {
            SeqOutcome::classify_timed(last_applied, seq, message.batch.ts)
        } else {
            SeqOutcome::classify(last, seq)
        };
        let hole = match &outcome {
            SeqOutcome::Next => None,
            SeqOutcome::Duplicate => {
                metrics.skipped("duplicate", 1);
                return;
            }
            SeqOutcome::Stale => {
                metrics.skipped("stale", 1);
                return;
            }
            // Joined late (daemon start, slow joiner): fetch what the buffer still has.
            SeqOutcome::First { missed } => missed.clone().map(|m| (m, false)),
            SeqOutcome::Restart { missed } => {
                self.restart(
                    &key,
                    last,
                    seq,
                    "publisher restarted (sequence went backwards): its blocks were cleared",
                );
                missed.clone().map(|m| (m, false))
            }
            SeqOutcome::Resync => {
                self.restart(&key, last, seq, "publisher sequence jumped beyond any real gap: its blocks were cleared and the stream restarted");
                None
            }
            SeqOutcome::Gap { missing } => {
                metrics.gap(&key.engine.pod);
                self.state(&key, |s| s.gaps += 1);
                Some((missing.clone(), true))
            }
        };
        if let Some((wanted, count_lost)) = hole {
            if let Some(route) = gap_fill {
                let closed_by_log = Arc::new(AtomicBool::new(false));
                if let Some(fill) =
                    self.start_fill(route, &key, wanted.clone(), closed_by_log.clone())
                {
                    let mut messages = VecDeque::new();
                    messages.push_back(message);
                    self.parked.insert(
                        key,
                        Parked {
                            fill,
                            wanted,
                            count_lost,
                            messages,
                            closed_by_log,
                        },
                    );
                    return;
                }
            }
            if count_lost {
                self.lost(&key, wanted.end - wanted.start);
            }
        }
        self.apply(&key, message);
    }

    /// Applies parked messages in order; a new hole among them is counted, not filled.
    fn release(&mut self, key: &PublisherKey, messages: VecDeque<Pending>) {
        for message in messages {
            self.sequence(None, key.clone(), message);
        }
    }

    /// A publisher's stream starts over (it restarted, or its sequence cannot be the one we
    /// knew): its blocks are cleared and the restart counted.
    fn restart(&self, key: &PublisherKey, last: Option<u64>, seq: u64, why: &str) {
        self.shared.metrics.ingest.restart(&key.engine.pod);
        let removed =
            self.shared
                .indexer
                .clear_engine(&key.model, &key.engine.pod, key.engine.dp_rank);
        if self.shared.warn_budget.allow(LineKind::Restart) {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, last_seq = ?last, seq, removed, "{why}");
        }
        self.state(key, |s| {
            s.restarts += 1;
            s.stale = false;
        });
    }

    /// Counts `n` messages of `key` as lost for good: its blocks may be short or stale until
    /// its engine clears them (a restart), so the publisher is marked stale in ListPods.
    fn lost(&self, key: &PublisherKey, n: u64) {
        if n > 0 {
            self.shared.metrics.ingest.lost(&key.engine.pod, n);
            self.state(key, |s| {
                s.messages_lost += n;
                s.stale = true;
            });
        }
    }

    /// Applies one message, records it as its publisher's last, and (when it came from this
    /// replica's socket and replication is on) appends it to the shared log.
    fn apply(&self, key: &PublisherKey, message: Pending) {
        let shared = self.shared;
        self.apply_batch(key, &message.batch);
        let received_by = message
            .from_log
            .clone()
            .unwrap_or_else(|| shared.replica.clone());
        shared.publishers.applied(key, message.link.as_ref(), |s| {
            s.last_seq = Some(message.seq);
            s.last_ts = message.batch.ts;
            s.messages += 1;
            if s.received_by != received_by {
                s.received_by = received_by;
            }
        });
        if let (Some(log), None) = (&shared.log, &message.from_log) {
            log.append(LogEntry::Message {
                pod: key.engine.pod.clone(),
                model: key.model.clone(),
                seq: message.seq,
                stamp: Some(Stamp {
                    rank: key.engine.dp_rank,
                    ts: message.batch.ts,
                }),
                payload: message.payload,
            });
        }
    }

    /// Applies one batch to the index and counts what it did.
    fn apply_batch(&self, key: &PublisherKey, batch: &EventBatch) {
        let shared = self.shared;
        let report = match shared
            .indexer
            .apply_batch(&key.model, &key.engine.pod, batch)
        {
            Ok(r) => r,
            Err(e @ kv_core::SettingsError::TooManyModels { .. }) => {
                shared.metrics.ingest.skipped("too_many_models", 1);
                if let Some(suppressed) = shared.decode_warn.allow() {
                    tracing::warn!(model = %key.model, error = %e, suppressed, "events of a model past maxModels dropped");
                }
                return;
            }
            Err(e) => {
                shared.metrics.ingest.skipped("bad_model_settings", 1);
                tracing::error!(model = %key.model, error = %e, "cannot index events for this model");
                return;
            }
        };
        if let Some(evicted) = &report.evicted_model {
            shared.metrics.ingest.model_evicted();
            shared.publishers.forget_model(evicted);
            tracing::warn!(model = %evicted, admitted = %key.model, "maxModels reached: the model holding the fewest blocks gave its place (its blocks dropped, its publishers start afresh); name real models in the config to keep them, or set allowedModels");
        }
        shared
            .metrics
            .ingest
            .applied(&key.engine.pod, &key.model, &report);
        shared.metrics.index.applied(&report);
        shared.metrics.translation.applied(&key.model, &report);
        if let Some(mode) = report.translation.mode_changed {
            self.report_key_mode(key, mode);
        }
        if report.layout_changed {
            self.report_layout(key, report.skipped_group_events > 0);
        }
        self.report_drops(key, &report);
        if report.first_mismatch && shared.warn_budget.allow(LineKind::HashMismatch) {
            let diagnosis = shared
                .indexer
                .model(&key.model)
                .and_then(|m| m.hash_check(&key.engine.pod))
                .and_then(|c| c.diagnosis)
                .unwrap_or_default();
            tracing::warn!(model = %key.model, pod = %key.engine.pod, "block hash mismatch: every score for this pod will be 0. {diagnosis}");
        }
    }
}

impl Worker<'_> {
    /// One log line (under the budget) for drops an operator must act on: blocks whose
    /// tokens do not cover them (the engine's block size or event shape), translated blocks
    /// the key budget had no room for (`size` too small), and runs refused for their
    /// lookahead tokens (another length than the model's, or inconsistent); and, once per
    /// model, the lookahead length it learned. Every drop is counted
    /// (`kvindexer_blocks_dropped_total`) whether or not a line is printed.
    fn report_drops(&self, key: &PublisherKey, report: &kv_core::ApplyReport) {
        if let Some(l) = report.lookahead_learned {
            // Once per model: prompts are hashed with their next `l` tokens from now on.
            tracing::info!(model = %key.model, pod = %key.engine.pod, lookahead = l, "lookahead hashing (vLLM num_hash_lookahead_tokens, EAGLE/MTP drafters): prompts of this model are hashed with the tokens after each block from now on; its engines must all publish this lookahead length");
        }
        let t = &report.translation;
        if let Some(size) = t.alignable {
            // Once per engine: it could be scored without a translation map.
            tracing::info!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, engine_block_size = size, "engine's block hashes are the index's keys at its own block size ({size}: same seed and algorithm): set tokenProcessorConfig.blockSize to {size} to score it aligned, without a translation map (scores are exact either way)");
        }
        if t.unplaced_hashes > 0 && self.shared.warn_budget.allow(LineKind::Dropped) {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, hashes = t.unplaced_hashes, "translated blocks not indexed: a run with fewer hashes than blocks (vLLM leaves null and masked blocks out) has hashes no other group's blocks pair with a block for certain; skipped, never guessed (the engine may be scored below its hit)");
        }
        let (uncovered, full) = (t.partial_blocks + t.uncovered_hashes, t.full_blocks);
        let (mismatch, malformed) = (
            report.lookahead_mismatch_blocks,
            report.lookahead_malformed_blocks,
        );
        let lookahead = mismatch + malformed;
        if u64::from(uncovered + full) + lookahead == 0
            || !self.shared.warn_budget.allow(LineKind::Dropped)
        {
            return;
        }
        if let Some((run, model)) = report.lookahead_mismatch.filter(|_| mismatch > 0) {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, blocks = mismatch, engine_lookahead = run, model_lookahead = model, "stored blocks not indexed: this engine hashes with another lookahead length (num_hash_lookahead_tokens) than the model's other engines; every engine of a model must run the same drafter setting");
        }
        if malformed > 0 {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, blocks = malformed, "stored blocks not indexed: their lookahead_token_ids are not one list per hash of one length, or not the run's own next tokens");
        }
        if uncovered > 0 {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, partial = t.partial_blocks, uncovered = t.uncovered_hashes, "stored blocks not indexed: their token ids do not cover them (a partial page, or more hashes than tokens)");
        }
        if full > 0 {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, blocks = full, "translated blocks not indexed: the key budget (size) has no room for their map entries; raise size");
        }
    }

    /// One log line (under the budget) when an engine's KV-cache groups change how it is
    /// scored: a hybrid model's groups, or engine blocks of several keys; a warning when a
    /// group was refused (`refused`).
    fn report_layout(&self, key: &PublisherKey, refused: bool) {
        let shared = self.shared;
        if !shared.warn_budget.allow(LineKind::KeyMode) {
            return;
        }
        if refused {
            tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, "a KV-cache group whose hit rule is not modelled is skipped for this engine (counted: kvindexer_events_skipped_total{{reason=\"non_prefix_cacheable_group\"}}): chunked local attention needs the model's chunk (models.<model>.attentionChunkSize); a group block must be a multiple of blockSize; an engine of a model marked hybrid (models.<model>.hybrid) that names no group (SGLang, vLLM before 0.20) is not indexed at all. Otherwise the engine is scored by its other groups");
        }
        let Some(model) = shared.indexer.model(&key.model) else {
            return;
        };
        let directory = model.index().directory();
        let engine = directory
            .engines_of(&key.engine.pod)
            .iter()
            .copied()
            .find(|&e| {
                directory
                    .key(e)
                    .is_some_and(|k| k.dp_rank == key.engine.dp_rank)
            });
        if let Some(layout) = engine.and_then(|e| model.layout(e)) {
            tracing::info!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, "engine's KV-cache groups: {layout}; scored by the hit vLLM takes over them");
        }
    }

    /// One log line (under the budget) when an engine's key mode is decided: translated is
    /// news (its hashes differ from the index's keys, and why), refused is a warning.
    fn report_key_mode(&self, key: &PublisherKey, mode: KeyMode) {
        let shared = self.shared;
        if !shared.warn_budget.allow(LineKind::KeyMode) {
            return;
        }
        let why = || {
            shared
                .indexer
                .model(&key.model)
                .and_then(|m| m.hash_check(&key.engine.pod))
                .and_then(|c| c.diagnosis)
                .unwrap_or_else(|| "the events' block size is not blockSize".to_owned())
        };
        match mode {
            KeyMode::Translated => {
                tracing::info!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, "engine's block hashes are not the index's keys: translating its blocks from their token ids (exact scores, a map entry per block; a hash no block can be paired with for certain is skipped and counted, reason unplaced_hash). Why they differ: {}", why())
            }
            KeyMode::Refused { engine, ours } => {
                tracing::warn!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, engine_block_size = engine, block_size = ours, "engine's block size is not a multiple of blockSize: its blocks are not indexed (set the engine's block or page size to a multiple of {ours}, e.g. SGLang --page-size {ours})")
            }
            KeyMode::Aligned | KeyMode::Undecided => {
                tracing::debug!(pod = %key.engine.pod, model = %key.model, rank = key.engine.dp_rank, mode = mode.label(), "engine key mode decided")
            }
        }
    }
}

/// Blocks a batch's `BlockStored` events carry (what a dropped batch loses).
fn stored_blocks(batch: &EventBatch) -> u64 {
    batch
        .events
        .iter()
        .map(|e| match e {
            kv_core::KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            _ => 0,
        })
        .sum()
}
