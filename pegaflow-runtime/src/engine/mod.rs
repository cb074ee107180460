//! The engine: instances and their registrations, sealing, the block index, leases, eviction,
//! and the orchestration of Save and Load.
//!
//! Owns every piece of server state. Must never: serve bytes of a block that is not sealed,
//! let a block id address memory outside its registration, evict a referenced block, or
//! release a registration before fencing it and draining its copies (DESIGN.md §6).
//! Blocking work (copies, unmapping) runs on transports' threads and on the reaper thread.

mod index;
mod instance;
mod lease;
mod load;
mod query;
mod reaper;
mod register;
mod save;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

pub use index::{BlockIndex, BlockKey, KeyRef, SealedBlock, Slot};
pub use instance::{Instance, Topology, Worker};
pub use lease::{parse_lease, LeaseTable};
pub use reaper::Reaper;

use crate::buffer::HostBuffer;
use crate::config::EngineConfig;
use crate::error::{EngineError, EngineResult};
use crate::fd_channel::FdChannel;
use crate::metrics::Metrics;
use crate::plugin::{CopyBatch, Registrar, Tier, Transport};

/// A block saved in part: the slots received so far.
struct Inflight {
    slots: Vec<Option<Slot>>,
    filled: usize,
    buffers: Vec<Arc<HostBuffer>>,
    footprint: u64,
    created: Instant,
}

/// Everything the engine is built from.
pub struct EngineParts {
    /// `[engine]` settings.
    pub config: EngineConfig,
    /// Tiers, landing (host-addressable) tier first.
    pub tiers: Vec<Arc<dyn Tier>>,
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
    landing: Arc<dyn Tier>,
    tiers: Vec<Arc<dyn Tier>>,
    registrars: Vec<Arc<dyn Registrar>>,
    transports: Vec<Arc<dyn Transport>>,
    instances: RwLock<HashMap<Arc<str>, Arc<Instance>>>,
    index: BlockIndex,
    inflight: Mutex<HashMap<BlockKey, Inflight>>,
    leases: LeaseTable,
    metrics: Arc<Metrics>,
    reaper: Reaper,
    /// Ids of instances being torn down: a registration under one is refused (a native client
    /// mints a fresh id per attempt), so no registration crosses the teardown of its id.
    closing: Mutex<std::collections::HashSet<Arc<str>>>,
    /// Saves hold the read side while running; Flush takes the write side.
    flush_barrier: tokio::sync::RwLock<()>,
    fd_channel: Option<Arc<FdChannel>>,
    /// The side channel's counters as last exported (to turn snapshots into counter deltas).
    fd_stats_seen: Mutex<crate::fd_channel::FdChannelStats>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("instances", &self.instances.read().len())
            .field("index", &self.index)
            .finish()
    }
}

impl Engine {
    /// Builds the engine. The first tier must be host-addressable (the landing tier).
    pub fn new(parts: EngineParts) -> anyhow::Result<Arc<Self>> {
        let landing = parts.tiers.first().cloned().ok_or_else(|| {
            anyhow::anyhow!("the pipeline has no tier; add a [[tier]] kind = \"dram\"")
        })?;
        if !landing.capabilities().host_addressable {
            anyhow::bail!(
                "the first tier ({}) must be host-addressable (the landing tier, e.g. dram)",
                landing.kind()
            );
        }
        parts
            .metrics
            .pool_capacity_bytes
            .set(landing.capacity_bytes() as i64);
        Ok(Arc::new(Self {
            leases: LeaseTable::new(
                Duration::from_secs(parts.config.lease_ttl_secs),
                parts.config.max_leases_per_instance,
            ),
            config: parts.config,
            landing,
            tiers: parts.tiers,
            registrars: parts.registrars,
            transports: parts.transports,
            instances: RwLock::new(HashMap::new()),
            index: BlockIndex::new(),
            inflight: Mutex::new(HashMap::new()),
            metrics: parts.metrics,
            reaper: Reaper::start(256),
            closing: Mutex::new(std::collections::HashSet::new()),
            flush_barrier: tokio::sync::RwLock::new(()),
            fd_channel: parts.fd_channel,
            fd_stats_seen: Mutex::new(Default::default()),
        }))
    }

