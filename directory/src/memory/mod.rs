//! `MemoryDirectory` (kind `memory`): the cross-node block directory in one process's memory,
//! with PegaFlow's MetaServer semantics (as PegaFlow 0.25.1's `pegaflow-metaserver` answers).
//! It is what `pegaflow-metaserver` serves by default; linked into a storage server
//! (`[directory] kind = "memory"`) it is a directory of that server alone, useful for tests.
//!
//! Owns:
//! - the block map `(namespace, hash) → owners` ([`shard`]), split over [`SHARDS`] shards,
//!   each behind its own mutex, so that no lock is held across a whole query or batch;
//! - the node table ([`nodes`]): each registered address's session, generation, last contact
//!   and entry count. A node is *live* while it was heard from (heartbeat, insert, remove)
//!   within `stale_after`; an owner is *visible* while its address's registration is live
//!   and of the owner's generation;
//! - the prefix query: the greedy cover plan of the `Directory` contract (PegaFlow 0.25.1's
//!   answer): from the first hash, the live owner with the longest run of consecutive hashes
//!   there (ties: the smallest address) takes that run, and the walk goes on from its end
//!   until a hash no live owner holds, or the plan has [`MAX_PLAN_SEGMENTS`] segments; each
//!   hash is looked up once, so a query costs O(hashes × owners) and locks one shard at a time;
//! - the bounds: every field is checked ([`crate::limits`]), and the caps ([`Caps`]) refuse a
//!   registration past `max_nodes`, an insert that would give a session more than
//!   `max_blocks_per_node` entries, and one that would take the store's estimated size past
//!   `max_store_bytes`, with [`DirectoryError::LimitReached`] and nothing of the call applied;
//! - the lifecycle sweep ([`MemoryDirectory::sweep`]) and the gauges the MetaServer exports
//!   ([`MemoryDirectory::stats`]).
//!
//! Must never: invent an entry (a query reports only visible owners), let one session remove
//! or overwrite what another session's node holds, block a query behind a scan (scans lock
//! one shard at a time), or keep growing: an address's slot, a namespace's name and an
//! entry's bytes are given back when nothing holds them any more.
//!
//! Lifecycle of a node address (what PegaFlow does):
//! - *unknown* → first heartbeat → *live* (`state_lost = true`);
//! - *live* → silent for `stale_after` → *stale*: hidden from queries, its inserts and
//!   removals still accepted (they refresh it), and another session may take the address
//!   over (`state_lost = true` for the new session; the old session's owners stay stored but
//!   invisible until the sweep drops them);
//! - *stale* → silent for `ttl` → dropped by the sweep with all its owners;
//! - any state → unregister by its session → *unknown*, its owners dropped.
//!
//! Time is a monotonic millisecond clock from the directory's creation.

mod nodes;
mod shard;
#[cfg(test)]
mod tests;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hashbrown::{DefaultHashBuilder, HashSet};
use parking_lot::{Mutex, RwLock};
use pegaflow_plugin::{
    defaults_of, parse_settings, ConfigSchema, Directory, DirectoryError, DirectoryFactory,
    HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix, PluginOption, RuntimeContext,
};
use serde::{Deserialize, Serialize};

use self::nodes::{newer, NodeTable, Registration, NONE};
use self::shard::{entry_bytes, Dropped, Entry, Owner, Shard};
use crate::limits::{self, echo, Caps, MAX_PLAN_SEGMENTS, NAMESPACE_OVERHEAD_BYTES, OWNER_BYTES};

/// Number of block-map shards (a power of two).
pub const SHARDS: usize = 64;

