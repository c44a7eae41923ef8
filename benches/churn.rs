//! `cargo bench --bench churn`: what pods that come and go under new names cost, beside the
//! baseline of the same messages from one pod, in the same run (three rounds, medians).
//!
//! Scenario: `N` = 100,000 messages, each one vLLM-shaped batch with one `BlockStored` of one
//! block (distinct tokens, seed 2026, hashed as vLLM's sha256_cbor with the default settings:
//! every engine aligned), model `bench/model`.
//!
//! - *core*: the messages applied with `Indexer::apply_batch` (no sockets): baseline all from
//!   one pod, then each from a new pod (`10.<a>.<b>.<c>:8000`), then every pod forgotten
//!   (`Indexer::remove_pod`); the heap the pods held, and what is left after forgetting;
//! - *daemon*: a real daemon (bind mode, release build) and one vLLM-shaped PUB socket that
//!   sends the messages under `kv@<pod>@bench/model` topics: baseline one topic, then one new
//!   topic per message; the clock runs until every message is applied (the daemon's
//!   `kvindexer_messages_applied_total`); then the socket closes and, after the grace period
//!   (`publisherGracePeriod: 500ms`), the daemon forgets every publisher; resident memory is
//!   read from `/proc/self/status` (the daemon runs in this process).

use std::time::{Duration, Instant};

use kv_core::{
    decode_batch, encode_batch, BlockStored, EngineHash, EventBatch, Indexer, IndexerSettings,
    KvEvent, Medium, RequestExtras, SplitMix64, TokenProcessor, TokenProcessorConfig,
};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

const N: usize = 100_000;
const MODEL: &str = "bench/model";

/// The payloads: one block each, distinct tokens, hashed as vLLM would with the default
/// settings (so every engine is aligned: what is measured is registration, not translation).
fn payloads() -> Vec<Vec<u8>> {
    let mut rng = SplitMix64::new(2026);
    let processor = TokenProcessor::new(&TokenProcessorConfig::default()).expect("defaults");
    (0..N)
        .map(|_| {
            let tokens: Vec<u32> = (0..16).map(|_| rng.below(150_000) as u32).collect();
            let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
            encode_batch(&EventBatch {
                ts: 1.7e9,
                events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes.into_iter().map(EngineHash::aligned).collect(),
                    token_ids: tokens,
                    block_size: 16,
                    medium: Some(Medium::Gpu),
                    ..Default::default()
                }))],
                data_parallel_rank: Some(0),
            })
        })
        .collect()
}

