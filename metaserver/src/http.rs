//! The HTTP endpoints (axum): `GET /health` and `GET /metrics`.
//!
//! `/health` answers `ok` while the directory answers; with a backend behind a network
//! (Redis) it asks the backend a one-hash query and answers 503 with the reason when the
//! store is unreachable or slow. `/metrics` refreshes the in-memory store gauges, then
//! renders every family. Neither waits longer than [`HEALTH_TIMEOUT`].

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use pegaflow_directory::memory::MemoryDirectory;
use pegaflow_plugin::Directory;

use crate::metrics::Metrics;

/// The longest `/health` waits on the backend.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// The namespace of the `/health` probe query (nothing is ever inserted there).
pub const HEALTH_NAMESPACE: &str = "__pegaflow_metaserver_health__";

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    /// The directory served.
    pub dir: Arc<dyn Directory>,
    /// The same directory when it is the in-memory one (its gauges; no probe needed).
    pub memory: Option<Arc<MemoryDirectory>>,
    /// The families.
    pub metrics: Arc<Metrics>,
}

async fn health(State(s): State<HttpState>) -> axum::response::Response {
    if s.memory.is_some() {
        return "ok".into_response();
    }
    let probe = vec![b"health-probe".to_vec()];
    match tokio::time::timeout(
        HEALTH_TIMEOUT,
        s.dir.query_prefix(HEALTH_NAMESPACE, &probe, None),
    )
    .await
    {
        Ok(Ok(_)) => "ok".into_response(),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{} directory: {e}\n", s.dir.kind()),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} directory: no answer within {} ms\n",
                s.dir.kind(),
                HEALTH_TIMEOUT.as_millis()
            ),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    if let Some(m) = &s.memory {
        // Locks each shard briefly: keep it off the executor threads.
        let m = m.clone();
        if let Ok(stats) = tokio::task::spawn_blocking(move || m.stats()).await {
            s.metrics.set_store(&stats);
        }
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        s.metrics.render(),
    )
}

/// The router.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}
