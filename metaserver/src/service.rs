//! The `pegaflow.MetaServer` gRPC service over a [`Directory`]: request validation, the
//! calls, and the one mapping of [`DirectoryError`] to gRPC codes. It holds no directory
//! state.
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
//! One deliberate difference: an empty `node` is INVALID_ARGUMENT (`node cannot be empty`);
//! PegaFlow registers it as an address.

use std::sync::Arc;
use std::time::Instant;

use pegaflow_proto::meta_server_server::{MetaServer, MetaServerServer};
use pegaflow_proto::{
    HeartbeatNodeRequest, HeartbeatNodeResponse, InsertBlockHashesRequest,
    InsertBlockHashesResponse, NodePrefixResult, QueryPrefixBlocksRequest,
    QueryPrefixBlocksResponse, RemoveBlockHashesRequest, RemoveBlockHashesResponse, ResponseStatus,
    UnregisterNodeRequest, UnregisterNodeResponse,
};
use pegaflow_runtime::{Directory, DirectoryError, NodeId};
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;

/// The message of an Insert, Remove or query without hashes (PegaFlow's).
pub const EMPTY_HASHES: &str = "block_hashes cannot be empty";

/// The gRPC status of a directory error (the one place this mapping lives).
pub fn status_of(e: &DirectoryError) -> Status {
    match e {
        DirectoryError::UnknownNode(_) => Status::failed_precondition("unknown node"),
        DirectoryError::SessionConflict(_) => Status::failed_precondition("stale node session"),
        DirectoryError::Invalid(m) => Status::invalid_argument(m.clone()),
        DirectoryError::Unavailable(m) => {
            Status::unavailable(format!("directory unavailable: {m}"))
        }
    }
}

/// The node identity of a request: `node_id` parsed as a UUID and written in its canonical
/// hyphenated lower-case form, and a non-empty `node`.
///
/// # Errors
/// INVALID_ARGUMENT naming what is wrong.
pub fn node_of(node: &str, node_id: &str) -> Result<NodeId, Status> {
    let id = uuid::Uuid::parse_str(node_id)
        .map_err(|e| Status::invalid_argument(format!("invalid node_id: {e}")))?;
    if node.is_empty() {
        return Err(Status::invalid_argument("node cannot be empty"));
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

/// The service: a stateless front over `dir`.
pub struct MetaService {
    dir: Arc<dyn Directory>,
    metrics: Arc<Metrics>,
}

impl MetaService {
    /// A service answering from `dir`, counting into `metrics`.
    pub fn new(dir: Arc<dyn Directory>, metrics: Arc<Metrics>) -> Self {
        Self { dir, metrics }
    }

    /// The tonic service, accepting messages up to [`pegaflow_proto::MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> MetaServerServer<Self> {
        MetaServerServer::new(self)
            .max_decoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pegaflow_proto::MAX_MESSAGE_BYTES)
    }

    fn finish<T>(
        &self,
        method: &'static str,
        start: Instant,
        r: Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        let took = start.elapsed();
        self.metrics
            .observe_rpc(method, r.as_ref().err().map(Status::code), took);
        match &r {
            Ok(_) => tracing::debug!(method, took_us = took.as_micros() as u64, "rpc ok"),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                tracing::warn!(method, error = %s.message(), "rpc failed: directory unavailable")
            }
            Err(s) => {
                tracing::debug!(method, code = ?s.code(), error = %s.message(), "rpc refused")
            }
        }
        r.map(Response::new)
    }
}

