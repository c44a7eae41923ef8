//! The token processor: vLLM's prefix-cache block hashes (`--prefix-caching-hash-algo
//! sha256_cbor`), recomputed byte for byte from token ids.
//!
//! A block's digest is `sha256(cbor((parent_digest, tuple(tokens), extra_keys_or_None)))`
//! with canonical CBOR; block 0's parent is `NONE_HASH = sha256(cbor(text seed))`, the seed
//! being `PYTHONHASHSEED` or, when unset, vLLM's (>= 0.29) default `"vllm-none-hash"`. The key
//! the index uses is the event form: the digest's last 8 bytes, big-endian (what vLLM publishes
//! with its default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
//!
//! Invariants:
//! - only full blocks are hashed; a partial tail never is;
//! - hashing a prompt allocates nothing per block: one scratch buffer is reused for every
//!   block's CBOR input, and request-wide extra keys (LoRA) are encoded once per request;
//! - with a hash unit smaller than the group block size (hybrid models), hashes are chained at
//!   the unit and the group's block `i` is the chained hash at unit `(i+1)*k - 1` (vLLM >= 0.24;
//!   in int mode the same value 0.12-0.23 published);
//! - with lookahead hashing (vLLM >= 0.33, [`lookahead`]) a unit's extra keys also hold the
//!   `L` tokens after it, and units without `L` tokens after them are not hashed.

mod cbor;
mod lookahead;
mod memo;

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::BlockHash;
use memo::digest_tail;
pub use memo::{DigestMemo, MemoStats};

/// How many units ahead of the one in hand the memoised path prefetches entries: enough to
/// cover a miss's latency while the unit in hand is verified or hashed.
const MEMO_PREFETCH_AHEAD: usize = 8;

/// vLLM's root seed when `PYTHONHASHSEED` is unset (vLLM >= 0.29, `DEFAULT_NONE_HASH_SEED`).
pub const DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// A full 32-byte block digest, as vLLM keeps it internally.
pub type BlockDigest = [u8; 32];

/// The index key of a digest: its last 8 bytes, big-endian (what an aligned engine's KV events
/// carry for it).
#[inline(always)]
pub fn event_hash(digest: &BlockDigest) -> BlockHash {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..32]);
    BlockHash::new(u64::from_be_bytes(tail))
}

/// Which vLLM release line's extra-key encoding to reproduce (`docs/vllm-compatibility.md` §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExtraKeysFormat {
    /// vLLM 0.31 and later: tagged tuples, `("lora", name, path)`, `("mm", id, offset)`,
    /// `("cache_salt", salt)`. The LoRA path is part of the hash.
    #[default]
    Tagged,
    /// vLLM 0.14 to 0.30: the bare LoRA name first, `(id, offset)` for multimodal items
    /// (0.19+), the bare salt string.
    Untagged,
}

/// The settings a model's keys depend on, as state that outlives the process carries them
/// (a snapshot): keys made under one key space mean nothing under another, so state from
/// another key space is never loaded as keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpace {
    /// The root digest (from the hash seed).
    pub none_hash: BlockDigest,
    /// Tokens per key (`blockSize`).
    pub block_size: u32,
    /// Tokens per chained hash unit.
    pub hash_block_size: u32,
    /// The extra-key encoding.
    pub extra_keys_format: ExtraKeysFormat,
    /// Tokens after each block its key covers (vLLM's `num_hash_lookahead_tokens`; 0: none,
    /// or not learned yet). A model's, learned from its events, not a processor setting.
    pub lookahead: u32,
}

/// A LoRA adapter as vLLM hashes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    /// `LoRARequest.lora_name`: what events publish as `lora_name`.
    pub name: String,
    /// `LoRARequest.lora_path`: hashed by vLLM >= 0.31 but never published, so configuration
    /// maps adapter names to paths.
    pub path: String,
}

