//! The one encoder of vLLM-shaped payloads: an [`EventBatch`] written as vLLM publishes it
//! (`[ts, events, data_parallel_rank]`), for loadgen, the lab's simulated pods, the benchmarks
//! and the tests. Events are maps (`{"type": tag, field: value}`, vLLM >= 0.24, [`encode_batch`])
//! or arrays (`[tag, field...]` in declaration order, vLLM <= 0.23, [`WireForm::Array`]).
//!
//! Invariant: `decode_batch(&encode_batch_as(b, form)) == b` for every batch whose events the
//! decoder knows, in both forms (checked in the tests). In map form optional fields are written
//! only when present; in array form every field up to the last present one is written, nil
//! where absent, as a release whose struct ends there sends it.

use rmp::encode as mp;

use super::{BlockRemoved, BlockStored, EventBatch, KvEvent, MsgpackValue};

// Writing into a Vec<u8> cannot fail: rmp's errors come from the writer only.
fn str(out: &mut Vec<u8>, s: &str) {
    let _ = mp::write_str(out, s);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = mp::write_uint(out, v);
}

fn int(out: &mut Vec<u8>, v: i64) {
    let _ = mp::write_sint(out, v);
}

fn nil(out: &mut Vec<u8>) {
    let _ = mp::write_nil(out);
}

fn array_len(out: &mut Vec<u8>, len: usize) {
    let _ = mp::write_array_len(out, len as u32);
}

fn map_len(out: &mut Vec<u8>, len: usize) {
    let _ = mp::write_map_len(out, len as u32);
}

fn u32s(out: &mut Vec<u8>, values: &[u32]) {
    array_len(out, values.len());
    for &v in values {
        uint(out, u64::from(v));
    }
}

fn value(out: &mut Vec<u8>, v: &MsgpackValue) {
    match v {
        MsgpackValue::Nil => nil(out),
        MsgpackValue::Bool(b) => {
            let _ = mp::write_bool(out, *b);
        }
        MsgpackValue::UInt(u) => uint(out, *u),
        MsgpackValue::Int(i) => int(out, *i),
        MsgpackValue::Float(f) => {
            let _ = mp::write_f64(out, *f);
        }
        MsgpackValue::Str(s) => str(out, s),
        MsgpackValue::Bytes(b) => {
            let _ = mp::write_bin(out, b);
        }
        MsgpackValue::Array(items) => {
            array_len(out, items.len());
            items.iter().for_each(|i| value(out, i));
        }
        MsgpackValue::Map(pairs) => {
            map_len(out, pairs.len());
            for (k, v) in pairs {
                value(out, k);
                value(out, v);
            }
        }
    }
}

/// How events are laid out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireForm {
    /// `{"type": tag, field: value}`: vLLM >= 0.24 (msgspec `array_like=False`).
    Map,
    /// `[tag, field...]` in declaration order: vLLM <= 0.23.
    Array,
}

/// Writes one event's fields in either form: in map form a field is a key and a value, written
/// only when present; in array form a present field is written after nils for the absent fields
/// before it.
struct Fields<'a> {
    out: &'a mut Vec<u8>,
    form: WireForm,
    /// Fields written (map form: entries; array form: elements).
    count: usize,
    /// Array form: absent fields not yet written.
    pending_nils: usize,
}

impl<'a> Fields<'a> {
    fn new(out: &'a mut Vec<u8>, form: WireForm) -> Self {
        Self {
            out,
            form,
            count: 0,
            pending_nils: 0,
        }
    }

    fn field<T>(&mut self, key: &str, v: Option<T>, write: impl FnOnce(&mut Vec<u8>, T)) {
        let Some(v) = v else {
            self.pending_nils += 1;
            return;
        };
        match self.form {
            WireForm::Map => str(self.out, key),
            WireForm::Array => {
                for _ in 0..self.pending_nils {
                    nil(self.out);
                }
                self.count += self.pending_nils;
                self.pending_nils = 0;
            }
        }
        write(self.out, v);
        self.count += 1;
    }
}

/// Writes the container header for `body` (whose fields `count`s) and the body.
fn container(out: &mut Vec<u8>, form: WireForm, count: usize, body: &[u8]) {
    match form {
        WireForm::Map => map_len(out, count),
        WireForm::Array => array_len(out, count),
    }
    out.extend_from_slice(body);
}

/// The event's type tag: a `type` entry in map form, the first element in array form.
fn tag(f: &mut Fields<'_>, tag: &str) {
    f.field("type", Some(tag), str);
}

fn stored(out: &mut Vec<u8>, s: &BlockStored, form: WireForm) {
    let mut body = Vec::new();
    let mut f = Fields::new(&mut body, form);
    tag(&mut f, "BlockStored");
    f.field("block_hashes", Some(&s.block_hashes), |o, v| {
        array_len(o, v.len());
        v.iter().for_each(|h| uint(o, h.get()));
    });
    // vLLM always sends the parent, nil at the prompt's start.
    f.field(
        "parent_block_hash",
        Some(s.parent_block_hash),
        |o, v| match v {
            Some(h) => uint(o, h.get()),
            None => nil(o),
        },
    );
    f.field("token_ids", Some(&s.token_ids), |o, v| u32s(o, v));
    f.field("block_size", Some(s.block_size), |o, v| {
        uint(o, u64::from(v))
    });
    f.field("lora_id", s.lora_id, int);
    f.field("medium", s.medium.as_ref(), |o, v| str(o, v.as_str()));
    f.field("lora_name", s.lora_name.as_deref(), str);
    f.field("extra_keys", s.extra_keys.as_ref(), |o, keys| {
        array_len(o, keys.len());
        for k in keys {
            match k {
                Some(v) => value(o, v),
                None => nil(o),
            }
        }
    });
    f.field("group_idx", s.group_idx, int);
    f.field("kv_cache_spec_kind", s.kv_cache_spec_kind.as_deref(), str);
    f.field(
        "kv_cache_spec_sliding_window",
        s.kv_cache_spec_sliding_window,
        int,
    );
    f.field("locality", s.locality.as_deref(), str);
    f.field("ownership", s.ownership.as_deref(), str);
    f.field("session_id", s.session_id.as_deref(), str);
    f.field(
        "lookahead_token_ids",
        s.lookahead_token_ids.as_ref(),
        |o, rows| {
            array_len(o, rows.len());
            rows.iter().for_each(|r| u32s(o, r));
        },
    );
    f.field("cache_salt", s.cache_salt.as_deref(), str);
    let count = f.count;
    container(out, form, count, &body);
}

