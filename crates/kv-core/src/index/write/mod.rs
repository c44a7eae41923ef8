//! The write path: one writer per lane applies stores, removals and clears of the lane's
//! engines, keeps the reverse lists and the continuation bitmap, grows the table and evicts by
//! CLOCK when the key budget is spent.
//!
//! Invariants kept here:
//! - every node write goes through `write_node`, which clears the continuation bits of the node
//!   and its successor before the change and recomputes them after (a set bit is never newer
//!   than the nodes it describes);
//! - the table is rebuilt into a new allocation and published with one swap (readers holding the
//!   old one finish on it);
//! - the running totals are plain integers here and published to the atomic counters when the
//!   write ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod evict;
mod reverse;

use super::read::locate;
use super::slab::SetPool;
use super::table::Table;
use super::types::{EngineId, IndexStats, Tier};
use super::{key, member, member_engine, IndexWriter, Lane, Lanes, ModelIndex, INITIAL_TABLE};
use crate::BlockHash;

/// The writer's running totals; published to [`Counters`] when each write ends.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    pub keys: u64,
    pub memberships: u64,
    pub admissions: u64,
    pub removals: u64,
    pub capacity_evictions: u64,
    pub pod_cache_evictions: u64,
    pub orphan_runs: u64,
    pub dropped_full: u64,
    pub pool_exhausted: u64,
}

/// Counters, readable at any time without the writer (as of the last finished write).
#[derive(Debug, Default)]
pub(super) struct Counters {
    keys: AtomicU64,
    memberships: AtomicU64,
    admissions: AtomicU64,
    removals: AtomicU64,
    capacity_evictions: AtomicU64,
    pod_cache_evictions: AtomicU64,
    orphan_runs: AtomicU64,
    dropped_full: AtomicU64,
    pool_exhausted: AtomicU64,
}

struct EngineState {
    /// Node ids this engine was given memberships on; may hold stale or duplicate ids (checked
    /// against the node when used, compacted when it grows past twice `live`).
    blocks: Vec<u32>,
    /// Memberships the engine holds now.
    live: u64,
}

/// The writer's state: everything readers never look at.
pub(super) struct Writer {
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
    /// The lane's engines, by slot (`engine id / lanes`).
    engines: Vec<Option<EngineState>>,
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
    /// Scratch for one node's member list (reused: a member change allocates nothing once it
    /// has held the largest set).
    list: Vec<u32>,
}

impl Counters {
    /// Publishes the writer's totals (relaxed: each counter is a statistic on its own).
    pub(super) fn publish(&self, t: &Tally) {
        for (counter, value) in [
            (&self.keys, t.keys),
            (&self.memberships, t.memberships),
            (&self.admissions, t.admissions),
            (&self.removals, t.removals),
            (&self.capacity_evictions, t.capacity_evictions),
            (&self.pod_cache_evictions, t.pod_cache_evictions),
            (&self.orphan_runs, t.orphan_runs),
            (&self.dropped_full, t.dropped_full),
            (&self.pool_exhausted, t.pool_exhausted),
        ] {
            counter.store(value, Ordering::Relaxed);
        }
    }

    /// The counters as of the last finished write (`memory_bytes` and the readers'
    /// `reads_given_up` left 0: they are not the writer's).
    pub(super) fn snapshot(&self) -> IndexStats {
        IndexStats {
            keys: self.keys.load(Ordering::Relaxed),
            memberships: self.memberships.load(Ordering::Relaxed),
            admissions: self.admissions.load(Ordering::Relaxed),
            removals: self.removals.load(Ordering::Relaxed),
            capacity_evictions: self.capacity_evictions.load(Ordering::Relaxed),
            pod_cache_evictions: self.pod_cache_evictions.load(Ordering::Relaxed),
            orphan_runs: self.orphan_runs.load(Ordering::Relaxed),
            dropped_full: self.dropped_full.load(Ordering::Relaxed),
            pool_exhausted: self.pool_exhausted.load(Ordering::Relaxed),
            reads_given_up: 0,
            memory_bytes: 0,
        }
    }
}