/// A multimodal item's placeholder range in the prompt, with its content identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiModalItem {
    /// The item's content hash (`mm_feature.identifier`).
    pub identifier: String,
    /// First placeholder token of the item.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// The request-level inputs that become per-block extra keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// The LoRA adapter the request runs under, if any.
    pub lora: Option<LoraAdapter>,
    /// Items sorted by offset, as vLLM assumes.
    pub multimodal: Vec<MultiModalItem>,
    /// `cache_salt`: only block 0 carries it.
    pub cache_salt: Option<String>,
}

impl RequestExtras {
    /// True when no block of the request has extra keys (the common case: `None` / CBOR `f6`).
    pub fn is_empty(&self) -> bool {
        self.lora.is_none() && self.multimodal.is_empty() && self.cache_salt.is_none()
    }
}

/// Why a token processor could not be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TokenProcessorError {
    /// A block size of zero hashes nothing.
    #[error("blockSize must be at least 1")]
    ZeroBlockSize,
    /// The hash unit must divide the group block size (vLLM views k consecutive hash units).
    #[error(
        "hashBlockSize {hash_block_size} must be at least 1 and divide blockSize {block_size}"
    )]
    BadHashBlockSize {
        /// The configured group block size.
        block_size: usize,
        /// The configured hash unit.
        hash_block_size: usize,
    },
}

/// Settings that must equal the vLLM fleet's for hashes to match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenProcessorConfig {
    /// `PYTHONHASHSEED` of the vLLM processes; `None` means unset (vLLM >= 0.29 default).
    pub hash_seed: Option<String>,
    /// The KV-cache block size of the group the events describe (vLLM `--block-size`).
    pub block_size: usize,
    /// The hash unit, when smaller than `block_size` (hybrid models); `None` = `block_size`.
    pub hash_block_size: Option<usize>,
    /// Which release line's extra-key encoding to use.
    pub extra_keys_format: ExtraKeysFormat,
}

impl Default for TokenProcessorConfig {
    fn default() -> Self {
        Self {
            hash_seed: None,
            block_size: 16,
            hash_block_size: None,
            extra_keys_format: ExtraKeysFormat::Tagged,
        }
    }
}

/// Recomputes vLLM block hashes; cheap to share (`&self` methods, no interior state).
#[derive(Debug, Clone)]
pub struct TokenProcessor {
    config: TokenProcessorConfig,
    none_hash: BlockDigest,
    block_size: usize,
    hash_block_size: usize,
    format: ExtraKeysFormat,
}

/// `NONE_HASH` for a seed: sha256 of the seed as a CBOR text string.
pub fn none_hash(seed: Option<&str>) -> BlockDigest {
    let mut input = Vec::with_capacity(40);
    cbor::write_text(&mut input, seed.unwrap_or(DEFAULT_HASH_SEED));
    Sha256::digest(&input).into()
}

/// Reusable per-thread buffers, so hashing a prompt allocates nothing per block.
#[derive(Debug, Default)]
pub struct HashScratch {
    /// One block's CBOR input; cleared and refilled for each block.
    input: Vec<u8>,
    /// The request-wide extra keys (LoRA) encoded once, reused for every block.
    constant_extras: Vec<u8>,
    /// The memo bucket of every unit of the prompt in hand (memoised path only).
    memo_buckets: Vec<usize>,
}

impl TokenProcessor {
    /// Builds a processor, validating the block sizes.
    pub fn new(config: &TokenProcessorConfig) -> Result<Self, TokenProcessorError> {
        if config.block_size == 0 {
            return Err(TokenProcessorError::ZeroBlockSize);
        }
        let hash_block_size = config.hash_block_size.unwrap_or(config.block_size);
        if hash_block_size == 0 || !config.block_size.is_multiple_of(hash_block_size) {
            return Err(TokenProcessorError::BadHashBlockSize {
                block_size: config.block_size,
                hash_block_size,
            });
        }
        Ok(Self {
            config: config.clone(),
            none_hash: none_hash(config.hash_seed.as_deref()),
            block_size: config.block_size,
            hash_block_size,
            format: config.extra_keys_format,
        })
    }

