//! The indexer fed with payloads captured from vLLM's publisher: scores for the request that
//! produced them (on both index structures), removals, clears, and hash-mismatch detection with
//! its diagnosis.

mod support;

use kv_core::{decode_batch, EngineHash, EventBatch, KvEvent};
use kv_core::{ExtraKeysFormat, RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_core::{IndexConfig, Indexer, IndexerSettings, ModelSettings, ScoreError};

const MODEL: &str = "Qwen/Qwen3-8B";

/// Settings that take every engine's hashes as published (no translation): what a mismatch
/// check is about.
fn aligned(seed: Option<&str>, block_size: usize) -> IndexerSettings {
    let mut s = settings(seed, block_size);
    s.default_model.engine_hashes = kv_core::EngineHashes::Aligned;
    s
}

fn settings(seed: Option<&str>, block_size: usize) -> IndexerSettings {
    IndexerSettings {
        default_model: ModelSettings {
            token_processor: TokenProcessorConfig {
                hash_seed: seed.map(str::to_owned),
                block_size,
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The first captured message of the int-hash (or bytes-hash) scenario and the request tokens.
fn captured(version: &str, scenario: &str) -> (EventBatch, Vec<u32>) {
    let (payload, tokens) = support::captured_payload(version, scenario);
    (decode_batch(&payload).expect("decodes"), tokens)
}

fn prefix(batch: &EventBatch, n: usize) -> EventBatch {
    EventBatch {
        events: batch.events[..n].to_vec(),
        ..batch.clone()
    }
}

#[test]
fn captured_events_score_the_request_that_produced_them() {
    for version in ["0.11.0", "0.23.0", "0.24.0", "0.28.0", "0.33.0"] {
        for scenario in [
            "int_hashes_topic_kv-events_dp0",
            "bytes_hashes_topic_kv-events_dp0",
        ] {
            // Without and with the digest memo (scores hash the prompt twice: the second time
            // from the memo), on one writer lane and on three.
            for (memo_bytes, lanes) in [0, 1 << 20]
                .into_iter()
                .flat_map(|m| [1, 3].map(|l| (m, l)))
            {
                let ctx = format!("{version} {scenario} memo {memo_bytes} lanes {lanes}");
                let (batch, tokens) = captured(version, scenario);
                let ix = Indexer::new(IndexerSettings {
                    digest_memo_bytes: memo_bytes,
                    index: IndexConfig {
                        writer_lanes: lanes,
                        ..Default::default()
                    },
                    ..settings(Some("12345"), 16)
                })
                .expect("valid");
                // The two BlockStored events: blocks 0-1 (root), then block 2 (parent = block 1).
                let report = ix
                    .apply_batch(MODEL, "10.0.0.1:8000", &prefix(&batch, 2))
                    .expect("applies");
                assert_eq!(report.blocks_stored, 3, "{ctx}");
                assert_eq!(
                    (report.hash_matches, report.hash_mismatches),
                    (1, 0),
                    "{ctx}"
                );
                assert_eq!(report.orphan_runs, 0, "{ctx}");
                let pods = vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
                let r = ix
                    .score_tokens(MODEL, &tokens, &pods, None, None)
                    .expect("known model");
                assert_eq!(r.total_blocks, 3, "{ctx}: 56 tokens = 3 full blocks");
                assert_eq!(r.prompt_tokens, 56);
                assert_eq!(r.pod(&r.scores[0]), "10.0.0.1:8000", "{ctx}");
                assert_eq!(r.pod(&r.scores[1]), "10.0.0.2:8000", "{ctx}: listed with 0");
                assert_eq!(r.scores[0].matched_blocks, 3, "{ctx}");
                assert!(
                    (r.scores[0].score - 3.0).abs() < 1e-9,
                    "{ctx}: GPU weight 1.0"
                );
                assert_eq!(
                    r.scores[1].matched_blocks, 0,
                    "{ctx}: candidate with nothing scores 0"
                );
                // The rest: three BlockRemoved (eviction) and AllBlocksCleared.
                let rest = EventBatch {
                    events: batch.events[2..].to_vec(),
                    ..batch.clone()
                };
                let report = ix
                    .apply_batch(MODEL, "10.0.0.1:8000", &rest)
                    .expect("applies");
                assert_eq!(report.removed_events, 3, "{ctx}");
                assert_eq!(report.blocks_removed, 3, "{ctx}");
                let r = ix
                    .score_tokens(MODEL, &tokens, &pods, None, None)
                    .expect("known");
                assert!(
                    r.scores.iter().all(|s| s.matched_blocks == 0),
                    "{ctx}: {r:?}"
                );
                let stats = ix.stats();
                assert_eq!(stats[0].1.keys, 0, "{ctx}: every node freed");
                let model = ix.model(MODEL).expect("known");
                match model.digest_memo() {
                    None => assert_eq!(memo_bytes, 0, "{ctx}"),
                    Some(memo) => assert_eq!(
                        (memo.stats().misses, memo.stats().hits),
                        (3, 3),
                        "{ctx}: hashed once, then from the memo"
                    ),
                }
            }
        }
    }
}

#[test]
fn lora_salted_multimodal_events_are_indexed_and_not_misjudged() {
    let doc = support::fixture("vllm/zmq_messages.vllm-0.33.0.json");
    let msg = &doc["scenarios"][0]["messages"][1];
    let batch = decode_batch(&support::unhex(msg["frames_hex"][2].as_str().expect("hex")))
        .expect("decodes");
    let ix = Indexer::new(settings(Some("12345"), 16)).expect("valid");
    let report = ix.apply_batch(MODEL, "pod-a", &batch).expect("applies");
    assert_eq!(report.blocks_stored, 2);
    assert_eq!(
        (report.hash_matches, report.hash_mismatches),
        (0, 0),
        "multimodal keys cannot be rebuilt from the event: not checked, not a mismatch"
    );
}

#[test]
fn salted_root_runs_are_verified_from_the_published_extra_keys() {
    // A run built by our processor (validated against vLLM's vectors) with a cache_salt, in the
    // published form: extra_keys[0] = ["tenant-42"].
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some("7".into()),
        extra_keys_format: ExtraKeysFormat::Tagged,
        ..Default::default()
    })
    .expect("valid");
    let tokens: Vec<u32> = (100..132).collect();
    let extras = RequestExtras {
        cache_salt: Some("tenant-42".into()),
        ..Default::default()
    };
    let hashes = processor.block_hashes(&tokens, &extras);
    let stored = kv_core::BlockStored {
        block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
        token_ids: tokens.clone(),
        block_size: 16,
        extra_keys: Some(vec![
            Some(kv_core::MsgpackValue::Array(vec![
                kv_core::MsgpackValue::Str("tenant-42".into()),
            ])),
            None,
        ]),
        ..Default::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(stored))],
        data_parallel_rank: Some(0),
    };
    let ix = Indexer::new(settings(Some("7"), 16)).expect("valid");
    let report = ix.apply_batch(MODEL, "p", &batch).expect("applies");
    assert_eq!((report.hash_matches, report.hash_mismatches), (1, 0));
    // A prompt one token past the two blocks (vLLM recomputes at least the last token).
    let prompt: Vec<u32> = tokens.iter().copied().chain([7]).collect();
    let r = ix
        .score_tokens(MODEL, &prompt, kv_core::ALL_PODS, None, Some("tenant-42"))
        .expect("known");
    assert_eq!(r.scores[0].matched_blocks, 2);
    let unsalted = ix
        .score_tokens(MODEL, &prompt, kv_core::ALL_PODS, None, None)
        .expect("known");
    assert_eq!(
        unsalted.scores[0].matched_blocks, 0,
        "the salt changes block 0"
    );
}

#[test]
fn mismatches_are_counted_per_pod_and_diagnosed() {
    let (batch, _) = captured("0.33.0", "int_hashes_topic_kv-events_dp0");
    let stored = prefix(&batch, 2);

    // Wrong block size: the event says 16.
    let ix = Indexer::new(aligned(Some("12345"), 32)).expect("valid");
    let r = ix.apply_batch(MODEL, "p1", &stored).expect("applies");
    assert_eq!(r.hash_mismatches, 1);
    let checks = ix.model(MODEL).expect("created").hash_checks();
    let d = checks["p1"].diagnosis.clone().expect("diagnosed");
    assert!(d.contains("block size differs") && d.contains("16"), "{d}");

    // Wrong seed, and one vLLM's own default would not fix: the generic diagnosis.
    let ix = Indexer::new(aligned(Some("999"), 16)).expect("valid");
    ix.apply_batch(MODEL, "p1", &stored).expect("applies");
    ix.apply_batch(MODEL, "p1", &stored).expect("applies");
    let checks = ix.model(MODEL).expect("created").hash_checks();
    assert_eq!((checks["p1"].matches, checks["p1"].mismatches), (0, 2));
    let d = checks["p1"].diagnosis.clone().expect("diagnosed");
    assert!(
        d.contains("PYTHONHASHSEED") && d.contains("sha256_cbor"),
        "{d}"
    );

    // vLLM ran with the default seed while we were told "12345": the diagnosis names it.
    let processor = TokenProcessor::new(&TokenProcessorConfig::default()).expect("valid");
    let tokens: Vec<u32> = (0..16).collect();
    let default_seed_run = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(kv_core::BlockStored {
            // The default seed's hashes: what that engine publishes, not our keys.
            block_hashes: processor
                .block_hashes(&tokens, &RequestExtras::default())
                .iter()
                .map(|h| EngineHash::new(h.get()))
                .collect(),
            token_ids: tokens,
            block_size: 16,
            ..Default::default()
        }))],
        data_parallel_rank: None,
    };
    let ix = Indexer::new(aligned(Some("12345"), 16)).expect("valid");
    ix.apply_batch(MODEL, "p2", &default_seed_run)
        .expect("applies");
    let d = ix.model(MODEL).expect("created").hash_checks()["p2"]
        .diagnosis
        .clone()
        .expect("diagnosed");
    assert!(d.contains("unset"), "{d}");

    // With the default settings the same pod is translated: no mismatch counted, the
    // diagnosis kept (it says why it is translated), and it scores.
    let ix = Indexer::new(settings(Some("12345"), 16)).expect("valid");
    let r = ix
        .apply_batch(MODEL, "p2", &default_seed_run)
        .expect("applies");
    assert_eq!((r.hash_mismatches, r.first_mismatch), (0, false));
    assert_eq!(
        r.translation.mode_changed,
        Some(kv_core::KeyMode::Translated)
    );
    let check = ix.model(MODEL).expect("created").hash_checks()["p2"].clone();
    assert_eq!(check.mismatches, 0);
    assert!(check.diagnosis.expect("diagnosed").contains("unset"));
    // Block 0 and one token more: vLLM reuses at most all but the last token.
    let tokens: Vec<u32> = (0..17).collect();
    let scored = ix
        .score_tokens(MODEL, &tokens, &["p2"], None, None)
        .expect("known");
    assert_eq!(scored.scores[0].matched_blocks, 1);
}