impl Writer {
    /// A writer for an empty index whose readers start on `table`.
    pub(super) fn new(table: Arc<Table>) -> Self {
        Self {
            table,
            table_used: 0,
            table_live: 0,
            free_ranges: Vec::new(),
            next_node: 0,
            sets: SetPool::default(),
            engines: Vec::new(),
            referenced: Vec::new(),
            seen: Vec::new(),
            linked: Vec::new(),
            tally: Tally::default(),
            clock_hand: 0,
            list: Vec::new(),
        }
    }
}

impl Writer {
    /// The lane's engines with their live memberships, as global ids.
    pub(super) fn live_engines(&self, lane: u32, lanes: u32) -> Vec<(EngineId, u64)> {
        self.engines
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.as_ref().map(|e| (slot as u32 * lanes + lane, e.live)))
            .collect()
    }

    fn reverse_bytes(&self) -> usize {
        self.engines
            .iter()
            .flatten()
            .map(|e| e.blocks.capacity() * 4 + std::mem::size_of::<EngineState>())
            .sum()
    }
}

impl Lane {
    /// Runs `f` as the lane's single writer.
    pub(super) fn write<R>(&self, f: impl FnOnce(&mut IndexWriter<'_>) -> R) -> R {
        let mut guard = self.writer.lock();
        let result = f(&mut IndexWriter::nodes(NodeWriter {
            index: self,
            state: &mut guard,
        }));
        self.counters.publish(&guard.tally);
        result
    }

    /// Bytes the lane holds: slab chunks, the table, reverse lists (takes its writer briefly).
    pub(super) fn memory_bytes(&self) -> usize {
        let w = self.writer.lock();
        self.slab.allocated_bytes()
            + w.table.allocated_bytes()
            + w.reverse_bytes()
            + w.free_ranges.capacity() * 8
            + w.sets.bookkeeping_bytes()
            + w.referenced.capacity() * 8
            + w.seen.capacity() * 8
            + w.linked.capacity() * 8
            + w.list.capacity() * 4
    }

    fn debug_memory(&self) -> String {
        let w = self.writer.lock();
        let rev_len: usize = w.engines.iter().flatten().map(|e| e.blocks.len()).sum();
        format!(
            "nodes {} (next_node {}, free ranges {}), pages {} (sets {}), table {} (cap {}, live {}, used {}), reverse {} (len {}), referenced {}",
            self.slab.nodes.allocated_bytes(), w.next_node, w.free_ranges.len(),
            self.slab.pages.allocated_bytes(), w.sets.set_count(),
            w.table.allocated_bytes(), w.table.capacity(), w.table_live, w.table_used,
            w.reverse_bytes(), rev_len, w.referenced.capacity() * 8
        )
    }
}

impl ModelIndex {
    /// Bytes the index holds: every lane's slab chunks, table, reverse lists and bookkeeping
    /// (takes each lane's writer briefly).
    pub fn memory_bytes(&self) -> usize {
        (0..self.lanes.len())
            .map(|i| self.lanes.memory_bytes(i))
            .sum()
    }

    /// Memory breakdown per lane (debugging).
    pub fn debug_memory(&self) -> String {
        let lanes: Vec<String> = match &self.lanes {
            Lanes::Nodes(lanes) => lanes.iter().map(Lane::debug_memory).collect(),
            Lanes::Runs(lanes) => lanes
                .iter()
                .map(|l| format!("runs {} bytes", l.memory_bytes()))
                .collect(),
        };
        lanes.join("; ")
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

/// A node lane's writer (see [`IndexWriter`], which dispatches to it).
pub(super) struct NodeWriter<'a> {
    index: &'a Lane,
    state: &'a mut Writer,
}

impl NodeWriter<'_> {
    /// The writer's slot of `engine`, if the engine belongs to this lane.
    #[inline(always)]
    fn slot(&self, engine: EngineId) -> Option<usize> {
        (engine % self.index.lanes == self.index.lane)
            .then_some((engine / self.index.lanes) as usize)
    }

