//! The copy kernel (`pf_copy`, compiled from `kernels.cu` into the embedded PTX) and the device
//! memory it works in: loading it into a worker's context, launching it over a range of
//! descriptors, and allocating and freeing the worker's device buffers (staging buffers, the
//! mapped path's descriptor buffer).
//!
//! Owns: the launch geometry (`BLOCK_THREADS` threads per block, at most `grid_cap` blocks).
//! Must never: launch over descriptors whose addresses are not device-visible and valid until
//! the batch synchronises (the caller's promise), or free a buffer a stream may still use.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{check, CudaError};
use crate::plan::Desc;

/// The copy kernel's PTX (generated from `kernels.cu`, see `examples/gen_ptx.rs`).
pub const KERNEL_PTX: &str = include_str!("../kernels.ptx");
const KERNEL_NAME: &std::ffi::CStr = c"pf_copy";
const BLOCK_THREADS: u32 = 256;

/// The copy kernel, loaded in a worker's context.
pub(super) struct Kernel {
    func: sys::CUfunction,
    /// The most thread blocks of a launch: `blocks_per_sm` × the device's multiprocessors.
    grid_cap: u32,
}

impl Kernel {
    /// Loads the kernel into the current context (once per worker; the module stays loaded for
    /// the process's lifetime). `grid_cap`: the most thread blocks of a launch.
    pub(super) fn load(grid_cap: u32) -> Result<Self, CudaError> {
        load_kernel().map(|func| Self { func, grid_cap })
    }

    /// Launches the kernel on `stream` over the `count` descriptors from index `first` of the
    /// array at device address `descs_dev` (one launch per `u32::MAX` descriptors).
    pub(super) fn launch(
        &self,
        descs_dev: u64,
        first: usize,
        count: usize,
        stream: sys::CUstream,
    ) -> Result<(), CudaError> {
        let f = self.func;
        let mut done = 0;
        while done < count {
            let n = (count - done).min(u32::MAX as usize);
            let mut ptr: u64 = descs_dev + ((first + done) * std::mem::size_of::<Desc>()) as u64;
            let mut n32 = n as u32;
            let grid = n32.min(self.grid_cap).max(1);
            let mut params: [*mut c_void; 2] =
                [(&mut ptr as *mut u64).cast(), (&mut n32 as *mut u32).cast()];
            check(
                // SAFETY: the kernel takes (const CopyDesc*, unsigned int), matching `params`; the
                // descriptors were uploaded on stream 0 (stream 1 waits for that) and every address
                // in them is device-visible and stays valid until the batch synchronises.
                unsafe {
                    sys::cuLaunchKernel(
                        f,
                        grid,
                        1,
                        1,
                        BLOCK_THREADS,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                },
                "cuLaunchKernel",
            )?;
            done += n;
        }
        Ok(())
    }
}

fn load_kernel() -> Result<sys::CUfunction, CudaError> {
    let ptx = std::ffi::CString::new(KERNEL_PTX).map_err(|_| CudaError("PTX has a NUL".into()))?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    check(
        // SAFETY: ptx is a NUL-terminated PTX image; the context is current. The module is kept for
        // the process's lifetime (one per worker).
        unsafe { sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) },
        "cuModuleLoadData",
    )?;
    let mut f: sys::CUfunction = std::ptr::null_mut();
    check(
        // SAFETY: out-pointer to a live local; the name is NUL-terminated.
        unsafe { sys::cuModuleGetFunction(&mut f, module, KERNEL_NAME.as_ptr()) },
        "cuModuleGetFunction",
    )?;
    Ok(f)
}

/// A device allocation owned by a worker.
pub(super) struct DevBuf {
    pub(super) ptr: u64,
    pub(super) len: usize,
}

/// `len` bytes of device memory in the current context.
pub(super) fn dev_alloc(len: usize) -> Result<DevBuf, CudaError> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a live local; the caller's thread has a current context.
    check(unsafe { sys::cuMemAlloc_v2(&mut p, len) }, "cuMemAlloc")?;
    Ok(DevBuf { ptr: p, len })
}

/// Frees `b` (made by [`dev_alloc`] in the current context; nothing may use it any more).
pub(super) fn dev_free(b: &DevBuf) {
    // SAFETY: b came from dev_alloc in the current context and nothing uses it any more.
    let _ = unsafe { sys::cuMemFree_v2(b.ptr) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_embedded() {
        assert!(KERNEL_PTX.contains(".entry pf_copy"));
    }
}
