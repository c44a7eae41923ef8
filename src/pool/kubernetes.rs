//! `endpointPicker.pool`: the `InferencePool` (`inference.networking.k8s.io/v1`) and the Pods
//! its selector picks, watched through the API server as GIE's EPP watches them (its
//! `InferencePool` and `Pod` reconcilers): the pool's `selector.matchLabels` and
//! `targetPorts`, each pod's IP and `Ready` condition.
//!
//! The watching is kube's runtime watcher: a list, then a watch from the list's
//! `resourceVersion` (with bookmarks, so a restarted watch resumes from the newest version it
//! saw), a relist when the server answers 410 Gone, and a backoff on errors (capped at
//! [`liveness::MAX_BACKOFF`]). Every call has a deadline the picker controls, as client-go's
//! do: a list page that does not come within `endpointPicker.pool.requestTimeout` restarts the
//! list (`list_stalled`); a watch closes after [`WATCH_SECONDS`] and is resumed (kube's idle
//! timeout catches one that went silent); and the API server is read every two seconds
//! ([`liveness`]): when it answers again after it did not, both watches start anew
//! (`api_back`), since one opened before may never deliver again. Meanwhile the last pool keeps
//! serving, and `/readyz` says why it is not ready before the first answer. Each endpoint of
//! the pool is `podIP:targetPort`; a pool with several target ports makes each pod several
//! data-parallel endpoints (rank `k` on the `k`-th port, as GIE's datastore names them
//! `<pod>-rank-<k>`), scored as the ranks of the pod vLLM's topic names `podIP:<first port>`.
//! A pod's `inference.networking.k8s.io/active-ports` annotation keeps only the ports it
//! lists, as in GIE.
//!
//! Each endpoint carries its pod's `llm-d.ai/role` label as a [`kv_core::Role`] (no label:
//! decode only; a label no llm-d filter knows: neither, and the pool says so).
//!
//! Invariants: a pod is Ready when its `Ready` condition is `True`, it has an IP and it is not
//! being deleted (GIE's `IsPodReady`); the pool's members change only after a complete list
//! (`InitDone`) or a watch event, never from a half-read list; a new selector starts a new pod
//! watch whose first list replaces every pod; a deleted pool empties the members and says so.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::liveness::{self, CappedBackoff, ProbeResult};
use super::{Member, Pool, PoolEndpoint};
use crate::config::PoolRefConfig;
use crate::warn_budget::WarnThrottle;

/// The InferencePool's API group.
pub const GROUP: &str = "inference.networking.k8s.io";
/// Its version.
pub const VERSION: &str = "v1";
/// Its kind.
pub const KIND: &str = "InferencePool";
/// Its resource name.
pub const PLURAL: &str = "inferencepools";
/// GIE's annotation naming the target ports a pod serves now (comma-separated).
pub const ACTIVE_PORTS: &str = "inference.networking.k8s.io/active-ports";
/// How long a watch call lasts before the server closes it and the watcher resumes it (kube's
/// idle timeout, 5 s past this, catches a watch that went silent).
pub const WATCH_SECONDS: u32 = 60;

/// The InferencePool's spec as the picker reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolSpec {
    /// `selector.matchLabels`.
    pub selector: BTreeMap<String, String>,
    /// `targetPorts[].number`, in order (the order is the data-parallel rank).
    pub target_ports: Vec<u16>,
}

