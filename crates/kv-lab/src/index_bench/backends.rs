//! The index benchmark's backends: kv-indexer's index alone ([`KvIndexerBackend`]), behind its
//! facade ([`IndexerFacadeBackend`]), the bare run index ([`RunIndexBackend`]), and kv-core's
//! reference index, which every answer is checked against (`ReferenceBackend`, feature
//! `testing`).

use std::sync::Arc;

use kv_core::{BlockHash, EngineHash};

use super::{Blocks, IndexBackend, QueryAnswer};

/// kv-indexer's own index as a benchmark backend.
pub struct KvIndexerBackend {
    name: String,
    pub(super) index: kv_core::ModelIndex,
    pub(super) engines: Vec<kv_core::EngineId>,
    /// Engine id -> pod number.
    pod_of: Vec<u32>,
    out: Vec<kv_core::EngineScore>,
    weights: kv_core::TierWeights,
}

impl KvIndexerBackend {
    /// The model index for `pods` engines, exact membership.
    pub fn new(pods: u32) -> Self {
        Self::with_pod_cache_size(pods, None)
    }

    /// The model index for `pods` engines with `podCacheSize` set to `bound` (`None`: exact).
    pub fn with_pod_cache_size(pods: u32, bound: Option<usize>) -> Self {
        Self::with_config(
            pods,
            kv_core::IndexConfig {
                max_keys: 1 << 26,
                pod_cache_size: bound,
                ..Default::default()
            },
        )
    }

    /// An index for `pods` engines (`pod-0`...) with `config`.
    pub fn with_config(pods: u32, config: kv_core::IndexConfig) -> Self {
        let mut name = "kv-indexer".to_owned();
        if let Some(b) = config.pod_cache_size {
            name.push_str(&format!(", podCacheSize {b}"));
        }
        if config.writer_lanes > 1 {
            name.push_str(&format!(", {} writer lanes", config.writer_lanes));
        }
        let index = kv_core::ModelIndex::new(config).expect("benchmark config is valid");
        let engines: Vec<_> = (0..pods)
            .filter_map(|p| index.engine(&kv_core::EngineKey::new(&format!("pod-{p}"), 0)))
            .collect();
        let mut pod_of = vec![u32::MAX; engines.iter().max().map_or(0, |&e| e as usize + 1)];
        for (p, &e) in engines.iter().enumerate() {
            pod_of[e as usize] = p as u32;
        }
        Self {
            name,
            index,
            engines,
            pod_of,
            out: Vec::new(),
            weights: kv_core::TierWeights::default(),
        }
    }

    /// The index (for stats after a run).
    pub fn index(&self) -> &kv_core::ModelIndex {
        &self.index
    }
}

impl IndexBackend for KvIndexerBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer {
        let hashes = prompt.hashes;
        self.index
            .score_engines(hashes, None, &self.weights, &mut self.out);
        let mut answer = QueryAnswer::default();
        for s in &self.out {
            if let Some(&pod) = self.pod_of.get(s.engine as usize) {
                answer.add(pod, s.matched_blocks);
            }
        }
        answer
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        let engine = self.engines[pod as usize];
        self.index.write(engine, |w| {
            w.store(engine, kv_core::Tier::Gpu, parent, hashes);
        });
    }

    fn remove(&mut self, pod: u32, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        let engine = self.engines[pod as usize];
        self.index.write(engine, |w| {
            w.remove(engine, kv_core::Tier::Gpu, hashes);
        });
    }
}

/// The bare run index ([`kv_core::RunIndex`], no lanes or budget): pod `p` is engine `p`, GPU tier.
pub struct RunIndexBackend {
    index: kv_core::RunIndex,
    scratch: kv_core::RunScratch,
    scores: Vec<kv_core::EngineScore>,
}

/// Blocks the benchmark's run index may hold (more than any workload here stores).
const RUN_INDEX_CAPACITY: u32 = 1 << 24;

impl RunIndexBackend {
    /// An empty run index.
    pub fn new() -> Self {
        Self {
            index: kv_core::RunIndex::new(0x5EED, RUN_INDEX_CAPACITY),
            scratch: kv_core::RunScratch::default(),
            scores: Vec::new(),
        }
    }

    /// The index (for its shape and split counters after a run).
    pub fn index(&self) -> &kv_core::RunIndex {
        &self.index
    }
}

impl Default for RunIndexBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl IndexBackend for RunIndexBackend {
    fn name(&self) -> &str {
        "kv-indexer v3 RunIndex (core)"
    }

    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer {
        let hashes = prompt.hashes;
        let mut answer = QueryAnswer::default();
        self.scores.clear();
        let weights = kv_core::TierWeights::default();
        self.index.reader().score(
            hashes,
            &weights,
            None::<fn(u32) -> bool>,
            &mut self.scratch,
            &mut self.scores,
        );
        for s in &self.scores {
            answer.add(s.engine, s.matched_blocks);
        }
        answer
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        self.index
            .store_each(pod, kv_core::Tier::Gpu, parent, hashes, |_, _| {});
    }

    fn remove(&mut self, pod: u32, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        self.index.remove(pod, kv_core::Tier::Gpu, hashes);
    }

