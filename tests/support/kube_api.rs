//! A Kubernetes API server in the test process, for the endpoint picker's pool watcher: it
//! serves `InferencePool`s (`inference.networking.k8s.io/v1`) and `Pod`s of namespaces the
//! test fills, and speaks list and watch as the API server does (written from the API
//! concepts documentation, https://kubernetes.io/docs/reference/using-api/api-concepts/):
//! - a list (`GET .../pods?labelSelector=..&limit=..`) answers a `PodList` whose
//!   `metadata.resourceVersion` is the store's current version;
//! - a watch (`?watch=true&resourceVersion=N&allowWatchBookmarks=true`) streams newline-
//!   separated JSON events (`ADDED`, `MODIFIED`, `DELETED`; `BOOKMARK` with only a
//!   `resourceVersion` when asked) for every change after `N`; a change that makes an object
//!   enter or leave a label selector is `ADDED` or `DELETED` to that watch, as the API server's
//!   watch cache sends it;
//! - a watch from a version older than the compacted history gets one `ERROR` event carrying a
//!   `Status` with code 410 (`Expired`), in a 200 response, as the API server answers it;
//! - `labelSelector` (`k=v,k=v`) and `fieldSelector=metadata.name=..` filter lists and watches.
//!
//! - a get (`GET .../inferencepools/<name>`) answers the object, or a 404 `Status`.
//!
//! The test drives it: objects added, changed and deleted; bookmarks sent; open watches dropped
//! (as the server's watch timeout ends them); history compacted; new watches held back; every
//! request recorded; and the server hung ([`KubeApi::hang`]): it accepts connections and never
//! answers, and open watches stall for good, as behind a proxy that lost them.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, Notify};

/// A resource the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    /// `inference.networking.k8s.io/v1` `inferencepools`.
    Pools,
    /// `v1` `pods`.
    Pods,
}

impl Resource {
    fn kind(self) -> &'static str {
        match self {
            Self::Pools => "InferencePool",
            Self::Pods => "Pod",
        }
    }
    fn api_version(self) -> &'static str {
        match self {
            Self::Pools => "inference.networking.k8s.io/v1",
            Self::Pods => "v1",
        }
    }
}

/// A request the server answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Which resource.
    pub resource: Resource,
    /// A watch (else a list).
    pub watch: bool,
    /// Its query parameters.
    pub query: HashMap<String, String>,
}

/// What a watch is told next.
#[derive(Debug, Clone)]
enum Note {
    /// A change (version, resource, namespace, type, object, the object before it).
    Change(u64, Resource, String, &'static str, Value, Option<Value>),
    /// A bookmark at the current version.
    Bookmark(u64),
    /// Open watches end.
    Drop,
}

#[derive(Default)]
struct Store {
    version: u64,
    /// (resource, namespace, name) -> object.
    objects: BTreeMap<(Resource, String, String), Value>,
    /// Every change, in order.
    log: Vec<Note>,
    /// A watch from a version below this one is expired (410).
    compacted_below: u64,
    held: bool,
}

struct Shared {
    store: Mutex<Store>,
    notes: broadcast::Sender<Note>,
    released: Notify,
    requests: Mutex<Vec<Recorded>>,
    /// Watches answered 410 Gone.
    gone: std::sync::atomic::AtomicU64,
    /// Hung: requests are accepted and never answered; open watches stall.
    hung: std::sync::atomic::AtomicBool,
    /// Hangs so far: a watch opened before the last one stalls for good.
    hangs: Arc<std::sync::atomic::AtomicU64>,
}

/// The running server; stops when dropped.
pub struct KubeApi {
    /// Where it listens (`http://`).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether `labels` match a `k=v,k=v` selector (empty: everything).
fn selector_matches(selector: &str, labels: &Value) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some((k, v)) => labels.get(k).and_then(Value::as_str) == Some(v),
            None => false,
        })
}

/// Whether `object` passes the request's selectors.
fn selected(query: &HashMap<String, String>, object: &Value) -> bool {
    let labels = &object["metadata"]["labels"];
    let by_label = query
        .get("labelSelector")
        .is_none_or(|s| selector_matches(s, labels));
    let by_field = match query
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
    {
        Some(name) => object["metadata"]["name"].as_str() == Some(name),
        None => true,
    };
    by_label && by_field
}

fn line(value: Value) -> Result<Bytes, std::io::Error> {
    let mut text = value.to_string();
    text.push('\n');
    Ok(Bytes::from(text))
}

/// The event a watch with `query` sees for `note` (`None`: not its business).
fn event_for(
    resource: Resource,
    namespace: &str,
    query: &HashMap<String, String>,
    note: &Note,
) -> Option<Value> {
    match note {
        Note::Change(_, r, ns, kind, object, before) if *r == resource && ns == namespace => {
            let now = selected(query, object);
            let was = before.as_ref().is_some_and(|b| selected(query, b));
            let kind = match (*kind, was, now) {
                ("DELETED", true, _) => "DELETED",
                ("DELETED", false, _) => return None,
                (_, false, true) => "ADDED",
                (_, true, true) => "MODIFIED",
                (_, true, false) => "DELETED",
                (_, false, false) => return None,
            };
            Some(json!({"type": kind, "object": object}))
        }
        Note::Bookmark(v)
            if query
                .get("allowWatchBookmarks")
                .is_some_and(|b| b == "true") =>
        {
            Some(json!({"type": "BOOKMARK", "object": {
                "kind": resource.kind(), "apiVersion": resource.api_version(),
                "metadata": {"resourceVersion": v.to_string()}}}))
        }
        _ => None,
    }
}

