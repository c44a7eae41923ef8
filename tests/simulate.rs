//! The routing simulator: deterministic, internally consistent, and the index actually steers.
//!
//! Small workloads (tens of requests per group) keep these fast in debug builds; the published
//! figures come from `kv-indexer simulate` in release (docs/simulation.md).

mod support;

use kv_lab::simulate::routers::{self, Router};
use kv_lab::simulate::workloads::{MultiTurn, SharedPrefix};
use kv_lab::simulate::{run, PolicyReport, SimRequest, SimSettings};

/// 24 system prompts x 5 questions (2,000 + 200 tokens), 4 req/s.
fn small_shared_prefix_seeded(seed: u64) -> Vec<SimRequest> {
    SharedPrefix {
        groups: 24,
        prompts_per_group: 5,
        system_tokens: 2_000,
        question_tokens: 200,
        output_tokens: 50,
        rate_per_s: 4.0,
    }
    .generate(16, seed)
}

fn small_shared_prefix() -> Vec<SimRequest> {
    small_shared_prefix_seeded(7)
}

fn settings(pods: usize) -> SimSettings {
    SimSettings {
        pod_capacity_blocks: vec![20_000; pods],
        ..Default::default()
    }
}

fn total_prompt_tokens(requests: &[SimRequest]) -> u64 {
    requests.iter().map(|r| r.prompt_tokens).sum()
}

fn check_invariants(report: &PolicyReport, requests: &[SimRequest]) {
    assert_eq!(report.requests, requests.len(), "{}", report.policy);
    assert!(
        (0.0..=1.0).contains(&report.token_hit_rate),
        "{}: hit rate {}",
        report.policy,
        report.token_hit_rate
    );
    let total = total_prompt_tokens(requests) as f64;
    let from_rate = total * (1.0 - report.token_hit_rate);
    assert!(
        (report.prefill_tokens as f64 - from_rate).abs() <= 1.0 + total * 1e-9,
        "{}: prefill {} vs total {} x (1 - {})",
        report.policy,
        report.prefill_tokens,
        total,
        report.token_hit_rate
    );
    assert!(report.ttft_p50_ms > 0.0, "{}", report.policy);
    assert!(
        report.ttft_p50_ms <= report.ttft_p90_ms && report.ttft_p90_ms <= report.ttft_p99_ms,
        "{}: percentiles out of order",
        report.policy
    );
    assert!(report.load_spread >= 1.0, "{}", report.policy);
}

