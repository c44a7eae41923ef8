//! The indexer: one [`ModelIndex`] and one [`TokenProcessor`] per model, fed by decoded event
//! batches and asked for pod scores. This is the library's front door; the daemon's ZMQ and gRPC
//! layers only translate to and from it.
//!
//! Invariants:
//! - a batch from one engine is applied under that model's writer as one unit, in order;
//! - only prefix-cacheable full-attention groups are indexed (`kv_cache_spec_kind` absent,
//!   `full_attention` or `mla_attention`); other groups' events are counted and skipped, and a
//!   `BlockRemoved` for a group an engine marked non-indexable is skipped too;
//! - hash mismatches are detected on runs that start at the root (parent `None`) and carry
//!   tokens: block 0 is recomputed with the model's settings (one SHA-256 per run, outside the
//!   writer lock), counted per (pod, model), and diagnosed in one log line per (pod, model).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod hash_check;
mod speculation;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use thiserror::Error;

use crate::events::{EventBatch, KvEvent, Medium};
use crate::hashing::{
    ExtraKeysFormat, HashScratch, LoraAdapter, RequestExtras, TokenProcessor, TokenProcessorConfig,
    TokenProcessorError,
};
use crate::index::{
    EngineDirectory, EngineId, EngineKey, EngineScore, IndexConfig, IndexConfigError, IndexStats,
    KeyBudget, ModelIndex, Tier, TierWeights,
};
use crate::marks::RoundMarks;
use crate::BlockHash;
use speculation::Speculation;
pub use speculation::{
    PodSpeculation, RecordEnd, RoutingRecorded, SpeculationSettings, SpeculationStats,
    MAX_TTL_FACTOR,
};

/// How one model's hashes are computed (must equal its vLLM deployment's settings).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelSettings {
    /// Seed, block sizes and extra-key format.
    pub token_processor: TokenProcessorConfig,
    /// LoRA adapter name -> path (vLLM >= 0.31 hashes the path, which events do not carry).
    pub lora_paths: HashMap<String, String>,
}

/// Everything the indexer needs to run.
#[derive(Debug, Clone, Default)]
pub struct IndexerSettings {
    /// Capacity: `max_keys` bounds all models together; `pod_cache_size`, when set, each block.
    pub index: IndexConfig,
    /// Models indexed at most (events name models, so they must not multiply state); 0 means
    /// [`DEFAULT_MAX_MODELS`].
    pub max_models: usize,
    /// Settings of models not listed in `models`.
    pub default_model: ModelSettings,
    /// Per-model overrides; these models are "known" before any event arrives.
    pub models: HashMap<String, ModelSettings>,
    /// Tier weights for scoring.
    pub weights: TierWeights,
    /// Speculative entries (recorded routings): lifetime, weight, bounds.
    pub speculation: SpeculationSettings,
}

/// Invalid settings.
#[derive(Debug, Error)]
pub enum SettingsError {
    /// A model's block sizes are invalid.
    #[error("model {model}: {source}")]
    TokenProcessor {
        /// Which model (`<default>` for the defaults).
        model: String,
        /// Why.
        source: TokenProcessorError,
    },
    /// Index capacity settings are invalid.
    #[error(transparent)]
    Index(#[from] IndexConfigError),
    /// Indexing this model would pass the model limit.
    #[error("model {model:?} not indexed: {max} models already (maxModels)")]
    TooManyModels {
        /// The model refused.
        model: String,
        /// The limit.
        max: usize,
    },
}

/// The model limit when none is configured.
pub const DEFAULT_MAX_MODELS: usize = 64;

/// Why a score request failed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ScoreError {
    /// The model is neither configured nor seen in any event.
    #[error("unknown model {0:?}: not configured and no KV events received for it")]
    UnknownModel(String),
    /// vLLM >= 0.31 hashes the adapter path, which must be configured.
    #[error("LoRA adapter {0:?} has no path configured (vLLM >= 0.31 hashes the adapter path; add it to loraAdapters)")]
    UnknownLora(String),
}

/// A pod's score for a prompt. The pod is a handle: its name is [`ScoreResult::pod`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodScore {
    /// The pod (resolve with [`ScoreResult::pod`]).
    pub pod: PodRef,
    /// Tier-weighted consecutive blocks from the prompt's start.
    pub score: f64,
    /// Consecutive blocks from the prompt's start the pod holds (speculative ones included).
    pub matched_blocks: u32,
    /// Of `matched_blocks`, those held only by speculative entries (recorded routings not yet
    /// confirmed by the pod's events), at the end of the run.
    pub speculative_blocks: u32,
}

