//! CLOCK eviction at `size`, per run, and the export of an engine's holdings.
//!
//! One reference bit per run number, set when a store adds to the run or lands in it; the hand
//! walks ids, passing a referenced run (and clearing its bit) in one step; from a run whose bit
//! is clear, the blocks from the hand on leave with all their memberships, as many as are still
//! wanted (the caller counts them as capacity evictions). A run's blocks leave as one stretch:
//! O(1) run bookkeeping plus a table delete per block.

use super::cells::NONE;
use super::RunIndex;
use crate::index::types::{EngineId, Tier};
use crate::BlockHash;

impl RunIndex {
    /// Sets run `r`'s reference bit.
    #[inline]
    pub(super) fn set_referenced(&mut self, r: u32) {
        let word = r as usize / 64;
        if word >= self.referenced.len() {
            self.referenced.resize(word + 1, 0);
        }
        self.referenced[word] |= 1 << (r % 64);
    }

    /// Clears run `r`'s reference bit; whether it was set.
    fn take_referenced(&mut self, r: u32) -> bool {
        match self.referenced.get_mut(r as usize / 64) {
            Some(word) => {
                let bit = 1u64 << (r % 64);
                let was = *word & bit != 0;
                *word &= !bit;
                was
            }
            None => false,
        }
    }

    /// Evicts `n` blocks (from the hand on, second chance for referenced runs) with all their
    /// memberships, telling `dropped(engine, memberships)` per holder. Returns the blocks
    /// evicted (fewer than `n` only when the index runs empty).
    pub fn evict(&mut self, n: usize, mut dropped: impl FnMut(EngineId, u64)) -> usize {
        let mut evicted = 0;
        // Two passes over the ids clear every bit and then find an unreferenced run.
        let mut budget = 2 * self.ids_len as u64 + 2;
        while evicted < n && self.stats.blocks > 0 && budget > 0 {
            if self.hand >= self.ids_len {
                self.hand = 0;
            }
            let id = self.hand;
            let r = self.id(id).run();
            if r == NONE {
                self.hand += 1;
                budget -= 1;
                continue;
            }
            let run = self.run(r);
            if self.take_referenced(r) {
                budget = budget.saturating_sub((run.end - id) as u64);
                self.hand = run.end;
                continue;
            }
            // From the hand on, as much of the run as is still wanted (runs of one holder set
            // can be long: a pod's whole cache, when no other pod shares it).
            let stop = run.end.min(id.saturating_add((n - evicted) as u32));
            let blocks = (stop - id) as u64;
            for (engine, _) in run.holders.members(&self.reader.shared.words) {
                dropped(engine, blocks);
            }
            self.leave(id, stop);
            self.hand = stop;
            budget = budget.saturating_sub(blocks);
            evicted += blocks as usize;
        }
        evicted
    }

    /// Appends every (block, tier) `engine` holds to `out`: what a snapshot stores. Compacts
    /// the engine's ranges first, so the walk is O(its runs and blocks).
    pub fn export(&mut self, engine: EngineId, out: &mut Vec<(BlockHash, Tier)>) {
        if self.ranges.len() <= engine as usize {
            return;
        }
        self.compact(engine);
        for &(start, end) in &self.ranges[engine as usize] {
            let mut id = start;
            while let Some((at, run)) = self.next_run(id, end) {
                let nibble = run.holders.nibble(engine, &self.reader.shared.words);
                let stop = run.end.min(end);
                for tier in (0..4).filter(|t| nibble & (1 << t) != 0) {
                    let tier = Tier::from_bits(tier);
                    out.extend((at..stop).map(|i| (BlockHash::new(self.id(i).hash()), tier)));
                }
                id = stop;
            }
        }
    }
}
