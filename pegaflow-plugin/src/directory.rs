//! The cross-node block directory contract: which node holds which block hashes.
//!
//! A node heartbeats under its identity ([`NodeId`]: the advertised `ip:port` and a session id
//! per process), inserts the hashes of blocks it holds, removes them when it stops holding
//! them, and asks for the per-node contiguous prefix of a request's hashes. The directory is a
//! hint: a requester re-validates every fetch with the holder (`QueryBlocksForTransfer`), so a
//! backend may lose entries (a restart, a flush) but must never invent one.
//!
//! Semantics every backend keeps (PegaFlow's MetaServer, `pegaflow-behavior.md` §7.2; the
//! conformance suite in `pegaflow-tests` checks them):
//! - a node's address is held by one session at a time: another session takes it over only
//!   once the holder has not heartbeated for the stale interval ([`HeartbeatAnswer::stale_after`]);
//!   until then its heartbeat fails with [`DirectoryError::SessionConflict`];
//! - insert and remove need the current session ([`DirectoryError::UnknownNode`] otherwise);
//!   a removal deletes only the caller's own ownership, never another session's;
//! - [`Directory::query_prefix`] answers a cover plan of the request's longest prefix that
//!   live sessions hold, as PegaFlow 0.25.1's MetaServer does (observed on the wire,
//!   `docs/DIRECTORY.md`): from the first hash, the node holding the longest run of
//!   consecutive hashes there (ties: the smallest address, by string order) takes that run;
//!   the walk goes on from the run's end, and stops at the first hash no live session holds.
//!   Segments come in hash order and a node may appear in several; a stale node is invisible;
//! - [`Directory::unregister`] and [`Directory::resync`] forget every entry of the session
//!   (unregister also forgets the node);
//! - no call blocks longer than the backend's own timeout: a backend that cannot reach its
//!   store answers [`DirectoryError::Unavailable`].
//!
//! The block key of the directory is `(namespace, hash)`; the tier stack folds a storage group
//! other than 0 into the namespace ([`directory_namespace`]).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::factory::{ConfigSchema, FactoryFlag, RuntimeContext};

/// A node's identity in the directory: PegaFlow's `node` (the address peers reach its gRPC
/// service at, `ip:port`) and `node_id` (a session id, a fresh UUID per process).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeId {
    /// Advertised `ip:port`.
    pub addr: String,
    /// Session id of this process.
    pub session: String,
}

impl NodeId {
    /// An identity for `addr` with a fresh random session id (a UUID v4).
    pub fn new_session(addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            session: uuid::Uuid::new_v4().to_string(),
        }
    }
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    /// A node not heard from for this long is hidden from queries and its address may be
    /// taken over; heartbeat at least twice as often.
    pub stale_after: Duration,
    /// The directory had no record of this session before this heartbeat (the first one, or
    /// the directory restarted, was flushed, or dropped the node): whatever the node inserted
    /// before may be gone, and it should insert what it holds again.
    pub state_lost: bool,
}

/// The answer to an insert.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertAnswer {
    /// Hashes of the batch now owned by the session (already-owned ones included).
    pub inserted: u64,
    /// Hashes this session just became an owner of that now have at least the directory's
    /// reclaimable threshold of live owners (PegaFlow: 3): copies the node may drop first.
    pub reclaimable: Vec<Vec<u8>>,
}

/// One segment of a prefix query's cover plan (PegaFlow's `NodePrefixResult`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodePrefix {
    /// The node holding the segment, its advertised `ip:port`.
    pub node: String,
    /// Hashes in the segment, ≥ 1: the segments' lengths, in order, add up to the covered
    /// prefix.
    pub prefix_len: u32,
}

/// Why a directory call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirectoryError {
    /// The store cannot be reached, or did not answer within the timeout; a later call may
    /// succeed. A query treats it as "nothing held elsewhere".
    #[error("directory unavailable: {0}")]
    Unavailable(String),
    /// The session is not (or no longer) registered: heartbeat, then insert again.
    #[error("unknown node session for {0}; heartbeat first")]
    UnknownNode(String),
    /// Another session holds the node's address and is still live.
    #[error("node {0} is held by another live session (stale node session)")]
    SessionConflict(String),
    /// The request is malformed (an empty query, an empty address, a field past its bound).
    #[error("invalid directory request: {0}")]
    Invalid(String),
    /// A bound of the directory was reached (registered nodes, one node's entries, the
    /// store's memory); nothing of the call was applied. A later call may succeed once
    /// entries are removed or nodes leave. `limit` names the bound (the backend's setting,
    /// e.g. `max_nodes`); `message` gives the figures.
    #[error("directory limit {limit} reached: {message}")]
    LimitReached {
        /// The bound's setting name.
        limit: &'static str,
        /// What was refused, with the figures.
        message: String,
    },
}

