//! An engine's KV-cache groups, learned from its own events, and the layouts scoring reads.
//!
//! vLLM (0.20+) tags every `BlockStored` with its `group_idx` and (0.22+) the group's
//! `kv_cache_spec_kind` and sliding window, and every `BlockRemoved` with its `group_idx`. Each
//! group's blocks are indexed in the group's own key space ([`BlockHash::in_group`]): group 0
//! (and events naming no group) under the plain keys, the others apart, so one engine's groups
//! never share a membership. A group's block is learned as the widest its events show (a
//! partial entry, one hash unit, is narrower than the group's block).
//!
//! Invariants:
//! - an engine whose groups are one full-attention group of one unit has no layout: the plain
//!   prefix walk is its whole rule, nothing is published and scoring pays nothing;
//! - a group whose kind is not modelled (chunked local attention without the model's
//!   `attentionChunkSize`) or whose block is not a whole number of units is
//!   refused for that engine: its events are counted and skipped, never guessed, and its
//!   removals are skipped too. Aligned and translated engines alike (a translated engine maps
//!   each group's blocks apart, `translate`);
//! - layouts are published copy-on-write ([`Layouts`]); a reader loads them without a lock.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::events::BlockStored;
use crate::hit::{GroupKind, GroupSpec, Layout, LayoutError};
use crate::index::EngineId;

/// What scoring needs of an engine that is not plain: its rule, and the `group_idx` of each of
/// the rule's groups (the key space its memberships are in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineLayout {
    /// The hit rule over the groups learned so far.
    pub layout: Layout,
    /// `group_idx` of the rule's group `i`.
    pub group_ids: Vec<u32>,
    /// The full-attention group whose held prefix the index's walk measures (its position in
    /// the rule, and its `group_idx`): the first full-attention group when its block is one
    /// unit and no other group shares its spec. Scoring takes its prefix from one walk over
    /// all engines instead of a lookup per block per engine.
    pub walked: Option<(usize, u32)>,
}

impl std::fmt::Display for EngineLayout {
    /// `group 0: full attention, 1 unit; group 1: sliding window 128, 1 unit`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (g, spec)) in self.group_ids.iter().zip(self.layout.groups()).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            let units = spec.block_units;
            let plural = if units == 1 { "" } else { "s" };
            match spec.kind {
                GroupKind::Full => write!(f, "group {g}: full attention, {units} unit{plural}")?,
                GroupKind::SlidingWindow { window } => write!(
                    f,
                    "group {g}: sliding window {window}, {units} unit{plural}"
                )?,
                GroupKind::Mamba => write!(f, "group {g}: mamba, {units} unit{plural}")?,
                GroupKind::ChunkedLocal { chunk } => write!(
                    f,
                    "group {g}: chunked local attention {chunk}, {units} unit{plural}"
                )?,
            }
        }
        Ok(())
    }
}

/// The published layouts of a model's engines that are not plain.
pub(super) type Layouts = HashMap<EngineId, Arc<EngineLayout>>;

/// Where a block event of a group goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// Stored or removed in this group's key space.
    Group(u32),
    /// Not indexed: the group is refused for this engine.
    Skip,
}

/// What a model's settings say about its engines' groups, which events do not carry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelGroups {
    /// The attention chunk of chunked-local-attention groups, in tokens.
    pub chunk: Option<u32>,
    /// The model keeps more than one KV-cache group: an engine whose events name no group
    /// (SGLang, which publishes only its full-attention KV; vLLM before 0.20) cannot be
    /// scored by the hit it takes, and is refused.
    pub hybrid: bool,
}

/// One engine's groups as its events have shown them.
#[derive(Debug, Default)]
pub(super) struct EngineGroups {
    /// (group_idx, spec), in group order.
    seen: Vec<(u32, GroupSpec)>,
    /// Groups refused for this engine.
    refused: HashSet<u32>,
}

/// The group a `group_idx` names (none: group 0); `None` for a negative or huge one.
fn group_of(group_idx: Option<i64>) -> Option<u32> {
    match group_idx {
        None => Some(0),
        Some(g) => u32::try_from(g)
            .ok()
            .filter(|&g| (g as usize) < crate::hit::MAX_GROUPS),
    }
}

