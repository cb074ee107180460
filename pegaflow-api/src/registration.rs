//! Native registration v2 (`client_version` `0.25.1+native-v2`, `docs/NATIVE.md`): a
//! registration of many allocations, each layer (arena) a strided view into one of them, and a
//! [`Client`] that several rank-local instances share.
//!
//! - [`RegistrationBuilder`] collects allocations (host memfds, CUDA VMM allocations, IPC
//!   exportable `cuMemAlloc` memory: anything implementing [`NativeAllocation`]) and tensors
//!   (name, allocation, offset, block count, block bytes, block stride) and checks them the
//!   way the server does ([`RegistrationBuilder::check`]), so a bad registration fails here
//!   with nothing sent.
//! - [`Client::connect`] opens one gRPC channel and learns the side channel's path; every
//!   [`Client::register`] mints a fresh instance id `<base>-<32 hex>`, opens that instance's
//!   Session, sends each fd allocation on the side channel (allocation `i` keyed
//!   `instance_id \0 device_id \0 i`, at most [`SIDE_CHANNEL_CONNECTIONS`] connections of the
//!   client at a time, whichever instance sends), then calls RegisterContextBatch.
//! - [`NativeInstance`] saves and loads whole blocks (every layer with the same block ids:
//!   the server refuses anything less for v2), and [`NativeInstance::unregister`] flushes the
//!   saves it submitted before it unregisters.
//!
//! The client's memory must stay allocated until the instance is unregistered (the server
//! copies into and out of it until then).

use std::collections::HashSet;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::Arc;

use pegaflow_proto as pb;
use tokio::sync::Semaphore;

use crate::client::{EngineClient, QueryOutcome};
use crate::{ApiError, KvLayout};

/// Side-channel connections one [`Client`] opens at once, over all its instances.
pub const SIDE_CHANNEL_CONNECTIONS: usize = 4;

/// Most allocations, and most tensors, of one registration (the server's limit).
pub const MAX_REGISTRATION_ENTRIES: usize = 4096;

/// Longest layer name, in bytes (the server's limit).
pub const MAX_LAYER_NAME_BYTES: usize = 256;

/// One allocation a native v2 registration hands to the server.
///
/// Fd kinds ([`pb::MemoryKind::HostMemfd`], [`pb::MemoryKind::CudaVmm`]) return their
/// descriptor from [`NativeAllocation::export_fd`]; CUDA IPC memory
/// ([`pb::MemoryKind::CudaIpc`]) returns its 64-byte handle from
/// [`NativeAllocation::ipc_handle`].
pub trait NativeAllocation: Send + Sync {
    /// What kind of memory it is.
    fn memory_kind(&self) -> pb::MemoryKind;
    /// Its size in bytes (a VMM allocation: granularity-aligned; IPC: the allocation's whole
    /// size as `cuMemGetAddressRange` reports it).
    fn size_bytes(&self) -> u64;
    /// The descriptor sent on the side channel (fd kinds); the caller keeps its own.
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// The raw `CUipcMemHandle` (CUDA IPC kind).
    fn ipc_handle(&self) -> Option<[u8; pb::CUDA_IPC_HANDLE_BYTES]> {
        None
    }
}

impl NativeAllocation for crate::memfd::HostMemfd {
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::HostMemfd
    }
    fn size_bytes(&self) -> u64 {
        self.len() as u64
    }
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd())
    }
}

#[cfg(feature = "cuda")]
impl NativeAllocation for crate::vmm::VmmAllocation {
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::CudaVmm
    }
    fn size_bytes(&self) -> u64 {
        self.len() as u64
    }
    fn export_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd())
    }
}

/// Which allocation of a [`RegistrationBuilder`] a tensor lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocationId(pub usize);

