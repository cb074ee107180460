//! `pegaflow-proto`: the generated types and gRPC stubs of `engine.proto`.
//!
//! The Engine service is byte-compatible with the published PegaFlow client 0.25.1
//! (`shared/protocol/engine-wire.md`); this project's extensions live on field numbers ≥ 100
//! so that a 0.25.1 client neither sends nor misreads them.
//!
//! The message types are always compiled; the gRPC clients (`engine_client`,
//! `meta_server_client`) only with the cargo feature `client`, the servers (`engine_server`,
//! `meta_server_server`) only with `server`, so a client crate links no server code.

#![allow(clippy::all, missing_docs)]

pub mod save;

/// Everything generated from `package pegaflow`, and the hand-written [`SaveRequest`] and
/// [`SaveLayer`] (`save`).
pub mod pegaflow {
    pub use crate::save::{SaveLayer, SaveRequest};
    tonic::include_proto!("pegaflow");
}

pub use save::HashList;

pub use pegaflow::*;

/// The client version string the published Python client sends in
/// `RegisterContextRequest.client_version` (field 15). Accepted by the server.
pub const PUBLISHED_CLIENT_VERSION: &str = "0.25.1";

/// The revision of this project's native registration wire (fields ≥ 100 of
/// `RegisterContextRequest`). It is part of [`NATIVE_CLIENT_VERSION`], so a native client of
/// another revision is refused before any of its fields is interpreted.
pub const NATIVE_WIRE_REVISION: &str = "native-v1";

/// The `client_version` this project's Rust client sends: the published protocol version it
/// speaks plus the native wire revision, e.g. `0.25.1+native-v1`.
pub const NATIVE_CLIENT_VERSION: &str = "0.25.1+native-v1";

/// The revision of this project's native registration wire v2: several allocations per
/// registration (`native_allocations`, field 103), each tensor naming its allocation
/// (`NativeKvTensor.allocation_index`, field 100), CUDA IPC handles as a third memory kind,
/// and side-channel messages keyed by allocation index. See `docs/NATIVE.md`.
pub const NATIVE_V2_WIRE_REVISION: &str = "native-v2";

/// The `client_version` of a native registration v2: `0.25.1+native-v2`. A server refuses a
/// v2 request under any other version (and a v1 request under this one) with
/// FAILED_PRECONDITION before it imports anything.
pub const NATIVE_V2_CLIENT_VERSION: &str = "0.25.1+native-v2";

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`, `NativeAllocation.cuda_ipc_handle`).
pub const CUDA_IPC_HANDLE_BYTES: usize = 64;

/// Largest gRPC message accepted or sent, in bytes (64 MiB, as the published client).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
