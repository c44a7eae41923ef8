//! kv-indexer's index against its peers on the Mooncake conversation trace, one thread, one
//! process, one run: SMG `kv-index` 2.0 `ChainIndex`, NVIDIA Dynamo `dynamo-kv-router` 1.6
//! `RadixTree`, and a flat hash map probed block by block. Every backend is driven through the same
//! prepared stream (`kv_lab::index_bench`) and must report the same matched-block checksum.
//!
//! Usage: `cargo run --release --manifest-path benches/peers/Cargo.toml [-- TRACE.jsonl]`.

use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::RadixTree;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use kv_core::BlockHash;
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::{
    drive, FlatMapBackend, IndexBackend, IndexWorkload, KvIndexerBackend, WorkloadShape,
};
use kv_lab::trace::load_mooncake;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// SMG's ChainIndex with one lane map per worker, driven through its allocation-free API.
struct Smg {
    index: ChainIndex,
    workers: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    blocks: Vec<StoredBlock>,
    removed: Vec<SequenceHash>,
    errors: usize,
}

impl Smg {
    fn new(pods: u32) -> Self {
        let index = ChainIndex::new();
        let workers = (0..pods)
            .map(|p| index.intern_worker(&format!("pod-{p}")).expect("room for workers"))
            .collect();
        Self {
            index,
            workers,
            maps: (0..pods).map(|_| ChainBlockMap::new()).collect(),
            blocks: Vec::new(),
            removed: Vec::new(),
            errors: 0,
        }
    }
}

impl IndexBackend for Smg {
    fn name(&self) -> &str {
        "SMG kv-index 2.0 ChainIndex"
    }

    fn query(&mut self, _hashes: &[BlockHash], content: &[u64]) -> u32 {
        let mut best = 0;
        self.index.score_into(content, |c| *c, false, |_, score| best = best.max(score));
        best
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, hashes: &[BlockHash], content: &[u64]) {
        self.blocks.clear();
        self.blocks.extend(hashes.iter().zip(content).map(|(&h, &c)| StoredBlock {
            seq_hash: SequenceHash(h.get()),
            content_hash: ContentHash(c),
        }));
        let map = &mut self.maps[pod as usize];
        if self
            .index
            .apply_stored(self.workers[pod as usize], &self.blocks, parent.map(|p| SequenceHash(p.get())), map)
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        self.removed.clear();
        self.removed.extend(hashes.iter().map(|&h| SequenceHash(h.get())));
        self.index
            .apply_removed(self.workers[pod as usize], &self.removed, &mut self.maps[pod as usize]);
    }
}

/// Dynamo's RadixTree through its event API (its only public write path).
struct Dynamo {
    tree: RadixTree,
    event_id: u64,
    errors: usize,
}

impl IndexBackend for Dynamo {
    fn name(&self) -> &str {
        "Dynamo dynamo-kv-router 1.6 RadixTree"
    }

    fn query(&mut self, _hashes: &[BlockHash], content: &[u64]) -> u32 {
        let seq = content.iter().map(|&c| LocalBlockHash(c)).collect();
        let scores = self.tree.find_matches(seq, false);
        scores.scores.values().copied().max().unwrap_or(0)
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, hashes: &[BlockHash], content: &[u64]) {
        self.event_id += 1;
        let blocks = hashes
            .iter()
            .zip(content)
            .map(|(&h, &c)| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(h.get()),
                tokens_hash: LocalBlockHash(c),
                mm_extra_info: None,
            })
            .collect();
        let event = KvCacheEvent {
            event_id: self.event_id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.get())),
                start_position: None,
                blocks,
            }),
            dp_rank: 0,
        };
        if self.tree.apply_event(RouterEvent::new(pod as u64, event)).is_err() {
            self.errors += 1;
        }
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        self.event_id += 1;
        let event = KvCacheEvent {
            event_id: self.event_id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: hashes.iter().map(|&h| ExternalSequenceBlockHash(h.get())).collect(),
            }),
            dp_rank: 0,
        };
        if self.tree.apply_event(RouterEvent::new(pod as u64, event)).is_err() {
            self.errors += 1;
        }
    }
}

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        format!(
            "{}/../../../shared/traces/mooncake/conversation_trace.jsonl",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let requests = load_mooncake(std::path::Path::new(&path)).unwrap_or_else(|e| {
        eprintln!("cannot read the trace: {e}");
        std::process::exit(2);
    });
    let shape = WorkloadShape::default();
    let t = Instant::now();
    let workload = IndexWorkload::simulate(&requests, shape);
    let (q, s, r) = workload.totals();
    println!(
        "Mooncake conversation trace: {} requests, {:.2}M stored, {:.2}M removed, {:.2}M queried blocks (avg depth {:.0}), {} final memberships; prepared in {:.1}s",
        requests.len(),
        s as f64 / 1e6,
        r as f64 / 1e6,
        q as f64 / 1e6,
        q as f64 / workload.steps.len() as f64,
        workload.final_memberships,
        t.elapsed().as_secs_f64()
    );
    println!();
    println!("| backend | block-ops/s | apply blocks/s | query p50 | query p99 | bytes/membership | vs best peer (ops/s) | matched blocks (exact = flat map) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let makers: Vec<(&str, Box<dyn Fn() -> Box<dyn IndexBackend>>)> = vec![
        ("flat", Box::new(|| Box::new(FlatMapBackend::default()))),
        ("smg", Box::new(move || Box::new(Smg::new(shape.pods)))),
        (
            "dynamo",
            Box::new(|| {
                Box::new(Dynamo {
                    tree: RadixTree::new(),
                    event_id: 0,
                    errors: 0,
                })
            }),
        ),
        ("ours", Box::new(move || Box::new(KvIndexerBackend::new(shape.pods)))),
    ];
    let mut rows = Vec::new();
    for (key, make) in &makers {
        let before = live_heap_bytes();
        let mut backend = make();
        let report = drive(&workload, backend.as_mut());
        let bytes = live_heap_bytes().saturating_sub(before);
        drop(backend);
        rows.push((*key, report, bytes));
    }
    let best_peer = rows
        .iter()
        .filter(|(k, ..)| *k == "smg" || *k == "dynamo")
        .map(|(_, r, _)| r.block_ops_per_sec())
        .fold(0.0, f64::max);
    let checksum = rows[0].1.checksum;
    for (_, rep, bytes) in &rows {
        println!(
            "| {} | {:.1}M | {:.1}M | {:.2} us | {:.2} us | {:.1} | {:.2} | {}{} |",
            rep.backend,
            rep.block_ops_per_sec() / 1e6,
            (s + r) as f64 / rep.apply_seconds / 1e6,
            rep.query_percentile_us(50.0),
            rep.query_percentile_us(99.0),
            *bytes as f64 / workload.final_memberships as f64,
            rep.block_ops_per_sec() / best_peer,
            rep.checksum,
            if rep.checksum == checksum { "" } else { " (differs)" }
        );
    }
}
