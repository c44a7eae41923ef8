//! `kv-indexer simulate`: routing policies on simulated vLLM pods (see `kv_lab::simulate`).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

use kv_lab::simulate::routers::{self, Router};
use kv_lab::simulate::workloads::{mooncake, MultiTurn, SharedPrefix};
use kv_lab::simulate::{rng, run, PolicyReport, SimRequest, SimSettings};
use kv_lab::trace::load_mooncake;

/// Flags of `kv-indexer simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// shared-prefix (the published 230 x 5 benchmark), chat (multi-turn) or mooncake.
    #[arg(long, default_value = "shared-prefix")]
    pub workload: String,
    /// Mooncake trace file (with --workload mooncake).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Comma-separated policies, or all: random, round-robin, least-loaded, approx-prefix,
    /// aibrix, localai, precise.
    #[arg(long, default_value = "all")]
    pub policies: String,
    /// Pods.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// KV-cache blocks per pod (16 tokens each).
    #[arg(long, default_value_t = 20_000)]
    pub capacity_blocks: usize,
    /// Give every other pod half the capacity (a router cannot see capacities).
    #[arg(long)]
    pub heterogeneous: bool,
    /// Share of requests that reach a random pod without passing the router.
    #[arg(long, default_value_t = 0.0)]
    pub bypass: f64,
    /// Prefix-cache resets, spread over the run.
    #[arg(long, default_value_t = 0)]
    pub resets: usize,
    /// Pod restarts, spread over the run (the pod is down, loses its cache, publishes
    /// AllBlocksCleared; its queued requests are retried).
    #[arg(long, default_value_t = 0)]
    pub restarts: usize,
    /// How long a restarting pod is down, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub restart_downtime_s: f64,
    /// Prefix weight of the scoring policies (approx-prefix, precise), like an EPP scorer weight.
    #[arg(long, default_value_t = 1.0)]
    pub prefix_weight: f64,
    /// Load weight of the scoring policies (approx-prefix, precise): in-flight / max in-flight.
    #[arg(long, default_value_t = 0.5)]
    pub load_weight: f64,
    /// Delay before the index sees a cache change, ms.
    #[arg(long, default_value_t = 50.0)]
    pub event_delay_ms: f64,
    /// Arrival rate for shared-prefix, requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Mooncake: first N requests only (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Seed (the run is deterministic for it).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG chart of TTFT and hit rate per policy.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

const ALL: [&str; 8] = [
    "random",
    "round-robin",
    "least-loaded",
    "approx-prefix",
    "aibrix",
    "localai",
    "precise-nospec",
    "precise",
];

fn router(
    name: &str,
    capacities: &[usize],
    args: &SimulateArgs,
) -> anyhow::Result<Box<dyn Router>> {
    let seed = args.seed;
    let precise = |ttl: f64| {
        let mut r = routers::Precise::new(ttl);
        r.prefix_weight = args.prefix_weight;
        r.load_weight = args.load_weight;
        Box::new(r)
    };
    Ok(match name {
        "random" => Box::new(routers::Random(rng(seed ^ 0xABCD))),
        "round-robin" => Box::new(routers::RoundRobin::default()),
        "least-loaded" => Box::new(routers::LeastLoaded),
        "approx-prefix" => {
            let mut r = routers::ApproxPrefix::new(capacities);
            r.prefix_weight = args.prefix_weight;
            r.load_weight = args.load_weight;
            Box::new(r)
        }
        "aibrix" => Box::new(routers::Aibrix::new(capacities)),
        "localai" => Box::new(routers::LocalAi::default()),
        "precise" => precise(60_000.0),
        "precise-nospec" => precise(0.0),
        other => bail!("unknown policy {other:?} (one of {})", ALL.join(", ")),
    })
}