/// The `[directory] kind = "memory"` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Seconds without a heartbeat (or insert/remove) after which a node is hidden from
    /// queries and its address may be taken over by another session. PegaFlow's
    /// `--node-stale-secs`. Default 30; must be > 0.
    #[serde(default = "default_stale_after_secs")]
    pub stale_after_secs: u64,
    /// Minutes without node activity after which the sweep drops the node and all its
    /// owners (block age does not count: a live node's entries stay). PegaFlow's
    /// `--ttl-minutes`. Default 120; must be > 0 and at least `stale_after_secs`.
    #[serde(default = "default_ttl_minutes")]
    pub ttl_minutes: u64,
    /// Live owners (the inserting node included) from which a newly owned hash is reported
    /// reclaimable. PegaFlow's `--min-reclaimable-owner-count`. Default 3; must be ≥ 2.
    #[serde(default = "default_min_reclaimable_owners")]
    pub min_reclaimable_owners: usize,
    /// Seconds between lifecycle sweeps run by a background thread when the directory is
    /// built from a pipeline; 0 = none (the owner calls [`MemoryDirectory::sweep`], as
    /// `pegaflow-metaserver` does on its `--sweep-interval-secs`). Default 600.
    #[serde(default = "default_sweep_interval_secs")]
    pub sweep_interval_secs: u64,
    /// Registered nodes (live or stale) at most; a heartbeat registering one more is
    /// refused. Default: [`Caps::defaults`] (from the machine's memory); must be > 0.
    #[serde(default = "default_max_nodes")]
    pub max_nodes: u64,
    /// Block entries one node session may own; an insert that would pass it is refused
    /// whole. Default: [`Caps::defaults`]; must be > 0.
    #[serde(default = "default_max_blocks_per_node")]
    pub max_blocks_per_node: u64,
    /// Estimated bytes of entries and namespaces the store may hold; an insert past it is
    /// refused whole. Default: half of the machine's memory ([`Caps::defaults`]); at least
    /// 1 MiB.
    #[serde(default = "default_max_store_bytes")]
    pub max_store_bytes: u64,
}

fn default_stale_after_secs() -> u64 {
    30
}
fn default_ttl_minutes() -> u64 {
    120
}
fn default_min_reclaimable_owners() -> usize {
    3
}
fn default_sweep_interval_secs() -> u64 {
    600
}
fn default_max_nodes() -> u64 {
    Caps::defaults().max_nodes
}
fn default_max_blocks_per_node() -> u64 {
    Caps::defaults().max_blocks_per_node
}
fn default_max_store_bytes() -> u64 {
    Caps::defaults().max_store_bytes
}

impl Default for MemoryConfig {
    fn default() -> Self {
        let caps = Caps::defaults();
        Self {
            stale_after_secs: default_stale_after_secs(),
            ttl_minutes: default_ttl_minutes(),
            min_reclaimable_owners: default_min_reclaimable_owners(),
            sweep_interval_secs: default_sweep_interval_secs(),
            max_nodes: caps.max_nodes,
            max_blocks_per_node: caps.max_blocks_per_node,
            max_store_bytes: caps.max_store_bytes,
        }
    }
}

impl MemoryConfig {
    /// Checks the settings as PegaFlow's MetaServer checks its flags, and the caps.
    ///
    /// # Errors
    /// `stale_after_secs` or `ttl_minutes` is 0, the TTL is shorter than the stale interval,
    /// `min_reclaimable_owners` < 2, a cap is 0 or the store budget under 1 MiB; the message
    /// names the setting.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.stale_after_secs == 0 {
            anyhow::bail!("memory directory: stale_after_secs must be > 0");
        }
        if self.ttl_minutes == 0 {
            anyhow::bail!("memory directory: ttl_minutes must be > 0");
        }
        if self.ttl_minutes.saturating_mul(60) < self.stale_after_secs {
            anyhow::bail!(
                "memory directory: ttl_minutes ({}) must be >= stale_after_secs ({}) in minutes",
                self.ttl_minutes,
                self.stale_after_secs
            );
        }
        if self.min_reclaimable_owners < 2 {
            anyhow::bail!("memory directory: min_reclaimable_owners must be at least 2");
        }
        if self.max_nodes == 0 || self.max_blocks_per_node == 0 {
            anyhow::bail!("memory directory: max_nodes and max_blocks_per_node must be > 0");
        }
        if self.max_store_bytes < 1 << 20 {
            anyhow::bail!(
                "memory directory: max_store_bytes ({}) must be at least 1 MiB",
                self.max_store_bytes
            );
        }
        Ok(())
    }

    /// The caps these settings give.
    pub fn caps(&self) -> Caps {
        Caps {
            max_nodes: self.max_nodes,
            max_blocks_per_node: self.max_blocks_per_node,
            max_store_bytes: self.max_store_bytes,
        }
    }
}

