//! The registrar contract: importing a client's memory description into a registration that a
//! transport can address, and the rules every import follows.
//!
//! Payload schemes are open: a registrar declares which wire carrier it imports
//! ([`PayloadCarrier`]: per-layer blobs, or a descriptor on the fd side channel under a
//! `memory_kind` number) and what its registrations require of the engine
//! ([`RegistrarTraits`]). The runtime selects a registrar by what the request carries and
//! never by a scheme's name.
//!
//! Registration states (owned by the engine's registry): importing (a reservation of the
//! device id) → live → fenced (new work refused) → drained (accepted copies finished) →
//! released (the [`Registration`] dropped on the reaper thread, which unmaps).

use std::sync::Arc;

use async_trait::async_trait;

use crate::side_channel::SideChannel;
use crate::transport::MemorySpace;

/// Memory a client handed over, mapped into this process. Dropping the last `Arc` unmaps it;
/// the engine only drops it after fencing and draining every copy (docs/ARCHITECTURE.md, "Fence, drain, unmap"), on a
/// dedicated thread.
pub trait Registration: Send + Sync + 'static {
    /// Where the memory lives.
    fn location(&self) -> MemorySpace;
    /// The address of byte 0, as transports address it.
    fn base_addr(&self) -> u64;
    /// Mapped length in bytes.
    fn len_bytes(&self) -> u64;
    /// One line for logs: what was imported.
    fn describe(&self) -> String;
}

/// One layer's memory: `len` bytes starting `offset` bytes into `memory`.
#[derive(Clone)]
pub struct LayerRegion {
    /// The mapping the layer lives in (several layers may share one).
    pub memory: Arc<dyn Registration>,
    /// Offset of the layer's block 0 from the mapping's base, in bytes.
    pub offset: u64,
    /// Bytes the layer may address from `offset`.
    pub len: u64,
}

impl std::fmt::Debug for LayerRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerRegion")
            .field("memory", &self.memory.describe())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// How a registration request carries its memory description on the wire
/// (`RegisterContextRequest`, docs/PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadCarrier {
    /// `wrapper_bytes`: one opaque blob per layer (what the published Python client sends).
    LayerBlobs,
    /// A descriptor on the fd side channel with one view per layer (`native_kv_tensors`),
    /// announced by `memory_kind` = this number (field 102).
    SideChannel {
        /// The `memory_kind` wire value the registrar imports (never 0).
        memory_kind: i32,
    },
}

impl std::fmt::Display for PayloadCarrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayloadCarrier::LayerBlobs => f.write_str("per-layer blobs"),
            PayloadCarrier::SideChannel { memory_kind } => {
                write!(f, "side channel, memory_kind {memory_kind}")
            }
        }
    }
}

/// A payload scheme a registrar declares: its name (for messages and listings) and its carrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PayloadScheme {
    /// The scheme's name, as its registrar spells it.
    pub name: &'static str,
    /// How requests of this scheme arrive.
    pub carrier: PayloadCarrier,
}

/// What registrations of a registrar require of the engine; declared by the registrar so that
/// the engine never branches on which registrar it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegistrarTraits {
    /// Loads into such registrations complete only by the Load RPC's own return
    /// (`wait_for_completion`); a load-state word is refused.
    pub completion_by_rpc_only: bool,
    /// Largest `world_size` (and `tp_size`) one instance of this scheme may have; `None` = any.
    pub max_world_size: Option<u32>,
}

/// One layer's view inside a native allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeView {
    /// Offset of block 0 from the allocation's start, in bytes.
    pub offset_bytes: u64,
    /// Bytes the view spans.
    pub size_bytes: u64,
    /// Distance between blocks, in bytes.
    pub block_stride_bytes: u64,
}

/// One allocation of a native registration v2 (`NativeAllocation` on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NativeAllocationSpec {
    /// The allocation's size in bytes as the client states it (> 0): what an fd kind maps,
    /// what a CUDA IPC handle's allocation must measure.
    pub size_bytes: u64,
    /// The raw `CUipcMemHandle` of a CUDA IPC allocation; `None` for fd kinds.
    pub ipc_handle: Option<[u8; pegaflow_proto::CUDA_IPC_HANDLE_BYTES]>,
}

/// One layer's view of a native registration v2: the allocation it lives in and its view
/// there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeTensorView {
    /// Index into the registration's allocations.
    pub allocation: usize,
    /// The view, relative to that allocation's start.
    pub view: NativeView,
}