    /// The settings this processor was built from.
    pub fn config(&self) -> &TokenProcessorConfig {
        &self.config
    }

    /// The root parent all chains start from.
    pub fn none_hash(&self) -> &BlockDigest {
        &self.none_hash
    }

    /// The group block size: one index key per this many tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The unit hashes are chained at (equals `block_size` except for hybrid models).
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// The extra-key encoding in use.
    pub fn extra_keys_format(&self) -> ExtraKeysFormat {
        self.format
    }

    /// What decides the keys this processor gives a prompt (seed, block sizes, extra-key
    /// encoding): two processors with equal key spaces key every prompt alike. Without
    /// lookahead: a model's is `ModelState::key_space`.
    pub fn key_space(&self) -> KeySpace {
        KeySpace {
            none_hash: self.none_hash,
            block_size: self.block_size as u32,
            hash_block_size: self.hash_block_size as u32,
            extra_keys_format: self.format,
            lookahead: 0,
        }
    }

    /// The one hashing loop: chains every full hash unit of `tokens` and calls
    /// `observe(unit_index, cbor_input, digest)` for each, in order.
    pub fn for_each_unit(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        observe: impl FnMut(usize, &[u8], &BlockDigest),
    ) {
        self.for_each_unit_after(&self.none_hash, tokens, extras, scratch, observe);
    }

    /// [`TokenProcessor::for_each_unit`] for tokens that continue a chain whose last digest
    /// is `parent` (the root's is [`TokenProcessor::none_hash`]). Positions in `extras` count
    /// from the first of `tokens`, so a continued chain passes no `cache_salt` (it belongs
    /// to the prompt's first block) and no multimodal items.
    pub fn for_each_unit_after(
        &self,
        parent: &BlockDigest,
        tokens: &[u32],
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        observe: impl FnMut(usize, &[u8], &BlockDigest),
    ) {
        self.for_each_unit_after_lookahead(parent, tokens, 0, extras, scratch, observe);
    }

    /// [`TokenProcessor::for_each_unit_after`] for an engine hashing with `lookahead` tokens
    /// after each unit (vLLM >= 0.33, `num_hash_lookahead_tokens`; 0: plain): each unit of
    /// `tokens` followed by `lookahead` more tokens, its extra keys `(E, *next_tokens)`
    /// ([`lookahead`]). A translated run passes its `token_ids` followed by its last block's
    /// `lookahead_token_ids`. The chaining loop of every path but the memoised one.
    pub fn for_each_unit_after_lookahead(
        &self,
        parent: &BlockDigest,
        tokens: &[u32],
        lookahead: usize,
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        mut observe: impl FnMut(usize, &[u8], &BlockDigest),
    ) {
        let unit = self.hash_block_size;
        scratch.constant_extras.clear();
        if let Some(lora) = &extras.lora {
            encode_lora(&mut scratch.constant_extras, lora, self.format);
        }
        let plain = extras.is_empty();
        let mut parent = *parent;
        let mut mm_cursor = 0usize;
        let units = tokens.len().saturating_sub(lookahead) / unit;
        for unit_index in 0..units {
            let start = unit_index * unit;
            let end = start + unit;
            let input = &mut scratch.input;
            write_unit_head(input, &parent, &tokens[start..end]);
            if lookahead > 0 {
                mm_cursor = lookahead::write_extras(
                    input,
                    extras,
                    &scratch.constant_extras,
                    self.format,
                    (start, end),
                    &tokens[end..end + lookahead],
                    mm_cursor,
                );
            } else if plain {
                input.push(cbor::NULL);
            } else {
                mm_cursor = write_block_extras(
                    input,
                    extras,
                    &scratch.constant_extras,
                    self.format,
                    start,
                    end,
                    mm_cursor,
                );
            }
            parent = Sha256::digest(input.as_slice()).into();
            observe(unit_index, input, &parent);
        }
    }

