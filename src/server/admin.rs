//! The admin RPCs: `ListPods` (what the index, the publishers and the endpoint picker's pool
//! say of each pod; read-only)
//! and `ClearPod` (changes the index: closed unless `server.enableAdminRpcs`, then only with
//! the bearer token).
//!
//! Invariant: a clear goes through the pod's ingest worker (`Pods::clear_pod`), ordered with
//! the pod's messages, like every other change to a pod.

use std::sync::Arc;

use tonic::{Request, Status};

use super::grpc::KvIndexerApi;
use crate::ingest::lifecycle::{unix_ms, Presence};
use crate::ingest::PublisherKey;
use crate::pool::Pool;
use kv_core::Standing;
use kv_proto::kvindexer_v1;

impl KvIndexerApi {
    /// Admits an RPC that changes the index: refused unless `server.enableAdminRpcs`, then only
    /// with `authorization: Bearer <server.adminToken>`.
    fn authorize_admin<T>(&self, rpc: &str, request: &Request<T>) -> Result<(), Status> {
        let svc = &self.0;
        if !svc.limits.enable_admin_rpcs {
            svc.metrics.scoring.request(rpc, "PermissionDenied");
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
        if !constant_time_eq(presented.as_bytes(), svc.limits.admin_token.as_bytes()) {
            svc.metrics.scoring.request(rpc, "Unauthenticated");
            tracing::warn!(rpc, "admin RPC refused: missing or wrong bearer token");
            return Err(Status::unauthenticated(format!(
                "{rpc} needs `authorization: Bearer <server.adminToken>`"
            )));
        }
        Ok(())
    }

    /// `ListPods`: every engine of every model (or of `want`), with its publisher's stream
    /// state, hash checks, presence and speculation, sorted by (model, pod, rank).
    pub(super) fn list_pods(&self, want: &str) -> kvindexer_v1::ListPodsResponse {
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
            let modes = model.key_modes();
            let notes = model.key_notes();
            let model_name: Arc<str> = model.name().into();
            for (key, blocks) in model.index().engine_blocks() {
                let publisher = publishers
                    .get(&PublisherKey {
                        engine: key.clone(),
                        model: model_name.clone(),
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
                let (key_mode, translated_blocks) = modes
                    .get(&key)
                    .map_or(("", 0), |&(mode, n)| (mode.label(), n as u64));
                let note = notes.get(&key).copied().unwrap_or_default();
                pods.push(kvindexer_v1::PodInfo {
                    model: model.name().to_owned(),
                    pod: key.pod.to_string(),
                    data_parallel_rank: key.dp_rank,
                    key_mode: key_mode.to_owned(),
                    translated_blocks,
                    unplaced_hashes: note.unplaced_hashes,
                    alignable_block_size: note.alignable_block_size.unwrap_or(0),
                    blocks,
                    last_sequence,
                    hash_matches: check.matches,
                    hash_mismatches: check.mismatches,
                    messages_lost: publisher.messages_lost,
                    gap_fill_failures: publisher.gap_fill_failures,
                    messages_dropped: publisher.messages_dropped,
                    stale: publisher.stale,
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
        let (pool, pool_source) = match &self.1 {
            Some(p) => {
                mark_standings(p, &mut pods);
                (pool_listing(p), p.kind().label().to_owned())
            }
            None => (Vec::new(), String::new()),
        };
        kvindexer_v1::ListPodsResponse {
            pods,
            pool,
            pool_source,
        }
    }

    /// `ClearPod`: forgets a pod of a model on this replica (through its worker) and, with
    /// replication, on every other.
    pub(super) async fn clear_pod(
        &self,
        request: Request<kvindexer_v1::ClearPodRequest>,
    ) -> Result<kvindexer_v1::ClearPodResponse, Status> {
        self.authorize_admin("ClearPod", &request)?;
        let req = request.into_inner();
        if req.model.is_empty() || req.pod.is_empty() {
            return Err(Status::invalid_argument("model and pod are required"));
        }
        if self.0.indexer.model(&req.model).is_none() {
            return Err(Status::not_found(format!("unknown model {:?}", req.model)));
        }
        let removed = self
            .0
            .pods
            .clear_pod(req.model.as_str().into(), req.pod.as_str().into())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(kvindexer_v1::ClearPodResponse {
            removed: removed as u64,
        })
    }
}

/// Each listed pod's standing as a candidate: with a pool, the best of its endpoints' (none:
/// not in the pool); without, its health.
fn mark_standings(pool: &Pool, pods: &mut [kvindexer_v1::PodInfo]) {
    let listed = pool.listing();
    for info in pods {
        let standing = match pool.is_pool() {
            true => listed
                .iter()
                .filter(|l| l.endpoint.pod == info.pod)
                .map(|l| l.standing)
                .min()
                .unwrap_or(Standing::NotInPool),
            false => pool.standing(&info.pod).0,
        };
        info.standing = standing.label().to_owned();
    }
}

/// The pool's endpoints as `ListPods` lists them.
fn pool_listing(pool: &Pool) -> Vec<kvindexer_v1::PoolEndpoint> {
    pool.listing()
        .into_iter()
        .map(|l| kvindexer_v1::PoolEndpoint {
            address: l.endpoint.address,
            pod: l.endpoint.pod,
            data_parallel_rank: l.endpoint.rank,
            name: l.endpoint.name,
            standing: l.standing.label().to_owned(),
            failed_scrapes: l.failures,
        })
        .collect()
}

/// Compares secrets without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
