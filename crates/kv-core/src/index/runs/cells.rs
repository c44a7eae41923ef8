//! The run index's shared memory: block ids (hashes, and runs with hints), run slots and pooled
//! holder words, as atomics in chunks that are never moved or freed while the index lives
//! ([`Chunked`]), so a reader holds references into them without a lock while the one writer
//! changes them.
//!
//! Publication (the orders of `crate::seqlock`, whose relabel model checks them):
//! - a **run** (`start .. end` and its holder set) changes only inside its seqlock; a reader
//!   keeps what it read only if the sequence did not move;
//! - an id's **run number** is stored with Release after the run that receives the id is
//!   written, and before the run the id leaves is shrunk: a reader that loads it with Acquire
//!   and finds that run still covering the id reads the holders of before or after the move;
//! - a block's **hash** changes only while its id is in no run (written before the id joins
//!   one, zeroed before it leaves), so a reader that finds the id inside its run under an
//!   unchanged sequence reads the hash of the block the run describes.
//!
//! Zeroed memory is a free slot: run numbers and hints are stored plus one (0 = none).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

#[cfg(test)]
pub(super) use super::holders::probe;
use super::holders::stored;
pub(super) use super::holders::Words;
use super::holders::{Holders, RunHolders};
use crate::index::chunked::Chunked;
use crate::memory::Zeroable;
use crate::seqlock::{StdFence, PROTOCOL};

/// No run, no id (a free id's run; a missing hint).
pub(super) const NONE: u32 = u32::MAX;

/// Bits of an id that select its slot inside a chunk (64Ki ids: 512 KiB of hashes, as much of
/// links).
pub(super) const ID_BITS: u32 = 16;
/// Bits of a run number that select its slot inside a chunk (4Ki runs: 192 KiB).
const RUN_BITS: u32 = 12;

/// A block id's hash (0 when free), in an array of its own: a walk compares the prompt with
/// consecutive ids' hashes, eight to a cache line, and reads nothing else of them.
#[repr(transparent)]
pub(super) struct HashCell(AtomicU64);

// SAFETY: an integer atomic; zero is a free id's hash.
unsafe impl Zeroable for HashCell {}

impl HashCell {
    /// A free id's hash (what zeroed memory holds).
    const fn free() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The block's hash (0: free).
    #[inline(always)]
    pub fn hash(&self) -> u64 {
        self.0.load(Relaxed)
    }

    #[inline(always)]
    pub fn set_hash(&self, hash: u64) {
        self.0.store(hash, Relaxed);
        stored();
    }
}

/// A block id's run and chain hint (each plus one; 0: none), in the second id array.
#[repr(C)]
pub(super) struct LinkCell {
    /// The block's run plus one (0: free).
    run: AtomicU32,
    /// The id its most recently stored chain child took, plus one, where that was not the
    /// next id (a hint, confirmed by the child's hash; 0: none).
    next: AtomicU32,
}

// SAFETY: integer atomics only; all zero is a free id (no run, no hint).
unsafe impl Zeroable for LinkCell {}

impl LinkCell {
    /// A free id's links (what zeroed memory holds).
    const fn free() -> Self {
        Self {
            run: AtomicU32::new(0),
            next: AtomicU32::new(0),
        }
    }

    /// The block's run ([`NONE`]: free). Acquire: the run it names was written before.
    #[inline(always)]
    pub fn run(&self) -> u32 {
        self.run.load(PROTOCOL.flag_observe).wrapping_sub(1)
    }

    /// The hinted chain child ([`NONE`]: none).
    #[inline(always)]
    pub fn next(&self) -> u32 {
        self.next.load(Relaxed).wrapping_sub(1)
    }

    /// Points the id at run `r` (Release: after the run was written).
    #[inline(always)]
    pub fn set_run(&self, r: u32) {
        self.run.store(r.wrapping_add(1), PROTOCOL.flag_publish);
        stored();
    }

    #[inline(always)]
    pub fn set_next(&self, id: u32) {
        self.next.store(id.wrapping_add(1), Relaxed);
        stored();
    }
}

