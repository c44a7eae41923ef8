//! The rule on hand-made layouts, each case one clause of vLLM's managers (the comparison with
//! vLLM's own code is `tests/hybrid_vllm.rs`).

use std::collections::HashSet;

use super::*;

const UNIT: u32 = 16;

fn full(k: u32) -> GroupSpec {
    GroupSpec {
        kind: GroupKind::Full,
        block_units: k,
    }
}

fn swa(window: u32, k: u32) -> GroupSpec {
    GroupSpec {
        kind: GroupKind::SlidingWindow { window },
        block_units: k,
    }
}

fn mamba(k: u32) -> GroupSpec {
    GroupSpec {
        kind: GroupKind::Mamba,
        block_units: k,
    }
}

/// The hit with `held` as a set of (group, unit).
fn hit(layout: &Layout, units: usize, max_tokens: u64, held: &[(usize, usize)]) -> u64 {
    let set: HashSet<(usize, usize)> = held.iter().copied().collect();
    layout.hit_tokens(units, max_tokens, |g, u| {
        assert!(u < units, "asked for unit {u} of {units}");
        set.contains(&(g, u))
    })
}

fn units(g: usize, range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    range.map(|u| (g, u)).collect()
}

#[test]
fn one_full_group_of_one_unit_is_the_consecutive_prefix_capped_by_the_last_token() {
    let l = Layout::full_attention(UNIT, 1);
    assert!(l.is_plain());
    let held = [units(0, 0..3), units(0, 4..6)].concat();
    assert_eq!(hit(&l, 6, 6 * 16 - 1, &held), 3 * 16);
    // A prompt of exactly 3 units reuses at most 2 (vLLM recomputes the last token).
    assert_eq!(hit(&l, 3, 3 * 16 - 1, &units(0, 0..3)), 2 * 16);
    assert_eq!(hit(&l, 3, 3 * 16, &units(0, 0..3)), 3 * 16);
}

#[test]
fn an_engine_block_of_two_units_hits_in_whole_blocks_only() {
    let l = Layout::full_attention(UNIT, 2);
    assert!(!l.is_plain());
    // Blocks are keyed by their last unit: 1, 3, 5.
    assert_eq!(hit(&l, 6, 1000, &[(0, 1), (0, 3)]), 64);
    // Interior units alone (translated engines store them too) add nothing past a block.
    assert_eq!(hit(&l, 6, 1000, &[(0, 1), (0, 3), (0, 4)]), 64);
    // A prompt of 5 units has 2 whole blocks.
    assert_eq!(hit(&l, 5, 1000, &units(0, 0..5)), 64);
}

#[test]
fn sliding_window_needs_the_blocks_before_the_point_not_the_prefix() {
    // Window 33 tokens, block 16: ceil(32 / 16) = 2 blocks before the point.
    let l = Layout::new(UNIT, vec![swa(33, 1)]).expect("valid layout");
    // Blocks 0, 1 evicted; 4, 5 held: the hit is 6 blocks (the window before token 96).
    assert_eq!(hit(&l, 8, 6 * 16, &[(0, 4), (0, 5)]), 96);
    // Only block 5: no two contiguous blocks, and the run does not reach block 0.
    assert_eq!(hit(&l, 8, 6 * 16, &[(0, 5)]), 0);
    // A run that reaches block 0 counts even when shorter than the window.
    assert_eq!(hit(&l, 8, 6 * 16, &[(0, 0)]), 16);
}

#[test]
fn full_and_sliding_window_meet_at_the_point_both_allow() {
    let l = Layout::new(UNIT, vec![swa(33, 1), full(1)]).expect("valid layout");
    assert_eq!(l.align_units(), 1);
    // Full holds 0..6; the window group holds 0 and 3..4: its rightmost point within 6 blocks
    // is 5 (blocks 3, 4).
    let held = [units(1, 0..6), vec![(0, 0), (0, 3), (0, 4)]].concat();
    assert_eq!(hit(&l, 8, 1000, &held), 5 * 16);
    // A full-attention-only rule would say 6 blocks.
    let only_full = Layout::full_attention(UNIT, 1);
    assert_eq!(hit(&only_full, 8, 1000, &units(0, 0..6)), 6 * 16);
}

#[test]
fn mamba_at_whole_blocks_takes_the_rightmost_state_within_the_full_prefix() {
    // Full and Mamba both 4 units: a Mamba group wider than a unit turns on vLLM's partial
    // hash hits, so the hit aligns to one unit.
    let l = Layout::new(UNIT, vec![full(4), mamba(4)]).expect("valid layout");
    assert!(l.fine_grained());
    assert_eq!(l.align_units(), 1);
    // Full blocks 0..2 (units 3, 7); Mamba states at the end of block 0 and at unit 5.
    let held = vec![(0, 3), (0, 7), (1, 3), (1, 5)];
    // Full gives 8 units; Mamba's rightmost state within 8 units is unit 5: 6 units. Full
    // accepts 6 units (downward-closed).
    assert_eq!(hit(&l, 12, 1000, &held), 6 * 16);
    // Without a Mamba state inside the prefix, nothing is reused.
    assert_eq!(hit(&l, 12, 1000, &[(0, 3), (0, 7)]), 0);
}

