//! The digest memo: block digests computed for earlier prompts, reused when a prompt repeats
//! their prefix (a shared system prompt, the earlier turns of a chat, a RAG document), so that
//! ScorePods hashes only what it has not seen.
//!
//! A table of entries `(parent digest tail, unit tokens) -> child digest` in buckets of two
//! (two-way set associative: two hot units that land in one bucket both stay, where a
//! direct-mapped table lost about a fifth of the loadgen's hits to such pairs). The bucket is
//! chosen by a fast rolling hash of the prompt up to the unit (computed for the whole prompt
//! first, so every bucket can be prefetched before it is needed); a new entry takes a way
//! never written, else a random one (no stale entry is pinned). A hit is *verified*
//! against the actual parent digest's last 8 bytes and the unit's tokens, so a hit returns
//! exactly what SHA-256 would: the 64 bits checked are the bits the index keys blocks by, so
//! a wrong hit needs the very collision that would already merge two blocks in the index.
//!
//! Invariants:
//! - only units without extra keys are memoised (no LoRA, multimodal item or salt): the entry
//!   key holds tokens and parent only;
//! - one memo serves every processor of its unit size: equal settings give equal digests, and
//!   different seeds give different roots, hence different parents;
//! - entries are claimed seqlocks ([`crate::seqlock`]): any number of callers read and write
//!   at once without a lock; a reader never waits (a write under way is a miss) and never keeps
//!   a torn entry; a writer that finds the entry claimed skips it;
//! - memory is fixed at construction: what input can change is which prompts are kept, never
//!   how much is kept.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::memory::{advise_huge, prefetch_read, zeroed_slice, CacheLine as Line};
use crate::seqlock::{StdFence, PROTOCOL};

use super::BlockDigest;

/// 32-bit words per cache line.
const LINE_WORDS: usize = 16;
/// Words before an entry's tokens: sequence, parent tail (2), child digest (8).
const HEAD_WORDS: usize = 11;
/// Entries per bucket.
const WAYS: usize = 2;

/// A memo's work so far (units, not calls) and its size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoStats {
    /// Units whose digest came from the memo.
    pub hits: u64,
    /// Units hashed with SHA-256 (and offered to the memo).
    pub misses: u64,
    /// Bytes of entry storage.
    pub bytes: u64,
}

impl std::ops::AddAssign for MemoStats {
    fn add_assign(&mut self, other: Self) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes += other.bytes;
    }
}

/// A fixed-size, lock-free memo of block digests for one hash unit size.
pub struct DigestMemo {
    lines: Box<[Line]>,
    unit: usize,
    lines_per_entry: usize,
    entries: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for DigestMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DigestMemo")
            .field("unit", &self.unit)
            .field("entries", &self.entries)
            .finish()
    }
}

impl DigestMemo {
    /// A memo for units of `unit` tokens in at most `bytes` (at least one entry).
    pub fn new(unit: usize, bytes: usize) -> Self {
        let unit = unit.max(1);
        let lines_per_entry = (HEAD_WORDS + unit).div_ceil(LINE_WORDS);
        let buckets = (bytes / (WAYS * lines_per_entry * std::mem::size_of::<Line>())).max(1);
        let entries = buckets * WAYS;
        // Zeroed (pages fault in as entries are first used): an all-zero entry is unclaimed
        // and matches only zero tokens after a parent whose tail is 0, the same 2^-64 bar as
        // every hit.
        let lines = zeroed_slice(entries * lines_per_entry);
        advise_huge(&lines);
        Self {
            lines,
            unit,
            lines_per_entry,
            entries,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Tokens per entry: the hash unit this memo serves.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Entries (units remembered at most).
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Bytes of entry storage.
    pub fn allocated_bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }

    /// Hits and misses so far, and the memo's size.
    pub fn stats(&self) -> MemoStats {
        MemoStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: self.allocated_bytes() as u64,
        }
    }

    /// Adds one prompt's tallies (one update per prompt, not per unit).
    pub(super) fn count(&self, hits: u64, misses: u64) {
        if hits > 0 {
            self.hits.fetch_add(hits, Ordering::Relaxed);
        }
        if misses > 0 {
            self.misses.fetch_add(misses, Ordering::Relaxed);
        }
    }

