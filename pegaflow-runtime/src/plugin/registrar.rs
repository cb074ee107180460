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

use super::transport::MemorySpace;
use crate::fd_channel::FdChannel;

/// Memory a client handed over, mapped into this process. Dropping the last `Arc` unmaps it;
/// the engine only drops it after fencing and draining every copy (DESIGN.md §6.3), on a
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
/// (`RegisterContextRequest`, engine-wire.md §4).
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
}

impl RegistrationPayload {
    /// The carrier this payload arrived on.
    pub fn carrier(&self) -> PayloadCarrier {
        match self {
            RegistrationPayload::LayerBlobs(_) => PayloadCarrier::LayerBlobs,
            RegistrationPayload::SideChannel { memory_kind, .. } => PayloadCarrier::SideChannel {
                memory_kind: *memory_kind,
            },
        }
    }

    /// A short description for messages.
    pub fn describe(&self) -> String {
        match self {
            RegistrationPayload::LayerBlobs(_) => "per-layer blob (wrapper_bytes)".into(),
            RegistrationPayload::SideChannel { memory_kind, .. } => {
                format!("side-channel memory_kind {memory_kind}")
            }
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
    pub channel: Arc<FdChannel>,
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
        channel: Option<&Arc<FdChannel>>,
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
                if matches!(other, RegistrationPayload::SideChannel { .. })
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
