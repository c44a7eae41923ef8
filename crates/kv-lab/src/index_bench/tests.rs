//! The index benchmark's unit tests: the simulated stream, and every backend's answers against the reference.

use super::*;
use crate::trace::MooncakeRequest;

fn req(ids: &[u64], input: u64) -> MooncakeRequest {
    MooncakeRequest {
        timestamp: 0,
        input_length: input,
        output_length: 1,
        hash_ids: ids.to_vec(),
    }
}

/// Trace blocks of 2 engine blocks (32 tokens, 16 per block), `pods` pods of `capacity` blocks.
fn small(pods: u32, capacity: usize) -> WorkloadShape {
    WorkloadShape {
        trace_block_tokens: 32,
        engine_block_tokens: 16,
        pods,
        pod_capacity_blocks: capacity,
        ..Default::default()
    }
}

#[test]
fn simulation_stores_missing_runs_and_evicts_lru() {
    let shape = small(1, 6);
    // 2 trace blocks = 4 engine blocks; the second request shares the first trace block.
    let w = IndexWorkload::simulate(&[req(&[0, 1], 64), req(&[0, 2], 60)], shape);
    assert_eq!(w.steps[0].stores.len(), 1);
    assert_eq!(w.steps[0].stores[0].parent, None);
    assert_eq!(w.steps[1].query.len(), 3, "60 tokens = 3 full blocks");
    let second = &w.steps[1].stores;
    assert_eq!(second.len(), 1);
    assert_eq!(
        second[0].parent,
        Some(w.queries[1]),
        "continues after the shared prefix"
    );
    assert_eq!(second[0].blocks.len(), 1);
    assert_eq!(w.steps[1].removed.len(), 0);
    assert_eq!(w.final_memberships, 5);
}

#[test]
fn the_reference_and_kv_indexer_agree_on_a_small_trace() {
    let reqs: Vec<_> = (0..200u64)
        .map(|i| req(&[0, 1 + i % 7, 100 + i], 96))
        .collect();
    let shape = small(3, 10);
    let orders = [
        (Removals::Batched, Eviction::TailFirst),
        (Removals::OnePerEvent, Eviction::TailFirst),
        (Removals::Shuffled, Eviction::TailFirst),
        (Removals::Batched, Eviction::HeadFirst),
    ];
    for (removals, eviction) in orders {
        let w = IndexWorkload::simulate(
            &reqs,
            WorkloadShape {
                removals,
                eviction,
                ..shape
            },
        );
        let a = drive(&w, &mut ReferenceBackend::default());
        let b = drive(&w, &mut KvIndexerBackend::new(3));
        let c = drive(&w, &mut IndexerFacadeBackend::new(3));
        let d = drive(&w, &mut RunIndexBackend::new());
        let lanes = kv_core::IndexConfig {
            max_keys: 1 << 20,
            writer_lanes: 2,
            ..Default::default()
        };
        let f = drive(&w, &mut KvIndexerBackend::with_config(3, lanes));
        assert!(a.checksum > 0);
        assert_eq!(f.mismatches(&a), 0, "two writer lanes, {removals:?}");
        assert_eq!(b.mismatches(&a), 0, "{removals:?}");
        assert_eq!(c.mismatches(&a), 0, "{removals:?}");
        assert_eq!(d.mismatches(&a), 0, "{removals:?}");
    }
}

#[test]
fn every_holder_of_a_shared_prefix_is_reported_and_a_bound_under_counts() {
    let reqs: Vec<_> = (0..300u64).map(|i| req(&[1000 + i], 32)).collect();
    let shape = WorkloadShape {
        shared_prefix_blocks: 4,
        ..small(100, 1000)
    };
    let w = IndexWorkload::simulate(&reqs, shape);
    let reference = drive(&w, &mut ReferenceBackend::default());
    let last = reference.answers.last().copied().unwrap_or_default();
    assert_eq!(last.holders, 100, "every pod holds the system prompt");
    let exact = drive(&w, &mut KvIndexerBackend::new(100));
    assert_eq!(exact.mismatches(&reference), 0);
    let bounded = drive(
        &w,
        &mut KvIndexerBackend::with_pod_cache_size(100, Some(10)),
    );
    assert!(
        bounded.short_answers(&reference) >= 200,
        "a bound of 10 must under-count once more than 10 pods hold the prefix"
    );
}

