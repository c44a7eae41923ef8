//! `kv-indexer simulate`: routing policies on simulated vLLM pods (see `kv_lab::simulate`):
//! one run per policy, or a load ladder (`--rates`) over several seeds with a verdict per
//! policy (the highest rate that meets a TTFT SLO), as tables, JSON and charts. The flags are
//! parsed and the results printed here; the policies, the statistics and the charts are
//! kv-lab's (`simulate::{policies, report, charts}`).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

use kv_lab::simulate::charts;
use kv_lab::simulate::engine::EngineConfig;
use kv_lab::simulate::family::ModelFamily;
use kv_lab::simulate::membership::PoolChanges;
use kv_lab::simulate::policies::{
    self, parse_prefix_score, parse_weights, PolicySettings, POLICIES,
};
use kv_lab::simulate::report::{self, LadderRun};
use kv_lab::simulate::routers::{self, Router};
use kv_lab::simulate::workloads::{mooncake, MultiTurn, SharedPrefix};
use kv_lab::simulate::{run, PolicyReport, SimRequest, SimSettings, ANCHOR_KV_TOKENS};
use kv_lab::trace::load_mooncake;

/// Flags of `kv-indexer simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// anchor (llm-d's published precise-vs-approximate benchmark: 150 groups x 5 users,
    /// 6,000 + 1,200 tokens in, 1,000 out, prompts drawn at random for 60 s), shared-prefix
    /// (230 groups x 5, each prompt once), chat (multi-turn) or mooncake (a trace).
    #[arg(long, default_value = "anchor")]
    pub workload: String,
    /// Mooncake trace file (with --workload mooncake).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Comma-separated policies, or all: random, round-robin, least-loaded, approx,
    /// approx-autotune, aibrix, localai, dynamo, precise-nospec, precise. Not in all:
    /// precise-full-only and precise-full-only-nospec, precise scoring over an index fed only
    /// the full-attention group's events (llm-d's and Dynamo's indexes today), to set beside
    /// precise on a hybrid --model-family; precise-publishers and precise-publishers-nospec,
    /// precise scoring among the pods that published (kv-indexer's picker without a pool), to
    /// set beside precise (the pool's pods) with --scale-out-at or --kill-at.
    #[arg(long, default_value = "all")]
    pub policies: String,
    /// The model's KV-cache groups: full (full attention only, 16-token blocks: the plain
    /// engine of the published figures), gpt-oss (full attention + a 128-token sliding
    /// window, 16-token blocks), gemma3 (full attention + a 1,024-token sliding window) or
    /// qwen3-next (full attention + Mamba state, 576-token blocks hashed in 16-token units).
    /// A hybrid pod's pool has, per group, as many blocks as the pod's KV tokens fill pages of
    /// the family (16 or 576 tokens), shared by all groups; events carry group_idx and the
    /// index scores by vLLM's hybrid rule. With a hybrid family the precise policies' expected
    /// hits are compared with the hits taken (a second table).
    #[arg(long, default_value = "full")]
    pub model_family: String,
    /// Pods.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// KV blocks per pod (16 tokens each); the default is the anchor's 307,328 KV tokens.
    #[arg(long, default_value_t = ANCHOR_KV_TOKENS / 16)]
    pub capacity_blocks: usize,
    /// Give every other pod half the capacity (no router is told).
    #[arg(long)]
    pub heterogeneous: bool,
    /// Engine: tokens one step may schedule (vLLM's max_num_batched_tokens).
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: u64,
    /// Engine: sequences running at once at most (vLLM's max_num_seqs).
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Engine: fixed cost of a step, ms (default: Qwen3-32B on 2 x H100, see
    /// docs/simulation.md).
    #[arg(long, default_value_t = EngineConfig::default().step_base_ms)]
    pub step_base_ms: f64,
    /// Engine: cost per scheduled token, ms.
    #[arg(long, default_value_t = EngineConfig::default().ms_per_token)]
    pub ms_per_token: f64,
    /// Engine: cost per token already in the scheduled sequences' KV, ms.
    #[arg(long, default_value_t = EngineConfig::default().ms_per_context_token)]
    pub ms_per_context_token: f64,
    /// Share of requests that reach a random pod without passing a router.
    #[arg(long, default_value_t = 0.0)]
    pub bypass: f64,
    /// Prefix-cache resets, spread over the run.
    #[arg(long, default_value_t = 0)]
    pub resets: usize,
    /// Pod restarts, spread over the run (the pod is down, loses its cache, publishes
    /// AllBlocksCleared; requests without a token yet are retried).
    #[arg(long, default_value_t = 0)]
    pub restarts: usize,
    /// How long a restarting pod is down, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub restart_downtime_s: f64,
    /// A scale-out: `--scale-out-pods` more pods (beside `--pods`) join the pool, Ready and
    /// idle, at this second.
    #[arg(long)]
    pub scale_out_at: Option<f64>,
    /// Pods the scale-out adds.
    #[arg(long, default_value_t = 1)]
    pub scale_out_pods: usize,
    /// Pod `--kill-pod`'s server stops answering for good at this second (hung, or its node cut
    /// off; its blocks stay in the index).
    #[arg(long)]
    pub kill_at: Option<f64>,
    /// The pod `--kill-at` kills.
    #[arg(long, default_value_t = 0)]
    pub kill_pod: usize,
    /// How long Kubernetes takes to mark a pod that stopped answering not Ready, seconds (its
    /// readiness probe's period x failure threshold; Kubernetes' defaults: 10 x 3).
    #[arg(long, default_value_t = kv_lab::simulate::DEFAULT_READINESS_DELAY_MS / 1000.0)]
    pub readiness_delay_s: f64,
    /// kv-indexer's picker: metrics reads refused or timed out in a row that take a pod out of
    /// its candidates (endpointPicker.scrapeFailuresToLeave).
    #[arg(long, default_value_t = kv_core::DEFAULT_FAILURES_TO_LEAVE)]
    pub scrape_failures_to_leave: u32,
    /// Gateway replicas: each routes a share of the arrivals with its own state (approximate
    /// replicas do not see each other's routings; precise replicas share the index).
    #[arg(long, default_value_t = 1)]
    pub routers: usize,
    /// Scorer weights, prefix:queue:kv-utilisation: `equal` (1:1:1 for every scoring
    /// policy, the head-to-head), `llm-d` (as published: approximate 1:1:1, precise 3:2:2), or
    /// three numbers (e.g. 2:1:1) for every scoring policy.
    #[arg(long, default_value = "equal")]
    pub weights: String,
    /// How the precise policies turn the index's scores into the prefix scorer's value:
    /// `min-max` (llm-d's precise-prefix-cache scorer on kv-indexer's scores: min-max over
    /// every candidate, 1.0 each when all are equal), `min-max-holders` (the same scorer on
    /// llm-d's own indexer, which returns only the pods holding the prompt's first block) or
    /// `share` (matched blocks over prompt blocks, what the lab used before).
    #[arg(long, default_value = "min-max")]
    pub precise_prefix_score: String,
    /// The approximate scorer's capacity guess per pod, in its blocks (lruCapacityPerServer).
    #[arg(long, default_value_t = routers::APPROX_CAPACITY_GUESS)]
    pub approx_capacity: usize,
    /// Delay before the index sees a cache change, ms.
    #[arg(long, default_value_t = 50.0)]
    pub event_delay_ms: f64,
    /// How often the gateways scrape pod metrics (queue, KV usage), ms.
    #[arg(long, default_value_t = 50.0)]
    pub scrape_interval_ms: f64,
    /// Arrival rate, requests per second (anchor, shared-prefix).
    #[arg(long)]
    pub rate: Option<f64>,
    /// A load ladder: comma-separated rates (requests per second), each run for every
    /// policy and seed (anchor, shared-prefix).
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Ladder: seeds per rate and policy (seed, seed + 1, ...); figures are means with a 95%
    /// interval.
    #[arg(long, default_value_t = 1)]
    pub seeds: u64,
    /// Ladder: the TTFT p90 a rate must meet (mean over seeds) to be sustainable, ms.
    #[arg(long, default_value_t = 1_000.0)]
    pub slo_ttft_p90_ms: f64,
    /// Workload knobs (anchor, shared-prefix): distinct system prompts.
    #[arg(long)]
    pub groups: Option<usize>,
    /// Questions (users) per system prompt.
    #[arg(long)]
    pub prompts_per_group: Option<usize>,
    /// System prompt tokens.
    #[arg(long)]
    pub system_tokens: Option<u64>,
    /// Question tokens.
    #[arg(long)]
    pub question_tokens: Option<u64>,
    /// Output tokens.
    #[arg(long)]
    pub output_tokens: Option<u64>,
    /// Seconds of arrivals (anchor: prompts drawn at random for this long).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Requests arriving together, all of one group (a burst).
    #[arg(long)]
    pub burst: Option<usize>,
    /// Mooncake: first N requests only (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Seed (a run is deterministic for it).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write SVG charts: one run, TTFT and hit rate per policy; a ladder, TTFT p90 against
    /// offered load per policy (FILE) and hit rate per policy and rate (FILE with `-hits`).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// No progress bar on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// The policies' settings from the flags.
fn policy_settings(args: &SimulateArgs) -> anyhow::Result<PolicySettings> {
    let (approx_weights, precise_weights) = parse_weights(&args.weights)?;
    Ok(PolicySettings {
        approx_capacity: args.approx_capacity,
        approx_weights,
        precise_weights,
        precise_prefix: parse_prefix_score(&args.precise_prefix_score)?,
    })
}

/// One router per gateway replica, each with its own seed.
fn replicas(name: &str, args: &SimulateArgs, seed: u64) -> anyhow::Result<Vec<Box<dyn Router>>> {
    Ok(policies::replicas(
        name,
        &policy_settings(args)?,
        args.routers,
        seed,
    )?)
}

/// The workload's requests at `rate` (when given) for `seed`.
fn workload(args: &SimulateArgs, rate: Option<f64>, seed: u64) -> anyhow::Result<Vec<SimRequest>> {
    let block = 16;
    let shared = |mut w: SharedPrefix| {
        w.groups = args.groups.unwrap_or(w.groups);
        w.prompts_per_group = args.prompts_per_group.unwrap_or(w.prompts_per_group);
        w.system_tokens = args.system_tokens.unwrap_or(w.system_tokens);
        w.question_tokens = args.question_tokens.unwrap_or(w.question_tokens);
        w.output_tokens = args.output_tokens.unwrap_or(w.output_tokens);
        w.duration_s = args.duration_s.unwrap_or(w.duration_s);
        w.burst = args.burst.unwrap_or(w.burst);
        if let Some(r) = rate.or(args.rate) {
            w.rate_per_s = r;
        }
        w
    };
    let mut requests = match args.workload.as_str() {
        "anchor" => shared(SharedPrefix::anchor()).generate(block, seed),
        "shared-prefix" => shared(SharedPrefix::preset()).generate(block, seed),
        "chat" if rate.is_none() => MultiTurn::preset().generate(block, seed),
        "mooncake" if rate.is_none() => {
            let path = args
                .trace
                .clone()
                .context("--workload mooncake needs --trace FILE")?;
            mooncake(&load_mooncake(&path)?, block, 1.0)
        }
        "chat" | "mooncake" => {
            bail!("--rates needs a rate-driven workload (anchor, shared-prefix)")
        }
        other => bail!("unknown workload {other:?} (anchor, shared-prefix, chat, mooncake)"),
    };
    if args.limit > 0 {
        requests.truncate(args.limit);
    }
    Ok(requests)
}

fn check(args: &SimulateArgs) -> anyhow::Result<()> {
    if args.pods == 0 || args.capacity_blocks == 0 {
        bail!("--pods and --capacity-blocks must be at least 1");
    }
    if args.pods > 4096 {
        bail!("--pods must be at most 4096, got {}", args.pods);
    }
    if args.routers == 0 || args.routers > 64 {
        bail!("--routers must be between 1 and 64, got {}", args.routers);
    }
    if args.max_num_batched_tokens == 0 || args.max_num_seqs == 0 {
        bail!("--max-num-batched-tokens and --max-num-seqs must be at least 1");
    }
    if !(0.0..=1.0).contains(&args.bypass) {
        bail!(
            "--bypass must be a share between 0 and 1, got {}",
            args.bypass
        );
    }
    for (flag, v) in [
        ("--event-delay-ms", args.event_delay_ms),
        ("--restart-downtime-s", args.restart_downtime_s),
        ("--step-base-ms", args.step_base_ms),
        ("--ms-per-token", args.ms_per_token),
        ("--ms-per-context-token", args.ms_per_context_token),
        ("--slo-ttft-p90-ms", args.slo_ttft_p90_ms),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            bail!("{flag} must be a finite number >= 0, got {v}");
        }
    }
    if !(args.scrape_interval_ms > 0.0 && args.scrape_interval_ms.is_finite()) {
        bail!("--scrape-interval-ms must be a positive number");
    }
    for r in args.rate.iter().chain(&args.rates) {
        if !(*r > 0.0 && r.is_finite()) {
            bail!("rates must be positive numbers of requests per second, got {r}");
        }
    }
    if args.duration_s.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
        bail!("--duration-s must be a positive number of seconds");
    }
    check_pool(args)?;
    if args.seeds == 0 || args.seeds > 100 {
        bail!("--seeds must be between 1 and 100, got {}", args.seeds);
    }
    parse_weights(&args.weights)?;
    parse_prefix_score(&args.precise_prefix_score)?;
    ModelFamily::parse(&args.model_family)?;
    Ok(())
}

