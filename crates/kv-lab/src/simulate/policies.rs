//! The routing policies by name, as `kv-indexer simulate --policies` and `--weights` name them,
//! and the runner that simulates many (policy, seed, rate) jobs on every core.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use thiserror::Error;

use super::rng;
use super::routers::{self, CapacityGuess, PrefixScore, Router, Weights};

/// Every policy, in the order `all` runs them.
pub const POLICIES: [&str; 10] = [
    "random",
    "round-robin",
    "least-loaded",
    "approx",
    "approx-autotune",
    "aibrix",
    "localai",
    "dynamo",
    "precise-nospec",
    "precise",
];

/// Policies `all` leaves out: precise scoring over an index fed only the full-attention
/// groups' events (llm-d's and Dynamo's indexes today), to set beside `precise` and
/// `precise-nospec` on a hybrid model family (on `full` they are the same).
pub const FULL_ONLY_POLICIES: [&str; 2] = ["precise-full-only", "precise-full-only-nospec"];

/// Policies `all` leaves out: precise scoring whose candidates are the pods that published
/// (kv-indexer's picker without a pool), to set beside `precise` (the pool's pods) when the pool
/// changes (`--scale-out-at`, `--kill-at`); while it does not, they are the same.
pub const PUBLISHERS_POLICIES: [&str; 2] = ["precise-publishers", "precise-publishers-nospec"];

/// A policy or weight setting that does not parse.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    /// Not one of [`POLICIES`] or [`FULL_ONLY_POLICIES`].
    #[error("unknown policy {0:?} (one of {list}, {full_only}, {publishers})",
        list = POLICIES.join(", "), full_only = FULL_ONLY_POLICIES.join(", "),
        publishers = PUBLISHERS_POLICIES.join(", "))]
    UnknownPolicy(String),
    /// Not `equal`, `llm-d` or `prefix:queue:kv` (finite, at least 0, not all 0).
    #[error("--weights {0:?}: equal, llm-d, or prefix:queue:kv (e.g. 2:1:1; not all 0)")]
    BadWeights(String),
    /// Not one of [`PrefixScore::NAMES`].
    #[error("--precise-prefix-score {0:?}: min-max, min-max-holders or share")]
    BadPrefixScore(String),
}

/// The precise policies' prefix normalisation by name (`min-max`, `min-max-holders`, `share`).
pub fn parse_prefix_score(text: &str) -> Result<PrefixScore, PolicyError> {
    PrefixScore::parse(text).ok_or_else(|| PolicyError::BadPrefixScore(text.to_owned()))
}

