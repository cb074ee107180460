//! The mapped path (`kernel_path = "mapped"`): the copy kernel reads or writes pinned host
//! memory directly, through the device pointers `cuMemHostGetDevicePointer` gives for the
//! landing tier's registrations; its descriptors are uploaded to a device buffer first.
//!
//! Owns: the per-registration device pointers and the descriptor upload buffers
//! ([`MappedPath`]). Must never: address host memory through a device pointer it did not get
//! from `cuMemHostGetDevicePointer`, or take a batch with a range that is not pinned yet
//! ([`Worker::all_mapped`]: the staged path takes those).

use std::ffi::c_void;

use cudarc::driver::sys;
use pegaflow_plugin::{CopyOp, Direction};

use super::Worker;
use crate::driver::{check, CudaError};
use crate::pin::PinState;
use crate::plan::{push_descs, Desc};
use crate::transport::kernel::{dev_alloc, dev_free, DevBuf};

/// What the mapped path keeps between batches.
pub(super) struct MappedPath {
    /// The device buffer the descriptors are uploaded to, and its pinned host side.
    pub(super) desc_dev: Option<DevBuf>,
    pub(super) desc_host: (*mut c_void, usize),
    /// Recorded on stream 0 after the upload; every other stream waits for it.
    pub(super) uploaded: sys::CUevent,
    /// The device pointer of each pinned chunk in this worker's context, looked up once.
    pub(super) bases: Vec<Option<u64>>,
}

impl MappedPath {
    /// Nothing uploaded yet; `chunks`: how many chunks the pinned set has.
    pub(super) fn new(chunks: usize) -> Self {
        Self {
            desc_dev: None,
            desc_host: (std::ptr::null_mut(), 0),
            uploaded: std::ptr::null_mut(),
            bases: vec![None; chunks],
        }
    }
}

impl Worker {
    /// Whether every byte of `ops`' host ranges lies in chunks this transport has pinned.
    pub(super) fn all_mapped(&self, ops: &[CopyOp]) -> bool {
        let Some(p) = &self.pins else { return false };
        ops.iter().filter(|o| o.len > 0).all(|o| {
            let mut h = o.host_addr;
            let end = o.host_addr + o.len;
            while h < end {
                let Some(i) = p.find(h, 1) else { return false };
                let c = &p.chunks()[i];
                if c.state() != PinState::Pinned {
                    return false;
                }
                h = c.addr + c.len;
            }
            true
        })
    }

    /// Copies `descs` into the device descriptor buffer (through a pinned host buffer), on
    /// stream 0; every other stream waits for it.
    fn upload(&mut self, descs: &[Desc]) -> Result<u64, CudaError> {
        let bytes = std::mem::size_of_val(descs);
        if self.mapped.desc_host.1 < bytes {
            if !self.mapped.desc_host.0.is_null() {
                // SAFETY: allocated by cuMemAllocHost below; the last batch using it synced.
                let _ = unsafe { sys::cuMemFreeHost(self.mapped.desc_host.0) };
                self.mapped.desc_host = (std::ptr::null_mut(), 0);
            }
            let cap = bytes.next_power_of_two().max(64 << 10);
            let mut p: *mut c_void = std::ptr::null_mut();
            check(
                // SAFETY: out-pointer to a live local; the context is current.
                unsafe { sys::cuMemAllocHost_v2(&mut p, cap) },
                "cuMemAllocHost",
            )?;
            self.mapped.desc_host = (p, cap);
        }
        if self.mapped.desc_dev.as_ref().is_none_or(|d| d.len < bytes) {
            if let Some(d) = self.mapped.desc_dev.take() {
                dev_free(&d);
            }
            self.mapped.desc_dev = Some(dev_alloc(bytes.next_power_of_two().max(64 << 10))?);
        }
        let dev = self.mapped.desc_dev.as_ref().map(|d| d.ptr).unwrap_or(0);
        // SAFETY: desc_host holds at least `bytes` bytes and no copy reads it (last batch
        // synced); Desc is plain old data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                descs.as_ptr().cast::<u8>(),
                self.mapped.desc_host.0.cast::<u8>(),
                bytes,
            )
        };
        check(
            // SAFETY: both buffers hold `bytes` bytes; stream 0 orders the later launches.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, self.mapped.desc_host.0, bytes, self.streams[0])
            },
            "cuMemcpyHtoDAsync (descriptors)",
        )?;
        check(
            // SAFETY: event and streams of this context.
            unsafe { sys::cuEventRecord(self.mapped.uploaded, self.streams[0]) },
            "cuEventRecord",
        )?;
        for s in &self.streams[1..] {
            check(
                // SAFETY: as above.
                unsafe { sys::cuStreamWaitEvent(*s, self.mapped.uploaded, 0) },
                "cuStreamWaitEvent",
            )?;
        }
        Ok(dev)
    }

    /// The device pointer of pinned chunk `i` in this worker's context (looked up once).
    fn mapped_base(&mut self, i: usize) -> Result<u64, CudaError> {
        if let Some(b) = self.mapped.bases[i] {
            return Ok(b);
        }
        let p = self
            .pins
            .as_ref()
            .ok_or_else(|| CudaError("nothing pinned".into()))?;
        let c = &p.chunks()[i];
        let mut d: sys::CUdeviceptr = 0;
        check(
            // SAFETY: out-pointer to a live local; the chunk is registered with DEVICEMAP.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, c.addr as *mut c_void, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        self.mapped.bases[i] = Some(d);
        Ok(d)
    }

    /// The mapped path: one kernel launch on stream 0 over descriptors that address host
    /// memory through each pinned chunk's device pointer. Returns the submissions (1).
    pub(super) fn mapped_copy(&mut self, ops: &[CopyOp]) -> Result<usize, CudaError> {
        let pins = self
            .pins
            .clone()
            .ok_or_else(|| CudaError("nothing pinned".into()))?;
        let mut descs = Vec::new();
        for o in ops.iter().filter(|o| o.len > 0) {
            // Split at pinned-chunk boundaries: each part has its own mapped base.
            let mut done = 0usize;
            while done < o.len {
                let h = o.host_addr + done;
                let i = pins
                    .find(h, 1)
                    .ok_or_else(|| CudaError(format!("host address {h:#x} is not pinned")))?;
                let c = &pins.chunks()[i];
                let n = (o.len - done).min(c.addr + c.len - h);
                let mh = self.mapped_base(i)? + (h - c.addr) as u64;
                let d = o.device_addr + done as u64;
                match self.dir {
                    Direction::ToHost => push_descs(&mut descs, d, mh, n as u64),
                    Direction::ToDevice => push_descs(&mut descs, mh, d, n as u64),
                }
                done += n;
            }
        }
        let r = self
            .upload(&descs)
            .and_then(|dev| self.launch(dev, 0, descs.len(), self.streams[0]));
        self.scratch.descs = descs;
        r.map(|()| 1)
    }
}
