//! The hash -> block id table: open addressing with linear probing over `AtomicU64` slots, read
//! without locks, written by the index's single writer.
//!
//! A slot is `0` (empty), `1` (tombstone) or `tag << 32 | (id + 2)`, the tag being the low
//! 32 bits of the mixed block hash, from which the home slot is also derived. Slots carry no
//! full key: a tag match is confirmed against the id slot's hash, which the reader reads anyway.
//! Because the tag determines the home slot, a rebuild re-places entries without reading any
//! id slot. 8 bytes per slot.
//!
//! The capacity is any size (not a power of two): a slot is chosen by multiply-shift range
//! reduction, so a rebuild can size the table to 1.5x its live entries instead of rounding up to
//! the next power of two (which costs up to 2x the memory).
//!
//! Invariants: the writer never moves an entry (deletes leave tombstones), so a concurrent reader
//! can miss only an entry inserted after it looked, never an old one; the table is rebuilt into a
//! new allocation (published through `ArcSwap`) before empty slots run out, so every probe ends.
//! A slot is stored after the id slot it names is written ("flag after data", `seqlock`).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::seqlock::PROTOCOL;

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = 1;

/// Mixes a block hash with the per-index seed. Block hashes are SHA-256 output, but events come
/// off the network: the seed keeps a crafted stream from aiming at one probe sequence.
#[inline(always)]
pub fn mix(hash: u64, seed: u64) -> u64 {
    let x = (hash ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// The slot naming `id` under `tag` (see the module docs).
#[inline(always)]
fn entry(tag: u32, id: u32) -> u64 {
    (tag as u64) << 32 | (id as u64 + 2)
}

/// The id a live slot names.
#[inline(always)]
fn id_of(slot: u64) -> u32 {
    (slot as u32).wrapping_sub(2)
}

/// Where an absent hash goes in a [`Table`] ([`Table::find_or_vacancy`]).
#[derive(Debug, Clone, Copy)]
pub struct Vacancy {
    pos: usize,
    tag: u32,
    tombstone: bool,
}

/// One published version of the table.
pub struct Table {
    slots: Box<[AtomicU64]>,
    seed: u64,
}

impl Table {
    /// An empty table with `capacity` (at least 16) slots.
    pub fn with_capacity(capacity: usize, seed: u64) -> Self {
        let capacity = capacity.max(16);
        // EMPTY is 0: a zeroed allocation is an empty table.
        let slots = crate::memory::zeroed_slice(capacity);
        // Inserts land at random: every page is written soon, so fault them in at once.
        crate::memory::prefault(&slots);
        Self { slots, seed }
    }

    /// The seed positions are mixed with (a rebuild keeps it).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Slot count.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The first slot of a tag's probe sequence: multiply-shift onto `0..capacity`.
    #[inline(always)]
    fn home(&self, tag: u32) -> usize {
        ((tag as u64 * self.slots.len() as u64) >> 32) as usize
    }

    #[inline(always)]
    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.slots.len() {
            0
        } else {
            pos + 1
        }
    }

    /// Hints the CPU to fetch `hash`'s home slot (a batch prefetches before it probes).
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        let pos = self.home(mix(hash, self.seed) as u32);
        crate::memory::prefetch_read(&self.slots[pos] as *const AtomicU64 as *const u8);
    }

    /// Bytes of slot storage.
    pub fn allocated_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<AtomicU64>()
    }

    /// The block id holding `hash`, if any. `hash_of(id)` reads an id slot's current hash.
    #[inline(always)]
    pub fn find(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Option<u32> {
        let tag = mix(hash, self.seed) as u32;
        let mut pos = self.home(tag);
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(PROTOCOL.flag_observe);
            if slot == EMPTY {
                return None;
            }
            if slot != TOMBSTONE && (slot >> 32) as u32 == tag {
                let id = id_of(slot);
                if hash_of(id) == hash {
                    return Some(id);
                }
            }
            pos = self.next(pos);
        }
        None
    }

    /// Writer: the id holding `hash`, or where it would be inserted (the first tombstone or
    /// empty slot on its probe sequence): a lookup and the insert after it in one probe. The
    /// vacancy holds until the table's next write.
    #[inline(always)]
    pub fn find_or_vacancy(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Result<u32, Vacancy> {
        let tag = mix(hash, self.seed) as u32;
        let mut pos = self.home(tag);
        let mut tombstone = None;
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                break;
            }
            if slot == TOMBSTONE {
                tombstone.get_or_insert(pos);
            } else if (slot >> 32) as u32 == tag {
                let id = id_of(slot);
                if hash_of(id) == hash {
                    return Ok(id);
                }
            }
            pos = self.next(pos);
        }
        Err(Vacancy {
            pos: tombstone.unwrap_or(pos),
            tag,
            tombstone: tombstone.is_some(),
        })
    }

    /// Writer: records `id` at a vacancy [`Table::find_or_vacancy`] gave for its hash (no
    /// write since). Returns whether it reused a tombstone.
    #[inline(always)]
    pub fn insert_at(&self, vacancy: Vacancy, id: u32) -> bool {
        let entry = entry(vacancy.tag, id);
        self.slots[vacancy.pos].store(entry, PROTOCOL.flag_publish);
        vacancy.tombstone
    }

    /// Writer: records `hash -> id` (the caller knows `hash` is absent). Returns whether it
    /// reused a tombstone. (The index inserts at a vacancy; the tests insert directly.)
    #[cfg(test)]
    pub fn insert(&self, hash: u64, id: u32) -> bool {
        self.insert_entry(entry(mix(hash, self.seed) as u32, id))
    }

    fn insert_entry(&self, entry: u64) -> bool {
        let mut pos = self.home((entry >> 32) as u32);
        loop {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY || slot == TOMBSTONE {
                self.slots[pos].store(entry, PROTOCOL.flag_publish);
                return slot == TOMBSTONE;
            }
            pos = self.next(pos);
        }
    }

    /// Writer: removes the entry `hash -> id`. Returns `None` if absent, else how many slots
    /// became empty again (0 when a tombstone was left).
    ///
    /// A slot whose successor is empty ends its cluster: no probe sequence goes past it, so it
    /// (and the tombstones before it) can be emptied outright, safely for concurrent readers.
    pub fn remove(&self, hash: u64, id: u32) -> Option<usize> {
        let entry = entry(mix(hash, self.seed) as u32, id);
        let mut pos = self.home((entry >> 32) as u32);
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                return None;
            }
            if slot == entry {
                if self.slots[self.next(pos)].load(Ordering::Relaxed) != EMPTY {
                    self.slots[pos].store(TOMBSTONE, PROTOCOL.flag_publish);
                    return Some(0);
                }
                let mut freed = 0;
                loop {
                    self.slots[pos].store(EMPTY, PROTOCOL.flag_publish);
                    freed += 1;
                    pos = if pos == 0 {
                        self.slots.len() - 1
                    } else {
                        pos - 1
                    };
                    if self.slots[pos].load(Ordering::Relaxed) != TOMBSTONE {
                        return Some(freed);
                    }
                }
            }
            pos = self.next(pos);
        }
        None
    }

    /// Writer: copies this table's live entries into `fresh` (empty, same seed). Entries are
    /// re-placed from their tags alone, in slot order, so the copy streams through memory.
    /// Returns the number copied.
    pub fn copy_into(&self, fresh: &Table) -> usize {
        let mut live = 0;
        for s in self.slots.iter() {
            let slot = s.load(Ordering::Relaxed);
            if slot != EMPTY && slot != TOMBSTONE {
                fresh.insert_entry(slot);
                live += 1;
            }
        }
        live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_a_cluster_end_empties_it_and_the_tombstones_before() {
        // Capacity 16: craft a cluster by inserting many entries, then remove them all.
        let t = Table::with_capacity(16, 3);
        let hashes: Vec<u64> = (1..=8).map(|i| i * 0x9E37_79B9).collect();
        for (id, &h) in hashes.iter().enumerate() {
            t.insert(h, id as u32);
        }
        let mut freed = 0;
        for (id, &h) in hashes.iter().enumerate() {
            freed += t.remove(h, id as u32).expect("present");
        }
        assert_eq!(
            freed, 8,
            "every slot is empty again once the cluster is gone"
        );
        let hash_of = |_: u32| 0;
        assert_eq!(t.find(hashes[0], hash_of), None);
    }

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
        assert!(t.remove(hashes[3], 3).is_some());
        assert_eq!(t.remove(hashes[3], 3), None, "already gone");
        assert_eq!(t.find(hashes[3], hash_of), None);
        for (id, &h) in hashes.iter().enumerate().filter(|(i, _)| *i != 3) {
            assert_eq!(
                t.find(h, hash_of),
                Some(id as u32),
                "entries past a tombstone stay"
            );
        }
        let bigger = Table::with_capacity(100, 7);
        assert_eq!(t.copy_into(&bigger), 9);
        for (id, &h) in hashes.iter().enumerate().filter(|(i, _)| *i != 3) {
            assert_eq!(
                bigger.find(h, hash_of),
                Some(id as u32),
                "rebuilt keeps entries"
            );
        }
    }

    #[test]
    fn a_vacancy_is_where_insert_would_have_put_the_entry() {
        // Two tables in lockstep: one probes twice (find, then insert), the other once
        // (find_or_vacancy, then insert_at). Removals leave tombstones the insert must reuse
        // first; the slots must agree after every step.
        let (twice, once) = (Table::with_capacity(64, 9), Table::with_capacity(64, 9));
        let mut hashes: Vec<u64> = Vec::new();
        let mut live: Vec<u32> = Vec::new();
        let mut x = 0x9E37_79B9_u64;
        for _ in 0..5000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
            if live.len() < 40 && (x >> 60) < 9 {
                let (id, h) = (hashes.len() as u32, x | 1);
                assert_eq!(twice.find(h, hash_of), None);
                let vacancy = once.find_or_vacancy(h, hash_of).expect_err("absent");
                assert_eq!(twice.insert(h, id), once.insert_at(vacancy, id));
                hashes.push(h);
                live.push(id);
            } else if !live.is_empty() {
                let id = live.swap_remove((x >> 8) as usize % live.len());
                let h = hashes[id as usize];
                assert_eq!(once.find_or_vacancy(h, hash_of).ok(), Some(id));
                assert_eq!(twice.remove(h, id), once.remove(h, id));
            }
            let slots = |t: &Table| {
                t.slots
                    .iter()
                    .map(|s| s.load(Ordering::Relaxed))
                    .collect::<Vec<_>>()
            };
            assert_eq!(slots(&twice), slots(&once));
        }
    }
}
