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

use std::ops::Range;

use std::time::Instant;

use kv_core::mix64;
use kv_core::BlockHash;

mod backends;

pub use backends::{IndexerFacadeBackend, KvIndexerBackend, ReferenceBackend, RunIndexBackend};

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
    /// Engine blocks of a system prompt put before every request (0: none), so every pod that
    /// serves a request holds them: the many-holders case.
    pub shared_prefix_blocks: u64,
    /// How evictions reach the index.
    pub removals: Removals,
}

/// How a pod's evictions are sent to the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Removals {
    /// One call per request with everything its LRU evicted, oldest first.
    #[default]
    Batched,
    /// One hash per call, each evicted batch tail first: vLLM sends one `BlockRemoved` per
    /// evicted block, and its free queue hands out a finished request's blocks last block
    /// first.
    OnePerEvent,
    /// One hash per call in a shuffled order: holes anywhere in a chain.
    Shuffled,
}

impl Default for WorkloadShape {
    /// The benchmark: 512 -> 32 x 16 tokens, 16 pods of 65,536 blocks.
    fn default() -> Self {
        Self {
            trace_block_tokens: 512,
            engine_block_tokens: 16,
            pods: 16,
            pod_capacity_blocks: 65_536,
            shared_prefix_blocks: 0,
            removals: Removals::Batched,
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
    /// Removed block hashes, each step's in the order the backend is sent them ([`Removals`]).
    pub removed: Vec<BlockHash>,
    /// Memberships held at the end (sum of the pods' LRU sizes).
    pub final_memberships: usize,
    /// How removals are sent ([`Removals`]; `removed` is already in the order they go in).
    pub removals: Removals,
}

impl IndexWorkload {
    /// Simulates the fleet over `requests` (see the module docs).
    pub fn simulate(requests: &[MooncakeRequest], shape: WorkloadShape) -> Self {
        let sub = (shape.trace_block_tokens / shape.engine_block_tokens).max(1);
        let mut w = IndexWorkload {
            removals: shape.removals,
            ..Default::default()
        };
        let mut shuffle = kv_core::SplitMix64::new(0x5407_F1ED);
        let mut lrus: Vec<LruSet<BlockHash>> = (0..shape.pods).map(|_| LruSet::new()).collect();
        let mut present = Vec::new();
        for (r, req) in requests.iter().enumerate() {
            let pod = (r % shape.pods as usize) as u32;
            let full = (shape.shared_prefix_blocks + req.input_length / shape.engine_block_tokens)
                as usize;
            let q0 = w.queries.len();
            for j in 0..shape.shared_prefix_blocks.min(full as u64) {
                // The system prompt: its own hash space (high bit set), chained like the rest.
                w.queries
                    .push(BlockHash::new(mix64(j ^ 0x5157_E000) | 1 << 63));
                w.query_content.push(mix64(j ^ 0x5157_E001));
            }
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
            let evicted = &mut w.removed[r0..];
            match shape.removals {
                Removals::Batched => {}
                Removals::OnePerEvent => evicted.reverse(),
                Removals::Shuffled => {
                    for i in (1..evicted.len()).rev() {
                        evicted.swap(i, (shuffle.next_u64() % (i as u64 + 1)) as usize);
                    }
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

    /// One line describing the stream (for benchmark reports).
    pub fn summary(&self) -> String {
        let (q, s, r) = self.totals();
        format!(
            "{} requests, {:.2}M blocks stored, {:.2}M removed, {:.2}M queried (avg query depth {:.0}), {} final memberships",
            self.steps.len(),
            s as f64 / 1e6,
            r as f64 / 1e6,
            q as f64 / 1e6,
            q as f64 / self.steps.len().max(1) as f64,
            self.final_memberships,
        )
    }
}

/// What a query found, reduced to numbers every backend can produce: the best pod's matched
/// blocks, and an order-independent digest of every (pod, matched blocks) pair with at least one
/// block, so two backends agree only if they report the same depth for the same pods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueryAnswer {
    /// The best pod's consecutive matched blocks.
    pub best: u32,
    /// Pods with at least one matched block.
    pub holders: u32,
    /// Wrapping sum of `mix64(pod << 32 | matched)` over those pods.
    pub digest: u64,
}

impl QueryAnswer {
    /// Adds one pod's result (pods with 0 blocks are ignored, as the digest defines).
    pub fn add(&mut self, pod: u32, matched: u32) {
        if matched == 0 {
            return;
        }
        self.best = self.best.max(matched);
        self.holders += 1;
        self.digest = self
            .digest
            .wrapping_add(mix64((pod as u64) << 32 | matched as u64));
    }
}

/// An index under benchmark: ours, a peer's, or a baseline.
pub trait IndexBackend {
    /// A short name for reports.
    fn name(&self) -> &str;
    /// Queries the prompt; returns what every pod matched (see [`QueryAnswer`]). `content`
    /// holds the blocks' content-only hashes, for indexes keyed by content.
    fn query(&mut self, hashes: &[BlockHash], content: &[u64]) -> QueryAnswer;
    /// `pod` stored `hashes` after `parent`.
    fn store(&mut self, pod: u32, parent: Option<BlockHash>, hashes: &[BlockHash], content: &[u64]);
    /// `pod` evicted `hashes`.
    fn remove(&mut self, pod: u32, hashes: &[BlockHash]);
    /// The backend's own shape figures after a run (runs, splits), for the report.
    fn shape(&self) -> Option<String> {
        None
    }
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
    /// Every query's answer, in order (compared with a reference by [`BenchReport::mismatches`]).
    pub answers: Vec<QueryAnswer>,
}

impl BenchReport {
    /// Block operations per second of index time.
    pub fn block_ops_per_sec(&self) -> f64 {
        self.block_ops as f64 / (self.query_seconds + self.apply_seconds)
    }

    /// Queries whose answer differs from `reference`'s (0 for an exact index against the
    /// reference).
    pub fn mismatches(&self, reference: &BenchReport) -> usize {
        self.answers
            .iter()
            .zip(&reference.answers)
            .filter(|(a, b)| a != b)
            .count()
            + self.answers.len().abs_diff(reference.answers.len())
    }

    /// Queries answered with fewer holders than `reference` found (a bounded index
    /// under-counting).
    pub fn short_answers(&self, reference: &BenchReport) -> usize {
        self.answers
            .iter()
            .zip(&reference.answers)
            .filter(|(a, b)| a.holders < b.holders)
            .count()
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
        answers: Vec::with_capacity(workload.steps.len()),
        ..Default::default()
    };
    let (q, s, r) = workload.totals();
    report.block_ops = (q + s + r) as u64;
    let mut apply_ns = 0u128;
    let mut query_total = 0u128;
    for step in &workload.steps {
        let t = Instant::now();
        let answer = backend.query(
            &workload.queries[step.query.clone()],
            &workload.query_content[step.query.clone()],
        );
        let dt = t.elapsed().as_nanos();
        report.query_ns.push(dt as u64);
        query_total += dt;
        report.checksum += answer.best as u64;
        report.answers.push(answer);
        let t = Instant::now();
        for op in &step.stores {
            backend.store(
                step.pod,
                op.parent,
                &workload.stored[op.blocks.clone()],
                &workload.stored_content[op.blocks.clone()],
            );
        }
        let removed = &workload.removed[step.removed.clone()];
        if workload.removals == Removals::Batched {
            if !removed.is_empty() {
                backend.remove(step.pod, removed);
            }
        } else {
            for h in removed {
                backend.remove(step.pod, std::slice::from_ref(h));
            }
        }
        apply_ns += t.elapsed().as_nanos();
    }
    report.query_ns.sort_unstable();
    report.query_seconds = query_total as f64 / 1e9;
    report.apply_seconds = apply_ns as f64 / 1e9;
    report
}

/// The median of `values` (the upper one of an even count; 0 when empty): benchmarks report
/// medians of their rounds.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// What [`apply_in_lanes`] measured.
#[derive(Debug, Clone, Copy)]
pub struct LaneRun {
    /// Stored plus removed blocks per second of wall time.
    pub apply_blocks_per_sec: f64,
    /// Blocks applied by the busiest thread over all blocks (1/threads when even).
    pub busiest_share: f64,
}

/// Applies the workload's stores and removals (no queries), in trace order per pod, to an
/// exact index with `lanes` writer lanes from `threads` threads: thread `t` applies the events
/// of the engines with `id % threads == t`, so with `threads == lanes` each thread writes one
/// lane and never waits for another.
pub fn apply_in_lanes(
    workload: &IndexWorkload,
    pods: u32,
    lanes: usize,
    threads: usize,
) -> LaneRun {
    let backend = KvIndexerBackend::with_config(
        pods,
        kv_core::IndexConfig {
            max_keys: 1 << 26,
            writer_lanes: lanes,
            ..Default::default()
        },
    );
    let index = &backend.index;
    let engines = &backend.engines;
    let threads = threads.max(1);
    let mut per_thread = vec![0usize; threads];
    for step in &workload.steps {
        let t = engines[step.pod as usize] as usize % threads;
        per_thread[t] +=
            step.stores.iter().map(|op| op.blocks.len()).sum::<usize>() + step.removed.len();
    }
    let total: usize = per_thread.iter().sum();
    let start = std::sync::Barrier::new(threads);
    let t0 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for step in &workload.steps {
                        let engine = engines[step.pod as usize];
                        if engine as usize % threads != t {
                            continue;
                        }
                        index.write(engine, |w| {
                            for op in &step.stores {
                                w.store(
                                    engine,
                                    kv_core::Tier::Gpu,
                                    op.parent,
                                    &workload.stored[op.blocks.clone()],
                                );
                            }
                            w.remove(
                                engine,
                                kv_core::Tier::Gpu,
                                &workload.removed[step.removed.clone()],
                            );
                        });
                    }
                    t0
                })
            })
            .collect();
        let starts: Vec<Instant> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
        starts.into_iter().min()
    });
    let seconds = t0.map_or(f64::INFINITY, |t| t.elapsed().as_secs_f64());
    LaneRun {
        apply_blocks_per_sec: total as f64 / seconds,
        busiest_share: per_thread.iter().copied().max().unwrap_or(0) as f64 / total.max(1) as f64,
    }
}

#[cfg(test)]
mod tests;
