//! The run index's write path: stores, removals and clears (one writer, `&mut`).

use super::cells::NONE;
use super::free::SLACK;
use super::{Cause, RunHolders, RunIndex, PREFETCH_AHEAD};
use crate::index::table::Vacancy;
use crate::index::types::{EngineId, Tier};
use crate::index::StoreOutcome;
use crate::BlockHash;

/// Where a new block goes ([`RunIndex::add_block`]).
struct Placement {
    /// The block before it on its chain: its id goes at `prev + 1` when that id is free.
    prev: Option<u32>,
    /// Blocks still to store (a new stretch takes a free range that fits them).
    want: u32,
    /// Its table slot, from the lookup that found it absent (no table write since).
    vacancy: Vacancy,
    /// The run the store's previous new block went into: held by the engine alone in the
    /// tier, so the block joins it without comparing holder sets.
    lone: Option<u32>,
}

impl RunIndex {
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

    /// [`RunIndex::prefetch_ahead`] for `hashes`, a tail of the store's hashes that starts at
    /// the store's index `base`, at the store's index `i`.
    #[inline]
    fn prefetch_ahead_at(
        &self,
        hashes: &[BlockHash],
        base: usize,
        i: usize,
        prefetched: &mut usize,
    ) {
        let mut local = prefetched.saturating_sub(base);
        self.prefetch_ahead(hashes, i - base, &mut local);
        *prefetched = base + local;
    }

    /// `engine` stores `hashes` after `parent` in `tier` (a `BlockStored`), telling
    /// `held(hash, added)` for every block the engine holds afterwards: `added` when the
    /// membership is new, not when the engine already held the block in that tier. (The one
    /// store of the structure; [`crate::IndexWriter`] is the surface callers use.)
    pub fn store_each(
        &mut self,
        engine: EngineId,
        tier: Tier,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        mut held: impl FnMut(BlockHash, bool),
    ) -> StoreOutcome {
        self.reserve(hashes.len());
        let mut outcome = StoreOutcome::default();
        let mut prefetched = 0;
        let mut prev = parent.and_then(|p| self.find(p.get()));
        // The run the last new block went into (held by `engine` in `tier` alone) while no
        // block already indexed came since: the next new block joins it without comparing.
        let mut lone = None;
        if parent.is_some() {
            outcome.orphan = !prev.is_some_and(|p| {
                let holders = self.run_slot(self.id(p).run()).holders();
                holders.nibble(engine, &self.reader.shared.words) != 0
            });
        }
        let mut i = 0;
        while i < hashes.len() {
            let h = hashes[i].get();
            // Only a block the chain's ids do not reach is probed for, and only then are the
            // next ones prefetched: inside a stretch they would be fetched for nothing.
            let found = match prev.and_then(|p| self.next_on_chain(p, h)) {
                Some(id) => Ok(id),
                None => {
                    self.prefetch_ahead(hashes, i, &mut prefetched);
                    self.table.find_or_vacancy(h, |id| self.id(id).hash())
                }
            };
            if let (Some(p), Ok(id)) = (prev, found) {
                self.link(p, id);
            }
            let id = match found {
                Ok(id) => id,
                Err(vacancy) => {
                    let at = Placement {
                        prev,
                        want: (hashes.len() - i) as u32,
                        vacancy,
                        lone,
                    };
                    let added =
                        self.add_stretch(engine, tier as u32, &hashes[i..], at, &mut prefetched, i);
                    match added {
                        Some((last, n)) => {
                            for &h in &hashes[i..i + n] {
                                held(h, true);
                            }
                            outcome.added += n;
                            prev = Some(last);
                            lone = Some(self.id(last).run());
                            i += n;
                        }
                        None => {
                            prev = None;
                            lone = None;
                            i += 1;
                        }
                    }
                    continue;
                }
            };
            lone = None;
            let (k, added) = self.join_indexed(engine, tier, id, &hashes[i..]);
            if added {
                outcome.added += k;
            }
            for &h in &hashes[i..i + k] {
                held(h, added);
            }
            prev = Some(id + k as u32 - 1);
            i += k;
        }
        outcome
    }

