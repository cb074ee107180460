//! Load, orchestrated: attach the completion word → validate (worker, ranks, completion mode)
//! → resolve the load groups to layers → check every lease → consume the leases → plan and
//! run one batched host → device copy → complete. Completion goes to the client's load-state
//! word (1, or −1 on any failure) or, with `wait_for_completion`, is the RPC's own return.
//!
//! Owns those steps. Must never: consume a lease before every lease, count, layer and slot
//! shape of the request has been checked (a refused load changes nothing but the −1 it
//! reports), address a destination block outside the layer's layout, report success for
//! a copy that did not finish, or map the client's load-state object (the client can shrink
//! it under us; the word is written with `pwrite` through [`LoadStateWriter`], which cannot
//! fault, and a word that cannot be written counts the load as failed).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use pegaflow_api::load_state::{LoadStateWriter, LOAD_FAILED, LOAD_SUCCESS};
use pegaflow_api::LEASE_BYTES;

use super::command::{LeaseLoad, LoadCommand, LoadCompletion};
use super::instance::{Topology, WorkerLayer, WorkerLease};
use super::Engine;
use crate::block::SealedBlock;
use crate::error::{EngineError, EngineResult};
use crate::metrics::{LoadPhase, Metrics, PhaseClock};
use crate::plugin::{CopyBatch, CopyOp, Direction};

/// A validated load, leases consumed: the blocks to copy (one list per lease of the
/// command, in its order) and the worker they go to.
struct Prepared {
    wl: WorkerLease,
    blocks: Vec<Arc<[Arc<SealedBlock>]>>,
}

/// One layer of a load group: (name, registration, slot, offset in the slot).
type GroupLayer<'a> = (&'a str, &'a WorkerLayer, usize, usize);

/// One load group resolved: its layers and the storage group they all belong to.
struct LoadGroup<'a> {
    layers: Vec<GroupLayer<'a>>,
    storage: u32,
}

/// Builds the ops of every targeted block, block by block, and hands them to the transport
/// in parts while the copy runs ([`super::copy`]). Returns the bytes copied.
async fn run_load_copy(p: Arc<Prepared>, cmd: &LoadCommand) -> EngineResult<u64> {
    // Checked before the leases were consumed; resolved again here (the load's task owns
    // the command now).
    let groups = resolve_groups(&p.wl, cmd)?;
    let batch = CopyBatch {
        location: p.wl.worker.location,
        direction: Direction::ToDevice,
        mode: p.wl.instance.transfer_mode,
        ops: Vec::new(),
    };
    let transport = p.wl.worker.transport.clone();
    // The copy keeps the blocks and the worker's gate guard until it ends.
    let keep = p.clone();
    let (mut feed, copy) = super::copy::start_copy(transport, batch, keep).await;
    for (ll, blocks) in cmd.leases.iter().zip(&p.blocks) {
        for (g, targets) in groups.iter().zip(&ll.targets_by_group) {
            // Per layer, once: its device base address; and the bytes of one block over the
            // group's layers.
            let layers: Vec<(&WorkerLayer, u64, usize, usize)> = g
                .layers
                .iter()
                .map(|&(_, l, slot, off)| (l, l.addr(0), slot, off))
                .collect();
            let per_block: u64 = layers.iter().map(|(l, ..)| l.layout.block_bytes()).sum();
            for (b, t) in blocks.iter().zip(targets.iter()) {
                let Some(dst) = *t else {
                    continue;
                };
                for &(l, base, slot, off) in &layers {
                    push_load_ops(feed.ops(), l, base, u64::from(dst), &b.slots[slot], off);
                }
                feed.block_done(per_block);
            }
        }
    }
    let bytes = feed.finish();
    copy.wait().await.map(|()| bytes)
}

