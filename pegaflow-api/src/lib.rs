//! `pegaflow-api`: the vocabulary of the KV-cache server (block keys, KV layouts, transfer modes,
//! the load-state word) and the Rust client SDK that native engines use to talk to it.
//!
//! This crate owns no server state. It must never depend on the runtime or on a backend crate:
//! both depend on it.

pub mod client;
#[cfg(feature = "cuda")]
pub mod cuda_driver;
pub mod echo;
pub mod error;
pub mod fd;
#[cfg(feature = "cuda")]
pub mod ipc;
pub mod layout;
pub mod limits;
pub mod load_state;
pub mod memfd;
pub mod native;
pub mod registration;
#[cfg(feature = "cuda")]
pub mod vmm;

pub use error::ApiError;
pub use layout::{KvLayout, LayoutError, SegmentRange};

/// The length of a lease token in bytes (a random UUIDv4, as PegaFlow mints them).
pub const LEASE_BYTES: usize = 16;

/// How an instance wants its blocks moved between device and host memory
/// (`RegisterContextRequest.transfer_mode`, field 17).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransferMode {
    /// One copy per contiguous range (`"direct"` in the Python client, wire value 0).
    #[default]
    Direct,
    /// One gather/scatter kernel per batch (`"kernel"` in the Python client, wire value 1).
    Kernel,
}

impl TransferMode {
    /// Maps the wire value; unknown values are `None`.
    pub fn from_wire(v: i32) -> Option<Self> {
        match v {
            0 => Some(Self::Direct),
            1 => Some(Self::Kernel),
            _ => None,
        }
    }
}

/// Whether `id` is safe as the instance part of an fd side-channel key: 1–128 bytes of
/// `[A-Za-z0-9_-]` (the rule of PegaFlow's native branch, `native-clients.md` §3.2).
pub fn is_side_channel_safe_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
