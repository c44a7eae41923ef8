//! The daemon's configuration: YAML in the shape operators already use for llm-d's
//! precise-prefix-cache scorer (`indexerConfig`, `kvEventsConfig`), plus kv-indexer's own
//! sections (`server`, `scoring`, `models`, `replication`, `endpointPicker`).
//!
//! Invariants: every field has a default, so an empty file (or none) is a working config; an
//! unknown field or a bad value is an error naming the field's path; environment overrides
//! (`HF_TOKEN`, `PYTHONHASHSEED`) are applied by [`Config::apply_env`] and win over the file;
//! [`Config::redacted`] hides secrets for printing.

mod duration;
mod events;
mod loud;
mod pd;
mod picker;
mod settings;
mod validate;

pub use duration::ConfigDuration;
pub use events::{
    nameserver_address, ConnectEndpoint, DiscoveredService, DiscoveryConfig, KvEventsConfig,
    MAX_POD_LEN,
};
pub use loud::ConfigWarning;
pub use pd::{PdConfig, RoledEndpoint, StaticEndpoint};
pub use picker::{
    EndpointPickerConfig, PickerHealthConfig, PickerTlsConfig, PickerTlsMode, PoolRefConfig,
    MAX_STATIC_ENDPOINTS,
};

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use kv_core::TierWeights;
use kv_core::{EngineHashes, ExtraKeysFormat};

/// Why a configuration was rejected.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not valid YAML for this schema (unknown field, wrong type): serde's message names it.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// serde_yaml's message, with the field and line.
        message: String,
    },
    /// A value out of range.
    #[error("{field}: {message}")]
    Invalid {
        /// The field's path, e.g. `indexerConfig.tokenProcessorConfig.blockSize`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Config {
    /// Hashing, index and tokenizer settings (llm-d's `indexerConfig`).
    pub indexer_config: IndexerSection,
    /// Where KV events come from (llm-d's `kvEventsConfig`).
    pub kv_events_config: KvEventsConfig,
    /// Listen addresses and request limits.
    pub server: ServerConfig,
    /// How blocks are weighted in a score.
    pub scoring: ScoringConfig,
    /// Per-model overrides (models listed here are known before any event arrives).
    pub models: BTreeMap<String, ModelConfig>,
    /// Several replicas sharing one index through Redis (off by default).
    pub replication: ReplicationConfig,
    /// kv-indexer as an InferencePool's endpoint picker (Envoy ext_proc; off by default).
    pub endpoint_picker: EndpointPickerConfig,
}

/// Replication through Redis (or Valkey): a shared event log, snapshots and warm restarts.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ReplicationConfig {
    /// Off by default: the daemon is one process with an in-memory index.
    pub enabled: bool,
    /// `redis://[user:password@]host:port[/db]` or `rediss://` (TLS); `KVINDEXER_REDIS_URL`
    /// wins over the file. The password is never printed.
    pub redis_url: String,
    /// Prefix of every key this deployment uses, so several deployments can share one Redis.
    pub key_prefix: String,
    /// This replica's name in the log and in `ListPods`; empty: the host name.
    pub replica_id: String,
    /// How often a snapshot of the index is written (by one replica at a time); the log is
    /// trimmed behind it.
    pub snapshot_interval: ConfigDuration,
    /// Messages waiting to be appended while Redis is slow or down; beyond, appends are
    /// dropped and counted (`kvindexer_replication_append_dropped_total`).
    pub append_queue: usize,
    /// Bytes those messages may hold together (large payloads must not multiply memory while
    /// Redis is down); beyond, appends are dropped and counted the same way.
    pub append_queue_bytes: usize,
    /// The log's length cap (approximate, entries): a safety net should snapshots stop; a
    /// replica that falls further behind reloads from the snapshot.
    pub max_log_length: u64,
    /// How long a starting replica waits for Redis (snapshot and log) before it serves cold
    /// and catches up in the background.
    pub startup_timeout: ConfigDuration,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            redis_url: String::new(),
            key_prefix: "kv-indexer".into(),
            replica_id: String::new(),
            snapshot_interval: ConfigDuration::secs(30),
            append_queue: 65_536,
            append_queue_bytes: 512 << 20,
            max_log_length: 2_000_000,
            startup_timeout: ConfigDuration::secs(10),
        }
    }
}

