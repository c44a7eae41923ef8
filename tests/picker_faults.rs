//! The endpoint picker's failure modes behind a real Envoy (1.40, `ENVOY_BIN`; `.ci/run`
//! installs it) running the gateway configuration the project ships (GIE's e2e shape), fake
//! vLLM pods behind it. Each fault is injected with its negative control; no test sleeps a
//! fixed time to let something happen (each waits on a condition, or measures over a span).
//!
//! - every pod's `/metrics` answering in 300 ms, then in 1.5 s, 10 s each while requests flow:
//!   no request is a 5xx and the picker stays ready; their load is scored as stale, never as
//!   dead (`slow_metrics_never_take_a_pod_out`);
//! - every pod's metrics port refusing while the pods are Ready (the template names a port
//!   nothing listens on): every request is still routed, the bound keeping half the pool and a
//!   pool of one panicking; negative control: no bound and no panic threshold, every request a
//!   503 (`refusing_metrics_ports_never_empty_the_pool`);
//! - STREAMED with a 60 KB body sent in chunks: refused at once with a 500 naming the setting
//!   to change, nothing reaching a pod; negative control: the same body under
//!   FULL_DUPLEX_STREAMED lands on its holder (`a_streamed_body_is_refused_with_the_fix`);
//! - 64 concurrent 8 MB chat bodies (an image inline) to a daemon in a process of its own, its
//!   bodies budget 96 MiB: it lives, answers each with a pick or a 429, serves the next
//!   request, and its peak RSS stays under its idle RSS plus the budget plus 64 MiB (30 MiB
//!   over the budget measured on 2026-11-29, debug build); negative
//!   control: a budget past what the bodies hold, and the peak passes that bound
//!   (`concurrent_large_bodies_stay_within_the_budget`).
//!
//! Without Envoy the tests say `SKIPPED` (under `CI=true` they fail).

mod support;

use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use serde_json::json;
use support::envoy::{Gateway, COMPLETIONS};
use support::picker::MODEL;

/// The gateway the project ships.
const GIE: &str = "deploy/examples/envoy.yaml";

fn prompt_ids(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 + seed * 7919 + i).collect()
}

/// The picker's test config at the daemon's default scrape interval and staleness, its pool
/// the gateway's pods (filled in by [`gateway`]).
fn config() -> Config {
    let mut c = support::picker::config(None);
    let defaults = Config::default().endpoint_picker;
    c.endpoint_picker.metrics_interval = defaults.metrics_interval;
    c.endpoint_picker.metrics_stale_after = defaults.metrics_stale_after;
    c
}

