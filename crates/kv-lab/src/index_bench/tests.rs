//! The index benchmark's unit tests: the simulated stream, and every backend's answers against the reference.

use super::*;

fn req(ids: &[u64], input: u64) -> MooncakeRequest {
    MooncakeRequest {
        timestamp: 0,
        input_length: input,
        output_length: 1,
        hash_ids: ids.to_vec(),
    }
}

#[test]
fn simulation_stores_missing_runs_and_evicts_lru() {
    let shape = WorkloadShape {
        trace_block_tokens: 32,
        engine_block_tokens: 16,
        pods: 1,
        pod_capacity_blocks: 6,
        shared_prefix_blocks: 0,
        ..Default::default()
    };
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
    let shape = WorkloadShape {
        trace_block_tokens: 32,
        engine_block_tokens: 16,
        pods: 3,
        pod_capacity_blocks: 10,
        shared_prefix_blocks: 0,
        ..Default::default()
    };
    for removals in [Removals::Batched, Removals::OnePerEvent, Removals::Shuffled] {
        let w = IndexWorkload::simulate(&reqs, WorkloadShape { removals, ..shape });
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
        trace_block_tokens: 32,
        engine_block_tokens: 16,
        pods: 100,
        pod_capacity_blocks: 1000,
        shared_prefix_blocks: 4,
        ..Default::default()
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