/// One layer (arena) of a native v2 registration: a strided view into one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Unique, non-empty layer name (at most [`MAX_LAYER_NAME_BYTES`] bytes).
    pub name: String,
    /// The allocation it lives in.
    pub allocation: AllocationId,
    /// Byte offset of block 0 from the allocation's start.
    pub offset_bytes: u64,
    /// Blocks in the layer (> 0).
    pub num_blocks: u64,
    /// Bytes of one segment of one block (> 0).
    pub bytes_per_block: u64,
    /// Segments per block: 1 (`[K|V]` or one MLA page) or 2 (K and V apart).
    pub segments: u32,
    /// K-to-V distance in bytes (0 with one segment).
    pub kv_stride_bytes: u64,
    /// Byte distance from block i to block i + 1 (≥ the block's extent).
    pub block_stride_bytes: u64,
}

impl TensorSpec {
    /// The bytes the view spans from its block 0: the reach of its last block.
    pub fn span_bytes(&self) -> Option<u64> {
        let extent = if self.segments == 2 && self.kv_stride_bytes > self.bytes_per_block {
            self.kv_stride_bytes.checked_add(self.bytes_per_block)?
        } else {
            self.bytes_per_block.checked_mul(self.segments as u64)?
        };
        self.num_blocks
            .checked_sub(1)?
            .checked_mul(self.block_stride_bytes)?
            .checked_add(extent)
    }
}

/// A native v2 registration under construction: allocations plus one tensor per layer.
///
/// ```no_run
/// # use pegaflow_api::registration::RegistrationBuilder;
/// # use pegaflow_api::memfd::HostMemfd;
/// // Two arenas of 10 blocks, 41,984 and 8,448 bytes per block, each its own memfd.
/// let mla = HostMemfd::new("mla", 10 * 41_984).unwrap();
/// let idx = HostMemfd::new("idx", 10 * 8_448).unwrap();
/// let mut b = RegistrationBuilder::new(0);
/// let a = b.allocation(&mla);
/// let i = b.allocation(&idx);
/// b.contiguous_tensor("L0.mla", a, 0, 10, 41_984)
///     .contiguous_tensor("L0.idxk", i, 0, 10, 8_448);
/// b.check().unwrap();
/// ```
pub struct RegistrationBuilder<'a> {
    device_id: i32,
    allocations: Vec<&'a dyn NativeAllocation>,
    tensors: Vec<TensorSpec>,
    page_first: bool,
}

impl std::fmt::Debug for RegistrationBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationBuilder")
            .field("device_id", &self.device_id)
            .field("allocations", &self.allocations.len())
            .field("tensors", &self.tensors.len())
            .field("page_first", &self.page_first)
            .finish()
    }
}

impl<'a> RegistrationBuilder<'a> {
    /// An empty registration of the worker on device `device_id` (for host memory: any
    /// non-negative id the worker owns).
    pub fn new(device_id: i32) -> Self {
        Self {
            device_id,
            allocations: Vec::new(),
            tensors: Vec::new(),
            page_first: false,
        }
    }

    /// Adds an allocation; tensors refer to it by the returned id. All allocations of one
    /// registration must be of one memory kind.
    pub fn allocation(&mut self, a: &'a dyn NativeAllocation) -> AllocationId {
        self.allocations.push(a);
        AllocationId(self.allocations.len() - 1)
    }

