//! The block index: for every (model, block hash), the engines that hold the block and in which
//! tier; and the prefix scoring walk over it.
//!
//! Shape (per model, [`ModelIndex`]):
//! - a **node** per distinct block (24 bytes: hash, two member words with overflow pages beyond,
//!   a hint to the block's most recently stored child), in a chunked slab; a stored run gets
//!   consecutive node ids where free ids allow (freed ids are kept as ranges), so a chain is
//!   mostly contiguous in memory;
//! - a **table** from block hash to node (8-byte key-less slots, open addressing, sized to 1.5x
//!   its live entries), published to readers through `ArcSwap` so a rebuild never blocks them;
//! - per engine, a **reverse list** of the nodes it holds (4 bytes per membership, compacted
//!   lazily), so clearing an engine costs O(its blocks), not O(index).
//!
//! Reads ([`ModelIndex::score_engines`], [`ModelIndex::lookup`]) take no lock and write nothing
//! shared: they pin the current table, then walk the prompt's hashes. Consecutive blocks of a
//! chain are found through the parent's child hint (one compare) and only fall back to a table
//! probe when the chain branches, so a 700-block prompt costs a few probes, not 700. Each node
//! is read under its seqlock, so a reader sees each block's member list as of one moment.
//!
//! Writes go through one writer per model ([`ModelIndex::write`]), which callers hold for a
//! whole event batch; different models write in parallel.
//!
//! Decisions:
//! - a `BlockStored` run whose parent this engine does not hold ("orphan") is stored anyway,
//!   keyed by its hashes, and counted: since a vLLM hash commits to its whole prefix, an orphan
//!   can never be mistaken for position 0 of another prompt; it only starts to score once its
//!   parent's chain arrives (e.g. by replay), which is exactly right;
//! - `podCacheSize` full: the oldest member of the block is dropped (members keep store order);
//! - `size` full: a CLOCK hand over the nodes evicts a block not stored recently (second
//!   chance), with all its memberships; counted as capacity evictions.
//!
//! Memory per block: 24 bytes (node) + 8 / load-factor bytes (table, load 0.67-0.85) + 4 bytes
//! per membership (reverse list; up to 1.25x before compaction) + 1 bit (CLOCK).

mod memory;
mod slab;
mod table;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use thiserror::Error;

use crate::events::Medium;
pub use slab::MAX_MEMBERS;
use slab::{NodeRead, SetPool, Slab, NO_WORDS};
use table::Table;

/// Dense per-model id of an engine (one vLLM process: a pod and its data-parallel rank).
pub type EngineId = u32;

/// The most engines per model (a member is `engine << 8 | tier` with bit 31 reserved).
pub const MAX_ENGINES: usize = (1 << 23) - 1;

/// Who published: the pod (topic's `<pod>` part, or a configured id) and its DP rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineKey {
    /// The pod identifier as the gateway names it (`ip` or `ip:port`).
    pub pod: Arc<str>,
    /// The vLLM data-parallel rank inside the pod (0 without DP).
    pub dp_rank: u32,
}

impl EngineKey {
    /// A key for `pod` at `dp_rank`.
    pub fn new(pod: &str, dp_rank: u32) -> Self {
        Self {
            pod: pod.into(),
            dp_rank,
        }
    }
}

/// Where a block copy lives; scoring weighs tiers differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// GPU memory: a hit is a free prefill.
    Gpu = 0,
    /// CPU offload: a hit costs a transfer.
    Cpu = 1,
    /// Disk / remote storage offload.
    Storage = 2,
    /// Any other medium a connector names.
    Other = 3,
}

impl Tier {
    /// The tier of an event's medium; no medium (vLLM < 0.10.2) means GPU.
    pub fn from_medium(medium: Option<&Medium>) -> Self {
        match medium {
            None | Some(Medium::Gpu) => Tier::Gpu,
            Some(Medium::Cpu) => Tier::Cpu,
            Some(Medium::Storage) => Tier::Storage,
            Some(Medium::Other(_)) => Tier::Other,
        }
    }

    fn from_bits(bits: u32) -> Self {
        match bits & 0xff {
            0 => Tier::Gpu,
            1 => Tier::Cpu,
            2 => Tier::Storage,
            _ => Tier::Other,
        }
    }

    /// The lower-case name used in config and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
            Tier::Other => "other",
        }
    }
}

/// Per-tier weights of a matched block in a pod's score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierWeights(pub [f64; 4]);

impl Default for TierWeights {
    fn default() -> Self {
        Self([1.0, 0.8, 0.6, 0.5])
    }
}

impl TierWeights {
    /// The weight of `tier`.
    #[inline(always)]
    pub fn of(&self, tier: Tier) -> f64 {
        self.0[tier as usize]
    }
}

/// Capacity settings (the `kvBlockIndexConfig.inMemoryConfig` of the config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most distinct block keys per model (`size`).
    pub max_keys: usize,
    /// Most engines per key (`podCacheSize`).
    pub pod_cache_size: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_keys: 100_000_000,
            pod_cache_size: 10,
        }
    }
}