    /// The state of `engine`, if it is a registered engine of this lane.
    fn engine_state(&mut self, engine: EngineId) -> Option<&mut EngineState> {
        let slot = self.slot(engine)?;
        self.state.engines.get_mut(slot)?.as_mut()
    }

    /// Gives a newly registered engine of this lane its (empty) state.
    pub(super) fn register(&mut self, engine: EngineId) {
        if let Some(slot) = self.slot(engine) {
            if self.state.engines.len() <= slot {
                self.state.engines.resize_with(slot + 1, || None);
            }
            self.state.engines[slot] = Some(EngineState {
                blocks: Vec::new(),
                live: 0,
            });
        }
    }

    /// Forgets an engine's state (after its blocks were cleared).
    pub(super) fn unregister(&mut self, engine: EngineId) {
        if let Some(slot) = self.slot(engine) {
            if let Some(e) = self.state.engines.get_mut(slot) {
                *e = None;
            }
            let engines = &mut self.state.engines;
            while matches!(engines.last(), Some(None)) {
                engines.pop();
            }
            if engines.capacity() > 64 && engines.len() < engines.capacity() / 4 {
                engines.shrink_to_fit();
            }
        }
    }

    fn find(&self, hash: u64) -> Option<u32> {
        let slab = &self.index.slab;
        self.state.table.find(hash, |id| slab.peek_hash(id))
    }

    fn has_engine(&mut self, id: u32, engine: EngineId) -> bool {
        self.index.slab.members_of(id, &mut self.state.list);
        self.state.list.iter().any(|&m| member_engine(m) == engine)
    }

    /// [`IndexWriter::store_each`] on a node lane: tells `held(hash, added)` for every block the engine holds
    /// afterwards: `added` when the membership is new, not when the engine already held the
    /// block in that tier (a second copy, which the caller may count).
    pub fn store_each(
        &mut self,
        engine: EngineId,
        tier: Tier,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        mut held: impl FnMut(BlockHash, bool),
    ) -> StoreOutcome {
        let mut outcome = StoreOutcome::default();
        if self.engine_state(engine).is_none() {
            return outcome;
        }
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
                    let added = self.add_member(id, hash, m);
                    if added {
                        outcome.added += 1;
                        self.note_membership(engine, id);
                    }
                    held(raw, added);
                    id
                }
                None => match self.alloc_node(hash, m) {
                    Some(id) => {
                        outcome.added += 1;
                        self.note_membership(engine, id);
                        held(raw, true);
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
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        const CHUNK: usize = 32;
        if self.engine_state(engine).is_none() {
            return 0;
        }
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
        let Some(state) = self.engine_state(engine) else {
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
                removed += self.remove_members(id, hash, |m| member_engine(m) == engine);
            }
        }
        removed
    }

    /// The lane's engines that are registered.
    pub(in crate::index) fn engines(&self) -> Vec<EngineId> {
        self.state
            .live_engines(self.index.lane, self.index.lanes)
            .into_iter()
            .map(|(engine, _)| engine)
            .collect()
    }

    /// Appends every (block, tier) `engine` holds to `out`, each once (stale reverse entries
    /// are compacted away first); a block held in two tiers is listed in both. For snapshots:
    /// O(the engine's memberships).
    pub fn export_engine(&mut self, engine: EngineId, out: &mut Vec<(BlockHash, Tier)>) {
        if self.engine_state(engine).is_none() {
            return;
        }
        self.compact_reverse_list(engine);
        let Some(state) = self.engine_state(engine) else {
            return;
        };
        let blocks = std::mem::take(&mut state.blocks);
        out.reserve(blocks.len());
        let mut list = std::mem::take(&mut self.state.list);
        for &id in &blocks {
            let hash = self.index.slab.hash_of(id);
            self.index.slab.members_of(id, &mut list);
            for &m in list.iter().filter(|&&m| member_engine(m) == engine) {
                out.push((BlockHash::from(hash), Tier::from_bits(m)));
            }
        }
        self.state.list = list;
        if let Some(state) = self.engine_state(engine) {
            state.blocks = blocks;
        }
    }

