//! Event ingestion: ZMQ SUB sockets receive vLLM's `[topic, seq, payload]` messages, workers
//! decode them and apply them to the [`Indexer`], keeping every publisher's stream in order and
//! complete where vLLM's buffer allows.
//!
//! - [`sockets`]: bind mode (one SUB socket binds `zmqEndpoint`; vLLM pods connect to it) and
//!   connect mode (one SUB socket per listed pod endpoint, each retrying in the background, so
//!   a pod that is down never blocks the daemon); frames are checked and dispatched by pod;
//! - [`discovery`]: connect mode by DNS (the pods behind a headless Service, dialled as they
//!   come and dropped as they go);
//! - [`sequence`]: the pure per-publisher state machine (first, next, duplicate, restart, gap);
//! - [`inbox`]: each worker's queue, one lane per pod, bounded by bytes;
//! - [`workers`]: decode, sequence, gap fill, resync after drops, apply;
//! - [`gap_fill`]: the client of vLLM's replay socket; [`topic`]: topic and endpoint grammar;
//! - [`lifecycle`]: noticing that a pod left, and forgetting it after a grace period;
//!   [`publishers`]: every publisher's stream state, by pod;
//! - [`shared_log`]: the port to a shared event log (replication implements it; ingestion
//!   never imports replication); [`feeder`]: the log's way back in (entries to the workers,
//!   pauses for snapshots, whether the log flows).
//!
//! Invariants:
//! - a message with a bad frame count, a short sequence or an unparsable topic is dropped,
//!   counted (`kvindexer_frame_errors_total{reason}`) and logged at most once per 10 s per
//!   reason; nothing a publisher sends can stop a receiver or a worker;
//! - all messages of one pod go to the same worker (pod hash), so its events apply in order;
//!   different pods apply in parallel;
//! - a receiver never waits on a worker, and nothing is dropped for being many: each worker's
//!   [`inbox`] is bounded by bytes (`queueBytes`, `queueBytesPerPod`) and serves its pods in
//!   turn; only a pod past its share loses queued messages, and the worker then resynchronises
//!   its publisher (gap fill, else counted as lost and marked stale);
//! - per publisher (pod, model, DP rank): a gap is filled once from the publisher's replay
//!   socket (never retried: no loops), and what it cannot supply is counted as lost; a sequence
//!   that goes backwards is a restarted vLLM, whose cache is gone, so its blocks are cleared
//!   first; a repeated sequence is a duplicate and dropped; a first message that does not start
//!   at 0 fetches from 0 when possible;
//! - gap fill runs off the event path: it is a task of its own (at most `maxGapFillsInFlight`
//!   at once); meanwhile that publisher's messages wait in a bounded buffer and every other
//!   publisher's apply as usual; a publisher whose gap fill fails is backed off (1 s doubling to
//!   60 s) and its gaps are counted as lost without asking it again;
//! - with a shared log ([`SharedLog`], replication), every message applied from this replica's
//!   own sockets is appended to it, and messages other replicas appended come back through a
//!   [`Feeder`] to the same worker as the pod's own messages; one sequence state per publisher
//!   covers both paths, so each (publisher, sequence) is applied once, whichever path brought
//!   it first (an older message after a newer one is stale, see [`sequence`]);
//! - a pod is forgotten in one place, its worker ([`Job::ClearPod`], [`Job::Forget`]), in
//!   order with its messages: an admin clear ([`Pods::clear_pod`]) drops the pod's parked gap
//!   fills with its blocks, so nothing fetched before the clear can bring them back.

pub mod discovery;
mod feeder;
pub mod gap_fill;
mod inbox;
pub mod lifecycle;
mod publishers;
pub mod sequence;
pub mod shared_log;
mod sockets;
pub mod topic;
mod workers;

pub use feeder::Feeder;
pub use publishers::Publishers;
pub use shared_log::{LogEntry, LogHandle, SharedLog, Stamp};

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use kv_core::Indexer;
use thiserror::Error;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use zeromq::{Socket, SubSocket};

use crate::config::KvEventsConfig;
use crate::metrics::Metrics;
use crate::warn_budget::{WarnBudget, WarnThrottle};

