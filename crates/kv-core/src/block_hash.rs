//! [`BlockHash`]: the key everything in kv-indexer agrees on.

use std::fmt;

/// A KV-cache block's hash as vLLM publishes it in events and the index keys it: the last 8
/// bytes, big-endian, of the block's `sha256_cbor` digest (which commits to the whole prefix
/// before the block, so equal hashes mean equal prefixes).
///
/// A newtype, not a bare `u64`, so a token id, an engine id or a count can never be passed
/// where a hash is meant; `repr(transparent)` keeps slices of it as cheap as slices of `u64`.
/// Serialised as the bare integer, as vLLM writes it.
#[repr(transparent)]
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockHash(u64);

impl BlockHash {
    /// The hash with this event value.
    #[inline(always)]
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The event value.
    #[inline(always)]
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for BlockHash {
    fn from(value: u64) -> Self {
        Self(value)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:#018x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    /// As vLLM logs the int form: decimal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
