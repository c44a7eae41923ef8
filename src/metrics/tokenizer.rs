//! Tokenization metrics, recorded through `kv_tokenize`'s observer trait.

use std::time::Duration;

use kv_tokenize::TokenizeObserver;
use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use super::registry::{counter, counter_vec, latency};

/// Tokenizer and prefix-store activity (llm-d's names where it has them).
pub struct TokenizerMetrics {
    tokenization_latency: Histogram,
    tokenized_tokens: IntCounter,
    prefix_store_lookups: IntCounterVec,
}

impl TokenizerMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        Self {
            tokenization_latency: latency(
                r,
                "kvcache_tokenization_tokenization_latency_seconds",
                "Time to tokenize a prompt (prefix-store misses)",
            ),
            tokenized_tokens: counter(
                r,
                "kvcache_tokenization_tokenized_tokens_total",
                "Tokens produced for score requests",
            ),
            prefix_store_lookups: counter_vec(
                r,
                "kvindexer_prefix_store_lookups_total",
                "Prefix-store lookups",
                &["result"],
            ),
        }
    }
}

impl TokenizeObserver for TokenizerMetrics {
    fn prefix_lookup(&self, hit: bool) {
        self.prefix_store_lookups
            .with_label_values(&[if hit { "hit" } else { "miss" }])
            .inc();
    }

    fn tokenized(&self, tokens: usize, tokenize_time: Option<Duration>) {
        self.tokenized_tokens.inc_by(tokens as u64);
        if let Some(t) = tokenize_time {
            self.tokenization_latency.observe(t.as_secs_f64());
        }
    }
}