/// Why ingestion could not start.
#[derive(Debug, Error)]
pub enum IngestError {
    /// The bind-mode SUB socket could not bind.
    #[error("binding {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
    /// Subscribing failed.
    #[error("subscribing on {endpoint}: {source}")]
    Subscribe {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: zeromq::ZmqError,
    },
    /// DNS discovery could not set up its resolver.
    #[error("connect-mode discovery: {0}")]
    Discovery(#[from] discovery::DiscoveryError),
}

/// A publisher: one vLLM engine process (its own sequence counter).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublisherKey {
    /// Pod id.
    pub pod: Arc<str>,
    /// Model.
    pub model: Arc<str>,
    /// Data-parallel rank (from the batch).
    pub rank: u32,
}

/// What the daemon knows about a publisher's stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublisherState {
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// The timestamp (`ts`, vLLM's wall clock) of the batch applied last; with `last_seq` it
    /// tells a stale message from a restart.
    pub last_ts: f64,
    /// The replica whose socket received the message applied last (this one's id when the
    /// message came from its own socket).
    pub received_by: Arc<str>,
    /// Messages applied.
    pub messages: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Restarts seen.
    pub restarts: u64,
    /// Messages lost for good (gaps gap fill could not supply).
    pub messages_lost: u64,
    /// Gap fills that failed in a row (0 once one succeeds). While it is not 0 the publisher is
    /// in backoff: its gaps are counted as lost without asking it again until `backoff_until`.
    pub gap_fill_failures: u32,
    /// No gap fill is asked of this publisher before this instant.
    pub backoff_until: Option<std::time::Instant>,
    /// Messages dropped from this replica's queue because the pod passed its share
    /// (`queueBytesPerPod`, `queueBytes`); each drop starts a resync.
    pub messages_dropped: u64,
    /// Messages were lost (a gap or a drop nothing could fill) since the engine's blocks were
    /// last cleared: its blocks may be short or stale.
    pub stale: bool,
}

/// The admin API's view of the pods: the publishers with what tells whether their pods are
/// there (what ListPods reports), and the way to clear one (ClearPod).
#[derive(Clone)]
pub struct Pods {
    /// Publisher states.
    pub publishers: Arc<Publishers>,
    links: Arc<lifecycle::Links>,
    lifecycle: lifecycle::LifecycleSettings,
    /// The workers' queues, while ingestion runs (held weakly: the admin API must not keep the
    /// queues open past shutdown).
    dispatch: Weak<Dispatch>,
}

/// Why an admin clear was not carried out.
#[derive(Debug, Error)]
pub enum ClearError {
    /// Ingestion has stopped (the daemon is shutting down).
    #[error("event ingestion has stopped")]
    Stopped,
}

impl Pods {
    /// Forgets `pod` in `model` through the pod's worker, in order with its messages: its
    /// blocks, engines, publisher states and parked gap fills; with a shared log, every replica
    /// is told. Returns the memberships removed.
    pub async fn clear_pod(&self, model: Arc<str>, pod: Arc<str>) -> Result<usize, ClearError> {
        let dispatch = self.dispatch.upgrade().ok_or(ClearError::Stopped)?;
        let (reply, answer) = oneshot::channel();
        let job = Job::ClearPod {
            model,
            pod: pod.clone(),
            origin: ClearOrigin::Admin(reply),
        };
        if dispatch.push(&pod, job).closed {
            return Err(ClearError::Stopped);
        }
        drop(dispatch);
        answer.await.map_err(|_| ClearError::Stopped)
    }

    /// Every pod known, with its presence and when it last spoke.
    pub fn presence(
        &self,
    ) -> std::collections::HashMap<Arc<str>, (lifecycle::Presence, std::time::Instant)> {
        let mut out = std::collections::HashMap::new();
        self.publishers
            .each_presence(&self.lifecycle, &self.links, |pod, presence, last, _| {
                out.insert(pod.clone(), (presence, last));
            });
        out
    }
}

/// The worker (and publisher shard) a pod's messages go to.
pub(crate) fn worker_of(pod: &str, workers: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pod.hash(&mut h);
    (h.finish() as usize) % workers.max(1)
}

/// Where a publisher's gap-fill (vLLM "replay") socket is.
#[derive(Debug, Clone)]
enum GapFillRoute {
    /// Bind mode: from the template and the pod's address (+ DP rank).
    Template(Arc<str>),
    /// Connect mode: configured for this endpoint.
    Fixed(Arc<str>),
    /// No gap fill.
    None,
}