/// What one sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepCounts {
    /// Owner records dropped: of nodes gone or unseen for the TTL, or of a session that no
    /// longer holds its address.
    pub owners: u64,
    /// Block keys dropped because no owner was left.
    pub keys: u64,
    /// Nodes dropped because they were unseen for the TTL.
    pub nodes: u64,
}

/// The directory's size, for the MetaServer gauges. Stored owners count, visible or not
/// (stale nodes and replaced sessions count until the sweep drops them), as PegaFlow counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Block keys (`pegaflow_metaserver_store_entries`).
    pub entries: u64,
    /// Owner records over all keys (`pegaflow_metaserver_block_owners`).
    pub owners: u64,
    /// Registered nodes heard from within the stale interval.
    pub nodes_active: u64,
    /// Registered nodes not heard from within the stale interval.
    pub nodes_stale: u64,
    /// Keys by owner count: index 0 = 1 owner, 1 = 2, 2 = 3, 3 = 4 or more
    /// (`pegaflow_metaserver_block_redundancy{owners}`).
    pub redundancy: [u64; 4],
    /// Estimated bytes of entries and namespaces, what `max_store_bytes` bounds
    /// (`pegaflow_metaserver_store_bytes`).
    pub bytes: u64,
}

impl MemoryStats {
    /// Owners per key on average, 0 for an empty directory
    /// (`pegaflow_metaserver_block_redundancy_avg`).
    pub fn redundancy_avg(&self) -> f64 {
        if self.entries == 0 {
            0.0
        } else {
            self.owners as f64 / self.entries as f64
        }
    }
}

/// What a query sees of the node table: each slot's live generation (`NONE` for none) and
/// the address of each live slot.
struct LiveView {
    gens: Vec<u32>,
    names: Vec<Option<Arc<str>>>,
}

/// The in-memory directory. See the module documentation.
pub struct MemoryDirectory {
    stale_after: Duration,
    stale_ms: u64,
    ttl_ms: u64,
    min_reclaimable: usize,
    caps: Caps,
    base: Instant,
    /// Added to the clock (tests move time forward without sleeping).
    offset_ms: AtomicU64,
    hasher: DefaultHashBuilder,
    shards: Box<[Mutex<Shard>]>,
    nodes: RwLock<NodeTable>,
    namespaces: RwLock<HashSet<Arc<str>>>,
    /// Estimated bytes of entries and namespaces (bounded by `caps.max_store_bytes`).
    used_bytes: AtomicU64,
    /// Held by a sweep (one at a time).
    sweeping: Mutex<()>,
    /// Dropped with the directory: stops the background sweeper, if any.
    sweeper: OnceLock<std::sync::mpsc::Sender<()>>,
}

impl std::fmt::Debug for MemoryDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDirectory")
            .field("stale_after", &self.stale_after)
            .field("ttl_ms", &self.ttl_ms)
            .field("min_reclaimable", &self.min_reclaimable)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

/// A refused insert: what to undo, and why.
struct Refusal {
    at: usize,
    error: DirectoryError,
}

impl MemoryDirectory {
    /// An empty directory with `config`'s timing and caps (not checked: see
    /// [`MemoryConfig::check`]). No sweeper runs: call [`MemoryDirectory::sweep`] or
    /// [`MemoryDirectory::start_sweeper`].
    pub fn new(config: &MemoryConfig) -> Self {
        Self::with_timing(
            Duration::from_secs(config.stale_after_secs),
            Duration::from_secs(config.ttl_minutes.saturating_mul(60)),
            config.min_reclaimable_owners,
        )
        .with_caps(config.caps())
    }

    /// An empty directory with a stale interval and a TTL of any precision (millisecond
    /// resolution), a reclaimable threshold in live owners, and the default caps.
    pub fn with_timing(
        stale_after: Duration,
        ttl: Duration,
        min_reclaimable_owners: usize,
    ) -> Self {
        Self {
            stale_after,
            stale_ms: stale_after.as_millis() as u64,
            ttl_ms: ttl.as_millis() as u64,
            min_reclaimable: min_reclaimable_owners.max(1),
            caps: Caps::defaults(),
            base: Instant::now(),
            offset_ms: AtomicU64::new(0),
            hasher: DefaultHashBuilder::default(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            nodes: RwLock::new(NodeTable::default()),
            namespaces: RwLock::new(HashSet::new()),
            used_bytes: AtomicU64::new(0),
            sweeping: Mutex::new(()),
            sweeper: OnceLock::new(),
        }
    }

    /// The same directory with other caps.
    pub fn with_caps(mut self, caps: Caps) -> Self {
        self.caps = caps;
        self
    }

    /// The caps it enforces.
    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// The stale interval.
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64 + self.offset_ms.load(Ordering::Relaxed)
    }

