//! Save, orchestrated: resolve the worker (gate entered, ranks checked) → check every layer
//! and block id → plan one block per (group, hash) not yet resident → allocate host buffers
//! (the store evicts under pressure) → copy device → host in one batch → seal the blocks
//! whose slots are all present, on the seal thread ([`super::sealer`]) after Save has
//! answered. A block saved here is queryable as soon as Save returns: queries wait for the
//! seals submitted before them.
//!
//! Owns those steps and the partially saved blocks (`inflight`), each with the instances that
//! wrote its slots (freed when the last of them is unregistered: [`Engine::drop_inflight_of`]).
//! Must never: allocate or copy before every check passed, address a block id outside its layer's layout, seal a block
//! with a missing slot, or let the worker's gate guard go before the copy is done.

use std::sync::Arc;
use std::time::Instant;

use super::acked::{AckedSave, AckedSaves};
use super::command::{HashList, SaveCommand, SaveLayer};
use super::instance::{Instance, Topology, WorkerLayer, WorkerLease};
use super::{Engine, Inflight};
use crate::block::{BlockKey, KeyRef, SealedBlock, Slot};
use crate::buffer::HostBuffer;
use crate::error::{echo, EngineError, EngineResult};
use crate::metrics::{PhaseClock, SavePhase};
use crate::plugin::{CopyBatch, CopyOp, Direction, SourceRead};

/// One block of a Save request. Its slots and device parts live in the plan's [`Fill`], so
/// planning allocates nothing per block.
struct BlockPlan<'a> {
    group: u32,
    /// Where the hash is in the request: (index in the Save's non-empty layers, position).
    at: (u32, u32),
    len: usize,
    /// The slot the last layer that added a slot claimed (layer-first: a repeat of that slot
    /// is the same hash twice in one layer, and the first wins).
    last_slot: Option<usize>,
    /// The layer that last added a part (page-first: a repeat is the same hash twice).
    last_layer: Option<&'a WorkerLayer>,
}

/// The plan of a Save: one block per (group, hash) not yet resident, in request order, and
/// the slots and device parts that fill them.
struct SavePlan<'a> {
    blocks: Vec<BlockPlan<'a>>,
    fill: Fill<'a>,
}

/// How a Save's planned blocks are filled.
enum Fill<'a> {
    /// Every block the same way: each save layer in request order adds one slot and one
    /// device part. Planned when the Save is layer-first, every layer carries the same hash
    /// list of one group and every layer fills its own slot (a vLLM or native Save of whole
    /// blocks): nothing is recorded per (block, layer), and the device parts are built while
    /// the copy runs. A block planned at position `pos` takes layer `l`'s part from device
    /// block `l.block_ids[pos]`.
    Uniform(Vec<UniformLayer<'a>>),
    /// Anything else: the slots and device parts, flat, in the order the layers were planned.
    Listed {
        /// (block, slot index, offset in the block's buffer, length).
        slots: Vec<(u32, usize, usize, usize)>,
        /// (block, layer, device block id, offset in the block's buffer).
        parts: Vec<(u32, &'a WorkerLayer, u32, usize)>,
    },
}

/// One save layer of a [`Fill::Uniform`] plan.
struct UniformLayer<'a> {
    layer: &'a WorkerLayer,
    /// Its device block ids, one per position of the shared hash list.
    block_ids: &'a [u32],
    /// The slot it fills.
    slot: usize,
    /// Where that slot starts in each block's buffer, and its length (bytes).
    offset: usize,
    len: usize,
}

/// `items` of `n` blocks regrouped block by block (stable; `block` says whose an item is,
/// `map` what is kept of it), and where each block's entries start (`starts[b]..starts[b +
/// 1]`). A counting sort: two passes, no per-block allocation.
fn group_by_block<T, U: Copy>(
    n: usize,
    items: &[T],
    block: impl Fn(&T) -> u32,
    map: impl Fn(&T) -> U,
) -> (Vec<U>, Vec<u32>) {
    let mut starts = vec![0u32; n + 1];
    for it in items {
        starts[block(it) as usize + 1] += 1;
    }
    for b in 0..n {
        starts[b + 1] += starts[b];
    }
    let mut fill = starts.clone();
    // Every entry is overwritten below; the first item's value only fills the vector.
    let mut out = match items.first() {
        Some(first) => vec![map(first); items.len()],
        None => Vec::new(),
    };
    for it in items {
        let at = &mut fill[block(it) as usize];
        out[*at as usize] = map(it);
        *at += 1;
    }
    (out, starts)
}

