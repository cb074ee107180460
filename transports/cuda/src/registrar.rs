//! The `cuda-ipc` registrar: imports the published Python client's pickled `CudaIPCWrapper`s
//! (one per layer) as CUDA IPC mappings; and the `cuda-ipc-handle` registrar: imports a native
//! registration v2 whose allocations are raw 64-byte CUDA IPC handles of `cuMemAlloc` memory
//! (`MEMORY_KIND_CUDA_IPC`, `native-clients.md` §2), one strided view per layer.
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
use pegaflow_plugin::{
    check_parses, defaults_of, parse_settings, ConfigSchema, ImportRequest, LayerRegion,
    MemorySpace, PayloadCarrier, PayloadScheme, Registrar, RegistrarError, RegistrarFactory,
    RegistrarTraits, Registration, RegistrationPayload, RuntimeContext,
};
use serde::{Deserialize, Serialize};

use cudarc::driver::sys;
use pegaflow_plugin::NativeImportV2;

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

/// The `memory_kind` wire value of native v2 CUDA IPC registrations (`MEMORY_KIND_CUDA_IPC`).
pub const IPC_HANDLE_MEMORY_KIND: i32 = pegaflow_proto::MemoryKind::CudaIpc as i32;

/// The `cuda-ipc-handle` registrar: native registration v2 over raw CUDA IPC handles.
///
/// Import: every allocation and view is checked first ([`NativeImportV2::check`]); then, on
/// the `cuda-registry` thread and in allocation order, each distinct handle is opened once
/// (`cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, refcounted with any other
/// registration of the same handle), and the mapping is confirmed: it must start at the
/// allocation's base (`cuMemGetAddressRange`), hold at least the stated `size_bytes`, and
/// live on the request's device (`cuPointerGetAttribute(DEVICE_ORDINAL)`). The first failure
/// closes every handle opened so far for the request. Each layer's region is bounds-checked
/// against its mapping. Loads complete by the RPC only; one GPU per instance.
#[derive(Debug, Clone, Default)]
pub struct CudaIpcHandleRegistrar {
    devices: Option<Vec<i32>>,
}

impl CudaIpcHandleRegistrar {
    /// A registrar serving `devices` (CUDA ordinals; `None` = every device the driver
    /// reports). Never fails: without a driver, imports fail with a clear error instead.
    pub fn new(devices: Option<Vec<i32>>) -> Self {
        Self { devices }
    }

    fn build(table: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Registrar>> {
        let _: CudaIpcConfig = parse_settings("cuda-ipc-handle registrar", table)?;
        if let Err(e) = driver() {
            crate::driver::note_unavailable("cuda-ipc-handle registrations", &e);
        }
        Ok(Arc::new(Self::new(ctx.devices.clone())))
    }
}

#[async_trait]
impl Registrar for CudaIpcHandleRegistrar {
    fn kind(&self) -> &'static str {
        "cuda-ipc-handle"
    }

    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "cuda-ipc-handle",
            carrier: PayloadCarrier::SideChannel {
                memory_kind: IPC_HANDLE_MEMORY_KIND,
            },
        }
    }

    /// One GPU per instance, loads complete by the RPC (the native rules).
    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits {
            completion_by_rpc_only: true,
            max_world_size: Some(1),
        }
    }

    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let import =
            NativeImportV2::check("cuda-ipc-handle", IPC_HANDLE_MEMORY_KIND, false, None, req)?;
        let ordinal = import.device_id;
        if let Some(allowed) = &self.devices {
            if !allowed.contains(&ordinal) {
                return Err(RegistrarError::Precondition(format!(
                    "GPU {ordinal} is not one of the devices this server serves ({allowed:?})"
                )));
            }
        }
        let drv = driver().map_err(|e| {
            RegistrarError::Failed(format!(
                "cuda-ipc-handle registration needs a CUDA driver: {e}"
            ))
        })?;
        let Some(dev) = drv.device(ordinal) else {
            return Err(RegistrarError::Precondition(format!(
                "no CUDA device with ordinal {ordinal} on this server (it has {})",
                drv.devices().len()
            )));
        };
        let uuid = dev.uuid.clone();
        let registry = drv
            .registry()
            .map_err(|e| RegistrarError::Failed(e.to_string()))?;
        let allocations: Vec<(u64, [u8; 64])> = import
            .allocations
            .iter()
            .map(|a| (a.size_bytes, a.ipc_handle.unwrap_or([0; 64])))
            .collect();
        // Opened on the registry thread: if this request is cancelled meanwhile, the result
        // is dropped there and every handle closes again.
        let rx = registry
            .submit(move |st| {
                let mut mappings: Vec<Arc<dyn Registration>> = Vec::with_capacity(allocations.len());
                for (i, &(stated, handle)) in allocations.iter().enumerate() {
                    let (base, len) = st.open_ipc(ordinal, &handle).map_err(|e| {
                        RegistrarError::Failed(format!(
                            "allocation {i}: cuIpcOpenMemHandle on GPU {ordinal} failed: {e} (is                              the engine process alive, on this node, and the handle from                              cuIpcGetMemHandle of a cuMemAlloc allocation?)"
                        ))
                    })?;
                    // From here the mapping closes when dropped, on any error below too.
                    let m = IpcMapping {
                        ordinal,
                        uuid: uuid.clone(),
                        base,
                        len,
                        handle,
                        registry,
                    };
                    let mut alloc_base: sys::CUdeviceptr = 0;
                    let mut alloc_len = 0usize;
                    crate::driver::check(
                        // SAFETY: out-pointers to live locals; base is a mapping of this
                        // process, open on the bound context.
                        unsafe { sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_len, base) },
                        "cuMemGetAddressRange",
                    )
                    .map_err(|e| RegistrarError::Failed(format!("allocation {i}: {e}")))?;
                    if alloc_base != base {
                        return Err(RegistrarError::Invalid(format!(
                            "allocation {i}: the IPC handle maps {base:#x}, inside an allocation                              starting at {alloc_base:#x} (send the handle of the allocation's base)"
                        )));
                    }
                    if len < stated {
                        return Err(RegistrarError::Invalid(format!(
                            "allocation {i}: the IPC allocation holds {len} bytes, less than the                              stated size_bytes {stated}"
                        )));
                    }
                    let on = st
                        .device_of(base)
                        .map_err(|e| RegistrarError::Failed(format!("allocation {i}: {e}")))?;
                    if on != ordinal {
                        return Err(RegistrarError::Invalid(format!(
                            "allocation {i} lives on GPU {on}, not on GPU {ordinal} (the                              request's device_id)"
                        )));
                    }
                    mappings.push(Arc::new(m));
                }
                Ok(mappings)
            })
            .map_err(|e| RegistrarError::Failed(e.to_string()))?;
        let mappings = rx
            .await
            .map_err(|_| RegistrarError::Failed("the cuda-registry thread is gone".into()))??;
        let regions = import.regions(&mappings)?;
        tracing::info!(
            instance = %import.instance_id,
            device_id = ordinal,
            layers = regions.len(),
            allocations = mappings.len(),
            "cuda-ipc-handle registration imported"
        );
        Ok(regions)
    }
}

