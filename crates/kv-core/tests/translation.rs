//! Keys from tokens: engines whose published hashes are not the index's keys (another
//! algorithm, seed or block size, or SGLang) are translated from their events' token ids and
//! score exactly. Ground truth: `fixtures/engines/engines.json`, made with vLLM 0.33.0's and
//! SGLang 0.5.23's own code (see its README), never with kv-indexer's.

mod support;

use kv_core::{
    decode_batch, BlockHash, BlockRemoved, BlockStored, EngineHash, EngineHashes, EventBatch,
    IndexConfig, Indexer, KeyMode, KvEvent, Medium, TokenProcessorConfig,
};

const MODEL: &str = "m";

/// Writer lanes of the indexers (the engine-hash maps live beside one lane or several).
const LANES: [usize; 2] = [1, 3];

fn indexer(engine_hashes: EngineHashes) -> Indexer {
    indexer_on(1, engine_hashes)
}

fn indexer_on(lanes: usize, engine_hashes: EngineHashes) -> Indexer {
    let index = IndexConfig {
        writer_lanes: lanes,
        ..Default::default()
    };
    support::fixture_indexer(index, engine_hashes)
}

/// Blocks of `tokens` the pod holds (scored as a prompt that continues past them).
fn matched(ix: &Indexer, tokens: &[u32], pod: &str) -> u32 {
    ix.score_tokens(MODEL, &support::past(tokens), &[pod], None, None)
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
    for (s, &lanes) in scenarios
        .iter()
        .flat_map(|s| LANES.iter().map(move |e| (s, e)))
    {
        let ix = indexer_on(lanes, EngineHashes::Auto);
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
                "{} on {lanes} lanes: after message {i}",
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
    let offload = |hashes: Vec<EngineHash>| EventBatch {
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
        .apply_batch(MODEL, "pod", &offload(vec![EngineHash::new(42)]))
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
            block_hashes: (1..=64).map(EngineHash::new).collect(),
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

    // A translated engine's partial page (a shorter block size) makes no key.
    let page = |hashes: Vec<EngineHash>, tokens: Vec<u32>, parent: Option<EngineHash>| EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_size: tokens.len() as u32,
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    };
    let ix = indexer(EngineHashes::Translated);
    ix.apply_batch(
        MODEL,
        "p",
        &page(vec![EngineHash::new(7)], (0..16).collect(), None),
    )
    .expect("applies");
    let r = ix
        .apply_batch(
            MODEL,
            "p",
            &page(
                vec![EngineHash::new(8)],
                (16..21).collect(),
                Some(EngineHash::new(7)),
            ),
        )
        .expect("applies");
    assert_eq!(r.blocks_stored, 0, "{r:?}");
    assert_eq!(matched(&ix, &(0..32).collect::<Vec<u32>>(), "p"), 1);
}

/// Differential: a translated engine (blocks of 32, opaque hashes) stores prompts that share
/// prefixes, stores second copies, evicts blocks in any order (holes included), and clears; after
/// every step each probe prompt scores what a reference model says (a key is held while some
/// copy of its engine block is), on both index engines. Keys come from kv-core's processor, which
/// the vLLM vectors check.
#[test]
fn translated_engines_agree_with_a_reference_under_random_churn() {
    use std::collections::HashMap;
    const K: usize = 2;
    for (seed, lanes) in [1u64, 2, 3, 4]
        .into_iter()
        .flat_map(|seed| LANES.map(|e| (seed, e)))
    {
        let mut rng = kv_core::SplitMix64::new(seed);
        let ix = indexer_on(lanes, EngineHashes::Auto);
        let processor = kv_core::TokenProcessor::new(&TokenProcessorConfig {
            hash_seed: Some("12345".into()),
            block_size: 16,
            ..Default::default()
        })
        .expect("valid");
        // Prompts: 3 trunks x 4 branches, 3-10 engine blocks each (shared prefixes).
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        for trunk in 0..3u32 {
            let stem: Vec<u32> = (0..64).map(|i| trunk * 1000 + i).collect();
            for branch in 0..4u32 {
                let extra = 32 * (1 + rng.below(8) as usize);
                let mut p = stem.clone();
                p.extend((0..extra as u32).map(|i| 50_000 + trunk * 5000 + branch * 500 + i));
                prompts.push(p);
            }
        }
        let keys: Vec<Vec<BlockHash>> = prompts
            .iter()
            .map(|p| processor.block_hashes(p, &Default::default()))
            .collect();
        // The engine's opaque hash of engine block j: a function of its content's key.
        let engine_hash = |keys: &[BlockHash], j: usize| {
            EngineHash::new(kv_core::mix64(keys[j * K + 1].get() ^ 0xE17))
        };
        let mut copies: HashMap<EngineHash, u32> = HashMap::new();
        let store = |p: usize,
                     from: usize,
                     copies: &mut HashMap<EngineHash, u32>,
                     rng: &mut kv_core::SplitMix64| {
            let blocks = prompts[p].len() / 32;
            let split = from + rng.below((blocks - from) as u64) as usize;
            let mut events = Vec::new();
            for (a, b) in [(from, split), (split, blocks)] {
                if a == b {
                    continue;
                }
                let hashes: Vec<EngineHash> = (a..b).map(|j| engine_hash(&keys[p], j)).collect();
                for h in &hashes {
                    *copies.entry(*h).or_insert(0) += 1;
                }
                events.push(KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: a.checked_sub(1).map(|j| engine_hash(&keys[p], j)),
                    token_ids: prompts[p][a * 32..b * 32].to_vec(),
                    block_size: 32,
                    medium: Some(Medium::Gpu),
                    ..Default::default()
                })));
            }
            EventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            }
        };
        for step in 0..300 {
            let roll = rng.below(100);
            let batch = if roll < 55 {
                let p = rng.below(prompts.len() as u64) as usize;
                let blocks = prompts[p].len() / 32;
                let cached = (0..blocks)
                    .take_while(|&j| {
                        copies
                            .get(&engine_hash(&keys[p], j))
                            .is_some_and(|&n| n > 0)
                    })
                    .count();
                // A fully cached prompt is sometimes computed again: a second copy of its tail.
                let from = if cached == blocks { blocks - 1 } else { cached };
                store(p, from, &mut copies, &mut rng)
            } else if roll < 97 {
                let held: Vec<EngineHash> = {
                    let mut v: Vec<_> = copies
                        .iter()
                        .filter(|(_, &n)| n > 0)
                        .map(|(h, _)| *h)
                        .collect();
                    v.sort_by_key(|h| h.get());
                    v
                };
                if held.is_empty() {
                    continue;
                }
                let h = held[rng.below(held.len() as u64) as usize];
                if let Some(n) = copies.get_mut(&h) {
                    *n -= 1;
                }
                EventBatch {
                    ts: 0.0,
                    events: vec![KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![h],
                        medium: Some(Medium::Gpu),
                        ..Default::default()
                    })],
                    data_parallel_rank: Some(0),
                }
            } else {
                copies.clear();
                EventBatch {
                    ts: 0.0,
                    events: vec![KvEvent::AllBlocksCleared],
                    data_parallel_rank: Some(0),
                }
            };
            ix.apply_batch(MODEL, "pod", &batch).expect("applies");
            for (p, prompt) in prompts.iter().enumerate() {
                let blocks = prompt.len() / 32;
                let want = (0..blocks)
                    .take_while(|&j| {
                        copies
                            .get(&engine_hash(&keys[p], j))
                            .is_some_and(|&n| n > 0)
                    })
                    .count()
                    * K;
                assert_eq!(
                    matched(&ix, prompt, "pod") as usize,
                    want,
                    "seed {seed} on {lanes} lanes, step {step}, prompt {p}"
                );
            }
        }
    }
}

