//! vLLM 0.33's own KV-cache manager as ground truth for hybrid models: the batches its
//! publisher sent while it served a chat-like workload with evictions (full attention beside
//! sliding windows of 128 and 512 tokens in both group orders, Mamba in align mode at 576-token
//! blocks with and without 16-token partial hits, MLA beside sliding-window MLA at other block
//! sizes, full attention of 32-token blocks hashed in units of 16), replayed into the indexer;
//! every probe's predicted hit must be the tokens vLLM's `get_computed_blocks` reuses.
//! `tests/fixtures/hybrid/README.md` says how the fixtures were made (`generate.py`, vLLM's
//! code from PyPI) and what each rule is.
//!
//! With EAGLE/MTP lookahead hashing (L = 1 and 2, single-group and hybrid), 30 more probes per
//! run share a block of an earlier prompt but 0..L of the tokens after it; those engines are
//! scored aligned (their hashes are our keys) and translated alike.
//!
//! The negative controls replay the same batches without the groups that are not full
//! attention (what an index of the full-attention group alone predicts), and the lookahead
//! runs with their lookahead tokens dropped (keys and prompts hashed without them), and must
//! miss.

mod support;

use kv_core::{EngineHashes, HashScratch, Indexer, IndexerSettings, KeyMode, KvEvent};
use kv_core::{ModelSettings, RequestExtras, TokenProcessor};
use support::replay::{foreign, is_full_attention, misses, processor_config, replay, MODEL, POD};
use support::{hybrid_runs as runs, HybridRun as Run};

/// Chunked local attention's chunk size is not in vLLM's events: refused, not predicted.
const REFUSED: &str = "full+chunked256-bs16";

/// Replays `run`'s batches (each event through `keep`) and predicts every probe's hit in
/// tokens.
fn predict(run: &Run, keep: impl Fn(&KvEvent) -> bool) -> (Indexer, Vec<u64>) {
    predict_as(run, EngineHashes::Auto, |e| keep(e).then(|| e.clone()))
}

/// [`predict`] with the engine's hashes taken as `hashes` says, each event as `edit` makes
/// it (`None`: dropped).
fn predict_as(
    run: &Run,
    hashes: EngineHashes,
    edit: impl Fn(&KvEvent) -> Option<KvEvent>,
) -> (Indexer, Vec<u64>) {
    predict_with(run, support::replay::settings_as(run, hashes), edit)
}

/// [`predict_as`] with the model's settings as given.
fn predict_with(
    run: &Run,
    settings: ModelSettings,
    edit: impl Fn(&KvEvent) -> Option<KvEvent>,
) -> (Indexer, Vec<u64>) {
    let r = replay(run, settings, edit);
    (r.indexer, r.predicted)
}

#[test]
fn our_hashes_of_a_probe_are_vllms() {
    for run in runs() {
        let processor = TokenProcessor::new(&processor_config(&run)).expect("valid");
        let tokens = &run.probes[0].tokens;
        let plain = RequestExtras::default();
        let mut ours = Vec::new();
        let l = run.lookahead as usize;
        let scratch = &mut HashScratch::default();
        processor.block_hashes_lookahead_into(tokens, l, &plain, scratch, &mut ours);
        let ours: Vec<u64> = ours.iter().map(|h| h.get()).collect();
        assert_eq!(ours, run.first_probe_hashes, "{}", run.name);
        if l > 0 {
            // Hashed without the lookahead, no block is vLLM's.
            let unkeyed = processor.block_hashes(tokens, &plain);
            assert!(unkeyed.iter().all(|h| !ours.contains(&h.get())));
        }
    }
}