    /// Adds a layer whose blocks are one contiguous segment each (`segments = 1`), starting
    /// `offset_bytes` into `allocation`, `block_stride_bytes` apart.
    pub fn tensor(
        &mut self,
        name: &str,
        allocation: AllocationId,
        offset_bytes: u64,
        num_blocks: u64,
        bytes_per_block: u64,
        block_stride_bytes: u64,
    ) -> &mut Self {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            allocation,
            offset_bytes,
            num_blocks,
            bytes_per_block,
            segments: 1,
            kv_stride_bytes: 0,
            block_stride_bytes,
        });
        self
    }

    /// [`Self::tensor`] with stride = block bytes (a densely packed arena).
    pub fn contiguous_tensor(
        &mut self,
        name: &str,
        allocation: AllocationId,
        offset_bytes: u64,
        num_blocks: u64,
        bytes_per_block: u64,
    ) -> &mut Self {
        self.tensor(
            name,
            allocation,
            offset_bytes,
            num_blocks,
            bytes_per_block,
            bytes_per_block,
        )
    }

    /// Adds a layer with every field given.
    pub fn tensor_spec(&mut self, spec: TensorSpec) -> &mut Self {
        self.tensors.push(spec);
        self
    }

    /// Stores all of a block's layers of this worker as one host page.
    pub fn page_first(&mut self, on: bool) -> &mut Self {
        self.page_first = on;
        self
    }

    /// The device id.
    pub fn device_id(&self) -> i32 {
        self.device_id
    }

    /// The tensors, in registration order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The memory kind of the allocations (of the first; [`Self::check`] requires them all
    /// equal). `None` without allocations.
    pub fn memory_kind(&self) -> Option<pb::MemoryKind> {
        self.allocations.first().map(|a| a.memory_kind())
    }

    /// Checks the registration as the server will: at least one allocation and one tensor,
    /// at most [`MAX_REGISTRATION_ENTRIES`] of each; every allocation of one kind, non-empty,
    /// carrying a descriptor (fd kinds) or a distinct IPC handle (CUDA IPC), and used by a
    /// tensor; device id ≥ 0; tensor names non-empty, distinct, at most
    /// [`MAX_LAYER_NAME_BYTES`]; every tensor's layout valid (non-zero sizes, 1 or 2 segments,
    /// blocks that do not overlap) and inside its allocation.
    ///
    /// Errors: [`ApiError::InvalidArgument`] naming the offending entry.
    pub fn check(&self) -> Result<(), ApiError> {
        let bad = |m: String| Err(ApiError::InvalidArgument(m));
        if self.device_id < 0 {
            return bad(format!("device_id must be >= 0, got {}", self.device_id));
        }
        if self.allocations.is_empty() {
            return bad("a registration needs at least one allocation".into());
        }
        if self.tensors.is_empty() {
            return bad("a registration needs at least one tensor".into());
        }
        if self.allocations.len() > MAX_REGISTRATION_ENTRIES
            || self.tensors.len() > MAX_REGISTRATION_ENTRIES
        {
            return bad(format!(
                "{} allocations and {} tensors; the limit is {MAX_REGISTRATION_ENTRIES} of each",
                self.allocations.len(),
                self.tensors.len()
            ));
        }
        let kind = self.allocations[0].memory_kind();
        if kind == pb::MemoryKind::Unspecified {
            return bad("allocation 0 has no memory kind".into());
        }
        let mut handles = HashSet::new();
        for (i, a) in self.allocations.iter().enumerate() {
            if a.memory_kind() != kind {
                return bad(format!(
                    "allocation {i} is {:?} but allocation 0 is {kind:?}: one registration is one memory kind",
                    a.memory_kind()
                ));
            }
            if a.size_bytes() == 0 {
                return bad(format!("allocation {i} is empty"));
            }
            if kind == pb::MemoryKind::CudaIpc {
                match a.ipc_handle() {
                    Some(h) if !handles.insert(h) => {
                        return bad(format!(
                            "allocation {i} repeats another allocation's CUDA IPC handle"
                        ))
                    }
                    Some(_) => {}
                    None => return bad(format!("allocation {i} has no CUDA IPC handle")),
                }
            } else if a.export_fd().is_none() {
                return bad(format!("allocation {i} has no descriptor to send"));
            }
        }
        let mut used = vec![false; self.allocations.len()];
        let mut names = HashSet::new();
        for t in &self.tensors {
            let name = &t.name;
            if name.is_empty() {
                return bad("tensor names must not be empty".into());
            }
            if name.len() > MAX_LAYER_NAME_BYTES {
                return bad(format!(
                    "tensor name {name:?} is {} bytes; the limit is {MAX_LAYER_NAME_BYTES}",
                    name.len()
                ));
            }
            if !names.insert(name.as_str()) {
                return bad(format!("duplicate tensor name {name:?}"));
            }
            let Some(a) = self.allocations.get(t.allocation.0) else {
                return bad(format!(
                    "tensor {name:?}: allocation {} is not one of the {} allocations",
                    t.allocation.0,
                    self.allocations.len()
                ));
            };
            used[t.allocation.0] = true;
            let Some(span) = t.span_bytes().filter(|_| t.num_blocks > 0) else {
                return bad(format!(
                    "tensor {name:?}: num_blocks must be > 0 and its span must fit 64 bits"
                ));
            };
            let available = a.size_bytes().saturating_sub(t.offset_bytes);
            if t.offset_bytes
                .checked_add(span)
                .is_none_or(|end| end > a.size_bytes())
            {
                return bad(format!(
                    "tensor {name:?}: {span} bytes at offset {} exceed allocation {} of {} bytes",
                    t.offset_bytes,
                    t.allocation.0,
                    a.size_bytes()
                ));
            }
            KvLayout::new(
                t.num_blocks,
                t.bytes_per_block,
                t.segments,
                t.kv_stride_bytes,
                Some(t.block_stride_bytes),
                span.min(available),
            )
            .map_err(|e| ApiError::InvalidArgument(format!("tensor {name:?}: {e}")))?;
        }
        if let Some(i) = used.iter().position(|u| !u) {
            return bad(format!("allocation {i} is not used by any tensor"));
        }
        Ok(())
    }

    /// The RegisterContextBatch request of this registration under `instance_id` and
    /// `namespace` (unchecked: call [`Self::check`] first).
    pub fn to_request(&self, instance_id: &str, namespace: &str) -> pb::RegisterContextRequest {
        let t = &self.tensors;
        let kind = self.memory_kind().unwrap_or(pb::MemoryKind::Unspecified);
        pb::RegisterContextRequest {
            instance_id: instance_id.to_string(),
            namespace: namespace.to_string(),
            tp_rank: 0,
            tp_size: 1,
            world_size: 1,
            pp_rank: 0,
            device_id: self.device_id,
            layer_names: t.iter().map(|x| x.name.clone()).collect(),
            wrapper_bytes: vec![],
            num_blocks: t.iter().map(|x| x.num_blocks).collect(),
            bytes_per_block: t.iter().map(|x| x.bytes_per_block).collect(),
            kv_stride_bytes: t.iter().map(|x| x.kv_stride_bytes).collect(),
            segments: t.iter().map(|x| x.segments).collect(),
            client_version: pb::NATIVE_V2_CLIENT_VERSION.to_string(),
            transfer_mode: pb::TransferMode::Direct as i32,
            page_first: self.page_first,
            layer_group_ids: vec![],
            native_kv_tensors: t
                .iter()
                .map(|x| pb::NativeKvTensor {
                    offset_bytes: x.offset_bytes,
                    size_bytes: x.span_bytes().unwrap_or(0),
                    block_stride_bytes: x.block_stride_bytes,
                    allocation_index: x.allocation.0 as u32,
                })
                .collect(),
            native_alloc_size: 0,
            memory_kind: kind as i32,
            native_allocations: self
                .allocations
                .iter()
                .map(|a| pb::NativeAllocation {
                    size_bytes: a.size_bytes(),
                    cuda_ipc_handle: a.ipc_handle().map(|h| h.to_vec()).unwrap_or_default(),
                })
                .collect(),
        }
    }
}

