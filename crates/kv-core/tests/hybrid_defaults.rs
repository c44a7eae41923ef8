//! vLLM 0.33's own KV-cache manager at vLLM's default settings as ground truth for hybrid
//! models (`fixtures/hybrid/defaults.json`): scheduler budgets of 2,048 and 8,192 tokens with
//! chunked prefill, prefix-cache retention 0 (and its alternatives), every hybrid layout in
//! both group orders. There vLLM's `BlockPool.cache_full_blocks` leaves null and masked blocks
//! out of an event's `block_hashes` while its `token_ids` cover the whole range: a sliding
//! window publishes only the blocks a later hit can use, a Mamba group one state for a
//! multi-block step. Every probe's predicted hit must be the tokens vLLM's
//! `get_computed_blocks` reuses, for an engine hashing as the index (aligned), one hashing
//! otherwise (translated from its tokens), and a Mamba engine of 576-token blocks under the
//! index's default 16-token `blockSize` (translated by block size).
//!
//! The negative control reads the same events as the translation did before it paired each
//! hash with its own block: the i-th hash with the i-th block of the tokens. It must miss.

mod support;

use kv_core::{EngineHashes, KeyMode, KvEvent, ModelSettings, TokenProcessorConfig};
use support::replay::{foreign, misses, processor_config, replay, settings_as, Replay, MODEL, POD};
use support::{hybrid_default_runs as runs, HybridRun as Run};

/// The chunk of the chunked-local-attention layouts (not in vLLM's events: the model's
/// `attention_chunk_size`, here the generator's 256).
const CHUNK: u32 = 256;

/// Runs with 16-token partial hits inside a Mamba group wider than the unit: a translated
/// engine cannot key the partial entries (docs/vllm-compatibility.md §4.5) and is scored by
/// whole blocks, never above vLLM's hit.
fn partial_hits_inside_blocks(run: &Run) -> bool {
    run.layout.contains("pmu")
}

/// The model's settings for `run`, its hashes taken as `hashes` says (the chunk given for the
/// chunked-local-attention layouts, as the model's config states it).
fn settings(run: &Run, hashes: EngineHashes) -> ModelSettings {
    ModelSettings {
        attention_chunk_size: run.layout.contains("chunked").then_some(CHUNK),
        ..settings_as(run, hashes)
    }
}

/// Whether `e` is a `BlockStored` of whole blocks whose hashes are fewer than the blocks its
/// tokens cover.
fn sparse(e: &KvEvent) -> bool {
    matches!(e, KvEvent::BlockStored(s)
        if s.block_size > 0 && s.token_ids.len() > s.block_hashes.len() * s.block_size as usize)
}

/// Probes equal to vLLM's hit, per layout: `(layout, matched, probes)`, in fixture order.
fn tally(rows: &mut Vec<(String, usize, usize)>, run: &Run, predicted: &[u64]) {
    let matched = run
        .probes
        .iter()
        .zip(predicted)
        .filter(|(p, &got)| got == p.hit)
        .count();
    match rows.iter_mut().find(|r| r.0 == run.layout) {
        Some(row) => {
            row.1 += matched;
            row.2 += run.probes.len();
        }
        None => rows.push((run.layout.clone(), matched, run.probes.len())),
    }
}

fn print_table(title: &str, rows: &[(String, usize, usize)]) {
    println!("{title}");
    for (layout, matched, probes) in rows {
        println!("  {layout:40} {matched:4}/{probes}");
    }
}

#[test]
fn the_fixtures_are_vllms_defaults_with_fewer_hashes_than_blocks() {
    let runs = runs();
    let mut layouts: Vec<&str> = runs.iter().map(|r| r.layout.as_str()).collect();
    layouts.dedup();
    assert_eq!(layouts.len(), 16, "{layouts:?}");
    for layout in layouts {
        let of = || runs.iter().filter(move |r| r.layout == layout);
        let budgets: Vec<u64> = of().map(|r| r.budget).collect();
        assert!(
            budgets.contains(&2048) && budgets.contains(&8192),
            "{layout}"
        );
        let sparse_events = of()
            .flat_map(|r| r.messages.iter().flat_map(|b| &b.events))
            .filter(|e| sparse(e))
            .count();
        // Chunked local attention caches every block of a range (vLLM's rule).
        assert_eq!(sparse_events == 0, layout.contains("chunked"), "{layout}");
    }
}