/// What a registrar is asked to import.
#[derive(Debug, Clone)]
pub enum RegistrationPayload {
    /// One opaque blob per layer ([`PayloadCarrier::LayerBlobs`]).
    LayerBlobs(Vec<Vec<u8>>),
    /// One allocation on the fd side channel, with one view per layer
    /// ([`PayloadCarrier::SideChannel`]).
    SideChannel {
        /// The `memory_kind` wire value.
        memory_kind: i32,
        /// The allocation's size in bytes, as the client states it.
        alloc_size: u64,
        /// Per-layer views.
        views: Vec<NativeView>,
    },
    /// Native registration v2 (`0.25.1+native-v2`): several allocations of one memory kind,
    /// one view per layer naming its allocation. Carried like
    /// [`RegistrationPayload::SideChannel`] of the same `memory_kind` (its registrar imports
    /// both), fd kinds with one side-channel message per allocation.
    NativeV2 {
        /// The `memory_kind` wire value of every allocation.
        memory_kind: i32,
        /// The allocations, in wire order (index = side-channel allocation index).
        allocations: Vec<NativeAllocationSpec>,
        /// Per-layer views.
        views: Vec<NativeTensorView>,
    },
}

impl RegistrationPayload {
    /// The carrier this payload arrived on.
    pub fn carrier(&self) -> PayloadCarrier {
        match self {
            RegistrationPayload::LayerBlobs(_) => PayloadCarrier::LayerBlobs,
            RegistrationPayload::SideChannel { memory_kind, .. }
            | RegistrationPayload::NativeV2 { memory_kind, .. } => PayloadCarrier::SideChannel {
                memory_kind: *memory_kind,
            },
        }
    }

    /// Whether this is a native registration (v1 or v2), i.e. not the Python path.
    pub fn is_native(&self) -> bool {
        !matches!(self, RegistrationPayload::LayerBlobs(_))
    }

    /// A short description for messages.
    pub fn describe(&self) -> String {
        match self {
            RegistrationPayload::LayerBlobs(_) => "per-layer blob (wrapper_bytes)".into(),
            RegistrationPayload::SideChannel { memory_kind, .. } => {
                format!("side-channel memory_kind {memory_kind}")
            }
            RegistrationPayload::NativeV2 {
                memory_kind,
                allocations,
                ..
            } => format!(
                "native v2 memory_kind {memory_kind} ({} allocations)",
                allocations.len()
            ),
        }
    }
}

/// A registrar's import request.
#[derive(Debug, Clone)]
pub struct ImportRequest {
    /// The instance registering.
    pub instance_id: String,
    /// The worker's device id (as the client numbers it).
    pub device_id: i32,
    /// The memory description.
    pub payload: RegistrationPayload,
}

/// Why an import failed. The message is shown to the client (gRPC INTERNAL unless noted).
#[derive(Debug, thiserror::Error)]
pub enum RegistrarError {
    /// The description is malformed or out of bounds (gRPC INVALID_ARGUMENT).
    #[error("{0}")]
    Invalid(String),
    /// A precondition is missing, e.g. no fd arrived on the side channel (FAILED_PRECONDITION).
    #[error("{0}")]
    Precondition(String),
    /// The import itself failed (mapping, driver) (INTERNAL).
    #[error("{0}")]
    Failed(String),
}

/// Turns a client's memory description into mapped [`LayerRegion`]s, one per layer, in order.
#[async_trait]
pub trait Registrar: Send + Sync + 'static {
    /// The pipeline kind, e.g. `host-memfd`.
    fn kind(&self) -> &'static str;
    /// The payload scheme this registrar imports.
    fn scheme(&self) -> PayloadScheme;
    /// What its registrations require of the engine.
    fn traits(&self) -> RegistrarTraits;
    /// Imports the memory. Must not block the executor (run blocking work on a blocking
    /// thread). Every region returned must be bounds-checked against what was mapped.
    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError>;
}

/// A native registration (an allocation sent on the fd side channel), checked as far as it can
/// be without its descriptor. Registrars of native payloads start from here.
#[derive(Debug)]
pub struct NativeImport {
    /// The side channel the descriptor arrives on.
    pub channel: Arc<dyn SideChannel>,
    /// The registering instance (side-channel safe).
    pub instance_id: String,
    /// The worker's device id.
    pub device_id: i32,
    /// The allocation's size as the client states it, in bytes (> 0).
    pub alloc_size: u64,
    /// One view per layer, each non-empty, with a non-zero stride, inside `alloc_size`.
    pub views: Vec<NativeView>,
}

