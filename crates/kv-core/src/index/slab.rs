//! Storage for the index's nodes (one per distinct block) and their member sets.
//!
//! Memory is a directory of fixed-size chunks allocated on first use and never moved or freed
//! while the index lives, so a reader can hold a node reference without any lock. Every field is
//! an atomic: the single writer mutates with relaxed stores inside a per-node seqlock, readers
//! load relaxed and validate with the node's sequence number (Boehm's seqlock recipe; the
//! orderings live in `seqlock`, which the loom model checks).
//!
//! Node layout (24 bytes): sequence, child hint, block hash, two member words. A member is
//! `engine_id << 8 | tier` (engine ids below 2^23, so bit 31 is free). The two words hold:
//! - up to two members inline (`EMPTY` where unused), or
//! - `SET_TAG | set id` and the member count, for more than two members. Such sets are
//!   **interned**: immutable, reference-counted, stored once in 32-byte pages however many nodes
//!   share them (every block of a prefix that the same pods hold).
//!
//! So a node's two words identify its member set exactly: the scoring walk compares them with
//! the previous block's and decodes nothing while they are equal. A set has no size limit (a
//! block held by every pod of a 1,024-pod fleet is one set of 1,024 members, 147 pages, stored
//! once); readers bound a decode by the largest set the writer ever built, so a torn read of a
//! node being rewritten can neither loop nor grow a buffer past what the index really holds.
//!
//! The **continuation bitmap** goes further: bit `id` is set when node `id` is the chain child
//! of node `id - 1` and has the same member words. A run of set bits is one chain segment held
//! by one member set; because chained hashes commit to their whole prefix, the walk checks only
//! the segment's last hash (or binary-searches where the request leaves the segment) instead of
//! reading every node. The writer clears a bit before it changes either node and sets it again
//! after, so a set bit is never newer than the nodes it describes.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::memory::prefetch_read;
use crate::memory::{zeroed_slice, Zeroable};
use crate::seqlock::{StdFence, PROTOCOL};

/// An unused member word (never a valid member: engine ids stop below 2^23 - 1).
pub const EMPTY: u32 = u32::MAX;
/// Marks the first member word as an interned set id.
const SET_TAG: u32 = 1 << 31;
/// Members per set page.
pub const PAGE_MEMBERS: usize = 7;
/// Member words that no node ever holds: "no previous block" for [`Slab::read_node`].
pub const NO_WORDS: u64 = u64::MAX - 1;

/// One distinct block: its hash, who holds it, and a hint to its most recently stored child.
#[repr(C)]
#[derive(Default)]
pub struct Node {
    /// Seqlock sequence: odd while the writer changes `hash` or `members`.
    seq: AtomicU32,
    /// `child id + 1` of the block stored after this one most recently; 0 = none. A hint only:
    /// readers verify the child's hash, so it is written without the seqlock.
    hint: AtomicU32,
    /// The block hash (event form); 0 for a free node.
    hash: AtomicU64,
    /// Two inline members, or `SET_TAG | set id` and the set's size.
    members: [AtomicU32; 2],
}

// SAFETY: every field is an integer atomic; all zero is a free node (hash 0, seq 0, no hint),
// with its member words to be written before it is linked.
unsafe impl Zeroable for Node {}

/// A slice of an interned member set, chained.
#[repr(C, align(32))]
#[derive(Default)]
pub struct Page {
    members: [AtomicU32; PAGE_MEMBERS],
    /// `page id + 1` of the next page; 0 = none.
    next: AtomicU32,
}

// SAFETY: integer atomics only.
unsafe impl Zeroable for Page {}

/// A directory of lazily allocated chunks of `N` items `T` (a power of two), addressed by
/// `u32` ids. A chunk is a fixed-size array, so a masked offset needs no bounds check: an
/// access is a directory entry and the item.
///
/// Chunks are reference-counted, so a writer can keep its own handles on them
/// ([`Chunked::chunk`]) and skip the directory on its accesses.
pub struct Chunked<T, const N: usize> {
    chunks: Box<[OnceLock<Arc<[T; N]>>]>,
}

impl<T: Zeroable, const N: usize> Chunked<T, N> {
    /// Bits of an id that select its item inside a chunk.
    const BITS: u32 = {
        assert!(N.is_power_of_two(), "chunks hold a power of two items");
        N.trailing_zeros()
    };

