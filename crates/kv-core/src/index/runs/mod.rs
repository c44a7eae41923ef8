//! The run index (index v3, under construction): block hashes to the members that hold them,
//! with holders kept per **run** instead of per block.
//!
//! Shape:
//! - every block in the index has an id, whose slot holds its hash and its run (side by side:
//!   a jump to an id reads one cache line); the table (shared with the v2 index: key-less
//!   tagged slots) maps hash -> id. New blocks of a stored run take consecutive ids where free
//!   ids allow, so a chain is a stretch of ids;
//! - a **run** is a stretch of ids `start .. end` whose blocks all have one holder set. Runs
//!   split where a store, a removal or a block leaving cuts them, and merge with a neighbour of
//!   equal holders again, always relabelling the smaller side;
//! - holders are bitmaps ([`holders`]): inline up to one 64-member window, pooled words beyond.
//!
//! Costs: a block entering the index pays one table insert; a store that joins blocks others
//! hold, or a removal that leaves other holders, pays per run it touches (stretches are found by
//! comparing `hashes[id + 1]` with the event's next hash, without probing), plus the relabels of
//! split-off parts; only a block leaving the index pays a table delete. A query compares the
//! prompt's next hash with `hashes[id + 1]` (sequential memory) and probes only where the chain
//! leaves the stretch; it intersects holder sets only where the run changes.
//!
//! Exactness does not depend on the structure being a chain: a block is named by its hash at
//! every step of a query, so a publisher whose "chain" is not one (a forged run) can only put
//! its own blocks in odd places; other members' holdings are never read through its runs.
//!
//! Invariants: an id's run is `NONE` iff the id is free, and then its hash is 0; the table
//! holds live ids only; a live run's ids all map to it; two
//! adjacent runs never have equal holder sets after an operation (merged); a run's holder set is
//! never empty.
//!
//! Not yet here (the v2 [`super::ModelIndex`] has them): tiers, lock-free readers, writer
//! lanes, CLOCK eviction under `size`, `podCacheSize`, export. This is the single-threaded core
//! measured against SMG in `benches/peers` before the rest is built on it.

mod holders;
mod slots;
mod surgery;

use super::table::Table;
use crate::BlockHash;
pub use holders::{Holders, WordPool};
use slots::{IdSlots, NONE};

/// How far ahead of the block in hand a write prefetches table slots: enough to cover a
/// miss's latency, few enough that a stretch found without probing wastes little.
const PREFETCH_AHEAD: usize = 12;

/// One run: ids `start .. end` held by `holders`.
#[derive(Clone, Copy, Debug)]
struct Run {
    start: u32,
    end: u32,
    holders: Holders,
}

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
}

/// The single-threaded run index (see the module docs).
pub struct RunIndex {
    table: Table,
    /// Table slots in use (live entries and tombstones) and live entries.
    table_used: usize,
    table_live: usize,
    /// Per block id: its hash and its run, side by side (a jump to an id costs one line).
    ids: IdSlots,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// Freed ids as ranges `start .. end`, newest last; an id taken by `prev + 1` stays in its
    /// range until it is reached (checked when taken). Allocation takes a range from its start,
    /// so a new run gets ascending ids, whichever order its ids were freed in.
    free_ranges: Vec<(u32, u32)>,
    pool: WordPool,
    /// Per member: id ranges it was given (stale entries allowed), so a clear walks its runs.
    ranges: Vec<Vec<(u32, u32)>>,
    /// Per member: `ranges` length after its last compaction.
    compacted: Vec<usize>,
    /// Per member: the first id of its last removal ([`RunIndex::near_cursor`]).
    cursors: Vec<u32>,
    stats: RunStats,
}