/// The `i`-th distinct pod name.
fn pod(i: usize) -> String {
    format!("10.{}.{}.{}:8000", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

fn core(payloads: &[Vec<u8>]) {
    let batches: Vec<EventBatch> = payloads
        .iter()
        .map(|p| decode_batch(p).expect("payload decodes"))
        .collect();
    let names: Vec<String> = (0..N).map(pod).collect();
    let (mut one, mut many, mut forget, mut held, mut left, mut left_one) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for _ in 0..3 {
        let ix = Indexer::new(IndexerSettings::default()).expect("default settings");
        ix.apply_batch(MODEL, "warm", &batches[0]).expect("applies");
        let before = live_heap_bytes();
        let started = Instant::now();
        for b in &batches {
            ix.apply_batch(MODEL, "10.0.0.1:8000", b).expect("applies");
        }
        one.push(started.elapsed().as_secs_f64());
        ix.remove_pod(MODEL, "10.0.0.1:8000");
        left_one.push(live_heap_bytes().saturating_sub(before) as f64 / N as f64);
        drop(ix);

        let ix = Indexer::new(IndexerSettings::default()).expect("default settings");
        ix.apply_batch(MODEL, "warm", &batches[0]).expect("applies");
        let before = live_heap_bytes();
        let started = Instant::now();
        for (b, name) in batches.iter().zip(&names) {
            ix.apply_batch(MODEL, name, b).expect("applies");
        }
        many.push(started.elapsed().as_secs_f64());
        held.push((live_heap_bytes() - before) as f64 / N as f64);
        let started = Instant::now();
        for name in &names {
            ix.remove_pod(MODEL, name);
        }
        forget.push(started.elapsed().as_secs_f64());
        left.push(live_heap_bytes().saturating_sub(before) as f64 / N as f64);
        let pods = ix
            .model(MODEL)
            .map_or(0, |m| m.index().directory().pod_count());
        assert_eq!(pods, 1, "every new pod forgotten");
    }
    let (one, many) = (median(&one), median(&many));
    println!("core, {N} messages of one block:");
    println!("  baseline, all from one pod     {:>8.3} s", one);
    println!(
        "  each from a new pod            {:>8.3} s  ({:.2}x the baseline)",
        many,
        many / one
    );
    println!("  forgetting the {N} pods     {:>8.3} s", median(&forget));
    println!(
        "  heap per message: {:.0} B while known; left after forgetting: {:.0} B from new \
         pods, {:.0} B from one pod (the blocks' table and node storage, kept for reuse)",
        median(&held),
        median(&left),
        median(&left_one)
    );
}

fn main() {
    let payloads = payloads();
    core(&payloads);
    daemon(&payloads);
}

/// Sends `payloads` as message 0 of a new pod each (`new_pods`) or as messages 0.. of one pod,
/// in rounds of 1,000 (each once the daemon applied the previous: ZeroMQ's PUB drops what its
/// queue cannot hold), and returns the seconds until every block is indexed.
async fn drive(
    d: &kv_indexer::daemon::RunningDaemon,
    socket: &mut zeromq::PubSocket,
    payloads: &[Vec<u8>],
    new_pods: bool,
    offset: usize,
) -> f64 {
    use zeromq::SocketSend;
    let memberships = || {
        d.indexer
            .stats()
            .iter()
            .map(|(_, s)| s.memberships)
            .sum::<u64>()
    };
    let base = memberships();
    let started = Instant::now();
    for (round, chunk) in payloads.chunks(1_000).enumerate() {
        for (k, payload) in chunk.iter().enumerate() {
            let i = round * 1_000 + k;
            let (pod, seq) = if new_pods {
                (pod(offset + i), 0u64)
            } else {
                (pod(offset), i as u64)
            };
            let message = zeromq::ZmqMessage::try_from(vec![
                bytes::Bytes::from(format!("kv@{pod}@{MODEL}")),
                bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                bytes::Bytes::from(payload.clone()),
            ])
            .expect("frames");
            socket.send(message).await.expect("send");
        }
        let want = base + (round * 1_000 + chunk.len()) as u64;
        while memberships() < want {
            assert!(started.elapsed() < Duration::from_secs(300), "stalled");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    started.elapsed().as_secs_f64()
}

fn daemon(payloads: &[Vec<u8>]) {
    use zeromq::Socket;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut config = kv_indexer::config::Config::default();
        config.server.grpc_addr = "127.0.0.1:0".into();
        config.server.metrics_addr = "127.0.0.1:0".into();
        config.kv_events_config.zmq_endpoint = "tcp://127.0.0.1:0".into();
        let d = kv_indexer::daemon::start(config)
            .await
            .expect("daemon starts");
        let mut socket = zeromq::PubSocket::new();
        socket
            .connect(d.zmq_endpoint.as_deref().expect("bind mode"))
            .await
            .expect("connects");
        // Past the slow joiner: one message that lands.
        let warm = &payloads[..1];
        while d.indexer.stats().is_empty() {
            drive_once(&mut socket, &warm[0]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rss_before = rss_bytes();
        let (mut one, mut many) = (Vec::new(), Vec::new());
        for round in 0..3 {
            // Distinct pods per round (3 x N), distinct from the baseline's pod.
            let offset = 1 + round * N;
            one.push(drive(&d, &mut socket, payloads, false, 10 * N + round).await);
            many.push(drive(&d, &mut socket, payloads, true, offset).await);
        }
        let pods = d.publishers().pod_count();
        let (one, many) = (median(&one), median(&many));
        println!("daemon (bind mode, one PUB socket), {N} messages of one block:");
        println!("  baseline, all from one pod     {:>8.3} s", one);
        println!(
            "  each from a new pod            {:>8.3} s  ({:.2}x the baseline)",
            many,
            many / one
        );
        println!(
            "  {pods} pods known at the end; RSS +{} MiB over the three rounds",
            rss_bytes().saturating_sub(rss_before) >> 20
        );
        d.shutdown().await;
    });
}

/// Sends one warm-up message (sequence 0 of pod `warm-up`).
async fn drive_once(socket: &mut zeromq::PubSocket, payload: &[u8]) {
    use zeromq::SocketSend;
    let message = zeromq::ZmqMessage::try_from(vec![
        bytes::Bytes::from(format!("kv@warm-up@{MODEL}")),
        bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
        bytes::Bytes::copy_from_slice(payload),
    ])
    .expect("frames");
    let _ = socket.send(message).await;
}

/// The process's resident memory (Linux), 0 elsewhere.
fn rss_bytes() -> usize {
    kv_indexer::resident_memory_bytes().map_or(0, |b| b as usize)
}
