//! Exportable CUDA VMM device memory (cargo feature `cuda`): the KV arena a native engine
//! registers through the server's `cuda-vmm` registrar (`native-clients.md` §1.1).
//!
//! [`VmmAllocation::new`] creates pinned device memory with `cuMemCreate`, requesting a POSIX
//! file descriptor handle type (and GPUDirect RDMA capability only where the device supports
//! it with VMM), rounds the size up to the minimum granularity, reserves and maps a virtual
//! range, grants the device read-write access, zeroes it, and exports the fd. The fd is what
//! [`crate::native::Connected::register`] sends on the side channel; the server imports its own
//! reference, so the allocation's memory outlives either side's handle alone.
//!
//! libcuda is loaded at run time by [`crate::cuda_driver`]: without a driver every
//! constructor fails with a [`VmmError`] starting "CUDA driver not available:"; nothing
//! panics. Every method binds the device's primary context on the calling thread and blocks
//! until its work is done, so call them from a thread that may block (not from an async
//! executor thread in latency-sensitive code).

use std::ffi::{c_int, c_void};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys;
use pegaflow_proto as pb;

use crate::cuda_driver::{self, DriverUnavailable};

/// A CUDA failure, with the driver call and error name where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct VmmError(pub String);

impl From<DriverUnavailable> for VmmError {
    fn from(e: DriverUnavailable) -> Self {
        VmmError(e.to_string())
    }
}

pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<(), VmmError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(VmmError(format!("{what} failed: {r:?}")))
    }
}

/// Every driver symbol this module calls besides `cuInit` (which [`cuda_driver::init`]
/// checks and calls); all must resolve before any is called, because cudarc's loader panics
/// on a missing one.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemsetD8_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuStreamSynchronize",
];

static DRIVER: OnceLock<Result<(), VmmError>> = OnceLock::new();

/// Checks once per process (then caches the answer) that libcuda loads, exports every symbol
/// this module calls, and initialises (through the shared [`cuda_driver::init`]).
///
/// Errors: [`VmmError`] "CUDA driver not available: ..." otherwise.
pub fn driver_available() -> Result<(), VmmError> {
    DRIVER
        .get_or_init(|| {
            cuda_driver::init(REQUIRED_SYMBOLS, "driver too old for CUDA VMM?").map_err(Into::into)
        })
        .clone()
}

fn attribute(attr: sys::CUdevice_attribute, dev: sys::CUdevice) -> Result<i32, VmmError> {
    let mut v = 0;
    check(
        // SAFETY: out-pointer to a live local; dev came from cuDeviceGet.
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

pub(crate) fn set_current(ctx: sys::CUcontext) -> Result<(), VmmError> {
    // SAFETY: ctx is a retained primary context, alive while the allocation holds it.
    check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
}

pub(crate) fn sync() -> Result<(), VmmError> {
    // SAFETY: the null stream of the current context; waits for the work issued above.
    check(
        unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) },
        "cuStreamSynchronize",
    )
}

/// The device of CUDA ordinal `ordinal` (the caller initialised the driver).
///
/// Errors: [`VmmError`] for an ordinal this process does not see, or a failing driver call.
pub(crate) fn device_of(ordinal: i32) -> Result<sys::CUdevice, VmmError> {
    let mut count = 0;
    check(
        // SAFETY: out-pointer to a live local.
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )?;
    if ordinal < 0 || ordinal >= count {
        return Err(VmmError(format!(
            "no CUDA device with ordinal {ordinal} (this process sees {count})"
        )));
    }
    let mut device: sys::CUdevice = 0;
    check(
        // SAFETY: out-pointer to a live local; 0 <= ordinal < count.
        unsafe { sys::cuDeviceGet(&mut device, ordinal) },
        "cuDeviceGet",
    )?;
    Ok(device)
}

/// Device memory this process allocated: `size` bytes at `ptr` in the retained primary
/// context `ctx`. The blocking, bounds-checked copies and fills both allocation kinds
/// (VMM, IPC) offer.
#[derive(Clone, Copy)]
pub(crate) struct DeviceSpan {
    pub(crate) ctx: sys::CUcontext,
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) size: usize,
}