impl NativeImport {
    /// Checks `req` for a registrar of `memory_kind` (named `registrar` in messages): the side
    /// channel is configured (else Precondition), the payload is a side-channel one of `memory_kind`, the instance id is
    /// side-channel safe, `alloc_size > 0` and every view lies inside the allocation (else
    /// Invalid). When the request is refused after the channel check, the descriptor already
    /// sent for its key is closed, so the client can resend at once.
    pub fn check(
        registrar: &str,
        memory_kind: i32,
        channel: Option<&Arc<dyn SideChannel>>,
        req: ImportRequest,
    ) -> Result<Self, RegistrarError> {
        let Some(channel) = channel else {
            return Err(RegistrarError::Precondition(format!(
                "{registrar} registration needs the fd side channel: start the server with --fd-socket-path"
            )));
        };
        let ImportRequest {
            instance_id,
            device_id,
            payload,
        } = req;
        let (alloc_size, views) = match payload {
            RegistrationPayload::SideChannel {
                memory_kind: k,
                alloc_size,
                views,
            } if k == memory_kind => (alloc_size, views),
            other => {
                let e = RegistrarError::Invalid(format!(
                    "the {registrar} registrar cannot import a {} payload",
                    other.describe()
                ));
                // A side-channel payload of another memory kind may have sent a descriptor
                // under this key: close it, as every refusal after the channel check does.
                if other.is_native()
                    && pegaflow_api::is_side_channel_safe_id(&instance_id)
                    && channel.discard(&instance_id, device_id)
                {
                    tracing::debug!(instance = %instance_id, device_id, "discarded the pending fd of a refused registration");
                }
                return Err(e);
            }
        };
        if !pegaflow_api::is_side_channel_safe_id(&instance_id) {
            return Err(RegistrarError::Invalid(format!(
                "instance id {instance_id:?} must be 1-128 characters of [A-Za-z0-9_-] for the fd side channel"
            )));
        }
        let import = Self {
            channel: channel.clone(),
            instance_id,
            device_id,
            alloc_size,
            views,
        };
        match import.check_views(registrar) {
            Ok(()) => Ok(import),
            Err(e) => Err(import.refuse(e)),
        }
    }

    fn check_views(&self, registrar: &str) -> Result<(), RegistrarError> {
        let alloc_size = self.alloc_size;
        if alloc_size == 0 {
            return Err(RegistrarError::Invalid(format!(
                "{registrar} alloc_size must be > 0"
            )));
        }
        if self.views.is_empty() {
            return Err(RegistrarError::Invalid(format!(
                "{registrar} registration has no layer views"
            )));
        }
        for (layer, v) in self.views.iter().enumerate() {
            if v.size_bytes == 0 {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: size_bytes must be > 0"
                )));
            }
            if v.block_stride_bytes == 0 {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: block_stride_bytes must be > 0"
                )));
            }
            if v.offset_bytes
                .checked_add(v.size_bytes)
                .is_none_or(|end| end > alloc_size)
            {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: view at offset {} of {} bytes exceeds the {alloc_size}-byte allocation",
                    v.offset_bytes, v.size_bytes
                )));
            }
        }
        Ok(())
    }

    /// Closes the descriptor pending for this registration's key (if any) and returns `e`: for
    /// a refusal decided before the descriptor was taken.
    pub fn refuse(&self, e: RegistrarError) -> RegistrarError {
        if self.channel.discard(&self.instance_id, self.device_id) {
            tracing::debug!(instance = %self.instance_id, device_id = self.device_id, "discarded the pending fd of a refused registration");
        }
        e
    }

    /// Takes the registration's descriptor, waiting up to `timeout`; Precondition when none came.
    pub async fn take_fd(
        &self,
        what: &str,
        timeout: std::time::Duration,
    ) -> Result<std::os::fd::OwnedFd, RegistrarError> {
        self.channel
            .take(&self.instance_id, self.device_id, timeout)
            .await
            .ok_or_else(|| {
                RegistrarError::Precondition(format!(
                    "no {what} received on the fd side channel for instance {} device {} within {}s",
                    self.instance_id,
                    self.device_id,
                    timeout.as_secs_f64()
                ))
            })
    }

    /// One region per view, all in `memory`.
    pub fn regions(&self, memory: Arc<dyn Registration>) -> Vec<LayerRegion> {
        self.views
            .iter()
            .map(|v| LayerRegion {
                memory: Arc::clone(&memory),
                offset: v.offset_bytes,
                len: v.size_bytes,
            })
            .collect()
    }
}