/// One block id: its hash, its run and a hint to where its chain went on (16 bytes, in two
/// arrays: [`HashCell`]s, which a walk reads, and [`LinkCell`]s, which a jump reads).
#[derive(Clone, Copy)]
pub(super) struct IdSlot<'a> {
    hash: &'a HashCell,
    link: &'a LinkCell,
}

impl IdSlot<'_> {
    /// The block's hash (0: free).
    #[inline(always)]
    pub fn hash(&self) -> u64 {
        self.hash.hash()
    }

    /// The block's run ([`NONE`]: free). Acquire: the run it names was written before.
    #[inline(always)]
    pub fn run(&self) -> u32 {
        self.link.run()
    }

    /// The hinted chain child ([`NONE`]: none).
    #[inline(always)]
    pub fn next(&self) -> u32 {
        self.link.next()
    }

    #[inline(always)]
    pub fn set_hash(&self, hash: u64) {
        self.hash.set_hash(hash);
    }

    /// Points the id at run `r` (the tests' way to break an id; the writer relabels through
    /// [`WriterIds::link_tail`]).
    #[cfg(test)]
    pub fn set_run(&self, r: u32) {
        self.link.set_run(r);
    }

    #[inline(always)]
    pub fn set_next(&self, id: u32) {
        self.link.set_next(id);
    }
}

/// One run: ids `start .. end` held by `holders`.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Run {
    pub start: u32,
    pub end: u32,
    pub holders: RunHolders,
}

/// A run's slot: the run's fields under a seqlock, and the hints (56 bytes).
#[repr(C)]
pub(super) struct RunSlot {
    seq: AtomicU32,
    start: AtomicU32,
    end: AtomicU32,
    gpu_base: AtomicU32,
    gpu_len: AtomicU32,
    other_base: AtomicU32,
    other_len: AtomicU32,
    /// The run the chain went on in after this run's last block, plus one (0: none): where
    /// its last store that jumped ids went. A hint a walk prefetches on entering the run;
    /// written outside the seqlock and never trusted.
    after: AtomicU32,
    /// The id that chain went on at, plus one (0: none): a walk entering the run prefetches
    /// its hash and links too, so leaving the run at its end costs no wait. A hint like
    /// `after`.
    after_id: AtomicU32,
    gpu_word: AtomicU64,
    other_word: AtomicU64,
}

// SAFETY: integer atomics only; all zero is an empty run at sequence 0.
unsafe impl Zeroable for RunSlot {}

impl RunSlot {
    /// An empty run's slot (what zeroed memory holds).
    const fn empty() -> Self {
        Self {
            seq: AtomicU32::new(0),
            start: AtomicU32::new(0),
            end: AtomicU32::new(0),
            gpu_base: AtomicU32::new(0),
            gpu_len: AtomicU32::new(0),
            other_base: AtomicU32::new(0),
            other_len: AtomicU32::new(0),
            after: AtomicU32::new(0),
            after_id: AtomicU32::new(0),
            gpu_word: AtomicU64::new(0),
            other_word: AtomicU64::new(0),
        }
    }

    /// The fields as they are now: the writer's view, or a reader's inside a read section.
    #[inline(always)]
    pub fn load(&self) -> Run {
        Run {
            start: self.start.load(Relaxed),
            end: self.end.load(Relaxed),
            holders: self.holders(),
        }
    }

    /// The run's end (the writer's view: each load costs, so it loads what it needs).
    #[inline(always)]
    pub fn end(&self) -> u32 {
        self.end.load(Relaxed)
    }

    /// The run's holders (the writer's view, or a reader's inside a read section).
    #[inline(always)]
    pub fn holders(&self) -> RunHolders {
        RunHolders {
            gpu: Holders::from_parts(
                self.gpu_base.load(Relaxed),
                self.gpu_len.load(Relaxed),
                self.gpu_word.load(Relaxed),
            ),
            other: Holders::from_parts(
                self.other_base.load(Relaxed),
                self.other_len.load(Relaxed),
                self.other_word.load(Relaxed),
            ),
        }
    }

    /// Moves the run's end (one seqlock write).
    #[inline]
    pub fn set_end(&self, end: u32) {
        PROTOCOL.write::<_, StdFence, _>(&self.seq, || self.end.store(end, Relaxed));
        stored();
    }

