//! Index rules broken on purpose, for negative controls only: a test arms a fault, builds an
//! index on its thread, and checks that the differential harness reports a difference
//! (`tests/index_differential.rs`). Compiled only with the `fault-injection` feature, which
//! kv-core's own tests enable (a dev-dependency on itself) and nothing else does. An index
//! built while no fault is armed behaves exactly as without the feature.

use std::cell::Cell;

/// A rule of the run index's holder order under `podCacheSize`, broken (see
/// `index/runs/order.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunFault {
    /// Adjacent runs with equal holders merge even when their holders' orders differ.
    MergeUnequalOrders,
    /// A changed part joins a neighbour with its holders even when the neighbour's order
    /// differs.
    JoinUnequalOrder,
    /// A join past the bound drops the newest holder (the last to join before it) instead of
    /// the oldest.
    DropNewest,
}

thread_local! {
    static ARMED: Cell<Option<RunFault>> = const { Cell::new(None) };
}

/// Runs `f` with `fault` armed: every run index `f` builds on this thread keeps it for its
/// whole life (the fault is read when the index is built, not when it is used).
pub fn with_run_fault<R>(fault: RunFault, f: impl FnOnce() -> R) -> R {
    /// Restores the previous state, also when `f` panics.
    struct Restore(Option<RunFault>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ARMED.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ARMED.with(|a| a.replace(Some(fault))));
    f()
}

/// The fault armed on this thread, if any (read by a run index being built).
pub(crate) fn armed() -> Option<RunFault> {
    ARMED.with(Cell::get)
}
