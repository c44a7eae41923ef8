//! The daemon's configuration: YAML in the shape operators already use for llm-d's
//! precise-prefix-cache scorer (`indexerConfig`, `kvEventsConfig`), plus kv-indexer's own
//! sections (`server`, `scoring`, `models`).
//!
//! Invariants: every field has a default, so an empty file (or none) is a working config; an
//! unknown field or a bad value is an error naming the field's path; environment overrides
//! (`HF_TOKEN`, `PYTHONHASHSEED`) are applied by [`Config::apply_env`] and win over the file;
//! [`Config::redacted`] hides secrets for printing.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use kv_core::hashing::{ExtraKeysFormat, TokenProcessorConfig};
use kv_core::index::{IndexConfig, TierWeights, MAX_MEMBERS};
use kv_core::indexer::{IndexerSettings, ModelSettings};

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
    /// Cached text blocks, per model.
    pub cache_size: usize,
    /// Characters per cached text block.
    pub block_size: usize,
}

impl Default for PrefixStoreConfig {
    fn default() -> Self {
        Self {
            cache_size: 500_000,
            block_size: 256,
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
}

impl Default for TokenProcessorSection {
    fn default() -> Self {
        Self {
            block_size: 16,
            hash_seed: None,
            hash_block_size: None,
            extra_keys_format: ExtraKeysFormat::Tagged,
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
    /// Most block keys per model.
    pub size: usize,
    /// Most pods per block key.
    pub pod_cache_size: usize,
}

impl Default for InMemoryConfig {
    fn default() -> Self {
        Self {
            size: 100_000_000,
            pod_cache_size: 10,
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

/// llm-d's `kvEventsConfig`, plus connect mode and replay settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Bind mode: the SUB socket binds here and vLLM pods connect. Empty disables bind mode.
    pub zmq_endpoint: String,
    /// Subscription prefix; topics are `kv@<pod>@<model>`.
    pub topic_filter: String,
    /// Event-applying workers (one pod's events always go to the same worker, in order).
    pub concurrency: usize,
    /// Bind mode: the replay endpoint of a pod, from its address: `{ip}` and `{port}` are the
    /// topic's pod address; vLLM adds the DP rank to the port, and so does kv-indexer. Empty:
    /// no replay in bind mode.
    pub replay_endpoint_template: String,
    /// How long a replay request may take.
    pub replay_timeout_ms: u64,
    /// Messages queued per worker before the receiver waits.
    pub queue_depth: usize,
    /// Connect mode: pods that bind their PUB socket, dialled by every kv-indexer replica.
    pub endpoints: Vec<ConnectEndpoint>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            zmq_endpoint: "tcp://*:5557".into(),
            topic_filter: "kv@".into(),
            concurrency: 16,
            replay_endpoint_template: String::new(),
            replay_timeout_ms: 2_000,
            queue_depth: 1024,
            endpoints: Vec::new(),
        }
    }
}

/// One pod in connect mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ConnectEndpoint {
    /// The pod's PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub endpoint: String,
    /// The pod id the gateway uses; empty = from the topic.
    pub pod: String,
    /// The model; empty = from the topic.
    pub model: String,
    /// The pod's replay (ROUTER) endpoint, e.g. `tcp://10.0.0.7:5558`; empty = no replay.
    pub replay_endpoint: String,
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
    /// Prompt text accepted at most, in bytes.
    pub max_prompt_bytes: usize,
    /// Candidate pods per request at most.
    pub max_candidate_pods: usize,
    /// On SIGTERM, how long in-flight work may take before exit.
    pub shutdown_grace_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            grpc_addr: "0.0.0.0:50051".into(),
            metrics_addr: "0.0.0.0:9090".into(),
            max_concurrent_requests: 1024,
            max_prompt_tokens: 1 << 20,
            max_prompt_bytes: 8 << 20,
            max_candidate_pods: 10_000,
            shutdown_grace_ms: 5_000,
        }
    }
}

/// Scoring settings.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ScoringConfig {
    /// Weight of a block per tier.
    pub tier_weights: TierWeightsConfig,
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
}