/// Appends ops copying `layer`'s block bytes of `slot` at `slot_off` into `layer`'s block
/// `dst` (`dst` checked against the layout, `slot_off + block bytes` inside the slot).
///
/// A slot in one host extent (the common case: a block's save allocates one buffer) is
/// addressed directly; fragmented buffers go through the general piece walk. `base` is
/// `layer.addr(0)`, looked up once per load.
fn push_load_ops(
    ops: &mut Vec<CopyOp>,
    layer: &WorkerLayer,
    base: u64,
    dst: u64,
    slot: &super::Slot,
    slot_off: usize,
) {
    let off = slot.offset + slot_off;
    let [extent] = slot.buf.extents() else {
        return super::save::push_ops(ops, layer, dst, &slot.buf, off);
    };
    let len = layer.layout.block_bytes() as usize;
    assert!(
        off.checked_add(len).is_some_and(|e| e <= extent.len),
        "range {off}+{len} outside a {} byte buffer",
        extent.len
    );
    let mut host = extent.addr + off;
    let ranges = layer
        .layout
        .ranges(dst)
        .expect("block id validated against the layout");
    for r in ranges {
        let op = CopyOp {
            device_addr: base + r.offset,
            host_addr: host,
            len: r.len as usize,
        };
        host += op.len;
        super::save::push_merged(ops, op);
    }
}

impl Engine {
    /// Load (see the module doc). Validation failures are returned as errors and written as −1
    /// to the load state; nothing is copied.
    pub async fn load(&self, cmd: LoadCommand) -> EngineResult<()> {
        let mut clock = PhaseClock::start();
        let state = attach_state(&cmd.completion).inspect_err(|_| {
            self.metrics.load_failures.inc();
        })?;
        let prepared = match self.prepare_load(&cmd, &mut clock) {
            Ok(p) => p,
            Err(e) => {
                // The refusal is what the RPC reports; a word that cannot be written is logged.
                let _ = complete(state.as_ref(), LOAD_FAILED);
                self.metrics.load_failures.inc();
                return Err(e);
            }
        };
        let Some(p) = prepared else {
            return complete(state.as_ref(), LOAD_SUCCESS).inspect_err(|_| {
                self.metrics.load_failures.inc();
            });
        };
        let wait = cmd.completion == LoadCompletion::Wait;
        let task = copy_to_device(self.metrics.clone(), p, cmd, state, clock);
        if wait {
            task.await
        } else {
            tokio::spawn(task);
            Ok(())
        }
    }

    /// Every check, then the leases consumed. `None`: nothing to load.
    fn prepare_load(
        &self,
        cmd: &LoadCommand,
        clock: &mut PhaseClock,
    ) -> EngineResult<Option<Prepared>> {
        let wl = self.resolve_loader(cmd)?;
        if cmd.leases.is_empty() {
            return Ok(None);
        }
        if cmd.groups.is_empty() {
            return Err(EngineError::invalid(
                "a load needs at least one layer group",
            ));
        }
        let groups = resolve_groups(&wl, cmd)?;
        let leases = self.check_leases(&wl, cmd, &groups)?;
        let phases = &self.metrics.rpc_phases;
        clock.lap(phases.load(LoadPhase::Validate));
        let mut blocks = Vec::with_capacity(leases.len());
        for (id, _) in leases {
            blocks.push(self.leases.consume(&id, &wl.instance.id)?);
        }
        self.metrics.leases_active.set(self.leases.len() as i64);
        clock.lap(phases.load(LoadPhase::Plan));
        Ok(Some(Prepared { wl, blocks }))
    }

    /// Enters the instance's gate and resolves the loading worker: its TP rank as the client
    /// names it, and a completion mode its registration supports.
    fn resolve_loader(&self, cmd: &LoadCommand) -> EngineResult<WorkerLease> {
        if cmd.device_id < 0 {
            return Err(EngineError::invalid(format!(
                "device_id must be >= 0, got {}",
                cmd.device_id
            )));
        }
        let inst = self.instance(&cmd.instance_id)?;
        let wl = inst.enter(cmd.device_id)?;
        let w = &wl.worker;
        if w.tp_rank != cmd.tp_rank {
            return Err(EngineError::invalid(format!(
                "device_id {} of instance {} is registered as tp_rank {}, got {}",
                cmd.device_id, inst.id, w.tp_rank, cmd.tp_rank
            )));
        }
        if w.traits.completion_by_rpc_only && cmd.completion != LoadCompletion::Wait {
            return Err(EngineError::invalid(
                "loads into this registration complete only by the RPC's return: set wait_for_completion",
            ));
        }
        Ok(wl)
    }

