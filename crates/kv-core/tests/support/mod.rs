//! Helpers shared by kv-core's integration tests (and included by the daemon's): the vLLM
//! fixtures in kv-core's `tests/fixtures/vllm` (copied from vLLM's own output; see its
//! `README.md`) and small converters.
#![allow(dead_code)]

pub mod replay;

use kv_core::BlockHash;
use serde_json::Value;

/// SplitMix64, seeded per test so a failure reproduces from the seed it prints.
#[allow(unused_imports)]
pub use kv_core::SplitMix64 as Rng;

/// An indexer with the engine fixtures' index settings (hash seed "12345", blocks of 16: what
/// their `expected_keys` were computed with) over `index`, translating as `engine_hashes` says.
pub fn fixture_indexer(
    index: kv_core::IndexConfig,
    engine_hashes: kv_core::EngineHashes,
) -> kv_core::Indexer {
    kv_core::Indexer::new(kv_core::IndexerSettings {
        index,
        default_model: kv_core::ModelSettings {
            token_processor: kv_core::TokenProcessorConfig {
                hash_seed: Some("12345".into()),
                block_size: 16,
                ..Default::default()
            },
            engine_hashes,
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid")
}

/// `tokens` and one token more: a prompt that holds every block of `tokens` and continues,
/// so vLLM's cap (it reuses at most all but the last token) leaves the blocks held in full.
/// What a test that means "the blocks the pod holds" scores.
pub fn past(tokens: &[u32]) -> Vec<u32> {
    let mut prompt = tokens.to_vec();
    prompt.push(1);
    prompt
}

/// Decodes lowercase hex.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Loads kv-core's `tests/fixtures/<rel>` as JSON (from kv-core's tests or the workspace root's).
pub fn fixture(rel: &str) -> Value {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let core = ["crates/kv-core", "."]
        .iter()
        .map(|dir| manifest.join(dir))
        .find(|dir| dir.join("tests/fixtures/vllm").is_dir())
        .unwrap_or_else(|| manifest.to_path_buf());
    let path = core.join("tests/fixtures").join(rel).display().to_string();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A JSON array of integers as u32s.
pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|t| t.as_u64().expect("uint") as u32)
        .collect()
}

/// Block hashes from their event values.
pub fn hashes(v: &[u64]) -> Vec<BlockHash> {
    v.iter().copied().map(BlockHash::new).collect()
}

/// The first captured ZMQ payload of a scenario in `vllm/zmq_messages.vllm-<version>.json`, and
/// the request tokens the capture was made with.
pub fn captured_payload(version: &str, scenario: &str) -> (Vec<u8>, Vec<u32>) {
    let doc = fixture(&format!("vllm/zmq_messages.vllm-{version}.json"));
    let s = doc["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .find(|s| s["name"] == scenario)
        .expect("scenario");
    let payload = unhex(s["messages"][0]["frames_hex"][2].as_str().expect("hex"));
    (payload, u32s(&doc["scenarios"][0]["request_token_ids"]))
}

/// A scenario of `engines/engines.json`: KV events of an engine whose hashes are not the
/// index's keys (made with vLLM's or SGLang's own code; see that folder's README), and the keys
/// vLLM's sha256_cbor gives its tokens (seed "12345", blocks of 16).
pub struct EngineScenario {
    /// The scenario's name.
    pub name: String,
    /// The prompt.
    pub tokens: Vec<u32>,
    /// vLLM's sha256_cbor keys of the prompt, as events carry them.
    pub expected_keys: Vec<BlockHash>,
    /// The ZMQ payloads, in order.
    pub messages: Vec<Vec<u8>>,
    /// Prompt blocks held after each message.
    pub matched_after: Vec<u32>,
}

/// Every scenario of `engines/engines.json`.
pub fn engine_scenarios() -> Vec<EngineScenario> {
    let doc = fixture("engines/engines.json");
    doc["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .map(|s| EngineScenario {
            name: s["name"].as_str().expect("name").to_owned(),
            tokens: u32s(&s["tokens"]),
            expected_keys: s["expected_keys"]
                .as_array()
                .expect("keys")
                .iter()
                .map(|k| BlockHash::new(k.as_str().expect("str").parse().expect("u64")))
                .collect(),
            messages: s["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .map(|m| unhex(m.as_str().expect("hex")))
                .collect(),
            matched_after: s["matched_after"]
                .as_array()
                .expect("matched")
                .iter()
                .map(|n| n.as_u64().expect("uint") as u32)
                .collect(),
        })
        .collect()
}

/// `engines/budget.json`: one translated vLLM engine (xxhash, seed 999, blocks of 16; made with
/// vLLM 0.33.0's own code, see that folder's README) storing four distinct prompts of 60 blocks
/// in two runs each, then evicting every block, oldest prompt first.
pub struct BudgetScenario {
    /// Each prompt's tokens and the keys vLLM's sha256_cbor gives them (seed "12345", blocks
    /// of 16).
    pub prompts: Vec<(Vec<u32>, Vec<BlockHash>)>,
    /// The ZMQ payloads, in order: one batch per stored run, then one per evicted prompt.
    pub messages: Vec<Vec<u8>>,
    /// `"stored"` or `"removed"`, per message.
    pub kinds: Vec<String>,
    /// Blocks of each prompt held after each message, with no key budget.
    pub matched_after: Vec<Vec<u32>>,
}

/// Loads `engines/budget.json`.
pub fn budget_scenario() -> BudgetScenario {
    let doc = fixture("engines/budget.json");
    let list = |field: &str| doc[field].as_array().expect(field).clone();
    BudgetScenario {
        prompts: list("prompts")
            .iter()
            .map(|p| {
                let keys = p["expected_keys"]
                    .as_array()
                    .expect("keys")
                    .iter()
                    .map(|k| BlockHash::new(k.as_str().expect("str").parse().expect("u64")))
                    .collect();
                (u32s(&p["tokens"]), keys)
            })
            .collect(),
        messages: list("messages")
            .iter()
            .map(|m| unhex(m.as_str().expect("hex")))
            .collect(),
        kinds: list("kinds")
            .iter()
            .map(|k| k.as_str().expect("kind").to_owned())
            .collect(),
        matched_after: list("matched_after").iter().map(u32s).collect(),
    }
}

/// A probe of a hybrid run: a prompt and what vLLM reuses of it.
pub struct HybridProbe {
    /// The prompt.
    pub tokens: Vec<u32>,
    /// Tokens vLLM's `get_computed_blocks` reuses.
    pub hit: u64,
    /// What the first full-attention group alone would give (the fixture's control).
    pub full_only: u64,
}

/// One run of `fixtures/hybrid/hybrid.json` or `defaults.json`: a layout and seed, vLLM's
/// batches, the probes.
pub struct HybridRun {
    /// `<scenario>/seed<N>`.
    pub name: String,
    /// The scenario's name (the layout's, with the settings in `defaults.json`).
    pub scenario: String,
    /// The layout's name (the scenario's in `hybrid.json`).
    pub layout: String,
    /// vLLM's `max_num_batched_tokens` (512 in `hybrid.json`).
    pub budget: u64,
    /// vLLM's hash unit (`hash_block_size`).
    pub unit: usize,
    /// `num_hash_lookahead_tokens`.
    pub lookahead: u64,
    /// How many KV-cache groups the layout has.
    pub groups: usize,
    /// vLLM's hash-unit hashes of probe 0.
    pub first_probe_hashes: Vec<u64>,
    /// The payloads vLLM's publisher sent, in order.
    pub payloads: Vec<Vec<u8>>,
    /// The batches, decoded.
    pub messages: Vec<kv_core::EventBatch>,
    /// The probes.
    pub probes: Vec<HybridProbe>,
}

fn b64(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

/// The runs of `fixtures/hybrid/hybrid.json` (vLLM 0.33's own KV-cache manager; see its
/// README).
pub fn hybrid_runs() -> Vec<HybridRun> {
    let out = hybrid_runs_of("hybrid/hybrid.json");
    assert!(
        out.len() >= 33,
        "11 scenarios x 3 seeds, found {}",
        out.len()
    );
    out
}

/// The runs of `fixtures/hybrid/defaults.json`: vLLM 0.33's own KV-cache manager at vLLM's
/// default settings (scheduler budgets of 2,048 and 8,192 tokens, prefix-cache retention 0),
/// where events carry fewer hashes than blocks (see the README).
pub fn hybrid_default_runs() -> Vec<HybridRun> {
    let out = hybrid_runs_of("hybrid/defaults.json");
    assert!(
        out.len() >= 38,
        "16 layouts x 2 budgets + 6, found {}",
        out.len()
    );
    out
}

fn hybrid_runs_of(rel: &str) -> Vec<HybridRun> {
    let doc = fixture(rel);
    let mut out = Vec::new();
    for s in doc["scenarios"].as_array().expect("scenarios") {
        let segments: Vec<Vec<u32>> = s["segments"]
            .as_array()
            .expect("segments")
            .iter()
            .map(|seg| {
                b64(seg.as_str().expect("str"))
                    .chunks_exact(2)
                    .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
                    .collect()
            })
            .collect();
        let probes = s["probes"]
            .as_array()
            .expect("probes")
            .iter()
            .map(|p| {
                let mut tokens: Vec<u32> = p["segments"]
                    .as_array()
                    .expect("ids")
                    .iter()
                    .flat_map(|i| segments[i.as_u64().expect("id") as usize].iter().copied())
                    .collect();
                if let Some(take) = p.get("take").and_then(Value::as_u64) {
                    tokens.truncate(take as usize);
                }
                HybridProbe {
                    tokens,
                    hit: p["hit_tokens"].as_u64().expect("hit"),
                    full_only: p["full_only_hit_tokens"].as_u64().expect("full only"),
                }
            })
            .collect();
        let payloads: Vec<Vec<u8>> = s["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| b64(m.as_str().expect("str")))
            .collect();
        let scenario = s["scenario"].as_str().expect("scenario").to_owned();
        out.push(HybridRun {
            name: s["name"].as_str().expect("name").to_owned(),
            layout: s
                .get("layout")
                .and_then(Value::as_str)
                .unwrap_or(&scenario)
                .to_owned(),
            budget: s
                .get("max_num_batched_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(512),
            scenario,
            unit: s["hash_block_size"].as_u64().expect("unit") as usize,
            lookahead: s["lookahead_tokens"].as_u64().expect("lookahead"),
            groups: s["groups"].as_array().expect("groups").len(),
            first_probe_hashes: s["first_probe_block_hashes"]
                .as_array()
                .expect("hashes")
                .iter()
                .map(|h| h.as_str().expect("str").parse().expect("u64"))
                .collect(),
            messages: payloads
                .iter()
                .map(|p| kv_core::decode_batch(p).expect("vLLM's batch decodes"))
                .collect(),
            payloads,
            probes,
        });
    }
    out
}
