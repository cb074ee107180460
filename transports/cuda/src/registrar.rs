//! The `cuda-ipc` registrar: imports the published Python client's pickled `CudaIPCWrapper`s
//! (one per layer) as CUDA IPC mappings.
//!
//! Owns: parsing and validating every wrapper before any mapping is opened; choosing the device
//! by UUID (never by the producer's device index); opening each distinct IPC handle of a
//! request once (refcounted across requests by the registry thread) with
//! `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`; waiting for the producer's IPC event when it asks;
//! bounds-checking every layer against the opened mapping; and closing mappings, on the
//! registry thread, when the last [`LayerRegion`] referencing an [`IpcMapping`] is dropped.
//!
//! Must never: run a CUDA call on the executor (all of them go to the `cuda-registry` thread),
//! return a region that reaches past the mapping or past its tensor's storage, leave a mapping
//! open when the request fails, or take the server down when there is no driver (the import
//! fails with a clear message instead).

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use pegaflow_runtime::{
    check_parses, defaults_of, parse_settings, ConfigSchema, ImportRequest, LayerRegion,
    MemorySpace, PayloadCarrier, PayloadScheme, Registrar, RegistrarError, RegistrarFactory,
    RegistrarTraits, Registration, RegistrationPayload, RuntimeContext,
};
use serde::{Deserialize, Serialize};

use crate::driver::{driver, Registry};
use crate::wrapper::{parse_wrapper, CudaIpcWrapper, WrapperError};

/// One opened CUDA IPC allocation. Dropping the last reference closes it on the registry
/// thread (the engine drops registrations only after their copies drained).
pub struct IpcMapping {
    ordinal: i32,
    uuid: String,
    base: u64,
    len: u64,
    handle: [u8; 64],
    registry: &'static Registry,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Registration for IpcMapping {
    fn location(&self) -> MemorySpace {
        crate::cuda_space(self.ordinal)
    }
    fn base_addr(&self) -> u64 {
        self.base
    }
    fn len_bytes(&self) -> u64 {
        self.len
    }
    fn describe(&self) -> String {
        format!(
            "cuda-ipc mapping of {} bytes at {:#x} on GPU {} ({})",
            self.len, self.base, self.ordinal, self.uuid
        )
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let (ordinal, handle) = (self.ordinal, self.handle);
        self.registry.post(move |st| st.close_ipc(ordinal, &handle));
    }
}

/// The `cuda-ipc` registrar.
#[derive(Debug, Clone, Default)]
pub struct CudaIpcRegistrar {
    devices: Option<Vec<i32>>,
}

/// A `cuda-ipc` registrar's settings: none yet (an empty table is the only valid one).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaIpcConfig {}

impl CudaIpcRegistrar {
    /// A registrar serving `devices` (CUDA ordinals; `None` = every device the driver reports).
    /// Never fails: without a driver, imports fail with a clear error instead.
    pub fn new(devices: Option<Vec<i32>>) -> Self {
        Self { devices }
    }