/// The slot records of each of `n` blocks: `slots` ((block, slot, offset, length), in plan
/// order) as (slot, offset, length), block by block ([`group_by_block`]).
fn slots_by_block(
    n: usize,
    slots: &[(u32, usize, usize, usize)],
) -> (Vec<(usize, usize, usize)>, Vec<u32>) {
    group_by_block(n, slots, |s| s.0, |&(_, slot, off, len)| (slot, off, len))
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
            push_merged(
                ops,
                CopyOp {
                    device_addr: dev,
                    host_addr: piece.addr,
                    len: piece.len,
                },
            );
            dev += piece.len as u64;
        }
        buf_off += r.len as usize;
    }
}

/// Appends `op` to `ops`, extending the last op instead when `op` continues it on both sides.
pub(super) fn push_merged(ops: &mut Vec<CopyOp>, op: CopyOp) {
    match ops.last_mut() {
        Some(l)
            if l.device_addr + l.len as u64 == op.device_addr
                && l.host_addr + l.len == op.host_addr =>
        {
            l.len += op.len
        }
        _ => ops.push(op),
    }
}

/// A save layer resolved against the worker: its registration, its slot and its offset in
/// the slot.
type ResolvedLayer<'a> = (&'a WorkerLayer, usize, usize);

/// A listed Save's distinct (group, hash list) pairs, for [`AckedSave`]: one clone per
/// distinct list.
fn acked_lists(saves: &[&SaveLayer], layers: &[ResolvedLayer<'_>]) -> Vec<(u32, HashList)> {
    let mut out: Vec<(u32, HashList)> = Vec::new();
    for (s, (layer, _, _)) in saves.iter().zip(layers) {
        if !out.iter().any(|(g, h)| *g == layer.group && *h == s.hashes) {
            out.push((layer.group, s.hashes.clone()));
        }
    }
    out
}

/// Ends an [`AckedSave`]'s window when dropped: after the Save queued its seal, or failed.
struct LeaveOnDrop(Arc<AckedSaves>, Arc<AckedSave>);

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        self.0.leave(&self.1);
    }
}

/// The layers of a [`Fill::Uniform`] Save, each slot after the previous one in the block's
/// buffer; `None` when the Save is not one (page-first, a second group, another hash list, a
/// slot filled twice, or block ids that do not pair with the hashes).
fn uniform_layers<'a>(
    topo: &Topology,
    saves: &[&'a SaveLayer],
    layers: &[ResolvedLayer<'a>],
) -> Option<Vec<UniformLayer<'a>>> {
    let (first, &(first_layer, _, _)) = (*saves.first()?, layers.first()?);
    if topo.page_first {
        return None;
    }
    let mut filled: Vec<bool> = Vec::new();
    let mut offset = 0;
    let mut out = Vec::with_capacity(layers.len());
    for (&s, &(layer, slot, _)) in saves.iter().zip(layers) {
        let same_list = std::ptr::eq(s, first) || s.hashes == first.hashes;
        if layer.group != first_layer.group || !same_list || s.block_ids.len() != s.hashes.len() {
            return None;
        }
        if slot >= filled.len() {
            filled.resize(slot + 1, false);
        }
        if std::mem::replace(&mut filled[slot], true) {
            return None;
        }
        let len = layer.layout.block_bytes() as usize;
        out.push(UniformLayer {
            layer,
            block_ids: &s.block_ids,
            slot,
            offset,
            len,
        });
        offset += len;
    }
    Some(out)
}

