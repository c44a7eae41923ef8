//! The index against the reference ([`kv_core::ReferenceIndex`]) through the one differential
//! harness ([`kv_core::harness`]): seeded random streams of stores, removals (batched, tail
//! first, shuffled), clears and queries, on the model index (one writer lane and three, with
//! and without `podCacheSize`) and on the bare run index. A divergence is shrunk and reported
//! with its seed and minimal ops.
//!
//! The harness tests itself: deliberately broken structures (a holder dropped, a walk that
//! stops early, and the run index with one rule of its holder order broken through kv-core's
//! `fault-injection` feature) must fail it, each on a stream that passes unbroken.
//!
//! Also: readers scoring while a writer churns see each block's members consistently (never a
//! torn or impossible answer), with few and with many engines per block.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_core::harness::{check_streams, run, IndexUnderTest, Stream};
use kv_core::{
    BlockHash, EngineId, EngineKey, EngineScore, IndexConfig, ModelIndex, RunIndex, RunScratch,
    Tier, TierWeights,
};
use support::Rng;

/// The model index, engines `pod0..podN` registered up front (ids spread over the lanes).
struct Model {
    ix: ModelIndex,
    ids: Vec<EngineId>,
    number_of: HashMap<EngineId, u32>,
    out: Vec<EngineScore>,
}

impl Model {
    fn new(stream: &Stream, writer_lanes: usize) -> Self {
        let ix = ModelIndex::new(IndexConfig {
            max_keys: 1 << 16,
            pod_cache_size: stream.pod_cache_size,
            writer_lanes,
        })
        .expect("valid config");
        let ids: Vec<EngineId> = (0..stream.engines)
            .map(|e| {
                ix.engine(&EngineKey::new(&format!("pod{e}"), 0))
                    .expect("room")
            })
            .collect();
        if writer_lanes == 1 {
            assert_eq!(
                ids,
                (0..stream.engines).collect::<Vec<_>>(),
                "one lane: dense ids"
            );
        }
        let number_of = ids
            .iter()
            .enumerate()
            .map(|(n, &id)| (id, n as u32))
            .collect();
        Self {
            ix,
            ids,
            number_of,
            out: Vec::new(),
        }
    }

    fn number(&self, id: EngineId) -> u32 {
        self.number_of.get(&id).copied().unwrap_or(u32::MAX)
    }
}

impl IndexUnderTest for Model {
    fn store(&mut self, engine: u32, tier: Tier, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let id = self.ids[engine as usize];
        self.ix.write(id, |w| w.store(id, tier, parent, hashes));
    }

    fn remove(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        let id = self.ids[engine as usize];
        self.ix.write(id, |w| w.remove(id, tier, hashes));
    }

    fn clear(&mut self, engine: u32) {
        let id = self.ids[engine as usize];
        self.ix.write(id, |w| w.clear_engine(id));
    }

    fn score(&mut self, hashes: &[BlockHash], candidates: Option<&[u32]>) -> Vec<EngineScore> {
        let ids: Option<Vec<EngineId>> =
            candidates.map(|c| c.iter().map(|&n| self.ids[n as usize]).collect());
        let mut out = std::mem::take(&mut self.out);
        self.ix
            .score_engines(hashes, ids.as_deref(), &TierWeights::default(), &mut out);
        let scores = out
            .iter()
            .map(|s| EngineScore {
                engine: self.number(s.engine),
                ..*s
            })
            .collect();
        self.out = out;
        scores
    }

    fn lookup(&mut self, hash: BlockHash) -> Vec<(u32, Tier)> {
        let held = self.ix.lookup(hash);
        held.into_iter().map(|(e, t)| (self.number(e), t)).collect()
    }

    fn holds_each(&mut self, keys: &[BlockHash], engine: u32) -> Vec<bool> {
        let mut out = Vec::new();
        self.ix
            .holds_each(keys, self.ids[engine as usize], &mut out);
        out
    }

    fn keys(&mut self) -> u64 {
        self.ix.stats().keys
    }

    fn memberships(&mut self) -> u64 {
        self.ix.stats().memberships
    }

