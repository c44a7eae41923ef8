//! The routing simulator: deterministic, internally consistent, and the index actually steers.
//!
//! Small workloads (tens of requests per group) keep these fast in debug builds; the published
//! figures come from `kv-indexer simulate` in release (docs/simulation.md).

mod support;

use std::cell::RefCell;
use std::rc::Rc;

use kv_core::{mix64, BlockHash, Indexer, IndexerSettings};
use kv_lab::simulate::routers::{self, CapacityGuess, Router, RouterContext, Weights};
use kv_lab::simulate::workloads::{MultiTurn, SharedPrefix};
use kv_lab::simulate::{run, PodMetrics, PolicyReport, SimRequest, SimSettings};

fn small_shared_prefix_seeded(seed: u64) -> Vec<SimRequest> {
    support::small_shared_prefix_spec().generate(16, seed)
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

fn precise() -> Vec<Box<dyn Router>> {
    vec![Box::new(routers::Precise::new(
        Weights::LLM_D_PRECISE,
        true,
        1,
    ))]
}

fn one(router: impl Router + 'static) -> Vec<Box<dyn Router>> {
    vec![Box::new(router)]
}

fn check_invariants(report: &PolicyReport, requests: &[SimRequest], settings: &SimSettings) {
    assert_eq!(
        report.requests + report.rejected,
        requests.len(),
        "{}: every request gets one first token",
        report.policy
    );
    assert!(
        (0.0..=1.0).contains(&report.token_hit_rate),
        "{}: hit rate {}",
        report.policy,
        report.token_hit_rate
    );
    // Prefill covers at least the prompt tokens not found in the cache (recomputation after
    // a preemption, and the last token of a fully cached prompt, only add).
    let total = total_prompt_tokens(requests) as f64;
    assert!(
        report.prefill_tokens as f64 >= total * (1.0 - report.token_hit_rate) - 1.0,
        "{}: prefill {} vs total {} x (1 - {})",
        report.policy,
        report.prefill_tokens,
        total,
        report.token_hit_rate
    );
    assert!(
        report.engine.max_step_tokens <= settings.engine.max_num_batched_tokens,
        "{}: a step over the token budget",
        report.policy
    );
    assert!(report.engine.max_step_seqs <= settings.engine.max_num_seqs);
    assert!(report.ttft_p50_ms > 0.0, "{}", report.policy);
    assert!(
        report.ttft_p50_ms <= report.ttft_p90_ms && report.ttft_p90_ms <= report.ttft_p99_ms,
        "{}: percentiles out of order",
        report.policy
    );
    assert!(report.output_tokens_per_s > 0.0);
    assert!(report.load_spread >= 1.0, "{}", report.policy);
}

#[test]
fn a_run_is_deterministic_for_its_seed() {
    let requests = small_shared_prefix();
    let a = run(&settings(4), &requests, &mut precise());
    let b = run(&settings(4), &requests, &mut precise());
    assert_eq!(
        serde_json::to_string(&a).expect("report serializes"),
        serde_json::to_string(&b).expect("report serializes")
    );
    // A different seed gives a different workload, so different figures.
    let other = small_shared_prefix_seeded(8);
    let c = run(&settings(4), &other, &mut precise());
    assert_ne!(
        serde_json::to_string(&a).expect("report serializes"),
        serde_json::to_string(&c).expect("report serializes")
    );
}

#[test]
fn every_policy_reports_consistent_figures() {
    let requests = small_shared_prefix();
    let s = settings(4);
    let policies: Vec<fn() -> Box<dyn Router>> = vec![
        || Box::new(routers::Random(kv_lab::simulate::rng(3))),
        || Box::new(routers::RoundRobin::default()),
        || Box::new(routers::LeastLoaded),
        || {
            Box::new(routers::ApproxPrefix::new(
                CapacityGuess::Fixed(31_250),
                Weights::EQUAL,
                1,
            ))
        },
        || {
            Box::new(routers::ApproxPrefix::new(
                CapacityGuess::AutoTune,
                Weights::EQUAL,
                1,
            ))
        },
        || Box::new(routers::Aibrix::default()),
        || Box::new(routers::LocalAi::default()),
        || Box::new(routers::Dynamo::new(1)),
        || Box::new(routers::Precise::new(Weights::EQUAL, false, 1)),
        || Box::new(routers::Precise::new(Weights::EQUAL, true, 1)),
    ];
    for make in policies {
        let report = run(&s, &requests, &mut [make()]);
        check_invariants(&report, &requests, &s);
        // Two gateway replicas each route half; every request is still served once.
        let two = SimSettings {
            routers: 2,
            ..s.clone()
        };
        let report = run(&two, &requests, &mut [make(), make()]);
        check_invariants(&report, &requests, &two);
    }
}

#[test]
fn precise_routing_keeps_each_system_prompt_on_one_pod() {
    let requests = small_shared_prefix();
    let rr = run(
        &settings(8),
        &requests,
        &mut one(routers::RoundRobin::default()),
    );
    let precise = run(&settings(8), &requests, &mut precise());
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
    // router can only balance load: its hits are what placement without prefix knowledge finds
    // (a random router's), and every hit above that is the index's doing.
    let requests = small_shared_prefix();
    let blind = SimSettings {
        event_delay_ms: 1e12,
        ..settings(4)
    };
    // Each group's system prompt prefilled once, then reused by its 4 other prompts.
    let reusable = (24 * 4 * (2_000 / 16) * 16) as f64 / total_prompt_tokens(&requests) as f64;
    let seeds = 1..=6u64;
    let (mut without_sum, mut random_sum) = (0.0, 0.0);
    for seed in seeds.clone() {
        let nospec = || one(routers::Precise::new(Weights::LLM_D_PRECISE, false, seed));
        let without = run(&blind, &requests, &mut nospec());
        let with = run(&settings(4), &requests, &mut nospec());
        let random = run(
            &settings(4),
            &requests,
            &mut one(routers::Random(kv_lab::simulate::rng(seed))),
        );
        assert!(
            with.token_hit_rate >= 0.98 * reusable,
            "seed {seed}: with events {} vs the bound {reusable}",
            with.token_hit_rate
        );
        assert!(
            with.token_hit_rate - without.token_hit_rate >= 0.25,
            "seed {seed}: with events {} vs without {}",
            with.token_hit_rate,
            without.token_hit_rate
        );
        without_sum += without.token_hit_rate;
        random_sum += random.token_hit_rate;
    }
    // Blind, it does no better than random placement (on 4 pods about half of a group's later
    // prompts find an earlier one's pod by chance: 0.33-0.40 of the prompt tokens here).
    let n = seeds.count() as f64;
    let (without, random) = (without_sum / n, random_sum / n);
    assert!(
        (without - random).abs() <= 0.05,
        "blind precise {without} vs random {random} (means over seeds)"
    );
}

/// An approximate router the test can look into after the run.
struct Shared(Rc<RefCell<routers::ApproxPrefix>>);

impl Router for Shared {
    fn name(&self) -> String {
        self.0.borrow().name()
    }
    fn route(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.0.borrow_mut().route(req, ctx)
    }
    fn routed(&mut self, req: &SimRequest, pod: usize, ctx: &RouterContext<'_>) {
        self.0.borrow_mut().routed(req, pod, ctx)
    }
}

#[test]
fn approximate_routers_size_their_view_from_a_guess_or_the_reported_blocks_never_the_truth() {
    let requests = small_shared_prefix();
    // Every other pod has half the cache; no router is told.
    let uneven = SimSettings {
        pod_capacity_blocks: vec![20_000, 10_000, 20_000, 10_000],
        ..Default::default()
    };
    let fixed = Rc::new(RefCell::new(routers::ApproxPrefix::new(
        CapacityGuess::Fixed(31_250),
        Weights::EQUAL,
        1,
    )));
    run(
        &uneven,
        &requests,
        &mut [Box::new(Shared(fixed.clone())) as Box<dyn Router>],
    );
    assert_eq!(
        fixed.borrow().capacities(),
        [31_250; 4],
        "the guess, whatever the pods have"
    );
    // autoTune reads what each engine reports (vLLM's num_gpu_blocks, scraped), converted to
    // 64-character blocks (16 tokens at 4 characters per token: one each).
    let tuned = Rc::new(RefCell::new(routers::ApproxPrefix::new(
        CapacityGuess::AutoTune,
        Weights::EQUAL,
        1,
    )));
    run(
        &uneven,
        &requests,
        &mut [Box::new(Shared(tuned.clone())) as Box<dyn Router>],
    );
    assert_eq!(
        tuned.borrow().capacities(),
        [20_000, 10_000, 20_000, 10_000]
    );
}

/// A prompt of `common` blocks every group shares, `group` blocks of its group `g`, then 16
/// blocks of its question `q` (hashes chained as vLLM's), 10 tokens out.
fn preamble_prompt(common: u64, group: u64, g: u64, q: u64, arrival_ms: f64) -> SimRequest {
    let mut h = 0x5eed_u64;
    let blocks: Vec<BlockHash> = (0..common + group + 16)
        .map(|i| {
            let content = match i {
                i if i < common => i,
                i if i < common + group => g << 40 | i,
                i => g << 40 | q << 32 | i,
            };
            h = mix64(h ^ mix64(content));
            BlockHash::new(h | 1)
        })
        .collect();
    SimRequest {
        arrival_ms,
        prompt_tokens: blocks.len() as u64 * 16,
        blocks,
        output_blocks: Vec::new(),
        output_tokens: 10,
    }
}

#[test]
fn the_approximate_scorer_looks_at_256_text_blocks_at_most() {
    // Two system prompts that share their first 264 blocks (4,224 tokens) and differ in the
    // next 64: pod 0 served the first, pod 1 the second. A new question on the first is 256 of
    // 256 blocks to the approximate scorer on both pods (it stops at block 256), so with equal
    // loads the seed decides; the index tells them apart (328 blocks against 264).
    let indexer = Indexer::new(IndexerSettings::default()).expect("default settings");
    let names: Vec<String> = (0..4).map(|p| format!("pod-{p}")).collect();
    // The pods' first (empty) batches make the model and the pods known to the index.
    for name in &names {
        let batch = kv_core::EventBatch {
            ts: 0.0,
            events: vec![kv_core::KvEvent::AllBlocksCleared],
            data_parallel_rank: Some(0),
        };
        indexer.apply_batch("m", name, &batch).expect("applied");
    }
    let scraped = [PodMetrics {
        waiting: 0,
        running: 1,
        kv_usage: 0.1,
        num_gpu_blocks: 20_000,
    }; 4];
    let in_flight = [0usize; 4];
    let ctx = RouterContext {
        now_ms: 1_000.0,
        instant: std::time::Instant::now(),
        in_flight: &in_flight,
        scraped: &scraped,
        scraped_ms: 990.0,
        scrape_interval_ms: 50.0,
        indexer: &indexer,
        model: "m",
        pod_names: &names,
        candidates: &[0, 1, 2, 3],
        score_before_last_token: false,
    };
    let winners = |common: u64, make: &dyn Fn(u64) -> Box<dyn Router>| {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..24 {
            let mut router = make(seed);
            router.routed(&preamble_prompt(common, 64, 1, 1, 0.0), 0, &ctx);
            router.routed(&preamble_prompt(common, 64, 2, 1, 0.0), 1, &ctx);
            seen.insert(router.route(&preamble_prompt(common, 64, 1, 2, 0.0), &ctx));
        }
        seen.into_iter().collect::<Vec<_>>()
    };
    let approx = |seed| -> Box<dyn Router> {
        Box::new(routers::ApproxPrefix::new(
            CapacityGuess::Fixed(31_250),
            Weights::EQUAL,
            seed,
        ))
    };
    let precise =
        |seed| -> Box<dyn Router> { Box::new(routers::Precise::new(Weights::EQUAL, true, seed)) };
    assert_eq!(
        winners(264, &approx),
        [0, 1],
        "past block 256 it cannot tell"
    );
    assert_eq!(winners(264, &precise), [0]);
    // Negative control: when the prompts differ within the first 256 blocks (a 128-block
    // preamble), the approximate scorer sees it too.
    assert_eq!(winners(128, &approx), [0]);

    // End to end: 80 prompts of 8 such system prompts (4 questions each, repeating) on 4 pods.
    // Both find the shared preamble; only the index keeps each group where its own blocks are.
    let s = settings(4);
    let (mut approx_sum, mut precise_sum) = (0.0, 0.0);
    for seed in 1..=3u64 {
        let mut rng = kv_lab::simulate::rng(seed);
        let mut t = 0.0;
        let requests: Vec<SimRequest> = (0..80)
            .map(|_| {
                t += -(1.0 - rng.unit()).ln() / 10.0 * 1000.0;
                let (g, q) = (rng.below(8) + 1, rng.below(4) + 1);
                preamble_prompt(264, 64, g, q, t)
            })
            .collect();
        let a = run(&s, &requests, &mut [approx(seed)]);
        let p = run(&s, &requests, &mut [precise(seed)]);
        check_invariants(&a, &requests, &s);
        assert!(a.token_hit_rate > 0.5, "seed {seed}: {}", a.token_hit_rate);
        approx_sum += a.token_hit_rate;
        precise_sum += p.token_hit_rate;
    }
    assert!(
        precise_sum / 3.0 >= approx_sum / 3.0 + 0.01,
        "precise {} vs approx {} (means over seeds 1-3)",
        precise_sum / 3.0,
        approx_sum / 3.0
    );
}

#[test]
fn multi_turn_chats_reuse_their_history_including_the_answers() {
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
    let s = settings(4);
    let precise = run(&s, &requests, &mut precise());
    let rr = run(&s, &requests, &mut one(routers::RoundRobin::default()));
    check_invariants(&precise, &requests, &s);
    assert!(
        precise.token_hit_rate > rr.token_hit_rate,
        "precise {} vs round-robin {}",
        precise.token_hit_rate,
        rr.token_hit_rate
    );
    // The answers' blocks are cached and published: a later turn on the same pod finds more
    // than the system prompt and the user's earlier messages.
    let prompts_only: u64 = requests
        .iter()
        .map(|r| 500 + (r.prompt_tokens - 500) / 2)
        .sum();
    assert!(
        precise.token_hit_rate * total_prompt_tokens(&requests) as f64 > 0.0
            && (precise.token_hit_rate * total_prompt_tokens(&requests) as f64) as u64
                > prompts_only / 2,
        "answers are hit: {}",
        precise.token_hit_rate
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
    let calm = run(&settings(4), &requests, &mut precise());
    let reset = run(&with_resets, &requests, &mut precise());
    check_invariants(&reset, &requests, &with_resets);
    assert!(reset.token_hit_rate <= calm.token_hit_rate);
}

#[test]
fn a_cache_too_small_preempts_and_every_request_still_finishes() {
    // Four pods of 600 blocks (9,600 tokens) for 2,200-token prompts with 400-token answers:
    // a few sequences fill a pod, so the engines preempt; budget and counts still hold.
    let requests = SharedPrefix {
        output_tokens: 400,
        rate_per_s: 20.0,
        ..support::small_shared_prefix_spec()
    }
    .generate(16, 9);
    let tight = SimSettings {
        pod_capacity_blocks: vec![600; 4],
        ..Default::default()
    };
    let report = run(&tight, &requests, &mut one(routers::RoundRobin::default()));
    check_invariants(&report, &requests, &tight);
    assert!(report.preemptions > 0, "{report:?}");
}

/// Runs `kv-indexer simulate ARGS --json` and returns its output.
fn simulate_json(args: &[&std::ffi::OsStr]) -> serde_json::Value {
    support::kv_indexer_json(&[&["simulate".as_ref()], args].concat())
}

#[test]
fn the_cli_runs_the_published_benchmark_and_draws_it() {
    let dir = support::temp_dir("sim-chart");
    let svg = dir.join("chart.svg");
    let json = simulate_json(&[
        "--workload".as_ref(),
        "shared-prefix".as_ref(),
        "--policies".as_ref(),
        "round-robin,precise".as_ref(),
        "--svg".as_ref(),
        svg.as_os_str(),
        "--quiet".as_ref(),
    ]);
    assert_eq!(json["requests"], 1150, "230 groups x 5 prompts");
    let results = json["results"].as_array().expect("results");
    let hit = |name: &str| {
        results
            .iter()
            .find(|r| r["policy"].as_str() == Some(name))
            .and_then(|r| r["token_hit_rate"].as_f64())
            .expect("policy in results")
    };
    assert!(hit("precise") > 3.0 * hit("round-robin"));
    let chart = std::fs::read_to_string(&svg).expect("svg written");
    assert!(chart.starts_with("<svg") && chart.contains("round-robin"));

    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["simulate", "--policies", "nope"])
        .output()
        .expect("run kv-indexer simulate");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown policy \"nope\""));
}

