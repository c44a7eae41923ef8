//! The read path: lock-free lookups and the prefix-scoring walk.
//!
//! A reader pins the current table (`ArcSwap`), then walks the prompt's hashes; it takes no
//! lock and writes nothing shared. Each node is read under its seqlock, so a reader sees each
//! block's member list as of one moment; a chain segment with one member set is crossed with
//! O(log n) node reads through the continuation bitmap.

use std::cell::RefCell;

use super::runs::RunScratch;
use super::slab::{NodeRead, Slab, NO_WORDS};
use super::table::Table;
use super::types::{EngineId, EngineScore, Tier, TierWeights};
use super::{key, member_engine, Lane, Lanes, ModelIndex};
use crate::marks::RoundMarks;
use crate::BlockHash;

/// A reader's working memory, kept per thread and reused by every call, so a score allocates
/// nothing once the thread has seen its largest member set and engine id. Per-engine marks
/// are [`RoundMarks`] instead of being cleared, so intersecting a set of `m` members with `a`
/// active engines costs O(m + a) whatever the fleet size.
#[derive(Default)]
struct Scratch {
    /// The members of the block last decoded.
    members: Vec<u32>,
    /// Engines still matching, with their score so far.
    active: Vec<EngineScore>,
    /// Each active engine's weight on the last decoded block (credited to the blocks after it
    /// that share its member set).
    last_weight: Vec<f64>,
    /// The engines of the last decoded set...
    seen: RoundMarks,
    /// ...and, per engine id, its best tier weight in that set.
    seen_weight: Vec<f64>,
    /// The engines this call is restricted to.
    candidates: RoundMarks,
    /// The run index's working memory (`engine: runs`).
    runs: RunScratch,
}

impl Scratch {
    /// Marks the candidates of this call; `false` when there is no restriction.
    fn mark_candidates(&mut self, candidates: Option<&[EngineId]>) -> bool {
        let Some(candidates) = candidates else {
            return false;
        };
        self.candidates.next_round();
        for &c in candidates {
            self.candidates.mark(c as usize);
        }
        true
    }

    /// Marks every engine of `members` (the set just decoded), in a new round, with its best
    /// tier weight; with `admit`, also appends engines not yet active (the prompt's first block).
    fn mark_members(&mut self, weights: &TierWeights, restricted: bool, admit: bool) {
        self.seen.next_round();
        for i in 0..self.members.len() {
            let m = self.members[i];
            let engine = member_engine(m);
            if restricted && !self.candidates.is_marked(engine as usize) {
                continue;
            }
            let e = engine as usize;
            if e >= self.seen_weight.len() {
                self.seen_weight.resize(e + 1, 0.0);
            }
            let w = weights.of(Tier::from_bits(m));
            if !self.seen.mark(e) {
                self.seen_weight[e] = self.seen_weight[e].max(w);
                continue;
            }
            self.seen_weight[e] = w;
            if admit {
                self.active.push(EngineScore {
                    engine,
                    matched_blocks: 0,
                    score: 0.0,
                });
                self.last_weight.push(0.0);
            }
        }
    }