/// A connection to the server shared by several rank-local instances: one gRPC channel (one
/// HTTP/2 connection) and one bounded pool of side-channel connections. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    rpc: EngineClient,
    socket: Option<PathBuf>,
    side_channel: Arc<Semaphore>,
}

impl Client {
    /// Connects to `endpoint` (`http://host:port`) and asks Health for the side channel's
    /// path (absent when the server runs without `--fd-socket-path`: then only CUDA IPC
    /// registrations can be made).
    ///
    /// Errors: [`ApiError::Connect`], or Health failing.
    pub async fn connect(endpoint: &str) -> Result<Self, ApiError> {
        let mut rpc = EngineClient::connect(endpoint).await?;
        let path = rpc.health().await?;
        Ok(Self::from_parts(
            rpc,
            (!path.is_empty()).then(|| PathBuf::from(path)),
        ))
    }

    /// A client over an existing connection and side-channel path.
    pub fn from_parts(rpc: EngineClient, socket: Option<PathBuf>) -> Self {
        Self {
            rpc,
            socket,
            side_channel: Arc::new(Semaphore::new(SIDE_CHANNEL_CONNECTIONS)),
        }
    }

    /// The side channel's path, as the server advertises it.
    pub fn socket_path(&self) -> Option<&std::path::Path> {
        self.socket.as_deref()
    }

