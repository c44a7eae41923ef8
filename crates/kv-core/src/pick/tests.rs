//! The pick's scorers, weights, order and refusals.

use super::*;

fn fresh(waiting: f64, usage: f64) -> Option<PodMetrics> {
    Some(PodMetrics {
        waiting_requests: waiting,
        kv_cache_usage: usage,
        age: Duration::from_millis(10),
    })
}

fn cand(pod: &str, prefix: f64, metrics: Option<PodMetrics>) -> Candidate {
    Candidate {
        pod: pod.into(),
        rank: None,
        prefix_score: prefix,
        metrics,
    }
}

fn pods(p: &Pick, c: &[Candidate]) -> Vec<String> {
    p.order.iter().map(|r| c[r.candidate].pod.clone()).collect()
}

fn run(c: &[Candidate]) -> Pick {
    let pick = pick(c, &PickSettings::default(), &mut SplitMix64::new(7));
    pick.unwrap_or_else(|e| panic!("pick failed: {e}"))
}

#[test]
fn the_prefix_holder_wins_when_loads_are_equal() {
    let c = [
        cand("a", 0.0, fresh(1.0, 0.5)),
        cand("b", 12.0, fresh(1.0, 0.5)),
        cand("c", 4.0, fresh(1.0, 0.5)),
    ];
    let p = run(&c);
    assert_eq!(pods(&p, &c), ["b", "c", "a"]);
    assert!(p.metrics_used);
    // b: 3 * 1 + 2 * 1 + 2 * 0.5.
    assert!((p.order[0].score - 6.0).abs() < 1e-9, "{:?}", p.order[0]);
    assert!((p.order[1].value("prefix").unwrap_or(0.0) - 1.0 / 3.0).abs() < 1e-9);
}

#[test]
fn a_deep_queue_loses_a_prefix_tie() {
    let c = [
        cand("deep", 8.0, fresh(40.0, 0.2)),
        cand("short", 8.0, fresh(0.0, 0.2)),
    ];
    for seed in 0..32 {
        let p = pick(&c, &PickSettings::default(), &mut SplitMix64::new(seed))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pods(&p, &c), ["short", "deep"], "seed {seed}");
        assert_eq!(p.order[0].value("queue"), Some(1.0));
        assert_eq!(p.order[1].value("queue"), Some(0.0));
    }
}

#[test]
fn a_full_kv_cache_loses_a_tie() {
    let c = [
        cand("full", 8.0, fresh(0.0, 0.95)),
        cand("empty", 8.0, fresh(0.0, 0.05)),
    ];
    assert_eq!(pods(&run(&c), &c), ["empty", "full"]);
}

#[test]
fn weights_trade_prefix_against_load() {
    // b holds the prompt but is loaded; a is idle and holds nothing.
    let c = [
        cand("a", 0.0, fresh(0.0, 0.0)),
        cand("b", 10.0, fresh(10.0, 1.0)),
    ];
    // 3:2:2: a = 0 + 2 + 2 = 4 beats b = 3.
    assert_eq!(pods(&run(&c), &c), ["a", "b"]);
    // Negative control: with the prefix weighted 5, b = 5 beats a = 4.
    let heavy = PickSettings {
        weights: PickWeights::default().with("prefix", 5.0),
        ..PickSettings::default()
    };
    let p = pick(&c, &heavy, &mut SplitMix64::new(1)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pods(&p, &c), ["b", "a"]);
}

#[test]
fn stale_or_missing_metrics_are_scored_as_the_fresh_median_and_counted() {
    let old = Some(PodMetrics {
        waiting_requests: 0.0,
        kv_cache_usage: 0.0,
        age: Duration::from_secs(5),
    });
    // a's stale sample says idle, and would win if trusted; it is scored as the median of b
    // and c instead (5 waiting, half the cache), so the idle c wins and a is between.
    let c = [
        cand("a", 0.0, old),
        cand("b", 0.0, fresh(10.0, 0.9)),
        cand("c", 0.0, fresh(0.0, 0.1)),
    ];
    let p = run(&c);
    assert_eq!(pods(&p, &c), ["c", "a", "b"]);
    assert!(p.metrics_used);
    assert_eq!((p.stale, p.missing), (1, 0));
    let a = p
        .order
        .iter()
        .find(|r| r.candidate == 0)
        .map(|r| r.value("queue"));
    assert_eq!(a, Some(Some(0.5)), "the median is halfway");
    // One pod never read does not turn load off for the others: the idle one of the two read
    // still beats the busy one, whatever the tie-break seed.
    let c = [
        cand("new", 0.0, None),
        cand("busy", 0.0, fresh(10.0, 0.9)),
        cand("idle", 0.0, fresh(0.0, 0.1)),
    ];
    for seed in 0..16 {
        let p = pick(&c, &PickSettings::default(), &mut SplitMix64::new(seed))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pods(&p, &c), ["idle", "new", "busy"], "seed {seed}");
        assert_eq!((p.stale, p.missing), (0, 1));
    }
}

