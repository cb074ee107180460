//! `MemoryDirectory` (kind `memory`): the cross-node block directory in one process's memory,
//! with PegaFlow's MetaServer semantics (`pegaflow-behavior.md` §7.2, as PegaFlow 0.25.1's
//! `pegaflow-metaserver` answers). It is what `pegaflow-metaserver` serves by default; linked
//! into a storage server (`[directory] kind = "memory"`) it is a directory of that server
//! alone, useful for tests.
//!
//! Owns:
//! - the block map `(namespace, hash) → owners`, an owner being a node address and the
//!   session that inserted it, split over [`SHARDS`] shards, each behind its own mutex, so
//!   that no lock is held across a whole query or batch;
//! - the node table `address → (session, last seen)`: a node is *live* while it was heard
//!   from (heartbeat, insert, remove) within `stale_after`; an owner is *visible* while its
//!   node is live and still registered under the owner's session;
//! - the prefix query: the greedy cover plan of the `Directory` contract (PegaFlow 0.25.1's
//!   answer): from the first hash, the live owner with the longest run of consecutive hashes
//!   there (ties: the smallest address) takes that run, and the walk goes on from its end
//!   until a hash no live owner holds; each hash is looked up once, so a query costs
//!   O(hashes × owners) and locks one shard at a time;
//! - the lifecycle sweep ([`MemoryDirectory::sweep`]) and the gauges the MetaServer exports
//!   ([`MemoryDirectory::stats`]).
//!
//! Must never: invent an entry (a query reports only visible owners), let one session remove
//! or overwrite what another session's node holds, or block a query behind a scan (scans lock
//! one shard at a time).
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
//! Time is a monotonic millisecond clock from the directory's creation. Node addresses,
//! sessions and namespaces are interned as 32-bit ids for the directory's lifetime (a few
//! dozen bytes per distinct value ever seen), so that an owner record is 8 bytes.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use parking_lot::{Mutex, RwLock};
use pegaflow_runtime::{
    defaults_of, parse_settings, ConfigSchema, Directory, DirectoryError, DirectoryFactory,
    HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix, PluginOption, RuntimeContext,
};
use serde::{Deserialize, Serialize};

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

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            stale_after_secs: default_stale_after_secs(),
            ttl_minutes: default_ttl_minutes(),
            min_reclaimable_owners: default_min_reclaimable_owners(),
            sweep_interval_secs: default_sweep_interval_secs(),
        }
    }
}

impl MemoryConfig {
    /// Checks the settings as PegaFlow's MetaServer checks its flags.
    ///
    /// # Errors
    /// `stale_after_secs` or `ttl_minutes` is 0, the TTL is shorter than the stale interval,
    /// or `min_reclaimable_owners` < 2; the message names the setting.
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
        Ok(())
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

/// One owner of a block key: interned node address and session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    addr: u32,
    session: u32,
}

struct Entry {
    ns: u32,
    hash: Box<[u8]>,
    owners: Vec<Owner>,
}

/// The redundancy bucket of a key with `n` owners (`None` for 0).
fn bucket(n: usize) -> Option<usize> {
    match n {
        0 => None,
        1..=3 => Some(n - 1),
        _ => Some(3),
    }
}

#[derive(Default)]
struct Shard {
    table: HashTable<Entry>,
    owners: u64,
    by_count: [u64; 4],
}

impl Shard {
    /// Book-keeping for a key whose owner count went from `before` to `after`.
    fn recount(&mut self, before: usize, after: usize) {
        if let Some(b) = bucket(before) {
            self.by_count[b] -= 1;
        }
        if let Some(b) = bucket(after) {
            self.by_count[b] += 1;
        }
        self.owners = self.owners + after as u64 - before as u64;
    }

    /// Drops the owners `drop` selects from every key, and keys left without owners.
    /// Returns (owners, keys) dropped.
    fn retain_owners(&mut self, mut drop: impl FnMut(&Owner) -> bool) -> (u64, u64) {
        let (mut owners, mut keys) = (0u64, 0u64);
        let mut changes: Vec<(usize, usize)> = Vec::new();
        self.table.retain(|e| {
            let before = e.owners.len();
            e.owners.retain(|o| !drop(o));
            let after = e.owners.len();
            if after != before {
                owners += (before - after) as u64;
                changes.push((before, after));
            }
            if after == 0 {
                keys += 1;
                false
            } else {
                true
            }
        });
        for (before, after) in changes {
            self.recount(before, after);
        }
        (owners, keys)
    }
}

/// The registration of an address.
struct NodeState {
    session: u32,
    last_seen_ms: AtomicU64,
}

