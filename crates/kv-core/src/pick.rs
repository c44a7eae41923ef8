//! The endpoint pick: which of a request's candidate pods serves it, scored as llm-d's default
//! scheduling profile scores them, with no I/O (the daemon's ext_proc endpoint picker and the
//! lab's simulator call the same function).
//!
//! The scorers are one list, [`SCORERS`]: each has its name (the key of its weight in the
//! config, `endpointPicker.weights`, and its place in the lab's `--weights`), its default
//! weight (llm-d's default profile, 3:2:2) and its input, and gives every candidate a value in
//! `[0, 1]`; a candidate's score is the values summed with the weights ([`PickWeights`]):
//! - `prefix`: the index's prefix score ([`Candidate::prefix_score`]), min-max normalised over
//!   the candidates (the best holder 1, the worst 0; all equal: 1 when they hold something,
//!   else 0), or, with [`PrefixNormalisation::AsGiven`], taken as a value already in `[0, 1]`
//!   (the lab's model of the gateway's approximate scorer, whose prefix value is a share of
//!   the prompt);
//! - `queue` (llm-d's `queue-scorer`): `(max - q) / (max - min)` over the candidates' waiting
//!   requests (`vllm:num_requests_waiting`); all equal: 1;
//! - `kvCacheUtilization` (llm-d's `kv-cache-utilization-scorer`): `1 - usage`
//!   (`vllm:kv_cache_usage_perc`, clamped to `[0, 1]`).
//!
//! Adding a scorer is one entry in [`SCORERS`] (a metric it reads that [`PodMetrics`] lacks is
//! a field there, filled by whoever scrapes); the config, its validation and the lab read the
//! list.
//!
//! Invariants:
//! - the metric scorers apply only when every candidate has metrics no older than
//!   [`PickSettings::max_metrics_age`]; otherwise the pick is the index's alone (the prefix
//!   scorer), and [`Pick::stale`] / [`Pick::missing`] count the candidates that caused it, so a
//!   pod whose scraper fails can neither win nor lose on numbers that are not current;
//! - the order is total and best first: the candidates are shuffled (the injected RNG), then
//!   sorted stably by score, so equals are ordered at random and a seed makes it repeatable;
//! - every candidate appears exactly once in [`Pick::order`] (the rest are the gateway's ordered
//!   fallbacks);
//! - bad input (no candidate, a weight that is negative or not finite, all weights zero, a
//!   score or metric input that is not finite) is a [`PickError`], never a panic; weights read
//!   from a config name scorers of the list, or are refused.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

use crate::SplitMix64;

/// What a scorer reads of a candidate, and how that becomes its value in `[0, 1]`.
#[derive(Clone, Copy)]
pub enum ScorerInput {
    /// The index's prefix score, normalised as [`PickSettings::prefix`] says.
    Prefix,
    /// A metric where less is better (a queue): `(max - v) / (max - min)` over the
    /// candidates; all equal: 1.
    Fewest(fn(&PodMetrics) -> f64),
    /// A share in use, 0 to 1: `1 - v` (clamped to `[0, 1]`).
    FreeShare(fn(&PodMetrics) -> f64),
}

/// One scorer of the pick.
#[derive(Clone, Copy)]
pub struct Scorer {
    /// Its name: its weight's key in the config (`endpointPicker.weights.<name>`).
    pub name: &'static str,
    /// Its weight in llm-d's default profile (the config's default).
    pub default_weight: f64,
    /// What it reads.
    pub input: ScorerInput,
}

/// How many scorers there are.
pub const SCORER_COUNT: usize = 3;