    fn lane_of(&self, engine: u32) -> usize {
        self.ids[engine as usize] as usize % self.ix.config().writer_lanes
    }
}

/// The bare run index (no lanes, no budget): stream engine `n` is slot `n * spread % 1024`,
/// so a few engines can span many 64-engine holder windows.
struct Bare {
    index: RunIndex,
    spread: u32,
    memberships: u64,
    scratch: RunScratch,
}

impl Bare {
    fn new(seed: u64, spread: u32) -> Self {
        Self {
            index: RunIndex::new(seed, 1 << 20),
            spread,
            memberships: 0,
            scratch: RunScratch::default(),
        }
    }

    fn slot(&self, n: u32) -> u32 {
        n * self.spread % 1024
    }

    fn number(&self, slot: u32) -> u32 {
        (0..1024)
            .find(|&n| self.slot(n) == slot)
            .unwrap_or(u32::MAX)
    }
}

impl IndexUnderTest for Bare {
    fn store(&mut self, engine: u32, tier: Tier, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let outcome = self
            .index
            .store_each(self.slot(engine), tier, parent, hashes, |_, _| {});
        self.memberships += outcome.added as u64;
    }

    fn remove(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        self.memberships -= self.index.remove(self.slot(engine), tier, hashes) as u64;
    }

    fn clear(&mut self, engine: u32) {
        self.memberships -= self.index.clear_engine(self.slot(engine)) as u64;
    }

    fn score(&mut self, hashes: &[BlockHash], candidates: Option<&[u32]>) -> Vec<EngineScore> {
        let slots: Option<Vec<u32>> = candidates.map(|c| c.iter().map(|&n| self.slot(n)).collect());
        let admit = slots.as_ref().map(|s| |slot: u32| s.contains(&slot));
        let mut out = Vec::new();
        self.index.reader().score(
            hashes,
            &TierWeights::default(),
            admit,
            &mut self.scratch,
            &mut out,
        );
        for s in &mut out {
            s.engine = self.number(s.engine);
        }
        out
    }

    fn lookup(&mut self, hash: BlockHash) -> Vec<(u32, Tier)> {
        let held = self.index.reader().lookup(hash);
        held.into_iter().map(|(s, t)| (self.number(s), t)).collect()
    }

    fn holds_each(&mut self, keys: &[BlockHash], engine: u32) -> Vec<bool> {
        let mut out = Vec::new();
        self.index
            .reader()
            .holds_each(keys, self.slot(engine), &mut out);
        out
    }

    fn keys(&mut self) -> u64 {
        self.index.stats().blocks
    }

    fn memberships(&mut self) -> u64 {
        self.memberships
    }
}

/// Streams of seeds `seeds`, `n` ops over `engines` engines, the holder bound per seed.
fn streams(
    seeds: std::ops::Range<u64>,
    n: usize,
    engines: u32,
    bound: impl Fn(u64) -> Option<usize>,
) -> Vec<Stream> {
    seeds
        .map(|seed| Stream::random(seed, n, engines, bound(seed)))
        .collect()
}

/// Runs `streams` on the model index with one lane, and (exact streams over several engines)
/// with three: the answers must not change with the lanes. A bounded stream runs on one lane
/// only: `podCacheSize` holds per lane.
fn check_model(streams: Vec<Stream>, check_every: usize) {
    let one = check_streams(
        streams.clone(),
        &mut |s| Box::new(Model::new(s, 1)),
        check_every,
    );
    one.unwrap_or_else(|e| panic!("one lane: {e}"));
    let exact = streams
        .into_iter()
        .filter(|s| s.pod_cache_size.is_none() && s.engines > 1);
    let three = check_streams(exact, &mut |s| Box::new(Model::new(s, 3)), check_every);
    three.unwrap_or_else(|e| panic!("three lanes: {e}"));
}

/// Six engines; exact on a third of the seeds, a small podCacheSize on the others, so holder
/// order and its bound are exercised.
const SIX_ENGINES: (std::ops::Range<u64>, usize, u32) = (0..300, 150, 6);

fn six_engines_bound(seed: u64) -> Option<usize> {
    [None, Some(2), Some(4)][seed as usize % 3]
}

