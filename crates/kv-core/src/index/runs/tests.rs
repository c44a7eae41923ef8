//! The run index against a plain model (hash -> member set, probed per block), under random
//! stores, removals in any order (holes at every offset) and clears.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::RunIndex;
use crate::{mix64, BlockHash, SplitMix64};

/// The reference: memberships per block, a query walks block by block.
#[derive(Default)]
struct Model {
    held: HashMap<u64, BTreeSet<u32>>,
}

impl Model {
    fn store(&mut self, member: u32, hashes: &[BlockHash]) {
        for h in hashes {
            self.held.entry(h.get()).or_default().insert(member);
        }
    }

    fn remove(&mut self, member: u32, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(set) = self.held.get_mut(&h.get()) {
                set.remove(&member);
                if set.is_empty() {
                    self.held.remove(&h.get());
                }
            }
        }
    }

    fn clear(&mut self, member: u32) {
        self.held.retain(|_, set| {
            set.remove(&member);
            !set.is_empty()
        });
    }

    fn score(&self, prompt: &[BlockHash]) -> BTreeMap<u32, u32> {
        let mut out = BTreeMap::new();
        let Some(first) = prompt.first().and_then(|h| self.held.get(&h.get())) else {
            return out;
        };
        let mut alive = first.clone();
        for (j, h) in prompt.iter().enumerate().skip(1) {
            let here = self.held.get(&h.get()).cloned().unwrap_or_default();
            for m in alive.difference(&here) {
                out.insert(*m, j as u32);
            }
            alive = alive.intersection(&here).copied().collect();
        }
        for m in alive {
            out.insert(m, prompt.len() as u32);
        }
        out
    }
}

fn scores(index: &RunIndex, prompt: &[BlockHash]) -> BTreeMap<u32, u32> {
    let mut out = BTreeMap::new();
    let mut alive = Vec::new();
    index.score(prompt, &mut alive, |m, d| {
        assert!(out.insert(m, d).is_none(), "member {m} reported twice");
    });
    out
}

/// Chains of a small prompt tree: prompt `p` shares its first blocks with prompt `p / 3`.
fn prompts(count: usize, len: usize, rng: &mut SplitMix64) -> Vec<Vec<BlockHash>> {
    let mut out: Vec<Vec<BlockHash>> = Vec::new();
    for p in 0..count {
        let shared = if p == 0 {
            0
        } else {
            (rng.next_u64() % len as u64) as usize
        };
        let mut chain: Vec<BlockHash> = if p == 0 {
            Vec::new()
        } else {
            out[p / 3][..shared].to_vec()
        };
        while chain.len() < len {
            chain.push(BlockHash::new(mix64(rng.next_u64()) | 1));
        }
        out.push(chain);
    }
    out
}

fn check(index: &RunIndex, model: &Model, prompts: &[Vec<BlockHash>], step: usize) {
    for (p, prompt) in prompts.iter().enumerate() {
        assert_eq!(
            scores(index, prompt),
            model.score(prompt),
            "step {step}, prompt {p}"
        );
        for h in prompt {
            let expected: Vec<u32> = model
                .held
                .get(&h.get())
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            assert_eq!(index.holders(*h), expected, "step {step}, holders");
        }
    }
    assert_eq!(index.stats().blocks, model.held.len() as u64, "step {step}");
}

