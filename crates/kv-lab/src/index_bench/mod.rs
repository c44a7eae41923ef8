//! The index benchmark: a Mooncake trace turned into the stream an index sees in a fleet
//! ([`workload`]: [`IndexWorkload::simulate`]), and a driver that measures any index on it.
//!
//! [`drive`] runs any [`IndexBackend`] through that stream on one thread, timing every query and
//! every step's events. Every backend is timed alike: before the first timer starts, a backend
//! converts the whole stream into its own input types ([`IndexBackend::prepare`]), so no
//! backend's timed region contains a conversion another's lacks; the timed region is the
//! index's own call (and, for a query, turning its result into a [`QueryAnswer`]).

use std::ops::Range;
use std::time::Instant;

use kv_core::mix64;
use kv_core::BlockHash;

mod backends;
mod file;
mod workload;

#[cfg(feature = "testing")]
pub use backends::ReferenceBackend;
pub use backends::{IndexerFacadeBackend, KvIndexerBackend, RunIndexBackend};
pub use workload::{Eviction, IndexWorkload, Removals, Step, StoreOp, WorkloadShape};

/// What a query found, reduced to numbers every backend can produce: the best pod's matched
/// blocks, and an order-independent digest of every (pod, matched blocks) pair with at least one
/// block, so two backends agree only if they report the same depth for the same pods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueryAnswer {
    /// The best pod's consecutive matched blocks.
    pub best: u32,
    /// Pods with at least one matched block.
    pub holders: u32,
    /// Wrapping sum of `mix64(pod << 32 | matched)` over those pods.
    pub digest: u64,
}

impl QueryAnswer {
    /// Adds one pod's result (pods with 0 blocks are ignored, as the digest defines).
    pub fn add(&mut self, pod: u32, matched: u32) {
        if matched == 0 {
            return;
        }
        self.best = self.best.max(matched);
        self.holders += 1;
        self.digest = self
            .digest
            .wrapping_add(mix64((pod as u64) << 32 | matched as u64));
    }
}

/// A stretch of the workload's blocks handed to a backend: where it sits in its slab (so a
/// backend that prepared its own copy of the slab reads that instead), its hashes and, for
/// queries and stores, its content hashes.
#[derive(Debug, Clone, Copy)]
pub struct Blocks<'a> {
    /// Start of the stretch in its slab ([`IndexWorkload::queries`], `stored` or `removed`).
    pub at: usize,
    /// The blocks' sequence hashes.
    pub hashes: &'a [BlockHash],
    /// The blocks' content-only hashes (empty for removals), for indexes keyed by content.
    pub content: &'a [u64],
}

impl<'a> Blocks<'a> {
    /// The stretch's range in its slab.
    pub fn range(&self) -> Range<usize> {
        self.at..self.at + self.hashes.len()
    }
}

/// An index under benchmark: ours, a peer's, or a baseline.
pub trait IndexBackend {
    /// A short name for reports.
    fn name(&self) -> &str;
    /// Converts `workload` into the backend's own input types, before any timer starts (a
    /// backend whose calls take the workload's slices as they are needs nothing).
    fn prepare(&mut self, _workload: &IndexWorkload) {}
    /// Queries the prompt; returns what every pod matched (see [`QueryAnswer`]).
    fn query(&mut self, prompt: Blocks<'_>) -> QueryAnswer;
    /// `pod` stored `blocks` after `parent`.
    fn store(&mut self, pod: u32, parent: Option<BlockHash>, blocks: Blocks<'_>);
    /// `pod` evicted `blocks`.
    fn remove(&mut self, pod: u32, blocks: Blocks<'_>);
    /// Frees what [`IndexBackend::prepare`] built (after the run, before memory is measured).
    fn release_input(&mut self) {}
    /// The backend's own shape figures after a run (runs, splits), for the report.
    fn shape(&self) -> Option<String> {
        None
    }
}

/// What one run of the benchmark measured.
#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    /// Backend name.
    pub backend: String,
    /// Blocks queried + stored + removed.
    pub block_ops: u64,
    /// Seconds spent in queries.
    pub query_seconds: f64,
    /// Seconds spent applying stores and removals.
    pub apply_seconds: f64,
    /// Per-query latencies, nanoseconds, sorted.
    pub query_ns: Vec<u64>,
    /// Sum of the best match per query (must agree across exact backends).
    pub checksum: u64,
    /// Every query's answer, in order (compared with a reference by [`BenchReport::mismatches`]).
    pub answers: Vec<QueryAnswer>,
    /// The driving thread's time on a CPU and waiting for one over the whole stream (queries,
    /// events and the driver's own bookkeeping), from the kernel's scheduler statistics; `None`
    /// where they cannot be read. On a shared machine the first is the steadier figure.
    pub cpu: Option<CpuTime>,
}

/// A thread's scheduler times over a stretch of work.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTime {
    /// Seconds on a CPU.
    pub running: f64,
    /// Seconds runnable but waiting for a CPU (other work on the machine).
    pub waiting: f64,
    /// Of `running`: seconds in user mode and in the kernel (page faults: memory first
    /// touched), from `/proc/thread-self/stat` (10 ms ticks); 0 where it cannot be read.
    pub user: f64,
    /// See [`CpuTime::user`].
    pub system: f64,
}

/// The calling thread's (running, waiting) nanoseconds so far, from
/// `/proc/thread-self/schedstat`.
fn schedstat() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some((fields.next()??, fields.next()??))
}

