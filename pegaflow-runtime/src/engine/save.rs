//! Save: validate everything, allocate host buffers (evicting under pressure), copy device →
//! host in one batch, then seal the blocks whose slots are all present. A block saved here is
//! queryable as soon as Save returns.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::command::{SaveCommand, SaveLayer};
use super::instance::WorkerLayer;
use super::{Engine, Inflight};
use crate::block::{BlockKey, KeyRef, SealedBlock, Slot};
use crate::buffer::HostBuffer;
use crate::error::{EngineError, EngineResult};
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

impl Engine {
    /// Save (see the module doc). INVALID_ARGUMENT / FAILED_PRECONDITION before any copy.
    pub async fn save(&self, req: SaveCommand) -> EngineResult<()> {
        let t_rpc = Instant::now();
        let inst = self.instance(&req.instance_id)?;
        let saves: Vec<&SaveLayer> = req
            .layers
            .iter()
            .filter(|s| !s.block_ids.is_empty())
            .collect();
        if saves.is_empty() {
            return Ok(());
        }
        let _flush = self.flush_barrier.read().await;
        let wl = inst.enter(req.device_id)?;
        let w = wl.worker.clone();
        if w.tp_rank != req.tp_rank || w.pp_rank != req.pp_rank {
            return Err(EngineError::invalid(format!(
                "device_id {} of instance {} is registered as tp_rank {} pp_rank {}, got tp_rank {} pp_rank {}",
                req.device_id, inst.id, w.tp_rank, w.pp_rank, req.tp_rank, req.pp_rank
            )));
        }
        let topo = wl.topology.clone();
        // Validate every layer and block id before planning anything.
        let mut seen = std::collections::HashSet::new();
        let mut layers = Vec::with_capacity(saves.len());
        for s in &saves {
            if !seen.insert(s.name.as_str()) {
                return Err(EngineError::invalid(format!(
                    "layer {} appears twice in one save",
                    s.name
                )));
            }
            let layer = w.layers.get(&s.name).ok_or_else(|| {
                EngineError::invalid(format!(
                    "layer {} is not registered on device_id {} of instance {}",
                    s.name, req.device_id, inst.id
                ))
            })?;
            let n = layer.layout.num_blocks();
            if let Some(b) = s.block_ids.iter().find(|&&b| b as u64 >= n) {
                return Err(EngineError::invalid(format!(
                    "block id {b} out of range for layer {} ({n} blocks)",
                    s.name
                )));
            }
            let (slot, page_off) = topo.slot_of(&s.name, w.tp_rank).ok_or_else(|| {
                EngineError::invalid(format!(
                    "layer {} is not part of instance {}'s sealed topology",
                    s.name, inst.id
                ))
            })?;
            if topo.layers[&s.name].block_bytes != layer.layout.block_bytes() as usize {
                return Err(EngineError::invalid(format!(
                    "layer {} of device_id {} does not match the instance's block geometry",
                    s.name, req.device_id
                )));
            }
            layers.push((layer, slot, page_off));
        }
        if topo.page_first {
            // Every layer of the worker's shard, with identical ids and hashes.
            let first = saves[0];
            let complete = saves.len() == w.layers.len()
                && saves
                    .iter()
                    .all(|s| s.block_ids == first.block_ids && s.hashes == first.hashes);
            if !complete {
                return Err(EngineError::invalid(format!(
                    "page-first save must carry all {} layers of the shard with the same block ids and hashes",
                    w.layers.len()
                )));
            }
        }
        // Plan: one entry per (group, hash) not yet resident, in request order.
        let ns = &inst.namespace;
        let mut plans: Vec<BlockPlan<'_>> = Vec::new();
        let mut by_key: HashMap<(u32, &[u8]), usize> = HashMap::new();
        // Layers usually carry the same hash list: reuse the previous layer's position → plan
        // mapping instead of looking every (layer, block) up again.
        // (group, hash list, plan index per position) of the previous layer.
        type Positions<'h> = (u32, &'h Vec<Vec<u8>>, Vec<Option<usize>>);
        let mut prev: Option<Positions<'_>> = None;
        for (s, &(layer, slot, page_off)) in saves.iter().zip(&layers) {
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
        if plans.is_empty() {
            return Ok(());
        }
        let lens: Vec<usize> = plans.iter().map(|p| p.len).collect();
        let bufs: Vec<Arc<HostBuffer>> = self
            .store
            .allocate(&lens)?
            .into_iter()
            .map(Arc::new)
            .collect();
        let mut ops = Vec::new();
        for (p, buf) in plans.iter().zip(&bufs) {
            for &(layer, bid, off) in &p.parts {
                push_ops(&mut ops, layer, bid as u64, buf, off);
            }
        }
        let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
        let batch = CopyBatch {
            location: w.location,
            direction: Direction::ToHost,
            mode: inst.transfer_mode,
            ops,
        };
        let t0 = Instant::now();
        let transport = w.transport.clone();
        let keep = (bufs.clone(), wl.worker.clone());
        let r = Self::run_copy(transport, batch, keep).await;
        if let Err(e) = r {
            self.metrics
                .transfer_failures
                .with_label_values(&["d2h"])
                .inc();
            return Err(e);
        }
        tracing::debug!(
            instance = %inst.id,
            blocks = lens.len(),
            bytes,
            copy_us = t0.elapsed().as_micros() as u64,
            "save copied"
        );
        self.metrics.save_bytes.inc_by(bytes);
        self.metrics
            .save_duration
            .observe(t0.elapsed().as_secs_f64());
        self.seal(&inst.namespace, &topo.groups, plans, bufs);
        // The gate guard goes last: teardown may only release the worker once nothing here
        // refers to it.
        drop(layers);
        drop(w);
        drop(wl);
        self.update_gauges();
        tracing::debug!(instance = %inst.id, total_us = t_rpc.elapsed().as_micros() as u64, "save done");
        Ok(())
    }

    fn seal(
        &self,
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
            let entry = inflight.entry(key.clone()).or_insert_with(|| Inflight {
                slots: vec![None; total],
                filled: 0,
                buffers: vec![],
                footprint: 0,
                created: Instant::now(),
            });
            if entry.slots.len() != total {
                tracing::warn!(
                    namespace = %ns,
                    "dropping a partially saved block whose slot count {} differs from this instance's {total}",
                    entry.slots.len()
                );
                *entry = Inflight {
                    slots: vec![None; total],
                    filled: 0,
                    buffers: vec![],
                    footprint: 0,
                    created: Instant::now(),
                };
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