/// How many times, after a step, a pod held a prompt's block without the block before it:
/// the workload's events replayed into per-pod sets, every prompt checked after every step.
fn holes_seen(w: &IndexWorkload, pods: u32) -> usize {
    let mut held: Vec<std::collections::HashSet<BlockHash>> =
        (0..pods).map(|_| Default::default()).collect();
    let mut holes = 0;
    for step in &w.steps {
        let set = &mut held[step.pod as usize];
        for h in &w.removed[step.removed.clone()] {
            assert!(set.remove(h), "only held blocks are evicted");
        }
        for op in &step.stores {
            set.extend(w.stored[op.blocks.clone()].iter().copied());
        }
        for prompt in w.steps.iter().map(|s| &w.queries[s.query.clone()]) {
            holes += prompt
                .windows(2)
                .filter(|p| !set.contains(&p[0]) && set.contains(&p[1]))
                .count();
        }
    }
    holes
}

#[test]
fn tail_first_eviction_keeps_prefixes_and_head_first_leaves_holes() {
    // Ten distinct 4-block prompts on one pod of 6 blocks: every request evicts.
    let reqs: Vec<_> = (0..10u64).map(|i| req(&[10 * i, 10 * i + 1], 64)).collect();
    let shape = small(1, 6);
    let tail = IndexWorkload::simulate(&reqs, shape);
    // The second request needs 4 blocks: the first's last two go, tail first.
    let first = &tail.queries[tail.steps[0].query.clone()];
    assert_eq!(
        &tail.removed[tail.steps[1].removed.clone()],
        &[first[3], first[2]]
    );
    assert_eq!(holes_seen(&tail, 1), 0, "tail first: pods hold prefixes");
    // The negative control: head first, the same requests leave tails without their heads.
    let head = IndexWorkload::simulate(
        &reqs,
        WorkloadShape {
            eviction: Eviction::HeadFirst,
            ..shape
        },
    );
    assert_eq!(
        &head.removed[head.steps[1].removed.clone()],
        &[first[0], first[1]]
    );
    assert!(holes_seen(&head, 1) > 0, "head first must leave holes");
}

#[test]
fn a_request_never_evicts_the_blocks_it_hits() {
    // Both requests share their first trace block (2 engine blocks); the pod holds 4.
    let reqs = [req(&[0, 1], 64), req(&[0, 2], 64)];
    let shape = small(1, 4);
    let w = IndexWorkload::simulate(&reqs, shape);
    let second = &w.queries[w.steps[1].query.clone()];
    let evicted = &w.removed[w.steps[1].removed.clone()];
    assert_eq!(evicted.len(), 2, "room for the two new blocks");
    assert!(
        !evicted.contains(&second[0]) && !evicted.contains(&second[1]),
        "the shared prefix is in use"
    );
    assert_eq!(w.steps[1].stores[0].parent, Some(second[1]));
}

#[test]
fn loops_replay_the_trace_with_fresh_blocks() {
    let reqs = [req(&[0, 1], 64), req(&[0, 2], 64)];
    let shape = small(1, 100);
    let once = IndexWorkload::simulate(&reqs, shape);
    let twice = IndexWorkload::simulate(&reqs, WorkloadShape { loops: 2, ..shape });
    assert_eq!(twice.steps.len(), 4);
    assert_eq!(
        twice.stored.len(),
        2 * once.stored.len(),
        "nothing of pass 1 is reused"
    );
    assert_eq!(twice.final_memberships, 2 * once.final_memberships);
    assert_eq!(&twice.queries[..8], &once.queries[..]);
}

#[test]
fn a_saved_workload_reads_back_equal_and_a_damaged_one_is_refused() {
    let reqs: Vec<_> = (0..50u64)
        .map(|i| req(&[0, 1 + i % 5, 100 + i], 96))
        .collect();
    let shape = WorkloadShape {
        removals: Removals::OnePerEvent,
        ..small(3, 10)
    };
    let w = IndexWorkload::simulate(&reqs, shape);
    let dir = std::env::temp_dir().join(format!("kv-lab-workload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let path = dir.join("w.bin");
    w.save(&path).expect("saved");
    let back = IndexWorkload::load(&path).expect("read back");
    assert_eq!(format!("{w:?}"), format!("{back:?}"));
    let a = drive(&w, &mut ReferenceBackend::default());
    let b = drive(&back, &mut ReferenceBackend::default());
    assert_eq!(b.mismatches(&a), 0);
    // A range past its slab (the last store's end, the file's last word) is refused.
    let mut bytes = std::fs::read(&path).expect("the file");
    let n = bytes.len();
    bytes[n - 8..].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).expect("rewritten");
    assert!(IndexWorkload::load(&path).is_err());
    std::fs::remove_dir_all(&dir).expect("removed");
}
