//! The verbs abstraction both backends implement: a NIC ([`Nic`]) with its capabilities,
//! memory regions and one completion queue, and reliable-connected queue pairs ([`QueuePair`])
//! that post one-sided READs.
//!
//! A queue pair's life is an explicit state machine ([`QpState`]), the one verbs defines:
//!
//! ```text
//! Reset ─► Init ─► Rtr ─► Rts          (connect: local setup, then the peer's QPN/PSN/address)
//!   ▲        │      │      │
//!   └────────┴──────┴──────┴──► Error  (any failure or timeout; every posted WR then completes,
//!                                       flushed, in order: the drain)
//! ```
//!
//! Only `Rts` accepts READs that move data; a READ posted in `Error` completes at once as
//! [`WcStatus::Flushed`] behind every earlier WR of the queue pair, which is how a transfer
//! drains: move to `Error`, post one signalled marker, wait for the marker's completion;
//! then no DMA of the queue pair can still write into a destination.
//!
//! Must never: hand a completion for a WR that was not posted, or reorder the completions of
//! one queue pair (reliable connection: in order).

use std::time::Duration;

/// A queue pair's state (verbs' `IBV_QPS_*`, without the drain states this code never uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created, or reset: posts are refused.
    Reset,
    /// Local attributes set (port, access): posts are still refused.
    Init,
    /// Ready to receive: connected to the peer's QPN/PSN/address.
    Rtr,
    /// Ready to send: READs may be posted.
    Rts,
    /// Failed or fenced: every WR completes flushed.
    Error,
}

/// Why a transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("queue pair transition {from:?} -> {to:?} is not allowed")]
pub struct BadTransition {
    /// The state it was in.
    pub from: QpState,
    /// The state asked for.
    pub to: QpState,
}

impl QpState {
    /// Whether verbs allow `self → to`: Reset→Init→Rtr→Rts in order, any state to Error or
    /// Reset, Error only to Reset (or Error again, a no-op).
    pub fn can_go(self, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (self, to),
            (Reset, Init) | (Init, Rtr) | (Rtr, Rts) | (_, Error) | (_, Reset)
        )
    }

    /// `to`, if allowed from `self`.
    ///
    /// # Errors
    /// [`BadTransition`] when verbs do not allow it.
    pub fn go(self, to: QpState) -> Result<QpState, BadTransition> {
        if self.can_go(to) {
            Ok(to)
        } else {
            Err(BadTransition { from: self, to })
        }
    }
}

/// How a NIC's port addresses peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: peers are addressed by LID (never 0 on an active port).
    Infiniband,
    /// RoCEv2 (Ethernet): peers are addressed by GID (an IPv6-form address), the LID is 0.
    Ethernet,
}

/// What a NIC declares (the requester pairs NICs by these, never by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicCaps {
    /// Device name (`mlx5_0`).
    pub name: String,
    /// Port number used (1-based).
    pub port: u8,
    /// Link layer of that port.
    pub link: LinkLayer,
    /// The port's LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The GID at `gid_index` (RoCEv2; may be zero on InfiniBand).
    pub gid: [u8; 16],
    /// GID table index used.
    pub gid_index: u8,
    /// NUMA node the device is attached to; -1 = unknown.
    pub numa_node: i32,
    /// The port's active MTU as verbs numbers it (1 = 256 … 5 = 4096 bytes; 0 = unknown).
    pub mtu: u8,
    /// Most outstanding send WRs per queue pair.
    pub max_qp_wr: u32,
    /// Largest single message in bytes.
    pub max_msg_bytes: u64,
}

/// A registered memory region's keys and bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// First byte (host virtual address).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Key local WRs name it by.
    pub lkey: u32,
    /// Key peers name it by in their READs.
    pub rkey: u32,
}

impl MemoryRegion {
    /// Whether `[addr, addr + len)` lies inside the region (an empty range never does).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr.saturating_add(self.len))
    }
}

/// What a queue pair needs of its peer to go to RTR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpPeer {
    /// The peer queue pair's number (24 bits).
    pub qpn: u32,
    /// The peer's initial packet sequence number (24 bits).
    pub psn: u32,
    /// The peer port's LID (InfiniBand).
    pub lid: u16,
    /// The peer port's GID (RoCEv2).
    pub gid: [u8; 16],
    /// Link layer both ports speak.
    pub link: LinkLayer,
    /// The peer port's active MTU (verbs numbering, 0 = unknown): the path MTU is the
    /// smaller of both ports'.
    pub mtu: u8,
    /// The emulator's fabric address of the peer (its socket); empty on real hardware.
    pub fabric: String,
}

/// One one-sided READ: `len` bytes at `remote_addr` (under `rkey`) into `local_addr` (under
/// `lkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Destination (host virtual address in this process).
    pub local_addr: u64,
    /// Destination region key.
    pub lkey: u32,
    /// Source address in the peer's address space.
    pub remote_addr: u64,
    /// Source region key.
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
    /// Whether a success produces a completion (errors always do).
    pub signaled: bool,
}

