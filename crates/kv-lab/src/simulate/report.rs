//! The simulator's report: the tables, and the load ladder's statistics (mean and 95% interval
//! over seeds) and verdict (the highest rate that meets a TTFT SLO). `kv-indexer simulate`
//! prints these; the charts are in `charts` (feature `charts`).

use std::collections::BTreeMap;

use serde::Serialize;

use super::PolicyReport;

/// One run of the ladder, in the JSON shape the ladder promises.
#[derive(Debug, Clone, Serialize)]
pub struct LadderRun {
    /// Offered load, requests per second.
    pub rate: f64,
    /// The policy.
    pub policy: String,
    /// The seed.
    pub seed: u64,
    /// Prompt tokens found in the pod's cache / all prompt tokens.
    pub hit_rate: f64,
    /// Time to first token, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Output tokens per second, first arrival to last token.
    pub output_tokens_per_s: f64,
    /// Sequences preempted.
    pub preemptions: u64,
}

impl LadderRun {
    /// The run's figures.
    pub fn new(rate: f64, seed: u64, r: &PolicyReport) -> Self {
        Self {
            rate,
            policy: r.policy.clone(),
            seed,
            hit_rate: r.token_hit_rate,
            ttft_p50_ms: r.ttft_p50_ms,
            ttft_p90_ms: r.ttft_p90_ms,
            ttft_p99_ms: r.ttft_p99_ms,
            output_tokens_per_s: r.output_tokens_per_s,
            preemptions: r.preemptions,
        }
    }
}

/// Mean and the half-width of its 95% interval (Student's t with n - 1 degrees of freedom;
/// 0 for a single value).
pub fn mean_interval(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    // Two-sided 97.5% quantiles of Student's t for 1..=30 degrees of freedom, then normal.
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let t = T.get(n - 2).copied().unwrap_or(1.96);
    (mean, t * (var / n as f64).sqrt())
}

/// The runs of (`policy`, `rate`), in seed order.
pub(super) fn cell<'a>(runs: &'a [LadderRun], policy: &str, rate: f64) -> Vec<&'a LadderRun> {
    runs.iter()
        .filter(|r| r.policy == policy && r.rate == rate)
        .collect()
}

/// Policies and rates in the order they first appear.
pub(super) fn axes(runs: &[LadderRun]) -> (Vec<String>, Vec<f64>) {
    let mut policies: Vec<String> = Vec::new();
    let mut rates: Vec<f64> = Vec::new();
    for r in runs {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
        if !rates.contains(&r.rate) {
            rates.push(r.rate);
        }
    }
    (policies, rates)
}

pub(super) fn mean_of(runs: &[&LadderRun], f: impl Fn(&LadderRun) -> f64) -> (f64, f64) {
    mean_interval(&runs.iter().map(|r| f(r)).collect::<Vec<_>>())
}

/// Per policy, the highest rate whose mean TTFT p90 meets the SLO with every lower rate
/// meeting it too (`None`: not even the lowest).
pub fn max_sustainable_rate(runs: &[LadderRun], slo_ms: f64) -> BTreeMap<String, Option<f64>> {
    let (policies, mut rates) = axes(runs);
    rates.sort_by(f64::total_cmp);
    policies
        .into_iter()
        .map(|p| {
            let mut best = None;
            for &rate in &rates {
                let (p90, _) = mean_of(&cell(runs, &p, rate), |r| r.ttft_p90_ms);
                if p90 > slo_ms {
                    break;
                }
                best = Some(rate);
            }
            (p, best)
        })
        .collect()
}

