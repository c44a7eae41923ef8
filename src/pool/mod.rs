//! The endpoint picker's pool: which endpoints may serve a request. The candidates are the
//! pool's Ready endpoints whether or not they ever published a KV event (a scaled-out pod
//! competes on load at once); an endpoint whose metrics port gives no connection
//! `endpointPicker.scrapeFailuresToLeave` times in a row is ejected until it answers, at most
//! `endpointPicker.health.maxEjectionPercent` of the Ready ones, and below
//! `panicThresholdPercent` left every Ready endpoint is a candidate again (kv-core's
//! [`Membership`], the rule the lab's simulated gateways keep too). A slow metrics page only
//! ages the pod's load sample.
//!
//! - here: [`Pool`] (the membership, the view picks read, readiness, the listing) and the
//!   sources' common shape ([`Member`]);
//! - [`kubernetes`]: `endpointPicker.pool`, the `InferencePool` and the Pods it selects watched
//!   through the API server;
//! - `sources`: `endpointPicker.endpoints` (a static list) and connect mode's DNS discovery.
//!
//! Without any of them the candidates are the model's live publishers (the picker's behaviour
//! before pools), with the same health rule.
//!
//! Each endpoint carries its pod's prefill/decode [`Role`] (llm-d's `llm-d.ai/role` label, read
//! by kv-core's [`Role::from_label`]): the Kubernetes watcher reads the label, a static entry
//! may name one, DNS answers and publishers decode only (no label).
//!
//! Invariants: a pick reads the [`PoolView`] published after every change, without a lock; the
//! picker is ready once the source has answered, as GIE's EPP is once its pool is synced (an
//! empty pool is ready, and each pick is a 503 saying why; [`Pool::readiness`] says why not);
//! every change of standing is logged and counted by reason, each panic logged once and counted;
//! a publisher the
//! pool does not list is never a candidate, logged once and counted; an endpoint whose role
//! label no llm-d filter knows is neither role (never picked), logged and counted once per
//! endpoint and label.

pub mod kubernetes;
mod liveness;
mod sources;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::EndpointPickerConfig;
use crate::ingest::Discovered;
use crate::metrics::Metrics;
use kv_core::{Change, HealthSettings, Membership, Probe, Role, Standing};

pub use sources::follow_discovery;

/// An endpoint of the pool: where the gateway sends a request, and what the index knows it as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEndpoint {
    /// `ip:port`: the pick's answer, and `{pod}` in `metricsUrlTemplate`.
    pub address: String,
    /// The pod the index scores for it (the name vLLM's topic gives: `ip:port`).
    pub pod: String,
    /// Its data-parallel rank (a pool with several target ports: rank `k` serves on the
    /// `k`-th); `None`: the pod's best rank, as the index scores it.
    pub rank: Option<u32>,
    /// The Kubernetes pod's name (empty outside Kubernetes).
    pub name: String,
    /// What it may do in a prefill/decode split (decode, unlabelled, unless its source says).
    pub role: Role,
}

impl PoolEndpoint {
    /// An endpoint the index knows by its own address (one target port, a static list, DNS),
    /// decoding only (no role label).
    pub fn plain(address: String) -> Self {
        Self {
            pod: address.clone(),
            address,
            rank: None,
            name: String::new(),
            role: Role::Decode,
        }
    }
}

/// An endpoint as a source lists it, and whether the source says it is Ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The endpoint.
    pub endpoint: PoolEndpoint,
    /// Ready, as the source says (a static list and DNS answers list Ready endpoints only).
    pub ready: bool,
    /// The role label no llm-d filter knows, when its pod carries one (the endpoint's role is
    /// then [`Role::Neither`]).
    pub unknown_role: Option<String>,
}

/// The role a pod's `llm-d.ai/role` label gives (`None`: no label), and the label itself when
/// no llm-d filter knows it (the role is then [`Role::Neither`], as llm-d excludes it): what
/// every source fills a [`Member`]'s role and `unknown_role` with.
pub(crate) fn role_of(label: Option<&str>) -> (Role, Option<String>) {
    match Role::from_label(label) {
        Ok(role) => (role, None),
        Err(unknown) => (Role::Neither, Some(unknown.0)),
    }
}

