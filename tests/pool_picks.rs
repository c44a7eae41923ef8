//! The pool, not the publishers, over real sockets: a daemon with the endpoint picker on, its
//! pool an InferencePool (served by the API server of `support::kube_api`) or a static list,
//! fake vLLM pods serving `/metrics` on loopback addresses, KV events over ZMQ, and an ext_proc
//! client generated from Envoy's protos asking for each pick.
//!
//! - a scaled-out pod that never published gets traffic within seconds: fresh prompts go to
//!   it (it is idle, the others have 30 requests waiting) while a prompt another pod holds
//!   stays there (`a_scaled_out_pod_gets_traffic_within_seconds`);
//! - a killed pod (its server gone, its blocks still in the index) stops being picked within
//!   the health bound at the default settings (`a_killed_pod_stops_being_picked_within_the_
//!   health_bound`);
//! - a restarted picker with an idle pool routes its first request, on load
//!   (`a_restarted_picker_routes_its_first_request`).
//!
//! Each has a negative control that runs the same check on the broken rule and must see it
//! fail: the live publishers alone as candidates (the picker before pools) starve the scaled
//! -out pod and answer a restarted picker's first request with 503; a health rule that never
//! lets a pod leave keeps picking the dead one.

mod support;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kv_indexer::config::Config;
use serde_json::json;
use support::kube_api::KubeApi;
use support::picker::{body, exchange, headers, read, shared_port, FakePod, Fleet, MODEL};
use support::pool::{self, prompt, static_pool, PoolPod};

type Client = ExternalProcessorClient<tonic::transport::Channel>;

/// The pick for a completions request of `ids`: its endpoint, or the immediate response.
async fn pick(client: &mut Client, ids: &[u32]) -> Result<String, (i32, String)> {
    let request = json!({"model": MODEL, "prompt": ids, "max_tokens": 8}).to_string();
    let mut messages = vec![headers("/v1/completions", None, None, false)];
    messages.extend(body(request.as_bytes(), 4096));
    let answer = read(&exchange(client, messages).await);
    match (answer.header, answer.immediate) {
        (Some(h), _) => Ok(h),
        (None, Some(immediate)) => Err(immediate),
        (None, None) => panic!("neither a pick nor an immediate response"),
    }
}

/// What a scale-out came to: how long until the new pod's first pick, and how many of the
/// next five fresh prompts it got.
struct ScaleOut {
    first: Option<Duration>,
    of_five: usize,
    holder_kept: bool,
}

