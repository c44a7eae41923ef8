//! The read path: lock-free lookups and the prefix-scoring walk.
//!
//! A reader pins the current table (`ArcSwap`), then walks the prompt's hashes; it takes no
//! lock and writes nothing shared. Each node is read under its seqlock, so a reader sees each
//! block's member list as of one moment; a chain segment with one member set is crossed with
//! O(log n) node reads through the continuation bitmap.

use super::slab::{NodeRead, Slab, MAX_MEMBERS, NO_WORDS};
use super::table::Table;
use super::types::{EngineId, EngineScore, Tier, TierWeights};
use super::{key, ModelIndex};
use crate::BlockHash;

impl ModelIndex {
    /// Who holds `hash` right now, as (engine, tier) pairs in store order.
    pub fn lookup(&self, hash: BlockHash) -> Vec<(EngineId, Tier)> {
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
        hashes: &[BlockHash],
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
}

/// Finds `hash`'s node, trying the chain first: the node after `prev`, then `prev`'s child
/// hint, then the table. Unvalidated (the caller reads the node under its seqlock).
#[inline(always)]
pub(super) fn locate(slab: &Slab, table: &Table, prev: Option<u32>, hash: u64) -> Option<u32> {
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
fn follow_segment(slab: &Slab, id: u32, words: u64, rest: &[BlockHash]) -> usize {
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
