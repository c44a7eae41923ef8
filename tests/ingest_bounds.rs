//! Nothing lost, nothing locked out (over real sockets, the default configuration unless a
//! test says otherwise):
//! - a burst of 20,000 pods each sending one `BlockStored` at once is indexed whole, with no
//!   message dropped (a count of queued messages used to shed a third of them);
//! - a publisher flooding far past its share of the queue loses only its own queued messages,
//!   is resynchronised (here: no replay endpoint, so it is marked stale, counted as lost),
//!   while the healthy pods beside it lose nothing and are not slowed by it (against the same
//!   healthy pods without the flood, earlier in the same test);
//! - a flood of 500 junk model names cannot keep a real model out (`maxModels` used to admit
//!   the first 64 names until a restart), and a configured model keeps its place.
//!
//! Times are printed (this build's); the release figures come from benches/ingest-bounds.sh.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::BlockHash;
use kv_indexer::config::ModelConfig;
use kv_indexer::daemon::{self, RunningDaemon};
use support::pods::{connect, list, model_message, stored_message, MODEL};
use zeromq::SocketSend;

/// Whether `pod` holds `block` of `model` in the daemon's index.
fn holds(d: &RunningDaemon, model: &str, pod: &str, block: u64) -> bool {
    let Some(m) = d.indexer.model(model) else {
        return false;
    };
    let directory = m.index().directory();
    let engines = directory.engines_of(pod);
    m.index()
        .lookup(BlockHash::new(block))
        .iter()
        .any(|(e, _)| engines.contains(e))
}

/// Sends message `seq` of `pod` (one block) until the daemon holds it: the socket is past
/// ZeroMQ's slow-joiner window afterwards.
async fn warm_up(p: &mut zeromq::PubSocket, d: &RunningDaemon, model: &str, pod: &str, block: u64) {
    for _ in 0..500 {
        let _ = p.send(model_message(model, pod, 0, block)).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        if holds(d, model, pod, block) {
            return;
        }
    }
    panic!("{pod}'s warm-up message never arrived");
}

fn shed_total(d: &RunningDaemon) -> f64 {
    d.metrics_text()
        .lines()
        .filter(|l| l.starts_with("kvindexer_messages_shed_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_20000_pods_is_indexed_whole() {
    const SOCKETS: usize = 100;
    const PODS_PER_SOCKET: usize = 200;
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut sockets = Vec::new();
    for s in 0..SOCKETS {
        let mut p = connect(&d).await;
        warm_up(&mut p, &d, MODEL, &format!("warm-{s}"), 1 << 40 | s as u64).await;
        sockets.push(p);
    }
    // Every socket sends its pods' first message at once.
    let started = Instant::now();
    let sends = sockets.into_iter().enumerate().map(|(s, mut p)| {
        tokio::spawn(async move {
            for i in 0..PODS_PER_SOCKET {
                let n = (s * PODS_PER_SOCKET + i) as u64;
                p.send(model_message(MODEL, &format!("burst-{n}"), 0, n))
                    .await
                    .expect("send");
            }
            p
        })
    });
    let mut keep = Vec::new();
    for send in sends {
        keep.push(send.await.expect("sender"));
    }
    let sent = started.elapsed();
    let total = (SOCKETS * PODS_PER_SOCKET) as u64;
    let mut missing: Vec<u64> = (0..total).collect();
    // What is asserted: every pod indexed, none dropped. 60 s is when the test gives up on the
    // missing ones, not a target: the target (all indexed within 3 s of the first send) is
    // for a release build, whose figure benches/ingest-bounds.sh prints (docs/operations.md);
    // this build's time is printed below.
    while !missing.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} of {total} pods never indexed (first: burst-{}); shed: {}",
            missing.len(),
            missing[0],
            shed_total(&d)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        missing.retain(|&n| !holds(&d, MODEL, &format!("burst-{n}"), n));
    }
    eprintln!(
        "{total} pods sent in {sent:?}, all indexed {:?} after the first send (this build; benches/ingest-bounds.sh runs it in release)",
        started.elapsed()
    );
    assert_eq!(shed_total(&d), 0.0, "no message may be dropped");
    let listed = list(&d).await;
    let burst = listed
        .iter()
        .filter(|p| p.pod.starts_with("burst-"))
        .count();
    assert_eq!(burst as u64, total, "ListPods lists every pod of the burst");
    assert!(listed.iter().all(|p| !p.stale && p.messages_dropped == 0));
    drop(keep);
    d.shutdown().await;
}

