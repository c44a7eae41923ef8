//! Holder sets of the run index: which members hold every block of a run.
//!
//! A set is a bitmap over member ids. One 64-member window is kept inline in the run (a pod
//! fleet's first 64 members, or any set whose members fall in one window); a set spanning
//! windows `base .. base + len` keeps its `len` words in the pool ([`Words`], shared with
//! readers; [`WordPool`] is the writer's bookkeeping of it), so 1,024 holders cost 16 words,
//! never a list copied per change. Sets are values: a change builds a new set and releases the
//! old one, so two runs never share pool words, and a reader reads a run's words inside the
//! run's seqlock section (words released and reused under it fail the section's check).
//!
//! Invariant: a pooled set's words lie in one chunk of the pool (a reader's torn view of a
//! set's place is bounded by [`MAX_WORDS`] and by the chunks that exist).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use crate::index::chunked::Chunked;

/// Bits per window.
pub(super) const WINDOW: u32 = 64;

/// Bits of a pooled word's offset inside its chunk (64Ki words: 512 KiB). A pooled set never
/// straddles two chunks, so this also bounds a set: 64Ki windows.
pub(super) const WORD_BITS: u32 = 16;

/// Pooled holder words (sets wider than one window).
pub(super) type Words = Chunked<AtomicU64, { 1 << WORD_BITS }>;

/// Test hook: runs a check after every store the writer makes to shared memory (the cells'
/// and the holder words'), so a test sees every intermediate state a reader could land
/// between.
#[cfg(test)]
pub(super) mod probe {
    use std::cell::RefCell;

    thread_local! {
        static HOOK: RefCell<Option<Box<dyn FnMut()>>> = RefCell::new(None);
    }

    /// Installs `check` on this thread (`None`: removes it).
    pub fn install(check: Option<Box<dyn FnMut()>>) {
        HOOK.with(|h| *h.borrow_mut() = check);
    }

    /// Runs the installed check (not from inside itself).
    pub fn fire() {
        HOOK.with(|h| {
            if let Ok(mut h) = h.try_borrow_mut() {
                if let Some(check) = h.as_mut() {
                    check();
                }
            }
        });
    }
}

/// Runs the test hook after a store (nothing outside tests).
#[inline(always)]
pub(super) fn stored() {
    #[cfg(test)]
    probe::fire();
}

/// The longest pooled set (windows): one pool chunk.
pub(super) const MAX_WORDS: u32 = 1 << WORD_BITS;

/// A holder set. `len == 0`: empty; `len == 1`: `word` holds window `base`'s bits; `len > 1`:
/// `word` is the pool offset of the `len` words of windows `base ..`. Equality of pooled sets
/// is by content ([`WordPool::same`]), never by this struct.
#[derive(Clone, Copy, Debug, Default)]
pub struct Holders {
    base: u32,
    len: u32,
    word: u64,
}

/// The writer's bookkeeping of the pool: where the next fresh words are, free lists by length.
#[derive(Default)]
pub struct WordPool {
    /// The first word never handed out.
    top: u64,
    free: Vec<Vec<u32>>,
    /// Words handed out now.
    live: usize,
    /// Where [`WordPool::with`] assembles a set (kept: a change allocates nothing).
    scratch: Vec<u64>,
}

#[inline(always)]
fn word(words: &Words, at: u64) -> u64 {
    u32::try_from(at)
        .ok()
        .and_then(|at| words.get(at))
        .map_or(0, |w| w.load(Relaxed))
}

impl Holders {
    /// The set of one member.
    pub fn one(member: u32) -> Self {
        Self {
            base: member / WINDOW,
            len: 1,
            word: 1 << (member % WINDOW),
        }
    }

    /// A set from the fields a run slot stores.
    #[inline(always)]
    pub(super) fn from_parts(base: u32, len: u32, word: u64) -> Self {
        Self { base, len, word }
    }

    /// The fields a run slot stores.
    #[inline(always)]
    pub(super) fn parts(&self) -> (u32, u32, u64) {
        (self.base, self.len, self.word)
    }

    /// Whether no member holds the run.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the set's shape is one the writer builds (a torn read may show another).
    #[inline(always)]
    pub(super) fn is_plausible(&self) -> bool {
        self.len <= MAX_WORDS
    }