#[derive(Default)]
struct NodeTable {
    by_addr: HashMap<String, u32>,
    addrs: Vec<String>,
    /// Indexed by address id.
    states: Vec<Option<NodeState>>,
    sessions: HashMap<String, u32>,
}

impl NodeTable {
    fn intern_addr(&mut self, addr: &str) -> u32 {
        if let Some(&id) = self.by_addr.get(addr) {
            return id;
        }
        let id = self.addrs.len() as u32;
        self.addrs.push(addr.to_owned());
        self.states.push(None);
        self.by_addr.insert(addr.to_owned(), id);
        id
    }

    fn intern_session(&mut self, session: &str) -> u32 {
        if let Some(&id) = self.sessions.get(session) {
            return id;
        }
        let id = self.sessions.len() as u32;
        self.sessions.insert(session.to_owned(), id);
        id
    }

    /// The (address id, session id, state) of `node` when its session holds the address.
    fn current(&self, node: &NodeId) -> Result<(u32, u32, &NodeState), DirectoryError> {
        let unknown = || DirectoryError::UnknownNode(node.addr.clone());
        let addr = *self.by_addr.get(node.addr.as_str()).ok_or_else(unknown)?;
        let state = self.states[addr as usize].as_ref().ok_or_else(unknown)?;
        match self.sessions.get(node.session.as_str()) {
            Some(&s) if s == state.session => Ok((addr, s, state)),
            _ => Err(DirectoryError::SessionConflict(node.addr.clone())),
        }
    }
}

/// Sentinel for "no visible session" in a liveness snapshot.
const NONE: u32 = u32::MAX;

/// The in-memory directory. See the module documentation.
pub struct MemoryDirectory {
    stale_after: Duration,
    stale_ms: u64,
    ttl_ms: u64,
    min_reclaimable: usize,
    base: Instant,
    /// Added to the clock (tests move time forward without sleeping).
    offset_ms: AtomicU64,
    hasher: DefaultHashBuilder,
    shards: Box<[Mutex<Shard>]>,
    nodes: RwLock<NodeTable>,
    namespaces: RwLock<HashMap<String, u32>>,
    /// Dropped with the directory: stops the background sweeper, if any.
    sweeper: OnceLock<std::sync::mpsc::Sender<()>>,
}

impl std::fmt::Debug for MemoryDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDirectory")
            .field("stale_after", &self.stale_after)
            .field("ttl_ms", &self.ttl_ms)
            .field("min_reclaimable", &self.min_reclaimable)
            .finish_non_exhaustive()
    }
}

impl MemoryDirectory {
    /// An empty directory with `config`'s timing (not checked: see [`MemoryConfig::check`]).
    /// No sweeper runs: call [`MemoryDirectory::sweep`] or [`MemoryDirectory::start_sweeper`].
    pub fn new(config: &MemoryConfig) -> Self {
        Self::with_timing(
            Duration::from_secs(config.stale_after_secs),
            Duration::from_secs(config.ttl_minutes.saturating_mul(60)),
            config.min_reclaimable_owners,
        )
    }

    /// An empty directory with a stale interval and a TTL of any precision (millisecond
    /// resolution), and a reclaimable threshold in live owners.
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
            base: Instant::now(),
            offset_ms: AtomicU64::new(0),
            hasher: DefaultHashBuilder::default(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            nodes: RwLock::new(NodeTable::default()),
            namespaces: RwLock::new(HashMap::new()),
            sweeper: OnceLock::new(),
        }
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

    fn key_hash(&self, ns: u32, hash: &[u8]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_u32(ns);
        h.write(hash);
        h.finish()
    }

    /// The shard of a key hash: bits the table's own probing never uses (it takes the low
    /// bits for the bucket and the top 7 for its tags).
    fn shard(&self, h: u64) -> &Mutex<Shard> {
        &self.shards[((h >> 40) as usize) & (SHARDS - 1)]
    }

    fn namespace(&self, ns: &str) -> Option<u32> {
        self.namespaces.read().get(ns).copied()
    }

    fn intern_namespace(&self, ns: &str) -> u32 {
        if let Some(id) = self.namespace(ns) {
            return id;
        }
        let mut t = self.namespaces.write();
        let next = t.len() as u32;
        *t.entry(ns.to_owned()).or_insert(next)
    }

    /// The visible session per address id (`NONE` where the node is absent or stale).
    fn live_sessions(nodes: &NodeTable, now: u64, stale_ms: u64) -> Vec<u32> {
        nodes
            .states
            .iter()
            .map(|s| match s {
                Some(s)
                    if now.saturating_sub(s.last_seen_ms.load(Ordering::Relaxed)) <= stale_ms =>
                {
                    s.session
                }
                _ => NONE,
            })
            .collect()
    }