impl PoolSpec {
    /// The selector as a label selector query (`k=v,k=v`).
    pub fn label_selector(&self) -> String {
        self.selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The spec of an InferencePool object, or why it cannot be read.
pub fn spec_of(object: &DynamicObject) -> Result<PoolSpec, String> {
    let spec = object.data.get("spec").ok_or("no spec")?;
    let mut selector = BTreeMap::new();
    let labels = spec
        .pointer("/selector/matchLabels")
        .and_then(|v| v.as_object());
    for (k, v) in labels.into_iter().flatten() {
        let v = v.as_str().ok_or("a matchLabels value is not a string")?;
        selector.insert(k.clone(), v.to_owned());
    }
    let mut target_ports = Vec::new();
    let ports = spec.get("targetPorts").and_then(|v| v.as_array());
    for p in ports.into_iter().flatten() {
        let n = p.get("number").and_then(|n| n.as_u64()).unwrap_or(0);
        let port = u16::try_from(n)
            .ok()
            .filter(|p| *p > 0)
            .ok_or("a targetPorts number is not a port")?;
        target_ports.push(port);
    }
    if target_ports.is_empty() {
        return Err("no targetPorts".into());
    }
    Ok(PoolSpec {
        selector,
        target_ports,
    })
}

/// Whether `pod` may serve: its `Ready` condition is `True`, it has an IP, and it is not being
/// deleted.
pub fn is_ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(status) = &pod.status else {
        return false;
    };
    let ready = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .is_some_and(|c| c.status == "True");
    ready && status.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
}

/// `ip:port` (`[v6]:port`).
fn join(ip: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

/// The endpoints `pod` gives the pool: one per active target port.
pub fn members_of(spec: &PoolSpec, pod: &Pod) -> Vec<Member> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    let Some(ip) = ip else {
        return Vec::new();
    };
    let active: Option<Vec<u16>> = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ACTIVE_PORTS))
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect());
    let ready = is_ready(pod);
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(kv_core::ROLE_LABEL))
        .map(String::as_str);
    let (role, unknown_role) = super::role_of(label);
    let first = join(ip, spec.target_ports[0]);
    let ranked = spec.target_ports.len() > 1;
    let name = pod.metadata.name.clone().unwrap_or_default();
    spec.target_ports
        .iter()
        .enumerate()
        .filter(|(_, port)| active.as_ref().is_none_or(|a| a.contains(port)))
        .map(|(rank, &port)| Member {
            endpoint: PoolEndpoint {
                address: join(ip, port),
                pod: first.clone(),
                rank: ranked.then_some(rank as u32),
                name: name.clone(),
                role,
            },
            ready,
            unknown_role: unknown_role.clone(),
        })
        .collect()
}

/// A Kubernetes client as `pool` says (its kubeconfig file; else the in-cluster service
/// account; else `KUBECONFIG` or `~/.kube/config`), and the namespace to watch.
pub async fn client(pool: &PoolRefConfig) -> Result<(Client, String), String> {
    let options = KubeConfigOptions::default();
    let config = if !pool.kubeconfig.is_empty() {
        let file = Kubeconfig::read_from(&pool.kubeconfig)
            .map_err(|e| format!("reading kubeconfig {}: {e}", pool.kubeconfig))?;
        kube::Config::from_custom_kubeconfig(file, &options)
            .await
            .map_err(|e| format!("kubeconfig {}: {e}", pool.kubeconfig))?
    } else if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        kube::Config::incluster().map_err(|e| format!("in-cluster service account: {e}"))?
    } else {
        kube::Config::from_kubeconfig(&options).await.map_err(|e| {
            format!("not in a cluster, and no kubeconfig (KUBECONFIG, ~/.kube/config): {e}")
        })?
    };
    let namespace = match pool.namespace.is_empty() {
        true => config.default_namespace.clone(),
        false => pool.namespace.clone(),
    };
    let client = Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))?;
    Ok((client, namespace))
}

type Watched<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// The pods the watcher holds: those of the last complete list and the events since, and the
/// list being read.
#[derive(Default)]
struct Pods {
    now: BTreeMap<String, Pod>,
    listing: Option<BTreeMap<String, Pod>>,
    synced: bool,
}

impl Pods {
    /// Applies one event; whether the pods changed (and are complete).
    fn apply(&mut self, event: Event<Pod>) -> bool {
        let key = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Init => self.listing = Some(BTreeMap::new()),
            Event::InitApply(p) => {
                self.listing.get_or_insert_default().insert(key(&p), p);
            }
            Event::InitDone => {
                self.now = self.listing.take().unwrap_or_default();
                self.synced = true;
                return true;
            }
            Event::Apply(p) => {
                self.now.insert(key(&p), p);
                return self.synced;
            }
            Event::Delete(p) => {
                self.now.remove(&key(&p));
                return self.synced;
            }
        }
        false
    }
}

/// The watcher's state: the pool's spec, its pods, the two streams and what the API server
/// last did.
struct Watcher {
    pools_api: Api<DynamicObject>,
    pods_api: Api<Pod>,
    /// The pool's name (its field selector).
    name: String,
    pool: Arc<Pool>,
    description: String,
    spec: Option<PoolSpec>,
    /// The pool's list is complete (so a missing pool is known to be missing).
    pool_listed: bool,
    listing_pool: Option<Option<DynamicObject>>,
    pool_stream: Watched<DynamicObject>,
    pods: Pods,
    pod_stream: Option<Watched<Pod>>,
    /// While a stream lists: when it last made progress (each list page must come within
    /// `request_timeout`).
    pool_listing: Option<Instant>,
    pod_listing: Option<Instant>,
    request_timeout: Duration,
    /// Since when the API server has not answered the liveness read.
    away_since: Option<Instant>,
    warn: WarnThrottle,
}

