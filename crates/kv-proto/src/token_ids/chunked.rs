//! A buffer cut into small chunks, for checking a decoder that reads each contiguous chunk of
//! its input apart (varints and keys then straddle chunk boundaries). Test code (feature
//! `testing`): kv-proto's tests and the `token_ids` fuzz target use it.

use prost::bytes::{Buf, Bytes};

/// A `Buf` over `bytes` that hands out at most `step` bytes per chunk.
pub struct Chunked {
    /// What is left to read.
    pub bytes: Bytes,
    /// The most bytes one chunk holds (at least 1).
    pub step: usize,
}

impl Buf for Chunked {
    fn remaining(&self) -> usize {
        self.bytes.len()
    }
    fn chunk(&self) -> &[u8] {
        &self.bytes[..self.step.min(self.bytes.len())]
    }
    fn advance(&mut self, n: usize) {
        self.bytes.advance(n);
    }
}
