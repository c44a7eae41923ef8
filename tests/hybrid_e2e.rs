//! Hybrid models end to end, over real sockets: the payloads vLLM 0.33's publisher sent while
//! its own KV-cache manager served a hybrid layout with evictions
//! (`crates/kv-core/tests/fixtures/hybrid`, made from vLLM's code; `defaults.json` at vLLM's
//! default scheduler budgets and prefix-cache retention), sent by a ZMQ PUB as vLLM frames
//! them (topic, sequence, payload) to the daemon with its defaults (but `blockSize` set to
//! vLLM's hash unit or left at 16, and `hashSeed` to vLLM's or another), then every probe
//! scored by `ScorePods` over gRPC: the matched tokens must be what vLLM's
//! `get_computed_blocks` reuses.

mod support;

use std::time::Duration;

use kv_core::{encode_batch, BlockHash, EngineHash, EventBatch};
use kv_indexer::daemon;
use support::pods::{connect, eventually, list, payload_message};
use support::HybridRun;
use zeromq::SocketSend;

const MODEL: &str = "hybrid/model";
const POD: &str = "10.0.0.7:8000";

/// Layouts whose every group rule is in the events: sliding window (group 0 and group 1),
/// Mamba with 16-token partial hits, MLA beside sliding-window MLA at another block size,
/// and lookahead hashing (MTP with two tokens; EAGLE beside a sliding window).
const RUNS: [&str; 6] = [
    "swa128+full-bs16/seed2",
    "full+swa512-bs16/seed2",
    "full+mamba-align-bs576-pmu16/seed1",
    "mla64+swamla16-w128/seed3",
    "full-mtp-lookahead2-bs16/seed3",
    "full+swa128-eagle-lookahead1-bs16/seed2",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_hybrid_publisher_through_the_daemon_scores_the_hit_vllm_takes() {
    let runs = support::hybrid_runs();
    check(&runs, &RUNS, &Daemon::keyed("12345"), "aligned").await;
}

/// The same engines, the daemon keyed with another seed than vLLM's `PYTHONHASHSEED`: every
/// engine is translated from its events' tokens, group by group. (Mamba partial hits inside
/// engine blocks cannot be translated: `crates/kv-core/tests/hybrid_vllm.rs` says why.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_engine_hashing_with_another_seed_is_translated_end_to_end() {
    let runs: Vec<&str> = RUNS.into_iter().filter(|r| !r.contains("pmu")).collect();
    assert_eq!(runs.len(), 5);
    check(
        &support::hybrid_runs(),
        &runs,
        &Daemon::keyed("777"),
        "translated",
    )
    .await;
}

/// Engines at vLLM's defaults (`defaults.json`: 2,048 and 8,192-token scheduler budgets,
/// prefix-cache retention 0), whose events carry fewer hashes than blocks: a sliding window
/// in group 0 (its hashes placed by the full-attention run published after it), Mamba in
/// both group orders, sliding-window MLA of 16-token blocks beside MLA of 64.
const DEFAULT_RUNS: [&str; 4] = [
    "swa128+full-bs16@2048/seed1",
    "full+mamba-align-bs576@2048/seed1",
    "mamba+full-align-bs576@8192/seed2",
    "swamla16+mla64-w128@8192/seed2",
];

/// A daemon keyed with another seed than the engines': translated at vLLM's defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_engine_at_vllms_defaults_is_translated_end_to_end() {
    let runs = support::hybrid_default_runs();
    check(&runs, &DEFAULT_RUNS, &Daemon::keyed("777"), "translated").await;
}

/// The daemon with vLLM's seed and its own default `blockSize` (16) against a Mamba engine of
/// 576-token blocks (Qwen3-Next-like): translated by block size, and `ListPods` says the
/// engine would be aligned at 576.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mamba_engine_of_wider_blocks_is_translated_and_said_alignable() {
    let runs = support::hybrid_default_runs();
    let names = [
        "full+mamba-align-bs576@8192/seed2",
        "mamba+full-align-bs576@2048/seed1",
    ];
    let daemon = Daemon {
        seed: "12345",
        block_size: Some(16),
        alignable: 576,
    };
    check(&runs, &names, &daemon, "translated").await;
}