/// A pod named in a [`ScoreResult`], without copying or reference-counting its name (listing
/// 1,024 pods by `Arc<str>` costs a cache miss per pod on the reference counts alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PodRef {
    /// A pod the index knows: its index in the result's directory.
    Known(u32),
    /// A candidate the index has never heard of: its index among the result's unknown names.
    Unknown(u32),
    /// A pod known only by its speculative entries (routings recorded for a pod that
    /// publishes no events): its index in the speculative directory.
    Speculative(u32),
}

/// The answer to a score request.
#[derive(Debug, Clone, Default)]
pub struct ScoreResult {
    /// One entry per candidate (every known pod when none are given), best first.
    pub scores: Vec<PodScore>,
    /// Full blocks in the prompt.
    pub total_blocks: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// The engine directory the pods were scored against (names of [`PodRef::Known`]).
    directory: Option<Arc<EngineDirectory>>,
    /// Names of [`PodRef::Unknown`] candidates.
    unknown: Vec<Box<str>>,
    /// The speculative entries' directory (names of [`PodRef::Speculative`]).
    speculative: Option<Arc<EngineDirectory>>,
}

impl ScoreResult {
    /// The name of a scored pod, as named in the events' topic (or connect-mode config).
    pub fn pod(&self, score: &PodScore) -> &str {
        match score.pod {
            PodRef::Known(p) => self
                .directory
                .as_ref()
                .and_then(|d| d.pod(p))
                .map_or("", |name| name),
            PodRef::Unknown(i) => self.unknown.get(i as usize).map_or("", |n| n),
            PodRef::Speculative(p) => self
                .speculative
                .as_ref()
                .and_then(|d| d.pod(p))
                .map_or("", |name| name),
        }
    }

    /// The directory the pods were scored against: [`PodRef::Known`] indexes its pods (an
    /// embedder can keep its own per-pod data by that index while the directory is the same).
    pub fn directory(&self) -> Option<&Arc<EngineDirectory>> {
        self.directory.as_ref()
    }

    /// `(pod name, score)` pairs, best first.
    pub fn named(&self) -> impl Iterator<Item = (&str, &PodScore)> {
        self.scores.iter().map(move |s| (self.pod(s), s))
    }
}

/// What applying one batch did (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// BlockStored events applied.
    pub stored_events: u32,
    /// BlockRemoved events applied.
    pub removed_events: u32,
    /// AllBlocksCleared events applied.
    pub cleared_events: u32,
    /// Events of unknown types, skipped.
    pub unknown_events: u32,
    /// Events for groups that are not indexed (sliding window, mamba, ...), skipped.
    pub skipped_group_events: u32,
    /// Blocks (memberships) added.
    pub blocks_stored: u64,
    /// Memberships removed (by BlockRemoved or a clear).
    pub blocks_removed: u64,
    /// Stored runs whose parent the engine did not hold.
    pub orphan_runs: u32,
    /// Root runs whose recomputed block-0 hash equalled vLLM's.
    pub hash_matches: u32,
    /// Root runs whose recomputed block-0 hash differed.
    pub hash_mismatches: u32,
    /// This batch brought the pod's first mismatch: its diagnosis is now in
    /// [`ModelState::hash_check`] (the embedder decides how loudly to report it; the core does
    /// not log).
    pub first_mismatch: bool,
    /// The engine could not be registered (too many engines): nothing applied.
    pub engine_rejected: bool,
}

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
    name: Arc<str>,
    index: ModelIndex,
    processor: TokenProcessor,
    lora_paths: HashMap<String, String>,
    /// Hash-check tallies per pod (write path only).
    hash_checks: Mutex<HashMap<Arc<str>, HashCheckStats>>,
    /// Per engine, the group ids its events marked as not indexable.
    skipped_groups: Mutex<HashMap<EngineKey, HashSet<i64>>>,
    /// Recorded routings not yet confirmed by events.
    speculation: Speculation,
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

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
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
    /// this model (no engine), or every hash check of its events mismatched.
    pub fn speculation_fallback(&self, pod: &str) -> bool {
        self.index.directory().engines_of(pod).is_empty()
            || self
                .hash_checks
                .lock()
                .get(pod)
                .is_some_and(|c| c.mismatches > 0 && c.matches == 0)
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

    /// Speculative records ended so far, by [`RecordEnd`] (confirmed, expired, evicted,
    /// superseded, cleared).
    pub fn speculation_ends(&self) -> [u64; 5] {
        self.speculation.ends()
    }
}

