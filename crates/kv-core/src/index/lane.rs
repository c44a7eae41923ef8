//! A writer lane: a [`RunIndex`] behind the lane's writer lock, read lock-free through its
//! [`RunReader`], with the model index's bookkeeping around it (engine slots, live
//! memberships, counters, the shared key budget). [`IndexWriter`] is the one write surface.
//!
//! The run index knows engines by their slot in the lane (`engine id / lanes`), so holder
//! bitmaps stay dense whatever the lane count; this module maps slots to global ids and back.
//!
//! `size` (the key budget shared by lanes and models) is charged after each store with the
//! blocks it added; when the budget is spent, the lane evicts whole runs (CLOCK, second chance
//! for runs stored into since the hand passed) until the store is paid for. The index may so
//! exceed `size` by at most one store's new blocks, for the length of that write.

use std::sync::Arc;

use parking_lot::Mutex;

use super::runs::{RunIndex, RunReader};
use super::stats::{Counters, IndexStats, StoreOutcome, Tally};
use super::types::{EngineId, KeyBudget, Tier};
use crate::BlockHash;

/// One writer lane: the run index of the engines whose pods hash to it.
pub(super) struct Lane {
    reader: RunReader,
    writer: Mutex<LaneState>,
    counters: Counters,
    budget: Arc<KeyBudget>,
    /// This lane's number and the lane count (engine `e` is here iff `e % lanes == lane`).
    lane: u32,
    lanes: u32,
}

/// What only the lane's writer touches.
struct LaneState {
    index: RunIndex,
    /// Per slot: `Some(live memberships)` for a registered engine.
    engines: Vec<Option<u64>>,
    tally: Tally,
}

/// A lane's writer, held for a batch of operations on engines of that lane (an engine of
/// another lane, or not registered, is ignored: nothing stored, removed or cleared).
pub struct IndexWriter<'a> {
    lane: &'a Lane,
    state: &'a mut LaneState,
}

impl Lane {
    /// A lane over `index` (empty).
    pub fn new(index: RunIndex, budget: Arc<KeyBudget>, lane: u32, lanes: u32) -> Self {
        Self {
            reader: index.reader().clone(),
            writer: Mutex::new(LaneState {
                index,
                engines: Vec::new(),
                tally: Tally::default(),
            }),
            counters: Counters::default(),
            budget,
            lane,
            lanes,
        }
    }

    /// The global id of the engine in `slot`.
    #[inline]
    pub fn engine_of(&self, slot: u32) -> EngineId {
        slot * self.lanes + self.lane
    }

    /// Runs `f` as the lane's single writer.
    pub fn write<R>(&self, f: impl FnOnce(&mut IndexWriter<'_>) -> R) -> R {
        let mut guard = self.writer.lock();
        let result = f(&mut IndexWriter {
            lane: self,
            state: &mut guard,
        });
        let stats = guard.index.stats();
        guard.tally.keys = stats.blocks;
        guard.tally.dropped_full = stats.dropped_full;
        guard.tally.pool_exhausted = stats.pool_exhausted;
        self.counters.publish(&guard.tally);
        result
    }

    /// The lane's counters as of its last finished write, with its readers' give-ups.
    pub fn counters(&self) -> IndexStats {
        IndexStats {
            reads_given_up: self.reader.gave_up(),
            ..self.counters.snapshot()
        }
    }

    /// The lane's lock-free reader.
    pub fn reader(&self) -> &RunReader {
        &self.reader
    }

    /// Bytes the lane holds (takes its writer briefly).
    pub fn memory_bytes(&self) -> usize {
        let w = self.writer.lock();
        w.index.allocated_bytes() + w.engines.capacity() * 16
    }

    /// The lane's registered engines with their live memberships.
    pub fn live_engines(&self) -> Vec<(EngineId, u64)> {
        let w = self.writer.lock();
        w.engines
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.map(|live| (self.engine_of(slot as u32), live)))
            .collect()
    }
}

/// Takes `memberships` the index dropped on its own (eviction, `podCacheSize`) off the count
/// of the engine in `slot` and the lane's total.
fn uncount(engines: &mut [Option<u64>], tally: &mut Tally, slot: u32, memberships: u64) {
    if let Some(Some(live)) = engines.get_mut(slot as usize) {
        *live = live.saturating_sub(memberships);
    }
    tally.memberships -= memberships;
}

