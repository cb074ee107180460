//! Instances, their workers and the sealed topology.
//!
//! An instance collects one worker per device until `world_size` workers registered; then its
//! topology is *sealed* from the union of the registered layers (`pegaflow-behavior.md` §1.2):
//! layer ids are the ranks of the sorted names, every layer has a storage group, and every
//! group has a slot space. Save, Load and membership queries need a sealed instance.
//!
//! Slot spaces:
//! - layer-first: `slot = group_rank(layer) * tp_size + tp_rank`, `total_slots = layers_in_group * tp_size`;
//! - page-first: one page per *shard* (a distinct registered layer set; identical sets are
//!   replicas), `total_slots = shards`, layers at prefix offsets inside the page in id order.
//!
//! Registration states of a worker: importing (a reservation of its device id) → live →
//! fenced (instance closing: new work refused) → drained → released (mappings dropped on the
//! reaper thread).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use pegaflow_api::{KvLayout, TransferMode};

use crate::error::{echo, EngineError, EngineResult};
use crate::plugin::{LayerRegion, MemorySpace, RegistrarTraits, Transport};

/// One registered layer of one worker.
#[derive(Debug, Clone)]
pub struct WorkerLayer {
    /// Where the layer lives.
    pub region: LayerRegion,
    /// Its validated layout (bounded by `region.len`).
    pub layout: KvLayout,
    /// Its storage group.
    pub group: u32,
}

impl WorkerLayer {
    /// The device address of byte `offset` of the layer (offset validated by the layout).
    pub fn addr(&self, offset: u64) -> u64 {
        self.region.memory.base_addr() + self.region.offset + offset
    }
}

/// One worker (one device's process) of an instance.
pub struct Worker {
    /// The client's device id.
    pub device_id: i32,
    /// TP rank.
    pub tp_rank: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// Registered layers by name.
    pub layers: HashMap<String, WorkerLayer>,
    /// The transport that reaches this worker's memory.
    pub transport: Arc<dyn Transport>,
    /// What the registrar that imported the memory declared of its registrations.
    pub traits: RegistrarTraits,
    /// Where the worker's memory lives (all its layers share one space).
    pub location: MemorySpace,
    /// Native registration v2: the layers are arenas indexed by one block id, so every Save
    /// and every Load of this worker names all of them with the same blocks (an MLA page is
    /// never stored or restored without its sidecars).
    pub whole_blocks: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("device_id", &self.device_id)
            .field("tp_rank", &self.tp_rank)
            .field("pp_rank", &self.pp_rank)
            .field("layers", &self.layers.len())
            .field("transport", &self.transport.kind())
            .finish()
    }
}

/// A layer's place in the sealed topology.
#[derive(Debug, Clone)]
pub struct LayerInfo {
    /// Dense layer id (rank of the name among all registered names).
    pub id: usize,
    /// Storage group.
    pub group: u32,
    /// Rank within its group.
    pub group_rank: usize,
    /// Host bytes of one block of this layer (all segments).
    pub block_bytes: usize,
    /// Page-first: the shard holding this layer, and its offset inside the shard's page.
    pub page: Option<(usize, usize)>,
}

/// One storage group's slot space.
#[derive(Debug, Clone)]
pub struct GroupInfo {
    /// Layers of the group, in id order.
    pub layers: Vec<String>,
    /// Slots a block of this group has.
    pub total_slots: usize,
}

/// The sealed topology of an instance.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Every layer by name.
    pub layers: HashMap<String, LayerInfo>,
    /// Groups by id (dense).
    pub groups: Vec<GroupInfo>,
    /// Page-first: each shard's page size in bytes and its layers in id order.
    pub pages: Vec<(usize, Vec<String>)>,
    /// TP degree.
    pub tp_size: u32,
    /// Whether pages replace per-layer slots.
    pub page_first: bool,
}

impl Topology {
    /// The slot index and byte offset inside the slot of `layer` for a worker of `tp_rank`.
    pub fn slot_of(&self, layer: &str, tp_rank: u32) -> Option<(usize, usize)> {
        let li = self.layers.get(layer)?;
        Some(match li.page {
            Some((shard, off)) => (shard, off),
            None => (li.group_rank * self.tp_size as usize + tp_rank as usize, 0),
        })
    }

