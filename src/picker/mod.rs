//! kv-indexer as an `InferencePool`'s endpoint picker: Envoy's external processing service
//! (`envoy.service.ext_proc.v3.ExternalProcessor`) on its own port, speaking GIE's
//! endpoint-picker protocol, with the gRPC health service a gateway probes.
//!
//! - `body`: OpenAI request bodies read into the prompt scoring takes (the prefix knowable
//!   exactly), or none;
//! - `choose`: candidates, prefix scores (the daemon's scoring), load, kv-core's pick, the
//!   routing record;
//! - `scrape`: each pod's Prometheus endpoint read on a short interval;
//! - `split`: prefill/decode disaggregation (whether to name a prefill pod, and which);
//! - `extproc`: the ext_proc stream's request side (body modes, the pick, immediate
//!   responses); `response`: its response side (served endpoint, bodies back, `usage` held
//!   against the prediction, read by `usage`); `answer`: the messages both build.
//!
//! Invariants: off unless `endpointPicker.enabled`; plaintext or TLS as the daemon's gRPC
//! (`server.tls`); the candidates are the pool's ([`crate::pool`]), whether or not they
//! published; the health service reports `liveness` SERVING while the process serves,
//! `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` SERVING only while the daemon
//! is ready (`/readyz`: the pool's source has answered, whether or not it lists a candidate);
//! at most `maxInFlight` requests are scored at once, `maxStreams` streams are open and
//! `maxBufferedBodyBytes` of bodies are held (beyond each: 429, `bounds`).

mod answer;
pub mod body;
mod bounds;
mod choose;
mod extproc;
mod response;
mod scrape;
mod split;
pub mod usage;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;

use crate::config::{Config, ServerConfig};
use crate::ingest::{LogHandle, Pods};
use crate::metrics::Metrics;
use crate::pool::Pool;
use crate::scoring::Scoring;
use kv_core::{Indexer, PickSettings, PrefixNormalisation};
use kv_tokenize::TokenizerService;

/// The health service names GIE's protocol asks for.
pub const HEALTH_SERVICES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// What the picker shares with the rest of the daemon.
pub struct PickerSetup {
    /// The index.
    pub indexer: Arc<Indexer>,
    /// The tokenizers (ScorePods' pool).
    pub tokenizers: Arc<TokenizerService>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Ingestion's pods (presence).
    pub pods: Pods,
    /// The shared log (replication): recorded picks reach the other replicas.
    pub log: Option<LogHandle>,
    /// The daemon's readiness.
    pub ready: Arc<AtomicBool>,
    /// The candidates' source and health.
    pub pool: Arc<Pool>,
    /// The pool's source, when it runs one (stopped with the picker).
    pub pool_task: Option<JoinHandle<()>>,
}

