//! Settings that would silently do nothing. Each is an error at start (`validate`) when
//! running that way defeats what the operator set it up for, or a warning naming the field
//! (`warnings`, logged by `serve` at start and printed by `check-config`) when it is merely
//! inert. docs/configuration.md lists every case ("Settings that do nothing").

use std::fmt;

use super::{invalid, Config, ConfigError, ReplicationConfig};

/// A setting that has no effect in this configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The field's path, e.g. `server.adminToken`.
    pub field: String,
    /// Why it does nothing, and what to do.
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl Config {
    /// Replication settings given while `replication.enabled` is false: an error, since the
    /// replicas of such a deployment would each keep a partial view without a word.
    pub(super) fn check_disabled_replication(&self) -> Result<(), ConfigError> {
        let r = &self.replication;
        if r.enabled {
            return Ok(());
        }
        let d = ReplicationConfig::default();
        let set: Vec<&str> = [
            ("redisUrl", r.redis_url != d.redis_url),
            ("keyPrefix", r.key_prefix != d.key_prefix),
            ("replicaId", r.replica_id != d.replica_id),
            (
                "snapshotInterval",
                r.snapshot_interval != d.snapshot_interval,
            ),
            ("appendQueue", r.append_queue != d.append_queue),
            (
                "appendQueueBytes",
                r.append_queue_bytes != d.append_queue_bytes,
            ),
            ("maxLogLength", r.max_log_length != d.max_log_length),
            ("startupTimeout", r.startup_timeout != d.startup_timeout),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
        if set.is_empty() {
            return Ok(());
        }
        Err(invalid(
            "replication.enabled",
            format!(
                "is false, but replication.{} {} set (KVINDEXER_REDIS_URL sets redisUrl): \
                 set enabled: true to share one index between replicas, or remove them \
                 (each replica would otherwise keep its own partial view)",
                set.join(", replication."),
                if set.len() == 1 { "is" } else { "are" }
            ),
        ))
    }

    /// Settings that are inert in this configuration, each with the field that names it.
    pub fn warnings(&self) -> Vec<ConfigWarning> {
        let mut out = Vec::new();
        self.event_warnings(&mut out);
        self.scoring_warnings(&mut out);
        self.tokenizer_and_model_warnings(&mut out);
        self.endpoint_picker.warnings(&mut out);
        out
    }

    /// The index's and the events' inert settings.
    fn event_warnings(&self, out: &mut Vec<ConfigWarning>) {
        let mut warn = |field: &str, message: &str| push(out, field, message);
        let mem = &self.indexer_config.kv_block_index_config.in_memory_config;
        if mem.engine == Some(super::RetiredEngine::Runs) {
            warn(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.engine",
                "is no longer a choice: the index has one structure (the run index, which \
                 `runs` named); remove it",
            );
        }
        let ev = &self.kv_events_config;
        if ev.queue_depth.is_some() {
            warn(
                "kvEventsConfig.queueDepth",
                "is no longer used and is ignored: the event queue is bounded by bytes \
                 (queueBytes, queueBytesPerPod); remove it",
            );
        }
        if ev.zmq_endpoint.is_empty() && !ev.replay_endpoint_template.is_empty() {
            warn(
                "kvEventsConfig.replayEndpointTemplate",
                "is used in bind mode only, and zmqEndpoint is empty: no gap fill comes from \
                 it (connect mode: endpoints[].replayEndpoint, discovery.services[].replayPort)",
            );
        }
        let discovery = &ev.discovery;
        let defaults = super::DiscoveryConfig::default();
        if discovery.services.is_empty() {
            if !discovery.nameservers.is_empty() {
                warn(
                    "kvEventsConfig.discovery.nameservers",
                    "is set but discovery.services is empty: nothing is resolved",
                );
            }
            if discovery.refresh_interval != defaults.refresh_interval {
                warn(
                    "kvEventsConfig.discovery.refreshInterval",
                    "is set but discovery.services is empty: nothing is resolved",
                );
            }
        }
    }

    /// The server's and scoring's inert settings (recorded routings' bounds with nothing
    /// recorded).
    fn scoring_warnings(&self, out: &mut Vec<ConfigWarning>) {
        let server = &self.server;
        if !server.enable_admin_rpcs && !server.admin_token.is_empty() {
            push(
                out,
                "server.adminToken",
                "is set (or KVINDEXER_ADMIN_TOKEN) but server.enableAdminRpcs is false: the \
                 admin RPCs stay off",
            );
        }
        let scoring = &self.scoring;
        let scoring_defaults = super::ScoringConfig::default();
        let recorded = server.enable_record_routing || self.endpoint_picker.enabled;
        if recorded || self.replication.enabled {
            return;
        }
        for (field, set) in [
            (
                "scoring.speculativeTtl",
                scoring.speculative_ttl != scoring_defaults.speculative_ttl,
            ),
            (
                "scoring.speculativePodBlocks",
                scoring.speculative_pod_blocks != scoring_defaults.speculative_pod_blocks,
            ),
            (
                "scoring.speculativeMaxBlocks",
                scoring.speculative_max_blocks != scoring_defaults.speculative_max_blocks,
            ),
            (
                "scoring.tierWeights.speculative",
                scoring.tier_weights.speculative != scoring_defaults.tier_weights.speculative,
            ),
        ] {
            if set {
                push(
                    out,
                    field,
                    "applies to recorded routings, and server.enableRecordRouting and \
                     endpointPicker.enabled are false (and no replica shares its log): none \
                     are recorded",
                );
            }
        }
    }

    /// The tokenizers' and the models' inert settings.
    fn tokenizer_and_model_warnings(&self, out: &mut Vec<ConfigWarning>) {
        let mut warn = |field: &str, message: &str| push(out, field, message);
        let pool = &self.indexer_config.tokenizers_pool_config;
        if pool.offline && !pool.hugging_face_token.is_empty() {
            warn(
                "indexerConfig.tokenizersPoolConfig.huggingFaceToken",
                "is set (or HF_TOKEN) but offline is true: the Hub is never asked",
            );
        }
        if pool.offline && !pool.hf_endpoint.is_empty() {
            warn(
                "indexerConfig.tokenizersPoolConfig.hfEndpoint",
                "is set (or HF_ENDPOINT) but offline is true: the Hub is never asked",
            );
        }
        if !self.indexer_config.kv_block_index_config.enable_metrics {
            warn(
                "indexerConfig.kvBlockIndexConfig.enableMetrics",
                "is false, which has no effect: the index's metrics are always exported \
                 (the field is accepted for llm-d compatibility)",
            );
        }
        for model in pool.local.model_tokenizer_map.keys() {
            if self
                .models
                .get(model)
                .is_some_and(|m| m.tokenizer.is_some())
            {
                warn(
                    &format!("indexerConfig.tokenizersPoolConfig.local.modelTokenizerMap.{model}"),
                    "is not used: models.<model>.tokenizer names this model's tokenizer too, \
                     and wins",
                );
            }
        }
        let allowed = &self.kv_events_config.allowed_models;
        if !allowed.is_empty() {
            for model in self.models.keys() {
                if !allowed.contains(model) {
                    warn(
                        &format!("models.{model}"),
                        "is not in kvEventsConfig.allowedModels: its events are refused, so \
                         its index stays empty",
                    );
                }
            }
        }
    }
}

/// Adds the warning that `field` does nothing, and why.
fn push(out: &mut Vec<ConfigWarning>, field: &str, message: &str) {
    out.push(ConfigWarning {
        field: field.to_owned(),
        message: message.to_owned(),
    });
}
