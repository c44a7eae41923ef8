//! The snapshot format: the index and the publishers' sequence states as of one log position,
//! as a stream of items, so it is written and read one engine at a time.
//!
//! Layout (little-endian): the magic `KVIXSNAP`, a `u32` version, the log position (`u64`
//! milliseconds, `u64` sequence), then items, each a tag byte:
//! - `1` blocks: model, pod (`u16`-length strings), `u32` DP rank, `u8` tier, `u32` count,
//!   then `count` block hashes (`u64`): 8 bytes per membership plus a few dozen per engine;
//! - `2` publisher: pod, model, received-by (strings), `u32` rank, `u64` last sequence
//!   (`u64::MAX`: none), `f64` timestamp, `u64` messages, gaps, restarts, lost;
//! - `3` engine keys (version 2): model, pod, `u32` rank, `u8` key mode (0 undecided, 1
//!   aligned, 2 translated, 3 refused, then `u32` engine and `u32` index block sizes), `u32`
//!   translated blocks, each `u64` engine hash, 32-byte tip digest, `u8` earlier keys and that
//!   many `u64` (version 3: a `u16` count), four `u16` copies, (version 6) a `u8` KV-cache
//!   group (the engine hash is in that group's space); `u32` second copies, each `u64`
//!   hash, `u8` tier, `u32` copies; (version 4) `u8` KV-cache groups, each `u32` group index,
//!   `u8` kind (0 full attention, 1 sliding window, 2 Mamba, (version 6) 3 chunked local
//!   attention), `u32` window (the chunk for kind 3), `u32` block units;
//! - `4` key space (version 3), before any item of its model: model, the 32-byte root digest
//!   (from the hash seed), `u32` block size, `u32` hash unit size, `u8` extra-key format (0
//!   tagged, 1 untagged), (version 5) `u32` lookahead (vLLM's `num_hash_lookahead_tokens` the
//!   model learned; 0: none). A reader whose model keys prompts otherwise loads none of that
//!   model's blocks or key states (they are keys of another key space), and counts them; a
//!   model that has learned no lookahead takes the snapshot's;
//! - `0` end.
//!
//! Versions 1 (no engine keys), 2 (no key spaces), 3 (no KV-cache groups), 4 (no
//! lookahead) and 5 (translated blocks of group 0 only) are still read; version 6 is written.
//!
//! Decoding checks every length against what is left, so a truncated or corrupt snapshot is
//! an error, never a panic or an allocation larger than the input.

use std::sync::Arc;

use kv_core::{
    BlockHash, EngineHash, EngineKey, EngineKeyState, ExtraKeysFormat, GroupKind, GroupSpec,
    KeyMode, KeySpace, Tier, TranslatedBlock,
};
use thiserror::Error;

use super::stream::StreamId;
use crate::ingest::{PublisherKey, PublisherState};

const MAGIC: &[u8; 8] = b"KVIXSNAP";
const VERSION: u32 = 6;
const TAG_END: u8 = 0;
const TAG_BLOCKS: u8 = 1;
const TAG_PUBLISHER: u8 = 2;
const TAG_ENGINE_KEYS: u8 = 3;
const TAG_KEY_SPACE: u8 = 4;

/// Why a snapshot could not be read.
#[derive(Debug, Error, PartialEq)]
pub enum SnapshotError {
    /// Not a snapshot, or one of another version.
    #[error("not a kv-indexer snapshot (version {0:?})")]
    Format(Option<u32>),
    /// The data ends inside an item.
    #[error("snapshot truncated at byte {0}")]
    Truncated(usize),
    /// An item is malformed.
    #[error("snapshot corrupt at byte {at}: {what}")]
    Corrupt {
        /// Where.
        at: usize,
        /// What.
        what: &'static str,
    },
}

/// Writes a snapshot item by item.
pub struct SnapshotWriter {
    out: Vec<u8>,
    memberships: u64,
}

