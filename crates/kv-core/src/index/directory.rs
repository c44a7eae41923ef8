//! The readers' map of engines and pods ([`EngineDirectory`]): which pod and rank an engine id
//! is, which engines a pod has, and a dense **pod index** per pod for scoring scratch arrays.
//!
//! Readers hold an immutable directory (`Arc`, published through `ArcSwap`); the registry keeps
//! the master copy and publishes a clone after every change. The maps are persistent (`imbl`:
//! a clone shares every node, a change copies one path), so registering or removing an engine
//! costs O(log pods) and publishing it O(1): a fleet whose pods keep arriving under new names
//! registers in O(n log n) in total, not O(n^2) as a directory rebuilt per change would.
//!
//! Invariants:
//! - a pod index names one pod for the lifetime of one directory value; indexes of removed
//!   pods are reused (lowest first), so a [`PodRef`](crate::PodRef) is only meaningful with the
//!   directory it was scored against (a `ScoreResult` keeps it);
//! - pod indexes and engine ids stay dense: free slots at the end are dropped, so memory
//!   follows the pods known now, not every pod ever seen.
//! - a directory value's [`DenseView`] describes that value: it is built from it on first use,
//!   and every published value starts without one.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use super::types::{EngineId, EngineKey};

/// What the directory knows of a pod.
#[derive(Debug, Clone)]
struct PodEntry {
    /// Its dense index.
    index: u32,
    /// Its engines (DP ranks), in registration order. Shared: copying a map node copies a
    /// pointer, not the list.
    engines: Arc<[EngineId]>,
}

/// What the directory knows of an engine id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EngineEntry {
    /// Its DP rank.
    rank: u32,
    /// Its pod's index.
    pod: u32,
}

/// The readers' map of engines: pods by name (name order), the engines of each pod, a dense
/// index per pod, and each engine's pod and rank. Cheap to clone (persistent maps).
#[derive(Debug, Default, Clone)]
pub struct EngineDirectory {
    /// Pod name -> its entry, in name order.
    by_name: imbl::OrdMap<Arc<str>, PodEntry>,
    /// Pod index -> name (`None`: free).
    names: imbl::Vector<Option<Arc<str>>>,
    /// Engine id -> rank and pod index (`None`: free).
    engines: imbl::Vector<Option<EngineEntry>>,
    /// The same facts as plain arrays, built on first use (never in the registry's master
    /// copy: [`DirectoryBuilder::publish`] hands out each value with an empty one).
    dense: OnceLock<Arc<DenseView>>,
}

/// What a score reads of a directory, as plain arrays: an engine's pod, and the pods in name
/// order. One directory value's view is built once, by the first score that reads it (O(pods +
/// engines)); the persistent maps stay what a registration changes. At 1,024 pods, looking
/// engines up in them, walking the name-ordered map and comparing names while sorting were
/// most of a score's time (docs/benchmarks-history.md, "The facade at 1,024 pods").
#[derive(Debug, Default)]
pub struct DenseView {
    /// Engine id -> pod index ([`NO_POD`]: a free id).
    pod_of: Vec<u32>,
    /// Engine id -> its data-parallel rank (0 for a free id).
    rank_of: Vec<u32>,
    /// Pod index -> whether the pod is data-parallel: it has an engine of a rank above 0
    /// (vLLM fills the rank in every batch, 0 without data parallelism, so rank 0 alone
    /// cannot tell).
    parallel: Vec<bool>,
    /// Pod indexes in name order.
    name_order: Vec<u32>,
    /// Pod index -> its position in `name_order` ([`NO_POD`]: a free index).
    name_rank: Vec<u32>,
}

/// No pod: a free engine id or pod index in a [`DenseView`].
pub const NO_POD: u32 = u32::MAX;

impl DenseView {
    fn of(d: &EngineDirectory) -> Self {
        let pod_of = d
            .engines
            .iter()
            .map(|e| e.map_or(NO_POD, |entry| entry.pod))
            .collect();
        let rank_of = d
            .engines
            .iter()
            .map(|e| e.map_or(0, |entry| entry.rank))
            .collect();
        let mut parallel = vec![false; d.names.len()];
        for entry in d.engines.iter().flatten() {
            if entry.rank > 0 {
                if let Some(p) = parallel.get_mut(entry.pod as usize) {
                    *p = true;
                }
            }
        }
        let name_order: Vec<u32> = d.by_name.values().map(|entry| entry.index).collect();
        let mut name_rank = vec![NO_POD; d.names.len()];
        for (rank, &p) in name_order.iter().enumerate() {
            if let Some(slot) = name_rank.get_mut(p as usize) {
                *slot = rank as u32;
            }
        }
        Self {
            pod_of,
            rank_of,
            parallel,
            name_order,
            name_rank,
        }
    }