/// Gives a map's memory back once it is mostly empty (a fleet that shrank).
fn shrink_if_sparse<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
        map.shrink_to_fit();
    }
}

/// Totals across models for metrics.
#[derive(Debug, Default)]
struct Totals {
    unknown_events: AtomicU64,
    skipped_group_events: AtomicU64,
}

/// The multi-model index with its hashing settings.
pub struct Indexer {
    settings: IndexerSettings,
    models: ArcSwap<HashMap<Arc<str>, Arc<ModelState>>>,
    create: Mutex<()>,
    totals: Totals,
    /// `size` keys shared by every model's index.
    budget: Arc<KeyBudget>,
}

/// The candidate list that means "every pod the model knows" (an empty list, typed).
pub const ALL_PODS: &[&str] = &[];

/// Per-thread working memory of the pod aggregation (reused by every score).
#[derive(Default)]
struct PodScratch {
    /// The candidates' engine ids.
    candidates: Vec<EngineId>,
    /// The index's per-engine result.
    engines: Vec<EngineScore>,
    /// The pods holding the prompt's first block in this call...
    holding: RoundMarks,
    /// ...and, per pod index, its best engine's (score, matched blocks), then with its
    /// speculative blocks added (score, matched, speculative).
    best: Vec<(f64, u32, u32)>,
    /// The candidates' speculative engine ids.
    spec_candidates: Vec<EngineId>,
    /// The speculative walk's per-engine result.
    spec_engines: Vec<EngineScore>,
    /// Pods known only by their speculative entries that hold the prompt's first block...
    spec_holding: RoundMarks,
    /// ...and, per speculative pod index, how many blocks.
    spec_len: Vec<u32>,
    /// Speculative-only pods listed in this pass.
    spec_listed: RoundMarks,
    /// The pods listed in this pass (a candidate named twice is listed once).
    listed: RoundMarks,
    /// Candidates unknown to the index already listed in this call.
    unknown: HashSet<Box<str>>,
}

/// The index tier of an event's medium; no medium (vLLM < 0.10.2) means GPU.
fn tier_of(medium: Option<&Medium>) -> Tier {
    match medium {
        None | Some(Medium::Gpu) => Tier::Gpu,
        Some(Medium::Cpu) => Tier::Cpu,
        Some(Medium::Storage) => Tier::Storage,
        Some(Medium::Other(_)) => Tier::Other,
    }
}

fn indexable_kind(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention") | Some("mla_attention"))
}

impl Indexer {
    /// Validates the settings and creates the configured models' indexes.
    pub fn new(settings: IndexerSettings) -> Result<Self, SettingsError> {
        settings.index.validate()?;
        TokenProcessor::new(&settings.default_model.token_processor).map_err(|source| {
            SettingsError::TokenProcessor {
                model: "<default>".into(),
                source,
            }
        })?;
        let indexer = Self {
            budget: KeyBudget::new(settings.index.max_keys as u64),
            settings,
            models: ArcSwap::from_pointee(HashMap::new()),
            create: Mutex::new(()),
            totals: Totals::default(),
        };
        let names: Vec<String> = indexer.settings.models.keys().cloned().collect();
        for name in names {
            indexer.model_or_create(&name)?;
        }
        Ok(indexer)
    }

    /// The settings in force.
    pub fn settings(&self) -> &IndexerSettings {
        &self.settings
    }

    /// The model's state if it is known.
    pub fn model(&self, name: &str) -> Option<Arc<ModelState>> {
        self.models.load().get(name).cloned()
    }

    /// Every known model.
    pub fn models(&self) -> Vec<Arc<ModelState>> {
        self.models.load().values().cloned().collect()
    }