impl SnapshotWriter {
    /// A snapshot of the state as of log position `position`, for about `memberships`
    /// memberships (the buffer is sized once: growing it by doubling would need twice the
    /// snapshot's size at the moment of a copy).
    pub fn new(position: StreamId, memberships: u64) -> Self {
        let capacity = (memberships as usize)
            .saturating_mul(8)
            .saturating_add(1 << 16);
        let mut out = Vec::with_capacity(capacity);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&position.ms.to_le_bytes());
        out.extend_from_slice(&position.seq.to_le_bytes());
        Self {
            out,
            memberships: 0,
        }
    }

    fn string(&mut self, s: &str) {
        // Pod and model names are bounded far below 64 KiB by the topic grammar; a longer one
        // is cut at a character boundary rather than corrupting the item.
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.out.extend_from_slice(&(end as u16).to_le_bytes());
        self.out.extend_from_slice(&s.as_bytes()[..end]);
    }

    /// One engine's blocks (any tiers, any order).
    pub fn blocks(&mut self, model: &str, key: &EngineKey, blocks: &[(BlockHash, Tier)]) {
        let mut counts = [0usize; 4];
        for (_, tier) in blocks {
            counts[*tier as usize] += 1;
        }
        for tier in [Tier::Gpu, Tier::Cpu, Tier::Storage, Tier::Other] {
            let count = counts[tier as usize];
            if count == 0 {
                continue;
            }
            self.out.push(TAG_BLOCKS);
            self.string(model);
            self.string(&key.pod);
            self.out.extend_from_slice(&key.dp_rank.to_le_bytes());
            self.out.push(tier as u8);
            self.out.extend_from_slice(&(count as u32).to_le_bytes());
            self.out.reserve(count * 8);
            for (hash, _) in blocks.iter().filter(|(_, t)| *t == tier) {
                self.out.extend_from_slice(&hash.get().to_le_bytes());
            }
            self.memberships += count as u64;
        }
    }

    /// A model's key space: written before any of the model's blocks or key states.
    pub fn key_space(&mut self, model: &str, space: &KeySpace) {
        self.out.push(TAG_KEY_SPACE);
        self.string(model);
        self.out.extend_from_slice(&space.none_hash);
        self.out.extend_from_slice(&space.block_size.to_le_bytes());
        self.out
            .extend_from_slice(&space.hash_block_size.to_le_bytes());
        self.out.push(match space.extra_keys_format {
            ExtraKeysFormat::Tagged => 0,
            ExtraKeysFormat::Untagged => 1,
        });
        self.out.extend_from_slice(&space.lookahead.to_le_bytes());
    }

    /// One publisher's sequence state.
    pub fn publisher(&mut self, key: &PublisherKey, state: &PublisherState) {
        self.out.push(TAG_PUBLISHER);
        self.string(&key.engine.pod);
        self.string(&key.model);
        self.string(&state.received_by);
        self.out
            .extend_from_slice(&key.engine.dp_rank.to_le_bytes());
        let seq = state.last_seq.unwrap_or(u64::MAX);
        self.out.extend_from_slice(&seq.to_le_bytes());
        self.out.extend_from_slice(&state.last_ts.to_le_bytes());
        for n in [
            state.messages,
            state.gaps,
            state.restarts,
            state.messages_lost,
        ] {
            self.out.extend_from_slice(&n.to_le_bytes());
        }
    }

    /// One engine's key state (mode, translation map, second copies).
    pub fn engine_keys(&mut self, model: &str, key: &EngineKey, state: &EngineKeyState) {
        self.out.push(TAG_ENGINE_KEYS);
        self.string(model);
        self.string(&key.pod);
        self.out.extend_from_slice(&key.dp_rank.to_le_bytes());
        match state.mode {
            KeyMode::Undecided => self.out.push(0),
            KeyMode::Aligned => self.out.push(1),
            KeyMode::Translated => self.out.push(2),
            KeyMode::Refused { engine, ours } => {
                self.out.push(3);
                self.out.extend_from_slice(&engine.to_le_bytes());
                self.out.extend_from_slice(&ours.to_le_bytes());
            }
        }
        self.out
            .extend_from_slice(&(state.translated.len() as u32).to_le_bytes());
        for t in &state.translated {
            self.out
                .extend_from_slice(&t.engine_hash.get().to_le_bytes());
            self.out.extend_from_slice(&t.tip);
            // An engine block holds at most a few hundred keys (block sizes are bounded).
            let earlier = t.earlier.len().min(u16::MAX as usize);
            self.out.extend_from_slice(&(earlier as u16).to_le_bytes());
            for k in &t.earlier[..earlier] {
                self.out.extend_from_slice(&k.get().to_le_bytes());
            }
            for c in t.copies {
                self.out.extend_from_slice(&c.to_le_bytes());
            }
            // Groups are fewer than 256 (`kv_core::MAX_GROUPS`).
            self.out.push(t.group.min(u32::from(u8::MAX)) as u8);
        }
        self.out
            .extend_from_slice(&(state.copies.len() as u32).to_le_bytes());
        for (hash, tier, n) in &state.copies {
            self.out.extend_from_slice(&hash.get().to_le_bytes());
            self.out.push(*tier as u8);
            self.out.extend_from_slice(&n.to_le_bytes());
        }
        // At most MAX_GROUPS groups.
        let groups = &state.groups[..state.groups.len().min(u8::MAX as usize)];
        self.out.push(groups.len() as u8);
        for (g, spec) in groups {
            self.out.extend_from_slice(&g.to_le_bytes());
            let (kind, window) = match spec.kind {
                GroupKind::Full => (0u8, 0u32),
                GroupKind::SlidingWindow { window } => (1, window),
                GroupKind::Mamba => (2, 0),
                GroupKind::ChunkedLocal { chunk } => (3, chunk),
            };
            self.out.push(kind);
            self.out.extend_from_slice(&window.to_le_bytes());
            self.out.extend_from_slice(&spec.block_units.to_le_bytes());
        }
    }

    /// The finished snapshot and the memberships it holds.
    pub fn finish(mut self) -> (Vec<u8>, u64) {
        self.out.push(TAG_END);
        (self.out, self.memberships)
    }
}

