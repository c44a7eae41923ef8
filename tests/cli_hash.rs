//! `kv-indexer hash` against vLLM's vectors: the binary, run as an operator would.

mod support;

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("hash")
        .args(args)
        .env_remove("PYTHONHASHSEED")
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn json_output_equals_vllm_vectors() {
    let doc = support::fixture("vllm/block_hashes.vllm-0.33.0.json");
    let cases = doc["cases"].as_array().expect("cases");
    for id in [
        "sha256_cbor/seed=12345/bs=16/plain64",
        "sha256_cbor/seed=unset/bs=32/partial40",
        "sha256_cbor/seed=12345/bs=16/cache_salt",
        "sha256_cbor/seed=12345/bs=16/lora",
        "sha256_cbor/seed=12345/bs=16/lookahead1",
    ] {
        let case = cases.iter().find(|c| c["id"] == id).expect("case exists");
        let tokens: Vec<String> = support::u32s(&case["token_ids"])
            .iter()
            .map(u32::to_string)
            .collect();
        let tokens = tokens.join(",");
        let block_size = case["block_size"].to_string();
        let mut args = vec!["--tokens", &tokens, "--block-size", &block_size, "--json"];
        if let Some(seed) = case["PYTHONHASHSEED"].as_str() {
            args.extend(["--seed", seed]);
        }
        if let Some(salt) = case["cache_salt"].as_str() {
            args.extend(["--cache-salt", salt]);
        }
        let lookahead = case["num_hash_lookahead_tokens"].to_string();
        if lookahead != "null" {
            args.extend(["--lookahead", &lookahead]);
        }
        let lora = &case["lora_request"];
        if !lora.is_null() {
            args.extend([
                "--lora-name",
                lora["lora_name"].as_str().expect("name"),
                "--lora-path",
                lora["lora_path"].as_str().expect("path"),
            ]);
        }
        let (ok, stdout, stderr) = run(&args);
        assert!(ok, "{id}: {stderr}");
        let got: serde_json::Value = serde_json::from_str(&stdout).expect("JSON output");
        assert_eq!(got["none_hash"], case["none_hash"], "{id}");
        let blocks = case["blocks"].as_array().expect("blocks");
        let got_blocks = got["blocks"].as_array().expect("blocks");
        assert_eq!(got_blocks.len(), blocks.len(), "{id}");
        for (g, w) in got_blocks.iter().zip(blocks) {
            assert_eq!(g["index"], w["index"], "{id}");
            assert_eq!(g["hash"], w["hash_hex_or_int"], "{id}");
            assert_eq!(
                g["event_hash"].as_u64(),
                w["event_hash_int_mode"].as_u64(),
                "{id}"
            );
        }
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, _, stderr) = run(&["--tokens", "1,2,banana"]);
    assert!(!ok);
    assert!(stderr.contains("banana"), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    let (ok, _, stderr) = run(&["--tokens", "1", "--lora-name", "x"]);
    assert!(!ok);
    assert!(stderr.contains("--lora-path"), "{stderr}");
    let (ok, _, stderr) = run(&["--tokens", "1", "--block-size", "0"]);
    assert!(!ok);
    assert!(stderr.contains("blockSize"), "{stderr}");
}

#[test]
fn text_output_names_the_seed_and_blocks() {
    let tokens: Vec<String> = (0..40).map(|t: u32| t.to_string()).collect();
    let (ok, stdout, _) = run(&["--tokens", &tokens.join(","), "--seed", "12345"]);
    assert!(ok);
    assert!(stdout.contains("\"12345\""), "{stdout}");
    assert!(stdout.contains("7292412b7aee6c72390673c639cb26bbadd61da0cb7af52fea097bf4c7b340b2"));
    assert!(
        stdout.contains("2 full blocks, 8 tokens not hashed"),
        "{stdout}"
    );
}
