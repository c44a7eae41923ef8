//! The hash -> block id table: open addressing with linear probing over `AtomicU64` slots, read
//! without locks, written by the index's single writer.
//!
//! A slot is `0` (empty) or `tag << 32 | (id + 2)`, the tag being the low 32 bits of the mixed
//! block hash, from which the home slot is also derived. Slots carry no full key: a tag match
//! is confirmed against the id slot's hash, which the reader reads anyway. Because the tag
//! determines the home slot, a rebuild re-places entries without reading any id slot. 8 bytes
//! per slot.
//!
//! The capacity is any size (not a power of two): a slot is chosen by multiply-shift range
//! reduction, so a rebuild can size the table to its live entries instead of rounding up to
//! the next power of two (which costs up to 2x the memory).
//!
//! Deletion leaves no tombstone: the entries after the emptied slot whose probe sequences pass
//! it move back (backward shift), so a probe's length follows the live entries alone, and a
//! table that churns at a steady size never needs a rebuild. (Tombstones made a miss probe about
//! six slots at 16 pods, where the live load alone gives two, and a rebuild every time they
//! piled up.)
//!
//! Invariants: every live entry is reachable from its home slot without crossing an empty
//! slot; the table is rebuilt into a new allocation (published through `ArcSwap`) before empty
//! slots run out, so every probe ends. A slot is stored after the id slot it names is written
//! ("flag after data", `seqlock`).
//!
//! Readers: an insert never moves an entry, and a deletion that moves entries does so inside one
//! seqlock write of the table's `moves` sequence. A reader trusts a hit at once (the caller
//! confirms it against the id slot, under the run's seqlock) and a miss only if no move began or
//! ended while it probed ([`Moved`] otherwise: probe again), so a reader can miss only an entry
//! inserted after it looked, never one that was there all along.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::seqlock::{StdFence, PROTOCOL};

const EMPTY: u64 = 0;

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
}

/// A reader's probe missed while the writer was moving entries back after a deletion: the miss
/// proves nothing, probe again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved;

/// One published version of the table.
pub struct Table {
    slots: Box<[AtomicU64]>,
    /// The seqlock sequence of entry moves (odd while a deletion moves entries back).
    moves: AtomicU32,
    seed: u64,
}

impl Table {
    /// An empty table with `capacity` (at least 16) slots.
    pub fn with_capacity(capacity: usize, seed: u64) -> Self {
        let capacity = capacity.max(16);
        // EMPTY is 0: a zeroed allocation is an empty table.
        let slots = crate::memory::zeroed_slice(capacity);
        // Inserts land at random: every page is written soon, so fault them in at once. No
        // huge-page hint: on a growing table it cost more kernel time than it saved
        // (crate::memory has the figures).
        crate::memory::prefault(&slots);
        Self {
            slots,
            moves: AtomicU32::new(0),
            seed,
        }
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

    /// Hints the CPU to fetch `hash`'s home slot and the cache line after it (a batch
    /// prefetches before it probes): a probe starting in a line's last slots goes on into the
    /// next line (two lines fetched: 12% more block-ops per CPU-second at 16 pods than one).
    #[inline(always)]
    pub fn prefetch(&self, hash: u64) {
        let pos = self.home(mix(hash, self.seed) as u32);
        crate::memory::prefetch_read(&self.slots[pos] as *const AtomicU64 as *const u8);
        let ahead = (pos + 7).min(self.slots.len() - 1);
        crate::memory::prefetch_read(&self.slots[ahead] as *const AtomicU64 as *const u8);
    }

    /// Bytes of slot storage.
    pub fn allocated_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<AtomicU64>()
    }

    /// Reader: the block id holding `hash`, if any; [`Moved`] when it missed while entries
    /// were moving (see the module docs). `hash_of(id)` reads an id slot's current hash.
    #[inline(always)]
    pub fn find(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Result<Option<u32>, Moved> {
        let begun = PROTOCOL.begin_read(&self.moves);
        let tag = mix(hash, self.seed) as u32;
        let mut pos = self.home(tag);
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(PROTOCOL.flag_observe);
            if slot == EMPTY {
                break;
            }
            if (slot >> 32) as u32 == tag {
                let id = id_of(slot);
                if hash_of(id) == hash {
                    return Ok(Some(id));
                }
            }
            pos = self.next(pos);
        }
        match begun {
            Some(s) if PROTOCOL.still::<_, StdFence>(&self.moves, s) => Ok(None),
            _ => Err(Moved),
        }
    }

