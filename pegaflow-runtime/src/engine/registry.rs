//! The registry: instances and their workers, and their lifecycle — reserve a device id →
//! import (by the orchestrator) → commit (the topology seals with the last worker) → fence →
//! drain → release.
//!
//! Owns the instances map, the set of ids being torn down, and the reaper thread that drops
//! released registrations. Must never: let a registration cross the teardown of its id, let a
//! worker join a fenced or sealed instance, or release a worker's memory before its instance
//! is fenced and drained (DESIGN.md §6.3). Lock order: the instances map, then the `closing`
//! set or one instance's state; never the other way round.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::command::RegisterCommand;
use super::instance::{Instance, InstanceState, Topology, Worker};
use super::lease::LeaseTable;
use super::reaper::Reaper;
use crate::error::{echo, EngineError, EngineResult};

/// Registered instances, and those being torn down.
pub struct Registry {
    instances: RwLock<HashMap<Arc<str>, Arc<Instance>>>,
    /// Ids of instances being torn down: a registration under one is refused (a native client
    /// mints a fresh id per attempt), so no registration crosses the teardown of its id.
    closing: Mutex<HashSet<Arc<str>>>,
    max_instances: usize,
    reaper: Reaper,
    /// The next [`Instance::serial`].
    next_serial: AtomicU64,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("instances", &self.len())
            .finish()
    }
}

impl Registry {
    /// An empty registry of at most `max_instances` instances, releasing on `reaper`.
    pub fn new(max_instances: usize, reaper: Reaper) -> Self {
        Self {
            instances: RwLock::new(HashMap::new()),
            closing: Mutex::new(HashSet::new()),
            max_instances,
            reaper,
            next_serial: AtomicU64::new(1),
        }
    }

    /// The reaper thread (drops registrations off the executor).
    pub fn reaper(&self) -> &Reaper {
        &self.reaper
    }

    /// The registered instance `id` (FAILED_PRECONDITION when there is none).
    pub fn get(&self, id: &str) -> EngineResult<Arc<Instance>> {
        self.find(id)
            .ok_or_else(|| EngineError::precondition(format!("instance {} not found", echo(id))))
    }

    /// The registered instance `id`, if any.
    pub fn find(&self, id: &str) -> Option<Arc<Instance>> {
        self.instances.read().get(id).cloned()
    }

