//! The HTTP endpoints (axum): `GET /health`, `GET /metrics`, `GET /instances`,
//! `POST /instances/cleanup[?id=]`, `POST /cache/memory/cleanup`, with PegaFlow's response
//! fields. `/health` and `/metrics` never wait on the registry or a device.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use crate::engine::Engine;
use crate::health::HealthBoard;

#[derive(Clone)]
struct AppState {
    engine: Arc<Engine>,
    health: HealthBoard,
}

#[derive(Deserialize)]
struct CleanupQuery {
    id: Option<String>,
}

async fn health_page(State(s): State<AppState>) -> String {
    s.health.render()
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
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
    Query(q): Query<CleanupQuery>,
) -> axum::response::Response {
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

async fn cleanup_memory(State(s): State<AppState>) -> axum::response::Response {
    // Freeing and trimming a large pool takes a while: keep it off the executor.
    let engine = s.engine.clone();
    match tokio::task::spawn_blocking(move || engine.cleanup_memory()).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The router; `/metrics` only when `enable_prometheus`. `/health` renders `health`
/// ([`HealthBoard::render`]: `ok`, PegaFlow's body, until a component reports).
pub fn router(engine: Arc<Engine>, health: HealthBoard, enable_prometheus: bool) -> Router {
    let mut r = Router::new()
        .route("/health", get(health_page))
        .route("/instances", get(instances))
        .route("/instances/cleanup", post(cleanup_instances))
        .route("/cache/memory/cleanup", post(cleanup_memory));
    if enable_prometheus {
        r = r.route("/metrics", get(metrics));
    }
    r.with_state(AppState { engine, health })
}