    /// The bits of window `w` (0 outside the set's windows).
    #[inline]
    pub fn bits_of(&self, w: u32, words: &Words) -> u64 {
        if w < self.base || w >= self.base + self.len {
            0
        } else if self.len == 1 {
            self.word
        } else {
            word(words, self.word + (w - self.base) as u64)
        }
    }

    /// Whether `member` is in the set.
    #[cfg(test)]
    pub fn contains(&self, member: u32, words: &Words) -> bool {
        self.bits_of(member / WINDOW, words) & (1 << (member % WINDOW)) != 0
    }

    /// Words `(window, bits)` of the set, in window order.
    #[inline]
    pub fn windows<'a>(&'a self, words: &'a Words) -> impl Iterator<Item = (u32, u64)> + 'a {
        (0..self.len).map(move |i| {
            let bits = match self.len {
                1 => self.word,
                _ => word(words, self.word + i as u64),
            };
            (self.base + i, bits)
        })
    }

    /// Members in the set.
    #[cfg(test)]
    pub fn count(&self, words: &Words) -> u32 {
        self.windows(words).map(|(_, b)| b.count_ones()).sum()
    }
}

impl WordPool {
    /// Words held by live sets (bytes: times 8).
    pub fn live_words(&self) -> usize {
        self.live
    }

    /// `len` words, in one chunk; `None` when the pool's chunks are all used.
    fn alloc(&mut self, len: u32, words: &Words) -> Option<u64> {
        if let Some(at) = self.free.get_mut(len as usize).and_then(Vec::pop) {
            self.live += len as usize;
            return Some(at as u64);
        }
        let chunk = 1u64 << WORD_BITS;
        let mut at = self.top;
        if at % chunk + len as u64 > chunk {
            at = at.div_ceil(chunk) * chunk; // never straddle chunks
        }
        let end = at + len as u64;
        if end > words.capacity() as u64 {
            return None;
        }
        words.get_or_alloc(u32::try_from(at).ok()?)?;
        self.top = end;
        self.live += len as usize;
        Some(at)
    }

    /// Returns a set's words to the pool (a set that is replaced or whose run died).
    pub fn release(&mut self, set: Holders) {
        if set.len > 1 {
            self.live -= set.len as usize;
            if self.free.len() <= set.len as usize {
                self.free.resize_with(set.len as usize + 1, Vec::new);
            }
            self.free[set.len as usize].push(set.word as u32);
        }
    }

    /// A copy of `set` the caller owns (a run split in two: each part owns its set); `None`
    /// when the pool is exhausted.
    pub fn copy(&mut self, set: Holders, words: &Words) -> Option<Holders> {
        if set.len <= 1 {
            return Some(set);
        }
        let at = self.alloc(set.len, words)?;
        for i in 0..set.len as u64 {
            let bits = word(words, set.word + i);
            store(words, at + i, bits);
        }
        Some(Holders { word: at, ..set })
    }

    /// Whether two sets have the same members.
    pub fn same(&self, a: &Holders, b: &Holders, words: &Words) -> bool {
        if a.base != b.base || a.len != b.len {
            return false;
        }
        match a.len {
            0 => true,
            1 => a.word == b.word,
            n => (0..n as u64).all(|i| word(words, a.word + i) == word(words, b.word + i)),
        }
    }

    /// `set` with `bits` of window `w` added (`present`) or removed, as a new set (the old
    /// one is not released); `None` when the pool is exhausted. Trims empty windows at either
    /// end, so equal sets have equal shapes.
    pub fn with(
        &mut self,
        set: &Holders,
        w: u32,
        bits: u64,
        present: bool,
        words: &Words,
    ) -> Option<Holders> {
        let (lo, hi) = if set.len == 0 {
            (w, w + 1)
        } else if present {
            (set.base.min(w), (set.base + set.len).max(w + 1))
        } else {
            (set.base, set.base + set.len)
        };
        // Assemble into the scratch window range, then trim.
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.resize((hi - lo) as usize, 0);
        for (win, word) in set.windows(words) {
            buf[(win - lo) as usize] = word;
        }
        if w >= lo && w < hi {
            let slot = &mut buf[(w - lo) as usize];
            if present {
                *slot |= bits;
            } else {
                *slot &= !bits;
            }
        }
        let first = buf.iter().position(|&b| b != 0);
        let last = buf.iter().rposition(|&b| b != 0);
        let set = match (first, last) {
            (Some(first), Some(last)) if first == last => Some(Holders {
                base: lo + first as u32,
                len: 1,
                word: buf[first],
            }),
            (Some(first), Some(last)) => {
                let len = (last - first + 1) as u32;
                self.alloc(len, words).map(|at| {
                    for (i, &bits) in buf[first..=last].iter().enumerate() {
                        store(words, at + i as u64, bits);
                    }
                    Holders {
                        base: lo + first as u32,
                        len,
                        word: at,
                    }
                })
            }
            _ => Some(Holders::default()),
        };
        self.scratch = buf;
        set
    }
}

