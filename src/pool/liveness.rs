//! Whether the Kubernetes API server answers, as the pool's watcher needs to know it: a read of
//! the InferencePool every [`PROBE_INTERVAL`] under a deadline, and the watcher's backoff,
//! capped so a watch is retried within seconds of the server answering again.
//!
//! Why a probe: a watch that was open while the API server hung may never deliver again (its
//! connection is gone behind a proxy, or was cut mid-stream), and from the watcher's side that
//! silence looks like a pool where nothing changes. A read that fails and then succeeds says
//! the server was away and is back; the watcher then starts its watches anew. The cost is one
//! small GET every two seconds, as a leader-election lease renews.
//!
//! Invariants: every read has a deadline (`endpointPicker.pool.requestTimeout`), so a server
//! that accepts and never answers is noticed; each read's result is sent, in order, to the
//! watcher; the probe stops when the watcher drops its receiver.

use std::time::Duration;

use kube::api::DynamicObject;
use kube::Api;
use tokio::sync::mpsc;

/// How often the API server is read to know it answers.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// The longest wait between two attempts of a failing list or watch.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// One read's result, as counted (`kvindexer_pool_api_probes_total`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeResult {
    /// The server answered (whether or not the pool exists).
    Answered,
    /// No answer within the deadline.
    Timeout,
    /// An error (refused, TLS, forbidden, ...), with what it said.
    Error(String),
}

impl ProbeResult {
    /// Its label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Answered => "ok",
            Self::Timeout => "timeout",
            Self::Error(_) => "error",
        }
    }
}

/// Reads pool `name` through `pools` every [`PROBE_INTERVAL`], each read bounded by
/// `deadline`, sending each result to `results` until it is dropped.
pub async fn probe(
    pools: Api<DynamicObject>,
    name: String,
    deadline: Duration,
    results: mpsc::Sender<ProbeResult>,
) {
    loop {
        let result = match tokio::time::timeout(deadline, pools.get_opt(&name)).await {
            Ok(Ok(_)) => ProbeResult::Answered,
            Ok(Err(e)) => ProbeResult::Error(e.to_string()),
            Err(_) => ProbeResult::Timeout,
        };
        if results.send(result).await.is_err() {
            return;
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// The watcher's backoff between failed attempts: from 200 ms, doubling, at most
/// [`MAX_BACKOFF`], each wait jittered by up to a quarter (kube's default reaches 30 s, which
/// would leave the pool stale for that long after the server answers again).
#[derive(Debug, Clone)]
pub struct CappedBackoff {
    next: Duration,
    draws: u64,
}

impl Default for CappedBackoff {
    fn default() -> Self {
        Self {
            next: Duration::from_millis(200),
            draws: 0,
        }
    }
}

impl Iterator for CappedBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let wait = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        self.draws += 1;
        let jitter = kv_core::mix64(self.draws ^ u64::from(std::process::id())) % 256;
        Some(wait + wait.mul_f64(jitter as f64 / 1024.0))
    }
}

impl kube::runtime::utils::Backoff for CappedBackoff {
    fn reset(&mut self) {
        self.next = Duration::from_millis(200);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_to_its_cap_and_resets() {
        use kube::runtime::utils::Backoff;
        let mut b = CappedBackoff::default();
        let waits: Vec<Duration> = b.by_ref().take(8).collect();
        assert!(waits[0] >= Duration::from_millis(200) && waits[0] < Duration::from_millis(260));
        assert!(waits[1] >= Duration::from_millis(400));
        assert!(waits.iter().all(|w| *w <= MAX_BACKOFF + MAX_BACKOFF / 4));
        assert!(waits[7] >= MAX_BACKOFF, "capped, not below it: {waits:?}");
        b.reset();
        assert!(b.next().is_some_and(|w| w < Duration::from_millis(260)));
    }
}
