//! `kv-indexer simulate`: simulated vLLM pods, several routing policies, and the real index.
//!
//! Discrete-event simulation, time in milliseconds, deterministic for a seed:
//! - a **pod** is a vLLM engine stepped as vLLM's V1 scheduler runs it ([`engine`]):
//!   continuous batching under a token budget, chunked prefill, a paged KV cache whose prompt
//!   and generated blocks are prefix-cached, preemption when blocks run out, and a step time
//!   that grows with the tokens in the step. TTFT = arrival to the end of the step that
//!   samples the first token;
//! - a pod runs a **model family** (`SimSettings::model_family`): full attention only (the
//!   plain engine above), or a hybrid model's groups (sliding window, Mamba) over one pool
//!   ([`hybrid`], chosen per pod by [`pod`]); a hybrid pod's events carry their group;
//! - pods **publish** `BlockStored` / `BlockRemoved` / `AllBlocksCleared` per step as vLLM
//!   encodes them (map-form msgpack), delivered after `event_delay_ms` through the daemon's
//!   decoder ([`kv_core::decode_batch`]) into a real [`Indexer`];
//! - pods' **metrics** (waiting and running requests, KV usage, KV blocks) are scraped every
//!   `scrape_interval_ms`: routers see them that stale;
//! - `routers` **gateway replicas** each route a share of the arrivals (chosen at random), each
//!   with its own state and its own count of what it has in flight; precise replicas share the
//!   index (and, through it, the speculative entries their routings record, as kv-indexer's
//!   replicas share them through replication) ([`routers`]).
//!
//! Scenarios a router cannot foresee: pods of different capacity, traffic that bypasses the
//! routers (`bypass_fraction`), prefix-cache resets (`resets`: free cached blocks dropped) and
//! pod restarts (`restarts`: the pod is down for `restart_downtime_ms`, loses its cache and
//! publishes `AllBlocksCleared`; requests that had no token yet are retried through a router,
//! streams already started are cut; a request routed to a down pod goes to the live candidate
//! with the fewest of that replica's requests, as a gateway retries on connection refused, and
//! is counted), and the pool changing ([`membership`]: pods joining late, a pod whose server
//! stops answering for good). Each router picks among its candidates: the pool's Ready pods as
//! Kubernetes says (a restarting pod is not Ready a second after its restart), or for the
//! precise routers kv-core's membership rule over them (the daemon's picker).
//!
//! The event loop (`event_loop.rs`) keeps a run deterministic for a seed: events pop by time,
//! ties in the order they were queued, and the run's one random stream is drawn in the same
//! order every run.
//!
//! Prefill/decode pools run in a loop of their own ([`pd`]): prefill pods compute prompts whose
//! KV moves to decode pods at a transfer cost, routed by [`pd_routers`] (llm-d's approximate
//! split decision against the exact one, both through kv-core's split rule).

pub mod cache;
#[cfg(feature = "charts")]
pub mod charts;
pub mod engine;
mod event_loop;
pub mod family;
pub mod hybrid;
pub mod membership;
pub mod pd;
pub mod pd_routers;
pub mod pod;
pub mod policies;
pub mod prefix_score;
pub mod report;
pub mod request;
pub mod routers;
pub mod scheduler;
pub mod wire;
pub mod workloads;

use std::cmp::Ordering as CmpOrdering;

use serde::Serialize;

use kv_core::BlockHash;
use kv_core::SplitMix64;

use engine::{EngineConfig, EngineStats};
use family::ModelFamily;
pub use request::SimRequest;

/// Simulation settings.
#[derive(Debug, Clone, Serialize)]
pub struct SimSettings {
    /// KV blocks of each pod.
    pub pod_capacity_blocks: Vec<usize>,
    /// The engine model.
    pub engine: EngineConfig,
    /// The model's KV-cache groups (`Full`: the plain engine of the published figures).
    pub model_family: ModelFamily,
    /// Delay between a cache change and the index seeing it, ms.
    pub event_delay_ms: f64,
    /// How often pods' metrics are scraped for the routers, ms.
    pub scrape_interval_ms: f64,
    /// Gateway replicas, each routing a share of the arrivals with its own state.
    pub routers: usize,
    /// Share of requests that reach a random pod without passing a router.
    pub bypass_fraction: f64,
    /// (time ms, pod): the pod's prefix cache is reset (its free blocks dropped).
    pub resets: Vec<(f64, usize)>,
    /// (time ms, pod): the pod restarts.
    pub restarts: Vec<(f64, usize)>,
    /// How long a restarting pod takes no requests, ms.
    pub restart_downtime_ms: f64,
    /// Pods joining the pool late (a scale-out) and pods whose server stops answering.
    pub pool: membership::PoolChanges,
    /// RNG seed.
    pub seed: u64,
}

/// How long Kubernetes takes to mark a pod whose server stopped answering not Ready at its
/// readiness probe's defaults (`periodSeconds` 10 x `failureThreshold` 3), ms.
pub const DEFAULT_READINESS_DELAY_MS: f64 = 30_000.0;