#[test]
fn with_no_fresh_metrics_the_pick_is_the_index_s_alone() {
    let c = [cand("a", 0.0, None), cand("b", 10.0, None)];
    let p = run(&c);
    assert_eq!(pods(&p, &c), ["b", "a"]);
    assert!(!p.metrics_used);
    assert_eq!((p.stale, p.missing), (0, 2));
    assert_eq!(p.order[0].value("queue"), None);
}

#[test]
fn ties_are_broken_at_random_and_a_seed_repeats() {
    let c: Vec<Candidate> = (0..4)
        .map(|i| cand(&format!("p{i}"), 5.0, fresh(2.0, 0.3)))
        .collect();
    let mut winners = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let p = pick(&c, &PickSettings::default(), &mut SplitMix64::new(seed))
            .unwrap_or_else(|e| panic!("{e}"));
        winners.insert(p.best());
        let again = pick(&c, &PickSettings::default(), &mut SplitMix64::new(seed))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p, again, "seed {seed} repeats");
    }
    assert_eq!(winners.len(), 4, "every equal candidate wins sometimes");
    // Negative control: a strict winner wins under every seed.
    let mut c = c;
    c[2].prefix_score = 6.0;
    for seed in 0..64 {
        let p = pick(&c, &PickSettings::default(), &mut SplitMix64::new(seed))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.best(), Some(2));
    }
}

#[test]
fn every_candidate_is_listed_once() {
    let c: Vec<Candidate> = (0..9)
        .map(|i| cand(&format!("p{i}"), f64::from(i % 3), fresh(f64::from(i), 0.1)))
        .collect();
    let p = run(&c);
    let mut seen: Vec<usize> = p.order.iter().map(|r| r.candidate).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..9).collect::<Vec<_>>());
    assert!(p.order.windows(2).all(|w| w[0].score >= w[1].score));
}

#[test]
fn nothing_held_anywhere_gives_no_prefix_preference() {
    let c = [cand("a", 0.0, None), cand("b", 0.0, None)];
    let p = run(&c);
    assert!(p
        .order
        .iter()
        .all(|r| r.score == 0.0 && r.value("prefix") == Some(0.0)));
    let c = [cand("a", 3.0, None), cand("b", 3.0, None)];
    assert!(run(&c).order.iter().all(|r| r.value("prefix") == Some(1.0)));
}

#[test]
fn bad_input_is_an_error() {
    let s = PickSettings::default();
    let mut rng = SplitMix64::new(0);
    assert_eq!(pick(&[], &s, &mut rng), Err(PickError::NoCandidates));
    let c = [cand("a", f64::NAN, None)];
    assert!(matches!(
        pick(&c, &s, &mut rng),
        Err(PickError::NotFinite { .. })
    ));
    let c = [cand("a", 1.0, fresh(f64::INFINITY, 0.0))];
    assert!(matches!(
        pick(&c, &s, &mut rng),
        Err(PickError::NotFinite { .. })
    ));
    let c = [cand("a", 1.0, None)];
    for weights in [
        PickWeights::default().with("prefix", -1.0),
        PickWeights([0.0; SCORER_COUNT]),
        PickWeights::default().with("queue", f64::NAN),
    ] {
        let s = PickSettings {
            weights,
            ..PickSettings::default()
        };
        assert!(matches!(
            pick(&c, &s, &mut rng),
            Err(PickError::BadWeights(_))
        ));
    }
}

