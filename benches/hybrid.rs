//! `cargo bench --bench hybrid`: what scoring hybrid models by vLLM's hit rule costs, beside
//! full-attention-only engines in the same run (three alternated rounds, medians).
//!
//! Scenario (seed 2026): model `bench/model`, 64 pods (`10.0.0.<p>:8000`), blocks of 16; 256
//! system prompts of 100 blocks; prompt `i` is system prompt `i % 256` and 400 blocks of its
//! own (500 blocks, 8,000 tokens); pod `p` holds prompts `32p .. 32p + 32` (2,048 prompts,
//! 1,024,000 blocks per group). Two indexers fed the same prompts through real events
//! (aligned engines, their hashes the keys):
//! - *full attention only*: one group, as vLLM publishes a full-attention model;
//! - *hybrid*: full attention (group 0) and a sliding window of 128 tokens (group 1), each
//!   group holding every block of its prompts (vLLM caches a window group's blocks until they
//!   are evicted, so this is the most memberships a two-group model holds: twice as many).
//!
//! Measured: heap per membership (counting allocator) and in all; every prompt scored against
//! all 64 pods by its hashes (the index's part of ScorePods: its walk, and for the hybrid
//! engines the rule over their groups) and by its tokens (ScorePods' core: hashing through the
//! digest memo, 16 MiB by default, then the index). The answers are checked: the owner of each
//! prompt matches all of it, its system prompt's other holders match the system prompt, in
//! both indexers and both forms.

use std::hint::black_box;
use std::time::Instant;

use kv_core::{
    BlockHash, BlockStored, EngineHash, EventBatch, Indexer, IndexerSettings, KvEvent, Medium,
    ScoreResult, SplitMix64,
};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

const MODEL: &str = "bench/model";
const PODS: usize = 64;
const SYSTEMS: usize = 256;
const SYSTEM_BLOCKS: usize = 100;
const OWN_BLOCKS: usize = 400;
const PER_POD: usize = 32;
const ROUNDS: usize = 3;

/// Each prompt's tokens (its system prompt's, then its own) and block hashes, as the
/// indexer's default settings hash them.
fn prompts() -> (Vec<Vec<u32>>, Vec<Vec<BlockHash>>) {
    let mut rng = SplitMix64::new(2026);
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n * 16).map(|_| rng.below(150_000) as u32).collect() };
    let systems: Vec<Vec<u32>> = (0..SYSTEMS).map(|_| tokens(SYSTEM_BLOCKS)).collect();
    let prompts: Vec<Vec<u32>> = (0..PODS * PER_POD)
        .map(|i| {
            let mut p = systems[i % SYSTEMS].clone();
            p.extend(tokens(OWN_BLOCKS));
            p
        })
        .collect();
    let processor = kv_core::TokenProcessor::new(&Default::default()).expect("defaults");
    let hashes = prompts
        .iter()
        .map(|p| processor.block_hashes(p, &Default::default()))
        .collect();
    (prompts, hashes)
}

fn pod(p: usize) -> String {
    format!("10.0.0.{p}:8000")
}

/// One group's run of `hashes`, as vLLM's `take_events` annotates it (group 0: full
/// attention; group 1: a sliding window of 128 tokens).
fn stored(hashes: &[BlockHash], group: i64) -> KvEvent {
    let (kind, window) = match group {
        0 => ("full_attention", None),
        _ => ("sliding_window", Some(128)),
    };
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
        block_size: 16,
        medium: Some(Medium::Gpu),
        group_idx: Some(group),
        kv_cache_spec_kind: Some(kind.into()),
        kv_cache_spec_sliding_window: window,
        ..Default::default()
    }))
}

/// An indexer whose pods hold their prompts in `groups` groups; returns it and the heap it
/// holds.
fn build(prompts: &[Vec<BlockHash>], groups: i64) -> (Indexer, f64) {
    let before = live_heap_bytes();
    let ix = Indexer::new(IndexerSettings::default()).expect("default settings");
    for (i, p) in prompts.iter().enumerate() {
        let batch = EventBatch {
            ts: 1.7e9,
            events: (0..groups).map(|g| stored(p, g)).collect(),
            data_parallel_rank: Some(0),
        };
        ix.apply_batch(MODEL, &pod(i / PER_POD), &batch)
            .expect("applies");
    }
    let held = live_heap_bytes().saturating_sub(before) as f64;
    (ix, held)
}