#[test]
fn a_partial_full_attention_entry_counts_only_when_fine_grained() {
    let fine = Layout::new(UNIT, vec![full(4), mamba(4)]).expect("valid layout");
    // Full block 0 held, and a partial entry at unit 5 (the prompt tail of an earlier
    // request); Mamba state at unit 5.
    let held = vec![(0, 3), (0, 5), (1, 5)];
    assert_eq!(hit(&fine, 12, 1000, &held), 6 * 16);
    // Full attention and a window group of 4 units: block-aligned, partial entries ignored.
    let coarse = Layout::new(UNIT, vec![full(4), swa(17, 4)]).expect("valid layout");
    assert!(!coarse.fine_grained());
    assert_eq!(coarse.align_units(), 4);
    let held = vec![(0, 3), (0, 5), (1, 3)];
    assert_eq!(hit(&coarse, 12, 1000, &held), 4 * 16);
}

#[test]
fn groups_of_one_spec_must_all_hold_a_block() {
    let l = Layout::new(UNIT, vec![full(1), swa(17, 1), swa(17, 1)]).expect("valid layout");
    let held = [units(0, 0..4), vec![(1, 2), (1, 3), (2, 3)]].concat();
    // Groups 1 and 2 both hold only block 3 (window needs one block): point 4.
    assert_eq!(hit(&l, 6, 1000, &held), 4 * 16);
    let held = [units(0, 0..4), vec![(1, 3)]].concat();
    // Group 2 holds nothing; group 1's block 3 alone is not enough.
    assert_eq!(hit(&l, 6, 1000, &held), 0);
}

#[test]
fn kinds_parse_as_events_name_them() {
    assert_eq!(GroupKind::parse(None, None), Ok(GroupKind::Full));
    assert_eq!(
        GroupKind::parse(Some("mla_attention"), None),
        Ok(GroupKind::Full)
    );
    assert_eq!(
        GroupKind::parse(Some("sliding_window_mla"), Some(128)),
        Ok(GroupKind::SlidingWindow { window: 128 })
    );
    assert_eq!(
        GroupKind::parse(Some("sliding_window"), None),
        Err(LayoutError::MissingWindow)
    );
    assert!(matches!(
        GroupKind::parse(Some("chunked_local_attention"), None),
        Err(LayoutError::UnsupportedKind(_))
    ));
    assert_eq!(
        GroupKind::parse_chunked(Some("chunked_local_attention"), None, Some(8192)),
        Ok(GroupKind::ChunkedLocal { chunk: 8192 })
    );
    assert!(Layout::new(UNIT, vec![]).is_err());
}

#[test]
fn chunked_local_attention_counts_the_blocks_before_the_last_chunk_as_computed() {
    // vLLM's own examples (ChunkedLocalAttentionManager.find_longest_cache_hit): chunk 8,
    // block 4.
    let chunked = |block_units| GroupSpec {
        kind: GroupKind::ChunkedLocal { chunk: 8 },
        block_units,
    };
    let l = Layout::new(4, vec![chunked(1)]).expect("valid");
    // Max 15: tokens 0-7 are outside the window; block 2 (tokens 8-11) must be held.
    assert_eq!(l.hit_tokens(4, 15, |_, u| u == 2), 12);
    assert_eq!(l.hit_tokens(4, 15, |_, _| false), 8);
    // Max 16: every block before token 16 is outside the window.
    assert_eq!(l.hit_tokens(5, 16, |_, _| false), 16);
    // Beside full attention, the full group's prefix bounds it.
    let l = Layout::new(4, vec![full(1), chunked(1)]).expect("valid");
    assert_eq!(l.hit_tokens(5, 16, |g, u| g == 0 && u < 2), 8);
}

#[test]
fn a_known_prefix_gives_the_hit_the_lookups_give() {
    let mut rng = crate::mix::SplitMix64::new(40);
    let layouts = [
        vec![full(1), swa(33, 1)],
        vec![swa(129, 1), full(1)],
        vec![full(1), mamba(4)],
        vec![full(1)],
    ];
    for round in 0..400 {
        let layout = Layout::new(UNIT, layouts[round % layouts.len()].clone()).expect("valid");
        let units = 1 + rng.below(40) as usize;
        let mut set = HashSet::new();
        for g in 0..layout.groups().len() {
            let dense = rng.below(4);
            for u in 0..units {
                if rng.below(4) < dense {
                    set.insert((g, u));
                }
            }
        }
        let full_group = layout
            .groups()
            .iter()
            .position(|g| g.kind == GroupKind::Full)
            .expect("a full group");
        let max = rng.below(units as u64 * 16 + 1);
        let walked = (max / 16).min(units as u64);
        let prefix = (0..walked)
            .take_while(|&u| set.contains(&(full_group, u as usize)))
            .count() as u64;
        let asked = layout.hit_tokens(units, max, |g, u| set.contains(&(g, u)));
        let known = layout.hit_tokens_known(units, max, Some((full_group, prefix)), |g, u| {
            assert!(g != full_group, "the known group is not asked");
            set.contains(&(g, u))
        });
        assert_eq!(asked, known, "round {round}");
    }
}
