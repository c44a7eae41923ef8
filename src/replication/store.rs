//! Redis operations: the log (append, read, info, trim) and the snapshot (store, load).
//! Replies are parsed from `redis::Value` here, RESP2 or RESP3 alike.

use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::Value;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::keys::Keys;
use super::snapshot::{checksum, SnapshotError, SnapshotItem, SnapshotReader};
use super::stream::{now_ms, StreamId};
use crate::ingest::{LogEntry, Stamp};
use crate::ingest::{PublisherKey, PublisherState};
use kv_core::Indexer;

/// Snapshot chunk size: large values are split so no single Redis value gets huge.
const CHUNK_BYTES: usize = 4 << 20;
/// How long a replaced snapshot's chunks stay readable (for a reader that started on them).
const OLD_CHUNKS_TTL_SECS: u64 = 120;

/// A failed Redis operation.
#[derive(Debug, Error)]
pub enum StoreError {
    /// Redis answered with an error or not at all.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The snapshot did not decode.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The snapshot's meta or chunks are inconsistent.
    #[error("snapshot: {0}")]
    Inconsistent(String),
}

/// The meta: which chunks make the current snapshot, and what it covers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// Names the chunk keys.
    pub generation: String,
    /// Number of chunks.
    pub chunks: usize,
    /// Total bytes.
    pub bytes: usize,
    /// FNV-1a of the bytes.
    pub checksum: u64,
    /// The log position covered (entries up to and including it).
    pub position: String,
    /// The position of the snapshot this one replaced (the log is kept from there).
    pub previous_position: String,
    /// Memberships held.
    pub memberships: u64,
    /// Entries ever added to the log up to and including `position` (the log's
    /// `entries-added` then), when the writer knew it: lets a replica that loads this snapshot
    /// tell whether entries after it were trimmed away.
    #[serde(default)]
    pub offset: Option<u64>,
    /// When it was written (ms since the epoch).
    pub written_ms: u64,
    /// Who wrote it.
    pub replica: String,
}

/// A snapshot read back.
pub struct Loaded {
    /// Its meta.
    pub meta: SnapshotMeta,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// The log position it covers.
    pub position: StreamId,
}

/// The current snapshot's meta, if any.
pub async fn snapshot_meta(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
) -> Result<Option<SnapshotMeta>, StoreError> {
    let raw: Option<Vec<u8>> = redis::cmd("GET")
        .arg(&keys.snapshot)
        .query_async(conn)
        .await?;
    match raw {
        None => Ok(None),
        Some(raw) => serde_json::from_slice(&raw)
            .map(Some)
            .map_err(|e| StoreError::Inconsistent(format!("meta: {e}"))),
    }
}

/// Reads the current snapshot (retrying when it is replaced while being read).
pub async fn load_snapshot(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
) -> Result<Option<Loaded>, StoreError> {
    let mut last_problem = String::new();
    for _ in 0..3 {
        let Some(meta) = snapshot_meta(conn, keys).await? else {
            return Ok(None);
        };
        let position = StreamId::parse(&meta.position)
            .ok_or_else(|| StoreError::Inconsistent(format!("position {:?}", meta.position)))?;
        let mut bytes = Vec::with_capacity(meta.bytes.min(1 << 30));
        let mut complete = true;
        for i in 0..meta.chunks {
            let chunk: Option<Vec<u8>> = redis::cmd("GET")
                .arg(keys.chunk(&meta.generation, i))
                .query_async(conn)
                .await?;
            match chunk {
                Some(chunk) => bytes.extend_from_slice(&chunk),
                None => {
                    complete = false;
                    break;
                }
            }
        }
        if complete && bytes.len() == meta.bytes && checksum(&[&bytes]) == meta.checksum {
            return Ok(Some(Loaded {
                meta,
                bytes,
                position,
            }));
        }
        last_problem = format!(
            "generation {} incomplete or changed while read ({} of {} bytes)",
            meta.generation,
            bytes.len(),
            meta.bytes
        );
    }
    Err(StoreError::Inconsistent(last_problem))
}