/// The pool's changes: a scale-out of at least one pod, a kill of one of `--pods`, both at a
/// time within reason.
fn check_pool(args: &SimulateArgs) -> anyhow::Result<()> {
    for (flag, v) in [
        ("--scale-out-at", args.scale_out_at),
        ("--kill-at", args.kill_at),
        ("--readiness-delay-s", Some(args.readiness_delay_s)),
    ] {
        if v.is_some_and(|v| !(v >= 0.0 && v.is_finite())) {
            bail!("{flag} must be a finite number of seconds >= 0");
        }
    }
    if args.scale_out_at.is_some() && !(1..=64).contains(&args.scale_out_pods) {
        bail!("--scale-out-pods must be between 1 and 64");
    }
    if args.kill_at.is_some() && args.kill_pod >= args.pods {
        bail!("--kill-pod must be one of the --pods ({})", args.pods);
    }
    if !(1..=100).contains(&args.scrape_failures_to_leave) {
        bail!("--scrape-failures-to-leave must be between 1 and 100");
    }
    Ok(())
}

fn settings(
    args: &SimulateArgs,
    requests: &[SimRequest],
    seed: u64,
) -> anyhow::Result<SimSettings> {
    let late = args.scale_out_at.map_or(0, |_| args.scale_out_pods);
    let capacities: Vec<usize> = (0..args.pods + late)
        .map(|p| {
            if args.heterogeneous && p % 2 == 1 {
                args.capacity_blocks / 2
            } else {
                args.capacity_blocks
            }
        })
        .collect();
    let end = requests.last().map_or(0.0, |r| r.arrival_ms);
    Ok(SimSettings {
        pod_capacity_blocks: capacities,
        engine: EngineConfig {
            block_size: 16,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            step_base_ms: args.step_base_ms,
            ms_per_token: args.ms_per_token,
            ms_per_context_token: args.ms_per_context_token,
        },
        model_family: ModelFamily::parse(&args.model_family)?,
        event_delay_ms: args.event_delay_ms,
        scrape_interval_ms: args.scrape_interval_ms,
        routers: args.routers,
        bypass_fraction: args.bypass,
        resets: (0..args.resets)
            .map(|k| {
                (
                    end * (k + 1) as f64 / (args.resets + 1) as f64,
                    k % args.pods,
                )
            })
            .collect(),
        restarts: (0..args.restarts)
            .map(|k| {
                (
                    end * (k as f64 + 0.5) / args.restarts as f64,
                    (k * 3 + 1) % args.pods,
                )
            })
            .collect(),
        restart_downtime_ms: args.restart_downtime_s * 1000.0,
        pool: PoolChanges {
            joins: args
                .scale_out_at
                .map(|s| {
                    (args.pods..args.pods + late)
                        .map(|p| (s * 1000.0, p))
                        .collect()
                })
                .unwrap_or_default(),
            kills: args
                .kill_at
                .map(|s| vec![(s * 1000.0, args.kill_pod)])
                .unwrap_or_default(),
            readiness_delay_ms: args.readiness_delay_s * 1000.0,
            probe_timeout_ms: 250.0,
            failures_to_leave: args.scrape_failures_to_leave,
        },
        seed,
    })
}

