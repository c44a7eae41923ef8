//! The snapshot format's round trips, its refusal of corrupt input, and what loading does.

use super::*;

fn sample() -> (Vec<u8>, u64) {
    let mut w = SnapshotWriter::new(StreamId { ms: 17, seq: 3 }, 3);
    let blocks: Vec<(BlockHash, Tier)> = vec![
        (BlockHash::from(1), Tier::Gpu),
        (BlockHash::from(2), Tier::Cpu),
        (BlockHash::from(u64::MAX - 1), Tier::Gpu),
    ];
    w.blocks("m", &EngineKey::new("10.0.0.1:8000", 2), &blocks);
    let state = PublisherState {
        last_seq: Some(41),
        last_ts: 1.5e9,
        received_by: "replica-a".into(),
        messages: 42,
        gaps: 1,
        restarts: 0,
        messages_lost: 3,
        ..PublisherState::default()
    };
    let key = PublisherKey::new("10.0.0.1:8000".into(), "m".into(), 2);
    w.publisher(&key, &state);
    let keys = EngineKeyState {
        mode: KeyMode::Translated,
        translated: vec![TranslatedBlock {
            engine_hash: EngineHash::from(77),
            group: 1,
            tip: [7; 32],
            earlier: vec![BlockHash::from(5)],
            copies: [1, 0, 2, 0],
        }],
        copies: vec![(BlockHash::from(9), Tier::Cpu, 2)],
        groups: vec![
            (
                0,
                GroupSpec {
                    kind: GroupKind::Full,
                    block_units: 36,
                },
            ),
            (
                1,
                GroupSpec {
                    kind: GroupKind::SlidingWindow { window: 128 },
                    block_units: 1,
                },
            ),
            (
                3,
                GroupSpec {
                    kind: GroupKind::Mamba,
                    block_units: 36,
                },
            ),
        ],
    };
    w.engine_keys("m", &EngineKey::new("10.0.0.1:8000", 2), &keys);
    w.finish()
}

/// The blocks pod `p` of model `m` is credited for `prompt` (by its tokens).
fn matched_by_p(ix: &kv_core::Indexer, prompt: &[u32]) -> u32 {
    ix.score_tokens("m", prompt, &["p"], None, None)
        .expect("model")
        .scores[0]
        .matched_blocks
}

/// Restores a snapshot of `source`'s blocks and engine keys into `into`.
fn restore(source: &kv_core::Indexer, into: &kv_core::Indexer) {
    let mut w = SnapshotWriter::new(StreamId::ZERO, 8);
    source.export_each(|model, key, blocks| w.blocks(model, key, blocks));
    source.export_keys_each(|model, key, state| w.engine_keys(model, key, state));
    let (bytes, _) = w.finish();
    super::super::store::apply_snapshot(&bytes, into).expect("loads");
}

/// A translated engine restored from a snapshot resolves its hashes as before: a removal
/// by engine hash removes the keys, a run continuing a restored block scores.
#[test]
fn a_translated_engines_map_survives_a_snapshot() {
    use kv_core::{
        BlockRemoved, BlockStored, EventBatch, Indexer, IndexerSettings, KvEvent, Medium,
    };
    let indexer = || Indexer::new(IndexerSettings::default()).expect("valid");
    let tokens: Vec<u32> = (0..96).map(|i| i * 31 + 7).collect();
    let run = |hashes: &[u64], parent: Option<u64>, toks: &[u32]| EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::from(h)).collect(),
            parent_block_hash: parent.map(EngineHash::from),
            token_ids: toks.to_vec(),
            block_size: 32,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    };
    let source = indexer();
    source
        .apply_batch("m", "p", &run(&[11, 12], None, &tokens[..64]))
        .expect("applies");
    let restored = indexer();
    restore(&source, &restored);
    let engines = restored.model("m").expect("model").key_modes();
    assert_eq!(engines.values().map(|(_, n)| *n).sum::<usize>(), 2);
    // One token past the three engine blocks: vLLM recomputes at least the last token, so a
    // prompt of exactly 96 tokens would reuse two blocks at most.
    let prompt: Vec<u32> = tokens.iter().copied().chain([5]).collect();
    let matched = |ix: &Indexer| matched_by_p(ix, &prompt);
    assert_eq!(matched(&restored), 4, "two engine blocks of 32: four units");
    restored
        .apply_batch("m", "p", &run(&[13], Some(12), &tokens[64..]))
        .expect("applies");
    assert_eq!(
        matched(&restored),
        6,
        "a continuation of a restored block scores"
    );
    let removed = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash::from(12)],
            medium: Some(Medium::Gpu),
            ..Default::default()
        })],
        data_parallel_rank: Some(0),
    };
    let r = restored.apply_batch("m", "p", &removed).expect("applies");
    assert_eq!(r.blocks_removed, 1, "engine block 12's key");
    assert_eq!(matched(&restored), 2);
}