    /// Writes the whole run (one seqlock write).
    #[inline]
    pub fn store(&self, run: Run) {
        PROTOCOL.write::<_, StdFence, _>(&self.seq, || {
            let (gb, gl, gw) = run.holders.gpu.parts();
            let (ob, ol, ow) = run.holders.other.parts();
            self.start.store(run.start, Relaxed);
            self.end.store(run.end, Relaxed);
            self.gpu_base.store(gb, Relaxed);
            self.gpu_len.store(gl, Relaxed);
            self.gpu_word.store(gw, Relaxed);
            self.other_base.store(ob, Relaxed);
            self.other_len.store(ol, Relaxed);
            self.other_word.store(ow, Relaxed);
        });
        stored();
    }

    /// Moves the run's bounds (one seqlock write).
    #[inline]
    pub fn set_bounds(&self, start: u32, end: u32) {
        PROTOCOL.write::<_, StdFence, _>(&self.seq, || {
            self.start.store(start, Relaxed);
            self.end.store(end, Relaxed);
        });
        stored();
    }

    /// The run hinted to follow this one ([`NONE`]: none; a hint, possibly stale).
    #[inline(always)]
    pub fn after(&self) -> u32 {
        self.after.load(Relaxed).wrapping_sub(1)
    }

    /// The id hinted to follow this run's last block ([`NONE`]: none; possibly stale).
    #[inline(always)]
    pub fn after_id(&self) -> u32 {
        self.after_id.load(Relaxed).wrapping_sub(1)
    }

    /// Hints that the chain goes on at id `id`, in run `r`, after this run.
    #[inline(always)]
    pub fn set_after(&self, r: u32, id: u32) {
        self.after.store(r.wrapping_add(1), Relaxed);
        self.after_id.store(id.wrapping_add(1), Relaxed);
        stored();
    }

    /// Starts a reader's section: the sequence to check with [`RunSlot::still`], or `None`
    /// while a write is under way.
    #[inline(always)]
    pub fn begin_read(&self) -> Option<u32> {
        PROTOCOL.begin_read(&self.seq)
    }

    /// Whether nothing was written since [`RunSlot::begin_read`] returned `begun`.
    #[inline(always)]
    pub fn still(&self, begun: u32) -> bool {
        PROTOCOL.still::<_, StdFence>(&self.seq, begun)
    }
}

/// Slots per id chunk.
pub(super) const ID_CHUNK: usize = 1 << ID_BITS;
/// Slots per run chunk.
pub(super) const RUN_CHUNK: usize = 1 << RUN_BITS;

/// The writer's handles on the chunks it addresses (the memory readers reach through the
/// directories), so its accesses skip the directory: `chunks[id >> BITS][id & mask]`.
pub(super) struct WriterChunks<T, const N: usize> {
    chunks: Vec<std::sync::Arc<[T; N]>>,
}

impl<T, const N: usize> Default for WriterChunks<T, N> {
    fn default() -> Self {
        Self { chunks: Vec::new() }
    }
}

impl<T: Zeroable, const N: usize> WriterChunks<T, N> {
    /// The item `i`, or `sink` past the chunks held.
    #[inline(always)]
    pub fn get<'a>(&'a self, i: u32, sink: &'a T) -> &'a T {
        match self.chunks.get(i as usize / N) {
            Some(chunk) => &chunk[i as usize & (N - 1)],
            None => sink,
        }
    }

    /// The items from `i` to the end of its chunk (empty past the chunks held).
    #[inline(always)]
    pub fn tail(&self, i: u32) -> &[T] {
        match self.chunks.get(i as usize / N) {
            Some(chunk) => &chunk[i as usize & (N - 1)..],
            None => &[],
        }
    }

    /// Makes item `i` addressable, allocating its chunk in `shared` when it starts one;
    /// `None` past `shared`'s capacity.
    #[inline]
    pub fn reach(&mut self, i: u32, shared: &Chunked<T, N>) -> Option<()> {
        if (i as usize / N) < self.chunks.len() {
            return Some(()); // the chunk is held already (the common case)
        }
        shared.get_or_alloc(i)?;
        while self.chunks.len() <= i as usize / N {
            let at = u32::try_from(self.chunks.len() * N).ok()?;
            self.chunks.push(shared.chunk(at)?.clone());
        }
        Some(())
    }
}

