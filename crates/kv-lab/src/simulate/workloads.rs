//! Workloads for the simulator: block-hash prompts with arrival times.
//!
//! Block hashes are chained like vLLM's: a block's hash depends on everything before it, so two
//! prompts share exactly their common leading blocks.

use kv_core::mix64 as mix;
use kv_core::BlockHash;

use super::{rng, SimRequest};
use crate::trace::MooncakeRequest;

/// Chained block hashes for a prompt made of `segments` (segment id, tokens), cut in `block`s.
fn chain(segments: &[(u64, u64)], block: u64) -> (Vec<BlockHash>, u64) {
    let total: u64 = segments.iter().map(|s| s.1).sum();
    let mut hashes = Vec::with_capacity((total / block) as usize);
    let mut h = 0x6b76_2d69_6e64_6578u64;
    let mut pos = 0u64;
    let mut seg = 0usize;
    let mut seg_start = 0u64;
    while pos + block <= total {
        // The content of block [pos, pos+block) is identified by the segments it overlaps.
        let mut content = 0u64;
        let end = pos + block;
        while seg < segments.len() && seg_start + segments[seg].1 <= pos {
            seg_start += segments[seg].1;
            seg += 1;
        }
        let (mut s, mut s_start) = (seg, seg_start);
        while s < segments.len() && s_start < end {
            content = mix(content ^ segments[s].0 ^ (pos.saturating_sub(s_start)) << 20);
            s_start += segments[s].1;
            s += 1;
        }
        h = mix(h ^ content);
        hashes.push(BlockHash::new(h | 1));
        pos += block;
    }
    (hashes, total)
}

/// A request whose prompt is `prompt` (segments) and whose output is the segment `output`:
/// the prompt's full blocks, then the blocks the output fills, chained on from the prompt.
fn request(arrival_ms: f64, prompt: &[(u64, u64)], output: (u64, u64), block: u64) -> SimRequest {
    let mut segments = prompt.to_vec();
    segments.push(output);
    let (mut blocks, _) = chain(&segments, block);
    let prompt_tokens: u64 = prompt.iter().map(|s| s.1).sum();
    let output_blocks = blocks.split_off(((prompt_tokens / block) as usize).min(blocks.len()));
    SimRequest {
        arrival_ms,
        blocks,
        output_blocks,
        prompt_tokens,
        output_tokens: output.1.max(1),
    }
}

/// How the shared-prefix generator picks prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampling {
    /// Every (group, prompt) once, in random order.
    EachOnce,
    /// Each arrival draws a group and one of its prompts at random (prompts repeat), for the
    /// workload's duration.
    Draw,
}

/// The shared-prefix generator: `groups` system prompts, `prompts_per_group` questions each,
/// Poisson arrivals at `rate_per_s` (in bursts of `burst` requests of one group when above 1).
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub groups: usize,
    /// Questions per system prompt.
    pub prompts_per_group: usize,
    /// System prompt tokens.
    pub system_tokens: u64,
    /// Question tokens.
    pub question_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Arrivals per second.
    pub rate_per_s: f64,
    /// How prompts are picked.
    pub sampling: Sampling,
    /// `Draw`: seconds of arrivals.
    pub duration_s: f64,
    /// Requests per arrival instant, all of one group (1: independent arrivals).
    pub burst: usize,
}

impl SharedPrefix {
    /// The published benchmark: 230 groups x 5 prompts, 8,000-token system prompts,
    /// 1,000-token questions, 1,000 output tokens (run on 8 pods).
    pub fn preset() -> Self {
        Self {
            groups: 230,
            prompts_per_group: 5,
            system_tokens: 8_000,
            question_tokens: 1_000,
            output_tokens: 1_000,
            rate_per_s: 4.0,
            sampling: Sampling::EachOnce,
            duration_s: 0.0,
            burst: 1,
        }
    }

    /// The published precise-vs-approximate benchmark's traffic (llm-d): 150 groups x 5
    /// users, 6,000-token system prompts, 1,200-token questions, 1,000 output tokens; each
    /// arrival draws a group and a user (prompts repeat), 60 s per rate.
    pub fn anchor() -> Self {
        Self {
            groups: 150,
            prompts_per_group: 5,
            system_tokens: 6_000,
            question_tokens: 1_200,
            output_tokens: 1_000,
            rate_per_s: 10.0,
            sampling: Sampling::Draw,
            duration_s: 60.0,
            burst: 1,
        }
    }

