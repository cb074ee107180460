//! The gRPC Engine service: decodes requests into domain commands ([`crate::decode`]), runs
//! the engine on them (in spawned tasks where a cancelled RPC must not cut an operation in
//! half), encodes the answers, maps errors to status codes, records `pegaflow_rpc_*` metrics,
//! and tracks Session liveness streams.
//!
//! Served behind [`GuardedEngineServer`], which answers a body that does not decode
//! INVALID_ARGUMENT (tonic says INTERNAL) and caps every status message at
//! [`MAX_STATUS_MESSAGE_BYTES`], whoever built the status.
//!
//! Must never: block the executor, answer a status-bearing RPC without `status` set, hand a
//! `pb::` type to the engine, or send a status whose message could outgrow the client's
//! HTTP/2 header limit (a reset stream, or from ~256 KB a GOAWAY that ends the client's
//! Session and with it its registration).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pegaflow_api::load_state::{LoadStateWriter, LOAD_FAILED};
use pegaflow_proto as pb;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status};

use crate::decode;
use crate::engine::Engine;
use crate::error::{capped_status, EngineError, EngineResult, MAX_STATUS_MESSAGE_BYTES};
use crate::metrics::{status_label, Metrics};
use crate::plugin::{NearEnd, SourceRead};

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
    admin_allow: crate::config::AdminAllow,
    save_headers_early: bool,
    save_answer_early: bool,
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
            admin_allow: Default::default(),
            save_headers_early: true,
            save_answer_early: true,
        }
    }

    /// Answers the Shutdown RPC only from the peers of `allow` (loopback unless set).
    pub fn with_admin_allow(mut self, allow: crate::config::AdminAllow) -> Self {
        self.admin_allow = allow;
        self
    }

    /// Whether a Save's response headers go out when its copy nears its end (default true;
    /// `[server] save_headers_early`, [`crate::config::ServerConfig::save_headers_early`]).
    pub fn with_save_headers_early(mut self, early: bool) -> Self {
        self.save_headers_early = early;
        self
    }

    /// Whether a Save is answered once its device memory was read (default true; `[server]
    /// save_answer_early`, [`crate::config::ServerConfig::save_answer_early`]).
    pub fn with_save_answer_early(mut self, early: bool) -> Self {
        self.save_answer_early = early;
        self
    }

    /// Wraps the service for tonic with 64 MiB message limits and no compression, behind
    /// [`GuardedEngineServer`].
    pub fn into_server(self) -> GuardedEngineServer {
        let metrics = self.engine.metrics().clone();
        let early_save =
            (self.save_headers_early || self.save_answer_early).then(|| Arc::new(self.clone()));
        GuardedEngineServer {
            inner: pb::engine_server::EngineServer::new(self)
                .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(pb::MAX_MESSAGE_BYTES),
            early_save,
            metrics,
        }
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

    /// A Load refused while decoding still reports −1 to its load-state word, as one the
    /// engine refuses does (the client may be polling it), and counts as a failed load.
    fn refused_load(&self, word: Option<&str>) {
        self.engine.metrics().load_failures.inc();
        let Some(name) = word else { return };
        if let Err(e) = LoadStateWriter::attach(name).and_then(|w| w.complete(LOAD_FAILED)) {
            tracing::debug!(load_state = name, error = %e, "cannot report a refused load");
        }
    }

    /// Runs `fut` on its own task so the operation completes even if the RPC is cancelled.
    async fn detached<T: Send + 'static>(
        fut: impl Future<Output = EngineResult<T>> + Send + 'static,
    ) -> Result<T, Status> {
        joined(tokio::spawn(fut).await)
    }

    /// A Save's end, whichever way its headers went: the metrics, the debug line, the answer.
    fn save_answered(
        &self,
        t0: Instant,
        r: Result<(), Status>,
    ) -> Result<pb::SaveResponse, Status> {
        self.record("save", t0, &r);
        tracing::debug!(
            ok = r.is_ok(),
            handler_us = t0.elapsed().as_micros() as u64,
            "save answered"
        );
        r.map(|()| pb::SaveResponse {
            status: ok_status(),
        })
    }

    /// The Save handler under `save_headers_early` or `save_answer_early`: runs the Save in a
    /// task of its own (a cancelled RPC does not cut it in half) with a [`NearEnd`] and a
    /// [`SourceRead`] listener, each only where its setting is on.
    ///
    /// - The Save ends first (a refusal, a copy that signals neither): the headers go out
    ///   with the answer, as under the unary handler.
    /// - The transport has read all of the Save's device memory first ([`SourceRead`]): the
    ///   answer (OK) goes out at once; the Save runs on to its end in its task, and a failure
    ///   after that is logged and counted in `pegaflow_save_late_failures_total`.
    /// - The copy nears its end first ([`NearEnd`]): the response headers go out at once, and
    ///   the answer, or the error status in the trailers, when the Save ends.
    ///
    /// A request with a deadline (`grpc-timeout`) is answered at its end, headers with it:
    /// the server's deadline covers a response only up to its headers, so the answer waits
    /// for the Save as under the unary handler and the deadline still applies to all of it.
    /// (The published client sends none.)
    async fn save_with_early_headers(
        self: Arc<Self>,
        request: Request<pb::SaveRequest>,
    ) -> Result<Response<SaveAnswer>, Status> {
        let t0 = Instant::now();
        tracing::debug!(layers = request.get_ref().saves.len(), "save received");
        let has_deadline = request.metadata().contains_key(GRPC_TIMEOUT);
        let cmd = match decode::save(request.into_inner()) {
            Ok(cmd) => cmd,
            Err(e) => return self.save_answered(t0, Err(e.into())).map(answer_now),
        };
        let (near, near_end) = NearEnd::new();
        let (read, source_read) = SourceRead::new();
        let engine = self.engine.clone();
        let save = async move { engine.save(cmd).await };
        // A Save with a deadline is answered at its end: no listener (the engine would note
        // it as acknowledged for nothing).
        let answer_early = self.save_answer_early && !has_deadline;
        let mut task = match (self.save_headers_early, answer_early) {
            (true, true) => tokio::spawn(near.scope(read.scope(save))),
            (true, false) => tokio::spawn(near.scope(save)),
            (false, true) => tokio::spawn(read.scope(save)),
            (false, false) => tokio::spawn(save),
        };
        if has_deadline {
            return self.save_answered(t0, joined(task.await)).map(answer_now);
        }
        // A listener not installed above never fires: only the task's end answers then.
        tokio::select! {
            biased;
            r = &mut task => return self.save_answered(t0, joined(r)).map(answer_now),
            Ok(()) = source_read => {
                let metrics = self.engine.metrics().clone();
                tokio::spawn(async move {
                    if let Err(e) = joined(task.await) {
                        metrics.save_late_failures.inc();
                        tracing::warn!(
                            error = %e.message(),
                            "a Save answered once its device memory was read failed afterwards; none of its blocks were stored"
                        );
                    }
                });
                return self.save_answered(t0, Ok(())).map(answer_now);
            }
            Ok(()) = near_end => {}
        }
        tracing::debug!(
            headers_us = t0.elapsed().as_micros() as u64,
            "save headers sent"
        );
        let svc = self.clone();
        let answer = futures::stream::once(async move {
            svc.save_answered(t0, joined(task.await))
                .map_err(capped_status)
        });
        Ok(Response::new(Box::pin(answer)))
    }
}