#[test]
fn a_prefix_given_as_a_share_is_used_as_it_is() {
    // Min-max would make 0.5 of 0.5 and 0.25 a full 1.0 against 0; as given it is 0.5
    // against 0.25, so the emptier queue of the shorter match wins (0.25 * 3 + 2 + 2 = 4.75
    // against 0.5 * 3 + 0 + 2 = 3.5).
    let c = [
        cand("long", 0.5, fresh(4.0, 0.0)),
        cand("short", 0.25, fresh(0.0, 0.0)),
    ];
    let given = PickSettings {
        prefix: PrefixNormalisation::AsGiven,
        ..PickSettings::default()
    };
    let p = pick(&c, &given, &mut SplitMix64::new(3)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pods(&p, &c), ["short", "long"]);
    assert_eq!(p.order[1].value("prefix"), Some(0.5));
    // Out of range is clamped, not trusted.
    let c = [cand("over", 7.0, None), cand("under", -1.0, None)];
    let p = pick(&c, &given, &mut SplitMix64::new(3)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (p.order[0].value("prefix"), p.order[1].value("prefix")),
        (Some(1.0), Some(0.0))
    );
    // Negative control: min-max (the default) gives the long match the full prefix weight,
    // 3 + 0 + 2 = 5 against 0 + 2 + 2 = 4.
    let c = [
        cand("long", 0.5, fresh(4.0, 0.0)),
        cand("short", 0.25, fresh(0.0, 0.0)),
    ];
    assert_eq!(pods(&run(&c), &c), ["long", "short"]);
}

#[test]
fn ranks_are_kept_with_their_candidate() {
    let c = [
        Candidate {
            rank: Some(3),
            ..cand("a", 9.0, None)
        },
        cand("b", 1.0, None),
    ];
    let p = run(&c);
    assert_eq!(c[p.order[0].candidate].rank, Some(3));
}

#[test]
fn weights_are_read_by_scorer_name_and_unknown_names_refused() {
    let w: PickWeights =
        serde_json::from_str(r#"{"queue": 1.5}"#).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.0, [3.0, 1.5, 2.0], "a scorer left out keeps its default");
    assert_eq!(w.get("queue"), Some(1.5));
    let all: PickWeights =
        serde_json::from_str(r#"{"prefix": 1, "queue": 0, "kvCacheUtilization": 4}"#)
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(all.0, [1.0, 0.0, 4.0]);
    let text = serde_json::to_string(&all).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        text,
        r#"{"prefix":1.0,"queue":0.0,"kvCacheUtilization":4.0}"#
    );
    assert_eq!(
        format!("{all:?}"),
        r#"{"prefix": 1.0, "queue": 0.0, "kvCacheUtilization": 4.0}"#
    );
    let bad = serde_json::from_str::<PickWeights>(r#"{"kv": 1}"#).map_err(|e| e.to_string());
    assert!(
        bad.as_ref()
            .is_err_and(|e| e.contains("unknown scorer \"kv\"")),
        "{bad:?}"
    );
    assert_eq!(PickWeights::default(), PickWeights::LLM_D);
    assert_eq!(PickWeights::LLM_D.0, [3.0, 2.0, 2.0]);
}

#[test]
fn each_scorer_of_the_list_is_its_value_times_its_weight() {
    let c = [
        cand("a", 2.0, fresh(3.0, 0.25)),
        cand("b", 6.0, fresh(1.0, 0.5)),
        cand("c", 4.0, fresh(5.0, 1.0)),
    ];
    for (i, scorer) in SCORERS.iter().enumerate() {
        let mut only = [0.0; SCORER_COUNT];
        only[i] = 2.0;
        let s = PickSettings {
            weights: PickWeights(only),
            ..PickSettings::default()
        };
        let p = pick(&c, &s, &mut SplitMix64::new(1)).unwrap_or_else(|e| panic!("{e}"));
        for r in &p.order {
            let v = r.value(scorer.name).unwrap_or(f64::NAN);
            assert!((0.0..=1.0).contains(&v), "{}: {v}", scorer.name);
            assert_eq!(r.score, 2.0 * v, "{}", scorer.name);
        }
        // Each scorer tells these candidates apart (b best on prefix and queue, a on KV).
        let best = c[p.best().unwrap_or(9)].pod.as_str();
        assert_eq!(best, ["b", "b", "a"][i], "{}", scorer.name);
    }
}
