//! The block index: for every (model, block hash), the engines that hold the block and in which
//! tier; and the prefix scoring walk over it.
//!
//! Shape (per model, [`ModelIndex`]):
//! - a **node** per distinct block (24 bytes: hash, two member words with overflow pages beyond,
//!   a hint to the block's most recently stored child), in a chunked slab; a stored run gets
//!   consecutive node ids where free ids allow (freed ids are kept as ranges), so a chain is
//!   mostly contiguous in memory;
//! - a **table** from block hash to node (8-byte key-less slots, open addressing, sized to 1.5x
//!   its live entries), published to readers through `ArcSwap` so a rebuild never blocks them;
//! - per engine, a **reverse list** of the nodes it holds (4 bytes per membership, compacted
//!   lazily), so clearing an engine costs O(its blocks), not O(index).
//!
//! Reads ([`ModelIndex::score_engines`], [`ModelIndex::lookup`]) take no lock and write nothing
//! shared: they pin the current table, then walk the prompt's hashes. Consecutive blocks of a
//! chain are found through the parent's child hint (one compare) and only fall back to a table
//! probe when the chain branches, so a 700-block prompt costs a few probes, not 700. Each node
//! is read under its seqlock, so a reader sees each block's member list as of one moment.
//!
//! Writes go through one writer per model ([`ModelIndex::write`]), which callers hold for a
//! whole event batch; different models write in parallel.
//!
//! Decisions:
//! - a `BlockStored` run whose parent this engine does not hold ("orphan") is stored anyway,
//!   keyed by its hashes, and counted: since a vLLM hash commits to its whole prefix, an orphan
//!   can never be mistaken for position 0 of another prompt; it only starts to score once its
//!   parent's chain arrives (e.g. by replay), which is exactly right;
//! - membership is exact by default: a block records every (engine, tier) that holds it, however
//!   many (sets of more than two are interned, so a prefix the whole fleet holds costs one set);
//!   `podCacheSize`, when configured, bounds it and drops the oldest member beyond (members keep
//!   store order);
//! - `size` full: a CLOCK hand over the nodes evicts a block not stored recently (second
//!   chance), with all its memberships; counted as capacity evictions.
//!
//! Memory per block: 24 bytes (node) + 8 / load-factor bytes (table, load 0.67-0.85) + 4 bytes
//! per membership (reverse list; up to 1.25x before compaction) + 1 bit (CLOCK).

// The index's memory modules: the only code in kv-core allowed `unsafe` (zeroed huge-page
// allocations, the `Zeroable` contract of the slab's atomics, prefetch hints), each block with
// its `// SAFETY:` argument.
#[allow(unsafe_code)]
mod memory;
#[allow(unsafe_code)]
mod slab;
mod table;

mod read;
mod seqlock;
mod types;
mod write;

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::BlockHash;
use slab::Slab;
use table::Table;
pub use types::{
    EngineDirectory, EngineId, EngineKey, EngineScore, IndexConfig, IndexConfigError, IndexStats,
    KeyBudget, Tier, TierWeights, MAX_ENGINES,
};
use write::{random_seed, Counters, Writer};
pub use write::{IndexWriter, StoreOutcome};

/// The index for one model.
pub struct ModelIndex {
    config: IndexConfig,
    /// Mixes block hashes into table positions (random per index).
    seed: u64,
    slab: Slab,
    table: ArcSwap<Table>,
    directory: ArcSwap<EngineDirectory>,
    writer: Mutex<Writer>,
    counters: Counters,
    /// Keys this index may create, shared with the other models' indexes.
    budget: Arc<KeyBudget>,
}

/// Maps the one hash value the slab reserves (0 = free node) to another value; a real block
/// hash is 0 with probability 2^-64, and would merely share a key with this alias.
#[inline(always)]
fn key(hash: BlockHash) -> u64 {
    match hash.get() {
        0 => 0x9E37_79B9_7F4A_7C15,
        h => h,
    }
}

#[inline(always)]
fn member(engine: EngineId, tier: Tier) -> u32 {
    engine << 8 | tier as u32
}

const INITIAL_TABLE: usize = 1024;

impl ModelIndex {
    /// An empty index with a key budget of its own. `config` must be valid
    /// ([`IndexConfig::validate`]).
    pub fn new(config: IndexConfig) -> Result<Self, IndexConfigError> {
        let budget = KeyBudget::new(config.max_keys as u64);
        Self::with_budget(config, budget)
    }