/// A completion's status (verbs' `IBV_WC_*`, the ones that matter here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// The WR completed.
    Success,
    /// The peer refused the access (wrong rkey, out of its region's bounds).
    RemoteAccess,
    /// The local buffer is not in a registered region (wrong lkey, out of bounds).
    LocalProtection,
    /// No answer from the peer after the transport's retries (a dead or unreachable peer).
    RetryExceeded,
    /// Flushed: the queue pair was in Error when the WR's turn came.
    Flushed,
    /// Anything else the device reported (vendor syndrome in the message).
    Other(u32),
}

/// One entry of a completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The WR's id.
    pub wr_id: u64,
    /// The queue pair it belongs to.
    pub qpn: u32,
    /// What happened.
    pub status: WcStatus,
}

/// A verbs call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device or library on this machine, or the named device is absent.
    #[error("RDMA unavailable: {0}")]
    Unavailable(String),
    /// A state transition verbs refuse.
    #[error(transparent)]
    Transition(#[from] BadTransition),
    /// A post in a state that does not accept it, or beyond the queue's depth.
    #[error("post refused: {0}")]
    Post(String),
    /// A device call failed (the call and errno in the message).
    #[error("verbs call failed: {0}")]
    Device(String),
}

/// One NIC opened for this server: its protection domain, memory regions and one
/// completion queue shared by all its queue pairs (a poller thread per NIC drains it).
pub trait Nic: Send + Sync + 'static {
    /// What it declares.
    fn caps(&self) -> &NicCaps;
    /// Registers `[addr, addr + len)` of this process (a pool region, once per NIC) for
    /// local writes and remote reads.
    ///
    /// # Safety
    /// The range stays mapped until the NIC is dropped.
    unsafe fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion, VerbsError>;
    /// A new reliable-connected queue pair in `Reset`, completing into this NIC's queue.
    fn create_qp(&self) -> Result<Box<dyn QueuePair>, VerbsError>;
    /// Takes up to `max` completions, waiting up to `wait` for the first.
    fn poll(&self, out: &mut Vec<Completion>, max: usize, wait: Duration) -> usize;
}

/// A reliable-connected queue pair.
pub trait QueuePair: Send + Sync + 'static {
    /// Its number (24 bits), unique on its NIC while it lives.
    fn qpn(&self) -> u32;
    /// Its initial send PSN.
    fn psn(&self) -> u32;
    /// Its state now.
    fn state(&self) -> QpState;
    /// Reset → Init (local port, remote-read access).
    fn to_init(&self) -> Result<(), VerbsError>;
    /// Init → Rtr, connected to `peer`.
    fn to_rtr(&self, peer: &QpPeer) -> Result<(), VerbsError>;
    /// Rtr → Rts.
    fn to_rts(&self) -> Result<(), VerbsError>;
    /// Any state → Error (idempotent): every outstanding and later WR completes flushed.
    fn to_error(&self) -> Result<(), VerbsError>;
    /// Posts `wrs` in order. In `Error` they are accepted and complete flushed; in `Reset`,
    /// `Init` or `Rtr` the post is refused.
    ///
    /// # Safety
    /// Every WR's local range lies in memory that stays valid until its completion (or a
    /// later WR's completion on this queue pair) has been polled.
    unsafe fn post_read(&self, wrs: &[ReadWr]) -> Result<(), VerbsError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    #[test]
    fn the_state_machine_is_the_verbs_one() {
        assert_eq!(Reset.go(Init), Ok(Init));
        assert_eq!(Init.go(Rtr), Ok(Rtr));
        assert_eq!(Rtr.go(Rts), Ok(Rts));
        for s in [Reset, Init, Rtr, Rts, Error] {
            assert!(s.can_go(Error), "{s:?} -> Error");
            assert!(s.can_go(Reset), "{s:?} -> Reset");
        }
        assert!(Reset.go(Rts).is_err(), "no skipping");
        assert!(Init.go(Rts).is_err());
        assert!(Rts.go(Rtr).is_err(), "no going back but to Reset");
        assert!(
            Error.go(Rts).is_err(),
            "an errored QP is reset before reuse"
        );
        assert!(Error.go(Init).is_err());
    }

    #[test]
    fn region_bounds() {
        let mr = MemoryRegion {
            addr: 0x1000,
            len: 0x1000,
            lkey: 1,
            rkey: 2,
        };
        assert!(mr.contains(0x1000, 0x1000));
        assert!(mr.contains(0x1fff, 1));
        assert!(!mr.contains(0x1fff, 2));
        assert!(!mr.contains(0xfff, 1));
        assert!(!mr.contains(0x1000, 0));
        assert!(!mr.contains(u64::MAX, 2));
    }
}
