//! The run index's own cases (splits, merges, hints, free ranges, forged runs, chunk
//! crossings, a full index, table rebuilds, export, eviction), each checked against the one
//! reference ([`ReferenceIndex`]). Random streams run through the differential harness
//! (`kv-core/tests/index_differential.rs`, which also runs the bare run index).

use std::collections::{BTreeMap, BTreeSet};

use super::{RunIndex, RunScratch};
use crate::index::reference::ReferenceIndex;
use crate::index::types::{Tier, TierWeights};
use crate::{mix64, BlockHash, SplitMix64};

/// Room for every test's blocks.
const CAPACITY: u32 = 1 << 20;

/// The reference, in the shapes these cases compare.
#[derive(Default)]
struct Model(ReferenceIndex);

impl Model {
    fn store(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        self.0.store(engine, tier, hashes);
    }

    fn remove(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        self.0.remove(engine, tier, hashes);
    }

    fn clear(&mut self, engine: u32) {
        self.0.clear_engine(engine);
    }

    /// Per engine: blocks matched from block 0 (any tier), and their best tier weights.
    fn score(&self, prompt: &[BlockHash]) -> BTreeMap<u32, (u32, f64)> {
        let scores = self.0.score(prompt, None, &TierWeights::default());
        scores
            .into_iter()
            .map(|s| (s.engine, (s.matched_blocks, s.score)))
            .collect()
    }

    /// The holders of `h`, sorted.
    fn holders(&self, h: BlockHash) -> Vec<(u32, u8)> {
        let mut held: Vec<(u32, u8)> = self
            .0
            .holders(h)
            .iter()
            .map(|&(e, t)| (e, t as u8))
            .collect();
        held.sort_unstable();
        held
    }

    /// Every block with its sorted holders.
    fn blocks(&self) -> Vec<(BlockHash, Vec<(u32, u8)>)> {
        self.0.blocks().map(|(h, _)| (h, self.holders(h))).collect()
    }
}

fn scores(index: &RunIndex, prompt: &[BlockHash]) -> BTreeMap<u32, (u32, f64)> {
    let mut out = Vec::new();
    let mut scratch = RunScratch::default();
    index.reader().score(
        prompt,
        &TierWeights::default(),
        None::<fn(u32) -> bool>,
        &mut scratch,
        &mut out,
    );
    let mut map = BTreeMap::new();
    for s in out {
        assert!(
            map.insert(s.engine, (s.matched_blocks, s.score)).is_none(),
            "engine {} reported twice",
            s.engine
        );
    }
    map
}

fn assert_same_scores(
    got: &BTreeMap<u32, (u32, f64)>,
    want: &BTreeMap<u32, (u32, f64)>,
    what: &str,
) {
    let blocks =
        |m: &BTreeMap<u32, (u32, f64)>| m.iter().map(|(&e, &(n, _))| (e, n)).collect::<Vec<_>>();
    assert_eq!(blocks(got), blocks(want), "{what}");
    for (e, (_, w)) in want {
        let g = got[e].1;
        assert!(
            (g - w).abs() < 1e-9,
            "{what}: engine {e} weighs {g}, not {w}"
        );
    }
}

/// Store, remove and clear as the index does and as the model does.
fn store(
    index: &mut RunIndex,
    model: &mut Model,
    e: u32,
    t: Tier,
    parent: Option<BlockHash>,
    hs: &[BlockHash],
) {
    index.store_each(e, t, parent, hs, |_, _| {});
    model.store(e, t, hs);
}

fn remove(index: &mut RunIndex, model: &mut Model, e: u32, t: Tier, hs: &[BlockHash]) {
    index.remove(e, t, hs);
    model.remove(e, t, hs);
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
        let what = format!("step {step}, prompt {p}");
        assert_same_scores(&scores(index, prompt), &model.score(prompt), &what);
        for h in prompt {
            let expected = model.holders(*h);
            let mut got: Vec<(u32, u8)> = index
                .reader()
                .lookup(*h)
                .into_iter()
                .map(|(e, t)| (e, t as u8))
                .collect();
            got.sort_unstable();
            assert_eq!(got, expected, "step {step}, holders");
        }
    }
    assert_eq!(index.stats().blocks, model.0.keys() as u64, "step {step}");
}

