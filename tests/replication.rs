//! Replication end to end, against a real `redis-server` (started by the test on a free port in
//! a temporary directory): several kv-indexer replicas over real sockets, vLLM-shaped
//! publishers (ZMQ PUB, msgpack batches with vLLM's block hashes), gRPC `ScorePods` and
//! `ListPods`.
//!
//! - bind mode, publishers on different replicas: every replica's ScorePods agrees soon after
//!   an event (p99 over thousands, through the log against the replica that received it:
//!   within 3x its p99 plus 100 ms), and the indexes end identical;
//! - SIGKILL of a replica process holding ~1M memberships, then a restart: ready and agreeing
//!   within 5 s, blocks stored before the kill (and never again) included;
//! - Redis killed for 10 s under load: every replica keeps serving, and all agree within 10 s
//!   of Redis coming back;
//! - connect mode (every replica hears every publisher): each message is applied once.
//!
//! Without `redis-server` on PATH these tests say they were skipped (and fail under CI=true).

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_core::{
    encode_batch, BlockHash, BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium,
    RequestExtras, TokenProcessor, TokenProcessorConfig,
};
use kv_indexer::config::{Config, ConfigDuration, ConnectEndpoint};
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ListPodsRequest};
use support::redis::RedisServer;
use support::replica::{self, Process};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "repl/model";

/// One test at a time: each runs several replicas and a Redis, and the first measures latency,
/// which the others' load on these two cores would distort.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const SEED: &str = "12345";
const BLOCK: usize = 16;
const PROMPT_BLOCKS: usize = 4;

fn replica_config(redis: &str, prefix: &str, id: &str) -> Config {
    let mut c = support::loopback_config();
    c.kv_events_config.concurrency = 2;
    c.indexer_config.token_processor_config.hash_seed = Some(SEED.into());
    c.replication.enabled = true;
    c.replication.redis_url = redis.into();
    c.replication.key_prefix = prefix.into();
    c.replication.replica_id = id.into();
    c.replication.snapshot_interval = ConfigDuration::secs(1);
    c
}

async fn start_replicas(redis: &RedisServer, prefix: &str, n: usize) -> Vec<RunningDaemon> {
    let mut out = Vec::new();
    for i in 0..n {
        let d = daemon::start(replica_config(&redis.url(), prefix, &format!("r{i}")))
            .await
            .expect("replica starts");
        out.push(d);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !out.iter().all(RunningDaemon::is_ready) {
        assert!(Instant::now() < deadline, "replicas never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    out
}

fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Prompt `n` of publisher `p`: distinct tokens, so distinct blocks.
fn prompt(p: usize, n: usize) -> Vec<u32> {
    (0..PROMPT_BLOCKS * BLOCK)
        .map(|i| 1_000 + ((p * 7_919 + n * 104_729 + i * 31) % 90_000) as u32)
        .collect()
}

fn processor() -> TokenProcessor {
    TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some(SEED.into()),
        block_size: BLOCK,
        ..Default::default()
    })
    .expect("processor")
}

fn stored(hashes: &[BlockHash], parent: Option<BlockHash>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
        parent_block_hash: parent.map(EngineHash::aligned),
        token_ids: tokens,
        block_size: BLOCK as u32,
        medium: Some(Medium::Gpu),
        ..Default::default()
    }))
}

fn payload(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(&EventBatch {
        ts: now_ts(),
        events,
        data_parallel_rank: Some(0),
    })
}

/// A vLLM-shaped publisher: one PUB socket, one sequence counter.
struct Publisher {
    socket: PubSocket,
    topic: String,
    pod: String,
    seq: u64,
}

impl Publisher {
    /// Connects to a replica's bind-mode endpoint.
    async fn connect(endpoint: &str, pod: &str) -> Self {
        let mut socket = PubSocket::new();
        socket.connect(endpoint).await.expect("PUB connects");
        Self {
            socket,
            topic: format!("kv@{pod}@{MODEL}"),
            pod: pod.into(),
            seq: 0,
        }
    }

    /// Binds (connect mode: replicas dial it).
    async fn bind(pod: &str) -> (Self, String) {
        let mut socket = PubSocket::new();
        let bound = socket
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("PUB binds")
            .to_string();
        let p = Self {
            socket,
            topic: format!("kv@{pod}@{MODEL}"),
            pod: pod.into(),
            seq: 0,
        };
        (p, bound)
    }

