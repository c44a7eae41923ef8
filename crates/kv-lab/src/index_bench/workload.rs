//! The index benchmark's stream: a Mooncake trace turned into what an index sees in a fleet of
//! vLLM pods ([`IndexWorkload::simulate`]).
//!
//! Every 512-token trace block is expanded to engine blocks (32 of 16 tokens), a request is cut
//! to its full engine blocks, requests go round-robin to pods, and each pod keeps its cached
//! blocks in the order vLLM's free queue would evict them. Per request, in the order vLLM's
//! scheduler step emits them: the query (the router asks before the request runs), the
//! evictions the request's new blocks force (`BlockRemoved`), then the missing blocks stored as
//! runs after their parent (`BlockStored`).
//!
//! Eviction order ([`Eviction`]): vLLM's `KVCacheManager.free` hands a finished request's blocks
//! to the free queue last block first, and the queue evicts from its front, so a pod loses a
//! request's *tail* first and keeps prefixes (the default, [`Eviction::TailFirst`]). The blocks a
//! request hits are in use while it runs, so its own allocation never evicts them. Head-first
//! ([`Eviction::HeadFirst`]) is what this benchmark did before 2026-11-27: pods then hold tails
//! without their prefixes, and an index that splits at holes pays for it; it stays as a
//! labelled stress fleet, not as the fleet figures are quoted on.
//!
//! Engine block hashes are derived from `(trace block id, sub-block)`: since trace ids identify
//! their whole prefix, so do these, like vLLM's chained hashes. A content (tokens-only) hash is
//! derived too, for indexes that key blocks by content (radix trees). With `loops > 1` the trace
//! is replayed again after itself with its block ids moved to a fresh range (new conversations
//! on pods that are already full), so a run is long enough for a steady state.

use std::ops::Range;

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
    /// Engine blocks each pod's cache holds.
    pub pod_capacity_blocks: usize,
    /// Engine blocks of a system prompt put before every request (0: none), so every pod that
    /// serves a request holds them: the many-holders case.
    pub shared_prefix_blocks: u64,
    /// How evictions reach the index.
    pub removals: Removals,
    /// Which of a request's blocks a pod evicts first.
    pub eviction: Eviction,
    /// Passes over the trace (each after the last, with fresh block ids); at least 1.
    pub loops: u32,
}

/// How a pod's evictions are sent to the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Removals {
    /// One call per request with everything its allocation evicted, in eviction order.
    #[default]
    Batched,
    /// One hash per call, in eviction order: vLLM sends one `BlockRemoved` per evicted block.
    OnePerEvent,
    /// One hash per call in a shuffled order: holes anywhere in a chain.
    Shuffled,
}

/// Which of a cached request's blocks a pod evicts first (among requests, the least recently
/// used goes first either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Eviction {
    /// The last block first, as vLLM's free queue orders a finished request's blocks: pods
    /// keep prefixes.
    #[default]
    TailFirst,
    /// Block 0 first (the benchmark's order before 2026-11-27): pods keep tails without their
    /// prefixes, so the index sees holes in every evicted chain. A stress case only.
    HeadFirst,
}