impl GapFillRoute {
    fn endpoint(&self, pod: &str, rank: u32) -> Option<String> {
        match self {
            GapFillRoute::Template(t) => topic::gap_fill_endpoint(t, pod, rank),
            GapFillRoute::Fixed(e) => Some(e.to_string()),
            GapFillRoute::None => None,
        }
    }
}

/// How a message reached this replica.
#[derive(Debug, Clone)]
enum Via {
    /// Its own socket; a gap may be filled through the route; the link (when known) tells
    /// when the pod left.
    Socket(GapFillRoute, Option<lifecycle::Link>),
    /// The shared log, appended by the named replica.
    Log(Arc<str>),
}

/// Who asked to clear a pod.
enum ClearOrigin {
    /// Another replica, through the shared log (not appended again).
    Log,
    /// An admin request on this replica: appended to the shared log, answered with the
    /// memberships removed.
    Admin(oneshot::Sender<usize>),
}

/// One message for a worker.
struct Message {
    pod: Arc<str>,
    model: Arc<str>,
    seq: u64,
    payload: Bytes,
    via: Via,
}

/// What a worker is asked to do.
enum Job {
    /// Sequence and apply a message.
    Message(Message),
    /// Forget a pod of a model: its blocks, engines, publishers and parked gap fills (an
    /// admin clear, or another replica's forgetting replayed from the log).
    ClearPod {
        /// The model.
        model: Arc<str>,
        /// The pod.
        pod: Arc<str>,
        /// Who asked.
        origin: ClearOrigin,
    },
    /// Forget a pod (every model) if it is still gone or idle (the sweeper's proposal).
    Forget {
        /// The pod.
        pod: Arc<str>,
        /// Why it was proposed.
        reason: lifecycle::ForgetReason,
    },
    /// Stop until the gate opens (a consistent snapshot of index and publishers).
    Pause(feeder::PauseGate),
    /// Socket messages of the pod dropped from its lane (it passed its share of the queue):
    /// resynchronise its publisher.
    Dropped(inbox::Dropped),
}

/// Shared by receivers and workers.
struct Shared {
    indexer: Arc<Indexer>,
    metrics: Arc<Metrics>,
    publishers: Arc<Publishers>,
    filter: String,
    /// `allowedModels` (empty: any).
    allowed_models: Vec<String>,
    /// `allowedPods` patterns (empty: any).
    allowed_pods: Vec<String>,
    gap_fill_timeout: Duration,
    /// Permits for gap fills in flight (`maxGapFillsInFlight`), across all workers.
    gap_fill_slots: Arc<tokio::sync::Semaphore>,
    frame_warn: WarnThrottle,
    decode_warn: WarnThrottle,
    gap_fill_warn: WarnThrottle,
    shed_warn: WarnThrottle,
    /// The budget of the warning lines that name a publisher.
    warn_budget: WarnBudget,
    /// The links (connections, sockets) that tell whether a pod is there.
    links: Arc<lifecycle::Links>,
    /// Grace period and idle timeout.
    lifecycle: lifecycle::LifecycleSettings,
    /// Where messages from this replica's sockets are appended (replication on).
    log: Option<LogHandle>,
    /// This replica's id (`received_by` of what its sockets bring).
    replica: Arc<str>,
    /// The shared log is not being followed at its end (Redis down, the follower behind):
    /// pods heard only through it are not silent, the log is (see [`Shared::verdict`]).
    log_stalled: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Why a pod is to be forgotten now, if it is. A pod this replica hears only through the
    /// shared log (no link of its own) is never judged idle while the log is stalled: its
    /// silence is the log's, and forgetting it would clear it on the replica that hears it
    /// live (an outage of Redis longer than `publisherIdleTimeout` did exactly that).
    fn verdict(
        &self,
        presence: lifecycle::Presence,
        last_message: std::time::Instant,
        linked: bool,
    ) -> Option<lifecycle::ForgetReason> {
        let reason = self.lifecycle.verdict(presence, last_message)?;
        let stalled = self.log_stalled.load(std::sync::atomic::Ordering::Relaxed);
        (linked || !stalled || reason != lifecycle::ForgetReason::Idle).then_some(reason)
    }
}

