//! The run index's read path: lock-free lookups and the prefix-scoring walk.
//!
//! A reader takes no lock and writes nothing shared. Every block it reports is checked inside
//! the seqlock section of the run it read it from: the id's slot named the run, the run
//! covered the id, and the id held the block's hash, all under one unchanged sequence. A
//! stretch of ids compared inside a run is kept only if the run's sequence still holds after
//! the comparison (nothing in a run changes without a write of it).
//!
//! Retries: a write under way is waited for, however long (a write is a few stores, so only a
//! descheduled writer makes it long); a section the writer wrote during, or a table probe that
//! missed while the writer moved table entries, is read again, up to [`CHANGES`] times; a check that fails without such a write (the id's slot or run moved
//! between two loads) re-reads the block through the table, up to [`RETRIES`] times. Past
//! either bound the block counts as not held (an underestimate, never a false hit) and the
//! reader's [`RunReader::gave_up`] count grows.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::cells::{id_slot, run_slot, HashCell, Run, RunSlot, NONE};
use super::{RunHolders, Shared, WINDOW};
use crate::index::table::{Moved, Table};
use crate::index::types::{EngineId, EngineScore, Tier, TierWeights};
use crate::BlockHash;

/// Failed checks of one block (its slot named a run that did not cover it, or the id no
/// longer held its hash) before a reader gives it up: each means the id moved between two
/// loads, so a bound is reached only if the index is inconsistent.
const RETRIES: usize = 64;

/// Sections of one block's run that the writer wrote during, before a reader gives it up: a
/// bound on a writer that rewrites one run back to back for as long as a reader reads.
const CHANGES: usize = 4096;

/// Ids past a block a walk jumps to whose slots it prefetches before reading the block's run:
/// the stretch it compares next (24 lines), fetched while the run slot, a dependent miss, is
/// read. 96 and 256 ids gave the same query p99 (docs/benchmarks-history.md, "Where the
/// 16-pod query p99 goes").
const STRETCH_AHEAD: usize = 192;

/// Spins before a reader waiting for a write to end yields its thread (the writer may have
/// been descheduled inside the write).
const SPINS: u32 = 128;

/// A lock-free reader of a [`RunIndex`](super::RunIndex) (clone it for each thread).
#[derive(Clone)]
pub struct RunReader {
    pub(super) shared: Arc<Shared>,
}

/// A reader's working memory, reused across calls (a score allocates nothing once it has
/// seen its widest holder set and its highest engine).
#[derive(Default)]
pub struct RunScratch {
    /// Engines still matching, by window of 64 engines (ascending).
    alive: Vec<(u32, u64)>,
    /// Per alive window: the engines of the run being read (kept once the read checks).
    held: Vec<u64>,
    /// The current run's engines whose best tier weighs other than GPU, with the difference
    /// per block; and the same for the run being read.
    deltas: Vec<(u32, f64)>,
    next_deltas: Vec<(u32, f64)>,
    /// Per engine: the weight beyond GPU's, summed over the runs passed (zeroed after each
    /// call through `touched`).
    extra: Vec<f64>,
    touched: Vec<u32>,
}

/// A block read under its run's seqlock.
struct Found {
    id: u32,
    run: u32,
    seq: u32,
    end: u32,
}

impl RunReader {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Who holds `hash` now, as (engine, tier) pairs in engine order.
    pub fn lookup(&self, hash: BlockHash) -> Vec<(EngineId, Tier)> {
        self.shared.lookup(hash)
    }

    /// Whether the engine in `slot` holds each of `keys` (in any tier), into `out`: the keys
    /// of consecutive blocks are found from each other (the next id, the chain's hint) as the
    /// prefix walk finds them, so a window of blocks costs about one table probe, not one each.
    pub fn holds_each(&self, keys: &[BlockHash], slot: EngineId, out: &mut Vec<bool>) {
        self.shared.holds_each(keys, slot, out);
    }

    /// Scores every engine that holds the prompt's first block (and that `admit` accepts,
    /// when given): how many consecutive blocks from block 0 it holds, in any tier, and their
    /// summed best tier weights. Appends one entry per such engine to `out`.
    pub fn score(
        &self,
        prompt: &[BlockHash],
        weights: &TierWeights,
        admit: Option<impl Fn(EngineId) -> bool>,
        scratch: &mut RunScratch,
        out: &mut Vec<EngineScore>,
    ) {
        self.shared.score(prompt, weights, admit, scratch, out);
    }

    /// Blocks that readers of this index counted as not held because the writer kept changing
    /// them (or the index disagreed with itself) for longer than a read waits: each made a
    /// score or a lookup an underestimate. Zero in every test; a metric where it is not.
    pub fn gave_up(&self) -> u64 {
        self.shared.gave_up.load(Relaxed)
    }
}