impl EngineGroups {
    /// Routes a `BlockStored` and learns its group. `unit` is the index's block size;
    /// `model` what the model's settings say (events do not carry it). The second value is
    /// true when the engine's layout changed (to publish).
    pub(super) fn stored(
        &mut self,
        s: &BlockStored,
        unit: u32,
        model: ModelGroups,
    ) -> (Route, bool) {
        let Some(g) = group_of(s.group_idx) else {
            return (Route::Skip, false);
        };
        if self.refused.contains(&g) {
            return (Route::Skip, false);
        }
        if model.hybrid && s.group_idx.is_none() {
            // A hybrid model's engine that names no group publishes one group's blocks (or
            // all mixed): the hit it takes is not in its events.
            self.refused.insert(g);
            self.seen.clear();
            return (Route::Skip, true);
        }
        let kind = GroupKind::parse_chunked(
            s.kv_cache_spec_kind.as_deref(),
            s.kv_cache_spec_sliding_window,
            model.chunk,
        );
        let units = (unit > 0 && s.block_size > 0 && s.block_size.is_multiple_of(unit))
            .then(|| s.block_size / unit);
        let spec = match (kind, units) {
            (Ok(kind), Some(block_units)) => GroupSpec { kind, block_units },
            // Group 0's block size is translation's to refuse (its key mode says why).
            (Ok(_), None) if g == 0 => return (Route::Group(0), false),
            _ => {
                self.refused.insert(g);
                self.seen.retain(|(seen, _)| *seen != g);
                return (Route::Skip, true);
            }
        };
        let changed = match self.seen.iter_mut().find(|(seen, _)| *seen == g) {
            // A group's kind is what its first event said: an event that says otherwise is
            // not from the same group (a broken publisher), and is skipped.
            Some((_, known)) if known.kind != spec.kind => return (Route::Skip, false),
            Some((_, known)) if known.block_units >= spec.block_units => false,
            Some((_, known)) => {
                known.block_units = spec.block_units;
                true
            }
            None => {
                let at = self.seen.partition_point(|(seen, _)| *seen < g);
                self.seen.insert(at, (g, spec));
                true
            }
        };
        (Route::Group(g), changed)
    }

    /// The groups shown so far, `(group_idx, spec)` in group order (a snapshot's).
    pub(super) fn seen(&self) -> &[(u32, GroupSpec)] {
        &self.seen
    }

    /// Groups restored from a snapshot (what [`EngineGroups::seen`] exported); a group
    /// index out of range is dropped.
    pub(super) fn restore(&mut self, groups: &[(u32, GroupSpec)]) {
        self.seen = groups
            .iter()
            .copied()
            .filter(|(g, s)| (*g as usize) < crate::hit::MAX_GROUPS && s.block_units > 0)
            .collect();
        self.seen.sort_by_key(|(g, _)| *g);
        self.seen.dedup_by_key(|(g, _)| *g);
    }

    /// Routes a `BlockRemoved` of `group_idx`.
    pub(super) fn removed(&self, group_idx: Option<i64>) -> Route {
        match group_of(group_idx) {
            Some(g) if !self.refused.contains(&g) => Route::Group(g),
            _ => Route::Skip,
        }
    }

    /// The layout to publish for scoring: [`EngineGroups::layout`], where a layout the rule
    /// cannot build (no set of groups vLLM publishes makes one) is not published and the
    /// engine is scored by the prefix walk.
    pub(super) fn published(&self, unit: u32) -> Option<EngineLayout> {
        self.layout(unit).ok().flatten()
    }

