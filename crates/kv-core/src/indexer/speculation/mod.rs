//! Speculative entries: prompts the gateway routed to a pod whose `BlockStored` has not arrived
//! yet. Between the routing decision and the pod's events (tens to hundreds of milliseconds,
//! more under load) the index does not know the pod holds the prompt, so a burst of requests
//! sharing it would scatter; a recorded routing makes the pod score as holding it meanwhile.
//!
//! Shape: per model, a second [`ModelIndex`] (one engine per pod, rank 0, tier GPU) holds the
//! speculative blocks, so scoring reads them lock-free with the same walk as real entries; a
//! list of **records** (one per recorded routing: the prompt's hashes, when, until when) says
//! why each block is there. Writes (record, confirm, expire) take this model's records lock;
//! reads never do.
//!
//! Invariants:
//! - a pod's speculative blocks are exactly the union of its live records' prompts, each from
//!   block 0, so the set is prefix-closed and a walk from block 0 measures it. (The one
//!   exception: the speculative index's own `size` bound evicting a block, counted.) Removing a
//!   record therefore removes only its blocks no other live record of the pod covers; since a
//!   vLLM hash commits to its whole prefix, the blocks two records share are a common prefix,
//!   found by binary search;
//! - a record is **confirmed** (removed, its blocks now real) when the pod stores its last
//!   block; it **expires** at its deadline, `speculativeTtl` while the pod's events confirm
//!   routings promptly and up to [`MAX_TTL_FACTOR`] times that while they lag (twice the pod's
//!   measured routing-to-`BlockStored` delay);
//! - a pod that publishes no events for the model, or whose hashes never matched, is in
//!   **fallback**: its records have no deadline (nothing would confirm them), and are kept
//!   under the per-pod bound, oldest dropped first; an approximate router for that pod alone;
//! - memory: each record holds its prompt's hashes (8 bytes per block, shared with the
//!   caller's copy); per pod at most `pod_blocks` hashes, in all at most `max_blocks`, the
//!   oldest records dropped beyond either.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::index::{EngineKey, IndexConfig, IndexConfigError, KeyBudget, ModelIndex, Tier};
use crate::BlockHash;

/// The longest deadline a lagging pod's records get, in multiples of `speculativeTtl`.
pub const MAX_TTL_FACTOR: u32 = 8;

/// How much one new delay measurement moves a pod's lag estimate (exponential average).
const LAG_SMOOTHING: f64 = 0.25;

/// Speculation settings (the config's `scoring.speculative*`).
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculationSettings {
    /// A record's lifetime while its pod's events confirm routings promptly.
    pub ttl: Duration,
    /// The weight of a speculative block in a pod's score (GPU blocks weigh 1.0).
    pub weight: f64,
    /// Most prompt blocks a pod's records hold (the fallback's LRU bound); the oldest records
    /// are dropped beyond it.
    pub pod_blocks: usize,
    /// Most prompt blocks all records of a model hold together.
    pub max_blocks: usize,
}

impl Default for SpeculationSettings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(2),
            weight: 1.0,
            pod_blocks: 31_250,
            max_blocks: 1_000_000,
        }
    }
}

/// What recording a routing did (`Indexer::record_routing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutingRecorded {
    /// This many of the prompt's blocks are now speculative for the pod (those after the
    /// blocks it already holds for real).
    Speculated(usize),
    /// The pod already holds every block of the prompt (or the prompt is empty), or, for an
    /// engine with a layout, already takes every block it would take once it had run the
    /// prompt (its hit is in whole scheduler blocks): nothing kept.
    AlreadyHeld,
    /// The prompt has more blocks than a pod's records may hold (`speculativePodBlocks`):
    /// refused, nothing kept.
    TooLong,
}

impl RoutingRecorded {
    /// Blocks made speculative (0 unless [`RoutingRecorded::Speculated`]).
    pub fn blocks(self) -> usize {
        match self {
            Self::Speculated(n) => n,
            Self::AlreadyHeld | Self::TooLong => 0,
        }
    }