impl DeviceSpan {
    /// The device address of byte `off`, once `off..off + len` is checked to lie inside and
    /// the context is bound on this thread.
    fn at(&self, off: usize, len: usize) -> Result<u64, VmmError> {
        match off.checked_add(len) {
            Some(end) if end <= self.size => {
                set_current(self.ctx)?;
                Ok(self.ptr + off as u64)
            }
            _ => Err(VmmError(format!(
                "bytes {off}..+{len} lie outside the {}-byte allocation",
                self.size
            ))),
        }
    }

    /// Copies `src` to byte `off` (`cuMemcpyHtoD`) and waits until it has landed.
    pub(crate) fn upload(&self, off: usize, src: &[u8]) -> Result<(), VmmError> {
        let dst = self.at(off, src.len())?;
        check(
            // SAFETY: dst..dst+len is inside the allocation; src is a live slice of len bytes.
            unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) },
            "cuMemcpyHtoD",
        )?;
        sync()
    }

    /// Copies bytes from byte `off` into `dst` (`cuMemcpyDtoH`).
    pub(crate) fn download(&self, off: usize, dst: &mut [u8]) -> Result<(), VmmError> {
        let src = self.at(off, dst.len())?;
        check(
            // SAFETY: src..src+len is inside the allocation; dst is a live slice of len bytes.
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) },
            "cuMemcpyDtoH",
        )?;
        sync()
    }

    /// Sets `len` bytes from byte `off` to `value` (`cuMemsetD8`) and waits until done.
    pub(crate) fn fill(&self, off: usize, len: usize, value: u8) -> Result<(), VmmError> {
        let dst = self.at(off, len)?;
        check(
            // SAFETY: dst..dst+len is inside the allocation.
            unsafe { sys::cuMemsetD8_v2(dst, value, len) },
            "cuMemsetD8",
        )?;
        sync()
    }
}

/// What [`VmmAllocation::new`] has built so far; dropping it undoes exactly that, in reverse
/// order (unmap, free the range, release the handle, release the primary context).
struct Partial {
    device: sys::CUdevice,
    ctx: Option<sys::CUcontext>,
    handle: Option<sys::CUmemGenericAllocationHandle>,
    va: Option<(sys::CUdeviceptr, usize)>,
    mapped: bool,
}

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx {
            let _ = set_current(ctx);
        }
        if let Some((ptr, size)) = self.va {
            if self.mapped {
                // SAFETY: ptr..ptr+size was mapped by cuMemMap below and has no user.
                let _ = unsafe { sys::cuMemUnmap(ptr, size) };
            }
            // SAFETY: the range was reserved by cuMemAddressReserve below and is unmapped.
            let _ = unsafe { sys::cuMemAddressFree(ptr, size) };
        }
        if let Some(h) = self.handle {
            // SAFETY: h came from cuMemCreate below and is no longer mapped.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        if self.ctx.is_some() {
            // SAFETY: balances the cuDevicePrimaryCtxRetain below.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        }
    }
}

/// Pinned device memory from the CUDA VMM API, mapped in this process and exported as a POSIX
/// file descriptor. Dropping it unmaps, frees the virtual range, releases the allocation
/// handle and then closes the fd (the server's imported reference, if any, keeps the physical
/// memory alive until the server releases it).
pub struct VmmAllocation {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    size: usize,
    requested: usize,
    granularity: usize,
    gdr: bool,
    fd: OwnedFd,
}

// SAFETY: the raw fields are opaque driver handles and a device address, valid on any thread
// once the primary context is bound there (every method binds it); no Rust memory is shared.
unsafe impl Send for VmmAllocation {}
// SAFETY: as above; the methods take &self and only issue driver calls, which are thread-safe.
unsafe impl Sync for VmmAllocation {}

impl std::fmt::Debug for VmmAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmAllocation")
            .field("ordinal", &self.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("requested", &self.requested)
            .field("gpu_direct_rdma", &self.gdr)
            .finish()
    }
}