fn removed(out: &mut Vec<u8>, r: &BlockRemoved, form: WireForm) {
    let mut body = Vec::new();
    let mut f = Fields::new(&mut body, form);
    tag(&mut f, "BlockRemoved");
    f.field("block_hashes", Some(&r.block_hashes), |o, v| {
        array_len(o, v.len());
        v.iter().for_each(|h| uint(o, h.get()));
    });
    f.field("medium", r.medium.as_ref(), |o, v| str(o, v.as_str()));
    f.field("group_idx", r.group_idx, int);
    f.field("locality", r.locality.as_deref(), str);
    f.field("ownership", r.ownership.as_deref(), str);
    let count = f.count;
    container(out, form, count, &body);
}

fn tag_only(out: &mut Vec<u8>, name: &str, form: WireForm) {
    let mut body = Vec::new();
    let mut f = Fields::new(&mut body, form);
    tag(&mut f, name);
    let count = f.count;
    container(out, form, count, &body);
}

/// Encodes `batch` as vLLM >= 0.24 publishes it (map-form events).
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    encode_batch_as(batch, WireForm::Map)
}

/// Encodes `batch` with events in `form`. An [`KvEvent::Unknown`] is written with only its type
/// tag.
pub fn encode_batch_as(batch: &EventBatch, form: WireForm) -> Vec<u8> {
    let mut out = Vec::new();
    array_len(&mut out, 3);
    let _ = mp::write_f64(&mut out, batch.ts);
    array_len(&mut out, batch.events.len());
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(s) => stored(&mut out, s, form),
            KvEvent::BlockRemoved(r) => removed(&mut out, r, form),
            KvEvent::AllBlocksCleared => tag_only(&mut out, "AllBlocksCleared", form),
            KvEvent::Unknown(name) => tag_only(&mut out, name, form),
        }
    }
    match batch.data_parallel_rank {
        Some(rank) => int(&mut out, rank),
        None => nil(&mut out),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::encode::{encode_batch_as, WireForm};
    use crate::events::{decode_batch, Medium};
    use crate::EngineHash;

    fn hashes(v: &[u64]) -> Vec<EngineHash> {
        v.iter().copied().map(EngineHash::new).collect()
    }

    #[test]
    fn array_form_writes_nils_up_to_the_last_present_field() {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: hashes(&[1]),
                block_size: 16,
                group_idx: Some(0),
                ..Default::default()
            }))],
            data_parallel_rank: None,
        };
        let bytes = encode_batch_as(&batch, WireForm::Array);
        // [ts, [[tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name,
        //   extra_keys, group_idx]], nil]: tag + 9 fields.
        let mut r = crate::events::msgpack::Reader::new(&bytes);
        assert_eq!(r.array_len().expect("batch"), 3);
        r.skip().expect("ts");
        assert_eq!(r.array_len().expect("events"), 1);
        assert_eq!(r.array_len().expect("event"), 10);
        assert_eq!(decode_batch(&bytes).expect("decodes"), batch);
    }

    #[test]
    fn every_field_round_trips_through_the_decoder() {
        let full = BlockStored {
            block_hashes: hashes(&[1, u64::MAX, 1 << 40]),
            parent_block_hash: Some(EngineHash::new(7)),
            token_ids: (0..48).collect(),
            block_size: 16,
            lora_id: Some(-3),
            medium: Some(Medium::Cpu),
            lora_name: Some("adapter".into()),
            extra_keys: Some(vec![
                Some(MsgpackValue::Array(vec![
                    MsgpackValue::Str("salt".into()),
                    MsgpackValue::UInt(9),
                ])),
                None,
                Some(MsgpackValue::Map(vec![(
                    MsgpackValue::Str("k".into()),
                    MsgpackValue::Float(0.5),
                )])),
            ]),
            group_idx: Some(1),
            kv_cache_spec_kind: Some("full_attention".into()),
            kv_cache_spec_sliding_window: Some(4096),
            locality: Some("local".into()),
            ownership: Some("owned".into()),
            session_id: Some("s".into()),
            lookahead_token_ids: Some(vec![vec![1, 2], vec![]]),
            cache_salt: None,
        };
        let batch = EventBatch {
            ts: 1.7e9,
            events: vec![
                KvEvent::BlockStored(Box::new(full)),
                KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes(&[5]),
                    block_size: 16,
                    ..Default::default()
                })),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes(&[1]),
                    medium: Some(Medium::Other("NVME".into())),
                    group_idx: Some(0),
                    ..Default::default()
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(3),
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).expect("decodes"), batch);
        let no_rank = EventBatch {
            data_parallel_rank: None,
            ..batch
        };
        assert_eq!(
            decode_batch(&encode_batch(&no_rank)).expect("decodes"),
            no_rank
        );
    }
}
