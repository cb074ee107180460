//! RegisterContextBatch, orchestrated: check the command against the server (registration
//! kind of the instance, a registrar for the payload and its limits) → reserve the device id
//! in the [registry](super::registry) → import the memory through the registrar → build the
//! worker (one transport, every layer's layout bounded by its region) → commit it (the last
//! worker seals the topology).
//!
//! Owns those steps and their rollback. Must never: change anything before the checks pass
//! (no instance is created for a refused command), keep a reservation or an imported region
//! of a failed registration, or drop an imported region on the executor (the reaper does).

use std::sync::Arc;

use pegaflow_api::{is_side_channel_safe_id, KvLayout};

use super::command::RegisterCommand;
use super::instance::{Instance, Worker, WorkerLayer};
use super::registry::check_mix;
use super::Engine;
use crate::error::{echo, EngineError, EngineResult};
use crate::plugin::{
    ImportRequest, LayerRegion, PayloadCarrier, Registrar, RegistrarError, RegistrarTraits,
    RegistrationPayload,
};

impl Engine {
    /// Registers one worker's KV memory (RegisterContextBatch).
    ///
    /// `cmd` is shape-checked ([`crate::decode::register`]); this checks it against the server
    /// (FAILED_PRECONDITION / INVALID_ARGUMENT with nothing changed), imports the memory
    /// through the pipeline's registrar for the payload kind, bounds-checks every layer, and
    /// seals the topology when the last worker joins.
    pub async fn register(&self, mut cmd: RegisterCommand) -> EngineResult<()> {
        let registrar = match self.check_registration(&cmd) {
            Ok(r) => r,
            Err(e) => {
                self.discard_pending_fd(&cmd.instance_id, cmd.device_id);
                return Err(e);
            }
        };
        let inst = match self.registry.reserve(&cmd, cmd.native()) {
            Ok(i) => i,
            Err(e) => {
                // Unless the same device is registering right now (whose descriptor the one
                // pending may be), this refusal's descriptor is closed.
                self.discard_pending_fd(&cmd.instance_id, cmd.device_id);
                return Err(e);
            }
        };
        let payload = std::mem::replace(&mut cmd.payload, RegistrationPayload::LayerBlobs(vec![]));
        let native = payload.is_native();
        let result = self.register_worker(&inst, &cmd, payload, registrar).await;
        if let Err(e) = &result {
            // Before the reservation goes: no other registration of this device can have
            // sent a descriptor that is pending now.
            if native {
                self.discard_fds(&cmd.instance_id, cmd.device_id);
            }
            self.registry.abandon(&inst, cmd.device_id);
            tracing::warn!(instance = %cmd.instance_id, device = cmd.device_id, error = %e, "registration rejected");
        }
        self.update_gauges();
        result
    }

    /// The checks against server state that precede the reservation (no side effect): the
    /// instance's registration kind, and a registrar for the payload.
    fn check_registration(&self, cmd: &RegisterCommand) -> EngineResult<Arc<dyn Registrar>> {
        if let Some(i) = self.registry.find(&cmd.instance_id) {
            check_mix(&i, cmd.native())?;
        }
        self.registrar_for(cmd, &cmd.payload)
    }

    /// Closes every descriptor the client sent on the side channel for a refused registration
    /// of `(instance_id, device_id)`, those already read and those still on their way
    /// ([`crate::fd_channel::FdChannel::discard`]), so that none waits for the pending TTL and
    /// the client can resend under the same key at once. Called for every refusal, whatever
    /// its reason (the service calls it for requests refused while decoding), except while a
    /// registration of the same device is importing: the descriptor pending under the key may
    /// be that one's, which closes what is left when its import ends.
    pub fn discard_pending_fd(&self, instance_id: &str, device_id: i32) {
        if self.fd_channel.is_none() || !is_side_channel_safe_id(instance_id) {
            return;
        }
        if self.registry.is_importing(instance_id, device_id) {
            tracing::debug!(instance = %instance_id, device = device_id, "a registration of this device is importing: its side-channel descriptor is left to it");
            return;
        }
        self.discard_fds(instance_id, device_id);
    }

    /// [`Self::discard_pending_fd`] without the importing check: for the registration that
    /// holds the device's reservation.
    fn discard_fds(&self, instance_id: &str, device_id: i32) {
        let Some(c) = &self.fd_channel else { return };
        if is_side_channel_safe_id(instance_id) && c.discard(instance_id, device_id) {
            tracing::info!(instance = %instance_id, device = device_id, "discarded the side-channel fd of a failed registration");
        }
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

    /// Import → build → commit. On failure every imported region is released.
    async fn register_worker(
        &self,
        inst: &Arc<Instance>,
        req: &RegisterCommand,
        payload: RegistrationPayload,
        registrar: Arc<dyn Registrar>,
    ) -> EngineResult<()> {
        let whole_blocks = matches!(payload, RegistrationPayload::NativeV2 { .. });
        let native = payload.is_native();
        let regions = self.import(req, payload, &registrar).await?;
        if native {
            // The import took its descriptors. Anything left under the key (sent by a
            // registration of the same device refused meanwhile) is nobody's: closed now,
            // before a later registration of this key could take it.
            self.discard_fds(&req.instance_id, req.device_id);
        }
        match self.build_worker(registrar.traits(), req, regions, whole_blocks) {
            Ok(worker) => self.registry.commit(inst, worker).await,
            Err((e, regions)) => {
                self.registry.reaper().release(regions).await;
                Err(e)
            }
        }
    }

    /// Imports the memory: one region per layer of the command.
    async fn import(
        &self,
        req: &RegisterCommand,
        payload: RegistrationPayload,
        registrar: &Arc<dyn Registrar>,
    ) -> EngineResult<Vec<LayerRegion>> {
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
            self.registry.reaper().release(regions).await;
            return Err(EngineError::internal(format!(
                "registrar {} returned {n} regions for {} layers",
                registrar.kind(),
                req.layers.len()
            )));
        }
        Ok(regions)
    }

    #[allow(clippy::type_complexity)]
    fn build_worker(
        &self,
        traits: RegistrarTraits,
        req: &RegisterCommand,
        regions: Vec<LayerRegion>,
        whole_blocks: bool,
    ) -> Result<Worker, (EngineError, Vec<LayerRegion>)> {
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
                    return Err((
                        EngineError::invalid(format!("layer {}: {e}", echo(name))),
                        regions,
                    ))
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
            whole_blocks,
        })
    }
}
