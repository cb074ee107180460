//! RegisterContextBatch: the worker's memory import, and topology sealing.

use std::sync::Arc;

use pegaflow_api::{is_side_channel_safe_id, KvLayout};

use super::command::RegisterCommand;
use super::instance::{Instance, InstanceState, Topology, Worker, WorkerLayer};
use super::Engine;
use crate::error::{EngineError, EngineResult};
use crate::plugin::{
    ImportRequest, PayloadCarrier, Registrar, RegistrarError, RegistrationPayload,
};

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
    /// `cmd` is shape-checked ([`crate::decode::register`]); this checks it against the server
    /// (FAILED_PRECONDITION / INVALID_ARGUMENT with nothing changed), imports the memory
    /// through the pipeline's registrar for the payload kind, bounds-checks every layer, and
    /// seals the topology when the last worker joins.
    pub async fn register(&self, mut cmd: RegisterCommand) -> EngineResult<()> {
        let native = cmd.native();
        let mixed = self
            .instances
            .read()
            .get(cmd.instance_id.as_str())
            .map_or(Ok(()), |i| check_mix(i, native));
        if let Err(e) = mixed {
            self.discard_failed_fd(&cmd);
            return Err(e);
        }
        let registrar = match self.registrar_for(&cmd, &cmd.payload) {
            Ok(r) => r,
            Err(e) => {
                self.discard_failed_fd(&cmd);
                return Err(e);
            }
        };
        // A refused reservation (e.g. the device is already registering) leaves the side
        // channel alone: the pending descriptor may belong to the registration in progress.
        let inst = self.reserve(&cmd, native)?;
        let payload = std::mem::replace(&mut cmd.payload, RegistrationPayload::LayerBlobs(vec![]));
        let result = self.register_worker(&inst, &cmd, payload, registrar).await;
        if let Err(e) = &result {
            if native {
                self.discard_pending_fd(&cmd.instance_id, cmd.device_id);
            }
            // Map lock first, then the instance's state (the order `reserve` uses), so no
            // registration can reserve on this instance between the check and the removal.
            let mut map = self.instances.write();
            let mut st = inst.state.lock();
            st.importing.remove(&cmd.device_id);
            if st.workers.is_empty()
                && st.importing.is_empty()
                && map.get(&*inst.id).is_some_and(|i| Arc::ptr_eq(i, &inst))
            {
                map.remove(&*inst.id);
            }
            drop(st);
            drop(map);
            tracing::warn!(instance = %cmd.instance_id, device = cmd.device_id, error = %e, "registration rejected");
        }
        self.update_gauges();
        result
    }

    fn discard_failed_fd(&self, cmd: &RegisterCommand) {
        if cmd.native() {
            self.discard_pending_fd(&cmd.instance_id, cmd.device_id);
        }
    }

    /// Closes a descriptor the client sent on the side channel for a failed native
    /// registration, so that it can resend under the same key at once instead of waiting for
    /// the pending TTL. The service calls it for requests refused while decoding.
    pub fn discard_pending_fd(&self, instance_id: &str, device_id: i32) {
        if let Some(c) = &self.fd_channel {
            if is_side_channel_safe_id(instance_id) && c.discard(instance_id, device_id) {
                tracing::info!(instance = %instance_id, device = device_id, "discarded the side-channel fd of a failed registration");
            }
        }
    }

    /// Gets or creates the instance and reserves the device id for this registration.
    fn reserve(&self, req: &RegisterCommand, native: bool) -> EngineResult<Arc<Instance>> {
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
        req: &RegisterCommand,
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
        req: &RegisterCommand,
        payload: RegistrationPayload,
        registrar: Arc<dyn Registrar>,
    ) -> EngineResult<()> {
        let traits = registrar.traits();
        let regions = registrar
            .import(ImportRequest {
                instance_id: req.instance_id.clone(),
                device_id: req.device_id,
                payload,
            })
            .await
            .map_err(|e| match e {
                RegistrarError::Invalid(m) => EngineError::invalid(m),
                RegistrarError::Precondition(m) => EngineError::precondition(m),
                RegistrarError::Failed(m) => {
                    EngineError::internal(format!("register tensor failed: {m}"))
                }
            })?;
        if regions.len() != req.layers.len() {
            let n = regions.len();
            self.reaper.release(regions).await;
            return Err(EngineError::internal(format!(
                "registrar {} returned {n} regions for {} layers",
                registrar.kind(),
                req.layers.len()
            )));
        }
        match self.build_worker(traits, req, regions) {
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
        req: &RegisterCommand,
        regions: Vec<crate::plugin::LayerRegion>,
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
        for (spec, region) in req.layers.iter().zip(&regions) {
            let name = &spec.name;
            let layout = KvLayout::new(
                spec.num_blocks,
                spec.bytes_per_block,
                spec.segments,
                spec.kv_stride_bytes,
                spec.block_stride_bytes,
                region.len,
            );
            match layout {
                Ok(layout) => {
                    layers.insert(
                        name.clone(),
                        WorkerLayer {
                            region: region.clone(),
                            layout,
                            group: spec.group,
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
