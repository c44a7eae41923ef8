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
//! - a candidate whose metrics are missing or older than [`PickSettings::max_metrics_age`] is
//!   scored on load as the median of the fresh candidates' values (a new or slow-to-scrape pod
//!   is taken as average), per candidate: one pod's missing sample never turns load scoring off
//!   for the others, and it can neither win nor lose on numbers that are not current;
//!   [`Pick::stale`] / [`Pick::missing`] count those candidates; with no fresh candidate at all
//!   the metric scorers do not apply and the pick is the index's alone;
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
pub const fn scorer_index(name: &str) -> Option<usize> {
    let mut i = 0;
    while i < SCORER_COUNT {
        if str_eq(SCORERS[i].name, name) {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// `a == b`, in a `const fn` (weights built by name at compile time).
const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
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

    /// Every scorer weighed 0: a start for weights that name each scorer they use (`with`).
    pub const NONE: PickWeights = PickWeights([0.0; SCORER_COUNT]);

    /// Scorer `name`'s weight (`None`: no such scorer).
    pub fn get(&self, name: &str) -> Option<f64> {
        scorer_index(name).map(|i| self.0[i])
    }

    /// These weights with scorer `name`'s set to `weight` (unchanged when there is no such
    /// scorer).
    pub const fn with(mut self, name: &str, weight: f64) -> Self {
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
    /// Metrics older than this are stale: the candidate is scored on the fresh ones' median.
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
    /// because no candidate's metrics were fresh).
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
    /// Whether the metric scorers were used (some candidate had fresh metrics).
    pub metrics_used: bool,
    /// Candidates whose metrics were older than `max_metrics_age` (scored on the median).
    pub stale: usize,
    /// Candidates without metrics (scored on the median).
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

/// The median of `values` (`None`: no value), the mean of the middle two for an even count.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Each candidate's input to a metric scorer: its own metric when fresh, else the fresh
/// candidates' median (`None`: no candidate is fresh).
fn metric_inputs(
    f: fn(&PodMetrics) -> f64,
    candidates: &[Candidate],
    fresh: &[bool],
) -> Option<Vec<f64>> {
    let own = |i: usize| candidates[i].metrics.filter(|_| fresh[i]).map(|m| f(&m));
    let neutral = median((0..candidates.len()).filter_map(own).collect())?;
    Some(
        (0..candidates.len())
            .map(|i| own(i).unwrap_or(neutral))
            .collect(),
    )
}

/// One scorer's values for `candidates`, in their order (`None`: a metric scorer while no
/// candidate's metrics are fresh).
fn values_of(
    scorer: &Scorer,
    candidates: &[Candidate],
    settings: &PickSettings,
    fresh: &[bool],
) -> Vec<Option<f64>> {
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
        ScorerInput::Fewest(f) | ScorerInput::FreeShare(f) => {
            let Some(inputs) = metric_inputs(f, candidates, fresh) else {
                return vec![None; candidates.len()];
            };
            match scorer.input {
                // The negated metric min-max normalised: the least gets 1.
                ScorerInput::Fewest(_) => min_max(inputs.iter().map(|v| -v), 1.0),
                _ => inputs.iter().map(|v| 1.0 - v.clamp(0.0, 1.0)).collect(),
            }
        }
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
    let fresh: Vec<bool> = candidates
        .iter()
        .map(|c| c.metrics.is_some_and(|m| m.age <= settings.max_metrics_age))
        .collect();
    let missing = candidates.iter().filter(|c| c.metrics.is_none()).count();
    let stale = fresh.iter().filter(|f| !**f).count() - missing;
    let metrics_used = fresh.contains(&true);
    let columns: Vec<Vec<Option<f64>>> = SCORERS
        .iter()
        .map(|s| values_of(s, candidates, settings, &fresh))
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
mod tests;
