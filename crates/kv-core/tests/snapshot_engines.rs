//! Snapshots across index shapes: what one indexer exports (blocks with their tiers, and the
//! engine-hash maps of translated engines) restores into a fresh indexer with one writer lane
//! or several with the same answers. A daemon restarted with another `writerLanes` comes back
//! warm from the snapshot the old one wrote.

use kv_core::{
    BlockHash, BlockRemoved, BlockStored, EngineHash, EngineKey, EngineKeyState, EventBatch,
    IndexConfig, Indexer, IndexerSettings, KvEvent, Medium, ModelSettings, SplitMix64, Tier,
    TokenProcessor, TokenProcessorConfig,
};

const MODEL: &str = "m";
/// Writer lanes of the indexers a snapshot moves between.
const LANES: [usize; 2] = [1, 3];

fn processor_config() -> TokenProcessorConfig {
    TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        block_size: 16,
        ..Default::default()
    }
}

fn indexer(lanes: usize) -> Indexer {
    Indexer::new(IndexerSettings {
        default_model: ModelSettings {
            token_processor: processor_config(),
            ..Default::default()
        },
        index: IndexConfig {
            writer_lanes: lanes,
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid")
}

/// Prompts sharing prefixes: 3 trunks of 4 blocks, 3 branches each of 2-7 more blocks.
fn prompts(rng: &mut SplitMix64) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for trunk in 0..3u32 {
        let stem: Vec<u32> = (0..64).map(|i| trunk * 1000 + i).collect();
        for branch in 0..3u32 {
            let mut p = stem.clone();
            let extra = 32 * (1 + rng.below(3) as u32);
            p.extend((0..extra).map(|i| 50_000 + trunk * 5000 + branch * 500 + i));
            out.push(p);
        }
    }
    out
}

/// The hash an engine publishes for its block `j`: the index's key (blocks of 16), or,
/// `translated`, an opaque function of its content's key (blocks of 32).
fn published(keys: &[BlockHash], j: usize, translated: bool) -> EngineHash {
    if translated {
        EngineHash::new(kv_core::mix64(keys[2 * j + 1].get() ^ 0xE17))
    } else {
        EngineHash::aligned(keys[j])
    }
}

/// A store of blocks `a .. b` of `tokens` by an engine whose hashes are the index's keys
/// (blocks of 16), or, `translated`, opaque hashes of blocks of 32 (then `a` and `b` count
/// blocks of 32).
fn stored(
    keys: &[BlockHash],
    tokens: &[u32],
    (a, b): (usize, usize),
    translated: bool,
    medium: Medium,
) -> KvEvent {
    let size = if translated { 32 } else { 16 };
    let hash = |j: usize| published(keys, j, translated);
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: (a..b).map(&hash).collect(),
        parent_block_hash: a.checked_sub(1).map(&hash),
        token_ids: tokens[a * size..b * size].to_vec(),
        block_size: size as u32,
        medium: Some(medium),
        ..Default::default()
    }))
}

/// Six aligned pods and one translated pod store, evict (holes) and clear, in GPU and CPU:
/// the prompts, and the batches with the pod that publishes each.
fn stream(seed: u64) -> (Vec<Vec<u32>>, Vec<(String, EventBatch)>) {
    let mut rng = SplitMix64::new(seed);
    let prompts = prompts(&mut rng);
    let processor = TokenProcessor::new(&processor_config()).expect("valid");
    let keys: Vec<Vec<BlockHash>> = prompts
        .iter()
        .map(|p| processor.block_hashes(p, &Default::default()))
        .collect();
    let mut batches = Vec::new();
    for step in 0..200 {
        let pod = rng.below(7) as usize;
        let translated = pod == 6;
        let p = rng.below(prompts.len() as u64) as usize;
        let blocks = prompts[p].len() / if translated { 32 } else { 16 };
        let medium = if rng.below(4) == 0 {
            Medium::Cpu
        } else {
            Medium::Gpu
        };
        let roll = rng.below(100);
        let event = if roll < 60 {
            let a = rng.below(blocks as u64 / 2) as usize;
            // A store continues a chain the pod stored before, or starts at the root.
            let a = if rng.below(2) == 0 { 0 } else { a };
            stored(&keys[p], &prompts[p], (a, blocks), translated, medium)
        } else if roll < 97 {
            let j = rng.below(blocks as u64) as usize;
            let hash = published(&keys[p], j, translated);
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![hash],
                medium: Some(medium),
                ..Default::default()
            })
        } else {
            KvEvent::AllBlocksCleared
        };
        let batch = EventBatch {
            ts: step as f64,
            events: vec![event],
            data_parallel_rank: Some(0),
        };
        batches.push((format!("pod{pod}"), batch));
    }
    (prompts, batches)
}

