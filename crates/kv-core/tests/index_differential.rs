//! Differential test: the real [`ModelIndex`] against a deliberately simple reference model on
//! seeded random streams of stores, removals, clears and queries. A failure is shrunk (ops
//! dropped one at a time while it still fails) and reported with its seed and minimal ops.
//!
//! Streams run with a few engines (so the opt-in `podCacheSize` bound is exercised) and with
//! hundreds (exact membership: sets of any size, hundreds of members per block).
//!
//! Also: readers scoring while a writer churns see each block's members consistently (never a
//! torn or impossible answer), with few and with many engines per block.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_core::BlockHash;
use kv_core::{EngineId, EngineKey, EngineScore, IndexConfig, ModelIndex, Tier, TierWeights};
use support::Rng;

const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

#[derive(Debug, Clone)]
enum Op {
    Store {
        engine: u32,
        tier: usize,
        chain: usize,
        start: usize,
        end: usize,
    },
    Remove {
        engine: u32,
        tier: usize,
        chain: usize,
        at: usize,
    },
    Clear {
        engine: u32,
    },
    Query {
        chain: usize,
        len: usize,
        candidates: Option<Vec<u32>>,
    },
}

/// A forest of chains sharing prefixes: chain `c` shares its first `shared[c]` blocks with
/// chain `c - 1`, as conversation turns and shared system prompts do.
fn chains(rng: &mut Rng) -> Vec<Vec<BlockHash>> {
    let mut out: Vec<Vec<BlockHash>> = Vec::new();
    for c in 0..8 {
        let len = 4 + rng.below(20) as usize;
        let mut chain = Vec::with_capacity(len);
        if c > 0 {
            let shared = rng.below(out[c - 1].len() as u64 + 1) as usize;
            chain.extend_from_slice(&out[c - 1][..shared.min(len)]);
        }
        while chain.len() < len {
            chain.push(BlockHash::new(rng.next_u64() | 1));
        }
        out.push(chain);
    }
    out
}

fn gen_ops(rng: &mut Rng, chains: &[Vec<BlockHash>], n: usize, engines: u32) -> Vec<Op> {
    (0..n)
        .map(|_| {
            let chain = rng.below(chains.len() as u64) as usize;
            let len = chains[chain].len();
            match rng.below(10) {
                0..=3 => {
                    let start = if rng.below(3) == 0 {
                        rng.below(len as u64) as usize
                    } else {
                        0
                    };
                    let end = start + 1 + rng.below((len - start) as u64) as usize;
                    Op::Store {
                        engine: rng.below(engines as u64) as u32,
                        tier: rng.below(3) as usize,
                        chain,
                        start,
                        end,
                    }
                }
                4..=5 => Op::Remove {
                    engine: rng.below(engines as u64) as u32,
                    tier: rng.below(3) as usize,
                    chain,
                    at: rng.below(len as u64) as usize,
                },
                6 => Op::Clear {
                    engine: rng.below(engines as u64) as u32,
                },
                _ => Op::Query {
                    chain,
                    len: 1 + rng.below(len as u64) as usize,
                    candidates: (rng.below(3) == 0).then(|| {
                        // In any order, some named twice: the index must not need them sorted.
                        let mut c: Vec<u32> = (0..engines).filter(|_| rng.below(2) == 0).collect();
                        for i in (1..c.len()).rev() {
                            c.swap(i, rng.below(i as u64 + 1) as usize);
                        }
                        if let Some(&first) = c.first() {
                            c.push(first);
                        }
                        c
                    }),
                },
            }
        })
        .collect()
}

/// The reference: a map from hash to its members in store order, nothing clever.
struct Reference {
    blocks: HashMap<BlockHash, Vec<(u32, Tier)>>,
    pod_cache_size: Option<usize>,
}

impl Reference {
    fn store(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        for h in hashes {
            let list = self.blocks.entry(*h).or_default();
            if !list.contains(&(engine, tier)) {
                if self.pod_cache_size.is_some_and(|b| list.len() >= b) {
                    list.remove(0);
                }
                list.push((engine, tier));
            }
        }
    }

    fn remove(&mut self, engine: u32, tier: Tier, h: BlockHash) {
        if let Some(list) = self.blocks.get_mut(&h) {
            list.retain(|m| *m != (engine, tier));
            if list.is_empty() {
                self.blocks.remove(&h);
            }
        }
    }

    fn clear(&mut self, engine: u32) {
        self.blocks.retain(|_, list| {
            list.retain(|m| m.0 != engine);
            !list.is_empty()
        });
    }

    fn score(
        &self,
        hashes: &[BlockHash],
        candidates: Option<&[u32]>,
        w: &TierWeights,
    ) -> Vec<(u32, u32, f64)> {
        let mut out = Vec::new();
        let engines = self
            .blocks
            .values()
            .flatten()
            .map(|m| m.0 + 1)
            .max()
            .unwrap_or(0);
        for engine in 0..engines {
            if candidates.is_some_and(|c| !c.contains(&engine)) {
                continue;
            }
            let (mut matched, mut score) = (0, 0.0);
            for h in hashes {
                let best = self.blocks.get(h).and_then(|l| {
                    l.iter()
                        .filter(|m| m.0 == engine)
                        .map(|m| w.of(m.1))
                        .reduce(f64::max)
                });
                match best {
                    Some(b) => {
                        matched += 1;
                        score += b;
                    }
                    None => break,
                }
            }
            if matched > 0 {
                out.push((engine, matched, score));
            }
        }
        out
    }
}

