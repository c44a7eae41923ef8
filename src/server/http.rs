//! The HTTP side port: `/metrics` (Prometheus text), `/healthz` (the process is up) and
//! `/readyz`: 200 once the event sockets are bound and gRPC is serving, 503 before that and
//! while shutting down. An empty index is ready: scores are 0 until events arrive, and a fleet
//! without traffic must not hold its gateway unready.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;
use kv_core::Indexer;

/// What the HTTP handlers read.
#[derive(Clone)]
pub struct HttpState {
    /// For the index gauges.
    pub indexer: Arc<Indexer>,
    /// The registry.
    pub metrics: Arc<Metrics>,
    /// Set once ingestion and gRPC are up; cleared on shutdown.
    pub ready: Arc<AtomicBool>,
}

/// The HTTP application of the metrics port (axum calls its route table a `Router`).
pub fn app(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&s.indexer),
    )
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
