//! Prefill/decode (P/D) disaggregation in the simulator: a pool of prefill pods and decode
//! pods (plain engines, [`super::engine`]), routed by a [`PdRouter`] that picks the decode pod
//! and, when kv-core's split rule says so, a prefill pod.
//!
//! The flow is llm-d's with vLLM's NIXL connector (pull mode, vLLM 0.33):
//! - **not split**: the decode pod prefills and decodes the request, as an aggregated pod;
//! - **split**: the prefill pod runs the request with one output token (the sidecar's
//!   `max_tokens=1`), computing what its own prefix cache does not hold and keeping the blocks
//!   cached afterwards (its LRU evicts them later). When it finishes, the decode pod looks up
//!   its own cache, pins what it holds and allocates the rest of the prompt's full blocks
//!   (they are not hits yet); those are pulled at [`TransferCost`] per token. When the pull
//!   ends the blocks join the decode pod's prefix cache (published as `BlockStored` then, as
//!   vLLM caches them only after the transfer) and the request queues on the decode pod, which
//!   hits them, computes the rest (at most a partial block and the last token) and samples the
//!   first token: TTFT is arrival to that step's end. The blocks stay pinned while the pull
//!   runs, then are cached and free until the request is admitted (vLLM keeps them allocated to
//!   the request; here a long queue may evict them first, and the decode pod recomputes them).
//!   A prefill pod that cannot hold the request (smaller than its decode pod) leaves it whole.
//!
//! Both pods publish their events into one real index (after `event_delay_ms`); metrics are
//! scraped every `scrape_interval_ms`. Prefill work is every token computed, on either kind of
//! pod; transfer volume is the tokens pulled.
//!
//! Invariants (tested in `pd_tests.rs`): every request that fits gets its first token once and
//! finishes once on its decode pod; a split request's prefill pod finishes it once; a threshold
//! of 0 never splits and moves nothing; no block stays pinned once all requests are done.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use serde::Serialize;

use kv_core::{decode_batch, BlockHash, Indexer, IndexerSettings, SplitRule};

use super::engine::{Engine, EngineStats};
use super::pd_routers::{route, PdRouter};
use super::routers::RouterContext;
use super::scheduler::Blocks;
use super::{percentile, wire, PodMetrics, SimRequest, SimSettings, MODEL};

/// The cost of moving KV from a prefill pod to a decode pod.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TransferCost {
    /// Fixed cost of one transfer, ms.
    pub base_ms: f64,
    /// Cost per token pulled, ms.
    pub ms_per_token: f64,
}

impl Default for TransferCost {
    /// Qwen3-32B's KV (256 KiB per token: 64 layers, 8 KV heads of 128, K and V in BF16) over
    /// the two 400 Gb/s RDMA NICs of a TP-2 pod (one per H100, as in a DGX H100) at an assumed
    /// 50% efficiency: 262,144 B / 50 GB/s = 5.24 us per token. The 1 ms per transfer (the
    /// sidecar's extra request and the NIXL handshake) and the 50% are assumptions, not
    /// measurements.
    fn default() -> Self {
        Self {
            base_ms: 1.0,
            ms_per_token: 0.005_24,
        }
    }
}

/// A P/D simulation's settings.
#[derive(Debug, Clone, Serialize)]
pub struct PdSettings {
    /// Engines, pods' capacities (prefill pods first), delays, seed.
    pub sim: SimSettings,
    /// How many of the pods (the first ones) prefill; the others decode.
    pub prefill_pods: usize,
    /// When a prefill is split off (its threshold is in the report).
    #[serde(skip)]
    pub rule: SplitRule,
    /// KV transfer cost.
    pub transfer: TransferCost,
}

/// One request's fate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PdOutcome {
    /// Its decode pod (`None`: rejected, too large for a pod).
    pub decode: Option<usize>,
    /// Its prefill pod when split.
    pub prefill: Option<usize>,
    /// The prompt tokens the router believed the decode pod holds.
    pub believed_cached: u64,
    /// The hit the index gave for the decode pod at the decision (what the exact rule uses).
    pub exact_cached: u64,
    /// The prompt tokens the decode pod's engine found cached when it admitted the request.
    pub decode_hit: Option<u64>,
    /// Tokens pulled from the prefill pod.
    pub pulled: u64,
    /// Arrival to first token, ms.
    pub ttft_ms: Option<f64>,
    /// First tokens sampled on the decode pod (1 when conserved).
    pub first_tokens: u32,
    /// Times it finished on the decode pod (1 when conserved).
    pub finished: u32,
    /// Times a prefill pod finished its prefill (1 when split).
    pub prefilled: u32,
}

