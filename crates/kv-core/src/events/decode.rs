//! The decoder: one `KVEventBatch` payload into an [`EventBatch`], both event forms (arrays
//! <= 0.23, maps >= 0.24), every allocation charged to the payload's decode budget
//! ([`Reader::charge`]).

use super::msgpack::{self, Int, MsgpackKind, Reader};
use super::{BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, Medium, MsgpackValue};
use crate::EngineHash;

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
        // SGLang (map form only): the salt of the request that stored the run.
        "cache_salt" => ev.cache_salt = opt_string(r)?,
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

fn read_hashes(r: &mut Reader<'_>, out: &mut Vec<EngineHash>) -> Result<(), DecodeError> {
    if r.try_nil() {
        return Ok(());
    }
    let n = r.array_len()?;
    r.charge(n.saturating_mul(std::mem::size_of::<EngineHash>()))?;
    out.reserve(n.min(1 << 20));
    for _ in 0..n {
        out.push(read_hash(r)?);
    }
    Ok(())
}

/// A block hash in any of its wire forms, as the engine published it (the last 8 bytes,
/// big-endian, of a byte string).
#[inline(always)]
fn read_hash(r: &mut Reader<'_>) -> Result<EngineHash, DecodeError> {
    let at = r.position();
    match r.peek_kind()? {
        MsgpackKind::Int => Ok(EngineHash::new(match r.int()? {
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
            Ok(EngineHash::new(u64::from_be_bytes(tail)))
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
