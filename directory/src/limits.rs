//! The input bounds every directory backend and `pegaflow-metaserver` apply, and the caps
//! that keep a directory's memory bounded.
//!
//! Owns: the checks of the fields a node sends (its address and session, a namespace, a
//! block-hash list, an excluded address), each refusing with a [`FieldError`] that names the
//! field and the limit and echoes no more than [`echo`]'s 64-character prefix of a client
//! string; the longest cover plan a query answers ([`MAX_PLAN_SEGMENTS`]); and the default
//! caps on nodes, one node's entries and the in-memory store ([`Caps`], derived from the
//! machine's memory). Must never look at directory state: a refused request has changed
//! nothing.
//!
//! The figures are the storage server's own (`pegaflow_api::limits`), so a bound is the
//! same whichever service a client talks to: a namespace of at most
//! [`MAX_NAMESPACE_BYTES`], block hashes of [`MIN_HASH_BYTES`] to [`MAX_HASH_BYTES`] bytes and
//! at most [`MAX_BLOCKS_PER_LIST`] of them per request, node addresses and session ids of at
//! most [`MAX_PEER_ID_BYTES`] (the bound on the ids of the server-to-server RPCs).

use std::sync::OnceLock;

pub use pegaflow_api::echo::echo;
pub use pegaflow_api::limits::{
    MAX_BLOCKS_PER_LIST, MAX_HASH_BYTES, MAX_NAMESPACE_BYTES, MAX_PEER_ID_BYTES, MIN_HASH_BYTES,
};
use pegaflow_plugin::{DirectoryError, NodeId};

/// Longest node address (`node`, `exclude_node`), in bytes.
pub const MAX_NODE_ADDR_BYTES: usize = MAX_PEER_ID_BYTES;
/// Longest session id (`node_id`), in bytes (PegaFlow's servers send a 36-character UUID).
pub const MAX_NODE_ID_BYTES: usize = MAX_PEER_ID_BYTES;

/// Most segments of a prefix query's answer. A plan with more (consecutive blocks whose
/// holders alternate) is cut after this many: the covered prefix is shorter, which costs
/// hits, never correctness. With addresses of at most [`MAX_NODE_ADDR_BYTES`] the answer
/// stays under 1.1 MB, inside the 4 MiB any gRPC client accepts by default (an uncut plan
/// of 256-byte addresses passes it at about 16,000 segments).
pub const MAX_PLAN_SEGMENTS: usize = 4096;

/// A field past its bound: `field` is the wire name (`node`, `node_id`, `namespace`,
/// `block_hashes`, `exclude_node`), `message` names the field and the limit, e.g.
/// `namespace is 1048576 bytes; the limit is 1024 bytes`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    /// The field's wire name.
    pub field: &'static str,
    /// What is wrong, with the limit.
    pub message: String,
}

impl From<FieldError> for DirectoryError {
    fn from(e: FieldError) -> Self {
        DirectoryError::Invalid(e.message)
    }
}

fn too_long(field: &'static str, len: usize, max: usize) -> FieldError {
    FieldError {
        field,
        message: format!("{field} is {len} bytes; the limit is {max} bytes"),
    }
}

fn check_len(field: &'static str, value: &str, max: usize) -> Result<(), FieldError> {
    if value.len() > max {
        return Err(too_long(field, value.len(), max));
    }
    Ok(())
}

/// A node address (`field`: `node` or `exclude_node`) of at most [`MAX_NODE_ADDR_BYTES`]
/// (emptiness is the caller's business).
///
/// # Errors
/// [`FieldError`] for `field`.
pub fn check_addr(field: &'static str, addr: &str) -> Result<(), FieldError> {
    check_len(field, addr, MAX_NODE_ADDR_BYTES)
}

/// A session id (`node_id`) of at most [`MAX_NODE_ID_BYTES`] (emptiness is the caller's
/// business).
///
/// # Errors
/// [`FieldError`] for `node_id`.
pub fn check_session(id: &str) -> Result<(), FieldError> {
    check_len("node_id", id, MAX_NODE_ID_BYTES)
}

/// A node identity: an address of 1 to [`MAX_NODE_ADDR_BYTES`] bytes and a session of 1 to
/// [`MAX_NODE_ID_BYTES`].
///
/// # Errors
/// [`FieldError`] for `node` or `node_id`.
pub fn check_node(node: &NodeId) -> Result<(), FieldError> {
    check_addr("node", &node.addr)?;
    if node.addr.is_empty() {
        return Err(FieldError {
            field: "node",
            message: "node cannot be empty".into(),
        });
    }
    check_session(&node.session)?;
    if node.session.is_empty() {
        return Err(FieldError {
            field: "node_id",
            message: "node_id cannot be empty".into(),
        });
    }
    Ok(())
}

