//! Speculative entries through the indexer's front door: a recorded routing makes the pod
//! score as holding the prompt before its events arrive, its `BlockStored` confirms it, its
//! deadline ends it, and a pod without events is scored by its records alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{
    BlockHash, BlockStored, EngineHash, EventBatch, IndexConfig, Indexer, IndexerSettings, KvEvent,
    PodRef, RoutingRecorded, ScoreResult, SpeculationSettings, ALL_PODS,
};

const MODEL: &str = "m";

/// One indexer with one writer lane, one with three (speculative entries live beside either).
fn indexers(weight: f64) -> [Indexer; 2] {
    [1, 3].map(|lanes| indexer_on(lanes, weight))
}

fn indexer_on(lanes: usize, weight: f64) -> Indexer {
    let indexer = Indexer::new(IndexerSettings {
        index: IndexConfig {
            writer_lanes: lanes,
            ..Default::default()
        },
        speculation: SpeculationSettings {
            ttl: Duration::from_millis(200),
            weight,
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("settings");
    indexer.model_or_create(MODEL).expect("model");
    indexer
}

/// A prompt of `n` blocks whose chain starts with `first`.
fn prompt(first: u64, n: u64) -> Arc<[BlockHash]> {
    (0..n).map(|i| BlockHash::new(first * 1_000 + i)).collect()
}

fn stored(hashes: &[BlockHash]) -> EventBatch {
    EventBatch {
        ts: 1.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
            block_size: 16,
            ..Default::default()
        }))],
        data_parallel_rank: None,
    }
}

/// (matched, speculative, score) of `pod`, `None` when not listed.
fn of(result: &ScoreResult, pod: &str) -> Option<(u32, u32, f64)> {
    result
        .named()
        .find(|(name, _)| *name == pod)
        .map(|(_, s)| (s.matched_blocks, s.speculative_blocks, s.score))
}

#[test]
fn a_recorded_routing_scores_until_its_events_confirm_it() {
    for ix in indexers(1.0) {
        let p = prompt(1, 10);
        ix.apply_batch(MODEL, "a", &stored(&p[..4])).expect("apply");
        ix.apply_batch(MODEL, "b", &stored(&prompt(9, 3)))
            .expect("apply");
        let before = ix.score_hashes(MODEL, &p, ALL_PODS).expect("score");
        assert_eq!(of(&before, "a"), Some((4, 0, 4.0)));
        assert_eq!(of(&before, "b"), Some((0, 0, 0.0)));

        // The gateway sends the prompt to b: six more blocks than a holds, all speculative.
        let t = Instant::now();
        assert_eq!(
            ix.record_routing(MODEL, "b", 0, p.clone(), t)
                .expect("record"),
            RoutingRecorded::Speculated(10)
        );
        let after = ix.score_hashes(MODEL, &p, ALL_PODS).expect("score");
        assert_eq!(of(&after, "b"), Some((10, 10, 10.0)));
        assert_eq!(
            after.named().next().map(|(n, _)| n),
            Some("b"),
            "b ranks first"
        );
        // Recorded for a, only what a does not hold is speculative.
        assert_eq!(
            ix.record_routing(MODEL, "a", 0, p.clone(), t)
                .expect("record"),
            RoutingRecorded::Speculated(6)
        );
        let both = ix.score_hashes(MODEL, &p, &["a"]).expect("score");
        assert_eq!(of(&both, "a"), Some((10, 6, 10.0)));

        // b's events arrive: confirmed, its entries are real now.
        ix.apply_batch(MODEL, "b", &stored(&p)).expect("apply");
        let model = ix.model(MODEL).expect("model");
        assert_eq!(model.speculation_of("b").map(|s| s.records), Some(0));
        let confirmed = ix.score_hashes(MODEL, &p, &["b"]).expect("score");
        assert_eq!(of(&confirmed, "b"), Some((10, 0, 10.0)));
        assert_eq!(model.speculation_ends()[0], 1, "one confirmed");

        // a never stores the rest: after its deadline, only its real 4 blocks remain.
        assert_eq!(ix.expire_speculation(t + Duration::from_millis(100)), 0);
        assert_eq!(ix.expire_speculation(t + Duration::from_millis(250)), 1);
        let expired = ix.score_hashes(MODEL, &p, &["a"]).expect("score");
        assert_eq!(of(&expired, "a"), Some((4, 0, 4.0)));
        assert_eq!(model.speculation_stats().entries, 0);
    }
}

#[test]
fn the_speculative_weight_scales_only_the_speculative_blocks() {
    for ix in indexers(0.5) {
        let p = prompt(1, 8);
        ix.apply_batch(MODEL, "a", &stored(&p[..2])).expect("apply");
        ix.record_routing(MODEL, "a", 0, p.clone(), Instant::now())
            .expect("record");
        let r = ix.score_hashes(MODEL, &p, &["a"]).expect("score");
        assert_eq!(of(&r, "a"), Some((8, 6, 2.0 + 0.5 * 6.0)));
        // A prompt sharing only the first 3 blocks: 2 real + 1 speculative.
        let mut other = p[..3].to_vec();
        other.extend(prompt(5, 4).iter());
        let r = ix.score_hashes(MODEL, &other, &["a"]).expect("score");
        assert_eq!(of(&r, "a"), Some((3, 1, 2.5)));
    }
}

