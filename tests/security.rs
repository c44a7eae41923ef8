//! Closed by default, open on purpose (over real sockets on loopback): admin RPCs refused unless
//! enabled, then only with the bearer token; topics outside the pod/model grammar or the
//! allow-lists dropped and counted; secrets never printed.

mod support;

use std::time::Duration;

use bytes::Bytes;
use kv_core::{encode_batch, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
use kv_indexer::config::Config;
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ClearPodRequest};
use tonic::Code;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "sec/model";
const TOKEN: &str = "s3cret-admin-token-0123456789";

fn stored(first: u64, n: u64) -> Bytes {
    Bytes::from(encode_batch(&EventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: (first..first + n).map(EngineHash::new).collect(),
            block_size: 16,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    }))
}

fn message(topic: &[u8], seq: u64, payload: &Bytes) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::copy_from_slice(topic),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.clone(),
    ])
    .expect("non-empty")
}

async fn publisher(d: &RunningDaemon) -> PubSocket {
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind mode"))
        .await
        .expect("PUB connects");
    tokio::time::sleep(Duration::from_millis(300)).await;
    p
}

fn blocks_of(d: &RunningDaemon, model: &str, pod: &str) -> u64 {
    d.indexer.model(model).map_or(0, |m| {
        m.index()
            .engine_blocks()
            .iter()
            .filter(|(k, _)| &*k.pod == pod)
            .map(|(_, n)| n)
            .sum()
    })
}

/// Publishes `payload` on `topic` until `pod` holds blocks in `model` (slow joiner).
async fn publish_until_indexed(d: &RunningDaemon, p: &mut PubSocket, pod: &str) {
    let topic = format!("kv@{pod}@{MODEL}");
    for _ in 0..100 {
        let _ = p.send(message(topic.as_bytes(), 0, &stored(1, 10))).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        if blocks_of(d, MODEL, pod) == 10 {
            return;
        }
    }
    panic!("{pod}'s blocks never arrived");
}