fn policy_names(args: &SimulateArgs) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> = if args.policies == "all" {
        POLICIES.iter().map(|s| s.to_string()).collect()
    } else {
        args.policies
            .split(',')
            .map(|s| s.trim().to_string())
            .collect()
    };
    let settings = policy_settings(args)?;
    for n in &names {
        policies::router(n, &settings, 0)?;
    }
    Ok(names)
}

/// Runs `jobs` on every core (see [`policies::run_parallel`]), ticking the progress bar.
fn parallel<J: Sync, R: Send>(
    jobs: &[J],
    progress: Option<&indicatif::ProgressBar>,
    work: impl Fn(&J) -> anyhow::Result<R> + Sync,
) -> anyhow::Result<Vec<R>> {
    policies::run_parallel(
        jobs,
        || {
            if let Some(bar) = progress {
                bar.inc(1);
            }
        },
        work,
    )
}

fn progress_bar(args: &SimulateArgs, len: usize, what: &str) -> Option<indicatif::ProgressBar> {
    if args.quiet {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} runs, ~{eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(what.to_string());
    Some(bar)
}

/// Runs every selected policy on the same workload (or the load ladder) and prints the
/// comparison.
pub fn run_cli(args: SimulateArgs) -> anyhow::Result<()> {
    check(&args)?;
    let names = policy_names(&args)?;
    if !args.rates.is_empty() {
        return ladder(&args, &names);
    }
    let requests = workload(&args, None, args.seed)?;
    let sim = settings(&args, &requests, args.seed)?;
    let bar = progress_bar(&args, names.len(), "simulate");
    let reports: Vec<PolicyReport> = parallel(&names, bar.as_ref(), |name| {
        let mut routers = replicas(name, &args, args.seed)?;
        Ok(run(&sim, &requests, &mut routers))
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if let Some(path) = &args.svg {
        charts::draw_policies(path, &reports)?;
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workload": args.workload, "requests": requests.len(), "seed": args.seed,
                "settings": sim, "results": reports,
            }))?
        );
        return Ok(());
    }
    println!(
        "{} requests ({}), {} pods, {} gateway replica(s), seed {}",
        requests.len(),
        args.workload,
        args.pods,
        args.routers,
        args.seed
    );
    if let Some(at) = args.scale_out_at {
        println!("{} more pods join at {at} s", args.scale_out_pods);
    }
    if let Some(at) = args.kill_at {
        println!(
            "pod {} stops answering at {at} s (not Ready {} s later)",
            args.kill_pod, args.readiness_delay_s
        );
    }
    if sim.model_family.is_hybrid() {
        println!("model family {}", sim.model_family.name());
    }
    print!("{}", report::policy_table(&reports));
    if !sim.pool.joins.is_empty() || !sim.pool.kills.is_empty() {
        println!("\nThe pool changing (a scale-out, a pod that stopped answering):");
        print!("{}", report::pool_table(&reports));
    }
    if sim.model_family.is_hybrid() {
        println!("\nPredicted hits (on the pod picked) against the hits the engines took:");
        print!("{}", report::prediction_table(&reports));
    }
    Ok(())
}