/// One item read back.
#[derive(Debug, PartialEq)]
pub enum SnapshotItem<'a> {
    /// An engine's blocks in one tier.
    Blocks {
        /// The model.
        model: &'a str,
        /// The engine.
        key: EngineKey,
        /// The tier.
        tier: Tier,
        /// The block hashes.
        hashes: Vec<BlockHash>,
    },
    /// A publisher's state.
    Publisher(PublisherKey, PublisherState),
    /// A model's key space (version 3): its items that follow are keys of this space.
    KeySpace {
        /// The model.
        model: &'a str,
        /// Its key space when the snapshot was written.
        space: KeySpace,
    },
    /// An engine's key state (translation map, second copies).
    EngineKeys {
        /// The model.
        model: &'a str,
        /// The engine.
        key: EngineKey,
        /// Its state.
        state: EngineKeyState,
    },
}

/// Reads a snapshot item by item.
pub struct SnapshotReader<'a> {
    data: &'a [u8],
    at: usize,
    /// The log position the snapshot covers.
    pub position: StreamId,
    version: u32,
    done: bool,
}

impl<'a> SnapshotReader<'a> {
    /// Checks the header.
    pub fn new(data: &'a [u8]) -> Result<Self, SnapshotError> {
        if data.len() < 28 || &data[..8] != MAGIC {
            return Err(SnapshotError::Format(None));
        }
        let mut r = Self {
            data,
            at: 8,
            position: StreamId::ZERO,
            version: 0,
            done: false,
        };
        let version = r.u32()?;
        if !(1..=VERSION).contains(&version) {
            return Err(SnapshotError::Format(Some(version)));
        }
        r.version = version;
        r.position = StreamId {
            ms: r.u64()?,
            seq: r.u64()?,
        };
        Ok(r)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(SnapshotError::Truncated(self.at))?;
        let bytes = &self.data[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u16(&mut self) -> Result<u16, SnapshotError> {
        let mut b = [0; 2];
        b.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(b))
    }

    fn tier(&mut self, at: usize) -> Result<Tier, SnapshotError> {
        match self.u8()? {
            0 => Ok(Tier::Gpu),
            1 => Ok(Tier::Cpu),
            2 => Ok(Tier::Storage),
            3 => Ok(Tier::Other),
            _ => Err(SnapshotError::Corrupt {
                at,
                what: "unknown tier",
            }),
        }
    }

    /// A `u32` count of items at least `min_size` bytes each, checked against what is left.
    fn count(&mut self, min_size: usize) -> Result<usize, SnapshotError> {
        let at = self.at;
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size) > self.data.len() - self.at {
            return Err(SnapshotError::Truncated(at));
        }
        Ok(n)
    }