    fn visible(live: &[u32], o: &Owner) -> bool {
        live.get(o.addr as usize)
            .is_some_and(|&s| s != NONE && s == o.session)
    }

    fn heartbeat_sync(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        if node.addr.is_empty() {
            return Err(DirectoryError::Invalid("empty node address".into()));
        }
        if node.session.is_empty() {
            return Err(DirectoryError::Invalid("empty node session".into()));
        }
        let now = self.now_ms();
        let refreshed = HeartbeatAnswer {
            stale_after: self.stale_after,
            state_lost: false,
        };
        // The common case, a refresh, under the shared lock.
        if let Ok((_, _, state)) = self.nodes.read().current(node) {
            state.last_seen_ms.store(now, Ordering::Relaxed);
            return Ok(refreshed);
        }
        let mut t = self.nodes.write();
        let addr = t.intern_addr(&node.addr);
        let session = t.sessions.get(node.session.as_str()).copied();
        let previous = t.states[addr as usize]
            .as_ref()
            .map(|s| (s.session, s.last_seen_ms.load(Ordering::Relaxed)));
        match previous {
            Some((held, _)) if Some(held) == session => {
                // Registered between the two locks.
                if let Some(s) = &t.states[addr as usize] {
                    s.last_seen_ms.store(now, Ordering::Relaxed);
                }
                Ok(refreshed)
            }
            Some((_, seen)) if now.saturating_sub(seen) <= self.stale_ms => {
                tracing::warn!(
                    node = %node.addr,
                    rejected_session = %node.session,
                    "directory heartbeat refused: the address is held by another live session"
                );
                Err(DirectoryError::SessionConflict(node.addr.clone()))
            }
            previous => {
                let session = t.intern_session(&node.session);
                t.states[addr as usize] = Some(NodeState {
                    session,
                    last_seen_ms: AtomicU64::new(now),
                });
                if previous.is_some() {
                    tracing::info!(node = %node.addr, session = %node.session,
                        "directory node taken over from a stale session");
                } else {
                    tracing::debug!(node = %node.addr, session = %node.session,
                        "directory node registered");
                }
                Ok(HeartbeatAnswer {
                    stale_after: self.stale_after,
                    state_lost: true,
                })
            }
        }
    }

    /// Checks the session, refreshes the node, and returns (address id, session id, the
    /// visible sessions after the refresh when `want_live`, else nothing).
    fn touch(
        &self,
        node: &NodeId,
        want_live: bool,
    ) -> Result<(u32, u32, Vec<u32>), DirectoryError> {
        let now = self.now_ms();
        let t = self.nodes.read();
        let (addr, session, state) = t.current(node).inspect_err(|e| {
            tracing::debug!(node = %node.addr, session = %node.session, error = %e,
                "directory write refused");
        })?;
        state.last_seen_ms.store(now, Ordering::Relaxed);
        let live = if want_live {
            Self::live_sessions(&t, now, self.stale_ms)
        } else {
            Vec::new()
        };
        Ok((addr, session, live))
    }

    fn insert_sync(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        let (addr, session, live) = self.touch(node, true)?;
        if hashes.is_empty() {
            return Ok(InsertAnswer::default());
        }
        let ns = self.intern_namespace(namespace);
        let me = Owner { addr, session };
        let mut reclaimable = Vec::new();
        for hash in hashes {
            let h = self.key_hash(ns, hash);
            let mut shard = self.shard(h).lock();
            let entry = shard.table.find_mut(h, |e| e.ns == ns && *e.hash == **hash);
            let (became, before, after, visible) = match entry {
                None => {
                    shard.table.insert_unique(
                        h,
                        Entry {
                            ns,
                            hash: hash.as_slice().into(),
                            owners: vec![me],
                        },
                        |e| self.key_hash(e.ns, &e.hash),
                    );
                    (true, 0, 1, 1)
                }
                Some(e) => {
                    let before = e.owners.len();
                    let became = match e.owners.iter_mut().find(|o| o.addr == addr) {
                        Some(o) if o.session == session => false,
                        Some(o) => {
                            // A record of a replaced session: this session owns it now.
                            o.session = session;
                            true
                        }
                        None => {
                            e.owners.push(me);
                            true
                        }
                    };
                    let visible = if became {
                        e.owners.iter().filter(|o| Self::visible(&live, o)).count()
                    } else {
                        0
                    };
                    (became, before, e.owners.len(), visible)
                }
            };
            if before != after {
                shard.recount(before, after);
            }
            drop(shard);
            if became && visible >= self.min_reclaimable {
                reclaimable.push(hash.clone());
            }
        }
        Ok(InsertAnswer {
            inserted: hashes.len() as u64,
            reclaimable,
        })
    }

