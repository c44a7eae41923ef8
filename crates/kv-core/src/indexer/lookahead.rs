//! Lookahead hashing (vLLM >= 0.33, `num_hash_lookahead_tokens` with EAGLE and MTP drafters):
//! each block's hash also covers the `L` tokens after it, so a prompt that shares a block but
//! not the tokens after it does not reuse it. The engine publishes those tokens per block
//! (`BlockStored.lookahead_token_ids`).
//!
//! `L` is a model's, learned from its engines' events: the first `BlockStored` carrying
//! lookahead sets it, and from then on prompts are hashed with their own next `L` tokens
//! (`ModelState::lookahead`), so the blocks at a prompt's end without `L` tokens
//! after them have no key and match nothing, as in vLLM. An aligned engine's published hashes
//! are then the keys as they come; a translated engine's keys are computed from its
//! `token_ids` followed by its last block's lookahead tokens.
//!
//! Invariants:
//! - a run is indexed only if its lookahead length is the model's (a run without lookahead is
//!   `L = 0`): a run of another length would be keyed in another key space, which no prompt
//!   is hashed in; it is refused and its blocks counted ([`Admission::Mismatch`]);
//! - a run whose lookahead lists are not one per hash of one length (at most
//!   [`MAX_LOOKAHEAD`]), or disagree with its own `token_ids`, is refused and counted ([`Admission::Malformed`]), never guessed;
//! - `L` is set once per model, from its events or from a snapshot of its keys
//!   (`ModelState::adopt_lookahead`), and kept until the model is dropped; runs
//!   without lookahead indexed before it was learned stay until removed, and no longer match.

use std::sync::atomic::{AtomicU32, Ordering};

/// The longest lookahead taken from events. vLLM's is the drafter's prefill lookahead (1 for
/// EAGLE, the MTP module count otherwise: single digits); a run claiming more is refused as
/// malformed, so one broken or hostile publisher cannot teach a model a length that leaves
/// every prompt without keys.
pub(super) const MAX_LOOKAHEAD: usize = 64;

use crate::events::BlockStored;

/// A run whose lookahead lists are inconsistent (count, lengths, or its own tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MalformedLookahead;

/// A run's lookahead length (`0`: none), or why it is malformed: one list per hash, all of one
/// length, and each equal to the run's own tokens after its block where they cover it.
pub(super) fn run_lookahead(s: &BlockStored) -> Result<usize, MalformedLookahead> {
    let Some(lists) = &s.lookahead_token_ids else {
        return Ok(0);
    };
    let Some(first) = lists.first() else {
        // No hash, no list: nothing to key.
        return if s.block_hashes.is_empty() {
            Ok(0)
        } else {
            Err(MalformedLookahead)
        };
    };
    let l = first.len();
    if l == 0
        || l > MAX_LOOKAHEAD
        || lists.len() != s.block_hashes.len()
        || lists.iter().any(|t| t.len() != l)
    {
        return Err(MalformedLookahead);
    }
    // Where the run's tokens are its blocks back to back, block i's lookahead is the tokens
    // that follow it (vLLM reads both from the request's tokens).
    let block = s.block_size as usize;
    if block > 0 && s.token_ids.len() == s.block_hashes.len() * block {
        for (i, list) in lists.iter().enumerate() {
            let end = (i + 1) * block;
            if let Some(next) = s.token_ids.get(end..end + l) {
                if next != list.as_slice() {
                    return Err(MalformedLookahead);
                }
            }
        }
    }
    Ok(l)
}

/// What [`admit`] decided for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    /// Indexed under the model's lookahead; `Some(l)` when this run taught the model `l`.
    Indexed(Option<u32>),
    /// Refused: a lookahead of `run` tokens where the model's is `model`.
    Mismatch { run: u32, model: u32 },
    /// Refused: inconsistent lookahead lists.
    Malformed,
}