    /// A directory able to hold `capacity` items.
    pub fn new(capacity: usize) -> Self {
        let n = capacity.div_ceil(N).max(1);
        Self {
            chunks: (0..n).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The item, if its chunk exists (readers; never allocates).
    #[inline(always)]
    pub fn get(&self, id: u32) -> Option<&T> {
        let chunk = self.chunks.get((id >> Self::BITS) as usize)?.get()?;
        Some(&chunk[id as usize & (N - 1)])
    }

    /// The items from `id` to the end of its chunk (empty if the chunk does not exist): what
    /// a reader compares in one pass.
    #[inline(always)]
    pub fn tail(&self, id: u32) -> &[T] {
        match self
            .chunks
            .get((id >> Self::BITS) as usize)
            .and_then(OnceLock::get)
        {
            Some(chunk) => &chunk[id as usize & (N - 1)..],
            None => &[],
        }
    }

    /// The item, allocating its chunk if needed (the writer). `None` past the directory's end.
    pub fn get_or_alloc(&self, id: u32) -> Option<&T> {
        let chunk = self
            .chunks
            .get((id >> Self::BITS) as usize)?
            .get_or_init(|| match Arc::<[T]>::from(zeroed_slice(N)).try_into() {
                Ok(chunk) => chunk,
                Err(_) => unreachable!("a zeroed slice of N items is an array of N"),
            });
        Some(&chunk[id as usize & (N - 1)])
    }

    /// The chunk holding `id`, if allocated: a handle for a writer that addresses it often.
    pub fn chunk(&self, id: u32) -> Option<&Arc<[T; N]>> {
        self.chunks.get((id >> Self::BITS) as usize)?.get()
    }

    /// Bytes held from the allocator (allocated chunks plus the directory).
    pub fn allocated_bytes(&self) -> usize {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        chunks * N * std::mem::size_of::<T>()
            + self.chunks.len() * std::mem::size_of::<OnceLock<Arc<[T; N]>>>()
    }

    /// How many ids the directory can address.
    pub fn capacity(&self) -> usize {
        self.chunks.len() * N
    }
}

/// What [`Slab::read_node`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRead {
    /// The node no longer holds the block.
    Gone,
    /// The member words equal the ones passed in: the same member set.
    Same,
    /// A different member set: `n` members copied out, and its words.
    Members(usize, u64),
}

/// Nodes plus interned member-set pages.
pub struct Slab {
    /// One node per distinct block, in chunks of 16Ki nodes (384 KiB).
    pub nodes: Chunked<Node, { 1 << 14 }>,
    /// Pages of interned member sets, in chunks of 4Ki pages (128 KiB).
    pub pages: Chunked<Page, { 1 << 12 }>,
    /// Continuation bits, one per node id (chunks of 256 words = 16Ki ids, like `nodes`).
    cont: Chunked<AtomicU64, { 1 << 8 }>,
    /// Members of the largest set ever interned (only grows): bounds every decode.
    largest_set: AtomicU32,
}

impl Slab {
    /// A slab for up to `max_nodes` nodes, each with up to `max_members` members.
    pub fn new(max_nodes: usize) -> Self {
        // Sets are interned and shared (a prefix held by the same pods is one set), so one page
        // per possible node is ample; if it ever runs out, the writer keeps two members inline.
        let max_pages = max_nodes.min(SET_TAG as usize - 1);
        Self {
            nodes: Chunked::new(max_nodes),
            pages: Chunked::new(max_pages.max(1)),
            cont: Chunked::new(max_nodes.div_ceil(64)),
            largest_set: AtomicU32::new(2),
        }
    }

    /// Writer: sets or clears the continuation bit of `id` (single writer: load + store).
    pub fn set_cont(&self, id: u32, on: bool) {
        if let Some(word) = self.cont.get_or_alloc(id / 64) {
            let bit = 1u64 << (id % 64);
            let w = word.load(Ordering::Relaxed);
            let new = if on { w | bit } else { w & !bit };
            if new != w {
                word.store(new, PROTOCOL.flag_publish);
            }
        }
    }

