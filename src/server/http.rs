//! The HTTP side port: `/metrics` (Prometheus text), `/healthz` (the process is up) and
//! `/readyz`: 200 once the event sockets are bound and gRPC is serving, 503 before that and
//! while shutting down. An empty index is ready: scores are 0 until events arrive, and a fleet
//! without traffic must not hold its gateway unready. With the endpoint picker's pool, readiness
//! follows membership: 503 until the pool's source has answered, and while it lists no ready
//! endpoint, the body saying why.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;
use crate::pool::Pool;
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
    /// The endpoint picker's pool (its readiness), when the picker is on.
    pub pool: Option<Arc<Pool>>,
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
    if !s.ready.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned());
    }
    match s.pool.as_ref().map_or(Ok(()), |p| p.readiness()) {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: endpoint picker: {why}\n"),
        ),
    }
}