    /// Checks every lease before any is consumed: known, of this instance, once in the load,
    /// with targets for every group and block, each target in range and each stored slot of
    /// the shape this instance's layout expects.
    fn check_leases<'c>(
        &self,
        wl: &WorkerLease,
        cmd: &'c LoadCommand,
        groups: &[LoadGroup<'_>],
    ) -> EngineResult<Vec<([u8; LEASE_BYTES], &'c LeaseLoad)>> {
        let inst = &wl.instance;
        let mut leases = Vec::with_capacity(cmd.leases.len());
        let mut seen_leases = HashSet::new();
        for ll in &cmd.leases {
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
            if wl.worker.whole_blocks && ll.targets_by_group.windows(2).any(|w| w[0] != w[1]) {
                // Native v2 arenas share one block id: groups sending a block's arenas to
                // different destinations (or skipping some) would restore a page without its
                // sidecar.
                return Err(EngineError::invalid(
                    "a native v2 load must send every arena of a block to the same destination: the load groups' targets differ",
                ));
            }
            for (g, targets) in groups.iter().zip(&ll.targets_by_group) {
                check_group_targets(&wl.topology, &inst.namespace, g, &blocks, targets)?;
            }
            leases.push((id, ll));
        }
        Ok(leases)
    }
}

/// The client's load-state word, when the load reports through one. Attached by descriptor,
/// never mapped: the client can truncate the object at any time (see [`LoadStateWriter`]).
///
/// # Errors
/// The client's object is the client's business ([`load_state_error`]): one that does not
/// exist (or this server may not open) is FAILED_PRECONDITION, one that is not a load-state
/// object INVALID_ARGUMENT; only the server's own failures (out of descriptors) are INTERNAL.
fn attach_state(completion: &LoadCompletion) -> EngineResult<Option<LoadStateWriter>> {
    match completion {
        LoadCompletion::Wait => Ok(None),
        LoadCompletion::StateWord(name) => LoadStateWriter::attach(name)
            .map(Some)
            .map_err(|e| load_state_error(name, "attach", e)),
    }
}

/// A load-state object's failure as the engine answers it: the client named an object that
/// does not exist or that this server's user may not open (`shm_open` ENOENT, EACCES, EPERM:
/// FAILED_PRECONDITION: create it first, as the published client's `PyLoadState` does, with
/// the server's user); named one that is no load-state object or shrank under the server
/// (INVALID_ARGUMENT); anything else is the server's (INTERNAL: out of descriptors, `/dev/shm`
/// full).
fn load_state_error(name: &str, what: &str, e: pegaflow_api::ApiError) -> EngineError {
    use pegaflow_api::ApiError;
    use std::io::ErrorKind;
    let name = crate::error::echo(name);
    match e {
        ApiError::InvalidArgument(m) => EngineError::invalid(m),
        ApiError::Io { source, .. } if source.kind() == ErrorKind::NotFound => {
            EngineError::precondition(format!(
                "load state {name:?} (load_state_shm) does not exist: create the load-state object before the Load (or set wait_for_completion)"
            ))
        }
        ApiError::Io { source, .. } if source.kind() == ErrorKind::PermissionDenied => {
            EngineError::precondition(format!(
                "load state {name:?} (load_state_shm) cannot be opened by this server ({source}): create it readable and writable by the server's user"
            ))
        }
        other => EngineError::internal(format!("cannot {what} load state {name:?}: {other}")),
    }
}

/// Writes the final `value` to the load-state word, if there is one. A word that cannot be
/// written (the client shrank the object under us, `/dev/shm` is full) is an error, logged
/// here: the client will never learn the outcome, so the caller counts the load as failed.
fn complete(state: Option<&LoadStateWriter>, value: i64) -> EngineResult<()> {
    let Some(s) = state else {
        return Ok(());
    };
    s.complete(value).map_err(|e| {
        tracing::warn!(load_state = s.name(), value, error = %e, "cannot write the load state");
        load_state_error(s.name(), "write", e)
    })
}

