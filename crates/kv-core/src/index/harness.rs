//! The differential harness every index structure plugs into: seeded random streams of
//! stores, removals (in order, tail first, shuffled), clears and queries over chains that
//! share prefixes, run on a structure and on the [`ReferenceIndex`] side by side; answers,
//! holders, key and membership counts compared after each step. A divergence is shrunk (ops
//! dropped one at a time while it still diverges) and reported with its seed.
//!
//! A structure plugs in by implementing [`IndexUnderTest`] (engines are numbered `0..n`; the
//! adapter maps them to its own ids). kv-core's tests run the model index (one and several
//! lanes, with and without `podCacheSize`) and the bare run index through it, and a self-test
//! runs deliberately broken structures that must fail it.

use super::reference::ReferenceIndex;
use super::types::{EngineScore, Tier, TierWeights};
use crate::{BlockHash, SplitMix64};

/// The tiers streams use.
const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

/// What the harness needs of an index structure. Engines are the numbers `0..n` of the
/// stream; an adapter maps them to its ids and back.
pub trait IndexUnderTest {
    /// `BlockStored`: `engine` holds `hashes`, continuing `parent`, in `tier`.
    fn store(&mut self, engine: u32, tier: Tier, parent: Option<BlockHash>, hashes: &[BlockHash]);
    /// `BlockRemoved`.
    fn remove(&mut self, engine: u32, tier: Tier, hashes: &[BlockHash]);
    /// `AllBlocksCleared`.
    fn clear(&mut self, engine: u32);
    /// Scores of the engines holding the prompt's first block (`engine` fields are stream
    /// numbers), restricted to `candidates` when given; any order.
    fn score(&mut self, hashes: &[BlockHash], candidates: Option<&[u32]>) -> Vec<EngineScore>;
    /// Holders of `hash` (stream numbers), any order.
    fn lookup(&mut self, hash: BlockHash) -> Vec<(u32, Tier)>;
    /// Whether `engine` holds each of `keys` (any tier), read together as one span (the
    /// hybrid rule reads a group's blocks so). By default, from [`IndexUnderTest::lookup`].
    fn holds_each(&mut self, keys: &[BlockHash], engine: u32) -> Vec<bool> {
        keys.iter()
            .map(|&k| self.lookup(k).iter().any(|m| m.0 == engine))
            .collect()
    }
    /// Distinct keys the structure holds.
    fn keys(&mut self) -> u64;
    /// Memberships the structure holds.
    fn memberships(&mut self) -> u64;
    /// The writer lane of `engine` (a block held by engines of two lanes is a key in each).
    fn lane_of(&self, _engine: u32) -> usize {
        0
    }
}

/// How a removal names its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovalOrder {
    /// One event, chain order.
    Batch,
    /// One event per block, the chain's tail first (as vLLM evicts).
    TailFirst,
    /// One event, shuffled: holes anywhere.
    Shuffled,
}

/// One step of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `engine` stores `chain[start..end]` in tier `tier` (parent `chain[start - 1]`).
    Store {
        /// Stream engine number.
        engine: u32,
        /// Index into the tiers used.
        tier: usize,
        /// Which chain.
        chain: usize,
        /// First block.
        start: usize,
        /// Past the last block.
        end: usize,
    },
    /// `engine` removes `chain[start..end]` from tier `tier`, in `order`.
    Remove {
        /// Stream engine number.
        engine: u32,
        /// Index into the tiers used.
        tier: usize,
        /// Which chain.
        chain: usize,
        /// First block.
        start: usize,
        /// Past the last block.
        end: usize,
        /// Event shape.
        order: RemovalOrder,
    },
    /// `engine` clears everything.
    Clear {
        /// Stream engine number.
        engine: u32,
    },
    /// Score `chain[..len]`, for `candidates` when given (any order, repeats allowed).
    Query {
        /// Which chain.
        chain: usize,
        /// Blocks of the prompt.
        len: usize,
        /// Engines asked about.
        candidates: Option<Vec<u32>>,
    },
}

/// A seeded stream: chains sharing prefixes and the ops over them.
#[derive(Debug, Clone)]
pub struct Stream {
    /// The seed it came from.
    pub seed: u64,
    /// Engines `0..engines`.
    pub engines: u32,
    /// Chains of block hashes; chain `c` shares a prefix with chain `c - 1`.
    pub chains: Vec<Vec<BlockHash>>,
    /// The steps.
    pub ops: Vec<Op>,
    /// The holder bound the reference keeps (`podCacheSize`).
    pub pod_cache_size: Option<usize>,
}

