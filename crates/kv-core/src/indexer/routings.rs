//! Recorded routings at the facade: the gateway's choice of pod for a prompt becomes
//! speculative entries (see `speculation`) until the pod's events confirm them or they expire.

use std::sync::Arc;

use super::layout_score::{recorded_hit_tokens, LayoutAsk, LayoutScratch};
use super::{Indexer, RoutingRecorded, ScoreError};
use crate::BlockHash;

impl Indexer {
    /// Records that the gateway routed a prompt (its block `hashes`) to `pod`, pinned to
    /// data-parallel rank `rank` (0 without data parallelism): until the pod's `BlockStored`
    /// confirms it, or it expires, that rank scores as holding those blocks (speculative
    /// entries; see [`SpeculationSettings`](crate::SpeculationSettings)). Returns what was
    /// recorded: the prompt's blocks after those the rank already holds for real, or why
    /// nothing was.
    pub fn record_routing(
        &self,
        model: &str,
        pod: &str,
        rank: u32,
        hashes: Arc<[BlockHash]>,
        now: std::time::Instant,
    ) -> Result<RoutingRecorded, ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let mut real = Vec::new();
        let directory = state.index.directory();
        let engine = directory.engine(pod, rank);
        let layouts = state.layouts.load();
        let layout = engine.and_then(|e| layouts.get(&e));
        if let Some(engine) = engine {
            let only = std::slice::from_ref(&engine);
            state
                .index
                .score_engines(&hashes, Some(only), &self.settings.weights, &mut real);
            if layout.is_some() {
                // The rank's real hit by its layout's rule, as scoring reads it.
                let ask = LayoutAsk {
                    state: &state,
                    layouts: &layouts,
                    hashes: &hashes,
                    max_tokens: None,
                    candidates: Some(only),
                    weights: &self.settings.weights,
                };
                ask.score(&mut real, &mut LayoutScratch::default());
            }
        }
        let real_blocks = real.iter().map(|e| e.matched_blocks).max().unwrap_or(0) as usize;
        if let Some(l) = layout {
            // What the rank will hit once it has run the prompt: whole scheduler blocks. A
            // record reaching no further than the real hit would change no score.
            let unit = state.processor.block_size().max(1) as u64;
            let all = hashes.len() as u64 * unit;
            let will_hit =
                (recorded_hit_tokens(&l.layout, hashes.len(), all, hashes.len()) / unit) as usize;
            if will_hit <= real_blocks {
                return Ok(RoutingRecorded::AlreadyHeld);
            }
        }
        let fallback = state.speculation_fallback(pod);
        Ok(state
            .speculation
            .record(pod, rank, hashes, real_blocks, fallback, now))
    }

    /// Ends the speculative records whose deadline passed (every model), re-deciding which
    /// pods are in fallback. Called periodically by the embedder. Returns records expired.
    pub fn expire_speculation(&self, now: std::time::Instant) -> u64 {
        self.models
            .load()
            .values()
            .map(|m| m.speculation.expire(now, |pod| m.speculation_fallback(pod)))
            .sum()
    }
}
