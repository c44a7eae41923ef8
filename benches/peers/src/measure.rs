//! One measurement in a process of its own (`--child`): the fleet's workload built, one
//! backend made, prepared and driven once; its figures printed as one line for the parent, its
//! answers written to a file for the parent to compare with the reference's.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use kv_core::IndexConfig;
use kv_lab::alloc::live_heap_bytes;
use kv_lab::index_bench::{
    drive, IndexBackend, IndexWorkload, IndexerFacadeBackend, KvIndexerBackend, QueryAnswer,
    ReferenceBackend, RunIndexBackend,
};

use crate::peers::{Dynamo, Smg};

/// The backends by key (`KV_BENCH_BACKENDS`), and what each is.
pub const BACKENDS: &[(&str, &str)] = &[
    (
        "reference",
        "kv-core's reference index (a per-block map): answers only",
    ),
    ("smg", "SMG kv-index 2.0 ChainIndex"),
    (
        "smg-converting",
        "SMG converting its input inside the timer (the harness before 2026-11-27)",
    ),
    ("dynamo", "Dynamo dynamo-kv-router 1.6 RadixTree"),
    ("ours", "kv-indexer's ModelIndex, one writer lane (exact)"),
    (
        "lanes",
        "kv-indexer's ModelIndex, two writer lanes (the daemon's default)",
    ),
    (
        "runs",
        "kv-indexer's bare RunIndex (no lanes, no key budget)",
    ),
    (
        "facade",
        "kv-indexer through its Indexer facade (builds decoded batches per call)",
    ),
    (
        "bounded",
        "kv-indexer with podCacheSize 10 (llm-d's setting; inexact)",
    ),
];

/// The backend `key` for a fleet of `pods`.
fn make(key: &str, pods: u32) -> Option<Box<dyn IndexBackend>> {
    let lanes = |writer_lanes| {
        let config = IndexConfig {
            max_keys: 1 << 26,
            writer_lanes,
            ..Default::default()
        };
        Box::new(KvIndexerBackend::with_config(pods, config))
    };
    Some(match key {
        "reference" => Box::new(ReferenceBackend::default()),
        "smg" => Box::new(Smg::new(pods)),
        "smg-converting" => Box::new(Smg::with_conversion(pods, true)),
        "dynamo" => Box::new(Dynamo::new()),
        "ours" => lanes(1),
        "lanes" => lanes(2),
        "runs" => Box::new(RunIndexBackend::new()),
        "facade" => Box::new(IndexerFacadeBackend::new(pods)),
        "bounded" => Box::new(KvIndexerBackend::with_pod_cache_size(pods, Some(10))),
        _ => return None,
    })
}

/// What the child prints (one tab-separated line starting `RESULT`).
pub struct Measured {
    pub name: String,
    pub ops: f64,
    pub apply: f64,
    pub p50: f64,
    pub p99: f64,
    pub bytes: f64,
    pub seconds: f64,
    /// Block ops per second on a CPU, and seconds spent waiting for one (0 when unknown).
    pub cpu_ops: f64,
    pub waiting: f64,
    pub shape: String,
    /// Of the CPU time over the stream: seconds in user mode and in the kernel (0: unknown).
    pub user: f64,
    pub system: f64,
}

impl Measured {
    /// The line the child prints.
    pub fn line(&self) -> String {
        format!(
            "RESULT\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.name,
            self.ops,
            self.apply,
            self.p50,
            self.p99,
            self.bytes,
            self.seconds,
            self.cpu_ops,
            self.waiting,
            self.shape,
            self.user,
            self.system
        )
    }

    /// Parses the child's line.
    pub fn parse(line: &str) -> Option<Self> {
        let f: Vec<&str> = line.strip_prefix("RESULT\t")?.split('\t').collect();
        let num = |i: usize| f.get(i)?.parse::<f64>().ok();
        Some(Self {
            name: f.first()?.to_string(),
            ops: num(1)?,
            apply: num(2)?,
            p50: num(3)?,
            p99: num(4)?,
            bytes: num(5)?,
            seconds: num(6)?,
            // Builds before 2026-11-27 print no scheduler times: the shape follows at once.
            cpu_ops: num(7).unwrap_or(0.0),
            waiting: num(8).unwrap_or(0.0),
            shape: f
                .get(if num(7).is_some() { 9 } else { 7 })
                .unwrap_or(&"")
                .to_string(),
            // Builds before 2026-11-28 print no user/system split.
            user: num(10).unwrap_or(0.0),
            system: num(11).unwrap_or(0.0),
        })
    }
}

/// Runs backend `key` on `workload` in this process and writes its answers to `answers`.
pub fn child(
    workload: &IndexWorkload,
    pods: u32,
    key: &str,
    answers: &Path,
) -> Result<Measured, String> {
    let before = live_heap_bytes();
    let mut backend = make(key, pods).ok_or_else(|| format!("no backend {key:?}"))?;
    let t = Instant::now();
    let report = drive(workload, backend.as_mut());
    let seconds = t.elapsed().as_secs_f64();
    // The report's own vectors are the driver's, not the backend's.
    let report_bytes = report.query_ns.capacity() * std::mem::size_of::<u64>()
        + report.answers.capacity() * std::mem::size_of::<QueryAnswer>();
    let bytes = live_heap_bytes().saturating_sub(before + report_bytes);
    let (_, s, r) = workload.totals();
    let measured = Measured {
        name: report.backend.clone(),
        ops: report.block_ops_per_sec(),
        apply: (s + r) as f64 / report.apply_seconds,
        p50: report.query_percentile_us(50.0),
        p99: report.query_percentile_us(99.0),
        bytes: bytes as f64 / workload.final_memberships as f64,
        seconds,
        cpu_ops: report.block_ops_per_cpu_sec().unwrap_or(0.0),
        waiting: report.cpu.map_or(0.0, |c| c.waiting),
        shape: backend.shape().unwrap_or_default().replace('\t', " "),
        user: report.cpu.map_or(0.0, |c| c.user),
        system: report.cpu.map_or(0.0, |c| c.system),
    };
    write_answers(answers, &report.answers).map_err(|e| format!("{}: {e}", answers.display()))?;
    Ok(measured)
}

/// Answers as 16-byte records (best, holders, digest; little-endian).
fn write_answers(path: &Path, answers: &[QueryAnswer]) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for a in answers {
        out.write_all(&a.best.to_le_bytes())?;
        out.write_all(&a.holders.to_le_bytes())?;
        out.write_all(&a.digest.to_le_bytes())?;
    }
    out.flush()
}

/// Reads what [`write_answers`] wrote.
pub fn read_answers(path: &Path) -> std::io::Result<Vec<QueryAnswer>> {
    let bytes = std::fs::read(path)?;
    Ok(bytes
        .chunks_exact(16)
        .map(|c| QueryAnswer {
            best: u32::from_le_bytes(c[0..4].try_into().unwrap_or_default()),
            holders: u32::from_le_bytes(c[4..8].try_into().unwrap_or_default()),
            digest: u64::from_le_bytes(c[8..16].try_into().unwrap_or_default()),
        })
        .collect())
}