impl Default for TierWeightsConfig {
    fn default() -> Self {
        let w = TierWeights::default().0;
        Self {
            gpu: w[0],
            cpu: w[1],
            storage: w[2],
            other: w[3],
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
    /// LoRA adapter name -> path (vLLM >= 0.31 hashes the path).
    pub lora_adapters: BTreeMap<String, String>,
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
    /// `hfEndpoint`, `HF_HUB_OFFLINE=1` -> `offline`.
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
    }

    /// Checks every range; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let tp = &self.indexer_config.token_processor_config;
        check_block_sizes(
            "indexerConfig.tokenProcessorConfig",
            tp.block_size,
            tp.hash_block_size,
        )?;
        let mem = &self.indexer_config.kv_block_index_config.in_memory_config;
        if mem.size == 0 || mem.size > (u32::MAX - 2) as usize {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.size",
                format!("must be between 1 and {}", u32::MAX - 2),
            ));
        }
        if mem.pod_cache_size == 0 || mem.pod_cache_size > MAX_MEMBERS {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.podCacheSize",
                format!("must be between 1 and {MAX_MEMBERS}"),
            ));
        }
        let ps = &self.indexer_config.prefix_store_config;
        if ps.block_size == 0 {
            return Err(invalid(
                "indexerConfig.prefixStoreConfig.blockSize",
                "must be at least 1",
            ));
        }
        let pool = &self.indexer_config.tokenizers_pool_config;
        if pool.workers_count == 0 || pool.workers_count > 256 {
            return Err(invalid(
                "indexerConfig.tokenizersPoolConfig.workersCount",
                "must be between 1 and 256",
            ));
        }
        if !(0.0..=1.0).contains(&pool.min_prefix_overlap_ratio) {
            return Err(invalid(
                "indexerConfig.tokenizersPoolConfig.minPrefixOverlapRatio",
                "must be between 0 and 1",
            ));
        }
        let ev = &self.kv_events_config;
        if ev.concurrency == 0 || ev.concurrency > 1024 {
            return Err(invalid(
                "kvEventsConfig.concurrency",
                "must be between 1 and 1024",
            ));
        }
        if ev.queue_depth == 0 {
            return Err(invalid("kvEventsConfig.queueDepth", "must be at least 1"));
        }
        if !ev.zmq_endpoint.is_empty() {
            check_tcp_endpoint("kvEventsConfig.zmqEndpoint", &ev.zmq_endpoint)?;
        }
        if !ev.replay_endpoint_template.is_empty() && !ev.replay_endpoint_template.contains("{ip}")
        {
            return Err(invalid(
                "kvEventsConfig.replayEndpointTemplate",
                "must contain {ip} (e.g. tcp://{ip}:5558)",
            ));
        }
        for (i, ep) in ev.endpoints.iter().enumerate() {
            check_tcp_endpoint(
                &format!("kvEventsConfig.endpoints[{i}].endpoint"),
                &ep.endpoint,
            )?;
            if !ep.replay_endpoint.is_empty() {
                check_tcp_endpoint(
                    &format!("kvEventsConfig.endpoints[{i}].replayEndpoint"),
                    &ep.replay_endpoint,
                )?;
            }
        }
        if ev.zmq_endpoint.is_empty() && ev.endpoints.is_empty() {
            tracing::warn!(
                "no event source: kvEventsConfig.zmqEndpoint is empty and no endpoints are listed"
            );
        }
        for (field, addr) in [
            ("server.grpcAddr", &self.server.grpc_addr),
            ("server.metricsAddr", &self.server.metrics_addr),
        ] {
            addr.parse::<SocketAddr>()
                .map_err(|e| invalid(field, format!("{addr:?} is not host:port ({e})")))?;
        }
        for (field, value) in [
            (
                "server.maxConcurrentRequests",
                self.server.max_concurrent_requests,
            ),
            ("server.maxPromptTokens", self.server.max_prompt_tokens),
            ("server.maxPromptBytes", self.server.max_prompt_bytes),
            ("server.maxCandidatePods", self.server.max_candidate_pods),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        let w = &self.scoring.tier_weights;
        for (name, v) in [
            ("gpu", w.gpu),
            ("cpu", w.cpu),
            ("storage", w.storage),
            ("other", w.other),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(
                    format!("scoring.tierWeights.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        for (model, m) in &self.models {
            if model.is_empty() {
                return Err(invalid("models", "a model name is empty"));
            }
            let block = m.block_size.unwrap_or(tp.block_size);
            let unit = m.hash_block_size.or(tp.hash_block_size);
            check_block_sizes(&format!("models.{model}"), block, unit)?;
        }
        Ok(())
    }

    /// The library settings this config describes.
    pub fn indexer_settings(&self) -> IndexerSettings {
        let tp = &self.indexer_config.token_processor_config;
        let default_processor = TokenProcessorConfig {
            hash_seed: tp.hash_seed.clone(),
            block_size: tp.block_size,
            hash_block_size: tp.hash_block_size,
            extra_keys_format: tp.extra_keys_format,
        };
        let models = self
            .models
            .iter()
            .map(|(name, m)| {
                let settings = ModelSettings {
                    token_processor: TokenProcessorConfig {
                        hash_seed: m.hash_seed.clone().or_else(|| tp.hash_seed.clone()),
                        block_size: m.block_size.unwrap_or(tp.block_size),
                        hash_block_size: m.hash_block_size.or(tp.hash_block_size),
                        extra_keys_format: m.extra_keys_format.unwrap_or(tp.extra_keys_format),
                    },
                    lora_paths: m.lora_adapters.clone().into_iter().collect(),
                };
                (name.clone(), settings)
            })
            .collect();
        let mem = &self.indexer_config.kv_block_index_config.in_memory_config;
        let w = &self.scoring.tier_weights;
        IndexerSettings {
            index: IndexConfig {
                max_keys: mem.size,
                pod_cache_size: mem.pod_cache_size,
            },
            default_model: ModelSettings {
                token_processor: default_processor,
                lora_paths: Default::default(),
            },
            models,
            weights: TierWeights([w.gpu, w.cpu, w.storage, w.other]),
        }
    }

    /// The tokenizer pool and prefix store settings this config describes.
    pub fn tokenizer_settings(&self) -> kv_tokenize::TokenizerSettings {
        let pool = &self.indexer_config.tokenizers_pool_config;
        let mut explicit: std::collections::HashMap<String, String> =
            pool.local.model_tokenizer_map.clone().into_iter().collect();
        for (model, m) in &self.models {
            if let Some(t) = &m.tokenizer {
                explicit.insert(model.clone(), t.clone());
            }
        }
        let store = &self.indexer_config.prefix_store_config;
        kv_tokenize::TokenizerSettings {
            sources: kv_tokenize::model::SourceSettings {
                explicit,
                cache_dir: pool.tokenizers_cache_dir.clone().into(),
                hf_token: Some(pool.hugging_face_token.clone()).filter(|t| !t.is_empty()),
                hf_endpoint: Some(pool.hf_endpoint.clone()).filter(|e| !e.is_empty()),
                offline: pool.offline,
            },
            workers: pool.workers_count,
            queue_size: pool.queue_size,
            prefix_cache_size: store.cache_size as u64,
            prefix_block_chars: store.block_size,
            min_prefix_overlap_ratio: pool.min_prefix_overlap_ratio,
        }
    }

    /// A copy safe to print: the HuggingFace token is masked.
    pub fn redacted(&self) -> Self {
        let mut c = self.clone();
        let token = &mut c.indexer_config.tokenizers_pool_config.hugging_face_token;
        if !token.is_empty() {
            *token = "<redacted>".into();
        }
        c
    }

    /// The config as YAML.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

fn check_block_sizes(prefix: &str, block: usize, unit: Option<usize>) -> Result<(), ConfigError> {
    if block == 0 {
        return Err(invalid(format!("{prefix}.blockSize"), "must be at least 1"));
    }
    if let Some(u) = unit {
        if u == 0 || !block.is_multiple_of(u) {
            return Err(invalid(
                format!("{prefix}.hashBlockSize"),
                format!("must be at least 1 and divide blockSize ({block})"),
            ));
        }
    }
    Ok(())
}

fn check_tcp_endpoint(field: &str, endpoint: &str) -> Result<(), ConfigError> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(invalid(
            field,
            format!("{endpoint:?}: only tcp:// endpoints are supported"),
        ));
    };
    let port = rest.rsplit_once(':').map(|(_, p)| p);
    match port.and_then(|p| p.parse::<u16>().ok()) {
        Some(_) => Ok(()),
        None => Err(invalid(
            field,
            format!("{endpoint:?} needs a port (tcp://host:port)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_the_embedded_default() {
        let c = Config::from_yaml("", "empty").expect("empty is fine");
        assert_eq!(c, Config::default());
        c.validate().expect("defaults are valid");
        assert_eq!(c.kv_events_config.zmq_endpoint, "tcp://*:5557");
        assert_eq!(c.server.grpc_addr, "0.0.0.0:50051");
    }

    #[test]
    fn the_llm_d_shape_parses() {
        let text = r#"
indexerConfig:
  prefixStoreConfig: {cacheSize: 500000, blockSize: 256}
  tokenProcessorConfig: {blockSize: 16, hashSeed: "12345"}
  kvBlockIndexConfig: {inMemoryConfig: {size: 100000000, podCacheSize: 10}, enableMetrics: true}
  tokenizersPoolConfig: {workersCount: 8, minPrefixOverlapRatio: 0.8, huggingFaceToken: "", tokenizersCacheDir: "/tmp"}
kvEventsConfig: {zmqEndpoint: "tcp://*:5557", topicFilter: "kv@", concurrency: 16}
"#;
        let c = Config::from_yaml(text, "llm-d").expect("parses");
        c.validate().expect("valid");
        assert_eq!(
            c.indexer_config.token_processor_config.hash_seed.as_deref(),
            Some("12345")
        );
    }

    #[test]
    fn unknown_fields_and_bad_values_name_the_field() {
        let e = Config::from_yaml(
            "indexerConfig:\n  tokenProcessorConfig: {blokSize: 16}\n",
            "f",
        )
        .expect_err("typo");
        assert!(e.to_string().contains("blokSize"), "{e}");
        let c = Config::from_yaml(
            "indexerConfig:\n  tokenProcessorConfig: {blockSize: 0}\n",
            "f",
        )
        .expect("parses");
        let e = c.validate().expect_err("zero block size");
        assert!(
            e.to_string()
                .contains("indexerConfig.tokenProcessorConfig.blockSize"),
            "{e}"
        );
        let c = Config::from_yaml("server: {grpcAddr: nonsense}\n", "f").expect("parses");
        assert!(c
            .validate()
            .expect_err("bad addr")
            .to_string()
            .contains("server.grpcAddr"));
        let c = Config::from_yaml("kvEventsConfig: {zmqEndpoint: \"ipc:///x\"}\n", "f")
            .expect("parses");
        assert!(c
            .validate()
            .expect_err("ipc")
            .to_string()
            .contains("zmqEndpoint"));
    }

    #[test]
    fn env_overrides_win_and_secrets_are_redacted() {
        let mut c = Config::from_yaml(
            "indexerConfig:\n  tokenProcessorConfig: {hashSeed: \"1\"}\n  tokenizersPoolConfig: {huggingFaceToken: file}\n",
            "f",
        )
        .expect("parses");
        c.apply_env(|k| match k {
            "HF_TOKEN" => Some("hf_secret".into()),
            "PYTHONHASHSEED" => Some("42".into()),
            _ => None,
        });
        assert_eq!(
            c.indexer_config.token_processor_config.hash_seed.as_deref(),
            Some("42")
        );
        let printed = c.redacted().to_yaml();
        assert!(!printed.contains("hf_secret"), "{printed}");
        assert!(printed.contains("<redacted>"));
    }

    #[test]
    fn per_model_settings_inherit_the_defaults() {
        let c = Config::from_yaml(
            "indexerConfig:\n  tokenProcessorConfig: {hashSeed: \"7\", blockSize: 32}\nmodels:\n  m1: {loraAdapters: {sql: /a/sql}}\n  m2: {blockSize: 16, extraKeysFormat: untagged}\n",
            "f",
        )
        .expect("parses");
        c.validate().expect("valid");
        let s = c.indexer_settings();
        assert_eq!(s.models["m1"].token_processor.block_size, 32);
        assert_eq!(
            s.models["m1"].token_processor.hash_seed.as_deref(),
            Some("7")
        );
        assert_eq!(s.models["m1"].lora_paths["sql"], "/a/sql");
        assert_eq!(s.models["m2"].token_processor.block_size, 16);
        assert_eq!(
            s.models["m2"].token_processor.extra_keys_format,
            ExtraKeysFormat::Untagged
        );
    }
}
