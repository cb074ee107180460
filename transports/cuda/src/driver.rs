//! Guarded access to the CUDA driver (libcuda, loaded at run time through cudarc), the device
//! list, primary contexts, and the `cuda-registry` thread.
//!
//! Owns: deciding once per process whether the driver is usable ([`driver`]): libcuda must load,
//! export every symbol this crate calls, and `cuInit` must succeed (checked by the process's one
//! loader, [`pegaflow_api::cuda_driver`]); the ordinal ↔ UUID map;
//! retaining each device's primary context (once, for the process's lifetime); and the
//! registry thread ([`Registry`]), which runs every IPC open/close and event wait, fed by a
//! bounded request queue, and keeps the refcounted table of open IPC mappings.
//!
//! Must never: call into cudarc before the load check passed (cudarc panics when libcuda or a
//! symbol is missing), run a CUDA call on an async executor thread (callers hand work to the
//! registry thread or to the transport's workers), or let a failed check take the process
//! down: every failure is a [`CudaError`] whose message starts with "CUDA driver not
//! available:" when the driver itself is missing.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use cudarc::driver::sys;
use pegaflow_api::cuda_driver::{self, DriverUnavailable};

/// A CUDA failure, with the driver's error name where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CudaError(pub String);

impl From<DriverUnavailable> for CudaError {
    fn from(e: DriverUnavailable) -> Self {
        CudaError(e.to_string())
    }
}

/// Checks a driver result; `what` names the call for the message.
pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError(format!("{what} failed: {r:?}")))
    }
}

/// Every driver symbol this crate calls besides `cuInit` (which the shared loader,
/// [`cuda_driver::init`], checks and calls); all must resolve before any is called, because
/// cudarc's dynamic loader panics on a missing one.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetMemHandle",
    "cuIpcOpenEventHandle",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuMemsetD8_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA ordinal in this process.
    pub ordinal: i32,
    /// Lowercase `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, without `GPU-`.
    pub uuid: String,
    /// Marketing name.
    pub name: String,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory, in bytes.
    pub total_mem: u64,
    /// PCI address as sysfs names it (`0000:3b:00.0`), from the driver's PCI attributes; it
    /// finds the device's NUMA node.
    pub pci_bus_id: String,
}

/// A retained primary context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx(pub(crate) sys::CUcontext);
// SAFETY: a CUcontext is an opaque driver handle that the driver lets any thread make current;
// this crate only passes it to cuCtxSetCurrent.
unsafe impl Send for Ctx {}
// SAFETY: as above; the handle is never dereferenced on the Rust side.
unsafe impl Sync for Ctx {}

/// The loaded, initialised driver.
pub struct Driver {
    version: i32,
    devices: Vec<DeviceInfo>,
    cu_devices: Vec<sys::CUdevice>,
    contexts: Vec<OnceLock<Result<Ctx, CudaError>>>,
    registry: OnceLock<Result<Registry, CudaError>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("version", &self.version)
            .field("devices", &self.devices)
            .finish()
    }
}

fn unavailable(why: impl std::fmt::Display) -> CudaError {
    DriverUnavailable::new(why).into()
}

fn load() -> Result<Driver, CudaError> {
    cuda_driver::init(REQUIRED_SYMBOLS, "driver too old for this build?")?;
    std::panic::catch_unwind(init)
        .unwrap_or_else(|_| Err(unavailable("initialising the CUDA driver panicked")))
}