impl Stream {
    /// Stream `seed`: eight chains of 4 to 40 blocks and `n` ops over `engines` engines.
    pub fn random(seed: u64, n: usize, engines: u32, pod_cache_size: Option<usize>) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut below = |n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
        let mut chains: Vec<Vec<BlockHash>> = Vec::new();
        for c in 0..8 {
            let len = 4 + below(37);
            let mut chain = Vec::with_capacity(len);
            if c > 0 {
                let shared = below(chains[c - 1].len() + 1);
                chain.extend_from_slice(&chains[c - 1][..shared.min(len)]);
            }
            while chain.len() < len {
                chain.push(BlockHash::new(((below(usize::MAX) as u64) << 1) | 1));
            }
            chains.push(chain);
        }
        let mut ops = Vec::with_capacity(n);
        for _ in 0..n {
            let chain = below(chains.len());
            let len = chains[chain].len();
            let engine = below(engines as usize) as u32;
            let tier = [0, 0, 0, 1, 2][below(5)];
            let start = if below(3) == 0 { below(len) } else { 0 };
            let end = start + 1 + below(len - start);
            ops.push(match below(20) {
                0..=7 => Op::Store {
                    engine,
                    tier,
                    chain,
                    start,
                    end,
                },
                8..=11 => {
                    let at = below(len);
                    Op::Remove {
                        engine,
                        tier,
                        chain,
                        start: at,
                        end: at + 1,
                        order: RemovalOrder::Batch,
                    }
                }
                12 | 13 => Op::Remove {
                    engine,
                    tier,
                    chain,
                    start,
                    end,
                    order: [RemovalOrder::TailFirst, RemovalOrder::Shuffled][below(2)],
                },
                14 => Op::Clear { engine },
                _ => Op::Query {
                    chain,
                    len: 1 + below(len),
                    candidates: (below(3) == 0).then(|| {
                        let mut c: Vec<u32> = (0..engines).filter(|_| below(2) == 0).collect();
                        for i in (1..c.len()).rev() {
                            c.swap(i, below(i + 1));
                        }
                        if let Some(&first) = c.first() {
                            c.push(first);
                        }
                        c
                    }),
                },
            });
        }
        Self {
            seed,
            engines,
            chains,
            ops,
            pod_cache_size,
        }
    }
}

/// Runs `stream` on `index` (fresh, with `stream.engines` engines known to its adapter) and
/// on the reference; `Err` describes the first divergence. Holders and counts are compared
/// every `check_every` steps and after the last.
pub fn run(
    stream: &Stream,
    index: &mut dyn IndexUnderTest,
    check_every: usize,
) -> Result<(), String> {
    let mut reference = ReferenceIndex::new(stream.pod_cache_size);
    let weights = TierWeights::default();
    let mut shuffle = SplitMix64::new(stream.seed ^ 0x5eed);
    for (step, op) in stream.ops.iter().enumerate() {
        match op {
            Op::Store {
                engine,
                tier,
                chain,
                start,
                end,
            } => {
                let c = &stream.chains[*chain];
                let parent = start.checked_sub(1).map(|p| c[p]);
                index.store(*engine, TIERS[*tier], parent, &c[*start..*end]);
                reference.store(*engine, TIERS[*tier], &c[*start..*end]);
            }
            Op::Remove {
                engine,
                tier,
                chain,
                start,
                end,
                order,
            } => {
                let mut hs = stream.chains[*chain][*start..*end].to_vec();
                let tier = TIERS[*tier];
                match order {
                    RemovalOrder::Batch => index.remove(*engine, tier, &hs),
                    RemovalOrder::TailFirst => {
                        for h in hs.iter().rev() {
                            index.remove(*engine, tier, std::slice::from_ref(h));
                        }
                    }
                    RemovalOrder::Shuffled => {
                        for i in (1..hs.len()).rev() {
                            hs.swap(i, (shuffle.next_u64() % (i as u64 + 1)) as usize);
                        }
                        index.remove(*engine, tier, &hs);
                    }
                }
                reference.remove(*engine, tier, &hs);
            }
            Op::Clear { engine } => {
                index.clear(*engine);
                reference.clear_engine(*engine);
            }
            Op::Query {
                chain,
                len,
                candidates,
            } => {
                let hashes = &stream.chains[*chain][..*len];
                let mut got = index.score(hashes, candidates.as_deref());
                got.sort_by_key(|s| s.engine);
                let want = reference.score(hashes, candidates.as_deref(), &weights);
                let same = got.len() == want.len()
                    && got.iter().zip(&want).all(|(a, b)| {
                        a.engine == b.engine
                            && a.matched_blocks == b.matched_blocks
                            && (a.score - b.score).abs() < 1e-9
                    });
                if !same {
                    return Err(format!(
                        "step {step} {op:?}: index {got:?}, reference {want:?}"
                    ));
                }
                // The same blocks read as a span, per engine (a few, in turn).
                for engine in (step as u32 % stream.engines..stream.engines).step_by(3) {
                    let got = index.holds_each(hashes, engine);
                    let want: Vec<bool> = hashes
                        .iter()
                        .map(|&h| reference.holders(h).iter().any(|m| m.0 == engine))
                        .collect();
                    if got != want {
                        return Err(format!(
                            "step {step} {op:?}: engine {engine} holds {got:?}, reference {want:?}"
                        ));
                    }
                }
            }
        }
        if step % check_every.max(1) != 0 && step + 1 != stream.ops.len() {
            continue;
        }
        check_holders(stream, &reference, index, step)?;
    }
    Ok(())
}