    /// Bytes of slot `slot` of a block of `group`.
    pub fn slot_bytes(&self, group: u32, slot: usize) -> Option<usize> {
        if self.page_first {
            return self.pages.get(slot).map(|p| p.0);
        }
        let g = self.groups.get(group as usize)?;
        let layer = g.layers.get(slot / self.tp_size as usize)?;
        Some(self.layers[layer].block_bytes)
    }

    /// The shape of a complete block of `group`: every slot's bytes, in slot order. `None`
    /// for an unknown group.
    pub fn block_shape(&self, group: u32) -> Option<crate::block::BlockShape> {
        let slots = self.groups.get(group as usize)?.total_slots;
        let lens: Option<Vec<u64>> = (0..slots)
            .map(|s| self.slot_bytes(group, s).map(|b| b as u64))
            .collect();
        lens.map(crate::block::BlockShape::new)
    }

    /// Seals a topology from the workers (all `world_size` of them).
    pub fn seal(
        workers: &BTreeMap<i32, Arc<Worker>>,
        tp_size: u32,
        page_first: bool,
    ) -> EngineResult<Self> {
        // Union of layer names with geometry and group consistency.
        let mut names: BTreeMap<&str, (&KvLayout, u32)> = BTreeMap::new();
        for w in workers.values() {
            for (name, l) in &w.layers {
                match names.get(name.as_str()) {
                    Some((layout, group)) => {
                        if !layout.same_geometry(&l.layout) {
                            return Err(EngineError::invalid(format!(
                                "layer {} has a different geometry on device {} than on another device",
                                echo(name),
                                w.device_id
                            )));
                        }
                        if *group != l.group {
                            return Err(EngineError::invalid(format!(
                                "layer {} is in group {} on device {} but in group {group} elsewhere",
                                echo(name),
                                l.group,
                                w.device_id
                            )));
                        }
                    }
                    None => {
                        names.insert(name, (&l.layout, l.group));
                    }
                }
            }
        }
        let groups_used: BTreeSet<u32> = names.values().map(|v| v.1).collect();
        let n_groups = groups_used.len() as u32;
        if groups_used.iter().copied().ne(0..n_groups) {
            return Err(EngineError::invalid(format!(
                "layer_group_ids must be dense 0..N-1, got {groups_used:?}"
            )));
        }
        if page_first && n_groups > 1 {
            return Err(EngineError::invalid(
                "page_first cannot be combined with more than one storage group",
            ));
        }
        // Completeness: every (layer, tp_rank) has an owner; owners agree on pp_rank.
        for name in names.keys() {
            let mut pp: Option<u32> = None;
            for r in 0..tp_size {
                let owners: Vec<&Arc<Worker>> = workers
                    .values()
                    .filter(|w| w.tp_rank == r && w.layers.contains_key(*name))
                    .collect();
                if owners.is_empty() {
                    return Err(EngineError::invalid(format!(
                        "incomplete KV registration: layer {} has no owner for tp_rank {r} after all {} workers registered",
                        echo(name),
                        workers.len()
                    )));
                }
                for o in owners {
                    if pp.is_some_and(|p| p != o.pp_rank) {
                        return Err(EngineError::invalid(format!(
                            "layer {} is registered by workers of different pp_ranks",
                            echo(name)
                        )));
                    }
                    pp = Some(o.pp_rank);
                }
            }
        }
        let mut layers: HashMap<String, LayerInfo> = HashMap::new();
        let mut groups: Vec<GroupInfo> = (0..n_groups)
            .map(|_| GroupInfo {
                layers: vec![],
                total_slots: 0,
            })
            .collect();
        for (id, (name, (layout, group))) in names.iter().enumerate() {
            let g = &mut groups[*group as usize];
            layers.insert(
                name.to_string(),
                LayerInfo {
                    id,
                    group: *group,
                    group_rank: g.layers.len(),
                    block_bytes: layout.block_bytes() as usize,
                    page: None,
                },
            );
            g.layers.push(name.to_string());
        }
        let mut pages = Vec::new();
        if page_first {
            // Shards: distinct registered layer sets, ordered by their smallest layer id.
            let mut sets: Vec<Vec<String>> = Vec::new();
            for w in workers.values() {
                let mut s: Vec<String> = w.layers.keys().cloned().collect();
                s.sort_by_key(|n| layers[n].id);
                if !sets.contains(&s) {
                    sets.push(s);
                }
            }
            sets.sort_by_key(|s| layers[&s[0]].id);
            let mut seen = BTreeSet::new();
            for s in &sets {
                for n in s {
                    if !seen.insert(n.clone()) {
                        return Err(EngineError::invalid(format!(
                            "page_first shards overlap: layer {} is in two different layer sets",
                            echo(n)
                        )));
                    }
                }
            }
            for (shard, s) in sets.iter().enumerate() {
                let mut off = 0usize;
                for n in s {
                    let li = layers.get_mut(n).expect("known layer");
                    li.page = Some((shard, off));
                    off += li.block_bytes;
                }
                pages.push((off, s.clone()));
            }
            groups[0].total_slots = pages.len();
        } else {
            for g in &mut groups {
                g.total_slots = g.layers.len() * tp_size as usize;
            }
        }
        Ok(Self {
            layers,
            groups,
            pages,
            tp_size,
            page_first,
        })
    }
}