/// Reads the driver version and the device list; the driver is initialised already.
fn init() -> Result<Driver, CudaError> {
    let mut version = 0;
    check(
        // SAFETY: out-pointer to a live local.
        unsafe { sys::cuDriverGetVersion(&mut version) },
        "cuDriverGetVersion",
    )
    .map_err(unavailable)?;
    let mut count = 0;
    check(
        // SAFETY: out-pointer to a live local.
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )
    .map_err(unavailable)?;
    let mut devices = Vec::new();
    let mut cu_devices = Vec::new();
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        check(
            // SAFETY: out-pointer to a live local; ordinal < count.
            unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        // SAFETY: CUuuid is plain bytes; all-zero is a valid value.
        let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: out-pointer to a live local; dev came from cuDeviceGet.
            unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) },
            "cuDeviceGetUuid_v2",
        )?;
        let mut name = [0 as std::ffi::c_char; 256];
        check(
            // SAFETY: the buffer holds 256 bytes, as passed.
            unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) },
            "cuDeviceGetName",
        )?;
        name[255] = 0;
        // SAFETY: the driver NUL-terminates within the buffer; the last byte stays 0 anyway.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut sms = 0;
        check(
            // SAFETY: out-pointer to a live local.
            unsafe {
                sys::cuDeviceGetAttribute(
                    &mut sms,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                )
            },
            "cuDeviceGetAttribute",
        )?;
        let pci = |attr| {
            let mut v = 0;
            // SAFETY: out-pointer to a live local.
            check(
                unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
                "cuDeviceGetAttribute",
            )
            .map(|()| v)
        };
        use sys::CUdevice_attribute as A;
        let pci_bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            pci(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            pci(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            pci(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let mut total = 0usize;
        check(
            // SAFETY: out-pointer to a live local.
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) },
            "cuDeviceTotalMem_v2",
        )?;
        let bytes: Vec<u8> = uuid.bytes.iter().map(|&b| b as u8).collect();
        devices.push(DeviceInfo {
            ordinal,
            uuid: format_uuid(&bytes),
            name,
            sm_count: sms.max(1) as u32,
            total_mem: total as u64,
            pci_bus_id,
        });
        cu_devices.push(dev);
    }
    let contexts = (0..devices.len()).map(|_| OnceLock::new()).collect();
    tracing::info!(
        driver_version = version,
        devices = ?devices.iter().map(|d| format!("{}:{}:{}", d.ordinal, d.name, d.uuid)).collect::<Vec<_>>(),
        "CUDA driver loaded"
    );
    Ok(Driver {
        version,
        devices,
        cu_devices,
        contexts,
        registry: OnceLock::new(),
    })
}

/// Formats 16 UUID bytes as lowercase `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(b: &[u8]) -> String {
    let mut s = String::with_capacity(36);
    for (i, byte) in b.iter().take(16).enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{byte:02x}"));
    }
    s
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

/// Says at start-up, once per process, what a backend cannot do without the driver: the first
/// caller logs one INFO line (a CPU-only machine is a normal deployment: host-memory
/// registrations are served), later ones only at DEBUG. `part` names what will be refused
/// (`cuda-ipc registrations`, ...).
pub fn note_unavailable(part: &str, e: &CudaError) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::debug!("{part} will be refused: {e}");
    } else {
        tracing::info!(
            "{e}: CUDA IPC and CUDA VMM registrations will be refused and the cuda transport copies nothing; host-memory registrations are served"
        );
    }
}

/// The process's CUDA driver, loaded and initialised on first use (then cached, success or
/// failure).
///
/// Errors: [`CudaError`] "CUDA driver not available: ..." when libcuda is missing, lacks a
/// symbol this crate calls, or `cuInit` fails (e.g. no device).
pub fn driver() -> Result<&'static Driver, CudaError> {
    DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
}

impl Driver {
    /// The driver's CUDA version, e.g. 13000.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Every device the driver reports, by ordinal.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// The device with this UUID (any case, with or without `GPU-`).
    pub fn device_by_uuid(&self, uuid: &str) -> Option<&DeviceInfo> {
        let u = uuid
            .strip_prefix("GPU-")
            .unwrap_or(uuid)
            .to_ascii_lowercase();
        self.devices.iter().find(|d| d.uuid == u)
    }

    /// The device with this ordinal.
    pub fn device(&self, ordinal: i32) -> Option<&DeviceInfo> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
    }

    /// The primary context of `ordinal`, retained on first use and kept for the process's
    /// lifetime.
    pub(crate) fn context(&self, ordinal: i32) -> Result<Ctx, CudaError> {
        let i = usize::try_from(ordinal)
            .ok()
            .filter(|&i| i < self.devices.len())
            .ok_or_else(|| CudaError(format!("no CUDA device with ordinal {ordinal}")))?;
        self.contexts[i]
            .get_or_init(|| {
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                check(
                    // SAFETY: out-pointer to a live local; the device handle came from cuDeviceGet.
                    unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.cu_devices[i]) },
                    "cuDevicePrimaryCtxRetain",
                )?;
                Ok(Ctx(ctx))
            })
            .clone()
    }

    /// Makes `ordinal`'s primary context current on the calling thread (which must be a
    /// dedicated CUDA thread, never an executor thread).
    ///
    /// Errors: [`CudaError`] when the ordinal is unknown or the driver refuses.
    pub fn bind(&self, ordinal: i32) -> Result<(), CudaError> {
        let ctx = self.context(ordinal)?;
        // SAFETY: ctx is a retained primary context, valid for the process's lifetime.
        check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")
    }

    /// The registry thread, started on first use.
    ///
    /// Errors: [`CudaError`] when the thread cannot be spawned.
    pub fn registry(&'static self) -> Result<&'static Registry, CudaError> {
        self.registry
            .get_or_init(|| Registry::start(self))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// Most requests the registry queue holds (waiting or running) before refusing more.
pub const REGISTRY_QUEUE_DEPTH: usize = 64;

type Job = Box<dyn FnOnce(&mut RegistryState) + Send>;

/// The `cuda-registry` thread: runs IPC opens/closes and other registry work off the async
/// executor, one at a time, in submission order.
pub struct Registry {
    tx: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .field("open_mappings", &self.open_mappings())
            .finish()
    }
}

struct IpcEntry {
    dptr: u64,
    size: u64,
    refs: usize,
}

/// State owned by the registry thread: the refcounted IPC mappings and the bound context.
pub struct RegistryState {
    driver: &'static Driver,
    bound: Option<i32>,
    ipc: HashMap<(i32, [u8; 64]), IpcEntry>,
    open: Arc<AtomicUsize>,
}

impl std::fmt::Debug for RegistryState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryState")
            .field("bound", &self.bound)
            .field("ipc_mappings", &self.ipc.len())
            .finish()
    }
}

