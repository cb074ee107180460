//! The `cuda-vmm` registrar: imports a native engine's CUDA VMM allocation, handed over as a
//! POSIX fd on the fd side channel, and returns one region per layer view
//! (`native-clients.md` §3.3, `pegaflow-behavior.md` §10.3).
//!
//! Owns: checking every view against the stated allocation size *before* the fd is taken (a
//! refused request closes the pending fd, so the client can resend under the same key at once);
//! taking the fd; and, on the `cuda-registry` thread, binding the device's primary context,
//! `cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)` (the driver keeps its own reference;
//! our fd is closed right after), checking that the allocation lives on the requested device
//! and that the stated size is a multiple of its granularity, `cuMemAddressReserve`,
//! `cuMemMap`, `cuMemSetAccess(READWRITE)`, unwinding every step on failure. The returned
//! [`LayerRegion`]s share one [`Registration`] whose drop queues, on the same thread,
//! `cuMemUnmap` → `cuMemAddressFree` → `cuMemRelease`.
//!
//! Size check: there is no driver call that reports the size of an imported allocation, so
//! the registrar relies on `cuMemMap` refusing a range longer than the allocation (on an H200
//! with driver 580.159.04 it answers `CUDA_ERROR_NOT_SUPPORTED`; `CUDA_ERROR_INVALID_VALUE` is
//! treated the same), reported to the client as an invalid argument; a stated size smaller than
//! the allocation maps just that prefix. The stated size must also be a multiple of the
//! imported allocation's granularity (checked first, with its own message).
//!
//! Native registration v2 ([`RegistrationPayload::NativeV2`], `0.25.1+native-v2`): several
//! VMM allocations per registration, allocation `i`'s fd keyed `instance_id \0 device_id \0 i`
//! on the side channel. Every fd is taken first (a missing one discards the rest), then all are
//! imported in allocation order in one registry job, each exactly as a v1 allocation; the
//! first failure releases every allocation imported so far (queued on the same thread) and
//! closes the fds not reached yet. Each mapping is its own [`VmmMapping`], released on its own
//! when the instance's teardown drops its last region.
//!
//! Must never: run a CUDA call on the async executor, return a region outside the mapping,
//! leave an import, reservation or mapping behind on any failure or cancellation, or take the
//! server down without a driver (imports fail with "CUDA driver not available: ...").

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use cudarc::driver::sys;
use parking_lot::Mutex;
use pegaflow_api::cuda_driver;
use pegaflow_plugin::{
    defaults_of, parse_settings, ConfigSchema, ImportRequest, LayerRegion, MemorySpace,
    NativeImport, NativeImportV2, PayloadCarrier, PayloadScheme, PluginOption, Registrar,
    RegistrarError, RegistrarFactory, RegistrarTraits, Registration, RegistrationPayload,
    RuntimeContext, SideChannel,
};
use serde::{Deserialize, Serialize};

use crate::driver::{check, driver, CudaError, Driver, Registry};

/// How long an import waits for the fd on the side channel unless `fd_timeout_secs` says
/// otherwise.
pub const DEFAULT_FD_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest accepted `fd_timeout_secs`, in seconds (one hour).
const MAX_FD_TIMEOUT_SECS: f64 = 3600.0;

/// A `cuda-vmm` registrar's settings: what its `[[registrar]]` table deserialises into.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaVmmConfig {
    /// Seconds an import waits for the allocation's fd on the side channel, 0 to 3600
    /// (fractions allowed).
    pub fd_timeout_secs: f64,
}

impl Default for CudaVmmConfig {
    fn default() -> Self {
        Self {
            fd_timeout_secs: DEFAULT_FD_TIMEOUT.as_secs_f64(),
        }
    }
}

/// Driver symbols the VMM import and release call beyond those [`driver`] checks; all must
/// resolve before any is called (cudarc's loader panics on a missing one).
const VMM_SYMBOLS: &[&str] = &[
    "cuCtxGetCurrent",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemRelease",
];

static VMM_READY: OnceLock<Result<(), CudaError>> = OnceLock::new();

/// The loaded driver, once it is known to export every VMM symbol.
fn vmm_driver() -> Result<&'static Driver, CudaError> {
    let d = driver()?;
    VMM_READY
        .get_or_init(|| {
            let missing = cuda_driver::missing_symbols(VMM_SYMBOLS)?;
            if missing.is_empty() {
                Ok(())
            } else {
                Err(CudaError(format!(
                    "the CUDA driver lacks the VMM API ({}); a driver of CUDA 11.4 or later is needed",
                    missing.join(", ")
                )))
            }
        })
        .clone()?;
    Ok(d)
}

