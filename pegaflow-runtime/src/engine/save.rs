//! Save, orchestrated: resolve the worker (gate entered, ranks checked) → check every layer
//! and block id → plan one block per (group, hash) not yet resident → allocate host buffers
//! (the store evicts under pressure) → copy device → host in one batch → seal the blocks
//! whose slots are all present. A block saved here is queryable as soon as Save returns.
//!
//! Owns those steps and the partially saved blocks (`inflight`), each with the instances that
//! wrote its slots (freed when the last of them is unregistered: [`Engine::drop_inflight_of`]).
//! Must never: allocate or copy before every check passed, address a block id outside its layer's layout, seal a block
//! with a missing slot, or let the worker's gate guard go before the copy is done.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::command::{SaveCommand, SaveLayer};
use super::instance::{Instance, Topology, WorkerLayer, WorkerLease};
use super::{Engine, Inflight};
use crate::block::{BlockKey, KeyRef, SealedBlock, Slot};
use crate::buffer::HostBuffer;
use crate::error::{echo, EngineError, EngineResult};
use crate::plugin::{CopyBatch, CopyOp, Direction};

/// One block of a Save request: which slots it brings and where they go in its buffer.
struct BlockPlan<'a> {
    group: u32,
    hash: &'a [u8],
    /// (slot index, offset in the buffer, length).
    slots: Vec<(usize, usize, usize)>,
    /// (layer, device block id, offset in the buffer).
    parts: Vec<(&'a WorkerLayer, u32, usize)>,
    len: usize,
}

/// Appends the copy ops moving `layer`'s block `block_id` to/from `buf` at `buf_off`, merging
/// with the previous op when both sides are contiguous.
pub(super) fn push_ops(
    ops: &mut Vec<CopyOp>,
    layer: &WorkerLayer,
    block_id: u64,
    buf: &HostBuffer,
    mut buf_off: usize,
) {
    let ranges = layer
        .layout
        .ranges(block_id)
        .expect("block id validated against the layout");
    for r in ranges {
        let mut dev = layer.addr(r.offset);
        for piece in buf.pieces(buf_off, r.len as usize) {
            let op = CopyOp {
                device_addr: dev,
                host_addr: piece.addr,
                len: piece.len,
            };
            match ops.last_mut() {
                Some(l)
                    if l.device_addr + l.len as u64 == op.device_addr
                        && l.host_addr + l.len == op.host_addr =>
                {
                    l.len += op.len
                }
                _ => ops.push(op),
            }
            dev += piece.len as u64;
        }
        buf_off += r.len as usize;
    }
}

/// A save layer resolved against the worker: its registration, its slot and its offset in
/// the slot.
type ResolvedLayer<'a> = (&'a WorkerLayer, usize, usize);

impl Engine {
    /// Save (see the module doc): validate → resolve the worker → check the layers → plan →
    /// allocate → copy → seal. INVALID_ARGUMENT / FAILED_PRECONDITION before any allocation
    /// or copy.
    pub async fn save(&self, cmd: SaveCommand) -> EngineResult<()> {
        let t_rpc = Instant::now();
        let inst = self.instance(&cmd.instance_id)?;
        let saves: Vec<&SaveLayer> = cmd
            .layers
            .iter()
            .filter(|s| !s.block_ids.is_empty())
            .collect();
        if saves.is_empty() {
            return Ok(());
        }
        let _flush = self.flush_barrier.read().await;
        let wl = resolve_saver(&inst, &cmd)?;
        let layers = check_save_layers(&wl, &cmd, &saves)?;
        let plans = self.plan_save(&inst.namespace, &wl.topology, &saves, &layers)?;
        if plans.is_empty() {
            return Ok(());
        }
        let bufs = self.allocate_save(&plans)?;
        self.copy_to_host(&wl, &plans, &bufs).await?;
        self.seal(
            inst.serial,
            &inst.namespace,
            &wl.topology.groups,
            plans,
            bufs,
        );
        // The gate guard goes last: teardown may only release the worker once nothing here
        // refers to it.
        drop(layers);
        drop(wl);
        self.update_gauges();
        tracing::debug!(instance = %inst.id, total_us = t_rpc.elapsed().as_micros() as u64, "save done");
        Ok(())
    }

