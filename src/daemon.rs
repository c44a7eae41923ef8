//! The daemon: wires configuration, the indexer, event ingestion and the servers together, and
//! shuts them down in order.
//!
//! Start-up: validate the config, build the indexer, (with replication) load the newest
//! snapshot, bind the ZMQ socket (or start dialling in connect mode), bind gRPC and HTTP, then
//! report ready: at once without replication, once the log is read to its end with it. Shutdown (SIGTERM/SIGINT, or
//! [`RunningDaemon::shutdown`]): not ready, stop intake, let workers apply what is queued, let
//! gRPC finish in-flight calls (bounded by `server.shutdownGraceMs`), stop.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::ingest::{self, IngestError, IngestHandle, IngestSetup, LogHandle, Publishers};
use crate::metrics::Metrics;
use crate::replication::{Replication, ReplicationError};
use crate::scoring::Scoring;
use crate::server::grpc::KvIndexerApi;
use crate::server::http;
use crate::server::llmd::LlmdIndexerApi;
use kv_core::{Indexer, SettingsError};
use kv_proto::{
    indexer_v1::indexer_service_server::IndexerServiceServer,
    kvindexer_v1::kv_indexer_server::KvIndexerServer, FILE_DESCRIPTOR_SET,
};

/// Why the daemon could not start.
#[derive(Debug, Error)]
pub enum DaemonError {
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Invalid index or hashing settings.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// ZMQ set-up failed.
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// Replication is misconfigured.
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    /// A listen address could not be bound.
    #[error("binding {what} on {addr}: {source}")]
    Listen {
        /// Which server.
        what: &'static str,
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// Reflection descriptors are broken (a build problem).
    #[error("gRPC reflection: {0}")]
    Reflection(String),
    /// The endpoint picker's pool could not be set up (no Kubernetes client).
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// A TLS file could not be read, or the certificate and key do not make a server identity.
    #[error("gRPC TLS ({what}): {detail}")]
    Tls {
        /// Which file or step.
        what: String,
        /// Why.
        detail: String,
    },
}

/// A gRPC server builder, with TLS when `server.tls` is set (the daemon's gRPC and the
/// endpoint picker).
fn grpc_builder(tls: &crate::config::TlsConfig) -> Result<tonic::transport::Server, DaemonError> {
    let builder = tonic::transport::Server::builder();
    if !tls.enabled() {
        return Ok(builder);
    }
    builder
        .tls_config(tls_config("server.tls", tls)?)
        .map_err(|e| DaemonError::Tls {
            what: "server.tls".into(),
            detail: e.to_string(),
        })
}

/// The endpoint picker's server: TLS as `endpointPicker.tls` says.
fn picker_builder(config: &Config) -> Result<tonic::transport::Server, DaemonError> {
    use crate::config::{PickerTlsMode, TlsConfig};
    let tls = &config.endpoint_picker.tls;
    let tls_config = match tls.mode {
        PickerTlsMode::Inherit => return grpc_builder(&config.server.tls),
        PickerTlsMode::Plaintext => return Ok(tonic::transport::Server::builder()),
        PickerTlsMode::Files => tls_config(
            "endpointPicker.tls",
            &TlsConfig {
                cert_file: tls.cert_file.clone(),
                key_file: tls.key_file.clone(),
                client_ca_file: tls.client_ca_file.clone(),
            },
        )?,
        PickerTlsMode::SelfSigned => self_signed()?,
    };
    tonic::transport::Server::builder()
        .tls_config(tls_config)
        .map_err(|e| DaemonError::Tls {
            what: "endpointPicker.tls".into(),
            detail: e.to_string(),
        })
}

/// A certificate made now and signed by its own key (`endpointPicker.tls.mode: selfSigned`).
fn self_signed() -> Result<tonic::transport::ServerTlsConfig, DaemonError> {
    let names = vec!["localhost".to_owned(), "kv-indexer".to_owned()];
    let made = rcgen::generate_simple_self_signed(names).map_err(|e| DaemonError::Tls {
        what: "endpointPicker.tls (selfSigned)".into(),
        detail: e.to_string(),
    })?;
    let identity =
        tonic::transport::Identity::from_pem(made.cert.pem(), made.signing_key.serialize_pem());
    Ok(tonic::transport::ServerTlsConfig::new().identity(identity))
}

/// The rustls server configuration from the files of `section` (`server.tls`,
/// `endpointPicker.tls`), read at start.
fn tls_config(
    section: &str,
    tls: &crate::config::TlsConfig,
) -> Result<tonic::transport::ServerTlsConfig, DaemonError> {
    let read = |field: &str, path: &str| {
        std::fs::read(path).map_err(|e| DaemonError::Tls {
            what: format!("{section}.{field} {path}"),
            detail: e.to_string(),
        })
    };
    let identity = tonic::transport::Identity::from_pem(
        read("certFile", &tls.cert_file)?,
        read("keyFile", &tls.key_file)?,
    );
    let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
    if !tls.client_ca_file.is_empty() {
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(read(
            "clientCaFile",
            &tls.client_ca_file,
        )?));
    }
    Ok(config)
}

