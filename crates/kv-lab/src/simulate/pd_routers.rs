//! P/D routers: for a prefill/decode pool (the `pd` module), each picks the decode pod first,
//! then lets kv-core's split rule ([`kv_core::decide`], the one the daemon's picker uses)
//! decide from the prompt tokens it believes that pod holds whether a prefill pod computes the
//! prompt, and if so which. They differ only in that belief:
//!
//! - [`LlmdApproxPd`]: llm-d's P/D scheduler as shipped (llm-d-router `deploy/config/
//!   pd-epp-config.yaml` at ebab6879): the `approx-prefix-cache-producer` (a per-pod LRU of its
//!   own routing history in 64-token blocks, the 16-token default floored at 64; at most
//!   `maxPrefixTokensToMatch` 16,384 tokens hashed; capacity auto-tuned from the pod's reported
//!   KV blocks, 31,250 before a scrape; the decode *and* the prefill pod recorded; whole blocks
//!   counted; what was routed is assumed still cached), `prefix-cache-scorer` weight 2 and
//!   `queue-scorer` weight 1 in both profiles, the decider on `matched blocks x 64` tokens;
//! - [`ExactPd`]: kv-indexer's: the precise prefix score from the real index (events and
//!   speculative entries for both pods) with the same weights, the decider on the hit vLLM
//!   will take on the decode pod (the index's matched blocks, at most the prompt's tokens
//!   before its last);
//! - [`LlmdApproxPd::with_exact_decision`]: llm-d's picks, the decision on the exact hit (what
//!   the decision alone changes).
//!
//! Invariants: a router picks only among the context's candidates; [`route`] asks for a
//! prefill pod only when the rule splits and there is a prefill candidate, and tells the
//! router where the request went exactly once.

use kv_core::{
    decide, BlockHash, Decision, PickWeights, PrefixNormalisation, SplitMix64, SplitRule,
};

use super::routers::{pick, Precise, Router, RouterContext};
use super::SimRequest;
use crate::lru::LruSet;

