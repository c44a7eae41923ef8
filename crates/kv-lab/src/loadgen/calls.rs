//! What every kind of caller shares: a gRPC channel tuned for prompts, and the gathering of
//! the callers' timings once their phase is over.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::error::LoadgenError;

/// A gRPC channel to `addr` with TCP_NODELAY and windows wide enough for a prompt.
pub(super) async fn channel(addr: &str) -> Result<tonic::transport::Channel, LoadgenError> {
    let grpc_error = |source| LoadgenError::Grpc {
        endpoint: addr.to_owned(),
        source,
    };
    tonic::transport::Endpoint::from_shared(addr.to_owned())
        .map_err(grpc_error)?
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(1 << 20))
        .initial_connection_window_size(Some(4 << 20))
        .connect()
        .await
        .map_err(grpc_error)
}

/// A caller task: its calls' latencies (ns) and its count.
pub(super) type Caller = tokio::task::JoinHandle<Result<(Vec<u64>, u64), LoadgenError>>;

/// Lets `tasks` call for `seconds`, stops them, and merges what they timed (sorted) and
/// counted.
pub(super) async fn gather(
    tasks: Vec<Caller>,
    stop: &AtomicBool,
    seconds: u64,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut counted = 0;
    for t in tasks {
        let (l, m) = t.await.map_err(|e| LoadgenError::Task(e.to_string()))??;
        all.extend(l);
        counted += m;
    }
    all.sort_unstable();
    Ok((all, counted))
}