    /// `engine` stores blocks already indexed, `hashes[0]` at `id`: the stretch of the id's
    /// run whose next ids hold the next hashes (one pass over the slots, to the run's end or
    /// the chunk's) joins `engine` in `tier` unless it held them there. Returns the stretch's
    /// length (at least 1) and whether the memberships are new.
    #[inline]
    fn join_indexed(
        &mut self,
        engine: EngineId,
        tier: Tier,
        id: u32,
        hashes: &[BlockHash],
    ) -> (usize, bool) {
        let bit = 1u64 << tier as u32;
        let run_of_id = self.id(id).run();
        let run = self.run_slot(run_of_id);
        let slots = self.id_chunks.hash_tail(id + 1);
        let room = ((run.end() - id - 1) as usize).min(slots.len());
        let k = 1 + slots[..room]
            .iter()
            .zip(&hashes[1..])
            .take_while(|(slot, h)| slot.hash() == h.get())
            .count();
        let end = id + k as u32;
        let holders = run.holders();
        let mut added = false;
        if holders.nibble(engine, &self.reader.shared.words) & bit == 0 {
            let words = &self.reader.shared.words;
            let joined = match self.pool.with_tiers(&holders, engine, bit, true, words) {
                Some(set) => self.within_bound(run_of_id, set, engine * 4 + tier as u32, k),
                None => {
                    self.stats.pool_exhausted += 1;
                    None
                }
            };
            if let Some(joined) = joined {
                self.recolor(id, end, joined, Cause::Join);
                self.note_range(engine, id, end);
                added = true;
            }
        }
        self.set_referenced(self.id(id).run());
        (k, added)
    }

    /// New blocks `hashes[0..n]` held by `engine` alone in `tier`, on consecutive ids from
    /// the one `at` places the first on, for as long as the next hash is absent from the table
    /// and the next id is free: each block pays its slot and its table entry, the stretch pays
    /// its run, its range and its merge once. Returns the last block's id and `n` (at least 1),
    /// or `None` when every id is in use (counted). `base` is `hashes[0]`'s index in the
    /// store (for the prefetch cursor `prefetched`).
    fn add_stretch(
        &mut self,
        engine: EngineId,
        tier: u32,
        hashes: &[BlockHash],
        at: Placement,
        prefetched: &mut usize,
        base: usize,
    ) -> Option<(u32, usize)> {
        let Placement {
            prev,
            want,
            vacancy,
            lone,
        } = at;
        let Some(first) = self.alloc_id(prev, want) else {
            self.stats.dropped_full += 1;
            return None;
        };
        self.put_new_block(first, hashes[0].get(), vacancy);
        let mut end = first + 1;
        while let Some(&h) = hashes.get((end - first) as usize) {
            let i = base + (end - first) as usize;
            self.prefetch_ahead_at(hashes, base, i, prefetched);
            // Stops at a hash the index holds, or where the ids stop being free (the table
            // keeps no write from this probe, so the caller probes that block again).
            let Err(vacancy) = self.table.find_or_vacancy(h.get(), |id| self.id(id).hash()) else {
                break;
            };
            if self.next_free(end - 1).is_none() {
                break;
            }
            self.put_new_block(end, h.get(), vacancy);
            end += 1;
        }
        let r = self.cover_new(engine, tier, first, end, lone)?;
        let r = self.merge_right(r);
        self.set_referenced(r);
        self.note_range(engine, first, end);
        if let Some(p) = prev {
            self.link(p, first);
        }
        Some((end - 1, (end - first) as usize))
    }

