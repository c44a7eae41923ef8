//! Differential test: the real [`ModelIndex`] against a deliberately simple reference model on
//! seeded random streams of stores, removals, clears and queries. A failure is shrunk (ops
//! dropped one at a time while it still fails) and reported with its seed and minimal ops.
//!
//! Also: readers scoring while a writer churns see each block's members consistently (never a
//! torn or impossible answer).

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_core::BlockHash;
use kv_core::{EngineId, EngineKey, EngineScore, IndexConfig, ModelIndex, Tier, TierWeights};
use support::Rng;

const ENGINES: u32 = 6;
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

fn gen_ops(rng: &mut Rng, chains: &[Vec<BlockHash>], n: usize) -> Vec<Op> {
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
                        engine: rng.below(ENGINES as u64) as u32,
                        tier: rng.below(3) as usize,
                        chain,
                        start,
                        end,
                    }
                }
                4..=5 => Op::Remove {
                    engine: rng.below(ENGINES as u64) as u32,
                    tier: rng.below(3) as usize,
                    chain,
                    at: rng.below(len as u64) as usize,
                },
                6 => Op::Clear {
                    engine: rng.below(ENGINES as u64) as u32,
                },
                _ => Op::Query {
                    chain,
                    len: 1 + rng.below(len as u64) as usize,
                    candidates: (rng.below(3) == 0).then(|| {
                        let mut c: Vec<u32> = (0..ENGINES).filter(|_| rng.below(2) == 0).collect();
                        c.sort_unstable();
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
    pod_cache_size: usize,
}

impl Reference {
    fn store(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]) {
        for h in hashes {
            let list = self.blocks.entry(*h).or_default();
            if !list.contains(&(engine, tier)) {
                if list.len() >= self.pod_cache_size {
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
        for engine in 0..ENGINES {
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
fn run(chains: &[Vec<BlockHash>], ops: &[Op], pod_cache_size: usize) -> Result<(), String> {
    let ix = ModelIndex::new(IndexConfig {
        max_keys: 1 << 16,
        pod_cache_size,
    })
    .map_err(|e| e.to_string())?;
    let ids: Vec<EngineId> = ix.write(|w| {
        (0..ENGINES)
            .map(|e| {
                w.engine(&EngineKey::new(&format!("pod{e}"), 0))
                    .expect("room")
            })
            .collect()
    });
    assert_eq!(
        ids,
        (0..ENGINES).collect::<Vec<_>>(),
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

fn shrink(chains: &[Vec<BlockHash>], mut ops: Vec<Op>, pcs: usize) -> (Vec<Op>, String) {
    let mut err = run(chains, &ops, pcs).expect_err("fails before shrinking");
    let mut i = 0;
    while i < ops.len() {
        let mut fewer = ops.clone();
        fewer.remove(i);
        match run(chains, &fewer, pcs) {
            Err(e) => {
                ops = fewer;
                err = e;
            }
            Ok(()) => i += 1,
        }
    }
    (ops, err)
}

#[test]
fn index_matches_reference_on_random_streams() {
    let mut total_ops = 0;
    for seed in 0..300u64 {
        let mut rng = Rng::new(seed);
        let chains = chains(&mut rng);
        let ops = gen_ops(&mut rng, &chains, 150);
        // Small podCacheSize on some seeds, so member eviction (and overflow pages) are exercised.
        let pcs = [2, 4, 10][seed as usize % 3];
        total_ops += ops.len();
        if run(&chains, &ops, pcs).is_err() {
            let (ops, err) = shrink(&chains, ops, pcs);
            panic!(
                "seed {seed} (podCacheSize {pcs}) diverges; shrunk to {} ops:\n{ops:#?}\n{err}",
                ops.len()
            );
        }
    }
    assert_eq!(total_ops, 300 * 150);
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
    assert!(run(&chains, &ops, 10).is_ok());
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
        pod_cache_size: 10,
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
    // A stable chain held by engine 0 throughout, and churn by other engines on branches that
    // share its prefix. Readers must always score engine 0 at the full stable length and never
    // score anyone beyond the prompt.
    let ix = Arc::new(
        ModelIndex::new(IndexConfig {
            max_keys: 1 << 16,
            // Above the 9 engines, so the stable engine is never the oldest member evicted.
            pod_cache_size: 10,
        })
        .expect("valid"),
    );
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
                        .engine(&EngineKey::new(&format!("churn{}", rng.below(8)), 0))
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
                    if rng.below(2) == 0 {
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
                for _ in 0..20_000 {
                    ix.score_engines(&stable, None, &TierWeights::default(), &mut out);
                    let s = out
                        .iter()
                        .find(|s| s.engine == 0)
                        .expect("stable engine present");
                    assert_eq!(s.matched_blocks, 64);
                    assert!(out.iter().all(|s| s.matched_blocks <= 64 && s.engine < 9));
                    assert!(out.len() <= 9, "at most every engine: {out:?}");
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
