//! The ScorePods callers of a load run: `score_concurrency` connections, each calling in a
//! loop with the next document's tokens and every pod as a candidate, timing each call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kv_proto::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ScorePodsRequest, TokenIds,
};

use super::args::LoadgenArgs;
use super::calls::{channel, gather};
use super::documents::Document;
use super::error::LoadgenError;

async fn score_loop(
    mut client: KvIndexerClient<tonic::transport::Channel>,
    docs: Arc<Vec<Document>>,
    model: String,
    pods: Vec<String>,
    stop: Arc<AtomicBool>,
    offset: usize,
    packed: bool,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let mut latencies = Vec::new();
    let mut matched = 0u64;
    let mut i = offset;
    while !stop.load(Ordering::Relaxed) {
        let doc = &docs[i % docs.len()];
        i += 1;
        let input = if packed {
            Input::TokenIdsLe(kv_proto::token_ids_le::encode(&doc.tokens))
        } else {
            Input::Tokens(TokenIds {
                ids: doc.tokens.clone(),
            })
        };
        let req = ScorePodsRequest {
            model: model.clone(),
            input: Some(input),
            pods: pods.clone(),
            ..Default::default()
        };
        let t = Instant::now();
        let resp = client.score_pods(req).await;
        latencies.push(t.elapsed().as_nanos() as u64);
        match resp {
            Ok(r) => {
                matched += r
                    .into_inner()
                    .scores
                    .first()
                    .map_or(0, |s| s.matched_blocks as u64)
            }
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return Err(LoadgenError::Score(s)),
        }
    }
    Ok((latencies, matched))
}

/// Calls ScorePods from `score_concurrency` connections for `seconds`; every call's latency
/// (ns, sorted) and the blocks the first pod matched, summed.
pub(super) async fn score_calls(
    args: &LoadgenArgs,
    docs: &Arc<Vec<Document>>,
    pods: &[String],
    seconds: u64,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..args.score_concurrency {
        let client = KvIndexerClient::new(channel(&args.grpc).await?);
        tasks.push(tokio::spawn(score_loop(
            client,
            docs.clone(),
            args.model.clone(),
            pods.to_vec(),
            stop.clone(),
            c * 7,
            args.packed_tokens,
        )));
    }
    gather(tasks, &stop, seconds).await
}
