//! A vLLM engine of a hybrid model (several KV-cache groups), step by step: the plain engine's
//! scheduler ([`super::engine`]: continuous batching under a token budget, chunked prefill,
//! first come first served admission, preemption of the newest sequence) over a pool shared by
//! every group, each group keeping what vLLM 0.33's manager of its kind keeps
//! (`single_type_kv_cache_manager.py`).
//!
//! A separate engine rather than a generalised one: the plain engine stays the code the
//! published figures came from, line for line.
//!
//! - **One pool**: every group draws blocks from one pool of `capacity` blocks (vLLM's
//!   `BlockPool`); a group's block `i` covers its hash units `[i k, (i + 1) k)` and is keyed by
//!   (group, the hash of unit `(i + 1) k - 1`), so the same hash is cached apart per group.
//!   Freed blocks stay cached until evicted, least recently freed first.
//! - **Full attention** keeps every block of a running sequence.
//! - **Sliding window** (`W` tokens): when a sequence is given blocks for a step, its blocks
//!   wholly more than `W - 1` tokens behind its computed tokens are freed first
//!   (`remove_skipped_blocks`); an admitted sequence pins only the window's blocks before its
//!   hit.
//! - **Mamba** (align mode): a state block per block boundary is computed and cached; a
//!   sequence keeps only the block holding its last computed token (earlier states are freed,
//!   still cached), and an admitted sequence pins the one state its hit starts from.
//! - **The hit** of an admitted request is vLLM's rule over what the groups hold
//!   ([`Layout::hit_tokens`], the coordinator's fixed point), at most its known tokens minus
//!   one.
//!
//! Invariants (tested here and in `tests/simulate_hybrid.rs`): the pool never holds more than
//! its capacity; every pin is a block some sequence holds (none once all are done); every
//! admitted request finishes exactly once (or is handed back by a restart); a sliding-window
//! group holds no block outside its window for a scheduled sequence; an admitted request's
//! hit is the rule's answer on the pool as it was.

use std::collections::VecDeque;

use kv_core::{BlockHash, GroupKind, GroupSpec, Layout};

use super::cache::KvCache;
use super::engine::{EngineConfig, EngineStats, Scheduled};
use super::family::{ModelFamily, UNIT_TOKENS};
use super::request::SimRequest;

/// A pool block's key: (group, the hash its block is keyed by).
type Key = (u32, BlockHash);

/// A run of consecutive blocks one group cached in a step (one `BlockStored`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRun {
    /// The group (`group_idx`).
    pub group: u32,
    /// The hash of the group's block before the run (none for block 0).
    pub parent: Option<BlockHash>,
    /// The run's block hashes (each the hash of the block's last unit).
    pub hashes: Vec<BlockHash>,
}

/// What one step of a hybrid engine produced.
#[derive(Debug, Clone, Default)]
pub struct HybridStepEnd {
    /// Requests that sampled their first token.
    pub first_tokens: Vec<usize>,
    /// Requests that sampled their last token.
    pub finished: Vec<usize>,
    /// Blocks that joined the prefix cache, per group.
    pub stored: Vec<GroupRun>,
    /// Blocks evicted while scheduling the step: (group, hash).
    pub removed: Vec<(u32, BlockHash)>,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Output tokens sampled.
    pub output_tokens: u64,
}

/// A request inside the engine.
#[derive(Debug)]
struct Seq {
    req: usize,
    /// Tokens whose KV is computed.
    computed: u64,
    /// Output tokens sampled so far.
    generated: u64,
    /// Per group, its blocks in order: `Some` held, `None` not held (freed outside the window,
    /// an earlier Mamba state, or skipped by the hit: vLLM's null block).
    held: Vec<Vec<Option<Key>>>,
    /// Admitted before (a preempted sequence's hits are not counted again).
    admitted: bool,
}

/// One group as the engine runs it.
#[derive(Debug, Clone, Copy)]
struct Group {
    kind: GroupKind,
    /// Its block, in units.
    units: u64,
    /// Its block, in tokens.
    block: u64,
}

impl Group {
    fn new(spec: GroupSpec) -> Self {
        let units = u64::from(spec.block_units.max(1));
        Self {
            kind: spec.kind,
            units,
            block: units * u64::from(UNIT_TOKENS),
        }
    }