/// Where the pool's members come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// `endpointPicker.pool`: an InferencePool through the Kubernetes API.
    Kubernetes,
    /// `endpointPicker.endpoints`.
    Static,
    /// `kvEventsConfig.discovery.services`.
    Dns,
    /// None: the model's live publishers are the candidates.
    Publishers,
}

impl SourceKind {
    /// Its name in logs and `ListPods`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Kubernetes => "kubernetes",
            Self::Static => "static",
            Self::Dns => "dns",
            Self::Publishers => "publishers",
        }
    }
}

/// What a pick reads: published after every change.
#[derive(Debug, Default)]
pub struct PoolView {
    /// The pool's candidates, by address (empty without a pool).
    pub candidates: Vec<PoolEndpoint>,
    /// Endpoints ejected for probes without a connection, that picks skip (without a pool:
    /// publishers; empty while the pool panics).
    pub unreachable: HashSet<String>,
}

/// One endpoint as `ListPods` shows it.
#[derive(Debug, Clone)]
pub struct Listed {
    /// The endpoint.
    pub endpoint: PoolEndpoint,
    /// Where it stands.
    pub standing: Standing,
    /// Its metrics reads that failed in a row.
    pub failures: u32,
}

struct Inner {
    membership: Membership,
    endpoints: BTreeMap<String, PoolEndpoint>,
    synced: bool,
    /// Why the source lists nothing, when it says so (the InferencePool does not exist).
    absent: Option<String>,
    /// Publishers seen outside the pool (each logged and counted once).
    outside: HashSet<String>,
    /// Endpoints seen with an unknown role label, with it (each logged and counted once).
    unknown_roles: HashSet<(String, String)>,
    /// Whether a prefill/decode split is configured (its pool should list a pod that
    /// prefills), and whether the last view had one (so the warning is logged per change).
    wants_prefill: bool,
    had_prefill: Option<bool>,
    /// Whether the last view was a panic's (every Ready endpoint a candidate).
    panicking: bool,
    /// What the source's last failure was, while it fails.
    trouble: Option<String>,
}

/// The pool: its members, their health, and the view picks read.
pub struct Pool {
    kind: SourceKind,
    /// What the source is, for logs and `/readyz` ("InferencePool llm/vllm").
    description: String,
    inner: Mutex<Inner>,
    view: ArcSwap<PoolView>,
    /// Woken on every change (the scraper reads a new endpoint at once).
    changed: tokio::sync::Notify,
    metrics: Arc<Metrics>,
}

impl Pool {
    /// An empty pool of `kind`; endpoints are ejected as `health` says.
    pub fn new(
        kind: SourceKind,
        description: String,
        health: HealthSettings,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let mut membership = Membership::new(health);
        if kind != SourceKind::Publishers {
            // A pool known to list nothing yet: its first members are counted as added.
            membership.set_pool(std::iter::empty());
        }
        Arc::new(Self {
            kind,
            description,
            inner: Mutex::new(Inner {
                membership,
                endpoints: BTreeMap::new(),
                synced: kind == SourceKind::Publishers,
                absent: None,
                outside: HashSet::new(),
                unknown_roles: HashSet::new(),
                wants_prefill: false,
                had_prefill: None,
                panicking: false,
                trouble: None,
            }),
            view: ArcSwap::default(),
            changed: tokio::sync::Notify::new(),
            metrics,
        })
    }

    /// Says a prefill/decode split is configured: a view without a candidate that prefills
    /// is then logged (a warning, once per change), since nothing can be split.
    pub fn want_prefill(&self) {
        let mut inner = self.inner.lock();
        inner.wants_prefill = true;
        self.publish(&mut inner, &[]);
    }

    /// Where the members come from.
    pub fn kind(&self) -> SourceKind {
        self.kind
    }

    /// Whether a source lists the members (else the publishers are the candidates).
    pub fn is_pool(&self) -> bool {
        self.kind != SourceKind::Publishers
    }