/// Invalid index settings.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexConfigError {
    /// `size` out of range.
    #[error("size must be between 1 and {max}, got {got}")]
    Size {
        /// The configured value.
        got: usize,
        /// The largest supported.
        max: usize,
    },
    /// `podCacheSize` out of range.
    #[error("podCacheSize must be between 1 and {max}, got {got}")]
    PodCacheSize {
        /// The configured value.
        got: usize,
        /// The largest supported.
        max: usize,
    },
}

impl IndexConfig {
    /// Checks the ranges the data structure supports.
    pub fn validate(&self) -> Result<(), IndexConfigError> {
        let max_keys = (u32::MAX - 2) as usize;
        if self.max_keys == 0 || self.max_keys > max_keys {
            return Err(IndexConfigError::Size {
                got: self.max_keys,
                max: max_keys,
            });
        }
        if self.pod_cache_size == 0 || self.pod_cache_size > MAX_MEMBERS {
            return Err(IndexConfigError::PodCacheSize {
                got: self.pod_cache_size,
                max: MAX_MEMBERS,
            });
        }
        Ok(())
    }
}

/// A pod's result for one prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineScore {
    /// Who.
    pub engine: EngineId,
    /// Consecutive prompt blocks from block 0 the engine holds.
    pub matched_blocks: u32,
    /// Those blocks' tier weights, summed.
    pub score: f64,
}

/// The writer's running totals; published to [`Counters`] when each write ends.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    keys: u64,
    memberships: u64,
    admissions: u64,
    removals: u64,
    capacity_evictions: u64,
    pod_cache_evictions: u64,
    orphan_runs: u64,
    dropped_full: u64,
}

/// Counters, readable at any time without the writer (as of the last finished write).
#[derive(Debug, Default)]
struct Counters {
    keys: AtomicU64,
    memberships: AtomicU64,
    admissions: AtomicU64,
    removals: AtomicU64,
    capacity_evictions: AtomicU64,
    pod_cache_evictions: AtomicU64,
    orphan_runs: AtomicU64,
    dropped_full: AtomicU64,
}

/// A snapshot of a model index's size and activity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block keys.
    pub keys: u64,
    /// (block, engine, tier) memberships.
    pub memberships: u64,
    /// Memberships added by stores.
    pub admissions: u64,
    /// Memberships removed by `BlockRemoved`, clears and engine removal.
    pub removals: u64,
    /// Memberships dropped because the index reached `size`.
    pub capacity_evictions: u64,
    /// Memberships dropped because a block reached `podCacheSize`.
    pub pod_cache_evictions: u64,
    /// Stored runs whose parent the engine did not hold.
    pub orphan_runs: u64,
    /// Blocks not stored because no node could be allocated (never with a sane `size`).
    pub dropped_full: u64,
    /// Bytes held by the index's structures.
    pub memory_bytes: u64,
}

/// The readers' map of engines: pods by name, and each engine's key.
#[derive(Debug, Default, Clone)]
pub struct EngineDirectory {
    by_pod: HashMap<Arc<str>, Vec<EngineId>>,
    keys: Vec<Option<EngineKey>>,
}

impl EngineDirectory {
    /// The engines (DP ranks) of a pod.
    pub fn engines_of(&self, pod: &str) -> &[EngineId] {
        self.by_pod.get(pod).map_or(&[], Vec::as_slice)
    }

    /// The key of an engine id.
    pub fn key(&self, engine: EngineId) -> Option<&EngineKey> {
        self.keys.get(engine as usize).and_then(Option::as_ref)
    }

    /// Every pod known to the index.
    pub fn pods(&self) -> impl Iterator<Item = &Arc<str>> {
        self.by_pod.keys()
    }
}

struct EngineState {
    key: EngineKey,
    /// Node ids this engine was given memberships on; may hold stale or duplicate ids (checked
    /// against the node when used, compacted when it grows past twice `live`).
    blocks: Vec<u32>,
    /// Memberships the engine holds now.
    live: u64,
}

/// The writer's state: everything readers never look at.
struct Writer {
    table: Arc<Table>,
    /// Live entries plus tombstones in `table`.
    table_used: usize,
    table_live: usize,
    /// Freed node ids as `(start, len)` ranges, reused from the last one, so a run of new blocks
    /// gets consecutive ids.
    free_ranges: Vec<(u32, u32)>,
    next_node: u32,
    /// Interned member sets of nodes with more than two members.
    sets: SetPool,
    engines: Vec<Option<EngineState>>,
    free_engine_ids: Vec<EngineId>,
    engine_ids: HashMap<EngineKey, EngineId>,
    /// CLOCK reference bits, one per node id.
    referenced: Vec<u64>,
    /// Scratch bitset over node ids for reverse-list compaction.
    seen: Vec<u64>,
    /// Bit `id`: node `id`'s block is the chain child of node `id - 1`'s (known from a stored
    /// run); the continuation bit also needs equal member words.
    linked: Vec<u64>,
    /// Running totals (plain integers: the hot path does no atomic read-modify-write).
    tally: Tally,
    clock_hand: u32,
}

/// The index for one model.
pub struct ModelIndex {
    config: IndexConfig,
    /// Mixes block hashes into table positions (random per index).
    seed: u64,
    slab: Slab,
    table: ArcSwap<Table>,
    directory: ArcSwap<EngineDirectory>,
    writer: Mutex<Writer>,
    counters: Counters,
}