/// `url` with its password (if any) replaced, for logs, metrics and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or("", |(u, _)| u);
            format!("{scheme}://{user}:<redacted>@{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// llm-d's `indexerConfig`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct IndexerSection {
    /// Reuse of earlier tokenizations.
    pub prefix_store_config: PrefixStoreConfig,
    /// vLLM block hashing: must match the fleet.
    pub token_processor_config: TokenProcessorSection,
    /// Index capacity.
    pub kv_block_index_config: KvBlockIndexConfig,
    /// Tokenizer workers and sources.
    pub tokenizers_pool_config: TokenizersPoolConfig,
}

/// Prefix store (tokenization cache) settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PrefixStoreConfig {
    /// Cached text blocks (llm-d's bound), counted as if each held `blockSize` tokens.
    pub cache_size: usize,
    /// Characters per cached text block.
    pub block_size: usize,
    /// Bytes the store may hold (a block weighs its token ids plus 64 bytes); the tighter of
    /// this and `cacheSize` applies.
    pub max_bytes: u64,
}

impl Default for PrefixStoreConfig {
    fn default() -> Self {
        Self {
            cache_size: 500_000,
            block_size: 256,
            max_bytes: 256 << 20,
        }
    }
}

/// Block hashing settings; they must equal the vLLM fleet's.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TokenProcessorSection {
    /// vLLM's `--block-size`.
    pub block_size: usize,
    /// vLLM's `PYTHONHASHSEED`. Absent: `$PYTHONHASHSEED` if set, else vLLM's default
    /// (`"vllm-none-hash"`, vLLM >= 0.29). `""` means set-but-empty, as in vLLM.
    pub hash_seed: Option<String>,
    /// Hash unit for hybrid models, when smaller than `blockSize`.
    pub hash_block_size: Option<usize>,
    /// `tagged` (vLLM >= 0.31) or `untagged` (0.14-0.30).
    pub extra_keys_format: ExtraKeysFormat,
    /// How engines' published hashes become index keys: `auto` (per engine, from its own
    /// events: taken as they are when they equal the keys above, else translated from the
    /// events' token ids), `aligned` (always taken; an engine that hashes differently scores
    /// 0) or `translated` (always computed from token ids).
    pub engine_hashes: EngineHashes,
}

impl Default for TokenProcessorSection {
    fn default() -> Self {
        Self {
            block_size: 16,
            hash_seed: None,
            hash_block_size: None,
            extra_keys_format: ExtraKeysFormat::Tagged,
            engine_hashes: EngineHashes::Auto,
        }
    }
}

/// llm-d's `kvBlockIndexConfig`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct KvBlockIndexConfig {
    /// The in-memory index (the only backend).
    pub in_memory_config: InMemoryConfig,
    /// Export index metrics.
    pub enable_metrics: bool,
}

impl Default for KvBlockIndexConfig {
    fn default() -> Self {
        Self {
            in_memory_config: InMemoryConfig::default(),
            enable_metrics: true,
        }
    }
}

/// Capacity of the in-memory index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct InMemoryConfig {
    /// Most block keys, all models together (as llm-d's single index counts them).
    pub size: usize,
    /// Most (pod, tier) holders recorded per block key, the oldest dropped beyond (llm-d's
    /// setting, honoured when present). Absent (the default): exact, every holder recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_cache_size: Option<usize>,
    /// Writer lanes per model: events of pods in different lanes apply in parallel (the ingest
    /// workers write concurrently); a query walks every lane.
    pub writer_lanes: usize,
    /// Most models indexed; events of further models are dropped and counted.
    pub max_models: usize,
    /// Retired: the index's data structure was once a choice (`runs` or `nodes`). The index
    /// has one structure now; `nodes` is refused and `runs` warned about (it does nothing), so
    /// a file written for an older release fails loudly or says what to remove.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<RetiredEngine>,
}

