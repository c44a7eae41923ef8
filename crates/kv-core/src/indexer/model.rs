//! One model's state: its index, its token processor and what its engines' events taught it
//! (KV-cache groups and layouts, key modes and translation maps, the lookahead, hash-check
//! tallies), and its speculative entries. The indexer's files read and write it; the registry
//! of models is the indexer's (`mod.rs`).
//!
//! Invariants: the write-path fields (`hash_checks`, `groups`, `engine_keys`, `engine_hashes`,
//! `model_groups`) change only under the model's writer (`engine_keys`' lock); what scoring
//! reads (`layouts`, `lookahead`, the index) is read without a lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::adapters::ModelHashing;
use super::groups::{self, EngineLayout};
use super::speculation::{PodSpeculation, Speculation, SpeculationStats};
use super::translate::{self, EngineHashes, EngineKeys, KeyMode, KeyNotes};
use crate::hashing::{
    DigestMemo, HashScratch, KeySpace, LoraAdapter, RequestExtras, TokenProcessor,
};
use crate::index::{EngineId, EngineKey, ModelIndex};
use crate::BlockHash;

/// Hash-check tallies for one (pod, model).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HashCheckStats {
    /// Recomputed block-0 hashes that matched.
    pub matches: u64,
    /// Recomputed block-0 hashes that did not.
    pub mismatches: u64,
    /// The diagnosis logged on the first mismatch.
    pub diagnosis: Option<String>,
}

/// One model's state.
pub struct ModelState {
    pub(super) name: Arc<str>,
    pub(super) index: ModelIndex,
    pub(super) processor: TokenProcessor,
    pub(super) lora_paths: HashMap<String, String>,
    /// Hash-check tallies per pod (write path only).
    pub(super) hash_checks: Mutex<HashMap<Arc<str>, HashCheckStats>>,
    /// Per engine, its KV-cache groups as its events showed them (write path only).
    pub(super) groups: Mutex<HashMap<EngineKey, groups::EngineGroups>>,
    /// The layouts of engines that are not plain, for scoring (lock-free to read).
    pub(super) layouts: ArcSwap<groups::Layouts>,
    /// Recorded routings not yet confirmed by events.
    pub(super) speculation: Speculation,
    /// How each engine's hashes become keys (write path only).
    pub(super) engine_hashes: EngineHashes,
    /// [`ModelSettings::attention_chunk_size`] and [`ModelSettings::hybrid`] (write path
    /// only).
    pub(super) model_groups: groups::ModelGroups,
    /// Per engine: its key mode, a translated engine's map, copies (write path only).
    pub(super) engine_keys: Mutex<(HashMap<EngineKey, EngineKeys>, translate::Scratch)>,
    /// When a batch was last applied ([`Indexer`]'s clock, ms): breaks ties between models
    /// holding as little when one must give its place.
    pub(super) last_write: AtomicU64,
    /// Set (under `engine_keys`) when the model gave its place to another (`max_models`): a
    /// batch that finds it set applies nothing.
    pub(super) evicted: AtomicBool,
    /// The digest memo of the model's hash unit size, when memos are enabled.
    pub(super) memo: Option<Arc<DigestMemo>>,
    /// Tokens after each block its hash covers (vLLM's `num_hash_lookahead_tokens`), learned
    /// from the first event that carries them (the `lookahead` file); 0: none. Set under the
    /// model's writer, read by scoring without a lock.
    pub(super) lookahead: AtomicU32,
}

impl ModelState {
    /// The model's index.
    pub fn index(&self) -> &ModelIndex {
        &self.index
    }

    /// The model's token processor.
    pub fn processor(&self) -> &TokenProcessor {
        &self.processor
    }

    /// The digest memo scoring uses for this model (shared with models of its unit size).
    pub fn digest_memo(&self) -> Option<&DigestMemo> {
        self.memo.as_deref()
    }

    /// The tokens after each block that the model's hashes cover (vLLM's
    /// `num_hash_lookahead_tokens`, learned from its engines' events; 0: none): prompts are
    /// hashed with their own next this many tokens.
    pub fn lookahead(&self) -> u32 {
        self.lookahead.load(Ordering::Relaxed)
    }

    /// What decides the keys of this model's prompts: its processor's settings and its
    /// lookahead (what a snapshot carries with the model's keys).
    pub fn key_space(&self) -> KeySpace {
        KeySpace {
            lookahead: self.lookahead(),
            ..self.processor.key_space()
        }
    }

    /// Takes `lookahead` as the model's when it has learned none (a snapshot's keys made
    /// with it): true when the model's lookahead is now `lookahead`, false when it learned
    /// another.
    pub fn adopt_lookahead(&self, lookahead: u32) -> bool {
        let _writer = self.engine_keys.lock();
        let current = self.lookahead();
        if current == 0 {
            self.lookahead.store(lookahead, Ordering::Relaxed);
            return true;
        }
        current == lookahead
    }