/// Maps the one hash value the slab reserves (0 = free node) to another value; a real block
/// hash is 0 with probability 2^-64, and would merely share a key with this alias.
#[inline(always)]
fn key(hash: u64) -> u64 {
    if hash == 0 {
        0x9E37_79B9_7F4A_7C15
    } else {
        hash
    }
}

#[inline(always)]
fn member(engine: EngineId, tier: Tier) -> u32 {
    engine << 8 | tier as u32
}

const INITIAL_TABLE: usize = 1024;

impl ModelIndex {
    /// An empty index. `config` must be valid ([`IndexConfig::validate`]).
    pub fn new(config: IndexConfig) -> Result<Self, IndexConfigError> {
        config.validate()?;
        let seed = random_seed();
        let table = Arc::new(Table::with_capacity(INITIAL_TABLE, seed));
        Ok(Self {
            seed,
            slab: Slab::new(config.max_keys),
            table: ArcSwap::new(table.clone()),
            directory: ArcSwap::from_pointee(EngineDirectory::default()),
            writer: Mutex::new(Writer {
                table,
                table_used: 0,
                table_live: 0,
                free_ranges: Vec::new(),
                next_node: 0,
                sets: SetPool::default(),
                engines: Vec::new(),
                free_engine_ids: Vec::new(),
                engine_ids: HashMap::new(),
                referenced: Vec::new(),
                seen: Vec::new(),
                linked: Vec::new(),
                tally: Tally::default(),
                clock_hand: 0,
            }),
            counters: Counters::default(),
            config,
        })
    }