    /// The requests, for a block size and a seed.
    pub fn generate(&self, block: u64, seed: u64) -> Vec<SimRequest> {
        let mut rng = rng(seed);
        let picks: Vec<(usize, usize)> = match self.sampling {
            Sampling::EachOnce => {
                let mut order: Vec<(usize, usize)> = (0..self.groups)
                    .flat_map(|g| (0..self.prompts_per_group).map(move |q| (g, q)))
                    .collect();
                for i in (1..order.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    order.swap(i, j);
                }
                order
            }
            Sampling::Draw => Vec::new(),
        };
        let burst = self.burst.max(1);
        let mut out = Vec::new();
        let mut t = 0.0;
        let mut next = 0usize;
        loop {
            t += -(1.0 - rng.unit()).ln() / self.rate_per_s * 1000.0 * burst as f64;
            if self.sampling == Sampling::Draw && t > self.duration_s * 1000.0 {
                return out;
            }
            let group = rng.below(self.groups.max(1) as u64) as usize;
            for _ in 0..burst {
                let (g, q) = match self.sampling {
                    Sampling::EachOnce => match picks.get(next) {
                        Some(&(g, q)) if burst == 1 => (g, q),
                        Some(&(_, q)) => (group, q),
                        None => return out,
                    },
                    Sampling::Draw => (
                        if burst == 1 {
                            rng.below(self.groups.max(1) as u64) as usize
                        } else {
                            group
                        },
                        rng.below(self.prompts_per_group.max(1) as u64) as usize,
                    ),
                };
                let n = out.len() as u64;
                out.push(request(
                    t,
                    &[
                        (mix(g as u64 + 1), self.system_tokens),
                        (
                            mix(((g as u64) << 32) | (q as u64 + 1)),
                            self.question_tokens,
                        ),
                    ],
                    (mix(seed ^ mix(n ^ 0x6f75_7470_7574)), self.output_tokens),
                    block,
                ));
                next += 1;
            }
        }
    }
}

/// The multi-turn chat generator: `conversations` chats of `turns` turns; each turn appends the
/// previous answer and a new user message to the history.
#[derive(Debug, Clone, Copy)]
pub struct MultiTurn {
    /// Concurrent conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// System prompt tokens (shared by all).
    pub system_tokens: u64,
    /// User message tokens per turn.
    pub user_tokens: u64,
    /// Answer tokens per turn.
    pub output_tokens: u64,
    /// Seconds between a conversation's turns.
    pub think_time_s: f64,
}

impl MultiTurn {
    /// A default chat workload.
    pub fn preset() -> Self {
        Self {
            conversations: 200,
            turns: 6,
            system_tokens: 1_000,
            user_tokens: 300,
            output_tokens: 300,
            think_time_s: 20.0,
        }
    }

    /// The requests, for a block size and a seed.
    pub fn generate(&self, block: u64, seed: u64) -> Vec<SimRequest> {
        let mut rng = rng(seed);
        let mut out = Vec::new();
        for c in 0..self.conversations {
            let mut t = rng.unit() * self.think_time_s * 1000.0 * 2.0;
            let mut segments = vec![(mix(7), self.system_tokens)];
            for turn in 0..self.turns {
                segments.push((
                    mix(((c as u64) << 20) | (turn as u64 * 2 + 1)),
                    self.user_tokens,
                ));
                let answer = (
                    mix(((c as u64) << 20) | (turn as u64 * 2 + 2)),
                    self.output_tokens,
                );
                out.push(request(t, &segments, answer, block));
                segments.push(answer);
                t += (self.think_time_s * (0.5 + rng.unit())) * 1000.0;
            }
        }
        out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
        out
    }
}