/// `healthy-{h}` for each socket `h` sends message `i` (one block) for every `i` in `seqs`,
/// round by round, 10 ms apart; each is waited for until indexed. The send-to-indexed
/// latencies, sorted.
async fn healthy_rounds(
    d: &RunningDaemon,
    healthy: &mut [zeromq::PubSocket],
    seqs: std::ops::RangeInclusive<u64>,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for i in seqs {
        for (h, p) in healthy.iter_mut().enumerate() {
            let pod = format!("healthy-{h}");
            let block = 4 << 40 | (h as u64) << 20 | i;
            let sent = Instant::now();
            p.send(model_message(MODEL, &pod, i, block))
                .await
                .expect("send");
            while !holds(d, MODEL, &pod, block) {
                assert!(
                    sent.elapsed() < Duration::from_secs(10),
                    "message {i} of {pod} never applied (shed: {})",
                    shed_total(d)
                );
                tokio::task::yield_now().await;
            }
            latencies.push(sent.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    latencies.sort();
    latencies
}

fn over_share(d: &RunningDaemon) -> f64 {
    support::metric(
        &d.metrics_text(),
        "kvindexer_messages_shed_total{reason=\"over_share\"}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_publisher_loses_only_its_own_and_is_resynchronised() {
    let mut config = support::loopback_config();
    // One worker for all pods (the worst case) and a small share (64 KiB), so every burst of
    // the flood passes it.
    config.kv_events_config.concurrency = 1;
    config.kv_events_config.queue_bytes_per_pod = 64 << 10;
    let d = daemon::start(config).await.expect("daemon starts");

    const HEALTHY: usize = 4;
    let mut healthy = Vec::new();
    for h in 0..HEALTHY {
        let mut p = connect(&d).await;
        warm_up(
            &mut p,
            &d,
            MODEL,
            &format!("healthy-{h}"),
            3 << 40 | h as u64,
        )
        .await;
        healthy.push(p);
    }
    // The baseline: the same loop with no flood, on this machine, in this run.
    let alone = healthy_rounds(&d, &mut healthy, 1..=100).await;

    let mut flooder = connect(&d).await;
    warm_up(&mut flooder, &d, MODEL, "flooder", 1 << 41).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        // One payload, sent again and again (encoding it each time would load this process,
        // not the daemon): 500 blocks, about 5 KB a message, in bursts of 32 (160 KB, 2.5
        // times the share) a millisecond apart, several times what the worker applies in
        // either build. Unpaced, the sender (in this process, on the daemon's own two runtime
        // threads) took the CPU the daemon needed: 30-40k messages/s, and healthy pods' p99
        // 170-290 ms (p50 45-95 ms) in a debug build, the sender's cost, not the daemon's.
        let hashes: Vec<BlockHash> = (0..500).map(|i| BlockHash::new(2 << 40 | i)).collect();
        let payload = stored_message(MODEL, "flooder", 0, &hashes).into_vec()[2].clone();
        tokio::spawn(async move {
            let mut seq = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let message = zeromq::ZmqMessage::try_from(vec![
                    bytes::Bytes::from(format!("kv@flooder@{MODEL}")),
                    bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload.clone(),
                ])
                .expect("frames");
                flooder.send(message).await.expect("send");
                seq += 1;
                if seq.is_multiple_of(32) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            seq - 1
        })
    };
    // Measured once the flood is past its share, and while it stays so.
    let started = Instant::now();
    while over_share(&d) == 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the flood never passed its share"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let shed_before = over_share(&d);
    let flooded = healthy_rounds(&d, &mut healthy, 101..=200).await;
    let shed_during = over_share(&d) - shed_before;
    stop.store(true, Ordering::Relaxed);
    let sent = flood.await.expect("flood task");
    let figures = |l: &[Duration]| (percentile(l, 50.0), percentile(l, 99.0));
    let ((alone_p50, alone_p99), (p50, p99)) = (figures(&alone), figures(&flooded));
    eprintln!(
        "healthy pods' apply latency alone: p50 {alone_p50:?}, p99 {alone_p99:?}; beside the flood: \
         p50 {p50:?}, p99 {p99:?}; the flooder sent {sent} messages of 500 blocks, \
         {shed_during} shed while the healthy pods were measured"
    );
    assert!(
        shed_during > 0.0,
        "the flood went on past its share while the healthy pods were measured"
    );
    // Not slowed by the flood, against the same loop without it (same daemon, machine and
    // moment): the worker takes one message per pod in turn (the inbox's own tests check the
    // turns), so a healthy message waits for one of the flooder's at most; what is left is
    // the flood's load on the two cores. Debug build, 2026-11-26: alone p99 3-5 ms, beside the
    // flood 9-26 ms; with two CPU hogs running too, 9-17 ms and 20-39 ms. The bound, 10x the
    // baseline p99 plus 250 ms, is that wide so that only real waiting fails it: a build whose
    // healthy messages queue behind the flooder's backlog, not cut at the share (that build
    // also sheds nothing `over_share`), waits seconds, the backlog growing by thousands of
    // messages a second. Waiting behind the share alone (64 KiB, about 13 messages, a few ms
    // here) is below what a margin that holds on a busy machine can see. The release figure
    // comes from benches/ingest-bounds.sh (docs/operations.md).
    // Every time bound of the suite, and what finds a 2x slowdown instead: docs/testing.md.
    let bound = alone_p99 * 10 + Duration::from_millis(250);
    assert!(
        p99 <= bound,
        "healthy pods' p99 apply latency {p99:?} beside the flood, {alone_p99:?} without it \
         (bound {bound:?})"
    );

    // The flooder lost queued messages; with no replay endpoint configured the resync cannot
    // fetch them: counted as lost and marked stale, never silently short.
    let page = d.metrics_text();
    assert!(support::metric(&page, "kvindexer_resyncs_total{result=\"unavailable\"}") > 0.0);
    let pods = list(&d).await;
    let flooder = pods
        .iter()
        .find(|p| p.pod == "flooder")
        .expect("flooder listed");
    assert!(flooder.messages_dropped > 0, "{flooder:?}");
    assert!(flooder.messages_lost > 0 && flooder.stale, "{flooder:?}");
    for p in pods.iter().filter(|p| p.pod.starts_with("healthy-")) {
        assert_eq!(
            (p.messages_dropped, p.messages_lost, p.stale),
            (0, 0, false),
            "a healthy pod lost nothing: {p:?}"
        );
        assert_eq!(p.last_sequence, 200, "{p:?}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_model_names_cannot_lock_a_real_model_out() {
    let mut config = support::loopback_config();
    config
        .models
        .insert("configured/model".into(), ModelConfig::default());
    let max = config
        .indexer_config
        .kv_block_index_config
        .in_memory_config
        .max_models;
    let d = daemon::start(config).await.expect("daemon starts");
    let mut junk = connect(&d).await;
    warm_up(&mut junk, &d, "junk/0", "junk-pod", 0).await;
    for m in 1..500u64 {
        junk.send(model_message(&format!("junk/{m}"), "junk-pod", 0, m))
            .await
            .expect("send");
        // A PUB drops what its peer's pipe cannot take: paced so every name arrives.
        if m.is_multiple_of(50) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Past the flood: its last model is indexed (on a build that locks models out it never
    // is). How long the flood takes to apply is printed, not bounded: every name past
    // `maxModels` takes a place (a debug build took 46-81 s for the 500, 0.09-0.19 s a name,
    // a release build 4.3-4.9 s). What is bounded is progress: the test gives up when no model
    // was admitted for 30 s (counted as models held plus models that gave their place; a
    // build that locks models out admits none past the first `maxModels`).
    let waited = Instant::now();
    let (mut admitted, mut progressed) = (0.0, Instant::now());
    while !holds(&d, "junk/499", "junk-pod", 499) {
        let now = d.indexer.models().len() as f64
            + support::metric(&d.metrics_text(), "kvindexer_models_evicted_total");
        if now > admitted {
            (admitted, progressed) = (now, Instant::now());
        }
        assert!(
            progressed.elapsed() < Duration::from_secs(30),
            "the flood's last model is not indexed, and no model was admitted for 30 s \
             ({admitted} were)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let flood_applied = waited.elapsed();
    assert!(
        d.indexer.models().len() <= max,
        "maxModels still bounds the models"
    );
    assert!(
        d.indexer.model("configured/model").is_some(),
        "a configured model keeps its place"
    );

    // Then a real model's first message, on the flood's socket (past ZeroMQ's slow joiner, so
    // what is timed is the daemon's): indexed within 3 s of being sent. Admitting it takes the
    // place of a junk model at once, one name's work like each of the flood's (0.10-0.17 s in
    // a debug build, 11-23 ms in release); a build that locks models out never indexes it.
    let hashes: Vec<BlockHash> = (1..=5).map(|i| BlockHash::new(1 << 50 | i)).collect();
    let sent = Instant::now();
    junk.send(stored_message("real/model", "real-pod", 0, &hashes))
        .await
        .expect("send");
    while !(1..=5).all(|i| holds(&d, "real/model", "real-pod", 1 << 50 | i)) {
        assert!(
            sent.elapsed() < Duration::from_secs(3),
            "the real model's 5 blocks are not indexed 3 s after its first message"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "the flood's 500 models applied {flood_applied:?} after the last was sent; the real \
         model's 5 blocks indexed {:?} after its first message",
        sent.elapsed()
    );
    let page = d.metrics_text();
    let evicted = support::metric(&page, "kvindexer_models_evicted_total");
    assert!(
        evicted >= (500 - max) as f64,
        "{evicted} models gave their place (the flood's 500 names, {max} at most)"
    );
    assert!(d.indexer.model("configured/model").is_some());
    d.shutdown().await;
}
