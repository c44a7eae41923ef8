//! CLOCK eviction at `size`: one reference bit per node, set when a block is stored, cleared
//! as the hand passes; a block whose bit is clear when the hand reaches it leaves with all its
//! memberships (counted as capacity evictions, not removals).

use super::NodeWriter;

impl NodeWriter<'_> {
    pub(super) fn set_referenced(&mut self, id: u32) {
        let word = id as usize / 64;
        if word >= self.state.referenced.len() {
            self.state.referenced.resize(word + 1, 0);
        }
        self.state.referenced[word] |= 1 << (id % 64);
    }

    /// Evicts up to `n` blocks (CLOCK), with all their memberships: room for another index
    /// sharing the key budget. Returns the blocks evicted.
    pub fn evict(&mut self, n: usize) -> usize {
        let mut evicted = 0;
        while evicted < n && self.state.tally.keys > 0 {
            let before = self.state.tally.keys;
            self.evict_one();
            if self.state.tally.keys == before {
                break;
            }
            evicted += 1;
        }
        evicted
    }

    /// Second-chance eviction of one block with all its memberships.
    pub(super) fn evict_one(&mut self) {
        let end = self.state.next_node;
        if end == 0 {
            return;
        }
        for _ in 0..=(2 * end as usize) {
            if self.state.clock_hand >= end {
                self.state.clock_hand = 0;
            }
            let id = self.state.clock_hand;
            self.state.clock_hand += 1;
            let hash = self.index.slab.hash_of(id);
            if hash == 0 {
                continue;
            }
            let word = id as usize / 64;
            let bit = 1u64 << (id % 64);
            if let Some(w) = self.state.referenced.get_mut(word) {
                if *w & bit != 0 {
                    *w &= !bit;
                    continue;
                }
            }
            let evicted = self.remove_members(id, hash, |_| true) as u64;
            // Those were counted as removals; they are capacity evictions.
            self.state.tally.removals -= evicted;
            self.state.tally.capacity_evictions += evicted;
            return;
        }
    }
}
