//! The plain engine: one full-attention group of `block_size`-token blocks, keyed by their
//! hash, on the scheduler every simulated engine shares (`super::scheduler`: continuous
//! batching, chunked prefill, preemption, step time). The code the published figures of
//! docs/simulation.md come from.
//!
//! - **A paged KV cache with prefix caching**: a sequence holds one block per `block_size`
//!   tokens of its prompt *and* of its generated tokens. A block joins the prefix cache once its
//!   tokens are computed (published as `BlockStored`); a finished or preempted sequence releases
//!   its blocks tail first, and cached blocks stay resident, free, until evicted (least recently
//!   freed first, published as `BlockRemoved`). An admitted request's leading cached blocks are
//!   hits (at most its known tokens minus one: the last token is always computed).
//!
//! Invariants (tested here and in `tests/simulate.rs`): those of the scheduler; a sequence's
//! blocks are its sequence's blocks `0..n` in order, each pinned once.

use kv_core::BlockHash;

use super::cache::KvCache;
use super::request::SimRequest;
use super::scheduler::{Blocks, Scheduler, StepOutput};

pub use super::scheduler::{EngineConfig, EngineStats, Scheduled};

/// One plain engine.
pub type Engine = Scheduler<PlainBlocks>;

/// What one step of a plain engine produced: runs of blocks (with their parent) and evicted
/// blocks.
pub type StepEnd = StepOutput<(Option<BlockHash>, Vec<BlockHash>), BlockHash>;

/// One full-attention group of `block_size`-token blocks.
#[derive(Debug, Clone, Copy)]
pub struct PlainBlocks {
    block_size: u64,
}

/// The content hash of block `k` of `req`'s sequence (prompt, then output).
fn block_hash(req: &SimRequest, k: usize) -> BlockHash {
    req.block_hash(k)
}

impl Blocks for PlainBlocks {
    type Key = BlockHash;
    type Held = Vec<BlockHash>;
    type Run = (Option<BlockHash>, Vec<BlockHash>);

    fn empty(&self) -> Vec<BlockHash> {
        Vec::new()
    }

    fn blocks_for(&self, tokens: u64) -> usize {
        tokens.div_ceil(self.block_size) as usize
    }

    fn grow(
        &self,
        cache: &mut KvCache<BlockHash>,
        evicted: &mut Vec<BlockHash>,
        req: &SimRequest,
        _computed: u64,
        held: &mut Vec<BlockHash>,
        tokens: u64,
    ) -> bool {
        let needed = tokens.div_ceil(self.block_size) as usize;
        while held.len() < needed {
            match cache.allocate(block_hash(req, held.len()), evicted) {
                Some(id) => held.push(id),
                None => return false,
            }
        }
        true
    }

    fn release(cache: &mut KvCache<BlockHash>, held: &mut Vec<BlockHash>) {
        for &id in held.iter().rev() {
            cache.release(id);
        }
        held.clear();
    }

    fn admit(
        &self,
        cache: &mut KvCache<BlockHash>,
        req: &SimRequest,
        held: &mut Vec<BlockHash>,
        known: u64,
    ) -> u64 {
        let bs = self.block_size;
        let max_hits = ((known - 1) / bs) as usize;
        let mut hits = 0;
        while hits < max_hits {
            let h = block_hash(req, hits);
            if !cache.is_hit(h) {
                break;
            }
            cache.pin(h);
            held.push(h);
            hits += 1;
        }
        hits as u64 * bs
    }

    fn stored(
        &self,
        cache: &mut KvCache<BlockHash>,
        req: &SimRequest,
        held: &Vec<BlockHash>,
        (before, after): (u64, u64),
        out: &mut Vec<Self::Run>,
    ) {
        let bs = self.block_size;
        let mut run: Vec<BlockHash> = Vec::new();
        let mut parent = None;
        let (first, full) = ((before / bs) as usize, (after / bs) as usize);
        for (k, &id) in held.iter().enumerate().take(full).skip(first) {
            if cache.computed(id) {
                if run.is_empty() {
                    parent = k.checked_sub(1).map(|j| block_hash(req, j));
                }
                run.push(block_hash(req, k));
            } else if !run.is_empty() {
                out.push((parent, std::mem::take(&mut run)));
            }
        }
        if !run.is_empty() {
            out.push((parent, run));
        }
    }

    fn held_count(held: &Vec<BlockHash>) -> u64 {
        held.len() as u64
    }
}