/// A native registration v2 (several allocations, one view per layer naming its allocation),
/// checked as far as it can be without its descriptors or handles. Registrars of v2 payloads
/// start from here.
///
/// Every refusal and every failure after the check closes the descriptors of the
/// registration that are still pending on the side channel ([`NativeImportV2::refuse`]), so
/// a failed registration leaves no descriptor behind and the client may resend at once.
#[derive(Debug)]
pub struct NativeImportV2 {
    /// The side channel (fd kinds; `None` for CUDA IPC handles).
    pub channel: Option<Arc<dyn SideChannel>>,
    /// The registering instance (side-channel safe).
    pub instance_id: String,
    /// The worker's device id.
    pub device_id: i32,
    /// The allocations, in wire order: each > 0 bytes, each used by at least one view.
    pub allocations: Vec<NativeAllocationSpec>,
    /// One view per layer: non-empty, non-zero stride, inside its allocation's stated size.
    pub views: Vec<NativeTensorView>,
}

impl NativeImportV2 {
    /// Checks `req` for a registrar of `memory_kind` (named `registrar` in messages): with
    /// `fds`, the side channel is configured (else Precondition) and no allocation carries an
    /// IPC handle; without, every allocation carries one; the instance id is side-channel
    /// safe; every allocation is non-empty and used; every view lies inside its allocation
    /// (else Invalid). On refusal after the channel check every pending descriptor of the
    /// registration is closed.
    pub fn check(
        registrar: &str,
        memory_kind: i32,
        fds: bool,
        channel: Option<&Arc<dyn SideChannel>>,
        req: ImportRequest,
    ) -> Result<Self, RegistrarError> {
        if fds && channel.is_none() {
            return Err(RegistrarError::Precondition(format!(
                "{registrar} registration needs the fd side channel: start the server with --fd-socket-path"
            )));
        }
        let ImportRequest {
            instance_id,
            device_id,
            payload,
        } = req;
        let RegistrationPayload::NativeV2 {
            memory_kind: k,
            allocations,
            views,
        } = payload
        else {
            return Err(RegistrarError::Invalid(format!(
                "the {registrar} registrar (native v2) cannot import a {} payload",
                payload.describe()
            )));
        };
        let import = Self {
            channel: if fds { channel.cloned() } else { None },
            instance_id,
            device_id,
            allocations,
            views,
        };
        if !pegaflow_api::is_side_channel_safe_id(&import.instance_id) {
            return Err(RegistrarError::Invalid(format!(
                "instance id {:?} must be 1-128 characters of [A-Za-z0-9_-] for a native registration",
                import.instance_id
            )));
        }
        let checked = if k != memory_kind {
            Err(RegistrarError::Invalid(format!(
                "the {registrar} registrar imports memory_kind {memory_kind}, not {k}"
            )))
        } else {
            import.check_views(registrar, fds)
        };
        match checked {
            Ok(()) => Ok(import),
            Err(e) => Err(import.refuse(e)),
        }
    }