    /// Ids of the registered instances, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .instances
            .read()
            .keys()
            .map(|k| k.to_string())
            .collect();
        v.sort();
        v
    }

    /// Whether a registration of `device_id` into instance `id` is importing right now
    /// (reserved, not yet committed or abandoned).
    pub fn is_importing(&self, id: &str, device_id: i32) -> bool {
        self.find(id)
            .is_some_and(|i| i.state.lock().importing.contains(&device_id))
    }

    /// Registered instances.
    pub fn len(&self) -> usize {
        self.instances.read().len()
    }

    /// Whether no instance is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gets or creates the instance and reserves the device id for this registration.
    pub(super) fn reserve(
        &self,
        req: &RegisterCommand,
        native: bool,
    ) -> EngineResult<Arc<Instance>> {
        let mut map = self.instances.write();
        if self.closing.lock().contains(req.instance_id.as_str()) {
            return Err(EngineError::precondition(format!(
                "instance {} is still being torn down; register under a fresh instance id",
                echo(&req.instance_id)
            )));
        }
        let inst = match map.get(req.instance_id.as_str()) {
            Some(i) => {
                if i.tp_size != req.tp_size
                    || i.world_size != req.world_size
                    || i.page_first != req.page_first
                {
                    return Err(EngineError::precondition(format!(
                        "topology mismatch for instance {}: registered tp_size={} world_size={} page_first={}, got tp_size={} world_size={} page_first={}",
                        echo(&i.id), i.tp_size, i.world_size, i.page_first, req.tp_size, req.world_size, req.page_first
                    )));
                }
                if *i.namespace != req.namespace {
                    return Err(EngineError::precondition(format!(
                        "instance {} is registered in namespace {:?}, got {:?}",
                        echo(&i.id),
                        echo(&i.namespace),
                        echo(&req.namespace)
                    )));
                }
                check_mix(i, native)?;
                i.clone()
            }
            None => {
                if map.len() >= self.max_instances {
                    return Err(EngineError::ResourceExhausted(format!(
                        "{} instances are registered (the limit)",
                        map.len()
                    )));
                }
                let i = Arc::new(Instance {
                    id: req.instance_id.as_str().into(),
                    serial: self.next_serial.fetch_add(1, Ordering::Relaxed),
                    namespace: req.namespace.as_str().into(),
                    tp_size: req.tp_size,
                    world_size: req.world_size,
                    page_first: req.page_first,
                    transfer_mode: req.transfer_mode,
                    native,
                    state: parking_lot::Mutex::new(InstanceState::default()),
                    gate: Arc::new(tokio::sync::RwLock::new(())),
                });
                map.insert(i.id.clone(), i.clone());
                i
            }
        };
        let mut st = inst.state.lock();
        if st.closing {
            return Err(EngineError::precondition(format!(
                "instance {} is closing",
                echo(&inst.id)
            )));
        }
        if st.workers.contains_key(&req.device_id) || st.importing.contains(&req.device_id) {
            return Err(EngineError::precondition(format!(
                "GPU context for device {} already exists in instance {}",
                req.device_id,
                echo(&inst.id)
            )));
        }
        if st.topology.is_some()
            || st.workers.len() + st.importing.len() >= inst.world_size as usize
        {
            return Err(EngineError::precondition(format!(
                "instance {} is already fully registered ({} workers); device {} cannot join",
                echo(&inst.id),
                inst.world_size,
                req.device_id
            )));
        }
        st.importing.insert(req.device_id);
        drop(st);
        Ok(inst)
    }

    /// Undoes a reservation whose import or commit failed: frees the device id, and removes
    /// the instance when this reservation had created it and nothing else joined.
    pub(super) fn abandon(&self, inst: &Arc<Instance>, device_id: i32) {
        // Map lock first, then the instance's state (the order `reserve` uses), so no
        // registration can reserve on this instance between the check and the removal.
        let mut map = self.instances.write();
        let mut st = inst.state.lock();
        st.importing.remove(&device_id);
        if st.workers.is_empty()
            && st.importing.is_empty()
            && map.get(&*inst.id).is_some_and(|i| Arc::ptr_eq(i, inst))
        {
            map.remove(&*inst.id);
        }
    }

    /// Commits an imported worker to its reservation: it joins the instance (sealing the
    /// topology when it is the last one), or — the instance was fenced or filled meanwhile, or
    /// the topology does not seal — its memory is released on the reaper thread.
    pub(super) async fn commit(&self, inst: &Arc<Instance>, worker: Worker) -> EngineResult<()> {
        let device = worker.device_id;
        let worker = Arc::new(worker);
        let rejected = {
            let mut st = inst.state.lock();
            st.importing.remove(&device);
            if st.closing {
                Some((
                    EngineError::precondition(format!(
                        "instance {} was unregistered while device {device} was registering",
                        echo(&inst.id)
                    )),
                    Some(worker.clone()),
                ))
            } else if st.topology.is_some() || st.workers.len() >= inst.world_size as usize {
                Some((
                    EngineError::precondition(format!(
                        "instance {} is already fully registered ({} workers); device {device} cannot join",
                        echo(&inst.id),
                        inst.world_size
                    )),
                    Some(worker.clone()),
                ))
            } else {
                st.workers.insert(device, worker.clone());
                if st.workers.len() as u32 == inst.world_size {
                    match Topology::seal(&st.workers, inst.tp_size, inst.page_first) {
                        Ok(t) => {
                            st.topology = Some(Arc::new(t));
                            None
                        }
                        Err(e) => {
                            let w = st.workers.remove(&device);
                            Some((e, w))
                        }
                    }
                } else {
                    None
                }
            }
        };
        if let Some((e, w)) = rejected {
            drop(worker);
            self.reaper.release(w).await;
            return Err(e);
        }
        tracing::info!(
            instance = %inst.id,
            device,
            tp_rank = worker.tp_rank,
            pp_rank = worker.pp_rank,
            layers = worker.layers.len(),
            transport = worker.transport.kind(),
            "worker registered"
        );
        Ok(())
    }

    /// Removes instance `id` and fences it (under the map lock, so no registration can reserve
    /// on it in between): new work and new workers are refused from here on.
    pub(super) fn remove_fenced(&self, id: &str) -> EngineResult<Arc<Instance>> {
        let mut map = self.instances.write();
        let inst = map
            .remove(id)
            .ok_or_else(|| EngineError::precondition(format!("instance {} not found", echo(id))))?;
        self.fence(&inst);
        Ok(inst)
    }

    /// Removes and fences every instance.
    pub(super) fn remove_all_fenced(&self) -> Vec<Arc<Instance>> {
        let mut map = self.instances.write();
        let all: Vec<Arc<Instance>> = map.drain().map(|(_, v)| v).collect();
        for inst in &all {
            self.fence(inst);
        }
        all
    }

    /// Marks an instance closing (callers hold the instances lock).
    fn fence(&self, inst: &Arc<Instance>) {
        self.closing.lock().insert(inst.id.clone());
        inst.state.lock().closing = true;
    }

    /// Drains a fenced instance's copies, drops its leases and releases its registrations on
    /// the reaper thread; returns how many layer registrations (tensors) it released. A
    /// registration importing meanwhile finds the instance closing at commit and releases its
    /// own memory.
    pub(super) async fn teardown(&self, inst: Arc<Instance>, leases: &LeaseTable) -> usize {
        // Drain: waits for every Save/Load holding the gate.
        let drained = inst.gate.write().await;
        let workers = std::mem::take(&mut inst.state.lock().workers);
        let dropped = leases.drop_instance(&inst.id);
        let n = workers.len();
        let tensors: usize = workers.values().map(|w| w.layers.len()).sum();
        self.reaper.release(workers).await;
        drop(drained);
        self.closing.lock().remove(&inst.id);
        tracing::info!(instance = %inst.id, workers = n, tensors, leases = dropped, "instance unregistered");
        tensors
    }
}

/// An instance holds either per-layer-blob (Python client) or side-channel (native)
/// registrations, never both.
pub(super) fn check_mix(i: &Instance, native: bool) -> EngineResult<()> {
    if i.native != native {
        return Err(EngineError::precondition(format!(
            "instance {} already has {} registrations; an instance cannot mix Python (per-layer blob) and native (side-channel) registrations",
            echo(&i.id),
            if i.native { "native" } else { "Python" }
        )));
    }
    Ok(())
}
