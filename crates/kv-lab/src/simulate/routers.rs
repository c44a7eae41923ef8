//! Routing policies, each a small, faithful version of a deployed design. None is told what a
//! pod's cache holds or how large it is: they see what a gateway sees (their own requests in
//! flight, scraped pod metrics, and, for the precise ones, the index fed by the pods' events).
//!
//! - `random`, `round-robin`, `least-loaded` (fewest of this replica's requests in flight);
//! - `approx`: the gateway's approximate prefix scorer: it remembers the blocks of what it sent
//!   to each pod in an LRU per pod whose size is a fixed guess (`lruCapacityPerServer`, 31,250
//!   blocks by default), sees no events, and looks at no more than the prompt's first 256
//!   blocks of 64 characters (at 4 characters per token, a block is 16 tokens: the first 4,096
//!   tokens); `approx-autotune` sizes each LRU from the pod's reported KV blocks instead;
//! - `precise`: kv-indexer's scores from the real index (fed by the pods' events), with the
//!   speculative entries of `RecordRouting` recorded after each decision (the index's own
//!   code: confirmed by events, expired by its TTL); `precise-nospec` records none. The raw
//!   scores become the prefix scorer's value as llm-d's precise-prefix-cache scorer makes them
//!   of kv-indexer's scores ([`PrefixScore::MinMax`]); the other forms show the difference;
//! - `dynamo`: Dynamo's KV router cost: `overlap_weight * blocks to prefill + blocks the pod has
//!   in use`, the lowest wins, with the overlap from the index;
//! - `aibrix`: AIBrix prefix-cache routing: least loaded when in-flight counts are imbalanced
//!   beyond a threshold, otherwise the best prefix match (its own table of routed prompts, sized
//!   by the same fixed guess) among pods whose load is at most mean + k * stddev;
//! - `localai`: routed prefixes with a TTL; the best match is used only if it covers a minimum
//!   share of the prompt and the pod is not overloaded, otherwise least loaded.
//!
//! The scoring routers (`approx*`, `precise*`) pick with the daemon's own endpoint pick,
//! [`kv_core::pick()`] (one implementation: what these ladders measure is the shipped code):
//! the prefix scorer (the approximate scorer's matched share of the blocks it hashed, as the
//! gateway's `prefix-cache-scorer` computes it, passed as it is; the precise scorer's as
//! [`PrefixScore`] says, min-max by the pick itself by default), the queue scorer (min-max over
//! the pods, 1 = the shortest queue) and the KV-cache utilisation scorer (`1 - usage`), both
//! from metrics scraped every scrape interval (stale), weighted; the highest sum wins, ties at
//! random from the router's seeded stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::SplitMix64;
use kv_core::{BlockHash, Candidate, PickSettings, PickWeights, PrefixNormalisation};

use super::family::{IndexedGroups, UNIT_TOKENS};
pub use super::membership::CandidateRule;
pub use super::prefix_score::PrefixScore;
use super::{PodMetrics, SimRequest};
use crate::lru::LruSet;
use kv_core::Indexer;

/// What a router may look at.
pub struct RouterContext<'a> {
    /// Simulated time, ms.
    pub now_ms: f64,
    /// Simulated time as an instant (the index's clock for speculative entries).
    pub instant: Instant,
    /// This gateway replica's requests in flight, per pod.
    pub in_flight: &'a [usize],
    /// Pod metrics as last scraped.
    pub scraped: &'a [PodMetrics],
    /// Simulated time of that scrape, ms.
    pub scraped_ms: f64,
    /// How often the gateways scrape, ms.
    pub scrape_interval_ms: f64,
    /// The real index (only the precise routers and `dynamo` read it).
    pub indexer: &'a Indexer,
    /// The model in the index.
    pub model: &'a str,
    /// Pod names in the index.
    pub pod_names: &'a [String],
    /// The pods this router may pick, in order, as its [`Router::candidate_rule`] makes them
    /// (every pod while the pool does not change).
    pub candidates: &'a [usize],
    /// Score only the prompt's hash units before its last token (vLLM recomputes the last
    /// token, and the hash form carries no token count): set for hybrid pods, whose rule the
    /// index applies to the units it is given; plain runs score every block, as the published
    /// figures did.
    pub score_before_last_token: bool,
}