    /// The data-parallel rank of an engine.
    #[inline]
    pub fn rank_of(&self, engine: EngineId) -> u32 {
        self.rank_of.get(engine as usize).copied().unwrap_or(0)
    }

    /// Whether pod index `p` is data-parallel (an engine of a rank above 0 is registered).
    #[inline]
    pub fn is_parallel(&self, p: u32) -> bool {
        self.parallel.get(p as usize).copied().unwrap_or(false)
    }

    /// The pod index of an engine.
    #[inline]
    pub fn pod_of(&self, engine: EngineId) -> Option<u32> {
        self.pod_of
            .get(engine as usize)
            .copied()
            .filter(|&p| p != NO_POD)
    }

    /// Every pod's index, in name order.
    pub fn name_order(&self) -> &[u32] {
        &self.name_order
    }

    /// Pod index `p`'s position in name order: comparing two pods' ranks compares their
    /// names (`NO_POD`, `u32::MAX`, for a free index).
    #[inline]
    pub fn name_rank(&self, p: u32) -> u32 {
        self.name_rank.get(p as usize).copied().unwrap_or(NO_POD)
    }
}

/// The registry's master copy of the directory, with the free pod indexes (kept out of the
/// directory itself, so publishing a clone never copies them).
#[derive(Debug, Default)]
pub(super) struct DirectoryBuilder {
    directory: EngineDirectory,
    /// Free pod indexes below `directory.names.len()`.
    free_pods: BTreeSet<u32>,
}

impl DirectoryBuilder {
    /// The directory as it is now, for readers: O(1), shares every node.
    pub(super) fn publish(&self) -> EngineDirectory {
        EngineDirectory {
            dense: OnceLock::new(),
            ..self.directory.clone()
        }
    }

    /// Records engine `id` as `key` (registration). `id` must be free.
    pub(super) fn add(&mut self, id: EngineId, key: &EngineKey) {
        let d = &mut self.directory;
        let pod = match d.by_name.get(&key.pod) {
            Some(entry) => {
                let mut engines = entry.engines.to_vec();
                engines.push(id);
                let index = entry.index;
                d.by_name.insert(
                    key.pod.clone(),
                    PodEntry {
                        index,
                        engines: engines.into(),
                    },
                );
                index
            }
            None => {
                let index = match self.free_pods.pop_first() {
                    Some(index) => {
                        d.names.set(index as usize, Some(key.pod.clone()));
                        index
                    }
                    None => {
                        d.names.push_back(Some(key.pod.clone()));
                        (d.names.len() - 1) as u32
                    }
                };
                d.by_name.insert(
                    key.pod.clone(),
                    PodEntry {
                        index,
                        engines: Arc::from([id]),
                    },
                );
                index
            }
        };
        let slot = id as usize;
        while d.engines.len() <= slot {
            d.engines.push_back(None);
        }
        d.engines.set(
            slot,
            Some(EngineEntry {
                rank: key.dp_rank,
                pod,
            }),
        );
    }

    /// Forgets engine `id` (and its pod, when it was the pod's last engine).
    pub(super) fn remove(&mut self, id: EngineId) {
        let d = &mut self.directory;
        let Some(Some(entry)) = d.engines.get(id as usize).copied() else {
            return;
        };
        d.engines.set(id as usize, None);
        while matches!(d.engines.last(), Some(None)) {
            d.engines.pop_back();
        }
        let Some(Some(name)) = d.names.get(entry.pod as usize).cloned() else {
            return;
        };
        let Some(pod) = d.by_name.get(&name) else {
            return;
        };
        let engines: Vec<EngineId> = pod.engines.iter().copied().filter(|&e| e != id).collect();
        if !engines.is_empty() {
            let index = pod.index;
            d.by_name.insert(
                name,
                PodEntry {
                    index,
                    engines: engines.into(),
                },
            );
            return;
        }
        d.by_name.remove(&name);
        d.names.set(entry.pod as usize, None);
        self.free_pods.insert(entry.pod);
        while matches!(d.names.last(), Some(None)) {
            d.names.pop_back();
            let last = d.names.len() as u32;
            self.free_pods.remove(&last);
        }
    }
}