/// The scorer weights of the approximate and the precise policies: `equal` (both 1:1:1),
/// `llm-d` (approximate 1:1:1, precise as llm-d publishes it, 3:2:2) or `prefix:queue:kv`
/// (both), each weight finite and at least 0, not all 0 (the daemon's pick refuses them).
pub fn parse_weights(text: &str) -> Result<(Weights, Weights), PolicyError> {
    Ok(match text {
        "equal" => (Weights::EQUAL, Weights::EQUAL),
        "llm-d" => (Weights::EQUAL, Weights::LLM_D_PRECISE),
        other => {
            let parts: Vec<f64> = other
                .split(':')
                .map(|p| p.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .ok()
                .filter(|v: &Vec<f64>| v.len() == 3 && v.iter().all(|x| *x >= 0.0 && x.is_finite()))
                .ok_or_else(|| PolicyError::BadWeights(other.to_owned()))?;
            let w = Weights {
                prefix: parts[0],
                queue: parts[1],
                kv: parts[2],
            };
            // The daemon's pick refuses all-zero weights; so does the simulator, which uses it.
            kv_core::PickWeights::from(w)
                .check()
                .map_err(|_| PolicyError::BadWeights(other.to_owned()))?;
            (w, w)
        }
    })
}

/// What a named policy is built from beside its name.
#[derive(Debug, Clone, Copy)]
pub struct PolicySettings {
    /// The approximate scorer's fixed capacity guess (`lruCapacityPerServer`), in blocks.
    pub approx_capacity: usize,
    /// The approximate policies' scorer weights.
    pub approx_weights: Weights,
    /// The precise policies' scorer weights.
    pub precise_weights: Weights,
    /// How the precise policies normalise the index's scores (min-max over every candidate by
    /// default).
    pub precise_prefix: PrefixScore,
}

/// The router `name` stands for, seeded with `seed`.
pub fn router(
    name: &str,
    settings: &PolicySettings,
    seed: u64,
) -> Result<Box<dyn Router>, PolicyError> {
    Ok(match name {
        "random" => Box::new(routers::Random(rng(seed ^ 0xABCD))),
        "round-robin" => Box::new(routers::RoundRobin::default()),
        "least-loaded" => Box::new(routers::LeastLoaded),
        "approx" => Box::new(routers::ApproxPrefix::new(
            CapacityGuess::Fixed(settings.approx_capacity),
            settings.approx_weights,
            seed,
        )),
        "approx-autotune" => Box::new(routers::ApproxPrefix::new(
            CapacityGuess::AutoTune,
            settings.approx_weights,
            seed,
        )),
        "aibrix" => Box::new(routers::Aibrix::default()),
        "localai" => Box::new(routers::LocalAi::default()),
        "dynamo" => Box::new(routers::Dynamo::new(seed)),
        "precise" | "precise-nospec" => Box::new(
            routers::Precise::new(settings.precise_weights, name == "precise", seed)
                .with_prefix_score(settings.precise_prefix),
        ),
        "precise-full-only" | "precise-full-only-nospec" => Box::new(
            routers::Precise::new(settings.precise_weights, name == "precise-full-only", seed)
                .with_prefix_score(settings.precise_prefix)
                .full_attention_only(),
        ),
        "precise-publishers" | "precise-publishers-nospec" => Box::new(
            routers::Precise::new(settings.precise_weights, name == "precise-publishers", seed)
                .with_prefix_score(settings.precise_prefix)
                .publishers_only(),
        ),
        other => return Err(PolicyError::UnknownPolicy(other.to_owned())),
    })
}

/// One router per gateway replica (`replicas` of them), each with its own seed.
pub fn replicas(
    name: &str,
    settings: &PolicySettings,
    replicas: usize,
    seed: u64,
) -> Result<Vec<Box<dyn Router>>, PolicyError> {
    (0..replicas as u64)
        .map(|r| router(name, settings, seed ^ (r << 48)))
        .collect()
}

/// Runs `work` on every job, on every core, in any order; the results keep their jobs'
/// order, and `done` is called after each job (a progress bar). The first error is returned
/// once every job has run.
pub fn run_parallel<J: Sync, R: Send, E: Send>(
    jobs: &[J],
    done: impl Fn() + Sync,
    work: impl Fn(&J) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, Result<R, E>)>> = Mutex::new(Vec::with_capacity(jobs.len()));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = work(job);
                done();
                // A poisoned lock means another job panicked, which the scope re-raises.
                if let Ok(mut out) = results.lock() {
                    out.push((i, r));
                }
            });
        }
    });
    let mut out = results.into_inner().unwrap_or_else(|e| e.into_inner());
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_parse_by_name_or_as_three_numbers() {
        assert_eq!(
            parse_weights("llm-d").map(|(a, p)| (a.prefix, p.prefix, p.queue)),
            Ok((1.0, 3.0, 2.0))
        );
        let (a, p) = parse_weights("2:1:0.5").expect("three weights");
        assert_eq!((a.prefix, a.queue, a.kv), (2.0, 1.0, 0.5));
        assert_eq!((p.prefix, p.queue, p.kv), (2.0, 1.0, 0.5));
        for bad in ["2:1", "a:b:c", "1:-1:1", "1:inf:1", "0:0:0"] {
            assert_eq!(
                parse_weights(bad).err(),
                Some(PolicyError::BadWeights(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn prefix_scores_parse_by_name_and_others_are_an_error() {
        assert_eq!(parse_prefix_score("min-max"), Ok(PrefixScore::MinMax));
        assert_eq!(
            parse_prefix_score("min-max-holders"),
            Ok(PrefixScore::MinMaxHolders)
        );
        assert_eq!(parse_prefix_score("share"), Ok(PrefixScore::Share));
        assert_eq!(
            parse_prefix_score("minmax"),
            Err(PolicyError::BadPrefixScore("minmax".into()))
        );
    }

    #[test]
    fn every_listed_policy_builds_and_others_are_named_in_the_error() {
        let settings = PolicySettings {
            approx_capacity: 1000,
            approx_weights: Weights::EQUAL,
            precise_weights: Weights::EQUAL,
            precise_prefix: PrefixScore::MinMax,
        };
        for name in POLICIES {
            assert!(router(name, &settings, 1).is_ok(), "{name}");
        }
        let e = router("psychic", &settings, 1).err().expect("unknown");
        assert!(e.to_string().contains("round-robin"), "{e}");
    }

    #[test]
    fn parallel_results_keep_the_jobs_order() {
        let jobs: Vec<u64> = (0..100).collect();
        let count = AtomicUsize::new(0);
        let out: Result<Vec<u64>, ()> = run_parallel(
            &jobs,
            || {
                count.fetch_add(1, Ordering::Relaxed);
            },
            |j| Ok(j * 2),
        );
        assert_eq!(out, Ok((0..100).map(|j| j * 2).collect()));
        assert_eq!(count.load(Ordering::Relaxed), 100);
        let failed: Result<Vec<u64>, u64> =
            run_parallel(&jobs, || {}, |&j| if j == 7 { Err(j) } else { Ok(j) });
        assert_eq!(failed, Err(7));
    }
}
