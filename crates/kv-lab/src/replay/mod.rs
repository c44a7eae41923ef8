//! `kv-indexer replay`: one block-level prefix cache, one request trace, exact hit statistics.
//!
//! Semantics (as used across the field): when a request arrives, its prefix hit `k` is the
//! largest `k` such that blocks `0..k` are all resident (the walk stops at the first miss; no
//! skip-ahead); its hit tokens are `min(k * block_size, input_length)`. Then every block of the
//! request, hit or miss, is accessed against the eviction policy, in order.
//!
//! Policies: LRU; LFU (least frequently used while resident, ties broken by least recent use);
//! FIFO (a hit changes nothing); and S3-FIFO in two variants. Both have a small FIFO `S` of
//! `round(capacity * small_ratio)` entries (Python's round: half to even), a main FIFO `M` with
//! the rest, a ghost FIFO `G` of ids only, as large as `M`'s share (a ghost hit is a miss that
//! enters `M` with frequency 0; any other miss enters `S` with frequency 0), a saturating
//! frequency (at most `max_freq`) per resident entry, incremented on a hit, and second chance in
//! `M` (an `M` entry with frequency > 0 is requeued with frequency - 1, else it is the victim).
//! - `s3fifo`, the published replay semantics (what independent simulators of KV-cache traces
//!   run): each queue keeps to its own share. Before an entry enters `S`, `S` is drained while
//!   it holds at least its share: its oldest entry moves to `M` if its frequency is >= 1
//!   (keeping it), else it goes to `G`. Before an entry enters `M` (a ghost hit or a promotion),
//!   `M` evicts one victim with second chance while it holds at least its share, and that
//!   victim goes to `G`. So the cache often holds fewer entries than its capacity (`S` is kept
//!   to its share even while `M` has room). Both shares must be at least 1;
//! - `s3fifo-paper`, Yang et al. (SOSP'23), Algorithm 1: nothing is evicted until the whole
//!   cache is full; then the eviction is from `S` when it holds at least its share, else from
//!   `M`; an `S` tail moves to `M` only with frequency > 1; `M`'s victims are not ghosted.
//!
//! Invariant: resident entries never exceed the capacity (the ghost holds ids only).

use std::collections::{BTreeSet, HashMap, VecDeque};

use std::path::Path;

use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig, TokenProcessorError};
use serde::Serialize;
use thiserror::Error;

use crate::lru::LruSet;
use crate::trace::{self, TraceError, TraceKind};

/// A block id (a trace's hash id, or a vLLM block hash).
pub type BlockId = u64;

/// An eviction policy under replay.
pub trait Policy {
    /// Is `id` resident?
    fn contains(&self, id: BlockId) -> bool;
    /// Accesses `id` (a hit updates the policy's state, a miss inserts it).
    fn access(&mut self, id: BlockId);
    /// Resident entries.
    fn len(&self) -> usize;
    /// True when nothing is resident.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Least recently used.
#[derive(Debug)]
pub struct Lru {
    capacity: usize,
    order: LruSet,
}

impl Lru {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            order: LruSet::new(),
        }
    }
}

impl Policy for Lru {
    fn contains(&self, id: BlockId) -> bool {
        self.order.contains(id)
    }

    fn access(&mut self, id: BlockId) {
        if self.capacity == 0 || self.order.touch(id) {
            return;
        }
        if self.order.len() >= self.capacity {
            self.order.pop_oldest();
        }
        self.order.insert(id);
    }

    fn len(&self) -> usize {
        self.order.len()
    }
}

/// Least frequently used while resident; ties go to the least recently used.
#[derive(Debug)]
pub struct Lfu {
    capacity: usize,
    tick: u64,
    state: HashMap<BlockId, (u64, u64)>,
    order: BTreeSet<(u64, u64, BlockId)>,
}

impl Lfu {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            tick: 0,
            state: HashMap::new(),
            order: BTreeSet::new(),
        }
    }
}

impl Policy for Lfu {
    fn contains(&self, id: BlockId) -> bool {
        self.state.contains_key(&id)
    }

    fn access(&mut self, id: BlockId) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        let freq = match self.state.get(&id) {
            Some(&(f, t)) => {
                self.order.remove(&(f, t, id));
                f + 1
            }
            None => {
                if self.state.len() >= self.capacity {
                    if let Some((_, _, victim)) = self.order.pop_first() {
                        self.state.remove(&victim);
                    }
                }
                1
            }
        };
        self.state.insert(id, (freq, self.tick));
        self.order.insert((freq, self.tick, id));
    }

    fn len(&self) -> usize {
        self.state.len()
    }
}

