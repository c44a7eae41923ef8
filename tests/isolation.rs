//! One bad publisher must not stall the others (over real sockets on loopback).
//!
//! Two broken pods skip a sequence number in every message, and their replay endpoints are a
//! black hole (a TCP listener that accepts and never answers: each gap fill can only time out)
//! and a closed port (refused). A healthy pod on the same worker (`concurrency: 1`, the worst
//! case) publishes one block at a time; none may wait as long as a hanging fill (each must be in
//! the index within 1.5 s of the 2 s replay timeout; it prints the p50 and p99 it measured).
//!
//! The broken pods send 32-block messages at `KV_ISOLATION_MSGS_PER_S` together (default 2,000:
//! 64k blocks/s, what a debug build's single worker sustains). For the figure at 1M blocks/s,
//! run it under `--release` with `KV_ISOLATION_MSGS_PER_S=31250` (measured: healthy pod p50
//! 0.4-0.5 ms, p99 27-44 ms in two runs, while the broken pods sent 70-78k gapped messages).
//!
//! Before gap fill moved off the event path, every gap of a broken pod held the worker for the
//! whole `replayTimeoutMs` (2 s) and the healthy pod's blocks waited behind it.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_core::{encode_batch, BlockHash, EventBatch};
use kv_indexer::daemon;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "iso/model";

fn stored(hashes: &[BlockHash]) -> Bytes {
    Bytes::from(encode_batch(&EventBatch::stored_on_gpu(
        1.7e9, 0, hashes, 16,
    )))
}

fn message(pod: &str, seq: u64, payload: &Bytes) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::from(format!("kv@{pod}@{MODEL}")),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.clone(),
    ])
    .expect("non-empty")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_gap_fill_hangs_does_not_delay_the_others() {
    // The black hole: accepts TCP connections and never says a word.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let hole_port = hole.local_addr().expect("addr").port();
    let held = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let keep = held.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = hole.accept().await {
            keep.lock().push(socket);
        }
    });
    let mut config = support::loopback_config();
    config.kv_events_config.concurrency = 1;

    config.kv_events_config.replay_timeout_ms = 2_000;
    // {ip} is the pod's address: 127.0.0.1 reaches the black hole, 127.0.0.3 refuses.
    config.kv_events_config.replay_endpoint_template = format!("tcp://{{ip}}:{hole_port}");
    let d = daemon::start(config).await.expect("daemon starts");
    let endpoint = d.zmq_endpoint.clone().expect("bind mode");

    let rate: u64 = std::env::var("KV_ISOLATION_MSGS_PER_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let per_pod = (rate / 2).max(1);
    let stop = Arc::new(AtomicBool::new(false));
    let mut floods = Vec::new();
    for (b, pod) in ["127.0.0.1:8000", "127.0.0.3:8000"].into_iter().enumerate() {
        let mut publisher = PubSocket::new();
        publisher.connect(&endpoint).await.expect("PUB connects");
        let stop = stop.clone();
        floods.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut seq = 1u64;
            let mut sent = 0u64;
            let start = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                // Paced: message n leaves at n / per_pod seconds.
                let due = Duration::from_secs_f64(sent as f64 / per_pod as f64);
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
                let base = (b as u64 + 1) << 40 | seq << 5;
                let hashes: Vec<BlockHash> = (0..32).map(|i| BlockHash::new(base | i)).collect();
                // Every message skips one sequence number: a gap each time.
                let _ = publisher.send(message(pod, seq, &stored(&hashes))).await;
                seq += 2;
                sent += 1;
            }
            sent
        }));
    }

    let mut healthy = PubSocket::new();
    healthy.connect(&endpoint).await.expect("PUB connects");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Warm up: the first message may meet ZeroMQ's slow joiner; resend until it lands.
    let pod = "127.0.0.2:8000";
    let first = BlockHash::new(7 << 50);
    let lookup = |h: BlockHash| {
        d.indexer
            .model(MODEL)
            .is_some_and(|m| !m.index().lookup(h).is_empty())
    };
    let mut seq = 0u64;
    let started = Instant::now();
    while !lookup(first) {
        assert!(started.elapsed() < Duration::from_secs(10), "warm-up");
        let _ = healthy.send(message(pod, 0, &stored(&[first]))).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut latencies = Vec::new();
    for i in 1..=400u64 {
        seq += 1;
        let h = BlockHash::new(7 << 50 | i);
        let sent = Instant::now();
        healthy
            .send(message(pod, seq, &stored(&[h])))
            .await
            .expect("send");
        while !lookup(h) {
            assert!(
                sent.elapsed() < Duration::from_secs(5),
                "block {i} of the healthy pod never applied"
            );
            tokio::task::yield_now().await;
        }
        latencies.push(sent.elapsed());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Both broken pods end up backed off, counting their gaps as lost (the black hole's first
    // fill can only end at its timeout).
    let backed_off = |d: &kv_indexer::daemon::RunningDaemon| {
        d.publishers()
            .snapshot()
            .iter()
            .filter(|(k, _)| k.pod.starts_with("127.0.0.1") || k.pod.starts_with("127.0.0.3"))
            .filter(|(_, s)| s.gap_fill_failures > 0 && s.messages_lost > 0)
            .count()
    };
    let waited = Instant::now();
    while backed_off(&d) < 2 && waited.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut flooded = 0;
    for f in floods {
        flooded += f.await.expect("flood task");
    }
    latencies.sort();
    let (p50, p99) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
    eprintln!("healthy pod apply latency: p50 {p50:?}, p99 {p99:?} while the broken pods sent {flooded} gapped messages");
    assert!(
        flooded > 1_000,
        "the broken pods must really flood ({flooded})"
    );
    // At the default rate one worker keeps up; at 1M blocks/s on one worker it sheds (the
    // healthy pod's latency is what this test measures, not the worker's throughput).
    if rate <= 2_000 {
        let text = d.metrics_text();
        let shed: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvindexer_messages_shed_total{"))
            .collect();
        assert!(
            shed.is_empty(),
            "no message was shed at this rate: {shed:?}"
        );
    }
    // Waiting behind a hanging fill takes the replay timeout (2 s): a message that waited
    // so would take over 1.5 s. Anything shorter is this shared machine's scheduling (under
    // three CPU hogs the worst seen was 0.41 s), not the failure this test looks for.
    let worst = latencies.last().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_millis(1_500),
        "worst {worst:?} (p99 {p99:?}, p50 {p50:?}): a broken pod's gap fill held back a healthy one"
    );
    let publishers = d.publishers().snapshot();
    assert_eq!(
        backed_off(&d),
        2,
        "both broken pods are backed off and count losses: {publishers:?}"
    );
    let healthy_state = publishers
        .iter()
        .find(|(k, _)| &*k.pod == pod)
        .map(|(_, s)| s.clone())
        .expect("healthy publisher");
    assert_eq!(healthy_state.messages_lost, 0);
    assert_eq!(healthy_state.gap_fill_failures, 0);
    d.shutdown().await;
    drop(held);
}
