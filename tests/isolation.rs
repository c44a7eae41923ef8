//! One bad publisher must not stall the others (over real sockets on loopback).
//!
//! Two broken pods skip a sequence number in every message, and their replay endpoints are a
//! black hole (a TCP listener that accepts and never answers: each gap fill can only time out)
//! and a closed port (refused). A healthy pod on the same worker (`concurrency: 1`, the worst
//! case) publishes one block at a time; none may wait as long as a hanging fill: its worst
//! latency beside the broken pods stays under its worst in the same loop before they started
//! plus half the 2 s replay timeout (it prints the p50, p99 and worst of both).
//!
//! The broken pods send 32-block messages at `KV_ISOLATION_MSGS_PER_S` together (default 2,000:
//! 64k blocks/s, what a debug build's single worker sustains). For the figure at 1M blocks/s,
//! run it under `--release` with `KV_ISOLATION_MSGS_PER_S=31250` (2026-11-26, two runs: healthy
//! pod p50 0.28-0.33 ms, p99 6.6-7.2 ms, worst 30-35 ms beside the broken pods, against p50
//! 0.16-0.19 ms, p99 4.5-5.5 ms before them, while they sent 50-52k gapped messages).
//!
//! Before gap fill moved off the event path, every gap of a broken pod held the worker for the
//! whole `replayTimeoutMs` (2 s) and the healthy pod's blocks waited behind it.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_core::{encode_batch, BlockHash, EngineHash, EventBatch};
use kv_indexer::daemon;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "iso/model";

/// A run of `hashes`, published by an aligned engine (its hashes are the index's keys).
fn stored(hashes: &[BlockHash]) -> Bytes {
    let published: Vec<EngineHash> = hashes.iter().map(|&k| EngineHash::aligned(k)).collect();
    Bytes::from(encode_batch(&EventBatch::stored_on_gpu(
        1.7e9, 0, &published, 16,
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

/// The healthy pod's loop: message `seq` for each of `seqs` (one new block each, 2 ms apart),
/// each waited for until indexed. The send-to-indexed latencies, sorted.
async fn healthy_loop(
    healthy: &mut PubSocket,
    pod: &str,
    seqs: std::ops::RangeInclusive<u64>,
    lookup: impl Fn(BlockHash) -> bool,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for seq in seqs {
        let h = BlockHash::new(7 << 50 | seq);
        let sent = Instant::now();
        healthy
            .send(message(pod, seq, &stored(&[h])))
            .await
            .expect("send");
        while !lookup(h) {
            // Not the bound (the test's end has it): how long to wait before calling it lost.
            assert!(
                sent.elapsed() < Duration::from_secs(10),
                "message {seq} of the healthy pod never applied"
            );
            tokio::task::yield_now().await;
        }
        latencies.push(sent.elapsed());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    latencies.sort();
    latencies
}

/// How long a gap fill waits for the black hole (`replayTimeoutMs`).
const REPLAY_TIMEOUT_MS: u64 = 2_000;

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
    config.kv_events_config.replay_timeout_ms = REPLAY_TIMEOUT_MS;
    // {ip} is the pod's address: 127.0.0.1 reaches the black hole, 127.0.0.3 refuses.
    config.kv_events_config.replay_endpoint_template = format!("tcp://{{ip}}:{hole_port}");
    let d = daemon::start(config).await.expect("daemon starts");
    let endpoint = d.zmq_endpoint.clone().expect("bind mode");

    let mut healthy = PubSocket::new();
    healthy.connect(&endpoint).await.expect("PUB connects");
    // Warm up: the first message may meet ZeroMQ's slow joiner; resend until it lands.
    let pod = "127.0.0.2:8000";
    let first = BlockHash::new(7 << 50);
    let lookup = |h: BlockHash| {
        d.indexer
            .model(MODEL)
            .is_some_and(|m| !m.index().lookup(h).is_empty())
    };
    let started = Instant::now();
    while !lookup(first) {
        assert!(started.elapsed() < Duration::from_secs(10), "warm-up");
        let _ = healthy.send(message(pod, 0, &stored(&[first]))).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The baseline: the same loop before the broken pods start, in this run.
    let alone = healthy_loop(&mut healthy, pod, 1..=400, lookup).await;

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

    // Measured once the broken pods gap (their fills in flight: the black hole's hangs for
    // the whole replay timeout).
    let started = Instant::now();
    while support::metric(&d.metrics_text(), "kvindexer_sequence_gaps_total") == 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the broken pods never gapped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let latencies = healthy_loop(&mut healthy, pod, 401..=800, lookup).await;
    // Both broken pods end up backed off, counting their gaps as lost (the black hole's first
    // fill can only end at its timeout).
    let backed_off = |d: &kv_indexer::daemon::RunningDaemon| {
        d.publishers()
            .snapshot()
            .iter()
            .filter(|(k, _)| {
                k.engine.pod.starts_with("127.0.0.1") || k.engine.pod.starts_with("127.0.0.3")
            })
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
    let figures = |l: &[Duration]| {
        let worst = l.last().copied().unwrap_or_default();
        (percentile(l, 50.0), percentile(l, 99.0), worst)
    };
    let (alone_p50, alone_p99, alone_worst) = figures(&alone);
    let (p50, p99, worst) = figures(&latencies);
    eprintln!(
        "healthy pod apply latency alone: p50 {alone_p50:?}, p99 {alone_p99:?}, worst \
         {alone_worst:?}; beside the broken pods: p50 {p50:?}, p99 {p99:?}, worst {worst:?}, \
         while they sent {flooded} gapped messages"
    );
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
    // Not held back by the broken pods, against the same loop before they started (same
    // daemon, machine and moment). Waiting behind a hanging fill takes the replay timeout
    // (2 s), and as the loop sends one message at a time, one message waits: it shows in the
    // worst latency, not in p99. Hence the bound: the worst alone plus half the timeout. Debug
    // build, 2026-11-26: worst 5.7-6.4 ms beside the broken pods, 4.5-5.4 ms before them. A
    // machine's scheduling stays far below the bound (the worst seen beside the broken pods
    // was 0.35 s with other builds on the machine, 0.41 s earlier under three CPU hogs); only
    // a build whose healthy pod waits for a fill fails it.
    // Every time bound of the suite, and what finds a 2x slowdown instead: docs/testing.md.
    let bound = alone_worst + Duration::from_millis(REPLAY_TIMEOUT_MS / 2);
    assert!(
        worst < bound,
        "worst {worst:?} (p99 {p99:?}, p50 {p50:?}; alone worst {alone_worst:?}, bound \
         {bound:?}): a broken pod's gap fill held back a healthy one"
    );
    let publishers = d.publishers().snapshot();
    assert_eq!(
        backed_off(&d),
        2,
        "both broken pods are backed off and count losses: {publishers:?}"
    );
    let healthy_state = publishers
        .iter()
        .find(|(k, _)| &*k.engine.pod == pod)
        .map(|(_, s)| s.clone())
        .expect("healthy publisher");
    assert_eq!(healthy_state.messages_lost, 0);
    assert_eq!(healthy_state.gap_fill_failures, 0);
    d.shutdown().await;
    drop(held);
}
