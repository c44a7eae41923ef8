//! The gRPC services: `kvindexer.v1.KvIndexer` (ScorePods and admin) and, for clients of the
//! llm-d indexer, `indexer.v1.IndexerService/GetPodScores`.
//!
//! Invariants: every request is validated before any work (empty or oversize input is
//! INVALID_ARGUMENT, an unknown model NOT_FOUND); at most `maxConcurrentRequests` score requests
//! run at once (beyond: RESOURCE_EXHAUSTED, at once, rather than queueing behind a backlog);
//! scoring never blocks event application (reads take no index lock).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::config::ServerConfig;
use crate::ingest::lifecycle::{unix_ms, Presence};
use crate::ingest::{Pods, PublisherKey};
use crate::metrics::Metrics;
use crate::replication::{LogSink, Record};
use crate::server::routing::{self, PromptKeys, ScoredPrompt};
use kv_core::{Indexer, ScoreError};
use kv_tokenize::LoadError;
use kv_tokenize::{ChatInput, ChatMessage};
use kv_tokenize::{TokenizeError, TokenizerService};

pub use kv_proto::{indexer_v1, kvindexer_v1, FILE_DESCRIPTOR_SET};
use kvindexer_v1::score_pods_request::Input;

/// State shared by both services.
pub struct ScoreService {
    indexer: Arc<Indexer>,
    tokenizers: Arc<TokenizerService>,
    metrics: Arc<Metrics>,
    pods: Pods,
    limits: ServerConfig,
    in_flight: Arc<Semaphore>,
    /// Replication's append queue: admin clears and recorded routings go to every replica
    /// through the log.
    log: Option<LogSink>,
    /// The prompt keys ScorePods handed out (for RecordRouting).
    prompt_keys: PromptKeys,
}

