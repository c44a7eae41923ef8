//! `--agree-with URL`: after the load, whether other replicas hold what the daemon under load
//! holds. Each replica's `ListPods` becomes a map (model, pod, rank) -> memberships (entries
//! holding none left out); the maps must become equal within a deadline (the log's last
//! entries, and forgetting idle pods, take a moment to reach every replica). Also
//! `--replica-metrics`: how fast the other replicas applied what the daemon under load applied.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ListPodsRequest};

use super::error::LoadgenError;
use super::report::{AgreementReport, ReplicaReport};
use super::scrape::{http_get, metric_sum};

type Holdings = BTreeMap<(String, String, u32), u64>;

async fn holdings(url: &str) -> Result<Holdings, LoadgenError> {
    let grpc_error = |source| LoadgenError::Grpc {
        endpoint: url.to_owned(),
        source,
    };
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(grpc_error)?
        .connect()
        .await
        .map_err(grpc_error)?;
    let pods = KvIndexerClient::new(channel)
        .max_decoding_message_size(256 << 20)
        .list_pods(ListPodsRequest {
            model: String::new(),
        })
        .await
        .map_err(LoadgenError::Score)?
        .into_inner()
        .pods;
    Ok(pods
        .into_iter()
        .filter(|p| p.blocks > 0)
        .map(|p| ((p.model, p.pod, p.data_parallel_rank), p.blocks))
        .collect())
}

/// Compares `here` (the daemon under load) with `there` until they agree or `within` passes.
pub(super) async fn compare(
    here: &str,
    there: &str,
    within: Duration,
) -> Result<AgreementReport, LoadgenError> {
    let started = Instant::now();
    loop {
        let (a, b) = (holdings(here).await?, holdings(there).await?);
        let mut differing = a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count();
        differing += b.keys().filter(|k| !a.contains_key(*k)).count();
        if differing == 0 || started.elapsed() >= within {
            let example = a
                .iter()
                .find(|(k, v)| b.get(*k) != Some(v))
                .map(|((m, p, r), v)| {
                    format!(
                        "{m} {p} {r}: {v} vs {:?}",
                        b.get(&(m.clone(), p.clone(), *r))
                    )
                })
                .or_else(|| {
                    b.iter()
                        .find(|(k, _)| !a.contains_key(*k))
                        .map(|((m, p, r), v)| format!("{m} {p} {r}: none vs {v}"))
                });
            return Ok(AgreementReport {
                replica: there.to_owned(),
                agree: differing == 0,
                publishers: a.len(),
                memberships: a.values().sum(),
                differing,
                example,
                waited_s: started.elapsed().as_secs_f64(),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits (at most 60 s after the load) until the replica at `addr` has applied `applied`
/// blocks since `before`, or stops progressing for 5 s; reports its rate from the load's start.
pub(super) async fn follow_replica(
    addr: &str,
    before: &str,
    applied: f64,
    started: Instant,
) -> Result<ReplicaReport, LoadgenError> {
    let base = metric_sum(before, "kvindexer_blocks_applied_total");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut last, mut last_change) = (-1.0, Instant::now());
    loop {
        let page = http_get(addr, "/metrics").await?;
        let done = metric_sum(&page, "kvindexer_blocks_applied_total") - base;
        let now = Instant::now();
        if done != last {
            (last, last_change) = (done, now);
        }
        if done >= applied || now >= deadline || now - last_change > Duration::from_secs(5) {
            let at = if done >= applied { now } else { last_change };
            let seconds = (at - started).as_secs_f64();
            return Ok(ReplicaReport {
                metrics: addr.to_owned(),
                applied_blocks: done,
                caught_up: done >= applied,
                caught_up_after_s: seconds,
                applied_blocks_per_s: done / seconds.max(1e-9),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