#[test]
fn index_matches_reference_on_random_streams() {
    let (seeds, n, engines) = SIX_ENGINES;
    check_model(streams(seeds, n, engines, six_engines_bound), 1);
}

#[test]
fn the_bare_run_index_matches_reference_with_holders_across_windows() {
    // Six engines at adjacent slots, and twelve spread over 1,024 slots (sets span many
    // 64-member windows).
    for (engines, spread) in [(6, 1), (12, 83)] {
        let exact = streams(0..60, 300, engines, |_| None);
        let result = check_streams(exact, &mut |s| Box::new(Bare::new(s.seed, spread)), 7);
        result.unwrap_or_else(|e| panic!("bare run index, spread {spread}: {e}"));
    }
}

#[test]
fn index_matches_reference_with_hundreds_of_engines_per_block() {
    // 400 engines in three tiers storing over eight chains: blocks held by hundreds of
    // (engine, tier) members; exact.
    check_model(streams(1000..1003, 1200, 400, |_| None), 8);
}

#[test]
fn index_matches_reference_with_a_bound_past_one_window_of_engines() {
    // 400 engines, `podCacheSize` 100: sets span several 64-engine windows when the oldest
    // member is dropped (the dropped member may sit in another window).
    check_model(streams(2000..2002, 1200, 400, |_| Some(100)), 8);
}

/// A structure broken on purpose: the model index with one fault in front of it.
struct Broken {
    inner: Model,
    fault: Fault,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// A holder dropped: stores of the last engine in the storage tier are lost.
    HolderDropped,
    /// The walk stops a block early on prompts longer than eight blocks.
    StopsEarly,
}

impl IndexUnderTest for Broken {
    fn store(&mut self, engine: u32, tier: Tier, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let dropped = matches!(self.fault, Fault::HolderDropped)
            && tier == Tier::Storage
            && engine + 1 == self.inner.ids.len() as u32;
        if !dropped {
            self.inner.store(engine, tier, parent, hashes);
        }
    }

    fn remove(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        self.inner.remove(engine, tier, hashes);
    }

    fn clear(&mut self, engine: u32) {
        self.inner.clear(engine);
    }

    fn score(&mut self, hashes: &[BlockHash], candidates: Option<&[u32]>) -> Vec<EngineScore> {
        let mut scores = self.inner.score(hashes, candidates);
        if matches!(self.fault, Fault::StopsEarly) {
            for s in scores.iter_mut().filter(|s| s.matched_blocks > 8) {
                s.matched_blocks -= 1;
            }
        }
        scores
    }

    fn lookup(&mut self, hash: BlockHash) -> Vec<(u32, Tier)> {
        self.inner.lookup(hash)
    }

    fn keys(&mut self) -> u64 {
        self.inner.keys()
    }

    fn memberships(&mut self) -> u64 {
        self.inner.memberships()
    }
}

/// The first of the six-engine streams that `make` diverges on, checked to pass unbroken (the
/// fault, not the stream, is what fails).
fn caught_by_the_harness(what: &str, make: &mut dyn FnMut(&Stream) -> Box<dyn IndexUnderTest>) {
    let (seeds, n, engines) = SIX_ENGINES;
    let caught = streams(seeds.clone(), n, engines, six_engines_bound)
        .into_iter()
        .find_map(|s| run(&s, make(&s).as_mut(), 1).err().map(|e| (s, e)));
    let Some((stream, err)) = caught else {
        panic!("{what}: no stream of seeds {seeds:?} tells it from the reference");
    };
    assert_eq!(
        run(&stream, &mut Model::new(&stream, 1), 1),
        Ok(()),
        "seed {} fails unbroken too",
        stream.seed
    );
    eprintln!("{what} caught on seed {}: {err}", stream.seed);
}

/// Negative controls: the harness must tell each broken structure from the reference.
#[test]
fn the_harness_catches_a_dropped_holder_and_a_walk_that_stops_early() {
    for fault in [Fault::HolderDropped, Fault::StopsEarly] {
        caught_by_the_harness(&format!("{fault:?}"), &mut |s| {
            Box::new(Broken {
                inner: Model::new(s, 1),
                fault,
            })
        });
    }
}

