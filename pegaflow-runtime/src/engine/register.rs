//! RegisterContextBatch: validation, the worker's memory import, and topology sealing.

use std::collections::HashSet;
use std::sync::Arc;

use pegaflow_api::{is_side_channel_safe_id, KvLayout, TransferMode};
use pegaflow_proto as pb;

use super::instance::{Instance, InstanceState, Topology, Worker, WorkerLayer};
use super::Engine;
use crate::error::{EngineError, EngineResult};
use crate::plugin::{
    ImportRequest, NativeView, PayloadCarrier, Registrar, RegistrarError, RegistrationPayload,
};

/// The published client's version this server speaks.
pub const SERVER_VERSION: &str = pb::PUBLISHED_CLIENT_VERSION;

/// Whether `v` is a client version this server accepts: the published 0.25.x client, or this
/// project's native client of the same wire revision.
pub fn accepts_client_version(v: &str) -> bool {
    if v == pb::NATIVE_CLIENT_VERSION {
        return true;
    }
    match v.strip_prefix("0.25.") {
        Some(patch) => !patch.is_empty() && patch.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// A validated registration.
struct Spec {
    payload: RegistrationPayload,
    block_strides: Option<Vec<u64>>,
    groups: Vec<u32>,
    transfer_mode: TransferMode,
}

fn validate(req: &pb::RegisterContextRequest) -> EngineResult<Spec> {
    if !accepts_client_version(&req.client_version) {
        let client = if req.client_version.is_empty() {
            "<missing>"
        } else {
            &req.client_version
        };
        return Err(EngineError::precondition(format!(
            "PegaFlow version mismatch: client={client} server={SERVER_VERSION} (this server accepts 0.25.x and {})",
            pb::NATIVE_CLIENT_VERSION
        )));
    }
    if req.instance_id.is_empty() {
        return Err(EngineError::invalid("instance_id must not be empty"));
    }
    if req.device_id < 0 {
        return Err(EngineError::invalid(format!(
            "device_id must be >= 0, got {}",
            req.device_id
        )));
    }
    if req.tp_size == 0 {
        return Err(EngineError::invalid("tp_size must be > 0"));
    }
    if req.world_size == 0 {
        return Err(EngineError::invalid("world_size must be > 0"));
    }
    if req.tp_rank >= req.tp_size {
        return Err(EngineError::invalid(format!(
            "tp_rank {} must be < tp_size {}",
            req.tp_rank, req.tp_size
        )));
    }
    let transfer_mode = TransferMode::from_wire(req.transfer_mode).ok_or_else(|| {
        EngineError::invalid(format!("unknown transfer_mode {}", req.transfer_mode))
    })?;
    let n = req.layer_names.len();
    if n == 0 {
        return Err(EngineError::invalid(
            "at least one layer must be registered",
        ));
    }
    let lens = [
        ("num_blocks", req.num_blocks.len()),
        ("bytes_per_block", req.bytes_per_block.len()),
        ("kv_stride_bytes", req.kv_stride_bytes.len()),
        ("segments", req.segments.len()),
    ];
    for (name, len) in lens {
        if len != n {
            return Err(EngineError::invalid(format!(
                "{name} has {len} entries but layer_names has {n}"
            )));
        }
    }
    if !req.layer_group_ids.is_empty() && req.layer_group_ids.len() != n {
        return Err(EngineError::invalid(format!(
            "layer_group_ids has {} entries but layer_names has {n}",
            req.layer_group_ids.len()
        )));
    }
    let mut seen = HashSet::new();
    for name in &req.layer_names {
        if name.is_empty() {
            return Err(EngineError::invalid("layer names must not be empty"));
        }
        if !seen.insert(name.as_str()) {
            return Err(EngineError::invalid(format!("duplicate layer name {name}")));
        }
    }
    let native = req.memory_kind != 0 || !req.native_kv_tensors.is_empty();
    let (payload, block_strides) = if native {
        if req.client_version != pb::NATIVE_CLIENT_VERSION {
            return Err(EngineError::precondition(format!(
                "native registration fields need client_version {} (the native wire revision), got {}",
                pb::NATIVE_CLIENT_VERSION,
                req.client_version
            )));
        }
        if !req.wrapper_bytes.is_empty() {
            return Err(EngineError::invalid(
                "a registration carries either wrapper_bytes or native_kv_tensors, not both",
            ));
        }
        if req.memory_kind <= 0 {
            return Err(EngineError::invalid(format!(
                "native registration needs a memory_kind (field 102) > 0, got {}",
                req.memory_kind
            )));
        }
        if req.native_kv_tensors.len() != n {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors has {} entries but layer_names has {n}",
                req.native_kv_tensors.len()
            )));
        }
        if !is_side_channel_safe_id(&req.instance_id) {
            return Err(EngineError::invalid(format!(
                "native instance_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
                req.instance_id
            )));
        }
        if req.native_alloc_size == 0 {
            return Err(EngineError::invalid("native_alloc_size must be > 0"));
        }
        let mut views = Vec::with_capacity(n);
        for (i, t) in req.native_kv_tensors.iter().enumerate() {
            if t.size_bytes == 0 || t.block_stride_bytes == 0 {
                return Err(EngineError::invalid(format!(
                    "native_kv_tensors[{i}] needs size_bytes > 0 and block_stride_bytes > 0"
                )));
            }
            if t.offset_bytes.checked_add(t.size_bytes).is_none() {
                return Err(EngineError::invalid(format!(
                    "native_kv_tensors[{i}] offset + size overflows"
                )));
            }
            views.push(NativeView {
                offset_bytes: t.offset_bytes,
                size_bytes: t.size_bytes,
                block_stride_bytes: t.block_stride_bytes,
            });
        }
        let strides = views.iter().map(|v| v.block_stride_bytes).collect();
        (
            RegistrationPayload::SideChannel {
                memory_kind: req.memory_kind,
                alloc_size: req.native_alloc_size,
                views,
            },
            Some(strides),
        )
    } else {
        if req.wrapper_bytes.len() != n {
            return Err(EngineError::invalid(format!(
                "wrapper_bytes has {} entries but layer_names has {n}",
                req.wrapper_bytes.len()
            )));
        }
        (
            RegistrationPayload::LayerBlobs(req.wrapper_bytes.clone()),
            None,
        )
    };
    let groups = if req.layer_group_ids.is_empty() {
        vec![0; n]
    } else {
        req.layer_group_ids.clone()
    };
    if req.page_first && groups.iter().any(|&g| g != 0) {
        return Err(EngineError::invalid(
            "page_first cannot be combined with more than one storage group",
        ));
    }
    Ok(Spec {
        payload,
        block_strides,
        groups,
        transfer_mode,
    })
}