/// A router of a P/D pool.
pub trait PdRouter {
    /// Its name in reports.
    fn name(&self) -> String;
    /// The decode pod for `req` among `ctx.candidates` (the decode pods), and the prompt tokens
    /// the router believes that pod holds (what the split rule is fed).
    fn pick_decode(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> (usize, u64);
    /// The prefill pod for `req` among `ctx.candidates` (the prefill pods).
    fn pick_prefill(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize;
    /// Learns where `req` went: its decode pod, and its prefill pod when it was split.
    fn routed(
        &mut self,
        req: &SimRequest,
        decode: usize,
        prefill: Option<usize>,
        ctx: &RouterContext<'_>,
    );
}

/// Where one request goes.
#[derive(Debug, Clone, Copy)]
pub struct PdRoute {
    /// Its decode pod.
    pub decode: usize,
    /// Its prefill pod (`None`: the decode pod prefills it).
    pub prefill: Option<usize>,
    /// The rule's decision, on the router's belief.
    pub decision: Decision,
    /// The prompt tokens the router believed the decode pod holds.
    pub believed_cached: u64,
    /// The hit the index gave for the decode pod at the decision ([`exact_hit_tokens`]).
    pub exact_cached: u64,
}

/// Routes `req`: the decode pod among `decode_ctx`'s candidates, the split rule on the
/// router's belief, a prefill pod among `prefill_ctx`'s when it splits.
pub fn route(
    router: &mut dyn PdRouter,
    rule: SplitRule,
    req: &SimRequest,
    decode_ctx: &RouterContext<'_>,
    prefill_ctx: &RouterContext<'_>,
) -> PdRoute {
    let (decode, believed_cached) = router.pick_decode(req, decode_ctx);
    // Before the router records anything: the index as the decision found it.
    let exact_cached = exact_hit_tokens(req, decode, decode_ctx);
    let tokens = |t: u64| u32::try_from(t).unwrap_or(u32::MAX);
    let decision = decide(rule, tokens(req.prompt_tokens), tokens(believed_cached));
    let prefill = (decision.split && !prefill_ctx.candidates.is_empty())
        .then(|| router.pick_prefill(req, prefill_ctx));
    router.routed(req, decode, prefill, decode_ctx);
    PdRoute {
        decode,
        prefill,
        decision,
        believed_cached,
        exact_cached,
    }
}

/// The prompt tokens vLLM will reuse on `pod` as the index sees it now: its matched blocks
/// (speculative entries included), at most the prompt's full blocks before its last token.
pub fn exact_hit_tokens(req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) -> u64 {
    let Some(name) = ctx.pod_names.get(pod) else {
        return 0;
    };
    let matched = ctx
        .indexer
        .score_hashes(ctx.model, &req.blocks, &[name.as_str()])
        .ok()
        .and_then(|r| {
            r.named()
                .find(|(n, _)| **n == **name)
                .map(|(_, s)| s.matched_blocks)
        })
        .unwrap_or(0);
    let cap = req.prompt_tokens.saturating_sub(1) / ENGINE_BLOCK_TOKENS;
    u64::from(matched).min(cap) * ENGINE_BLOCK_TOKENS
}

/// Tokens per block of the simulated requests (`SimRequest::blocks`).
const ENGINE_BLOCK_TOKENS: u64 = 16;
/// llm-d's approximate producer's block: its 16-token default floored at 64 tokens.
pub const LLMD_BLOCK_TOKENS: u64 = 64;
/// llm-d's shipped P/D config's `maxPrefixTokensToMatch`.
pub const LLMD_MAX_PREFIX_TOKENS: u64 = 16_384;
/// llm-d's `lruCapacityPerServer` default, used until a pod's KV blocks are scraped.
pub const LLMD_LRU_CAPACITY: usize = 31_250;
/// llm-d's shipped P/D weights in both profiles: prefix-cache-scorer 2, queue-scorer 1 (no
/// KV-utilisation scorer).
pub const LLMD_PD_WEIGHTS: PickWeights = PickWeights::NONE.with("prefix", 2.0).with("queue", 1.0);

/// llm-d's P/D scheduler with its approximate prefix producer.
pub struct LlmdApproxPd {
    pods: Vec<LruSet<BlockHash>>,
    weights: PickWeights,
    rng: SplitMix64,
    /// Per pod, the blocks matched for the request being routed.
    matched: Vec<u64>,
    /// The blocks the producer hashed for it.
    hashed: usize,
    /// Decide on the exact hit instead of the producer's count (llm-d's picks, our decision).
    exact_decision: bool,
}

impl LlmdApproxPd {
    /// The shipped configuration, ties broken from `seed`'s stream.
    pub fn new(seed: u64) -> Self {
        Self {
            pods: Vec::new(),
            weights: LLMD_PD_WEIGHTS,
            rng: super::rng(seed ^ 0x11D9D),
            matched: Vec::new(),
            hashed: 0,
            exact_decision: false,
        }
    }

    /// The same picks, the split rule fed the exact hit on the decode pod: what the decision
    /// alone is worth.
    pub fn with_exact_decision(mut self) -> Self {
        self.exact_decision = true;
        self
    }

    /// The producer's block keys for `req`: one per whole 64-token block (the chained hash of
    /// its last 16-token block identifies the prefix), at most 16,384 tokens' worth.
    fn keys(req: &SimRequest) -> impl Iterator<Item = BlockHash> + '_ {
        let per = (LLMD_BLOCK_TOKENS / ENGINE_BLOCK_TOKENS) as usize;
        let max = (LLMD_MAX_PREFIX_TOKENS / LLMD_BLOCK_TOKENS) as usize;
        req.blocks
            .chunks_exact(per)
            .take(max)
            .map(move |c| c[per - 1])
    }

    /// llm-d's `matchLongestPrefix`: walks the blocks while *some* pod holds one, counting per
    /// pod the blocks it holds.
    fn produce(&mut self, req: &SimRequest, pods: usize) {
        while self.pods.len() < pods {
            self.pods.push(LruSet::new());
        }
        self.matched.clear();
        self.matched.resize(pods, 0);
        for key in Self::keys(req) {
            let mut any = false;
            for (p, lru) in self.pods.iter().enumerate() {
                if lru.contains(key) {
                    self.matched[p] += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        // The producer hashes the whole (capped) prompt, whatever matched.
        self.hashed = Self::keys(req).count();
    }

    fn pick_among(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.produce(req, ctx.pod_names.len());
        let total = self.hashed.max(1) as f64;
        let share: Vec<f64> = self.matched.iter().map(|&m| m as f64 / total).collect();
        pick(
            &share,
            PrefixNormalisation::AsGiven,
            ctx,
            self.weights,
            &mut self.rng,
        )
    }

    fn record(&mut self, req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) {
        let capacity = match ctx.scraped.get(pod).map_or(0, |m| m.num_gpu_blocks) {
            0 => LLMD_LRU_CAPACITY,
            blocks => blocks,
        };
        let Some(lru) = self.pods.get_mut(pod) else {
            return;
        };
        for key in Self::keys(req) {
            lru.insert(key);
        }
        while lru.len() > capacity {
            lru.pop_oldest();
        }
    }
}

impl PdRouter for LlmdApproxPd {
    fn name(&self) -> String {
        match self.exact_decision {
            false => "llm-d-approx".into(),
            true => "llm-d-picks+exact".into(),
        }
    }
    fn pick_decode(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> (usize, u64) {
        let d = self.pick_among(req, ctx);
        let cached = match self.exact_decision {
            false => self.matched.get(d).copied().unwrap_or(0) * LLMD_BLOCK_TOKENS,
            true => exact_hit_tokens(req, d, ctx),
        };
        (d, cached)
    }
    fn pick_prefill(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.pick_among(req, ctx)
    }
    fn routed(
        &mut self,
        req: &SimRequest,
        decode: usize,
        prefill: Option<usize>,
        ctx: &RouterContext<'_>,
    ) {
        self.record(req, decode, ctx);
        if let Some(p) = prefill {
            self.record(req, p, ctx);
        }
    }
}

/// kv-indexer's P/D pick: precise scores and the exact hit on the decode pod.
pub struct ExactPd {
    decode: Precise,
    prefill: Precise,
}

impl ExactPd {
    /// With the scorer weights `weights` (llm-d's shipped [`LLMD_PD_WEIGHTS`] for a like-for-
    /// like comparison), ties broken from `seed`'s stream; both pods' routings recorded as
    /// speculative entries.
    pub fn new(weights: PickWeights, seed: u64) -> Self {
        Self {
            decode: Precise::new(weights, true, seed),
            prefill: Precise::new(weights, true, seed ^ 0x9F_E1),
        }
    }
}

impl PdRouter for ExactPd {
    fn name(&self) -> String {
        "exact".into()
    }
    fn pick_decode(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> (usize, u64) {
        let d = self.decode.route(req, ctx);
        (d, self.decode.predicted_hit_tokens(req, d).unwrap_or(0))
    }
    fn pick_prefill(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.prefill.route(req, ctx)
    }
    fn routed(
        &mut self,
        req: &SimRequest,
        decode: usize,
        prefill: Option<usize>,
        ctx: &RouterContext<'_>,
    ) {
        self.decode.routed(req, decode, ctx);
        if let Some(p) = prefill {
            self.prefill.routed(req, p, ctx);
        }
    }
}