    fn check_views(&self, registrar: &str, fds: bool) -> Result<(), RegistrarError> {
        if self.allocations.is_empty() {
            return Err(RegistrarError::Invalid(format!(
                "{registrar} registration has no allocations"
            )));
        }
        if self.views.is_empty() {
            return Err(RegistrarError::Invalid(format!(
                "{registrar} registration has no layer views"
            )));
        }
        for (i, a) in self.allocations.iter().enumerate() {
            if a.size_bytes == 0 {
                return Err(RegistrarError::Invalid(format!(
                    "allocation {i}: size_bytes must be > 0"
                )));
            }
            if fds == a.ipc_handle.is_some() {
                return Err(RegistrarError::Invalid(format!(
                    "allocation {i}: {registrar} allocations {} a CUDA IPC handle",
                    if fds { "carry no" } else { "need" }
                )));
            }
        }
        let mut used = vec![false; self.allocations.len()];
        for (layer, tv) in self.views.iter().enumerate() {
            let v = &tv.view;
            let Some(a) = self.allocations.get(tv.allocation) else {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: allocation_index {} is not one of the {} allocations",
                    tv.allocation,
                    self.allocations.len()
                )));
            };
            used[tv.allocation] = true;
            if v.size_bytes == 0 || v.block_stride_bytes == 0 {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: size_bytes and block_stride_bytes must be > 0"
                )));
            }
            if v.offset_bytes
                .checked_add(v.size_bytes)
                .is_none_or(|end| end > a.size_bytes)
            {
                return Err(RegistrarError::Invalid(format!(
                    "layer {layer}: view at offset {} of {} bytes exceeds allocation {} of {} bytes",
                    v.offset_bytes, v.size_bytes, tv.allocation, a.size_bytes
                )));
            }
        }
        if let Some(i) = used.iter().position(|u| !u) {
            return Err(RegistrarError::Invalid(format!(
                "allocation {i} is not used by any layer"
            )));
        }
        Ok(())
    }

    /// Closes every descriptor still pending for this registration's `(instance, device)`
    /// (any allocation index) and returns `e`.
    pub fn refuse(&self, e: RegistrarError) -> RegistrarError {
        if let Some(ch) = &self.channel {
            if ch.discard(&self.instance_id, self.device_id) {
                tracing::debug!(instance = %self.instance_id, device_id = self.device_id, "discarded the pending fds of a refused native v2 registration");
            }
        }
        e
    }

    /// Takes the descriptor of every allocation, in index order, all within one `timeout`.
    /// On a missing descriptor (Precondition naming its index) every descriptor taken so far
    /// is closed and every one still pending for the registration is discarded.
    pub async fn take_fds(
        &self,
        what: &str,
        timeout: std::time::Duration,
    ) -> Result<Vec<std::os::fd::OwnedFd>, RegistrarError> {
        let Some(ch) = &self.channel else {
            return Err(RegistrarError::Failed(format!(
                "{what}: a CUDA IPC registration has no descriptors to take"
            )));
        };
        let start = tokio::time::Instant::now();
        let deadline = start
            .checked_add(timeout)
            .unwrap_or_else(|| start + std::time::Duration::from_secs(365 * 24 * 3600));
        let mut fds = Vec::with_capacity(self.allocations.len());
        for i in 0..self.allocations.len() {
            let index = u32::try_from(i).map_err(|_| {
                self.refuse(RegistrarError::Invalid(format!(
                    "allocation index {i} too large"
                )))
            })?;
            match ch
                .take_allocation(&self.instance_id, self.device_id, index, deadline)
                .await
            {
                Some(fd) => fds.push(fd),
                None => {
                    drop(fds);
                    return Err(self.refuse(RegistrarError::Precondition(format!(
                        "no {what} for allocation {i} of {} received on the fd side channel for \
                         instance {} device {} within {}s",
                        self.allocations.len(),
                        self.instance_id,
                        self.device_id,
                        timeout.as_secs_f64()
                    ))));
                }
            }
        }
        Ok(fds)
    }

    /// One region per view, in layer order, each in `memories[view.allocation]` (one imported
    /// registration per allocation, in allocation order).
    ///
    /// Errors: Failed when `memories` does not hold one registration per allocation, or an
    /// imported registration is shorter than a view needs.
    pub fn regions(
        &self,
        memories: &[Arc<dyn Registration>],
    ) -> Result<Vec<LayerRegion>, RegistrarError> {
        if memories.len() != self.allocations.len() {
            return Err(RegistrarError::Failed(format!(
                "imported {} allocations of {}",
                memories.len(),
                self.allocations.len()
            )));
        }
        self.views
            .iter()
            .enumerate()
            .map(|(layer, tv)| {
                let m = &memories[tv.allocation];
                let end = tv.view.offset_bytes + tv.view.size_bytes;
                if end > m.len_bytes() {
                    return Err(RegistrarError::Invalid(format!(
                        "layer {layer}: view ends at byte {end} but allocation {} maps {} bytes",
                        tv.allocation,
                        m.len_bytes()
                    )));
                }
                Ok(LayerRegion {
                    memory: Arc::clone(m),
                    offset: tv.view.offset_bytes,
                    len: tv.view.size_bytes,
                })
            })
            .collect()
    }
}