    /// The outcome's name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Speculated(_) => "recorded",
            Self::AlreadyHeld => "already_held",
            Self::TooLong => "too_long",
        }
    }
}

/// Why a speculative record left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordEnd {
    /// The pod stored the prompt's last block: its entries are real now.
    Confirmed,
    /// Its deadline passed unconfirmed.
    Expired,
    /// Dropped for the per-pod or per-model bound (oldest first).
    Evicted,
    /// Covered by a newer record of the same pod (the same prompt or a longer one).
    Superseded,
    /// Its pod was cleared or forgotten.
    Cleared,
}

/// Counters of the speculative entries, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Live records.
    pub records: u64,
    /// Prompt blocks the live records hold (with repeats across records).
    pub held_blocks: u64,
    /// Distinct (pod, block) speculative entries.
    pub entries: u64,
    /// Pods with live records.
    pub pods: u64,
    /// Pods in fallback (no events, or hashes that never matched) with live records.
    pub fallback_pods: u64,
    /// Bytes held: the speculative index and the records' hashes.
    pub memory_bytes: u64,
}

/// One pod's speculation as `ListPods` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PodSpeculation {
    /// Live records.
    pub records: u32,
    /// Distinct speculative blocks.
    pub blocks: u64,
    /// In fallback: no events for the model, or hashes that never matched.
    pub fallback: bool,
    /// The lifetime its next record gets (`None` in fallback).
    pub ttl: Option<Duration>,
}

/// One recorded routing.
#[derive(Debug)]
struct Record {
    id: u64,
    /// The data-parallel rank the request was pinned to (its engine in the speculative index).
    rank: u32,
    hashes: Arc<[BlockHash]>,
    recorded: Instant,
    /// `None` while the pod is in fallback.
    deadline: Option<Instant>,
}

/// One pod's records, oldest first.
#[derive(Debug, Default)]
struct PodRecords {
    records: VecDeque<Record>,
    /// Record id by its prompt's last block (what confirms it).
    by_last: HashMap<BlockHash, u64>,
    /// Hashes held by the records.
    held: usize,
    /// Smoothed routing-to-`BlockStored` delay; `None` until measured.
    lag: Option<Duration>,
    /// When the pod's events were last applied (while it had records).
    last_event: Option<Instant>,
    fallback: bool,
}

/// Record ends by reason, for metrics (`RecordEnd` order).
pub type EndCounts = [u64; 5];

fn end_slot(end: RecordEnd) -> usize {
    match end {
        RecordEnd::Confirmed => 0,
        RecordEnd::Expired => 1,
        RecordEnd::Evicted => 2,
        RecordEnd::Superseded => 3,
        RecordEnd::Cleared => 4,
    }
}

#[derive(Debug, Default)]
struct State {
    pods: HashMap<Arc<str>, PodRecords>,
    /// (pod, record id) in record order, for the per-model bound (stale pairs are skipped).
    order: VecDeque<(Arc<str>, u64)>,
    /// Hashes held by every record.
    held: usize,
    next_id: u64,
    /// `order`'s length when the live records were last counted.
    order_counted: usize,
}

/// A model's speculative entries (see the module docs).
pub(crate) struct Speculation {
    settings: SpeculationSettings,
    index: ModelIndex,
    state: Mutex<State>,
    /// Record ends by reason ([`end_slot`] order).
    ends: [AtomicU64; 5],
}

/// The longest common prefix of two prompts' hashes. Chained hashes commit to their prefix, so
/// equal hashes at position `i` mean equal prompts up to `i`: a binary search finds it.
fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    let n = a.len().min(b.len());
    if n == 0 || a[0] != b[0] {
        return 0;
    }
    // a[lo] == b[lo]; a[hi] != b[hi] or hi == n.
    let (mut lo, mut hi) = (0usize, n);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo + 1
}

