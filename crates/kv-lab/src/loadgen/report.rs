//! What a load run reports: sent and applied rates, ScorePods latency idle and under load, and
//! in soak mode the daemon's memory over time with a growth verdict.

use serde::Serialize;

use super::scrape::metric_sum;

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1e3
}

/// ScorePods latency over one phase.
#[derive(Debug, Clone, Serialize)]
pub struct ScorePhase {
    /// Calls made.
    pub calls: usize,
    /// Calls per second.
    pub calls_per_s: f64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Slowest call, microseconds.
    pub max_us: f64,
    /// Mean matched blocks of the best pod (0 means the prompts were not found); with
    /// `--ext-proc`, the share of requests answered with a pick; with `--http`, the share
    /// answered 2xx.
    pub avg_matched_blocks: f64,
}

impl ScorePhase {
    pub(super) fn of(sorted_ns: &[u64], matched: u64, seconds: f64) -> Self {
        Self {
            calls: sorted_ns.len(),
            calls_per_s: sorted_ns.len() as f64 / seconds.max(1e-9),
            p50_us: percentile(sorted_ns, 50.0),
            p99_us: percentile(sorted_ns, 99.0),
            max_us: percentile(sorted_ns, 100.0),
            avg_matched_blocks: matched as f64 / sorted_ns.len().max(1) as f64,
        }
    }
}

/// What a load run measured: sent and applied rates (from the daemon's own counters, before
/// and after) and ScorePods latency idle (the baseline, same run) and under load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadgenReport {
    /// What the callers timed: `ScorePods`, or `picks` (the endpoint picker, `--ext-proc`).
    pub calls: &'static str,
    /// Seconds of load (0 for a warm-up-only run).
    pub duration_s: f64,
    /// Simulated pods.
    pub pods: u32,
    /// Blocks per prompt.
    pub prompt_blocks: usize,
    /// ZMQ messages sent per second.
    pub sent_messages_per_s: f64,
    /// Blocks sent per second (stores and removals).
    pub sent_blocks_per_s: f64,
    /// Blocks the daemon applied per second.
    pub applied_blocks_per_s: f64,
    /// Events the daemon applied per second.
    pub applied_events_per_s: f64,
    /// Sequence gaps the daemon counted.
    pub sequence_gaps: f64,
    /// Messages the daemon counted as lost.
    pub messages_lost: f64,
    /// ScorePods on the idle daemon.
    pub score_idle: ScorePhase,
    /// ScorePods under event load (`None` for a warm-up-only run).
    pub score_under_load: Option<ScorePhase>,
    /// Index lookups the daemon made during the load (its picks' or ScorePods' walks).
    pub lookups: f64,
    /// Share of those lookups in which some pod held the prompt's first block: a benchmark
    /// whose prompts never match the published blocks measures nothing.
    pub lookup_hit_share: f64,
    /// Soak mode: the memory samples and the verdict.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub soak: Option<SoakReport>,
    /// `--replica-metrics`: how the other replicas followed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaReport>,
    /// `--churn`: the pods that came and went.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub churn: Option<ChurnReport>,
    /// `--agree-with`: whether the other replicas hold what this one holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub agreement: Vec<AgreementReport>,
}

/// `--churn`: what the churning pods did.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    /// Pods that joined (and left).
    pub joined: u64,
    /// Pods joining per second, measured.
    pub joined_per_s: f64,
    /// Blocks they sent.
    pub blocks_sent: u64,
}

/// How another replica of a replicated deployment followed the load (through the log).
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaReport {
    /// Its metrics address.
    pub metrics: String,
    /// Blocks it applied since the load started.
    pub applied_blocks: f64,
    /// Whether it applied as many blocks as the daemon under load.
    pub caught_up: bool,
    /// Seconds from the load's start until it caught up (or last progressed).
    pub caught_up_after_s: f64,
    /// `applied_blocks / caught_up_after_s`: the end-to-end replication rate.
    pub applied_blocks_per_s: f64,
}

/// How one replica compared with the daemon under load.
#[derive(Debug, Clone, Serialize)]
pub struct AgreementReport {
    /// The other replica's gRPC address.
    pub replica: String,
    /// Whether both held the same memberships per (model, pod, rank) before the deadline.
    pub agree: bool,
    /// Publishers holding blocks on the daemon under load (at the last comparison).
    pub publishers: usize,
    /// Memberships on the daemon under load (at the last comparison).
    pub memberships: u64,
    /// Publishers whose memberships differ (0 when they agree).
    pub differing: usize,
    /// One difference, for the log: `model pod rank: here vs there`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub example: Option<String>,
    /// Seconds after the load until they agreed (or the deadline).
    pub waited_s: f64,
}

/// One soak sample of the daemon's own gauges.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSample {
    /// Seconds since the load started.
    pub at_s: f64,
    /// The daemon's resident memory.
    pub rss_bytes: f64,
    /// The index's memory, all models.
    pub index_bytes: f64,
    /// Block keys, all models.
    pub keys: f64,
    /// Messages waiting in worker queues.
    pub queue_depth: f64,
}

impl SoakSample {
    pub(super) fn read(at_s: f64, page: &str) -> Self {
        Self {
            at_s,
            rss_bytes: metric_sum(page, "kvindexer_process_resident_memory_bytes"),
            index_bytes: metric_sum(page, "kvindexer_index_memory_bytes"),
            keys: metric_sum(page, "kvindexer_index_keys"),
            queue_depth: metric_sum(page, "kvindexer_event_queue_depth"),
        }
    }
}

