//! Routing policies, each a small, faithful version of a published design.
//!
//! - `random`, `round-robin`, `least-loaded` (fewest in-flight requests);
//! - `approx-prefix`: the gateway's approximate prefix index: it remembers the block hashes of
//!   what it sent to each pod (an LRU per pod sized like the pod's cache), sees no events, and
//!   scores `prefix_weight * matched share - load_weight * load share`, as an EPP combines its
//!   prefix and queue scorers;
//! - `aibrix`: AIBrix prefix-cache routing: when in-flight counts are imbalanced beyond a
//!   threshold, least loaded; otherwise the best prefix match (its own table of routed
//!   prompts) among pods whose load is at most mean + k * stddev;
//! - `localai`: LocalAI-style prefix-tree routing: routed prefixes with a TTL; the best match is
//!   used only if it covers a minimum share of the prompt and the pod is not overloaded
//!   (load guard), otherwise least loaded;
//! - `precise`: kv-indexer's scores from the real index (fed by the pods' events), combined with
//!   the same load term as `approx-prefix`. Events confirm a routing decision only once the pod
//!   starts the request (seconds later under load), so decisions stay pending (speculative)
//!   until the index confirms them or a TTL passes.

use std::collections::HashMap;

use kv_core::BlockHash;
use kv_core::SplitMix64;

use super::{PodLoad, SimRequest};
use crate::lru::LruSet;
use kv_core::Indexer;

/// What a router may look at.
pub struct RouterContext<'a> {
    /// Simulated time.
    pub now_ms: f64,
    /// Per pod.
    pub loads: &'a [PodLoad],
    /// The real index (only `precise` reads it).
    pub indexer: &'a Indexer,
    /// The model in the index.
    pub model: &'a str,
    /// Pod names in the index.
    pub pod_names: &'a [String],
}

/// A routing policy.
pub trait Router {
    /// Its name in reports.
    fn name(&self) -> String;
    /// Picks a pod for `req`.
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize;
    /// Learns that `req` went to `pod` (routers with their own prefix tables).
    fn routed(&mut self, _req: &SimRequest, _pod: usize, _now_ms: f64) {}
}

fn least_loaded(loads: &[PodLoad], among: impl Iterator<Item = usize>) -> usize {
    among
        .min_by_key(|&p| (loads[p].in_flight(), p))
        .unwrap_or(0)
}

/// Uniformly random.
pub struct Random(pub SplitMix64);

impl Router for Random {
    fn name(&self) -> String {
        "random".into()
    }
    fn route(&mut self, _: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.0.below(ctx.loads.len() as u64) as usize
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
        self.0 = (self.0 + 1) % ctx.loads.len();
        self.0
    }
}

/// Fewest in-flight requests.
pub struct LeastLoaded;

impl Router for LeastLoaded {
    fn name(&self) -> String {
        "least-loaded".into()
    }
    fn route(&mut self, _: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        least_loaded(ctx.loads, 0..ctx.loads.len())
    }
}

/// Prefix score combined with load, as an EPP weighs its scorers.
fn combine(matched: &[f64], loads: &[PodLoad], prefix_weight: f64, load_weight: f64) -> usize {
    let max_load = loads
        .iter()
        .map(PodLoad::in_flight)
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    (0..loads.len())
        .max_by(|&a, &b| {
            let s = |p: usize| {
                prefix_weight * matched[p] - load_weight * loads[p].in_flight() as f64 / max_load
            };
            s(a).total_cmp(&s(b))
                .then(loads[b].in_flight().cmp(&loads[a].in_flight()))
                .then(b.cmp(&a))
        })
        .unwrap_or(0)
}

/// A bounded LRU of block hashes (the routers' own view of a pod).
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

/// The gateway's approximate prefix index (what it sent where; no events).
pub struct ApproxPrefix {
    pods: Vec<BlockLru>,
    /// Weight of the matched share.
    pub prefix_weight: f64,
    /// Weight of the load share.
    pub load_weight: f64,
}

impl ApproxPrefix {
    /// One LRU per pod, `capacity` blocks each.
    pub fn new(capacities: &[usize]) -> Self {
        Self {
            pods: capacities.iter().map(|&c| BlockLru::new(c)).collect(),
            prefix_weight: 1.0,
            load_weight: 0.5,
        }
    }
}

impl Router for ApproxPrefix {
    fn name(&self) -> String {
        "approx-prefix".into()
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        let n = req.blocks.len().max(1) as f64;
        let matched: Vec<f64> = self
            .pods
            .iter()
            .map(|p| p.prefix(&req.blocks) as f64 / n)
            .collect();
        combine(&matched, ctx.loads, self.prefix_weight, self.load_weight)
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, _: f64) {
        for &b in &req.blocks {
            self.pods[pod].touch(b);
        }
    }
}