/// An instance holds either per-layer-blob (Python client) or side-channel (native)
/// registrations, never both.
fn check_mix(i: &Instance, native: bool) -> EngineResult<()> {
    if i.native != native {
        return Err(EngineError::precondition(format!(
            "instance {} already has {} registrations; an instance cannot mix Python (per-layer blob) and native (side-channel) registrations",
            i.id,
            if i.native { "native" } else { "Python" }
        )));
    }
    Ok(())
}

impl Engine {
    /// Registers one worker's KV memory (RegisterContextBatch).
    ///
    /// Validates every field (INVALID_ARGUMENT / FAILED_PRECONDITION with nothing changed),
    /// imports the memory through the pipeline's registrar for the payload kind, bounds-checks
    /// every layer, and seals the topology when the last worker joins.
    pub async fn register(&self, req: pb::RegisterContextRequest) -> EngineResult<()> {
        let spec = match validate(&req) {
            Ok(s) => s,
            Err(e) => {
                self.discard_pending_fd(&req);
                return Err(e);
            }
        };
        let native = spec.payload.carrier() != PayloadCarrier::LayerBlobs;
        let mixed = self
            .instances
            .read()
            .get(req.instance_id.as_str())
            .map_or(Ok(()), |i| check_mix(i, native));
        if let Err(e) = mixed {
            self.discard_pending_fd(&req);
            return Err(e);
        }
        let registrar = match self.registrar_for(&req, &spec.payload) {
            Ok(r) => r,
            Err(e) => {
                self.discard_pending_fd(&req);
                return Err(e);
            }
        };
        // A refused reservation (e.g. the device is already registering) leaves the side
        // channel alone: the pending descriptor may belong to the registration in progress.
        let inst = self.reserve(&req, native, spec.transfer_mode)?;
        let result = self.register_worker(&inst, &req, spec, registrar).await;
        if let Err(e) = &result {
            self.discard_pending_fd(&req);
            // Map lock first, then the instance's state (the order `reserve` uses), so no
            // registration can reserve on this instance between the check and the removal.
            let mut map = self.instances.write();
            let mut st = inst.state.lock();
            st.importing.remove(&req.device_id);
            if st.workers.is_empty()
                && st.importing.is_empty()
                && map.get(&*inst.id).is_some_and(|i| Arc::ptr_eq(i, &inst))
            {
                map.remove(&*inst.id);
            }
            drop(st);
            drop(map);
            tracing::warn!(instance = %req.instance_id, device = req.device_id, error = %e, "registration rejected");
        }
        self.update_gauges();
        result
    }

