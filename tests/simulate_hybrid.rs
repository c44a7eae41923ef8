//! The simulator's hybrid pods (sliding-window and Mamba groups beside full attention): runs
//! stay consistent, the exact rule in the index predicts the hits the engines take, and an
//! index of the full-attention group alone (llm-d's and Dynamo's today) over-predicts them.
//!
//! Small workloads keep these fast in debug builds; the published figures come from
//! `kv-indexer simulate --model-family` in release (docs/simulation.md, "Hybrid models").

mod support;

use kv_core::PickWeights;
use kv_lab::simulate::family::ModelFamily;
use kv_lab::simulate::routers::{Precise, Router};
use kv_lab::simulate::{run, PolicyReport, SimRequest, SimSettings};

/// The simulator tests' small shared-prefix workload, seed 7.
fn workload() -> Vec<SimRequest> {
    support::small_shared_prefix_spec().generate(16, 7)
}

/// Two pods of `blocks` 16-token blocks of KV, pods of `family`, chunks of 512 tokens (so
/// windows and Mamba states are freed while prompts are prefilled).
fn settings(family: ModelFamily, blocks: usize) -> SimSettings {
    let mut s = SimSettings {
        pod_capacity_blocks: vec![blocks; 2],
        model_family: family,
        ..Default::default()
    };
    s.engine.max_num_batched_tokens = 512;
    s
}

fn precise(full_only: bool) -> Vec<Box<dyn Router>> {
    let router = Precise::new(PickWeights::EQUAL, false, 1);
    vec![Box::new(if full_only {
        router.full_attention_only()
    } else {
        router
    })]
}

fn check(report: &PolicyReport, requests: &[SimRequest], what: &str) {
    assert_eq!(
        report.requests + report.rejected,
        requests.len(),
        "{what}: every request gets one first token"
    );
    assert_eq!(report.rejected, 0, "{what}");
    assert!((0.0..=1.0).contains(&report.token_hit_rate), "{what}");
    assert!(report.ttft_p50_ms > 0.0 && report.ttft_p50_ms <= report.ttft_p90_ms);
    assert!(report.ttft_mean_ms > 0.0 && report.ttft_mean_ms <= report.ttft_p99_ms * 10.0);
    assert!(report.engine.max_step_tokens <= 512, "{what}: token budget");
}

#[test]
fn a_full_attention_family_gives_both_routers_the_same_run() {
    let requests = workload();
    let s = settings(ModelFamily::Full, 2_000);
    let exact = run(&s, &requests, &mut precise(false));
    let full_only = run(&s, &requests, &mut precise(true));
    check(&exact, &requests, "exact");
    assert_eq!(full_only.policy, "precise-full-only-nospec");
    let same = |r: &PolicyReport| {
        (
            r.token_hit_rate,
            r.prefill_tokens,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.prediction,
        )
    };
    assert_eq!(same(&exact), same(&full_only));
    assert!(exact.token_hit_rate > 0.5, "the prefixes are reused");
}

#[test]
fn hybrid_runs_are_consistent_and_deterministic() {
    let requests = workload();
    for family in [
        ModelFamily::GptOss,
        ModelFamily::Gemma3,
        ModelFamily::Qwen3Next,
    ] {
        let s = settings(family, 2_000);
        let a = run(&s, &requests, &mut precise(false));
        check(&a, &requests, family.name());
        assert!(
            a.token_hit_rate > 0.3,
            "{}: {}",
            family.name(),
            a.token_hit_rate
        );
        let b = run(&s, &requests, &mut precise(false));
        assert_eq!(
            serde_json::to_string(&a).expect("serializes"),
            serde_json::to_string(&b).expect("serializes"),
            "{}",
            family.name()
        );
    }
}

#[test]
fn the_exact_rule_predicts_the_hits_taken_and_full_attention_alone_over_predicts() {
    let requests = workload();
    for (family, blocks) in [(ModelFamily::GptOss, 600), (ModelFamily::Qwen3Next, 1_000)] {
        // A pool too small for every system prompt: blocks behind windows and earlier Mamba
        // states, freed while prompts run, are evicted before the full-attention prefix.
        let s = settings(family, blocks);
        let exact = run(&s, &requests, &mut precise(false));
        let full_only = run(&s, &requests, &mut precise(true));
        check(&exact, &requests, "exact");
        check(&full_only, &requests, "full-only");
        let (e, f) = (
            exact.prediction.expect("precise predicts"),
            full_only.prediction.expect("precise predicts"),
        );
        let name = family.name();
        assert!(
            f.over > 0,
            "{name}: full attention alone must over-predict: {f:?}"
        );
        assert!(
            e.exact_share() > f.exact_share(),
            "{name}: exact {e:?} vs full-only {f:?}"
        );
        assert!(
            e.over_share() < f.over_share(),
            "{name}: exact {e:?} vs full-only {f:?}"
        );
        // The engines' hits are what they are whoever routed: the full-only router picks on
        // hits that are not there.
        assert!(exact.token_hit_rate > 0.0 && full_only.token_hit_rate > 0.0);
    }
}

fn kv_indexer(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(args)
        .output()
        .expect("run kv-indexer")
}

#[test]
fn the_cli_runs_a_model_family_and_compares_predictions() {
    let args = [
        "simulate",
        "--workload",
        "chat",
        "--limit",
        "300",
        "--capacity-blocks",
        "1000",
        "--model-family",
        "gpt-oss",
        "--policies",
        "precise-nospec,precise-full-only-nospec",
        "--quiet",
    ];
    let out = kv_indexer(&[&args[..], &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["settings"]["model_family"], "gpt-oss");
    let results = json["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for r in results {
        let predicted = r["prediction"]["requests"].as_u64().expect("prediction");
        assert_eq!(predicted, 300, "{}", r["policy"]);
        assert!(r["ttft_mean_ms"].as_f64().expect("mean") > 0.0);
    }
    let table = kv_indexer(&args);
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("model family gpt-oss"), "{text}");
    assert!(text.contains("| precise-full-only-nospec |"), "{text}");
    assert!(text.contains("Predicted hits"), "{text}");

    let bad = kv_indexer(&["simulate", "--model-family", "llama"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown model family \"llama\""));
}
