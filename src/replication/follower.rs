//! The follower: reads the log after its position and feeds each entry to the workers, in log
//! order. Before each read it checks the log's trim point (reloading from the snapshot when its
//! position was trimmed away); once a second it updates its lag; and every `snapshotInterval`,
//! when it is at the log's end and wins the snapshot lock, it writes a snapshot as of its
//! position.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tokio::sync::watch;

use super::snapshot::SnapshotWriter;
use super::store::{self, StoreError};
use super::stream::{now_ms, StreamId};
use super::{Replication, BACKOFF_MAX, BACKOFF_START, READ_BLOCK};
use crate::ingest::{Feeder, LogEntry};
use crate::warn_budget::WarnThrottle;

/// Entries per read at most.
const READ_COUNT: usize = 1024;
/// How often the trim point, the lag and the snapshot's age are checked.
const CHECK_EVERY: Duration = Duration::from_secs(1);

struct Follower {
    rep: Replication,
    feeder: Feeder,
    position: StreamId,
    /// Entries ever added to the log up to and including `position` (its logical offset),
    /// when known: tells a trim past `position` and gives the lag.
    offset: Option<u64>,
    ready: Arc<AtomicBool>,
    last_check: Option<Instant>,
    next_snapshot: Instant,
    /// The last read reached the log's end.
    at_end: bool,
    /// The last read was more than [`STALL_AGE`] behind the log's end.
    behind: bool,
    warn: WarnThrottle,
}

/// How far behind the log's end the follower may read before the log counts as stalled for
/// the pods heard only through it.
const STALL_AGE: Duration = Duration::from_secs(1);

