//! Registration helpers and bounded label values.

use std::collections::HashSet;

use parking_lot::Mutex;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Distinct pods with their own label value; beyond, `"_other"`.
pub const MAX_POD_LABELS: usize = 512;
/// Distinct models with their own label value; beyond, `"_other"`.
pub const MAX_MODEL_LABELS: usize = 64;

/// A bounded set of label values.
#[derive(Debug)]
struct BoundedLabels {
    seen: Mutex<HashSet<String>>,
    limit: usize,
}

impl BoundedLabels {
    fn new(limit: usize) -> Self {
        Self {
            seen: Mutex::new(HashSet::new()),
            limit,
        }
    }

    /// Frees `value`'s slot; `Some(value)` when it had one.
    fn release(&self, value: &str) -> Option<String> {
        self.seen.lock().take(value)
    }

    /// `value` if it has (or can get) its own series, else `"_other"`.
    fn get(&self, value: &str) -> String {
        let mut seen = self.seen.lock();
        if seen.contains(value) {
            return value.to_owned();
        }
        if seen.len() < self.limit {
            seen.insert(value.to_owned());
            return value.to_owned();
        }
        "_other".to_owned()
    }
}

/// The bounded `pod` and `model` label values every area shares.
#[derive(Debug)]
pub struct Labels {
    pods: BoundedLabels,
    models: BoundedLabels,
}

impl Default for Labels {
    fn default() -> Self {
        Self {
            pods: BoundedLabels::new(MAX_POD_LABELS),
            models: BoundedLabels::new(MAX_MODEL_LABELS),
        }
    }
}

impl Labels {
    /// The label value for a pod (bounded).
    pub fn pod(&self, pod: &str) -> String {
        self.pods.get(pod)
    }

    /// Frees a forgotten pod's label slot (its series must be removed by the caller); `Some`
    /// with the label when it had its own.
    pub fn release_pod(&self, pod: &str) -> Option<String> {
        self.pods.release(pod)
    }

    /// The label value for a model (bounded).
    pub fn model(&self, model: &str) -> String {
        self.models.get(model)
    }
}

// Metric definitions are static: a failure to create or register one is a programming error
// caught by every test that builds `Metrics`, never something input can cause.

pub(super) fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("static metric definition is valid");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

pub(super) fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

pub(super) fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("static metric definition");
    r.register(Box::new(g.clone()))
        .expect("metric names are unique");
    g
}

pub(super) fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(g.clone()))
        .expect("metric names are unique");
    g
}

/// Latency buckets from 1 us to 1 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
        2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    ]
}

pub(super) fn latency(r: &Registry, name: &str, help: &str) -> Histogram {
    histogram(r, name, help, &latency_buckets())
}

/// A histogram of `buckets`, registered.
pub(super) fn histogram(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("static metric definition");
    r.register(Box::new(h.clone()))
        .expect("metric names are unique");
    h
}

pub(super) fn latency_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(latency_buckets()),
        labels,
    )
    .expect("static metric definition");
    r.register(Box::new(h.clone()))
        .expect("metric names are unique");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_labels_are_bounded() {
        let labels = Labels::default();
        for i in 0..MAX_POD_LABELS {
            assert_eq!(labels.pod(&format!("10.0.0.{i}")), format!("10.0.0.{i}"));
        }
        assert_eq!(labels.pod("one-too-many"), "_other");
        assert_eq!(
            labels.pod("10.0.0.3"),
            "10.0.0.3",
            "known pods keep their label"
        );
    }
}