impl Registry {
    fn start(driver: &'static Driver) -> Result<Registry, CudaError> {
        let (tx, rx) = mpsc::channel::<Job>();
        let open = Arc::new(AtomicUsize::new(0));
        let mut state = RegistryState {
            driver,
            bound: None,
            ipc: HashMap::new(),
            open: open.clone(),
        };
        std::thread::Builder::new()
            .name("cuda-registry".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking job must not take the registry (and every later close) down.
                    let r = std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut state)));
                    if r.is_err() {
                        tracing::error!("a cuda-registry job panicked");
                    }
                }
            })
            .map_err(|e| CudaError(format!("cannot spawn the cuda-registry thread: {e}")))?;
        Ok(Registry {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            open,
        })
    }

    /// Runs `f` on the registry thread and returns a receiver for its result.
    ///
    /// Errors: [`CudaError`] when [`REGISTRY_QUEUE_DEPTH`] requests are already queued, or
    /// the thread is gone.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RegistryState) -> R + Send + 'static,
    ) -> Result<tokio::sync::oneshot::Receiver<R>, CudaError> {
        let n = self.queued.fetch_add(1, Ordering::AcqRel);
        if n >= REGISTRY_QUEUE_DEPTH {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(CudaError(format!(
                "the cuda-registry queue is full ({REGISTRY_QUEUE_DEPTH} requests); retry later"
            )));
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        // Released when the job is done or dropped, even if it panics.
        struct Slot(Arc<AtomicUsize>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let slot = Slot(self.queued.clone());
        let job: Job = Box::new(move |st| {
            let out = f(st);
            drop(slot);
            // When the caller is gone the result is dropped here, on the registry thread.
            let _ = reply.send(out);
        });
        // On failure the job (and its slot) is dropped, releasing the slot.
        self.tx
            .send(job)
            .map_err(|_| CudaError("the cuda-registry thread is gone".into()))?;
        Ok(rx)
    }

    /// Queues release work (never refused: one per live mapping at most, so the queue stays
    /// bounded by the number of mappings).
    pub(crate) fn post(&self, f: impl FnOnce(&mut RegistryState) + Send + 'static) {
        if self.tx.send(Box::new(f)).is_err() {
            tracing::error!("the cuda-registry thread is gone; a release was dropped");
        }
    }

    /// IPC mappings currently open (distinct handles, whatever their reference counts).
    pub fn open_mappings(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

impl RegistryState {
    fn bind(&mut self, ordinal: i32) -> Result<(), CudaError> {
        if self.bound != Some(ordinal) {
            self.driver.bind(ordinal)?;
            self.bound = Some(ordinal);
        }
        Ok(())
    }

    /// Opens (or references again) the IPC handle on device `ordinal`, with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, and returns the mapping's base and size.
    ///
    /// Errors: [`CudaError`] from the driver (e.g. the producer is gone, or the handle came
    /// from this very process).
    pub fn open_ipc(&mut self, ordinal: i32, handle: &[u8; 64]) -> Result<(u64, u64), CudaError> {
        if let Some(e) = self.ipc.get_mut(&(ordinal, *handle)) {
            e.refs += 1;
            return Ok((e.dptr, e.size));
        }
        self.bind(ordinal)?;
        // SAFETY: CUipcMemHandle is 64 plain bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        let mut dptr: sys::CUdeviceptr = 0;
        check(
            // SAFETY: out-pointer to a live local; the context of `ordinal` is current.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut dptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        let mut base: sys::CUdeviceptr = 0;
        let mut size = 0usize;
        // SAFETY: out-pointers to live locals; dptr was just mapped.
        let r = check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr) },
            "cuMemGetAddressRange",
        );
        let size = match r {
            Ok(()) if base == dptr => size as u64,
            Ok(()) => {
                // The mapping starts inside a larger range: only what follows dptr counts.
                (base + size as u64).saturating_sub(dptr)
            }
            Err(e) => {
                // SAFETY: dptr was returned by cuIpcOpenMemHandle above and is not used again.
                let _ = unsafe { sys::cuIpcCloseMemHandle(dptr) };
                return Err(e);
            }
        };
        self.ipc.insert(
            (ordinal, *handle),
            IpcEntry {
                dptr,
                size,
                refs: 1,
            },
        );
        self.open.store(self.ipc.len(), Ordering::Release);
        Ok((dptr, size))
    }

    /// The CUDA ordinal of the device whose memory `dptr` (a mapping open in this process)
    /// belongs to (`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`).
    ///
    /// Errors: [`CudaError`] from the driver.
    pub fn device_of(&mut self, dptr: u64) -> Result<i32, CudaError> {
        let mut ordinal: std::ffi::c_int = -1;
        check(
            // SAFETY: the attribute is an int written through the out-pointer to a live
            // local; dptr is a device address of this process.
            unsafe {
                sys::cuPointerGetAttribute(
                    (&mut ordinal as *mut std::ffi::c_int).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    dptr,
                )
            },
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
        )?;
        Ok(ordinal)
    }

    /// Drops one reference to an IPC mapping; the last one closes it.
    pub fn close_ipc(&mut self, ordinal: i32, handle: &[u8; 64]) {
        let key = (ordinal, *handle);
        let Some(e) = self.ipc.get_mut(&key) else {
            tracing::error!(ordinal, "close of an IPC mapping that is not open");
            return;
        };
        e.refs -= 1;
        if e.refs > 0 {
            return;
        }
        let dptr = e.dptr;
        self.ipc.remove(&key);
        self.open.store(self.ipc.len(), Ordering::Release);
        if let Err(e) = self.bind(ordinal) {
            tracing::error!(
                ordinal,
                "cannot bind the context to close an IPC mapping: {e}"
            );
            return;
        }
        if let Err(e) = check(
            // SAFETY: dptr came from cuIpcOpenMemHandle on this context and has no other user
            // (the last registration referencing it was dropped after its copies drained).
            unsafe { sys::cuIpcCloseMemHandle(dptr) },
            "cuIpcCloseMemHandle",
        ) {
            tracing::error!(ordinal, "{e}");
        }
    }

    /// Waits for the producer's IPC event (torch's `event_sync_required`), so the first copy
    /// sees what the producer's stream wrote before it shared the tensor.
    ///
    /// Errors: [`CudaError`] from the driver.
    pub fn wait_ipc_event(&mut self, ordinal: i32, handle: &[u8; 64]) -> Result<(), CudaError> {
        self.bind(ordinal)?;
        // SAFETY: CUipcEventHandle is 64 plain bytes.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer to a live local; the context is current.
            unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) },
            "cuIpcOpenEventHandle",
        )?;
        // SAFETY: ev was just opened and is destroyed right after.
        let r = check(unsafe { sys::cuEventSynchronize(ev) }, "cuEventSynchronize");
        // SAFETY: as above.
        let _ = unsafe { sys::cuEventDestroy_v2(ev) };
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format() {
        let b: Vec<u8> = vec![
            0x40, 0xee, 0xab, 0x74, 0x84, 0x5d, 0x74, 0xc0, 0xe0, 0x59, 0x9b, 0xaa, 0x5f, 0x60,
            0xa9, 0xa5,
        ];
        assert_eq!(format_uuid(&b), "40eeab74-845d-74c0-e059-9baa5f60a9a5");
    }

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        // On a machine without libcuda this must be the "not available" error; on a GPU
        // machine it must load. Either way it must not panic, and must be stable.
        let a = driver().map(|d| d.devices().len());
        let b = driver().map(|d| d.devices().len());
        assert_eq!(a, b);
        if let Err(e) = a {
            assert!(e.0.starts_with("CUDA driver not available:"), "{e}");
        }
    }
}
