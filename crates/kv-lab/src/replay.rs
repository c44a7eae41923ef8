//! `kv-indexer replay`: one block-level prefix cache, one request trace, exact hit statistics.
//!
//! Semantics (as used across the field): when a request arrives, its prefix hit `k` is the
//! largest `k` such that blocks `0..k` are all resident (the walk stops at the first miss; no
//! skip-ahead); its hit tokens are `min(k * block_size, input_length)`. Then every block of the
//! request, hit or miss, is accessed against the eviction policy, in order.
//!
//! Policies: LRU; LFU (least frequently used while resident, ties broken by least recent use);
//! FIFO (a hit changes nothing); S3-FIFO exactly as Yang et al. (SOSP'23, Algorithm 1): a small
//! FIFO `S` of `round(capacity * small_ratio)` entries (Python's round: half to even), a main
//! FIFO `M` with the rest, a ghost FIFO `G` of ids only, as large as `M`'s capacity (a ghost hit
//! is a miss); a saturating frequency (at most `max_freq`) per resident entry; eviction from `S`
//! when it holds at least its share, else from `M`; an `S` tail with frequency > 1 moves to `M`
//! keeping its frequency, otherwise it goes to `G`; an `M` tail with frequency > 0 is requeued
//! with frequency - 1 (second chance), otherwise evicted; a miss whose id is in `G` enters `M`
//! with frequency 0, any other miss enters `S` with frequency 0.
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

/// S3-FIFO (Yang et al., SOSP'23).
#[derive(Debug)]
pub struct S3Fifo {
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
    pub fn new(capacity: usize, small_ratio: f64, max_freq: u8) -> Self {
        let small_capacity = round_half_even(capacity as f64 * small_ratio).min(capacity);
        Self {
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
        while let Some(t) = self.main.pop_front() {
            let Some(&(_, freq)) = self.resident.get(&t) else {
                continue;
            };
            if freq > 0 {
                self.resident.insert(t, (Queue::Main, freq - 1));
                self.main.push_back(t);
            } else {
                self.resident.remove(&t);
                return;
            }
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
    #[error("unknown policy {0:?} (lru, lfu, fifo, s3fifo)")]
    Unknown(String),
    /// `small_ratio` outside [0, 1].
    #[error("small ratio must be between 0 and 1, got {0}")]
    SmallRatio(f64),
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
        "s3fifo" => Box::new(S3Fifo::new(capacity, small_ratio, max_freq)),
        other => return Err(PolicyError::Unknown(other.to_owned())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(blocks: &[u64], block_size: u64) -> ReplayRequest {
        ReplayRequest {
            blocks: blocks.to_vec(),
            input_length: blocks.len() as u64 * block_size,
        }
    }

    #[test]
    fn python_rounding() {
        assert_eq!(round_half_even(2.5), 2);
        assert_eq!(round_half_even(1.5), 2);
        assert_eq!(round_half_even(0.5), 0);
        assert_eq!(round_half_even(2.6), 3);
        assert_eq!(S3Fifo::new(25, 0.1, 3).small_capacity(), 2);
        assert_eq!(S3Fifo::new(15, 0.1, 3).small_capacity(), 2);
        assert_eq!(S3Fifo::new(100, 0.1, 3).small_capacity(), 10);
    }

    #[test]
    fn prefix_hits_stop_at_the_first_miss_and_cap_at_the_prompt() {
        let mut p = Lru::new(10);
        let trace = vec![
            req(&[1, 2, 3], 4),
            ReplayRequest {
                blocks: vec![1, 9, 3],
                input_length: 10,
            },
            ReplayRequest {
                blocks: vec![1, 2, 3],
                input_length: 10,
            },
        ];
        let r = replay("lru", &mut p, 10, 4, &trace, true);
        let per = r.per_request.expect("kept");
        assert_eq!(per[0].hit_tokens, 0);
        assert_eq!(
            per[1].hit_tokens, 4,
            "block 3 is resident but block 9 missed first"
        );
        assert_eq!(
            per[2].hit_tokens, 10,
            "3 blocks = 12 tokens, capped at the 10-token prompt"
        );
    }

    #[test]
    fn lru_fifo_and_lfu_differ_where_they_should() {
        // Capacity 2: access 1, 2, 1, 3 -> LRU evicts 2, FIFO evicts 1, LFU evicts 2 (freq 1, older).
        for (name, keep) in [("lru", 1), ("fifo", 2), ("lfu", 1)] {
            let mut p = policy(name, 2, 0.1, 3).expect("known");
            for b in [1, 2, 1, 3] {
                p.access(b);
            }
            assert!(p.contains(keep) && p.contains(3) && p.len() == 2, "{name}");
        }
    }

    #[test]
    fn s3fifo_filters_one_hit_wonders_and_readmits_ghosts_to_main() {
        // Capacity 10: small 1, main 9, ghost up to 9.
        let mut p = S3Fifo::new(10, 0.1, 3);
        // A hot block accessed repeatedly, then a scan of one-hit wonders.
        for _ in 0..3 {
            p.access(100);
        }
        for b in 0..50 {
            p.access(b);
        }
        assert!(
            p.contains(100),
            "a hot block survives a scan (promoted to main)"
        );
        assert!(p.len() <= 10);
        // S may exceed its share while M has room: the scan's last 9 blocks (41..49) are still
        // resident in S; the ones before went S -> G (one hit), the ghost keeping the last 9.
        assert!((41..50).all(|b| p.resident.get(&b) == Some(&(Queue::Small, 0))));
        assert!((32..41).all(|b| !p.contains(b) && p.ghost_live.contains_key(&b)));
        assert!(
            !p.ghost_live.contains_key(&31),
            "the ghost is as large as main"
        );
        // A ghost hit is a miss that enters M with frequency 0.
        p.access(40);
        assert_eq!(p.resident.get(&40), Some(&(Queue::Main, 0)));
        assert!(!p.ghost_live.contains_key(&40));
        // Frequencies saturate at max_freq.
        for _ in 0..10 {
            p.access(40);
        }
        assert_eq!(p.resident.get(&40).map(|e| e.1), Some(3));
    }

    #[test]
    fn capacity_is_never_exceeded() {
        let mut x = 12345u64;
        for name in ["lru", "lfu", "fifo", "s3fifo"] {
            let mut p = policy(name, 37, 0.1, 3).expect("known");
            for _ in 0..5000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                p.access((x >> 33) % 100);
                assert!(p.len() <= 37, "{name}");
            }
        }
    }
}