/// Live imported mappings per instance id (for tests and logs).
static LIVE: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

fn live_add(instance: &str, delta: isize) {
    let mut g = LIVE.lock();
    let map = g.get_or_insert_with(HashMap::new);
    let n = map.entry(instance.to_string()).or_insert(0);
    *n = n.saturating_add_signed(delta);
    if *n == 0 {
        map.remove(instance);
    }
}

/// VMM mappings this process holds now, all instances together (a mapping counts until its
/// release has run on the registry thread).
pub fn live_mappings() -> usize {
    LIVE.lock().as_ref().map_or(0, |m| m.values().sum())
}

/// VMM mappings this process holds now for `instance_id`.
pub fn live_mappings_of(instance_id: &str) -> usize {
    LIVE.lock()
        .as_ref()
        .and_then(|m| m.get(instance_id).copied())
        .unwrap_or(0)
}

/// Makes `ordinal`'s primary context current for the duration of a registry job and restores
/// the previous one afterwards, so the registry thread's own record of what is bound stays
/// true.
struct CtxScope {
    prev: sys::CUcontext,
}

impl CtxScope {
    fn bind(drv: &Driver, ordinal: i32) -> Result<Self, CudaError> {
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer to a live local.
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            "cuCtxGetCurrent",
        )?;
        let ctx = drv.context(ordinal)?;
        // SAFETY: ctx is a retained primary context, valid for the process's lifetime.
        check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")?;
        Ok(Self { prev })
    }
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        // SAFETY: prev was current on this thread before (or null: none); both are valid.
        let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
    }
}

/// An imported allocation, reserved and mapped read-write on one device. Dropping it queues
/// the release on the registry thread (the engine drops registrations only after fencing and
/// draining their copies).
pub struct VmmMapping {
    ordinal: i32,
    uuid: String,
    base: u64,
    len: u64,
    handle: sys::CUmemGenericAllocationHandle,
    instance_id: String,
    registry: &'static Registry,
    driver: &'static Driver,
}

impl std::fmt::Debug for VmmMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Registration for VmmMapping {
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
            "cuda-vmm mapping of {} bytes at {:#x} on GPU {} ({}) for instance {}",
            self.len, self.base, self.ordinal, self.uuid, self.instance_id
        )
    }
}

/// Unmaps, frees the range and releases the handle, in that order, on the calling (registry)
/// thread. A failure is logged: the memory may leak, but nothing else is touched.
fn release(
    drv: &Driver,
    ordinal: i32,
    base: u64,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
    who: &str,
) {
    let _scope = match CtxScope::bind(drv, ordinal) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(who, "cuda-vmm release: cannot bind GPU {ordinal}: {e}");
            None
        }
    };
    // SAFETY: base..base+len was mapped by import() and every copy using it has drained.
    if let Err(e) = check(unsafe { sys::cuMemUnmap(base, len) }, "cuMemUnmap") {
        tracing::error!(who, "cuda-vmm release: {e}");
    }
    if let Err(e) = check(
        // SAFETY: the range was reserved by import() and is unmapped now.
        unsafe { sys::cuMemAddressFree(base, len) },
        "cuMemAddressFree",
    ) {
        tracing::error!(who, "cuda-vmm release: {e}");
    }
    // SAFETY: the handle came from cuMemImportFromShareableHandle and is no longer mapped.
    if let Err(e) = check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease") {
        tracing::error!(who, "cuda-vmm release: {e}");
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let (drv, ordinal, base, handle) = (self.driver, self.ordinal, self.base, self.handle);
        let len = self.len as usize;
        let who = std::mem::take(&mut self.instance_id);
        self.registry.post(move |_| {
            release(drv, ordinal, base, len, handle, &who);
            live_add(&who, -1);
            tracing::debug!(instance = %who, ordinal, len, "cuda-vmm mapping released");
        });
    }
}

/// Why an import on the registry thread failed: the registrar error to return.
fn failed(e: impl std::fmt::Display) -> RegistrarError {
    RegistrarError::Failed(e.to_string())
}

