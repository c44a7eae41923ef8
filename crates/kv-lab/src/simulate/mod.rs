//! `kv-indexer simulate`: simulated vLLM pods, several routing policies, and the real index.
//!
//! Discrete-event simulation, time in milliseconds, deterministic for a seed:
//! - a **pod** has a paged KV cache of `capacity_blocks`; a request's prompt blocks that are
//!   resident (in use or free) are hits, the rest are allocated, evicting free blocks in LRU
//!   order; the blocks of running requests are pinned; a finished request frees its blocks
//!   tail-first (its last block becomes the first eviction candidate), as vLLM does;
//! - **service time**: one prefill at a time per pod (`prefill_ms_per_token` per uncached token);
//!   decoding runs alongside (`decode_ms_per_token` per output token, at most `max_running`
//!   sequences per pod) and holds the blocks; TTFT = queueing + prefill;
//! - pods **publish** `BlockStored` / `BlockRemoved` / `AllBlocksCleared` as vLLM encodes them
//!   (map-form msgpack), delivered after `event_delay_ms` through the daemon's decoder
//!   ([`kv_core::decode_batch`]) into a real [`Indexer`];
//! - a **router** picks the pod for each arrival ([`routers`]).
//!
//! Scenarios a router cannot foresee: pods of different capacity, traffic that bypasses the
//! router (`bypass_fraction`), cache resets (`resets`: free blocks dropped) and pod restarts
//! (`restarts`: the pod is down for `restart_downtime_ms`, loses its whole cache and publishes
//! `AllBlocksCleared`; requests queued or prefilling on it are retried through the router, and a
//! request routed to a down pod goes to the least-loaded live one, as a gateway retries on
//! connection refused).

pub mod routers;
pub mod workloads;

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use serde::Serialize;

use kv_core::BlockHash;
use kv_core::SplitMix64;
use kv_core::{decode_batch, encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kv_core::{Indexer, IndexerSettings};

use crate::lru::LruSet;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Arrival time, ms.
    pub arrival_ms: f64,
    /// Prompt block hashes (full 16-token blocks, chained like vLLM's).
    pub blocks: Vec<BlockHash>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
}

/// Simulation settings.
#[derive(Debug, Clone, Serialize)]
pub struct SimSettings {
    /// Capacity of each pod, in blocks.
    pub pod_capacity_blocks: Vec<usize>,
    /// Tokens per block.
    pub block_size: u64,
    /// Prefill cost per uncached prompt token, ms.
    pub prefill_ms_per_token: f64,
    /// Fixed cost per prefill, ms.
    pub prefill_overhead_ms: f64,
    /// Decode cost per output token, ms.
    pub decode_ms_per_token: f64,
    /// Sequences a pod runs at once (vLLM's max_num_seqs); more wait in its queue.
    pub max_running: usize,
    /// Delay between a cache change and the index seeing it, ms.
    pub event_delay_ms: f64,
    /// Share of requests that reach a random pod without passing the router.
    pub bypass_fraction: f64,
    /// (time ms, pod): the pod's prefix cache is reset (its free blocks dropped).
    pub resets: Vec<(f64, usize)>,
    /// (time ms, pod): the pod restarts.
    pub restarts: Vec<(f64, usize)>,
    /// How long a restarting pod takes no requests, ms.
    pub restart_downtime_ms: f64,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SimSettings {
    fn default() -> Self {
        Self {
            pod_capacity_blocks: vec![20_000; 8],
            block_size: 16,
            prefill_ms_per_token: 0.06,
            prefill_overhead_ms: 5.0,
            decode_ms_per_token: 20.0,
            max_running: 32,
            event_delay_ms: 50.0,
            bypass_fraction: 0.0,
            resets: Vec::new(),
            restarts: Vec::new(),
            restart_downtime_ms: 60_000.0,
            seed: 42,
        }
    }
}

/// How many leading blocks two prompts share (their common prefix, in blocks).
pub fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The simulation's random stream for `seed` (salted, so seed 0 is no special stream).
pub fn rng(seed: u64) -> SplitMix64 {
    SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_4E5B)
}

/// What the router sees of a pod.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PodLoad {
    /// Waiting for prefill.
    pub queued: usize,
    /// Prefilling or decoding.
    pub running: usize,
}

impl PodLoad {
    /// Requests the pod holds.
    pub fn in_flight(&self) -> usize {
        self.queued + self.running
    }
}

