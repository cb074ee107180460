//! A Rust client for the Engine service: every RPC, with errors that never look like success.
//!
//! Status-bearing responses are checked: a non-OK gRPC status is [`ApiError::Rpc`], an
//! `ok = false` body or a missing status is [`ApiError::Rejected`]. `Release` returns an error
//! when the server rejects the lease (unknown, expired, released twice).

use std::path::Path;

use pb::engine_client::EngineClient as RawClient;
use pegaflow_proto as pb;
use tonic::transport::{Channel, Endpoint};

use crate::memfd::HostMemfd;
use crate::ApiError;

/// One layer of a native registration: its name and layout inside the single allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NativeLayer {
    /// Unique layer name.
    pub name: String,
    /// Blocks in the layer.
    pub num_blocks: u64,
    /// Bytes of one segment of one block.
    pub bytes_per_block: u64,
    /// Segments per block (1 or 2).
    pub segments: u32,
    /// K-to-V distance in bytes (0 with one segment).
    pub kv_stride_bytes: u64,
    /// Offset of block 0 inside the allocation, in bytes.
    pub offset_bytes: u64,
    /// Distance between consecutive blocks, in bytes.
    pub block_stride_bytes: u64,
}

impl NativeLayer {
    /// Bytes the layer's view spans from its block 0: the reach of its last block.
    pub fn span_bytes(&self) -> u64 {
        let extent = if self.segments == 2 && self.kv_stride_bytes > self.bytes_per_block {
            self.kv_stride_bytes + self.bytes_per_block
        } else {
            self.bytes_per_block * self.segments as u64
        };
        self.num_blocks.saturating_sub(1) * self.block_stride_bytes + extent
    }
}

/// What one worker registers natively: identity, topology and layers.
#[derive(Debug, Clone)]
pub struct NativeRegistration {
    /// Fresh per registration attempt; 1–128 characters of `[A-Za-z0-9_-]`.
    pub instance_id: String,
    /// Cache namespace (model + layout).
    pub namespace: String,
    /// This worker's TP rank.
    pub tp_rank: u32,
    /// TP degree of the instance.
    pub tp_size: u32,
    /// Workers in the instance (TP × PP).
    pub world_size: u32,
    /// This worker's PP rank.
    pub pp_rank: u32,
    /// Device id (for host memory, any non-negative id the worker owns).
    pub device_id: i32,
    /// The layers, in order.
    pub layers: Vec<NativeLayer>,
    /// Storage group of each layer (empty: all group 0).
    pub layer_group_ids: Vec<u32>,
    /// Store all of a block's layers of this worker as one page (one group only).
    pub page_first: bool,
}

impl NativeRegistration {
    /// The RegisterContextRequest for this registration, with the given memory kind and
    /// allocation size.
    pub fn to_request(&self, kind: pb::MemoryKind, alloc_size: u64) -> pb::RegisterContextRequest {
        let l = &self.layers;
        pb::RegisterContextRequest {
            instance_id: self.instance_id.clone(),
            namespace: self.namespace.clone(),
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            world_size: self.world_size,
            device_id: self.device_id,
            layer_names: l.iter().map(|x| x.name.clone()).collect(),
            wrapper_bytes: vec![],
            num_blocks: l.iter().map(|x| x.num_blocks).collect(),
            bytes_per_block: l.iter().map(|x| x.bytes_per_block).collect(),
            kv_stride_bytes: l.iter().map(|x| x.kv_stride_bytes).collect(),
            segments: l.iter().map(|x| x.segments).collect(),
            pp_rank: self.pp_rank,
            client_version: pb::NATIVE_CLIENT_VERSION.to_string(),
            transfer_mode: pb::TransferMode::Direct as i32,
            page_first: self.page_first,
            layer_group_ids: self.layer_group_ids.clone(),
            native_kv_tensors: l
                .iter()
                .map(|x| pb::NativeKvTensor {
                    offset_bytes: x.offset_bytes,
                    size_bytes: x.span_bytes(),
                    block_stride_bytes: x.block_stride_bytes,
                    allocation_index: 0,
                })
                .collect(),
            native_alloc_size: alloc_size,
            memory_kind: kind as i32,
            native_allocations: vec![],
        }
    }
}

/// The outcome of a QueryPrefetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryOutcome {
    /// The server is still promoting blocks from a lower tier; ask again with the same req_id.
    Loading,
    /// The answer: hit count, the lease pinning the hits (empty when 0), hit positions
    /// (membership queries).
    Ready {
        /// Blocks hit.
        num_hit_blocks: u64,
        /// The lease (16 bytes), empty when nothing hit.
        lease: Vec<u8>,
        /// Positions of the hits (membership queries, `group_id > 0`).
        hit_positions: Vec<u32>,
    },
}

