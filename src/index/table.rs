//! The hash -> node table: open addressing with linear probing over `AtomicU64` slots, read
//! without locks, written by the index's single writer.
//!
//! A slot is `0` (empty), `1` (tombstone) or `tag << 32 | (node_id + 2)`, the tag being 32 bits
//! of the mixed block hash. Slots carry no full key: a tag match is confirmed against the node's
//! hash, which the reader reads anyway. 8 bytes per slot.
//!
//! Invariants: the writer never moves an entry (deletes leave tombstones), so a concurrent reader
//! can miss only an entry inserted after it looked, never an old one; the table is rebuilt into a
//! new allocation (published through `ArcSwap`) before empty slots run out, so every probe ends.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = 1;

/// Mixes a block hash with the per-index seed. Block hashes are SHA-256 output, but events come
/// off the network: the seed keeps a crafted stream from aiming at one probe sequence.
#[inline(always)]
pub fn mix(hash: u64, seed: u64) -> u64 {
    let x = (hash ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// One published version of the table.
pub struct Table {
    slots: Box<[AtomicU64]>,
    mask: usize,
    seed: u64,
}

impl Table {
    /// An empty table with `capacity` (a power of two, at least 16) slots.
    pub fn with_capacity(capacity: usize, seed: u64) -> Self {
        let capacity = capacity.next_power_of_two().max(16);
        Self {
            slots: (0..capacity).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: capacity - 1,
            seed,
        }
    }

    /// Slot count.
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Bytes of slot storage.
    pub fn allocated_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<AtomicU64>()
    }

    /// The node holding `hash`, if any. `hash_of(id)` reads a node's current hash.
    #[inline(always)]
    pub fn find(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Option<u32> {
        let mixed = mix(hash, self.seed);
        let tag = mixed >> 32;
        let mut pos = mixed as usize & self.mask;
        for _ in 0..=self.mask {
            let slot = self.slots[pos].load(Ordering::Acquire);
            if slot == EMPTY {
                return None;
            }
            if slot != TOMBSTONE && slot >> 32 == tag {
                let id = (slot as u32).wrapping_sub(2);
                if hash_of(id) == hash {
                    return Some(id);
                }
            }
            pos = (pos + 1) & self.mask;
        }
        None
    }

    /// Writer: records `hash -> id` (the caller knows `hash` is absent). Returns whether it
    /// reused a tombstone.
    pub fn insert(&self, hash: u64, id: u32) -> bool {
        let mixed = mix(hash, self.seed);
        let entry = (mixed >> 32) << 32 | (id as u64 + 2);
        let mut pos = mixed as usize & self.mask;
        loop {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY || slot == TOMBSTONE {
                self.slots[pos].store(entry, Ordering::Release);
                return slot == TOMBSTONE;
            }
            pos = (pos + 1) & self.mask;
        }
    }

    /// Writer: removes the entry `hash -> id`; returns whether it was present.
    pub fn remove(&self, hash: u64, id: u32) -> bool {
        let mixed = mix(hash, self.seed);
        let entry = (mixed >> 32) << 32 | (id as u64 + 2);
        let mut pos = mixed as usize & self.mask;
        for _ in 0..=self.mask {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                return false;
            }
            if slot == entry {
                self.slots[pos].store(TOMBSTONE, Ordering::Release);
                return true;
            }
            pos = (pos + 1) & self.mask;
        }
        false
    }

    /// Writer: every live node id (for a rebuild).
    pub fn live_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().filter_map(|s| {
            let slot = s.load(Ordering::Relaxed);
            (slot != EMPTY && slot != TOMBSTONE).then(|| (slot as u32).wrapping_sub(2))
        })
    }

    /// The seed this table mixes with.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_with_tombstones() {
        let t = Table::with_capacity(16, 7);
        let hashes: Vec<u64> = (1..=10).map(|i| i * 0x1234_5678_9abc).collect();
        for (id, &h) in hashes.iter().enumerate() {
            t.insert(h, id as u32);
        }
        let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
        for (id, &h) in hashes.iter().enumerate() {
            assert_eq!(t.find(h, hash_of), Some(id as u32));
        }
        assert!(t.remove(hashes[3], 3));
        assert_eq!(t.find(hashes[3], hash_of), None);
        for (id, &h) in hashes.iter().enumerate().filter(|(i, _)| *i != 3) {
            assert_eq!(
                t.find(h, hash_of),
                Some(id as u32),
                "entries past a tombstone stay"
            );
        }
        assert_eq!(t.live_ids().count(), 9);
    }
}
