//! Hash-mismatch detection: a run that starts at the prompt's root and carries its tokens is
//! hashed again with the model's settings (block 0 only: one SHA-256 per run, outside the
//! writer lock) and compared with what vLLM published. A mismatch means every score for that
//! pod is 0; the first one per (pod, model) is diagnosed (block size, seed, extra-key format)
//! and logged once.

use std::sync::Arc;

use super::kinds::full_attention_kind;
use super::lookahead::{run_lookahead, run_tokens};
use super::{ApplyReport, Indexer, ModelState};
use crate::events::{BlockStored, EventBatch, KvEvent};
use crate::hashing::{
    ExtraKeysFormat, HashScratch, RequestExtras, TokenProcessor, TokenProcessorConfig,
    DEFAULT_HASH_SEED,
};
use crate::{BlockHash, EngineHash};

/// The root runs' checks of one batch, before they are tallied.
#[derive(Debug, Default)]
pub(super) struct RootChecks {
    matches: u32,
    mismatches: u32,
    /// The first mismatched run (its event index), for the diagnosis.
    first_mismatch: Option<usize>,
}

impl RootChecks {
    /// The batch's verdict on the engine's hashes: `Some(true)` when a root run's block 0
    /// recomputed equal, `Some(false)` when only mismatches were seen.
    pub(super) fn verdict(&self) -> Option<bool> {
        (self.matches + self.mismatches > 0).then_some(self.matches > 0)
    }
}

impl Indexer {
    /// Recomputes block 0 of each root run in `batch` (nothing is tallied yet).
    pub(super) fn check_hashes(&self, state: &ModelState, batch: &EventBatch) -> RootChecks {
        let processor = &state.processor;
        let mut checks = RootChecks::default();
        for (i, event) in batch.events.iter().enumerate() {
            let Some((s, extras)) = checkable(state, event) else {
                continue;
            };
            // An engine block of k units publishes the key of its last unit; a block size
            // that is not a multiple of ours is compared with our first unit (and differs).
            let ours = processor.block_size();
            let engine = s.block_size as usize;
            let block = if engine > 0 && engine.is_multiple_of(ours) && s.token_ids.len() >= engine
            {
                engine
            } else {
                ours
            };
            let ours = first_block_key(processor, s, block, &extras);
            if publishes(s.block_hashes[0], ours) {
                checks.matches += 1;
            } else {
                checks.mismatches += 1;
                checks.first_mismatch.get_or_insert(i);
            }
        }
        checks
    }

    /// Whether `batch`'s first root run of another block size than `blockSize` hashes as the
    /// index would at that block size (the model's seed, algorithm and extra keys, the engine
    /// block as one hash unit): `Some(Some(size))` when it does, `Some(None)` when it does not,
    /// `None` when the batch has no such run. One SHA-256 of one engine block.
    pub(super) fn alignable_block_size(
        &self,
        state: &ModelState,
        batch: &EventBatch,
    ) -> Option<Option<u32>> {
        let processor = &state.processor;
        let (s, extras) = batch.events.iter().find_map(|event| {
            let (s, extras) = checkable(state, event)?;
            let engine = s.block_size as usize;
            (engine > 0 && engine != processor.block_size() && s.token_ids.len() >= engine)
                .then_some((s, extras))
        })?;
        let engine = s.block_size as usize;
        let config = TokenProcessorConfig {
            block_size: engine,
            hash_block_size: None,
            ..processor.config().clone()
        };
        let key = TokenProcessor::new(&config)
            .ok()
            .and_then(|p| first_block_key(&p, s, engine, &extras));
        Some(publishes(s.block_hashes[0], key).then_some(s.block_size))
    }

    /// Tallies `checks` for `pod` when its hashes are taken as keys (`counted`); the first
    /// mismatch's diagnosis is kept either way (it says why an engine is translated).
    pub(super) fn record_checks(
        &self,
        state: &ModelState,
        pod: &Arc<str>,
        batch: &EventBatch,
        checks: &RootChecks,
        counted: bool,
        report: &mut ApplyReport,
    ) {
        if checks.matches + checks.mismatches == 0 {
            return;
        }
        let mut tallies = state.hash_checks.lock();
        let entry = tallies.entry(pod.clone()).or_default();
        if counted {
            report.hash_matches += checks.matches;
            report.hash_mismatches += checks.mismatches;
            entry.matches += u64::from(checks.matches);
            entry.mismatches += u64::from(checks.mismatches);
        }
        if entry.diagnosis.is_some() {
            return;
        }
        let diagnosed = checks
            .first_mismatch
            .and_then(|i| checkable(state, &batch.events[i]))
            .map(|(s, extras)| diagnose(&state.processor, s, &extras));
        if let Some(diagnosis) = diagnosed {
            report.first_mismatch = counted;
            entry.diagnosis = Some(diagnosis);
        }
    }
}