/// First in, first out; a hit changes nothing.
#[derive(Debug)]
pub struct Fifo {
    capacity: usize,
    queue: VecDeque<BlockId>,
    resident: std::collections::HashSet<BlockId>,
}

impl Fifo {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            queue: VecDeque::new(),
            resident: Default::default(),
        }
    }
}

impl Policy for Fifo {
    fn contains(&self, id: BlockId) -> bool {
        self.resident.contains(&id)
    }

    fn access(&mut self, id: BlockId) {
        if self.capacity == 0 || self.resident.contains(&id) {
            return;
        }
        if self.resident.len() >= self.capacity {
            if let Some(victim) = self.queue.pop_front() {
                self.resident.remove(&victim);
            }
        }
        self.queue.push_back(id);
        self.resident.insert(id);
    }

    fn len(&self) -> usize {
        self.resident.len()
    }
}

/// Python's `round(x)`: to the nearest integer, halves to even.
pub fn round_half_even(x: f64) -> usize {
    let floor = x.floor();
    let diff = x - floor;
    let r = if (diff - 0.5).abs() < 1e-12 {
        if floor as i64 % 2 == 0 {
            floor
        } else {
            floor + 1.0
        }
    } else {
        x.round()
    };
    r.max(0.0) as usize
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

/// Which S3-FIFO (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum S3FifoVariant {
    /// The published replay semantics (`s3fifo`): each queue kept to its share.
    Published,
    /// Yang et al., SOSP'23, Algorithm 1 (`s3fifo-paper`).
    Paper,
}

/// S3-FIFO, in the published replay semantics or the paper's.
#[derive(Debug)]
pub struct S3Fifo {
    variant: S3FifoVariant,
    capacity: usize,
    small_capacity: usize,
    main_capacity: usize,
    max_freq: u8,
    small: VecDeque<BlockId>,
    main: VecDeque<BlockId>,
    resident: HashMap<BlockId, (Queue, u8)>,
    /// Ghost FIFO entries (id, generation); `ghost_live` holds the live generation per id.
    ghost: VecDeque<(BlockId, u64)>,
    ghost_live: HashMap<BlockId, u64>,
    generation: u64,
}

impl S3Fifo {
    /// An empty cache of `capacity` blocks with a small queue of `round(capacity * small_ratio)`.
    pub fn new(variant: S3FifoVariant, capacity: usize, small_ratio: f64, max_freq: u8) -> Self {
        let small_capacity = round_half_even(capacity as f64 * small_ratio).min(capacity);
        Self {
            variant,
            capacity,
            small_capacity,
            main_capacity: capacity - small_capacity,
            max_freq,
            small: VecDeque::new(),
            main: VecDeque::new(),
            resident: HashMap::new(),
            ghost: VecDeque::new(),
            ghost_live: HashMap::new(),
            generation: 0,
        }
    }

    /// The small queue's share.
    pub fn small_capacity(&self) -> usize {
        self.small_capacity
    }

    /// Ids in the ghost queue.
    pub fn ghost_len(&self) -> usize {
        self.ghost_live.len()
    }

    fn ghost_insert(&mut self, id: BlockId) {
        if self.main_capacity == 0 {
            return;
        }
        self.generation += 1;
        self.ghost_live.insert(id, self.generation);
        self.ghost.push_back((id, self.generation));
        while self.ghost_live.len() > self.main_capacity {
            match self.ghost.pop_front() {
                Some((old, g)) if self.ghost_live.get(&old) == Some(&g) => {
                    self.ghost_live.remove(&old);
                }
                Some(_) => {}
                None => break,
            }
        }
    }

    /// Published: admits `id` to `S`, draining `S` to below its share first.
    fn admit_small(&mut self, id: BlockId) {
        while self.small.len() >= self.small_capacity {
            let Some(oldest) = self.small.pop_front() else {
                break;
            };
            let freq = self.resident.get(&oldest).map_or(0, |e| e.1);
            if freq >= 1 {
                self.admit_main(oldest, freq);
            } else {
                self.resident.remove(&oldest);
                self.ghost_insert(oldest);
            }
        }
        self.resident.insert(id, (Queue::Small, 0));
        self.small.push_back(id);
    }

