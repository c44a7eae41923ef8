//! vLLM KV-cache events: the `KVEventBatch` msgpack payload of a ZMQ message, decoded.
//!
//! Wire format (`docs/vllm-compatibility.md` §1, §2): a batch is the array `[ts, events, data_parallel_rank?]`;
//! an event is an array `[tag, field...]` (vLLM <= 0.23) or a map `{"type": tag, field: value}`
//! (vLLM >= 0.24). Hashes are u64 (default), signed ints (0.9 `builtin`) or byte strings (32 raw
//! digest bytes, or 64+ for concatenated hybrid-group hashes): the index key is always the last 8
//! bytes, big-endian.
//!
//! Invariants: decoding never panics; malformed input yields a [`DecodeError`] whose
//! [`DecodeError::reason`] is a bounded metric label; unknown fields, extra trailing array
//! elements and unknown event types are tolerated (forward compatibility), the latter surfacing as
//! [`KvEvent::Unknown`] so callers can count them.

mod encode;
pub(crate) mod msgpack;

pub use encode::{encode_batch, encode_batch_as, WireForm};

pub use msgpack::MsgpackKind;
use msgpack::{Int, Reader};

use crate::BlockHash;
use thiserror::Error;

/// Why a payload could not be decoded. Positions are byte offsets into the payload.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum DecodeError {
    /// The payload ended inside a value.
    #[error("payload truncated at byte {at}")]
    Truncated {
        /// Where reading stopped.
        at: usize,
    },
    /// A value of the wrong msgpack type.
    #[error("expected {expected} at byte {at}, found {found:?}")]
    UnexpectedType {
        /// What the decoder needed.
        expected: &'static str,
        /// What was there (`None` if unreadable).
        found: Option<MsgpackKind>,
        /// Where.
        at: usize,
    },
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in string at byte {at}")]
    InvalidUtf8 {
        /// Where the string starts.
        at: usize,
    },
    /// An integer outside the field's range (e.g. a token id above u32).
    #[error("integer out of range at byte {at}")]
    OutOfRange {
        /// Where the integer starts.
        at: usize,
    },
    /// Nesting beyond [`msgpack::MAX_DEPTH`].
    #[error("nesting too deep at byte {at}")]
    TooDeep {
        /// Where.
        at: usize,
    },
    /// A byte-string hash shorter than 8 bytes.
    #[error("block hash of {len} bytes at byte {at}; need at least 8")]
    ShortHash {
        /// Its length.
        len: usize,
        /// Where.
        at: usize,
    },
    /// A required field was absent from a map-form event, or an array-form event was too short.
    #[error("{event} is missing field {field}")]
    MissingField {
        /// The event type.
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// The batch array has fewer than two elements.
    #[error("a KVEventBatch needs [ts, events], got {len} elements")]
    BatchTooShort {
        /// The batch array's length.
        len: usize,
    },
    /// An event whose type tag is missing or not a string.
    #[error("event without a type tag at byte {at}")]
    MissingTag {
        /// Where the event starts.
        at: usize,
    },
    /// The decoded batch would be larger than the payload's decode budget (6x its size plus
    /// 4 KiB): a payload crafted to multiply memory.
    #[error("payload decodes to more than its memory budget (at byte {at})")]
    TooLarge {
        /// Where the budget ran out.
        at: usize,
    },
    /// Bytes left after the batch.
    #[error("{extra} trailing bytes after the batch")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}

impl DecodeError {
    /// A short, bounded label for the `decode_errors_total{reason}` metric.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::UnexpectedType { .. } => "unexpected_type",
            DecodeError::InvalidUtf8 { .. } => "invalid_utf8",
            DecodeError::OutOfRange { .. } => "out_of_range",
            DecodeError::TooDeep { .. } => "too_deep",
            DecodeError::ShortHash { .. } => "short_hash",
            DecodeError::MissingField { .. } => "missing_field",
            DecodeError::BatchTooShort { .. } => "batch_too_short",
            DecodeError::MissingTag { .. } => "missing_tag",
            DecodeError::TrailingBytes { .. } => "trailing_bytes",
            DecodeError::TooLarge { .. } => "too_large",
        }
    }
}

