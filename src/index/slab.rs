//! Storage for the index's nodes (one per distinct block) and their overflow member pages.
//!
//! Memory is a directory of fixed-size chunks allocated on first use and never moved or freed
//! while the index lives, so a reader can hold a node reference without any lock. Every field is
//! an atomic: the single writer mutates with relaxed stores inside a per-node seqlock, readers
//! load relaxed and validate with the node's sequence number (Boehm's seqlock recipe).
//!
//! Node layout (32 bytes, two per cache line): sequence, child hint, block hash, three inline
//! members, overflow page link. A member is `engine_id << 8 | tier`; [`EMPTY`] ends the list.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

/// An unused member slot (also never a valid member: engine ids stop below 2^24 - 1).
pub const EMPTY: u32 = u32::MAX;
/// Members stored in the node itself.
pub const INLINE_MEMBERS: usize = 3;
/// Members per overflow page.
pub const PAGE_MEMBERS: usize = 7;
/// The most members one node may hold (the `podCacheSize` upper bound).
pub const MAX_MEMBERS: usize = 64;
/// Pages a reader follows at most (bounds a walk over a page chain being rewritten).
const MAX_PAGES: usize = MAX_MEMBERS.div_ceil(PAGE_MEMBERS);

/// One distinct block: its hash, who holds it, and a hint to its most recently stored child.
#[repr(C, align(32))]
#[derive(Default)]
pub struct Node {
    /// Seqlock sequence: odd while the writer changes `hash`, `members` or `more`.
    seq: AtomicU32,
    /// `child id + 1` of the block stored after this one most recently; 0 = none. A hint only:
    /// readers verify the child's hash, so it is written without the seqlock.
    hint: AtomicU32,
    /// The block hash (event form); 0 for a free node.
    hash: AtomicU64,
    /// The first members, `EMPTY`-terminated.
    members: [AtomicU32; INLINE_MEMBERS],
    /// `page id + 1` of the first overflow page; 0 = none.
    more: AtomicU32,
}

/// Members beyond the inline ones, chained.
#[repr(C, align(32))]
#[derive(Default)]
pub struct Page {
    members: [AtomicU32; PAGE_MEMBERS],
    /// `page id + 1` of the next page; 0 = none.
    next: AtomicU32,
}

/// A directory of lazily allocated chunks of `T`, addressed by `u32` ids.
pub struct Chunked<T> {
    chunks: Box<[OnceLock<Box<[T]>>]>,
}

const CHUNK_BITS: u32 = 14;
const CHUNK: usize = 1 << CHUNK_BITS;

