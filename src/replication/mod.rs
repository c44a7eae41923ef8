//! Replication through Redis (or Valkey): several replicas, one index.
//!
//! - **The log** (a Redis stream, `<keyPrefix>:log`), ingestion's
//!   [`SharedLog`](crate::ingest::SharedLog): every message a replica applies from its own ZMQ
//!   sockets is appended as received (pod, model, sequence, payload), and so is every pod
//!   cleared (an admin request, or a pod forgotten) and every recorded routing. Every replica reads the whole log ([`follower`]) and hands each entry to the
//!   worker of its pod, where one sequence state per publisher covers both paths: each
//!   (publisher, sequence) is applied once, whichever path brought it first; older messages
//!   are stale; a publisher's restart is recognised the same way everywhere (see
//!   [`crate::ingest::sequence`]). Bind mode (each pod on one replica) and connect mode (every
//!   replica on every pod) converge alike.
//! - **Snapshots** (`<keyPrefix>:snapshot` and its chunks): every `snapshotInterval`, the
//!   replica that takes the snapshot lock pauses its workers, copies the index and the
//!   publisher states as of the log entry it read last, resumes, and stores the copy in chunks
//!   and then a meta naming them (one `SET`: a reader sees the old snapshot or the new
//!   one, never half). The log is then trimmed behind the previous snapshot's position, so a
//!   replica a little behind is never forced to reload.
//! - **Start**: load the newest snapshot, read the log from its position to the end, then
//!   report ready. A replica whose position was trimmed away (it was down or cut off too long)
//!   reloads from the snapshot while running.
//! - **Redis trouble**: appends wait in a bounded queue (overflow is dropped and counted),
//!   every task reconnects with backoff, and the replica keeps serving and applying its own
//!   events meanwhile.
//!
//! Invariants: nothing here blocks a worker (appends are `try_send`); the follower never
//! skips a log entry it read (it waits for room in the worker queues); a snapshot is taken
//! with every worker paused between two log entries, so its index, publisher states and log
//! position agree.

mod appender;
mod follower;
mod keys;
pub mod snapshot;
mod store;
mod stream;

pub use stream::StreamId;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{redact_url, ReplicationConfig};
use crate::ingest::{Feeder, LogEntry, PublisherKey, PublisherState, SharedLog};
use crate::metrics::Metrics;
use keys::Keys;
use kv_core::Indexer;

/// Why replication could not be set up.
#[derive(Debug, Error)]
pub enum ReplicationError {
    /// The Redis URL does not parse (the password is not shown).
    #[error("replication.redisUrl {url}: {detail}")]
    Url {
        /// The URL, password redacted.
        url: String,
        /// Why.
        detail: String,
    },
}

/// The workers' (and the admin API's) side of the append queue: ingestion's [`SharedLog`],
/// backed by Redis.
#[derive(Clone)]
pub struct LogSink {
    tx: mpsc::Sender<LogEntry>,
    metrics: Arc<Metrics>,
    /// Bytes queued (what [`queued_bytes`] charges), given back by the appender.
    queued: Arc<AtomicUsize>,
    /// `appendQueueBytes`.
    limit: usize,
}

/// What an entry costs in the append queue: its payload and a fixed part (names, stamp).
fn queued_bytes(entry: &LogEntry) -> usize {
    const ENTRY_OVERHEAD: usize = 128;
    match entry {
        LogEntry::Message { payload, .. } => ENTRY_OVERHEAD + payload.len(),
        LogEntry::Speculate { hashes, .. } => ENTRY_OVERHEAD + 8 * hashes.len(),
        LogEntry::ClearPod { .. } => ENTRY_OVERHEAD,
    }
}

impl SharedLog for LogSink {
    /// Queues `entry` for the log; when the queue is full (`appendQueue` entries or
    /// `appendQueueBytes`, Redis slow or down) it is dropped and counted.
    fn append(&self, entry: LogEntry) {
        let bytes = queued_bytes(&entry);
        if self.queued.fetch_add(bytes, Ordering::Relaxed) + bytes > self.limit {
            self.queued.fetch_sub(bytes, Ordering::Relaxed);
            self.metrics.replication.append_dropped();
            return;
        }
        match self.tx.try_send(entry) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.queued.fetch_sub(bytes, Ordering::Relaxed);
                self.metrics.replication.append_dropped();
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.queued.fetch_sub(bytes, Ordering::Relaxed);
            }
        }
    }
}

