//! Recorded routings at the facade: the gateway's choice of pod for a prompt becomes
//! speculative entries (see `speculation`) until the pod's events confirm them or they expire.

use std::sync::Arc;

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
        if let Some(engine) = directory.engine(pod, rank) {
            state.index.score_engines(
                &hashes,
                Some(std::slice::from_ref(&engine)),
                &self.settings.weights,
                &mut real,
            );
        }
        let real_blocks = real.iter().map(|e| e.matched_blocks).max().unwrap_or(0) as usize;
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
