//! The block index: for every (model, block key), the engines that hold the block and in which
//! tier; and the prefix scoring walk over it.
//!
//! One structure, the **run index** ([`runs`]): every block has an id, a chain's blocks take
//! consecutive ids, and holders are kept per **run** (a stretch of ids with one holder set) as
//! bitmaps over engines, so a store, a removal or a query costs per run it touches, not per
//! block. [`runs`]'s module docs give its shape, costs, invariants and concurrency.
//!
//! Around it, this module is the index of one model ([`ModelIndex`]): one or more **writer
//! lanes** ([`lane`]), each a complete run index of the engines assigned to it, by pod name (all
//! DP ranks of a pod together), with one writer and lock-free readers. Events of engines in
//! different lanes apply in parallel; a reader walks every lane ([`read`]; an engine's results
//! come from its lane only). Engine ids are global (`id % lanes` is the lane, `id / lanes` the
//! engine's slot in it). A block held by pods of two lanes is a key in each; `size` is one
//! budget ([`KeyBudget`]) for all lanes and, in an indexer, all models.
//!
//! Reads ([`ModelIndex::score_engines`], [`ModelIndex::lookup`]) take no lock and write nothing
//! shared. Writes go through a lane's [`IndexWriter`] ([`ModelIndex::write`],
//! [`ModelIndex::write_engine`]), which callers hold for a whole event batch of one engine.
//! Registering an engine takes a small registry lock (known engines are found in the published
//! [`EngineDirectory`] without it).
//!
//! Decisions:
//! - a `BlockStored` run whose parent this engine does not hold ("orphan") is stored anyway,
//!   keyed by its hashes, and counted: since a vLLM hash commits to its whole prefix, an orphan
//!   can never be mistaken for position 0 of another prompt; it only starts to score once its
//!   parent's chain arrives (e.g. by replay), which is exactly right;
//! - membership is exact by default: a block records every (engine, tier) that holds it, however
//!   many; `podCacheSize`, when configured, bounds it and drops the oldest holder beyond (each
//!   run keeps its holders' join order);
//! - `size` full: the lane that needs keys evicts whole runs not stored into recently (CLOCK,
//!   second chance) until the store is paid for, counted as capacity evictions.
//!
//! Memory: docs/benchmarks.md measures bytes per block and per membership at 16 and 1,024
//! pods (an id is 16 bytes in two arrays, a table slot 8 at load 0.4-0.85, a run's holders
//! inline up to one 64-engine window).
//!
//! `unsafe`: with `crate::memory`, only the run index's cells (`runs::cells`: the `Zeroable`
//! contract of its atomics), each block with its `// SAFETY:` argument.

mod chunked;
mod directory;
#[cfg(any(test, feature = "testing"))]
pub mod harness;
mod lane;
mod read;
#[cfg(any(test, feature = "testing"))]
pub mod reference;
mod runs;
mod stats;
mod table;
mod types;

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::BlockHash;
use directory::DirectoryBuilder;
pub use directory::{DenseView, EngineDirectory, NO_POD};
pub use lane::IndexWriter;
use lane::Lane;
pub use runs::{RunIndex, RunReader, RunScratch, RunStats, MAX_RUN_ENGINES};
pub use stats::{IndexStats, StoreOutcome};
pub use types::{
    EngineId, EngineKey, EngineScore, IndexConfig, IndexConfigError, KeyBudget, Tier, TierWeights,
    MAX_WRITER_LANES,
};

/// The index for one model: one or more **writer lanes**, each a complete index of the
/// engines assigned to it (by pod name, so a pod's DP ranks share a lane). Events of engines in
/// different lanes apply in parallel; a reader walks every lane, lock-free. Engine ids are
/// global: engine `e` lives in lane `e % lanes`, at slot `e / lanes` of that lane.
pub struct ModelIndex {
    config: IndexConfig,
    lanes: Box<[Lane]>,
    directory: ArcSwap<EngineDirectory>,
    registry: Mutex<Registry>,
}

/// Engine registration (rare: a new publisher), shared by the lanes.
#[derive(Default)]
struct Registry {
    ids: std::collections::HashMap<EngineKey, EngineId>,
    /// Key of each global engine id (`None`: free).
    keys: Vec<Option<EngineKey>>,
    /// Per lane: freed slots below `next_slot` (reused lowest first, so ids stay dense), and
    /// the slot after the highest in use.
    free: Vec<std::collections::BTreeSet<u32>>,
    next_slot: Vec<u32>,
    /// The master copy of what readers see; published (an O(1) clone) after every change.
    directory: DirectoryBuilder,
}

/// A seed for a lane's table positions, random per process (so no publisher can aim its
/// hashes at one probe sequence across restarts).
fn random_seed() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    RandomState::new().hash_one(0x6b76_2d69_6e64_6578u64)
}