#[test]
fn vllm_0_10_sha256_cbor_64bit_hashes_are_flagged() {
    // vLLM 0.10.0/0.10.1's sha256_cbor_64bit chains an int parent: not what >= 0.10.2 hashes.
    let doc = support::fixture("vllm/zmq_messages.vllm-0.10.1.json");
    let payload = support::unhex(
        doc["scenarios"][0]["messages"][0]["frames_hex"][2]
            .as_str()
            .expect("hex"),
    );
    let batch = decode_batch(&payload).expect("decodes");
    let ix = Indexer::new(aligned(Some("12345"), 16)).expect("valid");
    let r = ix
        .apply_batch(MODEL, "old", &prefix(&batch, 2))
        .expect("applies");
    assert_eq!((r.hash_matches, r.hash_mismatches), (0, 1));
    // By default it is translated from its token ids instead.
    let ix = Indexer::new(settings(Some("12345"), 16)).expect("valid");
    let r = ix
        .apply_batch(MODEL, "old", &prefix(&batch, 2))
        .expect("applies");
    assert_eq!(
        r.translation.mode_changed,
        Some(kv_core::KeyMode::Translated)
    );
    assert_eq!(
        (r.translation.translated_runs, r.translation.untranslatable),
        (2, [0; 5]),
        "both stored runs (blocks 0 and 1) translated"
    );
}

