//! Pods that come and go, over real sockets: a pod whose connection closes is forgotten after
//! the grace period and kept when it reconnects within it; a silent pod is forgotten after the
//! idle timeout; 100,000 publishers register, are listed and are forgotten, and the memory
//! they held returns (this test binary counts its heap).

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_core::{encode_batch, BlockHash, BlockStored, EventBatch, KvEvent, Medium};
use kv_indexer::config::ConfigDuration;
use kv_indexer::daemon::{self, RunningDaemon};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_proto::kvindexer_v1::{ListPodsRequest, PodInfo, PodState};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

const MODEL: &str = "life/model";

fn message(pod: &str, seq: u64, block: u64) -> ZmqMessage {
    let payload = encode_batch(&EventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: vec![BlockHash::new(block)],
            block_size: 16,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    });
    ZmqMessage::try_from(vec![
        Bytes::from(format!("kv@{pod}@{MODEL}")),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
    .expect("non-empty")
}

fn holds(d: &RunningDaemon, pod: &str, block: u64) -> bool {
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

async fn list(d: &RunningDaemon) -> Vec<PodInfo> {
    support::client(d)
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

async fn state_of(d: &RunningDaemon, pod: &str) -> Option<PodState> {
    list(d)
        .await
        .iter()
        .find(|p| p.pod == pod)
        .map(|p| p.state())
}

/// Waits (up to `within`) for `check`; panics with `what` otherwise.
async fn eventually<F: std::future::Future<Output = bool>>(
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

async fn connect(d: &RunningDaemon) -> PubSocket {
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind mode"))
        .await
        .expect("PUB connects");
    p
}

/// Sends message `seq` of `pod` until the daemon holds `block` (past the slow-joiner window).
async fn send_until_held(p: &mut PubSocket, d: &RunningDaemon, pod: &str, seq: u64, block: u64) {
    for _ in 0..250 {
        let _ = p.send(message(pod, seq, block)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if holds(d, pod, block) {
            return;
        }
    }
    panic!("{pod}'s message {seq} never arrived");
}

fn lifecycle_config(grace: Duration, idle: Duration) -> kv_indexer::config::Config {
    let mut c = support::loopback_config();
    c.kv_events_config.publisher_grace_period = ConfigDuration(grace);
    c.kv_events_config.publisher_idle_timeout = ConfigDuration(idle);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_gone_past_the_grace_period_is_forgotten_and_one_back_within_it_is_kept() {
    let grace = Duration::from_millis(800);
    let d = daemon::start(lifecycle_config(grace, Duration::ZERO))
        .await
        .expect("daemon starts");
    // The pod's id names the address its connection comes from (127.0.0.1), as `ip:port`
    // topics do in a cluster.
    let pod = "127.0.0.1:8000";
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, pod, 0, 1).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));

    // Disconnect, reconnect within the grace period: nothing is lost.
    drop(p);
    eventually(
        Duration::from_secs(5),
        "the pod never showed as gone",
        || async { state_of(&d, pod).await == Some(PodState::Gone) },
    )
    .await;
    let gone = list(&d).await;
    assert!(gone[0].state_since_unix_ms > 0, "{gone:?}");
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, pod, 1, 2).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));
    tokio::time::sleep(grace + Duration::from_millis(400)).await;
    assert!(
        holds(&d, pod, 1),
        "a pod back within the grace period keeps its blocks"
    );
    assert_eq!(
        support::metric(&d.metrics_text(), "kvindexer_pods_forgotten_total"),
        0.0
    );

    // Disconnect for good: forgotten once the grace period has passed, not before.
    let left = Instant::now();
    drop(p);
    let took = eventually(
        Duration::from_secs(10),
        "the pod was never forgotten",
        || async { !holds(&d, pod, 1) },
    )
    .await;
    assert!(
        left.elapsed() >= grace,
        "forgotten after {:?}, before the grace period",
        left.elapsed()
    );
    eprintln!("forgotten {took:?} after the disconnect (grace {grace:?})");
    assert!(!holds(&d, pod, 2));
    assert!(list(&d).await.is_empty(), "ListPods still shows the pod");
    assert_eq!(d.publishers().pod_count(), 0);
    let page = d.metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_pods_forgotten_total{reason=\"gone\"}"),
        1.0,
        "{page}"
    );
    assert!(
        !page.contains(&format!("pod=\"{pod}\"")),
        "the forgotten pod's series remain"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_pod_is_idle_then_forgotten_after_the_idle_timeout() {
    let (grace, idle) = (Duration::from_millis(300), Duration::from_millis(1_500));
    let d = daemon::start(lifecycle_config(grace, idle))
        .await
        .expect("daemon starts");
    // An id that names no address: only silence can tell it left.
    let (quiet, chatty) = ("vllm-quiet", "vllm-chatty");
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, quiet, 0, 1).await;
    send_until_held(&mut p, &d, chatty, 0, 2).await;
    let spoke = Instant::now();
    eventually(
        Duration::from_secs(5),
        "the quiet pod never showed as idle",
        || async { state_of(&d, quiet).await == Some(PodState::Idle) },
    )
    .await;
    // The chatty pod keeps talking; the quiet one is forgotten, the connection still open.
    let mut seq = 1;
    let forgotten = Instant::now();
    while holds(&d, quiet, 1) {
        assert!(
            forgotten.elapsed() < Duration::from_secs(10),
            "never forgotten"
        );
        let _ = p.send(message(chatty, seq, 2 + seq)).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(spoke.elapsed() >= idle, "forgotten before the idle timeout");
    assert!(holds(&d, chatty, 2), "the pod that kept talking was kept");
    assert_eq!(state_of(&d, chatty).await, Some(PodState::Live));
    assert_eq!(
        support::metric(
            &d.metrics_text(),
            "kvindexer_pods_forgotten_total{reason=\"idle\"}"
        ),
        1.0
    );
    drop(p);
    d.shutdown().await;
}

/// The `i`-th of the churn test's pod ids.
fn churn_pod(i: usize) -> String {
    format!("vllm-{i:06}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_publishers_register_and_their_memory_returns_when_forgotten() {
    const PODS: usize = 100_000;
    // Longer than registering takes in a debug build on a busy 2-core machine (about 10 s).
    let idle = Duration::from_secs(25);
    let mut config = lifecycle_config(Duration::from_secs(60), idle);
    config.kv_events_config.queue_depth = 1 << 17;
    let d = daemon::start(config).await.expect("daemon starts");
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, "warm-up", 0, u64::MAX).await;
    let index_memory = || {
        d.indexer
            .stats()
            .iter()
            .map(|(_, s)| s.memory_bytes as usize)
            .sum::<usize>()
    };
    let heap_before = live_heap_bytes() - index_memory();
    let rss_before = rss_bytes();

    // Sent in rounds of 1,000, each once the daemon has the previous (ZeroMQ's PUB drops what
    // its queue cannot hold; a real fleet's pods each have their own).
    let started = Instant::now();
    for round in 0..PODS / 1_000 {
        for i in round * 1_000..(round + 1) * 1_000 {
            p.send(message(&churn_pod(i), 0, i as u64 + 1))
                .await
                .expect("send");
        }
        let want = (round + 1) * 1_000 + 1;
        eventually(
            Duration::from_secs(30),
            "a round of publishers never registered",
            || async { d.publishers().pod_count() >= want },
        )
        .await;
    }
    let took = started.elapsed();
    let (heap_known, rss_known) = (live_heap_bytes() - index_memory(), rss_bytes());
    eprintln!(
        "{PODS} publishers registered in {took:?}; heap +{} B per pod, RSS +{} MiB",
        (heap_known - heap_before) / PODS,
        rss_known.saturating_sub(rss_before) >> 20
    );
    assert!(holds(&d, &churn_pod(PODS - 1), PODS as u64));
    let listed = list(&d).await;
    assert_eq!(listed.len(), PODS + 1);
    assert!(
        listed.iter().all(|p| p.state() == PodState::Live),
        "all live"
    );
    drop(listed);
    // The response's buffers (tens of MB for 100,000 pods) go with the gRPC connection, which
    // closes shortly after the call.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Silence: every pod (the warm-up one too) is forgotten after the idle timeout.
    eventually(
        Duration::from_secs(120),
        "the publishers were never all forgotten",
        || async { d.publishers().pod_count() == 0 },
    )
    .await;
    let model = d.indexer.model(MODEL).expect("model");
    assert_eq!(model.index().directory().pod_count(), 0);
    assert_eq!(model.index().stats().memberships, 0);
    assert!(list(&d).await.is_empty());
    // The index's own structures (block table, node chunks) are kept for reuse: not counted.
    let heap_after = live_heap_bytes() - index_memory();
    let left = heap_after.saturating_sub(heap_before) / PODS;
    eprintln!(
        "forgotten: heap {left} B per pod left (of {} B), RSS {} MiB",
        (heap_known - heap_before) / PODS,
        rss_bytes() >> 20
    );
    // What stays is the index's block storage kept for reuse (table, node chunks: tens of
    // bytes per block), not the publishers.
    assert!(left < 64, "{left} B per forgotten pod stayed on the heap");
    assert_eq!(
        support::metric(
            &d.metrics_text(),
            "kvindexer_pods_forgotten_total{reason=\"idle\"}"
        ),
        (PODS + 1) as f64
    );
    drop(p);
    d.shutdown().await;
}

/// The process's resident memory (Linux), 0 elsewhere.
fn rss_bytes() -> usize {
    kv_indexer::resident_memory_bytes().map_or(0, |b| b as usize)
}
