//! `cargo bench --bench translation`: what keys from tokens cost at ingest, beside aligned
//! engines in the same run (these machines are noisy; compare the ratios).
//!
//! Workload (seeded, deterministic): 16 pods; each stores 64 prompts of 512 tokens (a root
//! run of 16 blocks, then a continuation of 16) and removes the first 8 prompts' blocks one
//! hash per `BlockRemoved`, as vLLM does. The same token streams are published three ways:
//! - aligned: the engine's hashes are kv-indexer's keys (vLLM sha256_cbor, seed 12345, 16);
//! - translated: opaque hashes (another algorithm or seed), blocks of 16;
//! - translated x2: opaque hashes, blocks of 32 (two keys per engine block).
//!
//! Reported: apply blocks/s (index keys stored or removed per second; medians of 3 rounds,
//! the batches decoded beforehand), and heap per engine block the translated index holds
//! beyond the aligned one (the map: the CountingAllocator's live bytes after the stores).

use std::time::Instant;

use kv_core::{
    BlockRemoved, BlockStored, EngineHash, EngineHashes, EventBatch, Indexer, IndexerSettings,
    KvEvent, Medium, ModelSettings, RequestExtras, SplitMix64, TokenProcessor,
    TokenProcessorConfig,
};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

const PODS: usize = 16;
const PROMPTS: usize = 64;
const PROMPT_TOKENS: usize = 512;
const REMOVED_PROMPTS: usize = 8;

fn indexer() -> Indexer {
    Indexer::new(IndexerSettings {
        default_model: ModelSettings {
            token_processor: TokenProcessorConfig {
                hash_seed: Some("12345".into()),
                block_size: 16,
                ..Default::default()
            },
            engine_hashes: EngineHashes::Auto,
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid")
}

fn stored(hashes: &[EngineHash], parent: Option<EngineHash>, tokens: &[u32], bs: u32) -> KvEvent {
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: bs,
        medium: Some(Medium::Gpu),
        ..Default::default()
    }))
}

/// One pod's batches, its engine hashing as `engine` says (`None`: aligned), blocks of `bs`.
fn pod_batches(pod: usize, engine: Option<u64>, bs: usize) -> Vec<EventBatch> {
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        block_size: bs,
        ..Default::default()
    })
    .expect("valid");
    let mut rng = SplitMix64::new(pod as u64 * 7919 + 1);
    let mut opaque = SplitMix64::new(engine.unwrap_or(0) ^ pod as u64);
    let mut out = Vec::new();
    let mut removals = Vec::new();
    for p in 0..PROMPTS {
        let tokens: Vec<u32> = (0..PROMPT_TOKENS)
            .map(|_| rng.below(151_000) as u32)
            .collect();
        let hashes: Vec<EngineHash> = match engine {
            None => processor
                .block_hashes(&tokens, &RequestExtras::default())
                .into_iter()
                .map(EngineHash::aligned)
                .collect(),
            Some(_) => (0..PROMPT_TOKENS / bs)
                .map(|_| EngineHash::new(opaque.next_u64()))
                .collect(),
        };
        let half = hashes.len() / 2;
        let events = vec![
            stored(&hashes[..half], None, &tokens[..half * bs], bs as u32),
            stored(
                &hashes[half..],
                Some(hashes[half - 1]),
                &tokens[half * bs..],
                bs as u32,
            ),
        ];
        out.push(EventBatch {
            ts: p as f64,
            events,
            data_parallel_rank: Some(0),
        });
        if p < REMOVED_PROMPTS {
            removals.extend(hashes.iter().rev().map(|&h| {
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![h],
                    medium: Some(Medium::Gpu),
                    ..Default::default()
                })
            }));
        }
    }
    out.push(EventBatch {
        ts: PROMPTS as f64,
        events: removals,
        data_parallel_rank: Some(0),
    });
    out
}

/// Applies every pod's batches to a fresh indexer; returns (seconds, keys stored + removed).
fn apply_all(batches: &[(String, Vec<EventBatch>)]) -> (f64, u64, Indexer) {
    let ix = indexer();
    let started = Instant::now();
    let mut keys = 0;
    for (pod, list) in batches {
        for b in list {
            let r = ix.apply_batch("m", pod, b).expect("applies");
            keys += r.blocks_stored + r.blocks_removed;
        }
    }
    (started.elapsed().as_secs_f64(), keys, ix)
}

fn main() {
    let setups: [(&str, Option<u64>, usize); 3] = [
        ("aligned (sha256_cbor, seed 12345, 16)", None, 16),
        ("translated (opaque hashes, 16)", Some(99), 16),
        ("translated x2 (opaque hashes, 32)", Some(77), 32),
    ];
    let workloads: Vec<Vec<(String, Vec<EventBatch>)>> = setups
        .iter()
        .map(|&(_, engine, bs)| {
            (0..PODS)
                .map(|p| (format!("10.0.0.{p}:8000"), pod_batches(p, engine, bs)))
                .collect()
        })
        .collect();
    println!(
        "## Keys from tokens: apply cost ({PODS} pods x {PROMPTS} prompts of {PROMPT_TOKENS} tokens, {REMOVED_PROMPTS} removed; medians of 3 rounds)"
    );
    println!("| engine | keys applied | apply keys/s | vs aligned |");
    println!("|---|---:|---:|---:|");
    let mut base = 0.0;
    for (i, (name, _, _)) in setups.iter().enumerate() {
        let mut rates = Vec::new();
        let mut applied = 0;
        for _ in 0..3 {
            let (secs, keys, ix) = apply_all(&workloads[i]);
            applied = keys;
            rates.push(keys as f64 / secs);
            drop(ix);
        }
        let rate = median(&rates);
        if i == 0 {
            base = rate;
        }
        println!(
            "| {name} | {applied} | {:.2}M | {:.2}x |",
            rate / 1e6,
            rate / base
        );
    }

    // Heap: the stores alone (no removals), aligned vs translated with the same key count.
    let stores_only = |w: &Vec<(String, Vec<EventBatch>)>| -> Vec<(String, Vec<EventBatch>)> {
        w.iter()
            .map(|(pod, list)| (pod.clone(), list[..PROMPTS].to_vec()))
            .collect()
    };
    let mut heap = Vec::new();
    for w in &workloads[..2] {
        let batches = stores_only(w);
        let before = live_heap_bytes();
        let (_, _, ix) = apply_all(&batches);
        let held = live_heap_bytes().saturating_sub(before);
        let translated: usize = ix
            .model("m")
            .map(|m| m.key_modes().values().map(|(_, n)| *n).sum())
            .unwrap_or(0);
        heap.push((held, translated));
        drop(ix);
    }
    let engine_blocks = heap[1].1.max(1);
    println!(
        "\nheap after the stores: aligned {:.1} MiB, translated {:.1} MiB; {} translated engine blocks: {:.1} bytes each beyond aligned",
        heap[0].0 as f64 / 1048576.0,
        heap[1].0 as f64 / 1048576.0,
        heap[1].1,
        (heap[1].0 as f64 - heap[0].0 as f64) / engine_blocks as f64
    );
}