impl ScoreService {
    /// A service over `indexer`, limited by `limits`.
    pub fn new(
        indexer: Arc<Indexer>,
        tokenizers: Arc<TokenizerService>,
        metrics: Arc<Metrics>,
        pods: Pods,
        limits: ServerConfig,
        log: Option<LogSink>,
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

    fn admit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        self.in_flight.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "too many score requests in flight (server.maxConcurrentRequests = {})",
                self.limits.max_concurrent_requests
            ))
        })
    }

    /// Admits an RPC that changes the index: refused unless `server.enableAdminRpcs`, then only
    /// with `authorization: Bearer <server.adminToken>`.
    fn authorize_admin<T>(&self, rpc: &str, request: &Request<T>) -> Result<(), Status> {
        if !self.limits.enable_admin_rpcs {
            self.metrics.scoring.request(rpc, "PermissionDenied");
            return Err(Status::permission_denied(format!(
                "{rpc} changes the index and is disabled; enable it with server.enableAdminRpcs \
                 (and server.adminToken)"
            )));
        }
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(presented.as_bytes(), self.limits.admin_token.as_bytes()) {
            self.metrics.scoring.request(rpc, "Unauthenticated");
            tracing::warn!(rpc, "admin RPC refused: missing or wrong bearer token");
            return Err(Status::unauthenticated(format!(
                "{rpc} needs `authorization: Bearer <server.adminToken>`"
            )));
        }
        Ok(())
    }

    fn check_pods(&self, pods: &[String]) -> Result<(), Status> {
        if pods.len() > self.limits.max_candidate_pods {
            return Err(Status::invalid_argument(format!(
                "{} candidate pods; at most {} (server.maxCandidatePods)",
                pods.len(),
                self.limits.max_candidate_pods
            )));
        }
        Ok(())
    }

    fn record(&self, rpc: &str, status: &Result<(), &Status>) {
        let code = match status {
            Ok(()) => "OK".to_owned(),
            Err(s) => format!("{:?}", s.code()),
        };
        self.metrics.scoring.request(rpc, &code);
    }

    fn check_prompt_text(&self, text: &str) -> Result<(), Status> {
        if text.is_empty() {
            return Err(Status::invalid_argument("the prompt is empty"));
        }
        if text.len() > self.limits.max_prompt_bytes {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} bytes; at most {} (server.maxPromptBytes)",
                text.len(),
                self.limits.max_prompt_bytes
            )));
        }
        Ok(())
    }

    /// Fails fast for a model neither configured nor seen in events (before any tokenizing).
    fn check_model(&self, model: &str) -> Result<(), Status> {
        if self.indexer.model(model).is_none() {
            return Err(Status::not_found(
                ScoreError::UnknownModel(model.to_owned()).to_string(),
            ));
        }
        Ok(())
    }

    async fn score(
        &self,
        req: kvindexer_v1::ScorePodsRequest,
        deadline: Instant,
    ) -> Result<kvindexer_v1::ScorePodsResponse, Status> {
        if req.model.is_empty() {
            return Err(Status::invalid_argument("model is required"));
        }
        self.check_pods(&req.pods)?;
        let started = Instant::now();
        let (tokens, input_kind) = match req.input {
            None => {
                return Err(Status::invalid_argument(
                    "input is required: prompt, tokens or chat",
                ))
            }
            Some(Input::Tokens(t)) => (t.ids, "tokens"),
            Some(Input::Prompt(text)) => {
                self.check_prompt_text(&text)?;
                self.check_model(&req.model)?;
                let t = self
                    .tokenizers
                    .encode_prompt(&req.model, text, deadline)
                    .await
                    .map_err(tokenize_status)?;
                (t.ids, "prompt")
            }
            Some(Input::Chat(chat)) => {
                if chat.messages.is_empty() {
                    return Err(Status::invalid_argument("the chat has no messages"));
                }
                if chat.messages.len() > self.limits.max_chat_messages {
                    return Err(Status::invalid_argument(format!(
                        "the chat has {} messages; at most {} (server.maxChatMessages)",
                        chat.messages.len(),
                        self.limits.max_chat_messages
                    )));
                }
                let bytes: usize = chat
                    .messages
                    .iter()
                    .map(|m| m.role.len() + m.content.len())
                    .sum::<usize>()
                    + chat.tools_json.len()
                    + chat.chat_template_kwargs_json.len();
                if bytes > self.limits.max_prompt_bytes {
                    return Err(Status::invalid_argument(format!(
                        "the chat has {bytes} bytes; at most {} (server.maxPromptBytes)",
                        self.limits.max_prompt_bytes
                    )));
                }
                self.check_model(&req.model)?;
                let input = ChatInput::from_request(
                    chat.messages
                        .into_iter()
                        .map(|m| ChatMessage {
                            role: m.role,
                            content: m.content,
                        })
                        .collect(),
                    chat.add_generation_prompt,
                    &chat.chat_template_kwargs_json,
                    &chat.tools_json,
                )
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
                let t = self
                    .tokenizers
                    .encode_chat(&req.model, input, deadline)
                    .await
                    .map_err(tokenize_status)?;
                (t.ids, "chat")
            }
        };
        if tokens.is_empty() {
            return Err(Status::invalid_argument("the prompt has no tokens"));
        }
        if tokens.len() > self.limits.max_prompt_tokens {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} tokens; at most {} (server.maxPromptTokens)",
                tokens.len(),
                self.limits.max_prompt_tokens
            )));
        }
        let walk_started = Instant::now();
        let unknown_model = |e: ScoreError| match e {
            ScoreError::UnknownModel(_) => Status::not_found(e.to_string()),
            ScoreError::UnknownLora(_) => Status::invalid_argument(e.to_string()),
        };
        let lora = Some(req.lora_name.as_str());
        let salt = Some(req.cache_salt.as_str());
        // The hashes are kept only when a prompt key can be used (RecordRouting enabled);
        // otherwise the indexer hashes in its per-thread scratch and nothing is kept.
        let (mut result, hashes) = if self.limits.enable_record_routing {
            let hashes = self
                .indexer
                .block_hashes(&req.model, &tokens, lora, salt)
                .map_err(unknown_model)?;
            let result = self
                .indexer
                .score_hashes(&req.model, &hashes, &req.pods)
                .map_err(unknown_model)?;
            (result, Some(hashes))
        } else {
            let result = self
                .indexer
                .score_tokens(&req.model, &tokens, &req.pods, lora, salt)
                .map_err(unknown_model)?;
            (result, None)
        };
        result.prompt_tokens = tokens.len() as u32;
        self.metrics.scoring.lookup(
            result.scores.iter().any(|s| s.matched_blocks > 0),
            walk_started.elapsed(),
        );
        let scores = result
            .named()
            .map(|(pod, s)| kvindexer_v1::PodScore {
                pod: pod.to_owned(),
                score: s.score,
                matched_blocks: s.matched_blocks,
                speculative_blocks: s.speculative_blocks,
            })
            .collect();
        let prompt_key = hashes.map_or_else(Vec::new, |hashes| {
            self.prompt_keys.issue(ScoredPrompt {
                model: req.model.as_str().into(),
                hashes: hashes.into(),
                candidates: req.pods,
            })
        });
        self.metrics.scoring.served(input_kind, started.elapsed());
        Ok(kvindexer_v1::ScorePodsResponse {
            scores,
            total_blocks: result.total_blocks,
            prompt_tokens: result.prompt_tokens,
            prompt_key,
        })
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
        svc.record("ScorePods", &result.as_ref().map(|_| ()));
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
            Ok(_permit) => routing::record_routing(
                &svc.indexer,
                &svc.prompt_keys,
                &svc.metrics,
                svc.log.as_ref(),
                svc.limits.max_prompt_tokens,
                request.into_inner(),
            ),
            Err(s) => Err(s),
        };
        svc.record("RecordRouting", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    async fn list_pods(
        &self,
        request: Request<kvindexer_v1::ListPodsRequest>,
    ) -> Result<Response<kvindexer_v1::ListPodsResponse>, Status> {
        let want = request.into_inner().model;
        let svc = &self.0;
        let publishers: std::collections::HashMap<_, _> =
            svc.pods.publishers.snapshot().into_iter().collect();
        let presence = svc.pods.presence();
        let mut pods = Vec::new();
        for model in svc.indexer.models() {
            if !want.is_empty() && model.name() != want {
                continue;
            }
            let checks = model.hash_checks();
            let model_name: Arc<str> = model.name().into();
            for (key, blocks) in model.index().engine_blocks() {
                let publisher = publishers
                    .get(&PublisherKey {
                        pod: key.pod.clone(),
                        model: model_name.clone(),
                        rank: key.dp_rank,
                    })
                    .cloned()
                    .unwrap_or_default();
                let last_sequence = publisher.last_seq.map_or(-1, |s| s as i64);
                let check = checks.get(&key.pod).cloned().unwrap_or_default();
                let (state, state_since, last_message) = match presence.get(&key.pod) {
                    Some(&(p, last)) => {
                        let (state, since) = match p {
                            Presence::Live => (kvindexer_v1::PodState::Live, None),
                            Presence::Idle(t) => (kvindexer_v1::PodState::Idle, Some(t)),
                            Presence::Gone(t) => (kvindexer_v1::PodState::Gone, Some(t)),
                        };
                        (state, since.map_or(0, unix_ms), unix_ms(last))
                    }
                    None => (kvindexer_v1::PodState::Unspecified, 0, 0),
                };
                pods.push(kvindexer_v1::PodInfo {
                    model: model.name().to_owned(),
                    pod: key.pod.to_string(),
                    data_parallel_rank: key.dp_rank,
                    blocks,
                    last_sequence,
                    hash_matches: check.matches,
                    hash_mismatches: check.mismatches,
                    messages_lost: publisher.messages_lost,
                    gap_fill_failures: publisher.gap_fill_failures,
                    received_by: publisher.received_by.to_string(),
                    state: state as i32,
                    state_since_unix_ms: state_since,
                    last_message_unix_ms: last_message,
                    // Filled below, once per pod.
                    ..Default::default()
                });
            }
            // Pods known only by their recorded routings (no events for this model).
            let directory = model.index().directory();
            for pod in model.speculative_pods() {
                if !directory.engines_of(&pod).is_empty() {
                    continue;
                }
                let spec = model.speculation_of(&pod).unwrap_or_default();
                pods.push(kvindexer_v1::PodInfo {
                    model: model.name().to_owned(),
                    pod: pod.to_string(),
                    last_sequence: -1,
                    speculative_records: spec.records,
                    speculative_blocks: spec.blocks,
                    speculative_fallback: spec.fallback,
                    ..Default::default()
                });
            }
        }
        pods.sort_by(|a, b| {
            (&a.model, &a.pod, a.data_parallel_rank).cmp(&(&b.model, &b.pod, b.data_parallel_rank))
        });
        // A pod's speculation (per pod, not per engine) goes on its lowest rank's entry.
        for i in 0..pods.len() {
            let first_rank =
                i == 0 || (&pods[i - 1].model, &pods[i - 1].pod) != (&pods[i].model, &pods[i].pod);
            if !first_rank || pods[i].speculative_records > 0 {
                continue;
            }
            let spec = svc
                .indexer
                .model(&pods[i].model)
                .and_then(|m| m.speculation_of(&pods[i].pod));
            if let Some(spec) = spec {
                pods[i].speculative_records = spec.records;
                pods[i].speculative_blocks = spec.blocks;
                pods[i].speculative_fallback = spec.fallback;
            }
        }
        Ok(Response::new(kvindexer_v1::ListPodsResponse { pods }))
    }

    async fn clear_pod(
        &self,
        request: Request<kvindexer_v1::ClearPodRequest>,
    ) -> Result<Response<kvindexer_v1::ClearPodResponse>, Status> {
        self.0.authorize_admin("ClearPod", &request)?;
        let req = request.into_inner();
        if req.model.is_empty() || req.pod.is_empty() {
            return Err(Status::invalid_argument("model and pod are required"));
        }
        if self.0.indexer.model(&req.model).is_none() {
            return Err(Status::not_found(format!("unknown model {:?}", req.model)));
        }
        let removed = self.0.indexer.remove_pod(&req.model, &req.pod);
        self.0.pods.publishers.forget_pod(&req.model, &req.pod);
        self.0
            .metrics
            .ingest
            .forgotten(&req.pod, &[req.model.as_str().into()], "cleared");
        if let Some(log) = &self.0.log {
            log.append(Record::ClearPod {
                model: req.model.as_str().into(),
                pod: req.pod.as_str().into(),
            });
        }
        tracing::info!(model = %req.model, pod = %req.pod, removed, "pod cleared by admin request");
        Ok(Response::new(kvindexer_v1::ClearPodResponse {
            removed: removed as u64,
        }))
    }
}

