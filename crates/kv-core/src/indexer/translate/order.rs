//! The order a translated engine's batch is applied in: a run with fewer hashes than blocks
//! goes right after the run of another group, later in the same batch, that names its hashes
//! with every block (vLLM caches a step's groups in group order, so a sliding-window or Mamba
//! group 0 publishes before the full-attention group whose run places its hashes: `place`).
//!
//! Invariants: a run moves only past events of other groups (no store or removal of its own
//! group, no clear, no unknown event between), so what it does to its own group's entries and
//! keys is unchanged; every other event keeps its place; nothing is dropped or repeated. The
//! order is computed only for batches holding such a run, in the model's reused scratch.

use crate::events::{BlockStored, KvEvent};

/// Whether `s` carries fewer hashes than the blocks its tokens cover (and at least one).
pub(super) fn is_sparse(s: &BlockStored) -> bool {
    let block = s.block_size as usize;
    block > 0 && !s.block_hashes.is_empty() && s.token_ids.len() / block > s.block_hashes.len()
}

/// Whether `s` names a hash for every block its tokens cover.
fn is_dense(s: &BlockStored) -> bool {
    let block = s.block_size as usize;
    block > 0 && !s.block_hashes.is_empty() && s.token_ids.len() / block == s.block_hashes.len()
}

fn group(g: Option<i64>) -> i64 {
    g.unwrap_or(0)
}

/// Fills `order` with the positions of `events` in the order to apply them, and returns
/// true, when a sparse run is to wait for a later run naming its hashes; false (and `order`
/// untouched) when the batch applies as it comes. `moves` is scratch.
pub(super) fn application_order(
    events: &[KvEvent],
    order: &mut Vec<usize>,
    moves: &mut Vec<(usize, usize)>,
) -> bool {
    moves.clear();
    for (i, event) in events.iter().enumerate() {
        if let KvEvent::BlockStored(s) = event {
            if is_sparse(s) {
                if let Some(j) = placing_run(events, i, s) {
                    moves.push((j, i));
                }
            }
        }
    }
    if moves.is_empty() {
        return false;
    }
    moves.sort_unstable();
    order.clear();
    let mut next = 0;
    for (i, _) in events.iter().enumerate() {
        if moves.iter().any(|&(_, moved)| moved == i) {
            continue;
        }
        order.push(i);
        while let Some(&(after, moved)) = moves.get(next).filter(|m| m.0 == i) {
            debug_assert_eq!(after, i);
            order.push(moved);
            next += 1;
        }
    }
    debug_assert_eq!(order.len(), events.len());
    true
}

/// The first event after `i` that is a dense run of another group naming one of `s`'s hashes,
/// if nothing in between touches `s`'s group.
fn placing_run(events: &[KvEvent], i: usize, s: &BlockStored) -> Option<usize> {
    let own = group(s.group_idx);
    for (j, event) in events.iter().enumerate().skip(i + 1) {
        match event {
            KvEvent::BlockStored(d) if group(d.group_idx) != own => {
                let names =
                    is_dense(d) && d.block_hashes.iter().any(|h| s.block_hashes.contains(h));
                if names {
                    return Some(j);
                }
            }
            KvEvent::BlockRemoved(r) if group(r.group_idx) != own => {}
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::BlockRemoved;
    use crate::EngineHash;

    fn stored(group: i64, hashes: &[u64], blocks: usize) -> KvEvent {
        KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::new(h)).collect(),
            token_ids: vec![7; blocks * 4],
            block_size: 4,
            group_idx: Some(group),
            ..Default::default()
        }))
    }

    fn removed(group: i64, hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.iter().map(|&h| EngineHash::new(h)).collect(),
            group_idx: Some(group),
            ..Default::default()
        })
    }

    fn order_of(events: &[KvEvent]) -> Option<Vec<usize>> {
        let mut order = Vec::new();
        application_order(events, &mut order, &mut Vec::new()).then_some(order)
    }

    #[test]
    fn a_sparse_run_waits_for_the_run_that_names_its_blocks() {
        // Sliding window (group 0) publishes blocks 3 and 4 of five, then full attention
        // (group 1) names all five; a removal of group 1 in between is passed.
        let events = [
            stored(0, &[13, 14], 5),
            removed(1, &[99]),
            stored(1, &[10, 11, 12, 13, 14], 5),
            stored(0, &[20], 1),
        ];
        assert_eq!(order_of(&events), Some(vec![1, 2, 0, 3]));
    }

    #[test]
    fn a_run_never_passes_an_event_of_its_own_group() {
        let events = [
            stored(0, &[13, 14], 5),
            removed(0, &[13]),
            stored(1, &[10, 11, 12, 13, 14], 5),
        ];
        assert_eq!(order_of(&events), None);
        let cleared = [
            stored(0, &[13], 5),
            KvEvent::AllBlocksCleared,
            stored(1, &[13; 5], 5),
        ];
        assert_eq!(order_of(&cleared), None);
    }

    #[test]
    fn a_batch_without_sparse_runs_or_their_names_keeps_its_order() {
        let dense = [stored(0, &[1, 2], 2), stored(1, &[1, 2], 2)];
        assert_eq!(order_of(&dense), None);
        // The later run names none of its hashes.
        let unrelated = [stored(0, &[13], 5), stored(1, &[1, 2, 3, 4, 5], 5)];
        assert_eq!(order_of(&unrelated), None);
    }
}