/// `pods` fake pods in a static pool with `c`, Envoy in front; `None` without Envoy.
async fn gateway(pods: usize, c: Config, more: Vec<(&'static str, String)>) -> Option<Gateway> {
    Gateway::start_pooled(pods, c, GIE, more).await
}

/// Requests through Envoy for `span`, each a completions of `ids`: their statuses.
async fn traffic(gw: &Gateway, ids: &[u32], span: Duration) -> Vec<u16> {
    let start = Instant::now();
    let mut statuses = Vec::new();
    while start.elapsed() < span {
        statuses.push(gw.completions(ids).await.status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_metrics_never_take_a_pod_out() {
    let Some(mut gw) = gateway(3, config(), Vec::new()).await else {
        return;
    };
    let ids = prompt_ids(1, 64);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    support::picker::each_read(&gw.pods, 2).await;
    for delay in [Duration::from_millis(300), Duration::from_millis(1500)] {
        for p in &gw.pods {
            p.state().set_metrics_delay(delay);
        }
        let statuses = traffic(&gw, &ids, Duration::from_secs(10)).await;
        let errors = statuses.iter().filter(|s| **s >= 500).count();
        assert_eq!(
            errors,
            0,
            "{delay:?}: {} of {} were 5xx",
            errors,
            statuses.len()
        );
        assert!(
            statuses.len() >= 20,
            "{delay:?}: {} requests",
            statuses.len()
        );
        assert!(gw.fleet.daemon.is_ready(), "{delay:?}: /readyz ready");
        let page = gw.fleet.daemon.metrics_text();
        let left = support::metric(&page, "kvindexer_pool_left_total{reason=\"unreachable\"}");
        assert_eq!(left, 0.0, "{delay:?}: no pod ejected");
        assert!(
            support::metric(&page, "kvindexer_picker_scrapes_total{result=\"timeout\"}") > 0.0,
            "{delay:?}: the reads did time out (the fault was injected)"
        );
    }
    gw.fleet.daemon.shutdown().await;
}

/// Three pods whose metrics port refuses, in a pool of `pods` with `health`: the statuses of
/// requests through Envoy once every pod has been read as refusing enough times.
async fn refusing(pods: usize, max_ejection: u32, panic_threshold: u32) -> (Vec<u16>, String) {
    let mut c = config();
    // A port nothing listens on: every metrics read is refused while inference serves.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let closed_port = closed.local_addr().expect("addr").port();
    drop(closed);
    c.endpoint_picker.metrics_url_template = format!("http://127.0.0.1:{closed_port}/m?{{pod}}");
    c.endpoint_picker.health.max_ejection_percent = max_ejection;
    c.endpoint_picker.health.panic_threshold_percent = panic_threshold;
    let Some(mut gw) = gateway(pods, c, Vec::new()).await else {
        return (Vec::new(), String::new());
    };
    let ids = prompt_ids(2, 64);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    // Every pod read refused enough times to be ejected, were there no bound.
    let want = (pods * 3 * kv_core::DEFAULT_FAILURES_TO_LEAVE as usize) as f64;
    support::pods::eventually(Duration::from_secs(20), "the refused reads", || {
        let n = gw.metric("kvindexer_picker_scrapes_total{result=\"connect\"}");
        async move { n >= want }
    })
    .await;
    let statuses = traffic(&gw, &ids, Duration::from_secs(1)).await;
    let page = gw.fleet.daemon.metrics_text();
    gw.fleet.daemon.shutdown().await;
    (statuses, page)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusing_metrics_ports_never_empty_the_pool() {
    if support::envoy::binary().is_none() {
        return;
    }
    // Four pods: two ejected (the bound), two serve.
    let (statuses, page) = refusing(4, 50, 50).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(
        support::metric(&page, "kvindexer_pool_endpoints{standing=\"unreachable\"}"),
        2.0
    );
    assert_eq!(
        support::metric(&page, "kvindexer_pool_endpoints{standing=\"candidate\"}"),
        2.0
    );
    // One pod: ejected, and the pool panics, so it serves.
    let (statuses, page) = refusing(1, 50, 50).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(support::metric(&page, "kvindexer_pool_panicking"), 1.0);
    assert_eq!(support::metric(&page, "kvindexer_pool_panics_total"), 1.0);
    // Negative control: every pod may be ejected and nothing panics: no candidate, 503s.
    let (statuses, _) = refusing(4, 100, 0).await;
    assert!(
        !statuses.is_empty() && statuses.iter().all(|s| *s == 503),
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_is_refused_with_the_fix() {
    let duplex = "request_body_mode: FULL_DUPLEX_STREAMED";
    let indent = "\n                      ";
    let streamed = vec![
        (duplex, "request_body_mode: STREAMED".to_owned()),
        (
            "failure_mode_allow: false",
            format!("failure_mode_allow: false{indent}send_body_without_waiting_for_header_response: true"),
        ),
    ];
    // 12,000 token ids: a 72 KB body, more than two of the listener's 32 KiB buffers.
    let ids = prompt_ids(3, 12_000);
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 3}).to_string();
    assert!(body.len() > 60_000);
    for (more, streamed_mode) in [(streamed, true), (Vec::new(), false)] {
        let Some(mut gw) = Gateway::start_with(2, support::picker::config(None), GIE, more).await
        else {
            return;
        };
        gw.fleet.store(&gw.pods[1].name, &ids).await;
        let r = gw.envoy.post(COMPLETIONS, body.as_bytes()).await;
        match streamed_mode {
            true => {
                let text = String::from_utf8_lossy(&r.body);
                assert_eq!(r.status, 500, "{text}");
                assert!(text.contains("FULL_DUPLEX_STREAMED"), "{text}");
                assert_eq!(gw.received(), 0, "nothing reaches a pod");
                let refused = gw.metric("kvindexer_picker_refused_total{bound=\"body_mode\"}");
                assert_eq!(refused, 1.0);
            }
            // Negative control: GIE's mode, the same body, picked onto its holder.
            false => assert_eq!(gw.served(&r), gw.pod(1)),
        }
        gw.fleet.daemon.shutdown().await;
    }
}

/// A daemon process's resident memory now and at its peak (`VmRSS`, `VmHWM`), bytes.
fn rss_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kb = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("a VmRSS/VmHWM line")
            * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// A chat body of about `bytes` bytes: a question and an image inline (as a client sends a
/// screenshot), which the picker scores up to the image.
fn chat_with_image(bytes: usize) -> Vec<u8> {
    let image = format!("data:image/png;base64,{}", "A".repeat(bytes));
    json!({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"},
        {"type": "image_url", "image_url": {"url": image}}]}]})
    .to_string()
    .into_bytes()
}

/// 64 concurrent 8 MB bodies through Envoy to a daemon process whose bodies budget is
/// `budget`: (its idle RSS, its peak RSS, statuses, the refusals counted, the next request's
/// status). `None` without Envoy.
async fn large_bodies(budget: usize) -> Option<(u64, u64, Vec<u16>, f64, u16)> {
    let bin = support::envoy::binary()?;
    let dir = support::temp_dir("picker-budget");
    support::tiny_tokenizer(&dir.join("tok"));
    let pods = [
        support::picker::FakePod::start().await,
        support::picker::FakePod::start().await,
    ];
    let mut c = support::picker::config(Some(&dir.join("tok")));
    let port = |_| support::redis::free_port();
    let (grpc, metrics, picker) = (port(0), port(1), port(2));
    c.server.grpc_addr = format!("127.0.0.1:{grpc}");
    c.server.metrics_addr = format!("127.0.0.1:{metrics}");
    c.endpoint_picker.addr = format!("127.0.0.1:{picker}");
    c.endpoint_picker.endpoints = pods.iter().map(|p| p.name.as_str().into()).collect();
    c.endpoint_picker.max_buffered_body_bytes = budget;
    std::fs::write(dir.join("c.yaml"), c.to_yaml()).expect("config written");
    let mut daemon = support::replica::Process::spawn(&dir.join("c.yaml"), (0, grpc, metrics));
    daemon.wait_ready(Duration::from_secs(30)).await;
    let envoy = support::envoy::Envoy::start(&bin, &support::envoy::config(GIE, picker, &[])).await;
    // Warm: the tokenizer loaded, a pick made.
    let small = chat_with_image(16);
    assert_eq!(envoy.post("/v1/chat/completions", &small).await.status, 200);
    let (idle, _) = rss_of(daemon.child.id());
    let body = bytes::Bytes::from(chat_with_image(8 << 20));
    let url = envoy.url("/v1/chat/completions");
    let calls: Vec<_> = (0..64)
        .map(|_| {
            let (client, url, body) = (envoy.client().clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body);
                r.send().await.map(|r| r.status().as_u16()).unwrap_or(0)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.expect("the call ends"));
    }
    let (_, peak) = rss_of(daemon.child.id());
    let refused = support::metric(
        &daemon.metrics_text().await,
        "kvindexer_picker_refused_total{bound=\"body_budget\"}",
    );
    let next = envoy.post("/v1/chat/completions", &small).await.status;
    daemon.kill();
    Some((idle, peak, statuses, refused, next))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_bodies_stay_within_the_budget() {
    const MIB: u64 = 1 << 20;
    let budget = 96 << 20;
    let Some((idle, peak, statuses, refused, next)) = large_bodies(budget).await else {
        return;
    };
    eprintln!(
        "64 x 8 MB bodies, budget 96 MiB: idle {} MiB, peak {} MiB, {} refused (429)",
        idle / MIB,
        peak / MIB,
        refused
    );
    assert_eq!(next, 200, "the daemon lives and serves the next request");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    assert!(refused >= 1.0, "the budget was reached: {statuses:?}");
    let bound = idle + budget as u64 + 64 * MIB;
    assert!(
        peak <= bound,
        "peak {} MiB over {} MiB",
        peak / MIB,
        bound / MIB
    );
    // Negative control: a budget every body fits in, and the same load passes that bound.
    let Some((idle, peak, _, refused, next)) = large_bodies(4 << 30).await else {
        return;
    };
    eprintln!(
        "without a binding budget: idle {} MiB, peak {} MiB",
        idle / MIB,
        peak / MIB
    );
    assert_eq!((next, refused), (200, 0.0));
    assert!(
        peak > idle + budget as u64 + 64 * MIB,
        "peak {} MiB",
        peak / MIB
    );
}