/// What receivers hold: the shared state and the workers' queues. Workers do not hold it, so
/// when the receivers and the handle let go, the queues close and the workers drain and exit.
struct Dispatch {
    shared: Arc<Shared>,
    workers: Vec<Arc<inbox::Inbox>>,
    budget: Arc<inbox::Budget>,
}

impl Dispatch {
    /// Queues `job` on `pod`'s worker without waiting (a socket message may make room by
    /// dropping others of a pod past its share: counted and logged here).
    fn push(&self, pod: &Arc<str>, job: Job) -> inbox::Pushed {
        let worker = worker_of(pod, self.workers.len());
        let metrics = &self.shared.metrics.ingest;
        metrics.queued();
        let pushed = self.workers[worker].push(pod, job);
        let dropped = pushed.over_share + pushed.over_total;
        if pushed.closed {
            metrics.dequeued();
        } else if dropped > 0 {
            metrics.dequeued_n(dropped);
            metrics.shed_n("over_share", pushed.over_share);
            metrics.shed_n("over_total", pushed.over_total);
            if let Some(suppressed) = self.shared.shed_warn.allow() {
                tracing::warn!(%pod, worker, over_share = pushed.over_share, over_total = pushed.over_total, queued_bytes = self.budget.used(), suppressed, "event queue past its byte bounds (kvEventsConfig.queueBytesPerPod, queueBytes): queued messages of the pod holding the most were dropped; its publisher is resynchronised");
            }
        }
        metrics.queue_bytes(self.budget.used());
        pushed
    }
}

impl Drop for Dispatch {
    /// The receivers and the handle let go: the workers take what is queued, then stop.
    fn drop(&mut self) {
        for inbox in &self.workers {
            inbox.close();
        }
    }
}

/// The running pipeline.
pub struct IngestHandle {
    /// The endpoint the bind-mode socket is bound to (resolved port), if any.
    pub bound_endpoint: Option<String>,
    /// Publisher states (for the admin API).
    pub publishers: Arc<Publishers>,
    /// Publishers with their presence (for the admin API).
    pub pods: Pods,
    receivers: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
    dispatch: Option<Arc<Dispatch>>,
}

impl IngestHandle {
    /// The replication follower's way in (a log entry goes to its pod's worker).
    pub fn feeder(&self) -> Option<Feeder> {
        self.dispatch.as_ref().map(|dispatch| Feeder {
            dispatch: dispatch.clone(),
        })
    }

    /// A task that feeds the workers (the replication follower): joined with the receivers,
    /// before the queues close.
    pub fn attach(&mut self, task: JoinHandle<()>) {
        self.receivers.push(task);
    }

    /// Stops intake, then lets the workers finish what is queued. Call after signalling
    /// `shutdown`.
    pub async fn join(mut self) {
        for r in self.receivers.drain(..) {
            let _ = r.await;
        }
        // The receivers are gone; dropping the last senders lets workers drain and exit.
        self.dispatch = None;
        for w in self.workers.drain(..) {
            let _ = w.await;
        }
    }
}

/// What ingestion starts from, beside its config.
pub struct IngestSetup {
    /// The index.
    pub indexer: Arc<Indexer>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Publisher states restored from a snapshot (empty on a cold start).
    pub publishers: Vec<(PublisherKey, PublisherState)>,
    /// The shared log, when replication is on.
    pub log: Option<LogHandle>,
    /// This replica's id.
    pub replica: Arc<str>,
}