/// Resolves the load groups to layers (each layer in one group only, registered on the
/// worker, part of the sealed topology with its geometry) and one storage group each.
fn resolve_groups<'a>(
    wl: &'a WorkerLease,
    cmd: &'a LoadCommand,
) -> EngineResult<Vec<LoadGroup<'a>>> {
    let w = &wl.worker;
    let topo = &wl.topology;
    let inst = &wl.instance;
    let mut seen = HashSet::new();
    let mut groups = Vec::with_capacity(cmd.groups.len());
    for (gi, g) in cmd.groups.iter().enumerate() {
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
                    cmd.device_id, inst.id
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
                    cmd.device_id
                )));
            }
            layers.push((name.as_str(), l, slot, off));
        }
        groups.push(LoadGroup {
            layers,
            storage: storage.unwrap_or(0),
        });
    }
    if w.whole_blocks && seen.len() != w.layers.len() {
        // Native v2 arenas share one block id: restoring some without the others would be
        // silent corruption.
        return Err(EngineError::invalid(format!(
            "a native v2 load must name all {} layers of the registration, got {}",
            w.layers.len(),
            seen.len()
        )));
    }
    Ok(groups)
}

/// Checks one load group's targets for one lease's blocks: one target per block, blocks of
/// the group's storage group, destinations in range, stored slots of the expected size.
fn check_group_targets(
    topo: &Topology,
    namespace: &str,
    g: &LoadGroup<'_>,
    blocks: &[Arc<SealedBlock>],
    targets: &[Option<u32>],
) -> EngineResult<()> {
    if g.layers.is_empty() {
        return Ok(());
    }
    if targets.len() != blocks.len() {
        return Err(EngineError::invalid(format!(
            "query lease block count {} does not match destination block count {}",
            blocks.len(),
            targets.len()
        )));
    }
    let storage = g.storage;
    // Per layer, once: its slot, the slot length this instance's layout stores for the group
    // (`None`: the topology has no such slot) and its block count; the smallest block count
    // bounds every destination.
    let per_layer: Vec<(&str, usize, Option<usize>, u64)> = g
        .layers
        .iter()
        .map(|&(name, l, slot, _)| {
            (
                name,
                slot,
                topo.slot_bytes(storage, slot),
                l.layout.num_blocks(),
            )
        })
        .collect();
    let min_blocks = per_layer.iter().map(|p| p.3).min().unwrap_or(0);
    for (b, t) in blocks.iter().zip(targets) {
        let Some(dst) = *t else {
            continue;
        };
        if b.group != storage {
            return Err(EngineError::invalid(format!(
                "a block of storage group {} cannot be loaded into layers of group {storage}",
                b.group
            )));
        }
        if u64::from(dst) >= min_blocks {
            let (name, _, _, n) = per_layer
                .iter()
                .find(|p| u64::from(dst) >= p.3)
                .expect("some layer has the smallest block count");
            return Err(EngineError::invalid(format!(
                "destination block id {dst} out of range for layer {name} ({n} blocks)"
            )));
        }
        for &(name, slot, want, _) in &per_layer {
            let ok = b
                .slots
                .get(slot)
                .zip(want)
                .is_some_and(|(s, want)| s.len == want);
            if !ok {
                return Err(EngineError::invalid(format!(
                    "stored block does not match this instance's layout for layer {name} (namespace {namespace} shared by incompatible layouts?)"
                )));
            }
        }
    }
    Ok(())
}

/// The copy of a prepared load, to completion, with its metrics and its completion word.
async fn copy_to_device(
    metrics: Arc<Metrics>,
    p: Prepared,
    cmd: LoadCommand,
    state: Option<LoadStateWriter>,
    mut clock: PhaseClock,
) -> EngineResult<()> {
    let t0 = Instant::now();
    let r = run_load_copy(Arc::new(p), &cmd).await;
    let bytes = *r.as_ref().unwrap_or(&0);
    let r = r.map(drop);
    let phases = &metrics.rpc_phases;
    clock.lap(phases.load(LoadPhase::Copy));
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
    let value = if r.is_ok() { LOAD_SUCCESS } else { LOAD_FAILED };
    let done = complete(state.as_ref(), value);
    clock.lap(phases.load(LoadPhase::Complete));
    clock.total(phases.load(LoadPhase::Total));
    // A copy that landed but whose success the client cannot learn counts as a failed load
    // (the client times out and recomputes); a failed copy was counted above.
    if r.is_ok() && done.is_err() {
        metrics.load_failures.inc();
    }
    r.and(done)
}
