//! The delegate for the server-to-server RPCs (peer fetch): `QueryBlocksForTransfer`,
//! `ReleaseTransferLock` and `RdmaHandshake` (PegaFlow's messages and field numbers,
//! docs/PROTOCOL.md).
//!
//! The runtime owns the gRPC service but not these RPCs' semantics: a cross-node backend
//! (a TCP or RDMA transport crate) registers a [`PeerServiceFactory`] and is named in the
//! pipeline (`[peer] kind = "..."`); the service hands each request to it, with a
//! [`BlockHost`]: the view of this node's host DRAM it locks and exposes blocks of. Without a `[peer]` entry the RPCs answer
//! FAILED_PRECONDITION ("cross-node transfer is not configured"), and ReleaseTransferLock
//! answers success with 0 blocks released (nothing can be locked).
//!
//! The requesting side has two more seams:
//! - [`PeerFetcher`]: the peer rung of the promotion ladder (DRAM → peer → lower tiers →
//!   miss). The tier stack asks the directory which node holds the continuation of a query
//!   and hands the fetcher that node and the keys; the fetcher locks them there
//!   (`QueryBlocksForTransfer`), pulls the bytes into host buffers it allocates from the
//!   stack, and releases the lock. The stack indexes what landed, like any promoted block.
//! - [`PeerDataPath`]: "pull these remote slots into these local buffers", the one piece a
//!   transport (TCP, RDMA, an emulator) implements; everything around it (the directory, the
//!   locks, bounds checks, suspect marking) is the fetcher's.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use pegaflow_proto as pb;

use crate::block::{BlockKey, BlockShape, KeyRef, SealedBlock};
use crate::buffer::HostBuffer;
use crate::directory::NodePrefix;
use crate::factory::{ConfigSchema, FactoryFlag, RuntimeContext};
use crate::pool::HostPool;

/// This node's host DRAM as a peer backend sees it: the sealed blocks it may lock and expose
/// to other nodes, and the allocator a fetch lands blocks in. The runtime's tier stack
/// implements it; a backend never sees the stack itself.
pub trait BlockHost: Send + Sync + 'static {
    /// The sealed DRAM block under `key`, marked recently used; `None` when DRAM does not
    /// hold it. The returned `Arc` keeps the block's memory alive (never evicted while held).
    fn get_touch(&self, key: KeyRef<'_>) -> Option<Arc<SealedBlock>>;
    /// One host buffer per entry of `lens` (bytes), all or nothing, evicting least recently
    /// used unreferenced blocks as a Save's allocation does. Errors when the pool cannot make
    /// room (every block referenced, or more than its capacity).
    fn allocate(&self, lens: &[usize]) -> Result<Vec<HostBuffer>, HostAllocError>;
    /// The landing pool: its host regions (for a NIC to register) and the footprint of a
    /// buffer (`footprint_bytes`, for a landed block's accounting).
    fn pool(&self) -> &Arc<dyn HostPool>;
}

/// Why [`BlockHost::allocate`] could not serve an allocation (the message says how much was
/// asked and what the pool holds).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HostAllocError(pub String);

/// Who holds the continuation of a prefix: the directory as the tier stack's peer rung asks
/// it. The runtime's directory client implements it.
#[async_trait]
pub trait HolderLookup: Send + Sync + 'static {
    /// Which nodes hold `hashes` (group 0 of `namespace`), from the first, as runs in prefix
    /// order; this node is never among them. Empty when nothing is known or the directory is
    /// down (the stack then falls through to the lower tiers).
    async fn holders(&self, namespace: &str, hashes: &[Vec<u8>]) -> Vec<NodePrefix>;
}

