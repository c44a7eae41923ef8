//! The pool, not the publishers, behind a real Envoy (1.40, `ENVOY_BIN`; `.ci/run` installs it)
//! running the gateway configuration the project ships (`deploy/examples/envoy.yaml`, GIE's e2e
//! shape: ORIGINAL_DST by header, h2c to the picker): a client's request goes through Envoy,
//! whose ext_proc filter asks the daemon's picker, to a fake vLLM pod that answers with its
//! name (`x-served-by`). The pool is an InferencePool on the API server of `support::kube_api`,
//! or a static list. Without Envoy the tests say `SKIPPED` (under `CI=true` they fail).
//! `tests/pool_picks.rs` runs the same cases over the ext_proc client alone.
//!
//! - a scaled-out pod that never published serves fresh prompts within seconds; negative
//!   control: with the live publishers alone as candidates it serves nothing
//!   (`behind_envoy_a_scaled_out_pod_serves_within_seconds`);
//! - a killed pod (its port refusing) is out within 2 s: its prompt is served by the live pod,
//!   with no error after; negative control: a health rule that never lets it leave, and Envoy
//!   answers 503 (no healthy upstream: the dead pod is picked)
//!   (`behind_envoy_a_killed_pod_is_not_picked`);
//! - a restarted picker's first request through Envoy is served; negative control: with the
//!   live publishers alone it is a 503 (`behind_envoy_a_restarted_picker_routes_its_first_request`).

mod support;

use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use serde_json::json;
use support::envoy::{binary, config, Envoy, COMPLETIONS};
use support::kube_api::KubeApi;
use support::picker::{shared_port, FakePod, Fleet, MODEL};
use support::pod_http::Health;
use support::pool::{self, prompt, PoolPod};

/// The gateway the project ships.
const GIE: &str = "deploy/examples/envoy.yaml";

/// Envoy in front of `fleet`'s picker.
async fn envoy(bin: &std::path::Path, fleet: &Fleet) -> Envoy {
    let port = fleet.daemon.picker_addr.expect("the picker is on").port();
    Envoy::start(bin, &config(GIE, port, &[])).await
}

/// A completions request of `ids` through Envoy: its status and the pod that served.
async fn through(envoy: &Envoy, ids: &[u32]) -> (u16, Option<String>) {
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 3}).to_string();
    let r = envoy.post(COMPLETIONS, body.as_bytes()).await;
    (r.status, r.served_by)
}