impl Speculation {
    pub(crate) fn new(settings: SpeculationSettings) -> Result<Self, IndexConfigError> {
        let config = IndexConfig {
            max_keys: settings.max_blocks.max(1),
            pod_cache_size: None,
            writer_lanes: 1,
        };
        let budget = KeyBudget::new(config.max_keys as u64);
        Ok(Self {
            index: ModelIndex::with_budget(config, budget)?,
            settings,
            state: Mutex::new(State::default()),
            ends: Default::default(),
        })
    }

    /// The speculative blocks, one engine per pod (rank 0): what scoring walks.
    pub(crate) fn index(&self) -> &ModelIndex {
        &self.index
    }

    /// Whether any speculative entry exists (a score skips the second walk otherwise).
    pub(crate) fn is_empty(&self) -> bool {
        self.index.key_count() == 0
    }

    /// The lifetime a new record of `pod` gets.
    fn ttl(&self, pod: &PodRecords) -> Option<Duration> {
        if pod.fallback {
            return None;
        }
        let base = self.settings.ttl;
        Some(match pod.lag {
            Some(lag) => (lag * 2).clamp(base, base * MAX_TTL_FACTOR),
            None => base,
        })
    }

    /// Records that `pod`'s rank `rank` was chosen for a prompt with `hashes` (`fallback`: the
    /// pod publishes no usable events). Returns the record's blocks the rank did not already
    /// hold for real (`real_blocks` of them, from the start, it does); 0 records nothing.
    pub(crate) fn record(
        &self,
        pod: &str,
        rank: u32,
        hashes: Arc<[BlockHash]>,
        real_blocks: usize,
        fallback: bool,
        now: Instant,
    ) -> RoutingRecorded {
        let n = hashes.len();
        if n > self.settings.pod_blocks {
            return RoutingRecorded::TooLong;
        }
        if real_blocks >= n {
            return RoutingRecorded::AlreadyHeld;
        }
        let mut state = self.state.lock();
        let state = &mut *state;
        let id = state.next_id;
        state.next_id += 1;
        let key = EngineKey::new(pod, rank);
        let entry = state.pods.entry(key.pod.clone()).or_default();
        entry.fallback = fallback;
        // Records of the rank this one covers (the same prompt, or a prefix of it) are
        // redundant.
        let mut superseded = 0;
        let mut i = 0;
        while i < entry.records.len() {
            let old = &entry.records[i];
            if old.rank == rank && common_prefix(&old.hashes, &hashes) == old.hashes.len() {
                if let Some(old) = entry.records.remove(i) {
                    entry.by_last.remove(&old.hashes[old.hashes.len() - 1]);
                    entry.held -= old.hashes.len();
                    state.held -= old.hashes.len();
                    superseded += 1;
                }
            } else {
                i += 1;
            }
        }
        self.count(RecordEnd::Superseded, superseded);
        let deadline = self.ttl(entry).map(|ttl| now + ttl);
        self.index.write_engine(&key, |w, e| {
            w.store(e, Tier::Gpu, None, &hashes);
        });
        entry.by_last.insert(hashes[n - 1], id);
        entry.held += n;
        state.held += n;
        entry.records.push_back(Record {
            id,
            rank,
            hashes,
            recorded: now,
            deadline,
        });
        state.order.push_back((key.pod.clone(), id));
        self.enforce_bounds(state, &key.pod);
        RoutingRecorded::Speculated(n - real_blocks)
    }