/// A routing policy (one instance per gateway replica).
pub trait Router {
    /// Its name in reports.
    fn name(&self) -> String;
    /// Picks a pod for `req`.
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize;
    /// Learns that `req` went to `pod`.
    fn routed(&mut self, _req: &SimRequest, _pod: usize, _ctx: &RouterContext<'_>) {}
    /// The prompt tokens the router expected `pod`'s cache to give the request it routed
    /// last (`None`: it predicts none): what the simulation compares with the hit the engine
    /// takes.
    fn predicted_hit_tokens(&self, _req: &SimRequest, _pod: usize) -> Option<u64> {
        None
    }
    /// Which of a hybrid engine's groups this router's index is fed (every group unless it
    /// models an index of the full-attention group alone).
    fn indexed_groups(&self) -> IndexedGroups {
        IndexedGroups::All
    }
    /// Which pods it may pick: the pool's Ready pods, as Kubernetes says, unless it is
    /// kv-indexer's picker.
    fn candidate_rule(&self) -> CandidateRule {
        CandidateRule::Ready
    }
}

/// The gateway's approximate scorer's default capacity guess (`lruCapacityPerServer`).
pub const APPROX_CAPACITY_GUESS: usize = 31_250;
/// Blocks of prompt text the approximate scorer looks at, at most.
pub const APPROX_MAX_BLOCKS: usize = 256;
/// Characters per approximate block.
pub const APPROX_BLOCK_CHARS: u64 = 64;
/// Characters per token the simulation assumes for prompt text.
pub const CHARS_PER_TOKEN: u64 = 4;

fn least_loaded(in_flight: &[usize], among: impl Iterator<Item = usize>) -> usize {
    among.min_by_key(|&p| (in_flight[p], p)).unwrap_or(0)
}

/// The daemon's endpoint pick ([`kv_core::pick()`]) over the candidates: the prefix scores
/// (normalised as `normalise` says), the queue and KV-cache scorers from the scraped metrics
/// (as old as the last scrape; older than the daemon's default `metricsStaleAfter`, 500 ms,
/// or ten scrape intervals if that is longer, they are left out as the daemon leaves them
/// out), weighted by `w`; ties broken by `rng`. Returns the winner.
pub(super) fn pick(
    prefix: &[f64],
    normalise: PrefixNormalisation,
    ctx: &RouterContext<'_>,
    w: PickWeights,
    rng: &mut SplitMix64,
) -> usize {
    let age = Duration::from_secs_f64((ctx.now_ms - ctx.scraped_ms).max(0.0) / 1000.0);
    let candidates: Vec<Candidate> = ctx
        .candidates
        .iter()
        .map(|&p| Candidate {
            pod: ctx.pod_names.get(p).cloned().unwrap_or_default(),
            rank: None,
            prefix_score: prefix.get(p).copied().unwrap_or(0.0),
            metrics: ctx.scraped.get(p).map(|m| kv_core::PodMetrics {
                waiting_requests: m.waiting as f64,
                kv_cache_usage: m.kv_usage,
                age,
            }),
        })
        .collect();
    let daemon = PickSettings::default();
    let settings = PickSettings {
        weights: w,
        max_metrics_age: daemon.max_metrics_age.max(Duration::from_secs_f64(
            ctx.scrape_interval_ms * 10.0 / 1000.0,
        )),
        prefix: normalise,
    };
    // Weights are checked when parsed and every input is finite, so the pick cannot fail; if it
    // did, the gateway would fall back to load.
    match kv_core::pick(&candidates, &settings, rng) {
        Ok(pick) => ctx.candidates[pick.best().unwrap_or(0)],
        Err(_) => least_loaded(ctx.in_flight, ctx.candidates.iter().copied()),
    }
}

/// Uniformly random.
pub struct Random(pub SplitMix64);

impl Router for Random {
    fn name(&self) -> String {
        "random".into()
    }
    fn route(&mut self, _: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        ctx.candidates[self.0.below(ctx.candidates.len() as u64) as usize]
    }
}

/// Round-robin.
#[derive(Default)]
pub struct RoundRobin(usize);

impl Router for RoundRobin {
    fn name(&self) -> String {
        "round-robin".into()
    }
    fn route(&mut self, _: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.0 = (self.0 + 1) % ctx.candidates.len();
        ctx.candidates[self.0]
    }
}

/// Fewest of this replica's requests in flight.
pub struct LeastLoaded;

impl Router for LeastLoaded {
    fn name(&self) -> String {
        "least-loaded".into()
    }
    fn route(&mut self, _: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        least_loaded(ctx.in_flight, ctx.candidates.iter().copied())
    }
}

/// A bounded LRU of block hashes (a router's own view of a pod).
struct BlockLru {
    capacity: usize,
    order: LruSet<BlockHash>,
}

impl BlockLru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            order: LruSet::new(),
        }
    }
    fn touch(&mut self, b: BlockHash) {
        self.order.insert(b);
        while self.order.len() > self.capacity {
            self.order.pop_oldest();
        }
    }
    fn prefix(&self, blocks: &[BlockHash]) -> usize {
        blocks
            .iter()
            .take_while(|&&b| self.order.contains(b))
            .count()
    }
}