/// Four busy pods each holding a prompt, then a fifth, idle and silent, joins the pool: how
/// long until it served a fresh prompt through Envoy (`None`: not within `wait`).
async fn scale_out(
    bin: &std::path::Path,
    api: &KubeApi,
    c: Config,
    wait: Duration,
) -> Option<Duration> {
    let port = shared_port();
    let (fleet, busy) = pool::busy_fleet(api, port, c).await;
    let envoy = envoy(bin, &fleet).await;
    assert_eq!(
        through(&envoy, &prompt(1, 8)).await,
        (200, Some(busy[1].endpoint()))
    );
    let new = PoolPod::start("vllm-new", port).await;
    new.fake.set_load(0, 0.1);
    new.list(api, true);
    let joined = Instant::now();
    let mut fresh = 100;
    while joined.elapsed() < wait {
        fresh += 1;
        let (status, served) = through(&envoy, &prompt(fresh, 8)).await;
        assert_eq!(status, 200);
        if served == Some(new.endpoint()) {
            return Some(joined.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_scaled_out_pod_serves_within_seconds() {
    let Some(bin) = binary() else { return };
    let api = KubeApi::start().await;
    let first = scale_out(
        &bin,
        &api,
        pool::config(&api, "envoy-scale-out"),
        Duration::from_secs(10),
    )
    .await;
    let first = first.expect("the new pod served within 10 s");
    assert!(first < Duration::from_secs(5), "served after {first:?}");
    eprintln!("behind Envoy: the scaled-out pod served {first:?} after it was listed Ready");
    // Negative control: the live publishers alone never make the silent pod a candidate.
    let api = KubeApi::start().await;
    let never = scale_out(
        &bin,
        &api,
        support::picker::config(None),
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(never, None, "the check above fails on this rule");
}

/// Pod A holds a prompt, B is idle, both in a static pool; A is killed. How long until A's
/// prompt through Envoy is served by B (`None`: not within 2 s, the bound), then the statuses
/// and servers of three more requests of it, and B's name.
async fn kill(
    bin: &std::path::Path,
    failures_to_leave: u32,
) -> (Option<Duration>, Vec<(u16, Option<String>)>, String) {
    let a = FakePod::start().await;
    let b = FakePod::start().await;
    let mut c = pool::static_pool(&[a.name.clone(), b.name.clone()]);
    c.endpoint_picker.scrape_failures_to_leave = failures_to_leave;
    let mut fleet = Fleet::start(c).await;
    let held = prompt(7, 8);
    fleet.store(&a.name, &held).await;
    fleet.scraped(2, 2).await;
    let envoy = envoy(bin, &fleet).await;
    assert_eq!(through(&envoy, &held).await, (200, Some(a.name.clone())));
    // Killed: the connections Envoy keeps alive die with it, and nothing listens.
    a.state().set_health(Health::Down);
    drop(a);
    let killed = Instant::now();
    let mut out_after = None;
    while killed.elapsed() < Duration::from_secs(2) {
        if through(&envoy, &held).await == (200, Some(b.name.clone())) {
            out_after = Some(killed.elapsed());
            break;
        }
    }
    let mut after = Vec::new();
    for _ in 0..3 {
        after.push(through(&envoy, &held).await);
    }
    (out_after, after, b.name.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_killed_pod_is_not_picked() {
    let Some(bin) = binary() else { return };
    let (out_after, served, b) = kill(&bin, kv_core::DEFAULT_FAILURES_TO_LEAVE).await;
    let out_after = out_after.expect("the live pod serves the prompt within 2 s of the kill");
    eprintln!("behind Envoy: the killed pod was out {out_after:?} after the kill");
    assert!(
        served.iter().all(|r| *r == (200, Some(b.clone()))),
        "no errors after: {served:?}"
    );
    // Negative control: a rule that never lets the dead pod leave: Envoy is sent to it (503).
    let (never, refused, _) = kill(&bin, 100).await;
    assert_eq!(never, None);
    assert!(refused.iter().all(|(s, _)| *s == 503), "{refused:?}");
}

/// A picker restarted over an idle pool (no pod ever published), on the port Envoy dials: the
/// first request through Envoy once the picker reports ready.
async fn first_after_restart(
    bin: &std::path::Path,
    api: &KubeApi,
    mut c: Config,
) -> (u16, Option<String>) {
    let pods = pool::idle_pool(api).await;
    let before = Fleet::start(c.clone()).await;
    let picker = before.daemon.picker_addr.expect("the picker is on");
    let envoy = envoy(bin, &before).await;
    before.daemon.shutdown().await;
    c.endpoint_picker.addr = picker.to_string();
    let after = Fleet::start(c).await;
    support::pods::eventually(Duration::from_secs(10), "the picker reports ready", || {
        let ready = after.daemon.is_ready();
        async move { ready }
    })
    .await;
    let got = through(&envoy, &prompt(3, 8)).await;
    if let Some(by) = &got.1 {
        assert!(pods.iter().any(|p| p.endpoint() == *by), "{by}");
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_restarted_picker_routes_its_first_request() {
    let Some(bin) = binary() else { return };
    let api = KubeApi::start().await;
    let (status, by) = first_after_restart(&bin, &api, pool::config(&api, "envoy-restart")).await;
    assert_eq!(status, 200);
    assert!(by.is_some());
    // Negative control: the live publishers alone (none published): 503.
    let api = KubeApi::start().await;
    let (status, _) = first_after_restart(&bin, &api, support::picker::config(None)).await;
    assert_eq!(status, 503, "the check above fails on this rule");
}
