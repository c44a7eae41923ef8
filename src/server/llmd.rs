//! llm-d compatibility: `indexer.v1.IndexerService/GetPodScores`, for gateways built against
//! the llm-d indexer's API. A prompt in, pod scores out, through the same path as `ScorePods`:
//! as llm-d's server answers, one entry per (pod, rank) for a data-parallel pod (the rank set,
//! 0 included) and one entry without a rank for a pod without data parallelism. A pod that
//! holds nothing of the prompt is listed once, with 0 and no rank.

use tonic::{Request, Response, Status};

use super::grpc::{deadline_of, score_rpc};
use crate::scoring::{Prompt, ScoreRequest, Scoring};
use kv_proto::{indexer_v1, kvindexer_v1};
use std::sync::Arc;

/// `indexer.v1.IndexerService` (llm-d compatibility).
#[derive(Clone)]
pub struct LlmdIndexerApi(pub Arc<Scoring>);

#[tonic::async_trait]
impl indexer_v1::indexer_service_server::IndexerService for LlmdIndexerApi {
    async fn get_pod_scores(
        &self,
        request: Request<indexer_v1::GetPodScoresRequest>,
    ) -> Result<Response<indexer_v1::GetPodScoresResponse>, Status> {
        let deadline = deadline_of(&request);
        let req = request.into_inner();
        let score = ScoreRequest {
            model: req.model_name,
            prompt: Prompt::Text(req.prompt),
            lora: String::new(),
            cache_salt: String::new(),
            candidates: req.pod_identifiers,
            every_rank: true,
        };
        let result = score_rpc(&self.0, "GetPodScores", Ok(score), deadline)
            .await
            .map(|resp| indexer_v1::GetPodScoresResponse {
                scores: per_rank(resp),
            });
        result.map(Response::new)
    }
}

/// ScorePods' answer as llm-d lists it: each data-parallel pod's holding ranks apart (their
/// real blocks), every other pod once.
fn per_rank(resp: kvindexer_v1::ScorePodsResponse) -> Vec<indexer_v1::PodScore> {
    let mut ranks: std::collections::HashMap<&str, Vec<&kvindexer_v1::RankScore>> =
        std::collections::HashMap::new();
    for r in &resp.rank_scores {
        if r.data_parallel_rank.is_some() {
            ranks.entry(r.pod.as_str()).or_default().push(r);
        }
    }
    let mut out = Vec::with_capacity(resp.scores.len() + resp.rank_scores.len());
    for s in &resp.scores {
        let rank = |r: Option<u32>| r.and_then(|r| i32::try_from(r).ok());
        match ranks.get(s.pod.as_str()) {
            Some(held) => out.extend(held.iter().map(|r| indexer_v1::PodScore {
                pod: s.pod.clone(),
                score: r.score,
                data_parallel_rank: rank(r.data_parallel_rank),
            })),
            None => out.push(indexer_v1::PodScore {
                pod: s.pod.clone(),
                score: s.score,
                data_parallel_rank: rank(s.data_parallel_rank),
            }),
        }
    }
    out
}
