//! Endpoint-picker metrics (ext_proc picks and the pods' load scraper).

use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use super::registry::{counter, counter_vec, histogram, latency};

/// The prediction error's buckets, in tokens (predicted minus cached): symmetric, from a block
/// to a long prompt either way.
const PREDICTION_ERROR_BUCKETS: [f64; 15] = [
    -8192.0, -2048.0, -512.0, -128.0, -32.0, -16.0, -1.0, 0.0, 1.0, 16.0, 32.0, 128.0, 512.0,
    2048.0, 8192.0,
];

/// The uncached tokens' buckets at a prefill/decode decision: from llm-d's shipped threshold
/// (16) to a long prompt.
const PD_UNCACHED_BUCKETS: [f64; 10] = [
    0.0, 16.0, 64.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 16384.0, 65536.0,
];

/// The endpoint picker's activity.
pub struct PickerMetrics {
    picks: IntCounterVec,
    pick_latency: Histogram,
    stale: IntCounterVec,
    scrapes: IntCounterVec,
    rejected_bodies: IntCounterVec,
    served_mismatch: IntCounter,
    not_recorded: IntCounterVec,
    unscored: IntCounterVec,
    subset_outside: IntCounter,
    predictions: IntCounterVec,
    prediction_error: Histogram,
    pd_decisions: IntCounterVec,
    pd_uncached: Histogram,
}

