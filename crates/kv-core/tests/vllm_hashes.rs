//! Block hashes against vLLM's own output (`tests/fixtures/vllm/block_hashes.vllm-*.json`):
//! the CBOR input, the 32-byte digest and the u64 event hash of every block of every applicable
//! case, byte for byte.

use kv_core::{
    event_hash, DigestMemo, ExtraKeysFormat, HashScratch, LoraAdapter, MultiModalItem,
    RequestExtras, TokenProcessor, TokenProcessorConfig,
};
use serde_json::Value;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn load(version: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/vllm/block_hashes.vllm-{version}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// (major, minor) of a version string like "0.28.0".
fn minor(version: &str) -> u32 {
    version
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
}

/// Why a case is outside what kv-indexer reproduces, or `None` if it must match.
fn not_applicable(case: &Value, version: &str) -> Option<&'static str> {
    let m = minor(version);
    if case["algo"] != "sha256_cbor" {
        return Some("other hash algorithm (only sha256_cbor is reproducible)");
    }
    if case["nondeterministic"] == true {
        return Some("random root hash: vLLM < 0.29 without PYTHONHASHSEED");
    }
    if !case["lora_request"].is_null() && m < 14 {
        return Some("LoRA hashed by int id (vLLM <= 0.11.0)");
    }
    if case["mm_features"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
        && m < 19
    {
        return Some("multimodal keys without offsets (vLLM < 0.19)");
    }
    None
}

fn extras_of(case: &Value) -> RequestExtras {
    let lora = case["lora_request"].as_object().map(|l| LoraAdapter {
        name: l["lora_name"].as_str().expect("lora_name").to_owned(),
        path: l["lora_path"].as_str().expect("lora_path").to_owned(),
    });
    let multimodal = case["mm_features"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|f| MultiModalItem {
                    identifier: f["identifier"].as_str().expect("identifier").to_owned(),
                    offset: f["offset"].as_u64().expect("offset") as usize,
                    length: f["length"].as_u64().expect("length") as usize,
                })
                .collect()
        })
        .unwrap_or_default();
    RequestExtras {
        lora,
        multimodal,
        cache_salt: case["cache_salt"].as_str().map(str::to_owned),
    }
}