/// How the approximate scorer sizes its per-pod LRUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CapacityGuess {
    /// The same number of blocks for every pod (`lruCapacityPerServer`).
    Fixed(usize),
    /// From each pod's reported KV blocks (`num_gpu_blocks`, scraped), converted to text
    /// blocks; the fixed default until a pod has been scraped.
    AutoTune,
}

/// The gateway's approximate prefix scorer with the queue and KV-utilisation scorers.
pub struct ApproxPrefix {
    guess: CapacityGuess,
    pods: Vec<BlockLru>,
    /// Scorer weights.
    pub weights: PickWeights,
    rng: SplitMix64,
}

impl ApproxPrefix {
    /// An approximate scorer whose LRUs are sized by `guess`.
    pub fn new(guess: CapacityGuess, weights: PickWeights, seed: u64) -> Self {
        Self {
            guess,
            pods: Vec::new(),
            weights,
            rng: super::rng(seed ^ 0xA9_9E),
        }
    }

    /// The capacity of each pod's LRU as the router sized it (what a test compares with the
    /// truth it must not know).
    pub fn capacities(&self) -> Vec<usize> {
        self.pods.iter().map(|p| p.capacity).collect()
    }

    /// The text blocks the scorer hashes: at 4 characters per token a 64-character block is 16
    /// tokens, so the prompt's token blocks, of which at most the first 256.
    fn text_blocks(req: &SimRequest) -> &[BlockHash] {
        &req.blocks[..req.blocks.len().min(APPROX_MAX_BLOCKS)]
    }

    fn size(&mut self, ctx: &RouterContext<'_>) {
        let n = ctx.scraped.len();
        while self.pods.len() < n {
            self.pods.push(BlockLru::new(APPROX_CAPACITY_GUESS));
        }
        let per_token_block = 16 * CHARS_PER_TOKEN / APPROX_BLOCK_CHARS;
        for (lru, m) in self.pods.iter_mut().zip(ctx.scraped) {
            lru.capacity = match self.guess {
                CapacityGuess::Fixed(c) => c,
                CapacityGuess::AutoTune if m.num_gpu_blocks > 0 => {
                    (m.num_gpu_blocks as u64 * per_token_block) as usize
                }
                CapacityGuess::AutoTune => APPROX_CAPACITY_GUESS,
            };
        }
    }
}