/// Serves the server-to-server RPCs for one cross-node backend. Requests arrive as decoded
/// by the gRPC layer; errors are gRPC statuses (the delegate decides codes and messages).
#[async_trait]
pub trait PeerService: Send + Sync + 'static {
    /// The pipeline kind it was built from.
    fn kind(&self) -> &'static str;
    /// Finds the requested blocks in `host`'s DRAM, locks them under a transfer session and
    /// answers their slot locations.
    async fn query_blocks_for_transfer(
        &self,
        host: &Arc<dyn BlockHost>,
        req: pb::QueryBlocksForTransferRequest,
    ) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status>;
    /// Releases a transfer session's locks.
    async fn release_transfer_lock(
        &self,
        host: &Arc<dyn BlockHost>,
        req: pb::ReleaseTransferLockRequest,
    ) -> Result<pb::ReleaseTransferLockResponse, tonic::Status>;
    /// Exchanges connection metadata with a requesting peer.
    async fn rdma_handshake(
        &self,
        host: &Arc<dyn BlockHost>,
        req: pb::RdmaHandshakeRequest,
    ) -> Result<pb::RdmaHandshakeResponse, tonic::Status>;
    /// The requesting side of this backend, when it fetches from other nodes: the server
    /// installs it as the peer rung of the tier stack (with the directory, which it needs
    /// to find holders). `None`: this node serves peers but never fetches.
    fn fetcher(&self) -> Option<Arc<dyn PeerFetcher>>;
}

/// The peer rung of the promotion ladder: fetches blocks another node holds into this
/// node's host DRAM.
///
/// Contract:
/// - [`PeerFetcher::fetch`] returns by `deadline` whatever the peer does (a dead, frozen or
///   lying peer included) and never leaves I/O running into memory it returned or dropped;
/// - a returned block holds exactly the bytes the holder had under its key, in the slot
///   shape `expect` names (when given); blocks are returned as a prefix of `keys`, in order;
/// - it allocates only what it fetches, through [`BlockHost::allocate`] (the normal LRU),
///   never more because a peer described its memory oddly (NUMA nodes, slot splits);
/// - it never inserts into the index itself: the stack does, so the directory advertises
///   a fetched block only once it is resident.
#[async_trait]
pub trait PeerFetcher: Send + Sync + 'static {
    /// The backend kind (metric label).
    fn kind(&self) -> &'static str;
    /// Whether to skip asking `node` (an advertised `ip:port`) for a run starting at
    /// `first_hash`, and why (a metric label): `"suspect"` when the node failed or timed out
    /// recently, `"stale"` when it recently answered that it does not hold `first_hash`
    /// although the directory said so (a stale advertisement: asking again would loop).
    /// `None`: ask. The stack then falls through to the lower tiers.
    fn skip(&self, node: &str, first_hash: &[u8]) -> Option<&'static str>;
    /// Fetches `keys` (a prefix-ordered run the directory says `node` holds) into host
    /// buffers from `host`. Returns the blocks that landed whole, a prefix of `keys`
    /// (empty on any failure: the node is then marked suspect, except when it merely held
    /// fewer blocks than advertised).
    async fn fetch(
        &self,
        host: &Arc<dyn BlockHost>,
        node: &str,
        keys: &[BlockKey],
        expect: Option<&BlockShape>,
        deadline: Instant,
    ) -> Vec<Arc<SealedBlock>>;
}

/// One contiguous byte range in a peer's memory, as the peer described it
/// (`QueryBlocksForTransfer`'s `k_ptr`/`k_size`, `v_ptr`/`v_size`). Only the peer
/// interprets `addr`; the requester never dereferences it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// Address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One local destination of a pull: the remote ranges, concatenated in order, land in
/// `dest` from `dest_offset` on (`dest_offset + Σ len ≤ dest.len()`, checked by the caller
/// before the pull).
#[derive(Debug, Clone)]
pub struct PeerRead {
    /// Where the bytes go; the data path keeps this `Arc` until its I/O into it has ended.
    pub dest: Arc<HostBuffer>,
    /// Byte offset in `dest` where the first range lands.
    pub dest_offset: usize,
    /// The peer's ranges, in order.
    pub ranges: Vec<RemoteRange>,
}

/// Why a pull failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerDataError {
    /// The deadline passed before every byte landed.
    #[error("peer transfer timed out")]
    Timeout,
    /// The peer could not be reached, or the connection broke.
    #[error("peer unreachable: {0}")]
    Unreachable(String),
    /// The peer refused (unknown or expired session, a range outside its locked blocks) or
    /// answered something malformed.
    #[error("peer refused the transfer: {0}")]
    Refused(String),
}