/// Watches the InferencePool `pool_ref` names in `namespace` and its pods into `pool`, until
/// shutdown.
pub fn watch(
    client: Client,
    namespace: &str,
    pool_ref: &PoolRefConfig,
    pool: Arc<Pool>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let gvk = GroupVersionKind::gvk(GROUP, VERSION, KIND);
    let resource = ApiResource::from_gvk_with_plural(&gvk, PLURAL);
    let pools_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);
    let name = pool_ref.name.clone();
    let request_timeout = pool_ref.request_timeout.0;
    let mut w = Watcher {
        pool_stream: pool_watch(&pools_api, &name),
        pools_api,
        pods_api: Api::namespaced(client, namespace),
        description: format!("InferencePool {namespace}/{name}"),
        name,
        pool,
        spec: None,
        pool_listed: false,
        listing_pool: None,
        pods: Pods::default(),
        pod_stream: None,
        pool_listing: Some(Instant::now()),
        pod_listing: None,
        request_timeout,
        away_since: None,
        warn: WarnThrottle::default(),
    };
    let (probes_tx, mut probes) = mpsc::channel(4);
    let prober = tokio::spawn(liveness::probe(
        w.pools_api.clone(),
        w.name.clone(),
        request_timeout,
        probes_tx,
    ));
    tokio::spawn(async move {
        loop {
            let stalled_at = w.stall_deadline();
            tokio::select! {
                _ = shutdown.changed() => break,
                Some(event) = w.pool_stream.next() => w.on_pool(event),
                Some(event) = next_pod(&mut w.pod_stream) => w.on_pod(event),
                Some(result) = probes.recv() => w.on_probe(result),
                _ = tokio::time::sleep_until(stalled_at.into()) => w.restart_stalled(),
            }
        }
        prober.abort();
    })
}

/// A watch of the InferencePool `name` alone.
fn pool_watch(pools: &Api<DynamicObject>, name: &str) -> Watched<DynamicObject> {
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(WATCH_SECONDS);
    watcher::watcher(pools.clone(), config)
        .backoff(CappedBackoff::default())
        .boxed()
}

/// A watch of the pods `spec`'s selector picks.
fn pod_watch(pods: &Api<Pod>, spec: &PoolSpec) -> Watched<Pod> {
    let config = watcher::Config::default()
        .labels(&spec.label_selector())
        .timeout(WATCH_SECONDS);
    watcher::watcher(pods.clone(), config)
        .backoff(CappedBackoff::default())
        .boxed()
}

/// The next pod event, or never when no pod watch runs.
async fn next_pod(stream: &mut Option<Watched<Pod>>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// A watcher event's kind, as counted.
fn kind<K>(event: &Event<K>) -> &'static str {
    match event {
        Event::Init => "init",
        Event::InitApply(_) => "init_apply",
        Event::InitDone => "init_done",
        Event::Apply(_) => "apply",
        Event::Delete(_) => "delete",
    }
}

/// When a list in progress last moved: now while it lists, `None` once it is done.
fn progress<K>(event: &Event<K>) -> Option<Option<Instant>> {
    match event {
        Event::Init | Event::InitApply(_) => Some(Some(Instant::now())),
        Event::InitDone => Some(None),
        Event::Apply(_) | Event::Delete(_) => None,
    }
}

impl Watcher {
    fn error(&self, resource: &'static str, e: &watcher::Error) {
        self.pool.metrics.pool.watch_error(resource);
        if let Some(suppressed) = self.warn.allow() {
            tracing::warn!(pool = %self.description, resource, error = %e, suppressed, "endpoint picker: watching the Kubernetes API failed; retrying with backoff (the pool stays as it was)");
        }
    }

    /// When the first list in progress must have moved by (far ahead when none lists).
    fn stall_deadline(&self) -> Instant {
        [self.pool_listing, self.pod_listing]
            .into_iter()
            .flatten()
            .min()
            .map_or(Instant::now() + Duration::from_secs(3600), |t| {
                t + self.request_timeout
            })
    }

    /// A list page did not come in time: that list starts again.
    fn restart_stalled(&mut self) {
        let late =
            |since: Option<Instant>| since.is_some_and(|t| t.elapsed() >= self.request_timeout);
        let (pool_late, pods_late) = (late(self.pool_listing), late(self.pod_listing));
        let why = format!(
            "the Kubernetes API server did not answer a list within {:?} \
             (endpointPicker.pool.requestTimeout)",
            self.request_timeout
        );
        if pool_late || pods_late {
            tracing::warn!(pool = %self.description, "endpoint picker: {why}; listing again (the last pool keeps serving)");
            self.pool.set_trouble(Some(why));
        }
        if pool_late {
            self.restart_pool_watch("list_stalled");
        }
        if pods_late {
            self.restart_pod_watch("list_stalled");
        }
    }