impl KubeApi {
    /// Starts the server on a free loopback port.
    pub async fn start() -> Self {
        let (notes, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                version: 100,
                ..Default::default()
            }),
            notes,
            released: Notify::new(),
            requests: Mutex::new(Vec::new()),
            gone: Default::default(),
            hung: Default::default(),
            hangs: Default::default(),
        });
        let app = Router::new()
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(pools),
            )
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                get(one_pool),
            )
            .route("/api/v1/namespaces/{ns}/pods", get(pods))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, shared, task }
    }

    /// A kubeconfig file naming this server (plain HTTP, no credentials) with `namespace` as
    /// its context's namespace.
    pub fn kubeconfig(&self, dir: &std::path::Path, namespace: &str) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).expect("dir");
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: \
             http://{}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    \
             namespace: {namespace}\ncurrent-context: test\nusers:\n- name: test\n  user: {{}}\n",
            self.addr
        );
        std::fs::write(&path, text).expect("kubeconfig written");
        path
    }

    fn change(&self, resource: Resource, ns: &str, name: &str, object: Option<Value>) {
        let mut store = self.shared.store.lock().expect("store");
        store.version += 1;
        let v = store.version;
        let key = (resource, ns.to_owned(), name.to_owned());
        let before = store.objects.get(&key).cloned();
        let note = match object {
            Some(mut o) => {
                o["metadata"]["resourceVersion"] = json!(v.to_string());
                store.objects.insert(key, o.clone());
                let kind = if before.is_some() {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                Note::Change(v, resource, ns.to_owned(), kind, o, before)
            }
            None => {
                let Some(mut o) = store.objects.remove(&key) else {
                    return;
                };
                o["metadata"]["resourceVersion"] = json!(v.to_string());
                Note::Change(v, resource, ns.to_owned(), "DELETED", o, before)
            }
        };
        store.log.push(note.clone());
        let _ = self.shared.notes.send(note);
    }

    /// Adds or replaces the InferencePool `name` (`selector` its matchLabels, `ports` its
    /// targetPorts).
    pub fn set_pool(&self, ns: &str, name: &str, selector: &[(&str, &str)], ports: &[u16]) {
        let labels: serde_json::Map<String, Value> = selector
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
        let object = json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}")},
            "spec": {"selector": {"matchLabels": labels}, "targetPorts": ports,
                     "endpointPickerRef": {"name": "kv-indexer", "port": {"number": 9002}}}
        });
        self.change(Resource::Pools, ns, name, Some(object));
    }

    /// Deletes the InferencePool `name`.
    pub fn delete_pool(&self, ns: &str, name: &str) {
        self.change(Resource::Pools, ns, name, None);
    }

    /// Adds or replaces the pod `name` at `ip` with `labels`, Ready or not.
    pub fn set_pod(&self, ns: &str, name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let status = if ready { "True" } else { "False" };
        let object = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "uid": format!("uid-{name}")},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": status}]}
        });
        self.change(Resource::Pods, ns, name, Some(object));
    }

    /// Deletes the pod `name`.
    pub fn delete_pod(&self, ns: &str, name: &str) {
        self.change(Resource::Pods, ns, name, None);
    }

    /// The store's current resourceVersion.
    pub fn version(&self) -> u64 {
        self.shared.store.lock().expect("store").version
    }

    /// Sends every open watch that asked for them a bookmark at the current version.
    pub fn bookmark(&self) -> u64 {
        let v = self.version();
        let _ = self.shared.notes.send(Note::Bookmark(v));
        v
    }

    /// Ends every open watch (as the server's watch timeout does); clients resume from the
    /// last version they saw.
    pub fn drop_watches(&self) {
        let _ = self.shared.notes.send(Note::Drop);
    }

    /// Forgets the history up to now: a watch from any version seen so far gets 410 Gone.
    pub fn compact(&self) {
        let mut store = self.shared.store.lock().expect("store");
        store.compacted_below = store.version + 1;
    }

    /// New watches wait (`true`) until released (`false`).
    pub fn hold_watches(&self, held: bool) {
        self.shared.store.lock().expect("store").held = held;
        if !held {
            self.shared.released.notify_waiters();
        }
    }

    /// Hangs (`true`): every request from now on is accepted and never answered, even after
    /// the server answers again, and every open watch stalls for good; `false`: new requests
    /// are answered again.
    pub fn hang(&self, hung: bool) {
        if hung {
            self.shared
                .hangs
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.shared
            .hung
            .store(hung, std::sync::atomic::Ordering::SeqCst);
    }

    /// The requests answered so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().expect("requests").clone()
    }

    /// Watches answered 410 Gone so far.
    pub fn gone(&self) -> u64 {
        self.shared.gone.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lists of `resource` answered so far.
    pub fn lists(&self, resource: Resource) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.resource == resource && !r.watch)
            .count()
    }

    /// Waits (at most 10 s) until `done` holds of the requests, panicking with `what` if not.
    pub async fn wait_for(&self, what: &str, done: impl Fn(&[Recorded]) -> bool) {
        for _ in 0..1000 {
            if done(&self.requests()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what}: {:#?}", self.requests());
    }
}

/// `%XX` and `+` decoded.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(&text[i + 1..i + 3], 16) {
                Ok(b) => {
                    out.push(b);
                    i += 2;
                }
                Err(_) => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A query string's parameters.
fn params(query: Option<String>) -> HashMap<String, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

async fn pools(
    State(s): State<Arc<Shared>>,
    axum::extract::Path(ns): axum::extract::Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    serve(s, Resource::Pools, ns, params(q)).await
}

async fn one_pool(
    State(s): State<Arc<Shared>>,
    axum::extract::Path((ns, name)): axum::extract::Path<(String, String)>,
) -> Response {
    if s.hung.load(std::sync::atomic::Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    let key = (Resource::Pools, ns, name.clone());
    let object = s.store.lock().expect("store").objects.get(&key).cloned();
    match object {
        Some(o) => ([(header::CONTENT_TYPE, "application/json")], o.to_string()).into_response(),
        None => {
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "reason": "NotFound", "code": 404,
                "message": format!("inferencepools \"{name}\" not found")});
            (
                StatusCode::NOT_FOUND,
                [(header::CONTENT_TYPE, "application/json")],
                status.to_string(),
            )
                .into_response()
        }
    }
}