/// The peer data path: pull byte ranges of a peer's locked blocks into local host buffers.
/// The TCP transport implements it; an RDMA backend (one-sided READ of the peer's
/// registered pool) or an in-tree emulator plugs in the same way, and the fetcher around it
/// (directory, locks, bounds checks, suspect marking, metrics) stays unchanged.
///
/// Contract, for every implementation:
/// - `pull` completes `Ok` only when every byte of every read has landed in its `dest`,
///   exactly as the peer holds it; any failure is an `Err`, and the caller discards every
///   destination of the batch (a failed pull may have written part of them);
/// - it returns by `deadline` (`Err(Timeout)`), and when it returns, no I/O of the batch is
///   still running into a destination: it keeps each `dest` `Arc` until its own I/O (or
///   the NIC's DMA) on it has been drained or fenced, so dropping the returned future
///   never leaves a write into freed memory;
/// - `session` is the transfer session the ranges were locked under on the peer
///   (`transfer_session_id`); a data path that can renew the lease does so while it moves
///   data;
/// - `endpoint` is what the peer's handshake (`RdmaHandshake` metadata) told the fetcher:
///   its data address; the data path interprets it;
/// - it never reads or writes outside the `dest` buffers it is handed.
#[async_trait]
pub trait PeerDataPath: Send + Sync + 'static {
    /// The data path's name (metric label), e.g. `tcp`.
    fn kind(&self) -> &'static str;
    /// Makes sure a connection to the peer at `endpoint` is up (opening one if needed), by
    /// `deadline`. The fetcher calls it before it locks anything on the peer, so that the
    /// peer can tie the locks to a live connection (TCP: the requester's last connection
    /// closing releases them; RDMA: the queue pair's teardown).
    async fn connect(&self, endpoint: &str, deadline: Instant) -> Result<(), PeerDataError>;
    /// Pulls `reads` from the peer at `endpoint`, locked under `session`.
    async fn pull(
        &self,
        endpoint: &str,
        session: &str,
        reads: Vec<PeerRead>,
        deadline: Instant,
    ) -> Result<(), PeerDataError>;
}

/// Builds a peer delegate from its `[peer]` table (without `kind`).
pub type PeerServiceBuild =
    fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn PeerService>>;

/// A peer-delegate kind a linked backend provides.
#[derive(Debug)]
pub struct PeerServiceFactory {
    /// Kind name used in `[peer] kind = "..."`.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Settings with defaults and help (the `[peer]` table).
    pub config: ConfigSchema,
    /// Command-line flags overriding its settings (applied to the `[peer]` table when it is
    /// of this kind; `adds_entry` adds the table when the pipeline has none).
    pub flags: &'static [FactoryFlag],
    /// The constructor.
    pub build: PeerServiceBuild,
}

inventory::collect!(PeerServiceFactory);

/// The peer path a binary serves when a directory flag (`--metaserver-addr`) joins the node to
/// a cluster and the command line names none (no `--nics`, no `[peer]`): without one the node
/// would advertise blocks that no peer can fetch from it. The peer kind's table gets one
/// setting, its listen address: the host of `--addr` (the address peers already reach this
/// node at) with port 0 (any free port; peers learn it in the handshake). A binary submits at
/// most one with `inventory::submit!` (`pegaflow-server` names its TCP path); in a binary
/// without one, such a directory flag alone is refused with a message.
#[derive(Debug)]
pub struct DefaultPeerPath {
    /// The `[peer]` kind, e.g. `tcp`; a linked [`PeerServiceFactory`] of that kind.
    pub kind: &'static str,
    /// The setting that takes the listen address, e.g. `data_addr`.
    pub addr_setting: &'static str,
    /// The flag that sets it, named in the start-up note, e.g. `peer-data-addr`.
    pub addr_flag: &'static str,
}

inventory::collect!(DefaultPeerPath);

/// Peer-delegate kinds linked into this binary, sorted, comma-separated.
pub fn known_peer_services() -> String {
    crate::factory::known(inventory::iter::<PeerServiceFactory>(), |f| f.kind)
}

/// The peer-delegate factory for `kind`, or an error listing the kinds this binary knows.
pub fn peer_service_factory(kind: &str) -> anyhow::Result<&'static PeerServiceFactory> {
    inventory::iter::<PeerServiceFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown peer kind {kind:?}; this binary knows: {}",
                known_peer_services()
            )
        })
}