/// What loading a snapshot did.
#[derive(Debug, Default)]
pub struct SnapshotLoad {
    /// The publisher states it carried.
    pub publishers: Vec<(PublisherKey, PublisherState)>,
    /// Memberships restored.
    pub memberships: u64,
    /// Blocks of models that could not be indexed here (e.g. past `maxModels`): not loaded.
    pub dropped_blocks: u64,
    /// Translation-map entries the key budget (`size`) had no room for (the oldest first;
    /// their keys left the index with them).
    pub dropped_entries: u64,
    /// Blocks and map entries of models whose key space (hash seed, block sizes, extra-key
    /// format) differs here from the writer's: keys of another key space, not loaded.
    pub dropped_key_space: u64,
}

impl SnapshotLoad {
    /// Counts what was dropped and says so once (the operator's `size` or `maxModels` is
    /// smaller than the replica's that wrote the snapshot).
    pub fn report(&self, metrics: &crate::metrics::Metrics) {
        metrics
            .ingest
            .dropped("snapshot_model_refused", self.dropped_blocks);
        metrics
            .ingest
            .dropped("snapshot_over_budget", self.dropped_entries);
        metrics
            .ingest
            .dropped("snapshot_key_space", self.dropped_key_space);
        if self.dropped_blocks + self.dropped_entries > 0 {
            tracing::warn!(
                blocks = self.dropped_blocks,
                translation_entries = self.dropped_entries,
                "snapshot: part of it was not loaded (this replica's size or maxModels is smaller than the one that wrote it); raise them to match"
            );
        }
    }
}

/// Loads a snapshot's blocks, key states and publisher states into `indexer`.
pub fn apply_snapshot(bytes: &[u8], indexer: &Indexer) -> Result<SnapshotLoad, StoreError> {
    let mut reader = SnapshotReader::new(bytes)?;
    let mut load = SnapshotLoad::default();
    // Models whose keys in the snapshot are of another key space than this replica's.
    let mut foreign: std::collections::HashSet<String> = Default::default();
    while let Some(item) = reader.next_item()? {
        match item {
            SnapshotItem::KeySpace { model, space } => {
                let here = indexer.model_or_create(model).ok();
                let here = here.map(|m| {
                    let settings = m.key_space();
                    // A model that learned no lookahead takes the one its keys were made with.
                    let lookahead = kv_core::KeySpace {
                        lookahead: space.lookahead,
                        ..settings
                    };
                    if space.lookahead > 0 && lookahead == space {
                        m.adopt_lookahead(space.lookahead);
                    }
                    m.key_space()
                });
                if let Some(here) = here.filter(|here| *here != space) {
                    tracing::error!(
                        model,
                        snapshot_block_size = space.block_size,
                        block_size = here.block_size,
                        same_seed = space.none_hash == here.none_hash,
                        snapshot_lookahead = space.lookahead,
                        lookahead = here.lookahead,
                        "snapshot: this model's keys were made with other hash settings (hashSeed or PYTHONHASHSEED, blockSize, extra-key format, the lookahead its engines hash with) than this replica's; its blocks are not loaded and come back as its pods publish. Replicas sharing a log must hash alike"
                    );
                    foreign.insert(model.to_owned());
                }
            }
            SnapshotItem::Blocks { model, hashes, .. } if foreign.contains(model) => {
                load.dropped_key_space += hashes.len() as u64;
            }
            SnapshotItem::EngineKeys { model, state, .. } if foreign.contains(model) => {
                load.dropped_key_space += state.translated.len() as u64;
            }
            SnapshotItem::Blocks {
                model,
                key,
                tier,
                hashes,
            } => match indexer.import(model, &key, tier, &hashes) {
                Ok(added) => load.memberships += added as u64,
                Err(e) => {
                    load.dropped_blocks += hashes.len() as u64;
                    tracing::warn!(model, error = %e, "snapshot: a model's blocks were not loaded")
                }
            },
            SnapshotItem::Publisher(key, state) => load.publishers.push((key, state)),
            SnapshotItem::EngineKeys { model, key, state } => {
                let entries = state.translated.len() as u64;
                match indexer.import_keys(model, &key, state) {
                    Ok(imported) => load.dropped_entries += imported.dropped as u64,
                    Err(e) => {
                        load.dropped_entries += entries;
                        tracing::warn!(model, error = %e, "snapshot: an engine's key state was not loaded")
                    }
                }
            }
        }
    }
    Ok(load)
}

