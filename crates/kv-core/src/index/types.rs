//! The index's public vocabulary: who holds a block (engines, tiers), capacity settings,
//! scores and statistics. Plain data; no index state.

use std::sync::Arc;

use thiserror::Error;

/// Dense per-model id of an engine (one vLLM process: a pod and its data-parallel rank).
pub type EngineId = u32;

/// Who published: the pod (topic's `<pod>` part, or a configured id) and its DP rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineKey {
    /// The pod identifier as the gateway names it (`ip` or `ip:port`).
    pub pod: Arc<str>,
    /// The vLLM data-parallel rank inside the pod (0 without DP).
    pub dp_rank: u32,
}

impl EngineKey {
    /// A key for `pod` at `dp_rank`.
    pub fn new(pod: &str, dp_rank: u32) -> Self {
        Self {
            pod: pod.into(),
            dp_rank,
        }
    }
}

/// Where a block copy lives; scoring weighs tiers differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// GPU memory: a hit is a free prefill.
    Gpu = 0,
    /// CPU offload: a hit costs a transfer.
    Cpu = 1,
    /// Disk / remote storage offload.
    Storage = 2,
    /// Any other medium a connector names.
    Other = 3,
}

impl Tier {
    pub(super) fn from_bits(bits: u32) -> Self {
        match bits & 0xff {
            0 => Tier::Gpu,
            1 => Tier::Cpu,
            2 => Tier::Storage,
            _ => Tier::Other,
        }
    }

    /// The lower-case name used in config and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
            Tier::Other => "other",
        }
    }
}

/// Per-tier weights of a matched block in a pod's score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierWeights(pub [f64; 4]);

impl Default for TierWeights {
    fn default() -> Self {
        Self([1.0, 0.8, 0.6, 0.5])
    }
}

impl TierWeights {
    /// The weight of `tier`.
    #[inline(always)]
    pub fn of(&self, tier: Tier) -> f64 {
        self.0[tier as usize]
    }
}

/// The keys several model indexes share: `size` bounds the whole indexer, not each model (a
/// publisher that names many models cannot multiply it). Taken when a block enters a lane,
/// given back when it is freed.
#[derive(Debug)]
pub struct KeyBudget {
    limit: u64,
    used: std::sync::atomic::AtomicU64,
}

impl KeyBudget {
    /// A budget of `limit` keys.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Keys in use across every index sharing the budget.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Takes one key; false when the budget is spent.
    pub(crate) fn take(&self) -> bool {
        self.take_up_to(1) == 1
    }

    /// Takes up to `n` keys; returns how many it got.
    pub(crate) fn take_up_to(&self, n: u64) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        match self.used.fetch_update(Relaxed, Relaxed, |u| {
            (u < self.limit).then(|| u.saturating_add(n).min(self.limit))
        }) {
            Ok(before) => before.saturating_add(n).min(self.limit) - before,
            Err(_) => 0,
        }
    }

    /// Gives `n` keys back.
    pub(crate) fn give_back(&self, n: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let _ = self
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(n)));
    }
}

/// Capacity settings (the `kvBlockIndexConfig.inMemoryConfig` of the config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most distinct block keys (`size`): per index, and across the indexes that share a
    /// [`KeyBudget`] (the indexer's models).
    pub max_keys: usize,
    /// Most (engine, tier) holders recorded per key (`podCacheSize`), the oldest dropped
    /// beyond it. `None` (the default): exact, every holder of every block is recorded. With
    /// several writer lanes the bound holds per lane.
    pub pod_cache_size: Option<usize>,
    /// Writer lanes (`writerLanes`): events of engines in different lanes apply in parallel;
    /// a query walks every lane. 1 to [`MAX_WRITER_LANES`].
    pub writer_lanes: usize,
}

/// The most writer lanes an index may have.
pub const MAX_WRITER_LANES: usize = 64;

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_keys: 100_000_000,
            pod_cache_size: None,
            writer_lanes: 1,
        }
    }
}

/// Invalid index settings.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexConfigError {
    /// `size` out of range.
    #[error("size must be between 1 and {max}, got {got}")]
    Size {
        /// The configured value.
        got: usize,
        /// The largest supported.
        max: usize,
    },
    /// `writerLanes` out of range.
    #[error("writerLanes must be between 1 and {max}, got {got}")]
    WriterLanes {
        /// The configured value.
        got: usize,
        /// The largest supported.
        max: usize,
    },
    /// `podCacheSize` set to 0 (leave it out for exact membership).
    #[error("podCacheSize must be at least 1 when set (leave it out for exact membership)")]
    PodCacheSize,
}

impl IndexConfig {
    /// Checks the ranges the data structure supports.
    pub fn validate(&self) -> Result<(), IndexConfigError> {
        let max_keys = (u32::MAX - 2) as usize;
        if self.max_keys == 0 || self.max_keys > max_keys {
            return Err(IndexConfigError::Size {
                got: self.max_keys,
                max: max_keys,
            });
        }
        if self.pod_cache_size == Some(0) {
            return Err(IndexConfigError::PodCacheSize);
        }
        if self.writer_lanes == 0 || self.writer_lanes > MAX_WRITER_LANES {
            return Err(IndexConfigError::WriterLanes {
                got: self.writer_lanes,
                max: MAX_WRITER_LANES,
            });
        }
        Ok(())
    }
}

/// A pod's result for one prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineScore {
    /// Who.
    pub engine: EngineId,
    /// Consecutive prompt blocks from block 0 the engine holds.
    pub matched_blocks: u32,
    /// Those blocks' tier weights, summed.
    pub score: f64,
}