impl Engine {
    /// An idle engine with `capacity_blocks` KV blocks.
    pub fn new(config: EngineConfig, capacity_blocks: usize) -> Self {
        let blocks = PlainBlocks {
            block_size: config.block_size,
        };
        Self::with_blocks(config, blocks, capacity_blocks)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u64 {
        self.config.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::mix64;

    fn request(prompt: u64, output: u64, salt: u64) -> SimRequest {
        let blocks = (0..prompt / 16)
            .map(|k| BlockHash::new(mix64(salt ^ mix64(k)) | 1))
            .collect();
        let output_blocks = (prompt / 16..(prompt + output).div_ceil(16))
            .map(|k| BlockHash::new(mix64(salt ^ 0xabc ^ mix64(k)) | 1))
            .collect();
        SimRequest {
            arrival_ms: salt as f64,
            blocks,
            output_blocks,
            prompt_tokens: prompt,
            output_tokens: output,
        }
    }

    /// Runs every request to the end; returns each request's finish count.
    fn drain(engine: &mut Engine, requests: &[SimRequest]) -> Vec<u32> {
        let mut finished = vec![0u32; requests.len()];
        let mut first = vec![0u32; requests.len()];
        while let Some(step) = engine.schedule(requests) {
            let c = engine.config;
            assert!(step.tokens <= c.max_num_batched_tokens, "token budget");
            assert!(step.seqs <= c.max_num_seqs, "sequence limit");
            assert!(
                engine.resident_blocks() <= engine.capacity_blocks(),
                "capacity"
            );
            let end = engine.complete(requests);
            for r in end.first_tokens {
                first[r] += 1;
            }
            for r in end.finished {
                finished[r] += 1;
            }
            let (pins, held) = engine.pin_balance();
            assert_eq!(pins, held, "every pin is a block some sequence holds");
        }
        assert!(first.iter().all(|&n| n == 1), "one first token each");
        finished
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_within_the_budget() {
        let config = EngineConfig {
            max_num_batched_tokens: 512,
            ..Default::default()
        };
        let mut e = Engine::new(config, 1_000);
        let requests = vec![request(2_000, 3, 1)];
        e.add(0);
        let mut steps = Vec::new();
        while let Some(s) = e.schedule(&requests) {
            steps.push(s.tokens);
            e.complete(&requests);
        }
        // 2,000 prompt tokens in chunks of 512 (the 4th chunk samples the first token), then
        // two decode steps.
        assert_eq!(steps, [512, 512, 512, 464, 1, 1]);
        assert_eq!(e.pin_balance(), (0, 0));
        assert_eq!(
            e.resident_blocks(),
            125,
            "prompt and output blocks stay cached"
        );
    }

    #[test]
    fn a_repeated_prompt_hits_its_cached_blocks_but_computes_the_last_token() {
        let mut e = Engine::new(EngineConfig::default(), 1_000);
        let r = request(320, 4, 7);
        let requests = vec![r.clone(), r];
        e.add(0);
        drain(&mut e, &requests[..1]);
        e.add(1);
        let s = e.schedule(&requests).expect("work");
        // 20 blocks cached; the last is recomputed (at most known - 1 tokens are hits).
        assert_eq!(s.admitted, [(1, 304)]);
        assert_eq!(s.tokens, 16);
    }

    #[test]
    fn generated_blocks_are_cached_and_hit_by_the_next_turn() {
        let mut e = Engine::new(EngineConfig::default(), 1_000);
        let first = request(64, 40, 3);
        // The next turn's prompt: the first turn's prompt and answer (6 full blocks), then
        // 16 new tokens.
        let mut blocks = first.blocks.clone();
        blocks.extend(first.output_blocks.iter().take(2).copied());
        blocks.push(BlockHash::new(99));
        let second = SimRequest {
            arrival_ms: 1.0,
            blocks,
            output_blocks: Vec::new(),
            prompt_tokens: 112,
            output_tokens: 1,
        };
        let requests = vec![first, second];
        e.add(0);
        let mut stored = 0;
        while e.schedule(&requests[..1]).is_some() {
            stored += e
                .complete(&requests[..1])
                .stored
                .iter()
                .map(|r| r.1.len())
                .sum::<usize>();
        }
        assert_eq!(stored, 6, "4 prompt blocks, then 2 filled while decoding");
        e.add(1);
        let s = e.schedule(&requests).expect("work");
        assert_eq!(s.admitted, [(1, 96)], "the answer's blocks hit too");
    }

    #[test]
    fn a_full_cache_preempts_the_newest_sequence_and_everything_still_finishes_once() {
        // 40 blocks; a request is admitted with 7 (100 prompt tokens) and grows to 10 while
        // decoding (60 more): five are admitted, then they outgrow the cache.
        let config = EngineConfig {
            max_num_batched_tokens: 2_048,
            ..Default::default()
        };
        let mut e = Engine::new(config, 40);
        let requests: Vec<SimRequest> = (0..12).map(|i| request(100, 60, 100 + i)).collect();
        for (i, r) in requests.iter().enumerate() {
            assert!(e.fits(r));
            e.add(i);
        }
        let finished = drain(&mut e, &requests);
        assert!(finished.iter().all(|&n| n == 1), "{finished:?}");
        assert!(
            e.stats.preemptions > 0,
            "the cache was too small for them all"
        );
        assert_eq!(e.pin_balance(), (0, 0));
    }

    #[test]
    fn many_small_requests_respect_the_sequence_limit() {
        let config = EngineConfig {
            max_num_seqs: 4,
            ..Default::default()
        };
        let mut e = Engine::new(config, 10_000);
        let requests: Vec<SimRequest> = (0..20).map(|i| request(32, 5, 500 + i)).collect();
        for i in 0..requests.len() {
            e.add(i);
        }
        drain(&mut e, &requests);
        assert_eq!(e.stats.max_step_seqs, 4);
    }
}