#[test]
fn an_aligned_engine_at_vllms_defaults_scores_vllms_hit() {
    let mut rows = Vec::new();
    for run in runs() {
        let r = replay(&run, settings(&run, EngineHashes::Auto), |e| {
            Some(e.clone())
        });
        let missed = misses(&run, &r.predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        tally(&mut rows, &run, &r.predicted);
    }
    print_table("aligned", &rows);
}

/// `run` replayed as an engine hashing otherwise, every hash moved to another space.
fn translated(run: &Run) -> Replay {
    replay(run, settings(run, EngineHashes::Auto), |e| Some(foreign(e)))
}

fn modes(r: &Replay) -> Vec<KeyMode> {
    let model = r.indexer.model(MODEL).expect("model");
    model.key_modes().values().map(|m| m.0).collect()
}

/// Published hashes a replay skipped because no block could be paired with them for certain.
fn unplaced(r: &Replay) -> u64 {
    r.reports
        .iter()
        .map(|rep| u64::from(rep.translation.unplaced_hashes))
        .sum()
}

#[test]
fn a_translated_engine_at_vllms_defaults_scores_vllms_hit() {
    let mut rows = Vec::new();
    let mut partial_runs = 0;
    for run in runs() {
        let r = translated(&run);
        assert_eq!(modes(&r), [KeyMode::Translated], "{}", run.name);
        tally(&mut rows, &run, &r.predicted);
        if partial_hits_inside_blocks(&run) {
            let over = run.probes.iter().zip(&r.predicted);
            assert!(over.clone().all(|(p, &got)| got <= p.hit), "{}", run.name);
            partial_runs += 1;
            continue;
        }
        let missed = misses(&run, &r.predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        assert_eq!(unplaced(&r), 0, "{}: every hash placed", run.name);
    }
    assert_eq!(partial_runs, 4);
    print_table("translated (another seed)", &rows);
}

#[test]
fn every_hash_is_paired_with_the_block_whose_key_it_is() {
    // Translated although it hashes as the index: each map entry's key, computed from the
    // block its hash was paired with, must be the hash vLLM published for it (hybrid.json's
    // runs too, whose events name every block).
    let mut checked = 0;
    for run in runs().into_iter().chain(support::hybrid_runs()) {
        let ix = kv_core::Indexer::new(kv_core::IndexerSettings {
            default_model: settings(&run, EngineHashes::Translated),
            ..Default::default()
        })
        .expect("valid");
        for batch in &run.messages {
            let report = ix.apply_batch(MODEL, POD, batch).expect("applies");
            if !partial_hits_inside_blocks(&run) {
                assert_eq!(report.translation.unplaced_hashes, 0, "{}", run.name);
            }
            ix.export_keys_each(|_, _, state| {
                for t in &state.translated {
                    let key = kv_core::event_hash(&t.tip).in_group(t.group);
                    assert_eq!(key.get(), t.engine_hash.get(), "{}", run.name);
                    checked += 1;
                }
            });
        }
    }
    println!("{checked} map entries checked (after each batch)");
    assert!(checked > 10_000, "{checked} entries checked");
}

/// `blockSize` 16 (the daemon's default) with vLLM's seed: an engine of 576-token blocks.
fn at_block_16(run: &Run) -> ModelSettings {
    ModelSettings {
        token_processor: TokenProcessorConfig {
            block_size: 16,
            ..processor_config(run)
        },
        ..settings(run, EngineHashes::Auto)
    }
}

#[test]
fn a_mamba_engine_translated_by_block_size_scores_vllms_hit_and_could_be_aligned() {
    let mut rows = Vec::new();
    let mamba = runs().into_iter().filter(|r| r.unit == 576);
    let mut checked = 0;
    for run in mamba {
        let same: fn(&KvEvent) -> KvEvent = KvEvent::clone;
        for (edit, seed) in [
            (same, "vLLM's"),
            (foreign as fn(&KvEvent) -> KvEvent, "another"),
        ] {
            let r = replay(&run, at_block_16(&run), |e| Some(edit(e)));
            assert_eq!(modes(&r), [KeyMode::Translated], "{}", run.name);
            let missed = misses(&run, &r.predicted);
            assert!(
                missed.is_empty(),
                "{} ({seed} seed): {:#?}",
                run.name,
                missed
            );
            let model = r.indexer.model(MODEL).expect("model");
            let notes: Vec<Option<u32>> = model
                .key_notes()
                .values()
                .map(|n| n.alignable_block_size)
                .collect();
            // Hashed as the index would at the engine's own block size, it says so.
            let expected = if seed == "vLLM's" { Some(576) } else { None };
            assert_eq!(notes, [expected], "{} ({seed} seed)", run.name);
            if seed == "vLLM's" {
                tally(&mut rows, &run, &r.predicted);
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * 6);
    print_table("translated by block size (blockSize 16)", &rows);
}

/// `e` as the translation read it before each hash was paired with its own block: the i-th
/// hash with the i-th block of the tokens (here by cutting the tokens to one block per hash).
fn paired_by_position(e: &KvEvent) -> KvEvent {
    let mut e = foreign(e);
    if let KvEvent::BlockStored(s) = &mut e {
        if sparse(&KvEvent::BlockStored(s.clone())) {
            s.token_ids
                .truncate(s.block_hashes.len() * s.block_size as usize);
        }
    }
    e
}

#[test]
fn negative_control_pairing_hashes_with_blocks_by_position_misses() {
    let mut rows = Vec::new();
    let mut missed_layouts = std::collections::BTreeSet::new();
    for run in runs() {
        let r = replay(&run, settings(&run, EngineHashes::Auto), |e| {
            Some(paired_by_position(e))
        });
        tally(&mut rows, &run, &r.predicted);
        if !misses(&run, &r.predicted).is_empty() {
            missed_layouts.insert(run.layout.clone());
        }
    }
    print_table("negative control: paired by position", &rows);
    // Every layout whose events leave blocks out misses somewhere.
    let sparse_layouts = rows.iter().filter(|r| !r.0.contains("chunked")).count();
    assert_eq!(missed_layouts.len(), sparse_layouts, "{missed_layouts:?}");
}

#[test]
fn a_hash_that_cannot_be_placed_is_skipped_and_counted_never_guessed() {
    // A sliding window whose hashes no other group names (moved to a space of their own):
    // nothing says which blocks its hashes stand for.
    let run = runs()
        .into_iter()
        .find(|r| r.name == "swa128+full-bs16@2048/seed1")
        .expect("run");
    let r = replay(&run, settings(&run, EngineHashes::Auto), |e| {
        let mut e = foreign(e);
        if let KvEvent::BlockStored(s) = &mut e {
            if s.kv_cache_spec_kind.as_deref() == Some("sliding_window") {
                for h in s.block_hashes.iter_mut().chain(&mut s.parent_block_hash) {
                    *h = kv_core::EngineHash::new(h.get().rotate_left(17));
                }
            }
        }
        Some(e)
    });
    assert!(unplaced(&r) > 0, "hashes skipped");
    let drops: u64 = r
        .reports
        .iter()
        .map(|rep| {
            rep.drops()
                .into_iter()
                .find(|d| d.0 == "unplaced_hash")
                .map_or(0, |d| d.1)
        })
        .sum();
    assert_eq!(drops, unplaced(&r), "counted as dropped blocks");
    let notes = r.indexer.model(MODEL).expect("model").key_notes();
    let engine = notes.values().next().expect("engine");
    assert_eq!(engine.unplaced_hashes, unplaced(&r), "ListPods' count");
    // Never more than vLLM reuses.
    for (p, &got) in run.probes.iter().zip(&r.predicted) {
        assert!(got <= p.hit, "{got} > {}", p.hit);
    }
}