#[test]
fn unknown_models_and_unconfigured_lora_paths_are_errors() {
    let ix = Indexer::new(settings(None, 16)).expect("valid");
    assert_eq!(
        ix.score_tokens("nope", &[1, 2, 3], kv_core::ALL_PODS, None, None)
            .err(),
        Some(ScoreError::UnknownModel("nope".into()))
    );
    ix.apply_batch(
        MODEL,
        "p",
        &EventBatch {
            ts: 0.0,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: None,
        },
    )
    .expect("applies");
    assert!(matches!(
        ix.score_tokens(MODEL, &[1; 32], kv_core::ALL_PODS, Some("sql"), None),
        Err(ScoreError::UnknownLora(_))
    ));
    let r = ix
        .score_tokens(MODEL, &[1; 32], kv_core::ALL_PODS, None, None)
        .expect("known now");
    assert_eq!(
        r.scores.len(),
        1,
        "every known pod is listed when no candidates are given"
    );
}

#[test]
fn data_parallel_ranks_are_separate_engines_of_one_pod() {
    let (batch, tokens) = captured("0.33.0", "int_hashes_topic_kv-events_dp0");
    let ix = Indexer::new(settings(Some("12345"), 16)).expect("valid");
    let mut rank1 = prefix(&batch, 1); // blocks 0-1 on rank 1
    rank1.data_parallel_rank = Some(1);
    ix.apply_batch(MODEL, "pod", &rank1).expect("applies");
    let r = ix
        .score_tokens(MODEL, &tokens, &["pod"], None, None)
        .expect("known");
    assert_eq!(r.scores[0].matched_blocks, 2);
    // Clearing rank 0 leaves rank 1's blocks.
    let mut clear0 = prefix(&batch, 0);
    clear0.events.push(KvEvent::AllBlocksCleared);
    clear0.data_parallel_rank = Some(0);
    ix.apply_batch(MODEL, "pod", &clear0).expect("applies");
    let r = ix
        .score_tokens(MODEL, &tokens, &["pod"], None, None)
        .expect("known");
    assert_eq!(r.scores[0].matched_blocks, 2);
    assert_eq!(
        ix.remove_pod(MODEL, "pod"),
        2,
        "removing the pod drops both ranks"
    );
}

