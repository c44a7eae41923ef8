//! Publishers and checks shared by the pod lifecycle tests (`lifecycle.rs`, `churn.rs`): a
//! vLLM-shaped PUB socket connected to a bind-mode daemon, one-block messages, and waits.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_core::{encode_batch, BlockHash, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
use kv_indexer::config::ConfigDuration;
use kv_indexer::daemon::RunningDaemon;
use kv_proto::kvindexer_v1::{ListPodsRequest, PodInfo, PodState};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// The model every lifecycle test publishes for.
pub const MODEL: &str = "life/model";

/// Message `seq` of `pod` for [`MODEL`]: one `BlockStored` of `block`.
pub fn message(pod: &str, seq: u64, block: u64) -> ZmqMessage {
    model_message(MODEL, pod, seq, block)
}

/// Message `seq` of `pod` for `model`, as vLLM frames it: one `BlockStored` of `block`.
pub fn model_message(model: &str, pod: &str, seq: u64, block: u64) -> ZmqMessage {
    stored_message(model, pod, seq, &[BlockHash::new(block)])
}

/// Message `seq` of `pod` for `model`, as vLLM frames it: one `BlockStored` run of `hashes`
/// (GPU, rank 0).
pub fn stored_message(model: &str, pod: &str, seq: u64, hashes: &[BlockHash]) -> ZmqMessage {
    ranked_message(model, pod, 0, seq, hashes)
}

/// Message `seq` of data-parallel rank `rank` of `pod` for `model`: one `BlockStored` run of
/// `hashes` (GPU), the rank in the batch as vLLM's publisher fills it in. The test engines are
/// aligned: they publish the index's keys as their hashes.
pub fn ranked_message(
    model: &str,
    pod: &str,
    rank: i64,
    seq: u64,
    hashes: &[BlockHash],
) -> ZmqMessage {
    let published: Vec<EngineHash> = hashes.iter().map(|&k| EngineHash::aligned(k)).collect();
    let payload = encode_batch(&EventBatch::stored_on_gpu(1.7e9, rank, &published, 16));
    payload_message(model, pod, seq, &payload)
}

/// Message `seq` of `pod` for `model`: one map-form `BlockStored` of `hashes` with their
/// `tokens` (GPU, rank 0), as vLLM >= 0.24 publishes it.
pub fn token_stored_message(
    model: &str,
    pod: &str,
    seq: u64,
    hashes: &[BlockHash],
    tokens: &[u32],
    block_size: usize,
) -> ZmqMessage {
    ranked_token_message(model, (pod, 0), seq, hashes, tokens, block_size)
}

/// [`token_stored_message`] from data-parallel rank `rank` of `pod`.
pub fn ranked_token_message(
    model: &str,
    (pod, rank): (&str, i64),
    seq: u64,
    hashes: &[BlockHash],
    tokens: &[u32],
    block_size: usize,
) -> ZmqMessage {
    let payload = encode_batch(&EventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
            token_ids: tokens.to_vec(),
            block_size: block_size as u32,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(rank),
    });
    payload_message(model, pod, seq, &payload)
}

/// Message `seq` of `pod` for `model` carrying `payload` (a msgpack batch), as vLLM frames it:
/// topic, big-endian sequence, payload.
pub fn payload_message(model: &str, pod: &str, seq: u64, payload: &[u8]) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::from(format!("kv@{pod}@{model}")),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ])
    .expect("non-empty")
}

/// Whether the daemon's index says `pod` holds `block`.
pub fn holds(d: &RunningDaemon, pod: &str, block: u64) -> bool {
    let Some(model) = d.indexer.model(MODEL) else {
        return false;
    };
    let directory = model.index().directory();
    let engines = directory.engines_of(pod);
    model
        .index()
        .lookup(BlockHash::new(block))
        .iter()
        .any(|(e, _)| engines.contains(e))
}

/// `ListPods` over gRPC (every model).
pub async fn list(d: &RunningDaemon) -> Vec<PodInfo> {
    super::client(d)
        .await
        .max_decoding_message_size(64 << 20)
        .list_pods(ListPodsRequest {
            model: String::new(),
        })
        .await
        .expect("ListPods")
        .into_inner()
        .pods
}

/// `pod`'s state in `ListPods`; `None` when not listed.
pub async fn state_of(d: &RunningDaemon, pod: &str) -> Option<PodState> {
    list(d)
        .await
        .iter()
        .find(|p| p.pod == pod)
        .map(|p| p.state())
}

/// Waits (up to `within`) for `check`; panics with `what` otherwise.
pub async fn eventually<F: std::future::Future<Output = bool>>(
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> F,
) -> Duration {
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < within, "{what} (waited {within:?})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// A PUB socket connected to the daemon's bind-mode endpoint.
pub async fn connect(d: &RunningDaemon) -> PubSocket {
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind mode"))
        .await
        .expect("PUB connects");
    p
}

/// Sends message `seq` of `pod` until the daemon holds `block` (past the slow-joiner window).
pub async fn send_until_held(
    p: &mut PubSocket,
    d: &RunningDaemon,
    pod: &str,
    seq: u64,
    block: u64,
) {
    for _ in 0..250 {
        let _ = p.send(message(pod, seq, block)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if holds(d, pod, block) {
            return;
        }
    }
    panic!("{pod}'s message {seq} never arrived");
}

/// The loopback test config with the given grace period and idle timeout.
pub fn lifecycle_config(grace: Duration, idle: Duration) -> kv_indexer::config::Config {
    let mut c = super::loopback_config();
    c.kv_events_config.publisher_grace_period = ConfigDuration(grace);
    c.kv_events_config.publisher_idle_timeout = ConfigDuration(idle);
    c
}
