//! Routing runs ahead of events: the prompt keys a score hands out, and a routing record,
//! which turns "the gateway sent this prompt to that pod" into speculative entries (kv-core's
//! `Indexer::record_routing`) on this replica and, through the shared log (replication), on the
//! others (`RecordRouting`, and every pick of the endpoint picker).
//!
//! Invariants: a prompt key names one prompt's block hashes, its model and the candidates it
//! was scored for, for [`PROMPT_KEY_TTL`] on this replica; keys are 16 bytes, a per-process
//! nonce then a counter, so a key from another process (or a restart) never names a prompt
//! here; the keys' memory is bounded by [`PROMPT_KEY_MAX_HASHES`] (the oldest go first).

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{BlockHash, ScoreError};

use super::{Scoring, ScoringError};
use crate::ingest::LogEntry;

/// How long a prompt key names its prompt (a gateway calls `RecordRouting` milliseconds after
/// `ScorePods`).
pub const PROMPT_KEY_TTL: Duration = Duration::from_secs(30);

/// Most block hashes all live prompt keys hold together (8 bytes each: 64 MiB).
pub const PROMPT_KEY_MAX_HASHES: u64 = 8 << 20;

/// A scored prompt, as a prompt key names it.
pub struct ScoredPrompt {
    /// Its model.
    pub model: Arc<str>,
    /// Its block hashes.
    pub hashes: Arc<[BlockHash]>,
    /// The candidates it was scored for (empty: every pod the model knows).
    pub candidates: Vec<String>,
}

/// The prompt keys this replica handed out.
pub struct PromptKeys {
    cache: moka::sync::Cache<[u8; 16], Arc<ScoredPrompt>>,
    nonce: u64,
    next: AtomicU64,
}

impl Default for PromptKeys {
    fn default() -> Self {
        Self {
            cache: moka::sync::Cache::builder()
                .time_to_live(PROMPT_KEY_TTL)
                .weigher(|_, p: &Arc<ScoredPrompt>| {
                    u32::try_from(p.hashes.len()).unwrap_or(u32::MAX).max(1)
                })
                .max_capacity(PROMPT_KEY_MAX_HASHES)
                .build(),
            nonce: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            next: AtomicU64::new(0),
        }
    }
}

impl PromptKeys {
    /// A key naming `prompt` (empty when it has no full block: nothing to record).
    pub fn issue(&self, prompt: ScoredPrompt) -> Vec<u8> {
        if prompt.hashes.is_empty() {
            return Vec::new();
        }
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&self.nonce.to_be_bytes());
        key[8..].copy_from_slice(&self.next.fetch_add(1, Ordering::Relaxed).to_be_bytes());
        self.cache.insert(key, Arc::new(prompt));
        key.to_vec()
    }

    /// The prompt `key` names; `None` when unknown or expired. A key that is not 16 bytes is
    /// the caller's error.
    pub fn get(&self, key: &[u8]) -> Result<Option<Arc<ScoredPrompt>>, ScoringError> {
        let key: [u8; 16] = key.try_into().map_err(|_| {
            ScoringError::Invalid(format!(
                "prompt_key has {} bytes; keys from ScorePods have 16",
                key.len()
            ))
        })?;
        Ok(self.cache.get(&key))
    }
}

/// A record's block hashes, and the scored prompt its key named (if it named one).
type NamedHashes = (Arc<[BlockHash]>, Option<Arc<ScoredPrompt>>);

/// A routing to record: the gateway sent a prompt (named by its prompt key, or by its tokens)
/// to a pod.
#[derive(Debug, Clone, Default)]
pub struct RoutingRecord {
    /// The model.
    pub model: String,
    /// The pod the gateway chose.
    pub pod: String,
    /// The prompt key a score handed out (empty: use `tokens`).
    pub prompt_key: Vec<u8>,
    /// The prompt's token ids, when no prompt key names it.
    pub tokens: Option<Vec<u32>>,
    /// The LoRA adapter (with `tokens`; empty: none).
    pub lora: String,
    /// vLLM's `cache_salt` (with `tokens`; empty: none).
    pub cache_salt: String,
    /// The pod's data-parallel rank the request is pinned to.
    pub rank: Option<u32>,
}