/// Soak mode's verdict: the load is steady (the index is bounded by design), so after a
/// warm-up half nothing should grow. `growth` compares the last quarter's mean with the
/// second quarter's, per gauge; `bounded` holds when none grew by more than 5%.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// Every sample, in order.
    pub samples: Vec<SoakSample>,
    /// Relative growth of RSS, index memory and keys (last quarter over second quarter).
    pub rss_growth: f64,
    /// Index memory growth, same measure.
    pub index_growth: f64,
    /// Key count growth, same measure.
    pub keys_growth: f64,
    /// No gauge grew by more than 5% after the warm-up.
    pub bounded: bool,
}

impl SoakReport {
    pub(super) fn of(samples: Vec<SoakSample>) -> Self {
        let n = samples.len();
        let mean = |range: std::ops::Range<usize>, f: &dyn Fn(&SoakSample) -> f64| {
            let slice = &samples[range];
            slice.iter().map(f).sum::<f64>() / slice.len().max(1) as f64
        };
        let growth = |f: &dyn Fn(&SoakSample) -> f64| {
            let (q2, q4) = (n / 4..(n / 2).max(n / 4 + 1), (3 * n / 4).min(n - 1)..n);
            let base = mean(q2, f);
            if base <= 0.0 {
                0.0
            } else {
                mean(q4, f) / base - 1.0
            }
        };
        let rss_growth = growth(&|s| s.rss_bytes);
        let index_growth = growth(&|s| s.index_bytes);
        let keys_growth = growth(&|s| s.keys);
        Self {
            bounded: [rss_growth, index_growth, keys_growth]
                .iter()
                .all(|g| *g <= 0.05),
            samples,
            rss_growth,
            index_growth,
            keys_growth,
        }
    }
}

impl LoadgenReport {
    /// The report as an operator reads it.
    pub fn to_text(&self) -> String {
        let soak = self.soak.as_ref().map_or(String::new(), |s| {
            let last = s.samples.last();
            format!(
                "\nsoak: {} samples; last RSS {:.0} MB, index {:.0} MB, {:.0} keys; growth after warm-up: RSS {:+.1}%, index {:+.1}%, keys {:+.1}% ({})",
                s.samples.len(),
                last.map_or(0.0, |l| l.rss_bytes / 1e6),
                last.map_or(0.0, |l| l.index_bytes / 1e6),
                last.map_or(0.0, |l| l.keys),
                100.0 * s.rss_growth,
                100.0 * s.index_growth,
                100.0 * s.keys_growth,
                if s.bounded { "bounded" } else { "GROWING" }
            )
        });
        let replicas: String = self
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "\nreplica {}: applied {:.0} blocks through the log, {} after {:.1}s: {:.0} blocks/s end to end",
                    r.metrics,
                    r.applied_blocks,
                    if r.caught_up { "caught up" } else { "NOT caught up" },
                    r.caught_up_after_s,
                    r.applied_blocks_per_s
                )
            })
            .collect();
        let churn = self.churn.as_ref().map_or(String::new(), |c| {
            format!(
                "\nchurn: {} pods joined and left ({:.1}/s), {} blocks stored by them",
                c.joined, c.joined_per_s, c.blocks_sent
            )
        });
        let agreement: String = self
            .agreement
            .iter()
            .map(|a| {
                format!(
                    "\nreplica {}: {} ({} publishers, {} memberships here; {} differ{}) after {:.1}s",
                    a.replica,
                    if a.agree { "agrees" } else { "DISAGREES" },
                    a.publishers,
                    a.memberships,
                    a.differing,
                    a.example.as_ref().map_or(String::new(), |e| format!(", e.g. {e}")),
                    a.waited_s
                )
            })
            .collect();
        self.to_text_without_soak() + &soak + &replicas + &churn + &agreement
    }

    fn to_text_without_soak(&self) -> String {
        let idle = &self.score_idle;
        let Some(loaded) = &self.score_under_load else {
            return format!(
                "warm-up only: {} pods stored one prompt each; {} idle {} calls, p50 {:.1} us, p99 {:.1} us",
                self.pods, self.calls, idle.calls, idle.p50_us, idle.p99_us
            );
        };
        format!(
            "load: {} pods, prompts of {} blocks, {:.1}s\n\
             sent:    {:>10.0} msgs/s  {:>12.0} blocks/s\n\
             applied: {:>10.0} events/s {:>12.0} blocks/s  (gaps {}, lost messages {})\n\
             {:<9} idle:       {:>7} calls  p50 {:>8.1} us  p99 {:>8.1} us\n\
             {:<9} under load: {:>7} calls  p50 {:>8.1} us  p99 {:>8.1} us  (p99 ratio to idle {:.2}; {:.0} calls/s)\n\
             index lookups under load: {:.0}, {:.1}% found a prefix",
            self.pods,
            self.prompt_blocks,
            self.duration_s,
            self.sent_messages_per_s,
            self.sent_blocks_per_s,
            self.applied_events_per_s,
            self.applied_blocks_per_s,
            self.sequence_gaps,
            self.messages_lost,
            self.calls,
            idle.calls,
            idle.p50_us,
            idle.p99_us,
            self.calls,
            loaded.calls,
            loaded.p50_us,
            loaded.p99_us,
            loaded.p99_us / idle.p99_us.max(1e-9),
            loaded.calls_per_s,
            self.lookups,
            100.0 * self.lookup_hit_share
        )
    }
}