/// A P/D run's results.
#[derive(Debug, Clone, Serialize)]
pub struct PdReport {
    /// The router.
    pub policy: String,
    /// The split rule's threshold (uncached tokens on the decode pod).
    pub threshold: u32,
    /// Prefill pods.
    pub prefill_pods: usize,
    /// Decode pods.
    pub decode_pods: usize,
    /// Requests that got their first token.
    pub requests: usize,
    /// Requests no pod can hold.
    pub rejected: usize,
    /// Requests split.
    pub splits: usize,
    /// Splits over routed requests.
    pub split_rate: f64,
    /// Decisions the exact rule (on the index's hit at that moment) would have taken otherwise:
    /// split although the decode pod held all but fewer than the threshold's tokens.
    pub needless_splits: usize,
    /// ... and kept whole although at least the threshold's tokens were uncached.
    pub missed_splits: usize,
    /// Time to first token, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Tokens computed on prefill pods.
    pub prefill_tokens_on_prefill: u64,
    /// Prompt (and recomputed) tokens computed on decode pods.
    pub prefill_tokens_on_decode: u64,
    /// Tokens pulled from prefill pods to decode pods.
    pub transfer_tokens: u64,
    /// Output tokens per second, first arrival to last token.
    pub output_tokens_per_s: f64,
    /// Engine counters summed over pods.
    pub engine: EngineStats,
    /// Block pins left over all pods at the end (0: every block was given back).
    pub pins_left: u64,
    /// Per request, in the workload's order.
    #[serde(skip)]
    pub outcomes: Vec<PdOutcome>,
}

impl PdReport {
    /// Every token computed for prompts, on either kind of pod.
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens_on_prefill + self.prefill_tokens_on_decode
    }
}

/// What the event queue holds; ordered by (time bits, insertion order) only.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Arrival(usize),
    StepDone(usize),
    Deliver(usize, Vec<u8>),
    /// A split request's pull into its decode pod ends.
    Pulled(usize),
    Scrape,
}

/// A pull in flight: the blocks the decode pod holds for the request (local hits, then
/// allocated ones), from which block the pulled ones start.
struct Pull {
    held: Vec<BlockHash>,
    first_pulled: usize,
}

struct PdSim<'a> {
    settings: &'a PdSettings,
    requests: &'a [SimRequest],
    /// The requests as a prefill pod runs them (one output token).
    prefill_requests: Vec<SimRequest>,
    indexer: Indexer,
    epoch: Instant,
    names: Vec<String>,
    pods: Vec<Engine>,
    stepping: Vec<bool>,
    heap: BinaryHeap<Reverse<(u64, u64, Kind)>>,
    order: u64,
    in_flight: Vec<usize>,
    scraped: Vec<PodMetrics>,
    scraped_ms: f64,
    /// Per request, its pull while in flight.
    pulls: Vec<Option<Pull>>,
    outcomes: Vec<PdOutcome>,
    report: PdReport,
    unfinished: usize,
    ttft: Vec<f64>,
    output_tokens: u64,
    last_token_ms: f64,
}

/// Runs `requests` (sorted by arrival) on the P/D pool of `settings`, routed by `router`.
pub fn run_pd(
    settings: &PdSettings,
    requests: &[SimRequest],
    router: &mut dyn PdRouter,
) -> PdReport {
    let mut sim = PdSim::new(settings, requests, router.name());
    for (i, r) in requests.iter().enumerate() {
        sim.push(r.arrival_ms, Kind::Arrival(i));
    }
    sim.push(0.0, Kind::Scrape);
    while let Some(Reverse((bits, _, kind))) = sim.heap.pop() {
        let now = f64::from_bits(bits);
        let touched = match kind {
            Kind::Arrival(i) => sim.arrival(i, now, router),
            Kind::StepDone(p) => sim.step_done(p, now),
            Kind::Deliver(p, payload) => {
                if let Ok(batch) = decode_batch(&payload) {
                    let _ = sim
                        .indexer
                        .apply_batch_at(MODEL, &sim.names[p], &batch, sim.at(now));
                }
                None
            }
            Kind::Pulled(i) => sim.pulled(i, now),
            Kind::Scrape => sim.scrape(now),
        };
        if let Some(p) = touched {
            sim.start_step(p, now);
        }
    }
    sim.finish()
}

