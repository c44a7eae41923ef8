//! The endpoint picker's pool in tests: a daemon whose pool is an InferencePool served by the
//! in-process API server ([`super::kube_api`]), fake pods of that pool (each on a loopback
//! address of its own, all on the pool's target port), and waits on the pool's standings.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kv_indexer::config::{Config, PoolRefConfig};

use super::picker::Fleet;
use kv_indexer::daemon::RunningDaemon;

use super::kube_api::KubeApi;
use super::picker::{pod_address, FakePod};

/// The namespace and the InferencePool the tests use.
pub const NS: &str = "llm";
/// The pool's name.
pub const POOL: &str = "vllm";
/// The pool's selector.
pub const SELECTOR: [(&str, &str); 1] = [("app", "vllm")];

/// The picker's test config with `endpointPicker.pool` naming [`POOL`] on `api`.
pub fn config(api: &KubeApi, test: &str) -> Config {
    let mut c = super::picker::config(None);
    let dir = super::temp_dir(test);
    c.endpoint_picker.pool = Some(PoolRefConfig {
        name: POOL.into(),
        namespace: NS.into(),
        kubeconfig: api.kubeconfig(&dir, NS).display().to_string(),
        ..PoolRefConfig::default()
    });
    c
}

/// A pool pod: its fake server on the pool's port, its name and address.
pub struct PoolPod {
    /// The fake vLLM pod (its `/metrics`); dropping it kills the pod's server.
    pub fake: FakePod,
    /// The Kubernetes pod's name.
    pub name: String,
    /// Its IP.
    pub ip: Ipv4Addr,
}

impl PoolPod {
    /// A pod named `name` serving on `port` at an address of its own.
    pub async fn start(name: &str, port: u16) -> Self {
        let ip = pod_address();
        let fake = FakePod::start_at(SocketAddr::from((ip, port))).await;
        Self {
            fake,
            name: name.into(),
            ip,
        }
    }

    /// Its endpoint, `ip:port`.
    pub fn endpoint(&self) -> String {
        self.fake.name.clone()
    }

    /// Lists it in `api` with the pool's labels, Ready or not.
    pub fn list(&self, api: &KubeApi, ready: bool) {
        api.set_pod(NS, &self.name, &self.ip.to_string(), &SELECTOR, ready);
    }
}

/// The pool's endpoints and their standings, as the daemon holds them.
pub fn standings(d: &RunningDaemon) -> BTreeMap<String, String> {
    let pool = d.pool.as_ref().expect("the picker is on");
    pool.listing()
        .into_iter()
        .map(|l| (l.endpoint.address, l.standing.label().to_owned()))
        .collect()
}

/// Waits (10 s at most) until the pool's standings are `want`.
pub async fn wait_standings(d: &RunningDaemon, want: &[(&str, &str)]) {
    let want: BTreeMap<String, String> = want
        .iter()
        .map(|(e, s)| ((*e).to_owned(), (*s).to_owned()))
        .collect();
    for _ in 0..500 {
        if standings(d) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the pool never became {want:?}: {:?}", standings(d));
}

/// A prompt of `blocks` full blocks of its own.
pub fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| 1000 + seed * 7919 + i).collect()
}

/// The picker's test config at the default scrape interval, its pool the static list.
pub fn static_pool(endpoints: &[String]) -> Config {
    let mut c = super::picker::config(None);
    let defaults = Config::default().endpoint_picker;
    c.endpoint_picker.metrics_interval = defaults.metrics_interval;
    c.endpoint_picker.metrics_stale_after = defaults.metrics_stale_after;
    c.endpoint_picker.endpoints = endpoints.iter().map(|e| e.as_str().into()).collect();
    c
}

/// The pool [`POOL`] on `port`, four of its pods listed Ready with 30 requests waiting each,
/// pod `k` holding `prompt(k, 8)`, and a daemon with `c` that has read their metrics.
pub async fn busy_fleet(api: &KubeApi, port: u16, c: Config) -> (Fleet, Vec<PoolPod>) {
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let mut busy = Vec::new();
    for k in 0..4 {
        let p = PoolPod::start(&format!("vllm-{k}"), port).await;
        p.fake.set_load(30, 0.5);
        p.list(api, true);
        busy.push(p);
    }
    let mut fleet = Fleet::start(c).await;
    for (k, p) in busy.iter().enumerate() {
        fleet.store(&p.endpoint(), &prompt(k as u32, 8)).await;
    }
    fleet.scraped(4, 2).await;
    (fleet, busy)
}

/// The pool [`POOL`] of two Ready pods that never published.
pub async fn idle_pool(api: &KubeApi) -> [PoolPod; 2] {
    let port = super::picker::shared_port();
    api.set_pool(NS, POOL, &SELECTOR, &[port]);
    let pods = [
        PoolPod::start("vllm-0", port).await,
        PoolPod::start("vllm-1", port).await,
    ];
    for p in &pods {
        p.list(api, true);
    }
    pods
}
