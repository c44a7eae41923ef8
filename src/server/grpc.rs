//! The gRPC services' front: `kvindexer.v1.KvIndexer` (its RPCs handled by operation in
//! `score`, [`super::routing`] and `admin`) and, for clients of the llm-d indexer,
//! `indexer.v1.IndexerService/GetPodScores` (`llmd`); the state they share,
//! admission, deadlines and the decode-error mapping.
//!
//! Invariants: every request is validated before any work; at most `maxConcurrentRequests`
//! score requests run at once (beyond: RESOURCE_EXHAUSTED, at once, rather than queueing behind
//! a backlog); what changes the index (ClearPod, RecordRouting) is closed unless configured.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::config::ServerConfig;
use crate::ingest::{LogHandle, Pods};
use crate::metrics::Metrics;
use crate::server::routing::{self, PromptKeys};
use kv_core::Indexer;
use kv_proto::kvindexer_v1;
use kv_tokenize::TokenizerService;

/// State shared by both services.
pub struct ScoreService {
    pub(super) indexer: Arc<Indexer>,
    pub(crate) tokenizers: Arc<TokenizerService>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) pods: Pods,
    pub(super) limits: ServerConfig,
    in_flight: Arc<Semaphore>,
    /// The shared log (replication): recorded routings go to every replica through it (admin
    /// clears go through the pod's worker, which appends them).
    log: Option<LogHandle>,
    /// The prompt keys ScorePods handed out (for RecordRouting).
    pub(super) prompt_keys: PromptKeys,
}

impl ScoreService {
    /// A service over `indexer`, limited by `limits`.
    pub fn new(
        indexer: Arc<Indexer>,
        tokenizers: Arc<TokenizerService>,
        metrics: Arc<Metrics>,
        pods: Pods,
        limits: ServerConfig,
        log: Option<LogHandle>,
    ) -> Arc<Self> {
        Arc::new(Self {
            in_flight: Arc::new(Semaphore::new(limits.max_concurrent_requests)),
            indexer,
            tokenizers,
            metrics,
            pods,
            limits,
            log,
            prompt_keys: PromptKeys::default(),
        })
    }

    /// Takes a slot of `maxConcurrentRequests`, or refuses at once.
    pub(crate) fn admit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        self.in_flight.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "too many score requests in flight (server.maxConcurrentRequests = {})",
                self.limits.max_concurrent_requests
            ))
        })
    }

    /// `RecordRouting` on this service's prompt keys and shared log (the RPC, once admitted;
    /// the endpoint picker records its picks through it).
    pub(crate) fn record(
        &self,
        req: kvindexer_v1::RecordRoutingRequest,
    ) -> Result<kvindexer_v1::RecordRoutingResponse, Status> {
        routing::record_routing(
            &self.indexer,
            &self.prompt_keys,
            &self.metrics,
            self.log.as_ref(),
            self.limits.max_prompt_tokens,
            req,
        )
    }

    /// Counts an RPC's outcome by gRPC code.
    pub(super) fn count_request(&self, rpc: &str, status: &Result<(), &Status>) {
        let code = match status {
            Ok(()) => "OK".to_owned(),
            Err(s) => format!("{:?}", s.code()),
        };
        self.metrics.scoring.request(rpc, &code);
    }
}

/// `kvindexer.v1.KvIndexer`.
#[derive(Clone)]
pub struct KvIndexerApi(pub Arc<ScoreService>);

#[tonic::async_trait]
impl kvindexer_v1::kv_indexer_server::KvIndexer for KvIndexerApi {
    async fn score_pods(
        &self,
        request: Request<kvindexer_v1::ScorePodsRequest>,
    ) -> Result<Response<kvindexer_v1::ScorePodsResponse>, Status> {
        let svc = &self.0;
        let deadline = deadline_of(&request);
        let result = match svc.admit() {
            Ok(_permit) => svc.score(request.into_inner(), deadline).await,
            Err(s) => Err(s),
        };
        svc.count_request("ScorePods", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    async fn record_routing(
        &self,
        request: Request<kvindexer_v1::RecordRoutingRequest>,
    ) -> Result<Response<kvindexer_v1::RecordRoutingResponse>, Status> {
        let svc = &self.0;
        if !svc.limits.enable_record_routing {
            svc.metrics
                .scoring
                .request("RecordRouting", "PermissionDenied");
            return Err(Status::permission_denied(
                "RecordRouting changes scores (speculative entries) and is disabled; enable it \
                 with server.enableRecordRouting",
            ));
        }
        let result = match svc.admit() {
            Ok(_permit) => svc.record(request.into_inner()),
            Err(s) => Err(s),
        };
        svc.count_request("RecordRouting", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    async fn list_pods(
        &self,
        request: Request<kvindexer_v1::ListPodsRequest>,
    ) -> Result<Response<kvindexer_v1::ListPodsResponse>, Status> {
        Ok(Response::new(self.0.list_pods(&request.into_inner().model)))
    }

    async fn clear_pod(
        &self,
        request: Request<kvindexer_v1::ClearPodRequest>,
    ) -> Result<Response<kvindexer_v1::ClearPodResponse>, Status> {
        self.0.clear_pod(request).await.map(Response::new)
    }
}

/// tonic answers a request that does not decode (not protobuf, or a string field that is not
/// UTF-8) with INTERNAL, as if the server were at fault; this layer turns that answer into
/// INVALID_ARGUMENT, the client's error. Decode errors happen before any handler, so the
/// status is in the headers of a trailers-only response.
pub fn undecodable_is_invalid_argument<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let internal = headers.get("grpc-status").is_some_and(|s| s == "13");
    let decode = headers.get("grpc-message").is_some_and(|m| {
        let m = m.as_bytes();
        m.starts_with(b"failed%20to%20decode%20Protobuf")
            || m.starts_with(b"failed to decode Protobuf")
    });
    if internal && decode {
        headers.insert("grpc-status", http::HeaderValue::from_static("3"));
    }
    response
}

/// The request's deadline: its `grpc-timeout`, else 10 s.
pub(super) fn deadline_of<T>(request: &Request<T>) -> Instant {
    let timeout = request
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
        .unwrap_or(std::time::Duration::from_secs(10));
    Instant::now() + timeout
}

/// gRPC's `grpc-timeout` header: digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(v: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(
            parse_grpc_timeout("100m"),
            Some(std::time::Duration::from_millis(100))
        );
        assert_eq!(
            parse_grpc_timeout("2S"),
            Some(std::time::Duration::from_secs(2))
        );
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }
}