    fn engine_keys(&mut self, at: usize) -> Result<EngineKeyState, SnapshotError> {
        let mode = match self.u8()? {
            0 => KeyMode::Undecided,
            1 => KeyMode::Aligned,
            2 => KeyMode::Translated,
            3 => KeyMode::Refused {
                engine: self.u32()?,
                ours: self.u32()?,
            },
            _ => {
                return Err(SnapshotError::Corrupt {
                    at,
                    what: "unknown key mode",
                })
            }
        };
        let n = self.count(8 + 32 + 1 + 8)?;
        let mut translated = Vec::with_capacity(n);
        for _ in 0..n {
            let engine_hash = EngineHash::from(self.u64()?);
            let mut tip = [0u8; 32];
            tip.copy_from_slice(self.take(32)?);
            let earlier_len = if self.version >= 3 {
                self.u16()? as usize
            } else {
                self.u8()? as usize
            };
            let earlier = (0..earlier_len)
                .map(|_| self.u64().map(BlockHash::from))
                .collect::<Result<_, _>>()?;
            let mut copies = [0u16; 4];
            for c in &mut copies {
                *c = self.u16()?;
            }
            let group = if self.version >= 6 {
                u32::from(self.u8()?)
            } else {
                0
            };
            if group as usize >= kv_core::MAX_GROUPS {
                return Err(SnapshotError::Corrupt {
                    at,
                    what: "KV-cache group out of range",
                });
            }
            translated.push(TranslatedBlock {
                engine_hash,
                group,
                tip,
                earlier,
                copies,
            });
        }
        let n = self.count(8 + 1 + 4)?;
        let mut copies = Vec::with_capacity(n);
        for _ in 0..n {
            let hash = BlockHash::from(self.u64()?);
            let tier = self.tier(at)?;
            copies.push((hash, tier, self.u32()?));
        }
        let mut groups = Vec::new();
        if self.version >= 4 {
            let n = self.u8()? as usize;
            if n.saturating_mul(13) > self.data.len() - self.at {
                return Err(SnapshotError::Truncated(at));
            }
            for _ in 0..n {
                let g = self.u32()?;
                let kind = match (self.u8()?, self.u32()?) {
                    (0, _) => GroupKind::Full,
                    (1, window) => GroupKind::SlidingWindow { window },
                    (2, _) => GroupKind::Mamba,
                    (3, chunk) if chunk > 0 => GroupKind::ChunkedLocal { chunk },
                    _ => {
                        return Err(SnapshotError::Corrupt {
                            at,
                            what: "unknown KV-cache group kind",
                        })
                    }
                };
                let block_units = self.u32()?;
                groups.push((g, GroupSpec { kind, block_units }));
            }
        }
        Ok(EngineKeyState {
            mode,
            translated,
            copies,
            groups,
        })
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn string(&mut self) -> Result<&'a str, SnapshotError> {
        let mut b = [0; 2];
        b.copy_from_slice(self.take(2)?);
        let at = self.at;
        std::str::from_utf8(self.take(u16::from_le_bytes(b) as usize)?).map_err(|_| {
            SnapshotError::Corrupt {
                at,
                what: "a name is not UTF-8",
            }
        })
    }

