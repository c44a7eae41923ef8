//! Scores of engines that are not plain (a hybrid model's groups, engine blocks of several
//! keys): the hit vLLM takes ([`crate::Layout::hit_tokens`]) replaces the prefix walk's
//! answer for them.
//!
//! How the rule's questions are answered, cheapest first:
//! - the walked full-attention group's prefix from one walk over all engines (group 0's is the
//!   plain walk the other engines had; another group's walks the prompt's keys in its key
//!   space), never a lookup per block per engine;
//! - any other block from a span of the group's keys read together ([`ModelIndex::holds_each`]:
//!   consecutive blocks are found from each other, about one table probe per span), kept
//!   while the rule asks inside it (a sliding window asks its blocks right to left).
//!
//! Invariants: the answers are the index's (any tier), as a lookup per block would give them;
//! the hit never exceeds `max_tokens`; an engine's score is its matched blocks at GPU weight
//! (the tiers of a hybrid engine's blocks are not weighed apart); once a thread has seen its
//! largest prompt and engine id, a call allocates nothing.

use super::groups::{EngineLayout, Layouts};
use super::ModelState;
use crate::index::{EngineId, EngineScore, ModelIndex, Tier, TierWeights};
use crate::marks::RoundMarks;
use crate::BlockHash;

/// Keys of one group read together when the rule asks for a block outside the current span
/// (a window of 128 tokens at blocks of 16 asks 8); each further span of the same engine and
/// group is twice as long, to [`MAX_SPAN`].
const SPAN: usize = 8;
const MAX_SPAN: usize = 64;

/// A score's request, as far as layouts go.
pub(super) struct LayoutAsk<'a> {
    pub state: &'a ModelState,
    pub layouts: &'a Layouts,
    /// The prompt's keys (group 0's key space).
    pub hashes: &'a [BlockHash],
    /// vLLM's cap (`num_tokens - 1`); `None`: the prompt's tokens are unknown (hash form).
    pub max_tokens: Option<u64>,
    /// The candidates' engines (`None`: every engine).
    pub candidates: Option<&'a [EngineId]>,
    pub weights: &'a TierWeights,
}

/// Per-thread working memory of [`LayoutAsk::score`].
#[derive(Default)]
pub(super) struct LayoutScratch {
    /// The candidates, marked.
    candidates: RoundMarks,
    /// Engines whose walked group's prefix is known in this call...
    walked: RoundMarks,
    /// ...and its length, by engine id.
    walked_len: Vec<u32>,
    /// Groups other than 0 walked in this call.
    walk_groups: Vec<u32>,
    /// The prompt's keys in one group's key space.
    mapped: Vec<BlockHash>,
    /// One group walk's per-engine result.
    group_walk: Vec<EngineScore>,
    /// The span of keys last read.
    span: Span,
}

/// Which of a span of one group's keys an engine holds.
#[derive(Default)]
struct Span {
    /// (engine, group_idx) the span belongs to, and its first unit.
    owner: Option<(EngineId, u32)>,
    start: usize,
    keys: Vec<BlockHash>,
    held: Vec<bool>,
    /// The unit asked last (a rule that climbs reads its spans upwards).
    last: usize,
    /// The length of the next span.
    len: usize,
}

impl Span {
    /// Whether `engine` holds unit `u` of the prompt in group `group`.
    fn held(
        &mut self,
        index: &ModelIndex,
        hashes: &[BlockHash],
        (engine, group): (EngineId, u32),
        u: usize,
    ) -> bool {
        let inside = u >= self.start && u < self.start + self.held.len();
        if self.owner != Some((engine, group)) || !inside {
            let same = self.owner == Some((engine, group));
            self.len = if same {
                (self.len * 2).min(MAX_SPAN)
            } else {
                SPAN
            };
            let (from, to) = if same && u == self.last + 1 {
                (u, (u + self.len).min(hashes.len()))
            } else {
                (u + 1 - (u + 1).min(self.len), u + 1)
            };
            self.keys.clear();
            self.keys
                .extend(hashes[from..to].iter().map(|h| h.in_group(group)));
            index.holds_each(&self.keys, engine, &mut self.held);
            self.owner = Some((engine, group));
            self.start = from;
        }
        self.last = u;
        self.held[u - self.start]
    }
}

