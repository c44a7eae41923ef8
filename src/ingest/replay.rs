//! vLLM's replay protocol, client side: a DEALER asks the publisher's ROUTER for every buffered
//! batch from a sequence number on (`["", seq8]`), and reads replies until the end marker.
//!
//! Both reply layouts are accepted: `["", seq8, payload]` (vLLM <= 0.25) and
//! `["", topic, seq8, payload]` (>= 0.26); the end marker carries seq `ffffffffffffffff` and an
//! empty payload. A DEALER (not REQ) is used: REQ stops after the first reply.

use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The most batches one replay may return (vLLM buffers 10,000 by default).
pub const MAX_REPLAY_BATCHES: usize = 100_000;

/// Why a replay failed.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// Connecting, sending or receiving failed.
    #[error("replay socket error: {0}")]
    Socket(#[from] zeromq::ZmqError),
    /// No end marker within the timeout.
    #[error("replay timed out after {0:?}")]
    Timeout(Duration),
    /// A reply that is neither layout.
    #[error("replay reply with {frames} frames (expected 3 or 4)")]
    BadReply {
        /// Frames received.
        frames: usize,
    },
    /// A sequence frame that is not 8 bytes.
    #[error("replay reply with a {0}-byte sequence frame")]
    BadSequence(usize),
}

impl ReplayError {
    /// A bounded metric label.
    pub fn label(&self) -> &'static str {
        match self {
            ReplayError::Socket(_) => "socket_error",
            ReplayError::Timeout(_) => "timeout",
            ReplayError::BadReply { .. } | ReplayError::BadSequence(_) => "bad_reply",
        }
    }
}

/// Fetches the batches with sequence numbers from `start` on, in order.
pub async fn fetch(
    endpoint: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    match tokio::time::timeout(timeout, fetch_inner(endpoint, start)).await {
        Ok(result) => result,
        Err(_) => Err(ReplayError::Timeout(timeout)),
    }
}

async fn fetch_inner(endpoint: &str, start: u64) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    let mut socket = DealerSocket::new();
    socket.connect(endpoint).await?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .map_err(|_| ReplayError::BadReply { frames: 0 })?;
    socket.send(request).await?;
    let mut out = Vec::new();
    loop {
        let frames = socket.recv().await?.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] => (seq, payload),
            [_, _topic, seq, payload] => (seq, payload),
            other => {
                return Err(ReplayError::BadReply {
                    frames: other.len(),
                })
            }
        };
        let seq: [u8; 8] = seq[..]
            .try_into()
            .map_err(|_| ReplayError::BadSequence(seq.len()))?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, payload.clone()));
        if out.len() >= MAX_REPLAY_BATCHES {
            return Ok(out);
        }
    }
}