    /// The underlying RPC client (a clone shares the connection).
    pub fn rpc(&self) -> EngineClient {
        self.rpc.clone()
    }

    /// Registers `reg` as a new instance `<base>-<32 hex>` of `namespace`: checks it
    /// ([`RegistrationBuilder::check`]), opens the instance's Session, sends every fd
    /// allocation on the side channel, then RegisterContextBatch. On a refusal the attempt's id
    /// is unregistered (best effort) and the error returned; retry with a new call (a new id).
    ///
    /// Errors: [`ApiError::InvalidArgument`] before anything is sent (bad registration, bad
    /// `base`, fd allocations without a side channel), otherwise the server's answer.
    pub async fn register(
        &self,
        base: &str,
        namespace: &str,
        reg: &RegistrationBuilder<'_>,
    ) -> Result<NativeInstance, ApiError> {
        reg.check()?;
        let instance_id = crate::native::fresh_instance_id(base);
        if !crate::is_side_channel_safe_id(&instance_id) {
            return Err(ApiError::InvalidArgument(format!(
                "instance id base {base:?} must be characters of [A-Za-z0-9_-] (at most 95)"
            )));
        }
        let fd_kind = reg.memory_kind() != Some(pb::MemoryKind::CudaIpc);
        if fd_kind && self.socket.is_none() {
            return Err(ApiError::InvalidArgument(
                "the server's fd side channel is disabled (start it with --fd-socket-path); \
                 only CUDA IPC registrations work without it"
                    .into(),
            ));
        }
        let mut rpc = self.rpc.clone();
        let session = rpc.session(&instance_id, namespace, 1, 1).await?;
        if fd_kind {
            self.send_fds(&instance_id, reg).await?;
        }
        if let Err(e) = rpc.register(reg.to_request(&instance_id, namespace)).await {
            let _ = rpc.unregister(&instance_id).await;
            return Err(e);
        }
        Ok(NativeInstance {
            rpc,
            instance_id,
            namespace: namespace.to_string(),
            device_id: reg.device_id,
            layer_names: reg.tensors.iter().map(|t| t.name.clone()).collect(),
            session: Some(session),
            saves_since_flush: 0,
        })
    }

    /// Sends allocation `i`'s descriptor under `instance_id \0 device_id \0 i`, in order, one
    /// acknowledged connection each (on a blocking thread), holding one of the client's
    /// side-channel permits per send. A connection the server closed without acknowledging
    /// filed nothing and is retried a few times (its connection slots may be busy).
    async fn send_fds(
        &self,
        instance_id: &str,
        reg: &RegistrationBuilder<'_>,
    ) -> Result<(), ApiError> {
        let Some(socket) = &self.socket else {
            return Err(ApiError::InvalidArgument("no side channel".into()));
        };
        for (i, a) in reg.allocations.iter().enumerate() {
            let Some(fd) = a.export_fd() else {
                return Err(ApiError::InvalidArgument(format!(
                    "allocation {i} has no descriptor to send"
                )));
            };
            let fd = fd
                .try_clone_to_owned()
                .map_err(|e| ApiError::io(format!("dup of allocation {i}'s descriptor"), e))?;
            let fd = Arc::new(fd);
            let mut backoff = std::time::Duration::from_millis(5);
            let mut attempt = 0;
            loop {
                let permit = Arc::clone(&self.side_channel)
                    .acquire_owned()
                    .await
                    .map_err(|_| ApiError::InvalidArgument("client closed".into()))?;
                let (socket, id, dev, fd2) = (
                    socket.clone(),
                    instance_id.to_string(),
                    reg.device_id,
                    Arc::clone(&fd),
                );
                let r = tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    use std::os::fd::AsFd;
                    crate::fd::send_allocation_fd(&socket, &id, dev, i as u32, fd2.as_fd())
                })
                .await
                .map_err(|e| {
                    ApiError::io(
                        "side-channel send task",
                        std::io::Error::other(e.to_string()),
                    )
                })?;
                match r {
                    Err(ApiError::Io { source, .. })
                        if attempt < 5
                            && matches!(
                                source.kind(),
                                std::io::ErrorKind::UnexpectedEof
                                    | std::io::ErrorKind::ConnectionReset
                                    | std::io::ErrorKind::BrokenPipe
                            ) =>
                    {
                        attempt += 1;
                        tokio::time::sleep(backoff).await;
                        backoff *= 4;
                    }
                    other => {
                        other?;
                        break;
                    }
                }
            }
        }
        Ok(())
    }
}

