//! One vLLM engine (a pod), step by step, the way vLLM's V1 scheduler runs it: the scheduler
//! both simulated engines share, over their blocks ([`Blocks`]: the plain engine's one
//! full-attention group, a hybrid model's groups; each engine's own file implements it).
//!
//! - **Continuous batching under a token budget**: each step first serves the running
//!   sequences in order (a decode is one token; a prompt still being prefilled takes what is
//!   left of the budget: chunked prefill), then admits waiting requests first come, first
//!   served, while the budget (`max_num_batched_tokens`) and `max_num_seqs` allow. Admission
//!   stops at the first request whose blocks do not fit (no skipping ahead).
//! - **A paged KV cache with prefix caching** ([`KvCache`]): a block joins the prefix cache
//!   once its tokens are computed (published as `BlockStored`); a finished or preempted
//!   sequence releases its blocks tail first, and cached blocks stay resident, free, until
//!   evicted (least recently freed first, published as `BlockRemoved`). What a sequence holds,
//!   and what an admitted request hits (at most its known tokens minus one: the last token is
//!   always computed), is its [`Blocks`]'.
//! - **Preemption** (recompute): when a running sequence needs a block and every block is held,
//!   the most recently admitted running sequence gives up all its blocks and goes back to the
//!   head of the queue; no request is admitted in a step that preempted.
//! - **Step time**: `step_base_ms + ms_per_token * tokens scheduled + ms_per_context_token *
//!   tokens already in the scheduled sequences' KV` (weights read once per step, compute per
//!   token, attention reads of the context).
//!
//! Invariants (tested in both engines' tests and `tests/simulate*.rs`): a step schedules at
//! most `max_num_batched_tokens` tokens and `max_num_seqs` sequences; the cache never holds
//! more than its capacity, and every block is held by as many sequences as pin it (none once
//! all are done); every admitted request finishes exactly once (or is handed back by a
//! restart).

use std::collections::VecDeque;

use serde::Serialize;

use super::cache::{CacheKey, KvCache};
use super::request::SimRequest;

/// The engine's settings (flags of `kv-indexer simulate`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: u64,
    /// Tokens one step may schedule (vLLM's `max_num_batched_tokens`).
    pub max_num_batched_tokens: u64,
    /// Sequences running at once at most (vLLM's `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Fixed cost of a step, ms (reading the weights once).
    pub step_base_ms: f64,
    /// Cost per token scheduled, ms (the matrix multiplies).
    pub ms_per_token: f64,
    /// Cost per token already in the KV of the scheduled sequences, ms (attention reads).
    pub ms_per_context_token: f64,
}

impl Default for EngineConfig {
    /// Qwen3-32B in BF16 on two H100 SXM (tensor parallel 2), from the datasheet and the
    /// model's shape (docs/simulation.md, "The engine"): 65.5 GB of weights read at 2 x 3.35
    /// TB/s is 9.8 ms, plus 2 ms of launch and sampling; 2 x 32.8 GFLOP per token at 2 x 989
    /// TFLOPS and 50% utilisation is 0.066 ms; 256 KiB of KV per token (64 layers, 8 KV heads
    /// of 128, K and V in BF16) read at 6.7 TB/s is 0.039 us.
    fn default() -> Self {
        Self {
            block_size: 16,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            step_base_ms: 11.8,
            ms_per_token: 0.066,
            ms_per_context_token: 0.000_039,
        }
    }
}

/// What one step scheduled.
#[derive(Debug, Clone, Default)]
pub struct Scheduled {
    /// How long the step takes, ms.
    pub duration_ms: f64,
    /// Requests admitted for the first time, with their prompt tokens found in the cache.
    pub admitted: Vec<(usize, u64)>,
    /// Tokens scheduled.
    pub tokens: u64,
    /// Sequences scheduled.
    pub seqs: usize,
}

/// What one step produced: `R` a run of blocks that joined the prefix cache (one
/// `BlockStored`), `K` an evicted block's key.
#[derive(Debug, Clone)]
pub struct StepOutput<R, K> {
    /// Requests that sampled their first token.
    pub first_tokens: Vec<usize>,
    /// Requests that sampled their last token.
    pub finished: Vec<usize>,
    /// Blocks that joined the prefix cache: runs of consecutive blocks with their parent.
    pub stored: Vec<R>,
    /// Blocks evicted while scheduling the step.
    pub removed: Vec<K>,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Output tokens sampled.
    pub output_tokens: u64,
}

impl<R, K> Default for StepOutput<R, K> {
    fn default() -> Self {
        Self {
            first_tokens: Vec::new(),
            finished: Vec::new(),
            stored: Vec::new(),
            removed: Vec::new(),
            prefill_tokens: 0,
            output_tokens: 0,
        }
    }
}

/// Counters over the engine's life.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Most tokens one step scheduled.
    pub max_step_tokens: u64,
    /// Most sequences one step scheduled.
    pub max_step_seqs: usize,
    /// Sequences preempted.
    pub preemptions: u64,
}

