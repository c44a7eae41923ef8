//! Run surgery: giving part of a run a new holder set (split around it, merged with equal
//! neighbours), always relabelling the smaller side. Every holder change of the run index goes
//! through [`RunIndex::recolor`].

use super::{Cause, Holders, Run, RunIndex, NONE};

impl RunIndex {
    pub(super) fn new_run(&mut self, start: u32, end: u32, holders: Holders) -> u32 {
        let run = Run {
            start,
            end,
            holders,
        };
        self.stats.runs += 1;
        match self.free_runs.pop() {
            Some(r) => {
                self.runs[r as usize] = run;
                r
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    fn drop_run(&mut self, r: u32) {
        self.pool.release(self.runs[r as usize].holders);
        self.runs[r as usize].holders = Holders::default();
        self.free_runs.push(r);
        self.stats.runs -= 1;
    }

    fn relabel(&mut self, start: u32, end: u32, r: u32) {
        self.ids.set_run(start, end, r);
        self.stats.relabels += (end - start) as u64;
    }

    /// Gives ids `a .. b` (inside one run) the holder set `set` (owned; empty: the blocks left
    /// the index and the ids become free). The run is split around them and the result merged
    /// with equal neighbours; the largest part keeps the run's number, so only the smaller
    /// parts are relabelled.
    pub(super) fn recolor(&mut self, a: u32, b: u32, set: Holders, cause: Cause) {
        let r = self.ids[a].run;
        let run = self.runs[r as usize];
        let (left, mid, right) = (a - run.start, b - a, run.end - b);
        if left > 0 || right > 0 {
            match cause {
                Cause::Join => self.stats.splits_join += 1,
                Cause::Hole => self.stats.splits_hole += 1,
                Cause::Leave => self.stats.splits_leave += 1,
            }
        }
        if !set.is_empty() && (left == 0) != (right == 0) {
            // The part touches one end of its run: when the neighbour there already has `set`,
            // the part joins it (no new run, one relabel per id).
            let at = if left == 0 { a.checked_sub(1) } else { Some(b) };
            let neighbour = at
                .and_then(|i| self.ids.get(i).map(|slot| slot.run))
                .filter(|&n| n != NONE && self.pool.same(&self.runs[n as usize].holders, &set));
            if let Some(n) = neighbour {
                self.pool.release(set);
                self.relabel(a, b, n);
                if left == 0 {
                    self.runs[n as usize].end = b;
                    self.runs[r as usize].start = b;
                } else {
                    self.runs[n as usize].start = a;
                    self.runs[r as usize].end = a;
                }
                return;
            }
        }
        let keep_mid = !set.is_empty() && mid >= left && mid >= right;
        let old = run.holders;
        let mid_run = if set.is_empty() {
            None
        } else if keep_mid {
            self.runs[r as usize] = Run {
                start: a,
                end: b,
                holders: set,
            };
            Some(r)
        } else {
            let m = self.new_run(a, b, set);
            self.relabel(a, b, m);
            Some(m)
        };
        // The parts that keep the old holders: the first takes `old` itself, others a copy.
        let mut old_owned = false;
        let (big, small) = if left >= right {
            ((run.start, a), (b, run.end))
        } else {
            ((b, run.end), (run.start, a))
        };
        for (i, (s, e)) in [big, small].into_iter().enumerate() {
            if s == e {
                continue;
            }
            let holders = if old_owned {
                self.pool.copy(old)
            } else {
                old_owned = true;
                old
            };
            if i == 0 && !keep_mid {
                self.runs[r as usize] = Run {
                    start: s,
                    end: e,
                    holders,
                };
            } else {
                let n = self.new_run(s, e, holders);
                self.relabel(s, e, n);
            }
        }
        if !old_owned {
            self.pool.release(old);
        }
        if set.is_empty() && left == 0 && right == 0 {
            self.runs[r as usize].holders = Holders::default();
            self.free_runs.push(r);
            self.stats.runs -= 1;
        }
        match mid_run {
            Some(m) => {
                let m = self.merge_left(m);
                self.merge_right(m);
            }
            None => {
                self.ids.set_run(a, b, NONE);
            }
        }
    }

    /// Merges run `r` into its left neighbour (or the reverse) when their holders are equal;
    /// returns the surviving run.
    fn merge_left(&mut self, r: u32) -> u32 {
        let run = self.runs[r as usize];
        let Some(l) = run.start.checked_sub(1).map(|i| self.ids[i].run) else {
            return r;
        };
        if l == NONE || !self.pool.same(&self.runs[l as usize].holders, &run.holders) {
            return r;
        }
        self.join(l, r)
    }

    pub(super) fn merge_right(&mut self, r: u32) -> u32 {
        let run = self.runs[r as usize];
        let Some(n) = self.ids.get(run.end).map(|slot| slot.run) else {
            return r;
        };
        if n == NONE || !self.pool.same(&self.runs[n as usize].holders, &run.holders) {
            return r;
        }
        self.join(r, n)
    }

    /// Joins adjacent runs `l` then `r` (equal holders), relabelling the shorter.
    fn join(&mut self, l: u32, r: u32) -> u32 {
        self.stats.merges += 1;
        let (lr, rr) = (self.runs[l as usize], self.runs[r as usize]);
        let (keep, gone) = if lr.end - lr.start >= rr.end - rr.start {
            (l, r)
        } else {
            (r, l)
        };
        let g = self.runs[gone as usize];
        self.relabel(g.start, g.end, keep);
        self.runs[keep as usize].start = lr.start;
        self.runs[keep as usize].end = rr.end;
        self.drop_run(gone);
        keep
    }
}
