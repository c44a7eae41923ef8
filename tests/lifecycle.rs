//! Pods that come and go, over real sockets: a pod whose connection closes is forgotten after
//! the grace period and kept when it reconnects within it; a silent pod is forgotten after the
//! idle timeout; a listed connect-mode pod whose publisher stops is gone, then forgotten (DNS
//! discovery: `discovery.rs`). (100,000 publishers: `churn.rs`, a binary of its own so that its heap count
//! sees no other test.)

mod support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kv_indexer::daemon;
use kv_proto::kvindexer_v1::PodState;
use support::pods::{
    connect, eventually, holds, lifecycle_config, list, message, send_until_held, state_of,
};
use zeromq::{PubSocket, Socket, SocketSend};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_gone_past_the_grace_period_is_forgotten_and_one_back_within_it_is_kept() {
    let grace = Duration::from_millis(1_500);
    let d = daemon::start(lifecycle_config(grace, Duration::ZERO))
        .await
        .expect("daemon starts");
    // The pod's id names the address its connection comes from (127.0.0.1), as `ip:port`
    // topics do in a cluster.
    let pod = "127.0.0.1:8000";
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, pod, 0, 1).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));

    // Disconnect, reconnect within the grace period: nothing is lost.
    drop(p);
    eventually(
        Duration::from_secs(5),
        "the pod never showed as gone",
        || async { state_of(&d, pod).await == Some(PodState::Gone) },
    )
    .await;
    let gone = list(&d).await;
    assert!(gone[0].state_since_unix_ms > 0, "{gone:?}");
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, pod, 1, 2).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));
    tokio::time::sleep(grace + Duration::from_millis(400)).await;
    assert!(
        holds(&d, pod, 1),
        "a pod back within the grace period keeps its blocks"
    );
    assert_eq!(
        support::metric(&d.metrics_text(), "kvindexer_pods_forgotten_total"),
        0.0
    );

    // Disconnect for good: forgotten once the grace period has passed, not before.
    let left = Instant::now();
    drop(p);
    let took = eventually(
        Duration::from_secs(10),
        "the pod was never forgotten",
        || async { !holds(&d, pod, 1) },
    )
    .await;
    assert!(
        left.elapsed() >= grace,
        "forgotten after {:?}, before the grace period",
        left.elapsed()
    );
    eprintln!("forgotten {took:?} after the disconnect (grace {grace:?})");
    assert!(!holds(&d, pod, 2));
    assert!(list(&d).await.is_empty(), "ListPods still shows the pod");
    assert_eq!(d.publishers().pod_count(), 0);
    let page = d.metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_pods_forgotten_total{reason=\"gone\"}"),
        1.0,
        "{page}"
    );
    assert!(
        !page.contains(&format!("pod=\"{pod}\"")),
        "the forgotten pod's series remain"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_pod_is_idle_then_forgotten_after_the_idle_timeout() {
    let (grace, idle) = (Duration::from_millis(300), Duration::from_millis(1_500));
    let d = daemon::start(lifecycle_config(grace, idle))
        .await
        .expect("daemon starts");
    // An id that names no address: only silence can tell it left.
    let (quiet, chatty) = ("vllm-quiet", "vllm-chatty");
    let mut p = connect(&d).await;
    send_until_held(&mut p, &d, quiet, 0, 1).await;
    send_until_held(&mut p, &d, chatty, 0, 2).await;
    eventually(
        Duration::from_secs(5),
        "the quiet pod never showed as idle",
        || async { state_of(&d, quiet).await == Some(PodState::Idle) },
    )
    .await;
    // When the daemon last heard the quiet pod (its resends of message 0 may have landed after
    // the test saw the block): the idle timeout runs from there.
    let listed = list(&d).await;
    let spoke_ms = listed
        .iter()
        .find(|p| p.pod == quiet)
        .map(|p| p.last_message_unix_ms)
        .expect("the quiet pod is listed");
    assert!(spoke_ms > 0, "{listed:?}");
    // The chatty pod keeps talking; the quiet one is forgotten, the connection still open.
    let mut seq = 1;
    let forgotten = Instant::now();
    while holds(&d, quiet, 1) {
        assert!(
            forgotten.elapsed() < Duration::from_secs(10),
            "never forgotten"
        );
        let _ = p.send(message(chatty, seq, 2 + seq)).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // (Both clocks are read in whole milliseconds: 2 ms of rounding.)
    let silent_ms = unix_ms().saturating_sub(spoke_ms);
    assert!(
        silent_ms + 2 >= idle.as_millis() as u64,
        "forgotten {silent_ms} ms after its last message, before the idle timeout ({idle:?})"
    );
    assert!(holds(&d, chatty, 2), "the pod that kept talking was kept");
    assert_eq!(state_of(&d, chatty).await, Some(PodState::Live));
    assert_eq!(
        support::metric(
            &d.metrics_text(),
            "kvindexer_pods_forgotten_total{reason=\"idle\"}"
        ),
        1.0
    );
    drop(p);
    d.shutdown().await;
}

/// Now, in milliseconds since the Unix epoch (the clock `ListPods` reports in).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_pod_whose_publisher_stops_is_gone_then_forgotten_and_kept_if_back_in_time() {
    // Connect mode, a listed endpoint: this replica's socket to the pod is its link.
    let grace = Duration::from_millis(1_500);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut c = lifecycle_config(grace, Duration::ZERO);
    c.kv_events_config.zmq_endpoint = String::new();
    c.kv_events_config.endpoints = vec![kv_indexer::config::ConnectEndpoint {
        endpoint: endpoint.clone(),
        ..Default::default()
    }];
    let d = daemon::start(c).await.expect("daemon starts");
    let pod = "vllm-0.vllm:8000";
    let bind = || async {
        let mut p = PubSocket::new();
        p.bind(&endpoint).await.expect("PUB binds");
        p
    };
    let mut p = bind().await;
    send_until_held(&mut p, &d, pod, 0, 1).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));

    // The publisher stops (its socket closes) and comes back within the grace period: the
    // daemon's socket reconnects and the pod keeps everything.
    drop(p);
    eventually(
        Duration::from_secs(5),
        "the pod never showed as gone after its publisher stopped",
        || async { state_of(&d, pod).await == Some(PodState::Gone) },
    )
    .await;
    let mut p = bind().await;
    send_until_held(&mut p, &d, pod, 1, 2).await;
    assert_eq!(state_of(&d, pod).await, Some(PodState::Live));
    tokio::time::sleep(grace + Duration::from_millis(400)).await;
    assert!(holds(&d, pod, 1), "back within the grace period: kept");

    // It stops for good: forgotten once the grace period has passed.
    let left = Instant::now();
    drop(p);
    eventually(
        Duration::from_secs(10),
        "the pod was never forgotten",
        || async { !holds(&d, pod, 1) },
    )
    .await;
    assert!(left.elapsed() >= grace, "forgotten before the grace period");
    assert!(list(&d).await.is_empty(), "ListPods still shows the pod");
    assert_eq!(
        support::metric(
            &d.metrics_text(),
            "kvindexer_pods_forgotten_total{reason=\"gone\"}"
        ),
        1.0
    );
    d.shutdown().await;
}
