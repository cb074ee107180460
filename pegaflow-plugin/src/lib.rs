//! `pegaflow-plugin`: the contract a backend of the KV-cache server implements, and all it
//! needs to do so. A backend crate (a tier, a transport, a registrar, a peer path, a
//! directory, a layer) depends on this crate and the API types (`pegaflow-api`), never on the
//! runtime; the runtime depends on this crate too, and a server binary links both.
//!
//! What is here:
//! - the traits: [`HostPool`] (the landing tier's allocator), [`Tier`] (key-addressed
//!   storage below host DRAM), [`Transport`] (moves bytes between a registration and host
//!   buffers), [`Registrar`] (imports a client's memory), [`PeerService`] /
//!   [`PeerFetcher`] / [`PeerDataPath`] (cross-node fetch), [`Directory`] (which node holds
//!   which block);
//! - the block vocabulary ([`block`]: keys, shapes, sealed blocks, slots) and host buffers
//!   ([`buffer`]);
//! - narrow views of the runtime a backend may use: [`BlockHost`] (this node's host DRAM,
//!   for peer backends), [`SideChannel`] (native registrations' descriptors),
//!   [`MetricsRegistry`] (where each component registers its own metric families),
//!   [`HealthBoard`] (what `/health?verbose=1` shows), [`IndexEvents`] (what happened to each
//!   key), [`HolderLookup`] (the directory as the peer rung asks it);
//! - factories ([`TierFactory`], [`TransportFactory`], ...) that a backend submits with
//!   `inventory::submit!`, their settings' schema and flags, and the registry lookups;
//! - layers ([`layers`]: metrics, fault injection, admission) that wrap any tier or transport;
//! - units ([`units`]: sizes as PegaFlow's flags write them).
//!
//! Must never: depend on the runtime or on a backend, or hold server state of its own (the
//! registry is what the linked crates submitted).

pub mod block;
pub mod buffer;
mod directory;
pub mod events;
mod factory;
pub mod health;
mod layer;
pub mod layers;
pub mod metrics;
mod peer;
mod pool;
mod preflight;
mod registrar;
pub mod side_channel;
mod tier;
mod transport;
pub mod units;

pub use block::{BlockKey, BlockShape, KeyRef, SealedBlock, Slot};
pub use buffer::{Extent, HostBuffer, HostMemory, ReleaseBatch};
pub use directory::{
    directory_factory, directory_namespace, known_directories, Directory, DirectoryBuild,
    DirectoryError, DirectoryFactory, HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix,
};
pub use events::{IndexEvent, IndexEventKind, IndexEvents, INDEX_EVENT_BACKLOG};
pub use factory::*;
pub use health::{HealthBoard, HealthState};
pub use layer::{
    known_layers, layer_factory, parse_layer_entry, wrap_tier, wrap_transport, LayerContext,
    LayerFactory, TierLayerBuild, TransportLayerBuild,
};
pub use metrics::MetricsRegistry;
pub use peer::{
    known_peer_services, peer_service_factory, BlockHost, DefaultPeerPath, HolderLookup,
    HostAllocError, PeerDataError, PeerDataPath, PeerFetcher, PeerRead, PeerService,
    PeerServiceBuild, PeerServiceFactory, RemoteRange,
};
pub use pool::{HostPool, HostRegion};
pub use preflight::{
    can_create_in, can_read_write, creatable, preflights, Preflight, PreflightReport,
};
pub use registrar::{
    ImportRequest, LayerRegion, NativeAllocationSpec, NativeImport, NativeImportV2,
    NativeTensorView, NativeView, PayloadCarrier, PayloadScheme, Registrar, RegistrarError,
    RegistrarTraits, Registration, RegistrationPayload,
};
pub use side_channel::SideChannel;
pub use tier::{Recovered, Tier, TierCapabilities, TierError, TierGet, TierPut};
pub use transport::{
    op_parts, signal_near_end, CopyBatch, CopyOp, Direction, MemorySpace, NearEnd, OpPartSender,
    OpParts, PartTally, SourceRead, Transport, TransportError,
};
