//! The engine: a thin orchestrator over its parts.
//!
//! - [`registry`]: instances and workers, their lifecycle (reserve → commit → fence → drain →
//!   release) and the reaper thread;
//! - the tier stack ([`crate::store`]): sealed blocks, eviction, demotion, promotion;
//! - the lease table ([`LeaseTable`]): query leases pinning hit blocks;
//! - the orchestration of each RPC, on domain commands ([`command`]): `register.rs`,
//!   `save.rs`, `load.rs`, `query.rs`, each as named steps; this module keeps the shared
//!   plumbing (copies run to completion on their own task, gauges, flush, housekeeping,
//!   unregistration).
//!
//! Must never: see a wire (protobuf) type, serve bytes of a block that is not sealed, let a
//! block id address memory outside its registration, evict a referenced block, change
//! anything for a request it refuses (every rejection before any side effect), or release a
//! registration before fencing it and draining its copies (DESIGN.md §6). Blocking work
//! (copies, unmapping) runs on transports' threads and on the reaper thread.

mod acked;
pub mod command;
mod copy;
mod instance;
mod lease;
mod load;
mod query;
mod reaper;
mod register;
pub mod registry;
mod save;
mod sealer;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use crate::block::{BlockKey, KeyRef, SealedBlock, Slot};
pub use crate::store::BlockIndex;
pub use command::MAX_HASH_BYTES;
pub use instance::{Instance, Topology, Worker};
pub use lease::{parse_lease, LeaseTable};
pub use reaper::Reaper;
pub use registry::Registry;
pub use sealer::{SealHold, MAX_PENDING_HASHES, MAX_PENDING_SEALS};

use crate::buffer::HostBuffer;
use crate::config::EngineConfig;
use crate::error::EngineResult;
use crate::fd_channel::FdChannel;
use crate::metrics::Metrics;
use crate::plugin::{HostPool, Registrar, Tier, Transport};
use crate::store::{StoreConfig, TierStack};

/// A block saved in part: the slots received so far, and who wrote them.
struct Inflight {
    slots: Vec<Option<Slot>>,
    filled: usize,
    buffers: Vec<Arc<HostBuffer>>,
    footprint: u64,
    created: Instant,
    /// Serials ([`Instance::serial`]) of the registered instances that wrote a slot: when the
    /// last of them is unregistered, nobody will complete the block and it is dropped.
    writers: Vec<u64>,
}

impl Inflight {
    /// An empty block of `total` slots.
    fn new(total: usize) -> Self {
        Self {
            slots: vec![None; total],
            filled: 0,
            buffers: vec![],
            footprint: 0,
            created: Instant::now(),
            writers: vec![],
        }
    }
}

/// Everything the engine is built from.
pub struct EngineParts {
    /// `[engine]` settings.
    pub config: EngineConfig,
    /// The landing tier's host pool.
    pub pool: Arc<dyn HostPool>,
    /// Key-addressed tiers below DRAM, in fall-through order.
    pub lower_tiers: Vec<Arc<dyn Tier>>,
    /// `[store]` settings.
    pub store: StoreConfig,
    /// The index-event bus (the one handed to backends in their `RuntimeContext`).
    pub index_events: crate::store::IndexEvents,
    /// The delegate of the server-to-server RPCs, when the pipeline has a `[peer]`.
    pub peer: Option<Arc<dyn crate::plugin::PeerService>>,
    /// Registrars of the pipeline.
    pub registrars: Vec<Arc<dyn Registrar>>,
    /// Transports of the pipeline, in preference order.
    pub transports: Vec<Arc<dyn Transport>>,
    /// Metric families.
    pub metrics: Arc<Metrics>,
    /// The fd side channel, when configured (failed native registrations discard their fd).
    pub fd_channel: Option<Arc<FdChannel>>,
}