    /// Hashes every full block of `tokens`, calling `emit(block_index, digest)` in order. For
    /// hybrid models a block is `k` hash units and its digest is the chained digest at its last
    /// unit.
    pub fn for_each_block(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        emit: impl FnMut(usize, &BlockDigest),
    ) {
        self.chain_blocks(tokens, 0, extras, scratch, emit);
    }

    /// [`TokenProcessor::for_each_block`] with `lookahead` tokens after each unit in its hash
    /// (0: none): a block is `k` units and its digest the chained digest at its last unit.
    fn chain_blocks(
        &self,
        tokens: &[u32],
        lookahead: usize,
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        mut emit: impl FnMut(usize, &BlockDigest),
    ) {
        let group = self.block_size / self.hash_block_size;
        let root = self.none_hash;
        self.for_each_unit_after_lookahead(
            &root,
            tokens,
            lookahead,
            extras,
            scratch,
            |unit, _, digest| {
                if (unit + 1) % group == 0 {
                    emit(unit / group, digest);
                }
            },
        );
    }

    /// Appends the event-form hash of every full block to `out`.
    pub fn block_hashes_into(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        out: &mut Vec<BlockHash>,
    ) {
        out.reserve(tokens.len() / self.block_size);
        self.for_each_block(tokens, extras, scratch, |_, digest| {
            out.push(event_hash(digest))
        });
    }

    /// [`TokenProcessor::block_hashes_into`] through a digest memo: units seen before (after
    /// the same parent) are taken from `memo`, the others hashed and offered to it. The result
    /// is identical; requests with extra keys, and a memo of another unit size, hash as usual.
    /// Returns the units taken from the memo.
    pub fn block_hashes_memo_into(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        memo: &DigestMemo,
        scratch: &mut HashScratch,
        out: &mut Vec<BlockHash>,
    ) -> usize {
        let unit = self.hash_block_size;
        if !extras.is_empty() || memo.unit() != unit {
            self.block_hashes_into(tokens, extras, scratch, out);
            return 0;
        }
        out.reserve(tokens.len() / self.block_size);
        let group = self.block_size / unit;
        scratch.memo_buckets.clear();
        let mut key = digest_tail(&self.none_hash);
        for chunk in tokens.chunks_exact(unit) {
            key = DigestMemo::chain(key, chunk);
            scratch.memo_buckets.push(memo.bucket_of(key));
        }
        for &bucket in scratch.memo_buckets.iter().take(MEMO_PREFETCH_AHEAD) {
            memo.prefetch(bucket);
        }
        let (mut hits, mut misses) = (0usize, 0usize);
        let mut parent = self.none_hash;
        let mut units_left = group;
        for (unit_index, chunk) in tokens.chunks_exact(unit).enumerate() {
            if let Some(&ahead) = scratch.memo_buckets.get(unit_index + MEMO_PREFETCH_AHEAD) {
                memo.prefetch(ahead);
            }
            let bucket = scratch.memo_buckets[unit_index];
            let parent_tail = digest_tail(&parent);
            if let Some(child) = memo.get(bucket, parent_tail, chunk) {
                parent = child;
                hits += 1;
            } else {
                write_unit_head(&mut scratch.input, &parent, chunk);
                scratch.input.push(cbor::NULL);
                parent = Sha256::digest(scratch.input.as_slice()).into();
                memo.put(bucket, parent_tail, chunk, &parent);
                misses += 1;
            }
            // A counter, not `(unit_index + 1) % group`: a division per unit showed in
            // profiles.
            units_left -= 1;
            if units_left == 0 {
                out.push(event_hash(&parent));
                units_left = group;
            }
        }
        memo.count(hits as u64, misses as u64);
        hits
    }

    /// The event-form hashes of every full block (convenience; allocates the result).
    pub fn block_hashes(&self, tokens: &[u32], extras: &RequestExtras) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.block_hashes_into(tokens, extras, &mut HashScratch::default(), &mut out);
        out
    }

    /// The full digests of every full block (for the `hash` tool and diagnostics).
    pub fn block_digests(&self, tokens: &[u32], extras: &RequestExtras) -> Vec<BlockDigest> {
        self.block_digests_lookahead(tokens, 0, extras)
    }
}