/// Stores `bytes` as the current snapshot: chunks first, then the meta (one `SET`),
/// then the replaced snapshot's chunks expire and the log is trimmed behind its position.
/// Refuses to replace a snapshot of a later position.
pub async fn save_snapshot(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
    bytes: &[u8],
    position: StreamId,
    offset: Option<u64>,
    memberships: u64,
    replica: &str,
) -> Result<SnapshotMeta, StoreError> {
    let previous = snapshot_meta(conn, keys).await?;
    if let Some(p) = &previous {
        if StreamId::parse(&p.position).is_some_and(|p| p > position) {
            return Err(StoreError::Inconsistent(format!(
                "a newer snapshot (position {}) is already stored; this one ({position}) is not",
                p.position
            )));
        }
    }
    let written_ms = now_ms();
    let generation = format!("{position}.{written_ms}");
    let chunks: Vec<&[u8]> = bytes.chunks(CHUNK_BYTES).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        redis::cmd("SET")
            .arg(keys.chunk(&generation, i))
            .arg(*chunk)
            .query_async::<()>(conn)
            .await?;
    }
    let meta = SnapshotMeta {
        generation,
        chunks: chunks.len(),
        bytes: bytes.len(),
        checksum: checksum(&[bytes]),
        position: position.to_string(),
        previous_position: previous
            .as_ref()
            .map_or_else(|| StreamId::ZERO.to_string(), |p| p.position.clone()),
        memberships,
        offset,
        written_ms,
        replica: replica.to_owned(),
    };
    let text =
        serde_json::to_vec(&meta).map_err(|e| StoreError::Inconsistent(format!("meta: {e}")))?;
    redis::cmd("SET")
        .arg(&keys.snapshot)
        .arg(text)
        .query_async::<()>(conn)
        .await?;
    if let Some(previous) = previous {
        let mut pipe = redis::pipe();
        for i in 0..previous.chunks {
            pipe.cmd("EXPIRE")
                .arg(keys.chunk(&previous.generation, i))
                .arg(OLD_CHUNKS_TTL_SECS)
                .ignore();
        }
        // Keep one interval of log behind the new snapshot: replicas slightly behind it go
        // on reading instead of reloading. (Followers notice a trim past their position by
        // counting entries: see `LogInfo`.) Exact, not `~`: an approximate trim removes at
        // most 10,000 entries a call, fewer than one interval holds at 300k blocks/s (2,400
        // entries/s), and the log grew without end.
        pipe.cmd("XTRIM")
            .arg(&keys.log)
            .arg("MINID")
            .arg(&previous.position)
            .ignore();
        pipe.query_async::<()>(conn).await?;
    }
    Ok(meta)
}

/// Takes the snapshot lock for `ttl` if nobody holds it.
pub async fn try_lock(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
    holder: &str,
    ttl: std::time::Duration,
) -> Result<bool, StoreError> {
    let reply: Option<String> = redis::cmd("SET")
        .arg(&keys.lock)
        .arg(holder)
        .arg("NX")
        .arg("PX")
        .arg(ttl.as_millis().max(1) as u64)
        .query_async(conn)
        .await?;
    Ok(reply.is_some())
}

/// Appends a batch of entries in one script call ([`APPEND_SCRIPT`]): one command, so Redis
/// runs it whole or (loading, down) not at all, and a failure inside it leaves a prefix of the
/// batch. The appender then retries the whole batch, so each publisher's entries stay in order
/// in the log (a retried prefix reads as duplicates). A pipeline of one XADD per entry could
/// fail its first commands (Redis still loading its dump after a restart) and run the rest:
/// the retry then put the first entries after the later ones, and the other replicas counted
/// the gap as lost (the soak's second Redis restart: 103 messages).
pub async fn append(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
    entries: &[LogEntry],
    replica: &str,
    instance: &str,
    max_len: u64,
) -> Result<(), StoreError> {
    let mut script = redis::cmd("EVAL");
    script.arg(APPEND_SCRIPT).arg(1).arg(&keys.log).arg(max_len);
    for entry in entries {
        let mut f = XaddFields::default();
        f.put("r", replica).put("i", instance);
        match entry {
            LogEntry::Message {
                pod,
                model,
                seq,
                stamp,
                payload,
            } => {
                f.put("k", "m")
                    .put("p", &**pod)
                    .put("o", &**model)
                    .put("s", *seq);
                if let Some(stamp) = stamp {
                    // The timestamp's bits, exactly (a decimal rendering could round).
                    f.put("n", stamp.rank).put("t", stamp.ts.to_bits());
                }
                f.put("d", &payload[..]);
            }
            LogEntry::ClearPod { model, pod } => {
                f.put("k", "c").put("p", &**pod).put("o", &**model);
            }
            LogEntry::Speculate {
                model,
                pod,
                rank,
                hashes,
            } => {
                let bytes: Vec<u8> = hashes.iter().flat_map(|h| h.get().to_be_bytes()).collect();
                f.put("k", "x")
                    .put("p", &**pod)
                    .put("o", &**model)
                    .put("h", bytes);
                // Absent (read as rank 0) from releases before ranks were recorded.
                if *rank > 0 {
                    f.put("n", *rank);
                }
            }
        }
        script.arg(f.0.len()).arg(f.0);
    }
    script.query_async::<()>(conn).await?;
    Ok(())
}