/// What `POST /cache/memory/cleanup` did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MemoryCleanup {
    /// Blocks removed from the index.
    pub evicted_blocks: u64,
    /// Their footprint in bytes.
    pub evicted_bytes: u64,
    /// The real drop in pool usage, in bytes.
    pub reclaimed_bytes: u64,
    /// Removed blocks still held by a lease or a load (freed when those end).
    pub still_referenced_blocks: u64,
}

/// The engine.
pub struct Engine {
    config: EngineConfig,
    store: Arc<TierStack>,
    /// The same stack as peer backends see it.
    host: Arc<dyn crate::plugin::BlockHost>,
    peer: Option<Arc<dyn crate::plugin::PeerService>>,
    registrars: Vec<Arc<dyn Registrar>>,
    transports: Vec<Arc<dyn Transport>>,
    registry: Registry,
    inflight: Mutex<HashMap<BlockKey, Inflight>>,
    leases: LeaseTable,
    metrics: Arc<Metrics>,
    /// Saves hold the read side while running; Flush takes the write side.
    flush_barrier: tokio::sync::RwLock<()>,
    /// Seals and indexes saved blocks after their Save answered ([`sealer`]).
    sealer: sealer::SealQueue,
    /// Saves answered before their copy ended, until their seal is queued ([`acked`]).
    acked: Arc<acked::AckedSaves>,
    fd_channel: Option<Arc<FdChannel>>,
    /// The side channel's counters as last exported (to turn snapshots into counter deltas).
    fd_stats_seen: Mutex<crate::fd_channel::FdChannelStats>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("instances", &self.registry.len())
            .field("store", &self.store)
            .finish()
    }
}

impl Engine {
    /// Builds the engine over its parts; starts the tier stack's demotion worker (on the
    /// current tokio runtime) when there is a lower tier.
    pub fn new(parts: EngineParts) -> anyhow::Result<Arc<Self>> {
        parts
            .metrics
            .pool_capacity_bytes
            .set(parts.pool.capacity_bytes() as i64);
        let store = TierStack::new(
            parts.pool,
            parts.lower_tiers,
            parts.store,
            parts.metrics.clone(),
            parts.index_events,
        );
        let seal_metrics = parts.metrics.clone();
        Ok(Arc::new_cyclic(|engine| Self {
            sealer: sealer::SealQueue::start(engine.clone(), seal_metrics),
            acked: Default::default(),
            leases: LeaseTable::new(
                Duration::from_secs(parts.config.lease_ttl_secs),
                parts.config.max_leases_per_instance,
            ),
            registry: Registry::new(parts.config.max_instances, Reaper::start(256)),
            config: parts.config,
            host: store.clone(),
            store,
            peer: parts.peer,
            registrars: parts.registrars,
            transports: parts.transports,
            inflight: Mutex::new(HashMap::new()),
            metrics: parts.metrics,
            flush_barrier: tokio::sync::RwLock::new(()),
            fd_channel: parts.fd_channel,
            fd_stats_seen: Mutex::new(Default::default()),
        }))
    }

    /// The metric families.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The landing tier's host pool.
    pub fn pool(&self) -> &Arc<dyn HostPool> {
        self.store.pool()
    }

    /// The delegate of the server-to-server RPCs, if configured.
    pub fn peer(&self) -> Option<&Arc<dyn crate::plugin::PeerService>> {
        self.peer.as_ref()
    }

    /// The tier stack (block store).
    pub fn store(&self) -> &Arc<TierStack> {
        &self.store
    }

    /// The tier stack as a peer backend sees it ([`crate::plugin::BlockHost`]).
    pub fn block_host(&self) -> &Arc<dyn crate::plugin::BlockHost> {
        &self.host
    }

    /// The host-DRAM block index (read-only use: tests, benchmarks, metrics), once every
    /// Save that answered before this call is sealed and indexed (blocks the calling thread
    /// for as long as that takes, ~1 ms at most for a 512 MiB Save).
    pub fn index(&self) -> &BlockIndex {
        self.sealer.settle_blocking();
        self.store.index()
    }