    fn restart_pool_watch(&mut self, cause: &'static str) {
        self.pool.metrics.pool.watch_restart(cause);
        self.pool_stream = pool_watch(&self.pools_api, &self.name);
        self.pool_listing = Some(Instant::now());
    }

    fn restart_pod_watch(&mut self, cause: &'static str) {
        let Some(spec) = &self.spec else { return };
        self.pool.metrics.pool.watch_restart(cause);
        // The pods held stay until the new list replaces them.
        self.pod_stream = Some(pod_watch(&self.pods_api, spec));
        self.pod_listing = Some(Instant::now());
    }

    /// A liveness read's result: the server's absence noted once, its return restarting both
    /// watches.
    fn on_probe(&mut self, result: ProbeResult) {
        self.pool.metrics.pool.api_probe(result.label());
        match (&result, self.away_since) {
            (ProbeResult::Answered, None) => {}
            (ProbeResult::Answered, Some(since)) => {
                tracing::info!(pool = %self.description, away = ?since.elapsed(), "endpoint picker: the Kubernetes API server answers again; watching the pool anew");
                self.away_since = None;
                self.pool.set_trouble(None);
                self.restart_pool_watch("api_back");
                self.restart_pod_watch("api_back");
            }
            (_, Some(_)) => {}
            (failed, None) => {
                let why = match failed {
                    ProbeResult::Error(e) => format!("the Kubernetes API server fails: {e}"),
                    _ => format!(
                        "the Kubernetes API server did not answer within {:?} \
                         (endpointPicker.pool.requestTimeout)",
                        self.request_timeout
                    ),
                };
                tracing::warn!(pool = %self.description, "endpoint picker: {why}; the last pool keeps serving until it answers");
                self.away_since = Some(Instant::now());
                self.pool.set_trouble(Some(why));
            }
        }
    }

    fn on_pool(&mut self, event: Result<Event<DynamicObject>, watcher::Error>) {
        let event = match event {
            Ok(e) => e,
            Err(e) => return self.error("inferencepool", &e),
        };
        if let Some(listing) = progress(&event) {
            self.pool_listing = listing;
        }
        if !matches!(event, Event::InitApply(_)) {
            self.pool
                .metrics
                .pool
                .watch_event("inferencepool", kind(&event));
        }
        let object = match event {
            Event::Init => {
                self.listing_pool = Some(None);
                return;
            }
            Event::InitApply(o) => {
                self.listing_pool = Some(Some(o));
                return;
            }
            Event::InitDone => {
                self.pool_listed = true;
                self.listing_pool.take().flatten()
            }
            Event::Apply(o) => Some(o),
            Event::Delete(_) => None,
        };
        self.set_spec(object);
    }

    /// The pool is now `object` (`None`: it does not exist).
    fn set_spec(&mut self, object: Option<DynamicObject>) {
        let spec = match object.as_ref().map(spec_of) {
            None => None,
            Some(Ok(spec)) => Some(spec),
            Some(Err(why)) => {
                tracing::warn!(pool = %self.description, why, "endpoint picker: the InferencePool cannot be read; it lists no endpoint until it can");
                None
            }
        };
        let selector_changed = spec.as_ref().map(PoolSpec::label_selector)
            != self.spec.as_ref().map(PoolSpec::label_selector);
        self.spec = spec;
        match &self.spec {
            None => {
                self.pod_stream = None;
                self.pod_listing = None;
                self.pods = Pods::default();
                let why = match object {
                    None => format!("{} does not exist", self.description),
                    Some(_) => format!("{} cannot be read (see the log)", self.description),
                };
                self.pool.set_absent(why);
            }
            Some(spec) if selector_changed => {
                tracing::info!(pool = %self.description, selector = %spec.label_selector(), "endpoint picker: watching the pool's pods");
                self.pod_stream = Some(pod_watch(&self.pods_api, spec));
                self.pod_listing = Some(Instant::now());
                // The old pods stay until the new selector's first list replaces them.
                self.pods.synced = false;
            }
            Some(_) => self.publish(),
        }
    }