impl Router for ApproxPrefix {
    fn name(&self) -> String {
        match self.guess {
            CapacityGuess::Fixed(_) => "approx".into(),
            CapacityGuess::AutoTune => "approx-autotune".into(),
        }
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.size(ctx);
        let blocks = Self::text_blocks(req);
        let n = blocks.len().max(1) as f64;
        let matched: Vec<f64> = self
            .pods
            .iter()
            .map(|p| p.prefix(blocks) as f64 / n)
            .collect();
        // The gateway's prefix-cache-scorer's value is the share itself, not min-max.
        pick(
            &matched,
            PrefixNormalisation::AsGiven,
            ctx,
            self.weights,
            &mut self.rng,
        )
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) {
        self.size(ctx);
        for &b in Self::text_blocks(req) {
            self.pods[pod].touch(b);
        }
    }
}

/// kv-indexer's scores (real and speculative entries) with the queue and KV-utilisation
/// scorers.
pub struct Precise {
    /// Scorer weights.
    pub weights: PickWeights,
    /// Record each decision as speculative entries (`RecordRouting`).
    pub speculation: bool,
    /// How raw scores become the prefix scorer's value (min-max over every candidate by
    /// default, as llm-d's scorer makes it of kv-indexer's scores).
    pub prefix_score: PrefixScore,
    /// The index is fed the full-attention groups' events only (llm-d's and Dynamo's indexes
    /// today), so it predicts a hybrid engine's hit as that group's prefix.
    pub full_attention_only: bool,
    /// Its candidates: the pool's (the daemon's picker with a pool, the default) or the pods
    /// that published (the picker without one).
    pub rule: CandidateRule,
    rng: SplitMix64,
    /// The last routing's matched blocks per pod (what it predicted).
    last_matched: Vec<u32>,
}

impl Precise {
    /// Precise scoring as llm-d's scorer makes it of kv-indexer's scores, recording routings
    /// when `speculation`.
    pub fn new(weights: PickWeights, speculation: bool, seed: u64) -> Self {
        Self {
            weights,
            speculation,
            prefix_score: PrefixScore::MinMax,
            full_attention_only: false,
            rule: CandidateRule::Pool,
            rng: super::rng(seed ^ 0x9E_C1),
            last_matched: Vec::new(),
        }
    }

    /// The same router over an index fed only the full-attention groups' events.
    pub fn full_attention_only(mut self) -> Self {
        self.full_attention_only = true;
        self
    }

    /// The same router picking among the pods that published (the picker without a pool).
    pub fn publishers_only(mut self) -> Self {
        self.rule = CandidateRule::Publishers;
        self
    }

    /// The same router with another prefix normalisation.
    pub fn with_prefix_score(mut self, prefix_score: PrefixScore) -> Self {
        self.prefix_score = prefix_score;
        self
    }
}

/// The prompt's blocks a precise router scores: all of them, or those before its last token
/// when the context says so.
fn scored_blocks<'r>(req: &'r SimRequest, ctx: &RouterContext<'_>) -> &'r [BlockHash] {
    if ctx.score_before_last_token {
        let units = req.prompt_tokens.saturating_sub(1) / u64::from(UNIT_TOKENS);
        &req.blocks[..req.blocks.len().min(units as usize)]
    } else {
        &req.blocks
    }
}

