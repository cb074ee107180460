//! IPC-exportable CUDA device memory (cargo feature `cuda`): a plain `cuMemAlloc` arena and
//! its 64-byte CUDA IPC handle, what a native registration v2 of memory kind `CUDA_IPC`
//! hands to the server's `cuda-ipc-handle` registrar (`native-clients.md` §2: OpenInfer's
//! GLM5.2 arenas are each their own `cuMemAlloc`).
//!
//! [`IpcAllocation::new`] binds the device's primary context, allocates with `cuMemAlloc`
//! (never the stream-ordered allocator: `cuIpcGetMemHandle` refuses those), zeroes the memory,
//! reads the allocation's extent back with `cuMemGetAddressRange` (the size the server will
//! confirm) and exports the handle with `cuIpcGetMemHandle`. Dropping it frees the memory:
//! keep it alive until the instance using it is unregistered.
//!
//! A CUDA IPC handle cannot be opened by the process that exported it: the server must be
//! another process. Without a driver every constructor fails with a [`VmmError`] starting
//! "CUDA driver not available:". Every method blocks until its work is done.

use std::sync::OnceLock;

use cudarc::driver::sys;
use pegaflow_proto as pb;

use crate::cuda_driver;
use crate::vmm::{check, device_of, set_current, sync, DeviceSpan, VmmError};

/// Every driver symbol this module calls besides `cuInit`.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuMemsetD8_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuStreamSynchronize",
];

static DRIVER: OnceLock<Result<(), VmmError>> = OnceLock::new();

fn driver_available() -> Result<(), VmmError> {
    DRIVER
        .get_or_init(|| {
            cuda_driver::init(REQUIRED_SYMBOLS, "driver too old for CUDA IPC?").map_err(Into::into)
        })
        .clone()
}

/// `cuMemAlloc` device memory with its CUDA IPC handle. Dropping it frees the memory.
pub struct IpcAllocation {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    ptr: sys::CUdeviceptr,
    size: usize,
    handle: [u8; pb::CUDA_IPC_HANDLE_BYTES],
}

// SAFETY: the raw fields are opaque driver handles and a device address, valid on any thread
// once the primary context is bound there (every method binds it); no Rust memory is shared.
unsafe impl Send for IpcAllocation {}
// SAFETY: as above; the methods take &self and only issue thread-safe driver calls.
unsafe impl Sync for IpcAllocation {}

impl std::fmt::Debug for IpcAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcAllocation")
            .field("ordinal", &self.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .finish()
    }
}

impl IpcAllocation {
    /// Allocates `bytes` (> 0) of zeroed device memory on CUDA device `ordinal` with
    /// `cuMemAlloc` and exports its IPC handle. Binds the device's primary context on the
    /// calling thread.
    ///
    /// Errors: [`VmmError`] when `bytes` is 0, the driver is missing, the ordinal is unknown,
    /// or a driver call fails (the memory is freed again).
    pub fn new(ordinal: i32, bytes: usize) -> Result<Self, VmmError> {
        if bytes == 0 {
            return Err(VmmError("an IPC allocation needs more than 0 bytes".into()));
        }
        driver_available()?;
        let device = device_of(ordinal)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: out-pointer to a live local; device came from cuDeviceGet.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut a = Self {
            ordinal,
            device,
            ctx,
            ptr: 0,
            size: 0,
            handle: [0; pb::CUDA_IPC_HANDLE_BYTES],
        };
        // From here `a`'s Drop frees whatever was allocated and releases the context.
        set_current(a.ctx)?;
        check(
            // SAFETY: out-pointer to a live field; the context is current.
            unsafe { sys::cuMemAlloc_v2(&mut a.ptr, bytes) },
            "cuMemAlloc",
        )?;
        a.size = bytes;
        let mut base: sys::CUdeviceptr = 0;
        let mut extent = 0usize;
        check(
            // SAFETY: out-pointers to live locals; ptr was just allocated.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut extent, a.ptr) },
            "cuMemGetAddressRange",
        )?;
        if base != a.ptr || extent < bytes {
            return Err(VmmError(format!(
                "cuMemGetAddressRange reports {extent} bytes at {base:#x} for a {bytes}-byte \
                 allocation at {:#x}",
                a.ptr
            )));
        }
        a.size = extent;
        check(
            // SAFETY: ptr..ptr+size is this allocation.
            unsafe { sys::cuMemsetD8_v2(a.ptr, 0, a.size) },
            "cuMemsetD8",
        )?;
        sync()?;
        // SAFETY: CUipcMemHandle is 64 plain bytes; the driver fills it.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: out-pointer to a live local; ptr is the base of a cuMemAlloc allocation.
            unsafe { sys::cuIpcGetMemHandle(&mut h, a.ptr) },
            "cuIpcGetMemHandle",
        )?;
        for (d, s) in a.handle.iter_mut().zip(h.reserved.iter()) {
            *d = *s as u8;
        }
        Ok(a)
    }

    fn span(&self) -> DeviceSpan {
        DeviceSpan {
            ctx: self.ctx,
            ptr: self.ptr,
            size: self.size,
        }
    }

    /// The CUDA ordinal of the device holding the memory.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device address of byte 0 (valid in this process).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's size in bytes, as `cuMemGetAddressRange` reports it.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Never true: construction rejects 0 bytes.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The raw `CUipcMemHandle`.
    pub fn handle(&self) -> [u8; pb::CUDA_IPC_HANDLE_BYTES] {
        self.handle
    }

    /// Copies `src` to byte `off` (`cuMemcpyHtoD`) and waits until it has landed.
    ///
    /// Errors: [`VmmError`] when the range leaves the allocation or the copy fails.
    pub fn upload(&self, off: usize, src: &[u8]) -> Result<(), VmmError> {
        self.span().upload(off, src)
    }

    /// Copies bytes from byte `off` into `dst` (`cuMemcpyDtoH`).
    ///
    /// Errors: [`VmmError`] when the range leaves the allocation or the copy fails.
    pub fn download(&self, off: usize, dst: &mut [u8]) -> Result<(), VmmError> {
        self.span().download(off, dst)
    }

    /// Sets every byte to `value` and waits until done.
    ///
    /// Errors: [`VmmError`] when the memset fails.
    pub fn fill(&self, value: u8) -> Result<(), VmmError> {
        self.span().fill(0, self.size, value)
    }
}

impl Drop for IpcAllocation {
    fn drop(&mut self) {
        let _ = set_current(self.ctx);
        if self.ptr != 0 {
            // SAFETY: ptr came from cuMemAlloc in new(); this process no longer uses it (a
            // server that still has the handle open keeps its own mapping until it closes it).
            let r = unsafe { sys::cuMemFree_v2(self.ptr) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::error!(error = ?r, "cuMemFree of an IPC allocation failed");
            }
        }
        // SAFETY: balances the retain in new().
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl crate::registration::NativeAllocation for IpcAllocation {
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::CudaIpc
    }
    fn size_bytes(&self) -> u64 {
        self.size as u64
    }
    fn ipc_handle(&self) -> Option<[u8; pb::CUDA_IPC_HANDLE_BYTES]> {
        Some(self.handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_bytes_and_no_driver_fail_cleanly() {
        let e = IpcAllocation::new(0, 0).unwrap_err();
        assert!(e.0.contains("0 bytes"), "{e}");
        if let Err(d) = driver_available() {
            assert!(d.0.starts_with("CUDA driver not available:"), "{d}");
            let e = IpcAllocation::new(0, 4096).unwrap_err();
            assert!(e.0.starts_with("CUDA driver not available:"), "{e}");
        }
    }
}