    /// The unit whose hash keys block `i`.
    fn key_unit(&self, i: usize) -> usize {
        (i + 1) * self.units as usize - 1
    }

    /// Blocks wholly outside what a sequence of `computed` tokens keeps (vLLM's
    /// `get_num_skipped_tokens`, in whole blocks).
    fn skipped(&self, computed: u64) -> usize {
        let skipped_tokens = match self.kind {
            GroupKind::Full => 0,
            GroupKind::SlidingWindow { window } => {
                computed.saturating_sub(u64::from(window.saturating_sub(1)))
            }
            // The state after the last computed token lives in the block holding it.
            GroupKind::Mamba => computed.saturating_sub(1),
            // Tokens before the chunk the next token falls in.
            GroupKind::ChunkedLocal { chunk } => computed / u64::from(chunk) * u64::from(chunk),
        };
        (skipped_tokens / self.block) as usize
    }
}

/// One engine of a hybrid model.
#[derive(Debug)]
pub struct HybridEngine {
    config: EngineConfig,
    specs: Vec<GroupSpec>,
    groups: Vec<Group>,
    layout: Layout,
    cache: KvCache<Key>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// The step in flight: (index in `running`, tokens).
    plan: Vec<(usize, u64)>,
    evicted: Vec<Key>,
    /// Counters.
    pub stats: EngineStats,
}

impl HybridEngine {
    /// An idle engine of `family` whose pool has `capacity_blocks` blocks.
    pub fn new(config: EngineConfig, family: ModelFamily, capacity_blocks: usize) -> Self {
        Self {
            config,
            specs: family.groups(),
            groups: family.groups().into_iter().map(Group::new).collect(),
            layout: family.layout(),
            cache: KvCache::new(capacity_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
            evicted: Vec::new(),
            stats: EngineStats::default(),
        }
    }

    /// The groups, in `group_idx` order.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.specs
    }

    /// Pool blocks (what vLLM reports as `num_gpu_blocks`).
    pub fn capacity_blocks(&self) -> usize {
        self.cache.capacity()
    }

    /// Whether `req` can ever run here (every group's blocks for its whole sequence fit).
    pub fn fits(&self, req: &SimRequest) -> bool {
        let tokens = req.prompt_tokens + req.output_tokens.max(1);
        let blocks: u64 = self.groups.iter().map(|g| tokens.div_ceil(g.block)).sum();
        blocks as usize <= self.cache.capacity()
    }

