//! The prefix store: earlier tokenizations, cut into text blocks, so a prompt that shares a long
//! prefix with an earlier one is not tokenized again (system prompts, multi-turn chats, RAG).
//!
//! A prompt is cut into blocks of `block_chars` characters (at character boundaries, so UTF-8
//! is never split). Block `i` is keyed by a chained hash of the scope (model and input kind) and
//! all text up to its end; its value is the tokens whose text ends inside it (by byte offset).
//! A lookup walks blocks from the start until the first miss; if the blocks found cover at least
//! `min_ratio` of the prompt's characters, their tokens are returned as they are (the uncovered
//! tail is not tokenized: the score then concerns the covered prefix). Otherwise the caller
//! tokenizes the whole prompt and [`PrefixStore::insert`]s it. Only full blocks are stored.
//!
//! Capacity is `capacity` blocks (moka evicts least recently / least frequently used).

use std::hash::Hasher;
use std::sync::Arc;

use rustc_hash::FxHasher;

/// The chain seed for a model and an input kind (`prompt` adds special tokens, `chat` not).
pub fn scope(model: &str, kind: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(model.as_bytes());
    h.write_u8(0xff);
    h.write(kind.as_bytes());
    h.finish()
}

/// What a stored block costs besides its token ids (key, entry and bookkeeping).
pub const BLOCK_OVERHEAD_BYTES: u64 = 64;

/// The cache of tokenized text blocks.
pub struct PrefixStore {
    blocks: moka::sync::Cache<u64, Arc<[u32]>>,
    block_chars: usize,
    min_ratio: f64,
}

/// Byte ranges of the full `block_chars`-character blocks of `text`, and its character count.
fn full_blocks(text: &str, block_chars: usize) -> (Vec<(usize, usize)>, usize) {
    let mut out = Vec::new();
    let mut chars = 0;
    let mut start = 0;
    for (i, (byte, _)) in text.char_indices().enumerate() {
        if i > 0 && i % block_chars == 0 {
            out.push((start, byte));
            start = byte;
        }
        chars += 1;
    }
    if chars > 0 && chars % block_chars == 0 {
        out.push((start, text.len()));
    }
    (out, chars)
}

fn chain(prev: u64, bytes: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(prev);
    h.write(bytes);
    // FxHash is weak on its own: finish with a mix so chained keys spread.
    let x = h.finish().wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 32)
}

impl PrefixStore {
    /// A store of `block_chars`-character blocks, bounded by `max_bytes` (a block weighs its
    /// token ids plus [`BLOCK_OVERHEAD_BYTES`]) and, for llm-d's `cacheSize`, by `capacity`
    /// blocks of that many tokens each.
    pub fn new(capacity: u64, max_bytes: u64, block_chars: usize, min_ratio: f64) -> Self {
        let block_chars = block_chars.max(1);
        let per_block = BLOCK_OVERHEAD_BYTES + 4 * block_chars as u64;
        let bytes = max_bytes.min(capacity.saturating_mul(per_block)).max(1);
        Self {
            blocks: moka::sync::Cache::builder()
                .weigher(|_, tokens: &Arc<[u32]>| {
                    u32::try_from(BLOCK_OVERHEAD_BYTES as usize + 4 * tokens.len())
                        .unwrap_or(u32::MAX)
                })
                .max_capacity(bytes)
                .build(),
            block_chars,
            min_ratio,
        }
    }

    /// Bytes held now, as weighed (approximate: moka applies evictions lazily).
    pub fn weighted_bytes(&self) -> u64 {
        self.blocks.run_pending_tasks();
        self.blocks.weighted_size()
    }