impl<T: Default> Chunked<T> {
    /// A directory able to hold `capacity` items.
    pub fn new(capacity: usize) -> Self {
        let n = capacity.div_ceil(CHUNK).max(1);
        Self {
            chunks: (0..n).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The item, if its chunk exists (readers; never allocates).
    #[inline(always)]
    pub fn get(&self, id: u32) -> Option<&T> {
        let chunk = self.chunks.get((id >> CHUNK_BITS) as usize)?.get()?;
        chunk.get(id as usize & (CHUNK - 1))
    }

    /// The item, allocating its chunk if needed (the writer). `None` past the directory's end.
    pub fn get_or_alloc(&self, id: u32) -> Option<&T> {
        let chunk = self
            .chunks
            .get((id >> CHUNK_BITS) as usize)?
            .get_or_init(|| (0..CHUNK).map(|_| T::default()).collect());
        chunk.get(id as usize & (CHUNK - 1))
    }

    /// Bytes held from the allocator (allocated chunks plus the directory).
    pub fn allocated_bytes(&self) -> usize {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        chunks * CHUNK * std::mem::size_of::<T>()
            + self.chunks.len() * std::mem::size_of::<OnceLock<Box<[T]>>>()
    }

    /// How many ids the directory can address.
    pub fn capacity(&self) -> usize {
        self.chunks.len() * CHUNK
    }
}

/// Nodes plus their overflow pages.
pub struct Slab {
    /// One node per distinct block.
    pub nodes: Chunked<Node>,
    /// Overflow member pages.
    pub pages: Chunked<Page>,
}

impl Slab {
    /// A slab for up to `max_nodes` nodes, each with up to `max_members` members.
    pub fn new(max_nodes: usize, max_members: usize) -> Self {
        let pages_per_node = max_members
            .saturating_sub(INLINE_MEMBERS)
            .div_ceil(PAGE_MEMBERS);
        // Overflow is rare; the directory is sized for the worst case but chunks are lazy.
        let max_pages = (max_nodes.saturating_mul(pages_per_node)).min(u32::MAX as usize - 1);
        Self {
            nodes: Chunked::new(max_nodes),
            pages: Chunked::new(max_pages.max(1)),
        }
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

    /// Reader: copies node `id`'s members into `out` if the node still holds `hash`; returns the
    /// member count, or `None` when the node no longer holds that block. Consistent: the copy is
    /// one version of the member list, never a mix of two.
    #[inline]
    pub fn read_members(&self, id: u32, hash: u64, out: &mut [u32; MAX_MEMBERS]) -> Option<usize> {
        let node = self.nodes.get(id)?;
        loop {
            let s1 = node.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let current = node.hash.load(Ordering::Relaxed);
            let mut n = 0;
            if current == hash {
                n = self.copy_members(node, out);
            }
            fence(Ordering::Acquire);
            if node.seq.load(Ordering::Relaxed) == s1 {
                return (current == hash).then_some(n);
            }
        }
    }

    /// Copies the member list (reader or writer); bounded even on a list being rewritten.
    #[inline(always)]
    fn copy_members(&self, node: &Node, out: &mut [u32; MAX_MEMBERS]) -> usize {
        let mut n = 0;
        for slot in &node.members {
            let m = slot.load(Ordering::Relaxed);
            if m == EMPTY {
                return n;
            }
            out[n] = m;
            n += 1;
        }
        let mut link = node.more.load(Ordering::Relaxed);
        let mut pages = 0;
        while link != 0 && pages < MAX_PAGES {
            let Some(page) = self.pages.get(link - 1) else {
                return n;
            };
            for slot in &page.members {
                let m = slot.load(Ordering::Relaxed);
                if m == EMPTY || n == MAX_MEMBERS {
                    return n;
                }
                out[n] = m;
                n += 1;
            }
            link = page.next.load(Ordering::Relaxed);
            pages += 1;
        }
        n
    }

    /// Writer: the node's hash.
    pub fn hash_of(&self, id: u32) -> u64 {
        self.peek_hash(id)
    }

    /// Writer: copies the node's member list.
    pub fn members_of(&self, id: u32, out: &mut [u32; MAX_MEMBERS]) -> usize {
        self.nodes
            .get(id)
            .map_or(0, |node| self.copy_members(node, out))
    }

    /// Writer: sets the child hint of `parent` to `child`.
    pub fn set_hint(&self, parent: u32, child: u32) {
        if let Some(node) = self.nodes.get(parent) {
            node.hint.store(child + 1, Ordering::Relaxed);
        }
    }

    /// Writer: rewrites node `id` (hash and member list) as one seqlock write. Overflow pages
    /// are taken from / returned to `free_pages` (`next_page` grows the page space).
    ///
    /// Returns `false` if the page directory is exhausted (the caller caps members first, so
    /// this only happens on a misconfiguration).
    pub fn write(
        &self,
        id: u32,
        hash: u64,
        members: &[u32],
        free_pages: &mut Vec<u32>,
        next_page: &mut u32,
    ) -> bool {
        let Some(node) = self.nodes.get_or_alloc(id) else {
            return false;
        };
        // Pages the new list needs, reusing the node's current chain first.
        let mut chain: [u32; MAX_PAGES] = [0; MAX_PAGES];
        let mut have = 0;
        let mut link = node.more.load(Ordering::Relaxed);
        while link != 0 && have < MAX_PAGES {
            chain[have] = link - 1;
            have += 1;
            link = self
                .pages
                .get(link - 1)
                .map_or(0, |p| p.next.load(Ordering::Relaxed));
        }
        let overflow = members.len().saturating_sub(INLINE_MEMBERS);
        let need = overflow.div_ceil(PAGE_MEMBERS).min(MAX_PAGES);
        while have < need {
            let page = match free_pages.pop() {
                Some(p) => p,
                None => {
                    let p = *next_page;
                    if self.pages.get_or_alloc(p).is_none() {
                        return false;
                    }
                    *next_page += 1;
                    p
                }
            };
            chain[have] = page;
            have += 1;
        }

        let s = node.seq.load(Ordering::Relaxed);
        node.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        node.hash.store(hash, Ordering::Relaxed);
        for (i, slot) in node.members.iter().enumerate() {
            slot.store(members.get(i).copied().unwrap_or(EMPTY), Ordering::Relaxed);
        }
        node.more
            .store(if need > 0 { chain[0] + 1 } else { 0 }, Ordering::Relaxed);
        for p in 0..need {
            if let Some(page) = self.pages.get(chain[p]) {
                let base = INLINE_MEMBERS + p * PAGE_MEMBERS;
                for (i, slot) in page.members.iter().enumerate() {
                    slot.store(
                        members.get(base + i).copied().unwrap_or(EMPTY),
                        Ordering::Relaxed,
                    );
                }
                let next = if p + 1 < need { chain[p + 1] + 1 } else { 0 };
                page.next.store(next, Ordering::Relaxed);
            }
        }
        node.seq.store(s.wrapping_add(2), Ordering::Release);
        // Pages the list no longer needs go back; readers of the old version fail validation.
        free_pages.extend_from_slice(&chain[need..have]);
        if hash == 0 {
            node.hint.store(0, Ordering::Relaxed);
        }
        true
    }

    /// Bytes held from the allocator.
    pub fn allocated_bytes(&self) -> usize {
        self.nodes.allocated_bytes() + self.pages.allocated_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_is_half_a_cache_line() {
        assert_eq!(std::mem::size_of::<Node>(), 32);
        assert_eq!(std::mem::size_of::<Page>(), 32);
    }

    #[test]
    fn members_round_trip_through_pages_and_pages_are_recycled() {
        let slab = Slab::new(100, MAX_MEMBERS);
        let (mut free, mut next) = (Vec::new(), 0);
        let many: Vec<u32> = (0..20).map(|i| i << 8).collect();
        assert!(slab.write(5, 42, &many, &mut free, &mut next));
        let mut out = [0; MAX_MEMBERS];
        assert_eq!(slab.read_members(5, 42, &mut out), Some(20));
        assert_eq!(&out[..20], &many[..]);
        assert_eq!(slab.read_members(5, 43, &mut out), None, "other hash");
        assert_eq!(next, 3, "17 overflow members need 3 pages");
        assert!(slab.write(5, 42, &many[..2], &mut free, &mut next));
        assert_eq!(free.len(), 3, "shrinking returns the pages");
        assert_eq!(slab.read_members(5, 42, &mut out), Some(2));
    }
}