/// A Mooncake trace with each 512-token trace block expanded to engine blocks.
pub fn mooncake(requests: &[MooncakeRequest], block: u64, time_scale: f64) -> Vec<SimRequest> {
    let sub = (512 / block).max(1);
    let mut out: Vec<SimRequest> = requests
        .iter()
        .map(|r| {
            let full = (r.input_length / block) as usize;
            let blocks: Vec<BlockHash> = r
                .hash_ids
                .iter()
                .flat_map(|&id| {
                    (0..sub)
                        .map(move |j| BlockHash::new(mix(id.wrapping_mul(sub) + j + 0x5EED) | 1))
                })
                .take(full)
                .collect();
            // The output's blocks: this request's own (the trace says nothing of them).
            let last = blocks.last().map_or(r.timestamp, |b| b.get());
            let output_blocks = (full as u64..(r.input_length + r.output_length).div_ceil(block))
                .map(|k| BlockHash::new(mix(last ^ mix(k ^ r.timestamp)) | 1))
                .collect();
            SimRequest {
                arrival_ms: r.timestamp as f64 * time_scale,
                blocks,
                output_blocks,
                prompt_tokens: r.input_length,
                output_tokens: r.output_length.max(1),
            }
        })
        .collect();
    // The simulation wants arrival order; a stable sort keeps the trace's order among ties.
    out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_exactly_their_leading_blocks() {
        let reqs = SharedPrefix {
            groups: 2,
            prompts_per_group: 2,
            system_tokens: 64,
            question_tokens: 32,
            output_tokens: 1,
            rate_per_s: 1.0,
            sampling: Sampling::EachOnce,
            duration_s: 0.0,
            burst: 1,
        }
        .generate(16, 1);
        assert_eq!(reqs.len(), 4);
        for a in &reqs {
            assert_eq!(a.blocks.len(), 6);
            for b in &reqs {
                let common = crate::simulate::common_prefix(&a.blocks, &b.blocks);
                assert!(common == 6 || common == 4 || common == 0, "{common}");
            }
        }
        assert!(reqs.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    }

    #[test]
    fn mooncake_blocks_expand_to_engine_blocks_and_keep_sharing() {
        let trace = [
            MooncakeRequest {
                timestamp: 30,
                input_length: 1_000,
                output_length: 5,
                hash_ids: vec![1, 2],
            },
            MooncakeRequest {
                timestamp: 10,
                input_length: 700,
                output_length: 5,
                hash_ids: vec![1, 3],
            },
        ];
        let reqs = mooncake(&trace, 16, 2.0);
        assert_eq!(reqs[0].arrival_ms, 20.0, "sorted by arrival, scaled");
        assert_eq!(reqs[0].blocks.len(), 700 / 16);
        assert_eq!(reqs[1].blocks.len(), 1_000 / 16);
        let common = crate::simulate::common_prefix(&reqs[0].blocks, &reqs[1].blocks);
        assert_eq!(
            common, 32,
            "trace block 1 is 32 engine blocks, then they diverge"
        );
        let distinct: std::collections::HashSet<BlockHash> =
            reqs[1].blocks.iter().copied().collect();
        assert_eq!(distinct.len(), reqs[1].blocks.len());
    }

    #[test]
    fn multi_turn_prompts_extend_their_history() {
        let reqs = MultiTurn {
            conversations: 1,
            turns: 3,
            system_tokens: 32,
            user_tokens: 16,
            output_tokens: 16,
            think_time_s: 1.0,
        }
        .generate(16, 1);
        assert_eq!(reqs.len(), 3);
        assert!(reqs[1].blocks.starts_with(&reqs[0].blocks));
        assert!(reqs[2].blocks.starts_with(&reqs[1].blocks));
        // The next turn repeats the answer: its blocks are the ones the answer filled.
        let answered: Vec<BlockHash> = reqs[0]
            .blocks
            .iter()
            .chain(&reqs[0].output_blocks)
            .copied()
            .collect();
        assert!(reqs[1]
            .blocks
            .starts_with(&answered[..reqs[1].blocks.len().min(4)]));
        assert_eq!(&reqs[1].blocks[3], &reqs[0].output_blocks[0]);
    }

    #[test]
    fn the_anchor_draws_repeated_prompts_for_its_duration_and_bursts_stay_in_one_group() {
        let w = SharedPrefix {
            rate_per_s: 20.0,
            duration_s: 10.0,
            ..SharedPrefix::anchor()
        };
        let reqs = w.generate(16, 3);
        assert!((150..250).contains(&reqs.len()), "{}", reqs.len());
        assert!(reqs.iter().all(|r| r.arrival_ms <= 10_000.0));
        assert_eq!(reqs[0].prompt_tokens, 7_200);
        assert_eq!(reqs[0].blocks.len(), 450);
        assert_eq!(
            reqs[0].output_blocks.len(),
            8_200 / 16 - 450,
            "full blocks only"
        );
        let bursty = SharedPrefix { burst: 5, ..w }.generate(16, 3);
        for chunk in bursty.chunks(5).filter(|c| c.len() == 5) {
            assert!(chunk.iter().all(|r| r.arrival_ms == chunk[0].arrival_ms));
            assert!(chunk
                .iter()
                .all(|r| r.blocks[..375] == chunk[0].blocks[..375]));
        }
    }
}
