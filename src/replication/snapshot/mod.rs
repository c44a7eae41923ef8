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
//!   many `u64`, four `u16` copies; `u32` second copies, each `u64` hash, `u8` tier, `u32` copies;
//! - `0` end.
//!
//! Version 1 (no engine keys) is still read; version 2 is written.
//!
//! Decoding checks every length against what is left, so a truncated or corrupt snapshot is
//! an error, never a panic or an allocation larger than the input.

use std::sync::Arc;

use kv_core::{BlockHash, EngineKey, EngineKeyState, KeyMode, Tier, TranslatedBlock};
use thiserror::Error;

use super::StreamId;
use crate::ingest::{PublisherKey, PublisherState};

const MAGIC: &[u8; 8] = b"KVIXSNAP";
const VERSION: u32 = 2;
const TAG_END: u8 = 0;
const TAG_BLOCKS: u8 = 1;
const TAG_PUBLISHER: u8 = 2;
const TAG_ENGINE_KEYS: u8 = 3;

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

    /// One publisher's sequence state.
    pub fn publisher(&mut self, key: &PublisherKey, state: &PublisherState) {
        self.out.push(TAG_PUBLISHER);
        self.string(&key.pod);
        self.string(&key.model);
        self.string(&state.received_by);
        self.out.extend_from_slice(&key.rank.to_le_bytes());
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
            let earlier = t.earlier.len().min(u8::MAX as usize);
            self.out.push(earlier as u8);
            for k in &t.earlier[..earlier] {
                self.out.extend_from_slice(&k.get().to_le_bytes());
            }
            for c in t.copies {
                self.out.extend_from_slice(&c.to_le_bytes());
            }
        }
        self.out
            .extend_from_slice(&(state.copies.len() as u32).to_le_bytes());
        for (hash, tier, n) in &state.copies {
            self.out.extend_from_slice(&hash.get().to_le_bytes());
            self.out.push(*tier as u8);
            self.out.extend_from_slice(&n.to_le_bytes());
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
            done: false,
        };
        let version = r.u32()?;
        if !(1..=VERSION).contains(&version) {
            return Err(SnapshotError::Format(Some(version)));
        }
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
            let engine_hash = BlockHash::from(self.u64()?);
            let mut tip = [0u8; 32];
            tip.copy_from_slice(self.take(32)?);
            let earlier_len = self.u8()? as usize;
            let earlier = (0..earlier_len)
                .map(|_| self.u64().map(BlockHash::from))
                .collect::<Result<_, _>>()?;
            let mut copies = [0u16; 4];
            for c in &mut copies {
                *c = self.u16()?;
            }
            translated.push(TranslatedBlock {
                engine_hash,
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
        Ok(EngineKeyState {
            mode,
            translated,
            copies,
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
        match self.u8()? {
            TAG_END => {
                self.done = true;
                Ok(None)
            }
            TAG_BLOCKS => {
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
                Ok(Some(SnapshotItem::Blocks {
                    model,
                    key: EngineKey::new(pod, rank),
                    tier,
                    hashes,
                }))
            }
            TAG_PUBLISHER => {
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
                Ok(Some(SnapshotItem::Publisher(
                    PublisherKey { pod, model, rank },
                    state,
                )))
            }
            TAG_ENGINE_KEYS => {
                let model = self.string()?;
                let pod = self.string()?;
                let rank = self.u32()?;
                let state = self.engine_keys(at)?;
                Ok(Some(SnapshotItem::EngineKeys {
                    model,
                    key: EngineKey::new(pod, rank),
                    state,
                }))
            }
            _ => Err(SnapshotError::Corrupt {
                at,
                what: "unknown item tag",
            }),
        }
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
mod tests {
    use super::*;

    fn sample() -> (Vec<u8>, u64) {
        let mut w = SnapshotWriter::new(StreamId { ms: 17, seq: 3 }, 3);
        let blocks: Vec<(BlockHash, Tier)> = vec![
            (BlockHash::from(1), Tier::Gpu),
            (BlockHash::from(2), Tier::Cpu),
            (BlockHash::from(u64::MAX - 1), Tier::Gpu),
        ];
        w.blocks("m", &EngineKey::new("10.0.0.1:8000", 2), &blocks);
        let state = PublisherState {
            last_seq: Some(41),
            last_ts: 1.5e9,
            received_by: "replica-a".into(),
            messages: 42,
            gaps: 1,
            restarts: 0,
            messages_lost: 3,
            ..PublisherState::default()
        };
        let key = PublisherKey {
            pod: "10.0.0.1:8000".into(),
            model: "m".into(),
            rank: 2,
        };
        w.publisher(&key, &state);
        let keys = EngineKeyState {
            mode: KeyMode::Translated,
            translated: vec![TranslatedBlock {
                engine_hash: BlockHash::from(77),
                tip: [7; 32],
                earlier: vec![BlockHash::from(5)],
                copies: [1, 0, 2, 0],
            }],
            copies: vec![(BlockHash::from(9), Tier::Cpu, 2)],
        };
        w.engine_keys("m", &EngineKey::new("10.0.0.1:8000", 2), &keys);
        w.finish()
    }

    /// A translated engine restored from a snapshot resolves its hashes as before: a removal
    /// by engine hash removes the keys, a run continuing a restored block scores.
    #[test]
    fn a_translated_engines_map_survives_a_snapshot() {
        use kv_core::{
            BlockRemoved, BlockStored, EventBatch, Indexer, IndexerSettings, KvEvent, Medium,
        };
        let indexer = || Indexer::new(IndexerSettings::default()).expect("valid");
        let tokens: Vec<u32> = (0..96).map(|i| i * 31 + 7).collect();
        let run = |hashes: &[u64], parent: Option<u64>, toks: &[u32]| EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: hashes.iter().map(|&h| BlockHash::from(h)).collect(),
                parent_block_hash: parent.map(BlockHash::from),
                token_ids: toks.to_vec(),
                block_size: 32,
                medium: Some(Medium::Gpu),
                ..Default::default()
            }))],
            data_parallel_rank: Some(0),
        };
        let source = indexer();
        source
            .apply_batch("m", "p", &run(&[11, 12], None, &tokens[..64]))
            .expect("applies");
        let mut w = SnapshotWriter::new(StreamId::ZERO, 8);
        source.export_each(|model, key, blocks| w.blocks(model, key, blocks));
        source.export_keys_each(|model, key, state| w.engine_keys(model, key, state));
        let (bytes, _) = w.finish();

        let restored = indexer();
        super::super::store::apply_snapshot(&bytes, &restored).expect("loads");
        let engines = restored.model("m").expect("model").key_modes();
        assert_eq!(engines.values().map(|(_, n)| *n).sum::<usize>(), 2);
        let matched = |ix: &Indexer| {
            ix.score_tokens("m", &tokens, &["p"], None, None)
                .expect("model")
                .scores[0]
                .matched_blocks
        };
        assert_eq!(matched(&restored), 4, "two engine blocks of 32: four keys");
        restored
            .apply_batch("m", "p", &run(&[13], Some(12), &tokens[64..]))
            .expect("applies");
        assert_eq!(
            matched(&restored),
            6,
            "a continuation of a restored block scores"
        );
        let removed = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::from(12)],
                medium: Some(Medium::Gpu),
                ..Default::default()
            })],
            data_parallel_rank: Some(0),
        };
        let r = restored.apply_batch("m", "p", &removed).expect("applies");
        assert_eq!(r.blocks_removed, 2, "both keys of engine block 12");
        assert_eq!(matched(&restored), 2);
    }

    #[test]
    fn items_read_back_as_written() {
        let (bytes, memberships) = sample();
        assert_eq!(memberships, 3);
        let mut r = SnapshotReader::new(&bytes).expect("header");
        assert_eq!(r.position, StreamId { ms: 17, seq: 3 });
        let mut got = Vec::new();
        while let Some(rec) = r.next_item().expect("item") {
            got.push(format!("{rec:?}"));
        }
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(
            got[3].contains("Translated") && got[3].contains("copies: [1, 0, 2, 0]"),
            "{got:?}"
        );
        assert!(
            got[0].contains("Gpu") && got[0].contains("0xfffffffffffffffe"),
            "{got:?}"
        );
        assert!(got[1].contains("Cpu"), "{got:?}");
        assert!(
            got[2].contains("Some(41)") && got[2].contains("replica-a"),
            "{got:?}"
        );
    }

    #[test]
    fn every_truncation_and_a_bad_header_are_errors_not_panics() {
        let (bytes, _) = sample();
        for cut in 0..bytes.len() {
            let result = SnapshotReader::new(&bytes[..cut]).and_then(|mut r| {
                while r.next_item()?.is_some() {}
                Ok(())
            });
            assert!(result.is_err(), "a snapshot cut at {cut} read as complete");
        }
        let mut bad = bytes.clone();
        bad[8] = 9;
        assert!(matches!(
            SnapshotReader::new(&bad).err(),
            Some(SnapshotError::Format(Some(_)))
        ));
    }

    #[test]
    fn the_checksum_sees_one_flipped_bit() {
        let (bytes, _) = sample();
        let mut flipped = bytes.clone();
        flipped[30] ^= 1;
        assert_ne!(checksum(&[&bytes]), checksum(&[&flipped]));
        let (a, b) = bytes.split_at(10);
        assert_eq!(checksum(&[&bytes]), checksum(&[a, b]));
    }
}
