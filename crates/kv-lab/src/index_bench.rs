//! The index benchmark: a Mooncake trace turned into the stream an index sees in a fleet, and
//! a driver that measures any index on it.
//!
//! [`IndexWorkload::simulate`] turns a trace into the stream an index sees in a fleet: every 512-token trace block is expanded to
//! engine blocks (32 of 16 tokens), a request is truncated to its full engine blocks, requests
//! go round-robin to pods that each keep an LRU of engine blocks; before its events, each request
//! is queried; a pod's missing blocks are stored as runs with their parent, and the blocks its
//! LRU evicts are removed. [`drive`] runs any [`IndexBackend`] through that stream on one
//! thread, timing every query and every apply.
//!
//! Engine block hashes are derived from `(trace block id, sub-block)`: since trace ids identify
//! their whole prefix, so do these, like vLLM's chained hashes. A content (tokens-only) hash is
//! derived too, for indexes that key blocks by content (radix trees).

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use kv_core::mix64;
use kv_core::BlockHash;

use crate::lru::LruSet;
use crate::trace::MooncakeRequest;

/// Shape of the simulated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadShape {
    /// Tokens per trace block (512 for Mooncake).
    pub trace_block_tokens: u64,
    /// Tokens per engine block (vLLM's block size).
    pub engine_block_tokens: u64,
    /// Pods, round-robin.
    pub pods: u32,
    /// Engine blocks each pod's LRU holds.
    pub pod_capacity_blocks: usize,
}

impl Default for WorkloadShape {
    /// The benchmark: 512 -> 32 x 16 tokens, 16 pods of 65,536 blocks.
    fn default() -> Self {
        Self {
            trace_block_tokens: 512,
            engine_block_tokens: 16,
            pods: 16,
            pod_capacity_blocks: 65_536,
        }
    }
}

/// A `BlockStored` of the workload: `blocks` (a range of the store slab) after `parent`.
#[derive(Debug, Clone)]
pub struct StoreOp {
    /// The hash before the run, `None` at the prompt's start.
    pub parent: Option<BlockHash>,
    /// Range into [`IndexWorkload::stored`].
    pub blocks: Range<usize>,
}

/// One request's worth of index traffic, in order: query, stores, removals.
#[derive(Debug, Clone)]
pub struct Step {
    /// The pod the request was routed to.
    pub pod: u32,
    /// Range into [`IndexWorkload::queries`] (and `query_content`).
    pub query: Range<usize>,
    /// The runs the pod stored.
    pub stores: Vec<StoreOp>,
    /// Range into [`IndexWorkload::removed`]: what the pod's LRU evicted.
    pub removed: Range<usize>,
}

/// A prepared event/query stream (built once, driven against each backend).
#[derive(Debug, Clone, Default)]
pub struct IndexWorkload {
    /// Per request.
    pub steps: Vec<Step>,
    /// Query block hashes (sequence hashes), all requests concatenated.
    pub queries: Vec<BlockHash>,
    /// Content hashes parallel to `queries`.
    pub query_content: Vec<u64>,
    /// Stored block hashes, all runs concatenated.
    pub stored: Vec<BlockHash>,
    /// Content hashes parallel to `stored`.
    pub stored_content: Vec<u64>,
    /// Removed block hashes.
    pub removed: Vec<BlockHash>,
    /// Memberships held at the end (sum of the pods' LRU sizes).
    pub final_memberships: usize,
}

impl IndexWorkload {
    /// Simulates the fleet over `requests` (see the module docs).
    pub fn simulate(requests: &[MooncakeRequest], shape: WorkloadShape) -> Self {
        let sub = (shape.trace_block_tokens / shape.engine_block_tokens).max(1);
        let mut w = IndexWorkload::default();
        let mut lrus: Vec<LruSet<BlockHash>> = (0..shape.pods).map(|_| LruSet::new()).collect();
        let mut present = Vec::new();
        for (r, req) in requests.iter().enumerate() {
            let pod = (r % shape.pods as usize) as u32;
            let full = (req.input_length / shape.engine_block_tokens) as usize;
            let q0 = w.queries.len();
            'blocks: for &id in &req.hash_ids {
                for j in 0..sub {
                    if w.queries.len() - q0 == full {
                        break 'blocks;
                    }
                    let n = id * sub + j;
                    w.queries
                        .push(BlockHash::new(mix64(n.wrapping_add(0x5EED)) | 1));
                    w.query_content.push(mix64(n ^ 0xC0FF_EE00_0000_0000));
                }
            }
            let query = q0..w.queries.len();
            let lru = &mut lrus[pod as usize];
            present.clear();
            present.extend(w.queries[query.clone()].iter().map(|&h| lru.contains(h)));
            let mut stores = Vec::new();
            let mut i = 0;
            while i < present.len() {
                if present[i] {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < present.len() && !present[i] {
                    i += 1;
                }
                let s0 = w.stored.len();
                w.stored.extend_from_slice(&w.queries[q0 + start..q0 + i]);
                w.stored_content
                    .extend_from_slice(&w.query_content[q0 + start..q0 + i]);
                stores.push(StoreOp {
                    parent: start.checked_sub(1).map(|p| w.queries[q0 + p]),
                    blocks: s0..w.stored.len(),
                });
            }
            for &h in &w.queries[query.clone()] {
                lru.insert(h);
            }
            let r0 = w.removed.len();
            while lru.len() > shape.pod_capacity_blocks {
                match lru.pop_oldest() {
                    Some(h) => w.removed.push(h),
                    None => break,
                }
            }
            w.steps.push(Step {
                pod,
                query,
                stores,
                removed: r0..w.removed.len(),
            });
        }
        w.final_memberships = lrus.iter().map(LruSet::len).sum();
        w
    }

