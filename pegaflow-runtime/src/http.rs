//! The HTTP endpoints (axum): `GET /health[?verbose=1]`, `GET /metrics`, `GET /instances`,
//! `POST /instances/cleanup[?id=]`, `POST /cache/memory/cleanup`, with PegaFlow's response
//! fields. `/health` answers exactly `ok` (200) as PegaFlow's probe does, or 503 when a
//! component is unhealthy; `?verbose=1` adds one line per component ([`crate::health`]).
//! Without `enable_prometheus`, `/metrics` answers 404 naming the flag that turns it on.
//! `/health` and `/metrics` never wait on the registry or a device. The two `POST`
//! endpoints answer only the peers of `[server] admin_allow` (403 for the others); the
//! router must be served with [`PeerAddr`] connect info (the peer of an unknown connection
//! is refused unless `admin_allow` is `any`).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;

use crate::config::AdminAllow;
use crate::engine::Engine;
use crate::health::{HealthBoard, HealthState};

/// The peer of an HTTP connection, as the server's listener reports it
/// (`Router::into_make_service_with_connect_info::<PeerAddr>`).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

#[derive(Clone)]
struct AppState {
    engine: Arc<Engine>,
    health: HealthBoard,
    admin_allow: Arc<AdminAllow>,
}

impl AppState {
    /// `None` when `peer` may call the admin endpoint `what`, else the 403 to answer. Logs
    /// who asked either way.
    fn refuse(&self, peer: Option<PeerAddr>, what: &str) -> Option<axum::response::Response> {
        let shown = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.0.to_string());
        if self.admin_allow.permits(peer.map(|p| p.0.ip())) {
            tracing::info!(peer = %shown, "{what} requested over HTTP");
            return None;
        }
        tracing::warn!(peer = %shown, admin_allow = %self.admin_allow, "{what} refused over HTTP");
        let body = format!(
            "{what} is refused from {shown}: only peers in [server] admin_allow ({}) may call it; \
             set it or --admin-allow to allow more (`any` allows every peer)\n",
            self.admin_allow
        );
        Some((StatusCode::FORBIDDEN, body).into_response())
    }
}

#[derive(Deserialize)]
struct CleanupQuery {
    id: Option<String>,
}

#[derive(Deserialize)]
struct HealthQuery {
    verbose: Option<String>,
}

/// The response header that carries the overall state (`ok`, `degraded`, `unhealthy`) on
/// every `/health` answer, for scripts that want it without parsing the detail.
pub const HEALTH_HEADER: &str = "x-pegaflow-health";

/// `GET /health`: `200 ok` (exactly, as PegaFlow) while the server serves, degraded
/// components or not; `503` with the detail when a component is unhealthy. `?verbose=1` (or
/// `true`) answers the detail with the same status. The overall state is in
/// [`HEALTH_HEADER`] either way.
async fn health_page(
    State(s): State<AppState>,
    Query(q): Query<HealthQuery>,
) -> axum::response::Response {
    let overall = s.health.overall();
    let verbose = q
        .verbose
        .as_deref()
        .is_some_and(|v| matches!(v, "1" | "true" | "yes" | ""));
    let status = if overall == HealthState::Unhealthy {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = if verbose || overall == HealthState::Unhealthy {
        s.health.render()
    } else {
        "ok".to_string()
    };
    (status, [(HEALTH_HEADER, overall.as_str())], body).into_response()
}

/// `GET /metrics` when `enable_prometheus` is off: 404 (the route PegaFlow leaves out) with
/// a line saying how to turn it on.
async fn metrics_off() -> axum::response::Response {
    (
        StatusCode::NOT_FOUND,
        "/metrics is off: start the server with --enable-prometheus (or [server] enable_prometheus = true)\n",
    )
        .into_response()
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    // The gauges include every Save that answered before the scrape (the seal queue holds
    // ~1 ms of work at most; a scrape never waits longer than 100 ms for it).
    let _ = tokio::time::timeout(std::time::Duration::from_millis(100), s.engine.settle()).await;
    s.engine.update_gauges();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        s.engine.metrics().render(),
    )
}

async fn instances(State(s): State<AppState>) -> impl IntoResponse {
    Json(serde_json::json!({ "instances": s.engine.instance_ids() }))
}

async fn cleanup_instances(
    State(s): State<AppState>,
    peer: Option<Extension<ConnectInfo<PeerAddr>>>,
    Query(q): Query<CleanupQuery>,
) -> axum::response::Response {
    if let Some(refused) = s.refuse(
        peer.map(|Extension(ConnectInfo(p))| p),
        "POST /instances/cleanup",
    ) {
        return refused;
    }
    let engine = s.engine.clone();
    // Run detached: the cleanup completes even if the HTTP client goes away.
    let r = tokio::spawn(async move {
        match q.id {
            None => Ok(engine.unregister_all().await),
            Some(id) => engine.unregister_counting(&id).await.map(|n| (vec![id], n)),
        }
    })
    .await;
    match r {
        Ok(Ok((ids, tensors))) => (
            StatusCode::OK,
            Json(serde_json::json!({ "removed_instances": ids, "removed_tensors": tensors })),
        )
            .into_response(),
        Ok(Err(e)) => (StatusCode::NOT_FOUND, e.to_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn cleanup_memory(
    State(s): State<AppState>,
    peer: Option<Extension<ConnectInfo<PeerAddr>>>,
) -> axum::response::Response {
    if let Some(refused) = s.refuse(
        peer.map(|Extension(ConnectInfo(p))| p),
        "POST /cache/memory/cleanup",
    ) {
        return refused;
    }
    // Freeing and trimming a large pool takes a while: keep it off the executor.
    let engine = s.engine.clone();
    match tokio::task::spawn_blocking(move || engine.cleanup_memory()).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The router; `/metrics` serves only when `enable_prometheus` (else a 404 naming the flag).
/// `/health` answers from `health` (see [`health_page`]). The cleanup endpoints answer the
/// peers `admin_allow` permits.
pub fn router(
    engine: Arc<Engine>,
    health: HealthBoard,
    enable_prometheus: bool,
    admin_allow: AdminAllow,
) -> Router {
    let mut r = Router::new()
        .route("/health", get(health_page))
        .route("/instances", get(instances))
        .route("/instances/cleanup", post(cleanup_instances))
        .route("/cache/memory/cleanup", post(cleanup_memory));
    r = if enable_prometheus {
        r.route("/metrics", get(metrics))
    } else {
        r.route("/metrics", get(metrics_off))
    };
    r.with_state(AppState {
        engine,
        health,
        admin_allow: Arc::new(admin_allow),
    })
}