/// The block ids' two arrays (the readers' view).
pub(super) struct IdSlots {
    hashes: Chunked<HashCell, ID_CHUNK>,
    links: Chunked<LinkCell, ID_CHUNK>,
}

impl IdSlots {
    /// Room for `capacity` ids, no chunk allocated.
    pub fn new(capacity: usize) -> Self {
        Self {
            hashes: Chunked::new(capacity),
            links: Chunked::new(capacity),
        }
    }

    /// Bytes held from the allocator.
    pub fn allocated_bytes(&self) -> usize {
        self.hashes.allocated_bytes() + self.links.allocated_bytes()
    }

    /// The hashes from `id` to the end of its chunk: what a walk compares in one pass.
    #[inline(always)]
    pub fn hash_tail(&self, id: u32) -> &[HashCell] {
        self.hashes.tail(id)
    }

    /// Hints the CPU to fetch `id`'s hash (when `hash`) and links (when `link`).
    #[inline(always)]
    pub fn prefetch(&self, id: u32, hash: bool, link: bool) {
        if let (true, Some(h)) = (hash, self.hashes.get(id)) {
            crate::memory::prefetch_read(h as *const HashCell as *const u8);
        }
        if let (true, Some(l)) = (link, self.links.get(id)) {
            crate::memory::prefetch_read(l as *const LinkCell as *const u8);
        }
    }
}

/// The writer's handles on the id arrays' chunks.
#[derive(Default)]
pub(super) struct WriterIds {
    hashes: WriterChunks<HashCell, ID_CHUNK>,
    links: WriterChunks<LinkCell, ID_CHUNK>,
}

impl WriterIds {
    /// The slot of `id` (the sinks past the chunks held).
    #[inline(always)]
    pub fn get(&self, id: u32) -> IdSlot<'_> {
        IdSlot {
            hash: self.hashes.get(id, &SINK_HASH),
            link: self.links.get(id, &SINK_LINK),
        }
    }

    /// The hashes from `id` to the end of its chunk.
    #[inline(always)]
    pub fn hash_tail(&self, id: u32) -> &[HashCell] {
        self.hashes.tail(id)
    }

    /// The links from `id` to the end of its chunk.
    #[inline(always)]
    pub fn link_tail(&self, id: u32) -> &[LinkCell] {
        self.links.tail(id)
    }

    /// Makes id `i` addressable in both arrays; `None` past the capacity.
    #[inline]
    pub fn reach(&mut self, i: u32, shared: &IdSlots) -> Option<()> {
        self.hashes.reach(i, &shared.hashes)?;
        self.links.reach(i, &shared.links)
    }
}

/// Run slots.
pub(super) type RunSlots = Chunked<RunSlot, RUN_CHUNK>;

/// What every id outside the allocated chunks reads as: free.
static FREE_HASH: HashCell = HashCell::free();
/// See [`FREE_HASH`].
static FREE_LINK: LinkCell = LinkCell::free();

/// The slot of `id` (a free one outside the allocated chunks: never written).
#[inline(always)]
pub(super) fn id_slot(ids: &IdSlots, id: u32) -> IdSlot<'_> {
    IdSlot {
        hash: ids.hashes.get(id).unwrap_or(&FREE_HASH),
        link: ids.links.get(id).unwrap_or(&FREE_LINK),
    }
}

/// The slot every run outside the allocated chunks reads as: empty, covering nothing.
pub(super) static NO_RUN: RunSlot = RunSlot::empty();

/// The slot of run `r` (an empty one outside the allocated chunks: never written).
#[inline(always)]
pub(super) fn run_slot(runs: &RunSlots, r: u32) -> &RunSlot {
    runs.get(r).unwrap_or(&NO_RUN)
}

/// Where the writer's stores would go if it ever addressed an id or run outside the allocated
/// chunks (a bug: every id and run it hands out has its chunk): somewhere no reader looks, so
/// [`FREE_HASH`], [`FREE_LINK`] and [`NO_RUN`] stay what they say.
static SINK_HASH: HashCell = HashCell::free();
/// See [`SINK_HASH`].
static SINK_LINK: LinkCell = LinkCell::free();

/// See [`SINK_HASH`].
pub(super) static SINK_RUN: RunSlot = RunSlot::empty();