/// A pod's KV cache: resident blocks with their pin counts; free ones in LRU order.
struct Cache {
    capacity: usize,
    pins: HashMap<BlockHash, u32>,
    /// Free (unpinned, resident) blocks, least recently freed first.
    free: LruSet<BlockHash>,
}

impl Cache {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            pins: HashMap::new(),
            free: LruSet::new(),
        }
    }

    fn resident(&self, b: BlockHash) -> bool {
        self.pins.contains_key(&b)
    }

    fn pinned(&self) -> usize {
        self.pins.len() - self.free.len()
    }

    fn pin(&mut self, b: BlockHash) {
        self.free.remove(b);
        *self.pins.entry(b).or_insert(0) += 1;
    }

    fn unpin(&mut self, b: BlockHash) {
        if let Some(p) = self.pins.get_mut(&b) {
            *p = p.saturating_sub(1);
            if *p == 0 {
                self.free.insert(b);
            }
        }
    }

    /// Evicts the least recently freed block.
    fn evict_one(&mut self) -> Option<BlockHash> {
        let b = self.free.pop_oldest()?;
        self.pins.remove(&b);
        Some(b)
    }

    /// Drops every free block (a prefix-cache reset).
    fn reset(&mut self) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while let Some(b) = self.evict_one() {
            out.push(b);
        }
        out
    }
}

/// vLLM-shaped payloads (map form, through kv-core's one encoder) for the events a pod emits.
mod wire {
    use super::*;

    fn batch(events: Vec<KvEvent>) -> Vec<u8> {
        encode_batch(&EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        })
    }

    pub fn stored(hashes: &[BlockHash], parent: Option<BlockHash>, block_size: u64) -> Vec<u8> {
        batch(vec![KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            block_size: block_size as u32,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))])
    }

    pub fn removed(hashes: &[BlockHash]) -> Vec<u8> {
        // vLLM sends one BlockRemoved per evicted hash.
        batch(
            hashes
                .iter()
                .map(|&h| {
                    KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![h],
                        medium: Some(Medium::Gpu),
                        ..Default::default()
                    })
                })
                .collect(),
        )
    }

    pub fn cleared() -> Vec<u8> {
        batch(vec![KvEvent::AllBlocksCleared])
    }
}

#[derive(Debug)]
enum EventKind {
    Arrival(usize),
    /// (pod, request, the pod's incarnation when the prefill started).
    PrefillDone(usize, usize, u32),
    /// (pod, request, incarnation).
    Finish(usize, usize, u32),
    Deliver(usize, Vec<u8>),
    Reset(usize),
    Restart(usize),
    /// A request lost to a restart comes back to the router.
    Retry(usize),
    /// A restarted pod is back (nothing to do but let it start queued work).
    Up,
}

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

struct Pod {
    cache: Cache,
    queue: VecDeque<usize>,
    /// The request being prefilled, with its (hit, prompt) tokens (undone if a restart loses it).
    prefilling: Option<(usize, u64, u64)>,
    running: usize,
    /// Bumped by a restart: events of an earlier incarnation are void.
    incarnation: u32,
    /// The pod takes requests again from this time.
    down_until: f64,
}

/// One policy's results.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// The routing policy.
    pub policy: String,
    /// Requests served.
    pub requests: usize,
    /// Prompt tokens served from pods' caches / all prompt tokens.
    pub token_hit_rate: f64,
    /// Prompt tokens prefilled (not cached).
    pub prefill_tokens: u64,
    /// Time to first token, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Max over mean of pods' in-flight requests, averaged over arrivals.
    pub load_spread: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The model name events and scores use inside the simulation.
pub const MODEL: &str = "sim/model";

