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
//! Prefill/decode pools run in a loop of their own ([`pd`]): prefill pods compute prompts whose
//! KV moves to decode pods at a transfer cost, routed by [`pd_routers`] (llm-d's approximate
//! split decision against the exact one, both through kv-core's split rule).

pub mod cache;
#[cfg(feature = "charts")]
pub mod charts;
pub mod engine;
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
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use serde::Serialize;

use kv_core::decode_batch;
use kv_core::BlockHash;
use kv_core::SplitMix64;
use kv_core::{EngineHashes, Indexer, IndexerSettings};

use engine::{EngineConfig, EngineStats};
use family::ModelFamily;
use pod::PodEngine;
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

#[derive(Debug)]
enum EventKind {
    Arrival(usize),
    /// (pod, its incarnation when the step started).
    StepDone(usize, u32),
    Deliver(usize, Vec<u8>),
    Reset(usize),
    Restart(usize),
    /// The pod's server stops answering for good (its blocks stay in the index).
    Kill(usize),
    /// A request a restart lost before its first token comes back to a router.
    Retry(usize),
    /// A restarted pod takes requests again.
    Up(usize),
    /// The gateways scrape every pod's metrics (and the index expires speculative entries).
    Scrape,
}

struct Event {
    at: f64,
    order: u64,
    kind: EventKind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.order == o.order
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        // Min-heap by time, then by insertion order.
        o.at.total_cmp(&self.at).then(o.order.cmp(&self.order))
    }
}