#[test]
fn a_pod_without_events_is_scored_by_its_records_alone() {
    for ix in indexers(1.0) {
        let p = prompt(1, 6);
        let t = Instant::now();
        assert_eq!(
            ix.record_routing(MODEL, "silent", 0, p.clone(), t)
                .expect("record"),
            RoutingRecorded::Speculated(6)
        );
        let model = ix.model(MODEL).expect("model");
        assert!(model.speculation_fallback("silent"));
        let s = model.speculation_of("silent").expect("records");
        assert!(s.fallback && s.ttl.is_none(), "{s:?}");
        // Named as a candidate, or listed among every pod.
        for result in [
            ix.score_hashes(MODEL, &p, &["silent", "nobody"])
                .expect("score"),
            ix.score_hashes(MODEL, &p, ALL_PODS).expect("score"),
        ] {
            assert_eq!(of(&result, "silent"), Some((6, 6, 6.0)));
            assert!(matches!(result.scores[0].pod, PodRef::Speculative(_)));
        }
        // No deadline: still there long after the TTL.
        assert_eq!(ix.expire_speculation(t + Duration::from_secs(3600)), 0);
        assert_eq!(model.speculation_stats().fallback_pods, 1);
        assert_eq!(model.speculative_pods(), vec![Arc::<str>::from("silent")]);
        // Forgetting the pod drops its records.
        ix.remove_pod(MODEL, "silent");
        assert!(model.speculative_pods().is_empty());
        let r = ix.score_hashes(MODEL, &p, &["silent"]).expect("score");
        assert_eq!(of(&r, "silent"), Some((0, 0, 0.0)));
    }
}

/// A `BlockStored` of the first `blocks` engine blocks of `tokens`, an engine whose blocks
/// are `k` of the index's 16-token units: each engine block is keyed by the unit it ends on
/// (vLLM 0.24+), and its tokens let the index see that the keys are its own.
fn stored_blocks_of(ix: &Indexer, tokens: &[u32], k: usize, blocks: usize) -> EventBatch {
    let units = ix.block_hashes(MODEL, tokens, None, None).expect("hashes");
    let ends = units[..blocks * k]
        .chunks_exact(k)
        .map(|c| EngineHash::aligned(c[k - 1]))
        .collect();
    EventBatch {
        ts: 1.0,
        events: vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: ends,
            token_ids: tokens[..blocks * k * 16].to_vec(),
            block_size: 16 * k as u32,
            ..Default::default()
        }))],
        data_parallel_rank: None,
    }
}

#[test]
fn a_recorded_routing_counts_as_the_hit_the_engine_will_take() {
    for ix in indexers(1.0) {
        // Engines of 32-token blocks (two units each) hit in whole engine blocks.
        let tokens: Vec<u32> = (0..11 * 16).collect();
        let p: Arc<[BlockHash]> = ix
            .block_hashes(MODEL, &tokens, None, None)
            .expect("hashes")
            .into();
        let other: Vec<u32> = (5_000..5_064).collect();
        ix.apply_batch(MODEL, "a", &stored_blocks_of(&ix, &tokens, 2, 4))
            .expect("apply");
        ix.apply_batch(MODEL, "b", &stored_blocks_of(&ix, &other, 2, 2))
            .expect("apply");
        let real = ix.score_hashes(MODEL, &p, &["a"]).expect("score");
        assert_eq!(of(&real, "a"), Some((8, 0, 8.0)));

        // Nine units: a would hit the same 8 once it ran them, so nothing is recorded.
        let t = Instant::now();
        assert_eq!(
            ix.record_routing(MODEL, "a", 0, p[..9].to_vec().into(), t)
                .expect("record"),
            RoutingRecorded::AlreadyHeld
        );
        let model = ix.model(MODEL).expect("model");
        assert_eq!(model.speculation_of("a").map(|s| s.records), None);

        // Eleven units routed to b: it will hit five engine blocks (10 units), not 11.
        assert_eq!(
            ix.record_routing(MODEL, "b", 0, p.clone(), t)
                .expect("record"),
            RoutingRecorded::Speculated(11)
        );
        let spec = ix.score_hashes(MODEL, &p, &["a", "b"]).expect("score");
        assert_eq!(of(&spec, "b"), Some((10, 10, 10.0)));
        assert_eq!(of(&spec, "a"), Some((8, 0, 8.0)));
    }
}

#[test]
fn a_recorded_prompt_is_capped_like_a_real_one_at_its_last_token() {
    for ix in indexers(1.0) {
        // A prompt of exactly 6 blocks: vLLM computes its last token, so it reuses 5.
        let tokens: Vec<u32> = (0..96).collect();
        let p: Arc<[BlockHash]> = ix
            .block_hashes(MODEL, &tokens, None, None)
            .expect("hashes")
            .into();
        assert_eq!(p.len(), 6);
        ix.apply_batch(MODEL, "real", &stored(&p)).expect("apply");
        ix.apply_batch(MODEL, "routed", &stored(&prompt(9, 2)))
            .expect("apply");
        ix.record_routing(MODEL, "routed", 0, p.clone(), Instant::now())
            .expect("record");
        let r = ix
            .score_tokens(MODEL, &tokens, &["real", "routed"], None, None)
            .expect("score");
        assert_eq!(of(&r, "real"), Some((5, 0, 5.0)));
        assert_eq!(
            of(&r, "routed"),
            Some((5, 5, 5.0)),
            "speculative, capped alike"
        );
    }
}