    /// Writes a new block's slot (the hash first: a reader trusts it once the id is inside a
    /// run) and its table entry at `vacancy`.
    #[inline(always)]
    fn put_new_block(&mut self, id: u32, hash: u64, vacancy: Vacancy) {
        self.id(id).set_hash(hash);
        self.id(id).set_next(NONE);
        self.table.insert_at(vacancy, id);
        self.table_live += 1;
        self.stats.blocks += 1;
    }

    /// Puts new blocks `first .. end` (slots and table entries written) into a run held by
    /// `engine` alone in `tier`: the run before `first` grows over them when it has that holder
    /// set (`lone`: known to), else a new run; then each id points at it. `None` (the blocks
    /// taken back) when no run number is left (unreachable while runs never outnumber ids).
    fn cover_new(
        &mut self,
        engine: EngineId,
        tier: u32,
        first: u32,
        end: u32,
        lone: Option<u32>,
    ) -> Option<u32> {
        let alone = RunHolders::one(engine, tier);
        let left = first.checked_sub(1).map(|l| self.id(l).run());
        let joins_left = left.filter(|&l| {
            l != NONE
                && (lone == Some(l)
                    || self.pool.same_run(
                        &self.run_slot(l).holders(),
                        &alone,
                        &self.reader.shared.words,
                    ))
        });
        let r = match joins_left {
            Some(l) => {
                // The receiving run grows first, then the ids point at it.
                self.run_slot(l).set_end(end);
                l
            }
            None => match self.new_run(first, end, alone) {
                Some(r) => {
                    if let Some(order) = &mut self.order {
                        order.set_one(r, engine * 4 + tier);
                    }
                    r
                }
                None => {
                    for id in first..end {
                        self.drop_new_block(id, self.id(id).hash());
                    }
                    return None;
                }
            },
        };
        let mut id = first;
        while id < end {
            let slots = self.id_chunks.link_tail(id);
            let n = ((end - id) as usize).min(slots.len());
            for slot in &slots[..n] {
                slot.set_run(r);
            }
            id += n as u32;
        }
        Some(r)
    }

    /// `joined` (run `r`'s holders with member `m` added, owned) kept within `podCacheSize`
    /// for a join of `blocks` blocks: the oldest member leaves the set and is counted as
    /// displaced, and the order the part gets is staged for `recolor`. `None` (the set
    /// released) when the pool has no room for the smaller set: the join does not happen.
    fn within_bound(
        &mut self,
        r: u32,
        joined: RunHolders,
        m: u32,
        blocks: usize,
    ) -> Option<RunHolders> {
        let Some(victim) = self.order.as_mut().and_then(|o| o.stage_join(r, m)) else {
            return Some(joined);
        };
        let words = &self.reader.shared.words;
        let smaller = self
            .pool
            .with_tiers(&joined, victim / 4, 1 << (victim % 4), false, words);
        self.pool.release_run(joined);
        match smaller {
            Some(set) => {
                self.displaced.push((victim / 4, blocks as u64));
                self.stats.pod_cache_evictions += blocks as u64;
                Some(set)
            }
            None => {
                self.stats.pool_exhausted += 1;
                None
            }
        }
    }

    /// Takes back a block that got an id and a table entry but no run.
    fn drop_new_block(&mut self, id: u32, hash: u64) {
        if self.table.remove(hash, id) {
            self.table_live -= 1;
            self.table_deleted += 1;
        }
        self.id(id).set_hash(0);
        self.free.free(id);
        self.stats.blocks -= 1;
        self.stats.dropped_full += 1;
    }

    /// A free id for a block after `prev`: `prev + 1` when free, else the first id of a new
    /// stretch of up to `want` blocks ([`free`](super::free)'s order), else a fresh id; `None`
    /// at capacity.
    fn alloc_id(&mut self, prev: Option<u32>, want: u32) -> Option<u32> {
        if let Some(id) = prev.and_then(|p| self.next_free(p)) {
            return Some(id);
        }
        let live = self.stats.blocks;
        let spare = u64::from(self.ids_len).saturating_sub(live);
        let fresh_ok = self.ids_len < self.capacity && spare * SLACK <= live;
        let chunks = &self.id_chunks;
        let is_free = |id| chunks.get(id).run() == NONE;
        match self.free.take(want, fresh_ok, is_free) {
            Some(id) => Some(id),
            None => self.push_id(),
        }
    }