fn svg(reports: &[PolicyReport]) -> String {
    let w = 900.0;
    let row = 34.0;
    let h = 80.0 + row * reports.len() as f64;
    let max_ttft = reports.iter().map(|r| r.ttft_p90_ms).fold(1.0, f64::max);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\">TTFT p50 / p90 (ms, left) and token prefix-hit rate (right) per routing policy</text>\n"
    );
    for (i, r) in reports.iter().enumerate() {
        let y = 50.0 + row * i as f64;
        let p90 = 380.0 * r.ttft_p90_ms / max_ttft;
        let p50 = 380.0 * r.ttft_p50_ms / max_ttft;
        let hit = 250.0 * r.token_hit_rate;
        s += &format!(
            "<text x=\"10\" y=\"{:.0}\">{}</text>\n\
             <rect x=\"170\" y=\"{:.0}\" width=\"{p90:.1}\" height=\"12\" fill=\"#9ecae1\"/>\n\
             <rect x=\"170\" y=\"{:.0}\" width=\"{p50:.1}\" height=\"12\" fill=\"#3182bd\"/>\n\
             <text x=\"{:.0}\" y=\"{:.0}\">{:.0} / {:.0}</text>\n\
             <rect x=\"620\" y=\"{:.0}\" width=\"{hit:.1}\" height=\"12\" fill=\"#31a354\"/>\n\
             <text x=\"{:.0}\" y=\"{:.0}\">{:.1}%</text>\n",
            y + 10.0,
            r.policy,
            y,
            y,
            175.0 + p90,
            y + 10.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            y,
            625.0 + hit,
            y + 10.0,
            100.0 * r.token_hit_rate
        );
    }
    s + "</svg>\n"
}

/// Runs every selected policy on the same workload and prints the comparison.
pub fn run_cli(args: SimulateArgs) -> anyhow::Result<()> {
    let block = 16;
    let mut requests: Vec<SimRequest> = match args.workload.as_str() {
        "shared-prefix" => {
            let mut w = SharedPrefix::preset();
            if let Some(r) = args.rate {
                w.rate_per_s = r;
            }
            w.generate(block, args.seed)
        }
        "chat" => MultiTurn::preset().generate(block, args.seed),
        "mooncake" => {
            let path = args
                .trace
                .clone()
                .context("--workload mooncake needs --trace FILE")?;
            mooncake(&load_mooncake(&path)?, block, 1.0)
        }
        other => bail!("unknown workload {other:?} (shared-prefix, chat, mooncake)"),
    };
    if args.limit > 0 {
        requests.truncate(args.limit);
    }
    if args.pods == 0 || args.capacity_blocks == 0 {
        bail!("--pods and --capacity-blocks must be at least 1");
    }
    if args.pods > 4096 {
        bail!("--pods must be at most 4096, got {}", args.pods);
    }
    if !(0.0..=1.0).contains(&args.bypass) {
        bail!(
            "--bypass must be a share between 0 and 1, got {}",
            args.bypass
        );
    }
    if !(args.event_delay_ms >= 0.0 && args.event_delay_ms.is_finite()) {
        bail!(
            "--event-delay-ms must be a finite number >= 0, got {}",
            args.event_delay_ms
        );
    }
    for (flag, v) in [
        ("--restart-downtime-s", args.restart_downtime_s),
        ("--prefix-weight", args.prefix_weight),
        ("--load-weight", args.load_weight),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            bail!("{flag} must be a finite number >= 0, got {v}");
        }
    }
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--rate must be a positive number of requests per second");
    }
    let capacities: Vec<usize> = (0..args.pods)
        .map(|p| {
            if args.heterogeneous && p % 2 == 1 {
                args.capacity_blocks / 2
            } else {
                args.capacity_blocks
            }
        })
        .collect();
    let end = requests.last().map_or(0.0, |r| r.arrival_ms);
    let settings = SimSettings {
        pod_capacity_blocks: capacities.clone(),
        event_delay_ms: args.event_delay_ms,
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
        seed: args.seed,
        ..Default::default()
    };
    let names: Vec<&str> = if args.policies == "all" {
        ALL.to_vec()
    } else {
        args.policies.split(',').map(str::trim).collect()
    };
    let mut reports = Vec::new();
    for name in names {
        let mut r = router(name, &capacities, &args)?;
        reports.push(run(&settings, &requests, r.as_mut()));
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, svg(&reports))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workload": args.workload, "requests": requests.len(), "seed": args.seed,
                "settings": settings, "results": reports,
            }))?
        );
        return Ok(());
    }
    println!(
        "{} requests ({}), {} pods, seed {}",
        requests.len(),
        args.workload,
        args.pods,
        args.seed
    );
    println!(
        "| policy | prefix-hit rate | prefill tokens | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | load spread |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &reports {
        println!(
            "| {} | {:.1}% | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
            r.policy,
            100.0 * r.token_hit_rate,
            r.prefill_tokens,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.load_spread
        );
    }
    Ok(())
}