#[test]
fn every_probes_predicted_hit_is_the_hit_vllm_takes() {
    let mut checked = 0;
    for run in runs() {
        if run.scenario == REFUSED {
            continue;
        }
        let (_, predicted) = predict(&run, |_| true);
        let missed = misses(&run, &predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        checked += run.probes.len();
    }
    assert!(checked >= 50 * 30 + 30 * 9, "{checked} probes checked");
}

#[test]
fn negative_control_an_index_of_the_full_attention_group_alone_misses() {
    let mut missed_runs = 0;
    let mut differing_runs = 0;
    for run in runs() {
        if run.scenario == REFUSED || run.lookahead > 0 {
            continue;
        }
        let differs = run.probes.iter().any(|p| p.hit != p.full_only);
        let (_, predicted) = predict(&run, is_full_attention);
        let missed = misses(&run, &predicted);
        if differs {
            differing_runs += 1;
            if !missed.is_empty() {
                missed_runs += 1;
            }
        }
    }
    assert!(differing_runs >= 20, "{differing_runs}");
    assert_eq!(
        missed_runs, differing_runs,
        "full-attention-only prediction must miss wherever vLLM's hit is not the full group's"
    );
}

#[test]
fn a_group_whose_rule_events_cannot_show_is_refused_and_counted() {
    for run in runs().into_iter().filter(|r| r.scenario == REFUSED) {
        let (ix, _) = predict(&run, |_| true);
        assert!(ix.skipped_group_events() > 0, "{}", run.name);
    }
}

/// `e` as an engine that names no group publishes it (SGLang: its full-attention KV only, no
/// group, kind or window; vLLM before 0.20): group 0's events, stripped; `None` for others.
fn ungrouped(e: &KvEvent) -> Option<KvEvent> {
    let mut e = e.clone();
    match &mut e {
        KvEvent::BlockStored(s) if s.group_idx.unwrap_or(0) == 0 => {
            s.group_idx = None;
            s.kv_cache_spec_kind = None;
            s.kv_cache_spec_sliding_window = None;
        }
        KvEvent::BlockRemoved(r) if r.group_idx.unwrap_or(0) == 0 => r.group_idx = None,
        KvEvent::BlockStored(_) | KvEvent::BlockRemoved(_) => return None,
        _ => {}
    }
    Some(e)
}

#[test]
fn an_engine_of_a_hybrid_model_that_names_no_group_is_refused_and_counted() {
    let run = runs()
        .into_iter()
        .find(|r| r.name == "full+swa128-bs16/seed1")
        .expect("run");
    assert!(run.probes.iter().any(|p| p.full_only > p.hit));
    let hybrid = ModelSettings {
        token_processor: processor_config(&run),
        hybrid: true,
        ..Default::default()
    };
    let (ix, predicted) = predict_with(&run, hybrid, ungrouped);
    assert!(predicted.iter().all(|&p| p == 0), "{predicted:?}");
    assert!(ix.skipped_group_events() > 0);
    // The negative control: the same engine, the model not marked hybrid, is credited the
    // full-attention prefix, more than vLLM reuses.
    let (_, credited) = predict_as(&run, EngineHashes::Auto, ungrouped);
    let over = run
        .probes
        .iter()
        .zip(&credited)
        .any(|(p, &got)| got > p.hit);
    assert!(over, "scored as full attention, it over-predicts");
}

/// [`REFUSED`]'s chunk, as the model's HuggingFace config would state it.
const CHUNK: u32 = 256;

/// Chunked local attention scored with the model's chunk, aligned and translated.
fn predict_chunked(run: &Run, chunk: u32, hashes: EngineHashes) -> (Indexer, Vec<u64>) {
    let settings = ModelSettings {
        token_processor: processor_config(run),
        engine_hashes: hashes,
        attention_chunk_size: Some(chunk),
        ..Default::default()
    };
    predict_with(run, settings, |e| Some(foreign_if(hashes, e)))
}

/// `e` as published, or moved to another space for a translated engine.
fn foreign_if(hashes: EngineHashes, e: &KvEvent) -> KvEvent {
    match hashes {
        EngineHashes::Translated => foreign(e),
        _ => e.clone(),
    }
}

#[test]
fn chunked_local_attention_with_the_models_chunk_is_scored_as_vllm_reuses() {
    let mut checked = 0;
    for run in runs().into_iter().filter(|r| r.scenario == REFUSED) {
        for hashes in [EngineHashes::Auto, EngineHashes::Translated] {
            let (ix, predicted) = predict_chunked(&run, CHUNK, hashes);
            assert_eq!(ix.skipped_group_events(), 0, "{}", run.name);
            let missed = misses(&run, &predicted);
            assert!(missed.is_empty(), "{} {hashes:?}: {:#?}", run.name, missed);
            checked += run.probes.len();
        }
        // The negative controls: the full-attention group alone, and a wrong chunk.
        if run.probes.iter().any(|p| p.hit != p.full_only) {
            let (_, full_only) = predict(&run, is_full_attention);
            assert!(!misses(&run, &full_only).is_empty(), "{}", run.name);
        }
        let (_, wrong) = predict_chunked(&run, 2 * CHUNK, EngineHashes::Auto);
        assert!(!misses(&run, &wrong).is_empty(), "{}: chunk 512", run.name);
    }
    assert_eq!(checked, 3 * 2 * 50);
}

/// The single-group lookahead runs.
fn single_group_lookahead(run: &Run) -> bool {
    run.lookahead > 0 && run.groups == 1
}

/// Runs with 16-token partial hits in a Mamba group wider than the unit: a partial entry
/// continues a unit inside an engine block that was never published (its parent's hash is
/// one no event carried, its tokens only its own unit's), so a translated engine cannot key
/// it. Such runs are skipped as `unknown_parent` and the engine is scored by its whole blocks.
fn partial_hits_inside_blocks(run: &Run) -> bool {
    run.scenario.contains("pmu")
}

#[test]
fn a_translated_hybrid_engine_is_scored_as_vllm_reuses() {
    let mut checked = 0;
    let mut differing = 0;
    let mut partial_runs = 0;
    for run in runs() {
        if run.scenario == REFUSED {
            continue;
        }
        if partial_hits_inside_blocks(&run) {
            // Never more than vLLM reuses: only the partial entries are missing.
            let (_, predicted) = predict_as(&run, EngineHashes::Auto, |e| Some(foreign(e)));
            let over = run
                .probes
                .iter()
                .zip(&predicted)
                .filter(|(p, &got)| got > p.hit);
            assert_eq!(over.count(), 0, "{}", run.name);
            partial_runs += 1;
            continue;
        }
        let (ix, predicted) = predict_as(&run, EngineHashes::Auto, |e| Some(foreign(e)));
        let model = ix.model(MODEL).expect("model");
        let modes: Vec<KeyMode> = model.key_modes().values().map(|m| m.0).collect();
        assert_eq!(modes, [KeyMode::Translated], "{}", run.name);
        assert_eq!(ix.skipped_group_events(), 0, "{}", run.name);
        let missed = misses(&run, &predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        checked += run.probes.len();
        // The negative control: the same engine translated from its full-attention group
        // alone misses wherever vLLM's hit is not that group's.
        if run.lookahead == 0 && run.probes.iter().any(|p| p.hit != p.full_only) {
            differing += 1;
            let (_, full_only) = predict_as(&run, EngineHashes::Auto, |e| {
                is_full_attention(e).then(|| foreign(e))
            });
            assert!(!misses(&run, &full_only).is_empty(), "{}", run.name);
        }
    }
    assert!(checked >= 50 * 27 + 30 * 9, "{checked} probes checked");
    assert!(differing >= 17, "{differing}");
    assert_eq!(partial_runs, 3);
}

#[test]
fn lookahead_engines_are_aligned_and_their_length_is_the_models() {
    let mut runs_checked = 0;
    for run in runs().into_iter().filter(|r| r.lookahead > 0) {
        let (ix, _) = predict(&run, |_| true);
        let model = ix.model(MODEL).expect("model");
        assert_eq!(u64::from(model.lookahead()), run.lookahead, "{}", run.name);
        let modes: Vec<KeyMode> = model.key_modes().values().map(|m| m.0).collect();
        assert_eq!(modes, [KeyMode::Aligned], "{}", run.name);
        runs_checked += 1;
    }
    assert_eq!(runs_checked, 9);
}

#[test]
fn a_translated_lookahead_engine_is_scored_as_vllm_reuses() {
    let mut checked = 0;
    for run in runs().into_iter().filter(|r| r.lookahead > 0) {
        let (ix, predicted) = predict_as(&run, EngineHashes::Translated, |e| Some(e.clone()));
        let model = ix.model(MODEL).expect("model");
        let modes: Vec<KeyMode> = model.key_modes().values().map(|m| m.0).collect();
        assert_eq!(modes, [KeyMode::Translated], "{}", run.name);
        let missed = misses(&run, &predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        checked += run.probes.len();
    }
    assert_eq!(checked, 9 * 80);
}

#[test]
fn negative_control_scoring_without_the_lookahead_misses() {
    // The same engines translated from their tokens without the lookahead tokens, prompts
    // hashed without them: a prompt that shares a block but not the tokens after it is
    // credited that block, which vLLM does not reuse.
    for run in runs().into_iter().filter(single_group_lookahead) {
        let (ix, predicted) = predict_as(&run, EngineHashes::Translated, |e| {
            let mut e = e.clone();
            if let KvEvent::BlockStored(s) = &mut e {
                s.lookahead_token_ids = None;
            }
            Some(e)
        });
        assert_eq!(ix.model(MODEL).expect("model").lookahead(), 0);
        let missed = misses(&run, &predicted);
        assert!(
            !missed.is_empty(),
            "{}: ignoring lookahead must miss",
            run.name
        );
        // Only ever by crediting more than vLLM reuses.
        let over = run
            .probes
            .iter()
            .zip(&predicted)
            .all(|(p, &got)| got >= p.hit);
        assert!(over, "{}", run.name);
    }
}

#[test]
fn a_run_of_another_lookahead_length_is_refused_and_counted() {
    let run = runs()
        .into_iter()
        .find(|r| r.lookahead == 1)
        .expect("a lookahead run");
    let ix = Indexer::new(IndexerSettings {
        default_model: ModelSettings {
            token_processor: processor_config(&run),
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid");
    let (mut learned, mut mismatched, mut malformed) = (None, 0, 0);
    for (i, batch) in run.messages.iter().enumerate() {
        let mut batch = batch.clone();
        for e in &mut batch.events {
            if let KvEvent::BlockStored(s) = e {
                match (i % 3, s.lookahead_token_ids.as_mut()) {
                    // A plain engine's run (no lookahead) in a lookahead model.
                    (1, _) if learned.is_some() => s.lookahead_token_ids = None,
                    // One list cut short: lengths differ.
                    (2, Some(lists)) => {
                        if let Some(last) = lists.last_mut() {
                            last.clear();
                        }
                    }
                    _ => {}
                }
            }
        }
        let report = ix.apply_batch(MODEL, POD, &batch).expect("applies");
        learned = learned.or(report.lookahead_learned);
        mismatched += report.lookahead_mismatch_blocks;
        malformed += report.lookahead_malformed_blocks;
        let drops: std::collections::HashMap<_, _> = report.drops().into_iter().collect();
        assert_eq!(
            drops["lookahead_mismatch"],
            report.lookahead_mismatch_blocks
        );
        assert_eq!(
            drops["lookahead_malformed"],
            report.lookahead_malformed_blocks
        );
    }
    assert_eq!(learned, Some(1));
    assert!(mismatched > 0 && malformed > 0, "{mismatched} {malformed}");
    assert_eq!(ix.model(MODEL).expect("model").lookahead(), 1);
}
