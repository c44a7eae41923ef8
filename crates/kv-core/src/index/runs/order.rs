//! Holder order under `podCacheSize`: which of a run's holders came first, so a store that
//! would pass the bound drops the oldest holder of the block.
//!
//! Kept by the writer alone (readers never need it) and only when a bound is set. A member is
//! `engine * 4 + tier`, as in the holder sets. Every block of a run has the same holders in
//! the same order: a holder change on part of a run splits it as any change does, and two
//! adjacent runs merge only when their orders are equal too ([`RunIndex::recolor`] and the
//! merges ask [`HolderOrder::same`]).
//!
//! Invariant (between operations): for every live run `r`, `of(r)` lists exactly the members
//! of its holder set, oldest first, at most `bound` of them; a free run's list is empty.
//!
//! [`RunIndex::recolor`]: super::RunIndex

/// Whether the order `$o` was built with the fault `RunFault::$f` armed (the differential
/// test's negative controls; `false` without the `fault-injection` feature).
macro_rules! broken {
    ($o:expr, $f:ident) => {{
        #[cfg(feature = "fault-injection")]
        let broken = $o.fault == Some(crate::fault_injection::RunFault::$f);
        #[cfg(not(feature = "fault-injection"))]
        let broken = false;
        broken
    }};
}

/// The join order of every run's holders (see the module docs).
#[derive(Debug)]
pub(super) struct HolderOrder {
    /// The most members a block keeps (`podCacheSize`).
    bound: usize,
    /// Per run number: its members, oldest first.
    by_run: Vec<Vec<u32>>,
    /// The order of the holder set a change is about to give part of a run: staged by the
    /// caller of `recolor`, which gives it to the part's run.
    pub staged: Vec<u32>,
    /// A rule broken on purpose (the differential test's negative controls).
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault_injection::RunFault>,
}

impl HolderOrder {
    /// No run has holders yet; blocks keep at most `bound` (at least 1) members.
    pub fn new(bound: usize) -> Self {
        Self {
            bound: bound.max(1),
            by_run: Vec::new(),
            staged: Vec::new(),
            #[cfg(feature = "fault-injection")]
            fault: crate::fault_injection::armed(),
        }
    }

    /// Run `r`'s members, oldest first.
    pub fn of(&self, r: u32) -> &[u32] {
        self.by_run.get(r as usize).map_or(&[], Vec::as_slice)
    }

    /// Gives run `r` the staged order.
    pub fn take_staged(&mut self, r: u32) {
        let staged = std::mem::take(&mut self.staged);
        let list = self.list(r);
        list.clear();
        list.extend_from_slice(&staged);
        self.staged = staged;
    }

    /// Gives run `r` the single member `m` (a run of new blocks).
    pub fn set_one(&mut self, r: u32, m: u32) {
        let list = self.list(r);
        list.clear();
        list.push(m);
    }

    /// Gives run `to` run `from`'s order (a part split off keeps its holders).
    pub fn copy(&mut self, from: u32, to: u32) {
        if from == to {
            return;
        }
        let src = std::mem::take(self.list(from));
        let dst = self.list(to);
        dst.clear();
        dst.extend_from_slice(&src);
        *self.list(from) = src;
    }

    /// Run `r` is free.
    pub fn clear(&mut self, r: u32) {
        if let Some(list) = self.by_run.get_mut(r as usize) {
            list.clear();
        }
    }

    /// Whether runs `a` and `b` list their members in the same order.
    pub fn same(&self, a: u32, b: u32) -> bool {
        self.of(a) == self.of(b) || broken!(self, MergeUnequalOrders)
    }

    /// Whether run `r`'s order is the staged one.
    pub fn is_staged(&self, r: u32) -> bool {
        self.of(r) == self.staged.as_slice() || broken!(self, JoinUnequalOrder)
    }

    /// Stages run `r`'s order with `m` added last; when that passes the bound, the oldest
    /// member is dropped from it and returned (one at most: a run holds at most `bound`).
    pub fn stage_join(&mut self, r: u32, m: u32) -> Option<u32> {
        let mut staged = std::mem::take(&mut self.staged);
        staged.clear();
        staged.extend_from_slice(self.of(r));
        staged.push(m);
        let victim = if broken!(self, DropNewest) {
            staged.len().saturating_sub(2)
        } else {
            0 // the oldest
        };
        let dropped = (staged.len() > self.bound).then(|| staged.remove(victim));
        debug_assert!(staged.len() <= self.bound, "a run held more than the bound");
        self.staged = staged;
        dropped
    }

    /// Stages run `r`'s order without the members `gone` says leave.
    pub fn stage_without(&mut self, r: u32, gone: impl Fn(u32) -> bool) {
        let mut staged = std::mem::take(&mut self.staged);
        staged.clear();
        staged.extend(self.of(r).iter().copied().filter(|&m| !gone(m)));
        self.staged = staged;
    }

    /// Bytes held.
    pub fn allocated_bytes(&self) -> usize {
        self.by_run.capacity() * std::mem::size_of::<Vec<u32>>()
            + self.by_run.iter().map(|l| l.capacity() * 4).sum::<usize>()
            + self.staged.capacity() * 4
    }

    fn list(&mut self, r: u32) -> &mut Vec<u32> {
        let r = r as usize;
        if self.by_run.len() <= r {
            self.by_run.resize_with(r + 1, Vec::new);
        }
        &mut self.by_run[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_join_past_the_bound_drops_the_oldest_members_first() {
        let mut order = HolderOrder::new(3);
        order.set_one(0, 10);
        for m in [11, 12] {
            assert_eq!(order.stage_join(0, m), None, "under the bound");
            order.take_staged(0);
        }
        assert_eq!(order.of(0), &[10, 11, 12]);
        assert_eq!(order.stage_join(0, 13), Some(10), "the oldest goes");
        assert_eq!(order.staged, vec![11, 12, 13]);
        assert_eq!(
            order.of(0),
            &[10, 11, 12],
            "the run keeps its order until recolored"
        );
        order.take_staged(5);
        order.copy(5, 2);
        assert!(order.same(5, 2) && !order.same(0, 2));
        order.stage_without(2, |m| m == 12);
        assert_eq!(order.staged, vec![11, 13], "the others keep their places");
        order.clear(2);
        assert!(order.of(2).is_empty());
    }
}