impl BenchReport {
    /// Block operations per second of index time.
    pub fn block_ops_per_sec(&self) -> f64 {
        self.block_ops as f64 / (self.query_seconds + self.apply_seconds)
    }

    /// Block operations per second the driving thread spent on a CPU over the whole stream
    /// (the driver's bookkeeping included, alike for every backend).
    pub fn block_ops_per_cpu_sec(&self) -> Option<f64> {
        self.cpu.map(|c| self.block_ops as f64 / c.running)
    }

    /// Queries whose answer differs from `reference`'s (0 for an exact index against the
    /// reference).
    pub fn mismatches(&self, reference: &BenchReport) -> usize {
        self.answers
            .iter()
            .zip(&reference.answers)
            .filter(|(a, b)| a != b)
            .count()
            + self.answers.len().abs_diff(reference.answers.len())
    }

    /// Queries answered with fewer holders than `reference` found (a bounded index
    /// under-counting).
    pub fn short_answers(&self, reference: &BenchReport) -> usize {
        self.answers
            .iter()
            .zip(&reference.answers)
            .filter(|(a, b)| a.holders < b.holders)
            .count()
    }

    /// Nearest-rank percentile of query latency, microseconds.
    pub fn query_percentile_us(&self, p: f64) -> f64 {
        if self.query_ns.is_empty() {
            return 0.0;
        }
        let rank = ((p / 100.0) * self.query_ns.len() as f64).ceil() as usize;
        self.query_ns[rank.clamp(1, self.query_ns.len()) - 1] as f64 / 1e3
    }
}

/// The calling thread's (user, system) seconds so far, from `/proc/thread-self/stat` (fields
/// 14 and 15, in clock ticks of 10 ms).
fn user_system() -> Option<(f64, f64)> {
    let text = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let mut fields = text.rsplit_once(')')?.1.split_whitespace().skip(11);
    let mut tick = || fields.next()?.parse::<u64>().ok().map(|t| t as f64 / 100.0);
    Some((tick()?, tick()?))
}