/// KV tokens per pod in the published benchmark (llm-d, 8 x Qwen3-32B TP2 on H100).
pub const ANCHOR_KV_TOKENS: usize = 307_328;

impl Default for SimSettings {
    fn default() -> Self {
        Self {
            pod_capacity_blocks: vec![ANCHOR_KV_TOKENS / 16; 8],
            engine: EngineConfig::default(),
            model_family: ModelFamily::Full,
            event_delay_ms: 50.0,
            scrape_interval_ms: 50.0,
            routers: 1,
            bypass_fraction: 0.0,
            resets: Vec::new(),
            restarts: Vec::new(),
            restart_downtime_ms: 60_000.0,
            pool: membership::PoolChanges {
                joins: Vec::new(),
                kills: Vec::new(),
                readiness_delay_ms: DEFAULT_READINESS_DELAY_MS,
                probe_timeout_ms: 250.0,
                failures_to_leave: kv_core::DEFAULT_FAILURES_TO_LEAVE,
            },
            seed: 42,
        }
    }
}

/// How many leading blocks two prompts share (their common prefix, in blocks).
pub fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The simulation's random stream for `seed` (salted, so seed 0 is no special stream).
pub fn rng(seed: u64) -> SplitMix64 {
    SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_4E5B)
}

/// A pod's metrics as a gateway scrapes them (vLLM's `num_requests_waiting`,
/// `num_requests_running`, `kv_cache_usage_perc`, and `num_gpu_blocks` from its cache config).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PodMetrics {
    /// Requests waiting.
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Share of KV blocks held by requests.
    pub kv_usage: f64,
    /// KV blocks the engine has.
    pub num_gpu_blocks: usize,
}

/// One policy's results.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// The routing policy.
    pub policy: String,
    /// Requests that got their first token.
    pub requests: usize,
    /// Requests no pod can hold (prompt and output beyond a pod's whole cache), not run.
    pub rejected: usize,
    /// Prompt tokens found in the pod's cache on admission / all prompt tokens.
    pub token_hit_rate: f64,
    /// Tokens prefilled (prompt tokens not cached, and recomputation after preemption).
    pub prefill_tokens: u64,
    /// Time to first token, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Output tokens per second, from the first arrival to the last token.
    pub output_tokens_per_s: f64,
    /// Sequences preempted (all pods).
    pub preemptions: u64,
    /// Max over mean of pods' in-flight requests, averaged over arrivals.
    pub load_spread: f64,
    /// Engine counters summed over pods (the largest step over all).
    pub engine: EngineStats,
    /// Requests first routed to a pod that was down (a 503 behind a gateway without retries,
    /// such as GIE's; here retried on the least loaded live candidate).
    pub misrouted: usize,
    /// Requests that found no candidate at all (a 503), not run.
    pub refused: usize,
    /// Of the arrivals after the first late pod joined, the share routed to late pods (`None`:
    /// no pod joined late).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub late_share: Option<f64>,
    /// How the router's predicted hits compare with the hits the engines took (routers that
    /// predict: the precise ones).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<PredictionStats>,
}

/// A predicting router's expected hit on the pod it chose, against the hit the engine took
/// when it admitted the request (the cache may have changed in between, for every router
/// alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PredictionStats {
    /// Requests admitted with a prediction (routed, not bypassed, not retried).
    pub requests: usize,
    /// Predicted exactly.
    pub exact: usize,
    /// Predicted more than the engine reused (a pick made on a hit that was not there).
    pub over: usize,
    /// Predicted less.
    pub under: usize,
    /// Tokens predicted beyond the hits taken, summed over the over-predicted requests.
    pub over_tokens: u64,
}

impl PredictionStats {
    /// Counts one admitted request.
    pub fn record(&mut self, predicted: u64, taken: u64) {
        self.requests += 1;
        match predicted.cmp(&taken) {
            CmpOrdering::Equal => self.exact += 1,
            CmpOrdering::Greater => {
                self.over += 1;
                self.over_tokens += predicted - taken;
            }
            CmpOrdering::Less => self.under += 1,
        }
    }

    /// Share of the predicted requests predicted more than they got.
    pub fn over_share(&self) -> f64 {
        self.over as f64 / self.requests.max(1) as f64
    }

    /// Share predicted exactly.
    pub fn exact_share(&self) -> f64 {
        self.exact as f64 / self.requests.max(1) as f64
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The model name events and scores use inside the simulation.
pub const MODEL: &str = "sim/model";

/// Runs `requests` (sorted by arrival) against pods routed by `routers` (one per gateway
/// replica: `settings.routers` of them; arrivals are spread over them at random).
pub fn run(
    settings: &SimSettings,
    requests: &[SimRequest],
    routers: &mut [Box<dyn routers::Router>],
) -> PolicyReport {
    assert!(!routers.is_empty(), "at least one router");
    let mut sim = event_loop::Sim::new(settings, requests, routers);
    sim.run_events();
    sim.report()
}
