//! The run index's lock-free readers: a corrupted slot, readers on other threads under a busy
//! writer, and a reader run between every two stores of the writer.

use super::*;

#[test]
fn a_block_whose_slot_names_the_wrong_run_reads_as_not_held_and_is_counted() {
    // Negative control of the readers' bound: an index that disagrees with itself (never
    // built by the writer) makes a reader give up instead of looping or reporting a holder.
    let mut rng = SplitMix64::new(5);
    let chains = prompts(2, 20, &mut rng);
    let mut index = RunIndex::new(5, CAPACITY);
    index.store_each(0, Tier::Gpu, None, &chains[0], |_, _| {});
    index.store_each(1, Tier::Gpu, None, &chains[1][10..], |_, _| {});
    let (Some(bad), Some(other)) = (
        index.find(chains[0][5].get()),
        index.find(chains[1][15].get()),
    ) else {
        panic!("both blocks indexed");
    };
    index.id(bad).set_run(index.id(other).run());
    let reader = index.reader();
    assert!(reader.lookup(chains[0][5]).is_empty());
    assert_eq!(reader.gave_up(), 1);
    assert!(scores(&index, &chains[0][5..]).is_empty(), "a walk from it");
    assert_eq!(reader.gave_up(), 2);
    // A walk that reaches it inside its run compares hashes under the run's sequence and
    // does not consult the slot.
    assert_eq!(scores(&index, &chains[0]).get(&0).map(|s| s.0), Some(20));
}

#[test]
fn readers_under_a_busy_writer_never_lose_a_block_or_see_a_false_one() {
    concurrent::run(20_000);
}

#[test]
fn a_reader_between_any_two_stores_of_the_writer_sees_engine_0_whole() {
    concurrent::between_stores(1_500);
}

/// Readers on other threads while the writer splits, merges, relabels and reuses ids and runs.
mod concurrent {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// Engines (160 members with their tiers: holder sets span three windows).
    const ENGINES: u32 = 40;

    /// The longest prefix of the shared chain engine `e` ever stores (engine 0: all of it).
    fn reach(e: u32, len: usize) -> usize {
        if e == 0 {
            len
        } else {
            (60 + 7 * e as usize).min(len)
        }
    }

    /// The writer's steps of [`run`], with a reader's checks run after every store it makes.
    pub fn between_stores(steps: usize) {
        let mut rng = SplitMix64::new(99);
        let chain = prompts(1, 400, &mut rng).remove(0);
        let mut index = RunIndex::new(99, CAPACITY);
        index.store_each(0, Tier::Gpu, None, &chain, |_, _| {});
        let reader = index.reader().clone();
        let checks = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let (count, chain2) = (checks.clone(), chain.clone());
        let (mut out, mut scratch) = (Vec::new(), RunScratch::default());
        super::super::super::cells::probe::install(Some(Box::new(move || {
            out.clear();
            reader.score(
                &chain2,
                &TierWeights::default(),
                None::<fn(u32) -> bool>,
                &mut scratch,
                &mut out,
            );
            let zero = out.iter().find(|s| s.engine == 0).map(|s| s.matched_blocks);
            assert_eq!(zero, Some(400), "store {}: engine 0's score", count.get());
            let step = count.get();
            for (k, h) in chain2.iter().enumerate().skip(step as usize % 8).step_by(8) {
                let holders = reader.lookup(*h);
                assert!(
                    holders.contains(&(0, Tier::Gpu)),
                    "store {step}: block {k} lost engine 0"
                );
                for (e, _) in holders {
                    assert!(
                        k < reach(e, chain2.len()),
                        "engine {e} never held block {k}"
                    );
                }
            }
            count.set(count.get() + 1);
        })));
        writer_steps(&mut index, &chain, &mut rng, steps);
        super::super::super::cells::probe::install(None);
        assert!(checks.get() > 1000, "{} checks", checks.get());
    }

