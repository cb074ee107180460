//! The `pegaflow.MetaServer` calls over a [`Directory`]: decoding and validating requests,
//! running them (large ones off the async workers), and the one mapping of every refusal to a
//! gRPC status, a metric and a rate-limited log line. It holds no directory state.
//!
//! What it answers, as PegaFlow 0.25.1's `pegaflow-metaserver` answers (checked by the
//! differential test in `tests/differential.rs`):
//! - `node_id` must parse as a UUID (any of its text forms: hyphenated, simple, braced,
//!   `urn:uuid:`; compared as UUIDs, so the form does not matter), else INVALID_ARGUMENT
//!   `invalid node_id: <why>`;
//! - Insert and Remove with no hash answer OK with `status.ok = false` and the message
//!   `block_hashes cannot be empty` (before any other check); an empty query is
//!   INVALID_ARGUMENT with the same message;
//! - an address nobody registered: FAILED_PRECONDITION `unknown node`; an address held by
//!   another session: FAILED_PRECONDITION `stale node session` (the heartbeat of a second
//!   live session too);
//! - a backend that cannot reach its store: UNAVAILABLE.
//!
//! Where it differs, deliberately:
//! - an empty `node` is INVALID_ARGUMENT (`node cannot be empty`); PegaFlow registers it;
//! - every field is bounded with the storage server's limits ([`pegaflow_directory::limits`]):
//!   INVALID_ARGUMENT naming the field and the limit (`namespace is 1048576 bytes; the limit
//!   is 1024 bytes`), no client string echoed; PegaFlow stores whatever it gets;
//! - a body that does not decode is INVALID_ARGUMENT (`undecodable <method> request: ...`);
//!   tonic, and PegaFlow, answer INTERNAL;
//! - a cap reached (registered nodes, one node's entries, the store's bytes, or too many
//!   large requests waiting) is RESOURCE_EXHAUSTED with the figures;
//! - a query's answer has at most [`MAX_PLAN_SEGMENTS`] segments.
//!
//! Large requests (a body over [`INLINE_BODY_BYTES`], and every unregister, which scans the
//! store) are decoded, run and answered on a blocking thread, at most [`heavy_slots`] at a
//! time; the others wait (at most [`MAX_WAITING_BYTES`] of bodies, then RESOURCE_EXHAUSTED
//! `busy`). Heartbeats and small queries stay on the async workers and are not held up by a
//! million-hash query.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_directory::limits::{self, echo, FieldError, MAX_PLAN_SEGMENTS};
use pegaflow_plugin::{Directory, DirectoryError, NodeId};
use pegaflow_proto::{
    HeartbeatNodeRequest, HeartbeatNodeResponse, InsertBlockHashesRequest,
    InsertBlockHashesResponse, NodePrefixResult, QueryPrefixBlocksRequest,
    QueryPrefixBlocksResponse, RemoveBlockHashesRequest, RemoveBlockHashesResponse, ResponseStatus,
    UnregisterNodeRequest, UnregisterNodeResponse,
};
use prost::bytes::Bytes;
use prost::Message;
use tonic::Status;

use crate::metrics::Metrics;
use crate::throttle::Throttle;

/// The message of an Insert, Remove or query without hashes (PegaFlow's).
pub const EMPTY_HASHES: &str = "block_hashes cannot be empty";

/// Bodies up to this size are handled on the async worker that received them (about 1,800
/// 32-byte hashes; a heartbeat is under 300 bytes).
pub const INLINE_BODY_BYTES: usize = 64 << 10;

/// Bodies of large requests waiting for a blocking slot, at most (one always may wait).
pub const MAX_WAITING_BYTES: u64 = 256 << 20;

/// Large requests run at once: one fewer than the CPUs (at least one), so that the async
/// workers keep a CPU for heartbeats.
pub fn heavy_slots() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get().saturating_sub(1))
        .max(1)
}

/// The RPCs of the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `HeartbeatNode`.
    Heartbeat,
    /// `UnregisterNode`.
    Unregister,
    /// `InsertBlockHashes`.
    Insert,
    /// `RemoveBlockHashes`.
    Remove,
    /// `QueryPrefixBlocks`.
    Query,
}

