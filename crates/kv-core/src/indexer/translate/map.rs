//! A translated engine's map: per engine hash and KV-cache group, what the engine block
//! stands for (the chained digest its successor continues, the keys of its chunks, its copies
//! per tier), in the order the entries were made. Entries are looked up by the engine hash in
//! its group's space ([`EngineHash::in_group`]): one map holds every group's blocks apart.
//!
//! The order is what the key budget takes back first: when `size` is spent, the oldest entry
//! gives its place (and its keys leave the index with it), so the newest blocks win, as
//! everywhere else in the index. A snapshot carries the entries in this order, so a restored
//! replica gives back the same entries first.
//!
//! Invariants: `order` holds every live entry once, with the stamp the entry carries, oldest
//! first; items whose entry was removed (or re-made with another stamp) are stale and skipped
//! when met, and dropped once they outnumber the live entries (amortised O(1) per operation).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use crate::hashing::BlockDigest;
use crate::{BlockHash, EngineHash};

/// What one engine hash of a translated engine stands for.
#[derive(Debug)]
pub(super) struct Translated {
    /// The chained digest of the engine block's last chunk: what the next block continues.
    pub(super) tip: BlockDigest,
    /// The keys of the chunks before the last (empty when the engine's block size is ours).
    pub(super) earlier: Box<[BlockHash]>,
    /// Copies held, per tier.
    pub(super) copies: [u16; 4],
    /// When the entry was made (its place in the map's order), in the low [`GROUP_SHIFT`]
    /// bits, and its KV-cache group above them (packed: the entry stays 64 bytes).
    stamp_group: u64,
}

/// Where the group sits in [`Translated::stamp_group`]: 2^56 stamps outlast any engine, and
/// groups are fewer than 2^8 ([`crate::hit::MAX_GROUPS`]).
const GROUP_SHIFT: u32 = 56;

impl Translated {
    /// The group whose block this is; the keys are in its space.
    pub(super) fn group(&self) -> u32 {
        (self.stamp_group >> GROUP_SHIFT) as u32
    }

    fn stamp(&self) -> u64 {
        self.stamp_group & ((1 << GROUP_SHIFT) - 1)
    }

    /// Every key the engine block stands for, in chain order, in its group's space.
    pub(super) fn keys(&self, out: &mut Vec<BlockHash>) {
        let group = self.group();
        out.extend(self.earlier.iter().map(|k| k.in_group(group)));
        out.push(crate::hashing::event_hash(&self.tip).in_group(group));
    }
}

/// Engine hash in its group's space -> [`Translated`] (the index keys it stands for), with the
/// entries' order (see the module docs).
#[derive(Debug, Default)]
pub(super) struct TranslationMap {
    entries: HashMap<EngineHash, Translated>,
    order: VecDeque<(EngineHash, u64)>,
    next: u64,
}

impl TranslationMap {
    /// Live entries.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The stamp the next entry gets: entries made from now on have stamps at or above it.
    pub(super) fn next_stamp(&self) -> u64 {
        self.next
    }

    pub(super) fn get(&self, hash: &EngineHash) -> Option<&Translated> {
        self.entries.get(hash)
    }

    pub(super) fn get_mut(&mut self, hash: &EngineHash) -> Option<&mut Translated> {
        self.entries.get_mut(hash)
    }

    /// Makes the newest entry for `hash` (in `group`'s space, [`EngineHash::in_group`]),
    /// replacing one there, which a caller never does while it holds copies. `earlier` and
    /// `tip` are group 0's keys; [`Translated::keys`] puts them in the group's space.
    pub(super) fn insert(
        &mut self,
        hash: EngineHash,
        group: u32,
        tip: BlockDigest,
        earlier: Box<[BlockHash]>,
        copies: [u16; 4],
    ) {
        let stamp = self.next;
        self.next += 1;
        debug_assert!((group as usize) < crate::hit::MAX_GROUPS);
        self.entries.insert(
            hash,
            Translated {
                tip,
                earlier,
                copies,
                stamp_group: stamp | (u64::from(group) << GROUP_SHIFT),
            },
        );
        self.order.push_back((hash, stamp));
    }