    /// The view a pick reads.
    pub fn view(&self) -> arc_swap::Guard<Arc<PoolView>> {
        self.view.load()
    }

    /// Resolves at the pool's next change.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// The source's members now (it has answered).
    pub fn set_members(&self, members: Vec<Member>) {
        self.set(members, None);
    }

    /// The source says the pool does not exist (`why`): no members.
    pub fn set_absent(&self, why: String) {
        self.set(Vec::new(), Some(why));
    }

    fn set(&self, members: Vec<Member>, absent: Option<String>) {
        let mut inner = self.inner.lock();
        self.note_unknown_roles(&mut inner, &members);
        let changes = inner.membership.set_pool(
            members
                .iter()
                .map(|m| (m.endpoint.address.clone(), m.ready)),
        );
        inner.endpoints = members
            .into_iter()
            .map(|m| (m.endpoint.address.clone(), m.endpoint))
            .collect();
        if !inner.synced {
            tracing::info!(pool = %self.description, endpoints = inner.endpoints.len(), "endpoint picker: the pool's source answered");
        }
        inner.synced = true;
        inner.absent = absent;
        self.metrics.pool.synced(true);
        self.publish(&mut inner, &changes);
    }

    /// Logs and counts, once per endpoint and label, the members whose role label no llm-d
    /// filter knows (they are neither role, so never picked).
    fn note_unknown_roles(&self, inner: &mut Inner, members: &[Member]) {
        for m in members {
            let Some(label) = &m.unknown_role else {
                continue;
            };
            if inner
                .unknown_roles
                .insert((m.endpoint.address.clone(), label.clone()))
            {
                let e = kv_core::UnknownRole(label.clone());
                tracing::warn!(endpoint = %m.endpoint.address, name = %m.endpoint.name, pool = %self.description, error = %e, "endpoint picker: a pod's role label is unknown; it is neither a prefill nor a decode candidate");
                self.metrics.pool.unknown_role();
            }
        }
    }

    /// Counts a read of `endpoint`'s metrics.
    pub fn probed(&self, endpoint: &str, probe: Probe) {
        let mut inner = self.inner.lock();
        let changes = inner.membership.probed(endpoint, probe);
        if !changes.is_empty() {
            self.publish(&mut inner, &changes);
        }
    }

    /// Logs and counts `changes`, then publishes the view.
    fn publish(&self, inner: &mut Inner, changes: &[Change]) {
        for c in changes {
            self.metrics.pool.changed(c.from, c.to);
            tracing::info!(endpoint = %c.endpoint, from = c.from.label(), to = c.to.label(), pool = %self.description, "endpoint picker: an endpoint's standing changed");
        }
        let m = &inner.membership;
        let candidates: Vec<PoolEndpoint> = m
            .candidates()
            .iter()
            .filter_map(|e| inner.endpoints.get(e).cloned())
            .collect();
        let count = |s: Standing| m.members().filter(|(_, x)| *x == s).count();
        self.metrics.pool.standings(
            candidates.len(),
            count(Standing::NotReady),
            count(Standing::Unreachable),
        );
        let view = PoolView {
            candidates,
            unreachable: match m.panicking() {
                true => HashSet::new(),
                false => m.unreachable().into_iter().collect(),
            },
        };
        self.view.store(Arc::new(view));
        self.changed.notify_waiters();
        self.check_panic(inner);
        self.check_prefill(inner);
    }

    /// Logs and counts a panic's start (once per episode) and its end.
    fn check_panic(&self, inner: &mut Inner) {
        let m = &inner.membership;
        let now = m.panicking();
        self.metrics.pool.panicking(now);
        if now == inner.panicking {
            return;
        }
        inner.panicking = now;
        let ejected = m.unreachable().len();
        let threshold = m.settings().panic_threshold_percent;
        match now {
            true => {
                self.metrics.pool.panic();
                tracing::warn!(pool = %self.description, ejected, threshold_percent = threshold, "endpoint picker: panic: too few endpoints would be left, so every Ready endpoint is a candidate, ejected ones included, until enough answer again (endpointPicker.health.panicThresholdPercent)");
            }
            false => {
                tracing::info!(pool = %self.description, ejected, "endpoint picker: panic over: ejected endpoints are skipped again")
            }
        }
    }