    /// Reader: how many consecutive continuation bits are set from `first` on, at most `max`.
    #[inline(always)]
    pub fn cont_run(&self, first: u32, max: usize) -> usize {
        let mut n = 0usize;
        let mut id = first as usize;
        while n < max {
            let Some(word) = self.cont.get((id / 64) as u32) else {
                break;
            };
            let shift = id % 64;
            let bits = word.load(PROTOCOL.flag_observe) >> shift;
            let ones = (!bits).trailing_zeros() as usize;
            let room = 64 - shift;
            n += ones.min(room);
            if ones < room {
                break;
            }
            id += room;
        }
        n.min(max)
    }

    /// Writer: node `id`'s member words.
    pub fn words_of(&self, id: u32) -> u64 {
        self.nodes.get(id).map_or(NO_WORDS, |node| {
            (node.members[0].load(Ordering::Relaxed) as u64) << 32
                | node.members[1].load(Ordering::Relaxed) as u64
        })
    }

    /// Reader: the hash stored in node `id` right now (unvalidated; 0 if free or absent).
    #[inline(always)]
    pub fn peek_hash(&self, id: u32) -> u64 {
        self.nodes
            .get(id)
            .map_or(0, |n| n.hash.load(Ordering::Relaxed))
    }

    /// Reader: the child hint of node `id` (unvalidated).
    #[inline(always)]
    pub fn hint(&self, id: u32) -> Option<u32> {
        let h = self.nodes.get(id)?.hint.load(Ordering::Relaxed);
        h.checked_sub(1)
    }

    /// Reader: node `id`'s member set if the node still holds `hash`, as one consistent version.
    /// When its member words equal `prev_words`, nothing is decoded ([`NodeRead::Same`]);
    /// otherwise the members replace `out`'s contents (its capacity is reused).
    #[inline(always)]
    pub fn read_node(&self, id: u32, hash: u64, prev_words: u64, out: &mut Vec<u32>) -> NodeRead {
        let Some(node) = self.nodes.get(id) else {
            return NodeRead::Gone;
        };
        PROTOCOL.read::<_, StdFence, _>(&node.seq, || {
            let current = node.hash.load(Ordering::Relaxed);
            let m0 = node.members[0].load(Ordering::Relaxed);
            let m1 = node.members[1].load(Ordering::Relaxed);
            let words = (m0 as u64) << 32 | m1 as u64;
            if current != hash {
                NodeRead::Gone
            } else if words == prev_words {
                NodeRead::Same
            } else {
                self.decode(m0, m1, out);
                NodeRead::Members(out.len(), words)
            }
        })
    }

    /// Reader: whether node `id` still holds `hash` with member words `words`, as one
    /// consistent version (decodes nothing).
    #[inline(always)]
    pub fn holds_with(&self, id: u32, hash: u64, words: u64) -> bool {
        let Some(node) = self.nodes.get(id) else {
            return false;
        };
        PROTOCOL.read::<_, StdFence, _>(&node.seq, || {
            node.hash.load(Ordering::Relaxed) == hash
                && (node.members[0].load(Ordering::Relaxed) as u64) << 32
                    | node.members[1].load(Ordering::Relaxed) as u64
                    == words
        })
    }

    /// Reader: node `id`'s members (replacing `out`'s contents) if it still holds `hash`.
    pub fn read_members(&self, id: u32, hash: u64, out: &mut Vec<u32>) -> bool {
        out.clear();
        self.read_node(id, hash, NO_WORDS, out) != NodeRead::Gone
    }

    /// Decodes member words (inline, or an interned set's pages) into `out`, replacing its
    /// contents; bounded even on a set being rewritten (the caller's seqlock check discards
    /// such a read): at most the largest set ever built, following at most that many pages.
    #[inline(always)]
    fn decode(&self, m0: u32, m1: u32, out: &mut Vec<u32>) {
        out.clear();
        if m0 == EMPTY {
            return;
        }
        if m0 & SET_TAG == 0 {
            out.push(m0);
            if m1 != EMPTY {
                out.push(m1);
            }
            return;
        }
        let count = (m1 as usize).min(self.largest_set.load(Ordering::Relaxed) as usize);
        let max_pages = count.div_ceil(PAGE_MEMBERS);
        let mut link = Some(m0 & !SET_TAG);
        let mut pages = 0;
        while let Some(id) = link {
            if pages == max_pages {
                break;
            }
            let Some(page) = self.pages.get(id) else {
                break;
            };
            for slot in &page.members {
                if out.len() == count {
                    return;
                }
                out.push(slot.load(Ordering::Relaxed));
            }
            link = page.next.load(Ordering::Relaxed).checked_sub(1);
            pages += 1;
        }
    }