    /// The rolling key after one more unit: a fast mix of every token so far. It only picks
    /// the entry; a hit is verified, so its quality bounds the hit rate, not the result.
    ///
    /// The unit's tokens are folded in four independent lanes (pairs 0, 4, 8, ... in the
    /// first), which do not depend on `key`, and only the lanes' sum is mixed into it: the
    /// chain from one unit's key to the next is one `mix64`, not a multiply per token pair
    /// (the one-lane fold was a third of a memo-hit prompt's time).
    #[inline(always)]
    pub(super) fn chain(key: u64, tokens: &[u32]) -> u64 {
        const M: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut lanes = [M, M.rotate_left(16), M.rotate_left(32), M.rotate_left(48)];
        let groups = tokens.chunks_exact(8);
        let rest = groups.remainder();
        for group in groups {
            for (lane, pair) in lanes.iter_mut().zip(group.chunks_exact(2)) {
                let word = pair[0] as u64 | (pair[1] as u64) << 32;
                *lane = (*lane ^ word).wrapping_mul(M).rotate_left(29);
            }
        }
        for pair in rest.chunks(2) {
            let word = pair[0] as u64 | (pair.get(1).copied().unwrap_or(0) as u64) << 32;
            lanes[0] = (lanes[0] ^ word).wrapping_mul(M).rotate_left(29);
        }
        let unit = lanes[0]
            ^ lanes[1].rotate_left(17)
            ^ lanes[2].rotate_left(31)
            ^ lanes[3].rotate_left(47)
            ^ tokens.len() as u64;
        crate::mix64(key.wrapping_mul(M) ^ unit)
    }

    /// The bucket a rolling key selects (multiply-shift onto the buckets).
    #[inline(always)]
    pub(super) fn bucket_of(&self, key: u64) -> usize {
        (((key >> 32) * (self.entries / WAYS) as u64) >> 32) as usize
    }

    /// An entry's lines: the head (sequence, parent tail, child) in the first line, the
    /// tokens from word [`HEAD_WORDS`] on.
    #[inline(always)]
    fn lines_of(&self, entry: usize) -> (&Line, &[Line]) {
        let start = entry * self.lines_per_entry;
        let lines = &self.lines[start..start + self.lines_per_entry];
        (&lines[0], &lines[1..])
    }

    /// Whether an entry's token words hold `tokens` (relaxed loads, line by line).
    #[inline(always)]
    fn tokens_match(head: &Line, rest: &[Line], tokens: &[u32]) -> bool {
        let (first, more) = tokens.split_at(tokens.len().min(LINE_WORDS - HEAD_WORDS));
        let same = |words: &[AtomicU32], part: &[u32]| {
            words
                .iter()
                .zip(part)
                .all(|(w, &t)| w.load(Ordering::Relaxed) == t)
        };
        same(&head.0[HEAD_WORDS..], first)
            && rest
                .iter()
                .zip(more.chunks(LINE_WORDS))
                .all(|(line, part)| same(&line.0, part))
    }

    /// Writes `tokens` into an entry's token words (relaxed stores, line by line).
    #[inline(always)]
    fn store_tokens(head: &Line, rest: &[Line], tokens: &[u32]) {
        let (first, more) = tokens.split_at(tokens.len().min(LINE_WORDS - HEAD_WORDS));
        let store = |words: &[AtomicU32], part: &[u32]| {
            for (w, &t) in words.iter().zip(part) {
                w.store(t, Ordering::Relaxed);
            }
        };
        store(&head.0[HEAD_WORDS..], first);
        for (line, part) in rest.iter().zip(more.chunks(LINE_WORDS)) {
            store(&line.0, part);
        }
    }

    /// Hints the CPU to fetch a bucket's lines (its entries are adjacent).
    #[inline(always)]
    pub(super) fn prefetch(&self, bucket: usize) {
        let first = bucket * WAYS * self.lines_per_entry;
        for line in &self.lines[first..first + WAYS * self.lines_per_entry] {
            prefetch_read(line as *const Line as *const u8);
        }
    }

    /// The child digest remembered for `(parent_tail, tokens)` in `bucket`, if it holds it.
    #[inline(always)]
    pub(super) fn get(
        &self,
        bucket: usize,
        parent_tail: u64,
        tokens: &[u32],
    ) -> Option<BlockDigest> {
        (bucket * WAYS..(bucket + 1) * WAYS)
            .find_map(|entry| self.get_entry(entry, parent_tail, tokens))
    }