    /// Drops the oldest records of `pod` beyond the per-pod bound, then the oldest of the
    /// model beyond the per-model bound.
    fn enforce_bounds(&self, state: &mut State, pod: &Arc<str>) {
        let mut evicted = 0;
        if let Some(entry) = state.pods.get_mut(pod) {
            while entry.held > self.settings.pod_blocks {
                let held = self.drop_record(pod, entry, 0);
                state.held -= held;
                evicted += 1;
            }
        }
        while state.held > self.settings.max_blocks {
            let Some((other, id)) = state.order.pop_front() else {
                break;
            };
            let Some(entry) = state.pods.get_mut(&other) else {
                continue;
            };
            if let Some(at) = entry.records.iter().position(|r| r.id == id) {
                let held = self.drop_record(&other, entry, at);
                state.held -= held;
                evicted += 1;
                self.settle(state, &other);
            }
        }
        self.count(RecordEnd::Evicted, evicted);
        // Stale pairs (records that ended otherwise) are dropped once they dominate. Counting
        // the live records walks every pod, so it is done only when the pairs have doubled
        // since the last count: amortised O(1) per record.
        if state.order.len() > 2 * state.order_counted + 64 {
            let live: usize = state.pods.values().map(|p| p.records.len()).sum();
            if state.order.len() > 2 * live {
                let pods = &state.pods;
                state.order.retain(|(pod, id)| {
                    pods.get(pod)
                        .is_some_and(|p| p.records.iter().any(|r| r.id == *id))
                });
            }
            state.order_counted = state.order.len();
        }
        self.settle(state, pod);
    }

    /// Removes record `at` of `pod` and the blocks no other record of the pod covers. Returns
    /// the hashes it held (the caller updates the model's total).
    fn drop_record(&self, pod: &str, entry: &mut PodRecords, at: usize) -> usize {
        let Some(record) = entry.records.remove(at) else {
            return 0;
        };
        let n = record.hashes.len();
        entry.by_last.remove(&record.hashes[n - 1]);
        entry.held -= n;
        let covered = entry
            .records
            .iter()
            .filter(|r| r.rank == record.rank)
            .map(|r| common_prefix(&r.hashes, &record.hashes))
            .max()
            .unwrap_or(0);
        if covered < n {
            let key = EngineKey::new(pod, record.rank);
            self.index.write_engine(&key, |w, e| {
                w.remove(e, Tier::Gpu, &record.hashes[covered..]);
            });
        }
        n
    }

    /// If `pod` has no records left: removes its engine, and forgets it unless its lag
    /// estimate is worth keeping (a pod with events, whose records come and go).
    fn settle(&self, state: &mut State, pod: &str) {
        let Some(entry) = state.pods.get(pod) else {
            return;
        };
        if !entry.records.is_empty() {
            return;
        }
        self.index.remove_pod(pod);
        if entry.fallback || entry.lag.is_none() {
            state.pods.remove(pod);
            if state.pods.capacity() > 64 && state.pods.len() < state.pods.capacity() / 4 {
                state.pods.shrink_to_fit();
            }
        }
    }