/// The scorers, in the order of [`PickWeights`]' and [`Ranked::values`]' entries and of the
/// lab's `--weights prefix:queue:kv`. Adding one here is all a new scorer needs.
pub const SCORERS: [Scorer; SCORER_COUNT] = [
    Scorer {
        name: "prefix",
        default_weight: 3.0,
        input: ScorerInput::Prefix,
    },
    Scorer {
        name: "queue",
        default_weight: 2.0,
        input: ScorerInput::Fewest(|m| m.waiting_requests),
    },
    Scorer {
        name: "kvCacheUtilization",
        default_weight: 2.0,
        input: ScorerInput::FreeShare(|m| m.kv_cache_usage),
    },
];

/// Where scorer `name` is in [`SCORERS`].
pub fn scorer_index(name: &str) -> Option<usize> {
    SCORERS.iter().position(|s| s.name == name)
}

/// The scorers' weights, one per entry of [`SCORERS`], in its order. Read from the config as a
/// map by scorer name (a scorer left out keeps its default weight; an unknown name is an
/// error), so the config has no shape of its own to keep in step with the list.
#[derive(Clone, Copy, PartialEq)]
pub struct PickWeights(pub [f64; SCORER_COUNT]);

impl PickWeights {
    /// llm-d's default profile (each scorer's [`Scorer::default_weight`]): prefix 3, queue 2,
    /// KV-cache utilisation 2.
    pub const LLM_D: PickWeights = {
        let mut w = [0.0; SCORER_COUNT];
        let mut i = 0;
        while i < SCORER_COUNT {
            w[i] = SCORERS[i].default_weight;
            i += 1;
        }
        PickWeights(w)
    };

    /// Every scorer weighed alike (the lab's head-to-head default).
    pub const EQUAL: PickWeights = PickWeights([1.0; SCORER_COUNT]);

    /// Scorer `name`'s weight (`None`: no such scorer).
    pub fn get(&self, name: &str) -> Option<f64> {
        scorer_index(name).map(|i| self.0[i])
    }

    /// These weights with scorer `name`'s set to `weight` (unchanged when there is no such
    /// scorer).
    pub fn with(mut self, name: &str, weight: f64) -> Self {
        if let Some(i) = scorer_index(name) {
            self.0[i] = weight;
        }
        self
    }

    /// Whether these weights can score: finite, non-negative and not all zero.
    pub fn check(&self) -> Result<(), PickError> {
        let w = &self.0;
        if w.iter().any(|w| !w.is_finite() || *w < 0.0) || w.iter().all(|w| *w == 0.0) {
            return Err(PickError::BadWeights(*self));
        }
        Ok(())
    }
}

impl Default for PickWeights {
    fn default() -> Self {
        Self::LLM_D
    }
}

impl fmt::Debug for PickWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(SCORERS.iter().map(|s| s.name).zip(self.0))
            .finish()
    }
}

impl Serialize for PickWeights {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(SCORERS.iter().map(|s| s.name).zip(self.0))
    }
}

impl<'de> Deserialize<'de> for PickWeights {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let given = BTreeMap::<String, f64>::deserialize(d)?;
        let mut w = Self::default();
        for (name, weight) in given {
            let i = scorer_index(&name).ok_or_else(|| {
                let names: Vec<&str> = SCORERS.iter().map(|s| s.name).collect();
                serde::de::Error::custom(format!(
                    "unknown scorer {name:?} (the scorers: {})",
                    names.join(", ")
                ))
            })?;
            w.0[i] = weight;
        }
        Ok(w)
    }
}

/// How the prefix scorer turns [`Candidate::prefix_score`] into its value in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixNormalisation {
    /// Min-max over the candidates, as llm-d's precise-prefix-cache scorer normalises the
    /// index's scores (the daemon's pick, and the default).
    #[default]
    MinMax,
    /// The score is already the scorer's value (clamped to `[0, 1]`), used as it is: e.g. the
    /// gateway's approximate `prefix-cache-scorer`, whose value is the matched share of the
    /// blocks it hashed. The daemon does not use it; the lab's simulator does, so that every
    /// scoring router it models shares this pick's queue and KV-cache scorers.
    AsGiven,
}