    /// Blocks queried, stored and removed.
    pub fn totals(&self) -> (usize, usize, usize) {
        (self.queries.len(), self.stored.len(), self.removed.len())
    }
}

/// An index under benchmark: ours, a peer's, or a baseline.
pub trait IndexBackend {
    /// A short name for reports.
    fn name(&self) -> &str;
    /// Queries the prompt; returns the best pod's matched blocks (a checksum across backends).
    /// `content` holds the blocks' content-only hashes, for indexes keyed by content.
    fn query(&mut self, hashes: &[BlockHash], content: &[u64]) -> u32;
    /// `pod` stored `hashes` after `parent`.
    fn store(&mut self, pod: u32, parent: Option<BlockHash>, hashes: &[BlockHash], content: &[u64]);
    /// `pod` evicted `hashes`.
    fn remove(&mut self, pod: u32, hashes: &[BlockHash]);
}

/// What one run of the benchmark measured.
#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    /// Backend name.
    pub backend: String,
    /// Blocks queried + stored + removed.
    pub block_ops: u64,
    /// Seconds spent in queries.
    pub query_seconds: f64,
    /// Seconds spent applying stores and removals.
    pub apply_seconds: f64,
    /// Per-query latencies, nanoseconds, sorted.
    pub query_ns: Vec<u64>,
    /// Sum of the best match per query (must agree across exact backends).
    pub checksum: u64,
}

impl BenchReport {
    /// Block operations per second of index time.
    pub fn block_ops_per_sec(&self) -> f64 {
        self.block_ops as f64 / (self.query_seconds + self.apply_seconds)
    }

    /// Nearest-rank percentile of query latency, microseconds.
    pub fn query_percentile_us(&self, p: f64) -> f64 {
        if self.query_ns.is_empty() {
            return 0.0;
        }
        let rank = ((p / 100.0) * self.query_ns.len() as f64).ceil() as usize;
        self.query_ns[rank.clamp(1, self.query_ns.len()) - 1] as f64 / 1e3
    }
}

/// Runs `workload` against `backend` on the calling thread, timing every query and apply.
pub fn drive(workload: &IndexWorkload, backend: &mut dyn IndexBackend) -> BenchReport {
    let mut report = BenchReport {
        backend: backend.name().to_owned(),
        query_ns: Vec::with_capacity(workload.steps.len()),
        ..Default::default()
    };
    let (q, s, r) = workload.totals();
    report.block_ops = (q + s + r) as u64;
    let mut apply_ns = 0u128;
    let mut query_total = 0u128;
    for step in &workload.steps {
        let t = Instant::now();
        let best = backend.query(
            &workload.queries[step.query.clone()],
            &workload.query_content[step.query.clone()],
        );
        let dt = t.elapsed().as_nanos();
        report.query_ns.push(dt as u64);
        query_total += dt;
        report.checksum += best as u64;
        let t = Instant::now();
        for op in &step.stores {
            backend.store(
                step.pod,
                op.parent,
                &workload.stored[op.blocks.clone()],
                &workload.stored_content[op.blocks.clone()],
            );
        }
        if !step.removed.is_empty() {
            backend.remove(step.pod, &workload.removed[step.removed.clone()]);
        }
        apply_ns += t.elapsed().as_nanos();
    }
    report.query_ns.sort_unstable();
    report.query_seconds = query_total as f64 / 1e9;
    report.apply_seconds = apply_ns as f64 / 1e9;
    report
}

/// kv-indexer's own index as a benchmark backend.
pub struct KvIndexerBackend {
    index: kv_core::ModelIndex,
    engines: Vec<kv_core::EngineId>,
    out: Vec<kv_core::EngineScore>,
    weights: kv_core::TierWeights,
}

