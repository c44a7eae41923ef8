//! The daemon end to end, over real sockets on loopback (ephemeral ports): a ZMQ PUB sends the
//! bytes vLLM's publisher sent (`tests/fixtures/vllm/zmq_messages.*.json`), a tonic client calls
//! ScorePods, a test ROUTER answers vLLM's replay protocol, and the metrics page is read over
//! HTTP.
//!
//! Captured batches hold stores followed by removals; to observe the stores, batches are re-cut
//! at event boundaries: the event bytes are vLLM's own, only the array header is rewritten.

mod support;

use std::time::Duration;

use bytes::Bytes;
use kv_indexer::config::{Config, ConnectEndpoint};
use kv_indexer::daemon;
use kv_proto::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ListPodsRequest,
    ScorePodsRequest, TokenIds,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const MODEL: &str = "Qwen/Qwen3-8B";

/// A captured vLLM batch, cut into its parts.
struct Captured {
    ts: Vec<u8>,
    events: Vec<Vec<u8>>,
    rank: Vec<u8>,
    tokens: Vec<u32>,
}

/// Splits `[ts, [events...], rank]` into raw byte ranges (rmp reads the headers, rmpv skips
/// whole values).
fn cut(payload: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>, Vec<u8>) {
    let mut r = std::io::Cursor::new(payload);
    let at = |r: &std::io::Cursor<&[u8]>| r.position() as usize;
    let n = rmp::decode::read_array_len(&mut r).expect("batch array");
    assert_eq!(n, 3, "0.10+ batches have 3 elements");
    let ts_start = at(&r);
    rmpv::decode::read_value(&mut r).expect("ts");
    let ts = payload[ts_start..at(&r)].to_vec();
    let count = rmp::decode::read_array_len(&mut r).expect("events");
    let mut events = Vec::new();
    for _ in 0..count {
        let start = at(&r);
        rmpv::decode::read_value(&mut r).expect("event");
        events.push(payload[start..at(&r)].to_vec());
    }
    let rank = payload[at(&r)..].to_vec();
    (ts, events, rank)
}

fn captured(version: &str, scenario: &str) -> Captured {
    let (payload, tokens) = support::captured_payload(version, scenario);
    let (ts, events, rank) = cut(&payload);
    Captured {
        ts,
        events,
        rank,
        tokens,
    }
}

/// A batch of the given events (vLLM's bytes) under a new array header.
fn batch(c: &Captured, events: &[usize]) -> Vec<u8> {
    let mut out = vec![0x93];
    out.extend_from_slice(&c.ts);
    out.push(0x90 | events.len() as u8);
    for &e in events {
        out.extend_from_slice(&c.events[e]);
    }
    out.extend_from_slice(&c.rank);
    out
}

fn message(topic: &str, seq: u64, payload: &[u8]) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ])
    .expect("non-empty")
}

fn base_config() -> Config {
    let mut c = support::loopback_config();
    c.kv_events_config.concurrency = 4;
    c.kv_events_config.replay_timeout_ms = 3_000;
    c.indexer_config.token_processor_config.hash_seed = Some("12345".into());
    c
}

use support::client;

async fn matched(
    client: &mut KvIndexerClient<tonic::transport::Channel>,
    tokens: &[u32],
    pod: &str,
) -> u32 {
    support::matched_blocks(client, MODEL, tokens, pod).await
}

/// Polls `f` until it returns true (or fails the test after 10 s).
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for: {what}");
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("HTTP connects");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("request sent");
    let mut body = String::new();
    s.read_to_string(&mut body).await.expect("response read");
    let status = body
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body)
}