/// One log entry's field arguments, in the order XADD takes them.
#[derive(Default)]
struct XaddFields(Vec<Vec<u8>>);

impl XaddFields {
    fn put(&mut self, name: &str, value: impl redis::ToRedisArgs) -> &mut Self {
        self.0.push(name.as_bytes().to_vec());
        self.0.extend(value.to_redis_args());
        self
    }
}

/// XADDs its arguments' entries in order: `ARGV[1]` is the log's length cap, then each entry
/// is a count of field arguments followed by them.
const APPEND_SCRIPT: &str = r"
local cap = ARGV[1]
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', cap, '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return 0
";

/// One log entry read, with where it came from.
pub struct LoggedEntry {
    /// Its id.
    pub id: StreamId,
    /// The process that appended it.
    pub instance: Bytes,
    /// The replica that appended it.
    pub replica: std::sync::Arc<str>,
    /// What it says; `None` when it does not decode (counted, skipped).
    pub entry: Option<LogEntry>,
}

/// Reads up to `count` entries after `after`; with `block`, waits up to that long for new ones.
pub async fn read(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
    after: StreamId,
    count: usize,
    block: Option<std::time::Duration>,
) -> Result<Vec<LoggedEntry>, StoreError> {
    let mut cmd = redis::cmd("XREAD");
    cmd.arg("COUNT").arg(count);
    if let Some(block) = block {
        cmd.arg("BLOCK").arg(block.as_millis() as u64);
    }
    let reply: Value = cmd
        .arg("STREAMS")
        .arg(&keys.log)
        .arg(after.to_string())
        .query_async(conn)
        .await?;
    let mut out = Vec::new();
    // [[key, [[id, [field, value, ...]], ...]]] (RESP2) or {key: [...]} (RESP3); Nil on timeout.
    let streams: Vec<Value> = match reply {
        Value::Nil => return Ok(out),
        Value::Array(items) => items,
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        other => {
            return Err(StoreError::Inconsistent(format!(
                "unexpected XREAD reply {other:?}"
            )))
        }
    };
    for stream in streams {
        let Value::Array(mut parts) = stream else {
            continue;
        };
        let Some(Value::Array(entries)) = parts.pop() else {
            continue;
        };
        for entry in entries {
            let Value::Array(mut pair) = entry else {
                continue;
            };
            if pair.len() != 2 {
                continue;
            }
            let fields = pair.pop().unwrap_or(Value::Nil);
            let Some(id) = pair
                .pop()
                .and_then(|v| text(&v))
                .and_then(|t| StreamId::parse(&t))
            else {
                continue;
            };
            let fields = Fields::of(fields);
            out.push(LoggedEntry {
                id,
                instance: fields.instance.clone().unwrap_or_default(),
                replica: fields.text(&fields.replica).unwrap_or("").into(),
                entry: fields.entry(),
            });
        }
    }
    Ok(out)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn count(v: Value) -> u64 {
    match v {
        Value::Int(i) => i.max(0) as u64,
        other => text(&other).and_then(|t| t.parse().ok()).unwrap_or(0),
    }
}

/// A flat `[k, v, k, v...]` array (RESP2) or a map (RESP3) as pairs.
fn pairs(value: Value) -> Vec<(Value, Value)> {
    match value {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let mut pairs = Vec::new();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                pairs.push((k, v));
            }
            pairs
        }
        Value::Map(pairs) => pairs,
        _ => Vec::new(),
    }
}

/// An entry's fields, by the one-letter names `append` writes; unknown fields are ignored.
#[derive(Default)]
struct Fields {
    instance: Option<Bytes>,
    replica: Option<Bytes>,
    kind: Option<Bytes>,
    pod: Option<Bytes>,
    model: Option<Bytes>,
    seq: Option<Bytes>,
    rank: Option<Bytes>,
    ts: Option<Bytes>,
    payload: Option<Bytes>,
    hashes: Option<Bytes>,
}