    /// The capacity settings.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Runs `f` as the model's single writer (hold it for a whole event batch).
    pub fn write<R>(&self, f: impl FnOnce(&mut IndexWriter<'_>) -> R) -> R {
        let mut guard = self.writer.lock();
        let result = f(&mut IndexWriter {
            index: self,
            state: &mut guard,
        });
        let t = guard.tally;
        let c = &self.counters;
        for (counter, value) in [
            (&c.keys, t.keys),
            (&c.memberships, t.memberships),
            (&c.admissions, t.admissions),
            (&c.removals, t.removals),
            (&c.capacity_evictions, t.capacity_evictions),
            (&c.pod_cache_evictions, t.pod_cache_evictions),
            (&c.orphan_runs, t.orphan_runs),
            (&c.dropped_full, t.dropped_full),
        ] {
            counter.store(value, Ordering::Relaxed);
        }
        result
    }

    /// The engines known now (readers; lock-free).
    pub fn directory(&self) -> Arc<EngineDirectory> {
        self.directory.load_full()
    }

    /// Who holds `hash` right now, as (engine, tier) pairs in store order.
    pub fn lookup(&self, hash: u64) -> Vec<(EngineId, Tier)> {
        let hash = key(hash);
        let table = self.table.load();
        let mut buf = [0u32; MAX_MEMBERS];
        let n = table
            .find(hash, |id| self.slab.peek_hash(id))
            .and_then(|id| self.slab.read_members(id, hash, &mut buf))
            .unwrap_or(0);
        buf[..n]
            .iter()
            .map(|&m| (m >> 8, Tier::from_bits(m)))
            .collect()
    }

    /// Scores every engine that holds the prompt's first block: how many consecutive blocks
    /// from block 0 it holds, and their tier-weighted sum. `candidates` (sorted), when given,
    /// restricts the result to those engines. Engines holding nothing are not listed.
    ///
    /// Lock-free; allocates nothing but `out`'s growth.
    pub fn score_engines(
        &self,
        hashes: &[u64],
        candidates: Option<&[EngineId]>,
        weights: &TierWeights,
        out: &mut Vec<EngineScore>,
    ) {
        out.clear();
        let table = self.table.load();
        let slab = &self.slab;
        let mut members = [0u32; MAX_MEMBERS];
        // Active engines: each with its score so far and its weight on the last decoded block.
        let mut active = [EngineScore {
            engine: 0,
            matched_blocks: 0,
            score: 0.0,
        }; MAX_MEMBERS];
        let mut last_weight = [0f64; MAX_MEMBERS];
        let mut active_len = 0usize;
        // Blocks since the last decoded one whose member set was the same (not yet credited).
        let mut pending = 0u32;
        let mut words = NO_WORDS;
        let mut prev: Option<u32> = None;
        let mut i = 0;
        while i < hashes.len() {
            let hash = key(hashes[i]);
            let node = locate(slab, &table, prev, hash);
            let read = match node {
                Some(id) => slab.read_node(id, hash, words, &mut members),
                None => NodeRead::Gone,
            };
            let n = match read {
                NodeRead::Same => {
                    pending += 1;
                    i += 1;
                    // Same set: follow the chain segment that continues it.
                    if let Some(id) = node {
                        let run = follow_segment(slab, id, words, &hashes[i..]);
                        pending += run as u32;
                        i += run;
                        prev = Some(id + run as u32);
                    }
                    continue;
                }
                NodeRead::Gone => 0,
                NodeRead::Members(n, w) => {
                    words = w;
                    n
                }
            };
            // The set changed: credit the blocks that shared the previous one, then intersect.
            for (a, w) in active[..active_len].iter_mut().zip(&last_weight) {
                a.score += pending as f64 * w;
                a.matched_blocks += pending;
            }
            pending = 0;
            if i == 0 {
                for &m in &members[..n] {
                    let engine = m >> 8;
                    if candidates.is_some_and(|c| c.binary_search(&engine).is_err()) {
                        continue;
                    }
                    let w = weights.of(Tier::from_bits(m));
                    match active[..active_len].iter().position(|a| a.engine == engine) {
                        Some(k) => {
                            active[k].score = active[k].score.max(w);
                            last_weight[k] = active[k].score;
                        }
                        None => {
                            active[active_len] = EngineScore {
                                engine,
                                matched_blocks: 1,
                                score: w,
                            };
                            last_weight[active_len] = w;
                            active_len += 1;
                        }
                    }
                }
            } else {
                let mut k = 0;
                while k < active_len {
                    let engine = active[k].engine;
                    let mut best = -1.0f64;
                    for &m in &members[..n] {
                        if m >> 8 == engine {
                            best = best.max(weights.of(Tier::from_bits(m)));
                        }
                    }
                    if best >= 0.0 {
                        active[k].score += best;
                        active[k].matched_blocks += 1;
                        last_weight[k] = best;
                        k += 1;
                    } else {
                        out.push(active[k]);
                        active_len -= 1;
                        active[k] = active[active_len];
                        last_weight[k] = last_weight[active_len];
                    }
                }
            }
            if active_len == 0 {
                return;
            }
            prev = node;
            i += 1;
            // Fast path: the chain segment that follows with the same member set is matched by
            // every active engine, at the same weights.
            if let Some(id) = node {
                let run = follow_segment(slab, id, words, &hashes[i..]);
                pending += run as u32;
                i += run;
                prev = Some(id + run as u32);
            }
        }
        for (a, w) in active[..active_len].iter_mut().zip(&last_weight) {
            a.score += pending as f64 * w;
            a.matched_blocks += pending;
        }
        out.extend_from_slice(&active[..active_len]);
    }

    /// Size and activity counters.
    pub fn stats(&self) -> IndexStats {
        let c = &self.counters;
        IndexStats {
            keys: c.keys.load(Ordering::Relaxed),
            memberships: c.memberships.load(Ordering::Relaxed),
            admissions: c.admissions.load(Ordering::Relaxed),
            removals: c.removals.load(Ordering::Relaxed),
            capacity_evictions: c.capacity_evictions.load(Ordering::Relaxed),
            pod_cache_evictions: c.pod_cache_evictions.load(Ordering::Relaxed),
            orphan_runs: c.orphan_runs.load(Ordering::Relaxed),
            dropped_full: c.dropped_full.load(Ordering::Relaxed),
            memory_bytes: self.memory_bytes() as u64,
        }
    }

    /// Bytes the index holds: slab chunks, the table, reverse lists and engine maps (takes the
    /// writer briefly).
    pub fn memory_bytes(&self) -> usize {
        let w = self.writer.lock();
        let reverse: usize = w
            .engines
            .iter()
            .flatten()
            .map(|e| e.blocks.capacity() * 4 + std::mem::size_of::<EngineState>())
            .sum();
        self.slab.allocated_bytes()
            + w.table.allocated_bytes()
            + reverse
            + w.free_ranges.capacity() * 8
            + w.sets.bookkeeping_bytes()
            + w.referenced.capacity() * 8
            + w.seen.capacity() * 8
            + w.linked.capacity() * 8
    }

    /// Memory breakdown (debugging).
    pub fn debug_memory(&self) -> String {
        let w = self.writer.lock();
        let reverse: usize = w
            .engines
            .iter()
            .flatten()
            .map(|e| e.blocks.capacity() * 4)
            .sum();
        let rev_len: usize = w.engines.iter().flatten().map(|e| e.blocks.len()).sum();
        format!(
            "nodes {} (next_node {}, free ranges {}), pages {} (sets {}), table {} (cap {}, live {}, used {}), reverse {} (len {}), referenced {}",
            self.slab.nodes.allocated_bytes(), w.next_node, w.free_ranges.len(),
            self.slab.pages.allocated_bytes(), w.sets.set_count(),
            w.table.allocated_bytes(), w.table.capacity(), w.table_live, w.table_used,
            reverse, rev_len, w.referenced.capacity() * 8
        )
    }

    /// Every engine with the memberships it holds.
    pub fn engine_blocks(&self) -> Vec<(EngineKey, u64)> {
        let w = self.writer.lock();
        w.engines
            .iter()
            .flatten()
            .map(|e| (e.key.clone(), e.live))
            .collect()
    }
}

/// What a `store` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Memberships added (blocks the engine did not hold in that tier before).
    pub added: usize,
    /// The run's parent was given but the engine does not hold it.
    pub orphan: bool,
}

/// The model's writer, held for a batch of operations.
pub struct IndexWriter<'a> {
    index: &'a ModelIndex,
    state: &'a mut Writer,
}

