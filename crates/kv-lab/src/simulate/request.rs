//! A request of a simulated workload: its prompt and output as chained block hashes.
//!
//! Invariants: `blocks` are the prompt's full blocks (`prompt_tokens / block` of them), chained
//! like vLLM's; the sequence's block `k` past the prompt's full blocks is `output_blocks[k -
//! blocks.len()]` while there are some, then a hash of the request's own (never shared).

use kv_core::{mix64, BlockHash};

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Arrival time, ms.
    pub arrival_ms: f64,
    /// Prompt block hashes (full blocks, chained like vLLM's).
    pub blocks: Vec<BlockHash>,
    /// The hashes of the blocks after the prompt's full blocks, which the output fills (the
    /// first holds the prompt's tail): chained on, so a later prompt that repeats this
    /// conversation hits them.
    pub output_blocks: Vec<BlockHash>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Output tokens (at least 1 is generated).
    pub output_tokens: u64,
}

impl SimRequest {
    /// The content hash of block `k` of the request's sequence (prompt, then output): what
    /// an engine keys that block by and publishes.
    pub fn block_hash(&self, k: usize) -> BlockHash {
        match self.blocks.get(k) {
            Some(&h) => h,
            None => match self.output_blocks.get(k - self.blocks.len()) {
                Some(&h) => h,
                None => BlockHash::new(mix64(self.arrival_ms.to_bits() ^ mix64(k as u64)) | 1),
            },
        }
    }
}
