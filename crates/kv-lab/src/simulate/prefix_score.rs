//! How a precise router's raw index scores become the prefix scorer's value (llm-d's
//! precise-prefix-cache scorer's normalisations, and the share the lab used before).
//!
//! Invariants: every form gives values in `0..=1` for finite, non-negative raw scores, one per
//! pod, in the pods' order.

use kv_core::PrefixNormalisation;
use serde::Serialize;

/// How a precise router turns the indexer's raw scores (tier-weighted consecutive blocks, the
/// `score` of ScorePods) into the prefix scorer's value in `0..=1`.
///
/// llm-d's precise-prefix-cache scorer (`indexedScoresToNormalizedScoredPods` in
/// llm-d-inference-scheduler's `preciseprefixcache` package) normalises min-max over the pods
/// its indexer returned, 1.0 for each of them when their scores are equal, 0 for a pod not
/// returned. Which pods those are depends on the indexer: kv-indexer returns every candidate,
/// pods holding nothing included with 0 ([`PrefixScore::MinMax`]); llm-d's own indexer returns
/// only the pods holding the prompt's first block ([`PrefixScore::MinMaxHolders`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PrefixScore {
    /// Min-max over every candidate (llm-d's scorer on kv-indexer's scores); 1.0 for all when
    /// all are equal.
    MinMax,
    /// Min-max over the pods holding the prompt's first block (llm-d's scorer on llm-d's own
    /// indexer): the shortest holder scores as low as a pod holding nothing, a single holder
    /// 1.0 however short its match.
    MinMaxHolders,
    /// Matched blocks over prompt blocks (what this lab scored before; no deployed precise
    /// scorer does this).
    Share,
}

impl PrefixScore {
    /// Every form, by the name `--precise-prefix-score` takes.
    pub const NAMES: [(&'static str, PrefixScore); 3] = [
        ("min-max", PrefixScore::MinMax),
        ("min-max-holders", PrefixScore::MinMaxHolders),
        ("share", PrefixScore::Share),
    ];

    /// The form `name` stands for.
    pub fn parse(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, form)| form)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, form)| *form == self)
            .map_or("min-max", |&(n, _)| n)
    }

    /// The prefix scores to hand the pick for the raw scores of a prompt of `blocks` blocks,
    /// and how the pick is to normalise them: the raw scores for its own min-max
    /// ([`PrefixScore::MinMax`]), the scorer's values as they are for the other forms.
    pub fn normalise(self, raw: &[f64], blocks: usize) -> (Vec<f64>, PrefixNormalisation) {
        match self {
            PrefixScore::MinMax => (raw.to_vec(), PrefixNormalisation::MinMax),
            PrefixScore::MinMaxHolders => (min_max_holders(raw), PrefixNormalisation::AsGiven),
            PrefixScore::Share => {
                let n = blocks.max(1) as f64;
                let share = raw.iter().map(|r| r / n).collect();
                (share, PrefixNormalisation::AsGiven)
            }
        }
    }
}

/// `(v - min) / (max - min)` over the pods holding something (1.0 for each when they are
/// equal), 0 for the others: llm-d's min-max over the pods its own indexer returns.
fn min_max_holders(raw: &[f64]) -> Vec<f64> {
    let (min, max) = raw
        .iter()
        .copied()
        .filter(|&r| r > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(r), hi.max(r)));
    raw.iter()
        .map(|&r| match r > 0.0 {
            false => 0.0,
            true if max > min => (r - min) / (max - min),
            true => 1.0,
        })
        .collect()
}
