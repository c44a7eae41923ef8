//! A vLLM engine of a hybrid model (several KV-cache groups), step by step: the scheduler every
//! simulated engine shares ([`super::scheduler`]: continuous batching under a token budget,
//! chunked prefill, first come first served admission, preemption of the newest sequence) over
//! a pool shared by every group ([`HybridBlocks`]), each group keeping what vLLM 0.33's manager
//! of its kind keeps (`single_type_kv_cache_manager.py`).
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

use kv_core::{BlockHash, GroupKind, GroupSpec, Layout};

use super::cache::KvCache;
use super::family::{ModelFamily, UNIT_TOKENS};
use super::request::SimRequest;
use super::scheduler::{Blocks, EngineConfig, Scheduler, StepOutput};

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

/// What one step of a hybrid engine produced: runs per group, and evicted (group, hash).
pub type HybridStepEnd = StepOutput<GroupRun, Key>;

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
pub type HybridEngine = Scheduler<HybridBlocks>;

/// A hybrid model's groups over one pool, and the rule that reconciles them.
#[derive(Debug)]
pub struct HybridBlocks {
    specs: Vec<GroupSpec>,
    groups: Vec<Group>,
    layout: Layout,
}

impl HybridBlocks {
    /// The tokens vLLM's rule reuses for `req` with `known` tokens on `cache` as it is.
    fn hit_tokens(&self, cache: &KvCache<Key>, req: &SimRequest, known: u64) -> u64 {
        let units = (known / u64::from(UNIT_TOKENS)) as usize;
        self.layout
            .hit_tokens(units, known.saturating_sub(1), |g, u| {
                cache.is_hit((g as u32, req.block_hash(u)))
            })
    }
}

impl Blocks for HybridBlocks {
    type Key = Key;
    /// Per group, its blocks in order: `Some` held, `None` not held (freed outside the
    /// window, an earlier Mamba state, or skipped by the hit: vLLM's null block).
    type Held = Vec<Vec<Option<Key>>>;
    type Run = GroupRun;

    fn empty(&self) -> Self::Held {
        vec![Vec::new(); self.groups.len()]
    }

    fn blocks_for(&self, tokens: u64) -> usize {
        self.groups
            .iter()
            .map(|g| tokens.div_ceil(g.block))
            .sum::<u64>() as usize
    }

    /// Frees what the sequence's groups no longer keep at its computed tokens, then gives
    /// every group blocks for its first `tokens` tokens.
    fn grow(
        &self,
        cache: &mut KvCache<Key>,
        evicted: &mut Vec<Key>,
        req: &SimRequest,
        computed: u64,
        held: &mut Self::Held,
        tokens: u64,
    ) -> bool {
        for (g, (group, held)) in self.groups.iter().zip(held.iter_mut()).enumerate() {
            let skipped = group.skipped(computed).min(held.len());
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

    /// Group by group, each tail first.
    fn release(cache: &mut KvCache<Key>, held: &mut Self::Held) {
        for held in held.iter_mut() {
            for id in held.drain(..).rev().flatten() {
                cache.release(id);
            }
        }
    }

    /// The rule's hit, its blocks pinned per group as vLLM's managers return them: full
    /// attention every block, a sliding window the blocks of its window, Mamba the state the
    /// hit starts from.
    fn admit(
        &self,
        cache: &mut KvCache<Key>,
        req: &SimRequest,
        held: &mut Self::Held,
        known: u64,
    ) -> u64 {
        let hit = self.hit_tokens(cache, req, known);
        for (g, (group, held)) in self.groups.iter().zip(held.iter_mut()).enumerate() {
            let blocks = (hit / group.block) as usize;
            let first = match group.kind {
                GroupKind::Full => 0,
                GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. } => {
                    group.skipped(hit)
                }
                GroupKind::Mamba => blocks.saturating_sub(1),
            };
            held.clear();
            held.resize(first.min(blocks), None);
            for i in held.len()..blocks {
                let key = (g as u32, req.block_hash(group.key_unit(i)));
                if cache.is_hit(key) {
                    cache.pin(key);
                    held.push(Some(key));
                } else {
                    // The rule only reuses held blocks; a block it skips is vLLM's null block.
                    held.push(None);
                }
            }
        }
        hit
    }

    fn stored(
        &self,
        cache: &mut KvCache<Key>,
        req: &SimRequest,
        held: &Self::Held,
        (before, after): (u64, u64),
        out: &mut Vec<GroupRun>,
    ) {
        for (g, (group, held)) in self.groups.iter().zip(held).enumerate() {
            let mut run = GroupRun {
                group: g as u32,
                parent: None,
                hashes: Vec::new(),
            };
            let full = (after / group.block) as usize;
            let first = (before / group.block) as usize;
            for (k, slot) in held.iter().enumerate().take(full).skip(first) {
                let cached = slot.is_some_and(|id| cache.computed(id));
                if cached {
                    if run.hashes.is_empty() {
                        run.parent = k.checked_sub(1).map(|j| req.block_hash(group.key_unit(j)));
                    }
                    run.hashes.push(req.block_hash(group.key_unit(k)));
                } else if !run.hashes.is_empty() {
                    let next = GroupRun {
                        group: g as u32,
                        parent: None,
                        hashes: Vec::new(),
                    };
                    out.push(std::mem::replace(&mut run, next));
                }
            }
            if !run.hashes.is_empty() {
                out.push(run);
            }
        }
    }

    fn held_count(held: &Self::Held) -> u64 {
        held.iter().map(|h| h.iter().flatten().count() as u64).sum()
    }
}

impl HybridEngine {
    /// An idle engine of `family` whose pool has `capacity_blocks` blocks.
    pub fn new(config: EngineConfig, family: ModelFamily, capacity_blocks: usize) -> Self {
        let blocks = HybridBlocks {
            specs: family.groups(),
            groups: family.groups().into_iter().map(Group::new).collect(),
            layout: family.layout(),
        };
        Self::with_blocks(config, blocks, capacity_blocks)
    }

    /// The groups, in `group_idx` order.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.blocks.specs
    }

    /// The tokens vLLM's rule reuses for `req` with `known` tokens on the pool as it is.
    pub fn hit_tokens(&self, req: &SimRequest, known: u64) -> u64 {
        self.blocks.hit_tokens(&self.cache, req, known)
    }

    /// Blocks a sequence of the step in flight holds in a sliding-window or Mamba group
    /// although they are wholly behind what the group keeps (0 while the groups free them).
    pub fn held_outside_window(&self) -> usize {
        self.plan
            .iter()
            .map(|&(i, _)| {
                let seq = &self.running[i];
                self.blocks
                    .groups
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
