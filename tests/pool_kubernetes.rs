//! The endpoint picker's pool through the Kubernetes API: a daemon with
//! `endpointPicker.pool: {name, namespace}` (and a kubeconfig naming the API server of
//! `support::kube_api`, which serves InferencePools and Pods and speaks list and watch as the
//! API server does: JSON lists, watch events, bookmarks, 410 Gone), driven through what a
//! cluster does to a pool. No real cluster ran these tests (none can run on the machines this
//! project is built on); the server follows the API's documented list/watch contract.
//!
//! - pods added, made unready, made Ready again and deleted change the candidates; `/readyz`
//!   says the pool is synced whether or not it has a candidate, and a pick without one is a
//!   503 saying why (`pods_added_made_unready_and_deleted_change_the_candidates`);
//! - a new selector replaces the pods (`a_new_selector_replaces_the_pool_s_pods`);
//! - a restarted watch resumes from the bookmark's version, and a watch from a compacted
//!   version (410 Gone) relists and sees what changed meanwhile
//!   (`bookmarks_resume_the_watch_and_410_gone_relists`);
//! - a deleted pool empties the candidates and `/readyz` says why; recreated, it is back
//!   (`a_deleted_pool_empties_the_candidates_and_readyz_says_why`);
//! - two target ports make each pod two data-parallel endpoints, and a rank's prefix is picked
//!   on its port (`two_target_ports_are_two_data_parallel_endpoints`);
//! - an API server that accepts and never answers, from the start: `/readyz` says why, and the
//!   picker is ready within 10 s of it answering; negative control: a request deadline longer
//!   than the wait, and it is not (`an_api_server_hung_at_start_is_left_behind_within_seconds`);
//! - one that hangs after the first sync: the last pool serves meanwhile, and a pod added after
//!   it answers again is a candidate within 10 s; negative control: the same with a deadline
//!   longer than the wait (`an_api_server_hung_after_the_sync_is_watched_anew_when_it_answers`).

mod support;

use std::time::Duration;

use serde_json::json;
use support::kube_api::{KubeApi, Resource};
use support::picker::{body, exchange, first, headers, read, shared_port, Fleet, MODEL};
use support::pool::{self, wait_standings, PoolPod, NS, POOL, SELECTOR};

const C: &str = "candidate";