impl IndexWriter<'_> {
    /// The slot of `engine`, if it is a registered engine of this lane.
    #[inline]
    fn slot(&self, engine: EngineId) -> Option<u32> {
        let lane = self.lane;
        let slot = (engine % lane.lanes == lane.lane).then_some(engine / lane.lanes)?;
        matches!(self.state.engines.get(slot as usize), Some(Some(_))).then_some(slot)
    }

    /// Adds `delta` to the live memberships of the engine in `slot` (registered).
    fn count(&mut self, slot: u32, delta: i64) {
        if let Some(Some(live)) = self.state.engines.get_mut(slot as usize) {
            *live = live.saturating_add_signed(delta);
        }
    }

    /// Gives a newly registered engine of this lane its (empty) state.
    pub(super) fn register(&mut self, engine: EngineId) {
        let lane = self.lane;
        if engine % lane.lanes == lane.lane {
            let slot = (engine / lane.lanes) as usize;
            if self.state.engines.len() <= slot {
                self.state.engines.resize(slot + 1, None);
            }
            self.state.engines[slot] = Some(0);
        }
    }

    /// Forgets an engine's state (after its blocks were cleared).
    pub(super) fn unregister(&mut self, engine: EngineId) {
        let lane = self.lane;
        if engine % lane.lanes == lane.lane {
            if let Some(e) = self.state.engines.get_mut((engine / lane.lanes) as usize) {
                *e = None;
            }
            while matches!(self.state.engines.last(), Some(None)) {
                self.state.engines.pop();
            }
            let known = self.state.engines.len() as u32;
            self.state.index.release_engines_from(known);
        }
    }

    /// The lane's registered engines.
    pub(super) fn engines(&self) -> Vec<EngineId> {
        (0..self.state.engines.len() as u32)
            .filter(|&s| self.state.engines[s as usize].is_some())
            .map(|s| self.lane.engine_of(s))
            .collect()
    }

    /// `BlockStored`: `engine` holds `hashes` (a chain continuing `parent`) in `tier`.
    pub fn store(
        &mut self,
        engine: EngineId,
        tier: Tier,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
    ) -> StoreOutcome {
        self.store_each(engine, tier, parent, hashes, |_, _| {})
    }

    /// [`IndexWriter::store`], telling `held(hash, added)` for every block the engine holds
    /// afterwards: `added` when the membership is new, not when the engine already held the
    /// block in that tier (a second copy, which the caller may count).
    pub fn store_each(
        &mut self,
        engine: EngineId,
        tier: Tier,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        held: impl FnMut(BlockHash, bool),
    ) -> StoreOutcome {
        let Some(slot) = self.slot(engine) else {
            return StoreOutcome::default();
        };
        let before = self.state.index.stats().blocks;
        let outcome = self
            .state
            .index
            .store_each(slot, tier, parent, hashes, held);
        let added = outcome.added as u64;
        self.count(slot, added as i64);
        // Memberships `podCacheSize` dropped to make room (other engines' counts).
        let state = &mut *self.state;
        let (engines, tally) = (&mut state.engines, &mut state.tally);
        state.index.take_displaced(|victim, memberships| {
            uncount(engines, tally, victim, memberships);
            tally.pod_cache_evictions += memberships;
        });
        self.state.tally.stored(&outcome);
        let new_blocks = self.state.index.stats().blocks - before;
        self.charge(new_blocks);
        outcome
    }

    /// Takes `new_blocks` keys from the budget, evicting this lane's runs for what it lacks.
    fn charge(&mut self, new_blocks: u64) {
        if new_blocks == 0 {
            return;
        }
        let granted = self.lane.budget.take_up_to(new_blocks);
        if granted == new_blocks {
            return;
        }
        let evicted = self.evict_blocks((new_blocks - granted) as usize) as u64;
        // The lane grew by `new_blocks - evicted`; `granted` was taken.
        let grew = new_blocks.saturating_sub(evicted);
        if granted > grew {
            self.lane.budget.give_back(granted - grew);
        }
    }

    /// Evicts at least `n` blocks with their memberships (counted as capacity evictions).
    fn evict_blocks(&mut self, n: usize) -> usize {
        let state = &mut *self.state;
        let (engines, tally) = (&mut state.engines, &mut state.tally);
        state.index.evict(n, |slot, memberships| {
            uncount(engines, tally, slot, memberships);
            tally.capacity_evictions += memberships;
        })
    }

    /// Evicts at least `n` blocks (CLOCK) with all their memberships, or all the lane has:
    /// room for another index sharing the key budget. Returns the blocks evicted.
    pub fn evict(&mut self, n: usize) -> usize {
        let evicted = self.evict_blocks(n);
        self.lane.budget.give_back(evicted as u64);
        evicted
    }

    /// Runs a removal on the index and settles the counters and the budget.
    fn settle(&mut self, slot: u32, op: impl FnOnce(&mut RunIndex) -> usize) -> usize {
        let before = self.state.index.stats().blocks;
        let removed = op(&mut self.state.index);
        let left = before - self.state.index.stats().blocks;
        self.lane.budget.give_back(left);
        self.count(slot, -(removed as i64));
        let t = &mut self.state.tally;
        t.removals += removed as u64;
        t.memberships -= removed as u64;
        removed
    }

    /// `BlockRemoved`: `engine` no longer holds `hashes` in `tier`. Returns memberships removed.
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        match self.slot(engine) {
            Some(slot) => self.settle(slot, |index| index.remove(slot, tier, hashes)),
            None => 0,
        }
    }

    /// `AllBlocksCleared` / a restart: drops every block `engine` holds, in every tier.
    pub fn clear_engine(&mut self, engine: EngineId) -> usize {
        match self.slot(engine) {
            Some(slot) => self.settle(slot, |index| index.clear_engine(slot)),
            None => 0,
        }
    }

    /// Appends every block `engine` holds, with its tier, to `out`. For snapshots: O(the
    /// engine's memberships).
    pub fn export_engine(&mut self, engine: EngineId, out: &mut Vec<(BlockHash, Tier)>) {
        if let Some(slot) = self.slot(engine) {
            self.state.index.export(slot, out);
        }
    }

    /// Total memberships `engine` holds.
    pub fn engine_blocks(&mut self, engine: EngineId) -> u64 {
        self.slot(engine)
            .and_then(|slot| self.state.engines.get(slot as usize).copied().flatten())
            .unwrap_or(0)
    }
}
