//! A translated engine under a key budget (`size`): every key is stored together with the map
//! entry that removes it, and the newest blocks win. Ground truth: `fixtures/engines/budget.json`
//! (vLLM 0.33.0's own hashing and events: xxhash, `PYTHONHASHSEED=999`, four prompts of 60
//! blocks, then every block removed).

mod support;

use kv_core::{decode_batch, EngineHashes, IndexConfig, Indexer};

const MODEL: &str = "m";
const POD: &str = "10.0.0.1:8000";

fn indexer(lanes: usize, size: usize) -> Indexer {
    let index = IndexConfig {
        writer_lanes: lanes,
        max_keys: size,
        ..Default::default()
    };
    support::fixture_indexer(index, EngineHashes::Auto)
}

fn held(ix: &Indexer, s: &support::BudgetScenario) -> Vec<u32> {
    s.prompts
        .iter()
        .map(|(tokens, _)| {
            ix.score_tokens(MODEL, &support::past(tokens), &[POD], None, None)
                .expect("model")
                .scores[0]
                .matched_blocks
        })
        .collect()
}

/// (index keys, map entries) of the model.
fn footprint(ix: &Indexer) -> (u64, usize) {
    let model = ix.model(MODEL).expect("model");
    let entries = model.key_modes().values().map(|(_, n)| *n).sum();
    (model.index().stats().keys, entries)
}

#[test]
fn under_a_key_budget_the_newest_prompt_wins_and_every_removal_reaches_its_keys() {
    let s = support::budget_scenario();
    let stores = s.kinds.iter().filter(|k| *k == "stored").count();
    for lanes in [1, 3] {
        // Room for one prompt: 60 keys and the 60 map entries that remove them.
        let ix = indexer(lanes, 120);
        let (mut unknown, mut evicted) = (0u64, 0u64);
        for (i, payload) in s.messages.iter().enumerate() {
            let batch = decode_batch(payload).expect("decodes");
            let r = ix.apply_batch(MODEL, POD, &batch).expect("applies");
            unknown += u64::from(r.translation.unknown_removals);
            evicted += u64::from(r.translation.evicted_entries);
            let (keys, entries) = footprint(&ix);
            assert!(
                keys + entries as u64 <= 120,
                "{lanes} lanes after message {i}: {keys} keys and {entries} entries in a budget of 120"
            );
            if i + 1 == stores {
                assert_eq!(
                    held(&ix, &s),
                    [0, 0, 0, 60],
                    "{lanes} lanes: the newest prompt holds the budget"
                );
                assert_eq!((keys, entries), (60, 60), "{lanes} lanes");
            }
        }
        assert_eq!(
            held(&ix, &s),
            [0, 0, 0, 0],
            "{lanes} lanes: every block removed"
        );
        assert_eq!(
            footprint(&ix),
            (0, 0),
            "{lanes} lanes: no key outlives its removal"
        );
        assert_eq!(ix.stats()[0].1.memberships, 0, "{lanes} lanes");
        // The first three prompts' entries gave their place; their removals find nothing and
        // are counted.
        assert_eq!((unknown, evicted), (180, 180), "{lanes} lanes");
    }
}

#[test]
fn without_a_budget_the_same_events_hold_every_prompt() {
    // The control: the budget alone decides what the test above sees.
    let s = support::budget_scenario();
    let ix = indexer(1, 100_000);
    for payload in &s.messages[..8] {
        let batch = decode_batch(payload).expect("decodes");
        ix.apply_batch(MODEL, POD, &batch).expect("applies");
    }
    assert_eq!(held(&ix, &s), [60, 60, 60, 60]);
}

#[test]
fn a_snapshot_restored_under_a_smaller_budget_drops_entries_with_their_keys() {
    let s = support::budget_scenario();
    let stores = s.kinds.iter().filter(|k| *k == "stored").count();
    let source = indexer(1, 100_000);
    for payload in &s.messages[..stores] {
        let batch = decode_batch(payload).expect("decodes");
        source.apply_batch(MODEL, POD, &batch).expect("applies");
    }
    let mut blocks = Vec::new();
    source.export_each(|model, key, held| {
        blocks.push((model.to_owned(), key.clone(), held.to_vec()))
    });
    let mut states = Vec::new();
    source.export_keys_each(|model, key, state| {
        states.push((model.to_owned(), key.clone(), state.clone()))
    });
    let small = indexer(1, 120);
    for (model, key, held) in &blocks {
        let hashes: Vec<_> = held.iter().map(|(h, _)| *h).collect();
        small
            .import(model, key, kv_core::Tier::Gpu, &hashes)
            .expect("imports");
    }
    let mut dropped = 0;
    for (model, key, state) in states {
        dropped += small
            .import_keys(&model, &key, state)
            .expect("imports")
            .dropped;
    }
    let (keys, entries) = footprint(&small);
    assert!(
        keys + entries as u64 <= 120,
        "{keys} keys, {entries} entries"
    );
    assert_eq!(dropped, 240 - entries, "every entry left out is counted");
    assert!(entries > 0 && keys > 0, "{keys} keys, {entries} entries");
    // Every key left is removable: after the engine removes everything, nothing is left.
    for payload in &s.messages[stores..] {
        let batch = decode_batch(payload).expect("decodes");
        small.apply_batch(MODEL, POD, &batch).expect("applies");
    }
    assert_eq!(footprint(&small), (0, 0), "no key outlived its removal");
}