/// What the registry thread imports.
struct ImportJob {
    fd: OwnedFd,
    ordinal: i32,
    alloc_size: u64,
    instance_id: String,
}

/// Runs on the registry thread: imports, checks, reserves, maps and grants access, or undoes
/// every step done so far.
fn import_on_registry(
    job: ImportJob,
    drv: &'static Driver,
    registry: &'static Registry,
) -> Result<Arc<VmmMapping>, RegistrarError> {
    let ImportJob {
        fd,
        ordinal,
        alloc_size,
        instance_id,
    } = job;
    let len = usize::try_from(alloc_size).map_err(|_| {
        RegistrarError::Invalid(format!("alloc_size {alloc_size} does not fit in memory"))
    })?;
    let _scope = CtxScope::bind(drv, ordinal).map_err(failed)?;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // For POSIX fds the "OS handle" argument is the descriptor's value itself.
    let os_handle = fd.as_raw_fd() as isize as *mut c_void;
    check(
        // SAFETY: out-pointer to a live local; the fd is open for the duration of the call.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                os_handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        "cuMemImportFromShareableHandle",
    )
    .map_err(|e| {
        failed(format!(
            "{e} (is the descriptor a CUDA VMM allocation exported as a POSIX fd?)"
        ))
    })?;
    // The driver holds its own reference now.
    drop(fd);
    // Undo the import if anything below fails.
    struct Imported(sys::CUmemGenericAllocationHandle);
    impl Drop for Imported {
        fn drop(&mut self) {
            // SAFETY: the handle came from the import above and is not mapped.
            let _ = unsafe { sys::cuMemRelease(self.0) };
        }
    }
    let imported = Imported(handle);

    // SAFETY: CUmemAllocationProp is a plain C struct; the driver fills it.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    check(
        // SAFETY: out-pointer to a live local; the handle is valid.
        unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) },
        "cuMemGetAllocationPropertiesFromHandle",
    )
    .map_err(failed)?;
    let mut dev: sys::CUdevice = 0;
    check(
        // SAFETY: out-pointer to a live local; the ordinal was checked against the driver.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )
    .map_err(failed)?;
    if prop.location.type_ != sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        || prop.location.id != dev
    {
        return Err(RegistrarError::Invalid(format!(
            "the allocation sent for instance {instance_id} lives on {:?} {}, not on GPU {ordinal} \
             (the request's device_id)",
            prop.location.type_, prop.location.id
        )));
    }
    let mut granularity = 0usize;
    check(
        // SAFETY: out-pointer to a live local; prop was filled by the driver.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        },
        "cuMemGetAllocationGranularity",
    )
    .map_err(failed)?;
    // (Not `is_multiple_of`: the workspace's minimum Rust is 1.85.)
    if granularity > 1 && len / granularity * granularity != len {
        return Err(RegistrarError::Invalid(format!(
            "alloc_size {len} is not a multiple of the allocation granularity ({granularity} bytes)"
        )));
    }

    let mut base: sys::CUdeviceptr = 0;
    check(
        // SAFETY: out-pointer to a live local; default alignment, no fixed address.
        unsafe { sys::cuMemAddressReserve(&mut base, len, 0, 0, 0) },
        "cuMemAddressReserve",
    )
    .map_err(failed)?;
    struct Reserved(sys::CUdeviceptr, usize);
    impl Drop for Reserved {
        fn drop(&mut self) {
            // SAFETY: the range was reserved above and is not mapped (or was unmapped).
            let _ = unsafe { sys::cuMemAddressFree(self.0, self.1) };
        }
    }
    let reserved = Reserved(base, len);
    // SAFETY: base..base+len is a fresh reservation; the handle is valid.
    let r = unsafe { sys::cuMemMap(base, len, 0, handle, 0) };
    // The range and the handle are fresh and the offset is 0: a refusal here means the
    // allocation is shorter than the stated size (the likely case) or cannot be mapped at all.
    if matches!(
        r,
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE
    ) {
        return Err(RegistrarError::Invalid(format!(
            "cuMemMap of {len} bytes failed: {r:?} (is the allocation sent for instance \
             {instance_id} smaller than alloc_size {len}?)"
        )));
    }
    check(r, "cuMemMap").map_err(failed)?;
    struct Mapped(sys::CUdeviceptr, usize);
    impl Drop for Mapped {
        fn drop(&mut self) {
            // SAFETY: the range was mapped above and has no user yet.
            let _ = unsafe { sys::cuMemUnmap(self.0, self.1) };
        }
    }
    let mapped = Mapped(base, len);
    // SAFETY: CUmemAccessDesc is a plain C struct; every field is set below.
    let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(
        // SAFETY: base..base+len is mapped; one descriptor is passed.
        unsafe { sys::cuMemSetAccess(base, len, &access, 1) },
        "cuMemSetAccess",
    )
    .map_err(failed)?;
    // Success: the mapping owns the import, the reservation and the mapping from here on.
    std::mem::forget(mapped);
    std::mem::forget(reserved);
    std::mem::forget(imported);
    live_add(&instance_id, 1);
    Ok(Arc::new(VmmMapping {
        ordinal,
        uuid: drv
            .device(ordinal)
            .map(|d| d.uuid.clone())
            .unwrap_or_default(),
        base,
        len: alloc_size,
        handle,
        instance_id,
        registry,
        driver: drv,
    }))
}