/// Begins a read of `cell`, waiting while a write is under way.
#[inline]
fn wait_even(cell: &super::cells::RunSlot) -> u32 {
    wait_for(|| cell.begin_read())
}

/// Waits until `ready` gives a value (a write under way ended), spinning, then yielding: the
/// writer may have been descheduled inside the write, and every write ends.
#[inline]
fn wait_for<T>(ready: impl Fn() -> Option<T>) -> T {
    let mut spins = 0u32;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        if spins < SPINS {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// The best weight of the tiers in `nibble` (bit `t`: tier `t`), for every nibble.
fn best_weights(weights: &TierWeights) -> [f64; 16] {
    let tiers = [Tier::Gpu, Tier::Cpu, Tier::Storage, Tier::Other];
    let mut best = [0.0; 16];
    for (nibble, b) in best.iter_mut().enumerate() {
        *b = tiers
            .iter()
            .filter(|t| nibble & (1 << **t as usize) != 0)
            .map(|&t| weights.of(t))
            .fold(0.0, f64::max);
    }
    best
}

/// The engines of `holders` in `alive`'s windows, and each one's weight beyond GPU's where
/// it is not GPU's (`deltas`).
#[inline]
fn read_holders(
    holders: &RunHolders,
    alive: &[(u32, u64)],
    best: &[f64; 16],
    words: &super::Words,
    held: &mut Vec<u64>,
    deltas: &mut Vec<(u32, f64)>,
) {
    held.clear();
    held.extend(
        alive
            .iter()
            .map(|&(w, bits)| holders.engines_of(w, words) & bits),
    );
    deltas.clear();
    if holders.other.is_empty() {
        return; // GPU copies only: every engine weighs `best[1]`
    }
    for (k, &(w, _)) in alive.iter().enumerate() {
        let mut engines = held[k];
        while engines != 0 {
            let e = w * WINDOW + engines.trailing_zeros();
            engines &= engines - 1;
            let delta = best[holders.nibble(e, words) as usize] - best[1];
            if delta != 0.0 {
                deltas.push((e, delta));
            }
        }
    }
}

impl Shared {
    /// The id of `hash` through `table` (unchecked); [`Moved`] when the table moved entries
    /// while a miss was found (probe again).
    #[inline]
    fn find(&self, table: &Table, hash: u64) -> Result<Option<u32>, Moved> {
        table.find(hash, |id| id_slot(&self.ids, id).hash())
    }

    /// The id of `hash` following block `parent`: the next id, the parent's hint, the table
    /// (unchecked: the caller reads it under its run's seqlock).
    #[inline]
    fn locate(&self, table: &Table, parent: Option<u32>, hash: u64) -> Result<Option<u32>, Moved> {
        if let Some(p) = parent {
            let next = p.wrapping_add(1);
            if id_slot(&self.ids, next).hash() == hash {
                return Ok(Some(next));
            }
            let hint = id_slot(&self.ids, p).next();
            if hint != NONE && id_slot(&self.ids, hint).hash() == hash {
                return Ok(Some(hint));
            }
        }
        self.find(table, hash)
    }

    /// Reads block `hash` (found from `parent`) under its run's seqlock, running `inside` on
    /// the run while the section is open; `None` when the block is not in the index (or kept
    /// failing its checks). What `inside` computed is valid only when this returns `Some`.
    /// A walk (`walk`) prefetches the ids after the block first ([`STRETCH_AHEAD`]).
    #[inline]
    fn read_block(
        &self,
        table: &Table,
        parent: Option<u32>,
        hash: u64,
        walk: bool,
        mut inside: impl FnMut(u32, u32, &Run),
    ) -> Option<Found> {
        let mut from = parent;
        let (mut failed, mut changed) = (0, 0);
        while failed < RETRIES && changed < CHANGES {
            let id = match self.locate(table, from, hash) {
                Ok(found) => found?,
                Err(Moved) => {
                    // A miss while the table moved entries: probe again once they are moved.
                    changed += 1;
                    wait_for(|| table.settled().then_some(()));
                    continue;
                }
            };
            if walk {
                self.prefetch_stretch(id);
            }
            from = None; // a retry goes through the table
            let slot = id_slot(&self.ids, id);
            let r = slot.run();
            if r == NONE {
                failed += 1;
                continue;
            }
            let cell = run_slot(&self.runs, r);
            let seq = wait_even(cell);
            let run = cell.load();
            if run.start > id || id >= run.end || slot.hash() != hash || !run.holders.is_plausible()
            {
                if cell.still(seq) {
                    failed += 1; // the slot moved since it was loaded (or never agreed)
                } else {
                    changed += 1; // a torn read of the run
                }
                continue;
            }
            inside(r, seq, &run);
            if cell.still(seq) {
                return Some(Found {
                    id,
                    run: r,
                    seq,
                    end: run.end,
                });
            }
            changed += 1;
        }
        self.gave_up.fetch_add(1, Relaxed);
        None
    }

    /// Prefetches the hashes of the ids after `id` (a line each eight ids, to
    /// [`STRETCH_AHEAD`] or the chunk's end).
    #[inline]
    fn prefetch_stretch(&self, id: u32) {
        let tail = self.ids.hash_tail(id);
        for slot in tail.iter().take(STRETCH_AHEAD).skip(8).step_by(8) {
            crate::memory::prefetch_read(slot as *const HashCell as *const u8);
        }
    }

    fn lookup(&self, hash: BlockHash) -> Vec<(EngineId, Tier)> {
        let table = self.table.load();
        let mut out = Vec::new();
        let read = self.read_block(&table, None, hash.get(), false, |_, _, run| {
            out.clear();
            let members = run.holders.members(&self.words);
            out.extend(members.map(|(e, t)| (e, Tier::from_bits(t))));
        });
        if read.is_none() {
            out.clear();
        }
        out
    }

    fn holds_each(&self, keys: &[BlockHash], slot: EngineId, out: &mut Vec<bool>) {
        let table = self.table.load();
        let mut parent = None;
        out.clear();
        let mut i = 0;
        while i < keys.len() {
            let mut held = false;
            let found = self.read_block(&table, parent, keys[i].get(), false, |_, _, run| {
                held = run.holders.nibble(slot, &self.words) != 0;
            });
            out.push(found.is_some() && held);
            i += 1;
            let Some(at) = found else {
                parent = None;
                continue;
            };
            // Inside the block's run (one holder set): the next ids hold the next keys for as
            // long as their hashes agree, with the same answer; kept if the run did not
            // change (as the walk does).
            let slots = self.ids.hash_tail(at.id + 1);
            let room = (at.end - at.id - 1) as usize;
            let slots = &slots[..slots.len().min(room)];
            let same = slots
                .iter()
                .zip(&keys[i..])
                .take_while(|(slot, k)| slot.hash() == k.get())
                .count();
            parent = Some(at.id);
            if same > 0 && run_slot(&self.runs, at.run).still(at.seq) {
                out.extend(std::iter::repeat_n(held, same));
                i += same;
                parent = Some(at.id + same as u32);
            }
        }
    }

    fn score(
        &self,
        prompt: &[BlockHash],
        weights: &TierWeights,
        admit: Option<impl Fn(EngineId) -> bool>,
        s: &mut RunScratch,
        out: &mut Vec<EngineScore>,
    ) {
        let Some(first) = prompt.first() else {
            return;
        };
        let best = best_weights(weights);
        let table = self.table.load();
        let words = &self.words;
        // The first block: its holders (those `admit` accepts) start the walk.
        let found = self.read_block(&table, None, first.get(), true, |_, _, run| {
            start_walk(&run.holders, admit.as_ref(), &best, words, s);
        });
        let Some(mut at) = found else {
            return;
        };
        // `since`: the prompt position where the current run started; `entered`: the walk
        // has just entered the run `at` is in.
        let (mut j, mut since) = (0usize, 0usize);
        let mut entered = true;
        while j + 1 < prompt.len() && !s.alive.is_empty() {
            // Only on entering a run: where the chain goes on after it, prefetched.
            if entered {
                self.prefetch_exits(&at);
            }
            entered = false;
            // Inside the run (one holder set): the next ids hold the next blocks for as long
            // as their hashes agree; one pass over the slots, kept if the run did not change.
            let slots = self.ids.hash_tail(at.id + 1);
            let room = (at.end - at.id - 1) as usize;
            let slots = &slots[..slots.len().min(room)];
            let same = slots
                .iter()
                .zip(&prompt[j + 1..])
                .take_while(|(slot, h)| slot.hash() == h.get())
                .count();
            if same > 0 && run_slot(&self.runs, at.run).still(at.seq) {
                at.id += same as u32;
                j += same;
                if j + 1 == prompt.len() {
                    break;
                }
                if same == slots.len() && at.id + 1 < at.end {
                    continue; // the slots' chunk ended, the run did not
                }
            }
            // Where the stretch ends: the next block, wherever it is.
            let (run, seq) = (at.run, at.seq);
            let next = self.read_block(
                &table,
                Some(at.id),
                prompt[j + 1].get(),
                true,
                |r, q, cell| {
                    if r != run || q != seq {
                        let (held, deltas) = (&mut s.held, &mut s.next_deltas);
                        read_holders(&cell.holders, &s.alive, &best, words, held, deltas);
                    }
                },
            );
            let Some(next) = next else {
                break; // block `j + 1` is held by none of them
            };
            j += 1;
            entered = next.run != at.run;
            if next.run != at.run || next.seq != at.seq {
                // A new holder set from block `j`: close the run before it, then drop the
                // engines that do not hold block `j`.
                close_run(s, j - since);
                next_holder_set(s, j, &best, out);
                since = j;
            }
            at = next;
        }
        // Every engine still alive holds blocks `0 ..= j`.
        close_run(s, j + 1 - since);
        finish_walk(s, j + 1, &best, out);
    }
}

impl Shared {
    /// On entering the run `at` is in: prefetches where the chain last went on after it (that
    /// block's hash and links, and its run's slot) and the links of the run's last block
    /// (whose hint a hop from there reads), while the run's hashes are compared. Hints only:
    /// the hop reads them under its seqlock.
    #[inline]
    fn prefetch_exits(&self, at: &Found) {
        let cell = run_slot(&self.runs, at.run);
        let after = cell.after();
        if after != NONE {
            crate::memory::prefetch_read(run_slot(&self.runs, after) as *const RunSlot as *const u8);
        }
        let after_id = cell.after_id();
        if after_id != NONE {
            self.ids.prefetch(after_id, true, true);
        }
        self.ids.prefetch(at.end - 1, false, true);
    }
}

/// The walk's start: the first block's holders that `admit` accepts (every one without it)
/// become the alive engines, with their weights beyond GPU's.
#[inline]
fn start_walk<F: Fn(EngineId) -> bool>(
    holders: &RunHolders,
    admit: Option<&F>,
    best: &[f64; 16],
    words: &super::Words,
    s: &mut RunScratch,
) {
    s.alive.clear();
    for w in holders.engine_windows() {
        let mut engines = holders.engines_of(w, words);
        if let Some(admit) = admit {
            let mut admitted = 0;
            while engines != 0 {
                let b = engines.trailing_zeros();
                engines &= engines - 1;
                if admit(w * WINDOW + b) {
                    admitted |= 1 << b;
                }
            }
            engines = admitted;
        }
        if engines != 0 {
            s.alive.push((w, engines));
        }
    }
    read_holders(holders, &s.alive, best, words, &mut s.held, &mut s.deltas);
}

/// A new holder set from block `j`: the engines that do not hold it are scored for `j`
/// blocks and dropped; the set's weights become the current run's.
#[inline]
fn next_holder_set(s: &mut RunScratch, j: usize, best: &[f64; 16], out: &mut Vec<EngineScore>) {
    for (k, (w, bits)) in s.alive.iter_mut().enumerate() {
        let mut dropped = *bits & !s.held[k];
        while dropped != 0 {
            let e = *w * WINDOW + dropped.trailing_zeros();
            dropped &= dropped - 1;
            out.push(score_of(e, j, best, &s.extra));
        }
        *bits = s.held[k];
    }
    s.alive.retain(|&(_, bits)| bits != 0);
    std::mem::swap(&mut s.deltas, &mut s.next_deltas);
}

/// The walk's end: every engine still alive scored for `matched` blocks; the scratch left
/// clean for the next walk.
#[inline]
fn finish_walk(s: &mut RunScratch, matched: usize, best: &[f64; 16], out: &mut Vec<EngineScore>) {
    for &(w, mut bits) in &s.alive {
        while bits != 0 {
            let e = w * WINDOW + bits.trailing_zeros();
            bits &= bits - 1;
            out.push(score_of(e, matched, best, &s.extra));
        }
    }
    for &e in &s.touched {
        s.extra[e as usize] = 0.0;
    }
    s.touched.clear();
    s.alive.clear();
}

/// Adds the current run's weights beyond GPU's, for its `blocks`, to its engines' sums.
fn close_run(s: &mut RunScratch, blocks: usize) {
    for &(e, delta) in &s.deltas {
        let e = e as usize;
        if e >= s.extra.len() {
            s.extra.resize(e + 1, 0.0);
        }
        if s.extra[e] == 0.0 {
            s.touched.push(e as u32);
        }
        s.extra[e] += blocks as f64 * delta;
    }
}

/// Engine `e`'s score for `matched` blocks: GPU's weight each, plus what its tiers added.
#[inline]
fn score_of(e: u32, matched: usize, best: &[f64; 16], extra: &[f64]) -> EngineScore {
    EngineScore {
        engine: e,
        matched_blocks: matched as u32,
        score: matched as f64 * best[1] + extra.get(e as usize).copied().unwrap_or(0.0),
    }
}
