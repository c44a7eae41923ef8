//! vLLM-shaped payloads (map form, through kv-core's one encoder) for the events a simulated
//! pod emits. The simulated engines hash as the index does (aligned): they publish its keys.
//!
//! A plain pod's events name no group (as vLLM before 0.20, and as the published figures were
//! made); a hybrid pod's carry `group_idx`, `kv_cache_spec_kind`, the window and the group's
//! block size, as vLLM 0.22+ publishes them, and only the groups an index is fed
//! ([`IndexedGroups`]) are encoded.

use kv_core::{encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kv_core::{BlockHash, EngineHash, GroupKind, GroupSpec};

use super::family::{IndexedGroups, UNIT_TOKENS};
use super::hybrid::GroupRun;

fn batch(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(&EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    })
}

/// Evicted blocks (vLLM sends one `BlockRemoved` per evicted hash).
pub fn removed(hashes: &[BlockHash]) -> Vec<u8> {
    step(hashes, &[], 0)
}

/// One engine step's events: its evictions, then the blocks it filled.
pub fn step(
    removed: &[BlockHash],
    stored: &[(Option<BlockHash>, Vec<BlockHash>)],
    block_size: u64,
) -> Vec<u8> {
    let mut events: Vec<KvEvent> = removed
        .iter()
        .map(|&h| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::aligned(h)],
                medium: Some(Medium::Gpu),
                ..Default::default()
            })
        })
        .collect();
    events.extend(stored.iter().map(|(parent, hashes)| {
        KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::aligned(h)).collect(),
            parent_block_hash: parent.map(EngineHash::aligned),
            block_size: block_size as u32,
            medium: Some(Medium::Gpu),
            ..Default::default()
        }))
    }));
    batch(events)
}

/// A restarted engine's first batch: everything it held is gone.
pub fn cleared() -> Vec<u8> {
    batch(vec![KvEvent::AllBlocksCleared])
}

/// `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` of a group.
fn spec_fields(kind: GroupKind) -> (String, Option<i64>) {
    match kind {
        GroupKind::Full => ("full_attention".into(), None),
        GroupKind::SlidingWindow { window } => ("sliding_window".into(), Some(i64::from(window))),
        GroupKind::Mamba => ("mamba".into(), None),
        // The chunk is not in vLLM's events: the index takes it from the model's settings.
        GroupKind::ChunkedLocal { .. } => ("chunked_local_attention".into(), None),
    }
}

/// One step of a hybrid engine: its evictions, then the runs its groups cached, each event
/// tagged with its group; events of groups `indexed` leaves out are not encoded. `None` when
/// nothing is left to send.
pub fn hybrid_step(
    groups: &[GroupSpec],
    removed: &[(u32, BlockHash)],
    stored: &[GroupRun],
    indexed: IndexedGroups,
) -> Option<Vec<u8>> {
    let feeds = |g: u32| {
        groups
            .get(g as usize)
            .is_some_and(|spec| indexed.feeds(spec.kind))
    };
    let mut events: Vec<KvEvent> = removed
        .iter()
        .filter(|(g, _)| feeds(*g))
        .map(|&(g, h)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::aligned(h)],
                medium: Some(Medium::Gpu),
                group_idx: Some(i64::from(g)),
                ..Default::default()
            })
        })
        .collect();
    for run in stored.iter().filter(|r| feeds(r.group)) {
        let Some(spec) = groups.get(run.group as usize) else {
            continue;
        };
        let (kind, window) = spec_fields(spec.kind);
        events.push(KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: run.hashes.iter().map(|&h| EngineHash::aligned(h)).collect(),
            parent_block_hash: run.parent.map(EngineHash::aligned),
            block_size: spec.block_units * UNIT_TOKENS,
            medium: Some(Medium::Gpu),
            group_idx: Some(i64::from(run.group)),
            kv_cache_spec_kind: Some(kind),
            kv_cache_spec_sliding_window: window,
            ..Default::default()
        })));
    }
    (!events.is_empty()).then(|| batch(events))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::decode_batch;

    fn h(v: u64) -> BlockHash {
        BlockHash::new(v)
    }

    fn e(v: u64) -> EngineHash {
        EngineHash::new(v)
    }

    /// The simulated pods' payloads take the daemon's decode path and mean what they say.
    #[test]
    fn simulated_payloads_decode_as_vllm_events() {
        let stored =
            decode_batch(&step(&[], &[(Some(h(10)), vec![h(11), h(12)])], 16)).expect("stored");
        match stored.events.as_slice() {
            [KvEvent::BlockStored(s)] => {
                assert_eq!(s.block_hashes, vec![e(11), e(12)]);
                assert_eq!(s.parent_block_hash, Some(e(10)));
                assert_eq!(s.block_size, 16);
            }
            other => panic!("unexpected {other:?}"),
        }
        let removed = decode_batch(&removed(&[h(11), h(12)])).expect("removed");
        assert_eq!(
            removed.events.len(),
            2,
            "one BlockRemoved per hash, as vLLM sends"
        );
        assert!(
            matches!(&removed.events[1], KvEvent::BlockRemoved(r) if r.block_hashes == [e(12)])
        );
        let cleared = decode_batch(&cleared()).expect("cleared");
        assert!(matches!(
            cleared.events.as_slice(),
            [KvEvent::AllBlocksCleared]
        ));
    }

    /// A hybrid step's events carry their group; a full-attention-only feed drops the others.
    #[test]
    fn hybrid_payloads_carry_their_group_and_the_full_only_feed_drops_the_others() {
        let groups = [
            GroupSpec {
                kind: GroupKind::Full,
                block_units: 1,
            },
            GroupSpec {
                kind: GroupKind::SlidingWindow { window: 128 },
                block_units: 1,
            },
        ];
        let stored = [
            GroupRun {
                group: 0,
                parent: None,
                hashes: vec![h(1), h(2)],
            },
            GroupRun {
                group: 1,
                parent: Some(h(1)),
                hashes: vec![h(2)],
            },
        ];
        let removed = [(1, h(7))];
        let all = hybrid_step(&groups, &removed, &stored, IndexedGroups::All).expect("events");
        let all = decode_batch(&all).expect("decodes");
        assert_eq!(all.events.len(), 3);
        assert!(matches!(&all.events[0], KvEvent::BlockRemoved(r) if r.group_idx == Some(1)));
        match &all.events[2] {
            KvEvent::BlockStored(s) => {
                assert_eq!(s.group_idx, Some(1));
                assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
                assert_eq!(s.kv_cache_spec_sliding_window, Some(128));
                assert_eq!(s.parent_block_hash, Some(e(1)));
            }
            other => panic!("unexpected {other:?}"),
        }
        let full = hybrid_step(&groups, &removed, &stored, IndexedGroups::FullAttentionOnly)
            .expect("events");
        let full = decode_batch(&full).expect("decodes");
        assert_eq!(full.events.len(), 1, "only group 0's run");
        assert!(hybrid_step(&groups, &removed, &[], IndexedGroups::FullAttentionOnly).is_none());
    }
}
