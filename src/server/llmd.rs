//! llm-d compatibility: `indexer.v1.IndexerService/GetPodScores`, for gateways built against
//! the llm-d indexer's API. A prompt in, pod scores out, through the same path as `ScorePods`.

use tonic::{Request, Response, Status};

use super::grpc::{deadline_of, ScoreService};
use kv_proto::kvindexer_v1::score_pods_request::Input;
use kv_proto::{indexer_v1, kvindexer_v1};
use std::sync::Arc;

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
        self.0
            .count_request("GetPodScores", &result.as_ref().map(|_| ()));
        result.map(Response::new)
    }
}