fn apply(ix: &Indexer, batches: &[(String, EventBatch)]) {
    for (pod, batch) in batches {
        ix.apply_batch(MODEL, pod, batch).expect("applies");
    }
}

/// Applies [`stream`] to `ix`; returns the prompts.
fn fill(ix: &Indexer, seed: u64) -> Vec<Vec<u32>> {
    let (prompts, batches) = stream(seed);
    apply(ix, &batches);
    prompts
}

/// What a snapshot carries: every engine's blocks, and the key states of decided engines.
type Snapshot = (
    Vec<(String, EngineKey, Vec<(BlockHash, Tier)>)>,
    Vec<(String, EngineKey, EngineKeyState)>,
);

fn export(ix: &Indexer) -> Snapshot {
    let mut blocks = Vec::new();
    ix.export_each(|model, key, held| blocks.push((model.to_string(), key.clone(), held.to_vec())));
    let mut keys = Vec::new();
    ix.export_keys_each(|model, key, state| {
        keys.push((model.to_string(), key.clone(), state.clone()));
    });
    (blocks, keys)
}

fn restore(ix: &Indexer, (blocks, keys): &Snapshot) {
    for (model, key, held) in blocks {
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Storage, Tier::Other] {
            let hashes: Vec<BlockHash> = held
                .iter()
                .filter(|(_, t)| *t == tier)
                .map(|(h, _)| *h)
                .collect();
            if !hashes.is_empty() {
                ix.import(model, key, tier, &hashes).expect("imports");
            }
        }
    }
    for (model, key, state) in keys {
        ix.import_keys(model, key, state.clone())
            .expect("imports keys");
    }
}

/// Every prompt prefix's scores over every pod, named (scores to 1e-6: the order tiers are
/// summed in may differ).
fn answers(ix: &Indexer, prompts: &[Vec<u32>]) -> Vec<Vec<(String, u32, u64)>> {
    let pods: Vec<String> = (0..7).map(|p| format!("pod{p}")).collect();
    let mut out = Vec::new();
    for p in prompts {
        for len in (16..=p.len()).step_by(48) {
            let r = ix
                .score_tokens(MODEL, &p[..len], &pods, None, None)
                .expect("known model");
            let mut named: Vec<(String, u32, u64)> = r
                .named()
                .map(|(pod, s)| {
                    (
                        pod.to_string(),
                        s.matched_blocks,
                        (s.score * 1e6).round() as u64,
                    )
                })
                .collect();
            named.sort();
            out.push(named);
        }
    }
    out
}

#[test]
fn a_snapshot_of_either_shape_restores_into_either_with_the_same_answers() {
    for seed in [1u64, 2, 3] {
        for from in LANES {
            let source = indexer(from);
            let prompts = fill(&source, seed);
            let want = answers(&source, &prompts);
            let held: usize = want.iter().flatten().map(|(_, m, _)| *m as usize).sum();
            assert!(held > 0, "seed {seed}: the stream leaves blocks to restore");
            let snapshot = export(&source);
            assert!(
                !snapshot.1.is_empty(),
                "seed {seed}: decided engines (translated pod6 among them) carry key state"
            );
            for to in LANES {
                let restored = indexer(to);
                restore(&restored, &snapshot);
                assert_eq!(
                    answers(&restored, &prompts),
                    want,
                    "seed {seed}: {from:?} restored into {to:?}"
                );
                let memberships = |ix: &Indexer| ix.stats()[0].1.memberships;
                assert_eq!(
                    memberships(&restored),
                    memberships(&source),
                    "seed {seed}: {from:?} into {to:?}"
                );
            }
        }
    }
}