    /// Plans the blocks: one entry per (group, hash) not yet resident, in request order, with
    /// the slots this worker brings and the device parts that fill them.
    fn plan_save<'a>(
        &self,
        ns: &Arc<str>,
        topo: &Topology,
        saves: &[&'a SaveLayer],
        layers: &[ResolvedLayer<'a>],
    ) -> EngineResult<Vec<BlockPlan<'a>>> {
        // Plan: one entry per (group, hash) not yet resident, in request order.
        let mut plans: Vec<BlockPlan<'_>> = Vec::new();
        let mut by_key: HashMap<(u32, &[u8]), usize> = HashMap::new();
        // Layers usually carry the same hash list: reuse the previous layer's position → plan
        // mapping instead of looking every (layer, block) up again.
        // (group, hash list, plan index per position) of the previous layer.
        type Positions<'h> = (u32, &'h Vec<Vec<u8>>, Vec<Option<usize>>);
        let mut prev: Option<Positions<'_>> = None;
        for (s, &(layer, slot, page_off)) in saves.iter().zip(layers) {
            let block_bytes = layer.layout.block_bytes() as usize;
            let reuse = prev
                .as_ref()
                .is_some_and(|(g, h, _)| *g == layer.group && **h == s.hashes);
            let positions: Vec<Option<usize>> = if reuse {
                prev.take().expect("checked").2
            } else {
                s.hashes
                    .iter()
                    .map(|hash| {
                        let key = (layer.group, hash.as_slice());
                        if let Some(&i) = by_key.get(&key) {
                            return Some(i);
                        }
                        if self.store.contains(KeyRef {
                            namespace: ns,
                            group: layer.group,
                            hash,
                        }) {
                            return None;
                        }
                        plans.push(BlockPlan {
                            group: layer.group,
                            hash,
                            slots: vec![],
                            parts: vec![],
                            len: 0,
                        });
                        by_key.insert(key, plans.len() - 1);
                        Some(plans.len() - 1)
                    })
                    .collect()
            };
            for (&bid, idx) in s.block_ids.iter().zip(&positions) {
                let Some(idx) = *idx else { continue };
                let p = &mut plans[idx];
                if topo.page_first {
                    if p.slots.is_empty() {
                        let Some(page) = topo.slot_bytes(layer.group, slot) else {
                            return Err(EngineError::internal(format!(
                                "no page {slot} in the sealed topology"
                            )));
                        };
                        p.slots.push((slot, 0, page));
                        p.len = page;
                    }
                    // Parts of one layer are pushed together: a repeat is the same hash twice.
                    if p.parts
                        .last()
                        .is_some_and(|(l, _, _)| std::ptr::eq(*l, layer))
                    {
                        continue;
                    }
                    p.parts.push((layer, bid, page_off));
                } else {
                    // Each layer has its own slot and pushes its parts together, so a repeat of
                    // this layer's slot is the same hash twice in one layer: first wins.
                    if p.slots.last().is_some_and(|s| s.0 == slot) {
                        continue;
                    }
                    p.slots.push((slot, p.len, block_bytes));
                    p.parts.push((layer, bid, p.len));
                    p.len += block_bytes;
                }
            }
            prev = Some((layer.group, &s.hashes, positions));
        }
        Ok(plans)
    }

    /// Host buffers for the plans, all or nothing (the store evicts under pressure).
    fn allocate_save(&self, plans: &[BlockPlan<'_>]) -> EngineResult<Vec<Arc<HostBuffer>>> {
        let lens: Vec<usize> = plans.iter().map(|p| p.len).collect();
        Ok(self
            .store
            .allocate(&lens)?
            .into_iter()
            .map(Arc::new)
            .collect())
    }

    /// One batched device → host copy of every planned part, with its metrics.
    async fn copy_to_host(
        &self,
        wl: &WorkerLease,
        plans: &[BlockPlan<'_>],
        bufs: &[Arc<HostBuffer>],
    ) -> EngineResult<()> {
        let mut ops = Vec::new();
        for (p, buf) in plans.iter().zip(bufs) {
            for &(layer, bid, off) in &p.parts {
                push_ops(&mut ops, layer, bid as u64, buf, off);
            }
        }
        let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
        let batch = CopyBatch {
            location: wl.worker.location,
            direction: Direction::ToHost,
            mode: wl.instance.transfer_mode,
            ops,
        };
        let t0 = Instant::now();
        let transport = wl.worker.transport.clone();
        let keep = (bufs.to_vec(), wl.worker.clone());
        let r = Self::run_copy(transport, batch, keep).await;
        if let Err(e) = r {
            self.metrics
                .transfer_failures
                .with_label_values(&["d2h"])
                .inc();
            return Err(e);
        }
        tracing::debug!(
            instance = %wl.instance.id,
            blocks = plans.len(),
            bytes,
            copy_us = t0.elapsed().as_micros() as u64,
            "save copied"
        );
        self.metrics.save_bytes.inc_by(bytes);
        self.metrics
            .save_duration
            .observe(t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// Adds the copied slots to their partly saved blocks (`writer`: the saving instance's
    /// serial) and seals every block that has all its slots.
    fn seal(
        &self,
        writer: u64,
        ns: &Arc<str>,
        groups: &[super::instance::GroupInfo],
        plans: Vec<BlockPlan<'_>>,
        bufs: Vec<Arc<HostBuffer>>,
    ) {
        let mut inflight = self.inflight.lock();
        for (p, buf) in plans.into_iter().zip(bufs) {
            let key = BlockKey {
                namespace: ns.clone(),
                group: p.group,
                hash: p.hash.into(),
            };
            if self.store.contains(KeyRef {
                namespace: ns,
                group: p.group,
                hash: p.hash,
            }) {
                continue; // sealed by a concurrent save meanwhile
            }
            let total = groups[p.group as usize].total_slots;
            let fp = self.store.pool().footprint_bytes(buf.len());
            let entry = inflight
                .entry(key.clone())
                .or_insert_with(|| Inflight::new(total));
            if entry.slots.len() != total {
                tracing::warn!(
                    namespace = %ns,
                    "dropping a partially saved block whose slot count {} differs from this instance's {total}",
                    entry.slots.len()
                );
                *entry = Inflight::new(total);
            }
            let mut used = false;
            for &(slot, off, len) in &p.slots {
                if entry.slots[slot].is_none() {
                    entry.slots[slot] = Some(Slot {
                        buf: buf.clone(),
                        offset: off,
                        len,
                    });
                    entry.filled += 1;
                    used = true;
                }
            }
            if used {
                entry.buffers.push(buf);
                entry.footprint += fp;
            }
            // A writer whose slots another instance already filled still counts: the block
            // must outlive whichever of them goes first.
            if !entry.writers.contains(&writer) {
                entry.writers.push(writer);
            }
            if entry.filled == total {
                let e = inflight.remove(&key).expect("entry present");
                let block = Arc::new(SealedBlock {
                    group: p.group,
                    slots: e.slots.into_iter().map(|s| s.expect("filled")).collect(),
                    footprint: e.footprint,
                    sealed_at: Instant::now(),
                });
                self.store.insert_sealed(key, block);
            }
        }
        let bytes: u64 = inflight.values().map(|e| e.footprint).sum();
        self.metrics.inflight_bytes.set(bytes as i64);
    }
}

/// Enters the instance's gate and resolves the saving worker; its ranks must be the ones the
/// client names.
fn resolve_saver(inst: &Arc<Instance>, req: &SaveCommand) -> EngineResult<WorkerLease> {
    let wl = inst.enter(req.device_id)?;
    let w = &wl.worker;
    if w.tp_rank != req.tp_rank || w.pp_rank != req.pp_rank {
        return Err(EngineError::invalid(format!(
            "device_id {} of instance {} is registered as tp_rank {} pp_rank {}, got tp_rank {} pp_rank {}",
            req.device_id, echo(&inst.id), w.tp_rank, w.pp_rank, req.tp_rank, req.pp_rank
        )));
    }
    Ok(wl)
}

/// Checks every layer and block id against the worker and the sealed topology before
/// anything is planned; page-first saves must carry the whole shard.
fn check_save_layers<'a>(
    wl: &'a WorkerLease,
    req: &SaveCommand,
    saves: &[&SaveLayer],
) -> EngineResult<Vec<ResolvedLayer<'a>>> {
    let w = &wl.worker;
    let topo = &wl.topology;
    let inst = &wl.instance;
    // Validate every layer and block id before planning anything.
    let mut seen = std::collections::HashSet::new();
    let mut layers = Vec::with_capacity(saves.len());
    for s in saves {
        if !seen.insert(s.name.as_str()) {
            return Err(EngineError::invalid(format!(
                "layer {} appears twice in one save",
                echo(&s.name)
            )));
        }
        let layer = w.layers.get(&s.name).ok_or_else(|| {
            EngineError::invalid(format!(
                "layer {} is not registered on device_id {} of instance {}",
                echo(&s.name),
                req.device_id,
                echo(&inst.id)
            ))
        })?;
        let n = layer.layout.num_blocks();
        if let Some(b) = s.block_ids.iter().find(|&&b| b as u64 >= n) {
            return Err(EngineError::invalid(format!(
                "block id {b} out of range for layer {} ({n} blocks)",
                echo(&s.name)
            )));
        }
        let (slot, page_off) = topo.slot_of(&s.name, w.tp_rank).ok_or_else(|| {
            EngineError::invalid(format!(
                "layer {} is not part of instance {}'s sealed topology",
                echo(&s.name),
                echo(&inst.id)
            ))
        })?;
        if topo.layers[&s.name].block_bytes != layer.layout.block_bytes() as usize {
            return Err(EngineError::invalid(format!(
                "layer {} of device_id {} does not match the instance's block geometry",
                echo(&s.name),
                req.device_id
            )));
        }
        layers.push((layer, slot, page_off));
    }
    if topo.page_first || w.whole_blocks {
        // Every layer of the worker's shard (or, native v2, every arena), with identical ids
        // and hashes.
        let first = saves[0];
        let complete = saves.len() == w.layers.len()
            && saves
                .iter()
                .all(|s| s.block_ids == first.block_ids && s.hashes == first.hashes);
        if !complete {
            return Err(EngineError::invalid(format!(
                "{} save must carry all {} layers of the {} with the same block ids and hashes",
                if topo.page_first {
                    "page-first"
                } else {
                    "a native v2"
                },
                w.layers.len(),
                if topo.page_first {
                    "shard"
                } else {
                    "registration"
                }
            )));
        }
    }
    Ok(layers)
}
