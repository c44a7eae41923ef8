//! Translated engines (hashes that are not the index's keys) over real sockets, with vLLM
//! 0.33.0's own events (`--prefix-caching-hash-algo xxhash`, `PYTHONHASHSEED=999`, kv-core's
//! `tests/fixtures/engines`):
//!
//! - a replica killed with SIGKILL and started again (snapshot load, then the log) scores a
//!   translated pod as the replica that heard it does, and a later removal by engine hash
//!   reaches both. That the restart loaded a snapshot is asserted: it counts a snapshot
//!   loaded and applies no log entry before it scores the pod, where the same replica's first
//!   start (before the stores) got them from the log (the check's negative control);
//! - a replica started after the events (the log alone, no snapshot yet) does the same.
//!
//! Without `redis-server` on PATH these tests say they were skipped (and fail under CI=true).

mod support;

use std::time::{Duration, Instant};

use support::redis::RedisServer;
use support::replica::{self, Process};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "translated/model";
/// The index's settings the fixture's keys were computed with.
const INDEX: (&str, usize) = ("", 16);

fn message(pod: &str, seq: u64, payload: &[u8]) -> ZmqMessage {
    support::pods::payload_message(MODEL, pod, seq, payload)
}

/// The xxhash engine's scenario: a 12-block run, a 13-block continuation, one removal.
fn xxhash_scenario() -> support::EngineScenario {
    support::engine_scenarios()
        .into_iter()
        .find(|s| s.name == "vllm-xxhash-seed999-bs16")
        .expect("the xxhash scenario is in the fixture")
}

