//! The routers' unit tests (their own file: routers.rs stays under 700 lines).

use super::*;
use kv_core::IndexerSettings;

/// Four pods: pod 2 is loaded (waiting 6, KV 90% used), the others alike (waiting 1, 10%).
fn metrics() -> Vec<PodMetrics> {
    (0..4)
        .map(|p| PodMetrics {
            waiting: if p == 2 { 6 } else { 1 },
            running: 1,
            kv_usage: if p == 2 { 0.9 } else { 0.1 },
            num_gpu_blocks: 1_000,
        })
        .collect()
}

/// What the daemon's pick makes of these pods with `prefix`, scraped 20 ms ago.
fn daemon_pick(prefix: &[f64], settings: &PickSettings, rng: &mut SplitMix64) -> usize {
    let candidates: Vec<Candidate> = metrics()
        .iter()
        .zip(prefix)
        .enumerate()
        .map(|(p, (m, &prefix_score))| Candidate {
            pod: format!("pod-{p}"),
            rank: None,
            prefix_score,
            metrics: Some(kv_core::PodMetrics {
                waiting_requests: m.waiting as f64,
                kv_cache_usage: m.kv_usage,
                age: Duration::from_millis(20),
            }),
        })
        .collect();
    kv_core::pick(&candidates, settings, rng)
        .ok()
        .and_then(|p| p.best())
        .unwrap_or(usize::MAX)
}

#[test]
fn the_scoring_routers_pick_with_the_daemons_pick_and_its_seeded_ties() {
    let indexer = Indexer::new(IndexerSettings::default()).expect("default settings");
    let names: Vec<String> = (0..4).map(|p| format!("pod-{p}")).collect();
    // The pods' first (empty) batches make the model and the pods known to the index.
    for name in &names {
        let batch = kv_core::EventBatch {
            ts: 0.0,
            events: vec![kv_core::KvEvent::AllBlocksCleared],
            data_parallel_rank: Some(0),
        };
        indexer.apply_batch("m", name, &batch).expect("applied");
    }
    let scraped = metrics();
    let in_flight = [0usize; 4];
    let instant = Instant::now();
    let ctx = RouterContext {
        now_ms: 120.0,
        instant,
        in_flight: &in_flight,
        scraped: &scraped,
        scraped_ms: 100.0,
        scrape_interval_ms: 50.0,
        indexer: &indexer,
        model: "m",
        pod_names: &names,
        candidates: &[0, 1, 2, 3],
        score_before_last_token: false,
    };
    let blocks: Vec<BlockHash> = (1..=8u64).map(|h| BlockHash::new(h * 2 + 1)).collect();
    let req = SimRequest {
        arrival_ms: 120.0,
        blocks: blocks.clone(),
        output_blocks: Vec::new(),
        prompt_tokens: 8 * 16,
        output_tokens: 1,
    };
    // Pod 2 holds the prompt (a speculative entry) but is loaded: at 3:2:2 it scores
    // 3 + 0 + 0.2, the others 0 + 2 + 1.8 each, a three-way tie the seed breaks.
    let held: Arc<[BlockHash]> = blocks.as_slice().into();
    indexer
        .record_routing("m", "pod-2", 0, held, instant)
        .expect("recorded");
    let llm_d = PickSettings {
        weights: Weights::LLM_D_PRECISE.into(),
        ..PickSettings::default()
    };
    let mut winners = std::collections::BTreeSet::new();
    for seed in 0..32 {
        let mut precise = Precise::new(Weights::LLM_D_PRECISE, false, seed);
        let chosen = precise.route(&req, &ctx);
        let raw = [0.0, 0.0, 8.0, 0.0];
        let expected = daemon_pick(&raw, &llm_d, &mut crate::simulate::rng(seed ^ 0x9E_C1));
        assert_eq!(chosen, expected, "seed {seed}");
        assert_eq!(
            Precise::new(Weights::LLM_D_PRECISE, false, seed).route(&req, &ctx),
            chosen
        );
        winners.insert(chosen);
    }
    assert_eq!(
        winners.into_iter().collect::<Vec<_>>(),
        [0, 1, 3],
        "the tie goes to each of the three, never to the loaded holder"
    );
    // Negative control: unloaded, the holder wins under every seed.
    let calm: Vec<PodMetrics> = metrics()
        .into_iter()
        .map(|m| PodMetrics {
            waiting: 1,
            kv_usage: 0.1,
            ..m
        })
        .collect();
    let calm_ctx = RouterContext {
        scraped: &calm,
        ..ctx
    };
    for seed in 0..8 {
        let mut precise = Precise::new(Weights::LLM_D_PRECISE, false, seed);
        assert_eq!(precise.route(&req, &calm_ctx), 2);
    }
    // The approximate router hands the pick its matched share as it is (no min-max): half
    // the prompt on pod 2 scores 0.5 + 0 + 0.1 at 1:1:1, under the others' 0 + 1 + 0.9.
    let mut approx = ApproxPrefix::new(CapacityGuess::Fixed(100), Weights::EQUAL, 5);
    let half = SimRequest {
        blocks: blocks[..4].to_vec(),
        ..req.clone()
    };
    approx.routed(&half, 2, &ctx);
    let equal = PickSettings {
        weights: Weights::EQUAL.into(),
        prefix: PrefixNormalisation::AsGiven,
        ..PickSettings::default()
    };
    let expected = daemon_pick(
        &[0.0, 0.0, 0.5, 0.0],
        &equal,
        &mut crate::simulate::rng(5 ^ 0xA9_9E),
    );
    assert_eq!(approx.route(&req, &ctx), expected);
    assert_ne!(expected, 2);
}

#[test]
fn prefix_scores_reach_the_pick_as_llm_d_normalises_them_over_the_pods_returned() {
    let raw = [0.0, 375.0, 450.0, 375.0];
    // kv-indexer returns every candidate: the raw scores, min-max normalised by the pick.
    assert_eq!(
        PrefixScore::MinMax.normalise(&raw, 450),
        (raw.to_vec(), PrefixNormalisation::MinMax)
    );
    // llm-d's indexer returns the holders only: the lowest holder scores as a pod holding
    // nothing; the values reach the pick as they are.
    assert_eq!(
        PrefixScore::MinMaxHolders.normalise(&raw, 450),
        (vec![0.0, 0.0, 1.0, 0.0], PrefixNormalisation::AsGiven)
    );
    // One holder, or equal holders: 1.0 each, however short their match.
    assert_eq!(
        PrefixScore::MinMaxHolders.normalise(&[0.0, 3.0], 450).0,
        [0.0, 1.0]
    );
    assert_eq!(
        PrefixScore::MinMaxHolders
            .normalise(&[2.0, 2.0, 0.0], 450)
            .0,
        [1.0, 1.0, 0.0]
    );
    assert_eq!(
        PrefixScore::MinMaxHolders.normalise(&[0.0, 0.0], 450).0,
        [0.0, 0.0]
    );
    // The share: blocks over prompt blocks, as it is.
    let (share, how) = PrefixScore::Share.normalise(&[0.0, 375.0], 450);
    assert_eq!(
        (share[1], how),
        (375.0 / 450.0, PrefixNormalisation::AsGiven)
    );
    for (name, form) in PrefixScore::NAMES {
        assert_eq!(PrefixScore::parse(name), Some(form));
        assert_eq!(form.name(), name);
    }
    assert_eq!(PrefixScore::parse("minmax"), None);
}
