//! The lab's one LRU: an ordered set of keys (block ids, block hashes) with O(1) touch, insert, remove and
//! pop-oldest (an intrusive doubly linked list over a slab, plus a key -> slot map).
//!
//! Used wherever the lab models least-recently-used order: the index benchmark's pods, the
//! `lru` cache policy of `kv-indexer replay`, the simulated pods' free-block lists and the
//! approximate routers' view of each pod. Capacity is the caller's business: it decides when
//! to [`LruSet::pop_oldest`].

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

const NIL: usize = usize::MAX;
/// Slot 0 is the sentinel of the circular list.
const SENTINEL: usize = 0;

#[derive(Debug, Clone, Copy)]
struct Slot<K> {
    key: K,
    prev: usize,
    next: usize,
}

/// An LRU-ordered set of keys (`S`: how keys are hashed; keys that are already well mixed,
/// like block hashes, can use a cheaper hasher than the default).
#[derive(Debug, Clone)]
pub struct LruSet<K = u64, S = RandomState> {
    slot_of: HashMap<K, usize, S>,
    slots: Vec<Slot<K>>,
    free: Vec<usize>,
}

impl<K: Copy + Eq + Hash + Default> Default for LruSet<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Eq + Hash + Default> LruSet<K> {
    /// An empty set.
    pub fn new() -> Self {
        Self::with_hasher(RandomState::new())
    }
}

impl<K: Copy + Eq + Hash + Default, S: BuildHasher> LruSet<K, S> {
    /// An empty set whose keys are hashed by `hasher`.
    pub fn with_hasher(hasher: S) -> Self {
        Self {
            slot_of: HashMap::with_hasher(hasher),
            slots: vec![Slot {
                key: K::default(),
                prev: SENTINEL,
                next: SENTINEL,
            }],
            free: Vec::new(),
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    /// Whether `key` is held (does not change the order).
    pub fn contains(&self, key: K) -> bool {
        self.slot_of.contains_key(&key)
    }

    fn unlink(&mut self, i: usize) {
        let Slot { prev, next, .. } = self.slots[i];
        self.slots[prev].next = next;
        self.slots[next].prev = prev;
    }

    fn push_newest(&mut self, i: usize) {
        let last = self.slots[SENTINEL].prev;
        self.slots[i].prev = last;
        self.slots[i].next = SENTINEL;
        self.slots[last].next = i;
        self.slots[SENTINEL].prev = i;
    }

    /// Makes `key` the most recent; false (and no change) when it is not held.
    pub fn touch(&mut self, key: K) -> bool {
        match self.slot_of.get(&key) {
            Some(&i) => {
                self.unlink(i);
                self.push_newest(i);
                true
            }
            None => false,
        }
    }

    /// Inserts `key` as the most recent, or makes it the most recent if held.
    pub fn insert(&mut self, key: K) {
        if self.touch(key) {
            return;
        }
        let slot = Slot {
            key,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(key, i);
        self.push_newest(i);
    }

    /// Removes `key`; false when it was not held.
    pub fn remove(&mut self, key: K) -> bool {
        match self.slot_of.remove(&key) {
            Some(i) => {
                self.unlink(i);
                self.free.push(i);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the least recent key.
    pub fn pop_oldest(&mut self) -> Option<K> {
        let first = self.slots[SENTINEL].next;
        if first == SENTINEL {
            return None;
        }
        let key = self.slots[first].key;
        self.remove(key);
        Some(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_follows_use() {
        let mut lru: LruSet = LruSet::new();
        for k in [1, 2, 3] {
            lru.insert(k);
        }
        assert!(lru.touch(1));
        assert!(!lru.touch(9));
        lru.insert(2); // re-insert = touch
        assert_eq!(lru.len(), 3);
        assert_eq!(lru.pop_oldest(), Some(3));
        assert!(lru.remove(1));
        assert!(!lru.remove(1));
        lru.insert(4);
        assert_eq!(lru.pop_oldest(), Some(2));
        assert_eq!(lru.pop_oldest(), Some(4));
        assert_eq!(lru.pop_oldest(), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn slots_are_reused() {
        let mut lru: LruSet = LruSet::new();
        for round in 0..100u64 {
            lru.insert(round);
            if lru.len() > 4 {
                lru.pop_oldest();
            }
        }
        assert_eq!(lru.len(), 4);
        assert!(lru.slots.len() <= 6, "{} slots", lru.slots.len());
        assert!((96..100).all(|k| lru.contains(k)));
    }
}