/// Stores a pooled word the writer owns (allocated, not yet or no longer read by any run).
#[inline(always)]
fn store(words: &Words, at: u64, bits: u64) {
    if let Some(w) = u32::try_from(at).ok().and_then(|at| words.get(at)) {
        w.store(bits, Relaxed);
    }
    stored();
}

/// Who holds a run: engines holding it in GPU memory, one bit per engine, and the other tiers,
/// four bits per engine (`engine * 4 + tier`, bit 0 unused), in two sets. A fleet that only
/// reports GPU blocks never touches the second set, so its sets are an engine bitmap: 1,024
/// engines in 16 words. Owned like [`Holders`]: two runs never share words.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunHolders {
    /// Engines holding the run in GPU memory.
    pub gpu: Holders,
    /// `engine * 4 + tier` for tiers other than GPU.
    pub other: Holders,
}

/// Bits of an engine's tiers in the other-tiers set (tier 0, GPU, is never set there).
const OTHER_TIERS: u64 = 0xE;

impl RunHolders {
    /// `engine` alone, in `tier`.
    pub fn one(engine: u32, tier: u32) -> Self {
        match tier {
            0 => Self {
                gpu: Holders::one(engine),
                other: Holders::default(),
            },
            t => Self {
                gpu: Holders::default(),
                other: Holders::one(engine * 4 + t),
            },
        }
    }

    /// Whether no engine holds the run in any tier.
    pub fn is_empty(&self) -> bool {
        self.gpu.is_empty() && self.other.is_empty()
    }

    /// Whether the shapes are ones the writer builds (a torn read may show others).
    #[inline(always)]
    pub(super) fn is_plausible(&self) -> bool {
        self.gpu.is_plausible() && self.other.is_plausible()
    }

    /// `engine`'s tiers in the set: bit `t` for tier `t`.
    #[inline]
    pub fn nibble(&self, engine: u32, words: &Words) -> u64 {
        let gpu = (self.gpu.bits_of(engine / WINDOW, words) >> (engine % WINDOW)) & 1;
        let m = engine * 4;
        let other = (self.other.bits_of(m / WINDOW, words) >> (m % WINDOW)) & OTHER_TIERS;
        gpu | other
    }

    /// Every (engine, tier) membership, GPU first, each side in engine order.
    pub fn members<'a>(&'a self, words: &'a Words) -> impl Iterator<Item = (u32, u32)> + 'a {
        let gpu = self
            .gpu
            .windows(words)
            .flat_map(|(w, bits)| ones(bits).map(move |b| (w * WINDOW + b, 0)));
        let other = self.other.windows(words).flat_map(|(w, bits)| {
            ones(bits).map(move |b| ((w * WINDOW + b) / 4, (w * WINDOW + b) % 4))
        });
        gpu.chain(other)
    }

    /// The engines (of window `w`, 64 engines) holding the run in any tier.
    #[inline]
    pub fn engines_of(&self, w: u32, words: &Words) -> u64 {
        let mut engines = self.gpu.bits_of(w, words);
        if !self.other.is_empty() {
            // Engines 64w .. 64w + 64 are other-tier windows 4w .. 4w + 4 (16 engines each).
            for k in 0..4 {
                let bits = self.other.bits_of(w * 4 + k, words);
                for b in ones(bits) {
                    engines |= 1 << (k * 16 + b / 4);
                }
            }
        }
        engines
    }