impl LayoutAsk<'_> {
    /// Replaces the entries of engines with a layout in `engines` (the plain walk's result)
    /// with their hits, and adds those that hit and were not there.
    pub(super) fn score(&self, engines: &mut Vec<EngineScore>, s: &mut LayoutScratch) {
        let index = self.state.index();
        let unit = u64::from(self.state.processor().block_size() as u32);
        let max_tokens = self.max_tokens.unwrap_or(self.hashes.len() as u64 * unit);
        let walked = self.hashes.len().min((max_tokens / unit) as usize);
        // The walked groups' prefixes: group 0's from the plain walk...
        s.walked.next_round();
        for e in engines.iter() {
            if let Some(&(_, 0)) = self.layouts.get(&e.engine).and_then(|l| l.walked.as_ref()) {
                s.walked.mark(e.engine as usize);
                set_len(&mut s.walked_len, e.engine, e.matched_blocks);
            }
        }
        // ...the others' from one walk per group over its key space.
        s.walk_groups.clear();
        for l in self.layouts.values() {
            if let Some((_, g)) = l.walked {
                if g != 0 && !s.walk_groups.contains(&g) {
                    s.walk_groups.push(g);
                }
            }
        }
        for &g in &s.walk_groups {
            s.mapped.clear();
            s.mapped
                .extend(self.hashes[..walked].iter().map(|h| h.in_group(g)));
            index.score_engines(&s.mapped, self.candidates, self.weights, &mut s.group_walk);
            for e in &s.group_walk {
                let layout = self.layouts.get(&e.engine);
                if layout.and_then(|l| l.walked).map(|w| w.1) == Some(g) {
                    s.walked.mark(e.engine as usize);
                    set_len(&mut s.walked_len, e.engine, e.matched_blocks);
                }
            }
        }
        engines.retain(|e| !self.layouts.contains_key(&e.engine));
        if let Some(candidates) = self.candidates {
            s.candidates.next_round();
            for &c in candidates {
                s.candidates.mark(c as usize);
            }
        }
        s.span.owner = None;
        let weight = self.weights.of(Tier::Gpu);
        for (&engine, l) in self.layouts.iter() {
            if self.candidates.is_some() && !s.candidates.is_marked(engine as usize) {
                continue;
            }
            let prefix = if s.walked.is_marked(engine as usize) {
                s.walked_len[engine as usize] as usize
            } else if l.walked.is_some() {
                // Its full-attention group holds none of the prompt: no hit, nothing to ask.
                continue;
            } else {
                0
            };
            let matched = (self.hit(engine, l, prefix, max_tokens, &mut s.span) / unit) as u32;
            if matched > 0 {
                engines.push(EngineScore {
                    engine,
                    matched_blocks: matched,
                    score: f64::from(matched) * weight,
                });
            }
        }
    }

    /// `engine`'s hit in tokens, its walked group holding `prefix` blocks.
    fn hit(
        &self,
        engine: EngineId,
        l: &EngineLayout,
        prefix: usize,
        max_tokens: u64,
        span: &mut Span,
    ) -> u64 {
        let index = self.state.index();
        let known = l.walked.map(|(g, _)| (g, prefix as u64));
        l.layout
            .hit_tokens_known(self.hashes.len(), max_tokens, known, |g, u| {
                match l.walked {
                    Some((walked_group, _)) if walked_group == g => u < prefix,
                    _ => span.held(index, self.hashes, (engine, l.group_ids[g]), u),
                }
            })
    }
}

/// The tokens an engine with `layout` will reuse of a prompt of `units` units (at most
/// `max_tokens`) once it has run a recorded prompt sharing its first `recorded` units: every
/// group holds the recorded prefix's whole blocks, as vLLM caches them. Partial entries (a
/// Mamba group's state inside a block, under `--prefix-match-unit`) are not counted: only the
/// recorded prompt's last unit would have one, and which shared prefix ends there is not known
/// here, so the credit errs below the hit vLLM takes, never above it.
pub(super) fn recorded_hit_tokens(
    layout: &crate::Layout,
    units: usize,
    max_tokens: u64,
    recorded: usize,
) -> u64 {
    let groups = layout.groups();
    layout.hit_tokens(units, max_tokens, |g, u| {
        u < recorded && (u + 1) % groups[g].block_units.max(1) as usize == 0
    })
}

/// Sets `lens[engine]`, growing `lens` to the largest engine id seen (once per thread).
fn set_len(lens: &mut Vec<u32>, engine: EngineId, len: u32) {
    let i = engine as usize;
    if lens.len() <= i {
        lens.resize(i + 1, 0);
    }
    lens[i] = len;
}

#[cfg(test)]
mod tests {
    use super::recorded_hit_tokens;
    use crate::{GroupKind, GroupSpec, Layout};

    #[test]
    fn a_recorded_prefix_counts_in_whole_blocks_even_where_partial_hits_are_on() {
        let spec = |kind, block_units| GroupSpec { kind, block_units };
        // Full attention and Mamba of 4 units: vLLM allows partial (unit) hits here.
        let layout = Layout::new(
            16,
            vec![spec(GroupKind::Full, 4), spec(GroupKind::Mamba, 4)],
        )
        .expect("valid");
        assert!(layout.fine_grained());
        // Ten units recorded: the states at units 4 and 8 are vLLM's; a partial one at 10
        // only if the recorded prompt ended there, which is not known.
        assert_eq!(recorded_hit_tokens(&layout, 12, 12 * 16, 10), 8 * 16);
        assert_eq!(recorded_hit_tokens(&layout, 12, 12 * 16, 3), 0);
        // Capped like any hit.
        assert_eq!(recorded_hit_tokens(&layout, 12, 7 * 16, 12), 4 * 16);
        // Plain blocks of one unit: the recorded prefix itself.
        let plain = Layout::new(16, vec![spec(GroupKind::Full, 1), spec(GroupKind::Full, 1)])
            .expect("valid");
        assert_eq!(recorded_hit_tokens(&plain, 12, 12 * 16, 10), 10 * 16);
    }
}