/// A started daemon.
pub struct RunningDaemon {
    /// The gRPC address actually bound.
    pub grpc_addr: SocketAddr,
    /// The HTTP address actually bound.
    pub metrics_addr: SocketAddr,
    /// The endpoint picker's address actually bound, when it is enabled.
    pub picker_addr: Option<SocketAddr>,
    /// The bind-mode ZMQ endpoint actually bound, if bind mode is on.
    pub zmq_endpoint: Option<String>,
    /// The index.
    pub indexer: Arc<Indexer>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// The endpoint picker's pool, when the picker is on.
    pub pool: Option<Arc<crate::pool::Pool>>,
    shutdown: watch::Sender<bool>,
    ready: Arc<AtomicBool>,
    ingest: IngestHandle,
    appender: Option<JoinHandle<()>>,
    picker: Option<crate::picker::RunningPicker>,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    http: JoinHandle<std::io::Result<()>>,
    grace: Duration,
}

async fn listen(what: &'static str, addr: &str) -> Result<TcpListener, DaemonError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| DaemonError::Listen {
            what,
            addr: addr.to_owned(),
            source,
        })
}

/// Starts everything `config` describes; returns once all sockets are bound.
pub async fn start(config: Config) -> Result<RunningDaemon, DaemonError> {
    config.validate()?;
    for w in config.warnings() {
        tracing::warn!(field = %w.field, "a setting that does nothing: {}", w.message);
    }
    let indexer = Arc::new(Indexer::new(config.indexer_settings())?);
    let index = &indexer.settings().index;
    tracing::info!(
        size = index.max_keys,
        writer_lanes = index.writer_lanes,
        "block index"
    );
    if let Some(bound) = indexer.settings().index.pod_cache_size {
        tracing::warn!(
            pod_cache_size = bound,
            "podCacheSize is set: a block records at most {bound} holders and drops the oldest \
             beyond, so a prefix held by more pods scores too few of them \
             (kvindexer_index_capacity_drops{{reason=\"pod_cache_size\"}}); remove it for exact \
             membership"
        );
    }
    let metrics = Metrics::new();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let ready = Arc::new(AtomicBool::new(false));

    let replication = if config.replication.enabled {
        Some(Replication::new(&config.replication, metrics.clone())?)
    } else {
        None
    };
    let (mut restored, log, appender) = match &replication {
        Some(r) => {
            tracing::info!(redis = %r.redacted_url(), replica = %r.replica(), "replication on: loading the newest snapshot");
            let restored = r.restore(&indexer).await;
            let (sink, task) = r.start_appender();
            let log: LogHandle = Arc::new(sink);
            (restored, Some(log), Some(task))
        }
        None => (Default::default(), None, None),
    };
    let replica = replication
        .as_ref()
        .map_or_else(|| "".into(), Replication::replica);
    let mut ingest = ingest::start(
        &config.kv_events_config,
        IngestSetup {
            indexer: indexer.clone(),
            metrics: metrics.clone(),
            publishers: std::mem::take(&mut restored.publishers),
            log: log.clone(),
            replica,
        },
        shutdown_rx.clone(),
    )
    .await?;
    if let (Some(r), Some(feeder)) = (&replication, ingest.feeder()) {
        ingest.attach(r.start_follower(feeder, &restored, ready.clone(), shutdown_rx.clone()));
    }
    ingest.attach(tokio::spawn(expire_speculation(
        indexer.clone(),
        shutdown_rx.clone(),
    )));
    if crate::heap::TRIM_NEEDED {
        ingest.attach(tokio::spawn(crate::heap::trim_periodically(
            shutdown_rx.clone(),
        )));
    }

    let tokenizers =
        kv_tokenize::TokenizerService::new(config.tokenizer_settings(), metrics.tokenizer.clone());
    let service = Scoring::new(
        indexer.clone(),
        tokenizers,
        metrics.clone(),
        ingest.pods.clone(),
        (config.server.clone(), "server.maxConcurrentRequests"),
        log.clone(),
    );
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<KvIndexerServer<KvIndexerApi>>()
        .await;
    health_reporter
        .set_serving::<IndexerServiceServer<LlmdIndexerApi>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Reflection(e.to_string()))?;

    let grpc_listener = listen("gRPC", &config.server.grpc_addr).await?;
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|source| DaemonError::Listen {
            what: "gRPC",
            addr: config.server.grpc_addr.clone(),
            source,
        })?;
    let mut grpc_shutdown = shutdown_rx.clone();
    let builder = grpc_builder(&config.server.tls)?;
    let (pool, pool_task) = match config.endpoint_picker.enabled {
        true => {
            let (pool, task) = crate::pool::start(
                &config.endpoint_picker,
                ingest.discovered.clone(),
                metrics.clone(),
                shutdown_rx.clone(),
            )
            .await?;
            (Some(pool), task)
        }
        false => (None, None),
    };
    let picker_setup = pool.clone().map(|pool| crate::picker::PickerSetup {
        indexer: indexer.clone(),
        tokenizers: service.tokenizers.clone(),
        metrics: metrics.clone(),
        pods: ingest.pods.clone(),
        log: log.clone(),
        ready: ready.clone(),
        pool,
        pool_task,
    });
    let grpc = tokio::spawn(
        builder
            // A 500-block prompt is ~25 KB of token ids: open windows wide enough that a
            // request never waits for a WINDOW_UPDATE round trip.
            .initial_stream_window_size(Some(1 << 20))
            .initial_connection_window_size(Some(4 << 20))
            .layer(tower::util::MapResponseLayer::new(
                crate::server::grpc::undecodable_is_invalid_argument,
            ))
            .add_service(health_service)
            .add_service(reflection)
            .add_service(
                KvIndexerServer::new(KvIndexerApi(service.clone(), pool.clone()))
                    .max_decoding_message_size(config.server.max_request_bytes()),
            )
            .add_service(
                IndexerServiceServer::new(LlmdIndexerApi(service))
                    .max_decoding_message_size(config.server.max_request_bytes()),
            )
            // TCP_NODELAY: a small response must not wait for a delayed ACK (40 ms on Linux).
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                async move {
                    let _ = grpc_shutdown.changed().await;
                },
            ),
    );

    let http_listener = listen("metrics", &config.server.metrics_addr).await?;
    let metrics_addr = http_listener
        .local_addr()
        .map_err(|source| DaemonError::Listen {
            what: "metrics",
            addr: config.server.metrics_addr.clone(),
            source,
        })?;
    let app = http::app(http::HttpState {
        indexer: indexer.clone(),
        metrics: metrics.clone(),
        ready: ready.clone(),
        pool: pool.clone(),
    });
    let mut http_shutdown = shutdown_rx.clone();
    let http = tokio::spawn(async move {
        axum::serve(http_listener, app)
            .with_graceful_shutdown(async move {
                let _ = http_shutdown.changed().await;
            })
            .await
    });

    let picker = match picker_setup {
        Some(picker_setup) => {
            let addr = &config.endpoint_picker.addr;
            let listener = listen("endpoint picker", addr).await?;
            let builder = picker_builder(&config)?;
            let started = crate::picker::start(
                &config,
                picker_setup,
                listener,
                builder,
                shutdown_rx.clone(),
            )
            .await
            .map_err(|source| DaemonError::Listen {
                what: "endpoint picker",
                addr: addr.clone(),
                source,
            })?;
            Some(started)
        }
        None => None,
    };

    if replication.is_none() {
        ready.store(true, Ordering::Relaxed);
    }
    tracing::info!(grpc = %grpc_addr, metrics = %metrics_addr, zmq = ?ingest.bound_endpoint, "kv-indexer ready");
    Ok(RunningDaemon {
        grpc_addr,
        metrics_addr,
        zmq_endpoint: ingest.bound_endpoint.clone(),
        indexer,
        metrics,
        pool,
        shutdown,
        ready,
        ingest,
        appender,
        picker_addr: picker.as_ref().map(|p| p.addr),
        picker,
        grpc,
        http,
        grace: Duration::from_millis(config.server.shutdown_grace_ms),
    })
}

