//! Which block of a `BlockStored` run each of its hashes stands for, when the run carries
//! fewer hashes than its tokens cover blocks.
//!
//! vLLM's `BlockPool.cache_full_blocks` (`vllm/v1/core/block_pool.py`) publishes one hash per
//! block it caches in `[num_cached, num_full)`, in order, and leaves null and masked blocks out
//! of `block_hashes`, while `token_ids` cover the whole range and the parent is the block
//! before it. A run's hashes are thus a subsequence of its blocks; which one is what this
//! module decides, from two kinds of evidence:
//!
//! - **anchors**: a hash whose block is known, because the engine's map holds it (in any
//!   group: a block's digest is the same in every group of an engine, and the full-attention
//!   run of the same step names every block) with a digest one of the run's blocks has;
//! - **vLLM's rules**, where they leave one answer: `k` hashes between two anchors `k + 1`
//!   blocks apart are the blocks between them (and so at the run's ends); and a sliding
//!   window (`SlidingWindowManager.reachable_block_mask`) caches only the tails of
//!   `ceil((window - 1) / block)` blocks that end on a hit boundary, so its hashes form
//!   contiguous stretches that end on an aligned block, which the engine's other groups name:
//!   the hashes before an anchor with no other anchor between are the blocks right before it.
//!
//! Invariants: a placement is strictly increasing, each hash at most one block; anchors out of
//! order (no subsequence) place nothing; a hash no evidence places is left out (`None`), never
//! guessed. The sliding-window rule assumes vLLM's mask without the EAGLE shift (an EAGLE
//! drafter without lookahead hashing, which the hit rule does not model either: `crate::hit`).

use super::map::TranslationMap;
use crate::hashing::BlockDigest;
use crate::EngineHash;

/// How a run's unanchored hashes may be placed besides counting (its group kind's rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rule {
    /// Only where the count leaves one answer (full attention, Mamba, any other kind).
    Counted,
    /// Sliding window: hashes before an anchor are the blocks right before it.
    TailsBeforeAnchors,
}

/// Places `anchors.len()` hashes among `blocks` blocks: `anchors[j]` is hash `j`'s block when
/// known. Writes each hash's block (`None`: not placed) to `out`.
pub(super) fn place(
    blocks: usize,
    anchors: &[Option<u32>],
    rule: Rule,
    out: &mut Vec<Option<u32>>,
) {
    out.clear();
    out.extend_from_slice(anchors);
    if !consistent(blocks, anchors) {
        out.iter_mut().for_each(|p| *p = None);
        return;
    }
    // Each stretch of unanchored hashes between two bounds (an anchor, or the run's ends).
    let mut j = 0;
    while j < out.len() {
        if out[j].is_some() {
            j += 1;
            continue;
        }
        let start = j;
        while j < out.len() && out[j].is_none() {
            j += 1;
        }
        let count = j - start;
        let after = start
            .checked_sub(1)
            .and_then(|i| out[i])
            .map_or(0, |a| a as usize + 1);
        let before = out.get(j).copied().flatten();
        let slots = before.map_or(blocks, |b| b as usize) - after;
        let first = if count == slots {
            Some(after)
        } else if let (Rule::TailsBeforeAnchors, Some(b)) = (rule, before) {
            Some(b as usize - count)
        } else {
            None
        };
        if let Some(first) = first {
            for (k, p) in out[start..j].iter_mut().enumerate() {
                *p = Some((first + k) as u32);
            }
        }
    }
}

impl Rule {
    /// The rule of a group of kind `kind` (`kv_cache_spec_kind`).
    pub(super) fn of(kind: Option<&str>) -> Self {
        match kind {
            Some("sliding_window") | Some("sliding_window_mla") => Rule::TailsBeforeAnchors,
            _ => Rule::Counted,
        }
    }
}

