//! 100,000 distinct publishers over real sockets: they register, are listed, fall silent and
//! are forgotten after the idle timeout, and the memory they held returns. This binary counts
//! its heap, so it holds this one test only: a daemon of another test running beside it would
//! count too.

mod support;

use std::time::{Duration, Instant};

use kv_indexer::daemon;
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_proto::kvindexer_v1::PodState;
use support::pods::{
    connect, eventually, holds, lifecycle_config, list, message, send_until_held, MODEL,
};
use zeromq::SocketSend;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

/// The `i`-th of the churn test's pod ids.
fn churn_pod(i: usize) -> String {
    format!("vllm-{i:06}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_publishers_register_and_their_memory_returns_when_forgotten() {
    const PODS: usize = 100_000;
    // Longer than registering takes in a debug build on a 2-core machine: 8 s alone, 18 s with
    // three CPU-bound processes beside it.
    let idle = Duration::from_secs(40);
    let config = lifecycle_config(Duration::from_secs(60), idle);
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