/// Per pod, the index's score for `blocks`: consecutive blocks from the start, tier-weighted
/// (`score` of ScorePods; speculative blocks included, at their weight, 1 by default), and
/// the blocks matched (into `matched` when given).
fn indexed_blocks(
    blocks: &[BlockHash],
    ctx: &RouterContext<'_>,
    mut matched: Option<&mut Vec<u32>>,
) -> Vec<f64> {
    let mut scores = vec![0.0; ctx.pod_names.len()];
    if let Some(m) = matched.as_deref_mut() {
        m.clear();
        m.resize(ctx.pod_names.len(), 0);
    }
    if let Ok(result) = ctx
        .indexer
        .score_hashes(ctx.model, blocks, kv_core::ALL_PODS)
    {
        for (name, s) in result.named() {
            if let Some(p) = ctx.pod_names.iter().position(|n| **n == *name) {
                scores[p] = s.score;
                if let Some(m) = matched.as_deref_mut() {
                    m[p] = s.matched_blocks;
                }
            }
        }
    }
    scores
}

impl Router for Precise {
    fn name(&self) -> String {
        let base = match (self.full_attention_only, self.rule) {
            (true, _) => "precise-full-only",
            (false, CandidateRule::Publishers) => "precise-publishers",
            (false, _) => "precise",
        };
        if self.speculation {
            base.into()
        } else {
            format!("{base}-nospec")
        }
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        let raw = indexed_blocks(scored_blocks(req, ctx), ctx, Some(&mut self.last_matched));
        let (prefix, normalise) = self.prefix_score.normalise(&raw, req.blocks.len());
        pick(&prefix, normalise, ctx, self.weights, &mut self.rng)
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) {
        if self.speculation && !req.blocks.is_empty() {
            let hashes: Arc<[BlockHash]> = req.blocks.as_slice().into();
            let _ =
                ctx.indexer
                    .record_routing(ctx.model, &ctx.pod_names[pod], 0, hashes, ctx.instant);
        }
    }
    fn predicted_hit_tokens(&self, req: &SimRequest, pod: usize) -> Option<u64> {
        // vLLM recomputes at least the last token: a prompt's hit is at most its full units
        // before it.
        let cap = req.prompt_tokens.saturating_sub(1) / u64::from(UNIT_TOKENS);
        let matched = u64::from(*self.last_matched.get(pod)?);
        Some(matched.min(cap) * u64::from(UNIT_TOKENS))
    }
    fn indexed_groups(&self) -> IndexedGroups {
        if self.full_attention_only {
            IndexedGroups::FullAttentionOnly
        } else {
            IndexedGroups::All
        }
    }
    fn candidate_rule(&self) -> CandidateRule {
        self.rule
    }
}

/// Dynamo's KV router cost function.
pub struct Dynamo {
    /// Weight of the blocks still to prefill.
    pub overlap_weight: f64,
    rng: SplitMix64,
}

impl Dynamo {
    /// Dynamo's default (`overlap_score_weight` 1).
    pub fn new(seed: u64) -> Self {
        Self {
            overlap_weight: 1.0,
            rng: super::rng(seed ^ 0xD1_7A),
        }
    }
}

impl Router for Dynamo {
    fn name(&self) -> String {
        "dynamo".into()
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        let n = req.blocks.len() as f64;
        let overlap = indexed_blocks(&req.blocks, ctx, None);
        let costs: Vec<f64> = ctx
            .candidates
            .iter()
            .map(|&p| {
                let m = &ctx.scraped[p];
                self.overlap_weight * (n - overlap[p]) + m.kv_usage * m.num_gpu_blocks as f64
            })
            .collect();
        let best = costs.iter().copied().fold(f64::MAX, f64::min);
        let tied: Vec<usize> = (0..costs.len())
            .filter(|&i| costs[i] <= best + 1e-9)
            .map(|i| ctx.candidates[i])
            .collect();
        tied[self.rng.below(tied.len() as u64) as usize]
    }
}

/// AIBrix prefix-cache routing.
pub struct Aibrix {
    table: Vec<BlockLru>,
    /// Least loaded when max - min in-flight exceeds this.
    pub imbalance: usize,
    /// Candidate pods have load <= mean + k * stddev.
    pub k: f64,
}