/// The `memory_kind` wire value of CUDA VMM registrations (`MEMORY_KIND_CUDA_VMM`).
pub const MEMORY_KIND: i32 = pegaflow_proto::MemoryKind::CudaVmm as i32;

/// The `cuda-vmm` registrar (payload [`PayloadKind::CudaVmm`]).
#[derive(Debug)]
pub struct CudaVmmRegistrar {
    channel: Option<Arc<dyn SideChannel>>,
    fd_timeout: Duration,
    devices: Option<Vec<i32>>,
}

impl CudaVmmRegistrar {
    /// A registrar taking fds from `channel` (none: every import fails with
    /// [`RegistrarError::Precondition`]), waiting up to `fd_timeout` for each, serving
    /// `devices` (CUDA ordinals; `None` = every device the driver reports). Never fails:
    /// without a driver, imports fail with a clear error instead.
    pub fn new(
        channel: Option<Arc<dyn SideChannel>>,
        fd_timeout: Duration,
        devices: Option<Vec<i32>>,
    ) -> Self {
        Self {
            channel,
            fd_timeout,
            devices,
        }
    }

    /// Reads and range-checks the pipeline table (the factory's settings check and `build`).
    ///
    /// Errors: an unknown key or an out-of-range / non-numeric `fd_timeout_secs`.
    pub fn checked_config(table: &toml::Table) -> anyhow::Result<CudaVmmConfig> {
        let c: CudaVmmConfig = parse_settings("cuda-vmm registrar", table)?;
        let secs = c.fd_timeout_secs;
        if !(secs.is_finite() && (0.0..=MAX_FD_TIMEOUT_SECS).contains(&secs)) {
            anyhow::bail!(
                "cuda-vmm registrar: fd_timeout_secs must be between 0 and {MAX_FD_TIMEOUT_SECS}, got {secs}"
            );
        }
        Ok(c)
    }