impl<'a> PdSim<'a> {
    fn new(settings: &'a PdSettings, requests: &'a [SimRequest], policy: String) -> Self {
        let n = settings.sim.pod_capacity_blocks.len();
        let prefill_pods = settings.prefill_pods.min(n);
        let indexer = Indexer::new(IndexerSettings::default()).expect("default settings are valid");
        let prefill_requests = requests
            .iter()
            .map(|r| SimRequest {
                output_tokens: 1,
                ..r.clone()
            })
            .collect();
        Self {
            settings,
            requests,
            prefill_requests,
            indexer,
            epoch: Instant::now(),
            names: (0..n).map(|p| format!("10.9.1.{p}:8000")).collect(),
            pods: (settings.sim.pod_capacity_blocks.iter())
                .map(|&c| Engine::new(settings.sim.engine, c))
                .collect(),
            stepping: vec![false; n],
            heap: BinaryHeap::new(),
            order: 0,
            in_flight: vec![0; n],
            scraped: vec![PodMetrics::default(); n],
            scraped_ms: 0.0,
            pulls: (0..requests.len()).map(|_| None).collect(),
            outcomes: vec![PdOutcome::default(); requests.len()],
            report: PdReport {
                policy,
                threshold: settings.rule.threshold,
                prefill_pods,
                decode_pods: n - prefill_pods,
                requests: 0,
                rejected: 0,
                splits: 0,
                split_rate: 0.0,
                needless_splits: 0,
                missed_splits: 0,
                ttft_p50_ms: 0.0,
                ttft_p90_ms: 0.0,
                ttft_p99_ms: 0.0,
                ttft_mean_ms: 0.0,
                prefill_tokens_on_prefill: 0,
                prefill_tokens_on_decode: 0,
                transfer_tokens: 0,
                output_tokens_per_s: 0.0,
                engine: EngineStats::default(),
                pins_left: 0,
                outcomes: Vec::new(),
            },
            unfinished: requests.len(),
            ttft: Vec::with_capacity(requests.len()),
            output_tokens: 0,
            last_token_ms: 0.0,
        }
    }

    fn push(&mut self, at: f64, kind: Kind) {
        self.order += 1;
        self.heap
            .push(Reverse((at.max(0.0).to_bits(), self.order, kind)));
    }

    fn at(&self, ms: f64) -> Instant {
        self.epoch + Duration::from_secs_f64(ms.max(0.0) / 1_000.0)
    }

    fn is_prefill(&self, p: usize) -> bool {
        p < self.report.prefill_pods
    }

    fn context<'c>(&'c self, now: f64, candidates: &'c [usize]) -> RouterContext<'c> {
        RouterContext {
            now_ms: now,
            instant: self.at(now),
            in_flight: &self.in_flight,
            scraped: &self.scraped,
            scraped_ms: self.scraped_ms,
            scrape_interval_ms: self.settings.sim.scrape_interval_ms,
            indexer: &self.indexer,
            model: MODEL,
            pod_names: &self.names,
            candidates,
            score_before_last_token: false,
        }
    }

