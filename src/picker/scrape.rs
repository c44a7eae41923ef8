//! The pods' load: each pod's Prometheus endpoint (`endpointPicker.metricsUrlTemplate`) read
//! every `metricsInterval` for `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
//!
//! Invariants: one loop per pod, so a slow pod delays only its own samples; at most
//! [`MAX_CONCURRENT_SCRAPES`] reads are in flight at once, and all pods together are read at
//! most `metricsMaxScrapesPerSecond` times a second, each pod's interval stretched to
//! `pods / metricsMaxScrapesPerSecond` when the fleet is larger (and the age a sample may
//! reach before it is stale with it, [`Scraper::stale_after`]), so 10,000 endpoints cost what
//! the budget says; a read is bounded in time (a second at most) and in body size
//! ([`MAX_METRICS_BYTES`]); every failure is counted by kind (`kvindexer_picker_scrapes_total`)
//! and leaves the last sample to age, so a pick scores the pod as the pool's median rather
//! than on stale numbers; each read's outcome goes to the pool's health rule: no connection
//! (refused, reset, a TCP connect that timed out) counts against the endpoint, a slow answer
//! counts for nothing, any answer for it; pods are scraped while the pool holds them, at most
//! [`MAX_SCRAPED_PODS`] (the rest counted, and scored as the median).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::pool::Pool;
use kv_core::{mix64, PodMetrics, Probe};

/// The largest metrics page read (a vLLM page is some tens of KiB).
pub const MAX_METRICS_BYTES: usize = 1 << 20;

/// Pods scraped at most (beyond, a pod is scored on the median load, counted): as many as a
/// static pool may list.
pub const MAX_SCRAPED_PODS: usize = crate::config::MAX_STATIC_ENDPOINTS;

/// Metrics reads in flight at once, at most (a pod that does not answer holds its place until
/// its read times out).
pub const MAX_CONCURRENT_SCRAPES: usize = 128;

/// One reading of a pod's page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// `vllm:num_requests_waiting`, summed over the page's series.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`), the largest of
    /// the page's series.
    pub usage: f64,
}

/// Reads a Prometheus text page; `None` when the waiting-requests or the cache-usage series is
/// absent or a value does not parse.
pub fn parse_page(text: &str) -> Option<Sample> {
    let (mut waiting, mut usage, mut old_usage) = (None::<f64>, None::<f64>, None::<f64>);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
        let name = &line[..name_end];
        let slot = match name {
            "vllm:num_requests_waiting" => &mut waiting,
            "vllm:kv_cache_usage_perc" => &mut usage,
            "vllm:gpu_cache_usage_perc" => &mut old_usage,
            _ => continue,
        };
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labels) => &labels[labels.rfind('}')? + 1..],
            None => &line[name_end..],
        };
        let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
        if !value.is_finite() {
            return None;
        }
        *slot = Some(match (*slot, name) {
            (Some(sum), "vllm:num_requests_waiting") => sum + value,
            (Some(max), _) => max.max(value),
            (None, _) => value,
        });
    }
    Some(Sample {
        waiting: waiting?,
        usage: usage.or(old_usage)?,
    })
}

/// What a read's result says of the endpoint's health: no connection (refused or reset, a
/// TCP connect that timed out) counts against it, a slow answer counts for nothing, and any
/// answer, even one that does not parse, is an answer.
pub fn probe_of(result: &str) -> Probe {
    match result {
        "connect" | "reset" => Probe::NoConnection,
        "timeout" => Probe::Slow,
        _ => Probe::Answered,
    }
}

/// A failed read's kind, as counted: `connect` (no connection: refused, unreachable, or the
/// TCP connect timed out), `timeout` (connected, no page in time), `reset` (the connection
/// broke mid-read).
fn failure_of(e: &reqwest::Error) -> &'static str {
    if e.is_connect() {
        "connect"
    } else if e.is_timeout() {
        "timeout"
    } else {
        "reset"
    }
}

