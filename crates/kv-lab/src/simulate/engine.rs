//! One vLLM engine (a pod), step by step, the way vLLM's V1 scheduler runs it.
//!
//! - **Continuous batching under a token budget**: each step first serves the running
//!   sequences in order (a decode is one token; a prompt still being prefilled takes what is
//!   left of the budget: chunked prefill), then admits waiting requests first come, first
//!   served, while the budget (`max_num_batched_tokens`) and `max_num_seqs` allow. Admission
//!   stops at the first request whose blocks do not fit (no skipping ahead).
//! - **A paged KV cache with prefix caching**: a sequence holds one block per `block_size`
//!   tokens of its prompt *and* of its generated tokens. A block joins the prefix cache once its
//!   tokens are computed (published as `BlockStored`); a finished or preempted sequence releases
//!   its blocks tail first, and cached blocks stay resident, free, until evicted (least recently
//!   freed first, published as `BlockRemoved`). An admitted request's leading cached blocks are
//!   hits (at most its known tokens minus one: the last token is always computed).
//! - **Preemption** (recompute): when a running sequence needs a block and every block is held,
//!   the most recently admitted running sequence gives up all its blocks and goes back to the
//!   head of the queue; no request is admitted in a step that preempted.
//! - **Step time**: `step_base_ms + ms_per_token * tokens scheduled + ms_per_context_token *
//!   tokens already in the scheduled sequences' KV` (weights read once per step, compute per
//!   token, attention reads of the context).
//!
//! Invariants (tested here and in `tests/simulate.rs`): a step schedules at most
//! `max_num_batched_tokens` tokens and `max_num_seqs` sequences; the cache never holds more
//! than its capacity, and every block is held by as many sequences as pin it (none once all
//! are done); every admitted request finishes exactly once (or is handed back by a restart).

use std::collections::VecDeque;

use kv_core::BlockHash;
use serde::Serialize;

use super::cache::KvCache;
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

/// A request inside the engine.
#[derive(Debug)]
struct Seq {
    req: usize,
    /// Tokens whose KV is computed.
    computed: u64,
    /// Output tokens sampled so far.
    generated: u64,
    /// Block ids held, in order.
    held: Vec<BlockHash>,
    /// Admitted before (a preempted sequence's hits are not counted again).
    admitted: bool,
}