/// The ladder as a Markdown table: per rate and policy, means with their 95% intervals.
pub fn ladder_table(runs: &[LadderRun]) -> String {
    let (policies, rates) = axes(runs);
    let mut out = String::from(
        "| rate | policy | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | output tok/s | preemptions |\n|---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let fmt = |(m, h): (f64, f64), digits: usize| {
        if h == 0.0 {
            format!("{m:.digits$}")
        } else {
            format!("{m:.digits$} ±{h:.digits$}")
        }
    };
    for &rate in &rates {
        for p in &policies {
            let c = cell(runs, p, rate);
            if c.is_empty() {
                continue;
            }
            let (hit, hit_h) = mean_of(&c, |r| r.hit_rate * 100.0);
            out += &format!(
                "| {rate} | {p} | {}% | {} | {} | {} | {} | {} |\n",
                fmt((hit, hit_h), 1),
                fmt(mean_of(&c, |r| r.ttft_p50_ms), 0),
                fmt(mean_of(&c, |r| r.ttft_p90_ms), 0),
                fmt(mean_of(&c, |r| r.ttft_p99_ms), 0),
                fmt(mean_of(&c, |r| r.output_tokens_per_s), 0),
                fmt(mean_of(&c, |r| r.preemptions as f64), 0),
            );
        }
    }
    out
}

/// One run per policy as a Markdown table.
pub fn policy_table(reports: &[PolicyReport]) -> String {
    let mut out = String::from(
        "| policy | prefix-hit rate | prefill tokens | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | output tok/s | preemptions | load spread |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        out += &format!(
            "| {} | {:.1}% | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.2} |\n",
            r.policy,
            100.0 * r.token_hit_rate,
            r.prefill_tokens,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.output_tokens_per_s,
            r.preemptions,
            r.load_spread
        );
    }
    out
}

/// What each policy made of a changing pool (a scale-out, a pod that stopped answering), as a
/// Markdown table.
pub fn pool_table(reports: &[PolicyReport]) -> String {
    let mut out = String::from(
        "| policy | requests | sent to a down pod | no candidate (503) | arrivals on the scaled-out pods after they joined | prefix-hit rate | TTFT p50 ms | TTFT p90 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        let late = r
            .late_share
            .map_or("-".to_owned(), |s| format!("{:.1}%", 100.0 * s));
        out += &format!(
            "| {} | {} | {} | {} | {} | {:.1}% | {:.0} | {:.0} |\n",
            r.policy,
            r.requests,
            r.misrouted,
            r.refused,
            late,
            100.0 * r.token_hit_rate,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
        );
    }
    out
}

/// How each predicting policy's expected hits compared with the hits the engines took, as a
/// Markdown table (policies that predict nothing are left out).
pub fn prediction_table(reports: &[PolicyReport]) -> String {
    let mut out = String::from(
        "| policy | requests predicted | exact | over-predicted | under-predicted | tokens over-predicted per over-predicted request |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        let Some(p) = r.prediction else { continue };
        out += &format!(
            "| {} | {} | {:.1}% | {:.1}% | {:.1}% | {:.0} |\n",
            r.policy,
            p.requests,
            100.0 * p.exact_share(),
            100.0 * p.over_share(),
            100.0 * p.under as f64 / p.requests.max(1) as f64,
            p.over_tokens as f64 / p.over.max(1) as f64,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(policy: &str, rate: f64, seed: u64, p90: f64) -> LadderRun {
        LadderRun {
            rate,
            policy: policy.into(),
            seed,
            hit_rate: 0.5,
            ttft_p50_ms: p90 / 2.0,
            ttft_p90_ms: p90,
            ttft_p99_ms: p90 * 2.0,
            output_tokens_per_s: 100.0,
            preemptions: 0,
        }
    }

    #[test]
    fn the_interval_is_students_t_and_the_verdict_needs_every_lower_rate() {
        let (m, h) = mean_interval(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        // sd 1, n 3: 4.303 / sqrt(3).
        assert!((h - 4.303 / 3f64.sqrt()).abs() < 1e-9);
        assert_eq!(mean_interval(&[5.0]), (5.0, 0.0));
        let runs = vec![
            run("a", 10.0, 1, 100.0),
            run("a", 10.0, 2, 300.0),
            run("a", 20.0, 1, 900.0),
            run("a", 20.0, 2, 1_300.0),
            run("a", 30.0, 1, 200.0),
            run("b", 10.0, 1, 2_000.0),
            run("b", 20.0, 1, 100.0),
        ];
        let v = max_sustainable_rate(&runs, 1_000.0);
        // a: 10 (mean 200) ok, 20 (mean 1,100) fails, so 30 does not count.
        assert_eq!(v["a"], Some(10.0));
        assert_eq!(v["b"], None, "the lowest rate fails");
    }
}