impl Default for WorkloadShape {
    /// The benchmark: 512 -> 32 x 16 tokens, 16 pods of 65,536 blocks, one pass.
    fn default() -> Self {
        Self {
            trace_block_tokens: 512,
            engine_block_tokens: 16,
            pods: 16,
            pod_capacity_blocks: 65_536,
            shared_prefix_blocks: 0,
            removals: Removals::Batched,
            eviction: Eviction::TailFirst,
            loops: 1,
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

/// One request's worth of index traffic, in order: query, removals, stores.
#[derive(Debug, Clone)]
pub struct Step {
    /// The pod the request was routed to.
    pub pod: u32,
    /// Range into [`IndexWorkload::queries`] (and `query_content`).
    pub query: Range<usize>,
    /// Range into [`IndexWorkload::removed`]: what the request's allocation evicted.
    pub removed: Range<usize>,
    /// The runs the pod stored.
    pub stores: Vec<StoreOp>,
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
    /// Memberships held at the end (sum of the pods' cache sizes).
    pub final_memberships: usize,
    /// How removals are sent ([`Removals`]; `removed` is already in the order they go in).
    pub removals: Removals,
}

impl IndexWorkload {
    /// Simulates the fleet over `requests` (see the module docs).
    pub fn simulate(requests: &[MooncakeRequest], shape: WorkloadShape) -> Self {
        let mut w = IndexWorkload {
            removals: shape.removals,
            ..Default::default()
        };
        let mut pods: Vec<Cache> = (0..shape.pods)
            .map(|_| LruSet::with_hasher(MixedKeys))
            .collect();
        let mut shuffle = kv_core::SplitMix64::new(0x5407_F1ED);
        // Each pass's ids start past every id of the trace.
        let span = requests
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .max()
            .map_or(0, |m| m + 1);
        let mut r = 0usize;
        for pass in 0..u64::from(shape.loops.max(1)) {
            for req in requests {
                let pod = (r % shape.pods as usize) as u32;
                r += 1;
                let query = w.push_query(req, pass * span, shape);
                let cache = &mut pods[pod as usize];
                let r0 = w.removed.len();
                let (stores, missing) = w.missing_runs(query.clone(), cache);
                evict_for(cache, missing, shape.pod_capacity_blocks, &mut w.removed);
                let prompt = &w.queries[query.clone()];
                match shape.eviction {
                    // The request ends: its blocks go to the free queue last block first.
                    Eviction::TailFirst => prompt.iter().rev().for_each(|&h| cache.insert(h)),
                    Eviction::HeadFirst => prompt.iter().for_each(|&h| cache.insert(h)),
                }
                if shape.removals == Removals::Shuffled {
                    let evicted = &mut w.removed[r0..];
                    for i in (1..evicted.len()).rev() {
                        evicted.swap(i, (shuffle.next_u64() % (i as u64 + 1)) as usize);
                    }
                }
                w.steps.push(Step {
                    pod,
                    query,
                    removed: r0..w.removed.len(),
                    stores,
                });
            }
        }
        w.final_memberships = pods.iter().map(LruSet::len).sum();
        w
    }

    /// Appends `req`'s engine blocks (after the system prompt) to the query slabs, block ids
    /// moved by `offset`; returns their range.
    fn push_query(
        &mut self,
        req: &MooncakeRequest,
        offset: u64,
        shape: WorkloadShape,
    ) -> Range<usize> {
        let sub = (shape.trace_block_tokens / shape.engine_block_tokens).max(1);
        let full =
            (shape.shared_prefix_blocks + req.input_length / shape.engine_block_tokens) as usize;
        let q0 = self.queries.len();
        for j in 0..shape.shared_prefix_blocks.min(full as u64) {
            // The system prompt: its own hash space (high bit set), chained like the rest.
            self.queries
                .push(BlockHash::new(mix64(j ^ 0x5157_E000) | 1 << 63));
            self.query_content.push(mix64(j ^ 0x5157_E001));
        }
        'blocks: for &id in &req.hash_ids {
            for j in 0..sub {
                if self.queries.len() - q0 == full {
                    break 'blocks;
                }
                let n = (id + offset) * sub + j;
                self.queries
                    .push(BlockHash::new(mix64(n.wrapping_add(0x5EED)) | 1));
                self.query_content.push(mix64(n ^ 0xC0FF_EE00_0000_0000));
            }
        }
        q0..self.queries.len()
    }

    /// The runs of the prompt at `query` that `cache` lacks, appended to the store slabs with
    /// their parents; also their block count. The blocks the pod holds are touched: the
    /// request uses them, so its allocation cannot evict them.
    fn missing_runs(&mut self, query: Range<usize>, cache: &mut Cache) -> (Vec<StoreOp>, usize) {
        let mut stores = Vec::new();
        let mut missing = 0;
        let mut i = query.start;
        while i < query.end {
            if cache.touch(self.queries[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < query.end && !cache.contains(self.queries[i]) {
                i += 1;
            }
            let s0 = self.stored.len();
            self.stored.extend_from_slice(&self.queries[start..i]);
            self.stored_content
                .extend_from_slice(&self.query_content[start..i]);
            stores.push(StoreOp {
                parent: (start > query.start).then(|| self.queries[start - 1]),
                blocks: s0..self.stored.len(),
            });
            missing += i - start;
        }
        (stores, missing)
    }

    /// Blocks queried, stored and removed.
    pub fn totals(&self) -> (usize, usize, usize) {
        (self.queries.len(), self.stored.len(), self.removed.len())
    }

    /// The removal calls of `step`, as ranges of [`IndexWorkload::removed`]: one for the
    /// whole step when [`Removals::Batched`] (none when it evicted nothing), else one per hash.
    /// [`drive`](super::drive) and backends that prepare their input both follow it.
    pub fn removal_calls(&self, step: &Step) -> impl Iterator<Item = Range<usize>> {
        let range = step.removed.clone();
        let batched = self.removals == Removals::Batched;
        let calls = if batched {
            usize::from(!range.is_empty())
        } else {
            range.len()
        };
        (0..calls).map(move |k| match batched {
            true => range.clone(),
            false => range.start + k..range.start + k + 1,
        })
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

/// A pod's cached blocks, least recently used first.
type Cache = LruSet<BlockHash, MixedKeys>;

/// Hashes block hashes for the pods' caches: they are already mixed, so one multiply and a
/// shift spread them (their low bit is always set; the shift brings high bits down). Building a
/// 1,024-pod stream with the default SipHash took most of a child's start-up.
#[derive(Debug, Clone, Copy, Default)]
struct MixedKeys;

impl std::hash::BuildHasher for MixedKeys {
    type Hasher = MixedKeyHasher;

    fn build_hasher(&self) -> MixedKeyHasher {
        MixedKeyHasher(0)
    }
}

/// See [`MixedKeys`].
#[derive(Debug, Default)]
struct MixedKeyHasher(u64);

impl std::hash::Hasher for MixedKeyHasher {
    fn finish(&self) -> u64 {
        let y = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        y ^ (y >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// Evicts from `cache` (least recently used first) until `incoming` more blocks fit within
/// `capacity`, appending what goes to `removed`.
fn evict_for(cache: &mut Cache, incoming: usize, capacity: usize, removed: &mut Vec<BlockHash>) {
    while cache.len() + incoming > capacity {
        match cache.pop_oldest() {
            Some(h) => removed.push(h),
            None => break,
        }
    }
}