impl ModelIndex {
    /// An empty index with a key budget of its own. `config` must be valid
    /// ([`IndexConfig::validate`]).
    pub fn new(config: IndexConfig) -> Result<Self, IndexConfigError> {
        let budget = KeyBudget::new(config.max_keys as u64);
        Self::with_budget(config, budget)
    }

    /// An empty index whose keys count against `budget`, shared with other indexes: when it
    /// is spent, a lane evicts its own blocks (CLOCK) to make room.
    pub fn with_budget(
        config: IndexConfig,
        budget: Arc<KeyBudget>,
    ) -> Result<Self, IndexConfigError> {
        config.validate()?;
        let lanes = config.writer_lanes as u32;
        let lanes_built = (0..lanes)
            .map(|lane| {
                // Room past `size` for one store's new blocks, which the lane pays for by
                // eviction after the store (`lane`).
                let capacity =
                    u32::try_from(config.max_keys.saturating_add(1 << 16)).unwrap_or(u32::MAX - 2);
                let index =
                    RunIndex::with_pod_cache_size(random_seed(), capacity, config.pod_cache_size);
                Lane::new(index, budget.clone(), lane, lanes)
            })
            .collect();
        Ok(Self {
            lanes: lanes_built,
            directory: ArcSwap::from_pointee(EngineDirectory::default()),
            registry: Mutex::new(Registry {
                free: vec![Default::default(); lanes as usize],
                next_slot: vec![0; lanes as usize],
                ..Default::default()
            }),
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

    /// Distinct block keys as of the last finished writes, all lanes (lock-free). A block
    /// held by engines of two lanes is a key in each.
    pub fn key_count(&self) -> u64 {
        (0..self.lanes.len())
            .map(|i| self.lanes[i].counters().keys)
            .sum()
    }

    /// Size and activity counters (as of the last finished writes, all lanes) and memory held.
    pub fn stats(&self) -> IndexStats {
        let mut total = IndexStats::default();
        for i in 0..self.lanes.len() {
            total.add(&self.lanes[i].counters());
        }
        total.memory_bytes = self.memory_bytes() as u64;
        total
    }

    /// Bytes the index holds: every lane's ids, runs, table, holder words and bookkeeping
    /// (takes each lane's writer briefly).
    pub fn memory_bytes(&self) -> usize {
        self.lanes.iter().map(Lane::memory_bytes).sum()
    }

    /// The lane of an engine id.
    fn lane_of(&self, engine: EngineId) -> usize {
        (engine % self.lanes.len() as u32) as usize
    }

    /// The id of `key`, registering the engine on first sight in the lane its pod hashes to.
    /// `None` when its lane holds [`MAX_RUN_ENGINES`] engines.
    pub fn engine(&self, key: &EngineKey) -> Option<EngineId> {
        // Known engines are found in the published directory, without the registry's lock.
        if let Some(id) = self.directory.load().engine(&key.pod, key.dp_rank) {
            return Some(id);
        }
        let mut registry = self.registry.lock();
        if let Some(&id) = registry.ids.get(key) {
            return Some(id);
        }
        let lanes = self.lanes.len() as u32;
        let lane = (crate::mix::fnv1a(key.pod.as_bytes()) % lanes as u64) as u32;
        let slot = match registry.free[lane as usize].pop_first() {
            Some(slot) => slot,
            None => {
                let slot = registry.next_slot[lane as usize];
                if slot >= MAX_RUN_ENGINES {
                    return None;
                }
                registry.next_slot[lane as usize] += 1;
                slot
            }
        };
        let id = slot * lanes + lane;
        if registry.keys.len() <= id as usize {
            registry.keys.resize(id as usize + 1, None);
        }
        registry.keys[id as usize] = Some(key.clone());
        registry.ids.insert(key.clone(), id);
        self.lanes[lane as usize].write(|w| w.register(id));
        registry.directory.add(id, key);
        self.directory.store(Arc::new(registry.directory.publish()));
        Some(id)
    }

    /// Removes an engine entirely (its blocks, then its id). Returns memberships removed.
    pub fn remove_engine(&self, key: &EngineKey) -> usize {
        let mut registry = self.registry.lock();
        let Some(id) = registry.ids.remove(key) else {
            return 0;
        };
        let removed = self.write(id, |w| {
            let removed = w.clear_engine(id);
            w.unregister(id);
            removed
        });
        let lanes = self.lanes.len() as u32;
        registry.keys[id as usize] = None;
        // Free the slot; slots at the end of the lane are given back, so the per-engine
        // arrays follow the engines known now, not the most ever known.
        let lane = (id % lanes) as usize;
        registry.free[lane].insert(id / lanes);
        while let Some(last) = registry.next_slot[lane].checked_sub(1) {
            if !registry.free[lane].remove(&last) {
                break;
            }
            registry.next_slot[lane] = last;
        }
        while matches!(registry.keys.last(), Some(None)) {
            registry.keys.pop();
        }
        if registry.keys.capacity() > 64 && registry.keys.len() < registry.keys.capacity() / 4 {
            registry.keys.shrink_to_fit();
        }
        if registry.ids.capacity() > 64 && registry.ids.len() < registry.ids.capacity() / 4 {
            // A fleet that shrank (pods forgotten) gives the map's memory back.
            registry.ids.shrink_to_fit();
        }
        registry.directory.remove(id);
        self.directory.store(Arc::new(registry.directory.publish()));
        removed
    }

    /// Removes every engine (DP rank) of `pod`, blocks and ids: a pod that is gone. Returns
    /// memberships removed.
    pub fn remove_pod(&self, pod: &str) -> usize {
        let directory = self.directory.load_full();
        let keys: Vec<EngineKey> = directory
            .engines_of(pod)
            .iter()
            .filter_map(|&e| directory.key(e))
            .collect();
        keys.iter().map(|key| self.remove_engine(key)).sum()
    }

    /// Runs `f` as the single writer of `engine`'s lane (hold it for a whole event batch of
    /// that engine). Writers of other lanes run in parallel; readers never wait.
    pub fn write<R>(&self, engine: EngineId, f: impl FnOnce(&mut IndexWriter<'_>) -> R) -> R {
        self.lanes[self.lane_of(engine)].write(f)
    }

    /// Registers `key` if needed and runs `f` as its lane's writer with its id; `None` when
    /// the engine cannot be registered ([`MAX_RUN_ENGINES`] in its lane).
    pub fn write_engine<R>(
        &self,
        key: &EngineKey,
        f: impl FnOnce(&mut IndexWriter<'_>, EngineId) -> R,
    ) -> Option<R> {
        let engine = self.engine(key)?;
        Some(self.write(engine, |w| f(w, engine)))
    }

    /// Evicts up to `n` blocks (CLOCK) from the lane holding the most keys: room for another
    /// index sharing the key budget. Returns the blocks evicted.
    pub fn evict(&self, n: usize) -> usize {
        (0..self.lanes.len())
            .max_by_key(|&i| self.lanes[i].counters().keys)
            .map_or(0, |i| self.lanes[i].write(|w| w.evict(n)))
    }

    /// Calls `f` with every engine and the blocks it holds, with their tiers: what a snapshot
    /// stores, one engine at a time (one reused buffer, so the copy never holds the whole
    /// index). Takes each lane's writer in turn; a consistent copy needs the caller to have
    /// stopped its writers.
    pub fn export_each(&self, mut f: impl FnMut(&EngineKey, &[(BlockHash, Tier)])) {
        let registry = self.registry.lock();
        let mut blocks = Vec::new();
        for i in 0..self.lanes.len() {
            self.lanes[i].write(|w| {
                for id in w.engines() {
                    if let Some(Some(key)) = registry.keys.get(id as usize) {
                        blocks.clear();
                        w.export_engine(id, &mut blocks);
                        f(key, &blocks);
                    }
                }
            });
        }
    }

    /// Every engine with the memberships it holds.
    pub fn engine_blocks(&self) -> Vec<(EngineKey, u64)> {
        let registry = self.registry.lock();
        let mut out = Vec::new();
        for i in 0..self.lanes.len() {
            for (id, live) in self.lanes[i].live_engines() {
                if let Some(Some(key)) = registry.keys.get(id as usize) {
                    out.push((key.clone(), live));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(v: &[u64]) -> Vec<BlockHash> {
        v.iter().copied().map(BlockHash::new).collect()
    }

    fn index(max_keys: usize, pod_cache_size: Option<usize>, writer_lanes: usize) -> ModelIndex {
        ModelIndex::new(IndexConfig {
            max_keys,
            pod_cache_size,
            writer_lanes,
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

    /// Stores as its engine's writer.
    fn store(ix: &ModelIndex, e: EngineId, tier: Tier, parent: Option<u64>, hashes: &[u64]) {
        ix.write(e, |w| {
            w.store(e, tier, parent.map(BlockHash::new), &hs(hashes));
        });
    }

    #[test]
    fn consecutive_prefix_with_holes_and_tiers() {
        for (lanes, ix) in [1, 2, 3].map(|l| (l, index(1000, None, l))) {
            let a = ix.engine(&EngineKey::new("a", 0)).expect("room");
            let b = ix.engine(&EngineKey::new("b", 0)).expect("room");
            store(&ix, a, Tier::Gpu, None, &[1, 2, 3, 4]);
            store(&ix, b, Tier::Cpu, None, &[1, 2]);
            store(&ix, b, Tier::Gpu, Some(2), &[3]);
            let mut want = vec![(a, 4), (b, 3)];
            want.sort();
            assert_eq!(scores(&ix, &[1, 2, 3, 4, 5]), want, "{lanes} lanes");
            ix.write(a, |w| w.remove(a, Tier::Gpu, &hs(&[2])));
            let mut want = vec![(a, 1), (b, 3)];
            want.sort();
            assert_eq!(scores(&ix, &[1, 2, 3, 4]), want, "a hole stops a");
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
    }

    #[test]
    fn a_writer_ignores_engines_of_other_lanes() {
        let ix = index(1000, None, 2);
        let engines: Vec<_> = (0..8)
            .filter_map(|i| ix.engine(&EngineKey::new(&format!("p{i}"), 0)))
            .collect();
        let (a, b) = engines
            .iter()
            .flat_map(|&a| engines.iter().map(move |&b| (a, b)))
            .find(|(a, b)| a % 2 != b % 2)
            .expect("eight pods fill both lanes");
        let outcome = ix.write(a, |w| w.store(b, Tier::Gpu, None, &hs(&[1, 2])));
        assert_eq!(outcome.added, 0, "engine {b} is not in {a}'s lane");
        assert!(ix.lookup(BlockHash::new(1)).is_empty());
    }

    #[test]
    fn clear_and_pod_cache_eviction_and_capacity() {
        let ix = index(4, Some(2), 1);
        let ids: Vec<_> = (0..3)
            .map(|i| {
                ix.engine(&EngineKey::new(&format!("p{i}"), 0))
                    .expect("room")
            })
            .collect();
        ix.write(ids[0], |w| {
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

    #[test]
    fn runs_evict_at_size_and_keep_the_count() {
        let ix = index(10, None, 1);
        let e = ix.engine(&EngineKey::new("a", 0)).expect("room");
        store(&ix, e, Tier::Gpu, None, &[1, 2, 3, 4, 5, 6]);
        store(&ix, e, Tier::Gpu, None, &[11, 12, 13, 14, 15, 16]);
        let stats = ix.stats();
        assert!(stats.keys <= 10, "size bound holds: {stats:?}");
        // Both chains share one run (one holder, adjacent ids): the hand evicts just what the
        // second store needs, the oldest blocks first.
        assert_eq!(stats.capacity_evictions, 2, "{stats:?}");
        assert_eq!(stats.memberships, 10);
        assert_eq!(scores(&ix, &[11, 12, 13]), vec![(e, 3)]);
        assert!(scores(&ix, &[1, 2]).is_empty());
        assert_eq!(scores(&ix, &[3, 4]), vec![(e, 2)]);
        let mut exported = Vec::new();
        ix.export_each(|_, blocks| exported.extend_from_slice(blocks));
        assert_eq!(exported.len(), 10);
        assert_eq!(ix.engine_blocks()[0].1, 10);
        assert_eq!(ix.remove_pod("a"), 10);
        assert_eq!(ix.stats().keys, 0);
    }

    #[test]
    fn runs_keep_pod_cache_size_and_count_what_it_drops() {
        let ix = ModelIndex::new(IndexConfig {
            pod_cache_size: Some(2),
            ..IndexConfig::default()
        })
        .expect("runs take podCacheSize");
        let chain = hs(&(1..=10).collect::<Vec<u64>>());
        let pods: Vec<_> = (0..3)
            .map(|p| {
                ix.engine(&EngineKey::new(&format!("p{p}"), 0))
                    .expect("room")
            })
            .collect();
        for &pod in &pods {
            ix.write(pod, |w| w.store(pod, Tier::Gpu, None, &chain));
        }
        let held: std::collections::BTreeMap<String, u64> = ix
            .engine_blocks()
            .into_iter()
            .map(|(key, n)| (key.pod.to_string(), n))
            .collect();
        let want = [("p0", 0), ("p1", 10), ("p2", 10)].map(|(p, n)| (p.to_string(), n));
        assert_eq!(
            held,
            want.into(),
            "the oldest holder made room for the third"
        );
        assert_eq!(scores(&ix, &[1, 2, 3]), vec![(pods[1], 3), (pods[2], 3)]);
        let stats = ix.stats();
        assert_eq!((stats.memberships, stats.pod_cache_evictions), (20, 10));
    }

    #[test]
    fn lanes_share_the_size_budget() {
        let ix = index(8, None, 2);
        let engines: Vec<_> = (0..6)
            .filter_map(|i| ix.engine(&EngineKey::new(&format!("p{i}"), 0)))
            .collect();
        for (k, &e) in engines.iter().enumerate() {
            let base = 100 * k as u64;
            store(&ix, e, Tier::Gpu, None, &[base + 1, base + 2, base + 3]);
        }
        assert!(ix.stats().keys <= 8, "{:?}", ix.stats());
        assert!(ix.stats().capacity_evictions > 0);
    }
}