impl KvIndexerBackend {
    /// An index for `pods` engines with the default capacity settings.
    pub fn new(pods: u32) -> Self {
        let index = kv_core::ModelIndex::new(kv_core::IndexConfig {
            max_keys: 1 << 26,
            pod_cache_size: 16,
        })
        .expect("benchmark config is valid");
        let engines = index.write(|w| {
            (0..pods)
                .filter_map(|p| w.engine(&kv_core::EngineKey::new(&format!("pod-{p}"), 0)))
                .collect()
        });
        Self {
            index,
            engines,
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
        "kv-indexer"
    }

    fn query(&mut self, hashes: &[BlockHash], _content: &[u64]) -> u32 {
        self.index
            .score_engines(hashes, None, &self.weights, &mut self.out);
        self.out.iter().map(|s| s.matched_blocks).max().unwrap_or(0)
    }

    fn store(
        &mut self,
        pod: u32,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        _content: &[u64],
    ) {
        let engine = self.engines[pod as usize];
        self.index.write(|w| {
            w.store(engine, kv_core::Tier::Gpu, parent, hashes);
        });
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        let engine = self.engines[pod as usize];
        self.index.write(|w| {
            w.remove(engine, kv_core::Tier::Gpu, hashes);
        });
    }
}

/// The baseline every design is compared with: a flat hash map from block hash to holders,
/// probed block by block.
#[derive(Default)]
pub struct FlatMapBackend {
    map: HashMap<BlockHash, Vec<u32>>,
    active: Vec<u32>,
}

impl IndexBackend for FlatMapBackend {
    fn name(&self) -> &str {
        "flat-hashmap"
    }

    fn query(&mut self, hashes: &[BlockHash], _content: &[u64]) -> u32 {
        let Some(first) = hashes.first().and_then(|h| self.map.get(h)) else {
            return 0;
        };
        self.active.clear();
        self.active.extend_from_slice(first);
        let mut depth = 1;
        for h in &hashes[1..] {
            let Some(holders) = self.map.get(h) else {
                break;
            };
            self.active.retain(|p| holders.contains(p));
            if self.active.is_empty() {
                break;
            }
            depth += 1;
        }
        depth
    }

    fn store(
        &mut self,
        pod: u32,
        _parent: Option<BlockHash>,
        hashes: &[BlockHash],
        _content: &[u64],
    ) {
        for h in hashes {
            let holders = self.map.entry(*h).or_default();
            if !holders.contains(&pod) {
                holders.push(pod);
            }
        }
    }

    fn remove(&mut self, pod: u32, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(holders) = self.map.get_mut(h) {
                holders.retain(|p| *p != pod);
                if holders.is_empty() {
                    self.map.remove(h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], input: u64) -> MooncakeRequest {
        MooncakeRequest {
            timestamp: 0,
            input_length: input,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn simulation_stores_missing_runs_and_evicts_lru() {
        let shape = WorkloadShape {
            trace_block_tokens: 32,
            engine_block_tokens: 16,
            pods: 1,
            pod_capacity_blocks: 6,
        };
        // 2 trace blocks = 4 engine blocks; the second request shares the first trace block.
        let w = IndexWorkload::simulate(&[req(&[0, 1], 64), req(&[0, 2], 60)], shape);
        assert_eq!(w.steps[0].stores.len(), 1);
        assert_eq!(w.steps[0].stores[0].parent, None);
        assert_eq!(w.steps[1].query.len(), 3, "60 tokens = 3 full blocks");
        let second = &w.steps[1].stores;
        assert_eq!(second.len(), 1);
        assert_eq!(
            second[0].parent,
            Some(w.queries[1]),
            "continues after the shared prefix"
        );
        assert_eq!(second[0].blocks.len(), 1);
        assert_eq!(w.steps[1].removed.len(), 0);
        assert_eq!(w.final_memberships, 5);
    }

    #[test]
    fn the_flat_map_and_kv_indexer_agree_on_a_small_trace() {
        let reqs: Vec<_> = (0..200u64)
            .map(|i| req(&[0, 1 + i % 7, 100 + i], 96))
            .collect();
        let shape = WorkloadShape {
            trace_block_tokens: 32,
            engine_block_tokens: 16,
            pods: 3,
            pod_capacity_blocks: 10,
        };
        let w = IndexWorkload::simulate(&reqs, shape);
        let a = drive(&w, &mut FlatMapBackend::default());
        let b = drive(&w, &mut KvIndexerBackend::new(3));
        assert!(a.checksum > 0);
        assert_eq!(a.checksum, b.checksum);
    }
}