    /// Routes request `i`; the pod to step.
    fn arrival(&mut self, i: usize, now: f64, router: &mut dyn PdRouter) -> Option<usize> {
        let requests = self.requests;
        let req = &requests[i];
        let n = self.pods.len();
        let (prefill, decode): (Vec<usize>, Vec<usize>) = (0..n).partition(|&p| self.is_prefill(p));
        if decode.is_empty() || !self.pods[decode[0]].fits(req) {
            self.report.rejected += 1;
            self.unfinished -= 1;
            return None;
        }
        let pick = {
            let decode_ctx = self.context(now, &decode);
            let prefill_ctx = self.context(now, &prefill);
            route(router, self.settings.rule, req, &decode_ctx, &prefill_ctx)
        };
        let tokens = |t: u64| u32::try_from(t).unwrap_or(u32::MAX);
        let exact = pick.exact_cached;
        let exact_rule =
            kv_core::decide(self.settings.rule, tokens(req.prompt_tokens), tokens(exact));
        match (pick.decision.split, exact_rule.split) {
            (true, false) => self.report.needless_splits += 1,
            (false, true) => self.report.missed_splits += 1,
            _ => {}
        }
        let outcome = &mut self.outcomes[i];
        outcome.decode = Some(pick.decode);
        outcome.believed_cached = pick.believed_cached;
        outcome.exact_cached = exact;
        self.in_flight[pick.decode] += 1;
        // A prefill pod too small for the request (smaller than the decode pods) leaves it whole.
        let prefill_pod = pick
            .prefill
            .filter(|&p| self.pods[p].fits(&self.prefill_requests[i]));
        self.outcomes[i].prefill = prefill_pod;
        let pod = match prefill_pod {
            Some(p) => {
                self.report.splits += 1;
                p
            }
            None => pick.decode,
        };
        if pod != pick.decode {
            self.in_flight[pod] += 1;
        }
        self.pods[pod].add(i);
        Some(pod)
    }

    fn step_done(&mut self, p: usize, now: f64) -> Option<usize> {
        self.stepping[p] = false;
        let prefill = self.is_prefill(p);
        let reqs = match prefill {
            true => &self.prefill_requests[..],
            false => self.requests,
        };
        let end = self.pods[p].complete(reqs);
        if !end.stored.is_empty() || !end.removed.is_empty() {
            let payload = wire::step(&end.removed, &end.stored, self.pods[p].block_size());
            self.push(
                now + self.settings.sim.event_delay_ms,
                Kind::Deliver(p, payload),
            );
        }
        self.output_tokens += if prefill { 0 } else { end.output_tokens };
        if prefill {
            self.report.prefill_tokens_on_prefill += end.prefill_tokens;
            for &i in &end.finished {
                self.in_flight[p] -= 1;
                self.outcomes[i].prefilled += 1;
                self.start_pull(i, now);
            }
            return Some(p);
        }
        self.report.prefill_tokens_on_decode += end.prefill_tokens;
        if end.output_tokens > 0 {
            self.last_token_ms = now;
        }
        for &i in &end.first_tokens {
            let ttft = now - self.requests[i].arrival_ms;
            self.ttft.push(ttft);
            self.outcomes[i].ttft_ms = Some(ttft);
            self.outcomes[i].first_tokens += 1;
        }
        for &i in &end.finished {
            self.in_flight[p] -= 1;
            self.outcomes[i].finished += 1;
            self.unfinished -= 1;
        }
        Some(p)
    }

    /// The decode pod of split request `i` pins the prompt's blocks it holds and allocates the
    /// rest (evicting as it must); the pull of those takes the transfer's time.
    fn start_pull(&mut self, i: usize, now: f64) {
        let Some(d) = self.outcomes[i].decode else {
            return;
        };
        let requests = self.requests;
        let req = &requests[i];
        let engine = &mut self.pods[d];
        let (mut held, mut evicted) = (Vec::new(), Vec::new());
        let mut first_pulled = None;
        for (k, &h) in req.blocks.iter().enumerate() {
            if first_pulled.is_none() && engine.cache.is_hit(h) {
                engine.cache.pin(h);
            } else {
                first_pulled.get_or_insert(k);
                match engine.cache.allocate(h, &mut evicted) {
                    Some(id) => {
                        held.push(id);
                        continue;
                    }
                    // Every block is held: the rest is computed by the decode pod.
                    None => break,
                }
            }
            held.push(h);
        }
        let first_pulled = first_pulled.unwrap_or(held.len());
        let pulled = (held.len() - first_pulled) as u64 * engine.block_size();
        if !evicted.is_empty() {
            let payload = wire::removed(&evicted);
            self.push(
                now + self.settings.sim.event_delay_ms,
                Kind::Deliver(d, payload),
            );
        }
        self.pulls[i] = Some(Pull { held, first_pulled });
        self.outcomes[i].pulled = pulled;
        self.report.transfer_tokens += pulled;
        let cost = self.settings.transfer;
        let done = now + cost.base_ms + cost.ms_per_token * pulled as f64;
        self.push(done, Kind::Pulled(i));
    }