/// Whether `s` is indexed under the model's lookahead (`model_lookahead`, the model's
/// `lookahead` field), learning it from the first run that carries one. Called under the
/// model's writer lock.
pub(super) fn admit(model_lookahead: &AtomicU32, s: &BlockStored) -> Admission {
    let l = match run_lookahead(s) {
        Ok(l) => u32::try_from(l).unwrap_or(u32::MAX),
        Err(MalformedLookahead) => return Admission::Malformed,
    };
    let model = model_lookahead.load(Ordering::Relaxed);
    if model == 0 && l > 0 {
        // Under the model's writer: no other batch learns it meanwhile.
        model_lookahead.store(l, Ordering::Relaxed);
        return Admission::Indexed(Some(l));
    }
    if l == model {
        return Admission::Indexed(None);
    }
    Admission::Mismatch { run: l, model }
}

/// What a run's first `covered` tokens are hashed from: `(tokens, L)`, the tokens followed by
/// the `L` lookahead tokens of the last block they cover (copied into `buf`, reused), or the
/// tokens alone with `L = 0` when the run has no lookahead (or none for that block).
pub(super) fn run_tokens<'a>(
    s: &'a BlockStored,
    covered: usize,
    buf: &'a mut Vec<u32>,
) -> (&'a [u32], usize) {
    let blocks = covered / (s.block_size as usize).max(1);
    run_tokens_with(s, covered, blocks.wrapping_sub(1), buf)
}

/// [`run_tokens`] with the lookahead tokens of hash `list` (its `lookahead_token_ids` entry):
/// a run with fewer hashes than blocks hashes all its blocks followed by its last hash's.
pub(super) fn run_tokens_with<'a>(
    s: &'a BlockStored,
    covered: usize,
    list: usize,
    buf: &'a mut Vec<u32>,
) -> (&'a [u32], usize) {
    let plain = &s.token_ids[..covered];
    let last = s.lookahead_token_ids.as_ref().and_then(|l| l.get(list));
    match last {
        Some(next) if !next.is_empty() => {
            buf.clear();
            buf.extend_from_slice(plain);
            buf.extend_from_slice(next);
            (buf.as_slice(), next.len())
        }
        _ => (plain, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tokens: u32, block: u32, lookahead: Option<Vec<Vec<u32>>>) -> BlockStored {
        BlockStored {
            block_hashes: (0..tokens / block)
                .map(|h| crate::EngineHash::aligned(crate::BlockHash::new(h.into())))
                .collect(),
            token_ids: (0..tokens).collect(),
            block_size: block,
            lookahead_token_ids: lookahead,
            ..Default::default()
        }
    }

    #[test]
    fn lookahead_lists_must_be_one_per_hash_of_one_length_and_match_the_tokens() {
        assert_eq!(run_lookahead(&run(8, 4, None)), Ok(0));
        let good = run(8, 4, Some(vec![vec![4, 5], vec![8, 9]]));
        assert_eq!(run_lookahead(&good), Ok(2));
        let mut buf = Vec::new();
        assert_eq!(
            run_tokens(&good, 8, &mut buf),
            (&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9][..], 2)
        );
        assert_eq!(run_tokens(&good, 4, &mut buf), (&[0, 1, 2, 3, 4, 5][..], 2));
        let plain = run(8, 4, None);
        assert_eq!(run_tokens(&plain, 8, &mut buf).1, 0);
        for bad in [
            vec![vec![4, 5]],                    // one list for two hashes
            vec![vec![4], vec![8, 9]],           // lengths differ
            vec![vec![4, 6], vec![8, 9]],        // not the tokens after block 0
            vec![vec![], vec![]],                // empty lists
            vec![vec![7; MAX_LOOKAHEAD + 1]; 2], // longer than any drafter's
        ] {
            assert_eq!(
                run_lookahead(&run(8, 4, Some(bad.clone()))),
                Err(MalformedLookahead),
                "{bad:?}"
            );
        }
    }
}
