//! [`ReferenceIndex`]: the plain per-block map every index structure is checked against (the
//! differential harness, kv-core's tests, kv-lab's benchmark baseline).
//! Nothing clever: a map from block key to its holders in store order; a query walks the
//! prompt block by block. Public so that every check uses this one reference.
//!
//! Invariants: a block is in the map iff it has a holder; a holder (engine, tier) appears at
//! most once per block; under `podCacheSize` a block keeps its newest holders, in store order.

use std::collections::HashMap;

use super::types::{EngineId, EngineScore, Tier, TierWeights};
use crate::BlockHash;

/// The reference index: block key -> (engine, tier) holders in store order.
#[derive(Debug, Default, Clone)]
pub struct ReferenceIndex {
    blocks: HashMap<BlockHash, Vec<(EngineId, Tier)>>,
    pod_cache_size: Option<usize>,
}

impl ReferenceIndex {
    /// An empty reference; `pod_cache_size` bounds holders per block (the oldest dropped
    /// beyond it), as `podCacheSize` does.
    pub fn new(pod_cache_size: Option<usize>) -> Self {
        Self {
            blocks: HashMap::new(),
            pod_cache_size,
        }
    }

    /// `engine` holds `hashes` in `tier`; returns the memberships added.
    pub fn store(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        let mut added = 0;
        for h in hashes {
            let list = self.blocks.entry(*h).or_default();
            if list.contains(&(engine, tier)) {
                continue;
            }
            if self.pod_cache_size.is_some_and(|b| list.len() >= b) {
                list.remove(0);
            }
            list.push((engine, tier));
            added += 1;
        }
        added
    }

    /// `engine` no longer holds `hashes` in `tier`; returns the memberships removed.
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        let mut removed = 0;
        for h in hashes {
            if let Some(list) = self.blocks.get_mut(h) {
                let before = list.len();
                list.retain(|m| *m != (engine, tier));
                removed += before - list.len();
                if list.is_empty() {
                    self.blocks.remove(h);
                }
            }
        }
        removed
    }

    /// Drops every block `engine` holds; returns the memberships removed.
    pub fn clear_engine(&mut self, engine: EngineId) -> usize {
        let mut removed = 0;
        self.blocks.retain(|_, list| {
            let before = list.len();
            list.retain(|m| m.0 != engine);
            removed += before - list.len();
            !list.is_empty()
        });
        removed
    }

    /// The holders of `hash`, in store order (empty when no one holds it).
    pub fn holders(&self, hash: BlockHash) -> &[(EngineId, Tier)] {
        self.blocks.get(&hash).map_or(&[], Vec::as_slice)
    }

    /// Every block with its holders (any order).
    pub fn blocks(&self) -> impl Iterator<Item = (BlockHash, &[(EngineId, Tier)])> {
        self.blocks.iter().map(|(h, l)| (*h, l.as_slice()))
    }

    /// Distinct blocks held.
    pub fn keys(&self) -> usize {
        self.blocks.len()
    }

    /// (block, engine, tier) memberships.
    pub fn memberships(&self) -> usize {
        self.blocks.values().map(Vec::len).sum()
    }

    /// Every engine holding the prompt's first block (restricted to `candidates` when given):
    /// how many consecutive blocks from block 0 it holds in any tier, and the sum of each
    /// block's best tier weight. Sorted by engine. Per block: the holders' best weights are
    /// stamped with the block's round, then the engines still matching keep going
    /// (O(holders + matching) per block, so a 1,024-pod fleet stays quick to check).
    pub fn score(
        &self,
        hashes: &[BlockHash],
        candidates: Option<&[EngineId]>,
        weights: &TierWeights,
    ) -> Vec<EngineScore> {
        // Per engine id: the round (block) it was last seen holding, and its best weight then.
        let mut seen: Vec<(usize, f64)> = Vec::new();
        let mut active: Vec<EngineScore> = Vec::new();
        let mut done: Vec<EngineScore> = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let round = i + 1;
            for &(engine, tier) in self.holders(*h) {
                let e = engine as usize;
                if seen.len() <= e {
                    seen.resize(e + 1, (0, 0.0));
                }
                let w = weights.of(tier);
                seen[e] = match seen[e] {
                    (r, best) if r == round => (round, best.max(w)),
                    _ => (round, w),
                };
            }
            let held = |engine: EngineId| match seen.get(engine as usize) {
                Some(&(r, w)) if r == round => Some(w),
                _ => None,
            };
            if i == 0 {
                let mut first: Vec<EngineId> = self.holders(*h).iter().map(|m| m.0).collect();
                first.sort_unstable();
                first.dedup();
                active.extend(
                    first
                        .into_iter()
                        .filter(|e| candidates.is_none_or(|c| c.contains(e)))
                        .map(|engine| EngineScore {
                            engine,
                            matched_blocks: 0,
                            score: 0.0,
                        }),
                );
            }
            let mut k = 0;
            while k < active.len() {
                match held(active[k].engine) {
                    Some(w) => {
                        active[k].matched_blocks += 1;
                        active[k].score += w;
                        k += 1;
                    }
                    None => done.push(active.swap_remove(k)),
                }
            }
            if active.is_empty() {
                break;
            }
        }
        done.append(&mut active);
        done.sort_by_key(|s| s.engine);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_a_consecutive_prefix_at_the_best_tier_and_bounds_holders() {
        let h: Vec<BlockHash> = (1..=3).map(BlockHash::new).collect();
        let mut r = ReferenceIndex::new(Some(2));
        assert_eq!(r.store(0, Tier::Cpu, &h), 3);
        assert_eq!(r.store(0, Tier::Gpu, &h[..1]), 1);
        assert_eq!(r.store(1, Tier::Gpu, &h[..2]), 2);
        // Block 1 had three holders: the oldest, (0, Cpu), gave its place.
        assert_eq!(r.holders(h[0]), &[(0, Tier::Gpu), (1, Tier::Gpu)]);
        let s = r.score(&h, None, &TierWeights::default());
        assert_eq!(
            s.iter().map(|s| s.matched_blocks).collect::<Vec<_>>(),
            [3, 2]
        );
        assert_eq!(r.remove(1, Tier::Gpu, &h[1..2]), 1);
        assert_eq!(
            r.score(&h, Some(&[1]), &TierWeights::default())[0].matched_blocks,
            1
        );
        assert_eq!((r.clear_engine(0), r.keys()), (3, 1));
    }
}