    /// Published: admits `id` to `M` with `freq`, first evicting one victim (second chance)
    /// to `G` while `M` holds at least its share.
    fn admit_main(&mut self, id: BlockId, freq: u8) {
        while self.main.len() >= self.main_capacity {
            let Some(victim) = self.second_chance_victim() else {
                break;
            };
            self.resident.remove(&victim);
            self.ghost_insert(victim);
        }
        self.resident.insert(id, (Queue::Main, freq));
        self.main.push_back(id);
    }

    /// Takes `M`'s next victim out of `M`: oldest first, an entry with frequency > 0 requeued
    /// with one less. `None` when `M` is empty. Terminates: every requeue lowers a frequency.
    fn second_chance_victim(&mut self) -> Option<BlockId> {
        while let Some(oldest) = self.main.pop_front() {
            match self.resident.get_mut(&oldest) {
                Some((_, freq)) if *freq > 0 => {
                    *freq -= 1;
                    self.main.push_back(oldest);
                }
                Some(_) => return Some(oldest),
                None => {}
            }
        }
        None
    }

    fn evict_small(&mut self) {
        while let Some(t) = self.small.pop_front() {
            let Some(&(_, freq)) = self.resident.get(&t) else {
                continue;
            };
            if freq > 1 {
                self.resident.insert(t, (Queue::Main, freq));
                self.main.push_back(t);
                if self.main.len() > self.main_capacity {
                    self.evict_main();
                }
            } else {
                self.resident.remove(&t);
                self.ghost_insert(t);
                return;
            }
        }
    }

    fn evict_main(&mut self) {
        if let Some(victim) = self.second_chance_victim() {
            self.resident.remove(&victim);
        }
    }

    fn evict(&mut self) {
        if !self.small.is_empty() && self.small.len() >= self.small_capacity {
            self.evict_small();
        } else if !self.main.is_empty() {
            self.evict_main();
        } else {
            self.evict_small();
        }
    }
}

impl Policy for S3Fifo {
    fn contains(&self, id: BlockId) -> bool {
        self.resident.contains_key(&id)
    }

    fn access(&mut self, id: BlockId) {
        if self.capacity == 0 {
            return;
        }
        if let Some(entry) = self.resident.get_mut(&id) {
            entry.1 = (entry.1 + 1).min(self.max_freq);
            return;
        }
        if self.variant == S3FifoVariant::Published {
            if self.ghost_live.remove(&id).is_some() {
                self.admit_main(id, 0);
            } else {
                self.admit_small(id);
            }
            return;
        }
        while self.resident.len() >= self.capacity {
            self.evict();
        }
        if self.ghost_live.remove(&id).is_some() {
            self.resident.insert(id, (Queue::Main, 0));
            self.main.push_back(id);
        } else {
            self.resident.insert(id, (Queue::Small, 0));
            self.small.push_back(id);
        }
    }

    fn len(&self) -> usize {
        self.resident.len()
    }
}

/// One request of a replay: its blocks and its prompt length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRequest {
    /// Block ids in prompt order (the last may be partial).
    pub blocks: Vec<BlockId>,
    /// Prompt tokens.
    pub input_length: u64,
}

/// One request's result.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct RequestHits {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
}

/// A replay's totals.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReplayResult {
    /// The policy.
    pub policy: String,
    /// The cache size in blocks.
    pub capacity_blocks: usize,
    /// Tokens per block.
    pub block_size: u64,
    /// Requests replayed.
    pub requests: usize,
    /// Sum of prompt tokens.
    pub total_prompt_tokens: u64,
    /// Sum of hit tokens.
    pub total_hit_tokens: u64,
    /// `total_hit_tokens / total_prompt_tokens`.
    pub overall_hit_rate: f64,
    /// Resident blocks at the end (ghost entries excluded).
    pub final_cache_blocks: usize,
    /// Per request, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_request: Option<Vec<RequestHits>>,
}