impl VmmAllocation {
    /// Allocates at least `bytes` bytes (> 0) of device memory on CUDA device `ordinal`,
    /// rounded up to the device's minimum VMM granularity (2 MiB on current GPUs), zeroed,
    /// and exports it as a POSIX fd. Binds the device's primary context on the calling thread.
    ///
    /// Errors: [`VmmError`] when `bytes` is 0, the driver is missing ("CUDA driver not
    /// available: ..."), the ordinal is unknown, the device lacks VMM or POSIX-fd export
    /// support, or any driver call fails (everything done so far is undone).
    pub fn new(ordinal: i32, bytes: usize) -> Result<Self, VmmError> {
        if bytes == 0 {
            return Err(VmmError("a VMM allocation needs more than 0 bytes".into()));
        }
        driver_available()?;
        let device = device_of(ordinal)?;
        use sys::CUdevice_attribute as A;
        if attribute(
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            device,
        )? == 0
        {
            return Err(VmmError(format!(
                "CUDA device {ordinal} does not support virtual memory management"
            )));
        }
        if attribute(
            A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            device,
        )? == 0
        {
            return Err(VmmError(format!(
                "CUDA device {ordinal} cannot export allocations as POSIX file descriptors"
            )));
        }
        // GeForce parts reject the flag (CUDA_ERROR_INVALID_DEVICE): ask only where supported.
        let gdr = attribute(
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            device,
        )? != 0;

        let mut p = Partial {
            device,
            ctx: None,
            handle: None,
            va: None,
            mapped: false,
        };
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer to a live local; device came from cuDeviceGet.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        p.ctx = Some(ctx);
        set_current(ctx)?;

        // SAFETY: CUmemAllocationProp is a plain C struct; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        prop.allocFlags.gpuDirectRDMACapable = u8::from(gdr);
        let mut granularity = 0usize;
        check(
            // SAFETY: out-pointer to a live local; prop is fully initialised.
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        let granularity = granularity.max(1);
        let size = bytes
            .div_ceil(granularity)
            .checked_mul(granularity)
            .ok_or_else(|| VmmError(format!("{bytes} bytes cannot be rounded up")))?;

        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        check(
            // SAFETY: out-pointer to a live local; size is a multiple of the granularity.
            unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) },
            "cuMemCreate",
        )?;
        p.handle = Some(handle);
        let mut ptr: sys::CUdeviceptr = 0;
        check(
            // SAFETY: out-pointer to a live local; default alignment, no fixed address.
            unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) },
            "cuMemAddressReserve",
        )?;
        p.va = Some((ptr, size));
        check(
            // SAFETY: the range and the allocation are both `size` bytes, just created.
            unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) },
            "cuMemMap",
        )?;
        p.mapped = true;
        // SAFETY: CUmemAccessDesc is a plain C struct; every field is set below.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        check(
            // SAFETY: ptr..ptr+size is mapped; one descriptor is passed.
            unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) },
            "cuMemSetAccess",
        )?;
        check(
            // SAFETY: ptr..ptr+size is mapped read-write on this device.
            unsafe { sys::cuMemsetD8_v2(ptr, 0, size) },
            "cuMemsetD8",
        )?;
        sync()?;
        let mut raw: c_int = -1;
        check(
            // SAFETY: for POSIX fds the shareable handle is an int written through the pointer.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut raw as *mut c_int).cast::<c_void>(),
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        if raw < 0 {
            return Err(VmmError(format!(
                "cuMemExportToShareableHandle returned fd {raw}"
            )));
        }
        // SAFETY: the driver returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Keep the descriptor out of exec'd children; a failure here is harmless.
        let _ = nix::fcntl::fcntl(
            fd.as_fd(),
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        );
        // Success: the allocation owns everything from here on.
        p.ctx = None;
        p.handle = None;
        p.va = None;
        drop(p);
        Ok(Self {
            ordinal,
            device,
            ctx,
            handle,
            ptr,
            size,
            requested: bytes,
            granularity,
            gdr,
            fd,
        })
    }

    /// The CUDA ordinal of the device holding the memory.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device address of byte 0 (a `CUdeviceptr`, valid in this process).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's size in bytes: the request rounded up to [`Self::granularity`].
    pub fn len(&self) -> usize {
        self.size
    }

    /// Never true: construction rejects 0 bytes.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The size asked for, in bytes (≤ [`Self::len`]).
    pub fn requested_bytes(&self) -> usize {
        self.requested
    }

    /// The device's minimum VMM allocation granularity, in bytes.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Whether the allocation was created GPUDirect-RDMA capable (the device supports it with
    /// VMM).
    pub fn gpu_direct_rdma_capable(&self) -> bool {
        self.gdr
    }

    /// The exported descriptor (sent on the side channel; the caller keeps ownership).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn span(&self) -> DeviceSpan {
        DeviceSpan {
            ctx: self.ctx,
            ptr: self.ptr,
            size: self.size,
        }
    }

    /// Copies `src` to byte `off` of the allocation (`cuMemcpyHtoD`) and waits until it has
    /// landed.
    ///
    /// Errors: [`VmmError`] when the range leaves the allocation or the copy fails.
    pub fn upload(&self, off: usize, src: &[u8]) -> Result<(), VmmError> {
        self.span().upload(off, src)
    }

    /// Copies bytes from byte `off` of the allocation into `dst` (`cuMemcpyDtoH`), after
    /// every earlier copy or fill of this thread's context has finished.
    ///
    /// Errors: [`VmmError`] when the range leaves the allocation or the copy fails.
    pub fn download(&self, off: usize, dst: &mut [u8]) -> Result<(), VmmError> {
        self.span().download(off, dst)
    }

    /// Sets `len` bytes from byte `off` to `value` (`cuMemsetD8`) and waits until done.
    ///
    /// Errors: [`VmmError`] when the range leaves the allocation or the memset fails.
    pub fn fill_range(&self, off: usize, len: usize, value: u8) -> Result<(), VmmError> {
        self.span().fill(off, len, value)
    }

    /// Sets every byte of the allocation to `value` and waits until done.
    ///
    /// Errors: [`VmmError`] when the memset fails.
    pub fn fill(&self, value: u8) -> Result<(), VmmError> {
        self.fill_range(0, self.size, value)
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        let _ = set_current(self.ctx);
        // Work issued through the methods has already completed (each one synchronises).
        // SAFETY: the range was mapped in new() and nothing in this process uses it any more.
        let r = unsafe { sys::cuMemUnmap(self.ptr, self.size) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!(error = ?r, "cuMemUnmap of a VMM allocation failed");
        }
        // SAFETY: the range was reserved in new() and is unmapped now.
        let r = unsafe { sys::cuMemAddressFree(self.ptr, self.size) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!(error = ?r, "cuMemAddressFree of a VMM allocation failed");
        }
        // SAFETY: the handle came from cuMemCreate in new(); the server holds its own.
        let r = unsafe { sys::cuMemRelease(self.handle) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!(error = ?r, "cuMemRelease of a VMM allocation failed");
        }
        // SAFETY: balances the retain in new().
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        // The fd field closes after this body.
    }
}

