//! The run index: block hashes to the engines (and tiers) that hold them, with
//! holders kept per **run** instead of per block; one writer, lock-free readers.
//!
//! Shape:
//! - every block in the index has an id: its hash in one array (what a walk compares, 8 bytes
//!   a block) and its run and chain hint in another (what a jump reads); the table (key-less
//!   tagged slots) maps hash -> id.
//!   New blocks of a stored run take consecutive ids where free ids allow, so a chain is a
//!   stretch of ids ([`free`] picks a free range the stretch fits in, or a long one, before
//!   short ones);
//! - a **run** is a stretch of ids `start .. end` whose blocks all have one holder set. Runs
//!   split where a store, a removal or a block leaving cuts them, and merge with a neighbour of
//!   equal holders again, always relabelling the smaller side;
//! - holders are bitmaps ([`holders`]): one over engines for GPU copies, one over
//!   `engine * 4 + tier` for the other tiers (empty in a fleet that reports only GPU blocks);
//!   each inline up to one 64-bit window, pooled words beyond.
//!
//! Costs: a block entering the index pays one table insert; a store that joins blocks others
//! hold, or a removal that leaves other holders, pays per run it touches (stretches are found by
//! comparing `hashes[id + 1]` with the event's next hash, without probing), plus the relabels of
//! split-off parts; only a block leaving the index pays a table delete. A query compares the
//! prompt's next hash with `hashes[id + 1]` (sequential memory) and probes only where the chain
//! leaves the stretch; it intersects holder sets only where the run changes. Prefetches hide
//! most of a jump: a run's slot names the id and the run its chain last went on at (hints kept
//! outside the seqlock, never trusted), fetched on entering the run with the run's last id's
//! hint, and the hashes after a block jumped to are fetched before its run is read. A store's
//! new blocks go in as stretches: each block pays its id and its table entry, the stretch its
//! run, its range and its merge.
//!
//! Concurrency: [`RunIndex`] is the writer (`&mut self`); [`RunReader`]s (any number, any
//! thread) score and look up without a lock. Ids, runs and pooled words are atomics in chunks
//! that never move ([`cells`] has the publication rules); a reader checks that the run it read
//! still covers its id under the run's seqlock and retries otherwise; the table is replaced
//! through `ArcSwap` when it grows, and a deletion that moves table entries back is a seqlock
//! write of the table's own sequence, during which a reader's table miss is probed again.
//!
//! Exactness does not depend on the structure being a chain: a block is named by its hash at
//! every step of a query, so a publisher whose "chain" is not one (a forged run) can only put
//! its own blocks in odd places; other members' holdings are never read through its runs.
//!
//! Bounds: at most `capacity` block ids (a store past it drops the new blocks, counted); runs
//! never outnumber live ids by more than the two a split creates before the old run shrinks.
//!
//! Invariants: an id's run is `NONE` iff the id is free, and then its hash is 0; the table
//! holds live ids only; a live run's ids all map to it (between operations); two adjacent runs
//! never have equal holder sets (in the same order, under `podCacheSize`) after an operation
//! (merged); a run's holder set is never empty (unless the word pool was exhausted, counted in
//! [`RunStats::pool_exhausted`]).
//!
//! `podCacheSize` (optional): each run also keeps its holders' join order ([`order`], writer
//! only); a store that would give a block more holders than the bound drops the oldest, and
//! adjacent runs merge only when their orders agree too.

#[allow(unsafe_code)] // `Zeroable` for the slots, each with its `SAFETY:` argument
mod cells;
mod evict;
mod free;
mod holders;
mod order;
mod read;
mod surgery;
mod write;

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::table::Table;
use super::types::EngineId;
use cells::{
    IdSlot, IdSlots, Run, RunSlot, RunSlots, Words, WriterChunks, WriterIds, RUN_CHUNK, SINK_RUN,
};
use holders::RunHolders;
use holders::{WordPool, WINDOW};
use order::HolderOrder;
pub use read::{RunReader, RunScratch};

/// How far ahead of the block in hand a write prefetches table slots: enough to cover a
/// miss's latency, few enough that a stretch found without probing wastes little.
const PREFETCH_AHEAD: usize = 12;