    fn build(table: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Registrar>> {
        let _: CudaIpcConfig = parse_settings("cuda-ipc registrar", table)?;
        if let Err(e) = driver() {
            crate::driver::note_unavailable("cuda-ipc registrations", &e);
        }
        Ok(Arc::new(Self::new(ctx.devices.clone())))
    }
}

fn invalid_layer(i: usize, e: WrapperError) -> RegistrarError {
    RegistrarError::Invalid(format!("layer {i}: {e}"))
}

#[async_trait]
impl Registrar for CudaIpcRegistrar {
    fn kind(&self) -> &'static str {
        "cuda-ipc"
    }

    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "cuda-ipc",
            carrier: PayloadCarrier::LayerBlobs,
        }
    }

    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits::default()
    }

    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let RegistrationPayload::LayerBlobs(pickles) = &req.payload else {
            return Err(RegistrarError::Invalid(format!(
                "the cuda-ipc registrar imports CudaIPCWrapper pickles, not {} payloads",
                req.payload.describe()
            )));
        };
        if pickles.is_empty() {
            return Err(RegistrarError::Invalid("no layers to register".into()));
        }
        // Parse and check everything before touching the GPU (cheap: a few hundred bytes each).
        let mut layers: Vec<(CudaIpcWrapper, [u8; 64])> = Vec::with_capacity(pickles.len());
        for (i, p) in pickles.iter().enumerate() {
            let w = parse_wrapper(p).map_err(|e| invalid_layer(i, e))?;
            let h = w.ipc_handle().map_err(|e| invalid_layer(i, e))?;
            w.data_offset_bytes().map_err(|e| invalid_layer(i, e))?;
            w.storage_end_bytes().map_err(|e| invalid_layer(i, e))?;
            layers.push((w, h));
        }
        let drv = driver().map_err(|e| {
            RegistrarError::Failed(format!("cuda-ipc registration needs a CUDA driver: {e}"))
        })?;
        let mut ordinals = Vec::with_capacity(layers.len());
        for (i, (w, _)) in layers.iter().enumerate() {
            let dev = drv.device_by_uuid(&w.device_uuid).ok_or_else(|| {
                RegistrarError::Precondition(format!(
                    "layer {i}: no CUDA device with UUID {} on this server (it has: {})",
                    w.device_uuid,
                    drv.devices()
                        .iter()
                        .map(|d| format!("{} = {}", d.ordinal, d.uuid))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            if let Some(allowed) = &self.devices {
                if !allowed.contains(&dev.ordinal) {
                    return Err(RegistrarError::Precondition(format!(
                        "layer {i}: GPU {} ({}) is not one of the devices this server serves \
                         ({allowed:?})",
                        dev.ordinal, dev.uuid
                    )));
                }
            }
            ordinals.push(dev.ordinal);
        }
        // Distinct (device, handle) pairs in first-seen order, and the events to wait for.
        let mut distinct: Vec<(i32, [u8; 64])> = Vec::new();
        let mut index: HashMap<(i32, [u8; 64]), usize> = HashMap::new();
        let mut events: Vec<(i32, [u8; 64])> = Vec::new();
        for ((w, h), &o) in layers.iter().zip(&ordinals) {
            index.entry((o, *h)).or_insert_with(|| {
                distinct.push((o, *h));
                distinct.len() - 1
            });
            if let Some(ev) = w.ipc_event_handle() {
                if !events.contains(&(o, ev)) {
                    events.push((o, ev));
                }
            }
        }
        let registry = drv
            .registry()
            .map_err(|e| RegistrarError::Failed(e.to_string()))?;
        let to_open = distinct.clone();
        // The mappings are created on the registry thread: if this request is cancelled while
        // they open, the result is dropped there and every mapping closes again.
        let rx = registry
            .submit(move |st| {
                let mut mappings: Vec<Arc<IpcMapping>> = Vec::with_capacity(to_open.len());
                for &(ordinal, handle) in &to_open {
                    match st.open_ipc(ordinal, &handle) {
                        Ok((base, len)) => mappings.push(Arc::new(IpcMapping {
                            ordinal,
                            uuid: drv
                                .device(ordinal)
                                .map(|d| d.uuid.clone())
                                .unwrap_or_default(),
                            base,
                            len,
                            handle,
                            registry,
                        })),
                        Err(e) => {
                            // Dropping `mappings` queues the closes of those already open.
                            return Err(format!(
                                "cuIpcOpenMemHandle on GPU {ordinal} failed: {e} (is the engine \
                                 process alive, and on this node?)"
                            ));
                        }
                    }
                }
                for (o, ev) in &events {
                    if let Err(e) = st.wait_ipc_event(*o, ev) {
                        tracing::warn!("waiting for the producer's IPC event on GPU {o}: {e}");
                    }
                }
                Ok(mappings)
            })
            .map_err(|e| RegistrarError::Failed(e.to_string()))?;
        // From here on, dropping a mapping closes it: an error below releases everything.
        let mappings = rx
            .await
            .map_err(|_| RegistrarError::Failed("the cuda-registry thread is gone".into()))?
            .map_err(RegistrarError::Failed)?;
        let mut regions = Vec::with_capacity(layers.len());
        for (i, ((w, h), &o)) in layers.iter().zip(&ordinals).enumerate() {
            let m = &mappings[index[&(o, *h)]];
            let end = w.storage_end_bytes().map_err(|e| invalid_layer(i, e))?;
            if end > m.len {
                return Err(RegistrarError::Invalid(format!(
                    "layer {i}: storage [{}, {end}) reaches past the {}-byte IPC allocation",
                    w.storage_offset_bytes, m.len
                )));
            }
            let offset = w.data_offset_bytes().map_err(|e| invalid_layer(i, e))?;
            let len = w.registrable_bytes().map_err(|e| invalid_layer(i, e))?;
            regions.push(LayerRegion {
                memory: m.clone(),
                offset,
                len,
            });
        }
        tracing::info!(
            instance = %req.instance_id,
            device_id = req.device_id,
            layers = regions.len(),
            mappings = mappings.len(),
            "cuda-ipc registration imported"
        );
        Ok(regions)
    }
}

inventory::submit! {
    RegistrarFactory {
        kind: "cuda-ipc",
        summary: "imports CudaIPCWrapper pickles (the Python client) as CUDA IPC mappings",
        config: ConfigSchema {
            defaults: defaults_of::<CudaIpcConfig>,
            check: check_parses::<CudaIpcConfig>,
            options: &[],
        },
        flags: &[],
        build: CudaIpcRegistrar::build,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(name: &str) -> Vec<u8> {
        let p = format!("{}/testdata/{name}.pickle.hex", env!("CARGO_MANIFEST_DIR"));
        let s = std::fs::read_to_string(p).unwrap();
        let s = s.trim();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn req(p: Vec<Vec<u8>>) -> ImportRequest {
        ImportRequest {
            instance_id: "i".into(),
            device_id: 0,
            payload: RegistrationPayload::LayerBlobs(p),
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn bad_input_is_invalid_before_any_driver_call() {
        let r = CudaIpcRegistrar::new(None);
        let e =
            block_on(r.import(req(vec![golden("wrapper_default"), vec![1, 2, 3]]))).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Invalid(m) if m.starts_with("layer 1:")),
            "{e}"
        );
        let e = block_on(r.import(req(vec![golden("wrapper_expandable")]))).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Invalid(m) if m.contains("expandable_segments:True")),
            "{e}"
        );
        let e = block_on(r.import(req(vec![]))).unwrap_err();
        assert!(matches!(e, RegistrarError::Invalid(_)));
        let e = block_on(r.import(ImportRequest {
            instance_id: "i".into(),
            device_id: 0,
            payload: RegistrationPayload::SideChannel {
                memory_kind: 1,
                alloc_size: 0,
                views: vec![],
            },
        }))
        .unwrap_err();
        assert!(matches!(e, RegistrarError::Invalid(_)));
    }

    #[test]
    fn without_a_driver_import_fails_cleanly() {
        if driver().is_ok() {
            return; // a GPU machine: covered by the GPU tests
        }
        let r = CudaIpcRegistrar::new(None);
        let e = block_on(r.import(req(vec![golden("wrapper_default")]))).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Failed(m)
                if m.starts_with("cuda-ipc registration needs a CUDA driver: CUDA driver not available")),
            "{e}"
        );
    }

    #[test]
    fn factory_is_registered() {
        let f = pegaflow_runtime::registrar_factory("cuda-ipc").unwrap();
        let r = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(r.kind(), "cuda-ipc");
        assert_eq!(r.scheme().carrier, PayloadCarrier::LayerBlobs);
        let mut t = toml::Table::new();
        t.insert("bogus".into(), toml::Value::Integer(1));
        assert!((f.build)(&t, &RuntimeContext::default()).is_err());
    }
}