/// Waits (up to `within`) until `replica` scores `want` blocks of `tokens` for `pod`.
async fn scores(replica: &Process, tokens: &[u32], pod: &str, want: u32, within: Duration) {
    let started = Instant::now();
    loop {
        let got = replica.matched(MODEL, tokens, pod).await;
        if got == want {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{} scores {pod} {got} blocks, not {want}, after {within:?}",
            replica.grpc
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether `replica` came by what it holds from a snapshot: it counted a snapshot loaded and
/// applied no log entry (another replica's message) to get there. `Err` says how it did.
async fn from_a_snapshot(replica: &Process) -> Result<(), String> {
    let page = replica.metrics_text().await;
    let loaded = support::metric(
        &page,
        "kvindexer_replication_snapshots_total{operation=\"load\",result=\"ok\"}",
    );
    let applied = support::metric(
        &page,
        "kvindexer_replication_log_entries_total{outcome=\"applied\"}",
    );
    match (loaded, applied) {
        (l, 0.0) if l >= 1.0 => Ok(()),
        _ => Err(format!(
            "{} loaded {loaded} snapshots and applied {applied} log entries",
            replica.grpc
        )),
    }
}

/// (key mode, blocks, translated blocks) of `pod` on `replica`.
async fn listed(replica: &Process, pod: &str) -> Option<(String, u64, u64)> {
    replica
        .pods(MODEL)
        .await
        .into_iter()
        .find(|p| p.pod == pod)
        .map(|p| (p.key_mode, p.blocks, p.translated_blocks))
}

/// Replica A, which hears the translated pod (its two stores sent and scored), the Redis it
/// shares, and replica B's configuration, written beside A's.
struct Pair {
    _redis: RedisServer,
    dir: std::path::PathBuf,
    a: Process,
    config_b: std::path::PathBuf,
    ports_b: replica::Ports,
    publisher: PubSocket,
    s: support::EngineScenario,
    pod: &'static str,
}

impl Pair {
    /// `None` (said loudly) without `redis-server`.
    async fn start(test: &str, pod: &'static str) -> Option<Self> {
        let redis = RedisServer::start(test)?;
        let dir = support::temp_dir(test);
        let (ports_a, ports_b) = (replica::ports(), replica::ports());
        let config =
            |name, ports| replica::write_config(&dir, name, &redis.url(), test, ports, INDEX, "");
        let (config_a, config_b) = (config("a", ports_a), config("b", ports_b));
        let a = Process::spawn(&config_a, ports_a);
        a.wait_ready(Duration::from_secs(30)).await;
        let mut publisher = PubSocket::new();
        publisher.connect(&a.zmq).await.expect("PUB connects");
        Some(Self {
            _redis: redis,
            dir,
            a,
            config_b,
            ports_b,
            publisher,
            s: xxhash_scenario(),
            pod,
        })
    }

    /// Replica B, started now.
    async fn start_b(&self) -> Process {
        self.start_b_with_env(&[]).await
    }

    /// Replica B, started now with `env` set.
    async fn start_b_with_env(&self, env: &[(&str, &str)]) -> Process {
        let b = Process::spawn_with_env(&self.config_b, self.ports_b, env);
        b.wait_ready(Duration::from_secs(30)).await;
        b
    }

    /// Sends message 0 until A applies it (ZeroMQ's slow-joiner window), then the others up
    /// to `upto` (exclusive).
    async fn publish(&mut self, upto: usize) {
        let (s, pod) = (&self.s, self.pod);
        let mut applied = false;
        for _ in 0..200 {
            let first = message(pod, 0, &s.messages[0]);
            self.publisher.send(first).await.expect("send");
            tokio::time::sleep(Duration::from_millis(25)).await;
            if self.a.matched(MODEL, &s.tokens, pod).await == s.matched_after[0] {
                applied = true;
                break;
            }
        }
        assert!(applied, "message 0 never applied");
        for seq in 1..upto {
            let next = message(pod, seq as u64, &s.messages[seq]);
            self.publisher.send(next).await.expect("send");
        }
    }

    /// Starts B, sends the two stores (heard by A, reaching B through the log) and waits
    /// until both score them, then for a snapshot covering them (written every second).
    /// Returns B and the blocks held.
    async fn stored_on_both_and_snapshotted(&mut self) -> (Process, u32) {
        let b = self.start_b().await;
        self.publish(2).await;
        let held = self.s.matched_after[1];
        for r in [&self.a, &b] {
            scores(r, &self.s.tokens, self.pod, held, Duration::from_secs(20)).await;
        }
        // A snapshot written since, holding them (each replica writes in turn).
        let (a, b_ref) = (&self.a, &b);
        support::pods::eventually(
            Duration::from_secs(30),
            "a snapshot holding the stores",
            || async move {
                for r in [a, b_ref] {
                    let page = r.metrics_text().await;
                    let wrote = support::metric(
                        &page,
                        "kvindexer_replication_snapshots_total{operation=\"write\",result=\"ok\"}",
                    );
                    let held_now =
                        support::metric(&page, "kvindexer_replication_snapshot_memberships");
                    if wrote > 0.0 && held_now >= f64::from(held) {
                        return true;
                    }
                }
                false
            },
        )
        .await;
        (b, held)
    }

    /// Sends message `seq` (no retry: past the first, ZeroMQ delivers in order).
    async fn send(&mut self, seq: usize) {
        let next = message(self.pod, seq as u64, &self.s.messages[seq]);
        self.publisher.send(next).await.expect("send");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_replica_scores_translated_pods_as_the_replica_that_heard_them() {
    let Some(mut t) = Pair::start("translated-sigkill", "10.7.0.1:8000").await else {
        return;
    };
    // The two stores: 25 blocks, heard by A only; B follows through the log. Then a
    // snapshot, SIGKILL and a restart.
    let (mut b, held) = t.stored_on_both_and_snapshotted().await;
    let pod = t.pod;
    let before = listed(&b, pod).await.expect("listed on B");
    assert_eq!(before.0, "translated", "{before:?}");
    // The negative control of the check below: started before the stores, B got them from
    // the log, as a replica rebuilt from the log alone does, and the check says so.
    let rebuilt = from_a_snapshot(&b).await;
    assert!(
        rebuilt.is_err(),
        "a replica fed by the log passes for one restored from a snapshot"
    );
    b.kill();
    b = t.start_b().await;
    scores(&b, &t.s.tokens, pod, held, Duration::from_secs(10)).await;
    // The restart loaded a snapshot that held the stores: no log entry was applied to get
    // them back.
    if let Err(how) = from_a_snapshot(&b).await {
        panic!("the restarted replica did not restore the pod from a snapshot: {how}");
    }
    assert_eq!(
        listed(&b, pod).await,
        Some(before.clone()),
        "the restarted replica lists the pod as before"
    );
    // A removal by engine hash after the restart reaches both replicas.
    t.send(2).await;
    let after = t.s.matched_after[2];
    assert!(after < held, "the fixture's last message removes a block");
    for r in [&t.a, &b] {
        scores(r, &t.s.tokens, pod, after, Duration::from_secs(20)).await;
    }
    assert_eq!(listed(&t.a, pod).await, listed(&b, pod).await);
}

/// A replica restarted with other hash settings (here `PYTHONHASHSEED` left in its
/// environment, which overrides `hashSeed`) does not load the snapshot's keys of that model as
/// its own: no prompt hashes to them there, and loading them made every pod score 0 while
/// `ListPods` showed their blocks. It counts them and starts that model empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_with_another_seed_does_not_load_keys_it_cannot_hash_to() {
    let Some(mut t) = Pair::start("translated-reseeded", "10.7.0.5:8000").await else {
        return;
    };
    let (mut b, held) = t.stored_on_both_and_snapshotted().await;
    let pod = t.pod;
    b.kill();
    b = t.start_b_with_env(&[("PYTHONHASHSEED", "999")]).await;
    let page = b.metrics_text().await;
    let refused = support::metric(
        &page,
        "kvindexer_blocks_dropped_total{reason=\"snapshot_key_space\"}",
    );
    assert!(
        refused >= f64::from(held),
        "the snapshot's keys of the model are counted, not loaded: {refused}"
    );
    let listed_b = listed(&b, pod).await;
    assert!(
        listed_b.as_ref().is_none_or(|(_, blocks, _)| *blocks == 0),
        "no foreign keys held for the pod: {listed_b:?}"
    );
    // A keeps its own.
    scores(&t.a, &t.s.tokens, pod, held, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_after_the_events_scores_translated_pods_from_the_log() {
    let Some(mut t) = Pair::start("translated-late", "10.7.0.2:8000").await else {
        return;
    };
    t.publish(2).await;
    let (held, pod) = (t.s.matched_after[1], t.pod);
    scores(&t.a, &t.s.tokens, pod, held, Duration::from_secs(20)).await;
    // B starts after the stores: from a snapshot, or the log when none is written yet.
    let b = t.start_b().await;
    scores(&b, &t.s.tokens, pod, held, Duration::from_secs(10)).await;
    t.send(2).await;
    for r in [&t.a, &b] {
        scores(
            r,
            &t.s.tokens,
            pod,
            t.s.matched_after[2],
            Duration::from_secs(20),
        )
        .await;
    }
    assert_eq!(listed(&t.a, pod).await, listed(&b, pod).await);
}

/// In-process daemon helpers for the single-replica cases below.
mod single {
    use std::time::Duration;

    use kv_indexer::daemon::{self, RunningDaemon};
    use zeromq::{PubSocket, SocketSend};

    use super::{message, support, MODEL};

    /// A daemon with the fixtures' index settings (seed 12345, blocks of 16) and `size`.
    pub async fn start(size: usize) -> RunningDaemon {
        let mut config = support::loopback_config();
        config.indexer_config.token_processor_config.hash_seed = Some("12345".into());
        config
            .indexer_config
            .kv_block_index_config
            .in_memory_config
            .size = size;
        daemon::start(config).await.expect("daemon starts")
    }

    /// Sends `payload` as message `seq` of `pod` until `applied()` holds (the first message,
    /// past ZeroMQ's slow-joiner window).
    pub async fn send_first(
        p: &mut PubSocket,
        pod: &str,
        payload: &[u8],
        mut applied: impl FnMut() -> bool,
    ) {
        for _ in 0..200 {
            p.send(message(pod, 0, payload)).await.expect("send");
            tokio::time::sleep(Duration::from_millis(25)).await;
            if applied() {
                return;
            }
        }
        panic!("{pod}'s first message never applied");
    }

    /// Blocks of each prompt `pod` holds, by ScorePods over gRPC (each scored as a prompt
    /// that continues past them).
    pub async fn held(d: &RunningDaemon, prompts: &[Vec<u32>], pod: &str) -> Vec<u32> {
        let mut grpc = support::client(d).await;
        let mut out = Vec::new();
        for tokens in prompts {
            let prompt = support::past(tokens);
            out.push(support::matched_blocks(&mut grpc, MODEL, &prompt, pod).await);
        }
        out
    }

    /// The daemon's counter `name{labels}` (0 when absent).
    pub fn metric(d: &RunningDaemon, name_and_labels: &str) -> f64 {
        support::metric(&d.metrics_text(), name_and_labels)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_key_budget_the_newest_blocks_win_and_every_removal_reaches_its_keys() {
    let s = support::budget_scenario();
    let prompts: Vec<Vec<u32>> = s.prompts.iter().map(|(t, _)| t.clone()).collect();
    let stores = s.kinds.iter().filter(|k| *k == "stored").count();
    // Room for one prompt of 60 blocks: its keys and the map entries that remove them.
    let d = single::start(120).await;
    let pod = "10.7.0.3:8000";
    let mut p = support::pods::connect(&d).await;
    let first = s.messages[0].clone();
    let model_known = || {
        d.indexer
            .model(MODEL)
            .is_some_and(|m| !m.key_modes().is_empty())
    };
    single::send_first(&mut p, pod, &first, model_known).await;
    for (seq, payload) in s.messages.iter().enumerate().take(stores).skip(1) {
        p.send(message(pod, seq as u64, payload))
            .await
            .expect("send");
    }
    support::pods::eventually(
        Duration::from_secs(20),
        "the newest prompt held",
        || async { single::held(&d, &prompts, pod).await == [0, 0, 0, 60] },
    )
    .await;
    for (seq, payload) in s.messages.iter().enumerate().skip(stores) {
        p.send(message(pod, seq as u64, payload))
            .await
            .expect("send");
    }
    let keys = |d: &kv_indexer::daemon::RunningDaemon| {
        d.indexer.model(MODEL).map_or(0, |m| m.index().stats().keys)
    };
    support::pods::eventually(Duration::from_secs(20), "every key removed", || async {
        keys(&d) == 0 && single::held(&d, &prompts, pod).await == [0, 0, 0, 0]
    })
    .await;
    // The three older prompts' entries gave their place (counted), so their removals found
    // nothing (counted).
    assert_eq!(
        single::metric(
            &d,
            "kvindexer_blocks_dropped_total{reason=\"unknown_removal\"}"
        ),
        180.0
    );
    assert_eq!(
        single::metric(
            &d,
            &format!("kvindexer_translated_blocks_evicted_total{{model=\"{MODEL}\"}}")
        ),
        180.0
    );
    d.shutdown().await;
}

/// A payload: one `BlockStored` run of `hashes` (blocks of `block_size`, `tokens`), GPU.
fn run(hashes: &[u64], block_size: u32, tokens: Vec<u32>, rank: Option<i64>) -> Vec<u8> {
    use kv_core::{encode_batch, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
    encode_batch(&EventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::new(h)).collect(),
            token_ids: tokens,
            block_size,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: rank,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_that_cannot_be_indexed_are_counted_by_reason_and_the_daemon_lives() {
    let d = single::start(100_000).await;
    let mut p = support::pods::connect(&d).await;
    let tokens: Vec<u32> = (0..96).map(|i| 7 + i * 13).collect();
    // A translated engine (blocks of 32, opaque hashes): decided on its first root run.
    let pod = "10.7.0.4:8000";
    let translated = || {
        d.indexer
            .model(MODEL)
            .is_some_and(|m| m.key_modes().values().any(|(_, n)| *n > 0))
    };
    let first = run(&[901, 902], 32, tokens[..64].to_vec(), Some(0));
    single::send_first(&mut p, pod, &first, translated).await;
    // A partial page (8 tokens: not a multiple of blockSize), and a run with one hash more
    // than its tokens cover.
    let partial = run(&[903], 8, tokens[64..72].to_vec(), Some(0));
    let uncovered = run(&[911, 912], 32, tokens[..32].to_vec(), Some(0));
    // One hash for two blocks, which nothing else names: which block it is is not known.
    let unplaced = run(&[941], 32, tokens[..64].to_vec(), Some(0));
    // Ranks no engine has: negative, and beyond any deployment.
    let negative = run(&[921], 16, tokens[..16].to_vec(), Some(-1));
    let huge = run(&[922], 16, tokens[..16].to_vec(), Some(1 << 40));
    let sent = [partial, uncovered, unplaced, negative, huge];
    for (seq, payload) in sent.iter().enumerate() {
        p.send(message(pod, seq as u64 + 1, payload))
            .await
            .expect("send");
    }
    let dropped = |reason: &str| {
        single::metric(
            &d,
            &format!("kvindexer_blocks_dropped_total{{reason=\"{reason}\"}}"),
        )
    };
    support::pods::eventually(Duration::from_secs(20), "every drop counted", || async {
        dropped("partial_block") == 1.0
            && dropped("uncovered_hash") == 1.0
            && dropped("unplaced_hash") == 1.0
            && dropped("rank_out_of_range") == 2.0
    })
    .await;
    let skipped = "kvindexer_events_skipped_total{reason=\"unplaced_hash\"}";
    assert_eq!(single::metric(&d, skipped), 1.0, "the run, counted");
    let unplaced: Vec<u64> = support::pods::list(&d)
        .await
        .iter()
        .filter(|p| p.pod == pod)
        .map(|p| p.unplaced_hashes)
        .collect();
    assert_eq!(unplaced, [1], "ListPods says so");
    assert_eq!(
        single::metric(&d, &format!("kvindexer_rank_errors_total{{pod=\"{pod}\"}}")),
        2.0,
        "counted against the publisher"
    );
    // Nothing of the bad ranks was read as rank 0, and the daemon still applies.
    let listed: Vec<u32> = support::pods::list(&d)
        .await
        .iter()
        .filter(|p| p.pod == pod)
        .map(|p| p.data_parallel_rank)
        .collect();
    assert_eq!(listed, [0], "one engine: rank 0");
    let next = run(&[931, 932], 32, tokens[..64].to_vec(), Some(1));
    p.send(message(pod, 0, &next)).await.expect("send");
    support::pods::eventually(Duration::from_secs(20), "rank 1 applied", || async {
        support::pods::list(&d)
            .await
            .iter()
            .any(|p| p.pod == pod && p.data_parallel_rank == 1)
    })
    .await;
    d.shutdown().await;
}
