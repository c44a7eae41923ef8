//! The endpoint picker's pool through the Kubernetes API: a daemon with
//! `endpointPicker.pool: {name, namespace}` (and a kubeconfig naming the API server of
//! `support::kube_api`, which serves InferencePools and Pods and speaks list and watch as the
//! API server does: JSON lists, watch events, bookmarks, 410 Gone), driven through what a
//! cluster does to a pool. No real cluster ran these tests (none can run on the machines this
//! project is built on); the server follows the API's documented list/watch contract.
//!
//! - pods added, made unready, made Ready again and deleted change the candidates, and
//!   `/readyz` follows (`pods_added_made_unready_and_deleted_change_the_candidates`);
//! - a new selector replaces the pods (`a_new_selector_replaces_the_pool_s_pods`);
//! - a restarted watch resumes from the bookmark's version, and a watch from a compacted
//!   version (410 Gone) relists and sees what changed meanwhile
//!   (`bookmarks_resume_the_watch_and_410_gone_relists`);
//! - a deleted pool empties the candidates and `/readyz` says why; recreated, it is back
//!   (`a_deleted_pool_empties_the_candidates_and_readyz_says_why`);
//! - two target ports make each pod two data-parallel endpoints, and a rank's prefix is picked
//!   on its port (`two_target_ports_are_two_data_parallel_endpoints`).

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
    let (code, why) = readyz(&fleet).await;
    assert_eq!(code, 503);
    assert!(why.contains("no ready endpoint"), "{why}");
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
    // version to the pods' watch: a restarted watch resumes from there.
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bookmark = api.bookmark();
    tokio::time::sleep(Duration::from_millis(500)).await;
    api.drop_watches();
    api.wait_for(
        "the pods' watch resumed from the bookmark's version",
        pod_watch(Some(bookmark)),
    )
    .await;
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
