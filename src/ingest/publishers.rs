//! Every publisher's stream state, grouped by pod: one entry per pod holds its publishers
//! (model, DP rank), the link that tells whether it is still there, and when it last spoke.
//!
//! Invariants: a pod's entry lives in the shard of its worker ([`worker_of`]), so the
//! worker is its only writer; finding, adding or forgetting a pod is O(1) (a fleet of 100,000
//! pods costs no more per pod than a fleet of ten).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kv_core::EngineKey;
use parking_lot::Mutex;

use super::lifecycle::{LifecycleSettings, Link, Links, Presence};

/// A publisher: one vLLM engine (pod and data-parallel rank, the index's [`EngineKey`]) and
/// the model its stream is about; each has its own sequence counter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublisherKey {
    /// The engine: pod id and data-parallel rank (from the batch, [`kv_core::EventBatch::rank`]).
    pub engine: EngineKey,
    /// Model.
    pub model: Arc<str>,
}

impl PublisherKey {
    /// The publisher of `model`'s events at `pod`, rank `rank`.
    pub fn new(pod: Arc<str>, model: Arc<str>, rank: u32) -> Self {
        Self {
            engine: EngineKey { pod, dp_rank: rank },
            model,
        }
    }
}

/// What the daemon knows about a publisher's stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublisherState {
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// The timestamp (`ts`, vLLM's wall clock) of the batch applied last; with `last_seq` it
    /// tells a stale message from a restart.
    pub last_ts: f64,
    /// The replica whose socket received the message applied last (this one's id when the
    /// message came from its own socket).
    pub received_by: Arc<str>,
    /// Messages applied.
    pub messages: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Restarts seen.
    pub restarts: u64,
    /// Messages lost for good (gaps gap fill could not supply).
    pub messages_lost: u64,
    /// Gap fills that failed in a row (0 once one succeeds). While it is not 0 the publisher is
    /// in backoff: its gaps are counted as lost without asking it again until `backoff_until`.
    pub gap_fill_failures: u32,
    /// No gap fill is asked of this publisher before this instant.
    pub backoff_until: Option<std::time::Instant>,
    /// Messages dropped from this replica's queue because the pod passed its share
    /// (`queueBytesPerPod`, `queueBytes`); each drop starts a resync.
    pub messages_dropped: u64,
    /// Messages were lost (a gap or a drop nothing could fill) since the engine's blocks were
    /// last cleared: its blocks may be short or stale.
    pub stale: bool,
}

/// The worker (and publisher shard) a pod's messages go to.
pub(crate) fn worker_of(pod: &str, workers: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pod.hash(&mut h);
    (h.finish() as usize) % workers.max(1)
}

/// One pod: its publishers and its presence.
#[derive(Debug)]
pub(crate) struct PodEntry {
    /// What tells this replica the pod left: its connection (bind mode) or this replica's
    /// socket to it (connect mode). `None` when its messages come only through the
    /// replication log, or its id names no address: then only silence (the idle timeout) can.
    pub(crate) link: Option<Link>,
    /// When a message of the pod was last applied (or the pod was restored from a snapshot).
    pub(crate) last_message: Instant,
    /// Its publishers: (model, DP rank, state).
    pub(crate) publishers: Vec<(Arc<str>, u32, PublisherState)>,
}

impl PodEntry {
    fn new() -> Self {
        Self {
            link: None,
            last_message: Instant::now(),
            publishers: Vec::new(),
        }
    }

    /// `key`'s state (this entry being `key.pod`'s), created on first use.
    fn state(&mut self, key: &PublisherKey) -> &mut PublisherState {
        let at = self
            .publishers
            .iter()
            .position(|(model, rank, _)| *model == key.model && *rank == key.engine.dp_rank);
        let at = at.unwrap_or_else(|| {
            self.publishers.push((
                key.model.clone(),
                key.engine.dp_rank,
                PublisherState::default(),
            ));
            self.publishers.len() - 1
        });
        &mut self.publishers[at].2
    }
}

/// Publisher states, one map per worker, keyed by pod.
#[derive(Default)]
pub struct Publishers {
    pub(crate) shards: Vec<Mutex<HashMap<Arc<str>, PodEntry>>>,
}

