//! Event ingestion: ZMQ SUB sockets receive vLLM's `[topic, seq, payload]` messages, workers
//! decode them and apply them to the [`Indexer`], keeping every publisher's stream in order and
//! complete where vLLM's replay buffer allows.
//!
//! - **Bind mode**: one SUB socket binds `zmqEndpoint`; vLLM pods connect to it.
//! - **Connect mode**: one SUB socket per listed pod endpoint (vLLM binds); each retries its
//!   connection in the background, so a pod that is down never blocks the daemon.
//!
//! Invariants:
//! - a message with a bad frame count, a short sequence or an unparsable topic is dropped,
//!   counted (`kvindexer_frame_errors_total{reason}`) and logged at most once per 10 s per
//!   reason; nothing a publisher sends can stop a receiver or a worker;
//! - all messages of one pod go to the same worker (pod hash), so its events apply in order;
//!   different pods apply in parallel;
//! - per publisher (pod, model, DP rank): a sequence jump is a gap, filled once by a replay
//!   request to the publisher's ROUTER (never retried: no replay loops), and what replay cannot
//!   supply is counted as lost; a sequence that goes backwards is a restarted vLLM, whose cache
//!   is gone, so its blocks are cleared first; a repeated sequence is a duplicate and dropped.
//!   The first message from a publisher that does not start at 0 (the daemon started late, or
//!   ZeroMQ's slow joiner dropped the first messages) triggers a replay from 0 when possible.

pub mod replay;
pub mod topic;

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

use crate::config::{ConnectEndpoint, KvEventsConfig};
use crate::events::{decode_batch, EventBatch};
use crate::indexer::Indexer;
use crate::metrics::Metrics;

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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublisherState {
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Messages applied.
    pub messages: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Restarts seen.
    pub restarts: u64,
}

/// Publisher states, one map per worker (a pod always maps to the same worker, so each map has
/// one writer; the admin API reads them).
#[derive(Default)]
pub struct Publishers {
    shards: Vec<Mutex<HashMap<PublisherKey, PublisherState>>>,
}

