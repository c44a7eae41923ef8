//! Bad input never panics the decoder: every prefix, thousands of byte mutations of real vLLM
//! payloads, and random bytes all decode or fail with a typed, labelled error.

mod support;

use kv_core::{decode_batch, DecodeError};
use support::Rng;

fn real_payloads() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for version in ["0.10.1", "0.11.0", "0.23.0", "0.24.0", "0.28.0", "0.33.0"] {
        let doc = support::fixture(&format!("vllm/zmq_messages.vllm-{version}.json"));
        for s in doc["scenarios"].as_array().expect("scenarios") {
            for m in s["messages"].as_array().into_iter().flatten() {
                out.push(support::unhex(m["frames_hex"][2].as_str().expect("hex")));
            }
        }
    }
    out
}

const REASONS: [&str; 11] = [
    "truncated",
    "unexpected_type",
    "invalid_utf8",
    "out_of_range",
    "too_deep",
    "short_hash",
    "missing_field",
    "batch_too_short",
    "missing_tag",
    "trailing_bytes",
    "too_large",
];

fn check(bytes: &[u8], seen: &mut std::collections::BTreeSet<&'static str>) {
    if let Err(e) = decode_batch(bytes) {
        assert!(REASONS.contains(&e.reason()), "{e}");
        assert!(!e.to_string().is_empty());
        seen.insert(e.reason());
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    for p in real_payloads() {
        for cut in 0..p.len() {
            let e = decode_batch(&p[..cut]).expect_err("a strict prefix is incomplete");
            assert!(
                matches!(
                    e,
                    DecodeError::Truncated { .. } | DecodeError::BatchTooShort { .. }
                ),
                "{e}"
            );
        }
        let mut longer = p.clone();
        longer.push(0);
        assert!(matches!(
            decode_batch(&longer),
            Err(DecodeError::TrailingBytes { extra: 1 })
        ));
    }
}

#[test]
fn mutated_and_random_payloads_never_panic() {
    let payloads = real_payloads();
    let mut rng = Rng::new(2026);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..20_000 {
        let mut p = payloads[rng.below(payloads.len() as u64) as usize].clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(p.len() as u64) as usize;
            p[at] = rng.next_u64() as u8;
        }
        check(&p, &mut seen);
    }
    for _ in 0..20_000 {
        let len = rng.below(64) as usize;
        let mut p: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        if !p.is_empty() {
            p[0] = 0x93; // a 3-element array, so decoding goes past the first byte
        }
        check(&p, &mut seen);
    }
    assert!(seen.len() >= 5, "mutations reached only {seen:?}");
}

#[test]
fn unknown_event_types_and_fields_are_tolerated() {
    // [1.0, [{"type": "BlockPinned", "x": 1}, ["FutureEvent", 1, 2], {"type": "AllBlocksCleared", "new_field": [1]}], 0, "extra"]
    let mut p = vec![0x94, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.push(0x93);
    p.extend_from_slice(&[0x82, 0xa4]);
    p.extend_from_slice(b"type");
    p.push(0xab);
    p.extend_from_slice(b"BlockPinned");
    p.extend_from_slice(&[0xa1, b'x', 0x01]);
    p.extend_from_slice(&[0x93, 0xab]);
    p.extend_from_slice(b"FutureEvent");
    p.extend_from_slice(&[0x01, 0x02]);
    p.extend_from_slice(&[0x82, 0xa4]);
    p.extend_from_slice(b"type");
    p.push(0xb0);
    p.extend_from_slice(b"AllBlocksCleared");
    p.push(0xa9);
    p.extend_from_slice(b"new_field");
    p.extend_from_slice(&[0x91, 0x01]);
    p.extend_from_slice(&[0x00, 0xa5]);
    p.extend_from_slice(b"extra");
    let batch = decode_batch(&p).expect("forward compatible");
    let labels: Vec<_> = batch.events.iter().map(|e| e.type_label()).collect();
    assert_eq!(labels, ["unknown", "unknown", "AllBlocksCleared"]);
    assert_eq!(batch.data_parallel_rank, Some(0));
}

/// Payloads crafted to multiply memory: 16 MB of nil `extra_keys` (each nil would decode into
/// a 32-byte value), 16 MB of one-byte hashes (8 bytes each), a million tiny events. Each is
/// refused before it allocates more than its budget (6x its size).
#[test]
fn payloads_that_would_multiply_memory_are_refused() {
    fn map_event(key: &str, elements: usize, element: u8) -> Vec<u8> {
        let mut p = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
        p.push(0x83);
        p.push(0xa4);
        p.extend_from_slice(b"type");
        p.push(0xab);
        p.extend_from_slice(b"BlockStored");
        p.push(0xa0 | key.len() as u8);
        p.extend_from_slice(key.as_bytes());
        p.push(0xdd);
        p.extend_from_slice(&(elements as u32).to_be_bytes());
        p.extend(std::iter::repeat_n(element, elements));
        p.extend_from_slice(&[0xaa]);
        p.extend_from_slice(b"block_size");
        p.push(16);
        p.push(0);
        p
    }
    for (what, payload) in [
        ("nil extra_keys", map_event("extra_keys", 16 << 20, 0xc0)),
        (
            "fixint block_hashes",
            map_event("block_hashes", 16 << 20, 0x01),
        ),
    ] {
        let e = decode_batch(&payload).expect_err(what);
        assert_eq!(e.reason(), "too_large", "{what}: {e}");
    }
    // A million unknown array-form events (["x"], 3 bytes) would each decode to ~115 bytes.
    let mut tiny = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    tiny.extend_from_slice(&(1u32 << 20).to_be_bytes());
    for _ in 0..1 << 20 {
        tiny.extend_from_slice(&[0x91, 0xa1, b'x']);
    }
    tiny.push(0);
    assert_eq!(
        decode_batch(&tiny).expect_err("tiny events").reason(),
        "too_large"
    );
}
