//! kv-indexer's index against its peers on the Mooncake conversation trace, one thread: SMG
//! `kv-index` 2.0 `ChainIndex`, NVIDIA Dynamo `dynamo-kv-router` 1.6 `RadixTree`, and kv-core's
//! reference index (a per-block map), which every answer is checked against.
//!
//! How every backend is treated alike:
//! - **The stream** is `kv_lab::index_bench::IndexWorkload`: pods evict as vLLM's free queue
//!   orders a finished request's blocks (tail first, so pods keep prefixes), and each request's
//!   evictions come before its stores, as one scheduler step emits them. The trace is looped
//!   (`KV_BENCH_LOOPS`, default 3: the trace again after itself with fresh block ids), so one
//!   backend's run lasts seconds and a page-fault storm moves a figure little.
//! - **The timed region** is the index's own call. Before any timer starts, each backend
//!   converts the whole stream into its own types (SMG's `StoredBlock`s and `SequenceHash`es,
//!   Dynamo's events and query vectors; kv-indexer reads the stream's `BlockHash` slices as
//!   they are).
//! - **A fresh process per measurement**: every (backend, round) runs in a child process of
//!   its own (this binary with `--child`), so no backend inherits another's freed heap; rounds
//!   rotate the backends' order, so slow minutes of the shared machine fall on each in turn.
//!   Five rounds (`KV_BENCH_RUNS`); the tables show the median and the range (min-max), ratios
//!   against SMG as the median of the per-round ratios, and the load average seen as each
//!   child started.
//! - **Exactness**: the reference runs once per fleet in a child of its own; every other
//!   child's answers (each pod's matched depth per query) are compared with its answers.
//!
//! SMG's own replay (`benches/mooncake_replay` in the `kv-index` crate) is an open-loop,
//! multi-threaded harness: it replays an exported corpus at scaled deadlines on query and event
//! lanes and counts block operations (requested, stored and removed block hashes) over the
//! time to the last completion. What this harness matches: the block-op count, one fresh
//! process per trial, mimalloc for every backend (`--features mimalloc`; its binary links
//! mimalloc), nearest-rank percentiles, the engines' eviction order (its churn generator's
//! default is the mock engine's tail-first order), and one charge for every backend's input:
//! its default (`--owned-payloads`) charges every backend a copy from a 40-byte wire record
//! inside the timed lane; its `--owned-payloads off` charges none; this harness charges none
//! (the conversion is prepared before the timer). What it does not: lanes, threads and
//! deadlines. Here one thread calls the index back to back and only the index's calls are
//! timed, which is a closed-loop, single-writer figure, not SMG's sustained rate.
//!
//! Usage: `cargo run --release --manifest-path benches/peers/Cargo.toml --features mimalloc
//! [-- TRACE.jsonl]`. `KV_BENCH_FLEETS` picks fleets (default `16,1024`; keys in `fleets()`),
//! `KV_BENCH_BACKENDS` backends (default `smg,dynamo,ours,lanes`; keys in
//! `measure::BACKENDS`; `key@PATH` runs that backend from another build of this harness, to
//! compare builds alternated in one run).

mod measure;
mod peers;

use std::path::{Path, PathBuf};
use std::process::Command;

#[cfg(not(any(feature = "mimalloc", feature = "jemalloc")))]
use kv_lab::alloc::CountingAllocator;
use kv_lab::index_bench::{median, Eviction, IndexWorkload, QueryAnswer, Removals, WorkloadShape};
use kv_lab::trace::load_mooncake;
use measure::Measured;

#[cfg(not(any(feature = "mimalloc", feature = "jemalloc")))]
#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

/// `--features mimalloc`: every backend on mimalloc instead of glibc (the allocator comparison).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: kv_lab::alloc::CountingAllocator<mimalloc::MiMalloc> =
    kv_lab::alloc::CountingAllocator(mimalloc::MiMalloc);

/// `--features jemalloc`: every backend on jemalloc.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static GLOBAL: kv_lab::alloc::CountingAllocator<tikv_jemallocator::Jemalloc> =
    kv_lab::alloc::CountingAllocator(tikv_jemallocator::Jemalloc);

