//! The plugin contract: the [`Tier`], [`Transport`] and [`Registrar`] traits, the factories a
//! backend crate submits with `inventory`, and the lookup that turns a pipeline's `kind` into
//! a built backend.
//!
//! The runtime never names a backend: it branches on capabilities ([`TierCapabilities`],
//! [`Transport::can_address`], [`Registrar::payload`]). A backend crate registers itself with
//! `inventory::submit! { TierFactory { .. } }` (or the transport/registrar equivalent) and is
//! linked into a server binary; nothing in this crate changes.

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_api::TransferMode;

use crate::buffer::HostBuffer;
use crate::fd_channel::FdChannel;

/// What a tier can do; the engine asks, it never matches on the kind's name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCapabilities {
    /// Blocks live in host memory that transports can address directly (the landing tier).
    pub host_addressable: bool,
    /// Blocks survive a restart of the server.
    pub persistent: bool,
    /// Blocks live on another node.
    pub remote: bool,
}

/// A level where sealed blocks live. The landing tier (host DRAM) hands out [`HostBuffer`]s
/// that transports copy into directly; the engine's block index decides what stays.
pub trait Tier: Send + Sync + 'static {
    /// The pipeline kind this tier was built from, e.g. `dram`.
    fn kind(&self) -> &'static str;
    /// What this tier can do.
    fn capabilities(&self) -> TierCapabilities;
    /// Bytes the tier can hold.
    fn capacity_bytes(&self) -> u64;
    /// Bytes currently allocated.
    fn used_bytes(&self) -> u64;
    /// Bytes an allocation of `len` bytes takes from the capacity (after the tier's rounding).
    fn footprint_bytes(&self, len: usize) -> u64 {
        len as u64
    }
    /// Host-addressable tiers: allocates exactly `len` bytes, possibly as several extents.
    /// `None` when fewer than `footprint_bytes(len)` bytes are free; the engine then evicts
    /// and retries. Tiers that are not host-addressable return `None`.
    fn allocate(&self, len: usize) -> Option<HostBuffer>;
    /// Allocates one buffer per entry of `lens`, all or nothing. A tier that can should carve
    /// them from one contiguous range (in order), so that a transport sees one large host range
    /// for a whole Save batch while each block can still be freed on its own.
    fn allocate_batch(&self, lens: &[usize]) -> Option<Vec<HostBuffer>> {
        let mut out = Vec::with_capacity(lens.len());
        for &l in lens {
            out.push(self.allocate(l)?);
        }
        Some(out)
    }
    /// Host-addressable tiers: the (address, length) ranges backing the tier, so that a
    /// transport can register (pin) them with a device. Empty for other tiers.
    fn backing_ranges(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
    /// Gives memory that no live buffer uses back to the OS (after a cleanup); best effort.
    fn trim(&self) {}
}

/// Where a registration's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host memory mapped in this process; addresses are host virtual addresses.
    Host,
    /// Memory of a CUDA device (by CUDA ordinal in this process); addresses are `CUdeviceptr`s.
    CudaDevice {
        /// CUDA device ordinal.
        ordinal: i32,
    },
}

/// Memory a client handed over, mapped into this process. Dropping the last `Arc` unmaps it;
/// the engine only drops it after fencing and draining every copy (DESIGN.md §6.3), on a
/// dedicated thread.
pub trait Registration: Send + Sync + 'static {
    /// Where the memory lives.
    fn location(&self) -> MemoryLocation;
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

/// The kind of memory description a registration request carries; each registrar imports one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// Pickled `CudaIPCWrapper`s, one per layer (the published Python client).
    CudaIpcWrapper,
    /// A host memfd on the fd side channel with per-layer views.
    HostMemfd,
    /// A CUDA VMM allocation (POSIX fd) on the fd side channel with per-layer views.
    CudaVmm,
}

