//! Gap fill: the client side of what vLLM calls its replay protocol. A DEALER asks the
//! publisher's replay socket (a ZMQ ROUTER, `replay_endpoint` in vLLM's config) for every
//! buffered batch from a sequence number on (`["", seq8]`), and reads replies until the end
//! marker.
//!
//! Both reply layouts are accepted: `["", seq8, payload]` (vLLM <= 0.25) and
//! `["", topic, seq8, payload]` (>= 0.26); the end marker carries seq `ffffffffffffffff` and an
//! empty payload. A DEALER (not REQ) is used: REQ stops after the first reply.

use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The most batches one gap fill may return (vLLM buffers 10,000 by default).
pub const MAX_GAP_FILL_BATCHES: usize = 100_000;

/// Why a gap fill failed.
#[derive(Debug, Error)]
pub enum GapFillError {
    /// Connecting, sending or receiving failed.
    #[error("gap-fill socket error: {0}")]
    Socket(#[from] zeromq::ZmqError),
    /// Nothing accepts connections at the endpoint (refused, unroutable, or no answer to the
    /// TCP handshake within the probe time).
    #[error("gap-fill endpoint unreachable: {0}")]
    Unreachable(String),
    /// No end marker within the timeout.
    #[error("gap fill timed out after {0:?}")]
    Timeout(Duration),
    /// A reply that is neither layout.
    #[error("gap-fill reply with {frames} frames (expected 3 or 4)")]
    BadReply {
        /// Frames received.
        frames: usize,
    },
    /// A sequence frame that is not 8 bytes.
    #[error("gap-fill reply with a {0}-byte sequence frame")]
    BadSequence(usize),
}

impl GapFillError {
    /// A bounded metric label.
    pub fn label(&self) -> &'static str {
        match self {
            GapFillError::Socket(_) => "socket_error",
            GapFillError::Unreachable(_) => "unreachable",
            GapFillError::Timeout(_) => "timeout",
            GapFillError::BadReply { .. } | GapFillError::BadSequence(_) => "bad_reply",
        }
    }
}

/// Fetches the batches with sequence numbers from `start` on, in order.
pub async fn fetch(
    endpoint: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, GapFillError> {
    match tokio::time::timeout(timeout, fetch_inner(endpoint, start)).await {
        Ok(result) => result,
        Err(_) => Err(GapFillError::Timeout(timeout)),
    }
}

/// How long the TCP probe waits for a handshake.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Fails fast when nothing listens at a `tcp://host:port` endpoint: the ZMQ client would keep
/// retrying a refused connection until the whole gap-fill timeout passed.
async fn probe(endpoint: &str) -> Result<(), GapFillError> {
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return Ok(());
    };
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_stream)) => Ok(()),
        Ok(Err(e)) => Err(GapFillError::Unreachable(e.to_string())),
        Err(_) => Err(GapFillError::Unreachable(format!(
            "no TCP handshake within {PROBE_TIMEOUT:?}"
        ))),
    }
}

async fn fetch_inner(endpoint: &str, start: u64) -> Result<Vec<(u64, Bytes)>, GapFillError> {
    probe(endpoint).await?;
    let mut socket = DealerSocket::new();
    socket.connect(endpoint).await?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .map_err(|_| GapFillError::BadReply { frames: 0 })?;
    socket.send(request).await?;
    let mut out = Vec::new();
    loop {
        let frames = socket.recv().await?.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] => (seq, payload),
            [_, _topic, seq, payload] => (seq, payload),
            other => {
                return Err(GapFillError::BadReply {
                    frames: other.len(),
                })
            }
        };
        let seq: [u8; 8] = seq[..]
            .try_into()
            .map_err(|_| GapFillError::BadSequence(seq.len()))?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, payload.clone()));
        if out.len() >= MAX_GAP_FILL_BATCHES {
            return Ok(out);
        }
    }
}