/// The values the retired `engine` setting took.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RetiredEngine {
    /// The node index, removed: refused with a message saying so.
    Nodes,
    /// The run index, now the only structure: accepted with a warning.
    Runs,
}

impl Default for InMemoryConfig {
    fn default() -> Self {
        Self {
            size: 100_000_000,
            pod_cache_size: None,
            writer_lanes: 2,
            max_models: kv_core::DEFAULT_MAX_MODELS,
            engine: None,
        }
    }
}

/// Tokenizer pool settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TokenizersPoolConfig {
    /// Tokenizer worker threads.
    pub workers_count: usize,
    /// Share of a prompt the prefix store must cover for its tokens to be used as they are.
    pub min_prefix_overlap_ratio: f64,
    /// HuggingFace token (`$HF_TOKEN` overrides it).
    pub hugging_face_token: String,
    /// Where downloaded tokenizers are cached.
    pub tokenizers_cache_dir: String,
    /// Local tokenizer files (llm-d form).
    pub local: LocalTokenizers,
    /// Never download; only local files and the cache (`HF_HUB_OFFLINE=1` sets it).
    pub offline: bool,
    /// HuggingFace Hub base URL (`HF_ENDPOINT` overrides it); empty = huggingface.co.
    pub hf_endpoint: String,
    /// Tokenization requests waiting at most (beyond: RESOURCE_EXHAUSTED).
    pub queue_size: usize,
    /// Prompts (or chats) longer than this many bytes are tokenized in a lane of their own (an
    /// eighth of the workers, at least one, and a quarter of the queue), so a few huge prompts
    /// cannot hold up the short ones.
    pub large_prompt_bytes: usize,
}

impl Default for TokenizersPoolConfig {
    fn default() -> Self {
        Self {
            workers_count: 8,
            min_prefix_overlap_ratio: 0.8,
            hugging_face_token: String::new(),
            tokenizers_cache_dir: "/tmp".into(),
            local: LocalTokenizers::default(),
            offline: false,
            hf_endpoint: String::new(),
            queue_size: 1024,
            large_prompt_bytes: 32 << 10,
        }
    }
}

/// llm-d's `tokenizersPoolConfig.local`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LocalTokenizers {
    /// Model -> `tokenizer.json` path (or its folder).
    pub model_tokenizer_map: BTreeMap<String, String>,
}

/// Listen addresses and limits.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ServerConfig {
    /// gRPC (ScorePods, admin, health, reflection).
    pub grpc_addr: String,
    /// HTTP: `/metrics`, `/healthz`, `/readyz`.
    pub metrics_addr: String,
    /// Score requests in flight at most; beyond, RESOURCE_EXHAUSTED.
    pub max_concurrent_requests: usize,
    /// Prompt tokens accepted at most.
    pub max_prompt_tokens: usize,
    /// Prompt text accepted at most, in bytes (a chat: its roles, contents, tools and template
    /// arguments together). The gRPC message limit follows from this and `maxPromptTokens`, so
    /// an oversize request is refused before it is read whole.
    pub max_prompt_bytes: usize,
    /// Chat messages accepted at most.
    pub max_chat_messages: usize,
    /// Candidate pods per request at most.
    pub max_candidate_pods: usize,
    /// On SIGTERM, how long in-flight work may take before exit.
    pub shutdown_grace_ms: u64,
    /// Serve `RecordRouting` (recorded routings change scores: speculative entries). Off, it
    /// answers PERMISSION_DENIED naming this setting.
    pub enable_record_routing: bool,
    /// Whether RPCs that change the index (`ClearPod`) are served. Off: they answer
    /// PERMISSION_DENIED naming this setting.
    pub enable_admin_rpcs: bool,
    /// The bearer token admin RPCs must carry (`authorization: Bearer <token>`), required when
    /// they are enabled; also `KVINDEXER_ADMIN_TOKEN`. Never printed.
    pub admin_token: String,
    /// TLS for gRPC (off when both files are empty).
    pub tls: TlsConfig,
}

