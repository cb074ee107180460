//! Load: validate the whole request (leases, counts, layers, slot shapes), consume the leases,
//! then copy host → device in one batch. Completion goes to the client's load-state word
//! (1, or −1 on any failure) or, with `wait_for_completion`, is the RPC's own return.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use pegaflow_api::load_state::{LoadState, LOAD_FAILED, LOAD_SUCCESS};

use super::command::{LoadCommand, LoadCompletion};
use super::instance::{WorkerLayer, WorkerLease};
use super::Engine;
use crate::block::SealedBlock;
use crate::error::{EngineError, EngineResult};
use crate::plugin::{CopyBatch, CopyOp, Direction};

struct Prepared {
    wl: WorkerLease,
    ops: Vec<CopyOp>,
    blocks: Vec<Arc<[Arc<SealedBlock>]>>,
    bytes: u64,
}

/// Appends ops copying `len` bytes of `slot` at `slot_off` into `layer`'s block `dst`.
fn push_load_ops(
    ops: &mut Vec<CopyOp>,
    layer: &WorkerLayer,
    dst: u64,
    slot: &super::Slot,
    slot_off: usize,
) {
    super::save::push_ops(ops, layer, dst, &slot.buf, slot.offset + slot_off);
}

impl Engine {
    /// Load (see the module doc). Validation failures are returned as errors and written as −1
    /// to the load state; nothing is copied.
    pub async fn load(&self, req: LoadCommand) -> EngineResult<()> {
        let state = match &req.completion {
            LoadCompletion::Wait => None,
            LoadCompletion::StateWord(name) => {
                let s = LoadState::attach(name).map_err(|e| {
                    EngineError::internal(format!("cannot attach load state {name:?}: {e}"))
                })?;
                Some(s)
            }
        };
        let prepared = match self.prepare_load(&req) {
            Ok(p) => p,
            Err(e) => {
                if let Some(s) = &state {
                    s.set(LOAD_FAILED);
                }
                self.metrics.load_failures.inc();
                return Err(e);
            }
        };
        let Some(p) = prepared else {
            if let Some(s) = &state {
                s.set(LOAD_SUCCESS);
            }
            return Ok(());
        };
        let metrics = self.metrics.clone();
        let transport = p.wl.worker.transport.clone();
        let batch = CopyBatch {
            location: p.wl.worker.location,
            direction: Direction::ToDevice,
            mode: p.wl.instance.transfer_mode,
            ops: p.ops,
        };
        let bytes = p.bytes;
        let keep = (p.blocks, p.wl);
        let task = async move {
            let t0 = Instant::now();
            let r = Engine::run_copy(transport, batch, keep).await;
            match &r {
                Ok(()) => {
                    metrics.load_bytes.inc_by(bytes);
                    metrics.load_duration.observe(t0.elapsed().as_secs_f64());
                }
                Err(e) => {
                    metrics.load_failures.inc();
                    metrics.transfer_failures.with_label_values(&["h2d"]).inc();
                    tracing::warn!(error = %e, "load failed");
                }
            }
            if let Some(s) = &state {
                s.set(if r.is_ok() { LOAD_SUCCESS } else { LOAD_FAILED });
            }
            r
        };
        if req.completion == LoadCompletion::Wait {
            task.await
        } else {
            tokio::spawn(task);
            Ok(())
        }
    }

