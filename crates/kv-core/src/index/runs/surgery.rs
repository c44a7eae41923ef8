//! Run surgery: giving part of a run a new holder set (split around it, merged with equal
//! neighbours), always relabelling the smaller side. Every holder change of the run index goes
//! through [`RunIndex::recolor`]. Under `podCacheSize` the part's holder order is the one its
//! caller staged ([`super::order`]); parts split off keep the run's order, and "equal" means
//! equal holders in the same order.
//!
//! Order (what keeps lock-free readers right, `seqlock`'s relabel model): ids move to another
//! run only after that run is written to cover them, and the run they leave is shrunk after
//! their slots point elsewhere; so at every moment each live id is covered by its slot's run,
//! or by the run it is moving to, and both hold its holders of before or after the change. A
//! set's pool words are released only after the run that held them was rewritten.

use super::cells::{Run, NONE};
use super::{Cause, RunHolders, RunIndex};

impl RunIndex {
    /// A new run (a free number reused first), written before any id points at it.
    pub(super) fn new_run(&mut self, start: u32, end: u32, holders: RunHolders) -> Option<u32> {
        let r = match self.free_runs.pop() {
            Some(r) => r,
            None => {
                let r = self.runs_len;
                self.run_chunks.reach(r, &self.reader.shared.runs)?;
                self.runs_len += 1;
                r
            }
        };
        self.stats.runs += 1;
        self.put_run(
            r,
            Run {
                start,
                end,
                holders,
            },
        );
        Some(r)
    }

    /// Frees run `r`: it covers nothing from now on, then its words go back to the pool.
    fn drop_run(&mut self, r: u32) {
        let holders = self.run(r).holders;
        self.put_run(r, Run::default());
        self.pool.release_run(holders);
        self.free_run(r);
    }

    /// Run number `r` (covering nothing, its words released) is free for reuse.
    fn free_run(&mut self, r: u32) {
        if let Some(order) = &mut self.order {
            order.clear(r);
        }
        self.free_runs.push(r);
        self.stats.runs -= 1;
    }

    /// Points ids `start .. end` at run `r` (written before).
    fn relabel(&mut self, start: u32, end: u32, r: u32) {
        let mut id = start;
        while id < end {
            let slots = self.id_chunks.link_tail(id);
            let n = ((end - id) as usize).min(slots.len());
            if n == 0 {
                break; // past the allocated ids (never: every id handed out has its chunk)
            }
            for slot in &slots[..n] {
                slot.set_run(r);
            }
            id += n as u32;
        }
        if r != NONE {
            self.stats.relabels += (end - start) as u64;
        }
    }

    /// A copy of `set` for a second part of a split run; when the pool is exhausted, an
    /// empty set (the part then scores for no one: an underestimate, never a false hit).
    fn copy_or_empty(&mut self, set: RunHolders) -> RunHolders {
        let words = &self.reader.shared.words;
        self.pool.copy_run(set, words).unwrap_or_else(|| {
            self.stats.pool_exhausted += 1;
            RunHolders::default()
        })
    }

    /// Gives ids `a .. b` (inside one run) the holder set `set` (owned; empty: the blocks left
    /// the index and the ids become free) and, under `podCacheSize`, the staged holder order.
    /// The run is split around them and the result merged with equal neighbours; the largest
    /// part keeps the run's number, so only the smaller parts are relabelled. The steps keep
    /// the module's order: a run is written before ids point at it, and `r` shrinks last.
    pub(super) fn recolor(&mut self, a: u32, b: u32, set: RunHolders, cause: Cause) {
        let r = self.id(a).run();
        let run = self.run(r);
        let (left, mid, right) = (a - run.start, b - a, run.end - b);
        if left > 0 || right > 0 {
            match cause {
                Cause::Join => self.stats.splits_join += 1,
                Cause::Hole => self.stats.splits_hole += 1,
                Cause::Leave => self.stats.splits_leave += 1,
            }
        }
        if !set.is_empty()
            && (left == 0) != (right == 0)
            && self.join_neighbour(a, b, (r, run), set)
        {
            return;
        }
        let keep_mid = !set.is_empty() && mid >= left && mid >= right;
        // The middle part, when it moves to a run of its own: written, then pointed at.
        let mut mid_run = None;
        if !set.is_empty() && !keep_mid {
            mid_run = self.middle_run(a, b, set);
        }
        let (old_owned, stays) = self.split_off_old((r, run), a, b, keep_mid);
        if set.is_empty() {
            self.relabel(a, b, NONE);
        }
        // Only now does `r` shrink (or take the middle's set, or die).
        match (keep_mid, stays) {
            (true, _) => {
                self.put_run(
                    r,
                    Run {
                        start: a,
                        end: b,
                        holders: set,
                    },
                );
                if let Some(order) = &mut self.order {
                    order.take_staged(r);
                }
                mid_run = Some(r);
            }
            (false, Some((s, e))) => self.run_slot(r).set_bounds(s, e),
            (false, None) if mid_run.is_none() && !set.is_empty() => {} // no run: unchanged
            (false, None) => {
                self.put_run(r, Run::default());
                self.free_run(r);
            }
        }
        if !old_owned {
            self.pool.release_run(run.holders);
        }
        if let Some(m) = mid_run {
            let m = self.merge_left(m);
            self.merge_right(m);
        }
    }