impl PayloadKind {
    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            PayloadKind::CudaIpcWrapper => "cuda-ipc",
            PayloadKind::HostMemfd => "host-memfd",
            PayloadKind::CudaVmm => "cuda-vmm",
        }
    }
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
    /// One pickled CudaIPCWrapper per layer.
    CudaIpcWrappers(Vec<Vec<u8>>),
    /// One allocation on the fd side channel, with one view per layer.
    Native {
        /// Host memfd or CUDA VMM.
        kind: PayloadKind,
        /// The allocation's size in bytes, as the client states it.
        alloc_size: u64,
        /// Per-layer views.
        views: Vec<NativeView>,
    },
}

impl RegistrationPayload {
    /// Which registrar kind imports this payload.
    pub fn kind(&self) -> PayloadKind {
        match self {
            RegistrationPayload::CudaIpcWrappers(_) => PayloadKind::CudaIpcWrapper,
            RegistrationPayload::Native { kind, .. } => *kind,
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
    /// The payload kind this registrar imports.
    fn payload(&self) -> PayloadKind;
    /// Imports the memory. Must not block the executor (run blocking work on a blocking
    /// thread). Every region returned must be bounds-checked against what was mapped.
    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError>;
}

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Save: registered (device) memory → host buffers.
    ToHost,
    /// Load: host buffers → registered (device) memory.
    ToDevice,
}

/// One contiguous copy between a registration and a host buffer piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Address in the registration's memory (validated by the engine).
    pub device_addr: u64,
    /// Host address inside a live [`HostBuffer`].
    pub host_addr: usize,
    /// Bytes.
    pub len: usize,
}

/// A batch of copies against memory of one location, in one direction.
#[derive(Debug, Clone)]
pub struct CopyBatch {
    /// Where the device side lives.
    pub location: MemoryLocation,
    /// Which way.
    pub direction: Direction,
    /// The instance's requested mode (a hint; a transport may ignore it).
    pub mode: TransferMode,
    /// The copies; the engine merges adjacent ones before submitting.
    pub ops: Vec<CopyOp>,
}

/// Why a copy failed. A failed copy is never reported as success.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

/// Moves bytes between registrations and host buffers.
///
/// Contract: the future returned by [`Transport::copy`] completes only once every byte of the
/// batch has moved (or failed); the engine keeps the registration and the host buffers alive
/// until then and always drives the future to completion.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The pipeline kind, e.g. `memcpy`.
    fn kind(&self) -> &'static str;
    /// Whether this transport can reach memory at `location`.
    fn can_address(&self, location: MemoryLocation) -> bool;
    /// Runs the batch.
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError>;
}

/// What a backend's factory gets besides its own settings.
#[derive(Clone, Default)]
pub struct RuntimeContext {
    /// The fd side channel, when configured.
    pub fd_channel: Option<Arc<FdChannel>>,
    /// The landing (host-addressable) tier, built before transports and registrars, so that a
    /// device transport can pin its [`Tier::backing_ranges`].
    pub landing_tier: Option<Arc<dyn Tier>>,
    /// CUDA devices the operator asked for (`--devices`); `None` = all the driver reports.
    pub devices: Option<Vec<i32>>,
}

impl std::fmt::Debug for RuntimeContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeContext")
            .field(
                "fd_channel",
                &self.fd_channel.as_ref().map(|c| c.path().to_path_buf()),
            )
            .field(
                "landing_tier",
                &self.landing_tier.as_ref().map(|t| t.kind()),
            )
            .field("devices", &self.devices)
            .finish()
    }
}

/// A documented option of a backend, for `--list-plugins`.
#[derive(Debug, Clone, Copy)]
pub struct PluginOption {
    /// Key in the pipeline table.
    pub name: &'static str,
    /// Default value, as TOML.
    pub default: &'static str,
    /// What it does.
    pub help: &'static str,
}

/// Builds a tier from its pipeline table (the `[[tier]]` entry without `kind`).
pub type TierBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Tier>>;
/// Builds a transport from its pipeline table.
pub type TransportBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Transport>>;
/// Builds a registrar from its pipeline table.
pub type RegistrarBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Registrar>>;