/// The content hash of block `k` of `req`'s sequence (prompt, then output).
fn block_hash(req: &SimRequest, k: usize) -> BlockHash {
    req.block_hash(k)
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

/// What one step produced.
#[derive(Debug, Clone, Default)]
pub struct StepEnd {
    /// Requests that sampled their first token.
    pub first_tokens: Vec<usize>,
    /// Requests that sampled their last token.
    pub finished: Vec<usize>,
    /// Blocks that joined the prefix cache: runs of consecutive blocks with their parent.
    pub stored: Vec<(Option<BlockHash>, Vec<BlockHash>)>,
    /// Blocks evicted while scheduling the step.
    pub removed: Vec<BlockHash>,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Output tokens sampled.
    pub output_tokens: u64,
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

/// One engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    cache: KvCache<BlockHash>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// The step in flight: (index in `running`, tokens).
    plan: Vec<(usize, u64)>,
    evicted: Vec<BlockHash>,
    /// Counters.
    pub stats: EngineStats,
}

impl Engine {
    /// An idle engine with `capacity_blocks` KV blocks.
    pub fn new(config: EngineConfig, capacity_blocks: usize) -> Self {
        Self {
            config,
            cache: KvCache::new(capacity_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
            evicted: Vec::new(),
            stats: EngineStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u64 {
        self.config.block_size
    }

    /// KV blocks (what vLLM reports as `num_gpu_blocks`).
    pub fn capacity_blocks(&self) -> usize {
        self.cache.capacity()
    }

    /// Whether `req` can ever run here (its prompt and output fit in the whole cache).
    pub fn fits(&self, req: &SimRequest) -> bool {
        let tokens = req.prompt_tokens + req.output_tokens.max(1);
        tokens.div_ceil(self.config.block_size) as usize <= self.cache.capacity()
    }

    /// Queues a request.
    pub fn add(&mut self, req: usize) {
        self.waiting.push_back(Seq {
            req,
            computed: 0,
            generated: 0,
            held: Vec::new(),
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

    /// Share of KV blocks held by sequences (vLLM's `kv_cache_usage`).
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

    /// Gives `seq` blocks for its first `tokens` tokens. `false` when the cache is full.
    fn grow(
        cache: &mut KvCache<BlockHash>,
        evicted: &mut Vec<BlockHash>,
        block_size: u64,
        req: &SimRequest,
        seq: &mut Seq,
        tokens: u64,
    ) -> bool {
        let needed = tokens.div_ceil(block_size) as usize;
        while seq.held.len() < needed {
            match cache.allocate(block_hash(req, seq.held.len()), evicted) {
                Some(id) => seq.held.push(id),
                None => return false,
            }
        }
        true
    }

    fn release(cache: &mut KvCache<BlockHash>, seq: &mut Seq) {
        for &id in seq.held.iter().rev() {
            cache.release(id);
        }
        seq.held.clear();
        seq.computed = 0;
    }

    /// Plans the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self, requests: &[SimRequest]) -> Option<Scheduled> {
        self.plan.clear();
        let bs = self.config.block_size;
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
            while !Self::grow(
                &mut self.cache,
                &mut self.evicted,
                bs,
                req,
                &mut self.running[i],
                target,
            ) {
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
            let max_hits = ((known - 1) / bs) as usize;
            let mut hits = 0;
            while hits < max_hits {
                let h = block_hash(req, hits);
                if !self.cache.is_hit(h) {
                    break;
                }
                self.cache.pin(h);
                seq.held.push(h);
                hits += 1;
            }
            seq.computed = hits as u64 * bs;
            let need = (known - seq.computed).min(budget);
            let target = seq.computed + need;
            if !Self::grow(
                &mut self.cache,
                &mut self.evicted,
                bs,
                req,
                &mut seq,
                target,
            ) {
                Self::release(&mut self.cache, &mut seq);
                self.waiting.push_front(seq);
                break;
            }
            if !seq.admitted {
                seq.admitted = true;
                out.admitted
                    .push((seq.req, (hits as u64 * bs).min(req.prompt_tokens)));
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
    pub fn complete(&mut self, requests: &[SimRequest]) -> StepEnd {
        let bs = self.config.block_size;
        let mut end = StepEnd {
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
            let mut run: Vec<BlockHash> = Vec::new();
            let mut parent = None;
            for k in (before / bs) as usize..(seq.computed / bs) as usize {
                if self.cache.computed(seq.held[k]) {
                    if run.is_empty() {
                        parent = k.checked_sub(1).map(|j| block_hash(req, j));
                    }
                    run.push(block_hash(req, k));
                } else if !run.is_empty() {
                    end.stored.push((parent, std::mem::take(&mut run)));
                }
            }
            if !run.is_empty() {
                end.stored.push((parent, run));
            }
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
    pub fn reset_prefix_cache(&mut self) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while let Some(b) = self.cache.drop_oldest_free() {
            out.push(b);
        }
        out
    }

    /// A restart: the cache and every request are gone. Returns the requests that had not
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
        let pins = self.cache.pins();
        let held = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .map(|s| s.held.len() as u64)
            .sum();
        (pins, held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::mix64;

    fn request(prompt: u64, output: u64, salt: u64) -> SimRequest {
        let blocks = (0..prompt / 16)
            .map(|k| BlockHash::new(mix64(salt ^ mix64(k)) | 1))
            .collect();
        let output_blocks = (prompt / 16..(prompt + output).div_ceil(16))
            .map(|k| BlockHash::new(mix64(salt ^ 0xabc ^ mix64(k)) | 1))
            .collect();
        SimRequest {
            arrival_ms: salt as f64,
            blocks,
            output_blocks,
            prompt_tokens: prompt,
            output_tokens: output,
        }
    }

    /// Runs every request to the end; returns each request's finish count.
    fn drain(engine: &mut Engine, requests: &[SimRequest]) -> Vec<u32> {
        let mut finished = vec![0u32; requests.len()];
        let mut first = vec![0u32; requests.len()];
        while let Some(step) = engine.schedule(requests) {
            let c = engine.config;
            assert!(step.tokens <= c.max_num_batched_tokens, "token budget");
            assert!(step.seqs <= c.max_num_seqs, "sequence limit");
            assert!(
                engine.resident_blocks() <= engine.capacity_blocks(),
                "capacity"
            );
            let end = engine.complete(requests);
            for r in end.first_tokens {
                first[r] += 1;
            }
            for r in end.finished {
                finished[r] += 1;
            }
            let (pins, held) = engine.pin_balance();
            assert_eq!(pins, held, "every pin is a block some sequence holds");
        }
        assert!(first.iter().all(|&n| n == 1), "one first token each");
        finished
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_within_the_budget() {
        let config = EngineConfig {
            max_num_batched_tokens: 512,
            ..Default::default()
        };
        let mut e = Engine::new(config, 1_000);
        let requests = vec![request(2_000, 3, 1)];
        e.add(0);
        let mut steps = Vec::new();
        while let Some(s) = e.schedule(&requests) {
            steps.push(s.tokens);
            e.complete(&requests);
        }
        // 2,000 prompt tokens in chunks of 512 (the 4th chunk samples the first token), then
        // two decode steps.
        assert_eq!(steps, [512, 512, 512, 464, 1, 1]);
        assert_eq!(e.pin_balance(), (0, 0));
        assert_eq!(
            e.resident_blocks(),
            125,
            "prompt and output blocks stay cached"
        );
    }

    #[test]
    fn a_repeated_prompt_hits_its_cached_blocks_but_computes_the_last_token() {
        let mut e = Engine::new(EngineConfig::default(), 1_000);
        let r = request(320, 4, 7);
        let requests = vec![r.clone(), r];
        e.add(0);
        drain(&mut e, &requests[..1]);
        e.add(1);
        let s = e.schedule(&requests).expect("work");
        // 20 blocks cached; the last is recomputed (at most known - 1 tokens are hits).
        assert_eq!(s.admitted, [(1, 304)]);
        assert_eq!(s.tokens, 16);
    }

    #[test]
    fn generated_blocks_are_cached_and_hit_by_the_next_turn() {
        let mut e = Engine::new(EngineConfig::default(), 1_000);
        let first = request(64, 40, 3);
        // The next turn's prompt: the first turn's prompt and answer (6 full blocks), then
        // 16 new tokens.
        let mut blocks = first.blocks.clone();
        blocks.extend(first.output_blocks.iter().take(2).copied());
        blocks.push(BlockHash::new(99));
        let second = SimRequest {
            arrival_ms: 1.0,
            blocks,
            output_blocks: Vec::new(),
            prompt_tokens: 112,
            output_tokens: 1,
        };
        let requests = vec![first, second];
        e.add(0);
        let mut stored = 0;
        while e.schedule(&requests[..1]).is_some() {
            stored += e
                .complete(&requests[..1])
                .stored
                .iter()
                .map(|r| r.1.len())
                .sum::<usize>();
        }
        assert_eq!(stored, 6, "4 prompt blocks, then 2 filled while decoding");
        e.add(1);
        let s = e.schedule(&requests).expect("work");
        assert_eq!(s.admitted, [(1, 96)], "the answer's blocks hit too");
    }

    #[test]
    fn a_full_cache_preempts_the_newest_sequence_and_everything_still_finishes_once() {
        // 40 blocks; a request is admitted with 7 (100 prompt tokens) and grows to 10 while
        // decoding (60 more): five are admitted, then they outgrow the cache.
        let config = EngineConfig {
            max_num_batched_tokens: 2_048,
            ..Default::default()
        };
        let mut e = Engine::new(config, 40);
        let requests: Vec<SimRequest> = (0..12).map(|i| request(100, 60, 100 + i)).collect();
        for (i, r) in requests.iter().enumerate() {
            assert!(e.fits(r));
            e.add(i);
        }
        let finished = drain(&mut e, &requests);
        assert!(finished.iter().all(|&n| n == 1), "{finished:?}");
        assert!(
            e.stats.preemptions > 0,
            "the cache was too small for them all"
        );
        assert_eq!(e.pin_balance(), (0, 0));
    }

    #[test]
    fn many_small_requests_respect_the_sequence_limit() {
        let config = EngineConfig {
            max_num_seqs: 4,
            ..Default::default()
        };
        let mut e = Engine::new(config, 10_000);
        let requests: Vec<SimRequest> = (0..20).map(|i| request(32, 5, 500 + i)).collect();
        for i in 0..requests.len() {
            e.add(i);
        }
        drain(&mut e, &requests);
        assert_eq!(e.stats.max_step_seqs, 4);
    }
}