    /// Blocks held now (approximate: moka applies evictions lazily).
    pub fn len(&self) -> u64 {
        self.blocks.run_pending_tasks();
        self.blocks.entry_count()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached tokens of `text`'s longest stored prefix, if it covers enough of `text`.
    pub fn lookup(&self, scope: u64, text: &str) -> Option<Vec<u32>> {
        let (blocks, chars) = full_blocks(text, self.block_chars);
        if chars == 0 {
            return None;
        }
        let mut key = scope;
        let mut found = Vec::new();
        for &(s, e) in &blocks {
            key = chain(key, &text.as_bytes()[s..e]);
            match self.blocks.get(&key) {
                Some(tokens) => found.push(tokens),
                None => break,
            }
        }
        let covered = found.len() * self.block_chars;
        if found.is_empty() || (covered as f64) < self.min_ratio * chars as f64 {
            return None;
        }
        let mut ids = Vec::with_capacity(found.iter().map(|t| t.len()).sum());
        for t in found {
            ids.extend_from_slice(&t);
        }
        Some(ids)
    }

    /// Stores `text`'s full blocks with the tokens (ids and byte offsets) ending in each.
    pub fn insert(&self, scope: u64, text: &str, ids: &[u32], offsets: &[(usize, usize)]) {
        let (blocks, _) = full_blocks(text, self.block_chars);
        let mut key = scope;
        let mut t = 0;
        for (b, &(s, e)) in blocks.iter().enumerate() {
            key = chain(key, &text.as_bytes()[s..e]);
            let first = t;
            // A token belongs to the block its text ends in; tokens without text (a BOS at
            // offset (0, 0)) belong to the first block.
            while t < ids.len()
                && offsets
                    .get(t)
                    .is_some_and(|o| o.1 <= e && (o.1 > s || b == 0))
            {
                t += 1;
            }
            self.blocks.insert(key, ids[first..t].into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cut_at_character_boundaries() {
        let (b, n) = full_blocks("héllo wörld!", 4);
        assert_eq!(n, 12);
        assert_eq!(b.len(), 3);
        let text = "héllo wörld!";
        assert_eq!(&text[b[0].0..b[0].1], "héll");
        assert_eq!(&text[b[1].0..b[1].1], "o wö");
        let (b, _) = full_blocks("abcdefg", 4);
        assert_eq!(b, vec![(0, 4)], "the partial tail is not a block");
    }

    /// Character "tokenizer": one token per character, id = code point, byte offsets.
    fn chars(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
        text.char_indices()
            .map(|(i, c)| (c as u32, (i, i + c.len_utf8())))
            .unzip()
    }

    #[test]
    fn overlap_threshold_decides() {
        let store = PrefixStore::new(1000, u64::MAX, 4, 0.8);
        let s = scope("m", "prompt");
        let first = "0123456789abcdefghij"; // 5 blocks
        let (ids, offs) = chars(first);
        store.insert(s, first, &ids, &offs);
        assert_eq!(
            store.lookup(s, first),
            Some(ids.clone()),
            "everything cached"
        );
        // Shares 4 of 5 blocks (16 of 20 chars = 0.8): used, tail omitted.
        let hit = "0123456789abcdefXXXX";
        assert_eq!(store.lookup(s, hit), Some(ids[..16].to_vec()));
        // Shares 3 blocks of 5 (0.6 < 0.8): a miss.
        assert_eq!(store.lookup(s, "0123456789abXXXXXXXX"), None);
        assert_eq!(
            store.lookup(scope("other", "prompt"), first),
            None,
            "scopes are separate"
        );
    }

    #[test]
    fn unicode_and_tokens_spanning_blocks() {
        let store = PrefixStore::new(1000, u64::MAX, 3, 1.0);
        let s = scope("m", "chat");
        let text = "日本語のテキスト"; // 8 chars, 24 bytes: blocks of 3 chars = 9 bytes
                                       // Two-character tokens: one spans the first block boundary.
        let ids = vec![1, 2, 3, 4];
        let offs = vec![(0, 6), (6, 12), (12, 18), (18, 24)];
        store.insert(s, text, &ids, &offs);
        // Blocks: [0,9) [9,18); the 8th char is a partial tail. Token 1 ends at 6 (block 0),
        // token 2 ends at 12 (block 1), token 3 ends at 18 (block 1).
        let exact = "日本語のテキ";
        assert_eq!(store.lookup(s, exact), Some(vec![1, 2, 3]));
    }

    #[test]
    fn capacity_evicts() {
        let store = PrefixStore::new(10, u64::MAX, 2, 0.5);
        let s = scope("m", "prompt");
        for i in 0..100u32 {
            let text = format!("{i:04}abcdefgh");
            let (ids, offs) = chars(&text);
            store.insert(s, &text, &ids, &offs);
        }
        assert!(store.len() <= 10, "{}", store.len());
    }
}