    fn at_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.base).as_millis() as u64
            + self.offset_ms.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    fn advance(&self, d: Duration) {
        self.offset_ms
            .fetch_add(d.as_millis() as u64, Ordering::Relaxed);
    }

    /// The hash of a key: the namespace by identity (one `Arc` per live namespace), the
    /// block hash by content.
    fn key_hash(&self, ns: &Arc<str>, hash: &[u8]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_usize(Arc::as_ptr(ns) as *const u8 as usize);
        h.write(hash);
        h.finish()
    }

    /// The shard of a key hash: bits the table's own probing never uses (it takes the low
    /// bits for the bucket and the top 7 for its tags).
    fn shard(&self, h: u64) -> &Mutex<Shard> {
        &self.shards[((h >> 40) as usize) & (SHARDS - 1)]
    }

    /// Charges `bytes` to the store budget.
    fn reserve(&self, bytes: u64) -> Result<(), DirectoryError> {
        let before = self.used_bytes.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > self.caps.max_store_bytes {
            self.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
            return Err(DirectoryError::LimitReached {
                limit: "max_store_bytes",
                message: format!(
                    "the directory's store holds about {before} bytes; the limit is {} bytes \
                     (max_store_bytes); nothing of this insert was kept",
                    self.caps.max_store_bytes
                ),
            });
        }
        Ok(())
    }

    fn release_bytes(&self, bytes: u64) {
        self.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn namespace(&self, ns: &str) -> Option<Arc<str>> {
        self.namespaces.read().get(ns).cloned()
    }

    fn intern_namespace(&self, ns: &str) -> Result<Arc<str>, DirectoryError> {
        if let Some(a) = self.namespace(ns) {
            return Ok(a);
        }
        let mut t = self.namespaces.write();
        if let Some(a) = t.get(ns) {
            return Ok(a.clone());
        }
        self.reserve(NAMESPACE_OVERHEAD_BYTES + ns.len() as u64)?;
        let a: Arc<str> = ns.into();
        t.insert(a.clone());
        Ok(a)
    }

    /// Counts one more entry against `reg`'s quota.
    fn take_quota(&self, node: &NodeId, reg: &Registration) -> Result<(), DirectoryError> {
        let max = self.caps.max_blocks_per_node;
        let before = reg.owned.fetch_add(1, Ordering::Relaxed);
        if before >= max {
            reg.owned.fetch_sub(1, Ordering::Relaxed);
            return Err(DirectoryError::LimitReached {
                limit: "max_blocks_per_node",
                message: format!(
                    "node {} owns {before} block entries; the limit is {max} \
                     (max_blocks_per_node); nothing of this insert was kept",
                    echo(&node.addr)
                ),
            });
        }
        Ok(())
    }

    fn view(&self, nodes: &NodeTable, exclude: Option<&str>) -> LiveView {
        let mut gens = nodes.live_gens(self.now_ms(), self.stale_ms);
        // An excluded address holds nothing for this query.
        if let Some((slot, _)) = exclude.and_then(|a| nodes.registration(a)) {
            gens[slot as usize] = NONE;
        }
        let names = gens
            .iter()
            .zip(&nodes.slots)
            .map(|(&g, s)| (g != NONE).then(|| s.addr.clone()))
            .collect();
        LiveView { gens, names }
    }

    fn visible(live: &[u32], o: &Owner) -> bool {
        live.get(o.addr as usize)
            .is_some_and(|&g| g != NONE && g == o.gen)
    }

    fn heartbeat_sync(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        limits::check_node(node)?;
        let now = self.now_ms();
        let refreshed = HeartbeatAnswer {
            stale_after: self.stale_after,
            state_lost: false,
        };
        // The common case, a refresh, under the shared lock.
        if let Ok((_, reg)) = self.nodes.read().current(node) {
            reg.last_seen_ms.store(now, Ordering::Relaxed);
            return Ok(refreshed);
        }
        let mut t = self.nodes.write();
        let previous = t.registration(&node.addr).map(|(_, r)| {
            (
                *r.session == *node.session,
                r.live(now, self.stale_ms),
                r.clone(),
            )
        });
        match previous {
            Some((true, _, reg)) => {
                // Registered between the two locks.
                reg.last_seen_ms.store(now, Ordering::Relaxed);
                Ok(refreshed)
            }
            Some((false, true, _)) => {
                tracing::debug!(node = %echo(&node.addr), rejected_session = %echo(&node.session),
                    "directory heartbeat refused: the address is held by another live session");
                Err(DirectoryError::SessionConflict(node.addr.clone()))
            }
            previous => {
                t.register(node, now, self.caps.max_nodes)?;
                // Debug only: a client can cause these at will (the MetaServer logs
                // registrations itself, rate limited).
                if previous.is_some() {
                    tracing::debug!(node = %echo(&node.addr), session = %echo(&node.session),
                        "directory node taken over from a stale session");
                } else {
                    tracing::debug!(node = %echo(&node.addr), session = %echo(&node.session),
                        "directory node registered");
                }
                Ok(HeartbeatAnswer {
                    stale_after: self.stale_after,
                    state_lost: true,
                })
            }
        }
    }

    /// Checks the session, refreshes the node, and returns (its slot, its registration,
    /// the live generations after the refresh when `want_live`, else nothing).
    fn touch(
        &self,
        node: &NodeId,
        want_live: bool,
    ) -> Result<(u32, Arc<Registration>, Vec<u32>), DirectoryError> {
        let now = self.now_ms();
        let t = self.nodes.read();
        let (slot, reg) = t.current(node).inspect_err(|e| {
            tracing::debug!(node = %echo(&node.addr), session = %echo(&node.session), error = %e,
                "directory write refused");
        })?;
        reg.last_seen_ms.store(now, Ordering::Relaxed);
        let live = if want_live {
            t.live_gens(now, self.stale_ms)
        } else {
            Vec::new()
        };
        Ok((slot, reg.clone(), live))
    }

    fn insert_sync(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        limits::check_node(node)?;
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        let (slot, reg, live) = self.touch(node, true)?;
        if hashes.is_empty() {
            return Ok(InsertAnswer::default());
        }
        let ns = self.intern_namespace(namespace)?;
        let me = Owner {
            addr: slot,
            gen: reg.gen,
        };
        // Positions this call made the session an owner of (undone if the call is refused).
        let mut added: Vec<usize> = Vec::new();
        let mut reclaimable = Vec::new();
        let mut refused = None;
        for (i, hash) in hashes.iter().enumerate() {
            let h = self.key_hash(&ns, hash);
            let mut shard = self.shard(h).lock();
            let step = match shard
                .table
                .find_mut(h, |e| Arc::ptr_eq(&e.ns, &ns) && *e.hash == **hash)
            {
                None => self.take_quota(node, &reg).and_then(|()| {
                    self.reserve(entry_bytes(hash.len(), 1)).inspect_err(|_| {
                        reg.owned.fetch_sub(1, Ordering::Relaxed);
                    })
                }),
                Some(e) => match e.owners.iter().position(|o| o.addr == slot) {
                    Some(j) if e.owners[j].gen == me.gen => {
                        continue;
                    }
                    // A record of an earlier registration of the slot: this one owns it now.
                    Some(_) => self.take_quota(node, &reg),
                    None => self.take_quota(node, &reg).and_then(|()| {
                        self.reserve(OWNER_BYTES).inspect_err(|_| {
                            reg.owned.fetch_sub(1, Ordering::Relaxed);
                        })
                    }),
                },
            };
            if let Err(error) = step {
                drop(shard);
                refused = Some(Refusal { at: i, error });
                break;
            }
            let (before, after, visible) = match shard
                .table
                .find_mut(h, |e| Arc::ptr_eq(&e.ns, &ns) && *e.hash == **hash)
            {
                None => {
                    shard.table.insert_unique(
                        h,
                        Entry {
                            ns: ns.clone(),
                            hash: hash.as_slice().into(),
                            owners: vec![me],
                        },
                        |e| self.key_hash(&e.ns, &e.hash),
                    );
                    (0, 1, 1)
                }
                Some(e) => {
                    let before = e.owners.len();
                    match e.owners.iter_mut().find(|o| o.addr == slot) {
                        Some(o) => o.gen = me.gen,
                        None => e.owners.push(me),
                    }
                    let visible = e.owners.iter().filter(|o| Self::visible(&live, o)).count();
                    (before, e.owners.len(), visible)
                }
            };
            if before != after {
                shard.recount(before, after);
            }
            drop(shard);
            added.push(i);
            if visible >= self.min_reclaimable {
                reclaimable.push(hash.clone());
            }
        }
        if let Some(Refusal { at, error }) = refused {
            self.undo_inserts(&ns, hashes, &added, me, &reg);
            tracing::debug!(node = %echo(&node.addr), at, error = %error, "directory insert refused");
            return Err(error);
        }
        Ok(InsertAnswer {
            inserted: hashes.len() as u64,
            reclaimable,
        })
    }

    /// Removes the owner records `me` got from `hashes[added]` in a refused insert.
    fn undo_inserts(
        &self,
        ns: &Arc<str>,
        hashes: &[Vec<u8>],
        added: &[usize],
        me: Owner,
        reg: &Registration,
    ) {
        for &i in added {
            let hash = &hashes[i];
            if self.remove_owner(ns, hash, me) {
                reg.owned.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Removes owner `who` of `(ns, hash)`; whether it was there.
    fn remove_owner(&self, ns: &Arc<str>, hash: &[u8], who: Owner) -> bool {
        let h = self.key_hash(ns, hash);
        let mut shard = self.shard(h).lock();
        let Ok(mut entry) = shard
            .table
            .find_entry(h, |e| Arc::ptr_eq(&e.ns, ns) && *e.hash == *hash)
        else {
            return false;
        };
        let e = entry.get_mut();
        let Some(i) = e.owners.iter().position(|o| *o == who) else {
            return false;
        };
        e.owners.swap_remove(i);
        let after = e.owners.len();
        let freed = entry_bytes(hash.len(), after + 1) - entry_bytes(hash.len(), after);
        if after == 0 {
            entry.remove();
        }
        shard.recount(after + 1, after);
        drop(shard);
        self.release_bytes(freed);
        true
    }

    fn remove_sync(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        let (slot, reg, _) = self.touch(node, false)?;
        let Some(ns) = self.namespace(namespace) else {
            return Ok(0);
        };
        let me = Owner {
            addr: slot,
            gen: reg.gen,
        };
        let mut removed = 0u64;
        for hash in hashes {
            if self.remove_owner(&ns, hash, me) {
                removed += 1;
            }
        }
        reg.owned.fetch_sub(removed, Ordering::Relaxed);
        Ok(removed)
    }

    fn query_sync(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        limits::check_exclude(exclude)?;
        if hashes.is_empty() {
            return Err(DirectoryError::Invalid(
                "block_hashes cannot be empty".into(),
            ));
        }
        let Some(ns) = self.namespace(namespace) else {
            return Ok(Vec::new());
        };
        let view = self.view(&self.nodes.read(), exclude);
        // The greedy cover plan: from the start of a segment, the nodes holding every hash
        // so far run on; when none of them holds the next hash, the segment goes to the one
        // with the smallest address among the last ones standing, and the next segment starts
        // there. Each hash is looked up once.
        let mut plan: Vec<(u32, u32)> = Vec::new();
        let mut start = 0usize;
        let mut running: Vec<u32> = Vec::new();
        let mut holders: Vec<u32> = Vec::new();
        let mut stopped = false;
        for (i, hash) in hashes.iter().enumerate() {
            holders.clear();
            {
                let h = self.key_hash(&ns, hash);
                let shard = self.shard(h).lock();
                if let Some(e) = shard
                    .table
                    .find(h, |e| Arc::ptr_eq(&e.ns, &ns) && *e.hash == **hash)
                {
                    holders.extend(
                        e.owners
                            .iter()
                            .filter(|o| Self::visible(&view.gens, o))
                            .map(|o| o.addr),
                    );
                }
            }
            if i == 0 {
                if holders.is_empty() {
                    stopped = true;
                    break;
                }
                std::mem::swap(&mut running, &mut holders);
                continue;
            }
            if running.iter().any(|a| holders.contains(a)) {
                running.retain(|a| holders.contains(a));
                continue;
            }
            plan.push((Self::smallest(&view, &running), (i - start) as u32));
            start = i;
            if holders.is_empty() || plan.len() == MAX_PLAN_SEGMENTS {
                stopped = true;
                break;
            }
            std::mem::swap(&mut running, &mut holders);
        }
        if !stopped {
            plan.push((
                Self::smallest(&view, &running),
                (hashes.len() - start) as u32,
            ));
        }
        Ok(plan
            .into_iter()
            .filter_map(|(slot, n)| {
                let name = view.names.get(slot as usize)?.as_ref()?;
                Some(NodePrefix {
                    node: name.to_string(),
                    prefix_len: n,
                })
            })
            .collect())
    }

    /// The slot among `slots` (not empty, all live in `view`) whose address is the smallest
    /// string.
    fn smallest(view: &LiveView, slots: &[u32]) -> u32 {
        if let [only] = slots {
            return *only;
        }
        let name = |s: &u32| view.names.get(*s as usize).cloned().flatten();
        slots
            .iter()
            .min_by(|a, b| name(a).cmp(&name(b)))
            .copied()
            .unwrap_or(u32::MAX)
    }

    /// Drops every owner record of slot `slot` up to generation `upto` (not those of a later
    /// registration of the slot), one shard at a time.
    fn drop_owners_of(&self, slot: u32, upto: u32) -> Dropped {
        let mut d = Dropped::default();
        for shard in self.shards.iter() {
            d += shard
                .lock()
                .retain_owners(|o| o.addr == slot && !newer(o.gen, upto));
        }
        self.release_bytes(d.bytes);
        d
    }

    fn unregister_sync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        let (slot, gen) = {
            let mut t = self.nodes.write();
            let (slot, _) = t.current(node)?;
            (slot, t.release(slot))
        };
        // PegaFlow drops every owner record under the address, a replaced session's too.
        let d = self.drop_owners_of(slot, gen);
        tracing::debug!(node = %echo(&node.addr), session = %echo(&node.session),
            owners = d.owners, keys = d.keys, "directory node unregistered");
        Ok(d.owners)
    }

    fn resync_sync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        let (slot, old) = {
            let mut t = self.nodes.write();
            let (slot, _) = t.current(node)?;
            (slot, t.renew(slot, self.now_ms()))
        };
        let d = self.drop_owners_of(slot, old);
        tracing::info!(node = %echo(&node.addr), session = %echo(&node.session),
            owners = d.owners, keys = d.keys, "directory node resynced: its entries are forgotten");
        Ok(d.owners)
    }

    /// Runs the lifecycle sweep now. See [`MemoryDirectory::sweep_at`].
    pub fn sweep(&self) -> SweepCounts {
        self.sweep_ms(self.now_ms())
    }

    /// The lifecycle sweep as of `now`, PegaFlow's rules: drop nodes unseen for longer than
    /// the TTL; drop owners whose node is gone (just dropped, or unregistered) or is held by
    /// another session now; drop keys left without owners, and namespaces without keys. A
    /// live node's entries stay however old they are. Locks one shard at a time; queries and
    /// inserts go on meanwhile.
    pub fn sweep_at(&self, now: Instant) -> SweepCounts {
        self.sweep_ms(self.at_ms(now))
    }

    fn sweep_ms(&self, now: u64) -> SweepCounts {
        let _one = self.sweeping.lock();
        let mut counts = SweepCounts::default();
        // Nodes first, so that a node heard from while the sweep runs keeps its owners.
        // Per slot: the generation that stays (`NONE`: none) and the last one drawn (owners
        // of later generations were inserted after this snapshot and stay).
        let snapshot: Vec<(u32, u32)> = {
            let mut t = self.nodes.write();
            let expired: Vec<u32> = t
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| {
                    s.reg.as_ref().is_some_and(|r| {
                        now.saturating_sub(r.last_seen_ms.load(Ordering::Relaxed)) > self.ttl_ms
                    })
                })
                .map(|(i, _)| i as u32)
                .collect();
            for slot in expired {
                t.release(slot);
                counts.nodes += 1;
            }
            t.slots
                .iter()
                .map(|s| (s.reg.as_ref().map_or(NONE, |r| r.gen), s.issued))
                .collect()
        };
        let mut d = Dropped::default();
        for shard in self.shards.iter() {
            d += shard.lock().retain_owners(|o| {
                snapshot
                    .get(o.addr as usize)
                    .is_some_and(|&(keep, issued)| o.gen != keep && !newer(o.gen, issued))
            });
        }
        self.release_bytes(d.bytes);
        counts.owners = d.owners;
        counts.keys = d.keys;
        // Namespaces no entry (and no call in flight) holds.
        let mut freed = 0u64;
        self.namespaces.write().retain(|ns| {
            let keep = Arc::strong_count(ns) > 1;
            if !keep {
                freed += NAMESPACE_OVERHEAD_BYTES + ns.len() as u64;
            }
            keep
        });
        self.release_bytes(freed);
        counts
    }

    /// Sizes for the MetaServer gauges (locks each shard briefly).
    pub fn stats(&self) -> MemoryStats {
        let mut s = MemoryStats::default();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            s.entries += shard.table.len() as u64;
            s.owners += shard.owners;
            for (total, n) in s.redundancy.iter_mut().zip(shard.by_count) {
                *total += n;
            }
        }
        let now = self.now_ms();
        for slot in &self.nodes.read().slots {
            match &slot.reg {
                Some(r) if r.live(now, self.stale_ms) => s.nodes_active += 1,
                Some(_) => s.nodes_stale += 1,
                None => {}
            }
        }
        s.bytes = self.used_bytes.load(Ordering::Relaxed);
        s
    }

    /// Starts a thread that sweeps every `interval` until the directory is dropped (at most
    /// one per directory; later calls do nothing). Each sweep that removes something is
    /// logged.
    pub fn start_sweeper(self: &Arc<Self>, interval: Duration) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        if self.sweeper.set(tx).is_err() {
            return;
        }
        let weak: Weak<Self> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("memory-dir-sweep".into())
            .spawn(move || loop {
                match rx.recv_timeout(interval) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(dir) = weak.upgrade() else { return };
                let c = dir.sweep();
                if c != SweepCounts::default() {
                    tracing::info!(
                        owners = c.owners,
                        keys = c.keys,
                        nodes = c.nodes,
                        "memory directory sweep"
                    );
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("memory directory: cannot start the sweeper thread: {e}");
        }
    }
}