struct Pod {
    engine: PodEngine,
    /// A step is in flight.
    stepping: bool,
    /// Bumped by a restart: steps of an earlier incarnation are void.
    incarnation: u32,
    /// The pod takes requests again from this time.
    down_until: f64,
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
    let mut index_settings = IndexerSettings::default();
    if settings.model_family.is_hybrid() {
        // The simulated engines publish the index's keys; an engine whose groups' blocks are
        // wider than the unit (Mamba's 576 tokens) carries no token ids to show it, so the
        // index is told rather than left to decide per engine.
        index_settings.default_model.engine_hashes = EngineHashes::Aligned;
    }
    let indexer = Indexer::new(index_settings).expect("default settings are valid");
    let epoch = Instant::now();
    let at = |ms: f64| epoch + Duration::from_secs_f64(ms.max(0.0) / 1_000.0);
    let pod_names: Vec<String> = (0..settings.pod_capacity_blocks.len())
        .map(|p| format!("10.9.0.{p}:8000"))
        .collect();
    let mut pods: Vec<Pod> = settings
        .pod_capacity_blocks
        .iter()
        .map(|&c| Pod {
            engine: PodEngine::new(settings.engine, settings.model_family, c),
            stepping: false,
            incarnation: 0,
            down_until: f64::NEG_INFINITY,
        })
        .collect();
    let n_pods = pods.len();
    let mut rng = rng(settings.seed);
    let mut heap = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<Event>, at: f64, kind: EventKind| {
        order += 1;
        heap.push(Event { at, order, kind });
    };
    for (i, r) in requests.iter().enumerate() {
        push(&mut heap, r.arrival_ms, EventKind::Arrival(i));
    }
    for &(t, pod) in &settings.resets {
        if pod < n_pods {
            push(&mut heap, t, EventKind::Reset(pod));
        }
    }
    for &(t, pod) in &settings.restarts {
        if pod < n_pods {
            push(&mut heap, t, EventKind::Restart(pod));
        }
    }
    for &(t, pod) in &settings.pool.kills {
        if pod < n_pods {
            push(&mut heap, t, EventKind::Kill(pod));
        }
    }
    let mut pool = membership::SimPool::new(&pod_names, &settings.pool);
    let first_join = pool.first_join();
    let (mut misrouted, mut refused, mut after_join, mut on_late) = (0, 0, 0usize, 0usize);
    push(&mut heap, 0.0, EventKind::Scrape);
    let mut scraped = vec![PodMetrics::default(); n_pods];
    let mut scraped_ms = 0.0;
    // Per gateway replica, its requests in flight per pod; per request, (replica, pod).
    let mut in_flight = vec![vec![0usize; n_pods]; routers.len()];
    let mut placed: Vec<Option<(usize, usize)>> = vec![None; requests.len()];
    // Per request, the hit its router predicted on the pod it went to.
    let mut predicted: Vec<Option<u64>> = vec![None; requests.len()];
    let mut prediction = PredictionStats::default();
    let indexed = routers[0].indexed_groups();
    let hybrid = settings.model_family.is_hybrid();
    let mut unfinished = requests.len();
    let mut ttft = Vec::with_capacity(requests.len());
    let (mut hit_tokens, mut prompt_tokens, mut prefill_tokens) = (0u64, 0u64, 0u64);
    let (mut output_tokens, mut last_token_ms, mut rejected) = (0u64, 0.0f64, 0usize);
    let mut stats = EngineStats::default();
    let (mut spread_sum, mut spread_n) = (0.0, 0usize);
    let first_arrival = requests.first().map_or(0.0, |r| r.arrival_ms);
    while let Some(Event { at: now, kind, .. }) = heap.pop() {
        let mut touched = None;
        match kind {
            EventKind::Arrival(i) | EventKind::Retry(i) => {
                let retry = matches!(kind, EventKind::Retry(_));
                if !pods[0].engine.fits(&requests[i]) && !retry {
                    rejected += 1;
                    unfinished -= 1;
                    continue;
                }
                let totals: Vec<usize> = (0..n_pods)
                    .map(|p| in_flight.iter().map(|r| r[p]).sum())
                    .collect();
                let total: usize = totals.iter().sum();
                if total > 0 && !retry {
                    let max = totals.iter().copied().max().unwrap_or(0) as f64;
                    spread_sum += max / (total as f64 / n_pods as f64);
                    spread_n += 1;
                }
                let replica = rng.below(routers.len() as u64) as usize;
                let candidates = pool.candidates(routers[replica].candidate_rule(), now);
                if candidates.is_empty() {
                    refused += 1;
                    unfinished -= 1;
                    continue;
                }
                let pod = if settings.bypass_fraction > 0.0 && rng.unit() < settings.bypass_fraction
                {
                    // Traffic around the routers reaches a Ready pod.
                    let ready = pool.candidates(membership::CandidateRule::Ready, now);
                    let among = if ready.is_empty() {
                        &candidates
                    } else {
                        &ready
                    };
                    among[rng.below(among.len() as u64) as usize]
                } else {
                    let ctx = routers::RouterContext {
                        now_ms: now,
                        instant: at(now),
                        in_flight: &in_flight[replica],
                        scraped: &scraped,
                        scraped_ms,
                        scrape_interval_ms: settings.scrape_interval_ms,
                        indexer: &indexer,
                        model: MODEL,
                        pod_names: &pod_names,
                        candidates: &candidates,
                        score_before_last_token: hybrid,
                    };
                    let p = routers[replica].route(&requests[i], &ctx).min(n_pods - 1);
                    // A down pod does not serve; the gateway retries on the live candidate with
                    // the fewest of its requests, and knows where the request went.
                    let p = if pods[p].down_until > now {
                        misrouted += 1;
                        candidates
                            .iter()
                            .copied()
                            .filter(|&q| pods[q].down_until <= now)
                            .min_by_key(|&q| (in_flight[replica][q], q))
                            .unwrap_or(p)
                    } else {
                        p
                    };
                    routers[replica].routed(&requests[i], p, &ctx);
                    predicted[i] = routers[replica].predicted_hit_tokens(&requests[i], p);
                    p
                };
                if !pods[pod].engine.fits(&requests[i]) {
                    rejected += 1;
                    unfinished -= 1;
                    continue;
                }
                if first_join.is_some_and(|t| now >= t) && !retry {
                    after_join += 1;
                    on_late += usize::from(pool.joined_late(pod));
                }
                in_flight[replica][pod] += 1;
                placed[i] = Some((replica, pod));
                pods[pod].engine.add(i);
                touched = Some(pod);
            }
            EventKind::StepDone(p, incarnation) => {
                if pods[p].incarnation != incarnation {
                    continue;
                }
                pods[p].stepping = false;
                let end = pods[p].engine.complete(requests, indexed);
                for &i in &end.first_tokens {
                    ttft.push(now - requests[i].arrival_ms);
                }
                for &i in &end.finished {
                    if let Some((replica, pod)) = placed[i].take() {
                        in_flight[replica][pod] -= 1;
                    }
                    unfinished -= 1;
                }
                prefill_tokens += end.prefill_tokens;
                output_tokens += end.output_tokens;
                if end.output_tokens > 0 {
                    last_token_ms = now;
                }
                if let Some(payload) = end.payload {
                    push(
                        &mut heap,
                        now + settings.event_delay_ms,
                        EventKind::Deliver(p, payload),
                    );
                }
                touched = Some(p);
            }
            EventKind::Deliver(p, payload) => {
                pool.published(p);
                if let Ok(batch) = decode_batch(&payload) {
                    let _ = indexer.apply_batch_at(MODEL, &pod_names[p], &batch, at(now));
                }
            }
            EventKind::Reset(p) => {
                if let Some(payload) = pods[p].engine.reset_prefix_cache(indexed) {
                    push(
                        &mut heap,
                        now + settings.event_delay_ms,
                        EventKind::Deliver(p, payload),
                    );
                }
            }
            EventKind::Restart(p) | EventKind::Kill(p) => {
                let killed = matches!(kind, EventKind::Kill(_));
                let pod = &mut pods[p];
                pod.incarnation += 1;
                pod.stepping = false;
                pod.down_until = match killed {
                    true => f64::INFINITY,
                    false => now + settings.restart_downtime_ms,
                };
                let (retry, cut) = pod.engine.restart();
                for i in cut {
                    // Its stream is cut: the client saw its first tokens, then an error.
                    if let Some((replica, q)) = placed[i].take() {
                        in_flight[replica][q] -= 1;
                    }
                    unfinished -= 1;
                }
                for i in retry {
                    if let Some((replica, q)) = placed[i].take() {
                        in_flight[replica][q] -= 1;
                    }
                    push(&mut heap, now, EventKind::Retry(i));
                }
                // The restarted engine's first batch clears what the index held for it; a killed
                // one publishes nothing again, and the index keeps its blocks.
                if !killed {
                    pool.restarting(p, now, pod.down_until);
                    push(
                        &mut heap,
                        now + settings.event_delay_ms,
                        EventKind::Deliver(p, wire::cleared()),
                    );
                    push(&mut heap, pod.down_until, EventKind::Up(p));
                }
            }
            EventKind::Up(p) => touched = Some(p),
            EventKind::Scrape => {
                for (m, pod) in scraped.iter_mut().zip(&pods) {
                    *m = PodMetrics {
                        waiting: pod.engine.waiting(),
                        running: pod.engine.running(),
                        kv_usage: pod.engine.kv_usage(),
                        num_gpu_blocks: pod.engine.capacity_blocks(),
                    };
                }
                scraped_ms = now;
                pool.scrape(now, |p| pods[p].down_until > now);
                indexer.expire_speculation(at(now));
                if unfinished > 0 {
                    push(
                        &mut heap,
                        now + settings.scrape_interval_ms,
                        EventKind::Scrape,
                    );
                }
            }
        }
        // A pod that is idle and has work starts its next step.
        if let Some(p) = touched {
            let pod = &mut pods[p];
            if !pod.stepping && pod.down_until <= now {
                if let Some(step) = pod.engine.schedule(requests) {
                    for &(i, hit) in &step.admitted {
                        if let Some(expected) = predicted[i].take() {
                            prediction.record(expected, hit);
                        }
                        hit_tokens += hit;
                        prompt_tokens += requests[i].prompt_tokens;
                    }
                    pod.stepping = true;
                    let incarnation = pod.incarnation;
                    push(
                        &mut heap,
                        now + step.duration_ms,
                        EventKind::StepDone(p, incarnation),
                    );
                }
            }
        }
    }
    for pod in &pods {
        let s = pod.engine.stats();
        stats.steps += s.steps;
        stats.preemptions += s.preemptions;
        stats.max_step_tokens = stats.max_step_tokens.max(s.max_step_tokens);
        stats.max_step_seqs = stats.max_step_seqs.max(s.max_step_seqs);
    }
    ttft.sort_by(f64::total_cmp);
    let span_s = (last_token_ms - first_arrival).max(1.0) / 1_000.0;
    PolicyReport {
        policy: routers[0].name(),
        requests: ttft.len(),
        rejected,
        token_hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            hit_tokens as f64 / prompt_tokens as f64
        },
        prefill_tokens,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_mean_ms: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        output_tokens_per_s: output_tokens as f64 / span_s,
        preemptions: stats.preemptions,
        load_spread: if spread_n == 0 {
            1.0
        } else {
            spread_sum / spread_n as f64
        },
        engine: stats,
        misrouted,
        refused,
        late_share: first_join.map(|_| on_late as f64 / after_join.max(1) as f64),
        prediction: (prediction.requests > 0).then_some(prediction),
    }
}