    /// The model's state, creating it (with default or configured settings) on first use.
    pub fn model_or_create(&self, name: &str) -> Result<Arc<ModelState>, SettingsError> {
        if let Some(m) = self.model(name) {
            return Ok(m);
        }
        let _guard = self.create.lock();
        if let Some(m) = self.model(name) {
            return Ok(m);
        }
        let max = match self.settings.max_models {
            0 => DEFAULT_MAX_MODELS,
            n => n,
        };
        if self.models.load().len() >= max {
            return Err(SettingsError::TooManyModels {
                model: name.to_owned(),
                max,
            });
        }
        let settings = self
            .settings
            .models
            .get(name)
            .unwrap_or(&self.settings.default_model);
        let processor = TokenProcessor::new(&settings.token_processor).map_err(|source| {
            SettingsError::TokenProcessor {
                model: name.to_owned(),
                source,
            }
        })?;
        let state = Arc::new(ModelState {
            name: name.into(),
            index: ModelIndex::with_budget(self.settings.index.clone(), self.budget.clone())?,
            processor,
            lora_paths: settings.lora_paths.clone(),
            hash_checks: Mutex::new(HashMap::new()),
            skipped_groups: Mutex::new(HashMap::new()),
            speculation: Speculation::new(self.settings.speculation.clone())?,
        });
        let mut next = HashMap::clone(&self.models.load());
        next.insert(name.into(), state.clone());
        self.models.store(Arc::new(next));
        Ok(state)
    }

    /// Applies one decoded batch published by `pod` for `model`. The engine is
    /// `(pod, batch.data_parallel_rank)`.
    pub fn apply_batch(
        &self,
        model: &str,
        pod: &str,
        batch: &EventBatch,
    ) -> Result<ApplyReport, SettingsError> {
        self.apply_batch_at(model, pod, batch, std::time::Instant::now())
    }

    /// [`Indexer::apply_batch`] at a given instant: `now` is when the batch arrived, what a
    /// recorded routing it confirms measures its delay against (a simulation's own clock, or
    /// the wall clock).
    pub fn apply_batch_at(
        &self,
        model: &str,
        pod: &str,
        batch: &EventBatch,
        now: std::time::Instant,
    ) -> Result<ApplyReport, SettingsError> {
        let state = self.model_or_create(model)?;
        let rank = batch
            .data_parallel_rank
            .and_then(|r| u32::try_from(r).ok())
            .unwrap_or(0);
        let key = EngineKey::new(pod, rank);
        let mut report = ApplyReport::default();
        self.make_room(&state, batch);
        self.check_hashes(&state, &key.pod, batch, &mut report);
        // Only engines that published a non-indexable group have an entry.
        let mut skipped = state.skipped_groups.lock();
        let applied = state.index.write_engine(&key, |w, engine| {
            for event in &batch.events {
                match event {
                    KvEvent::BlockStored(s) => {
                        if !indexable_kind(s.kv_cache_spec_kind.as_deref()) {
                            if let Some(g) = s.group_idx {
                                skipped.entry(key.clone()).or_default().insert(g);
                            }
                            report.skipped_group_events += 1;
                            continue;
                        }
                        let tier = tier_of(s.medium.as_ref());
                        let outcome = w.store(engine, tier, s.parent_block_hash, &s.block_hashes);
                        report.stored_events += 1;
                        report.blocks_stored += outcome.added as u64;
                        report.orphan_runs += u32::from(outcome.orphan);
                    }
                    KvEvent::BlockRemoved(r) => {
                        let skips = skipped.get(&key);
                        if r.group_idx
                            .is_some_and(|g| skips.is_some_and(|set| set.contains(&g)))
                        {
                            report.skipped_group_events += 1;
                            continue;
                        }
                        let tier = tier_of(r.medium.as_ref());
                        report.blocks_removed += w.remove(engine, tier, &r.block_hashes) as u64;
                        report.removed_events += 1;
                    }
                    KvEvent::AllBlocksCleared => {
                        report.blocks_removed += w.clear_engine(engine) as u64;
                        report.cleared_events += 1;
                    }
                    KvEvent::Unknown(_) => report.unknown_events += 1,
                }
            }
        });
        if applied.is_none() {
            report.engine_rejected = true;
        }
        drop(skipped);
        if !state.speculation.is_empty() {
            let stored: Vec<&[BlockHash]> = batch
                .events
                .iter()
                .filter_map(|e| match e {
                    KvEvent::BlockStored(s) => Some(&s.block_hashes[..]),
                    _ => None,
                })
                .collect();
            state.speculation.confirm(pod, &stored, now);
        }
        self.totals
            .unknown_events
            .fetch_add(report.unknown_events as u64, Ordering::Relaxed);
        self.totals
            .skipped_group_events
            .fetch_add(report.skipped_group_events as u64, Ordering::Relaxed);
        Ok(report)
    }