fn check_version(version: &str, expect_checked: usize) {
    let doc = load(version);
    let format = if minor(version) >= 31 {
        ExtraKeysFormat::Tagged
    } else {
        ExtraKeysFormat::Untagged
    };
    let mut checked = 0;
    let mut skipped = Vec::new();
    let mut memos = std::collections::HashMap::new();
    for case in doc["cases"].as_array().expect("cases") {
        let id = case["id"].as_str().expect("id");
        if let Some(why) = not_applicable(case, version) {
            skipped.push(format!("{id}: {why}"));
            continue;
        }
        let hash_unit = case["block_size"].as_u64().expect("block_size") as usize;
        let group = case["group_block_size"].as_u64().map(|g| g as usize);
        let processor = TokenProcessor::new(&TokenProcessorConfig {
            hash_seed: case["PYTHONHASHSEED"].as_str().map(str::to_owned),
            block_size: group.unwrap_or(hash_unit),
            hash_block_size: Some(hash_unit),
            extra_keys_format: format,
        })
        .expect("valid sizes");
        assert_eq!(
            hex(processor.none_hash()),
            case["none_hash"].as_str().expect("none_hash"),
            "{version} {id}: NONE_HASH"
        );
        let tokens: Vec<u32> = case["token_ids"]
            .as_array()
            .expect("token_ids")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        let extras = extras_of(case);
        let blocks = case["blocks"].as_array().expect("blocks");
        // EAGLE/MTP lookahead (0.33): each unit keyed with the tokens after it.
        let lookahead = case["num_hash_lookahead_tokens"].as_u64().unwrap_or(0) as usize;
        let mut units = Vec::new();
        processor.for_each_unit_after_lookahead(
            processor.none_hash(),
            &tokens,
            lookahead,
            &extras,
            &mut HashScratch::default(),
            |i, input, d| units.push((i, hex(input), *d)),
        );
        assert_eq!(
            units.len(),
            blocks.len(),
            "{version} {id}: number of full blocks"
        );
        assert_eq!(
            blocks.len() as u64,
            case["num_full_blocks"].as_u64().expect("num_full_blocks")
        );
        for ((i, input, digest), want) in units.iter().zip(blocks) {
            assert_eq!(
                input,
                want["cbor_input_hex"].as_str().expect("cbor"),
                "{version} {id} block {i}: CBOR input"
            );
            assert_eq!(
                hex(digest),
                want["hash_hex_or_int"].as_str().expect("hash"),
                "{version} {id} block {i}: digest"
            );
            assert_eq!(
                event_hash(digest).get(),
                want["event_hash_int_mode"].as_u64().expect("event hash"),
                "{version} {id} block {i}: event hash"
            );
        }
        // What the index keys on: the group's blocks (every k-th unit for hybrid models).
        let mut keys = Vec::new();
        processor.block_hashes_lookahead_into(
            &tokens,
            lookahead,
            &extras,
            &mut HashScratch::default(),
            &mut keys,
        );
        let keys: Vec<u64> = keys.iter().map(|h| h.get()).collect();
        let want_keys: Vec<u64> = match case["group_view_event_hashes_int_mode"].as_array() {
            Some(view) => view.iter().map(|v| v.as_u64().expect("u64")).collect(),
            None => blocks
                .iter()
                .map(|b| b["event_hash_int_mode"].as_u64().expect("u64"))
                .collect(),
        };
        assert_eq!(keys, want_keys, "{version} {id}: index keys");
        if lookahead > 0 {
            // The negative control: the same tokens hashed without the lookahead key no block.
            let plain = processor.block_hashes(&tokens, &extras);
            assert!(
                plain.iter().all(|h| !want_keys.contains(&h.get())),
                "{version} {id}: plain hashing must not reproduce lookahead keys"
            );
            checked += 1;
            continue;
        }
        // Through a digest memo: one memo per unit size shared by every case of the version
        // (other seeds, other tokens), and a one-bucket memo where every unit collides. The
        // second pass takes plain units from the memo; the keys stay vLLM's.
        let shared = memos
            .entry(hash_unit)
            .or_insert_with(|| DigestMemo::new(hash_unit, 1 << 20));
        let tiny = DigestMemo::new(hash_unit, 1);
        for memo in [&*shared, &tiny] {
            let mut hits = Vec::new();
            for pass in 0..2 {
                let mut out = Vec::new();
                hits.push(processor.block_hashes_memo_into(
                    &tokens,
                    &extras,
                    memo,
                    &mut HashScratch::default(),
                    &mut out,
                ));
                let got: Vec<u64> = out.iter().map(|h| h.get()).collect();
                assert_eq!(got, want_keys, "{version} {id}: memoised keys, pass {pass}");
            }
            if !extras.is_empty() {
                assert_eq!(
                    hits,
                    [0, 0],
                    "{version} {id}: extra keys are never memoised"
                );
            } else if memo.entries() > 64 && !units.is_empty() {
                assert!(hits[1] > 0, "{version} {id}: the second pass hit the memo");
            }
        }
        if let Some(view) = case["group_view_hash_hex"].as_array() {
            let digests: Vec<String> = processor
                .block_digests(&tokens, &extras)
                .iter()
                .map(|d| hex(d))
                .collect();
            let want: Vec<&str> = view.iter().map(|v| v.as_str().expect("hex")).collect();
            assert_eq!(digests, want, "{version} {id}: group view digests");
        }
        checked += 1;
    }
    eprintln!(
        "vLLM {version}: {checked} cases matched; not applicable: {}",
        skipped.join("; ")
    );
    assert_eq!(
        checked, expect_checked,
        "vLLM {version}: the number of reproduced cases changed (skipped: {skipped:?})"
    );
}

#[test]
fn vllm_0_33_0_every_sha256_cbor_case() {
    // 18 seed/size cases + lora, cache_salt, mm, lora+mm+cache_salt + hybrid group +
    // EAGLE lookahead.
    check_version("0.33.0", 24);
}

#[test]
fn vllm_0_28_0_untagged_extra_keys() {
    // The unset-seed cases are random in 0.28 (6 fewer).
    check_version("0.28.0", 17);
}

#[test]
fn vllm_0_24_0() {
    // No hybrid-group case in this file.
    check_version("0.24.0", 16);
}

#[test]
fn vllm_0_23_0() {
    check_version("0.23.0", 16);
}

#[test]
fn vllm_0_11_0_plain_and_salted() {
    // LoRA by int id and multimodal keys without offsets are out of scope in 0.11.
    check_version("0.11.0", 13);
}

#[test]
fn a_wrong_seed_or_block_size_changes_every_hash() {
    let tokens: Vec<u32> = (0..64).collect();
    let base = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        ..Default::default()
    })
    .expect("valid");
    let other_seed = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some("1234".into()),
        ..Default::default()
    })
    .expect("valid");
    let a = base.block_hashes(&tokens, &RequestExtras::default());
    let b = other_seed.block_hashes(&tokens, &RequestExtras::default());
    assert_eq!(a.len(), 4);
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
}