/// Runs `requests` (sorted by arrival) against pods routed by `router`.
pub fn run(
    settings: &SimSettings,
    requests: &[SimRequest],
    router: &mut dyn routers::Router,
) -> PolicyReport {
    let indexer = Indexer::new(IndexerSettings::default()).expect("default settings are valid");
    let pod_names: Vec<String> = (0..settings.pod_capacity_blocks.len())
        .map(|p| format!("10.9.0.{p}:8000"))
        .collect();
    let mut pods: Vec<Pod> = settings
        .pod_capacity_blocks
        .iter()
        .map(|&c| Pod {
            cache: Cache::new(c),
            queue: VecDeque::new(),
            prefilling: None,
            running: 0,
            incarnation: 0,
            down_until: f64::NEG_INFINITY,
        })
        .collect();
    let mut rng = rng(settings.seed);
    let mut heap = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<Event>, at: f64, kind: EventKind| {
        order += 1;
        heap.push(Event { at, order, kind });
    };
    for (i, r) in requests.iter().enumerate() {
        push(&mut heap, r.arrival_ms, EventKind::Arrival(i));
    }
    for &(at, pod) in &settings.resets {
        if pod < pods.len() {
            push(&mut heap, at, EventKind::Reset(pod));
        }
    }
    for &(at, pod) in &settings.restarts {
        if pod < pods.len() {
            push(&mut heap, at, EventKind::Restart(pod));
        }
    }
    let mut ttft = Vec::with_capacity(requests.len());
    let (mut hit_tokens, mut prompt_tokens, mut prefill_tokens) = (0u64, 0u64, 0u64);
    let mut spread_sum = 0.0;
    let mut spread_n = 0usize;
    while let Some(Event { at: now, kind, .. }) = heap.pop() {
        match kind {
            EventKind::Arrival(i) | EventKind::Retry(i) => {
                let retry = matches!(kind, EventKind::Retry(_));
                let loads: Vec<PodLoad> = pods
                    .iter()
                    .map(|p| PodLoad {
                        queued: p.queue.len(),
                        running: p.running + usize::from(p.prefilling.is_some()),
                    })
                    .collect();
                let total: usize = loads.iter().map(PodLoad::in_flight).sum();
                if total > 0 && !retry {
                    let max = loads.iter().map(PodLoad::in_flight).max().unwrap_or(0) as f64;
                    spread_sum += max / (total as f64 / loads.len() as f64);
                    spread_n += 1;
                }
                let pod = if settings.bypass_fraction > 0.0 && rng.unit() < settings.bypass_fraction
                {
                    rng.below(pods.len() as u64) as usize
                } else {
                    let ctx = routers::RouterContext {
                        now_ms: now,
                        loads: &loads,
                        indexer: &indexer,
                        model: MODEL,
                        pod_names: &pod_names,
                    };
                    let p = router.route(&requests[i], &ctx).min(pods.len() - 1);
                    // A down pod refuses the connection; the gateway retries the least-loaded
                    // live one and knows where the request went.
                    let p = if pods[p].down_until > now {
                        (0..pods.len())
                            .filter(|&q| pods[q].down_until <= now)
                            .min_by_key(|&q| (loads[q].in_flight(), q))
                            .unwrap_or(p)
                    } else {
                        p
                    };
                    router.routed(&requests[i], p, now);
                    p
                };
                pods[pod].queue.push_back(i);
            }
            EventKind::PrefillDone(pod, i, incarnation) => {
                if pods[pod].incarnation != incarnation {
                    continue;
                }
                pods[pod].prefilling = None;
                pods[pod].running += 1;
                ttft.push(now - requests[i].arrival_ms);
                let decode = requests[i].output_tokens as f64 * settings.decode_ms_per_token;
                push(
                    &mut heap,
                    now + decode,
                    EventKind::Finish(pod, i, incarnation),
                );
            }
            EventKind::Finish(pod, i, incarnation) => {
                if pods[pod].incarnation != incarnation {
                    continue;
                }
                pods[pod].running -= 1;
                // Tail-first: the last block is freed first, so it is evicted first.
                let cap = pods[pod].cache.capacity;
                for &b in requests[i].blocks.iter().take(cap).rev() {
                    pods[pod].cache.unpin(b);
                }
            }
            EventKind::Deliver(pod, payload) => {
                if let Ok(batch) = decode_batch(&payload) {
                    let _ = indexer.apply_batch(MODEL, &pod_names[pod], &batch);
                }
            }
            EventKind::Reset(pod) => {
                let dropped = pods[pod].cache.reset();
                if !dropped.is_empty() {
                    push(
                        &mut heap,
                        now + settings.event_delay_ms,
                        EventKind::Deliver(pod, wire::removed(&dropped)),
                    );
                }
            }
            EventKind::Restart(pod) => {
                let p = &mut pods[pod];
                p.incarnation += 1;
                p.down_until = now + settings.restart_downtime_ms;
                let up_at = p.down_until;
                p.cache = Cache::new(p.cache.capacity);
                // Decoding requests already had their first token; their streams are cut.
                p.running = 0;
                let mut lost: Vec<usize> = p.queue.drain(..).collect();
                if let Some((i, hit, prompt)) = p.prefilling.take() {
                    hit_tokens -= hit;
                    prompt_tokens -= prompt;
                    prefill_tokens -= prompt - hit;
                    lost.insert(0, i);
                }
                for i in lost {
                    push(&mut heap, now, EventKind::Retry(i));
                }
                // The restarted engine's first batch clears what the index held for it.
                push(
                    &mut heap,
                    now + settings.event_delay_ms,
                    EventKind::Deliver(pod, wire::cleared()),
                );
                push(&mut heap, up_at, EventKind::Up);
            }
            EventKind::Up => {}
        }
        // Start prefills wherever a pod is idle and its next request fits.
        for (p, pod) in pods.iter_mut().enumerate() {
            if pod.prefilling.is_some()
                || pod.running >= settings.max_running
                || pod.down_until > now
            {
                continue;
            }
            let Some(&i) = pod.queue.front() else {
                continue;
            };
            let r = &requests[i];
            let blocks = &r.blocks[..r.blocks.len().min(pod.cache.capacity)];
            let hits = blocks
                .iter()
                .take_while(|b| pod.cache.resident(**b))
                .count();
            let new = blocks.iter().filter(|b| !pod.cache.resident(**b)).count();
            if pod.cache.pinned() + blocks.len() > pod.cache.capacity && pod.running > 0 {
                continue; // wait for running requests to free blocks
            }
            pod.queue.pop_front();
            for &b in blocks {
                if pod.cache.resident(b) {
                    pod.cache.pin(b);
                }
            }
            let mut evicted = Vec::new();
            while pod.cache.pins.len() + new > pod.cache.capacity {
                match pod.cache.evict_one() {
                    Some(b) => evicted.push(b),
                    None => break,
                }
            }
            let mut stored = Vec::new();
            let mut parent = None;
            for (k, &b) in blocks.iter().enumerate() {
                if !pod.cache.resident(b) {
                    if stored.is_empty() {
                        parent = k.checked_sub(1).map(|j| blocks[j]);
                    }
                    pod.cache.pin(b);
                    stored.push(b);
                }
            }
            if !evicted.is_empty() {
                push(
                    &mut heap,
                    now + settings.event_delay_ms,
                    EventKind::Deliver(p, wire::removed(&evicted)),
                );
            }
            if !stored.is_empty() {
                push(
                    &mut heap,
                    now + settings.event_delay_ms,
                    EventKind::Deliver(p, wire::stored(&stored, parent, settings.block_size)),
                );
            }
            let hit = (hits as u64 * settings.block_size).min(r.prompt_tokens);
            hit_tokens += hit;
            prompt_tokens += r.prompt_tokens;
            prefill_tokens += r.prompt_tokens - hit;
            let prefill = settings.prefill_overhead_ms
                + (r.prompt_tokens - hit) as f64 * settings.prefill_ms_per_token;
            pod.prefilling = Some((i, hit, r.prompt_tokens));
            push(
                &mut heap,
                now + prefill,
                EventKind::PrefillDone(p, i, pod.incarnation),
            );
        }
    }
    ttft.sort_by(f64::total_cmp);
    PolicyReport {
        policy: router.name(),
        requests: ttft.len(),
        token_hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            hit_tokens as f64 / prompt_tokens as f64
        },
        prefill_tokens,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        load_spread: if spread_n == 0 {
            1.0
        } else {
            spread_sum / spread_n as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::wire;
    use kv_core::BlockHash;
    use kv_core::{decode_batch, KvEvent};

    fn h(v: u64) -> BlockHash {
        BlockHash::new(v)
    }

    /// The simulated pods' payloads take the daemon's decode path and mean what they say.
    #[test]
    fn simulated_payloads_decode_as_vllm_events() {
        let stored = decode_batch(&wire::stored(&[h(11), h(12)], Some(h(10)), 16)).expect("stored");
        match stored.events.as_slice() {
            [KvEvent::BlockStored(s)] => {
                assert_eq!(s.block_hashes, vec![h(11), h(12)]);
                assert_eq!(s.parent_block_hash, Some(h(10)));
                assert_eq!(s.block_size, 16);
            }
            other => panic!("unexpected {other:?}"),
        }
        let removed = decode_batch(&wire::removed(&[h(11), h(12)])).expect("removed");
        assert_eq!(
            removed.events.len(),
            2,
            "one BlockRemoved per hash, as vLLM sends"
        );
        assert!(
            matches!(&removed.events[1], KvEvent::BlockRemoved(r) if r.block_hashes == [h(12)])
        );
        let cleared = decode_batch(&wire::cleared()).expect("cleared");
        assert!(matches!(
            cleared.events.as_slice(),
            [KvEvent::AllBlocksCleared]
        ));
    }
}