    /// The pull of request `i` ends: its blocks join the decode pod's prefix cache and it
    /// queues there.
    fn pulled(&mut self, i: usize, now: f64) -> Option<usize> {
        let d = self.outcomes[i].decode?;
        let requests = self.requests;
        let req = &requests[i];
        let engine = &mut self.pods[d];
        let bs = engine.block_size();
        let mut runs = Vec::new();
        if let Some(pull) = &self.pulls[i] {
            let span = (pull.first_pulled as u64 * bs, pull.held.len() as u64 * bs);
            engine
                .blocks
                .stored(&mut engine.cache, req, &pull.held, span, &mut runs);
        }
        if !runs.is_empty() {
            let payload = wire::step(&[], &runs, bs);
            self.push(
                now + self.settings.sim.event_delay_ms,
                Kind::Deliver(d, payload),
            );
        }
        // Cached and free from now (the most recently freed, so evicted last): held on until
        // admission, pulls queued behind a request that needs their memory would never run.
        if let Some(mut pull) = self.pulls[i].take() {
            let cache = &mut self.pods[d].cache;
            <super::engine::PlainBlocks as Blocks>::release(cache, &mut pull.held);
        }
        self.pods[d].add(i);
        Some(d)
    }

    fn start_step(&mut self, p: usize, now: f64) {
        if self.stepping[p] {
            return;
        }
        let prefill = self.is_prefill(p);
        let reqs = match prefill {
            true => &self.prefill_requests[..],
            false => self.requests,
        };
        let Some(step) = self.pods[p].schedule(reqs) else {
            return;
        };
        for &(i, hit) in &step.admitted {
            if !prefill {
                self.outcomes[i].decode_hit = Some(hit);
            }
        }
        self.stepping[p] = true;
        self.push(now + step.duration_ms, Kind::StepDone(p));
    }

    fn scrape(&mut self, now: f64) -> Option<usize> {
        for (m, pod) in self.scraped.iter_mut().zip(&self.pods) {
            *m = PodMetrics {
                waiting: pod.waiting(),
                running: pod.running(),
                kv_usage: pod.kv_usage(),
                num_gpu_blocks: pod.capacity_blocks(),
            };
        }
        self.scraped_ms = now;
        self.indexer.expire_speculation(self.at(now));
        if self.unfinished > 0 {
            self.push(now + self.settings.sim.scrape_interval_ms, Kind::Scrape);
        }
        None
    }

    fn finish(mut self) -> PdReport {
        let mut report = self.report;
        report.pins_left = self.pods.iter().map(|e| e.pin_balance().0).sum();
        for pod in &self.pods {
            let s = pod.stats;
            report.engine.steps += s.steps;
            report.engine.preemptions += s.preemptions;
            report.engine.max_step_tokens = report.engine.max_step_tokens.max(s.max_step_tokens);
            report.engine.max_step_seqs = report.engine.max_step_seqs.max(s.max_step_seqs);
        }
        self.ttft.sort_by(f64::total_cmp);
        let routed = self.requests.len() - report.rejected;
        report.requests = self.ttft.len();
        report.split_rate = report.splits as f64 / routed.max(1) as f64;
        report.ttft_p50_ms = percentile(&self.ttft, 50.0);
        report.ttft_p90_ms = percentile(&self.ttft, 90.0);
        report.ttft_p99_ms = percentile(&self.ttft, 99.0);
        report.ttft_mean_ms = self.ttft.iter().sum::<f64>() / self.ttft.len().max(1) as f64;
        let first = self.requests.first().map_or(0.0, |r| r.arrival_ms);
        let span_s = (self.last_token_ms - first).max(1.0) / 1_000.0;
        report.output_tokens_per_s = self.output_tokens as f64 / span_s;
        report.outcomes = self.outcomes;
        report
    }
}

#[cfg(test)]
#[path = "pd_tests.rs"]
mod tests;