    /// Test hook: holds the seal thread back until the guard (and every other hold) is
    /// dropped, so that Saves answer with their blocks not yet sealed (queries, Flush and
    /// unregistration wait meanwhile; [`Engine::index`] would block).
    #[doc(hidden)]
    pub fn hold_seals(&self) -> SealHold {
        self.sealer.hold()
    }

    /// Waits until every Save that answered before this call is sealed and indexed (the
    /// barrier queries pass; see [`sealer`]).
    pub async fn settle(&self) {
        self.sealer.settle().await
    }

    /// Live leases.
    pub fn leases(&self) -> &LeaseTable {
        &self.leases
    }

    fn instance(&self, id: &str) -> EngineResult<Arc<Instance>> {
        self.registry.get(id)
    }

    /// The registry of instances and workers.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Ids of the registered instances, sorted.
    pub fn instance_ids(&self) -> Vec<String> {
        self.registry.ids()
    }

    /// Refreshes the gauges derived from state (pool, index, leases, instances).
    pub fn update_gauges(&self) {
        let m = &self.metrics;
        let pool = self.store.pool();
        m.pool_capacity_bytes.set(pool.capacity_bytes() as i64);
        m.pool_used_bytes.set(pool.used_bytes() as i64);
        let index = self.store.index();
        m.cache_resident_bytes.set(index.resident_bytes() as i64);
        m.cache_resident_blocks
            .with_label_values(&["retained"])
            .set(index.resident_blocks() as i64);
        m.leases_active.set(self.leases.len() as i64);
        let expired = self.leases.expired_total();
        m.leases_expired
            .inc_by(expired.saturating_sub(m.leases_expired.get()));
        m.instances.set(self.registry.len() as i64);
        if let Some(c) = &self.fd_channel {
            let now = c.stats();
            let mut seen = self.fd_stats_seen.lock();
            let ev = &m.fd_channel_events;
            for (name, new, old) in [
                ("accepted", now.accepted, seen.accepted),
                ("delivered", now.delivered, seen.delivered),
                (
                    "rejected_malformed",
                    now.rejected_malformed,
                    seen.rejected_malformed,
                ),
                (
                    "rejected_duplicate",
                    now.rejected_duplicate,
                    seen.rejected_duplicate,
                ),
                (
                    "rejected_capacity",
                    now.rejected_capacity,
                    seen.rejected_capacity,
                ),
                (
                    "connections_dropped",
                    now.connections_dropped,
                    seen.connections_dropped,
                ),
                ("expired", now.expired, seen.expired),
                ("discarded", now.discarded, seen.discarded),
            ] {
                ev.with_label_values(&[name])
                    .inc_by(new.saturating_sub(old));
            }
            m.fd_channel_pending.set(now.pending as i64);
            *seen = now;
        }
    }

    /// Unregisters an instance: fence, drain its copies, drop its leases, then release its
    /// registrations on the reaper thread. Cached blocks of its namespace stay.
    pub async fn unregister(&self, id: &str) -> EngineResult<()> {
        self.unregister_counting(id).await.map(drop)
    }

    /// [`Engine::unregister`], returning how many layer registrations (tensors) it released.
    pub async fn unregister_counting(&self, id: &str) -> EngineResult<usize> {
        let inst = self.registry.remove_fenced(id)?;
        let serial = inst.serial;
        let tensors = self.registry.teardown(inst, &self.leases).await;
        // Its saves' seals may still add slots to partly saved blocks.
        self.sealer.settle().await;
        self.drop_inflight_of(serial);
        self.update_gauges();
        Ok(tensors)
    }