/// How a Load reports its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadCompletion<'a> {
    /// Through the load-state word in the named shared-memory object (the Python client's
    /// `PyLoadState`); the RPC returns once the copy is submitted.
    StateWord(&'a str),
    /// The RPC returns when the copy is done (`wait_for_completion`, native clients).
    Wait,
}

/// A Load of one lease into one group of layers: the lease's block `i` goes to `targets[i]` in
/// every layer of `layer_names`; `None` skips that block.
pub fn single_group_load(
    instance_id: &str,
    tp_rank: u32,
    device_id: i32,
    layer_names: Vec<String>,
    lease: &[u8],
    targets: impl IntoIterator<Item = Option<u32>>,
    completion: LoadCompletion<'_>,
) -> pb::LoadRequest {
    let (load_state_shm, wait_for_completion) = match completion {
        LoadCompletion::StateWord(name) => (name.to_string(), false),
        LoadCompletion::Wait => (String::new(), true),
    };
    pb::LoadRequest {
        instance_id: instance_id.to_string(),
        tp_rank,
        device_id,
        load_state_shm,
        groups: vec![pb::LoadGroup { layer_names }],
        loads: vec![pb::LeaseLoad {
            lease: lease.to_vec(),
            block_ids_by_group: vec![pb::LoadBlockIds {
                targets: targets
                    .into_iter()
                    .map(|t| pb::LoadBlockTarget {
                        target: t.map(pb::load_block_target::Target::BlockId),
                    })
                    .collect(),
            }],
        }],
        wait_for_completion,
    }
}

fn check(rpc: &'static str, st: Option<pb::ResponseStatus>) -> Result<String, ApiError> {
    match st {
        Some(s) if s.ok => Ok(s.message),
        Some(s) => Err(ApiError::Rejected {
            rpc,
            message: s.message,
        }),
        None => Err(ApiError::Rejected {
            rpc,
            message: "response missing status".into(),
        }),
    }
}

fn rpc_err(rpc: &'static str) -> impl FnOnce(tonic::Status) -> ApiError {
    move |status| ApiError::Rpc { rpc, status }
}

/// A connected Engine client. Cheap to clone (one HTTP/2 connection, many streams).
#[derive(Debug, Clone)]
pub struct EngineClient {
    raw: RawClient<Channel>,
}

impl EngineClient {
    /// Connects to `endpoint` (`http://host:port`), with 64 MiB message limits.
    pub async fn connect(endpoint: &str) -> Result<Self, ApiError> {
        let ep = Endpoint::from_shared(endpoint.to_string()).map_err(|e| ApiError::Connect {
            endpoint: endpoint.to_string(),
            source: e,
        })?;
        let ch = ep
            .connect_timeout(std::time::Duration::from_secs(5))
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(32 << 20))
            .http2_keep_alive_interval(std::time::Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .connect()
            .await
            .map_err(|e| ApiError::Connect {
                endpoint: endpoint.to_string(),
                source: e,
            })?;
        Ok(Self::from_channel(ch))
    }

    /// Wraps an existing channel.
    pub fn from_channel(ch: Channel) -> Self {
        Self {
            raw: RawClient::new(ch)
                .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(pb::MAX_MESSAGE_BYTES),
        }
    }

    /// The generated client, for requests this wrapper does not shape.
    pub fn raw(&mut self) -> &mut RawClient<Channel> {
        &mut self.raw
    }

    /// Health: `Ok(fd_socket_path)` (empty when the side channel is off).
    pub async fn health(&mut self) -> Result<String, ApiError> {
        let r = self
            .raw
            .health(pb::HealthRequest {})
            .await
            .map_err(rpc_err("Health"))?
            .into_inner();
        check("Health", r.status)?;
        Ok(r.fd_socket_path)
    }

    /// RegisterContextBatch with a request built by the caller.
    pub async fn register(&mut self, req: pb::RegisterContextRequest) -> Result<(), ApiError> {
        let r = self
            .raw
            .register_context_batch(req)
            .await
            .map_err(rpc_err("RegisterContextBatch"))?
            .into_inner();
        check("RegisterContextBatch", r.status).map(drop)
    }

    /// Sends `memfd` on the side channel at `socket_path`, then registers `reg` over it
    /// (memory kind `HOST_MEMFD`, allocation size = the memfd's length).
    pub async fn register_host_memfd(
        &mut self,
        socket_path: &Path,
        reg: &NativeRegistration,
        memfd: &HostMemfd,
    ) -> Result<(), ApiError> {
        crate::fd::send_fd(socket_path, &reg.instance_id, reg.device_id, memfd.fd())?;
        self.register(reg.to_request(pb::MemoryKind::HostMemfd, memfd.len() as u64))
            .await
    }