    /// The metric families.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The landing tier.
    pub fn landing_tier(&self) -> &Arc<dyn Tier> {
        &self.landing
    }

    /// All tiers.
    pub fn tiers(&self) -> &[Arc<dyn Tier>] {
        &self.tiers
    }

    /// The block index (read-only use: tests, benchmarks, metrics).
    pub fn index(&self) -> &BlockIndex {
        &self.index
    }

    /// Live leases.
    pub fn leases(&self) -> &LeaseTable {
        &self.leases
    }

    fn instance(&self, id: &str) -> EngineResult<Arc<Instance>> {
        self.instances
            .read()
            .get(id)
            .cloned()
            .ok_or_else(|| EngineError::precondition(format!("instance {id} not found")))
    }

    /// Ids of the registered instances, sorted.
    pub fn instance_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .instances
            .read()
            .keys()
            .map(|k| k.to_string())
            .collect();
        v.sort();
        v
    }

    /// Refreshes the gauges derived from state (pool, index, leases, instances).
    pub fn update_gauges(&self) {
        let m = &self.metrics;
        m.pool_capacity_bytes
            .set(self.landing.capacity_bytes() as i64);
        m.pool_used_bytes.set(self.landing.used_bytes() as i64);
        m.cache_resident_bytes
            .set(self.index.resident_bytes() as i64);
        m.cache_resident_blocks
            .with_label_values(&["retained"])
            .set(self.index.resident_blocks() as i64);
        m.leases_active.set(self.leases.len() as i64);
        let expired = self.leases.expired_total();
        m.leases_expired
            .inc_by(expired.saturating_sub(m.leases_expired.get()));
        m.instances.set(self.instances.read().len() as i64);
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

    /// Allocates host buffers for `lens`, evicting least recently used unreferenced blocks
    /// until they fit. RESOURCE_EXHAUSTED when everything resident is referenced.
    fn allocate(&self, lens: &[usize]) -> EngineResult<Vec<HostBuffer>> {
        let need: u64 = lens.iter().map(|&l| self.landing.footprint_bytes(l)).sum();
        let cap = self.landing.capacity_bytes();
        if need > cap {
            self.metrics.pool_alloc_failures.inc();
            return Err(EngineError::ResourceExhausted(format!(
                "a save of {need} bytes exceeds the host tier's capacity of {cap} bytes"
            )));
        }
        loop {
            if let Some(b) = self.landing.allocate_batch(lens) {
                return Ok(b);
            }
            // Evict least recently used blocks until the free bytes cover the request — at
            // least one per round, since a concurrent save may take what was freed — then retry.
            let mut evicted = 0u64;
            while let Some(e) = self.index.evict_lru() {
                self.note_eviction(&e.block, "pressure");
                let before = self.landing.used_bytes();
                drop(e);
                let freed = before.saturating_sub(self.landing.used_bytes());
                self.metrics.cache_eviction_reclaimed_bytes.inc_by(freed);
                evicted += 1;
                if cap.saturating_sub(self.landing.used_bytes()) >= need {
                    break;
                }
            }
            if evicted == 0 {
                if let Some(b) = self.landing.allocate_batch(lens) {
                    return Ok(b);
                }
                self.metrics.pool_alloc_failures.inc();
                return Err(EngineError::ResourceExhausted(format!(
                    "host pool exhausted: {need} bytes needed, {} of {cap} free, and every resident block is leased, loading or still being saved",
                    cap.saturating_sub(self.landing.used_bytes())
                )));
            }
        }
    }

    fn note_eviction(&self, block: &SealedBlock, reason: &str) {
        let m = &self.metrics;
        m.cache_block_evictions.inc();
        m.cache_block_evictions_by_class
            .with_label_values(&["retained"])
            .inc();
        m.cache_residence_duration
            .with_label_values(&[reason])
            .observe(block.sealed_at.elapsed().as_secs_f64());
    }

    /// Runs a copy to completion on its own task, so a cancelled RPC can never drop the
    /// buffers or the registration while bytes are still moving. `keep` is held until the
    /// copy has finished.
    async fn run_copy<K: Send + 'static>(
        transport: Arc<dyn Transport>,
        batch: CopyBatch,
        keep: K,
    ) -> EngineResult<()> {
        let h = tokio::spawn(async move {
            let r = transport.copy(batch).await;
            drop(keep);
            r
        });
        match h.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(EngineError::internal(format!("copy failed: {e}"))),
            Err(e) => Err(EngineError::internal(format!("copy task failed: {e}"))),
        }
    }

    /// Unregisters an instance: fence, drain its copies, drop its leases, then release its
    /// registrations on the reaper thread. Cached blocks of its namespace stay.
    pub async fn unregister(&self, id: &str) -> EngineResult<()> {
        self.unregister_counting(id).await.map(drop)
    }

    /// [`Engine::unregister`], returning how many layer registrations (tensors) it released.
    pub async fn unregister_counting(&self, id: &str) -> EngineResult<usize> {
        let inst = {
            let mut map = self.instances.write();
            let inst = map
                .remove(id)
                .ok_or_else(|| EngineError::precondition(format!("instance {id} not found")))?;
            self.fence(&inst);
            inst
        };
        Ok(self.teardown(inst).await)
    }

    /// Marks an instance closing (under the instances lock, so no registration can reserve on
    /// it in between): new work and new workers are refused from here on.
    fn fence(&self, inst: &Arc<Instance>) {
        self.closing.lock().insert(inst.id.clone());
        inst.state.lock().closing = true;
    }

    /// Drains a fenced instance's copies, drops its leases and releases its registrations on the
    /// reaper thread. A registration importing meanwhile finds the instance closing at commit
    /// and releases its own memory.
    async fn teardown(&self, inst: Arc<Instance>) -> usize {
        // Drain: waits for every Save/Load holding the gate.
        let drained = inst.gate.write().await;
        let workers = std::mem::take(&mut inst.state.lock().workers);
        let dropped = self.leases.drop_instance(&inst.id);
        let n = workers.len();
        let tensors: usize = workers.values().map(|w| w.layers.len()).sum();
        self.reaper.release(workers).await;
        drop(drained);
        self.closing.lock().remove(&inst.id);
        tracing::info!(instance = %inst.id, workers = n, tensors, leases = dropped, "instance unregistered");
        self.update_gauges();
        tensors
    }

    /// Unregisters every instance (HTTP cleanup, shutdown). Returns their ids and how many
    /// layer registrations (tensors) were released.
    pub async fn unregister_all(&self) -> (Vec<String>, usize) {
        let all: Vec<Arc<Instance>> = {
            let mut map = self.instances.write();
            let all: Vec<Arc<Instance>> = map.drain().map(|(_, v)| v).collect();
            for inst in &all {
                self.fence(inst);
            }
            all
        };
        let mut ids = Vec::new();
        let mut tensors = 0;
        for inst in all {
            ids.push(inst.id.to_string());
            tensors += self.teardown(inst).await;
        }
        ids.sort();
        (ids, tensors)
    }

    /// Removes every block from the index (`POST /cache/memory/cleanup`). Leased blocks stay
    /// allocated until loaded or released.
    pub fn cleanup_memory(&self) -> MemoryCleanup {
        self.leases.sweep();
        let before = self.landing.used_bytes();
        let blocks = self.index.clear();
        let mut r = MemoryCleanup::default();
        for b in &blocks {
            r.evicted_blocks += 1;
            r.evicted_bytes += b.footprint;
            if Arc::strong_count(b) > 1 {
                r.still_referenced_blocks += 1;
                self.metrics.cache_block_evictions_still_referenced.inc();
            }
            self.note_eviction(b, "cleanup");
        }
        drop(blocks);
        r.reclaimed_bytes = before.saturating_sub(self.landing.used_bytes());
        self.metrics
            .cache_eviction_reclaimed_bytes
            .inc_by(r.reclaimed_bytes);
        self.landing.trim();
        self.update_gauges();
        r
    }

    /// Waits until every Save accepted before this call has finished (sealed or failed).
    pub async fn flush(&self) {
        drop(self.flush_barrier.write().await);
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
        self.update_gauges();
    }
}