#[test]
fn items_read_back_as_written() {
    let (bytes, memberships) = sample();
    assert_eq!(memberships, 3);
    let mut r = SnapshotReader::new(&bytes).expect("header");
    assert_eq!(r.position, StreamId { ms: 17, seq: 3 });
    let mut got = Vec::new();
    while let Some(rec) = r.next_item().expect("item") {
        got.push(format!("{rec:?}"));
    }
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(
        got[3].contains("Translated") && got[3].contains("copies: [1, 0, 2, 0]"),
        "{got:?}"
    );
    assert!(
        got[0].contains("Gpu") && got[0].contains("0xfffffffffffffffe"),
        "{got:?}"
    );
    assert!(got[1].contains("Cpu"), "{got:?}");
    assert!(
        got[2].contains("Some(41)") && got[2].contains("replica-a"),
        "{got:?}"
    );
}

#[test]
fn every_truncation_and_a_bad_header_are_errors_not_panics() {
    let (bytes, _) = sample();
    for cut in 0..bytes.len() {
        let result = SnapshotReader::new(&bytes[..cut]).and_then(|mut r| {
            while r.next_item()?.is_some() {}
            Ok(())
        });
        assert!(result.is_err(), "a snapshot cut at {cut} read as complete");
    }
    let mut bad = bytes.clone();
    bad[8] = 9;
    assert!(matches!(
        SnapshotReader::new(&bad).err(),
        Some(SnapshotError::Format(Some(_)))
    ));
}

#[test]
fn the_checksum_sees_one_flipped_bit() {
    let (bytes, _) = sample();
    let mut flipped = bytes.clone();
    flipped[30] ^= 1;
    assert_ne!(checksum(&[&bytes]), checksum(&[&flipped]));
    let (a, b) = bytes.split_at(10);
    assert_eq!(checksum(&[&bytes]), checksum(&[a, b]));
}

/// A snapshot written under one hash seed, loaded by a replica of the same settings and by one
/// whose model hashes with another seed (a changed `hashSeed` or `PYTHONHASHSEED`): the second
/// loads none of the model's keys (no prompt hashes to them there) and counts them.
#[test]
fn a_snapshot_of_another_key_space_is_not_loaded_as_keys() {
    use kv_core::{
        BlockStored, EventBatch, Indexer, IndexerSettings, KvEvent, ModelSettings,
        TokenProcessorConfig,
    };
    let indexer = |seed: &str| {
        Indexer::new(IndexerSettings {
            default_model: ModelSettings {
                token_processor: TokenProcessorConfig {
                    hash_seed: Some(seed.into()),
                    block_size: 16,
                    ..Default::default()
                },
                ..Default::default()
            },
            ..Default::default()
        })
        .expect("valid")
    };
    let tokens: Vec<u32> = (0..64).map(|i| i * 7 + 1).collect();
    let source = indexer("1");
    let hashes = source
        .model_or_create("m")
        .expect("model")
        .processor()
        .block_hashes(&tokens, &Default::default());
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.into_iter().map(EngineHash::aligned).collect(),
            token_ids: tokens.clone(),
            block_size: 16,
            ..Default::default()
        }))],
        data_parallel_rank: Some(0),
    };
    source.apply_batch("m", "p", &batch).expect("applies");
    let mut w = SnapshotWriter::new(StreamId::ZERO, 4);
    for model in source.models() {
        w.key_space(model.name(), &model.key_space());
    }
    source.export_each(|model, key, blocks| w.blocks(model, key, blocks));
    source.export_keys_each(|model, key, state| w.engine_keys(model, key, state));
    let (bytes, _) = w.finish();
    // One token past the four blocks (vLLM recomputes at least the last token).
    let prompt: Vec<u32> = tokens.iter().copied().chain([3]).collect();
    let matched = |ix: &Indexer| matched_by_p(ix, &prompt);

    let same = indexer("1");
    let load = super::super::store::apply_snapshot(&bytes, &same).expect("loads");
    assert_eq!((load.memberships, load.dropped_key_space), (4, 0));
    assert_eq!(matched(&same), 4);

    let other = indexer("2");
    let load = super::super::store::apply_snapshot(&bytes, &other).expect("loads");
    assert_eq!(
        (load.memberships, load.dropped_key_space),
        (0, 4),
        "keys of another key space are counted, not loaded"
    );
    assert_eq!(other.stats()[0].1.keys, 0);
}