/// Starts a unit's CBOR input, `(parent, tuple(tokens), ...`: everything but the extra keys.
#[inline(always)]
fn write_unit_head(input: &mut Vec<u8>, parent: &BlockDigest, tokens: &[u32]) {
    input.clear();
    input.extend_from_slice(&[0x83, 0x58, 0x20]);
    input.extend_from_slice(parent);
    cbor::write_array_head(input, tokens.len());
    cbor::write_u32s(input, tokens);
}

/// Encodes the LoRA extra key (identical for every block of a request).
fn encode_lora(out: &mut Vec<u8>, lora: &LoraAdapter, format: ExtraKeysFormat) {
    match format {
        ExtraKeysFormat::Tagged => {
            cbor::write_array_head(out, 3);
            cbor::write_text(out, "lora");
            cbor::write_text(out, &lora.name);
            cbor::write_text(out, &lora.path);
        }
        ExtraKeysFormat::Untagged => cbor::write_text(out, &lora.name),
    }
}

/// Writes one block's extra keys (`LoRA + MM + cache_salt`, as a tuple, or `None` when the
/// block has none), advancing the multimodal cursor exactly as vLLM's
/// `_gen_mm_extra_hash_keys` does. Returns the new cursor.
fn write_block_extras(
    out: &mut Vec<u8>,
    extras: &RequestExtras,
    lora_cbor: &[u8],
    format: ExtraKeysFormat,
    start: usize,
    end: usize,
    mm_cursor: usize,
) -> usize {
    // First pass: which multimodal items this block carries (a contiguous range of items).
    let (mm_first, mm_count, next_cursor) =
        multimodal_span(&extras.multimodal, start, end, mm_cursor);
    let salt = extras.cache_salt.as_deref().filter(|_| start == 0);
    let count = usize::from(!lora_cbor.is_empty()) + mm_count + usize::from(salt.is_some());
    if count == 0 {
        out.push(cbor::NULL);
        return next_cursor;
    }
    cbor::write_array_head(out, count);
    out.extend_from_slice(lora_cbor);
    for item in &extras.multimodal[mm_first..mm_first + mm_count] {
        let relative = item.offset as i64 - start as i64;
        match format {
            ExtraKeysFormat::Tagged => {
                cbor::write_array_head(out, 3);
                cbor::write_text(out, "mm");
                cbor::write_text(out, &item.identifier);
                cbor::write_int(out, relative);
            }
            ExtraKeysFormat::Untagged => {
                cbor::write_array_head(out, 2);
                cbor::write_text(out, &item.identifier);
                cbor::write_int(out, relative);
            }
        }
    }
    if let Some(salt) = salt {
        match format {
            ExtraKeysFormat::Tagged => {
                cbor::write_array_head(out, 2);
                cbor::write_text(out, "cache_salt");
                cbor::write_text(out, salt);
            }
            ExtraKeysFormat::Untagged => cbor::write_text(out, salt),
        }
    }
    next_cursor
}

