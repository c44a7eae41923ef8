//! Lookahead hashing (vLLM >= 0.33, `num_hash_lookahead_tokens`, EAGLE and MTP drafters): a
//! hash unit is hashed only once the `L` tokens after it exist, and its extra keys become
//! `(E, *next_tokens)`, `E` being the plain extra keys of the unit and those tokens
//! (`get_request_block_hasher` and `generate_lookahead_block_hash_extra_keys`,
//! core/kv_cache_utils.py:953-1060).
//!
//! Invariants:
//! - with `L` tokens of lookahead, a prompt of `n` tokens has `(n - L) / unit` units: the
//!   units without `L` tokens after them have no hash (they can match nothing);
//! - the lookahead tokens are the prompt's own, so a block is keyed by what follows it: a
//!   prompt that shares a block but not the tokens after it has another key;
//! - `L = 0` is plain hashing, byte for byte (the same loop).

use super::{cbor, write_block_extras, BlockDigest, ExtraKeysFormat, HashScratch, RequestExtras};
use super::{event_hash, TokenProcessor};
use crate::BlockHash;

impl TokenProcessor {
    /// [`TokenProcessor::block_hashes_into`] with `lookahead` tokens after each unit in its
    /// hash (what vLLM's `Request.block_hashes` are with `num_hash_lookahead_tokens`): one key
    /// per block followed by `lookahead` tokens of the prompt.
    pub fn block_hashes_lookahead_into(
        &self,
        tokens: &[u32],
        lookahead: usize,
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        out: &mut Vec<BlockHash>,
    ) {
        out.reserve(tokens.len() / self.block_size);
        self.chain_blocks(tokens, lookahead, extras, scratch, |_, digest| {
            out.push(event_hash(digest))
        });
    }

    /// [`TokenProcessor::block_digests`] with `lookahead` tokens after each unit in its hash
    /// (the `hash` tool's `--lookahead`; convenience, allocates the result).
    pub fn block_digests_lookahead(
        &self,
        tokens: &[u32],
        lookahead: usize,
        extras: &RequestExtras,
    ) -> Vec<BlockDigest> {
        let mut out = Vec::new();
        let scratch = &mut HashScratch::default();
        self.chain_blocks(tokens, lookahead, extras, scratch, |_, d| out.push(*d));
        out
    }
}

/// Writes one unit's lookahead extra keys, `(E, *next)`, `E` covering `[start, end +
/// next.len())` (`None` when the request has no extra keys), and returns the multimodal
/// cursor rewound to the first item that reaches past `end`, as vLLM's
/// `generate_lookahead_block_hash_extra_keys` does (an item overlapping the next unit is
/// keyed there too).
pub(super) fn write_extras(
    out: &mut Vec<u8>,
    extras: &RequestExtras,
    lora_cbor: &[u8],
    format: ExtraKeysFormat,
    (start, end): (usize, usize),
    next: &[u32],
    mm_cursor: usize,
) -> usize {
    cbor::write_array_head(out, 1 + next.len());
    let mut cursor = mm_cursor;
    if extras.is_empty() {
        out.push(cbor::NULL);
    } else {
        let window_end = end + next.len();
        cursor = write_block_extras(out, extras, lora_cbor, format, start, window_end, cursor);
        while let Some(item) = cursor.checked_sub(1).map(|i| &extras.multimodal[i]) {
            if item.offset + item.length <= end {
                break;
            }
            cursor -= 1;
        }
    }
    cbor::write_u32s(out, next);
    cursor
}

#[cfg(test)]
mod tests {
    use super::super::{TokenProcessorConfig, DEFAULT_HASH_SEED};
    use super::*;
    use sha2::{Digest, Sha256};

    /// vLLM's hash of one unit written out by hand: `(parent, tokens, (None, *next))`.
    fn by_hand(parent: &BlockDigest, tokens: &[u32], next: &[u32]) -> BlockDigest {
        let mut input = vec![0x83, 0x58, 0x20];
        input.extend_from_slice(parent);
        cbor::write_array_head(&mut input, tokens.len());
        cbor::write_u32s(&mut input, tokens);
        cbor::write_array_head(&mut input, 1 + next.len());
        input.push(cbor::NULL);
        cbor::write_u32s(&mut input, next);
        Sha256::digest(&input).into()
    }

    #[test]
    fn each_unit_is_keyed_by_the_tokens_after_it_and_the_tail_has_no_key() {
        let p = TokenProcessor::new(&TokenProcessorConfig {
            block_size: 4,
            ..Default::default()
        })
        .expect("valid");
        let tokens: Vec<u32> = (1..=14).collect();
        let plain = RequestExtras::default();
        for lookahead in [1usize, 2, 5] {
            let mut out = Vec::new();
            let scratch = &mut HashScratch::default();
            p.block_hashes_lookahead_into(&tokens, lookahead, &plain, scratch, &mut out);
            assert_eq!(out.len(), (tokens.len() - lookahead) / 4, "L={lookahead}");
            let mut parent = super::super::none_hash(Some(DEFAULT_HASH_SEED));
            for (i, key) in out.iter().enumerate() {
                let end = (i + 1) * 4;
                parent = by_hand(&parent, &tokens[i * 4..end], &tokens[end..end + lookahead]);
                assert_eq!(*key, event_hash(&parent), "L={lookahead} block {i}");
            }
            // Another token after block 0 changes every key; plain keys are none of them.
            let mut other = tokens.clone();
            other[4] += 100;
            let mut changed = Vec::new();
            p.block_hashes_lookahead_into(&other, lookahead, &plain, scratch, &mut changed);
            assert!(out.iter().zip(&changed).all(|(a, b)| a != b));
            let unkeyed = p.block_hashes(&tokens, &plain);
            assert!(out.iter().all(|k| !unkeyed.contains(k)));
        }
        // L = 0 is plain hashing.
        let mut zero = Vec::new();
        p.block_hashes_lookahead_into(&tokens, 0, &plain, &mut HashScratch::default(), &mut zero);
        assert_eq!(zero, p.block_hashes(&tokens, &plain));
    }
}