pub(super) async fn run(
    rep: Replication,
    feeder: Feeder,
    (position, offset): (StreamId, Option<u64>),
    ready: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let interval = rep.inner.config.snapshot_interval.0;
    let mut f = Follower {
        rep,
        feeder,
        position,
        offset,
        ready,
        last_check: None,
        next_snapshot: Instant::now() + interval,
        at_end: false,
        behind: true,
        warn: WarnThrottle::default(),
    };
    let mut conn: Option<MultiplexedConnection> = None;
    let mut backoff = BACKOFF_START;
    loop {
        if *shutdown.borrow() {
            break;
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => {
                let attempt = tokio::select! {
                    _ = shutdown.changed() => break,
                    c = f.rep.connect() => c,
                };
                match attempt {
                    Ok(c) => {
                        if backoff > BACKOFF_START {
                            f.rep.inner.metrics.replication.reconnected();
                            tracing::info!("replication: reading the log again");
                        }
                        backoff = BACKOFF_START;
                        conn.insert(c)
                    }
                    Err(e) => {
                        f.feeder.log_stalled();
                        f.failed(&StoreError::Redis(e));
                        tokio::select! {
                            _ = shutdown.changed() => break,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        continue;
                    }
                }
            }
        };
        let step = tokio::select! {
            _ = shutdown.changed() => break,
            step = f.step(c) => step,
        };
        // Pods heard only through the log are judged idle only while it flows (read at its
        // end, or at most STALL_AGE behind).
        match &step {
            Ok(true) if !f.behind => f.feeder.log_flowing(),
            _ => f.feeder.log_stalled(),
        }
        match step {
            Ok(true) => {}
            Ok(false) => break, // the workers are gone
            Err(e) => {
                f.failed(&e);
                conn = None;
                tokio::select! {
                    _ = shutdown.changed() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
    tracing::info!(position = %f.position, "replication: follower stopped");
}

impl Follower {
    fn failed(&self, e: &StoreError) {
        self.rep.inner.metrics.replication.redis_error("follow");
        if let Some(suppressed) = self.warn.allow() {
            tracing::warn!(redis = %self.rep.redacted_url(), error = %e, position = %self.position, suppressed, "replication: cannot read the log; serving from memory meanwhile");
        }
    }

    /// One round: the periodic checks, a snapshot when due, one read. `Ok(false)` when the
    /// workers are gone.
    async fn step(&mut self, conn: &mut MultiplexedConnection) -> Result<bool, StoreError> {
        let rep = self.rep.clone();
        let keys = &rep.inner.keys;
        // Before every read: has the log been trimmed past this replica's position? (A read
        // would silently start after the hole.)
        let info = store::log_info(conn, keys).await?;
        if let Some(offset) = self.offset {
            if info.entries_added < offset {
                // The log is younger than this replica's position (Redis came back empty):
                // everything in it is new.
                tracing::warn!(position = %self.position, "replication: the log was recreated (Redis restarted without its data); reading it from its start");
                self.offset = Some(info.entries_added.saturating_sub(info.length));
            } else if info.entries_added - offset > info.length {
                return self.reload(conn).await;
            }
        }
        if info.last_id <= self.position {
            self.offset = Some(info.entries_added);
        }
        if self.last_check.is_none_or(|t| t.elapsed() >= CHECK_EVERY) {
            self.last_check = Some(Instant::now());
            self.check(conn, info).await?;
        }
        // Only a replica at the log's end writes snapshots: one that is behind would store
        // an old state (and the store refuses to replace a newer snapshot anyway).
        if Instant::now() >= self.next_snapshot && self.at_end {
            self.next_snapshot = Instant::now() + self.rep.inner.config.snapshot_interval.0;
            if !self.snapshot_turn(conn).await? {
                return Ok(false);
            }
        }
        // Block for new entries only when there are none to read.
        let block = (info.last_id <= self.position).then_some(READ_BLOCK);
        let entries = store::read(conn, keys, self.position, READ_COUNT, block).await?;
        let metrics = &self.rep.inner.metrics.replication;
        let at_end = entries.len() < READ_COUNT;
        self.at_end = at_end;
        let newest = entries.last().map(|e| e.id);
        for entry in entries {
            self.position = entry.id;
            self.offset = self.offset.map(|o| o + 1);
            match entry.entry {
                None => metrics.log_entry("undecodable"),
                // This process applied its own admin clears and recorded routings when it
                // made them.
                Some(LogEntry::ClearPod { .. } | LogEntry::Speculate { .. })
                    if entry.instance[..] == *self.rep.inner.instance.as_bytes() =>
                {
                    metrics.log_entry("own")
                }
                // Already applied (this replica's own message, or one its socket brought
                // first): no decoding, no queue hop.
                Some(LogEntry::Message {
                    ref pod,
                    ref model,
                    seq,
                    stamp: Some(stamp),
                    ..
                }) if self.feeder.already_applied(pod, model, seq, stamp) => {
                    metrics.log_entry("already_applied")
                }
                Some(logged) => {
                    if !self.feeder.feed(entry.replica, logged).await {
                        return Ok(false);
                    }
                    metrics.log_entry("applied");
                }
            }
        }
        if let Some(newest) = newest {
            let age = now_ms().saturating_sub(newest.ms) as f64 / 1e3;
            metrics.lag_seconds(if at_end { 0.0 } else { age });
            self.behind = !at_end && age > STALL_AGE.as_secs_f64();
        } else {
            self.behind = false;
        }
        if at_end && !self.ready.swap(true, Ordering::Relaxed) {
            tracing::info!(position = %self.position, "replication: caught up with the log; ready");
        }
        Ok(true)
    }

    /// Lag and snapshot age, once a second.
    async fn check(
        &mut self,
        conn: &mut MultiplexedConnection,
        info: store::LogInfo,
    ) -> Result<(), StoreError> {
        let metrics = &self.rep.inner.metrics.replication;
        if info.last_id <= self.position {
            metrics.lag_seconds(0.0);
        }
        if let Some(offset) = self.offset {
            metrics.lag_messages(info.entries_added.saturating_sub(offset));
        }
        if let Some(meta) = store::snapshot_meta(conn, &self.rep.inner.keys).await? {
            metrics.snapshot_age(now_ms().saturating_sub(meta.written_ms) as f64 / 1e3);
        }
        Ok(())
    }

    /// The log was trimmed past this replica's position: replace the index with the snapshot.
    async fn reload(&mut self, conn: &mut MultiplexedConnection) -> Result<bool, StoreError> {
        let metrics = &self.rep.inner.metrics.replication;
        let Some(loaded) = store::load_snapshot(conn, &self.rep.inner.keys).await? else {
            tracing::error!(position = %self.position, "replication: the log was trimmed past this replica and there is no snapshot; the entries trimmed are lost for it (raise replication.maxLogLength)");
            self.offset = None;
            return Ok(true);
        };
        let started = Instant::now();
        let Some(paused) = self.feeder.pause().await else {
            return Ok(false);
        };
        let cleared = self.feeder.indexer().clear_all();
        let load = store::apply_snapshot(&loaded.bytes, self.feeder.indexer())?;
        load.report(&self.rep.inner.metrics);
        let memberships = load.memberships;
        self.feeder.publishers().restore(load.publishers);
        drop(paused);
        metrics.reloaded();
        metrics.snapshot("load", loaded.bytes.len(), memberships);
        tracing::warn!(from = %self.position, to = %loaded.position, cleared, memberships, elapsed = ?started.elapsed(), "replication: fell behind the trimmed log; reloaded from the snapshot");
        self.position = loaded.position;
        self.offset = loaded.meta.offset;
        // A snapshot older than the trim point too (the log's length cap cut it while
        // snapshots stalled) cannot be helped: go on from it rather than reload again.
        let info = store::log_info(conn, &self.rep.inner.keys).await?;
        if let Some(offset) = self.offset {
            if info.entries_added >= offset && info.entries_added - offset > info.length {
                tracing::error!(snapshot = %loaded.position, lost = info.entries_added - offset - info.length, "replication: the log was trimmed past the newest snapshot too; those entries are lost for this replica (raise replication.maxLogLength)");
                self.offset = None;
            }
        }
        Ok(true)
    }

    /// Writes a snapshot if this replica wins the lock for this interval.
    async fn snapshot_turn(
        &mut self,
        conn: &mut MultiplexedConnection,
    ) -> Result<bool, StoreError> {
        let inner = &self.rep.inner;
        let interval = inner.config.snapshot_interval.0;
        if !store::try_lock(conn, &inner.keys, &inner.instance, interval).await? {
            return Ok(true);
        }
        let started = Instant::now();
        let Some(paused) = self.feeder.pause().await else {
            return Ok(false);
        };
        let indexer = self.feeder.indexer();
        let held: u64 = indexer.stats().iter().map(|(_, s)| s.memberships).sum();
        let mut writer = SnapshotWriter::new(self.position, held);
        for model in indexer.models() {
            writer.key_space(model.name(), &model.key_space());
        }
        indexer.export_each(|model, key, blocks| writer.blocks(model, key, blocks));
        indexer.export_keys_each(|model, key, state| writer.engine_keys(model, key, state));
        for (key, state) in self.feeder.publishers().snapshot() {
            writer.publisher(&key, &state);
        }
        drop(paused);
        let paused_for = started.elapsed();
        let (bytes, memberships) = writer.finish();
        let rep = self.rep.clone();
        let (position, offset) = (self.position, self.offset);
        // Storing runs beside the follower, on its own connection.
        tokio::spawn(async move {
            let inner = &rep.inner;
            let metrics = &inner.metrics.replication;
            let result = async {
                let mut conn = rep.connect().await?;
                store::save_snapshot(
                    &mut conn,
                    &inner.keys,
                    &bytes,
                    position,
                    offset,
                    memberships,
                    &inner.replica,
                )
                .await
            }
            .await;
            match result {
                Ok(meta) => {
                    metrics.snapshot("write", bytes.len(), memberships);
                    metrics.snapshot_duration(started.elapsed().as_secs_f64());
                    tracing::info!(position = %position, bytes = bytes.len(), memberships, chunks = meta.chunks, ?paused_for, elapsed = ?started.elapsed(), "replication: snapshot written");
                }
                Err(e) => {
                    metrics.snapshot_failed("write");
                    tracing::warn!(error = %e, "replication: snapshot not written");
                }
            }
        });
        Ok(true)
    }
}
