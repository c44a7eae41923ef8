//! The publication protocol between writers and lock-free readers, written once, generic over
//! the atomics, so that the model check (`loom`, under `cfg(loom)`) runs the code the index and
//! the digest memo run, and a deliberately broken variant shows the check can fail.
//!
//! Three primitives:
//! - **Seqlock** (every run of the index: its bounds and holder words). The writer makes the sequence odd,
//!   fences (Release), changes the data with relaxed stores, and publishes the next even
//!   sequence with a Release store. A reader loads the sequence (Acquire), reads the data
//!   relaxed, fences (Acquire), and keeps the read only if the sequence is unchanged and even.
//!   A kept read is one version of the run, never a mix of two, and never older than the
//!   sequence it saw. Anything the writer stored before the write (a fresh holder set's pooled
//!   words) is visible to a reader that keeps the read.
//! - **Claimed seqlock** (the digest memo's entries: many writers, readers that never wait).
//!   A writer claims the entry by a compare-and-swap of the even sequence to odd (Acquire, so
//!   its stores follow the previous writer's), then writes as above; a writer that finds the
//!   entry claimed gives up. A reader makes one attempt and treats an odd or changed sequence
//!   as a miss.
//! - **Flag after data** (an id slot's run, a table slot; a rebuilt table). The data is complete before a
//!   Release store of the flag; a reader that loads the flag with Acquire sees that data.
//!   ([`arc_swap`] gives a table swap the same store/load semantics.)
//!
//! The model also fixes the order in which the run index moves ids between runs
//! under lock-free readers: receiving run written, slots pointed at it, old run shrunk
//! (`index::runs::surgery` follows it; `index::runs::cells` has the rest of its rules).

use std::sync::atomic::Ordering;

/// A 32-bit atomic word (the std one in the index, loom's in the model).
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u32;
    fn store(&self, value: u32, order: Ordering);
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32>;
}

/// A memory fence (std's in the index, loom's in the model).
pub(crate) trait Fence {
    fn fence(order: Ordering);
}

impl Word for std::sync::atomic::AtomicU32 {
    #[inline(always)]
    fn load(&self, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::load(self, order)
    }
    #[inline(always)]
    fn store(&self, value: u32, order: Ordering) {
        std::sync::atomic::AtomicU32::store(self, value, order)
    }
    #[inline(always)]
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32> {
        std::sync::atomic::AtomicU32::compare_exchange(self, current, new, success, failure)
    }
}

/// The hardware fence.
pub(crate) struct StdFence;

impl Fence for StdFence {
    #[inline(always)]
    fn fence(order: Ordering) {
        std::sync::atomic::fence(order)
    }
}

/// The orderings of the protocol, as data so the model can also check a broken variant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Protocol {
    /// Whether a claiming writer takes the sequence by one compare-and-swap (the protocol) or
    /// by a load and a store (the broken variant the model must catch: two writers can both
    /// believe they hold the claim).
    pub claim_atomically: bool,
    /// A claiming writer's compare-and-swap of the sequence to odd, on success.
    pub write_claim: Ordering,
    /// The writer's fence after making the sequence odd.
    pub write_fence: Ordering,
    /// The writer's store of the next even sequence.
    pub write_publish: Ordering,
    /// The reader's first load of the sequence.
    pub read_load: Ordering,
    /// The reader's fence before it loads the sequence again.
    pub read_fence: Ordering,
    /// The store of a flag after its data.
    pub flag_publish: Ordering,
    /// The load of a flag before its data.
    pub flag_observe: Ordering,
}

/// The protocol the index runs.
pub(crate) const PROTOCOL: Protocol = Protocol {
    claim_atomically: true,
    write_claim: Ordering::Acquire,
    write_fence: Ordering::Release,
    write_publish: Ordering::Release,
    read_load: Ordering::Acquire,
    read_fence: Ordering::Acquire,
    flag_publish: Ordering::Release,
    flag_observe: Ordering::Acquire,
};

impl Protocol {
    /// Writer (the only one): runs `change` (relaxed stores) as one seqlock write of `seq`.
    #[inline(always)]
    pub fn write<W: Word, F: Fence, R>(&self, seq: &W, change: impl FnOnce() -> R) -> R {
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        F::fence(self.write_fence);
        let result = change();
        seq.store(s.wrapping_add(2), self.write_publish);
        result
    }

