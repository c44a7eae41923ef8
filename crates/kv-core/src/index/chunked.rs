//! [`Chunked`]: the memory of the index's id-addressed arrays (block ids, runs, pooled holder
//! words), allocated in fixed-size chunks on first use and never moved or freed while the
//! index lives, so a lock-free reader can hold a reference into them.
//!
//! Invariant: a chunk, once published (`OnceLock`), is never replaced; items are `Zeroable`, so
//! a new chunk is all zeroes, which every user reads as "free".

use std::sync::{Arc, OnceLock};

use crate::memory::{zeroed_arc_array, Zeroable};

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
            .get_or_init(zeroed_arc_array::<T, N>);
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
