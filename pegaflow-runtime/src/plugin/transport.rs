//! The transport contract: moving byte ranges between a registration and host buffers.
//!
//! Memory spaces are open identifiers ([`MemorySpace`]) that backends declare: a registrar
//! says which space a registration lives in, a transport says which spaces it can address, and
//! the runtime pairs them without knowing any space but host memory.

use async_trait::async_trait;
use pegaflow_api::TransferMode;

use super::pool::HostRegion;

/// Where memory lives: a domain declared by a backend (`"host"` for this process's virtual
/// memory; a device backend declares its own, e.g. one per GPU API) and an ordinal inside it
/// (a device number; 0 for host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemorySpace {
    /// The domain's name, as its backend declares it.
    pub domain: &'static str,
    /// The device ordinal inside the domain (0 for host memory).
    pub ordinal: i32,
}

impl MemorySpace {
    /// Host memory mapped in this process; addresses are host virtual addresses.
    pub const HOST: MemorySpace = MemorySpace {
        domain: "host",
        ordinal: 0,
    };

    /// A space of `domain`, device `ordinal`.
    pub const fn new(domain: &'static str, ordinal: i32) -> Self {
        Self { domain, ordinal }
    }

    /// Whether this is this process's host memory.
    pub fn is_host(&self) -> bool {
        *self == Self::HOST
    }
}

impl std::fmt::Display for MemorySpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_host() {
            f.write_str("host")
        } else {
            write!(f, "{}:{}", self.domain, self.ordinal)
        }
    }
}

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Save (D2H): registered memory → host buffers.
    ToHost,
    /// Load (H2D): host buffers → registered memory.
    ToDevice,
}

/// One contiguous copy between a registration and a host buffer piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Address in the registration's memory (validated by the engine).
    pub device_addr: u64,
    /// Host address inside a live [`crate::HostBuffer`].
    pub host_addr: usize,
    /// Bytes.
    pub len: usize,
}

/// A batch of copies against memory of one space, in one direction.
#[derive(Debug, Clone)]
pub struct CopyBatch {
    /// Where the registration side lives.
    pub location: MemorySpace,
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
/// until then and always drives the future to completion. No default methods: a layer that
/// wraps a transport forwards every call.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The pipeline kind, e.g. `memcpy`.
    fn kind(&self) -> &'static str;
    /// Whether this transport can reach memory in `space`.
    fn can_address(&self, space: MemorySpace) -> bool;
    /// Host memory the runtime installs before serving: every region the landing pool and
    /// the tiers publish. A device transport registers (pins) them, possibly in the
    /// background; a transport that needs nothing returns `Ok(())`. Called once per region
    /// set, before the first copy.
    ///
    /// # Errors
    /// A registration the transport cannot start (the server then fails start-up).
    fn install_host_memory(&self, regions: &[HostRegion]) -> Result<(), TransportError>;
    /// Runs the batch.
    async fn copy(&self, batch: CopyBatch) -> Result<(), TransportError>;
}
