//! A simulated pod's engine, plain or hybrid, behind one face for the event loop: the plain
//! engine ([`super::engine::Engine`], one full-attention group, the published figures) or a
//! hybrid model's ([`super::hybrid::HybridEngine`]), each step's events already encoded as
//! the pod publishes them.
//!
//! Invariants: a plain pod's payloads are byte for byte what the event loop encoded before
//! hybrid pods existed (no group fields); a hybrid pod of `capacity_blocks` 16-token blocks of
//! KV has `groups x capacity_blocks x 16 / page` pool blocks, `page` being the family's block
//! (16 or 576 tokens): as if its layers were split evenly over the groups, every group's page
//! the same size, as vLLM makes them.

use kv_core::BlockHash;

use super::engine::{Engine, EngineConfig, EngineStats, Scheduled};
use super::family::{IndexedGroups, ModelFamily, UNIT_TOKENS};
use super::hybrid::HybridEngine;
use super::request::SimRequest;
use super::wire;

/// What one step of a pod produced, its events encoded.
#[derive(Debug, Default)]
pub struct PodStep {
    /// Requests that sampled their first token.
    pub first_tokens: Vec<usize>,
    /// Requests that sampled their last token.
    pub finished: Vec<usize>,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Output tokens sampled.
    pub output_tokens: u64,
    /// The step's events as the pod publishes them (`None`: nothing to publish).
    pub payload: Option<Vec<u8>>,
}

/// A pod's engine.
#[derive(Debug)]
pub enum PodEngine {
    /// One full-attention group (the plain engine).
    Plain(Box<Engine>),
    /// A hybrid model's groups over one pool.
    Hybrid(Box<HybridEngine>),
}

impl PodEngine {
    /// An idle engine of `family` for a pod of `capacity_blocks` 16-token KV blocks.
    pub fn new(config: EngineConfig, family: ModelFamily, capacity_blocks: usize) -> Self {
        if !family.is_hybrid() {
            return PodEngine::Plain(Box::new(Engine::new(config, capacity_blocks)));
        }
        let tokens = capacity_blocks as u64 * u64::from(UNIT_TOKENS);
        let pool = (tokens / family.page_tokens()) as usize * family.groups().len();
        PodEngine::Hybrid(Box::new(HybridEngine::new(config, family, pool.max(1))))
    }

    /// Whether `req` can ever run here.
    pub fn fits(&self, req: &SimRequest) -> bool {
        match self {
            PodEngine::Plain(e) => e.fits(req),
            PodEngine::Hybrid(e) => e.fits(req),
        }
    }

    /// Queues a request.
    pub fn add(&mut self, req: usize) {
        match self {
            PodEngine::Plain(e) => e.add(req),
            PodEngine::Hybrid(e) => e.add(req),
        }
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        match self {
            PodEngine::Plain(e) => e.waiting(),
            PodEngine::Hybrid(e) => e.waiting(),
        }
    }

    /// Requests running.
    pub fn running(&self) -> usize {
        match self {
            PodEngine::Plain(e) => e.running(),
            PodEngine::Hybrid(e) => e.running(),
        }
    }

    /// Share of KV blocks held by sequences.
    pub fn kv_usage(&self) -> f64 {
        match self {
            PodEngine::Plain(e) => e.kv_usage(),
            PodEngine::Hybrid(e) => e.kv_usage(),
        }
    }

    /// KV blocks the engine reports (`num_gpu_blocks`).
    pub fn capacity_blocks(&self) -> usize {
        match self {
            PodEngine::Plain(e) => e.capacity_blocks(),
            PodEngine::Hybrid(e) => e.capacity_blocks(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        match self {
            PodEngine::Plain(e) => e.stats,
            PodEngine::Hybrid(e) => e.stats,
        }
    }

    /// Plans the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self, requests: &[SimRequest]) -> Option<Scheduled> {
        match self {
            PodEngine::Plain(e) => e.schedule(requests),
            PodEngine::Hybrid(e) => e.schedule(requests),
        }
    }

    /// Ends the step planned last; a hybrid pod's events are those of the groups `indexed`.
    pub fn complete(&mut self, requests: &[SimRequest], indexed: IndexedGroups) -> PodStep {
        match self {
            PodEngine::Plain(e) => {
                let block_size = e.block_size();
                let end = e.complete(requests);
                let payload = (!end.stored.is_empty() || !end.removed.is_empty())
                    .then(|| wire::step(&end.removed, &end.stored, block_size));
                PodStep {
                    first_tokens: end.first_tokens,
                    finished: end.finished,
                    prefill_tokens: end.prefill_tokens,
                    output_tokens: end.output_tokens,
                    payload,
                }
            }
            PodEngine::Hybrid(e) => {
                let end = e.complete(requests);
                PodStep {
                    payload: wire::hybrid_step(e.groups(), &end.removed, &end.stored, indexed),
                    first_tokens: end.first_tokens,
                    finished: end.finished,
                    prefill_tokens: end.prefill_tokens,
                    output_tokens: end.output_tokens,
                }
            }
        }
    }

    /// A prefix-cache reset; the removals to publish, if any.
    pub fn reset_prefix_cache(&mut self, indexed: IndexedGroups) -> Option<Vec<u8>> {
        match self {
            PodEngine::Plain(e) => {
                let dropped: Vec<BlockHash> = e.reset_prefix_cache();
                (!dropped.is_empty()).then(|| wire::removed(&dropped))
            }
            PodEngine::Hybrid(e) => {
                let dropped = e.reset_prefix_cache();
                wire::hybrid_step(e.groups(), &dropped, &[], indexed)
            }
        }
    }

    /// A restart: the requests to retry and those whose stream is cut.
    pub fn restart(&mut self) -> (Vec<usize>, Vec<usize>) {
        match self {
            PodEngine::Plain(e) => e.restart(),
            PodEngine::Hybrid(e) => e.restart(),
        }
    }
}