    /// Takes id `p + 1` when it is free (a fresh id when `p` is the last handed out).
    #[inline]
    fn next_free(&mut self, p: u32) -> Option<u32> {
        let next = p + 1;
        if next == self.ids_len {
            self.push_id()
        } else if next < self.ids_len && self.id(next).run() == NONE {
            self.free.taken(next);
            Some(next)
        } else {
            None
        }
    }

    /// A fresh id (`ids_len`), its chunk allocated; `None` at capacity.
    fn push_id(&mut self) -> Option<u32> {
        if self.ids_len >= self.capacity {
            return None;
        }
        let id = self.ids_len;
        self.id_chunks.reach(id, &self.reader.shared.ids)?;
        self.ids_len += 1;
        Some(id)
    }

    /// Records that `engine` was given ids `start .. end` (extending its last range when
    /// adjacent), compacting its list when stale entries have doubled it.
    fn note_range(&mut self, engine: EngineId, start: u32, end: u32) {
        let e = engine as usize;
        if self.ranges.len() <= e {
            self.ranges.resize_with(e + 1, Vec::new);
            self.compacted.resize(e + 1, 0);
            self.cursors.resize(e + 1, NONE);
        }
        let list = &mut self.ranges[e];
        match list.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => list.push((start, end)),
        }
        if list.len() > 2 * self.compacted[e] + 64 {
            self.compact(engine);
        }
    }

    /// Rewrites `engine`'s ranges to exactly the runs it holds now (any tier), merged.
    pub(super) fn compact(&mut self, engine: EngineId) {
        let e = engine as usize;
        let mut old = std::mem::take(&mut self.ranges[e]);
        old.sort_unstable();
        let mut fresh: Vec<(u32, u32)> = Vec::new();
        let mut covered = 0;
        for &(start, end) in &old {
            let mut id = start.max(covered);
            while let Some((_, run)) = self.next_run(id, end) {
                if run.holders.nibble(engine, &self.reader.shared.words) != 0 {
                    match fresh.last_mut() {
                        Some(last) if last.1 >= run.start => last.1 = last.1.max(run.end),
                        _ => fresh.push((run.start, run.end)),
                    }
                }
                id = run.end;
            }
            covered = covered.max(end);
        }
        self.compacted[e] = fresh.len();
        self.ranges[e] = fresh;
    }

    /// `engine` no longer holds `hashes` in `tier` (a `BlockRemoved`); hashes it does not
    /// hold are ignored. Consecutive hashes on a stretch (either direction) are taken as one
    /// range. Returns the memberships removed.
    pub fn remove(&mut self, engine: EngineId, tier: Tier, hashes: &[BlockHash]) -> usize {
        let bit = 1u64 << tier as u32;
        let mut removed = 0;
        let mut prefetched = 0;
        let mut i = 0;
        while i < hashes.len() {
            let h = hashes[i].get();
            // The cursor serves vLLM's one-hash events; a batch finds its stretches itself.
            let near = (hashes.len() == 1).then(|| self.near_cursor(engine, h));
            let Some(id) = near.flatten().or_else(|| {
                self.prefetch_ahead(hashes, i, &mut prefetched);
                self.find(h)
            }) else {
                i += 1;
                continue;
            };
            let run = self.run(self.id(id).run());
            let mut k = 1;
            let (mut a, mut b) = (id, id + 1);
            while i + k < hashes.len() {
                let h = hashes[i + k].get();
                if b < run.end && self.id(b).hash() == h {
                    b += 1;
                } else if a > run.start && self.id(a - 1).hash() == h {
                    a -= 1;
                } else {
                    break;
                }
                k += 1;
            }
            removed += self.take_off(engine, bit, a, b);
            i += k;
        }
        removed
    }

    /// The block `hash` if it sits next to `engine`'s last removal (vLLM frees a request's
    /// blocks one event each, tail first: the next one is usually the id before).
    #[inline]
    fn near_cursor(&self, engine: EngineId, hash: u64) -> Option<u32> {
        let c = *self.cursors.get(engine as usize)?;
        if c == NONE {
            return None;
        }
        [c.wrapping_sub(1), c + 1]
            .into_iter()
            .find(|&id| id != NONE && self.is_block(id, hash))
    }

    /// Takes `engine`'s tiers `tiers` (bit `t`: tier `t`) off ids `a .. b` (inside one run).
    /// Returns the memberships removed.
    fn take_off(&mut self, engine: EngineId, tiers: u64, a: u32, b: u32) -> usize {
        if let Some(c) = self.cursors.get_mut(engine as usize) {
            *c = a;
        }
        let holders = self.run_slot(self.id(a).run()).holders();
        let held = holders.nibble(engine, &self.reader.shared.words) & tiers;
        if held == 0 {
            return 0;
        }
        let words = &self.reader.shared.words;
        let left = self
            .pool
            .with_tiers(&holders, engine, held, false, words)
            .unwrap_or_else(|| {
                // No room for the smaller set: the blocks leave for everyone (an underestimate).
                self.stats.pool_exhausted += 1;
                RunHolders::default()
            });
        if left.is_empty() {
            self.leave(a, b);
        } else {
            let r = self.id(a).run();
            if let Some(order) = &mut self.order {
                order.stage_without(r, |m| m / 4 == engine && held >> (m % 4) & 1 != 0);
            }
            self.recolor(a, b, left, Cause::Hole);
        }
        held.count_ones() as usize * (b - a) as usize
    }

    /// Blocks `a .. b` (inside one run) leave the index, with every membership: table
    /// entries deleted, hashes zeroed, ids freed, the run cut.
    pub(super) fn leave(&mut self, a: u32, b: u32) {
        let mut id = a;
        while id < b {
            let slots = self.id_chunks.hash_tail(id);
            let slots = &slots[..((b - id) as usize).min(slots.len())];
            if slots.is_empty() {
                break; // past the allocated ids (never: every id has its chunk)
            }
            // Each block leaving costs its table slot, at random: fetch them ahead.
            for slot in slots.iter().take(PREFETCH_AHEAD) {
                self.table.prefetch(slot.hash());
            }
            for (k, slot) in slots.iter().enumerate() {
                if let Some(ahead) = slots.get(k + PREFETCH_AHEAD) {
                    self.table.prefetch(ahead.hash());
                }
                let hash = slot.hash();
                if self.table.remove(hash, id) {
                    self.table_live -= 1;
                    self.table_deleted += 1;
                }
                // Zeroed before the id leaves its run: a reader in the run sees no block.
                slot.set_hash(0);
                self.free.free(id);
                id += 1;
            }
        }
        self.stats.blocks -= (b - a) as u64;
        self.recolor(a, b, RunHolders::default(), Cause::Leave);
    }

    /// Drops every holding of `engine`, in every tier (its engine cleared or gone). Returns
    /// the memberships removed.
    pub fn clear_engine(&mut self, engine: EngineId) -> usize {
        let Some(list) = self.ranges.get_mut(engine as usize).map(std::mem::take) else {
            return 0;
        };
        let bits = 0xF;
        let mut removed = 0;
        for (start, end) in list {
            let mut id = start;
            while let Some((at, run)) = self.next_run(id, end) {
                let stop = run.end.min(end);
                removed += self.take_off(engine, bits, at, stop);
                id = stop;
            }
        }
        self.compacted[engine as usize] = 0;
        self.cursors[engine as usize] = NONE;
        removed
    }
}