impl EngineDirectory {
    /// The engines (DP ranks) of a pod.
    pub fn engines_of(&self, pod: &str) -> &[EngineId] {
        self.by_name.get(pod).map_or(&[], |entry| &entry.engines)
    }

    /// A pod's index and engines, in one lookup.
    pub fn pod_entry(&self, pod: &str) -> Option<(u32, &[EngineId])> {
        self.by_name
            .get(pod)
            .map(|entry| (entry.index, &*entry.engines))
    }

    /// The directory as plain arrays (built by the first call on this value).
    pub fn dense(&self) -> &DenseView {
        self.dense.get_or_init(|| Arc::new(DenseView::of(self)))
    }

    /// The engine of `pod` at `rank`, if registered.
    pub fn engine(&self, pod: &str, rank: u32) -> Option<EngineId> {
        self.engines_of(pod).iter().copied().find(|&e| {
            self.engines
                .get(e as usize)
                .copied()
                .flatten()
                .is_some_and(|entry| entry.rank == rank)
        })
    }

    /// The pod index of a pod name (dense: below [`EngineDirectory::pod_slots`]).
    pub fn pod_index(&self, pod: &str) -> Option<u32> {
        self.by_name.get(pod).map(|entry| entry.index)
    }

    /// The name of pod index `p`.
    pub fn pod(&self, p: u32) -> Option<&Arc<str>> {
        self.names.get(p as usize).and_then(Option::as_ref)
    }

    /// How many pods the index knows.
    pub fn pod_count(&self) -> usize {
        self.by_name.len()
    }

    /// One more than the highest pod index in use: the size of a scratch array indexed by
    /// pod index (some slots below it may be free).
    pub fn pod_slots(&self) -> usize {
        self.names.len()
    }

    /// The pod index of an engine.
    #[inline]
    pub fn pod_of(&self, engine: EngineId) -> Option<u32> {
        self.engines
            .get(engine as usize)
            .copied()
            .flatten()
            .map(|entry| entry.pod)
    }

    /// The key of an engine id.
    pub fn key(&self, engine: EngineId) -> Option<EngineKey> {
        let entry = self.engines.get(engine as usize).copied().flatten()?;
        let pod = self.pod(entry.pod)?;
        Some(EngineKey {
            pod: pod.clone(),
            dp_rank: entry.rank,
        })
    }

    /// Every pod known to the index, in name order, with its index.
    pub fn pods(&self) -> impl Iterator<Item = (&Arc<str>, u32)> {
        self.by_name.iter().map(|(name, entry)| (name, entry.index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_keep_their_index_and_free_indexes_are_reused_lowest_first() {
        let mut b = DirectoryBuilder::default();
        b.add(0, &EngineKey::new("b", 0));
        b.add(1, &EngineKey::new("a", 0));
        b.add(2, &EngineKey::new("b", 1));
        b.add(3, &EngineKey::new("c", 0));
        let d = b.publish();
        assert_eq!(d.pod_index("b"), Some(0));
        assert_eq!(d.pod_index("a"), Some(1));
        assert_eq!(d.engines_of("b"), &[0, 2]);
        assert_eq!(d.engine("b", 1), Some(2));
        assert_eq!(d.key(2), Some(EngineKey::new("b", 1)));
        let names: Vec<_> = d.pods().map(|(n, _)| n.to_string()).collect();
        assert_eq!(names, ["a", "b", "c"], "name order");

        let before = d;
        b.remove(1);
        let d = b.publish();
        assert_eq!(d.pod_index("a"), None);
        assert_eq!(d.pod_slots(), 3, "a hole in the middle stays");
        assert_eq!(before.pod_index("a"), Some(1), "a clone is a snapshot");
        b.add(1, &EngineKey::new("d", 0));
        assert_eq!(
            b.publish().pod_index("d"),
            Some(1),
            "the free index is reused"
        );

        b.remove(0);
        assert_eq!(b.publish().engines_of("b"), &[2], "b keeps its other rank");
        for id in [1, 2, 3] {
            b.remove(id);
        }
        let d = b.publish();
        assert_eq!(d.pod_count(), 0);
        assert_eq!(d.pod_slots(), 0, "free slots at the end are dropped");
        assert_eq!(d.pod_of(3), None);
        b.add(7, &EngineKey::new("e", 0));
        let d = b.publish();
        assert_eq!(d.pod_index("e"), Some(0));
        assert_eq!(d.pod_of(7), Some(0));
    }
}