async fn pods(
    State(s): State<Arc<Shared>>,
    axum::extract::Path(ns): axum::extract::Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    serve(s, Resource::Pods, ns, params(q)).await
}

async fn serve(
    s: Arc<Shared>,
    resource: Resource,
    ns: String,
    q: HashMap<String, String>,
) -> Response {
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if s.hung.load(std::sync::atomic::Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    s.requests.lock().expect("requests").push(Recorded {
        resource,
        watch,
        query: q.clone(),
    });
    if !watch {
        return list(&s, resource, &ns, &q);
    }
    loop {
        let released = s.released.notified();
        if !s.store.lock().expect("store").held {
            break;
        }
        released.await;
    }
    watch_stream(&s, resource, ns, q)
}

fn list(s: &Shared, resource: Resource, ns: &str, q: &HashMap<String, String>) -> Response {
    let store = s.store.lock().expect("store");
    let items: Vec<Value> = store
        .objects
        .iter()
        .filter(|((r, n, _), o)| *r == resource && n == ns && selected(q, o))
        .map(|(_, o)| o.clone())
        .collect();
    let body = json!({
        "apiVersion": resource.api_version(), "kind": format!("{}List", resource.kind()),
        "metadata": {"resourceVersion": store.version.to_string()},
        "items": items,
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn watch_stream(
    s: &Shared,
    resource: Resource,
    ns: String,
    q: HashMap<String, String>,
) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let store = s.store.lock().expect("store");
    let chunked = |lines: Vec<Value>, live: Option<broadcast::Receiver<Note>>| {
        let backlog = futures::stream::iter(lines.into_iter().map(line));
        let hangs = s.hangs.clone();
        let born = hangs.load(std::sync::atomic::Ordering::SeqCst);
        let live = futures::stream::unfold(
            (live, resource, ns.clone(), q.clone()),
            move |(rx, resource, ns, q)| {
                let hangs = hangs.clone();
                async move {
                    let mut rx = rx?;
                    loop {
                        let note = rx.recv().await;
                        // A watch open while the server hung stalls for good.
                        if hangs.load(std::sync::atomic::Ordering::SeqCst) != born {
                            std::future::pending::<()>().await;
                        }
                        match note {
                            Ok(Note::Drop) | Err(broadcast::error::RecvError::Closed) => {
                                return None
                            }
                            Ok(note) => {
                                if let Some(e) = event_for(resource, &ns, &q, &note) {
                                    return Some((line(e), (Some(rx), resource, ns, q)));
                                }
                            }
                            Err(broadcast::error::RecvError::Lagged(_)) => return None,
                        }
                    }
                }
            },
        );
        use futures::StreamExt;
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from_stream(backlog.chain(live)))
            .expect("a response")
    };
    if from < store.compacted_below {
        s.gone.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let status = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {from} ({})", store.compacted_below),
            "reason": "Expired", "code": 410}});
        return chunked(vec![status], None);
    }
    let backlog: Vec<Value> = store
        .log
        .iter()
        .filter(|n| matches!(n, Note::Change(v, ..) if *v > from))
        .filter_map(|n| event_for(resource, &ns, &q, n))
        .collect();
    let live = s.notes.subscribe();
    drop(store);
    chunked(backlog, Some(live))
}
