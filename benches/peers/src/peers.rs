//! The peers as benchmark backends: SMG's `ChainIndex` and Dynamo's `RadixTree`, each driven
//! through its public write and read paths, its input converted into its own types by
//! `prepare` before any timer starts (as kv-indexer's rows read the workload's slices as they
//! are).

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::RadixTree;
use kv_core::BlockHash;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use kv_lab::index_bench::{Blocks, IndexBackend, IndexWorkload, QueryAnswer};

/// SMG's ChainIndex with one lane map per worker, driven through its allocation-free API, as
/// SMG's own replay drives it (`apply_stored` with the worker's `ChainBlockMap`, `score_into`
/// over content hashes).
pub struct Smg {
    index: ChainIndex,
    workers: Vec<u32>,
    /// SMG worker id -> pod number.
    pod_of: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    /// The workload's stored blocks in SMG's type, parallel to `IndexWorkload::stored`.
    blocks: Vec<StoredBlock>,
    /// The workload's removed hashes in SMG's type, parallel to `IndexWorkload::removed`.
    removed: Vec<SequenceHash>,
    /// Converts each call's input inside the timed call instead (what the harness did for SMG
    /// alone before 2026-11-27), to measure what that cost it.
    converting: bool,
    /// Calls SMG rejected (reported; 0 on every fleet so far).
    pub errors: usize,
}

impl Smg {
    /// An index sized for `pods` workers (SMG's default is 256; 1,024 is its most).
    pub fn new(pods: u32) -> Self {
        Self::with_conversion(pods, false)
    }

    /// [`Smg::new`]; `converting`: the input is converted inside each timed call.
    pub fn with_conversion(pods: u32, converting: bool) -> Self {
        let index = ChainIndex::with_max_workers(pods as usize);
        let workers: Vec<u32> = (0..pods)
            .map(|p| {
                index
                    .intern_worker(&format!("pod-{p}"))
                    .expect("room for workers")
            })
            .collect();
        let mut pod_of = vec![u32::MAX; workers.iter().max().map_or(0, |&w| w as usize + 1)];
        for (p, &w) in workers.iter().enumerate() {
            pod_of[w as usize] = p as u32;
        }
        Self {
            index,
            workers,
            pod_of,
            maps: (0..pods).map(|_| ChainBlockMap::new()).collect(),
            blocks: Vec::new(),
            removed: Vec::new(),
            converting,
            errors: 0,
        }
    }
}

impl IndexBackend for Smg {
    fn name(&self) -> &str {
        match self.converting {
            false => "SMG kv-index 2.0 ChainIndex",
            true => "SMG, input converted inside the timer (the earlier harness)",
        }
    }

    fn prepare(&mut self, w: &IndexWorkload) {
        if self.converting {
            return;
        }
        self.blocks = w
            .stored
            .iter()
            .zip(&w.stored_content)
            .map(|(&h, &c)| StoredBlock {
                seq_hash: SequenceHash(h.get()),
                content_hash: ContentHash(c),
            })
            .collect();
        self.removed = w.removed.iter().map(|&h| SequenceHash(h.get())).collect();
    }

    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer {
        let mut answer = QueryAnswer::default();
        let pod_of = &self.pod_of;
        self.index.score_into(
            prompt.content,
            |c| *c,
            false,
            |worker, score| {
                answer.add(
                    pod_of.get(worker as usize).copied().unwrap_or(u32::MAX),
                    score,
                )
            },
        );
        answer
    }

