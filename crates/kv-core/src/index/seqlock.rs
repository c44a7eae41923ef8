//! The publication protocol between the index's one writer and its lock-free readers, written
//! once, generic over the atomics, so that the model check (`loom`, under `cfg(loom)`) runs the
//! code the index runs, and a deliberately broken variant shows the check can fail.
//!
//! Two primitives:
//! - **Seqlock** (every node: hash and member words). The writer makes the sequence odd,
//!   fences (Release), changes the data with relaxed stores, and publishes the next even
//!   sequence with a Release store. A reader loads the sequence (Acquire), reads the data
//!   relaxed, fences (Acquire), and keeps the read only if the sequence is unchanged and even.
//!   A kept read is one version of the node, never a mix of two, and never older than the
//!   sequence it saw. Anything the writer stored before the write (a fresh set's pages, the
//!   largest-set bound) is visible to a reader that keeps the read.
//! - **Flag after data** (continuation bits; a rebuilt table). The data is complete before a
//!   Release store of the flag; a reader that loads the flag with Acquire sees that data.
//!   ([`arc_swap`] gives a table swap the same store/load semantics.)

use std::sync::atomic::Ordering;

/// A 32-bit atomic word (the std one in the index, loom's in the model).
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u32;
    fn store(&self, value: u32, order: Ordering);
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

    /// Reader: runs `read` (relaxed loads) until it saw one version, and returns what it saw.
    #[inline(always)]
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

#[cfg(not(loom))]
#[inline(always)]
fn spin() {
    std::hint::spin_loop();
}

/// Under the model a spinning reader must yield, or the writer would never be scheduled.
#[cfg(loom)]
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
            let node = Arc::new(Node::default());
            node.hash.store(10, Relaxed);
            node.m0.store(11, Relaxed);
            node.m1.store(12, Relaxed);
            let writer = {
                let node = node.clone();
                thread::spawn(move || {
                    p.write::<_, LoomFence, _>(&node.seq, || {
                        node.hash.store(20, Relaxed);
                        node.m0.store(21, Relaxed);
                        node.m1.store(22, Relaxed);
                    });
                })
            };
            let (h, a, b) = p.read::<_, LoomFence, _>(&node.seq, || {
                (
                    node.hash.load(Relaxed),
                    node.m0.load(Relaxed),
                    node.m1.load(Relaxed),
                )
            });
            assert!(
                a == h + 1 && b == h + 2,
                "torn read: hash {h}, members {a}, {b}"
            );
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
}