#[async_trait]
impl Directory for MemoryDirectory {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        self.heartbeat_sync(node)
    }

    async fn insert(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        self.insert_sync(node, namespace, hashes)
    }

    async fn remove(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        self.remove_sync(node, namespace, hashes)
    }

    async fn query_prefix(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        self.query_sync(namespace, hashes, exclude)
    }

    async fn unregister(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        self.unregister_sync(node)
    }

    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        self.resync_sync(node)
    }
}

fn build(table: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Directory>> {
    let config: MemoryConfig = parse_settings("memory directory", table)?;
    config.check()?;
    let dir = Arc::new(MemoryDirectory::new(&config));
    if config.sweep_interval_secs > 0 {
        dir.start_sweeper(Duration::from_secs(config.sweep_interval_secs));
    }
    Ok(dir)
}

inventory::submit! {
    DirectoryFactory {
        kind: "memory",
        summary: "in-process directory with PegaFlow's MetaServer semantics (this server only; pegaflow-metaserver's default store)",
        config: ConfigSchema {
            defaults: defaults_of::<MemoryConfig>,
            check: |w, t| parse_settings::<MemoryConfig>(w, t)?.check(),
            options: &[
                PluginOption { name: "stale_after_secs", help: "seconds without a heartbeat before a node is hidden and its address may be taken over" },
                PluginOption { name: "ttl_minutes", help: "minutes without node activity before the sweep drops the node and its entries" },
                PluginOption { name: "min_reclaimable_owners", help: "live owners from which a newly owned hash is reported reclaimable (>= 2)" },
                PluginOption { name: "sweep_interval_secs", help: "seconds between background lifecycle sweeps; 0 = none" },
                PluginOption { name: "max_nodes", help: "registered nodes at most (default: the store budget / 16 MiB, within 64..=65536)" },
                PluginOption { name: "max_blocks_per_node", help: "block entries one node session may own (default: an eighth of the store budget in 192-byte entries)" },
                PluginOption { name: "max_store_bytes", help: "estimated bytes of entries and namespaces at most (default: half of the machine's memory)" },
            ],
        },
        flags: &[],
        build,
    }
}
