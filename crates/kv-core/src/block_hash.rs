//! [`BlockHash`], the key everything in the index agrees on, and [`EngineHash`], what an
//! engine published: one word for each thing.

use std::fmt;

/// A 64-bit hash newtype: `repr(transparent)` (slices of it as cheap as slices of `u64`),
/// serialised as the bare integer (as vLLM writes it), `Debug` in hex with its type's name,
/// `Display` in decimal (as vLLM logs the int form).
macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(
            Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize,
            serde::Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(u64);

        impl $name {
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

        impl From<u64> for $name {
            fn from(value: u64) -> Self {
                Self(value)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#018x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

hash_newtype! {
    /// A block's key in the index: the hash kv-indexer computes from token ids, vLLM's
    /// `sha256_cbor` with the configured seed and block size (the last 8 bytes, big-endian, of
    /// the block's digest, which commits to the whole prefix before the block, so equal keys
    /// mean equal prefixes). What [`ModelIndex`](crate::ModelIndex), scoring, speculation and
    /// snapshots' blocks are keyed by.
    ///
    /// An engine's published hash ([`EngineHash`]) becomes one only through
    /// [`BlockHash::aligned`] (an engine whose hashes are these keys) or through translation
    /// (keys computed from the engine's token ids).
    ///
    /// A newtype, not a bare `u64`, so a token id, an engine id, a count or an engine's hash
    /// can never be passed where a key is meant.
    BlockHash
}

hash_newtype! {
    /// A block hash as an engine published it in its events (`BlockStored.block_hashes`,
    /// `parent_block_hash`, `BlockRemoved.block_hashes`): opaque, compared only with the same
    /// engine's other hashes. Engines may hash with another seed, algorithm or block size than
    /// the index (or be SGLang), so it is not an index key: it becomes one only through
    /// [`BlockHash::aligned`], for an engine whose hashes are the index's keys (aligned), or
    /// through the engine's translation map.
    EngineHash
}

impl BlockHash {
    /// An aligned engine's published hash taken as the index's key: the one conversion from
    /// [`EngineHash`], for engines whose hashes are the keys (same algorithm, seed and block
    /// size; an undecided engine's are taken so until its events show otherwise).
    #[inline(always)]
    pub const fn aligned(hash: EngineHash) -> Self {
        Self(hash.0)
    }
}

impl BlockHash {
    /// This key in KV-cache group `group`'s key space: itself for group 0 (and for events
    /// that name no group), a fixed mix of key and group otherwise. vLLM keys its cache by
    /// (hash, group) (`make_block_hash_with_group_id`) and the same hash is routinely held by
    /// several groups of one engine; memberships of a hybrid model's groups are kept apart
    /// this way, in the one index, at the same cost per membership.
    #[inline(always)]
    pub fn in_group(self, group: u32) -> Self {
        Self(in_group(self.0, group))
    }
}

/// `hash` in KV-cache group `group`'s space: itself for group 0, a fixed mix of hash and group
/// otherwise (the one mix, for keys and engine hashes alike).
#[inline(always)]
fn in_group(hash: u64, group: u32) -> u64 {
    if group == 0 {
        hash
    } else {
        crate::mix::mix64(hash ^ crate::mix::mix64(u64::from(group).wrapping_mul(GROUP_GAMMA)))
    }
}

/// The odd constant group numbers are spread by before they mix into a key.
const GROUP_GAMMA: u64 = 0xD1B5_4A32_D192_ED03;

impl EngineHash {
    /// The hash an aligned engine publishes for the index's key `key` (an engine that hashes
    /// as kv-indexer does: what simulated and test engines send); the inverse of
    /// [`BlockHash::aligned`].
    #[inline(always)]
    pub const fn aligned(key: BlockHash) -> Self {
        Self(key.0)
    }

    /// This engine hash in KV-cache group `group`'s space (itself for group 0), as
    /// [`BlockHash::in_group`] does for keys: a translated engine maps what each of its groups
    /// holds apart, since vLLM stores the same hash in several groups and removes one copy
    /// while another stays.
    #[inline(always)]
    pub fn in_group(self, group: u32) -> Self {
        Self(in_group(self.0, group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_names_the_type_and_display_is_decimal() {
        assert_eq!(
            format!("{:?}", BlockHash::new(255)),
            "BlockHash(0x00000000000000ff)"
        );
        assert_eq!(
            format!("{:?}", EngineHash::new(255)),
            "EngineHash(0x00000000000000ff)"
        );
        assert_eq!(EngineHash::new(255).to_string(), "255");
        assert_eq!(BlockHash::aligned(EngineHash::from(7)), BlockHash::new(7));
        assert_eq!(EngineHash::aligned(BlockHash::new(7)), EngineHash::new(7));
        let k = BlockHash::new(7);
        assert_eq!(k.in_group(0), k);
        assert_ne!(k.in_group(1), k);
        assert_ne!(k.in_group(1), k.in_group(2));
        assert_eq!(k.in_group(3), BlockHash::new(7).in_group(3));
    }
}
