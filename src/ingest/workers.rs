//! The workers: each owns the publishers of the pods hashed to it, so one publisher's messages
//! are decoded, sequenced ([`SeqOutcome`]), gap-filled and applied in order.

use std::sync::Arc;
use std::time::Instant;

use kv_core::{decode_batch, EventBatch};
use tokio::sync::mpsc;

use super::sequence::SeqOutcome;
use super::{gap_fill, Job, PublisherKey, Shared};

/// Runs worker `index` until its queue closes.
pub(super) async fn run(index: usize, mut rx: mpsc::Receiver<Job>, shared: Arc<Shared>) {
    while let Some(job) = rx.recv().await {
        shared.metrics.ingest.dequeued();
        handle(index, job, &shared).await;
    }
}

async fn handle(worker: usize, job: Job, shared: &Shared) {
    let metrics = &shared.metrics.ingest;
    let batch = match decode_batch(&job.payload) {
        Ok(b) => b,
        Err(e) => {
            metrics.decode_error(e.reason());
            if let Some(suppressed) = shared.decode_log.allow() {
                tracing::warn!(pod = %job.pod, model = %job.model, seq = job.seq, error = %e, suppressed, "undecodable KV event payload dropped");
            }
            return;
        }
    };
    let rank = batch
        .data_parallel_rank
        .and_then(|r| u32::try_from(r).ok())
        .unwrap_or(0);
    let key = PublisherKey {
        pod: job.pod.clone(),
        model: job.model.clone(),
        rank,
    };
    let last = shared.publishers.shards[worker]
        .lock()
        .get(&key)
        .and_then(|s| s.last_seq);
    let outcome = SeqOutcome::classify(last, job.seq);
    match &outcome {
        SeqOutcome::Next => {}
        SeqOutcome::Duplicate => {
            metrics.skipped("duplicate", 1);
            return;
        }
        SeqOutcome::First { missed } => {
            // Joined late (daemon start, slow joiner): fetch what the buffer still has.
            if let Some(missed) = missed {
                fill_gap(shared, &job, rank, missed.clone(), false).await;
            }
        }
        SeqOutcome::Restart { missed } => {
            metrics.restart(&job.pod);
            let removed = shared.indexer.clear_engine(&job.model, &job.pod, rank);
            tracing::warn!(pod = %job.pod, model = %job.model, rank, last_seq = ?last, seq = job.seq, removed, "publisher restarted (sequence went backwards): its blocks were cleared");
            if let Some(missed) = missed {
                fill_gap(shared, &job, rank, missed.clone(), false).await;
            }
        }
        SeqOutcome::Gap { missing } => {
            metrics.gap(&job.pod);
            fill_gap(shared, &job, rank, missing.clone(), true).await;
        }
    }
    apply(shared, &job.model, &job.pod, &batch);
    let mut shard = shared.publishers.shards[worker].lock();
    let state = shard.entry(key).or_default();
    state.last_seq = Some(job.seq);
    state.messages += 1;
    state.gaps += u64::from(matches!(outcome, SeqOutcome::Gap { .. }));
    state.restarts += u64::from(matches!(outcome, SeqOutcome::Restart { .. }));
}

/// Fetches `wanted` from the publisher's gap-fill socket and applies it; what cannot be had is
/// counted as lost when `count_lost` (a gap; not when joining late or after a restart).
async fn fill_gap(
    shared: &Shared,
    job: &Job,
    rank: u32,
    wanted: std::ops::Range<u64>,
    count_lost: bool,
) {
    let metrics = &shared.metrics.ingest;
    let lost = |n: u64| {
        if count_lost {
            metrics.lost(&job.pod, n);
        }
    };
    let total = wanted.end - wanted.start;
    let Some(endpoint) = job.gap_fill.endpoint(&job.pod, rank) else {
        metrics.gap_fill("unavailable");
        lost(total);
        return;
    };
    let started = Instant::now();
    match gap_fill::fetch(&endpoint, wanted.start, shared.gap_fill_timeout).await {
        Ok(batches) => {
            metrics.gap_fill("ok");
            let mut applied = 0u64;
            for (seq, payload) in batches {
                if !wanted.contains(&seq) {
                    continue;
                }
                match decode_batch(&payload) {
                    Ok(batch) => {
                        apply(shared, &job.model, &job.pod, &batch);
                        applied += 1;
                    }
                    Err(e) => metrics.decode_error(e.reason()),
                }
            }
            tracing::info!(pod = %job.pod, model = %job.model, rank, from = wanted.start, to = wanted.end, applied, elapsed = ?started.elapsed(), "filled a gap from the publisher's replay buffer");
            lost(total.saturating_sub(applied));
        }
        Err(e) => {
            metrics.gap_fill(e.label());
            if let Some(suppressed) = shared.gap_fill_log.allow() {
                tracing::warn!(pod = %job.pod, endpoint = %endpoint, error = %e, suppressed, "gap fill failed; the missed events are lost");
            }
            lost(total);
        }
    }
}

/// Applies one batch and records what it did.
fn apply(shared: &Shared, model: &str, pod: &str, batch: &EventBatch) {
    let report = match shared.indexer.apply_batch(model, pod, batch) {
        Ok(r) => r,
        Err(e) => {
            shared.metrics.ingest.skipped("bad_model_settings", 1);
            tracing::error!(model, error = %e, "cannot index events for this model");
            return;
        }
    };
    shared.metrics.ingest.applied(pod, model, &report);
    shared.metrics.index.applied(&report);
}
