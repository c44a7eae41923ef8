//! The event loop behind [`super::run`]: one run's state ([`Sim`]), built with its seeded event
//! queue, stepped one event at a time, then summed into a [`PolicyReport`].
//!
//! Invariants (what keeps a run deterministic for a seed):
//! - events pop by time, ties by the order they were pushed ([`Sim::push`] numbers them);
//! - the run's one random stream is drawn only on arrivals and retries, in the same order
//!   every run: the gateway replica, then (with bypass traffic) the bypass draw and its pod;
//! - a step that ends after its pod restarted belongs to an earlier incarnation and is void;
//! - every request in flight is counted once in its replica's `in_flight` and leaves it when
//!   it finishes, is cut, or is retried.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use kv_core::{decode_batch, EngineHashes, Indexer, IndexerSettings, SplitMix64};

use super::engine::EngineStats;
use super::family::IndexedGroups;
use super::membership::{CandidateRule, SimPool};
use super::pod::PodEngine;
use super::routers::{Router, RouterContext};
use super::{percentile, rng, wire, PodMetrics, PolicyReport, PredictionStats};
use super::{SimRequest, SimSettings, MODEL};

/// What happens at an event's time.
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

/// One queued event: the heap orders them by `at`, then by `order` (push order).
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

/// A simulated pod: its engine and what the loop knows of its life.
struct Pod {
    engine: PodEngine,
    /// A step is in flight.
    stepping: bool,
    /// Bumped by a restart: steps of an earlier incarnation are void.
    incarnation: u32,
    /// The pod takes requests again from this time.
    down_until: f64,
}

/// What the report sums, counted as the run goes.
#[derive(Default)]
struct Tally {
    rejected: usize,
    misrouted: usize,
    refused: usize,
    /// Arrivals after the first late pod joined, and those of them routed to a late pod.
    after_join: usize,
    on_late: usize,
    ttft: Vec<f64>,
    hit_tokens: u64,
    prompt_tokens: u64,
    prefill_tokens: u64,
    output_tokens: u64,
    last_token_ms: f64,
    /// Max over mean of pods' in-flight requests, summed over arrivals, and how many.
    spread_sum: f64,
    spread_n: usize,
    prediction: PredictionStats,
}

/// One run's state: the pods, the index they publish to, the gateway replicas' view, the
/// event queue and the tally.
pub(super) struct Sim<'a> {
    settings: &'a SimSettings,
    requests: &'a [SimRequest],
    routers: &'a mut [Box<dyn Router>],
    indexer: Indexer,
    /// Simulated time 0 as the index's clock sees it.
    epoch: Instant,
    pod_names: Vec<String>,
    pods: Vec<Pod>,
    rng: SplitMix64,
    heap: BinaryHeap<Event>,
    /// Events pushed so far (ties in time pop in push order).
    order: u64,
    pool: SimPool,
    first_join: Option<f64>,
    scraped: Vec<PodMetrics>,
    scraped_ms: f64,
    /// Per gateway replica, its requests in flight per pod.
    in_flight: Vec<Vec<usize>>,
    /// Per request in flight, (replica, pod).
    placed: Vec<Option<(usize, usize)>>,
    /// Per request, the hit its router predicted on the pod it went to.
    predicted: Vec<Option<u64>>,
    /// The groups the index is fed (the first router's).
    indexed: IndexedGroups,
    /// Requests neither finished, cut, rejected nor refused (scrapes stop at 0).
    unfinished: usize,
    tally: Tally,
}

impl<'a> Sim<'a> {
    /// The run's index and pods, with arrivals, resets, restarts, kills and the first scrape
    /// queued (in that order: it numbers their ties).
    pub(super) fn new(
        settings: &'a SimSettings,
        requests: &'a [SimRequest],
        routers: &'a mut [Box<dyn Router>],
    ) -> Self {
        let pod_names: Vec<String> = (0..settings.pod_capacity_blocks.len())
            .map(|p| format!("10.9.0.{p}:8000"))
            .collect();
        let pods: Vec<Pod> = (settings.pod_capacity_blocks.iter())
            .map(|&c| Pod {
                engine: PodEngine::new(settings.engine, settings.model_family, c),
                stepping: false,
                incarnation: 0,
                down_until: f64::NEG_INFINITY,
            })
            .collect();
        let n_pods = pods.len();
        let pool = SimPool::new(&pod_names, &settings.pool);
        let mut sim = Self {
            settings,
            requests,
            indexer: Indexer::new(index_settings(settings)).expect("default settings are valid"),
            epoch: Instant::now(),
            pod_names,
            pods,
            rng: rng(settings.seed),
            heap: BinaryHeap::new(),
            order: 0,
            first_join: pool.first_join(),
            pool,
            scraped: vec![PodMetrics::default(); n_pods],
            scraped_ms: 0.0,
            in_flight: vec![vec![0usize; n_pods]; routers.len()],
            placed: vec![None; requests.len()],
            predicted: vec![None; requests.len()],
            indexed: routers[0].indexed_groups(),
            routers,
            unfinished: requests.len(),
            tally: Tally {
                ttft: Vec::with_capacity(requests.len()),
                ..Tally::default()
            },
        };
        sim.seed_events();
        sim
    }