/// When the table is rebuilt (at 2.5 times its live entries), in percent of its slots: when
/// live entries would fill [`TABLE_FULL_PERCENT`] (each rebuild of a growing table then more
/// than doubles it, and few rebuilds mean little memory written), when a table that churns
/// (as many deletions as live entries since its last rebuild) is over [`TABLE_CHURN_PERCENT`]
/// full, or when it is under [`TABLE_EMPTY_PERCENT`] full (memory follows an index that
/// shrank). Every block entering the index probes for its hash and misses, and a linear
/// probe's miss reads about `(1 + 1 / (1 - load)^2) / 2` slots: 23 at 85%, under 4 at 60%, 2
/// at 40%; a deletion moves entries back over as many. Deletions leave no tombstones
/// ([`super::table`]), so a table churning at a steady size keeps its load. Earlier variants:
/// docs/benchmarks-history.md ("Table rebuilds: churn and growth").
const TABLE_FULL_PERCENT: usize = 85;

/// See [`TABLE_FULL_PERCENT`].
const TABLE_CHURN_PERCENT: usize = 60;

/// See [`TABLE_FULL_PERCENT`].
const TABLE_EMPTY_PERCENT: usize = 10;

/// Members per engine in the other-tiers set (bit `t` for tier `t`; GPU has its own set).
const TIERS: u32 = 4;

/// The most engines a run index holds (its members must fit the pool's longest set).
pub const MAX_RUN_ENGINES: u32 = holders::MAX_WORDS / TIERS * WINDOW;

/// Why a run was split (reported per cause).
#[derive(Clone, Copy)]
enum Cause {
    /// A store added a member to part of a run.
    Join,
    /// A removal took a member off part of a run others still hold.
    Hole,
    /// Blocks left the index from part of a run.
    Leave,
}

/// Shape and work counters of a [`RunIndex`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RunStats {
    /// Blocks in the index.
    pub blocks: u64,
    /// Live runs.
    pub runs: u64,
    /// Runs split by a store joining part of them.
    pub splits_join: u64,
    /// Runs split by a removal leaving other holders.
    pub splits_hole: u64,
    /// Runs split by blocks leaving the index.
    pub splits_leave: u64,
    /// Adjacent runs merged (equal holders).
    pub merges: u64,
    /// Block ids relabelled to another run (what splits and merges cost).
    pub relabels: u64,
    /// Pooled words of holder sets wider than one 64-member window.
    pub holder_words: u64,
    /// Block ids handed out, live or free (16 bytes each, in two arrays): above `blocks` by the
    /// free ids (the free-id policy takes fresh ids for a long stretch only while free ids are under an
    /// eighth of live ones).
    pub ids: u64,
    /// New blocks not stored because every id was in use (the capacity).
    pub dropped_full: u64,
    /// Holder changes the word pool had no room for (the part scores for no one).
    pub pool_exhausted: u64,
    /// Memberships dropped to keep a block within `podCacheSize` (the oldest holder first).
    pub pod_cache_evictions: u64,
}

/// What readers share with the writer.
struct Shared {
    table: ArcSwap<Table>,
    ids: IdSlots,
    runs: RunSlots,
    words: Words,
    /// Blocks readers gave up on (`read`'s module docs), over every reader.
    gave_up: std::sync::atomic::AtomicU64,
}

/// The run index's writer (see the module docs); [`RunIndex::reader`] hands out readers.
pub struct RunIndex {
    /// The shared memory, through the index's own reader.
    reader: RunReader,
    /// The published table (the writer's handle: no `ArcSwap` load per probe).
    table: Arc<Table>,
    /// The writer's handles on the id and run chunks.
    id_chunks: WriterIds,
    run_chunks: WriterChunks<RunSlot, RUN_CHUNK>,
    /// Live table entries, and entries deleted since the table was built.
    table_live: usize,
    table_deleted: usize,
    /// Ids handed out so far (live or free), and the most there may be.
    ids_len: u32,
    capacity: u32,
    /// Run numbers handed out so far (live or free).
    runs_len: u32,
    free_runs: Vec<u32>,
    /// Freed ids as ranges, by size ([`free`]): a new stretch gets ascending ids, whichever
    /// order they were freed in, and few hops.
    free: free::FreeIds,
    pool: WordPool,
    /// Per engine: id ranges it was given (stale entries allowed), so a clear walks its runs.
    ranges: Vec<Vec<(u32, u32)>>,
    /// Per engine: `ranges` length after its last compaction.
    compacted: Vec<usize>,
    /// Per engine: the first id of its last removal ([`RunIndex::near_cursor`]).
    cursors: Vec<u32>,
    /// CLOCK reference bits, one per run number, and the hand (an id).
    referenced: Vec<u64>,
    hand: u32,
    /// Holders' join order, kept only under `podCacheSize`.
    order: Option<HolderOrder>,
    /// Memberships dropped by `podCacheSize` since the last [`RunIndex::take_displaced`]:
    /// (engine, blocks).
    displaced: Vec<(EngineId, u64)>,
    stats: RunStats,
}