    /// An empty index whose keys count against `budget`, shared with other indexes: when it
    /// is spent, this index evicts its own blocks (CLOCK) to make room.
    pub fn with_budget(
        config: IndexConfig,
        budget: Arc<KeyBudget>,
    ) -> Result<Self, IndexConfigError> {
        config.validate()?;
        let seed = random_seed();
        let table = Arc::new(Table::with_capacity(INITIAL_TABLE, seed));
        Ok(Self {
            seed,
            slab: Slab::new(config.max_keys),
            table: ArcSwap::new(table.clone()),
            directory: ArcSwap::from_pointee(EngineDirectory::default()),
            writer: Mutex::new(Writer::new(table)),
            counters: Counters::default(),
            budget,
            config,
        })
    }

    /// The capacity settings.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// The engines known now (readers; lock-free).
    pub fn directory(&self) -> Arc<EngineDirectory> {
        self.directory.load_full()
    }

    /// Distinct block keys as of the last finished write (lock-free).
    pub fn key_count(&self) -> u64 {
        self.counters.snapshot().keys
    }

    /// Size and activity counters (as of the last finished write) and memory held.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            memory_bytes: self.memory_bytes() as u64,
            ..self.counters.snapshot()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(v: &[u64]) -> Vec<BlockHash> {
        v.iter().copied().map(BlockHash::new).collect()
    }

    fn index(max_keys: usize, pod_cache_size: Option<usize>) -> ModelIndex {
        ModelIndex::new(IndexConfig {
            max_keys,
            pod_cache_size,
        })
        .expect("valid config")
    }

    fn scores(ix: &ModelIndex, hashes: &[u64]) -> Vec<(EngineId, u32)> {
        let mut out = Vec::new();
        ix.score_engines(&hs(hashes), None, &TierWeights::default(), &mut out);
        let mut v: Vec<_> = out.iter().map(|s| (s.engine, s.matched_blocks)).collect();
        v.sort();
        v
    }

    #[test]
    fn consecutive_prefix_with_holes_and_tiers() {
        let ix = index(1000, None);
        let (a, b) = ix.write(|w| {
            let a = w.engine(&EngineKey::new("a", 0)).expect("room");
            let b = w.engine(&EngineKey::new("b", 0)).expect("room");
            w.store(a, Tier::Gpu, None, &hs(&[1, 2, 3, 4]));
            w.store(b, Tier::Cpu, None, &hs(&[1, 2]));
            w.store(b, Tier::Gpu, Some(BlockHash::new(2)), &hs(&[3]));
            (a, b)
        });
        assert_eq!(scores(&ix, &[1, 2, 3, 4, 5]), vec![(a, 4), (b, 3)]);
        ix.write(|w| w.remove(a, Tier::Gpu, &hs(&[2])));
        assert_eq!(
            scores(&ix, &[1, 2, 3, 4]),
            vec![(a, 1), (b, 3)],
            "a hole stops a"
        );
        let mut out = Vec::new();
        ix.score_engines(
            &hs(&[1, 2, 3]),
            Some(&[b]),
            &TierWeights::default(),
            &mut out,
        );
        assert_eq!(out.len(), 1);
        assert!((out[0].score - (0.8 + 0.8 + 1.0)).abs() < 1e-9, "{out:?}");
    }

    #[test]
    fn clear_and_pod_cache_eviction_and_capacity() {
        let ix = index(4, Some(2));
        ix.write(|w| {
            let ids: Vec<_> = (0..3)
                .map(|i| {
                    w.engine(&EngineKey::new(&format!("p{i}"), 0))
                        .expect("room")
                })
                .collect();
            for &e in &ids {
                w.store(e, Tier::Gpu, None, &hs(&[10, 11]));
            }
            assert_eq!(
                w.engine_blocks(ids[0]),
                0,
                "oldest member dropped at podCacheSize"
            );
            assert_eq!(w.clear_engine(ids[1]), 2);
            w.store(
                ids[2],
                Tier::Gpu,
                Some(BlockHash::new(11)),
                &hs(&[12, 13, 14, 15]),
            );
        });
        let stats = ix.stats();
        assert!(stats.keys <= 4, "size bound holds: {stats:?}");
        assert!(stats.capacity_evictions >= 2, "{stats:?}");
    }
}
