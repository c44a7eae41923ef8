//! The configuration translated into the libraries' settings (kv-core's indexer, kv-tokenize's
//! service).

use kv_core::TokenProcessorConfig;
use kv_core::{IndexConfig, TierWeights};
use kv_core::{IndexerSettings, ModelSettings, SpeculationSettings};

use super::Config;

impl Config {
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
                    engine_hashes: m.engine_hashes.unwrap_or(tp.engine_hashes),
                    attention_chunk_size: m.attention_chunk_size,
                    hybrid: m.hybrid,
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
                writer_lanes: mem.writer_lanes,
            },
            max_models: mem.max_models,
            default_model: ModelSettings {
                token_processor: default_processor,
                lora_paths: Default::default(),
                engine_hashes: tp.engine_hashes,
                attention_chunk_size: None,
                hybrid: false,
            },
            models,
            weights: TierWeights([w.gpu, w.cpu, w.storage, w.other]),
            speculation: SpeculationSettings {
                ttl: self.scoring.speculative_ttl.0,
                weight: w.speculative,
                pod_blocks: self.scoring.speculative_pod_blocks,
                max_blocks: self.scoring.speculative_max_blocks,
            },
            digest_memo_bytes: self.scoring.digest_memo_bytes,
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
            sources: kv_tokenize::SourceSettings {
                explicit,
                cache_dir: pool.tokenizers_cache_dir.clone().into(),
                hf_token: Some(pool.hugging_face_token.clone()).filter(|t| !t.is_empty()),
                hf_endpoint: Some(pool.hf_endpoint.clone()).filter(|e| !e.is_empty()),
                offline: pool.offline,
            },
            workers: pool.workers_count,
            queue_size: pool.queue_size,
            large_prompt_bytes: pool.large_prompt_bytes,
            prefix_cache_size: store.cache_size as u64,
            prefix_store_bytes: store.max_bytes,
            prefix_block_chars: store.block_size,
            min_prefix_overlap_ratio: pool.min_prefix_overlap_ratio,
        }
    }
}