impl Method {
    /// Every method.
    pub const ALL: [Method; 5] = [
        Method::Heartbeat,
        Method::Unregister,
        Method::Insert,
        Method::Remove,
        Method::Query,
    ];

    /// The method of a request path (`/pegaflow.MetaServer/<Name>`).
    pub fn from_path(path: &str) -> Option<Self> {
        let name = path.strip_prefix("/pegaflow.MetaServer/")?;
        Self::ALL.into_iter().find(|m| m.rpc_name() == name)
    }

    /// The RPC's name on the wire.
    pub fn rpc_name(self) -> &'static str {
        match self {
            Method::Heartbeat => "HeartbeatNode",
            Method::Unregister => "UnregisterNode",
            Method::Insert => "InsertBlockHashes",
            Method::Remove => "RemoveBlockHashes",
            Method::Query => "QueryPrefixBlocks",
        }
    }

    /// The metric label (PegaFlow's: the RPC in snake case).
    pub fn label(self) -> &'static str {
        match self {
            Method::Heartbeat => "heartbeat_node",
            Method::Unregister => "unregister_node",
            Method::Insert => "insert_block_hashes",
            Method::Remove => "remove_block_hashes",
            Method::Query => "query_prefix_blocks",
        }
    }
}

/// Why a call was not answered OK.
#[derive(Debug)]
pub enum Failure {
    /// The body is not a message of the method's type (INVALID_ARGUMENT).
    Undecodable(String),
    /// A field past its bound or malformed (INVALID_ARGUMENT).
    Field(FieldError),
    /// The directory refused or failed.
    Directory(DirectoryError),
    /// Too many large requests wait (RESOURCE_EXHAUSTED).
    Busy(String),
    /// A status built where it arose (the empty-query message, a failed blocking task).
    Status(Status),
}

impl From<FieldError> for Failure {
    fn from(e: FieldError) -> Self {
        Failure::Field(e)
    }
}

impl From<DirectoryError> for Failure {
    fn from(e: DirectoryError) -> Self {
        Failure::Directory(e)
    }
}

/// The gRPC status of a directory error.
pub fn status_of(e: &DirectoryError) -> Status {
    match e {
        DirectoryError::UnknownNode(_) => Status::failed_precondition("unknown node"),
        DirectoryError::SessionConflict(_) => Status::failed_precondition("stale node session"),
        DirectoryError::Invalid(m) => Status::invalid_argument(m.clone()),
        DirectoryError::Unavailable(m) => {
            Status::unavailable(format!("directory unavailable: {m}"))
        }
        DirectoryError::LimitReached { message, .. } => Status::resource_exhausted(message.clone()),
    }
}

impl Failure {
    /// The status answered (the one mapping of failures to gRPC codes).
    pub fn status(&self) -> Status {
        match self {
            Failure::Undecodable(m) => Status::invalid_argument(m.clone()),
            Failure::Field(e) => Status::invalid_argument(e.message.clone()),
            Failure::Directory(e) => status_of(e),
            Failure::Busy(m) => Status::resource_exhausted(m.clone()),
            Failure::Status(s) => s.clone(),
        }
    }
}

/// The node identity of a request: `node` and `node_id` within their bounds, `node_id`
/// parsed as a UUID and written in its canonical hyphenated lower-case form, `node` not
/// empty.
///
/// # Errors
/// A [`FieldError`] naming what is wrong.
pub fn node_of(node: &str, node_id: &str) -> Result<NodeId, FieldError> {
    limits::check_addr("node", node)?;
    limits::check_session(node_id)?;
    let id = uuid::Uuid::parse_str(node_id).map_err(|e| FieldError {
        field: "node_id",
        message: format!("invalid node_id: {e}"),
    })?;
    if node.is_empty() {
        return Err(FieldError {
            field: "node",
            message: "node cannot be empty".into(),
        });
    }
    Ok(NodeId {
        addr: node.to_owned(),
        session: id.hyphenated().to_string(),
    })
}