    /// The engine's layout, `None` when plain (or nothing is modelled).
    pub(super) fn layout(&self, unit: u32) -> Result<Option<EngineLayout>, LayoutError> {
        let plain = GroupSpec {
            kind: GroupKind::Full,
            block_units: 1,
        };
        match self.seen.as_slice() {
            [] => return Ok(None),
            [(0, spec)] if *spec == plain => return Ok(None),
            _ => {}
        }
        let layout = Layout::new(unit, self.seen.iter().map(|(_, s)| *s).collect())?;
        let walked = self
            .seen
            .iter()
            .position(|(_, s)| s.kind == GroupKind::Full)
            .filter(|&i| {
                let spec = self.seen[i].1;
                spec == plain && self.seen.iter().filter(|(_, s)| *s == spec).count() == 1
            })
            .map(|i| (i, self.seen[i].0));
        Ok(Some(EngineLayout {
            layout,
            group_ids: self.seen.iter().map(|(g, _)| *g).collect(),
            walked,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineHash;

    fn stored(group: Option<i64>, kind: Option<&str>, window: Option<i64>, bs: u32) -> BlockStored {
        BlockStored {
            block_hashes: vec![EngineHash::new(1)],
            block_size: bs,
            group_idx: group,
            kv_cache_spec_kind: kind.map(str::to_owned),
            kv_cache_spec_sliding_window: window,
            ..BlockStored::default()
        }
    }

    #[test]
    fn a_plain_engine_has_no_layout_and_a_hybrid_one_learns_its_groups_in_order() {
        let mut g = EngineGroups::default();
        assert_eq!(
            g.stored(&stored(None, None, None, 16), 16, ModelGroups::default()),
            (Route::Group(0), true)
        );
        assert_eq!(g.layout(16), Ok(None));
        let (route, changed) = g.stored(
            &stored(Some(1), Some("sliding_window"), Some(128), 16),
            16,
            ModelGroups::default(),
        );
        assert_eq!((route, changed), (Route::Group(1), true));
        let l = g.layout(16).expect("valid").expect("hybrid");
        assert_eq!(l.group_ids, vec![0, 1]);
        assert_eq!(l.walked, Some((0, 0)));
        assert_eq!(
            l.to_string(),
            "group 0: full attention, 1 unit; group 1: sliding window 128, 1 unit"
        );
        assert_eq!(
            l.layout.groups()[1].kind,
            GroupKind::SlidingWindow { window: 128 }
        );
        // A partial entry (one unit) does not narrow a wider group's block.
        let mut m = EngineGroups::default();
        m.stored(
            &stored(Some(1), Some("mamba"), None, 64),
            16,
            ModelGroups::default(),
        );
        assert!(
            !m.stored(
                &stored(Some(1), Some("mamba"), None, 16),
                16,
                ModelGroups::default()
            )
            .1
        );
        assert_eq!(m.seen[0].1.block_units, 4);
    }

    #[test]
    fn a_group_keeps_the_kind_its_first_event_named() {
        let mut g = EngineGroups::default();
        g.stored(
            &stored(Some(0), Some("sliding_window"), Some(128), 16),
            16,
            ModelGroups::default(),
        );
        let full = stored(Some(0), Some("full_attention"), None, 16);
        assert_eq!(
            g.stored(&full, 16, ModelGroups::default()),
            (Route::Skip, false)
        );
        assert_eq!(
            g.layout(16)
                .expect("valid")
                .expect("hybrid")
                .layout
                .groups()[0]
                .kind,
            GroupKind::SlidingWindow { window: 128 }
        );
    }

    #[test]
    fn unmodelled_groups_are_refused() {
        let mut g = EngineGroups::default();
        let chunked = stored(Some(1), Some("chunked_local_attention"), None, 16);
        assert_eq!(
            g.stored(&chunked, 16, ModelGroups::default()).0,
            Route::Skip
        );
        // With the model's chunk configured, it is modelled.
        let mut c = EngineGroups::default();
        assert_eq!(
            c.stored(
                &chunked,
                16,
                ModelGroups {
                    chunk: Some(256),
                    hybrid: false
                }
            )
            .0,
            Route::Group(1)
        );
        assert_eq!(c.seen()[0].1.kind, GroupKind::ChunkedLocal { chunk: 256 });
        assert_eq!(g.removed(Some(1)), Route::Skip);
        assert_eq!(g.removed(Some(0)), Route::Group(0));
        assert_eq!(g.removed(Some(-1)), Route::Skip);
        let swa = stored(Some(2), Some("sliding_window"), Some(64), 16);
        assert_eq!(
            g.stored(&swa, 16, ModelGroups::default()).0,
            Route::Group(2)
        );
        assert_eq!(g.refused.len(), 1);
        // A block that is not a whole number of units.
        // A hybrid model's engine that names no group (SGLang) is refused, removals too.
        let mut sglang = EngineGroups::default();
        let hybrid = ModelGroups {
            chunk: None,
            hybrid: true,
        };
        let plain = stored(None, None, None, 16);
        assert_eq!(sglang.stored(&plain, 16, hybrid), (Route::Skip, true));
        assert_eq!(sglang.stored(&plain, 16, hybrid), (Route::Skip, false));
        assert_eq!(sglang.removed(None), Route::Skip);
        // vLLM names its groups: indexed.
        let vllm = stored(Some(0), Some("full_attention"), None, 16);
        assert_eq!(
            EngineGroups::default().stored(&vllm, 16, hybrid).0,
            Route::Group(0)
        );
        let odd = stored(Some(3), Some("mamba"), None, 24);
        assert_eq!(g.stored(&odd, 16, ModelGroups::default()).0, Route::Skip);
    }
}