/// Runs `workload` against `backend` on the calling thread, timing every query and every
/// step's events (removals, then stores, as vLLM's scheduler step emits them). The backend
/// prepares its input before and releases it after, both untimed.
pub fn drive(workload: &IndexWorkload, backend: &mut dyn IndexBackend) -> BenchReport {
    let mut report = BenchReport {
        backend: backend.name().to_owned(),
        query_ns: Vec::with_capacity(workload.steps.len()),
        answers: Vec::with_capacity(workload.steps.len()),
        ..Default::default()
    };
    let (q, s, r) = workload.totals();
    report.block_ops = (q + s + r) as u64;
    backend.prepare(workload);
    let started = schedstat();
    let started_modes = user_system();
    let mut apply_ns = 0u128;
    let mut query_total = 0u128;
    for step in &workload.steps {
        let prompt = Blocks {
            at: step.query.start,
            hashes: &workload.queries[step.query.clone()],
            content: &workload.query_content[step.query.clone()],
        };
        let t = Instant::now();
        let answer = backend.query(prompt);
        let dt = t.elapsed().as_nanos();
        report.query_ns.push(dt as u64);
        query_total += dt;
        report.checksum += answer.best as u64;
        report.answers.push(answer);
        let t = Instant::now();
        for call in workload.removal_calls(step) {
            let removed = Blocks {
                at: call.start,
                hashes: &workload.removed[call],
                content: &[],
            };
            backend.remove(step.pod, removed);
        }
        for op in &step.stores {
            let stored = Blocks {
                at: op.blocks.start,
                hashes: &workload.stored[op.blocks.clone()],
                content: &workload.stored_content[op.blocks.clone()],
            };
            backend.store(step.pod, op.parent, stored);
        }
        apply_ns += t.elapsed().as_nanos();
    }
    let (user, system) = started_modes
        .zip(user_system())
        .map_or((0.0, 0.0), |((u0, s0), (u1, s1))| (u1 - u0, s1 - s0));
    report.cpu = started
        .zip(schedstat())
        .map(|((r0, w0), (r1, w1))| CpuTime {
            running: r1.saturating_sub(r0) as f64 / 1e9,
            waiting: w1.saturating_sub(w0) as f64 / 1e9,
            user,
            system,
        });
    backend.release_input();
    report.query_ns.sort_unstable();
    report.query_seconds = query_total as f64 / 1e9;
    report.apply_seconds = apply_ns as f64 / 1e9;
    report
}

/// The median of `values` (the upper one of an even count; 0 when empty): benchmarks report
/// medians of their rounds.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// What [`apply_in_lanes`] measured.
#[derive(Debug, Clone, Copy)]
pub struct LaneRun {
    /// Stored plus removed blocks per second of wall time.
    pub apply_blocks_per_sec: f64,
    /// Blocks applied by the busiest thread over all blocks (1/threads when even).
    pub busiest_share: f64,
}

/// Applies the workload's stores and removals (no queries), in trace order per pod, to an
/// exact index with `lanes` writer lanes from `threads` threads: thread `t` applies the events
/// of the engines with `id % threads == t`, so with `threads == lanes` each thread writes one
/// lane and never waits for another.
pub fn apply_in_lanes(
    workload: &IndexWorkload,
    pods: u32,
    lanes: usize,
    threads: usize,
) -> LaneRun {
    let backend = KvIndexerBackend::with_config(
        pods,
        kv_core::IndexConfig {
            max_keys: 1 << 26,
            writer_lanes: lanes,
            ..Default::default()
        },
    );
    let index = &backend.index;
    let engines = &backend.engines;
    let threads = threads.max(1);
    let mut per_thread = vec![0usize; threads];
    for step in &workload.steps {
        let t = engines[step.pod as usize] as usize % threads;
        per_thread[t] +=
            step.stores.iter().map(|op| op.blocks.len()).sum::<usize>() + step.removed.len();
    }
    let total: usize = per_thread.iter().sum();
    let start = std::sync::Barrier::new(threads);
    let t0 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for step in &workload.steps {
                        let engine = engines[step.pod as usize];
                        if engine as usize % threads != t {
                            continue;
                        }
                        index.write(engine, |w| {
                            w.remove(
                                engine,
                                kv_core::Tier::Gpu,
                                &workload.removed[step.removed.clone()],
                            );
                            for op in &step.stores {
                                w.store(
                                    engine,
                                    kv_core::Tier::Gpu,
                                    op.parent,
                                    &workload.stored[op.blocks.clone()],
                                );
                            }
                        });
                    }
                    t0
                })
            })
            .collect();
        let starts: Vec<Instant> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
        starts.into_iter().min()
    });
    let seconds = t0.map_or(f64::INFINITY, |t| t.elapsed().as_secs_f64());
    LaneRun {
        apply_blocks_per_sec: total as f64 / seconds,
        busiest_share: per_thread.iter().copied().max().unwrap_or(0) as f64 / total.max(1) as f64,
    }
}

#[cfg(test)]
mod tests;