/// A cross-node block directory backend. See the module documentation for the semantics.
/// Hashes are opaque bytes; `namespace` is the directory namespace of the blocks.
#[async_trait]
pub trait Directory: Send + Sync + 'static {
    /// The pipeline kind it was built from.
    fn kind(&self) -> &'static str;

    /// Registers `node` or refreshes its session.
    ///
    /// # Errors
    /// [`DirectoryError::SessionConflict`] while another live session holds the address;
    /// [`DirectoryError::Invalid`] for an empty address or session; `Unavailable`.
    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError>;

    /// Records that `node` holds `hashes` (any number; backends split large batches).
    ///
    /// # Errors
    /// [`DirectoryError::UnknownNode`] when the session is not registered (or was taken
    /// over); `Unavailable`. Nothing is inserted on error.
    async fn insert(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError>;

    /// Records that `node` no longer holds `hashes`; another session's ownership of the same
    /// hashes stays. Returns how many of them the session owned.
    ///
    /// # Errors
    /// [`DirectoryError::UnknownNode`]; `Unavailable`.
    async fn remove(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError>;

    /// The cover plan of the longest prefix of `hashes` (in prefix order) that live
    /// sessions hold: segments in hash order, each the longest run one node holds from where
    /// the previous segment ended (see the module documentation). Empty when no live session
    /// holds the first hash. With `exclude`, that address counts as holding nothing (a node
    /// asking for what the others hold; PegaFlow 0.25.1's `exclude_node`).
    ///
    /// # Errors
    /// [`DirectoryError::Invalid`] for an empty list; `Unavailable`.
    async fn query_prefix(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError>;

    /// Forgets `node` and every entry of its session. Returns the entries forgotten (a
    /// backend that cannot count them cheaply answers what it knows, possibly 0).
    ///
    /// # Errors
    /// [`DirectoryError::UnknownNode`] when the session is not the registered one;
    /// `Unavailable`.
    async fn unregister(&self, node: &NodeId) -> Result<u64, DirectoryError>;

    /// Forgets every entry of the session but keeps the node registered: the node inserts
    /// what it holds next (after it lost track of what it advertised). Returns the entries
    /// forgotten, as [`Directory::unregister`].
    ///
    /// # Errors
    /// As [`Directory::unregister`].
    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError>;
}

/// The directory namespace of a block key: the cache namespace for storage group 0 (what
/// PegaFlow's servers use), `"<namespace>#g<group>"` for the other groups of hybrid models.
pub fn directory_namespace(namespace: &str, group: u32) -> std::borrow::Cow<'_, str> {
    if group == 0 {
        std::borrow::Cow::Borrowed(namespace)
    } else {
        std::borrow::Cow::Owned(format!("{namespace}#g{group}"))
    }
}

/// Builds a directory backend from its `[directory]` table (without `kind` and the runtime's
/// own keys).
pub type DirectoryBuild = fn(&toml::Table, &RuntimeContext) -> anyhow::Result<Arc<dyn Directory>>;

/// A directory kind a linked backend provides (`[directory] kind = "..."`).
#[derive(Debug)]
pub struct DirectoryFactory {
    /// Kind name used in the pipeline.
    pub kind: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// Settings with defaults and help.
    pub config: ConfigSchema,
    /// Command-line flags overriding its settings; a flag with
    /// [`FactoryFlag::adds_entry`] given while the pipeline has no `[directory]` adds one of
    /// this kind (how `--metaserver-addr` turns the directory on).
    pub flags: &'static [FactoryFlag],
    /// The constructor.
    pub build: DirectoryBuild,
}

inventory::collect!(DirectoryFactory);

/// Directory kinds linked into this binary, sorted, comma-separated.
pub fn known_directories() -> String {
    crate::factory::known(inventory::iter::<DirectoryFactory>(), |f| f.kind)
}

/// The directory factory for `kind`, or an error listing the kinds this binary knows.
pub fn directory_factory(kind: &str) -> anyhow::Result<&'static DirectoryFactory> {
    inventory::iter::<DirectoryFactory>()
        .find(|f| f.kind == kind)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown directory kind {kind:?}; this binary knows: {}",
                known_directories()
            )
        })
}
