//! The indexer: one [`ModelIndex`] and one [`TokenProcessor`] per model, fed by decoded event
//! batches and asked for pod scores. This is the library's front door; the daemon's ZMQ and gRPC
//! layers only translate to and from it.
//!
//! The facade is split by operation, one verb each:
//! - this module: the settings and the model registry ([`Indexer::model_or_create`]);
//! - [`model`]: one model's state ([`ModelState`]: its index, processor and what its engines'
//!   events taught it);
//! - [`apply`]: what events do: [`Indexer::apply_batch`], [`Indexer::clear_engine`] (a
//!   restarted engine), [`Indexer::remove_pod`] (a pod forgotten), and a snapshot's
//!   [`Indexer::export_each`], [`Indexer::import`] and [`Indexer::clear_all`];
//! - [`score`]: what a gateway asks: [`Indexer::score_tokens`], [`Indexer::score_hashes`],
//!   [`Indexer::block_hashes`];
//! - [`routings`]: recorded routings ([`Indexer::record_routing`],
//!   [`Indexer::expire_speculation`]) over the speculative entries of `speculation`.
//!
//! Invariants:
//! - a batch from one engine is applied under that model's writer as one unit, in order;
//! - every KV-cache group whose hit rule is modelled (full attention and MLA, sliding window,
//!   Mamba) is indexed in its own key space, and a hybrid engine is scored by vLLM's rule over
//!   its groups ([`groups`], [`crate::Layout`]); a group that is not modelled is counted and
//!   skipped, its removals too;
//! - hash mismatches are detected on runs that start at the root (parent `None`) and carry
//!   tokens: block 0 is recomputed with the model's settings (one SHA-256 per run, outside the
//!   writer lock), counted per (pod, model), and diagnosed in one log line per (pod, model).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

mod adapters;
mod apply;
mod groups;
mod hash_check;
mod kinds;
mod layout_score;
mod lookahead;
mod model;
mod order;
mod routings;
mod score;
mod scored;
mod speculation;
mod translate;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use thiserror::Error;

use crate::hashing::{
    DigestMemo, MemoStats, TokenProcessor, TokenProcessorConfig, TokenProcessorError,
};
use crate::index::{IndexConfig, IndexConfigError, IndexStats, KeyBudget, ModelIndex, TierWeights};
pub use apply::{ApplyReport, KeysImported};
pub use groups::EngineLayout;
pub use model::{HashCheckStats, ModelState};
pub use score::{ScoreError, ScoreResult, ALL_PODS};
pub use scored::{PodRef, PodScore, RankScore};
use speculation::Speculation;
pub use speculation::{
    PodSpeculation, RecordEnd, RoutingRecorded, SpeculationSettings, SpeculationStats,
    MAX_TTL_FACTOR,
};
pub use translate::{
    EngineHashes, EngineKeyState, KeyMode, KeyNotes, TranslatedBlock, TranslationReport,
    Untranslatable,
};

/// How one model's hashes are computed (must equal its vLLM deployment's settings).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelSettings {
    /// Seed, block sizes and extra-key format.
    pub token_processor: TokenProcessorConfig,
    /// LoRA adapter name -> path (vLLM >= 0.31 hashes the path, which events do not carry).
    pub lora_paths: HashMap<String, String>,
    /// Whether engines' published hashes are taken as keys or translated from their tokens
    /// (decided per engine by default; see [`KeyMode`]).
    pub engine_hashes: EngineHashes,
    /// The model's attention chunk in tokens (`attention_chunk_size` of its HuggingFace
    /// config; Llama 4), which vLLM's events do not carry: with it, chunked-local-attention
    /// groups are scored by their rule; without it, they are refused and counted.
    pub attention_chunk_size: Option<u32>,
    /// The model keeps more than one KV-cache group (sliding window, Mamba or chunked local
    /// attention beside full attention). vLLM's events name each group; an engine whose
    /// events name none (SGLang publishes only its full-attention KV; vLLM before 0.20) is
    /// refused for such a model, per engine and counted, rather than scored by a hit it will
    /// not take.
    pub hybrid: bool,
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
    /// Bytes of the digest memo that lets scoring skip SHA-256 for prompt blocks seen before
    /// ([`DigestMemo`]): one memo of this size per hash unit size in use, shared by the models
    /// of that size; 0 disables it.
    pub digest_memo_bytes: usize,
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

/// Totals across models for metrics.
#[derive(Debug, Default)]
struct Totals {
    unknown_events: AtomicU64,
    skipped_group_events: AtomicU64,
    models_evicted: AtomicU64,
}

/// The multi-model index with its hashing settings.
pub struct Indexer {
    settings: IndexerSettings,
    models: ArcSwap<HashMap<Arc<str>, Arc<ModelState>>>,
    /// Serialises model creation; holds the digest memos by hash unit size.
    create: Mutex<HashMap<usize, Arc<DigestMemo>>>,
    totals: Totals,
    /// `size` keys shared by every model's index.
    budget: Arc<KeyBudget>,
    /// The models' write clock starts here ([`coarse_millis`]).
    started_ms: u64,
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
            create: Mutex::new(HashMap::new()),
            totals: Totals::default(),
            started_ms: coarse_millis(),
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
    /// At `max_models`, a model not named in the settings gives its place (see
    /// [`Indexer::admit`]).
    pub fn model_or_create(&self, name: &str) -> Result<Arc<ModelState>, SettingsError> {
        self.admit(name).map(|(state, _)| state)
    }

