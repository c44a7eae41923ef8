//! `kv-indexer replay` against ground truth and its invariants.
//!
//! Ground truth: with a cache larger than the trace's distinct blocks, every policy's token
//! prefix-hit rate must equal the infinite-cache figure `stats.json` gives for the Mooncake traces
//! (`../shared/traces/mooncake/`, read in place; SKIPPED without it, required in CI).

mod support;

use std::process::Command;

use serde_json::Value;

fn replay(args: &[&str]) -> Value {
    support::kv_indexer_json(&[&["replay"], args].concat())
}

#[test]
fn an_unbounded_cache_reproduces_the_traces_infinite_cache_hit_rate() {
    let Some(dir) = support::shared_traces() else {
        return;
    };
    let stats: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("stats.json")).expect("stats"))
            .expect("json");
    for trace in ["conversation_trace.jsonl", "synthetic_trace.jsonl"] {
        let want = stats[trace]["infinite_cache_prefix_hit_tokens"]
            .as_f64()
            .expect("figure");
        let unique = stats[trace]["unique_blocks"].as_u64().expect("figure");
        let path = dir.join(trace);
        for policy in ["lru", "lfu", "fifo", "s3fifo", "s3fifo-paper"] {
            let r = replay(&[
                "--trace",
                path.to_str().expect("utf8"),
                "--policy",
                policy,
                "--capacity-blocks",
                "10000000",
            ]);
            let got = r["overall_hit_rate"].as_f64().expect("rate");
            assert!(
                (got - want).abs() < 1e-12,
                "{trace} {policy}: {got} vs stats.json {want}"
            );
            assert_eq!(
                r["final_cache_blocks"].as_u64(),
                Some(unique),
                "{trace} {policy}"
            );
        }
    }
}

#[test]
fn invariants_hold_for_every_policy_at_a_tight_capacity() {
    let Some(dir) = support::shared_traces() else {
        return;
    };
    let path = dir.join("synthetic_trace.jsonl");
    let mut rates = Vec::new();
    for policy in ["lru", "lfu", "fifo", "s3fifo", "s3fifo-paper"] {
        let r = replay(&[
            "--trace",
            path.to_str().expect("utf8"),
            "--policy",
            policy,
            "--capacity-blocks",
            "4000",
            "--per-request",
        ]);
        let per = r["per_request"].as_array().expect("per_request");
        assert_eq!(per.len() as u64, r["requests"].as_u64().expect("requests"));
        let prompt: u64 = per
            .iter()
            .map(|p| p["prompt_tokens"].as_u64().expect("n"))
            .sum();
        let hit: u64 = per
            .iter()
            .map(|p| p["hit_tokens"].as_u64().expect("n"))
            .sum();
        assert_eq!(
            prompt,
            r["total_prompt_tokens"].as_u64().expect("n"),
            "{policy}"
        );
        assert_eq!(hit, r["total_hit_tokens"].as_u64().expect("n"), "{policy}");
        assert!(per
            .iter()
            .all(|p| p["hit_tokens"].as_u64() <= p["prompt_tokens"].as_u64()));
        let rate = r["overall_hit_rate"].as_f64().expect("rate");
        assert!(
            (rate - hit as f64 / prompt as f64).abs() < 1e-12,
            "{policy}"
        );
        assert!(
            r["final_cache_blocks"].as_u64().expect("n") <= 4000,
            "{policy}"
        );
        rates.push(rate);
    }
    // A tight cache hits less than an unbounded one, and the policies do not all agree.
    assert!(rates.iter().all(|r| *r > 0.0 && *r < 0.6513), "{rates:?}");
    assert!(
        rates.windows(2).any(|w| (w[0] - w[1]).abs() > 1e-6),
        "{rates:?}"
    );
}

#[test]
fn token_id_traces_are_hashed_with_the_token_processor() {
    let dir = support::temp_dir("token-trace");
    let path = dir.join("tokens.jsonl");
    // Request 2 shares the first 8 tokens (two blocks of 4) with request 1, then diverges.
    std::fs::write(
        &path,
        "{\"token_ids\": [1,2,3,4,5,6,7,8,9,10]}\n\n{\"token_ids\": [1,2,3,4,5,6,7,8,99,100,101,102,103]}\n",
    )
    .expect("write");
    let r = replay(&[
        "--trace",
        path.to_str().expect("utf8"),
        "--policy",
        "lru",
        "--capacity-blocks",
        "100",
        "--block-size",
        "4",
        "--per-request",
    ]);
    let per = r["per_request"].as_array().expect("per");
    assert_eq!(per[0]["hit_tokens"], 0);
    assert_eq!(per[1]["hit_tokens"], 8);
    assert_eq!(per[1]["prompt_tokens"], 13);
    assert_eq!(
        r["final_cache_blocks"], 3,
        "2 shared + 1 new full block; partial tails are not blocks"
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args([
            "replay",
            "--trace",
            "/nonexistent.jsonl",
            "--policy",
            "lru",
            "--capacity-blocks",
            "1",
        ])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent.jsonl"), "{stderr}");
    assert_eq!(
        stderr.matches("os error 2").count(),
        1,
        "the cause once: {stderr}"
    );
    let dir = support::temp_dir("bad-policy");
    let path = dir.join("t.jsonl");
    std::fs::write(&path, "{\"token_ids\": [1,2,3]}\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args([
            "replay",
            "--policy",
            "arc",
            "--capacity-blocks",
            "1",
            "--trace",
        ])
        .arg(&path)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown policy"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
