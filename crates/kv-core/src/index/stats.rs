//! The index's counters, written once: [`counters!`] takes one list of names and builds the
//! writer's plain running totals ([`Tally`]), their atomic copy that readers load without the
//! writer ([`Counters`]) and the public [`IndexStats`], so adding a counter is one line.
//!
//! Invariant: a lane's writer changes only its `Tally` (plain integers: no atomic
//! read-modify-write on the hot path) and publishes it whole when its write ends; a reader of
//! [`Counters`] sees each counter as of some finished write (relaxed: each is a statistic on
//! its own, not a consistent set).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Builds [`Tally`], [`Counters`] and [`IndexStats`] from one list of writer counters.
macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident, )*) => {
        /// A lane writer's running totals, published to [`Counters`] when each write ends.
        #[derive(Debug, Default, Clone, Copy)]
        pub(super) struct Tally {
            $( $(#[$doc])* pub $name: u64, )*
        }

        /// A lane's counters, readable at any time without its writer (as of the last
        /// finished write).
        #[derive(Debug, Default)]
        pub(super) struct Counters {
            $( $name: AtomicU64, )*
        }

        impl Counters {
            /// Publishes the writer's totals.
            pub(super) fn publish(&self, t: &Tally) {
                $( self.$name.store(t.$name, Relaxed); )*
            }

            /// The counters as of the last finished write (`reads_given_up` and
            /// `memory_bytes` left 0: they are not the writer's).
            pub(super) fn snapshot(&self) -> IndexStats {
                IndexStats {
                    $( $name: self.$name.load(Relaxed), )*
                    reads_given_up: 0,
                    memory_bytes: 0,
                }
            }
        }

        /// A snapshot of a model index's size and activity: what the daemon exports as
        /// metrics and the benchmarks report.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct IndexStats {
            $( $(#[$doc])* pub $name: u64, )*
            /// Blocks a lock-free reader counted as not held because the writer kept changing
            /// them for longer than a read waits (each made a score an underestimate).
            pub reads_given_up: u64,
            /// Bytes held by the index's structures.
            pub memory_bytes: u64,
        }

        impl IndexStats {
            /// Adds another lane's counters (memory included).
            pub(super) fn add(&mut self, other: &IndexStats) {
                $( self.$name += other.$name; )*
                self.reads_given_up += other.reads_given_up;
                self.memory_bytes += other.memory_bytes;
            }
        }
    };
}

counters! {
    /// Distinct block keys.
    keys,
    /// (block, engine, tier) memberships.
    memberships,
    /// Memberships added by stores.
    admissions,
    /// Memberships removed by `BlockRemoved`, clears and engine removal.
    removals,
    /// Memberships dropped because the index reached `size`.
    capacity_evictions,
    /// Memberships dropped because a block reached `podCacheSize` (only when it is set).
    pod_cache_evictions,
    /// Stored runs whose parent the engine did not hold.
    orphan_runs,
    /// Blocks not stored because every block id was in use (never with a sane `size`).
    dropped_full,
    /// Holder changes the word pool had no room for (each part then scores for no one;
    /// never with a sane `size`).
    pool_exhausted,
}

/// What one store did: the caller's answer (e.g. translation counts second copies), folded
/// into the lane's [`Tally`] by [`Tally::stored`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Memberships added (blocks the engine did not hold in that tier before).
    pub added: usize,
    /// The run's parent was given but the engine does not hold it.
    pub orphan: bool,
}

impl Tally {
    /// Counts a store's new memberships and its orphan run.
    pub(super) fn stored(&mut self, outcome: &StoreOutcome) {
        self.admissions += outcome.added as u64;
        self.memberships += outcome.added as u64;
        self.orphan_runs += u64::from(outcome.orphan);
    }
}