    /// Total memberships `engine` holds.
    pub fn engine_blocks(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .and_then(|slot| self.state.engines.get(slot))
            .and_then(Option::as_ref)
            .map_or(0, |e| e.live)
    }

    fn add_member(&mut self, id: u32, hash: u64, m: u32) -> bool {
        let mut list = std::mem::take(&mut self.state.list);
        self.index.slab.members_of(id, &mut list);
        if list.contains(&m) {
            self.state.list = list;
            return false;
        }
        // Opt-in bound (`podCacheSize`): the oldest holder makes room.
        if let Some(bound) = self.index.config.pod_cache_size {
            while list.len() >= bound {
                let victim = list.remove(0);
                self.drop_membership(victim);
                self.state.tally.pod_cache_evictions += 1;
            }
        }
        list.push(m);
        self.state.tally.memberships += 1;
        self.state.tally.admissions += 1;
        self.write_members(id, hash, &list);
        self.state.list = list;
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
        if let Some(state) = self.engine_state(member_engine(m)) {
            state.live = state.live.saturating_sub(1);
        }
        self.state.tally.memberships -= 1;
    }

    /// Removes the members matching `pred` from node `id`; frees the node when none remain.
    fn remove_members(&mut self, id: u32, hash: u64, pred: impl Fn(u32) -> bool) -> usize {
        let mut list = std::mem::take(&mut self.state.list);
        self.index.slab.members_of(id, &mut list);
        let before = list.len();
        list.retain(|&m| {
            let leaves = pred(m);
            if leaves {
                self.drop_membership(m);
            }
            !leaves
        });
        let removed = before - list.len();
        if removed > 0 {
            self.state.tally.removals += removed as u64;
            if list.is_empty() {
                self.free_node(id, hash);
            } else {
                self.write_members(id, hash, &list);
            }
        }
        self.state.list = list;
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
        self.index.budget.give_back(1);
    }

    /// A fresh node holding `hash` with the single member `m`, evicting by CLOCK from this lane
    /// when the shared key budget (`size`) is spent. `None` when no key can be had (the budget
    /// is spent and this lane holds nothing to evict).
    fn alloc_node(&mut self, hash: u64, m: u32) -> Option<u32> {
        // The budget is `size` (all lanes and, in an indexer, all models together).
        if !self.index.budget.take() {
            self.evict_one();
            if !self.index.budget.take() {
                return None;
            }
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
                    self.index.budget.give_back(1);
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

    /// Rebuilds the table into a new allocation, sized to 1.4x the live entries, when live
    /// entries plus tombstones would pass 85% of it.
    fn ensure_table_room(&mut self) {
        let cap = self.state.table.capacity();
        if (self.state.table_used + 1) * 100 <= cap * 85 {
            return;
        }
        let wanted = ((self.state.table_live + 1) * 7 / 5).max(INITIAL_TABLE);
        let fresh = Table::with_capacity(wanted, self.index.seed);
        let live = self.state.table.copy_into(&fresh);
        let fresh = Arc::new(fresh);
        self.state.table = fresh.clone();
        self.state.table_used = live;
        self.state.table_live = live;
        self.index.table.store(fresh);
    }
}

/// How far ahead a batch prefetches table slots.
const PREFETCH_AHEAD: usize = 16;

pub(super) fn random_seed() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    RandomState::new().hash_one(0x6b76_2d69_6e64_6578u64)
}