impl RunIndex {
    /// An empty index of at most `capacity` blocks; `seed` mixes block hashes into table
    /// positions.
    pub fn new(seed: u64, capacity: u32) -> Self {
        Self::with_pod_cache_size(seed, capacity, None)
    }

    /// [`RunIndex::new`] whose blocks keep at most `pod_cache_size` (engine, tier) holders
    /// each when set, the oldest dropped first (`podCacheSize`; `None`: exact).
    pub fn with_pod_cache_size(seed: u64, capacity: u32, pod_cache_size: Option<usize>) -> Self {
        let capacity = capacity.clamp(1, u32::MAX - 2);
        let table = Arc::new(Table::with_capacity(1024, seed));
        // A split writes up to two runs before the run it splits shrinks.
        let runs = capacity as usize + 2;
        // Pooled words (sets wider than one window): sixteen per block (a run per block, each
        // held by a thousand engines), allocated in chunks as sets need them. Past that, a
        // change that needs words is counted and scores for no one (`pool_exhausted`).
        let words = (capacity as usize * 16).clamp(1 << 16, 1 << 32);
        Self {
            reader: RunReader::new(Arc::new(Shared {
                table: ArcSwap::new(table.clone()),
                ids: IdSlots::new(capacity as usize),
                runs: RunSlots::new(runs),
                words: Words::new(words),
                gave_up: Default::default(),
            })),
            table,
            id_chunks: WriterIds::default(),
            run_chunks: WriterChunks::default(),
            table_live: 0,
            table_deleted: 0,
            ids_len: 0,
            capacity,
            runs_len: 0,
            free_runs: Vec::new(),
            free: free::FreeIds::default(),
            pool: WordPool::default(),
            ranges: Vec::new(),
            compacted: Vec::new(),
            cursors: Vec::new(),
            referenced: Vec::new(),
            hand: 0,
            order: pod_cache_size.map(HolderOrder::new),
            displaced: Vec::new(),
            stats: RunStats::default(),
        }
    }

    /// The index's lock-free reader: score and look up through it (clone it for another
    /// thread: a reference count).
    pub fn reader(&self) -> &RunReader {
        &self.reader
    }

    /// Counters (splits, merges, relabels) and shape (blocks, runs).
    pub fn stats(&self) -> RunStats {
        RunStats {
            holder_words: self.pool.live_words() as u64,
            ids: u64::from(self.ids_len),
            ..self.stats
        }
    }

    /// Bytes held: id and run slots, table, pooled words, the writer's lists.
    pub fn allocated_bytes(&self) -> usize {
        self.reader.shared.ids.allocated_bytes()
            + self.reader.shared.runs.allocated_bytes()
            + self.reader.shared.words.allocated_bytes()
            + self.table.allocated_bytes()
            + self.free_runs.capacity() * 4
            + self.free.allocated_bytes()
            + self.ranges.capacity() * std::mem::size_of::<Vec<(u32, u32)>>()
            + self.ranges.iter().map(|r| r.capacity() * 8).sum::<usize>()
            + self.compacted.capacity() * std::mem::size_of::<usize>()
            + self.cursors.capacity() * 4
            + self.referenced.capacity() * 8
            + self.order.as_ref().map_or(0, HolderOrder::allocated_bytes)
    }

    /// Engines numbered `engines` and beyond are gone (cleared, then forgotten): their
    /// per-engine lists are released, so memory follows the engines known now, not the most
    /// ever known. An engine that still holds blocks keeps its list.
    pub fn release_engines_from(&mut self, engines: u32) {
        let keep = engines as usize;
        while self.ranges.len() > keep && self.ranges.last().is_some_and(Vec::is_empty) {
            self.ranges.pop();
        }
        let len = self.ranges.len();
        self.compacted.truncate(len);
        self.cursors.truncate(len);
        // Shrunk once half is unused: engines forgotten one by one cost amortised O(1).
        if self.ranges.capacity() > 2 * len.max(8) {
            self.ranges.shrink_to_fit();
            self.compacted.shrink_to_fit();
            self.cursors.shrink_to_fit();
        }
    }

    /// Hands `dropped(engine, memberships)` what `podCacheSize` dropped since the last call
    /// (the caller's per-engine counts).
    pub fn take_displaced(&mut self, mut dropped: impl FnMut(EngineId, u64)) {
        for (engine, n) in self.displaced.drain(..) {
            dropped(engine, n);
        }
    }