/// How a prompt is scored: by its hashes (the index's part) or its tokens (ScorePods' core:
/// hashing through the digest memo, then the index).
#[derive(Clone, Copy)]
enum Form {
    Hashes,
    Tokens,
}

/// Scores every prompt against every pod; returns seconds, checking the answers.
fn score_all(
    ix: &Indexer,
    form: Form,
    (tokens, hashes): (&[Vec<u32>], &[Vec<BlockHash>]),
    pods: &[String],
) -> f64 {
    let mut out = ScoreResult::default();
    // One token past the blocks: vLLM's cap leaves a held prompt whole.
    let prompts: Vec<Vec<u32>> = tokens
        .iter()
        .map(|t| t.iter().copied().chain([7]).collect())
        .collect();
    let started = Instant::now();
    for i in 0..hashes.len() {
        match form {
            Form::Hashes => ix.score_hashes_into(MODEL, &hashes[i], pods, &mut out),
            Form::Tokens => ix.score_tokens_into(MODEL, &prompts[i], pods, None, None, &mut out),
        }
        .expect("the model is known");
        let owner = out.named().find(|(name, _)| *name == pods[i / PER_POD]);
        assert_eq!(
            owner.map(|(_, s)| s.matched_blocks as usize),
            Some(SYSTEM_BLOCKS + OWN_BLOCKS),
            "the owner holds the whole prompt"
        );
        let sharing = out
            .scores
            .iter()
            .filter(|s| s.matched_blocks as usize == SYSTEM_BLOCKS)
            .count();
        assert_eq!(
            sharing,
            PER_POD * PODS / SYSTEMS - 1,
            "the system prompt's other holders"
        );
        black_box(&out);
    }
    started.elapsed().as_secs_f64()
}

fn main() {
    let (tokens, prompts) = prompts();
    let pods: Vec<String> = (0..PODS).map(pod).collect();
    let memberships =
        |groups: usize| (prompts.len() * (SYSTEM_BLOCKS + OWN_BLOCKS) * groups) as f64;
    // Per indexer: heap per membership, hash-form and token-form score seconds.
    let mut rows: [Vec<f64>; 6] = Default::default();
    for _ in 0..ROUNDS {
        // Alternated in one process: full attention only, then hybrid.
        for (groups, at) in [(1i64, 0), (2, 3)] {
            let (ix, held) = build(&prompts, groups);
            let model = ix.model(MODEL).expect("model");
            let hybrid_layouts = model
                .index()
                .directory()
                .engines_of(&pods[0])
                .iter()
                .filter(|&&e| model.layout(e).is_some())
                .count();
            assert_eq!(
                hybrid_layouts,
                usize::from(groups == 2),
                "hybrid pods carry a layout"
            );
            rows[at].push(held / memberships(groups as usize));
            rows[at + 1].push(score_all(&ix, Form::Hashes, (&tokens, &prompts), &pods));
            rows[at + 2].push(score_all(&ix, Form::Tokens, (&tokens, &prompts), &pods));
            println!(
                "  round: {groups} group(s), {:.1} MiB",
                held / (1 << 20) as f64
            );
        }
    }
    let [full_heap, full_hashes, full_tokens, hybrid_heap, hybrid_hashes, hybrid_tokens] =
        rows.map(|r| median(&r));
    let per = |s: f64| s / prompts.len() as f64 * 1e6;
    println!(
        "hybrid scoring, {} prompts of {} blocks, {PODS} pods (medians of {ROUNDS}):",
        prompts.len(),
        SYSTEM_BLOCKS + OWN_BLOCKS
    );
    println!("                       heap/membership   by hashes    by tokens (us/prompt)");
    println!(
        "  full attention only: {full_heap:>10.1} B {:>14.2} {:>12.2}",
        per(full_hashes),
        per(full_tokens)
    );
    println!(
        "  full + window 128:   {hybrid_heap:>10.1} B {:>14.2} {:>12.2}",
        per(hybrid_hashes),
        per(hybrid_tokens)
    );
    println!(
        "  hybrid / full: {:.2}x per membership ({:.2}x in all: twice the memberships), \
         {:.2}x by hashes, {:.2}x by tokens",
        hybrid_heap / full_heap,
        2.0 * hybrid_heap / full_heap,
        hybrid_hashes / full_hashes,
        hybrid_tokens / full_tokens
    );
}