/// `size` bounds the indexer, not each model: many models share one key budget, a newcomer
/// makes room by evicting from the model holding the most, and `max_models` bounds how many
/// models events can create.
#[test]
fn size_bounds_all_models_together_and_models_are_bounded() {
    use kv_core::{BlockStored, EventBatch, IndexConfig, KvEvent};
    let indexer = Indexer::new(IndexerSettings {
        index: IndexConfig {
            max_keys: 100,
            pod_cache_size: Some(10),
            writer_lanes: 1,
        },
        max_models: 8,
        ..settings(Some("12345"), 16)
    })
    .expect("valid");
    let batch = |model: u64, n: u64| EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: (0..n)
                .map(|i| EngineHash::new(model << 32 | (i + 1)))
                .collect(),
            block_size: 16,
            ..Default::default()
        }))],
        data_parallel_rank: None,
    };
    for m in 0..8u64 {
        indexer
            .apply_batch(&format!("m{m}"), "10.0.0.1:8000", &batch(m, 40))
            .expect("applies");
        let total: u64 = indexer.stats().iter().map(|(_, s)| s.keys).sum();
        assert!(total <= 100, "after model {m}: {total} keys");
        let newest = indexer.model(&format!("m{m}")).expect("model");
        assert_eq!(
            newest.index().stats().keys,
            40,
            "model {m} got room for all its blocks"
        );
    }
    // Past maxModels a newcomer takes the place of the model holding the fewest keys (the
    // budget made the older ones give room, so they hold less than the newest).
    let before: std::collections::HashMap<_, _> = indexer
        .stats()
        .into_iter()
        .map(|(name, s)| (name, s.memberships))
        .collect();
    let fewest = before.values().min().copied().expect("models");
    let report = indexer
        .apply_batch("m8", "10.0.0.1:8000", &batch(8, 1))
        .expect("a new model is admitted");
    let least = report.evicted_model.expect("a model gave its place");
    assert_eq!(
        before[&least], fewest,
        "{least} held the fewest ({before:?})"
    );
    assert!(indexer.model(&least).is_none(), "{least} gave its place");
    assert_eq!(indexer.models().len(), 8);
    assert_eq!(indexer.models_evicted(), 1);
    let total: u64 = indexer.stats().iter().map(|(_, s)| s.keys).sum();
    assert!(total <= 100, "the evicted model's keys went back: {total}");
    assert_eq!(
        indexer.model("m8").expect("m8").index().stats().keys,
        1,
        "the newcomer is indexed"
    );
}

/// Models named in the settings are always there and never give their place: when every
/// place is a configured model, an unconfigured one is refused.
#[test]
fn configured_models_keep_their_place() {
    use kv_core::{BlockStored, EventBatch, KvEvent, SettingsError};
    let mut s = settings(Some("12345"), 16);
    s.max_models = 2;
    s.models
        .insert("configured".into(), s.default_model.clone());
    let indexer = Indexer::new(s).expect("valid");
    let batch = |n: u64| EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: vec![EngineHash::new(n)],
            block_size: 16,
            ..Default::default()
        }))],
        data_parallel_rank: None,
    };
    for m in 0..20u64 {
        indexer
            .apply_batch(&format!("junk{m}"), "p", &batch(m))
            .expect("a junk name takes the other junk name's place");
        assert!(indexer.model("configured").is_some(), "never evicted");
        assert_eq!(indexer.models().len(), 2);
    }
    let mut full = settings(Some("12345"), 16);
    full.max_models = 1;
    full.models
        .insert("configured".into(), full.default_model.clone());
    let indexer = Indexer::new(full).expect("valid");
    let e = indexer
        .apply_batch("other", "p", &batch(1))
        .expect_err("no place to take");
    assert!(
        matches!(e, SettingsError::TooManyModels { max: 1, .. }),
        "{e}"
    );
}