/// One registered rank-local instance of a [`Client`] (its own id, Session and saves).
#[derive(Debug)]
pub struct NativeInstance {
    rpc: EngineClient,
    instance_id: String,
    namespace: String,
    device_id: i32,
    layer_names: Vec<String>,
    session: Option<tonic::Streaming<pb::SessionEvent>>,
    saves_since_flush: u64,
}

impl NativeInstance {
    /// The instance id (`<base>-<32 hex>`).
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The device id.
    pub fn device_id(&self) -> i32 {
        self.device_id
    }

    /// The layer names, in registration order.
    pub fn layer_names(&self) -> &[String] {
        &self.layer_names
    }

    /// Saves blocks `block_ids` of every layer under `hashes` (one hash per block id): all of
    /// a block's arenas travel in one request.
    ///
    /// Errors: the server's refusal (INVALID_ARGUMENT for out-of-range ids or mismatched
    /// lengths, FAILED_PRECONDITION for an unknown or closing instance).
    pub async fn save(&mut self, block_ids: &[u32], hashes: &[Vec<u8>]) -> Result<(), ApiError> {
        let saves = self
            .layer_names
            .iter()
            .map(|l| (l.clone(), block_ids.to_vec(), hashes.to_vec()))
            .collect();
        self.saves_since_flush += 1;
        self.rpc
            .save(&self.instance_id, 0, 0, self.device_id, saves)
            .await
    }

    /// Asks which prefix of `hashes` is cached (re-polling while the server promotes blocks);
    /// the hits are leased. Returns (hit count, lease; empty when 0).
    pub async fn query(
        &mut self,
        hashes: Vec<Vec<u8>>,
        req_id: &str,
    ) -> Result<(u64, Vec<u8>), ApiError> {
        loop {
            match self
                .rpc
                .query(&self.instance_id, hashes.clone(), req_id)
                .await?
            {
                QueryOutcome::Ready {
                    num_hit_blocks,
                    lease,
                    ..
                } => return Ok((num_hit_blocks, lease)),
                QueryOutcome::Loading => {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await
                }
            }
        }
    }

    /// Loads a lease's blocks into `targets` (lease block `i` → block `targets[i]`) of every
    /// layer; returns when every byte has landed.
    pub async fn load(&mut self, lease: &[u8], targets: &[u32]) -> Result<(), ApiError> {
        let req = crate::client::single_group_load(
            &self.instance_id,
            0,
            self.device_id,
            self.layer_names.clone(),
            lease,
            targets.iter().map(|&b| Some(b)),
            crate::client::LoadCompletion::Wait,
        );
        self.rpc.load(req).await
    }

    /// Releases a lease that will not be loaded. Errors when the server rejects it.
    pub async fn release(&mut self, lease: &[u8]) -> Result<(), ApiError> {
        self.rpc.release(lease).await
    }

    /// Waits until every save submitted so far (by any client of the server) is sealed and
    /// queryable.
    pub async fn flush(&mut self) -> Result<(), ApiError> {
        self.rpc.flush().await?;
        self.saves_since_flush = 0;
        Ok(())
    }