/// Replication's shared settings and Redis client.
#[derive(Clone)]
pub struct Replication {
    inner: Arc<Inner>,
}

struct Inner {
    config: ReplicationConfig,
    client: redis::Client,
    keys: Keys,
    /// This replica's name (`replicaId`, or the host name).
    replica: Arc<str>,
    /// This process: a replica restarted under the same name is another instance.
    instance: Arc<str>,
    metrics: Arc<Metrics>,
}

/// What a starting replica restored.
#[derive(Default)]
pub struct Restored {
    /// Publisher states from the snapshot.
    pub publishers: Vec<(PublisherKey, PublisherState)>,
    /// Where the log is read from.
    pub position: StreamId,
    /// Entries added to the log up to `position`, when known.
    pub offset: Option<u64>,
    /// Whether Redis answered (else the replica starts cold and catches up later).
    pub reached: bool,
}

/// How long one Redis command may take (a blocked read waits [`READ_BLOCK`] on top).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a log read blocks waiting for new entries.
const READ_BLOCK: Duration = Duration::from_millis(500);
/// The first reconnect delay; doubles up to [`BACKOFF_MAX`].
const BACKOFF_START: Duration = Duration::from_millis(100);
/// The longest reconnect delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Replication {
    /// Checks the URL and names this replica; connects lazily.
    pub fn new(
        config: &ReplicationConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Self, ReplicationError> {
        let client = redis::Client::open(config.redis_url.as_str()).map_err(|e| {
            ReplicationError::Url {
                url: redact_url(&config.redis_url),
                // The error's category and detail name the part that failed; the URL itself
                // (with its password) is never repeated.
                detail: format!("{:?}: {}", e.kind(), e.detail().unwrap_or("invalid URL")),
            }
        })?;
        let replica: Arc<str> = if config.replica_id.is_empty() {
            host_name().into()
        } else {
            config.replica_id.as_str().into()
        };
        let instance = format!(
            "{replica}/{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
                ^ u128::from(std::process::id())
        );
        Ok(Self {
            inner: Arc::new(Inner {
                config: config.clone(),
                client,
                keys: Keys::new(&config.key_prefix),
                replica,
                instance: instance.into(),
                metrics,
            }),
        })
    }

    /// This replica's name.
    pub fn replica(&self) -> Arc<str> {
        self.inner.replica.clone()
    }

    /// The Redis URL with its password hidden (for logs).
    pub fn redacted_url(&self) -> String {
        redact_url(&self.inner.config.redis_url)
    }

    async fn connect(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(COMMAND_TIMEOUT))
            .set_response_timeout(Some(COMMAND_TIMEOUT + READ_BLOCK));
        self.inner
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// Loads the newest snapshot into `indexer` (waiting at most `startupTimeout` for Redis).
    pub async fn restore(&self, indexer: &Indexer) -> Restored {
        let timeout = self.inner.config.startup_timeout.0;
        let attempt = async {
            let mut backoff = BACKOFF_START;
            loop {
                match self.try_restore(indexer).await {
                    Ok(restored) => return restored,
                    Err(e) => {
                        self.inner.metrics.replication.redis_error("restore");
                        tracing::warn!(redis = %self.redacted_url(), error = %e, retry_in = ?backoff, "replication: cannot load the snapshot yet");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(restored) => restored,
            Err(_) => {
                tracing::error!(redis = %self.redacted_url(), ?timeout, "replication: Redis unreachable at start; serving from an empty index and catching up when it answers");
                Restored::default()
            }
        }
    }

    async fn try_restore(&self, indexer: &Indexer) -> Result<Restored, store::StoreError> {
        let mut conn = self.connect().await?;
        let started = std::time::Instant::now();
        let Some(loaded) = store::load_snapshot(&mut conn, &self.inner.keys).await? else {
            tracing::info!("replication: no snapshot yet; reading the log from its start");
            return Ok(Restored {
                reached: true,
                offset: Some(0),
                ..Restored::default()
            });
        };
        let load = store::apply_snapshot(&loaded.bytes, indexer)?;
        load.report(&self.inner.metrics);
        let (publishers, memberships) = (load.publishers, load.memberships);
        self.inner
            .metrics
            .replication
            .snapshot("load", loaded.bytes.len(), memberships);
        tracing::info!(
            position = %loaded.position,
            bytes = loaded.bytes.len(),
            memberships,
            publishers = publishers.len(),
            elapsed = ?started.elapsed(),
            written_by = %loaded.meta.replica,
            "replication: snapshot loaded"
        );
        Ok(Restored {
            publishers,
            position: loaded.position,
            offset: loaded.meta.offset,
            reached: true,
        })
    }

    /// Starts the appender; returns the workers' side of its queue.
    pub fn start_appender(&self) -> (LogSink, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(self.inner.config.append_queue);
        let queued = Arc::new(AtomicUsize::new(0));
        let sink = LogSink {
            tx,
            metrics: self.inner.metrics.clone(),
            queued: queued.clone(),
            limit: self.inner.config.append_queue_bytes,
        };
        let task = tokio::spawn(appender::run(self.clone(), rx, queued));
        (sink, task)
    }

    /// Starts the follower: reads the log from `restored.position`, feeds the workers, writes
    /// snapshots in its turn, and sets `ready` once it has caught up with the log (or at once
    /// when Redis was unreachable at start).
    pub fn start_follower(
        &self,
        feeder: Feeder,
        restored: &Restored,
        ready: Arc<AtomicBool>,
        shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        if !restored.reached {
            ready.store(true, Ordering::Relaxed);
        }
        tokio::spawn(follower::run(
            self.clone(),
            feeder,
            (restored.position, restored.offset),
            ready,
            shutdown,
        ))
    }
}

/// The host name (the default replica id): `$HOSTNAME`, else `/etc/hostname`, else "kv-indexer".
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "kv-indexer".into())
}

#[cfg(test)]
mod tests {
    use super::{queued_bytes, LogSink};
    use crate::ingest::{LogEntry, SharedLog};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn message(bytes: usize) -> LogEntry {
        LogEntry::Message {
            pod: "p".into(),
            model: "m".into(),
            seq: 0,
            stamp: None,
            payload: bytes::Bytes::from(vec![0u8; bytes]),
        }
    }

    /// While Redis is down the append queue is bounded by bytes too: a few large payloads
    /// cannot multiply memory (65,536 entries of 1 MB would be 64 GB).
    #[test]
    fn the_append_queue_is_bounded_by_bytes() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(65_536);
        let metrics = crate::metrics::Metrics::new();
        let queued = Arc::new(AtomicUsize::new(0));
        let sink = LogSink {
            tx,
            metrics: metrics.clone(),
            queued: queued.clone(),
            limit: 4 << 20,
        };
        for _ in 0..10 {
            sink.append(message(1 << 20));
        }
        assert!(queued.load(Ordering::Relaxed) <= 4 << 20);
        let mut kept = 0;
        while let Ok(entry) = rx.try_recv() {
            queued.fetch_sub(queued_bytes(&entry), Ordering::Relaxed);
            kept += 1;
        }
        assert_eq!(
            kept, 3,
            "three 1 MiB payloads (and their overhead) fit in 4 MiB"
        );
        assert_eq!(queued.load(Ordering::Relaxed), 0);
        let indexer = kv_core::Indexer::new(Default::default()).expect("indexer");
        let page = metrics.render(&indexer);
        assert!(
            page.contains("kvindexer_replication_append_dropped_total 7"),
            "the other seven are dropped and counted"
        );
        sink.append(message(1 << 20));
        assert_eq!(
            rx.try_recv().map(|_| ()).ok(),
            Some(()),
            "room again once taken"
        );
    }
}