/// A tier kind a linked backend provides.
#[derive(Debug)]
pub struct TierFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: TierBuild,
}

/// A transport kind a linked backend provides.
#[derive(Debug)]
pub struct TransportFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: TransportBuild,
}

/// A registrar kind a linked backend provides.
#[derive(Debug)]
pub struct RegistrarFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Options with defaults.
    pub options: &'static [PluginOption],
    /// The constructor.
    pub build: RegistrarBuild,
}

inventory::collect!(TierFactory);
inventory::collect!(TransportFactory);
inventory::collect!(RegistrarFactory);

fn known<T>(it: impl Iterator<Item = T>, name: impl Fn(&T) -> &'static str) -> String {
    let mut v: Vec<&str> = it.map(|f| name(&f)).collect();
    v.sort_unstable();
    v.dedup();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// Tier kinds linked into this binary, sorted, comma-separated.
pub fn known_tiers() -> String {
    known(inventory::iter::<TierFactory>(), |f| f.kind)
}
/// Transport kinds linked into this binary.
pub fn known_transports() -> String {
    known(inventory::iter::<TransportFactory>(), |f| f.kind)
}
/// Registrar kinds linked into this binary.
pub fn known_registrars() -> String {
    known(inventory::iter::<RegistrarFactory>(), |f| f.kind)
}

/// The tier factory for `kind`, or an error listing the kinds this binary knows.
pub fn tier_factory(kind: &str) -> anyhow::Result<&'static TierFactory> {
    inventory::iter::<TierFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown tier kind {kind:?}; this binary knows: {}",
                known_tiers()
            )
        })
}

/// The transport factory for `kind`, or an error listing the kinds this binary knows.
pub fn transport_factory(kind: &str) -> anyhow::Result<&'static TransportFactory> {
    inventory::iter::<TransportFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown transport kind {kind:?}; this binary knows: {}",
                known_transports()
            )
        })
}

/// The registrar factory for `kind`, or an error listing the kinds this binary knows.
pub fn registrar_factory(kind: &str) -> anyhow::Result<&'static RegistrarFactory> {
    inventory::iter::<RegistrarFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown registrar kind {kind:?}; this binary knows: {}",
                known_registrars()
            )
        })
}

/// A human-readable listing of every linked plugin kind with its options and defaults.
pub fn describe_plugins() -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut section =
        |title: &str, rows: Vec<(&'static str, &'static str, &'static [PluginOption])>| {
            let _ = writeln!(s, "{title}:");
            let mut rows = rows;
            rows.sort_by_key(|r| r.0);
            for (kind, summary, opts) in rows {
                let _ = writeln!(s, "  {kind:<12} {summary}");
                for o in opts {
                    let _ = writeln!(s, "      {} = {}    {}", o.name, o.default, o.help);
                }
            }
        };
    section(
        "tiers",
        inventory::iter::<TierFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "transports",
        inventory::iter::<TransportFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    section(
        "registrars",
        inventory::iter::<RegistrarFactory>()
            .map(|f| (f.kind, f.summary, f.options))
            .collect(),
    );
    s
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
    /// Checks `req` for a registrar of `kind` (named `registrar` in messages): the side channel
    /// is configured (else Precondition), the payload is `kind`, the instance id is
    /// side-channel safe, `alloc_size > 0` and every view lies inside the allocation (else
    /// Invalid). When the request is refused after the channel check, the descriptor already
    /// sent for its key is closed, so the client can resend at once.
    pub fn check(
        registrar: &str,
        kind: PayloadKind,
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
            RegistrationPayload::Native {
                kind: k,
                alloc_size,
                views,
            } if k == kind => (alloc_size, views),
            other => {
                return Err(RegistrarError::Invalid(format!(
                    "the {registrar} registrar cannot import a {} payload",
                    other.kind().name()
                )))
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