    /// With a split configured: warns when the candidates come to have no pod that prefills
    /// (once per change; also at start for a source that can list no role).
    fn check_prefill(&self, inner: &mut Inner) {
        if !inner.wants_prefill || !inner.synced {
            return;
        }
        let has = self
            .view
            .load()
            .candidates
            .iter()
            .any(|c| c.role.prefills());
        if inner.had_prefill == Some(has) {
            return;
        }
        inner.had_prefill = Some(has);
        match has {
            true => {
                tracing::info!(pool = %self.description, "endpoint picker: the pool has a candidate that prefills; long prompts may be split (endpointPicker.pd)")
            }
            false => {
                tracing::warn!(pool = %self.description, "endpoint picker: endpointPicker.pd.threshold is set but no candidate prefills (no pod labelled llm-d.ai/role: prefill, prefill-decode, both, encode-prefill or encode-prefill-decode): no request is split")
            }
        }
    }

    /// `Ok` when the picker has its pool: always without a pool; with one, once its source has
    /// answered (as GIE's EPP is ready once its pool is synced), whether or not it lists a
    /// candidate (a pick then is a 503 saying why, [`Self::why_empty`]). `Err` says why not.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.is_pool() {
            return Ok(());
        }
        let inner = self.inner.lock();
        if !inner.synced {
            let mut why = format!("waiting for {}'s first answer", self.description);
            if let Some(trouble) = &inner.trouble {
                why.push_str(&format!(" ({trouble})"));
            }
            return Err(why);
        }
        match &inner.absent {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// Why the pool has no candidate now, for a pick's 503 (`None`: it has one).
    pub fn why_empty(&self) -> Option<String> {
        if let Err(why) = self.readiness() {
            return Some(why);
        }
        let inner = self.inner.lock();
        let m = &inner.membership;
        if !self.is_pool() || m.members().any(|(e, _)| m.admits(e)) {
            return None;
        }
        let count = |s: Standing| m.members().filter(|(_, x)| *x == s).count();
        Some(format!(
            "{} has no ready endpoint ({} listed: {} not Ready, {} unreachable)",
            self.description,
            inner.endpoints.len(),
            count(Standing::NotReady),
            count(Standing::Unreachable)
        ))
    }

    /// The source is having trouble (`Some`: why, e.g. the API server does not answer) or is
    /// not (`None`); shown by `/readyz` until the first answer.
    pub fn set_trouble(&self, trouble: Option<String>) {
        self.inner.lock().trouble = trouble;
    }

    /// The endpoints to read metrics from: the pool's Ready members (`None` without a pool:
    /// the caller's publishers).
    pub fn scrape_targets(&self) -> Option<Vec<Arc<str>>> {
        if !self.is_pool() {
            return None;
        }
        let inner = self.inner.lock();
        let targets = inner
            .membership
            .members()
            .filter(|(_, s)| matches!(s, Standing::Candidate | Standing::Unreachable))
            .map(|(e, _)| Arc::from(e))
            .collect();
        Some(targets)
    }

    /// Without a pool: forgets the health of endpoints no longer read (`scraped` lists those
    /// read now, sorted).
    pub fn forget_unscraped(&self, scraped: &[Arc<str>]) {
        if self.is_pool() {
            return;
        }
        let mut inner = self.inner.lock();
        let before = inner.membership.unreachable().len();
        inner
            .membership
            .forget(|e| scraped.binary_search_by(|s| (**s).cmp(e)).is_ok());
        if inner.membership.unreachable().len() != before {
            self.publish(&mut inner, &[]);
        }
    }

    /// With a pool: the publishers (index pod names) the pool does not list are logged once
    /// each and counted.
    pub fn note_publishers(&self, publishers: &[String]) {
        if !self.is_pool() {
            return;
        }
        let mut inner = self.inner.lock();
        if !inner.synced {
            return;
        }
        let known: HashSet<&str> = inner.endpoints.values().map(|e| e.pod.as_str()).collect();
        let outside: Vec<String> = publishers
            .iter()
            .filter(|p| !known.contains(p.as_str()))
            .cloned()
            .collect();
        let mut new = 0;
        for p in &outside {
            if inner.outside.insert(p.clone()) {
                new += 1;
                tracing::warn!(pod = %p, pool = %self.description, "endpoint picker: a pod publishes KV events but the pool does not list it; it is not a candidate");
            }
        }
        self.metrics.pool.outside(new, outside.len());
    }

    /// Every endpoint the pool lists, with its standing (empty without a pool).
    pub fn listing(&self) -> Vec<Listed> {
        let inner = self.inner.lock();
        inner
            .membership
            .members()
            .filter_map(|(e, standing)| {
                Some(Listed {
                    endpoint: inner.endpoints.get(e)?.clone(),
                    standing,
                    failures: inner.membership.failures(e),
                })
            })
            .collect()
    }

    /// The health of `endpoint` (with or without a pool).
    pub fn standing(&self, endpoint: &str) -> (Standing, u32) {
        let inner = self.inner.lock();
        (
            inner.membership.standing(endpoint),
            inner.membership.failures(endpoint),
        )
    }
}

