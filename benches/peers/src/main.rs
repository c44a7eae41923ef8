//! kv-indexer's index against its peers on the Mooncake conversation trace, one thread, one
//! process: SMG `kv-index` 2.0 `ChainIndex`, NVIDIA Dynamo `dynamo-kv-router` 1.6 `RadixTree`,
//! and kv-core's reference index, a per-block map walked block by block (the reference). Every backend is driven through
//! the same prepared stream (`kv_lab::index_bench`); each query's answer (every pod's matched
//! depth) is compared with the reference's, and mismatching queries are counted.
//!
//! Fleets: 16 pods (the replay), 80, 1,024, and 1,024 with a 128-block system prompt
//! before every request (held by every pod). Each fleet runs `KV_BENCH_RUNS` rounds (default 3)
//! of every backend, interleaved; the table shows medians.
//!
//! Usage: `cargo run --release --manifest-path benches/peers/Cargo.toml [-- TRACE.jsonl]`;
//! `KV_BENCH_FLEETS=16,80` picks fleets (`1024s` = 1,024 pods with the system prompt; `16e` and
//! `16h`: 16 pods with one hash per removal call, tail first as vLLM evicts, and shuffled);
//! `KV_BENCH_BACKENDS=smg,ours` picks backends (keys in `backends()`; the reference always runs).

use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::RadixTree;
use kv_core::BlockHash;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::{
    drive, median, BenchReport, IndexBackend, IndexWorkload, IndexerFacadeBackend,
    KvIndexerBackend, QueryAnswer, ReferenceBackend, Removals, RunIndexBackend, WorkloadShape,
};
use kv_lab::trace::load_mooncake;

#[cfg(not(any(feature = "mimalloc", feature = "jemalloc")))]
#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

/// `--features mimalloc`: every backend on mimalloc instead of glibc (the allocator comparison).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: CountingAllocator<mimalloc::MiMalloc> = CountingAllocator(mimalloc::MiMalloc);

/// `--features jemalloc`: every backend on jemalloc.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static GLOBAL: CountingAllocator<tikv_jemallocator::Jemalloc> =
    CountingAllocator(tikv_jemallocator::Jemalloc);

/// SMG's ChainIndex with one lane map per worker, driven through its allocation-free API.
struct Smg {
    index: ChainIndex,
    workers: Vec<u32>,
    /// SMG worker id -> pod number.
    pod_of: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    blocks: Vec<StoredBlock>,
    removed: Vec<SequenceHash>,
    errors: usize,
}