#[test]
fn a_run_is_deterministic_for_its_seed() {
    let requests = small_shared_prefix();
    let a = run(
        &settings(4),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    let b = run(
        &settings(4),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    assert_eq!(
        serde_json::to_string(&a).expect("report serializes"),
        serde_json::to_string(&b).expect("report serializes")
    );
    // A different seed gives a different workload, so different figures.
    let other = small_shared_prefix_seeded(8);
    let c = run(&settings(4), &other, &mut routers::Precise::new(60_000.0));
    assert_ne!(
        serde_json::to_string(&a).expect("report serializes"),
        serde_json::to_string(&c).expect("report serializes")
    );
}

#[test]
fn every_policy_reports_consistent_figures() {
    let requests = small_shared_prefix();
    let caps = vec![20_000; 4];
    let mut policies: Vec<Box<dyn Router>> = vec![
        Box::new(routers::Random(kv_lab::simulate::rng(3))),
        Box::new(routers::RoundRobin::default()),
        Box::new(routers::LeastLoaded),
        Box::new(routers::ApproxPrefix::new(&caps)),
        Box::new(routers::Aibrix::new(&caps)),
        Box::new(routers::LocalAi::default()),
        Box::new(routers::Precise::new(0.0)),
        Box::new(routers::Precise::new(60_000.0)),
    ];
    for policy in policies.iter_mut() {
        let report = run(&settings(4), &requests, policy.as_mut());
        check_invariants(&report, &requests);
    }
}

#[test]
fn precise_routing_keeps_each_system_prompt_on_one_pod() {
    let requests = small_shared_prefix();
    let rr = run(&settings(8), &requests, &mut routers::RoundRobin::default());
    let precise = run(
        &settings(8),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    // The best any router can do: each group's system prompt prefilled once, then reused by
    // its other 4 prompts (2,000 of 2,200 tokens; 1,984 in full 16-token blocks).
    let reusable = (24 * 4 * (2_000 / 16) * 16) as f64 / total_prompt_tokens(&requests) as f64;
    assert!(
        precise.token_hit_rate <= reusable + 1e-9,
        "{} above the bound {reusable}",
        precise.token_hit_rate
    );
    assert!(
        precise.token_hit_rate >= 0.9 * reusable,
        "precise {} vs bound {reusable}",
        precise.token_hit_rate
    );
    assert!(
        rr.token_hit_rate < 0.5 * precise.token_hit_rate,
        "round-robin {} vs precise {}",
        rr.token_hit_rate,
        precise.token_hit_rate
    );
    assert!(precise.ttft_p50_ms < rr.ttft_p50_ms);
}

#[test]
fn precise_routing_without_events_falls_back_to_load() {
    // With events that never arrive (and no speculation) the index stays empty, so the precise
    // router can only balance load: this is what makes the hit rate above the index's doing.
    let requests = small_shared_prefix();
    let blind = SimSettings {
        event_delay_ms: 1e12,
        ..settings(4)
    };
    let without = run(&blind, &requests, &mut routers::Precise::new(0.0));
    let with = run(&settings(4), &requests, &mut routers::Precise::new(0.0));
    assert!(
        with.token_hit_rate > 2.0 * without.token_hit_rate,
        "with events {} vs without {}",
        with.token_hit_rate,
        without.token_hit_rate
    );
}

#[test]
fn multi_turn_chats_reuse_their_history() {
    let requests = MultiTurn {
        conversations: 16,
        turns: 4,
        system_tokens: 500,
        user_tokens: 100,
        output_tokens: 100,
        think_time_s: 5.0,
    }
    .generate(16, 11);
    assert_eq!(requests.len(), 64);
    assert!(requests
        .windows(2)
        .all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    let precise = run(
        &settings(4),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    let rr = run(&settings(4), &requests, &mut routers::RoundRobin::default());
    check_invariants(&precise, &requests);
    assert!(
        precise.token_hit_rate > rr.token_hit_rate,
        "precise {} vs round-robin {}",
        precise.token_hit_rate,
        rr.token_hit_rate
    );
}

#[test]
fn cache_resets_cost_hits_and_the_index_follows_them() {
    let requests = small_shared_prefix();
    let span = requests.last().map_or(0.0, |r| r.arrival_ms);
    let resets: Vec<(f64, usize)> = (1..=8).map(|i| (span * i as f64 / 9.0, i % 4)).collect();
    let with_resets = SimSettings {
        resets,
        ..settings(4)
    };
    let calm = run(
        &settings(4),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    let reset = run(
        &with_resets,
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    check_invariants(&reset, &requests);
    assert!(reset.token_hit_rate <= calm.token_hit_rate);
}

/// Runs `kv-indexer simulate ARGS --json` and returns its output.
fn simulate_json(args: &[&std::ffi::OsStr]) -> serde_json::Value {
    support::kv_indexer_json(&[&["simulate".as_ref()], args].concat())
}

#[test]
fn the_cli_runs_the_published_benchmark_and_draws_it() {
    let dir = std::env::temp_dir().join(format!("kv-indexer-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let svg = dir.join("chart.svg");
    let json = simulate_json(&[
        "--policies".as_ref(),
        "round-robin,precise".as_ref(),
        "--svg".as_ref(),
        svg.as_os_str(),
    ]);
    assert_eq!(json["requests"], 1150, "230 groups x 5 prompts");
    let results = json["results"].as_array().expect("results");
    let hit = |name: &str| {
        results
            .iter()
            .find(|r| r["policy"].as_str().is_some_and(|p| p.starts_with(name)))
            .and_then(|r| r["token_hit_rate"].as_f64())
            .expect("policy in results")
    };
    assert!(hit("precise") > 3.0 * hit("round-robin"));
    let chart = std::fs::read_to_string(&svg).expect("svg written");
    assert!(chart.starts_with("<svg") && chart.contains("round-robin"));
    std::fs::remove_dir_all(&dir).ok();

    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["simulate", "--policies", "nope"])
        .output()
        .expect("run kv-indexer simulate");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown policy \"nope\""));
}

#[test]
fn restarted_pods_lose_their_cache_and_requests_are_retried_once() {
    let requests = small_shared_prefix();
    let span = requests.last().map_or(0.0, |r| r.arrival_ms);
    // Every pod restarts at the same moment: nothing is live for 5 s, work waits, then resumes.
    let all_down = SimSettings {
        restarts: (0..4).map(|p| (span / 2.0, p)).collect(),
        restart_downtime_ms: 5_000.0,
        ..settings(4)
    };
    let calm = run(
        &settings(4),
        &requests,
        &mut routers::Precise::new(60_000.0),
    );
    let restarted = run(&all_down, &requests, &mut routers::Precise::new(60_000.0));
    check_invariants(&restarted, &requests);
    // The system prompts cached before the restart are gone: groups that straddle it pay again.
    assert!(
        restarted.token_hit_rate < calm.token_hit_rate,
        "restarted {} vs calm {}",
        restarted.token_hit_rate,
        calm.token_hit_rate
    );
    assert!(restarted.ttft_p99_ms > calm.ttft_p99_ms);

    // One pod restarting: the index is told (AllBlocksCleared), so precise routing keeps finding
    // the prefixes that survive on the other pods.
    let one_down = SimSettings {
        restarts: vec![(span / 3.0, 1), (2.0 * span / 3.0, 2)],
        restart_downtime_ms: 10_000.0,
        ..settings(4)
    };
    for policy in [
        &mut routers::Precise::new(60_000.0) as &mut dyn Router,
        &mut routers::RoundRobin::default(),
    ] {
        let report = run(&one_down, &requests, policy);
        check_invariants(&report, &requests);
    }
}

#[test]
fn the_cli_routes_a_real_mooncake_trace() {
    let Some(dir) = support::shared_traces() else {
        return;
    };
    let trace = dir.join("conversation_trace.jsonl");
    let json = simulate_json(&[
        "--workload".as_ref(),
        "mooncake".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--limit".as_ref(),
        "300".as_ref(),
        "--policies".as_ref(),
        "round-robin,precise".as_ref(),
    ]);
    assert_eq!(json["requests"], 300);
    let results = json["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    let hit = |i: usize| results[i]["token_hit_rate"].as_f64().expect("hit rate");
    for r in results {
        assert_eq!(r["requests"], 300, "every request served once");
    }
    // Conversations resend their history: routing by the index finds it, round-robin mostly not.
    assert!(
        hit(1) > hit(0),
        "precise {} vs round-robin {}",
        hit(1),
        hit(0)
    );
}