/// kv-indexer's precise scores plus the load term, with speculative entries.
///
/// A routing decision is pending until the index confirms it (the pod's events show the
/// request's last block) or `speculative_ttl_ms` passes; a pod's prefix is the longer of what
/// the index holds and the longest common prefix with its pending requests. Once confirmed, the
/// index alone speaks for the pod, evictions included.
pub struct Precise {
    /// Weight of the matched share.
    pub prefix_weight: f64,
    /// Weight of the load share.
    pub load_weight: f64,
    /// The longest a decision stays pending without confirmation, ms (0 = no speculation).
    pub speculative_ttl_ms: f64,
    /// Per pod: (time routed, blocks) of unconfirmed decisions.
    pending: Vec<Vec<(f64, std::sync::Arc<[BlockHash]>)>>,
}

impl Precise {
    /// Precise scoring with the EPP-like load term and speculation until confirmed.
    pub fn new(speculative_ttl_ms: f64) -> Self {
        Self {
            prefix_weight: 1.0,
            load_weight: 0.5,
            speculative_ttl_ms,
            pending: Vec::new(),
        }
    }
}

impl Router for Precise {
    fn name(&self) -> String {
        if self.speculative_ttl_ms > 0.0 {
            "precise (kv-indexer)".into()
        } else {
            "precise, no speculation".into()
        }
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        let n = req.blocks.len().max(1) as f64;
        let pods = ctx.loads.len();
        if self.pending.len() < pods {
            self.pending.resize_with(pods, Vec::new);
        }
        let mut matched = vec![0.0; pods];
        if let Ok(result) = ctx
            .indexer
            .score_hashes(ctx.model, &req.blocks, kv_core::ALL_PODS)
        {
            for (name, s) in result.named() {
                if let Some(p) = ctx.pod_names.iter().position(|n| **n == *name) {
                    matched[p] = s.matched_blocks as f64 / n;
                }
            }
        }
        if self.speculative_ttl_ms > 0.0 {
            for (p, pending) in self.pending.iter_mut().enumerate() {
                if pending.is_empty() {
                    continue;
                }
                let only_this_pod = [ctx.pod_names.get(p).cloned().unwrap_or_default()];
                pending.retain(|(t, blocks)| {
                    if ctx.now_ms - t > self.speculative_ttl_ms {
                        return false;
                    }
                    // Confirmed when the index shows this pod holding the request's last block.
                    let confirmed = blocks.last().is_some_and(|&last| {
                        ctx.indexer
                            .score_hashes(ctx.model, std::slice::from_ref(&last), &only_this_pod)
                            .is_ok_and(|r| r.scores.first().is_some_and(|s| s.matched_blocks > 0))
                    });
                    !confirmed
                });
                let depth = pending
                    .iter()
                    .map(|(_, blocks)| super::common_prefix(blocks, &req.blocks))
                    .max()
                    .unwrap_or(0);
                matched[p] = matched[p].max(depth as f64 / n);
            }
        }
        combine(&matched, ctx.loads, self.prefix_weight, self.load_weight)
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, now_ms: f64) {
        if self.speculative_ttl_ms <= 0.0 {
            return;
        }
        if self.pending.len() <= pod {
            self.pending.resize_with(pod + 1, Vec::new);
        }
        self.pending[pod].push((now_ms, req.blocks.as_slice().into()));
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

impl Aibrix {
    /// A routed-prompts table per pod.
    pub fn new(capacities: &[usize]) -> Self {
        Self {
            table: capacities.iter().map(|&c| BlockLru::new(c)).collect(),
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
        let loads: Vec<f64> = ctx.loads.iter().map(|l| l.in_flight() as f64).collect();
        let (min, max) = loads
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        if max - min > self.imbalance as f64 {
            return least_loaded(ctx.loads, 0..ctx.loads.len());
        }
        let mean = loads.iter().sum::<f64>() / loads.len() as f64;
        let sd =
            (loads.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / loads.len() as f64).sqrt();
        let limit = mean + self.k * sd;
        let candidates: Vec<usize> = (0..loads.len()).filter(|&p| loads[p] <= limit).collect();
        let best = candidates
            .iter()
            .map(|&p| (self.table[p].prefix(&req.blocks), p))
            .max_by(|a, b| {
                a.0.cmp(&b.0)
                    .then(ctx.loads[b.1].in_flight().cmp(&ctx.loads[a.1].in_flight()))
            });
        match best {
            Some((m, p)) if m > 0 => p,
            _ => least_loaded(ctx.loads, candidates.into_iter()),
        }
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, _: f64) {
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
        let n = ctx.loads.len();
        let mut depth = vec![0usize; n];
        let mut alive: Vec<bool> = vec![true; n];
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
        let mean = ctx.loads.iter().map(|l| l.in_flight() as f64).sum::<f64>() / n as f64;
        let best = (0..n).max_by_key(|&p| (depth[p], std::cmp::Reverse(ctx.loads[p].in_flight())));
        match best {
            Some(p)
                if depth[p] as f64 >= self.min_match_ratio * req.blocks.len() as f64
                    && ctx.loads[p].in_flight() as f64 <= self.load_guard * mean + 1.0 =>
            {
                p
            }
            _ => least_loaded(ctx.loads, 0..n),
        }
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, now_ms: f64) {
        for &b in &req.blocks {
            self.seen.entry(b).or_default().insert(pod, now_ms);
        }
    }
}