    /// One of several writers: claims `seq` and runs `change` (relaxed stores) as one seqlock
    /// write, or returns `None` without running it if another writer holds the claim.
    #[inline(always)]
    pub fn try_write<W: Word, F: Fence, R>(
        &self,
        seq: &W,
        change: impl FnOnce() -> R,
    ) -> Option<R> {
        let s = seq.load(Ordering::Relaxed);
        if s & 1 == 1 {
            return None;
        }
        if self.claim_atomically {
            seq.compare_exchange(s, s.wrapping_add(1), self.write_claim, Ordering::Relaxed)
                .ok()?;
        } else {
            seq.store(s.wrapping_add(1), Ordering::Relaxed);
        }
        F::fence(self.write_fence);
        let result = change();
        seq.store(s.wrapping_add(2), self.write_publish);
        Some(result)
    }

    /// Reader, one attempt: what `read` (relaxed loads) saw if it saw one version, else
    /// `None` (a write was under way).
    #[inline(always)]
    pub fn try_read<W: Word, F: Fence, T>(&self, seq: &W, read: impl FnOnce() -> T) -> Option<T> {
        let s1 = seq.load(self.read_load);
        if s1 & 1 == 1 {
            return None;
        }
        let seen = read();
        F::fence(self.read_fence);
        (seq.load(Ordering::Relaxed) == s1).then_some(seen)
    }

    /// Reader, in two steps for a read section that spans other work: the even sequence
    /// `seq` holds now (`None`: a write is under way); read relaxed after it...
    #[inline(always)]
    pub fn begin_read<W: Word>(&self, seq: &W) -> Option<u32> {
        let s = seq.load(self.read_load);
        (s & 1 == 0).then_some(s)
    }

    /// ...then keep what was read only if `seq` still holds `begun` (no write since).
    #[inline(always)]
    pub fn still<W: Word, F: Fence>(&self, seq: &W, begun: u32) -> bool {
        F::fence(self.read_fence);
        seq.load(Ordering::Relaxed) == begun
    }

    /// Reader: runs `read` (relaxed loads) until it saw one version, and returns what it saw.
    /// (The index's readers use [`Protocol::begin_read`] and [`Protocol::still`]; the loom
    /// models use this loop.)
    #[cfg(all(test, loom))]
    pub fn read<W: Word, F: Fence, T>(&self, seq: &W, mut read: impl FnMut() -> T) -> T {
        loop {
            let s1 = seq.load(self.read_load);
            if s1 & 1 == 1 {
                spin();
                continue;
            }
            let seen = read();
            F::fence(self.read_fence);
            if seq.load(Ordering::Relaxed) == s1 {
                return seen;
            }
        }
    }
}

/// Under the model a spinning reader must yield, or the writer would never be scheduled.
#[cfg(all(test, loom))]
fn spin() {
    loom::thread::yield_now();
}

#[cfg(all(test, loom))]
mod model {
    //! Model checks of the protocol with loom (`RUSTFLAGS="--cfg loom" cargo test -p kv-core
    //! --lib --release model`). Each model runs with [`PROTOCOL`] and must pass, and with one
    //! ordering weakened and must fail: the negative control that shows the checker would see
    //! the bug.

    use super::*;
    use loom::sync::atomic::{AtomicU32, Ordering::Relaxed};
    use loom::sync::Arc;
    use loom::thread;

    impl Word for AtomicU32 {
        fn load(&self, order: Ordering) -> u32 {
            AtomicU32::load(self, order)
        }
        fn store(&self, value: u32, order: Ordering) {
            AtomicU32::store(self, value, order)
        }
        fn compare_exchange(
            &self,
            current: u32,
            new: u32,
            success: Ordering,
            failure: Ordering,
        ) -> Result<u32, u32> {
            AtomicU32::compare_exchange(self, current, new, success, failure)
        }
    }

    struct LoomFence;

    impl Fence for LoomFence {
        fn fence(order: Ordering) {
            loom::sync::atomic::fence(order)
        }
    }

    /// A node: sequence, hash and two member words (the index's node without its hint).
    #[derive(Default)]
    struct Node {
        seq: AtomicU32,
        hash: AtomicU32,
        m0: AtomicU32,
        m1: AtomicU32,
    }

    impl Node {
        /// A node holding version `v`: hash `v`, members `v + 1`, `v + 2`.
        fn holding(v: u32) -> Arc<Self> {
            let node = Arc::new(Node::default());
            node.store_version(v);
            node
        }

        /// Relaxed stores of version `v` (inside a write, or before the node is shared).
        fn store_version(&self, v: u32) {
            self.hash.store(v, Relaxed);
            self.m0.store(v + 1, Relaxed);
            self.m1.store(v + 2, Relaxed);
        }

        /// Relaxed loads of hash and members (inside a read).
        fn load_words(&self) -> (u32, u32, u32) {
            (
                self.hash.load(Relaxed),
                self.m0.load(Relaxed),
                self.m1.load(Relaxed),
            )
        }
    }