impl Publishers {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, pod: &str) -> &Mutex<HashMap<Arc<str>, PodEntry>> {
        &self.shards[worker_of(pod, self.shards.len())]
    }

    /// Every publisher known, sorted.
    pub fn snapshot(&self) -> Vec<(PublisherKey, PublisherState)> {
        let mut all = Vec::new();
        for shard in &self.shards {
            for (pod, entry) in shard.lock().iter() {
                for (model, rank, state) in &entry.publishers {
                    all.push((
                        PublisherKey::new(pod.clone(), model.clone(), *rank),
                        state.clone(),
                    ));
                }
            }
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// How many pods are known.
    pub fn pod_count(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Puts back publisher states from a snapshot (replacing what is there). Restored pods
    /// count as having spoken now.
    pub(crate) fn restore(&self, states: Vec<(PublisherKey, PublisherState)>) {
        for shard in &self.shards {
            shard.lock().clear();
        }
        for (key, state) in states {
            self.shard(&key.engine.pod)
                .lock()
                .entry(key.engine.pod.clone())
                .or_insert_with(PodEntry::new)
                .publishers
                .push((key.model, key.engine.dp_rank, state));
        }
    }

    /// Runs `f` on `key`'s state, creating it (and its pod's entry) on first use.
    pub(crate) fn with_state<R>(
        &self,
        key: &PublisherKey,
        f: impl FnOnce(&mut PublisherState) -> R,
    ) -> R {
        let mut shard = self.shard(&key.engine.pod).lock();
        let entry = shard
            .entry(key.engine.pod.clone())
            .or_insert_with(PodEntry::new);
        f(entry.state(key))
    }

    /// Calls `f` with every pod known, its presence, when it last spoke and whether this
    /// replica has a link to it (one shard locked at a time).
    pub(crate) fn each_presence(
        &self,
        settings: &LifecycleSettings,
        links: &Links,
        mut f: impl FnMut(&Arc<str>, Presence, Instant, bool),
    ) {
        for shard in &self.shards {
            for (pod, entry) in shard.lock().iter() {
                let presence = settings.presence(links, entry.link.as_ref(), entry.last_message);
                f(pod, presence, entry.last_message, entry.link.is_some());
            }
        }
    }

    /// Pods without a link here (heard only through the shared log) count their silence from
    /// now.
    pub(crate) fn touch_unlinked(&self) {
        let now = Instant::now();
        for shard in &self.shards {
            for entry in shard.lock().values_mut() {
                if entry.link.is_none() {
                    entry.last_message = now;
                }
            }
        }
    }

    /// The last sequence applied for `key`, with its batch timestamp.
    pub(crate) fn last_applied(&self, key: &PublisherKey) -> Option<(u64, f64)> {
        let shard = self.shard(&key.engine.pod).lock();
        let entry = shard.get(&key.engine.pod)?;
        entry
            .publishers
            .iter()
            .find(|(model, rank, _)| *model == key.model && *rank == key.engine.dp_rank)
            .and_then(|(_, _, s)| s.last_seq.map(|seq| (seq, s.last_ts)))
    }

    /// A message of `key` was applied now: `f` updates its state, under the same lock as the
    /// pod's presence; `link` (when the message came from this replica's socket) is what will
    /// tell that the pod left.
    pub(crate) fn applied(
        &self,
        key: &PublisherKey,
        link: Option<&Link>,
        f: impl FnOnce(&mut PublisherState),
    ) {
        let mut shard = self.shard(&key.engine.pod).lock();
        let entry = shard
            .entry(key.engine.pod.clone())
            .or_insert_with(PodEntry::new);
        entry.last_message = Instant::now();
        if let Some(link) = link {
            if entry.link.as_ref() != Some(link) {
                entry.link = Some(link.clone());
            }
        }
        f(entry.state(key));
    }

    /// Forgets `pod`'s publishers of `model` (the pod's entry goes with its last publisher),
    /// so its next message starts afresh.
    pub fn forget_pod(&self, model: &str, pod: &str) {
        let mut shard = self.shard(pod).lock();
        let Some(entry) = shard.get_mut(pod) else {
            return;
        };
        entry.publishers.retain(|(m, _, _)| &**m != model);
        if entry.publishers.is_empty() {
            shard.remove(pod);
            if shard.capacity() > 64 && shard.len() < shard.capacity() / 4 {
                shard.shrink_to_fit();
            }
        }
    }

    /// Forgets every publisher of `model` (the model gave its place in the index): their next
    /// messages start afresh, as late joiners.
    pub(crate) fn forget_model(&self, model: &str) {
        for shard in &self.shards {
            let mut shard = shard.lock();
            shard.retain(|_, entry| {
                entry.publishers.retain(|(m, _, _)| &**m != model);
                !entry.publishers.is_empty()
            });
        }
    }

    /// The DP ranks of `pod` known for `model`.
    pub(crate) fn ranks_of(&self, pod: &str, model: &str) -> Vec<u32> {
        let shard = self.shard(pod).lock();
        shard.get(pod).map_or_else(Vec::new, |e| {
            e.publishers
                .iter()
                .filter(|(m, _, _)| &**m == model)
                .map(|(_, rank, _)| *rank)
                .collect()
        })
    }

    /// The models `pod` publishes for.
    pub(crate) fn models_of(&self, pod: &str) -> Vec<Arc<str>> {
        let shard = self.shard(pod).lock();
        let mut models: Vec<Arc<str>> = shard
            .get(pod)
            .map(|e| e.publishers.iter().map(|(m, _, _)| m.clone()).collect())
            .unwrap_or_default();
        models.sort();
        models.dedup();
        models
    }
}
