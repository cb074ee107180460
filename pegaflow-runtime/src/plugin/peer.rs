//! The delegate for the server-to-server RPCs (peer fetch): `QueryBlocksForTransfer`,
//! `ReleaseTransferLock` and `RdmaHandshake` (engine-wire.md §11, PegaFlow's field numbers).
//!
//! The runtime owns the gRPC service but not these RPCs' semantics: a cross-node backend
//! (a TCP or RDMA transport crate) registers a [`PeerServiceFactory`] and is named in the
//! pipeline (`[peer] kind = "..."`); the service hands each request to it, with the tier
//! stack, whose DRAM blocks it locks and exposes. Without a `[peer]` entry the RPCs answer
//! FAILED_PRECONDITION ("cross-node transfer is not configured"), and ReleaseTransferLock
//! answers success with 0 blocks released (nothing can be locked).

use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_proto as pb;

use super::{ConfigSchema, RuntimeContext};
use crate::store::TierStack;

/// Serves the server-to-server RPCs for one cross-node backend. Requests arrive as decoded
/// by the gRPC layer; errors are gRPC statuses (the delegate decides codes and messages).
#[async_trait]
pub trait PeerService: Send + Sync + 'static {
    /// The pipeline kind it was built from.
    fn kind(&self) -> &'static str;
    /// Finds the requested blocks in `store`'s DRAM, locks them under a transfer session and
    /// answers their slot locations.
    async fn query_blocks_for_transfer(
        &self,
        store: &Arc<TierStack>,
        req: pb::QueryBlocksForTransferRequest,
    ) -> Result<pb::QueryBlocksForTransferResponse, tonic::Status>;
    /// Releases a transfer session's locks.
    async fn release_transfer_lock(
        &self,
        store: &Arc<TierStack>,
        req: pb::ReleaseTransferLockRequest,
    ) -> Result<pb::ReleaseTransferLockResponse, tonic::Status>;
    /// Exchanges connection metadata with a requesting peer.
    async fn rdma_handshake(
        &self,
        store: &Arc<TierStack>,
        req: pb::RdmaHandshakeRequest,
    ) -> Result<pb::RdmaHandshakeResponse, tonic::Status>;
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
    /// The constructor.
    pub build: PeerServiceBuild,
}

inventory::collect!(PeerServiceFactory);

/// Peer-delegate kinds linked into this binary, sorted, comma-separated.
pub fn known_peer_services() -> String {
    super::known(inventory::iter::<PeerServiceFactory>(), |f| f.kind)
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