fn ok_status() -> Option<ResponseStatus> {
    Some(ResponseStatus {
        ok: true,
        message: String::new(),
    })
}

fn empty_status() -> Option<ResponseStatus> {
    Some(ResponseStatus {
        ok: false,
        message: EMPTY_HASHES.into(),
    })
}

fn decode<T: Message + Default>(method: Method, body: &Bytes) -> Result<T, Failure> {
    T::decode(body.clone())
        .map_err(|e| Failure::Undecodable(format!("undecodable {} request: {e}", method.label())))
}

/// What a call that succeeded tells the log and the metrics.
enum Event {
    None,
    Registered(NodeId),
    Unregistered(NodeId, u64),
    /// A query answered a plan cut at [`MAX_PLAN_SEGMENTS`].
    PlanCut,
}

/// Log lines a client can cause, each rate limited.
struct Logs {
    refused: Throttle,
    unavailable: Throttle,
    nodes: Throttle,
}

/// The service: a stateless front over `dir`.
pub struct MetaService {
    dir: Arc<dyn Directory>,
    metrics: Arc<Metrics>,
    heavy: Arc<tokio::sync::Semaphore>,
    waiting_bytes: AtomicU64,
    max_waiting_bytes: u64,
    logs: Logs,
}

impl MetaService {
    /// A service answering from `dir`, counting into `metrics`, running at most
    /// [`heavy_slots`] large requests at once with at most [`MAX_WAITING_BYTES`] of others
    /// waiting.
    pub fn new(dir: Arc<dyn Directory>, metrics: Arc<Metrics>) -> Self {
        Self::with_heavy_limits(dir, metrics, heavy_slots(), MAX_WAITING_BYTES)
    }

    /// As [`MetaService::new`], with `slots` large requests at once and at most
    /// `max_waiting_bytes` of bodies waiting.
    pub fn with_heavy_limits(
        dir: Arc<dyn Directory>,
        metrics: Arc<Metrics>,
        slots: usize,
        max_waiting_bytes: u64,
    ) -> Self {
        Self {
            dir,
            metrics,
            heavy: Arc::new(tokio::sync::Semaphore::new(slots.max(1))),
            waiting_bytes: AtomicU64::new(0),
            max_waiting_bytes,
            logs: Logs {
                refused: Throttle::new(Duration::from_secs(10), 5),
                unavailable: Throttle::new(Duration::from_secs(10), 1),
                nodes: Throttle::new(Duration::from_secs(10), 20),
            },
        }
    }

    /// The families it counts into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Answers one call: `body` is the request message's encoding, the answer the
    /// response's. `peer` is the client's address, for the log.
    pub async fn handle(
        self: &Arc<Self>,
        method: Method,
        body: Bytes,
        peer: Option<SocketAddr>,
    ) -> Result<Bytes, Status> {
        let start = Instant::now();
        let heavy = method == Method::Unregister || body.len() > INLINE_BODY_BYTES;
        let r = if heavy {
            self.offload(method, body).await
        } else {
            run(self.dir.as_ref(), method, body).await
        };
        self.finish(method, start, peer, r)
    }