impl Scoring {
    /// Records a routing: validates, finds the prompt's hashes (by key, else from the tokens),
    /// checks the pod, records, and tells the other replicas. The blocks recorded.
    pub fn record(&self, req: RoutingRecord) -> Result<u32, ScoringError> {
        let invalid = |m: &str| Err(ScoringError::Invalid(m.to_owned()));
        if req.model.is_empty() {
            return invalid("model is required");
        }
        if req.pod.is_empty() {
            return invalid("pod is required: the pod the gateway chose");
        }
        let Some(model) = self.indexer.model(&req.model) else {
            return Err(ScoringError::NotFound(
                ScoreError::UnknownModel(req.model).to_string(),
            ));
        };
        let (hashes, scored) = self.hashes_of(&req)?;
        // The pod must be one the index knows for the model, or a candidate the prompt was
        // scored for (a pod that publishes no events is known only that way).
        let known = !model.index().directory().engines_of(&req.pod).is_empty()
            || model.speculation_of(&req.pod).is_some()
            || scored.is_some_and(|p| p.candidates.contains(&req.pod));
        if !known {
            return Err(ScoringError::NotFound(format!(
                "unknown pod {:?} for model {:?}: neither publishing events for it nor among \
                 the candidates the prompt was scored for",
                req.pod, req.model
            )));
        }
        let rank = req.rank.unwrap_or(0);
        if rank > kv_core::MAX_DATA_PARALLEL_RANK {
            return Err(ScoringError::Invalid(format!(
                "data_parallel_rank {rank} is out of range (0..={})",
                kv_core::MAX_DATA_PARALLEL_RANK
            )));
        }
        let recorded = self
            .indexer
            .record_routing(&req.model, &req.pod, rank, hashes.clone(), Instant::now())
            .map_err(|e| ScoringError::NotFound(e.to_string()))?;
        self.metrics.speculation.routing_recorded(recorded);
        let blocks = recorded.blocks();
        if let Some(log) = self.log.as_ref().filter(|_| blocks > 0) {
            log.append(LogEntry::Speculate {
                model: req.model.as_str().into(),
                pod: req.pod.as_str().into(),
                rank,
                hashes,
            });
        }
        Ok(u32::try_from(blocks).unwrap_or(u32::MAX))
    }

    /// The hashes a record names: its prompt key's (with the prompt it names), else its
    /// tokens' hashed.
    fn hashes_of(&self, req: &RoutingRecord) -> Result<NamedHashes, ScoringError> {
        let scored = match req.prompt_key.is_empty() {
            true => None,
            false => self.prompt_keys.get(&req.prompt_key)?,
        };
        self.metrics
            .speculation
            .prompt_key(match (req.prompt_key.is_empty(), scored.is_some()) {
                (true, _) => "absent",
                (false, true) => "found",
                (false, false) => "unknown",
            });
        match (scored, &req.tokens) {
            (Some(p), _) if *p.model != *req.model => Err(ScoringError::Invalid(format!(
                "prompt_key was issued for model {:?}, not {:?}",
                p.model, req.model
            ))),
            (Some(p), _) => Ok((p.hashes.clone(), Some(p))),
            (None, Some(tokens)) => {
                if tokens.is_empty() {
                    return Err(ScoringError::Invalid("the prompt has no tokens".into()));
                }
                self.check_tokens(tokens.len())?;
                let hashes = self
                    .indexer
                    .block_hashes(
                        &req.model,
                        tokens,
                        Some(req.lora.as_str()),
                        Some(req.cache_salt.as_str()),
                    )
                    .map_err(ScoringError::from)?;
                Ok((Arc::from(hashes), None))
            }
            (None, None) if req.prompt_key.is_empty() => Err(ScoringError::Invalid(
                "prompt_key (from ScorePods) or tokens is required".into(),
            )),
            (None, None) => Err(ScoringError::NotFound(format!(
                "prompt_key is unknown or expired (keys live {}s on the replica that scored \
                 the prompt); send tokens instead",
                PROMPT_KEY_TTL.as_secs()
            ))),
        }
    }
}