    /// Closes a descriptor the client sent for this (failed) registration, so that it can
    /// resend under the same key at once instead of waiting for the pending TTL.
    fn discard_pending_fd(&self, req: &pb::RegisterContextRequest) {
        let native = req.memory_kind != 0 || !req.native_kv_tensors.is_empty();
        if let (true, Some(c)) = (native, &self.fd_channel) {
            if is_side_channel_safe_id(&req.instance_id)
                && c.discard(&req.instance_id, req.device_id)
            {
                tracing::info!(instance = %req.instance_id, device = req.device_id, "discarded the side-channel fd of a failed registration");
            }
        }
    }

    /// Gets or creates the instance and reserves the device id for this registration.
    fn reserve(
        &self,
        req: &pb::RegisterContextRequest,
        native: bool,
        transfer_mode: TransferMode,
    ) -> EngineResult<Arc<Instance>> {
        let mut map = self.instances.write();
        if self.closing.lock().contains(req.instance_id.as_str()) {
            return Err(EngineError::precondition(format!(
                "instance {} is still being torn down; register under a fresh instance id",
                req.instance_id
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
                        i.id, i.tp_size, i.world_size, i.page_first, req.tp_size, req.world_size, req.page_first
                    )));
                }
                if *i.namespace != req.namespace {
                    return Err(EngineError::precondition(format!(
                        "instance {} is registered in namespace {:?}, got {:?}",
                        i.id, i.namespace, req.namespace
                    )));
                }
                check_mix(i, native)?;
                i.clone()
            }
            None => {
                if map.len() >= self.config.max_instances {
                    return Err(EngineError::ResourceExhausted(format!(
                        "{} instances are registered (the limit)",
                        map.len()
                    )));
                }
                let i = Arc::new(Instance {
                    id: req.instance_id.as_str().into(),
                    namespace: req.namespace.as_str().into(),
                    tp_size: req.tp_size,
                    world_size: req.world_size,
                    page_first: req.page_first,
                    transfer_mode,
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
                inst.id
            )));
        }
        if st.workers.contains_key(&req.device_id) || st.importing.contains(&req.device_id) {
            return Err(EngineError::precondition(format!(
                "GPU context for device {} already exists in instance {}",
                req.device_id, inst.id
            )));
        }
        if st.topology.is_some()
            || st.workers.len() + st.importing.len() >= inst.world_size as usize
        {
            return Err(EngineError::precondition(format!(
                "instance {} is already fully registered ({} workers); device {} cannot join",
                inst.id, inst.world_size, req.device_id
            )));
        }
        st.importing.insert(req.device_id);
        drop(st);
        Ok(inst)
    }

    /// The pipeline's registrar for what `payload` carries, with its declared limits checked
    /// against the request (no side effect).
    fn registrar_for(
        &self,
        req: &pb::RegisterContextRequest,
        payload: &RegistrationPayload,
    ) -> EngineResult<Arc<dyn Registrar>> {
        let carrier = payload.carrier();
        let registrar = self
            .registrars
            .iter()
            .find(|r| r.scheme().carrier == carrier)
            .cloned()
            .ok_or_else(|| {
                let here = self
                    .registrars
                    .iter()
                    .map(|r| format!("{} ({})", r.kind(), r.scheme().carrier))
                    .collect::<Vec<_>>()
                    .join(", ");
                let msg = format!(
                    "{} registrations are not supported by this server: no registrar of the pipeline imports them (registrars here: {})",
                    payload.describe(),
                    if here.is_empty() { "none".to_string() } else { here }
                );
                match carrier {
                    // An unknown native memory kind is the client's mistake; a missing Python
                    // registrar is the server's configuration.
                    PayloadCarrier::SideChannel { .. } => EngineError::invalid(msg),
                    PayloadCarrier::LayerBlobs => EngineError::internal(msg),
                }
            })?;
        if let Some(max) = registrar.traits().max_world_size {
            if req.tp_size > max || req.world_size > max {
                return Err(EngineError::invalid(format!(
                    "{} registrations support at most {max} worker(s) per instance (tp_size = {}, world_size = {})",
                    registrar.scheme().name,
                    req.tp_size,
                    req.world_size
                )));
            }
        }
        Ok(registrar)
    }

    async fn register_worker(
        &self,
        inst: &Arc<Instance>,
        req: &pb::RegisterContextRequest,
        spec: Spec,
        registrar: Arc<dyn Registrar>,
    ) -> EngineResult<()> {
        let traits = registrar.traits();
        let regions = registrar
            .import(ImportRequest {
                instance_id: req.instance_id.clone(),
                device_id: req.device_id,
                payload: spec.payload,
            })
            .await
            .map_err(|e| match e {
                RegistrarError::Invalid(m) => EngineError::invalid(m),
                RegistrarError::Precondition(m) => EngineError::precondition(m),
                RegistrarError::Failed(m) => {
                    EngineError::internal(format!("register tensor failed: {m}"))
                }
            })?;
        if regions.len() != req.layer_names.len() {
            let n = regions.len();
            self.reaper.release(regions).await;
            return Err(EngineError::internal(format!(
                "registrar {} returned {n} regions for {} layers",
                registrar.kind(),
                req.layer_names.len()
            )));
        }
        match self.build_worker(traits, req, regions, spec.block_strides, &spec.groups) {
            Ok(worker) => self.commit_worker(inst, worker).await,
            Err((e, regions)) => {
                self.reaper.release(regions).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn build_worker(
        &self,
        traits: crate::plugin::RegistrarTraits,
        req: &pb::RegisterContextRequest,
        regions: Vec<crate::plugin::LayerRegion>,
        strides: Option<Vec<u64>>,
        groups: &[u32],
    ) -> Result<Worker, (EngineError, Vec<crate::plugin::LayerRegion>)> {
        let location = regions[0].memory.location();
        if regions.iter().any(|r| r.memory.location() != location) {
            return Err((
                EngineError::invalid("all layers of one worker must live on the same device"),
                regions,
            ));
        }
        let Some(transport) = self
            .transports
            .iter()
            .find(|t| t.can_address(location))
            .cloned()
        else {
            return Err((
                EngineError::internal(format!(
                    "no transport in the pipeline can address {location} memory (transports here: {})",
                    self.transports.iter().map(|t| t.kind()).collect::<Vec<_>>().join(", ")
                )),
                regions,
            ));
        };
        let mut layers = std::collections::HashMap::new();
        for (i, region) in regions.iter().enumerate() {
            let name = &req.layer_names[i];
            let layout = KvLayout::new(
                req.num_blocks[i],
                req.bytes_per_block[i],
                req.segments[i],
                req.kv_stride_bytes[i],
                strides.as_ref().map(|s| s[i]),
                region.len,
            );
            match layout {
                Ok(layout) => {
                    layers.insert(
                        name.clone(),
                        WorkerLayer {
                            region: region.clone(),
                            layout,
                            group: groups[i],
                        },
                    );
                }
                Err(e) => {
                    return Err((EngineError::invalid(format!("layer {name}: {e}")), regions))
                }
            }
        }
        Ok(Worker {
            device_id: req.device_id,
            tp_rank: req.tp_rank,
            pp_rank: req.pp_rank,
            layers,
            transport,
            traits,
            location,
        })
    }

    async fn commit_worker(&self, inst: &Arc<Instance>, worker: Worker) -> EngineResult<()> {
        let device = worker.device_id;
        let worker = Arc::new(worker);
        let rejected = {
            let mut st = inst.state.lock();
            st.importing.remove(&device);
            if st.closing {
                Some((
                    EngineError::precondition(format!(
                        "instance {} was unregistered while device {device} was registering",
                        inst.id
                    )),
                    Some(worker.clone()),
                ))
            } else if st.topology.is_some() || st.workers.len() >= inst.world_size as usize {
                Some((
                    EngineError::precondition(format!(
                        "instance {} is already fully registered ({} workers); device {device} cannot join",
                        inst.id, inst.world_size
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_gate() {
        assert!(accepts_client_version("0.25.1"));
        assert!(accepts_client_version("0.25.7"));
        assert!(accepts_client_version(pb::NATIVE_CLIENT_VERSION));
        assert!(!accepts_client_version("0.26.0"));
        assert!(!accepts_client_version("0.25."));
        assert!(!accepts_client_version("0.25.1+native-v0"));
        assert!(!accepts_client_version(""));
    }
}