/// How the daemon is keyed, and what `ListPods` must then say of the engine.
struct Daemon {
    /// `hashSeed`.
    seed: &'static str,
    /// `blockSize`; `None`: vLLM's hash unit (the run's).
    block_size: Option<usize>,
    /// `ListPods`' `alignable_block_size`.
    alignable: u32,
}

impl Daemon {
    /// Keyed with `seed` at the run's hash unit.
    fn keyed(seed: &'static str) -> Self {
        Self {
            seed,
            block_size: None,
            alignable: 0,
        }
    }
}

/// Publishes each of `names`' payloads (runs of `runs`) to a daemon keyed as `keyed` says,
/// then checks every probe's `ScorePods` hit, the engine's key mode being `mode`, no hash
/// left unplaced.
async fn check(runs: &[HybridRun], names: &[&str], keyed: &Daemon, mode: &str) {
    for &name in names {
        let run = runs
            .iter()
            .find(|r| r.name == name)
            .expect("run in fixtures");
        let unit = keyed.block_size.unwrap_or(run.unit);
        let mut c = support::loopback_config();
        c.indexer_config.token_processor_config.hash_seed = Some(keyed.seed.into());
        c.indexer_config.token_processor_config.block_size = unit;
        let d = daemon::start(c).await.expect("daemon starts");
        let mut publisher = connect(&d).await;
        // Past ZMQ's slow-joiner window: a marker of another pod until it is held.
        let marker = BlockHash::new(0x5EED);
        let held = |pod: &str, key: BlockHash| {
            d.indexer.model(MODEL).is_some_and(|m| {
                let engines = m.index().directory().engines_of(pod).to_vec();
                m.index()
                    .lookup(key)
                    .iter()
                    .any(|(e, _)| engines.contains(e))
            })
        };
        for seq in 0..250u64 {
            // One block of the daemon's size (a narrower one is refused).
            let published = [EngineHash::aligned(marker)];
            let warmup = EventBatch::stored_on_gpu(1.7e9, 0, &published, unit as u32);
            let _ = publisher
                .send(payload_message(
                    MODEL,
                    "warmup:1",
                    seq,
                    &encode_batch(&warmup),
                ))
                .await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if held("warmup:1", marker) {
                break;
            }
        }
        assert!(
            held("warmup:1", marker),
            "{name}: the daemon never subscribed"
        );
        for (seq, payload) in run.payloads.iter().enumerate() {
            publisher
                .send(payload_message(MODEL, POD, seq as u64, payload))
                .await
                .expect("sends");
        }
        // Every message applied: the pod's last applied sequence is the last one sent.
        let last = run.payloads.len() as i64 - 1;
        eventually(Duration::from_secs(30), "every message applied", || async {
            list(&d)
                .await
                .iter()
                .any(|p| p.pod == POD && p.last_sequence == last)
        })
        .await;
        let listed: Vec<(String, u64, u32)> = list(&d)
            .await
            .into_iter()
            .filter(|p| p.pod == POD)
            .map(|p| (p.key_mode, p.unplaced_hashes, p.alignable_block_size))
            .collect();
        assert_eq!(listed, [(mode.to_owned(), 0, keyed.alignable)], "{name}");
        let mut client = support::client(&d).await;
        let mut hits = 0;
        for (i, probe) in run.probes.iter().enumerate() {
            let matched = support::matched_blocks(&mut client, MODEL, &probe.tokens, POD).await;
            let got = u64::from(matched) * unit as u64;
            assert_eq!(
                got,
                probe.hit,
                "{name} probe {i} ({} tokens): predicted {got}, vLLM reuses {}, full attention alone {}",
                probe.tokens.len(),
                probe.hit,
                probe.full_only
            );
            hits += u32::from(probe.hit > 0);
        }
        assert!(hits >= 10, "{name}: {hits} probes hit");
        d.shutdown().await;
    }
}