/// The latest samples, and the pods to scrape.
pub struct Scraper {
    samples: Mutex<HashMap<Arc<str>, (Sample, Instant)>>,
    template: String,
    interval: Duration,
    /// All pods' reads a second, at most.
    max_per_second: f64,
    /// `metricsStaleAfter`.
    stale_after: Duration,
    timeout: Duration,
    client: reqwest::Client,
    permits: Semaphore,
    /// Pods scraped now.
    pods: AtomicUsize,
    metrics: Arc<Metrics>,
    /// Told each read's outcome (an endpoint whose port stops answering is ejected).
    pool: Arc<Pool>,
}

/// How a [`Scraper`] reads.
pub struct ScrapeSettings {
    /// The URL, `{pod}` replaced.
    pub template: String,
    /// How often each pod is read (stretched for large fleets).
    pub interval: Duration,
    /// All pods' reads a second, at most.
    pub max_per_second: u32,
    /// A sample older than this (or than the stretched interval allows) is stale.
    pub stale_after: Duration,
}

impl Scraper {
    /// A scraper as `settings` say, telling `pool` whether each endpoint answers.
    pub fn new(settings: ScrapeSettings, metrics: Arc<Metrics>, pool: Arc<Pool>) -> Arc<Self> {
        let timeout = settings
            .interval
            .max(Duration::from_millis(250))
            .min(Duration::from_secs(1));
        // The connect's own bound is shorter, so a connect that times out is told apart (no
        // connection: the node is gone) from a server that is only slow.
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout * 4 / 5)
            .pool_max_idle_per_host(1)
            .build()
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "metrics client settings refused; using the defaults");
                reqwest::Client::new()
            });
        Arc::new(Self {
            samples: Mutex::default(),
            template: settings.template,
            interval: settings.interval,
            max_per_second: f64::from(settings.max_per_second.max(1)),
            stale_after: settings.stale_after,
            timeout,
            client,
            permits: Semaphore::new(MAX_CONCURRENT_SCRAPES),
            pods: AtomicUsize::new(0),
            metrics,
            pool,
        })
    }

    /// How long each pod waits between reads: `metricsInterval`, stretched so all pods
    /// together stay within the reads-per-second budget.
    pub fn period(&self) -> Duration {
        let pods = self.pods.load(Ordering::Relaxed) as f64;
        self.interval
            .max(Duration::from_secs_f64(pods / self.max_per_second))
    }

    /// The age past which a sample is stale: `metricsStaleAfter`, or two stretched periods
    /// and a read's timeout when that is longer.
    pub fn stale_after(&self) -> Duration {
        self.stale_after.max(self.period() * 2 + self.timeout)
    }

    /// The pod's load for a pick (`None`: never read).
    pub fn metrics_of(&self, pod: &str) -> Option<PodMetrics> {
        self.samples.lock().get(pod).map(|(s, at)| PodMetrics {
            waiting_requests: s.waiting,
            kv_cache_usage: s.usage,
            age: at.elapsed(),
        })
    }

    async fn scrape(&self, pod: &str) -> Result<Sample, &'static str> {
        let url = self.template.replace("{pod}", pod);
        let mut response = self
            .client
            .get(&url)
            .send()
            .await
            .map_err(|e| failure_of(&e))?;
        if !response.status().is_success() {
            return Err("status");
        }
        let mut page = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) if page.len() + chunk.len() > MAX_METRICS_BYTES => {
                    return Err("too_large")
                }
                Ok(Some(chunk)) => page.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(e) => return Err(failure_of(&e)),
            }
        }
        let text = std::str::from_utf8(&page).map_err(|_| "parse")?;
        parse_page(text).ok_or("parse")
    }

    /// Reads `pod` now (waiting for a place among the reads in flight), and records what
    /// came of it.
    async fn read_once(&self, pod: &Arc<str>, warned: &mut bool) {
        let result = match self.permits.acquire().await {
            Ok(_permit) => self.scrape(pod).await,
            Err(_) => return,
        };
        let kind = result.as_ref().map_or_else(|e| *e, |_| "ok");
        self.metrics.picker.scrape(kind);
        self.pool.probed(pod, probe_of(kind));
        match result {
            Ok(sample) => {
                self.samples
                    .lock()
                    .insert(pod.clone(), (sample, Instant::now()));
                *warned = false;
            }
            Err(kind) if !*warned => {
                tracing::warn!(%pod, kind, "cannot read the pod's metrics; its picks score its load as the pool's median until it answers");
                *warned = true;
            }
            Err(_) => {}
        }
    }

    async fn pod_loop(self: Arc<Self>, pod: Arc<str>) {
        // A new pod is read at once; in a large fleet the pods' reads spread over the period.
        let spread = self.period().saturating_sub(self.interval);
        let offset = mix64(
            pod.bytes()
                .fold(0, |h, b| h.wrapping_mul(31) + u64::from(b)),
        );
        tokio::time::sleep(spread.mul_f64((offset % 1024) as f64 / 1024.0)).await;
        let mut warned = false;
        loop {
            self.read_once(&pod, &mut warned).await;
            tokio::time::sleep(self.period()).await;
        }
    }

    /// Keeps one scrape loop per pod `pods()` lists until shutdown; checks the list every
    /// second and whenever the pool changes.
    pub fn run(
        self: Arc<Self>,
        pods: impl Fn() -> Vec<Arc<str>> + Send + 'static,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut loops: HashMap<Arc<str>, JoinHandle<()>> = HashMap::new();
            loop {
                let mut want = pods();
                want.sort_unstable();
                want.dedup();
                let over = want.len().saturating_sub(MAX_SCRAPED_PODS);
                want.truncate(MAX_SCRAPED_PODS);
                self.pods.store(want.len(), Ordering::Relaxed);
                self.metrics
                    .bounds
                    .scrape_targets(want.len(), over, self.period());
                loops.retain(|pod, task| {
                    let keep = want.binary_search(pod).is_ok();
                    if !keep {
                        task.abort();
                    }
                    keep
                });
                self.samples.lock().retain(|pod, _| loops.contains_key(pod));
                for pod in want {
                    if let std::collections::hash_map::Entry::Vacant(slot) = loops.entry(pod) {
                        let pod = slot.key().clone();
                        slot.insert(tokio::spawn(self.clone().pod_loop(pod)));
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = self.pool.changed() => {}
                    _ = shutdown.changed() => break,
                }
            }
            for task in loops.values() {
                task.abort();
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_pages_parse() {
        let page = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m, x\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
            vllm:num_requests_running{model_name=\"m\"} 9.0\n\
            vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25 1700000000\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 0.5\n";
        assert_eq!(
            parse_page(page),
            Some(Sample {
                waiting: 5.0,
                usage: 0.5
            })
        );
        let old = "vllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.1\n";
        assert_eq!(
            parse_page(old),
            Some(Sample {
                waiting: 1.0,
                usage: 0.1
            })
        );
    }

    #[test]
    fn incomplete_or_broken_pages_do_not_parse() {
        assert_eq!(parse_page(""), None);
        assert_eq!(parse_page("vllm:num_requests_waiting 1\n"), None);
        assert_eq!(parse_page("vllm:kv_cache_usage_perc 0.1\n"), None);
        assert_eq!(
            parse_page("vllm:num_requests_waiting x\nvllm:kv_cache_usage_perc 0.1\n"),
            None
        );
        assert_eq!(
            parse_page("vllm:num_requests_waiting{a=\"b\" 1\nvllm:kv_cache_usage_perc 0.1\n"),
            None
        );
        assert_eq!(
            parse_page("vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 0.1\n"),
            None
        );
    }
}