impl IndexWriter<'_> {
    /// The id of `key`, registering the engine on first sight. `None` when `MAX_ENGINES`
    /// engines are registered.
    pub fn engine(&mut self, key: &EngineKey) -> Option<EngineId> {
        if let Some(&id) = self.state.engine_ids.get(key) {
            return Some(id);
        }
        let id = match self.state.free_engine_ids.pop() {
            Some(id) => id,
            None => {
                if self.state.engines.len() >= MAX_ENGINES {
                    return None;
                }
                self.state.engines.push(None);
                (self.state.engines.len() - 1) as EngineId
            }
        };
        self.state.engines[id as usize] = Some(EngineState {
            key: key.clone(),
            blocks: Vec::new(),
            live: 0,
        });
        self.state.engine_ids.insert(key.clone(), id);
        self.publish_directory();
        Some(id)
    }

    /// Removes an engine entirely (its blocks, then its id). Returns memberships removed.
    pub fn remove_engine(&mut self, key: &EngineKey) -> usize {
        let Some(&id) = self.state.engine_ids.get(key) else {
            return 0;
        };
        let removed = self.clear_engine(id);
        self.state.engine_ids.remove(key);
        self.state.engines[id as usize] = None;
        self.state.free_engine_ids.push(id);
        self.publish_directory();
        removed
    }

    fn publish_directory(&self) {
        let mut dir = EngineDirectory {
            by_pod: HashMap::new(),
            keys: vec![None; self.state.engines.len()],
        };
        for (id, e) in self.state.engines.iter().enumerate() {
            if let Some(e) = e {
                dir.keys[id] = Some(e.key.clone());
                dir.by_pod
                    .entry(e.key.pod.clone())
                    .or_default()
                    .push(id as EngineId);
            }
        }
        self.index.directory.store(Arc::new(dir));
    }

    fn find(&self, hash: u64) -> Option<u32> {
        let slab = &self.index.slab;
        self.state.table.find(hash, |id| slab.peek_hash(id))
    }

    fn has_engine(&self, id: u32, engine: EngineId) -> bool {
        let mut buf = [0u32; MAX_MEMBERS];
        let n = self.index.slab.members_of(id, &mut buf);
        buf[..n].iter().any(|&m| m >> 8 == engine)
    }

    /// `BlockStored`: `engine` holds `hashes` (a chain continuing `parent`) in `tier`.
    pub fn store(
        &mut self,
        engine: EngineId,
        tier: Tier,
        parent: Option<u64>,
        hashes: &[u64],
    ) -> StoreOutcome {
        let mut outcome = StoreOutcome::default();
        let mut prev = None;
        if let Some(p) = parent {
            prev = self.find(key(p));
            outcome.orphan = !prev.is_some_and(|id| self.has_engine(id, engine));
            if outcome.orphan {
                self.state.tally.orphan_runs += 1;
            }
        }
        let m = member(engine, tier);
        for &raw in hashes.iter().take(PREFETCH_AHEAD) {
            self.state.table.prefetch(key(raw));
        }
        for (i, &raw) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(i + PREFETCH_AHEAD) {
                self.state.table.prefetch(key(ahead));
            }
            let hash = key(raw);
            let id = match locate(&self.index.slab, &self.state.table, prev, hash) {
                Some(id) => {
                    if self.add_member(id, hash, m) {
                        outcome.added += 1;
                        self.note_membership(engine, id);
                    }
                    id
                }
                None => match self.alloc_node(hash, m) {
                    Some(id) => {
                        outcome.added += 1;
                        self.note_membership(engine, id);
                        id
                    }
                    None => {
                        self.state.tally.dropped_full += 1;
                        prev = None;
                        continue;
                    }
                },
            };
            self.set_referenced(id);
            if let Some(p) = prev {
                // The walk tries `p + 1` before the hint: no need to write the hint then.
                if p.wrapping_add(1) != id {
                    self.index.slab.set_hint(p, id);
                } else if !self.linked(id) {
                    self.set_linked(id, true);
                    self.refresh_cont(id);
                }
            }
            prev = Some(id);
        }
        outcome
    }

    /// `BlockRemoved`: `engine` no longer holds `hashes` in `tier`. Returns memberships removed.
    ///
    /// Works in chunks: prefetch the chunk's table slots, find candidate nodes by tag and
    /// prefetch them, then verify and remove, so the cache misses of a chunk overlap.
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[u64]) -> usize {
        const CHUNK: usize = 32;
        let m = member(engine, tier);
        let mut removed = 0;
        let mut candidates = [None; CHUNK];
        for chunk in hashes.chunks(CHUNK) {
            for &raw in chunk {
                self.state.table.prefetch(key(raw));
            }
            for (c, &raw) in candidates.iter_mut().zip(chunk) {
                *c = self.state.table.find_tagged(key(raw));
                if let Some(id) = *c {
                    self.index.slab.prefetch(id);
                }
            }
            for (c, &raw) in candidates.iter().zip(chunk) {
                let hash = key(raw);
                let id = c
                    .filter(|&id| self.index.slab.peek_hash(id) == hash)
                    .or_else(|| self.find(hash));
                if let Some(id) = id {
                    removed += self.remove_members(id, hash, |x| x == m);
                }
            }
        }
        removed
    }

    /// `AllBlocksCleared` / a restart: drops every block `engine` holds, in every tier.
    pub fn clear_engine(&mut self, engine: EngineId) -> usize {
        let Some(Some(state)) = self.state.engines.get_mut(engine as usize) else {
            return 0;
        };
        let blocks = std::mem::take(&mut state.blocks);
        let mut removed = 0;
        for (i, &id) in blocks.iter().enumerate() {
            if let Some(&ahead) = blocks.get(i + PREFETCH_AHEAD) {
                self.index.slab.prefetch(ahead);
            }
            let hash = self.index.slab.hash_of(id);
            if hash != 0 {
                removed += self.remove_members(id, hash, |m| m >> 8 == engine);
            }
        }
        removed
    }

    /// Total memberships `engine` holds.
    pub fn engine_blocks(&self, engine: EngineId) -> u64 {
        self.state
            .engines
            .get(engine as usize)
            .and_then(Option::as_ref)
            .map_or(0, |e| e.live)
    }

    fn note_membership(&mut self, engine: EngineId, id: u32) {
        let Some(Some(state)) = self.state.engines.get_mut(engine as usize) else {
            return;
        };
        if state.blocks.len() == state.blocks.capacity() {
            // Full: compact if at least a third is stale, else grow by a quarter. Capacity stays
            // within ~1.5x the live memberships (a doubling Vec would reach 4x).
            let live = state.live as usize;
            if state.blocks.len() >= 1024 && state.blocks.len() > live + live / 2 {
                self.compact_reverse_list(engine);
            }
            if let Some(Some(state)) = self.state.engines.get_mut(engine as usize) {
                if state.blocks.len() == state.blocks.capacity() {
                    state
                        .blocks
                        .reserve_exact((state.blocks.len() / 4).max(256));
                }
            }
        }
        if let Some(Some(state)) = self.state.engines.get_mut(engine as usize) {
            state.blocks.push(id);
            state.live += 1;
        }
    }

    /// Drops stale and duplicate ids from an engine's reverse list: one pass, nodes prefetched,
    /// duplicates found with a bitset over node ids (no sort).
    fn compact_reverse_list(&mut self, engine: EngineId) {
        let Some(Some(state)) = self.state.engines.get_mut(engine as usize) else {
            return;
        };
        let mut blocks = std::mem::take(&mut state.blocks);
        let mut seen = std::mem::take(&mut self.state.seen);
        seen.clear();
        seen.resize(self.state.next_node as usize / 64 + 1, 0);
        let slab = &self.index.slab;
        let mut kept = 0;
        for i in 0..blocks.len() {
            if let Some(&ahead) = blocks.get(i + PREFETCH_AHEAD) {
                slab.prefetch(ahead);
            }
            let id = blocks[i];
            let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
            if seen.get(word).is_none_or(|w| w & bit != 0) {
                continue;
            }
            if self.has_engine(id, engine) {
                seen[word] |= bit;
                blocks[kept] = id;
                kept += 1;
            }
        }
        blocks.truncate(kept);
        if blocks.capacity() > 2 * kept + 4096 {
            blocks.shrink_to(kept + kept / 4 + 1024);
        }
        self.state.seen = seen;
        if let Some(Some(state)) = self.state.engines.get_mut(engine as usize) {
            state.blocks = blocks;
        }
    }

    fn add_member(&mut self, id: u32, hash: u64, m: u32) -> bool {
        let slab = &self.index.slab;
        let mut list = [0u32; MAX_MEMBERS];
        let mut n = slab.members_of(id, &mut list);
        if list[..n].contains(&m) {
            return false;
        }
        if n >= self.index.config.pod_cache_size {
            let victim = list[0];
            list.copy_within(1..n, 0);
            n -= 1;
            self.drop_membership(victim);
            self.state.tally.pod_cache_evictions += 1;
        }
        list[n] = m;
        n += 1;
        self.state.tally.memberships += 1;
        self.state.tally.admissions += 1;
        self.write_members(id, hash, &list[..n]);
        true
    }

    /// Writes a node's member list. Should the set pages ever run out, the node keeps its two
    /// newest members (the others are dropped and counted as pod-cache evictions).
    fn write_members(&mut self, id: u32, hash: u64, list: &[u32]) {
        if self.write_node(id, hash, list) {
            return;
        }
        let keep = list.len().saturating_sub(2);
        for &victim in &list[..keep] {
            self.drop_membership(victim);
            self.state.tally.pod_cache_evictions += 1;
        }
        self.write_node(id, hash, &list[keep..]);
    }

    /// Every node write goes through here: the continuation bits of `id` and `id + 1` are
    /// cleared before the node changes and recomputed after.
    fn write_node(&mut self, id: u32, hash: u64, list: &[u32]) -> bool {
        let slab = &self.index.slab;
        slab.set_cont(id, false);
        slab.set_cont(id.wrapping_add(1), false);
        let ok = slab.write(id, hash, list, &mut self.state.sets);
        self.refresh_cont(id);
        self.refresh_cont(id.wrapping_add(1));
        ok
    }

    /// Sets the continuation bit of `id` iff it is linked to `id - 1` and both hold blocks with
    /// equal member words.
    fn refresh_cont(&self, id: u32) {
        let slab = &self.index.slab;
        let on = id > 0
            && self.linked(id)
            && slab.hash_of(id) != 0
            && slab.hash_of(id - 1) != 0
            && slab.words_of(id) == slab.words_of(id - 1);
        slab.set_cont(id, on);
    }

    fn linked(&self, id: u32) -> bool {
        self.state
            .linked
            .get(id as usize / 64)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    fn set_linked(&mut self, id: u32, on: bool) {
        let word = id as usize / 64;
        if word >= self.state.linked.len() {
            if !on {
                return;
            }
            self.state.linked.resize(word + 1, 0);
        }
        if on {
            self.state.linked[word] |= 1 << (id % 64);
        } else {
            self.state.linked[word] &= !(1 << (id % 64));
        }
    }

    /// Bookkeeping for a membership leaving a node (the reverse list stays lazy).
    fn drop_membership(&mut self, m: u32) {
        if let Some(Some(state)) = self.state.engines.get_mut((m >> 8) as usize) {
            state.live = state.live.saturating_sub(1);
        }
        self.state.tally.memberships -= 1;
    }

    /// Removes the members matching `pred` from node `id`; frees the node when none remain.
    fn remove_members(&mut self, id: u32, hash: u64, pred: impl Fn(u32) -> bool) -> usize {
        let slab = &self.index.slab;
        let mut list = [0u32; MAX_MEMBERS];
        let n = slab.members_of(id, &mut list);
        let mut kept = 0;
        let mut removed = 0;
        for i in 0..n {
            let m = list[i];
            if pred(m) {
                removed += 1;
                self.drop_membership(m);
            } else {
                list[kept] = m;
                kept += 1;
            }
        }
        if removed == 0 {
            return 0;
        }
        self.state.tally.removals += removed as u64;
        if kept == 0 {
            self.free_node(id, hash);
        } else {
            self.write_members(id, hash, &list[..kept]);
        }
        removed
    }

    fn free_node(&mut self, id: u32, hash: u64) {
        // The block leaves: it is nobody's chain child, and its successor id no longer follows it.
        self.set_linked(id, false);
        self.set_linked(id.wrapping_add(1), false);
        self.write_node(id, 0, &[]);
        if let Some(emptied) = self.state.table.remove(hash, id) {
            self.state.table_live -= 1;
            self.state.table_used -= emptied;
        }
        match self.state.free_ranges.last_mut() {
            Some((start, len)) if *start + *len == id => *len += 1,
            Some((start, len)) if id + 1 == *start => {
                *start = id;
                *len += 1;
            }
            _ => self.state.free_ranges.push((id, 1)),
        }
        self.state.tally.keys -= 1;
    }

    fn set_referenced(&mut self, id: u32) {
        let word = id as usize / 64;
        if word >= self.state.referenced.len() {
            self.state.referenced.resize(word + 1, 0);
        }
        self.state.referenced[word] |= 1 << (id % 64);
    }

    /// A fresh node holding `hash` with the single member `m`, evicting by CLOCK when the index
    /// is at `size`.
    fn alloc_node(&mut self, hash: u64, m: u32) -> Option<u32> {
        if self.state.tally.keys as usize >= self.index.config.max_keys {
            self.evict_one();
        }
        let id = match self.state.free_ranges.last_mut() {
            Some((start, len)) => {
                let id = *start;
                *start += 1;
                *len -= 1;
                if *len == 0 {
                    self.state.free_ranges.pop();
                }
                id
            }
            None => {
                let id = self.state.next_node;
                if id as usize >= self.index.slab.nodes.capacity()
                    || self.index.slab.nodes.get_or_alloc(id).is_none()
                {
                    return None;
                }
                self.state.next_node += 1;
                id
            }
        };
        self.write_node(id, hash, &[m]);
        self.ensure_table_room();
        if !self.state.table.insert(hash, id) {
            self.state.table_used += 1;
        }
        self.state.table_live += 1;
        let tally = &mut self.state.tally;
        tally.keys += 1;
        tally.memberships += 1;
        tally.admissions += 1;
        Some(id)
    }

    /// Rebuilds the table into a new allocation, sized to 1.5x the live entries, when live
    /// entries plus tombstones would pass 85% of it.
    fn ensure_table_room(&mut self) {
        let cap = self.state.table.capacity();
        if (self.state.table_used + 1) * 100 <= cap * 85 {
            return;
        }
        let wanted = ((self.state.table_live + 1) * 3 / 2).max(INITIAL_TABLE);
        let fresh = Table::with_capacity(wanted, self.index.seed);
        let live = self.state.table.copy_into(&fresh);
        let fresh = Arc::new(fresh);
        self.state.table = fresh.clone();
        self.state.table_used = live;
        self.state.table_live = live;
        self.index.table.store(fresh);
    }

    /// Second-chance eviction of one block with all its memberships.
    fn evict_one(&mut self) {
        let end = self.state.next_node;
        if end == 0 {
            return;
        }
        for _ in 0..=(2 * end as usize) {
            if self.state.clock_hand >= end {
                self.state.clock_hand = 0;
            }
            let id = self.state.clock_hand;
            self.state.clock_hand += 1;
            let hash = self.index.slab.hash_of(id);
            if hash == 0 {
                continue;
            }
            let word = id as usize / 64;
            let bit = 1u64 << (id % 64);
            if let Some(w) = self.state.referenced.get_mut(word) {
                if *w & bit != 0 {
                    *w &= !bit;
                    continue;
                }
            }
            let evicted = self.remove_members(id, hash, |_| true) as u64;
            // Those were counted as removals; they are capacity evictions.
            self.state.tally.removals -= evicted;
            self.state.tally.capacity_evictions += evicted;
            return;
        }
    }
}

