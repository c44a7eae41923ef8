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

/// Drains the append queue into the log until the queue closes (shutdown); what Redis never
/// took by then is logged as lost.
pub(super) async fn run(rep: Replication, rx: mpsc::Receiver<LogEntry>, queued: Arc<AtomicUsize>) {
    let mut appender = Appender {
        rep,
        rx,
        queued,
        warn: WarnThrottle::default(),
        conn: None,
        batch: Vec::with_capacity(BATCH),
        backoff: BACKOFF_START,
        failing: false,
        closed: false,
        final_attempts: 0,
        backlog_peak: 0,
    };
    while appender.fill().await {
        let step = match appender.conn.is_some() {
            true => appender.append().await,
            false => appender.connect().await,
        };
        if matches!(step, Step::Stop) {
            break;
        }
    }
    if !appender.batch.is_empty() {
        tracing::warn!(
            lost = appender.batch.len(),
            "replication: stopped with appends Redis never took"
        );
    }
}

/// What the appender does next.
enum Step {
    /// Goes on with the next round.
    Go,
    /// Stops: the queue closed and Redis did not take the rest in [`FINAL_ATTEMPTS`].
    Stop,
}

/// The appender's state between round trips.
struct Appender {
    rep: Replication,
    rx: mpsc::Receiver<LogEntry>,
    /// Bytes queued (the workers add, the appender takes).
    queued: Arc<AtomicUsize>,
    warn: WarnThrottle,
    conn: Option<redis::aio::MultiplexedConnection>,
    /// The entries of the next round trip, kept while Redis fails.
    batch: Vec<LogEntry>,
    backoff: Duration,
    /// Whether the last round trip failed (the next success is logged).
    failing: bool,
    /// Whether the queue has closed (shutdown).
    closed: bool,
    final_attempts: u32,
    /// The most bytes queued since the heap was last trimmed.
    backlog_peak: usize,
}

impl Appender {
    /// Fills the batch from the queue (waiting for the first entry when it is empty); false
    /// when there is nothing left to append.
    async fn fill(&mut self) -> bool {
        if self.batch.is_empty() {
            if self.closed {
                return false;
            }
            match self.rx.recv().await {
                Some(entry) => self.take(entry),
                None => return false,
            }
        }
        while !self.closed && self.batch.len() < BATCH {
            match self.rx.try_recv() {
                Ok(entry) => self.take(entry),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => self.closed = true,
            }
        }
        self.rep
            .inner
            .metrics
            .replication
            .append_queue(self.rx.len());
        let queued = self.queued.load(Ordering::Relaxed);
        self.backlog_peak = self.backlog_peak.max(queued);
        true
    }

    /// An entry leaves the queue's byte count when the appender takes it.
    fn take(&mut self, entry: LogEntry) {
        self.queued
            .fetch_sub(queued_bytes(&entry), Ordering::Relaxed);
        self.batch.push(entry);
    }

    /// Connects to Redis, or counts, logs and backs off.
    async fn connect(&mut self) -> Step {
        match self.rep.connect().await {
            Ok(c) => {
                self.conn = Some(c);
                Step::Go
            }
            Err(e) => {
                self.rep.inner.metrics.replication.redis_error("append");
                if let Some(suppressed) = self.warn.allow() {
                    let queued = self.rx.len() + self.batch.len();
                    tracing::warn!(redis = %self.rep.redacted_url(), error = %e, queued, suppressed, "replication: cannot reach Redis; appends wait in the queue");
                }
                self.failed(self.backoff).await
            }
        }
    }

    /// Appends the batch in one round trip; on success, trims the heap once a large backlog
    /// has drained; on failure, counts, logs, drops the connection and backs off.
    async fn append(&mut self) -> Step {
        let Some(c) = self.conn.as_mut() else {
            return Step::Go;
        };
        let inner = &self.rep.inner;
        let appended = store::append(
            c,
            &inner.keys,
            &self.batch,
            &inner.replica,
            &inner.instance,
            inner.config.max_log_length,
        )
        .await;
        let metrics = &inner.metrics.replication;
        match appended {
            Ok(()) => {
                metrics.appended(self.batch.len() as u64);
                self.batch.clear();
                self.backoff = BACKOFF_START;
                if self.failing {
                    self.failing = false;
                    metrics.reconnected();
                    tracing::info!(queued = self.rx.len(), "replication: appending again");
                }
                let queued = self.queued.load(Ordering::Relaxed);
                if self.backlog_peak >= TRIM_BACKLOG && queued < TRIM_BACKLOG / 8 {
                    self.backlog_peak = 0;
                    release_heap_after_backlog();
                }
                Step::Go
            }
            Err(e) => {
                metrics.redis_error("append");
                if let Some(suppressed) = self.warn.allow() {
                    let queued = self.rx.len() + self.batch.len();
                    tracing::warn!(error = %e, queued, suppressed, "replication: append failed; retrying");
                }
                self.conn = None;
                self.failed(self.backoff.min(Duration::from_secs(1))).await
            }
        }
    }

    /// A failed round trip: after the queue closed, the last of [`FINAL_ATTEMPTS`] stops the
    /// appender; otherwise it waits `wait` and doubles its backoff.
    async fn failed(&mut self, wait: Duration) -> Step {
        self.failing = true;
        if self.closed {
            self.final_attempts += 1;
            if self.final_attempts >= FINAL_ATTEMPTS {
                return Step::Stop;
            }
        }
        tokio::time::sleep(wait).await;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        Step::Go
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