    /// Whether no deletion is moving entries now (a reader's [`Moved`] probe waits for it).
    #[inline]
    pub fn settled(&self) -> bool {
        PROTOCOL.begin_read(&self.moves).is_some()
    }

    /// Writer: the id holding `hash`, or where it would be inserted (the empty slot that ends
    /// its probe sequence): a lookup and the insert after it in one probe. The vacancy holds
    /// until the table's next write.
    #[inline(always)]
    pub fn find_or_vacancy(&self, hash: u64, hash_of: impl Fn(u32) -> u64) -> Result<u32, Vacancy> {
        let tag = mix(hash, self.seed) as u32;
        let mut pos = self.home(tag);
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                break;
            }
            if (slot >> 32) as u32 == tag {
                let id = id_of(slot);
                if hash_of(id) == hash {
                    return Ok(id);
                }
            }
            pos = self.next(pos);
        }
        Err(Vacancy { pos, tag })
    }

    /// Writer: records `id` at a vacancy [`Table::find_or_vacancy`] gave for its hash (no
    /// write since).
    #[inline(always)]
    pub fn insert_at(&self, vacancy: Vacancy, id: u32) {
        self.slots[vacancy.pos].store(entry(vacancy.tag, id), PROTOCOL.flag_publish);
    }

    /// Writer: records `hash -> id` (the caller knows `hash` is absent). (The index inserts at
    /// a vacancy; the tests insert directly.)
    #[cfg(test)]
    pub fn insert(&self, hash: u64, id: u32) {
        self.insert_entry(entry(mix(hash, self.seed) as u32, id));
    }

    fn insert_entry(&self, entry: u64) {
        let mut pos = self.home((entry >> 32) as u32);
        while self.slots[pos].load(Ordering::Relaxed) != EMPTY {
            pos = self.next(pos);
        }
        self.slots[pos].store(entry, PROTOCOL.flag_publish);
    }

    /// Writer: removes the entry `hash -> id`. Returns whether it was there.
    pub fn remove(&self, hash: u64, id: u32) -> bool {
        let entry = entry(mix(hash, self.seed) as u32, id);
        let mut pos = self.home((entry >> 32) as u32);
        for _ in 0..self.slots.len() {
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                return false;
            }
            if slot == entry {
                self.vacate(pos);
                return true;
            }
            pos = self.next(pos);
        }
        false
    }

    /// Whether the entry `slot` at `pos` must stay where it is when `hole` (before it in its
    /// cluster) empties: its home lies cyclically in `hole + 1 ..= pos`.
    #[inline(always)]
    fn stays(&self, hole: usize, pos: usize, slot: u64) -> bool {
        let home = self.home((slot >> 32) as u32);
        if hole <= pos {
            hole < home && home <= pos
        } else {
            hole < home || home <= pos
        }
    }

    /// Empties slot `hole` (a live entry's), moving back each later entry of its cluster whose
    /// probe sequence passes the hole. The moves, if any, are one seqlock write of `moves`; a
    /// hole no entry needs is emptied without one (no probe passes it).
    fn vacate(&self, hole: usize) {
        let mut pos = hole;
        let first = loop {
            pos = self.next(pos);
            let slot = self.slots[pos].load(Ordering::Relaxed);
            if slot == EMPTY {
                break None;
            }
            if !self.stays(hole, pos, slot) {
                break Some((pos, slot));
            }
        };
        let Some((mut pos, mut slot)) = first else {
            self.slots[hole].store(EMPTY, PROTOCOL.flag_publish);
            return;
        };
        PROTOCOL.write::<_, StdFence, _>(&self.moves, || {
            let mut hole = hole;
            loop {
                if !self.stays(hole, pos, slot) {
                    self.slots[hole].store(slot, PROTOCOL.flag_publish);
                    hole = pos;
                }
                pos = self.next(pos);
                slot = self.slots[pos].load(Ordering::Relaxed);
                if slot == EMPTY {
                    break;
                }
            }
            self.slots[hole].store(EMPTY, PROTOCOL.flag_publish);
        });
    }

    /// Writer: copies this table's live entries into `fresh` (empty, same seed). Entries are
    /// re-placed from their tags alone, in slot order, so the copy streams through memory.
    /// Returns the number copied.
    pub fn copy_into(&self, fresh: &Table) -> usize {
        let mut live = 0;
        for s in self.slots.iter() {
            let slot = s.load(Ordering::Relaxed);
            if slot != EMPTY {
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

    /// The slots as plain words.
    fn slots(t: &Table) -> Vec<u64> {
        t.slots.iter().map(|s| s.load(Ordering::Relaxed)).collect()
    }

    /// Every entry that cannot be reached from its home slot without crossing an empty slot
    /// (what a probe would miss), by position.
    fn unreachable(t: &Table) -> Vec<usize> {
        let words = slots(t);
        (0..words.len())
            .filter(|&pos| words[pos] != EMPTY)
            .filter(|&pos| {
                let mut at = t.home((words[pos] >> 32) as u32);
                while at != pos {
                    if words[at] == EMPTY {
                        return true;
                    }
                    at = t.next(at);
                }
                false
            })
            .collect()
    }

    /// A pseudo-random sequence (an LCG's high bits).
    fn lcg(x: &mut u64) -> u64 {
        *x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x >> 11
    }

    #[test]
    fn entries_stay_reachable_through_inserts_and_removals_that_move_them_back() {
        // A small table near its bound, so clusters are long and wrap past the last slot.
        for capacity in [16, 64] {
            let t = Table::with_capacity(capacity, 3);
            let mut hashes: Vec<u64> = Vec::new();
            let mut live: Vec<u32> = Vec::new();
            let mut x = capacity as u64;
            let (mut moved, mut steps) = (0, 0);
            while steps < 20_000 {
                steps += 1;
                let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
                if live.len() < capacity * 3 / 4 && lcg(&mut x) & 1 == 0 {
                    let (id, h) = (hashes.len() as u32, lcg(&mut x) | 1);
                    assert_eq!(t.find(h, hash_of), Ok(None));
                    t.insert(h, id);
                    hashes.push(h);
                    live.push(id);
                } else if !live.is_empty() {
                    let id = live.swap_remove(lcg(&mut x) as usize % live.len());
                    let before = t.moves.load(Ordering::Relaxed);
                    assert!(t.remove(hashes[id as usize], id));
                    assert!(!t.remove(hashes[id as usize], id), "already gone");
                    moved += usize::from(t.moves.load(Ordering::Relaxed) != before);
                }
                let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
                assert_eq!(unreachable(&t), Vec::<usize>::new(), "step {steps}");
                for &id in &live {
                    assert_eq!(t.find(hashes[id as usize], hash_of), Ok(Some(id)));
                }
                let used = slots(&t).iter().filter(|&&w| w != EMPTY).count();
                assert_eq!(used, live.len(), "no tombstones: one slot per live entry");
                assert!(t.settled());
            }
            assert!(moved > 100, "removals moved entries back ({moved})");
        }
    }

    #[test]
    fn a_deletion_that_only_empties_its_slot_loses_the_entries_after_it() {
        // The negative control of the test above: emptying a slot in the middle of a cluster
        // (no move back) leaves later entries unreachable, and `unreachable` says so.
        let t = Table::with_capacity(16, 5);
        let mut x = 7;
        let mut hashes: Vec<u64> = Vec::new();
        // Entries until some cluster has an entry away from its home slot.
        let displaced = loop {
            let (id, h) = (hashes.len() as u32, lcg(&mut x) | 1);
            t.insert(h, id);
            hashes.push(h);
            let words = slots(&t);
            let away = (0..16).find(|&p| words[p] != EMPTY && t.home((words[p] >> 32) as u32) != p);
            if let Some(p) = away {
                break p;
            }
        };
        let words = slots(&t);
        let home = t.home((words[displaced] >> 32) as u32);
        t.slots[home].store(EMPTY, Ordering::Relaxed);
        assert!(unreachable(&t).contains(&displaced));
        let id = id_of(words[displaced]);
        let hash_of = |i: u32| hashes.get(i as usize).copied().unwrap_or(0);
        assert_eq!(
            t.find(hashes[id as usize], hash_of),
            Ok(None),
            "a probe misses it"
        );
    }

    #[test]
    fn a_miss_while_entries_move_is_not_trusted() {
        let t = Table::with_capacity(64, 11);
        let hashes: Vec<u64> = (1..=20)
            .map(|i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
        for (id, &h) in hashes.iter().enumerate().take(10) {
            t.insert(h, id as u32);
        }
        // A deletion under way (the sequence odd): a hit is kept, a miss is not.
        t.moves.store(1, Ordering::Relaxed);
        assert!(!t.settled());
        assert_eq!(t.find(hashes[0], hash_of), Ok(Some(0)));
        assert_eq!(t.find(hashes[15], hash_of), Err(Moved));
        t.moves.store(2, Ordering::Relaxed);
        assert_eq!(t.find(hashes[15], hash_of), Ok(None));
    }

    #[test]
    fn a_reader_never_misses_an_entry_present_throughout() {
        // Entries 0..8 stay; the writer inserts and removes others around them (moving entries
        // back) while readers look the fixed ones up: a miss would be a lost block.
        use std::sync::atomic::AtomicBool;
        let t = Table::with_capacity(64, 13);
        let mut x = 99;
        let hashes: Vec<u64> = (0..4096).map(|_| lcg(&mut x) | 1).collect();
        let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
        for id in 0..8 {
            t.insert(hashes[id as usize], id);
        }
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    while !done.load(Ordering::Relaxed) {
                        for id in 0..8 {
                            let found = loop {
                                match t.find(hashes[id as usize], hash_of) {
                                    Ok(found) => break found,
                                    Err(Moved) => std::hint::spin_loop(),
                                }
                            };
                            assert_eq!(found, Some(id), "a fixed entry was missed");
                        }
                    }
                });
            }
            let mut live = std::collections::VecDeque::new();
            for id in 8..4096u32 {
                t.insert(hashes[id as usize], id);
                live.push_back(id);
                if live.len() > 36 {
                    let gone = live.pop_front().unwrap_or_default();
                    assert!(t.remove(hashes[gone as usize], gone));
                }
            }
            done.store(true, Ordering::Relaxed);
        });
        assert_eq!(unreachable(&t), Vec::<usize>::new());
    }

    #[test]
    fn a_vacancy_is_where_insert_would_have_put_the_entry() {
        // Two tables in lockstep: one probes twice (find, then insert), the other once
        // (find_or_vacancy, then insert_at); the slots must agree after every step.
        let (twice, once) = (Table::with_capacity(64, 9), Table::with_capacity(64, 9));
        let mut hashes: Vec<u64> = Vec::new();
        let mut live: Vec<u32> = Vec::new();
        let mut x = 0x9E37_79B9_u64;
        for _ in 0..5000 {
            let r = lcg(&mut x);
            let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
            if live.len() < 40 && r % 16 < 9 {
                let (id, h) = (hashes.len() as u32, lcg(&mut x) | 1);
                assert_eq!(twice.find(h, hash_of), Ok(None));
                let vacancy = once.find_or_vacancy(h, hash_of).expect_err("absent");
                twice.insert(h, id);
                once.insert_at(vacancy, id);
                hashes.push(h);
                live.push(id);
            } else if !live.is_empty() {
                let id = live.swap_remove((r >> 8) as usize % live.len());
                let h = hashes[id as usize];
                assert_eq!(once.find_or_vacancy(h, hash_of).ok(), Some(id));
                assert_eq!(twice.remove(h, id), once.remove(h, id));
            }
            assert_eq!(slots(&twice), slots(&once));
        }
        let bigger = Table::with_capacity(100, 9);
        assert_eq!(once.copy_into(&bigger), live.len());
        let hash_of = |id: u32| hashes.get(id as usize).copied().unwrap_or(0);
        for &id in &live {
            assert_eq!(
                bigger.find(hashes[id as usize], hash_of),
                Ok(Some(id)),
                "rebuilt keeps entries"
            );
        }
    }
}
