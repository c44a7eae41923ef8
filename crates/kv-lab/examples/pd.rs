//! Prefill/decode disaggregation on a Mooncake trace: llm-d's approximate P/D decision against
//! the exact one (kv-indexer's), at several thresholds and loads, beside aggregated baselines
//! (the same pods, every one prefilling and decoding). See docs/simulation.md, "Prefill/decode
//! disaggregation".
//!
//! ```sh
//! cargo run --release -p kv-lab --example pd -- --trace ../shared/traces/mooncake/conversation_trace.jsonl \
//!     --pd 2:6 --thresholds 0,16,256,1024 --time-scales 1,0.5 [--limit N] [--json]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use kv_core::SplitRule;
use kv_lab::simulate::pd::{run_pd, PdReport, PdSettings, TransferCost};
use kv_lab::simulate::pd_routers::{ExactPd, LlmdApproxPd, PdRouter, LLMD_PD_WEIGHTS};
use kv_lab::simulate::routers::{ApproxPrefix, CapacityGuess, Precise, Router};
use kv_lab::simulate::workloads::mooncake;
use kv_lab::simulate::{run, PolicyReport, SimRequest, SimSettings, ANCHOR_KV_TOKENS};
use kv_lab::trace::load_mooncake;

struct Args {
    trace: PathBuf,
    prefill: usize,
    decode: usize,
    thresholds: Vec<u32>,
    time_scales: Vec<f64>,
    limit: usize,
    capacity_blocks: usize,
    transfer: TransferCost,
    seed: u64,
    json: bool,
}