    /// Remembers `(parent_tail, tokens) -> child` in `bucket`: in a way never written if there
    /// is one, else in a random way (skipped if another caller is writing that entry).
    #[inline(always)]
    pub(super) fn put(&self, bucket: usize, parent_tail: u64, tokens: &[u32], child: &BlockDigest) {
        let first = bucket * WAYS;
        let way = (0..WAYS)
            .find(|&way| self.lines_of(first + way).0 .0[0].load(Ordering::Relaxed) == 0)
            .unwrap_or_else(random_way);
        self.put_entry(first + way, parent_tail, tokens, child);
    }

    /// The child digest remembered for `(parent_tail, tokens)` in `entry`, if that is what the
    /// entry holds.
    #[inline(always)]
    fn get_entry(&self, entry: usize, parent_tail: u64, tokens: &[u32]) -> Option<BlockDigest> {
        if tokens.len() != self.unit {
            return None;
        }
        let (head, rest) = self.lines_of(entry);
        let w = &head.0;
        PROTOCOL
            .try_read::<_, StdFence, _>(&w[0], || {
                let tail = w[1].load(Ordering::Relaxed) as u64
                    | (w[2].load(Ordering::Relaxed) as u64) << 32;
                let same = tail == parent_tail && Self::tokens_match(head, rest, tokens);
                let mut child = [0u8; 32];
                if same {
                    for (bytes, word) in child.chunks_exact_mut(4).zip(&w[3..HEAD_WORDS]) {
                        bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
                    }
                }
                same.then_some(child)
            })
            .flatten()
    }

    /// Remembers `(parent_tail, tokens) -> child` in `entry`, replacing what it held, unless
    /// another caller is writing it right now.
    #[inline(always)]
    fn put_entry(&self, entry: usize, parent_tail: u64, tokens: &[u32], child: &BlockDigest) {
        if tokens.len() != self.unit {
            return;
        }
        let (head, rest) = self.lines_of(entry);
        let w = &head.0;
        PROTOCOL.try_write::<_, StdFence, _>(&w[0], || {
            w[1].store(parent_tail as u32, Ordering::Relaxed);
            w[2].store((parent_tail >> 32) as u32, Ordering::Relaxed);
            for (bytes, word) in child.chunks_exact(4).zip(&w[3..HEAD_WORDS]) {
                let value = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                word.store(value, Ordering::Relaxed);
            }
            Self::store_tokens(head, rest, tokens);
        });
    }
}

/// A way chosen at random (a per-thread xorshift): which entry of a full bucket a new one
/// replaces.
fn random_way() -> usize {
    thread_local! {
        static STATE: Cell<u32> = const { Cell::new(0x9E37_79B9) };
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        state.set(x);
        x as usize % WAYS
    })
}