inventory::submit! {
    RegistrarFactory {
        kind: "cuda-ipc-handle",
        summary: "imports a native v2 registration of raw CUDA IPC handles (cuMemAlloc arenas, no side channel)",
        config: ConfigSchema {
            defaults: defaults_of::<CudaIpcConfig>,
            check: check_parses::<CudaIpcConfig>,
            options: &[],
        },
        flags: &[],
        build: CudaIpcHandleRegistrar::build,
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
    fn ipc_handle_registrar_refuses_bad_input_before_any_driver_call() {
        use pegaflow_plugin::{NativeAllocationSpec, NativeTensorView, NativeView};
        let r = CudaIpcHandleRegistrar::new(None);
        let v1 = ImportRequest {
            instance_id: "i".into(),
            device_id: 0,
            payload: RegistrationPayload::SideChannel {
                memory_kind: IPC_HANDLE_MEMORY_KIND,
                alloc_size: 4096,
                views: vec![],
            },
        };
        let e = block_on(r.import(v1)).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Invalid(m) if m.contains("native v2")),
            "{e}"
        );
        let v2 = |offset: u64, handle: Option<[u8; 64]>| ImportRequest {
            instance_id: "i".into(),
            device_id: 0,
            payload: RegistrationPayload::NativeV2 {
                memory_kind: IPC_HANDLE_MEMORY_KIND,
                allocations: vec![NativeAllocationSpec {
                    size_bytes: 4096,
                    ipc_handle: handle,
                }],
                views: vec![NativeTensorView {
                    allocation: 0,
                    view: NativeView {
                        offset_bytes: offset,
                        size_bytes: 4096,
                        block_stride_bytes: 4096,
                    },
                }],
            },
        };
        let e = block_on(r.import(v2(1, Some([1; 64])))).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Invalid(m) if m.contains("exceeds allocation 0")),
            "{e}"
        );
        let e = block_on(r.import(v2(0, None))).unwrap_err();
        assert!(
            matches!(&e, RegistrarError::Invalid(m) if m.contains("need a CUDA IPC handle")),
            "{e}"
        );
        if driver().is_err() {
            let e = block_on(r.import(v2(0, Some([1; 64])))).unwrap_err();
            assert!(
                matches!(&e, RegistrarError::Failed(m) if m.contains("needs a CUDA driver")),
                "{e}"
            );
        }
        let f = pegaflow_plugin::registrar_factory("cuda-ipc-handle").unwrap();
        let r = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(r.kind(), "cuda-ipc-handle");
        assert_eq!(
            r.scheme().carrier,
            PayloadCarrier::SideChannel {
                memory_kind: IPC_HANDLE_MEMORY_KIND
            }
        );
    }

    #[test]
    fn factory_is_registered() {
        let f = pegaflow_plugin::registrar_factory("cuda-ipc").unwrap();
        let r = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(r.kind(), "cuda-ipc");
        assert_eq!(r.scheme().carrier, PayloadCarrier::LayerBlobs);
        let mut t = toml::Table::new();
        t.insert("bogus".into(), toml::Value::Integer(1));
        assert!((f.build)(&t, &RuntimeContext::default()).is_err());
    }
}