/// The storage tier a block lives in (`BlockStored.medium`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// vLLM's GPU block pool (`"GPU"`); also assumed when an event names no medium (< 0.10.2).
    Gpu,
    /// CPU offload (`"CPU"`).
    Cpu,
    /// Storage offload (`"STORAGE"`).
    Storage,
    /// Any other tier a connector names.
    Other(Box<str>),
}

impl Medium {
    /// Parses vLLM's medium string (case-insensitive for the known tiers).
    pub fn parse(s: &str) -> Self {
        if s.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if s.eq_ignore_ascii_case("CPU") {
            Medium::Cpu
        } else if s.eq_ignore_ascii_case("STORAGE") {
            Medium::Storage
        } else {
            Medium::Other(s.into())
        }
    }

    /// The wire name.
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Other(s) => s,
        }
    }
}

/// A generic msgpack value, for the rarely used, loosely typed fields (`extra_keys`).
#[derive(Debug, Clone, PartialEq)]
pub enum MsgpackValue {
    /// `nil`
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// An array (or tuple).
    Array(Vec<MsgpackValue>),
    /// A map, as key/value pairs in wire order.
    Map(Vec<(MsgpackValue, MsgpackValue)>),
}

/// `BlockStored`: a run of full blocks one engine cached, with the hash of the block before it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The run's block hashes (index keys), in chain order.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block the run continues; `None` when it starts at the prompt's start.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of the run (for SWA groups it spans skipped blocks too).
    pub token_ids: Vec<u32>,
    /// The group's block size.
    pub block_size: u32,
    /// The LoRA adapter's int id (deprecated in 0.14+).
    pub lora_id: Option<i64>,
    /// The tier (`None` before vLLM 0.10.2).
    pub medium: Option<Medium>,
    /// The LoRA adapter's name (0.14+).
    pub lora_name: Option<String>,
    /// Per-block extra keys as published (0.17+): one entry per hash, `None` for plain blocks.
    pub extra_keys: Option<Vec<Option<MsgpackValue>>>,
    /// The KV-cache group (0.20+).
    pub group_idx: Option<i64>,
    /// The group's kind, e.g. `"full_attention"`, `"sliding_window"`, `"mamba"` (0.22+).
    pub kv_cache_spec_kind: Option<String>,
    /// The group's sliding window, if any (0.22+).
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// 0.26+.
    pub locality: Option<String>,
    /// 0.29+.
    pub ownership: Option<String>,
    /// 0.30+.
    pub session_id: Option<String>,
    /// EAGLE lookahead tokens per block (0.33+).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`: blocks an engine evicted (vLLM sends one event per evicted hash).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The evicted hashes.
    pub block_hashes: Vec<BlockHash>,
    /// The tier they were evicted from.
    pub medium: Option<Medium>,
    /// The KV-cache group (0.20+).
    pub group_idx: Option<i64>,
    /// 0.26+.
    pub locality: Option<String>,
    /// 0.29+.
    pub ownership: Option<String>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks cached (boxed: the largest event, so the others stay small in a batch).
    BlockStored(Box<BlockStored>),
    /// Blocks evicted.
    BlockRemoved(BlockRemoved),
    /// The engine's prefix cache was reset.
    AllBlocksCleared,
    /// A type this decoder does not know (a newer vLLM); its body was skipped.
    Unknown(String),
}

impl KvEvent {
    /// The event's type name, bounded, for metric labels.
    pub fn type_label(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
            KvEvent::Unknown(_) => "unknown",
        }
    }
}

/// A decoded `KVEventBatch`: what one ZMQ message carries.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The publisher's wall-clock time (seconds since the epoch).
    pub ts: f64,
    /// The events, in the order the engine produced them.
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank (0.10+), if sent.
    pub data_parallel_rank: Option<i64>,
}