    fn prepare_load(&self, req: &LoadCommand) -> EngineResult<Option<Prepared>> {
        if req.device_id < 0 {
            return Err(EngineError::invalid(format!(
                "device_id must be >= 0, got {}",
                req.device_id
            )));
        }
        let inst = self.instance(&req.instance_id)?;
        let wl = inst.enter(req.device_id)?;
        let w = wl.worker.clone();
        if w.tp_rank != req.tp_rank {
            return Err(EngineError::invalid(format!(
                "device_id {} of instance {} is registered as tp_rank {}, got {}",
                req.device_id, inst.id, w.tp_rank, req.tp_rank
            )));
        }
        if w.traits.completion_by_rpc_only && req.completion != LoadCompletion::Wait {
            return Err(EngineError::invalid(
                "loads into this registration complete only by the RPC's return: set wait_for_completion",
            ));
        }
        if req.leases.is_empty() {
            return Ok(None);
        }
        if req.groups.is_empty() {
            return Err(EngineError::invalid(
                "a load needs at least one layer group",
            ));
        }
        let topo = wl.topology.clone();
        // Resolve load groups to layers and one storage group each.
        let mut seen = HashSet::new();
        // Per load group: its layers with their (slot, offset in the slot), and its storage group.
        type GroupLayers<'a> = Vec<(&'a str, &'a WorkerLayer, usize, usize)>;
        let mut groups: Vec<(GroupLayers<'_>, u32)> = Vec::new();
        for (gi, g) in req.groups.iter().enumerate() {
            let mut layers = Vec::new();
            let mut storage: Option<u32> = None;
            for name in g {
                if !seen.insert(name.as_str()) {
                    return Err(EngineError::invalid(format!(
                        "layer {name} appears in more than one load group"
                    )));
                }
                let l = w.layers.get(name).ok_or_else(|| {
                    EngineError::invalid(format!(
                        "layer {name} is not registered on device_id {} of instance {}",
                        req.device_id, inst.id
                    ))
                })?;
                if storage.is_some_and(|s| s != l.group) {
                    return Err(EngineError::invalid(format!(
                        "load group {gi} mixes layers of storage groups {} and {}",
                        storage.unwrap_or_default(),
                        l.group
                    )));
                }
                storage = Some(l.group);
                let (slot, off) = topo.slot_of(name, w.tp_rank).ok_or_else(|| {
                    EngineError::invalid(format!(
                        "layer {name} is not part of instance {}'s sealed topology",
                        inst.id
                    ))
                })?;
                if topo.layers[name].block_bytes != l.layout.block_bytes() as usize {
                    return Err(EngineError::invalid(format!(
                        "layer {name} of device_id {} does not match the instance's block geometry",
                        req.device_id
                    )));
                }
                layers.push((name.as_str(), l, slot, off));
            }
            groups.push((layers, storage.unwrap_or(0)));
        }
        // Validate every lease before consuming any.
        let mut leases = Vec::with_capacity(req.leases.len());
        let mut seen_leases = HashSet::new();
        for ll in &req.leases {
            let id = super::parse_lease(&ll.lease)?;
            if !seen_leases.insert(id) {
                return Err(EngineError::invalid(
                    "a lease appears twice in one load (each worker consumes a lease once)",
                ));
            }
            let blocks = self.leases.peek(&id, &inst.id)?;
            if ll.targets_by_group.len() != groups.len() {
                return Err(EngineError::invalid(format!(
                    "a lease load has targets for {} groups but the load names {} groups",
                    ll.targets_by_group.len(),
                    groups.len()
                )));
            }
            for ((layers, storage), targets) in groups.iter().zip(&ll.targets_by_group) {
                if layers.is_empty() {
                    continue;
                }
                if targets.len() != blocks.len() {
                    return Err(EngineError::invalid(format!(
                        "query lease block count {} does not match destination block count {}",
                        blocks.len(),
                        targets.len()
                    )));
                }
                for (b, t) in blocks.iter().zip(targets.iter()) {
                    let Some(dst) = *t else {
                        continue;
                    };
                    if b.group != *storage {
                        return Err(EngineError::invalid(format!(
                            "a block of storage group {} cannot be loaded into layers of group {storage}",
                            b.group
                        )));
                    }
                    for &(name, l, slot, _) in layers {
                        if dst as u64 >= l.layout.num_blocks() {
                            return Err(EngineError::invalid(format!(
                                "destination block id {dst} out of range for layer {name} ({} blocks)",
                                l.layout.num_blocks()
                            )));
                        }
                        let ok = b
                            .slots
                            .get(slot)
                            .zip(topo.slot_bytes(b.group, slot))
                            .is_some_and(|(s, want)| s.len == want);
                        if !ok {
                            return Err(EngineError::invalid(format!(
                                "stored block does not match this instance's layout for layer {name} (namespace {} shared by incompatible layouts?)",
                                inst.namespace
                            )));
                        }
                    }
                }
            }
            leases.push((id, ll));
        }
        // Consume, then plan the copies.
        let mut ops = Vec::new();
        let mut held = Vec::with_capacity(leases.len());
        let mut bytes = 0u64;
        for (id, ll) in leases {
            let blocks = self.leases.consume(&id, &inst.id)?;
            for ((layers, _), targets) in groups.iter().zip(&ll.targets_by_group) {
                for (b, t) in blocks.iter().zip(targets.iter()) {
                    let Some(dst) = *t else {
                        continue;
                    };
                    for &(_, l, slot, off) in layers {
                        push_load_ops(&mut ops, l, dst as u64, &b.slots[slot], off);
                        bytes += l.layout.block_bytes();
                    }
                }
            }
            held.push(blocks);
        }
        self.metrics.leases_active.set(self.leases.len() as i64);
        Ok(Some(Prepared {
            wl,
            ops,
            blocks: held,
            bytes,
        }))
    }
}