    /// Hints the CPU to fetch node `id` (no effect on results).
    #[inline(always)]
    pub fn prefetch(&self, id: u32) {
        if let Some(node) = self.nodes.get(id) {
            prefetch_read(node as *const Node as *const u8);
        }
    }

    /// Writer: the node's hash.
    pub fn hash_of(&self, id: u32) -> u64 {
        self.peek_hash(id)
    }

    /// Writer: the node's member list, replacing `out`'s contents.
    pub fn members_of(&self, id: u32, out: &mut Vec<u32>) {
        out.clear();
        if let Some(node) = self.nodes.get(id) {
            let m0 = node.members[0].load(Ordering::Relaxed);
            let m1 = node.members[1].load(Ordering::Relaxed);
            self.decode(m0, m1, out);
        }
    }

    /// Writer: sets the child hint of `parent` to `child`.
    pub fn set_hint(&self, parent: u32, child: u32) {
        if let Some(node) = self.nodes.get(parent) {
            node.hint.store(child + 1, Ordering::Relaxed);
        }
    }

    /// Writer: rewrites node `id` (hash and member list) as one seqlock write, interning the
    /// list in `sets` when it has more than two members. Returns `false` if the node or page
    /// space is exhausted.
    pub fn write(&self, id: u32, hash: u64, members: &[u32], sets: &mut SetPool) -> bool {
        let Some(node) = self.nodes.get_or_alloc(id) else {
            return false;
        };
        let (m0, m1) = match members {
            [] => (EMPTY, EMPTY),
            [a] => (*a, EMPTY),
            [a, b] => (*a, *b),
            many => match sets.acquire(self, many) {
                Some(set) => (SET_TAG | set, many.len() as u32),
                None => return false,
            },
        };
        let old = node.members[0].load(Ordering::Relaxed);
        PROTOCOL.write::<_, StdFence, _>(&node.seq, || {
            node.hash.store(hash, Ordering::Relaxed);
            node.members[0].store(m0, Ordering::Relaxed);
            node.members[1].store(m1, Ordering::Relaxed);
        });
        if old != EMPTY && old & SET_TAG != 0 {
            sets.release(old & !SET_TAG);
        }
        if hash == 0 {
            node.hint.store(0, Ordering::Relaxed);
        }
        true
    }

    /// Bytes held from the allocator.
    pub fn allocated_bytes(&self) -> usize {
        self.nodes.allocated_bytes() + self.pages.allocated_bytes() + self.cont.allocated_bytes()
    }
}

/// One interned set.
struct SetEntry {
    refs: u32,
    contents: Box<[u32]>,
    pages: Box<[u32]>,
}

/// The writer's bookkeeping of interned member sets.
#[derive(Default)]
pub struct SetPool {
    // Fx hashing: keys are member words the index assigns itself, not network input.
    /// Set contents -> set id (the id of its first page).
    by_contents: HashMap<Box<[u32]>, u32>,
    /// Set id -> its references, contents and pages.
    sets: HashMap<u32, SetEntry>,
    free_pages: Vec<u32>,
    next_page: u32,
}

impl SetPool {
    /// A reference to the set holding exactly `members` (in order), creating it if needed.
    fn acquire(&mut self, slab: &Slab, members: &[u32]) -> Option<u32> {
        if let Some(&set) = self.by_contents.get(members) {
            if let Some(entry) = self.sets.get_mut(&set) {
                entry.refs += 1;
            }
            return Some(set);
        }
        let pages = members.len().div_ceil(PAGE_MEMBERS);
        let mut ids = Vec::with_capacity(pages);
        for _ in 0..pages {
            let page = match self.free_pages.pop() {
                Some(p) => p,
                None => {
                    let p = self.next_page;
                    if p >= SET_TAG - 1 || slab.pages.get_or_alloc(p).is_none() {
                        self.free_pages.extend_from_slice(&ids);
                        return None;
                    }
                    self.next_page += 1;
                    p
                }
            };
            ids.push(page);
        }
        // Fresh pages: no node points at them yet, so no reader can see these stores half-done.
        for (k, &page_id) in ids.iter().take(pages).enumerate() {
            let page = slab.pages.get(page_id)?;
            for (i, slot) in page.members.iter().enumerate() {
                let m = members.get(k * PAGE_MEMBERS + i).copied().unwrap_or(EMPTY);
                slot.store(m, Ordering::Relaxed);
            }
            let next = if k + 1 < pages { ids[k + 1] + 1 } else { 0 };
            page.next.store(next, Ordering::Relaxed);
        }
        let set = ids[0];
        // Published before any node names the set: a reader that sees the set id sees a bound
        // that covers it (the node's seqlock write releases after this store).
        slab.largest_set
            .fetch_max(members.len() as u32, Ordering::Relaxed);
        self.by_contents.insert(members.into(), set);
        self.sets.insert(
            set,
            SetEntry {
                refs: 1,
                contents: members.into(),
                pages: ids.into(),
            },
        );
        Some(set)
    }