    /// Queues what is known before the run starts.
    fn seed_events(&mut self) {
        let settings = self.settings;
        for (i, r) in self.requests.iter().enumerate() {
            self.push(r.arrival_ms, EventKind::Arrival(i));
        }
        self.push_per_pod(&settings.resets, EventKind::Reset);
        self.push_per_pod(&settings.restarts, EventKind::Restart);
        self.push_per_pod(&settings.pool.kills, EventKind::Kill);
        self.push(0.0, EventKind::Scrape);
    }

    /// Queues `kind(pod)` at each (time, pod) of `times` whose pod exists.
    fn push_per_pod(&mut self, times: &[(f64, usize)], kind: fn(usize) -> EventKind) {
        for &(t, pod) in times {
            if pod < self.pods.len() {
                self.push(t, kind(pod));
            }
        }
    }

    /// Queues `kind` at `at`, numbered after every event pushed before it.
    fn push(&mut self, at: f64, kind: EventKind) {
        self.order += 1;
        let order = self.order;
        self.heap.push(Event { at, order, kind });
    }

    /// Simulated time `ms` on the index's clock.
    fn at(&self, ms: f64) -> Instant {
        self.epoch + Duration::from_secs_f64(ms.max(0.0) / 1_000.0)
    }

    /// Pops events until none is left; after each, the pod it touched starts its next step
    /// if it can.
    pub(super) fn run_events(&mut self) {
        while let Some(Event { at: now, kind, .. }) = self.heap.pop() {
            let touched = match kind {
                EventKind::Arrival(i) => self.arrival(i, false, now),
                EventKind::Retry(i) => self.arrival(i, true, now),
                EventKind::StepDone(p, incarnation) => self.step_done(p, incarnation, now),
                EventKind::Deliver(p, payload) => self.deliver(p, &payload, now),
                EventKind::Reset(p) => self.reset(p, now),
                EventKind::Restart(p) => self.stop(p, false, now),
                EventKind::Kill(p) => self.stop(p, true, now),
                EventKind::Up(p) => Some(p),
                EventKind::Scrape => self.scrape(now),
            };
            if let Some(p) = touched {
                self.start_step(p, now);
            }
        }
    }

    /// Routes request `i` (a first arrival, or a `retry` after a restart lost it) and adds it
    /// to its pod; the pod, unless the request was rejected or refused.
    fn arrival(&mut self, i: usize, retry: bool, now: f64) -> Option<usize> {
        let requests = self.requests;
        let req = &requests[i];
        if !self.pods[0].engine.fits(req) && !retry {
            self.tally.rejected += 1;
            self.unfinished -= 1;
            return None;
        }
        if !retry {
            self.record_spread();
        }
        let replica = self.rng.below(self.routers.len() as u64) as usize;
        let rule = self.routers[replica].candidate_rule();
        let candidates = self.pool.candidates(rule, now);
        if candidates.is_empty() {
            self.tally.refused += 1;
            self.unfinished -= 1;
            return None;
        }
        let pod = self.pick(i, replica, &candidates, now);
        if !self.pods[pod].engine.fits(req) {
            self.tally.rejected += 1;
            self.unfinished -= 1;
            return None;
        }
        if self.first_join.is_some_and(|t| now >= t) && !retry {
            self.tally.after_join += 1;
            self.tally.on_late += usize::from(self.pool.joined_late(pod));
        }
        self.in_flight[replica][pod] += 1;
        self.placed[i] = Some((replica, pod));
        self.pods[pod].engine.add(i);
        Some(pod)
    }

    /// Adds the pods' load spread (max over mean of in-flight requests) as an arrival finds it.
    fn record_spread(&mut self) {
        let n_pods = self.pods.len();
        let totals: Vec<usize> = (0..n_pods)
            .map(|p| self.in_flight.iter().map(|r| r[p]).sum())
            .collect();
        let total: usize = totals.iter().sum();
        if total > 0 {
            let max = totals.iter().copied().max().unwrap_or(0) as f64;
            self.tally.spread_sum += max / (total as f64 / n_pods as f64);
            self.tally.spread_n += 1;
        }
    }