/// `indexer.v1.IndexerService` (llm-d compatibility).
#[derive(Clone)]
pub struct LlmdIndexerApi(pub Arc<ScoreService>);

#[tonic::async_trait]
impl indexer_v1::indexer_service_server::IndexerService for LlmdIndexerApi {
    async fn get_pod_scores(
        &self,
        request: Request<indexer_v1::GetPodScoresRequest>,
    ) -> Result<Response<indexer_v1::GetPodScoresResponse>, Status> {
        let deadline = deadline_of(&request);
        let req = request.into_inner();
        let result = match self.0.admit() {
            Ok(_permit) => {
                let r = kvindexer_v1::ScorePodsRequest {
                    model: req.model_name,
                    input: Some(Input::Prompt(req.prompt)),
                    pods: req.pod_identifiers,
                    ..Default::default()
                };
                self.0
                    .score(r, deadline)
                    .await
                    .map(|resp| indexer_v1::GetPodScoresResponse {
                        scores: resp
                            .scores
                            .into_iter()
                            .map(|s| indexer_v1::PodScore {
                                pod: s.pod,
                                score: s.score,
                                data_parallel_rank: 0,
                            })
                            .collect(),
                    })
            }
            Err(s) => Err(s),
        };
        self.0.record("GetPodScores", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }
}

/// The request's deadline: its `grpc-timeout`, else 10 s.
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

/// Compares secrets without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn deadline_of<T>(request: &Request<T>) -> Instant {
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

/// How tokenization failures surface: the model and the cause, with a code a client can act on.
fn tokenize_status(e: TokenizeError) -> Status {
    let msg = e.to_string();
    match e {
        TokenizeError::Load(LoadError::Download { .. }) => Status::unavailable(msg),
        TokenizeError::Load(_) => Status::failed_precondition(msg),
        TokenizeError::Chat(_) | TokenizeError::Encode { .. } => Status::invalid_argument(msg),
        TokenizeError::Overloaded(_) => Status::resource_exhausted(msg),
        TokenizeError::DeadlineExceeded => Status::deadline_exceeded(msg),
    }
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