/// Why the pool could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The Kubernetes client could not be configured.
    #[error("endpointPicker.pool: {0}")]
    Kubernetes(String),
}

/// The pool `config` describes, with its source's task (none for a static list or without a
/// pool). `discovered`: connect mode's DNS answers, when discovery is on.
pub async fn start(
    config: &EndpointPickerConfig,
    discovered: Option<watch::Receiver<Discovered>>,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
) -> Result<(Arc<Pool>, Option<JoinHandle<()>>), PoolError> {
    let failures = config.health.settings(config.scrape_failures_to_leave);
    if let Some(pool_ref) = &config.pool {
        let (client, namespace) = kubernetes::client(pool_ref)
            .await
            .map_err(PoolError::Kubernetes)?;
        let description = format!("InferencePool {namespace}/{}", pool_ref.name);
        let pool = Pool::new(SourceKind::Kubernetes, description, failures, metrics);
        want_prefill(config, &pool);
        tracing::info!(pool = %pool.description, "endpoint picker: candidates are the pool's Ready pods (watched through the Kubernetes API)");
        let task = kubernetes::watch(client, &namespace, pool_ref, pool.clone(), shutdown);
        return Ok((pool, Some(task)));
    }
    if !config.endpoints.is_empty() {
        let description = format!("endpointPicker.endpoints ({})", config.endpoints.len());
        let pool = Pool::new(SourceKind::Static, description, failures, metrics);
        want_prefill(config, &pool);
        pool.set_members(sources::static_members(&config.endpoints));
        return Ok((pool, None));
    }
    if let Some(discovered) = discovered {
        let description = "kvEventsConfig.discovery.services".to_owned();
        let pool = Pool::new(SourceKind::Dns, description, failures, metrics);
        want_prefill(config, &pool);
        tracing::info!("endpoint picker: candidates are the addresses DNS discovery answers");
        let task = tokio::spawn(follow_discovery(discovered, pool.clone(), shutdown));
        return Ok((pool, Some(task)));
    }
    let description = "the model's live publishers".to_owned();
    tracing::info!("endpoint picker: no pool configured; candidates are the model's live publishers (endpointPicker.pool or endpointPicker.endpoints lists the pool)");
    let pool = Pool::new(SourceKind::Publishers, description, failures, metrics);
    want_prefill(config, &pool);
    Ok((pool, None))
}

/// Tells `pool` a split is configured (`endpointPicker.pd.threshold` above 0).
fn want_prefill(config: &EndpointPickerConfig, pool: &Pool) {
    if config.pd.threshold > 0 {
        pool.want_prefill();
    }
}

#[cfg(test)]
mod tests;