/// A snapshot of a model whose engines hash with lookahead (vLLM's `num_hash_lookahead_tokens`):
/// a fresh replica takes the lookahead with the keys and scores as the writer did; one whose
/// model learned another loads none of them, and counts them.
#[test]
fn a_snapshot_carries_the_lookahead_its_keys_were_made_with() {
    use kv_core::{
        BlockStored, EventBatch, HashScratch, Indexer, IndexerSettings, KvEvent, ModelSettings,
        RequestExtras, TokenProcessorConfig,
    };
    let indexer = || {
        Indexer::new(IndexerSettings {
            default_model: ModelSettings {
                token_processor: TokenProcessorConfig {
                    hash_seed: Some("1".into()),
                    block_size: 16,
                    ..Default::default()
                },
                ..Default::default()
            },
            ..Default::default()
        })
        .expect("valid")
    };
    // An engine with lookahead `l`: four blocks, keyed with the token after each.
    let run = |ix: &Indexer, l: usize| {
        let tokens: Vec<u32> = (0..64 + l as u32).map(|i| i * 7 + 1).collect();
        let model = ix.model_or_create("m").expect("model");
        let mut keys = Vec::new();
        let (plain, scratch) = (RequestExtras::default(), &mut HashScratch::default());
        let processor = model.processor();
        processor.block_hashes_lookahead_into(&tokens, l, &plain, scratch, &mut keys);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: keys.into_iter().map(EngineHash::aligned).collect(),
                token_ids: tokens[..64].to_vec(),
                block_size: 16,
                lookahead_token_ids: Some(
                    (1..=4)
                        .map(|b| tokens[b * 16..b * 16 + l].to_vec())
                        .collect(),
                ),
                ..Default::default()
            }))],
            data_parallel_rank: Some(0),
        };
        let report = ix.apply_batch("m", "p", &batch).expect("applies");
        assert_eq!(report.lookahead_learned, Some(l as u32));
        tokens
    };
    let source = indexer();
    let tokens = run(&source, 1);
    let mut w = SnapshotWriter::new(StreamId::ZERO, 4);
    for model in source.models() {
        w.key_space(model.name(), &model.key_space());
    }
    source.export_each(|model, key, blocks| w.blocks(model, key, blocks));
    let (bytes, _) = w.finish();
    let matched = |ix: &Indexer| matched_by_p(ix, &tokens);
    assert_eq!(matched(&source), 4);

    let fresh = indexer();
    let load = super::super::store::apply_snapshot(&bytes, &fresh).expect("loads");
    assert_eq!((load.memberships, load.dropped_key_space), (4, 0));
    assert_eq!(fresh.model("m").expect("model").lookahead(), 1);
    assert_eq!(matched(&fresh), 4, "prompts are hashed with the lookahead");

    let other = indexer();
    run(&other, 2);
    let load = super::super::store::apply_snapshot(&bytes, &other).expect("loads");
    assert_eq!((load.memberships, load.dropped_key_space), (0, 4));
    assert_eq!(other.model("m").expect("model").lookahead(), 2);
}

/// A translated hybrid engine's map keeps each group's blocks apart through a snapshot: a
/// removal from one group removes that group's key, and the other group's stays.
#[test]
fn a_translated_hybrid_engines_groups_survive_a_snapshot() {
    use kv_core::{
        BlockRemoved, BlockStored, EventBatch, Indexer, IndexerSettings, KvEvent, Medium,
    };
    let indexer = || Indexer::new(IndexerSettings::default()).expect("valid");
    let tokens: Vec<u32> = (0..48).map(|i| i * 17 + 3).collect();
    let stored = |group: i64, kind: &str, window: Option<i64>| {
        KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: [21, 22, 23].map(EngineHash::from).to_vec(),
            token_ids: tokens.clone(),
            block_size: 16,
            medium: Some(Medium::Gpu),
            group_idx: Some(group),
            kv_cache_spec_kind: Some(kind.into()),
            kv_cache_spec_sliding_window: window,
            ..Default::default()
        }))
    };
    let batch = |events| EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    };
    let source = indexer();
    let both = vec![
        stored(0, "full_attention", None),
        stored(1, "sliding_window", Some(32)),
    ];
    source.apply_batch("m", "p", &batch(both)).expect("applies");
    let restored = indexer();
    restore(&source, &restored);
    let entries: usize = restored
        .model("m")
        .expect("model")
        .key_modes()
        .values()
        .map(|(_, n)| *n)
        .sum();
    assert_eq!(entries, 6, "three blocks in each of two groups");
    let prompt: Vec<u32> = tokens.iter().copied().chain([5]).collect();
    let matched = |ix: &Indexer| matched_by_p(ix, &prompt);
    assert_eq!(matched(&restored), 3);
    // The window's last block leaves group 1 only: the window (two blocks) no longer ends
    // at block 3, so the hit is the first two blocks, whose window is held.
    let removed = batch(vec![KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineHash::from(23)],
        medium: Some(Medium::Gpu),
        group_idx: Some(1),
        ..Default::default()
    })]);
    let r = restored.apply_batch("m", "p", &removed).expect("applies");
    assert_eq!(r.blocks_removed, 1, "group 1's key of block 23");
    assert_eq!(matched(&restored), 2);
}