fn list<T: std::str::FromStr>(v: &str) -> Result<Vec<T>, String> {
    v.split(',')
        .map(|x| x.trim().parse().map_err(|_| format!("bad list item {x:?}")))
        .collect()
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        trace: PathBuf::from("../shared/traces/mooncake/conversation_trace.jsonl"),
        prefill: 2,
        decode: 6,
        thresholds: vec![0, 16, 256, 1024],
        time_scales: vec![1.0],
        limit: 0,
        capacity_blocks: ANCHOR_KV_TOKENS / 16,
        transfer: TransferCost::default(),
        seed: 42,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--json" {
            a.json = true;
            continue;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |what: &str| format!("{flag}: bad {what} {v:?}");
        match flag.as_str() {
            "--trace" => a.trace = PathBuf::from(&v),
            "--pd" => {
                let (p, d) = v.split_once(':').ok_or(num("P:D"))?;
                a.prefill = p.parse().map_err(|_| num("P:D"))?;
                a.decode = d.parse().map_err(|_| num("P:D"))?;
            }
            "--thresholds" => a.thresholds = list(&v)?,
            "--time-scales" => a.time_scales = list(&v)?,
            "--limit" => a.limit = v.parse().map_err(|_| num("count"))?,
            "--capacity-blocks" => a.capacity_blocks = v.parse().map_err(|_| num("count"))?,
            "--transfer-ms-per-token" => {
                a.transfer.ms_per_token = v.parse().map_err(|_| num("number"))?
            }
            "--transfer-base-ms" => a.transfer.base_ms = v.parse().map_err(|_| num("number"))?,
            "--seed" => a.seed = v.parse().map_err(|_| num("number"))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.decode == 0 || a.capacity_blocks == 0 {
        return Err("--pd needs at least one decode pod; --capacity-blocks at least 1".into());
    }
    if a.time_scales.iter().any(|&t| !(t > 0.0 && t.is_finite())) {
        return Err("--time-scales must be positive".into());
    }
    Ok(a)
}

/// The aggregated baselines: every pod prefills and decodes, routed by the gateway's
/// approximate scorer or kv-indexer's precise one, both at llm-d's P/D weights.
fn baselines(a: &Args, requests: &[SimRequest]) -> Vec<PolicyReport> {
    let sim = SimSettings {
        pod_capacity_blocks: vec![a.capacity_blocks; a.prefill + a.decode],
        seed: a.seed,
        ..SimSettings::default()
    };
    let approx: Box<dyn Router> = Box::new(ApproxPrefix::new(
        CapacityGuess::AutoTune,
        LLMD_PD_WEIGHTS,
        a.seed,
    ));
    let precise: Box<dyn Router> = Box::new(Precise::new(LLMD_PD_WEIGHTS, true, a.seed));
    [approx, precise]
        .into_iter()
        .map(|r| run(&sim, requests, &mut [r]))
        .collect()
}

fn pd_runs(a: &Args, requests: &[SimRequest]) -> Vec<PdReport> {
    let mut out = Vec::new();
    for &threshold in &a.thresholds {
        let settings = PdSettings {
            sim: SimSettings {
                pod_capacity_blocks: vec![a.capacity_blocks; a.prefill + a.decode],
                seed: a.seed,
                ..SimSettings::default()
            },
            prefill_pods: a.prefill,
            rule: SplitRule {
                threshold,
                min_prompt_tokens: 0,
            },
            transfer: a.transfer,
        };
        let routers: [Box<dyn PdRouter>; 3] = [
            Box::new(LlmdApproxPd::new(a.seed)),
            Box::new(LlmdApproxPd::new(a.seed).with_exact_decision()),
            Box::new(ExactPd::new(LLMD_PD_WEIGHTS, a.seed)),
        ];
        for mut r in routers {
            out.push(run_pd(&settings, requests, r.as_mut()));
        }
    }
    out
}

fn m(tokens: u64) -> f64 {
    tokens as f64 / 1e6
}

/// One table row: the columns after the policy's name.
struct Row {
    threshold: String,
    split: String,
    needless: String,
    missed: String,
    ttft_ms: [f64; 3],
    on_prefill: String,
    on_decode: String,
    total: u64,
    moved: String,
    preemptions: u64,
}

fn print_row(policy: &str, r: &Row) {
    let [p50, p90, p99] = r.ttft_ms.map(|t| t / 1e3);
    println!(
        "{policy:<22} {:>6} {:>6} {:>8} {:>7} {p50:>8.3} {p90:>8.3} {p99:>8.3} {:>9} {:>9} {:>8.1}M {:>9} {:>8}",
        r.threshold, r.split, r.needless, r.missed, r.on_prefill, r.on_decode, m(r.total),
        r.moved, r.preemptions
    );
}

fn print_table(scale: f64, n: usize, base: &[PolicyReport], pd: &[PdReport]) {
    println!("\ntime scale {scale} ({n} requests)");
    println!(
        "{:<22} {:>6} {:>6} {:>8} {:>7} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "policy",
        "thresh",
        "split",
        "needless",
        "missed",
        "p50 s",
        "p90 s",
        "p99 s",
        "pf on P",
        "pf on D",
        "pf total",
        "moved",
        "preempt"
    );
    let dash = || "-".to_string();
    for b in base {
        let row = Row {
            threshold: dash(),
            split: dash(),
            needless: dash(),
            missed: dash(),
            ttft_ms: [b.ttft_p50_ms, b.ttft_p90_ms, b.ttft_p99_ms],
            on_prefill: dash(),
            on_decode: dash(),
            total: b.prefill_tokens,
            moved: dash(),
            preemptions: b.preemptions,
        };
        print_row(&format!("aggregated {}", b.policy), &row);
    }
    for r in pd {
        let row = Row {
            threshold: r.threshold.to_string(),
            split: format!("{:.1}%", 100.0 * r.split_rate),
            needless: r.needless_splits.to_string(),
            missed: r.missed_splits.to_string(),
            ttft_ms: [r.ttft_p50_ms, r.ttft_p90_ms, r.ttft_p99_ms],
            on_prefill: format!("{:.1}M", m(r.prefill_tokens_on_prefill)),
            on_decode: format!("{:.1}M", m(r.prefill_tokens_on_decode)),
            total: r.prefill_tokens(),
            moved: format!("{:.1}M", m(r.transfer_tokens)),
            preemptions: r.engine.preemptions,
        };
        print_row(&r.policy, &row);
    }
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let trace = match load_mooncake(&a.trace) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {}: {e}", a.trace.display());
            return ExitCode::FAILURE;
        }
    };
    let mut all = Vec::new();
    for &scale in &a.time_scales {
        let mut requests = mooncake(&trace, 16, scale);
        if a.limit > 0 {
            requests.truncate(a.limit);
        }
        let base = baselines(&a, &requests);
        let pd = pd_runs(&a, &requests);
        if a.json {
            all.push(
                serde_json::json!({"time_scale": scale, "requests": requests.len(),
                "aggregated": base, "pd": pd}),
            );
        } else {
            print_table(scale, requests.len(), &base, &pd);
        }
    }
    if a.json {
        println!("{}", serde_json::Value::Array(all));
    }
    ExitCode::SUCCESS
}
