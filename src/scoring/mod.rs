//! Scoring as a service of the daemon: a prompt (token ids, text or a chat) for a model in, each
//! candidate pod's prefix score out, and a routing recorded as speculative entries. The gRPC
//! faces (`ScorePods`, llm-d's `GetPodScores`, `RecordRouting`) and the endpoint picker each
//! map their protocol onto these types; nothing here knows a protocol.
//!
//! - here: the shared state ([`Scoring`]), admission, the request and error types;
//! - `score`: validate, tokenize (through the tokenizer pool), hash and walk the index;
//! - [`routing`]: the prompt keys a score hands out, and recording a routing.
//!
//! Invariants: every request is validated before any work (an empty or oversize prompt is
//! [`ScoringError::Invalid`], an unknown model [`ScoringError::NotFound`], before any
//! tokenizing); at most `limits.max_concurrent_requests` requests are admitted at once (beyond:
//! [`ScoringError::Overloaded`], at once, rather than queueing behind a backlog); scoring never
//! blocks event application (reads take no index lock).

pub mod routing;
mod score;

use std::sync::Arc;

use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ServerConfig;
use crate::ingest::{LogHandle, Pods};
use crate::metrics::Metrics;
use kv_core::{Indexer, ScoreError, ScoreResult};
use kv_tokenize::{ChatInput, TokenizerService};
use routing::PromptKeys;

/// Why a score or a routing record was not made, in the daemon's own kinds (each face maps
/// them to its protocol: a gRPC code, an HTTP status).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScoringError {
    /// The request is malformed or over a limit: the caller's error.
    #[error("{0}")]
    Invalid(String),
    /// The model, pod or prompt key is not known here.
    #[error("{0}")]
    NotFound(String),
    /// Too much in flight (admission, or the tokenizer queue): try again later.
    #[error("{0}")]
    Overloaded(String),
    /// The model's tokenizer could not be downloaded (may succeed later).
    #[error("{0}")]
    Unavailable(String),
    /// The model's tokenizer cannot be loaded as configured.
    #[error("{0}")]
    NotReady(String),
    /// The deadline passed before the prompt was tokenized.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// No prefix of the prompt is knowable exactly (a cut chat whose template hides the cut).
    #[error("{0}")]
    Unscorable(String),
}

impl From<ScoreError> for ScoringError {
    fn from(e: ScoreError) -> Self {
        match e {
            ScoreError::UnknownModel(_) => Self::NotFound(e.to_string()),
            ScoreError::UnknownLora(_) => Self::Invalid(e.to_string()),
        }
    }
}

/// A prompt, in the forms the daemon scores.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Token ids, as the engine will see them.
    Tokens(Vec<u32>),
    /// Token ids packed as little-endian u32s (checked against the limit before unpacking).
    PackedTokens(Vec<u8>),
    /// Text, tokenized with the model's tokenizer (no chat template).
    Text(String),
    /// A chat, rendered with the model's chat template, then tokenized.
    Chat(ChatInput),
}

impl Prompt {
    /// The label `kvindexer_score_requests` counts this form under.
    fn kind(&self) -> &'static str {
        match self {
            Self::Tokens(_) => "tokens",
            Self::PackedTokens(_) => "token_ids_le",
            Self::Text(_) => "prompt",
            Self::Chat(_) => "chat",
        }
    }
}

/// A score request.
#[derive(Debug, Clone)]
pub struct ScoreRequest {
    /// The model (a base model the index knows).
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// The LoRA adapter the request names (empty: none).
    pub lora: String,
    /// vLLM's `cache_salt` (empty: none).
    pub cache_salt: String,
    /// The candidate pods (empty: every pod the model knows).
    pub candidates: Vec<String>,
    /// List every (pod, rank) holding part of the prompt too ([`ScoreResult::ranks`]).
    pub every_rank: bool,
}

/// A score: kv-core's result, with what the caller needs to act on it.
#[derive(Debug, Clone)]
pub struct Scores {
    /// Each candidate's score, best first (and the ranks, when asked).
    pub result: ScoreResult,
    /// Names the prompt's hashes for a routing record on this replica (empty when routing
    /// records are off, or the prompt has no full block).
    pub prompt_key: Vec<u8>,
    /// Tokens per matched block (the model's `blockSize`): `matched_blocks x block_size` is
    /// the prefix the engine will reuse.
    pub block_size: usize,
}

/// The state scoring shares: the index, the tokenizers, the limits, the prompt keys.
pub struct Scoring {
    pub(crate) indexer: Arc<Indexer>,
    pub(crate) tokenizers: Arc<TokenizerService>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) pods: Pods,
    pub(crate) limits: ServerConfig,
    in_flight: Arc<Semaphore>,
    /// The setting that bounds `in_flight` (named when a request is refused).
    in_flight_setting: &'static str,
    /// The shared log (replication): recorded routings go to every replica through it.
    log: Option<LogHandle>,
    /// The prompt keys scores handed out (for routing records).
    prompt_keys: PromptKeys,
}

impl Scoring {
    /// Scoring over `indexer`, limited by `limits` (`enable_record_routing` keeps each
    /// prompt's hashes behind a prompt key); `in_flight_setting` names the setting that
    /// `limits.max_concurrent_requests` comes from.
    pub fn new(
        indexer: Arc<Indexer>,
        tokenizers: Arc<TokenizerService>,
        metrics: Arc<Metrics>,
        pods: Pods,
        (limits, in_flight_setting): (ServerConfig, &'static str),
        log: Option<LogHandle>,
    ) -> Arc<Self> {
        Arc::new(Self {
            in_flight: Arc::new(Semaphore::new(limits.max_concurrent_requests)),
            in_flight_setting,
            indexer,
            tokenizers,
            metrics,
            pods,
            limits,
            log,
            prompt_keys: PromptKeys::default(),
        })
    }

    /// Takes a slot of `maxConcurrentRequests`, or refuses at once.
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, ScoringError> {
        self.in_flight.clone().try_acquire_owned().map_err(|_| {
            ScoringError::Overloaded(format!(
                "too many score requests in flight ({} = {})",
                self.in_flight_setting, self.limits.max_concurrent_requests
            ))
        })
    }

    /// Tokens per index block of `model` (`None`: a model the index does not know).
    pub fn block_size(&self, model: &str) -> Option<usize> {
        self.indexer
            .model(model)
            .map(|m| m.processor().block_size())
    }
}
