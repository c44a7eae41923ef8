//! Translation metrics: how engines' hashes become index keys (kv-core's `translate`): engines
//! per key mode and translated engine blocks (gauges read at scrape time), runs translated and
//! runs that could not be, by reason (counters, as batches apply).

use std::sync::Arc;

use kv_core::{ApplyReport, Indexer, KeyMode, Untranslatable};
use prometheus::{IntCounterVec, IntGaugeVec, Registry};

use super::registry::{counter_vec, gauge_vec, Labels};

/// Every key mode, for the gauge (so a mode with no engine reads 0, not absent).
const MODES: [&str; 4] = ["undecided", "aligned", "translated", "refused"];

/// Keys from tokens.
pub struct TranslationMetrics {
    labels: Arc<Labels>,
    engines: IntGaugeVec,
    translated_blocks: IntGaugeVec,
    runs: IntCounterVec,
    untranslatable: IntCounterVec,
    evicted: IntCounterVec,
}

impl TranslationMetrics {
    pub(super) fn new(r: &Registry, labels: Arc<Labels>) -> Self {
        Self {
            labels,
            engines: gauge_vec(
                r,
                "kvindexer_engines",
                "Engines (pod, DP rank) by how their hashes become keys: aligned (taken as published), translated (from token ids), refused (block size not a multiple of blockSize), undecided",
                &["model", "key_mode"],
            ),
            translated_blocks: gauge_vec(
                r,
                "kvindexer_translated_blocks",
                "Engine blocks in the translation maps (each takes one key of the size budget)",
                &["model"],
            ),
            runs: counter_vec(
                r,
                "kvindexer_translated_runs_total",
                "BlockStored runs whose keys were computed from their token ids (or found in the map)",
                &["model"],
            ),
            untranslatable: counter_vec(
                r,
                "kvindexer_untranslatable_runs_total",
                "BlockStored runs (and BlockStored events of refused engines) not indexed because their keys could not be computed, by reason",
                &["model", "reason"],
            ),
            evicted: counter_vec(
                r,
                "kvindexer_translated_blocks_evicted_total",
                "Translation-map entries that gave their place to newer ones because size was spent (their keys left the index with them)",
                &["model"],
            ),
        }
    }

    /// Counts what translation did in one batch.
    pub fn applied(&self, model: &str, report: &ApplyReport) {
        let t = &report.translation;
        let skipped: u32 = t.untranslatable.iter().sum::<u32>() + report.refused_events;
        if t.translated_runs == 0 && skipped == 0 && t.evicted_entries == 0 {
            return;
        }
        let m = self.labels.model(model);
        if t.evicted_entries > 0 {
            self.evicted
                .with_label_values(&[&m])
                .inc_by(u64::from(t.evicted_entries));
        }
        self.runs
            .with_label_values(&[&m])
            .inc_by(u64::from(t.translated_runs));
        for (why, n) in Untranslatable::ALL.iter().zip(t.untranslatable) {
            if n > 0 {
                self.untranslatable
                    .with_label_values(&[m.as_str(), why.label()])
                    .inc_by(u64::from(n));
            }
        }
        if report.refused_events > 0 {
            self.untranslatable
                .with_label_values(&[m.as_str(), "block_size"])
                .inc_by(u64::from(report.refused_events));
        }
    }

    /// Sets the gauges from every model's engines.
    pub(super) fn refresh(&self, indexer: &Indexer) {
        for model in indexer.models() {
            let m = self.labels.model(model.name());
            let mut counts = [0i64; 4];
            let mut blocks = 0usize;
            for (mode, translated) in model.key_modes().into_values() {
                let slot = match mode {
                    KeyMode::Undecided => 0,
                    KeyMode::Aligned => 1,
                    KeyMode::Translated => 2,
                    KeyMode::Refused { .. } => 3,
                };
                counts[slot] += 1;
                blocks += translated;
            }
            for (mode, n) in MODES.iter().zip(counts) {
                self.engines.with_label_values(&[m.as_str(), mode]).set(n);
            }
            self.translated_blocks
                .with_label_values(&[&m])
                .set(blocks as i64);
        }
    }
}