    /// The pod request `i` goes to: a Ready pod at random for traffic around the routers,
    /// else `replica`'s router's pick.
    fn pick(&mut self, i: usize, replica: usize, candidates: &[usize], now: f64) -> usize {
        let bypass = self.settings.bypass_fraction;
        if bypass > 0.0 && self.rng.unit() < bypass {
            // Traffic around the routers reaches a Ready pod.
            let ready = self.pool.candidates(CandidateRule::Ready, now);
            let among = if ready.is_empty() { candidates } else { &ready };
            among[self.rng.below(among.len() as u64) as usize]
        } else {
            self.route(i, replica, candidates, now)
        }
    }

    /// `replica`'s router's pick for request `i`, moved off a down pod as a gateway retries;
    /// the router learns where it went, and what it predicted there is kept.
    fn route(&mut self, i: usize, replica: usize, candidates: &[usize], now: f64) -> usize {
        let requests = self.requests;
        let req = &requests[i];
        let n_pods = self.pods.len();
        let ctx = RouterContext {
            now_ms: now,
            instant: self.at(now),
            in_flight: &self.in_flight[replica],
            scraped: &self.scraped,
            scraped_ms: self.scraped_ms,
            scrape_interval_ms: self.settings.scrape_interval_ms,
            indexer: &self.indexer,
            model: MODEL,
            pod_names: &self.pod_names,
            candidates,
            score_before_last_token: self.settings.model_family.is_hybrid(),
        };
        let router = &mut self.routers[replica];
        let p = router.route(req, &ctx).min(n_pods - 1);
        // A down pod does not serve; the gateway retries on the live candidate with the
        // fewest of its requests, and knows where the request went.
        let p = if self.pods[p].down_until > now {
            self.tally.misrouted += 1;
            (candidates.iter().copied())
                .filter(|&q| self.pods[q].down_until <= now)
                .min_by_key(|&q| (self.in_flight[replica][q], q))
                .unwrap_or(p)
        } else {
            p
        };
        router.routed(req, p, &ctx);
        self.predicted[i] = router.predicted_hit_tokens(req, p);
        p
    }

    /// Pod `p`'s step ended (void if the pod restarted since): first tokens and finished
    /// requests are counted and its events queued for delivery.
    fn step_done(&mut self, p: usize, incarnation: u32, now: f64) -> Option<usize> {
        if self.pods[p].incarnation != incarnation {
            return None;
        }
        self.pods[p].stepping = false;
        let end = self.pods[p].engine.complete(self.requests, self.indexed);
        for &i in &end.first_tokens {
            self.tally.ttft.push(now - self.requests[i].arrival_ms);
        }
        for &i in &end.finished {
            self.release(i);
            self.unfinished -= 1;
        }
        self.tally.prefill_tokens += end.prefill_tokens;
        self.tally.output_tokens += end.output_tokens;
        if end.output_tokens > 0 {
            self.tally.last_token_ms = now;
        }
        if let Some(payload) = end.payload {
            self.publish(p, payload, now);
        }
        Some(p)
    }

    /// Request `i` leaves its replica's count of requests in flight, if it was placed.
    fn release(&mut self, i: usize) {
        if let Some((replica, pod)) = self.placed[i].take() {
            self.in_flight[replica][pod] -= 1;
        }
    }

    /// Queues pod `p`'s event batch for the index, `event_delay_ms` from `now`.
    fn publish(&mut self, p: usize, payload: Vec<u8>, now: f64) {
        self.push(
            now + self.settings.event_delay_ms,
            EventKind::Deliver(p, payload),
        );
    }

    /// Pod `p`'s event batch reaches the index through the daemon's decoder.
    fn deliver(&mut self, p: usize, payload: &[u8], now: f64) -> Option<usize> {
        self.pool.published(p);
        if let Ok(batch) = decode_batch(payload) {
            let at = self.at(now);
            let _ = self
                .indexer
                .apply_batch_at(MODEL, &self.pod_names[p], &batch, at);
        }
        None
    }

    /// Pod `p`'s prefix cache is reset: its free cached blocks are dropped and published.
    fn reset(&mut self, p: usize, now: f64) -> Option<usize> {
        if let Some(payload) = self.pods[p].engine.reset_prefix_cache(self.indexed) {
            self.publish(p, payload, now);
        }
        None
    }

