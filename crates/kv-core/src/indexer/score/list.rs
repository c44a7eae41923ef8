//! The listing of a score: each pod's standing after the walks (its best engine, the blocks
//! its recorded routings add) turned into [`ScoreResult::scores`]. Two passes, holders then
//! the rest, so only holders need sorting and the rest keep their order (name order, or the
//! caller's).
//!
//! Invariants: holders come first, best first (ties by matched blocks, then name); each
//! candidate is listed once (a pod named twice too); a candidate the index never heard of is
//! listed once, with 0; the scratch is reused, so a listing allocates nothing once it has
//! seen its largest fleet.

use std::collections::HashSet;

use super::super::order::{group_in_name_order, holder_order, GroupScratch};
use super::super::scored::{PodRef, PodScore};
use super::{Best, ScoreResult};
use crate::index::{DenseView, EngineDirectory, NO_POD};
use crate::marks::RoundMarks;

/// What the listing reuses from one score to the next.
#[derive(Default)]
pub(super) struct ListScratch {
    /// Speculative-only pods listed in this pass.
    spec_listed: RoundMarks,
    /// The pods listed in this pass (a candidate named twice is listed once).
    listed: RoundMarks,
    /// Candidates unknown to the index already listed in this call.
    unknown: HashSet<Box<str>>,
    /// The holders' ordering.
    groups: GroupScratch,
    /// Known pods that hold nothing of the prompt, in name order (listed after the holders).
    others: Vec<u32>,
}

/// A listed pod's (score, matched blocks, speculative blocks, rank).
type Entry = (f64, u32, u32, Option<u32>);

/// Each pod's standing after the walks, as the listing reads it.
pub(super) struct Standing<'a> {
    /// The directory the pods were scored against...
    pub directory: &'a EngineDirectory,
    /// ...and its dense view.
    pub dense: &'a DenseView,
    /// The speculative entries' directory, when the model has some.
    pub speculative: Option<&'a EngineDirectory>,
    /// The known pods holding the prompt's first block...
    pub holding: &'a RoundMarks,
    /// ...and their best engine, by pod index.
    pub best: &'a [Best],
    /// The pods known only by their speculative entries that hold the first block...
    pub spec_holding: &'a RoundMarks,
    /// ...and how many blocks, by speculative pod index.
    pub spec_len: &'a [u32],
    /// The weight of a speculative block.
    pub weight: f64,
}

impl Standing<'_> {
    /// Known pod `p`'s entry (0 when it holds nothing).
    fn known(&self, p: u32) -> Entry {
        match self.best.get(p as usize) {
            Some(&(score, matched, spec, rank)) if self.holding.is_marked(p as usize) => {
                let rank = (matched > 0 && self.dense.is_parallel(p)).then_some(rank);
                (score, matched, spec, rank)
            }
            _ => (0.0, 0, 0, None),
        }
    }

    /// The entry of speculative pod `sp`, a pod known only by its speculative entries.
    fn speculative_only(&self, sp: u32) -> Entry {
        match self.spec_len.get(sp as usize) {
            Some(&n) if self.spec_holding.is_marked(sp as usize) => {
                (self.weight * n as f64, n, n, None)
            }
            _ => (0.0, 0, 0, None),
        }
    }
}

fn push(
    out: &mut ScoreResult,
    pod: PodRef,
    (score, matched_blocks, speculative_blocks, rank): Entry,
) {
    out.scores.push(PodScore {
        pod,
        score,
        matched_blocks,
        speculative_blocks,
        rank,
    })
}

/// Lists `pods` (every pod the model knows when empty; `candidate_pods`: each candidate's pod
/// index, `NO_POD` when the index does not know it) into `out.scores`, holders first.
pub(super) fn list<S: AsRef<str>>(
    standing: &Standing<'_>,
    pods: &[S],
    candidate_pods: &[u32],
    s: &mut ListScratch,
    out: &mut ScoreResult,
) {
    for holders in [true, false] {
        if pods.is_empty() {
            list_every_pod(standing, holders, s, out);
        } else {
            list_candidates(standing, pods, candidate_pods, holders, s, out);
        }
        if holders {
            sort_holders(standing, pods.is_empty(), &mut s.groups, out);
        }
    }
}