#[test]
fn the_ladder_gives_every_run_and_a_verdict_per_policy() {
    let dir = support::temp_dir("sim-ladder");
    let svg = dir.join("ladder.svg");
    let json = simulate_json(&[
        "--rates".as_ref(),
        "2,6".as_ref(),
        "--seeds".as_ref(),
        "2".as_ref(),
        "--duration-s".as_ref(),
        "10".as_ref(),
        "--output-tokens".as_ref(),
        "50".as_ref(),
        "--policies".as_ref(),
        "round-robin,approx,precise".as_ref(),
        "--slo-ttft-p90-ms".as_ref(),
        "2000".as_ref(),
        "--svg".as_ref(),
        svg.as_os_str(),
        "--quiet".as_ref(),
    ]);
    let runs = json["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2 * 2 * 3, "rates x seeds x policies");
    for r in runs {
        for key in [
            "rate",
            "policy",
            "seed",
            "hit_rate",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "output_tokens_per_s",
        ] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
    }
    let verdict = json["max_sustainable_rate"].as_object().expect("verdict");
    assert_eq!(verdict.len(), 3);
    // The verdict follows the runs: a rate counts when its mean p90 meets the SLO.
    for (policy, rate) in verdict {
        let p90 = |rate: f64| {
            let v: Vec<f64> = runs
                .iter()
                .filter(|r| r["policy"] == policy.as_str() && r["rate"].as_f64() == Some(rate))
                .map(|r| r["ttft_p90_ms"].as_f64().expect("p90"))
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        match rate.as_f64() {
            Some(r) => assert!(p90(r) <= 2000.0, "{policy}"),
            None => assert!(p90(2.0) > 2000.0, "{policy}"),
        }
    }
    for file in ["ladder.svg", "ladder-hits.svg"] {
        let chart = std::fs::read_to_string(dir.join(file)).expect("chart written");
        assert!(
            chart.starts_with("<svg") && chart.contains("precise"),
            "{file}"
        );
    }
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
    let calm = run(&settings(4), &requests, &mut precise());
    let restarted = run(&all_down, &requests, &mut precise());
    // Streams already started are cut (counted neither served nor rejected), the rest retried.
    assert!(restarted.requests <= requests.len());
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
    for mut policy in [precise(), one(routers::RoundRobin::default())] {
        let report = run(&one_down, &requests, &mut policy);
        assert!(report.requests > requests.len() * 9 / 10, "{report:?}");
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
        "--quiet".as_ref(),
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
