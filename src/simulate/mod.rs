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
//!   ([`crate::events::decode_batch`]) into a real [`Indexer`];
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

use crate::events::decode_batch;
use crate::indexer::{Indexer, IndexerSettings};

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Arrival time, ms.
    pub arrival_ms: f64,
    /// Prompt block hashes (full 16-token blocks, chained like vLLM's).
    pub blocks: Vec<u64>,
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
pub fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// SplitMix64, for deterministic runs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
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
    pins: HashMap<u64, u32>,
    /// Free (unpinned, resident) blocks: tick of release -> block, and block -> tick.
    free_order: std::collections::BTreeMap<u64, u64>,
    free_tick: HashMap<u64, u64>,
    tick: u64,
}

impl Cache {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            pins: HashMap::new(),
            free_order: Default::default(),
            free_tick: HashMap::new(),
            tick: 0,
        }
    }

    fn resident(&self, b: u64) -> bool {
        self.pins.contains_key(&b)
    }

    fn pinned(&self) -> usize {
        self.pins.len() - self.free_tick.len()
    }

    fn pin(&mut self, b: u64) {
        if let Some(t) = self.free_tick.remove(&b) {
            self.free_order.remove(&t);
        }
        *self.pins.entry(b).or_insert(0) += 1;
    }

    fn unpin(&mut self, b: u64) {
        if let Some(p) = self.pins.get_mut(&b) {
            *p = p.saturating_sub(1);
            if *p == 0 {
                self.tick += 1;
                self.free_order.insert(self.tick, b);
                self.free_tick.insert(b, self.tick);
            }
        }
    }

    /// Evicts the least recently freed block.
    fn evict_one(&mut self) -> Option<u64> {
        let (_, b) = self.free_order.pop_first()?;
        self.free_tick.remove(&b);
        self.pins.remove(&b);
        Some(b)
    }

    /// Drops every free block (a prefix-cache reset).
    fn reset(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(b) = self.evict_one() {
            out.push(b);
        }
        out
    }
}

/// vLLM-shaped payloads (map form) for the events a pod emits.
mod wire {
    use rmp::encode::*;

    fn batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        write_array_len(&mut out, 3).ok();
        write_f64(&mut out, 0.0).ok();
        write_array_len(&mut out, events.len() as u32).ok();
        for e in events {
            out.extend_from_slice(e);
        }
        write_uint(&mut out, 0).ok();
        out
    }

    pub fn stored(hashes: &[u64], parent: Option<u64>, block_size: u64) -> Vec<u8> {
        let mut m = Vec::new();
        write_map_len(&mut m, 7).ok();
        write_str(&mut m, "type").ok();
        write_str(&mut m, "BlockStored").ok();
        write_str(&mut m, "block_hashes").ok();
        write_array_len(&mut m, hashes.len() as u32).ok();
        for &h in hashes {
            write_uint(&mut m, h).ok();
        }
        write_str(&mut m, "parent_block_hash").ok();
        match parent {
            Some(p) => write_uint(&mut m, p).map(|_| ()).ok(),
            None => write_nil(&mut m).ok(),
        };
        write_str(&mut m, "token_ids").ok();
        write_array_len(&mut m, 0).ok();
        write_str(&mut m, "block_size").ok();
        write_uint(&mut m, block_size).ok();
        write_str(&mut m, "lora_id").ok();
        write_nil(&mut m).ok();
        write_str(&mut m, "medium").ok();
        write_str(&mut m, "GPU").ok();
        batch(&[m])
    }

    pub fn removed(hashes: &[u64]) -> Vec<u8> {
        // vLLM sends one BlockRemoved per evicted hash.
        let events: Vec<Vec<u8>> = hashes
            .iter()
            .map(|&h| {
                let mut m = Vec::new();
                write_map_len(&mut m, 3).ok();
                write_str(&mut m, "type").ok();
                write_str(&mut m, "BlockRemoved").ok();
                write_str(&mut m, "block_hashes").ok();
                write_array_len(&mut m, 1).ok();
                write_uint(&mut m, h).ok();
                write_str(&mut m, "medium").ok();
                write_str(&mut m, "GPU").ok();
                m
            })
            .collect();
        batch(&events)
    }

    pub fn cleared() -> Vec<u8> {
        let mut m = Vec::new();
        write_map_len(&mut m, 1).ok();
        write_str(&mut m, "type").ok();
        write_str(&mut m, "AllBlocksCleared").ok();
        batch(&[m])
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
    let mut rng = Rng::new(settings.seed);
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
                    rng.below(pods.len())
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
    use crate::events::{decode_batch, KvEvent};

    /// The simulated pods' payloads take the daemon's decode path and mean what they say.
    #[test]
    fn simulated_payloads_decode_as_vllm_events() {
        let stored = decode_batch(&wire::stored(&[11, 12], Some(10), 16)).expect("stored");
        match stored.events.as_slice() {
            [KvEvent::BlockStored(s)] => {
                assert_eq!(s.block_hashes, vec![11, 12]);
                assert_eq!(s.parent_block_hash, Some(10));
                assert_eq!(s.block_size, 16);
            }
            other => panic!("unexpected {other:?}"),
        }
        let removed = decode_batch(&wire::removed(&[11, 12])).expect("removed");
        assert_eq!(
            removed.events.len(),
            2,
            "one BlockRemoved per hash, as vLLM sends"
        );
        assert!(matches!(&removed.events[1], KvEvent::BlockRemoved(r) if r.block_hashes == [12]));
        let cleared = decode_batch(&wire::cleared()).expect("cleared");
        assert!(matches!(
            cleared.events.as_slice(),
            [KvEvent::AllBlocksCleared]
        ));
    }
}