    async fn send_seq(&mut self, seq: u64, payload: &[u8]) {
        let msg = ZmqMessage::try_from(vec![
            Bytes::copy_from_slice(self.topic.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .expect("frames");
        self.socket.send(msg).await.expect("PUB send");
    }

    async fn send(&mut self, payload: &[u8]) {
        self.send_seq(self.seq, payload).await;
        self.seq += 1;
    }

    /// Sends message 0 (a prompt) until every replica in `replicas` scores it: past ZeroMQ's
    /// slow-joiner window.
    async fn warm_up(&mut self, tokens: &[u32], replicas: &[&RunningDaemon]) {
        let hashes = processor().block_hashes(tokens, &RequestExtras::default());
        let first = payload(vec![stored(&hashes, None, tokens.to_vec())]);
        for _ in 0..200 {
            self.send_seq(0, &first).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut all = true;
            for r in replicas {
                all &= matched(r, tokens, &self.pod).await == PROMPT_BLOCKS as u32;
            }
            if all {
                self.seq = 1;
                return;
            }
        }
        panic!("{} never reached the replicas", self.pod);
    }
}

use support::client;

/// Blocks of `tokens` that `pod` holds (scored as a prompt that continues past them).
async fn matched_on(
    client: &mut KvIndexerClient<tonic::transport::Channel>,
    tokens: &[u32],
    pod: &str,
) -> u32 {
    support::matched_blocks(client, MODEL, &support::past(tokens), pod).await
}

/// Whether `pod` holds every block of `tokens` on `d`.
async fn holds(d: &RunningDaemon, tokens: Vec<u32>, pod: &str) -> bool {
    matched(d, &tokens, pod).await == PROMPT_BLOCKS as u32
}

/// Waits (up to 5 s) until `d` scores `tokens` as held by `pod` (or, with `held == false`, as
/// not held). An index that agrees with the others may still be about to apply a message the
/// publisher has sent, so agreement alone is not the moment to look.
async fn eventually_holds(d: &RunningDaemon, tokens: Vec<u32>, pod: &str, held: bool) {
    let started = Instant::now();
    while holds(d, tokens.clone(), pod).await != held {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{pod} holds {held} never became true"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn matched(d: &RunningDaemon, tokens: &[u32], pod: &str) -> u32 {
    matched_on(&mut client(d).await, tokens, pod).await
}

/// Every membership of a replica's index, sorted: (model, pod, rank, tier, hash).
fn digest(d: &RunningDaemon) -> BTreeSet<(String, String, u32, u8, u64)> {
    let mut out = BTreeSet::new();
    d.indexer.export_each(|model, key, blocks| {
        for (hash, tier) in blocks {
            out.insert((
                model.to_owned(),
                key.pod.to_string(),
                key.dp_rank,
                *tier as u8,
                hash.get(),
            ));
        }
    });
    out
}

/// Waits until every replica's index is identical (and not empty); returns how long it took.
async fn converge(replicas: &[&RunningDaemon], within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let digests: Vec<_> = replicas.iter().map(|r| digest(r)).collect();
        if !digests[0].is_empty() && digests.iter().all(|d| *d == digests[0]) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "replicas disagree after {within:?}: sizes {:?}",
            digests.iter().map(BTreeSet::len).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_mode_replicas_agree_soon_after_each_event() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("bind_mode_replicas_agree") else {
        return;
    };
    let replicas = start_replicas(&redis, "agree", 3).await;
    let refs: Vec<&RunningDaemon> = replicas.iter().collect();
    let processor = processor();
    let mut publishers = Vec::new();
    for p in 0..6 {
        let endpoint = replicas[p % 3].zmq_endpoint.clone().expect("bind mode");
        let mut publisher = Publisher::connect(&endpoint, &format!("10.0.0.{p}:8000")).await;
        publisher.warm_up(&prompt(p, 0), &refs).await;
        publishers.push(publisher);
    }
    const EVENTS: usize = 1_500;
    let (sent_tx, sent_rx) = tokio::sync::watch::channel(Vec::<(usize, usize, Instant)>::new());
    let mut checkers = Vec::new();
    for r in &replicas {
        let mut c = client(r).await;
        let mut sent_rx = sent_rx.clone();
        checkers.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(EVENTS);
            let mut next = 0;
            while next < EVENTS {
                let batch: Vec<_> = sent_rx.borrow_and_update()[next..].to_vec();
                if batch.is_empty() {
                    let _ = sent_rx.changed().await;
                    continue;
                }
                for (p, n, at) in batch {
                    let tokens = prompt(p, n);
                    let pod = format!("10.0.0.{p}:8000");
                    let deadline = at + Duration::from_secs(10);
                    while matched_on(&mut c, &tokens, &pod).await != PROMPT_BLOCKS as u32 {
                        assert!(
                            Instant::now() < deadline,
                            "event {n} of {pod} never arrived"
                        );
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    latencies.push(at.elapsed());
                    next += 1;
                }
            }
            latencies
        }));
    }
    for e in 0..EVENTS {
        let p = e % publishers.len();
        let n = 1 + e / publishers.len();
        let tokens = prompt(p, n);
        let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
        publishers[p]
            .send(&payload(vec![stored(&hashes, None, tokens)]))
            .await;
        sent_tx.send_modify(|v| v.push((p, n, Instant::now())));
        // 100 events/s across the three replicas: what the lag is measured at. At 333/s (3 ms)
        // a debug build on a slow 2-core day saturates (about 150 events/s end to end on
        // 2026-11-24, old and new code alike) and the figure becomes queueing, not replication
        // lag (p50 0.8-2 s, growing with the run's length); throughput is measured by
        // benches/replication-load.sh in release.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Each checker saw the events in order, and event `e` was published to replica `e % 3`
    // (publisher `e % 6`, on replica `p % 3`): that replica's own observations are the
    // baseline (ZMQ, its worker, its index, the checker's polling), the other two replicas'
    // are the same events through the shared log.
    let (mut local, mut replicated) = (Vec::new(), Vec::new());
    for (r, c) in checkers.into_iter().enumerate() {
        for (e, lag) in c.await.expect("checker").into_iter().enumerate() {
            if e % 3 == r {
                local.push(lag);
            } else {
                replicated.push(lag);
            }
        }
    }
    local.sort();
    replicated.sort();
    let figures = |l: &[Duration]| (percentile(l, 0.5), percentile(l, 0.99), l[l.len() - 1]);
    let (local_p50, local_p99, local_max) = figures(&local);
    let (p50, p99, max) = figures(&replicated);
    eprintln!(
        "{EVENTS} events: on the replica that received them p50 {local_p50:?}, p99 \
         {local_p99:?}, max {local_max:?}; on the other two, through the log, p50 {p50:?}, p99 \
         {p99:?}, max {max:?}"
    );
    // Replication lag at 100 events/s: the same events through the log against the replica
    // that received them, same run. Debug build on a busy 2-core machine, 2026-11-26, two
    // runs: p99 41-57 ms through the log, 37-55 ms on the receiving replica (p50 9 vs 7 ms).
    // A log read that waits for a poll interval or a batch to fill, rather than for the next
    // entry, adds up to its period to every event; the bound, 3x the receiving replica's p99
    // plus 100 ms (0.21-0.27 s in those runs), passes the measured ratio (1.0-1.1x; on
    // 2026-11-27, with other builds running, 203 against 204 ms) and fails a read period of
    // 250 ms (it was 10x + 250 ms, which only a period of a second failed). A 2x slowdown of
    // the log's path is for benches/replication-load.sh to find, as is throughput
    // (docs/testing.md).
    let bound = local_p99 * 3 + Duration::from_millis(100);
    assert!(
        p99 <= bound,
        "replication lag p99 {p99:?}, {local_p99:?} on the receiving replica (bound {bound:?})"
    );
    converge(&refs, Duration::from_secs(5)).await;
    // Each replica applied the other replicas' messages from the log (two thirds of the
    // events), and recognised its own coming back there without decoding them.
    for r in &replicas {
        let page = r.metrics_text();
        let entries = |outcome: &str| {
            support::metric(
                &page,
                &format!("kvindexer_replication_log_entries_total{{outcome=\"{outcome}\"}}"),
            )
        };
        assert!(entries("applied") >= (EVENTS * 2 / 3) as f64, "{page}");
        assert!(entries("already_applied") >= (EVENTS / 3) as f64, "{page}");
    }
    let pods = client(&replicas[1])
        .await
        .list_pods(ListPodsRequest {
            model: MODEL.into(),
        })
        .await
        .expect("ListPods")
        .into_inner()
        .pods;
    assert_eq!(pods.len(), 6);
    for pod in pods {
        let p: usize = pod.pod[7..8].parse().expect("pod index");
        assert_eq!(pod.received_by, format!("r{}", p % 3), "{pod:?}");
    }
    for r in replicas {
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_mode_applies_each_message_once_though_every_replica_appends_it() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("connect_mode_applies_once") else {
        return;
    };
    let mut publishers = Vec::new();
    let mut endpoints = Vec::new();
    for p in 0..2 {
        let pod = format!("10.1.0.{p}:8000");
        let (publisher, bound) = Publisher::bind(&pod).await;
        endpoints.push(ConnectEndpoint {
            endpoint: bound,
            pod: pod.clone(),
            model: MODEL.into(),
            replay_endpoint: String::new(),
        });
        publishers.push(publisher);
    }
    let mut replicas = Vec::new();
    for i in 0..3 {
        let mut c = replica_config(&redis.url(), "connect", &format!("c{i}"));
        c.kv_events_config.zmq_endpoint = String::new();
        c.kv_events_config.endpoints = endpoints.clone();
        replicas.push(daemon::start(c).await.expect("replica starts"));
    }
    let refs: Vec<&RunningDaemon> = replicas.iter().collect();
    let processor = processor();
    for (p, publisher) in publishers.iter_mut().enumerate() {
        publisher.warm_up(&prompt(p, 0), &refs).await;
    }
    // Each publisher stores 40 prompts, then evicts the even ones: a message applied twice
    // (a store again after its removal) would bring evicted blocks back.
    let mut sent = [1u64; 2];
    for n in 1..=40 {
        for (p, publisher) in publishers.iter_mut().enumerate() {
            let tokens = prompt(p, n);
            let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
            publisher
                .send(&payload(vec![stored(&hashes, None, tokens)]))
                .await;
            sent[p] += 1;
        }
    }
    for n in (2..=40).step_by(2) {
        for (p, publisher) in publishers.iter_mut().enumerate() {
            let hashes = processor.block_hashes(&prompt(p, n), &RequestExtras::default());
            publisher
                .send(&payload(vec![KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes.into_iter().map(EngineHash::aligned).collect(),
                    medium: Some(Medium::Gpu),
                    ..Default::default()
                })]))
                .await;
            sent[p] += 1;
        }
    }
    converge(&refs, Duration::from_secs(10)).await;
    // Let every replica read the log's copies of everything.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    converge(&refs, Duration::from_secs(5)).await;
    for r in &replicas {
        for (p, sent) in sent.iter().enumerate() {
            let pod = format!("10.1.0.{p}:8000");
            for n in 1..=40 {
                let want = if n % 2 == 0 { 0 } else { PROMPT_BLOCKS as u32 };
                assert_eq!(
                    matched(r, &prompt(p, n), &pod).await,
                    want,
                    "{pod} prompt {n}"
                );
            }
            let states = r.publishers().snapshot();
            let (_, state) = states
                .iter()
                .find(|(k, _)| *k.engine.pod == *pod)
                .expect("publisher known");
            assert_eq!(state.messages, *sent, "{pod}: messages applied once each");
            assert_eq!(state.last_seq, Some(sent - 1));
        }
        let page = r.metrics_text();
        // The log's copies were recognised before decoding, or dropped by the workers.
        let dropped =
            support::metric(
                &page,
                "kvindexer_events_skipped_total{reason=\"duplicate\"}",
            ) + support::metric(&page, "kvindexer_events_skipped_total{reason=\"stale\"}")
                + support::metric(
                    &page,
                    "kvindexer_replication_log_entries_total{outcome=\"already_applied\"}",
                );
        assert!(
            dropped >= sent.iter().sum::<u64>() as f64,
            "the log's copies were dropped, not applied: {dropped}"
        );
    }
    for r in replicas {
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_keep_serving_through_a_redis_outage_and_agree_after_it() {
    let _serial = SERIAL.lock().await;
    let Some(mut redis) = RedisServer::start("redis_outage") else {
        return;
    };
    let replicas = start_replicas(&redis, "outage", 3).await;
    let refs: Vec<&RunningDaemon> = replicas.iter().collect();
    let mut publishers = Vec::new();
    for (p, replica) in replicas.iter().enumerate() {
        let endpoint = replica.zmq_endpoint.clone().expect("bind mode");
        let mut publisher = Publisher::connect(&endpoint, &format!("10.2.0.{p}:8000")).await;
        publisher.warm_up(&prompt(p, 0), &refs).await;
        publishers.push(publisher);
    }
    let processor = processor();
    let mut n = 0;
    let mut load = |publishers: &mut Vec<Publisher>| {
        n += 1;
        let mut msgs = Vec::new();
        for p in 0..publishers.len() {
            let tokens = prompt(p, n);
            let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
            msgs.push((p, payload(vec![stored(&hashes, None, tokens)])));
        }
        (n, msgs)
    };
    // Two seconds of load, then Redis dies for ten.
    for _ in 0..100 {
        let (_, msgs) = load(&mut publishers);
        for (p, m) in msgs {
            publishers[p].send(&m).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.kill();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(10) {
        let (n, msgs) = load(&mut publishers);
        for (p, m) in msgs {
            publishers[p].send(&m).await;
        }
        if n % 25 == 0 {
            // Each replica keeps applying its own publisher's events and answering.
            for (p, r) in replicas.iter().enumerate() {
                let pod = format!("10.2.0.{p}:8000");
                let tokens = prompt(p, n);
                let mut ok = false;
                for _ in 0..50 {
                    if matched(r, &tokens, &pod).await == PROMPT_BLOCKS as u32 {
                        ok = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                assert!(
                    ok,
                    "replica {p} stopped applying its own events during the outage"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.restart();
    let back = Instant::now();
    for _ in 0..50 {
        let (_, msgs) = load(&mut publishers);
        for (p, m) in msgs {
            publishers[p].send(&m).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    converge(
        &refs,
        Duration::from_secs(10).saturating_sub(back.elapsed()),
    )
    .await;
    eprintln!("agreed {:?} after Redis came back", back.elapsed());
    for r in &replicas {
        let page = r.metrics_text();
        // The outage was seen (commands failed) and survived (the tasks reconnected).
        assert!(
            page.contains("kvindexer_replication_redis_errors_total{task="),
            "{page}"
        );
        assert!(
            support::metric(&page, "kvindexer_replication_reconnects_total") >= 1.0,
            "{page}"
        );
        assert_eq!(
            support::metric(&page, "kvindexer_replication_append_dropped_total"),
            0.0
        );
    }
    for r in replicas {
        r.shutdown().await;
    }
}

/// Blocks per (pod, rank) on a replica process, from ListPods.
async fn blocks_per_engine(p: &Process) -> Vec<(String, u32, u64)> {
    p.pods(MODEL)
        .await
        .into_iter()
        .map(|p| (p.pod, p.data_parallel_rank, p.blocks))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_replica_with_a_million_memberships_comes_back_warm_within_5s() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("sigkill_warm_restart") else {
        return;
    };
    let dir = support::temp_dir("sigkill");
    let ports_a = replica::ports();
    let ports_b = replica::ports();
    let config = |name, ports| {
        replica::write_config(&dir, name, &redis.url(), "kill", ports, (SEED, BLOCK), "")
    };
    let (config_a, config_b) = (config("a", ports_a), config("b", ports_b));
    let a = Process::spawn(&config_a, ports_a);
    let mut b = Process::spawn(&config_b, ports_b);
    for p in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !p.ready().await {
            assert!(Instant::now() < deadline, "a replica never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // 50 pods publish to replica A: a real prompt each (scored by tokens later), then 20,000
    // blocks each in runs of 250 (continuations, as vLLM sends a long prompt's later runs).
    const PODS: usize = 50;
    const BLOCKS_PER_POD: usize = 20_000;
    let processor = processor();
    let endpoint = format!("tcp://127.0.0.1:{}", ports_a.0);
    let mut rng = support::Rng::new(0x5eed_2026);
    let mut publishers = Vec::new();
    for p in 0..PODS {
        let pod = format!("10.3.0.{p}:8000");
        let mut publisher = Publisher::connect(&endpoint, &pod).await;
        let tokens = prompt(p, 0);
        let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
        let first = payload(vec![stored(&hashes, None, tokens.clone())]);
        for _ in 0..200 {
            publisher.send_seq(0, &first).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if a.matched(MODEL, &tokens, &pod).await == PROMPT_BLOCKS as u32 {
                break;
            }
        }
        publisher.seq = 1;
        publishers.push(publisher);
    }
    for round in 0..BLOCKS_PER_POD / 250 {
        for publisher in publishers.iter_mut() {
            let hashes: Vec<BlockHash> =
                (0..250).map(|_| BlockHash::from(rng.next_u64())).collect();
            let parent = Some(BlockHash::from(rng.next_u64()));
            publisher
                .send(&payload(vec![stored(&hashes, parent, Vec::new())]))
                .await;
        }
        if round % 8 == 7 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let expected: u64 = (PODS * (BLOCKS_PER_POD + PROMPT_BLOCKS)) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (pa, pb) = (blocks_per_engine(&a).await, blocks_per_engine(&b).await);
        let total: u64 = pa.iter().map(|p| p.2).sum();
        if total == expected && pa == pb {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replicas never held all {expected} memberships: A {total}, A==B {}",
            pa == pb
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A snapshot covering everything (interval 1 s), then SIGKILL and a restart.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    b.kill();
    let restarted = Instant::now();
    b = Process::spawn(&config_b, ports_b);
    while !b.ready().await {
        assert!(
            restarted.elapsed() < Duration::from_secs(5),
            "not ready within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ready_after = restarted.elapsed();
    let want = blocks_per_engine(&a).await;
    loop {
        if blocks_per_engine(&b).await == want {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(5),
            "not agreeing within 5 s of the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let agreed_after = restarted.elapsed();
    for p in 0..PODS {
        let pod = format!("10.3.0.{p}:8000");
        assert_eq!(
            b.matched(MODEL, &prompt(p, 0), &pod).await,
            PROMPT_BLOCKS as u32,
            "{pod}"
        );
    }
    eprintln!("{expected} memberships: restarted replica ready after {ready_after:?}, agreeing after {agreed_after:?}");
    drop(b);
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A payload storing `tokens` as one root run, stamped `ts`.
fn stored_at(tokens: &[u32], ts: f64) -> Vec<u8> {
    let hashes = processor().block_hashes(tokens, &RequestExtras::default());
    encode_batch(&EventBatch {
        ts,
        events: vec![stored(&hashes, None, tokens.to_vec())],
        data_parallel_rank: Some(0),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_log_before_vllm_is_asked() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("gap_filled_from_the_log") else {
        return;
    };
    // One vLLM publisher seen through two sockets: replica A dials one, replica B the other,
    // so a message can reach B and not A. A's replay endpoint records every request.
    let pod = "10.4.0.1:8000";
    let (mut to_a, endpoint_a) = Publisher::bind(pod).await;
    let (mut to_b, endpoint_b) = Publisher::bind(pod).await;
    let mut router = zeromq::RouterSocket::new();
    let replay = router
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("ROUTER binds")
        .to_string();
    let requests = tokio::spawn(async move {
        use zeromq::SocketRecv;
        let mut n = 0;
        while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(8), router.recv()).await {
            n += 1;
        }
        n
    });
    let mut replicas = Vec::new();
    for (id, endpoint, replay) in [("a", endpoint_a, replay), ("b", endpoint_b, String::new())] {
        let mut c = replica_config(&redis.url(), "gapfill", id);
        c.kv_events_config.zmq_endpoint = String::new();
        c.kv_events_config.endpoints = vec![ConnectEndpoint {
            endpoint,
            pod: pod.into(),
            model: MODEL.into(),
            replay_endpoint: replay,
        }];
        replicas.push(daemon::start(c).await.expect("replica starts"));
    }
    let t0 = now_ts();
    let payloads: Vec<Vec<u8>> = (0..7)
        .map(|n| stored_at(&prompt(9, n), t0 + n as f64 * 0.01))
        .collect();
    // Message 0 through both sockets until both replicas have it (slow joiners).
    for attempt in 0.. {
        assert!(attempt < 200, "message 0 never reached both replicas");
        to_a.send_seq(0, &payloads[0]).await;
        to_b.send_seq(0, &payloads[0]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut both = true;
        for r in &replicas {
            both &= matched(r, &prompt(9, 0), pod).await == PROMPT_BLOCKS as u32;
        }
        if both {
            break;
        }
    }
    for seq in 1..=3u64 {
        to_a.send_seq(seq, &payloads[seq as usize]).await;
        to_b.send_seq(seq, &payloads[seq as usize]).await;
    }
    // Message 4 is lost on A's socket: A sees 5 first (a gap), B brings 4 through the log.
    to_a.send_seq(5, &payloads[5]).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    to_b.send_seq(4, &payloads[4]).await;
    to_b.send_seq(5, &payloads[5]).await;
    for n in 0..=5 {
        for r in &replicas {
            let started = Instant::now();
            while matched(r, &prompt(9, n), pod).await != PROMPT_BLOCKS as u32 {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "prompt {n} missing"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let page = replicas[0].metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_replays_total{result=\"from_log\"}"),
        1.0,
        "{page}"
    );
    assert_eq!(support::metric(&page, "kvindexer_messages_lost_total"), 0.0);
    let state = replicas[0].publishers().snapshot();
    assert_eq!(state[0].1.last_seq, Some(5));
    assert_eq!(requests.await.expect("router task"), 0, "vLLM was asked");
    for r in replicas {
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_and_admin_clears_take_effect_once_on_every_replica() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("restarts_and_clears") else {
        return;
    };
    const TOKEN: &str = "replicated-admin-token-0123456789";
    let mut replicas = Vec::new();
    for i in 0..2 {
        let mut c = replica_config(&redis.url(), "clears", &format!("r{i}"));
        c.server.enable_admin_rpcs = true;
        c.server.admin_token = TOKEN.into();
        replicas.push(daemon::start(c).await.expect("replica starts"));
    }
    let refs: Vec<&RunningDaemon> = replicas.iter().collect();
    let (p_pod, q_pod) = ("10.5.0.1:8000", "10.5.0.2:8000");
    let mut p = Publisher::connect(&replicas[0].zmq_endpoint.clone().expect("bind"), p_pod).await;
    let mut q = Publisher::connect(&replicas[1].zmq_endpoint.clone().expect("bind"), q_pod).await;
    p.warm_up(&prompt(1, 0), &refs).await;
    q.warm_up(&prompt(2, 0), &refs).await;
    for n in 1..=3 {
        p.send(&stored_at(&prompt(1, n), now_ts())).await;
        q.send(&stored_at(&prompt(2, n), now_ts())).await;
    }
    for r in &replicas {
        eventually_holds(r, prompt(1, 3), p_pod, true).await;
        eventually_holds(r, prompt(2, 3), q_pod, true).await;
    }
    converge(&refs, Duration::from_secs(5)).await;

    // P's vLLM restarts: sequence 0 again, a newer clock. Both replicas drop its old blocks.
    tokio::time::sleep(Duration::from_millis(20)).await;
    p.send_seq(0, &stored_at(&prompt(1, 10), now_ts())).await;
    for r in &replicas {
        let started = Instant::now();
        while !holds(r, prompt(1, 10), p_pod).await || holds(r, prompt(1, 3), p_pod).await {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "restart not applied"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // An admin clears Q on replica 1: both replicas drop it, replica 1 only once.
    let mut admin = client(&replicas[1]).await;
    let mut request = tonic::Request::new(kv_proto::kvindexer_v1::ClearPodRequest {
        model: MODEL.into(),
        pod: q_pod.into(),
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {TOKEN}").parse().expect("ascii"),
    );
    let removed = admin
        .clear_pod(request)
        .await
        .expect("ClearPod")
        .into_inner()
        .removed;
    assert_eq!(removed, (4 * PROMPT_BLOCKS) as u64);
    converge(&refs, Duration::from_secs(5)).await;
    for r in &replicas {
        eventually_holds(r, prompt(2, 3), q_pod, false).await;
        assert!(holds(r, prompt(1, 10), p_pod).await);
    }
    // Q's next message starts its stream afresh everywhere.
    q.send(&stored_at(&prompt(2, 20), now_ts())).await;
    for r in &replicas {
        let started = Instant::now();
        while !holds(r, prompt(2, 20), q_pod).await {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "Q's next message missing"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    converge(&refs, Duration::from_secs(5)).await;
    let own = support::metric(
        &replicas[1].metrics_text(),
        "kvindexer_replication_log_entries_total{outcome=\"own\"}",
    );
    assert_eq!(own, 1.0, "replica 1 skipped its own clear coming back");
    for r in replicas {
        r.shutdown().await;
    }
}

/// A TCP proxy in front of Redis that the test can cut (every connection dropped, new ones
/// refused) and restore: a replica cut off from Redis while the others go on.
struct Cuttable {
    addr: std::net::SocketAddr,
    open: Arc<std::sync::atomic::AtomicBool>,
    generation: Arc<std::sync::atomic::AtomicU64>,
}

impl Cuttable {
    async fn start(upstream: String) -> Self {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy binds");
        let addr = listener.local_addr().expect("proxy address");
        let open = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (o, g) = (open.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !o.load(Ordering::SeqCst) {
                    continue; // refused: dropped at once
                }
                let born = g.load(Ordering::SeqCst);
                let (o, g, upstream) = (o.clone(), g.clone(), upstream.clone());
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let cut = async {
                        while o.load(Ordering::SeqCst) && g.load(Ordering::SeqCst) == born {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut => {}
                    }
                });
            }
        });
        Self {
            addr,
            open,
            generation,
        }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_past_the_trimmed_log_reloads_from_the_snapshot() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("reload_past_the_trimmed_log") else {
        return;
    };
    let proxy = Cuttable::start(redis.url().trim_start_matches("redis://").to_owned()).await;
    let mut a_config = replica_config(&redis.url(), "reload", "a");
    a_config.replication.snapshot_interval = ConfigDuration::millis(200);
    let mut b_config = replica_config(&proxy.url(), "reload", "b");
    b_config.replication.snapshot_interval = ConfigDuration::millis(200);
    let a = daemon::start(a_config).await.expect("a starts");
    let b = daemon::start(b_config).await.expect("b starts");
    let refs = [&a, &b];
    let mut p = Publisher::connect(&a.zmq_endpoint.clone().expect("bind"), "10.6.0.1:8000").await;
    p.warm_up(&prompt(6, 0), &refs).await;
    proxy.cut();
    // While b is cut off, a goes on: thousands of messages, snapshots every 200 ms, each
    // trimming the log behind the one before.
    let processor = processor();
    for n in 1..=3_000 {
        let tokens = prompt(6, n);
        let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
        p.send(&payload(vec![stored(&hashes, None, tokens)])).await;
        if n % 100 == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(
        matched(&b, &prompt(6, 3_000), "10.6.0.1:8000").await == 0,
        "b was not cut off"
    );
    proxy.restore();
    let took = converge(&refs, Duration::from_secs(15)).await;
    let page = b.metrics_text();
    assert!(
        support::metric(&page, "kvindexer_replication_reloads_total") >= 1.0,
        "b caught up without reloading: the log was not trimmed past it\n{page}"
    );
    eprintln!("b reloaded and agreed {took:?} after the cut ended");
    a.shutdown().await;
    b.shutdown().await;
}

/// Each snapshot trims the log behind the one before, however many entries that is: an
/// approximate trim removed at most 10,000 a call, so past 10,000 entries per interval the log
/// (and Redis) grew without end under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_trims_the_whole_log_behind_the_one_before() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("trim_all") else {
        return;
    };
    let mut config = replica_config(&redis.url(), "trim", "a");
    config.replication.snapshot_interval = ConfigDuration::secs(3);
    let a = daemon::start(config).await.expect("a starts");
    let mut p = Publisher::connect(&a.zmq_endpoint.clone().expect("bind"), "10.7.0.1:8000").await;
    p.warm_up(&prompt(7, 0), &[&a]).await;
    // 25,000 messages (log entries) within about one snapshot interval.
    let one = payload(vec![stored(&[BlockHash::new(7)], None, vec![1; BLOCK])]);
    for n in 0..25_000 {
        p.send(&one).await;
        // A PUB drops what its peer's pipe cannot take: paced.
        if n % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let client = redis::Client::open(redis.url()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let deadline = Instant::now() + Duration::from_secs(60);
    let appended = |d: &RunningDaemon| {
        support::metric(&d.metrics_text(), "kvindexer_replication_appended_total")
    };
    // Until the appends stop growing; more than an approximate trim's 10,000 must be there.
    let mut seen = -1.0;
    while appended(&a) != seen {
        assert!(Instant::now() < deadline, "a never stopped appending");
        seen = appended(&a);
        tokio::time::sleep(Duration::from_millis(1_000)).await;
    }
    assert!(seen > 15_000.0, "only {seen} entries appended");
    let newest: Vec<(String, redis::Value)> = redis::cmd("XREVRANGE")
        .arg("trim:log")
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut conn)
        .await
        .expect("XREVRANGE");
    let newest = newest.first().map(|(id, _)| id.clone()).expect("entries");
    // Two snapshots at (or after) the last entry: the second trims behind the first.
    let last_len: u64 = loop {
        let meta: Option<String> = redis::cmd("GET")
            .arg("trim:snapshot")
            .query_async(&mut conn)
            .await
            .expect("GET");
        let previous = meta
            .and_then(|m| serde_json::from_str::<serde_json::Value>(&m).ok())
            .and_then(|m| m["previous_position"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let id = |s: &str| {
            let (ms, seq) = s.split_once('-').unwrap_or((s, "0"));
            (
                ms.parse::<u64>().unwrap_or(0),
                seq.parse::<u64>().unwrap_or(0),
            )
        };
        if id(&previous) >= id(&newest) {
            break redis::cmd("XLEN")
                .arg("trim:log")
                .query_async(&mut conn)
                .await
                .expect("XLEN");
        }
        assert!(
            Instant::now() < deadline,
            "no second snapshot after the load (newest entry {newest}, snapshot's previous position {previous})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // MINID keeps the entry at the position itself.
    assert!(
        last_len <= 1,
        "{last_len} entries left: every entry behind the previous snapshot is trimmed"
    );
    a.shutdown().await;
}

/// A replica cut off from the log must not judge the pods it hears only through the log
/// idle: it used to forget them after `publisherIdleTimeout` and, once back, tell every replica
/// to (a ClearPod through the log), clearing them on the replica that hears them live. In the
/// one-hour soak a 26 s Redis restart did that to half the pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_the_log_does_not_forget_pods_it_hears_through_it() {
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("stalled_log_is_not_silence") else {
        return;
    };
    let proxy = Cuttable::start(redis.url().trim_start_matches("redis://").to_owned()).await;
    let idle = ConfigDuration::secs(1);
    let mut a_config = replica_config(&redis.url(), "stall", "a");
    a_config.kv_events_config.publisher_idle_timeout = idle;
    let mut b_config = replica_config(&proxy.url(), "stall", "b");
    b_config.kv_events_config.publisher_idle_timeout = idle;
    let a = daemon::start(a_config).await.expect("a starts");
    let b = daemon::start(b_config).await.expect("b starts");
    let refs = [&a, &b];
    let pod = "10.8.0.1:8000";
    let mut p = Publisher::connect(&a.zmq_endpoint.clone().expect("bind"), pod).await;
    p.warm_up(&prompt(8, 0), &refs).await;
    let processor = processor();
    let publish = |n: usize| {
        let tokens = prompt(8, n);
        let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
        payload(vec![stored(&hashes, None, tokens)])
    };
    // The pod speaks to a every 100 ms throughout; b is cut off from Redis for 3 s (three
    // idle timeouts) in the middle.
    let mut n = 1;
    for phase in 0..3 {
        if phase == 1 {
            proxy.cut();
        }
        if phase == 2 {
            proxy.restore();
        }
        for _ in 0..30 {
            p.send(&publish(n)).await;
            n += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    converge(&refs, Duration::from_secs(15)).await;
    let (page_a, page_b) = (a.metrics_text(), b.metrics_text());
    assert_eq!(
        support::metric(&page_b, "kvindexer_pods_forgotten_total{reason=\"idle\"}"),
        0.0,
        "b judged the pod idle while the log was stalled\n{page_b}"
    );
    assert_eq!(
        support::metric(
            &page_a,
            "kvindexer_pods_forgotten_total{reason=\"cleared\"}"
        ),
        0.0,
        "a cleared a pod it hears live, told to by b"
    );
    assert!(
        matched(&a, &prompt(8, 0), pod).await > 0,
        "a still holds what the pod stored before the cut"
    );
    assert!(matched(&b, &prompt(8, 0), pod).await > 0);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_recorded_on_one_replica_scores_on_the_others() {
    use kv_proto::kvindexer_v1::{RecordRoutingRequest, TokenIds};
    let _serial = SERIAL.lock().await;
    let Some(redis) = RedisServer::start("speculate") else {
        return;
    };
    let mut replicas = Vec::new();
    for i in 0..2 {
        let mut c = replica_config(&redis.url(), "speculate", &format!("r{i}"));
        c.server.enable_record_routing = true;
        c.scoring.speculative_ttl = ConfigDuration::secs(30);
        replicas.push(daemon::start(c).await.expect("replica starts"));
    }
    let refs: Vec<&RunningDaemon> = replicas.iter().collect();
    let pod = "10.6.0.1:8000";
    let mut p = Publisher::connect(&replicas[0].zmq_endpoint.clone().expect("bind"), pod).await;
    p.warm_up(&prompt(1, 0), &refs).await;
    converge(&refs, Duration::from_secs(5)).await;
    // The gateway beside replica 1 routes a new prompt to the pod (which publishes to replica 0).
    let tokens = prompt(7, PROMPT_BLOCKS);
    assert_eq!(matched(&replicas[0], &tokens, pod).await, 0);
    let blocks = client(&replicas[1])
        .await
        .record_routing(RecordRoutingRequest {
            model: MODEL.into(),
            tokens: Some(TokenIds {
                ids: tokens.clone(),
            }),
            pod: pod.into(),
            ..Default::default()
        })
        .await
        .expect("RecordRouting")
        .into_inner()
        .blocks;
    assert_eq!(blocks, PROMPT_BLOCKS as u32);
    // Replica 0 (through the log) scores the pod as holding it, speculatively.
    for r in &replicas {
        eventually_holds(r, tokens.clone(), pod, true).await;
    }
    let model = replicas[0].indexer.model(MODEL).expect("model");
    assert_eq!(model.speculation_of(pod).map(|s| s.records), Some(1));
    // Replica 1 does not apply its own entry twice.
    let model = replicas[1].indexer.model(MODEL).expect("model");
    assert_eq!(model.speculation_stats().records, 1);
    drop(p);
    for r in replicas {
        r.shutdown().await;
    }
}