    /// Credits `pending` blocks that shared the last decoded set to every active engine.
    fn credit(&mut self, pending: u32) {
        if pending == 0 {
            return;
        }
        for (a, w) in self.active.iter_mut().zip(&self.last_weight) {
            a.score += pending as f64 * w;
            a.matched_blocks += pending;
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl ModelIndex {
    /// Who holds `hash` right now, as (engine, tier) pairs: lane by lane, each in store order.
    pub fn lookup(&self, hash: BlockHash) -> Vec<(EngineId, Tier)> {
        let mut out = Vec::new();
        let lanes = match &self.lanes {
            Lanes::Nodes(lanes) => lanes,
            Lanes::Runs(lanes) => {
                for lane in lanes.iter() {
                    let held = lane.reader.lookup(hash);
                    out.extend(held.into_iter().map(|(s, t)| (lane.engine_of(s), t)));
                }
                return out;
            }
        };
        let hash = key(hash);
        let mut buf = Vec::new();
        for lane in lanes.iter() {
            let table = lane.table.load();
            let found = table
                .find(hash, |id| lane.slab.peek_hash(id))
                .is_some_and(|id| lane.slab.read_members(id, hash, &mut buf));
            if found {
                out.extend(buf.iter().map(|&m| (member_engine(m), Tier::from_bits(m))));
            }
        }
        out
    }

    /// Scores every engine that holds the prompt's first block: how many consecutive blocks
    /// from block 0 it holds, and their tier-weighted sum. `candidates` (any order), when
    /// given, restricts the result to those engines. Engines holding nothing are not listed;
    /// every holder is, however many pods hold a block.
    ///
    /// Lock-free; allocates nothing but `out`'s growth (and, once per thread, the working
    /// memory for the largest set and engine id it meets).
    pub fn score_engines(
        &self,
        hashes: &[BlockHash],
        candidates: Option<&[EngineId]>,
        weights: &TierWeights,
        out: &mut Vec<EngineScore>,
    ) {
        out.clear();
        let mut walk_lanes = |s: &mut Scratch| {
            let restricted = s.mark_candidates(candidates);
            // An engine lives in one lane, so the lanes' results never overlap.
            match &self.lanes {
                Lanes::Nodes(lanes) => {
                    for lane in lanes.iter() {
                        lane.walk(hashes, restricted, weights, s, out);
                    }
                }
                Lanes::Runs(lanes) => {
                    for lane in lanes.iter() {
                        let from = out.len();
                        let marks = &s.candidates;
                        let admit = restricted
                            .then_some(|slot| marks.is_marked(lane.engine_of(slot) as usize));
                        lane.reader.score(hashes, weights, admit, &mut s.runs, out);
                        for score in &mut out[from..] {
                            score.engine = lane.engine_of(score.engine);
                        }
                    }
                }
            }
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => walk_lanes(&mut scratch),
            // Only reachable if a walk re-entered itself on this thread; stay correct anyway.
            Err(_) => walk_lanes(&mut Scratch::default()),
        });
    }
}

impl Lane {
    /// The scoring walk over this lane (see [`ModelIndex::score_engines`]); appends to `out`.
    fn walk(
        &self,
        hashes: &[BlockHash],
        restricted: bool,
        weights: &TierWeights,
        s: &mut Scratch,
        out: &mut Vec<EngineScore>,
    ) {
        let table = self.table.load();
        let slab = &self.slab;
        s.active.clear();
        s.last_weight.clear();
        // Blocks since the last decoded one whose member set was the same (not yet credited).
        let mut pending = 0u32;
        let mut words = NO_WORDS;
        let mut prev: Option<u32> = None;
        let mut i = 0;
        while i < hashes.len() {
            let hash = key(hashes[i]);
            let node = locate(slab, &table, prev, hash);
            let read = match node {
                Some(id) => slab.read_node(id, hash, words, &mut s.members),
                None => NodeRead::Gone,
            };
            match read {
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
                NodeRead::Gone => s.members.clear(),
                NodeRead::Members(_, w) => words = w,
            }
            // The set changed: credit the blocks that shared the previous one, then intersect.
            s.credit(pending);
            pending = 0;
            s.mark_members(weights, restricted, i == 0);
            let mut k = 0;
            while k < s.active.len() {
                let e = s.active[k].engine as usize;
                if s.seen.is_marked(e) {
                    let w = s.seen_weight[e];
                    s.active[k].score += w;
                    s.active[k].matched_blocks += 1;
                    s.last_weight[k] = w;
                    k += 1;
                } else {
                    out.push(s.active.swap_remove(k));
                    s.last_weight.swap_remove(k);
                }
            }
            if s.active.is_empty() {
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
        s.credit(pending);
        out.extend_from_slice(&s.active);
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
    let holds = |j: usize| slab.holds_with(id + j as u32, key(rest[j - 1]), words);
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
