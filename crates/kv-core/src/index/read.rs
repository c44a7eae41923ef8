//! The read path over a model's lanes: lock-free lookups and the prefix-scoring walk.
//!
//! A reader walks each lane's run index through its [`RunReader`](super::RunReader) (no lock,
//! nothing shared written; `runs::read` has the protocol) and maps the lane's engine slots to
//! global ids. An engine lives in one lane, so the lanes' results never overlap.

use std::cell::RefCell;

use super::runs::RunScratch;
use super::types::{EngineId, EngineScore, Tier, TierWeights};
use super::ModelIndex;
use crate::marks::RoundMarks;
use crate::BlockHash;

/// A reader's working memory, kept per thread and reused by every call, so a score allocates
/// nothing once the thread has seen its largest member set and engine id.
#[derive(Default)]
struct Scratch {
    /// The engines this call is restricted to ([`RoundMarks`]: marking `c` candidates costs
    /// O(c) whatever the fleet size).
    candidates: RoundMarks,
    /// The run index's working memory.
    runs: RunScratch,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl ModelIndex {
    /// Who holds `hash` right now, as (engine, tier) pairs, lane by lane.
    pub fn lookup(&self, hash: BlockHash) -> Vec<(EngineId, Tier)> {
        let mut out = Vec::new();
        for lane in self.lanes.iter() {
            let held = lane.reader().lookup(hash);
            out.extend(held.into_iter().map(|(s, t)| (lane.engine_of(s), t)));
        }
        out
    }

    /// Whether `engine` holds each of `keys` (any tier), into `out`; consecutive blocks' keys
    /// cost about one table probe in all. Lock-free; allocates only `out`'s growth.
    pub fn holds_each(&self, keys: &[BlockHash], engine: EngineId, out: &mut Vec<bool>) {
        let lane = &self.lanes[self.lane_of(engine)];
        lane.reader()
            .holds_each(keys, engine / self.lanes.len() as u32, out);
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
            if let Some(candidates) = candidates {
                s.candidates.next_round();
                for &c in candidates {
                    s.candidates.mark(c as usize);
                }
            }
            for lane in self.lanes.iter() {
                let from = out.len();
                let marks = &s.candidates;
                let admit = candidates
                    .is_some()
                    .then_some(|slot| marks.is_marked(lane.engine_of(slot) as usize));
                lane.reader()
                    .score(hashes, weights, admit, &mut s.runs, out);
                for score in &mut out[from..] {
                    score.engine = lane.engine_of(score.engine);
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