    fn remove_sync(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        let (addr, session, _) = self.touch(node, false)?;
        let Some(ns) = self.namespace(namespace) else {
            return Ok(0);
        };
        let mut removed = 0u64;
        for hash in hashes {
            let h = self.key_hash(ns, hash);
            let mut shard = self.shard(h).lock();
            let Ok(mut entry) = shard
                .table
                .find_entry(h, |e| e.ns == ns && *e.hash == **hash)
            else {
                continue;
            };
            let e = entry.get_mut();
            let Some(i) = e
                .owners
                .iter()
                .position(|o| o.addr == addr && o.session == session)
            else {
                continue;
            };
            e.owners.swap_remove(i);
            let after = e.owners.len();
            if after == 0 {
                entry.remove();
            }
            shard.recount(after + 1, after);
            removed += 1;
        }
        Ok(removed)
    }

    fn query_sync(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        if hashes.is_empty() {
            return Err(DirectoryError::Invalid(
                "block_hashes cannot be empty".into(),
            ));
        }
        let Some(ns) = self.namespace(namespace) else {
            return Ok(Vec::new());
        };
        let live = {
            let nodes = self.nodes.read();
            let mut live = Self::live_sessions(&nodes, self.now_ms(), self.stale_ms);
            // An excluded address holds nothing for this query.
            if let Some(id) = exclude.and_then(|a| nodes.by_addr.get(a)) {
                if let Some(s) = live.get_mut(*id as usize) {
                    *s = NONE;
                }
            }
            live
        };
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
                let h = self.key_hash(ns, hash);
                let shard = self.shard(h).lock();
                if let Some(e) = shard.table.find(h, |e| e.ns == ns && *e.hash == **hash) {
                    holders.extend(
                        e.owners
                            .iter()
                            .filter(|o| Self::visible(&live, o))
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
            plan.push((self.smallest_addr(&running), (i - start) as u32));
            start = i;
            if holders.is_empty() {
                stopped = true;
                break;
            }
            std::mem::swap(&mut running, &mut holders);
        }
        if !stopped {
            plan.push((self.smallest_addr(&running), (hashes.len() - start) as u32));
        }
        let t = self.nodes.read();
        Ok(plan
            .into_iter()
            .map(|(addr, n)| NodePrefix {
                node: t.addrs[addr as usize].clone(),
                prefix_len: n,
            })
            .collect())
    }

    /// The address id among `ids` (not empty) whose address is the smallest string.
    fn smallest_addr(&self, ids: &[u32]) -> u32 {
        if let [only] = ids {
            return *only;
        }
        let t = self.nodes.read();
        ids.iter()
            .copied()
            .min_by(|a, b| t.addrs[*a as usize].cmp(&t.addrs[*b as usize]))
            .unwrap_or(u32::MAX)
    }

    /// Drops every owner record of address `addr` (any session), one shard at a time.
    fn drop_owners_of(&self, addr: u32) -> (u64, u64) {
        let (mut owners, mut keys) = (0, 0);
        for shard in self.shards.iter() {
            let (o, k) = shard.lock().retain_owners(|o| o.addr == addr);
            owners += o;
            keys += k;
        }
        (owners, keys)
    }

    fn unregister_sync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        let addr = {
            let mut t = self.nodes.write();
            let (addr, _, _) = t.current(node)?;
            t.states[addr as usize] = None;
            addr
        };
        // PegaFlow drops every owner record under the address, a replaced session's too.
        let (owners, keys) = self.drop_owners_of(addr);
        tracing::debug!(node = %node.addr, session = %node.session, owners, keys,
            "directory node unregistered");
        Ok(owners)
    }