impl crate::native::ExportableMemory for VmmAllocation {
    fn export_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
    fn alloc_size(&self) -> u64 {
        self.size as u64
    }
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::CudaVmm
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::ExportableMemory;

    #[test]
    fn zero_bytes_is_refused_before_the_driver() {
        let e = VmmAllocation::new(0, 0).unwrap_err();
        assert!(e.0.contains("0 bytes"), "{e}");
    }

    #[test]
    fn without_a_driver_allocation_fails_cleanly() {
        // Stable and panic-free either way; on a machine without libcuda it is the clear error.
        let a = driver_available();
        assert_eq!(a, driver_available());
        match a {
            Err(e) => {
                assert!(e.0.starts_with("CUDA driver not available:"), "{e}");
                let e = VmmAllocation::new(0, 4096).unwrap_err();
                assert!(e.0.starts_with("CUDA driver not available:"), "{e}");
            }
            Ok(()) => {
                // A GPU machine: an unknown ordinal is an error, not a panic.
                let e = VmmAllocation::new(i32::MAX, 4096).unwrap_err();
                assert!(e.0.contains("no CUDA device"), "{e}");
                if std::env::var("PEGAFLOW_GPU_TESTS").as_deref() == Ok("1") {
                    let a = VmmAllocation::new(0, 3).unwrap();
                    assert!(a.len() >= a.granularity());
                    assert_eq!(a.len() / a.granularity() * a.granularity(), a.len());
                    assert_eq!(a.alloc_size(), a.len() as u64);
                    assert_eq!(a.memory_kind(), pb::MemoryKind::CudaVmm);
                    let mut b = vec![1u8; 16];
                    a.download(0, &mut b).unwrap();
                    assert_eq!(b, vec![0u8; 16], "fresh memory reads as zeros");
                }
            }
        }
    }
}