    /// Runs a large call on a blocking thread once a slot is free.
    async fn offload(
        self: &Arc<Self>,
        method: Method,
        body: Bytes,
    ) -> Result<(Bytes, Event), Failure> {
        let len = body.len() as u64;
        let before = self.waiting_bytes.fetch_add(len, Ordering::Relaxed);
        if before > 0 && before + len > self.max_waiting_bytes {
            self.waiting_bytes.fetch_sub(len, Ordering::Relaxed);
            return Err(Failure::Busy(format!(
                "the MetaServer is busy: {before} bytes of large requests are waiting; the \
                 limit is {} bytes; retry later",
                self.max_waiting_bytes
            )));
        }
        self.metrics.waiting_bytes.add(len as i64);
        let permit = self.heavy.clone().acquire_owned().await;
        self.waiting_bytes.fetch_sub(len, Ordering::Relaxed);
        self.metrics.waiting_bytes.sub(len as i64);
        let Ok(permit) = permit else {
            return Err(Failure::Status(Status::unavailable("shutting down")));
        };
        self.metrics
            .offloaded
            .with_label_values(&[method.label()])
            .inc();
        let dir = self.dir.clone();
        let rt = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _slot = permit;
            rt.block_on(run(dir.as_ref(), method, body))
        })
        .await
        .unwrap_or_else(|e| {
            Err(Failure::Status(Status::internal(format!(
                "{} failed: {e}",
                method.label()
            ))))
        })
    }

    /// Counts and logs the outcome, and answers it.
    fn finish(
        &self,
        method: Method,
        start: Instant,
        peer: Option<SocketAddr>,
        r: Result<(Bytes, Event), Failure>,
    ) -> Result<Bytes, Status> {
        let took = start.elapsed();
        let peer = peer.map_or_else(|| "unknown".to_string(), |p| p.to_string());
        match r {
            Ok((answer, event)) => {
                self.metrics.observe_rpc(method.label(), None, took);
                tracing::debug!(
                    method = method.label(),
                    took_us = took.as_micros() as u64,
                    "rpc ok"
                );
                match event {
                    Event::None => {}
                    Event::Registered(n) => {
                        if let Some(held) = self.logs.nodes.admit() {
                            tracing::info!(node = %echo(&n.addr), session = %n.session, %peer,
                                suppressed = held, "node registered");
                        }
                    }
                    Event::Unregistered(n, removed) => {
                        if let Some(held) = self.logs.nodes.admit() {
                            tracing::info!(node = %echo(&n.addr), session = %n.session, removed,
                                %peer, suppressed = held, "node unregistered");
                        }
                    }
                    Event::PlanCut => self.metrics.query_answers_cut.inc(),
                }
                Ok(answer)
            }
            Err(f) => {
                let status = f.status();
                self.count_failure(method, &f);
                self.metrics
                    .observe_rpc(method.label(), Some(status.code()), took);
                self.log_failure(method, &peer, &f, &status);
                Err(status)
            }
        }
    }

    /// Counts and logs a call tonic answered before [`MetaService::handle`] ran (a message
    /// over the size limit, or a body it could not take apart: `undecodable`).
    pub fn refused_before(
        &self,
        method: Method,
        status: &Status,
        took: Duration,
        undecodable: bool,
    ) {
        if undecodable {
            self.metrics.invalid(method.label(), "body");
        }
        self.metrics
            .observe_rpc(method.label(), Some(status.code()), took);
        if let Some(held) = self.logs.refused.admit() {
            let m = method.label();
            tracing::warn!(method = m, code = ?status.code(), suppressed = held,
                "rpc {m} refused: {}", status.message());
        }
    }

    /// The failure counters.
    fn count_failure(&self, method: Method, f: &Failure) {
        match f {
            Failure::Undecodable(_) => self.metrics.invalid(method.label(), "body"),
            Failure::Field(e) => self.metrics.invalid(method.label(), e.field),
            Failure::Directory(DirectoryError::LimitReached { limit, .. }) => {
                self.metrics.limit_refused(limit)
            }
            Failure::Busy(_) => self.metrics.limit_refused("busy"),
            _ => {}
        }
    }

    /// A failure's log line, rate limited: refusals a client caused (bad input, a cap) and
    /// an unreachable directory warn; the others (unknown node, stale session) are debug.
    fn log_failure(&self, method: Method, peer: &str, f: &Failure, status: &Status) {
        let m = method.label();
        match f {
            Failure::Undecodable(_)
            | Failure::Field(_)
            | Failure::Busy(_)
            | Failure::Directory(DirectoryError::LimitReached { .. }) => {
                if let Some(held) = self.logs.refused.admit() {
                    tracing::warn!(method = m, %peer, code = ?status.code(), suppressed = held,
                        "rpc {m} refused: {}", status.message());
                }
            }
            Failure::Directory(DirectoryError::Unavailable(_)) => {
                if let Some(held) = self.logs.unavailable.admit() {
                    tracing::warn!(method = m, error = %status.message(), suppressed = held,
                        "rpc failed: directory unavailable");
                }
            }
            _ => tracing::debug!(method = m, %peer, code = ?status.code(),
                error = %status.message(), "rpc refused"),
        }
    }
}

