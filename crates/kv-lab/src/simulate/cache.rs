//! The simulated engines' paged KV cache: a pool of blocks keyed by content, prefix-cached
//! once computed, freed blocks kept resident and evicted least recently freed first (vLLM's
//! `BlockPool` with its free-block queue).
//!
//! Generic over the key so the plain engine keys blocks by their hash and a hybrid engine by
//! (KV-cache group, hash): vLLM keys its cache by hash and group, and the same hash is held
//! by several groups of one engine.
//!
//! Invariants: the pool never holds more than `capacity` blocks; a block is in the free list
//! exactly when nothing pins it and it is computed and shareable (an unshareable or
//! uncomputed block nothing pins is dropped at once); a private copy (made while another
//! sequence computes the same content) is never a hit.

use std::collections::HashMap;
use std::hash::Hash;

use kv_core::{mix64, BlockHash};

use crate::lru::LruSet;

/// A key the pool can make a private copy of (an id no content has).
pub trait CacheKey: Copy + Eq + Hash + Default {
    /// A key for a private copy of `self`, different for every `nonce`.
    fn private(self, nonce: u64) -> Self;
}

impl CacheKey for BlockHash {
    fn private(self, nonce: u64) -> Self {
        BlockHash::new(mix64(self.get() ^ mix64(nonce)) | 1)
    }
}

impl CacheKey for (u32, BlockHash) {
    fn private(self, nonce: u64) -> Self {
        (self.0, self.1.private(nonce))
    }
}

#[derive(Debug)]
struct Block {
    /// Sequences holding it.
    pins: u32,
    /// Its tokens are computed: it is in the prefix cache (when shareable).
    computed: bool,
    /// Keyed by the content's hash (false: a private copy, made while another sequence was
    /// computing the same block, never cached).
    shareable: bool,
}

/// The paged KV cache.
#[derive(Debug)]
pub struct KvCache<K: CacheKey> {
    capacity: usize,
    blocks: HashMap<K, Block>,
    /// Computed, shareable, unpinned blocks: the eviction order.
    free: LruSet<K>,
    /// Makes private block ids.
    nonce: u64,
}

impl<K: CacheKey> KvCache<K> {
    /// An empty pool of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            blocks: HashMap::new(),
            free: LruSet::new(),
            nonce: 0,
        }
    }

    /// Blocks the pool has.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks resident (held or cached).
    pub fn resident(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks held by sequences (vLLM's KV-cache usage counts these).
    pub fn used(&self) -> usize {
        self.blocks.len() - self.free.len()
    }

    /// Whether `h` is in the prefix cache (computed and shareable).
    pub fn is_hit(&self, h: K) -> bool {
        self.blocks
            .get(&h)
            .is_some_and(|b| b.computed && b.shareable)
    }

    /// One more sequence holds `h` (out of the free list if it was free).
    pub fn pin(&mut self, h: K) {
        if let Some(b) = self.blocks.get_mut(&h) {
            if b.pins == 0 {
                self.free.remove(h);
            }
            b.pins += 1;
        }
    }

    /// A new block for content `h` (a private copy when `h` is resident), evicting the least
    /// recently freed block when full. `None`: every block is held.
    pub fn allocate(&mut self, h: K, evicted: &mut Vec<K>) -> Option<K> {
        if self.blocks.len() >= self.capacity {
            let victim = self.free.pop_oldest()?;
            self.blocks.remove(&victim);
            evicted.push(victim);
        }
        let id = if self.blocks.contains_key(&h) {
            loop {
                self.nonce += 1;
                let private = h.private(self.nonce);
                if !self.blocks.contains_key(&private) {
                    break private;
                }
            }
        } else {
            h
        };
        self.blocks.insert(
            id,
            Block {
                pins: 1,
                computed: false,
                shareable: id == h,
            },
        );
        Some(id)
    }

    /// Marks a block computed; `true` when it joins the prefix cache (to be published).
    pub fn computed(&mut self, id: K) -> bool {
        match self.blocks.get_mut(&id) {
            Some(b) if !b.computed => {
                b.computed = true;
                b.shareable
            }
            _ => false,
        }
    }

    /// One sequence fewer holds `id`; unpinned, it joins the free list (or is dropped when it
    /// is not cacheable).
    pub fn release(&mut self, id: K) {
        let Some(b) = self.blocks.get_mut(&id) else {
            return;
        };
        b.pins = b.pins.saturating_sub(1);
        if b.pins == 0 {
            if b.computed && b.shareable {
                self.free.insert(id);
            } else {
                self.blocks.remove(&id);
            }
        }
    }

    /// Drops the least recently freed block (a prefix-cache reset drops them all); `None`
    /// when no block is free.
    pub fn drop_oldest_free(&mut self) -> Option<K> {
        let b = self.free.pop_oldest()?;
        self.blocks.remove(&b);
        Some(b)
    }

    /// Pins over all blocks (equal to what the sequences hold when blocks are conserved).
    pub fn pins(&self) -> u64 {
        self.blocks.values().map(|b| u64::from(b.pins)).sum()
    }
}
