//! The host-pool contract: the landing tier's facet that hands out host buffers.
//!
//! Transports copy straight into a pool's buffers on Save and out of them on Load; I/O
//! engines of lower tiers read into them on promotion. A block lands in host memory by
//! adopting the buffers it was copied into, never by a second copy. The pool does not decide
//! what to evict: the tier stack does, and frees buffers by dropping them.

use std::any::Any;
use std::sync::Arc;

use crate::buffer::HostBuffer;

/// One range of host memory a pool publishes, so that transports can register (pin) it with
/// a device or a NIC before serving. `owner` keeps the memory mapped: a transport that
/// registers the range holds it until it has unregistered the range.
#[derive(Clone)]
pub struct HostRegion {
    /// Start address (host virtual address).
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Keeps the range mapped while held.
    pub owner: Arc<dyn Any + Send + Sync>,
}

impl HostRegion {
    /// `(addr, len)`.
    pub fn range(&self) -> (usize, usize) {
        (self.addr, self.len)
    }
}

impl PartialEq for HostRegion {
    fn eq(&self, other: &Self) -> bool {
        self.range() == other.range()
    }
}

impl Eq for HostRegion {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// The landing tier's allocator (host DRAM). Every method is thread-safe and never blocks on
/// I/O.
pub trait HostPool: Send + Sync + 'static {
    /// The pipeline kind this pool was built from.
    fn kind(&self) -> &'static str;
    /// The `tier` label of the hit/miss metrics for blocks served from this pool (PegaFlow's
    /// dashboards call host memory `ram`).
    fn metric_label(&self) -> &'static str;
    /// Bytes the pool can hand out.
    fn capacity_bytes(&self) -> u64;
    /// Bytes currently handed out (after rounding).
    fn used_bytes(&self) -> u64;
    /// Bytes not handed out; `capacity_bytes() - used_bytes()` at some instant.
    fn free_bytes(&self) -> u64;
    /// Bytes an allocation of `len` bytes takes from the capacity (after the pool's rounding);
    /// `u64::MAX` when `len` cannot be served at all.
    fn footprint_bytes(&self, len: usize) -> u64;
    /// Allocates one buffer per entry of `lens`, all or nothing, each extent starting at an
    /// address that is a multiple of `align` bytes (a power of two; 1 for no constraint).
    /// The pool carves the batch from one contiguous range where it can (in order), so a
    /// transport sees one large host range for a whole Save while each block can still be
    /// freed on its own; when its free space is fragmented it may return several extents per
    /// buffer. `None` when the free bytes do not cover the batch (the caller evicts and
    /// retries) or `align` cannot be honoured.
    fn allocate_batch(&self, lens: &[usize], align: usize) -> Option<Vec<HostBuffer>>;
    /// The host ranges backing the pool, for transports to register.
    fn regions(&self) -> Vec<HostRegion>;
    /// Gives memory that no live buffer uses back to the OS (after a cleanup); best effort.
    fn trim(&self);
}