    /// When the part `a .. b` touches one end of its run `r` (as it was: `run`) and the
    /// neighbour there already has `set`, the part joins it (no new run, one relabel per id,
    /// `set` released): true.
    fn join_neighbour(&mut self, a: u32, b: u32, (r, run): (u32, Run), set: RunHolders) -> bool {
        let left = a == run.start;
        let at = if left { a.checked_sub(1) } else { Some(b) };
        let neighbour = at.map(|i| self.id(i).run()).filter(|&n| {
            n != NONE
                && self
                    .pool
                    .same_run(&self.run(n).holders, &set, &self.reader.shared.words)
                && self.order.as_ref().is_none_or(|o| o.is_staged(n))
        });
        let Some(n) = neighbour else {
            return false;
        };
        self.pool.release_run(set);
        let nr = self.run(n);
        if left {
            self.run_slot(n).set_bounds(nr.start, b);
            self.relabel(a, b, n);
            self.run_slot(r).set_bounds(b, run.end);
        } else {
            self.run_slot(n).set_bounds(a, nr.end);
            self.relabel(a, b, n);
            self.run_slot(r).set_bounds(run.start, a);
        }
        true
    }

    /// The middle part `a .. b` in a run of its own with `set` (and the staged order),
    /// written, then pointed at; `None` when no run is left (the part keeps its holders, `set`
    /// is released).
    fn middle_run(&mut self, a: u32, b: u32, set: RunHolders) -> Option<u32> {
        let Some(m) = self.new_run(a, b, set) else {
            self.pool.release_run(set);
            return None;
        };
        if let Some(order) = &mut self.order {
            order.take_staged(m);
        }
        self.relabel(a, b, m);
        Some(m)
    }

    /// The parts of run `r` (as it was: `run`) around `a .. b` that keep its holders: the
    /// larger stays in `r` unless the middle does (returned, for `r` to shrink to last);
    /// every other part gets a run of its own (the first takes the old set itself, the next
    /// a copy). Returns whether a part took the old set, and the part that stays.
    fn split_off_old(
        &mut self,
        (r, run): (u32, Run),
        a: u32,
        b: u32,
        keep_mid: bool,
    ) -> (bool, Option<(u32, u32)>) {
        let old = run.holders;
        let (big, small) = if a - run.start >= run.end - b {
            ((run.start, a), (b, run.end))
        } else {
            ((b, run.end), (run.start, a))
        };
        let mut old_owned = false;
        let mut stays = None;
        for (i, (s, e)) in [big, small].into_iter().enumerate() {
            if s == e {
                continue;
            }
            if i == 0 && !keep_mid {
                stays = Some((s, e));
                old_owned = true;
                continue;
            }
            let holders = if old_owned {
                self.copy_or_empty(old)
            } else {
                old_owned = true;
                old
            };
            if let Some(n) = self.new_run(s, e, holders) {
                if let Some(order) = &mut self.order {
                    order.copy(r, n);
                }
                self.relabel(s, e, n);
            }
        }
        (old_owned, stays)
    }

    /// Merges run `r` into its left neighbour (or the reverse) when they may merge
    /// ([`RunIndex::mergeable`]); returns the surviving run.
    fn merge_left(&mut self, r: u32) -> u32 {
        let run = self.run(r);
        let Some(l) = run.start.checked_sub(1).map(|i| self.id(i).run()) else {
            return r;
        };
        if l == NONE || !self.mergeable(l, r) {
            return r;
        }
        self.join(l, r)
    }

    pub(super) fn merge_right(&mut self, r: u32) -> u32 {
        let end = self.run_slot(r).end();
        if end >= self.ids_len {
            return r;
        }
        let n = self.id(end).run();
        if n == NONE || !self.mergeable(r, n) {
            return r;
        }
        self.join(r, n)
    }

    /// Joins adjacent runs `l` then `r` (mergeable), relabelling the shorter: the kept run
    /// grows first, the other's ids point at it, then the other dies.
    fn join(&mut self, l: u32, r: u32) -> u32 {
        self.stats.merges += 1;
        let (lr, rr) = (self.run(l), self.run(r));
        let (keep, gone) = if lr.end - lr.start >= rr.end - rr.start {
            (l, r)
        } else {
            (r, l)
        };
        let g = self.run(gone);
        self.run_slot(keep).set_bounds(lr.start, rr.end);
        self.relabel(g.start, g.end, keep);
        self.drop_run(gone);
        keep
    }
}