/// How a pick is made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickSettings {
    /// The scorers' weights.
    pub weights: PickWeights,
    /// Metrics older than this are stale: the pick falls back to the index alone.
    pub max_metrics_age: Duration,
    /// How the prefix scores become the prefix scorer's values (min-max by default).
    pub prefix: PrefixNormalisation,
}

impl Default for PickSettings {
    fn default() -> Self {
        Self {
            weights: PickWeights::default(),
            // Ten of GIE's 50 ms scrape intervals.
            max_metrics_age: Duration::from_millis(500),
            prefix: PrefixNormalisation::MinMax,
        }
    }
}

/// A pod's load, as its Prometheus endpoint last reported it (the metric scorers' inputs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodMetrics {
    /// Requests waiting (`vllm:num_requests_waiting`).
    pub waiting_requests: f64,
    /// Share of the KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
    /// How long ago they were read.
    pub age: Duration,
}

/// One pod (or one data-parallel rank of a pod) the request may go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The pod's name (`ip:port`, as vLLM's topic names it).
    pub pod: String,
    /// Its data-parallel rank, for a data-parallel pod.
    pub rank: Option<u32>,
    /// The index's prefix score for the prompt (tier-weighted blocks; 0 when it holds none).
    pub prefix_score: f64,
    /// Its load, when known.
    pub metrics: Option<PodMetrics>,
}

/// Why no pick was made.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PickError {
    /// There is nothing to pick from.
    #[error("no candidate to pick from")]
    NoCandidates,
    /// A weight is negative or not finite, or all are zero.
    #[error("pick weights must be finite, non-negative and not all zero: {0:?}")]
    BadWeights(PickWeights),
    /// A candidate's prefix score or metric is not a finite number.
    #[error("candidate {pod:?} has a score or metric that is not a finite number")]
    NotFinite {
        /// The candidate.
        pod: String,
    },
}

/// One candidate's place in a pick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    /// Its position in the candidates passed to [`pick`].
    pub candidate: usize,
    /// Its weighted total.
    pub score: f64,
    /// Each scorer's value, 0 to 1, in [`SCORERS`]' order (`None`: a metric scorer, not used
    /// because some candidate's metrics were stale or missing).
    pub values: [Option<f64>; SCORER_COUNT],
}

impl Ranked {
    /// Scorer `name`'s value (`None`: not used, or no such scorer).
    pub fn value(&self, name: &str) -> Option<f64> {
        scorer_index(name).and_then(|i| self.values[i])
    }
}

/// A pick: every candidate, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// The candidates, best first (the first is the pick, the others its fallbacks).
    pub order: Vec<Ranked>,
    /// Whether the metric scorers were used (every candidate had fresh metrics).
    pub metrics_used: bool,
    /// Candidates whose metrics were older than `max_metrics_age`.
    pub stale: usize,
    /// Candidates without metrics.
    pub missing: usize,
}

impl Pick {
    /// The winner's position in the candidates.
    pub fn best(&self) -> Option<usize> {
        self.order.first().map(|r| r.candidate)
    }
}

/// `(v - min) / (max - min)` for each value, or `when_equal` for all when they are equal.
fn min_max(values: impl Iterator<Item = f64> + Clone, when_equal: f64) -> Vec<f64> {
    let (min, max) = values
        .clone()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let span = max - min;
    values
        .map(|v| {
            if span > 0.0 {
                (v - min) / span
            } else {
                when_equal
            }
        })
        .collect()
}

/// Whether a candidate's inputs are all finite numbers: its prefix score and every metric a
/// scorer reads.
fn finite_inputs(c: &Candidate) -> bool {
    c.prefix_score.is_finite()
        && SCORERS.iter().all(|s| match (s.input, c.metrics) {
            (ScorerInput::Fewest(f) | ScorerInput::FreeShare(f), Some(m)) => f(&m).is_finite(),
            _ => true,
        })
}

