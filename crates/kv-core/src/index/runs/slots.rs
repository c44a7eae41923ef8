//! The run index's block-id slots, in fixed chunks that never move.
//!
//! A single growing vector would copy every slot at each doubling (and touch twice the memory
//! the final size needs: at 1,024 pods that copying was a tenth of the apply time). Chunks of
//! [`CHUNK`] slots are allocated as ids reach them and never moved or freed while the index
//! lives, so growth costs one allocation per 64Ki ids and a reader's reference to a slot stays
//! valid. The chunk is a fixed-size array, so a masked offset needs no bounds check: an access
//! is one directory load (a small, cache-resident vector) and the slot.
//!
//! Invariant: ids `0 .. len` have slots; a slot past `len` is never handed out.

use std::ops::{Index, IndexMut};

/// Bits of an id that select the slot inside its chunk.
const CHUNK_BITS: u32 = 16;
/// Slots per chunk (64Ki: 1 MiB of 16-byte slots).
const CHUNK: usize = 1 << CHUNK_BITS;

/// The run of a free id.
pub(super) const NONE: u32 = u32::MAX;

/// One block id's slot.
#[derive(Clone, Copy, Debug)]
pub(super) struct IdSlot {
    /// The block's hash (0 when free).
    pub hash: u64,
    /// The block's run ([`NONE`] when free).
    pub run: u32,
    /// Where this block's chain went on when it did not go on at the next id: the id its most
    /// recently stored child took (a hint, confirmed by the child's hash; [`NONE`]: none). It
    /// fills the slot's padding, and saves a table probe where a chain jumps.
    pub next: u32,
}

impl IdSlot {
    const FREE: IdSlot = IdSlot {
        hash: 0,
        run: NONE,
        next: NONE,
    };
}

/// Block-id slots `0 .. len`, in chunks that never move.
#[derive(Default)]
pub(super) struct IdSlots {
    chunks: Vec<Box<[IdSlot; CHUNK]>>,
    len: u32,
}

impl IdSlots {
    /// Ids handed out so far (live or free).
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// The slot of `id`, if the id was ever handed out.
    #[inline]
    pub fn get(&self, id: u32) -> Option<&IdSlot> {
        if id >= self.len {
            return None;
        }
        Some(&self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)])
    }

    /// The slots of ids `from .. to`, or of the part of them in `from`'s chunk (empty when
    /// `from >= to` or `from` was never handed out): what a walk compares in one pass.
    #[inline]
    pub fn stretch(&self, from: u32, to: u32) -> &[IdSlot] {
        let to = to.min(self.len);
        if from >= to {
            return &[];
        }
        let offset = from as usize & (CHUNK - 1);
        let stop = (offset + (to - from) as usize).min(CHUNK);
        &self.chunks[(from >> CHUNK_BITS) as usize][offset..stop]
    }

    /// A new free id (`len`), allocating its chunk when it starts one.
    pub fn push(&mut self) -> u32 {
        let id = self.len;
        if id as usize == self.chunks.len() * CHUNK {
            let chunk: Box<[IdSlot]> = vec![IdSlot::FREE; CHUNK].into_boxed_slice();
            match chunk.try_into() {
                Ok(chunk) => self.chunks.push(chunk),
                Err(_) => unreachable!("a chunk is built with CHUNK slots"),
            }
        }
        self.len += 1;
        id
    }

    /// Sets the run of ids `start .. end` (chunk by chunk).
    pub fn set_run(&mut self, start: u32, end: u32, run: u32) {
        let mut id = start;
        while id < end {
            let offset = id as usize & (CHUNK - 1);
            let stop = (end - id).min((CHUNK - offset) as u32);
            let chunk = &mut self.chunks[(id >> CHUNK_BITS) as usize];
            for slot in &mut chunk[offset..offset + stop as usize] {
                slot.run = run;
            }
            id += stop;
        }
    }

    /// Bytes held from the allocator.
    pub fn allocated_bytes(&self) -> usize {
        self.chunks.len() * std::mem::size_of::<[IdSlot; CHUNK]>()
            + self.chunks.capacity() * std::mem::size_of::<usize>()
    }
}

impl Index<u32> for IdSlots {
    type Output = IdSlot;

    #[inline]
    fn index(&self, id: u32) -> &IdSlot {
        debug_assert!(id < self.len, "id {id} was never handed out");
        &self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }
}

impl IndexMut<u32> for IdSlots {
    #[inline]
    fn index_mut(&mut self, id: u32) -> &mut IdSlot {
        debug_assert!(id < self.len, "id {id} was never handed out");
        &mut self.chunks[(id >> CHUNK_BITS) as usize][id as usize & (CHUNK - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_cross_chunks_and_runs_are_set_across_the_boundary() {
        let mut slots = IdSlots::default();
        for want in 0..(CHUNK as u32 + 10) {
            assert_eq!(slots.push(), want);
        }
        assert_eq!(slots.len(), CHUNK as u32 + 10);
        assert!(slots.get(CHUNK as u32 + 10).is_none());
        let (a, b) = (CHUNK as u32 - 3, CHUNK as u32 + 4);
        slots.set_run(a, b, 7);
        for id in a - 2..b + 2 {
            let want = if (a..b).contains(&id) { 7 } else { NONE };
            assert_eq!(slots[id].run, want, "id {id}");
        }
        assert_eq!(slots.stretch(a, b).len(), 3, "up to the chunk's end");
        assert_eq!(slots.stretch(CHUNK as u32, b).len(), 4);
        assert!(slots.stretch(b, a).is_empty());
        assert_eq!(slots.stretch(b, u32::MAX).len(), 6, "up to the last id");
        slots[CHUNK as u32].hash = 42;
        assert_eq!(slots.get(CHUNK as u32).map(|s| s.hash), Some(42));
        assert_eq!(slots.allocated_bytes() / (1 << 20), 2, "two 1 MiB chunks");
    }
}