/// An operation task's result as the RPC's.
fn joined<T>(r: Result<EngineResult<T>, tokio::task::JoinError>) -> Result<T, Status> {
    match r {
        Ok(r) => r.map_err(Status::from),
        Err(e) => Err(EngineError::internal(format!("operation task failed: {e}")).into()),
    }
}

/// A Save's answer as a stream of one message: how the Save path of [`GuardedEngineServer`]
/// sends it (on the wire the same as a unary answer: headers, one message, trailers).
type SaveAnswer =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::SaveResponse, Status>> + Send>>;

fn answer_now(resp: pb::SaveResponse) -> Response<SaveAnswer> {
    Response::new(Box::pin(futures::stream::once(std::future::ready(Ok(
        resp,
    )))))
}

/// The request header that carries a client's deadline.
const GRPC_TIMEOUT: &str = "grpc-timeout";

/// [`EngineService::save_with_early_headers`] as tonic's server-streaming service.
struct EarlySave(Arc<EngineService>);

impl tonic::server::ServerStreamingService<pb::SaveRequest> for EarlySave {
    type Response = pb::SaveResponse;
    type ResponseStream = SaveAnswer;
    type Future = BoxFuture<Response<SaveAnswer>, Status>;

    fn call(&mut self, request: Request<pb::SaveRequest>) -> Self::Future {
        let svc = self.0.clone();
        Box::pin(async move { svc.save_with_early_headers(request).await })
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
        tracing::debug!(layers = request.get_ref().saves.len(), "save received");
        let engine = self.engine.clone();
        let r = match decode::save(request.into_inner()) {
            Ok(cmd) => Self::detached(async move { engine.save(cmd).await }).await,
            Err(e) => Err(e.into()),
        };
        self.save_answered(t0, r).map(Response::new)
    }