/// What a sequence holds and hits, for one kind of engine: the scheduler asks it for blocks,
/// gives them back, and reports what a step cached.
pub trait Blocks {
    /// A pool block's key.
    type Key: CacheKey;
    /// What one sequence holds.
    type Held;
    /// One run of blocks a step cached (one `BlockStored`).
    type Run;

    /// What a new sequence holds: nothing.
    fn empty(&self) -> Self::Held;

    /// The pool blocks a sequence of `tokens` tokens needs at most (whether it fits at all).
    fn blocks_for(&self, tokens: u64) -> usize;

    /// Gives a sequence with `computed` tokens computed blocks for its first `tokens` tokens
    /// (first freeing what it no longer keeps). `false` when the pool is full.
    fn grow(
        &self,
        cache: &mut KvCache<Self::Key>,
        evicted: &mut Vec<Self::Key>,
        req: &SimRequest,
        computed: u64,
        held: &mut Self::Held,
        tokens: u64,
    ) -> bool;

    /// Releases all of a sequence's blocks, tail first (vLLM's `free`).
    fn release(cache: &mut KvCache<Self::Key>, held: &mut Self::Held);

    /// The tokens an admitted request of `known` tokens hits, its hit blocks pinned into
    /// `held`.
    fn admit(
        &self,
        cache: &mut KvCache<Self::Key>,
        req: &SimRequest,
        held: &mut Self::Held,
        known: u64,
    ) -> u64;

    /// The runs of blocks a step that computed a sequence's tokens `span.0..span.1` cached.
    /// cached.
    fn stored(
        &self,
        cache: &mut KvCache<Self::Key>,
        req: &SimRequest,
        held: &Self::Held,
        span: (u64, u64),
        out: &mut Vec<Self::Run>,
    );

    /// Blocks a sequence holds (each pinned once).
    fn held_count(held: &Self::Held) -> u64;
}

/// A request inside the engine.
#[derive(Debug)]
pub(super) struct Seq<H> {
    pub(super) req: usize,
    /// Tokens whose KV is computed.
    pub(super) computed: u64,
    /// Output tokens sampled so far.
    generated: u64,
    /// Its blocks.
    pub(super) held: H,
    /// Admitted before (a preempted sequence's hits are not counted again).
    admitted: bool,
}

/// One engine over blocks `B`.
#[derive(Debug)]
pub struct Scheduler<B: Blocks> {
    pub(super) config: EngineConfig,
    pub(super) blocks: B,
    pub(super) cache: KvCache<B::Key>,
    waiting: VecDeque<Seq<B::Held>>,
    pub(super) running: Vec<Seq<B::Held>>,
    /// The step in flight: (index in `running`, tokens).
    pub(super) plan: Vec<(usize, u64)>,
    evicted: Vec<B::Key>,
    /// Counters.
    pub stats: EngineStats,
}