    fn on_pod(&mut self, event: Result<Event<Pod>, watcher::Error>) {
        let event = match event {
            Ok(e) => e,
            Err(e) => return self.error("pod", &e),
        };
        if let Some(listing) = progress(&event) {
            self.pod_listing = listing;
        }
        if !matches!(event, Event::InitApply(_)) {
            self.pool.metrics.pool.watch_event("pod", kind(&event));
        }
        if self.pods.apply(event) {
            self.publish();
        }
    }

    /// The members from the spec and the pods, once both are known.
    fn publish(&self) {
        let Some(spec) = &self.spec else { return };
        if !self.pool_listed || !self.pods.synced {
            return;
        }
        let members = self
            .pods
            .now
            .values()
            .flat_map(|p| members_of(spec, p))
            .collect();
        self.pool.set_members(members);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_core::Role;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("a pod")
    }

    #[test]
    fn a_pool_s_spec_and_a_pod_s_endpoints() {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "n"},
            "spec": {"selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
                     "targetPorts": [{"number": 8000}, {"number": 8001}]}
        }))
        .expect("an object");
        let spec = spec_of(&object).expect("a spec");
        assert_eq!(spec.label_selector(), "app=vllm,tier=a");
        let ready = json!([{"type": "Ready", "status": "True"}]);
        let p = pod(json!({"metadata": {"name": "v-0"},
            "status": {"podIP": "10.1.0.5", "conditions": ready}}));
        let members = members_of(&spec, &p);
        let got: Vec<(&str, &str, Option<u32>, bool)> = members
            .iter()
            .map(|m| {
                let e = &m.endpoint;
                (e.address.as_str(), e.pod.as_str(), e.rank, m.ready)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("10.1.0.5:8000", "10.1.0.5:8000", Some(0), true),
                ("10.1.0.5:8001", "10.1.0.5:8000", Some(1), true)
            ]
        );
        let active = pod(json!({"metadata": {"name": "v-0",
                "annotations": {ACTIVE_PORTS: "8001, x"}},
            "status": {"podIP": "fd00::5", "conditions": ready}}));
        let members = members_of(&spec, &active);
        assert_eq!(members.len(), 1);
        assert_eq!(members[0].endpoint.address, "[fd00::5]:8001");
        assert_eq!(members[0].endpoint.rank, Some(1));
        assert_eq!(members[0].endpoint.role, Role::Decode, "no label: decode");
    }

    #[test]
    fn a_pod_s_role_is_its_llm_d_role_label() {
        let spec = PoolSpec {
            selector: BTreeMap::new(),
            target_ports: vec![8000],
        };
        let ready = json!([{"type": "Ready", "status": "True"}]);
        let of = |label: &str| {
            let p = pod(
                json!({"metadata": {"name": "v", "labels": {"llm-d.ai/role": label}},
                "status": {"podIP": "10.1.0.5", "conditions": ready}}),
            );
            let m = members_of(&spec, &p).remove(0);
            (m.endpoint.role, m.unknown_role)
        };
        assert_eq!(of("prefill"), (Role::Prefill, None));
        assert_eq!(of("decode"), (Role::Decode, None));
        assert_eq!(of("both"), (Role::Both, None));
        assert_eq!(of("encode"), (Role::Neither, None));
        assert_eq!(of("Prefill"), (Role::Neither, Some("Prefill".into())));
    }

    #[test]
    fn readiness_is_gie_s() {
        let with = |conditions: serde_json::Value, ip: &str, deleting: bool| {
            let mut meta = json!({"name": "v"});
            if deleting {
                meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            is_ready(&pod(json!({"metadata": meta,
                "status": {"podIP": ip, "conditions": conditions}})))
        };
        let ready = json!([{"type": "Ready", "status": "True"}]);
        assert!(with(ready.clone(), "10.0.0.1", false));
        assert!(!with(ready.clone(), "10.0.0.1", true), "being deleted");
        assert!(!with(ready, "", false), "no IP");
        assert!(!with(
            json!([{"type": "Ready", "status": "False"}]),
            "10.0.0.1",
            false
        ));
        assert!(!with(
            json!([{"type": "ContainersReady", "status": "True"}]),
            "10.0.0.1",
            false
        ));
    }

    #[test]
    fn pools_without_ports_or_with_bad_labels_are_unreadable() {
        let read = |spec: serde_json::Value| {
            let o: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "p"}, "spec": spec}))
            .expect("an object");
            spec_of(&o)
        };
        assert!(read(json!({"selector": {"matchLabels": {"a": "b"}}})).is_err());
        assert!(read(json!({"targetPorts": [{"number": 70000}]})).is_err());
        assert!(read(json!({"selector": {"matchLabels": {"a": 1}},
            "targetPorts": [{"number": 8000}]}))
        .is_err());
    }
}