    async fn load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        let t0 = Instant::now();
        let engine = self.engine.clone();
        let req = request.into_inner();
        let word = decode::load_state_word(&req).map(str::to_owned);
        let r = match decode::load(req) {
            Ok(cmd) => Self::detached(async move { engine.load(cmd).await }).await,
            Err(e) => {
                self.refused_load(word.as_deref());
                Err(e.into())
            }
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
        let r = decode::release(request.into_inner())
            .and_then(|lease| self.engine.release(&lease))
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
        let r = match decode::unregister(request.into_inner()) {
            Ok(id) => Self::detached(async move { engine.unregister(&id).await }).await,
            Err(e) => Err(e.into()),
        };
        self.record("unregister_context", t0, &r);
        r.map(|()| {
            Response::new(pb::UnregisterResponse {
                status: ok_status(),
            })
        })
    }

    async fn shutdown(
        &self,
        request: Request<pb::ShutdownRequest>,
    ) -> Result<Response<pb::ShutdownResponse>, Status> {
        let peer = request.remote_addr();
        let shown = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
        if !self.admin_allow.permits(peer.map(|p| p.ip())) {
            tracing::warn!(peer = %shown, admin_allow = %self.admin_allow, "Shutdown RPC refused");
            let r = Err(Status::permission_denied(format!(
                "Shutdown is refused from {shown}: only peers in [server] admin_allow ({}) may \
                 call it; set it or --admin-allow to allow more (`any` allows every peer)",
                self.admin_allow
            )));
            self.record("shutdown", Instant::now(), &r);
            return r;
        }
        tracing::info!(peer = %shown, "shutdown requested over gRPC");
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
        let instance_id = match decode::session(request.into_inner()) {
            Ok(id) => id,
            Err(e) => {
                let status = Status::from(e);
                self.record::<()>("session", Instant::now(), &Err(status.clone()));
                return Err(status);
            }
        };
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.sessions.lock().insert(instance_id.clone(), token);
        let (tx, rx) = mpsc::channel::<Result<pb::SessionEvent, Status>>(1);
        let sessions = self.sessions.clone();
        let engine = self.engine.clone();
        let id = instance_id.clone();
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
        tracing::info!(instance = %instance_id, token, "session opened");
        self.record("session", Instant::now(), &Ok::<(), Status>(()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn query_blocks_for_transfer(
        &self,
        request: Request<pb::QueryBlocksForTransferRequest>,
    ) -> Result<Response<pb::QueryBlocksForTransferResponse>, Status> {
        let t0 = Instant::now();
        let req = request.into_inner();
        let r = match (
            decode::check_query_blocks_for_transfer(&req),
            self.engine.peer(),
        ) {
            (Err(e), _) => Err(e.into()),
            (Ok(()), Some(p)) => {
                // The blocks of every Save that answered before this call are sealed and
                // indexed first, as for QueryPrefetch: a peer asking right after a Save sees it.
                self.engine.settle().await;
                p.query_blocks_for_transfer(self.engine.block_host(), req)
                    .await
                    .map(Response::new)
            }
            (Ok(()), None) => Err(Status::failed_precondition(
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
        let req = request.into_inner();
        let r = match (
            decode::check_release_transfer_lock(&req),
            self.engine.peer(),
        ) {
            (Err(e), _) => Err(e.into()),
            (Ok(()), Some(p)) => p
                .release_transfer_lock(self.engine.block_host(), req)
                .await
                .map(Response::new),
            // Nothing can be locked without a delegate: releasing is a no-op success.
            (Ok(()), None) => Ok(Response::new(pb::ReleaseTransferLockResponse {
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
        let req = request.into_inner();
        let r = match (decode::check_rdma_handshake(&req), self.engine.peer()) {
            (Err(e), _) => Err(e.into()),
            (Ok(()), Some(p)) => p
                .rdma_handshake(self.engine.block_host(), req)
                .await
                .map(Response::new),
            (Ok(()), None) => Err(Status::failed_precondition(
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

/// Every method of the Engine service: its path name and its `method` metric label.
const METHODS: [(&str, &str); 13] = [
    ("RegisterContextBatch", "register_context_batch"),
    ("Save", "save"),
    ("Load", "load"),
    ("QueryPrefetch", "query_prefetch"),
    ("Release", "release"),
    ("UnregisterContext", "unregister_context"),
    ("Shutdown", "shutdown"),
    ("Health", "health"),
    ("Session", "session"),
    ("QueryBlocksForTransfer", "query_blocks_for_transfer"),
    ("ReleaseTransferLock", "release_transfer_lock"),
    ("RdmaHandshake", "rdma_handshake"),
    ("Flush", "flush"),
];

/// The metric label of a request path (`unknown` for any other path: labels stay bounded).
fn method_label(path: &str) -> &'static str {
    path.strip_prefix("/pegaflow.Engine/")
        .and_then(|m| METHODS.iter().find(|(name, _)| *name == m))
        .map_or("unknown", |(_, label)| label)
}

/// How tonic's INTERNAL statuses for a request body that does not decode begin: the prost
/// error, a missing or truncated message, a bad compression flag.
const UNDECODABLE_PREFIXES: [&str; 4] = [
    "failed to decode Protobuf message",
    "Missing request message",
    "Unexpected EOF decoding stream",
    "protocol error: received message with",
];

/// The trailers-only status headers (gRPC over HTTP/2).
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");
const GRPC_STATUS_DETAILS: http::HeaderName =
    http::HeaderName::from_static("grpc-status-details-bin");

/// Whether `s` is tonic's answer to a request body that does not decode.
fn is_undecodable(s: &Status) -> bool {
    s.code() == tonic::Code::Internal
        && UNDECODABLE_PREFIXES
            .iter()
            .any(|p| s.message().starts_with(p))
}

/// The Engine server behind two guards on its error statuses, for whatever built them:
///
/// - a request body that does not decode (malformed protobuf, a string that is not UTF-8, a
///   truncated frame) is INVALID_ARGUMENT — the client's `ValueError` — not tonic's INTERNAL,
///   and is counted in `pegaflow_rpc_undecodable_requests_total{method}` and
///   `pegaflow_rpc_requests_total{method, status="InvalidArgument"}`;
/// - no status message is longer than [`MAX_STATUS_MESSAGE_BYTES`].
///
/// Error statuses of unary and server-streaming handlers travel in the response headers
/// ("trailers-only"), which is where both guards look.
///
/// Under early Save headers ([`EngineService::with_save_headers_early`]) this server answers
/// `Save` itself, through [`EngineService::save_with_early_headers`]: a Save that fails
/// after its headers went out carries its status in the trailers, capped by that handler.
#[derive(Clone)]
pub struct GuardedEngineServer {
    inner: pb::engine_server::EngineServer<EngineService>,
    /// The service that answers Saves with early headers, when
    /// [`EngineService::with_save_headers_early`] is on.
    early_save: Option<Arc<EngineService>>,
    metrics: Arc<Metrics>,
}

/// The Save method's path, which [`GuardedEngineServer`] serves itself under early headers.
const SAVE_PATH: &str = "/pegaflow.Engine/Save";

impl std::fmt::Debug for GuardedEngineServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedEngineServer").finish()
    }
}

impl tonic::server::NamedService for GuardedEngineServer {
    const NAME: &'static str =
        <pb::engine_server::EngineServer<EngineService> as tonic::server::NamedService>::NAME;
}

impl<B> Service<http::Request<B>> for GuardedEngineServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::<http::Request<B>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_label(req.uri().path());
        let t0 = Instant::now();
        let metrics = self.metrics.clone();
        let fut: Self::Future = match &self.early_save {
            Some(svc) if req.uri().path() == SAVE_PATH => {
                let svc = EarlySave(svc.clone());
                // The limits and the compression (none) of `into_server`'s generated server.
                Box::pin(async move {
                    let codec =
                        tonic_prost::ProstCodec::<pb::SaveResponse, pb::SaveRequest>::default();
                    let mut grpc = tonic::server::Grpc::new(codec).apply_max_message_size_config(
                        Some(pb::MAX_MESSAGE_BYTES),
                        Some(pb::MAX_MESSAGE_BYTES),
                    );
                    Ok(grpc.server_streaming(svc, req).await)
                })
            }
            _ => self.inner.call(req),
        };
        Box::pin(async move {
            let mut resp = fut.await?;
            guard_status(&mut resp, method, t0, &metrics);
            Ok(resp)
        })
    }
}

/// Rewrites a trailers-only error status of `resp` when it needs it (see
/// [`GuardedEngineServer`]).
fn guard_status(
    resp: &mut http::Response<tonic::body::Body>,
    method: &'static str,
    t0: Instant,
    metrics: &Metrics,
) {
    let headers = resp.headers();
    let Some(code) = headers.get(GRPC_STATUS) else {
        return; // not trailers-only: a message follows, the status is in the trailers
    };
    let internal = code.as_bytes() == b"13";
    let long = headers
        .get(GRPC_MESSAGE)
        .is_some_and(|m| m.len() > MAX_STATUS_MESSAGE_BYTES);
    if !internal && !long {
        return;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    let status = if is_undecodable(&status) {
        metrics
            .rpc_undecodable_requests
            .with_label_values(&[method])
            .inc();
        metrics.observe_rpc(
            method,
            status_label(tonic::Code::InvalidArgument),
            t0.elapsed().as_secs_f64(),
        );
        Status::invalid_argument(format!(
            "undecodable {method} request: {}",
            status.message()
        ))
    } else if long {
        Status::with_details(
            status.code(),
            status.message(),
            tonic::codegen::Bytes::copy_from_slice(status.details()),
        )
    } else {
        return;
    };
    let status = capped_status(status);
    let headers = resp.headers_mut();
    headers.remove(GRPC_STATUS);
    headers.remove(GRPC_MESSAGE);
    headers.remove(GRPC_STATUS_DETAILS);
    if let Err(e) = status.add_header(headers) {
        tracing::warn!(error = %e, "cannot rewrite a status");
    }
    resp.extensions_mut().insert(status);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(
            method_label("/pegaflow.Engine/QueryPrefetch"),
            "query_prefetch"
        );
        assert_eq!(method_label("/pegaflow.Engine/Nope"), "unknown");
        assert_eq!(method_label("/other.Service/Save"), "unknown");
    }

    fn trailers_only(s: Status) -> http::Response<tonic::body::Body> {
        s.into_http()
    }

    #[test]
    fn undecodable_bodies_become_invalid_argument_and_long_messages_are_cut() {
        let m = Metrics::new();
        let mut r = trailers_only(Status::internal(
            "failed to decode Protobuf message: invalid wire type",
        ));
        guard_status(&mut r, "save", Instant::now(), &m);
        let s = Status::from_header_map(r.headers()).unwrap();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s
            .message()
            .starts_with("undecodable save request: failed to decode"));
        assert_eq!(
            m.rpc_undecodable_requests
                .with_label_values(&["save"])
                .get(),
            1
        );

        let mut r = trailers_only(Status::internal("copy failed: x"));
        guard_status(&mut r, "load", Instant::now(), &m);
        let s = Status::from_header_map(r.headers()).unwrap();
        assert_eq!(
            s.code(),
            tonic::Code::Internal,
            "other INTERNAL statuses stay"
        );

        let mut r = trailers_only(Status::not_found("n ".repeat(100_000)));
        guard_status(&mut r, "release", Instant::now(), &m);
        let s = Status::from_header_map(r.headers()).unwrap();
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert!(s.message().len() <= MAX_STATUS_MESSAGE_BYTES);
        assert!(r.headers().get(GRPC_MESSAGE).unwrap().len() < 4 * MAX_STATUS_MESSAGE_BYTES);
        assert_eq!(
            m.rpc_undecodable_requests
                .with_label_values(&["release"])
                .get(),
            0
        );
    }
}