impl PickerMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        let metrics = Self::register(r);
        // Both reasons' series exist from the start, at 0 (the dashboard charts them).
        for reason in ["stale", "missing"] {
            metrics.stale.with_label_values(&[reason]);
        }
        metrics
    }

    fn register(r: &Registry) -> Self {
        Self {
            picks: counter_vec(
                r,
                "kvindexer_picker_picks_total",
                "Endpoint-picker requests by outcome: picked, picked_without_prefix, \
                 no_candidates (503), shed (429), too_large (413), refused (500: a body mode \
                 that cannot carry a pick), bad_request (400)",
                &["outcome"],
            ),
            pick_latency: latency(
                r,
                "kvindexer_picker_pick_latency_seconds",
                "Time from a request's whole body to its pick (parse, tokenize, score, pick)",
            ),
            stale: counter_vec(
                r,
                "kvindexer_picker_metrics_unusable_total",
                "Candidates whose load metrics were stale or missing at a pick (each scored on \
                 load as the median of the fresh candidates)",
                &["reason"],
            ),
            scrapes: counter_vec(
                r,
                "kvindexer_picker_scrapes_total",
                "Pod metrics scrapes by result: ok, connect (no connection), reset, timeout \
                 (connected, no page in time), status, too_large, parse",
                &["result"],
            ),
            rejected_bodies: counter_vec(
                r,
                "kvindexer_picker_bad_requests_total",
                "Request bodies the picker refused with 400, by reason",
                &["reason"],
            ),
            served_mismatch: counter(
                r,
                "kvindexer_picker_served_elsewhere_total",
                "Responses served by another endpoint than the pick (a fallback): the routing \
                 is recorded for the endpoint that served",
            ),
            not_recorded: counter_vec(
                r,
                "kvindexer_picker_records_refused_total",
                "Picks whose speculative routing record was refused (by reason: invalid, \
                 not_found, other), so back-to-back requests sharing their prefix are not \
                 steered by it",
                &["reason"],
            ),
            unscored: counter_vec(
                r,
                "kvindexer_picker_unscored_requests_total",
                "Requests picked on load alone because no prefix of theirs is knowable exactly, \
                 by reason",
                &["reason"],
            ),
            subset_outside: counter(
                r,
                "kvindexer_picker_subset_outside_pool_total",
                "Endpoints a subset hint named that are not in the pool (never picked)",
            ),
            predictions: counter_vec(
                r,
                "kvindexer_picker_predictions_total",
                "Responses whose usage.prompt_tokens_details.cached_tokens was held against the \
                 pick's prediction, by result: exact, over (predicted more), under; or why not \
                 measured: no_usage, no_cached_tokens, served_unlisted",
                &["result"],
            ),
            prediction_error: histogram(
                r,
                "kvindexer_picker_prediction_error_tokens",
                "Predicted minus actually cached prompt tokens on the endpoint that \
                 served (vLLM's usage.prompt_tokens_details.cached_tokens)",
                &PREDICTION_ERROR_BUCKETS,
            ),
            pd_decisions: counter_vec(
                r,
                "kvindexer_picker_pd_decisions_total",
                "Picks by prefill/decode decision (split: a prefill pod named in \
                 x-prefiller-host-port; whole: decode pod alone) and reason: uncached (split), \
                 disabled (endpointPicker.pd.threshold 0), short_prompt, cached (fewer uncached \
                 tokens than the threshold on the decode pod), unscored (no prefix scored), \
                 no_prefill_candidate, prefill_is_decode (the best prefill pod is the decode pod)",
                &["decision", "reason"],
            ),
            pd_uncached: histogram(
                r,
                "kvindexer_picker_pd_uncached_tokens",
                "Prompt tokens the chosen decode pod is predicted not to reuse, at each \
                 prefill/decode decision (endpointPicker.pd.threshold above 0, prefix \
                 scored)",
                &PD_UNCACHED_BUCKETS,
            ),
        }
    }

    /// A pick's prefill/decode decision.
    pub fn pd_decision(&self, split: bool, reason: &str) {
        let decision = match split {
            true => "split",
            false => "whole",
        };
        self.pd_decisions
            .with_label_values(&[decision, reason])
            .inc();
    }

    /// The uncached tokens a prefill/decode decision was taken on.
    pub fn pd_uncached(&self, tokens: u32) {
        self.pd_uncached.observe(f64::from(tokens));
    }

    /// One request's outcome (and, for a pick, how long it took).
    pub fn pick(&self, outcome: &str, took: Option<Duration>) {
        self.picks.with_label_values(&[outcome]).inc();
        if let Some(took) = took {
            self.pick_latency.observe(took.as_secs_f64());
        }
    }

    /// Candidates whose metrics could not be used at a pick.
    pub fn metrics_unusable(&self, stale: usize, missing: usize) {
        if stale > 0 {
            self.stale
                .with_label_values(&["stale"])
                .inc_by(stale as u64);
        }
        if missing > 0 {
            self.stale
                .with_label_values(&["missing"])
                .inc_by(missing as u64);
        }
    }

    /// One scrape's result.
    pub fn scrape(&self, result: &str) {
        self.scrapes.with_label_values(&[result]).inc();
    }

    /// A body refused with 400.
    pub fn bad_request(&self, reason: &str) {
        self.rejected_bodies.with_label_values(&[reason]).inc();
    }

    /// A pick's routing record refused (`code`: the gRPC code RecordRouting would return).
    pub fn not_recorded(&self, code: &str) {
        self.not_recorded.with_label_values(&[code]).inc();
    }

    /// A response served by another endpoint than the pick.
    pub fn served_elsewhere(&self) {
        self.served_mismatch.inc();
    }

    /// A request picked on load alone: no prefix of it is knowable exactly (`reason`).
    pub fn unscored(&self, reason: &str) {
        self.unscored.with_label_values(&[reason]).inc();
    }

    /// Endpoints of a subset hint outside the pool.
    pub fn subset_outside_pool(&self, n: usize) {
        if n > 0 {
            self.subset_outside.inc_by(n as u64);
        }
    }

    /// A response's cached tokens against the pick's prediction for its endpoint.
    pub fn prediction(&self, predicted: u32, actual: u32) {
        let result = match predicted.cmp(&actual) {
            std::cmp::Ordering::Equal => "exact",
            std::cmp::Ordering::Greater => "over",
            std::cmp::Ordering::Less => "under",
        };
        self.predictions.with_label_values(&[result]).inc();
        self.prediction_error
            .observe(f64::from(predicted) - f64::from(actual));
    }

    /// A response whose prediction could not be measured (`reason`).
    pub fn prediction_unmeasured(&self, reason: &str) {
        self.predictions.with_label_values(&[reason]).inc();
    }
}