    fn resync_sync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        let (addr, _, _) = self.touch(node, false)?;
        let (owners, keys) = self.drop_owners_of(addr);
        tracing::info!(node = %node.addr, session = %node.session, owners, keys,
            "directory node resynced: its entries are forgotten");
        Ok(owners)
    }

    /// Runs the lifecycle sweep now. See [`MemoryDirectory::sweep_at`].
    pub fn sweep(&self) -> SweepCounts {
        self.sweep_ms(self.now_ms())
    }

    /// The lifecycle sweep as of `now`, PegaFlow's rules: drop nodes unseen for longer than
    /// the TTL; drop owners whose node is gone (just dropped, or unregistered) or is held by
    /// another session now; drop keys left without owners. A live node's entries stay
    /// however old they are. Locks one shard at a time; queries and inserts go on meanwhile.
    pub fn sweep_at(&self, now: Instant) -> SweepCounts {
        self.sweep_ms(self.at_ms(now))
    }

    fn sweep_ms(&self, now: u64) -> SweepCounts {
        let mut counts = SweepCounts::default();
        // Nodes first, so that a node heard from while the sweep runs keeps its owners.
        let current: Vec<u32> = {
            let mut t = self.nodes.write();
            for s in t.states.iter_mut() {
                let expired = s.as_ref().is_some_and(|s| {
                    now.saturating_sub(s.last_seen_ms.load(Ordering::Relaxed)) > self.ttl_ms
                });
                if expired {
                    *s = None;
                    counts.nodes += 1;
                }
            }
            t.states
                .iter()
                .map(|s| s.as_ref().map_or(NONE, |s| s.session))
                .collect()
        };
        for shard in self.shards.iter() {
            // Addresses registered after the snapshot are kept.
            let (o, k) = shard.lock().retain_owners(|o| {
                current
                    .get(o.addr as usize)
                    .is_some_and(|&s| s != o.session)
            });
            counts.owners += o;
            counts.keys += k;
        }
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
        for state in self.nodes.read().states.iter().flatten() {
            if now.saturating_sub(state.last_seen_ms.load(Ordering::Relaxed)) <= self.stale_ms {
                s.nodes_active += 1;
            } else {
                s.nodes_stale += 1;
            }
        }
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
            ],
        },
        flags: &[],
        build,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> MemoryDirectory {
        MemoryDirectory::new(&MemoryConfig::default())
    }

    fn h(i: u8) -> Vec<u8> {
        vec![i; 8]
    }

    fn hs(r: std::ops::Range<u8>) -> Vec<Vec<u8>> {
        r.map(h).collect()
    }

    fn p(node: &NodeId, n: u32) -> NodePrefix {
        NodePrefix {
            node: node.addr.clone(),
            prefix_len: n,
        }
    }

    #[test]
    fn config_defaults_and_checks() {
        let t = defaults_of::<MemoryConfig>();
        let c: MemoryConfig = parse_settings("memory", &t).unwrap();
        assert_eq!(c, MemoryConfig::default());
        assert_eq!(c.stale_after_secs, 30);
        assert_eq!(c.ttl_minutes, 120);
        assert_eq!(c.min_reclaimable_owners, 3);
        c.check().unwrap();
        let bad = MemoryConfig {
            ttl_minutes: 1,
            stale_after_secs: 61,
            ..c.clone()
        };
        assert!(bad.check().unwrap_err().to_string().contains("ttl_minutes"));
        let bad = MemoryConfig {
            ttl_minutes: 0,
            ..c.clone()
        };
        assert!(bad.check().is_err());
        let bad = MemoryConfig {
            min_reclaimable_owners: 1,
            ..c
        };
        assert!(bad.check().is_err());
        let mut t = toml::Table::new();
        t.insert("nope".into(), toml::Value::Integer(1));
        assert!(parse_settings::<MemoryConfig>("memory", &t).is_err());
        let f = pegaflow_runtime::directory_factory("memory").unwrap();
        assert!(
            f.config.doc_problems().is_empty(),
            "{:?}",
            f.config.doc_problems()
        );
    }

    #[test]
    fn heartbeat_registers_refreshes_and_refuses_a_live_holder() {
        let d = dir();
        let a = NodeId::new_session("10.0.0.1:1");
        assert!(d.heartbeat_sync(&a).unwrap().state_lost);
        let again = d.heartbeat_sync(&a).unwrap();
        assert!(!again.state_lost);
        assert_eq!(again.stale_after, Duration::from_secs(30));
        let b = NodeId::new_session("10.0.0.1:1");
        assert_eq!(
            d.heartbeat_sync(&b),
            Err(DirectoryError::SessionConflict(a.addr.clone()))
        );
        // Stale: the address changes hands, the new session starts empty.
        d.insert_sync(&a, "ns", &hs(0..2)).unwrap();
        d.advance(Duration::from_secs(31));
        assert!(d.query_sync("ns", &hs(0..2), None).unwrap().is_empty());
        assert!(d.heartbeat_sync(&b).unwrap().state_lost);
        assert!(d.query_sync("ns", &hs(0..2), None).unwrap().is_empty());
        assert_eq!(
            d.insert_sync(&a, "ns", &hs(0..1)),
            Err(DirectoryError::SessionConflict(a.addr.clone()))
        );
        assert!(matches!(
            d.heartbeat_sync(&NodeId::new_session("")),
            Err(DirectoryError::Invalid(_))
        ));
    }

    #[test]
    fn writes_need_the_current_session_and_refresh_a_stale_node() {
        let d = dir();
        let a = NodeId::new_session("10.0.0.1:1");
        assert_eq!(
            d.insert_sync(&a, "ns", &hs(0..1)),
            Err(DirectoryError::UnknownNode(a.addr.clone()))
        );
        assert_eq!(
            d.remove_sync(&a, "ns", &hs(0..1)),
            Err(DirectoryError::UnknownNode(a.addr.clone()))
        );
        d.heartbeat_sync(&a).unwrap();
        d.insert_sync(&a, "ns", &hs(0..3)).unwrap();
        d.advance(Duration::from_secs(40));
        assert!(
            d.query_sync("ns", &hs(0..3), None).unwrap().is_empty(),
            "stale"
        );
        // PegaFlow accepts a stale session's insert and counts it as activity.
        d.insert_sync(&a, "ns", &hs(3..4)).unwrap();
        assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&a, 4)]);
        let b = NodeId::new_session("10.0.0.1:1");
        assert!(matches!(
            d.heartbeat_sync(&b),
            Err(DirectoryError::SessionConflict(_))
        ));
    }

    #[test]
    fn query_answers_the_greedy_cover_plan() {
        let d = dir();
        let (a, b, c) = (
            NodeId::new_session("10.0.0.3:1"),
            NodeId::new_session("10.0.0.1:1"),
            NodeId::new_session("10.0.0.2:1"),
        );
        for n in [&a, &b, &c] {
            d.heartbeat_sync(n).unwrap();
        }
        d.insert_sync(&a, "ns", &hs(0..5)).unwrap();
        d.insert_sync(&b, "ns", &hs(0..5)).unwrap();
        d.insert_sync(&c, "ns", &[h(0), h(1), h(3)]).unwrap();
        // a and b tie for the longest run: the smaller address takes it; c's shorter run
        // does not show.
        assert_eq!(d.query_sync("ns", &hs(0..8), None).unwrap(), vec![p(&b, 5)]);
        assert_eq!(d.query_sync("ns", &hs(0..3), None).unwrap(), vec![p(&b, 3)]);
        assert_eq!(d.query_sync("other", &hs(0..8), None).unwrap(), vec![]);
        assert_eq!(d.query_sync("ns", &hs(5..8), None).unwrap(), vec![]);
        assert!(matches!(
            d.query_sync("ns", &[], None),
            Err(DirectoryError::Invalid(_))
        ));
        // a loses h0, b loses h2: b (smaller than c) takes h0..h1, then a, whose run from h2
        // is the only one, takes h2..h4.
        d.remove_sync(&a, "ns", &hs(0..1)).unwrap();
        d.remove_sync(&b, "ns", &hs(2..3)).unwrap();
        assert_eq!(
            d.query_sync("ns", &hs(0..8), None).unwrap(),
            vec![p(&b, 2), p(&a, 3)]
        );
        // One node may serve several segments: x holds 0..3 and 5..8, y holds 3..5.
        let (x, y) = (
            NodeId::new_session("10.0.0.8:1"),
            NodeId::new_session("10.0.0.9:1"),
        );
        d.heartbeat_sync(&x).unwrap();
        d.heartbeat_sync(&y).unwrap();
        let mut xs = hs(0..3);
        xs.extend(hs(5..8));
        d.insert_sync(&x, "two", &xs).unwrap();
        d.insert_sync(&y, "two", &hs(3..5)).unwrap();
        assert_eq!(
            d.query_sync("two", &hs(0..8), None).unwrap(),
            vec![p(&x, 3), p(&y, 2), p(&x, 3)]
        );
        assert_eq!(
            d.query_sync("two", &hs(0..10), None).unwrap(),
            vec![p(&x, 3), p(&y, 2), p(&x, 3)]
        );
        // A node that does not hold the segment's first hash cannot start it.
        assert_eq!(
            d.query_sync("two", &hs(3..8), None).unwrap(),
            vec![p(&y, 2), p(&x, 3)]
        );
    }

    #[test]
    fn removal_is_owner_checked_and_drops_empty_keys() {
        let d = dir();
        let (a, b) = (
            NodeId::new_session("10.0.0.1:1"),
            NodeId::new_session("10.0.0.2:1"),
        );
        d.heartbeat_sync(&a).unwrap();
        d.heartbeat_sync(&b).unwrap();
        d.insert_sync(&a, "ns", &hs(0..4)).unwrap();
        d.insert_sync(&b, "ns", &hs(0..2)).unwrap();
        assert_eq!(d.stats().entries, 4);
        assert_eq!(d.stats().owners, 6);
        assert_eq!(d.remove_sync(&b, "ns", &hs(2..4)).unwrap(), 0);
        assert_eq!(d.remove_sync(&b, "ns", &[h(0), h(0), h(1)]).unwrap(), 2);
        assert_eq!(d.remove_sync(&a, "ns", &hs(3..4)).unwrap(), 1);
        let s = d.stats();
        assert_eq!((s.entries, s.owners), (3, 3));
        assert_eq!(s.redundancy, [3, 0, 0, 0]);
        assert_eq!(d.query_sync("ns", &hs(0..4), None).unwrap(), vec![p(&a, 3)]);
    }

    #[test]
    fn reclaimable_counts_live_owners_and_new_ownership_only() {
        let d = dir();
        let n: Vec<NodeId> = (1..=4)
            .map(|i| NodeId::new_session(format!("10.0.0.{i}:1")))
            .collect();
        for x in &n {
            d.heartbeat_sync(x).unwrap();
        }
        assert!(d
            .insert_sync(&n[0], "ns", &hs(0..3))
            .unwrap()
            .reclaimable
            .is_empty());
        assert!(d
            .insert_sync(&n[1], "ns", &hs(0..2))
            .unwrap()
            .reclaimable
            .is_empty());
        let got = d
            .insert_sync(&n[2], "ns", &[h(0), h(0), h(1), h(2)])
            .unwrap();
        assert_eq!(got.inserted, 4);
        assert_eq!(got.reclaimable, vec![h(0), h(1)]);
        // Already an owner: nothing new.
        assert!(d
            .insert_sync(&n[2], "ns", &hs(0..2))
            .unwrap()
            .reclaimable
            .is_empty());
        // Stale owners do not count.
        d.advance(Duration::from_secs(31));
        d.heartbeat_sync(&n[3]).unwrap();
        assert!(d
            .insert_sync(&n[3], "ns", &hs(0..1))
            .unwrap()
            .reclaimable
            .is_empty());
        let s = d.stats();
        assert_eq!((s.nodes_active, s.nodes_stale), (1, 3));
        // h0: 4 owners, h1: 3, h2: 2.
        assert_eq!(s.redundancy, [0, 1, 1, 1]);
        assert!((s.redundancy_avg() - 3.0).abs() < 1e-9);
    }

    #[test]
    fn unregister_and_resync_forget_every_owner_of_the_address() {
        let d = dir();
        let a = NodeId::new_session("10.0.0.1:1");
        let b = NodeId::new_session("10.0.0.2:1");
        d.heartbeat_sync(&a).unwrap();
        d.heartbeat_sync(&b).unwrap();
        d.insert_sync(&a, "ns", &hs(0..3)).unwrap();
        d.insert_sync(&a, "ns2", &hs(0..2)).unwrap();
        d.insert_sync(&b, "ns", &hs(0..1)).unwrap();
        let impostor = NodeId::new_session("10.0.0.1:1");
        assert!(matches!(
            d.unregister_sync(&impostor),
            Err(DirectoryError::SessionConflict(_))
        ));
        assert_eq!(d.resync_sync(&a).unwrap(), 5);
        assert_eq!(d.query_sync("ns", &hs(0..3), None).unwrap(), vec![p(&b, 1)]);
        d.insert_sync(&a, "ns", &hs(0..2)).unwrap();
        assert_eq!(d.unregister_sync(&a).unwrap(), 2);
        assert!(matches!(
            d.unregister_sync(&a),
            Err(DirectoryError::UnknownNode(_))
        ));
        assert!(matches!(
            d.insert_sync(&a, "ns", &hs(0..1)),
            Err(DirectoryError::UnknownNode(_))
        ));
        let s = d.stats();
        assert_eq!((s.entries, s.owners, s.nodes_active), (1, 1, 1));
    }

    #[test]
    fn sweep_drops_expired_nodes_replaced_sessions_and_empty_keys() {
        let d = MemoryDirectory::with_timing(Duration::from_secs(2), Duration::from_secs(60), 3);
        let live = NodeId::new_session("10.0.0.1:1");
        let gone = NodeId::new_session("10.0.0.2:1");
        let old = NodeId::new_session("10.0.0.3:1");
        for n in [&live, &gone, &old] {
            d.heartbeat_sync(n).unwrap();
        }
        d.insert_sync(&live, "ns", &hs(0..2)).unwrap();
        d.insert_sync(&gone, "ns", &hs(0..3)).unwrap();
        d.insert_sync(&old, "ns", &hs(5..7)).unwrap();
        d.advance(Duration::from_secs(3));
        let new = NodeId::new_session("10.0.0.3:1");
        d.heartbeat_sync(&new).unwrap();
        d.heartbeat_sync(&live).unwrap();
        // The replaced session's two owners go; nothing has reached the TTL.
        assert_eq!(
            d.sweep(),
            SweepCounts {
                owners: 2,
                keys: 2,
                nodes: 0
            }
        );
        for _ in 0..7 {
            d.advance(Duration::from_secs(10));
            d.heartbeat_sync(&live).unwrap();
            d.heartbeat_sync(&new).unwrap();
        }
        // `gone` was silent for 73 s; `live`'s entries are 73 s old and stay.
        assert_eq!(
            d.sweep(),
            SweepCounts {
                owners: 3,
                keys: 1,
                nodes: 1
            }
        );
        assert_eq!(
            d.query_sync("ns", &hs(0..3), None).unwrap(),
            vec![p(&live, 2)]
        );
        assert!(matches!(
            d.insert_sync(&gone, "ns", &hs(0..1)),
            Err(DirectoryError::UnknownNode(_))
        ));
        let s = d.stats();
        assert_eq!(
            (s.entries, s.owners, s.nodes_active, s.nodes_stale),
            (2, 2, 2, 0)
        );
        assert_eq!(d.sweep(), SweepCounts::default());
    }

    #[test]
    fn many_entries_and_concurrent_writers() {
        let d = Arc::new(dir());
        let nodes: Vec<NodeId> = (0..4)
            .map(|i| NodeId::new_session(format!("10.1.0.{i}:1")))
            .collect();
        for n in &nodes {
            d.heartbeat_sync(n).unwrap();
        }
        let key = |i: u32| -> Vec<u8> { i.to_le_bytes().repeat(8) };
        std::thread::scope(|s| {
            for (k, n) in nodes.iter().enumerate() {
                let d = &d;
                s.spawn(move || {
                    let batch: Vec<Vec<u8>> = (0..50_000u32).map(key).collect();
                    for c in batch.chunks(4096) {
                        d.insert_sync(n, "big", c).unwrap();
                    }
                    if k == 3 {
                        d.remove_sync(n, "big", &batch[25_000..]).unwrap();
                    }
                });
            }
        });
        let s = d.stats();
        assert_eq!(s.entries, 50_000);
        assert_eq!(s.owners, 175_000);
        assert_eq!(s.redundancy, [0, 0, 25_000, 25_000]);
        let all: Vec<Vec<u8>> = (0..50_000u32).map(key).collect();
        // Nodes 0..2 hold everything: the smallest address covers it in one segment.
        assert_eq!(
            d.query_sync("big", &all, None).unwrap(),
            vec![p(&nodes[0], 50_000)]
        );
        assert_eq!(d.unregister_sync(&nodes[0]).unwrap(), 50_000);
        assert_eq!(d.stats().owners, 125_000);
    }

    /// 1M keys with 3 owners each: how long the calls take (run with `--release -- --ignored
    /// --nocapture`).
    #[test]
    #[ignore = "prints figures"]
    fn million_entries_figures() {
        use std::time::Instant;
        let d = dir();
        let nodes: Vec<NodeId> = (0..3)
            .map(|i| NodeId::new_session(format!("10.2.0.{i}:50055")))
            .collect();
        for n in &nodes {
            d.heartbeat_sync(n).unwrap();
        }
        let key = |i: u32| -> Vec<u8> {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_le_bytes());
            k[28..].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
            k.to_vec()
        };
        let rss_kib = || -> u64 {
            std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("VmRSS:"))
                        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
                })
                .unwrap_or(0)
        };
        let all: Vec<Vec<u8>> = (0..1_000_000u32).map(key).collect();
        let rss_before = rss_kib();
        let t = Instant::now();
        for n in &nodes {
            for c in all.chunks(16_384) {
                d.insert_sync(n, "m", c).unwrap();
            }
        }
        let inserted = t.elapsed();
        let rss_mib = rss_kib().saturating_sub(rss_before) / 1024;
        let t = Instant::now();
        for i in 0..100 {
            let q = &all[i * 1000..i * 1000 + 1000];
            assert_eq!(d.query_sync("m", q, None).unwrap().len(), 1);
        }
        let query = t.elapsed() / 100;
        let t = Instant::now();
        let s = d.stats();
        let stats = t.elapsed();
        let t = Instant::now();
        d.sweep();
        let sweep = t.elapsed();
        let t = Instant::now();
        let removed = d.unregister_sync(&nodes[0]).unwrap();
        let unregister = t.elapsed();
        assert_eq!(
            (s.entries, s.owners, removed),
            (1_000_000, 3_000_000, 1_000_000)
        );
        println!(
            "3M inserts {inserted:?} ({:.0} ns each); 1000-hash query {query:?}; stats {stats:?}; \
             sweep {sweep:?}; unregister of 1M owners {unregister:?}; {rss_mib} MiB resident",
            inserted.as_nanos() as f64 / 3e6
        );
    }
}