/// vLLM's multimodal walk for one block `[start, end)`: returns the first included item, how
/// many are included, and the cursor for the next block.
fn multimodal_span(
    items: &[MultiModalItem],
    start: usize,
    end: usize,
    cursor: usize,
) -> (usize, usize, usize) {
    let Some(last) = items.last() else {
        return (cursor, 0, cursor);
    };
    if last.offset + last.length < start {
        return (cursor, 0, cursor);
    }
    let mut current = cursor;
    let mut first = None;
    let mut count = 0;
    while current < items.len() {
        let item = &items[current];
        if end > item.offset {
            if start > item.offset + item.length {
                current += 1;
                continue;
            }
            first.get_or_insert(current);
            count += 1;
            if end >= item.offset + item.length {
                current += 1;
            } else {
                break;
            }
        } else {
            break;
        }
    }
    (first.unwrap_or(current), count, current)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn none_hash_matches_vllm() {
        assert_eq!(
            hex(&none_hash(Some("12345"))),
            "7292412b7aee6c72390673c639cb26bbadd61da0cb7af52fea097bf4c7b340b2"
        );
        assert_eq!(
            hex(&none_hash(None)),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        assert_eq!(
            hex(&none_hash(Some(""))),
            "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3"
        );
    }

    #[test]
    fn partial_tail_is_not_hashed_and_bad_sizes_are_rejected() {
        let p = TokenProcessor::new(&TokenProcessorConfig::default()).expect("defaults are valid");
        assert_eq!(p.block_hashes(&[1; 15], &RequestExtras::default()).len(), 0);
        assert_eq!(p.block_hashes(&[1; 33], &RequestExtras::default()).len(), 2);
        let bad = TokenProcessorConfig {
            block_size: 32,
            hash_block_size: Some(12),
            ..Default::default()
        };
        assert!(matches!(
            TokenProcessor::new(&bad),
            Err(TokenProcessorError::BadHashBlockSize { .. })
        ));
    }

    #[test]
    fn a_memo_answers_only_for_the_same_parent_and_seed() {
        // Every block has the same tokens, so only the parent tells them apart; two seeds
        // share one memo; a one-bucket memo makes every unit collide.
        let tokens = vec![7u32; 16 * 12];
        let plain = RequestExtras::default();
        let processors: Vec<TokenProcessor> = [None, Some("42")]
            .into_iter()
            .map(|seed| {
                TokenProcessor::new(&TokenProcessorConfig {
                    hash_seed: seed.map(str::to_owned),
                    ..Default::default()
                })
                .expect("valid")
            })
            .collect();
        for memo in [DigestMemo::new(16, 1), DigestMemo::new(16, 1 << 16)] {
            for _pass in 0..3 {
                for p in &processors {
                    let mut out = Vec::new();
                    p.block_hashes_memo_into(
                        &tokens,
                        &plain,
                        &memo,
                        &mut HashScratch::default(),
                        &mut out,
                    );
                    assert_eq!(out, p.block_hashes(&tokens, &plain));
                }
            }
            let stats = memo.stats();
            assert_eq!(stats.hits + stats.misses, 3 * 2 * 12);
            if memo.entries() > 64 {
                assert!(stats.hits >= 2 * 2 * 12 - 4, "repeats hit: {stats:?}");
            }
        }
    }

    #[test]
    fn callers_sharing_a_small_memo_at_once_all_get_exact_hashes() {
        // Four threads score prompts that share prefixes of different lengths through one
        // memo far smaller than what they hash, so entries are read while others rewrite them.
        let processor = TokenProcessor::new(&TokenProcessorConfig::default()).expect("valid");
        let memo = DigestMemo::new(16, 64 * 128);
        let prompts: Vec<Vec<u32>> = (0..8u32)
            .map(|p| {
                (0..16 * 40)
                    .map(|t| if t < 16 * 5 * p { t } else { t * 31 + p })
                    .collect()
            })
            .collect();
        let want: Vec<Vec<BlockHash>> = prompts
            .iter()
            .map(|t| processor.block_hashes(t, &RequestExtras::default()))
            .collect();
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let (processor, memo, prompts, want) = (&processor, &memo, &prompts, &want);
                scope.spawn(move || {
                    let mut scratch = HashScratch::default();
                    let mut out = Vec::new();
                    for round in 0..200 {
                        let i = (thread * 3 + round) % prompts.len();
                        out.clear();
                        processor.block_hashes_memo_into(
                            &prompts[i],
                            &RequestExtras::default(),
                            memo,
                            &mut scratch,
                            &mut out,
                        );
                        assert_eq!(out, want[i], "thread {thread} round {round}");
                    }
                });
            }
        });
        assert!(memo.stats().hits > 0);
    }
}