    pub fn run(steps: usize) {
        let mut rng = SplitMix64::new(99);
        let chain = prompts(1, 400, &mut rng).remove(0);
        let mut index = RunIndex::new(99, CAPACITY);
        index.store_each(0, Tier::Gpu, None, &chain, |_, _| {});
        let reader = index.reader().clone();
        let done = Arc::new(AtomicBool::new(false));
        // Reader 0 scores the chain and looks up every 7th block; reader 1 looks up every block.
        let readers: Vec<_> = (0..2)
            .map(|i| {
                let (reader, done, chain) = (reader.clone(), done.clone(), chain.clone());
                std::thread::spawn(move || {
                    let (mut out, mut scratch) = (Vec::new(), RunScratch::default());
                    let mut rounds = 0u64;
                    while !done.load(Ordering::Relaxed) || rounds < 10 {
                        out.clear();
                        reader.score(
                            &chain,
                            &TierWeights::default(),
                            None::<fn(u32) -> bool>,
                            &mut scratch,
                            &mut out,
                        );
                        let mut seen = BTreeSet::new();
                        for s in &out {
                            assert!(seen.insert(s.engine), "engine {} twice", s.engine);
                            let most = reach(s.engine, chain.len()) as u32;
                            assert!(
                                s.matched_blocks <= most,
                                "engine {} matched {} > {most}",
                                s.engine,
                                s.matched_blocks
                            );
                            if s.engine == 0 {
                                assert_eq!(
                                    s.matched_blocks,
                                    400,
                                    "engine 0 lost a block ({} given up)",
                                    reader.gave_up()
                                );
                                assert!((s.score - 400.0).abs() < 1e-9);
                            }
                        }
                        assert!(seen.contains(&0), "engine 0 missing");
                        let step = if i == 0 { 7 } else { 1 };
                        for k in (rounds as usize % step..chain.len()).step_by(step) {
                            let holders = reader.lookup(chain[k]);
                            assert!(
                                holders.contains(&(0, Tier::Gpu)),
                                "lookup lost engine 0 ({} given up)",
                                reader.gave_up()
                            );
                            for (e, _) in holders {
                                assert!(
                                    k < reach(e, chain.len()),
                                    "engine {e} never held block {k}"
                                );
                            }
                        }
                        rounds += 1;
                    }
                    rounds
                })
            })
            .collect();
        writer_steps(&mut index, &chain, &mut rng, steps);
        done.store(true, Ordering::Relaxed);
        for r in readers {
            let rounds = r.join().expect("a reader's checks hold");
            assert!(rounds >= 10);
        }
        assert!(index.stats().relabels > 0 && index.stats().merges > 0);
        assert_eq!(reader.gave_up(), 0, "no read gave up");
    }

    /// The writer's random steps: stores, removals in any order, fresh blocks, clears.
    fn writer_steps(index: &mut RunIndex, chain: &[BlockHash], rng: &mut SplitMix64, steps: usize) {
        let mut side: Vec<Vec<BlockHash>> = Vec::new();
        for _ in 0..steps {
            let e = 1 + (rng.next_u64() % (ENGINES - 1) as u64) as u32;
            let top = reach(e, chain.len());
            let a = (rng.next_u64() % top as u64) as usize;
            let b = a + 1 + (rng.next_u64() % (top - a) as u64) as usize;
            let t = tier(rng);
            match rng.next_u64() % 8 {
                0..=2 => {
                    index.store_each(
                        e,
                        t,
                        a.checked_sub(1).map(|p| chain[p]),
                        &chain[a..b],
                        |_, _| {},
                    );
                }
                3 | 4 => {
                    for h in chain[a..b].iter().rev() {
                        index.remove(e, t, std::slice::from_ref(h));
                    }
                }
                5 => {
                    // Fresh blocks that come and go: ids, runs and pool words are reused, the
                    // table grows and is replaced.
                    let fresh: Vec<BlockHash> = (0..1 + rng.next_u64() % 40)
                        .map(|_| BlockHash::new(mix64(rng.next_u64()) | 1))
                        .collect();
                    index.store_each(e, t, None, &fresh, |_, _| {});
                    side.push(fresh);
                    if side.len() > 50 {
                        let gone = side.swap_remove((rng.next_u64() % side.len() as u64) as usize);
                        for e in 1..ENGINES {
                            index.remove(e, Tier::Gpu, &gone);
                            index.remove(e, Tier::Cpu, &gone);
                            index.remove(e, Tier::Storage, &gone);
                        }
                    }
                }
                6 => {
                    let mut hs = chain[a..b].to_vec();
                    for i in (1..hs.len()).rev() {
                        hs.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                    }
                    index.remove(e, t, &hs);
                }
                _ => {
                    index.clear_engine(e);
                }
            }
        }
    }
}
