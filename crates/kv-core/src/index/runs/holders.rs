//! Holder sets of the run index: which members hold every block of a run.
//!
//! A set is a bitmap over member ids. One 64-member window is kept inline in the run (a pod
//! fleet's first 64 members, or any set whose members fall in one window); a set spanning
//! windows `base .. base + len` keeps its `len` words in the [`WordPool`], so 1,024 holders cost
//! 16 words, never a list copied per change. Sets are values: a change builds a new set and
//! releases the old one, so two runs never share pool words.

/// Bits per window.
const WINDOW: u32 = 64;

/// A holder set. `len == 0`: empty; `len == 1`: `word` holds window `base`'s bits; `len > 1`:
/// `word` is the pool offset of the `len` words of windows `base ..`. Equality of pooled sets
/// is by content ([`WordPool::same`]), never by this struct.
#[derive(Clone, Copy, Debug, Default)]
pub struct Holders {
    base: u32,
    len: u32,
    word: u64,
}

/// Storage for holder sets wider than one window, with free lists by length.
#[derive(Default)]
pub struct WordPool {
    words: Vec<u64>,
    free: Vec<Vec<u32>>,
    /// Words handed out now.
    live: usize,
    /// Where [`WordPool::with`] assembles a set (kept: a change allocates nothing).
    scratch: Vec<u64>,
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

    /// Whether no member holds the run.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `member` is in the set.
    #[inline]
    pub fn contains(&self, member: u32, pool: &WordPool) -> bool {
        let w = member / WINDOW;
        if w < self.base || w >= self.base + self.len {
            return false;
        }
        let bits = match self.len {
            1 => self.word,
            _ => pool.words[(self.word + (w - self.base) as u64) as usize],
        };
        bits & (1 << (member % WINDOW)) != 0
    }

    /// The bits of window `w` (0 outside the set's windows).
    #[inline]
    pub fn bits_of(&self, w: u32, pool: &WordPool) -> u64 {
        if w < self.base || w >= self.base + self.len {
            0
        } else if self.len == 1 {
            self.word
        } else {
            pool.words[(self.word + (w - self.base) as u64) as usize]
        }
    }

    /// Words `(window, bits)` of the set, in window order.
    #[inline]
    pub fn windows<'a>(&'a self, pool: &'a WordPool) -> impl Iterator<Item = (u32, u64)> + 'a {
        let words: &[u64] = match self.len {
            0 => &[],
            1 => std::slice::from_ref(&self.word),
            n => &pool.words[self.word as usize..self.word as usize + n as usize],
        };
        words
            .iter()
            .enumerate()
            .map(move |(i, &bits)| (self.base + i as u32, bits))
    }

    /// Members in the set.
    #[cfg(test)]
    pub fn count(&self, pool: &WordPool) -> u32 {
        self.windows(pool).map(|(_, b)| b.count_ones()).sum()
    }
}

impl WordPool {
    /// Words held by live sets (bytes: times 8).
    pub fn live_words(&self) -> usize {
        self.live
    }

    /// Bytes allocated for pooled words.
    pub fn allocated_bytes(&self) -> usize {
        self.words.capacity() * 8
    }

    fn alloc(&mut self, len: u32) -> u64 {
        self.live += len as usize;
        if let Some(at) = self.free.get_mut(len as usize).and_then(Vec::pop) {
            return at as u64;
        }
        let at = self.words.len();
        self.words.resize(at + len as usize, 0);
        at as u64
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

    /// A copy of `set` the caller owns (a run split in two: each part owns its set).
    pub fn copy(&mut self, set: Holders) -> Holders {
        if set.len <= 1 {
            return set;
        }
        let at = self.alloc(set.len);
        let (from, to) = (set.word as usize, at as usize);
        self.words.copy_within(from..from + set.len as usize, to);
        Holders { word: at, ..set }
    }

    /// Whether two sets have the same members.
    pub fn same(&self, a: &Holders, b: &Holders) -> bool {
        if a.base != b.base || a.len != b.len {
            return false;
        }
        match a.len {
            0 => true,
            1 => a.word == b.word,
            n => {
                let (x, y) = (a.word as usize, b.word as usize);
                self.words[x..x + n as usize] == self.words[y..y + n as usize]
            }
        }
    }

    /// `set` with `member` added or removed, as a new set (the old one is not released).
    /// Trims empty windows at either end, so equal sets have equal shapes.
    pub fn with(&mut self, set: &Holders, member: u32, present: bool) -> Holders {
        let w = member / WINDOW;
        let bit = 1u64 << (member % WINDOW);
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
        for (win, bits) in set.windows(self) {
            buf[(win - lo) as usize] = bits;
        }
        if w >= lo && w < hi {
            let slot = &mut buf[(w - lo) as usize];
            if present {
                *slot |= bit;
            } else {
                *slot &= !bit;
            }
        }
        let first = buf.iter().position(|&b| b != 0);
        let last = buf.iter().rposition(|&b| b != 0);
        let set = match (first, last) {
            (Some(first), Some(last)) if first == last => Holders {
                base: lo + first as u32,
                len: 1,
                word: buf[first],
            },
            (Some(first), Some(last)) => {
                let len = (last - first + 1) as u32;
                let at = self.alloc(len);
                self.words[at as usize..at as usize + len as usize]
                    .copy_from_slice(&buf[first..=last]);
                Holders {
                    base: lo + first as u32,
                    len,
                    word: at,
                }
            }
            _ => Holders::default(),
        };
        self.scratch = buf;
        set
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_across_windows_add_remove_and_compare_by_content() {
        let mut pool = WordPool::default();
        let a = Holders::one(3);
        let b = pool.with(&a, 1000, true);
        assert!(b.contains(3, &pool) && b.contains(1000, &pool));
        assert!(!b.contains(999, &pool) && !b.contains(64, &pool));
        assert_eq!(b.count(&pool), 2);
        let c = pool.with(&Holders::one(1000), 3, true);
        assert!(pool.same(&b, &c), "same members, different pool words");
        let d = pool.with(&b, 1000, false);
        assert!(pool.same(&d, &a), "trimmed back to one inline window");
        let e = pool.with(&d, 3, false);
        assert!(e.is_empty());
        pool.release(b);
        pool.release(c);
        assert_eq!(pool.live_words(), 0);
    }
}
