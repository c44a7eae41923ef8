//! An admin `ClearPod` is ordered with the pod's messages: it goes through the pod's ingest
//! worker, so a gap fill that was parked for the pod when the clear came in is dropped with it.
//! Before it did (the admin handler cleared the index beside the worker), the fill's batches and
//! the messages parked behind it were applied after the clear and brought cleared blocks back.
//!
//! Over real sockets on loopback: a PUB publishes as vLLM frames it, a ROUTER answers vLLM's
//! replay protocol (0.26+ layout) when the test lets it, and a tonic client calls `ClearPod`.

mod support;

use std::time::Duration;

use bytes::Bytes;
use kv_indexer::daemon;
use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ClearPodRequest};
use support::pods::{self, holds, MODEL};
use tokio::sync::{mpsc, oneshot};
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

const TOKEN: &str = "clear-admin-token-0123456789";

/// A replay ROUTER that reports each request's start sequence on `requests` and answers it
/// (with `buffer`'s messages from that start, then the end marker) only once `go` fires.
fn spawn_held_replay(
    mut router: RouterSocket,
    topic: String,
    buffer: Vec<(u64, Vec<u8>)>,
    requests: mpsc::UnboundedSender<u64>,
    go: oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(Ok(req)) = tokio::time::timeout(Duration::from_secs(20), router.recv()).await else {
            return;
        };
        let frames = req.into_vec();
        assert_eq!(frames.len(), 3, "[identity, empty, start_seq]");
        let start = u64::from_be_bytes(frames[2][..].try_into().expect("8-byte seq"));
        let _ = requests.send(start);
        let _ = go.await;
        let identity = frames[0].clone();
        for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::from(topic.clone()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::copy_from_slice(payload),
            ];
            router
                .send(ZmqMessage::try_from(reply).expect("frames"))
                .await
                .expect("replay send");
        }
        let end = vec![
            identity,
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
            Bytes::new(),
        ];
        router
            .send(ZmqMessage::try_from(end).expect("frames"))
            .await
            .expect("end marker");
        // Stay up (a closed ROUTER would fail the fill instead of answering it).
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_fill_parked_before_an_admin_clear_cannot_bring_the_cleared_blocks_back() {
    let (router, template) = support::replay_router().await;
    let mut config = support::loopback_config();
    config.kv_events_config.replay_endpoint_template = template;
    config.kv_events_config.replay_timeout_ms = 10_000;
    config.server.enable_admin_rpcs = true;
    config.server.admin_token = TOKEN.into();
    let d = daemon::start(config).await.expect("daemon starts");

    let pod = "127.0.0.1:8000";
    // vLLM's replay buffer: seq 1 stored block 2, which the SUB never receives.
    let seq1 = pods::message(pod, 1, 2).into_vec()[2].to_vec();
    let (requests_tx, mut requests) = mpsc::unbounded_channel();
    let (go, held) = oneshot::channel();
    let replay = spawn_held_replay(
        router,
        format!("kv@{pod}@{MODEL}"),
        vec![(1, seq1)],
        requests_tx,
        held,
    );

    let mut publisher = pods::connect(&d).await;
    pods::send_until_held(&mut publisher, &d, pod, 0, 1).await;
    // seq 2 (block 3) after a hole: the worker asks the replay socket for seq 1 and parks seq 2.
    publisher
        .send(pods::message(pod, 2, 3))
        .await
        .expect("send");
    let start = tokio::time::timeout(Duration::from_secs(10), requests.recv())
        .await
        .expect("the gap fill asks the replay socket")
        .expect("router running");
    assert_eq!(start, 1, "the fill asks from the first missing message");
    assert!(!holds(&d, pod, 3), "seq 2 waits behind its gap fill");

    // The admin clear, while the fill is in flight.
    let mut grpc = KvIndexerClient::connect(format!("http://{}", d.grpc_addr))
        .await
        .expect("gRPC connects");
    let mut request = tonic::Request::new(ClearPodRequest {
        model: MODEL.into(),
        pod: pod.into(),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {TOKEN}").parse().expect("ascii"),
    );
    let removed = grpc
        .clear_pod(request)
        .await
        .expect("authorized")
        .into_inner()
        .removed;
    assert_eq!(removed, 1, "block 1 was the pod's only membership");
    assert!(!holds(&d, pod, 1));

    // Now the fill answers: seq 1 (block 2), after which seq 2 (block 3) would be released.
    go.send(()).expect("router waiting");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < deadline {
        for block in [1, 2, 3] {
            assert!(
                !holds(&d, pod, block),
                "block {block} came back after the pod was cleared"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        pods::list(&d).await.iter().all(|p| p.pod != pod),
        "the cleared pod is not listed"
    );
    d.shutdown().await;
    replay.abort();
}
