//! kv-core: the I/O-free heart of kv-indexer.
//!
//! - `hashing`: vLLM's `sha256_cbor` block hashes, byte for byte ([`TokenProcessor`]);
//! - `events`: the msgpack `KVEventBatch` a vLLM publisher sends, decoded ([`decode_batch`]),
//!   and the one encoder of vLLM-shaped payloads that loadgen, the lab and the tests share
//!   ([`encode_batch`]);
//! - `hit`: the hit vLLM takes, from which blocks each of an engine's KV-cache groups holds
//!   (full attention, sliding window, Mamba; vLLM's hybrid coordinator) ([`Layout`]);
//! - `index`: the block -> (engine, tier) index and the prefix-scoring walk ([`ModelIndex`]);
//! - `indexer`: per-model indexes and token processors, batch application, hash-mismatch
//!   detection, translation of engines whose hashes are not the index's keys (keys from their
//!   token ids), pod scores and speculative entries (recorded routings not yet confirmed by
//!   events) ([`Indexer`]): what a transport (the daemon, a gateway, a benchmark) calls;
//! - `pick`: which candidate serves a request, from the index's prefix scores and the pods'
//!   load, as llm-d's default profile scores them ([`pick()`]);
//! - `membership`: which endpoints are candidates at all: the pool's Ready members less those
//!   whose metrics port refuses, within a bound, with a panic threshold ([`Membership`]);
//! - `disagg`: prefill/decode disaggregation: a pod's role and whether a request's prefill is
//!   split off to a pod of its own, llm-d's rule on the exact hit ([`decide`]).
//!
//! Every block in the index is keyed by a [`BlockHash`] (computed from token ids); what an
//! engine publishes in its events is an [`EngineHash`], a key only for an aligned engine
//! ([`BlockHash::aligned`]) or through translation. The facts about vLLM this crate relies on
//! (wire format, hashing, per-version differences) are in `docs/vllm-compatibility.md`.
//!
//! No async runtime, no sockets, no metrics registry: counters are returned or read, and the
//! embedding program exports them.

mod block_hash;
mod disagg;
mod events;
// Index rules broken on purpose, for the differential test's negative controls only.
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault_injection;
mod hashing;
mod hit;
mod index;
mod indexer;
mod marks;
mod membership;
// Memory for randomly probed structures: with the run index's cells (`index::runs::cells`),
// the only `unsafe` in kv-core.
#[allow(unsafe_code)]
mod memory;
mod mix;
mod pick;
mod seqlock;

// The public surface: everything a transport, a gateway, the lab or a benchmark uses. Modules
// stay private; what is not listed here is an implementation detail.

pub use block_hash::{BlockHash, EngineHash};

/// vLLM's block hashes (`hashing`).
pub use hashing::{
    event_hash, none_hash, BlockDigest, DigestMemo, ExtraKeysFormat, HashScratch, KeySpace,
    LoraAdapter, MemoStats, MultiModalItem, RequestExtras, TokenProcessor, TokenProcessorConfig,
    TokenProcessorError, DEFAULT_HASH_SEED,
};

/// KV events on the wire (`events`).
pub use events::{
    decode_batch, encode_batch, encode_batch_as, BlockRemoved, BlockStored, DecodeError,
    EventBatch, KvEvent, Medium, MsgpackKind, MsgpackValue, RankOutOfRange, WireForm,
    MAX_DATA_PARALLEL_RANK,
};

/// The hit vLLM takes from an engine's KV-cache groups (`hit`).
pub use hit::{GroupKind, GroupSpec, Layout, LayoutError, MAX_GROUPS};

/// The block index (`index`).
pub use index::{
    DenseView, EngineDirectory, EngineId, EngineKey, EngineScore, IndexConfig, IndexConfigError,
    IndexStats, IndexWriter, KeyBudget, ModelIndex, RunIndex, RunReader, RunScratch, RunStats,
    StoreOutcome, Tier, TierWeights, MAX_RUN_ENGINES, MAX_WRITER_LANES,
};

/// The reference every index structure is checked against, and the differential harness
/// that checks it (feature `testing`: kv-core's tests, kv-lab's reference backend, the
/// benchmarks).
#[cfg(feature = "testing")]
pub use index::{harness, reference::ReferenceIndex};

/// The facade transports call (`indexer`).
pub use indexer::{
    ApplyReport, EngineHashes, EngineKeyState, EngineLayout, HashCheckStats, Indexer,
    IndexerSettings, KeyMode, KeyNotes, KeysImported, ModelSettings, ModelState, PodRef, PodScore,
    PodSpeculation, RankScore, RecordEnd, RoutingRecorded, ScoreError, ScoreResult, SettingsError,
    SpeculationSettings, SpeculationStats, TranslatedBlock, TranslationReport, Untranslatable,
    ALL_PODS, DEFAULT_MAX_MODELS, MAX_TTL_FACTOR,
};

/// The endpoint pick: llm-d's default scoring profile over candidates, I/O-free (`pick`).
pub use pick::{
    pick, scorer_index, Candidate, Pick, PickError, PickSettings, PickWeights, PodMetrics,
    PrefixNormalisation, Ranked, Scorer, ScorerInput, SCORERS, SCORER_COUNT,
};

/// Which endpoints are candidates: the pool's Ready members less the ejected (`membership`).
pub use membership::{
    Change, HealthSettings, Membership, Probe, Standing, DEFAULT_FAILURES_TO_LEAVE,
    DEFAULT_MAX_EJECTION_PERCENT, DEFAULT_PANIC_THRESHOLD_PERCENT,
};

/// Prefill/decode disaggregation: roles and the split decision (`disagg`).
pub use disagg::{decide, Decision, Role, SplitReason, SplitRule, UnknownRole, ROLE_LABEL};

/// 64-bit mixing, the project's one PRNG and its one FNV-1a (`mix`).
pub use mix::{fnv1a, mix64, Fnv1a, SplitMix64};