fn random_run(index: &mut RunIndex, model: &mut Model, members: u32, seed: u64, steps: usize) {
    let mut rng = SplitMix64::new(seed);
    let prompts = prompts(24, 40, &mut rng);
    for step in 0..steps {
        let member = (rng.next_u64() % members as u64) as u32;
        let prompt = &prompts[(rng.next_u64() % prompts.len() as u64) as usize];
        let a = (rng.next_u64() % prompt.len() as u64) as usize;
        let b = a + 1 + (rng.next_u64() % (prompt.len() - a) as u64) as usize;
        match rng.next_u64() % 10 {
            0..=4 => {
                let parent = a.checked_sub(1).map(|p| prompt[p]);
                index.store(member, parent, &prompt[a..b]);
                model.store(member, &prompt[a..b]);
            }
            5 | 6 => {
                // Tail first, one hash per event (as vLLM does).
                for h in prompt[a..b].iter().rev() {
                    index.remove(member, std::slice::from_ref(h));
                    model.remove(member, std::slice::from_ref(h));
                }
            }
            7 => {
                // A shuffled batch: holes anywhere.
                let mut hs = prompt[a..b].to_vec();
                for i in (1..hs.len()).rev() {
                    hs.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                index.remove(member, &hs);
                model.remove(member, &hs);
            }
            8 => {
                index.remove(member, &prompt[a..b]);
                model.remove(member, &prompt[a..b]);
            }
            _ => {
                if rng.next_u64().is_multiple_of(4) {
                    index.clear_member(member);
                    model.clear(member);
                }
            }
        }
        if step.is_multiple_of(7) {
            check(index, model, &prompts, step);
        }
    }
    check(index, model, &prompts, steps);
}

#[test]
fn random_stores_removals_and_clears_match_the_model() {
    for seed in 0..20 {
        let mut index = RunIndex::new(seed);
        let mut model = Model::default();
        random_run(&mut index, &mut model, 6, seed, 600);
    }
}

#[test]
fn many_holders_across_windows_match_the_model() {
    // Members spread over 1,024 ids: holder sets span many 64-member windows.
    for seed in 0..4 {
        let mut index = RunIndex::new(seed);
        let mut model = Model::default();
        let mut rng = SplitMix64::new(seed ^ 0xABCD);
        let prompt = prompts(1, 64, &mut rng).remove(0);
        for m in (0..1024).step_by(7) {
            index.store(m, None, &prompt[..32 + (m as usize % 32)]);
            model.store(m, &prompt[..32 + (m as usize % 32)]);
        }
        check(&index, &model, std::slice::from_ref(&prompt), 0);
        random_run(&mut index, &mut model, 1024, seed, 300);
    }
}

#[test]
fn a_hole_splits_a_run_and_a_refill_merges_it_back() {
    let mut rng = SplitMix64::new(9);
    let chain = prompts(1, 100, &mut rng).remove(0);
    let mut index = RunIndex::new(1);
    index.store(0, None, &chain);
    index.store(1, None, &chain);
    assert_eq!(index.stats().runs, 1, "one run, two holders");
    index.remove(1, &chain[50..51]);
    assert_eq!(index.stats().runs, 3, "the hole splits the run in three");
    assert_eq!(index.stats().splits_hole, 1);
    index.store(1, Some(chain[49]), &chain[50..51]);
    assert_eq!(index.stats().runs, 1, "the refill merges the three back");
    let mut alive = Vec::new();
    let mut got = Vec::new();
    index.score(&chain, &mut alive, |m, d| got.push((m, d)));
    got.sort_unstable();
    assert_eq!(got, vec![(0, 100), (1, 100)]);
}

#[test]
fn tail_first_removal_relabels_one_block_per_event() {
    let mut rng = SplitMix64::new(4);
    let chain = prompts(1, 1000, &mut rng).remove(0);
    let mut index = RunIndex::new(2);
    index.store(0, None, &chain);
    index.store(1, None, &chain);
    let before = index.stats().relabels;
    for h in chain.iter().rev().take(500) {
        index.remove(1, std::slice::from_ref(h));
    }
    let relabels = index.stats().relabels - before;
    assert!(
        relabels <= 1000,
        "{relabels} relabels for 500 tail removals"
    );
    assert_eq!(index.stats().runs, 2);
}

#[test]
fn a_forged_run_cannot_change_what_others_score() {
    let mut rng = SplitMix64::new(5);
    let honest = prompts(1, 30, &mut rng).remove(0);
    let mut index = RunIndex::new(3);
    // The forger knows the honest chain and stores it out of order, with gaps, before anyone.
    let forged: Vec<BlockHash> = honest.iter().rev().step_by(2).copied().collect();
    index.store(7, Some(honest[3]), &forged);
    index.store(0, None, &honest);
    let mut alive = Vec::new();
    let mut got = BTreeMap::new();
    index.score(&honest, &mut alive, |m, d| {
        got.insert(m, d);
    });
    assert_eq!(
        got.get(&0),
        Some(&30),
        "the honest member scores its whole chain"
    );
    assert!(got.get(&7).is_none_or(|&d| d <= 1));
}

#[test]
fn a_walk_crosses_id_chunks_and_run_ends_at_any_offset() {
    // 70,000 blocks take ids across the first 64Ki chunk; a second member holds a prefix that
    // ends past the chunk boundary and a third a stretch inside it, so runs end on both sides.
    let mut index = RunIndex::new(7);
    let mut model = Model::default();
    let chain: Vec<BlockHash> = (1..=70_000u64).map(|h| BlockHash::new(mix64(h))).collect();
    for (member, part) in [
        (0, &chain[..]),
        (1, &chain[..66_000]),
        (2, &chain[..65_530]),
    ] {
        index.store(member, None, part);
        model.store(member, part);
    }
    index.remove(2, &chain[65_000..65_010]);
    model.remove(2, &chain[65_000..65_010]);
    for len in [
        1, 65_000, 65_011, 65_535, 65_536, 65_537, 66_000, 66_001, 70_000,
    ] {
        assert_eq!(
            scores(&index, &chain[..len]),
            model.score(&chain[..len]),
            "prompt of {len} blocks"
        );
    }
}
