//! The block-tier contract: every tier below host DRAM (SSD, a peer, a third party's store)
//! is key-addressed, asynchronous and batched.
//!
//! A tier stores sealed blocks under their [`BlockKey`] and hands them back into host
//! buffers the tier stack allocates from the landing pool. It declares what it is
//! ([`TierCapabilities`]) so that the stack branches on capabilities, never on a kind name,
//! and fails with a typed [`TierError`] so that the stack can fall through to the next tier.
//!
//! Contract, for every implementation and every layer that wraps one:
//! - a block is visible to [`Tier::lookup`] and [`Tier::get`] only once its [`Tier::put`]
//!   completed successfully; a get never yields bytes other than those put under the key;
//! - a future may be dropped at any point: the tier keeps the `Arc`s it was handed (the
//!   source block of a put, the destination buffer of a get) alive until its own I/O on them
//!   has ended, so a dropped future never leaves I/O running into freed memory;
//! - no method blocks the async executor (file I/O runs on the tier's own threads);
//! - the trait has no default methods: a wrapper forwards every call explicitly.

use std::sync::Arc;

use async_trait::async_trait;

use crate::block::{BlockKey, BlockShape, SealedBlock};
use crate::buffer::HostBuffer;

/// What a tier is; the tier stack asks, it never matches on the kind's name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCapabilities {
    /// Blocks survive a restart of the server ([`Tier::recover`] finds them).
    pub persistent: bool,
    /// Blocks live on another node (reads cross the network).
    pub remote: bool,
    /// Expected sustained read bandwidth in bytes per second (0 = unknown). A tier that
    /// measures itself reports what it measured.
    pub read_bytes_per_sec: u64,
    /// Expected sustained write bandwidth in bytes per second (0 = unknown).
    pub write_bytes_per_sec: u64,
    /// The tier asks to be offered every block as soon as it seals (write-through: the
    /// stack's write-behind runs with no threshold), so that blocks still resident in DRAM
    /// survive a restart of the server. Only the first lower tier's wish counts.
    pub write_through: bool,
}

/// Why a tier operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// No room for the block (after the tier's own eviction).
    #[error("tier full: {0}")]
    Full(String),
    /// The tier (or the device, or the peer) cannot serve now; a later call may succeed.
    #[error("tier unavailable: {0}")]
    Unavailable(String),
    /// The stored record failed its checks (checksum, shape); the tier dropped it.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// The key is not (or no longer) held.
    #[error("block not found")]
    NotFound,
}

/// One block to store: its key and the sealed block whose slot bytes are written.
#[derive(Debug, Clone)]
pub struct TierPut {
    /// The key.
    pub key: BlockKey,
    /// The block (kept alive by the tier until its write has ended).
    pub block: Arc<SealedBlock>,
}

/// One block to read: its key, the shape [`Tier::lookup`] reported, and the host buffer the
/// slot bytes go to, back to back in slot order (`dest.len() >= shape.len_bytes()`).
#[derive(Debug, Clone)]
pub struct TierGet {
    /// The key.
    pub key: BlockKey,
    /// The block's shape as the tier reported it.
    pub shape: BlockShape,
    /// Where the bytes go (kept alive by the tier until its read has ended).
    pub dest: Arc<HostBuffer>,
}

/// What [`Tier::recover`] found at start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Blocks found intact and indexed.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Records dropped (torn, failed checksums).
    pub dropped: u64,
}

/// A key-addressed, asynchronous, batched store of sealed blocks below host DRAM.
#[async_trait]
pub trait Tier: Send + Sync + 'static {
    /// The pipeline kind this tier was built from.
    fn kind(&self) -> &'static str;
    /// What this tier is.
    fn capabilities(&self) -> TierCapabilities;
    /// Bytes the tier can hold.
    fn capacity_bytes(&self) -> u64;
    /// Bytes held.
    fn used_bytes(&self) -> u64;
    /// How many of `keys`, from the first, the tier holds (the prefix stops at the first key
    /// it does not hold), with each held block's shape: `result.len()` is the prefix length.
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<BlockShape>, TierError>;
    /// Stores the blocks; one result per block, in order. A key already held succeeds
    /// without a write (content-addressed blocks never change). A failed put leaves nothing
    /// visible under its key.
    async fn put(&self, blocks: Vec<TierPut>) -> Vec<Result<(), TierError>>;
    /// Reads the blocks into their destination buffers; one result per block, in order. A
    /// failed get may have written part of its destination: the caller discards it.
    async fn get(&self, reads: Vec<TierGet>) -> Vec<Result<(), TierError>>;
    /// Removes the keys it holds; returns how many it removed.
    async fn remove(&self, keys: &[BlockKey]) -> Result<u64, TierError>;
    /// Returns once every put that completed before the call is durable (persistent tiers)
    /// or at least visible (others).
    async fn flush(&self) -> Result<(), TierError>;
    /// Rebuilds the tier's index from what it holds at start (persistent tiers); others
    /// return an empty [`Recovered`]. Called once, before the server serves.
    async fn recover(&self) -> Result<Recovered, TierError>;
}