impl RunIndex {
    /// An empty index; `seed` mixes block hashes into table positions.
    pub fn new(seed: u64) -> Self {
        Self {
            table: Table::with_capacity(1024, seed),
            table_used: 0,
            table_live: 0,
            ids: IdSlots::default(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            free_ranges: Vec::new(),
            pool: WordPool::default(),
            ranges: Vec::new(),
            compacted: Vec::new(),
            cursors: Vec::new(),
            stats: RunStats::default(),
        }
    }

    /// Counters (splits, merges, relabels) and shape (blocks, runs).
    pub fn stats(&self) -> RunStats {
        RunStats {
            holder_words: self.pool.live_words() as u64,
            ..self.stats
        }
    }

    /// Bytes held: ids (hash and run), table, runs, pooled holder words, member ranges.
    pub fn allocated_bytes(&self) -> usize {
        self.ids.allocated_bytes()
            + self.table.allocated_bytes()
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.free_runs.capacity() * 4
            + self.free_ranges.capacity() * 8
            + self.pool.allocated_bytes()
            + self.ranges.iter().map(|r| r.capacity() * 8).sum::<usize>()
    }

    /// The id of the block with `hash`, if indexed. The table holds live ids only, so a tag
    /// match is confirmed by the hash alone.
    #[inline]
    fn find(&self, hash: u64) -> Option<u32> {
        let ids = &self.ids;
        self.table.find(hash, |id| ids[id].hash)
    }

    /// Whether `id` is a live block with `hash` (the stretch test: no probe). A freed id's
    /// hash is 0, so only a hash of 0 needs the run check.
    #[inline]
    fn is_block(&self, id: u32, hash: u64) -> bool {
        self.ids
            .get(id)
            .is_some_and(|slot| slot.hash == hash && (hash != 0 || slot.run != NONE))
    }

    /// The block `hash`, which follows block `parent` on its chain: at the next id, where the
    /// parent's hint says, or else through the table. What stores and the walk both use.
    #[inline]
    fn child(&self, parent: u32, hash: u64) -> Option<u32> {
        if self.is_block(parent + 1, hash) {
            return Some(parent + 1);
        }
        self.by_hint(parent, hash).or_else(|| self.find(hash))
    }

    /// The chain child `hash` of block `parent`, if its hint names it.
    #[inline]
    fn by_hint(&self, parent: u32, hash: u64) -> Option<u32> {
        let next = self.ids[parent].next;
        (next != NONE && self.is_block(next, hash)).then_some(next)
    }

    /// Records that block `child` continues block `parent`'s chain (a hint, where it is not
    /// the next id).
    #[inline]
    fn link(&mut self, parent: u32, child: u32) {
        if child != parent + 1 {
            self.ids[parent].next = child;
        }
    }

    /// The members holding `hash`.
    pub fn holders(&self, hash: BlockHash) -> Vec<u32> {
        let Some(id) = self.find(hash.get()) else {
            return Vec::new();
        };
        let set = self.runs[self.ids[id].run as usize].holders;
        let mut out = Vec::new();
        for (w, mut bits) in set.windows(&self.pool) {
            while bits != 0 {
                out.push(w * 64 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        out
    }

    /// Grows the table before a batch of up to `more` new blocks could fill it past 85%.
    fn reserve(&mut self, more: usize) {
        if (self.table_used + more) * 20 <= self.table.capacity() * 17 {
            return;
        }
        let capacity = ((self.table_live + more) * 5 / 2).max(1024);
        let fresh = Table::with_capacity(capacity, self.table.seed());
        self.table_live = self.table.copy_into(&fresh);
        self.table_used = self.table_live;
        self.table = fresh;
    }

    /// Prefetches the table slots of the hashes up to [`PREFETCH_AHEAD`] past `i` (from where
    /// the last call stopped, or from `i` after a stretch skipped ahead).
    #[inline]
    fn prefetch_ahead(&self, hashes: &[BlockHash], i: usize, prefetched: &mut usize) {
        let until = (i + PREFETCH_AHEAD).min(hashes.len());
        *prefetched = (*prefetched).max(i);
        while *prefetched < until {
            self.table.prefetch(hashes[*prefetched].get());
            *prefetched += 1;
        }
    }

    /// `member` stores `hashes` after `parent` (a `BlockStored`).
    pub fn store(&mut self, member: u32, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        self.reserve(hashes.len());
        let mut prefetched = 0;
        let mut prev = parent.and_then(|p| self.find(p.get()));
        let mut i = 0;
        while i < hashes.len() {
            self.prefetch_ahead(hashes, i, &mut prefetched);
            let h = hashes[i].get();
            let found = match prev {
                Some(p) => self.child(p, h),
                None => self.find(h),
            };
            if let (Some(p), Some(id)) = (prev, found) {
                self.link(p, id);
            }
            let Some(id) = found else {
                let id = self.add_block(member, prev, h);
                prev = Some(id);
                i += 1;
                continue;
            };
            let run = self.runs[self.ids[id].run as usize];
            let mut k = 1;
            while i + k < hashes.len()
                && id + (k as u32) < run.end
                && self.ids[id + k as u32].hash == hashes[i + k].get()
            {
                k += 1;
            }
            let end = id + k as u32;
            if !run.holders.contains(member, &self.pool) {
                let joined = self.pool.with(&run.holders, member, true);
                self.recolor(id, end, joined, Cause::Join);
                self.note_range(member, id, end);
            }
            prev = Some(end - 1);
            i += k;
        }
    }

    /// A new block `hash` held by `member` alone, at `prev + 1` when that id is free.
    fn add_block(&mut self, member: u32, prev: Option<u32>, hash: u64) -> u32 {
        let id = self.alloc_id(prev);
        self.ids[id].hash = hash;
        self.ids[id].next = NONE;
        if let Some(p) = prev {
            self.link(p, id);
        }
        // `insert` reports whether it reused a tombstone (a slot already counted as used).
        if !self.table.insert(hash, id) {
            self.table_used += 1;
        }
        self.table_live += 1;
        self.stats.blocks += 1;
        let alone = Holders::one(member);
        let left = id.checked_sub(1).map(|l| self.ids[l].run);
        let r = match left {
            Some(l) if l != NONE && self.pool.same(&self.runs[l as usize].holders, &alone) => {
                self.runs[l as usize].end = id + 1;
                l
            }
            _ => self.new_run(id, id + 1, alone),
        };
        self.ids[id].run = r;
        self.merge_right(r);
        self.note_range(member, id, id + 1);
        id
    }

    fn alloc_id(&mut self, prev: Option<u32>) -> u32 {
        if let Some(p) = prev {
            let next = p + 1;
            if next == self.ids.len() {
                return self.ids.push();
            }
            if next < self.ids.len() && self.ids[next].run == NONE {
                return next;
            }
        }
        while let Some(range) = self.free_ranges.last_mut() {
            let id = range.0;
            range.0 += 1;
            if range.0 == range.1 {
                self.free_ranges.pop();
            }
            if self.ids[id].run == NONE {
                return id;
            }
        }
        self.ids.push()
    }

    /// Records `id` as free, extending the newest range when adjacent (ascending or descending
    /// frees of a stretch make one range).
    fn free_id(&mut self, id: u32) {
        match self.free_ranges.last_mut() {
            Some(range) if range.1 == id => range.1 += 1,
            Some(range) if range.0 == id + 1 => range.0 = id,
            _ => self.free_ranges.push((id, id + 1)),
        }
    }

    /// Records that `member` was given ids `start .. end` (extending its last range when
    /// adjacent), compacting its list when stale entries have doubled it.
    fn note_range(&mut self, member: u32, start: u32, end: u32) {
        let m = member as usize;
        if self.ranges.len() <= m {
            self.ranges.resize_with(m + 1, Vec::new);
            self.compacted.resize(m + 1, 0);
            self.cursors.resize(m + 1, NONE);
        }
        let list = &mut self.ranges[m];
        match list.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => list.push((start, end)),
        }
        if list.len() > 2 * self.compacted[m] + 64 {
            self.compact(member);
        }
    }

    /// Rewrites `member`'s ranges to exactly the runs it holds now, merged.
    fn compact(&mut self, member: u32) {
        let m = member as usize;
        let mut old = std::mem::take(&mut self.ranges[m]);
        old.sort_unstable();
        let mut fresh: Vec<(u32, u32)> = Vec::new();
        let mut covered = 0;
        for &(start, end) in &old {
            let mut id = start.max(covered);
            while id < end {
                let r = self.ids[id].run;
                if r == NONE {
                    id += 1;
                    continue;
                }
                let run = self.runs[r as usize];
                if run.holders.contains(member, &self.pool) {
                    match fresh.last_mut() {
                        Some(last) if last.1 >= run.start => last.1 = last.1.max(run.end),
                        _ => fresh.push((run.start, run.end)),
                    }
                }
                id = run.end;
            }
            covered = covered.max(end);
        }
        self.compacted[m] = fresh.len();
        self.ranges[m] = fresh;
    }

    /// `member` no longer holds `hashes` (a `BlockRemoved`); hashes it does not hold are
    /// ignored. Consecutive hashes on a stretch (either direction) are taken as one range.
    pub fn remove(&mut self, member: u32, hashes: &[BlockHash]) {
        let mut prefetched = 0;
        let mut i = 0;
        while i < hashes.len() {
            let h = hashes[i].get();
            // The cursor serves vLLM's one-hash events; a batch finds its stretches itself.
            let near = (hashes.len() == 1).then(|| self.near_cursor(member, h));
            let Some(id) = near.flatten().or_else(|| {
                self.prefetch_ahead(hashes, i, &mut prefetched);
                self.find(h)
            }) else {
                i += 1;
                continue;
            };
            let run = self.runs[self.ids[id].run as usize];
            let mut k = 1;
            let (mut a, mut b) = (id, id + 1);
            while i + k < hashes.len() {
                let h = hashes[i + k].get();
                if b < run.end && self.ids[b].hash == h {
                    b += 1;
                } else if a > run.start && self.ids[a - 1].hash == h {
                    a -= 1;
                } else {
                    break;
                }
                k += 1;
            }
            self.take_off(member, a, b);
            i += k;
        }
    }

    /// The block `hash` if it sits next to `member`'s last removal (vLLM frees a request's
    /// blocks one event each, tail first: the next one is usually the id before).
    #[inline]
    fn near_cursor(&self, member: u32, hash: u64) -> Option<u32> {
        let c = *self.cursors.get(member as usize)?;
        if c == NONE {
            return None;
        }
        [c.wrapping_sub(1), c + 1]
            .into_iter()
            .find(|&id| id != NONE && self.is_block(id, hash))
    }

    /// Takes `member` off ids `a .. b` (inside one run), if it holds them.
    fn take_off(&mut self, member: u32, a: u32, b: u32) {
        if let Some(c) = self.cursors.get_mut(member as usize) {
            *c = a;
        }
        let holders = self.runs[self.ids[a].run as usize].holders;
        if !holders.contains(member, &self.pool) {
            return;
        }
        let left = self.pool.with(&holders, member, false);
        if left.is_empty() {
            // Each block leaving costs its table slot, at random: fetch them ahead.
            for id in a..b.min(a + PREFETCH_AHEAD as u32) {
                self.table.prefetch(self.ids[id].hash);
            }
            for id in a..b {
                if let Some(ahead) = id.checked_add(PREFETCH_AHEAD as u32).filter(|&i| i < b) {
                    self.table.prefetch(self.ids[ahead].hash);
                }
                let hash = self.ids[id].hash;
                if let Some(emptied) = self.table.remove(hash, id) {
                    self.table_used -= emptied;
                    self.table_live -= 1;
                }
                self.ids[id].hash = 0;
                self.free_id(id);
            }
            self.stats.blocks -= (b - a) as u64;
            self.recolor(a, b, left, Cause::Leave);
        } else {
            self.recolor(a, b, left, Cause::Hole);
        }
    }

    /// Drops every holding of `member` (its engine cleared or gone).
    pub fn clear_member(&mut self, member: u32) {
        let Some(list) = self.ranges.get_mut(member as usize).map(std::mem::take) else {
            return;
        };
        for (start, end) in list {
            let mut id = start;
            while id < end {
                let r = self.ids[id].run;
                if r == NONE {
                    id += 1;
                    continue;
                }
                let stop = self.runs[r as usize].end.min(end);
                self.take_off(member, id, stop);
                id = stop;
            }
        }
        self.compacted[member as usize] = 0;
    }

    /// Every holder's matched prefix of `prompt`: `emit(member, blocks)` once per member that
    /// holds the first block. `alive` is the caller's scratch (reused across calls).
    pub fn score(
        &self,
        prompt: &[BlockHash],
        alive: &mut Vec<(u32, u64)>,
        mut emit: impl FnMut(u32, u32),
    ) {
        alive.clear();
        let Some(first) = prompt.first() else {
            return;
        };
        let Some(mut id) = self.find(first.get()) else {
            return;
        };
        let mut r = self.ids[id].run;
        let mut end = self.runs[r as usize].end;
        alive.extend(self.runs[r as usize].holders.windows(&self.pool));
        let mut j = 1;
        while j < prompt.len() {
            // Inside the run (one holder set): the next ids hold the next blocks for as long
            // as their hashes agree; one pass over the slots, no run or table read.
            let slots = self.ids.stretch(id + 1, end);
            let same = slots
                .iter()
                .zip(&prompt[j..])
                .take_while(|(slot, h)| slot.hash == h.get())
                .count();
            id += same as u32;
            j += same;
            if j == prompt.len() {
                break;
            }
            if same == slots.len() && id + 1 < end {
                continue; // the slots' chunk ended, the run did not
            }
            let Some(next) = self.child(id, prompt[j].get()) else {
                return emit_all(alive, j as u32, &mut emit);
            };
            id = next;
            let q = self.ids[id].run;
            let run = &self.runs[q as usize];
            end = run.end;
            if q != r {
                r = q;
                let holders = &run.holders;
                alive.retain_mut(|(w, bits)| {
                    let kept = *bits & holders.bits_of(*w, &self.pool);
                    emit_bits(*w, *bits & !kept, j as u32, &mut emit);
                    *bits = kept;
                    kept != 0
                });
                if alive.is_empty() {
                    return;
                }
            }
            j += 1;
        }
        emit_all(alive, prompt.len() as u32, &mut emit);
    }
}

fn emit_all(alive: &[(u32, u64)], depth: u32, emit: &mut impl FnMut(u32, u32)) {
    for &(w, bits) in alive {
        emit_bits(w, bits, depth, emit);
    }
}

#[inline]
fn emit_bits(window: u32, mut bits: u64, depth: u32, emit: &mut impl FnMut(u32, u32)) {
    while bits != 0 {
        emit(window * 64 + bits.trailing_zeros(), depth);
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests;