/// Negative controls: the run index with one rule of its holder order under `podCacheSize`
/// broken on purpose (kv-core's test-only `fault-injection` feature).
#[test]
fn a_run_index_with_a_broken_order_rule_fails_the_differential() {
    use kv_core::fault_injection::{with_run_fault, RunFault};
    for fault in [
        RunFault::MergeUnequalOrders,
        RunFault::JoinUnequalOrder,
        RunFault::DropNewest,
    ] {
        // The fault is read when the index is built, so the structure is built armed.
        caught_by_the_harness(&format!("{fault:?}"), &mut |s| {
            with_run_fault(fault, || Box::new(Model::new(s, 1)))
        });
    }
}

#[test]
fn concurrent_readers_never_see_impossible_scores() {
    concurrent_readers(8, 20_000);
}

#[test]
fn concurrent_readers_never_see_impossible_scores_with_many_engines() {
    concurrent_readers(300, 1_000);
}

/// A stable chain held by one engine throughout, and churn by `churners` other engines, from
/// two writer threads (two lanes, so they write in parallel), on branches that share its
/// prefix. Readers must always score the stable engine at the full stable length (exact
/// membership: it is never dropped, however many engines join the block) and never score
/// anyone beyond the prompt, an unknown engine, or any engine twice.
fn concurrent_readers(churners: u64, reads: usize) {
    let ix = Arc::new(
        ModelIndex::new(IndexConfig {
            max_keys: 1 << 16,
            pod_cache_size: None,
            writer_lanes: 2,
        })
        .expect("valid"),
    );
    let mut rng = Rng::new(99);
    let stable: Vec<BlockHash> = (0..64)
        .map(|_| BlockHash::new(rng.next_u64() | 1))
        .collect();
    let stable_engine = ix
        .write_engine(&EngineKey::new("stable", 0), |w, e| {
            w.store(e, Tier::Gpu, None, &stable);
            e
        })
        .expect("room");
    let known: Vec<EngineId> = (0..churners)
        .filter_map(|c| ix.engine(&EngineKey::new(&format!("churn{c}"), 0)))
        .chain([stable_engine])
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u64)
        .map(|thread| {
            let ix = ix.clone();
            let stop = stop.clone();
            let stable = stable.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(7 + thread);
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) || rounds < 1000 {
                    // Each thread churns its half of the engines.
                    let c = rng.below(churners.div_ceil(2)) * 2 + thread;
                    let key = EngineKey::new(&format!("churn{}", c.min(churners - 1)), 0);
                    let cut = rng.below(64) as usize;
                    let branch: Vec<BlockHash> = (0..32)
                        .map(|_| BlockHash::new(rng.next_u64() | 1))
                        .collect();
                    let clear = rng.below(8) == 0;
                    ix.write_engine(&key, |w, e| {
                        w.store(e, Tier::Gpu, None, &stable[..cut]);
                        w.store(
                            e,
                            Tier::Cpu,
                            stable.get(cut.wrapping_sub(1)).copied(),
                            &branch,
                        );
                        // Clear rarely, so blocks gather many holders.
                        if clear {
                            w.clear_engine(e);
                        } else {
                            w.remove(e, Tier::Cpu, &branch[..16]);
                        }
                    });
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let ix = ix.clone();
            let stable = stable.clone();
            let known = known.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for _ in 0..reads {
                    ix.score_engines(&stable, None, &TierWeights::default(), &mut out);
                    let s = out
                        .iter()
                        .find(|s| s.engine == stable_engine)
                        .expect("stable engine present");
                    assert_eq!(s.matched_blocks, 64);
                    assert!(out
                        .iter()
                        .all(|s| s.matched_blocks <= 64 && known.contains(&s.engine)));
                    let mut ids: Vec<_> = out.iter().map(|s| s.engine).collect();
                    ids.sort_unstable();
                    ids.dedup();
                    assert_eq!(ids.len(), out.len(), "no engine twice: {out:?}");
                }
            })
        })
        .collect();
    for r in readers {
        r.join().expect("reader ok");
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        assert!(w.join().expect("writer ok") >= 1000);
    }
}