    /// A prompt's block hashes for scoring: with the model's lookahead when it has one
    /// (a block without that many tokens after it has no key), else through the digest memo
    /// when there is one.
    pub(super) fn hashes_into(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        scratch: &mut HashScratch,
        out: &mut Vec<BlockHash>,
    ) {
        let lookahead = self.lookahead() as usize;
        if lookahead > 0 {
            self.processor
                .block_hashes_lookahead_into(tokens, lookahead, extras, scratch, out);
            return;
        }
        match &self.memo {
            Some(memo) => {
                self.processor
                    .block_hashes_memo_into(tokens, extras, memo, scratch, out);
            }
            None => self
                .processor
                .block_hashes_into(tokens, extras, scratch, out),
        }
    }

    /// The layout scoring applies to `engine` (`None`: plain, the prefix walk alone).
    pub fn layout(&self, engine: EngineId) -> Option<Arc<EngineLayout>> {
        self.layouts.load().get(&engine).cloned()
    }

    /// Publishes `engine`'s layout (`None`: plain), copy-on-write: layouts change when an
    /// engine shows a group for the first time, not per batch.
    pub(super) fn publish_layout(&self, engine: EngineId, layout: Option<EngineLayout>) {
        let same = match (&layout, self.layouts.load().get(&engine)) {
            (None, None) => true,
            (Some(new), Some(old)) => **old == *new,
            _ => false,
        };
        if same {
            return;
        }
        let layout = layout.map(Arc::new);
        self.layouts.rcu(|current| {
            let mut next = (**current).clone();
            match &layout {
                Some(l) => next.insert(engine, l.clone()),
                None => next.remove(&engine),
            };
            next
        });
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The LoRA adapter `name` as this model's vLLM hashes it: with its configured path, or
    /// with none under the untagged format (which hashes the name only). `None` when the tagged
    /// format needs a path that is not configured (vLLM >= 0.31 hashes it).
    pub(crate) fn lora_adapter(&self, name: &str) -> Option<LoraAdapter> {
        self.hashing().lora_adapter(name)
    }

    /// How the model hashes a prompt (what translation and the hash check rebuild).
    pub(super) fn hashing(&self) -> ModelHashing<'_> {
        ModelHashing {
            processor: &self.processor,
            lora_paths: &self.lora_paths,
        }
    }

    /// Hash-check tallies per pod.
    pub fn hash_checks(&self) -> HashMap<Arc<str>, HashCheckStats> {
        self.hash_checks.lock().clone()
    }

    /// Hash-check tallies of one pod.
    pub fn hash_check(&self, pod: &str) -> Option<HashCheckStats> {
        self.hash_checks.lock().get(pod).cloned()
    }

    /// Whether recorded routings are all the index has for `pod`: it publishes no events for
    /// this model (no engine), or every hash check of its events mismatched (counted only for
    /// engines whose hashes are taken as keys: a translated engine's are not mismatches).
    pub fn speculation_fallback(&self, pod: &str) -> bool {
        self.index.directory().engines_of(pod).is_empty()
            || self
                .hash_checks
                .lock()
                .get(pod)
                .is_some_and(|c| c.mismatches > 0 && c.matches == 0)
    }

    /// Each engine's key mode and, for translated engines, how many engine blocks its map
    /// holds (what `ListPods` reports).
    pub fn key_modes(&self) -> HashMap<EngineKey, (KeyMode, usize)> {
        self.engine_keys
            .lock()
            .0
            .iter()
            .map(|(key, keys)| (key.clone(), (keys.mode, keys.translated_blocks())))
            .collect()
    }

    /// What each engine's translation noted beside its mode: hashes skipped because no block
    /// could be paired with them, and the block size at which its hashes are the index's
    /// keys (what `ListPods` reports).
    pub fn key_notes(&self) -> HashMap<EngineKey, KeyNotes> {
        self.engine_keys
            .lock()
            .0
            .iter()
            .map(|(key, keys)| (key.clone(), keys.notes()))
            .collect()
    }

    /// `pod`'s speculative entries, if it has had records.
    pub fn speculation_of(&self, pod: &str) -> Option<PodSpeculation> {
        self.speculation.pod(pod)
    }

    /// Pods with live speculative records, in name order.
    pub fn speculative_pods(&self) -> Vec<Arc<str>> {
        self.speculation.pods()
    }

    /// The speculative entries' size.
    pub fn speculation_stats(&self) -> SpeculationStats {
        self.speculation.stats()
    }

    /// Speculative records ended so far, by [`RecordEnd`](super::RecordEnd) (confirmed,
    /// expired, evicted, superseded, cleared).
    pub fn speculation_ends(&self) -> [u64; 5] {
        self.speculation.ends()
    }
}
