//! `cargo bench --bench replication`: what a replication snapshot costs, beside the baseline a
//! starting replica would otherwise pay, in the same run (three rounds, medians).
//!
//! Scenario (seed 2026): 64 pods, 500 prompts of 500 blocks, each prompt stored by 4 pods
//! drawn at random: 250,000 distinct blocks, 1,000,000 memberships, all GPU tier.
//!
//! - baseline, *replay*: the same memberships as vLLM-shaped event messages (one message per
//!   prompt and pod), decoded and applied to an empty index: what a replica that had to
//!   re-read every event would do;
//! - *write*: a snapshot of the index (the pause: copy engine by engine and encode), then its
//!   checksum (after the pause); bytes per membership; the heap the write needed at its worst
//!   beyond the index;
//! - *load*: the snapshot decoded and imported into an empty index.
//!
//! The storing round trips to Redis are not included (they run after the pause, beside the
//! follower); `tests/replication.rs` measures a whole restart against a real Redis.

use std::time::Instant;

use kv_core::{
    decode_batch, encode_batch, BlockStored, EngineHash, EventBatch, Indexer, IndexerSettings,
    KvEvent, Medium, SplitMix64,
};
use kv_indexer::replication::snapshot::{checksum, SnapshotItem, SnapshotReader, SnapshotWriter};
use kv_indexer::replication::StreamId;
use kv_lab::alloc::{live_heap_bytes, peak_heap_bytes, reset_peak_heap_bytes, CountingAllocator};
use kv_lab::index_bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

const PODS: u64 = 64;
const PROMPTS: usize = 500;
const BLOCKS: usize = 500;
const HOLDERS: usize = 4;
const MODEL: &str = "bench/model";

fn indexer() -> Indexer {
    Indexer::new(IndexerSettings::default()).expect("default settings")
}

/// (pod, payload) messages: each prompt stored by `HOLDERS` distinct pods.
fn messages() -> Vec<(String, Vec<u8>)> {
    let mut rng = SplitMix64::new(2026);
    let mut out = Vec::new();
    for _ in 0..PROMPTS {
        let hashes: Vec<EngineHash> = (0..BLOCKS)
            .map(|_| EngineHash::from(rng.next_u64()))
            .collect();
        let mut pods = Vec::new();
        while pods.len() < HOLDERS {
            let p = rng.below(PODS);
            if !pods.contains(&p) {
                pods.push(p);
            }
        }
        for p in pods {
            let payload = encode_batch(&EventBatch {
                ts: 1.7e9,
                events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes.clone(),
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: 16,
                    medium: Some(Medium::Gpu),
                    ..Default::default()
                }))],
                data_parallel_rank: Some(0),
            });
            out.push((format!("10.0.{}.{}:8000", p / 256, p % 256), payload));
        }
    }
    out
}

fn memberships(ix: &Indexer) -> u64 {
    ix.stats().iter().map(|(_, s)| s.memberships).sum()
}

fn main() {
    let messages = messages();
    let (mut replay, mut write, mut sums, mut load, mut bytes_per, mut peak_extra) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut size = 0;
    for round in 0..3 {
        // Baseline: replay the events into an empty index.
        let started = Instant::now();
        let source = indexer();
        for (pod, payload) in &messages {
            let batch = decode_batch(payload).expect("payload decodes");
            source.apply_batch(MODEL, pod, &batch).expect("applies");
        }
        replay.push(started.elapsed().as_secs_f64());
        let held = memberships(&source);
        assert_eq!(held, (PROMPTS * BLOCKS * HOLDERS) as u64);

        // Write: the pause (copy and encode), then the checksum (after the workers resume).
        let before = live_heap_bytes();
        reset_peak_heap_bytes();
        let started = Instant::now();
        let mut writer = SnapshotWriter::new(StreamId { ms: 1, seq: 0 }, held);
        source.export_each(|model, key, blocks| writer.blocks(model, key, blocks));
        let (bytes, written) = writer.finish();
        write.push(started.elapsed().as_secs_f64());
        let started = Instant::now();
        let sum = checksum(&[&bytes]);
        sums.push(started.elapsed().as_secs_f64());
        peak_extra.push((peak_heap_bytes() - before) as f64 / written as f64);
        assert_eq!(written, held);
        bytes_per.push(bytes.len() as f64 / written as f64);
        size = bytes.len();

        // Load into an empty index.
        let started = Instant::now();
        let target = indexer();
        let mut reader = SnapshotReader::new(&bytes).expect("header");
        while let Some(item) = reader.next_item().expect("item") {
            if let SnapshotItem::Blocks {
                model,
                key,
                tier,
                hashes,
            } = item
            {
                target.import(model, &key, tier, &hashes).expect("imports");
            }
        }
        load.push(started.elapsed().as_secs_f64());
        assert_eq!(
            memberships(&target),
            held,
            "round {round}: load lost memberships"
        );
        std::hint::black_box(sum);
    }
    let m = (PROMPTS * BLOCKS * HOLDERS) as f64 / 1e6;
    let (replay, write, sum, load) = (
        median(&replay),
        median(&write),
        median(&sums),
        median(&load),
    );
    println!("snapshot of {m:.1}M memberships ({PODS} pods, {PROMPTS} prompts x {BLOCKS} blocks x {HOLDERS} holders, seed 2026); medians of 3 rounds");
    println!("| step | seconds per 1M memberships | vs replaying the events |");
    println!("| --- | --- | --- |");
    println!(
        "| replay events (baseline: decode + apply) | {:.3} | 1.00x |",
        replay / m
    );
    println!(
        "| write snapshot: copy + encode (the workers' pause) | {:.3} | {:.2}x |",
        write / m,
        write / replay
    );
    println!(
        "| write snapshot: checksum (after the pause) | {:.3} | {:.2}x |",
        sum / m,
        sum / replay
    );
    println!(
        "| load snapshot (decode + import) | {:.3} | {:.2}x |",
        load / m,
        load / replay
    );
    println!(
        "size {size} bytes: {:.2} bytes per membership; the write needed at most {:.1} bytes per membership beyond the index",
        median(&bytes_per),
        median(&peak_extra)
    );
}
