//! Keys from tokens: engines whose published hashes are not the index's keys (another
//! algorithm, seed or block size, or SGLang) are translated from their events' token ids and
//! score exactly. Ground truth: `fixtures/engines/engines.json`, made with vLLM 0.33.0's and
//! SGLang 0.5.23's own code (see its README), never with kv-indexer's.

mod support;

use kv_core::{
    decode_batch, BlockHash, BlockRemoved, BlockStored, EngineHashes, EventBatch, Indexer,
    IndexerSettings, KeyMode, KvEvent, Medium, ModelSettings, TokenProcessorConfig,
};

const MODEL: &str = "m";

fn indexer(engine_hashes: EngineHashes) -> Indexer {
    Indexer::new(IndexerSettings {
        default_model: ModelSettings {
            token_processor: TokenProcessorConfig {
                hash_seed: Some("12345".into()),
                block_size: 16,
                ..Default::default()
            },
            engine_hashes,
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid")
}

fn matched(ix: &Indexer, tokens: &[u32], pod: &str) -> u32 {
    ix.score_tokens(MODEL, tokens, &[pod], None, None)
        .expect("known model")
        .scores[0]
        .matched_blocks
}

fn mode(ix: &Indexer, pod: &str) -> Option<KeyMode> {
    ix.model(MODEL)?
        .key_modes()
        .iter()
        .find(|(k, _)| &*k.pod == pod)
        .map(|(_, (m, _))| *m)
}

#[test]
fn every_engine_scores_exactly_with_the_default_settings() {
    let scenarios = support::engine_scenarios();
    assert!(scenarios.len() >= 8, "{}", scenarios.len());
    for s in &scenarios {
        let ix = indexer(EngineHashes::Auto);
        // The keys kv-indexer computes for the prompt are vLLM's own.
        assert_eq!(
            ix.block_hashes(MODEL, &s.tokens, None, None)
                .unwrap_or_else(|_| ix
                    .model_or_create(MODEL)
                    .map(|m| m.processor().block_hashes(&s.tokens, &Default::default()))
                    .expect("model")),
            s.expected_keys,
            "{}",
            s.name
        );
        for (i, payload) in s.messages.iter().enumerate() {
            let batch = decode_batch(payload).expect("decodes");
            ix.apply_batch(MODEL, "pod", &batch).expect("applies");
            assert_eq!(
                matched(&ix, &s.tokens, "pod"),
                s.matched_after[i],
                "{}: after message {i}",
                s.name
            );
        }
        let aligned = s.name.contains("aligned") || s.name.contains("duplicate");
        assert_eq!(
            mode(&ix, "pod"),
            Some(if aligned {
                KeyMode::Aligned
            } else {
                KeyMode::Translated
            }),
            "{}",
            s.name
        );
    }
}

#[test]
fn forced_modes_override_what_the_events_show() {
    let s = support::engine_scenarios()
        .into_iter()
        .find(|s| s.name == "vllm-xxhash-seed999-bs16")
        .expect("scenario");
    // Taken as published: an xxhash engine scores nothing (the old behaviour, on request).
    let ix = indexer(EngineHashes::Aligned);
    for payload in &s.messages[..2] {
        ix.apply_batch(MODEL, "pod", &decode_batch(payload).expect("decodes"))
            .expect("applies");
    }
    assert_eq!(matched(&ix, &s.tokens, "pod"), 0);
    assert_eq!(mode(&ix, "pod"), Some(KeyMode::Aligned));
    // Always translated: an aligned engine is translated too, and scores the same.
    let aligned = support::engine_scenarios()
        .into_iter()
        .find(|s| s.name.ends_with("-aligned"))
        .expect("scenario");
    let ix = indexer(EngineHashes::Translated);
    for payload in &aligned.messages[..2] {
        ix.apply_batch(MODEL, "pod", &decode_batch(payload).expect("decodes"))
            .expect("applies");
    }
    assert_eq!(matched(&ix, &aligned.tokens, "pod"), 30);
    assert_eq!(mode(&ix, "pod"), Some(KeyMode::Translated));
}

/// A run whose parent the map does not know is skipped and counted, never guessed; a
/// restart, `AllBlocksCleared` and forgetting the pod drop the map with the blocks.
#[test]
fn unknown_parents_are_counted_and_the_map_goes_with_the_engine() {
    let s = support::engine_scenarios()
        .into_iter()
        .find(|s| s.name == "vllm-sha256cbor-seed777-bs32")
        .expect("scenario");
    let batches: Vec<EventBatch> = s
        .messages
        .iter()
        .map(|p| decode_batch(p).expect("decodes"))
        .collect();
    let ix = indexer(EngineHashes::Auto);
    // The continuation first: its parent is unknown (the engine is translated: block size 32).
    let r = ix.apply_batch(MODEL, "pod", &batches[1]).expect("applies");
    assert_eq!(r.translation.untranslatable[0], 1, "{r:?}");
    assert_eq!(r.blocks_stored, 0);
    assert_eq!(matched(&ix, &s.tokens, "pod"), 0);
    ix.apply_batch(MODEL, "pod", &batches[0]).expect("applies");
    ix.apply_batch(MODEL, "pod", &batches[1]).expect("applies");
    assert_eq!(matched(&ix, &s.tokens, "pod"), 20);
    let blocks = |ix: &Indexer| {
        ix.model(MODEL)
            .expect("model")
            .key_modes()
            .values()
            .map(|(_, n)| *n)
            .sum::<usize>()
    };
    assert_eq!(blocks(&ix), 10, "one map entry per engine block");

    // AllBlocksCleared: blocks and map gone, the mode kept.
    let cleared = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    };
    ix.apply_batch(MODEL, "pod", &cleared).expect("applies");
    assert_eq!((matched(&ix, &s.tokens, "pod"), blocks(&ix)), (0, 0));

    // A restart: the mode is decided again from the next events.
    ix.apply_batch(MODEL, "pod", &batches[0]).expect("applies");
    assert_eq!(blocks(&ix), 5);
    ix.clear_engine(MODEL, "pod", 0);
    assert_eq!(mode(&ix, "pod"), None);
    assert_eq!(matched(&ix, &s.tokens, "pod"), 0);

    // Forgetting the pod drops everything of it.
    ix.apply_batch(MODEL, "pod", &batches[0]).expect("applies");
    assert!(ix.remove_pod(MODEL, "pod") > 0);
    assert!(ix.model(MODEL).expect("model").key_modes().is_empty());
    let stats = &ix.stats()[0].1;
    assert_eq!(stats.keys, 0, "{stats:?}");
}

/// An offload tier's `BlockStored` without tokens is resolved through the map; one whose
/// hashes the map does not know is counted.
#[test]
fn a_store_without_tokens_is_resolved_through_the_map() {
    let s = support::engine_scenarios()
        .into_iter()
        .find(|s| s.name == "vllm-xxhash-seed999-bs16")
        .expect("scenario");
    let ix = indexer(EngineHashes::Auto);
    let first = decode_batch(&s.messages[0]).expect("decodes");
    ix.apply_batch(MODEL, "pod", &first).expect("applies");
    let KvEvent::BlockStored(stored) = &first.events[0] else {
        panic!("a store");
    };
    let offload = |hashes: Vec<BlockHash>| EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes,
            block_size: 16,
            medium: Some(Medium::Cpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    };
    let r = ix
        .apply_batch(MODEL, "pod", &offload(stored.block_hashes.clone()))
        .expect("applies");
    assert_eq!(r.blocks_stored, 12, "{r:?}");
    // Evicted from the GPU, still in the CPU tier: still held.
    let gpu_evicted = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: stored.block_hashes.clone(),
            medium: Some(Medium::Gpu),
            ..Default::default()
        })],
        data_parallel_rank: Some(0),
    };
    ix.apply_batch(MODEL, "pod", &gpu_evicted).expect("applies");
    assert_eq!(matched(&ix, &s.tokens, "pod"), 12);
    let r = ix
        .apply_batch(MODEL, "pod", &offload(vec![BlockHash::new(42)]))
        .expect("applies");
    assert_eq!(r.translation.untranslatable[3], 1, "{r:?}");
}

/// An engine block size that is not a multiple of `blockSize` (SGLang's default page size 1)
/// is refused for that engine, counted; other engines are unaffected.
#[test]
fn a_block_size_that_is_not_a_multiple_is_refused() {
    let tokens: Vec<u32> = (0..64).collect();
    let pages = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: (1..=64).map(BlockHash::new).collect(),
            token_ids: tokens.clone(),
            block_size: 1,
            medium: Some(Medium::Other("GPU".into())),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    };
    let ix = indexer(EngineHashes::Auto);
    let r = ix.apply_batch(MODEL, "sglang", &pages).expect("applies");
    assert_eq!(r.refused_events, 1);
    assert_eq!(r.blocks_stored, 0);
    assert_eq!(
        mode(&ix, "sglang"),
        Some(KeyMode::Refused {
            engine: 1,
            ours: 16
        })
    );
}