fn sorted(scores: &[EngineScore]) -> Vec<(u32, u32, f64)> {
    let mut v: Vec<_> = scores
        .iter()
        .map(|s| (s.engine, s.matched_blocks, s.score))
        .collect();
    v.sort_by_key(|s| s.0);
    v
}

/// Runs `ops` on both; `Err` describes the first divergence.
fn run(
    chains: &[Vec<BlockHash>],
    ops: &[Op],
    pod_cache_size: Option<usize>,
    engines: u32,
) -> Result<(), String> {
    let ix = ModelIndex::new(IndexConfig {
        max_keys: 1 << 16,
        pod_cache_size,
    })
    .map_err(|e| e.to_string())?;
    let ids: Vec<EngineId> = ix.write(|w| {
        (0..engines)
            .map(|e| {
                w.engine(&EngineKey::new(&format!("pod{e}"), 0))
                    .expect("room")
            })
            .collect()
    });
    assert_eq!(
        ids,
        (0..engines).collect::<Vec<_>>(),
        "ids are dense from 0"
    );
    let mut reference = Reference {
        blocks: HashMap::new(),
        pod_cache_size,
    };
    let weights = TierWeights::default();
    let mut out = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Store {
                engine,
                tier,
                chain,
                start,
                end,
            } => {
                let c = &chains[*chain];
                let parent = start.checked_sub(1).map(|p| c[p]);
                ix.write(|w| w.store(*engine, TIERS[*tier], parent, &c[*start..*end]));
                reference.store(*engine, TIERS[*tier], &c[*start..*end]);
            }
            Op::Remove {
                engine,
                tier,
                chain,
                at,
            } => {
                let h = chains[*chain][*at];
                ix.write(|w| w.remove(*engine, TIERS[*tier], &[h]));
                reference.remove(*engine, TIERS[*tier], h);
            }
            Op::Clear { engine } => {
                ix.write(|w| w.clear_engine(*engine));
                reference.clear(*engine);
            }
            Op::Query {
                chain,
                len,
                candidates,
            } => {
                let hashes = &chains[*chain][..*len];
                ix.score_engines(hashes, candidates.as_deref(), &weights, &mut out);
                let got = sorted(&out);
                let want = reference.score(hashes, candidates.as_deref(), &weights);
                let same = got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.0 == b.0 && a.1 == b.1 && (a.2 - b.2).abs() < 1e-9);
                if !same {
                    return Err(format!(
                        "step {step} {op:?}: index {got:?}, reference {want:?}"
                    ));
                }
            }
        }
        // After every op: membership of every block, in store order, and the key count.
        for chain in chains {
            for h in chain {
                let got = ix.lookup(*h);
                let want = reference.blocks.get(h).cloned().unwrap_or_default();
                if got != want {
                    return Err(format!(
                        "step {step} {op:?}: block {h:?} index {got:?}, reference {want:?}"
                    ));
                }
            }
        }
        let keys = ix.stats().keys as usize;
        if keys != reference.blocks.len() {
            return Err(format!(
                "step {step}: {keys} keys, reference {}",
                reference.blocks.len()
            ));
        }
    }
    let memberships: usize = reference.blocks.values().map(Vec::len).sum();
    if ix.stats().memberships as usize != memberships {
        return Err(format!(
            "memberships {} != {memberships}",
            ix.stats().memberships
        ));
    }
    Ok(())
}

fn shrink(
    chains: &[Vec<BlockHash>],
    mut ops: Vec<Op>,
    pcs: Option<usize>,
    engines: u32,
) -> (Vec<Op>, String) {
    let mut err = run(chains, &ops, pcs, engines).expect_err("fails before shrinking");
    let mut i = 0;
    while i < ops.len() {
        let mut fewer = ops.clone();
        fewer.remove(i);
        match run(chains, &fewer, pcs, engines) {
            Err(e) => {
                ops = fewer;
                err = e;
            }
            Ok(()) => i += 1,
        }
    }
    (ops, err)
}

/// Runs `seeds` random streams of `n` ops over `engines` engines; panics with the shrunk case.
fn check_seeds(
    seeds: std::ops::Range<u64>,
    n: usize,
    engines: u32,
    pcs: impl Fn(u64) -> Option<usize>,
) {
    for seed in seeds {
        let mut rng = Rng::new(seed);
        let chains = chains(&mut rng);
        let ops = gen_ops(&mut rng, &chains, n, engines);
        let pcs = pcs(seed);
        if run(&chains, &ops, pcs, engines).is_err() {
            let (ops, err) = shrink(&chains, ops, pcs, engines);
            panic!(
                "seed {seed} ({engines} engines, podCacheSize {pcs:?}) diverges; shrunk to {} ops:\n{ops:#?}\n{err}",
                ops.len()
            );
        }
    }
}