    /// The next item, `None` at the end marker.
    pub fn next_item(&mut self) -> Result<Option<SnapshotItem<'a>>, SnapshotError> {
        if self.done {
            return Ok(None);
        }
        let at = self.at;
        let item = match self.u8()? {
            TAG_END => {
                self.done = true;
                return Ok(None);
            }
            TAG_BLOCKS => self.blocks(at)?,
            TAG_PUBLISHER => self.publisher()?,
            TAG_KEY_SPACE => self.key_space(at)?,
            TAG_ENGINE_KEYS => {
                let model = self.string()?;
                let pod = self.string()?;
                let rank = self.u32()?;
                let state = self.engine_keys(at)?;
                SnapshotItem::EngineKeys {
                    model,
                    key: EngineKey::new(pod, rank),
                    state,
                }
            }
            _ => {
                return Err(SnapshotError::Corrupt {
                    at,
                    what: "unknown item tag",
                })
            }
        };
        Ok(Some(item))
    }

    /// A blocks record (its tag read at `at`): an engine's hashes in one tier.
    fn blocks(&mut self, at: usize) -> Result<SnapshotItem<'a>, SnapshotError> {
        let model = self.string()?;
        let pod = self.string()?;
        let rank = self.u32()?;
        let tier = match self.u8()? {
            0 => Tier::Gpu,
            1 => Tier::Cpu,
            2 => Tier::Storage,
            3 => Tier::Other,
            _ => {
                return Err(SnapshotError::Corrupt {
                    at,
                    what: "unknown tier",
                })
            }
        };
        let count = self.u32()? as usize;
        let bytes = self.take(count.checked_mul(8).ok_or(SnapshotError::Truncated(at))?)?;
        let hashes = bytes
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0; 8];
                b.copy_from_slice(c);
                BlockHash::from(u64::from_le_bytes(b))
            })
            .collect();
        Ok(SnapshotItem::Blocks {
            model,
            key: EngineKey::new(pod, rank),
            tier,
            hashes,
        })
    }

    /// A publisher's stream state.
    fn publisher(&mut self) -> Result<SnapshotItem<'a>, SnapshotError> {
        let pod: Arc<str> = self.string()?.into();
        let model: Arc<str> = self.string()?.into();
        let received_by: Arc<str> = self.string()?.into();
        let rank = self.u32()?;
        let seq = self.u64()?;
        let ts = f64::from_bits(self.u64()?);
        let state = PublisherState {
            last_seq: (seq != u64::MAX).then_some(seq),
            last_ts: ts,
            received_by,
            messages: self.u64()?,
            gaps: self.u64()?,
            restarts: self.u64()?,
            messages_lost: self.u64()?,
            ..PublisherState::default()
        };
        Ok(SnapshotItem::Publisher(
            PublisherKey::new(pod, model, rank),
            state,
        ))
    }

    /// A model's key space (its tag read at `at`): what its keys were hashed with.
    fn key_space(&mut self, at: usize) -> Result<SnapshotItem<'a>, SnapshotError> {
        let model = self.string()?;
        let mut none_hash = [0u8; 32];
        none_hash.copy_from_slice(self.take(32)?);
        let block_size = self.u32()?;
        let hash_block_size = self.u32()?;
        let extra_keys_format = match self.u8()? {
            0 => ExtraKeysFormat::Tagged,
            1 => ExtraKeysFormat::Untagged,
            _ => {
                return Err(SnapshotError::Corrupt {
                    at,
                    what: "unknown extra-key format",
                })
            }
        };
        let lookahead = if self.version >= 5 { self.u32()? } else { 0 };
        Ok(SnapshotItem::KeySpace {
            model,
            space: KeySpace {
                none_hash,
                block_size,
                hash_block_size,
                extra_keys_format,
                lookahead,
            },
        })
    }
}

/// FNV-1a over the snapshot's bytes: the meta carries it, so a reader that got chunks
/// of two different snapshots (one replaced meanwhile) notices.
pub fn checksum(parts: &[impl AsRef<[u8]>]) -> u64 {
    let mut h = kv_core::Fnv1a::new();
    for part in parts {
        h.write(part.as_ref());
    }
    h.finish()
}

#[cfg(test)]
mod tests;