/// Decodes, checks and runs one call.
async fn run(dir: &dyn Directory, method: Method, body: Bytes) -> Result<(Bytes, Event), Failure> {
    match method {
        Method::Heartbeat => {
            let req: HeartbeatNodeRequest = decode(method, &body)?;
            drop(body);
            let node = node_of(&req.node, &req.node_id)?;
            let a = dir.heartbeat(&node).await?;
            let answer = HeartbeatNodeResponse {
                stale_after_secs: a.stale_after.as_secs(),
            };
            let event = if a.state_lost {
                Event::Registered(node)
            } else {
                Event::None
            };
            Ok((answer.encode_to_vec().into(), event))
        }
        Method::Unregister => {
            let req: UnregisterNodeRequest = decode(method, &body)?;
            drop(body);
            let node = node_of(&req.node, &req.node_id)?;
            let removed = dir.unregister(&node).await?;
            let answer = UnregisterNodeResponse {
                removed_owners: removed,
            };
            Ok((
                answer.encode_to_vec().into(),
                Event::Unregistered(node, removed),
            ))
        }
        Method::Insert => {
            let req: InsertBlockHashesRequest = decode(method, &body)?;
            drop(body);
            if req.block_hashes.is_empty() {
                let answer = InsertBlockHashesResponse {
                    status: empty_status(),
                    ..Default::default()
                };
                return Ok((answer.encode_to_vec().into(), Event::None));
            }
            let node = node_of(&req.node, &req.node_id)?;
            limits::check_namespace(&req.namespace)?;
            limits::check_hashes(&req.block_hashes)?;
            let a = dir.insert(&node, &req.namespace, &req.block_hashes).await?;
            drop(req);
            let answer = InsertBlockHashesResponse {
                status: ok_status(),
                inserted_count: a.inserted,
                reclaimable_hashes: a.reclaimable,
            };
            Ok((answer.encode_to_vec().into(), Event::None))
        }
        Method::Remove => {
            let req: RemoveBlockHashesRequest = decode(method, &body)?;
            drop(body);
            if req.block_hashes.is_empty() {
                let answer = RemoveBlockHashesResponse {
                    status: empty_status(),
                    removed_count: 0,
                };
                return Ok((answer.encode_to_vec().into(), Event::None));
            }
            let node = node_of(&req.node, &req.node_id)?;
            limits::check_namespace(&req.namespace)?;
            limits::check_hashes(&req.block_hashes)?;
            let removed = dir.remove(&node, &req.namespace, &req.block_hashes).await?;
            let answer = RemoveBlockHashesResponse {
                status: ok_status(),
                removed_count: removed,
            };
            Ok((answer.encode_to_vec().into(), Event::None))
        }
        Method::Query => {
            let req: QueryPrefixBlocksRequest = decode(method, &body)?;
            drop(body);
            if req.block_hashes.is_empty() {
                return Err(Failure::Status(Status::invalid_argument(EMPTY_HASHES)));
            }
            limits::check_namespace(&req.namespace)?;
            limits::check_hashes(&req.block_hashes)?;
            let exclude = Some(req.exclude_node.as_str()).filter(|x| !x.is_empty());
            limits::check_exclude(exclude)?;
            let nodes = dir
                .query_prefix(&req.namespace, &req.block_hashes, exclude)
                .await?;
            drop(req);
            // A cut plan is the only one this long (the backends stop there).
            let event = if nodes.len() >= MAX_PLAN_SEGMENTS {
                Event::PlanCut
            } else {
                Event::None
            };
            let answer = QueryPrefixBlocksResponse {
                nodes: nodes
                    .into_iter()
                    .take(MAX_PLAN_SEGMENTS)
                    .map(|n| NodePrefixResult {
                        node: n.node,
                        prefix_len: n.prefix_len,
                    })
                    .collect(),
            };
            Ok((answer.encode_to_vec().into(), event))
        }
    }
}

#[cfg(test)]
mod tests;