/// How often recorded routings past their deadline are ended (a tenth of the smallest
/// `speculativeTtl` worth configuring).
const SPECULATION_TICK: Duration = Duration::from_millis(50);

/// Ends recorded routings whose deadline passed, until shutdown.
async fn expire_speculation(indexer: Arc<Indexer>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SPECULATION_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                indexer.expire_speculation(std::time::Instant::now());
            }
            _ = shutdown.changed() => return,
        }
    }
}

impl RunningDaemon {
    /// Whether the daemon reports ready (`/readyz`): with replication, once it has read the
    /// log to its end; with the endpoint picker's pool, while the pool lists a candidate.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
            && self.pool.as_ref().is_none_or(|p| p.readiness().is_ok())
    }

    /// Publisher states (for tests and tools).
    pub fn publishers(&self) -> Arc<Publishers> {
        self.ingest.publishers.clone()
    }

    /// The metrics page as `/metrics` serves it (for tests and tools).
    pub fn metrics_text(&self) -> String {
        self.metrics.render(&self.indexer)
    }

    /// Graceful shutdown: stop intake, drain the event queues, finish in-flight RPCs.
    pub async fn shutdown(self) {
        self.ready.store(false, Ordering::Relaxed);
        let _ = self.shutdown.send(true);
        let grace = self.grace;
        let drain = async {
            self.ingest.join().await;
            let _ = self.grpc.await;
            if let Some(picker) = self.picker {
                picker.join().await;
            }
            let _ = self.http.await;
            // Last: the workers and the admin API have let go of the append queue, so the
            // appender flushes what they appended and stops.
            if let Some(appender) = self.appender {
                let _ = appender.await;
            }
        };
        if tokio::time::timeout(grace, drain).await.is_err() {
            tracing::warn!(
                ?grace,
                "shutdown grace period over; exiting with work in flight"
            );
        }
        tracing::info!("kv-indexer stopped");
    }
}