/// A fleet to replay the trace on: its key, what it is, its shape.
fn fleets() -> Vec<(&'static str, &'static str, WorkloadShape)> {
    let loops = env_number("KV_BENCH_LOOPS", 3) as u32;
    let base = WorkloadShape {
        loops,
        ..WorkloadShape::default()
    };
    let one = Removals::OnePerEvent;
    vec![
        ("16", "16 pods, evictions tail first (as vLLM's free queue), one removal call per request", base),
        ("16e", "16 pods, tail first, one hash per removal call (vLLM's one BlockRemoved per block)", WorkloadShape { removals: one, ..base }),
        ("16x", "16 pods, evictions head first (the order before 2026-11-27: holes; a stress case)", WorkloadShape { eviction: Eviction::HeadFirst, ..base }),
        ("16h", "16 pods, one hash per removal call in a shuffled order (holes anywhere; a stress case)", WorkloadShape { removals: Removals::Shuffled, ..base }),
        ("80", "80 pods", WorkloadShape { pods: 80, ..base }),
        ("1024", "1,024 pods", WorkloadShape { pods: 1024, ..base }),
        ("1024s", "1,024 pods, 128-block system prompt on every request", WorkloadShape { pods: 1024, shared_prefix_blocks: 128, ..base }),
    ]
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        std::process::exit(child_main(&args[2..]));
    }
    if args.get(1).map(String::as_str) == Some("--save") {
        std::process::exit(save_main(&args[2..]));
    }
    let trace = args.get(1).cloned().unwrap_or_else(default_trace);
    let requests = load_mooncake(Path::new(&trace)).unwrap_or_else(|e| {
        eprintln!("cannot read the trace {trace}: {e}");
        std::process::exit(2);
    });
    let wanted = std::env::var("KV_BENCH_FLEETS").unwrap_or_else(|_| "16,1024".into());
    let backends =
        std::env::var("KV_BENCH_BACKENDS").unwrap_or_else(|_| "smg,dynamo,ours,lanes".into());
    let backends: Vec<Backend> = backends.split(',').filter_map(Backend::parse).collect();
    let runs = env_number("KV_BENCH_RUNS", 5).max(1);
    for (key, label, shape) in fleets() {
        if !wanted.split(',').any(|w| w.trim() == key) {
            continue;
        }
        // Built once, read back by every child.
        let t = std::time::Instant::now();
        let workload = IndexWorkload::simulate(&requests, shape);
        let file =
            std::env::temp_dir().join(format!("kv-peers-{}-{key}.workload", std::process::id()));
        if let Err(e) = workload.save(&file) {
            eprintln!("{}: {e}", file.display());
            std::process::exit(2);
        }
        let summary = format!(
            "{}; built in {:.1}s",
            workload.summary(),
            t.elapsed().as_secs_f64()
        );
        drop(workload);
        let fleet = Fleet {
            key,
            label,
            file: &file,
            pods: shape.pods,
        };
        run_fleet(&fleet, &summary, &backends, runs);
        let _ = std::fs::remove_file(&file);
    }
}