/// gRPC TLS (rustls): a certificate and key in PEM, and optionally the CA that client
/// certificates must chain to (mutual TLS).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The server certificate chain (PEM file).
    pub cert_file: String,
    /// The server private key (PEM file).
    pub key_file: String,
    /// When set, clients must present a certificate issued by this CA (PEM file).
    pub client_ca_file: String,
}

impl TlsConfig {
    /// Whether TLS is configured.
    pub fn enabled(&self) -> bool {
        !self.cert_file.is_empty() || !self.key_file.is_empty()
    }
}

impl ServerConfig {
    /// The largest gRPC message accepted: a maximal prompt as text or as token ids (at most 5
    /// bytes each on the wire), plus room for the other fields.
    pub fn max_request_bytes(&self) -> usize {
        self.max_prompt_bytes
            .max(self.max_prompt_tokens.saturating_mul(5))
            .saturating_add(64 << 10)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            grpc_addr: "0.0.0.0:50051".into(),
            metrics_addr: "0.0.0.0:9090".into(),
            max_concurrent_requests: 1024,
            max_prompt_tokens: 1 << 18,
            max_prompt_bytes: 1 << 20,
            max_chat_messages: 4096,
            max_candidate_pods: 10_000,
            shutdown_grace_ms: 5_000,
            enable_record_routing: false,
            enable_admin_rpcs: false,
            admin_token: String::new(),
            tls: TlsConfig::default(),
        }
    }
}

/// The digest memo's default size: 131,072 units of 16 tokens (2M prompt tokens), 16 MiB.
pub const DEFAULT_DIGEST_MEMO_BYTES: usize = 16 << 20;

/// Scoring settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ScoringConfig {
    /// Weight of a block per tier.
    pub tier_weights: TierWeightsConfig,
    /// How long a recorded routing (`RecordRouting`) counts while the pod's events confirm
    /// routings promptly; a pod whose events lag gets up to 8 times longer.
    pub speculative_ttl: ConfigDuration,
    /// Most prompt blocks one pod's recorded routings hold (the oldest dropped beyond): the
    /// bound of the fallback for pods that publish no events.
    pub speculative_pod_blocks: usize,
    /// Most prompt blocks all recorded routings of a model hold.
    pub speculative_max_blocks: usize,
    /// Bytes of the digest memo (per hash unit size in use; 0 disables it): prompt blocks
    /// scored before are not hashed again.
    pub digest_memo_bytes: usize,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        let s = kv_core::SpeculationSettings::default();
        Self {
            tier_weights: TierWeightsConfig::default(),
            speculative_ttl: ConfigDuration(s.ttl),
            speculative_pod_blocks: s.pod_blocks,
            speculative_max_blocks: s.max_blocks,
            digest_memo_bytes: DEFAULT_DIGEST_MEMO_BYTES,
        }
    }
}

/// Per-tier block weights.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TierWeightsConfig {
    /// GPU (vLLM's own cache).
    pub gpu: f64,
    /// CPU offload.
    pub cpu: f64,
    /// Storage offload.
    pub storage: f64,
    /// Any other medium.
    pub other: f64,
    /// A block the pod holds only by a recorded routing (`RecordRouting`), not yet confirmed
    /// by its events.
    pub speculative: f64,
}

impl Default for TierWeightsConfig {
    fn default() -> Self {
        let w = TierWeights::default().0;
        Self {
            gpu: w[0],
            cpu: w[1],
            storage: w[2],
            other: w[3],
            speculative: kv_core::SpeculationSettings::default().weight,
        }
    }
}

