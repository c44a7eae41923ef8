//! The order of a score's pods: holders best first (ties by matched blocks, then by name),
//! then the others (in name order for "every pod", in the caller's order for a candidate
//! list). Scores read the directory through its dense view (`EngineDirectory::dense`), built
//! once per directory value: these tests register pods out of name order, reuse freed pod
//! indexes and score between changes, so a view that outlived its directory would misorder
//! them.

use kv_core::{
    BlockHash, BlockRemoved, BlockStored, EngineHash, EventBatch, IndexConfig, Indexer,
    IndexerSettings, KvEvent, ScoreResult, ALL_PODS,
};

const MODEL: &str = "m";

fn indexer(lanes: usize) -> Indexer {
    let settings = IndexerSettings {
        index: IndexConfig {
            writer_lanes: lanes,
            ..Default::default()
        },
        ..Default::default()
    };
    Indexer::new(settings).expect("valid settings")
}

fn hashes(n: u64) -> Vec<BlockHash> {
    (1..=n).map(|i| BlockHash::new(0x1000 + i)).collect()
}

/// What the pods (aligned engines) publish for the first `n` blocks.
fn published(n: u64) -> Vec<EngineHash> {
    hashes(n).into_iter().map(EngineHash::aligned).collect()
}

fn apply(ix: &Indexer, pod: &str, event: KvEvent) {
    let batch = EventBatch {
        ts: 0.0,
        events: vec![event],
        data_parallel_rank: None,
    };
    ix.apply_batch(MODEL, pod, &batch).expect("applied");
}

/// `pod` stores the first `n` blocks of the prompt.
fn store(ix: &Indexer, pod: &str, n: u64) {
    let stored = BlockStored {
        block_hashes: published(n),
        parent_block_hash: None,
        block_size: 16,
        ..Default::default()
    };
    apply(ix, pod, KvEvent::BlockStored(Box::new(stored)));
}

/// `pod` drops every block of the prompt (it stays registered, holding nothing).
fn drop_all(ix: &Indexer, pod: &str) {
    let removed = BlockRemoved {
        block_hashes: published(8),
        ..Default::default()
    };
    apply(ix, pod, KvEvent::BlockRemoved(removed));
}

/// The pods a score of the whole prompt lists, in order, with their matched blocks.
fn scored(ix: &Indexer, pods: &[&str]) -> Vec<(String, u32)> {
    let mut result = ScoreResult::default();
    ix.score_hashes_into(MODEL, &hashes(8), pods, &mut result)
        .expect("known model");
    result
        .named()
        .map(|(name, s)| (name.to_owned(), s.matched_blocks))
        .collect()
}

fn pairs(want: &[(&str, u32)]) -> Vec<(String, u32)> {
    want.iter().map(|&(n, m)| (n.to_owned(), m)).collect()
}

#[test]
fn every_pod_lists_holders_best_first_ties_by_name_then_the_rest_in_name_order() {
    for lanes in [1, 3] {
        let ix = indexer(lanes);
        // Registered out of name order, so pod indexes do not follow names.
        for (pod, n) in [
            ("pod-d", 2),
            ("pod-b", 4),
            ("pod-e", 0),
            ("pod-a", 2),
            ("pod-c", 4),
        ] {
            store(&ix, pod, n.max(1));
            if n == 0 {
                drop_all(&ix, pod);
            }
        }
        let want = [
            ("pod-b", 4),
            ("pod-c", 4),
            ("pod-a", 2),
            ("pod-d", 2),
            ("pod-e", 0),
        ];
        assert_eq!(scored(&ix, ALL_PODS), pairs(&want), "{lanes} lanes");

        // pod-b leaves (its index is freed), pod-0 and pod-bb arrive (one reuses it): the next
        // score reads a new directory, in the new name order.
        assert!(ix.remove_pod(MODEL, "pod-b") > 0);
        store(&ix, "pod-bb", 4);
        store(&ix, "pod-0", 2);
        let want = [
            ("pod-bb", 4),
            ("pod-c", 4),
            ("pod-0", 2),
            ("pod-a", 2),
            ("pod-d", 2),
            ("pod-e", 0),
        ];
        assert_eq!(
            scored(&ix, ALL_PODS),
            pairs(&want),
            "{lanes} lanes, after churn"
        );
    }
}

#[test]
fn candidates_list_holders_best_first_then_the_rest_in_the_callers_order_each_once() {
    for lanes in [1, 3] {
        let ix = indexer(lanes);
        for (pod, n) in [("pod-z", 3), ("pod-y", 1), ("pod-x", 3), ("pod-w", 1)] {
            store(&ix, pod, n);
        }
        drop_all(&ix, "pod-w");
        let candidates = [
            "pod-w",
            "pod-y",
            "unknown-2",
            "pod-z",
            "pod-x",
            "pod-y",
            "unknown-1",
        ];
        let want = [
            ("pod-x", 3),
            ("pod-z", 3),
            ("pod-y", 1),
            ("pod-w", 0),
            ("unknown-2", 0),
            ("unknown-1", 0),
        ];
        assert_eq!(scored(&ix, &candidates), pairs(&want), "{lanes} lanes");
    }
}