/// Each of `hashes`' block among `digests` (the chained digest of every block the run's
/// tokens cover) where the engine's map knows the hash, looked up in `group` first, then in
/// `groups` (written to `out`, `None`: not known). False when a known hash's digest is none of
/// the run's blocks: the run is not the chain the map says (place nothing).
pub(super) fn anchors(
    map: &TranslationMap,
    (group, groups): (u32, &[(u32, crate::GroupSpec)]),
    hashes: &[EngineHash],
    digests: &[BlockDigest],
    out: &mut Vec<Option<u32>>,
) -> bool {
    out.clear();
    let mut from = 0;
    for &hash in hashes {
        let others = groups.iter().map(|&(g, _)| g).filter(|&g| g != group);
        let tip = std::iter::once(group)
            .chain(others)
            .find_map(|g| map.get(&hash.in_group(g)))
            .map(|t| t.tip);
        let Some(tip) = tip else {
            out.push(None);
            continue;
        };
        // Anchors come in chain order: search on from the last one, then (to tell a
        // contradiction from a miss) before it.
        let at = digests[from..]
            .iter()
            .position(|d| *d == tip)
            .map(|i| from + i)
            .or_else(|| digests[..from].iter().position(|d| *d == tip));
        let Some(at) = at else {
            return false;
        };
        from = at + 1;
        out.push(Some(at as u32));
    }
    true
}

/// Whether the anchors can be a subsequence of `blocks` blocks: strictly increasing, with
/// as many blocks between two of them (and before the first, after the last) as there are
/// hashes.
fn consistent(blocks: usize, anchors: &[Option<u32>]) -> bool {
    // The previous anchor as (hash, block); the run's start is hash -1 at block -1.
    let (mut pj, mut pa) = (-1i64, -1i64);
    for (j, a) in anchors.iter().enumerate() {
        let Some(a) = a else {
            continue;
        };
        let (j, a) = (j as i64, i64::from(*a));
        if a - pa < j - pj {
            return false;
        }
        (pj, pa) = (j, a);
    }
    blocks as i64 - pa >= anchors.len() as i64 - pj
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(blocks: usize, anchors: &[Option<u32>], rule: Rule) -> Vec<Option<u32>> {
        let mut out = Vec::new();
        place(blocks, anchors, rule, &mut out);
        out
    }

    const A: Option<u32> = None;

    #[test]
    fn a_count_that_leaves_one_answer_places_the_hashes() {
        // Two hashes between anchors three blocks apart: the blocks between.
        let got = placed(8, &[Some(1), A, A, Some(4)], Rule::Counted);
        assert_eq!(got, [Some(1), Some(2), Some(3), Some(4)]);
        // At the run's ends.
        let got = placed(5, &[A, Some(1), A, A, A], Rule::Counted);
        assert_eq!(got, [Some(0), Some(1), Some(2), Some(3), Some(4)]);
    }

    #[test]
    fn a_count_that_leaves_several_answers_places_nothing() {
        let got = placed(8, &[Some(1), A, Some(5)], Rule::Counted);
        assert_eq!(got, [Some(1), None, Some(5)]);
        // A Mamba state alone in a multi-block step: which block is not known.
        assert_eq!(placed(3, &[A], Rule::Counted), [None]);
    }

    #[test]
    fn a_sliding_window_places_hashes_right_before_their_anchor() {
        // mla64 + swa-mla16, window 128: eight blocks ending on a 64-token boundary, of which
        // the blocks on boundaries (every fourth) are named by the MLA group.
        let anchors = [A, A, A, Some(23), A, A, A, Some(27)];
        let got = placed(28, &anchors, Rule::TailsBeforeAnchors);
        let want: Vec<Option<u32>> = (20..28).map(Some).collect();
        assert_eq!(got, want);
        // Hashes after the last anchor have no anchor to end on.
        let got = placed(30, &[A, Some(5), A], Rule::TailsBeforeAnchors);
        assert_eq!(got, [Some(4), Some(5), None]);
    }

    #[test]
    fn anchors_that_cannot_be_a_subsequence_place_nothing() {
        for anchors in [
            vec![Some(3), Some(2)],       // out of order
            vec![A, A, Some(1)],          // no room before
            vec![Some(3), A, A],          // no room after (5 blocks)
            vec![Some(7)],                // past the run
            vec![Some(1), A, A, Some(3)], // no room between
        ] {
            let got = placed(5, &anchors, Rule::TailsBeforeAnchors);
            assert!(got.iter().all(Option::is_none), "{anchors:?}: {got:?}");
        }
    }

    #[test]
    fn negative_control_pairing_by_position_is_not_the_placement() {
        // What the translation did before: hash j at block j. vLLM's Mamba state of a
        // three-block step is block 2; one anchor says so.
        let got = placed(3, &[Some(2)], Rule::Counted);
        assert_ne!(got, [Some(0)]);
        assert_eq!(got, [Some(2)]);
    }
}