/// The last 8 bytes of a digest, as a number (what a memo entry checks its parent by).
#[inline(always)]
pub(super) fn digest_tail(digest: &BlockDigest) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..32]);
    u64::from_le_bytes(tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_answers_only_its_own_parents_and_tokens() {
        let memo = DigestMemo::new(4, 4096);
        assert_eq!(memo.entries(), 64, "one line per entry, two per bucket");
        memo.put(0, 42, &[1, 2, 3, 4], &[7u8; 32]);
        assert_eq!(memo.get(0, 42, &[1, 2, 3, 4]), Some([7u8; 32]));
        assert_eq!(memo.get(0, 43, &[1, 2, 3, 4]), None, "another parent");
        assert_eq!(memo.get(0, 42, &[1, 2, 3, 5]), None, "another token");
        assert_eq!(memo.get(0, 42, &[1, 2, 3]), None, "another length");
        assert_eq!(memo.get(1, 42, &[1, 2, 3, 4]), None, "another bucket");
        // A second unit in the bucket takes the free way: both stay.
        memo.put(0, 43, &[1, 2, 3, 4], &[9u8; 32]);
        assert_eq!(memo.get(0, 42, &[1, 2, 3, 4]), Some([7u8; 32]));
        assert_eq!(memo.get(0, 43, &[1, 2, 3, 4]), Some([9u8; 32]));
        // A third replaces one of them.
        memo.put(0, 44, &[1, 2, 3, 4], &[5u8; 32]);
        assert_eq!(memo.get(0, 44, &[1, 2, 3, 4]), Some([5u8; 32]));
        let kept = [42, 43]
            .into_iter()
            .filter(|&tail| memo.get(0, tail, &[1, 2, 3, 4]).is_some())
            .count();
        assert_eq!(kept, 1, "one of the two older units was replaced");
    }

    #[test]
    fn a_claimed_entry_reads_as_a_miss_and_skips_a_second_writer() {
        let memo = DigestMemo::new(2, 4096);
        memo.put(1, 5, &[1, 2], &[3u8; 32]);
        memo.put(1, 6, &[1, 2], &[4u8; 32]);
        // Claim both entries of bucket 1 as writers in progress would (odd sequence).
        let seqs = [&memo.lines_of(2).0 .0[0], &memo.lines_of(3).0 .0[0]];
        let even: Vec<u32> = seqs.iter().map(|s| s.load(Ordering::Relaxed)).collect();
        for (seq, &e) in seqs.iter().zip(&even) {
            seq.store(e + 1, Ordering::Relaxed);
        }
        assert_eq!(memo.get(1, 5, &[1, 2]), None, "a write under way is a miss");
        memo.put(1, 7, &[1, 2], &[8u8; 32]);
        for (seq, &e) in seqs.iter().zip(&even) {
            seq.store(e, Ordering::Relaxed);
        }
        assert_eq!(memo.get(1, 5, &[1, 2]), Some([3u8; 32]));
        assert_eq!(memo.get(1, 6, &[1, 2]), Some([4u8; 32]));
        assert_eq!(
            memo.get(1, 7, &[1, 2]),
            None,
            "the writer skipped the claimed entry"
        );
    }

    #[test]
    fn size_is_fixed_by_bytes_and_unit() {
        let memo = DigestMemo::new(16, 1 << 20);
        assert_eq!(
            memo.lines_per_entry, 2,
            "11 head words + 16 tokens fit two lines"
        );
        assert_eq!(memo.entries(), (1 << 20) / 128);
        assert_eq!(memo.allocated_bytes(), 1 << 20);
        let wide = DigestMemo::new(64, 1 << 20);
        assert_eq!(wide.lines_per_entry, 5);
        assert_eq!(DigestMemo::new(16, 1).entries(), 2, "at least one bucket");
    }

    /// How a rolling key spreads units over 8,192 buckets: (buckets filled by 4,096 units of
    /// 64 prompts, buckets of one unit after 1,000 different first units, units of 1,000 that
    /// move when two of their tokens are swapped).
    fn spread(chain: fn(u64, &[u32]) -> u64) -> (usize, usize, usize) {
        use std::collections::HashSet;
        let memo = DigestMemo::new(16, 8192 * 2 * 128);
        let mut rng = crate::SplitMix64::new(7);
        let mut unit =
            || -> Vec<u32> { (0..16).map(|_| rng.next_u64() as u32 % 150_000).collect() };
        let mut filled = HashSet::new();
        for _ in 0..64 {
            let mut key = 0;
            for _ in 0..64 {
                key = chain(key, &unit());
                filled.insert(memo.bucket_of(key));
            }
        }
        let second = unit();
        let after: HashSet<usize> = (0..1_000)
            .map(|_| memo.bucket_of(chain(chain(0, &unit()), &second)))
            .collect();
        let moved = (0..1_000)
            .filter(|k| {
                let a = unit();
                let mut b = a.clone();
                let i = k % 16;
                b.swap(i, (i + 1 + (k / 16) % 15) % 16);
                memo.bucket_of(chain(3, &a)) != memo.bucket_of(chain(3, &b))
            })
            .count();
        (filled.len(), after.len(), moved)
    }

    /// The rolling key picks buckets as a random function would: units spread over the
    /// buckets (a random function fills 8,192 * (1 - e^-0.5) = 3,223 on average), the same
    /// unit after another prefix lands elsewhere, and so does a unit with two tokens swapped.
    /// A key that ignored the prefix or the order (the negative control) piles units into
    /// few buckets, and the memo would lose hits to its two ways.
    #[test]
    fn the_rolling_key_spreads_units_like_a_random_function() {
        let (filled, after, moved) = spread(DigestMemo::chain);
        assert!(filled > 3_100, "{filled} buckets for 4,096 units");
        assert!(after > 900, "{after} buckets for 1,000 prefixes");
        assert!(moved > 990, "{moved} of 1,000 swaps moved the unit");
        let blind = |_key: u64, tokens: &[u32]| {
            crate::mix64(tokens.iter().fold(0u64, |h, &t| h.wrapping_add(t as u64)))
        };
        let (_, after, moved) = spread(blind);
        assert!(
            after <= 1 && moved == 0,
            "the control must fail: {after} buckets, {moved} moved"
        );
    }
}
