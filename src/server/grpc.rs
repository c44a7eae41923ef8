//! The gRPC services' front: `kvindexer.v1.KvIndexer` (ScorePods and RecordRouting mapped onto
//! the daemon's scoring, ListPods and ClearPod in `admin`) and, for clients of the llm-d
//! indexer, `indexer.v1.IndexerService/GetPodScores` (`llmd`); the mapping of the daemon's
//! scoring types and errors to protobuf and gRPC codes, deadlines and the decode-error mapping.
//!
//! Invariants: scoring's kinds map to one gRPC code each ([`status_of`]); every RPC's outcome
//! is counted by code; what changes the index (ClearPod, RecordRouting) is closed unless
//! configured.

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use crate::pool::Pool;
use crate::scoring::routing::RoutingRecord;
use crate::scoring::{Prompt, ScoreRequest, Scores, Scoring, ScoringError};
use kv_proto::kvindexer_v1;
use kv_proto::kvindexer_v1::score_pods_request::Input;
use kv_tokenize::{ChatInput, ChatMessage};

/// The daemon's scoring errors as gRPC statuses.
pub(super) fn status_of(e: ScoringError) -> Status {
    match e {
        ScoringError::Invalid(m) => Status::invalid_argument(m),
        ScoringError::NotFound(m) => Status::not_found(m),
        ScoringError::Overloaded(m) => Status::resource_exhausted(m),
        ScoringError::Unavailable(m) => Status::unavailable(m),
        ScoringError::NotReady(m) | ScoringError::Unscorable(m) => Status::failed_precondition(m),
        ScoringError::DeadlineExceeded(m) => Status::deadline_exceeded(m),
    }
}

/// A `ScorePodsRequest` as the daemon's score request.
pub(super) fn score_request(
    req: kvindexer_v1::ScorePodsRequest,
) -> Result<ScoreRequest, ScoringError> {
    let prompt = match req.input {
        None => {
            return Err(ScoringError::Invalid(
                "input is required: prompt, tokens or chat".into(),
            ))
        }
        Some(Input::Tokens(t)) => Prompt::Tokens(t.ids),
        Some(Input::TokenIdsLe(bytes)) => Prompt::PackedTokens(bytes),
        Some(Input::Prompt(text)) => Prompt::Text(text),
        Some(Input::Chat(chat)) => {
            let messages = chat
                .messages
                .into_iter()
                .map(|m| ChatMessage {
                    role: m.role,
                    content: m.content,
                })
                .collect();
            let input = ChatInput::from_request(
                messages,
                chat.add_generation_prompt,
                &chat.chat_template_kwargs_json,
                &chat.tools_json,
            )
            .map_err(|e| ScoringError::Invalid(e.to_string()))?;
            Prompt::Chat(input)
        }
    };
    Ok(ScoreRequest {
        model: req.model,
        prompt,
        lora: req.lora_name,
        cache_salt: req.cache_salt,
        candidates: req.pods,
        every_rank: req.every_rank,
    })
}

/// The daemon's scores as a `ScorePodsResponse`.
pub(super) fn score_response(s: Scores) -> kvindexer_v1::ScorePodsResponse {
    let r = &s.result;
    kvindexer_v1::ScorePodsResponse {
        scores: r
            .named()
            .map(|(pod, p)| kvindexer_v1::PodScore {
                pod: pod.to_owned(),
                score: p.score,
                matched_blocks: p.matched_blocks,
                speculative_blocks: p.speculative_blocks,
                data_parallel_rank: p.rank,
            })
            .collect(),
        total_blocks: r.total_blocks,
        prompt_tokens: r.prompt_tokens,
        prompt_key: s.prompt_key,
        rank_scores: r
            .ranks
            .iter()
            .map(|k| kvindexer_v1::RankScore {
                pod: r.pod_name(k.pod).to_owned(),
                data_parallel_rank: k.rank,
                score: k.score,
                matched_blocks: k.matched_blocks,
            })
            .collect(),
    }
}

/// Admits, scores and counts one score RPC (`rpc` names it in the metrics).
pub(super) async fn score_rpc(
    svc: &Scoring,
    rpc: &str,
    req: Result<ScoreRequest, ScoringError>,
    deadline: Instant,
) -> Result<kvindexer_v1::ScorePodsResponse, Status> {
    let result = match (svc.admit(), req) {
        (Ok(_permit), Ok(req)) => svc.score(req, deadline).await.map(score_response),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
    .map_err(status_of);
    count_request(svc, rpc, &result.as_ref().map(|_| ()));
    result
}

/// Counts an RPC's outcome by gRPC code.
pub(super) fn count_request(svc: &Scoring, rpc: &str, status: &Result<(), &Status>) {
    let code = match status {
        Ok(()) => "OK".to_owned(),
        Err(s) => format!("{:?}", s.code()),
    };
    svc.metrics.scoring.request(rpc, &code);
}

/// `kvindexer.v1.KvIndexer`: scoring, and the endpoint picker's pool (for `ListPods`) when the
/// picker is on.
#[derive(Clone)]
pub struct KvIndexerApi(pub Arc<Scoring>, pub Option<Arc<Pool>>);

#[tonic::async_trait]
impl kvindexer_v1::kv_indexer_server::KvIndexer for KvIndexerApi {
    async fn score_pods(
        &self,
        request: Request<kvindexer_v1::ScorePodsRequest>,
    ) -> Result<Response<kvindexer_v1::ScorePodsResponse>, Status> {
        let deadline = deadline_of(&request);
        let req = score_request(request.into_inner());
        score_rpc(&self.0, "ScorePods", req, deadline)
            .await
            .map(Response::new)
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
        let req = request.into_inner();
        let record = RoutingRecord {
            model: req.model,
            pod: req.pod,
            prompt_key: req.prompt_key,
            tokens: req.tokens.map(|t| t.ids),
            lora: req.lora_name,
            cache_salt: req.cache_salt,
            rank: req.data_parallel_rank,
        };
        let result = svc
            .admit()
            .and_then(|_permit| svc.record(record))
            .map(|blocks| kvindexer_v1::RecordRoutingResponse { blocks })
            .map_err(status_of);
        count_request(svc, "RecordRouting", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    async fn list_pods(
        &self,
        request: Request<kvindexer_v1::ListPodsRequest>,
    ) -> Result<Response<kvindexer_v1::ListPodsResponse>, Status> {
        Ok(Response::new(self.list_pods(&request.into_inner().model)))
    }

    async fn clear_pod(
        &self,
        request: Request<kvindexer_v1::ClearPodRequest>,
    ) -> Result<Response<kvindexer_v1::ClearPodResponse>, Status> {
        self.clear_pod(request).await.map(Response::new)
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
