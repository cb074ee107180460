//! The bounds the server (and `pegaflow-metaserver`, and every directory backend) puts on the
//! fields a client sends: a request past one is refused with INVALID_ARGUMENT naming the field
//! and the limit, before anything changes. One definition, so that a bound is the same
//! whichever service a client talks to.

/// Longest `instance_id` of any request, in bytes (vLLM's are UUID-based, about 40 bytes;
/// native ones at most 128).
pub const MAX_INSTANCE_ID_BYTES: usize = 256;
/// Longest `namespace` (RegisterContextBatch, Session, QueryBlocksForTransfer), in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 1024;
/// Longest layer name (RegisterContextBatch, Save, Load), in bytes (vLLM's look like
/// `model.layers.31.self_attn.attn`).
pub const MAX_LAYER_NAME_BYTES: usize = 256;
/// Most layers one request names: registered by one worker, saved by one Save, loaded by one
/// Load (all groups together).
pub const MAX_LAYERS_PER_REQUEST: usize = 4096;
/// Longest QueryPrefetch `req_id`, in bytes (vLLM request ids, which a client may extend).
pub const MAX_REQ_ID_BYTES: usize = 1024;
/// Shortest block hash, in bytes: an empty hash names no content.
pub const MIN_HASH_BYTES: usize = 1;
/// Most entries of one block list: hashes of a query (own or a peer's), block ids and hashes
/// of one saved layer, destinations of one lease's group, leases of one Load (2^20: a
/// 16M-token prompt in 16-token blocks; 1M 32-byte hashes are 34 MiB, inside the 64 MiB
/// message limit).
pub const MAX_BLOCKS_PER_LIST: usize = 1 << 20;
/// Longest `load_state_shm`, in bytes (what `LoadStateWriter::attach` opens; the published client
/// sends `pega_load_` + 32 hex digits).
pub const MAX_LOAD_STATE_NAME_BYTES: usize = 200;
/// Longest id of the server-to-server RPCs (`requester_id`, `transfer_session_id`), in bytes.
pub const MAX_PEER_ID_BYTES: usize = 256;
/// Longest block hash accepted, in bytes (content hashes are 8–64 bytes in practice; the cap
/// keeps index keys from growing the heap outside the pool's accounting).
pub const MAX_HASH_BYTES: usize = 1024;
