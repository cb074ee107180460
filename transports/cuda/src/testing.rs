//! Helpers for this crate's GPU tests and bench (and for integration tests elsewhere): a host
//! arena that poses as a landing tier, and a plain device allocation.
//!
//! Owns: an anonymous host mapping exposed as [`HostRegion`]s so the `cuda` transport pins
//! it exactly as it pins the DRAM pool, and [`DeviceBuffer`], a `cuMemAlloc`
//! allocation with blocking upload/download.
//!
//! Must never: be used by the server itself (it allocates nothing through the tier API and
//! its device helpers block the calling thread on CUDA calls).

use std::ffi::c_void;

use cudarc::driver::sys;
use pegaflow_plugin::HostRegion;

use crate::driver::{check, driver, CudaError};

/// An anonymous, page-aligned host mapping posing as a landing pool's memory (it hands out no
/// buffers; it only publishes its range for pinning).
#[derive(Debug)]
pub struct HostArena {
    addr: usize,
    len: usize,
}

impl HostArena {
    /// Maps `len` bytes (lazily committed, zero-filled).
    ///
    /// Errors: the `mmap` error.
    pub fn new(len: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            addr: p as usize,
            len,
        })
    }

    /// The first byte's address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The arena as bytes.
    ///
    /// # Safety
    /// No copy may be writing into the arena while the slice is alive.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live for &self; the caller excludes concurrent writers.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The arena as mutable bytes.
    ///
    /// # Safety
    /// No copy may be touching the arena while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the mapping is live for &self; the caller excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in new() and is no longer used (a transport pinning
        // it holds an Arc to this arena until it has unpinned).
        unsafe { libc::munmap(self.addr as *mut c_void, self.len.max(1)) };
    }
}

impl HostArena {
    /// The arena as the host memory a runtime installs into a transport
    /// ([`pegaflow_plugin::Transport::install_host_memory`]); the region keeps it mapped.
    pub fn regions(self: &std::sync::Arc<Self>) -> Vec<HostRegion> {
        vec![HostRegion {
            addr: self.addr,
            len: self.len,
            owner: self.clone(),
        }]
    }
}

/// A `cuMemAlloc` allocation on one device. Every method binds the device's primary context on
/// the calling thread and blocks.
#[derive(Debug)]
pub struct DeviceBuffer {
    ordinal: i32,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on device `ordinal`.
    ///
    /// Errors: no driver, or the allocation fails.
    pub fn new(ordinal: i32, len: usize) -> Result<Self, CudaError> {
        driver()?.bind(ordinal)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a live local; the context is current.
        check(unsafe { sys::cuMemAlloc_v2(&mut p, len) }, "cuMemAlloc")?;
        Ok(Self {
            ordinal,
            ptr: p,
            len,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to byte `off`.
    ///
    /// Errors: out of range, or the copy fails.
    pub fn upload(&self, off: usize, src: &[u8]) -> Result<(), CudaError> {
        self.range(off, src.len())?;
        driver()?.bind(self.ordinal)?;
        // SAFETY: the range was checked; src is a live slice.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr + off as u64, src.as_ptr().cast(), src.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Copies bytes from `off` into `dst`.
    ///
    /// Errors: out of range, or the copy fails.
    pub fn download(&self, off: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.range(off, dst.len())?;
        driver()?.bind(self.ordinal)?;
        // SAFETY: the range was checked; dst is a live slice.
        check(
            unsafe {
                sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + off as u64, dst.len())
            },
            "cuMemcpyDtoH",
        )
    }

    /// Sets every byte to `v`.
    ///
    /// Errors: the memset fails.
    pub fn fill(&self, v: u8) -> Result<(), CudaError> {
        driver()?.bind(self.ordinal)?;
        // SAFETY: the whole allocation.
        check(
            unsafe { sys::cuMemsetD8_v2(self.ptr, v, self.len) },
            "cuMemsetD8",
        )
    }

    /// The CUDA IPC handle of this allocation (`cuIpcGetMemHandle`), for another process.
    ///
    /// Errors: the driver refuses.
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        driver()?.bind(self.ordinal)?;
        // SAFETY: CUipcMemHandle is 64 plain bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        check(
            // SAFETY: out-pointer to a live local; ptr is the base of a cuMemAlloc allocation.
            unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        let mut out = [0u8; 64];
        for (o, b) in out.iter_mut().zip(h.reserved) {
            *o = b as u8;
        }
        Ok(out)
    }

    fn range(&self, off: usize, len: usize) -> Result<(), CudaError> {
        if off.checked_add(len).is_some_and(|e| e <= self.len) {
            Ok(())
        } else {
            Err(CudaError(format!(
                "{off}+{len} outside a {}-byte buffer",
                self.len
            )))
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(d) = driver() {
            if d.bind(self.ordinal).is_ok() {
                // SAFETY: allocated in new(); the owner guarantees no copy still uses it.
                let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
            }
        }
    }
}