/// A namespace of at most [`MAX_NAMESPACE_BYTES`] (empty is a namespace, as on PegaFlow).
///
/// # Errors
/// [`FieldError`] for `namespace`.
pub fn check_namespace(namespace: &str) -> Result<(), FieldError> {
    check_len("namespace", namespace, MAX_NAMESPACE_BYTES)
}

/// An excluded address of at most [`MAX_NODE_ADDR_BYTES`].
///
/// # Errors
/// [`FieldError`] for `exclude_node`.
pub fn check_exclude(exclude: Option<&str>) -> Result<(), FieldError> {
    check_addr("exclude_node", exclude.unwrap_or(""))
}

/// A block-hash list of at most [`MAX_BLOCKS_PER_LIST`] hashes of [`MIN_HASH_BYTES`] to
/// [`MAX_HASH_BYTES`] bytes each (the list may be empty: callers decide what that means).
///
/// # Errors
/// [`FieldError`] for `block_hashes`, naming the first bad hash's position.
pub fn check_hashes(hashes: &[Vec<u8>]) -> Result<(), FieldError> {
    const FIELD: &str = "block_hashes";
    if hashes.len() > MAX_BLOCKS_PER_LIST {
        return Err(FieldError {
            field: FIELD,
            message: format!(
                "{FIELD} has {} entries; the limit is {MAX_BLOCKS_PER_LIST}",
                hashes.len()
            ),
        });
    }
    for (i, h) in hashes.iter().enumerate() {
        if h.len() < MIN_HASH_BYTES {
            return Err(FieldError {
                field: FIELD,
                message: format!(
                    "{FIELD}[{i}] is empty: a block hash is {MIN_HASH_BYTES} to {MAX_HASH_BYTES} bytes"
                ),
            });
        }
        if h.len() > MAX_HASH_BYTES {
            return Err(FieldError {
                field: FIELD,
                message: format!(
                    "{FIELD}[{i}] is {} bytes; the limit is {MAX_HASH_BYTES} bytes",
                    h.len()
                ),
            });
        }
    }
    Ok(())
}

/// Estimated bytes of one block entry of the in-memory store besides its hash: the table
/// slot, the entry (namespace, hash and owner-list handles), allocator headers and the
/// first owner. Measured: 1M entries of 32-byte hashes with 3 owners each take 237 MiB
/// resident, about 250 bytes each (`memory::tests::million_entries_figures`), which this
/// and [`OWNER_BYTES`] estimate as 240.
pub const ENTRY_OVERHEAD_BYTES: u64 = 160;
/// Estimated bytes of each further owner of an entry.
pub const OWNER_BYTES: u64 = 24;
/// Estimated bytes of one interned namespace besides its name.
pub const NAMESPACE_OVERHEAD_BYTES: u64 = 64;
/// The entry size the default caps assume: a 32-byte hash (what vLLM's block hashes are).
pub const TYPICAL_ENTRY_BYTES: u64 = ENTRY_OVERHEAD_BYTES + 32;

/// Bytes of store budget per node the default `max_nodes` assumes (16 MiB: about 87,000
/// typical entries each, on average).
pub const STORE_BYTES_PER_NODE: u64 = 16 << 20;
/// The share of the store one node may fill by default (1/8).
pub const NODE_SHARE_DIVISOR: u64 = 8;

/// Caps on what a directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Registered nodes (live or stale), at most. A heartbeat that would register one more
    /// is refused.
    pub max_nodes: u64,
    /// Block entries one node session owns, at most. An insert that would pass it is
    /// refused whole.
    pub max_blocks_per_node: u64,
    /// Estimated bytes of the in-memory store's entries and namespaces, at most (the `memory`
    /// backend's; Redis bounds its own memory with `maxmemory`).
    pub max_store_bytes: u64,
}

impl Caps {
    /// The caps derived from a memory budget of `store_bytes`: `max_nodes` =
    /// `store_bytes / 16 MiB` within 64..=65536, `max_blocks_per_node` = an eighth of the
    /// budget in typical entries (`store_bytes / 8 / 192`), at least 65,536.
    pub fn for_store_bytes(store_bytes: u64) -> Self {
        Self {
            max_nodes: (store_bytes / STORE_BYTES_PER_NODE).clamp(64, 65_536),
            max_blocks_per_node: (store_bytes / NODE_SHARE_DIVISOR / TYPICAL_ENTRY_BYTES)
                .max(65_536),
            max_store_bytes: store_bytes,
        }
    }

