//! Endpoint-picker metrics (ext_proc picks and the pods' load scraper).

use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use super::registry::{counter, counter_vec, latency};

/// The endpoint picker's activity.
pub struct PickerMetrics {
    picks: IntCounterVec,
    pick_latency: Histogram,
    stale: IntCounterVec,
    scrapes: IntCounterVec,
    rejected_bodies: IntCounterVec,
    served_mismatch: IntCounter,
    not_recorded: IntCounterVec,
}

impl PickerMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            picks: counter_vec(
                r,
                "kvindexer_picker_picks_total",
                "Endpoint-picker requests by outcome: picked, picked_without_prefix, \
                 no_candidates (503), shed (429), bad_request (400)",
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
                "Candidates whose load metrics were stale or missing at a pick (the pick then \
                 used the index alone)",
                &["reason"],
            ),
            scrapes: counter_vec(
                r,
                "kvindexer_picker_scrapes_total",
                "Pod metrics scrapes by result: ok, connect, timeout, status, too_large, parse",
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
                "Picks whose speculative routing record was refused (by gRPC code), so \
                 back-to-back requests sharing their prefix are not steered by it",
                &["code"],
            ),
        }
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
}
