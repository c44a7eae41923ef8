//! Hash-mismatch detection: a run that starts at the prompt's root and carries its tokens is
//! hashed again with the model's settings (block 0 only: one SHA-256 per run, outside the
//! writer lock) and compared with what vLLM published. A mismatch means every score for that
//! pod is 0; the first one per (pod, model) is diagnosed (block size, seed, extra-key format)
//! and logged once.

use std::sync::Arc;

use super::apply::indexable_kind;
use super::{ApplyReport, Indexer, ModelState};
use crate::events::{BlockStored, EventBatch, KvEvent};
use crate::hashing::{
    ExtraKeysFormat, RequestExtras, TokenProcessor, TokenProcessorConfig, DEFAULT_HASH_SEED,
};

impl Indexer {
    /// Recomputes block 0 of each root run in `batch` and tallies matches per pod.
    pub(super) fn check_hashes(
        &self,
        state: &ModelState,
        pod: &Arc<str>,
        batch: &EventBatch,
        report: &mut ApplyReport,
    ) {
        let processor = &state.processor;
        for event in &batch.events {
            let KvEvent::BlockStored(s) = event else {
                continue;
            };
            if s.parent_block_hash.is_some()
                || s.block_hashes.is_empty()
                || !indexable_kind(s.kv_cache_spec_kind.as_deref())
            {
                continue;
            }
            let Ok(extras) = super::translate::run_extras(s, true, 1, state) else {
                continue; // not reproducible from the event alone (multimodal, unknown LoRA path)
            };
            let block = processor.block_size();
            if s.token_ids.len() < block {
                continue;
            }
            let first = processor
                .block_hashes(&s.token_ids[..block], &extras)
                .first()
                .copied();
            let matched = first == Some(s.block_hashes[0]);
            if matched {
                report.hash_matches += 1;
            } else {
                report.hash_mismatches += 1;
            }
            let mut checks = state.hash_checks.lock();
            let entry = checks.entry(pod.clone()).or_default();
            if matched {
                entry.matches += 1;
                continue;
            }
            entry.mismatches += 1;
            if entry.diagnosis.is_none() {
                let diagnosis = diagnose(processor, s, &extras);
                report.first_mismatch = true;
                entry.diagnosis = Some(diagnosis);
            }
        }
    }
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
    let tokens = &s.token_ids[..block];
    let target = s.block_hashes[0];
    let try_config = |seed: Option<&str>, format: ExtraKeysFormat| {
        let config = TokenProcessorConfig {
            hash_seed: seed.map(str::to_owned),
            block_size: processor.block_size(),
            hash_block_size: Some(processor.hash_block_size()),
            extra_keys_format: format,
        };
        TokenProcessor::new(&config)
            .ok()
            .and_then(|p| p.block_hashes(tokens, extras).first().copied())
            == Some(target)
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
