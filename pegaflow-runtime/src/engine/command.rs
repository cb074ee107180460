//! Domain commands: what each engine RPC asks, already decoded from the wire and shape-checked
//! by the service ([`crate::decode`]), and the engine's domain answers.
//!
//! Owns the vocabulary between the gRPC service and the engine. Must never: refer to wire
//! (protobuf) types, or carry a field the decoder has not checked for the pure shape rules
//! (list lengths, signs, caps) the engine relies on. Checks that need server state (instances,
//! workers, leases, layouts) are the engine's.

use pegaflow_api::{TransferMode, LEASE_BYTES};
pub use pegaflow_proto::HashList;

use crate::plugin::RegistrationPayload;

pub use pegaflow_api::limits::MAX_HASH_BYTES;

/// RegisterContextBatch: one worker's KV memory.
///
/// Decoded: the client version is accepted, ids and sizes are in range, every per-layer list
/// has one entry per layer, layer names are non-empty and distinct, and the payload is of one
/// carrier only.
#[derive(Debug, Clone)]
pub struct RegisterCommand {
    /// The client's instance id (non-empty; side-channel safe for native registrations).
    pub instance_id: String,
    /// Cache namespace.
    pub namespace: String,
    /// The worker's device id (≥ 0).
    pub device_id: i32,
    /// TP rank (< `tp_size`).
    pub tp_rank: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// TP degree (> 0).
    pub tp_size: u32,
    /// Workers of the instance (> 0).
    pub world_size: u32,
    /// Page-first host layout (then every layer is in storage group 0).
    pub page_first: bool,
    /// Requested transfer mode.
    pub transfer_mode: TransferMode,
    /// The layers, in request order (at least one).
    pub layers: Vec<RegisterLayer>,
    /// The memory description a registrar imports (one entry per layer).
    pub payload: RegistrationPayload,
}

impl RegisterCommand {
    /// Whether the memory arrives on the fd side channel (a native registration).
    pub fn native(&self) -> bool {
        self.payload.is_native()
    }
}

/// One layer of a [`RegisterCommand`]: its name and its declared layout.
#[derive(Debug, Clone)]
pub struct RegisterLayer {
    /// Layer name (non-empty, unique in the command).
    pub name: String,
    /// Blocks of the layer.
    pub num_blocks: u64,
    /// Bytes of one segment of one block.
    pub bytes_per_block: u64,
    /// Segments per block (K and V: 2).
    pub segments: u32,
    /// Distance between segments, in bytes.
    pub kv_stride_bytes: u64,
    /// Native registrations: distance from block i to block i + 1, in bytes.
    pub block_stride_bytes: Option<u64>,
    /// Storage group.
    pub group: u32,
}

/// Save: copy the named layers' device blocks into the store under their hashes.
///
/// Decoded: `device_id` ≥ 0, every layer has as many hashes as block ids, no hash is longer
/// than [`MAX_HASH_BYTES`].
#[derive(Debug, Clone)]
pub struct SaveCommand {
    /// The instance.
    pub instance_id: String,
    /// The worker's device id (≥ 0).
    pub device_id: i32,
    /// The worker's TP rank, as the client believes it.
    pub tp_rank: u32,
    /// The worker's PP rank, as the client believes it.
    pub pp_rank: u32,
    /// Per layer: the blocks to save (layers with no block are ignored).
    pub layers: Vec<SaveLayer>,
}

/// One layer of a [`SaveCommand`].
#[derive(Debug, Clone)]
pub struct SaveLayer {
    /// Layer name.
    pub name: String,
    /// Device block ids, one per hash.
    pub block_ids: Vec<u32>,
    /// Block hashes, one per block id (one buffer for the layer, as decoded).
    pub hashes: HashList,
}

/// How a Load reports its completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadCompletion {
    /// The RPC returns when the copy has finished (native clients).
    Wait,
    /// The RPC returns at once; the outcome is written to the named shared-memory load-state
    /// word (the published client).
    StateWord(String),
}

/// Load: copy leased blocks into the worker's device blocks.
///
/// Decoded: the completion mode is consistent (a waiting load names no state word). The device
/// id and the lease tokens are checked by the engine, after it attached the state word, so
/// that a refused load still reports −1 there.
#[derive(Debug, Clone)]
pub struct LoadCommand {
    /// The instance.
    pub instance_id: String,
    /// The worker's TP rank, as the client believes it.
    pub tp_rank: u32,
    /// The worker's device id.
    pub device_id: i32,
    /// How completion is reported.
    pub completion: LoadCompletion,
    /// Load groups: each a list of layer names that receive the same blocks.
    pub groups: Vec<Vec<String>>,
    /// One entry per lease to load.
    pub leases: Vec<LeaseLoad>,
}

/// The blocks of one lease, and where each goes per load group.
#[derive(Debug, Clone)]
pub struct LeaseLoad {
    /// The lease token, as sent (parsed by the engine).
    pub lease: Vec<u8>,
    /// Per load group, per leased block: the destination block id, or `None` to skip it.
    pub targets_by_group: Vec<Vec<Option<u32>>>,
}

/// QueryPrefetch: which of the hashes are cached (group 0: the longest prefix).
///
/// Decoded: `req_id` is non-empty.
#[derive(Debug, Clone)]
pub struct QueryCommand {
    /// The instance.
    pub instance_id: String,
    /// The query's id (non-empty): a re-poll of a Loading answer carries the same one.
    pub req_id: String,
    /// Block hashes, in prefix order.
    pub hashes: Vec<Vec<u8>>,
    /// Storage group: 0 asks for a prefix, > 0 for membership per position.
    pub group_id: u32,
    /// Membership queries: all or nothing.
    pub wait_for_full_prefix: bool,
}

/// The engine's answer to a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryAnswer {
    /// The hits, leased when there are any.
    Ready {
        /// Blocks hit (and leased).
        num_hit_blocks: u64,
        /// The lease pinning them; `None` on a miss.
        lease: Option<[u8; LEASE_BYTES]>,
        /// Membership queries: the positions hit, in order (empty for prefix queries).
        hit_positions: Vec<u32>,
    },
    /// Blocks below DRAM are being promoted: ask again with the same `req_id`.
    Loading,
}

impl QueryAnswer {
    /// A miss: nothing hit, no lease.
    pub fn miss() -> Self {
        QueryAnswer::Ready {
            num_hit_blocks: 0,
            lease: None,
            hit_positions: Vec::new(),
        }
    }
}