/// Whether the engine's hash `published` is the key `ours` kv-indexer computed for the same
/// block: the question the check asks (an engine whose hashes are our keys is aligned), so
/// the two are compared by value, the one place an engine's hash meets a computed key.
fn publishes(published: EngineHash, ours: Option<BlockHash>) -> bool {
    ours.is_some_and(|key| key.get() == published.get())
}

/// The key of a run's first `block` tokens as `processor` hashes them, with the lookahead
/// tokens after them when the run has lookahead (one allocation per root run).
fn first_block_key(
    processor: &TokenProcessor,
    s: &BlockStored,
    block: usize,
    extras: &RequestExtras,
) -> Option<BlockHash> {
    let mut buf = Vec::new();
    let (tokens, lookahead) = run_tokens(s, block, &mut buf);
    let mut keys = Vec::new();
    let scratch = &mut HashScratch::default();
    processor.block_hashes_lookahead_into(tokens, lookahead, extras, scratch, &mut keys);
    keys.last().copied()
}

/// A root run whose block 0 can be recomputed from the event alone, with its extra keys.
fn checkable<'a>(
    state: &ModelState,
    event: &'a KvEvent,
) -> Option<(&'a BlockStored, RequestExtras)> {
    let KvEvent::BlockStored(s) = event else {
        return None;
    };
    if s.parent_block_hash.is_some()
        || s.block_hashes.is_empty()
        || !full_attention_kind(s.kv_cache_spec_kind.as_deref())
        || s.token_ids.len() < state.processor.block_size()
        || run_lookahead(s).is_err()
    {
        return None;
    }
    // Multimodal keys or an unknown LoRA path: not reproducible from the event alone.
    let extras = super::translate::run_extras(s, true, 1, state.hashing()).ok()?;
    Some((s, extras))
}

/// Explains a mismatch: block size, then which seed or extra-key format would have matched.
fn diagnose(processor: &TokenProcessor, s: &BlockStored, extras: &RequestExtras) -> String {
    if s.block_size as usize != processor.block_size() {
        return format!(
            "block size differs: vLLM's events say {}, kv-indexer is configured with {} \
             (set tokenProcessorConfig.blockSize to vLLM's --block-size)",
            s.block_size,
            processor.block_size()
        );
    }
    let block = processor.block_size();
    let published = s.block_hashes[0];
    let try_config = |seed: Option<&str>, format: ExtraKeysFormat| {
        let config = TokenProcessorConfig {
            hash_seed: seed.map(str::to_owned),
            block_size: processor.block_size(),
            hash_block_size: Some(processor.hash_block_size()),
            extra_keys_format: format,
        };
        let key = TokenProcessor::new(&config)
            .ok()
            .and_then(|p| first_block_key(&p, s, block, extras));
        publishes(published, key)
    };
    for seed in [None, Some("0"), Some("")] {
        if try_config(seed, processor.extra_keys_format()) {
            let shown = seed.map_or(
                format!("unset (vLLM's default {DEFAULT_HASH_SEED:?})"),
                |s| format!("{s:?}"),
            );
            return format!(
                "the hash seed differs: vLLM's hashes match PYTHONHASHSEED={shown}; set \
                 tokenProcessorConfig.hashSeed (or PYTHONHASHSEED) to the same value"
            );
        }
    }
    let other = match processor.extra_keys_format() {
        ExtraKeysFormat::Tagged => ExtraKeysFormat::Untagged,
        ExtraKeysFormat::Untagged => ExtraKeysFormat::Tagged,
    };
    if !extras.is_empty() && try_config(processor.config().hash_seed.as_deref(), other) {
        return format!("the extra-keys format differs: vLLM uses {other:?}; set extraKeysFormat");
    }
    "the hash seed (PYTHONHASHSEED), the hash algorithm (vLLM must run with \
     --prefix-caching-hash-algo sha256_cbor; its default is pickle-based sha256) or the extra \
     keys (LoRA path, cache_salt) differ; check with `kv-indexer hash --tokens ...`"
        .to_owned()
}