    /// When the shared key budget cannot take `batch`'s new blocks, evicts that many from the
    /// model holding the most keys, if it is another one (this model evicts its own as it
    /// stores). Takes one other model's writer at a time, never while holding this one's.
    fn make_room(&self, state: &ModelState, batch: &EventBatch) {
        let incoming: u64 = batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
                _ => 0,
            })
            .sum();
        let over = (self.budget.used() + incoming).saturating_sub(self.budget.limit());
        if over == 0 {
            return;
        }
        let largest = self
            .models
            .load()
            .values()
            .max_by_key(|m| m.index.key_count())
            .cloned();
        if let Some(other) = largest.filter(|m| m.name != state.name) {
            other.index.evict(over as usize);
        }
    }

    /// Drops every block of `pod` (all DP ranks) in `model`: a publisher restart, an admin
    /// request, or a pod that went away. Returns memberships removed.
    pub fn clear_pod(&self, model: &str, pod: &str) -> usize {
        let Some(state) = self.model(model) else {
            return 0;
        };
        state.speculation.clear_pod(pod);
        let engines: Vec<EngineId> = state.index.directory().engines_of(pod).to_vec();
        engines
            .iter()
            .map(|&e| state.index.write(e, |w| w.clear_engine(e)))
            .sum()
    }

    /// Forgets `pod` in `model` entirely: its blocks, its engines (ids and directory entries)
    /// and its per-pod tallies, so a fleet whose pods come and go under new names holds only
    /// the pods it has now. Returns memberships removed.
    pub fn remove_pod(&self, model: &str, pod: &str) -> usize {
        let Some(state) = self.model(model) else {
            return 0;
        };
        let directory = state.index.directory();
        let mut skipped = state.skipped_groups.lock();
        for &e in directory.engines_of(pod) {
            if let Some(key) = directory.key(e) {
                skipped.remove(&key);
            }
        }
        shrink_if_sparse(&mut skipped);
        drop(skipped);
        let mut checks = state.hash_checks.lock();
        checks.remove(pod);
        shrink_if_sparse(&mut checks);
        drop(checks);
        state.speculation.clear_pod(pod);
        state.index.remove_pod(pod)
    }

    /// Records that the gateway routed a prompt (its block `hashes`) to `pod`: until the
    /// pod's `BlockStored` confirms it, or it expires, the pod scores as holding those blocks
    /// (speculative entries; see [`SpeculationSettings`]). Returns what was recorded: the
    /// prompt's blocks after those the pod already holds for real, or why nothing was.
    pub fn record_routing(
        &self,
        model: &str,
        pod: &str,
        hashes: Arc<[BlockHash]>,
        now: std::time::Instant,
    ) -> Result<RoutingRecorded, ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let mut real = Vec::new();
        let directory = state.index.directory();
        let engines = directory.engines_of(pod);
        if !engines.is_empty() {
            state
                .index
                .score_engines(&hashes, Some(engines), &self.settings.weights, &mut real);
        }
        let real_blocks = real.iter().map(|e| e.matched_blocks).max().unwrap_or(0) as usize;
        let fallback = state.speculation_fallback(pod);
        Ok(state
            .speculation
            .record(pod, hashes, real_blocks, fallback, now))
    }

    /// Ends the speculative records whose deadline passed (every model), re-deciding which
    /// pods are in fallback. Called periodically by the embedder. Returns records expired.
    pub fn expire_speculation(&self, now: std::time::Instant) -> u64 {
        self.models
            .load()
            .values()
            .map(|m| m.speculation.expire(now, |pod| m.speculation_fallback(pod)))
            .sum()
    }

    /// Calls `f` with every model's engines and the blocks they hold, with their tiers (a
    /// snapshot's content), one engine at a time. Consistent only while nothing writes (the
    /// caller pauses its writers).
    pub fn export_each(&self, mut f: impl FnMut(&str, &EngineKey, &[(BlockHash, Tier)])) {
        let mut models: Vec<_> = self.models.load().values().cloned().collect();
        models.sort_by(|a, b| a.name.cmp(&b.name));
        for m in models {
            m.index.export_each(|key, blocks| f(&m.name, key, blocks));
        }
    }

    /// `pod` at rank `rank` holds `hashes` in `tier` (a snapshot being loaded). Returns the
    /// memberships added.
    pub fn import(
        &self,
        model: &str,
        key: &EngineKey,
        tier: Tier,
        hashes: &[BlockHash],
    ) -> Result<usize, SettingsError> {
        let state = self.model_or_create(model)?;
        Ok(state
            .index
            .write_engine(key, |w, e| w.store(e, tier, None, hashes).added)
            .unwrap_or(0))
    }

    /// Drops every block of every model (before a snapshot replaces the index). Returns
    /// memberships removed.
    pub fn clear_all(&self) -> usize {
        let mut removed = 0;
        for state in self.models.load().values() {
            let directory = state.index.directory();
            for (pod, _) in directory.pods() {
                for &e in directory.engines_of(pod) {
                    removed += state.index.write(e, |w| w.clear_engine(e));
                }
            }
        }
        removed
    }

    /// Drops every block of one engine (`pod` at data-parallel rank `rank`): its vLLM process
    /// restarted. Returns memberships removed.
    pub fn clear_engine(&self, model: &str, pod: &str, rank: u32) -> usize {
        let Some(state) = self.model(model) else {
            return 0;
        };
        let key = EngineKey::new(pod, rank);
        state
            .index
            .write_engine(&key, |w, e| w.clear_engine(e))
            .unwrap_or(0)
    }

    /// Scores `pods` (every known pod of the model when empty) for a prompt given as tokens.
    pub fn score_tokens<S: AsRef<str>>(
        &self,
        model: &str,
        tokens: &[u32],
        pods: &[S],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<ScoreResult, ScoreError> {
        let mut result = ScoreResult::default();
        self.score_tokens_into(model, tokens, pods, lora_name, cache_salt, &mut result)?;
        Ok(result)
    }

    /// [`Indexer::score_tokens`] into a result the caller reuses: once the thread and `out`
    /// have seen their largest prompt and fleet, a call allocates nothing (a candidate the
    /// index has never heard of costs its name).
    pub fn score_tokens_into<S: AsRef<str>>(
        &self,
        model: &str,
        tokens: &[u32],
        pods: &[S],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        out: &mut ScoreResult,
    ) -> Result<(), ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let extras = self.request_extras(&state, lora_name, cache_salt)?;
        thread_local! {
            static HASHING: std::cell::RefCell<(HashScratch, Vec<BlockHash>)> =
                std::cell::RefCell::new((HashScratch::default(), Vec::new()));
        }
        HASHING.with(|cell| {
            let mut fresh = Default::default();
            let mut borrowed = cell.try_borrow_mut();
            let (scratch, hashes) = match borrowed.as_deref_mut() {
                Ok(pair) => pair,
                Err(_) => &mut fresh,
            };
            hashes.clear();
            state
                .processor
                .block_hashes_into(tokens, &extras, scratch, hashes);
            self.score_hashes_in(&state, hashes, pods, out);
        });
        out.prompt_tokens = tokens.len() as u32;
        Ok(())
    }

    /// The prompt's block hashes as `model`'s vLLM computes them (what [`Indexer::score_hashes`]
    /// and [`Indexer::record_routing`] take).
    pub fn block_hashes(
        &self,
        model: &str,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<BlockHash>, ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let extras = self.request_extras(&state, lora_name, cache_salt)?;
        let mut hashes = Vec::with_capacity(tokens.len() / state.processor.block_size().max(1));
        state.processor.block_hashes_into(
            tokens,
            &extras,
            &mut HashScratch::default(),
            &mut hashes,
        );
        Ok(hashes)
    }

    /// Scores pods for a prompt given as its block hashes (event form).
    pub fn score_hashes<S: AsRef<str>>(
        &self,
        model: &str,
        hashes: &[BlockHash],
        pods: &[S],
    ) -> Result<ScoreResult, ScoreError> {
        let mut result = ScoreResult::default();
        self.score_hashes_into(model, hashes, pods, &mut result)?;
        Ok(result)
    }

    /// [`Indexer::score_hashes`] into a result the caller reuses (see
    /// [`Indexer::score_tokens_into`]).
    pub fn score_hashes_into<S: AsRef<str>>(
        &self,
        model: &str,
        hashes: &[BlockHash],
        pods: &[S],
        out: &mut ScoreResult,
    ) -> Result<(), ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        self.score_hashes_in(&state, hashes, pods, out);
        out.prompt_tokens = 0;
        Ok(())
    }

    fn request_extras(
        &self,
        state: &ModelState,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<RequestExtras, ScoreError> {
        let lora = match lora_name.filter(|n| !n.is_empty()) {
            None => None,
            Some(name) => {
                let path = state.lora_paths.get(name).cloned();
                let path = match (path, state.processor.extra_keys_format()) {
                    (Some(p), _) => p,
                    (None, ExtraKeysFormat::Untagged) => String::new(),
                    (None, ExtraKeysFormat::Tagged) => {
                        return Err(ScoreError::UnknownLora(name.to_owned()))
                    }
                };
                Some(LoraAdapter {
                    name: name.to_owned(),
                    path,
                })
            }
        };
        Ok(RequestExtras {
            lora,
            multimodal: Vec::new(),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        })
    }

    /// Scores into `out`: the index walk over the candidates' engines, then one entry per
    /// pod (its best engine, for DP ranks), best first (ties by matched blocks, then name).
    fn score_hashes_in<S: AsRef<str>>(
        &self,
        state: &ModelState,
        hashes: &[BlockHash],
        pods: &[S],
        out: &mut ScoreResult,
    ) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<PodScratch> = Default::default();
        }
        SCRATCH.with(|cell| {
            let mut fresh = PodScratch::default();
            let mut borrowed = cell.try_borrow_mut();
            let scratch = match borrowed.as_deref_mut() {
                Ok(s) => s,
                Err(_) => &mut fresh,
            };
            self.score_pods(state, hashes, pods, scratch, out);
        });
        out.total_blocks = hashes.len() as u32;
    }

    fn score_pods<S: AsRef<str>>(
        &self,
        state: &ModelState,
        hashes: &[BlockHash],
        pods: &[S],
        s: &mut PodScratch,
        out: &mut ScoreResult,
    ) {
        let directory = state.index.directory();
        out.scores.clear();
        out.unknown.clear();
        s.candidates.clear();
        for pod in pods {
            let ids = directory.engines_of(pod.as_ref());
            s.candidates.extend_from_slice(ids);
        }
        let restrict = (!pods.is_empty()).then_some(s.candidates.as_slice());
        state
            .index
            .score_engines(hashes, restrict, &self.settings.weights, &mut s.engines);
        // Best engine per pod (DP ranks), by pod index.
        s.holding.next_round();
        if s.best.len() < directory.pod_slots() {
            s.best.resize(directory.pod_slots(), (0.0, 0, 0));
        }
        for e in &s.engines {
            let Some(p) = directory.pod_of(e.engine) else {
                continue;
            };
            let slot = &mut s.best[p as usize];
            if s.holding.mark(p as usize) || (e.score, e.matched_blocks) > (slot.0, slot.1) {
                *slot = (e.score, e.matched_blocks, 0);
            }
        }
        let speculative = self.score_speculative(state, &directory, hashes, pods, s);
        let (holding, best) = (&s.holding, &s.best);
        let score_of = |p: u32| match best.get(p as usize) {
            Some(&triple) if holding.is_marked(p as usize) => triple,
            _ => (0.0, 0, 0),
        };
        let (spec_holding, spec_len) = (&s.spec_holding, &s.spec_len);
        let weight = self.settings.speculation.weight;
        // A pod known only by its speculative entries.
        let spec_only = |sp: u32| match spec_len.get(sp as usize) {
            Some(&n) if spec_holding.is_marked(sp as usize) => (weight * n as f64, n, n),
            _ => (0.0, 0, 0),
        };
        let push = |out: &mut ScoreResult, pod, (score, matched_blocks, speculative_blocks)| {
            out.scores.push(PodScore {
                pod,
                score,
                matched_blocks,
                speculative_blocks,
            })
        };
        // Two passes, holders then the rest, so only holders need sorting and the rest keep
        // their order (name order, or the caller's).
        for holders in [true, false] {
            if pods.is_empty() {
                for (_, p) in directory.pods() {
                    let triple = score_of(p);
                    if (triple.1 > 0) == holders {
                        push(out, PodRef::Known(p), triple);
                    }
                }
                if let Some(sdir) = &speculative {
                    for (name, sp) in sdir.pods() {
                        let triple = spec_only(sp);
                        if directory.pod_index(name).is_none() && (triple.1 > 0) == holders {
                            push(out, PodRef::Speculative(sp), triple);
                        }
                    }
                }
            } else {
                // Each candidate once, in the caller's order (a pod named twice is listed once).
                s.listed.next_round();
                s.spec_listed.next_round();
                s.unknown.clear();
                for pod in pods {
                    let name = pod.as_ref();
                    if let Some(p) = directory.pod_index(name) {
                        let triple = score_of(p);
                        if (triple.1 > 0) == holders && s.listed.mark(p as usize) {
                            push(out, PodRef::Known(p), triple);
                        }
                        continue;
                    }
                    if let Some(sp) = speculative.as_ref().and_then(|d| d.pod_index(name)) {
                        let triple = spec_only(sp);
                        if (triple.1 > 0) == holders && s.spec_listed.mark(sp as usize) {
                            push(out, PodRef::Speculative(sp), triple);
                        }
                        continue;
                    }
                    // Unknown to the index: listed with 0, once.
                    if !holders && s.unknown.insert(name.into()) {
                        push(out, PodRef::Unknown(out.unknown.len() as u32), (0.0, 0, 0));
                        out.unknown.push(name.into());
                    }
                }
            }
            if holders {
                // Ties by name (holders are always known pods).
                let name = |p: &PodScore| match p.pod {
                    PodRef::Known(i) => directory.pod(i).map_or("", |n| n),
                    PodRef::Speculative(i) => speculative
                        .as_ref()
                        .and_then(|d| d.pod(i))
                        .map_or("", |n| n),
                    PodRef::Unknown(_) => "",
                };
                out.scores.sort_unstable_by(|a, b| {
                    b.score
                        .total_cmp(&a.score)
                        .then(b.matched_blocks.cmp(&a.matched_blocks))
                        .then_with(|| name(a).cmp(name(b)))
                });
            }
        }
        out.directory = Some(directory);
        out.speculative = speculative;
    }

    /// The speculative walk (only while the model has speculative entries): a pod whose
    /// recorded routings reach further than its real blocks scores the difference at the
    /// speculative weight. Pods the index knows get it in `s.best`; pods known only by their
    /// records, in `s.spec_len` by speculative pod index. Returns the speculative directory.
    fn score_speculative<S: AsRef<str>>(
        &self,
        state: &ModelState,
        directory: &EngineDirectory,
        hashes: &[BlockHash],
        pods: &[S],
        s: &mut PodScratch,
    ) -> Option<Arc<EngineDirectory>> {
        s.spec_holding.next_round();
        if state.speculation.is_empty() {
            return None;
        }
        let index = state.speculation.index();
        let sdir = index.directory();
        s.spec_candidates.clear();
        for pod in pods {
            s.spec_candidates
                .extend_from_slice(sdir.engines_of(pod.as_ref()));
        }
        let restrict = (!pods.is_empty()).then_some(s.spec_candidates.as_slice());
        // Every speculative block weighs the same; the weight is applied below.
        index.score_engines(
            hashes,
            restrict,
            &TierWeights([1.0; 4]),
            &mut s.spec_engines,
        );
        if s.spec_len.len() < sdir.pod_slots() {
            s.spec_len.resize(sdir.pod_slots(), 0);
        }
        let weight = self.settings.speculation.weight;
        for e in &s.spec_engines {
            let Some(sp) = sdir.pod_of(e.engine) else {
                continue;
            };
            let Some(name) = sdir.pod(sp) else {
                continue;
            };
            let n = e.matched_blocks;
            match directory.pod_index(name) {
                Some(p) => {
                    let slot = &mut s.best[p as usize];
                    if s.holding.mark(p as usize) {
                        *slot = (0.0, 0, 0);
                    }
                    if n > slot.1 {
                        let extra = n - slot.1;
                        *slot = (slot.0 + weight * extra as f64, n, extra);
                    }
                }
                None => {
                    s.spec_holding.mark(sp as usize);
                    s.spec_len[sp as usize] = n;
                }
            }
        }
        Some(sdir)
    }

    /// Per-model index statistics.
    pub fn stats(&self) -> Vec<(Arc<str>, IndexStats)> {
        self.models()
            .iter()
            .map(|m| (m.name.clone(), m.index.stats()))
            .collect()
    }

    /// Events of unknown types seen so far.
    pub fn unknown_events(&self) -> u64 {
        self.totals.unknown_events.load(Ordering::Relaxed)
    }

    /// Events skipped because their group is not indexed.
    pub fn skipped_group_events(&self) -> u64 {
        self.totals.skipped_group_events.load(Ordering::Relaxed)
    }
}