/// Replays `requests` through `policy`.
pub fn replay(
    name: &str,
    policy: &mut dyn Policy,
    capacity_blocks: usize,
    block_size: u64,
    requests: &[ReplayRequest],
    keep_per_request: bool,
) -> ReplayResult {
    let mut per = Vec::with_capacity(if keep_per_request { requests.len() } else { 0 });
    let (mut prompt, mut hit) = (0u64, 0u64);
    for r in requests {
        let k = r.blocks.iter().take_while(|b| policy.contains(**b)).count() as u64;
        let h = (k * block_size).min(r.input_length);
        for &b in &r.blocks {
            policy.access(b);
        }
        prompt += r.input_length;
        hit += h;
        if keep_per_request {
            per.push(RequestHits {
                prompt_tokens: r.input_length,
                hit_tokens: h,
            });
        }
    }
    ReplayResult {
        policy: name.to_owned(),
        capacity_blocks,
        block_size,
        requests: requests.len(),
        total_prompt_tokens: prompt,
        total_hit_tokens: hit,
        overall_hit_rate: if prompt == 0 {
            0.0
        } else {
            hit as f64 / prompt as f64
        },
        final_cache_blocks: policy.len(),
        per_request: keep_per_request.then_some(per),
    }
}

/// Why a trace could not be turned into replay requests.
#[derive(Debug, Error)]
pub enum LoadError {
    /// Reading or parsing the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The block size cannot hash token traces.
    #[error("block size: {0}")]
    BlockSize(#[from] TokenProcessorError),
}

/// Reads a trace of either kind ([`trace::detect`]): Mooncake block ids as they are, token ids
/// hashed into vLLM's block hashes at `block_size` with `seed` (PYTHONHASHSEED; `None` = unset).
pub fn load_requests(
    path: &Path,
    block_size: u64,
    seed: Option<String>,
) -> Result<Vec<ReplayRequest>, LoadError> {
    match trace::detect(path)? {
        TraceKind::Mooncake => Ok(trace::load_mooncake(path)?
            .into_iter()
            .map(|r| ReplayRequest {
                blocks: r.hash_ids,
                input_length: r.input_length,
            })
            .collect()),
        TraceKind::Tokens => {
            let processor = TokenProcessor::new(&TokenProcessorConfig {
                hash_seed: seed,
                block_size: block_size as usize,
                ..Default::default()
            })?;
            Ok(trace::load_tokens(path)?
                .into_iter()
                .map(|r| ReplayRequest {
                    blocks: processor
                        .block_hashes(&r.token_ids, &RequestExtras::default())
                        .iter()
                        .map(|h| h.get())
                        .collect(),
                    input_length: r.token_ids.len() as u64,
                })
                .collect())
        }
    }
}

/// Why a policy could not be built.
#[derive(Debug, Error, PartialEq)]
pub enum PolicyError {
    /// Unknown name.
    #[error("unknown policy {0:?} (lru, lfu, fifo, s3fifo, s3fifo-paper)")]
    Unknown(String),
    /// `small_ratio` outside [0, 1].
    #[error("small ratio must be between 0 and 1, got {0}")]
    SmallRatio(f64),
    /// `s3fifo` needs both queues: a share of at least one entry each.
    #[error(
        "s3fifo keeps each queue to its share: with capacity {capacity} and small ratio \
         {small_ratio}, the small queue gets {small} entries and the main queue {main}; both \
         need at least 1"
    )]
    S3FifoShares {
        /// The capacity.
        capacity: usize,
        /// The ratio.
        small_ratio: f64,
        /// `S`'s share.
        small: usize,
        /// `M`'s share.
        main: usize,
    },
}

/// A policy by name.
pub fn policy(
    name: &str,
    capacity: usize,
    small_ratio: f64,
    max_freq: u8,
) -> Result<Box<dyn Policy>, PolicyError> {
    if !(0.0..=1.0).contains(&small_ratio) {
        return Err(PolicyError::SmallRatio(small_ratio));
    }
    Ok(match name {
        "lru" => Box::new(Lru::new(capacity)),
        "lfu" => Box::new(Lfu::new(capacity)),
        "fifo" => Box::new(Fifo::new(capacity)),
        "s3fifo" => {
            let p = S3Fifo::new(S3FifoVariant::Published, capacity, small_ratio, max_freq);
            if p.small_capacity == 0 || p.main_capacity == 0 {
                return Err(PolicyError::S3FifoShares {
                    capacity,
                    small_ratio,
                    small: p.small_capacity,
                    main: p.main_capacity,
                });
            }
            Box::new(p)
        }
        "s3fifo-paper" => Box::new(S3Fifo::new(
            S3FifoVariant::Paper,
            capacity,
            small_ratio,
            max_freq,
        )),
        other => return Err(PolicyError::Unknown(other.to_owned())),
    })
}

#[cfg(test)]
mod tests;