fn ladder(args: &SimulateArgs, names: &[String]) -> anyhow::Result<()> {
    let mut jobs = Vec::new();
    for &rate in &args.rates {
        for k in 0..args.seeds {
            for name in names {
                jobs.push((rate, args.seed + k, name.clone()));
            }
        }
    }
    let bar = progress_bar(args, jobs.len(), "ladder");
    let runs: Vec<LadderRun> = parallel(&jobs, bar.as_ref(), |(rate, seed, name)| {
        let requests = workload(args, Some(*rate), *seed)?;
        let sim = settings(args, &requests, *seed)?;
        let mut routers = replicas(name, args, *seed)?;
        let report = run(&sim, &requests, &mut routers);
        Ok(LadderRun::new(*rate, *seed, &report))
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let verdict = report::max_sustainable_rate(&runs, args.slo_ttft_p90_ms);
    if let Some(path) = &args.svg {
        charts::draw_ladder(path, &runs, args.slo_ttft_p90_ms)?;
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workload": args.workload, "slo_ttft_p90_ms": args.slo_ttft_p90_ms,
                "weights": args.weights, "precise_prefix_score": args.precise_prefix_score,
                "runs": runs, "max_sustainable_rate": verdict,
            }))?
        );
        return Ok(());
    }
    println!(
        "load ladder ({}), {} pods, {} gateway replica(s), seeds {}..{}, weights {}, precise prefix score {}: mean [95% interval]",
        args.workload,
        args.pods,
        args.routers,
        args.seed,
        args.seed + args.seeds - 1,
        args.weights,
        args.precise_prefix_score
    );
    print!("{}", report::ladder_table(&runs));
    println!(
        "\nhighest rate whose mean TTFT p90 meets {} ms (and every lower rate does):",
        args.slo_ttft_p90_ms
    );
    for (policy, rate) in &verdict {
        match rate {
            Some(r) => println!("  {policy}: {r} req/s"),
            None => println!("  {policy}: none of the rates"),
        }
    }
    Ok(())
}