/// Finds `hash`'s node, trying the chain first: the node after `prev`, then `prev`'s child
/// hint, then the table. Unvalidated (the caller reads the node under its seqlock).
#[inline(always)]
fn locate(slab: &Slab, table: &Table, prev: Option<u32>, hash: u64) -> Option<u32> {
    if let Some(p) = prev {
        let next = p.wrapping_add(1);
        if slab.peek_hash(next) == hash {
            return Some(next);
        }
        if let Some(c) = slab.hint(p) {
            if slab.peek_hash(c) == hash {
                return Some(c);
            }
        }
    }
    table.find(hash, |id| slab.peek_hash(id))
}

/// How many of `rest` (the request's next hashes) continue from node `id` through the chain
/// segment after it, all with member words `words`. The continuation bits give the segment's
/// length `k`; since chained hashes commit to their prefix, node `id + j` holding `rest[j - 1]`
/// implies every earlier one does too, so the last node is checked first and, if the request
/// leaves the segment early, the exit is found by binary search: O(log k) node reads.
#[inline]
fn follow_segment(slab: &Slab, id: u32, words: u64, rest: &[u64]) -> usize {
    let k = slab.cont_run(id.wrapping_add(1), rest.len());
    if k == 0 {
        return 0;
    }
    let mut scratch = [0u32; MAX_MEMBERS];
    let mut holds = |j: usize| {
        slab.read_node(id + j as u32, key(rest[j - 1]), words, &mut scratch) == NodeRead::Same
    };
    if holds(k) {
        return k;
    }
    let (mut lo, mut hi) = (0usize, k);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// How far ahead a batch prefetches table slots.
const PREFETCH_AHEAD: usize = 16;

fn random_seed() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    RandomState::new().hash_one(0x6b76_2d69_6e64_6578u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(max_keys: usize, pod_cache_size: usize) -> ModelIndex {
        ModelIndex::new(IndexConfig {
            max_keys,
            pod_cache_size,
        })
        .expect("valid config")
    }

    fn scores(ix: &ModelIndex, hashes: &[u64]) -> Vec<(EngineId, u32)> {
        let mut out = Vec::new();
        ix.score_engines(hashes, None, &TierWeights::default(), &mut out);
        let mut v: Vec<_> = out.iter().map(|s| (s.engine, s.matched_blocks)).collect();
        v.sort();
        v
    }

    #[test]
    fn consecutive_prefix_with_holes_and_tiers() {
        let ix = index(1000, 10);
        let (a, b) = ix.write(|w| {
            let a = w.engine(&EngineKey::new("a", 0)).expect("room");
            let b = w.engine(&EngineKey::new("b", 0)).expect("room");
            w.store(a, Tier::Gpu, None, &[1, 2, 3, 4]);
            w.store(b, Tier::Cpu, None, &[1, 2]);
            w.store(b, Tier::Gpu, Some(2), &[3]);
            (a, b)
        });
        assert_eq!(scores(&ix, &[1, 2, 3, 4, 5]), vec![(a, 4), (b, 3)]);
        ix.write(|w| w.remove(a, Tier::Gpu, &[2]));
        assert_eq!(
            scores(&ix, &[1, 2, 3, 4]),
            vec![(a, 1), (b, 3)],
            "a hole stops a"
        );
        let mut out = Vec::new();
        ix.score_engines(&[1, 2, 3], Some(&[b]), &TierWeights::default(), &mut out);
        assert_eq!(out.len(), 1);
        assert!((out[0].score - (0.8 + 0.8 + 1.0)).abs() < 1e-9, "{out:?}");
    }

    #[test]
    fn clear_and_pod_cache_eviction_and_capacity() {
        let ix = index(4, 2);
        ix.write(|w| {
            let ids: Vec<_> = (0..3)
                .map(|i| {
                    w.engine(&EngineKey::new(&format!("p{i}"), 0))
                        .expect("room")
                })
                .collect();
            for &e in &ids {
                w.store(e, Tier::Gpu, None, &[10, 11]);
            }
            assert_eq!(
                w.engine_blocks(ids[0]),
                0,
                "oldest member dropped at podCacheSize"
            );
            assert_eq!(w.clear_engine(ids[1]), 2);
            w.store(ids[2], Tier::Gpu, Some(11), &[12, 13, 14, 15]);
        });
        let stats = ix.stats();
        assert!(stats.keys <= 4, "size bound holds: {stats:?}");
        assert!(stats.capacity_evictions >= 2, "{stats:?}");
    }
}