/// One pass over every pod, in name order (the holders keep it within each (score, matched)
/// group). The holders' pass sets the others aside for the second.
fn list_every_pod(
    standing: &Standing<'_>,
    holders: bool,
    s: &mut ListScratch,
    out: &mut ScoreResult,
) {
    if holders {
        s.others.clear();
        for &p in standing.dense.name_order() {
            let entry = standing.known(p);
            if entry.1 > 0 {
                push(out, PodRef::Known(p), entry);
            } else {
                s.others.push(p);
            }
        }
    } else {
        out.scores.extend(s.others.iter().map(|&p| PodScore {
            pod: PodRef::Known(p),
            score: 0.0,
            matched_blocks: 0,
            speculative_blocks: 0,
            rank: None,
        }));
    }
    if let Some(sdir) = standing.speculative {
        for (name, sp) in sdir.pods() {
            let entry = standing.speculative_only(sp);
            if standing.directory.pod_index(name).is_none() && (entry.1 > 0) == holders {
                push(out, PodRef::Speculative(sp), entry);
            }
        }
    }
}

/// One pass over the candidates: each once, in the caller's order.
fn list_candidates<S: AsRef<str>>(
    standing: &Standing<'_>,
    pods: &[S],
    candidate_pods: &[u32],
    holders: bool,
    s: &mut ListScratch,
    out: &mut ScoreResult,
) {
    s.listed.next_round();
    s.spec_listed.next_round();
    s.unknown.clear();
    for (pod, &p) in pods.iter().zip(candidate_pods) {
        let name = pod.as_ref();
        if p != NO_POD {
            let entry = standing.known(p);
            if (entry.1 > 0) == holders && s.listed.mark(p as usize) {
                push(out, PodRef::Known(p), entry);
            }
            continue;
        }
        if let Some(sp) = standing.speculative.and_then(|d| d.pod_index(name)) {
            let entry = standing.speculative_only(sp);
            if (entry.1 > 0) == holders && s.spec_listed.mark(sp as usize) {
                push(out, PodRef::Speculative(sp), entry);
            }
            continue;
        }
        // Unknown to the index: listed with 0, once.
        if !holders && s.unknown.insert(name.into()) {
            push(
                out,
                PodRef::Unknown(out.unknown.len() as u32),
                (0.0, 0, 0, None),
            );
            out.unknown.push(name.into());
        }
    }
}

/// Sorts the holders (all of `out.scores` after the first pass): best first, ties by matched
/// blocks, then name.
fn sort_holders(
    standing: &Standing<'_>,
    every_pod: bool,
    groups: &mut GroupScratch,
    out: &mut ScoreResult,
) {
    let dense = standing.dense;
    // Ties by name (holders are always known pods).
    let name = |p: &PodScore| match p.pod {
        PodRef::Known(i) => standing.directory.pod(i).map_or("", |n| n),
        PodRef::Speculative(i) => standing
            .speculative
            .and_then(|d| d.pod(i))
            .map_or("", |n| n),
        PodRef::Unknown(_) => "",
    };
    // Two known pods compare by name rank: no name is read.
    let by_name = |a: &PodScore, b: &PodScore| match (a.pod, b.pod) {
        (PodRef::Known(i), PodRef::Known(j)) => dense.name_rank(i).cmp(&dense.name_rank(j)),
        _ => name(a).cmp(name(b)),
    };
    let known = out.scores.iter().all(|p| matches!(p.pod, PodRef::Known(_)));
    // Listed in name order (every pod, none speculative): placed by group.
    let grouped = known && every_pod && group_in_name_order(&mut out.scores, groups);
    if !grouped && known {
        // Known pods only (no speculative holder): one integer key per pod.
        out.scores.sort_unstable_by_key(|p| holder_order(p, dense));
    } else if !grouped {
        out.scores.sort_unstable_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(b.matched_blocks.cmp(&a.matched_blocks))
                .then_with(|| by_name(a, b))
        });
    }
}