impl Smg {
    fn new(pods: u32) -> Self {
        // SMG's default is 256 workers; 1,024 is its most.
        let index = ChainIndex::with_max_workers(pods as usize);
        let workers: Vec<u32> = (0..pods)
            .map(|p| {
                index
                    .intern_worker(&format!("pod-{p}"))
                    .expect("room for workers")
            })
            .collect();
        let mut pod_of = vec![u32::MAX; workers.iter().max().map_or(0, |&w| w as usize + 1)];
        for (p, &w) in workers.iter().enumerate() {
            pod_of[w as usize] = p as u32;
        }
        Self {
            index,
            workers,
            pod_of,
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

    fn query(&mut self, _hashes: &[BlockHash], content: &[u64]) -> QueryAnswer {
        let mut answer = QueryAnswer::default();
        let pod_of = &self.pod_of;
        self.index.score_into(
            content,
            |c| *c,
            false,
            |worker, score| {
                answer.add(
                    pod_of.get(worker as usize).copied().unwrap_or(u32::MAX),
                    score,
                )
            },
        );
        answer
    }

    fn store(
        &mut self,
        pod: u32,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        content: &[u64],
    ) {
        self.blocks.clear();
        self.blocks
            .extend(hashes.iter().zip(content).map(|(&h, &c)| StoredBlock {
                seq_hash: SequenceHash(h.get()),
                content_hash: ContentHash(c),
            }));
        let map = &mut self.maps[pod as usize];
        if self
            .index
            .apply_stored(
                self.workers[pod as usize],
                &self.blocks,
                parent.map(|p| SequenceHash(p.get())),
                map,
            )
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        self.removed.clear();
        self.removed
            .extend(hashes.iter().map(|&h| SequenceHash(h.get())));
        self.index.apply_removed(
            self.workers[pod as usize],
            &self.removed,
            &mut self.maps[pod as usize],
        );
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

    fn query(&mut self, _hashes: &[BlockHash], content: &[u64]) -> QueryAnswer {
        let seq = content.iter().map(|&c| LocalBlockHash(c)).collect();
        let scores = self.tree.find_matches(seq, false);
        let mut answer = QueryAnswer::default();
        for (worker, &score) in &scores.scores {
            answer.add(worker.worker_id as u32, score);
        }
        answer
    }

    fn store(
        &mut self,
        pod: u32,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        content: &[u64],
    ) {
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
        if self
            .tree
            .apply_event(RouterEvent::new(pod as u64, event))
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        self.event_id += 1;
        let event = KvCacheEvent {
            event_id: self.event_id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: hashes
                    .iter()
                    .map(|&h| ExternalSequenceBlockHash(h.get()))
                    .collect(),
            }),
            dp_rank: 0,
        };
        if self
            .tree
            .apply_event(RouterEvent::new(pod as u64, event))
            .is_err()
        {
            self.errors += 1;
        }
    }
}

/// A fleet to replay the trace on.
struct Fleet {
    label: &'static str,
    shape: WorkloadShape,
}

fn fleets() -> Vec<Fleet> {
    let base = WorkloadShape::default();
    let all = [
        ("16", "16 pods", base),
        (
            "16e",
            "16 pods, one hash per removal event, tail first (as vLLM evicts)",
            WorkloadShape {
                removals: Removals::OnePerEvent,
                ..base
            },
        ),
        (
            "16h",
            "16 pods, one hash per removal event, shuffled eviction order (holes)",
            WorkloadShape {
                removals: Removals::Shuffled,
                ..base
            },
        ),
        ("80", "80 pods", WorkloadShape { pods: 80, ..base }),
        ("1024", "1,024 pods", WorkloadShape { pods: 1024, ..base }),
        (
            "1024s",
            "1,024 pods, 128-block system prompt on every request",
            WorkloadShape {
                pods: 1024,
                shared_prefix_blocks: 128,
                ..base
            },
        ),
    ];
    let wanted = std::env::var("KV_BENCH_FLEETS").unwrap_or_else(|_| "16,80,1024,1024s".into());
    let wanted: Vec<&str> = wanted.split(',').map(str::trim).collect();
    all.into_iter()
        .filter(|(key, ..)| wanted.contains(key))
        .map(|(_, label, shape)| Fleet { label, shape })
        .collect()
}

type Maker = Box<dyn Fn(u32) -> Box<dyn IndexBackend>>;

/// kv-indexer's `ModelIndex` with `writer_lanes` lanes (exact membership).
fn model_index(writer_lanes: usize) -> Maker {
    Box::new(move |pods| {
        Box::new(KvIndexerBackend::with_config(
            pods,
            kv_core::IndexConfig {
                max_keys: 1 << 26,
                writer_lanes,
                ..Default::default()
            },
        ))
    })
}

fn backends() -> Vec<(&'static str, Maker)> {
    vec![
        (
            "reference",
            Box::new(|_| Box::new(ReferenceBackend::default())),
        ),
        ("smg", Box::new(|pods| Box::new(Smg::new(pods)))),
        (
            "dynamo",
            Box::new(|_| {
                Box::new(Dynamo {
                    tree: RadixTree::new(),
                    event_id: 0,
                    errors: 0,
                })
            }),
        ),
        // The bare core before the model index that wraps it (the order of the earlier
        // sequences: an earlier backend's freed memory moves a later one's figures).
        ("runs", Box::new(|_| Box::new(RunIndexBackend::new()))),
        (
            "ours",
            Box::new(|pods| Box::new(KvIndexerBackend::new(pods))),
        ),
        (
            "facade",
            Box::new(|pods| Box::new(IndexerFacadeBackend::new(pods))),
        ),
        ("lanes", model_index(2)),
        (
            "bounded",
            Box::new(|pods| Box::new(KvIndexerBackend::with_pod_cache_size(pods, Some(10)))),
        ),
    ]
}

/// One backend's rounds on one fleet.
#[derive(Default)]
struct Rounds {
    name: String,
    ops: Vec<f64>,
    apply: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    bytes: Vec<f64>,
    mismatches: Vec<usize>,
    short: Vec<usize>,
    shape: Option<String>,
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
    let runs: usize = std::env::var("KV_BENCH_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    for fleet in fleets() {
        let t = Instant::now();
        let workload = IndexWorkload::simulate(&requests, fleet.shape);
        let (_, s, r) = workload.totals();
        println!(
            "### {}: {}; prepared in {:.1}s; medians of {runs} rounds",
            fleet.label,
            workload.summary(),
            t.elapsed().as_secs_f64()
        );
        println!();
        println!("| backend | block-ops/s | apply blocks/s | query p50 | query p99 | bytes/membership | ops/s vs SMG | apply vs SMG | queries differing from the reference (of which short) |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        // KV_BENCH_BACKENDS=smg,facade picks backends (the reference always runs).
        let picked = std::env::var("KV_BENCH_BACKENDS").ok();
        let makers: Vec<_> = backends()
            .into_iter()
            .filter(|(key, _)| {
                *key == "reference"
                    || picked
                        .as_deref()
                        .is_none_or(|p| p.split(',').any(|k| k == *key))
            })
            .collect();
        let mut rounds: Vec<Rounds> = makers.iter().map(|_| Rounds::default()).collect();
        for _ in 0..runs {
            let mut reference: Option<BenchReport> = None;
            for ((_, make), acc) in makers.iter().zip(rounds.iter_mut()) {
                let before = live_heap_bytes();
                let mut backend = make(fleet.shape.pods);
                let report = drive(&workload, backend.as_mut());
                let bytes = live_heap_bytes().saturating_sub(before);
                acc.shape = backend.shape();
                drop(backend);
                acc.name = report.backend.clone();
                acc.ops.push(report.block_ops_per_sec());
                acc.apply.push((s + r) as f64 / report.apply_seconds);
                acc.p50.push(report.query_percentile_us(50.0));
                acc.p99.push(report.query_percentile_us(99.0));
                acc.bytes
                    .push(bytes as f64 / workload.final_memberships as f64);
                match &reference {
                    None => {
                        acc.mismatches.push(0);
                        acc.short.push(0);
                        reference = Some(report);
                    }
                    Some(reference) => {
                        acc.mismatches.push(report.mismatches(reference));
                        acc.short.push(report.short_answers(reference));
                    }
                }
            }
        }
        let smg = rounds
            .iter()
            .zip(&makers)
            .find(|(_, (key, _))| *key == "smg")
            .map(|(r, _)| (median(&r.ops), median(&r.apply)))
            .unwrap_or((f64::NAN, f64::NAN));
        for acc in &rounds {
            println!(
                "| {} | {:.1}M | {:.1}M | {:.2} us | {:.2} us | {:.1} | {:.2} | {:.2} | {} ({}) |",
                acc.name,
                median(&acc.ops) / 1e6,
                median(&acc.apply) / 1e6,
                median(&acc.p50),
                median(&acc.p99),
                median(&acc.bytes),
                median(&acc.ops) / smg.0,
                median(&acc.apply) / smg.1,
                acc.mismatches.iter().max().copied().unwrap_or(0),
                acc.short.iter().max().copied().unwrap_or(0),
            );
        }
        for acc in rounds.iter() {
            if let Some(shape) = &acc.shape {
                println!("- {}, last round: {shape}", acc.name);
            }
        }
        println!();
    }
}