/// Four pods that each hold a prompt of their own and have 30 requests waiting; then a fifth,
/// idle and silent, joins the pool. `config` says where the picker's candidates come from.
async fn scale_out(api: &KubeApi, config: Config, wait: Duration) -> ScaleOut {
    let port = shared_port();
    let (fleet, busy) = pool::busy_fleet(api, port, config).await;
    let mut client = fleet.client().await;
    let mut fresh = 100u32;
    for _ in 0..5 {
        fresh += 1;
        let got = pick(&mut client, &prompt(fresh, 8)).await.expect("a pick");
        assert!(busy.iter().any(|p| p.endpoint() == got), "{got}");
    }
    let new = PoolPod::start("vllm-new", port).await;
    new.fake.set_load(0, 0.1);
    new.list(api, true);
    let joined = Instant::now();
    let mut first = None;
    while first.is_none() && joined.elapsed() < wait {
        fresh += 1;
        if pick(&mut client, &prompt(fresh, 8)).await.ok() == Some(new.endpoint()) {
            first = Some(joined.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut of_five = 0;
    for _ in 0..5 {
        fresh += 1;
        of_five +=
            usize::from(pick(&mut client, &prompt(fresh, 8)).await.ok() == Some(new.endpoint()));
    }
    // A prompt pod 0 holds stays with it (prefix 3 against the idle pod's queue 2).
    let holder_kept = pick(&mut client, &prompt(0, 8)).await.ok() == Some(busy[0].endpoint());
    ScaleOut {
        first,
        of_five,
        holder_kept,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scaled_out_pod_gets_traffic_within_seconds() {
    let api = KubeApi::start().await;
    let config = pool::config(&api, "picks-scale-out");
    let s = scale_out(&api, config, Duration::from_secs(10)).await;
    let first = s.first.expect("the new pod got a request within 10 s");
    assert!(first < Duration::from_secs(5), "first pick after {first:?}");
    assert_eq!(s.of_five, 5, "the idle pod gets every fresh prompt");
    assert!(s.holder_kept, "a held prompt stays with its holder");
    eprintln!("scale-out: the new pod's first pick {first:?} after it was listed Ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_publishers_alone_starve_a_scaled_out_pod() {
    let api = KubeApi::start().await;
    // The picker before pools: no pool configured, the live publishers are the candidates.
    let config = support::picker::config(None);
    let s = scale_out(&api, config, Duration::from_secs(2)).await;
    assert_eq!(
        s.first, None,
        "a silent pod is never a publisher's candidate"
    );
    assert_eq!(s.of_five, 0, "the check above fails on this rule: 0 of 5");
}

/// What killing a pod came to: how long until it was out of the candidates (`None`: not
/// within 3 s), and where its prompt went next.
struct Kill {
    left: Option<Duration>,
    to_dead: usize,
    to_live: usize,
}

/// Pod A holds a prompt, B is idle; A's server is killed (its blocks stay in the index).
async fn kill(config_of: impl FnOnce(&[String]) -> Config) -> Kill {
    let a = FakePod::start().await;
    let b = FakePod::start().await;
    let (ea, eb) = (a.name.clone(), b.name.clone());
    let mut fleet = Fleet::start(config_of(&[ea.clone(), eb.clone()])).await;
    let held = prompt(7, 8);
    fleet.store(&ea, &held).await;
    fleet.scraped(2, 2).await;
    let mut client = fleet.client().await;
    assert_eq!(pick(&mut client, &held).await.as_ref(), Ok(&ea));
    let pool = fleet.daemon.pool.clone().expect("the picker is on");
    // Killed: its open connections die with it, and nothing listens.
    a.state().set_health(support::pod_http::Health::Down);
    drop(a);
    let killed = Instant::now();
    let mut left = None;
    while killed.elapsed() < Duration::from_secs(3) {
        if pool.standing(&ea).0 != kv_core::Standing::Candidate {
            left = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (mut to_dead, mut to_live) = (0, 0);
    for _ in 0..5 {
        match pick(&mut client, &held).await {
            Ok(p) if p == ea => to_dead += 1,
            Ok(p) if p == eb => to_live += 1,
            other => panic!("{other:?}"),
        }
    }
    Kill {
        left,
        to_dead,
        to_live,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_pod_stops_being_picked_within_the_health_bound() {
    let k = kill(static_pool).await;
    let left = k.left.expect("the killed pod left the candidates");
    // Refused three times at the default 50 ms: ~150 ms; the bound the docs give is 1 s.
    assert!(left <= Duration::from_secs(1), "left after {left:?}");
    assert_eq!(
        (k.to_dead, k.to_live),
        (0, 5),
        "its prompt goes to the live pod"
    );
    eprintln!("killed pod: out of the candidates after {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_pod_that_never_leaves_keeps_winning_dead() {
    // A health rule that does not take a pod out within the test (100 failures): the dead pod
    // holds the prompt, its metrics go stale, the pick falls back to the prefix, and the prefix
    // favours it (issue 52's third finding). The checks above fail on this rule.
    let k = kill(|e| {
        let mut c = static_pool(e);
        c.endpoint_picker.scrape_failures_to_leave = 100;
        c
    })
    .await;
    assert_eq!(k.left, None);
    assert_eq!((k.to_dead, k.to_live), (5, 0), "the dead pod keeps winning");
}

/// A picker restarted over an idle pool (no pod ever published): its first request once it
/// reports ready.
async fn first_after_restart(api: &KubeApi, config: Config) -> Result<String, (i32, String)> {
    let pods = pool::idle_pool(api).await;
    let before = Fleet::start(config.clone()).await;
    before.daemon.shutdown().await;
    let after = Fleet::start(config).await;
    support::pods::eventually(Duration::from_secs(10), "the picker reports ready", || {
        let ready = after.daemon.is_ready();
        async move { ready }
    })
    .await;
    let mut client = after.client().await;
    let got = pick(&mut client, &prompt(3, 8)).await;
    if let Ok(e) = &got {
        assert!(pods.iter().any(|p| p.endpoint() == *e), "{e}");
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_picker_routes_its_first_request() {
    let api = KubeApi::start().await;
    let config = pool::config(&api, "picks-restart");
    let got = first_after_restart(&api, config).await;
    assert!(got.is_ok(), "the first request is picked: {got:?}");
    // A static pool needs no answer from anyone: ready at once.
    let a = FakePod::start().await;
    let fleet = Fleet::start(static_pool(std::slice::from_ref(&a.name))).await;
    let mut client = fleet.client().await;
    assert_eq!(pick(&mut client, &prompt(4, 8)).await, Ok(a.name.clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_publishers_alone_refuse_a_restarted_picker_s_first_request() {
    let api = KubeApi::start().await;
    let got = first_after_restart(&api, support::picker::config(None)).await;
    let (status, why) = got.expect_err("the check above fails on this rule");
    assert_eq!(status, 503);
    assert!(why.contains("no ready endpoint serves model"), "{why}");
}
