//! The appender: drains the append queue into the log, a pipelined batch per round trip.
//! While Redis fails it keeps its batch, backs off (100 ms doubling to 5 s) and reconnects;
//! the queue meanwhile fills up to `appendQueue` entries or `appendQueueBytes`, beyond which the
//! workers' appends are dropped and counted (they never wait). Once a backlog of at least
//! [`TRIM_BACKLOG`] bytes has drained, the freed heap is handed back to the OS where the
//! allocator needs telling (a glibc build; `crate::heap`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{queued_bytes, store, Replication, BACKOFF_MAX, BACKOFF_START};
use crate::ingest::LogEntry;
use crate::warn_budget::WarnThrottle;

/// Entries per round trip at most.
const BATCH: usize = 512;
/// Attempts to flush what is left once the queue has closed (shutdown).
const FINAL_ATTEMPTS: u32 = 3;
/// A backlog this large (bytes queued at once), once drained, is worth a `malloc_trim` (glibc).
const TRIM_BACKLOG: usize = 32 << 20;

pub(super) async fn run(
    rep: Replication,
    mut rx: mpsc::Receiver<LogEntry>,
    queued: Arc<AtomicUsize>,
) {
    // An entry leaves the queue's byte count when the appender takes it.
    let taken = |entry: LogEntry| {
        queued.fetch_sub(queued_bytes(&entry), Ordering::Relaxed);
        entry
    };
    let inner = &rep.inner;
    let metrics = &inner.metrics.replication;
    let warn = WarnThrottle::default();
    let mut conn = None;
    let mut batch: Vec<LogEntry> = Vec::with_capacity(BATCH);
    let mut backoff = BACKOFF_START;
    let mut failing = false;
    let mut closed = false;
    let mut final_attempts = 0;
    // The most bytes queued since the heap was last trimmed.
    let mut backlog_peak = 0usize;
    loop {
        if batch.is_empty() {
            if closed {
                break;
            }
            match rx.recv().await {
                Some(entry) => batch.push(taken(entry)),
                None => break,
            }
        }
        while !closed && batch.len() < BATCH {
            match rx.try_recv() {
                Ok(entry) => batch.push(taken(entry)),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => closed = true,
            }
        }
        metrics.append_queue(rx.len());
        backlog_peak = backlog_peak.max(queued.load(Ordering::Relaxed));
        if conn.is_none() {
            match rep.connect().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    metrics.redis_error("append");
                    if let Some(suppressed) = warn.allow() {
                        tracing::warn!(redis = %rep.redacted_url(), error = %e, queued = rx.len() + batch.len(), suppressed, "replication: cannot reach Redis; appends wait in the queue");
                    }
                    if closed {
                        final_attempts += 1;
                        if final_attempts >= FINAL_ATTEMPTS {
                            break;
                        }
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    failing = true;
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        match store::append(
            c,
            &inner.keys,
            &batch,
            &inner.replica,
            &inner.instance,
            inner.config.max_log_length,
        )
        .await
        {
            Ok(()) => {
                metrics.appended(batch.len() as u64);
                batch.clear();
                backoff = BACKOFF_START;
                if failing {
                    failing = false;
                    metrics.reconnected();
                    tracing::info!(queued = rx.len(), "replication: appending again");
                }
                if backlog_peak >= TRIM_BACKLOG && queued.load(Ordering::Relaxed) < TRIM_BACKLOG / 8
                {
                    backlog_peak = 0;
                    release_heap_after_backlog();
                }
            }
            Err(e) => {
                metrics.redis_error("append");
                if let Some(suppressed) = warn.allow() {
                    tracing::warn!(error = %e, queued = rx.len() + batch.len(), suppressed, "replication: append failed; retrying");
                }
                conn = None;
                failing = true;
                if closed {
                    final_attempts += 1;
                    if final_attempts >= FINAL_ATTEMPTS {
                        break;
                    }
                }
                tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
    if !batch.is_empty() {
        tracing::warn!(
            lost = batch.len(),
            "replication: stopped with appends Redis never took"
        );
    }
}

/// Hands the heap a drained backlog held back to the OS (without holding up the appender).
fn release_heap_after_backlog() {
    tokio::spawn(async {
        if let Some((before, after)) = crate::heap::release_off_runtime().await {
            tracing::info!(
                resident_before_mb = before >> 20,
                resident_after_mb = after >> 20,
                "replication: append backlog drained; freed heap returned to the OS"
            );
        }
    });
}