    /// Flushes this instance's submitted saves, unregisters it, and closes its Session.
    pub async fn unregister(mut self) -> Result<(), ApiError> {
        if self.saves_since_flush > 0 {
            self.flush().await?;
        }
        let r = self.rpc.unregister(&self.instance_id).await;
        self.session.take();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memfd::HostMemfd;

    struct FakeIpc([u8; 64], u64);
    impl NativeAllocation for FakeIpc {
        fn memory_kind(&self) -> pb::MemoryKind {
            pb::MemoryKind::CudaIpc
        }
        fn size_bytes(&self) -> u64 {
            self.1
        }
        fn ipc_handle(&self) -> Option<[u8; 64]> {
            Some(self.0)
        }
    }

    fn msg(r: Result<(), ApiError>) -> String {
        match r {
            Err(ApiError::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn glm_like_registration_builds_the_v2_request() {
        let mla = HostMemfd::new("mla", 10 * 41_984).unwrap();
        let idx = HostMemfd::new("idx", 4096 + 10 * 8_448).unwrap();
        let mut b = RegistrationBuilder::new(3);
        let a = b.allocation(&mla);
        let i = b.allocation(&idx);
        b.contiguous_tensor("L0.mla", a, 0, 10, 41_984)
            .contiguous_tensor("L0.idxk", i, 4096, 10, 8_448);
        b.check().unwrap();
        let r = b.to_request("x-1", "ns");
        assert_eq!(r.client_version, pb::NATIVE_V2_CLIENT_VERSION);
        assert_eq!(r.memory_kind, pb::MemoryKind::HostMemfd as i32);
        assert_eq!(r.native_alloc_size, 0);
        assert_eq!(r.native_allocations.len(), 2);
        assert_eq!(r.native_allocations[1].size_bytes, 4096 + 84_480);
        let t = &r.native_kv_tensors[1];
        assert_eq!(
            (
                t.allocation_index,
                t.offset_bytes,
                t.size_bytes,
                t.block_stride_bytes
            ),
            (1, 4096, 84_480, 8_448)
        );
        assert_eq!(r.segments, vec![1, 1]);
        assert_eq!(r.kv_stride_bytes, vec![0, 0]);
    }

    #[test]
    fn bad_registrations_fail_before_anything_is_sent() {
        let m = HostMemfd::new("m", 4096).unwrap();
        let m2 = HostMemfd::new("m2", 4096).unwrap();
        let none = RegistrationBuilder::new(0);
        assert!(msg(none.check()).contains("at least one allocation"));
        let mut b = RegistrationBuilder::new(0);
        let a = b.allocation(&m);
        assert!(msg(b.check()).contains("at least one tensor"));
        b.tensor("t", a, 0, 4, 1024, 1024);
        b.check().unwrap();
        // Past the end of its allocation.
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&m);
        c.tensor("t", a, 1, 4, 1024, 1024);
        assert!(msg(c.check()).contains("exceed allocation 0"));
        // Overlapping blocks (stride below the block).
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&m);
        c.tensor("t", a, 0, 4, 1024, 512);
        assert!(msg(c.check()).contains("overlap"));
        // An unused allocation, an unknown allocation, duplicate names, negative device.
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&m);
        c.allocation(&m2);
        c.contiguous_tensor("t", a, 0, 4, 1024);
        assert!(msg(c.check()).contains("allocation 1 is not used"));
        c.contiguous_tensor("u", AllocationId(7), 0, 1, 1);
        assert!(msg(c.check()).contains("allocation 7 is not one of"));
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&m);
        c.contiguous_tensor("t", a, 0, 2, 1024)
            .contiguous_tensor("t", a, 2048, 2, 1024);
        assert!(msg(c.check()).contains("duplicate tensor name"));
        let mut c = RegistrationBuilder::new(-1);
        let a = c.allocation(&m);
        c.contiguous_tensor("t", a, 0, 1, 1);
        assert!(msg(c.check()).contains("device_id"));
        // Mixed kinds; repeated IPC handles.
        let ipc = FakeIpc([7; 64], 4096);
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&m);
        let i = c.allocation(&ipc);
        c.contiguous_tensor("t", a, 0, 1, 1)
            .contiguous_tensor("u", i, 0, 1, 1);
        assert!(msg(c.check()).contains("one memory kind"));
        let ipc2 = FakeIpc([7; 64], 4096);
        let mut c = RegistrationBuilder::new(0);
        let a = c.allocation(&ipc);
        let i = c.allocation(&ipc2);
        c.contiguous_tensor("t", a, 0, 1, 1)
            .contiguous_tensor("u", i, 0, 1, 1);
        assert!(msg(c.check()).contains("repeats another allocation"));
    }
}
