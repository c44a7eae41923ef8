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
//!   [`publishers`]: every publisher's stream state, by pod; [`pods`]: the admin API's view
//!   of the pods and the sweeper that proposes to forget them;
//! - [`jobs`]: what a worker is asked to do (a message, a clear, a pause, a resync);
//!   [`dispatch`]: the state receivers and workers share, and each job's way to its pod's
//!   worker;
//! - [`shared_log`]: the port to a shared event log (replication implements it; ingestion
//!   never imports replication); [`feeder`]: the log's way back in (entries to the workers,
//!   pauses for snapshots, whether the log flows).
//!
//! This file only wires them: [`start`] builds the shared state, the workers and the
//! receivers.
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
//! - a pod is forgotten in one place, its worker ([`jobs::Job::ClearPod`], [`jobs::Job::Forget`]), in
//!   order with its messages: an admin clear ([`Pods::clear_pod`]) drops the pod's parked gap
//!   fills with its blocks, so nothing fetched before the clear can bring them back.

pub mod discovery;
mod dispatch;
mod feeder;
pub mod gap_fill;
mod inbox;
mod jobs;
pub mod lifecycle;
mod pods;
mod publishers;
pub mod runtime;
pub mod sequence;
pub mod shared_log;
mod sockets;
pub mod topic;
mod workers;

pub use discovery::Discovered;
pub use feeder::Feeder;
pub use pods::Pods;
pub use publishers::{PublisherKey, PublisherState, Publishers};
pub use shared_log::{LogEntry, LogHandle, SharedLog, Stamp};

use std::sync::Arc;
use std::time::Duration;

use kv_core::Indexer;
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{Socket, SubSocket};

use crate::config::KvEventsConfig;
use crate::metrics::Metrics;
use crate::warn_budget::{WarnBudget, WarnThrottle};
use dispatch::{Dispatch, Shared};
use jobs::GapFillRoute;

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
    /// The ingest runtime's threads could not be started.
    #[error("starting the ingest threads: {0}")]
    Runtime(std::io::Error),
}

/// The running pipeline.
pub struct IngestHandle {
    /// The endpoint the bind-mode socket is bound to (resolved port), if any.
    pub bound_endpoint: Option<String>,
    /// Publisher states (for the admin API).
    pub publishers: Arc<Publishers>,
    /// Publishers with their presence (for the admin API).
    pub pods: Pods,
    /// What DNS discovery answers (connect mode by DNS only).
    pub discovered: Option<watch::Receiver<Discovered>>,
    receivers: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
    dispatch: Option<Arc<Dispatch>>,
    /// Where all of the above run; dropped last (after `join`, nothing is left on it).
    runtime: Option<runtime::IngestRuntime>,
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
        drop(self.runtime.take());
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

/// Starts the workers and the receivers (bind and/or connect mode) on the ingest runtime
/// ([`runtime`]: threads of their own, at `ingestNice` below the serving threads).
pub async fn start(
    config: &KvEventsConfig,
    setup: IngestSetup,
    shutdown: watch::Receiver<bool>,
) -> Result<IngestHandle, IngestError> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt =
        runtime::IngestRuntime::new(threads.min(config.concurrency.max(1)), config.ingest_nice)
            .map_err(IngestError::Runtime)?;
    // Started from a task on the ingest runtime, so that everything it spawns (sockets'
    // connection tasks included) runs there.
    let config = config.clone();
    let started = rt
        .handle()
        .spawn(async move { start_here(&config, setup, shutdown).await })
        .await;
    let mut handle = match started {
        Ok(result) => result?,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => unreachable!("the ingest runtime is not shut down while starting: {e}"),
    };
    handle.runtime = Some(rt);
    Ok(handle)
}

async fn start_here(
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
    let mut discovered = None;
    if !config.discovery.services.is_empty() {
        let resolver = Arc::new(discovery::Resolver::new(&config.discovery)?);
        let (sender, receiver) = watch::channel(Discovered {
            services: config.discovery.services.len(),
            ..Default::default()
        });
        let sender = Arc::new(sender);
        discovered = Some(receiver);
        for service in &config.discovery.services {
            tracing::info!(service = %service.name, interval = %config.discovery.refresh_interval, ranks = service.data_parallel_size, "connect mode: discovering pods by DNS");
            receivers.push(tokio::spawn(discovery::follow(
                service.clone(),
                resolver.clone(),
                (
                    config.discovery.refresh_interval.0,
                    config.topic_filter.clone(),
                ),
                dispatch.clone(),
                sender.clone(),
                shutdown.clone(),
            )));
        }
    }
    receivers.push(tokio::spawn(pods::sweep(
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
        discovered,
        receivers,
        workers,
        dispatch: Some(dispatch),
        runtime: None,
    })
}