    fn shape(&self) -> Option<String> {
        let s = self.index.stats();
        Some(format!(
            "{:.1} runs per 1k blocks ({} runs, {} blocks, {:.3} ids per block); splits: {} join, {} hole, {} leave; {} merges; {} relabels",
            s.runs as f64 * 1000.0 / s.blocks.max(1) as f64,
            s.runs,
            s.blocks,
            s.ids as f64 / s.blocks.max(1) as f64,
            s.splits_join,
            s.splits_hole,
            s.splits_leave,
            s.merges,
            s.relabels
        ))
    }
}

/// kv-indexer through its facade ([`kv_core::Indexer`]), as a transport drives it: events as
/// decoded batches (one per store run or removal list, built per call as the decoder would),
/// scores by pod name into a reused result.
pub struct IndexerFacadeBackend {
    name: &'static str,
    indexer: kv_core::Indexer,
    pods: Vec<String>,
    result: kv_core::ScoreResult,
    /// Pod index -> pod number, for the directory at address `numbers_for`.
    numbers: Vec<u32>,
    numbers_for: usize,
}

/// The model name the facade backend indexes under.
const BENCH_MODEL: &str = "bench";

impl IndexerFacadeBackend {
    /// A facade with default settings (exact membership) and `pods` pods.
    pub fn new(pods: u32) -> Self {
        let settings = kv_core::IndexerSettings {
            index: kv_core::IndexConfig {
                max_keys: 1 << 26,
                ..Default::default()
            },
            ..Default::default()
        };
        Self {
            name: "kv-indexer through Indexer (facade)",
            indexer: kv_core::Indexer::new(settings).expect("benchmark config is valid"),
            pods: (0..pods).map(|p| format!("pod-{p}")).collect(),
            result: kv_core::ScoreResult::default(),
            numbers: Vec::new(),
            numbers_for: 0,
        }
    }

    fn apply(&self, pod: u32, event: kv_core::KvEvent) {
        let batch = kv_core::EventBatch {
            ts: 0.0,
            events: vec![event],
            data_parallel_rank: None,
        };
        // Cannot fail: one model, default limits.
        let _ = self
            .indexer
            .apply_batch(BENCH_MODEL, &self.pods[pod as usize], &batch);
    }
}

impl IndexBackend for IndexerFacadeBackend {
    fn name(&self) -> &str {
        self.name
    }

    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer {
        let hashes = prompt.hashes;
        let mut answer = QueryAnswer::default();
        if self
            .indexer
            .score_hashes_into(BENCH_MODEL, hashes, kv_core::ALL_PODS, &mut self.result)
            .is_ok()
        {
            // Pod index -> pod number, rebuilt when the directory changes (pod indexes are
            // reused as pods come and go); pod names are `pod-<n>`.
            let directory = self
                .result
                .directory()
                .map_or(0, |d| Arc::as_ptr(d) as usize);
            if directory != self.numbers_for {
                self.numbers_for = directory;
                self.numbers.clear();
                if let Some(d) = self.result.directory() {
                    self.numbers.extend((0..d.pod_slots() as u32).map(|p| {
                        d.pod(p)
                            .and_then(|name| name.strip_prefix("pod-")?.parse().ok())
                            .unwrap_or(u32::MAX)
                    }));
                }
            }
            for s in self.result.scores.iter().filter(|s| s.matched_blocks > 0) {
                let number = match s.pod {
                    kv_core::PodRef::Known(p) => self.numbers.get(p as usize).copied(),
                    kv_core::PodRef::Unknown(_) | kv_core::PodRef::Speculative(_) => None,
                };
                answer.add(number.unwrap_or(u32::MAX), s.matched_blocks);
            }
        }
        answer
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        // The facade's engines are aligned: they publish the index's keys as their hashes.
        let stored = kv_core::BlockStored {
            block_hashes: published(hashes),
            parent_block_hash: parent.map(EngineHash::aligned),
            block_size: 16,
            ..Default::default()
        };
        self.apply(pod, kv_core::KvEvent::BlockStored(Box::new(stored)));
    }

    fn remove(&mut self, pod: u32, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        let removed = kv_core::BlockRemoved {
            block_hashes: published(hashes),
            ..Default::default()
        };
        self.apply(pod, kv_core::KvEvent::BlockRemoved(removed));
    }
}

/// What an aligned engine publishes for the index's keys `keys`.
fn published(keys: &[BlockHash]) -> Vec<EngineHash> {
    keys.iter().map(|&k| EngineHash::aligned(k)).collect()
}

/// kv-core's reference index ([`kv_core::ReferenceIndex`]: a plain per-block map, walked
/// block by block), pod `p` as engine `p`, GPU tier: what every other backend's answers are
/// checked against, the same reference kv-core's differential harness uses (feature
/// `testing`).
#[cfg(feature = "testing")]
#[derive(Default)]
pub struct ReferenceBackend {
    index: kv_core::ReferenceIndex,
}

#[cfg(feature = "testing")]
impl IndexBackend for ReferenceBackend {
    fn name(&self) -> &str {
        "reference (per-block map)"
    }

    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer {
        let hashes = prompt.hashes;
        let mut answer = QueryAnswer::default();
        for s in self
            .index
            .score(hashes, None, &kv_core::TierWeights::default())
        {
            answer.add(s.engine, s.matched_blocks);
        }
        answer
    }

    fn store(&mut self, pod: u32, _parent: Option<BlockHash>, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        self.index.store(pod, kv_core::Tier::Gpu, hashes);
    }

    fn remove(&mut self, pod: u32, blocks: Blocks<'_>) {
        let hashes = blocks.hashes;
        self.index.remove(pod, kv_core::Tier::Gpu, hashes);
    }
}