/// A serving picker.
pub struct RunningPicker {
    /// The address bound.
    pub addr: SocketAddr,
    /// The server.
    pub server: JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningPicker {
    /// Waits for the server to finish (after shutdown), then stops the background tasks.
    pub async fn join(self) {
        let _ = self.server.await;
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Serves the picker on `listener` with `builder` (TLS already applied), until `shutdown`.
pub async fn start(
    config: &Config,
    setup: PickerSetup,
    listener: TcpListener,
    builder: tonic::transport::Server,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<RunningPicker> {
    let cfg = &config.endpoint_picker;
    let addr = listener.local_addr()?;
    let mut setup = setup;
    let mut tasks: Vec<JoinHandle<()>> = setup.pool_task.take().into_iter().collect();
    let (ready, pool) = (setup.ready.clone(), setup.pool.clone());
    let chooser = chooser(config, setup);
    let lister = chooser.clone();
    tasks.push(
        chooser
            .scraper
            .clone()
            .run(move || lister.scrape_targets(), shutdown.clone()),
    );
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(HEALTH_SERVICES[0], ServingStatus::Serving)
        .await;
    tasks.push(tokio::spawn(report_readiness(
        reporter,
        ready,
        pool,
        shutdown.clone(),
    )));
    let metrics = chooser.metrics.clone();
    let service = extproc::ExtProc {
        chooser,
        max_body_bytes: cfg.max_body_bytes,
        budget: bounds::BodyBudget::new(cfg.max_buffered_body_bytes, metrics.clone()),
        slots: bounds::StreamSlots::new(cfg.max_streams, metrics),
        mode_warnings: Default::default(),
    };
    let mut server_shutdown = shutdown;
    // HTTP/2's own bound per connection too, so a gateway is told before it opens more.
    let streams = u32::try_from(cfg.max_streams).unwrap_or(u32::MAX);
    let server = tokio::spawn(
        builder
            .max_concurrent_streams(Some(streams))
            .add_service(health)
            .add_service(
                ExternalProcessorServer::new(service)
                    .max_decoding_message_size(cfg.max_body_bytes.saturating_add(64 << 10)),
            )
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                async move {
                    let _ = server_shutdown.changed().await;
                },
            ),
    );
    tracing::info!(%addr, "endpoint picker (ext_proc) serving");
    Ok(RunningPicker {
        addr,
        server,
        tasks,
    })
}

/// The picker's chooser: its own scoring service, the load scraper, the pick's settings.
fn chooser(config: &Config, setup: PickerSetup) -> Arc<choose::Chooser> {
    let cfg = &config.endpoint_picker;
    // The picker's own score service: its in-flight bound is maxInFlight, and its picks are
    // recorded (a prompt key per pick) whatever server.enableRecordRouting says of the RPC.
    let limits = ServerConfig {
        max_concurrent_requests: cfg.max_in_flight,
        enable_record_routing: true,
        ..config.server.clone()
    };
    let scoring = Scoring::new(
        setup.indexer.clone(),
        setup.tokenizers,
        setup.metrics.clone(),
        setup.pods.clone(),
        (limits, "endpointPicker.maxInFlight"),
        setup.log,
    );
    let scraper = scrape::Scraper::new(
        scrape::ScrapeSettings {
            template: cfg.metrics_url_template.clone(),
            interval: cfg.metrics_interval.0,
            max_per_second: cfg.metrics_max_scrapes_per_second,
            stale_after: cfg.metrics_stale_after.0,
        },
        setup.metrics.clone(),
        setup.pool.clone(),
    );
    let adapters = config
        .models
        .iter()
        .flat_map(|(base, m)| m.lora_adapters.keys().map(|a| (a.clone(), base.clone())))
        .collect();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    Arc::new(choose::Chooser {
        scoring,
        indexer: setup.indexer,
        pods: setup.pods,
        scraper,
        pool: setup.pool,
        metrics: setup.metrics,
        settings: PickSettings {
            weights: cfg.weights,
            max_metrics_age: cfg.metrics_stale_after.0,
            prefix: PrefixNormalisation::MinMax,
        },
        fallbacks: cfg.fallbacks,
        adapters,
        picks: Default::default(),
        seed,
        pd: cfg.pd.rule(),
    })
}

/// Keeps the health service's `readiness` and ext_proc entries at the daemon's readiness
/// (ready, and the pool's source has answered), checked every 100 ms, until `shutdown`.
async fn report_readiness(
    reporter: tonic_health::server::HealthReporter,
    ready: Arc<AtomicBool>,
    pool: Arc<Pool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last = None;
    loop {
        let now = ready.load(Ordering::Relaxed) && pool.readiness().is_ok();
        if last != Some(now) {
            let status = match now {
                true => ServingStatus::Serving,
                false => ServingStatus::NotServing,
            };
            for name in &HEALTH_SERVICES[1..] {
                reporter.set_service_status(*name, status).await;
            }
            last = Some(now);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = shutdown.changed() => return,
        }
    }
}
