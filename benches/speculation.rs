//! `cargo bench --bench speculation`: what speculative entries (`RecordRouting`) cost in the
//! core, beside the baseline of the same scoring with none, in the same run (three rounds,
//! medians).
//!
//! Scenario (seed 2026): model `bench/model`, 64 pods (`10.0.0.<p>:8000`), 256 groups; a
//! prompt is its group's 48-block system prompt and a 16-block question of its own (64 blocks:
//! 1,024 tokens at block size 16); 8,192 prompts, prompt `i` of group `i % 256`. Real events:
//! pod `p` holds the system prompts of groups `4p .. 4p + 4`. Then:
//! - *baseline*: every prompt scored against all 64 pods, no speculative entries;
//! - *record*: prompt `i` recorded as routed to pod `i % 64` (`Indexer::record_routing`);
//! - *scored with entries*: every prompt scored again, the 8,192 records live;
//! - *expire*: every record expired (`Indexer::expire_speculation`);
//! - heap: what the records (with their own copy of the prompt's hashes, 8 B per block) and
//!   their entries hold (counting allocator), per distinct speculative (pod, block) entry,
//!   beside the indexer's own estimate (`SpeculationStats::memory_bytes`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{
    BlockHash, EngineHash, EventBatch, Indexer, IndexerSettings, ScoreResult, SplitMix64,
};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

const MODEL: &str = "bench/model";
const PODS: usize = 64;
const GROUPS: usize = 256;
const SYSTEM_BLOCKS: usize = 48;
const QUESTION_BLOCKS: usize = 16;
const PROMPTS: usize = 8_192;

/// The prompts' block hashes: a group's prompts share their first `SYSTEM_BLOCKS` hashes and
/// differ from there on (the chain property of vLLM's hashes).
fn prompts() -> (Vec<Vec<BlockHash>>, Vec<Arc<[BlockHash]>>) {
    let mut rng = SplitMix64::new(2026);
    let systems: Vec<Vec<BlockHash>> = (0..GROUPS)
        .map(|_| {
            (0..SYSTEM_BLOCKS)
                .map(|_| BlockHash::from(rng.next_u64()))
                .collect()
        })
        .collect();
    let prompts = (0..PROMPTS)
        .map(|i| {
            let mut p = systems[i % GROUPS].clone();
            p.extend((0..QUESTION_BLOCKS).map(|_| BlockHash::from(rng.next_u64())));
            p.into()
        })
        .collect();
    (systems, prompts)
}

fn pod(p: usize) -> String {
    format!("10.0.0.{p}:8000")
}

/// The pods are aligned engines: they publish the prompts' keys as their hashes.
fn stored(hashes: &[BlockHash]) -> EventBatch {
    let published: Vec<EngineHash> = hashes.iter().map(|&k| EngineHash::aligned(k)).collect();
    EventBatch::stored_on_gpu(1.7e9, 0, &published, 16)
}

/// Scores every prompt against every pod; returns seconds and the best score seen (kept so
/// the work is not optimised away, and checked).
fn score_all(ix: &Indexer, prompts: &[Arc<[BlockHash]>], pods: &[String]) -> (f64, f64) {
    let mut out = ScoreResult::default();
    let mut best = 0.0f64;
    let started = Instant::now();
    for p in prompts {
        ix.score_hashes_into(MODEL, p, pods, &mut out)
            .expect("the model is known");
        best = best.max(out.scores.iter().map(|s| s.score).fold(0.0, f64::max));
    }
    (started.elapsed().as_secs_f64(), black_box(best))
}

fn main() {
    let (systems, prompts) = prompts();
    let pods: Vec<String> = (0..PODS).map(pod).collect();
    let mut rows: [Vec<f64>; 6] = Default::default();
    for _ in 0..3 {
        let ix = Indexer::new(IndexerSettings::default()).expect("default settings");
        for (p, name) in pods.iter().enumerate() {
            for system in &systems[4 * p..4 * p + 4] {
                ix.apply_batch(MODEL, name, &stored(system))
                    .expect("applies");
            }
        }
        let (base, best_before) = score_all(&ix, &prompts, &pods);
        assert_eq!(best_before, SYSTEM_BLOCKS as f64, "real entries only");

        let now = Instant::now();
        let before = live_heap_bytes();
        // Each record owns its prompt's hashes, as in the daemon once the prompt key expired.
        let owned: Vec<Arc<[BlockHash]>> = prompts.iter().map(|p| Arc::from(&p[..])).collect();
        let started = Instant::now();
        let mut speculated = 0usize;
        for (i, p) in owned.into_iter().enumerate() {
            speculated += ix
                .record_routing(MODEL, &pods[i % PODS], 0, p, now)
                .expect("records")
                .blocks();
        }
        let record = started.elapsed().as_secs_f64();
        let held = live_heap_bytes().saturating_sub(before) as f64;
        let stats = ix.model(MODEL).expect("model").speculation_stats();
        assert_eq!(stats.records as usize, PROMPTS, "every routing is live");
        assert!(speculated > 0);

        let (with, best_after) = score_all(&ix, &prompts, &pods);
        assert_eq!(
            best_after,
            (SYSTEM_BLOCKS + QUESTION_BLOCKS) as f64,
            "a recorded prompt scores whole on its pod"
        );

        let started = Instant::now();
        let expired = ix.expire_speculation(now + Duration::from_secs(3_600));
        let expire = started.elapsed().as_secs_f64();
        assert_eq!(expired as usize, PROMPTS);

        rows[0].push(base);
        rows[1].push(record);
        rows[2].push(with);
        rows[3].push(expire);
        rows[4].push(held / stats.entries as f64);
        rows[5].push(stats.memory_bytes as f64 / stats.entries as f64);
        println!(
            "  round: {} entries, {} records, heap {:.1} MiB",
            stats.entries,
            stats.records,
            held / (1 << 20) as f64
        );
    }
    let [base, record, with, expire, heap, estimate] = rows.map(|r| median(&r));
    let per = |s: f64| s / PROMPTS as f64 * 1e6;
    println!(
        "speculation, {PROMPTS} prompts of {} blocks, {PODS} pods (medians of 3):",
        SYSTEM_BLOCKS + QUESTION_BLOCKS
    );
    println!(
        "  score, no entries (baseline)   {:>8.2} us/prompt",
        per(base)
    );
    println!(
        "  score, {PROMPTS} records live    {:>8.2} us/prompt  ({:.2}x the baseline)",
        per(with),
        with / base
    );
    println!(
        "  record_routing                 {:>8.2} us/call    ({:.2}x a baseline score)",
        per(record),
        record / base
    );
    println!(
        "  expire every record            {:>8.2} us/record",
        per(expire)
    );
    println!(
        "  heap per speculative entry: {heap:.1} B measured, {estimate:.1} B by the indexer's estimate"
    );
}