    fn count(&self, end: RecordEnd, n: u64) {
        if n > 0 {
            self.ends[end_slot(end)].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `pod`'s events were applied (`stored`: the blocks its `BlockStored` events named): the
    /// records whose last block is among them are confirmed, and measure the pod's lag.
    /// Cheap when the pod has no records (one map lookup under the records lock, taken only
    /// while the model has speculative entries).
    pub(crate) fn confirm(&self, pod: &str, stored: &[&[BlockHash]], now: Instant) {
        if self.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        let state = &mut *state;
        let Some(entry) = state.pods.get_mut(pod) else {
            return;
        };
        entry.last_event = Some(now);
        let mut confirmed = 0;
        for run in stored {
            for hash in *run {
                let Some(&id) = entry.by_last.get(hash) else {
                    continue;
                };
                let Some(at) = entry.records.iter().position(|r| r.id == id) else {
                    continue;
                };
                let delay = now.saturating_duration_since(entry.records[at].recorded);
                entry.lag = Some(smooth(entry.lag, delay));
                state.held -= self.drop_record(pod, entry, at);
                confirmed += 1;
            }
        }
        self.count(RecordEnd::Confirmed, confirmed);
        if confirmed > 0 {
            self.settle(state, pod);
        }
    }

    /// Ends the records whose deadline passed, after re-deciding each pod's fallback
    /// (`fallback(pod)`): a pod entering it keeps its records without deadline, one leaving it
    /// gives them its TTL from now. A record that expires after the pod's events flowed past
    /// it counts as a delay of at least its lifetime (the pod lags). Returns records expired.
    pub(crate) fn expire(&self, now: Instant, fallback: impl Fn(&str) -> bool) -> u64 {
        let mut state = self.state.lock();
        let state = &mut *state;
        let mut expired = 0;
        let mut touched = Vec::new();
        for (pod, entry) in state.pods.iter_mut() {
            let was = entry.fallback;
            entry.fallback = fallback(pod);
            if was != entry.fallback {
                let deadline = self.ttl(entry).map(|ttl| now + ttl);
                for r in entry.records.iter_mut() {
                    r.deadline = deadline;
                }
            }
            let mut i = 0;
            while i < entry.records.len() {
                let r = &entry.records[i];
                let Some(deadline) = r.deadline.filter(|d| *d <= now) else {
                    i += 1;
                    continue;
                };
                if entry.last_event.is_some_and(|t| t > r.recorded) {
                    let lived = deadline.saturating_duration_since(r.recorded);
                    entry.lag = Some(smooth(entry.lag, lived));
                }
                state.held -= self.drop_record(pod, entry, i);
                expired += 1;
                if touched.last() != Some(pod) {
                    touched.push(pod.clone());
                }
            }
        }
        self.count(RecordEnd::Expired, expired);
        for pod in touched {
            self.settle(state, &pod);
        }
        expired
    }

    /// Drops every record of `pod` and its speculative blocks. Returns the entries removed.
    pub(crate) fn clear_pod(&self, pod: &str) -> usize {
        let mut state = self.state.lock();
        let Some(entry) = state.pods.remove(pod) else {
            return 0;
        };
        state.held -= entry.held;
        self.count(RecordEnd::Cleared, entry.records.len() as u64);
        self.index.remove_pod(pod)
    }

    /// `pod`'s speculation, if it has records.
    pub(crate) fn pod(&self, pod: &str) -> Option<PodSpeculation> {
        let state = self.state.lock();
        let entry = state.pods.get(pod)?;
        Some(PodSpeculation {
            records: entry.records.len() as u32,
            blocks: self.index.directory().engine(pod, 0).map_or(0, |e| {
                self.index.write(e, |w| w.engine_blocks(e)) // one engine: a short lock
            }),
            fallback: entry.fallback,
            ttl: self.ttl(entry),
        })
    }

    /// Pods with records, in name order.
    pub(crate) fn pods(&self) -> Vec<Arc<str>> {
        let state = self.state.lock();
        let mut pods: Vec<Arc<str>> = state
            .pods
            .iter()
            .filter(|(_, p)| !p.records.is_empty())
            .map(|(pod, _)| pod.clone())
            .collect();
        pods.sort();
        pods
    }

    pub(crate) fn stats(&self) -> SpeculationStats {
        let state = self.state.lock();
        let index = self.index.stats();
        SpeculationStats {
            records: state.pods.values().map(|p| p.records.len() as u64).sum(),
            held_blocks: state.held as u64,
            entries: index.memberships,
            pods: state
                .pods
                .values()
                .filter(|p| !p.records.is_empty())
                .count() as u64,
            fallback_pods: state
                .pods
                .values()
                .filter(|p| p.fallback && !p.records.is_empty())
                .count() as u64,
            memory_bytes: index.memory_bytes
                + (state.held * std::mem::size_of::<BlockHash>()) as u64,
        }
    }

    /// Records ended so far, by reason (`RecordEnd` order: confirmed, expired, evicted,
    /// superseded, cleared).
    pub(crate) fn ends(&self) -> EndCounts {
        std::array::from_fn(|i| self.ends[i].load(Ordering::Relaxed))
    }
}

fn smooth(lag: Option<Duration>, sample: Duration) -> Duration {
    match lag {
        None => sample,
        Some(lag) => lag.mul_f64(1.0 - LAG_SMOOTHING) + sample.mul_f64(LAG_SMOOTHING),
    }
}

#[cfg(test)]
mod tests;
