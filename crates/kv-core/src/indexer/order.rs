//! The order of a score's holders: score descending (in `f64::total_cmp`'s order), then
//! matched blocks descending, then name.
//!
//! At 1,024 pods nearly every pod holds a prompt's first block, so a score orders a thousand
//! holders; a comparison sort of them was most of a score's time. Holders listed in name
//! order fall into few distinct (score, matched) groups (the depths the prompt reaches), so
//! [`group_in_name_order`] places them by counting, stable, in O(holders x groups) at worst;
//! past [`MAX_GROUPS`] it declines and the caller sorts by [`holder_order`].

use super::scored::{PodRef, PodScore};
use crate::index::DenseView;

/// The most distinct (score, matched) groups [`group_in_name_order`] takes on.
pub(super) const MAX_GROUPS: usize = 64;

/// Working memory of [`group_in_name_order`] (reused across scores).
#[derive(Default)]
pub(super) struct GroupScratch {
    /// Distinct keys in first-seen order, with their holder counts, then their next slots.
    groups: Vec<(u128, usize)>,
    /// Per holder, its group.
    group_of: Vec<u8>,
    /// Groups, best first.
    ranked: Vec<u8>,
    /// The holders in their final order (swapped with the caller's list).
    placed: Vec<PodScore>,
}

/// A holder's (score, matched) as one integer, ascending = best first.
#[inline]
fn group_key(score: f64, matched_blocks: u32) -> u128 {
    let bits = score.to_bits() as i64;
    // `total_cmp`'s key, then flipped to unsigned order: ascending with the score.
    let score = ((bits ^ (((bits >> 63) as u64) >> 1) as i64) as u64) ^ (1 << 63);
    ((!score as u128) << 32) | (u32::MAX - matched_blocks) as u128
}

/// A known pod's place among holders as one integer, ascending: its group's key, then its
/// name (its rank in `dense`).
#[inline]
pub(super) fn holder_order(p: &PodScore, dense: &DenseView) -> u128 {
    let rank = match p.pod {
        PodRef::Known(i) => dense.name_rank(i),
        PodRef::Speculative(_) | PodRef::Unknown(_) => u32::MAX,
    };
    (group_key(p.score, p.matched_blocks) << 32) | rank as u128
}

/// Orders `holders`, listed in name order, best first, keeping name order within each
/// (score, matched) group. Returns `false` (and leaves them as they were) past
/// [`MAX_GROUPS`] groups.
pub(super) fn group_in_name_order(holders: &mut Vec<PodScore>, s: &mut GroupScratch) -> bool {
    s.groups.clear();
    s.group_of.clear();
    let mut last = 0;
    for p in holders.iter() {
        let key = group_key(p.score, p.matched_blocks);
        let g = if s.groups.get(last).is_some_and(|g| g.0 == key) {
            last
        } else if let Some(g) = s.groups.iter().position(|g| g.0 == key) {
            g
        } else if s.groups.len() < MAX_GROUPS {
            s.groups.push((key, 0));
            s.groups.len() - 1
        } else {
            return false;
        };
        s.groups[g].1 += 1;
        s.group_of.push(g as u8);
        last = g;
    }
    if s.groups.len() <= 1 {
        return true; // one group: name order is the order
    }
    s.ranked.clear();
    s.ranked.extend(0..s.groups.len() as u8);
    let groups = &mut s.groups;
    s.ranked.sort_unstable_by_key(|&g| groups[g as usize].0);
    // Counts become each group's first slot.
    let mut at = 0;
    for &g in &s.ranked {
        let n = groups[g as usize].1;
        groups[g as usize].1 = at;
        at += n;
    }
    s.placed.clear();
    s.placed.extend_from_slice(holders);
    for (p, &g) in holders.iter().zip(&s.group_of) {
        let slot = &mut groups[g as usize].1;
        s.placed[*slot] = *p;
        *slot += 1;
    }
    std::mem::swap(holders, &mut s.placed);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SplitMix64;

    /// `n` known holders in name order (pod index = rank), scores drawn from `scores`.
    fn holders(n: u32, scores: &[f64], seed: u64) -> Vec<PodScore> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|i| PodScore {
                pod: PodRef::Known(i),
                score: scores[(rng.next_u64() % scores.len() as u64) as usize],
                matched_blocks: (rng.next_u64() % 4) as u32,
                speculative_blocks: 0,
                rank: None,
            })
            .collect()
    }

    /// What every order must agree with: the comparator on the fields, names by index.
    fn by_comparator(v: &mut [PodScore]) {
        let index = |p: &PodScore| match p.pod {
            PodRef::Known(i) => i,
            _ => u32::MAX,
        };
        v.sort_unstable_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(b.matched_blocks.cmp(&a.matched_blocks))
                .then(index(a).cmp(&index(b)))
        });
    }

    fn bits(v: &[PodScore]) -> Vec<(u64, u32, PodRef)> {
        v.iter()
            .map(|p| (p.score.to_bits(), p.matched_blocks, p.pod))
            .collect()
    }

    const SCORES: [f64; 9] = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 1e9, -1.0, f64::INFINITY];

    #[test]
    fn the_holder_key_orders_as_the_comparator_does() {
        let mut want = holders(2_000, &SCORES, 7);
        let mut got = want.clone();
        let rank = |p: &PodScore| match p.pod {
            PodRef::Known(i) => i,
            _ => u32::MAX,
        };
        got.sort_unstable_by_key(|p| {
            (group_key(p.score, p.matched_blocks) << 32) | rank(p) as u128
        });
        by_comparator(&mut want);
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn grouping_in_name_order_orders_as_the_comparator_does_and_declines_past_its_bound() {
        let mut scratch = GroupScratch::default();
        for (n, seed) in [(0, 1), (1, 2), (5, 3), (1_024, 4), (3_000, 5)] {
            let mut want = holders(n, &SCORES, seed);
            let mut got = want.clone();
            assert!(group_in_name_order(&mut got, &mut scratch));
            by_comparator(&mut want);
            assert_eq!(bits(&got), bits(&want), "{n} holders");
        }
        // 100 distinct scores: more groups than it takes on; the list is left as it was.
        let many: Vec<f64> = (0..100).map(f64::from).collect();
        let before = holders(500, &many, 6);
        let mut got = before.clone();
        assert!(!group_in_name_order(&mut got, &mut scratch));
        assert_eq!(bits(&got), bits(&before));
    }
}
