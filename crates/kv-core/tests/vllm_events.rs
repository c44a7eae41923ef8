//! The event decoder against payloads captured from vLLM's real ZMQ publisher
//! (`tests/fixtures/vllm/zmq_messages.vllm-*.json`): every message of every version decodes, and
//! every field equals the JSON `decoded` form vLLM's own msgspec produced.

use kv_core::{decode_batch, BlockRemoved, BlockStored, KvEvent, MsgpackValue as Ev};
use serde_json::{json, Value};

const VERSIONS: [&str; 6] = ["0.10.1", "0.11.0", "0.23.0", "0.24.0", "0.28.0", "0.33.0"];
const STORED: [&str; 15] = [
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
const REMOVED: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn load(version: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/vllm/zmq_messages.vllm-{version}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("json")
}

/// A hash as the fixtures write it, reduced to the index key.
fn want_hash(v: &Value) -> Value {
    match v.get("bytes_hex").and_then(Value::as_str) {
        Some(h) => {
            let b = unhex(h);
            let mut tail = [0u8; 8];
            tail.copy_from_slice(&b[b.len() - 8..]);
            json!(u64::from_be_bytes(tail))
        }
        None => v.clone(),
    }
}

fn want_field(name: &str, v: &Value) -> Value {
    match name {
        "block_hashes" => Value::Array(v.as_array().expect("list").iter().map(want_hash).collect()),
        "parent_block_hash" if !v.is_null() => want_hash(v),
        _ => v.clone(),
    }
}

fn value_json(v: &Ev) -> Value {
    match v {
        Ev::Nil => Value::Null,
        Ev::Bool(b) => json!(b),
        Ev::UInt(u) => json!(u),
        Ev::Int(i) => json!(i),
        Ev::Float(f) => json!(f),
        Ev::Str(s) => json!(s),
        Ev::Bytes(b) => {
            json!({"bytes_hex": b.iter().map(|x| format!("{x:02x}")).collect::<String>()})
        }
        Ev::Array(a) => Value::Array(a.iter().map(value_json).collect()),
        Ev::Map(m) => Value::Array(
            m.iter()
                .map(|(k, v)| json!([value_json(k), value_json(v)]))
                .collect(),
        ),
    }
}

fn stored_field(e: &BlockStored, name: &str) -> Value {
    match name {
        "block_hashes" => json!(e.block_hashes),
        "parent_block_hash" => json!(e.parent_block_hash),
        "token_ids" => json!(e.token_ids),
        "block_size" => json!(e.block_size),
        "lora_id" => json!(e.lora_id),
        "medium" => json!(e.medium.as_ref().map(|m| m.as_str().to_owned())),
        "lora_name" => json!(e.lora_name),
        "extra_keys" => match &e.extra_keys {
            None => Value::Null,
            Some(k) => Value::Array(
                k.iter()
                    .map(|x| x.as_ref().map_or(Value::Null, value_json))
                    .collect(),
            ),
        },
        "group_idx" => json!(e.group_idx),
        "kv_cache_spec_kind" => json!(e.kv_cache_spec_kind),
        "kv_cache_spec_sliding_window" => json!(e.kv_cache_spec_sliding_window),
        "locality" => json!(e.locality),
        "ownership" => json!(e.ownership),
        "session_id" => json!(e.session_id),
        "lookahead_token_ids" => json!(e.lookahead_token_ids),
        other => panic!("unknown field {other}"),
    }
}

fn removed_field(e: &BlockRemoved, name: &str) -> Value {
    match name {
        "block_hashes" => json!(e.block_hashes),
        "medium" => json!(e.medium.as_ref().map(|m| m.as_str().to_owned())),
        "group_idx" => json!(e.group_idx),
        "locality" => json!(e.locality),
        "ownership" => json!(e.ownership),
        other => panic!("unknown field {other}"),
    }
}

/// (field name, expected value) pairs of one decoded event, for both wire forms.
fn fields_of<'a>(want: &'a Value, names: &[&'a str]) -> Vec<(&'a str, &'a Value)> {
    match want {
        Value::Array(items) => names.iter().copied().zip(items.iter().skip(1)).collect(),
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| k.as_str() != "type")
            .map(|(k, v)| (k.as_str(), v))
            .collect(),
        other => panic!("event is neither array nor map: {other}"),
    }
}