/// Everything a restore must reproduce, in a canonical order: each engine's blocks with their
/// tiers, and each decided engine's key state (its map in the order the budget takes entries
/// back, its second copies).
fn state(ix: &Indexer) -> Snapshot {
    let (mut blocks, mut keys) = export(ix);
    for (_, _, held) in &mut blocks {
        held.sort_by_key(|(h, t)| (h.get(), *t as u8));
    }
    blocks.retain(|(_, _, held)| !held.is_empty());
    blocks.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    for (_, _, state) in &mut keys {
        state
            .copies
            .sort_by_key(|(h, t, n)| (h.get(), *t as u8, *n));
    }
    keys.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    (blocks, keys)
}

/// A replica that restored a snapshot taken part-way and applied the rest of the stream (the
/// log after the snapshot's position) against one that applied the whole stream.
fn restored_then_replayed(
    batches: &[(String, EventBatch)],
    cut: usize,
    lanes: usize,
    corrupt: impl FnOnce(&mut Snapshot),
) -> Indexer {
    let before = indexer(lanes);
    apply(&before, &batches[..cut]);
    let mut snapshot = export(&before);
    corrupt(&mut snapshot);
    let after = indexer(lanes);
    restore(&after, &snapshot);
    apply(&after, &batches[cut..]);
    after
}

#[test]
fn a_restored_replica_that_replays_the_rest_holds_what_the_one_that_heard_it_all_holds() {
    for seed in [11u64, 12, 13, 14] {
        let (prompts, batches) = stream(seed);
        for lanes in LANES {
            let heard = indexer(lanes);
            apply(&heard, &batches);
            let want = state(&heard);
            let mut mapped_at_cuts = 0;
            for cut in [batches.len() / 4, batches.len() / 2, 3 * batches.len() / 4] {
                let removals_after = batches[cut..]
                    .iter()
                    .filter(|(pod, b)| {
                        pod == "pod6" && matches!(b.events[0], KvEvent::BlockRemoved(_))
                    })
                    .count();
                assert!(removals_after > 0, "seed {seed}: removals after the cut");
                let restored = restored_then_replayed(&batches, cut, lanes, |snapshot| {
                    mapped_at_cuts += usize::from(
                        snapshot
                            .1
                            .iter()
                            .any(|(_, k, s)| &*k.pod == "pod6" && !s.translated.is_empty()),
                    );
                });
                assert!(
                    state(&restored) == want,
                    "seed {seed}, {lanes} lanes, cut at {cut}: the restored replica differs"
                );
                assert_eq!(answers(&restored, &prompts), answers(&heard, &prompts));
            }
            assert!(
                mapped_at_cuts > 0,
                "seed {seed}: the translated pod's map was restored at some cut"
            );
        }
    }
}

/// The negative control: the comparison above sees a snapshot whose translated block holds
/// one copy too many (an import that restored copies wrong would look like this).
#[test]
fn a_restore_with_a_wrong_translated_copy_count_is_told_apart() {
    let (_, batches) = stream(11);
    let heard = indexer(1);
    apply(&heard, &batches);
    let want = state(&heard);
    let mut differed = 0;
    // The last cut restores with nothing replayed after it (a later clear may hide the
    // corruption at earlier cuts: the engine's cache was dropped anyway).
    for cut in [batches.len() / 2, 3 * batches.len() / 4, batches.len()] {
        let mut corrupted = false;
        let restored = restored_then_replayed(&batches, cut, 1, |snapshot| {
            let pod6 = snapshot.1.iter_mut().find(|(_, k, _)| &*k.pod == "pod6");
            let entry = pod6.and_then(|(_, _, s)| s.translated.first_mut());
            if let Some(held) = entry.and_then(|e| e.copies.iter_mut().find(|c| **c > 0)) {
                *held += 1;
                corrupted = true;
            }
        });
        if corrupted {
            differed += usize::from(state(&restored) != want);
        }
    }
    assert!(
        differed > 0,
        "a corrupted restore went unnoticed at every cut"
    );
}