#[tonic::async_trait]
impl MetaServer for MetaService {
    async fn heartbeat_node(
        &self,
        request: Request<HeartbeatNodeRequest>,
    ) -> Result<Response<HeartbeatNodeResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let req = request.into_inner();
            let node = node_of(&req.node, &req.node_id)?;
            let a = self.dir.heartbeat(&node).await.map_err(|e| status_of(&e))?;
            if a.state_lost {
                tracing::info!(node = %node.addr, session = %node.session, "node registered");
            }
            Ok(HeartbeatNodeResponse {
                stale_after_secs: a.stale_after.as_secs(),
            })
        }
        .await;
        self.finish("heartbeat_node", start, r)
    }

    async fn unregister_node(
        &self,
        request: Request<UnregisterNodeRequest>,
    ) -> Result<Response<UnregisterNodeResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let req = request.into_inner();
            let node = node_of(&req.node, &req.node_id)?;
            let removed = self.dir.unregister(&node).await.map_err(|e| status_of(&e))?;
            tracing::info!(node = %node.addr, session = %node.session, removed, "node unregistered");
            Ok(UnregisterNodeResponse {
                removed_owners: removed,
            })
        }
        .await;
        self.finish("unregister_node", start, r)
    }

    async fn insert_block_hashes(
        &self,
        request: Request<InsertBlockHashesRequest>,
    ) -> Result<Response<InsertBlockHashesResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let req = request.into_inner();
            if req.block_hashes.is_empty() {
                return Ok(InsertBlockHashesResponse {
                    status: empty_status(),
                    ..Default::default()
                });
            }
            let node = node_of(&req.node, &req.node_id)?;
            let a = self
                .dir
                .insert(&node, &req.namespace, &req.block_hashes)
                .await
                .map_err(|e| status_of(&e))?;
            Ok(InsertBlockHashesResponse {
                status: ok_status(),
                inserted_count: a.inserted,
                reclaimable_hashes: a.reclaimable,
            })
        }
        .await;
        self.finish("insert_block_hashes", start, r)
    }

    async fn remove_block_hashes(
        &self,
        request: Request<RemoveBlockHashesRequest>,
    ) -> Result<Response<RemoveBlockHashesResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let req = request.into_inner();
            if req.block_hashes.is_empty() {
                return Ok(RemoveBlockHashesResponse {
                    status: empty_status(),
                    removed_count: 0,
                });
            }
            let node = node_of(&req.node, &req.node_id)?;
            let removed = self
                .dir
                .remove(&node, &req.namespace, &req.block_hashes)
                .await
                .map_err(|e| status_of(&e))?;
            Ok(RemoveBlockHashesResponse {
                status: ok_status(),
                removed_count: removed,
            })
        }
        .await;
        self.finish("remove_block_hashes", start, r)
    }

    async fn query_prefix_blocks(
        &self,
        request: Request<QueryPrefixBlocksRequest>,
    ) -> Result<Response<QueryPrefixBlocksResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let req = request.into_inner();
            if req.block_hashes.is_empty() {
                return Err(Status::invalid_argument(EMPTY_HASHES));
            }
            let nodes = self
                .dir
                .query_prefix(
                    &req.namespace,
                    &req.block_hashes,
                    Some(req.exclude_node.as_str()).filter(|x| !x.is_empty()),
                )
                .await
                .map_err(|e| status_of(&e))?;
            Ok(QueryPrefixBlocksResponse {
                nodes: nodes
                    .into_iter()
                    .map(|n| NodePrefixResult {
                        node: n.node,
                        prefix_len: n.prefix_len,
                    })
                    .collect(),
            })
        }
        .await;
        self.finish("query_prefix_blocks", start, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pegaflow_directory::memory::{MemoryConfig, MemoryDirectory};

    fn service() -> MetaService {
        MetaService::new(
            Arc::new(MemoryDirectory::new(&MemoryConfig::default())),
            Arc::new(Metrics::new(true)),
        )
    }

    #[test]
    fn node_ids_are_uuids_in_any_form() {
        let id = "b49483d3-55ab-4378-a3e1-db19516ed766";
        for form in [
            id.to_string(),
            id.to_uppercase(),
            id.replace('-', ""),
            format!("urn:uuid:{id}"),
            format!("{{{id}}}"),
        ] {
            assert_eq!(node_of("n:1", &form).unwrap().session, id, "{form}");
        }
        let e = node_of("n:1", "").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().starts_with("invalid node_id: "),
            "{}",
            e.message()
        );
        assert_eq!(
            node_of("", id).unwrap_err().message(),
            "node cannot be empty"
        );
    }

    #[test]
    fn errors_map_to_pegaflows_codes() {
        let s = status_of(&DirectoryError::UnknownNode("a".into()));
        assert_eq!(
            (s.code(), s.message()),
            (tonic::Code::FailedPrecondition, "unknown node")
        );
        let s = status_of(&DirectoryError::SessionConflict("a".into()));
        assert_eq!(
            (s.code(), s.message()),
            (tonic::Code::FailedPrecondition, "stale node session")
        );
        assert_eq!(
            status_of(&DirectoryError::Unavailable("down".into())).code(),
            tonic::Code::Unavailable
        );
        assert_eq!(
            status_of(&DirectoryError::Invalid("x".into())).code(),
            tonic::Code::InvalidArgument
        );
    }

    #[tokio::test]
    async fn empty_batches_answer_a_status_not_an_error() {
        let s = service();
        let r = s
            .insert_block_hashes(Request::new(InsertBlockHashesRequest {
                namespace: "ns".into(),
                block_hashes: vec![],
                node: "n:1".into(),
                node_id: "not even a uuid".into(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, empty_status());
        let r = s
            .remove_block_hashes(Request::new(RemoveBlockHashesRequest::default()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, empty_status());
        let e = s
            .query_prefix_blocks(Request::new(QueryPrefixBlocksRequest::default()))
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (tonic::Code::InvalidArgument, EMPTY_HASHES)
        );
    }

    #[tokio::test]
    async fn a_round_trip() {
        let s = service();
        let id = uuid::Uuid::new_v4().to_string();
        let hb = s
            .heartbeat_node(Request::new(HeartbeatNodeRequest {
                node: "10.0.0.1:50055".into(),
                node_id: id.to_uppercase(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(hb.stale_after_secs, 30);
        let ins = s
            .insert_block_hashes(Request::new(InsertBlockHashesRequest {
                namespace: "ns".into(),
                block_hashes: vec![vec![1], vec![2]],
                node: "10.0.0.1:50055".into(),
                node_id: id.replace('-', ""),
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((ins.status, ins.inserted_count), (ok_status(), 2));
        let q = s
            .query_prefix_blocks(Request::new(QueryPrefixBlocksRequest {
                namespace: "ns".into(),
                block_hashes: vec![vec![1], vec![2], vec![3]],
                exclude_node: String::new(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            q.nodes,
            vec![NodePrefixResult {
                node: "10.0.0.1:50055".into(),
                prefix_len: 2
            }]
        );
        let un = s
            .unregister_node(Request::new(UnregisterNodeRequest {
                node: "10.0.0.1:50055".into(),
                node_id: id.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(un.removed_owners, 2);
        let e = s
            .unregister_node(Request::new(UnregisterNodeRequest {
                node: "10.0.0.1:50055".into(),
                node_id: id,
            }))
            .await
            .unwrap_err();
        assert_eq!(e.message(), "unknown node");
        assert!(s.metrics.render().contains(
            "pegaflow_metaserver_rpc_requests_total{method=\"unregister_node\",status=\"The system is not in a state required for the operation's execution\"} 1"
        ));
    }
}