    /// Queues a request.
    pub fn add(&mut self, req: usize) {
        self.waiting.push_back(Seq {
            req,
            computed: 0,
            generated: 0,
            held: vec![Vec::new(); self.groups.len()],
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

    /// The tokens vLLM's rule reuses for `req` with `known` tokens on the pool as it is.
    pub fn hit_tokens(&self, req: &SimRequest, known: u64) -> u64 {
        let units = (known / u64::from(UNIT_TOKENS)) as usize;
        self.layout
            .hit_tokens(units, known.saturating_sub(1), |g, u| {
                self.cache.is_hit((g as u32, req.block_hash(u)))
            })
    }

    /// Frees what `seq`'s groups no longer keep at its computed tokens, then gives every group
    /// blocks for its first `tokens` tokens. `false` when the pool is full.
    fn grow(
        groups: &[Group],
        cache: &mut KvCache<Key>,
        evicted: &mut Vec<Key>,
        req: &SimRequest,
        seq: &mut Seq,
        tokens: u64,
    ) -> bool {
        for (g, (group, held)) in groups.iter().zip(seq.held.iter_mut()).enumerate() {
            let skipped = group.skipped(seq.computed).min(held.len());
            for slot in &mut held[..skipped] {
                if let Some(id) = slot.take() {
                    cache.release(id);
                }
            }
            let needed = tokens.div_ceil(group.block) as usize;
            while held.len() < needed {
                let key = (g as u32, req.block_hash(group.key_unit(held.len())));
                match cache.allocate(key, evicted) {
                    Some(id) => held.push(Some(id)),
                    None => return false,
                }
            }
        }
        true
    }

    /// Releases all of `seq`'s blocks, group by group, each tail first (vLLM's `free`).
    fn release(cache: &mut KvCache<Key>, seq: &mut Seq) {
        for held in &mut seq.held {
            for id in held.drain(..).rev().flatten() {
                cache.release(id);
            }
        }
        seq.computed = 0;
    }

    /// Pins the blocks a hit of `hit` tokens reuses, per group as vLLM's managers return
    /// them: full attention every block, a sliding window the blocks of its window, Mamba
    /// the state the hit starts from.
    fn pin_hit(&mut self, req: &SimRequest, seq: &mut Seq, hit: u64) {
        for (g, (group, held)) in self.groups.iter().zip(seq.held.iter_mut()).enumerate() {
            let blocks = (hit / group.block) as usize;
            let first = match group.kind {
                GroupKind::Full => 0,
                GroupKind::SlidingWindow { .. } => group.skipped(hit),
                GroupKind::Mamba => blocks.saturating_sub(1),
                GroupKind::ChunkedLocal { .. } => group.skipped(hit),
            };
            held.clear();
            held.resize(first.min(blocks), None);
            for i in held.len()..blocks {
                let key = (g as u32, req.block_hash(group.key_unit(i)));
                if self.cache.is_hit(key) {
                    self.cache.pin(key);
                    held.push(Some(key));
                } else {
                    // The rule only reuses held blocks; a block it skips is vLLM's null block.
                    held.push(None);
                }
            }
        }
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
            while !Self::grow(
                &self.groups,
                &mut self.cache,
                &mut self.evicted,
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
            let hit = self.hit_tokens(req, known);
            self.pin_hit(req, &mut seq, hit);
            seq.computed = hit;
            let need = (known - seq.computed).min(budget);
            let target = seq.computed + need;
            if !Self::grow(
                &self.groups,
                &mut self.cache,
                &mut self.evicted,
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

    /// Ends the step planned last: computes its tokens, caches the blocks they fill in every
    /// group, samples a token for every sequence whose known tokens are all computed, and
    /// releases the finished ones.
    pub fn complete(&mut self, requests: &[SimRequest]) -> HybridStepEnd {
        let mut end = HybridStepEnd {
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
            for (g, (group, held)) in self.groups.iter().zip(&seq.held).enumerate() {
                let mut run = GroupRun {
                    group: g as u32,
                    parent: None,
                    hashes: Vec::new(),
                };
                let full = (seq.computed / group.block) as usize;
                let first = (before / group.block) as usize;
                for (k, slot) in held.iter().enumerate().take(full).skip(first) {
                    let cached = slot.is_some_and(|id| self.cache.computed(id));
                    if cached {
                        if run.hashes.is_empty() {
                            run.parent =
                                k.checked_sub(1).map(|j| req.block_hash(group.key_unit(j)));
                        }
                        run.hashes.push(req.block_hash(group.key_unit(k)));
                    } else if !run.hashes.is_empty() {
                        let next = GroupRun {
                            group: g as u32,
                            parent: None,
                            hashes: Vec::new(),
                        };
                        end.stored.push(std::mem::replace(&mut run, next));
                    }
                }
                if !run.hashes.is_empty() {
                    end.stored.push(run);
                }
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
    pub fn reset_prefix_cache(&mut self) -> Vec<(u32, BlockHash)> {
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
            .flat_map(|s| s.held.iter())
            .map(|h| h.iter().flatten().count() as u64)
            .sum();
        (self.cache.pins(), held)
    }

    /// Blocks a sequence of the step in flight holds in a sliding-window or Mamba group
    /// although they are wholly behind what the group keeps (0 while the groups free them).
    pub fn held_outside_window(&self) -> usize {
        self.plan
            .iter()
            .map(|&(i, _)| {
                let seq = &self.running[i];
                self.groups
                    .iter()
                    .zip(&seq.held)
                    .map(|(group, held)| {
                        let skipped = group.skipped(seq.computed).min(held.len());
                        held[..skipped].iter().flatten().count()
                    })
                    .sum::<usize>()
            })
            .sum()
    }
}

#[cfg(test)]
#[path = "hybrid_tests.rs"]
mod tests;
