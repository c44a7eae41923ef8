//! Validation: every value checked against what the daemon supports, each error naming the
//! field's path.

use std::net::SocketAddr;
use std::time::Duration;

use super::{invalid, Config, ConfigError};

/// The largest digest memo a configuration may ask for (one per hash unit size in use).
const MAX_DIGEST_MEMO_BYTES: usize = 4 << 30;

impl Config {
    /// Checks every range, section by section; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_indexer()?;
        self.validate_events()?;
        self.validate_server()?;
        self.validate_scoring()?;
        self.validate_models()?;
        self.endpoint_picker.validate()?;
        self.validate_replication()
    }

    /// `indexerConfig`: block sizes, the index's size and lanes, the tokenizers, `maxModels`.
    fn validate_indexer(&self) -> Result<(), ConfigError> {
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
        if mem.engine == Some(super::RetiredEngine::Nodes) {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.engine",
                "nodes: the node index was retired; the index has one structure (runs of a \
                 chain with holder bitmaps, what `engine: runs` chose), which keeps every \
                 guarantee the node index kept; remove `engine`",
            ));
        }
        if mem.pod_cache_size == Some(0) {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.podCacheSize",
                "must be at least 1 when set (leave it out for exact membership)",
            ));
        }
        if mem.writer_lanes == 0 || mem.writer_lanes > kv_core::MAX_WRITER_LANES {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.writerLanes",
                format!("must be between 1 and {}", kv_core::MAX_WRITER_LANES),
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
        if mem.max_models == 0 || mem.max_models > 4096 {
            return Err(invalid(
                "indexerConfig.kvBlockIndexConfig.inMemoryConfig.maxModels",
                "must be between 1 and 4096",
            ));
        }
        if self.models.len() > mem.max_models {
            return Err(invalid(
                "models",
                format!(
                    "{} models are configured but maxModels is {}",
                    self.models.len(),
                    mem.max_models
                ),
            ));
        }
        Ok(())
    }

    /// `kvEventsConfig`: the workers, the queues, the endpoints, discovery, the pod filter.
    fn validate_events(&self) -> Result<(), ConfigError> {
        let ev = &self.kv_events_config;
        if ev.concurrency == 0 || ev.concurrency > 1024 {
            return Err(invalid(
                "kvEventsConfig.concurrency",
                "must be between 1 and 1024",
            ));
        }
        if !(0..=19).contains(&ev.ingest_nice) {
            return Err(invalid(
                "kvEventsConfig.ingestNice",
                "must be between 0 and 19 (a nice increment below the serving threads)",
            ));
        }
        if ev.max_gap_fills_in_flight == 0 || ev.max_gap_fills_in_flight > 4096 {
            return Err(invalid(
                "kvEventsConfig.maxGapFillsInFlight",
                "must be between 1 and 4096",
            ));
        }
        if ev.queue_bytes_per_pod < 64 << 10 {
            return Err(invalid(
                "kvEventsConfig.queueBytesPerPod",
                "must be at least 65536 (64 KiB)",
            ));
        }
        if ev.queue_bytes < ev.queue_bytes_per_pod {
            return Err(invalid(
                "kvEventsConfig.queueBytes",
                format!(
                    "must be at least queueBytesPerPod ({})",
                    ev.queue_bytes_per_pod
                ),
            ));
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
        self.validate_discovery()?;
        if ev.zmq_endpoint.is_empty() && ev.endpoints.is_empty() && ev.discovery.services.is_empty()
        {
            tracing::warn!(
                "no event source: kvEventsConfig.zmqEndpoint is empty, and no endpoints or discovery services are listed"
            );
        }
        for (i, pattern) in ev.allowed_pods.iter().enumerate() {
            if pattern.is_empty() || pattern.len() > super::MAX_POD_LEN {
                return Err(invalid(
                    format!("kvEventsConfig.allowedPods[{i}]"),
                    "must be a non-empty pod pattern",
                ));
            }
        }
        Ok(())
    }

    /// `server`: the listen addresses, the request limits, TLS and the admin token.
    fn validate_server(&self) -> Result<(), ConfigError> {
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
            ("server.maxChatMessages", self.server.max_chat_messages),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        let tls = &self.server.tls;
        if tls.enabled() && (tls.cert_file.is_empty() || tls.key_file.is_empty()) {
            return Err(invalid(
                "server.tls",
                "certFile and keyFile go together (both PEM files)",
            ));
        }
        if !tls.client_ca_file.is_empty() && !tls.enabled() {
            return Err(invalid(
                "server.tls.clientCaFile",
                "needs certFile and keyFile (mutual TLS is on top of TLS)",
            ));
        }
        if self.server.enable_admin_rpcs && self.server.admin_token.len() < 16 {
            return Err(invalid(
                "server.adminToken",
                "enableAdminRpcs needs an admin token of at least 16 characters \
                 (set server.adminToken or KVINDEXER_ADMIN_TOKEN, from a Secret)",
            ));
        }
        Ok(())
    }

    /// `scoring`: tier weights, speculative entries, the digest memo.
    fn validate_scoring(&self) -> Result<(), ConfigError> {
        let w = &self.scoring.tier_weights;
        for (name, v) in [
            ("gpu", w.gpu),
            ("cpu", w.cpu),
            ("storage", w.storage),
            ("other", w.other),
            ("speculative", w.speculative),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(
                    format!("scoring.tierWeights.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        let sc = &self.scoring;
        if sc.speculative_ttl.0.is_zero() {
            return Err(invalid(
                "scoring.speculativeTtl",
                "must be longer than 0 (a recorded routing would never count)",
            ));
        }
        for (name, v) in [
            ("speculativePodBlocks", sc.speculative_pod_blocks),
            ("speculativeMaxBlocks", sc.speculative_max_blocks),
        ] {
            if v == 0 || v > u32::MAX as usize - 2 {
                return Err(invalid(
                    format!("scoring.{name}"),
                    format!("must be between 1 and {}", u32::MAX - 2),
                ));
            }
        }
        if sc.digest_memo_bytes > MAX_DIGEST_MEMO_BYTES {
            return Err(invalid(
                "scoring.digestMemoBytes",
                format!("must be at most {MAX_DIGEST_MEMO_BYTES} (4 GiB; 0 disables the memo)"),
            ));
        }
        Ok(())
    }

    /// `models`: each model's block sizes and attention chunk.
    fn validate_models(&self) -> Result<(), ConfigError> {
        let tp = &self.indexer_config.token_processor_config;
        for (model, m) in &self.models {
            if model.is_empty() {
                return Err(invalid("models", "a model name is empty"));
            }
            let block = m.block_size.unwrap_or(tp.block_size);
            let unit = m.hash_block_size.or(tp.hash_block_size);
            check_block_sizes(&format!("models.{model}"), block, unit)?;
            if let Some(chunk) = m.attention_chunk_size {
                // vLLM's chunked local attention: a chunk of whole blocks (Llama 4: 8,192).
                if chunk == 0 || !(chunk as usize).is_multiple_of(block) {
                    return Err(invalid(
                        format!("models.{model}.attentionChunkSize"),
                        format!("{chunk} is not a positive multiple of the block size {block}"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_discovery(&self) -> Result<(), ConfigError> {
        let discovery = &self.kv_events_config.discovery;
        let interval = discovery.refresh_interval.0;
        if interval < Duration::from_millis(100) || interval > Duration::from_secs(3_600) {
            return Err(invalid(
                "kvEventsConfig.discovery.refreshInterval",
                "must be between 100ms and 1h",
            ));
        }
        for (i, server) in discovery.nameservers.iter().enumerate() {
            if super::nameserver_address(server).is_none() {
                return Err(invalid(
                    format!("kvEventsConfig.discovery.nameservers[{i}]"),
                    format!("{server:?} is not an IP address or ip:port"),
                ));
            }
        }
        for (i, service) in discovery.services.iter().enumerate() {
            let field = |name: &str| format!("kvEventsConfig.discovery.services[{i}].{name}");
            if service.name.trim().is_empty() {
                return Err(invalid(field("name"), "must name a DNS name"));
            }
            if service.data_parallel_size == 0 || service.data_parallel_size > 1024 {
                return Err(invalid(
                    field("dataParallelSize"),
                    "must be between 1 and 1024",
                ));
            }
            let last_rank = service.data_parallel_size - 1;
            if service.publisher_port == 0
                || service.publisher_port.checked_add(last_rank).is_none()
            {
                return Err(invalid(
                    field("publisherPort"),
                    "must be a port, with room for every data-parallel rank (port + rank <= 65535)",
                ));
            }
            if service.replay_port != 0 && service.replay_port.checked_add(last_rank).is_none() {
                return Err(invalid(
                    field("replayPort"),
                    "must leave room for every data-parallel rank (port + rank <= 65535); 0 for no gap fill",
                ));
            }
            let placeholders = service.pod.replace("{ip}", "");
            if placeholders.contains('{') || placeholders.contains('}') {
                return Err(invalid(
                    field("pod"),
                    "the only placeholder is {ip} (e.g. {ip}:8000)",
                ));
            }
            if service.max_addresses == 0 || service.max_addresses > 65_536 {
                return Err(invalid(
                    field("maxAddresses"),
                    "must be between 1 and 65536",
                ));
            }
        }
        Ok(())
    }

    fn validate_replication(&self) -> Result<(), ConfigError> {
        let r = &self.replication;
        if !r.enabled {
            return self.check_disabled_replication();
        }
        if !(r.redis_url.starts_with("redis://") || r.redis_url.starts_with("rediss://")) {
            return Err(invalid(
                "replication.redisUrl",
                format!(
                    "{:?}: replication needs a redis:// or rediss:// URL (or KVINDEXER_REDIS_URL)",
                    super::redact_url(&r.redis_url)
                ),
            ));
        }
        if r.key_prefix.is_empty()
            || r.key_prefix.len() > 128
            || r.key_prefix
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                "replication.keyPrefix",
                "must be 1-128 characters without spaces",
            ));
        }
        if r.replica_id.len() > 253 || r.replica_id.chars().any(|c| c.is_control()) {
            return Err(invalid(
                "replication.replicaId",
                "must be at most 253 printable characters",
            ));
        }
        if r.snapshot_interval.0 < std::time::Duration::from_millis(100) {
            return Err(invalid(
                "replication.snapshotInterval",
                "must be at least 100ms",
            ));
        }
        if r.append_queue == 0 {
            return Err(invalid("replication.appendQueue", "must be at least 1"));
        }
        if r.append_queue_bytes < 1 << 20 {
            return Err(invalid(
                "replication.appendQueueBytes",
                "must be at least 1048576 (1 MiB)",
            ));
        }
        if r.max_log_length < 1_000 {
            return Err(invalid("replication.maxLogLength", "must be at least 1000"));
        }
        Ok(())
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