impl Default for Aibrix {
    fn default() -> Self {
        Self {
            table: Vec::new(),
            imbalance: 8,
            k: 1.0,
        }
    }
}

impl Router for Aibrix {
    fn name(&self) -> String {
        "aibrix".into()
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        while self.table.len() < ctx.in_flight.len() {
            self.table.push(BlockLru::new(APPROX_CAPACITY_GUESS));
        }
        let pods = ctx.candidates;
        let loads: Vec<f64> = pods.iter().map(|&p| ctx.in_flight[p] as f64).collect();
        let (min, max) = loads
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        if max - min > self.imbalance as f64 {
            return least_loaded(ctx.in_flight, pods.iter().copied());
        }
        let mean = loads.iter().sum::<f64>() / loads.len() as f64;
        let sd =
            (loads.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / loads.len() as f64).sqrt();
        let limit = mean + self.k * sd;
        let candidates: Vec<usize> = (0..loads.len())
            .filter(|&i| loads[i] <= limit)
            .map(|i| pods[i])
            .collect();
        let best = candidates
            .iter()
            .map(|&p| (self.table[p].prefix(&req.blocks), p))
            .max_by(|a, b| {
                a.0.cmp(&b.0)
                    .then(ctx.in_flight[b.1].cmp(&ctx.in_flight[a.1]))
            });
        match best {
            Some((m, p)) if m > 0 => p,
            _ => least_loaded(ctx.in_flight, candidates.into_iter()),
        }
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, _: &RouterContext<'_>) {
        for &b in &req.blocks {
            self.table[pod].touch(b);
        }
    }
}

/// LocalAI-style prefix-tree routing.
pub struct LocalAi {
    /// block -> (pod -> last time routed).
    seen: HashMap<BlockHash, HashMap<usize, f64>>,
    /// Entries older than this are ignored, ms.
    pub ttl_ms: f64,
    /// The best match must cover at least this share of the prompt.
    pub min_match_ratio: f64,
    /// ... and the pod's load must be at most this times the mean (+1).
    pub load_guard: f64,
}

impl Default for LocalAi {
    fn default() -> Self {
        Self {
            seen: HashMap::new(),
            ttl_ms: 300_000.0,
            min_match_ratio: 0.5,
            load_guard: 1.5,
        }
    }
}

impl Router for LocalAi {
    fn name(&self) -> String {
        "localai".into()
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        let n = ctx.in_flight.len();
        let mut depth = vec![0usize; n];
        let mut alive: Vec<bool> = vec![false; n];
        for &p in ctx.candidates {
            alive[p] = true;
        }
        for &b in &req.blocks {
            let Some(pods) = self.seen.get(&b) else { break };
            let mut any = false;
            for p in 0..n {
                if alive[p] && pods.get(&p).is_some_and(|&t| ctx.now_ms - t <= self.ttl_ms) {
                    depth[p] += 1;
                    any = true;
                } else {
                    alive[p] = false;
                }
            }
            if !any {
                break;
            }
        }
        let pods = ctx.candidates;
        let mean = pods.iter().map(|&p| ctx.in_flight[p] as f64).sum::<f64>() / pods.len() as f64;
        let best = pods
            .iter()
            .copied()
            .max_by_key(|&p| (depth[p], std::cmp::Reverse(ctx.in_flight[p])));
        match best {
            Some(p)
                if depth[p] as f64 >= self.min_match_ratio * req.blocks.len() as f64
                    && ctx.in_flight[p] as f64 <= self.load_guard * mean + 1.0 =>
            {
                p
            }
            _ => least_loaded(ctx.in_flight, pods.iter().copied()),
        }
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) {
        for &b in &req.blocks {
            self.seen.entry(b).or_default().insert(pod, ctx.now_ms);
        }
    }
}

#[cfg(test)]
#[path = "routers_tests.rs"]
mod tests;
