//! The gRPC Engine service: decodes requests into domain commands ([`crate::decode`]), runs
//! the engine on them (in spawned tasks where a cancelled RPC must not cut an operation in
//! half), encodes the answers, maps errors to status codes, records `pegaflow_rpc_*` metrics,
//! and tracks Session liveness streams.
//!
//! Must never: block the executor, answer a status-bearing RPC without `status` set, or hand a
//! `pb::` type to the engine.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pegaflow_proto as pb;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::decode;
use crate::engine::Engine;
use crate::error::{EngineError, EngineResult};
use crate::metrics::status_label;

fn ok_status() -> Option<pb::ResponseStatus> {
    Some(pb::ResponseStatus {
        ok: true,
        message: String::new(),
    })
}

/// The Engine service implementation.
#[derive(Clone)]
pub struct EngineService {
    engine: Arc<Engine>,
    sessions: Arc<Mutex<HashMap<String, u64>>>,
    next_token: Arc<AtomicU64>,
    shutdown: Arc<Notify>,
    fd_socket_path: String,
}

impl std::fmt::Debug for EngineService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineService").finish()
    }
}

impl EngineService {
    /// A service over `engine`; `shutdown` is notified by the Shutdown RPC.
    pub fn new(engine: Arc<Engine>, shutdown: Arc<Notify>, fd_socket_path: Option<String>) -> Self {
        Self {
            engine,
            sessions: Arc::new(Mutex::new(HashMap::new())),
            next_token: Arc::new(AtomicU64::new(1)),
            shutdown,
            fd_socket_path: fd_socket_path.unwrap_or_default(),
        }
    }

    /// Wraps the service for tonic with 64 MiB message limits and no compression.
    pub fn into_server(self) -> pb::engine_server::EngineServer<Self> {
        pb::engine_server::EngineServer::new(self)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES)
    }

    fn record<T>(&self, method: &str, t0: Instant, r: &Result<T, Status>) {
        let code = match r {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        self.engine
            .metrics()
            .observe_rpc(method, status_label(code), t0.elapsed().as_secs_f64());
    }

    /// Runs `fut` on its own task so the operation completes even if the RPC is cancelled.
    async fn detached<T: Send + 'static>(
        fut: impl Future<Output = EngineResult<T>> + Send + 'static,
    ) -> Result<T, Status> {
        match tokio::spawn(fut).await {
            Ok(r) => r.map_err(Status::from),
            Err(e) => Err(EngineError::internal(format!("operation task failed: {e}")).into()),
        }
    }
}

type SessionStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::engine_server::Engine for EngineService {
    async fn register_context_batch(
        &self,
        request: Request<pb::RegisterContextRequest>,
    ) -> Result<Response<pb::RegisterContextResponse>, Status> {
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let r = match decode::register(request.into_inner()) {
            Ok(cmd) => Self::detached(async move { engine.register(cmd).await }).await,
            Err(rejected) => {
                if let Some((id, device)) = &rejected.pending_fd {
                    self.engine.discard_pending_fd(id, *device);
                }
                Err(rejected.error.into())
            }
        };
        self.record("register_context_batch", t0, &r);
        r.map(|()| {
            Response::new(pb::RegisterContextResponse {
                status: ok_status(),
            })
        })
    }

    async fn save(
        &self,
        request: Request<pb::SaveRequest>,
    ) -> Result<Response<pb::SaveResponse>, Status> {
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let r = match decode::save(request.into_inner()) {
            Ok(cmd) => Self::detached(async move { engine.save(cmd).await }).await,
            Err(e) => Err(e.into()),
        };
        self.record("save", t0, &r);
        r.map(|()| {
            Response::new(pb::SaveResponse {
                status: ok_status(),
            })
        })
    }

    async fn load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let r = match decode::load(request.into_inner()) {
            Ok(cmd) => Self::detached(async move { engine.load(cmd).await }).await,
            Err(e) => Err(e.into()),
        };
        self.record("load", t0, &r);
        r.map(|()| {
            Response::new(pb::LoadResponse {
                status: ok_status(),
            })
        })
    }

    async fn query_prefetch(
        &self,
        request: Request<pb::QueryRequest>,
    ) -> Result<Response<pb::QueryResponse>, Status> {
        let t0 = Instant::now();
        let r = match decode::query(request.into_inner()) {
            Ok(cmd) => self
                .engine
                .query(cmd)
                .await
                .map(decode::query_response)
                .map_err(Status::from),
            Err(e) => Err(e.into()),
        };
        self.record("query_prefetch", t0, &r);
        r.map(Response::new)
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let t0 = Instant::now();
        let r = self
            .engine
            .release(&request.into_inner().lease)
            .map_err(Status::from);
        self.record("release", t0, &r);
        r.map(|()| Response::new(pb::ReleaseResponse {}))
    }

    async fn unregister_context(
        &self,
        request: Request<pb::UnregisterRequest>,
    ) -> Result<Response<pb::UnregisterResponse>, Status> {
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let id = request.into_inner().instance_id;
        let r = Self::detached(async move { engine.unregister(&id).await }).await;
        self.record("unregister_context", t0, &r);
        r.map(|()| {
            Response::new(pb::UnregisterResponse {
                status: ok_status(),
            })
        })
    }

    async fn shutdown(
        &self,
        _request: Request<pb::ShutdownRequest>,
    ) -> Result<Response<pb::ShutdownResponse>, Status> {
        tracing::info!("shutdown requested over gRPC");
        self.shutdown.notify_waiters();
        self.shutdown.notify_one();
        let r = Ok(Response::new(pb::ShutdownResponse {
            status: ok_status(),
        }));
        self.record("shutdown", Instant::now(), &r);
        r
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        let r = Ok(Response::new(pb::HealthResponse {
            status: ok_status(),
            fd_socket_path: self.fd_socket_path.clone(),
        }));
        self.record("health", Instant::now(), &r);
        r
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        request: Request<pb::SessionRequest>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let req = request.into_inner();
        if req.instance_id.is_empty() {
            let status = Status::invalid_argument("instance_id must not be empty");
            self.record::<()>("session", Instant::now(), &Err(status.clone()));
            return Err(status);
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.sessions.lock().insert(req.instance_id.clone(), token);
        let (tx, rx) = mpsc::channel::<Result<pb::SessionEvent, Status>>(1);
        let sessions = self.sessions.clone();
        let engine = self.engine.clone();
        let id = req.instance_id.clone();
        tokio::spawn(async move {
            tx.closed().await;
            let current = {
                let mut s = sessions.lock();
                if s.get(&id) == Some(&token) {
                    s.remove(&id);
                    true
                } else {
                    false
                }
            };
            if current {
                match engine.unregister(&id).await {
                    Ok(()) => tracing::info!(instance = %id, "session ended; instance cleaned up"),
                    Err(e) => tracing::debug!(instance = %id, error = %e, "session ended"),
                }
            } else {
                tracing::debug!(instance = %id, "superseded session ended");
            }
        });
        tracing::info!(instance = %req.instance_id, token, "session opened");
        self.record("session", Instant::now(), &Ok::<(), Status>(()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn query_blocks_for_transfer(
        &self,
        request: Request<pb::QueryBlocksForTransferRequest>,
    ) -> Result<Response<pb::QueryBlocksForTransferResponse>, Status> {
        let t0 = Instant::now();
        let r = match self.engine.peer() {
            Some(p) => p
                .query_blocks_for_transfer(self.engine.store(), request.into_inner())
                .await
                .map(Response::new),
            None => Err(Status::failed_precondition(
                "cross-node transfer is not configured on this server (the pipeline has no [peer])",
            )),
        };
        self.record("query_blocks_for_transfer", t0, &r);
        r
    }

    async fn release_transfer_lock(
        &self,
        request: Request<pb::ReleaseTransferLockRequest>,
    ) -> Result<Response<pb::ReleaseTransferLockResponse>, Status> {
        let t0 = Instant::now();
        let r = match self.engine.peer() {
            Some(p) => p
                .release_transfer_lock(self.engine.store(), request.into_inner())
                .await
                .map(Response::new),
            // Nothing can be locked without a delegate: releasing is a no-op success.
            None => Ok(Response::new(pb::ReleaseTransferLockResponse {
                status: ok_status(),
                released_blocks: 0,
            })),
        };
        self.record("release_transfer_lock", t0, &r);
        r
    }

    async fn rdma_handshake(
        &self,
        request: Request<pb::RdmaHandshakeRequest>,
    ) -> Result<Response<pb::RdmaHandshakeResponse>, Status> {
        let t0 = Instant::now();
        let r = match self.engine.peer() {
            Some(p) => p
                .rdma_handshake(self.engine.store(), request.into_inner())
                .await
                .map(Response::new),
            None => Err(Status::failed_precondition(
                "cross-node transfer is not configured on this server (the pipeline has no [peer])",
            )),
        };
        self.record("rdma_handshake", t0, &r);
        r
    }

    async fn flush(
        &self,
        _request: Request<pb::FlushRequest>,
    ) -> Result<Response<pb::FlushResponse>, Status> {
        let t0 = Instant::now();
        self.engine.flush().await;
        let r = Ok(Response::new(pb::FlushResponse {
            status: ok_status(),
        }));
        self.record("flush", t0, &r);
        r
    }
}