    /// Drops a reference; the last one frees the set's pages.
    fn release(&mut self, set: u32) {
        let Some(entry) = self.sets.get_mut(&set) else {
            return;
        };
        entry.refs -= 1;
        if entry.refs > 0 {
            return;
        }
        if let Some(entry) = self.sets.remove(&set) {
            self.by_contents.remove(&entry.contents);
            self.free_pages.extend_from_slice(&entry.pages);
        }
    }

    /// Distinct interned sets (for stats).
    pub fn set_count(&self) -> usize {
        self.sets.len()
    }

    /// Bytes of the writer's bookkeeping (approximate: map entries and contents).
    pub fn bookkeeping_bytes(&self) -> usize {
        self.sets
            .values()
            .map(|e| 2 * e.contents.len() * 4 + e.pages.len() * 4 + 96)
            .sum::<usize>()
            + self.free_pages.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 24);
        assert_eq!(std::mem::size_of::<Page>(), 32);
    }

    #[test]
    fn sets_are_interned_shared_and_freed() {
        let slab = Slab::new(100);
        let mut pool = SetPool::default();
        let many: Vec<u32> = (0..20).map(|i| i << 8).collect();
        assert!(slab.write(5, 42, &many, &mut pool));
        assert!(slab.write(6, 43, &many, &mut pool));
        assert_eq!(pool.set_count(), 1, "one set for two nodes");
        assert_eq!(pool.next_page, 3, "20 members need 3 pages, once");
        let mut out = Vec::new();
        assert!(slab.read_members(5, 42, &mut out));
        assert_eq!(out, many);
        assert!(!slab.read_members(5, 43, &mut out), "other hash");
        let words = match slab.read_node(5, 42, NO_WORDS, &mut out) {
            NodeRead::Members(20, w) => w,
            other => panic!("{other:?}"),
        };
        assert_eq!(slab.read_node(6, 43, words, &mut out), NodeRead::Same);
        assert!(slab.holds_with(6, 43, words));
        assert!(!slab.holds_with(6, 42, words), "other hash");
        assert!(slab.write(5, 42, &many[..2], &mut pool));
        assert_eq!(pool.set_count(), 1, "node 6 still references the set");
        assert!(slab.write(6, 43, &many[..1], &mut pool));
        assert_eq!(pool.set_count(), 0);
        assert_eq!(
            pool.free_pages.len(),
            3,
            "the last reference frees the pages"
        );
        assert!(slab.read_members(6, 43, &mut out));
        assert_eq!(out, many[..1]);
    }

    #[test]
    fn a_set_of_any_size_round_trips() {
        let slab = Slab::new(10);
        let mut pool = SetPool::default();
        let all: Vec<u32> = (0..1500).map(|i| i << 8 | (i % 2)).collect();
        assert!(slab.write(1, 7, &all, &mut pool));
        let mut out = Vec::new();
        assert!(slab.read_members(1, 7, &mut out));
        assert_eq!(out, all, "1,500 members, every one back in order");
        assert_eq!(pool.next_page as usize, 1500usize.div_ceil(PAGE_MEMBERS));
    }
}