/// Decodes one `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let len = r.array_len()?;
    if len < 2 {
        return Err(DecodeError::BatchTooShort { len });
    }
    let ts = r.f64()?;
    let n = r.array_len()?;
    r.charge(n.saturating_mul(std::mem::size_of::<KvEvent>()))?;
    // Cap the pre-allocation: a hostile length must not reserve gigabytes.
    let mut events = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        events.push(decode_event(&mut r)?);
    }
    let mut data_parallel_rank = None;
    if len >= 3 && !r.try_nil() {
        data_parallel_rank = Some(r.i64()?);
    }
    for _ in 3..len {
        r.skip()?;
    }
    if !r.is_at_end() {
        return Err(DecodeError::TrailingBytes {
            extra: payload.len() - r.position(),
        });
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn decode_event(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let at = r.position();
    match r.peek_kind()? {
        MsgpackKind::Array => {
            let len = r.array_len()?;
            if len == 0 {
                return Err(DecodeError::MissingTag { at });
            }
            let tag = r.str().map_err(|e| tag_error(e, at))?;
            decode_array_event(r, tag, len - 1)
        }
        MsgpackKind::Map => {
            let len = r.map_len()?;
            decode_map_event(r, len, at)
        }
        _ => Err(DecodeError::UnexpectedType {
            expected: "event (array or map)",
            found: r.peek_kind().ok(),
            at,
        }),
    }
}

/// A tag that is not a string is a missing tag; a payload that ends inside it is truncated.
fn tag_error(e: DecodeError, at: usize) -> DecodeError {
    match e {
        DecodeError::Truncated { .. } => e,
        _ => DecodeError::MissingTag { at },
    }
}

/// Field names of BlockStored in declaration (= array) order.
const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
/// Field names of BlockRemoved in declaration order.
const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

fn decode_array_event(
    r: &mut Reader<'_>,
    tag: &str,
    fields: usize,
) -> Result<KvEvent, DecodeError> {
    match tag {
        "BlockStored" => {
            if fields < 4 {
                return Err(DecodeError::MissingField {
                    event: "BlockStored",
                    field: STORED_FIELDS[fields],
                });
            }
            let mut ev = BlockStored::default();
            for i in 0..fields {
                match STORED_FIELDS.get(i) {
                    Some(name) => stored_field(r, &mut ev, name)?,
                    None => r.skip()?,
                }
            }
            r.charge(std::mem::size_of::<BlockStored>())?;
            Ok(KvEvent::BlockStored(Box::new(ev)))
        }
        "BlockRemoved" => {
            if fields < 1 {
                return Err(DecodeError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            let mut ev = BlockRemoved::default();
            for i in 0..fields {
                match REMOVED_FIELDS.get(i) {
                    Some(name) => removed_field(r, &mut ev, name)?,
                    None => r.skip()?,
                }
            }
            Ok(KvEvent::BlockRemoved(ev))
        }
        "AllBlocksCleared" => {
            for _ in 0..fields {
                r.skip()?;
            }
            Ok(KvEvent::AllBlocksCleared)
        }
        other => {
            r.charge(other.len())?;
            let other = other.to_owned();
            for _ in 0..fields {
                r.skip()?;
            }
            Ok(KvEvent::Unknown(other))
        }
    }
}

fn decode_map_event(r: &mut Reader<'_>, len: usize, at: usize) -> Result<KvEvent, DecodeError> {
    // msgspec writes the tag first; accept it anywhere by buffering nothing: a map event whose
    // tag comes later is re-read from the start once the tag is known.
    let start = r.clone();
    let mut tag = None;
    for _ in 0..len {
        let key = r.str()?;
        if key == "type" {
            tag = Some(r.str().map_err(|e| tag_error(e, at))?);
            break;
        }
        r.skip()?;
    }
    let tag = tag.ok_or(DecodeError::MissingTag { at })?;
    *r = start;
    let mut seen_hashes = false;
    let mut seen_block_size = false;
    let event = match tag {
        "BlockStored" => {
            let mut ev = BlockStored::default();
            for _ in 0..len {
                let key = r.str()?;
                match key {
                    "type" => r.skip()?,
                    "block_hashes" => {
                        seen_hashes = true;
                        stored_field(r, &mut ev, key)?
                    }
                    "block_size" => {
                        seen_block_size = true;
                        stored_field(r, &mut ev, key)?
                    }
                    k if STORED_FIELDS.contains(&k) => stored_field(r, &mut ev, k)?,
                    _ => r.skip()?,
                }
            }
            if !seen_hashes {
                return Err(DecodeError::MissingField {
                    event: "BlockStored",
                    field: "block_hashes",
                });
            }
            if !seen_block_size {
                return Err(DecodeError::MissingField {
                    event: "BlockStored",
                    field: "block_size",
                });
            }
            r.charge(std::mem::size_of::<BlockStored>())?;
            KvEvent::BlockStored(Box::new(ev))
        }
        "BlockRemoved" => {
            let mut ev = BlockRemoved::default();
            for _ in 0..len {
                let key = r.str()?;
                match key {
                    "type" => r.skip()?,
                    "block_hashes" => {
                        seen_hashes = true;
                        removed_field(r, &mut ev, key)?
                    }
                    k if REMOVED_FIELDS.contains(&k) => removed_field(r, &mut ev, k)?,
                    _ => r.skip()?,
                }
            }
            if !seen_hashes {
                return Err(DecodeError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            KvEvent::BlockRemoved(ev)
        }
        other => {
            let kind = if other == "AllBlocksCleared" {
                KvEvent::AllBlocksCleared
            } else {
                r.charge(other.len())?;
                KvEvent::Unknown(other.to_owned())
            };
            for _ in 0..len {
                r.skip()?;
                r.skip()?;
            }
            kind
        }
    };
    Ok(event)
}

fn stored_field(r: &mut Reader<'_>, ev: &mut BlockStored, name: &str) -> Result<(), DecodeError> {
    match name {
        "block_hashes" => read_hashes(r, &mut ev.block_hashes)?,
        "parent_block_hash" => {
            ev.parent_block_hash = if r.try_nil() {
                None
            } else {
                Some(read_hash(r)?)
            }
        }
        "token_ids" => {
            if !r.try_nil() {
                let n = r.array_len()?;
                r.charge(n.saturating_mul(4))?;
                ev.token_ids.reserve(n.min(1 << 20));
                for _ in 0..n {
                    ev.token_ids.push(r.u32()?);
                }
            }
        }
        "block_size" => {
            ev.block_size = if r.try_nil() { 0 } else { r.u32()? };
        }
        "lora_id" => ev.lora_id = opt_i64(r)?,
        "medium" => ev.medium = opt_medium(r)?,
        "lora_name" => ev.lora_name = opt_string(r)?,
        "extra_keys" => {
            ev.extra_keys = if r.try_nil() {
                None
            } else {
                let n = r.array_len()?;
                r.charge(n.saturating_mul(std::mem::size_of::<Option<MsgpackValue>>()))?;
                let mut keys = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    keys.push(if r.try_nil() {
                        None
                    } else {
                        Some(read_value(r, 0)?)
                    });
                }
                Some(keys)
            }
        }
        "group_idx" => ev.group_idx = opt_i64(r)?,
        "kv_cache_spec_kind" => ev.kv_cache_spec_kind = opt_string(r)?,
        "kv_cache_spec_sliding_window" => ev.kv_cache_spec_sliding_window = opt_i64(r)?,
        "locality" => ev.locality = opt_string(r)?,
        "ownership" => ev.ownership = opt_string(r)?,
        "session_id" => ev.session_id = opt_string(r)?,
        "lookahead_token_ids" => {
            ev.lookahead_token_ids = if r.try_nil() {
                None
            } else {
                let n = r.array_len()?;
                r.charge(n.saturating_mul(std::mem::size_of::<Vec<u32>>()))?;
                let mut rows = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let m = r.array_len()?;
                    r.charge(m.saturating_mul(4))?;
                    let mut row = Vec::with_capacity(m.min(1024));
                    for _ in 0..m {
                        row.push(r.u32()?);
                    }
                    rows.push(row);
                }
                Some(rows)
            }
        }
        _ => r.skip()?,
    }
    Ok(())
}

fn removed_field(r: &mut Reader<'_>, ev: &mut BlockRemoved, name: &str) -> Result<(), DecodeError> {
    match name {
        "block_hashes" => read_hashes(r, &mut ev.block_hashes)?,
        "medium" => ev.medium = opt_medium(r)?,
        "group_idx" => ev.group_idx = opt_i64(r)?,
        "locality" => ev.locality = opt_string(r)?,
        "ownership" => ev.ownership = opt_string(r)?,
        _ => r.skip()?,
    }
    Ok(())
}

fn read_hashes(r: &mut Reader<'_>, out: &mut Vec<BlockHash>) -> Result<(), DecodeError> {
    if r.try_nil() {
        return Ok(());
    }
    let n = r.array_len()?;
    r.charge(n.saturating_mul(std::mem::size_of::<BlockHash>()))?;
    out.reserve(n.min(1 << 20));
    for _ in 0..n {
        out.push(read_hash(r)?);
    }
    Ok(())
}

/// A block hash in any of its wire forms, as the index's key.
#[inline(always)]
fn read_hash(r: &mut Reader<'_>) -> Result<BlockHash, DecodeError> {
    let at = r.position();
    match r.peek_kind()? {
        MsgpackKind::Int => Ok(BlockHash::new(match r.int()? {
            Int::Unsigned(v) => v,
            // 0.9 `builtin` hashes are signed 64-bit; keep their two's-complement bits.
            Int::Negative(v) => v as u64,
        })),
        MsgpackKind::Bin => {
            let bytes = r.bin()?;
            if bytes.len() < 8 {
                return Err(DecodeError::ShortHash {
                    len: bytes.len(),
                    at,
                });
            }
            let mut tail = [0u8; 8];
            tail.copy_from_slice(&bytes[bytes.len() - 8..]);
            Ok(BlockHash::new(u64::from_be_bytes(tail)))
        }
        found => Err(DecodeError::UnexpectedType {
            expected: "block hash (int or bytes)",
            found: Some(found),
            at,
        }),
    }
}

fn opt_i64(r: &mut Reader<'_>) -> Result<Option<i64>, DecodeError> {
    if r.try_nil() {
        Ok(None)
    } else {
        r.i64().map(Some)
    }
}

fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.try_nil() {
        Ok(None)
    } else {
        r.str().map(Some)
    }
}

/// An optional string field, owned (charged to the decode budget).
fn opt_string(r: &mut Reader<'_>) -> Result<Option<String>, DecodeError> {
    let Some(s) = opt_str(r)? else {
        return Ok(None);
    };
    r.charge(s.len())?;
    Ok(Some(s.to_owned()))
}

/// The `medium` field (a name other than the known tiers is kept, and charged).
fn opt_medium(r: &mut Reader<'_>) -> Result<Option<Medium>, DecodeError> {
    let Some(s) = opt_str(r)? else {
        return Ok(None);
    };
    let medium = Medium::parse(s);
    if let Medium::Other(name) = &medium {
        r.charge(name.len())?;
    }
    Ok(Some(medium))
}

fn read_value(r: &mut Reader<'_>, depth: usize) -> Result<MsgpackValue, DecodeError> {
    if depth > msgpack::MAX_DEPTH {
        return Err(DecodeError::TooDeep { at: r.position() });
    }
    Ok(match r.peek_kind()? {
        MsgpackKind::Nil => {
            r.try_nil();
            MsgpackValue::Nil
        }
        MsgpackKind::Bool => MsgpackValue::Bool(r.bool()?),
        MsgpackKind::Int => match r.int()? {
            Int::Unsigned(v) => MsgpackValue::UInt(v),
            Int::Negative(v) => MsgpackValue::Int(v),
        },
        MsgpackKind::Float => MsgpackValue::Float(r.f64()?),
        MsgpackKind::Str => {
            let text = r.str()?;
            r.charge(text.len())?;
            MsgpackValue::Str(text.to_owned())
        }
        MsgpackKind::Bin => {
            let bytes = r.bin()?;
            r.charge(bytes.len())?;
            MsgpackValue::Bytes(bytes.to_vec())
        }
        MsgpackKind::Array => {
            let n = r.array_len()?;
            r.charge(n.saturating_mul(std::mem::size_of::<MsgpackValue>()))?;
            let mut items = Vec::with_capacity(n.min(256));
            for _ in 0..n {
                items.push(read_value(r, depth + 1)?);
            }
            MsgpackValue::Array(items)
        }
        MsgpackKind::Map => {
            let n = r.map_len()?;
            r.charge(n.saturating_mul(2 * std::mem::size_of::<MsgpackValue>()))?;
            let mut items = Vec::with_capacity(n.min(256));
            for _ in 0..n {
                let k = read_value(r, depth + 1)?;
                let v = read_value(r, depth + 1)?;
                items.push((k, v));
            }
            MsgpackValue::Map(items)
        }
        MsgpackKind::Ext | MsgpackKind::Reserved => {
            let at = r.position();
            r.skip()?;
            return Err(DecodeError::UnexpectedType {
                expected: "plain value in extra_keys",
                found: Some(MsgpackKind::Ext),
                at,
            });
        }
    })
}
