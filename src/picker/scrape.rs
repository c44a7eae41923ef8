//! The pods' load: each pod's Prometheus endpoint (`endpointPicker.metricsUrlTemplate`) read
//! every `metricsInterval` for `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
//!
//! Invariants: one loop per pod, so a slow pod delays only its own samples; a scrape is bounded
//! in time (a second at most) and in body size ([`MAX_METRICS_BYTES`]); every failure is
//! counted by kind (`kvindexer_picker_scrapes_total`) and leaves the last sample to age, so a
//! pick sees it stale rather than wrong; each read's outcome goes to the pool's health rule
//! (refused and timed out count against the endpoint, any answer for it); pods are scraped
//! while the pool holds them, at most [`MAX_SCRAPED_PODS`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::pool::Pool;
use kv_core::{PodMetrics, Probe};

/// The largest metrics page read (a vLLM page is some tens of KiB).
pub const MAX_METRICS_BYTES: usize = 1 << 20;

/// Pods scraped at most.
pub const MAX_SCRAPED_PODS: usize = 4096;

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

/// What a read's result says of the endpoint's health: a refused (or reset) connection and a
/// timeout count against it; any answer, even one that does not parse, is an answer.
pub fn probe_of(result: &str) -> Probe {
    match result {
        "connect" => Probe::Refused,
        "timeout" => Probe::TimedOut,
        _ => Probe::Answered,
    }
}

/// The latest samples, and the pods to scrape.
pub struct Scraper {
    samples: Mutex<HashMap<Arc<str>, (Sample, Instant)>>,
    template: String,
    interval: Duration,
    client: reqwest::Client,
    metrics: Arc<Metrics>,
    /// Told each read's outcome (an endpoint that stops answering leaves the candidates).
    pool: Arc<Pool>,
}

impl Scraper {
    /// A scraper of `template` (`{pod}` replaced) every `interval`, telling `pool` whether
    /// each endpoint answers.
    pub fn new(
        template: &str,
        interval: Duration,
        metrics: Arc<Metrics>,
        pool: Arc<Pool>,
    ) -> Arc<Self> {
        let timeout = interval
            .max(Duration::from_millis(250))
            .min(Duration::from_secs(1));
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(1)
            .build()
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "metrics client settings refused; using the defaults");
                reqwest::Client::new()
            });
        Arc::new(Self {
            samples: Mutex::default(),
            template: template.to_owned(),
            interval,
            client,
            metrics,
            pool,
        })
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
        let mut response = self.client.get(&url).send().await.map_err(|e| {
            if e.is_timeout() {
                "timeout"
            } else {
                "connect"
            }
        })?;
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
                Err(e) if e.is_timeout() => return Err("timeout"),
                Err(_) => return Err("connect"),
            }
        }
        let text = std::str::from_utf8(&page).map_err(|_| "parse")?;
        parse_page(text).ok_or("parse")
    }

    async fn pod_loop(self: Arc<Self>, pod: Arc<str>) {
        let mut warned = false;
        loop {
            let result = self.scrape(&pod).await;
            let kind = result.as_ref().map_or_else(|e| *e, |_| "ok");
            self.metrics.picker.scrape(kind);
            self.pool.probed(&pod, probe_of(kind));
            match result {
                Ok(sample) => {
                    self.samples
                        .lock()
                        .insert(pod.clone(), (sample, Instant::now()));
                    warned = false;
                }
                Err(kind) if !warned => {
                    tracing::warn!(%pod, kind, "cannot read the pod's metrics; its picks use the index alone until it answers");
                    warned = true;
                }
                Err(_) => {}
            }
            tokio::time::sleep(self.interval).await;
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
                want.truncate(MAX_SCRAPED_PODS);
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