impl<B: Blocks> Scheduler<B> {
    /// An idle engine over `blocks` with a pool of `capacity_blocks` blocks.
    pub(super) fn with_blocks(config: EngineConfig, blocks: B, capacity_blocks: usize) -> Self {
        Self {
            config,
            blocks,
            cache: KvCache::new(capacity_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
            evicted: Vec::new(),
            stats: EngineStats::default(),
        }
    }

    /// Pool blocks (what vLLM reports as `num_gpu_blocks`).
    pub fn capacity_blocks(&self) -> usize {
        self.cache.capacity()
    }

    /// Whether `req` can ever run here (the blocks of its whole sequence fit in the pool).
    pub fn fits(&self, req: &SimRequest) -> bool {
        let tokens = req.prompt_tokens + req.output_tokens.max(1);
        self.blocks.blocks_for(tokens) <= self.cache.capacity()
    }

    /// Queues a request.
    pub fn add(&mut self, req: usize) {
        self.waiting.push_back(Seq {
            req,
            computed: 0,
            generated: 0,
            held: self.blocks.empty(),
            admitted: false,
        });
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Share of pool blocks held by sequences (vLLM's `kv_cache_usage`).
    pub fn kv_usage(&self) -> f64 {
        self.cache.used() as f64 / self.cache.capacity().max(1) as f64
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.cache.used()
    }

    /// Blocks resident (held or cached).
    pub fn resident_blocks(&self) -> usize {
        self.cache.resident()
    }

    fn release(cache: &mut KvCache<B::Key>, seq: &mut Seq<B::Held>) {
        B::release(cache, &mut seq.held);
        seq.computed = 0;
    }

    /// Plans the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self, requests: &[SimRequest]) -> Option<Scheduled> {
        self.plan.clear();
        let mut budget = self.config.max_num_batched_tokens;
        let mut out = Scheduled::default();
        let mut context = 0u64;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let req = &requests[self.running[i].req];
            let known = req.prompt_tokens + self.running[i].generated;
            let need = (known - self.running[i].computed).min(budget);
            let target = self.running[i].computed + need;
            let mut scheduled = true;
            loop {
                let seq = &mut self.running[i];
                let (cache, evicted) = (&mut self.cache, &mut self.evicted);
                if self
                    .blocks
                    .grow(cache, evicted, req, seq.computed, &mut seq.held, target)
                {
                    break;
                }
                preempted = true;
                self.stats.preemptions += 1;
                // The newest sequence goes back to the queue; this one only when it is the newest.
                let newest = self.running.len() - 1;
                let mut victim = self.running.remove(newest);
                Self::release(&mut self.cache, &mut victim);
                self.waiting.push_front(victim);
                if newest == i {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            context += self.running[i].computed;
            self.plan.push((i, need));
            budget -= need;
            i += 1;
        }
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let req = &requests[seq.req];
            let known = req.prompt_tokens + seq.generated;
            let hit = self
                .blocks
                .admit(&mut self.cache, req, &mut seq.held, known);
            seq.computed = hit;
            let need = (known - seq.computed).min(budget);
            let target = seq.computed + need;
            let (cache, evicted) = (&mut self.cache, &mut self.evicted);
            if !self
                .blocks
                .grow(cache, evicted, req, seq.computed, &mut seq.held, target)
            {
                Self::release(&mut self.cache, &mut seq);
                self.waiting.push_front(seq);
                break;
            }
            if !seq.admitted {
                seq.admitted = true;
                out.admitted.push((seq.req, hit.min(req.prompt_tokens)));
            }
            context += seq.computed;
            self.running.push(seq);
            self.plan.push((self.running.len() - 1, need));
            budget -= need;
        }
        if self.plan.is_empty() {
            return None;
        }
        out.tokens = self.config.max_num_batched_tokens - budget;
        out.seqs = self.plan.len();
        out.duration_ms = self.config.step_base_ms
            + self.config.ms_per_token * out.tokens as f64
            + self.config.ms_per_context_token * context as f64;
        self.stats.steps += 1;
        self.stats.max_step_tokens = self.stats.max_step_tokens.max(out.tokens);
        self.stats.max_step_seqs = self.stats.max_step_seqs.max(out.seqs);
        Some(out)
    }

    /// Ends the step planned last: computes its tokens, caches the blocks they fill, samples
    /// a token for every sequence whose known tokens are all computed, and releases the
    /// finished ones.
    pub fn complete(&mut self, requests: &[SimRequest]) -> StepOutput<B::Run, B::Key> {
        let mut end = StepOutput {
            removed: std::mem::take(&mut self.evicted),
            ..Default::default()
        };
        let mut done = Vec::new();
        for &(i, need) in &self.plan {
            let seq = &mut self.running[i];
            let req = &requests[seq.req];
            let known = req.prompt_tokens + seq.generated;
            let before = seq.computed;
            seq.computed += need;
            if !(need == 1 && seq.generated > 0 && before + 1 == known) {
                end.prefill_tokens += need;
            }
            let span = (before, seq.computed);
            self.blocks
                .stored(&mut self.cache, req, &seq.held, span, &mut end.stored);
            if seq.computed == known {
                seq.generated += 1;
                end.output_tokens += 1;
                if seq.generated == 1 {
                    end.first_tokens.push(seq.req);
                }
                if seq.generated >= req.output_tokens.max(1) {
                    end.finished.push(seq.req);
                    done.push(i);
                }
            }
        }
        self.plan.clear();
        for &i in done.iter().rev() {
            let mut seq = self.running.remove(i);
            Self::release(&mut self.cache, &mut seq);
        }
        end
    }

    /// A prefix-cache reset: every free cached block is dropped (returned, to publish).
    pub fn reset_prefix_cache(&mut self) -> Vec<B::Key> {
        let mut out = Vec::new();
        while let Some(b) = self.cache.drop_oldest_free() {
            out.push(b);
        }
        out
    }

    /// A restart: the pool and every request are gone. Returns the requests that had not
    /// sampled a token (to retry) and those whose stream is cut.
    pub fn restart(&mut self) -> (Vec<usize>, Vec<usize>) {
        let (mut retry, mut cut) = (Vec::new(), Vec::new());
        for seq in self.running.drain(..).chain(self.waiting.drain(..)) {
            if seq.generated == 0 {
                retry.push(seq.req);
            } else {
                cut.push(seq.req);
            }
        }
        self.cache = KvCache::new(self.cache.capacity());
        self.plan.clear();
        self.evicted.clear();
        (retry, cut)
    }

    /// Pins held across all blocks and what the sequences hold (equal when blocks are
    /// conserved).
    pub fn pin_balance(&self) -> (u64, u64) {
        let held = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .map(|s| B::held_count(&s.held))
            .sum();
        (self.cache.pins(), held)
    }
}