    /// Removes `hash`'s entry (its item in the order goes stale).
    pub(super) fn remove(&mut self, hash: &EngineHash) -> Option<Translated> {
        let removed = self.entries.remove(hash);
        self.compact_if_stale();
        removed
    }

    /// Removes and returns the oldest entry, if it was made before `before` (entries made
    /// since, e.g. the run being stored, are never taken).
    pub(super) fn pop_oldest_before(&mut self, before: u64) -> Option<(EngineHash, Translated)> {
        while let Some(&(hash, stamp)) = self.order.front() {
            let live = self.entries.get(&hash).is_some_and(|t| t.stamp() == stamp);
            if !live {
                self.order.pop_front();
                continue;
            }
            if stamp >= before {
                return None;
            }
            self.order.pop_front();
            return match self.entries.entry(hash) {
                Entry::Occupied(e) => Some(e.remove_entry()),
                Entry::Vacant(_) => None,
            };
        }
        None
    }

    /// Every live entry, oldest first.
    pub(super) fn in_order(&self) -> impl Iterator<Item = (EngineHash, &Translated)> {
        self.order.iter().filter_map(|&(hash, stamp)| {
            self.entries
                .get(&hash)
                .filter(|t| t.stamp() == stamp)
                .map(|t| (hash, t))
        })
    }

    /// Drops stale order items once they outnumber the live entries.
    fn compact_if_stale(&mut self) {
        if self.order.len() > 2 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.order
                .retain(|(hash, stamp)| entries.get(hash).is_some_and(|t| t.stamp() == *stamp));
            self.order.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> EngineHash {
        EngineHash::new(n)
    }

    #[test]
    fn the_oldest_live_entry_leaves_first_and_stale_items_are_skipped() {
        let mut m = TranslationMap::default();
        for n in 1..=4 {
            m.insert(h(n), 0, [n as u8; 32], Box::new([]), [1, 0, 0, 0]);
        }
        assert!(m.remove(&h(1)).is_some());
        // Re-made: its first item is stale, its second is the newest.
        assert!(m.remove(&h(2)).is_some());
        m.insert(h(2), 0, [9; 32], Box::new([]), [1, 0, 0, 0]);
        let order: Vec<u64> = m.in_order().map(|(hash, _)| hash.get()).collect();
        assert_eq!(order, [3, 4, 2]);
        let fence = m.next_stamp();
        m.insert(h(5), 0, [5; 32], Box::new([]), [1, 0, 0, 0]);
        let taken: Vec<u64> = std::iter::from_fn(|| m.pop_oldest_before(fence))
            .map(|(hash, _)| hash.get())
            .collect();
        assert_eq!(taken, [3, 4, 2], "entries made since the fence stay");
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn an_entry_keeps_its_group_apart_from_its_stamp() {
        let mut m = TranslationMap::default();
        m.insert(h(1), 0, [1; 32], Box::new([]), [1, 0, 0, 0]);
        m.insert(h(1).in_group(15), 15, [1; 32], Box::new([]), [1, 0, 0, 0]);
        let (plain, grouped) = (&m.entries[&h(1)], &m.entries[&h(1).in_group(15)]);
        assert_eq!((plain.group(), grouped.group()), (0, 15));
        assert_eq!((plain.stamp(), grouped.stamp()), (0, 1));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        plain.keys(&mut a);
        grouped.keys(&mut b);
        assert_eq!(b, [a[0].in_group(15)], "the key in its group's space");
        let order: Vec<EngineHash> = m.in_order().map(|(hash, _)| hash).collect();
        assert_eq!(order, [h(1), h(1).in_group(15)]);
    }

    #[test]
    fn stale_items_are_dropped_once_they_outnumber_live_entries() {
        let mut m = TranslationMap::default();
        for n in 0..10_000 {
            m.insert(h(n), 0, [0; 32], Box::new([]), [1, 0, 0, 0]);
            m.remove(&h(n));
        }
        assert!(m.order.len() <= 1024 + 1, "{} items kept", m.order.len());
        assert_eq!(m.in_order().count(), 0);
    }
}