/// One scorer's values for `candidates`, in their order (`None`: a metric scorer while the
/// metrics are not used).
fn values_of(
    scorer: &Scorer,
    candidates: &[Candidate],
    settings: &PickSettings,
    metrics_used: bool,
) -> Vec<Option<f64>> {
    let metrics = || candidates.iter().filter_map(|c| c.metrics);
    let values = match scorer.input {
        ScorerInput::Prefix => {
            let scores = candidates.iter().map(|c| c.prefix_score);
            match settings.prefix {
                PrefixNormalisation::MinMax => {
                    let top = scores.clone().fold(f64::NEG_INFINITY, f64::max);
                    min_max(scores, if top > 0.0 { 1.0 } else { 0.0 })
                }
                PrefixNormalisation::AsGiven => scores.map(|s| s.clamp(0.0, 1.0)).collect(),
            }
        }
        _ if !metrics_used => return vec![None; candidates.len()],
        // The negated metric min-max normalised: the least gets 1.
        ScorerInput::Fewest(f) => min_max(metrics().map(|m| -f(&m)), 1.0),
        ScorerInput::FreeShare(f) => metrics().map(|m| 1.0 - f(&m).clamp(0.0, 1.0)).collect(),
    };
    values.into_iter().map(Some).collect()
}

/// Orders `candidates` best first (see the module doc for the scorers and the invariants);
/// `rng` breaks ties.
pub fn pick(
    candidates: &[Candidate],
    settings: &PickSettings,
    rng: &mut SplitMix64,
) -> Result<Pick, PickError> {
    if candidates.is_empty() {
        return Err(PickError::NoCandidates);
    }
    let w = settings.weights;
    w.check()?;
    if let Some(c) = candidates.iter().find(|c| !finite_inputs(c)) {
        return Err(PickError::NotFinite { pod: c.pod.clone() });
    }
    let missing = candidates.iter().filter(|c| c.metrics.is_none()).count();
    let stale = candidates
        .iter()
        .filter(|c| c.metrics.is_some_and(|m| m.age > settings.max_metrics_age))
        .count();
    let metrics_used = missing == 0 && stale == 0;
    let columns: Vec<Vec<Option<f64>>> = SCORERS
        .iter()
        .map(|s| values_of(s, candidates, settings, metrics_used))
        .collect();
    let mut order: Vec<Ranked> = (0..candidates.len())
        .map(|i| {
            let values: [Option<f64>; SCORER_COUNT] = std::array::from_fn(|s| columns[s][i]);
            let score = values
                .iter()
                .zip(w.0)
                .fold(0.0, |sum, (v, w)| sum + v.map_or(0.0, |v| w * v));
            Ranked {
                candidate: i,
                score,
                values,
            }
        })
        .collect();
    // Fisher-Yates, then a stable sort: equals keep the random order.
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(Pick {
        order,
        metrics_used,
        stale,
        missing,
    })
}

#[cfg(test)]
mod tests {
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
    fn stale_or_missing_metrics_fall_back_to_the_index_and_are_counted() {
        let old = Some(PodMetrics {
            waiting_requests: 0.0,
            kv_cache_usage: 0.0,
            age: Duration::from_secs(5),
        });
        // With fresh metrics the idle pod a would win (as above); one stale pod makes the pick
        // the index's alone, and b holds the prompt.
        let c = [cand("a", 0.0, old), cand("b", 10.0, fresh(10.0, 1.0))];
        let p = run(&c);
        assert_eq!(pods(&p, &c), ["b", "a"]);
        assert!(!p.metrics_used);
        assert_eq!((p.stale, p.missing), (1, 0));
        assert_eq!(p.order[0].value("queue"), None);
        let c = [cand("a", 0.0, None), cand("b", 10.0, fresh(10.0, 1.0))];
        let p = run(&c);
        assert_eq!(pods(&p, &c), ["b", "a"]);
        assert_eq!((p.stale, p.missing), (0, 1));
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
}