    /// The engine windows the set spans (either side), as a range.
    pub fn engine_windows(&self) -> std::ops::Range<u32> {
        let (g0, g1) = (self.gpu.base, self.gpu.base + self.gpu.len);
        let (o0, o1) = (
            self.other.base / 4,
            (self.other.base + self.other.len).div_ceil(4),
        );
        match (self.gpu.is_empty(), self.other.is_empty()) {
            (true, true) => 0..0,
            (false, true) => g0..g1,
            (true, false) => o0..o1,
            (false, false) => g0.min(o0)..g1.max(o1),
        }
    }
}

/// The set bits of `bits`, lowest first.
#[inline]
fn ones(mut bits: u64) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        (bits != 0).then(|| {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            b
        })
    })
}

impl WordPool {
    /// Returns both sides' words.
    pub fn release_run(&mut self, set: RunHolders) {
        self.release(set.gpu);
        self.release(set.other);
    }

    /// A copy the caller owns; `None` when the pool is exhausted.
    pub fn copy_run(&mut self, set: RunHolders, words: &Words) -> Option<RunHolders> {
        let gpu = self.copy(set.gpu, words)?;
        match self.copy(set.other, words) {
            Some(other) => Some(RunHolders { gpu, other }),
            None => {
                self.release(gpu);
                None
            }
        }
    }

    /// Whether two runs have the same holders in every tier.
    pub fn same_run(&self, a: &RunHolders, b: &RunHolders, words: &Words) -> bool {
        self.same(&a.gpu, &b.gpu, words) && self.same(&a.other, &b.other, words)
    }

    /// `set` with `engine`'s tiers in `tiers` (bit `t`: tier `t`) added (`present`) or
    /// removed, as a new set that owns its words (the old one is not released); `None` when
    /// the pool is exhausted.
    pub fn with_tiers(
        &mut self,
        set: &RunHolders,
        engine: u32,
        tiers: u64,
        present: bool,
        words: &Words,
    ) -> Option<RunHolders> {
        let gpu = if tiers & 1 != 0 {
            let (w, bit) = (engine / WINDOW, 1u64 << (engine % WINDOW));
            self.with(&set.gpu, w, bit, present, words)?
        } else {
            self.copy(set.gpu, words)?
        };
        let other = if tiers & OTHER_TIERS != 0 {
            let m = engine * 4;
            let bits = (tiers & OTHER_TIERS) << (m % WINDOW);
            self.with(&set.other, m / WINDOW, bits, present, words)
        } else {
            self.copy(set.other, words)
        };
        match other {
            Some(other) => Some(RunHolders { gpu, other }),
            None => {
                self.release(gpu);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_across_windows_add_remove_and_compare_by_content() {
        let words = Words::new(1 << 20);
        let mut pool = WordPool::default();
        let one = |m: u32| (m / WINDOW, 1u64 << (m % WINDOW));
        let a = Holders::one(3);
        let (w, bit) = one(1000);
        let b = pool.with(&a, w, bit, true, &words).expect("room");
        assert!(b.contains(3, &words) && b.contains(1000, &words));
        assert!(!b.contains(999, &words) && !b.contains(64, &words));
        assert_eq!(b.count(&words), 2);
        let (w3, bit3) = one(3);
        let c = pool
            .with(&Holders::one(1000), w3, bit3, true, &words)
            .expect("room");
        assert!(pool.same(&b, &c, &words), "same members, different words");
        let d = pool.with(&b, w, bit, false, &words).expect("room");
        assert!(pool.same(&d, &a, &words), "trimmed back to one window");
        let e = pool.with(&d, w3, bit3, false, &words).expect("room");
        assert!(e.is_empty());
        pool.release(b);
        pool.release(c);
        assert_eq!(pool.live_words(), 0);
    }

    #[test]
    fn a_pooled_set_never_straddles_chunks_and_a_full_pool_says_so() {
        let words = Words::new(2 << WORD_BITS);
        let mut pool = WordPool {
            top: (1 << WORD_BITS) - 3,
            ..WordPool::default()
        };
        let at = pool.alloc(5, &words).expect("the second chunk has room");
        assert_eq!(at, 1 << WORD_BITS, "moved to the next chunk's start");
        pool.top = (2 << WORD_BITS) - 2;
        assert!(pool.alloc(5, &words).is_none(), "no third chunk");
    }
}