/// `--save FLEET PATH [TRACE]`: writes the fleet's stream to `PATH`, for profiling one backend
/// with `--child PATH PODS BACKEND ANSWERS` under `perf` or `valgrind`.
fn save_main(args: &[String]) -> i32 {
    let (Some(fleet), Some(path)) = (args.first(), args.get(1)) else {
        eprintln!("usage: --save FLEET PATH [TRACE]");
        return 2;
    };
    let Some((.., shape)) = fleets().into_iter().find(|(k, ..)| k == fleet) else {
        eprintln!("no fleet {fleet:?}");
        return 2;
    };
    let trace = args.get(2).cloned().unwrap_or_else(default_trace);
    let saved = load_mooncake(Path::new(&trace))
        .map_err(|e| e.to_string())
        .and_then(|requests| {
            let w = IndexWorkload::simulate(&requests, shape);
            println!("{} pods: {}", shape.pods, w.summary());
            w.save(Path::new(path)).map_err(|e| e.to_string())
        });
    match saved {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// The Mooncake trace in `../shared`, beside the checkout.
fn default_trace() -> String {
    format!(
        "{}/../../../shared/traces/mooncake/conversation_trace.jsonl",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `--child WORKLOAD PODS BACKEND ANSWERS`: one measurement (see `measure`).
fn child_main(args: &[String]) -> i32 {
    let [workload, pods, backend, answers] = args else {
        eprintln!("usage: --child WORKLOAD PODS BACKEND ANSWERS");
        return 2;
    };
    let Ok(pods) = pods.parse() else {
        eprintln!("pods: {pods:?} is not a number");
        return 2;
    };
    let workload = match IndexWorkload::load(Path::new(workload)) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{workload}: {e}");
            return 2;
        }
    };
    match measure::child(&workload, pods, backend, Path::new(answers)) {
        Ok(m) => {
            println!("{}", m.line());
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// A backend row: its key, and the binary it runs from.
struct Backend {
    key: String,
    binary: PathBuf,
    /// Shown after the backend's name when it runs from another build.
    tag: String,
}

impl Backend {
    fn parse(spec: &str) -> Option<Self> {
        let spec = spec.trim();
        let (key, binary) = match spec.split_once('@') {
            Some((k, path)) => (k, PathBuf::from(path)),
            None => (spec, std::env::current_exe().ok()?),
        };
        let tag = match spec.contains('@') {
            true => format!(" [{}]", binary.file_name()?.to_string_lossy()),
            false => String::new(),
        };
        if !measure::BACKENDS.iter().any(|(k, _)| *k == key) {
            eprintln!("no backend {key:?}; keys: {:?}", measure::BACKENDS);
            return None;
        }
        Some(Self {
            key: key.into(),
            binary,
            tag,
        })
    }
}

/// One backend's rounds on one fleet.
#[derive(Default)]
struct Rounds {
    name: String,
    runs: Vec<Measured>,
    mismatches: usize,
    short: usize,
    loads: Vec<f64>,
}

/// The 1-minute load average now.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// A fleet's prepared stream, for its children.
struct Fleet<'a> {
    key: &'a str,
    label: &'a str,
    file: &'a Path,
    pods: u32,
}

/// Runs `backend` on `fleet` in a child process; its figures and answers.
fn spawn(
    backend: &Backend,
    fleet: &Fleet,
    tag: &str,
) -> Result<(Measured, Vec<QueryAnswer>), String> {
    let answers = std::env::temp_dir().join(format!(
        "kv-peers-{}-{}-{}-{tag}.answers",
        std::process::id(),
        fleet.key,
        backend.key
    ));
    let out = Command::new(&backend.binary)
        .arg("--child")
        .arg(fleet.file)
        .arg(fleet.pods.to_string())
        .arg(&backend.key)
        .arg(&answers)
        .output()
        .map_err(|e| format!("{}: {e}", backend.binary.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{} on {} failed: {}{}",
            backend.key,
            fleet.key,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let measured = stdout.lines().find_map(Measured::parse);
    let read = measure::read_answers(&answers).map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&answers);
    Ok((measured.ok_or("no RESULT line")?, read?))
}

fn run_fleet(fleet: &Fleet, summary: &str, backends: &[Backend], runs: usize) {
    let reference = Backend::parse("reference").expect("the reference backend exists");
    let truth = match spawn(&reference, fleet, "truth") {
        Ok((_, truth)) => truth,
        Err(e) => {
            eprintln!("{e}");
            return;
        }
    };
    println!("### {}: {summary}", fleet.label);
    println!();
    println!(
        "{runs} rounds, each backend in a fresh process, order rotated per round; median [min-max]"
    );
    println!();
    let mut rounds: Vec<Rounds> = backends.iter().map(|_| Rounds::default()).collect();
    for round in 0..runs {
        for k in 0..backends.len() {
            let i = (k + round) % backends.len();
            let load = load_average();
            match spawn(&backends[i], fleet, &round.to_string()) {
                Ok((m, answers)) => {
                    let acc = &mut rounds[i];
                    acc.name = format!("{}{}", m.name, backends[i].tag);
                    acc.mismatches = acc
                        .mismatches
                        .max(mismatches(&answers, &truth, |a, b| a != b));
                    acc.short = acc
                        .short
                        .max(mismatches(&answers, &truth, |a, b| a.holders < b.holders));
                    acc.loads.push(load);
                    acc.runs.push(m);
                }
                Err(e) => eprintln!("{e}"),
            }
        }
    }
    print_table(backends, &rounds);
}

/// Queries where `differs(answer, truth)` (a missing answer counts).
fn mismatches(
    answers: &[QueryAnswer],
    truth: &[QueryAnswer],
    differs: impl Fn(&QueryAnswer, &QueryAnswer) -> bool,
) -> usize {
    answers
        .iter()
        .zip(truth)
        .filter(|(a, b)| differs(a, b))
        .count()
        + answers.len().abs_diff(truth.len())
}

/// `median [min-max]` of `values`, formatted by `f`.
fn spread(values: &[f64], f: impl Fn(f64) -> String) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{} [{}-{}]", f(median(values)), f(min), f(max))
}

fn print_table(backends: &[Backend], rounds: &[Rounds]) {
    let smg = backends
        .iter()
        .position(|b| b.key == "smg" && b.tag.is_empty());
    println!("| backend | block-ops/s | apply blocks/s | block-ops per CPU-s | query p50 | query p99 | bytes/membership | ops/s vs SMG | apply vs SMG | per CPU-s vs SMG | queries differing (short) | load avg | s waiting for a CPU | CPU s user / kernel |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let m = |x: f64| format!("{:.1}M", x / 1e6);
    let us = |x: f64| format!("{x:.2}");
    let ratio = |x: f64| format!("{x:.2}");
    for acc in rounds.iter().filter(|a| !a.runs.is_empty()) {
        let col = |f: fn(&Measured) -> f64| acc.runs.iter().map(f).collect::<Vec<_>>();
        // Per-round ratios against SMG's run of the same round.
        let against = |f: fn(&Measured) -> f64| {
            let smg = &rounds[smg?];
            let r: Vec<f64> = acc
                .runs
                .iter()
                .zip(&smg.runs)
                .map(|(a, b)| f(a) / f(b))
                .collect();
            (!r.is_empty()).then(|| spread(&r, ratio))
        };
        println!(
            "| {} | {} | {} | {} | {} us | {} us | {:.1} | {} | {} | {} | {} ({}) | {} | {} | {:.2} / {:.2} |",
            acc.name,
            spread(&col(|r| r.ops), m),
            spread(&col(|r| r.apply), m),
            spread(&col(|r| r.cpu_ops), m),
            us(median(&col(|r| r.p50))),
            spread(&col(|r| r.p99), us),
            median(&col(|r| r.bytes)),
            against(|r| r.ops).unwrap_or_else(|| "-".into()),
            against(|r| r.apply).unwrap_or_else(|| "-".into()),
            against(|r| r.cpu_ops).unwrap_or_else(|| "-".into()),
            acc.mismatches,
            acc.short,
            spread(&acc.loads, |x| format!("{x:.1}")),
            spread(&col(|r| r.waiting), |x| format!("{x:.2}")),
            median(&col(|r| r.user)),
            median(&col(|r| r.system)),
        );
    }
    println!();
    for acc in rounds {
        if let Some(last) = acc.runs.last().filter(|r| !r.shape.is_empty()) {
            println!("- {}, last round: {}", acc.name, last.shape);
        }
        let secs: Vec<f64> = acc.runs.iter().map(|r| r.seconds).collect();
        if !secs.is_empty() {
            println!(
                "- {}: {} s per run (index time and untimed preparation)",
                acc.name,
                spread(&secs, |x| format!("{x:.1}"))
            );
        }
    }
    println!();
}