/// `fixtures/engines/budget.json` (vLLM 0.33.0's own code): a translated engine stores four
/// prompts of 60 blocks, then evicts them all, oldest first. With no key budget each prompt
/// scores what the fixture says after every message, and kv-indexer's keys are vLLM's.
#[test]
fn the_budget_fixture_scores_as_made_without_a_key_budget() {
    let s = support::budget_scenario();
    assert_eq!(s.prompts.len(), 4);
    assert_eq!(s.messages.len(), s.kinds.len());
    assert_eq!(s.messages.len(), s.matched_after.len());
    for &lanes in &LANES {
        let ix = indexer_on(lanes, EngineHashes::Auto);
        let model = ix.model_or_create(MODEL).expect("model");
        for (p, (tokens, keys)) in s.prompts.iter().enumerate() {
            assert_eq!(tokens.len(), 960, "prompt {p}");
            assert_eq!(
                &model.processor().block_hashes(tokens, &Default::default()),
                keys,
                "prompt {p}"
            );
        }
        for (i, payload) in s.messages.iter().enumerate() {
            let batch = decode_batch(payload).expect("decodes");
            assert!(
                batch.events.iter().all(|e| match s.kinds[i].as_str() {
                    "stored" => matches!(e, KvEvent::BlockStored(_)),
                    "removed" => matches!(e, KvEvent::BlockRemoved(_)),
                    kind => panic!("message {i}: kind {kind}"),
                }),
                "message {i}"
            );
            ix.apply_batch(MODEL, "pod", &batch).expect("applies");
            let held: Vec<u32> = s
                .prompts
                .iter()
                .map(|(tokens, _)| matched(&ix, tokens, "pod"))
                .collect();
            assert_eq!(held, s.matched_after[i], "{lanes} lanes: after message {i}");
        }
        assert_eq!(mode(&ix, "pod"), Some(KeyMode::Translated));
    }
}