    /// The defaults: a store budget of half of this machine's memory ([`memory_bytes`],
    /// rounded down to a MiB), and the caps [`Caps::for_store_bytes`] derives from it.
    /// Computed once per process.
    pub fn defaults() -> Self {
        static DEFAULTS: OnceLock<Caps> = OnceLock::new();
        *DEFAULTS.get_or_init(|| Self::for_store_bytes((memory_bytes() / 2) >> 20 << 20))
    }
}

/// The memory this process may use, in bytes: `MemTotal` of `/proc/meminfo`, or the cgroup's
/// limit (`memory.max` of cgroup v2, `memory.limit_in_bytes` of v1) when that is lower;
/// 8 GiB when neither can be read.
pub fn memory_bytes() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    });
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .filter_map(|p| std::fs::read_to_string(p).ok())
    .filter_map(|s| s.trim().parse::<u64>().ok())
    .min();
    match (total, cgroup) {
        (Some(t), Some(c)) => t.min(c),
        (Some(t), None) => t,
        (None, Some(c)) if c < (1 << 50) => c,
        _ => 8 << 30,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_bounded_with_the_runtimes_figures() {
        let ok = NodeId::new_session("10.0.0.1:50055");
        check_node(&ok).unwrap();
        let long = NodeId {
            addr: "a".repeat(MAX_NODE_ADDR_BYTES + 1),
            session: ok.session.clone(),
        };
        let e = check_node(&long).unwrap_err();
        assert_eq!(e.field, "node");
        assert_eq!(e.message, "node is 257 bytes; the limit is 256 bytes");
        let e = check_node(&NodeId {
            addr: "n".into(),
            session: "s".repeat(1 << 20),
        })
        .unwrap_err();
        assert_eq!(
            (e.field, e.message.as_str()),
            (
                "node_id",
                "node_id is 1048576 bytes; the limit is 256 bytes"
            )
        );
        assert_eq!(
            check_node(&NodeId {
                addr: String::new(),
                session: "s".into()
            })
            .unwrap_err()
            .field,
            "node"
        );
        check_namespace(&"n".repeat(1024)).unwrap();
        assert_eq!(
            check_namespace(&"n".repeat(1025)).unwrap_err().message,
            "namespace is 1025 bytes; the limit is 1024 bytes"
        );
        check_exclude(None).unwrap();
        check_exclude(Some(&"x".repeat(256))).unwrap();
        assert_eq!(
            check_exclude(Some(&"x".repeat(257))).unwrap_err().field,
            "exclude_node"
        );
        check_hashes(&[vec![1], vec![0; 1024]]).unwrap();
        check_hashes(&[]).unwrap();
        assert_eq!(
            check_hashes(&[vec![1], vec![]]).unwrap_err().message,
            "block_hashes[1] is empty: a block hash is 1 to 1024 bytes"
        );
        assert_eq!(
            check_hashes(&[vec![0; 1025]]).unwrap_err().message,
            "block_hashes[0] is 1025 bytes; the limit is 1024 bytes"
        );
        assert!(check_hashes(&vec![vec![1]; MAX_BLOCKS_PER_LIST + 1])
            .unwrap_err()
            .message
            .contains("has 1048577 entries; the limit is 1048576"));
        let d: DirectoryError = check_namespace(&"n".repeat(2000)).unwrap_err().into();
        assert!(matches!(d, DirectoryError::Invalid(m) if m.contains("namespace")));
    }

    #[test]
    fn default_caps_follow_the_memory() {
        let c = Caps::for_store_bytes(12 << 30);
        assert_eq!(c.max_nodes, 768);
        assert_eq!(c.max_blocks_per_node, (12u64 << 30) / 8 / 192);
        assert_eq!(c.max_store_bytes, 12 << 30);
        let small = Caps::for_store_bytes(256 << 20);
        assert_eq!((small.max_nodes, small.max_blocks_per_node), (64, 174_762));
        let tiny = Caps::for_store_bytes(1 << 20);
        assert_eq!((tiny.max_nodes, tiny.max_blocks_per_node), (64, 65_536));
        assert!(memory_bytes() >= 64 << 20);
        assert_eq!(
            Caps::defaults(),
            Caps::for_store_bytes((memory_bytes() / 2) >> 20 << 20)
        );
    }
}