    /// Pod `p` restarts (down for `restart_downtime_ms`, its cache cleared) or is `killed`
    /// (down for good, its blocks left in the index): started streams are cut, requests
    /// without a token are retried.
    fn stop(&mut self, p: usize, killed: bool, now: f64) -> Option<usize> {
        let pod = &mut self.pods[p];
        pod.incarnation += 1;
        pod.stepping = false;
        pod.down_until = match killed {
            true => f64::INFINITY,
            false => now + self.settings.restart_downtime_ms,
        };
        let down_until = pod.down_until;
        let (retry, cut) = pod.engine.restart();
        for i in cut {
            // Its stream is cut: the client saw its first tokens, then an error.
            self.release(i);
            self.unfinished -= 1;
        }
        for i in retry {
            self.release(i);
            self.push(now, EventKind::Retry(i));
        }
        // The restarted engine's first batch clears what the index held for it; a killed one
        // publishes nothing again, and the index keeps its blocks.
        if !killed {
            self.pool.restarting(p, now, down_until);
            self.publish(p, wire::cleared(), now);
            self.push(down_until, EventKind::Up(p));
        }
        None
    }

    /// The gateways scrape every pod's metrics, the pool's probes run, and the index expires
    /// speculative entries; the next scrape is queued while requests remain.
    fn scrape(&mut self, now: f64) -> Option<usize> {
        for (m, pod) in self.scraped.iter_mut().zip(&self.pods) {
            *m = PodMetrics {
                waiting: pod.engine.waiting(),
                running: pod.engine.running(),
                kv_usage: pod.engine.kv_usage(),
                num_gpu_blocks: pod.engine.capacity_blocks(),
            };
        }
        self.scraped_ms = now;
        let pods = &self.pods;
        self.pool.scrape(now, |p| pods[p].down_until > now);
        self.indexer.expire_speculation(self.at(now));
        if self.unfinished > 0 {
            self.push(now + self.settings.scrape_interval_ms, EventKind::Scrape);
        }
        None
    }

    /// Pod `p`, if idle, up and with work, starts its next step; admitted requests' hits
    /// are counted (and checked against their router's prediction).
    fn start_step(&mut self, p: usize, now: f64) {
        let pod = &mut self.pods[p];
        if pod.stepping || pod.down_until > now {
            return;
        }
        let Some(step) = pod.engine.schedule(self.requests) else {
            return;
        };
        for &(i, hit) in &step.admitted {
            if let Some(expected) = self.predicted[i].take() {
                self.tally.prediction.record(expected, hit);
            }
            self.tally.hit_tokens += hit;
            self.tally.prompt_tokens += self.requests[i].prompt_tokens;
        }
        pod.stepping = true;
        let incarnation = pod.incarnation;
        self.push(now + step.duration_ms, EventKind::StepDone(p, incarnation));
    }

    /// The run's results, once no event is left.
    pub(super) fn report(self) -> PolicyReport {
        let mut stats = EngineStats::default();
        for pod in &self.pods {
            let s = pod.engine.stats();
            stats.steps += s.steps;
            stats.preemptions += s.preemptions;
            stats.max_step_tokens = stats.max_step_tokens.max(s.max_step_tokens);
            stats.max_step_seqs = stats.max_step_seqs.max(s.max_step_seqs);
        }
        let mut t = self.tally;
        t.ttft.sort_by(f64::total_cmp);
        let first_arrival = self.requests.first().map_or(0.0, |r| r.arrival_ms);
        let span_s = (t.last_token_ms - first_arrival).max(1.0) / 1_000.0;
        PolicyReport {
            policy: self.routers[0].name(),
            requests: t.ttft.len(),
            rejected: t.rejected,
            token_hit_rate: if t.prompt_tokens == 0 {
                0.0
            } else {
                t.hit_tokens as f64 / t.prompt_tokens as f64
            },
            prefill_tokens: t.prefill_tokens,
            ttft_p50_ms: percentile(&t.ttft, 50.0),
            ttft_p90_ms: percentile(&t.ttft, 90.0),
            ttft_p99_ms: percentile(&t.ttft, 99.0),
            ttft_mean_ms: t.ttft.iter().sum::<f64>() / t.ttft.len().max(1) as f64,
            output_tokens_per_s: t.output_tokens as f64 / span_s,
            preemptions: stats.preemptions,
            load_spread: if t.spread_n == 0 {
                1.0
            } else {
                t.spread_sum / t.spread_n as f64
            },
            engine: stats,
            misrouted: t.misrouted,
            refused: t.refused,
            late_share: self
                .first_join
                .map(|_| t.on_late as f64 / t.after_join.max(1) as f64),
            prediction: (t.prediction.requests > 0).then_some(t.prediction),
        }
    }
}

/// The index's settings for `settings`' pods.
fn index_settings(settings: &SimSettings) -> IndexerSettings {
    let mut index_settings = IndexerSettings::default();
    if settings.model_family.is_hybrid() {
        // The simulated engines publish the index's keys; an engine whose groups' blocks are
        // wider than the unit (Mamba's 576 tokens) carries no token ids to show it, so the
        // index is told rather than left to decide per engine.
        index_settings.default_model.engine_hashes = EngineHashes::Aligned;
    }
    index_settings
}