    /// Asserts a read saw one version (`message` names the model's failure).
    fn assert_one_version((h, a, b): (u32, u32, u32), message: &str) {
        assert!(
            a == h + 1 && b == h + 2,
            "{message}: hash {h}, members {a}, {b}"
        );
    }

    /// Runs `model` under loom (every interleaving with up to 3 preemptions): `Ok` if all
    /// passed, else the first failure's message.
    fn check(model: impl Fn() + Sync + Send + 'static) -> Result<(), String> {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.check(model))).map_err(
            |payload| {
                payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            },
        )
    }

    /// The negative control's verdict: the model must fail, on its own assertion (not on a
    /// loom error).
    fn fails_with(model: impl Fn() + Sync + Send + 'static, assertion: &str) {
        match check(model) {
            Ok(()) => panic!("loom found no interleaving that breaks `{assertion}`"),
            Err(message) => assert!(
                message.contains(assertion),
                "failed for another reason: {message}"
            ),
        }
    }

    /// The writer rewrites a node (hash and both member words); the reader's kept read is
    /// exactly the old version or the new one.
    fn seqlock_model(p: Protocol) -> impl Fn() + Sync + Send + 'static {
        move || {
            let node = Node::holding(10);
            let writer = {
                let node = node.clone();
                thread::spawn(move || {
                    p.write::<_, LoomFence, _>(&node.seq, || node.store_version(20));
                })
            };
            let seen = p.read::<_, LoomFence, _>(&node.seq, || node.load_words());
            assert_one_version(seen, "torn read");
            writer.join().expect("writer");
        }
    }

    #[test]
    fn a_kept_seqlock_read_is_one_version() {
        assert_eq!(check(seqlock_model(PROTOCOL)), Ok(()));
    }

    #[test]
    fn negative_control_a_relaxed_publish_lets_a_torn_read_through() {
        let broken = Protocol {
            write_publish: Relaxed,
            ..PROTOCOL
        };
        fails_with(seqlock_model(broken), "torn read");
    }

    /// The digest memo's entries: two writers claim the same entry, each to write a version of
    /// its own; a reader makes one attempt. A kept read is one whole version, and a writer
    /// that lost the claim wrote nothing.
    fn claimed_model(p: Protocol) -> impl Fn() + Sync + Send + 'static {
        move || {
            let node = Node::holding(10);
            let writers: Vec<_> = [20u32, 30]
                .into_iter()
                .map(|v| {
                    let node = node.clone();
                    thread::spawn(move || {
                        p.try_write::<_, LoomFence, _>(&node.seq, || node.store_version(v))
                    })
                })
                .collect();
            let read = || p.try_read::<_, LoomFence, _>(&node.seq, || node.load_words());
            if let Some(seen) = read() {
                assert_one_version(seen, "torn claimed read");
            }
            for w in writers {
                w.join().expect("writer");
            }
            // Once both writers are done the entry is stable: one whole version.
            let last = read().expect("an entry no one writes reads at once");
            assert_one_version(last, "torn claimed read");
        }
    }

    #[test]
    fn a_kept_read_of_a_claimed_entry_is_one_version() {
        assert_eq!(check(claimed_model(PROTOCOL)), Ok(()));
    }

    #[test]
    fn negative_control_a_claim_by_load_and_store_lets_two_writers_tear_an_entry() {
        let broken = Protocol {
            claim_atomically: false,
            ..PROTOCOL
        };
        fails_with(claimed_model(broken), "torn claimed read");
    }

    /// Set interning: the writer fills a fresh page (relaxed, no seqlock: nothing names it
    /// yet), then names it from the node in a seqlock write. A reader that keeps a read naming
    /// the page sees the page's contents.
    fn set_model(p: Protocol) -> impl Fn() + Sync + Send + 'static {
        move || {
            let node = Arc::new(Node::default());
            let page = Arc::new([AtomicU32::new(0), AtomicU32::new(0)]);
            let writer = {
                let (node, page) = (node.clone(), page.clone());
                thread::spawn(move || {
                    page[0].store(7, Relaxed);
                    page[1].store(8, Relaxed);
                    p.write::<_, LoomFence, _>(&node.seq, || node.m0.store(1, Relaxed));
                })
            };
            let (set, first, second) = p.read::<_, LoomFence, _>(&node.seq, || {
                (
                    node.m0.load(Relaxed),
                    page[0].load(Relaxed),
                    page[1].load(Relaxed),
                )
            });
            if set == 1 {
                assert_eq!((first, second), (7, 8), "a named set's page is complete");
            }
            writer.join().expect("writer");
        }
    }

    #[test]
    fn a_set_named_by_a_kept_read_is_complete() {
        assert_eq!(check(set_model(PROTOCOL)), Ok(()));
    }

    #[test]
    fn negative_control_a_relaxed_first_load_shows_a_half_written_set() {
        let broken = Protocol {
            read_load: Relaxed,
            ..PROTOCOL
        };
        fails_with(set_model(broken), "a named set's page is complete");
    }

    /// Continuation bits (and table swaps): the writer makes node B's member words equal to
    /// node A's, then sets B's flag; a reader that sees the flag may skip reading B, so B's
    /// words must already be visible to it.
    fn flag_model(p: Protocol) -> impl Fn() + Sync + Send + 'static {
        move || {
            let b_words = Arc::new(AtomicU32::new(5));
            let flag = Arc::new(AtomicU32::new(0));
            let writer = {
                let (b_words, flag) = (b_words.clone(), flag.clone());
                thread::spawn(move || {
                    b_words.store(9, Relaxed);
                    flag.store(1, p.flag_publish);
                })
            };
            if flag.load(p.flag_observe) == 1 {
                assert_eq!(
                    b_words.load(Relaxed),
                    9,
                    "a set flag is never newer than its node"
                );
            }
            writer.join().expect("writer");
        }
    }

    #[test]
    fn a_set_flag_is_never_newer_than_its_nodes() {
        assert_eq!(check(flag_model(PROTOCOL)), Ok(()));
    }

    #[test]
    fn negative_control_a_relaxed_flag_is_caught() {
        let broken = Protocol {
            flag_publish: Relaxed,
            ..PROTOCOL
        };
        fails_with(
            flag_model(broken),
            "a set flag is never newer than its node",
        );
    }

    /// A run of the run index: its ids `start .. end` and their holder set, under a
    /// seqlock.
    #[derive(Default)]
    struct RunCell {
        seq: AtomicU32,
        start: AtomicU32,
        end: AtomicU32,
        holders: AtomicU32,
    }

    /// The order in which the run index's writer moves ids from one run to another (a split:
    /// a store joins part of a run; merges move ids the same way).
    #[derive(Clone, Copy)]
    enum Relabel {
        /// The protocol: publish the receiving run, point the ids' slots at it, then shrink
        /// the run they leave.
        ReceiverFirst,
        /// The negative control: shrink the old run before the slots point elsewhere.
        ShrinkFirst,
    }

    /// Run A holds ids 0..2 (holders 1); a store by member 2 joins id 1, which moves to run B
    /// (holders 3). A reader of id 1 reads its slot's run, then that run under its seqlock,
    /// and retries if the run no longer covers the id. It must find a covering run within
    /// two reads, with the holders of before (1) or after (3) the store.
    fn relabel_model(p: Protocol, order: Relabel) -> impl Fn() + Sync + Send + 'static {
        move || {
            let runs = Arc::new([RunCell::default(), RunCell::default()]);
            runs[0].end.store(2, Relaxed);
            runs[0].holders.store(1, Relaxed);
            let slot = Arc::new(AtomicU32::new(0));
            let writer = {
                let (runs, slot) = (runs.clone(), slot.clone());
                thread::spawn(move || {
                    let receive = || {
                        p.write::<_, LoomFence, _>(&runs[1].seq, || {
                            runs[1].start.store(1, Relaxed);
                            runs[1].end.store(2, Relaxed);
                            runs[1].holders.store(3, Relaxed);
                        })
                    };
                    let shrink = || {
                        p.write::<_, LoomFence, _>(&runs[0].seq, || runs[0].end.store(1, Relaxed))
                    };
                    match order {
                        Relabel::ReceiverFirst => {
                            receive();
                            slot.store(1, p.flag_publish);
                            shrink();
                        }
                        Relabel::ShrinkFirst => {
                            receive();
                            shrink();
                            slot.store(1, p.flag_publish);
                        }
                    }
                })
            };
            let find = || {
                let r = slot.load(p.flag_observe) as usize;
                let run = &runs[r];
                let (start, end, holders) = p.read::<_, LoomFence, _>(&run.seq, || {
                    (
                        run.start.load(Relaxed),
                        run.end.load(Relaxed),
                        run.holders.load(Relaxed),
                    )
                });
                (start <= 1 && 1 < end).then_some(holders)
            };
            let found = find().or_else(find);
            assert!(
                matches!(found, Some(1) | Some(3)),
                "a reader finds its block's run within two reads: {found:?}"
            );
            writer.join().expect("writer");
        }
    }

    #[test]
    fn a_relabelled_block_is_found_in_its_old_or_new_run() {
        assert_eq!(
            check(relabel_model(PROTOCOL, Relabel::ReceiverFirst)),
            Ok(())
        );
    }

    #[test]
    fn negative_control_shrinking_the_old_run_first_loses_the_block() {
        fails_with(
            relabel_model(PROTOCOL, Relabel::ShrinkFirst),
            "a reader finds its block's run within two reads",
        );
    }
}