    /// [`Indexer::model_or_create`], saying which model gave its place, if one did. Models
    /// named in the settings are always there and never give theirs; past `max_models`, the
    /// unnamed model holding the fewest memberships (one whose pods are all gone holds none;
    /// ties: the one written longest ago) is cleared and dropped, so a flood of junk names
    /// cannot keep a real model out for longer than the flood lasts.
    pub fn admit(&self, name: &str) -> Result<(Arc<ModelState>, Option<Arc<str>>), SettingsError> {
        if let Some(m) = self.model(name) {
            return Ok((m, None));
        }
        let mut memos = self.create.lock();
        if let Some(m) = self.model(name) {
            return Ok((m, None));
        }
        let max = match self.settings.max_models {
            0 => DEFAULT_MAX_MODELS,
            n => n,
        };
        let mut next = HashMap::clone(&self.models.load());
        let mut evicted = None;
        if next.len() >= max {
            let victim = next
                .values()
                .filter(|m| !self.settings.models.contains_key(&*m.name))
                .min_by_key(|m| {
                    (
                        m.index.stats().memberships,
                        m.last_write.load(Ordering::Relaxed),
                    )
                })
                .cloned();
            let Some(victim) = victim else {
                return Err(SettingsError::TooManyModels {
                    model: name.to_owned(),
                    max,
                });
            };
            next.remove(&victim.name);
            self.evict(&victim);
            evicted = Some(victim.name.clone());
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
        let memo = (self.settings.digest_memo_bytes > 0).then(|| {
            let unit = processor.hash_block_size();
            memos
                .entry(unit)
                .or_insert_with(|| Arc::new(DigestMemo::new(unit, self.settings.digest_memo_bytes)))
                .clone()
        });
        let state = Arc::new(ModelState {
            name: name.into(),
            index: ModelIndex::with_budget(self.settings.index.clone(), self.budget.clone())?,
            processor,
            lora_paths: settings.lora_paths.clone(),
            hash_checks: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
            layouts: ArcSwap::default(),
            speculation: Speculation::new(self.settings.speculation.clone())?,
            engine_hashes: settings.engine_hashes,
            model_groups: groups::ModelGroups {
                chunk: settings.attention_chunk_size,
                hybrid: settings.hybrid,
            },
            engine_keys: Mutex::new(Default::default()),
            evicted: AtomicBool::new(false),
            last_write: AtomicU64::new(self.clock()),
            memo,
            lookahead: AtomicU32::new(0),
        });
        next.insert(name.into(), state.clone());
        self.models.store(Arc::new(next));
        Ok((state, evicted))
    }

    /// Clears `victim` and marks it evicted (it has left the registry): a batch applying to
    /// it now finishes first, and one that comes later applies nothing, so its keys all go
    /// back to the shared budget.
    fn evict(&self, victim: &ModelState) {
        {
            let _engines = victim.engine_keys.lock();
            victim.evicted.store(true, Ordering::Release);
        }
        self.clear_model(victim);
        self.totals.models_evicted.fetch_add(1, Ordering::Relaxed);
    }

    /// Milliseconds since the indexer started (the models' write clock, read on every batch;
    /// what chooses the model written least recently, for which a tick's resolution is ample).
    fn clock(&self) -> u64 {
        coarse_millis().saturating_sub(self.started_ms)
    }

    /// Every digest memo's hits, misses and bytes, summed (memos are never dropped, so the
    /// counts only grow).
    pub fn digest_memo_stats(&self) -> MemoStats {
        let mut total = MemoStats::default();
        for memo in self.create.lock().values() {
            total += memo.stats();
        }
        total
    }

    /// Models that gave their place to another (`max_models`) so far.
    pub fn models_evicted(&self) -> u64 {
        self.totals.models_evicted.load(Ordering::Relaxed)
    }
}

impl Indexer {
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

/// A monotonic clock in milliseconds, coarse (a scheduler tick, 1-4 ms) where the kernel has
/// one: on Linux `CLOCK_MONOTONIC_COARSE`, which the vDSO reads without touching the TSC. On
/// this project's VM the precise clock (`Instant::now`) was 8% of applying a one-event batch
/// (`perf`, `benches/peers` fleet `16e`).
#[cfg(target_os = "linux")]
fn coarse_millis() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    let millis = i128::from(t.tv_sec) * 1000 + i128::from(t.tv_nsec) / 1_000_000;
    u64::try_from(millis).unwrap_or(0)
}

/// [`coarse_millis`] elsewhere: the precise clock, from the first call.
#[cfg(not(target_os = "linux"))]
fn coarse_millis() -> u64 {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(std::time::Instant::now);
    u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod clock_tests {
    #[test]
    fn the_write_clock_counts_milliseconds_and_never_goes_back() {
        let before = super::coarse_millis();
        std::thread::sleep(std::time::Duration::from_millis(60));
        let after = super::coarse_millis();
        let elapsed = after
            .checked_sub(before)
            .expect("the clock never goes back");
        // A coarse clock lags by up to a tick (at most 10 ms at 100 Hz); a clock in other
        // units (seconds, microseconds) would fall outside.
        assert!(
            (45..=5_000).contains(&elapsed),
            "60 ms read as {elapsed} ms"
        );
    }
}