#[test]
fn index_matches_reference_on_random_streams() {
    // Six engines; exact on a third of the seeds, a small podCacheSize on the others, so member
    // eviction (and set pages) are exercised.
    check_seeds(0..300, 150, 6, |seed| {
        [None, Some(2), Some(4)][seed as usize % 3]
    });
}

#[test]
fn index_matches_reference_with_hundreds_of_engines_per_block() {
    // 400 engines in three tiers storing over eight chains: blocks held by hundreds of
    // (engine, tier) members, far past the 64 the index once capped them at; exact.
    check_seeds(1000..1004, 1500, 400, |_| None);
}

#[test]
fn the_harness_catches_a_wrong_reference() {
    // Negative control: a reference that forgets removals must be caught.
    let mut rng = Rng::new(1);
    let chains = chains(&mut rng);
    let ops = vec![
        Op::Store {
            engine: 0,
            tier: 0,
            chain: 0,
            start: 0,
            end: 3,
        },
        Op::Remove {
            engine: 0,
            tier: 0,
            chain: 0,
            at: 1,
        },
        Op::Query {
            chain: 0,
            len: 3,
            candidates: None,
        },
    ];
    assert!(run(&chains, &ops, None, 6).is_ok());
    let ix = ModelIndex::new(IndexConfig::default()).expect("valid");
    ix.write(|w| {
        let e = w.engine(&EngineKey::new("a", 0)).expect("room");
        w.store(e, Tier::Gpu, None, &chains[0][..3]);
        w.remove(e, Tier::Gpu, &chains[0][1..2]);
    });
    let mut out = Vec::new();
    ix.score_engines(&chains[0][..3], None, &TierWeights::default(), &mut out);
    let mut forgetful = Reference {
        blocks: HashMap::new(),
        pod_cache_size: None,
    };
    forgetful.store(0, Tier::Gpu, &chains[0][..3]);
    assert_ne!(
        sorted(&out),
        forgetful.score(&chains[0][..3], None, &TierWeights::default()),
        "a reference that skips removals disagrees"
    );
}

#[test]
fn concurrent_readers_never_see_impossible_scores() {
    concurrent_readers(8, 20_000);
}

#[test]
fn concurrent_readers_never_see_impossible_scores_with_many_engines() {
    concurrent_readers(300, 1_000);
}

/// A stable chain held by engine 0 throughout, and churn by `churners` other engines on
/// branches that share its prefix. Readers must always score engine 0 at the full stable
/// length (exact membership: it is never dropped, however many engines join the block) and
/// never score anyone beyond the prompt or any engine twice.
fn concurrent_readers(churners: u64, reads: usize) {
    let ix = Arc::new(
        ModelIndex::new(IndexConfig {
            max_keys: 1 << 16,
            pod_cache_size: None,
        })
        .expect("valid"),
    );
    let engines = churners as usize + 1;
    let mut rng = Rng::new(99);
    let stable: Vec<BlockHash> = (0..64)
        .map(|_| BlockHash::new(rng.next_u64() | 1))
        .collect();
    ix.write(|w| {
        let e = w.engine(&EngineKey::new("stable", 0)).expect("room");
        w.store(e, Tier::Gpu, None, &stable);
    });
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let ix = ix.clone();
        let stop = stop.clone();
        let stable = stable.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(7);
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) || rounds < 2000 {
                ix.write(|w| {
                    let e = w
                        .engine(&EngineKey::new(&format!("churn{}", rng.below(churners)), 0))
                        .expect("room");
                    let cut = rng.below(64) as usize;
                    let branch: Vec<BlockHash> = (0..32)
                        .map(|_| BlockHash::new(rng.next_u64() | 1))
                        .collect();
                    w.store(e, Tier::Gpu, None, &stable[..cut]);
                    w.store(
                        e,
                        Tier::Cpu,
                        stable.get(cut.wrapping_sub(1)).copied(),
                        &branch,
                    );
                    // Clear rarely, so blocks gather many holders.
                    if rng.below(8) == 0 {
                        w.clear_engine(e);
                    } else {
                        w.remove(e, Tier::Cpu, &branch[..16]);
                    }
                });
                rounds += 1;
            }
            rounds
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let ix = ix.clone();
            let stable = stable.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for _ in 0..reads {
                    ix.score_engines(&stable, None, &TierWeights::default(), &mut out);
                    let s = out
                        .iter()
                        .find(|s| s.engine == 0)
                        .expect("stable engine present");
                    assert_eq!(s.matched_blocks, 64);
                    assert!(out
                        .iter()
                        .all(|s| s.matched_blocks <= 64 && (s.engine as usize) < engines));
                    assert!(out.len() <= engines, "at most every engine: {out:?}");
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
    let rounds = writer.join().expect("writer ok");
    assert!(rounds >= 2000);
}