    /// Forgets instance `serial` as a writer of partly saved blocks, and drops (frees) those
    /// it was the last writer of: after its teardown drained its saves, nobody will complete
    /// them. Called after the teardown, so no save of the instance can add a slot meanwhile.
    /// Counted in `pegaflow_inflight_gc_cleaned_total`. Returns the blocks dropped.
    fn drop_inflight_of(&self, serial: u64) -> usize {
        let mut freed = Vec::new();
        {
            let mut inf = self.inflight.lock();
            inf.retain(|_, e| {
                let Some(i) = e.writers.iter().position(|&w| w == serial) else {
                    return true;
                };
                e.writers.swap_remove(i);
                if e.writers.is_empty() {
                    freed.push((std::mem::take(&mut e.slots), std::mem::take(&mut e.buffers)));
                    false
                } else {
                    true
                }
            });
            let bytes: u64 = inf.values().map(|e| e.footprint).sum();
            self.metrics.inflight_bytes.set(bytes as i64);
        }
        let n = freed.len();
        self.metrics.inflight_gc_cleaned.inc_by(n as u64);
        // The buffers go back to the pool here, outside the lock.
        drop(freed);
        if n > 0 {
            tracing::info!(
                blocks = n,
                "dropped the partly saved blocks of an unregistered instance"
            );
        }
        n
    }

    /// Unregisters every instance (HTTP cleanup, shutdown). Returns their ids and how many
    /// layer registrations (tensors) were released.
    pub async fn unregister_all(&self) -> (Vec<String>, usize) {
        let all = self.registry.remove_all_fenced();
        let mut ids = Vec::new();
        let mut tensors = 0;
        for inst in all {
            ids.push(inst.id.to_string());
            let serial = inst.serial;
            tensors += self.registry.teardown(inst, &self.leases).await;
            self.sealer.settle().await;
            self.drop_inflight_of(serial);
            self.update_gauges();
        }
        ids.sort();
        (ids, tensors)
    }

    /// Removes every block from the DRAM index (`POST /cache/memory/cleanup`). Leased blocks
    /// stay allocated until loaded or released; lower tiers keep what they hold.
    pub fn cleanup_memory(&self) -> MemoryCleanup {
        // Blocks of Saves that answered before the cleanup are indexed first, then removed.
        self.sealer.settle_blocking();
        self.leases.sweep();
        let pool = self.store.pool();
        let before = pool.used_bytes();
        let blocks = self.store.clear_dram();
        let mut r = MemoryCleanup::default();
        for b in &blocks {
            r.evicted_blocks += 1;
            r.evicted_bytes += b.footprint;
            if Arc::strong_count(b) > 1 {
                r.still_referenced_blocks += 1;
                self.metrics.cache_block_evictions_still_referenced.inc();
            }
        }
        drop(blocks);
        r.reclaimed_bytes = before.saturating_sub(pool.used_bytes());
        self.metrics
            .cache_eviction_reclaimed_bytes
            .inc_by(r.reclaimed_bytes);
        pool.trim();
        self.update_gauges();
        r
    }

    /// Waits until every Save accepted before this call has finished (sealed or failed).
    pub async fn flush(&self) {
        drop(self.flush_barrier.write().await);
        self.sealer.settle().await;
    }

    /// [`Engine::flush`], then waits for the demotion queue to drain and flushes the lower
    /// tiers.
    pub async fn flush_tiers(&self) {
        self.flush().await;
        self.store.flush().await;
    }

    /// Periodic housekeeping: expired leases, stale unsealed blocks, gauges.
    pub fn gc(&self) {
        self.leases.sweep();
        let ttl = Duration::from_secs(self.config.inflight_ttl_secs);
        let mut stale = Vec::new();
        {
            let mut inf = self.inflight.lock();
            inf.retain(|_, e| {
                if e.created.elapsed() > ttl {
                    stale.push(std::mem::take(&mut e.buffers));
                    false
                } else {
                    true
                }
            });
            let bytes: u64 = inf.values().map(|e| e.footprint).sum();
            self.metrics.inflight_bytes.set(bytes as i64);
        }
        self.metrics.inflight_gc_cleaned.inc_by(stale.len() as u64);
        drop(stale);
        self.store.gc();
        self.update_gauges();
    }
}