/// Sends `msg` repeatedly until `done` holds.
async fn send_until<Fut: std::future::Future<Output = bool>>(
    publisher: &mut PubSocket,
    msg: ZmqMessage,
    mut done: impl FnMut() -> Fut,
) {
    for _ in 0..200 {
        publisher.send(msg.clone()).await.expect("PUB send");
        tokio::time::sleep(Duration::from_millis(50)).await;
        if done().await {
            return;
        }
    }
    panic!("the daemon never applied the first message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mode_scores_what_vllm_published_for_every_wire_format() {
    scores_every_wire_format(base_config()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_lane_scores_what_vllm_published_for_every_wire_format() {
    let mut config = base_config();
    config
        .indexer_config
        .kv_block_index_config
        .in_memory_config
        .writer_lanes = 1;
    scores_every_wire_format(config).await;
}

/// Captured vLLM frames of every wire format, stored, scored (varint and packed tokens),
/// removed; the metrics count them.
async fn scores_every_wire_format(config: Config) {
    let d = daemon::start(config).await.expect("daemon starts");
    let endpoint = d.zmq_endpoint.clone().expect("bind mode");
    let mut publisher = PubSocket::new();
    publisher
        .connect(&endpoint)
        .await
        .expect("PUB connects to the daemon");
    let grpc = client(&d).await;

    let cases = [
        ("0.23.0", "int_hashes_topic_kv-events_dp0"),
        ("0.24.0", "int_hashes_topic_kv-events_dp0"),
        ("0.33.0", "int_hashes_topic_kv-events_dp0"),
        ("0.33.0", "bytes_hashes_topic_kv-events_dp0"),
        ("0.28.0", "bytes_hashes_topic_kv-events_dp0"),
    ];
    for (i, (version, scenario)) in cases.iter().enumerate() {
        let c = captured(version, scenario);
        let pod = format!("10.0.0.{i}:8000");
        let topic = format!("kv@{pod}@{MODEL}");
        // seq 0: the two BlockStored events (blocks 0-1, then block 2 with its parent).
        let stores = message(&topic, 0, &batch(&c, &[0, 1]));
        let mut g = grpc.clone();
        let (tokens, p) = (c.tokens.clone(), pod.clone());
        send_until(&mut publisher, stores, || {
            let (mut g, tokens, p) = (g.clone(), tokens.clone(), p.clone());
            async move { matched(&mut g, &tokens, &p).await == 3 }
        })
        .await;
        assert_eq!(
            matched(&mut g, &c.tokens, &pod).await,
            3,
            "{version} {scenario}"
        );
        // The packed form of the same tokens scores the same.
        let packed = g
            .score_pods(ScorePodsRequest {
                model: MODEL.into(),
                input: Some(Input::TokenIdsLe(kv_proto::token_ids_le::encode(&c.tokens))),
                pods: vec![pod.clone()],
                ..Default::default()
            })
            .await
            .expect("packed ScorePods")
            .into_inner();
        assert_eq!(packed.scores[0].matched_blocks, 3, "packed {version}");
        assert_eq!(packed.prompt_tokens as usize, c.tokens.len());
        // seq 1: three BlockRemoved (evictions, leaf first) and AllBlocksCleared.
        publisher
            .send(message(&topic, 1, &batch(&c, &[2, 3, 4, 5])))
            .await
            .expect("send");
        let (tokens, p) = (c.tokens.clone(), pod.clone());
        eventually("removals applied", || {
            let (mut g, tokens, p) = (grpc.clone(), tokens.clone(), p.clone());
            async move { matched(&mut g, &tokens, &p).await == 0 }
        })
        .await;
    }
    let (_, page) = http_get(d.metrics_addr, "/metrics").await;
    assert!(
        support::metric(
            &page,
            "kvindexer_events_received_total{pod=\"10.0.0.2:8000\",type=\"BlockStored\"}"
        ) >= 2.0,
        "{page}"
    );
    assert!(support::metric(&page, "kvindexer_hash_checks_total{model=\"Qwen/Qwen3-8B\",pod=\"10.0.0.0:8000\",result=\"match\"}") >= 1.0);
    assert_eq!(support::metric(&page, "kvindexer_hash_checks_total{model=\"Qwen/Qwen3-8B\",pod=\"10.0.0.0:8000\",result=\"mismatch\"}"), 0.0);
    assert!(
        support::metric(&page, "kvcache_index_admissions_total") >= 15.0,
        "5 cases x 3 blocks"
    );
    drop(grpc);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_mode_dials_a_binding_publisher() {
    // vLLM binds (endpoint without `*` means connect in vLLM; here the test plays a pod whose
    // publisher binds), kv-indexer dials it; the captured topic "kv-events" is used as is.
    let mut publisher = PubSocket::new();
    let bound = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("PUB binds");
    let mut config = base_config();
    config.kv_events_config.zmq_endpoint = String::new();
    config.kv_events_config.topic_filter = String::new();
    config.kv_events_config.endpoints = vec![ConnectEndpoint {
        endpoint: bound.to_string(),
        pod: "10.1.0.1:8000".into(),
        model: MODEL.into(),
        replay_endpoint: String::new(),
    }];
    let d = daemon::start(config).await.expect("daemon starts");
    let mut grpc = client(&d).await;
    let c = captured("0.33.0", "int_hashes_topic_kv-events_dp0");
    let g = grpc.clone();
    send_until(
        &mut publisher,
        message("kv-events", 0, &batch(&c, &[0, 1])),
        || {
            let (mut g, tokens) = (g.clone(), c.tokens.clone());
            async move { matched(&mut g, &tokens, "10.1.0.1:8000").await == 3 }
        },
    )
    .await;
    let pods = grpc
        .list_pods(ListPodsRequest {
            model: MODEL.into(),
        })
        .await
        .expect("ListPods")
        .into_inner()
        .pods;
    assert_eq!(pods.len(), 1);
    assert_eq!(pods[0].pod, "10.1.0.1:8000");
    assert_eq!(pods[0].blocks, 3);
    assert_eq!(pods[0].last_sequence, 0);
    assert_eq!((pods[0].hash_matches, pods[0].hash_mismatches), (1, 0));
    d.shutdown().await;
}

/// A test ROUTER that answers vLLM's replay protocol from `buffer` (seq, payload), in the
/// 0.26+ layout (`topic` given) or the <= 0.25 layout (`None`). Returns the requests it saw.
fn spawn_replay_router(
    mut router: RouterSocket,
    buffer: Vec<(u64, Vec<u8>)>,
    topic: Option<String>,
) -> tokio::task::JoinHandle<Vec<u64>> {
    tokio::spawn(async move {
        let mut requests = Vec::new();
        // Wait long for the first request, briefly for any further (there should be none).
        let wait = |first: bool| Duration::from_secs(if first { 20 } else { 1 });
        while let Ok(Ok(req)) = tokio::time::timeout(wait(requests.is_empty()), router.recv()).await
        {
            let frames = req.into_vec();
            assert_eq!(frames.len(), 3, "[identity, empty, start_seq]");
            assert!(frames[1].is_empty());
            let start = u64::from_be_bytes(frames[2][..].try_into().expect("8-byte seq"));
            requests.push(start);
            let identity = frames[0].clone();
            let reply = |seq: u64, payload: &[u8]| {
                let mut f = vec![identity.clone(), Bytes::new()];
                if let Some(t) = &topic {
                    f.push(Bytes::copy_from_slice(t.as_bytes()));
                }
                f.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
                f.push(Bytes::copy_from_slice(payload));
                ZmqMessage::try_from(f).expect("frames")
            };
            for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                router
                    .send(reply(*seq, payload))
                    .await
                    .expect("replay send");
            }
            // End marker: seq -1, empty payload (0.26+: with an empty topic frame).
            let mut end = vec![identity.clone(), Bytes::new()];
            if topic.is_some() {
                end.push(Bytes::new());
            }
            end.push(Bytes::copy_from_slice(&u64::MAX.to_be_bytes()));
            end.push(Bytes::new());
            router
                .send(ZmqMessage::try_from(end).expect("frames"))
                .await
                .expect("end marker");
        }
        requests
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_recovered_from_vllms_replay_buffer_in_both_layouts() {
    for (layout, topic_frame) in [("0.26+", true), ("<=0.25", false)] {
        let (router, template) = support::replay_router().await;
        let mut config = base_config();
        config.kv_events_config.replay_endpoint_template = template;
        let d = daemon::start(config).await.expect("daemon starts");
        let mut publisher = PubSocket::new();
        publisher
            .connect(d.zmq_endpoint.as_deref().expect("bind mode"))
            .await
            .expect("PUB connects");
        let grpc = client(&d).await;
        let c = captured("0.33.0", "int_hashes_topic_kv-events_dp0");
        let pod = "127.0.0.1:8000";
        let topic = format!("kv@{pod}@{MODEL}");
        // The publisher's buffer: seq 1 holds block 2, which the SUB never receives.
        let seq1 = batch(&c, &[1]);
        let replay =
            spawn_replay_router(router, vec![(1, seq1)], topic_frame.then(|| topic.clone()));
        let g = grpc.clone();
        let tokens = c.tokens.clone();
        send_until(&mut publisher, message(&topic, 0, &batch(&c, &[0])), || {
            let (mut g, tokens) = (g.clone(), tokens.clone());
            async move { matched(&mut g, &tokens, pod).await == 2 }
        })
        .await;
        // seq 2 arrives after a gap: an empty batch.
        let empty = batch(&c, &[]);
        publisher
            .send(message(&topic, 2, &empty))
            .await
            .expect("send");
        eventually("block 2 recovered by replay", || {
            let (mut g, tokens) = (grpc.clone(), c.tokens.clone());
            async move { matched(&mut g, &tokens, pod).await == 3 }
        })
        .await;
        let (_, page) = http_get(d.metrics_addr, "/metrics").await;
        assert_eq!(
            support::metric(
                &page,
                "kvindexer_sequence_gaps_total{pod=\"127.0.0.1:8000\"}"
            ),
            1.0,
            "{layout}"
        );
        assert_eq!(
            support::metric(&page, "kvindexer_replays_total{result=\"ok\"}"),
            1.0,
            "{layout}"
        );
        assert_eq!(
            support::metric(
                &page,
                "kvindexer_messages_lost_total{pod=\"127.0.0.1:8000\"}"
            ),
            0.0,
            "{layout}"
        );
        d.shutdown().await;
        let requests = replay.await.expect("router task");
        assert_eq!(
            requests,
            vec![1],
            "{layout}: one replay request, from the first missing seq"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restart_clears_the_pod_and_garbage_is_counted() {
    let d = daemon::start(base_config()).await.expect("daemon starts");
    let mut publisher = PubSocket::new();
    publisher
        .connect(d.zmq_endpoint.as_deref().expect("bind mode"))
        .await
        .expect("PUB connects");
    let mut grpc = client(&d).await;
    let c = captured("0.24.0", "int_hashes_topic_kv-events_dp0");
    let pod = "10.2.0.1:8000";
    let topic = format!("kv@{pod}@{MODEL}");
    let g = grpc.clone();
    let tokens = c.tokens.clone();
    send_until(&mut publisher, message(&topic, 0, &batch(&c, &[0])), || {
        let (mut g, tokens) = (g.clone(), tokens.clone());
        async move { matched(&mut g, &tokens, pod).await == 2 }
    })
    .await;
    publisher
        .send(message(&topic, 1, &batch(&c, &[1])))
        .await
        .expect("send");
    eventually("seq 1 applied", || {
        let (mut g, tokens) = (grpc.clone(), c.tokens.clone());
        async move { matched(&mut g, &tokens, pod).await == 3 }
    })
    .await;

    // Garbage of every kind, then a restarted publisher (seq back to 0) storing nothing.
    let garbage = [
        ZmqMessage::try_from(vec![
            Bytes::from_static(b"kv@x@y"),
            Bytes::from_static(b"12"),
        ])
        .expect("frames"),
        ZmqMessage::try_from(vec![
            Bytes::copy_from_slice(topic.as_bytes()),
            Bytes::from_static(b"1234"),
            Bytes::from_static(b"\x90"),
        ])
        .expect("frames"),
        message("kv@no-model", 5, &[0x90]),
        message(
            &format!("kv@10.2.0.9:8000@{MODEL}"),
            0,
            b"\xc1\xc1 not msgpack",
        ),
    ];
    for g in garbage {
        publisher.send(g).await.expect("send");
    }
    let empty = batch(&c, &[]);
    publisher
        .send(message(&topic, 0, &empty))
        .await
        .expect("send");
    eventually("the restart cleared the pod", || {
        let (mut g, tokens) = (grpc.clone(), c.tokens.clone());
        async move { matched(&mut g, &tokens, pod).await == 0 }
    })
    .await;
    let (status, page) = http_get(d.metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(
        support::metric(&page, "kvindexer_pod_restarts_total{pod=\"10.2.0.1:8000\"}"),
        1.0,
        "{page}"
    );
    assert_eq!(
        support::metric(
            &page,
            "kvindexer_frame_errors_total{reason=\"bad_frame_count\"}"
        ),
        1.0
    );
    assert_eq!(
        support::metric(&page, "kvindexer_frame_errors_total{reason=\"short_seq\"}"),
        1.0
    );
    assert_eq!(
        support::metric(&page, "kvindexer_frame_errors_total{reason=\"bad_topic\"}"),
        1.0
    );
    assert!(
        support::metric(
            &page,
            "kvindexer_decode_errors_total{reason=\"unexpected_type\"}"
        ) >= 1.0,
        "{page}"
    );
    // Still serving.
    assert_eq!(http_get(d.metrics_addr, "/healthz").await.0, 200);
    assert_eq!(http_get(d.metrics_addr, "/readyz").await.0, 200);
    assert_eq!(matched(&mut grpc, &c.tokens, pod).await, 0);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_errors_health_and_reflection() {
    let d = daemon::start(base_config()).await.expect("daemon starts");
    let mut grpc = client(&d).await;
    let score = |model: &str, input: Option<Input>| ScorePodsRequest {
        model: model.into(),
        input,
        ..Default::default()
    };
    let code = |r: Result<tonic::Response<_>, tonic::Status>| r.err().map(|s| s.code());
    assert_eq!(
        code(
            grpc.score_pods(score(
                "nope",
                Some(Input::Tokens(TokenIds { ids: vec![1; 32] }))
            ))
            .await
        ),
        Some(tonic::Code::NotFound)
    );
    assert_eq!(
        code(grpc.score_pods(score("", None)).await),
        Some(tonic::Code::InvalidArgument)
    );
    assert_eq!(
        code(
            grpc.score_pods(score(MODEL, Some(Input::Tokens(TokenIds { ids: vec![] }))))
                .await
        ),
        Some(tonic::Code::InvalidArgument)
    );
    assert_eq!(
        code(
            grpc.score_pods(score("no-such-model", Some(Input::Prompt("hi".into()))))
                .await
        ),
        Some(tonic::Code::NotFound)
    );
    // Packed token ids whose length is not a multiple of 4.
    assert_eq!(
        code(
            grpc.score_pods(score(MODEL, Some(Input::TokenIdsLe(vec![1, 0, 0, 0, 2]))))
                .await
        ),
        Some(tonic::Code::InvalidArgument)
    );
    let too_many = ScorePodsRequest {
        pods: vec!["p".into(); 10_001],
        ..score(MODEL, Some(Input::Tokens(TokenIds { ids: vec![1] })))
    };
    assert_eq!(
        code(grpc.score_pods(too_many).await),
        Some(tonic::Code::InvalidArgument)
    );

    let channel = tonic::transport::Channel::from_shared(format!("http://{}", d.grpc_addr))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kvindexer.v1.KvIndexer".into(),
        })
        .await
        .expect("health")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .expect("reflection")
        .into_inner();
    let reply = stream.message().await.expect("reply").expect("one reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"kvindexer.v1.KvIndexer".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"indexer.v1.IndexerService".to_owned()),
        "{names:?}"
    );
    d.shutdown().await;
}