async fn readyz(fleet: &Fleet) -> (u16, String) {
    support::http_get(fleet.daemon.metrics_addr.port(), "/readyz")
        .await
        .expect("the daemon answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_added_made_unready_and_deleted_change_the_candidates() {
    let api = KubeApi::start().await;
    let port = shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let a = PoolPod::start("vllm-a", port).await;
    let b = PoolPod::start("vllm-b", port).await;
    let other = PoolPod::start("other-c", port).await;
    a.list(&api, true);
    b.list(&api, false);
    api.set_pod(
        NS,
        &other.name,
        &other.ip.to_string(),
        &[("app", "other")],
        true,
    );
    let fleet = Fleet::start(pool::config(&api, "pool-k8s-pods")).await;
    let d = &fleet.daemon;
    let (ea, eb) = (a.endpoint(), b.endpoint());
    wait_standings(d, &[(&ea, C), (&eb, "not_ready")]).await;
    assert_eq!(readyz(&fleet).await.0, 200);
    b.list(&api, true);
    wait_standings(d, &[(&ea, C), (&eb, C)]).await;
    a.list(&api, false);
    wait_standings(d, &[(&ea, "not_ready"), (&eb, C)]).await;
    api.delete_pod(NS, &b.name);
    wait_standings(d, &[(&ea, "not_ready")]).await;
    // Synced, so ready (a gateway gets the picker's 503 with its reason, not a dead Service).
    assert_eq!(readyz(&fleet).await.0, 200);
    let why = d.pool.as_ref().and_then(|p| p.why_empty());
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("no ready endpoint")),
        "{why:?}"
    );
    // ListPods shows the pool, with where it comes from.
    let listed = support::client(d)
        .await
        .list_pods(kv_proto::kvindexer_v1::ListPodsRequest::default())
        .await
        .expect("ListPods")
        .into_inner();
    assert_eq!(listed.pool_source, "kubernetes");
    assert_eq!(listed.pool.len(), 1);
    assert_eq!(
        (
            listed.pool[0].name.as_str(),
            listed.pool[0].standing.as_str()
        ),
        ("vllm-a", "not_ready")
    );
    let page = d.metrics_text();
    for (line, at_least) in [
        ("kvindexer_pool_joined_total{reason=\"added\"}", 1.0),
        ("kvindexer_pool_joined_total{reason=\"ready\"}", 1.0),
        ("kvindexer_pool_left_total{reason=\"not_ready\"}", 1.0),
        ("kvindexer_pool_left_total{reason=\"removed\"}", 1.0),
        ("kvindexer_pool_synced", 1.0),
    ] {
        assert!(support::metric(&page, line) >= at_least, "{line}: {page}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_selector_replaces_the_pool_s_pods() {
    let api = KubeApi::start().await;
    let port = shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let a = PoolPod::start("vllm-a", port).await;
    let c = PoolPod::start("other-c", port).await;
    a.list(&api, true);
    api.set_pod(NS, &c.name, &c.ip.to_string(), &[("app", "other")], true);
    let fleet = Fleet::start(pool::config(&api, "pool-k8s-selector")).await;
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
    api.set_pool(NS, POOL, &[("app", "other")], &[port]);
    wait_standings(&fleet.daemon, &[(&c.endpoint(), C)]).await;
    let asked = api.requests().into_iter().any(|r| {
        r.resource == Resource::Pods
            && !r.watch
            && r.query.get("labelSelector").map(String::as_str) == Some("app=other")
    });
    assert!(
        asked,
        "the new selector's pods were listed: {:#?}",
        api.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_resume_the_watch_and_410_gone_relists() {
    let api = KubeApi::start().await;
    let port = shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let a = PoolPod::start("vllm-a", port).await;
    a.list(&api, true);
    let fleet = Fleet::start(pool::config(&api, "pool-k8s-watch")).await;
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
    let pod_watch = |from: Option<u64>| {
        move |rs: &[support::kube_api::Recorded]| {
            rs.iter().any(|r| {
                r.resource == Resource::Pods
                    && r.watch
                    && r.query.get("allowWatchBookmarks").map(String::as_str) == Some("true")
                    && from.is_none_or(|v| r.query.get("resourceVersion") == Some(&v.to_string()))
            })
        }
    };
    api.wait_for("a pod watch with bookmarks", pod_watch(None))
        .await;
    // The pool changes (the pods' watch sees nothing of it), then a bookmark carries the new
    // version to the pods' watch: a restarted watch resumes from there. Whether the watcher
    // read the bookmark before its watch was dropped cannot be seen from here, so the round
    // is tried again (a new bookmark each time) until a resumed watch names one.
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let mut resumed = false;
    for _ in 0..20 {
        let bookmark = api.bookmark();
        let before = api.requests().len();
        api.drop_watches();
        api.wait_for("the pods' watch restarted", |rs| {
            rs[before..]
                .iter()
                .any(|r| r.resource == Resource::Pods && r.watch)
        })
        .await;
        if pod_watch(Some(bookmark))(&api.requests()[before..]) {
            resumed = true;
            break;
        }
    }
    assert!(resumed, "the pods' watch resumed from a bookmark's version");
    // The watch goes down; a pod joins and the history is compacted meanwhile: the resumed
    // watch gets 410 Gone, the watcher relists, and the new pod is a candidate.
    let lists = api.lists(Resource::Pods);
    let watches = api.requests().len();
    api.hold_watches(true);
    api.drop_watches();
    api.wait_for("a watch waits", |rs| {
        rs.len() > watches && rs[watches..].iter().any(|r| r.resource == Resource::Pods)
    })
    .await;
    let d = PoolPod::start("vllm-d", port).await;
    d.list(&api, true);
    api.compact();
    api.hold_watches(false);
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C), (&d.endpoint(), C)]).await;
    assert!(api.gone() >= 1, "a watch was answered 410 Gone");
    assert!(
        api.lists(Resource::Pods) > lists,
        "the pods were listed again after 410 Gone"
    );
    let errors = support::metric(
        &fleet.daemon.metrics_text(),
        "kvindexer_pool_watch_errors_total{resource=\"pod\"}",
    );
    assert!(errors >= 1.0, "the 410 was counted: {errors}");
    let inits = support::metric(
        &fleet.daemon.metrics_text(),
        "kvindexer_pool_watch_events_total{event=\"init\",resource=\"pod\"}",
    );
    assert!(inits >= 2.0, "a first list and a relist: {inits}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pool_empties_the_candidates_and_readyz_says_why() {
    let api = KubeApi::start().await;
    let port = shared_port();
    let a = PoolPod::start("vllm-a", port).await;
    a.list(&api, true);
    // No pool yet: the picker is not ready, and says so.
    let fleet = Fleet::start(pool::config(&api, "pool-k8s-deleted")).await;
    support::pods::eventually(Duration::from_secs(10), "no pool", || async {
        let (code, why) = readyz(&fleet).await;
        code == 503 && why.contains("does not exist")
    })
    .await;
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
    assert_eq!(readyz(&fleet).await.0, 200);
    api.delete_pool(NS, POOL);
    wait_standings(&fleet.daemon, &[]).await;
    let (code, why) = readyz(&fleet).await;
    assert_eq!(code, 503);
    assert!(
        why.contains("InferencePool llm/vllm does not exist"),
        "{why}"
    );
    // A request gets 503 too, saying why.
    let mut client = fleet.client().await;
    let request = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let mut messages = vec![headers("/v1/completions", None, None, false)];
    messages.extend(body(request.as_bytes(), 4096));
    let answer = read(&exchange(&mut client, messages).await);
    let (status, text) = answer.immediate.expect("an immediate response");
    assert_eq!(status, 503);
    assert!(text.contains("does not exist"), "{text}");
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_target_ports_are_two_data_parallel_endpoints() {
    let api = KubeApi::start().await;
    let (p0, p1) = (shared_port(), shared_port());
    api.set_pool(NS, POOL, &SELECTOR, &[p0, p1]);
    let rank0 = PoolPod::start("vllm-dp", p0).await;
    let rank1 = support::picker::FakePod::start_at((rank0.ip, p1).into()).await;
    rank0.list(&api, true);
    let mut fleet = Fleet::start(pool::config(&api, "pool-k8s-dp")).await;
    let (e0, e1) = (rank0.endpoint(), rank1.name.clone());
    wait_standings(&fleet.daemon, &[(&e0, C), (&e1, C)]).await;
    let listing = fleet.daemon.pool.as_ref().expect("pool").listing();
    let mut ranks: Vec<(String, String, Option<u32>)> = listing
        .into_iter()
        .map(|l| (l.endpoint.address, l.endpoint.pod, l.endpoint.rank))
        .collect();
    ranks.sort_by_key(|r| r.2);
    assert_eq!(
        ranks,
        [
            (e0.clone(), e0.clone(), Some(0)),
            (e1.clone(), e0.clone(), Some(1))
        ]
    );
    // Rank 1 of the pod (vLLM's topic names the pod by its first port) holds the prompt: the
    // pick is rank 1's port.
    let ids: Vec<u32> = (0..64).map(|i| 5000 + i).collect();
    fleet.store_ranked(&e0, 1, &ids).await;
    fleet.scraped(2, 2).await;
    let mut client = fleet.client().await;
    let request = json!({"model": MODEL, "prompt": ids, "max_tokens": 1}).to_string();
    for _ in 0..3 {
        let mut messages = vec![headers("/v1/completions", None, None, false)];
        messages.extend(body(request.as_bytes(), 4096));
        let answer = read(&exchange(&mut client, messages).await);
        assert_eq!(first(&answer), e1, "{answer:?}");
        assert_eq!(answer.rank.as_deref(), Some("1"), "{answer:?}");
    }
}

/// Whether `fleet`'s picker becomes ready within `within` (polled).
async fn ready_within(fleet: &Fleet, within: Duration) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if readyz(fleet).await.0 == 200 {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// The pool of one Ready pod on an API server hung from the start, a picker with
/// `request_timeout` started on it: how long after the server answers again the picker is
/// ready (`None`: not within 10 s).
async fn hung_at_start(test: &str, request_timeout: Duration) -> Option<Duration> {
    let api = KubeApi::start().await;
    let port = shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let a = PoolPod::start("vllm-a", port).await;
    a.list(&api, true);
    api.hang(true);
    let mut c = pool::config(&api, test);
    if let Some(p) = c.endpoint_picker.pool.as_mut() {
        p.request_timeout = kv_indexer::config::ConfigDuration(request_timeout);
    }
    let fleet = Fleet::start(c).await;
    // Not ready, and saying why, once a request has gone unanswered past its deadline.
    if request_timeout < Duration::from_secs(10) {
        support::pods::eventually(Duration::from_secs(30), "readyz says why", || async {
            let (code, why) = readyz(&fleet).await;
            code == 503 && why.contains("did not answer")
        })
        .await;
    } else {
        support::pods::eventually(Duration::from_secs(10), "readyz 503", || async {
            readyz(&fleet).await.0 == 503
        })
        .await;
    }
    api.hang(false);
    let ready = ready_within(&fleet, Duration::from_secs(10)).await;
    if ready.is_some() {
        wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
    }
    ready
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_hung_at_start_is_left_behind_within_seconds() {
    let ready = hung_at_start("pool-k8s-hung-start", Duration::from_secs(5)).await;
    let ready = ready.expect("ready within 10 s of the API server answering");
    eprintln!("an API server hung at start: ready {ready:?} after it answered");
    // Negative control: a deadline past the wait leaves the first list hanging.
    let never = hung_at_start("pool-k8s-hung-start-control", Duration::from_secs(300)).await;
    assert_eq!(never, None, "the check above fails without a deadline");
}

/// A pool of pod A, synced; the API server hangs, pod B joins meanwhile and A keeps being
/// picked; the server answers again: how long until B is a candidate (`None`: not within
/// 10 s).
async fn hung_after_sync(test: &str, request_timeout: Duration) -> Option<Duration> {
    let api = KubeApi::start().await;
    let port = shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let a = PoolPod::start("vllm-a", port).await;
    let b = PoolPod::start("vllm-b", port).await;
    a.list(&api, true);
    let mut c = pool::config(&api, test);
    if let Some(p) = c.endpoint_picker.pool.as_mut() {
        p.request_timeout = kv_indexer::config::ConfigDuration(request_timeout);
    }
    let fleet = Fleet::start(c).await;
    wait_standings(&fleet.daemon, &[(&a.endpoint(), C)]).await;
    api.hang(true);
    b.list(&api, true);
    // The last pool serves while the server does not answer (past the liveness read's
    // deadline, when it has one short enough to be noticed here).
    if request_timeout < Duration::from_secs(10) {
        support::pods::eventually(
            Duration::from_secs(30),
            "the server's absence noticed",
            || {
                let n = support::metric(
                    &fleet.daemon.metrics_text(),
                    "kvindexer_pool_api_probes_total{result=\"timeout\"}",
                );
                async move { n >= 1.0 }
            },
        )
        .await;
    }
    let mut client = fleet.client().await;
    let request = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let mut messages = vec![headers("/v1/completions", None, None, false)];
    messages.extend(body(request.as_bytes(), 4096));
    let answer = read(&exchange(&mut client, messages).await);
    assert_eq!(first(&answer), a.endpoint(), "the last pool serves");
    assert_eq!(
        readyz(&fleet).await.0,
        200,
        "still ready: the last pool is good"
    );
    api.hang(false);
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let p = fleet.daemon.pool.as_ref().expect("pool");
        if p.view()
            .candidates
            .iter()
            .any(|c| c.address == b.endpoint())
        {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_hung_after_the_sync_is_watched_anew_when_it_answers() {
    let joined = hung_after_sync("pool-k8s-hung-sync", Duration::from_secs(5)).await;
    let joined = joined.expect("the new pod a candidate within 10 s of the server answering");
    eprintln!("an API server hung after the sync: the new pod in {joined:?} after it answered");
    // Negative control: a deadline past the wait never notices the server was away, and the
    // watch that stalled never delivers.
    let never = hung_after_sync("pool-k8s-hung-sync-control", Duration::from_secs(300)).await;
    assert_eq!(never, None, "the check above fails without a deadline");
}