impl Fields {
    fn of(value: Value) -> Self {
        let mut f = Self::default();
        for (k, v) in pairs(value) {
            let v = match v {
                Value::BulkString(b) => Bytes::from(b),
                Value::SimpleString(s) => Bytes::from(s.into_bytes()),
                _ => continue,
            };
            let slot = match &k {
                Value::BulkString(name) => match name.as_slice() {
                    b"i" => &mut f.instance,
                    b"r" => &mut f.replica,
                    b"k" => &mut f.kind,
                    b"p" => &mut f.pod,
                    b"o" => &mut f.model,
                    b"s" => &mut f.seq,
                    b"n" => &mut f.rank,
                    b"t" => &mut f.ts,
                    b"d" => &mut f.payload,
                    b"h" => &mut f.hashes,
                    _ => continue,
                },
                _ => continue,
            };
            *slot = Some(v);
        }
        f
    }

    fn text<'a>(&self, field: &'a Option<Bytes>) -> Option<&'a str> {
        std::str::from_utf8(field.as_deref()?).ok()
    }

    fn entry(&self) -> Option<LogEntry> {
        let name = |field: &Option<Bytes>| -> Option<std::sync::Arc<str>> {
            self.text(field).filter(|t| !t.is_empty()).map(Into::into)
        };
        let pod = name(&self.pod)?;
        let model = name(&self.model)?;
        match self.kind.as_deref() {
            Some(b"m") => Some(LogEntry::Message {
                pod,
                model,
                seq: self.text(&self.seq)?.parse().ok()?,
                stamp: match (self.text(&self.rank), self.text(&self.ts)) {
                    (Some(rank), Some(ts)) => Some(Stamp {
                        rank: rank.parse().ok()?,
                        ts: f64::from_bits(ts.parse().ok()?),
                    }),
                    _ => None,
                },
                payload: self.payload.clone()?,
            }),
            Some(b"c") => Some(LogEntry::ClearPod { model, pod }),
            Some(b"x") => {
                let bytes = self.hashes.as_deref()?;
                if bytes.is_empty() || bytes.len() % 8 != 0 {
                    return None;
                }
                let hashes = bytes
                    .chunks_exact(8)
                    .map(|c| {
                        let mut word = [0u8; 8];
                        word.copy_from_slice(c);
                        kv_core::BlockHash::new(u64::from_be_bytes(word))
                    })
                    .collect();
                let rank = match self.text(&self.rank) {
                    Some(rank) => rank.parse().ok()?,
                    None => 0,
                };
                Some(LogEntry::Speculate {
                    model,
                    pod,
                    rank,
                    hashes,
                })
            }
            _ => None,
        }
    }
}

/// What `XINFO STREAM` says of the log.
#[derive(Debug, Default, Clone, Copy)]
pub struct LogInfo {
    /// The newest entry's id.
    pub last_id: StreamId,
    /// Entries ever added (nothing is ever deleted but by trimming from the front).
    pub entries_added: u64,
    /// Entries in the log now. A reader that has seen `k` of the `entries_added` knows that
    /// `entries_added - k` entries follow its position; fewer than that in the log means
    /// some were trimmed away. (Redis 7.0 does not record trimmed ids in
    /// `max-deleted-entry-id`, so the count is the signal.)
    pub length: u64,
}

/// The log's state; an absent log is an empty one.
pub async fn log_info(
    conn: &mut MultiplexedConnection,
    keys: &Keys,
) -> Result<LogInfo, StoreError> {
    let reply: redis::RedisResult<Value> = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(&keys.log)
        .query_async(conn)
        .await;
    let reply = match reply {
        Ok(v) => v,
        Err(e) if e.to_string().to_ascii_lowercase().contains("no such key") => {
            return Ok(LogInfo::default())
        }
        Err(e) => return Err(e.into()),
    };
    let mut info = LogInfo::default();
    for (k, v) in pairs(reply) {
        match text(&k).as_deref() {
            Some("last-generated-id") => {
                info.last_id = text(&v)
                    .and_then(|t| StreamId::parse(&t))
                    .unwrap_or_default()
            }
            Some("length") => info.length = count(v),
            Some("entries-added") => info.entries_added = count(v),
            _ => {}
        }
    }
    Ok(info)
}