/// Compares every chain block's holders, the key count and the membership count.
fn check_holders(
    stream: &Stream,
    reference: &ReferenceIndex,
    index: &mut dyn IndexUnderTest,
    step: usize,
) -> Result<(), String> {
    let key = |m: &(u32, Tier)| (m.0, m.1 as u8);
    for chain in &stream.chains {
        for h in chain {
            let mut got = index.lookup(*h);
            let mut want = reference.holders(*h).to_vec();
            got.sort_by_key(key);
            want.sort_by_key(key);
            if got != want {
                return Err(format!(
                    "step {step}: block {h:?} index {got:?}, reference {want:?}"
                ));
            }
        }
    }
    let want_keys: usize = reference
        .blocks()
        .map(|(_, holders)| {
            let mut lanes: Vec<usize> = holders.iter().map(|m| index.lane_of(m.0)).collect();
            lanes.sort_unstable();
            lanes.dedup();
            lanes.len()
        })
        .sum();
    let keys = index.keys();
    if keys != want_keys as u64 {
        return Err(format!("step {step}: {keys} keys, reference {want_keys}"));
    }
    let memberships = index.memberships();
    if memberships != reference.memberships() as u64 {
        return Err(format!(
            "step {step}: {memberships} memberships, reference {}",
            reference.memberships()
        ));
    }
    Ok(())
}

/// Drops ops from a diverging stream one at a time while it still diverges; returns the
/// shrunk stream and its divergence. `make` builds a fresh structure for each try.
pub fn shrink(
    stream: &Stream,
    make: &mut dyn FnMut() -> Box<dyn IndexUnderTest>,
    check_every: usize,
) -> (Stream, String) {
    let mut stream = stream.clone();
    let mut err = match run(&stream, make().as_mut(), check_every) {
        Err(e) => e,
        Ok(()) => return (stream, "the stream does not diverge".into()),
    };
    let mut i = 0;
    while i < stream.ops.len() {
        let mut fewer = stream.clone();
        fewer.ops.remove(i);
        match run(&fewer, make().as_mut(), check_every) {
            Err(e) => {
                stream = fewer;
                err = e;
            }
            Ok(()) => i += 1,
        }
    }
    (stream, err)
}

/// Runs each stream on a fresh structure from `make`; the first divergence, shrunk, as an
/// error naming its seed and minimal ops.
pub fn check_streams(
    streams: impl IntoIterator<Item = Stream>,
    make: &mut dyn FnMut(&Stream) -> Box<dyn IndexUnderTest>,
    check_every: usize,
) -> Result<(), String> {
    for stream in streams {
        if run(&stream, make(&stream).as_mut(), check_every).is_err() {
            let (shrunk, err) = shrink(&stream, &mut || make(&stream), check_every);
            return Err(format!(
                "seed {} ({} engines, podCacheSize {:?}) diverges; shrunk to {} ops:\n{:#?}\n{err}",
                stream.seed,
                stream.engines,
                stream.pod_cache_size,
                shrunk.ops.len(),
                shrunk.ops
            ));
        }
    }
    Ok(())
}