    fn store(&mut self, pod: u32, parent: Option<BlockHash>, blocks: Blocks<'_>) {
        let mut range = blocks.range();
        if self.converting {
            self.blocks.clear();
            self.blocks
                .extend(
                    blocks
                        .hashes
                        .iter()
                        .zip(blocks.content)
                        .map(|(&h, &c)| StoredBlock {
                            seq_hash: SequenceHash(h.get()),
                            content_hash: ContentHash(c),
                        }),
                );
            range = 0..self.blocks.len();
        }
        let map = &mut self.maps[pod as usize];
        if self
            .index
            .apply_stored(
                self.workers[pod as usize],
                &self.blocks[range],
                parent.map(|p| SequenceHash(p.get())),
                map,
            )
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn remove(&mut self, pod: u32, blocks: Blocks<'_>) {
        let mut range = blocks.range();
        if self.converting {
            self.removed.clear();
            self.removed
                .extend(blocks.hashes.iter().map(|&h| SequenceHash(h.get())));
            range = 0..self.removed.len();
        }
        self.index.apply_removed(
            self.workers[pod as usize],
            &self.removed[range],
            &mut self.maps[pod as usize],
        );
    }

    fn release_input(&mut self) {
        self.blocks = Vec::new();
        self.removed = Vec::new();
    }

    fn shape(&self) -> Option<String> {
        let s = self.index.stats();
        Some(format!(
            "{} runs live, {} blocks live; splits: {} branch, {} hole, {} mid-run store, {} prefix holders; {} runs died; {} calls rejected",
            s.runs_live,
            s.blocks_live,
            s.splits_by_branch,
            s.splits_by_hole,
            s.splits_by_mid_run_store,
            s.splits_by_prefix_holders,
            s.runs_died,
            self.errors
        ))
    }
}

/// Dynamo's RadixTree through its event API (its only public write path). The API takes each
/// event and each query by value, so `prepare` builds them all, in the order the driver calls.
pub struct Dynamo {
    tree: RadixTree,
    /// Events in call order (removals, then stores, per step), and the next one.
    events: std::vec::IntoIter<RouterEvent>,
    /// Queries in call order.
    queries: std::vec::IntoIter<Vec<LocalBlockHash>>,
    /// Calls Dynamo rejected.
    pub errors: usize,
}

impl Dynamo {
    /// An empty tree.
    pub fn new() -> Self {
        Self {
            tree: RadixTree::new(),
            events: Vec::new().into_iter(),
            queries: Vec::new().into_iter(),
            errors: 0,
        }
    }
}

impl IndexBackend for Dynamo {
    fn name(&self) -> &str {
        "Dynamo dynamo-kv-router 1.6 RadixTree"
    }

    fn prepare(&mut self, w: &IndexWorkload) {
        let mut events = Vec::new();
        let mut event_id = 0;
        let mut event = |pod: u32, data| {
            event_id += 1;
            let event = KvCacheEvent {
                event_id,
                data,
                dp_rank: 0,
            };
            RouterEvent::new(u64::from(pod), event)
        };
        for step in &w.steps {
            for call in w.removal_calls(step) {
                let block_hashes = w.removed[call]
                    .iter()
                    .map(|&h| ExternalSequenceBlockHash(h.get()))
                    .collect();
                let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes });
                events.push(event(step.pod, data));
            }
            for op in &step.stores {
                let blocks = w.stored[op.blocks.clone()]
                    .iter()
                    .zip(&w.stored_content[op.blocks.clone()])
                    .map(|(&h, &c)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h.get()),
                        tokens_hash: LocalBlockHash(c),
                        mm_extra_info: None,
                    })
                    .collect();
                let data = KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: op.parent.map(|p| ExternalSequenceBlockHash(p.get())),
                    start_position: None,
                    blocks,
                });
                events.push(event(step.pod, data));
            }
        }
        self.events = events.into_iter();
        self.queries = w
            .steps
            .iter()
            .map(|s| {
                w.query_content[s.query.clone()]
                    .iter()
                    .map(|&c| LocalBlockHash(c))
                    .collect()
            })
            .collect::<Vec<_>>()
            .into_iter();
    }

    fn query(&mut self, _prompt: Blocks<'_>) -> QueryAnswer {
        let mut answer = QueryAnswer::default();
        let Some(seq) = self.queries.next() else {
            self.errors += 1;
            return answer;
        };
        let scores = self.tree.find_matches(seq, false);
        for (worker, &score) in &scores.scores {
            answer.add(worker.worker_id as u32, score);
        }
        answer
    }

    fn store(&mut self, _pod: u32, _parent: Option<BlockHash>, _blocks: Blocks<'_>) {
        self.apply_next();
    }

    fn remove(&mut self, _pod: u32, _blocks: Blocks<'_>) {
        self.apply_next();
    }

    fn release_input(&mut self) {
        self.events = Vec::new().into_iter();
        self.queries = Vec::new().into_iter();
    }

    fn shape(&self) -> Option<String> {
        Some(format!("{} calls rejected", self.errors))
    }
}

impl Dynamo {
    /// Applies the next prepared event (the driver calls in the order `prepare` built them).
    fn apply_next(&mut self) {
        let applied = self
            .events
            .next()
            .is_some_and(|event| self.tree.apply_event(event).is_ok());
        if !applied {
            self.errors += 1;
        }
    }
}