/// Starts the workers and the receivers (bind and/or connect mode).
pub async fn start(
    config: &KvEventsConfig,
    setup: IngestSetup,
    shutdown: watch::Receiver<bool>,
) -> Result<IngestHandle, IngestError> {
    let IngestSetup {
        indexer,
        metrics,
        publishers: restored,
        log,
        replica,
    } = setup;
    let n = config.concurrency.max(1);
    let publishers = Arc::new(Publishers::new(n));
    publishers.restore(restored);
    let budget = inbox::Budget::new(config.queue_bytes, config.queue_bytes_per_pod);
    let inboxes: Vec<Arc<inbox::Inbox>> = (0..n)
        .map(|_| Arc::new(inbox::Inbox::new(budget.clone())))
        .collect();
    let links = Arc::new(lifecycle::Links::default());
    let lifecycle = lifecycle::LifecycleSettings {
        grace_period: config.publisher_grace_period.0,
        idle_timeout: Some(config.publisher_idle_timeout.0).filter(|t| !t.is_zero()),
    };
    let shared = Arc::new(Shared {
        indexer,
        metrics,
        publishers: publishers.clone(),
        filter: config.topic_filter.clone(),
        allowed_models: config.allowed_models.clone(),
        allowed_pods: config.allowed_pods.clone(),
        gap_fill_timeout: Duration::from_millis(config.replay_timeout_ms),
        gap_fill_slots: Arc::new(tokio::sync::Semaphore::new(
            config.max_gap_fills_in_flight.max(1),
        )),
        frame_warn: WarnThrottle::default(),
        decode_warn: WarnThrottle::default(),
        gap_fill_warn: WarnThrottle::default(),
        shed_warn: WarnThrottle::default(),
        warn_budget: WarnBudget::default(),
        links: links.clone(),
        lifecycle,
        log_stalled: std::sync::atomic::AtomicBool::new(log.is_some()),
        log,
        replica,
    });
    let dispatch = Arc::new(Dispatch {
        shared: shared.clone(),
        workers: inboxes.clone(),
        budget,
    });
    let workers = inboxes
        .into_iter()
        .enumerate()
        .map(|(i, inbox)| tokio::spawn(workers::run(i, inbox, shared.clone())))
        .collect();

    let mut receivers = Vec::new();
    let mut bound_endpoint = None;
    if !config.zmq_endpoint.is_empty() {
        let endpoint = topic::bindable(&config.zmq_endpoint);
        let mut socket = SubSocket::new();
        receivers.push(tokio::spawn(lifecycle::follow_bind_monitor(
            socket.monitor(),
            links.clone(),
            shutdown.clone(),
        )));
        let bound = socket
            .bind(&endpoint)
            .await
            .map_err(|source| IngestError::Bind {
                endpoint: endpoint.clone(),
                source,
            })?;
        socket
            .subscribe(&config.topic_filter)
            .await
            .map_err(|source| IngestError::Subscribe {
                endpoint: endpoint.clone(),
                source,
            })?;
        tracing::info!(endpoint = %bound, filter = %config.topic_filter, "bind mode: SUB socket bound; vLLM pods connect here");
        bound_endpoint = Some(bound.to_string());
        let gap_fill = if config.replay_endpoint_template.is_empty() {
            GapFillRoute::None
        } else {
            GapFillRoute::Template(config.replay_endpoint_template.as_str().into())
        };
        let source = sockets::Source {
            pod: "".into(),
            model: "".into(),
            gap_fill,
            label: bound.to_string().into(),
            link: None,
        };
        receivers.push(tokio::spawn(sockets::receive(
            socket,
            source,
            None,
            dispatch.clone(),
            shutdown.clone(),
        )));
    }
    for ep in &config.endpoints {
        receivers.push(tokio::spawn(sockets::connect_and_receive(
            ep.clone(),
            lifecycle::Link::Endpoint(ep.endpoint.as_str().into()),
            config.topic_filter.clone(),
            dispatch.clone(),
            shutdown.clone(),
        )));
    }
    if !config.discovery.services.is_empty() {
        let resolver = Arc::new(discovery::Resolver::new(&config.discovery)?);
        for service in &config.discovery.services {
            tracing::info!(service = %service.name, interval = %config.discovery.refresh_interval, ranks = service.data_parallel_size, "connect mode: discovering pods by DNS");
            receivers.push(tokio::spawn(discovery::follow(
                service.clone(),
                resolver.clone(),
                config.discovery.refresh_interval.0,
                config.topic_filter.clone(),
                dispatch.clone(),
                shutdown.clone(),
            )));
        }
    }
    receivers.push(tokio::spawn(lifecycle::sweep(
        dispatch.clone(),
        lifecycle,
        shutdown.clone(),
    )));
    Ok(IngestHandle {
        bound_endpoint,
        pods: Pods {
            publishers: publishers.clone(),
            links,
            lifecycle,
            dispatch: Arc::downgrade(&dispatch),
        },
        publishers,
        receivers,
        workers,
        dispatch: Some(dispatch),
    })
}