/// Mutable state of an instance, under one mutex (one lock order: instance state, then
/// nothing else).
#[derive(Debug, Default)]
pub struct InstanceState {
    /// Live workers by device id.
    pub workers: BTreeMap<i32, Arc<Worker>>,
    /// Device ids whose registration is importing right now.
    pub importing: BTreeSet<i32>,
    /// Set once all workers registered.
    pub topology: Option<Arc<Topology>>,
    /// Set when teardown began: no new work is accepted.
    pub closing: bool,
}

/// One engine deployment.
pub struct Instance {
    /// The client's instance id.
    pub id: Arc<str>,
    /// This registration's serial number, unique for the server's life (an id can be
    /// registered again after a teardown; the serial tells the two apart).
    pub serial: u64,
    /// Cache namespace (fixed by the first registration).
    pub namespace: Arc<str>,
    /// TP degree.
    pub tp_size: u32,
    /// Workers expected.
    pub world_size: u32,
    /// Page-first host layout.
    pub page_first: bool,
    /// Requested transfer mode.
    pub transfer_mode: TransferMode,
    /// Whether the instance registers natively (fd side channel) rather than via Python.
    pub native: bool,
    /// Workers and topology.
    pub state: parking_lot::Mutex<InstanceState>,
    /// The operation gate: Save and Load hold a read guard until their copy finished;
    /// teardown takes the write side to drain them.
    pub gate: Arc<tokio::sync::RwLock<()>>,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("id", &self.id)
            .field("namespace", &self.namespace)
            .field("tp_size", &self.tp_size)
            .field("world_size", &self.world_size)
            .finish()
    }
}

/// What a Save or Load works with: the worker, the topology and the gate guard that keeps
/// teardown from releasing the worker's memory until the copy is done.
pub struct WorkerLease {
    /// The instance.
    pub instance: Arc<Instance>,
    /// The worker.
    pub worker: Arc<Worker>,
    /// The sealed topology.
    pub topology: Arc<Topology>,
    /// Held until the copy has finished.
    pub guard: tokio::sync::OwnedRwLockReadGuard<()>,
}

impl Instance {
    /// Acquires the gate without waiting and resolves the worker for `device_id`.
    pub fn enter(self: &Arc<Self>, device_id: i32) -> EngineResult<WorkerLease> {
        let guard = self.gate.clone().try_read_owned().map_err(|_| {
            EngineError::precondition(format!("instance {} is closing", echo(&self.id)))
        })?;
        let st = self.state.lock();
        if st.closing {
            return Err(EngineError::precondition(format!(
                "instance {} is closing",
                echo(&self.id)
            )));
        }
        let Some(topology) = st.topology.clone() else {
            return Err(EngineError::invalid(format!(
                "registration incomplete: {}/{} workers registered",
                st.workers.len(),
                self.world_size
            )));
        };
        let worker = st.workers.get(&device_id).cloned().ok_or_else(|| {
            EngineError::precondition(format!(
                "no worker registered for device_id {device_id} of instance {}",
                echo(&self.id)
            ))
        })?;
        Ok(WorkerLease {
            instance: self.clone(),
            worker,
            topology,
            guard,
        })
    }
}