/// Mostly GPU, sometimes another tier (an engine then holds a block in two tiers).
fn tier(rng: &mut SplitMix64) -> Tier {
    match rng.next_u64() % 8 {
        0 => Tier::Cpu,
        1 => Tier::Storage,
        _ => Tier::Gpu,
    }
}

fn random_run(index: &mut RunIndex, model: &mut Model, engines: u32, seed: u64, steps: usize) {
    let mut rng = SplitMix64::new(seed);
    let prompts = prompts(24, 40, &mut rng);
    for step in 0..steps {
        let e = (rng.next_u64() % engines as u64) as u32;
        let t = tier(&mut rng);
        let prompt = &prompts[(rng.next_u64() % prompts.len() as u64) as usize];
        let a = (rng.next_u64() % prompt.len() as u64) as usize;
        let b = a + 1 + (rng.next_u64() % (prompt.len() - a) as u64) as usize;
        match rng.next_u64() % 10 {
            0..=4 => {
                let parent = a.checked_sub(1).map(|p| prompt[p]);
                store(index, model, e, t, parent, &prompt[a..b]);
            }
            5 | 6 => {
                // Tail first, one hash per event (as vLLM does).
                for h in prompt[a..b].iter().rev() {
                    remove(index, model, e, t, std::slice::from_ref(h));
                }
            }
            7 => {
                // A shuffled batch: holes anywhere.
                let mut hs = prompt[a..b].to_vec();
                for i in (1..hs.len()).rev() {
                    hs.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                remove(index, model, e, t, &hs);
            }
            8 => remove(index, model, e, t, &prompt[a..b]),
            _ => {
                if rng.next_u64().is_multiple_of(4) {
                    index.clear_engine(e);
                    model.clear(e);
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
fn one_run_held_by_1024_engines_in_mixed_tiers() {
    let mut rng = SplitMix64::new(17);
    let chain = prompts(1, 50, &mut rng).remove(0);
    let mut index = RunIndex::new(17, CAPACITY);
    let mut model = Model::default();
    for e in 0..1024 {
        let t = if e % 3 == 0 { Tier::Cpu } else { Tier::Gpu };
        store(&mut index, &mut model, e, t, None, &chain);
    }
    assert_eq!(index.stats().runs, 1, "one run, 1,024 holders");
    assert_eq!(
        index.stats().holder_words,
        16 + 64,
        "1,024 engines' GPU bits in 16 words, a third's CPU nibbles in 64, once"
    );
    // A hole in every 100th engine's copy, at a different offset each.
    for e in (0..1024).step_by(100) {
        let t = if e % 3 == 0 { Tier::Cpu } else { Tier::Gpu };
        remove(
            &mut index,
            &mut model,
            e,
            t,
            &chain[(e as usize / 100) * 4..][..1],
        );
    }
    // A second tier for some: the best weight counts.
    store(&mut index, &mut model, 3, Tier::Gpu, None, &chain[..20]);
    check(&index, &model, std::slice::from_ref(&chain), 0);
    for e in 0..1024 {
        index.clear_engine(e);
        model.clear(e);
    }
    check(&index, &model, std::slice::from_ref(&chain), 1);
    assert_eq!(index.stats().runs, 0);
    assert_eq!(index.stats().holder_words, 0);
}

#[test]
fn a_hole_splits_a_run_and_a_refill_merges_it_back() {
    let mut rng = SplitMix64::new(9);
    let chain = prompts(1, 100, &mut rng).remove(0);
    let mut index = RunIndex::new(1, CAPACITY);
    index.store_each(0, Tier::Gpu, None, &chain, |_, _| {});
    index.store_each(1, Tier::Gpu, None, &chain, |_, _| {});
    assert_eq!(index.stats().runs, 1, "one run, two holders");
    index.remove(1, Tier::Gpu, &chain[50..51]);
    assert_eq!(index.stats().runs, 3, "the hole splits the run in three");
    assert_eq!(index.stats().splits_hole, 1);
    index.store_each(1, Tier::Gpu, Some(chain[49]), &chain[50..51], |_, _| {});
    assert_eq!(index.stats().runs, 1, "the refill merges the three back");
    let got: Vec<_> = scores(&index, &chain)
        .into_iter()
        .map(|(e, (n, _))| (e, n))
        .collect();
    assert_eq!(got, vec![(0, 100), (1, 100)]);
}

#[test]
fn a_run_hints_the_run_its_chain_went_on_in_last() {
    let mut rng = SplitMix64::new(12);
    let chain = prompts(1, 60, &mut rng).remove(0);
    let branch = prompts(1, 20, &mut rng).remove(0);
    let other = prompts(1, 10, &mut rng).remove(0);
    let mut index = RunIndex::new(3, CAPACITY);
    let run_of = |index: &RunIndex, h: BlockHash| {
        let id = index.find(h.get()).expect("indexed");
        index.id(id).run()
    };
    index.store_each(0, Tier::Gpu, None, &chain[..30], |_, _| {});
    // Another chain takes the ids after it, so the continuation jumps.
    index.store_each(1, Tier::Gpu, None, &other, |_, _| {});
    index.store_each(0, Tier::Gpu, Some(chain[29]), &chain[30..], |_, _| {});
    let first = index.run_slot(run_of(&index, chain[29]));
    assert_eq!(
        first.end(),
        index.find(chain[29].get()).expect("indexed") + 1
    );
    assert_eq!(first.after(), run_of(&index, chain[30]));
    // A second child of the same block, stored later, becomes the hint.
    index.store_each(2, Tier::Gpu, Some(chain[29]), &branch, |_, _| {});
    let first = index.run_slot(run_of(&index, chain[29]));
    assert_eq!(first.after(), run_of(&index, branch[0]));
    assert_ne!(run_of(&index, branch[0]), run_of(&index, chain[30]));
}

#[test]
fn a_new_chain_takes_the_free_range_it_fits_in_whole() {
    let mut rng = SplitMix64::new(13);
    let long = prompts(1, 300, &mut rng).remove(0);
    let holed = prompts(1, 300, &mut rng).remove(0);
    let new = prompts(1, 200, &mut rng).remove(0);
    let mut index = RunIndex::new(4, CAPACITY);
    index.store_each(0, Tier::Gpu, None, &long, |_, _| {});
    index.store_each(0, Tier::Gpu, None, &holed, |_, _| {});
    // 300 ids freed in one range, then fifteen holes of 10 ids (freed last: the newest).
    index.remove(0, Tier::Gpu, &long);
    for hole in holed.chunks(20) {
        index.remove(0, Tier::Gpu, &hole[..10]);
    }
    index.store_each(1, Tier::Gpu, None, &new, |_, _| {});
    let first = index.find(new[0].get()).expect("indexed");
    for (k, h) in new.iter().enumerate() {
        assert_eq!(index.find(h.get()), Some(first + k as u32), "block {k}");
    }
    assert_eq!(
        index.stats().runs,
        15 + 1,
        "the holed chain's pieces and the new chain"
    );
}

#[test]
fn tail_first_removal_relabels_one_block_per_event() {
    let mut rng = SplitMix64::new(4);
    let chain = prompts(1, 1000, &mut rng).remove(0);
    let mut index = RunIndex::new(2, CAPACITY);
    index.store_each(0, Tier::Gpu, None, &chain, |_, _| {});
    index.store_each(1, Tier::Gpu, None, &chain, |_, _| {});
    let before = index.stats().relabels;
    for h in chain.iter().rev().take(500) {
        index.remove(1, Tier::Gpu, std::slice::from_ref(h));
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
    let mut index = RunIndex::new(3, CAPACITY);
    // The forger knows the honest chain and stores it out of order, with gaps, before anyone.
    let forged: Vec<BlockHash> = honest.iter().rev().step_by(2).copied().collect();
    index.store_each(7, Tier::Gpu, Some(honest[3]), &forged, |_, _| {});
    index.store_each(0, Tier::Gpu, None, &honest, |_, _| {});
    let got = scores(&index, &honest);
    assert_eq!(
        got.get(&0).map(|s| s.0),
        Some(30),
        "the honest engine scores its whole chain"
    );
    assert!(got.get(&7).is_none_or(|s| s.0 <= 1));
}

#[test]
fn a_walk_crosses_id_chunks_and_run_ends_at_any_offset() {
    // 70,000 blocks take ids across the first 64Ki chunk; a second engine holds a prefix that
    // ends past the chunk boundary and a third a stretch inside it, so runs end on both sides.
    let mut index = RunIndex::new(7, CAPACITY);
    let mut model = Model::default();
    let chain: Vec<BlockHash> = (1..=70_000u64).map(|h| BlockHash::new(mix64(h))).collect();
    for (e, part) in [
        (0, &chain[..]),
        (1, &chain[..66_000]),
        (2, &chain[..65_530]),
    ] {
        store(&mut index, &mut model, e, Tier::Gpu, None, part);
    }
    remove(&mut index, &mut model, 2, Tier::Gpu, &chain[65_000..65_010]);
    for len in [
        1, 65_000, 65_011, 65_535, 65_536, 65_537, 66_000, 66_001, 70_000,
    ] {
        let what = format!("prompt of {len} blocks");
        assert_same_scores(
            &scores(&index, &chain[..len]),
            &model.score(&chain[..len]),
            &what,
        );
    }
}

#[test]
fn a_full_index_drops_new_blocks_and_counts_them() {
    let mut rng = SplitMix64::new(6);
    let chain = prompts(1, 40, &mut rng).remove(0);
    let mut index = RunIndex::new(8, 32);
    index.store_each(0, Tier::Gpu, None, &chain, |_, _| {});
    assert_eq!(index.stats().blocks, 32, "capacity");
    assert_eq!(index.stats().dropped_full, 8);
    let got = scores(&index, &chain);
    assert_eq!(
        got.get(&0).map(|s| s.0),
        Some(32),
        "what was kept still scores"
    );
    index.clear_engine(0);
    index.store_each(1, Tier::Gpu, None, &chain[..10], |_, _| {});
    assert_eq!(index.stats().blocks, 10, "freed ids are used again");
}

#[test]
fn a_churning_table_keeps_its_size_without_rebuilds_and_keeps_every_block() {
    use super::TABLE_FULL_PERCENT;
    // A steady 3,000 blocks, each stored alone and removed in a random order later: deletions
    // leave no tombstones, so once the table has grown to the live blocks it is never rebuilt.
    let live = 3_000;
    let mut rng = SplitMix64::new(12);
    let mut index = RunIndex::new(12, CAPACITY);
    let reader = index.reader().clone();
    let mut held: Vec<BlockHash> = Vec::new();
    let mut rebuilds = 0;
    let mut table = std::sync::Arc::as_ptr(&index.table);
    for step in 0..60_000 {
        let hash = BlockHash::new(mix64(step as u64 ^ 0xC0FFEE) | 1);
        index.store_each(0, Tier::Gpu, None, &[hash], |_, _| {});
        held.push(hash);
        if held.len() > live {
            let gone = held.swap_remove(rng.below(held.len() as u64) as usize);
            index.remove(0, Tier::Gpu, &[gone]);
            assert!(
                reader.lookup(gone).is_empty(),
                "step {step}: a removed block stays"
            );
        }
        let slots = index.table.capacity();
        assert_eq!(
            index.table_live,
            held.len(),
            "step {step}: one entry a block"
        );
        assert!(
            index.table_live * 100 <= slots * TABLE_FULL_PERCENT,
            "step {step}: over full"
        );
        if std::sync::Arc::as_ptr(&index.table) != table {
            assert!(step < 3 * live, "step {step}: a rebuild at a steady size");
            rebuilds += 1;
            table = std::sync::Arc::as_ptr(&index.table);
        }
    }
    assert!(rebuilds > 0, "the table grew");
    let slots = index.table.capacity();
    assert!(
        slots <= live * 3,
        "churn does not grow the table: {slots} slots for {live} blocks"
    );
    for &hash in &held {
        assert_eq!(
            reader.lookup(hash),
            [(0, Tier::Gpu)],
            "a held block is found"
        );
    }
}

#[test]
fn export_lists_every_membership_of_an_engine() {
    for seed in 0..4 {
        let mut index = RunIndex::new(seed, CAPACITY);
        let mut model = Model::default();
        random_run(&mut index, &mut model, 6, seed + 100, 300);
        for e in 0..6 {
            let mut out = Vec::new();
            index.export(e, &mut out);
            let got: BTreeSet<(u64, u8)> = out.iter().map(|(h, t)| (h.get(), *t as u8)).collect();
            assert_eq!(got.len(), out.len(), "each membership once");
            let want: BTreeSet<(u64, u8)> = model
                .blocks()
                .into_iter()
                .flat_map(|(h, set)| {
                    set.into_iter()
                        .filter(|m| m.0 == e)
                        .map(move |m| (h.get(), m.1))
                })
                .collect();
            assert_eq!(got, want, "seed {seed}, engine {e}");
        }
    }
}

#[test]
fn eviction_takes_unreferenced_runs_whole_and_the_rest_stays_exact() {
    let mut rng = SplitMix64::new(12);
    let chains = prompts(8, 30, &mut rng);
    let mut index = RunIndex::new(12, CAPACITY);
    let mut model = Model::default();
    for (e, chain) in chains.iter().enumerate() {
        store(&mut index, &mut model, e as u32 % 3, Tier::Gpu, None, chain);
    }
    let before = index.stats().blocks;
    let mut dropped = BTreeMap::new();
    let evicted = index.evict(40, |e, n| *dropped.entry(e).or_insert(0) += n);
    assert!(evicted >= 40, "{evicted}");
    assert_eq!(index.stats().blocks, before - evicted as u64);
    // Whatever is left is exactly as the model says; what left, left for every holder.
    let mut gone = 0u64;
    let mut memberships = 0u64;
    for (h, set) in model.blocks() {
        let mut got: Vec<(u32, u8)> = index
            .reader()
            .lookup(h)
            .into_iter()
            .map(|(e, t)| (e, t as u8))
            .collect();
        got.sort_unstable();
        if got.is_empty() {
            gone += 1;
            memberships += set.len() as u64;
            for (e, t) in set {
                model.remove(e, Tier::from_bits(t as u32), &[h]);
            }
        } else {
            assert_eq!(got, set);
        }
    }
    assert_eq!(gone, evicted as u64);
    assert_eq!(dropped.values().sum::<u64>(), memberships);
    check(&index, &model, &chains, 0);
    // Second chance: a chain stored again is referenced; the next eviction passes it by.
    let kept = &chains[7];
    if !model.holders(kept[0]).is_empty() {
        index.store_each(2, Tier::Gpu, None, kept, |_, _| {});
        let all = index.stats().blocks as usize - kept.len();
        index.evict(all.max(1), |_, _| {});
        assert!(
            !index.reader().lookup(kept[0]).is_empty(),
            "the referenced chain survived"
        );
    }
}

mod readers;