fn tag_of(want: &Value) -> &str {
    match want {
        Value::Array(items) => items[0].as_str().expect("tag"),
        other => other["type"].as_str().expect("type"),
    }
}

fn check_event(ctx: &str, got: &KvEvent, want: &Value) -> usize {
    let tag = tag_of(want);
    assert_eq!(got.type_label(), tag, "{ctx}: event type");
    let mut compared = 0;
    match got {
        KvEvent::BlockStored(e) => {
            let fields = fields_of(want, &STORED);
            for (name, v) in &fields {
                assert_eq!(stored_field(e, name), want_field(name, v), "{ctx}: {name}");
                compared += 1;
            }
            // Fields the wire omitted must be at their defaults.
            for name in STORED
                .iter()
                .filter(|n| !fields.iter().any(|(f, _)| f == *n))
            {
                assert_eq!(stored_field(e, name), Value::Null, "{ctx}: omitted {name}");
            }
        }
        KvEvent::BlockRemoved(e) => {
            for (name, v) in fields_of(want, &REMOVED) {
                assert_eq!(removed_field(e, name), want_field(name, v), "{ctx}: {name}");
                compared += 1;
            }
        }
        KvEvent::AllBlocksCleared => {}
        KvEvent::Unknown(t) => panic!("{ctx}: unknown event {t}"),
    }
    compared
}

#[test]
fn every_captured_message_decodes_to_what_vllm_sent() {
    let mut messages = 0;
    let mut fields = 0;
    for version in VERSIONS {
        let doc = load(version);
        for scenario in doc["scenarios"].as_array().expect("scenarios") {
            let name = scenario["name"].as_str().expect("name");
            for msg in scenario["messages"].as_array().into_iter().flatten() {
                let frames = msg["frames_hex"].as_array().expect("frames");
                assert_eq!(frames.len(), 3, "{version} {name}: [topic, seq, payload]");
                let payload = unhex(frames[2].as_str().expect("payload"));
                let batch =
                    decode_batch(&payload).unwrap_or_else(|e| panic!("{version} {name}: {e}"));
                let want = &msg["decoded"];
                assert_eq!(
                    batch.ts,
                    want[0].as_f64().expect("ts"),
                    "{version} {name}: ts"
                );
                let want_events = want[1].as_array().expect("events");
                assert_eq!(batch.events.len(), want_events.len(), "{version} {name}");
                for (i, (got, w)) in batch.events.iter().zip(want_events).enumerate() {
                    fields += check_event(&format!("{version} {name} event {i}"), got, w);
                }
                assert_eq!(
                    batch.data_parallel_rank,
                    want.get(2).and_then(Value::as_i64),
                    "{version} {name}: dp rank"
                );
                messages += 1;
            }
            // Replayed batches (DEALER side): every non-end-marker frame set carries a payload.
            for frames in scenario["dealer_received_frames_hex"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let frames = frames.as_array().expect("frames");
                let payload = unhex(frames.last().and_then(Value::as_str).expect("payload"));
                if payload.is_empty() {
                    continue; // end marker
                }
                let batch =
                    decode_batch(&payload).unwrap_or_else(|e| panic!("{version} replay: {e}"));
                assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
                messages += 1;
            }
        }
    }
    eprintln!("decoded {messages} captured payloads, {fields} fields compared");
    assert!(
        messages >= 30,
        "fixtures went missing: only {messages} payloads"
    );
    assert!(fields >= 200, "too few fields compared: {fields}");
}

#[test]
fn bytes_and_int_hashes_decode_to_the_same_keys() {
    let doc = load("0.33.0");
    let payload = |scenario: usize| {
        let s = &doc["scenarios"][scenario]["messages"][0]["frames_hex"][2];
        decode_batch(&unhex(s.as_str().expect("hex"))).expect("decodes")
    };
    let ints = payload(0);
    let bytes = payload(1);
    assert_eq!(ints.events.len(), bytes.events.len());
    for (a, b) in ints.events.iter().zip(&bytes.events) {
        match (a, b) {
            (KvEvent::BlockStored(a), KvEvent::BlockStored(b)) => {
                assert_eq!(a.block_hashes, b.block_hashes);
                assert_eq!(a.parent_block_hash, b.parent_block_hash);
            }
            (KvEvent::BlockRemoved(a), KvEvent::BlockRemoved(b)) => {
                assert_eq!(a.block_hashes, b.block_hashes)
            }
            (a, b) => assert_eq!(a, b),
        }
    }
}
