//! Prometheus metrics: the names llm-d users already chart (`kvcache_index_*`,
//! `kvcache_tokenization_*`) and kv-indexer's own (`kvindexer_*`), grouped by the part of the
//! daemon that records them. They are attached from the outside: ingest and the servers call
//! the small recording methods here, the tokenizer reports through `kv_tokenize`'s
//! [`TokenizeObserver`](kv_tokenize::TokenizeObserver), and the index's gauges are read from
//! its statistics at scrape time. kv-core and kv-tokenize never see a Prometheus type.
//!
//! Invariant: every label set is bounded. Reasons and event types are fixed enums; the `pod`
//! label takes at most `MAX_POD_LABELS` (512) distinct values (later pods are reported as
//! `"_other"`), so a fleet whose pods restart under new addresses cannot grow the series count
//! without bound; model labels are bounded the same way.

mod bounds;
mod discovery;
mod index;
mod ingest;
mod picker;
mod pool;
mod registry;
mod replication;
mod scoring;
mod speculation;
mod tokenizer;
mod translation;

use std::sync::Arc;

use kv_core::Indexer;
use prometheus::{Encoder, IntGauge, Registry, TextEncoder};

pub use bounds::BoundsMetrics;
pub use discovery::DiscoveryMetrics;
pub use index::IndexMetrics;
pub use ingest::IngestMetrics;
pub use picker::PickerMetrics;
pub use pool::PoolMetrics;
pub use registry::Labels;
pub use replication::ReplicationMetrics;
pub use scoring::ScoringMetrics;
pub use speculation::SpeculationMetrics;
pub use tokenizer::TokenizerMetrics;
pub use translation::TranslationMetrics;

/// Every metric the daemon exports, by area.
pub struct Metrics {
    registry: Registry,
    /// Bounded pod and model label values, shared by every area.
    pub labels: Arc<Labels>,
    /// ZMQ intake, sequencing, gap fill and batch application.
    pub ingest: IngestMetrics,
    /// Connect mode's DNS discovery.
    pub discovery: DiscoveryMetrics,
    /// The index's size gauges and admission counters.
    pub index: IndexMetrics,
    /// Score requests.
    pub scoring: ScoringMetrics,
    /// Recorded routings and speculative entries.
    pub speculation: SpeculationMetrics,
    /// Keys from tokens (engines whose hashes are not the index's keys).
    pub translation: TranslationMetrics,
    /// The replication log, snapshots and Redis (zero while replication is off).
    pub replication: ReplicationMetrics,
    /// The endpoint picker (zero while it is off).
    pub picker: PickerMetrics,
    /// The endpoint picker's bounds: streams, body bytes, the scraper's budget.
    pub bounds: BoundsMetrics,
    /// The endpoint picker's pool (zero while it is off).
    pub pool: PoolMetrics,
    /// Tokenization (the tokenizer service's observer).
    pub tokenizer: Arc<TokenizerMetrics>,
    /// The process's resident memory, read at scrape time (soak tests watch it).
    resident_memory: IntGauge,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Arc<Self> {
        let registry = Registry::new();
        let labels = Arc::new(Labels::default());
        Arc::new(Self {
            ingest: IngestMetrics::new(&registry, labels.clone()),
            discovery: DiscoveryMetrics::new(&registry),
            index: IndexMetrics::new(&registry, labels.clone()),
            scoring: ScoringMetrics::new(&registry),
            speculation: SpeculationMetrics::new(&registry, labels.clone()),
            translation: TranslationMetrics::new(&registry, labels.clone()),
            replication: ReplicationMetrics::new(&registry),
            picker: PickerMetrics::new(&registry),
            bounds: BoundsMetrics::new(&registry),
            pool: PoolMetrics::new(&registry),
            tokenizer: Arc::new(TokenizerMetrics::new(&registry)),
            resident_memory: registry::gauge(
                &registry,
                "kvindexer_process_resident_memory_bytes",
                "Resident memory of the daemon process (Linux VmRSS), read at scrape time",
            ),
            labels,
            registry,
        })
    }

    /// Refreshes the index gauges from the indexer, then renders the text exposition.
    pub fn render(&self, indexer: &Indexer) -> String {
        self.index.refresh(indexer);
        self.speculation.refresh(indexer);
        self.translation.refresh(indexer);
        self.scoring.refresh(indexer);
        if let Some(rss) = resident_memory_bytes() {
            self.resident_memory.set(rss as i64);
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            return format!("# metrics encoding failed: {e}\n");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The process's resident set size from `/proc/self/status` (`None` off Linux); also what the
/// benchmarks and tests that run a daemon in their own process read.
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}