    /// Builds the registrar from its pipeline table ([`CudaVmmConfig`]).
    ///
    /// Errors: an unknown key or an out-of-range / non-numeric `fd_timeout_secs`.
    pub fn build(table: &toml::Table, ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Registrar>> {
        let c = Self::checked_config(table)?;
        let secs = c.fd_timeout_secs;
        let fd_timeout = Duration::from_secs_f64(secs);
        if ctx.fd_channel.is_none() {
            tracing::info!(
                "cuda-vmm registrations will be refused: no fd side channel (--fd-socket-path)"
            );
        }
        match driver() {
            Err(e) => crate::driver::note_unavailable("cuda-vmm registrations", &e),
            Ok(_) => {
                if let Err(e) = vmm_driver() {
                    tracing::warn!("cuda-vmm registrations will fail: {e}");
                }
            }
        }
        Ok(Arc::new(Self::new(
            ctx.fd_channel.clone(),
            fd_timeout,
            ctx.devices.clone(),
        )))
    }

    /// The driver and its registry thread for an import on `ordinal`, after
    /// [`Self::check_device`] and a check that the driver has that device: everything
    /// checkable before the client's fds are taken.
    fn driver_for(
        &self,
        ordinal: i32,
    ) -> Result<(&'static Driver, &'static Registry), RegistrarError> {
        self.check_device(ordinal)?;
        let drv = vmm_driver().map_err(|e| {
            RegistrarError::Failed(format!("cuda-vmm registration needs a CUDA driver: {e}"))
        })?;
        if drv.device(ordinal).is_none() {
            return Err(RegistrarError::Precondition(format!(
                "no CUDA device with ordinal {ordinal} on this server (it has {})",
                drv.devices().len()
            )));
        }
        let registry = drv.registry().map_err(failed)?;
        Ok((drv, registry))
    }

    /// Everything that can be checked without the fd and before any CUDA call.
    fn check_device(&self, ordinal: i32) -> Result<(), RegistrarError> {
        if ordinal < 0 {
            return Err(RegistrarError::Invalid(format!(
                "device_id must be >= 0, got {ordinal}"
            )));
        }
        if let Some(allowed) = &self.devices {
            if !allowed.contains(&ordinal) {
                return Err(RegistrarError::Precondition(format!(
                    "GPU {ordinal} is not one of the devices this server serves ({allowed:?})"
                )));
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Registrar for CudaVmmRegistrar {
    fn kind(&self) -> &'static str {
        "cuda-vmm"
    }

    fn scheme(&self) -> PayloadScheme {
        PayloadScheme {
            name: "cuda-vmm",
            carrier: PayloadCarrier::SideChannel {
                memory_kind: MEMORY_KIND,
            },
        }
    }

    /// One GPU and one fused allocation per instance (the native-VMM v1 rules), and loads
    /// complete by the RPC only: the client's VMM memory has no load-state word.
    fn traits(&self) -> RegistrarTraits {
        RegistrarTraits {
            completion_by_rpc_only: true,
            max_world_size: Some(1),
        }
    }

    async fn import(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        if matches!(req.payload, RegistrationPayload::NativeV2 { .. }) {
            return self.import_v2(req).await;
        }
        let import = NativeImport::check("cuda-vmm", MEMORY_KIND, self.channel.as_ref(), req)?;
        let (instance_id, device_id, alloc_size) = (
            import.instance_id.clone(),
            import.device_id,
            import.alloc_size,
        );
        // Everything checkable without the fd comes first; a refusal closes the fd already
        // sent for this key, so the client can resend at once (not after the pending TTL).
        let (drv, registry) = self.driver_for(device_id).map_err(|e| import.refuse(e))?;
        let fd = import.take_fd("allocation fd", self.fd_timeout).await?;
        let job = ImportJob {
            fd,
            ordinal: device_id,
            alloc_size,
            instance_id: instance_id.clone(),
        };
        // The import runs on the registry thread: if this request is cancelled meanwhile, the
        // result is dropped there and the mapping is released again.
        let rx = registry
            .submit(move |_| import_on_registry(job, drv, registry))
            .map_err(failed)?;
        let memory = rx
            .await
            .map_err(|_| RegistrarError::Failed("the cuda-registry thread is gone".into()))??;
        tracing::info!(
            instance = %instance_id,
            device_id,
            layers = import.views.len(),
            memory = %memory.describe(),
            "cuda-vmm registration imported"
        );
        let memory: Arc<dyn Registration> = memory;
        Ok(import.regions(memory))
    }
}

impl CudaVmmRegistrar {
    /// Imports a native registration v2: one VMM fd per allocation.
    async fn import_v2(&self, req: ImportRequest) -> Result<Vec<LayerRegion>, RegistrarError> {
        let import =
            NativeImportV2::check("cuda-vmm", MEMORY_KIND, true, self.channel.as_ref(), req)?;
        let (instance_id, device_id) = (import.instance_id.clone(), import.device_id);
        let (drv, registry) = self.driver_for(device_id).map_err(|e| import.refuse(e))?;
        let fds = import.take_fds("allocation fd", self.fd_timeout).await?;
        let jobs: Vec<ImportJob> = fds
            .into_iter()
            .zip(&import.allocations)
            .map(|(fd, a)| ImportJob {
                fd,
                ordinal: device_id,
                alloc_size: a.size_bytes,
                instance_id: instance_id.clone(),
            })
            .collect();
        // One registry job imports them all in order; if this request is cancelled meanwhile,
        // the result is dropped there and every mapping is released again.
        let rx = registry
            .submit(move |_| {
                let mut out: Vec<Arc<dyn Registration>> = Vec::with_capacity(jobs.len());
                for (i, job) in jobs.into_iter().enumerate() {
                    // On an error `out` drops (each mapping queues its release on this thread)
                    // and the remaining jobs drop with the iterator (their fds close).
                    let m = import_on_registry(job, drv, registry).map_err(|e| match e {
                        RegistrarError::Invalid(m) => {
                            RegistrarError::Invalid(format!("allocation {i}: {m}"))
                        }
                        RegistrarError::Precondition(m) => {
                            RegistrarError::Precondition(format!("allocation {i}: {m}"))
                        }
                        RegistrarError::Failed(m) => {
                            RegistrarError::Failed(format!("allocation {i}: {m}"))
                        }
                    })?;
                    out.push(m);
                }
                Ok(out)
            })
            .map_err(failed)?;
        let memories = rx
            .await
            .map_err(|_| RegistrarError::Failed("the cuda-registry thread is gone".into()))??;
        tracing::info!(
            instance = %instance_id,
            device_id,
            layers = import.views.len(),
            allocations = memories.len(),
            "cuda-vmm native v2 registration imported"
        );
        import.regions(&memories)
    }
}

inventory::submit! {
    RegistrarFactory {
        kind: "cuda-vmm",
        summary: "imports a native engine's CUDA VMM allocation (POSIX fd on the side channel)",
        config: ConfigSchema {
            defaults: defaults_of::<CudaVmmConfig>,
            check: |_, t| CudaVmmRegistrar::checked_config(t).map(drop),
            options: &[PluginOption {
                name: "fd_timeout_secs",
                help: "seconds an import waits for the allocation's fd on the side channel",
            }],
        },
        flags: &[],
        build: CudaVmmRegistrar::build,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pegaflow_fd_channel::{FdChannel, FdChannelLimits};
    use pegaflow_plugin::{NativeView, RegistrationPayload};
    use std::os::fd::AsFd;

    fn view(offset: u64, size: u64) -> NativeView {
        NativeView {
            offset_bytes: offset,
            size_bytes: size,
            block_stride_bytes: 4096,
        }
    }

    fn request(id: &str, alloc_size: u64, views: Vec<NativeView>) -> ImportRequest {
        ImportRequest {
            instance_id: id.into(),
            device_id: 0,
            payload: RegistrationPayload::SideChannel {
                memory_kind: MEMORY_KIND,
                alloc_size,
                views,
            },
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        channel: Arc<FdChannel>,
    }

    async fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let channel = FdChannel::bind(&dir.path().join("fd.sock"), FdChannelLimits::default())
            .await
            .unwrap();
        Fixture { _dir: dir, channel }
    }

    fn registrar(f: &Fixture, timeout_secs: f64) -> Arc<dyn Registrar> {
        let mut t = toml::Table::new();
        t.insert("fd_timeout_secs".into(), toml::Value::Float(timeout_secs));
        let ctx = RuntimeContext {
            fd_channel: Some(Arc::clone(&f.channel) as Arc<dyn SideChannel>),
            ..RuntimeContext::default()
        };
        CudaVmmRegistrar::build(&t, &ctx).unwrap()
    }

    /// Sends some fd (a pipe's read end: the registrar must not care before the driver does)
    /// under `(id, 0)` and waits until the channel holds it.
    async fn send_and_wait(f: &Fixture, id: &str) {
        let (r, _w) = nix::unistd::pipe().unwrap();
        let before = f.channel.pending();
        pegaflow_api::fd::send_fd(f.channel.path(), id, 0, r.as_fd()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while f.channel.pending() != before + 1 {
            assert!(std::time::Instant::now() < deadline, "fd never arrived");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    #[tokio::test]
    async fn no_side_channel_is_a_precondition_failure() {
        let r = CudaVmmRegistrar::build(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        match r.import(request("x", 2 << 20, vec![view(0, 4096)])).await {
            Err(RegistrarError::Precondition(m)) => assert!(m.contains("--fd-socket-path"), "{m}"),
            other => panic!("expected Precondition, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn bad_views_are_invalid_and_discard_the_pending_fd() {
        let f = fixture().await;
        let reg = registrar(&f, 0.2);
        let stride0 = NativeView {
            offset_bytes: 0,
            size_bytes: 8,
            block_stride_bytes: 0,
        };
        let bad: Vec<(u64, Vec<NativeView>, &str)> = vec![
            (4096, vec![view(0, 1024), view(4000, 200)], "layer 1"),
            (4096, vec![view(u64::MAX, 2)], "layer 0"),
            (4096, vec![view(0, 0)], "size_bytes"),
            (4096, vec![stride0], "block_stride_bytes"),
            (4096, vec![], "no layer views"),
            (0, vec![view(0, 1)], "alloc_size"),
        ];
        for (alloc, views, needle) in bad {
            send_and_wait(&f, "vmm-bad").await;
            match reg.import(request("vmm-bad", alloc, views)).await {
                Err(RegistrarError::Invalid(m)) => assert!(m.contains(needle), "{m}"),
                other => panic!("expected Invalid for {needle}, got {other:?}"),
            }
            // Closed at once: the next resend under the same key is not a duplicate.
            assert_eq!(f.channel.pending(), 0, "{needle}");
        }
        let stats = f.channel.stats();
        assert_eq!(stats.discarded, 6);
        assert_eq!(stats.rejected_duplicate, 0);
        // Another payload kind or an unsafe id: refused too.
        let wrong = ImportRequest {
            instance_id: "x".into(),
            device_id: 0,
            payload: RegistrationPayload::LayerBlobs(vec![vec![1]]),
        };
        assert!(
            matches!(reg.import(wrong).await, Err(RegistrarError::Invalid(m)) if m.contains("wrapper_bytes"))
        );
        assert!(matches!(
            reg.import(request("bad id", 4096, vec![view(0, 64)])).await,
            Err(RegistrarError::Invalid(m)) if m.contains("instance id")
        ));
    }

    #[tokio::test]
    async fn devices_outside_the_served_set_are_refused() {
        let f = fixture().await;
        let reg = CudaVmmRegistrar::new(
            Some(Arc::clone(&f.channel) as Arc<dyn SideChannel>),
            Duration::from_millis(100),
            Some(vec![1]),
        );
        send_and_wait(&f, "vmm-dev").await;
        match reg
            .import(request("vmm-dev", 4096, vec![view(0, 64)]))
            .await
        {
            Err(RegistrarError::Precondition(m)) => assert!(m.contains("GPU 0"), "{m}"),
            other => panic!("expected Precondition, got {other:?}"),
        }
        assert_eq!(f.channel.pending(), 0);
    }

    #[tokio::test]
    async fn without_a_driver_import_fails_cleanly() {
        if driver().is_ok() {
            return; // a GPU machine: covered by tests/tests/vmm_gpu.rs (pegaflow-tests)
        }
        let f = fixture().await;
        let reg = registrar(&f, 5.0);
        send_and_wait(&f, "vmm-nodrv").await;
        let t0 = std::time::Instant::now();
        match reg
            .import(request("vmm-nodrv", 2 << 20, vec![view(0, 4096)]))
            .await
        {
            Err(RegistrarError::Failed(m)) => assert!(
                m.starts_with(
                    "cuda-vmm registration needs a CUDA driver: CUDA driver not available"
                ),
                "{m}"
            ),
            other => panic!("expected Failed, got {other:?}"),
        }
        // Refused before waiting for anything, and the fd was closed.
        assert!(t0.elapsed() < Duration::from_secs(4));
        assert_eq!(f.channel.pending(), 0);
        assert_eq!(live_mappings(), 0);
    }

    #[test]
    fn the_factory_is_registered_and_options_are_checked() {
        let f = pegaflow_plugin::registrar_factory("cuda-vmm").unwrap();
        let r = (f.build)(&toml::Table::new(), &RuntimeContext::default()).unwrap();
        assert_eq!(r.kind(), "cuda-vmm");
        assert_eq!(
            r.scheme().carrier,
            PayloadCarrier::SideChannel {
                memory_kind: MEMORY_KIND
            }
        );
        let ctx = RuntimeContext::default();
        let table = |s: &str| -> toml::Table { toml::from_str(s).unwrap() };
        assert!(CudaVmmRegistrar::build(&table("fd_timeout_secs = 3"), &ctx).is_ok());
        assert!(CudaVmmRegistrar::build(&table("fd_timeout_secs = 0.5"), &ctx).is_ok());
        assert!(CudaVmmRegistrar::build(&table("fd_timeout_secs = -1"), &ctx).is_err());
        assert!(CudaVmmRegistrar::build(&table("fd_timeout_secs = \"10\""), &ctx).is_err());
        assert!(CudaVmmRegistrar::build(&table("fd_timeout = 3"), &ctx).is_err());
    }
}