impl Publishers {
    fn new(n: usize) -> Self {
        Self {
            shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    /// Every publisher seen, sorted.
    pub fn snapshot(&self) -> Vec<(PublisherKey, PublisherState)> {
        let mut all: Vec<_> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.lock()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Forgets a pod's publishers (after an admin clear), so its next message starts afresh.
    pub fn forget_pod(&self, model: &str, pod: &str) {
        for shard in &self.shards {
            shard
                .lock()
                .retain(|k, _| !(&*k.pod == pod && &*k.model == model));
        }
    }
}

/// At most one log line per reason every 10 s, reporting how many were suppressed.
#[derive(Default)]
pub struct LogLimiter {
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimiter {
    /// `Some(suppressed since the last line)` when a line may be logged now.
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last.load(Ordering::Relaxed);
        if now >= last + 10
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Where a pod's replay ROUTER is.
#[derive(Debug, Clone)]
enum ReplayRoute {
    /// Bind mode: from the template and the pod's address (+ DP rank).
    Template(Arc<str>),
    /// Connect mode: configured for this endpoint.
    Fixed(Arc<str>),
    /// No replay.
    None,
}

impl ReplayRoute {
    fn endpoint(&self, pod: &str, rank: u32) -> Option<String> {
        match self {
            ReplayRoute::Template(t) => topic::replay_endpoint(t, pod, rank),
            ReplayRoute::Fixed(e) => Some(e.to_string()),
            ReplayRoute::None => None,
        }
    }
}

/// One received message, routed to a worker.
struct Job {
    pod: Arc<str>,
    model: Arc<str>,
    seq: u64,
    payload: Bytes,
    replay: ReplayRoute,
}

/// How a receiver names the messages it gets.
#[derive(Clone)]
struct Source {
    /// Pod and model from configuration (connect mode); empty = from the topic.
    pod: Arc<str>,
    model: Arc<str>,
    replay: ReplayRoute,
    label: Arc<str>,
}

/// Shared by receivers and workers.
struct Shared {
    indexer: Arc<Indexer>,
    metrics: Arc<Metrics>,
    publishers: Arc<Publishers>,
    filter: String,
    replay_timeout: Duration,
    frame_log: LogLimiter,
    decode_log: LogLimiter,
    replay_log: LogLimiter,
}

/// What receivers hold: the shared state and the workers' queues. Workers do not hold it, so
/// when the receivers and the handle let go, the queues close and the workers drain and exit.
struct Router {
    shared: Arc<Shared>,
    workers: Vec<mpsc::Sender<Job>>,
}

/// The running pipeline.
pub struct IngestHandle {
    /// The endpoint the bind-mode socket is bound to (resolved port), if any.
    pub bound_endpoint: Option<String>,
    /// Publisher states (for the admin API).
    pub publishers: Arc<Publishers>,
    receivers: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
    router: Option<Arc<Router>>,
}

impl IngestHandle {
    /// Stops intake, then lets the workers finish what is queued. Call after signalling
    /// `shutdown`.
    pub async fn join(mut self) {
        for r in self.receivers.drain(..) {
            let _ = r.await;
        }
        // The receivers are gone; dropping the last senders lets workers drain and exit.
        self.router = None;
        for w in self.workers.drain(..) {
            let _ = w.await;
        }
    }
}

/// Starts the workers and the receivers (bind and/or connect mode).
pub async fn start(
    config: &KvEventsConfig,
    indexer: Arc<Indexer>,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
) -> Result<IngestHandle, IngestError> {
    let n = config.concurrency.max(1);
    let publishers = Arc::new(Publishers::new(n));
    let mut senders = Vec::with_capacity(n);
    let mut receivers_of_workers = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = mpsc::channel::<Job>(config.queue_depth.max(1));
        senders.push(tx);
        receivers_of_workers.push(rx);
    }
    let shared = Arc::new(Shared {
        indexer,
        metrics,
        publishers: publishers.clone(),
        filter: config.topic_filter.clone(),
        replay_timeout: Duration::from_millis(config.replay_timeout_ms),
        frame_log: LogLimiter::default(),
        decode_log: LogLimiter::default(),
        replay_log: LogLimiter::default(),
    });
    let router = Arc::new(Router {
        shared: shared.clone(),
        workers: senders,
    });
    let workers = receivers_of_workers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| tokio::spawn(worker(i, rx, shared.clone())))
        .collect();

    let mut receivers = Vec::new();
    let mut bound_endpoint = None;
    if !config.zmq_endpoint.is_empty() {
        let endpoint = topic::bindable(&config.zmq_endpoint);
        let mut socket = SubSocket::new();
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
        let replay = if config.replay_endpoint_template.is_empty() {
            ReplayRoute::None
        } else {
            ReplayRoute::Template(config.replay_endpoint_template.as_str().into())
        };
        let source = Source {
            pod: "".into(),
            model: "".into(),
            replay,
            label: bound.to_string().into(),
        };
        receivers.push(tokio::spawn(receive(
            socket,
            source,
            router.clone(),
            shutdown.clone(),
        )));
    }
    for ep in &config.endpoints {
        receivers.push(tokio::spawn(connect_and_receive(
            ep.clone(),
            config.topic_filter.clone(),
            router.clone(),
            shutdown.clone(),
        )));
    }
    Ok(IngestHandle {
        bound_endpoint,
        publishers,
        receivers,
        workers,
        router: Some(router),
    })
}

/// Connect mode: dials the pod until it answers (with backoff), then receives.
async fn connect_and_receive(
    ep: ConnectEndpoint,
    filter: String,
    router: Arc<Router>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Duration::from_millis(200);
    let socket = loop {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(Duration::from_secs(5));
        let mut socket = SubSocket::with_options(options);
        let attempt = async {
            socket.connect(&ep.endpoint).await?;
            socket.subscribe(&filter).await?;
            Ok::<_, zeromq::ZmqError>(())
        };
        tokio::select! {
            _ = shutdown.changed() => return,
            result = attempt => match result {
                Ok(()) => break socket,
                Err(e) => {
                    tracing::warn!(endpoint = %ep.endpoint, error = %e, retry_in = ?backoff, "connect mode: cannot reach the pod's publisher yet");
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    };
    tracing::info!(endpoint = %ep.endpoint, pod = %ep.pod, "connect mode: subscribed");
    let replay = if ep.replay_endpoint.is_empty() {
        ReplayRoute::None
    } else {
        ReplayRoute::Fixed(ep.replay_endpoint.as_str().into())
    };
    let source = Source {
        pod: ep.pod.as_str().into(),
        model: ep.model.as_str().into(),
        replay,
        label: ep.endpoint.as_str().into(),
    };
    receive(socket, source, router, shutdown).await;
}

/// Receives until shutdown, routing every well-formed message to its pod's worker.
async fn receive(
    mut socket: SubSocket,
    source: Source,
    router: Arc<Router>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            message = socket.recv() => match message {
                Ok(message) => route(message, &source, &router).await,
                Err(e) => {
                    frame_error(&router.shared, "recv_error", &format!("receive on {}: {e}", source.label));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    tracing::info!(source = %source.label, "receiver stopped");
}

fn frame_error(shared: &Shared, reason: &'static str, detail: &str) {
    shared
        .metrics
        .frame_errors
        .with_label_values(&[reason])
        .inc();
    if let Some(suppressed) = shared.frame_log.allow() {
        tracing::warn!(reason, suppressed, "dropped a ZMQ message: {detail}");
    }
}

async fn route(message: ZmqMessage, source: &Source, router: &Router) {
    let shared = &router.shared;
    let frames = message.into_vec();
    let [topic, seq, payload] = frames.as_slice() else {
        frame_error(
            shared,
            "bad_frame_count",
            &format!("{} frames (expected [topic, seq, payload])", frames.len()),
        );
        return;
    };
    let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
        frame_error(
            shared,
            "short_seq",
            &format!("a {}-byte sequence frame (expected 8)", seq.len()),
        );
        return;
    };
    let seq = u64::from_be_bytes(seq);
    let (pod, model): (Arc<str>, Arc<str>) = if !source.pod.is_empty() && !source.model.is_empty() {
        (source.pod.clone(), source.model.clone())
    } else {
        match topic::parse_topic(topic, &shared.filter) {
            Ok((pod, model)) => (
                if source.pod.is_empty() {
                    pod.into()
                } else {
                    source.pod.clone()
                },
                if source.model.is_empty() {
                    model.into()
                } else {
                    source.model.clone()
                },
            ),
            Err(e) => {
                frame_error(shared, "bad_topic", &e.to_string());
                return;
            }
        }
    };
    shared
        .metrics
        .messages_received
        .with_label_values(&[&shared.metrics.pod_label(&pod)])
        .inc();
    let mut h = DefaultHasher::new();
    pod.hash(&mut h);
    let worker = (h.finish() as usize) % router.workers.len();
    shared.metrics.event_queue_depth.inc();
    let job = Job {
        pod,
        model,
        seq,
        payload: payload.clone(),
        replay: source.replay.clone(),
    };
    if router.workers[worker].send(job).await.is_err() {
        shared.metrics.event_queue_depth.dec();
    }
}

async fn worker(index: usize, mut rx: mpsc::Receiver<Job>, shared: Arc<Shared>) {
    while let Some(job) = rx.recv().await {
        shared.metrics.event_queue_depth.dec();
        handle(index, job, &shared).await;
    }
}

async fn handle(worker: usize, job: Job, shared: &Shared) {
    let metrics = &shared.metrics;
    let pod_label = metrics.pod_label(&job.pod);
    let batch = match decode_batch(&job.payload) {
        Ok(b) => b,
        Err(e) => {
            metrics.decode_errors.with_label_values(&[e.reason()]).inc();
            if let Some(suppressed) = shared.decode_log.allow() {
                tracing::warn!(pod = %job.pod, model = %job.model, seq = job.seq, error = %e, suppressed, "undecodable KV event payload dropped");
            }
            return;
        }
    };
    let rank = batch
        .data_parallel_rank
        .and_then(|r| u32::try_from(r).ok())
        .unwrap_or(0);
    let key = PublisherKey {
        pod: job.pod.clone(),
        model: job.model.clone(),
        rank,
    };
    let last = shared.publishers.shards[worker]
        .lock()
        .get(&key)
        .and_then(|s| s.last_seq);
    let mut restarted = false;
    let mut gap = false;
    match last {
        None => {
            if job.seq > 0 {
                // Joined late (daemon start, slow joiner): fetch what the buffer still has.
                catch_up(shared, &job, rank, 0, job.seq, false).await;
            }
        }
        Some(last) if job.seq == last.wrapping_add(1) => {}
        Some(last) if job.seq == last => {
            metrics
                .events_skipped
                .with_label_values(&["duplicate"])
                .inc();
            return;
        }
        Some(last) if job.seq < last => {
            restarted = true;
            metrics.pod_restarts.with_label_values(&[&pod_label]).inc();
            let removed = shared.indexer.clear_engine(&job.model, &job.pod, rank);
            tracing::warn!(pod = %job.pod, model = %job.model, rank, last_seq = last, seq = job.seq, removed, "publisher restarted (sequence went backwards): its blocks were cleared");
            if job.seq > 0 {
                catch_up(shared, &job, rank, 0, job.seq, false).await;
            }
        }
        Some(last) => {
            gap = true;
            metrics.sequence_gaps.with_label_values(&[&pod_label]).inc();
            catch_up(shared, &job, rank, last + 1, job.seq, true).await;
        }
    }
    apply(shared, &job.model, &job.pod, &batch);
    let mut shard = shared.publishers.shards[worker].lock();
    let state = shard.entry(key).or_default();
    state.last_seq = Some(job.seq);
    state.messages += 1;
    state.gaps += u64::from(gap);
    state.restarts += u64::from(restarted);
}

/// Replays `[from, to)` from the publisher's ROUTER and applies it; what cannot be had is
/// counted as lost when `count_lost` (a gap; not when joining late).
async fn catch_up(shared: &Shared, job: &Job, rank: u32, from: u64, to: u64, count_lost: bool) {
    let metrics = &shared.metrics;
    let wanted = to - from;
    let lost = |n: u64| {
        if count_lost && n > 0 {
            metrics
                .messages_lost
                .with_label_values(&[&metrics.pod_label(&job.pod)])
                .inc_by(n);
        }
    };
    let Some(endpoint) = job.replay.endpoint(&job.pod, rank) else {
        metrics.replays.with_label_values(&["unavailable"]).inc();
        lost(wanted);
        return;
    };
    let started = Instant::now();
    match replay::fetch(&endpoint, from, shared.replay_timeout).await {
        Ok(batches) => {
            metrics.replays.with_label_values(&["ok"]).inc();
            let mut applied = 0u64;
            for (seq, payload) in batches {
                if seq < from || seq >= to {
                    continue;
                }
                match decode_batch(&payload) {
                    Ok(batch) => {
                        apply(shared, &job.model, &job.pod, &batch);
                        applied += 1;
                    }
                    Err(e) => {
                        metrics.decode_errors.with_label_values(&[e.reason()]).inc();
                    }
                }
            }
            tracing::info!(pod = %job.pod, model = %job.model, rank, from, to, applied, elapsed = ?started.elapsed(), "replayed missed KV events");
            lost(wanted.saturating_sub(applied));
        }
        Err(e) => {
            metrics.replays.with_label_values(&[e.label()]).inc();
            if let Some(suppressed) = shared.replay_log.allow() {
                tracing::warn!(pod = %job.pod, endpoint = %endpoint, error = %e, suppressed, "replay failed; the missed events are lost");
            }
            lost(wanted);
        }
    }
}

fn apply(shared: &Shared, model: &str, pod: &str, batch: &EventBatch) {
    let metrics = &shared.metrics;
    let report = match shared.indexer.apply_batch(model, pod, batch) {
        Ok(r) => r,
        Err(e) => {
            metrics
                .events_skipped
                .with_label_values(&["bad_model_settings"])
                .inc();
            tracing::error!(model, error = %e, "cannot index events for this model");
            return;
        }
    };
    let pod_label = metrics.pod_label(pod);
    for (ty, n) in [
        ("BlockStored", report.stored_events),
        ("BlockRemoved", report.removed_events),
        ("AllBlocksCleared", report.cleared_events),
        ("unknown", report.unknown_events),
    ] {
        if n > 0 {
            metrics
                .events_received
                .with_label_values(&[&pod_label, ty])
                .inc_by(n as u64);
        }
    }
    if report.skipped_group_events > 0 {
        metrics
            .events_skipped
            .with_label_values(&["non_prefix_cacheable_group"])
            .inc_by(report.skipped_group_events as u64);
    }
    if report.unknown_events > 0 {
        metrics
            .events_skipped
            .with_label_values(&["unknown_type"])
            .inc_by(report.unknown_events as u64);
    }
    if report.engine_rejected {
        metrics
            .events_skipped
            .with_label_values(&["too_many_engines"])
            .inc();
    }
    metrics
        .blocks_applied
        .with_label_values(&["stored"])
        .inc_by(report.blocks_stored);
    metrics
        .blocks_applied
        .with_label_values(&["removed"])
        .inc_by(report.blocks_removed);
    metrics.index_admissions.inc_by(report.blocks_stored);
    metrics.index_evictions.inc_by(report.blocks_removed);
    if report.hash_matches + report.hash_mismatches > 0 {
        let model_label = metrics.model_label(model);
        metrics
            .hash_checks
            .with_label_values(&[&pod_label, &model_label, "match"])
            .inc_by(report.hash_matches as u64);
        metrics
            .hash_checks
            .with_label_values(&[&pod_label, &model_label, "mismatch"])
            .inc_by(report.hash_mismatches as u64);
    }
}
