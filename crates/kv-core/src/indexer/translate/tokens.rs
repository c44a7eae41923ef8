//! What a translated run's keys are hashed from: the extra keys its event tells, and the
//! chained digest of each of its blocks from its tokens (followed by lookahead tokens where
//! the engine hashes with them).
//!
//! Invariants: a digest is computed only from the event's own tokens and the parent's digest,
//! at the index's hash unit; an engine block of `k` keys has the digest of its last unit (what
//! an aligned engine of that block size publishes, vLLM 0.24+); extra keys the event does not
//! let us rebuild (multimodal, prompt embeddings, a LoRA without a configured path) make the
//! run untranslatable, never guessed.

use super::super::adapters::ModelHashing;
use super::super::lookahead::run_tokens_with;
use super::{Scratch, Untranslatable};
use crate::events::{BlockStored, MsgpackValue};
use crate::hashing::{BlockDigest, RequestExtras, TokenProcessor};

/// The chained digest of each of a run's first `blocks` engine blocks of `k` units, from
/// `parent`, into `scratch.digests`: what an aligned engine of that block size publishes for
/// it is the key of the last unit (vLLM 0.24+). With lookahead hashing the tokens are followed
/// by the run's last hash's lookahead tokens (its last block's, where that hash is that block).
pub(super) fn block_digests(
    processor: &TokenProcessor,
    s: &BlockStored,
    (parent, blocks, k): (&BlockDigest, usize, usize),
    extras: &RequestExtras,
    scratch: &mut Scratch,
) {
    scratch.digests.clear();
    let digests = &mut scratch.digests;
    // Hash units per engine block (k keys of `blockSize / hash unit` units each).
    let per_block = processor.block_size() / processor.hash_block_size() * k;
    let covered = blocks * s.block_size as usize;
    let last_list = s.block_hashes.len().min(blocks).saturating_sub(1);
    let (tokens, lookahead) = run_tokens_with(s, covered, last_list, &mut scratch.tokens);
    processor.for_each_unit_after_lookahead(
        parent,
        tokens,
        lookahead,
        extras,
        &mut scratch.hashing,
        |unit, _, digest| {
            if (unit + 1) % per_block == 0 {
                digests.push(*digest);
            }
        },
    );
}

/// The extra keys a run's blocks were hashed with, as far as the event tells: its LoRA (the
/// path from the configuration), and for a run from the prompt's root its `cache_salt`
/// (SGLang's field, or vLLM's block-0 entry). Multimodal and prompt-embedding keys are not
/// rebuilt.
/// Reads the first `blocks` extra-keys entries (the hash check needs block 0's only).
pub(in crate::indexer) fn run_extras(
    s: &BlockStored,
    root: bool,
    blocks: usize,
    model: ModelHashing<'_>,
) -> Result<RequestExtras, Untranslatable> {
    let mut extras = RequestExtras::default();
    if let Some(name) = s.lora_name.as_ref().filter(|n| !n.is_empty()) {
        extras.lora = Some(model.lora_adapter(name).ok_or(Untranslatable::Lora)?);
    }
    // vLLM publishes one extra-keys entry per block: beyond the LoRA name, only block 0's
    // salt is rebuilt.
    for (i, entry) in s.extra_keys.iter().flatten().take(blocks).enumerate() {
        let items: &[MsgpackValue] = match entry {
            None => continue,
            Some(MsgpackValue::Array(items)) => items,
            Some(MsgpackValue::Str(salt)) if i == 0 && root && extras.lora.is_none() => {
                extras.cache_salt = Some(salt.clone());
                continue;
            }
            Some(_) => return Err(Untranslatable::ExtraKeys),
        };
        let mut rest = items;
        if extras.lora.is_some() {
            match rest.first() {
                Some(MsgpackValue::Str(n)) if Some(n) == s.lora_name.as_ref() => rest = &rest[1..],
                _ => return Err(Untranslatable::ExtraKeys),
            }
        }
        match rest {
            [] => {}
            [MsgpackValue::Str(salt)] if i == 0 && root => extras.cache_salt = Some(salt.clone()),
            _ => return Err(Untranslatable::ExtraKeys),
        }
    }
    if root {
        if let Some(salt) = s.cache_salt.as_ref().filter(|s| !s.is_empty()) {
            extras.cache_salt = Some(salt.clone());
        }
    }
    Ok(extras)
}