    /// Save: `saves` = (layer name, block ids, block hashes).
    pub async fn save(
        &mut self,
        instance_id: &str,
        tp_rank: u32,
        pp_rank: u32,
        device_id: i32,
        saves: Vec<(String, Vec<u32>, Vec<Vec<u8>>)>,
    ) -> Result<(), ApiError> {
        let req = pb::SaveRequest {
            instance_id: instance_id.to_string(),
            tp_rank,
            pp_rank,
            device_id,
            saves: saves
                .into_iter()
                .map(|(layer_name, block_ids, block_hashes)| pb::SaveLayer {
                    layer_name,
                    block_ids,
                    block_hashes: block_hashes.into(),
                })
                .collect(),
        };
        let r = self
            .raw
            .save(req)
            .await
            .map_err(rpc_err("Save"))?
            .into_inner();
        check("Save", r.status).map(drop)
    }

    /// QueryPrefetch with every field.
    pub async fn query_full(
        &mut self,
        instance_id: &str,
        block_hashes: Vec<Vec<u8>>,
        req_id: &str,
        wait_for_full_prefix: bool,
        group_id: u32,
    ) -> Result<QueryOutcome, ApiError> {
        let r = self
            .raw
            .query_prefetch(pb::QueryRequest {
                instance_id: instance_id.to_string(),
                block_hashes,
                req_id: req_id.to_string(),
                wait_for_full_prefix,
                group_id,
            })
            .await
            .map_err(rpc_err("QueryPrefetch"))?
            .into_inner();
        match r.outcome {
            Some(pb::query_response::Outcome::Loading(_)) => Ok(QueryOutcome::Loading),
            Some(pb::query_response::Outcome::Ready(q)) => Ok(QueryOutcome::Ready {
                num_hit_blocks: q.num_hit_blocks,
                lease: q.lease,
                hit_positions: q.hit_positions,
            }),
            None => Err(ApiError::Rejected {
                rpc: "QueryPrefetch",
                message: "response missing outcome".into(),
            }),
        }
    }

    /// QueryPrefetch of a group-0 prefix.
    pub async fn query(
        &mut self,
        instance_id: &str,
        block_hashes: Vec<Vec<u8>>,
        req_id: &str,
    ) -> Result<QueryOutcome, ApiError> {
        self.query_full(instance_id, block_hashes, req_id, false, 0)
            .await
    }

    /// Load with a request built by the caller.
    pub async fn load(&mut self, req: pb::LoadRequest) -> Result<(), ApiError> {
        let r = self
            .raw
            .load(req)
            .await
            .map_err(rpc_err("Load"))?
            .into_inner();
        check("Load", r.status).map(drop)
    }

    /// Release a lease. An unknown, expired or already released lease is an error.
    pub async fn release(&mut self, lease: &[u8]) -> Result<(), ApiError> {
        self.raw
            .release(pb::ReleaseRequest {
                lease: lease.to_vec(),
            })
            .await
            .map_err(rpc_err("Release"))?;
        Ok(())
    }

    /// UnregisterContext.
    pub async fn unregister(&mut self, instance_id: &str) -> Result<(), ApiError> {
        let r = self
            .raw
            .unregister_context(pb::UnregisterRequest {
                instance_id: instance_id.to_string(),
            })
            .await
            .map_err(rpc_err("UnregisterContext"))?
            .into_inner();
        check("UnregisterContext", r.status).map(drop)
    }

    /// Flush: returns once every Save acknowledged before it is sealed and indexed.
    pub async fn flush(&mut self) -> Result<(), ApiError> {
        let r = self
            .raw
            .flush(pb::FlushRequest {})
            .await
            .map_err(rpc_err("Flush"))?
            .into_inner();
        check("Flush", r.status).map(drop)
    }

    /// Shutdown: asks the server to stop.
    pub async fn shutdown(&mut self) -> Result<(), ApiError> {
        let r = self
            .raw
            .shutdown(pb::ShutdownRequest {})
            .await
            .map_err(rpc_err("Shutdown"))?
            .into_inner();
        check("Shutdown", r.status).map(drop)
    }

    /// Opens the Session liveness stream. Keep the returned stream: dropping it ends the
    /// session, and the server then unregisters the instance.
    pub async fn session(
        &mut self,
        instance_id: &str,
        namespace: &str,
        tp_size: u32,
        world_size: u32,
    ) -> Result<tonic::Streaming<pb::SessionEvent>, ApiError> {
        Ok(self
            .raw
            .session(pb::SessionRequest {
                instance_id: instance_id.to_string(),
                namespace: namespace.to_string(),
                tp_size,
                world_size,
            })
            .await
            .map_err(rpc_err("Session"))?
            .into_inner())
    }
}
