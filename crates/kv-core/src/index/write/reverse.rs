//! Per-engine reverse lists: the node ids an engine was given memberships on, so clearing an
//! engine costs O(its blocks). Lazy: a list may hold stale or duplicate ids (checked against
//! the node when used) and is compacted when it grows past 1.25x the engine's live memberships.

use super::{NodeWriter, PREFETCH_AHEAD};
use crate::index::types::EngineId;

impl NodeWriter<'_> {
    pub(super) fn note_membership(&mut self, engine: EngineId, id: u32) {
        let Some(state) = self.engine_state(engine) else {
            return;
        };
        if state.blocks.len() == state.blocks.capacity() {
            // Full: compact if at least a fifth is stale, else grow by an eighth. Capacity stays
            // within ~1.25x the live memberships (a doubling Vec would reach 4x).
            let live = state.live as usize;
            if state.blocks.len() >= 1024 && state.blocks.len() > live + live / 4 {
                self.compact_reverse_list(engine);
            }
            if let Some(state) = self.engine_state(engine) {
                if state.blocks.len() == state.blocks.capacity() {
                    state
                        .blocks
                        .reserve_exact((state.blocks.len() / 8).max(256));
                }
            }
        }
        if let Some(state) = self.engine_state(engine) {
            state.blocks.push(id);
            state.live += 1;
        }
    }

    /// Drops stale and duplicate ids from an engine's reverse list: one pass, nodes prefetched,
    /// duplicates found with a bitset over node ids (no sort).
    pub(super) fn compact_reverse_list(&mut self, engine: EngineId) {
        let Some(state) = self.engine_state(engine) else {
            return;
        };
        let mut blocks = std::mem::take(&mut state.blocks);
        let mut seen = std::mem::take(&mut self.state.seen);
        seen.clear();
        seen.resize(self.state.next_node as usize / 64 + 1, 0);
        let slab = &self.index.slab;
        let mut kept = 0;
        for i in 0..blocks.len() {
            if let Some(&ahead) = blocks.get(i + PREFETCH_AHEAD) {
                slab.prefetch(ahead);
            }
            let id = blocks[i];
            let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
            if seen.get(word).is_none_or(|w| w & bit != 0) {
                continue;
            }
            if self.has_engine(id, engine) {
                seen[word] |= bit;
                blocks[kept] = id;
                kept += 1;
            }
        }
        blocks.truncate(kept);
        // Give back what compaction freed (the list regrows by an eighth when needed).
        if blocks.capacity() > kept + kept / 4 + 1024 {
            blocks.shrink_to(kept + kept / 8 + 256);
        }
        self.state.seen = seen;
        if let Some(state) = self.engine_state(engine) {
            state.blocks = blocks;
        }
    }
}
