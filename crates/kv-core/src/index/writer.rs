//! [`IndexWriter`]: one writer surface over the two lane engines (`engine: nodes`, the v2
//! node index; `engine: runs`, the v3 run index), so the indexer, its translation and
//! speculation write the same way whichever engine a model runs.

use super::run_lane::RunLaneWriter;
use super::types::{EngineId, Tier};
use super::write::{NodeWriter, StoreOutcome};
use crate::BlockHash;

/// A lane's writer, held for a batch of operations on engines of that lane (an engine of
/// another lane is ignored: nothing stored, removed or cleared).
pub struct IndexWriter<'a> {
    engine: Engine<'a>,
}

enum Engine<'a> {
    Nodes(NodeWriter<'a>),
    Runs(RunLaneWriter<'a>),
}

/// Runs the same call on whichever engine the writer has.
macro_rules! dispatch {
    ($self:expr, $w:ident => $call:expr) => {
        match &mut $self.engine {
            Engine::Nodes($w) => $call,
            Engine::Runs($w) => $call,
        }
    };
}

impl<'a> IndexWriter<'a> {
    pub(super) fn nodes(w: NodeWriter<'a>) -> Self {
        Self {
            engine: Engine::Nodes(w),
        }
    }

    pub(super) fn runs(w: RunLaneWriter<'a>) -> Self {
        Self {
            engine: Engine::Runs(w),
        }
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
        dispatch!(self, w => w.store_each(engine, tier, parent, hashes, held))
    }

    /// `BlockRemoved`: `engine` no longer holds `hashes` in `tier`. Returns memberships removed.
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        dispatch!(self, w => w.remove(engine, tier, hashes))
    }

    /// `AllBlocksCleared` / a restart: drops every block `engine` holds, in every tier.
    pub fn clear_engine(&mut self, engine: EngineId) -> usize {
        dispatch!(self, w => w.clear_engine(engine))
    }

    /// Appends every block `engine` holds, with its tier, to `out`. For snapshots: O(the
    /// engine's memberships).
    pub fn export_engine(&mut self, engine: EngineId, out: &mut Vec<(BlockHash, Tier)>) {
        dispatch!(self, w => w.export_engine(engine, out))
    }

    /// Total memberships `engine` holds.
    pub fn engine_blocks(&mut self, engine: EngineId) -> u64 {
        dispatch!(self, w => w.engine_blocks(engine))
    }

    /// Evicts at least `n` blocks (CLOCK) with all their memberships, or all the lane has:
    /// room for another index sharing the key budget. Returns the blocks evicted.
    pub fn evict(&mut self, n: usize) -> usize {
        dispatch!(self, w => w.evict(n))
    }

    /// Gives a newly registered engine of this lane its (empty) state.
    pub(super) fn register(&mut self, engine: EngineId) {
        dispatch!(self, w => w.register(engine))
    }

    /// Forgets an engine's state (after its blocks were cleared).
    pub(super) fn unregister(&mut self, engine: EngineId) {
        dispatch!(self, w => w.unregister(engine))
    }

    /// The lane's registered engines.
    pub(super) fn engines(&self) -> Vec<EngineId> {
        match &self.engine {
            Engine::Nodes(w) => w.engines(),
            Engine::Runs(w) => w.engines(),
        }
    }
}
