//! The port between ingestion and a shared event log: what ingestion hands to a log, and what
//! a log hands back. Ingestion owns these types; a log implementation (the daemon's Redis
//! replication) implements [`SharedLog`] and feeds entries back through the ingest's
//! `Feeder`. Dependencies run one way: the log's implementation uses
//! ingestion, never the reverse (not even in doc links).
//!
//! Invariant: [`SharedLog::append`] never waits (a worker or an RPC calls it on its path); a
//! log that cannot keep up drops and counts, it does not hold ingestion back.

use std::sync::Arc;

use bytes::Bytes;

/// One entry of the shared log: what a replica applied from its own sockets or was asked to do.
#[derive(Debug, Clone)]
pub enum LogEntry {
    /// A message applied from this replica's own socket, as received.
    Message {
        /// The pod.
        pod: Arc<str>,
        /// The model.
        model: Arc<str>,
        /// The publisher's sequence number.
        seq: u64,
        /// The batch's data-parallel rank and timestamp, copied out of the payload so a
        /// replica can tell it already applied the message without decoding it (`None` when
        /// an entry lacks them).
        stamp: Option<Stamp>,
        /// The payload, as received.
        payload: Bytes,
    },
    /// A pod forgotten in a model (an admin clear, or the pod gone or idle past its limit).
    ClearPod {
        /// The model.
        model: Arc<str>,
        /// The pod.
        pod: Arc<str>,
    },
    /// A routing recorded by `RecordRouting`: every replica makes the same speculative
    /// entries (each with its own clock and its own view of the pod's events).
    Speculate {
        /// The model.
        model: Arc<str>,
        /// The pod the gateway chose.
        pod: Arc<str>,
        /// The data-parallel rank it was pinned to (0 without data parallelism).
        rank: u32,
        /// The prompt's block hashes.
        hashes: Arc<[kv_core::BlockHash]>,
    },
}

/// What identifies a message in its publisher's stream beside the sequence number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stamp {
    /// The data-parallel rank (0 without DP).
    pub rank: u32,
    /// The batch's timestamp (vLLM's wall clock).
    pub ts: f64,
}

/// A shared event log that ingestion (and the admin RPCs) append to.
pub trait SharedLog: Send + Sync {
    /// Queues `entry` for the log without waiting; an entry the log cannot take is dropped and
    /// counted by the log.
    fn append(&self, entry: LogEntry);
}

/// The handle ingestion and the server hold (absent when replication is off).
pub type LogHandle = Arc<dyn SharedLog>;
