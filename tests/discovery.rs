//! Connect mode by DNS, end to end: a real DNS server (`support::dns`, UDP on loopback) answers
//! for a headless-Service-like name while vLLM-shaped publishers bind on loopback addresses
//! (`127.0.0.2`, `127.0.0.3`, ... and `::1`, all local on Linux). The daemon resolves the name,
//! dials every address's data-parallel ranks, and follows the answer as pods come and go.

mod support;

use std::net::{IpAddr, TcpListener};
use std::time::{Duration, Instant};

use kv_core::BlockHash;
use kv_indexer::config::{ConfigDuration, DiscoveredService};
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::PodState;
use support::dns::DnsServer;
use support::pods::{eventually, holds, list, ranked_message, state_of, MODEL};
use zeromq::{PubSocket, Socket, SocketSend};

const NAME: &str = "vllm-headless.kvtest";

fn ip(text: &str) -> IpAddr {
    text.parse().expect("ip")
}

/// A port `p` such that `p .. p + ranks` are free on every address.
fn free_ports(addresses: &[IpAddr], ranks: u16) -> u16 {
    'search: for _ in 0..200 {
        let first = TcpListener::bind((addresses[0], 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        if first.checked_add(ranks).is_none() {
            continue;
        }
        for &address in addresses {
            for rank in 0..ranks {
                if TcpListener::bind((address, first + rank)).is_err() {
                    continue 'search;
                }
            }
        }
        return first;
    }
    panic!("no run of {ranks} free ports on {addresses:?}");
}

/// A vLLM pod at `address`: one bound PUB socket per data-parallel rank.
struct Pod {
    id: String,
    ranks: Vec<PubSocket>,
    next_seq: u64,
}

impl Pod {
    async fn start(address: IpAddr, port: u16, ranks: u16) -> Self {
        let host = match address {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let mut sockets = Vec::new();
        for rank in 0..ranks {
            let mut s = PubSocket::new();
            s.bind(&format!("tcp://{host}:{}", port + rank))
                .await
                .expect("PUB binds");
            sockets.push(s);
        }
        Self {
            id: format!("{host}:8000"),
            ranks: sockets,
            next_seq: 0,
        }
    }

    /// Publishes `block` from every rank (rank r stores `block + r`) until the daemon holds
    /// them all (the daemon dials when it next resolves; messages before it subscribed are
    /// lost, as with any SUB socket, and the repeats are new sequence numbers).
    async fn store(&mut self, d: &RunningDaemon, block: u64) {
        let started = Instant::now();
        loop {
            for (rank, socket) in self.ranks.iter_mut().enumerate() {
                let hash = BlockHash::new(block + rank as u64);
                let _ = socket
                    .send(ranked_message(
                        MODEL,
                        &self.id,
                        rank as i64,
                        self.next_seq,
                        &[hash],
                    ))
                    .await;
            }
            self.next_seq += 1;
            tokio::time::sleep(Duration::from_millis(30)).await;
            if (0..self.ranks.len() as u64).all(|r| holds(d, &self.id, block + r)) {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "{}'s blocks from {block} never arrived",
                self.id
            );
        }
    }
}

async fn start_daemon(dns: &DnsServer, port: u16, ranks: u16, grace: Duration) -> RunningDaemon {
    let mut c = support::loopback_config();
    c.kv_events_config.zmq_endpoint = String::new();
    c.kv_events_config.publisher_grace_period = ConfigDuration(grace);
    let discovery = &mut c.kv_events_config.discovery;
    discovery.refresh_interval = ConfigDuration::millis(200);
    discovery.nameservers = vec![dns.addr.to_string()];
    discovery.services = vec![DiscoveredService {
        name: NAME.into(),
        publisher_port: port,
        data_parallel_size: ranks,
        pod: "{ip}:8000".into(),
        model: MODEL.into(),
        ..Default::default()
    }];
    daemon::start(c).await.expect("daemon starts")
}

fn dialled(d: &RunningDaemon) -> f64 {
    support::metric(
        &d.metrics_text(),
        &format!("kvindexer_discovery_addresses{{service=\"{NAME}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_behind_a_name_are_dialled_as_they_come_and_forgotten_after_they_go() {
    let grace = Duration::from_millis(1_500);
    let (a, b) = (ip("127.0.0.2"), ip("127.0.0.3"));
    let port = free_ports(&[a, b], 2);
    let dns = DnsServer::start();
    dns.set(NAME, &[a]);
    let d = start_daemon(&dns, port, 2, grace).await;

    // Pod a: both data-parallel ranks dialled (port and port + 1), each its own publisher.
    let mut pod_a = Pod::start(a, port, 2).await;
    pod_a.store(&d, 100).await;
    let ranks: Vec<u32> = list(&d)
        .await
        .iter()
        .filter(|p| p.pod == pod_a.id)
        .map(|p| p.data_parallel_rank)
        .collect();
    assert_eq!(ranks, [0, 1], "one publisher per rank");
    assert_eq!(dialled(&d), 1.0);

    // Pod b joins the answer: dialled at the next resolution.
    let mut pod_b = Pod::start(b, port, 2).await;
    dns.set(NAME, &[a, b]);
    pod_b.store(&d, 200).await;
    assert_eq!(dialled(&d), 2.0);

    // Pod a leaves the answer (e.g. unready) and comes back within the grace period: its
    // sockets were dropped (GONE), then dialled again; nothing is lost.
    dns.set(NAME, &[b]);
    eventually(
        Duration::from_secs(5),
        "pod a never showed as gone after leaving the answer",
        || async { state_of(&d, &pod_a.id).await == Some(PodState::Gone) },
    )
    .await;
    dns.set(NAME, &[a, b]);
    pod_a.store(&d, 110).await;
    assert_eq!(state_of(&d, &pod_a.id).await, Some(PodState::Live));
    tokio::time::sleep(grace + Duration::from_millis(300)).await;
    assert!(
        holds(&d, &pod_a.id, 100) && holds(&d, &pod_a.id, 101),
        "a pod back in the answer within the grace period keeps its blocks"
    );

    // Pod a leaves for good while its publisher still runs: its sockets are dropped, so what
    // it publishes now is not heard, and it is forgotten once the grace period has passed.
    dns.set(NAME, &[b]);
    let left = Instant::now();
    eventually(
        Duration::from_secs(5),
        "pod a never showed as gone",
        || async { state_of(&d, &pod_a.id).await == Some(PodState::Gone) },
    )
    .await;
    for socket in pod_a.ranks.iter_mut() {
        let _ = socket
            .send(ranked_message(
                MODEL,
                &pod_a.id,
                0,
                1_000,
                &[BlockHash::new(999)],
            ))
            .await;
    }
    let took = eventually(
        Duration::from_secs(10),
        "pod a was never forgotten",
        || async { !holds(&d, &pod_a.id, 100) },
    )
    .await;
    assert!(
        left.elapsed() >= grace,
        "forgotten after {took:?}, before the grace period ({grace:?})"
    );
    assert!(!holds(&d, &pod_a.id, 101), "every rank's blocks go");
    assert!(!holds(&d, &pod_a.id, 999), "a dropped socket hears nothing");
    assert!(list(&d).await.iter().all(|p| p.pod != pod_a.id));
    assert!(holds(&d, &pod_b.id, 200) && holds(&d, &pod_b.id, 201));
    assert_ne!(
        state_of(&d, &pod_b.id).await,
        Some(PodState::Gone),
        "pod b's sockets stayed up"
    );
    let page = d.metrics_text();
    assert_eq!(dialled(&d), 1.0);
    assert_eq!(
        support::metric(
            &page,
            &format!("kvindexer_discovery_changes_total{{change=\"removed\",service=\"{NAME}\"}}")
        ),
        2.0,
        "{page}"
    );
    assert_eq!(
        support::metric(&page, "kvindexer_pods_forgotten_total{reason=\"gone\"}"),
        1.0,
        "{page}"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_dns_server_changes_nothing_and_a_name_that_is_gone_empties_the_set() {
    let grace = Duration::from_millis(1_000);
    let v4 = ip("127.0.0.4");
    let v6 = ip("::1");
    let ipv6 = TcpListener::bind((v6, 0)).is_ok();
    if !ipv6 {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true: this machine has no IPv6 loopback (::1), which the AAAA path needs"
        );
        eprintln!("NOTE: no IPv6 loopback (::1) here: the AAAA pod is left out of this run");
    }
    let addresses: Vec<IpAddr> = if ipv6 { vec![v4, v6] } else { vec![v4] };
    let port = free_ports(&addresses, 1);
    let dns = DnsServer::start();
    dns.set(NAME, &addresses);
    let d = start_daemon(&dns, port, 1, grace).await;
    let mut pods = Vec::new();
    for &address in &addresses {
        let mut pod = Pod::start(address, port, 1).await;
        pod.store(&d, 300).await;
        pods.push(pod);
    }
    if ipv6 {
        assert_eq!(
            pods[1].id, "[::1]:8000",
            "an AAAA address, bracketed in the pod id"
        );
    }

    // DNS fails (SERVFAIL) for longer than the grace period: the pods stay dialled (silent,
    // so IDLE, never GONE) and keep their blocks.
    dns.fail(true);
    let before = dns.queries();
    tokio::time::sleep(grace * 2).await;
    assert!(dns.queries() > before, "the daemon kept asking");
    for pod in &pods {
        assert_ne!(
            state_of(&d, &pod.id).await,
            Some(PodState::Gone),
            "{}",
            pod.id
        );
        assert!(holds(&d, &pod.id, 300));
    }
    let errors = support::metric(
        &d.metrics_text(),
        &format!("kvindexer_discovery_resolutions_total{{result=\"error\",service=\"{NAME}\"}}"),
    );
    assert!(errors >= 2.0, "failed resolutions are counted: {errors}");
    assert_eq!(dialled(&d), addresses.len() as f64);

    // The name is gone (NXDOMAIN): a definite answer, so every pod leaves and is forgotten.
    dns.fail(false);
    dns.remove(NAME);
    for pod in &pods {
        eventually(
            Duration::from_secs(10),
            "a pod of a name that is gone was never forgotten",
            || async { !holds(&d, &pod.id, 300) },
        )
        .await;
    }
    assert_eq!(dialled(&d), 0.0);
    d.shutdown().await;
}