fn clear(pod: &str) -> tonic::Request<ClearPodRequest> {
    tonic::Request::new(ClearPodRequest {
        model: MODEL.into(),
        pod: pod.into(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_rpcs_are_refused_unless_enabled_then_need_the_token() {
    // Default: ClearPod refused, naming the setting; the victim keeps its blocks.
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut p = publisher(&d).await;
    publish_until_indexed(&d, &mut p, "10.0.0.1:8000").await;
    let mut grpc = KvIndexerClient::connect(format!("http://{}", d.grpc_addr))
        .await
        .expect("gRPC connects");
    let e = grpc
        .clear_pod(clear("10.0.0.1:8000"))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains("server.enableAdminRpcs"), "{e}");
    assert_eq!(blocks_of(&d, MODEL, "10.0.0.1:8000"), 10);
    d.shutdown().await;

    // Enabled: no token or a wrong one is UNAUTHENTICATED; the right one clears.
    let mut c = support::loopback_config();
    c.server.enable_admin_rpcs = true;
    c.server.admin_token = TOKEN.into();
    let d = daemon::start(c).await.expect("daemon starts");
    let mut p = publisher(&d).await;
    publish_until_indexed(&d, &mut p, "10.0.0.1:8000").await;
    let mut grpc = KvIndexerClient::connect(format!("http://{}", d.grpc_addr))
        .await
        .expect("gRPC connects");
    let e = grpc
        .clear_pod(clear("10.0.0.1:8000"))
        .await
        .expect_err("no token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    let mut wrong = clear("10.0.0.1:8000");
    wrong.metadata_mut().insert(
        "authorization",
        "Bearer s3cret-admin-token-0123456780"
            .parse()
            .expect("ascii"),
    );
    let e = grpc.clear_pod(wrong).await.expect_err("wrong token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    assert!(!e.message().contains(TOKEN), "the token is never echoed");
    assert_eq!(blocks_of(&d, MODEL, "10.0.0.1:8000"), 10);
    let mut right = clear("10.0.0.1:8000");
    right.metadata_mut().insert(
        "authorization",
        format!("Bearer {TOKEN}").parse().expect("ascii"),
    );
    let removed = grpc
        .clear_pod(right)
        .await
        .expect("authorized")
        .into_inner()
        .removed;
    assert_eq!(removed, 10);
    assert_eq!(blocks_of(&d, MODEL, "10.0.0.1:8000"), 0);
    let page = d.metrics_text();
    assert!(!page.contains(TOKEN), "metrics never carry the token");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_outside_the_grammar_or_the_allow_lists_are_dropped_and_counted() {
    let mut c = support::loopback_config();
    c.kv_events_config.allowed_models = vec![MODEL.into()];
    c.kv_events_config.allowed_pods = vec!["10.0.*:8000".into()];
    let d = daemon::start(c).await.expect("daemon starts");
    let mut p = publisher(&d).await;
    publish_until_indexed(&d, &mut p, "10.0.0.1:8000").await;

    let huge_pod = format!("kv@{}@{MODEL}", "9".repeat(64 * 1024));
    let spaced = format!("kv@10.0.0.9 :8000@{MODEL}");
    let cases: [(&[u8], &str); 5] = [
        (huge_pod.as_bytes(), "topic_too_long"),
        (spaced.as_bytes(), "bad_topic_pod"),
        (b"kv@10.0.0.2:8000@model\nwith newline", "bad_topic_model"),
        (b"kv@10.0.0.3:8000@other/model", "model_not_allowed"),
        (b"kv@10.9.0.3:8000@sec/model", "pod_not_allowed"),
    ];
    for (topic, _) in &cases {
        for seq in 0..3 {
            p.send(message(topic, seq, &stored(100, 5)))
                .await
                .expect("send");
        }
    }
    // A valid message after them proves the receiver went on.
    let topic = format!("kv@10.0.0.4:8000@{MODEL}");
    for _ in 0..100 {
        let _ = p.send(message(topic.as_bytes(), 0, &stored(1, 3))).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        if blocks_of(&d, MODEL, "10.0.0.4:8000") == 3 {
            break;
        }
    }
    assert_eq!(blocks_of(&d, MODEL, "10.0.0.4:8000"), 3);
    let page = d.metrics_text();
    for (_, reason) in &cases {
        let n = support::metric(
            &page,
            &format!("kvindexer_frame_errors_total{{reason=\"{reason}\"}}"),
        );
        assert!(n >= 1.0, "{reason} counted: {n}");
    }
    let models: Vec<String> = d
        .indexer
        .models()
        .iter()
        .map(|m| m.name().to_owned())
        .collect();
    assert_eq!(
        models,
        vec![MODEL.to_owned()],
        "no model from a rejected topic"
    );
    let pods: Vec<String> = d
        .indexer
        .model(MODEL)
        .map(|m| {
            m.index()
                .engine_blocks()
                .iter()
                .map(|(k, _)| k.pod.to_string())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        pods.iter().all(|p| p.len() < 64 && p.starts_with("10.0.")),
        "no pod from a rejected topic: {pods:?}"
    );
    assert!(page.len() < 64 * 1024, "the metrics page stays small");
    d.shutdown().await;
}

#[test]
fn defaults_keep_the_index_closed_and_secrets_out_of_printed_configs() {
    let c = Config::default();
    assert!(
        c.kv_events_config
            .zmq_endpoint
            .starts_with("tcp://127.0.0.1:"),
        "the ZMQ intake listens on loopback unless configured: {}",
        c.kv_events_config.zmq_endpoint
    );
    assert!(!c.server.enable_admin_rpcs);
    let mut enabled = Config::default();
    enabled.server.enable_admin_rpcs = true;
    let e = enabled.validate().expect_err("admin RPCs need a token");
    assert!(e.to_string().contains("server.adminToken"), "{e}");
    enabled.apply_env(|k| (k == "KVINDEXER_ADMIN_TOKEN").then(|| TOKEN.to_owned()));
    enabled
        .validate()
        .expect("the token from the environment is enough");
    let printed = enabled.redacted().to_yaml();
    assert!(!printed.contains(TOKEN), "{printed}");
    assert!(printed.contains("<redacted>"));
}
