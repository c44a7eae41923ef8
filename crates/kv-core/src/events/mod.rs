//! vLLM KV-cache events: the `KVEventBatch` msgpack payload of a ZMQ message, decoded.
//!
//! Wire format (`docs/vllm-compatibility.md` §1, §2): a batch is the array `[ts, events, data_parallel_rank?]`;
//! an event is an array `[tag, field...]` (vLLM <= 0.23) or a map `{"type": tag, field: value}`
//! (vLLM >= 0.24). Hashes are u64 (default), signed ints (0.9 `builtin`) or byte strings (32 raw
//! digest bytes, or 64+ for concatenated hybrid-group hashes): an [`EngineHash`] is always the
//! last 8 bytes, big-endian. Events carry what the engine published, never index keys.
//!
//! Invariants: decoding never panics; malformed input yields a [`DecodeError`] whose
//! [`DecodeError::reason`] is a bounded metric label; unknown fields, extra trailing array
//! elements and unknown event types are tolerated (forward compatibility), the latter surfacing as
//! [`KvEvent::Unknown`] so callers can count them.

mod decode;
mod encode;
pub(crate) mod msgpack;

pub use decode::decode_batch;
pub use encode::{encode_batch, encode_batch_as, WireForm};

pub use msgpack::MsgpackKind;

use crate::EngineHash;
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
    /// Nesting beyond the decoder's depth bound (`msgpack::MAX_DEPTH`, 32 levels).
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
    /// CPU offload (vLLM's `"CPU"`, SGLang's `"CPU_PINNED"`).
    Cpu,
    /// Storage offload (vLLM's `"STORAGE"`, SGLang's `"DISK"`).
    Storage,
    /// Any other tier a connector names.
    Other(Box<str>),
}

impl Medium {
    /// Parses vLLM's medium string (case-insensitive for the known tiers).
    pub fn parse(s: &str) -> Self {
        if s.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if s.eq_ignore_ascii_case("CPU") || s.eq_ignore_ascii_case("CPU_PINNED") {
            Medium::Cpu
        } else if s.eq_ignore_ascii_case("STORAGE") || s.eq_ignore_ascii_case("DISK") {
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
    /// The run's block hashes as the engine published them, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// The engine's hash of the block the run continues; `None` when it starts at the
    /// prompt's start.
    pub parent_block_hash: Option<EngineHash>,
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
    /// SGLang: the salt of the request that stored the run (vLLM carries it in `extra_keys`).
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks an engine evicted (vLLM sends one event per evicted hash).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The evicted hashes, as the engine published them.
    pub block_hashes: Vec<EngineHash>,
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

impl EventBatch {
    /// One `BlockStored` run of `hashes` on the GPU tier (`block_size` tokens each, no parent),
    /// published at `ts` by the engine of data-parallel rank `rank`: the batch tests,
    /// benchmarks and simulations send when they speak vLLM's wire format.
    pub fn stored_on_gpu(ts: f64, rank: i64, hashes: &[EngineHash], block_size: u32) -> Self {
        Self {
            ts,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: hashes.to_vec(),
                block_size,
                medium: Some(Medium::Gpu),
                ..Default::default()
            }))],
            data_parallel_rank: Some(rank),
        }
    }

    /// The data-parallel rank of the engine that published the batch: absent means rank 0
    /// (vLLM before 0.10, or no data parallelism). The one conversion from the wire's
    /// integer: a rank that is negative or above [`MAX_DATA_PARALLEL_RANK`] is an error
    /// (counted and dropped by the caller), never read as rank 0.
    pub fn rank(&self) -> Result<u32, RankOutOfRange> {
        match self.data_parallel_rank {
            None => Ok(0),
            Some(r) => u32::try_from(r)
                .ok()
                .filter(|&r| r <= MAX_DATA_PARALLEL_RANK)
                .ok_or(RankOutOfRange(r)),
        }
    }
}

/// The highest data-parallel rank a batch may name. vLLM deployments run tens of ranks at
/// most; a larger value is a broken or hostile publisher, and each rank is an engine the
/// index keeps state for.
pub const MAX_DATA_PARALLEL_RANK: u32 = 65_535;

/// A batch named a data-parallel rank outside `0..=MAX_DATA_PARALLEL_RANK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("data_parallel_rank {0} is out of range (0..={MAX_DATA_PARALLEL_RANK})")]
pub struct RankOutOfRange(pub i64);