/// Per-model overrides.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Overrides `tokenProcessorConfig.blockSize`.
    pub block_size: Option<usize>,
    /// Overrides `tokenProcessorConfig.hashSeed`.
    pub hash_seed: Option<String>,
    /// Overrides `tokenProcessorConfig.hashBlockSize`.
    pub hash_block_size: Option<usize>,
    /// Overrides `tokenProcessorConfig.extraKeysFormat`.
    pub extra_keys_format: Option<ExtraKeysFormat>,
    /// Overrides `tokenProcessorConfig.engineHashes`.
    pub engine_hashes: Option<EngineHashes>,
    /// LoRA adapter name -> path (vLLM >= 0.31 hashes the path).
    pub lora_adapters: BTreeMap<String, String>,
    /// The model's attention chunk in tokens (`attention_chunk_size` in its HuggingFace
    /// config; Llama 4: 8192). vLLM's events name a chunked-local-attention group but not its
    /// chunk: without this, such groups are refused and counted.
    pub attention_chunk_size: Option<u32>,
    /// The model keeps more than one KV-cache group (sliding window, Mamba or chunked local
    /// attention beside full attention: gpt-oss, Gemma 3, Qwen3-Next, Granite 4...). vLLM's
    /// events say so themselves; an engine whose events name no group (SGLang, which
    /// publishes only its full-attention KV; vLLM before 0.20) is then refused and counted
    /// instead of being scored by a hit it will not take.
    pub hybrid: bool,
    /// Tokenizer: a `tokenizer.json` path, its folder, or a HuggingFace model id.
    pub tokenizer: Option<String>,
}

impl Config {
    /// Parses YAML text (`source` names it in errors).
    pub fn from_yaml(text: &str, source: &str) -> Result<Self, ConfigError> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
            path: source.to_owned(),
            message: e.to_string(),
        })
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// Applies environment overrides through `get` (so tests need no process environment):
    /// `HF_TOKEN` -> `huggingFaceToken`, `PYTHONHASHSEED` -> `hashSeed`, `HF_ENDPOINT` ->
    /// `hfEndpoint`, `HF_HUB_OFFLINE=1` -> `offline`, `KVINDEXER_ADMIN_TOKEN` -> `adminToken`,
    /// `KVINDEXER_REDIS_URL` -> `replication.redisUrl`.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) {
        if let Some(endpoint) = get("HF_ENDPOINT").filter(|e| !e.is_empty()) {
            self.indexer_config.tokenizers_pool_config.hf_endpoint = endpoint;
        }
        if get("HF_HUB_OFFLINE").is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
            self.indexer_config.tokenizers_pool_config.offline = true;
        }
        if let Some(token) = get("HF_TOKEN").filter(|t| !t.is_empty()) {
            self.indexer_config
                .tokenizers_pool_config
                .hugging_face_token = token;
        }
        if let Some(seed) = get("PYTHONHASHSEED") {
            self.indexer_config.token_processor_config.hash_seed = Some(seed);
        }
        if let Some(token) = get("KVINDEXER_ADMIN_TOKEN").filter(|t| !t.is_empty()) {
            self.server.admin_token = token;
        }
        if let Some(url) = get("KVINDEXER_REDIS_URL").filter(|u| !u.is_empty()) {
            self.replication.redis_url = url;
        }
    }

    /// A copy safe to print: the HuggingFace token and the admin token are masked.
    pub fn redacted(&self) -> Self {
        let mut c = self.clone();
        for secret in [
            &mut c.indexer_config.tokenizers_pool_config.hugging_face_token,
            &mut c.server.admin_token,
        ] {
            if !secret.is_empty() {
                *secret = "<redacted>".into();
            }
        }
        c.replication.redis_url = redact_url(&c.replication.redis_url);
        c
    }

    /// The config as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

#[cfg(test)]
mod tests;