    /// Whether runs `a` and `b` may merge: equal holders (and, under `podCacheSize`, in the
    /// same order).
    fn mergeable(&self, a: u32, b: u32) -> bool {
        let words = &self.reader.shared.words;
        self.pool.same_run(
            &self.run_slot(a).holders(),
            &self.run_slot(b).holders(),
            words,
        ) && self.order.as_ref().is_none_or(|o| o.same(a, b))
    }

    /// The slot of `id` (the writer's view).
    #[inline(always)]
    fn id(&self, id: u32) -> IdSlot<'_> {
        self.id_chunks.get(id)
    }

    /// The slot of run `r`.
    #[inline(always)]
    fn run_slot(&self, r: u32) -> &RunSlot {
        self.run_chunks.get(r, &SINK_RUN)
    }

    /// Run `r` as it is now.
    #[inline(always)]
    fn run(&self, r: u32) -> Run {
        self.run_slot(r).load()
    }

    /// The first live id in `id .. end` and its run: how the walks over an engine's ranges
    /// skip freed ids.
    fn next_run(&self, mut id: u32, end: u32) -> Option<(u32, Run)> {
        while id < end {
            let r = self.id(id).run();
            if r != cells::NONE {
                return Some((id, self.run(r)));
            }
            id += 1;
        }
        None
    }

    /// Writes run `r` whole (one seqlock write).
    #[inline(always)]
    fn put_run(&self, r: u32, run: Run) {
        self.run_slot(r).store(run);
    }

    /// The id of the block with `hash`, if indexed. The table holds live ids only, so a tag
    /// match is confirmed by the hash alone.
    #[inline]
    fn find(&self, hash: u64) -> Option<u32> {
        self.table
            .find_or_vacancy(hash, |id| self.id(id).hash())
            .ok()
    }

    /// Whether `id` is a live block with `hash` (the stretch test: no probe). A freed id's
    /// hash is 0, so only a hash of 0 needs the run check.
    #[inline]
    fn is_block(&self, id: u32, hash: u64) -> bool {
        id < self.ids_len && {
            let slot = self.id(id);
            slot.hash() == hash && (hash != 0 || slot.run() != cells::NONE)
        }
    }

    /// The block `hash` where it follows block `parent` on its chain without a probe: at the
    /// next id or where the parent's hint says. What stores try before the table.
    #[inline(always)]
    fn next_on_chain(&self, parent: u32, hash: u64) -> Option<u32> {
        if self.is_block(parent + 1, hash) {
            return Some(parent + 1);
        }
        let next = self.id(parent).next();
        (next != cells::NONE && self.is_block(next, hash)).then_some(next)
    }

    /// Records that block `child` (already in its run) continues block `parent`'s chain, where
    /// it is not the next id: the parent's hint names it, and when the parent ends its run,
    /// that run's slot names `child` and its run (a walk entering the run prefetches them).
    #[inline]
    fn link(&self, parent: u32, child: u32) {
        if child == parent + 1 {
            return;
        }
        self.id(parent).set_next(child);
        let cell = self.run_slot(self.id(parent).run());
        if cell.end() == parent + 1 {
            cell.set_after(self.id(child).run(), child);
        }
    }

    /// Rebuilds the table before a batch of up to `more` new blocks could fill it past
    /// [`TABLE_FULL_PERCENT`], or when it churns over [`TABLE_CHURN_PERCENT`] full, or is
    /// under [`TABLE_EMPTY_PERCENT`] full; the new table is published to readers (those on the
    /// old one finish on it).
    fn reserve(&mut self, more: usize) {
        let filled = (self.table_live + more) * 100;
        let capacity = self.table.capacity();
        let churned = self.table_deleted >= self.table_live.max(1024)
            && filled > capacity * TABLE_CHURN_PERCENT;
        if filled <= capacity * TABLE_FULL_PERCENT
            && !churned
            && (filled >= capacity * TABLE_EMPTY_PERCENT || capacity <= 1024)
        {
            return;
        }
        // A churning table keeps its size: half full leaves room for its ups and downs.
        let percent = 250;
        let capacity = ((self.table_live + more) * percent / 100).max(1024);
        let fresh = Arc::new(Table::with_capacity(capacity, self.table.seed()));
        self.table_live = self.table.copy_into(&fresh);
        self.table_deleted = 0;
        self.reader.shared.table.store(fresh.clone());
        self.table = fresh;
    }
}

#[cfg(test)]
mod tests;