impl Engine {
    /// Save (see the module doc): validate → resolve the worker → check the layers → plan →
    /// allocate → copy → seal. INVALID_ARGUMENT / FAILED_PRECONDITION before any allocation
    /// or copy.
    pub async fn save(&self, cmd: SaveCommand) -> EngineResult<()> {
        let mut clock = PhaseClock::start();
        tracing::debug!(layers = cmd.layers.len(), "save started");
        let phases = &self.metrics.rpc_phases;
        let inst = self.instance(&cmd.instance_id)?;
        // The non-empty layers, and their indices in the request.
        let live: Vec<u32> = (0..cmd.layers.len() as u32)
            .filter(|&i| !cmd.layers[i as usize].block_ids.is_empty())
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        let saves: Vec<&SaveLayer> = live.iter().map(|&i| &cmd.layers[i as usize]).collect();
        let _flush = self.flush_barrier.read().await;
        // A place in the seal queue before anything is allocated (waits while it is full).
        let place = self
            .sealer
            .reserve(saves.iter().map(|s| s.hashes.len()).sum())
            .await;
        let wl = resolve_saver(&inst, &cmd)?;
        let layers = check_save_layers(&wl, &cmd, &saves)?;
        clock.lap(phases.save(SavePhase::Validate));
        let plan = self.plan_save(&inst.namespace, &wl.topology, &saves, &layers)?;
        clock.lap(phases.save(SavePhase::Plan));
        if plan.blocks.is_empty() {
            return Ok(());
        }
        let bufs = self.allocate_save(&plan.blocks).await?;
        clock.lap(phases.save(SavePhase::Allocate));
        // The seal's inputs that need no copy, taken before it.
        let blocks: Vec<(u32, u32, u32)> = plan
            .blocks
            .iter()
            .map(|p| (p.group, live[p.at.0 as usize], p.at.1))
            .collect();
        let totals: Vec<usize> = wl.topology.groups.iter().map(|g| g.total_slots).collect();
        // Answered before its copy ends (the RPC layer listens for the transport's
        // SourceRead): noted as acknowledged first, so that a query waits for its blocks.
        let acked = SourceRead::current().map(|then| {
            // A uniform Save's layers share one list of one group: no comparison needed.
            let lists = match &plan.fill {
                Fill::Uniform(u) => u
                    .first()
                    .map(|l| vec![(l.layer.group, saves[0].hashes.clone())])
                    .unwrap_or_default(),
                Fill::Listed { .. } => acked_lists(&saves, &layers),
            };
            let save = Arc::new(AckedSave::new(inst.namespace.clone(), lists));
            let (all, entered) = (self.acked.clone(), save.clone());
            let read = SourceRead::chained(move || all.enter(entered), then);
            (save, read)
        });
        // The window ends when this guard drops: after the seal is queued below, or when the
        // Save fails or is dropped (a signal fired after that enters nothing).
        let (_left, read) = match acked {
            Some((save, read)) => (Some(LeaveOnDrop(self.acked.clone(), save)), Some(read)),
            None => (None, None),
        };
        let copy = self.copy_to_host(&wl, &plan, bufs);
        let bufs = match read {
            Some(read) => read.scope(copy).await?,
            None => copy.await?,
        };
        clock.lap(phases.save(SavePhase::Copy));
        let slots = match plan.fill {
            Fill::Uniform(layers) => {
                SealSlots::Same(layers.iter().map(|l| (l.slot, l.offset, l.len)).collect())
            }
            Fill::Listed { slots, .. } => SealSlots::Listed(slots),
        };
        drop(layers);
        drop(saves);
        let job = SealBatch {
            writer: inst.serial,
            ns: inst.namespace.clone(),
            totals,
            cmd,
            blocks,
            slots,
            bufs,
        };
        self.sealer.submit(Box::new(move |e: &Engine| {
            e.seal(job);
            drop(place);
        }));
        // The gate guard goes after the submission: once teardown holds the gate, every seal
        // of this worker's Saves is queued, and teardown waits for them before it drops the
        // instance's partly saved blocks. (The seal itself refers to the pool's buffers only.)
        drop(wl);
        clock.total(phases.save(SavePhase::Total));
        tracing::debug!(instance = %inst.id, "save done");
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
    ) -> EngineResult<SavePlan<'a>> {
        if let Some(uniform) = uniform_layers(topo, saves, layers) {
            return Ok(self.plan_uniform(ns, saves[0], uniform));
        }
        let mut plans = Vec::new();
        let mut slots = Vec::new();
        let mut parts = Vec::new();
        // Sized for the first layer's list (usually every layer's): no rehash while planning.
        let mut by_key: hashbrown::HashMap<(u32, &[u8]), u32> =
            hashbrown::HashMap::with_capacity(saves.first().map_or(0, |s| s.hashes.len()));
        // Layers usually carry the same hash list: reuse the previous layer's position → plan
        // mapping instead of looking every (layer, block) up again.
        // (group, hash list, plan index per position) of the previous layer.
        type Positions<'h> = (u32, &'h HashList, Vec<Option<u32>>);
        let mut prev: Option<Positions<'_>> = None;
        for (li, (s, &(layer, slot, page_off))) in saves.iter().zip(layers).enumerate() {
            let block_bytes = layer.layout.block_bytes() as usize;
            let reuse = prev
                .as_ref()
                .is_some_and(|(g, h, _)| *g == layer.group && **h == s.hashes);
            let positions: Vec<Option<u32>> = if reuse {
                prev.take().expect("checked").2
            } else {
                // One residency check per index shard for the whole list.
                let hashes: Vec<&[u8]> = s.hashes.iter().collect();
                let resident = self.store.contains_many(ns, layer.group, &hashes);
                hashes
                    .iter()
                    .zip(resident)
                    .enumerate()
                    .map(|(pos, (&hash, resident))| {
                        let key = (layer.group, hash);
                        if let Some(&i) = by_key.get(&key) {
                            return Some(i);
                        }
                        if resident {
                            return None;
                        }
                        let i = plans.len() as u32;
                        plans.push(BlockPlan {
                            group: layer.group,
                            at: (li as u32, pos as u32),
                            len: 0,
                            last_slot: None,
                            last_layer: None,
                        });
                        by_key.insert(key, i);
                        Some(i)
                    })
                    .collect()
            };
            if parts.capacity() == 0 {
                parts.reserve(plans.len() * saves.len());
                slots.reserve(plans.len() * saves.len());
            }
            for (&bid, idx) in s.block_ids.iter().zip(&positions) {
                let Some(idx) = *idx else { continue };
                let p = &mut plans[idx as usize];
                if topo.page_first {
                    if p.len == 0 {
                        let Some(page) = topo.slot_bytes(layer.group, slot) else {
                            return Err(EngineError::internal(format!(
                                "no page {slot} in the sealed topology"
                            )));
                        };
                        slots.push((idx, slot, 0, page));
                        p.len = page;
                    }
                    // Parts of one layer are pushed together: a repeat is the same hash twice.
                    if p.last_layer.is_some_and(|l| std::ptr::eq(l, layer)) {
                        continue;
                    }
                    parts.push((idx, layer, bid, page_off));
                    p.last_layer = Some(layer);
                } else {
                    // Each layer has its own slot and pushes its parts together, so a repeat of
                    // this layer's slot is the same hash twice in one layer: first wins.
                    if p.last_slot == Some(slot) {
                        continue;
                    }
                    slots.push((idx, slot, p.len, block_bytes));
                    parts.push((idx, layer, bid, p.len));
                    p.len += block_bytes;
                    p.last_slot = Some(slot);
                }
            }
            prev = Some((layer.group, &s.hashes, positions));
        }
        Ok(SavePlan {
            blocks: plans,
            fill: Fill::Listed { slots, parts },
        })
    }

    /// [`Engine::plan_save`] for a [`Fill::Uniform`] Save: one block per hash of the shared
    /// list not yet resident, the first of repeated hashes (whose block ids the layers then
    /// use), in request order. Per block it records only its position.
    fn plan_uniform<'a>(
        &self,
        ns: &Arc<str>,
        first: &SaveLayer,
        layers: Vec<UniformLayer<'a>>,
    ) -> SavePlan<'a> {
        let group = layers[0].layer.group;
        let len: usize = layers.iter().map(|l| l.len).sum();
        let hashes: Vec<&[u8]> = first.hashes.iter().collect();
        let resident = self.store.contains_many(ns, group, &hashes);
        let mut seen: hashbrown::HashSet<&[u8]> = hashbrown::HashSet::with_capacity(hashes.len());
        let blocks = hashes
            .iter()
            .zip(resident)
            .enumerate()
            .filter(|&(_, (&hash, resident))| !resident && seen.insert(hash))
            .map(|(pos, _)| BlockPlan {
                group,
                at: (0, pos as u32),
                len,
                last_slot: None,
                last_layer: None,
            })
            .collect();
        SavePlan {
            blocks,
            fill: Fill::Uniform(layers),
        }
    }

    /// Host buffers for the plans, all or nothing (the store evicts under pressure). Blocks
    /// still waiting for their seal cannot be evicted yet: while seals are pending, or ran
    /// since the attempt, a refused allocation waits for them and tries again (8 rounds).
    async fn allocate_save(&self, plans: &[BlockPlan<'_>]) -> EngineResult<Vec<Arc<HostBuffer>>> {
        let lens: Vec<usize> = plans.iter().map(|p| p.len).collect();
        let mut rounds = 0;
        loop {
            let seen = self.sealer.done();
            match self.store.allocate(&lens) {
                Ok(b) => return Ok(b.into_iter().map(Arc::new).collect()),
                Err(EngineError::ResourceExhausted(_))
                    if rounds < 8 && (self.sealer.pending() || self.sealer.done() != seen) =>
                {
                    rounds += 1;
                    self.sealer.settle().await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One batched device → host copy of every planned part, with its metrics. Returns the
    /// buffers (held by the copy while it runs).
    ///
    /// The ops go to the transport block by block, in parts ([`super::copy`]): the blocks'
    /// buffers lie in ascending host order, so the ops do too, and the first bytes move while
    /// the rest are built.
    async fn copy_to_host(
        &self,
        wl: &WorkerLease,
        plan: &SavePlan<'_>,
        bufs: Vec<Arc<HostBuffer>>,
    ) -> EngineResult<Vec<Arc<HostBuffer>>> {
        let batch = CopyBatch {
            location: wl.worker.location,
            direction: Direction::ToHost,
            mode: wl.instance.transfer_mode,
            ops: Vec::new(),
        };
        let t0 = Instant::now();
        let transport = wl.worker.transport.clone();
        // The copy holds the buffers (one reference for the whole list) until it ends.
        let bufs = Arc::new(bufs);
        let keep = (bufs.clone(), wl.worker.clone());
        tracing::debug!(blocks = plan.blocks.len(), "save copy starting");
        let (mut feed, copy) = super::copy::start_copy(transport, batch, keep).await;
        match &plan.fill {
            Fill::Uniform(layers) => {
                let bytes: u64 = layers.iter().map(|l| l.len as u64).sum();
                for (p, buf) in plan.blocks.iter().zip(bufs.iter()) {
                    let pos = p.at.1 as usize;
                    for l in layers {
                        push_ops(feed.ops(), l.layer, l.block_ids[pos] as u64, buf, l.offset);
                    }
                    feed.block_done(bytes);
                }
            }
            Fill::Listed { parts, .. } => {
                // Each block's device parts, in layer order (the plan lists them layer by
                // layer).
                let (parts, starts) = group_by_block(
                    plan.blocks.len(),
                    parts,
                    |p| p.0,
                    |&(_, layer, bid, off)| (layer, bid, off),
                );
                for (b, buf) in bufs.iter().enumerate() {
                    let mut bytes = 0;
                    for &(layer, bid, off) in &parts[starts[b] as usize..starts[b + 1] as usize] {
                        push_ops(feed.ops(), layer, bid as u64, buf, off);
                        bytes += layer.layout.block_bytes();
                    }
                    feed.block_done(bytes);
                }
            }
        }
        let bytes = feed.finish();
        let r = copy.wait().await;
        if let Err(e) = r {
            self.metrics
                .transfer_failures
                .with_label_values(&["d2h"])
                .inc();
            return Err(e);
        }
        tracing::debug!(
            instance = %wl.instance.id,
            blocks = plan.blocks.len(),
            bytes,
            copy_us = t0.elapsed().as_micros() as u64,
            "save copied"
        );
        self.metrics.save_bytes.inc_by(bytes);
        self.metrics
            .save_duration
            .observe(t0.elapsed().as_secs_f64());
        // The copy task dropped its reference before it completed.
        Ok(Arc::try_unwrap(bufs).unwrap_or_else(|shared| shared.as_ref().clone()))
    }

    /// Adds the copied slots to their partly saved blocks (`writer`: the saving instance's
    /// serial) and seals every block that has all its slots. A block whose slots all came
    /// in this save, with no partly saved entry of its key, is sealed directly (no entry).
    /// The sealed blocks are indexed together, in request order. Runs on the seal thread.
    fn seal(&self, job: SealBatch) {
        // The blocks' seal time, and the start of the phase's clock.
        let now = Instant::now();
        let SealBatch {
            writer,
            ref ns,
            totals,
            cmd,
            blocks,
            slots,
            bufs,
        } = job;
        let (slot_recs, starts) = match &slots {
            SealSlots::Listed(s) => slots_by_block(blocks.len(), s),
            SealSlots::Same(_) => (Vec::new(), Vec::new()),
        };
        let mut sealed: Vec<(u32, &[u8], Arc<SealedBlock>)> = Vec::with_capacity(blocks.len());
        let mut inflight = self.inflight.lock();
        let mut inflight_changed = false;
        for ((bi, &(group, li, pos)), buf) in blocks.iter().enumerate().zip(bufs) {
            let recs = match &slots {
                SealSlots::Same(recs) => &recs[..],
                SealSlots::Listed(_) => &slot_recs[starts[bi] as usize..starts[bi + 1] as usize],
            };
            let total = totals[group as usize];
            let hash: &[u8] = &cmd.layers[li as usize].hashes[pos as usize];
            let fp = self.store.pool().footprint_bytes(buf.len());
            // Every slot, once each, in slot order (layers are planned in id order, so a
            // complete block's records usually are).
            if recs.len() == total && recs.iter().enumerate().all(|(i, r)| r.0 == i) {
                let partial = !inflight.is_empty()
                    && inflight.contains_key(&BlockKey {
                        namespace: ns.clone(),
                        group,
                        hash: hash.into(),
                    });
                if !partial {
                    let block = Arc::new(SealedBlock {
                        group,
                        slots: recs
                            .iter()
                            .map(|&(_, off, len)| Slot {
                                buf: buf.clone(),
                                offset: off,
                                len,
                            })
                            .collect(),
                        footprint: fp,
                        sealed_at: now,
                    });
                    sealed.push((group, hash, block));
                    continue;
                }
            }
            if self.store.contains(KeyRef {
                namespace: ns,
                group,
                hash,
            }) {
                continue; // sealed by a concurrent save meanwhile
            }
            let key = BlockKey {
                namespace: ns.clone(),
                group,
                hash: hash.into(),
            };
            inflight_changed = true;
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
            for &(slot, off, len) in recs {
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
                    group,
                    slots: e.slots.into_iter().map(|s| s.expect("filled")).collect(),
                    footprint: e.footprint,
                    sealed_at: now,
                });
                sealed.push((group, hash, block));
            }
        }
        // Indexed while the in-flight map is still locked, as a per-block insert would be.
        self.store.insert_sealed_many(ns, sealed);
        if inflight_changed {
            let bytes: u64 = inflight.values().map(|e| e.footprint).sum();
            self.metrics.inflight_bytes.set(bytes as i64);
        }
        drop(inflight);
        self.update_gauges();
        self.metrics
            .rpc_phases
            .save(SavePhase::Seal)
            .observe(now.elapsed().as_secs_f64());
    }
}

/// A Save's copied blocks, for the seal thread: owned, since the Save has answered by the
/// time they are sealed.
struct SealBatch {
    /// The saving instance's serial.
    writer: u64,
    ns: Arc<str>,
    /// Slots per block, per group of the instance's topology.
    totals: Vec<usize>,
    /// The request: it owns the hashes (one buffer per layer; its drop leaves the Save's path
    /// too).
    cmd: SaveCommand,
    /// Per planned block: (group, layer index in `cmd`, position in that layer's lists).
    blocks: Vec<(u32, u32, u32)>,
    /// The plan's slot records.
    slots: SealSlots,
    /// The blocks' host buffers, copied.
    bufs: Vec<Arc<HostBuffer>>,
}

/// A Save's slot records, for its seal.
enum SealSlots {
    /// Every block's: (slot, offset in the block's buffer, length), in order
    /// ([`Fill::Uniform`]).
    Same(Vec<(usize, usize, usize)>),
    /// Per block: (block, slot, offset in the block's buffer, length), in plan order.
    Listed(Vec<(u32, usize, usize, usize)>),
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
